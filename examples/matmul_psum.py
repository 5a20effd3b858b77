"""Matmul whose contraction dim is split: a local matmul, then one psum.

    y[b, n] = sum_k x[b, k] w[k, n]

Each of the tp ranks holds a k-slice of x and of w. Its local matmul is a partial sum
of y; ``fs.psum`` adds the partial sums, so y is whole (and the same) on every rank.
In the backward the psum costs nothing (its transpose is the identity): the gradients
of x and w come out k-sliced like x and w, with no communication at all.

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/matmul_psum.py
    torchrun --nproc-per-node 4 examples/matmul_psum.py
    python -m fshard.run -n 4 examples/matmul_psum.py --compile   # the matmul compiled (inductor)

The script checks the values and the gradients against plain single-process torch on
the global tensors, and exits non-zero if they disagree.
"""

import argparse
import contextlib
import sys

import torch
import torch.distributed as dist

import fshard as fs


def check(name, got, want, tol=1e-4):
    """Exit non-zero, naming ``name``, if ``got`` is not close to the reference ``want``."""
    if not torch.allclose(got, want, rtol=tol, atol=tol):
        err = (got - want).abs().max().item()
        sys.exit(
            f"rank {dist.get_rank()}: {name} disagrees with the single-process reference "
            f"(max abs error {err:.3g})"
        )


def main():
    parser = argparse.ArgumentParser(description="matmul with a split contraction dim")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=64, help="contraction dim (divisible by the world size)")
    parser.add_argument("--n", type=int, default=16)
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

    # The spec says how each dim is laid out: "b (tp k)" splits k over tp, b is whole.
    @fs.shard_map(mesh=mesh, in_specs=("b (tp k)", "(tp k) n"), out_specs="b n")
    def matmul(x, w):
        return fs.psum(x @ w, "tp")  # (b, k/tp) @ (k/tp, n) is a partial sum: add them up

    if args.compile:  # traced on the first call, again for the call that needs gradients
        matmul = fs.compile(matmul, backend=args.compile)
    counting = args.compile in (None, "inductor")  # fs.count_collectives counts inductor's graphs only
    count = fs.count_collectives if counting else contextlib.nullcontext

    # Global tensors, the same on every rank (seeded); fs.shard keeps this rank's block.
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.batch, args.k, generator=gen)
    w = torch.randn(args.k, args.n, generator=gen)
    ct = torch.randn(args.batch, args.n, generator=gen)  # a fixed cotangent for the loss
    xs, ws = fs.shard(x, mesh, "b (tp k)"), fs.shard(w, mesh, "(tp k) n")

    def loss_fn(x, w):
        return (matmul(x, w) * ct).sum()

    with count() as fwd:
        y = matmul(xs, ws)  # a plain tensor: its out_spec splits nothing
    with count() as step:
        loss, (gx, gw) = fs.value_and_grad(loss_fn, argnums=(0, 1))(xs, ws)  # Sharded grads

    # Single-process reference on the global tensors.
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = xr @ wr
    (ref * ct).sum().backward()
    check("y", y, ref.detach())
    check("loss", loss, (ref * ct).sum().detach())
    check("dloss/dx", gx.full(), xr.grad)  # .full() gathers a Sharded value (for the check only)
    check("dloss/dw", gw.full(), wr.grad)

    if dist.get_rank() == 0:
        if counting:
            print(f"forward collectives:            {fwd}")
            print(f"forward + backward collectives: {step}")
        print(f"matmul_psum: OK (y {tuple(y.shape)}, tp={mesh.size}) matches the single-process reference")


if __name__ == "__main__":
    main()
