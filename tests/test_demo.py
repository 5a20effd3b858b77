"""The flagship demo (fshard/demo.py, examples/train_gpt.py) end to end, on a tiny configuration.

Every run goes through a launcher as a user would run it: ``python examples/train_gpt.py`` and
``python -m fshard.demo`` relaunch themselves on 4 local ranks; ``python -m fshard.run -n 4``
launches explicitly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "--d-model", "32", "--n-heads", "4", "--n-layers", "1", "--d-mlp", "64", "--digits", "2",
    "--batch", "16", "--eval-size", "16", "--steps", "12", "--warmup", "3", "--ckpt-every", "6",
    "--eval-every", "0", "--ref-every", "4", "--lr", "3e-3",
]
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _run(cmd: list[str], timeout: float = 240) -> str:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH")) if x)
    proc = subprocess.run(
        [sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
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
    text = _run(["examples/train_gpt.py", *TINY, "--out", str(out_dir), "--check-reference"])
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
    text = _run(["-m", "fshard.run", "-n", "4", "examples/train_gpt.py", *TINY, "--layout", layout,
                 "--out", str(tmp_path)])
    mesh = "Mesh(dp=4, tp=1)" if layout == "fsdp" else "Mesh(dp=2, tp=2)"
    assert f"4 ranks, {mesh}, layout {layout}" in text
    # FSDP: every parameter is all-gathered over dp; the transpose is a reduce-scatter of its gradient
    assert "all_gather[dp]" in text and "reduce_scatter[dp]" in text
    ours, ref = _losses(tmp_path), _losses(ref_dir)
    assert sorted(ours) == list(range(12))
    for step in ours:  # same init (fs.random) and data, so the same curve up to float rounding
        assert ours[step] == pytest.approx(ref[step], abs=1e-4), step


@pytest.mark.timeout(300)
def test_resume_at_another_mesh_shape_continues_the_loss_curve(uninterrupted, tmp_path):
    ref_dir, _ = uninterrupted
    first = _run(["-m", "fshard.demo", *TINY, "--out", str(tmp_path), "--stop-after", "6"])
    assert "steps 0..6 of 12" in first
    second = _run(["-m", "fshard.demo", *TINY, "--out", str(tmp_path), "--resume", "--dp", "1", "--tp", "4"])
    assert "(step 6) on Mesh(dp=1, tp=4)" in second
    assert "steps 6..12 of 12" in second
    ours, ref = _losses(tmp_path), _losses(ref_dir)
    assert sorted(ours) == list(range(12))  # metrics.json keeps the first run's steps
    for step in range(6, 12):
        assert ours[step] == pytest.approx(ref[step], abs=1e-4), step
    with open(tmp_path / "metrics.json") as fh:
        assert json.load(fh)["resumes"] == [{"step": 6, "mesh": "dp=1,tp=4", "layout": "dp_tp"}]
