"""Shared test helpers: persistent rank pools, one per world size.

Spawning ranks costs an interpreter start plus ``import torch`` per rank, so multi-rank tests share
one :class:`~fshard._launch.RankPool` per world size for the whole session::

    def _my_rank_fn(x):                      # module level: ranks import it by reference
        import torch.distributed as dist
        return dist.get_rank() * x

    def test_something(ranks):               # or: from tests.conftest import run_ranks
        assert ranks(2, _my_rank_fn, 10) == [0, 10]

A failing job raises :class:`~fshard._errors.RankError`; its pool restarts on the next call. Jobs
must not leave collectives pending.
"""

from __future__ import annotations

import atexit
import sys
import threading
from pathlib import Path

import pytest

# Spawned ranks inherit sys.path at spawn time: make the repo root (which holds `fshard` and the
# `tests` package) importable there whatever the invocation (`python3 -m pytest`, `pytest`, IDE).
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from fshard._launch import RankPool  # noqa: E402

_POOLS: dict[int, RankPool] = {}


def run_ranks(n: int, fn, *args, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on the cached ``n``-rank pool; return the per-rank results.

    ``timeout=`` (seconds) is consumed by the pool, not passed to ``fn``. Its default, 90 s, is
    below pytest-timeout's 120 s so that a hang is reported as a RankError with the ranks' stacks.
    """
    kwargs.setdefault("timeout", 90)
    pool = _POOLS.get(n)
    if pool is None:
        pool = _POOLS[n] = RankPool(n)
    return pool.run(fn, *args, **kwargs)


def close_pools() -> None:
    """Close every cached pool (idempotent), all at once: each close waits for its ranks to exit."""
    pools = list(_POOLS.values())
    _POOLS.clear()
    threads = []
    for pool in pools:
        thread = threading.Thread(target=pool.close, name=f"close-{pool.nprocs}-rank-pool")
        try:
            thread.start()
        except RuntimeError:  # at interpreter shutdown (the atexit fallback), new threads are refused
            pool.close()
        else:
            threads.append(thread)
    for thread in threads:
        thread.join()


atexit.register(close_pools)


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """Close the cached pools at the end of the session."""
    yield
    close_pools()


@pytest.fixture
def ranks():
    """The :func:`run_ranks` helper: ``ranks(n, fn, *args, **kwargs) -> list``."""
    return run_ranks
