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
wait for the end of the backward). It puts the gradient, cast to ``reduce_dtype``, in the
bucket planned for it and launches, asynchronously, every bucket that is complete, strictly in
plan order. The plan is made when the backward starts and is the same on every rank whatever
order ``f`` used the inputs in (DDP's rule): inputs in reverse order, per (axis group, dtype,
device), a bucket taking gradients while they fit in ``bucket_mb`` MiB (a larger one alone), the
first of each key at most 1 MiB, as DDP's, so that a reduction starts early even when the whole
model fits in one bucket; inputs whose tap will not run in this backward
(``torch._C._will_engine_execute_node``) are left out. (Buckets filled in ready order would be
summed misaligned when Python code on per-rank values orders the uses differently on each rank.)
When every gradient fits in one bucket per key (at most 1 MiB in all), no taps are made: such a
bucket could only launch when its last gradient is in, which is when the backward reaches the
boundary, and the taps (a Python autograd node per input, made and run every step) would only
cost. When backward reaches the boundary (once every use is done), it launches the buckets still
waiting (zeros for a gradient that never came on this rank), waits for all of them and adds the
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
import zlib

import torch
import torch.distributed as dist

from . import _comm, _compile, _inflight, _state
from . import _watchdog as _watch
from ._comm import untracked
from ._errors import CollectiveError, FshardError
from ._mesh import AxisGroup
from ._primitives import AllReduce, Pvary, _functorch_active, apply
from ._twins import _version, twin_entry
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
# Whether _PENDING may hold a sum: what a compiled call guards on (`_no_sync_graph.mode`), so that
# the graph of a step while gradients are pending is another one than the plain step's.
_any_pending = False


@_state.job_state(order=40)
def _reset() -> None:
    """A new job: outside any fs.no_sync block, with no gradient an earlier job kept pending."""
    global _sync, _any_pending
    _sync = True
    _any_pending = False
    _PENDING.clear()


def _take_pending(leaf, g=None, what=None):
    """The pending ``(axis group, sum)`` of ``leaf``, dropped; None if there is none. With ``g``, the
    group its gradient is summed over now: a sum kept over other ranks raises (summed over ``g``,
    it would count the ranks outside its own group's several times, or miss some)."""
    global _any_pending
    hit = _PENDING.get(id(leaf))
    if hit is None or hit[0]() is not leaf:
        return None
    del _PENDING[id(leaf)]
    _any_pending = bool(_PENDING)
    if g is not None and g is not hit[1] and set(g.global_ranks) != set(hit[1].global_ranks):
        raise FshardError(
            f"fs.no_sync kept the gradient of {what or 'a parameter'} pending as a sum over mesh axes "
            f"{', '.join(hit[1].names)}, and a later call sums it over {', '.join(g.names)}: use the "
            f"parameter with values that vary over the same mesh axes in every micro-batch"
        )
    return hit[1], hit[2]


def _drop_pending(key: int) -> None:
    global _any_pending
    _PENDING.pop(key, None)
    _any_pending = bool(_PENDING)


def _add_pending(leaf, g, twin, what=None) -> None:
    global _any_pending
    hit = _take_pending(leaf, g, what)
    total = twin.detach().clone() if hit is None else hit[1] + twin.detach()
    key = id(leaf)
    if hit is None:
        weakref.finalize(leaf, _drop_pending, key)
    _PENDING[key] = (weakref.ref(leaf), g, total)
    _any_pending = True


class no_sync:
    """Accumulate gradients over micro-batches without reducing them (DDP's ``no_sync``).

    Calls of shard_map'd functions made inside the block keep the data-parallel gradient
    reductions of their leaf inputs (parameters) pending: each backward adds this rank's
    unreduced gradient to a buffer per parameter (the invariant part of the gradient is
    accumulated as usual). The first call made outside the block reduces its own gradients
    together with everything pending, in the same buckets: one reduction for all the
    micro-batches, and ``p.grad`` is then exactly what one big batch gives. Eager and compiled
    calls (``torch.compile``, ``fs.compile``) alike, mixed in any order. The gradients
    ``fs.value_and_grad`` returns inside ``f`` are values, always reduced: the block keeps none
    of them pending.

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


def _pending_group(leaf):
    """The axis group of ``leaf``'s pending (`no_sync`) gradient, or None."""
    hit = _PENDING.get(id(leaf)) if leaf is not None and _PENDING else None
    return hit[1] if hit is not None and hit[0]() is leaf else None


class BoundaryState:
    """Per call: for each boundary input, the axis group its twin is summed over (or None),
    its dtype, shape and device, whether it is a leaf (whose reduction `no_sync` may defer), and
    its twin's tap; during one backward, the buckets (planned in a fixed order, the same on every
    rank) being filled and those launched."""

    __slots__ = (
        "groups",
        "bucket_bytes",
        "dtypes",
        "shapes",
        "devices",
        "leaves",
        "taps",
        "defer",
        "param_dtype",
        "reduce_dtype",
        "early",
        "task",
        "plan",
        "slot",
        "next",
        "extra",
        "launched",
        "where",
        "alone",
    )

    def __init__(self, xs, bucket_mb: float, param_dtype=None, reduce_dtype=None, where=None, defer=True):
        n = len(xs)
        self.groups: list[AxisGroup | None] = [None] * n
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.dtypes = [x.dtype for x in xs]
        self.shapes = [x.shape for x in xs]
        self.devices = [x.device for x in xs]
        self.leaves = [x if x.is_leaf else None for x in xs]
        self.taps: list = [None] * n  # weak references to the twins' TwinTap nodes
        self.defer = defer and not _sync
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        # Launch from the taps only when every input is on one device: the autograd engine runs
        # the backward of each device on its own thread (the buckets' order is fixed, but a thread
        # would wait on another's bucket).
        self.early = len({x.device for x in xs}) == 1
        if self.early:  # one bucket per key at most: it could not launch before the boundary anyway
            total = sum(x.numel() * (reduce_dtype or x.dtype).itemsize for x in xs)
            self.early = total > min(self.bucket_bytes, FIRST_BUCKET_BYTES)
        self.task: int | None = None  # the backward (autograd graph task) the buckets below belong to
        self.plan: list | None = None  # buckets: [key, indices, gradients, missing, bytes, cap, position]
        self.slot: dict = {}  # input index -> (bucket, position)
        self.next = 0  # the next bucket to launch: buckets go strictly in plan order
        self.extra: list = []  # gradients outside the plan (launched at the boundary, by index)
        self.launched: list = []  # (work, flat, indices, shapes, record, tags, group, flight), in launch order
        self.where = where  # (function name, key path of input i) for errors, or None
        # per input, after a backward: the axis group whose all-reduce alone made its gradient (no
        # invariant use added to it), or None; such a gradient is the same on every rank of the group
        self.alone: list[AxisGroup | None] = [None] * n

    def begin(self) -> None:
        """Start this backward's buckets; drop what an abandoned backward of the graph left."""
        task = _graph_task()
        if task != self.task:
            self.task = task
            self.plan = None
            self.slot = {}
            self.next = 0
            self.extra = []
            self.launched = []

    def _ct_dtype(self, i: int):
        return self.reduce_dtype or self.dtypes[i]

    def make_plan(self, present) -> None:
        """Assign each input whose gradient this backward reduces (``present(i)``) to a bucket, in
        reverse input order (as DDP: roughly the order a backward makes them ready), per (axis
        group, dtype, device): a bucket takes gradients while they fit in ``bucket_mb`` (a larger
        one alone), the first of each key at most 1 MiB. The order depends only on what every rank
        has in common, never on the order gradients become ready, which Python code on per-rank
        values (``if x.sum().item() > 0``) may change: buckets are summed aligned."""
        plan: list = []
        open_: dict = {}
        for i in reversed(range(len(self.groups))):
            leaf = self.leaves[i]
            if self.defer and leaf is not None:
                continue  # kept pending by no_sync
            g = self.groups[i] or _pending_group(leaf)
            if g is None or not present(i):
                continue
            dtype = self._ct_dtype(i)
            nbytes = self.shapes[i].numel() * dtype.itemsize
            if not nbytes:
                continue
            key = (g, dtype, self.devices[i])
            b = open_.get(key)
            if b is not None and b[4] + nbytes > b[5]:
                del open_[key]
                b = None
            if b is None:
                cap = (
                    self.bucket_bytes
                    if any(c[0] == key for c in plan)
                    else min(self.bucket_bytes, FIRST_BUCKET_BYTES)
                )
                b = open_[key] = [key, [], [], 0, 0, cap, len(plan)]
                plan.append(b)
            self.slot[i] = (b[6], len(b[1]))
            b[1].append(i)
            b[2].append(None)
            b[3] += 1
            b[4] += nbytes
            if b[4] >= b[5]:
                del open_[key]
        # What each bucket holds travels in the tags of its all-reduce (CPU): ranks whose plans
        # differ (f used an input on some ranks only) raise instead of summing misaligned buckets.
        # Per axis group: its members hold the same blocks of the inputs reduced over it.
        per: dict = {}
        for b in plan:
            per.setdefault(b[0][0], []).append((b[1], str(b[0][1])))
        sigs = {g: zlib.crc32(repr(v).encode()) for g, v in per.items()}
        seen: dict = {}
        for b in plan:
            k = seen[b[0][0]] = seen.get(b[0][0], -1) + 1
            b.append((sigs[b[0][0]], k))
        self.plan = plan

    def tap_present(self, i: int) -> bool:
        """Whether input ``i``'s gradient comes in this backward (its tap will run, or no_sync left one)."""
        if _pending_group(self.leaves[i]) is not None:
            return True
        ref = self.taps[i]
        node = ref() if ref is not None else None
        if node is None:
            return False
        try:
            return bool(torch._C._will_engine_execute_node(node))
        except RuntimeError:
            return False

    def add(self, i: int, g: AxisGroup, ct: torch.Tensor) -> None:
        """Put input ``i``'s unreduced gradient ``ct`` in its planned bucket; launch, in plan order,
        every bucket that is now complete."""
        if not ct.numel():  # nothing to reduce
            self.launched.append((None, ct.reshape(-1), [i], [ct.shape], None, None, g, None))
            return
        if self.plan is None:
            self.make_plan(lambda k: k == i or self.tap_present(k))
        plan: list = self.plan or []
        bucket, pos = self.slot.get(i, (-1, 0))
        b = plan[bucket] if bucket >= 0 else None
        if b is None or b[0][0] is not g or b[2][pos] is not None:
            self.extra.append((i, g, ct))  # outside the plan: reduced at the boundary
            return
        b[2][pos] = ct
        b[3] -= 1
        while self.next < len(plan) and plan[self.next][3] == 0:
            self._launch(plan[self.next])
            self.next += 1

    def _launch(self, b) -> None:
        key, idx, cts = b[0], b[1], b[2]
        for k, i in enumerate(idx):  # a gradient that never came on this rank: zeros
            if cts[k] is None:
                cts[k] = torch.zeros(self.shapes[i], dtype=key[1], device=key[2])
        self._reduce(key[0], idx, cts, b[7])

    def _reduce(self, g: AxisGroup, idx: list, cts: list, salt) -> None:
        # a copy (ct may be shared with other grads): one C++ call for a bucket of many, with
        # room for the tags after the data
        dtype = cts[0].dtype
        k = _comm.reduce_tag_len(g, dtype, cts[0].device)
        if k:
            flat = _flatten([*cts, cts[0].new_zeros(2 * k)])
        else:
            flat = _flatten(cts) if len(cts) > 1 else torch.cat([cts[0].reshape(-1)])
        n = flat.numel() - 2 * k
        tags = None
        # counted, labelled while profiling; under fs.debug, checked with what it holds before it is sent
        with _comm._issue(
            "all_reduce", g, flat[:n] if k else flat, salt, lambda: f"a bucket of {self._held(idx)}"
        ):
            rec = _comm.issued()
            if k and rec is not None:
                # the collective's own tag, then one with what the bucket holds mixed in
                mine = _watch.reduce_tags(rec, dtype, g.size, "sum")
                held = _watch.reduce_tags(rec, dtype, g.size, "sum", salt)
                if mine is not None and held is not None:
                    tags = (mine, held)
                    flat[n:].copy_(torch.tensor(mine + held, dtype=dtype))
            work = dist.all_reduce(flat, group=g.group, async_op=True)  # type: ignore[arg-type]
        flight = _inflight.track(_comm._name(g), g, lambda: _comm.wait_work(work, rec))
        self.launched.append((work, flat, idx, [c.shape for c in cts], rec, tags, g, flight))

    def finish(self, grads: list) -> None:
        """Launch the buckets still waiting (in plan order), wait for all, add the sums into ``grads``."""
        plan = self.plan or []
        while self.next < len(plan):
            self._launch(plan[self.next])
            self.next += 1
        for i, g, ct in sorted(self.extra, key=lambda e: e[0]):
            self._reduce(g, [i], [ct], ("outside the plan", i))
        launched, self.launched, self.task, self.plan = self.launched, [], None, None
        self.extra = []
        for work, flat, idx, shapes, rec, tags, g, flight in launched:
            if flight is not None:
                flight.done()
            if work is not None:
                _comm.wait_work(work, rec)  # marked as a wait in that collective (hang reports)
            if tags is not None:
                self._check_tags(flat, tags, idx, rec, g)
            offset = 0
            dtypes = self.dtypes
            for i, shape in zip(idx, shapes):
                n = shape.numel()
                red = flat[offset : offset + n].view(shape)
                if red.dtype != dtypes[i]:
                    red = red.to(dtypes[i])
                offset += n
                self.alone[i] = g if grads[i] is None else None
                grads[i] = red if grads[i] is None else grads[i] + red

    def _check_tags(self, flat: torch.Tensor, tags: tuple, idx: list, rec: tuple, g: AxisGroup) -> None:
        """After a bucket's all-reduce: raise if the ranks reduced other collectives or buckets."""
        mine, held = tags
        got = flat[flat.numel() - len(mine) - len(held) :].tolist()
        if _watch.reduced_tags_agree(got[: len(mine)], mine, g.size, "sum"):
            if _watch.reduced_tags_agree(got[len(mine) :], held, g.size, "sum"):
                return
            raise CollectiveError(self._mismatch_text(idx, rec, g))
        raise CollectiveError(
            f"fshard: the ranks of the group over {','.join(g.names)} ({_watch._ranks_text(g.global_ranks)}) "
            f"ran different collectives together: this rank's {_watch.describe(rec)}, a bucket "
            f"of {self._held(idx)}, met another collective on another rank (the tags sent with it "
            f"disagreed); its result was not returned. {_watch._ORDER_FIX}. fs.debug() (or FSHARD_DEBUG=1) "
            "checks each collective before it is sent"
        )

    def what(self, i: int) -> str:
        """Input ``i`` in an error: its key path and the function's name."""
        name, path = self.where if self.where is not None else ("f", None)
        return f"{path(i) if path is not None else f'input {i}'} (an input of {name})"

    def _held(self, idx: list) -> str:
        name, path = self.where if self.where is not None else ("f", None)
        held = ", ".join(path(i) if path is not None else f"input {i}" for i in idx)
        return f"the gradients of {held} (inputs of {name})"

    def _mismatch_text(self, idx: list, rec: tuple, g: AxisGroup) -> str:
        axes = ",".join(g.names)
        return (
            f"fshard: the ranks of the group over {axes} ({_watch._ranks_text(g.global_ranks)}) reduced "
            f"different gradients together in one bucket: this rank's bucket held {self._held(idx)}, "
            f"another rank's bucket held other inputs (the tags sent with it disagreed); its result was not "
            f"returned. Each rank buckets the gradients of the inputs f used with values varying over {axes} "
            f"in that backward, so an input that f uses on some ranks only (a Python branch on the rank or on "
            f"per-rank data: `if rank == 0: loss = loss + g(w)`) is reduced by those ranks alone. Use every "
            f"input on every rank alike: select with torch.where, or scale the term by a 0/1 tensor"
        )


_flatten = torch._C._nn.flatten_dense_tensors
"""One flat copy of a list of tensors (of one dtype and device), made in C++."""

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
            dtype = state.reduce_dtype or state.dtypes[i]
            if ct.dtype != dtype:
                ct = ct.to(dtype)
            hit = (
                _take_pending(leaf, state.groups[i], state.what(i)) if leaf is not None and _PENDING else None
            )
            if hit is not None:
                ct = ct + hit[1]
            state.add(i, state.groups[i], ct)  # type: ignore[arg-type]
        return None, None, None


def _tap(state: BoundaryState, i: int, raw: torch.Tensor) -> torch.Tensor:
    out = apply(TwinTap, state, i, raw)
    if out.grad_fn is not None:
        state.taps[i] = weakref.ref(out.grad_fn)
    return out


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
        state.alone = [None] * n
        differentiable = torch.is_grad_enabled()
        if not differentiable:
            state.begin()  # keeps the buckets the taps filled in this backward
            if state.plan is None:  # no tap launched: plan from what came (the same on every rank)
                state.make_plan(
                    lambda i: cts[2 * i + 1] is not None or _pending_group(state.leaves[i]) is not None
                )
        for i in range(n):
            # The twin's gradient arrives here only if its tap passed it on (see TwinTap).
            vis, twin = cts[2 * i], cts[2 * i + 1]
            g = state.groups[i]
            dtype = state.dtypes[i]
            grads[i] = vis if vis is None or vis.dtype == dtype else vis.to(dtype)
            if differentiable:  # create_graph: keep the reduction differentiable, nothing deferred
                if twin is not None and g is not None:
                    red = apply(AllReduce, twin, g).to(dtype)
                    state.alone[i] = g if grads[i] is None else None
                    grads[i] = red if grads[i] is None else grads[i] + red
                continue
            leaf = state.leaves[i]
            if twin is not None and g is not None and twin.dtype != (state.reduce_dtype or dtype):
                twin = twin.to(state.reduce_dtype or dtype)
            if state.defer and leaf is not None:
                if twin is not None and g is not None:
                    _add_pending(leaf, g, twin, state.what(i))
                continue
            hit = (
                _take_pending(leaf, g if twin is not None else None, state.what(i))
                if leaf is not None and _PENDING
                else None
            )
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


class _CastState:
    """A cast input's twin (no buckets): the axis group its implicit cast sums over, once known."""

    __slots__ = ("groups", "cast", "reduce_dtype", "deferred")

    def __init__(self, cast, reduce_dtype, deferred=None):
        self.groups: list = [None]
        self.cast = cast
        self.reduce_dtype = reduce_dtype
        self.deferred = (
            deferred  # compiled, under fs.no_sync or with gradients pending: its `_no_sync_graph.Deferred`
        )


def _cast_twin(st: _CastState, x: torch.Tensor) -> torch.Tensor:
    """The varying twin of ``x.to(st.cast)``: ``x`` cast to varying in ``reduce_dtype`` (or its own
    dtype), then to ``cast``; the backward sums the gradient before casting it back, as a bucket
    (or, compiled under fs.no_sync, keeps it pending: `_no_sync_graph`)."""
    y = x if st.reduce_dtype is None else x.to(st.reduce_dtype)
    d = st.deferred
    return (apply(Pvary, y, st.groups[0]) if d is None else d.cast(y, st.groups[0], apply, Pvary)).to(st.cast)


def wrap(
    xs: list,
    masks: list[int],
    tr,
    all_bits: int,
    bucket_mb: float,
    cast=None,
    reduce_dtype=None,
    path=None,
    defer: bool = True,
) -> list:
    """Put the tensors of ``xs`` (varying over ``masks``) that need a gradient and may meet more
    varying data behind one GradBoundary of trace ``tr``; cast floating ones to ``cast``.
    ``path(i)``: the key path of ``xs[i]`` (named in errors). ``defer``: whether `no_sync` may keep
    the gradients of leaves pending (not for ``fs.value_and_grad``'s own primals: its gradients
    are values it returns, always reduced).

    Returns the tensors for ``f`` (visible outputs, tagged like their inputs). Without
    ``bucket_mb`` (compiled calls, or under torch.func, or without grad) only the casts apply;
    with grad, a cast input's implicit cast to varying is made on the input's side of its dtype
    cast (`_cast_twin`), so its gradient is summed in ``reduce_dtype`` as in the buckets.
    """
    grad = torch.is_grad_enabled() and not _functorch_active()
    # (forward-mode AD, torch.autograd.forward_ad: the boundary and its taps have no jvp rule)
    use = bucket_mb and grad and torch.autograd.forward_ad._current_level < 0
    out = list(xs)
    idx = []
    for i, (x, m) in enumerate(zip(xs, masks)):
        if not isinstance(x, torch.Tensor):
            continue
        if use and x.requires_grad and m != all_bits:
            idx.append(i)
        elif cast is not None and x.is_floating_point() and x.dtype != cast:
            out[i] = vis = x.to(cast)
            if m:
                tag(vis, tr, m)
            if grad and x.requires_grad and m != all_bits:
                # f's varying uses of vis (or of an invariant function of it) get the twin below
                # (the input itself is no entry: f never sees it, and it is no twin of itself)
                d = tr.inputs.get(id(x)) if tr.inputs else None  # (a key path, or a compiled no_sync cast)
                st = _CastState(cast, reduce_dtype, d if hasattr(d, "cast") else None)
                src = twin_entry(x, x, 0, st)
                tr.twins[id(vis)] = twin_entry(
                    vis, None, 0, st, (src, _cast_twin, (st, x), None), _version(vis, tr)
                )
    if not idx:
        return out
    where = (tr.where, (lambda k: path(idx[k])) if path is not None else None)
    state = BoundaryState([xs[i] for i in idx], bucket_mb, cast, reduce_dtype, where, defer)
    got = apply(GradBoundary, state, *[xs[i] for i in idx])
    for k, i in enumerate(idx):
        vis, twin = got[2 * k], got[2 * k + 1]
        if masks[i]:
            tag(vis, tr, masks[i])
        out[i] = vis
        # The twin f's uses see is made on first use (_vma._twin_of derives it from the hidden
        # one): a TwinTap, created just before the first use so that its backward runs as soon
        # as the twin's gradient is complete (and never for an input used invariantly only).
        # Without early launches (every gradient fits in one bucket per key) the twin itself.
        if state.early:
            src = twin_entry(twin, twin, k, state)  # the hidden twin: no entry of its own
            tr.twins[id(vis)] = twin_entry(
                vis, None, k, state, (src, _tap, (state, k, twin), None), _version(vis, tr)
            )
        else:
            tr.twins[id(vis)] = twin_entry(vis, twin, k, state, None, _version(vis, tr))
    return out


class _ScaleCotangent(torch.autograd.Function):
    """Identity forward; the backward multiplies the cotangent by ``scale`` (``check=False``)."""

    @staticmethod
    def forward(x, scale):
        with untracked():
            return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, ct):
        return ct * ctx.scale, None

    @staticmethod
    def jvp(ctx, x_t, _):  # the forward is the identity
        return x_t.clone()

    @staticmethod
    def vmap(info, in_dims, x, scale):
        return apply(_ScaleCotangent, x, scale), in_dims[0]


_compile.hide_jvp([_ScaleCotangent])  # as the primitives' (torch.compile of check=False)
_compile.mark_backward([_ScaleCotangent])
