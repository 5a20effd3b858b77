"""Values that could escape varying-axes tracking: shapes of uneven blocks, tracked Python numbers.

- Shapes: with 10 rows cut 3, 3, 3, 1 over ``dp``, ``x.shape[0]`` / ``x.size(0)`` / ``x.numel()``
  of a varying block are tracked numbers, so ``torch.tensor(n)``, ``fs.psum(n, "dp")`` and
  ``fs.pmean`` give the global answer (10) on every rank, on 1- and 2-axis meshes; ``len(x)``
  raises; even calls give plain ints. Expected values are the global tensor's, in one process.
- Tracked numbers (``.item()``): ``int()``, ``float()``, ``math.sqrt``, ``bool()`` and
  comparisons raise ``fs.TracingError`` with the full message on every rank; arithmetic,
  ``round`` and ``math.floor`` stay tracked (the replication check sees them).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok

F64 = torch.float64


# =============================================================================================
# shapes of uneven blocks


def _rank_uneven_shapes(X, mesh_shape):
    mesh = fs.Mesh(**mesh_shape)
    errs: list[str] = []
    dp = "dp"

    def f(x):
        n = x.shape[0]
        got = {
            "type": type(n).__name__,
            "psum_int": fs.psum(n, dp),
            "psum_size": fs.psum(x.size(0), dp),
            "psum_numel": fs.psum(x.numel(), dp),
            "pmean_int": fs.pmean(n, dp),
            "psum_float": fs.psum(n * 0.5, dp),
            "plain_psum": fs.psum(1, dp),  # a plain number keeps its meaning: the axis size
            "psum_all": fs.psum(n, tuple(mesh_shape)),  # summed over dp, times the size of the rest
        }
        rows = fs.psum(torch.tensor(n, dtype=F64), dp)  # a tensor made from the shape is varying
        mean = fs.psum(x.sum(0), dp) / rows
        try:
            len(x)
            got["len"] = "no error"
        except fs.TracingError as e:
            got["len"] = str(e)
        return rows, mean, got

    g = fs.shard_map(f, mesh=mesh, in_specs="(dp b) d", out_specs=("", "d", None), check=False)
    rows, mean, got = g(X)
    even = fs.shard_map(lambda x: type(x.shape[0]).__name__, mesh=mesh, in_specs="(dp b) d", out_specs=None)
    got_even = even(X[: mesh_shape["dp"]])  # one row per rank: plain ints
    if got_even != "int":
        errs.append(f"even call: {got_even}")
    total, world, d = X.shape[0], mesh_shape["dp"], X.shape[1]
    want_mean = X.mean(0)
    if rows.item() != total:
        errs.append(f"psum of torch.tensor(n): {rows.item()}")  # 12 or 4 when the shape escaped
    if not torch.allclose(mean, want_mean):
        errs.append(f"mean: {mean} != {want_mean}")
    for k, want in (
        ("psum_int", total),
        ("psum_size", total),
        ("psum_numel", total * d),
        ("pmean_int", total / world),
        ("psum_float", total * 0.5),
        ("plain_psum", world),
        ("psum_all", total * dist.get_world_size() // world),
    ):
        if got[k] != want or type(got[k]) is not type(want):
            errs.append(f"{k}: {got[k]!r} ({type(got[k]).__name__}), want {want!r}")
    return errs, got["type"], got["len"]


@pytest.mark.parametrize(
    "world, rows, mesh_shape",
    [(4, 10, {"dp": 4}), (2, 5, {"dp": 2}), (4, 5, {"dp": 2, "tp": 2}), (4, 10, {"tp": 1, "dp": 4})],
)
def test_shapes_of_uneven_blocks_are_tracked(world, rows, mesh_shape):
    # 10 rows over 4 ranks: 3, 3, 3, 1; 5 over 2: 3, 2
    X = torch.randn(rows, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    got = run_ranks(world, _rank_uneven_shapes, X, mesh_shape)
    assert_ok([e for e, _, _ in got])
    assert [t for _, t, _ in got] == ["VaryingInt"] * world
    assert [m for _, _, m in got] == [
        "fs.shard_map(_rank_uneven_shapes.<locals>.f): len() of a tensor that varies over mesh axis 'dp', "
        "in a call with uneven blocks (torch.chunk's cut), gives a plain int that may differ between "
        "ranks, which fshard cannot track; use x.shape[0], which is tracked in such calls"
    ] * world
