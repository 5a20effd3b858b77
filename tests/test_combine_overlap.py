"""Overlap of combined collectives (``fshard/_combine.py``, `Flight`), on real gloo ranks.

A flush launches its buckets in queue order, at most ``FSHARD_COMBINE_AHEAD`` (2) in flight, and
the first use of a result waits for its own bucket only: the buckets after it are on the wire
while it is used. Checked: the collectives launched at each point of ``f`` (`fs.count_collectives`
counts a collective when it is launched), values and gradients against plain torch in one process
with many small buckets (1- and 2-axis meshes, 2 and 4 ranks, float32 and float64 leaves, several
``FSHARD_COMBINE_AHEAD``), and ranks that use the results in opposite orders.
"""

from __future__ import annotations

import time

import optree
import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, env_vars
from tests.test_combine import LEAVES, _params, _reference, _step

AG = ("all_gather", ("dp",))


def _launched(counts) -> int:
    return counts.by_kind()[AG]


def _rank_in_flight(X):
    """Five float32 leaves, one bucket each (a cap of 1 byte): which all_gathers are launched
    when each result is first used, and the values and gradients."""
    mesh = fs.Mesh(dp=2)
    errs: list = []
    seen: list = []
    counts = fs.CollectiveCounts()

    def f(*ws):
        ys = [fs.all_gather(w, "dp", dim=0, tiled=True) for w in ws]
        seen.append(_launched(counts))  # nothing used yet: the first two buckets are in flight
        out = []
        for y in ys:
            out.append(y.sin())  # the first use of y: waits for its bucket, launches the next
            seen.append(_launched(counts))
        return tuple(fs.psum(o, "dp") for o in out)

    ws = [X[i : i + 4].clone().requires_grad_(True) for i in range(0, 20, 4)]  # (4, 4) blocks over dp
    step = fs.shard_map(f, mesh=mesh, in_specs="(dp r) c", out_specs="...")
    from fshard import _counts

    with env_vars(FSHARD_COMBINE_MB=1 / 2**20):
        _counts._recorders.append(counts)
        try:
            outs = step(*ws)
        finally:
            _counts._recorders.remove(counts)
        sum(o.sum() * (i + 1) for i, o in enumerate(outs)).backward()
    # before any use: buckets 0 and 1 launched; using bucket k's result launches bucket k + 2
    if seen != [2, 3, 4, 5, 5, 5]:
        errs.append(f"all_gathers launched at each first use: {seen}, want [2, 3, 4, 5, 5, 5]")
    if [n for k, _, n in counts.combined if k == "all_gather"] != [1] * 5:
        errs.append(f"combined: {counts.combined}, want 5 all_gathers of one call")
    for i, (o, w) in enumerate(zip(outs, ws)):
        close(errs, f"value {i}", o, 2 * w.detach().sin())
        close(errs, f"grad {i}", w.grad, 2 * (i + 1) * w.detach().cos())
    return errs


def test_later_buckets_are_in_flight_before_an_earlier_result_is_used():
    X = torch.randn(20, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64).float()
    assert_ok(run_ranks(2, _rank_in_flight, X))


def _rank_many_buckets(sizes: dict, X):
    """The per-leaf and pytree forms of `tests.test_combine` with one bucket per leaf and 1, 2 or
    all buckets in flight (0: none, a flush waits): values and gradients against plain torch, and the calls counted."""
    mesh = fs.Mesh(**sizes)
    want_loss, want_parts, want_grads = _reference(X)
    errs: list = []
    n = len(LEAVES)
    for form in ("leaf", "tree"):
        for ahead in (0, 1, 2, 100):
            with env_vars(FSHARD_COMBINE_MB=1 / 2**20, FSHARD_COMBINE_AHEAD=ahead):
                params = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
                with fs.count_collectives() as fwd:
                    loss, parts = _step(mesh, form)(params, X)
                total = loss + sum(p.double() for p in parts.values())
                total.backward()
            what = f"{form} ahead={ahead}"
            close(errs, f"{what} loss", loss, want_loss)
            for k in LEAVES:
                close(errs, f"{what} parts[{k}]", parts[k], want_parts[k])
                close(errs, f"{what} grad {k}", params[k].grad, want_grads[k])
            gathers = [c for kind, _, c in fwd.combined if kind == "all_gather"]
            if gathers != [1] * n or fwd.by_kind()[AG] != n:
                errs.append(f"{what}: {fwd!r} {fwd.combined}, want {n} all_gathers of one call")
    return errs


@pytest.mark.parametrize("sizes", [{"dp": 2}, {"dp": 2, "tp": 2}], ids=["1axis", "2axes"])
def test_many_buckets_in_flight_match_one_process(sizes):
    n = 1
    for s in sizes.values():
        n *= s
    X = torch.randn(4 * n, 4, generator=torch.Generator().manual_seed(6), dtype=torch.float64).float()
    assert_ok(run_ranks(n, _rank_many_buckets, sizes, X))


def _rank_opposite_orders(X):
    """Rank 0 uses the results first to last, rank 1 last to first, eight buckets of two dtypes:
    the buckets go on the wire in queue order on both (no deadlock), the values are right."""
    mesh = fs.Mesh(dp=2)
    rank = mesh.axis_index("dp")
    errs: list = []

    def f(ws):
        ys = optree.tree_map(lambda w: fs.all_gather(w, "dp", dim=0, tiled=True, invariant=True), ws)
        order = range(len(ys)) if rank == 0 else reversed(range(len(ys)))
        used = {i: ys[i] * 3 for i in order}
        return [used[i] for i in range(len(ys))]

    ws = [X[i : i + 4].clone() for i in range(0, 32, 4)]
    ws = [w.double() if i % 3 == 0 else w for i, w in enumerate(ws)]
    step = fs.shard_map(f, mesh=mesh, in_specs="(dp r) c", out_specs="...")
    t0 = time.monotonic()
    with env_vars(FSHARD_COMBINE_MB=1 / 2**20):
        outs = step(ws)
    if time.monotonic() - t0 > 30:
        errs.append(f"took {time.monotonic() - t0:.1f} s")
    for i, (o, w) in enumerate(zip(outs, ws)):
        if o.dtype != w.dtype:
            errs.append(f"result {i}: {o.dtype}, want {w.dtype}")
        close(errs, f"value {i}", o, 3 * w)
    return errs


def test_ranks_using_results_in_opposite_orders():
    X = torch.randn(32, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64).float()
    assert_ok(run_ranks(2, _rank_opposite_orders, X, timeout=60))


def _rank_backward_early(X, W):
    """Four layers, a bucket per layer: the gradients' reduce-scatters are launched as each layer's
    gradients complete (before the backward reaches the first layer), waited at the end; the
    gradients agree with plain torch, and nothing is launched twice."""
    mesh = fs.Mesh(dp=2)
    errs: list = []
    seen: list = []
    counts = fs.CollectiveCounts()
    RS = ("reduce_scatter", ("dp",))

    def f(x, *ws):
        ys = [fs.all_gather(w, "dp", dim=0, tiled=True) for w in ws]
        h = x
        first = None
        for y in ys:
            h = torch.tanh(h @ y)
            first = h if first is None else first
        first.register_hook(lambda g: seen.append(counts.by_kind()[RS]))  # the first layer's backward
        return fs.psum(h.square().sum(), "dp")

    ws = [w.clone().requires_grad_(True) for w in W]
    step = fs.shard_map(f, mesh=mesh, in_specs=("(dp b) c", *["(dp r) c"] * len(W)), out_specs="")
    from fshard import _counts

    for ahead in (2, 0):
        for w in ws:
            w.grad = None
        seen.clear()
        with env_vars(FSHARD_COMBINE_MB=1 / 2**20, FSHARD_COMBINE_AHEAD=ahead):
            _counts._recorders.append(counts)
            try:
                counts.records.clear()
                counts.combined.clear()
                step(X, *ws).backward()
            finally:
                _counts._recorders.remove(counts)
        # early: layers 4, 3 and 2's reduce-scatters are on the wire when layer 1's backward runs
        want = 3 if ahead else 0
        if seen != [want]:
            errs.append(
                f"ahead={ahead}: reduce_scatters launched at the first layer's backward {seen}, want [{want}]"
            )
        if (
            counts.by_kind()[RS] != 4
            or [n for k, _, n in counts.combined if k == "reduce_scatter"] != [1] * 4
        ):
            errs.append(f"ahead={ahead}: {counts!r} {counts.combined}, want 4 reduce_scatters of one call")
        ref = [w.detach().clone().requires_grad_(True) for w in W]
        h = X
        for w in ref:
            h = torch.tanh(h @ w)
        h.square().sum().backward()
        for i, (w, r) in enumerate(zip(ws, ref)):
            close(errs, f"ahead={ahead}: grad {i}", w.grad, r.grad)
    return errs


def test_backward_reduce_scatters_launch_as_their_gradients_complete():
    g = torch.Generator().manual_seed(8)
    X = torch.randn(8, 4, generator=g, dtype=torch.float64).float()
    W = [(torch.randn(4, 4, generator=g, dtype=torch.float64) * 0.5).float() for _ in range(4)]
    assert_ok(run_ranks(2, _rank_backward_early, X, W))


def _rank_backward_fallbacks(X, W):
    """A bucket whose results do not all get a gradient (reduce-scattered at the end, with the
    gradients that came early), and double backward (create_graph: the differentiable path)."""
    mesh = fs.Mesh(dp=2)
    errs: list = []

    def f(x, *ws):
        extra = ws[0] * 2
        ys = [fs.all_gather(w, "dp", dim=0, tiled=True) for w in ws]
        unused = fs.all_gather(extra, "dp", dim=0, tiled=True)  # same bucket, never in the loss
        del unused
        h = x
        for y in ys:
            h = torch.tanh(h @ y)
        return fs.psum(h.square().sum(), "dp")

    step = fs.shard_map(f, mesh=mesh, in_specs=("(dp b) c", *["(dp r) c"] * len(W)), out_specs="")

    def ref_loss(ws):
        h = X
        for w in ws:
            h = torch.tanh(h @ w)
        return h.square().sum()

    ws = [w.clone().requires_grad_(True) for w in W]
    with fs.count_collectives() as bwd_counts:
        loss = step(X, *ws)
        loss.backward()
    ref = [w.clone().requires_grad_(True) for w in W]
    ref_loss(ref).backward()
    for i, (w, r) in enumerate(zip(ws, ref)):
        close(errs, f"partial bucket: grad {i}", w.grad, r.grad)
    if [n for k, _, n in bwd_counts.combined if k == "reduce_scatter"] != [5]:
        errs.append(f"partial bucket: {bwd_counts.combined}, want one reduce_scatter of 5 calls")

    # double backward: d/dw of the squared gradient norm
    ws = [w.clone().requires_grad_(True) for w in W]
    grads = torch.autograd.grad(step(X, *ws), ws, create_graph=True)
    sum(g.square().sum() for g in grads).backward()
    ref = [w.clone().requires_grad_(True) for w in W]
    rgrads = torch.autograd.grad(ref_loss(ref), ref, create_graph=True)
    sum(g.square().sum() for g in rgrads).backward()
    for i, (g, rg, w, r) in enumerate(zip(grads, rgrads, ws, ref)):
        close(errs, f"create_graph: grad {i}", g, rg)
        close(errs, f"create_graph: grad of grad {i}", w.grad, r.grad)
    return errs


def test_backward_fallbacks_partial_bucket_and_double_backward():
    g = torch.Generator().manual_seed(9)
    X = torch.randn(8, 4, generator=g, dtype=torch.float64).float()
    W = [(torch.randn(4, 4, generator=g, dtype=torch.float64) * 0.5).float() for _ in range(4)]
    assert_ok(run_ranks(2, _rank_backward_fallbacks, X, W))
