"""Restarts after a failure, and clean exits: counted over many real multi-process runs.

Two measurements (run from the repository root)::

    python -m benchmarks.restarts kills --runs 20     # kill-and-restart, under both launchers
    python -m benchmarks.restarts exits --runs 50     # 4-rank runs that must exit with code 0

``kills``: the 2-rank FSDP training loop of ``tests/restart_program.py`` (20 steps, a checkpoint
every 5, resuming from ``fshard.checkpoint.latest_step``) with rank 1 SIGKILLed before step 17
on the first attempt, started ``--runs`` times under ``python -m fshard.run --max-restarts 1``
and ``--runs`` times under ``torchrun --max-restarts 1 --rdzv-backend c10d``. A run counts as a
success when the launcher exits with 0, the second attempt resumed from step 15, and the final
parameters are bit-identical to an uninterrupted run's.

``exits``: ``--runs`` 4-rank runs (``python -m fshard.run -n 4``) of a short script that does
what the demo does before it exits (a 2x2 mesh, a training step with dp and tp collectives, an
asynchronous all-gather, a checkpoint save and load, then, as the demo, ``destroy_process_group``
by the script and rank 0 printing last), each checked for exit code 0 on every rank.
``--keep-groups``: the same runs without fshard releasing its meshes' process groups at exit (the
teardown before that fix), for comparison.

Each run is bounded in time and its whole process group is killed if it overruns. The counts go
into the "Restarts and clean exits" section of ``benchmarks/RESULTS.md`` (``--write``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
BEGIN, END = "<!-- restarts: begin -->", "<!-- restarts: end -->"


def launcher(kind: str, nprocs: int, max_restarts: int) -> list[str]:
    """The command prefix that starts ``nprocs`` local ranks under ``kind`` ("fshard" or "torchrun")."""
    if kind == "fshard":
        return [sys.executable, "-m", "fshard.run", "-n", str(nprocs), "--max-restarts", str(max_restarts)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nprocs),
        "--max-restarts",
        str(max_restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        "--monitor-interval",
        "0.1",
    ]


def run_bounded(cmd: list[str], timeout: float) -> tuple[int | None, str, float, bool]:
    """Run ``cmd`` in a session of its own: ``(exit code or None on timeout, output, seconds,
    whether a process of the session was still alive at the end)``. Everything left is killed."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH")) if x)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = None
    except BaseException:  # a test's own timeout, Ctrl-C: leave no launcher behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    seconds = time.monotonic() - t0
    left = _session_alive(proc.pid)
    if left:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code, out.decode(errors="replace"), seconds, left


def _session_alive(sid: int) -> bool:
    """Whether any process still runs in session ``sid`` (zombies excepted)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            return True
    return False


# --------------------------------------------------------------------------------------------------
# kills


def kills(runs: int, timeout: float) -> dict:
    import torch

    from tests.restart_program import reference

    counts: dict = {}
    with tempfile.TemporaryDirectory(prefix="fshard-restarts-") as tmp:
        base = Path(tmp, "uninterrupted")
        code, out, _, _ = run_bounded(
            [*launcher("fshard", 2, 0), "-m", "tests.restart_program", str(base)], timeout
        )
        if code != 0:
            raise SystemExit(f"the uninterrupted run failed:\n{out[-3000:]}")
        want = torch.load(base / "final.pt")
        ref = reference(20)
        err = max((want[k] - ref[k]).abs().max().item() for k in ref)
        print(f"uninterrupted run: max |difference| from plain torch {err:.2g}", flush=True)
        for kind in ("fshard", "torchrun"):
            ok, seconds, problems = 0, [], []
            for i in range(runs):
                out_dir = Path(tmp, f"{kind}{i}")
                cmd = [*launcher(kind, 2, 1), "-m", "tests.restart_program", str(out_dir), "--kill-at", "17"]
                code, out, dt, left = run_bounded(cmd, timeout)
                seconds.append(dt)
                why = _kill_run_problem(code, out, out_dir, want, left)
                ok += why is None
                if why is not None:
                    problems.append(f"run {i}: {why}")
                print(f"{kind} run {i}: {'ok' if why is None else why} ({dt:.1f} s)", flush=True)
            counts[kind] = dict(ok=ok, runs=runs, seconds=sorted(seconds), problems=problems)
    return counts


def _kill_run_problem(code, out: str, out_dir: Path, want: dict, left: bool) -> str | None:
    import torch

    if code is None:
        return "timed out"
    if left:
        return "a process was left behind"
    if code != 0:
        refused = " (Connection refused)" if "Connection refused" in out else ""
        return f"launcher exited with {code}{refused}: {out.strip().splitlines()[-1][:200]}"
    attempts = (out_dir / "attempts.txt").read_text().splitlines()
    if len(attempts) != 2 or not attempts[1].startswith("attempt 1 start 15 "):
        return f"unexpected attempts {attempts}"
    got = torch.load(out_dir / "final.pt")
    if not all(torch.equal(got[k], want[k]) for k in want):
        return "final parameters differ from the uninterrupted run"
    return None


# --------------------------------------------------------------------------------------------------
# exits


def exit_program() -> None:
    """What the demo does before it exits, on a 2x2 mesh (run on 4 ranks)."""
    import torch
    import torch.distributed as dist

    import fshard as fs
    from fshard import checkpoint

    atexit.register(_gloo_threads_at_exit)  # registered before fs.init: runs after fshard's exit hook
    fs.init()
    mesh = fs.Mesh(dp=2, tp=2)
    gen = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(8, 16, generator=gen), "w2": torch.randn(16, 8, generator=gen)}
    specs = {"w1": "(dp d) (tp h)", "w2": "(tp h) (dp d)"}
    sharded = fs.shard(params, mesh, specs)

    @fs.shard_map(mesh=mesh, in_specs=(specs, "(dp b) d"), out_specs="")
    def loss(p, x):
        w1 = fs.all_gather(p["w1"], "dp", dim=0, tiled=True)
        w2 = fs.all_gather(p["w2"], "dp", dim=1, async_op=True, tiled=True).wait()
        h = fs.psum(torch.tanh(x @ w1) @ w2, "tp")
        return fs.pmean((h**2).mean(), "dp")

    opt = fs.optim.adamw(1e-2)
    state = {"params": sharded, "opt": opt.init(sharded)}
    for _ in range(3):
        x = torch.randn(8, 8, generator=gen)
        _, grads = fs.value_and_grad(loss)(state["params"], x)
        state["params"], state["opt"] = opt.update(state["params"], grads, state["opt"])
    ckpt = sys.argv[2]
    checkpoint.save(ckpt, state, step=3)
    state = checkpoint.load(ckpt, state)
    total = sum(float(v.full().sum()) for v in state["params"].values())
    # The demo's ending: the script destroys the default group itself, then rank 0 alone reports
    # while the others are already exiting (the meshes still hold their groups).
    dist.barrier()
    dist.destroy_process_group()
    if sys.argv[3:] == ["--keep-groups"]:  # the teardown before fshard released its groups at exit
        from fshard import _env

        _env._holders.clear()
    if int(os.environ["RANK"]) == 0:
        print(f"exit program: done, parameter sum {total:.4f}", flush=True)


def _gloo_threads_at_exit() -> None:
    """Print how many gloo threads this rank still has after fshard's exit hook (Linux only): each
    one left for interpreter shutdown can abort the process there."""
    tasks = "/proc/self/task"
    if os.path.isdir(tasks):
        names = []
        for task in os.listdir(tasks):
            try:
                names.append(Path(tasks, task, "comm").read_text())
            except OSError:
                pass
        left = sum("gloo" in n for n in names)
        print(f"exit program: rank {os.environ['RANK']} gloo threads at exit {left}", flush=True)


def exits(runs: int, timeout: float, keep_groups: bool = False) -> dict:
    ok, seconds, problems = 0, [], []
    threads_left = 0  # runs in which some rank still had gloo threads after fshard's exit hook
    with tempfile.TemporaryDirectory(prefix="fshard-exits-") as tmp:
        for i in range(runs):
            cmd = [
                *launcher("fshard", 4, 0),
                "-m",
                "benchmarks.restarts",
                "exit-program",
                str(Path(tmp, str(i))),
                *(["--keep-groups"] if keep_groups else []),
            ]
            code, out, dt, left = run_bounded(cmd, timeout)
            seconds.append(dt)
            why = None
            if code is None:
                why = "timed out"
            elif left:
                why = "a process was left behind"
            elif code != 0 or "exit program: done" not in out:
                lines = [
                    x for x in out.splitlines() if "terminate" in x or "fshard.run" in x
                ] or out.splitlines()[-2:]
                why = f"exit code {code}: {' | '.join(lines)[:300]}"
            ok += why is None
            left_threads = [int(n) for n in re.findall(r"gloo threads at exit (\d+)", out)]
            threads_left += len(left_threads) != 4 or any(left_threads)
            if why:
                problems.append(f"run {i}: {why}")
            print(
                f"exit run {i}: {'ok' if why is None else why} ({dt:.1f} s; gloo threads left at "
                f"exit per rank {left_threads})",
                flush=True,
            )
    return dict(
        ok=ok,
        runs=runs,
        seconds=sorted(seconds),
        problems=problems,
        keep_groups=keep_groups,
        threads_left=threads_left,
    )


# --------------------------------------------------------------------------------------------------
# report


def _median(xs: list[float]) -> float:
    return xs[len(xs) // 2] if xs else float("nan")


def section(kill_counts: dict | None, exit_counts: dict | None) -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        BEGIN,
        "## Restarts and clean exits",
        "",
        "`python -m benchmarks.restarts kills --runs N` and `exits --runs N` (see the script's docstring); "
        f"load average at the end {load} on {os.cpu_count()} CPUs.",
        "",
    ]
    if kill_counts:
        lines += [
            "Kill-and-restart: 2-rank FSDP loop, checkpoint every 5 steps, rank 1 SIGKILLed before step 17, "
            "`--max-restarts 1`; success = exit 0, resumed from step 15, final parameters bit-identical "
            "to the uninterrupted run.",
            "",
            "| launcher | successes | median s per run (max) |",
            "|---|---|---|",
        ]
        names = {"fshard": "`python -m fshard.run`", "torchrun": "`torchrun --rdzv-backend c10d`"}
        for kind, c in kill_counts.items():
            lines.append(
                f"| {names[kind]} | {c['ok']} of {c['runs']} | {_median(c['seconds']):.1f} ({max(c['seconds']):.1f}) |"
            )
        lines.append("")
        lines += [f"- {kind} {p}" for kind, c in kill_counts.items() for p in c["problems"]]
    if exit_counts:
        c = exit_counts
        lines += [
            "",
            f"Clean exits: {c['ok']} of {c['runs']} 4-rank runs (mesh dp=2 x tp=2, collectives on both "
            "axes, an asynchronous all-gather, a checkpoint save and load, `destroy_process_group` by "
            "the script as the demo does) exited with code 0; "
            f"median {_median(c['seconds']):.1f} s per run; runs in which a rank still had gloo "
            f"threads after fshard's exit hook: {c['threads_left']}"
            + (
                " (`--keep-groups`: without releasing the meshes' groups at exit)."
                if c.get("keep_groups")
                else "."
            ),
        ]
        lines += [f"- {p}" for p in c["problems"]]
    lines.append(END)
    return "\n".join(lines) + "\n"


def write(text: str) -> None:
    old = RESULTS.read_text() if RESULTS.exists() else ""
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END) + "\n?", re.S)
    new = pattern.sub(lambda _: text, old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + text
    RESULTS.write_text(new)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "exit-program":
        exit_program()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("kills", "exits", "both"))
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--exit-runs", type=int, default=50, help="runs of `exits` under `both`")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one run may take")
    parser.add_argument(
        "--keep-groups", action="store_true", help="exits: do not release the meshes' groups at exit"
    )
    parser.add_argument("--write", action="store_true", help="update the section of benchmarks/RESULTS.md")
    args = parser.parse_args()
    kill_counts = kills(args.runs, args.timeout) if args.what in ("kills", "both") else None
    exit_runs = args.exit_runs if args.what == "both" else args.runs
    exit_counts = exits(exit_runs, args.timeout, args.keep_groups) if args.what in ("exits", "both") else None
    text = section(kill_counts, exit_counts)
    print(text)
    if args.write:
        write(text)


if __name__ == "__main__":
    main()
