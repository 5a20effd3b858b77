"""Tensor operations Dynamo traces without the active torch-function modes, sent to fshard's.

Eager, every operation on a tensor inside ``f`` reaches the tracking mode (`_vma.VmaMode`),
which tags its result with the mesh axes it varies over. Dynamo (torch 2.13) traces a few of them
as bare graph nodes without calling the active torch-function modes:

- attributes that make a tensor of a tensor: ``x.T``, ``x.mT``, ``x.H``, ``x.mH``, ``x.real``,
  ``x.imag``, ``x.data``;
- unpacking and iterating over a tensor: ``a, b = x``, ``for row in x``, ``list(x)``, ``f(*x)``;
- Python's number protocol reached other than by an operator: ``abs(x)``, ``+x``, ``sum(xs)``'s
  additions, ``int(x)``, ``float(x)``, ``operator.index(x)``;
- the functions torch lists as ignored for overrides, which eager's modes see all the same
  (`SEEN_BY_MODES`: ``torch.rand_like``, ``torch.normal``, ``torch.as_strided``, ...).

And one Python number: Dynamo reads an ``int`` subclass as a constant, so ``int(i)``, ``if i:`` and
``i == 0`` of a tracked `VaryingInt` (``fs.axis_index("dp").item()``, whose value each rank's
graph holds as a constant) took the plain value without asking it: no taint, so a per-rank value
could pass a replicated out_spec. A `VaryingInt` is no constant for Dynamo here: its own methods
are traced, and a branch on it is refused in a compiled call as any other. Dynamo answers
``_scalars.symbolic`` here: whether it traces a number symbolically (``.item()`` of a tensor the
graph computes), which a `VaryingInt` cannot hold.

Their results came out untagged, which reads as invariant: compiled, ``fs.psum(x.T, "dp")`` of a
varying ``x`` was ``x.T * 2`` instead of the sum over ranks, a silent wrong value. While a tracking
mode is the innermost mode, these are dispatched to it here, as Dynamo already does for a tensor
subclass's attribute reads and for operators: the mode sees ``Tensor.T.__get__``,
``Tensor.__getitem__``, ``Tensor.__abs__``, ... as in eager. Other modes and code outside
``shard_map`` are left as they were. `INSTALLED` says whether the hooks are in place (they reach
into Dynamo's variable trackers; on a torch without them compiled calls are refused).

One more hook decides where a ``torch.compile``'d function runs when it is called inside an
*eagerly* run shard_map call (``torch.compile`` inside ``f``, or ``fs.shard_map(torch.compile(g))``):
eagerly, with a warning (`EAGER_INSIDE`). Traced there, Dynamo would read the running call's
tracking state (its trace id, its caches, the tags of this call's tensors) as constants of the
graph: every call recompiled (until Dynamo's recompile limit), and with a gradient the trace failed
outright. Eager, the tracking sees each op of the function as it sees the rest of ``f``: the values,
gradients and collectives are the eager call's. ``fs.compile`` of the function compiles it there
(a region traced apart from the call, `_region`), and so does compiling the whole step.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ._scalars import VaryingInt, symbolic
from ._scalars import _stack as _traces

__all__ = ["INSTALLED", "VIEW_ATTRS", "EAGER_INSIDE"]

VIEW_ATTRS = ("T", "mT", "H", "mH", "real", "imag", "data")
"""Tensor attributes that make a tensor of a tensor."""

SEEN_BY_MODES = tuple(
    getattr(torch, name)
    for name in (
        "rand_like randn_like randint_like normal as_strided _conj "
        "_conj_physical _neg_view _lazy_clone _addmm_activation grouped_mm scaled_mm"
    ).split()
    if hasattr(torch, name)
)
"""Functions of tensors that eager sends through the torch-function modes but that torch lists as
ignored for overrides, which Dynamo reads as "never dispatched": compiled, ``torch.rand_like(w)`` of
a replicated ``w`` counted as replicated (each rank draws its own) and passed the replication check.
(Not ``torch.tensor`` / ``as_tensor``: made of Python data, their arguments cannot all be guarded.)"""

_UNARY = {
    "nb_negative_impl": torch.Tensor.__neg__,
    "nb_positive_impl": torch.Tensor.__pos__,
    "nb_absolute_impl": torch.Tensor.__abs__,
    "nb_index_impl": torch.Tensor.__index__,
    "nb_int_impl": torch.Tensor.__int__,
    "nb_float_impl": torch.Tensor.__float__,
}
_BINARY = {  # slot -> (the operator, its reflected form)
    "nb_add_impl": ("__add__", "__radd__"),
    "nb_subtract_impl": ("__sub__", "__rsub__"),
    "nb_multiply_impl": ("__mul__", "__rmul__"),
    "nb_true_divide_impl": ("__truediv__", "__rtruediv__"),
    "nb_floor_divide_impl": ("__floordiv__", "__rfloordiv__"),
    "nb_remainder_impl": ("__mod__", "__rmod__"),
    "nb_lshift_impl": ("__lshift__", "__rlshift__"),
    "nb_rshift_impl": ("__rshift__", "__rrshift__"),
    "nb_or_impl": ("__or__", "__ror__"),
    "nb_and_impl": ("__and__", "__rand__"),
    "nb_xor_impl": ("__xor__", "__rxor__"),
}


def _tracking(tx) -> bool:
    """Whether the innermost torch-function mode Dynamo is tracing under is a tracking mode."""
    modes: Any = getattr(getattr(tx, "symbolic_torch_function_state", None), "mode_stack", None)
    return bool(modes) and getattr(type(modes[-1].value), "_fshard_tracks_attrs", False)


def _install() -> bool:
    try:
        from torch._dynamo.variables import tensor as tensor_vars
        from torch._dynamo.variables import torch as torch_vars
        from torch._dynamo.variables.base import AsPythonConstantNotImplementedError, VariableTracker
        from torch._dynamo.variables.builder import SourcelessBuilder
        from torch._dynamo.variables.constant import ConstantVariable
        from torch._dynamo.variables.functions import UserFunctionVariable
        from torch._dynamo.variables.torch_function import dispatch_torch_function
        from torch._dynamo.variables.user_defined import UserDefinedConstantVariable
    except ImportError:  # another torch
        return False
    cls = tensor_vars.TensorVariable
    fns = torch_vars.TorchInGraphFunctionVariable
    sym = getattr(tensor_vars, "SymNodeVariable", None)
    needed = ["var_getattr", "unpack_var_sequence", "mp_subscript_impl", *_UNARY, *_BINARY]
    if not all(callable(getattr(cls, name, None)) for name in needed):
        return False
    if not callable(getattr(fns, "torch_function_override_enabled", None)):
        return False
    if sym is None or not callable(getattr(UserFunctionVariable, "call_function", None)):
        return False
    if not callable(getattr(UserDefinedConstantVariable, "as_python_constant", None)):
        return False
    if getattr(cls.var_getattr, "_fshard", False):
        return True

    def ours(self, tx) -> bool:
        return type(self) is cls and _tracking(tx)

    def dispatch(tx, fn, args):
        return dispatch_torch_function(tx, SourcelessBuilder.create(tx, fn), args, {})

    def hook(name, make, owner=cls):
        original = getattr(owner, name)
        wrapper = make(original)
        wrapper._fshard = True
        wrapper.__name__ = name
        setattr(owner, name, wrapper)

    seen = frozenset(SEEN_BY_MODES)

    def override_hook(original):
        def torch_function_override_enabled(self, tx, args, kwargs):
            if original(self, tx, args, kwargs):
                return True
            try:
                fn = self.get_function()
            except Exception:  # noqa: BLE001  (not a plain function: as before)
                return False
            return fn in seen and _tracking(tx)

        return torch_function_override_enabled

    def getattr_hook(original):
        def var_getattr(self, tx, name):
            if name in VIEW_ATTRS and ours(self, tx):
                return dispatch(tx, getattr(torch.Tensor, name).__get__, [self])
            return original(self, tx, name)

        return var_getattr

    def unpack_hook(original):
        def unpack_var_sequence(self, tx, idxes=None):
            if not ours(self, tx):
                return original(self, tx, idxes)
            if idxes is None and self.valid_size() and isinstance(self.size[0], int):
                rows = range(self.size[0])
            elif idxes is None:  # a symbolic length: as Dynamo finds it (its rows go unused)
                rows = range(len(original(self, tx, None)))
            else:
                rows = idxes
            return [self.mp_subscript_impl(tx, VariableTracker.build(tx, i)) for i in rows]

        return unpack_var_sequence

    def unary_hook(fn):
        def make(original):
            def impl(self, tx, *args, **kwargs):
                if ours(self, tx):
                    return dispatch(tx, fn, [self])
                return original(self, tx, *args, **kwargs)

            return impl

        return make

    def binary_hook(names):
        def make(original):
            def impl(self, tx, other, reverse=False, *args, **kwargs):
                if ours(self, tx):
                    fn = getattr(torch.Tensor, names[1] if reverse else names[0])
                    return dispatch(tx, fn, [self, other])
                return original(self, tx, other, reverse, *args, **kwargs)

            return impl

        return make

    def constant_hook(original):
        def as_python_constant(self):
            if type(self.value) is VaryingInt:  # its methods run traced (int(), bool(), ==, ...)
                raise AsPythonConstantNotImplementedError(self)
            return original(self)

        return as_python_constant

    def call_hook(original):
        def call_function(self, tx, args, kwargs):
            if self.fn is symbolic and len(args) == 1 and not kwargs:
                return ConstantVariable.create(isinstance(args[0].realize(), sym))
            return original(self, tx, args, kwargs)

        return call_function

    hook("as_python_constant", constant_hook, UserDefinedConstantVariable)
    hook("call_function", call_hook, UserFunctionVariable)
    hook("torch_function_override_enabled", override_hook, fns)
    hook("var_getattr", getattr_hook)
    hook("unpack_var_sequence", unpack_hook)
    for name, fn in _UNARY.items():
        hook(name, unary_hook(fn))
    for name, names in _BINARY.items():
        hook(name, binary_hook(names))
    return True


INSTALLED = _install()
"""Whether Dynamo's traced tensor operations above reach the tracking mode."""

EAGER_INSIDE = (
    "fshard: a torch.compile'd function was called inside an eager call of fs.shard_map({where}): it "
    "runs eagerly there. In an eager call fshard tracks the mesh axes each value varies over op by "
    "op, which a graph torch.compile made on its own cannot follow without being recompiled for every "
    "call. To compile it there, compile it with fs.compile (a compiled region, traced apart from the "
    "call), or compile the whole step: fs.compile(step), or torch.compile around the shard_map'd "
    "function (docs/tutorial/09-compiling.md)"
)
"""The warning given once per shard_map'd function when a compiled function runs eagerly inside it."""

_warned: set = set()


def _eager_trace_where() -> str | None:
    """The name of the innermost shard_map call if it runs eagerly with tracking, else None."""
    tr = _traces[-1] if _traces else None  # (`_vma.Trace`s)
    if tr is None or tr.compiled or tr._mode is None:
        return None
    return tr.where


def _install_eager_inside() -> bool:
    """Route the callback Dynamo sets when a compiled function is called (``_callback_from_stance``,
    consulted at each call of it): inside an eager, tracking shard_map call, no callback (eager)."""
    try:
        from torch._dynamo import eval_frame
    except ImportError:
        return False
    original = getattr(eval_frame, "_callback_from_stance", None)
    count = getattr(eval_frame, "set_fullgraph_compiled_frame_count", None)
    if not callable(original) or not callable(count):
        return False
    if getattr(original, "_fshard", False):
        return True

    def _callback_from_stance(callback):
        out = original(callback)
        if out is None or out is False:
            return out
        where = _eager_trace_where()
        if where is None:
            return out
        if where not in _warned:
            _warned.add(where)
            warnings.warn(EAGER_INSIDE.format(where=where), UserWarning, stacklevel=3)
        # fullgraph=True counts the frames compiled in the call and raises at none: this one ran
        # eagerly on purpose, counted as one (-1: no fullgraph call is counting; a count is set
        # only from -1)
        n = count(-1)
        if n >= 0:
            count(n + 1)
        return None

    _callback_from_stance._fshard = True  # type: ignore[attr-defined]
    eval_frame._callback_from_stance = _callback_from_stance
    return True


EAGER_INSIDE_INSTALLED = _install_eager_inside()
"""Whether compiled functions called inside eager shard_map calls run eagerly (see `EAGER_INSIDE`)."""
