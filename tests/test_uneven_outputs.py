"""Outputs in uneven blocks: every rank checks every rank's blocks alike, on real gloo ranks.

A rank whose block is the one its out_spec describes cannot see alone that another rank's is
not; in a call with uneven blocks the ranks exchange their split outputs' shapes (one small
all-gather per call, for all of its outputs) and either all return the Sharded values or all
raise the same SpecError, before any of the outputs' collectives, so the next collective pairs
as it should. Even calls exchange nothing.

- A per-rank statistic (one row per rank) returned with the batch's spec: 3 rows over 2 ranks
  (2, 1) and over 4 ranks (1, 1, 1, 0) on 1- and 2-axis meshes, combining on and off, under
  ``fs.debug()`` too: the full message on every rank; the same statistic with a dim label of its
  own is valid (values and gradients against one process).
- A partial sum whose shape differs across the ranks that sum it; two wrong outputs in one call.
- The cost: one all-gather of shapes for a call with several split outputs, none for an even call
  (nor for even inputs whose out_spec reduce-scatters a partial sum into uneven blocks).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, env_vars, randn

F64 = torch.float64


def _mesh(kind: str):
    """``(mesh, axes, batch spec with label b, the same with a label of its own)``."""
    if kind == "dp=2":
        return fs.Mesh(dp=2), "dp", "(dp b) d", "(dp r) d"
    if kind == "dp=4":
        return fs.Mesh(dp=4), "dp", "(dp b) d", "(dp r) d"
    return fs.Mesh(dp=2, tp=2), ("dp", "tp"), "(dp tp b) d", "(dp tp r) d"


def _blocks(X, kind):
    """torch.chunk's blocks of X's rows, in rank order (nested for two axes), empty ones included."""

    def chunk(t, n):
        pieces = list(t.chunk(n))
        return pieces + [t[:0]] * (n - len(pieces))

    if kind == "dp=2":
        return chunk(X, 2)
    if kind == "dp=4":
        return chunk(X, 4)
    return [q for p in chunk(X, 2) for q in chunk(p, 2)]


def _rank_statistic(kind, combine, debug):
    mesh, axes, spec, own = _mesh(kind)
    errs: list[str] = []
    X = randn(1, 3, 2, dtype=F64)

    def stat(x):  # one row per rank: a statistic of its block, and a loss
        return x.sum(0, keepdim=True), fs.psum((x**2).sum(), axes)

    wrong = fs.shard_map(stat, mesh=mesh, in_specs=spec, out_specs=(spec, ""))
    right = fs.shard_map(stat, mesh=mesh, in_specs=spec, out_specs=(own, ""))
    msg = None
    with env_vars(FSHARD_COMBINE=combine), fs.debug() if debug else contextlib.nullcontext():
        try:
            got = wrong(X)
            errs.append(f"no error: returned {type(got[0]).__name__} of shape {tuple(got[0].shape)}")
        except fs.SpecError as e:
            msg = str(e)
        # the ranks still agree about collectives: the next calls pair and give the right values
        x = X.clone().requires_grad_(True)
        s, loss = right(x)
        (s.full() ** 2).sum().backward()
    xr = X.clone().requires_grad_(True)
    rows = torch.stack([b.sum(0) for b in _blocks(xr, kind)])
    (rows**2).sum().backward()
    if tuple(s.shape) != (mesh.size, 2):
        errs.append(f"statistic shape {tuple(s.shape)}")
    close(errs, "statistics", s.full(), rows, F64)
    close(errs, "loss", loss, (X**2).sum(), F64)
    close(errs, "grad x", x.grad, xr.grad, F64)
    return errs, msg


def _want_statistic(kind):
    name = "_rank_statistic.<locals>.stat"
    tail = (
        "return the block the spec describes (torch.chunk's cut of the global value: the first blocks are the "
        "longer), give the dim a label no input uses to return each rank's block as it is (e.g. '{axes} r)' "
        "for one row per rank, such as a statistic of its block), or gather the blocks inside f with "
        "fs.all_gather(y, {arg}, dim=0, tiled=True, invariant=True) and return that with a replicated out_spec"
    )
    if kind == "dp=2":
        return (
            f"fs.shard_map({name}): output out[0] with out_spec '(dp b) d' returns blocks that make no global "
            "value split over dp: the ranks return local shapes ranks 0, 1: (1, 2), but dim 0 is labelled 'b', "
            "of size 3 among the inputs, so the global shape is (3, 2), which torch.chunk cuts into rank 0: "
            "(2, 2); rank 1: (1, 2); " + tail.format(axes="(dp", arg="'dp'")
        )
    if kind == "dp=4":
        return (
            f"fs.shard_map({name}): output out[0] with out_spec '(dp b) d' returns blocks that make no global "
            "value split over dp: the ranks return local shapes ranks 0, 1, 2, 3: (1, 2), but dim 0 is labelled "
            "'b', of size 3 among the inputs, so the global shape is (3, 2), which torch.chunk cuts into ranks "
            "0, 1, 2: (1, 2); rank 3: (0, 2); " + tail.format(axes="(dp", arg="'dp'")
        )
    return (
        f"fs.shard_map({name}): output out[0] with out_spec '(dp tp b) d' returns blocks that make no global "
        "value split over (dp tp): the ranks return local shapes ranks 0, 1, 2, 3: (1, 2), but dim 0 is "
        "labelled 'b', of size 3 among the inputs, so the global shape is (3, 2), which torch.chunk cuts into "
        "ranks 0, 1, 2: (1, 2); rank 3: (0, 2); " + tail.format(axes="(dp tp", arg="('dp', 'tp')")
    )


@pytest.mark.parametrize(
    ("world", "kind"), [(2, "dp=2"), (4, "dp=4"), (4, "dp=2 x tp=2")], ids=["dp2", "dp4", "dp2xtp2"]
)
@pytest.mark.parametrize(
    ("combine", "debug"), [("1", False), ("0", False), ("1", True)], ids=["", "nocombine", "debug"]
)
@pytest.mark.timeout(300)  # several calls and backwards per rank, on a loaded machine
def test_per_rank_statistic_raises_on_every_rank(world, kind, combine, debug):
    got = run_ranks(world, _rank_statistic, kind, combine, debug, timeout=240)
    assert_ok([e for e, _ in got])
    assert [m for _, m in got] == [_want_statistic(kind)] * world


def _rank_more_errors():
    mesh = fs.Mesh(dp=4)
    X = randn(2, 3, 2, dtype=F64)  # 1, 1, 1, 0 rows
    out = []

    @fs.shard_map(mesh=mesh, in_specs="(dp b) d", out_specs="(dp n) d | sum(dp)")
    def partial(x):  # each rank's block as a partial sum of the whole: shapes differ across dp
        return x * 2

    @fs.shard_map(
        mesh=mesh, in_specs="(dp b) d", out_specs={"a": "(dp b) d", "b": "(dp b) d", "c": "(dp b) d"}
    )
    def two(x):
        narrow = [lambda x: x] * 3 + [lambda x: x[:, :1]]  # one rank returns a narrower block
        return {
            "a": x.sum(0, keepdim=True),
            "b": torch.cat([x, x]),
            "c": fs.switch(fs.axis_index("dp"), narrow, x),
        }

    for fn in (partial, two):
        with fs.count_collectives() as c:
            try:
                fn(X)
                out.append("no error")
            except fs.SpecError as e:
                out.append(str(e))
        out.append(dict(c.by_kind()))  # the shapes' all-gather only: no reduce-scatter was issued
    right = fs.shard_map(lambda x: fs.psum(x.sum(), "dp"), mesh=mesh, in_specs="(dp b) d", out_specs="")
    out.append(right(X).item() == pytest.approx(X.sum().item()))
    return out


@pytest.mark.timeout(300)  # several calls and backwards per rank, on a loaded machine
def test_partial_sum_and_several_outputs():
    got = run_ranks(4, _rank_more_errors, timeout=240)
    partial = (
        "fs.shard_map(_rank_more_errors.<locals>.partial): output out is a partial sum over dp (out_spec "
        "'(dp n) d | sum(dp)'), but its shape differs across the ranks of dp (ranks 0, 1, 2: (1, 2); rank 3: "
        "(0, 2)); the ranks that sum a value must return the same shape: pad it to one size "
        "(torch.nn.functional.pad), or reduce it to a shape that agrees first"
    )
    fix = (
        "return the block the spec describes (torch.chunk's cut of the global value: the first blocks are the "
        "longer), give the dim a label no input uses to return each rank's block as it is (e.g. '(dp r)' for "
        "one row per rank, such as a statistic of its block), or gather the blocks inside f with "
        "fs.all_gather(y, 'dp', dim={d}, tiled=True, invariant=True) and return that with a replicated out_spec"
    )
    two = (
        "fs.shard_map(_rank_more_errors.<locals>.two): 3 outputs whose blocks make no global value:\n"
        "  - output out['a'] with out_spec '(dp b) d' returns blocks that make no global value split over dp: "
        "the ranks return local shapes ranks 0, 1, 2, 3: (1, 2), but dim 0 is labelled 'b', of size 3 among "
        "the inputs, so the global shape is (3, 2), which torch.chunk cuts into ranks 0, 1, 2: (1, 2); rank 3: "
        "(0, 2); " + fix.format(d=0) + "\n"
        "  - output out['b'] with out_spec '(dp b) d' returns blocks that make no global value split over dp: "
        "the ranks return local shapes ranks 0, 1, 2: (2, 2); rank 3: (0, 2), but dim 0 is labelled 'b', of "
        "size 3 among the inputs, so the global shape is (3, 2), which torch.chunk cuts into ranks 0, 1, 2: "
        "(1, 2); rank 3: (0, 2); " + fix.format(d=0) + "\n"
        "  - output out['c'] with out_spec '(dp b) d' returns blocks that make no global value split over dp: "
        "the ranks return local shapes ranks 0, 1, 2: (1, 2); rank 3: (0, 1), but dim 1 is not split (every "
        "rank returns it whole, of one size), so the global shape is (3, 2), which torch.chunk cuts into "
        "ranks 0, 1, 2: (1, 2); rank 3: (0, 2); " + fix.format(d=0)
    )
    gathers = {("all_gather", ("dp",)): 1}
    assert got == [[partial, gathers, two, gathers, True]] * 4


def _rank_costs():
    mesh = fs.Mesh(dp=4)
    errs: list[str] = []
    X, P = randn(3, 10, 3, dtype=F64), randn(4, 10, 3, dtype=F64)

    @fs.shard_map(
        mesh=mesh, in_specs=("(dp b) d", "n d"), out_specs=("(dp b) d", "(dp _) d", "(dp n) d | sum(dp)")
    )
    def f(x, p):
        return x * 2, x + 1, p * (fs.axis_index("dp") + 1)

    # uneven inputs (3, 3, 3, 1 rows) exchange the outputs' shapes; even inputs whose partial sum
    # the out_spec reduce-scatters unevenly (3, 3, 3, 1) know them without; even ones, too
    for rows, prows in ((10, 10), (8, 10), (8, 8)):
        with fs.count_collectives() as c:
            a, b, s = f(X[:rows], P[:prows])
        want = {("reduce_scatter", ("dp",)): 1}
        if rows == 10:
            want[("all_gather", ("dp",))] = 1  # the three outputs' shapes, in one all-gather
        where = f"{rows} rows, partial sum of {prows}"
        if dict(c.by_kind()) != want:
            errs.append(f"{where}: collectives {dict(c.by_kind())}, want {want}")
        for name, got, ref in (("a", a, X[:rows] * 2), ("b", b, X[:rows] + 1), ("s", s, P[:prows] * 10)):
            if tuple(got.shape) != tuple(ref.shape):
                errs.append(f"{where}: {name} shape {tuple(got.shape)}")
            close(errs, f"{where}: {name}", got.full(), ref, F64)
    return errs


@pytest.mark.timeout(300)  # several calls and backwards per rank, on a loaded machine
def test_one_gather_per_uneven_call_none_when_even():
    assert_ok(run_ranks(4, _rank_costs, timeout=240))
