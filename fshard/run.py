"""Run a script on N local ranks, torchrun-style.

Usage::

    python -m fshard.run -n 4 train.py --lr 0.1
    python -m fshard.run -n 2 -m mypackage.train --lr 0.1
    python -m fshard.run -n 2 --prefix train.py      # prefix each output line with [rankR]:

Every rank is a ``sys.executable`` subprocess whose environment carries ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` (plus the other
variables ``torchrun`` sets), so a script that calls ``fshard._launch.init()`` (or
``torch.distributed.init_process_group("gloo")``) runs unchanged under either launcher. Rank 0 hosts
the rendezvous store, as with ``torchrun`` when it does not use its agent store.

If a rank exits with a non-zero code, the other ranks are terminated (SIGTERM, then SIGKILL after a
few seconds) and the launcher exits with that code. SIGINT/SIGTERM sent to the launcher are
forwarded to the ranks (a second signal kills them).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import IO

__all__ = ["main"]

_KILL_AFTER_FAILURE = 3.0  # seconds between SIGTERM and SIGKILL once a rank failed
_KILL_AFTER_SIGNAL = 10.0  # seconds ranks get to handle a forwarded SIGINT/SIGTERM


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
    parser.add_argument("script", metavar="SCRIPT", help="script path (or module name with -m)")
    parser.add_argument("script_args", metavar="ARGS", nargs=argparse.REMAINDER, help="script arguments")
    return parser


def _rank_env(rank: int, nprocs: int, port: int, run_id: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        ROLE_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_USE_AGENT_STORE="False",
        TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    )
    if nprocs > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun does, to avoid oversubscribing the cores
    return env


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


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def main(argv: Sequence[str] | None = None) -> int:
    """Launch ``SCRIPT`` (or ``-m MODULE``) on ``-n`` local ranks and return the exit code.

    Args:
        argv: command-line arguments without the program name (``sys.argv[1:]`` when ``None``).

    Returns:
        0 if every rank exited with 0; the exit code of the first failing rank (``128 + signal``
        if it was killed by a signal); ``128 + signal`` if the launcher was interrupted.

    Examples:
        >>> from fshard.run import main
        >>> main(["-n", "2", "train.py", "--epochs", "1"])   # doctest: +SKIP
        0
    """
    parser = _parser()
    opts = parser.parse_args(argv)
    if opts.nprocs < 1:
        parser.error("--nprocs must be >= 1")
    if not opts.module and not os.path.exists(opts.script):
        parser.error(f"no such script: {opts.script}")
    if opts.master_port is not None:
        port = opts.master_port
    else:
        from fshard._launch import _free_port

        port = _free_port()
    cmd = [sys.executable, *(["-m"] if opts.module else []), opts.script, *opts.script_args]
    run_id = f"fshard-{uuid.uuid4().hex[:12]}"
    preexec = _death_signal_preexec()

    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    received: list[int] = []
    old_handlers: dict[int, object] = {}

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        sig: int = signum if len(received) == 1 else signal.SIGKILL
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(sig)
                except OSError:
                    pass

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            old_handlers[sig] = signal.signal(sig, forward)
        for rank in range(opts.nprocs):
            env = _rank_env(rank, opts.nprocs, port, run_id)
            kwargs: dict = {"env": env, "preexec_fn": preexec}
            if opts.prefix:
                env["PYTHONUNBUFFERED"] = "1"
                kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            procs.append(subprocess.Popen(cmd, **kwargs))
            if received:  # a signal arrived while starting: forward it to the late ones too
                procs[-1].send_signal(received[0])
        if opts.prefix:
            lock = threading.Lock()
            for rank, proc in enumerate(procs):
                tag = f"[rank{rank}]: ".encode()
                for src, dst in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
                    thread = threading.Thread(target=_pump, args=(src, dst, tag, lock), daemon=True)
                    thread.start()
                    pumps.append(thread)

        exit_code = 0
        kill_at: float | None = None
        while True:
            codes = [proc.poll() for proc in procs]
            if all(code is not None for code in codes):
                break
            now = time.monotonic()
            if received and kill_at is None:
                kill_at = now + _KILL_AFTER_SIGNAL
            if exit_code == 0 and not received:
                failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
                if failed:
                    rank, code = failed[0]
                    exit_code = 128 - code if code < 0 else code
                    alive = sum(code is None for code in codes)
                    print(
                        f"fshard.run: rank {rank} (pid {procs[rank].pid}) {_describe(code)}; "
                        f"terminating the {alive} other running rank(s)",
                        file=sys.stderr,
                        flush=True,
                    )
                    for proc in procs:
                        if proc.poll() is None:
                            proc.terminate()
                    kill_at = now + _KILL_AFTER_FAILURE
            if kill_at is not None and now >= kill_at:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
                kill_at = float("inf")
            time.sleep(0.05)
        if exit_code == 0:
            for rank, rc in enumerate(codes):
                if rc is not None and rc != 0 and not received:
                    exit_code = 128 - rc if rc < 0 else rc
                    print(f"fshard.run: rank {rank} {_describe(rc)}", file=sys.stderr, flush=True)
                    break
        if received:
            exit_code = 128 + received[0]
        return exit_code
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


if __name__ == "__main__":
    sys.exit(main())
