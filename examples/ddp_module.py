"""The PyTorch DDP tutorial's training program, with an ``nn.Module`` and ``fs.shard_map`` instead of DDP.

PyTorch's multi-GPU DDP tutorial trains a small model with ``torch.optim.SGD`` over a
dataset read through a ``DataLoader`` with a ``DistributedSampler``: each rank reads only its
own rows, wraps the model in ``DistributedDataParallel``, and calls ``loss.backward()`` and
``optimizer.step()``. This is that program, with three changes:

* no ``DistributedDataParallel``: the loss is a function run by ``fs.shard_map`` whose batch is
  split over the "dp" axis, and ``fs.pmean`` averages it over dp. The parameters are replicated,
  so fshard all-reduces their gradients where they meet dp-split data, as DDP does;
* each rank's batch is wrapped as ``fs.Sharded.from_local(x, mesh, "(dp b) d")``: the block of a
  global batch of ``batch * dp`` rows that this rank loaded itself;
* every rank builds the model from the same seed (DDP would broadcast rank 0's parameters).

The module's parameters reach the loss in one of two ways. By default they are an input of the
call, ``dict(model.named_parameters())``, used with ``torch.func.functional_call``: their
gradient all-reduces are then bucketed (one collective for all of them, per step). With
``--closure`` the loss calls ``model(x)``, capturing the parameters by closure: the gradients
are the same, but each parameter gets its own all-reduce (compiled by inductor, both forms
bucket the gradients' all-reduces).

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/ddp_module.py
    torchrun --nproc-per-node 4 examples/ddp_module.py
    python -m fshard.run -n 2 examples/ddp_module.py --closure
    python -m fshard.run -n 4 examples/ddp_module.py --compile   # the loss and its backward compiled

The script checks every loss and the final parameters against the same program in one process
(the same model, optimizer and global batches: each step's batches of all the ranks together),
and the collectives of every step; it exits non-zero if anything disagrees.
"""

import argparse
import contextlib
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import fshard as fs


def check(name, got, want, tol=1e-5):
    """Exit non-zero, naming ``name``, if ``got`` is not close to the reference ``want``."""
    if not torch.allclose(got, want, rtol=tol, atol=tol):
        err = (got - want).abs().max().item()
        sys.exit(
            f"rank {dist.get_rank()}: {name} disagrees with the single-process reference "
            f"(max abs error {err:.3g})"
        )


def load_train_objs(args):
    """The dataset, the model and its optimizer; the model is the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(args.seed)
    dataset = TensorDataset(torch.rand(args.size, 20, generator=gen), torch.rand(args.size, 1, generator=gen))
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    return dataset, model, optimizer


def prepare_dataloader(dataset, batch_size, replicas, rank, seed):
    """This rank's rows of every epoch, in batches (DistributedSampler: rows rank, rank + replicas, ...)."""
    sampler = DistributedSampler(
        dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)


class Trainer:
    """The tutorial's Trainer: one ``_run_batch`` per batch, ``set_epoch`` per epoch."""

    def __init__(self, model, train_data, optimizer, mesh, closure, backend=None):
        self.model, self.train_data, self.optimizer, self.mesh = model, train_data, optimizer, mesh
        if closure:  # the parameters are captured by the closure: one all-reduce each

            def loss_fn(x, y):
                return fs.pmean(F.mse_loss(model(x), y), "dp")

            self.loss_fn = fs.shard_map(loss_fn, mesh=mesh, in_specs=("(dp b) d", "(dp b) o"), out_specs="")
            self.inputs = lambda x, y: (x, y)
        else:  # the parameters are an input: their all-reduces travel in one bucket

            def loss_fn(params, x, y):
                return fs.pmean(F.mse_loss(functional_call(model, params, (x,)), y), "dp")

            self.loss_fn = fs.shard_map(
                loss_fn, mesh=mesh, in_specs=("...", "(dp b) d", "(dp b) o"), out_specs=""
            )
            self.inputs = lambda x, y: (dict(model.named_parameters()), x, y)
        if backend:  # the loss compiled (traced on the first call), its backward with it
            self.loss_fn = fs.compile(self.loss_fn, backend=backend)
        self.counting = backend in (None, "inductor")  # fs.count_collectives counts inductor's graphs only
        n = len(list(model.parameters()))
        per_step = 1 + (n if closure else 1)  # the loss, then the gradients
        if backend:  # inductor buckets the compiled backward's all-reduces, closure or not
            per_step = 2
        self.expected = {("all_reduce", ("dp",)): per_step} if mesh.size > 1 else {}
        self.losses = []

    def _run_batch(self, source, targets):
        x = fs.Sharded.from_local(source, self.mesh, "(dp b) d")  # this rank's rows of the global batch
        y = fs.Sharded.from_local(targets, self.mesh, "(dp b) o")
        self.optimizer.zero_grad()
        with fs.count_collectives() if self.counting else contextlib.nullcontext() as counts:
            loss = self.loss_fn(*self.inputs(x, y))  # the mean loss over the global batch
            loss.backward()  # the gradients of the parameters, summed over dp: the same on every rank
        self.optimizer.step()
        if self.counting and counts.by_kind() != self.expected:
            sys.exit(f"rank {dist.get_rank()}: expected collectives {self.expected} per step, got {counts}")
        self.losses.append(loss.detach())

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def train(self, epochs):
        for epoch in range(epochs):
            self._run_epoch(epoch)
            if dist.get_rank() == 0:
                print(f"epoch {epoch}: {len(self.train_data)} steps, last loss {self.losses[-1].item():.5f}")


def reference(args, dp):
    """The same program in one process: each step's global batch is every rank's batch, in rank order."""
    dataset, model, optimizer = load_train_objs(args)
    losses = []
    for epoch in range(args.epochs):
        loaders = [prepare_dataloader(dataset, args.batch, dp, r, args.seed) for r in range(dp)]
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
        for per_rank in zip(*loaders):
            x = torch.cat([b[0] for b in per_rank])
            y = torch.cat([b[1] for b in per_rank])
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
    return losses, model


def main():
    parser = argparse.ArgumentParser(description="the DDP tutorial's program on fshard")
    parser.add_argument("--size", type=int, default=512, help="rows in the dataset")
    parser.add_argument("--batch", type=int, default=16, help="rows per rank and step")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--closure", action="store_true", help="capture the parameters by closure")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="compile the step with fs.compile (inductor, or the backend named: aot_eager, ...)",
    )
    args = parser.parse_args()

    fs.init()
    mesh = fs.Mesh(dp=dist.get_world_size())
    dataset, model, optimizer = load_train_objs(args)
    train_data = prepare_dataloader(
        dataset, args.batch, mesh.axis_size("dp"), mesh.axis_index("dp"), args.seed
    )
    trainer = Trainer(model, train_data, optimizer, mesh, args.closure, args.compile)
    trainer.train(args.epochs)

    ref_losses, ref_model = reference(args, mesh.axis_size("dp"))
    if len(ref_losses) != len(trainer.losses):
        sys.exit(f"rank {dist.get_rank()}: {len(trainer.losses)} steps, the reference took {len(ref_losses)}")
    for i, (got, want) in enumerate(zip(trainer.losses, ref_losses)):
        check(f"loss at step {i}", got, want)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        check(f"{name} after {len(ref_losses)} steps", p.detach(), q.detach())

    if dist.get_rank() == 0:
        form = "parameters captured by closure" if args.closure else "parameters as an input"
        print(
            f"ddp_module: OK (dp={mesh.size}, {form}) {len(ref_losses)} losses and the parameters match "
            f"the single-process reference"
        )


if __name__ == "__main__":
    main()
