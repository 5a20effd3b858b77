"""fshard's own cost per parameter leaf: a data-parallel step over many small leaves.

Not part of ``benchmarks.run``: the measurement of issue "fshard's own cost per leaf" (the per-leaf
bookkeeping of the tracking, the implicit casts and the gradient buckets, which real models with
300 to 1000 parameter tensors pay every step). The step, for ``n`` replicated leaves of ``width``
floats and this rank's rows ``x`` of the global batch::

    loss = mean over the global batch of sum_i (x * leaf_i).sum(-1) ** 2      # then gradients

Contenders, built once and timed in interleaved rounds:

* ``hand-written``: plain torch on the local rows, ``torch.autograd.grad``, one flat all-reduce of
  every gradient (what DDP does with one bucket), divided by the world size;
* ``fshard outer``: ``fs.value_and_grad(fs.shard_map(loss))`` (the gradients reduced in buckets at
  the boundary);
* ``fshard inner``: ``fs.shard_map(fs.value_and_grad(loss))`` (the whole step inside; each leaf's
  gradient reduced by the transpose of its implicit cast).

Rank 0 prints each contender's median time per step and fshard's extra cost per leaf,
``(fshard - hand-written) / n``, for every ``n``; the extra cost should be flat in ``n``.

    python -m benchmarks.per_leaf --world 2 --leaves 100 1000 3000
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import fshard as fs


def _loss_local(leaves, x):
    return sum(((x * w).sum(-1) ** 2).sum() for w in leaves)


def _contenders(n: int, width: int, rows: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(width, generator=g) * 0.1 for _ in range(n)]
    x = torch.randn(rows * world, width, generator=g)
    local_x = x.tensor_split(world)[rank]
    total_rows = x.shape[0]

    hand = [w.clone().requires_grad_(True) for w in leaves]

    def hand_step():
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

    return {
        "hand-written": hand_step,
        "fshard outer": lambda: outer(params, x),
        "fshard inner": lambda: inner(params, x),
    }


def _check(steps: dict) -> None:
    ref_loss, ref_grads = steps["hand-written"]()
    for name, step in steps.items():
        loss, grads = step()
        torch.testing.assert_close(loss, ref_loss, msg=name)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, msg=name)


def _rank(ns: list[int], width: int, rows: int, steps: int, rounds: int) -> dict:
    out = {}
    for n in ns:
        contenders = _contenders(n, width, rows)
        _check(contenders)  # every contender gives the hand-written values
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for step in contenders.values():
            step()
        names = list(contenders)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(steps):
                    contenders[name]()
                dist.barrier()
                times[name].append((time.perf_counter() - t0) / steps)
        out[n] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--leaves", type=int, nargs="+", default=[100, 1000, 3000])
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    res = fs.launch(_rank, a.world, (a.leaves, a.width, a.rows, a.steps, a.rounds), timeout=3600)
    print(f"world {a.world}, leaves of {a.width} floats, {a.rows} rows per rank; median ms per step")
    print(f"{'leaves':>6s} {'contender':14s} {'median ms':>10s} {'min ms':>8s} {'extra us/leaf':>14s}")
    for n, times in res[0].items():
        base = statistics.median(times["hand-written"])
        for name, ts in times.items():
            med = statistics.median(ts)
            extra = "" if name == "hand-written" else f"{1e6 * (med - base) / n:14.1f}"
            print(f"{n:6d} {name:14s} {1e3 * med:10.2f} {1e3 * min(ts):8.2f} {extra}")


if __name__ == "__main__":
    main()
