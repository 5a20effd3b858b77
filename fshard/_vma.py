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

import torch
from torch.overrides import TorchFunctionMode

from ._errors import CollectiveError
from ._mesh import Mesh
from ._primitives import Pvary, apply

_ATTR = "_fshard_vma"
_Tensor = torch.Tensor


_ids = itertools.count(1)


class Trace:
    """State of one running shard_map call on this rank; a context manager that runs its body.

    ``with trace:`` makes it the innermost trace (what collectives see) and, when the mesh has
    an axis of size > 1, propagates varying axes through every torch op with `VmaMode`. Tags
    on tensors hold the trace's integer ``id`` (not the trace), so tensors stay picklable and
    keep nothing alive after the call.
    """

    __slots__ = ("mesh", "pvary_cache", "where", "id", "_mode")

    def __init__(self, mesh: Mesh, where: str):
        self.mesh = mesh
        self.where = where
        self.pvary_cache: dict = {}
        self.id = next(_ids)
        self._mode = None

    def __enter__(self) -> "Trace":
        _stack.append(self)
        if self.mesh.tracked:
            self._mode = VmaMode(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
                self._mode = None
        finally:
            _stack.pop()
            self.pvary_cache.clear()


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
    if tag is not None and tag[0] == tr.id:
        return tag[1]
    if _is_wrapped(t):  # inside torch.func transforms: the mask lives on the unwrapped tensor
        return get(_unwrap(t), tr)
    return 0


def tag(t, tr: Trace, bits: int):
    """Mark ``t`` as varying over ``bits`` in ``tr``; returns ``t``."""
    setattr(t, _ATTR, (tr.id, bits))
    return t


def pvary(x: torch.Tensor, tr: Trace, have: int, want: int) -> torch.Tensor:
    """Cast ``x`` (varying over ``have``) to vary over ``want``; cached within the trace."""
    missing = want & ~have
    if not missing or not (x.requires_grad and torch.is_grad_enabled()):
        return x
    key = (id(x), x._version, missing)
    hit = tr.pvary_cache.get(key)
    if hit is not None:
        return hit[1]
    g = tr.mesh.axis_group(tr.mesh.names_of(missing), "pvary")
    out = apply(Pvary, x, g)
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
    tag = (tr.id, bits)
    if isinstance(out, _Tensor):
        setattr(out, _ATTR, tag)
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, _Tensor):
                setattr(o, _ATTR, tag)


class VmaMode(TorchFunctionMode):
    """Propagates varying-axes masks through every torch op run inside ``f``."""

    def __init__(self, tr: Trace):
        super().__init__()
        self.tr = tr

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tr = self.tr
        tid = tr.id
        if kwargs is None:
            kwargs = {}
        if func is torch.autograd.grad:
            return _autograd_grad(tr, args, kwargs)
        foreach = _FOREACH.get(func)
        if foreach is None:
            foreach = _FOREACH[func] = getattr(func, "__name__", "").startswith("_foreach_")
        if foreach:
            return _foreach(func, tr, args, kwargs)
        # Union of the operands' masks, noting whether they differ (hot path: keep it flat).
        union = 0
        first = -1
        mixed = False
        for seq in (args, kwargs.values()) if kwargs else (args,):
            for a in seq:
                if isinstance(a, _Tensor):
                    t = getattr(a, _ATTR, None)
                    v = t[1] if t is not None and t[0] == tid else get(a, tr)
                elif type(a) is list or type(a) is tuple:
                    for b in a:
                        if isinstance(b, _Tensor):
                            t = getattr(b, _ATTR, None)
                            v = t[1] if t is not None and t[0] == tid else get(b, tr)
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


_FOREACH: dict = {}


def _foreach(func, tr: Trace, args, kwargs):
    """``torch._foreach_*``: element i of each list operand lines up; tag output i on its own."""
    lists = [a for a in args if type(a) in (list, tuple)]
    n = len(lists[0]) if lists else 0
    shared = 0
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
