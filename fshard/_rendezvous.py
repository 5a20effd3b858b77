"""Joining a job's rendezvous store in `fs.init`: one job per store, and waits that end on Ctrl-C.

Two things could go wrong in ``torch.distributed``'s own ``env://`` rendezvous:

* a second job started on a port that a running job's store holds (``--master-port P`` twice)
  joined the running job: its non-zero ranks connected to the other job's store, took part in
  its gloo rendezvous and waited in their first collective until it timed out (30 minutes), with
  no "address in use" error anywhere. Here every job says who it is in its store (`job_identity`:
  the launcher's run id and the world size), and a rank whose job differs raises at once, naming
  the port, both jobs and the fix; the running job is only read from, never written to. Two
  copies of a job without a run id (started by hand) are told apart by their ranks: a rank that
  finds its own rank already joined raises the same way.
* a rank blocked inside C++ (the store's connect, gloo's wait for its peers) runs no Python
  signal handler, so Ctrl-C while rank 0 was slow to start left the other ranks waiting until
  their launcher killed them, silently. Here the waits are Python loops of short steps (a plain
  socket probe of the store's port, then non-blocking key checks), so SIGINT and SIGTERM end the
  rank at once, saying why in one line.

Nothing here imports torch at module level.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from ._errors import FshardError

JOB_KEY = "fshard/job"  # the job that owns the store: {"run_id": ..., "world_size": ...}
_RANK_KEY = "fshard/rank/{}"  # incremented by each rank that joins: 2 means a rank joined twice
_JOINED_KEY = "fshard/joined"  # how many ranks have joined
_ALL_JOINED_KEY = "fshard/all-joined"  # set by the last rank to join
_POLL = 0.05  # seconds between two looks at the store
_OWNER_WAIT = 10.0  # seconds a store that rank 0 hosts may take to say whose it is (it does at once)


class _Terminated(BaseException):
    """SIGTERM arrived while this rank waited in the rendezvous."""


def job_identity(world_size: int) -> dict[str, Any]:
    """Who this rank's job is: its launcher's run id (``TORCHELASTIC_RUN_ID``, which
    ``python -m fshard.run`` and torchrun set; None when the ranks were started by hand) and its
    world size."""
    return {"run_id": os.environ.get("TORCHELASTIC_RUN_ID") or None, "world_size": world_size}


def describe_job(job: dict[str, Any]) -> str:
    """``job 'fshard-1a2b3c' (2 ranks)``, or ``a job without a run id (2 ranks)``."""
    size = job.get("world_size")
    ranks = f"{size} rank{'s' if size != 1 else ''}"
    run_id = job.get("run_id")
    return f"job {run_id!r} ({ranks})" if run_id else f"a job without a run id ({ranks})"


def _fix(port: int) -> str:
    return (
        f"Another job is using port {port}. Give this job a port of its own (`python -m fshard.run "
        "--master-port` / `torchrun --master-port`, or MASTER_PORT), or leave the port out so that "
        "the launcher picks a free one"
    )


def join(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    *,
    hosts_store: bool,
    prefix: str | None,
    timeout: float,
    store_timeout: timedelta,
) -> Any:
    """Connect to (or, when ``hosts_store``, host) the rendezvous store at ``host:port``, check
    that it is this job's, and wait until every rank of the job has joined it; return the store
    (under ``prefix``, when given: the attempt's keys in a launcher's store).

    ``timeout``: seconds to wait for the store and for the other ranks. ``store_timeout``: the
    timeout of the store's own operations afterwards.

    Raises:
        FshardError: the port is taken by another process, the store belongs to another job, this
            rank already joined it, or the ranks did not all join within ``timeout``.
    """
    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    where = f"{host}:{port}"
    with interruptible(rank, f"waiting for the store at {where}"):
        if hosts_store:
            try:
                root = dist.TCPStore(
                    host,
                    port,
                    world_size,
                    True,
                    timeout=store_timeout,
                    wait_for_workers=False,
                    multi_tenant=True,
                )
            except RuntimeError as exc:
                if "EADDRINUSE" not in str(exc):
                    raise
                raise FshardError(
                    f"fshard.init(): rank {rank} cannot host the rendezvous store at {where}: the port is "
                    f"already in use. {_fix(port)}."
                ) from None
        else:
            _wait_for_listener(host, port, rank, deadline)
            # (not counted among the store's workers: a client of another job's store writes nothing)
            root = dist.TCPStore(host, port, world_size, False, timeout=store_timeout, wait_for_workers=False)
    store = dist.PrefixStore(prefix, root) if prefix else root
    mine = job_identity(world_size)
    with interruptible(rank, f"waiting for rank 0 to start the job at {where}"):
        if rank == 0:
            store.set(JOB_KEY, json.dumps(mine))
            if prefix:  # a launcher's store: say whose it is to ranks that look for it at the top
                root.set(JOB_KEY, json.dumps({**mine, "launcher_store": True}))
        else:
            # A store that rank 0 hosts holds the job's identity from the moment it listens.
            by = deadline if prefix else min(deadline, time.monotonic() + _OWNER_WAIT)
            if not _wait_for_key(store, JOB_KEY, by):
                if prefix:
                    raise FshardError(
                        f"fshard.init(): rank {rank} timed out after {timeout:g} s waiting for rank 0 to join "
                        f"at {where}: rank 0 did not call fs.init()"
                    )
                raise FshardError(
                    f"fshard.init(): rank {rank} of {describe_job(mine)} reached a rendezvous store at "
                    f"{where} that did not say which job owns it within {_OWNER_WAIT:g} s: it is not this "
                    f"job's (its rank 0 would have said so at once) but another program's, which "
                    f"does not join with fs.init; this rank did not join it. {_fix(port)}."
                )
            theirs = _decode(store.get(JOB_KEY))
            if theirs != mine:
                raise FshardError(
                    f"fshard.init(): rank {rank} of {describe_job(mine)} reached the rendezvous store at "
                    f"{where}, which belongs to {describe_job(theirs)}: this rank did not join it, and "
                    f"the other job goes on undisturbed. {_fix(port)}."
                )
    if store.add(_RANK_KEY.format(rank), 1) > 1:
        raise FshardError(
            f"fshard.init(): rank {rank} of {describe_job(mine)} reached the rendezvous store at {where}, "
            f"where a rank {rank} has already joined: two copies of the job were started on the same "
            f"port (by hand, or under one run id); this one did not join. {_fix(port)}."
        )
    with interruptible(rank, f"waiting for the other ranks to join at {where}"):
        if store.add(_JOINED_KEY, 1) == world_size:
            store.set(_ALL_JOINED_KEY, "1")
        if not _wait_for_key(store, _ALL_JOINED_KEY, deadline):
            missing = [r for r in range(world_size) if not store.check([_RANK_KEY.format(r)])]
            raise FshardError(
                f"fshard.init(): rank {rank} timed out after {timeout:g} s waiting for the other ranks to "
                f"join at {where}: rank{'s' if len(missing) != 1 else ''} {', '.join(map(str, missing))} "
                "did not"
            )
    return store


def _decode(raw: Any) -> dict[str, Any]:
    try:
        got = json.loads(bytes(raw).decode())
        return got if isinstance(got, dict) else {"run_id": str(got)}
    except (ValueError, TypeError):
        return {"run_id": repr(raw)}


def _wait_for_listener(host: str, port: int, rank: int, deadline: float) -> None:
    """Wait until something listens on ``host:port`` (a quiet probe; the store's own connect
    retries inside C++, unseen by signals, and logs every failed attempt)."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except socket.gaierror:
            raise
        except OSError:  # refused (not listening yet), unreachable, timed out: try again
            pass
        if time.monotonic() >= deadline:
            raise FshardError(
                f"fshard.init(): rank {rank} found no rendezvous store at {host}:{port} (hosted by rank 0) "
                f"within the rendezvous timeout: rank 0 did not start, or MASTER_ADDR/MASTER_PORT differ "
                f"between the ranks"
            )
        time.sleep(0.1)


def _wait_for_key(store: Any, key: str, deadline: float) -> bool:
    """Wait until ``key`` is in ``store``; False if it is not by ``deadline``."""
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL)
    return True


@contextlib.contextmanager
def interruptible(rank: int, what: str) -> Iterator[None]:
    """End the rank, with one line on stderr, when SIGINT or SIGTERM arrives during the block.

    SIGINT raises KeyboardInterrupt as usual; SIGTERM, left to its default action (the process
    ends silently), is turned into an exception for the length of the block.
    """
    installed = False
    main = threading.current_thread() is threading.main_thread()
    if main:
        previous = signal.getsignal(signal.SIGTERM)
        if previous == signal.SIG_DFL:

            def terminated(signum: int, frame: object) -> None:
                raise _Terminated

            signal.signal(signal.SIGTERM, terminated)
            installed = True
    try:
        yield
    except (KeyboardInterrupt, _Terminated) as exc:
        sig = signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT
        if main:  # a second signal must not cut the line short
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with contextlib.suppress(Exception):
            sys.stderr.write(f"fshard: rank {rank}: interrupted ({sig.name}) while {what}; ending\n")
            sys.stderr.flush()
        os._exit(128 + sig)
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
