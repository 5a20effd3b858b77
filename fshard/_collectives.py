"""Named-axis collectives for use inside ``shard_map``: the public API over ``_primitives``.

Each function checks its arguments, decides from the varying axes of its operand which
primitive (``_primitives``) to apply, and tags the result's varying axes. The transpose
rules follow JAX's shard_map with varying-axes tracking:

=====================  ==============================  ===================================
op                     varying axes                    gradient
=====================  ==============================  ===================================
psum                   varying -> invariant            identity (pvary), no communication
all_gather             varying -> varying              psum_scatter
all_gather(invariant)  varying -> invariant            local slice, no communication
psum_scatter           varying -> varying              all_gather
all_to_all             varying -> varying              all_to_all, split and concat swapped
ppermute               varying -> varying              ppermute with the inverse pairs
pbroadcast             varying -> invariant            cotangent kept on the source only
pmax / pmin            varying -> invariant            to the ranks holding the extremum,
                                                       split evenly among ties
=====================  ==============================  ===================================
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import _vma
from ._comm import untracked
from ._errors import CollectiveError
from ._primitives import (
    AllGather,
    AllGatherInvariant,
    AllReduce,
    AllToAll,
    Broadcast,
    Extremum,
    PPermute,
    ReduceScatter,
)
from ._primitives import apply as _apply

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "pbroadcast",
    "pvary",
    "axis_index",
    "axis_size",
]


# -- public API ---------------------------------------------------------------------------


def _prologue(x, axis, where: str):
    tr = _vma.current(where)
    if not isinstance(x, torch.Tensor):
        raise CollectiveError(f"fs.{where} expects a torch.Tensor, got {type(x).__name__}")
    g = tr.mesh.axis_group(axis, where)
    return tr, g, tr.mesh.bits(g.names), _vma.get(x, tr)


def _norm_dim(dim: int, ndim: int, where: str, what: str = "dim") -> int:
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise CollectiveError(f"fs.{where}: {what}={dim!r} is out of range for a tensor of {ndim} dims")
    return dim % ndim


def _check_divisible(x, dim, n, where, what="dim"):
    if x.shape[dim] % n:
        raise CollectiveError(
            f"fs.{where}: {what} {dim} of shape {tuple(x.shape)} has size {x.shape[dim]}, "
            f"which the axis size {n} does not divide; pad it to {-(-x.shape[dim] // n) * n}"
        )


def _vary(x, tr, have, bits):
    """Make ``x`` vary over ``bits`` before a varying->varying collective."""
    return _vma.pvary(x, tr, have, have | bits)


def _mul_untracked(x, k):
    with untracked():
        return x * k


def psum(x: torch.Tensor, axis) -> torch.Tensor:
    """Sum ``x`` over mesh axis ``axis`` (a name or a tuple of names).

    The result is invariant over ``axis``. A value already invariant over ``axis`` is
    multiplied by the axis size without communication (that is the definition, as in JAX).
    Gradient: the cotangent passes through unchanged (pvary); no communication.

    Examples:
        >>> @fs.shard_map(mesh=mesh, in_specs=("b (tp k)", "(tp k) n"), out_specs="b n")
        ... def matmul(a, b):
        ...     return fs.psum(a @ b, "tp")
    """
    tr, g, bits, v = _prologue(x, axis, "psum")
    vary = bits & v
    y = x
    if vary:
        y = _apply(AllReduce, x, tr.mesh.axis_group(tr.mesh.names_of(vary), "psum"))
    inv = bits & ~v
    if inv:
        y = _mul_untracked(y, math.prod(tr.mesh.axis_size(n) for n in tr.mesh.names_of(inv)))
    return _vma.tag(y, tr, v & ~bits) if y is not x else y


def pmean(x: torch.Tensor, axis) -> torch.Tensor:
    """Mean of ``x`` over mesh axis ``axis``: ``psum(x, axis) / axis_size(axis)``.

    Examples:
        >>> loss = fs.pmean(local_loss, "dp")
    """
    _, g, _, _ = _prologue(x, axis, "pmean")
    y = psum(x, axis)
    if g.size == 1:
        return y
    tr = _vma.current("pmean")
    v = _vma.get(y, tr)
    return _vma.tag(_mul_untracked(y, 1.0 / g.size), tr, v)


def _extremum(x, axis, op, where):
    tr, g, bits, v = _prologue(x, axis, where)
    vary = bits & v
    if not vary:
        return x
    y = _apply(Extremum, x, tr.mesh.axis_group(tr.mesh.names_of(vary), where), op)
    return _vma.tag(y, tr, v & ~bits)


def pmax(x: torch.Tensor, axis) -> torch.Tensor:
    """Elementwise maximum over ``axis``; invariant over ``axis``.

    Gradient: the cotangent goes to the ranks whose value equals the maximum, split evenly
    among ties (as ``torch.amax`` does over the stacked values); it costs one all-reduce of
    the tie counts in the backward.

    Examples:
        >>> m = fs.pmax(scores.amax(-1), "tp")
    """
    return _extremum(x, axis, dist.ReduceOp.MAX, "pmax")


def pmin(x: torch.Tensor, axis) -> torch.Tensor:
    """Elementwise minimum over ``axis``; invariant over ``axis``. Gradient as `pmax`.

    Examples:
        >>> lo = fs.pmin(x.amin(), "dp")
    """
    return _extremum(x, axis, dist.ReduceOp.MIN, "pmin")


def all_gather(x: torch.Tensor, axis, dim: int = 0, tiled: bool = False, *, invariant: bool = False):
    """Gather the blocks of ``x`` from every index along ``axis``.

    With ``tiled=False`` the blocks are stacked in a new dimension ``dim``; with
    ``tiled=True`` they are concatenated along ``dim``.

    The result varies over ``axis`` and its gradient is a ``psum_scatter`` (one
    reduce-scatter: the FSDP pattern). With ``invariant=True`` the result is instead
    invariant over ``axis`` (so it may be returned with a replicated out_spec) and its
    gradient is this rank's slice of the cotangent, with no communication.

    Examples:
        >>> w = fs.all_gather(w_shard, "dp", dim=0, tiled=True)   # FSDP parameter
    """
    tr, g, bits, v = _prologue(x, axis, "all_gather")
    ndim = x.dim() if tiled else x.dim() + 1
    dim = _norm_dim(dim, ndim, "all_gather")
    x = _vary(x, tr, v, bits)
    if invariant:
        return _vma.tag(_apply(AllGatherInvariant, x, g, dim, tiled), tr, v & ~bits)
    y = _vma.tag(_apply(AllGather, x, g, dim, tiled), tr, v | bits)
    y._fshard_gathered = g.names  # the replication check suggests invariant=True for it
    return y


def psum_scatter(x: torch.Tensor, axis, dim: int = 0, tiled: bool = False) -> torch.Tensor:
    """Sum ``x`` over ``axis`` and keep this rank's block along ``dim`` (a reduce-scatter).

    With ``tiled=False`` dimension ``dim`` must have the axis size and is removed; with
    ``tiled=True`` it must be divisible by the axis size and shrinks by it. The result
    varies over ``axis``; the gradient is an ``all_gather``.

    Examples:
        >>> y_block = fs.psum_scatter(partial_y, "tp", dim=0, tiled=True)
    """
    tr, g, bits, v = _prologue(x, axis, "psum_scatter")
    dim = _norm_dim(dim, x.dim(), "psum_scatter")
    if tiled:
        _check_divisible(x, dim, g.size, "psum_scatter")
    elif x.shape[dim] != g.size:
        raise CollectiveError(
            f"fs.psum_scatter: with tiled=False dim {dim} must have the axis size {g.size}, "
            f"but x has shape {tuple(x.shape)}; pass tiled=True to split it into {g.size} blocks"
        )
    x = _vary(x, tr, v, bits)
    return _vma.tag(_apply(ReduceScatter, x, g, dim, tiled), tr, v | bits)


def all_to_all(x: torch.Tensor, axis, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Cut ``split_dim`` into axis-size blocks, send block j to index j, concatenate along ``concat_dim``.

    ``split_dim`` shrinks by the axis size and ``concat_dim`` grows by it. The gradient is
    the same all-to-all with the two dims swapped.

    Examples:
        >>> # sequence parallel -> head parallel: (b, s/n, h, d) -> (b, s, h/n, d)
        >>> q = fs.all_to_all(q, "sp", split_dim=2, concat_dim=1)
    """
    tr, g, bits, v = _prologue(x, axis, "all_to_all")
    split_dim = _norm_dim(split_dim, x.dim(), "all_to_all", "split_dim")
    concat_dim = _norm_dim(concat_dim, x.dim(), "all_to_all", "concat_dim")
    _check_divisible(x, split_dim, g.size, "all_to_all", "split_dim")
    x = _vary(x, tr, v, bits)
    return _vma.tag(_apply(AllToAll, x, g, split_dim, concat_dim), tr, v | bits)


def ppermute(x: torch.Tensor, axis, perm) -> torch.Tensor:
    """Send ``x`` along ``axis`` by ``perm``, a list of ``(source index, destination index)`` pairs.

    An index that no pair sends to receives zeros. The gradient is the ppermute with the
    pairs reversed.

    Examples:
        >>> n = fs.axis_size("pp")
        >>> nxt = fs.ppermute(h, "pp", [(i, (i + 1) % n) for i in range(n)])
    """
    tr, g, bits, v = _prologue(x, axis, "ppermute")
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise CollectiveError(
            f"fs.ppermute: perm must be a list of (source, destination) index pairs, got {perm!r}"
        ) from None
    srcs = [s for s, _ in pairs]
    dsts = [d for _, d in pairs]
    bad = [p for p in pairs if not (0 <= p[0] < g.size and 0 <= p[1] < g.size)]
    if bad or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        why = (
            f"indices must lie in [0, {g.size})"
            if bad
            else "each index may appear at most once as a source and once as a destination"
        )
        raise CollectiveError(
            f"fs.ppermute: bad perm {list(pairs)} for axis {axis!r} of size {g.size}: {why}"
        )
    x = _vary(x, tr, v, bits)
    return _vma.tag(_apply(PPermute, x, g, pairs), tr, v | bits)


def pbroadcast(x: torch.Tensor, axis, src: int = 0) -> torch.Tensor:
    """Every index along ``axis`` gets the value of index ``src``; the result is invariant over ``axis``.

    Gradient: the cotangent stays on the source index; other indices get zeros.

    Examples:
        >>> w = fs.pbroadcast(w, "dp", src=0)
    """
    tr, g, bits, v = _prologue(x, axis, "pbroadcast")
    if not isinstance(src, int) or not 0 <= src < g.size:
        raise CollectiveError(
            f"fs.pbroadcast: src={src!r} must be an index in [0, {g.size}) of axis {axis!r}"
        )
    if not bits & v:
        return x
    return _vma.tag(_apply(Broadcast, x, g, src), tr, v & ~bits)


def pvary(x: torch.Tensor, axis) -> torch.Tensor:
    """Mark an invariant ``x`` as varying over ``axis`` (identity; gradient is a ``psum``).

    shard_map inserts this implicitly wherever an invariant value meets a varying one;
    call it yourself only to make a value's type explicit.

    Examples:
        >>> w_v = fs.pvary(w, "dp")
    """
    tr, g, bits, v = _prologue(x, axis, "pvary")
    if not bits & ~v:
        return x
    out = _vma.pvary(x, tr, v, v | bits)
    return _vma.tag(out if out is not x else _view(x), tr, v | bits)


def _view(x):
    with untracked():
        return x.view_as(x)


def axis_index(axis) -> torch.Tensor:
    """This rank's index along ``axis`` as a 0-dim int64 tensor that varies over ``axis``.

    Examples:
        >>> offset = fs.axis_index("tp") * local_vocab
    """
    tr = _vma.current("axis_index")
    g = tr.mesh.axis_group(axis, "axis_index")
    with untracked():
        t = torch.tensor(g.index, dtype=torch.int64, device=tr.mesh.device)
    return _vma.tag(t, tr, tr.mesh.bits(g.names))


def axis_size(axis) -> int:
    """The size of ``axis`` (product of sizes for a tuple), as a Python int.

    Examples:
        >>> n = fs.axis_size(("dp", "tp"))
    """
    tr = _vma.current("axis_size")
    return tr.mesh.axis_group(axis, "axis_size").size
