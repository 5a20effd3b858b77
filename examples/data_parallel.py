"""Data parallel training of an MLP: the whole step is one per-shard function.

The batch is split over the "dp" axis ("(dp b) d"); the parameters are replicated
("..."). Inside the step each rank computes its local loss and ``fs.pmean`` averages
it over dp. Nothing else is written by hand: where a replicated parameter meets
dp-split data shard_map marks it as varying (an implicit ``pvary``), and the
transpose of that is an all-reduce of that parameter's gradient; the gradients of all
parameters travel together in one flat bucket, as DDP does. The gradients come out replicated, so the update needs no
communication and the new parameters may be returned with the replicated spec.

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/data_parallel.py
    torchrun --nproc-per-node 4 examples/data_parallel.py
    python -m fshard.run -n 4 examples/data_parallel.py --compile   # the step compiled (inductor)

The script trains for a few steps and checks every loss and the final parameters
against the same training in plain single-process torch (torch.optim.SGD on the
global batch), and exits non-zero if they disagree. It also checks that a step
issues exactly two all-reduces: one for the loss and one for all the gradients
(compiled by inductor, one: the loss travels in the gradients' bucket).
"""

import argparse
import contextlib
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fshard as fs


def check(name, got, want, tol=1e-4):
    """Exit non-zero, naming ``name``, if ``got`` is not close to the reference ``want``."""
    if not torch.allclose(got, want, rtol=tol, atol=tol):
        err = (got - want).abs().max().item()
        sys.exit(
            f"rank {dist.get_rank()}: {name} disagrees with the single-process reference "
            f"(max abs error {err:.3g})"
        )


def init_params(seed, d, hidden, classes):
    gen = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(d, hidden, generator=gen) / d**0.5,
        "b1": torch.zeros(hidden),
        "w2": torch.randn(hidden, classes, generator=gen) / hidden**0.5,
        "b2": torch.zeros(classes),
    }


def mlp_loss(params, x, labels):
    """Plain torch: mean cross-entropy of a two-layer MLP on the batch it is given."""
    h = F.gelu(x @ params["w1"] + params["b1"])
    return F.cross_entropy(h @ params["w2"] + params["b2"], labels)


def main():
    parser = argparse.ArgumentParser(description="data parallel MLP training")
    parser.add_argument("--batch", type=int, default=32, help="global batch (divisible by the world size)")
    parser.add_argument("--d", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
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
    opt = fs.optim.sgd(args.lr, momentum=0.9)

    def train_step(params, opt_state, x, labels):  # runs on local blocks
        def loss_fn(params):
            return fs.pmean(mlp_loss(params, x, labels), "dp")  # mean over the global batch

        loss, grads = fs.value_and_grad(loss_fn)(params)  # grads: replicated, already summed
        params, opt_state = opt.update(params, grads, opt_state)
        return params, opt_state, loss

    step = fs.shard_map(
        train_step, mesh=mesh, in_specs=("...", "...", "(dp b) d", "(dp b)"), out_specs=("...", "...", "")
    )
    if args.compile:
        step = fs.compile(step, backend=args.compile)  # traced on the first call, one graph after that

    params = init_params(args.seed, args.d, args.hidden, args.classes)
    opt_state = opt.init(params)

    # Single-process reference: the same model and optimizer on the global batches.
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    ref_opt = torch.optim.SGD(list(ref.values()), lr=args.lr, momentum=0.9)

    # One all-reduce for the loss and one bucket for every gradient (none on a 1-rank mesh);
    # compiled by inductor, the loss travels in the gradients' bucket: one all-reduce in all.
    expected = {("all_reduce", ("dp",)): 1 if args.compile else 2} if mesh.size > 1 else {}
    counting = args.compile in (None, "inductor")  # fs.count_collectives counts inductor's graphs only
    data = torch.Generator().manual_seed(args.seed + 1)
    for i in range(args.steps):
        x = torch.randn(args.batch, args.d, generator=data)  # the global batch, the same on every rank
        labels = torch.randint(args.classes, (args.batch,), generator=data)
        with fs.count_collectives() if counting else contextlib.nullcontext() as counts:
            params, opt_state, loss = step(params, opt_state, x, labels)
        ref_opt.zero_grad()
        ref_loss = mlp_loss(ref, x, labels)
        ref_loss.backward()
        ref_opt.step()
        check(f"loss at step {i}", loss, ref_loss.detach())
        if counting and counts.by_kind() != expected:
            sys.exit(f"rank {dist.get_rank()}: expected collectives {expected} per step, got {counts}")
        if dist.get_rank() == 0:
            print(f"step {i}: loss {loss.item():.4f}" + (f"  collectives {counts}" if counting else ""))
    for k in params:
        check(f"{k} after {args.steps} steps", params[k], ref[k].detach())

    if dist.get_rank() == 0:
        print(f"data_parallel: OK (dp={mesh.size}) losses and parameters match the single-process reference")


if __name__ == "__main__":
    main()
