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

import torch
from torch.overrides import TorchFunctionMode

from . import _comm
from ._errors import CollectiveError
from ._mesh import Mesh

_ATTR = "_fshard_vma"
_Tensor = torch.Tensor


class Trace:
    """State of one running shard_map call on this rank."""

    __slots__ = ("mesh", "pvary_cache", "where")

    def __init__(self, mesh: Mesh, where: str):
        self.mesh = mesh
        self.where = where
        self.pvary_cache: dict = {}


_stack: list[Trace] = []


def current(where: str) -> Trace:
    """The innermost running trace, or a CollectiveError naming ``where``."""
    if not _stack:
        raise CollectiveError(
            f"fs.{where} can only be called inside a function run by fs.shard_map, where mesh axes "
            f"have names; wrap the calling function with fs.shard_map(f, mesh=..., in_specs=..., "
            f"out_specs=...)"
        )
    return _stack[-1]


def active() -> Trace | None:
    return _stack[-1] if _stack else None


_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_unwrap = torch._C._functorch.get_unwrapped


def get(t, tr: Trace) -> int:
    """The varying-axes mask of ``t`` in trace ``tr`` (0: invariant)."""
    tag = getattr(t, _ATTR, None)
    if tag is not None and tag[0] is tr:
        return tag[1]
    if _is_wrapped(t):  # inside torch.func transforms: the mask lives on the unwrapped tensor
        return get(_unwrap(t), tr)
    return 0


def tag(t, tr: Trace, bits: int):
    """Mark ``t`` as varying over ``bits`` in ``tr``; returns ``t``."""
    setattr(t, _ATTR, (tr, bits))
    return t


class _Pvary(torch.autograd.Function):
    """Identity forward; the backward sums the cotangent over the newly varying axes."""

    @staticmethod
    def forward(x, g):
        with _comm._no_tf():
            return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g = inputs[1]

    @staticmethod
    def backward(ctx, ct):
        return _comm.all_reduce(ct, ctx.g), None


def pvary(x: torch.Tensor, tr: Trace, have: int, want: int) -> torch.Tensor:
    """Cast ``x`` (varying over ``have``) to vary over ``want``; cached within the trace."""
    missing = want & ~have
    if not missing or not (x.requires_grad and torch.is_grad_enabled()):
        return x
    key = (id(x), missing)
    hit = tr.pvary_cache.get(key)
    if hit is not None:
        return hit[1]
    g = tr.mesh.axis_group(tr.mesh.names_of(missing), "pvary")
    out = _Pvary.apply(x, g)
    tag(out, tr, have | missing)
    tr.pvary_cache[key] = (x, out)  # holding x keeps its id unique for the call
    return out


def _cast_args(seq, tr: Trace, union: int):
    out = []
    for a in seq:
        if isinstance(a, _Tensor):
            v = get(a, tr)
            out.append(pvary(a, tr, v, union) if v != union else a)
        elif type(a) in (list, tuple):
            out.append(
                type(a)(
                    pvary(b, tr, get(b, tr), union) if isinstance(b, _Tensor) and get(b, tr) != union else b
                    for b in a
                )
            )
        else:
            out.append(a)
    return out


def _tag_out(out, tr: Trace, bits: int) -> None:
    if isinstance(out, _Tensor):
        setattr(out, _ATTR, (tr, bits))
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, _Tensor):
                setattr(o, _ATTR, (tr, bits))


class VmaMode(TorchFunctionMode):
    """Propagates varying-axes masks through every torch op run inside ``f``."""

    def __init__(self, tr: Trace):
        super().__init__()
        self.tr = tr

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tr = self.tr
        if kwargs is None:
            kwargs = {}
        if func is torch.autograd.grad:
            return _autograd_grad(tr, args, kwargs)
        # Union of the operands' masks, noting whether they differ (hot path: keep it flat).
        union = 0
        first = -1
        mixed = False
        for seq in (args, kwargs.values()) if kwargs else (args,):
            for a in seq:
                if isinstance(a, _Tensor):
                    t = getattr(a, _ATTR, None)
                    v = t[1] if t is not None and t[0] is tr else get(a, tr)
                elif type(a) is list or type(a) is tuple:
                    for b in a:
                        if isinstance(b, _Tensor):
                            t = getattr(b, _ATTR, None)
                            v = t[1] if t is not None and t[0] is tr else get(b, tr)
                            if first < 0:
                                first = v
                            elif v != first:
                                mixed = True
                            union |= v
                    continue
                else:
                    continue
                if first < 0:
                    first = v
                elif v != first:
                    mixed = True
                union |= v
        if mixed and torch.is_grad_enabled():
            args = _cast_args(args, tr, union)
            if kwargs:
                kwargs = dict(zip(kwargs.keys(), _cast_args(kwargs.values(), tr, union)))
        out = func(*args, **kwargs)
        if union:  # also covers `p.grad`: a gradient varies like its primal
            _tag_out(out, tr, union)
        return out


def _autograd_grad(tr: Trace, args, kwargs):
    outputs = args[0] if args else kwargs.get("outputs")
    inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
    grads = torch.autograd.grad(*args, **kwargs)
    ins = (inputs,) if isinstance(inputs, _Tensor) else tuple(inputs)
    for g, x in zip(grads, ins):
        if g is not None:
            tag(g, tr, get(x, tr))
    del outputs
    return grads
