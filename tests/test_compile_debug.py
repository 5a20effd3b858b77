"""``fs.debug`` under ``torch.compile``: the same cross-rank checks as eager, at every run of the graph.

A compiled call under ``fs.debug`` (or ``FSHARD_DEBUG=1``) holds the debug checks in its graph: the
digests of its plain tensor inputs (and of fs.PerRank inputs, between the copies of an index) and
the signature of its outputs' structure and local shapes are all-gathered over the mesh, and the
``fshard::debug_check`` op compares them each time the graph runs, raising eager's `TracingError`,
with eager's message, on every rank. The table below runs each check eagerly and compiled
(``aot_eager``, and ``inductor`` for one), on a 1-axis mesh of 2 ranks and a 2-axis mesh of 4:

=====================================  =========================================================
case                                   compiled under fs.debug
=====================================  =========================================================
inputs agree                           values and gradients of eager and of one process; one
                                       graph over the calls (no recompile); outputs of a dynamic
                                       size (the batch changed) compared as the graph runs
a plain input differs on one rank      eager's TracingError on every rank, the graph raising
                                       at its run (the first call, and a later one)
outputs' local shapes differ by rank   eager's TracingError on every rank
fs.PerRank values differ in a copy     eager's TracingError on every rank (2-axis mesh)
debug turned off again                 the graph without checks (a recompile), values as eager
=====================================  =========================================================
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import close, compile_counter, randn


def _raised(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "nothing raised"


def _loss_body(w, x, axes):
    import fshard as fs

    return fs.psum(torch.tanh(x @ w).square().sum(), axes)


def _rank_debug(shape: dict, backend: str):
    import torch.distributed as dist

    import fshard as fs

    torch._dynamo.reset()
    mesh = fs.Mesh(**shape)
    axes = " ".join(mesh.axis_names)
    rank = dist.get_rank()
    errs: list[str] = []
    out: dict = {}
    names = tuple(mesh.axis_names)

    def loss(w, x):
        return _loss_body(w, x, names)

    f = fs.shard_map(loss, mesh=mesh, in_specs=("d e", f"({axes} b) d"), out_specs="")
    counted, stats = compile_counter()
    step = torch.compile(f, backend=counted if backend == "aot_eager" else backend, fullgraph=True)
    x = randn(1, 4 * mesh.size, 6)
    for i in range(3):  # inputs that agree: eager's values and gradients, and one process's
        w = randn(2 + i, 6, 5).requires_grad_()
        with fs.debug():
            got = step(w, x)
            got.backward()
        w_ref = w.detach().clone().requires_grad_()
        want = torch.tanh(x @ w_ref).square().sum()
        want.backward()
        close(errs, f"call {i} value", got, want)
        close(errs, f"call {i} grad", w.grad, w_ref.grad)
    out["graphs"] = stats["graphs"]
    # a plain (global) input that differs on the last rank: eager's error, raised by the graph
    w = randn(7, 6, 5)
    bad = w + 1 if rank == mesh.size - 1 else w
    with fs.debug():
        out["input eager"] = _raised(lambda: f(bad, x))
        out["input compiled"] = _raised(lambda: step(bad, x))
        close(errs, "after a failed check", step(w, x), torch.tanh(x @ w).square().sum())
        out["input compiled again"] = _raised(lambda: step(bad, x))
    # debug off again: no check (the graph without it), the values eager gives
    close(errs, "debug off", step(bad, x), f(bad, x))
    # outputs of a dynamic size (the batch changed between calls): their sizes are compared as the
    # graph runs; they agree, so nothing is raised
    torch._dynamo.reset()
    double = torch.compile(
        fs.shard_map(lambda x: x * 2, mesh=mesh, in_specs=f"({axes} b) d", out_specs=f"({axes} b) d"),
        backend=backend,
        fullgraph=True,
    )
    with fs.debug():
        for rows in (2, 3, 5):
            xs = randn(rows, rows * mesh.size, 6)
            close(errs, f"dynamic batch {rows}", double(xs).full(), xs * 2)
    # outputs whose local shapes differ by rank (a Python branch on the rank)
    torch._dynamo.reset()  # (static shapes: the calls above made the batch dim of shard_map calls dynamic)
    cut = fs.shard_map(
        lambda x: x if dist.get_rank() == 0 else x[:1],
        mesh=mesh,
        in_specs=f"({axes} b) d",
        out_specs=f"({axes} b) d",
    )
    with fs.debug():
        out["outputs eager"] = _raised(lambda: cut(x))
        out["outputs compiled"] = _raised(lambda: torch.compile(cut, backend=backend, fullgraph=True)(x))
    return errs, out


def _rank_per_rank_debug(backend: str):
    import fshard as fs

    torch._dynamo.reset()
    mesh = fs.Mesh(dp=2, pp=2)
    dp, pp = mesh.axis_index("dp"), mesh.axis_index("pp")
    step = fs.shard_map(
        lambda p, x: (p["w"] * x).sum(), mesh=mesh, in_specs=(None, "d"), out_specs="... | sum(pp)"
    )
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    x = torch.arange(4.0)
    out: dict = {}
    good = fs.PerRank({"w": torch.full((4,), float(pp + 1))}, "pp", mesh)
    # the same shapes on the copies along dp, but rank 2 (dp 1, pp 0) holds other values
    bad = fs.PerRank({"w": torch.full((4,), float(pp + 1 + (dp and not pp)))}, "pp", mesh)
    with fs.debug():
        out["good"] = (float(compiled(good, x)), float(step(good, x)))
        out["bad eager"] = _raised(lambda: step(bad, x))
        out["bad compiled"] = _raised(lambda: compiled(bad, x))
    return out


MESHES = {"dp2": {"dp": 2}, "dp2xtp2": {"dp": 2, "tp": 2}}


@pytest.mark.timeout(240)  # inductor compiles C++ kernels with gcc: slow on a loaded 2-core machine
@pytest.mark.parametrize(
    ("mesh", "backend"), [("dp2", "aot_eager"), ("dp2xtp2", "aot_eager"), ("dp2", "inductor")]
)
def test_debug_checks_run_in_the_compiled_graph_with_eagers_errors(mesh, backend):
    shape = MESHES[mesh]
    n = 1
    for s in shape.values():
        n *= s
    got = run_ranks(n, _rank_debug, shape, backend, timeout=200)
    last = n - 1
    for rank, (errs, out) in enumerate(got):
        assert errs == [], (rank, errs)
        if backend == "aot_eager":
            assert out["graphs"] == 1, out  # the checks are in the graph: no recompile over the calls
        assert out["input eager"] == (
            f"TracingError: fs.shard_map(_rank_debug.<locals>.loss) [debug]: args[0] differs across ranks (equal within: "
            f"ranks {', '.join(map(str, range(last)))}; rank {last}); a plain tensor argument is the global value, "
            f"the same on every rank: seed random generators the same way on every rank, take one rank's copy with "
            f"fs.shard(x, mesh, spec, src=0), or pass per-rank blocks as fs.Sharded(local, mesh, spec)"
            if last > 1
            else "TracingError: fs.shard_map(_rank_debug.<locals>.loss) [debug]: args[0] differs across ranks (equal within: "
            "rank 0; rank 1); a plain tensor argument is the global value, the same on every rank: seed random "
            "generators the same way on every rank, take one rank's copy with fs.shard(x, mesh, spec, src=0), or "
            "pass per-rank blocks as fs.Sharded(local, mesh, spec)"
        ), (rank, out["input eager"])
        assert out["input compiled"] == out["input compiled again"] == out["input eager"], (rank, out)
        assert out["outputs eager"] == (
            "TracingError: fs.shard_map(_rank_debug.<locals>.<lambda>) [debug]: f returned outputs whose structure "
            f"or local shapes differ across ranks (equal within: rank 0; ranks {', '.join(map(str, range(1, n)))}"
            if n > 2
            else "TracingError: fs.shard_map(_rank_debug.<locals>.<lambda>) [debug]: f returned outputs whose "
            "structure or local shapes differ across ranks (equal within: rank 0; rank 1"
        ) + (
            "); a data-dependent shape (x[mask], nonzero, unique) on a varying value differs per rank: pad it to a "
            "fixed size (torch.where with a fill value) or return the mask with the values"
        ), (rank, out["outputs eager"])
        assert out["outputs compiled"] == out["outputs eager"], (rank, out)


def test_debug_compares_per_rank_copies_in_the_compiled_graph():
    text = (
        "TracingError: fs.shard_map(_rank_per_rank_debug.<locals>.<lambda>) [debug]: the per-rank values over "
        "'pp' differ between ranks that hold the same index (index 0: rank 0 vs rank 2); they are replicated over "
        "'dp': initialize them with the same seed on every rank of an index, and update them with gradients that "
        "are summed over 'dp'"
    )
    for rank, out in enumerate(run_ranks(4, _rank_per_rank_debug, "aot_eager", timeout=200)):
        # the sum over pp of (pp + 1) * sum(x) = 1 * 6 + 2 * 6
        assert out["good"] == (18.0, 18.0), (rank, out)
        assert out["bad eager"] == out["bad compiled"] == text, (rank, out)
