"""FSDP x tensor parallel training on a 2-D mesh (dp, tp), with AdamW.

The MLP is the Megatron pair of ``tensor_parallel_mlp.py`` (weights split over "tp"),
and on top each weight's tp block is split again over "dp", FSDP style, on a dim
tp does not use: w1 is "(dp d) (tp h)", w2 "(tp h) (dp c)". A bias split over both
axes, "(tp dp h)", means: h is cut into tp blocks, and each of those into dp blocks.
Inside the loss each rank all-gathers over dp the dim that dp splits, which rebuilds
exactly its tp block; the transpose of that all-gather reduce-scatters the gradients
over dp. The batch is split over dp. AdamW state is sharded like the parameters.

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/fsdp_tp.py              # dp=2, tp=2
    torchrun --nproc-per-node 4 examples/fsdp_tp.py
    python -m fshard.run -n 4 examples/fsdp_tp.py --compile    # loss and gradients compiled (inductor)

The script trains a few steps and checks every loss and the final parameters against
plain single-process torch (torch.optim.AdamW on the global batch), and exits
non-zero if they disagree.
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


PARAM_SPECS = {"w1": "(dp d) (tp h)", "b1": "(tp dp h)", "w2": "(tp h) (dp c)", "b2": "(dp c)"}
FSDP_DIM = {"w1": 0, "b1": 0, "w2": 1, "b2": 0}  # the dim dp splits, gathered before use


def init_params(seed, d, hidden, classes):
    gen = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(d, hidden, generator=gen) / d**0.5,
        "b1": torch.zeros(hidden),
        "w2": torch.randn(hidden, classes, generator=gen) / hidden**0.5,
        "b2": torch.zeros(classes),
    }


def main():
    parser = argparse.ArgumentParser(description="FSDP x TP MLP training with AdamW")
    parser.add_argument("--dp", type=int, default=2, help="FSDP size; tp = world size / dp")
    parser.add_argument("--batch", type=int, default=32, help="global batch (divisible by dp)")
    parser.add_argument("--d", type=int, default=16, help="divisible by dp")
    parser.add_argument("--hidden", type=int, default=32, help="divisible by dp * tp")
    parser.add_argument("--classes", type=int, default=8, help="divisible by dp")
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
    mesh = fs.Mesh(dp=args.dp, tp=dist.get_world_size() // args.dp)

    @fs.shard_map(mesh=mesh, in_specs=(PARAM_SPECS, "(dp b) d", "(dp b)"), out_specs="")
    def loss_fn(params, x, labels):  # runs on local blocks
        p = {k: fs.all_gather(v, "dp", dim=FSDP_DIM[k], tiled=True) for k, v in params.items()}
        h = F.gelu(x @ p["w1"] + p["b1"])  # my tp slice of the hidden layer
        logits = fs.psum(h @ p["w2"], "tp") + p["b2"]
        return fs.pmean(F.cross_entropy(logits, labels), "dp")

    global_params = init_params(args.seed, args.d, args.hidden, args.classes)
    params = {k: fs.shard(v, mesh, PARAM_SPECS[k]) for k, v in global_params.items()}
    opt = fs.optim.adamw(args.lr)
    opt_state = opt.init(params)

    # Single-process reference: the plain MLP on the global batches.
    ref = {k: v.clone().requires_grad_() for k, v in global_params.items()}
    ref_opt = torch.optim.AdamW(list(ref.values()), lr=args.lr)

    loss_and_grads = fs.value_and_grad(loss_fn)
    if args.compile:
        loss_and_grads = fs.compile(loss_and_grads, backend=args.compile)  # traced on the first call
    counting = args.compile in (None, "inductor")  # fs.count_collectives counts inductor's graphs only
    data = torch.Generator().manual_seed(args.seed + 1)
    for i in range(args.steps):
        x = torch.randn(args.batch, args.d, generator=data)  # the global batch, the same on every rank
        labels = torch.randint(args.classes, (args.batch,), generator=data)
        with fs.count_collectives() if counting else contextlib.nullcontext() as counts:
            loss, grads = loss_and_grads(params, x, labels)
        params, opt_state = opt.update(params, grads, opt_state)
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(F.gelu(x @ ref["w1"] + ref["b1"]) @ ref["w2"] + ref["b2"], labels)
        ref_loss.backward()
        ref_opt.step()
        check(f"loss at step {i}", loss, ref_loss.detach())
        if dist.get_rank() == 0:
            print(f"step {i}: loss {loss.item():.4f}" + (f"  collectives {counts}" if counting else ""))
    for k in params:
        check(f"{k} after {args.steps} steps", params[k].full(), ref[k].detach())

    if dist.get_rank() == 0:
        sizes = ", ".join(f"{k} {tuple(v.local.shape)} of {tuple(v.shape)}" for k, v in params.items())
        print(f"stored per rank: {sizes}")
        print(f"fsdp_tp: OK ({mesh}) losses and parameters match the single-process reference")


if __name__ == "__main__":
    main()
