"""Collective matmul: an all-gather matmul done as a ppermute ring.

    y = all_gather(x) @ w      x: "(tp b) k" (rows split), w: "k (tp n)", y: "b (tp n)"

The straightforward version gathers every row block of x, then multiplies. The ring
version never holds the gathered x: in each of tp steps a rank multiplies the row
block it holds by its w, and passes that block on to the next rank with
``fs.ppermute``. After tp steps it has seen every block. The send is started before
the matmul (``async_op=True``) and waited for after it, so the transfer overlaps
with the compute. The backward runs the ring in reverse (the transpose of a
ppermute is the inverse ppermute).

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/collective_matmul.py
    torchrun --nproc-per-node 4 examples/collective_matmul.py
    python -m fshard.run -n 4 examples/collective_matmul.py --compile   # both versions compiled (inductor)

The script checks both versions (values and gradients) against plain single-process
torch on the global tensors, and exits non-zero if they disagree. ``--time`` also
times the ring's forward with and without the overlap on larger matrices.
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


def gather_matmul(x, w):
    """Per shard: x (b / tp, k) is my row block, w (k, n / tp) my columns; gather all rows, multiply."""
    return fs.all_gather(x, "tp", dim=0, tiled=True) @ w


def ring_matmul(x, w, overlap=True):
    """The same product, one row block at a time, passing the blocks around a ring."""
    n, me = fs.axis_size("tp"), fs.axis_index("tp")
    to_next = [(i, (i + 1) % n) for i in range(n)]
    blocks = []
    for step in range(n):
        nxt = fs.ppermute(x, "tp", to_next, async_op=overlap) if step < n - 1 else None
        blocks.append(x @ w)  # x holds the rows of rank (me - step) % n; the next block is in flight
        x = nxt.wait() if overlap and nxt is not None else nxt
    # blocks[step] came from rank (me - step) % n; put them back in rank order.
    return torch.stack(blocks)[(me - torch.arange(n)) % n].flatten(0, 1)


def main():
    parser = argparse.ArgumentParser(description="collective matmul with a ppermute ring")
    parser.add_argument("--batch", type=int, default=16, help="rows of x (divisible by the world size)")
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--n", type=int, default=16, help="columns of w (divisible by the world size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time", action="store_true", help="time the ring with and without overlap")
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

    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.batch, args.k, generator=gen)
    w = torch.randn(args.k, args.n, generator=gen)
    ct = torch.randn(args.batch, args.n, generator=gen)  # a fixed cotangent for the loss
    xs, ws, cts = fs.shard(x, mesh, "(tp b) k"), fs.shard(w, mesh, "k (tp n)"), fs.shard(ct, mesh, "b (tp n)")
    dot = fs.shard_map(
        lambda y, c: fs.psum((y * c).sum(), "tp"), mesh=mesh, in_specs=("b (tp n)", "b (tp n)"), out_specs=""
    )

    # Single-process reference on the global tensors.
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = xr @ wr
    (ref * ct).sum().backward()

    counting = args.compile in (None, "inductor")  # fs.count_collectives counts inductor's graphs only
    count = fs.count_collectives if counting else contextlib.nullcontext

    def loss_fn(x, w, matmul):
        return dot(matmul(x, w), cts)

    for name, fn in [("all_gather", gather_matmul), ("ppermute ring", ring_matmul)]:
        matmul = fs.shard_map(fn, mesh=mesh, in_specs=("(tp b) k", "k (tp n)"), out_specs="b (tp n)")
        if args.compile:  # traced on the first call, again for the call that needs gradients
            matmul = fs.compile(matmul, backend=args.compile)
        with count() as fwd:
            y = matmul(xs, ws)
        with count() as both:
            loss, (gx, gw) = fs.value_and_grad(loss_fn, argnums=(0, 1))(xs, ws, matmul)
        check(f"{name}: y", y.full(), ref.detach())
        check(f"{name}: loss", loss, (ref * ct).sum().detach())
        check(f"{name}: dloss/dx", gx.full(), xr.grad)
        check(f"{name}: dloss/dw", gw.full(), wr.grad)
        if dist.get_rank() == 0 and counting:
            print(f"{name:>13}: forward {fwd}")
            print(f"{'':>13}  loss, forward and backward {both}")

    if dist.get_rank() == 0:
        print(f"collective_matmul: OK (tp={mesh.size}) both versions match the single-process reference")
    if args.time:
        time_ring(mesh, args.compile)


def time_ring(mesh, backend=None, rows=4096, k=1024, n=1024, rounds=7):
    """Median forward time of the ring with the transfers overlapped and not, interleaved; compiled
    with ``backend`` if one is named (the first call of each, which compiles it, is not timed)."""
    import time

    gen = torch.Generator().manual_seed(1)
    xs = fs.shard(torch.randn(rows, k, generator=gen), mesh, "(tp b) k")
    ws = fs.shard(torch.randn(k, n, generator=gen), mesh, "k (tp n)")
    fns = {
        overlap: fs.shard_map(
            lambda x, w, o=overlap: ring_matmul(x, w, o),
            mesh=mesh,
            in_specs=("(tp b) k", "k (tp n)"),
            out_specs="b (tp n)",
        )
        for overlap in (False, True)
    }
    if backend:
        fns = {overlap: fs.compile(fn, backend=backend) for overlap, fn in fns.items()}
    times: dict = {False: [], True: []}
    with torch.no_grad():
        if backend:
            for fn in fns.values():
                fn(xs, ws)  # traced and compiled here, not timed
        for _ in range(rounds):
            for overlap, fn in fns.items():
                dist.barrier()
                t = time.perf_counter()
                fn(xs, ws)
                times[overlap].append(time.perf_counter() - t)
    med = {o: sorted(v)[len(v) // 2] * 1e3 for o, v in times.items()}
    if dist.get_rank() == 0:
        print(
            f"ring forward ({rows}x{k} @ {k}x{n}, tp={mesh.size}): synchronous {med[False]:.1f} ms, "
            f"overlapped {med[True]:.1f} ms ({med[False] / med[True]:.2f}x)"
        )


if __name__ == "__main__":
    main()
