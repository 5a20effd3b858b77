"""Collectives of Python numbers: ``fs.psum(n, axis)`` of a plain number (the same on every rank,
JAX's ``psum(1, axis)``) or of a tracked one (`VaryingInt`/`VaryingFloat`: summed over the ranks),
and the plain numbers made after a branch on a varying value, which count as tracked."""

from __future__ import annotations

import math

import torch

from . import _comm, _scalars, _vma
from ._comm import untracked


def _is_number(x) -> bool:
    """A plain Python number (the same on every rank; not a tracked `VaryingInt`)."""
    return type(x) is int or type(x) is float


def _is_tracked_number(x) -> bool:
    """A Python number that varies over mesh axes (`VaryingInt`, `VaryingFloat`)."""
    return type(x) is _scalars.VaryingInt or type(x) is _scalars.VaryingFloat


def _after_branch(x):
    """A plain number ``x``, tracked as varying over the call's taint: made after a branch on a
    varying value (`_scalars.taint`), it may differ between ranks."""
    tr = _vma.active()
    if tr is None or not tr.taint:
        return x
    return _scalars._varying_scalar(x, tr.id, tr.taint)


def _psum_number(x, axis, where: str):
    """``psum`` of a tracked Python number: an all-reduce (of one element) over the axes of
    ``axis`` it varies over, times the sizes of those it does not; tracked over the rest."""
    tr = _vma.current(where)
    g = tr.mesh.axis_group(axis, where)
    bits = tr.mesh.bits(g.names)
    v = _scalars._scan(x, tr.id)
    value = _scalars.plain(x)
    vary = bits & v
    if vary:
        ga = tr.mesh.axis_group(tr.mesh.names_of(vary), where)
        with untracked():
            dtype = torch.int64 if isinstance(value, int) else torch.float64
            t = torch.tensor(value, dtype=dtype, device=tr.mesh.device)
            value = _comm.all_reduce(t, ga).item()
    inv = bits & ~v
    if inv:
        value = value * math.prod([tr.mesh.axis_size(n) for n in tr.mesh.names_of(inv)])
    return _scalars._varying_scalar(value, tr.id, v & ~bits), g.size
