"""Training with fshard: optimizer trajectories, global-norm clipping, mesh-independent randomness.

Each rank trains the same small MLP with fshard (parameters laid out per parallel layout,
gradients from ``fs.value_and_grad``, updates from ``fs.optim``) and, in the same process,
with ``torch.optim`` on the global tensors; the two trajectories must agree step by step.
Rank functions return a list of problems so that one assertion shows every mismatch
(helpers.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, full, gelu_mlp, mse, randn

STEPS = 5


# == the model and its layouts ==============================================================

PARAMS = ("b1", "b2", "w1", "w2")
K, H, B = 8, 8, 8  # features, hidden, global batch

LAYOUTS = {
    # name: (param specs, all_gather dim per FSDP-split param, uses dp, uses tp)
    "dp": ({"w1": "k n", "b1": "n", "w2": "n k", "b2": "k"}, {}, True, False),
    "fsdp": (
        {"w1": "(dp k) n", "b1": "(dp n)", "w2": "(dp n) k", "b2": "(dp k)"},
        {"w1": 0, "b1": 0, "w2": 0, "b2": 0},
        True,
        False,
    ),
    "tp": ({"w1": "k (tp n)", "b1": "(tp n)", "w2": "(tp n) k", "b2": "k"}, {}, False, True),
    "dp_tp": ({"w1": "k (tp n)", "b1": "(tp n)", "w2": "(tp n) k", "b2": "k"}, {}, True, True),
    "fsdp_tp": (
        {"w1": "(dp k) (tp n)", "b1": "(tp dp n)", "w2": "(tp n) (dp k)", "b2": "(dp k)"},
        {"w1": 0, "b1": 0, "w2": 1, "b2": 0},
        True,
        True,
    ),
}


def _init_params(dtype=torch.float32):
    return {
        "w1": randn(1, K, H, dtype=dtype) / math.sqrt(K),
        "b1": randn(2, H, dtype=dtype) * 0.1,
        "w2": randn(3, H, K, dtype=dtype) / math.sqrt(H),
        "b2": randn(4, K, dtype=dtype) * 0.1,
    }


def _batch(step, dtype=torch.float32):
    return randn(100 + step, B, K, dtype=dtype), randn(200 + step, B, K, dtype=dtype)


def _forward(p, x, psum=lambda h: h):
    return psum(gelu_mlp(p, x)) + p["b2"]


def _ref_loss(p, x, y):
    return mse(_forward(p, x), y)


def _local_loss_fn(layout):
    import fshard as fs

    _, gather, dp, tp = LAYOUTS[layout]

    def loss(p, x, y):
        p = {k: fs.all_gather(v, "dp", dim=gather[k], tiled=True) if k in gather else v for k, v in p.items()}
        out = _forward(p, x, (lambda h: fs.psum(h, "tp")) if tp else (lambda h: h))
        local = ((out - y) ** 2).mean()
        return fs.pmean(local, "dp") if dp else local

    return loss


def _x_spec(layout):
    return "(dp b) k" if LAYOUTS[layout][2] else "b k"


def _place(mesh, layout, tensors):
    """Global tensors -> Sharded leaves for split specs, plain tensors for replicated ones."""
    import fshard as fs

    specs = LAYOUTS[layout][0]
    return {k: fs.shard(v, mesh, specs[k]) if "(" in specs[k] else v.clone() for k, v in tensors.items()}


def _optimizers(name):
    import fshard as fs

    if name == "sgd":
        return fs.optim.sgd(0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    return (
        fs.optim.adamw(0.01, weight_decay=0.01),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    )


def _state_specs(opt_name, specs):
    if opt_name == "sgd":
        return {"step": "", "momentum": specs}
    return {"step": "", "m": specs, "v": specs}


def _check_trajectory(errs, step, loss, ref_loss, params, ref):
    close(errs, f"step {step} loss", loss, ref_loss.detach())
    for k in PARAMS:
        close(errs, f"step {step} param {k}", full(params[k]), ref[k].detach())


# == training trajectories ===================================================================


def _train_outside(layout, axes, opt_name):
    """Gradients from fs.value_and_grad of the shard_map'd loss; updates by fs.optim on Sharded leaves."""
    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(**axes)
    specs = LAYOUTS[layout][0]
    loss_fn = fs.shard_map(
        _local_loss_fn(layout), mesh=mesh, in_specs=(specs, _x_spec(layout), _x_spec(layout)), out_specs=""
    )
    value_and_grad = fs.value_and_grad(loss_fn)
    opt, make_ref_opt = _optimizers(opt_name)
    params = _place(mesh, layout, _init_params())
    state = opt.init(params)
    ref = {k: torch.nn.Parameter(v) for k, v in _init_params().items()}
    ref_opt = make_ref_opt([ref[k] for k in PARAMS])

    for step in range(STEPS):
        x, y = _batch(step)
        loss, grads = value_and_grad(params, x, y)
        with fs.count_collectives() as counts:
            params, state = opt.update(params, grads, state)
        if counts.total:
            errs.append(f"step {step}: the optimizer update issued collectives: {counts}")
        ref_opt.zero_grad()
        ref_loss = _ref_loss(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        _check_trajectory(errs, step, loss, ref_loss, params, ref)

    # optimizer state is laid out like its parameter
    for key, tree in state.items():
        if key == "step":
            if tree != STEPS:
                errs.append(f"state step is {tree}, want {STEPS}")
            continue
        for k in PARAMS:
            s, p = tree[k], params[k]
            if isinstance(p, fs.Sharded) != isinstance(s, fs.Sharded) or (
                isinstance(p, fs.Sharded) and s.spec != p.spec
            ):
                errs.append(f"state {key}[{k}] is {s!r}, parameter is {p!r}")
    return errs


_TRAIN_CASES = [
    ("dp", {"dp": 1}),
    ("dp", {"dp": 2}),
    ("dp", {"dp": 4}),
    ("fsdp", {"dp": 2}),
    ("fsdp", {"dp": 4}),
    ("tp", {"tp": 2}),
    ("tp", {"tp": 4}),
    ("dp_tp", {"dp": 2, "tp": 2}),
    ("dp_tp", {"dp": 4, "tp": 2}),
    ("fsdp_tp", {"dp": 2, "tp": 2}),
    ("fsdp_tp", {"dp": 1, "tp": 2}),
]


def _ids(layout, axes):
    return f"{layout}-" + "x".join(f"{k}{v}" for k, v in axes.items())


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize(
    "layout, axes", [pytest.param(lay, ax, id=_ids(lay, ax)) for lay, ax in _TRAIN_CASES]
)
def test_training_trajectory_matches_torch_optim(layout, axes, opt_name):
    assert_ok(run_ranks(math.prod(axes.values()), _train_outside, layout, axes, opt_name))


def _train_inside(layout, axes, opt_name):
    """The whole step inside shard_map: value_and_grad and fs.optim update on local blocks."""
    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(**axes)
    specs = LAYOUTS[layout][0]
    local_loss = _local_loss_fn(layout)
    opt, make_ref_opt = _optimizers(opt_name)

    def train_step(p, state, x, y):
        loss, grads = fs.value_and_grad(local_loss)(p, x, y)
        p, state = opt.update(p, grads, state)
        return loss, p, state

    st_specs = _state_specs(opt_name, specs)
    step_fn = fs.shard_map(
        train_step,
        mesh=mesh,
        in_specs=(specs, st_specs, _x_spec(layout), _x_spec(layout)),
        out_specs=("", specs, st_specs),
    )
    params = _place(mesh, layout, _init_params())
    state = opt.init(params)
    ref = {k: torch.nn.Parameter(v) for k, v in _init_params().items()}
    ref_opt = make_ref_opt([ref[k] for k in PARAMS])
    for step in range(STEPS):
        x, y = _batch(step)
        try:
            loss, params, state = step_fn(params, state, x, y)
        except fs.SpecError as e:  # raised identically on every rank, before any communication
            errs.append(f"step {step}: SpecError: {e}")
            return errs
        ref_opt.zero_grad()
        ref_loss = _ref_loss(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        _check_trajectory(errs, step, loss, ref_loss, params, ref)
    return errs


@pytest.mark.parametrize(
    "layout, axes",
    [
        pytest.param("dp", {"dp": 2}, id="dp-dp2"),
        pytest.param("fsdp", {"dp": 2}, id="fsdp-dp2"),
        pytest.param("tp", {"tp": 2}, id="tp-tp2"),
        pytest.param("dp_tp", {"dp": 2, "tp": 2}, id="dp_tp-dp2xtp2"),
        pytest.param("fsdp_tp", {"dp": 2, "tp": 2}, id="fsdp_tp-dp2xtp2"),
    ],
)
def test_training_step_inside_shard_map(layout, axes):
    assert_ok(run_ranks(math.prod(axes.values()), _train_inside, layout, axes, "adamw"))


# == global norm and clipping ================================================================


def _ref_grads(dtype=torch.float32):
    ref = {k: v.clone().requires_grad_(True) for k, v in _init_params(dtype).items()}
    x, y = _batch(0, dtype)
    _ref_loss(ref, x, y).backward()
    return {k: ref[k].grad for k in PARAMS}


def _ref_clip(grads, max_norm):
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    ps = {k: torch.nn.Parameter(torch.zeros_like(g)) for k, g in grads.items()}
    for k, p in ps.items():
        p.grad = grads[k].clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(list(ps.values()), max_norm)
    return norm, torch_norm, {k: p.grad for k, p in ps.items()}


def _clip_outside(layout, axes):
    """Gradients as Sharded leaves (and plain leaves for replicated parameters), outside shard_map."""
    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(**axes)
    specs = LAYOUTS[layout][0]
    loss_fn = fs.shard_map(
        _local_loss_fn(layout), mesh=mesh, in_specs=(specs, _x_spec(layout), _x_spec(layout)), out_specs=""
    )
    x, y = _batch(0)
    _, grads = fs.value_and_grad(loss_fn)(_place(mesh, layout, _init_params()), x, y)
    ref = _ref_grads()
    norm, torch_norm, _ = _ref_clip(ref, 1.0)
    with fs.count_collectives() as counts:
        got = fs.optim.global_norm(grads)
    close(errs, "global_norm", got, norm)
    close(errs, "global_norm vs torch.nn.utils.clip_grad_norm_", got, torch_norm)
    # one all_reduce when some leaf is split; none when every gradient is replicated (all local)
    want = 1 if any(isinstance(g, fs.Sharded) for g in grads.values()) and mesh.size > 1 else 0
    if counts.total != want:
        errs.append(f"global_norm issued {counts}, want {want} all_reduce")
    for max_norm in (0.5 * norm.item(), 10 * norm.item()):  # clips, does not clip
        _, _, ref_clipped = _ref_clip(ref, max_norm)
        clipped, n = fs.optim.clip_by_global_norm(grads, max_norm)
        close(errs, f"clip_by_global_norm({max_norm:.3g}) norm", n, norm)
        for k in PARAMS:
            if type(clipped[k]) is not type(grads[k]):
                errs.append(f"clipped {k} is {type(clipped[k]).__name__}, grad was {type(grads[k]).__name__}")
            close(errs, f"clip_by_global_norm({max_norm:.3g}) {k}", full(clipped[k]), ref_clipped[k])
    return errs


def _clip_inside(layout, axes, check):
    """Gradients as plain local tensors inside f (mixed replicated and split), clipped inside f."""
    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(**axes)
    specs = LAYOUTS[layout][0]
    local_loss = _local_loss_fn(layout)
    ref = _ref_grads()
    norm, _, _ = _ref_clip(ref, 1.0)
    max_norm = 0.5 * norm.item()
    _, _, ref_clipped = _ref_clip(ref, max_norm)

    def body(p, x, y):
        _, grads = fs.value_and_grad(local_loss)(p, x, y)
        n1 = fs.optim.global_norm(grads)
        clipped, n2 = fs.optim.clip_by_global_norm(grads, max_norm)
        n3 = fs.optim.global_norm(clipped)  # the norm after clipping is max_norm
        return n1, n2, n3, clipped

    f = fs.shard_map(
        body,
        mesh=mesh,
        in_specs=(specs, _x_spec(layout), _x_spec(layout)),
        out_specs=("", "", "", specs),
        check=check,
    )
    x, y = _batch(0)
    try:
        n1, n2, n3, clipped = f(_place(mesh, layout, _init_params()), x, y)
    except fs.SpecError as e:
        errs.append(f"SpecError: {e}")
        return errs
    close(errs, "global_norm inside f", n1, norm)
    close(errs, "clip_by_global_norm norm inside f", n2, norm)
    close(errs, "global_norm of the clipped grads inside f", n3, torch.tensor(max_norm))
    for k in PARAMS:
        close(errs, f"clipped {k}", full(clipped[k]), ref_clipped[k])
    return errs


_CLIP_CASES = [
    pytest.param("dp", {"dp": 2}, id="dp-dp2"),
    pytest.param("fsdp", {"dp": 2}, id="fsdp-dp2"),
    pytest.param("tp", {"tp": 2}, id="tp-tp2"),
    pytest.param("dp_tp", {"dp": 2, "tp": 2}, id="dp_tp-dp2xtp2"),
    pytest.param("fsdp_tp", {"dp": 2, "tp": 2}, id="fsdp_tp-dp2xtp2"),
]


@pytest.mark.parametrize("layout, axes", _CLIP_CASES)
def test_clip_by_global_norm_outside(layout, axes):
    assert_ok(run_ranks(math.prod(axes.values()), _clip_outside, layout, axes))


@pytest.mark.parametrize("layout, axes", _CLIP_CASES)
def test_clip_by_global_norm_inside(layout, axes):
    assert_ok(run_ranks(math.prod(axes.values()), _clip_inside, layout, axes, True))


@pytest.mark.parametrize(
    "layout, axes", [c for c in _CLIP_CASES if c.id in ("dp_tp-dp2xtp2", "fsdp_tp-dp2xtp2")]
)
def test_clip_by_global_norm_inside_values(layout, axes):
    """Values only (replication check off): clipped grads and the global norm of the clipped grads."""
    assert_ok(run_ranks(math.prod(axes.values()), _clip_inside, layout, axes, False))


def _global_norm_inside_only(layout, axes):
    """global_norm alone (no clipping) inside f, on mixed replicated / split gradients."""
    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(**axes)
    specs = LAYOUTS[layout][0]
    local_loss = _local_loss_fn(layout)
    norm, _, _ = _ref_clip(_ref_grads(), 1.0)

    def body(p, x, y):
        _, grads = fs.value_and_grad(local_loss)(p, x, y)
        with fs.count_collectives() as counts:
            n = fs.optim.global_norm(grads)
        return n, torch.tensor(counts.total)

    f = fs.shard_map(body, mesh=mesh, in_specs=(specs, _x_spec(layout), _x_spec(layout)), out_specs=("", ""))
    x, y = _batch(0)
    n, total = f(_place(mesh, layout, _init_params()), x, y)
    close(errs, "global_norm inside f", n, norm)
    if total.item() != 1:
        errs.append(f"global_norm issued {total.item()} collectives, want 1")
    return errs


@pytest.mark.parametrize(
    "layout, axes", [c for c in _CLIP_CASES if c.id in ("dp_tp-dp2xtp2", "fsdp_tp-dp2xtp2")]
)
def test_global_norm_inside(layout, axes):
    assert_ok(run_ranks(4, _global_norm_inside_only, layout, axes))


# == randomness ===============================================================================


def _normal_is_mesh_independent(axes, specs):
    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(**axes)
    for spec in specs:
        for dtype in (torch.float32, torch.float64):
            want = fs.random.normal(7, (8, 4), std=0.5, mean=1.0, dtype=dtype)
            got = fs.random.normal(7, (8, 4), std=0.5, mean=1.0, mesh=mesh, spec=spec, dtype=dtype)
            if not isinstance(got, fs.Sharded):
                errs.append(f"normal(mesh, {spec!r}) returned {type(got).__name__}")
                continue
            if tuple(got.shape) != (8, 4) or got.spec.replace(" ", "") == "":
                errs.append(f"normal(mesh, {spec!r}): shape {tuple(got.shape)} spec {got.spec!r}")
            whole = got.full()
            if not torch.equal(whole, want):
                errs.append(f"normal(mesh, {spec!r}, {dtype}).full() differs from the unsharded call")
            u = fs.random.uniform(8, (8, 4), low=-1, high=2, mesh=mesh, spec=spec, dtype=dtype).full()
            if not torch.equal(u, fs.random.uniform(8, (8, 4), low=-1, high=2, dtype=dtype)):
                errs.append(f"uniform(mesh, {spec!r}, {dtype}).full() differs from the unsharded call")
    # a different seed gives a different tensor
    if torch.equal(fs.random.normal(1, (8, 4)), fs.random.normal(2, (8, 4))):
        errs.append("seeds 1 and 2 give the same normal tensor")
    return errs


@pytest.mark.parametrize(
    "axes, specs",
    [
        pytest.param({"dp": 1}, ["(dp a) b", "a b"], id="dp1"),
        pytest.param({"dp": 2}, ["(dp a) b", "a (dp b)", "a b"], id="dp2"),
        pytest.param(
            {"dp": 2, "tp": 2},
            ["(dp a) (tp b)", "(tp a) (dp b)", "(dp tp a) b", "(tp dp a) b", "a (tp b)"],
            id="dp2xtp2",
        ),
    ],
)
def test_random_normal_same_global_values_on_every_mesh(axes, specs):
    assert_ok(run_ranks(math.prod(axes.values()), _normal_is_mesh_independent, axes, specs))


def _dropout_masks():
    """Masks per rank for values split over dp (replicated over tp), over tp, and replicated."""
    import fshard as fs

    mesh = fs.Mesh(dp=2, tp=2)
    p = 0.5

    def masks(a, b, c):
        return (
            fs.random.dropout(a, p, seed=3),
            fs.random.dropout(b, p, seed=3),
            fs.random.dropout(c, p, seed=3),
            fs.random.dropout(a, p, seed=4),
            fs.random.dropout(a, p, seed=3, training=False),
        )

    f = fs.shard_map(
        masks,
        mesh=mesh,
        in_specs=("(dp b) d", "b (tp d)", "b d"),
        out_specs=("(dp b) d", "b (tp d)", "b d", "(dp b) d", "(dp b) d"),
    )
    ones = torch.ones(8, 64)
    out = f(ones, ones, ones)
    locs = [o.local if isinstance(o, fs.Sharded) else o for o in out]

    # gradient of a dropout is its mask
    xg = torch.ones(8, 64, requires_grad=True)
    g = fs.shard_map(
        lambda a: fs.random.dropout(a, p, seed=3), mesh=mesh, in_specs=("(dp b) d",), out_specs="(dp b) d"
    )
    y = g(xg)
    y.local.sum().backward()
    grad_ok = torch.equal(xg.grad.narrow(0, mesh.axis_index("dp") * 4, 4), y.local.detach())
    return {
        "coord": mesh.coordinate,
        "masks": [t.detach().tolist() for t in locs],
        "grad_ok": grad_ok,
    }


def test_dropout_masks_equal_across_replicas_differ_across_shards():
    res = run_ranks(4, _dropout_masks)
    by = {(r["coord"]["dp"], r["coord"]["tp"]): [torch.tensor(m) for m in r["masks"]] for r in res}
    split_dp, split_tp, repl, other_seed, off = (0, 1, 2, 3, 4)
    for m in by.values():
        for t in m[:4]:
            vals = set(t.unique().tolist())
            assert vals <= {0.0, 2.0}, f"dropout values {vals}: want 0 or 1/(1-p)"
            assert 0.3 < (t != 0).float().mean().item() < 0.7
        assert torch.equal(m[off], torch.ones_like(m[off])), "training=False must be the identity"
        assert not torch.equal(m[split_dp], m[other_seed]), "another seed must give another mask"
    # split over dp, replicated over tp
    assert torch.equal(by[0, 0][split_dp], by[0, 1][split_dp]) and torch.equal(
        by[1, 0][split_dp], by[1, 1][split_dp]
    )
    assert not torch.equal(by[0, 0][split_dp], by[1, 0][split_dp])
    # split over tp, replicated over dp
    assert torch.equal(by[0, 0][split_tp], by[1, 0][split_tp]) and torch.equal(
        by[0, 1][split_tp], by[1, 1][split_tp]
    )
    assert not torch.equal(by[0, 0][split_tp], by[0, 1][split_tp])
    # replicated everywhere
    assert all(torch.equal(by[0, 0][repl], m[repl]) for m in by.values())
    assert all(r["grad_ok"] for r in res), "the gradient of dropout must be its mask"
