"""Run the canonical examples in examples/ at small sizes, on real multi-rank worlds.

Each example checks itself against a single-process plain-torch reference (values,
gradients, training steps) and exits non-zero with a message if it disagrees, so a
test here only asserts that the example ran to the end and printed its success line.

Cost control: the examples run inside the persistent rank pools of conftest.py, each rank
calling the script's ``main()`` with its command-line flags in ``sys.argv`` (what running the
script does, minus the interpreter start and ``import torch`` per rank). One example also runs
exactly as a user runs it, through the launcher in fresh processes::

    python -m fshard.run -n 4 examples/NAME.py [small flags]   # from the repository root

and every example is checked to call its ``main()`` when run as a script.

A few examples also run with ``--compile`` (their step compiled by ``fs.compile``), with the same
checks against their reference: ``aot_eager`` on a representative subset and the default
``inductor`` on one small world, whose count of the compiled collectives the example checks too.
Each costs Dynamo's tracing on every rank, so the subset is kept small.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_ranks

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# (example, ranks, flags). Every example runs on 4 ranks; a few also on a smaller world.
CASES = [
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
    ("per_example_dp_sgd", 4, ["--steps", "2"]),
    ("ddp_module", 4, ["--epochs", "1"]),
    ("ddp_module", 2, ["--epochs", "1", "--closure"]),  # parameters captured by closure
    ("dp_tp", 2, ["--dp", "1", "--steps", "2"]),  # tp only, on 2 ranks
    ("data_parallel", 1, ["--steps", "2"]),  # a 1-rank world: no collectives at all
    ("hf_gpt2", 2, ["--steps", "2"]),  # transformers' GPT-2, data parallel, padded batches
    ("hf_gpt2", 4, ["--steps", "2", "--layout", "fsdp"]),  # FSDP, the vocabulary split unevenly
    # compiled (fs.compile; `--compile [BACKEND]` last): the same checks, the step one graph per rank
    ("data_parallel", 2, ["--steps", "2", "--compile", "aot_eager"]),  # the whole step, the update inside
    ("tensor_parallel_mlp", 4, ["--compile", "aot_eager"]),  # the shard_map'd MLP, forward and backward
    ("fsdp", 4, ["--steps", "2", "--compile", "aot_eager"]),  # value_and_grad of an fs.fsdp_scan loss
    ("pipeline", 4, ["--steps", "2", "--layers-per-stage", "1", "--compile", "aot_eager"]),  # fs.switch
    ("ddp_module", 2, ["--epochs", "1", "--closure", "--compile"]),  # inductor: its collectives counted
]
# Examples whose step does not compile yet: --compile exits at once with a line saying why.
NOT_COMPILED = [
    ("per_example_dp_sgd", 2, ["--compile", "aot_eager"], "torch.func transforms"),
    ("hf_gpt2", 4, ["--layout", "fsdp", "--compile"], "uneven blocks"),  # 250 rows over 4 ranks
]
# Run through `python -m fshard.run` in fresh processes, as the example's docstring says.
LAUNCHED = ("matmul_psum", 4, [])
ALL_CASES = [LAUNCHED, *CASES]


def _case_id(case) -> str:
    """``NAME-nRANKS``, and the backend of a compiled case (``--compile [BACKEND]`` comes last)."""
    name, nprocs, flags = case
    if "--compile" not in flags:
        return f"{name}-n{nprocs}"
    return f"{name}-n{nprocs}-{(flags[flags.index('--compile') + 1 :] or ['inductor'])[0]}"


# --- in the rank pools ------------------------------------------------------------------------------


def _run_example(name: str, flags: list[str]) -> str:
    """Rank function: run ``examples/NAME.py FLAGS`` in this rank; return what it printed.

    The script is loaded as a fresh module and its ``main()`` called with ``sys.argv`` set as the
    command line would set it. ``fs.init()`` finds the pool's process group and keeps it. A
    non-zero ``sys.exit`` (an example's way of reporting a mismatch) is raised as an error, so that
    the pool reports it at once with the script's output instead of the other ranks waiting for
    this one in a collective. The global RNG is restored afterwards (an example may seed it). With
    ``--compile``, Dynamo's caches are reset before and after, as in a process of its own: the
    compiled functions of earlier jobs neither count against its recompile limit nor make its
    shapes dynamic, and its graphs do not outlive it.
    """
    import torch

    path = EXAMPLES / f"{name}.py"
    module_name = f"_fshard_example_{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    out, err = io.StringIO(), io.StringIO()
    saved_argv = sys.argv
    sys.modules[module_name] = module  # as for a script's __main__: pickling, dataclasses
    code: object = 0
    compiled = "--compile" in flags
    if compiled:
        torch._dynamo.reset()
    try:
        spec.loader.exec_module(module)
        sys.argv = [str(path), *flags]
        with (
            torch.random.fork_rng(devices=[]),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            module.main()
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = saved_argv
        sys.modules.pop(module_name, None)
        if compiled:
            torch._dynamo.reset()
    if code not in (None, 0):
        raise RuntimeError(
            f"examples/{name}.py {' '.join(flags)} exited with {code!r}\n"
            f"--- stdout ---\n{out.getvalue()}--- stderr ---\n{err.getvalue()}"
        )
    return out.getvalue()


@pytest.mark.parametrize(("name", "nprocs", "flags"), CASES, ids=[_case_id(c) for c in CASES])
def test_example_matches_its_reference(name, nprocs, flags):
    outputs = run_ranks(nprocs, _run_example, name, flags)
    assert f"{name}: OK" in outputs[0], f"examples/{name}.py printed no success line on rank 0:\n{outputs[0]}"


def _exit_message(name: str, flags: list[str]) -> str | None:
    """Rank function: what ``examples/NAME.py FLAGS`` exits with (None if it runs to the end). The
    rank answers instead of failing, so that the pool goes on without a restart."""
    try:
        _run_example(name, flags)
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(("name", "nprocs", "flags", "why"), NOT_COMPILED, ids=[c[0] for c in NOT_COMPILED])
def test_example_that_does_not_compile_yet_says_so_at_once(name, nprocs, flags, why):
    for message in run_ranks(nprocs, _exit_message, name, flags):
        assert message is not None and f"{name}: --compile" in message and why in message, message


# --- as a user runs them ----------------------------------------------------------------------------


def test_example_run_by_the_launcher_matches_its_reference():
    name, nprocs, flags = LAUNCHED
    env = dict(os.environ)
    # The ranks run examples/NAME.py, whose own directory is first on sys.path: make the
    # repository's fshard importable there even when it is not installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "fshard.run", "-n", str(nprocs), f"examples/{name}.py", *flags]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    output = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, (
        f"examples/{name}.py on {nprocs} ranks exited with {proc.returncode}\n{output}"
    )
    assert f"{name}: OK" in proc.stdout, f"examples/{name}.py printed no success line\n{output}"


def _calls_main_as_script(tree: ast.Module) -> bool:
    """Whether the module ends with ``if __name__ == "__main__": main()``."""
    last = tree.body[-1] if tree.body else None
    return (
        isinstance(last, ast.If)
        and ast.unparse(last.test).replace("'", '"') == '__name__ == "__main__"'
        and len(last.body) == 1
        and ast.unparse(last.body[0]) == "main()"
    )


def test_examples_state_their_commands_and_run_main_as_scripts():
    for name in sorted({c[0] for c in ALL_CASES}):
        tree = ast.parse((EXAMPLES / f"{name}.py").read_text())
        doc = ast.get_docstring(tree) or ""
        for command in (
            f"python -m fshard.run -n 4 examples/{name}.py",
            f"torchrun --nproc-per-node 4 examples/{name}.py",
        ):
            assert command in doc, f"examples/{name}.py: its docstring must state the command {command!r}"
        # The pool tests call main(): running the script must do the same and nothing more.
        assert _calls_main_as_script(tree), (
            f'examples/{name}.py must end with `if __name__ == "__main__": main()`'
        )
