"""Named-axis collectives for use inside ``shard_map``, each with its gradient rule.

Every primitive is a ``torch.autograd.Function`` with a separate ``setup_context``, so
``loss.backward()``, ``torch.autograd.grad``, ``torch.func.grad`` and ``torch.func.vjp``
all pass through. The transpose rules follow JAX's shard_map with varying-axes tracking:

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

import functools
import math

import torch
import torch.distributed as dist

from . import _comm, _vma
from ._errors import CollectiveError
from ._mesh import AxisGroup
from ._vma import apply as _apply

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


def _untracked(fn):
    """Run an autograd-Function body with shard_map's tracking mode out of the way."""

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        with _comm._no_tf():
            return fn(*args, **kwargs)

    return inner


# -- layout helpers (pure tensor reshapes around the block-stacked comm functions) --------


def gather_dim(x: torch.Tensor, g: AxisGroup, dim: int, tiled: bool) -> torch.Tensor:
    blocks = _comm.all_gather_blocks(x, g)  # [N, *x.shape]
    if not tiled:
        return blocks.movedim(0, dim)
    shape = list(x.shape)
    shape[dim] *= g.size
    return blocks.movedim(0, dim).reshape(shape)


def _split_blocks(x: torch.Tensor, n: int, dim: int, tiled: bool) -> torch.Tensor:
    """``x`` as ``[n, *block]``: block j is the j-th piece of ``dim``."""
    if not tiled:
        return x.movedim(dim, 0)
    shape = list(x.shape)
    shape[dim : dim + 1] = [n, shape[dim] // n]
    return x.reshape(shape).movedim(dim, 0)


def scatter_dim(x: torch.Tensor, g: AxisGroup, dim: int, tiled: bool) -> torch.Tensor:
    return _comm.reduce_scatter_blocks(_split_blocks(x, g.size, dim, tiled), g)


def local_block(x: torch.Tensor, g: AxisGroup, dim: int, tiled: bool) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (no communication)."""
    if not tiled:
        return x.select(dim, g.index)
    s = x.shape[dim] // g.size
    return x.narrow(dim, g.index * s, s)


def a2a_dim(x: torch.Tensor, g: AxisGroup, split_dim: int, concat_dim: int) -> torch.Tensor:
    blocks = _split_blocks(x, g.size, split_dim, True)
    got = _comm.all_to_all_blocks(blocks, g)  # [N, *block]; row i came from index i
    shape = list(blocks.shape[1:])
    shape[concat_dim] *= g.size
    return got.movedim(0, concat_dim).reshape(shape)


# -- autograd Functions -------------------------------------------------------------------


class AllReduce(torch.autograd.Function):
    """psum: all-reduce forward; the transpose is pvary (identity, whose own transpose is psum)."""

    @staticmethod
    @_untracked
    def forward(x, g):
        return _comm.all_reduce(x, g)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g = inputs[1]

    @staticmethod
    def backward(ctx, ct):
        if torch.is_grad_enabled():  # double backward: record the pvary so it transposes to psum
            return _apply(_vma._Pvary, ct, ctx.g), None
        return ct, None


_vma.PSUM = AllReduce


class AllGather(torch.autograd.Function):
    @staticmethod
    @_untracked
    def forward(x, g, dim, tiled):
        return gather_dim(x, g, dim, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        return _apply(ReduceScatter, ct, *ctx.args), None, None, None


class AllGatherInvariant(torch.autograd.Function):
    @staticmethod
    @_untracked
    def forward(x, g, dim, tiled):
        return gather_dim(x, g, dim, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        return local_block(ct, *ctx.args), None, None, None


class LocalSlice(torch.autograd.Function):
    """This rank's block of an invariant value (no communication); gradient: all_gather."""

    @staticmethod
    @_untracked
    def forward(x, g, dim, tiled):
        return local_block(x, g, dim, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        return _apply(AllGatherInvariant, ct, *ctx.args), None, None, None


class ReduceScatter(torch.autograd.Function):
    @staticmethod
    @_untracked
    def forward(x, g, dim, tiled):
        return scatter_dim(x, g, dim, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        return _apply(AllGather, ct, *ctx.args), None, None, None


class AllToAll(torch.autograd.Function):
    @staticmethod
    @_untracked
    def forward(x, g, split_dim, concat_dim):
        return a2a_dim(x, g, split_dim, concat_dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        g, split_dim, concat_dim = ctx.args
        return _apply(AllToAll, ct, g, concat_dim, split_dim), None, None, None


class PPermute(torch.autograd.Function):
    @staticmethod
    @_untracked
    def forward(x, g, perm):
        return _comm.permute(x, g, perm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g, ctx.perm = inputs[1:]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        inverse = tuple((d, s) for s, d in ctx.perm)
        return _apply(PPermute, ct, ctx.g, inverse), None, None


class Broadcast(torch.autograd.Function):
    @staticmethod
    @_untracked
    def forward(x, g, src):
        return _comm.broadcast(x, g, src)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g, ctx.src = inputs[1:]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        return (ct if ctx.g.index == ctx.src else torch.zeros_like(ct)), None, None


class Extremum(torch.autograd.Function):
    @staticmethod
    @_untracked
    def forward(x, g, op):
        return _comm.all_reduce(x, g, op)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g = inputs[1]
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        x, y = ctx.saved_tensors
        hit = (x == y).to(ct.dtype)
        ties = _comm.all_reduce(hit, ctx.g)
        return ct * hit / ties, None, None


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
    with _comm._no_tf():
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
    return _vma.tag(_apply(AllGather, x, g, dim, tiled), tr, v | bits)


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
            f"indices must lie in [0, {g.size})" if bad else "each index may appear at most once as a source "
            "and once as a destination"
        )
        raise CollectiveError(f"fs.ppermute: bad perm {list(pairs)} for axis {axis!r} of size {g.size}: {why}")
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
        raise CollectiveError(f"fs.pbroadcast: src={src!r} must be an index in [0, {g.size}) of axis {axis!r}")
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
    with _comm._no_tf():
        return x.view_as(x)


def axis_index(axis) -> torch.Tensor:
    """This rank's index along ``axis`` as a 0-dim int64 tensor that varies over ``axis``.

    Examples:
        >>> offset = fs.axis_index("tp") * local_vocab
    """
    tr = _vma.current("axis_index")
    g = tr.mesh.axis_group(axis, "axis_index")
    with _comm._no_tf():
        t = torch.tensor(g.index, dtype=torch.int64, device=tr.mesh.device)
    return _vma.tag(t, tr, tr.mesh.bits(g.names))


def axis_size(axis) -> int:
    """The size of ``axis`` (product of sizes for a tuple), as a Python int.

    Examples:
        >>> n = fs.axis_size(("dp", "tp"))
    """
    tr = _vma.current("axis_size")
    return tr.mesh.axis_group(axis, "axis_size").size
