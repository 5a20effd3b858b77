"""Values and gradients that must agree across ranks, and did not: three silent-wrong-value holes.

* ``check=False`` gradients: an output that is the same on every rank in fact but tracked as
  varying (a ``ppermute`` of a replicated value around a full ring, ``fs.switch`` with identical
  branches), returned under a replicated out_spec: the cotangent of each of its N copies flows
  back through ``f`` and the transposes sum them, so its gradient must be divided by N.
* Draws from torch's global generator inside ``f`` (``F.dropout``, ``torch.rand``, ...): each rank
  draws its own numbers, so their results vary over every mesh axis, and the replication check
  says so.
* ``fs.optim.clip_grad_norm_``: the global norm of local gradient blocks, where torch's own
  function would clip each rank by its local norm.

Each program's values and gradients are compared with plain torch on the global tensors in the
test process, on real gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close

DT = torch.float64
D = 3  # width of every value


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _ring(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# 1. check=False: an output tracked as varying but returned as replicated


def _sq(w):
    return w * w


def _ring_sum(x):
    """The sum of x over 'r', by hand: N-1 ppermutes around the ring (the same on every rank in fact)."""
    n = fs.axis_size("r")
    acc, s = x, x
    for _ in range(n - 1):
        s = fs.ppermute(s, "r", _ring(n))
        acc = acc + s
    return acc


def _programs(n: int, a: int, b: int) -> dict:
    """name -> (mesh axes, f(w, x), in_specs, out_spec, reference(W, X) on the global tensors).

    ``w`` (shape (D,)) is replicated; ``x`` (shape (2 n, D)) is split as in_specs says."""
    one = {"r": n}
    two = {"a": a, "b": b}
    return {
        # replicated w sent around the full ring: the same on every rank, tracked as varying over r
        "ring": (
            one,
            lambda w, x: fs.ppermute(w.sin(), "r", _ring(n)),
            ("d", "(r k) d"),
            "d",
            lambda W, X: W.sin(),
        ),
        # a varying x summed over r by ppermutes: the gradient reaches the varying input too
        "ring_sum": (
            one,
            lambda w, x: _ring_sum(x * w),
            ("d", "(r k) d"),
            "k d",
            lambda W, X: (X * W).reshape(n, -1, D).sum(0),
        ),
        # every rank runs a branch of its own, all alike
        "switch": (
            one,
            lambda w, x: fs.switch(fs.axis_index("r"), [_sq] * n, w),
            ("d", "(r k) d"),
            "d",
            _sq_ref,
        ),
        # 2-axis mesh, output tracked as varying over 'a' only (divide by |a|, not by the mesh)
        "ring_a": (
            two,
            lambda w, x: fs.ppermute(w.sin(), "a", _ring(a)),
            ("d", "(b k) d"),
            "d",
            lambda W, X: W.sin(),
        ),
        # over both axes (divide by |a| |b|)
        "ring_ab": (
            two,
            lambda w, x: fs.ppermute(fs.ppermute(w.sin(), "a", _ring(a)), "b", _ring(b)),
            ("d", "(b k) d"),
            "d",
            lambda W, X: W.sin(),
        ),
        # split over b by its spec, tracked varying over a too: only 'a' is extra
        "split_b_ring_a": (
            two,
            lambda w, x: fs.ppermute(x * w, "a", _ring(a)),
            ("d", "(b k) d"),
            "(b k) d",
            lambda W, X: X * W,
        ),
    }


def _sq_ref(W, X):
    return W * W


def _rank_unchecked(n: int, a: int, b: int, W, X, C):
    errs: list[str] = []
    for name, (axes, body, in_specs, out_spec, ref) in _programs(n, a, b).items():
        mesh = fs.Mesh(**axes)
        f = fs.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check=False)
        w, x = W.clone().requires_grad_(True), X.clone().requires_grad_(True)
        want_w, want_x = W.clone().requires_grad_(True), X.clone().requires_grad_(True)
        want = ref(want_w, want_x)
        c = C[name]
        (want * c).sum().backward()

        y = f(w, x)
        y = y.full() if isinstance(y, fs.Sharded) else y
        close(errs, f"{name}: value", y, want, DT)
        (y * c).sum().backward()  # loss.backward()
        close(errs, f"{name}: backward grad w", w.grad, want_w.grad, DT)
        close(
            errs,
            f"{name}: backward grad x",
            x.grad if x.grad is not None else torch.zeros_like(X),
            want_x.grad if want_x.grad is not None else torch.zeros_like(X),
            DT,
        )

        def loss(w, x, f=f, c=c):
            out = f(w, x)
            return ((out.full() if isinstance(out, fs.Sharded) else out) * c).sum()

        v, (gw, gx) = fs.value_and_grad(loss, argnums=(0, 1))(W, X)
        close(errs, f"{name}: value_and_grad value", v, (want * c).sum(), DT)
        close(errs, f"{name}: value_and_grad grad w", gw, want_w.grad, DT)
        close(
            errs,
            f"{name}: value_and_grad grad x",
            gx,
            want_x.grad if want_x.grad is not None else torch.zeros_like(X),
            DT,
        )

    # second order: d/dw of |dy/dw|^2 for y = ring-sent w^3 (the same on every rank)
    mesh = fs.Mesh(r=n)
    f = fs.shard_map(
        lambda w: fs.ppermute(w**3, "r", _ring(n)), mesh=mesh, in_specs="d", out_specs="d", check=False
    )
    w = W.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(w).sum(), w, create_graph=True)
    close(errs, "second order: first grad", g, 3 * W**2, DT)
    (g * g).sum().backward()
    close(errs, "second order: grad of |grad|^2", w.grad, 36 * W**3, DT)

    # nothing added when tracking proves the output replicated (a psum), nor under check=True
    for check in (False, True):
        g2 = fs.shard_map(
            lambda w, x: fs.psum(x * w, "r"),
            mesh=mesh,
            in_specs=("d", "(r k) d"),
            out_specs="k d",
            check=check,
        )
        y = g2(W.clone().requires_grad_(True), X)
        if type(y.grad_fn).__name__ == "_ScaleCotangentBackward":
            errs.append(f"check={check}: a psum output got a cotangent scale")
    return errs


@pytest.mark.parametrize("n,a,b", [(2, 2, 1), (4, 2, 2), (8, 4, 2)])
def test_check_false_gradients_of_replicated_outputs(n, a, b):
    W, X = _randn(0, D), _randn(1, 2 * n, D)
    C = {
        name: _randn(10 + i, *ref(W, X).shape)
        for i, (name, (_, _, _, _, ref)) in enumerate(_programs(n, a, b).items())
    }
    assert_ok(run_ranks(n, _rank_unchecked, n, a, b, W, X, C))


# ---------------------------------------------------------------------------------------------
# 4. torch's global generator: each rank draws its own numbers


def _draw(route, x):
    """A value drawn from torch's global generator; returns (value, the op's name in the message)."""
    import torch.nn.functional as F

    if route == "F.dropout":
        return F.dropout(x, 0.5), "torch.nn.functional.dropout"
    if route == "nn.Dropout":
        return torch.nn.Dropout(0.5)(x), "torch.nn.functional.dropout"
    if route == "rand":
        return torch.rand(3), "torch.rand"
    if route == "randn_like":
        return torch.randn_like(x), "torch.randn_like"
    if route == "bernoulli":
        return torch.bernoulli(torch.full_like(x, 0.5)), "torch.bernoulli"
    if route == "normal_":
        return torch.empty(3).normal_(), "Tensor.normal_"
    if route == "uniform_":
        return x.clone().uniform_(), "Tensor.uniform_"
    if route == "multinomial":
        return torch.multinomial(torch.ones(5), 3), "torch.multinomial"
    if route == "randperm":
        return torch.randperm(5), "torch.randperm"
    if route == "randint":
        return torch.randint(0, 9, (3,)), "torch.randint"
    raise AssertionError(route)


DRAWS = [
    "F.dropout",
    "nn.Dropout",
    "rand",
    "randn_like",
    "bernoulli",
    "normal_",
    "uniform_",
    "multinomial",
    "randperm",
    "randint",
]


def _replication_text(head, axes, spec, drew):
    ax = ", ".join(axes)
    tup = repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))
    word = "axis" if len(axes) == 1 else "axes"
    text = (
        f"fs.shard_map({head}): 1 problem with out_specs (replication check):\n"
        f"  - out varies over mesh {word} {ax} but out_spec {spec!r} says it is replicated over {ax}; reduce it "
        f"inside f (fs.psum / fs.pmean over {tup}), mark it as a partial sum with '| sum({' '.join(axes)})', split "
        f"a dim over {ax} in the out_spec, or pass check=False if you know it is the same on every rank"
    )
    if drew:
        text += (
            f"\nf drew random numbers from torch's global generator ({drew}), which gives each rank numbers of "
            f"its own, so they vary over every mesh axis; draw them with fs.random, whose streams agree across "
            f"the axes a value is replicated over: fs.random.dropout(x, p, seed=step) for dropout, or pass "
            f"generator=fs.random.generator(seed, like=x) to torch.rand, torch.randn, torch.bernoulli, "
            f"Tensor.normal_ and the rest"
        )
    return text


def _spec_error(fn, *args):
    try:
        fn(*args)
    except (fs.SpecError, fs.TracingError) as e:
        return str(e)
    return "no error"


def _rank_random(X, W, C):
    import torch.nn.functional as F

    errs: list[str] = []
    texts: dict = {}
    torch.manual_seed(1000 + torch.distributed.get_rank())  # per-rank seeds, as a training script has
    mesh = fs.Mesh(dp=2, tp=2)
    x = X.clone()

    # a dp-split activation, replicated over tp, through F.dropout: the tp replicas would differ
    def drop(h):
        return F.dropout(h, 0.5)

    texts["drop"] = _spec_error(fs.shard_map(drop, mesh=mesh, in_specs="(dp b) d", out_specs="(dp b) d"), x)
    for route in DRAWS:

        def f(h, route=route):
            return _draw(route, h)[0]

        texts[route] = _spec_error(fs.shard_map(f, mesh=mesh, in_specs="b d", out_specs="..."), x)

    # what does not draw from the global generator passes the check
    def ok(h):
        out = {
            "fs.random.dropout": fs.random.dropout(h, 0.5, seed=1),
            "fs.random.generator": torch.randn(h.shape, generator=fs.random.generator(0, like=h)),
            "eval nn.Dropout": torch.nn.Dropout(0.5).eval()(h),
            "training=False": F.dropout(h, 0.5, training=False),
            "p=0": F.dropout(h, 0.0),
        }
        rep = {
            "fs.random.normal": fs.random.normal(0, (3,)),
            "generator seeded alike": torch.rand(3, generator=torch.Generator().manual_seed(5)),
        }
        return out, rep

    try:
        out, rep = fs.shard_map(ok, mesh=mesh, in_specs="(dp b) d", out_specs=("(dp b) d", "..."))(x)
    except fs.FshardError as e:
        errs.append(f"fs.random and non-drawing calls failed the check: {e}")
    else:
        for k in ("eval nn.Dropout", "training=False", "p=0"):
            close(errs, k, out[k].full(), X, DT)
        close(errs, "fs.random.normal", rep["fs.random.normal"], fs.random.normal(0, (3,)), torch.float32)
        close(
            errs,
            "seeded",
            rep["generator seeded alike"],
            torch.rand(3, generator=torch.Generator().manual_seed(5)),
            torch.float32,
        )

    # fs.random.generator's numbers vary over like's axes: not replicated over dp
    def gen_rep(h):
        return torch.randn(h.shape, generator=fs.random.generator(0, like=h))

    texts["generator_replicated"] = _spec_error(
        fs.shard_map(gen_rep, mesh=mesh, in_specs="(dp b) d", out_specs="..."), x
    )

    # an in-place dropout of a tp-replicated value that needs a gradient: its gradient could not be summed
    def inplace(h, w):
        return F.dropout(h @ w, 0.5, inplace=True)

    texts["inplace"] = _spec_error(
        fs.shard_map(inplace, mesh=mesh, in_specs=("(dp b) k", "k d"), out_specs="(dp b) (tp d)"),
        X,
        W.clone().requires_grad_(True),
    )

    # gradients: the tp-replicated operand gets a pvary (its gradient sums the tp ranks' masked
    # cotangents); compared with plain torch given the masks the ranks drew
    for axes, out_spec, reps in (({"dp": 4}, "(dp b) d", 1), ({"dp": 2, "tp": 2}, "(dp b) (tp d)", 2)):
        m = fs.Mesh(**axes)
        f = fs.shard_map(
            lambda h, w: F.dropout(h @ w, 0.5), mesh=m, in_specs=("(dp b) k", "k d"), out_specs=out_spec
        )
        x, w = X.clone().requires_grad_(True), W.clone().requires_grad_(True)
        y = f(x, w).full()
        c = C[: y.shape[0], : y.shape[1]]
        (y * c).sum().backward()
        xr, wr = X.clone().requires_grad_(True), W.clone().requires_grad_(True)
        h = (xr @ wr).repeat(1, reps)
        mask = (y.detach() != 0).to(DT) * 2.0
        if reps == 2 and torch.equal(mask[:, : W.shape[1]], mask[:, W.shape[1] :]):
            errs.append(f"{axes}: the two tp ranks drew the same mask")
        close(errs, f"{axes}: value", y, h * mask, DT)
        (h * mask * c).sum().backward()
        close(errs, f"{axes}: grad x", x.grad, xr.grad, DT)
        close(errs, f"{axes}: grad w", w.grad, wr.grad, DT)
    return errs, texts


def test_global_generator_draws_vary_over_every_axis():
    X, W, C = _randn(0, 8, 4), _randn(1, 4, D), _randn(2, 8, 2 * D)
    results = run_ranks(4, _rank_random, X, W, C)
    assert_ok([errs for errs, _ in results])
    texts = results[0][1]
    assert all(t == texts for _, t in results), "ranks disagree"
    head = "_rank_random.<locals>."
    assert texts["drop"] == _replication_text(
        head + "drop", ["tp"], "(dp b) d", "torch.nn.functional.dropout"
    )
    for route in DRAWS:
        want = _replication_text(head + "f", ["dp", "tp"], "...", _draw(route, torch.ones(2, 2))[1])
        assert texts[route] == want, route
    # an fs.random.generator stream varies over like's axes: the check says so, with no word on torch's generator
    assert texts["generator_replicated"] == _replication_text(head + "gen_rep", ["dp"], "...", None)
    assert texts["inplace"] == (
        "fs.shard_map(_rank_random.<locals>.inplace): in-place dropout writes a value that varies over mesh axis "
        "'tp' into a tensor that needs a gradient and does not vary over them, so its gradient could not be "
        "summed over those axes; use the out-of-place op (e.g. torch.where, index_put, x = x + y), or "
        "fs.pvary(x, ...) before writing into it"
    )


# ---------------------------------------------------------------------------------------------
# 5. fs.optim.clip_grad_norm_: the global norm of FSDP-sharded parameters' local gradients

CLIP_SPECS = {"w1": "(dp a) b", "w2": "(dp b) c"}  # 7 and 5 rows: uneven blocks on 2 and 4 ranks


def _clip_params():
    return {"w1": _randn(20, 7, 5), "w2": _randn(21, 5, 3), "bias": _randn(22, 3)}


def _clip_loss_ref(p, x):
    return ((x @ p["w1"]).tanh() @ p["w2"] + p["bias"]).pow(2).sum()


def _rank_clip(n, X):
    errs: list[str] = []
    mesh = fs.Mesh(dp=n)

    @fs.shard_map(mesh=mesh, in_specs=("(dp a) b", "(dp b) c", "c", "(dp m) a"), out_specs="")
    def loss_fn(w1, w2, bias, x):
        w1, w2 = fs.all_gather(w1, "dp", tiled=True), fs.all_gather(w2, "dp", tiled=True)
        return fs.psum(((x @ w1).tanh() @ w2 + bias).pow(2).sum(), "dp")

    P = _clip_params()
    params = {
        k: fs.shard(v, mesh, CLIP_SPECS[k]).requires_grad_(True) for k, v in P.items() if k in CLIP_SPECS
    }
    params["bias"] = P["bias"].clone().requires_grad_(True)  # a plain tensor: replicated
    ref = {k: v.clone().requires_grad_(True) for k, v in P.items()}
    order = ["w1", "w2", "bias"]
    for norm_type in (2.0, 1.0, 3.0, float("inf")):
        for clips in (True, False):
            for k in order:
                p = params[k]
                (p.local if isinstance(p, fs.Sharded) else p).grad = None
                ref[k].grad = None
            loss_fn(params["w1"], params["w2"], params["bias"], X).backward()
            _clip_loss_ref(ref, X).backward()
            true = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(ref[k].grad, norm_type) for k in order]), norm_type
            )
            max_norm = 0.3 * true.item() if clips else 3 * true.item()
            what = f"norm_type={norm_type} {'clipping' if clips else 'not clipping'}"
            if norm_type == 2.0 and clips:  # torch's own function on the local blocks: each rank its own norm
                local = [fs.optim.local_tensors(params[k])[0].grad.clone() for k in order]
                torch_local = torch.nn.utils.clip_grad_norm_(
                    [torch.nn.Parameter(g.clone()) for g in local], 1.0
                )
                if torch.allclose(torch_local.to(DT), true):
                    errs.append("torch's clip_grad_norm_ of the local blocks gave the global norm")
            want = torch.nn.utils.clip_grad_norm_([ref[k] for k in order], max_norm, norm_type)
            with fs.count_collectives() as counts:
                got = fs.optim.clip_grad_norm_(params.values(), max_norm, norm_type=norm_type)
            close(errs, f"{what}: norm", got, want, DT)
            if counts.total != 1:
                errs.append(f"{what}: {counts}, want one all_reduce")
            for k in order:
                g = params[k].grad.full() if isinstance(params[k], fs.Sharded) else params[k].grad
                close(errs, f"{what}: clipped grad {k}", g, ref[k].grad, DT)
    return errs


@pytest.mark.parametrize("n", [2, 4])
def test_clip_grad_norm_of_sharded_parameters(n):
    assert_ok(run_ranks(n, _rank_clip, n, _randn(23, 4 * n, 7)))


def test_clip_grad_norm_bad_norm_type():
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(fs.ArgumentError) as e:
            fs.optim.clip_grad_norm_([], 1.0, norm_type=bad)
        assert str(e.value) == (
            f"fs.optim.clip_grad_norm_: norm_type must be a positive number or float('inf'), got "
            f"{float(bad)!r}; use 2.0 for the L2 norm"
        )
