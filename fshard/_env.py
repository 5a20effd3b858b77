"""The torchrun environment, joining the default process group, and how a rank ends.

Written once here and shared by `fs.init`, the rank pool (``fshard._launch``) and the
``python -m fshard.run`` launcher:

* `torchrun_env`: the variables ``torchrun`` gives a rank on one machine;
* `describe_exit` / `exit_status`: how a rank's exit code is reported and passed on;
* `is_comm_error` (from `_errors`): whether an exception is a consequence of another rank failing;
* `init` and its exit hooks: a rank that raises exits at once (and leaves an error file in
  torchrun's format for its launcher) instead of waiting for its peers at exit.

Nothing here imports torch at module level: the launcher process never needs it.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

from ._errors import FshardError, is_comm_error

HOST = "127.0.0.1"
REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # where a rank records the exception that ended it
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # how many times the launcher restarted the ranks
EXIT_BARRIER_TIMEOUT = 30.0  # seconds the at-exit barrier waits at most (half init's timeout if shorter)
EXIT_AFTER_ERROR = 10.0  # seconds a rank that raised may spend in interpreter shutdown
EXIT_RELEASE_TIMEOUT = 10.0  # seconds the process groups' threads may take to end at exit
STORE_GRACE = 4.0  # seconds a store-hosting rank that timed out keeps the store up for its peers
CONSEQUENCE_GRACE = 3.0  # seconds a rank failed by a peer's failure waits before exiting under torchrun
RENDEZVOUS_TIMEOUT = 300.0  # seconds to join a world at least: ranks may start seconds apart


# --------------------------------------------------------------------------------------------------
# the environment torchrun sets


def torchrun_env(
    rank: int, nprocs: int, port: int, *, agent_store: bool, run_id: str | None = None
) -> dict[str, str]:
    """The variables ``torchrun --nproc-per-node nprocs`` gives ``rank`` (one machine).

    ``agent_store``: the launcher hosts the rendezvous store (every rank is a client) rather than
    rank 0. ``run_id``: also set the elastic agent's variables (``TORCHELASTIC_RUN_ID``, ...), as a
    command-line launcher does.
    """
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": HOST,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
    }
    if run_id is not None:
        env.update(
            ROLE_RANK=str(rank),
            ROLE_NAME="default",
            ROLE_WORLD_SIZE=str(nprocs),
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
            TORCHELASTIC_RUN_ID=run_id,
        )
    return env


def free_port(host: str = HOST) -> int:
    """Return a TCP port on ``host`` that was free a moment ago (bind port 0; retry once)."""
    for attempt in range(2):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                return sock.getsockname()[1]
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or attempt:
                raise
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------------
# exit codes


def describe_exit(code: int | None) -> str:
    """``"exited with code 3"``, ``"was killed by SIGKILL"``, or ``"disappeared"`` (no code)."""
    if code is None:
        return "disappeared"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def exit_status(code: int) -> int:
    """The shell's exit status for a child's return code: ``128 + signal`` when it was killed."""
    return 128 - code if code < 0 else code


# --------------------------------------------------------------------------------------------------
# failures caused by another rank


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``"ValueError: message"`` on one line, truncated to ``limit`` characters."""
    text = traceback.format_exception_only(type(exc), exc)[-1].strip().replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------------
# error files (torchrun's format: the launcher reads them to name the rank that failed first)


def write_error_file(path: str, exc: BaseException, tb: Any, *, secondary: bool = False) -> None:
    """Record ``exc`` in ``path`` the way ``torch.distributed.elastic``'s ``@record`` does.

    ``secondary``: ``exc`` is a consequence of another rank failing (a closed connection, a
    timeout), so a launcher should look for another culprit first. An exception carrying
    ``fshard_blame = (ranks, what)`` (a collective that timed out because ``ranks`` did not
    arrive) records them: the launcher names those ranks.
    """
    now = time.time()
    blame = getattr(exc, "fshard_blame", None)
    data = {
        "message": {
            "message": one_line(exc, 2000),
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(exc), exc, tb)),
                "timestamp": str(int(now)),
                "fshard_time": repr(now),
                "fshard_secondary": secondary,
                "fshard_blame": list(blame) if blame else None,
            },
        }
    }
    # Written whole or not at all (a new file moved into place): torchrun's agent reads the file of
    # a rank that ended, and a rank stopped halfway through the write (the agent's own SIGTERM, once
    # another rank died) left it empty, on which the agent itself failed (JSONDecodeError) instead
    # of restarting the ranks.
    tmp = f"{path}.{os.getpid()}.partial"
    try:
        with open(tmp, "w") as fh:
            json.dump(data, fh, default=str)  # (a value JSON cannot hold is written as its text)
        os.replace(tmp, path)
    except OSError:  # diagnostics only
        with contextlib.suppress(OSError):
            os.remove(tmp)


class Recorded(NamedTuple):
    """What a rank recorded in its error file."""

    message: str  # "ValueError: ..." on one line
    time: float  # when it was written
    secondary: bool  # a consequence of another rank failing
    blame: tuple | None = None  # (ranks that did not arrive at a collective, what they did not do)


def read_error_file(path: str) -> Recorded | None:
    """The exception recorded in an error file, or None when there is none."""
    try:
        with open(path) as fh:
            data = json.load(fh)
        message = data["message"]
        if isinstance(message, str):
            return Recorded(message.splitlines()[0] if message else "", os.path.getmtime(path), False)
        info = message.get("extraInfo", {})
        when = float(info.get("fshard_time") or info.get("timestamp") or os.path.getmtime(path))
        text = str(message.get("message", "")).splitlines()
        blame = info.get("fshard_blame")
        blame = (tuple(int(r) for r in blame[0]), str(blame[1])) if blame else None
        return Recorded(text[0] if text else "", when, bool(info.get("fshard_secondary", False)), blame)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


# --------------------------------------------------------------------------------------------------
# process groups


def default_backend(nprocs: int = 1) -> str:
    """``"nccl"`` when CUDA has at least ``nprocs`` devices, else ``"gloo"``."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs:
        return "nccl"
    return "gloo"


def check_timeout(timeout: Any, where: str) -> float | None:
    """``timeout`` as float seconds (None stays None), or a FshardError naming ``where``."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise FshardError(
            f"{where}: timeout must be a positive number of seconds (or None for torch's default), "
            f"got {timeout!r}"
        )
    return float(timeout)


def init_process_group(
    backend: str,
    *,
    local_rank: int,
    timeout: float | None,
    store: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """``torch.distributed.init_process_group`` with fshard's defaults (``env://`` without store).

    ``timeout`` bounds the collectives; joining the world itself may take up to
    `RENDEZVOUS_TIMEOUT` (ranks can start seconds apart on a busy machine), so a short timeout
    is set once every rank has joined.
    """
    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timedelta(seconds=max(timeout, RENDEZVOUS_TIMEOUT))
    if "nccl" in backend:
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world_size)
    else:
        kwargs["init_method"] = "env://"
    dist.init_process_group(backend, **kwargs)
    if timeout is not None and timeout < RENDEZVOUS_TIMEOUT:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout))


# --------------------------------------------------------------------------------------------------
# restarts


def restart_count() -> int:
    """How many times the launcher has restarted this run's ranks: 0 on the first attempt.

    Read from ``TORCHELASTIC_RESTART_COUNT``, which ``python -m fshard.run --max-restarts N``
    and ``torchrun --max-restarts N`` set for every rank (0 when it is unset, e.g. under
    `fs.launch` or as a plain script). A restarted rank starts the script from the top: resume
    from the latest checkpoint (``fshard.checkpoint.latest_step``) rather than from this number.

    Examples:
        >>> import fshard as fs
        >>> fs.restart_count()          # under `python -m fshard.run --max-restarts 3`, after a failure: 1
        0
    """
    text = os.environ.get(RESTART_COUNT_ENV, "")
    try:
        return max(0, int(text))
    except ValueError:
        return 0


def attempt_store(rank: int, world_size: int, timeout: float | None) -> Any:
    """Join this attempt's rendezvous store (see ``fshard._rendezvous.join``) and return the store
    for the default process group.

    When the launcher hosts the store (``TORCHELASTIC_USE_AGENT_STORE=True``: torchrun with the
    c10d or static rendezvous), that store outlives the ranks: after a restart it still holds the
    keys the previous attempt's ranks wrote, among them the addresses gloo's ``connectFullMesh``
    reads to connect to its peers. A new rank that reads a dead peer's address gets "Connection
    refused" and fails the restart; which address it reads first is a race. Every attempt
    therefore joins under a prefix of its own (run id and restart count), so no key of a previous
    attempt is ever read. When rank 0 hosts the store (``python -m fshard.run``, which also picks
    a new port per attempt), the store dies with the attempt; the process group's keys go under
    ``default_pg/``, as with ``env://``.
    """
    import torch.distributed as dist

    from . import _rendezvous

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    prefix = (
        f"fshard/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/attempt_{restart_count()}/" if agent else None
    )
    wait = max(timeout or 0.0, RENDEZVOUS_TIMEOUT)
    store = _rendezvous.join(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        rank,
        world_size,
        hosts_store=rank == 0 and not agent,
        prefix=prefix,
        timeout=wait,
        store_timeout=timedelta(seconds=wait) if timeout else dist.distributed_c10d.default_pg_timeout,
    )
    return store if agent else dist.PrefixStore("default_pg", store)


# --------------------------------------------------------------------------------------------------
# init


def init(backend: str | None = None, timeout: float | None = None, hang_report: float | None = 60.0) -> None:
    """Initialize the default ``torch.distributed`` process group from the environment.

    Reads the ``env://`` variables that ``torchrun`` and ``python -m fshard.run`` set (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, and ``LOCAL_RANK`` which defaults to
    ``RANK``). If none of them is set, a 1-rank world (rank 0 of 1) is created on a free local
    port, so the same script also runs as plain ``python script.py``. Calling ``init`` when the
    default group already exists (second call, or inside `launch` / `RankPool`) does
    nothing.

    In a multi-rank world, a rank whose script ends with an uncaught exception exits at once
    with code 1 (after printing the traceback), without waiting for its peers, and records the
    exception in torchrun's error file: the launcher then stops the other ranks and names this
    one. A rank that finishes normally waits for the others to finish (up to 30 s, or half of
    ``timeout`` if that is shorter) before tearing the process group down.

    The ranks join on a rendezvous store (hosted by rank 0, or by torchrun) that records which
    job owns it (``TORCHELASTIC_RUN_ID`` and the world size): a rank that reaches another job's
    store (the same ``--master-port`` given to two jobs) raises at once rather than joining that
    job, which goes on undisturbed. Ctrl-C (SIGINT, SIGTERM) while a rank waits there for its
    peers ends it at once, saying why in one line.

    Under a launcher (torchrun, ``python -m fshard.run``), a rank whose launcher dies (killed
    with ``SIGKILL``, say) exits within half a second with code 1, saying so on stderr, instead
    of waiting, orphaned, in a collective until its timeout.

    Args:
        backend: ``"nccl"``, ``"gloo"``, ... Defaults to ``"nccl"`` when CUDA is available (the
            process is then bound to GPU ``LOCAL_RANK`` with ``torch.cuda.set_device``), else
            ``"gloo"``.
        timeout: collective / rendezvous timeout in seconds (torch's default, 30 minutes, when
            ``None``). It also applies to every process group a `Mesh` creates. When it ends a
            wait in an fshard collective, the rank raises `CollectiveError` naming the ranks that
            did not arrive (and where they are); the launcher names them too.
        hang_report: seconds a rank may wait in one fshard collective before it prints, once, a
            hang report on stderr: which ranks of the group have not arrived, the collective
            (op, axes, call site, sequence number) every rank is in or last finished, and the
            Python stacks of the missing ones (``None``: no report). Applied also when the
            default group already exists (inside `launch` / `RankPool`).

    Raises:
        FshardError: the environment is only partially configured, or holds non-integers, or
            ``timeout`` or ``hang_report`` is not a positive number; or the port belongs to another
            job, or the ranks did not all join within the rendezvous timeout (``timeout``, at
            least 300 s).

    Examples:
        >>> import torch, torch.distributed as dist
        >>> import fshard as fs
        >>> fs.init()                   # python -m fshard.run -n 4 this_script.py
        >>> t = torch.ones(1)
        >>> dist.all_reduce(t)          # t == world size
    """
    import torch
    import torch.distributed as dist

    timeout = check_timeout(timeout, "fshard.init()")
    hang_report = _check_hang_report(hang_report)
    if not dist.is_available():
        raise FshardError("torch.distributed is not available in this build of PyTorch")
    if dist.is_initialized():
        _start_watchdog(hang_report)
        return
    names = (*REQUIRED_ENV, "LOCAL_RANK")
    present = {name: os.environ[name] for name in names if os.environ.get(name)}
    if not present:
        backend = backend or default_backend()
        store = dist.TCPStore(
            HOST, 0, 1, True, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT), wait_for_workers=False
        )
        init_process_group(backend, local_rank=0, timeout=timeout, store=store, rank=0, world_size=1)
        return
    missing = [name for name in REQUIRED_ENV if name not in present]
    if missing:
        raise FshardError(
            f"fshard.init(): environment variable(s) {', '.join(missing)} not set, while "
            f"{', '.join(sorted(present))} are: the distributed environment is only partially "
            "configured. Run the script under `python -m fshard.run -n N script.py` or "
            "`torchrun --nproc-per-node N script.py` (they set RANK, LOCAL_RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT), or unset all of them to run a single-rank world."
        )
    try:
        rank = int(present["RANK"])
        world_size = int(present["WORLD_SIZE"])
        int(present["MASTER_PORT"])
        local_rank = int(present.get("LOCAL_RANK", rank))
    except ValueError as exc:
        raise FshardError(f"fshard.init(): malformed distributed environment variable: {exc}") from exc
    if not 0 <= rank < world_size:
        raise FshardError(f"fshard.init(): RANK={rank} is not in [0, WORLD_SIZE={world_size})")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "nccl" in backend and "LOCAL_RANK" not in present:
        local_rank = rank % max(1, torch.cuda.device_count())
    _watch_launcher()
    _install_failure_hook()  # a rank refused by the rendezvous records why, for its launcher
    from . import _rendezvous

    where = f"{present['MASTER_ADDR']}:{present['MASTER_PORT']}"
    with _rendezvous.interruptible(rank, f"joining the job at {where}"):
        store = attempt_store(rank, world_size, timeout)
        init_process_group(
            backend, local_rank=local_rank, timeout=timeout, store=store, rank=rank, world_size=world_size
        )
    _start_watchdog(hang_report)
    # Half the collective timeout: a rank that left early (sys.exit(3)) while its peers wait for
    # it in a collective gives up on them before they give up on it, so it is seen to fail first.
    _exit.barrier_timeout = min(EXIT_BARRIER_TIMEOUT, timeout / 2) if timeout else EXIT_BARRIER_TIMEOUT
    atexit.register(_shutdown_at_exit)


def _watch_launcher() -> None:
    """End this rank when the launcher that started it dies.

    torchrun starts every rank in a session of its own, so a torchrun agent that is killed
    (``SIGKILL``, the out-of-memory killer) takes none of them along: they would wait, orphaned,
    in a rendezvous or a collective until its timeout, holding their devices and ports against
    the next attempt. Under a launcher (``TORCHELASTIC_RUN_ID`` set: torchrun, ``python -m
    fshard.run``, whose ranks the kernel also kills with the launcher) a daemon thread checks
    twice a second that the parent process is still the one that started this rank, and ends
    the rank with exit code 1, saying why on stderr, once it is not. Ranks started otherwise (by
    hand, by a scheduler) are left alone: a parent shell may exit while its ranks go on.
    """
    if _exit.watching or not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    _exit.watching = True
    parent = os.getppid()
    watch_parent(
        parent,
        f"fshard: rank {os.environ.get('RANK', '?')}: its launcher (process {parent}) has exited; ending this "
        f"rank, which would otherwise wait in its collectives until they time out",
        code=1,
    )


def watch_parent(parent: int, message: str | None, code: int) -> None:
    """Start a daemon thread that ends this process with ``code`` (printing ``message`` on stderr
    first, if any) once its parent is no longer process ``parent``; it looks twice a second."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                if message is not None:
                    sys.stderr.write(message + "\n")
                    sys.stderr.flush()
                os._exit(code)

    threading.Thread(target=watch, name="fshard-parent-watch", daemon=True).start()


def _check_hang_report(seconds: Any) -> float | None:
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise FshardError(
            f"fshard.init(): hang_report must be a positive number of seconds (or None for no report), "
            f"got {seconds!r}"
        )
    return float(seconds)


def _start_watchdog(hang_report: float | None) -> None:
    """Set the hang-report threshold and start this rank's watchdog (see ``fshard._watchdog``)."""
    from . import _watchdog

    _watchdog.configure(hang_report)


# --------------------------------------------------------------------------------------------------
# how a rank ends


class _ExitState:
    failed = False
    code = 1
    barrier_timeout = EXIT_BARRIER_TIMEOUT
    hooked = False
    watching = False  # the launcher watch runs (see `_watch_launcher`)
    linger = 0.0  # seconds to wait before exiting after a failure (see `_on_uncaught`)


_exit = _ExitState()


def _install_failure_hook() -> None:
    """Chain a ``sys.excepthook`` that marks this rank as failed (see `_on_uncaught`)."""
    if _exit.hooked:
        return
    _exit.hooked = True
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        interactive = bool(sys.flags.interactive) or hasattr(sys, "ps1")
        if not interactive and isinstance(exc, BaseException) and not isinstance(exc, SystemExit):
            _on_uncaught(exc, tb)
        previous(exc_type, exc, tb)
        if _exit.failed:
            _flush()

    sys.excepthook = excepthook


def _on_uncaught(exc: BaseException, tb: Any) -> None:
    """The script is ending with ``exc``: record it and make sure the process ends soon.

    Peers may be blocked in a collective with this rank; waiting for them at exit (the barrier of
    `_shutdown_at_exit`) would hang until the process-group timeout. The exception is written to
    the launcher's error file first (before this process closes its connections, hence before
    any peer fails because of it), marked secondary when it is itself a consequence of another
    rank failing.
    """
    _exit.failed = True
    _exit.code = 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        write_error_file(path, exc, tb, secondary=is_comm_error(exc))
    if getattr(exc, "fshard_blame", None) and _hosts_store():
        # A collective timed out and this rank hosts the rendezvous store (rank 0 under fshard.run):
        # the ranks of other groups, timing out about now, ask the others where they are through
        # it before they record which ranks did not arrive at theirs. Exiting at once took the
        # store away and left those ranks with gloo's bare timeout.
        _exit.linger = STORE_GRACE
    elif is_comm_error(exc) and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        # A consequence (a connection closed by a peer whose collective timed out) under torchrun,
        # whose agent stops every rank as soon as one exits: give that peer the time to ask where
        # everyone is and to raise the error naming the ranks that did not arrive.
        _exit.linger = CONSEQUENCE_GRACE
    # Interpreter shutdown joins non-daemon threads before the exit hooks run: bound it.
    threading.Thread(target=_exit_later, args=(EXIT_AFTER_ERROR,), daemon=True, name="fshard-exit").start()


def _hosts_store() -> bool:
    """Whether this rank hosts the rendezvous store (rank 0, unless the launcher hosts it)."""
    return os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)


def _exit_later(delay: float) -> None:
    time.sleep(delay)
    _exit_now(_exit.code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


def _exit_now(code: int) -> None:
    """End the process without interpreter teardown (where gloo's threads can abort it)."""
    if "logging" in sys.modules:
        try:
            sys.modules["logging"].shutdown()
        except Exception:
            pass
    _flush()
    os._exit(code)


def _shutdown_at_exit() -> None:
    """Tear the process groups down before the interpreter does.

    A bounded barrier first lets every rank finish its last collective; then the default group
    is destroyed (unless the script did it) and `release_groups` ends the groups' threads while
    the interpreter is still whole. A rank whose script raised skips all of it and exits at once
    (code 1; 130 after Ctrl-C).
    """
    if _exit.failed:
        time.sleep(_exit.linger)
        _exit_now(_exit.code)
    import torch.distributed as dist

    from . import _watchdog

    _watchdog.stop()  # before the barrier: no rank's watchdog polls a store whose host has left
    if dist.is_initialized():
        try:
            _exit_barrier(_exit.barrier_timeout)
        except Exception:  # a peer already failed: its launcher is ending every rank anyway
            pass
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    release_groups(EXIT_RELEASE_TIMEOUT)


def _exit_barrier(timeout: float) -> bool:
    """Wait (up to ``timeout`` s) until every rank has reached its exit; False on timeout.

    Counted on the rendezvous store rather than with a collective: a gloo barrier does not
    honour its timeout while a peer is blocked in another collective with this rank (a peer
    waiting for a rank that left with ``sys.exit(1)``, say), and the count needs no backend.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    if world == 1:
        return True
    store = dist.distributed_c10d._get_default_store()
    key = "fshard/exit-barrier"
    store.add(key, 1)
    deadline = time.monotonic() + timeout
    while store.add(key, 0) < world:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


# --------------------------------------------------------------------------------------------------
# ending the process groups' threads

# Callables registered by modules that keep process groups (``fshard._mesh``; this module cannot
# import them): each drops its module's references to groups and returns the groups it held.
_holders: list[Callable[[], list]] = []


def hold_groups(release: Callable[[], list]) -> None:
    """Register ``release``, which drops a module's references to process groups (at exit, or when
    a pool rank ends) and returns the groups it dropped."""
    if release not in _holders:
        _holders.append(release)


def release_groups(timeout: float) -> bool:
    """End the threads of every process group fshard kept, before interpreter shutdown; False when
    they did not end within ``timeout`` s.

    ``destroy_process_group`` forgets the groups but does not end a gloo group's threads (two
    workers and a transport loop per group): they end when the group object is freed, and
    fshard's meshes keep their groups (and the DeviceMesh's) alive. Left to interpreter shutdown,
    a worker that frees a finished collective's tensors while the interpreter is finalizing calls
    into Python, which ends the thread with ``pthread_exit``; unwinding through C++ ``noexcept``
    code then aborts the process ("terminate called without an active exception") after the
    script has finished. So the meshes drop their groups here (and torch's functions their
    default-argument copies of destroyed groups: `_drop_destroyed_defaults`), and the last references are freed
    on a helper thread (freeing a group joins its workers, which waits for its queued collectives)
    bounded by ``timeout``: a collective that a peer never joined cannot make the exit hang.
    """
    import gc

    from . import _watchdog

    _watchdog.stop(timeout=2.0)  # its store connection and thread end first
    held: list = []
    for release in _holders:
        try:
            held.extend(release())
        except Exception:
            pass
    with warnings.catch_warnings():  # reading torch.distributed's deprecated names warns
        warnings.simplefilter("ignore")
        _drop_destroyed_defaults()
    box = [held]
    del held

    def free() -> None:
        box.clear()  # the groups' last references: their destructors join their threads here
        gc.collect()

    thread = threading.Thread(target=free, daemon=True, name="fshard-release")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        try:
            sys.stderr.write(
                f"fshard: the process groups' threads did not end within {timeout:.0f} s at exit "
                "(a collective issued and never waited for, or one a peer never joined?)\n"
            )
        except Exception:
            pass
        return False
    return True


def _drop_destroyed_defaults() -> None:
    """Replace the destroyed process groups that torch.distributed's functions hold as default
    arguments by None.

    ``torch.distributed.nn.functional`` writes ``group=group.WORLD`` as default arguments; imported
    after the default group was made (``torch._dynamo`` imports it, and fshard imports
    ``torch._dynamo`` on first use, often after `fs.init`), its functions hold the world group, and
    its threads, into interpreter shutdown long after ``destroy_process_group``. To every c10d call
    None means the default group, so the functions mean what they meant; a group still in use
    (not destroyed) is left alone. Functions and methods of classes of ``torch.distributed``'s
    modules are scanned (a few milliseconds).
    """
    import types

    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        live = c10d._world.pg_map
        kind = dist.ProcessGroup
    except Exception:
        return

    def dead(v: object) -> bool:
        return isinstance(v, kind) and v not in live

    def scrub(fn: object) -> None:
        fn = getattr(fn, "__func__", fn)  # staticmethod, classmethod
        if not isinstance(fn, types.FunctionType):
            return
        if fn.__defaults__ and any(dead(v) for v in fn.__defaults__):
            fn.__defaults__ = tuple(None if dead(v) else v for v in fn.__defaults__)
        if fn.__kwdefaults__ and any(dead(v) for v in fn.__kwdefaults__.values()):
            fn.__kwdefaults__ = {k: None if dead(v) else v for k, v in fn.__kwdefaults__.items()}

    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torch.distributed" or name.startswith("torch.distributed.")):
            continue
        try:
            for value in list(vars(module).values()):
                if isinstance(value, type) and value.__module__ == name:
                    for member in list(vars(value).values()):
                        scrub(member)
                else:
                    scrub(value)
        except Exception:
            pass
