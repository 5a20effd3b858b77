"""``fs.no_sync`` in compiled calls: gradient accumulation over micro-batches, on real gloo ranks (4;
``fs.compile`` with inductor on 2).

A table over meshes (``dp=4``, also with ``compute_dtype=float32, reduce_dtype=float64``;
``dp=2 x tp=2`` with tensor-parallel weights beside replicated ones and an ``fs.Sharded``
parameter) and over which calls are compiled (every micro-batch; the micro-batches under
``fs.no_sync`` only; the last one only: one compiled function for the three; and eager calls
without gradient buckets, ``bucket_mb=None``, which defer as compiled ones do): after two
accumulation cycles the gradients equal plain torch's on the whole batch in one process, and
eager's; the backward of a compiled call under ``fs.no_sync`` makes no all-reduce for the deferred
parameters (gloo's own count), the call after it as many as a call with nothing pending (nothing
is left pending); the compiled function makes two graphs (under ``fs.no_sync``, and with gradients
pending) and no more over the second cycle or with eager calls mixed in. ``fs.compile`` (inductor)
of a whole step that calls ``loss.backward()`` likewise, and a dp x pp pipeline of ``fs.PerRank``
stages (its casts' backward once ran under the tracking mode and failed to trace). The errors of what a compiled call
cannot reduce are asserted by their full text.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, compile_counter

WORLD = 4
MICRO = 3  # micro-batches per accumulation cycle
HOWS = ("all", "no_sync only", "last only", "eager, no buckets")  # which calls are compiled


def _init():
    g = torch.Generator().manual_seed(0)
    shapes = {"ln": (6,), "w1": (6, 8), "b1": (8,), "w2": (8, 3), "b2": (3,), "s": (3,)}
    return {k: torch.randn(*s, generator=g, dtype=torch.float64) / 2 for k, s in shapes.items()}


def _batches():
    return [
        torch.randn(8, 6, generator=torch.Generator().manual_seed(10 + i), dtype=torch.float64)
        for i in range(MICRO)
    ]


def _model(p, x, psum_tp=None):
    h = torch.tanh((x * p["ln"]) @ p["w1"] + p["b1"]) @ p["w2"]
    if psum_tp is not None:
        h = psum_tp(h)
    return ((h + p["b2"]) * p["s"]) ** 2


def _reference():
    """Plain torch, one process: the gradients of the summed losses of every micro-batch."""
    p = {k: v.clone().requires_grad_() for k, v in _init().items()}
    total = sum(_model(p, x).mean() + 0.01 * (p["w1"] ** 2).sum() for x in _batches())
    return dict(zip(p, torch.autograd.grad(total, list(p.values()))))


def _maps(mesh_kind, world=WORLD, bucket_mb=25.0):
    """The loss as a shard_map, the parameters (the one given as fs.Sharded in ``sharded``), and
    how to read a parameter's gradient as the global tensor."""
    import fshard as fs

    mixed = {}
    if mesh_kind in ("dp", "dp mixed"):
        mesh = fs.Mesh(dp=world)
        specs = {k: "..." for k in _init()}

        def loss(p, x):
            return fs.pmean(_model(p, x).mean(), "dp") + 0.01 * (p["w1"] ** 2).sum()

        if mesh_kind == "dp mixed":  # computed in float32, gradients summed in float64
            mixed = {"compute_dtype": torch.float32, "reduce_dtype": torch.float64}
    else:  # dp=2 x tp=2: w1, b1, w2 split over tp (their gradients reduced at once: each block is
        # a slice, not a parameter); ln, b2, s replicated (deferred); s given as fs.Sharded
        mesh = fs.Mesh(dp=2, tp=2)
        specs = {"ln": "...", "w1": "d (tp h)", "b1": "(tp h)", "w2": "(tp h) o", "b2": "...", "s": "..."}

        def loss(p, x):
            data = _model(p, x, lambda h: fs.psum(h, "tp")).mean()
            return fs.pmean(data, "dp") + 0.01 * fs.psum((p["w1"] ** 2).sum(), "tp")

    f = fs.shard_map(
        loss, mesh=mesh, in_specs=(specs, "(dp b) d"), out_specs="", bucket_mb=bucket_mb, **mixed
    )
    return mesh, f


def _params(mesh, mesh_kind):
    import fshard as fs

    p = {k: v.clone().requires_grad_() for k, v in _init().items()}
    if mesh_kind == "dp2xtp2":  # s as fs.Sharded (replicated): its local block is the parameter
        s = p.pop("s")
        p["s"] = fs.Sharded(s, mesh, "...")
    return p


def _grads(p):
    return {k: (v.local if hasattr(v, "local") else v).grad for k, v in p.items()}


def _leaves(p):
    return [v.local if hasattr(v, "local") else v for v in p.values()]


def _gloo_all_reduces(fn, *args) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args)
    return sum(e.name == "gloo:all_reduce" for e in prof.events())


def _cycle(p, xs, under, last, counts):
    """One accumulation cycle: the micro-batches but the last under fs.no_sync (``under``), then
    ``last``; the all-reduces gloo ran in each backward go in ``counts``."""
    import fshard as fs

    for v in _leaves(p):
        v.grad = None
    with fs.no_sync():
        for x in xs[:-1]:
            loss = under(p, x)
            counts.append(_gloo_all_reduces(loss.backward))
    loss = last(p, xs[-1])
    counts.append(_gloo_all_reduces(loss.backward))
    return _grads(p)


def _rank_table(ref):
    errs: list = []
    out: dict = {}
    xs = _batches()
    for mesh_kind in ("dp", "dp2xtp2", "dp mixed"):
        torch._dynamo.reset()
        mesh, f = _maps(mesh_kind)
        eager_p = _params(mesh, mesh_kind)
        eager_counts: list = []
        eager = _cycle(eager_p, xs, f, f, eager_counts)
        for k, want in ref.items():  # (the tp-split weights are global tensors: their gradients too)
            close(errs, f"{mesh_kind} eager: grad {k} vs one process", eager[k], want)
        # one compiled function for the three ways: each graph is made once (under no_sync, with
        # gradients pending; the plain one last) and reused however eager calls are mixed in; and
        # eager calls without gradient buckets (bucket_mb=None), which defer as compiled ones do
        backend, stats = compile_counter()
        c = torch.compile(f, backend=backend, fullgraph=True)
        _, f0 = _maps(mesh_kind, bucket_mb=None)
        for how in HOWS:
            under, last = {
                "all": (c, c),
                "no_sync only": (c, f),
                "last only": (f, c),
                "eager, no buckets": (f0, f0),
            }[how]
            p = _params(mesh, mesh_kind)
            for rep in range(2):
                counts: list = []
                got = _cycle(p, xs, under, last, counts)
                for k in ref:
                    close(errs, f"{mesh_kind} {how} cycle {rep}: grad {k} vs eager", got[k], eager[k])
                out[(mesh_kind, how, rep)] = counts
                out[(mesh_kind, how, rep, "graphs")] = stats["graphs"]
            out[(mesh_kind, "pending left", how)] = _pending_left()
        # the backward of a compiled call with nothing pending: one all-reduce per gradient it reduces
        p = _params(mesh, mesh_kind)
        loss = c(p, xs[0])
        out[(mesh_kind, "plain")] = _gloo_all_reduces(loss.backward)
        out[(mesh_kind, "graphs")] = stats["graphs"]
    return errs, out


def _rank_fs_compile():
    """fs.compile (inductor, its all-reduces bucketed) of a step that calls loss.backward(), on 2 ranks."""
    import fshard as fs

    errs: list = []
    xs = _batches()
    torch._dynamo.reset()
    mesh, f = _maps("dp", world=2)

    def step(p, x):
        loss = f(p, x)
        loss.backward()
        return loss.detach()

    compiled = fs.compile(step)
    p = _params(mesh, "dp")
    plain = _gloo_all_reduces(compiled, p, xs[0])  # (compiled with nothing pending)
    eager_p = _params(mesh, "dp")
    eager = _cycle(eager_p, xs, f, f, [])
    counts = []
    for rep in range(2):
        for v in _leaves(p):
            v.grad = None
        with fs.no_sync():
            for x in xs[:-1]:
                counts.append(_gloo_all_reduces(compiled, p, x))
        counts.append(_gloo_all_reduces(compiled, p, xs[-1]))
        for k, v in _grads(p).items():
            close(errs, f"fs.compile cycle {rep}: grad {k} vs eager", v, eager[k])
    return errs, (plain, counts)


def _pending_left():
    from fshard import _buckets

    return len(_buckets._PENDING), _buckets._any_pending


def _rank_errors():
    import fshard as fs

    torch._dynamo.reset()
    out = {}
    xs = _batches()
    # a compiled call after fs.no_sync that does not use a parameter with pending gradients
    mesh, f = _maps("dp")

    def other(p, x):
        return fs.pmean((x @ p["w1"]).mean(), "dp") + sum((v**2).sum() for k, v in p.items() if k != "w1")

    g = fs.shard_map(other, mesh=mesh, in_specs=({k: "..." for k in _init()}, "(dp b) d"), out_specs="")
    p = _params(mesh, "dp")
    c = torch.compile(f, backend="aot_eager", fullgraph=True)
    with fs.no_sync():
        c(p, xs[0]).backward()
    out["unused"] = _raised(torch.compile(g, backend="aot_eager", fullgraph=True), p, xs[1])
    f(p, xs[1]).backward()  # an eager call reduces what is pending
    out["left after eager"] = _pending_left()
    # a parameter whose pending sum is over dp, summed over dp and tp by a later call: eager and compiled
    mesh = fs.Mesh(dp=2, tp=2)

    def loss(p, x):
        return fs.pmean(((x * p["ln"]) ** 2).mean(), ("dp", "tp"))

    over_dp = fs.shard_map(loss, mesh=mesh, in_specs=({"ln": "..."}, "(dp b) d"), out_specs="")
    over_both = fs.shard_map(loss, mesh=mesh, in_specs=({"ln": "..."}, "(dp tp b) d"), out_specs="")
    for how in ("eager", "compiled"):
        torch._dynamo.reset()
        ln = {"ln": _init()["ln"].clone().requires_grad_()}
        wrap = (
            (lambda fn: fn)
            if how == "eager"
            else (lambda fn: torch.compile(fn, backend="aot_eager", fullgraph=True))
        )
        with fs.no_sync():
            wrap(over_dp)(ln, xs[0]).backward()
        loss_ = wrap(over_both)(ln, xs[1])
        out[f"groups {how}"] = _raised(loss_.backward)
        fs.init()  # a new job: nothing pending
    return out


def _rank_value_and_grad():
    """fs.value_and_grad inside f under fs.no_sync: its gradients are values it returns, reduced as
    outside the block (eager once kept them pending on its own temporary copies: lost)."""
    import fshard as fs

    mesh, _ = _maps("dp")

    def body(p, x):
        return fs.value_and_grad(lambda p: fs.pmean(_model(p, x).mean(), "dp"))(p)

    f = fs.shard_map(
        body, mesh=mesh, in_specs=({k: "..." for k in _init()}, "(dp b) d"), out_specs=("", "...")
    )
    out = {}
    for how in ("eager", "compiled"):
        torch._dynamo.reset()
        fn = f if how == "eager" else torch.compile(f, backend="aot_eager", fullgraph=True)
        p = _params(mesh, "dp")
        with torch._dynamo.config.patch(trace_autograd_ops=True), fs.no_sync():
            out[how] = fn(p, _batches()[0])[1]
        out[f"{how} pending"] = _pending_left()
    return out


def _rank_pipeline(how):
    """The dp=2 x pp=2 pipeline of per-rank stages (tests/test_compile_stages.py: fs.PerRank
    parameters, fs.switch on the stage, fs.ppermute between stages): three micro-batches, the
    first two under fs.no_sync (``how``: eager, or compiled), or every backward reducing (the
    reference)."""
    import fshard as fs
    from tests.test_compile_stages import _step

    torch._dynamo.reset()
    mesh, n, step, params, tokens, targets = _step({"dp": 2, "pp": 2})
    p = params()
    leaves = torch.utils._pytree.tree_leaves(p.tree)
    for t in leaves:
        t.requires_grad_()
    if how == "reference":
        for _ in range(MICRO):
            step(p, tokens, targets).backward()
    else:
        fn = step if how == "eager" else torch.compile(step, backend="aot_eager", fullgraph=True)
        with fs.no_sync():
            for _ in range(MICRO - 1):
                fn(p, tokens, targets).backward()
        fn(p, tokens, targets).backward()
    return [t.grad for t in leaves], _pending_left()


def _rank_returned_gradients():
    """torch.autograd.grad (first order, and a Hessian-vector product through create_graph) of an
    eager call without buckets under fs.no_sync: gradients returned, not accumulated, are reduced as
    outside the block; loss.backward() in the block still keeps its gradient pending."""
    import fshard as fs

    mesh, f = _maps("dp", bucket_mb=None)
    xs = _batches()
    p = _params(mesh, "dp")
    ps = list(p.values())
    with fs.no_sync():
        first = torch.autograd.grad(f(p, xs[0]), ps)
        grads = torch.autograd.grad(f(p, xs[0]), ps, create_graph=True)
        hvp = torch.autograd.grad(sum(g.sum() for g in grads), ps)
        f(p, xs[0]).backward()
    return first, [g.detach() for g in grads], hvp, _pending_left()


def _raised(fn, *args) -> str:
    try:
        fn(*args)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "nothing raised"


@pytest.mark.timeout(230)
def test_compiled_no_sync_accumulates_as_eager_and_one_process():
    ref = _reference()
    got = run_ranks(WORLD, _rank_table, ref, timeout=200)
    assert_ok([errs for errs, _ in got])
    for _, out in got:
        for mesh_kind in ("dp", "dp2xtp2", "dp mixed"):
            plain = out[(mesh_kind, "plain")]
            n_deferred = 3 if mesh_kind == "dp2xtp2" else 6  # the parameters whole in f: ln, b2, s on 2 x 2
            for how in HOWS:
                for rep in range(2):
                    counts = out[(mesh_kind, how, rep)]
                    under, last = counts[:-1], counts[-1]
                    if how != "last only":  # under no_sync, no buckets: the deferred reductions are not made
                        assert under == [plain - n_deferred] * (MICRO - 1), (mesh_kind, how, counts)
                    if how != "no_sync only":  # no buckets, with pending gradients: as many as with none
                        assert last == plain, (mesh_kind, how, counts)
                assert out[(mesh_kind, "pending left", how)] == (0, False)
            # one graph under no_sync and one with gradients pending, made by the first cycle; none
            # added by the second, nor by mixing eager calls in; the plain one last
            for how in HOWS:
                assert [out[(mesh_kind, how, rep, "graphs")] for rep in range(2)] == [2, 2], (mesh_kind, how)
            assert out[(mesh_kind, "graphs")] == 3


@pytest.mark.timeout(300)  # inductor compiles C++ kernels with gcc: slow on a loaded 2-core machine
def test_fs_compile_with_inductor_accumulates_under_no_sync():
    got = run_ranks(2, _rank_fs_compile, timeout=280)
    assert_ok([errs for errs, _ in got])
    for _, (plain, counts) in got:
        # the step's own pmean in the forward, nothing else under no_sync; the last micro-batch
        # reduces as a step with nothing pending does
        assert counts == [1, 1, plain] * 2, (plain, counts)


@pytest.mark.timeout(230)
def test_compiled_no_sync_errors_name_the_parameter_and_the_fix():
    for out in run_ranks(WORLD, _rank_errors, timeout=200):
        assert out["unused"] == (
            "FshardError: fs.no_sync kept the gradient of args[0]['b1'] (an input of _rank_errors.<locals>.other) "
            "pending, and this call, the first outside fs.no_sync, does not use it with values that vary over a "
            "mesh axis, so it cannot reduce it (it is compiled, or has bucket_mb=None): call this step eagerly "
            "with gradient buckets (bucket_mb, 25 MB by default), which reduce every pending gradient"
        )
        assert out["left after eager"] == (0, False)
        for how in ("eager", "compiled"):  # (eager summed the pending sum over dp and tp: tp times too much)
            assert out[f"groups {how}"] == (
                "FshardError: fs.no_sync kept the gradient of args[0]['ln'] (an input of _rank_errors.<locals>.loss) "
                "pending as a sum over mesh axes dp, and a later call sums it over dp, tp: use the parameter with "
                "values that vary over the same mesh axes in every micro-batch"
            ), how


def test_value_and_grad_inside_f_under_no_sync_returns_reduced_gradients():
    p = {k: v.clone().requires_grad_() for k, v in _init().items()}
    want = dict(zip(p, torch.autograd.grad(_model(p, _batches()[0]).mean(), list(p.values()))))
    for out in run_ranks(WORLD, _rank_value_and_grad, timeout=100):
        errs: list = []
        for how in ("eager", "compiled"):
            for k in want:
                close(errs, f"{how}: grad {k} vs one process", out[how][k], want[k])
            assert out[f"{how} pending"] == (0, False), how
        assert not errs, errs


@pytest.mark.timeout(200)
def test_compiled_no_sync_in_a_pipeline_of_per_rank_stages():
    from tests.test_stages import DT

    ref = run_ranks(WORLD, _rank_pipeline, "reference", timeout=100)
    for how in ("eager", "compiled"):
        errs: list = []
        for (want, _), (got, left) in zip(ref, run_ranks(WORLD, _rank_pipeline, how, timeout=150)):
            assert len(got) == len(want) and left == (0, False), how
            for k, (a, b) in enumerate(zip(got, want)):
                close(errs, f"{how}: gradient {k} vs every backward reducing", a, b, DT)
        assert not errs, errs


def test_gradients_returned_under_no_sync_without_buckets_are_reduced():
    p = {k: v.clone().requires_grad_() for k, v in _init().items()}
    ps = list(p.values())
    x = _batches()[0]
    grads = torch.autograd.grad(_model(p, x).mean() + 0.01 * (p["w1"] ** 2).sum(), ps, create_graph=True)
    hvp = torch.autograd.grad(sum(g.sum() for g in grads), ps)
    for first, got, got_hvp, left in run_ranks(WORLD, _rank_returned_gradients, timeout=100):
        errs: list = []
        for k, (a, b, c, w, h) in enumerate(zip(first, got, got_hvp, grads, hvp)):
            close(errs, f"grad {k} vs one process", a, w.detach())
            close(errs, f"create_graph grad {k} vs one process", b, w.detach())
            close(errs, f"hvp {k} vs one process", c, h)
        assert not errs, errs
        assert left == (len(ps), True)  # loss.backward() kept every parameter's gradient pending
