"""fshard.checkpoint: save at one mesh shape, load at another (and at other world sizes)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import run_ranks

# --- global values (every rank and the test process can rebuild them) ---------------------------


def _globals():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(8, 12, generator=g),
        "h": torch.randn(4, 8, 12, generator=g),
        "b": torch.randn(16, generator=g),
        "rep": torch.randn(4, 6, generator=g),
        "plain": torch.randn(6, generator=g),
    }


# Layouts at save time (mesh dp=2 x tp=2); "(tp dp x)" lists the axes against mesh order.
_SAVE_SPECS = {"w": "(dp a) (tp b)", "h": "h (tp dp s) d", "b": "(dp tp n)", "rep": "a b"}
# Layouts at load time, per mesh shape.
_LOAD_SPECS = {
    (1, 4): {"w": "a (tp b)", "h": "(tp h) s d", "b": "n", "rep": "(tp a) b"},
    (4, 1): {"w": "(dp a) b", "h": "h s (dp d)", "b": "(dp n)", "rep": "a b"},
    (2, 1): {"w": "a (dp b)", "h": "(dp h) s d", "b": "(dp n)", "rep": "a b"},
    (1, 2): {"w": "(tp a) b", "h": "h (tp s) d", "b": "(tp n)", "rep": "a (tp b)"},
}


def _tree(mesh, specs, values):
    import fshard as fs

    tree = {"params": {k: fs.shard(values[k], mesh, s) for k, s in specs.items()}}
    tree["params"]["plain"] = values["plain"].clone()
    tree["meta"] = {"step": 0, "lr": 0.0, "name": "", "flag": False}
    tree["list"] = [values["b"][:4].clone(), values["b"][4:].clone()]
    return tree


# --- rank functions (module level: the ranks import them by reference) ---------------------------


def _save_2x2(path, step):
    import fshard as fs
    from fshard import checkpoint

    fs.init()
    mesh = fs.Mesh(dp=2, tp=2)
    tree = _tree(mesh, _SAVE_SPECS, _globals())
    tree["meta"] = {"step": step, "lr": 0.25, "name": "run", "flag": True}
    return checkpoint.save(path, tree, step=step)


def _load_and_compare(path, dp, tp, step=None):
    import fshard as fs
    from fshard import checkpoint

    fs.init()
    mesh = fs.Mesh(dp=dp, tp=tp)
    zeros = {k: torch.zeros_like(v) for k, v in _globals().items()}
    like = _tree(mesh, _LOAD_SPECS[(dp, tp)], zeros)
    got = checkpoint.load(path, like, step=step)
    want = _globals()
    report = {}
    for k, spec in _LOAD_SPECS[(dp, tp)].items():
        x = got["params"][k]
        assert isinstance(x, fs.Sharded) and x.mesh == mesh and x.layout == like["params"][k].layout, k
        assert x.local.shape == like["params"][k].local.shape, k
        report[k] = torch.equal(x.full(), want[k])
    report["plain"] = torch.equal(got["params"]["plain"], want["plain"])
    report["list"] = torch.equal(torch.cat(got["list"]), want["b"])
    report["meta"] = got["meta"]
    # like was not modified
    report["like_untouched"] = all(
        float(v.local.abs().sum()) == 0 for v in like["params"].values() if isinstance(v, fs.Sharded)
    )
    return report


def _expected_report(step):
    keys = ["w", "h", "b", "rep", "plain", "list"]
    rep = {k: True for k in keys}
    rep["meta"] = {"step": step, "lr": 0.25, "name": "run", "flag": True}
    rep["like_untouched"] = True
    return rep


# AdamW: a few steps of a tiny tensor-parallel regression at dp=2 x tp=2, then a resharded resume.

_ADAM_SPECS = {
    (2, 2): {"w1": "(dp i) (tp h)", "w2": "(tp h) o", "bias": "o"},
    (1, 4): {"w1": "i (tp h)", "w2": "(tp h) o", "bias": "o"},
    (4, 1): {"w1": "(dp i) h", "w2": "h (dp o)", "bias": "(dp o)"},
}


def _adam_setup(dp, tp):
    import fshard as fs

    mesh = fs.Mesh(dp=dp, tp=tp)
    specs = _ADAM_SPECS[(dp, tp)]
    params = {
        "w1": fs.random.normal(1, (8, 16), std=0.3, mesh=mesh, spec=specs["w1"]),
        "w2": fs.random.normal(2, (16, 4), std=0.3, mesh=mesh, spec=specs["w2"]),
        "bias": fs.shard(torch.zeros(4), mesh, specs["bias"]),
    }
    opt = fs.optim.adamw(0.05, weight_decay=0.1)

    def unshard(w, spec):  # FSDP: all-gather a parameter split over dp
        for i, dim in enumerate(fs.parse_spec(spec).dims):
            if "dp" in dim.names:
                return fs.all_gather(w, "dp", dim=i, tiled=True)
        return w

    def loss_fn(p, x, y):
        p = {k: unshard(w, specs[k]) for k, w in p.items()}
        out = fs.psum(torch.tanh(x @ p["w1"]) @ p["w2"], "tp") + p["bias"]
        return fs.pmean(((out - y) ** 2).mean(), "dp")

    grad_step = fs.shard_map(
        lambda p, x, y: fs.value_and_grad(loss_fn)(p, x, y),
        mesh=mesh,
        in_specs=(specs, "(dp b) i", "(dp b) o"),
        out_specs=("", specs),
    )

    def train(params, state, n, first):
        losses = []
        for i in range(first, first + n):
            g = torch.Generator().manual_seed(100 + i)
            x = torch.randn(8, 8, generator=g)
            y = torch.randn(8, 4, generator=g)
            loss, grads = grad_step(params, x, y)
            params, state = opt.update(params, grads, state)
            losses.append(float(loss))
        return params, state, losses

    return mesh, params, opt, train


def _full(tree):
    import fshard as fs
    import optree

    return optree.tree_map(lambda x: x.full() if isinstance(x, fs.Sharded) else x, tree)


def _adam_save(path):
    from fshard import checkpoint
    import fshard as fs

    fs.init()
    _, params, opt, train = _adam_setup(2, 2)
    state = opt.init(params)
    params, state, _ = train(params, state, 3, 0)
    checkpoint.save(path, {"params": params, "opt": state}, step=3)
    full = _full({"params": params, "opt": state})
    params, state, losses = train(params, state, 3, 3)  # the uninterrupted continuation
    return full, losses


def _adam_resume(path, dp, tp):
    from fshard import checkpoint
    import fshard as fs

    fs.init()
    _, params, opt, train = _adam_setup(dp, tp)
    like = {"params": params, "opt": opt.init(params)}
    got = checkpoint.load(path, like)
    ok_layouts = all(
        g.layout == w.layout and g.local.shape == w.local.shape
        for g, w in zip(_leaves(got), _leaves(like))
        if isinstance(w, fs.Sharded)
    )
    full = _full(got)
    _, _, losses = train(got["params"], got["opt"], 3, 3)
    return full, losses, ok_layouts


def _leaves(tree):
    import optree

    return optree.tree_leaves(tree)


def _save_with_step(path, step, value):
    import fshard as fs
    from fshard import checkpoint

    fs.init()
    mesh = fs.Mesh(dp=2)
    return checkpoint.save(path, {"x": fs.shard(torch.full((4,), float(value)), mesh, "(dp n)")}, step=step)


def _load_bad(path):
    import fshard as fs
    from fshard import checkpoint

    fs.init()
    mesh = fs.Mesh(dp=2)
    like = {
        "x": fs.shard(torch.zeros(6), mesh, "(dp n)"),  # saved with shape (4,)
        "y": torch.zeros(2),  # not saved
        "z": {"w": 0},  # not saved
    }
    try:
        checkpoint.load(path, like)
    except checkpoint.CheckpointError as e:
        return str(e)
    return None


# --- tests ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt"))
    out = run_ranks(4, _save_2x2, path, 7)
    assert out == [os.path.join(path, "step_00000007")] * 4
    return path


@pytest.mark.parametrize("dp, tp", [(1, 4), (4, 1)])
def test_save_2x2_load_other_mesh_shapes(saved_2x2, dp, tp):
    for report in run_ranks(4, _load_and_compare, saved_2x2, dp, tp):
        assert report == _expected_report(7)


@pytest.mark.parametrize("dp, tp", [(2, 1), (1, 2)])
def test_save_2x2_load_at_world_2(saved_2x2, dp, tp):
    for report in run_ranks(2, _load_and_compare, saved_2x2, dp, tp, 7):
        assert report == _expected_report(7)


def test_save_2x2_load_in_one_process_without_distributed(saved_2x2):
    import torch.distributed as dist

    from fshard import checkpoint

    assert not dist.is_initialized()
    zeros = {k: torch.zeros_like(v) for k, v in _globals().items()}
    like = {"params": zeros, "meta": {"step": 0, "lr": 0.0, "name": "", "flag": False}}
    got = checkpoint.load(saved_2x2, like)  # a subset of the saved keys ("list" is not asked for)
    want = _globals()
    for k in want:
        assert torch.equal(got["params"][k], want[k]), k
    assert got["meta"] == {"step": 7, "lr": 0.25, "name": "run", "flag": True}


def test_state_dict_keys_are_dotted_key_paths(saved_2x2):
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(os.path.join(saved_2x2, "step_00000007")).read_metadata()
    assert set(md.state_dict_metadata) == {
        "params.w", "params.h", "params.b", "params.rep", "params.plain",
        "meta.step", "meta.lr", "meta.name", "meta.flag", "list.0", "list.1",
    }
    assert tuple(md.state_dict_metadata["params.h"].size) == (4, 8, 12)


@pytest.mark.parametrize("dp, tp", [(1, 4), (4, 1)])
def test_adamw_state_resharded_resume(tmp_path, dp, tp):
    path = str(tmp_path)
    (want, want_losses), *_ = run_ranks(4, _adam_save, path)
    for full, losses, ok_layouts in run_ranks(4, _adam_resume, path, dp, tp):
        assert ok_layouts
        assert full["opt"]["step"] == 3
        for group in ("params",):
            for k in want[group]:
                assert torch.equal(full[group][k], want[group][k]), k
        for moment in ("m", "v"):
            for k in want["opt"][moment]:
                assert torch.equal(full["opt"][moment][k], want["opt"][moment][k]), (moment, k)
        # the resumed run continues the uninterrupted one (up to float reduction order)
        assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6)


def test_latest_step_and_step_selection(tmp_path):
    from fshard import checkpoint

    path = str(tmp_path)
    assert checkpoint.latest_step(path) is None
    for step in (5, 20, 10):
        run_ranks(2, _save_with_step, path, step, step)
    os.makedirs(os.path.join(path, ".tmp_step_00000030"))  # an interrupted save is ignored
    os.makedirs(os.path.join(path, "step_00000040"))  # so is a directory without metadata
    assert checkpoint.latest_step(path) == 20
    assert float(checkpoint.load(path, {"x": torch.zeros(4)})["x"][0]) == 20.0
    assert float(checkpoint.load(path, {"x": torch.zeros(4)}, step=5)["x"][0]) == 5.0
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 6 .* it has steps \[5, 10, 20\]"):
        checkpoint.load(path, {"x": torch.zeros(4)}, step=6)
    with pytest.raises(FileNotFoundError, match="neither a checkpoint"):
        checkpoint.load(os.path.join(path, "empty"), {"x": torch.zeros(4)})


def test_load_reports_every_mismatch(tmp_path):
    path = str(tmp_path)
    run_ranks(2, _save_with_step, path, 1, 1.0)
    msg = run_ranks(2, _load_bad, path)[0]
    ckpt = os.path.join(path, "step_00000001")
    assert msg == (
        f"fshard.checkpoint.load: the checkpoint {ckpt!r} does not fit like (3 problems):\n"
        "  - x: saved with global shape (4,), but like has global shape (6,)\n"
        "  - y: not in the checkpoint\n"
        "  - z.w: not in the checkpoint"
    )


def test_save_rejects_unsupported_leaves_and_duplicate_keys(tmp_path):
    from fshard import checkpoint

    with pytest.raises(checkpoint.CheckpointError, match=r"bad: a object is not a Sharded value"):
        checkpoint.save(str(tmp_path), {"ok": torch.zeros(1), "bad": object()})
    with pytest.raises(checkpoint.CheckpointError, match=r"both make the key 'a.b'"):
        checkpoint.save(str(tmp_path), {"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}})
