"""Varying-axes tracking ("vma") for plain tensors inside shard_map.

Every value inside ``f`` varies over a set of mesh axes (SEMANTICS: inputs over the axes
their spec splits, an op's result over the union of its operands', ``axis_index(a)`` over
``a``). We keep that set as a bit mask in an attribute on the tensor, stamped with the
current trace so stale tags from earlier calls read as "invariant".

A ``TorchFunctionMode`` propagates the masks through torch ops. Where an operand that
needs a gradient meets operands varying over more axes, it is cast with ``pvary``: the
identity forward, a ``psum`` over the missing axes backward. The cast is cached per
tensor and axes within one call, so a replicated parameter used many times with
data-parallel data still gets exactly one gradient reduction.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.overrides import TorchFunctionMode

from . import _compile, _shapes, _state
from ._comm import untracked
from ._errors import CollectiveError, TracingError
from ._mesh import Mesh
from ._opkinds import _INPLACE, _PLAIN, _draws, _kind_of, _random_rule
from ._primitives import Pvary, PvaryInput, _functorch_active, apply
from ._scalars import (
    _ATTR,
    _CARRIERS,
    _LEAVES,
    _is_wrapped,
    _plain_args,
    _scan,
    _stack,
    _unwrap,
    _varying_axes_text,
    _varying_scalar,
    check_traced_number,
    compiled_branch,
    differentiating,
    hidden_bits,
    needs_grad,
    taint,
    taint_note,  # noqa: F401  (for shard_map's replication check)
    taint_of,
)
from ._twins import _derive_twin, _drop_twins, _twin_entry, _twin_of

_Tensor = torch.Tensor


def may_need_grad(t) -> bool:
    """``t.requires_grad``, or under a transform `needs_grad` (also a tangent that needs one)."""
    return t.requires_grad or (differentiating() and needs_grad(t))


_compiling = _compile.compiling


class Trace:
    """State of one running shard_map call on this rank; a context manager that runs its body.

    ``with trace:`` makes it the innermost trace (what collectives see) and, when the mesh has
    an axis of size > 1, propagates varying axes through every torch op with `VmaMode`. Tags
    on tensors hold the trace's integer ``id`` (not the trace), so tensors stay picklable and
    keep nothing alive after the call.
    """

    __slots__ = (
        "mesh",
        "pvary_cache",
        "cast_groups",
        "where",
        "id",
        "_mode",
        "twins",
        "bucket_mb",
        "uneven",
        "ragged",
        "shapes_differ",
        "queue",
        "pending",
        "compiled",
        "inputs",
        "taint",
        "taint_why",
        "fresh",
        "branch",
        "level",
    )

    def __init__(self, mesh: Mesh, where: str):
        self.mesh = mesh
        self.where = where
        self.pvary_cache: dict = {}
        self.cast_groups: dict = {}  # missing axes (bits) -> the AxisGroup pvary sums over (eager)
        self.id = _compile.next_id()
        # made while torch.compile traces: a constant of the trace, read on the per-op path
        # instead of calling torch.compiler.is_compiling() for every op
        self.compiled = _compiling()
        if self.compiled:
            _compile.keep_collectives_in_place()
        self._mode: VmaMode | None = None
        # id(visible) -> (visible, twin, index, BoundaryState) for tensors behind a GradBoundary
        self.twins: dict = {}
        # id(input) -> key path for inputs cast outside the gradient buckets (PvaryInput; under no_sync
        # or with gradients pending: a `_no_sync_graph.Deferred`), or None
        self.inputs: dict | None = None
        self.bucket_mb = 0.0  # the shard_map's bucket size (for value_and_grad inside f)
        self.uneven = False  # some input has uneven blocks: collectives first compare their operands' shapes
        # a varying operand met an op whose output shape depends on the data (x[mask], nonzero,
        # unique, ...): the outputs' global shapes are found from their gathered block shapes
        self.ragged = False
        # a value's shape may differ between ranks beyond uneven and ragged blocks: fs.PerRank values
        # (each rank's own tree) and the results of fs.switch on a varying index (_stages)
        self.shapes_differ = False
        self.queue = None  # collectives issued and not yet run (`_combine.Queue`): flushed by the next op
        self.pending = None  # flushed collectives whose results are not filled yet (`_combine.Flight`)
        # the axes a value that left tracking varied over (a Python branch on it, `_scalars.taint`):
        # every value made afterwards varies over them; what did it, for the replication check
        self.taint = 0
        self.taint_why: str | None = None
        # id(collective result made after the latest taint) -> (weak ref, the axes it is the same
        # over on every rank whatever branches the ranks took)
        self.fresh: dict = {}
        # the axes of the fs.switch indices whose branch is running (ranks along them run other code),
        # and torch.func's depth at the call (a deeper transform was entered in f: `same_batch`)
        self.branch = 0
        self.level = None if self.compiled else torch._C._functorch.maybe_current_level()

    def __enter__(self) -> Trace:
        _stack.append(self)
        if self.mesh.tracked:
            mode = self._mode = VmaMode(self)
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        # Each step runs even when an earlier one raises: a collective flushed here may raise (a
        # CollectiveError, a timeout) on some ranks only, and a VmaMode left on torch's mode stack
        # would then track (and pvary) every op of that process's later calls, so that its
        # backward issued other collectives than its peers'.
        q, self.queue = self.queue, None  # a failed call leaves no queued work behind
        try:
            if exc[0] is None:
                if q is not None:
                    q.flush()
                if self.pending is not None:
                    self.pending.drain()  # f returned: the results it queued are filled
        finally:
            self.pending = None
            mode, self._mode = self._mode, None
            try:
                if mode is not None:
                    mode.__exit__(*exc)
            finally:
                _stack.pop()
                self.pvary_cache.clear()


def current(where: str) -> Trace:
    """The innermost running trace, or a CollectiveError naming ``where``."""
    if not _stack:
        raise CollectiveError(
            f"fs.{where} can only be called inside a function run by fs.shard_map, where mesh axes "
            f"have names; wrap the calling function with fs.shard_map(f, mesh=..., in_specs=..., "
            f"out_specs=...)"
        )
    tr = _stack[-1]
    if tr.compiled:
        _compile.check_transforms()
    if tr.queue is not None:  # another collective: the queued ones run first, in issue order
        tr.queue.flush()
    if tr.pending is not None:
        tr.pending.drain()
    return tr


def active() -> Trace | None:
    return _stack[-1] if _stack else None


@_state.job_state(order=10)
def reset() -> int:
    """End the traces (and their queued collectives) and `VmaMode`s on torch's mode stack that an
    earlier job left (a pool rank, `_state`); returns how many were ended (0: the process was clean)."""
    ended = 0
    while _stack:
        tr = _stack[-1]
        tr.queue = tr.pending = None  # never run: the job that queued it has ended
        tr.__exit__(None, None, None)
        ended += 1
    modes = torch.overrides._get_current_function_mode_stack()
    while modes and isinstance(modes[-1], VmaMode):
        modes.pop().__exit__(None, None, None)
        ended += 1
    return ended


def get(t, tr: Trace) -> int:
    """The varying-axes mask of ``t`` in trace ``tr`` (0: invariant)."""
    tag = getattr(t, _ATTR, None)
    if tag is not None and tag[0] == tr.id:
        return tag[1]
    return _hidden(t, tr)


def tag_result(t, tr: Trace, bits: int, clean: int = 0):
    """Tag a collective's result ``t``: ``bits``, and the call's taint but for ``clean``, the axes
    over which the collective made it the same on every rank (see `taint_of`); returns ``t``."""
    if tr.taint:
        if clean:
            tr.fresh[id(t)] = (weakref.ref(t), clean)
        bits |= tr.taint & ~clean
    return _put(t, tr, bits)


def operand(x, tr: Trace, v: int):
    """A collective's operand ``x`` (varying over ``v``) with the call's taint: cast with pvary over
    the tainted axes it does not vary over (a branch may have chosen it: the collective must
    combine the ranks' own values, and its gradient be summed over them); returns ``(x, v)``."""
    extra = taint_of(x, tr) & ~v
    if extra:
        x = pvary(x, tr, v, v | extra)
        v |= extra
    return x, v


def operands(leaves, tr: Trace):
    """The leaves of a pytree operand and their varying axes, with the call's taint (`_vma.operand`)."""
    if not tr.taint:
        return leaves, [get(x, tr) for x in leaves]
    pairs = [operand(x, tr, get(x, tr)) for x in leaves]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _hidden(t, tr: Trace) -> int:
    """The mask of a tensor without a tag of ``tr``: torch.func transforms hide it (see
    `_scalars.hidden_bits`)."""
    return hidden_bits(t, tr.id)


def _tag_wrapped(t, tag: tuple) -> None:
    """Tag the tensors a torch.func wrapper ``t`` wraps (a batch or a primal varies like its
    wrapper), so that the transform's result keeps the mask once unwrapped."""
    while _is_wrapped(t):
        t = _unwrap(t)
        setattr(t, _ATTR, tag)


def tag(t, tr: Trace, bits: int):
    """Mark ``t`` as varying over ``bits`` in ``tr`` (and over the call's taint: made after a branch
    on a varying value, `_scalars.taint`); returns ``t``."""
    return _put(t, tr, bits | tr.taint)


def _put(t, tr: Trace, bits: int):
    setattr(t, _ATTR, (tr.id, bits))
    if _is_wrapped(t):
        _tag_wrapped(t, (tr.id, bits))
    return t


def pvary(x: torch.Tensor, tr: Trace, have: int, want: int) -> torch.Tensor:
    """Cast ``x`` (varying over ``have``) to vary over ``want``; cached within the trace."""
    missing = want & ~have
    if not missing or not torch.is_grad_enabled() or not (x.requires_grad or needs_grad(x)):
        return x
    # (compiled: Dynamo cannot read _version; the in-place rule drops a changed tensor's casts)
    key = (id(x), missing) if tr.compiled else (id(x), x._version, missing)
    hit = tr.pvary_cache.get(key)
    if hit is not None:
        return hit[1]
    g = tr.cast_groups.get(missing)
    if g is None:
        g = tr.mesh.axis_group(tr.mesh.names_of(missing), "pvary")
        if not tr.compiled:  # (compiled: the mesh's own cache, which Dynamo reads as a constant)
            tr.cast_groups[missing] = g
    if _functorch_active():
        # inside a torch.func transform entered in f (vmap, grad, jvp, ...): the cast with its own
        # transpose (the gradient buckets' taps have no batching or forward rule), not cached (the
        # result may be the transform's wrapper, dead once it exits)
        return tag(apply(Pvary, x, g), tr, have | missing)
    twin = _twin_entry(tr, x) if tr.twins else None
    if twin is not None and twin[3].groups[twin[2]] in (None, g):
        # a tensor behind a GradBoundary (or an invariant function of one): its twin is the
        # cast, and its gradient is reduced in the boundary's buckets
        twin[3].groups[twin[2]] = g
        out = _twin_of(twin)
    else:
        path = tr.inputs.get(id(x)) if tr.inputs else None
        if path is None:
            out = apply(Pvary, x, g)
        else:  # an input: its key path in the reduction's tags, or a no_sync cast (`_no_sync_graph`)
            out = path.cast(x, g, apply, Pvary) if hasattr(path, "cast") else apply(PvaryInput, x, g, path)
    tag(out, tr, have | missing)
    tr.pvary_cache[key] = (x, out)  # holding x keeps its id unique for the call
    return out


def _drop_casts(tr: Trace, x) -> None:
    """Forget the pvary casts of ``x``, just changed in place (compiled calls)."""
    # (by identity: Dynamo cannot compare the id of a tensor made in the graph with an input's)
    for key in [k for k, hit in tr.pvary_cache.items() if hit[0] is x]:
        del tr.pvary_cache[key]


def _cast_args(seq, tr: Trace, union: int):
    """The operands ``seq`` (tensors, and lists or tuples of them), each cast to vary over ``union``."""
    out = []
    for a in seq:
        if isinstance(a, _Tensor):
            v = get(a, tr)
            out.append(pvary(a, tr, v, union) if v != union else a)
        else:
            out.append(type(a)(_cast_args(a, tr, union)) if type(a) in (list, tuple) else a)
    return out


def _own(out, args, kwargs, tag: tuple):
    """``out``, or a view of it if the op returned an operand (``w.to(x.device)``, ``w.type_as(x)``)
    whose mask ``tag`` would change: tagging it must not retag the operand (an invariant ``w`` would
    count as varying, and its uses after the op would go uncast). An operand that already varies so
    is returned itself (``t.requires_grad_()``: a view would not be the leaf the caller holds)."""

    def mine(o) -> bool:  # (a torch.func wrapper keeps itself: its transform tracks the identity)
        return (
            isinstance(o, _Tensor)
            and getattr(o, _ATTR, None) != tag
            and not _is_wrapped(o)
            and _takes_tensor(o, args, kwargs)
        )

    if isinstance(out, _Tensor):
        return out.view_as(out) if mine(out) else out
    if isinstance(out, (tuple, list)) and any(mine(o) for o in out):
        return type(out)(o.view_as(o) if mine(o) else o for o in out)
    return out


def _takes_tensor(t, args, kwargs) -> bool:
    """Whether ``t`` itself is among the operands (or in a list or tuple of them)."""
    for seq in (args, kwargs.values()) if kwargs else (args,):
        for a in seq:
            if a is t or ((type(a) is list or type(a) is tuple) and any(b is t for b in a)):
                return True
    return False


def _tag_out(out, tr: Trace, bits: int):
    """``out`` (a tensor, or a tuple or list of them) tagged; returns it (compiled: maybe anew)."""
    tag = (tr.id, bits)
    if isinstance(out, _Tensor):
        setattr(out, _ATTR, tag)
        if _is_wrapped(out):
            _tag_wrapped(out, tag)
    elif isinstance(out, (tuple, list)):
        if tr.compiled:  # Dynamo sets attributes on a multi-output op's tensors only through a view
            with untracked():
                out = type(out)([o.view_as(o) if isinstance(o, _Tensor) else o for o in out])
        for o in out:
            if isinstance(o, _Tensor):
                setattr(o, _ATTR, tag)
                if _is_wrapped(o):
                    _tag_wrapped(o, tag)
    return out


_PREP = frozenset(
    (_Tensor.to, _Tensor.float, _Tensor.half, _Tensor.bfloat16, _Tensor.double, _Tensor.type)
    + (_Tensor.contiguous, _Tensor.view, _Tensor.reshape, _Tensor.flatten, _Tensor.detach)
)
"""Ops that leave a queue of per-leaf collectives open: what turns a parameter into the operand of
its own gather (``fs.all_gather(p.to(torch.bfloat16), ...)``). Neither writes a tensor."""


def _takes(ids, args, kwargs) -> bool:
    """Whether a tensor whose id is in ``ids`` is among the operands (or in a list or tuple of them)."""
    for seq in (args, kwargs.values()) if kwargs else (args,):
        for a in seq:
            if isinstance(a, _Tensor):
                if id(a) in ids:
                    return True
            elif type(a) is list or type(a) is tuple:
                if any(isinstance(b, _Tensor) and id(b) in ids for b in a):
                    return True
    return False


class VmaMode(TorchFunctionMode):
    """Propagates varying-axes masks through every torch op run inside ``f``.

    Operands are tensors, lists and tuples of them, and the values that can carry a mask
    without being tensors: Python numbers made from varying tensors (`VaryingInt`,
    `VaryingFloat`) and slices or index tuples holding either. Ops that mutate their first
    argument (``add_``, ``__setitem__``, ...) tag it with the union too.
    """

    _fshard_tracks_attrs = True  # compiled: Dynamo sends it ``x.T`` and the like (_dynamo_hooks)

    def __init__(self, tr: Trace):
        super().__init__()
        self.tr = tr

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tr = self.tr
        q = tr.queue
        # Queued collectives (_combine) run at the first op after the calls (so that they start
        # early), unless it prepares the next call's operand (a cast, a reshape) from no result.
        if q is not None and (func not in _PREP or _takes(q.outs, args, kwargs)):
            q.flush()
        if tr.pending is not None:  # wait for the collectives of the results among the operands
            tr.pending.use(args, kwargs)
        tid = tr.id
        if tr.compiled:  # a constant of the trace (Dynamo would guard on the cache's keys)
            _compile.check_transforms()
            kind = _classify(func)
        else:
            kind = _KIND.get(func)
            if kind is None:
                kind = _KIND[func] = _classify(func)
        if kind is not _PLAIN and kind is not _INPLACE:
            return kind(func, tr, args, kwargs or {})
        given = (args, kwargs) if tr.uneven else None  # (for the output's per-rank shapes)
        # Union of the operands' masks, noting whether they differ (hot path: keep it flat).
        union = 0
        first = -1
        mixed = False
        # the axes every operand that needs a gradient varies over (all bits: none needs one); only
        # such an operand varying less than the union is cast (pvary passes the others through)
        low = -1
        scalars = False  # a tracked number among the operands: torch gets its plain value
        for seq in (args, kwargs.values()) if kwargs else (args,):
            for a in seq:
                if isinstance(a, _Tensor):
                    t = getattr(a, _ATTR, None)
                    if t is not None and t[0] == tid:
                        v = t[1]
                    else:  # untagged or stale: invariant, unless a torch.func transform hides a tag
                        v = _hidden(a, tr)
                    if a.requires_grad or (differentiating() and needs_grad(a)):
                        low &= v
                elif type(a) is list or type(a) is tuple:
                    for b in a:
                        if isinstance(b, _Tensor):
                            t = getattr(b, _ATTR, None)
                            if t is not None and t[0] == tid:
                                v = t[1]
                            else:
                                v = _hidden(b, tr)
                            if b.requires_grad or (differentiating() and needs_grad(b)):
                                low &= v
                        elif type(b) in _CARRIERS:
                            v = _scan(b, tid)
                            if not v:
                                continue
                            scalars = True
                        else:
                            continue
                        if first < 0:
                            first = v
                        elif v != first:
                            mixed = True
                        union |= v
                    continue
                elif type(a) in _CARRIERS:
                    v = _scan(a, tid)
                    if not v:
                        continue
                    scalars = True
                else:
                    continue
                if first < 0:
                    first = v
                elif v != first:
                    mixed = True
                union |= v
        if scalars:
            args = _plain_args(args)
            if kwargs:
                kwargs = {k: _plain_args(v) for k, v in kwargs.items()}
        if tr.taint:  # made after a branch on a varying value: varies like it (`_scalars.taint`)
            union |= tr.taint
            mixed = True
        if mixed and low & union != union and torch.is_grad_enabled():
            if kind is _INPLACE:
                _check_inplace(func, tr, args, union)
                args = (args[0], *_cast_args(args[1:], tr, union))
            else:
                args = _cast_args(args, tr, union)
            if kwargs:
                kwargs = dict(zip(kwargs.keys(), _cast_args(kwargs.values(), tr, union)))
        out = func(*args, **kwargs) if kwargs else func(*args)
        if given is not None and not tr.compiled:
            _shapes.propagate(func, tr, given[0], given[1] or {}, out)
        if union:  # also covers `p.grad`: a gradient varies like its primal
            if kind is _INPLACE:
                if args and isinstance(args[0], _Tensor):
                    setattr(args[0], _ATTR, (tid, union))
                out = _tag_out(out, tr, union)
            else:
                out = _tag_out(_own(out, args, kwargs, (tid, union)), tr, union)
                if tr.twins and not mixed and not tr.compiled:  # of one tensor, varying like it: w.flatten(1)
                    _derive_twin(tr, func, args, kwargs, out)
        elif tr.twins and kind is _PLAIN and isinstance(out, _Tensor) and out.requires_grad:
            _derive_twin(tr, func, args, kwargs, out)
        if kind is _INPLACE and tr.compiled and args and isinstance(args[0], _Tensor):
            if tr.pvary_cache:
                _drop_casts(tr, args[0])  # its casts hold the old value (eager: keyed by _version)
            if tr.twins and args[0].requires_grad:
                _drop_twins(tr, args[0])  # (eager: the twins entries hold the version they were made at)
        return out


# -- ops with their own rule ------------------------------------------------------------------


def _self_bits(tr: Trace, args) -> int:
    """The varying axes of the tensor a method was called on (0 when it is invariant)."""
    return get(args[0], tr) if args and isinstance(args[0], _Tensor) else 0


def _to_python(func, tr: Trace, args, kwargs):
    """``t.item()``, ``t.tolist()``: Python numbers that keep the mask (compiled: only those each
    rank's graph holds as constants, `check_traced_number`)."""
    out = func(*args, **kwargs)
    bits = _self_bits(tr, args) | tr.taint
    if bits and tr.compiled:
        check_traced_number(tr, bits, func.__name__, out)
    return _mark(out, tr.id, bits) if bits else out


def _mark(x, tid: int, bits: int):
    if type(x) is list:
        return [_mark(y, tid, bits) for y in x]
    return _varying_scalar(x, tid, bits)


_LEAVE = {  # a tensor's way out of tracking -> what the taint record calls it
    "__bool__": _LEAVES["__bool__"],
    "__int__": "int() of",
    "__float__": "float() of",
    "__index__": "a Python index from",
    "numpy": ".numpy() of",
}


def _view_attr(func, tr: Trace, args, kwargs):
    """``x.T``, ``x.mT``, ``x.H``, ``x.mH``, ``x.real``, ``x.imag``, ``x.data``: the plain rule of an
    op of one tensor. Compiled, a view of Dynamo's result: Dynamo names that by where it reads it
    (``args[0].T``), so the pvary cache's ``id(x)`` guarded on an object the attribute makes anew
    at each read, a guard that failed at once (``x @ w.T`` of a replicated ``w`` needing a grad)."""
    bits = _self_bits(tr, args) | tr.taint  # (made after a branch on a varying value: varies like it)
    if tr.taint:  # ... its operand cast, as the plain rule casts (its gradient summed over the taint)
        args = _cast_args(args, tr, bits)
    out = func(*args, **kwargs)
    if tr.compiled and isinstance(out, _Tensor):
        out = out.view_as(out)
    elif tr.uneven:  # its shape at every position, as the plain rule's
        _shapes.propagate(func, tr, args, kwargs or {}, out)
    if bits:
        out = _tag_out(_own(out, args, kwargs, (tr.id, bits)), tr, bits)
    if tr.twins and not tr.taint and (not bits or not tr.compiled):  # (invariant, or varying like x)
        _derive_twin(tr, func, args, kwargs, out)
    return out


def _refuse_varying(func, tr: Trace, args, kwargs):
    """``bool(t)``, ``int(t)``, ``float(t)``, ``operator.index(t)``, ``t.numpy()``: plain Python or
    numpy values that cannot carry varying axes; when ``t`` varies, the call is tainted
    (`_scalars.taint`: what the ranks do next may differ, so every later value varies like ``t``)."""
    bits = _self_bits(tr, args)
    if bits:
        if tr.compiled:  # (raised at trace time as itself)
            _compile.fail(TracingError, compiled_branch(tr, bits, _LEAVE[func.__name__]))
        taint(tr, bits, _LEAVE[func.__name__])
    return func(*args, **kwargs)


def _iterate(func, tr: Trace, args, kwargs):
    """``for row in t``: each row varies like ``t`` (and the taint: ``t`` cast to it, as in `_view_attr`)."""
    bits = _self_bits(tr, args) | tr.taint
    if tr.taint:
        args = _cast_args(args, tr, bits)
    rows = list(func(*args, **kwargs))
    if bits:
        rows = _tag_out(rows, tr, bits)
    return iter(rows)


def _check_inplace(func, tr: Trace, args, union: int) -> None:
    """An in-place op writing a more varying value into a tensor that needs a gradient."""
    dst = args[0] if args else None
    if not isinstance(dst, _Tensor) or not dst.requires_grad:
        return
    have = get(dst, tr)
    if have == union:
        return
    word, axes = _varying_axes_text(tr, union & ~have)
    name = getattr(func, "__name__", str(func))
    raise TracingError(
        f"fs.shard_map({tr.where}): in-place {name} writes a value that varies over mesh {word} {axes} into "
        f"a tensor that needs a gradient and does not vary over them, so its gradient could not be summed "
        f"over those axes; use the out-of-place op (e.g. torch.where, index_put, x = x + y), or "
        f"fs.pvary(x, ...) before writing into it"
    )


_KIND: dict = {}
_RULES: dict = {}  # eager: a random op -> its _random_rule


def _classify(func):
    """How ``VmaMode`` treats ``func``: a handler, or the plain or in-place rule (cached per func)."""
    kind = _kind_of(func)
    return kind if kind is _PLAIN or kind is _INPLACE else _HANDLERS[kind]


def _data_dependent(func, tr: Trace, args, kwargs):
    """An op whose output shape may depend on the data (``x[mask]``, ``nonzero``, ``unique``,
    one-argument ``torch.where``, ``repeat_interleave`` with tensor repeats): the plain rule, and
    when an operand varies (so its shape may differ across ranks) the call is marked: later
    collectives compare operand shapes and the outputs' global shapes are found from their
    blocks, as for uneven inputs."""
    union = 0
    for a in itertools.chain(args, kwargs.values()):
        union |= _scan(a, tr.id)
    ragged = bool(union and _shape_bits(func, tr, args, kwargs))
    if ragged:
        tr.uneven = tr.ragged = True
    given = (args, kwargs) if tr.uneven and not ragged else None  # (x[i:j]: its per-rank shapes)
    union |= tr.taint
    if union and torch.is_grad_enabled():
        args = _cast_args(args, tr, union)
        if kwargs:
            kwargs = dict(zip(kwargs.keys(), _cast_args(kwargs.values(), tr, union)))
    out = func(*args, **kwargs)
    if given is not None:
        _shapes.propagate(func, tr, *given, out)
    if union:
        out = _tag_out(out, tr, union)
    elif tr.twins and isinstance(out, _Tensor) and out.requires_grad:  # w[:s] of an input: as the plain rule
        _derive_twin(tr, func, args, kwargs, out)
    return out


def _shape_bits(func, tr: Trace, args, kwargs) -> int:
    """The varying axes of the operands whose values decide the output's shape (0: the shape is
    the same on every rank whenever the operands' shapes are)."""
    name = func.__name__
    if name == "__getitem__":  # the boolean masks in the index
        idx = args[1] if len(args) > 1 else None
        items = idx if type(idx) is tuple else (idx,)
        masks = [
            i for i in items if isinstance(i, _Tensor) and i.dtype in (torch.bool, torch.uint8) and i.dim()
        ]
        return _scan(masks, tr.id)
    if name == "where":  # torch.where(cond): the indices where cond holds
        return _scan(args[0], tr.id) if len(args) == 1 and not kwargs else 0
    if name == "repeat_interleave":  # (input, repeats), or torch.repeat_interleave(repeats)
        repeats = [*args[1:], kwargs.get("repeats")] if len(args) != 1 or kwargs else list(args)
        return _scan([r for r in repeats if isinstance(r, _Tensor)], tr.id)
    if name == "masked_select":  # (input, mask): the mask's true elements
        mask = args[1] if len(args) > 1 else kwargs.get("mask")
        return _scan(mask, tr.id) if isinstance(mask, _Tensor) else 0
    return _scan(args[0], tr.id) if args else 0  # nonzero, argwhere, unique*: the input's values


def _foreach(func, tr: Trace, args, kwargs):
    """``torch._foreach_*``: element i of each list operand lines up; tag output i on its own."""
    lists = [a for a in args if type(a) in (list, tuple)]
    n = len(lists[0]) if lists else 0
    shared = tr.taint
    for a in args:
        if isinstance(a, _Tensor):
            shared |= get(a, tr)
    masks = []
    for i in range(n):
        m = shared
        for lst in lists:
            if i < len(lst) and isinstance(lst[i], _Tensor):
                m |= get(lst[i], tr)
        masks.append(m)
    out = func(*args, **kwargs)
    targets = out if isinstance(out, (list, tuple)) else (lists[0] if lists and out is None else ())
    for t, m in zip(targets, masks):
        if isinstance(t, _Tensor):
            setattr(t, _ATTR, (tr.id, m))
    return out


def _autograd_grad(func, tr: Trace, args, kwargs):
    outputs = args[0] if args else kwargs.get("outputs")
    inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
    grads = torch.autograd.grad(*args, **kwargs)
    ins = (inputs,) if isinstance(inputs, _Tensor) else tuple(inputs)
    for g, x in zip(grads, ins):
        if g is not None:
            tag(g, tr, get(x, tr) | tr.taint)
            if tr.uneven:
                _shapes.put(g, tr, _shapes.of(x, tr))
    del outputs
    return grads


# -- draws from random number generators ------------------------------------------------------

# Generators made by fs.random.generator -> (trace id, the axes their stream differs over).
_generator_axes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# (trace id, op) of the latest draw from torch's global generator inside a shard_map call.
_global_draw: list = [0, ""]


def tag_generator(g: torch.Generator, tr: Trace, bits: int) -> torch.Generator:
    """Numbers ``g`` draws inside ``tr`` vary over ``bits`` (`fshard.random.generator`); returns ``g``."""
    _generator_axes[g] = (tr.id, bits)
    return g


def global_draw(tr: Trace) -> str | None:
    """The first op in ``tr`` that drew from torch's global generator (a name), or None."""
    return _global_draw[1] if _global_draw[0] == tr.id else None


def _operand_bits(seq, tr: Trace) -> int:
    bits = 0
    for a in seq:
        if isinstance(a, _Tensor):
            bits |= get(a, tr)
        elif type(a) in _CARRIERS:
            if type(a) is list or type(a) is tuple:
                bits |= _operand_bits(a, tr)
            else:
                bits |= _scan(a, tr.id)
    return bits


def _random(func, tr: Trace, args, kwargs):
    """An op that draws random numbers. From torch's global generator (no ``generator=``), each
    rank draws its own numbers: the result varies over every mesh axis, as if an operand did
    (operands that need a gradient are cast with pvary, so gradients sum over the ranks). With an
    explicit generator the draw is a plain op, unless `fshard.random.generator` made it: then
    the result also varies over the axes its stream differs over."""
    given = (args, kwargs)  # (the operands before their casts: their per-rank shapes)
    hit = _random_rule(func) if tr.compiled else _RULES.get(func)  # (compiled: trace-time constants)
    if hit is None:
        hit = _RULES[func] = _random_rule(func)
    name, label, rule, writes, always = hit
    gen = None
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Generator):
            gen = a
            break
    if gen is not None:
        hit = _generator_axes.get(gen)
        extra = hit[1] if hit is not None and hit[0] == tr.id else 0
    elif _draws(rule, always, args, kwargs):
        extra = tr.mesh.bits(tr.mesh.axis_names)
        if _global_draw[0] != tr.id:
            _global_draw[:] = (tr.id, label)
    else:
        extra = 0
    union = extra | _operand_bits(args, tr) | _operand_bits(kwargs.values(), tr) | tr.taint
    at = rule[2] if rule is not None else None
    inplace = writes or (
        at is not None and bool(kwargs.get("inplace", args[at] if len(args) > at else False))
    )
    dst = (args[0] if args else kwargs.get("tensor", kwargs.get("input"))) if inplace else None
    if union and torch.is_grad_enabled():
        if isinstance(dst, _Tensor) and dst.grad_fn is not None:
            _check_inplace(func, tr, (dst,), union)
        args = [a if a is dst else b for a, b in zip(args, _cast_args(args, tr, union))]
        if kwargs:
            cast = _cast_args(kwargs.values(), tr, union)
            kwargs = {k: (a if a is dst else b) for (k, a), b in zip(kwargs.items(), cast)}
    out = func(*args, **kwargs)
    if tr.uneven and not tr.compiled:  # (a draw's shape is its operands' and arguments')
        _shapes.propagate(func, tr, *given, out)
    if union:
        out = _tag_out(out, tr, union)
        if isinstance(dst, _Tensor):
            tag(dst, tr, union)
    return out


def _as_is(func, tr: Trace, args, kwargs):
    """An op whose body the tracking follows itself (``fs.remat``'s region compiled, `_remat._compiled`):
    run as is (a cast of an invariant input beside a varying weight summed its gradient over the ranks)."""
    return func(*args, **kwargs)


_HANDLERS = {
    f.__name__: f for f in (_autograd_grad, _view_attr, _refuse_varying, _to_python, _iterate, _as_is)
}
_HANDLERS.update(
    {f.__name__: f for f in (_shapes._shape, _shapes._length, _data_dependent, _random, _foreach)}
)
