"""Features on uneven blocks (torch.chunk's cut) and data-dependent shapes, on real gloo ranks.

- ``async_op=True`` all_gather and psum_scatter accept exactly the blocks the synchronous forms
  accept (uneven 10 over 4, empty blocks 3 over 4, on 1- and 2-axis meshes): values and
  gradients of both against one process, and the same collectives.
"""

from __future__ import annotations

import pytest
import torch

import fshard as fs
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
