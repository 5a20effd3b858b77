"""The compiled twin of the autodiff matrix (tests/test_programs.py) under real inductor (code
generation included), and ranks whose compiled graphs hold different collectives.

``INDUCTOR_SUBSET`` names the programs compiled here, each with ``torch.compile(f, backend="inductor",
fullgraph=True)`` of its shard_map'd function and ``loss.backward()`` (``torch.autograd.backward``
with a fixed cotangent) outside the compiled call: data parallel, tensor parallel (the input's
gradient too), dp x tp, FSDP with per-leaf all-gathers of Sharded parameters, an explicit
``fs.psum_scatter`` and an out_spec's reduce-scatter (``| sum(tp)``), ``fs.ppermute`` as a ring
(collective matmul) and as a chain on 2 and 4 stages (a pipeline: rank 0 only sends, the last rank only receives,
the case where inductor's partitioner moved one rank's collective into its forward), ``fs.remat``
around a psum, and ``fs.axis_index(...).item()``. The outputs and the gradients of every input are
compared with the eager call and with the same computation by plain torch on the global tensors in
one process. Uneven blocks are refused by compiled calls (tests/test_compile_steps.py), so none is
here. The subset is small because inductor compiles each program on every rank (tens of seconds
on a small machine).

The pipeline on 4 stages hung under inductor in its compiled forward (gloo's timeout): on the first
stage two bubble steps send the same value (tanh(0 @ w), the stage's constants folded), and
AOTAutograd's common-subexpression elimination merged the two ppermute all-to-alls into one on that
rank only; fshard turns that elimination off while a shard_map call compiles (`_compile`).

Graphs that differ between ranks: each rank compiles its own graph, and the graphs do differ where
the program reads the rank in Python (the pipeline's stage, the collective matmul's block order,
``fs.axis_index(...).item()``: constants of each rank's graph); their collectives must not. A rank
whose traced collectives differ from the others' (a Python branch on ``mesh.axis_index``, in the
forward or only in the backward) makes every rank raise the same `CollectiveError` at trace time
(fshard/_traced_order.py), not hang as the graphs did (gloo paired an all-reduce with an
all-gather) nor return a wrong value; under ``fs.compile`` the error is raised as itself. A rank
that traces a call alone (its cache reset: a recompile on one rank only) waits a bounded time for
the others' sequences, warns, and runs its graph, whose collectives pair with the others' (the
comparison goes through the store, never through the process group the graphs use). A call
without collectives compiles as before.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, full, gelu_mlp, is_split, mse, randn
from tests.programs import PROGRAMS

# == programs of this file (the others are the matrix's, tests/programs.py) ==================


def _p_psum_scatter(mesh, dtype):
    """Megatron MLP whose row-split output is reduced by an explicit fs.psum_scatter over tp (the
    inputs and specs of the matrix's tp_partial program, x differentiated too)."""
    import fshard as fs

    base = PROGRAMS["tp_partial"](mesh, dtype, scatter=True)
    return SimpleNamespace(
        inputs=base.inputs,
        specs=base.specs,
        diff=("x", "w1", "b1", "w2"),
        local=lambda t: fs.psum_scatter(gelu_mlp(t, t["x"]), "tp", dim=0, tiled=True),
        ref=lambda t: gelu_mlp(t, t["x"]),
        out_spec="(tp b) k",
    )


def _p_remat(mesh, dtype):
    """Two residual tensor-parallel blocks, each inside fs.remat (recomputed in the backward)."""
    import fshard as fs

    ntp = mesh.shape["tp"]
    b, k, hn = 2, 4, 2
    inputs = {"x": randn(1, 2 * b, k, dtype=dtype), "y": randn(2, 2 * b, k, dtype=dtype)}
    for i in range(2):
        inputs[f"w1{i}"] = randn(10 + i, k, ntp * hn, dtype=dtype) / 2
        inputs[f"w2{i}"] = randn(20 + i, ntp * hn, k, dtype=dtype) / 2

    def block(w1, w2, h, psum=lambda y: y):
        return h + psum(torch.tanh(h @ w1) @ w2)

    def local(t):
        h = t["x"]
        for i in range(2):
            tp_block = fs.remat(lambda a, c, h: block(a, c, h, lambda y: fs.psum(y, "tp")))
            h = tp_block(t[f"w1{i}"], t[f"w2{i}"], h)
        return mse(h, t["y"])

    def ref(t):
        h = t["x"]
        for i in range(2):
            h = block(t[f"w1{i}"], t[f"w2{i}"], h)
        return mse(h, t["y"])

    weights = {f"w1{i}": "k (tp n)" for i in range(2)} | {f"w2{i}": "(tp n) k" for i in range(2)}
    return SimpleNamespace(
        inputs=inputs,
        specs={"x": "b k", "y": "b k", **weights},
        diff=("x", *weights),
        local=local,
        ref=ref,
        out_spec="",
    )


def _p_axis_index(mesh, dtype):
    """Rows scaled by this rank's index along dp, taken with .item() (a tracked int): block i of
    the batch by (i + 1) / sum over dp of (i + 1)."""
    import fshard as fs

    n = mesh.shape["dp"]
    inputs = {"x": randn(1, 2 * n, 4, dtype=dtype), "w": randn(2, 4, 3, dtype=dtype)}

    def local(t):
        i = fs.axis_index("dp").item()
        return torch.tanh(t["x"] @ t["w"]) * (i + 1) / fs.psum(i + 1, "dp")

    def ref(t):
        scale = torch.arange(1, n + 1, dtype=dtype).repeat_interleave(2).view(-1, 1) / (n * (n + 1) / 2)
        return torch.tanh(t["x"] @ t["w"]) * scale

    specs = {"x": "(dp b) d", "w": "d o"}
    return SimpleNamespace(
        inputs=inputs, specs=specs, diff=("x", "w"), local=local, ref=ref, out_spec="(dp b) o"
    )


LOCAL = {"psum_scatter": _p_psum_scatter, "remat": _p_remat, "axis_index": _p_axis_index}

# (program, mesh axes, builder options, how inputs are passed: "sharded" puts split inputs in as
# fs.Sharded, whose .grad is Sharded; "plain" passes global tensors, whose .grad is global)
INDUCTOR_SUBSET = {
    2: [
        ("dp_mlp", {"dp": 2}, {}, "plain"),
        ("tp_mlp", {"tp": 2}, {"x_grad": True}, "plain"),
        ("fsdp", {"dp": 2}, {}, "sharded"),
        ("psum_scatter", {"tp": 2}, {}, "plain"),
        ("tp_partial", {"tp": 2}, {"scatter": True}, "sharded"),
        ("cmatmul", {"tp": 2}, {}, "sharded"),
        ("pipeline", {"pp": 2}, {}, "plain"),
        ("remat", {"tp": 2}, {}, "plain"),
        ("axis_index", {"dp": 2}, {}, "plain"),
    ],
    4: [
        ("dp_tp", {"dp": 2, "tp": 2}, {}, "plain"),
        ("pipeline", {"pp": 4}, {}, "plain"),
    ],
}


# == the rank job: every program of the subset, eager vs inductor vs one process ==============


def _run_case(prog, axes, opts, how, backend="inductor"):
    import fshard as fs

    mesh = fs.Mesh(**axes)
    dtype = torch.float32
    c = (LOCAL.get(prog) or PROGRAMS[prog])(mesh, dtype, **opts)
    label = f"{prog} {'x'.join(f'{k}={v}' for k, v in axes.items())}"

    ref_in = {k: v.clone().requires_grad_(k in c.diff) for k, v in c.inputs.items()}
    want = c.ref(ref_in)
    ct = randn(99, *want.shape, dtype=dtype)
    want_grads = torch.autograd.grad(want, [ref_in[k] for k in c.diff], ct)

    def run(fn):
        args = {}
        for k, v in c.inputs.items():
            if how == "sharded" and is_split(c.specs[k], mesh):
                args[k] = fs.shard(v, mesh, c.specs[k]).requires_grad_(k in c.diff)
            else:
                args[k] = v.clone().requires_grad_(k in c.diff)
        y = fn(args)
        y = fs.full(y) if isinstance(y, fs.Sharded) else y
        torch.autograd.backward(y, ct)
        return y.detach(), [full(args[k].grad) for k in c.diff]

    f = fs.shard_map(c.local, mesh=mesh, in_specs=(c.specs,), out_specs=c.out_spec)
    errs: list[str] = []
    eager = run(f)
    torch._dynamo.reset()
    start = time.perf_counter()
    got = run(torch.compile(f, backend=backend, fullgraph=True))
    seconds = time.perf_counter() - start
    names = ["output", *(f"grad {k}" for k in c.diff)]
    for what, e, g, r in zip(names, [eager[0], *eager[1]], [got[0], *got[1]], [want, *want_grads]):
        close(errs, f"{label}: eager {what} vs one process", e, r)
        close(errs, f"{label}: inductor {what} vs one process", g, r)
        close(errs, f"{label}: inductor {what} vs eager", g, e)
    return errs, (label, seconds)


CASES = [(world, case) for world, cases in INDUCTOR_SUBSET.items() for case in cases]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "world, case", CASES, ids=[f"{c[0]}-{'x'.join(f'{k}{v}' for k, v in c[1].items())}" for _, c in CASES]
)
def test_inductor_subset_of_the_program_matrix_matches_eager_and_one_process(world, case):
    got = run_ranks(world, _run_case, *case, timeout=380)
    assert_ok([errs for errs, _ in got])
    print(got[0][1])


# == ranks whose traced collectives differ: refused on every rank at trace time ================

ORDER_FIX = (
    "Every rank must issue the same collectives over a group in the same order (op, axes, shape, dtype, "
    "call site): look for a collective in a branch on the rank or on per-rank data (if rank == 0, a loop "
    "whose length differs by rank) and make every rank reach it"
)


def _traced_error(name: str, bullets: list[str]) -> str:
    return (
        f"CollectiveError: fshard: the ranks of the mesh (ranks 0, 1) traced different collectives into their compiled "
        f"graphs of fs.shard_map({name}):\n" + "\n".join(bullets) + "\nNothing was sent: every rank "
        f"raised this error while Dynamo traced the call, before its graph ran. {ORDER_FIX}"
    )


def _rank_branch(case):
    """Each rank compiles a call whose collectives depend on its rank (a Python branch); returns the
    error each rank raised (or what it returned) and the expected message."""
    import torch.distributed as dist

    import fshard as fs

    mesh = fs.Mesh(dp=2)
    rank = dist.get_rank()
    x = randn(1, 4, 3)
    w = randn(2, 3, 3)

    if case in ("forward", "fs.compile"):

        def f(x, w):
            y = x @ w
            if rank == 0:
                y = fs.psum(y, "dp")
            return y

        first = f.__code__.co_firstlineno
        bullets = [
            f"  - rank 0: #1 all_reduce (sum) over dp of float32 (2, 3) at test_compile_inductor_programs.py:{first + 3}",
            "  - rank 1: no collective #1 (it traced 0)",
        ]
    elif case == "order":

        def f(x, w):
            y = x @ w
            if rank == 0:
                return fs.pmax(fs.psum(y, "dp"), "dp")
            return fs.psum(fs.pmax(y, "dp"), "dp")

        first = f.__code__.co_firstlineno
        bullets = [
            f"  - rank 0: #1 all_reduce (sum) over dp of float32 (2, 3) at test_compile_inductor_programs.py:{first + 3}",
            f"  - rank 1: #1 all_reduce (max) over dp of float32 (2, 3) at test_compile_inductor_programs.py:{first + 4}",
        ]
    else:  # "backward": the same forward on every rank; rank 1's weight takes no gradient

        def f(x, w):
            return x @ (w if rank == 0 else w.detach())

        first = f.__code__.co_firstlineno
        bullets = [
            f"  - rank 0: #1 all_reduce (sum) over dp of float32 (3, 3) at test_compile_inductor_programs.py:{first + 1} in the backward",
            "  - rank 1: no collective #1 (it traced 0)",
        ]
    sm = fs.shard_map(f, mesh=mesh, in_specs=("(dp b) d", "d o"), out_specs="(dp b) o")
    torch._dynamo.reset()
    want = _traced_error(f.__qualname__, bullets)
    if case == "fs.compile":  # fs.compile raises fshard's error as itself
        compiled = fs.compile(sm, backend="aot_eager")
    else:  # torch.compile: in Dynamo's InternalTorchDynamoError, with fshard's text
        compiled = torch.compile(sm, backend="aot_eager", fullgraph=True)
        want = f"InternalTorchDynamoError: {want}"
    try:
        y = compiled(x, w.requires_grad_(case == "backward"))
        return f"no error; returned {tuple(y.shape)}", want
    except Exception as err:  # noqa: BLE001  (the exception's type and text are compared)
        text = f"{type(err).__name__}: {err}"
        return text.split("\n\nfrom user code:")[0], want


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["forward", "order", "backward", "fs.compile"])
def test_ranks_that_trace_different_collectives_raise_the_same_error_at_trace_time(case):
    got = run_ranks(2, _rank_branch, case, timeout=280)
    for rank, (message, want) in enumerate(got):
        assert message == want, f"rank {rank}"


def _rank_lone_retrace(wait):
    """Rank 0 traces the call again alone (its cache reset): its check waits ``wait`` s for the
    others, warns and runs its graph, whose psum pairs with the other rank's cached graph."""
    import warnings

    import torch.distributed as dist

    import fshard as fs
    from fshard import _traced_order

    _traced_order.WAIT = wait
    mesh = fs.Mesh(dp=2)
    x = randn(1, 4, 3)

    def lone(x):
        return fs.psum(x * 2, "dp")

    torch._dynamo.reset()
    g = torch.compile(fs.shard_map(lone, mesh=mesh, in_specs="(dp b) d", out_specs="b d"), fullgraph=True)
    errs: list[str] = []
    want = 2 * (x[:2] + x[2:])
    close(errs, "first call", g(x), want)
    if dist.get_rank() == 0:
        torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        close(errs, "second call", g(x), want)
        seconds = time.perf_counter() - start
    _traced_order.WAIT = 120.0
    return errs, [str(w.message) for w in caught], seconds


@pytest.mark.timeout(300)
def test_a_rank_that_traces_a_call_alone_waits_warns_and_runs_unchecked():
    got = run_ranks(2, _rank_lone_retrace, 3.0, timeout=280)
    assert_ok([errs for errs, _, _ in got])
    assert got[0][1] == [
        "fshard: the collectives traced into the compiled graph of fs.shard_map("
        "_rank_lone_retrace.<locals>.lone) were not compared with the other ranks': rank 1 did not "
        "trace the call within 3 s (a recompile on this rank only, or a rank held up elsewhere); "
        "this call is not checked again"
    ]
    assert got[1][1] == []
    assert got[0][2] >= 3.0 and got[1][2] >= 2.0  # rank 1's graph waited in its psum for rank 0


def _rank_no_collectives():
    """A call without collectives on any rank compiles, and its check passes."""
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    x = randn(1, 4, 3)
    torch._dynamo.reset()
    g = torch.compile(fs.shard_map(lambda t: t * 3, mesh=mesh, in_specs="(dp b) d", out_specs="(dp b) d"))
    errs: list[str] = []
    close(errs, "output", fs.full(g(x)), 3 * x)
    return errs


@pytest.mark.timeout(300)
def test_a_call_without_collectives_compiles_on_every_rank():
    assert_ok(run_ranks(2, _rank_no_collectives, timeout=280))
