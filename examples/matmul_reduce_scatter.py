"""Matmul whose result is reduce-scattered: a local matmul, then one psum_scatter.

    y[b, n] = sum_k x[b, k] w[k, n]

As in ``matmul_psum.py`` each tp rank holds a k-slice of x and w, so its local matmul
is a partial sum of the whole y. Instead of summing everything everywhere (psum), a
reduce-scatter sums and leaves each rank only its b-slice of y: ``(tp b) n``. This is
the second half of a sequence-parallel Megatron layer. Two ways to write it:

* explicitly, ``fs.psum_scatter(x @ w, "tp", dim=0, tiled=True)`` inside f;
* declaratively, return the partial sum and say so in the out_spec:
  ``"(tp b) n | sum(tp)"``; shard_map issues the same reduce-scatter on the way out.

The backward of a reduce-scatter is an all-gather of the cotangent.

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/matmul_reduce_scatter.py
    torchrun --nproc-per-node 4 examples/matmul_reduce_scatter.py
    python -m fshard.run -n 4 examples/matmul_reduce_scatter.py --compile   # both compiled (inductor)

The script checks both versions (values and gradients) against plain single-process
torch on the global tensors, and exits non-zero if they disagree.
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
    parser = argparse.ArgumentParser(description="matmul with a reduce-scattered result")
    parser.add_argument("--batch", type=int, default=8, help="rows of y (divisible by the world size)")
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
    in_specs = ("b (tp k)", "(tp k) n")

    @fs.shard_map(mesh=mesh, in_specs=in_specs, out_specs="(tp b) n")
    def matmul_explicit(x, w):
        return fs.psum_scatter(x @ w, "tp", dim=0, tiled=True)  # sum, keep my b-slice

    @fs.shard_map(mesh=mesh, in_specs=in_specs, out_specs="(tp b) n | sum(tp)")
    def matmul_declarative(x, w):
        return x @ w  # an unreduced partial sum; the out_spec reduce-scatters it

    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.batch, args.k, generator=gen)
    w = torch.randn(args.k, args.n, generator=gen)
    ct = torch.randn(args.batch, args.n, generator=gen)  # a fixed cotangent for the loss
    xs, ws = fs.shard(x, mesh, in_specs[0]), fs.shard(w, mesh, in_specs[1])
    cts = fs.shard(ct, mesh, "(tp b) n")

    # Single-process reference on the global tensors.
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = xr @ wr
    (ref * ct).sum().backward()

    # A loss that stays sharded: each rank dots its own b-slice, one psum adds the pieces.
    dot = fs.shard_map(
        lambda y, c: fs.psum((y * c).sum(), "tp"), mesh=mesh, in_specs=("(tp b) n", "(tp b) n"), out_specs=""
    )

    versions = [("psum_scatter", matmul_explicit), ("out_spec | sum(tp)", matmul_declarative)]
    if args.compile:  # each traced on its first call, again for the call that needs gradients
        versions = [(name, fs.compile(fn, backend=args.compile)) for name, fn in versions]
    counting = args.compile in (None, "inductor")  # fs.count_collectives counts inductor's graphs only

    def loss_fn(x, w, matmul):
        return dot(matmul(x, w), cts)

    for name, matmul in versions:
        with fs.count_collectives() if counting else contextlib.nullcontext() as counts:
            y = matmul(xs, ws)  # Sharded: global shape (batch, n), local (batch / tp, n)
        loss, (gx, gw) = fs.value_and_grad(loss_fn, argnums=(0, 1))(xs, ws, matmul)
        check(f"{name}: y", y.full(), ref.detach())  # .full() gathers (for the check only)
        check(f"{name}: loss", loss, (ref * ct).sum().detach())
        check(f"{name}: dloss/dx", gx.full(), xr.grad)
        check(f"{name}: dloss/dw", gw.full(), wr.grad)
        if dist.get_rank() == 0:
            seen = f", forward collectives: {counts}" if counting else ""
            print(f"{name:>20}: y {y.spec!r} local {tuple(y.local.shape)}{seen}")

    if dist.get_rank() == 0:
        print(f"matmul_reduce_scatter: OK (tp={mesh.size}) both versions match the single-process reference")


if __name__ == "__main__":
    main()
