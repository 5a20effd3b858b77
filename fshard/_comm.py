"""Raw communication on an `AxisGroup`.

Every byte fshard moves goes through a function here, so `count_collectives` (`_counts`) sees
all of it (forward and backward). These functions know nothing of autograd or of
varying-axes tracking; ``_collectives.py`` builds the differentiable primitives on them.
All of them run with torch-function handling disabled so that shard_map's tracking mode
does not see their internal tensor ops.

The collectives that torch has as functional ops (``torch.ops._c10d_functional``: all-reduce,
all-gather, reduce-scatter, all-to-all, broadcast) are issued through them: the op launches the
collective and returns its output, ``wait_tensor`` waits for it. Those ops are asynchronous and
``torch.compile`` traces them into its graph. Their own autograd is never used (the
differentiable primitives in ``_primitives.py`` own the transposes): in eager they are
dispatched below autograd (which also skips the Python autograd kernels torch registers for
them, about 30 us a call), while compiling under ``no_grad``. Point-to-point (`permute`),
results on one rank (`gather_blocks`, `reduce_`), `scatter` and `broadcast_object` use
``torch.distributed`` directly.
"""

from __future__ import annotations

import contextlib
import zlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401  (the ops' fake kernels, for tracing)

from . import _counts, _errors, _inflight, _traced_order, _wire
from . import _watchdog as _watch
from ._mesh import AxisGroup
from ._scalars import symbolic

__all__: list[str] = []  # internal (the counts: `_counts`)


_profiling = torch.autograd._profiler_enabled
_compiling = torch.compiler.is_compiling
_NO_SPAN = contextlib.nullcontext()


def _span(kind: str, names: tuple[str, ...], nbytes: int):
    """A ``torch.profiler`` range ``fshard.{kind}[{axes}] {nbytes}B`` around one collective.

    Only while a profiler is recording; otherwise a shared no-op context (one C call), so the
    collectives cost nothing extra when nobody profiles.
    """
    if not _profiling():
        return _NO_SPAN
    return torch.profiler.record_function(f"fshard.{kind}[{','.join(names)}] {nbytes}B")


class Abstract(Exception):
    """A collective reached while `abstract` is on: nothing was sent (see `abstract`)."""


_ABSTRACT = [0]


@contextlib.contextmanager
def abstract():
    """Code run for its types only (`fs.switch` traces each branch on fake tensors): every collective
    raises `Abstract` before anything is recorded or sent, and none is queued for combining."""
    _ABSTRACT[0] += 1
    try:
        yield
    finally:
        _ABSTRACT[0] -= 1


def is_abstract() -> bool:
    return _ABSTRACT[0] > 0


def _issue(kind: str, g: AxisGroup, t: torch.Tensor, salt=None, what=None, op: str = ""):
    """Record one collective of ``t`` over ``g`` and return its profiler range (see `_span`).

    Outside ``torch.compile`` it also gets its record in ``_watchdog`` (sequence number, call
    site; in debug mode the cross-rank fingerprint check, which raises before anything is sent),
    which `issued` returns until the next collective. Under `abstract` it raises `Abstract`."""
    if _ABSTRACT[0]:
        raise Abstract(f"a {kind} over {', '.join(g.names)} while tracing for types only")
    if _compiling():  # a compiled graph shows the functional ops themselves
        _traced(kind, g, t, op)
        return _NO_SPAN
    if g.size > 1:  # gloo: the collectives still in flight over the group first (see _inflight)
        _inflight.drain(_name(g))
    _counts.record(kind, g, t)
    _watch.begin(kind, g, t, salt, what)
    if not _profiling():
        return _NO_SPAN
    label = f"fshard.{kind}[{','.join(g.names)}] {t.numel() * t.element_size()}B"
    return torch.profiler.record_function(label)


def _traced(kind: str, g: AxisGroup, t: torch.Tensor, op: str = "") -> None:
    """While Dynamo traces: count the collective (``fs.count_collectives``) and note it, with its
    reduction ``op``, for the ranks' comparison of their traced collectives (`_traced_order`; a
    ppermute's blocks differ by rank: no shape; a dim traced symbolically: -1)."""
    _counts.record_traced(kind, g, t)
    shape = None if kind == "ppermute" else tuple(-1 if symbolic(d) else d for d in t.shape)
    _traced_order.note(kind, op, g.names, t.dtype, shape)


def issued() -> tuple | None:
    """The record of the last collective `_issue` saw (what a later wait marks; see ``_watchdog``);
    None while compiling (traced collectives get no record, and a read of the record would be a
    guard on it: the next call after an eager collective would recompile)."""
    return None if _compiling() else _watch.S.issued


def wait_work(work, rec: tuple | None) -> None:
    """``work.wait()`` of a ``torch.distributed`` async op issued as ``rec``, marked as a wait."""
    _watch.wait(work.wait, rec)


untracked = torch._C.DisableTorchFunction
"""``with untracked():`` runs tensor ops unseen by shard_map's varying-axes tracking mode
(the one spelling of "disable torch function" in fshard)."""
_F = torch.ops._c10d_functional
_ALL_REDUCE = _F.all_reduce.default
_ALL_REDUCE_ = _F.all_reduce_.default
_ALL_GATHER = _F.all_gather_into_tensor.default
_REDUCE_SCATTER = _F.reduce_scatter_tensor.default
_ALL_TO_ALL = _F.all_to_all_single.default
_BROADCAST = _F.broadcast.default
_WAIT = _F.wait_tensor.default
_below_autograd = torch._C._AutoDispatchBelowAutograd
_OP_NAMES = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor",
}


def _launch(op, *args) -> torch.Tensor:
    """Issue the functional collective ``op(*args)`` outside autograd; returns its output, which
    must go through `_wait` before it is read."""
    if _compiling():
        with torch.no_grad():
            return op(*args)
    with _below_autograd():
        return op(*args)


def _wait(t: torch.Tensor, rec: tuple | None) -> torch.Tensor:
    """``wait_tensor``: the output of a functional collective, once the collective is done; the wait
    is marked as one in collective ``rec`` (see ``_watchdog``)."""
    if _compiling():
        with torch.no_grad():
            return _WAIT(t)
    with _below_autograd():
        return _watch.wait(_WAIT, rec, t)


def _real(g: AxisGroup) -> bool:
    """Whether ``g``'s collectives move data: the "fake" backend (a world checked in one process)
    returns whatever its buffers held, so tags sent through it would read as a disagreement."""
    real = g.real  # cached on the AxisGroup (see AxisGroup.real), not in a table keyed by group
    if real is None:
        real = g.real = dist.get_backend(g.group) != "fake"  # type: ignore[arg-type]
    return real


def reduce_tag_len(g: AxisGroup, dtype: torch.dtype, device: torch.device) -> int:
    """How many tag elements an all-reduce (a sum) of ``dtype`` on ``device`` over ``g`` carries
    after its data (0: none; see ``_watchdog``)."""
    if not _watch.S.tags or device.type != "cpu" or g.size == 1 or _compiling() or not _real(g):
        return 0
    bd = _watch._base(dtype, g.size, "sum")
    return 0 if bd is None else 2 * bd[1]


def _reduce_tags(t: torch.Tensor, g: AxisGroup, op: str, salt=None) -> tuple[tuple | None, list[int] | None]:
    """The record of the collective just issued, and the tags its all-reduce buffer carries (None:
    none, as when compiling or off the CPU; see ``_watchdog``), ``salt`` mixed in."""
    if _compiling():
        return None, None
    rec = issued()
    if t.device.type != "cpu" or rec is None or not _real(g):
        return rec, None
    return rec, _watch.reduce_tags(rec, t.dtype, g.size, op, salt)


def _tag_start(t: torch.Tensor, g: AxisGroup) -> torch.Tensor | None:
    """Launch the all-gather of the tag of the collective just issued (right after its data, so that
    their latencies overlap); None when it carries no tag (see ``_watchdog``)."""
    rec = issued()
    if (
        _compiling()
        or not _watch.S.gather_tags
        or t.device.type != "cpu"
        or rec is None
        or not rec[0]
        or not _real(g)
    ):
        return None
    tag = torch.tensor([_watch.tag(rec)], dtype=torch.int64)
    if _inflight.serial(g):
        return tag  # gloo: gathered after the data has arrived (one collective in flight, _inflight)
    return _launch(_ALL_GATHER, tag, g.size, _name(g))


def _tag_check(tags: torch.Tensor | None, rec: tuple | None, g: AxisGroup) -> None:
    """After the data of ``rec`` has arrived: raise on every rank of the group if the tags differ."""
    if tags is not None:
        if tags.numel() == 1 and g.size > 1:  # not launched yet (gloo): now, after what is in flight
            _inflight.drain(_name(g))
            tags = _launch(_ALL_GATHER, tags, g.size, _name(g))
        _watch.check_gathered_tags(_wait(tags, rec).tolist(), rec, g, tags.device)  # type: ignore[arg-type]


def _agree(t: torch.Tensor, g: AxisGroup, salt, what) -> None:
    """Before the data of the collective just issued (a combined one, whose size depends on what each
    rank queued): its tags, with ``salt`` (what it holds), all-reduced in a buffer of a fixed size
    and compared, so that ranks whose buckets differ raise the same `CollectiveError` instead of
    sending buffers of different sizes (see ``_watchdog.agree``). Off with the tags
    (``FSHARD_DESYNC_TAGS=0``), off the CPU, and under ``fs.debug`` (which checked it already)."""
    if salt is None or _watch.S.check or not _watch.S.tags or t.device.type != "cpu" or not _real(g):
        return
    rec = issued()
    if rec is not None:
        _watch.agree(rec, g, t.device, salt, what)


def _name(g: AxisGroup) -> str:
    """The name of the group's ProcessGroup, by which the functional ops find it."""
    name = g.pg_name  # a plain string: torch.compile reads it as a constant
    if name is None:
        name = g.group.group_name  # type: ignore[attr-defined]
    if _compiling():
        _note_axes(name, g.names)
    return name


@torch._dynamo.assume_constant_result  # run at trace time, before inductor's passes read the table
def _note_axes(name: str, names: tuple) -> bool:
    """While tracing: the axes of the group a traced collective names, for the compiled graph's
    count (`_graph_counts`). Meshes that share a process group (``Mesh(dp=2)`` and ``Mesh(tp=2)``
    on two ranks) share its entry: the collective traced last names it."""
    from ._mesh import GROUP_AXES

    GROUP_AXES[name] = names
    return True


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


def all_reduce(t: torch.Tensor, g: AxisGroup, op=dist.ReduceOp.SUM, what: str | None = None) -> torch.Tensor:
    """Out-of-place all-reduce of ``t`` over the group. ``what`` (the same on every rank that runs
    the same program, such as "the gradient of args[0]['w']") goes in its tags and its description."""
    with untracked():
        if g.size == 1:
            return t.clone(memory_format=torch.contiguous_format)
        t = t.contiguous()
        name = _OP_NAMES[op]
        if not _compiling() and (how := _wire.plan(g, t, name)) is not None:  # a dtype the backend lacks
            return _wire.from_wire(all_reduce(_wire.to_wire(t, how), g, op, what), t.dtype, how)
        desc = None if what is None else (lambda: what)
        # (the range covers the wait, as for any blocking call)
        with _issue("all_reduce", g, t, what, desc, op=name):
            rec, tags = _reduce_tags(t, g, name, what)
            nans = _nan_marks(t) if name in ("max", "min") and t.is_floating_point() else None
            if tags is None and nans is None:
                return _wait(_launch(_ALL_REDUCE, t, name, _name(g)), rec)
            n = t.numel()  # the data, NaN marks and tags in one buffer (the copy the out-of-place op makes)
            k = n if nans is None else n + nans.numel()
            buf = torch.empty(k + len(tags or ()), dtype=t.dtype, device=t.device)
            buf[:n].copy_(t.view(-1))
            if nans is not None:
                buf[n:k].copy_(nans if name == "max" else -nans)  # 1 (max) or -1 (min) where NaN
            if tags is not None:
                buf[k:].copy_(torch.tensor(tags, dtype=t.dtype))
            buf = _wait(_launch(_ALL_REDUCE if _compiling() else _ALL_REDUCE_, buf, name, _name(g)), rec)
            if tags is not None:
                _watch.check_reduced_tags(buf[k:].tolist(), tags, g.size, name, rec, g, t.device, desc)  # type: ignore[arg-type]
            out = buf[:n].view(t.shape)
        return out if nans is None else _with_nans(out, buf[n:k], t, g)


def _nan_marks(t: torch.Tensor) -> torch.Tensor:
    """What a max or min all-reduce of the floating ``t`` sends after its data so that a NaN on any
    rank gives NaN, as torch's ``amax`` of the global tensor does (gloo's MAX keeps or drops a NaN
    depending on where it meets it; NCCL's drops it): on the CPU in eager one element, 1 if ``t``
    holds a NaN (read after the reduction: a second all-reduce, of the NaN mask, only when some
    rank had one); elsewhere (no host read on an accelerator, or while compiling) the whole mask."""
    mark = t.isnan().view(-1)
    if t.device.type == "cpu" and not _compiling():
        mark = mark.any().view(1)
    return mark.to(t.dtype)


def _with_nans(out: torch.Tensor, marks: torch.Tensor, t: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """``out``, the max or min over ``g``, with NaN where some rank's ``t`` holds one (``marks``: the
    reduced `_nan_marks`, the same on every rank, so every rank takes the same branch)."""
    if t.device.type == "cpu" and not _compiling():
        if marks.item() == 0:
            return out
        marks = all_reduce(t.isnan().view(-1).to(torch.uint8), g, dist.ReduceOp.MAX)
    return out.masked_fill(marks.view(t.shape) != 0, float("nan"))


def all_gather_blocks(t: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """Gather ``t`` from every index along the axes: returns ``[size, *t.shape]``."""
    if _compiling() and g.size > 1:
        return _all_gather_traced(t, g)
    return all_gather_start(t, g).wait()


def reduce_scatter_blocks(t: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """``t`` is ``[size, *block]``; returns the sum over ranks of block ``index``."""
    if _compiling() and g.size > 1:
        return _reduce_scatter_traced(t, g)
    return reduce_scatter_start(t, g).wait()


# While Dynamo traces, the blocking collectives are the functional op, its wait and the
# `count_collectives` record: what `all_gather_start` and `reduce_scatter_start` add (the handle,
# the watchdog's record and tags, the profiler range) is eager-only, and Dynamo would interpret it
# at each call.


def _all_gather_traced(t: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    with untracked(), torch.no_grad():
        t = t.contiguous()
        _traced("all_gather", g, t)
        out = _WAIT(_ALL_GATHER(t.reshape(-1), g.size, _name(g)))
        return _to_blocks_order(out.view(g.size, *t.shape), g, inverse=True)


def _reduce_scatter_traced(t: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    with untracked(), torch.no_grad():
        t = _to_blocks_order(t, g, inverse=False).contiguous()
        _traced("reduce_scatter", g, t, "sum")
        return _WAIT(_REDUCE_SCATTER(t.reshape(-1), "sum", g.size, _name(g))).view(t.shape[1:])


def all_to_all_blocks(t: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """``t`` is ``[size, *block]``: block j goes to index j; returns what each index sent, stacked."""
    with untracked():
        if g.size == 1:
            return t.clone()
        if not _compiling() and (how := _wire.plan(g, t, "move")) is not None:  # its bytes, block by block
            t = t.contiguous()
            out = all_to_all_blocks(_wire.to_wire(t, how).view(g.size, -1), g)
            return _wire.from_wire(out, t.dtype, how, t.shape)
        t = _to_blocks_order(t, g, inverse=False).contiguous()
        splits = [1] * g.size
        with _issue("all_to_all", g, t):
            out = _launch(_ALL_TO_ALL, t, splits, splits, _name(g))
            tags, rec = _tag_start(t, g), issued()
            out = _wait(out, rec)
            _tag_check(tags, rec, g)
        return _to_blocks_order(out, g, inverse=True)


class Handle:
    """An asynchronous operation in flight: ``wait()`` blocks until it is done and returns its
    result (once; later calls return the same result).

    The buffers of the collective do not depend on this handle to stay alive: the backend's work
    holds its input and output tensors until it has run (gloo's queue holds the work; the
    functional ops' registry holds it until ``wait_tensor``), so the caller may drop its operand
    right after the launch, and a handle dropped unwaited (an exception, a pool rank's reset)
    frees nothing the collective still uses (``tests/test_buffer_lifetimes.py``)."""

    __slots__ = ("_works", "_finish", "_result", "_done", "_rec")

    def __init__(self, works, finish, rec=None):
        self._works = works
        self._finish = finish
        self._result = None
        self._done = False
        self._rec = rec  # the collective's record, for the works' wait (see ``_watchdog``)

    def wait(self):
        if not self._done:
            with torch.no_grad():  # the backend may write results into views of our buffers
                for work in self._works:
                    _watch.wait(work.wait, self._rec)
            self._result = self._finish()
            self._done = True
            self._works = ()
        return self._result


def permute_start(t: torch.Tensor, g: AxisGroup, perm: tuple[tuple[int, int], ...]) -> Handle:
    """Start `permute`; the handle's ``wait()`` returns its result."""
    with untracked():
        me = g.index
        send_to = [d for s, d in perm if s == me and d != me]
        recv_from = [s for s, d in perm if d == me and s != me]
        local = any(s == d == me for s, d in perm)
        if _compiling() and g.size > 1 and any(s != d for s, d in perm):
            # Dynamo cannot trace P2P ops: an all-to-all over the axis with this rank's pair
            # only, which every rank of the axis joins (a rank in no pair too, with empty splits)
            return _permute_compiled(t, g, send_to, recv_from, local)
        if not send_to and not recv_from:
            if g.size > 1:
                g.group  # noqa: B018  (a group made on first use is made by every rank: collective)
            result = t.clone(memory_format=torch.contiguous_format) if local else torch.zeros_like(t)
            return Handle((), lambda: result)
        if (how := _wire.plan(g, t, "move")) is not None:  # a dtype the backend does not move: its bytes
            inner = permute_start(_wire.to_wire(t.contiguous(), how), g, perm)
            return Handle((), lambda: _wire.from_wire(inner.wait(), t.dtype, how, t.shape))
        group = g.group
        flat = t.contiguous()
        ops = [dist.P2POp(dist.isend, flat, g.global_ranks[d], group) for d in send_to]  # type: ignore[arg-type]
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device) if recv_from else flat
        ops += [dist.P2POp(dist.irecv, out, g.global_ranks[s], group) for s in recv_from]  # type: ignore[arg-type]
        with _issue("ppermute", g, flat if send_to else flat.reshape(-1)[:0]):
            works = dist.batch_isend_irecv(ops)
            result = out if recv_from else torch.zeros_like(t)  # a sender's zeros: made while sending
        return Handle(works, lambda: result, issued())


def permute(t: torch.Tensor, g: AxisGroup, perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Send ``t`` from source index to destination index for each pair; others get zeros.

    Point-to-point: only the ranks in ``perm`` communicate, with one ``batch_isend_irecv`` of
    this rank's send and receive (a rank is at most one source and one destination). A rank
    that no pair involves returns zeros without communicating; a pair ``(i, i)`` is a local
    copy. With NCCL, as torch documents for ``batch_isend_irecv``, the first operation on a
    process group must involve all of its ranks; an earlier collective over the axis (any
    fshard collective) satisfies that.
    """
    return permute_start(t, g, perm).wait()


def _permute_compiled(t: torch.Tensor, g: AxisGroup, send_to: list, recv_from: list, local: bool) -> Handle:
    """`permute` in traced code: one functional all-to-all over the axis in which this rank sends
    ``t`` to its destination and receives from its source (every other split empty), the same
    bytes as the point-to-point exchange; every rank of the axis takes part."""
    n = t.numel()
    in_splits = [0] * g.size
    out_splits = [0] * g.size
    for i in range(g.size):  # axis index i lives at group rank order[i]
        r = g.order[i] if g.order is not None else i
        if any(d == i for d in send_to):  # (compared, not indexed: a pair may be a traced int)
            in_splits[r] = n
        if any(s == i for s in recv_from):
            out_splits[r] = n
    flat = t.contiguous().reshape(-1) if send_to else t.reshape(-1)[:0].contiguous()
    with _issue("ppermute", g, flat):
        out = _launch(_ALL_TO_ALL, flat, out_splits, in_splits, _name(g))
        rec = issued()
        out = _wait(out, rec)
    if recv_from:
        result = out.view(t.shape)
    else:  # the (empty) received part still feeds the result, so the graph keeps the all-to-all
        # on this rank too (a collective whose output is unused is dead code to the graph's
        # cleanup: dropped on this rank alone, it left the others waiting in theirs)
        keep = t.reshape(-1) if local else torch.zeros_like(t).reshape(-1)
        result = torch.cat([out, keep]).view(t.shape)
    return Handle((), lambda: result)


def all_gather_start(t: torch.Tensor, g: AxisGroup, agree=None, what=None) -> Handle:
    """Start `all_gather_blocks`; the handle's ``wait()`` returns ``[size, *t.shape]``. With
    ``agree`` (what a combined collective holds), the ranks first agree on it (`_agree`)."""
    with untracked():
        t = t.contiguous()
        if g.size == 1:
            blocks = t.unsqueeze(0)
            return Handle((), lambda: blocks)
        if not _compiling() and (how := _wire.plan(g, t, "move")) is not None:  # its bytes
            inner = all_gather_start(_wire.to_wire(t, how), g, agree, what)
            return Handle((), lambda: _wire.from_wire(inner.wait(), t.dtype, how, (g.size, *t.shape)))
        with _issue("all_gather", g, t, agree, what):
            _agree(t, g, agree, what)
            out = _launch(_ALL_GATHER, t.reshape(-1), g.size, _name(g))
            tags = _tag_start(t, g)
        rec = issued()
        flight = _inflight.track(_name(g), g, lambda: _wait(out, rec))

        def finish():
            with untracked():
                if flight is not None:
                    flight.done()
                blocks = _wait(out, rec)
                _tag_check(tags, rec, g)
                return _to_blocks_order(blocks.view(g.size, *t.shape), g, inverse=True)

        return Handle((), finish)


def reduce_scatter_start(t: torch.Tensor, g: AxisGroup) -> Handle:
    """Start `reduce_scatter_blocks`; the handle's ``wait()`` returns the reduced block."""
    with untracked():
        if g.size == 1:
            block = t[0].clone()
            return Handle((), lambda: block)
        if not _compiling() and (how := _wire.plan(g, t, "sum")) is not None:  # a dtype it lacks
            inner = reduce_scatter_start(_wire.to_wire(t.contiguous(), how), g)
            return Handle((), lambda: _wire.from_wire(inner.wait(), t.dtype, how))
        t = _to_blocks_order(t, g, inverse=False).contiguous()
        with _issue("reduce_scatter", g, t):
            out = _launch(_REDUCE_SCATTER, t.reshape(-1), "sum", g.size, _name(g))
            tags = _tag_start(t, g)
        shape = t.shape[1:]
        rec = issued()
        flight = _inflight.track(_name(g), g, lambda: _wait(out, rec))

        def finish():
            with untracked():
                if flight is not None:
                    flight.done()
                block = _wait(out, rec)
                _tag_check(tags, rec, g)
                return block.view(shape)

        return Handle((), finish)


def broadcast(t: torch.Tensor, g: AxisGroup, src: int) -> torch.Tensor:
    """Every index along the axes receives index ``src``'s ``t``."""
    with untracked():
        if g.size == 1:
            return t.clone(memory_format=torch.contiguous_format)
        t = t.contiguous()
        if not _compiling() and (how := _wire.plan(g, t, "move")) is not None:
            return _wire.from_wire(broadcast(_wire.to_wire(t, how), g, src), t.dtype, how, t.shape)
        root = src if g.order is None else g.order[src]  # the functional op takes the group rank
        with _issue("broadcast", g, t):
            out = _launch(_BROADCAST, t, root, _name(g))
            tags, rec = _tag_start(t, g), issued()
            out = _wait(out, rec)
            _tag_check(tags, rec, g)
            return out


def all_reduce_(t: torch.Tensor, g: AxisGroup, op=dist.ReduceOp.SUM) -> None:
    """In-place all-reduce of a contiguous buffer the caller owns (a packed pytree, say)."""
    with untracked():
        if g.size > 1:
            if not _compiling() and (how := _wire.plan(g, t, _OP_NAMES[op])) is not None:
                w = _wire.to_wire(t, how)
                all_reduce_(w, g, op)
                if how[1] != "view":  # a view reduced in place is already t
                    t.copy_(_wire.from_wire(w, t.dtype, how))
                return
            with _issue("all_reduce", g, t, op=_OP_NAMES[op]):
                if _compiling():  # the traceable form of an in-place collective
                    with torch.no_grad():
                        t.copy_(_WAIT(_ALL_REDUCE(t, _OP_NAMES[op], _name(g))))
                    return
                with _below_autograd():
                    out = _ALL_REDUCE_(t, _OP_NAMES[op], _name(g))
                tags, rec = _tag_start(t, g), issued()
                with _below_autograd():
                    _watch.wait(_WAIT, rec, out)
                _tag_check(tags, rec, g)


def all_reduce_start_(t: torch.Tensor, g: AxisGroup, agree=None, what=None) -> Handle:
    """Start the sum over the group of the flat buffer ``t`` (owned by the caller, reduced in place
    unless it carries tags); the handle's ``wait()`` returns the sum. Eager only (the combined
    collectives of ``_combine``, never queued while torch.compile traces). With ``agree`` (what
    the combined collective holds), the ranks first agree on it (`_agree`), which its tags carry too."""
    with untracked():
        if g.size == 1:
            return Handle((), lambda: t)
        if (how := _wire.plan(g, t, "sum")) is not None:  # a dtype the backend does not reduce
            inner = all_reduce_start_(_wire.to_wire(t, how), g, agree, what)
            return Handle((), lambda: _wire.from_wire(inner.wait(), t.dtype, how))
        with _issue("all_reduce", g, t, agree, what):
            _agree(t, g, agree, what)
            rec, tags = _reduce_tags(t, g, "sum", agree)
            n = t.numel()
            if tags is not None:  # the data and its tags in one buffer, as `all_reduce` sends them
                buf = torch.empty(n + len(tags), dtype=t.dtype, device=t.device)
                buf[:n].copy_(t)
                buf[n:].copy_(torch.tensor(tags, dtype=t.dtype))
                t = buf
            with _below_autograd():
                out = _ALL_REDUCE_(t, "sum", _name(g))
        flight = _inflight.track(_name(g), g, lambda: _wait(out, rec))

        def finish():
            with untracked():
                if flight is not None:
                    flight.done()
                with _below_autograd():
                    _watch.wait(_WAIT, rec, out)
                if tags is not None:
                    _watch.check_reduced_tags(t[n:].tolist(), tags, g.size, "sum", rec, g, t.device, what)
                return t[:n]

        return Handle((), finish)


def gather_blocks(t: torch.Tensor, g: AxisGroup, dst: int) -> torch.Tensor | None:
    """Gather ``t`` from every index along the axes onto index ``dst`` (one ``dist.gather``).

    Returns ``[size, *t.shape]`` (row i from index i) on ``dst`` and None elsewhere.
    """
    with untracked():
        t = t.contiguous()
        if g.size == 1:
            return t.unsqueeze(0).clone()
        if (how := _wire.plan(g, t, "move")) is not None:  # a dtype the backend does not move: its bytes
            got = gather_blocks(_wire.to_wire(t, how), g, dst)
            return None if got is None else _wire.from_wire(got, t.dtype, how, (g.size, *t.shape))
        out = torch.empty(g.size, *t.shape, dtype=t.dtype, device=t.device) if g.index == dst else None
        rows = list(out.unbind(0)) if out is not None else None
        with _issue("gather", g, t):
            _watch.wait(dist.gather, issued(), t, rows, dst=g.global_ranks[dst], group=g.group)
        if out is None:
            return None
        return _to_blocks_order(out, g, inverse=True)


def reduce_(t: torch.Tensor, g: AxisGroup, dst: int) -> None:
    """Sum the contiguous buffer ``t`` (owned by the caller) over the axes onto index ``dst``.

    In place (one ``dist.reduce``): afterwards ``t`` holds the sum on ``dst``; elsewhere its
    contents are unspecified.
    """
    with untracked():
        if g.size > 1:
            if (how := _wire.plan(g, t, "sum")) is not None:  # a dtype the backend does not reduce
                w = _wire.to_wire(t, how)
                reduce_(w, g, dst)
                if how[1] != "view":  # a view reduced in place is already t
                    t.copy_(_wire.from_wire(w, t.dtype, how))
                return
            with _issue("reduce", g, t):
                _watch.wait(dist.reduce, issued(), t, dst=g.global_ranks[dst], group=g.group)


def gather_shapes(
    xs, g: AxisGroup, device=None, where: str = "", paths=None, error=None
) -> list[list[tuple[int, ...]]]:
    """The shapes of tensors ``xs`` at every index of ``g``: ``out[i][k]`` is index ``i``'s
    ``xs[k].shape``. One small all-gather of ``[ndim + 256 * kind, *shape]`` rows padded to 9
    numbers (shapes past 8 dims are known by their first 8; ``kind``: a digest of the dtype and
    device type), so that ranks can compare shapes before a collective whose sizes must agree. The
    dtypes and device types must agree already: otherwise ``error`` (default `CollectiveError`) is
    raised on every rank alike, naming ``where`` (the public function), the operand (``paths[k]``)
    and which ranks hold which dtype (a collective of mismatched dtypes fails inside the backend, or
    ends the process in gloo). ``device``: where the rows travel (default: ``xs[0]``'s device)."""
    mine: list[int] = []
    for x in xs:
        row = [x.dim() + 256 * _kind(x.dtype, x.device.type), *x.shape[:8]]
        mine += row + [0] * (9 - len(row))
    with untracked():
        t = torch.tensor(mine, dtype=torch.int64, device=device or xs[0].device)
        rows = all_gather_blocks(t, g).tolist()
    for k in range(len(xs)):
        if any(row[9 * k] != rows[0][9 * k] for row in rows):
            kinds = [row[9 * k] >> 8 for row in rows]
            raise (error or _errors.CollectiveError)(
                _kinds_differ(kinds, g, where, paths[k] if paths else None)
            )
    return [
        [tuple(row[9 * k + 1 : 9 * k + 1 + min(row[9 * k] & 255, 8)]) for k in range(len(xs))] for row in rows
    ]


def _kind(dtype: torch.dtype, device_type: str) -> int:
    return zlib.crc32(f"{dtype} {device_type}".encode()) & 0x7FFFFFFF


_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "hpu", "mtia", "meta", "xla", "privateuseone")


def _kinds_differ(kinds: list, g: AxisGroup, where: str, path) -> str:
    dtypes = [d for d in vars(torch).values() if isinstance(d, torch.dtype)]
    names = {_kind(d, v): f"{d} on {v}" for d in dtypes for v in _DEVICE_TYPES}
    by: dict = {}
    for i, kind in enumerate(kinds):
        by.setdefault(names.get(kind, f"a dtype or device type #{kind}"), []).append(g.global_ranks[i])
    held = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {k}" for k, r in by.items())
    common = max(by, key=lambda k: len(by[k])).split(" on ")[0]
    what = f"the operand at {path}" if path else "the operand"
    return (
        f"{where or 'a collective'} over {' '.join(g.names) or 'the world'}: {what} has a different dtype or "
        f"device type on different ranks ({held}); every rank must hand the same dtype on the same kind of "
        f"device (a collective of mismatched dtypes fails inside the backend). Cast it on every rank alike, "
        f"e.g. x.to({common}) where the ranks' values are made (a per-rank loader's batch as it is loaded)"
    )


def broadcast_object(objs: list, src: int) -> None:
    """``dist.broadcast_object_list`` over the world, counted as a broadcast."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        _counts.record_world("broadcast")
        rec = _watch.begin("broadcast", _watch.world_group(), torch.empty(len(objs), dtype=torch.uint8))
        with _span("broadcast", ("world",), 0):
            _watch.wait(dist.broadcast_object_list, rec, objs, src=src)


def scatter(out: torch.Tensor, blocks: list | None, src: int) -> None:
    """``dist.scatter`` over the world (one block per global rank), counted."""
    if (how := _wire.plan(_watch.world_group(), out, "move")) is not None:  # a dtype the backend lacks
        wire = _wire.to_wire(out.contiguous(), how)  # its bytes: a view of ``out`` when contiguous
        scatter(wire, None if blocks is None else [_wire.to_wire(b.contiguous(), how) for b in blocks], src)
        if wire.data_ptr() != out.data_ptr() or not out.is_contiguous():
            out.copy_(_wire.from_wire(wire, out.dtype, how, out.shape))
        return
    nbytes = out.numel() * out.element_size()
    _counts.record_world("scatter", nbytes)
    rec = _watch.begin("scatter", _watch.world_group(), out)
    with _span("scatter", ("world",), nbytes):
        _watch.wait(dist.scatter, rec, out, blocks, src=src)
