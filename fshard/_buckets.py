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

import torch
import torch.distributed as dist

from . import _comm
from ._comm import untracked
from ._mesh import AxisGroup
from ._primitives import AllReduce, apply

__all__ = ["GradBoundary", "BoundaryState", "DEFAULT_BUCKET_MB"]

DEFAULT_BUCKET_MB = 25.0
"""Bucket size for gradient all-reduces, as DDP's default."""


class BoundaryState:
    """Per call: for each boundary input, the axis group its twin is summed over (or None)."""

    __slots__ = ("groups", "bucket_bytes")

    def __init__(self, n: int, bucket_mb: float):
        self.groups: list[AxisGroup | None] = [None] * n
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))


class GradBoundary(torch.autograd.Function):
    """Identity on n inputs, returning ``(visible_0, twin_0, visible_1, twin_1, ...)``."""

    @staticmethod
    def forward(state, *xs):
        with untracked():
            out = []
            for x in xs:
                out.append(x.view_as(x))
                out.append(x.view_as(x))
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
        for i in range(n):
            vis, twin = cts[2 * i], cts[2 * i + 1]
            g = state.groups[i]
            if twin is None or g is None:
                grads[i] = vis
                continue
            if torch.is_grad_enabled():  # create_graph: keep the reduction differentiable
                red = apply(AllReduce, twin, g)
                grads[i] = red if vis is None else vis + red
                continue
            pending.setdefault((g, twin.dtype, twin.device), []).append(i)
            grads[i] = vis
        if pending:
            with untracked():
                _reduce_buckets(pending, cts, grads, state.bucket_bytes)
        return (None, *grads)


def _reduce_buckets(pending: dict, cts, grads: list, bucket_bytes: int) -> None:
    """All-reduce each input's twin gradient in flat buckets; add it into ``grads``."""
    launched = []
    for (g, dtype, _device), idx in pending.items():
        bucket: list[int] = []
        size = 0
        itemsize = torch.empty((), dtype=dtype).element_size()
        for i in idx:
            nbytes = cts[2 * i + 1].numel() * itemsize
            if bucket and size + nbytes > bucket_bytes:
                launched.append(_launch(g, bucket, cts))
                bucket, size = [], 0
            bucket.append(i)
            size += nbytes
        if bucket:
            launched.append(_launch(g, bucket, cts))
    for work, flat, bucket in launched:
        if work is not None:
            work.wait()
        offset = 0
        for i in bucket:
            ct = cts[2 * i + 1]
            red = flat[offset : offset + ct.numel()].view(ct.shape)
            offset += ct.numel()
            vis = grads[i]
            grads[i] = red if vis is None else vis + red


def _launch(g: AxisGroup, bucket: list[int], cts):
    flat = torch.cat([cts[2 * i + 1].reshape(-1) for i in bucket])
    _comm._record("all_reduce", g, flat)
    work = dist.all_reduce(flat, group=g.group, async_op=True)  # type: ignore[arg-type]
    return work, flat, bucket
