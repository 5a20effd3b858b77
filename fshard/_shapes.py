"""Per-rank shapes of the blocks of a call with uneven blocks: which sizes really differ.

In a call where some input is split unevenly (torch.chunk's cut: 10 rows over 4 ranks are 3, 3,
3, 1), a tensor may have another shape on another rank, but most of its dims do not: a batch split
unevenly leaves the sequence length and the width the same everywhere. So that ordinary shape code
(``if q_len == 1``, ``loss / y.shape[1]``, ``range(x.shape[1])``) stays ordinary Python, each
tensor carries the shape it has on every mesh position (``_fshard_shapes``: ``(trace id,
shapes)``), and ``x.shape`` gives a tracked `VaryingInt` only for a dim whose sizes differ.

The shapes follow the ops: an input's come from its layout (`Layout.block` at every mesh
coordinate); an op's are found by running the op on meta tensors with each other position's
operand shapes (and the other positions' values of tracked sizes among its arguments), which is
exact for every op whose output shape is a function of its operands' shapes and the other
arguments (ops whose shape depends on the data are marked ragged by ``_vma``). A tensor without
shapes of the running call is the same shape everywhere when it is invariant, and of unknown
shapes (every dim a `VaryingInt`) when it varies: an op that cannot run on meta tensors, an
operand of unknown shapes or a tracked number whose per-rank values are unknown make its output's
shapes unknown (the sound side: a wrong plain int could make the ranks diverge silently).
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import types
from typing import Any

import torch

from ._comm import untracked
from ._scalars import VaryingFloat, VaryingInt, _varying_scalar, taint
from ._scalars import _scan as _scan_bits

_Tensor = torch.Tensor
_SHAPES = "_fshard_shapes"
_RANKS = "_fshard_ranks"  # on a VaryingInt: its value at every mesh position, when known
UNKNOWN = "unknown"
_LAID_OUT = ("global", "sharded", "reshard")  # the kinds of shard_map inputs cut by a layout


@functools.lru_cache(maxsize=64)
def _coords(names: tuple, sizes: tuple) -> tuple:
    """The coordinate (a dict) of every mesh position, row-major."""
    return tuple(dict(zip(names, c)) for c in itertools.product(*[range(n) for n in sizes]))


def coords(mesh) -> tuple:
    shape = mesh.shape
    return _coords(tuple(shape), tuple(shape.values()))


def here(mesh) -> int:
    """This rank's mesh position (row-major)."""
    shape, coord = mesh.shape, mesh.coordinate
    i = 0
    for a, n in shape.items():
        i = i * n + coord[a]
    return i


def set_input(t, tr, layout, global_shape, mesh) -> None:
    """An input block: its shape at every mesh position, from its layout."""
    shp = mesh.shape
    shapes = tuple(tuple(n for _, n in layout.block(global_shape, shp, c)) for c in coords(mesh))
    setattr(t, _SHAPES, (tr.id, None if len(set(shapes)) == 1 else shapes))


def set_inputs(leaves, plans, local, tr) -> None:
    """In a call with uneven blocks, the inputs' blocks (``local``) of the global ``leaves``, placed
    by shard_map's input ``plans``: their shapes at every position (by their layouts)."""
    if not tr.uneven:
        return
    for x, p, y in zip(leaves, plans, local):
        # (a fs.PerRank leaf is no block of a global value)
        if p.kind.value in _LAID_OUT and p.layout is not None and p.bits and isinstance(y, _Tensor):
            set_input(y, tr, p.layout, x.shape, tr.mesh)


def of(t, tr) -> Any:
    """The shapes of ``t`` at every position, None (the same everywhere) or UNKNOWN."""
    rec = getattr(t, _SHAPES, None)
    if rec is not None and rec[0] == tr.id:
        return rec[1]
    return UNKNOWN if _scan_bits(t, tr.id) else None  # (also a mask a torch.func wrapper hides)


def put(t, tr, shapes) -> None:
    setattr(t, _SHAPES, (tr.id, shapes))


def ranked(value: int, tid: int, bits: int, ranks: tuple):
    """``value``, a size at this rank: a plain int when it is the same at every position, else a
    `VaryingInt` that knows its value at every position."""
    return _varying_scalar(value, tid, bits, ranks)


def shape_of(x, out, tr, bits: int, func, args):
    """What ``x.shape`` / ``x.size(...)`` / ``x.numel()`` (``out``, this rank's) gives the user's code."""
    shapes = of(x, tr)
    if shapes is None:
        return out
    tid = tr.id
    if shapes is UNKNOWN:
        if type(out) is int:
            return _varying_scalar(out, tid, bits)
        return torch.Size([_varying_scalar(d, tid, bits) for d in out])
    if type(out) is int:
        name = getattr(func, "__name__", "")
        if name in ("numel", "nelement"):
            return ranked(out, tid, bits, tuple(math.prod(s) for s in shapes))
        d = args[1] if len(args) > 1 else None
        d = d if d is not None else out  # (unreachable: size() with no dim is a Size)
        d = d % len(shapes[0])
        return ranked(out, tid, bits, tuple(s[d] for s in shapes))
    return torch.Size([ranked(n, tid, bits, tuple(s[i] for s in shapes)) for i, n in enumerate(out)])


def dim_varies(x, tr, d: int) -> bool:
    shapes = of(x, tr)
    if shapes is None:
        return False
    if shapes is UNKNOWN:
        return True
    return len({s[d] for s in shapes}) > 1


# -- the shape handlers of the tracking mode (`_vma.VmaMode`)


_DISPATCH = frozenset(("fshard._vma", __name__, "torch.overrides", "torch._tensor"))


def _user_code() -> bool:
    """Whether the code that asked (the nearest frame outside torch's dispatch and this module) is
    the user's: torch's and fshard's own code read plain shapes."""
    f: types.FrameType | None = sys._getframe(1)
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        if mod not in _DISPATCH:
            top = mod.partition(".")[0]
            return top != "torch" and top != "fshard"
        f = f.f_back
    return True


def _shape(func, tr, args, kwargs):
    """``x.shape``, ``x.size()``, ``x.numel()``: in a call with uneven blocks, a size of a varying
    tensor that may differ between ranks is a `VaryingInt` (for the user's code; `_shapes` knows
    which); the others, and every size in other calls, are plain ints."""
    out = func(*args, **kwargs)
    if not tr.uneven:
        return out
    bits = _scan_bits(args[0], tr.id) if args and isinstance(args[0], _Tensor) else 0
    if not bits or not _user_code():
        return out
    return shape_of(args[0], out, tr, bits, func, args)


def _length(func, tr, args, kwargs):
    """``len(x)``: Python makes it a plain int; when the length of ``x`` may differ between ranks
    (uneven blocks along its first dim), the call is tainted (`_scalars.taint`) with the axes it
    varies over."""
    n = func(*args, **kwargs)
    if tr.uneven:
        bits = _scan_bits(args[0], tr.id) if args and isinstance(args[0], _Tensor) else 0
        if bits and _user_code() and dim_varies(args[0], tr, 0):
            taint(tr, bits, "len() of")
    return n


# -- an op's output shapes ------------------------------------------------------------------


def _scan(x, tr, found: list) -> bool:
    """Collect the operands of ``x`` whose shape or value may differ between positions into
    ``found``; False when one of them is unknown."""
    tp = type(x)
    if isinstance(x, _Tensor):
        s = of(x, tr)
        if s is UNKNOWN:
            return False
        if s is not None:
            found.append(x)
        return True
    if tp is VaryingInt:
        if getattr(x, _RANKS, None) is None:
            return x._fshard_vma[0] != tr.id  # a stale number is plain
        found.append(x)
        return True
    if tp is VaryingFloat:
        return x._fshard_vma[0] != tr.id
    if tp is slice:
        return _scan(x.start, tr, found) and _scan(x.stop, tr, found) and _scan(x.step, tr, found)
    if tp is list or tp is tuple or tp is torch.Size:
        return all(_scan(y, tr, found) for y in x)
    return True


def _at(x, p: int, tr, shapes: dict):
    """``x`` as it is at position ``p``: tensors as meta tensors of that position's shape, tracked
    sizes as that position's values."""
    tp = type(x)
    if isinstance(x, _Tensor):
        s = shapes.get(id(x))
        shape = x.shape if s is None else s[p]
        return torch.empty(shape, dtype=x.dtype, device="meta")
    if tp is VaryingInt:
        r = getattr(x, _RANKS, None)
        return int.__int__(x) if r is None else r[p]
    if tp is VaryingFloat:
        return x._value
    if tp is slice:
        return slice(_at(x.start, p, tr, shapes), _at(x.stop, p, tr, shapes), _at(x.step, p, tr, shapes))
    if tp is list or tp is tuple or tp is torch.Size:
        return tp([_at(y, p, tr, shapes) for y in x])
    if isinstance(x, torch.device) or (type(x) is str and x in ("cpu", "cuda")):
        return torch.device("meta")
    return x


def _outs(out) -> list:
    if isinstance(out, _Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, _Tensor)]
    return []


def propagate(func, tr, args, kwargs, out) -> None:
    """Put on ``out`` (a tensor or a tuple/list of them) its shape at every position."""
    outs = _outs(out)
    if not outs:
        return
    found: list = []
    ok = all(_scan(a, tr, found) for a in args) and (
        not kwargs or all(_scan(v, tr, found) for v in kwargs.values())
    )
    # (inside a torch.func transform entered in f, the ops see the transform's wrappers: unknown)
    if not ok or tr.taint or torch._C._are_functorch_transforms_active():
        for o in outs:
            put(o, tr, UNKNOWN)
        return
    if not found:
        for o in outs:
            put(o, tr, None)
        return
    shapes = {id(x): of(x, tr) for x in found if isinstance(x, _Tensor)}
    n = tr.mesh.size
    me = here(tr.mesh)

    def key(p):
        return tuple(shapes[id(x)][p] if isinstance(x, _Tensor) else getattr(x, _RANKS)[p] for x in found)

    mine = key(me)
    got: dict = {mine: [tuple(o.shape) for o in outs]}
    per: list = []
    for p in range(n):
        k = key(p)
        if k not in got:
            try:
                with untracked(), torch.device("meta"):
                    a = [_at(x, p, tr, shapes) for x in args]
                    kw = {k2: _at(v, p, tr, shapes) for k2, v in kwargs.items()} if kwargs else {}
                    o = _outs(func(*a, **kw))
                got[k] = [tuple(t.shape) for t in o] if len(o) == len(outs) else None
            except Exception:  # no meta kernel, or the op refuses that position's shapes
                got[k] = None
        per.append(got[k])
    for i, o in enumerate(outs):
        if any(s is None for s in per):
            put(o, tr, UNKNOWN)
            continue
        col = tuple(s[i] for s in per)
        put(o, tr, None if len(set(col)) == 1 else col)


def gathered(y, x, tr, g, dim: int, tiled: bool) -> None:
    """An all-gather's result ``y`` of ``x`` over group ``g`` along ``dim``: its shape at every
    position, from the operand's at the positions of that position's group."""
    shapes = of(x, tr)
    if shapes is UNKNOWN:
        return
    cs = coords(tr.mesh)
    if shapes is None:
        shapes = (tuple(x.shape),) * len(cs)
    names = g.names
    out = []
    for c in cs:
        members = [s for s, c2 in zip(shapes, cs) if all(c2[a] == c[a] for a in c if a not in names)]
        s = list(shapes[cs.index(c)])
        if tiled:
            s[dim] = sum(m[dim] for m in members)
        else:
            s.insert(dim, len(members))
        out.append(tuple(s))
    put(y, tr, None if len(set(out)) == 1 else tuple(out))
