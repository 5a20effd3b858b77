"""Tracked Python numbers: values that carry a varying-axes mask without being tensors.

`.item()` and `.tolist()` of a varying tensor and, in calls with uneven blocks, the shapes of
varying tensors give `VaryingInt` / `VaryingFloat` (see ``_vma``, whose `VmaMode` reads their
masks and hands torch the plain values). This module holds the numbers themselves and the
running traces' stack (``_stack``, kept by ``_vma.Trace``), which tells whether the call that
made a number is still running.
"""

from __future__ import annotations

import math
import operator
import os
import sys
import weakref
from typing import Any

import torch

from ._errors import TracingError
from ._trace_time import fail

_ATTR = "_fshard_vma"
_Tensor = torch.Tensor

_stack: list[Any] = []
"""The running ``_vma.Trace`` objects, innermost last (pushed and popped by ``Trace``)."""


def _varying_axes_text(tr: Any, bits: int) -> tuple[str, str]:
    axes = tr.mesh.names_of(bits)
    word = "axis" if len(axes) == 1 else "axes"
    return word, ", ".join(repr(a) for a in axes)


# -- values that carry a mask without being tensors ------------------------------------------
# `.item()`, `.tolist()` and, in calls with uneven blocks, the sizes of varying tensors that differ
# between ranks give tracked Python numbers. Arithmetic, round() and math.floor/ceil/trunc keep
# them tracked; torch ops receive them through VmaMode (which reads their masks and hands torch
# the plain values). What turns them into untracked Python values (int(), float(), the math
# functions, which call float(), bool(), comparisons) gives the plain value and taints the call
# that made them (`taint`), unless their values at every rank are known and agree.


def _scalar_bits(x) -> int:
    tag = getattr(x, _ATTR, None)
    return tag[1] if tag is not None else 0


def plain(x):
    """The exact Python number of a tracked one (``x`` itself otherwise): for fshard's own code,
    which reads the value without the checks `VaryingInt` and `VaryingFloat` make."""
    tp = type(x)
    if tp is VaryingInt:
        return x.real  # the exact int (Dynamo traces this, not int.__int__)
    if tp is VaryingFloat:
        return x._value
    return x


def _wrap_result(name: str):
    """Operation ``name`` of a tracked number: the same operation on the plain values, tracked."""

    def op(self, *others):
        vals = []
        bits = _scalar_bits(self)
        for o in others:
            tp = type(o)
            if tp is VaryingInt or tp is VaryingFloat:
                bits |= _scalar_bits(o)
                vals.append(plain(o))
            elif tp is int or tp is float or tp is bool or o is None:  # None: round(v, None)
                vals.append(o)
            else:
                return NotImplemented  # e.g. a tensor: its reflected op runs, under VmaMode
        fn = _OPS[name]
        try:
            out = fn(plain(self), *vals)
        except TypeError:  # (an operand the operation does not take: as the int's own method)
            return NotImplemented
        tid = self._fshard_vma[0]
        ranks = _per_rank(fn, self, others)
        if type(out) is tuple:  # divmod
            return tuple(
                _varying_scalar(y, tid, bits, None if ranks is None else tuple(r[i] for r in ranks))
                for i, y in enumerate(out)
            )
        return _varying_scalar(out, tid, bits, ranks)

    op.__name__ = name
    return op


def _reflected(fn):
    return lambda a, b: fn(b, a)


# The operations of `_wrap_result` on the plain values, as Python's operators compute them (an int
# and a float give a float). Dynamo traces these, where ``int.__add__(3, 1)`` of a compiled call
# reads as NotImplemented.
_OPS: dict[str, Any] = {
    "__add__": operator.add,
    "__sub__": operator.sub,
    "__mul__": operator.mul,
    "__floordiv__": operator.floordiv,
    "__truediv__": operator.truediv,
    "__mod__": operator.mod,
    "__divmod__": divmod,
    "__and__": operator.and_,
    "__or__": operator.or_,
    "__xor__": operator.xor,
    "__lshift__": operator.lshift,
    "__rshift__": operator.rshift,
}
_OPS.update({"__r" + k[2:]: _reflected(fn) for k, fn in list(_OPS.items())})
_OPS.update(
    {
        "__pow__": pow,
        "__rpow__": lambda a, b, mod=None: pow(b, a, mod),
        "__neg__": operator.neg,
        "__pos__": operator.pos,
        "__abs__": abs,
        "__invert__": operator.invert,
        "__round__": round,
        "__floor__": math.floor,
        "__ceil__": math.ceil,
        "__trunc__": math.trunc,
    }
)


def _per_rank(fn, self, others) -> tuple | None:
    """``fn`` of the operands at every mesh position, when every tracked operand is a size whose
    value at every position is known (`_shapes`); else None."""
    mine = getattr(self, "_fshard_ranks", None)
    if mine is None or fn is None:
        return None
    cols = []
    for o in others:
        tp = type(o)
        if tp is VaryingInt or tp is VaryingFloat:
            r = getattr(o, "_fshard_ranks", None)
            if r is None:
                return None
            cols.append(r)
        else:
            cols.append(None)
    try:
        out = tuple(
            fn(v, *[o if c is None else c[p] for o, c in zip(others, cols)]) for p, v in enumerate(mine)
        )
    except (ArithmeticError, TypeError, ValueError):
        return None
    return None if NotImplemented in out else out


def _owner(self, others) -> tuple[Any, int] | None:
    """The running trace that made a tracked operand, and the operands' axes (None: stale tags)."""
    bits = 0
    tid = None
    for x in (self, *others):
        tag = getattr(x, _ATTR, None)
        if tag is not None and tag[1]:
            bits |= tag[1]
            tid = tag[0]
    for tr in reversed(_stack):
        if tr.id == tid:
            return tr, bits
    return None


_COMPARE = ("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__")


def _site() -> str:
    """The user's line that is running (the nearest frame outside torch and fshard), as ``file:line``."""
    f: Any = sys._getframe(1)
    while f is not None:
        top = f.f_globals.get("__name__", "").partition(".")[0]
        if top not in ("torch", "fshard", "optree"):
            return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"
        f = f.f_back
    return "?"


def taint(tr: Any, bits: int, what: str) -> None:
    """A value of ``tr`` varying over ``bits`` left tracking (``what``: a branch on it, a plain
    Python number made from it): the ranks may run different code from here on, so every value
    made afterwards in the call varies over ``bits`` (an information-flow type system's tainted
    program counter), and values made before it count as varying over them where they are read
    whole (outputs, collective operands): a branch may have chosen between them. A collective's
    result over those axes made afterwards is the same on every rank again (``fresh``)."""
    if tr.compiled:  # a compiled call cannot branch on the ranks' data: refused as before
        fail(TracingError, compiled_branch(tr, bits, what))  # (at trace time, as itself)
    if tr.taint_why is None or bits & ~tr.taint:
        word, axes = _varying_axes_text(tr, bits & ~tr.taint if tr.taint_why is not None else bits)
        why = f"{what} a value that varies over mesh {word} {axes}, at {_site()}"
        tr.taint_why = why if tr.taint_why is None else f"{tr.taint_why}; {why}"
    tr.taint |= bits
    tr.fresh.clear()  # a collective result made before this branch may be the one it chose


def symbolic(x) -> bool:
    """Whether Dynamo traces the number ``x`` symbolically: an int or float the graph knows only
    when it runs (``t.item()`` of a tensor the graph computes), not a constant of the trace. False
    outside a trace (Dynamo answers it: ``_dynamo_hooks``)."""
    return False


def check_traced_number(tr: Any, bits: int, name: str, out) -> None:
    """In a compiled call, ``t.item()`` / ``t.tolist()`` (``name``) of a tensor varying over ``bits``
    gave ``out``: a `VaryingInt` (an int subclass) holds its value at trace time, so an int the
    graph computes is refused; one each rank's graph holds as a constant
    (``fs.axis_index(axis).item()``) is tracked as in eager, and so is a float (`VaryingFloat`
    holds the symbolic value)."""
    if not _symbolic_int(out):
        return
    word, axes = _varying_axes_text(tr, bits)
    fail(
        TracingError,
        f"fs.shard_map({tr.where}): t.{name}() of an integer tensor that varies over mesh {word} {axes} "
        f"and that the compiled graph computes (its value is known only when the graph runs, and a "
        f"tracked Python int needs it at trace time); keep it a tensor (x * t, x[t], "
        f"torch.where(t == 0, a, b)), or call it eagerly",
    )


def _symbolic_int(x) -> bool:
    if type(x) is list:
        return any(_symbolic_int(y) for y in x)
    return type(x) is int and symbolic(x)


def taint_of(t, tr: Any) -> int:
    """The axes the call's taint adds to ``t`` where it is read whole (an output, a collective's
    operand): all of them, but for a collective result made after the latest taint over the axes
    it reduced (the same on every rank whatever branches the ranks took)."""
    bits = tr.taint
    if bits:
        hit = tr.fresh.get(id(t))
        if hit is not None and hit[0]() is t:
            bits &= ~hit[1]
    return bits


def same_value(dst, src, tr: Any) -> None:
    """``dst`` holds the bytes of ``src``: fshard's own copy of it (``fs.value_and_grad``'s value
    and primals), made alike on every rank. It varies like ``src`` read whole (its axes and the
    call's taint, `taint_of`): a collective's result made after the latest taint stays one."""
    tag = getattr(src, _ATTR, None)
    bits = tag[1] if tag is not None and tag[0] == tr.id else hidden_bits(src, tr.id)
    setattr(dst, _ATTR, (tr.id, bits | taint_of(src, tr)))
    hit = tr.fresh.get(id(src)) if tr.taint else None
    if hit is not None and hit[0]() is src:
        tr.fresh[id(dst)] = (weakref.ref(dst), hit[1])


def taint_note(tr: Any) -> str:
    """What the replication check adds when the call was tainted (`taint`), or ""."""
    if tr.taint_why is None:
        return ""
    return (
        f"\nf branched on a value that varies across ranks ({tr.taint_why}), so the ranks may have run "
        f"different code from there on: every value made after it (and any value it may have chosen) "
        f"counts as varying over those axes; reduce the output after the branch (the result of fs.psum / "
        f"fs.pmean / fs.all_gather(..., invariant=True) over them is the same on every rank), or select "
        f"with torch.where(cond, a, b) instead of the branch"
    )


def compiled_branch(tr: Any, bits: int, what: str) -> str:
    """The refusal of a branch on a varying value in a compiled call."""
    word, axes = _varying_axes_text(tr, bits)
    return (
        f"fs.shard_map({tr.where}): {what} a value that varies over mesh {word} {axes} in a compiled call "
        f"(Dynamo would branch at trace time on one rank's value); select between values with "
        f"torch.where(cond, a, b), or call it eagerly"
    )


_LEAVES = {  # a tracked number's way out of tracking -> what the taint record calls it
    "__bool__": "bool() (a Python if, while, and/or or assert) of",
    "compare": "a comparison of",
    "__int__": "int() of",
    "__float__": "float() (or a math function) of",
    "__index__": "a Python index (range(), a list index) from",
    "__complex__": "complex() of",
}


_LEAVE_OPS: dict[str, Any] = {  # (as `_OPS`: what Dynamo traces)
    "__lt__": operator.lt,
    "__le__": operator.le,
    "__gt__": operator.gt,
    "__ge__": operator.ge,
    "__eq__": operator.eq,
    "__ne__": operator.ne,
    "__bool__": bool,
    "__int__": int,
    "__float__": float,
    "__index__": operator.index,
    "__complex__": complex,
}


def _refuse_scalar(name: str):
    """Operation ``name`` of a tracked number: the plain operation, after tainting the call that
    made it (`taint`) when it is still running."""
    what = _LEAVES["compare" if name in _COMPARE else name]

    def op(self, *others):
        hit = _owner(self, others)
        base = plain(self)
        if hit is not None:
            ranks = _per_rank(_LEAVE_OPS[name], self, others) if type(base) is int else None
            if ranks is None or len(set(ranks)) > 1:  # (the same at every position: plain)
                taint(hit[0], hit[1], what)
        return _LEAVE_OPS[name](base, *[plain(o) for o in others])

    op.__name__ = name
    return op


class VaryingInt(int):
    """A Python int that varies over some mesh axes: ``i.item()``, ``i.tolist()`` of a varying tensor,
    and in calls with uneven blocks a size that differs between ranks (``x.shape[0]``, ``x.size(0)``,
    ``x.numel()``).

    It is an int (a torch.Size can hold it); torch ops that receive it (as an argument, a slice
    bound or in an index tuple), arithmetic, round() and math.floor/ceil/trunc keep its varying
    axes, so ``x[i * n:(i + 1) * n]`` and ``torch.tensor(x.shape[0])`` are tracked and
    ``fs.psum(n, axis)`` sums it over the ranks. ``int()``, ``float()`` (and the math functions that
    call it), ``bool()`` and comparisons give plain values and, inside the call that made it, taint
    the call: every value made afterwards varies like it (a replicated out_spec then needs a
    collective after the branch, such as ``fs.psum``).

    Examples:
        >>> n = x.shape[0]                       # 3, 3, 3, 1 for 10 rows over 4 ranks
        >>> total = fs.psum(n, "dp")             # 10 on every rank
    """

    _fshard_vma: tuple[int, int]
    __hash__ = int.__hash__


class VaryingFloat:
    """A Python number that varies over some mesh axes: ``t.item()`` of a varying float tensor, or
    arithmetic mixing a `VaryingInt` and a float.

    Not a float subclass: Python's math functions read a float subclass's value without asking
    it, so this one holds its value and sees, inside the call that made it, every way out of
    tracking (``float()``, ``math.sqrt(v)``, ``int()``, ``bool()``, comparisons), each of which
    taints the call (every value made afterwards varies like it). Arithmetic, round() and math.floor/ceil/trunc stay tracked; torch ops
    receive the plain value. ``str(v)``, ``repr(v)`` and ``f"{v:.3f}"`` format the value (for
    logging: the one way it leaves tracking).

    Examples:
        >>> loss = x.sum().item()                # a VaryingFloat when x varies
        >>> t = torch.tensor(loss * 2.0)         # tracked: varies like x
    """

    __slots__ = ("_value", "_fshard_vma")
    _fshard_vma: tuple[int, int]

    def __init__(self, value: float):
        self._value = float(value)

    def __repr__(self) -> str:
        return repr(self._value)

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(self._value, spec)

    def __hash__(self) -> int:
        return hash(self._value)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Makes torch's argument parser hand ops with this operand to VmaMode (``x * v``); outside
        # the call that made it, the op runs on the plain value.
        return func(*_plain_args(args), **{k: _plain_args(v) for k, v in (kwargs or {}).items()})


_ARITH = (
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __floordiv__ __rfloordiv__ __truediv__ "
    "__rtruediv__ __mod__ __rmod__ __divmod__ __rdivmod__ __pow__ __rpow__ __neg__ __pos__ __abs__ "
    "__and__ __rand__ __or__ __ror__ __xor__ __rxor__ __lshift__ __rlshift__ __rshift__ __rrshift__ "
    "__invert__ __round__ __floor__ __ceil__ __trunc__"
).split()
for _name in _ARITH:
    if hasattr(int, _name):
        setattr(VaryingInt, _name, _wrap_result(_name))
    if hasattr(float, _name):
        setattr(VaryingFloat, _name, _wrap_result(_name))
for _name in (*_COMPARE, "__bool__", "__int__", "__float__", "__index__", "__complex__"):
    setattr(VaryingInt, _name, _refuse_scalar(_name))
    if _name not in ("__index__", "__complex__"):
        setattr(VaryingFloat, _name, _refuse_scalar(_name))
del _name


def _varying_scalar(value, tid: int, bits: int, ranks: tuple | None = None):
    """``value`` (a Python number) carrying ``bits``; plain when ``bits`` is 0, it is no number, or
    its values at every mesh position (``ranks``, when known) are all the same."""
    if not bits or type(value) is bool or (ranks is not None and len(set(ranks)) == 1):
        return value
    out: VaryingInt | VaryingFloat
    if type(value) is int:
        out = VaryingInt(value)
    elif type(value) is float:
        out = VaryingFloat(value)
    else:
        return value
    out._fshard_vma = (tid, bits)
    if ranks is not None and type(out) is VaryingInt and all(type(r) is int for r in ranks):
        out._fshard_ranks = ranks  # type: ignore[attr-defined]
    return out


_CARRIERS = frozenset((VaryingInt, VaryingFloat, slice, list, tuple, torch.Size))


def _scan(x, tid: int) -> int:
    """The mask carried by a scalar, a slice, or a (nested) list/tuple of either or of tensors."""
    tp = type(x)
    if tp is VaryingInt or tp is VaryingFloat:
        tag = x._fshard_vma
        return tag[1] if tag[0] == tid else 0
    if tp is slice:
        return _scan(x.start, tid) | _scan(x.stop, tid) | _scan(x.step, tid)
    if tp is list or tp is tuple or tp is torch.Size:
        bits = 0
        for y in x:
            bits |= _scan(y, tid)
        return bits
    if isinstance(x, _Tensor):
        tag = getattr(x, _ATTR, None)
        return tag[1] if tag is not None and tag[0] == tid else hidden_bits(x, tid)
    return 0


_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_mode_on = torch._C._is_torch_function_mode_enabled
_functorch_active = torch._C._are_functorch_transforms_active
_forward_ad = torch.autograd.forward_ad
_unwrap = torch._C._functorch.get_unwrapped


def hidden_bits(t: torch.Tensor, tid: int) -> int:
    """The mask in trace ``tid`` of a tensor without a tag of that trace: torch.func transforms hide
    it (0: invariant).

    Inside a transform the mask may live on the tensor a wrapper wraps (``vmap``'s batch, ``jvp``'s
    primal); a transform's result (``vmap``'s output with the batch dim moved back, ``jvp``'s
    primal and tangent) is the wrapped tensor or a view of it, tagged when the wrapper was tagged.
    """
    if _is_wrapped(t):
        t = _unwrap(t)
        tag = getattr(t, _ATTR, None)
        return tag[1] if tag is not None and tag[0] == tid else hidden_bits(t, tid)
    if _mode_on():  # read from the user's code (a collective's operand): unseen by the tracking mode,
        with torch._C.DisableTorchFunction():  # whose rule for it would tag the base after a branch
            base = t._base
    else:
        base = t._base
    if base is not None:
        tag = getattr(base, _ATTR, None)
        if tag is not None and tag[0] == tid:
            return tag[1]
    return 0


def _plain_args(x):
    """``x`` with tracked numbers replaced by their plain values (for torch, which reads them)."""
    tp = type(x)
    if tp is VaryingInt:
        return x.real  # the exact int (Dynamo traces this, not int.__int__)
    if tp is VaryingFloat:
        return x._value
    if tp is slice:
        return slice(_plain_args(x.start), _plain_args(x.stop), _plain_args(x.step))
    if tp is list or tp is tuple or tp is torch.Size:
        return tp([_plain_args(y) for y in x])
    return x


def differentiating() -> bool:
    """Whether a transform may differentiate what runs now: a torch.func transform, or a level of
    forward-mode AD (``torch.autograd.forward_ad``), whose tangents may need a gradient of their own."""
    return _functorch_active() or _forward_ad._current_level >= 0


def needs_grad(t) -> bool:
    """Whether ``t`` needs a gradient: its own flag, or, inside a torch.func transform entered in
    f, that of the tensor a wrapper wraps (a ``jvp`` dual or a ``vmap`` batch of a parameter has no
    ``requires_grad`` of its own, yet a gradient taken outside reaches the parameter through it).

    Under forward mode the tangent may need a gradient although the primal does not (a reverse
    pass over a ``jvp``: ``jacrev(jacfwd(f))``, ``loss.backward()`` of a tangent): a floating dual
    of a torch.func ``jvp`` level counts as needing one (its tangent is not reachable from the
    wrapper), and a ``forward_ad`` dual when its tangent requires a gradient."""
    if t.requires_grad:
        return True
    if _is_wrapped(t):
        if (t.is_floating_point() or t.is_complex()) and _jvp_level():
            return True
        while _is_wrapped(t):
            t = _unwrap(t)
            if t.requires_grad:
                return True
        return False
    if _forward_ad._current_level >= 0:
        tangent = _forward_ad.unpack_dual(t).tangent
        return tangent is not None and tangent.requires_grad
    return False


def _jvp_level() -> bool:
    """Whether a torch.func forward-mode level (``jvp``, ``jacfwd``, ``hessian``) is running."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())
