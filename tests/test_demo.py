"""The flagship demo (the package ``fshard_demo`` in examples/fshard_demo/, examples/train_gpt.py).

End to end, on a tiny configuration: every run goes through a launcher as a user would run it:
``python examples/train_gpt.py`` and ``python -m fshard_demo`` (what the ``fshard-demo`` console
script runs) relaunch themselves on 4 local ranks; ``python -m fshard.run -n 4`` launches
explicitly. And the model's API, which benchmarks import: ``fshard_demo.model``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_ranks

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"  # holds the package fshard_demo (installed by `pip install -e .`)
if importlib.util.find_spec("fshard_demo") is None:  # a source checkout that is not installed
    sys.path.append(str(EXAMPLES))
TINY = [
    "--d-model",
    "32",
    "--n-heads",
    "4",
    "--n-layers",
    "1",
    "--d-mlp",
    "64",
    "--digits",
    "2",
    "--batch",
    "16",
    "--eval-size",
    "16",
    "--steps",
    "12",
    "--warmup",
    "3",
    "--ckpt-every",
    "6",
    "--eval-every",
    "0",
    "--ref-every",
    "4",
    "--lr",
    "3e-3",
]
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _run(cmd: list[str], timeout: float = 240) -> str:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), str(EXAMPLES), env.get("PYTHONPATH")) if x)
    proc = subprocess.run(
        [sys.executable, *cmd],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-4000:]}"
    return out


def _losses(out_dir) -> dict[int, float]:
    with open(os.path.join(out_dir, "metrics.json")) as fh:
        return {s: v for s, v in json.load(fh)["losses"]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The default layout (dp=2 x tp=2) with --check-reference, started as a plain process."""
    out_dir = tmp_path_factory.mktemp("dp_tp")
    text = _run(
        ["examples/train_gpt.py", *TINY, "--out", str(out_dir), "--check-reference", "--profile", "3"]
    )
    return out_dir, text


@pytest.mark.timeout(300)
def test_default_layout_matches_the_one_process_reference(uninterrupted):
    out_dir, text = uninterrupted
    assert "4 ranks, Mesh(dp=2, tp=2), layout dp_tp" in text
    assert "--check-reference: 12 steps" in text and "PASS" in text and "FAIL" not in text
    assert "== summary ==" in text and "held-out exact match" in text
    # The Megatron step: one psum over tp after attention and one after the MLP, in the forward
    # and (their transposes' partners, the "f" operator) in the backward.
    assert "all_reduce[tp]" in text and "all_reduce[dp]" in text
    # --profile 3: the time in collectives per step, by kind and axes (from the profiler labels)
    line = next(x for x in text.splitlines() if "time in collectives per step" in x)
    assert "(rank 0, 3 profiled steps)" in line and "all_reduce[tp]" in line and "all_reduce[dp]" in line
    assert (out_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(out_dir / "ckpt")) == ["step_00000006", "step_00000012"]
    with open(out_dir / "metrics.json") as fh:
        metrics = json.load(fh)
    assert len(metrics["reference_losses"]) == 12
    assert not (out_dir / "reference" / "anchors").exists()  # removed after the check


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_fsdp_layouts_follow_the_same_loss_curve(uninterrupted, tmp_path, layout):
    ref_dir, _ = uninterrupted
    text = _run(
        [
            "-m",
            "fshard.run",
            "-n",
            "4",
            "examples/train_gpt.py",
            *TINY,
            "--layout",
            layout,
            "--out",
            str(tmp_path),
        ]
    )
    mesh = "Mesh(dp=4, tp=1)" if layout == "fsdp" else "Mesh(dp=2, tp=2)"
    assert f"4 ranks, {mesh}, layout {layout}" in text
    # FSDP: every parameter is all-gathered over dp; the transpose is a reduce-scatter of its gradient
    assert "all_gather[dp]" in text and "reduce_scatter[dp]" in text
    ours, ref = _losses(tmp_path), _losses(ref_dir)
    assert sorted(ours) == list(range(12))
    for step in ours:  # same init (fs.random) and data, so the same curve up to float rounding
        assert ours[step] == pytest.approx(ref[step], abs=1e-4), step


@pytest.mark.timeout(300)
def test_the_compiled_step_follows_the_same_loss_curve(uninterrupted, tmp_path):
    """--compile: the training step (value_and_grad in shard_map, clipping, AdamW) as one graph per
    rank; aot_eager here (inductor's kernels would cost the suite a minute), the same curve."""
    ref_dir, _ = uninterrupted
    text = _run(["-m", "fshard_demo", *TINY, "--compile", "aot_eager", "--out", str(tmp_path)])
    assert "4 ranks, Mesh(dp=2, tp=2), layout dp_tp" in text
    ours, ref = _losses(tmp_path), _losses(ref_dir)
    assert sorted(ours) == list(range(12))
    for step in ours:
        assert ours[step] == pytest.approx(ref[step], abs=1e-4), step


@pytest.mark.timeout(300)
def test_resume_at_another_mesh_shape_continues_the_loss_curve(uninterrupted, tmp_path):
    ref_dir, _ = uninterrupted
    first = _run(["-m", "fshard_demo", *TINY, "--out", str(tmp_path), "--stop-after", "6"])
    assert "steps 0..6 of 12" in first
    second = _run(["-m", "fshard_demo", *TINY, "--out", str(tmp_path), "--resume", "--dp", "1", "--tp", "4"])
    assert "(step 6) on Mesh(dp=1, tp=4)" in second
    assert "steps 6..12 of 12" in second
    ours, ref = _losses(tmp_path), _losses(ref_dir)
    assert sorted(ours) == list(range(12))  # metrics.json keeps the first run's steps
    for step in range(6, 12):
        assert ours[step] == pytest.approx(ref[step], abs=1e-4), step
    with open(tmp_path / "metrics.json") as fh:
        assert json.load(fh)["resumes"] == [{"step": 6, "mesh": "dp=1,tp=4", "layout": "dp_tp"}]


def test_the_demo_is_not_part_of_the_library():
    import fshard as fs
    import fshard_demo

    assert importlib.util.find_spec("fshard.demo") is None
    assert not hasattr(fs, "demo")
    assert callable(fshard_demo.init_params) and not hasattr(fshard_demo, "init")  # not fs.init


def _model_api(layouts):
    """On 4 ranks: the doctests of fshard_demo.model and .data, and one loss and gradient per layout."""
    import doctest

    import fshard as fs
    from fshard_demo import data, model
    from fshard_demo.data import Task
    from fshard_demo.model import Config, fsdp_dims, init_params, loss_fn

    results = [doctest.testmod(m) for m in (model, data)]
    cfg = Config(digits=2, d_model=32, n_heads=4, n_layers=2, d_mlp=64)
    tokens = Task(cfg.digits).batch(0, 8)
    out = {}
    for layout in layouts:
        mesh = fs.Mesh(dp=4, tp=1) if layout in ("dp", "fsdp") else fs.Mesh(dp=2, tp=2)
        params, specs = init_params(0, cfg, mesh, layout)
        dims = fsdp_dims(specs)
        step = fs.shard_map(
            lambda p, t: fs.value_and_grad(loss_fn)(p, t, cfg, dims),  # noqa: B023 (called at once)
            mesh=mesh,
            in_specs=(specs, "(dp b) t"),
            out_specs=("", specs),
        )
        with fs.count_collectives() as counts:
            loss, grads = step(params, tokens)
        wq = grads["blocks"][0]["wq"]  # Sharded where its spec splits it, else a plain tensor
        wq = wq.full() if isinstance(wq, fs.Sharded) else wq
        dp = counts.by_kind()
        out[layout] = (
            float(loss),
            specs["blocks"][0]["wq"],
            float(wq.norm()),
            (dp[("all_gather", ("dp",))], dp[("reduce_scatter", ("dp",))]),
        )
    return [(r.failed, r.attempted) for r in results], out


def test_model_api_gives_the_same_loss_and_gradients_in_every_layout():
    layouts = ["dp_tp", "fsdp_tp", "dp", "fsdp"]
    doctests, out = run_ranks(4, _model_api, layouts)[0]
    for (failed, attempted), name in zip(doctests, ("model", "data")):
        assert attempted and not failed, f"fshard_demo.{name}: {failed} of {attempted} doctests failed"
    assert out["fsdp_tp"][1] == "(dp d) (tp e)" and out["dp"][1] == "d e"
    loss, _, norm, _ = out["dp_tp"]
    # FSDP: the embeddings and the head in one all-gather (each along its split dim), kept for
    # the backward; each block (n_layers=2) gathered in the forward and again in the backward;
    # one reduce-scatter of the gradients per gather of the forward
    for layout in ("fsdp", "fsdp_tp"):
        assert out[layout][3] == (1 + 2 * 2, 1 + 2), (layout, out[layout][3])
    for layout in ("dp", "dp_tp"):
        assert out[layout][3] == (0, 0), (layout, out[layout][3])
    for layout in layouts:
        assert out[layout][0] == pytest.approx(loss, abs=1e-5), layout
        assert out[layout][2] == pytest.approx(norm, rel=1e-4), layout
