"""Collective counting: `count_collectives` and what it records.

Every collective fshard issues is recorded here by `_comm` (forward and backward, eager and
traced); an ``fs.compile``'d graph counts its own collectives when it runs (``_graph_counts``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch

from . import _state
from ._mesh import AxisGroup

__all__ = ["count_collectives", "CollectiveCounts"]  # the public part; the rest is internal


@dataclass
class CollectiveCounts:
    """What `count_collectives` saw: one ``(kind, axes, nbytes)`` record per call.

    ``kind`` is one of ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
    ``ppermute``, ``broadcast``, ``scatter``, ``gather``, ``reduce``; ``axes`` is the tuple of
    mesh axes; ``nbytes`` is the size of the tensor each rank hands to the collective. A
    ``ppermute`` is point-to-point: a rank records the bytes it sends (0 if it only receives),
    and a rank that no pair involves issues nothing and records nothing. ``gather`` and
    ``reduce`` (results on one rank) are recorded only by the ranks that take part.

    Per-leaf ``fs.all_gather`` and ``fs.psum`` calls issued before their results are used run
    combined, as one collective (see the debugging page): ``records`` has what went on the wire,
    ``combined`` one ``(kind, axes, calls)`` record per combined collective, and ``calls`` the
    number of user calls in all.

    Examples:
        >>> with fs.count_collectives() as counts:
        ...     loss = step(params, batch)
        >>> counts.total, counts.calls   # 2 collectives on the wire for 7 calls
        (2, 7)
    """

    records: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)
    #: one ``(kind, axes, calls)`` record per combined collective: how many user calls (one leaf
    #: each) it carries; see fshard's docs on combining. Its collective is also in ``records``.
    combined: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Number of collectives issued."""
        return len(self.records)

    @property
    def bytes(self) -> int:
        """Bytes handed to collectives by this rank."""
        return sum(r[2] for r in self.records)

    def by_kind(self) -> Counter:
        """A Counter of ``(kind, axes)`` to number of calls."""
        return Counter((k, a) for k, a, _ in self.records)

    @property
    def calls(self) -> int:
        """Number of user calls the collectives carry: each combined collective counts the calls
        it combined, every other collective one."""
        return self.total + sum(n - 1 for _, _, n in self.combined)

    def __repr__(self) -> str:
        parts = [f"{k}{list(a)}: {n}" for (k, a), n in sorted(self.by_kind().items())]
        calls = self.calls
        more = f"; {calls} calls combined into {self.total}" if calls != self.total else ""
        return f"CollectiveCounts({', '.join(parts) or 'none'}; {self.bytes} bytes{more})"


_recorders: list[CollectiveCounts] = []
compiled_counted = False
"""True while an ``fs.compile``'d function runs with the inductor backend, whose graphs count their
collectives themselves (``_graph_counts``): traced code then does not look at `_recorders`."""


@_state.job_state(order=40)
def _reset() -> None:
    """A new job: no recorder an earlier job entered and never exited counts its collectives."""
    global compiled_counted
    _recorders.clear()
    compiled_counted = False


def counting_refused() -> bool:
    """While Dynamo traces: whether a count is running that the graph would not count (plain
    ``torch.compile``, or ``fs.compile`` with another backend than inductor)."""
    return not compiled_counted and bool(_recorders)


@contextlib.contextmanager
def count_collectives():
    """Count the collectives fshard issues inside the block, forward and backward.

    Calls of functions compiled with ``fs.compile`` (inductor backend) are counted too: the
    collectives of the graphs that run, after inductor's bucketing (``combined`` has each bucket
    of several user calls). A shard_map call traced by plain ``torch.compile``, or by
    ``fs.compile`` with another backend, inside the block raises a `TracingError`.

    Yields:
        CollectiveCounts: filled in as collectives run.

    Examples:
        >>> with fs.count_collectives() as counts:
        ...     loss = step(params, batch)
        ...     loss.backward()
        >>> counts.by_kind()
        Counter({('all_reduce', ('dp',)): 3})
    """
    rec = CollectiveCounts()
    _recorders.append(rec)
    try:
        yield rec
    finally:
        _recorders.remove(rec)


def record(kind: str, g: AxisGroup, t: torch.Tensor) -> None:
    if _recorders:
        item = (kind, g.names, t.numel() * t.element_size())
        for r in _recorders:
            r.records.append(item)


def record_traced(kind: str, g: AxisGroup, t: torch.Tensor) -> None:
    """`record` while Dynamo traces: under plain torch.compile the trace is where a count sees the
    call (Dynamo guards on the counts, so a call in a new count traces again); an ``fs.compile``'d
    graph counts its collectives itself when it runs (``_graph_counts``)."""
    if not compiled_counted:
        record(kind, g, t)


def record_combined(kind: str, g: AxisGroup, calls: int) -> None:
    """Note that the collective just recorded carries ``calls`` user calls (see `CollectiveCounts`)."""
    if _recorders and g.size > 1:
        item = (kind, g.names, calls)
        for r in _recorders:
            r.combined.append(item)


def record_world(kind: str, nbytes: int = 0) -> None:
    """Record a collective over the whole world made with ``torch.distributed`` directly."""
    for r in _recorders:
        r.records.append((kind, ("world",), nbytes))
