"""Whole training steps under ``torch.compile(step, fullgraph=True)``, on real gloo ranks (2).

Each step (gradients, global-norm clipping, optimizer update) is compiled once per rank job with a
counting ``aot_eager``-style backend (`tests.helpers.compile_counter`) and run for ``STEPS``
steps on new batches, side by side with the same step called eagerly and with the same training
by plain torch (``torch.optim``, ``torch.nn.utils.clip_grad_norm_``) on the global batch in one
process. ``fullgraph=True`` makes any graph break an error; one graph after all the steps means
no recompilation. The collectives in the compiled graphs are asserted by name. A changing batch
size costs one recompile (Dynamo's automatic dynamic shapes), none when the batch dim is marked
dynamic, and a size the mesh does not divide is refused. One step is compiled with the inductor
backend (C++ kernels built with gcc) and compared with eager.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, compile_counter, full, mse, randn

N = 2  # ranks
STEPS = 12  # steps with fixed shapes: still one graph
LR = {"sgd": 0.1, "adamw": 0.01}


def _mlp(p, x):
    return torch.tanh(x @ p["w1"]) @ p["w2"]


def _local_loss(p, x, y):
    import fshard as fs

    return fs.pmean(mse(_mlp(p, x), y), "dp")


def _fsdp_loss(p, x, y):
    import fshard as fs

    return _local_loss(fs.all_gather(p, "dp", dim=0, tiled=True), x, y)


def _init():
    return {"w1": randn(0, 4, 8) / 2, "w2": randn(1, 8, 3) / 3}


def _batch(i, b=8):
    return randn(100 + i, b, 4), randn(200 + i, b, 3)


class _Reference:
    """The same training in one process: torch.optim on the global parameters and batch."""

    def __init__(self, params, kind, clip=1.0):
        self.p = {k: full(v).detach().clone().requires_grad_() for k, v in params.items()}
        ps = list(self.p.values())
        self.opt = (
            torch.optim.SGD(ps, lr=LR[kind], momentum=0.9)
            if kind == "sgd"
            else torch.optim.AdamW(ps, lr=LR[kind])
        )
        self.clip = clip

    def step(self, x, y):
        self.opt.zero_grad()
        loss = mse(_mlp(self.p, x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(self.p.values()), self.clip)
        self.opt.step()
        return loss.detach(), norm


def _train(errs, name, step, compiled, states, ref, batches):
    """Run a step per ``(seed, batch size)`` of ``batches`` eagerly, compiled and in one process,
    from ``states`` (eager params and state, compiled params and state); compare every loss and
    norm and the parameters after each step. Returns the new states."""
    ep, es, cp, cs = states
    for i, b in batches:
        x, y = _batch(i, b)
        el, en, ep, es = step(ep, es, x, y)
        cl, cn, cp, cs = compiled(cp, cs, x, y)
        rl, rn = ref.step(x, y)
        close(errs, f"{name} step {i}: compiled loss vs one process", cl, rl)
        close(errs, f"{name} step {i}: compiled norm vs one process", cn, rn)
        close(errs, f"{name} step {i}: compiled loss vs eager", cl, el)
        for k in ref.p:
            close(errs, f"{name} step {i}: compiled {k} vs one process", full(cp[k]), ref.p[k])
            close(errs, f"{name} step {i}: compiled {k} vs eager", full(cp[k]), full(ep[k]))
    return ep, es, cp, cs


def _rank_steps():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):  # autograd.grad and backward traced
        return _step_cases()


def _step_cases():
    import fshard as fs

    errs: list[str] = []
    out: dict = {}
    dp = fs.Mesh(dp=N)

    # 1. data parallel, the whole step inside shard_map (value_and_grad, clipping and SGD with
    # momentum on the local blocks), as examples/data_parallel.py writes it
    sgd = fs.optim.sgd(LR["sgd"], momentum=0.9)

    def dp_step(params, state, x, y):
        loss, grads = fs.value_and_grad(_local_loss)(params, x, y)
        grads, norm = fs.optim.clip_by_global_norm(grads, 1.0)
        params, state = sgd.update(params, grads, state)
        return loss, norm, params, state

    step = fs.shard_map(dp_step, mesh=dp, in_specs=("...", "...", "(dp b) d", "(dp b) o"), out_specs="...")
    backend, stats = compile_counter()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    params = _init()
    ref = _Reference(params, "sgd")
    states = (params, sgd.init(params), params, sgd.init(params))
    states = _train(errs, "dp sgd", step, compiled, states, ref, [(i, 8) for i in range(STEPS)])
    out["dp sgd"] = {"graphs": stats["graphs"], "ops": list(stats["ops"])}
    # new batch sizes: one recompile, at the first, after which Dynamo's automatic dynamic
    # shapes treat the batch dim as symbolic (the same graph for every even size)
    sizes = [(STEPS + i, b) for i, b in enumerate([12, 16, 20, 24, 6])]
    states = _train(errs, "dp sgd, new batch sizes", step, compiled, states, ref, sizes)
    out["dp sgd"]["graphs after new sizes"] = stats["graphs"]
    # a size the mesh does not divide: shard_map refuses it, as for any uneven input
    out["uneven batch"] = _raised(compiled, *states[2:], *_batch(0, 9))

    # 2. FSDP: Sharded parameters, fs.value_and_grad of a shard_map'd loss that gathers them (one
    # coalesced all-gather), clipping and AdamW on the Sharded gradients outside shard_map
    adamw = fs.optim.adamw(LR["adamw"])
    specs = {"w1": "(dp d) h", "w2": "(dp h) o"}
    loss_fn = fs.shard_map(_fsdp_loss, mesh=dp, in_specs=(specs, "(dp b) d", "(dp b) o"), out_specs="...")
    grad_fn = fs.value_and_grad(loss_fn)

    def fsdp_step(params, state, x, y):
        loss, grads = grad_fn(params, x, y)
        grads, norm = fs.optim.clip_by_global_norm(grads, 1.0)
        params, state = adamw.update(params, grads, state)
        return loss, norm, params, state

    backend, stats = compile_counter()
    compiled = torch.compile(fsdp_step, backend=backend, fullgraph=True)
    params = fs.shard(_init(), dp, specs)
    states = (params, adamw.init(params), params, adamw.init(params))
    batches = [(i, 8) for i in range(STEPS)]
    _, _, cp, cs = _train(
        errs, "fsdp adamw", fsdp_step, compiled, states, _Reference(params, "adamw"), batches
    )
    if not (isinstance(cp["w1"], fs.Sharded) and cp["w1"].spec == specs["w1"]):
        errs.append(f"fsdp adamw: compiled step returned {cp['w1']!r}, want a Sharded over {specs['w1']!r}")
    if int(cs["step"]) != STEPS:
        errs.append(f"fsdp adamw: the state counts {int(cs['step'])} steps, want {STEPS}")
    out["fsdp adamw"] = {"graphs": stats["graphs"], "ops": list(stats["ops"])}

    # 3. loss.backward() inside the compiled step, fs.optim.clip_grad_norm_ on the .grad of plain
    # (replicated) parameters, and an in-place SGD update
    plain = fs.shard_map(_local_loss, mesh=dp, in_specs=("...", "(dp b) d", "(dp b) o"), out_specs="...")

    def backward_step(params, state, x, y):
        loss = plain(params, x, y)
        loss.backward()
        norm = fs.optim.clip_grad_norm_(params.values(), 1.0)
        with torch.no_grad():
            for p in params.values():
                p -= LR["sgd"] * p.grad
        return loss.detach(), norm, params, state

    backend, stats = compile_counter()
    compiled = torch.compile(backward_step, backend=backend, fullgraph=True)
    ref = _Reference(_init(), "sgd")
    ref.opt = torch.optim.SGD(list(ref.p.values()), lr=LR["sgd"])
    eager_params = {k: v.clone().requires_grad_() for k, v in _init().items()}
    params = {k: v.clone().requires_grad_() for k, v in _init().items()}
    for i in range(STEPS):
        # a new batch size at each step, marked dynamic: one graph for all of them
        x, y = _batch(i, 8 + 4 * (i % 5))
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(y, 0)
        el, en, _, _ = backward_step(eager_params, None, x, y)
        cl, cn, _, _ = compiled(params, None, x, y)
        # zeroed outside the compiled step: torch 2.13 accumulates the next compiled backward
        # wrongly after a ``p.grad = None`` inside it (plain torch, without fshard, too)
        for p in [*eager_params.values(), *params.values()]:
            p.grad = None
        rl, rn = ref.step(x, y)
        close(errs, f"backward step {i}: compiled loss vs one process", cl, rl)
        close(errs, f"backward step {i}: compiled clip_grad_norm_ vs one process", cn, rn)
        close(errs, f"backward step {i}: compiled clip_grad_norm_ vs eager", cn, en)
        for k in ref.p:
            close(errs, f"backward step {i}: compiled {k} vs one process", params[k], ref.p[k])
    out["backward clip_grad_norm_"] = {"graphs": stats["graphs"], "ops": list(stats["ops"])}
    return errs, out


def _raised(fn, *args) -> str:
    """fshard's error from ``fn(*args)`` as ``type: text`` (Dynamo wraps an error raised at trace
    time in its ``InternalTorchDynamoError``, and appends where it was traced)."""
    try:
        fn(*args)
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        head = "InternalTorchDynamoError: "
        return text[len(head) :].split("\n\nfrom user code:")[0] if text.startswith(head) else text
    return "nothing raised"


def test_compiled_training_steps_match_eager_and_one_process_in_one_graph():
    got = run_ranks(N, _rank_steps, timeout=115)
    assert_ok([errs for errs, _ in got])
    for _, out in got:
        for name in ("dp sgd", "fsdp adamw", "backward clip_grad_norm_"):
            stats = out[name]
            assert stats["graphs"] == 1, (name, stats)  # no graph break, no recompile over the steps
        # new batch sizes: one recompile in all (with mark_dynamic, none: "backward" above)
        assert out["dp sgd"]["graphs after new sizes"] == 2
        assert out["uneven batch"] == (
            "TracingError: fs.shard_map(_step_cases.<locals>.dp_step) with uneven blocks (a dim not "
            "divisible by its mesh axes) is not supported inside torch.compile yet (fshard refuses "
            "rather than compiling something that would mean another thing than the eager call); pad "
            "the inputs to a multiple of the mesh axes' sizes, or call it eagerly"
        )
        # the loss's pmean, one gradient all-reduce per parameter (no buckets in a compiled
        # backward) and the global norm's all-reduce
        assert sorted(out["dp sgd"]["ops"]) == ["all_reduce"] * 4
        # the parameters' coalesced all-gather, its transpose (one reduce-scatter), the pmean and
        # the global norm's all-reduce
        assert sorted(out["fsdp adamw"]["ops"]) == [
            "all_gather_into_tensor",
            "all_reduce",
            "all_reduce",
            "reduce_scatter_tensor",
        ]
        assert sorted(out["backward clip_grad_norm_"]["ops"]) == ["all_reduce"] * 3  # pmean, 2 grads


# == constructs inside a compiled step: compiled with eager's values, or refused by name ========


def _async_loss(p, x, y):
    import fshard as fs

    pending = fs.all_gather(p["w1"], "dp", dim=0, tiled=True, async_op=True)  # starts the gather
    h = x * 2  # computed meanwhile
    return fs.pmean(mse(torch.tanh(h @ pending.wait()) @ p["w2"], y), "dp")


def _remat_loss(p, x, y):
    import fshard as fs

    layer = fs.remat(_layer)
    return fs.pmean(mse(layer(p["w1"], x) @ p["w2"], y), "dp")


def _layer(w, h):
    return torch.tanh(h @ w)


def _switch_loss(p, x, y):
    import fshard as fs

    h = fs.switch(fs.axis_index("dp"), [_layer, _layer], p["w1"], x)
    return fs.pmean(mse(h @ p["w2"], y), "dp")


def _rank_constructs():
    import fshard as fs

    torch._dynamo.reset()
    errs: list[str] = []
    out: dict = {}
    dp = fs.Mesh(dp=N)
    x, y = _batch(0)
    # async_op=True: the functional collective and its wait are traced as they are
    specs = {"w1": "(dp d) h", "w2": "..."}
    loss_fn = fs.shard_map(_async_loss, mesh=dp, in_specs=(specs, "(dp b) d", "(dp b) o"), out_specs="...")
    params = fs.shard(_init(), dp, {"w1": "(dp d) h", "w2": "h o"})
    ref = {k: full(v).detach().clone().requires_grad_() for k, v in params.items()}
    want = mse(_mlp(ref, 2 * x), y)
    want_grads = torch.autograd.grad(want, list(ref.values()))
    vg = fs.value_and_grad(loss_fn)
    backend, stats = compile_counter()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(vg, backend=backend, fullgraph=True)
        for _ in range(3):
            loss, grads = compiled(params, x, y)
    eager_loss, _ = vg(params, x, y)
    close(errs, "async_op: compiled loss vs one process", loss, want)
    close(errs, "async_op: compiled loss vs eager", loss, eager_loss)
    for (k, g), w in zip(grads.items(), want_grads):
        close(errs, f"async_op: compiled grad {k} vs one process", full(g), w)
    out["async_op"] = {"graphs": stats["graphs"], "ops": list(stats["ops"])}
    # fs.remat under plain torch.compile, the Dynamo setting fs.compile sets left as it was: fshard
    # sets it itself while tracing the region (compiled fs.remat and fs.fsdp_scan in depth:
    # tests/test_compile_scan.py)
    plain = _init()
    specs = {"mesh": dp, "in_specs": ("...", "(dp b) d", "(dp b) o"), "out_specs": "..."}
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
        f = fs.shard_map(_remat_loss, **specs)
        loss = torch.compile(f, backend="eager", fullgraph=True)(plain, x, y)
    close(errs, "remat: compiled loss vs one process", loss, mse(_mlp(plain, x), y))
    # fs.switch on a varying index compiles: each rank's graph holds its own branch (pipelines
    # of per-rank stages in depth: tests/test_compile_stages.py)
    f = fs.shard_map(_switch_loss, **specs)
    ref = {k: v.detach().clone().requires_grad_() for k, v in plain.items()}
    want = mse(_mlp(ref, x), y)
    want_grads = torch.autograd.grad(want, list(ref.values()))
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        ps = {k: v.detach().clone().requires_grad_() for k, v in plain.items()}
        loss = torch.compile(f, backend=backend, fullgraph=True)(ps, x, y)
        loss.backward()
        close(errs, f"switch ({backend}): compiled loss vs one process", loss, want)
        for (k, p), w in zip(ps.items(), want_grads):
            close(errs, f"switch ({backend}): compiled grad {k} vs one process", p.grad, w)
    close(errs, "switch: eager loss vs one process", f(plain, x, y), want)
    return errs, out


def test_compiled_async_collectives_remat_and_a_varying_switch_match_one_process():
    got = run_ranks(N, _rank_constructs, timeout=115)
    assert_ok([errs for errs, _ in got])
    for _, out in got:
        assert out["async_op"]["graphs"] == 1
        # the gather and its transpose (a reduce-scatter), the pmean, w2's gradient all-reduce
        assert sorted(out["async_op"]["ops"]) == [
            "all_gather_into_tensor",
            "all_reduce",
            "all_reduce",
            "reduce_scatter_tensor",
        ]


# == the inductor backend ====================================================================


def _rank_inductor():
    import fshard as fs

    torch._dynamo.reset()
    errs: list[str] = []
    dp = fs.Mesh(dp=N)
    sgd = fs.optim.sgd(LR["sgd"], momentum=0.9)

    def dp_step(params, state, x, y):
        loss, grads = fs.value_and_grad(_local_loss)(params, x, y)
        params, state = sgd.update(params, grads, state)
        return loss, params, state

    step = fs.shard_map(dp_step, mesh=dp, in_specs=("...", "...", "(dp b) d", "(dp b) o"), out_specs="...")
    # one compile thread per rank: the two ranks already share the machine's cores
    with torch._dynamo.config.patch(trace_autograd_ops=True), torch._inductor.config.patch(compile_threads=1):
        compiled = torch.compile(step, backend="inductor", fullgraph=True)
        ep = cp = _init()
        es = cs = sgd.init(ep)
        for i in range(3):
            x, y = _batch(i)
            el, ep, es = step(ep, es, x, y)
            cl, cp, cs = compiled(cp, cs, x, y)
            close(errs, f"inductor step {i}: loss vs eager", cl, el)
            for k in ep:
                close(errs, f"inductor step {i}: {k} vs eager", cp[k], ep[k])
    with torch._inductor.config.patch(compile_threads=1):
        _fs_compile_case(errs, dp)
        _fs_compile_fsdp_case(errs, dp)
        _fs_compile_permute_case(errs, dp)
    return errs


def _fs_compile_permute_case(errs, dp):
    """fs.count_collectives of an fs.compile'd ppermute (compiled as an all-to-all that sends one
    block) and all_to_all, forward and backward: eager's records; the all-reduces (the psum and
    the gradient's) may share a bucket compiled, so only their bytes are compared."""
    import fshard as fs

    def body(w, x):
        h = fs.ppermute(torch.tanh(x @ w), "dp", [(0, 1), (1, 0)])
        h = fs.all_to_all(h, "dp", split_dim=1, concat_dim=0)
        return fs.psum((h**2).sum(), "dp")

    vg = fs.value_and_grad(fs.shard_map(body, mesh=dp, in_specs=("d h", "(dp b) d"), out_specs=""))
    w, x = randn(60, 4, 6), randn(61, 8, 4)
    with fs.count_collectives() as eager:
        eager_loss, eager_grad = vg(w, x)
    compiled = fs.compile(vg)
    with fs.count_collectives() as first:  # traced and compiled inside the block: counted once
        compiled(w, x)
    with fs.count_collectives() as counted:
        loss, grad = compiled(w, x)
    if first.records != counted.records:
        errs.append(f"fs.compile permute: first call counted {first.records}, then {counted.records}")
    close(errs, "fs.compile permute: loss vs eager", loss, eager_loss)
    close(errs, "fs.compile permute: grad vs eager", grad, eager_grad)

    def split(c):
        moved = sorted(r for r in c.records if r[0] != "all_reduce")
        return moved, sum(r[2] for r in c.records if r[0] == "all_reduce")

    want = [("all_to_all", ("dp",), 4 * 4 * 6)] * 2 + [("ppermute", ("dp",), 4 * 4 * 6)] * 2
    if split(counted) != split(eager) or split(eager)[0] != want:
        errs.append(f"fs.compile permute: counted {counted.records}, eager {eager.records}")


def _gloo_ops(fn, *args) -> dict:
    """How many all-gathers and reduce-scatters ran during ``fn(*args)``: the functional
    collectives' profiler events (gloo runs a reduce-scatter as an all-reduce on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args)
    names = [e.name for e in prof.events() if e.name.startswith("_c10d_functional::")]
    return {
        k: sum(n.startswith(f"_c10d_functional::{k}") for n in names)
        for k in ("all_gather", "reduce_scatter")
    }


def _fs_compile_fsdp_case(errs, dp):
    """fs.compile of the per-leaf FSDP program (one fs.all_gather per split parameter, then
    ``loss.backward()``): inductor buckets the gathers and their transposes (capped at eager's
    combining size), one all-gather and one reduce-scatter for these two leaves, as eager combines
    them; values and gradients as eager's and one process's."""
    import optree

    import fshard as fs

    def loss_fn(p, x, y):
        full_p = optree.tree_map(lambda t: fs.all_gather(t, "dp", dim=0, tiled=True), p)
        return _local_loss(full_p, x, y)

    f = fs.shard_map(
        loss_fn,
        mesh=dp,
        in_specs=({"w1": "(dp d) h", "w2": "(dp h) o"}, "(dp b) d", "(dp b) o"),
        out_specs="",
    )
    init = _init()
    eager_p = fs.shard(init, dp, {"w1": "(dp d) h", "w2": "(dp h) o"})
    comp_p = fs.shard(init, dp, {"w1": "(dp d) h", "w2": "(dp h) o"})
    for p in (*eager_p.values(), *comp_p.values()):
        p.local.requires_grad_(True)

    def step(p, x, y):
        loss = f(p, x, y)
        loss.backward()
        return loss.detach()

    x, y = _batch(0)
    eager_loss = step(eager_p, x, y)
    compiled = fs.compile(step)
    with fs.count_collectives() as first:  # traced and compiled inside the block: counted once
        compiled(comp_p, x, y)
    for p in comp_p.values():
        p.local.grad = None
    with fs.count_collectives() as counted:
        ops = _gloo_ops(compiled, comp_p, x, y)
    if ops != {"all_gather": 1, "reduce_scatter": 1}:
        errs.append(f"fs.compile fsdp: {ops} in the compiled step, want one bucket each way")
    # fs.count_collectives counts the compiled call: what ran (one bucket each way, as the
    # profiler's events above say, and the loss's pmean), with the bytes eager hands in
    for p in eager_p.values():
        p.local.grad = None
    with fs.count_collectives() as eager_counted:
        step(eager_p, x, y)
    kinds = {("all_gather", ("dp",)): 1, ("all_reduce", ("dp",)): 1, ("reduce_scatter", ("dp",)): 1}
    if sorted(counted.records) != sorted(eager_counted.records) or counted.by_kind() != kinds:
        errs.append(f"fs.compile fsdp: counted {counted.records}, eager {eager_counted.records}")
    if first.records != counted.records:
        errs.append(f"fs.compile fsdp: first call counted {first.records}, then {counted.records}")
    if sorted(counted.combined) != [("all_gather", ("dp",), 2), ("reduce_scatter", ("dp",), 2)]:
        errs.append(f"fs.compile fsdp: combined {counted.combined}")
    if counted.calls != 5 or eager_counted.calls != 5:  # two leaves each way, and the pmean
        errs.append(f"fs.compile fsdp: {counted.calls} calls counted compiled, {eager_counted.calls} eager")
    got_loss = compiled(comp_p, x, y)  # gradients accumulate over the two calls since the reset
    close(errs, "fs.compile fsdp: loss vs eager", got_loss, eager_loss)
    X, Y = full(x), full(y)
    want = torch.func.grad(lambda p: mse(_mlp(p, X), Y))(init)  # one process
    for k in init:
        got = comp_p[k].local.grad / 2
        close(errs, f"fs.compile fsdp: grad {k} vs eager", got, eager_p[k].local.grad)
        block = want[k].chunk(N)[torch.distributed.get_rank()]
        close(errs, f"fs.compile fsdp: grad {k} vs one process", eager_p[k].local.grad, block)


def _gloo_all_reduces(fn, *args) -> int:
    """How many all-reduces gloo ran during ``fn(*args)`` (read from the profiler's events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args)
    return sum(e.name == "gloo:all_reduce" for e in prof.events())


def _fs_compile_case(errs, dp):
    """fs.compile of ``loss.backward()`` on a data-parallel loss: the gradient all-reduces of the
    three replicated parameters and the loss's pmean are one bucket in the compiled graph."""
    import fshard as fs

    def loss_fn(p, x, y):
        return fs.pmean(mse(_mlp(p, x) + p["b"], y), "dp")

    f = fs.shard_map(loss_fn, mesh=dp, in_specs=("...", "(dp b) d", "(dp b) o"), out_specs="")
    init = {**_init(), "b": randn(2, 3) / 4}
    eager_p = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    comp_p = {k: v.clone().requires_grad_(True) for k, v in init.items()}

    def step(p, x, y):
        loss = f(p, x, y)
        loss.backward()
        return loss.detach()

    x, y = _batch(0)
    with fs.count_collectives() as eager_counts:
        eager_loss = step(eager_p, x, y)
    compiled = fs.compile(step)
    compiled(comp_p, x, y)  # traced and compiled
    for t in comp_p.values():
        t.grad = None
    with fs.count_collectives() as counted:
        n = _gloo_all_reduces(compiled, comp_p, x, y)
    if n != 1:
        errs.append(f"fs.compile: {n} all-reduces in the compiled step, want 1 bucket")
    # counted: the one bucket of the pmean and three gradients (their bytes: 4 + 3 parameters')
    nbytes = 4 * (1 + sum(v.numel() for v in init.values()))
    if counted.records != [("all_reduce", ("dp",), nbytes)] or counted.combined != [
        ("all_reduce", ("dp",), 4)
    ]:
        errs.append(f"fs.compile: counted {counted.records}, combined {counted.combined}")
    if eager_counts.total < 2:  # eager: the loss's pmean, then the gradients' bucket
        errs.append(f"eager: {eager_counts}")
    got_loss = compiled(comp_p, x, y)  # gradients accumulate over the two calls since the reset
    close(errs, "fs.compile: loss vs eager", got_loss, eager_loss)
    X, Y = full(x), full(y)
    want = torch.func.grad(lambda p: mse(_mlp(p, X) + p["b"], Y))(init)  # one process
    for k in init:
        close(errs, f"fs.compile: grad {k} vs eager", comp_p[k].grad / 2, eager_p[k].grad)
        close(errs, f"fs.compile: grad {k} vs one process", eager_p[k].grad, want[k])


@pytest.mark.timeout(240)  # inductor compiles C++ kernels with gcc: slow on a loaded 2-core machine
def test_compiled_step_with_inductor_matches_eager():
    assert_ok(run_ranks(N, _rank_inductor, timeout=220))


def test_fs_compile_refuses_inductor_settings_for_another_backend():
    import fshard as fs

    with pytest.raises(ValueError) as err:
        fs.compile(lambda x: x, backend="aot_eager", options={"max_autotune": True})
    assert str(err.value) == (
        "fs.compile: options= and mode= are inductor's; backend='aot_eager' takes neither "
        "(leave them out, or use backend='inductor')"
    )


def _rank_same_sharded_params():
    """The same Sharded parameters passed to a compiled ``loss.backward()`` step again and again
    (their local tensors collect ``.grad``, zeroed between steps): one graph for all the calls."""
    import fshard as fs

    torch._dynamo.reset()
    errs: list[str] = []
    dp = fs.Mesh(dp=N)
    specs = {"w1": "(dp d) h", "w2": "(dp h) o"}
    f = fs.shard_map(_fsdp_loss, mesh=dp, in_specs=(specs, "(dp b) d", "(dp b) o"), out_specs="")

    def step(params, x, y):
        loss = f(params, x, y)
        loss.backward()
        return loss.detach()

    backend, stats = compile_counter()
    compiled = fs.compile(step, backend=backend)
    params = fs.shard(_init(), dp, specs)
    for k, p in params.items():
        params[k] = fs.Sharded(p.local.clone().requires_grad_(True), dp, specs[k])
    for i in range(3):
        for p in params.values():
            p.local.grad = None
        x, y = _batch(i)
        loss = compiled(params, x, y)
        X, Y = full(x), full(y)
        want, want_loss = torch.func.grad_and_value(lambda p, X=X, Y=Y: mse(_mlp(p, X), Y))(_init())
        close(errs, f"step {i}: loss vs one process", loss, want_loss)
        for k, p in params.items():
            close(errs, f"step {i}: grad {k} vs one process", p.grad.full(), want[k])
    if stats["graphs"] != 1:
        errs.append(f"{stats['graphs']} graphs for 3 calls with the same Sharded parameters, want 1")
    return errs


def test_compiled_step_takes_the_same_sharded_parameters_without_recompiling():
    assert_ok(run_ranks(N, _rank_same_sharded_params, timeout=115))


def test_counting_pass_cache_key_follows_the_axes_of_the_process_groups():
    """The counting pass writes each collective's mesh axes (found from its process group's name)
    into the compiled graph, so inductor's on-disk cache must not hand a graph compiled where the
    group had other axes to this process: two compile tests failed on a machine whose cache held
    graphs compiled where group "0" was tp, counting their dp collectives as tp."""
    from fshard import _mesh
    from fshard._graph_counts import CountingPass

    saved = dict(_mesh.GROUP_AXES)
    try:
        _mesh.GROUP_AXES.clear()
        _mesh.GROUP_AXES["0"] = ("dp",)
        as_dp = CountingPass(None).uuid()
        _mesh.GROUP_AXES["0"] = ("tp",)
        as_tp = CountingPass(None).uuid()
        _mesh.GROUP_AXES["0"] = ("dp",)
        assert CountingPass(None).uuid() == as_dp  # the same axes: the same key (cache hits)
    finally:
        _mesh.GROUP_AXES.clear()
        _mesh.GROUP_AXES.update(saved)
    assert as_dp != as_tp


def _rank_counts_name_the_traced_axes():
    import fshard as fs

    dp, tp = fs.Mesh(dp=2), fs.Mesh(tp=2)  # on 2 ranks both axes are the world: one process group
    x = randn(0, 4, 3)
    on_dp = fs.shard_map(lambda x: fs.psum(x.sum(0) * 2, "dp"), mesh=dp, in_specs="(dp b) d", out_specs="d")
    on_tp = fs.shard_map(lambda x: fs.psum(x.sum(0) * 3, "tp"), mesh=tp, in_specs="(tp b) d", out_specs="d")
    on_dp(x)
    on_tp(x)  # the group's eager entry now names tp
    step = fs.compile(lambda x: on_dp(x).sum())
    with fs.count_collectives() as counts:
        got = step(x)
    errs: list[str] = []
    close(errs, "value", got, (x * 2).sum())
    return errs, [(kind, axes) for kind, axes, _ in counts.records]


def test_compiled_counts_name_the_axes_of_the_traced_collective():
    """The count of a compiled graph named a collective's axes from a process-group table that the
    last mesh made over the same ranks had overwritten: a dp all-reduce counted as tp."""
    got = run_ranks(2, _rank_counts_name_the_traced_axes)
    assert_ok([e for e, _ in got])
    for _, records in got:
        assert records == [("all_reduce", ("dp",))], records


def test_an_optimizer_built_inside_a_compiled_step_with_a_tensor_lr_compiles_once():
    """``opt = fs.optim.adamw(lr)`` inside the step (as the demo writes it), lr a 0-d tensor that
    changes every step: one graph over the steps, and eager's parameters and state."""
    import fshard as fs

    def step(params, grads, state, lr):
        opt = fs.optim.adamw(lr, weight_decay=0.01)
        return opt.update(params, grads, state)

    backend, stats = compile_counter()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    state = fs.optim.adamw(0.1).init(params)
    eager_p, eager_s = params, state
    for i in range(6):
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        lr = torch.tensor(1e-2 * (i + 1))
        params, state = compiled(params, grads, state, lr)
        eager_p, eager_s = step(eager_p, grads, eager_s, lr)
        for k in params:
            torch.testing.assert_close(params[k], eager_p[k], rtol=1e-6, atol=1e-6)
    assert int(state["step"]) == int(eager_s["step"]) == 6
    assert stats["graphs"] == 1, stats


def _rank_counts_with_dynamic_shapes():
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    f = fs.shard_map(
        lambda x, w: fs.psum(torch.tanh(x @ w), "dp"),
        mesh=mesh,
        in_specs=("(dp b) d", "d e"),
        out_specs="b e",
    )

    def loss(x, w):
        return f(x, w).square().sum()

    step = fs.compile(loss)
    errs: list[str] = []
    rows = []
    for b in (2, 3, 5):  # the second batch size recompiles with a dynamic batch; the third reuses it
        x, w = randn(b, 2 * b, 6), randn(7, 6, 5).requires_grad_()
        with fs.count_collectives() as eager:
            want = loss(x, w)
            want.backward()
        want_grad, w.grad = w.grad, None
        with fs.count_collectives() as compiled:
            got = step(x, w)
            got.backward()
        close(errs, f"b={b} loss", got, want)
        close(errs, f"b={b} grad", w.grad, want_grad)
        rows.append((b, eager.records, compiled.records))
    return errs, rows


@pytest.mark.timeout(240)  # inductor compiles C++ kernels with gcc: slow on a loaded 2-core machine
def test_compiled_counts_follow_a_dynamic_batch_with_inductor():
    """A compiled graph whose batch dim became dynamic hands its collectives a symbolic size: the
    count (made as the graph runs) has each call's bytes, as eager counts them (it raised on the
    size's symbol before). The bytes are also checked against the shapes."""
    got = run_ranks(N, _rank_counts_with_dynamic_shapes, timeout=200)
    assert_ok([e for e, _ in got])
    for _, rows in got:
        assert [b for b, _, _ in rows] == [2, 3, 5]
        for b, eager, compiled in rows:
            # forward: the psum of this rank's [b, 5] block; backward: the all-reduce of w's [6, 5] grad
            assert sorted(compiled) == sorted(eager), (b, compiled, eager)
            assert sorted(compiled) == sorted(
                [("all_reduce", ("dp",), b * 5 * 4), ("all_reduce", ("dp",), 6 * 5 * 4)]
            )
