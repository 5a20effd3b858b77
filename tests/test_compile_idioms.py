"""Idioms of shard_map'd code under plain ``torch.compile(fullgraph=True)``, against eager and one
process: dividing by ``fs.axis_size`` (a plain int taken from the mesh's shape; it was an attribute
of a trace-time axis group, which Dynamo could not hold: InternalTorchDynamoError), a residual
around a psum inside ``fs.remat`` with Dynamo's checkpoint setting left as it was (fshard sets
``skip_fwd_side_effects_in_bwd_under_checkpoint`` itself while tracing the region; it raised a
TracingError asking the user to), and ``fs.axis_index(axis).item()`` (a tracked int, which Dynamo
traced through ``int.__int__`` and lost: "'VaryingInt' object has no attribute '_fshard_vma'"; each
rank's graph now holds its own index, tracked as in eager), a weight used twice, and ring attention
(keys and values passed around the dp ring by ``fs.ppermute``). Values and gradients of a weighted
sum, on a 2-axis mesh. Then what stays refused of a tracked int in a compiled call, with eager's
counterpart: a Python branch on it (eager taints the call, so a replicated out_spec refuses the
value it made), and ``.item()`` of an integer tensor the graph computes (eager tracks it).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, randn

ROWS, D = 8, 4


def _by_index(w, x):
    """Rows ``i :`` of this rank's block scaled by ``(i + 1) / sum over dp of (i + 1)``, the other
    rows by ``i``, with ``i = fs.axis_index("dp").item()``."""
    import fshard as fs

    i = fs.axis_index("dp").item()
    y = x @ w
    return torch.cat([y[:i] * i, y[i:] * (i + 1) / fs.psum(i + 1, "dp")])


def _by_index_ref(W, X):
    blocks = (X @ W).chunk(2)  # dp = 2: rank i's block; psum(i + 1) = 3
    return torch.cat([torch.cat([b[:i] * i, b[i:] * (i + 1) / 3]) for i, b in enumerate(blocks)])


def _ring_attention(w, x):
    """Attention of this rank's rows over every row of the batch, the keys and values passed
    around the dp ring with ``fs.ppermute`` (ring attention): each step's scores and values kept,
    one softmax over all of them."""
    import fshard as fs

    n = fs.axis_size("dp")
    ring = [(i, (i + 1) % n) for i in range(n)]
    q, k, v = x @ w, x, x
    scores, values = [q @ k.T], [v]
    for _ in range(n - 1):
        k, v = fs.ppermute(k, "dp", ring), fs.ppermute(v, "dp", ring)
        scores.append(q @ k.T)
        values.append(v)
    return torch.softmax(torch.cat(scores, -1), -1) @ torch.cat(values)


def _rank_idioms():
    import fshard as fs

    torch._dynamo.reset()
    mesh = fs.Mesh(dp=2, tp=2)
    programs = {
        "x @ w / axis_size": (
            lambda w, x: (x @ w) / fs.axis_size(("dp", "tp")),
            lambda W, X: (X @ W) / 4,
        ),
        "remat residual around psum": (
            lambda w, x: fs.remat(lambda w, h: h + fs.psum(torch.tanh(h @ w), "tp") / 2)(w, x),
            lambda W, X: X + torch.tanh(X @ W),
        ),
        # a tracked int: each rank's graph holds its own index; its arithmetic, psum and slices
        "axis_index().item()": (_by_index, _by_index_ref),
        # one weight used twice (a Dynamo guard on w.T once failed: ___check_obj_id(args[1].T, ...))
        "a weight used twice": (lambda w, x: (x @ w) @ w.T, lambda W, X: (X @ W) @ W.T),
        "ring attention over dp": (_ring_attention, lambda W, X: torch.softmax((X @ W) @ X.T, -1) @ X),
    }
    W, X = randn(0, D, D) / 2, randn(1, ROWS, D)
    weights = torch.linspace(0.5, 1.5, ROWS * D).view(ROWS, D)

    def run(fn):
        w, x = W.clone().requires_grad_(), X.clone().requires_grad_()
        y = fn(w, x)
        y = fs.full(y) if isinstance(y, fs.Sharded) else y
        return (y.detach(), *torch.autograd.grad((y * weights).sum(), (w, x)))

    errs: list[str] = []
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
        for name, (body, ref) in programs.items():
            f = fs.shard_map(body, mesh=mesh, in_specs=("...", "(dp b) d"), out_specs="(dp b) d")
            want, eager = run(ref), run(f)
            got = run(torch.compile(f, backend="aot_eager", fullgraph=True))
            for what, e, g, r in zip(("value", "grad w", "grad x"), eager, got, want):
                close(errs, f"{name}: eager {what} vs one process", e, r)
                close(errs, f"{name}: compiled {what} vs one process", g, r)
    return errs


@pytest.mark.timeout(240)
def test_compiled_idioms_match_eager_and_one_process():
    assert_ok(run_ranks(4, _rank_idioms, timeout=200))


# -- what a compiled call refuses of a tracked int, and what eager does with it ------------------


def _rank_tracked_int_refusals():
    import fshard as fs

    cases = {
        # a Python branch on it: eager runs it and taints the call (the replicated out_spec then
        # refuses what it made, the psum's result included); compiled, Dynamo would bake one
        # rank's branch into the graph
        "branch on axis_index().item()": (
            lambda x: fs.psum(x.sum(0), "dp") * (2.0 if fs.axis_index("dp").item() == 0 else 1.0),
            "d",
        ),
        # an int the graph computes: eager tracks it; compiled, no int subclass can hold its value
        "item() of a computed int": (lambda x: x * (x > 0).sum().item(), "(dp b) d"),
    }
    mesh = fs.Mesh(dp=2, tp=2)
    X = randn(2, ROWS, D)
    out = {}
    for name, (body, out_spec) in cases.items():
        torch._dynamo.reset()
        f = fs.shard_map(body, mesh=mesh, in_specs="(dp b) d", out_specs=out_spec)
        got = []
        for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
            try:
                y = fn(X)
                got.append(("value", fs.full(y) if isinstance(y, fs.Sharded) else y))
            except Exception as e:  # noqa: BLE001  (the text is the assertion)
                got.append(("error", f"{type(e).__name__}: {e}".split("\n\nfrom user code:")[0]))
        out[name] = got
    return out


WHERE = "fs.shard_map(_rank_tracked_int_refusals.<locals>.<lambda>)"


@pytest.mark.timeout(120)
def test_compiled_call_refuses_a_branch_on_a_tracked_int_and_an_int_the_graph_computes():
    X = randn(2, ROWS, D)
    line = _line('fs.axis_index("dp").item() == 0')  # (the branch's)
    for r, out in enumerate(run_ranks(4, _rank_tracked_int_refusals, timeout=100)):
        eager, compiled = out["branch on axis_index().item()"]
        assert eager == (
            "error",
            f"SpecError: {WHERE}: 1 problem with out_specs (replication check):\n"
            "  - out varies over mesh axis dp but out_spec 'd' says it is replicated over dp; reduce it "
            "inside f (fs.psum / fs.pmean over 'dp'), mark it as a partial sum with '| sum(dp)', split a "
            "dim over dp in the out_spec, or pass check=False if you know it is the same on every rank\n"
            "f branched on a value that varies across ranks (a comparison of a value that varies over "
            f"mesh axis 'dp', at test_compile_idioms.py:{line}), so the ranks may have run different code "
            "from there on: every value made after it (and any value it may have chosen) counts as "
            "varying over those axes; reduce the output after the branch (the result of fs.psum / "
            "fs.pmean / fs.all_gather(..., invariant=True) over them is the same on every rank), or "
            "select with torch.where(cond, a, b) instead of the branch",
        ), (r, eager)
        assert compiled == (
            "error",
            f"InternalTorchDynamoError: TracingError: {WHERE}: a comparison of a value that varies"
            " over mesh axis 'dp' in a compiled call (Dynamo would branch at trace time on one "
            "rank's value); select between values with torch.where(cond, a, b), or call it eagerly",
        ), (r, compiled)
        eager, compiled = out["item() of a computed int"]
        assert eager[0] == "value", (r, eager)
        want = torch.cat([b * (b > 0).sum() for b in X.chunk(2)])  # each dp block by its own count
        torch.testing.assert_close(eager[1], want, msg=f"rank {r}")
        assert compiled == (
            "error",
            f"InternalTorchDynamoError: TracingError: {WHERE}: t.item() of an integer tensor that"
            " varies over mesh axis 'dp' and that the compiled graph computes (its value is known only "
            "when the graph runs, and a tracked Python int needs it at trace time); keep it a tensor "
            "(x * t, x[t], torch.where(t == 0, a, b)), or call it eagerly",
        ), (r, compiled)


def _line(text: str) -> int:
    """The line of this file that holds ``text``."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)
