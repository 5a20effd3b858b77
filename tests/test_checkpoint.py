"""fshard.checkpoint: save at one mesh shape, load at another (and at other world sizes)."""

from __future__ import annotations

import os
import pickle
import shlex
import shutil
from pathlib import Path

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
    for k, _spec in _LOAD_SPECS[(dp, tp)].items():
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
    import optree

    import fshard as fs

    return optree.tree_map(lambda x: x.full() if isinstance(x, fs.Sharded) else x, tree)


def _adam_save(path):
    import fshard as fs
    from fshard import checkpoint

    fs.init()
    _, params, opt, train = _adam_setup(2, 2)
    state = opt.init(params)
    params, state, _ = train(params, state, 3, 0)
    checkpoint.save(path, {"params": params, "opt": state}, step=3)
    full = _full({"params": params, "opt": state})
    params, state, losses = train(params, state, 3, 3)  # the uninterrupted continuation
    return full, losses


def _adam_resume(path, dp, tp):
    import fshard as fs
    from fshard import checkpoint

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
        "params.w",
        "params.h",
        "params.b",
        "params.rep",
        "params.plain",
        "meta.step",
        "meta.lr",
        "meta.name",
        "meta.flag",
        "list.0",
        "list.1",
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


# --- soundness: atomic saves, step validation, damaged and crafted files ------------------------

_FIX = (
    "The file is damaged, or was not written by fshard.checkpoint.save: load another step "
    "(fshard.checkpoint.steps lists them) or save again"
)


def _unreadable(file, ckpt, reason):
    return f"fshard.checkpoint.load: cannot read {file!r} of the checkpoint {ckpt!r}: {reason}. {_FIX}"


def _damaged(ckpt, problems):
    n = len(problems)
    return (
        f"fshard.checkpoint.load: the checkpoint {ckpt!r} is damaged: files differ from its "
        f"fshard-manifest.json; load another step (fshard.checkpoint.steps lists them) or save again "
        f"({n} problem{'s' if n != 1 else ''}):\n" + "\n".join(f"  - {p}" for p in problems)
    )


def _x_tree(value, n=4):
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    return {"x": fs.shard(torch.full((n,), float(value)), mesh, "(dp n)"), "meta": {"value": int(value)}}


def _x_value(tree):
    x = tree["x"]
    full = x.full() if hasattr(x, "full") else x
    assert torch.all(full == full[0]), full  # one save's values, not a mix of two
    assert tree["meta"]["value"] == float(full[0])
    return float(full[0])


def _interrupted_plain_save(path):
    """A save without step= that fails on rank 1 after writing a block leaves the previous one whole."""
    import torch.distributed as dist
    import torch.distributed.checkpoint.filesystem as dcp_fs

    import fshard as fs
    from fshard import checkpoint

    fs.init()
    checkpoint.save(path, _x_tree(1))
    real = dcp_fs._write_item

    def write_then_fail(*args, **kwargs):
        real(*args, **kwargs)  # the block is written, then the disk fills up
        raise OSError("No space left on device (simulated)")

    if dist.get_rank() == 1:
        dcp_fs._write_item = write_then_fail
    try:
        checkpoint.save(path, _x_tree(2))
        msg = None
    except checkpoint.CheckpointError as e:
        msg = str(e)
    finally:
        dcp_fs._write_item = real
    parent = os.path.dirname(path)
    after_failure = (sorted(os.listdir(parent)), _x_value(checkpoint.load(path, _x_tree(0))))
    checkpoint.save(path, _x_tree(3))
    dist.barrier()
    after_retry = (sorted(os.listdir(parent)), _x_value(checkpoint.load(path, _x_tree(0))))
    return msg, after_failure, after_retry


def test_interrupted_save_without_step_keeps_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    tmp = str(tmp_path / ".tmp_ckpt")
    for msg, after_failure, after_retry in run_ranks(2, _interrupted_plain_save, path):
        assert msg == (
            f"fshard.checkpoint.save: torch.distributed.checkpoint failed to write {tmp!r} "
            f"(rank 1: OSError: No space left on device (simulated)); {path!r} was left as it was"
        )
        assert after_failure == ([".tmp_ckpt", "ckpt"], 1.0)  # the partial write is never read
        assert after_retry == (["ckpt"], 3.0)  # the next save clears the leftover


def _resave_interrupted_between_renames(path):
    """Re-saving step 5 stops after the old checkpoint was renamed aside, before the new one is in."""
    import torch.distributed as dist

    import fshard as fs
    from fshard import checkpoint

    fs.init()
    checkpoint.save(path, _x_tree(1), step=5)
    real = os.replace

    def crash(src, dst):
        if os.path.basename(src) == ".tmp_step_00000005":
            raise OSError("simulated crash")
        return real(src, dst)

    os.replace = crash  # rank 0 does the renames
    try:
        checkpoint.save(path, _x_tree(2), step=5)
        msg = None
    except checkpoint.CheckpointError as e:
        msg = str(e)
    finally:
        os.replace = real
    state = (
        sorted(os.listdir(path)),
        checkpoint.steps(path),
        checkpoint.latest_step(path),
        _x_value(checkpoint.load(path, _x_tree(0))),
        _x_value(checkpoint.load(path, _x_tree(0), step=5)),
    )
    checkpoint.save(path, _x_tree(3), step=5)
    dist.barrier()
    after = (sorted(os.listdir(path)), _x_value(checkpoint.load(path, _x_tree(0))))
    return msg, state, after


def test_resaving_a_step_never_leaves_it_missing(tmp_path):
    path = str(tmp_path)
    final = os.path.join(path, "step_00000005")
    for msg, state, after in run_ranks(2, _resave_interrupted_between_renames, path):
        assert msg == (
            f"fshard.checkpoint.save: cannot move the new checkpoint into {final!r} "
            f"(OSError: simulated crash); the previous one still loads, and saving again cleans up"
        )
        # step_5 is gone, but the previous checkpoint set aside is found and loaded
        assert state == ([".old_step_00000005", ".tmp_step_00000005"], [5], 5, 1.0, 1.0)
        assert after == (["step_00000005"], 3.0)


def _save_x(path, value, step=None):
    import fshard as fs
    from fshard import checkpoint

    fs.init()
    return checkpoint.save(path, _x_tree(value), step=step)


def test_leftovers_of_interrupted_saves(tmp_path):
    from fshard import checkpoint

    path = str(tmp_path)
    for step in (5, 6):
        run_ranks(2, _save_x, path, step, step)
    like = {"x": torch.zeros(4), "meta": {"value": 0}}
    # a complete step_5 wins over a leftover .old_step_5 (a save stopped while deleting it)
    os.rename(os.path.join(path, "step_00000006"), os.path.join(path, ".old_step_00000005"))
    # .old_step_7 alone: a save stopped between its renames; .tmp_* is never read
    shutil.copytree(os.path.join(path, "step_00000005"), os.path.join(path, ".old_step_00000007"))
    shutil.copytree(os.path.join(path, "step_00000005"), os.path.join(path, ".tmp_step_00000008"))
    assert checkpoint.steps(path) == [5, 7]
    assert checkpoint.latest_step(path) == 7
    assert _x_value(checkpoint.load(path, like, step=5)) == 5.0
    assert _x_value(checkpoint.load(path, like)) == 5.0  # step 7 is the old copy of step 5's files
    run_ranks(2, _save_x, path, 7, 7)
    run_ranks(2, _save_x, path, 8, 8)
    assert sorted(os.listdir(path)) == [
        ".old_step_00000005",
        "step_00000005",
        "step_00000007",
        "step_00000008",
    ]
    run_ranks(2, _save_x, path, 9, 5)
    assert sorted(os.listdir(path)) == ["step_00000005", "step_00000007", "step_00000008"]
    assert _x_value(checkpoint.load(path, like, step=5)) == 9.0


def _saves_twice_recording_warnings(path):
    import warnings

    import fshard as fs
    from fshard import checkpoint

    fs.init()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for value in (1, 2):
            checkpoint.save(path, _x_tree(value), step=1)
            checkpoint.save(os.path.join(path, "plain"), _x_tree(value))
    return [f"{w.category.__name__}: {w.message}" for w in seen]


def test_saving_over_a_checkpoint_warns_nothing(tmp_path):
    # DCP warns when it overwrites a checkpoint in place; fshard never does, and filters nothing
    from fshard import checkpoint

    assert run_ranks(2, _saves_twice_recording_warnings, str(tmp_path)) == [[], []]
    assert sorted(os.listdir(tmp_path)) == ["plain", "step_00000001"]
    assert not hasattr(checkpoint, "warnings")


@pytest.mark.parametrize("bad, shown", [(-1, "-1 (int)"), (2.7, "2.7 (float)"), (True, "True (bool)")])
def test_step_must_be_a_non_negative_int(tmp_path, bad, shown):
    from fshard import checkpoint

    calls = {
        "save": lambda: checkpoint.save(str(tmp_path), {"x": torch.zeros(1)}, step=bad),
        "load": lambda: checkpoint.load(str(tmp_path), {"x": torch.zeros(1)}, step=bad),
    }
    for where, call in calls.items():
        with pytest.raises(checkpoint.CheckpointError) as err:
            call()
        assert str(err.value) == (
            f"fshard.checkpoint.{where}: step must be a non-negative int, got {shown}; pass the training "
            f"step as a whole number, such as step=100"
        )
        assert isinstance(err.value, ValueError)
    assert os.listdir(tmp_path) == []  # nothing was written


def test_save_without_step_replaces_only_a_checkpoint_or_an_empty_directory(tmp_path, monkeypatch):
    from fshard import checkpoint

    tree = {"x": torch.zeros(1)}
    os.makedirs(tmp_path / "runs" / "step_00000001")
    (tmp_path / "runs" / "notes.txt").write_text("keep me")
    (tmp_path / "file").write_text("")
    cases = {
        str(tmp_path / "runs"): (
            f"fshard.checkpoint.save: {str(tmp_path / 'runs')!r} is neither empty nor a checkpoint (it "
            f"holds step_00000001), and save without step= replaces the whole directory; pass a new or "
            f"empty directory, or step= to keep checkpoints side by side in it as step_*"
        ),
        str(tmp_path / "file"): (
            f"fshard.checkpoint.save: {str(tmp_path / 'file')!r} is a file; pass a directory path (a new "
            f"or empty directory, or an earlier checkpoint)"
        ),
    }
    for path, msg in cases.items():
        with pytest.raises(checkpoint.CheckpointError) as err:
            checkpoint.save(path, tree)
        assert str(err.value) == msg
    monkeypatch.chdir(tmp_path / "runs")
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.save(".", tree)
    assert str(err.value) == (
        "fshard.checkpoint.save: '.' holds the current directory, and save replaces the whole "
        "directory; pass a subdirectory, such as 'ckpt'"
    )
    assert (tmp_path / "runs" / "notes.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["file", "runs"]
    os.makedirs(tmp_path / "empty")
    assert checkpoint.save(str(tmp_path / "empty"), tree) == str(tmp_path / "empty")  # empty: fine


# Damaged and crafted files. One checkpoint saved at dp=2 is copied for each test.


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pristine"))
    run_ranks(2, _save_x, path, 3, 3)
    return os.path.join(path, "step_00000003")


@pytest.fixture
def ckpt(pristine, tmp_path):
    path = str(tmp_path / "step_00000003")
    shutil.copytree(pristine, path)
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "fshard-manifest.json"]
    return path


def _like():
    return {"x": torch.zeros(4), "meta": {"value": 0}}


def _flip_byte(file, at=None):
    data = bytearray(Path(file).read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x01
    Path(file).write_bytes(bytes(data))


def _rehash(ckpt, name):
    """Update the manifest entry of ``name``, as whoever crafts a checkpoint can."""
    import hashlib
    import json

    file = Path(ckpt, "fshard-manifest.json")
    manifest = json.loads(file.read_text())
    data = Path(ckpt, name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    file.write_text(json.dumps(manifest))


def _load_error(path):
    """Load at dp=2; the type and message of the error each rank raises."""
    import fshard as fs
    from fshard import checkpoint

    fs.init()
    try:
        checkpoint.load(path, _x_tree(0))
    except Exception as e:  # a CheckpointException of DCP would escape this
        return type(e).__name__, str(e)
    return None


def test_flipped_byte_and_missing_file_are_caught_on_every_rank(ckpt):
    from fshard import checkpoint

    _flip_byte(os.path.join(ckpt, "__0_0.distcp"))
    os.remove(os.path.join(ckpt, "__1_0.distcp"))
    msg = _damaged(
        ckpt,
        [
            "__0_0.distcp: its sha256 differs from the one recorded when it was written",
            "__1_0.distcp: missing",
        ],
    )
    # rank 0 checks one file and rank 1 the other; both report both
    assert run_ranks(2, _load_error, ckpt) == [("CheckpointError", msg)] * 2
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(ckpt, _like())
    assert str(err.value) == msg


def test_damaged_metadata_is_caught_by_its_checksum(ckpt):
    from fshard import checkpoint

    file = os.path.join(ckpt, ".metadata")
    size = os.path.getsize(file)
    _flip_byte(file)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(ckpt, _like())
    assert str(err.value) == _damaged(
        ckpt, [".metadata: its sha256 differs from the one recorded when it was written"]
    )
    Path(file).write_bytes(b"\x80\x04")
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(ckpt, _like())
    assert str(err.value) == _damaged(ckpt, [f".metadata: 2 bytes, but {size} were written"])


def test_unreadable_metadata_without_manifest_names_the_file(ckpt):
    from fshard import checkpoint

    os.remove(os.path.join(ckpt, "fshard-manifest.json"))  # as written by plain DCP: unverified
    file = os.path.join(ckpt, ".metadata")
    for content, reason in [
        (b"", "it ends early (truncated)"),
        (b"\x80\x04", "it ends early (truncated)"),
        (b"not a pickle", "UnpicklingError: invalid load key, 'n'."),
        (pickle.dumps({"a": 1}), "it holds a dict, not torch.distributed.checkpoint metadata"),
    ]:
        Path(file).write_bytes(content)
        with pytest.raises(checkpoint.CheckpointError) as err:
            checkpoint.load(ckpt, _like())
        assert str(err.value) == _unreadable(file, ckpt, reason)


def test_unreadable_data_file_raises_checkpoint_error_on_every_rank(ckpt):
    # without the manifest, torch.load fails inside DCP, which raises a CheckpointException
    # (a BaseException); fshard turns it into a CheckpointError naming the file
    from fshard import checkpoint

    os.remove(os.path.join(ckpt, "fshard-manifest.json"))
    file = os.path.join(ckpt, "__1_0.distcp")
    with open(file, "r+b") as f:
        f.truncate(40)
    head = f"fshard.checkpoint.load: cannot read {file!r} of the checkpoint {ckpt!r}: "
    errors = run_ranks(2, _load_error, ckpt)
    assert errors[0] == errors[1]
    kind, msg = errors[0]
    assert kind == "CheckpointError"
    assert msg.startswith(head) and msg.endswith(f". {_FIX}"), msg
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(ckpt, _like())
    assert str(err.value).startswith(head) and str(err.value).endswith(f". {_FIX}")


class _RunsCode:
    """Unpickling it runs a shell command: what a crafted checkpoint file would do."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_crafted_metadata_is_refused_without_running_code(ckpt, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from fshard import checkpoint

    marker = tmp_path / "pwned"
    file = os.path.join(ckpt, ".metadata")
    Path(file).write_bytes(pickle.dumps(_RunsCode(f"touch {shlex.quote(str(marker))}")))
    _rehash(ckpt, ".metadata")  # the checksum passes: the manifest is no defense here
    msg = _unreadable(
        file,
        ckpt,
        f"it refers to {os.system.__module__}.system, which checkpoint metadata never holds "
        f"(refused: loading never runs code from a checkpoint)",
    )
    assert run_ranks(2, _load_error, ckpt) == [("CheckpointError", msg)] * 2
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(ckpt, _like())
    assert str(err.value) == msg
    assert not marker.exists()
    with pytest.raises(AttributeError):  # DCP's own reader unpickles it: the command runs
        FileSystemReader(ckpt).read_metadata()
    assert marker.exists()


def test_crafted_scalar_is_refused_without_running_code(tmp_path):
    import torch.distributed.checkpoint as dcp

    from fshard import checkpoint

    marker = tmp_path / "pwned"
    ckpt = str(tmp_path / "crafted")
    evil = _RunsCode(f"touch {shlex.quote(str(marker))}")
    dcp.save({"x": torch.zeros(4), "meta.value": evil}, checkpoint_id=ckpt, no_dist=True)
    like = _like()
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(ckpt, like)
    assert str(err.value) == _unreadable(
        os.path.join(ckpt, "__0_0.distcp"),
        ckpt,
        "the saved value of 'meta.value' is not a Python scalar (refused: loading never runs code "
        "from a checkpoint)",
    )
    assert not marker.exists()
    dcp.load({"x": torch.zeros(4), "meta.value": 0}, checkpoint_id=ckpt, no_dist=True)  # DCP's own load
    assert marker.exists()
