"""Fully sharded data parallel (FSDP / ZeRO-3) training of a residual MLP, with AdamW.

Every parameter is split along its first dim over the "dp" axis ("(dp d) h"), and so
are its gradient and both AdamW moments: each rank stores 1/dp of the model and of
the optimizer state. The batch is split over dp too. Inside the loss the hidden blocks
run through ``fs.fsdp_scan``: one block's parameters are all-gathered at a time (the
next block's gather already in flight while a block computes), freed after the
block's forward and gathered again in the backward, so a rank never holds more than
about two gathered blocks. The input and output layers are gathered once, in one
coalesced all-gather (``fs.all_gather(tree, "dp", tiled=True)``). The transpose of
each all-gather is one reduce-scatter, so the backward hands each rank the summed
gradient of exactly its own parameter slices, with no hand-written communication.
``fs.optim.adamw`` then updates the local slices with no communication either.

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/fsdp.py
    torchrun --nproc-per-node 4 examples/fsdp.py
    python -m fshard.run -n 4 examples/fsdp.py --compile   # loss and gradients compiled (inductor)

The script trains a few steps and checks every loss and the final parameters against
plain single-process torch (torch.optim.AdamW on the global batch), and the
collectives of a step (one all-gather of the input and output layers and one per block
in the forward, one per block again in the backward, one reduce-scatter per
all-gather of the forward, one all-reduce for the loss; compiled by inductor, the calls of
each kind in one bucket); it exits non-zero if anything disagrees.
"""

import argparse
import contextlib
import sys

import optree
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
BLOCK_SPECS = {"w": "(dp h) k", "b": "(dp k)"}


def param_specs(layers):
    return {
        "w_in": "(dp d) h",
        "blocks": [dict(BLOCK_SPECS) for _ in range(layers)],
        "w_out": "(dp h) c",
        "b_out": "(dp c)",
    }


def init_params(seed, d, hidden, classes, layers):
    gen = torch.Generator().manual_seed(seed)
    return {
        "w_in": torch.randn(d, hidden, generator=gen) / d**0.5,
        "blocks": [
            {"w": torch.randn(hidden, hidden, generator=gen) / hidden**0.5, "b": torch.zeros(hidden)}
            for _ in range(layers)
        ],
        "w_out": torch.randn(hidden, classes, generator=gen) / hidden**0.5,
        "b_out": torch.zeros(classes),
    }


def block(p, h):
    """One residual block (plain torch): ``p`` holds the block's full parameters."""
    return h + F.gelu(h @ p["w"] + p["b"])


def mlp_loss(params, x, labels):
    """Plain torch: mean cross-entropy of the MLP on the batch it is given."""
    h = F.gelu(x @ params["w_in"])
    for p in params["blocks"]:
        h = block(p, h)
    return F.cross_entropy(h @ params["w_out"] + params["b_out"], labels)


def main():
    parser = argparse.ArgumentParser(description="FSDP MLP training with AdamW")
    parser.add_argument("--batch", type=int, default=32, help="global batch (divisible by the world size)")
    parser.add_argument("--d", type=int, default=16, help="all sizes divisible by the world size")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--layers", type=int, default=3, help="hidden residual blocks")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
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

    specs = param_specs(args.layers)

    @fs.shard_map(mesh=mesh, in_specs=(specs, "(dp b) d", "(dp b)"), out_specs="")
    def loss_fn(params, x, labels):  # runs on local blocks
        # the input and output layers: one coalesced all-gather, kept until the backward
        io = fs.all_gather({k: v for k, v in params.items() if k != "blocks"}, "dp", dim=0, tiled=True)
        h = F.gelu(x @ io["w_in"])
        # the blocks: gathered one at a time, prefetched, freed after use
        h = fs.fsdp_scan(block, params["blocks"], h, "dp", dims=specs["blocks"])
        local = F.cross_entropy(h @ io["w_out"] + io["b_out"], labels)
        return fs.pmean(local, "dp")

    global_params = init_params(args.seed, args.d, args.hidden, args.classes, args.layers)
    params = fs.shard(global_params, mesh, specs)
    opt = fs.optim.adamw(args.lr)
    opt_state = opt.init(params)  # moments are Sharded like their parameters

    # Single-process reference: the same model and optimizer on the global batches.
    ref = optree.tree_map(lambda v: v.clone().requires_grad_(), global_params)
    ref_opt = torch.optim.AdamW(optree.tree_leaves(ref), lr=args.lr)

    # all-gathers: the input/output layers and each block, each block again in the backward;
    # one reduce-scatter per all-gather of the forward; the loss
    n = args.layers
    expected = {
        ("all_gather", ("dp",)): 1 + 2 * n,
        ("reduce_scatter", ("dp",)): 1 + n,
        ("all_reduce", ("dp",)): 1,
    }
    if args.compile:  # inductor buckets the calls of each kind: one collective each at these sizes
        expected = dict.fromkeys(expected, 1)
    loss_and_grads = fs.value_and_grad(loss_fn)
    if args.compile:
        loss_and_grads = fs.compile(loss_and_grads, backend=args.compile)  # traced on the first call
    counting = args.compile in (None, "inductor")  # fs.count_collectives counts inductor's graphs only
    data = torch.Generator().manual_seed(args.seed + 1)
    for i in range(args.steps):
        x = torch.randn(args.batch, args.d, generator=data)  # the global batch, the same on every rank
        labels = torch.randint(args.classes, (args.batch,), generator=data)
        with fs.count_collectives() if counting else contextlib.nullcontext() as counts:
            loss, grads = loss_and_grads(params, x, labels)  # grads: Sharded like params
        params, opt_state = opt.update(params, grads, opt_state)
        ref_opt.zero_grad()
        ref_loss = mlp_loss(ref, x, labels)
        ref_loss.backward()
        ref_opt.step()
        check(f"loss at step {i}", loss, ref_loss.detach())
        if counting and mesh.size > 1 and counts.by_kind() != expected:
            sys.exit(f"rank {dist.get_rank()}: expected collectives {expected} per step, got {counts}")
        if dist.get_rank() == 0:
            print(f"step {i}: loss {loss.item():.4f}" + (f"  collectives {counts}" if counting else ""))
    paths, leaves, _ = optree.tree_flatten_with_path(params)
    moments = optree.tree_leaves(opt_state["m"])
    for path, p, m, r in zip(paths, leaves, moments, optree.tree_leaves(ref)):
        name = ".".join(map(str, path))
        check(f"{name} after {args.steps} steps", p.full(), r.detach())
        check(f"AdamW moment m[{name}]", m.full(), ref_opt.state[r]["exp_avg"])

    if dist.get_rank() == 0:
        w = params["blocks"][0]["w"]
        print(f"blocks[0].w: global {tuple(w.shape)}, stored per rank {tuple(w.local.shape)} ({w.spec!r})")
        print(
            f"fsdp: OK (dp={mesh.size}) losses, parameters and AdamW state match the single-process reference"
        )


if __name__ == "__main__":
    main()
