"""A ``torch.compile``'d function called inside an eagerly run shard_map call, on real gloo ranks (2).

Traced there, Dynamo read the running call's tracking state as constants: every call recompiled
(until Dynamo's recompile limit), and with a gradient ``fullgraph=True`` failed ("Could not extract
specialized integer from data-dependent expression"). It now runs eagerly inside the eager call,
with one warning per shard_map'd function, and gives the eager values, gradients and collectives,
``fullgraph=True`` or not; the same compiled function compiles as usual outside the call, and
inside a compiled step (``torch.compile`` around the shard_map'd function) it is part of that
graph. Values are compared with plain torch on the global tensors in one process.
"""

from __future__ import annotations

import warnings

import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, compile_counter, randn

N = 2
D, H, B = 4, 6, 8


def _fshard_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("fshard:")]


def _rank():
    import fshard as fs

    errs: list[str] = []
    out: dict = {}
    mesh = fs.Mesh(dp=N)
    w, x, y = randn(0, D, H), randn(1, B, D), randn(2, B, H)
    wr = w.clone().requires_grad_(True)
    want = ((torch.tanh(x @ wr) - y) ** 2).mean()
    (want_g,) = torch.autograd.grad(want, wr)

    backend, stats = compile_counter()
    body = torch.compile(lambda w, x: torch.tanh(x @ w), backend=backend, fullgraph=True)

    def loss(w, x, y):
        return fs.pmean(((body(w, x) - y) ** 2).mean(), "dp")

    sm = fs.shard_map(loss, mesh=mesh, in_specs=("...", "(dp b) d", "(dp b) h"), out_specs="")
    vg = fs.value_and_grad(sm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(3):
            with fs.count_collectives() as counts:
                got, g = vg(w, x, y)
            close(errs, f"dp call {k}: loss", got, want)
            close(errs, f"dp call {k}: grad", g, want_g)
    out["dp warnings"] = _fshard_warnings(caught)
    out["dp graphs"] = stats["graphs"]

    def plain(w, x, y):
        return fs.pmean(((torch.tanh(x @ w) - y) ** 2).mean(), "dp")

    plain_vg = fs.value_and_grad(
        fs.shard_map(plain, mesh=mesh, in_specs=("...", "(dp b) d", "(dp b) h"), out_specs="")
    )
    with fs.count_collectives() as eager_counts:
        plain_vg(w, x, y)
    out["dp collectives"] = (counts.records, eager_counts.records)

    # the same compiled function outside any shard_map call: compiled as usual
    close(errs, "body outside", body(w, x), torch.tanh(x @ w))
    out["graphs after a call outside"] = stats["graphs"]

    # Megatron MLP on tp: the compiled function holds the psum and a w.T; fs.shard_map(torch.compile(g))
    tp = fs.Mesh(tp=N)
    w1, w2 = randn(3, D, 2 * H), randn(4, D, 2 * H)
    backend2, stats2 = compile_counter()

    def mlp(w1, w2, x):
        return (fs.psum(torch.relu(x @ w1) @ w2.T, "tp") ** 2).sum()

    specs = ("d (tp h)", "d (tp h)", "b d")
    smt = fs.shard_map(torch.compile(mlp, backend=backend2), mesh=tp, in_specs=specs, out_specs="")
    a, b = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    want_t = ((torch.relu(x @ a) @ b.T) ** 2).sum()
    want_ga, want_gb = torch.autograd.grad(want_t, (a, b))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(2):
            got, (ga, gb) = fs.value_and_grad(smt, argnums=(0, 1))(w1, w2, x)
            close(errs, f"tp call {k}: loss", got, want_t)
            close(errs, f"tp call {k}: grad w1", ga, want_ga)
            close(errs, f"tp call {k}: grad w2", gb, want_gb)
    out["tp warnings"] = _fshard_warnings(caught)
    out["tp graphs"] = stats2["graphs"]

    # inside a compiled step, the compiled function is part of the step's graph
    backend3, stats3 = compile_counter()
    step = torch.compile(vg, backend=backend3, fullgraph=True)
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(trace_autograd_ops=True):
        warnings.simplefilter("always")
        for k in range(2):
            got, g = step(w, x, y)
            close(errs, f"compiled step call {k}: loss", got, want)
            close(errs, f"compiled step call {k}: grad", g, want_g)
    out["step warnings"] = _fshard_warnings(caught)
    out["step graphs"] = stats3["graphs"]
    out["step ops"] = sorted(set(stats3["ops"]))
    return errs, out


def test_compiled_function_inside_an_eager_shard_map_call_runs_eagerly_with_eager_values():
    got = run_ranks(N, _rank, timeout=110)
    assert_ok([e for e, _ in got])
    for _, out in got:
        where = "_rank.<locals>.loss"
        text = (
            f"fshard: a torch.compile'd function was called inside an eager call of fs.shard_map({where}): it "
            "runs eagerly there. In an eager call fshard tracks the mesh axes each value varies over op by "
            "op, which a graph torch.compile made on its own cannot follow without being recompiled for every "
            "call. To compile it there, compile it with fs.compile (a compiled region, traced apart from the "
            "call), or compile the whole step: fs.compile(step), or torch.compile around the shard_map'd "
            "function (docs/tutorial/09-compiling.md)"
        )
        assert out["dp warnings"] == [text], out["dp warnings"]  # once for the function, not per call
        assert out["dp graphs"] == 0, out  # nothing compiled inside the eager calls
        mine, plain = out["dp collectives"]
        assert mine == plain and len(mine) == 2, out  # the loss's pmean and the gradient bucket
        assert out["graphs after a call outside"] == 1, out
        assert out["tp warnings"] == [text.replace(where, "_rank.<locals>.mlp")], out["tp warnings"]
        assert out["tp graphs"] == 0, out
        assert out["step warnings"] == [], out  # compiled with the step: nothing runs eagerly
        assert out["step graphs"] == 1, out  # one graph over the calls: no break, no recompile
        assert out["step ops"] == ["all_reduce"], out


# == fs.compile'd regions ===================================================================


def _rank_regions():
    import fshard as fs

    errs: list[str] = []
    out: dict = {}
    mesh, tp = fs.Mesh(dp=N), fs.Mesh(tp=N)
    w, x, y = randn(0, D, H), randn(1, B, D), randn(2, B, H)
    wr = w.clone().requires_grad_(True)
    want = ((torch.tanh(x @ wr) - y) ** 2).mean()
    (want_g,) = torch.autograd.grad(want, wr)
    specs = ("...", "(dp b) d", "(dp b) h")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # data parallel: w invariant (its implicit cast, and the transpose's all-reduce, in the region)
        backend, stats = compile_counter()
        body = fs.compile(lambda w, x: torch.tanh(x @ w), backend=backend)
        vg = fs.value_and_grad(
            fs.shard_map(
                lambda w, x, y: fs.pmean(((body(w, x) - y) ** 2).mean(), "dp"),
                mesh=mesh,
                in_specs=specs,
                out_specs="",
            )
        )
        for k in range(3):
            got, g = vg(w, x, y)
            close(errs, f"dp call {k}: loss", got, want)
            close(errs, f"dp call {k}: grad", g, want_g)
        out["dp"] = (stats["graphs"], stats["ops"])

        # FSDP: w split over dp and gathered in the region (its transpose: a reduce-scatter)
        backend, stats = compile_counter()
        blk = fs.compile(
            lambda w, x: torch.tanh(x @ fs.all_gather(w, "dp", dim=0, tiled=True)), backend=backend
        )
        fsdp = fs.shard_map(
            lambda w, x, y: fs.pmean(((blk(w, x) - y) ** 2).mean(), "dp"),
            mesh=mesh,
            in_specs=("(dp d) h", "(dp b) d", "(dp b) h"),
            out_specs="",
        )
        for k in range(2):
            got, g = fs.value_and_grad(fsdp)(w, x, y)
            close(errs, f"fsdp call {k}: loss", got, want)
            close(errs, f"fsdp call {k}: grad", fs.full(g), want_g)
        out["fsdp"] = (stats["graphs"], stats["ops"])

        # tensor parallel: the region holds the psum and a w.T
        w1, w2 = randn(3, D, 2 * H), randn(4, D, 2 * H)
        backend, stats = compile_counter()
        mlp = fs.compile(lambda w1, w2, x: fs.psum(torch.relu(x @ w1) @ w2.T, "tp"), backend=backend)
        smt = fs.shard_map(
            lambda w1, w2, x: (mlp(w1, w2, x) ** 2).sum(),
            mesh=tp,
            in_specs=("d (tp h)", "d (tp h)", "b d"),
            out_specs="",
        )
        a, b = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        want_t = ((torch.relu(x @ a) @ b.T) ** 2).sum()
        want_ga, want_gb = torch.autograd.grad(want_t, (a, b))
        for k in range(2):
            got, (ga, gb) = fs.value_and_grad(smt, argnums=(0, 1))(w1, w2, x)
            close(errs, f"tp call {k}: loss", got, want_t)
            close(errs, f"tp call {k}: grad w1", ga, want_ga)
            close(errs, f"tp call {k}: grad w2", gb, want_gb)
        out["tp"] = (stats["graphs"], stats["ops"])

        # the region's results vary as the eager ops make them: psum of an invariant one multiplies
        backend, stats = compile_counter()
        two = fs.compile(lambda w, x: ((w * 2).sum(), (x * 3).sum()), backend=backend)

        def sums(w, x):
            i, v = two(w, x)
            return fs.psum(i, "dp"), fs.psum(v, "dp")

        both = fs.shard_map(sums, mesh=mesh, in_specs=specs[:2], out_specs=("", ""))
        for k in range(2):
            i, v = both(w, x)
            close(errs, f"masks call {k}: psum of the invariant result", i, (w * 2).sum() * N)
            close(errs, f"masks call {k}: psum of the varying result", v, (x * 3).sum())
        out["masks"] = (stats["graphs"], stats["ops"])

        # uneven blocks (7 rows over 2 ranks): the region does not cover the call; eager, with a warning
        backend, stats = compile_counter()
        ragged = fs.compile(lambda w, x: torch.tanh(x @ w), backend=backend)
        smu = fs.shard_map(
            lambda w, x, y: fs.psum(((ragged(w, x) - y) ** 2).sum(), "dp"),
            mesh=mesh,
            in_specs=specs,
            out_specs="",
        )
        got, g = fs.value_and_grad(smu)(w, x[:7], y[:7])
        l7 = ((torch.tanh(x[:7] @ wr) - y[:7]) ** 2).sum()
        close(errs, "uneven: loss", got, l7)
        close(errs, "uneven: grad", g, torch.autograd.grad(l7, wr)[0])
        out["uneven"] = (stats["graphs"], stats["ops"])

        # with check=False, inside fs.remat, and called with a second pattern of masks (x invariant)
        backend, stats = compile_counter()
        both_ways = fs.compile(lambda w, x: torch.tanh(x @ w), backend=backend)

        def two_patterns(w, x, y):
            extra = both_ways(w, torch.ones(1, D)).sum()  # x invariant here: another graph
            return fs.pmean(((fs.remat(both_ways)(w, x) - y) ** 2).mean(), "dp") + 0 * extra

        vg2 = fs.value_and_grad(
            fs.shard_map(two_patterns, mesh=mesh, in_specs=specs, out_specs="", check=False)
        )
        for k in range(2):
            got, g = vg2(w, x, y)
            close(errs, f"patterns call {k}: loss", got, want)
            close(errs, f"patterns call {k}: grad", g, want_g)
        out["patterns"] = stats["graphs"]

        # fs.debug checks each collective before it is sent: eagerly
        backend, stats = compile_counter()
        checked = fs.compile(lambda w, x: torch.tanh(x @ w), backend=backend)
        smd = fs.shard_map(
            lambda w, x, y: fs.pmean(((checked(w, x) - y) ** 2).mean(), "dp"),
            mesh=mesh,
            in_specs=specs,
            out_specs="",
        )
        with fs.debug():
            got, g = fs.value_and_grad(smd)(w, x, y)
        close(errs, "debug: loss", got, want)
        close(errs, "debug: grad", g, want_g)
        out["debug"] = stats["graphs"]

        # inductor: fs.count_collectives counts the region's collectives with the call's
        ind = fs.compile(lambda w, x: torch.tanh(x @ w))
        smi = fs.shard_map(
            lambda w, x, y: fs.pmean(((ind(w, x) - y) ** 2).mean(), "dp"),
            mesh=mesh,
            in_specs=specs,
            out_specs="",
        )
        for k in range(2):
            with fs.count_collectives() as counts:
                got, g = fs.value_and_grad(smi)(w, x, y)
            close(errs, f"inductor call {k}: loss", got, want)
            close(errs, f"inductor call {k}: grad", g, want_g)
        out["inductor counts"] = counts.records
    out["warnings"] = _fshard_warnings(caught)
    return errs, out


def test_fs_compile_inside_an_eager_call_is_a_compiled_region_with_eager_values():
    got = run_ranks(N, _rank_regions, timeout=110)
    assert_ok([e for e, _ in got])
    for _, out in got:
        assert out["dp"] == (1, ["all_reduce"]), out  # one graph over the calls; w's gradient summed in it
        assert out["fsdp"] == (1, ["all_gather_into_tensor", "reduce_scatter_tensor"]), out
        assert out["tp"] == (1, ["all_reduce"]), out  # the forward's psum (its transpose: none)
        assert out["masks"] == (1, []), out
        assert out["uneven"] == (0, []), out  # not compiled
        # (the compiled graph names a collective's process group, which the tp mesh of this test shares)
        assert [(k, n) for k, _, n in out["inductor counts"]] == [
            ("all_reduce", 4),
            ("all_reduce", D * H * 4),
        ], out
        assert out["patterns"] == 2, out  # one graph per pattern of masks, none recompiled over the calls
        assert out["debug"] == 0, out
        name = "fshard: fs.compile(_rank_regions.<locals>.<lambda>) was called inside an eager call of fs.shard_map("
        tail = (
            ": it runs eagerly there, with the call's values, gradients and collectives "
            "(docs/tutorial/09-compiling.md: what a compiled region covers)"
        )
        assert out["warnings"] == [
            f"{name}_rank_regions.<locals>.<lambda>) with uneven blocks (a dim its mesh axes do not divide){tail}",
            f"{name}_rank_regions.<locals>.<lambda>) under fs.debug (which checks each collective before it "
            f"is sent, eagerly){tail}",
        ], out["warnings"]


def _rank_region_2d():
    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(dp=2, tp=2)
    w1, w2, x, y = randn(5, D, 2 * H), randn(6, 2 * H, D), randn(7, B, D), randn(8, B, D)
    a, b = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    want = ((torch.relu(x @ a) @ b - y) ** 2).mean()
    want_ga, want_gb = torch.autograd.grad(want, (a, b))
    backend, stats = compile_counter()
    block = fs.compile(lambda w1, w2, x: fs.psum(torch.relu(x @ w1) @ w2, "tp"), backend=backend)

    def loss(w1, w2, x, y):
        return fs.pmean(((block(w1, w2, x) - y) ** 2).mean(), "dp")

    sm = fs.shard_map(
        loss, mesh=mesh, in_specs=("d (tp h)", "(tp h) o", "(dp b) d", "(dp b) o"), out_specs=""
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(2):
            got, (ga, gb) = fs.value_and_grad(sm, argnums=(0, 1))(w1, w2, x, y)
            close(errs, f"call {k}: loss", got, want)
            close(errs, f"call {k}: grad w1", fs.full(ga), want_ga)
            close(errs, f"call {k}: grad w2", fs.full(gb), want_gb)
    return errs, (stats["graphs"], sorted(stats["ops"]), _fshard_warnings(caught))


def test_fs_compile_region_on_a_dp_x_tp_mesh_matches_one_process():
    got = run_ranks(4, _rank_region_2d, timeout=110)
    assert_ok([e for e, _ in got])
    for _, (graphs, ops, warned) in got:
        # one graph; the forward's psum over tp, and the dp sums of both weights' gradients
        assert (graphs, ops, warned) == (1, ["all_reduce", "all_reduce", "all_reduce"], []), (
            graphs,
            ops,
            warned,
        )


def _rank_region_scan():
    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(dp=N)
    layers = [{"w": randn(10 + i, D, D), "b": randn(20 + i, D)} for i in range(3)]
    x, y = randn(1, B, D), randn(2, B, D)
    ref = [{k: v.clone().requires_grad_(True) for k, v in layer.items()} for layer in layers]
    h = x
    for layer in ref:
        h = torch.tanh(h @ layer["w"] + layer["b"])
    want = ((h - y) ** 2).mean()
    want_g = torch.autograd.grad(want, [v for layer in ref for v in layer.values()])
    backend, stats = compile_counter()
    body = fs.compile(lambda layer, h: torch.tanh(h @ layer["w"] + layer["b"]), backend=backend)

    def make(layer_fn):
        def loss(layers, x, y):
            h = fs.fsdp_scan(layer_fn, layers, x, "dp", dims={"w": 0, "b": None})
            return fs.pmean(((h - y) ** 2).mean(), "dp")

        specs = ([{"w": "(dp d) e", "b": "e"}] * 3, "(dp b) d", "(dp b) e")
        return fs.value_and_grad(fs.shard_map(loss, mesh=mesh, in_specs=specs, out_specs=""))

    def check(what, got, grads):
        close(errs, f"{what}: loss", got, want)
        for i, (layer, g) in enumerate(zip(grads, [want_g[k : k + 2] for k in range(0, 6, 2)])):
            close(errs, f"{what}: layer {i} grad w", fs.full(layer["w"]), g[0])
            close(errs, f"{what}: layer {i} grad b", fs.full(layer["b"]), g[1])

    vg = make(body)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(2):
            check(f"call {k}", *vg(layers, x, y))
        graphs = stats["graphs"]
        # a count with a backend whose graphs do not count: the region runs eagerly, counted exactly
        with fs.count_collectives() as counts:
            check("counted call", *vg(layers, x, y))
    with fs.count_collectives() as plain:
        make(lambda layer, h: torch.tanh(h @ layer["w"] + layer["b"]))(layers, x, y)
    return errs, (graphs, stats["graphs"], counts.records == plain.records, _fshard_warnings(caught))


def test_fs_compile_region_as_the_fsdp_scan_layer_matches_one_process():
    got = run_ranks(N, _rank_region_scan, timeout=110)
    assert_ok([e for e, _ in got])
    for _, (graphs, graphs_after, same_counts, warned) in got:
        # two graphs over both calls: the first layer's input (x) needs no gradient, the others' do
        # (a guard of Dynamo's); layers 2 and 3 share one
        assert graphs == 2, graphs
        assert graphs_after == 2, graphs_after  # the counted call compiled nothing
        assert same_counts, "the counted call's collectives differ from the plain function's"
        assert warned == [
            "fshard: fs.compile(_rank_region_scan.<locals>.<lambda>) was called inside an eager call of "
            "fs.shard_map(_rank_region_scan.<locals>.make.<locals>.loss) under fs.count_collectives with "
            "a backend other than inductor (only inductor's graphs count their own collectives): it runs "
            "eagerly there, with the call's values, gradients and collectives "
            "(docs/tutorial/09-compiling.md: what a compiled region covers)"
        ], warned


def _rank_region_transforms():
    import torch.func as tf

    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(dp=N)
    w, x, y = randn(0, D, H), randn(1, B, D), randn(2, B, H)
    wr = w.clone().requires_grad_(True)
    want = ((torch.tanh(x @ wr) - y) ** 2).mean()
    (want_g,) = torch.autograd.grad(want, wr)
    backend, stats = compile_counter()
    body = fs.compile(lambda w, x: torch.tanh(x @ w), backend=backend)
    specs = ("...", "(dp b) d", "(dp b) h")
    sm = fs.shard_map(
        lambda w, x, y: fs.pmean(((body(w, x) - y) ** 2).mean(), "dp"),
        mesh=mesh,
        in_specs=specs,
        out_specs="",
    )

    def rows(w, x, y):  # vmap entered inside f, the region called per row
        r = tf.vmap(lambda xi: body(w, xi[None])[0])(x)
        return fs.pmean(((r - y) ** 2).mean(), "dp")

    smv = fs.shard_map(rows, mesh=mesh, in_specs=specs, out_specs="")
    t = randn(3, D, H)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        close(errs, "torch.func.grad around", tf.grad(sm)(w, x, y), want_g)
        got, tangent = tf.jvp(lambda w: sm(w, x, y), (w,), (t,))
        close(errs, "torch.func.jvp around: value", got, want)
        close(errs, "torch.func.jvp around: tangent", tangent, (want_g * t).sum())
        got, g = fs.value_and_grad(smv)(w, x, y)
        close(errs, "vmap inside f: loss", got, want)
        close(errs, "vmap inside f: grad", g, want_g)
        got, g = fs.value_and_grad(sm)(w, x, y)  # no transform: the compiled region
        close(errs, "region: loss", got, want)
        close(errs, "region: grad", g, want_g)
    return errs, (stats["graphs"], _fshard_warnings(caught))


def test_fs_compile_region_under_torch_func_transforms_runs_eagerly_with_eager_values():
    got = run_ranks(N, _rank_region_transforms, timeout=110)
    assert_ok([e for e, _ in got])
    why = (
        "under a torch.func transform (grad, vjp, jvp, vmap, ...), which Dynamo does not trace a compiled "
        "function inside when the transform was entered eagerly: it runs eagerly there, with the call's values, "
        "gradients and collectives (docs/tutorial/09-compiling.md: what a compiled region covers)"
    )
    name = "fshard: fs.compile(_rank_region_transforms.<locals>.<lambda>) was called inside an eager call of "
    for _, (graphs, warned) in got:
        assert graphs == 1, graphs  # only the call without a transform compiled
        assert warned == [
            f"{name}fs.shard_map(_rank_region_transforms.<locals>.<lambda>) {why}",
            f"{name}fs.shard_map(_rank_region_transforms.<locals>.rows) {why}",
        ], warned


def _rank_region_inplace():
    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(dp=N)
    x = randn(1, B, D)
    backend, stats = compile_counter()
    add_rows = fs.compile(lambda h, x: h.add_(x.sum(0)), backend=backend)

    def summed(x):  # h starts invariant; the region writes a varying value into it
        h = torch.zeros(D)
        add_rows(h, x)
        return fs.psum(h, "dp")

    sm = fs.shard_map(summed, mesh=mesh, in_specs="(dp b) d", out_specs="...")
    for k in range(2):
        close(errs, f"call {k}: psum of the written argument", sm(x), x.sum(0))

    def unreduced(x):
        h = torch.zeros(D)
        add_rows(h, x)
        return h

    messages = []
    for g in (add_rows, lambda h, x: h.add_(x.sum(0))):  # the region, and the same function eagerly
        add_rows = g
        try:
            fs.shard_map(unreduced, mesh=mesh, in_specs="(dp b) d", out_specs="...")(x)
            errs.append("a replicated out_spec took a written argument that varies")
        except fs.SpecError as e:
            messages.append(str(e))
    return errs, (stats["graphs"], messages)


def test_fs_compile_region_writing_an_argument_in_place_tags_it_as_eager_does():
    """The region wrote the caller's tensor but left its tag: a psum of it took the invariant rule
    (2x instead of the sum over ranks), and a replicated out_spec accepted it, silently."""
    got = run_ranks(N, _rank_region_inplace, timeout=110)
    assert_ok([e for e, _ in got])
    for _, (graphs, (region, eager)) in got:
        assert graphs == 2, graphs  # one per shard_map'd function calling it, none per call
        assert region == eager, (region, eager)
        assert region == (
            "fs.shard_map(_rank_region_inplace.<locals>.unreduced): 1 problem with out_specs (replication "
            "check):\n  - out varies over mesh axis dp but out_spec '...' says it is replicated over dp; reduce "
            "it inside f (fs.psum / fs.pmean over 'dp'), mark it as a partial sum with '| sum(dp)', split a dim "
            "over dp in the out_spec, or pass check=False if you know it is the same on every rank"
        ), region
