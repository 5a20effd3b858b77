"""Megatron-style tensor parallel MLP: column parallel, then row parallel, one psum.

    y = gelu(x @ w1 + b1) @ w2 + b2

w1 is split by columns ("d (tp h)") and w2 by rows ("(tp h) d"), so each tp rank
computes its own slice of the hidden layer with no communication and multiplies it
by its rows of w2. That gives a partial sum of y, and one ``fs.psum`` completes it.

Megatron writes two operators by hand: "f" (identity forward, all-reduce backward)
where the replicated x enters the parallel region, and "g" (all-reduce forward,
identity backward) where it leaves. Here "g" is ``fs.psum`` and "f" is implicit:
x is replicated, and where it meets the tp-split weights shard_map inserts a
``pvary``, whose transpose all-reduces x's gradient. So the forward costs one
all-reduce, and the backward one more, only if x needs a gradient (as it does here).

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/tensor_parallel_mlp.py
    torchrun --nproc-per-node 4 examples/tensor_parallel_mlp.py
    python -m fshard.run -n 4 examples/tensor_parallel_mlp.py --compile   # the MLP compiled (inductor)

The script checks the output and the gradients of every parameter and of x against
plain single-process torch on the global tensors, and exits non-zero if they disagree.
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


PARAM_SPECS = {"w1": "d (tp h)", "b1": "(tp h)", "w2": "(tp h) d", "b2": "d"}


def mlp(params, x):
    """Per shard: the column parallel layer, then the row parallel layer and one psum."""
    h = F.gelu(x @ params["w1"] + params["b1"])  # (b, h / tp): my slice of the hidden layer
    return fs.psum(h @ params["w2"], "tp") + params["b2"]  # partial sums of y, added up


def main():
    parser = argparse.ArgumentParser(description="tensor parallel MLP")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--d", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64, help="divisible by the world size")
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
    mesh = fs.Mesh(tp=dist.get_world_size())
    tp_mlp = fs.shard_map(mlp, mesh=mesh, in_specs=(PARAM_SPECS, "b d"), out_specs="b d")
    if args.compile:  # traced on the first call, again for the call that needs gradients
        tp_mlp = fs.compile(tp_mlp, backend=args.compile)
    counting = args.compile in (None, "inductor")  # fs.count_collectives counts inductor's graphs only
    count = fs.count_collectives if counting else contextlib.nullcontext

    gen = torch.Generator().manual_seed(args.seed)
    global_params = {
        "w1": torch.randn(args.d, args.hidden, generator=gen) / args.d**0.5,
        "b1": torch.randn(args.hidden, generator=gen),
        "w2": torch.randn(args.hidden, args.d, generator=gen) / args.hidden**0.5,
        "b2": torch.randn(args.d, generator=gen),
    }
    x = torch.randn(args.batch, args.d, generator=gen)
    ct = torch.randn(args.batch, args.d, generator=gen)  # a fixed cotangent for the loss
    params = {k: fs.shard(v, mesh, PARAM_SPECS[k]) for k, v in global_params.items()}

    def loss_fn(params, x):
        return (tp_mlp(params, x) * ct).sum()

    with count() as fwd:
        y = tp_mlp(params, x)
    with count() as both:
        loss, (grads, gx) = fs.value_and_grad(loss_fn, argnums=(0, 1))(params, x)

    # Single-process reference on the global tensors.
    ref = {k: v.clone().requires_grad_() for k, v in global_params.items()}
    xr = x.clone().requires_grad_()
    ref_y = F.gelu(xr @ ref["w1"] + ref["b1"]) @ ref["w2"] + ref["b2"]
    (ref_y * ct).sum().backward()

    check("y", y, ref_y.detach())
    check("loss", loss, (ref_y * ct).sum().detach())
    check("dloss/dx", gx, xr.grad)
    for k in params:
        check(f"dloss/d{k}", grads[k].full(), ref[k].grad)  # Sharded like the parameter

    if dist.get_rank() == 0:
        if counting:
            print(f"forward:              {fwd}")
            print(f"forward and backward: {both}")
        print(
            f"tensor_parallel_mlp: OK (tp={mesh.size}) output and gradients match the single-process reference"
        )


if __name__ == "__main__":
    main()
