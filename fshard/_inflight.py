"""One collective in flight per gloo process group: each collective drains the ones before it.

torch's gloo backend (2.13, CPU) corrupts the heap when two collectives of one process group are
in flight and the first one waited for is an all-gather: ``malloc(): unaligned fastbin chunk
detected``, SIGSEGV or SIGABRT within a few thousand steps in plain torch (2 and 4 ranks: a
functional ``all_gather_into_tensor`` of a few elements, or ``dist.all_gather_into_tensor(...,
async_op=True)``, then a functional all-gather or all-reduce, each waited for right after both
were launched). In fshard it ended ``fs.fsdp_scan`` steps (a prefetched gather in flight while
the backward's reduce-scatter went out) about once in 15 runs of its test. In the same probes,
4,000 steps each, pairs of all-reduces, of reduce-scatters, of ``torch.distributed`` async
all-gathers, and an all-reduce or reduce-scatter waited before an all-gather did not crash; the
cause inside gloo is not known, so every collective is treated alike.

So on a gloo group, a collective launched and left in flight (``*_start``, the gradient
buckets) registers a *drain*, and the next collective issued over the same process group
(``_comm._issue``) first waits for every drain registered before it. The launch order, and so the
order on every rank, is unchanged; what goes is the overlap of one collective with another on
the same group (their overlap with compute stays: a collective is drained only when the next
one is issued). NCCL and other backends are left alone. A drain is dropped once its collective
was waited for the usual way (`Flight.done`), so it keeps no buffer alive.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from . import _state

__all__: list[str] = []

_compiling = torch.compiler.is_compiling
_PENDING: dict[str, list[Flight]] = {}  # process-group name -> drains of collectives in flight


class Flight:
    """The drain of one collective left in flight: ``drain()`` waits for it (once)."""

    __slots__ = ("_wait",)

    def __init__(self, wait: Callable[[], object]):
        self._wait: Callable[[], object] | None = wait

    def drain(self) -> None:
        wait, self._wait = self._wait, None
        if wait is not None:
            wait()

    def done(self) -> None:
        """Its collective was waited for: forget the wait (and the buffers it refers to)."""
        self._wait = None


def serial(g) -> bool:
    """Whether `AxisGroup` ``g``'s process group is a gloo group, whose collectives go one at a time
    (cached on ``g``, as ``g.real``: a table keyed by group would keep the group alive)."""
    hit = g.gloo
    if hit is None:
        try:
            hit = dist.get_backend(g.group) == "gloo"
        except (RuntimeError, ValueError):  # a group this rank is not in, or torn down
            hit = False
        g.gloo = hit
    return hit


def track(name: str, g, wait: Callable[[], object]) -> Flight | None:
    """Register ``wait`` as the drain of a collective just launched over `AxisGroup` ``g`` (process
    group ``name``) and left in flight; returns its `Flight` (None: not gloo, nothing to drain)."""
    if _compiling() or not serial(g):  # (traced collectives: their order is the graph's)
        return None
    f = Flight(wait)
    _PENDING.setdefault(name, []).append(f)
    return f


def drain(name: str) -> None:
    """Wait for every collective left in flight over process group ``name`` (before the next)."""
    pending = _PENDING.pop(name, None)
    if pending:
        for f in pending:
            f.drain()


@_state.job_state(order=30)
def forget() -> None:
    """Drop every drain (a pool rank between jobs: an earlier job's collectives are not waited for)."""
    _PENDING.clear()
