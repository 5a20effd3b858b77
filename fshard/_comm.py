"""Raw communication on an `AxisGroup`, plus collective counting.

Every byte fshard moves goes through a function here, so `count_collectives` sees
all of it (forward and backward). These functions know nothing of autograd or of
varying-axes tracking; ``_collectives.py`` builds the differentiable primitives on them.
All of them run with torch-function handling disabled so that shard_map's tracking mode
does not see their internal tensor ops.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ._mesh import AxisGroup

__all__ = ["count_collectives", "CollectiveCounts"]  # the public part; the rest is internal


@dataclass
class CollectiveCounts:
    """What `count_collectives` saw: one ``(kind, axes, nbytes)`` record per call.

    ``kind`` is one of ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
    ``ppermute``, ``broadcast``, ``scatter``; ``axes`` is the tuple of mesh axes;
    ``nbytes`` is the size of the tensor each rank hands to the collective.
    """

    records: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)

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

    def __repr__(self) -> str:
        parts = [f"{k}{list(a)}: {n}" for (k, a), n in sorted(self.by_kind().items())]
        return f"CollectiveCounts({', '.join(parts) or 'none'}; {self.bytes} bytes)"


_recorders: list[CollectiveCounts] = []


@contextlib.contextmanager
def count_collectives():
    """Count the collectives fshard issues inside the block, forward and backward.

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


def _record(kind: str, g: AxisGroup, t: torch.Tensor) -> None:
    if _recorders:
        item = (kind, g.names, t.numel() * t.element_size())
        for r in _recorders:
            r.records.append(item)


untracked = torch._C.DisableTorchFunction
"""``with untracked():`` runs tensor ops unseen by shard_map's varying-axes tracking mode
(the one spelling of "disable torch function" in fshard)."""
# torch 2.13 renamed the flat-buffer collectives; keep the older names for older releases.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _to_blocks_order(t: torch.Tensor, g: AxisGroup, inverse: bool) -> torch.Tensor:
    """Reorder the leading block dim between axis order and group-rank order."""
    if g.order is None:
        return t
    order = g.order
    if inverse:  # axis index i lives at group rank order[i]: pick block order[i] for index i
        idx = torch.tensor(order, device=t.device)
    else:  # put the block of axis index i at position order[i]
        inv = [0] * len(order)
        for i, o in enumerate(order):
            inv[o] = i
        idx = torch.tensor(inv, device=t.device)
    return t.index_select(0, idx)


def all_reduce(t: torch.Tensor, g: AxisGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Out-of-place all-reduce of ``t`` over the group."""
    with untracked():
        out = t.clone(memory_format=torch.contiguous_format)
        if g.size > 1:
            _record("all_reduce", g, out)
            dist.all_reduce(out, op=op, group=g.group)
        return out


def all_gather_blocks(t: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Gather ``t`` from every index along the axes: returns ``[size, *t.shape]``."""
    with untracked():
        t = t.contiguous()
        if g.size == 1:
            return t.unsqueeze(0)
        out = torch.empty(g.size * t.numel(), dtype=t.dtype, device=t.device)
        _record("all_gather", g, t)
        _all_gather_flat(out, t.reshape(-1), group=g.group)
        return _to_blocks_order(out.view(g.size, *t.shape), g, inverse=True)


def reduce_scatter_blocks(t: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """``t`` is ``[size, *block]``; returns the sum over ranks of block ``index``."""
    with untracked():
        if g.size == 1:
            return t[0].clone()
        t = _to_blocks_order(t, g, inverse=False).contiguous()
        out = torch.empty(t[0].numel(), dtype=t.dtype, device=t.device)
        _record("reduce_scatter", g, t)
        _reduce_scatter_flat(out, t.reshape(-1), group=g.group)
        return out.view(t.shape[1:])


def all_to_all_blocks(t: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """``t`` is ``[size, *block]``: block j goes to index j; returns what each index sent, stacked."""
    with untracked():
        if g.size == 1:
            return t.clone()
        t = _to_blocks_order(t, g, inverse=False).contiguous()
        out = torch.empty_like(t)
        _record("all_to_all", g, t)
        dist.all_to_all_single(out, t, group=g.group)
        return _to_blocks_order(out, g, inverse=True)


def permute(t: torch.Tensor, g: AxisGroup, perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Send ``t`` from source index to destination index for each pair; others get zeros.

    Implemented as one ``all_to_all_single`` with zero-sized splits for non-pairs, which
    gloo and NCCL both support.
    """
    with untracked():
        me = g.index
        send_to = [d for s, d in perm if s == me]
        recv_from = [s for s, d in perm if d == me]
        if g.size == 1:
            return t.clone() if recv_from else torch.zeros_like(t)
        flat = t.contiguous().reshape(-1)
        n = flat.numel()
        in_splits = [0] * g.size
        out_splits = [0] * g.size
        order = g.order or range(g.size)
        for d in send_to:
            in_splits[order[d]] = n
        for s in recv_from:
            out_splits[order[s]] = n
        out = torch.empty(sum(out_splits), dtype=t.dtype, device=t.device)
        send = flat if send_to else flat[:0]
        _record("ppermute", g, send)
        dist.all_to_all_single(out, send, out_splits, in_splits, group=g.group)
        if not recv_from:
            return torch.zeros_like(t)
        return out.reshape(t.shape)


def broadcast(t: torch.Tensor, g: AxisGroup, src: int) -> torch.Tensor:
    """Every index along the axes receives index ``src``'s ``t``."""
    with untracked():
        out = t.clone(memory_format=torch.contiguous_format)
        if g.size > 1:
            _record("broadcast", g, out)
            dist.broadcast(out, src=g.global_ranks[src], group=g.group)  # type: ignore[arg-type]
        return out


def broadcast_object(objs: list, src: int) -> None:
    """``dist.broadcast_object_list`` over the world, counted as a broadcast."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        if _recorders:
            for r in _recorders:
                r.records.append(("broadcast", ("world",), 0))
        dist.broadcast_object_list(objs, src=src)


def scatter(out: torch.Tensor, blocks: list | None, src: int) -> None:
    """``dist.scatter`` over the world (one block per global rank), counted."""
    if _recorders:
        for r in _recorders:
            r.records.append(("scatter", ("world",), out.numel() * out.element_size()))
    dist.scatter(out, blocks, src=src)
