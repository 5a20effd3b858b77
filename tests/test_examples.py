"""Run the canonical examples in examples/ as a user would, through the launcher, at small sizes.

Each example checks itself against a single-process plain-torch reference (values,
gradients, training steps) and exits non-zero with a message if it disagrees, so a
test here only asserts the exit code and the example's success line::

    python -m fshard.run -n 4 examples/NAME.py [small flags]   # from the repository root
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# (example, ranks, flags). Every example runs on 4 ranks; a few also on a smaller world.
CASES = [
    ("matmul_psum", 4, []),
    ("matmul_reduce_scatter", 4, []),
    ("data_parallel", 4, ["--steps", "2"]),
    ("fsdp", 4, ["--steps", "2"]),
    ("tensor_parallel_mlp", 4, []),
    ("tensor_parallel_block", 4, []),
    ("dp_tp", 4, ["--steps", "2"]),
    ("fsdp_tp", 4, ["--steps", "2"]),
    ("sequence_parallel", 4, []),
    ("collective_matmul", 4, []),
    ("pipeline", 4, ["--steps", "2", "--layers-per-stage", "1"]),
    ("moe", 4, ["--steps", "2"]),
    ("ddp_module", 4, ["--epochs", "1"]),
    ("ddp_module", 2, ["--epochs", "1", "--closure"]),  # parameters captured by closure
    ("dp_tp", 2, ["--dp", "1", "--steps", "2"]),  # tp only, on 2 ranks
    ("data_parallel", 1, ["--steps", "2"]),  # a 1-rank world: no collectives at all
]


def _run(name: str, nprocs: int, flags: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # The ranks run examples/NAME.py, whose own directory is first on sys.path: make the
    # repository's fshard importable there even when it is not installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "fshard.run", "-n", str(nprocs), f"examples/{name}.py", *flags]
    return subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)


@pytest.mark.parametrize(("name", "nprocs", "flags"), CASES, ids=[f"{c[0]}-n{c[1]}" for c in CASES])
def test_example_matches_its_reference(name, nprocs, flags):
    proc = _run(name, nprocs, flags)
    output = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, (
        f"examples/{name}.py on {nprocs} ranks exited with {proc.returncode}\n{output}"
    )
    assert f"{name}: OK" in proc.stdout, f"examples/{name}.py printed no success line\n{output}"


def test_examples_state_their_commands():
    for name in sorted({c[0] for c in CASES}):
        doc = ast.get_docstring(ast.parse((EXAMPLES / f"{name}.py").read_text())) or ""
        for command in (
            f"python -m fshard.run -n 4 examples/{name}.py",
            f"torchrun --nproc-per-node 4 examples/{name}.py",
        ):
            assert command in doc, f"examples/{name}.py: its docstring must state the command {command!r}"
