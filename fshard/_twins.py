"""The twins of shard_map's differentiable inputs, as the tracking mode (`_vma`) uses them.

A tensor behind a gradient boundary (`_buckets`), or a function of one that is invariant or varies
like it (``w.T``, ``w[:s]``, ``w.to(bf16)``, ``w * 2``, ``w.flatten(1)`` of a ``w`` split over tp), has
a *twin*: the tensor its ``pvary`` cast returns, whose
gradient reaches the boundary unreduced and is summed in its buckets. A trace keeps one entry per
such tensor (`Trace.twins`, keyed by id), made when the tensor is; the twin itself is derived on
the first varying use. A tensor is never derived from itself: an op that returns one of its
operands (``w.to(w.device)``, ``w.float()`` of a float) makes no entry, and an entry holds its
source entry, never an id to look up. An entry holds the version counter its tensor had when it
was made: changed in place since, the tensor is cast with ``Pvary`` instead (compiled calls cannot
read versions: the in-place rule drops the entries there).
"""

from __future__ import annotations

import torch

from ._comm import untracked

_Tensor = torch.Tensor


def _version(t, tr):
    """``t``'s version counter, or None in a compiled call (Dynamo cannot read it; there the in-place
    rule drops the twins instead, `_drop_twins`)."""
    return None if tr.compiled else t._version


def _twin_entry(tr, t):
    """``t``'s twins entry, if ``t`` is still the value the entry was made for (an in-place op on
    it, or on a tensor it is a view of, since then makes the twin stale: it is cast with Pvary)."""
    hit = tr.twins.get(id(t))
    if hit is None or hit[0] is not t or (hit[5] is not None and hit[5] != t._version):
        return None
    return hit


def twin_entry(visible, twin, index: int, state, derivation=None, version=None) -> list:
    """A twins entry: ``visible`` (what f sees), its ``twin`` (None until derived), the input's
    ``index`` at its boundary and the boundary's ``state``; ``derivation``: ``(source entry, func,
    args, kwargs)``, the twin being ``func`` of the source's twin; ``version``: ``visible``'s
    version counter when the entry was made (None: compiled)."""
    return [visible, twin, index, state, derivation, version]


def _derive_twin(tr, func, args, kwargs, out) -> None:
    """``out`` is a function of one tensor behind a GradBoundary (``w.T``, ``w[:s]``, ``w.to(bf16)``,
    ``w * 2``), invariant or varying only like that tensor (the tracking mode's callers see to
    it; not after a branch on a varying value): register the same function of that tensor's twin,
    made only if ``out`` is ever cast with pvary. Its gradient then reaches the twin unreduced and
    is summed in the bucket: exact, since the function is the same on every rank of the axes the
    cast adds, over which its operands do not vary (so is its transpose).

    An op that returned one of its operands (``w.to(w.device)``, ``w.float()`` of a float,
    ``w.contiguous()`` of a contiguous one, ``w.requires_grad_()``) made nothing new: the
    operand keeps its own entry (a tensor is never derived from itself)."""
    if not isinstance(out, _Tensor) or not out.requires_grad:
        return
    src = None
    for a in args:
        if isinstance(a, _Tensor):
            if a is out:
                return
            hit = _twin_entry(tr, a)
            if hit is not None:
                if src is not None:
                    return  # two tensors behind the boundary: their gradients stay separate
                src = hit
    if src is None:
        return
    # Any other operand that needs a gradient would get the twin path's unreduced cotangent.
    for a in (*args, *(kwargs.values() if kwargs else ())):
        if isinstance(a, _Tensor):
            if a is out or (a is not src[0] and a.requires_grad):
                return
        elif type(a) is list or type(a) is tuple:
            if any(isinstance(b, _Tensor) and (b is out or b.requires_grad) for b in a):
                return
    tr.twins[id(out)] = twin_entry(out, None, src[2], src[3], (src, func, args, kwargs), _version(out, tr))


def _twin_of(entry) -> torch.Tensor:
    """The twin of a twins entry, derived (and kept) on first use."""
    if entry[1] is None:
        src, func, args, kwargs = entry[4]
        base = _twin_of(src)
        args = tuple(base if a is src[0] else a for a in args)
        with untracked():
            entry[1] = func(*args, **kwargs) if kwargs else func(*args)
    return entry[1]


def _drop_twins(tr, x) -> None:
    """``x`` was just changed in place (compiled calls: no version counter to read): forget its
    twin, and those derived from tensors since none can tell whether they view ``x``."""
    for k in [k for k, e in tr.twins.items() if e[0] is x or e[4] is not None]:
        del tr.twins[k]
