"""fshard's own cost per parameter leaf: a data-parallel step over many small leaves.

Not part of ``benchmarks.run``: the measurement of issue "fshard's own cost per leaf" (the per-leaf
bookkeeping of the tracking, the implicit casts and the gradient buckets, which real models with
300 to 1000 parameter tensors pay every step). The step, for ``n`` replicated leaves of ``width``
floats and this rank's rows ``x`` of the global batch::

    loss = mean over the global batch of sum_i (x * leaf_i).sum(-1) ** 2      # then gradients

Contenders, built once and timed in interleaved rounds:

* ``hand-written``: plain torch on the local rows, ``torch.autograd.grad``, one flat all-reduce of
  every gradient (what DDP does with one bucket), divided by the world size;
* ``mode floor``: the hand-written step with an empty ``TorchFunctionMode`` (one that only calls
  the op) around its forward: what any per-op tracking written in Python pays before it does
  anything, so ``fshard - mode floor`` is the part of fshard's cost that its own rules make;
* ``fshard outer``: ``fs.value_and_grad(fs.shard_map(loss))`` (the gradients reduced in buckets at
  the boundary);
* ``fshard inner``: ``fs.shard_map(fs.value_and_grad(loss))`` (the whole step inside; each leaf's
  gradient reduced by the transpose of its implicit cast).

With ``--compiled BACKEND`` also the hand-written step and ``fshard outer`` under ``fs.compile``
(first call, tracing and compiling, timed apart): compiled, no per-op tracking runs, and inductor
buckets the per-leaf gradient all-reduces (``aot_eager`` does not: one blocking all-reduce per
leaf). Compiling takes minutes at a few hundred leaves on a small machine.

Rank 0 prints each contender's median time per step and its extra cost per leaf over the
hand-written step, ``(fshard - hand-written) / n``, and over the mode floor, for every ``n``; the
extra cost should be flat in ``n``. ``--cpu`` times the main thread's CPU (``time.thread_time``)
instead of the wall clock: steadier when other processes share the cores.

    python -m benchmarks.per_leaf --world 2 --leaves 100 1000 3000
    python -m benchmarks.per_leaf --world 2 --leaves 100 --compiled inductor
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import fshard as fs


def _loss_local(leaves, x):
    return sum(((x * w).sum(-1) ** 2).sum() for w in leaves)


class _EmptyMode(TorchFunctionMode):
    """Calls each op and nothing else: the floor of any per-op tracking written in Python."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **kwargs) if kwargs else func(*args)


def _contenders(n: int, width: int, rows: int, backend: str | None = None) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(width, generator=g) * 0.1 for _ in range(n)]
    x = torch.randn(rows * world, width, generator=g)
    local_x = x.tensor_split(world)[rank]
    total_rows = x.shape[0]

    hand = [w.clone().requires_grad_(True) for w in leaves]

    def hand_step(mode=None):
        if mode is None:
            loss = _loss_local(hand, local_x) / total_rows
        else:
            with mode():
                loss = _loss_local(hand, local_x) / total_rows
        grads = torch.autograd.grad(loss, hand)
        flat = torch.cat([gr.reshape(-1) for gr in grads])
        loss = loss.detach().clone()
        dist.all_reduce(flat)
        dist.all_reduce(loss)
        return loss, list(flat.split([w.numel() for w in hand]))

    mesh = fs.Mesh(dp=world)

    def loss_fn(ws, xb):
        return fs.psum(_loss_local(ws, xb), "dp") / total_rows

    outer = fs.value_and_grad(fs.shard_map(loss_fn, mesh=mesh, in_specs=("...", "(dp b) d"), out_specs=""))
    inner = fs.shard_map(
        fs.value_and_grad(loss_fn), mesh=mesh, in_specs=("...", "(dp b) d"), out_specs=("", "...")
    )
    params = [w.clone() for w in leaves]

    out = {
        "hand-written": hand_step,
        "mode floor": lambda: hand_step(_EmptyMode),
        "fshard outer": lambda: outer(params, x),
        "fshard inner": lambda: inner(params, x),
    }
    if backend is not None:  # the same steps compiled: no per-op tracking left at run time
        hand_c = fs.compile(hand_step, backend=backend)
        outer_c = fs.compile(outer, backend=backend)
        out["hand compiled"] = hand_c
        out["outer compiled"] = lambda: outer_c(params, x)
    return out


def _check(steps: dict) -> None:
    ref_loss, ref_grads = steps["hand-written"]()
    for name, step in steps.items():
        loss, grads = step()
        torch.testing.assert_close(loss, ref_loss, msg=name)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, msg=name)


def _rank(
    ns: list[int],
    width: int,
    rows: int,
    steps: int,
    rounds: int,
    backend: str | None = None,
    cpu: bool = False,
) -> dict:
    clock = time.thread_time if cpu else time.perf_counter
    gc.collect()
    out = {}
    for n in ns:
        torch._dynamo.reset()
        contenders = _contenders(n, width, rows, backend)
        first: dict[str, float] = {}
        for name, step in contenders.items():
            if "compiled" in name:  # the first call traces and compiles: timed apart
                dist.barrier()
                t0 = time.perf_counter()
                step()
                first[name] = time.perf_counter() - t0
        _check(contenders)  # every contender gives the hand-written values
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for step in contenders.values():
            step()
        names = list(contenders)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                dist.barrier()
                t0 = clock()
                for _ in range(steps):
                    contenders[name]()
                if not cpu:
                    dist.barrier()
                times[name].append((clock() - t0) / steps)
        out[n] = (times, first)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--leaves", type=int, nargs="+", default=[100, 1000, 3000])
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--compiled",
        metavar="BACKEND",
        help="also time the hand-written step and fshard outer compiled with fs.compile (inductor, aot_eager)",
    )
    ap.add_argument("--cpu", action="store_true", help="time the main thread's CPU instead of the wall clock")
    a = ap.parse_args()
    args = (a.leaves, a.width, a.rows, a.steps, a.rounds, a.compiled, a.cpu)
    res = fs.launch(_rank, a.world, args, timeout=3600)
    clock = "main-thread CPU" if a.cpu else "wall"
    print(f"world {a.world}, leaves of {a.width} floats, {a.rows} rows per rank; {clock} ms per step, rank 0")
    print(
        f"{'leaves':>6s} {'contender':14s} {'median ms':>10s} {'min ms':>8s} {'extra us/leaf':>14s} "
        f"{'over floor us/leaf':>19s}"
    )
    for n, (times, first) in res[0].items():
        base = statistics.median(times["hand-written"])
        floor = statistics.median(times["mode floor"])
        for name, ts in times.items():
            med = statistics.median(ts)
            extra = "" if name == "hand-written" else f"{1e6 * (med - base) / n:14.1f}"
            over = f"{1e6 * (med - floor) / n:19.1f}" if name.startswith("fshard") else ""
            print(f"{n:6d} {name:14s} {1e3 * med:10.2f} {1e3 * min(ts):8.2f} {extra:>14s} {over}")
        if "outer compiled" in times:
            hc = statistics.median(times["hand compiled"])
            oc = statistics.median(times["outer compiled"])
            print(f"{n:6d} outer compiled - hand compiled: {1e6 * (oc - hc) / n:.1f} us/leaf")
        for name, sec in first.items():
            print(f"{n:6d} {name:14s} first call (trace + compile) {sec:.1f} s")


if __name__ == "__main__":
    main()
