"""Combining per-leaf collectives in eager, as XLA's collective combiner does when compiling.

``optree.tree_map(lambda p: fs.all_gather(p, "dp", dim=0, tiled=True), params)`` issues one
all_gather per leaf. Inside ``shard_map`` (where `VmaMode` sees every torch op) such a call does
not communicate at once: it returns its result tensor, allocated but not yet filled, and queues
the collective on the running `Trace`, in a bucket per key: kind, axes, options, dtype, device
and grad mode (dtypes are never packed together). Each bucket runs as one coalesced collective
(`AllGatherInto`, `AllReduceInto`), which fills the results in place and records one autograd
node for all of them, so the backward is one coalesced reduce-scatter (all_gather) or no
communication at all (psum).

The queue is flushed (its buckets handed, in the order of their keys' first calls, to the trace's
`Flight`):

- at the first torch op run inside ``f`` after the calls (`VmaMode` checks ``trace.queue``), but
  for an op that prepares the next call's operand from no queued result (a cast, a reshape:
  ``_vma._PREP``), so that ``fs.all_gather(p.to(torch.bfloat16), ...)`` leaf by leaf still combines,
- when any fshard collective that is not queued is called (`_vma.current`), or a queued one whose
  operand is a queued result,
- when ``f`` returns (the trace's exit),
- when a bucket's results would exceed `cap_bytes` (``FSHARD_COMBINE_MB``, default 4 MB): a
  bucket's transient buffers (its packed operands and received blocks in the forward, its
  gradients, packed, in the backward) are a few times its size, so small buckets keep the peak
  memory near that of one call at a time (one bucket of a whole model took 1.5x FSDP2's peak).

A flush does not wait: the `Flight` launches the buckets asynchronously in queue order (the same
on every rank, whatever order the results are later used in), at most ``FSHARD_COMBINE_AHEAD``
(default 2; 0 runs a flush's buckets at once and waits) in flight, and the first use of a result (a torch op taking it) waits for its own
bucket only, which launches the next: the per-leaf FSDP form computes with one layer's
parameters while the next ones arrive. Any other collective, and the trace's exit, wait for all.
In the backward, a combined all_gather's node runs last (autograd runs the nodes recorded later
first, and it was recorded at the launch), so its reduce-scatter would wait for the whole
backward, holding every gradient: each result instead gets an `Arrived` node when it is filled,
which hands its gradient to the bucket's `Early` as soon as it is complete; the bucket's
reduce-scatter is launched when it has them all (at most ``FSHARD_COMBINE_AHEAD`` in flight), and
the combined node takes its result.

``FSHARD_COMBINE=0`` in the environment turns combining off (each call communicates at once,
as before), for debugging. Calls are never combined under torch.func transforms or forward-mode
AD (``torch.autograd.forward_ad.dual_level``: the combined Functions have no jvp rule), while
``torch.compile`` traces, under ``fs.debug`` (which checks each call against the other ranks'),
in a call with uneven blocks, or across dtypes.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque

import torch

from . import _comm, _counts, _reshard, _state, _vma
from . import _watchdog as _watch
from ._comm import untracked
from ._primitives import (
    Pvary,
    ReduceScatter,
    ReduceScatterCoalesced,
    _owned,
    _untracked,
    apply,
    invariant_slice,
    split_blocks,
)

__all__ = [
    "enabled",
    "cap_bytes",
    "deferrable",
    "psum_later",
    "all_gather_later",
    "empty",
    "ahead",
    "Queue",
    "Bucket",
    "Flight",
    "push",
    "hold",
    "release",
    "AllGatherInto",
    "AllReduceInto",
    "Early",
    "Arrived",
    "reset",
]

_functorch_active = torch._C._are_functorch_transforms_active
_forward_ad = torch.autograd.forward_ad
_compiling = torch.compiler.is_compiling


def enabled() -> bool:
    """Whether per-leaf collectives may be combined (``FSHARD_COMBINE=0`` turns it off)."""
    return os.environ.get("FSHARD_COMBINE", "1") != "0"


def cap_bytes() -> int:
    """The most bytes of results one combined collective gathers (``FSHARD_COMBINE_MB``, default 4)."""
    return int(float(os.environ.get("FSHARD_COMBINE_MB", "4")) * 2**20)


def ahead() -> int:
    """How many combined collectives of the flushed queues are in flight at once, launched and not
    yet waited for (``FSHARD_COMBINE_AHEAD``, default 2; 0: a flush runs them all and waits)."""
    return max(0, int(os.environ.get("FSHARD_COMBINE_AHEAD", "2")))


def deferrable(tr) -> bool:
    """Whether a collective issued now in trace ``tr`` may be queued."""
    return (
        tr is not None
        and tr._mode is not None  # VmaMode sees the ops that use the results
        and not tr.uneven
        and not tr.taint  # after a branch on a varying value: operands cast one by one (_vma.operand)
        and not _functorch_active()
        and _forward_ad._current_level < 0  # forward-mode AD: the combined Functions have no jvp
        and not _compiling()
        and enabled()
        and not _watch.S.check  # fs.debug checks each call as made, against the other ranks'
        and not _comm.is_abstract()  # (types only: the collective raises, see _comm.abstract)
    )


def psum_later(x, axis, tr):
    """``fs.psum`` of a tensor varying over all of ``axis``, queued: its result (filled when the
    queue runs), or None when it cannot be queued (the caller then runs it at once)."""
    g = tr.mesh.axis_group(axis, "psum")
    bits = tr.mesh.bits(g.names)
    held = hold(tr)  # fshard's own torch ops on x below must not flush the queue
    try:
        v = _vma.get(x, tr)
        if not bits & v or bits & ~v:  # invariant over some of the axes: a product, run at once
            return None
        g = tr.mesh.axis_group(tr.mesh.names_of(bits), "psum")  # in mesh order, as run at once
        out = empty(x.shape, x, _PsumT(g))
        key = ("psum", g.names, False, False, x.dtype, x.device, torch.is_grad_enabled(), False)
        with untracked():  # the result is not tagged yet: no mode (an fs.switch branch's guard) may see it
            nbytes = out.numel() * out.element_size()
    finally:
        release(tr, held)
    push(tr, key, g, x, out, 0, nbytes)
    return _vma.tag(out, tr, v & ~bits)


def all_gather_later(x, axis, dim, tiled, invariant, tr, norm_dim):
    """``fs.all_gather`` of one tensor, queued: its result (filled when the queue runs), or None
    when it cannot be queued. ``norm_dim`` is the collectives' check of ``dim`` (same errors)."""
    if not isinstance(x, torch.Tensor):
        return None  # the caller's error
    g = tr.mesh.axis_group(axis, "all_gather")
    if g.size == 1:
        return None
    held = hold(tr)  # the checks below run torch ops on x, which must not flush the queue
    try:
        bits = tr.mesh.bits(g.names)
        v = _vma.get(x, tr)
        shape = list(x.shape)
        dim = norm_dim(dim, len(shape) if tiled else len(shape) + 1, "all_gather")
        x = _vma.pvary(x, tr, v, v | bits)
        if tiled:
            shape[dim] *= g.size
        else:
            shape.insert(dim, g.size)
        out = empty(shape, x, _GatherT(g, dim, tiled, invariant))
        key = (
            "all_gather",
            g.names,
            bool(tiled),
            bool(invariant),
            x.dtype,
            x.device,
            torch.is_grad_enabled(),
            _reshard.active() and x.requires_grad,  # gathered again in the backward
        )
        with untracked():  # the result is not tagged yet: no mode (an fs.switch branch's guard) may see it
            nbytes = out.numel() * out.element_size()
    finally:
        release(tr, held)
    push(tr, key, g, x, out, dim, nbytes)
    if key[-1]:
        b = tr.queue.buckets[key]
        if b.gathers is None:
            b.gathers = _reshard.Gathers(_reshard.Many(g, [], tiled, invariant, contiguous=True))
        b.gathers.run.dims.append(dim)
        _reshard.note(out, b.gathers, b.gathers.add(x))
    if invariant:
        return _vma.tag(out, tr, v & ~bits)
    _vma.tag(out, tr, v | bits)
    out._fshard_gathered = g.names  # the replication check suggests invariant=True for it
    return out


def _issued_level():
    """Where a bucket is launched and filled: outside any torch.func transform entered in ``f``
    after its calls were queued (a result first used inside ``vmap``), at the level the calls were
    issued at (queued calls are never made inside a transform: `deferrable`)."""
    if not _functorch_active():
        return contextlib.nullcontext()
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    return temporarily_clear_interpreter_stack()


class Bucket:
    """Queued calls of one key (kind, axes, options, dtype, device, grad mode), in issue order."""

    __slots__ = (
        "key",
        "g",
        "items",
        "nbytes",
        "site",
        "launched",
        "fill",
        "ids",
        "outs",
        "early",
        "gathers",
        "members",
    )

    def __init__(self, key, g, site):
        self.key = key
        self.g = g
        self.items: list = []  # (operand, result, dim) per call
        self.nbytes = 0
        self.site = site  # the first call's site: what the watchdog's records and reports name
        self.launched = False
        self.fill = None  # once launched: waits for the collective and fills the results
        self.ids: list = []  # the ids of the results (while in a `Flight`)
        self.outs: list | None = None  # the results, launched and not yet filled
        self.early: Early | None = None  # their gradients' reduce-scatter, run early (all_gather)
        self.gathers: _reshard.Gathers | None = None  # fs.reshard_after_forward: gathered again
        self.members: tuple = ()  # once launched: what every rank must agree it holds (`agreed`)

    def launch(self) -> None:
        """Start the bucket's calls as one coalesced collective (recording its autograd node);
        `wait` fills their results."""
        with _issued_level():
            self._launch()

    def _launch(self) -> None:
        kind, _, tiled, invariant, _, _, grad, _ = self.key
        xs = [x for x, _, _ in self.items]
        outs = [y for _, y, _ in self.items]
        dims = tuple(d for _, _, d in self.items)
        self.launched = True
        self.outs = outs
        # its size depends on what this rank queued: the ranks agree on its members before it is sent
        self.members = (
            kind,
            bool(tiled),
            bool(invariant),
            str(xs[0].dtype),
            tuple((tuple(x.shape), d) for x, d in zip(xs, dims)),
        )
        if kind == "all_gather" and grad and not invariant and ahead():
            self.early = Early(self.g, dims, tiled, len(xs))
        self.items = []  # the operands are packed: only the fill holds the results
        _watch.S.site = self.site
        try:
            with torch.set_grad_enabled(grad), untracked():  # the results are not used yet
                if kind == "all_gather":
                    apply(AllGatherInto, self.g, dims, tiled, invariant, self, len(xs), *xs, *outs)
                else:
                    apply(AllReduceInto, self.g, self, len(xs), *xs, *outs)
        finally:
            _watch.S.site = None
        _counts.record_combined("all_gather" if kind == "all_gather" else "all_reduce", self.g, len(xs))

    def agreed(self):
        """What the ranks agree on before the collective is sent (its tags carry it: ranks whose
        buckets differ raise the same `CollectiveError` instead of sending buffers of different
        sizes), and its description in that error."""
        kind, tiled, _, _, members = self.members

        def what() -> str:
            if kind == "all_gather":
                shown = ", ".join(f"{shape} at dim {d}" for shape, d in members)
            else:
                shown = ", ".join(str(shape) for shape, _ in members)
            calls = f"{len(members)} call{'s' if len(members) != 1 else ''}"
            return f"combining {calls} of {'tiled ' if tiled else ''}{kind}: {shown}"

        return self.members, what

    def wait(self) -> None:
        """Wait for the launched collective and fill the results (once)."""
        fill, self.fill = self.fill, None
        if fill is not None:
            with _issued_level():
                self._fill(fill)

    def _fill(self, fill) -> None:
        fill()
        outs, early = self.outs, self.early
        self.outs = self.early = None
        if early is not None and outs and outs[0].requires_grad:
            with torch.enable_grad(), untracked():  # recorded now: see `Arrived`
                for i, out in enumerate(outs):
                    apply(Arrived, early, i, out)


class Queue:
    """The collectives issued in one trace and not yet run: a bucket per key, in the order of each
    key's first call (the same on every rank)."""

    __slots__ = ("tr", "buckets", "outs")

    def __init__(self, tr):
        self.tr = tr
        self.buckets: dict = {}
        self.outs: set = set()  # ids of the results (an operand that is one flushes first)

    def flush(self) -> None:
        """Hand every bucket, in order, to the trace's `Flight` (which launches the first ones)."""
        tr = self.tr
        if tr.queue is self:
            tr.queue = None
        if tr.pending is None:
            tr.pending = Flight(tr)
        tr.pending.add(self.buckets.values())


class Flight:
    """The buckets of a trace's flushed queues whose results are not filled yet, in queue order.

    They are launched in that order (the same on every rank, whatever order the results are used
    in), at most `ahead` at a time: waiting for one launches the next. The first use of a result
    (a torch op that takes it, `VmaMode`) waits for its bucket only, launching first the buckets
    queued before it; any other collective (`_vma.current`) and the trace's exit wait for all.
    """

    __slots__ = ("tr", "todo", "live", "owner")

    def __init__(self, tr):
        self.tr = tr
        self.todo: deque = deque()  # queued, not launched
        self.live: deque = deque()  # launched, not waited for
        self.owner: dict = {}  # id(result) -> its bucket (which holds the result until filled)

    def add(self, buckets) -> None:
        """Take flushed buckets, launching up to `ahead` of those not yet waited for."""
        owner = self.owner
        for b in buckets:
            b.ids = [id(out) for _, out, _ in b.items]
            for k in b.ids:
                owner[k] = b
            self.todo.append(b)
        limit = ahead()
        if limit:
            self._launch(limit)
        else:  # no overlap: every result filled now (for debugging and comparison)
            self.drain()

    def _launch(self, limit: int) -> None:
        while self.todo and len(self.live) < limit:
            b = self.todo.popleft()
            self.live.append(b)
            b.launch()

    def wait(self, b: Bucket) -> None:
        """Fill ``b``'s results: launch the buckets up to it, wait for it, launch the next."""
        while not b.launched:
            nxt = self.todo.popleft()
            self.live.append(nxt)
            nxt.launch()
        self.live.remove(b)
        for k in b.ids:  # first: the fill's own ops must not find them
            del self.owner[k]
        b.wait()
        if not self.owner:
            if self.tr.pending is self:
                self.tr.pending = None
            return
        self._launch(max(1, ahead()))

    def use(self, args, kwargs) -> None:
        """A torch op is about to run on ``args`` and ``kwargs``: fill the results among them."""
        owner = self.owner
        for seq in (args, kwargs.values()) if kwargs else (args,):
            for a in seq:
                if isinstance(a, torch.Tensor):
                    b = owner.get(id(a))
                    if b is not None:
                        self.wait(b)
                elif isinstance(a, (list, tuple)):
                    for t in a:
                        if isinstance(t, torch.Tensor):
                            b = owner.get(id(t))
                            if b is not None:
                                self.wait(b)

    def drain(self) -> None:
        """Launch every bucket left and fill every result, in queue order."""
        if self.tr.pending is self:
            self.tr.pending = None
        while self.todo:
            b = self.todo.popleft()
            self.live.append(b)
            b.launch()
        while self.live:
            self.live.popleft().wait()
        self.owner.clear()


def hold(tr):
    """Detach ``tr``'s queue while a collective checks its arguments (fshard's own torch ops on
    the operand must not flush it); give it back with `release`."""
    q = tr.queue
    tr.queue = None
    return q


def release(tr, q) -> None:
    """Give back the queue `hold` took (unless it was flushed meanwhile)."""
    if q is not None and tr.queue is None:
        tr.queue = q


def push(tr, key, g, x: torch.Tensor, out: torch.Tensor, dim: int, nbytes: int) -> None:
    """Queue one call: ``out`` is filled from operand ``x`` when the queue is flushed."""
    q = tr.queue
    if q is not None:
        b = q.buckets.get(key)
        # the operand is a queued result, or this key's bucket is full: the queue runs first
        if id(x) in q.outs or (b is not None and b.nbytes + nbytes > cap_bytes()):
            q.flush()
            q = None
    p = tr.pending
    if p is not None and id(x) in p.owner:  # the operand is a result in flight: filled first
        p.wait(p.owner[id(x)])
    if q is None:
        q = tr.queue = Queue(tr)
    b = q.buckets.get(key)
    if b is None:
        b = q.buckets[key] = Bucket(key, g, _watch._site())
    b.items.append((x, out, dim))
    b.nbytes += nbytes
    q.outs.add(id(out))


def empty(shape, like: torch.Tensor, transpose) -> torch.Tensor:
    """A result to be filled by a flush. When gradients are recorded and ``like`` (the operand)
    needs one, an `Unfilled` whose history is ``transpose`` (the call's own, from the result's
    gradient to the operand's); else a new tensor that needs none."""
    with untracked():
        if torch.is_grad_enabled() and like.requires_grad:
            return apply(Unfilled, like, shape, transpose)
        return torch.empty(shape, dtype=like.dtype, device=like.device)


class Unfilled(torch.autograd.Function):
    """A queued call's result before its bucket runs: a new tensor whose history is the call's own
    transpose. A torch op that takes it fills it first (`VmaMode`), and the fill gives it the
    bucket's history (mark_dirty), which leaves this node unused. But ``Function.apply`` is no torch
    op (fshard does not see it): an autograd.Function applied to the result before the fill keeps
    this node as its input's history, and its gradient then reaches the operand here (before, the
    result was a leaf that needed no gradient, and that gradient was dropped without a word)."""

    @staticmethod
    @_untracked
    def forward(x, shape, transpose):
        return torch.empty(shape, dtype=x.dtype, device=x.device)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.transpose = inputs[2]
        ctx.set_materialize_grads(False)

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        return (None if ct is None else ctx.transpose(ct)), None, None


class _PsumT:
    """The transpose of a psum of a value varying over all of ``g``: pvary (no communication)."""

    __slots__ = ("g",)

    def __init__(self, g):
        self.g = g

    def __call__(self, ct):
        return apply(Pvary, ct, self.g) if torch.is_grad_enabled() else ct


class _GatherT:
    """The transpose of one all_gather: a reduce-scatter, or this rank's block (``invariant``)."""

    __slots__ = ("g", "dim", "tiled", "invariant")

    def __init__(self, g, dim, tiled, invariant):
        self.g, self.dim, self.tiled, self.invariant = g, dim, tiled, invariant

    def __call__(self, ct):
        if self.invariant:
            return invariant_slice(ct, self.g, self.dim, self.tiled)
        return apply(ReduceScatter, ct, self.g, self.dim, self.tiled)


# -- the coalesced Functions that fill results given in advance -------------------------------


def _pack(xs) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in xs])


class AllGatherInto(torch.autograd.Function):
    """all_gather of n tensors with one all-gather, written into n given results (marked dirty,
    so each result gets this node as its history). The forward only starts the collective;
    ``bucket.fill`` waits for it and fills the results. The transpose is one coalesced reduce-scatter,
    or each tensor's local slice for an ``invariant`` result, as for `AllGatherCoalesced`."""

    @staticmethod
    @_untracked
    def forward(g, dims, tiled, invariant, bucket, n, *args):
        xs, outs = args[:n], args[n:]
        shapes = [x.shape for x in xs]
        handle = _comm.all_gather_start(_pack(xs), g, *bucket.agreed())  # [N, total]; row i from index i

        def fill():
            blocks = handle.wait()
            size = blocks.shape[0]
            offset = 0
            with torch.no_grad(), untracked():
                for shape, d, out in zip(shapes, dims, outs):
                    k = shape.numel()
                    src = blocks[:, offset : offset + k].view(size, *shape)
                    offset += k
                    if tiled:
                        dst = out.view(*shape[:d], size, shape[d], *shape[d + 1 :]).movedim(d, 0)
                    else:
                        dst = out.movedim(d, 0)
                    dst.copy_(src)

        bucket.fill = fill
        return tuple(outs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = (*inputs[:4], inputs[5])
        ctx.early = inputs[4].early
        ctx.mark_dirty(*inputs[6 + inputs[5] :])

    @staticmethod
    @_untracked
    def backward(ctx, *cts):
        g, dims, tiled, invariant, n = ctx.args
        early = ctx.early
        if invariant:
            grads = tuple(invariant_slice(ct, g, d, tiled) for ct, d in zip(cts, dims))
        elif early is not None and early.started():
            grads = early.result()  # reduce-scattered during the backward (`Arrived`)
        else:
            if early is not None:  # some results got no gradient: the ones that did were kept
                cts = early.merge(cts)
            grads = apply(ReduceScatterCoalesced, g, dims, tiled, *cts)
            _counts.record_combined("reduce_scatter", g, n)
        return (None, None, None, None, None, None, *grads, *([None] * n))


class AllReduceInto(torch.autograd.Function):
    """psum of n tensors with one all-reduce, written into n given results (marked dirty) by
    ``bucket.fill``, the forward only starting it; the transpose is pvary of each (no communication)."""

    @staticmethod
    @_untracked
    def forward(g, bucket, n, *args):
        xs, outs = args[:n], args[n:]
        sizes = [x.numel() for x in xs]
        handle = _comm.all_reduce_start_(_pack(xs), g, *bucket.agreed())

        def fill():
            buf = handle.wait()
            with torch.no_grad(), untracked():
                for p, out in zip(buf.split(sizes), outs):
                    out.copy_(p.view(out.shape))

        bucket.fill = fill
        return tuple(outs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g, n = inputs[0], inputs[2]
        ctx.mark_dirty(*inputs[3 + n :])
        ctx.n = n

    @staticmethod
    def backward(ctx, *cts):
        if torch.is_grad_enabled():  # double backward: record the pvary so it transposes to psum
            cts = tuple(apply(Pvary, ct, ctx.g) for ct in cts)
        return (None, None, None, *cts, *([None] * ctx.n))


# -- the backward's reduce-scatters, launched as their buckets' gradients complete ----------------

_in_flight: deque = deque()  # `Early` reduce-scatters launched and not yet waited for (one process)


@_state.job_state(order=20)
def reset() -> None:
    """Forget the backward reduce-scatters an earlier job left in flight (a pool rank between jobs)."""
    _in_flight.clear()


class Early:
    """The reduce-scatter of one combined all_gather's gradients, launched as soon as they are all
    there (`Arrived`), long before autograd reaches the combined node (recorded at the launch, so
    run last); that node waits for it. At most `ahead` of them are in flight: launching one waits
    for the oldest (whose reduced blocks, 1/N of its gradients, are kept until its node runs)."""

    __slots__ = ("g", "dims", "tiled", "cts", "have", "handle", "done")

    def __init__(self, g, dims, tiled, n):
        self.g, self.dims, self.tiled = g, dims, tiled
        self.cts: list = [None] * n
        self.have = 0
        self.handle = None
        self.done = None

    def arrive(self, i: int, ct: torch.Tensor) -> None:
        """Result ``i``'s gradient is complete: keep it; with all of them, launch the reduce-scatter."""
        if self.cts[i] is None:
            self.have += 1
        self.cts[i] = ct
        if self.have == len(self.cts):
            cts, self.cts, self.have = self.cts, [None] * len(self.cts), 0
            with untracked():
                parts = [split_blocks(x, self.g.size, d, self.tiled) for x, d in zip(cts, self.dims)]
                del cts
                buf = torch.cat([p.reshape(self.g.size, -1) for p in parts], dim=1)  # [N, total]
                shapes = [p.shape[1:] for p in parts]
                del parts
                handle = _comm.reduce_scatter_start(buf, self.g)
            _counts.record_combined("reduce_scatter", self.g, len(shapes))
            del buf

            def finish():
                mine = handle.wait()
                return tuple(
                    _owned(m.view(s)) for m, s in zip(mine.split([s.numel() for s in shapes]), shapes)
                )

            self.handle = finish
            _in_flight.append(self)
            while len(_in_flight) > max(1, ahead()):
                _in_flight.popleft().wait()

    def wait(self) -> None:
        """Wait for the launched reduce-scatter, keeping this rank's blocks."""
        finish, self.handle = self.handle, None
        if finish is not None:
            with untracked():
                self.done = finish()

    def started(self) -> bool:
        return self.handle is not None or self.done is not None

    def result(self) -> tuple:
        """The reduced gradients (waiting if needed); ready for the next backward."""
        if self.handle is not None:
            _in_flight.remove(self)
            self.wait()
        done, self.done = self.done, None
        return done  # type: ignore[return-value]

    def merge(self, cts) -> tuple:
        """The gradients the combined node got, with those `Arrived` kept in their place."""
        kept, self.cts, self.have = self.cts, [None] * len(self.cts), 0
        return tuple(ct if k is None else k for ct, k in zip(cts, kept))


class Arrived(torch.autograd.Function):
    """Identity, in place, on a combined all_gather's result, recorded when the result is filled
    (just before its first use). Autograd runs the nodes recorded later first, so this one runs as
    soon as the result's gradient is complete, while the combined node, recorded when the bucket
    was launched, runs at the end of the backward: this hands the gradient to the bucket's `Early`
    and passes on zeros (a broadcast scalar: no memory). Under double backward (create_graph) it
    passes the gradient on, for the combined node's differentiable reduce-scatter."""

    @staticmethod
    def forward(early, i, x):
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.early, ctx.i = inputs[0], inputs[1]
        ctx.mark_dirty(inputs[2])

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        if torch.is_grad_enabled():
            return None, None, ct
        ctx.early.arrive(ctx.i, ct)
        return None, None, ct.new_zeros(()).expand(ct.shape)
