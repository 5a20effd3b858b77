"""Local multi-process worlds: `RankPool` and `launch`.

* `launch` runs one function on ``nprocs`` freshly spawned local ranks and returns the
  per-rank results.
* `RankPool` keeps ``nprocs`` ranks alive so that many functions can run on the same world
  without paying the interpreter and ``import torch`` start-up each time (the test-suite uses it).

`launch` is a one-shot `RankPool`; both share the worker machinery below. Failures are
reported as `fshard._errors.RankError` carrying the failing rank and its remote traceback;
the surviving ranks are killed (SIGTERM, then SIGKILL) after a short grace period, so a rank that
is blocked in a collective waiting for a dead peer never hangs the caller. Inside the ranks,
every collective is also bounded by the process-group timeout (``collective_timeout``), a
backstop behind the parent's own timeout.

`init` (joining the world of ``torchrun`` / ``python -m fshard.run``) lives in ``fshard._env``
with the rest of the environment rules; it is re-exported here.
"""

from __future__ import annotations

import atexit
import faulthandler
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import multiprocessing.reduction as mp_reduction
import multiprocessing.util  # noqa: F401  (imported before our atexit hook so ours runs first)
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ._env import (
    EXIT_RELEASE_TIMEOUT,
    HOST,
    RENDEZVOUS_TIMEOUT,
    check_timeout,
    default_backend,
    describe_exit,
    init,
    init_process_group,
    is_comm_error,
    release_groups,
    torchrun_env,
    watch_parent,
)
from ._errors import FshardError, RankError

__all__ = ["init", "launch", "RankPool"]

_BACKSTOP = 300.0  # default process-group timeout inside pool ranks (s); RankPool.run's default is 120
_BACKSTOP_MARGIN = 10.0  # launch(timeout=T): the ranks' collectives time out at T + this, after the parent
_GRACE = 3.0  # seconds the other ranks get to finish after one rank failed
_SHUTDOWN_WAIT = 5.0  # seconds a graceful close waits before killing
_MAX_TEXT = 4000  # truncation of remote texts embedded in messages
_DEFAULT = object()  # "use the module default" (read when called, so tests may lower it)


def _truncate(text: str, limit: int = _MAX_TEXT) -> str:
    if len(text) <= limit:
        return text
    return "...[truncated]...\n" + text[-limit:]


# --------------------------------------------------------------------------------------------------
# worker side (runs in the spawned processes)

_stack_file = None  # kept alive: faulthandler writes into it


def _error_message(exc: BaseException) -> tuple:
    summary = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return ("err", summary, traceback.format_exc(), is_comm_error(exc))


def _reread_environment() -> None:
    """Settings fshard reads from the environment when it is imported, read again (a forked rank
    imported fshard with the fork server's environment, before it took its owner's)."""
    from . import _debug, _watchdog  # not at the top: fs.init comes from here, and these import torch

    fresh = _watchdog._State()
    _watchdog.S.check, _watchdog.S.tags, _watchdog.S.gather_tags = fresh.check, fresh.tags, fresh.gather_tags
    _debug.enabled = fresh.check


def _run_job(data: bytes) -> bytes:
    """Unpickle ``(fn, args, kwargs)``, call it, and return the pickled reply."""
    try:
        from . import _state

        # Every rank starts the job in step (collective sequence numbers from 1), outside any
        # shard_map (no tracking mode), with nothing an earlier job left in flight or pending:
        # the resets the modules registered beside their state (`_state`).
        _state.new_job()
        fn, args, kwargs = pickle.loads(data)
        return pickle.dumps(("ok", fn(*args, **kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # SystemExit too: a rank must always answer
        return pickle.dumps(_error_message(exc))


def _worker_main(rank: int, cfg: dict, conn: mp_connection.Connection) -> None:
    """Body of one pool rank: init the process group, then run jobs until told to stop."""
    global _stack_file
    if "env" in cfg:  # forked from the fork server: its parent is the server, which ends with the owner
        os.environ.clear()
        os.environ.update(cfg["env"])
        _reread_environment()
        for ours, fd in zip(cfg["stdio"], (1, 2)):
            if ours is not None:
                os.dup2(ours, fd)
                os.close(ours)
    watch_parent(os.getppid() if "env" in cfg else cfg["ppid"], None, code=70)  # the pool's owner is gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills us
    try:
        _stack_file = open(os.path.join(cfg["stack_dir"], f"rank{rank}.txt"), "w")  # noqa: SIM115
        faulthandler.enable(file=_stack_file, all_threads=True)
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    except OSError:  # pragma: no cover - diagnostics only
        pass
    nprocs = cfg["nprocs"]
    # The parent hosts the store: env:// ranks are its clients.
    os.environ.update(torchrun_env(rank, nprocs, cfg["port"], agent_store=True))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(cfg["threads"])
        store = dist.TCPStore(HOST, cfg["port"], nprocs, False, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT))
        init_process_group(
            cfg["backend"],
            local_rank=rank,
            timeout=cfg["collective_timeout"],
            store=store,
            rank=rank,
            world_size=nprocs,
        )
        from . import _watchdog

        _watchdog.ensure_started()  # answers hang reports, including while a job runs outside fshard
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
        release_groups(EXIT_RELEASE_TIMEOUT)  # the groups' threads end before interpreter shutdown


# --------------------------------------------------------------------------------------------------
# parent side

_LIVE_WORLDS: weakref.WeakSet[_World] = weakref.WeakSet()

# Environment variables read when torch is imported (or that change how it loads): a fork server
# whose environment differs from ours in one of these cannot start our ranks.
_IMPORT_TIME_ENV = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "CUDA", "LD_", "PYTHON", "NCCL", "GLOO")


class _ForkServer:
    """Ranks forked from a server process that has imported torch once: a rank starts in a fraction
    of a second instead of paying ``import torch`` (seconds on a busy machine) each time."""

    env: dict[str, str] | None = None  # our environment when the server started (it keeps it)


class _OurFd:
    """One of our file descriptors, as the forked rank's copy of it (sent through the fork server)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        try:
            os.fstat(self.fd)
        except OSError:  # closed here: the rank keeps the server's
            return (_no_fd, ())
        return (_detach, (mp_reduction.DupFd(self.fd),))


def _no_fd() -> None:
    return None


def _detach(dup) -> int:
    return dup.detach()


def _import_env(env) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME_ENV)}


def _context():
    """The multiprocessing context that starts ranks: the fork server where there is one and it
    can (``FSHARD_RANK_START=spawn`` turns it off), else ``spawn``."""
    if os.environ.get("FSHARD_RANK_START", "forkserver") == "spawn" or not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    if _ForkServer.env is None:
        _ForkServer.env = _import_env(os.environ)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
    elif _ForkServer.env != _import_env(os.environ):
        return mp.get_context("spawn")
    return mp.get_context("forkserver")


class _Failure:
    __slots__ = ("rank", "what", "traceback", "secondary", "seq")

    def __init__(self, rank: int, what: str, tb: str, secondary: bool, seq: int):
        self.rank, self.what, self.traceback, self.secondary, self.seq = rank, what, tb, secondary, seq


class _World:
    """``nprocs`` spawned ranks, their pipes, and the TCP store (hosted here) they rendezvous on."""

    def __init__(self, nprocs: int, backend: str, threads: int, collective_timeout: float | None):
        import torch.distributed as dist

        self.nprocs = nprocs
        self.ready = False
        self.procs: list = []
        self.conns: list = []
        self.stack_dir = tempfile.mkdtemp(prefix="fshard-ranks-")
        # Hosting the store here (bound to port 0, so no port race) lets every rank be a client.
        self.store = dist.TCPStore(
            HOST, 0, None, True, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT), wait_for_workers=False
        )
        cfg = dict(
            nprocs=nprocs,
            backend=backend,
            threads=threads,
            collective_timeout=collective_timeout,
            port=self.store.port,
            ppid=os.getpid(),
            stack_dir=self.stack_dir,
        )
        ctx = _context()
        if ctx.get_start_method() != "spawn":  # a forked rank has the fork server's environment and
            cfg["env"] = dict(os.environ)  # output streams: it takes ours, as a spawned rank would
            cfg["stdio"] = (_OurFd(1), _OurFd(2))
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

    The ranks are started when the pool is created: on Linux they are forked from a server process
    that imported torch once (multiprocessing's ``"forkserver"``, so a rank starts in a fraction of
    a second), with this process's environment, ``sys.path`` and output streams, as a spawned rank
    would have; elsewhere, or with ``FSHARD_RANK_START=spawn``, or when a variable torch reads at
    import (``TORCH*``, ``OMP_*``, ...) changed since the server started, they are spawned. Each sets
    ``torch.set_num_threads(threads)``, joins the default process group once (backend ``gloo`` on
    CPU, ``nccl`` with GPU ``rank`` when there are at least ``nprocs`` GPUs), and then serves
    jobs. `run` sends ``fn(*args, **kwargs)`` to every rank and returns the results in rank order.

    Two timeouts bound a job. `run`'s ``timeout`` is enforced by the caller's process: the ranks
    still running are killed and the error shows their Python stacks. ``collective_timeout`` is
    the process-group timeout inside the ranks (also given to the groups a `Mesh` creates there):
    a single collective waiting longer than that fails in the rank itself. Keep it above the
    ``timeout`` of your `run` calls, so that a slow but legitimate job is not cut short by it.

    If a rank raises or dies, the other ranks get a grace period of a few seconds to finish, are then
    killed (SIGTERM, then SIGKILL), and `fshard._errors.RankError` is raised; the pool is
    rebuilt transparently by the next `run`. Jobs must not leave collectives pending; each job
    starts outside any ``shard_map`` call, with collective sequence numbers from 1. Not
    thread-safe: one `run` at a time.

    Args:
        nprocs: number of ranks (world size).
        backend: process-group backend; ``None`` picks ``"nccl"`` if CUDA has ``>= nprocs`` devices,
            else ``"gloo"``.
        threads: intra-op threads per rank (``torch.set_num_threads``).
        grace: seconds the other ranks get to finish after a rank failed, before being killed.
        collective_timeout: process-group timeout inside the ranks, in seconds (default 300;
            ``None``: torch's default, 30 minutes).

    Raises:
        FshardError: ``nprocs`` or ``collective_timeout`` is not a positive number, or a backend
            needs more GPUs than there are.

    Examples:
        >>> import torch.distributed as dist
        >>> def whoami():                       # module level, so it pickles by reference
        ...     return dist.get_rank()
        >>> with fs.RankPool(2) as pool:
        ...     pool.run(whoami)
        [0, 1]
    """

    def __init__(
        self,
        nprocs: int,
        *,
        backend: str | None = None,
        threads: int = 1,
        grace: float = _GRACE,
        collective_timeout: Any = _DEFAULT,
    ):
        if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
            raise FshardError(f"nprocs must be a positive integer, got {nprocs!r}")
        if collective_timeout is _DEFAULT:
            collective_timeout = _BACKSTOP
        collective_timeout = check_timeout(collective_timeout, "fs.RankPool(collective_timeout=...)")
        if backend is None:
            backend = default_backend(nprocs)
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
        self.collective_timeout = collective_timeout
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
        world = _World(self.nprocs, self.backend, self.threads, self.collective_timeout)
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
                (``None``: no bound). One collective inside ``fn`` is also bounded by the pool's
                ``collective_timeout``.
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
        return self._run(fn, args, kwargs, check_timeout(timeout, "RankPool.run()"))

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
                    what = f"{describe_exit(msg[1])} without returning a result"
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
    timeout: float | None = 300,
    backend: str | None = None,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` freshly spawned local ranks.

    Each rank is a new process (started as `RankPool` starts its ranks) that joins the default
    process group (``gloo`` on CPU; ``nccl`` with one GPU per rank when CUDA has ``>= nprocs`` devices), runs
    ``fn``, and destroys the group. This is a one-shot `RankPool` (one thread per rank), so
    the same rules apply: ``fn`` must be a module-level function, and arguments and results must
    pickle. If the caller is a script, guard its entry point with ``if __name__ == "__main__":``
    because new ranks re-import the main module.

    ``timeout`` bounds the call end to end: the ranks' process groups get a slightly longer
    timeout (``timeout`` + 10 s), so a collective may legitimately wait for a slow peer as long
    as the call allows, and a hang is reported by this process with the ranks' stacks.

    Args:
        fn: the function every rank runs.
        nprocs: number of ranks.
        args: positional arguments for ``fn``.
        kwargs: keyword arguments for ``fn``.
        timeout: bound in seconds on the whole call (start-up included); ``None``: no bound
            (collectives then use torch's default timeout, 30 minutes).
        backend: process-group backend; ``None`` chooses as described above.

    Returns:
        The per-rank return values, in rank order.

    Raises:
        RankError: a rank raised (its rank and remote traceback are in the message), died without
            raising (exit code), or the call timed out; the remaining ranks are killed within a few
            seconds, even if they are blocked in a collective.
        FshardError: ``nprocs`` or ``timeout`` is not a positive number.

    Examples:
        >>> import torch, torch.distributed as dist
        >>> def rank_sum():
        ...     t = torch.tensor([dist.get_rank()])
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> fs.launch(rank_sum, 4)
        [6, 6, 6, 6]
    """
    timeout = check_timeout(timeout, "fs.launch()")
    collective_timeout = None if timeout is None else timeout + _BACKSTOP_MARGIN
    with RankPool(nprocs, backend=backend, collective_timeout=collective_timeout) as pool:
        return pool._run(fn, tuple(args), dict(kwargs or {}), timeout)
