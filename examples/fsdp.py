"""Fully sharded data parallel (FSDP / ZeRO-3) training of an MLP, with AdamW.

Every parameter is split along its first dim over the "dp" axis ("(dp d) h"), and so
are its gradient and both AdamW moments: each rank stores 1/dp of the model and of
the optimizer state. The batch is split over dp too. Inside the loss each rank
all-gathers the parameters it needs, the whole tree in one coalesced collective
(``fs.all_gather(params, "dp", tiled=True)``); the transpose of that all-gather is one
reduce-scatter, so the backward hands each rank
the summed gradient of exactly its own parameter slice, with no hand-written
communication. ``fs.optim.adamw`` then updates the local slices with no
communication either.

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/fsdp.py
    torchrun --nproc-per-node 4 examples/fsdp.py

The script trains a few steps and checks every loss and the final parameters against
plain single-process torch (torch.optim.AdamW on the global batch), and the
collectives of a step (one all-gather and one reduce-scatter per parameter, one
all-reduce for the loss); it exits non-zero if anything disagrees.
"""

import argparse
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


# Each parameter's first dim is split over dp; the labels name the model's dims.
PARAM_SPECS = {"w1": "(dp d) h", "b1": "(dp h)", "w2": "(dp h) c", "b2": "(dp c)"}


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
    parser = argparse.ArgumentParser(description="FSDP MLP training with AdamW")
    parser.add_argument("--batch", type=int, default=32, help="global batch (divisible by the world size)")
    parser.add_argument("--d", type=int, default=16, help="all sizes divisible by the world size")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    fs.init()
    mesh = fs.Mesh(dp=dist.get_world_size())

    @fs.shard_map(mesh=mesh, in_specs=(PARAM_SPECS, "(dp b) d", "(dp b)"), out_specs="")
    def loss_fn(params, x, labels):  # runs on local blocks
        full = fs.all_gather(params, "dp", dim=0, tiled=True)  # one all-gather for the whole tree
        return fs.pmean(mlp_loss(full, x, labels), "dp")

    global_params = init_params(args.seed, args.d, args.hidden, args.classes)
    params = {k: fs.shard(v, mesh, PARAM_SPECS[k]) for k, v in global_params.items()}
    opt = fs.optim.adamw(args.lr)
    opt_state = opt.init(params)  # moments are Sharded like their parameters

    # Single-process reference: the same model and optimizer on the global batches.
    ref = {k: v.clone().requires_grad_() for k, v in global_params.items()}
    ref_opt = torch.optim.AdamW(list(ref.values()), lr=args.lr)

    # one coalesced all-gather of the parameters, one reduce-scatter of their gradients, the loss
    expected = {("all_gather", ("dp",)): 1, ("reduce_scatter", ("dp",)): 1, ("all_reduce", ("dp",)): 1}
    data = torch.Generator().manual_seed(args.seed + 1)
    for i in range(args.steps):
        x = torch.randn(args.batch, args.d, generator=data)  # the global batch, the same on every rank
        labels = torch.randint(args.classes, (args.batch,), generator=data)
        with fs.count_collectives() as counts:
            loss, grads = fs.value_and_grad(loss_fn)(params, x, labels)  # grads: Sharded like params
        params, opt_state = opt.update(params, grads, opt_state)
        ref_opt.zero_grad()
        ref_loss = mlp_loss(ref, x, labels)
        ref_loss.backward()
        ref_opt.step()
        check(f"loss at step {i}", loss, ref_loss.detach())
        if mesh.size > 1 and counts.by_kind() != expected:
            sys.exit(f"rank {dist.get_rank()}: expected collectives {expected} per step, got {counts}")
        if dist.get_rank() == 0:
            print(f"step {i}: loss {loss.item():.4f}  collectives {counts}")
    for k in params:
        check(f"{k} after {args.steps} steps", params[k].full(), ref[k].detach())
        check(f"AdamW moment m[{k}]", opt_state["m"][k].full(), ref_opt.state[ref[k]]["exp_avg"])

    if dist.get_rank() == 0:
        w1 = params["w1"]
        print(f"w1: global {tuple(w1.shape)}, stored per rank {tuple(w1.local.shape)} ({w1.spec!r})")
        print(
            f"fsdp: OK (dp={mesh.size}) losses, parameters and AdamW state match the single-process reference"
        )


if __name__ == "__main__":
    main()
