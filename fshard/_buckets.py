"""Bucketed gradient reductions for shard_map's inputs.

A parameter that is the same on every rank (invariant over an axis) and meets data that varies
over that axis is cast with ``pvary``, whose transpose is a ``psum`` of its gradient: one
all-reduce per parameter, each blocking, as the backward reaches it. This module batches them.

At the start of a call, every differentiable input whose block may be cast goes through one
`GradBoundary` node, which hands ``f`` a *visible* tensor and keeps a hidden *twin*. The tracking
mode uses the twin as the input's ``pvary`` (the identity), so the twin collects the unreduced
per-rank gradient of every varying use while the visible tensor collects the gradient of the
invariant uses. When backward reaches the boundary (once every use is done), it returns, per
input, ``grad(visible) + psum(grad(twin))``, with the psums grouped by (axes, dtype, device) into
flat buckets of at most ``bucket_mb`` MiB, launched back to back and waited together: one
all-reduce per bucket instead of one per parameter, with the same bytes.

Exact by linearity: the path from an input to its use is invariant, so summing before or after
it is the same. With ``create_graph=True`` the reductions stay differentiable (one `AllReduce`
per input); under ``torch.func`` transforms the boundary is not used.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from . import _comm
from ._comm import untracked
from ._mesh import AxisGroup
from ._primitives import AllReduce, _functorch_active, apply
from ._vma import tag

__all__ = ["GradBoundary", "BoundaryState", "DEFAULT_BUCKET_MB", "no_sync", "wrap"]

DEFAULT_BUCKET_MB = 25.0
"""Bucket size for gradient all-reduces, as DDP's default."""

_sync = True
# Unreduced gradients of leaf inputs from calls under `no_sync`: id(input) -> (weak reference to
# the input, axis group, sum). Keyed by id (tensors compare elementwise), dropped with the input.
_PENDING: dict = {}


def _take_pending(leaf):
    hit = _PENDING.get(id(leaf))
    if hit is None or hit[0]() is not leaf:
        return None
    del _PENDING[id(leaf)]
    return hit[1], hit[2]


def _add_pending(leaf, g, twin) -> None:
    hit = _take_pending(leaf)
    total = twin.detach().clone() if hit is None else hit[1] + twin.detach()
    key = id(leaf)
    if hit is None:
        weakref.finalize(leaf, _PENDING.pop, key, None)
    _PENDING[key] = (weakref.ref(leaf), g, total)


class no_sync:
    """Accumulate gradients over micro-batches without reducing them (DDP's ``no_sync``).

    Calls of shard_map'd functions made inside the block keep the data-parallel gradient
    reductions of their leaf inputs (parameters) pending: each backward adds this rank's
    unreduced gradient to a buffer per parameter (the invariant part of the gradient is
    accumulated as usual). The first call made outside the block reduces its own gradients
    together with everything pending, in the same buckets: one reduction for all the
    micro-batches, and ``p.grad`` is then exactly what one big batch gives.

    Examples:
        >>> with fs.no_sync():
        ...     for mb in batches[:-1]:
        ...         step(params, mb).backward()
        >>> step(params, batches[-1]).backward()      # reduces once, for all micro-batches
    """

    def __enter__(self) -> no_sync:
        global _sync
        self._saved = _sync
        _sync = False
        return self

    def __exit__(self, *exc) -> None:
        global _sync
        _sync = self._saved


class BoundaryState:
    """Per call: for each boundary input, the axis group its twin is summed over (or None),
    its dtype and whether it is a leaf (whose reduction `no_sync` may defer)."""

    __slots__ = ("groups", "bucket_bytes", "dtypes", "leaves", "defer", "param_dtype", "reduce_dtype")

    def __init__(self, xs, bucket_mb: float, param_dtype=None, reduce_dtype=None):
        n = len(xs)
        self.groups: list[AxisGroup | None] = [None] * n
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.dtypes = [x.dtype for x in xs]
        self.leaves = [x if x.is_leaf else None for x in xs]
        self.defer = not _sync
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype


class GradBoundary(torch.autograd.Function):
    """Identity on n inputs (or a cast to ``param_dtype``), returning ``(visible_0, twin_0, ...)``."""

    @staticmethod
    def forward(state, *xs):
        with untracked():
            out = []
            cast = state.param_dtype
            for x in xs:
                y = x.to(cast) if cast is not None and x.is_floating_point() and x.dtype != cast else x
                out.append(y.view_as(y))
                out.append(y.view_as(y))
            return tuple(out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.state = inputs[0]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *cts):
        state: BoundaryState = ctx.state
        n = len(state.groups)
        grads: list = [None] * n
        pending: dict = {}
        twins: list = [None] * n
        differentiable = torch.is_grad_enabled()
        for i in range(n):
            vis, twin = cts[2 * i], cts[2 * i + 1]
            g = state.groups[i]
            dtype = state.dtypes[i]
            grads[i] = None if vis is None else vis.to(dtype)
            if differentiable:  # create_graph: keep the reduction differentiable, nothing deferred
                if twin is not None and g is not None:
                    red = apply(AllReduce, twin, g).to(dtype)
                    grads[i] = red if grads[i] is None else grads[i] + red
                continue
            leaf = state.leaves[i]
            if twin is not None and g is not None:
                twin = twin.to(state.reduce_dtype or dtype)
            if state.defer and leaf is not None:
                if twin is not None and g is not None:
                    _add_pending(leaf, g, twin)
                continue
            hit = _take_pending(leaf) if leaf is not None and _PENDING else None
            if hit is not None:
                g = g if g is not None else hit[0]
                twin = hit[1] if twin is None or state.groups[i] is None else twin + hit[1]
            if twin is None or g is None:
                continue
            twins[i] = twin
            pending.setdefault((g, twin.dtype, twin.device), []).append(i)
        if pending:
            with untracked():
                _reduce_buckets(pending, twins, grads, state.dtypes, state.bucket_bytes)
        return (None, *grads)


def _reduce_buckets(pending: dict, twins: list, grads: list, dtypes: list, bucket_bytes: int) -> None:
    """All-reduce each input's twin gradient in flat buckets; add it into ``grads``."""
    launched = []
    for (g, dtype, _device), idx in pending.items():
        bucket: list[int] = []
        size = 0
        itemsize = torch.empty((), dtype=dtype).element_size()
        for i in idx:
            nbytes = twins[i].numel() * itemsize
            if bucket and size + nbytes > bucket_bytes:
                launched.append(_launch(g, bucket, twins))
                bucket, size = [], 0
            bucket.append(i)
            size += nbytes
        if bucket:
            launched.append(_launch(g, bucket, twins))
    for work, flat, bucket in launched:
        if work is not None:
            work.wait()
        offset = 0
        for i in bucket:
            ct = twins[i]
            red = flat[offset : offset + ct.numel()].view(ct.shape).to(dtypes[i])
            offset += ct.numel()
            vis = grads[i]
            grads[i] = red if vis is None else vis + red


def _launch(g: AxisGroup, bucket: list[int], twins: list):
    flat = torch.cat([twins[i].reshape(-1) for i in bucket])
    with _comm._issue("all_reduce", g, flat):  # counted, and labelled while profiling
        work = dist.all_reduce(flat, group=g.group, async_op=True)  # type: ignore[arg-type]
    return work, flat, bucket


def wrap(
    xs: list, masks: list[int], tr, all_bits: int, bucket_mb: float, cast=None, reduce_dtype=None
) -> list:
    """Put the tensors of ``xs`` (varying over ``masks``) that need a gradient and may meet more
    varying data behind one GradBoundary of trace ``tr``; cast floating ones to ``cast``.

    Returns the tensors for ``f`` (visible outputs, tagged like their inputs). Without
    ``bucket_mb`` (or under torch.func, or without grad) only the casts apply.
    """
    use = bucket_mb and torch.is_grad_enabled() and not _functorch_active()
    out = list(xs)
    idx = []
    for i, (x, m) in enumerate(zip(xs, masks)):
        if not isinstance(x, torch.Tensor):
            continue
        if use and x.requires_grad and m != all_bits:
            idx.append(i)
        elif cast is not None and x.is_floating_point() and x.dtype != cast:
            out[i] = x.to(cast)
            if m:
                tag(out[i], tr, m)
    if not idx:
        return out
    state = BoundaryState([xs[i] for i in idx], bucket_mb, cast, reduce_dtype)
    got = apply(GradBoundary, state, *[xs[i] for i in idx])
    for k, i in enumerate(idx):
        vis, twin = got[2 * k], got[2 * k + 1]
        if masks[i]:
            tag(vis, tr, masks[i])
        out[i] = vis
        tr.twins[id(vis)] = [vis, twin, k, state, None]
    return out
