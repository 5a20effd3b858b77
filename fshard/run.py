"""Run a script on N local ranks, torchrun-style.

Usage::

    python -m fshard.run -n 4 train.py --lr 0.1
    python -m fshard.run -n 2 -m mypackage.train --lr 0.1
    python -m fshard.run -n 2 --prefix train.py      # prefix each output line with [rankR]:

Every rank is a ``sys.executable`` subprocess whose environment carries ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` (plus the other
variables ``torchrun`` sets, see ``fshard._env.torchrun_env``), so a script that calls
``fs.init()`` (or ``torch.distributed.init_process_group("gloo")``) runs unchanged under either
launcher. Rank 0 hosts the rendezvous store, as with ``torchrun`` when it does not use its agent
store.

If a rank exits with a non-zero code, the other ranks are terminated (SIGTERM, then SIGKILL after a
few seconds) and the launcher exits with the code of the rank that failed first. A rank that
called ``fs.init()`` and raised records its exception in ``TORCHELASTIC_ERROR_FILE`` before it
exits: the launcher names that rank, and its exception, even when ranks that were waiting for it
in a collective exit first. SIGINT/SIGTERM sent to the launcher are forwarded to the ranks, saying so
in one line (a second signal kills them; so does the launcher, 10 s later). A rank that waits in
``fs.init()``'s rendezvous (for a rank 0 slow to start, say) ends at once, saying why.

With ``--max-restarts N``, a failed attempt is not the end: every rank is stopped, and after a
short pause (1 s, doubling up to 30 s) all of them start again from the top of the script, on a
fresh rendezvous (a new port, unless ``--master-port`` is given, and so a new store), up to ``N``
times. Each rank sees the attempt number as ``TORCHELASTIC_RESTART_COUNT`` (0, 1, ...), as under
``torchrun --max-restarts N``, and through ``fs.restart_count()``; a restarted script resumes
from its latest checkpoint (``fshard.checkpoint.latest_step``). A launcher interrupted by
SIGINT/SIGTERM never restarts.

The launcher itself does not import torch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from typing import IO

from ._env import ERROR_FILE_ENV, describe_exit, exit_status, free_port, read_error_file, torchrun_env

__all__ = ["main"]

_KILL_AFTER_FAILURE = 3.0  # seconds between SIGTERM and SIGKILL once a rank failed
_KILL_AFTER_SIGNAL = 10.0  # seconds ranks get to handle a forwarded SIGINT/SIGTERM
_WAIT_FOR_CULPRIT = 2.0  # seconds to wait for the rank that caused the failures seen so far
# Seconds to wait while every failure seen is a consequence (a connection closed by a peer whose
# collective timed out): that peer first asks the others where they are (up to 2.5 s,
# ``fshard._watchdog._ANSWER_WAIT``), then records which ranks did not arrive. After 2 s the
# launcher used to blame a rank whose connection had been closed instead.
_WAIT_FOR_RECORD = 6.0
_WAIT_FOR_BLAME = 10.0  # at most, while ranks keep timing out waiting for ranks that did not arrive
_RANK_MEMORY = 230 * 2**20  # resident memory of an idle rank: an interpreter with torch imported
_RANKS_PER_CPU = 4  # beyond this many ranks per CPU, start-up and collectives crawl
_RESTART_BACKOFF = 1.0  # seconds before the first restart; doubled for each further one
_RESTART_BACKOFF_MAX = 30.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fshard.run",
        description="Launch a Python script (or module) on N local ranks with torchrun's environment.",
    )
    parser.add_argument(
        "-n",
        "--nprocs",
        "--nproc-per-node",
        dest="nprocs",
        type=int,
        default=1,
        help="number of ranks (default 1)",
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="treat SCRIPT as a module name, run like `python -m`"
    )
    parser.add_argument("--prefix", action="store_true", help="prefix every output line with [rankR]:")
    parser.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart every rank up to this many times after a failure (default 0)",
    )
    parser.add_argument("script", metavar="SCRIPT", help="script path (or module name with -m)")
    parser.add_argument("script_args", metavar="ARGS", nargs=argparse.REMAINDER, help="script arguments")
    return parser


def _rank_env(
    rank: int, nprocs: int, port: int, run_id: str, error_file: str, attempt: int = 0, max_restarts: int = 0
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(torchrun_env(rank, nprocs, port, agent_store=False, run_id=run_id))
    env.update(_restart_env(attempt, max_restarts))
    env[ERROR_FILE_ENV] = error_file
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if nprocs > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun does, to avoid oversubscribing the cores
    return env


def _machine() -> tuple[int, int | None]:
    """(usable CPUs, available memory in bytes or None when unknown)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    available = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            pass
    return cpus, available


def _capacity_warnings(nprocs: int, cpus: int, available: int | None) -> list[str]:
    """Warnings for a world far beyond this machine (memory, CPUs); empty when it fits."""
    gib = 2**30
    warnings = []
    need = nprocs * _RANK_MEMORY
    if available is not None and need > available:
        fit = max(1, available // _RANK_MEMORY)
        warnings.append(
            f"fshard.run: warning: {nprocs} ranks need about {need / gib:.1f} GiB of memory "
            f"({nprocs} x ~{_RANK_MEMORY // 2**20} MiB, one Python process with torch each) but only "
            f"{available / gib:.1f} GiB is available, so ranks may be killed for lack of memory; "
            f"use -n {fit} or fewer, or a machine with more memory"
        )
    if nprocs > _RANKS_PER_CPU * cpus:
        warnings.append(
            f"fshard.run: warning: {nprocs} ranks on {cpus} CPU(s) is {nprocs / cpus:.0f} ranks per "
            f"CPU, so start-up and every collective will be very slow; use -n "
            f"{_RANKS_PER_CPU * cpus} or fewer, or a machine with more CPUs"
        )
    return warnings


def _death_signal_preexec():
    """On Linux, have the kernel kill a rank if the launcher dies (no orphans even on SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL)

    return preexec


def _pump(src: IO[bytes], dst: IO[bytes], prefix: bytes, lock: threading.Lock) -> None:
    try:
        for line in iter(src.readline, b""):
            with lock:
                dst.write(prefix + line)
                dst.flush()
    except (OSError, ValueError):  # stream closed under us at shutdown
        pass


def _root_cause(codes: list[int | None], error_files: list[str], *, final: bool) -> tuple[int, str] | None:
    """The rank that failed first, and how: ``(rank, "raised ValueError: ... and exited with code 1")``.

    In order: the rank that recorded the earliest exception of its own (it wrote its error file
    before closing its connections, hence before any peer could fail because of it); else a rank
    that another rank's collective timed out waiting for (``"did not arrive at ..."``: it is
    still running, stuck elsewhere, and recorded nothing); else the
    lowest rank that exited with an error and recorded nothing (``sys.exit(3)``, a signal); else,
    if every failed rank recorded a consequence of another rank failing (a closed connection, a
    timeout), None until ``final`` (the culprit may still be on its way out), then the earliest.
    """
    recorded = {rank: read_error_file(path) for rank, path in enumerate(error_files)}

    def raised(rank: int) -> str:
        code = codes[rank]
        message = f"raised {recorded[rank].message}"  # type: ignore[union-attr]
        return message if code is None else f"{message} and {describe_exit(code)}"

    primary = [(got.time, rank) for rank, got in recorded.items() if got is not None and not got.secondary]
    if primary:
        rank = min(primary)[1]
        return rank, raised(rank)
    blamed = [(got.time, got.blame) for got in recorded.values() if got is not None and got.blame]
    if blamed:
        ranks, what = min(blamed)[1]
        return ranks[0], what
    failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
    unrecorded = [rank for rank in failed if recorded[rank] is None]
    if unrecorded:
        return unrecorded[0], describe_exit(codes[unrecorded[0]])
    if not final:
        return None
    secondary = [(got.time, rank) for rank, got in recorded.items() if got is not None]
    rank = min(secondary)[1] if secondary else failed[0]
    return rank, raised(rank)


def _not_arrived(error_files: list[str]) -> list[int]:
    """Every rank that some rank's collective timed out waiting for (from their error files)."""
    ranks: set[int] = set()
    for path in error_files:
        got = read_error_file(path)
        if got is not None and got.blame:
            ranks.update(got.blame[0])
    return sorted(ranks)


def main(argv: Sequence[str] | None = None) -> int:
    """Launch ``SCRIPT`` (or ``-m MODULE``) on ``-n`` local ranks and return the exit code.

    Args:
        argv: command-line arguments without the program name (``sys.argv[1:]`` when ``None``).

    Returns:
        0 if every rank exited with 0; the exit code of the rank that failed first (``128 +
        signal`` if it was killed by a signal); ``128 + signal`` if the launcher was interrupted.

    Examples:
        >>> from fshard.run import main
        >>> main(["-n", "2", "train.py", "--epochs", "1"])   # doctest: +SKIP
        0
    """
    parser = _parser()
    opts = parser.parse_args(argv)
    if opts.nprocs < 1:
        parser.error("--nprocs must be >= 1")
    if opts.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    if not opts.module and not os.path.exists(opts.script):
        parser.error(f"no such script: {opts.script}")
    for warning in _capacity_warnings(opts.nprocs, *_machine()):
        print(warning, file=sys.stderr, flush=True)
    cmd = [sys.executable, *(["-m"] if opts.module else []), opts.script, *opts.script_args]
    run_id = f"fshard-{uuid.uuid4().hex[:12]}"
    return _restarting(opts.nprocs, opts.max_restarts, lambda attempt: _attempt(opts, cmd, run_id, attempt))


def _attempt(opts: argparse.Namespace, cmd: list[str], run_id: str, attempt: int) -> tuple[int, bool]:
    """Run every rank once: ``(exit code, whether the launcher was interrupted by a signal)``."""
    port = opts.master_port if opts.master_port is not None else free_port()  # a fresh store each attempt
    preexec = _death_signal_preexec()
    error_dir = tempfile.mkdtemp(prefix="fshard-run-")
    error_files = [os.path.join(error_dir, f"rank{rank}.json") for rank in range(opts.nprocs)]

    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    received: list[int] = []
    old_handlers: dict[int, object] = {}

    passed_on: list[int] = []  # how many ranks the first signal was passed on to

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        sig: int = signum if len(received) == 1 else signal.SIGKILL
        sent = 0
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(sig)
                    sent += 1
                except OSError:
                    pass
        if len(received) == 1:
            passed_on.append(sent)

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            old_handlers[sig] = signal.signal(sig, forward)
        for rank in range(opts.nprocs):
            env = _rank_env(rank, opts.nprocs, port, run_id, error_files[rank], attempt, opts.max_restarts)
            kwargs: dict = {"env": env, "preexec_fn": preexec}
            if opts.prefix:
                env["PYTHONUNBUFFERED"] = "1"
                kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            procs.append(subprocess.Popen(cmd, **kwargs))
            if received:  # a signal arrived while starting: forward it to the late ones too
                procs[-1].send_signal(received[0])
                passed_on[0] += 1
        if opts.prefix:
            lock = threading.Lock()
            for rank, proc in enumerate(procs):
                tag = f"[rank{rank}]: ".encode()
                for src, dst in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
                    thread = threading.Thread(target=_pump, args=(src, dst, tag, lock), daemon=True)
                    thread.start()
                    pumps.append(thread)

        blamed: int | None = None  # the rank that failed first
        stuck = False  # the blamed rank did not arrive at a collective (the launcher stops it)
        absent: list[int] = []  # the ranks that did not arrive (the blamed one first)
        n_failed, last_failure = 0, 0.0  # ranks seen failed so far, and when the last of them was seen
        own_codes: list[int] = []  # the codes of the ranks that failed by themselves (before any was stopped)
        first_failure: float | None = None  # when a rank was first seen to fail
        kill_at: float | None = None
        while True:
            codes = [proc.poll() for proc in procs]
            now = time.monotonic()
            if received and kill_at is None:  # (said even when every rank has ended since)
                kill_at = now + _KILL_AFTER_SIGNAL
                alive = passed_on[0] if passed_on else sum(code is None for code in codes)
                print(
                    f"fshard.run: {signal.Signals(received[0]).name}: passed on to the {alive} running "
                    f"rank(s); those still running in {_KILL_AFTER_SIGNAL:g} s will be killed (a second "
                    "signal kills them now)",
                    file=sys.stderr,
                    flush=True,
                )
            if all(code is not None for code in codes):
                break
            verdict = None
            if blamed is None and not received and any(code not in (None, 0) for code in codes):
                if first_failure is None:
                    first_failure = now
                verdict = _root_cause(codes, error_files, final=now - first_failure >= _WAIT_FOR_RECORD)
            if verdict is not None and verdict[1].startswith("did not arrive"):
                # Ranks that did not arrive are stuck elsewhere. The ranks of other groups waiting for
                # them time out about now: give them the culprit's grace to name theirs too.
                failed = sum(code not in (None, 0) for code in codes)
                if failed > n_failed:
                    n_failed, last_failure = failed, now
                if now - last_failure < _WAIT_FOR_CULPRIT and now - first_failure < _WAIT_FOR_BLAME:  # type: ignore[operator]
                    verdict = None
            if verdict is not None:
                blamed, what = verdict
                own_codes = [code for code in codes if code]
                # A rank that did not arrive at a collective is stuck elsewhere: it is stopped too.
                stuck = what.startswith("did not arrive")
                absent = [blamed]
                if stuck:
                    absent = sorted({blamed, *_not_arrived(error_files)})
                    absent = [r for r in absent if 0 <= r < len(procs)]
                    blamed = absent[0]
                running = [r for r in absent if stuck and codes[r] is None]
                others = [p for rank, p in enumerate(procs) if rank not in absent and p.poll() is None]
                who = ", ".join(f"{r} (pid {procs[r].pid})" for r in absent)
                them = ("them and " if len(running) > 1 else "it and ") if running else ""
                print(
                    f"fshard.run: rank{'s' if len(absent) > 1 else ''} {who} {what}; "
                    f"terminating {them}the {len(others)} other running rank(s)",
                    file=sys.stderr,
                    flush=True,
                )
                for proc in others + [procs[r] for r in running]:
                    proc.terminate()  # the blamed rank, if still running, is ending by itself (unless stuck)
                kill_at = now + _KILL_AFTER_FAILURE
            if kill_at is not None and now >= kill_at:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
                kill_at = float("inf")
            time.sleep(0.05)
        if received:
            return 128 + received[0], True
        if blamed is None and any(codes):  # failures seen only at the last poll
            blamed, what = _root_cause(codes, error_files, final=True)  # type: ignore[misc]
            print(f"fshard.run: rank {blamed} (pid {procs[blamed].pid}) {what}", file=sys.stderr, flush=True)
        if blamed is None:
            return 0, False
        # The blamed rank's code; if it somehow exited with 0 after recording, the first failure's; if
        # it was stopped by the launcher for not arriving, the code of a rank that failed by itself
        # (not that of a rank the launcher then terminated).
        if stuck:
            return exit_status(next(iter(own_codes), 1)), False
        return exit_status(codes[blamed] or next(code for code in codes if code)), False
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for thread in pumps:
            thread.join(timeout=2.0)
        if not any(thread.is_alive() for thread in pumps):  # else a grandchild holds the pipe open
            for proc in procs:
                for stream in (proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
        for old_sig, handler in old_handlers.items():
            signal.signal(old_sig, handler)  # type: ignore[arg-type]
        shutil.rmtree(error_dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# restarts


def _restart_env(attempt: int, max_restarts: int) -> dict[str, str]:
    """What a rank of attempt ``attempt`` (0 first) is told, as torchrun tells it."""
    return {"TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}


def _backoff(restart: int) -> float:
    """Seconds to wait before restart number ``restart`` (1 first): 1, 2, 4, ... up to 30."""
    return min(_RESTART_BACKOFF * 2 ** (restart - 1), _RESTART_BACKOFF_MAX)


def _restarting(nprocs: int, max_restarts: int, run_attempt) -> int:
    """Run attempts (``run_attempt(attempt) -> (code, interrupted)``) until one succeeds, the
    launcher is interrupted, or ``max_restarts`` restarts have failed; return the last code."""
    attempt = 0
    while True:
        code, interrupted = run_attempt(attempt)
        if code == 0 or interrupted or max_restarts == 0:
            return code
        if attempt == max_restarts:
            print(
                f"fshard.run: giving up: the last of {max_restarts} restart(s) failed too",
                file=sys.stderr,
                flush=True,
            )
            return code
        attempt += 1
        delay = _backoff(attempt)
        print(
            f"fshard.run: restarting all {nprocs} rank(s) in {delay:g} s "
            f"(restart {attempt} of {max_restarts})",
            file=sys.stderr,
            flush=True,
        )
        try:
            time.sleep(delay)
        except KeyboardInterrupt:
            return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
