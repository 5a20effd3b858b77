"""Per-process state that belongs to one job, and the one place that resets it.

A rank of a pool (`_launch.RankPool`, the test suite's pools, ``fs.launch``) runs job after job in
one process. What a job leaves behind in fshard's modules must not reach the next one: collective
sequence numbers that would put the ranks out of step, a shard_map trace or torch-function mode an
exception left open, collectives left in flight, gradients ``fs.no_sync`` kept pending, a
``fs.count_collectives`` recorder never exited. Each module that keeps such state registers its
reset here, beside the state (``@job_state(order)``), and the pool calls `new_job` before each
job: one list, one call, instead of the launcher naming modules' globals.

What the user chose for the process is not job state and stays: the process group and meshes,
``fs.init``'s timeout, the ``FSHARD_*`` settings, plans cached per function.

Examples:
    >>> from fshard import _state
    >>> @_state.job_state(order=20)
    ... def _reset() -> None:
    ...     _LEFT.clear()
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["job_state", "new_job", "registered"]

_RESETS: list[tuple[int, int, str, Callable[[], object]]] = []


def job_state(order: int = 50) -> Callable[[Callable[[], object]], Callable[[], object]]:
    """Register the decorated function (no arguments) as a reset run by `new_job`: lower
    ``order`` first, then in registration order. Returns the function unchanged."""

    def register(fn: Callable[[], object]) -> Callable[[], object]:
        name = f"{fn.__module__}.{fn.__qualname__}"
        if all(entry[2] != name for entry in _RESETS):  # (a module reloaded registers once)
            _RESETS.append((order, len(_RESETS), name, fn))
            _RESETS.sort(key=lambda entry: entry[:2])
        return fn

    return register


def new_job() -> None:
    """Run every registered reset (a pool rank, before each job)."""
    for *_, fn in list(_RESETS):
        fn()


def registered() -> list[str]:
    """The registered resets, ``module.function``, in the order `new_job` runs them."""
    return [entry[2] for entry in _RESETS]
