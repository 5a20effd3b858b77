"""``torch.compile(fullgraph=True)`` of shard_map'd code, on real gloo ranks (2).

Each compiled function is compiled once per rank job (compilation is the slow part) with a
counting ``aot_eager``-style backend (`tests.helpers.compile_counter`) that records how many
graphs Dynamo made and the ``_c10d_functional`` collectives in the forward and backward graphs. Values and gradients are
compared with the eager call and with the same computation by plain torch on the global tensors
in one process; the collectives in the graphs with eager's `fs.count_collectives` (eager with
``bucket_mb=None``: one all-reduce per parameter, as the compiled backward does today); graph
counts after repeated calls show there is no recompilation. The refusals and the trace-time
errors are asserted by their full text.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, compile_counter, full, mse, randn

N = 2  # ranks
CALLS = 10  # calls of each compiled function with fixed shapes: still one graph


def _dp_body(w1, w2, x, y):
    import fshard as fs

    return fs.pmean(mse(torch.tanh(x @ w1) @ w2, y), "dp")


def _tp_body(w1, w2, x):
    import fshard as fs

    return (fs.psum(torch.tanh(x @ w1) @ w2, "tp") ** 2).mean()


def _fsdp_body(w, x, y):
    import fshard as fs

    return fs.pmean(mse(x @ fs.all_gather(w, "dp", dim=0, tiled=True), y), "dp")


def _params(*shapes, seed=0):
    return [randn(seed + i, *s).requires_grad_() for i, s in enumerate(shapes)]


def _reference(loss_fn, params, *data):
    """Loss and gradients by plain torch on the global tensors."""
    ps = [p.detach().clone().requires_grad_() for p in params]
    loss = loss_fn(*ps, *data)
    return loss.detach(), torch.autograd.grad(loss, ps)


def _compiled_case(errs, out, name, fn, args, want_loss, want_grads, eager_fn, grads_of=None):
    """Compile ``fn`` (returning (loss, grads) or a loss), compare, call it CALLS times."""
    import fshard as fs

    backend, stats = compile_counter()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    with fs.count_collectives() as eager_counts:
        eager = eager_fn(*args)
    got = compiled(*args)
    for _ in range(CALLS - 1):
        got = compiled(*args)
    if grads_of is not None:  # fn calls backward itself: its gradients are in .grad
        got = (got, grads_of())
    loss, grads = got if isinstance(got, tuple) else (got, ())
    close(errs, f"{name}: compiled loss vs one process", loss, want_loss)
    eager_loss = eager[0] if isinstance(eager, tuple) else eager
    close(errs, f"{name}: compiled loss vs eager", loss, eager_loss)
    for i, (g, w) in enumerate(zip(grads, want_grads)):
        close(errs, f"{name}: compiled grad {i} vs one process", g, w)
    out[name] = {"graphs": stats["graphs"], "ops": sorted(stats["ops"]), "eager": len(eager_counts.records)}


def _rank_compile():
    torch._dynamo.reset()
    # fs.value_and_grad and loss.backward() inside the compiled function: Dynamo traces them
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        return _compile_cases()


def _compile_cases():
    import fshard as fs

    errs: list[str] = []
    out: dict = {}
    dp, tp = fs.Mesh(dp=N), fs.Mesh(tp=N)
    w1, w2 = _params((4, 8), (8, 3))
    x, y = randn(10, 8, 4), randn(11, 8, 3)
    in_dp = ("...", "...", "(dp b) d", "(dp b) o")
    loss_dp = fs.shard_map(_dp_body, mesh=dp, in_specs=in_dp, out_specs="...")
    per_param = fs.shard_map(_dp_body, mesh=dp, in_specs=in_dp, out_specs="...", bucket_mb=None)
    want_loss, want_grads = _reference(lambda a, b, x, y: mse(torch.tanh(x @ a) @ b, y), [w1, w2], x, y)

    # 1. the shard_map'd function itself
    _compiled_case(errs, out, "dp loss", loss_dp, (w1, w2, x, y), want_loss, (), per_param)
    # 2. fs.value_and_grad of it
    vg = fs.value_and_grad(loss_dp, argnums=(0, 1))
    vg_eager = fs.value_and_grad(per_param, argnums=(0, 1))
    _compiled_case(errs, out, "dp value_and_grad", vg, (w1, w2, x, y), want_loss, want_grads, vg_eager)

    # 3. a function calling it, then loss.backward()
    def step(w1, w2, x, y):
        loss = loss_dp(w1, w2, x, y)
        loss.backward()
        return loss.detach()

    def eager_step(w1, w2, x, y):
        loss = per_param(w1, w2, x, y)
        loss.backward()
        return loss.detach()

    def grads_of():  # accumulated over the eager call and the compiled calls
        return w1.grad / (CALLS + 1), w2.grad / (CALLS + 1)

    _compiled_case(
        errs, out, "dp backward", step, (w1, w2, x, y), want_loss, want_grads, eager_step, grads_of
    )
    w1.grad = w2.grad = None

    # 4. tensor parallel: column- then row-parallel weights, a psum over tp
    v1, v2 = _params((6, 8), (8, 5), seed=20)
    xt = randn(30, 4, 6)
    tp_loss = fs.shard_map(_tp_body, mesh=tp, in_specs=("d (tp h)", "(tp h) o", "b d"), out_specs="...")
    want_loss, want_grads = _reference(lambda a, b, x: ((torch.tanh(x @ a) @ b) ** 2).mean(), [v1, v2], xt)
    vg = fs.value_and_grad(tp_loss, argnums=(0, 1))
    _compiled_case(errs, out, "tp value_and_grad", vg, (v1, v2, xt), want_loss, want_grads, vg)

    # 5. FSDP: a parameter sharded over dp, gathered in f (its gradient reduce-scattered back)
    (u,) = _params((4, 6), seed=40)
    xf, yf = randn(41, 8, 4), randn(42, 8, 6)
    fsdp_loss = fs.shard_map(
        _fsdp_body, mesh=dp, in_specs=("(dp d) h", "(dp b) d", "(dp b) h"), out_specs="..."
    )
    want_loss, want_grads = _reference(lambda w, x, y: mse(x @ w, y), [u], xf, yf)
    vg = fs.value_and_grad(fsdp_loss)
    _compiled_case(
        errs,
        out,
        "fsdp value_and_grad",
        lambda *a: (lambda lg: (lg[0], (lg[1],)))(vg(*a)),
        (u, xf, yf),
        want_loss,
        want_grads,
        vg,
    )
    return errs, out


def test_compiled_shard_map_matches_eager_and_one_process_with_one_graph():
    got = run_ranks(N, _rank_compile, timeout=115)
    assert_ok([errs for errs, _ in got])
    for _, out in got:
        for name, case in out.items():
            assert case["graphs"] == 1, (name, case)  # fullgraph, and no recompile over CALLS calls
        assert out["dp loss"]["ops"] == ["all_reduce"]  # the pmean
        # the pmean, and one gradient all-reduce per replicated parameter (eager bucket_mb=None)
        assert out["dp value_and_grad"]["ops"] == ["all_reduce"] * 3
        assert out["dp backward"]["ops"] == ["all_reduce"] * 3
        # the psum (its transpose, pvary, moves nothing); the weights are global tensors sliced
        # in shard_map, so each one's gradient block is gathered back (LocalSlice's transpose)
        assert out["tp value_and_grad"]["ops"] == ["all_gather_into_tensor"] * 2 + ["all_reduce"]
        # the all-gather in f and the pmean; backward: the all-gather's transpose (a reduce-scatter)
        # and the gather of the gradient block of the sliced global parameter
        assert out["fsdp value_and_grad"]["ops"] == [
            "all_gather_into_tensor",
            "all_gather_into_tensor",
            "all_reduce",
            "reduce_scatter_tensor",
        ]
        for name, case in out.items():
            assert len(case["ops"]) == case["eager"], (name, case)  # the same collectives as eager


def _unreduced_body(w1, w2, x, y):
    return mse(torch.tanh(x @ w1) @ w2, y)  # varies over dp: no pmean


def _raised(fn, *args) -> str:
    """The exception ``fn(*args)`` raised, as ``type: text``. Under torch.compile Dynamo wraps an
    exception raised at trace time in its ``InternalTorchDynamoError``, whose text is fshard's
    error (``type: text``) followed by Dynamo's notes on where it was traced."""
    try:
        fn(*args)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "nothing raised"


def _fshard_part(text: str) -> str:
    """fshard's error in a compiled call's error text (what precedes Dynamo's notes)."""
    head = "InternalTorchDynamoError: "
    return text[len(head) :].split("\n\nfrom user code:")[0] if text.startswith(head) else text


def _rank_refusals():
    import fshard as fs

    torch._dynamo.reset()
    dp = fs.Mesh(dp=N)
    w1, w2 = _params((4, 8), (8, 3))
    x, y = randn(10, 8, 4), randn(11, 8, 3)
    in_dp = ("...", "...", "(dp b) d", "(dp b) o")
    args = (w1, w2, x, y)
    out = {}
    # the replication check, at trace time with eager's message
    unreduced = fs.shard_map(_unreduced_body, mesh=dp, in_specs=in_dp, out_specs="...")
    out["check eager"] = _raised(unreduced, *args)
    out["check compiled"] = _raised(torch.compile(unreduced, backend="eager", fullgraph=True), *args)
    # fs.compile raises fshard's error as itself (a user's `except fs.SpecError` catches it)
    try:
        fs.compile(unreduced, backend="eager")(*args)
        out["check fs.compile"] = "nothing raised"
    except fs.SpecError as e:
        out["check fs.compile"] = f"{type(e).__name__}: {e}"
    # what compiled calls do not support yet: refused at trace time, naming the construct
    plain = fs.shard_map(_dp_body, mesh=dp, in_specs=in_dp, out_specs="...")
    # fs.no_sync compiles (in depth: tests/test_compile_no_sync.py)
    with fs.no_sync():
        got = torch.compile(plain, backend="eager", fullgraph=True)(*args)
        want = plain(*args)
    out["no_sync"] = (float(got), float(want))
    torch._dynamo.reset()
    with fs.debug():  # compiles, its checks in the graph (in depth: tests/test_compile_debug.py)
        out["debug"] = [
            torch.compile(plain, backend="eager", fullgraph=True)(*args).tolist(),
            plain(*args).tolist(),
        ]
    torch._dynamo.reset()
    staged = fs.shard_map(
        lambda p, x: fs.psum((x @ p).sum(), "dp"), mesh=dp, in_specs=(None, "(dp b) d"), out_specs=""
    )
    # an fs.PerRank argument compiles (each rank's graph takes its own tree; pipelines of per-rank
    # stages in depth: tests/test_compile_stages.py): the sum over ranks of x_r @ (r + 1) w1
    per_rank = fs.PerRank.build(dp, "dp", lambda i: w1 * (i + 1))
    got = torch.compile(staged, backend="eager", fullgraph=True)(per_rank, x)
    rows = x.shape[0] // N
    want = sum((x[r * rows : (r + 1) * rows] @ (w1 * (r + 1))).sum() for r in range(N))
    out["PerRank"] = (float(got), float(staged(per_rank, x)), float(want))
    # torch.func transforms inside f (their compiled graphs lost the implicit casts: a gradient of
    # an invariant parameter missed its psum, silently) and around a shard_map'd function
    inside = {
        "grad": lambda w1, w2, x, y: torch.func.grad(_unreduced_body)(w1, w2, x, y),
        "vmap": lambda w1, w2, x, y: torch.func.vmap(lambda r: torch.tanh(r @ w1) @ w2)(x),
        "jvp": lambda w1, w2, x, y: torch.func.jvp(lambda w: _unreduced_body(w, w2, x, y), (w1,), (w1,))[1],
    }
    outs = {"grad": "... | sum(dp)", "vmap": "(dp b) o", "jvp": "| sum(dp)"}
    for name, body in inside.items():
        f = fs.shard_map(body, mesh=dp, in_specs=in_dp, out_specs=outs[name])
        out[f"torch.func.{name} inside"] = _raised(torch.compile(f, backend="eager", fullgraph=True), *args)
    # fs.count_collectives does not see inside a call compiled by plain torch.compile: refused,
    # also for a function compiled before the counting began (Dynamo guards on it, and traces
    # again); fs.compile'd calls are counted (tests/test_compile_steps.py, inductor)
    counted = torch.compile(plain, backend="eager", fullgraph=True)
    close([], "", counted(*args), plain(*args))
    with fs.count_collectives() as counts:
        out["count_collectives"] = _raised(counted, *args)
    out["counted"] = len(counts.records)
    around = torch.func.grad(plain)
    out["torch.func.grad around"] = _raised(torch.compile(around, backend="eager", fullgraph=True), *args)
    return out


REFUSED = (
    " is not supported inside torch.compile yet (fshard refuses rather than compiling something that "
    "would mean another thing than the eager call); "
)


def test_compiled_shard_map_raises_eagers_errors_and_refuses_what_it_does_not_support():
    got = run_ranks(N, _rank_refusals, timeout=110)
    for out in got:
        assert out["check compiled"].startswith("InternalTorchDynamoError: ")
        assert _fshard_part(out["check compiled"]) == out["check eager"]
        assert out["check fs.compile"] == out["check eager"]
        assert out["check eager"] == (
            "SpecError: fs.shard_map(_unreduced_body): 1 problem with out_specs (replication check):\n"
            "  - out varies over mesh axis dp but out_spec '...' says it is replicated over dp; reduce it "
            "inside f (fs.psum / fs.pmean over 'dp'), mark it as a partial sum with '| sum(dp)', split a dim "
            "over dp in the out_spec, or pass check=False if you know it is the same on every rank"
        )
        assert _fshard_part(out["count_collectives"]) == (
            "TracingError: fs.shard_map(_dp_body) under fs.count_collectives" + REFUSED + "compile the "
            "step with fs.compile and the inductor backend, whose compiled calls fs.count_collectives "
            "counts, or count an eager call of the step"
        )
        assert out["counted"] == 0
        for name in ("grad inside", "vmap inside", "jvp inside", "grad around"):
            assert _fshard_part(out[f"torch.func.{name}"]) == (
                "TracingError: torch.func transforms (grad, vjp, jvp, vmap, jacrev, hessian, ...) inside "
                "or around a shard_map'd function"
                + REFUSED.replace(" is ", " are ", 1)[:-2]
                + "; under them Dynamo drops the custom backward and jvp of the autograd Functions fshard's "
                "collectives are (pytorch/pytorch#193279): call the transform eagerly, or use "
                "fs.value_and_grad / loss.backward() in the compiled step"
            ), name
        compiled_debug, eager_debug = out["debug"]
        assert compiled_debug == pytest.approx(eager_debug, rel=1e-6)
        compiled, eager, want = out["PerRank"]
        assert compiled == pytest.approx(want, rel=1e-9) and eager == pytest.approx(want, rel=1e-9)
        compiled, eager = out["no_sync"]
        assert compiled == pytest.approx(eager, rel=1e-6)


def _mixed_body(p, x, y, scale):
    import fshard as fs

    w1 = fs.all_gather(p["w1"], "dp", dim=0, tiled=True)
    w2 = fs.all_gather(p["w2"], "dp", dim=1, tiled=True)
    return fs.pmean(mse(torch.tanh(x @ w1) @ w2 * scale, y), "dp")


def _rank_trace_time_plans():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):  # fs.value_and_grad traced
        return _trace_time_plans()


def _trace_time_plans():
    import fshard as fs

    errs: list[str] = []
    out: dict = {}
    dp = fs.Mesh(dp=N)
    w1, w2 = randn(60, 4, 8), randn(61, 8, 4)
    x, y = randn(62, 8, 4), randn(63, 8, 4)
    # w1 is stored as its in_spec says, w2 in another layout (moved at the call), x and y are
    # global tensors (sliced), the scale a Python number (passed through)
    params = {"w1": fs.shard(w1, dp, "(dp d) h"), "w2": fs.shard(w2, dp, "(dp h) o")}
    in_specs = ({"w1": "(dp d) h", "w2": "h (dp o)"}, "(dp b) d", "(dp b) o", None)
    f = fs.value_and_grad(fs.shard_map(_mixed_body, mesh=dp, in_specs=in_specs, out_specs="..."))
    backend, stats = compile_counter()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    want_loss, want_grads = _reference(lambda a, b, x, y: mse(torch.tanh(x @ a) @ b * 0.5, y), [w1, w2], x, y)
    # compiled, eager, compiled again: the eager call leaves nothing a guard of the graph reads
    for i, fn in enumerate([compiled, compiled, f, compiled, compiled]):
        loss, grads = fn(params, x, y, 0.5)
        close(errs, f"call {i}: loss vs one process", loss, want_loss)
        for k, w in zip(("w1", "w2"), want_grads):
            close(errs, f"call {i}: grad {k} vs one process", full(grads[k]), w)
            if grads[k].spec != params[k].spec:
                errs.append(f"call {i}: grad {k} has spec {grads[k].spec!r}, want {params[k].spec!r}")
    out["graphs"] = stats["graphs"]
    out["ops"] = sorted(stats["ops"])
    # spec errors found by the planning, raised at trace time with eager's text
    in_bad = ("h e", "(dp h o", "(dp b) e", "(dp b) o")
    bad = fs.shard_map(_dp_body, mesh=dp, in_specs=in_bad, out_specs="...")
    args = (w1, w2[:, :3], x, y[:, :3])
    out["in_specs eager"] = _raised(bad, *args)
    out["in_specs compiled"] = _raised(torch.compile(bad, backend="eager", fullgraph=True), *args)
    bad_out = fs.shard_map(
        _dp_body, mesh=dp, in_specs=in_bad[:1] + ("...",) + in_bad[2:], out_specs="| sum(dq)"
    )
    args = (w1.T, w2[:, :3], x, y[:, :3])
    out["out_specs eager"] = _raised(bad_out, *args)
    out["out_specs compiled"] = _raised(torch.compile(bad_out, backend="eager", fullgraph=True), *args)
    return errs, out


def test_compiled_calls_plan_at_trace_time_as_eager_does():
    got = run_ranks(N, _rank_trace_time_plans, timeout=110)
    assert_ok([errs for errs, _ in got])
    for _, out in got:
        assert out["graphs"] == 1, out  # no recompile over the calls, also after the eager one
        # w2 moved from dim 0 to dim 1 (one all-to-all, and back in the backward), the two
        # gathers and their reduce-scatters, the pmean
        assert out["ops"] == [
            "all_gather_into_tensor",
            "all_gather_into_tensor",
            "all_reduce",
            "all_to_all_single",
            "all_to_all_single",
            "reduce_scatter_tensor",
            "reduce_scatter_tensor",
        ], out["ops"]
        for what in ("in_specs", "out_specs"):
            assert out[f"{what} compiled"].startswith("InternalTorchDynamoError: "), out[f"{what} compiled"]
            assert _fshard_part(out[f"{what} compiled"]) == out[f"{what} eager"], what
        assert out["in_specs eager"] == (
            "SpecError: fs.shard_map(_dp_body): 2 problems with in_specs:\n"
            '  - args[1]: invalid spec "(dp h o": unbalanced parenthesis\n'
            "      (dp h o\n"
            "      ^\n"
            '    fix: close the group with ")"\n'
            "  - dim 'e' has size 8 in args[0] but size 4 in args[2] (spec '(dp b) e', shape (8, 4)); a "
            "label names one logical dim, so its global size must agree everywhere; rename one of them, "
            "or write _ for a dim that should not tie"
        )
        assert out["out_specs eager"] == (
            "SpecError: fs.shard_map(_dp_body): 1 problem with out_specs:\n"
            "  - out_specs '| sum(dq)': sum(dq) names 'dq', which is not an axis of Mesh(dp=2) (did you "
            "mean 'dp'?)"
        )
