"""Features on uneven blocks (torch.chunk's cut) and data-dependent shapes, on real gloo ranks.

- ``fs.fsdp_scan`` over layers whose parameters ``fs.shard`` cut unevenly (blocks of 3 and 2,
  of 3, 3, 3 and 0, of 2, 2, 2, 2, 1, 0, 0, 0), listed and stacked: a residual MLP's loss and
  gradients against one process on dp = 2, 4, 8 and dp x tp, next to per-leaf
  ``fs.all_gather`` (sync and async) and the even case; the same collectives as the even case
  but for the small all-gathers of block shapes, and the next layer's gather still prefetched.
- Data-dependent shapes (``x[mask]``, ``masked_select``, ``nonzero``, ``unique``, one-argument
  ``torch.where``, ``repeat_interleave``) on varying values: blocks that are torch.chunk's cut
  stitch to the right global rows (``.full()``, ``.reshard()``, another shard_map, gradients),
  others raise one SpecError on every rank (bounded in time), and calls without them
  communicate nothing.
- ``async_op=True`` all_gather and psum_scatter accept exactly the blocks the synchronous forms
  accept (uneven 10 over 4, empty blocks 3 over 4, on 1- and 2-axis meshes): values and
  gradients of both against one process, and the same collectives.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import fshard as fs
from fshard import _comm, _counts
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, randn

F64 = torch.float64


def _mesh(kind: str):
    """``(mesh, axes, batch spec)``: one axis of 4, or 2 x 2 with the batch split over both."""
    if kind == "1-axis":
        return fs.Mesh(dp=4), "dp", "(dp b) d"
    return fs.Mesh(dp=2, tp=2), ("dp", "tp"), "(dp tp b) d"


# =============================================================================================
# async_op=True on uneven blocks


def _async_reference(X, W, n):
    x, w = X.clone().requires_grad_(True), W.clone().requires_grad_(True)
    y = torch.tanh(x @ w)
    s = y * (n * (n + 1) // 2)  # the psum over ranks of (index + 1) * y
    pieces = list(torch.chunk(s, n)) + [s[:0]] * (n - len(torch.chunk(s, n)))
    loss = sum(((p**2).sum() * (i + 1) for i, p in enumerate(pieces)), torch.zeros((), dtype=F64))
    loss = loss + (y.cumsum(0) ** 2).sum()
    loss.backward()
    return loss.detach(), y.detach(), x.grad, w.grad


def _rank_async_uneven(rows):
    errs: list[str] = []
    for kind in ("1-axis", "2-axis"):
        mesh, axes, spec = _mesh(kind)
        X, W = randn(1, rows, 3, dtype=F64), randn(2, 3, 5, dtype=F64)
        want_loss, want_y, want_gx, want_gw = _async_reference(X, W, 4)
        records = {}
        for async_op in (False, True):
            where = f"{kind}, {rows} rows, async_op={async_op}"

            def f(x, w, async_op=async_op, axes=axes):
                y = torch.tanh(x @ w)
                g = fs.all_gather(y, axes, dim=0, tiled=True, async_op=async_op)
                g = g.wait() if async_op else g
                i = fs.axis_index(axes)
                s = fs.psum_scatter(g * (i + 1), axes, dim=0, tiled=True, async_op=async_op)
                s = s.wait() if async_op else s
                mine = (s**2).sum() * (i + 1) + (g.cumsum(0) ** 2).sum() / fs.axis_size(axes)
                return fs.psum(mine, axes), fs.pmean(g, axes)

            step = fs.shard_map(f, mesh=mesh, in_specs=(spec, "d k"), out_specs=("", "b k"))
            x, w = X.clone().requires_grad_(True), W.clone().requires_grad_(True)
            with fs.count_collectives() as counts:
                loss, y = step(x, w)
                loss.backward()
            records[async_op] = sorted(counts.records)
            close(errs, f"{where}: loss", loss, want_loss, F64)
            close(errs, f"{where}: gathered", y, want_y, F64)
            close(errs, f"{where}: grad x", x.grad, want_gx, F64)
            close(errs, f"{where}: grad w", w.grad, want_gw, F64)
        if records[True] != records[False]:
            errs.append(f"{kind}, {rows} rows: async collectives {records[True]} != sync {records[False]}")
    return errs


@pytest.mark.parametrize("rows", [10, 3])  # 3, 3, 3, 1 (or 3, 2, 3, 2) rows; 1, 1, 1, 0 rows
def test_async_uneven(rows):
    assert_ok(run_ranks(4, _rank_async_uneven, rows))


# =============================================================================================
# fs.fsdp_scan (and per-leaf all_gather) over uneven blocks: {even, uneven} x {prefetched scan,
# scan, sync all_gather, async all_gather} x {1-, 2-axis mesh}

L = 3
AG, RS = ("all_gather", ("dp",)), ("reduce_scatter", ("dp",))
DIMS_OF = {"w1": 0, "b1": 0, "w2": 1}


def _specs(kind):
    if kind == "1-axis":
        return {"w1": "(dp d) f", "b1": "(dp f)", "w2": "f (dp d)"}
    return {"w1": "(dp d) (tp f)", "b1": "(tp f)", "w2": "(tp f) (dp d)"}


def _mlp(p, h, psum):
    return h + psum(torch.tanh(h @ p["w1"] + p["b1"]) @ p["w2"])


def _mlp_params(d, ff):
    return [
        {
            "w1": randn(20 + i, d, ff, dtype=F64) * 0.5,
            "b1": randn(30 + i, ff, dtype=F64) * 0.1,
            "w2": randn(40 + i, ff, d, dtype=F64) * 0.5,
        }
        for i in range(L)
    ]


@contextlib.contextmanager
def _shape_checks_apart():
    """Keep the small all-gathers of block shapes (`_comm.gather_shapes`) out of the counts, in
    a list of their own, so that the rest can be compared with the even case."""
    checks: list = []
    orig = _comm.gather_shapes

    def counted(xs, g, *more, **kw):
        before = [len(r.records) for r in _counts._recorders]
        out = orig(xs, g, *more, **kw)
        for r, b in zip(_counts._recorders, before):
            checks.extend(r.records[b:])
            del r.records[b:]
        return out

    _comm.gather_shapes = counted
    try:
        yield checks
    finally:
        _comm.gather_shapes = orig


def _rank_fsdp_uneven(kind, forms):
    # uneven and even calls issue the same collectives call for call: per-leaf calls are not
    # combined in calls with uneven blocks, so the even ones are run uncombined too
    import os

    old = os.environ.get("FSHARD_COMBINE")
    os.environ["FSHARD_COMBINE"] = "0"
    try:
        with _shape_checks_apart() as checks:
            return _fsdp_uneven(kind, forms, checks)
    finally:
        if old is None:
            del os.environ["FSHARD_COMBINE"]
        else:
            os.environ["FSHARD_COMBINE"] = old


def _fsdp_uneven(kind, forms, checks):
    errs: list[str] = []
    if kind == "1-axis":
        mesh = fs.Mesh(dp=torch.distributed.get_world_size())
        psum = lambda t: t  # noqa: E731
    else:
        mesh = fs.Mesh(dp=2, tp=2)
        psum = lambda t: fs.psum(t, "tp")  # noqa: E731
    specs = _specs(kind)
    dims = {k: (None if "dp" not in s else DIMS_OF[k]) for k, s in specs.items()}
    counts: dict = {}
    for even in (True, False):
        d, ff, b = (8, 8, 8) if even else (5, 9, 6)
        ps, X = _mlp_params(d, ff), randn(9, b, d, dtype=F64)
        ref = [{k: v.clone().requires_grad_(True) for k, v in p.items()} for p in ps]
        h = X
        for p in ref:
            h = _mlp(p, h, lambda t: t)
        want = h.pow(2).sum() / h.numel()
        want.backward()
        for how in forms:
            where = f"{kind} dp={mesh.axis_size('dp')} {'even' if even else 'uneven'} {how}"
            starts: list[int] = []

            def layer(p, h, starts=starts):
                starts.append(fwd.by_kind()[AG])  # dp all-gathers issued when the layer starts
                return _mlp(p, h, psum)

            def f(params, x, how=how, size=b * d, layer=layer):
                if how.startswith("scan"):
                    h = fs.fsdp_scan(layer, params, x, "dp", dims=dims, prefetch=how != "scan")
                else:
                    h = x
                    for p in params:
                        got = {
                            k: fs.all_gather(v, "dp", dims[k], tiled=True, async_op=how == "async")
                            if dims[k] is not None
                            else v
                            for k, v in p.items()
                        }
                        if how == "async":
                            got = {k: v.wait() if isinstance(v, fs.Pending) else v for k, v in got.items()}
                        h = layer(got, h)
                return fs.psum(h.pow(2).sum(), "dp") / size

            stacked = how == "scan-prefetch, stacked"
            if stacked:
                lspecs = {k: "l " + s for k, s in specs.items()}
                params = {
                    k: fs.shard(torch.stack([p[k] for p in ps]), mesh, lspecs[k]).requires_grad_(True)
                    for k in specs
                }
                in_specs = (lspecs, "(dp b) d")
            else:
                params = [
                    {k: fs.shard(v, mesh, specs[k]).requires_grad_(True) for k, v in p.items()} for p in ps
                ]
                in_specs = ([specs] * L, "(dp b) d")
            step = fs.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs="")
            del checks[:]
            with fs.count_collectives() as fwd:
                loss = step(params, X)
            with fs.count_collectives() as bwd:
                loss.backward()
            close(errs, f"{where}: loss", loss, want, F64)
            for i in range(L):
                for k in specs:
                    got = params[k].grad.full()[i] if stacked else params[i][k].grad.full()
                    close(errs, f"{where}: grad of layer {i} {k}", got, ref[i][k].grad, F64)
            counts[even, how] = (dict(fwd.by_kind()), dict(bwd.by_kind()))
            if even and checks:
                errs.append(f"{where}: shapes compared in an even call: {checks}")
            if not even:
                if counts[even, how] != counts[True, how]:
                    errs.append(f"{where}: collectives {counts[even, how]} != even {counts[True, how]}")
            if how.startswith("scan"):
                ahead = 1 if "prefetch" in how else 0
                want_starts = [min(i + 1 + ahead, L) for i in range(L)]
                if starts != want_starts:
                    errs.append(
                        f"{where}: dp all-gathers issued when each layer starts {starts}, want {want_starts}"
                    )
                if (
                    counts[even, how][0][AG] != L
                    or counts[even, how][1][AG] != L
                    or counts[even, how][1][RS] != L
                ):
                    errs.append(
                        f"{where}: dp collectives {counts[even, how]}, want {L} all-gathers each way, {L} reduce-scatters"
                    )
    return errs


@pytest.mark.parametrize(
    ("world", "kind", "forms"),
    [
        (2, "1-axis", ("scan-prefetch", "sync")),
        (4, "1-axis", ("scan-prefetch", "scan", "scan-prefetch, stacked", "sync", "async")),
        (8, "1-axis", ("scan-prefetch", "scan-prefetch, stacked")),
        (4, "2-axis", ("scan-prefetch", "scan", "sync", "async")),
    ],
)
def test_fsdp_scan_uneven(world, kind, forms):
    assert_ok(run_ranks(world, _rank_fsdp_uneven, kind, forms))


def _rank_fsdp_blocks_error():
    mesh = fs.Mesh(dp=4)

    def f(layers, x):
        try:  # w is split along dim 1 (3, 3, 3, 1 columns), but dims says dim 0
            fs.fsdp_scan(lambda p, h: h, layers, x, "dp", dims={"w": 0})
        except fs.ArgumentError as e:
            return str(e)
        return None

    return fs.shard_map(f, mesh=mesh, in_specs=([{"w": "d (dp f)"}], "(dp b) d"), out_specs=None)(
        [{"w": torch.ones(3, 10)}], torch.ones(10, 3)
    )


def test_fsdp_scan_blocks_differ_elsewhere():
    want = (
        "fs.fsdp_scan: layers[0]['w'] has blocks of different shapes on the ranks of dp (index 0: (3, 3); "
        "index 1: (3, 3); index 2: (3, 3); index 3: (3, 1)) beyond its split dim 0, so they are not the "
        "blocks of one parameter gathered along dim 0; store it split along that one dim over dp (as "
        "fs.shard cuts it), or give its dims entry as None"
    )
    assert run_ranks(4, _rank_fsdp_blocks_error) == [want] * 4


# =============================================================================================
# Data-dependent output shapes


def _rank_ragged():
    import time

    mesh = fs.Mesh(dp=2)
    r = torch.distributed.get_rank()
    errs: list[str] = []
    X = randn(3, 8, 2, dtype=F64)

    @fs.shard_map(mesh=mesh, in_specs=("(dp b) d", "(dp b)"), out_specs=("(dp b) d", "(dp n)", "(dp u)"))
    def pick(x, m):
        y = x[m]
        return y, torch.nonzero(m).squeeze(1) + 4 * fs.axis_index("dp"), torch.unique(m.long())

    # 3 and 2 rows: torch.chunk's cut of 5 rows; 3 and 2 indices; 2 and 2 unique values
    M = torch.tensor([1, 1, 0, 1, 0, 1, 1, 0], dtype=torch.bool)
    x = X.clone().requires_grad_(True)
    with fs.count_collectives() as counts:
        y, idx, uniq = pick(x, M)
    if tuple(y.shape) != (5, 2) or tuple(idx.shape) != (5,) or tuple(uniq.shape) != (4,):
        errs.append(f"shapes {tuple(y.shape)}, {tuple(idx.shape)}, {tuple(uniq.shape)}")
    close(errs, "x[m] full", y.full(), X[M], F64)
    if not torch.equal(idx.full(), torch.nonzero(M).squeeze(1)) or uniq.full().tolist() != [0, 1, 0, 1]:
        errs.append(f"nonzero {idx.full().tolist()}, unique {uniq.full().tolist()}")
    if dict(counts.by_kind()) != {("all_gather", ("dp",)): 1}:  # the three outputs' block shapes, in one
        errs.append(f"collectives {counts}")
    close(errs, "reshard", y.reshard("b (dp d)").full(), X[M], F64)

    @fs.shard_map(mesh=mesh, in_specs="(dp b) d", out_specs="")
    def loss(y):
        return fs.psum((y**2).sum(), "dp")

    total = loss(y)  # the ragged Sharded passed on to another shard_map
    total.backward()
    close(errs, "loss of the picked rows", total, (X[M] ** 2).sum(), F64)
    close(errs, "grad through x[m]", x.grad, 2 * X * M[:, None], F64)

    # masked_select, torch.where(cond) and repeat_interleave with tensor repeats
    @fs.shard_map(mesh=mesh, in_specs=("(dp b) d", "(dp b)"), out_specs=("(dp n)", "(dp n)", "(dp n) d"))
    def more(x, m):
        rows = torch.where(m)[0]
        return torch.masked_select(x[:, 0], m), rows * 1.0, x.repeat_interleave(m.long() + 1, dim=0)

    a, b, c = more(X, M)
    close(errs, "masked_select", a.full(), X[M, 0], F64)
    if b.full().tolist() != torch.cat([torch.where(p)[0] for p in M.chunk(2)]).tolist():  # local row indices
        errs.append(f"torch.where(m) {b.full().tolist()}")
    close(errs, "repeat_interleave", c.full(), X.repeat_interleave(M.long() + 1, dim=0), F64)

    # zero communication: an even call without data-dependent ops, or whose masks are invariant
    @fs.shard_map(mesh=mesh, in_specs=("(dp b) d", "d"), out_specs="(dp b) k")
    def invariant_mask(x, keep):
        return x[:, keep] * 2

    with fs.count_collectives() as counts:
        z = invariant_mask(X, torch.tensor([False, True]))
    if counts.total:
        errs.append(f"collectives with an invariant mask: {counts}")
    close(errs, "invariant mask", z.full(), X[:, [1]] * 2, F64)

    # a mask inside one branch of fs.switch: the other ranks know nothing of it, so the call does
    # not turn uneven (a psum after it would otherwise compare shapes on one rank only and hang)
    @fs.shard_map(mesh=mesh, in_specs="(dp b) d", out_specs="d")
    def branch(x):
        picked = fs.switch(fs.axis_index("dp"), [lambda x: x[x[:, 0] > 0].sum(0), lambda x: x.sum(0)], x)
        return fs.psum(picked, "dp")

    first, second = X.chunk(2)
    close(errs, "switch", branch(X), first[first[:, 0] > 0].sum(0) + second.sum(0), F64)

    # 3 rows and 1 row: not torch.chunk's cut of 4 rows (2, 2)
    bad = torch.tensor([1, 1, 1, 0, 0, 0, 1, 0], dtype=torch.bool)
    t0 = time.monotonic()
    msg = None
    try:
        pick(X, bad)
        errs.append("3 and 1 rows did not raise")
    except fs.SpecError as e:
        msg = str(e)
    if time.monotonic() - t0 > 20:
        errs.append(f"the error took {time.monotonic() - t0:.1f} s")
    return errs, msg, r


def test_data_dependent_shapes():
    got = run_ranks(2, _rank_ragged, timeout=60)
    assert_ok([e for e, _, _ in got])
    why = (
        "so they make no global value (an op in f such as x[mask], nonzero or unique gave each rank its own "
        "size); return a block padded to a fixed size with the count of its valid rows, or gather the blocks "
        "inside f with fs.all_gather(y, 'dp', dim=0, tiled=True, invariant=True) and return that with a "
        "replicated out_spec"
    )
    want = (  # x[m] (3 rows and 1) and nonzero(m) (3 indices and 1); unique(m) (2 and 2) is fine
        "fs.shard_map(_rank_ragged.<locals>.pick): 2 outputs whose blocks make no global value:\n"
        "  - output out[0] has blocks whose shapes depend on the data (rank 0: (3, 2); rank 1: (1, 2)), and "
        f"they are not the blocks torch.chunk cuts for out_spec '(dp b) d', {why}\n"
        "  - output out[1] has blocks whose shapes depend on the data (rank 0: (3,); rank 1: (1,)), and they "
        f"are not the blocks torch.chunk cuts for out_spec '(dp n)', {why}"
    )
    assert [m for _, m, _ in got] == [want] * 2
