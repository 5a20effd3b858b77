"""Pipeline stages of different shapes: ``fs.PerRank`` values and ``fs.switch``, on real gloo ranks.

A pipeline whose stages differ in shape (an embedding on stage 0, a different hidden width per
stage, a head on the last stage) holds each stage's parameters only on that stage's ranks
(``fs.PerRank``) and runs each stage's code with ``fs.switch``. Its loss and every stage's
parameter gradients are compared with the same sequential model run by plain torch in one process,
on meshes pp=2, pp=4 and dp=2 x pp=2; the errors are checked by their full text.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close

VOCAB, D, MB, M = 11, 6, 4, 3  # vocabulary, boundary width, microbatch size, microbatches
DT = torch.float64


def hidden(s: int) -> int:
    """Stage s's hidden width: a different one per stage."""
    return 5 + 3 * s


def stage_params(s: int, n: int, layers: int = 1) -> dict:
    """Stage s of n: its own parameters (seeded by s), shapes depending on s."""
    g = torch.Generator().manual_seed(100 + s)

    def rnd(*shape):
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 0.4).to(DT)

    p: dict = {
        "layers": [
            {"w1": rnd(D, hidden(s)), "b1": rnd(hidden(s)), "w2": rnd(hidden(s), D)} for _ in range(layers)
        ]
    }
    if s == 0:
        p["embed"] = rnd(VOCAB, D)
    if s == n - 1:
        p["head"] = rnd(D, VOCAB)
    return p


def run_layers(p, h):
    for lay in p["layers"]:
        h = h + torch.tanh(h @ lay["w1"] + lay["b1"]) @ lay["w2"]
    return h


def reference(n, tokens, targets, tied=None):
    """The sequential model in one process: loss and each stage's gradients (and tied's)."""
    params = [stage_params(s, n) for s in range(n)]
    leaves = [t.requires_grad_() for p in params for t in torch.utils._pytree.tree_leaves(p)]
    extra = [tied.clone().requires_grad_()] if tied is not None else []
    h = params[0]["embed"][tokens.reshape(-1)]
    if tied is not None:
        h = h + extra[0]
    for p in params:
        h = run_layers(p, h)
    logits = h @ params[-1]["head"]
    if tied is not None:
        logits = logits + (h * extra[0]).sum(-1, keepdim=True)
    loss = F.cross_entropy(logits, targets.reshape(-1))
    grads = torch.autograd.grad(loss, leaves + extra)
    out, k = [], 0
    for p in params:
        nl = len(torch.utils._pytree.tree_leaves(p))
        out.append(grads[k : k + nl])
        k += nl
    return loss.detach(), out, (grads[-1] if extra else None)


def run_stage(s, n, t, p, tokens, targets, carry, tied=None):
    """Stage s at clock tick t: microbatch t - s; constants in the bubble."""
    i = t - s
    m = tokens.shape[0]
    zero_h, zero_l = torch.zeros(tokens.shape[1], D, dtype=DT), torch.zeros((), dtype=DT)
    if not 0 <= i < m:
        return zero_h, zero_l
    h = p["embed"][tokens[i]] if s == 0 else carry
    if s == 0 and tied is not None:
        h = h + tied
    h = run_layers(p, h)
    if s < n - 1:
        return h, zero_l
    logits = h @ p["head"]
    if tied is not None:
        logits = logits + (h * tied).sum(-1, keepdim=True)
    # a sum over this microbatch's tokens; divided by the global token count outside
    return zero_h, F.cross_entropy(logits, targets[i], reduction="sum")


def pipeline(p, tokens, targets, *tied):
    """GPipe over "pp": stage s runs microbatch t - s at tick t; the loss is summed on the last stage."""
    n, stage = fs.axis_size("pp"), fs.axis_index("pp")
    m, mb = tokens.shape
    to_next = [(i, i + 1) for i in range(n - 1)]
    branches = [functools.partial(run_stage, s, n) for s in range(n)]
    carry = torch.zeros(mb, D, dtype=DT)
    total = torch.zeros((), dtype=DT)
    for t in range(m + n - 1):
        h, loss = fs.switch(stage, branches, t, p, tokens, targets, carry, *tied)
        total = total + loss
        if t < m + n - 2:
            carry = fs.ppermute(h, "pp", to_next)
    return fs.psum(total, "pp")


def n_stages(mesh):
    return mesh.axis_size("pp")


def _data(dp):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (M, MB * dp), generator=g)
    targets = torch.randint(0, VOCAB, (M, MB * dp), generator=g)
    return tokens, targets


def _rank_gradients(shape, tied_on):
    mesh = fs.Mesh(**shape)
    n, dp = mesh.axis_size("pp"), shape.get("dp", 1)
    tokens, targets = _data(dp)
    tied = torch.randn(D, generator=torch.Generator().manual_seed(3), dtype=DT) * 0.3 if tied_on else None
    params = fs.PerRank.build(mesh, "pp", [functools.partial(stage_params, s, n) for s in range(n)])
    errs: list[str] = []
    if params.index != mesh.axis_index("pp") or params.axes != ("pp",):
        errs.append(f"index {params.index}, axes {params.axes}")
    count = tokens.numel()

    def f(p, x, y, *extra):
        total = pipeline(p, x, y, *extra)
        return fs.psum(total, "dp") / count if "dp" in mesh.axis_names else total / count

    spec = "m (dp b)" if "dp" in shape else "m b"
    in_specs = (None, spec, spec) + ((None,) if tied_on else ())
    step = fs.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs="")
    args = (params, tokens, targets) + ((tied,) if tied_on else ())
    argnums = (0, 3) if tied_on else 0
    with fs.count_collectives() as counts:
        loss, grads = fs.value_and_grad(step, argnums=argnums)(*args)
    grads, gtied = grads if tied_on else (grads, None)
    want_loss, want, want_tied = reference(n, tokens, targets, tied)
    close(errs, "loss", loss, want_loss, DT)
    if not isinstance(grads, fs.PerRank) or grads.axes != ("pp",):
        errs.append(f"gradients are {type(grads).__name__}, not a PerRank over pp")
        return errs
    s = mesh.axis_index("pp")
    got = torch.utils._pytree.tree_leaves(grads.tree)
    if len(got) != len(want[s]):
        errs.append(f"stage {s}: {len(got)} gradients, want {len(want[s])}")
    for k, (a, b) in enumerate(zip(got, want[s])):
        close(errs, f"stage {s} gradient {k}", a, b, DT)
    if tied_on:
        close(errs, "tied gradient", gtied, want_tied, DT)
    # Nothing reduces the stages' gradients over pp: over pp go the ppermutes (forward and back),
    # the loss psum and the tied operand's gradient; over dp the loss psum and one bucket of the
    # stage's gradients; the tied gradient is summed over dp and pp at once.
    dp_on = "dp" in shape
    want_counts = {("ppermute", ("pp",)): 2 * (M + n_stages(mesh) - 2), ("all_reduce", ("pp",)): 1}
    if tied_on and not dp_on:
        want_counts[("all_reduce", ("pp",))] += 1
    if dp_on:
        want_counts[("all_reduce", ("dp",))] = 2
    if tied_on and dp_on:
        want_counts[("all_reduce", ("dp", "pp"))] = 1
    if dict(counts.by_kind()) != want_counts:
        errs.append(f"collectives {dict(counts.by_kind())}, want {want_counts}")
    return errs


@pytest.mark.parametrize(
    "n,shape,tied",
    [
        (2, {"pp": 2}, False),
        (4, {"pp": 4}, False),
        (4, {"dp": 2, "pp": 2}, False),
        (2, {"pp": 2}, True),
        (4, {"dp": 2, "pp": 2}, True),
    ],
    ids=["pp2", "pp4", "dp2xpp2", "pp2-tied", "dp2xpp2-tied"],
)
def test_pipeline_gradients_match_one_process(n, shape, tied):
    assert_ok(run_ranks(n, _rank_gradients, shape, tied))


# == a training step inside shard_map: PerRank in, PerRank out ==============================


def _sgd_reference(n, tokens, targets, lr, steps):
    """Each stage's parameters after ``steps`` SGD steps of the sequential model, in one process."""
    params = [stage_params(s, n) for s in range(n)]
    for _ in range(steps):
        _, grads, _ = _reference_from(params, tokens, targets)
        params = [
            torch.utils._pytree.tree_unflatten(
                [p - lr * g for p, g in zip(torch.utils._pytree.tree_leaves(ps), gs)],
                torch.utils._pytree.tree_structure(ps),
            )
            for ps, gs in zip(params, grads)
        ]
    return params


def _reference_from(params, tokens, targets):
    leaves = [t.detach().clone().requires_grad_() for p in params for t in torch.utils._pytree.tree_leaves(p)]
    it = iter(leaves)
    ps = [
        torch.utils._pytree.tree_unflatten(
            [next(it) for _ in torch.utils._pytree.tree_leaves(p)], torch.utils._pytree.tree_structure(p)
        )
        for p in params
    ]
    h = ps[0]["embed"][tokens.reshape(-1)]
    for p in ps:
        h = run_layers(p, h)
    loss = F.cross_entropy(h @ ps[-1]["head"], targets.reshape(-1))
    grads = torch.autograd.grad(loss, leaves)
    out, k = [], 0
    for p in params:
        nl = len(torch.utils._pytree.tree_leaves(p))
        out.append(grads[k : k + nl])
        k += nl
    return loss.detach(), out, None


def _rank_train_inside():
    mesh = fs.Mesh(dp=2, pp=2)
    n, lr, steps = 2, 0.5, 2
    tokens, targets = _data(2)
    count = tokens.numel()
    opt = fs.optim.sgd(lr)

    def train_step(p, x, y):
        def loss_fn(p):
            return fs.psum(pipeline(p, x, y), "dp") / count

        loss, grads = fs.value_and_grad(loss_fn)(p)
        new, _ = opt.update(p, grads, opt.init(p))
        return fs.PerRank(new, "pp"), loss

    step = fs.shard_map(train_step, mesh=mesh, in_specs=(None, "m (dp b)", "m (dp b)"), out_specs=(None, ""))
    params = fs.PerRank.build(mesh, "pp", [functools.partial(stage_params, s, n) for s in range(n)])
    errs: list[str] = []
    with fs.count_collectives() as counts:
        for _ in range(steps):
            params, loss = step(params, tokens, targets)
    if not isinstance(params, fs.PerRank) or params.axes != ("pp",) or params.mesh != mesh:
        return [f"step returned {params!r}, not a PerRank over pp"]
    s = params.index
    want = torch.utils._pytree.tree_leaves(_sgd_reference(n, tokens, targets, lr, steps)[s])
    got = torch.utils._pytree.tree_leaves(params.tree)
    for k, (a, b) in enumerate(zip(got, want)):
        close(errs, f"stage {s} parameter {k} after {steps} steps", a, b, DT)
    # the per-rank parameters come back without any gathering: no all-gather at all
    if any(kind == "all_gather" for kind, _ in counts.by_kind()):
        errs.append(f"gathered something: {counts}")
    return errs


def test_train_step_inside_shard_map_returns_per_rank_params():
    assert_ok(run_ranks(4, _rank_train_inside))


# == errors, each with its full text, the same on every rank ================================

MESH = "Mesh(dp=2, pp=2)"


def _catch(fn):
    try:
        fn()
    except fs.FshardError as e:
        return type(e).__name__, str(e)
    return None


def _stage_of_width(width):
    return {"w": torch.zeros(width, 3)}


def _rank_errors():
    mesh = fs.Mesh(dp=2, pp=2)
    dp, pp = mesh.axis_index("dp"), mesh.axis_index("pp")
    out = {}
    out["axis"] = _catch(lambda: fs.PerRank.build(mesh, "pipe", [dict, dict]))
    out["length"] = _catch(lambda: fs.PerRank.build(mesh, "pp", [dict, dict, dict]))
    out["no_mesh"] = _catch(lambda: fs.PerRank({}, "pp"))
    out["sharded_leaf"] = _catch(
        lambda: fs.PerRank({"w": fs.shard(torch.zeros(4), mesh, "(dp n)")}, "pp", mesh)
    )
    # the copies along dp of stage 1 disagree in shape (rank 3 builds a wider one)
    with fs.count_collectives() as counts:
        out["replicas"] = _catch(lambda: fs.PerRank(_stage_of_width(2 + pp + (dp and pp)), "pp", mesh))
    out["replicas_collectives"] = counts.by_kind()
    params = fs.PerRank(_stage_of_width(4 + pp), "pp", mesh)
    splits_pp = fs.shard_map(lambda p: p["w"].sum(), mesh=mesh, in_specs=("(pp a) b",), out_specs="pp")
    out["spec_over_pp"] = _catch(lambda: splits_pp(params))
    returns_pp = fs.shard_map(
        lambda p: fs.PerRank(p, "pp"), mesh=mesh, in_specs=(None,), out_specs="(pp a) b"
    )
    out["out_spec_over_pp"] = _catch(lambda: returns_pp(params))

    w = torch.ones(3, requires_grad=True)

    def captures(p, w):
        branches = [lambda h: (h * w).sum(), lambda h: (h * w).sum()]
        return fs.psum(fs.switch(fs.axis_index("pp"), branches, torch.ones(3)), "pp")

    out["captured"] = _catch(
        lambda: fs.shard_map(captures, mesh=mesh, in_specs=(None, None), out_specs="")(params, w)
    )

    def out_of_range(p):
        return fs.PerRank(
            fs.switch(
                fs.axis_index("pp") + 5,
                [lambda: p],
            ),
            "pp",
        )

    out["range"] = _catch(
        lambda: fs.shard_map(out_of_range, mesh=mesh, in_specs=(None,), out_specs=None)(params)
    )

    def captures_dp(p, x):
        return fs.psum(fs.switch(fs.axis_index("pp"), [lambda: x.sum(), lambda: x.sum()]), ("dp", "pp"))

    out["captured_dp"] = _catch(
        lambda: fs.shard_map(captures_dp, mesh=mesh, in_specs=(None, "(dp b)"), out_specs="")(
            params, torch.ones(4)
        )
    )
    return out


def test_errors_full_text():
    results = run_ranks(4, _rank_errors)
    pp_text = (
        "fs.switch in fs.shard_map(_rank_errors.<locals>.captures): branch {} uses a tensor of shape (3,)"
    )
    want = {
        "axis": ("ArgumentError", f"fs.PerRank.build: 'pipe' is not an axis of {MESH} (did you mean 'pp'?)"),
        "length": (
            "ArgumentError",
            "fs.PerRank.build: got 3 entries for axis 'pp' of size 2; give one per index (a callable returning that "
            "index's tree), or one callable taking the index",
        ),
        "no_mesh": (
            "ArgumentError",
            "fs.PerRank: pass mesh= (the fs.Mesh whose axes the value varies over); only inside fs.shard_map does it "
            "default to the call's mesh",
        ),
        "sharded_leaf": (
            "ArgumentError",
            "fs.PerRank: tree['w'] is an fs.Sharded value; a per-rank value holds this rank's own plain tensors (use "
            ".full() or .tree to get them)",
        ),
        "replicas": (
            "SpecError",
            "fs.PerRank: the ranks that hold the same index along 'pp' (the copies along 'dp') hold trees of "
            "different structure, shapes, dtypes or device types (index 1: rank 1 vs rank 3); a per-rank value is replicated "
            "over the other axes: build it the same way on every rank of an index (e.g. fs.PerRank.build(mesh, "
            "'pp', [...]) with the same seeds)",
        ),
        "replicas_collectives": {("all_gather", ("dp", "pp")): 1},
        "spec_over_pp": (
            "SpecError",
            "fs.shard_map(_rank_errors.<locals>.<lambda>): 1 problem with in_specs:\n"
            "  - args[0].tree['w'] with spec '(pp a) b' splits a dim over 'pp', an axis its fs.PerRank value varies "
            "over (each rank already holds only its own value); split only over the other axes, or give the spec None",
        ),
        "out_spec_over_pp": (
            "SpecError",
            "fs.shard_map(_rank_errors.<locals>.<lambda>): 1 problem with out_specs:\n"
            "  - out.tree['w'] with spec '(pp a) b' splits or sums over 'pp', an axis its fs.PerRank value varies "
            "over (each rank returns its own value); split only over the other axes, or give the spec None",
        ),
    }
    for rank, got in enumerate(results):
        pp = rank % 2
        for key, value in want.items():
            assert got[key] == value, (rank, key, got[key])
        assert got["captured"] == (
            "TracingError",
            pp_text.format(pp)
            + " that needs a gradient and is the same on every rank of 'pp' (captured by the "
            "branch, not passed as an operand); its gradient must be summed over 'pp' on every rank, which only an "
            "operand gets: pass it to the branches as an operand, fs.switch(index, branches, ..., x)",
        ), (rank, got["captured"])
        assert got["range"] == (
            "ArgumentError",
            f"fs.switch: index {5 + pp} (this rank's index along 'pp') is out of range for 1 branch; give one "
            f"branch per index value",
        ), (rank, got["range"])
        assert got["captured_dp"] == (
            "TracingError",
            f"fs.switch in fs.shard_map(_rank_errors.<locals>.captures_dp): branch {pp} uses a tensor of shape (2,) that varies over 'dp', "
            f"which neither the index nor any operand varies over (a captured tensor, or the result of a "
            f"collective): the results of every branch must vary over the same axes on every rank; pass it (or a "
            f"tensor that varies over 'dp') to the branches as an operand",
        ), (rank, got["captured_dp"])


# == fs.debug: per-rank values compared between the copies of an index ======================


def _rank_debug():
    mesh = fs.Mesh(dp=2, pp=2)
    dp, pp = mesh.axis_index("dp"), mesh.axis_index("pp")
    # same shapes on the copies along dp, but rank 2 (dp 1, pp 0) holds other values
    params = fs.PerRank({"w": torch.full((2 + pp,), float(dp and not pp))}, "pp", mesh)
    step = fs.shard_map(lambda p: fs.PerRank(p, "pp"), mesh=mesh, in_specs=(None,), out_specs=None)
    out = {"plain": _catch(lambda: step(params))}
    with fs.debug():
        out["debug"] = _catch(lambda: step(params))
        good = fs.PerRank({"w": torch.full((2 + pp,), float(pp))}, "pp", mesh)
        out["debug_good"] = _catch(lambda: step(good))
        out["debug_build"] = _catch(
            lambda: fs.PerRank({"w": torch.full((2 + pp,), float(dp and not pp))}, "pp", mesh)
        )
    return out


def test_debug_compares_copies_of_each_index():
    text = (
        "the per-rank values over 'pp' differ between ranks that hold the same index (index 0: rank 0 vs rank 2); "
        "they are replicated over 'dp': initialize them with the same seed on every rank of an index, and update "
        "them with gradients that are summed over 'dp'"
    )
    for rank, got in enumerate(run_ranks(4, _rank_debug)):
        assert got["plain"] is None and got["debug_good"] is None, (rank, got)
        assert got["debug"] == (
            "TracingError",
            f"fs.shard_map(_rank_debug.<locals>.<lambda>) [debug]: {text}",
        ), (
            rank,
            got["debug"],
        )
        assert got["debug_build"] == ("TracingError", f"fs.PerRank [debug]: {text}"), (
            rank,
            got["debug_build"],
        )


# =============================================================================================
# fs.optim.global_norm of PerRank gradients outside shard_map: each stage's tensors counted once


def _rank_global_norm():
    mesh = fs.Mesh(dp=2, pp=2)
    shapes = [(3, 4), (5,)]
    stage = [lambda s=s: {"w": torch.full(shapes[s], float(s + 1))} for s in range(2)]
    grads = {
        "stages": fs.PerRank.build(mesh, "pp", stage),
        "shared": torch.full((2,), 3.0),  # replicated: counted once
        "split": fs.shard(torch.arange(8.0), mesh, "(dp n)"),
    }
    norm = fs.optim.global_norm(grads)
    clipped, before = fs.optim.clip_by_global_norm(grads, 1.0)
    return float(norm), float(before), float(fs.optim.global_norm(clipped))


def test_global_norm_counts_each_stage_once():
    want = math.sqrt(12 * 1.0 + 5 * 4.0 + 2 * 9.0 + float((torch.arange(8.0) ** 2).sum()))
    for norm, before, after in run_ranks(4, _rank_global_norm):
        assert norm == pytest.approx(want, rel=1e-6)
        assert before == pytest.approx(want, rel=1e-6)
        assert after == pytest.approx(1.0, rel=1e-5)


# =============================================================================================
# Checkpoints: each stage's own tree is saved under its index and loaded back on its ranks


def _rank_checkpoint_stages(path):
    from fshard import checkpoint

    mesh = fs.Mesh(dp=2, pp=2)
    shapes = [(3, 4), (5,)]

    def build(fill):
        return fs.PerRank.build(
            mesh, "pp", [lambda s=s: {"w": torch.full(shapes[s], fill * (s + 1))} for s in range(2)]
        )

    checkpoint.save(path, {"stages": build(1.0), "step": 3})
    got = checkpoint.load(path, {"stages": build(0.0), "step": 0})
    s = mesh.coordinate["pp"]
    return got["step"], torch.equal(got["stages"].tree["w"], torch.full(shapes[s], float(s + 1)))


def test_checkpoint_per_rank_stages(tmp_path):
    assert run_ranks(4, _rank_checkpoint_stages, str(tmp_path / "ckpt")) == [(3, True)] * 4
