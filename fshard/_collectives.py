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

Every collective also takes a pytree of tensors (dicts, lists, tuples, ...) and returns the
same tree. ``psum``, ``pmean``, ``all_gather`` and ``psum_scatter`` coalesce it: the leaves
of one dtype (and, for psum, the same varying axes) move in one collective, forward and
backward; the others apply to each leaf.

The mesh axis is the second argument, or JAX's keyword ``axis_name=``:
``fs.psum(x, axis_name="dp")`` is ``fs.psum(x, "dp")``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, TypeVar, cast

import optree
import torch
import torch.distributed as dist

from . import _combine, _comm, _reshard, _vma
from . import _shapes as _per_rank
from ._comm import untracked
from ._errors import ArgumentError, CollectiveError
from ._layout import chunk_sizes
from ._numbers import _after_branch, _is_number, _is_tracked_number, _psum_number
from ._operand_shapes import same_shapes, uneven_tiling
from ._primitives import (
    AllGather,
    AllGatherCoalesced,
    AllGatherDone,
    AllGatherInvariant,
    AllReduce,
    AllReduceCoalesced,
    AllToAll,
    Broadcast,
    Extremum,
    PPermute,
    PPermuteDone,
    ReduceScatter,
    ReduceScatterCoalesced,
    ReduceScatterDone,
    gather_operand,
    pick,
    split_blocks,
)
from ._primitives import apply as _apply

_T = TypeVar("_T")  # a tensor, or a pytree of tensors: the result has the same structure
_U = TypeVar("_U")  # a collective's operand, as the caller narrowed it

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
    "Pending",
    "axis_index",
    "axis_size",
]


# -- public API ---------------------------------------------------------------------------


_UNSET = object()


def _axis_name_alias(fn):
    """Accept JAX's keyword ``axis_name=`` for the mesh axis (``axis``), given once."""
    name = fn.__name__
    pos = 0 if name in ("axis_index", "axis_size") else 1

    @functools.wraps(fn)
    def inner(*args, axis_name=_UNSET, **kwargs):
        if axis_name is not _UNSET:
            if len(args) > pos or "axis" in kwargs:
                axis = args[pos] if len(args) > pos else kwargs["axis"]
                if isinstance(axis, int) and not isinstance(axis, bool):
                    raise ArgumentError(
                        f"fs.{name}: axis={axis} is a tensor dim in JAX's spelling; fshard calls it "
                        f"dim= and takes the mesh axis as axis_name= or the second argument: "
                        f"fs.{name}(x, {axis_name!r}, dim={axis})"
                    )
                raise ArgumentError(
                    f"fs.{name}: the mesh axis is given twice ({axis!r} and axis_name={axis_name!r}); "
                    f"give it once, as fs.{name}(x, {axis_name!r}) or fs.{name}(x, axis_name={axis_name!r})"
                )
            kwargs["axis"] = axis_name
        return fn(*args, **kwargs)

    return inner


_NO_SHAPE_CHECK = ("pvary", "pmean", "all_gather")  # no communication, or checked by their callee


def _prologue(x: _U, axis, where: str) -> tuple[Any, Any, int, int, _U]:
    tr = _vma.current(where)
    if not isinstance(x, torch.Tensor):
        raise CollectiveError(
            f"fs.{where} expects a torch.Tensor or a pytree of tensors, got {type(x).__name__}"
        )
    g = tr.mesh.axis_group(axis, where)
    if tr.uneven and g.size > 1 and where not in _NO_SHAPE_CHECK:
        same_shapes(_comm.gather_shapes([x], g, None, f"fs.{where}"), g, where)
    v = _vma.get(x, tr)
    if tr.taint:  # after a branch on a varying value: x may be the one a branch chose (_vma.operand)
        x, v = _vma.operand(x, tr, v)
    return tr, g, tr.mesh.bits(g.names), v, x


def _tree_prologue(tree, axis, where: str, check: bool = True):
    """The trace, axis group, axis bits, tensor leaves and treedef of a pytree operand (whose
    shapes must agree across ranks, in a call with uneven blocks, when ``check``)."""
    tr = _vma.current(where)
    g = tr.mesh.axis_group(axis, where)
    leaves, treedef = optree.tree_flatten(tree)
    if treedef.num_leaves == 1 and treedef.num_nodes == 1:  # a bare non-tensor value
        raise CollectiveError(
            f"fs.{where} expects a torch.Tensor or a pytree of tensors, got {type(tree).__name__}"
        )
    if not all(isinstance(x, torch.Tensor) for x in leaves):
        accessors, _, _ = optree.tree_flatten_with_accessor(tree)
        i = next(i for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor))
        raise CollectiveError(
            f"fs.{where} expects a torch.Tensor or a pytree of tensors, got {type(leaves[i]).__name__} "
            f"at {accessors[i].codify('x')}"
        )
    if check and tr.uneven and g.size > 1 and leaves:
        paths = [a.codify("x") for a in optree.tree_flatten_with_accessor(tree)[0]]
        same_shapes(_comm.gather_shapes(leaves, g, None, f"fs.{where}", paths), g, where, paths)
    return tr, g, tr.mesh.bits(g.names), leaves, treedef


def _tree_map(fn, tree, axis, where: str):
    """``fn`` applied to each leaf of a pytree of tensors (the collectives that do not coalesce)."""
    _, _, _, leaves, treedef = _tree_prologue(tree, axis, where)
    return optree.tree_unflatten(treedef, [fn(x) for x in leaves])


def _by_dtype(leaves, idx, key=lambda x: None) -> dict:
    """Leaf indices ``idx`` grouped by (key, dtype, device), in first-seen order (the same on every rank)."""
    groups: dict = {}
    for i in idx:
        x = leaves[i]
        groups.setdefault((key(x), x.dtype, x.device), []).append(i)
    return groups


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


def _div_untracked(x, n: int):
    """``x / n`` (by an int: torch.func.jvp of a 0-dim tensor times a Python float gives a
    float64 tangent)."""
    with untracked():
        return x / n


@_axis_name_alias
def psum(x: _T, axis) -> _T:
    """Sum ``x`` over mesh axis ``axis`` (a name or a tuple of names).

    The result is invariant over ``axis``. A value already invariant over ``axis`` is
    multiplied by the axis size without communication (that is the definition, as in JAX).
    Gradient: the cotangent passes through unchanged (pvary); no communication. Calls on one
    tensor each, made one after the other before any result is used, run combined as one
    all-reduce (``FSHARD_COMBINE=0`` turns that off; see the debugging page).

    Examples:
        >>> @fs.shard_map(mesh=mesh, in_specs=("b (tp k)", "(tp k) n"), out_specs="b n")
        ... def matmul(a, b):
        ...     return fs.psum(a @ b, "tp")

    ``x`` may be a pytree of tensors: the leaves of one dtype go in one all-reduce. A plain
    Python number is the same on every rank: ``fs.psum(1, "dp")`` is the size of ``dp``, as in
    JAX. A tracked one (`VaryingInt`/`VaryingFloat`: ``t.item()`` of a varying tensor, or the shape
    of a block in a call with uneven blocks) is summed over the ranks (a one-element all-reduce).

    Examples:
        >>> grads = fs.psum({"w": gw, "b": gb}, "dp")   # one all-reduce for both
        >>> n = fs.psum(1, "dp")                        # the axis size, no communication
        >>> rows = fs.psum(x.shape[0], "dp")            # 10 for 10 rows cut 3, 3, 3, 1 over dp
    """
    if _is_number(x):
        x = _after_branch(x)
    if _is_number(x):  # JAX's psum(1, axis): the axis size
        return x * axis_size(axis)
    if _is_tracked_number(x):  # a per-rank number (x.item(), a shape of uneven blocks): summed
        return _psum_number(x, axis, "psum")[0]
    if not isinstance(x, torch.Tensor):
        return _psum_tree(x, axis, "psum")
    tr = _vma.active()
    if _combine.deferrable(tr):
        y = _combine.psum_later(x, axis, tr)
        if y is not None:
            return y
    x0 = x
    tr, g, bits, v, x = _prologue(x, axis, "psum")
    vary = bits & v
    y = x
    if vary:
        y = _apply(AllReduce, x, tr.mesh.axis_group(tr.mesh.names_of(vary), "psum"))
    inv = bits & ~v
    if inv:
        y = _mul_untracked(y, math.prod([tr.mesh.axis_size(n) for n in tr.mesh.names_of(inv)]))
    if y is x0:
        return y
    if tr.uneven:  # the operand's shape (the same across the group: checked by _prologue)
        _per_rank.put(y, tr, _per_rank.of(x0, tr))
    return _vma.tag_result(y, tr, v & ~bits, bits)


def _psum_tree(tree, axis, where: str):
    tr, g, bits, leaves, treedef = _tree_prologue(tree, axis, where)
    leaves, vs = _vma.operands(leaves, tr)
    out = list(leaves)
    varying = [i for i, v in enumerate(vs) if v & bits]
    for (vary, _, _), idx in _by_dtype(leaves, varying, lambda x: bits & _vma.get(x, tr)).items():
        ga = tr.mesh.axis_group(tr.mesh.names_of(vary), where)
        if len(idx) == 1:
            ys = (_apply(AllReduce, leaves[idx[0]], ga),)
        else:
            ys = _apply(AllReduceCoalesced, ga, *[leaves[i] for i in idx])
        for i, y in zip(idx, ys):
            out[i] = y
    for i, v in enumerate(vs):
        inv = bits & ~v
        if inv:
            out[i] = _mul_untracked(out[i], math.prod([tr.mesh.axis_size(n) for n in tr.mesh.names_of(inv)]))
        if out[i] is not leaves[i]:
            _vma.tag_result(out[i], tr, v & ~bits, bits)
    return optree.tree_unflatten(treedef, out)


@_axis_name_alias
def pmean(x: _T, axis) -> _T:
    """Mean of ``x`` over mesh axis ``axis``: ``psum(x, axis) / axis_size(axis)``.

    Examples:
        >>> loss = fs.pmean(local_loss, "dp")
        >>> metrics = fs.pmean({"loss": loss, "acc": acc}, "dp")   # one all-reduce
    """
    if _is_number(x):
        x = _after_branch(x)
    if _is_number(x):  # the same number on every rank
        axis_size(axis)  # checks the axis
        return x
    if _is_tracked_number(x):
        total, n = _psum_number(x, axis, "pmean")
        return total / n
    if not isinstance(x, torch.Tensor):
        return _pmean_tree(x, axis)
    _, g, _, _, x = _prologue(x, axis, "pmean")
    y = psum(x, axis)
    if g.size == 1:
        return y
    tr = _vma.current("pmean")
    v = _vma.get(y, tr)
    return _vma.tag_result(_div_untracked(y, g.size), tr, v, tr.mesh.bits(g.names))


def _pmean_tree(tree, axis):
    summed = _psum_tree(tree, axis, "pmean")
    tr = _vma.current("pmean")
    g = tr.mesh.axis_group(axis, "pmean")
    n, clean = g.size, tr.mesh.bits(g.names)
    if n == 1:
        return summed
    return optree.tree_map(
        lambda y: _vma.tag_result(_div_untracked(y, n), tr, _vma.get(y, tr), clean), summed
    )


def _extremum(x, axis, op, where):
    tr, g, bits, v, x = _prologue(x, axis, where)
    vary = bits & v
    if not vary:
        return x
    y = _apply(Extremum, x, tr.mesh.axis_group(tr.mesh.names_of(vary), where), op)
    return _vma.tag_result(y, tr, v & ~bits, bits)


@_axis_name_alias
def pmax(x: _T, axis) -> _T:
    """Elementwise maximum over ``axis``; invariant over ``axis``.

    Gradient: the cotangent goes to the ranks whose value equals the maximum, split evenly
    among ties (as ``torch.amax`` does over the stacked values); it costs one all-reduce of
    the tie counts in the backward. A NaN on any rank gives NaN, as ``torch.amax`` does (value,
    gradient and tangent), also on backends whose max drops NaN.

    Examples:
        >>> m = fs.pmax(scores.amax(-1), "tp")
    """
    if not isinstance(x, torch.Tensor):
        return _tree_map(lambda t: pmax(t, axis), x, axis, "pmax")
    return _extremum(x, axis, dist.ReduceOp.MAX, "pmax")


@_axis_name_alias
def pmin(x: _T, axis) -> _T:
    """Elementwise minimum over ``axis``; invariant over ``axis``. Gradient as `pmax`.

    Examples:
        >>> lo = fs.pmin(x.amin(), "dp")
    """
    if not isinstance(x, torch.Tensor):
        return _tree_map(lambda t: pmin(t, axis), x, axis, "pmin")
    return _extremum(x, axis, dist.ReduceOp.MIN, "pmin")


@_axis_name_alias
def all_gather(
    x: _T, axis, dim: int = 0, tiled: bool = False, *, invariant: bool = False, async_op: bool = False
):
    """Gather the blocks of ``x`` from every index along ``axis``.

    With ``tiled=False`` the blocks are stacked in a new dimension ``dim``; with
    ``tiled=True`` they are concatenated along ``dim``.

    The result varies over ``axis`` and its gradient is a ``psum_scatter`` (one
    reduce-scatter: the FSDP pattern). With ``invariant=True`` the result is instead
    invariant over ``axis`` (so it may be returned with a replicated out_spec) and its
    gradient is this rank's slice of the cotangent, with no communication.

    Calls made one after the other before any result is used (one leaf at a time) run
    combined, as one all-gather per dtype and up to ``FSHARD_COMBINE_MB`` (4 MB) of results,
    and their gradients as one reduce-scatter each (``FSHARD_COMBINE=0`` turns that off; see
    the debugging page). The combined all-gathers run asynchronously: a result's first use waits
    for its own, while the next ones are on the wire (``FSHARD_COMBINE_AHEAD``, 2 at a time).

    Examples:
        >>> w = fs.all_gather(w_shard, "dp", dim=0, tiled=True)   # FSDP parameter
        >>> full = optree.tree_map(lambda p: fs.all_gather(p, "dp", dim=0, tiled=True), params)  # combined

    ``x`` may be a pytree of tensors, each gathered along ``dim``, or along its own dim when
    ``dim`` is a pytree of ints matching ``x`` (or a prefix of it): the leaves of one dtype go
    in one all-gather (and their gradients in one reduce-scatter), or in a few when their
    results pass ``FSHARD_COMBINE_MB``, as per-leaf calls are combined.

    Examples:
        >>> layer = fs.all_gather({"w": w_shard, "b": b_shard}, "dp", tiled=True)
        >>> top = fs.all_gather({"wte": wte, "w_out": w_out}, "dp", dim={"wte": 1, "w_out": 0}, tiled=True)
    """
    if not isinstance(x, torch.Tensor):
        _no_async_tree(async_op, "all_gather")
        return _all_gather_tree(x, axis, dim, tiled, invariant)
    if async_op and not invariant and _transformed():
        return _ready(all_gather(x, axis, dim, tiled))
    tr = _vma.active()
    if not async_op and _combine.deferrable(tr):
        y = _combine.all_gather_later(x, axis, dim, tiled, invariant, tr, _norm_dim)
        if y is not None:
            return y
    x0 = x
    tr, g, bits, v, x = _prologue(x, axis, "all_gather")
    assert isinstance(x, torch.Tensor)  # (for mypy: _prologue returns the operand it was given, cast)
    ndim = x.dim() if tiled else x.dim() + 1
    dim = _norm_dim(dim, ndim, "all_gather")
    x = _vary(x, tr, v, bits)
    if tr.uneven and g.size > 1:
        tiled = uneven_tiling(x, g, dim, tiled)
    if async_op:
        if invariant:
            raise CollectiveError(
                "fs.all_gather: async_op=True is not supported with invariant=True; gather "
                "asynchronously without it, or synchronously with invariant=True"
            )
        handle = _comm.all_gather_start(gather_operand(cast(torch.Tensor, x), dim, tiled), g)

        again = _reshard.active()

        def done():
            y = _vma.tag_result(_apply(AllGatherDone, x, g, dim, tiled, handle), tr, v | bits)
            y._fshard_gathered = g.names
            if again:
                _reshard.gather_again(y, x, AllGather, g, dim, tiled)
            return y

        return Pending(done)
    if invariant:
        y = _vma.tag_result(_apply(AllGatherInvariant, x, g, dim, tiled), tr, v & ~bits, bits)
        if tr.uneven:
            _per_rank.gathered(y, x0, tr, g, dim, tiled)
        if _reshard.active():
            _reshard.gather_again(y, x, AllGatherInvariant, g, dim, tiled)
        return y
    y = _vma.tag_result(_apply(AllGather, x, g, dim, tiled), tr, v | bits)
    if tr.uneven:
        _per_rank.gathered(y, x0, tr, g, dim, tiled)
    y._fshard_gathered = g.names  # the replication check suggests invariant=True for it
    if _reshard.active():
        _reshard.gather_again(y, x, AllGather, g, dim, tiled)
    return y


def _all_gather_tree(tree, axis, dim, tiled, invariant):
    tr, g, bits, leaves, treedef = _tree_prologue(tree, axis, "all_gather", check=False)
    accessors = optree.tree_flatten_with_accessor(tree)[0]
    if isinstance(dim, int):
        per_leaf = [dim] * len(leaves)
    else:  # one dim per leaf, or per subtree
        try:
            per_leaf = optree.broadcast_prefix(dim, tree)
        except ValueError:
            raise CollectiveError(
                f"fs.all_gather: dim must be an int or a pytree of ints matching x (or a prefix of it); "
                f"got dim={dim!r} for x with structure {treedef}"
            ) from None
    dims = [
        _norm_dim(d, x.dim() if tiled else x.dim() + 1, f"all_gather at {acc.codify('x')}")
        for x, d, acc in zip(leaves, per_leaf, accessors)
    ]
    if g.size > 1 and _combine.deferrable(tr):  # queued as per-leaf calls: the same size-capped buckets
        queued = [
            _combine.all_gather_later(x, axis, d, tiled, invariant, tr, _norm_dim)
            for x, d in zip(leaves, dims)
        ]
        return optree.tree_unflatten(treedef, queued)
    leaves, vs = _vma.operands(leaves, tr)
    tiling = tiled  # per leaf where some leaf's blocks are uneven (as the per-leaf form gathers them)
    if tr.uneven and g.size > 1 and leaves:  # one small all-gather of every leaf's shape
        paths = [a.codify("x") for a in accessors]
        shapes = _comm.gather_shapes(leaves, g, None, "fs.all_gather", paths)
        tiling = tuple(
            uneven_tiling(x, g, d, tiled, shapes, k, paths[k]) for k, (x, d) in enumerate(zip(leaves, dims))
        )
        tiling = tiled if all(t is tiled for t in tiling) else tiling
    xs = [_vary(x, tr, v, bits) for x, v in zip(leaves, vs)]
    out = list(xs)
    for _, idx in _by_dtype(xs, range(len(xs))).items():
        sub, ts = tuple(dims[i] for i in idx), pick(tiling, idx)
        if len(idx) == 1:
            one = ts[0] if type(ts) is tuple else ts
            ys = (_apply(AllGatherInvariant if invariant else AllGather, xs[idx[0]], g, sub[0], one),)
        else:
            ys = _apply(AllGatherCoalesced, g, sub, ts, invariant, *[xs[i] for i in idx])
        if _reshard.active():
            _reshard.gather_again_many(ys, [xs[i] for i in idx], g, list(sub), ts, invariant)
        for i, y in zip(idx, ys):
            out[i] = y
    for y, v in zip(out, vs):
        if invariant:
            _vma.tag_result(y, tr, v & ~bits, bits)
        else:
            _vma.tag_result(y, tr, v | bits)
            y._fshard_gathered = g.names
    return optree.tree_unflatten(treedef, out)


@_axis_name_alias
def psum_scatter(x: _T, axis, dim: int = 0, tiled: bool = False, *, async_op: bool = False):
    """Sum ``x`` over ``axis`` and keep this rank's block along ``dim`` (a reduce-scatter).

    With ``tiled=False`` dimension ``dim`` must have the axis size and is removed; with
    ``tiled=True`` it is cut into one block per index, as torch.chunk cuts it (uneven when the
    axis size does not divide it: 10 rows over 4 ranks give 3, 3, 3 and 1). The result varies
    over ``axis``; the gradient is an ``all_gather`` (of the same blocks).

    Examples:
        >>> y_block = fs.psum_scatter(partial_y, "tp", dim=0, tiled=True)

    ``x`` may be a pytree of tensors, each scattered along ``dim``: the leaves of one dtype
    go in one reduce-scatter (and their gradients in one all-gather).

    Examples:
        >>> g_shards = fs.psum_scatter(grads, "dp", tiled=True)   # ZeRO-style gradient shards
    """
    if not isinstance(x, torch.Tensor):
        _no_async_tree(async_op, "psum_scatter")
        return _psum_scatter_tree(x, axis, dim, tiled)
    if async_op and _transformed():
        return _ready(psum_scatter(x, axis, dim, tiled))
    tr, g, bits, v, x = _prologue(x, axis, "psum_scatter")
    dim = _check_scatter(x, g, dim, tiled, "psum_scatter", uneven=True)
    x = _vary(x, tr, v, bits)
    size = cast(torch.Tensor, x).shape[dim]
    tiling: bool | tuple[int, ...] = tiled
    if tiled and size % g.size:  # uneven blocks: later collectives of the call check shapes
        tiling = chunk_sizes(size, [g.size])
        tr.uneven = True
    if async_op:
        handle = _comm.reduce_scatter_start(split_blocks(cast(torch.Tensor, x), g.size, dim, tiling), g)
        return Pending(
            lambda: _vma.tag_result(_apply(ReduceScatterDone, x, g, dim, tiling, handle), tr, v | bits)
        )
    return _vma.tag_result(_apply(ReduceScatter, x, g, dim, tiling), tr, v | bits)


class Pending:
    """A collective started with ``async_op=True``: compute meanwhile, then ``wait()``.

    ``wait()`` blocks until the transfer is done and returns the result, a tensor like the
    synchronous collective's (with the same gradient); later calls return the same tensor.
    Call it inside the same shard_map call.

    Examples:
        >>> nxt = fs.ppermute(blk, "tp", ring, async_op=True)   # starts the transfer
        >>> acc = acc + blk @ w                                 # overlaps with it
        >>> blk = nxt.wait()
    """

    __slots__ = ("_finish", "_out")

    def __init__(self, finish):
        self._finish = finish
        self._out = None

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            self._out = self._finish()
            self._finish = None
        return self._out


_transformed = torch._C._are_functorch_transforms_active


def _ready(y: torch.Tensor) -> Pending:
    """``async_op=True`` under torch.func transforms (vmap, jvp, grad, ...): the collective ran
    synchronously (a started collective could not be batched or differentiated forward)."""
    return Pending(lambda: y)


def _no_async_tree(async_op: bool, where: str) -> None:
    if async_op:
        raise CollectiveError(
            f"fs.{where}: async_op=True takes a single tensor, not a pytree; start one per leaf"
        )


def _check_scatter(x, g, dim, tiled, where, uneven: bool = False) -> int:
    dim = _norm_dim(dim, x.dim(), where)
    if tiled:
        if not uneven:
            _check_divisible(x, dim, g.size, where)
    elif x.shape[dim] != g.size:
        raise CollectiveError(
            f"fs.{where}: with tiled=False dim {dim} must have the axis size {g.size}, "
            f"but x has shape {tuple(x.shape)}; pass tiled=True to split it into {g.size} blocks"
        )
    return dim


def _psum_scatter_tree(tree, axis, dim, tiled):
    tr, g, bits, leaves, treedef = _tree_prologue(tree, axis, "psum_scatter")
    accessors = optree.tree_flatten_with_accessor(tree)[0]
    dims = [
        _check_scatter(x, g, dim, tiled, f"psum_scatter at {acc.codify('x')}")
        for x, acc in zip(leaves, accessors)
    ]
    leaves, vs = _vma.operands(leaves, tr)
    xs = [_vary(x, tr, v, bits) for x, v in zip(leaves, vs)]
    out = list(xs)
    for _, idx in _by_dtype(xs, range(len(xs))).items():
        if len(idx) == 1:
            i = idx[0]
            ys = (_apply(ReduceScatter, xs[i], g, dims[i], tiled),)
        else:
            ys = _apply(ReduceScatterCoalesced, g, tuple(dims[i] for i in idx), tiled, *[xs[i] for i in idx])
        for i, y in zip(idx, ys):
            out[i] = y
    for y, v in zip(out, vs):
        _vma.tag_result(y, tr, v | bits)
    return optree.tree_unflatten(treedef, out)


@_axis_name_alias
def all_to_all(x: _T, axis, split_dim: int, concat_dim: int) -> _T:
    """Cut ``split_dim`` into axis-size blocks, send block j to index j, concatenate along ``concat_dim``.

    ``split_dim`` shrinks by the axis size and ``concat_dim`` grows by it. The gradient is
    the same all-to-all with the two dims swapped.

    Examples:
        >>> # sequence parallel -> head parallel: (b, s/n, h, d) -> (b, s, h/n, d)
        >>> q = fs.all_to_all(q, "sp", split_dim=2, concat_dim=1)
    """
    if not isinstance(x, torch.Tensor):
        return _tree_map(lambda t: all_to_all(t, axis, split_dim, concat_dim), x, axis, "all_to_all")
    tr, g, bits, v, x = _prologue(x, axis, "all_to_all")
    assert isinstance(x, torch.Tensor)  # (for mypy: _prologue returns the operand it was given, cast)
    split_dim = _norm_dim(split_dim, x.dim(), "all_to_all", "split_dim")
    concat_dim = _norm_dim(concat_dim, x.dim(), "all_to_all", "concat_dim")
    _check_divisible(x, split_dim, g.size, "all_to_all", "split_dim")
    x = _vary(x, tr, v, bits)
    return _vma.tag_result(_apply(AllToAll, x, g, split_dim, concat_dim), tr, v | bits)


@_axis_name_alias
def ppermute(x: _T, axis, perm, *, async_op: bool = False):
    """Send ``x`` along ``axis`` by ``perm``, a list of ``(source index, destination index)`` pairs.

    An index that no pair sends to receives zeros. Only the ranks in ``perm`` communicate,
    point to point (one send and one receive at most per rank): a single pair is one send and
    one receive, and a rank that no pair involves does not communicate. The gradient is the
    ppermute with the pairs reversed. ``x`` may be a pytree of tensors (one ppermute per leaf).

    With ``async_op=True`` (a single tensor) the transfer starts and a `Pending` is returned:
    compute meanwhile, then ``.wait()`` gives the result (the gradient's ppermute is synchronous).

    Examples:
        >>> n = fs.axis_size("pp")
        >>> nxt = fs.ppermute(h, "pp", [(i, (i + 1) % n) for i in range(n)])
        >>> h1 = fs.ppermute(h0, "pp", [(0, 1)])   # stage 0 -> stage 1 only
    """
    if not isinstance(x, torch.Tensor):
        _no_async_tree(async_op, "ppermute")
        return _tree_map(lambda t: ppermute(t, axis, perm), x, axis, "ppermute")
    if async_op and _transformed():
        return _ready(ppermute(x, axis, perm))
    tr, g, bits, v, x = _prologue(x, axis, "ppermute")
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
    if async_op:
        handle = _comm.permute_start(cast(torch.Tensor, x), g, pairs)
        return Pending(lambda: _vma.tag_result(_apply(PPermuteDone, x, g, pairs, handle), tr, v | bits))
    return _vma.tag_result(_apply(PPermute, x, g, pairs), tr, v | bits)


@_axis_name_alias
def pbroadcast(x: _T, axis, src: int = 0) -> _T:
    """Every index along ``axis`` gets the value of index ``src``; the result is invariant over ``axis``.

    Gradient: the cotangent stays on the source index; other indices get zeros.

    Examples:
        >>> w = fs.pbroadcast(w, "dp", src=0)
    """
    if not isinstance(x, torch.Tensor):
        return _tree_map(lambda t: pbroadcast(t, axis, src), x, axis, "pbroadcast")
    tr, g, bits, v, x = _prologue(x, axis, "pbroadcast")
    if not isinstance(src, int) or not 0 <= src < g.size:
        raise CollectiveError(
            f"fs.pbroadcast: src={src!r} must be an index in [0, {g.size}) of axis {axis!r}"
        )
    if not bits & v:
        return x
    return _vma.tag_result(_apply(Broadcast, x, g, src), tr, v & ~bits, bits)


@_axis_name_alias
def pvary(x: _T, axis) -> _T:
    """Mark an invariant ``x`` as varying over ``axis`` (identity; gradient is a ``psum``).

    shard_map inserts this implicitly wherever an invariant value meets a varying one;
    call it yourself only to make a value's type explicit.

    Examples:
        >>> w_v = fs.pvary(w, "dp")
    """
    if not isinstance(x, torch.Tensor):
        return _tree_map(lambda t: pvary(t, axis), x, axis, "pvary")
    tr, g, bits, v, x = _prologue(x, axis, "pvary")
    assert isinstance(x, torch.Tensor)  # (for mypy: _prologue returns the operand it was given, cast)
    if not bits & ~v:
        return x
    out = _vma.pvary(x, tr, v, v | bits)
    return _vma.tag_result(out if out is not x else _view(x), tr, v | bits)


def _view(x):
    with untracked():
        return x.view_as(x)


@_axis_name_alias
def axis_index(axis) -> torch.Tensor:
    """This rank's index along ``axis`` as a 0-dim int64 tensor that varies over ``axis``.

    Examples:
        >>> offset = fs.axis_index("tp") * local_vocab
    """
    tr = _vma.current("axis_index")
    g = tr.mesh.axis_group(axis, "axis_index")
    with untracked():
        t = torch.tensor(g.index, dtype=torch.int64, device=tr.mesh.device)
    return _vma.tag_result(t, tr, tr.mesh.bits(g.names))


@_axis_name_alias
def axis_size(axis) -> int:
    """The size of ``axis`` (product of sizes for a tuple), as a Python int.

    Examples:
        >>> n = fs.axis_size(("dp", "tp"))
    """
    tr = _vma.current("axis_size")
    return tr.mesh.axis_group(axis, "axis_size").size
