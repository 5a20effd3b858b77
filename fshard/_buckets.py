"""Bucketed gradient reductions for shard_map's inputs.

A parameter that is the same on every rank (invariant over an axis) and meets data that varies
over that axis is cast with ``pvary``, whose transpose is a ``psum`` of its gradient: one
all-reduce per parameter, each blocking, as the backward reaches it. This module batches them.

At the start of a call, every differentiable input whose block may be cast goes through one
`GradBoundary` node, which hands ``f`` a *visible* tensor and keeps a hidden *twin*. The tracking
mode uses the twin as the input's ``pvary`` (the identity), so the twin collects the unreduced
per-rank gradient of every varying use while the visible tensor collects the gradient of the
invariant uses. Backward returns, per input, ``grad(visible) + psum(grad(twin))``, with the psums
grouped into flat buckets: one all-reduce per bucket instead of one per parameter, the same bytes.

The buckets are filled, and launched, while the backward runs (as DDP does). The twin ``f`` sees
is a `TwinTap` of the hidden one, made when the input is first cast (``_vma._twin_of``), just
before its first varying use: the autograd engine runs ready nodes latest-created first, so the
tap's backward runs as soon as the gradient of every use is in (made up front, every tap would
wait for the end of the backward). It puts the gradient, cast to ``reduce_dtype``, in the open
bucket of its (axis group, dtype, device) -- buckets are formed in the order gradients become
ready -- and launches the bucket asynchronously once the gradient does not fit in it (the bucket
goes, the gradient opens the next) or fills it: at most ``bucket_mb`` MiB, a larger gradient
alone; the first bucket of each backward at most 1 MiB, as DDP's, so that a reduction starts
early even when the whole model fits in one bucket. When backward reaches the boundary (once every use is done), it launches the buckets still
open (those of inputs whose gradient never came included), waits for all of them and adds the
sums into the gradients. The buckets of one backward are kept per call, with the id of the
backward (autograd graph task): a backward abandoned by an exception leaves nothing that the next
backward of the graph (``retain_graph``) or the next call would pick up.

Exact by linearity: the path from an input to its use is invariant, so summing before or after
it is the same. With ``create_graph=True`` the taps pass the gradients on and the reductions stay
differentiable (one `AllReduce` per input, at the boundary); leaf inputs of calls under `no_sync`
pass theirs on too, and the boundary keeps them pending; under ``torch.func`` transforms the
boundary is not used. If the inputs are on several devices, the taps pass every gradient on and
all buckets are launched at the boundary (the engine runs each device's backward on its own
thread, so the ready order could differ between ranks).
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

__all__ = ["GradBoundary", "TwinTap", "BoundaryState", "DEFAULT_BUCKET_MB", "no_sync", "wrap"]

DEFAULT_BUCKET_MB = 25.0
"""Bucket size for gradient all-reduces, as DDP's default."""

FIRST_BUCKET_BYTES = 2**20
"""The first bucket of each backward is at most this big (1 MiB, as DDP's first bucket), so that
a reduction starts early in the backward even when the whole model fits in one bucket."""

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
    its dtype and whether it is a leaf (whose reduction `no_sync` may defer); and, during one
    backward, the buckets being filled and those launched."""

    __slots__ = (
        "groups",
        "bucket_bytes",
        "dtypes",
        "leaves",
        "defer",
        "param_dtype",
        "reduce_dtype",
        "early",
        "task",
        "open",
        "launched",
        "started",
    )

    def __init__(self, xs, bucket_mb: float, param_dtype=None, reduce_dtype=None):
        n = len(xs)
        self.groups: list[AxisGroup | None] = [None] * n
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.dtypes = [x.dtype for x in xs]
        self.leaves = [x if x.is_leaf else None for x in xs]
        self.defer = not _sync
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        # Launch from the taps only when every input is on one device: the autograd engine runs
        # the backward of each device on its own thread, so with several devices the ready order
        # (hence the order of the all-reduces) could differ between ranks.
        self.early = len({x.device for x in xs}) == 1
        self.task: int | None = None  # the backward (autograd graph task) the buckets below belong to
        self.open: dict = {}  # (group, dtype, device) -> [indices, gradients, bytes]
        self.launched: list = []  # (work, flat, indices, shapes, record), in launch order
        self.started: set = set()  # the (group, dtype, device) keys that launched a bucket

    def begin(self) -> None:
        """Start this backward's buckets; drop what an abandoned backward of the graph left."""
        task = _graph_task()
        if task != self.task:
            self.task = task
            self.open = {}
            self.launched = []
            self.started = set()

    def add(self, i: int, g: AxisGroup, ct: torch.Tensor) -> None:
        """Put input ``i``'s unreduced gradient ``ct`` in the open bucket of its (group, dtype,
        device); launch the bucket once ``ct`` does not fit in it or fills it."""
        nbytes = ct.numel() * ct.element_size()
        if not nbytes:  # nothing to reduce
            self.launched.append((None, ct.reshape(-1), [i], [ct.shape], None))
            return
        key = (g, ct.dtype, ct.device)
        cap = self.bucket_bytes if key in self.started else min(self.bucket_bytes, FIRST_BUCKET_BYTES)
        b = self.open.get(key)
        if b is not None and b[2] + nbytes > cap:
            self._launch(key, b)
            b = None
            cap = self.bucket_bytes
        if b is None:
            b = self.open[key] = [[], [], 0]
        b[0].append(i)
        b[1].append(ct)
        b[2] += nbytes
        if b[2] >= cap:
            self._launch(key, b)

    def _launch(self, key, b) -> None:
        del self.open[key]
        self.started.add(key)
        g = key[0]
        flat = torch.cat([c.reshape(-1) for c in b[1]])  # a copy: ct may be shared with other grads
        with _comm._issue("all_reduce", g, flat):  # counted, and labelled while profiling
            work = dist.all_reduce(flat, group=g.group, async_op=True)  # type: ignore[arg-type]
        self.launched.append((work, flat, b[0], [c.shape for c in b[1]], _comm.issued()))

    def finish(self, grads: list) -> None:
        """Launch the buckets still open, wait for all, add the sums into ``grads``."""
        for key, b in list(self.open.items()):
            self._launch(key, b)
        launched, self.launched, self.task = self.launched, [], None
        for work, flat, idx, shapes, rec in launched:
            if work is not None:
                _comm.wait_work(work, rec)  # marked as a wait in that collective (hang reports)
            offset = 0
            for i, shape in zip(idx, shapes):
                n = shape.numel()
                red = flat[offset : offset + n].view(shape).to(self.dtypes[i])
                offset += n
                grads[i] = red if grads[i] is None else grads[i] + red


_graph_task = getattr(torch._C, "_current_graph_task_id", lambda: -1)
"""The id of the running backward (autograd graph task), -1 outside one."""


class TwinTap(torch.autograd.Function):
    """Identity on the twin of boundary input ``i``. Made when the twin is first used, so that
    its backward (ordered by creation in the autograd engine) runs as soon as the gradient of
    every use is in: it puts the gradient in a bucket (maybe launching it) and passes nothing
    on. Under ``create_graph``, for deferred (`no_sync`) leaves, and when ``early`` is off, it
    passes the gradient on to `GradBoundary`, which handles it as before."""

    @staticmethod
    def forward(state, i, x):
        with untracked():
            return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.state, ctx.i = inputs[0], inputs[1]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, ct):
        state: BoundaryState = ctx.state
        i = ctx.i
        leaf = state.leaves[i]
        if ct is None or not state.early or torch.is_grad_enabled() or (state.defer and leaf is not None):
            return None, None, ct
        with untracked():
            state.begin()
            ct = ct.to(state.reduce_dtype or state.dtypes[i])
            hit = _take_pending(leaf) if leaf is not None and _PENDING else None
            if hit is not None:
                ct = ct + hit[1]
            state.add(i, state.groups[i], ct)  # type: ignore[arg-type]
        return None, None, None


def _tap(state: BoundaryState, i: int, raw: torch.Tensor) -> torch.Tensor:
    return apply(TwinTap, state, i, raw)


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
        differentiable = torch.is_grad_enabled()
        if not differentiable:
            state.begin()  # keeps the buckets the taps filled in this backward
        for i in range(n):
            # The twin's gradient arrives here only if its tap passed it on (see TwinTap).
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
            with untracked():
                state.add(i, g, twin)
        if not differentiable:
            with untracked():
                state.finish(grads)
        return (None, *grads)


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
    if tr.uneven:
        # Ranks hold blocks of different shapes, so Python code on shapes may build different
        # graphs on different ranks, and the ready order with them: launch every bucket at the
        # boundary, in input order (the same on every rank).
        state.early = False
    got = apply(GradBoundary, state, *[xs[i] for i in idx])
    for k, i in enumerate(idx):
        vis, twin = got[2 * k], got[2 * k + 1]
        if masks[i]:
            tag(vis, tr, masks[i])
        out[i] = vis
        # The twin f's uses see is made on first use (_vma._twin_of derives it from the hidden
        # one): a TwinTap, created just before the first use so that its backward runs as soon
        # as the twin's gradient is complete (and never for an input used invariantly only).
        tr.twins[id(twin)] = [twin, twin, k, state, None]
        tr.twins[id(vis)] = [vis, None, k, state, (twin, _tap, (state, k, twin), None)]
    return out
