"""Values that could escape varying-axes tracking: shapes of uneven blocks, tracked Python numbers.

- Shapes: with 10 rows cut 3, 3, 3, 1 over ``dp``, ``x.shape[0]`` / ``x.size(0)`` / ``x.numel()``
  of a varying block are tracked numbers, so ``torch.tensor(n)``, ``fs.psum(n, "dp")`` and
  ``fs.pmean`` give the global answer (10) on every rank, on 1- and 2-axis meshes; ``len(x)``
  gives the local length (a plain int) and taints the call; even calls give plain ints. Expected
  values are the global tensor's, in one process.
- Tracked numbers (``.item()``): ``int()``, ``float()``, ``math.sqrt``, ``bool()`` and
  comparisons give plain values and taint the call (what is made afterwards varies like the
  number: a replicated claim on it fails the replication check, naming the line), on every
  rank; arithmetic, ``round`` and ``math.floor`` stay tracked (the replication check sees them).
"""

from __future__ import annotations

import math

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
        got["len"] = len(x)  # plain, this rank's length; taints what is made afterwards
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
    dp = [r // 2 if mesh_shape == {"dp": 2, "tp": 2} else r for r in range(world)]
    assert [m for _, _, m in got] == [len(X.chunk(mesh_shape["dp"])[i]) for i in dp]


# =============================================================================================
# gradient buckets: reduced in an order every rank agrees on, whatever order f uses parameters in

SHAPES = {"a": (6, 40), "b": (6, 30), "c": (6, 20)}


def _order_params():
    gen = torch.Generator().manual_seed(3)
    return {k: torch.randn(*s, generator=gen, dtype=F64) / 3 for k, s in SHAPES.items()}


_TERMS = {  # one term per parameter; f adds them up in a rank-dependent order
    "a": lambda p, x: (x @ p["a"]).pow(2).sum(),
    "b": lambda p, x: torch.tanh(x @ p["b"]).sum(),
    "c": lambda p, x: (x @ p["c"]).sin().sum(),
}


def _rank_order(X, mesh_shape, axis, bucket_mbs):
    mesh = fs.Mesh(**mesh_shape)
    r = mesh.axis_index(axis)  # a plain int: each rank uses the parameters in its own order
    order = [["a", "b", "c"], ["c", "b", "a"], ["b", "c", "a"], ["c", "a", "b"]][r % 4]
    out = []
    for bucket_mb in bucket_mbs:
        params = {k: v.clone().requires_grad_(True) for k, v in _order_params().items()}

        def f(p, x):
            total = 0
            for k in order:  # the twins' taps are made in this order: the ready order follows it
                total = total + _TERMS[k](p, x)
            return fs.psum(total, tuple(mesh_shape))

        step = fs.shard_map(f, mesh=mesh, in_specs=("...", "(dp b) d"), out_specs="", bucket_mb=bucket_mb)
        with fs.count_collectives() as c:
            loss = step(params, X)
            loss.backward()
        out.append((loss.detach(), {k: p.grad for k, p in params.items()}, c.records))
    return out


@pytest.mark.parametrize(
    "world, mesh_shape, axis",
    [(2, {"dp": 2}, "dp"), (4, {"dp": 4}, "dp"), (4, {"dp": 2, "tp": 2}, "tp")],
)
def test_parameters_used_in_rank_dependent_order(world, mesh_shape, axis):
    X = torch.randn(8, 6, generator=torch.Generator().manual_seed(4), dtype=F64)
    p = {k: v.clone().requires_grad_(True) for k, v in _order_params().items()}
    copies = world // mesh_shape["dp"]  # tp copies of each row block each add their terms
    ref = copies * sum(t(p, X) for t in _TERMS.values())
    ref.backward()
    small, one = 1500 / 2**20, 25.0  # one bucket per parameter (c alone, then b, then a); one bucket
    for r, got in enumerate(run_ranks(world, _rank_order, X, mesh_shape, axis, (small, one))):
        for (loss, grads, records), bucket_mb in zip(got, (small, one)):
            torch.testing.assert_close(loss, ref.detach(), msg=f"rank {r} loss")
            for k in SHAPES:
                torch.testing.assert_close(grads[k], p[k].grad, msg=f"rank {r} grad {k} ({bucket_mb} MiB)")
            grad_reduces = [n for kind, _, n in records if kind == "all_reduce" and n > 8]
            want = [6 * 20 * 8, 6 * 30 * 8, 6 * 40 * 8] if bucket_mb == small else [6 * 90 * 8]
            assert grad_reduces == want, (r, bucket_mb, records)


# =============================================================================================
# tracked Python numbers: every way out raises, on every rank; the rest stays tracked

ESCAPE_ROUTES = {
    "float": lambda v: torch.tensor(float(v)),
    "int": lambda v: torch.tensor(int(v)),
    "math.sqrt": lambda v: torch.tensor(math.sqrt(v)),
    "math.exp": lambda v: torch.tensor(math.exp(v)),
    "if": lambda v: torch.tensor(1.0 if v else 0.0),
    "<": lambda v: torch.tensor(1.0 if v < 0 else 0.0),
    "==": lambda v: torch.tensor(float(v == 2.0)),
    "int <": lambda v: torch.tensor(1.0 if round(v) < 3 else 0.0),
}
TRACKED_ROUTES = {  # a per-rank value that must fail the replication check
    "arith": lambda v: torch.tensor(v * 2 + 1),
    "round": lambda v: torch.tensor(round(v)),
    "floor": lambda v: torch.tensor(math.floor(v) * 1.0),
    "divmod": lambda v: torch.tensor(divmod(v, 1.5)[0]),
    "int item": lambda v: torch.ones(3)[: round(v) % 2 + 1].sum(),
}


def _rank_scalar_escapes():
    mesh = fs.Mesh(dp=dist.get_world_size())
    got = {}
    for name, route in {**ESCAPE_ROUTES, **TRACKED_ROUTES}.items():

        def f(x, route=route):
            return route(x.sum().item())

        try:
            fs.shard_map(f, mesh=mesh, in_specs="(dp b)", out_specs="")(torch.arange(1.0, 5.0))
            got[name] = "no error"
        except (fs.TracingError, fs.SpecError) as e:
            got[name] = f"{type(e).__name__}: {e}"
    fmt = fs.shard_map(lambda x: f"{x.sum().item():.1f}", mesh=mesh, in_specs="(dp b)", out_specs=None)
    got["format"] = fmt(torch.arange(1.0, 5.0))  # logging: formats the value (untracked)
    return got


def test_tracked_number_escapes_taint_the_call():
    texts = run_ranks(2, _rank_scalar_escapes)
    assert texts[0] == {**texts[1], "format": "3.0"} and texts[1]["format"] == "7.0"
    check = (
        "SpecError: fs.shard_map(_rank_scalar_escapes.<locals>.f): 1 problem with out_specs (replication "
        "check):\n  - out varies over mesh axis dp but out_spec '' says it is replicated over dp; reduce it "
        "inside f (fs.psum / fs.pmean over 'dp'), mark it as a partial sum with '| sum(dp)', split a dim over "
        "dp in the out_spec, or pass check=False if you know it is the same on every rank"
    )
    what = {
        "float": "float() (or a math function) of",
        "int": "int() of",
        "math.sqrt": "float() (or a math function) of",
        "math.exp": "float() (or a math function) of",
        "if": "bool() (a Python if, while, and/or or assert) of",
        "<": "a comparison of",
        "==": "a comparison of",
        "int <": "a comparison of",
    }
    want = {
        k: (
            f"{check}\nf branched on a value that varies across ranks ({w} a value that varies over mesh axis "
            f"'dp', at test_escapes.py:{ESCAPE_ROUTES[k].__code__.co_firstlineno}), so the ranks may have run "
            "different code from there on: every value made after it (and any value it may have chosen) counts "
            "as varying over those axes; reduce the output after the branch (the result of fs.psum / fs.pmean / "
            "fs.all_gather(..., invariant=True) over them is the same on every rank), or select with "
            "torch.where(cond, a, b) instead of the branch"
        )
        for k, w in what.items()
    }
    want.update({k: check for k in TRACKED_ROUTES})
    assert {k: v for k, v in texts[0].items() if k != "format"} == want
