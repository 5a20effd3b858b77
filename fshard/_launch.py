"""Process-group setup and local multi-process launching.

Three entry points:

* `init` joins (or creates) the default ``torch.distributed`` process group from the
  environment that ``torchrun`` / ``python -m fshard.run`` set, or makes a 1-rank world.
* `launch` runs one function on ``nprocs`` freshly spawned local ranks and returns the
  per-rank results.
* `RankPool` keeps ``nprocs`` ranks alive so that many functions can run on the same world
  without paying the interpreter and ``import torch`` start-up each time (the test-suite uses it).

`launch` is a one-shot `RankPool`; both share the worker machinery below. Failures are
reported as `fshard._errors.RankError` carrying the failing rank and its remote traceback;
the surviving ranks are killed (SIGTERM, then SIGKILL) after a short grace period, so a rank that
is blocked in a collective waiting for a dead peer never hangs the caller.
"""

from __future__ import annotations

import atexit
import errno
import faulthandler
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import multiprocessing.util  # noqa: F401  (imported before our atexit hook so ours runs first)
import os
import pickle
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ._errors import FshardError, RankError

__all__ = ["init", "launch", "RankPool"]

_HOST = "127.0.0.1"
_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_WORKER_PG_TIMEOUT = 60.0  # gloo/NCCL timeout inside pool workers: a backstop, the parent kills earlier
_GRACE = 3.0  # seconds the other ranks get to finish after one rank failed
_SHUTDOWN_WAIT = 5.0  # seconds a graceful close waits before killing
_MAX_TEXT = 4000  # truncation of remote texts embedded in messages


# --------------------------------------------------------------------------------------------------
# helpers


def _free_port(host: str = _HOST) -> int:
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


def _default_backend(nprocs: int = 1) -> str:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs:
        return "nccl"
    return "gloo"


def _init_process_group(
    backend: str,
    *,
    local_rank: int,
    timeout: float | None,
    store: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timedelta(seconds=timeout)
    if "nccl" in backend:
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world_size)
    else:
        kwargs["init_method"] = "env://"
    dist.init_process_group(backend, **kwargs)


def _truncate(text: str, limit: int = _MAX_TEXT) -> str:
    if len(text) <= limit:
        return text
    return "...[truncated]...\n" + text[-limit:]


def _exit_description(code: int | None) -> str:
    if code is None:
        return "disappeared"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with exit code {code}"


# --------------------------------------------------------------------------------------------------
# init


def init(backend: str | None = None, timeout: float | None = None) -> None:
    """Initialize the default ``torch.distributed`` process group from the environment.

    Reads the ``env://`` variables that ``torchrun`` and ``python -m fshard.run`` set (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, and ``LOCAL_RANK`` which defaults to
    ``RANK``). If none of them is set, a 1-rank world (rank 0 of 1) is created on a free local
    port, so the same script also runs as plain ``python script.py``. Calling ``init`` when the
    default group already exists (second call, or inside `launch` / `RankPool`) does
    nothing.

    Args:
        backend: ``"nccl"``, ``"gloo"``, ... Defaults to ``"nccl"`` when CUDA is available (the
            process is then bound to GPU ``LOCAL_RANK`` with ``torch.cuda.set_device``), else
            ``"gloo"``.
        timeout: collective / rendezvous timeout in seconds (torch's default when ``None``).

    Raises:
        FshardError: the environment is only partially configured, or holds non-integers.

    Examples:
        >>> import torch, torch.distributed as dist
        >>> import fshard as fs
        >>> fs.init()                   # python -m fshard.run -n 4 this_script.py
        >>> t = torch.ones(1)
        >>> dist.all_reduce(t)          # t == world size
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise FshardError("torch.distributed is not available in this build of PyTorch")
    if dist.is_initialized():
        return
    names = (*_REQUIRED_ENV, "LOCAL_RANK")
    present = {name: os.environ[name] for name in names if os.environ.get(name)}
    if not present:
        backend = backend or _default_backend()
        store = dist.TCPStore(
            _HOST, 0, 1, True, timeout=timedelta(seconds=timeout or 300), wait_for_workers=False
        )
        _init_process_group(backend, local_rank=0, timeout=timeout, store=store, rank=0, world_size=1)
        return
    missing = [name for name in _REQUIRED_ENV if name not in present]
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
    _init_process_group(backend, local_rank=local_rank, timeout=timeout)
    atexit.register(_shutdown_at_exit)


def _shutdown_at_exit() -> None:
    """Tear the process group down before the interpreter does.

    Left to interpreter teardown, a gloo group whose peers are still closing their connections
    can abort the process ("terminate called without an active exception") after the script
    has finished. A bounded barrier first lets every rank finish its last collective.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
            dist.monitored_barrier(timeout=timedelta(seconds=30))
        else:
            dist.barrier()
    except Exception:  # a peer already failed: its launcher is ending every rank anyway
        pass
    try:
        dist.destroy_process_group()
    except Exception:
        pass


# --------------------------------------------------------------------------------------------------
# worker side (runs in the spawned processes)

_stack_file = None  # kept alive: faulthandler writes into it


def _watch_parent(ppid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            os._exit(70)


# gloo raises plain RuntimeErrors; these texts mark a failure caused by another rank.
_COMM_ERROR_MARKERS = (
    "gloo/transport/",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket Timeout",
    "Timed out waiting",
)


def _is_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a consequence of another rank failing (not a root cause)."""
    try:
        import torch.distributed as dist

        if isinstance(exc, dist.DistError):
            return True
    except Exception:  # pragma: no cover
        pass
    text = str(exc)
    return any(marker in text for marker in _COMM_ERROR_MARKERS)


def _error_message(exc: BaseException) -> tuple:
    summary = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return ("err", summary, traceback.format_exc(), _is_comm_error(exc))


def _run_job(data: bytes) -> bytes:
    """Unpickle ``(fn, args, kwargs)``, call it, and return the pickled reply."""
    try:
        fn, args, kwargs = pickle.loads(data)
        return pickle.dumps(("ok", fn(*args, **kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # SystemExit too: a rank must always answer
        return pickle.dumps(_error_message(exc))


def _worker_main(rank: int, cfg: dict, conn: mp_connection.Connection) -> None:
    """Body of one pool rank: init the process group, then run jobs until told to stop."""
    global _stack_file
    threading.Thread(target=_watch_parent, args=(cfg["ppid"],), daemon=True, name="fshard-ppid").start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills us
    try:
        _stack_file = open(os.path.join(cfg["stack_dir"], f"rank{rank}.txt"), "w")  # noqa: SIM115
        faulthandler.enable(file=_stack_file, all_threads=True)
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    except OSError:  # pragma: no cover - diagnostics only
        pass
    nprocs = cfg["nprocs"]
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0",
        MASTER_ADDR=_HOST,
        MASTER_PORT=str(cfg["port"]),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the parent hosts the store: env:// ranks are clients
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(cfg["threads"])
        store = dist.TCPStore(
            _HOST, cfg["port"], nprocs, False, timeout=timedelta(seconds=_WORKER_PG_TIMEOUT)
        )
        _init_process_group(
            cfg["backend"],
            local_rank=rank,
            timeout=_WORKER_PG_TIMEOUT,
            store=store,
            rank=rank,
            world_size=nprocs,
        )
        conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    except BaseException as exc:
        conn.send_bytes(pickle.dumps(_error_message(exc)))
        return
    try:
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                break
            if not data:  # graceful shutdown
                break
            reply = _run_job(data)
            del data  # free the job's arguments while idle
            try:
                conn.send_bytes(reply)
            except OSError:  # parent gone
                break
            del reply
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


# --------------------------------------------------------------------------------------------------
# parent side

_LIVE_WORLDS: weakref.WeakSet[_World] = weakref.WeakSet()


class _Failure:
    __slots__ = ("rank", "what", "traceback", "secondary", "seq")

    def __init__(self, rank: int, what: str, tb: str, secondary: bool, seq: int):
        self.rank, self.what, self.traceback, self.secondary, self.seq = rank, what, tb, secondary, seq


class _World:
    """``nprocs`` spawned ranks, their pipes, and the TCP store (hosted here) they rendezvous on."""

    def __init__(self, nprocs: int, backend: str, threads: int):
        import torch.distributed as dist

        self.nprocs = nprocs
        self.ready = False
        self.procs: list = []
        self.conns: list = []
        self.stack_dir = tempfile.mkdtemp(prefix="fshard-ranks-")
        # Hosting the store here (bound to port 0, so no port race) lets every rank be a client.
        self.store = dist.TCPStore(
            _HOST, 0, None, True, timeout=timedelta(seconds=_WORKER_PG_TIMEOUT), wait_for_workers=False
        )
        cfg = dict(
            nprocs=nprocs,
            backend=backend,
            threads=threads,
            port=self.store.port,
            ppid=os.getpid(),
            stack_dir=self.stack_dir,
        )
        ctx = mp.get_context("spawn")
        _LIVE_WORLDS.add(self)
        try:
            for rank in range(nprocs):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_worker_main, args=(rank, cfg, child_conn), name=f"fshard-rank{rank}", daemon=False
                )
                self.conns.append(parent_conn)
                proc.start()
                self.procs.append(proc)
                child_conn.close()
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def stacks(self, ranks: list[int]) -> str:
        """Ask ``ranks`` to dump their Python stacks (SIGUSR1) and return the dumps."""
        if not hasattr(signal, "SIGUSR1"):
            return ""
        for rank in ranks:
            try:
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
            except (OSError, IndexError):
                pass
        time.sleep(0.5)
        return "".join(
            f"\n--- Python stacks of rank {rank} ---\n{_truncate(self.stack_text(rank), 3000)}"
            for rank in ranks
        )

    def stack_text(self, rank: int) -> str:
        try:
            with open(os.path.join(self.stack_dir, f"rank{rank}.txt")) as fh:
                return fh.read().strip()
        except OSError:
            return ""

    def shutdown(self, graceful: bool) -> None:
        """Stop all ranks (politely if ``graceful``, then SIGTERM, then SIGKILL) and free everything.

        Ranks that never reported ready are not idle, so they are terminated right away.
        """
        procs, conns = self.procs, self.conns
        self.procs, self.conns = [], []
        if graceful and self.ready:
            for conn in conns:
                try:
                    conn.send_bytes(b"")
                except (OSError, ValueError):
                    pass
            end = time.monotonic() + _SHUTDOWN_WAIT
            for proc in procs:
                proc.join(max(0.0, end - time.monotonic()))
        for sig_method, wait in (("terminate", 2.0), ("kill", 5.0)):
            alive = [p for p in procs if p.exitcode is None]
            if not alive:
                break
            for proc in alive:
                try:
                    getattr(proc, sig_method)()
                except (OSError, ValueError):
                    pass
            end = time.monotonic() + wait
            for proc in alive:
                proc.join(max(0.0, end - time.monotonic()))
        for conn in conns:
            conn.close()
        for proc in procs:
            try:
                proc.close()
            except ValueError:  # pragma: no cover - still running after SIGKILL (uninterruptible)
                pass
        self.store = None  # type: ignore[assignment]
        shutil.rmtree(self.stack_dir, ignore_errors=True)
        _LIVE_WORLDS.discard(self)


def _shutdown_all_worlds() -> None:
    for world in list(_LIVE_WORLDS):
        world.shutdown(graceful=True)


# Registered after multiprocessing.util's exit hook, hence runs before it (atexit is LIFO): the
# ranks are non-daemonic (so they may spawn children) and would otherwise be joined forever.
atexit.register(_shutdown_all_worlds)


class RankPool:
    """A persistent world of ``nprocs`` local ranks that runs functions on all ranks.

    The ranks are spawned (start method ``"spawn"``) when the pool is created; each one sets
    ``torch.set_num_threads(threads)``, joins the default process group once (backend ``gloo`` on
    CPU, ``nccl`` with GPU ``rank`` when there are at least ``nprocs`` GPUs; a 60 s collective
    timeout as a backstop), and then serves jobs. `run` sends ``fn(*args, **kwargs)`` to every
    rank and returns the results in rank order.

    If a rank raises or dies, the other ranks get a grace period of a few seconds to finish, are then
    killed (SIGTERM, then SIGKILL), and `fshard._errors.RankError` is raised; the pool is
    rebuilt transparently by the next `run`. Jobs must not leave collectives pending, since
    nothing is reset between jobs. Not thread-safe: one `run` at a time.

    Args:
        nprocs: number of ranks (world size).
        backend: process-group backend; ``None`` picks ``"nccl"`` if CUDA has ``>= nprocs`` devices,
            else ``"gloo"``.
        threads: intra-op threads per rank (``torch.set_num_threads``).
        grace: seconds the other ranks get to finish after a rank failed, before being killed.

    Examples:
        >>> import torch.distributed as dist
        >>> def whoami():                       # module level, so it pickles by reference
        ...     return dist.get_rank()
        >>> with fs.RankPool(2) as pool:
        ...     pool.run(whoami)
        [0, 1]
    """

    def __init__(self, nprocs: int, *, backend: str | None = None, threads: int = 1, grace: float = _GRACE):
        if not isinstance(nprocs, int) or nprocs < 1:
            raise FshardError(f"nprocs must be a positive integer, got {nprocs!r}")
        if backend is None:
            backend = _default_backend(nprocs)
        elif "nccl" in backend:
            import torch

            if torch.cuda.device_count() < nprocs:
                raise FshardError(
                    f"backend {backend!r} needs one GPU per rank: {nprocs} ranks but "
                    f"{torch.cuda.device_count()} visible GPU(s)"
                )
        self.nprocs = nprocs
        self.backend = backend
        self.threads = int(threads)
        self.grace = float(grace)
        self._closed = False
        self._world: _World | None = None
        self._finalizer: weakref.finalize | None = None
        self._start()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._world is not None else "stopped")
        return f"RankPool(nprocs={self.nprocs}, backend={self.backend!r}, {state})"

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start(self) -> _World:
        world = _World(self.nprocs, self.backend, self.threads)
        self._world = world
        self._finalizer = weakref.finalize(self, world.shutdown, True)
        self._finalizer.atexit = False  # _shutdown_all_worlds handles interpreter exit
        return world

    def _drop_world(self, graceful: bool) -> None:
        world, self._world = self._world, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if world is not None:
            world.shutdown(graceful=graceful)

    def close(self) -> None:
        """Stop the ranks (they destroy their process group and exit). Idempotent.

        Examples:
            >>> pool = fs.RankPool(2)
            >>> pool.close()
        """
        self._closed = True
        self._drop_world(graceful=True)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = 120, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank and return the per-rank results.

        ``fn``, the arguments and the results travel by pickle (``fn`` by reference: define it at
        module level in an importable module). Tensors are copied by value; CUDA tensors come back
        on their CUDA device, so return ``.cpu()`` copies to keep the caller free of CUDA contexts.

        Args:
            fn: the function each rank runs.
            *args: positional arguments for ``fn``.
            timeout: bound in seconds on the whole call, including (re)starting the ranks
                (``None``: no bound).
            **kwargs: keyword arguments for ``fn`` (``timeout`` is taken by ``run`` itself).

        Returns:
            ``[result of rank 0, result of rank 1, ...]``.

        Raises:
            RankError: a rank raised (message and ``remote_traceback`` carry its traceback), died
                (exit code), or the call timed out (message names the ranks still running and
                includes their Python stacks). The pool restarts on the next call.
            FshardError: the pool is closed, or ``fn``/arguments cannot be pickled.

        Examples:
            >>> import torch, torch.distributed as dist
            >>> def total(x):
            ...     t = torch.tensor([x * (dist.get_rank() + 1)])
            ...     dist.all_reduce(t)
            ...     return t.item()
            >>> with fs.RankPool(2) as pool:
            ...     pool.run(total, 10)
            [30, 30]
        """
        return self._run(fn, args, kwargs, timeout)

    # internals ------------------------------------------------------------------------------------

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float | None) -> list:
        if self._closed:
            raise FshardError("this RankPool is closed")
        try:
            payload = pickle.dumps((fn, tuple(args), dict(kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise FshardError(
                f"cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments to the ranks: {exc}. "
                "Rank functions must be defined at module level of an importable module, "
                "and their arguments must be picklable."
            ) from exc
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        done = False
        try:
            world = self._world if self._world is not None else self._start()
            if not world.ready:
                _, failures, pending = self._gather(world, deadline)
                if failures or pending:
                    self._fail(world, failures, pending, timeout, starting=True)
                world.ready = True
            for conn in world.conns:
                try:
                    conn.send_bytes(payload)
                except OSError:  # that rank is dead: _gather reports it
                    pass
            results, failures, pending = self._gather(world, deadline)
            if failures or pending:
                self._fail(world, failures, pending, timeout, starting=False)
            done = True
            return results
        finally:
            if not done:  # failure, timeout, Ctrl-C...: the world's state is unknown, rebuild it
                self._drop_world(graceful=False)

    def _gather(self, world: _World, deadline: float) -> tuple[list, list[_Failure], list[int]]:
        """Collect one message per rank until all answered, the deadline, or a failure's grace ends."""
        n = world.nprocs
        pending = set(range(n))
        results: list = [None] * n
        failures: list[_Failure] = []
        grace_end = None
        while pending:
            now = time.monotonic()
            end = deadline if grace_end is None else min(deadline, grace_end)
            if now >= end:
                break
            owners: dict = {}
            for rank in pending:
                owners[world.conns[rank]] = rank
                owners[world.procs[rank].sentinel] = rank
            for obj in mp_connection.wait(list(owners), timeout=min(end - now, 60.0)):
                rank = owners[obj]
                if rank not in pending:
                    continue
                pending.discard(rank)
                msg = self._receive(world, rank)
                if msg[0] in ("ok", "ready"):
                    results[rank] = msg[1]
                    continue
                if msg[0] == "err":
                    _, summary, tb, secondary = msg
                    what = f"raised {summary}"
                else:  # ("died", exitcode)
                    tb, secondary = "", False
                    what = f"{_exit_description(msg[1])} without returning a result"
                    fatal = world.stack_text(rank)
                    if fatal:
                        tb = fatal
                failures.append(_Failure(rank, what, tb, secondary, len(failures)))
            if failures and grace_end is None:
                grace_end = time.monotonic() + self.grace
        return results, failures, sorted(pending)

    @staticmethod
    def _receive(world: _World, rank: int) -> tuple:
        conn, proc = world.conns[rank], world.procs[rank]
        try:
            if conn.poll():
                data = conn.recv_bytes()
            else:  # sentinel fired and nothing buffered
                raise EOFError
        except (EOFError, OSError):
            proc.join(2.0)
            return ("died", proc.exitcode)
        try:
            return pickle.loads(data)
        except Exception as exc:
            return (
                "err",
                f"{type(exc).__name__}: {exc}",
                "the parent could not unpickle this rank's result:\n" + traceback.format_exc(),
                False,
            )

    def _fail(
        self,
        world: _World,
        failures: list[_Failure],
        pending: list[int],
        timeout: float | None,
        starting: bool,
    ) -> None:
        n = world.nprocs
        phase = " while starting up" if starting else ""
        if not failures:
            stacks = world.stacks(pending)
            message = (
                f"timed out after {timeout:g} s{phase}: rank(s) {pending} (of {n}) were still running "
                f"and have been killed.{stacks}"
            )
            raise RankError(message, rank=None, remote_traceback=stacks)
        failures.sort(key=lambda f: (f.secondary, f.seq))
        first = failures[0]
        lines = [f"rank {first.rank} (of {n}) {first.what}{phase}"]
        for other in failures[1:]:
            lines.append(f"also: rank {other.rank} {_truncate(other.what, 300)}")
        if pending:
            lines.append(
                f"rank(s) {pending} were still running {self.grace:g} s after the failure "
                "and have been killed"
            )
        message = "\n".join(lines)
        if first.traceback:
            message += f"\n\nRemote traceback of rank {first.rank}:\n{_truncate(first.traceback)}"
        raise RankError(message, rank=first.rank, remote_traceback=first.traceback)


# --------------------------------------------------------------------------------------------------
# launch


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    timeout: float = 300,
    backend: str | None = None,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` freshly spawned local ranks.

    Each rank is a new process (start method ``"spawn"``) that joins the default process group
    (``gloo`` on CPU; ``nccl`` with one GPU per rank when CUDA has ``>= nprocs`` devices), runs
    ``fn``, and destroys the group. This is a one-shot `RankPool` (one thread per rank), so
    the same rules apply: ``fn`` must be a module-level function, and arguments and results must
    pickle. If the caller is a script, guard its entry point with ``if __name__ == "__main__":``
    because spawned ranks re-import the main module.

    Args:
        fn: the function every rank runs.
        nprocs: number of ranks.
        args: positional arguments for ``fn``.
        kwargs: keyword arguments for ``fn``.
        timeout: bound in seconds on the whole call (start-up included).
        backend: process-group backend; ``None`` chooses as described above.

    Returns:
        The per-rank return values, in rank order.

    Raises:
        RankError: a rank raised (its rank and remote traceback are in the message), died without
            raising (exit code), or the call timed out; the remaining ranks are killed within a few
            seconds, even if they are blocked in a collective.

    Examples:
        >>> import torch, torch.distributed as dist
        >>> def rank_sum():
        ...     t = torch.tensor([dist.get_rank()])
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> fs.launch(rank_sum, 4)
        [6, 6, 6, 6]
    """
    with RankPool(nprocs, backend=backend) as pool:
        return pool._run(fn, tuple(args), dict(kwargs or {}), timeout)
