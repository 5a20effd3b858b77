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

Their results came out untagged, which reads as invariant: compiled, ``fs.psum(x.T, "dp")`` of a
varying ``x`` was ``x.T * 2`` instead of the sum over ranks, a silent wrong value. While a tracking
mode is the innermost mode, these are dispatched to it here, as Dynamo already does for a tensor
subclass's attribute reads and for operators: the mode sees ``Tensor.T.__get__``,
``Tensor.__getitem__``, ``Tensor.__abs__``, ... as in eager. Other modes and code outside
``shard_map`` are left as they were. `INSTALLED` says whether the hooks are in place (they reach
into Dynamo's variable trackers; on a torch without them compiled calls are refused).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["INSTALLED", "VIEW_ATTRS"]

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
        from torch._dynamo.variables.base import VariableTracker
        from torch._dynamo.variables.builder import SourcelessBuilder
        from torch._dynamo.variables.torch_function import dispatch_torch_function
    except ImportError:  # another torch
        return False
    cls = tensor_vars.TensorVariable
    fns = torch_vars.TorchInGraphFunctionVariable
    needed = ["var_getattr", "unpack_var_sequence", "mp_subscript_impl", *_UNARY, *_BINARY]
    if not all(callable(getattr(cls, name, None)) for name in needed):
        return False
    if not callable(getattr(fns, "torch_function_override_enabled", None)):
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
