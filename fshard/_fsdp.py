"""``fs.fsdp_scan``: an FSDP layer loop that gathers per layer, prefetches and frees.

Each layer's parameters are stored split over a mesh axis (FSDP / ZeRO-3). The loop gathers
one layer at a time, in one all-gather per dtype (the layer's leaves packed into one flat
buffer); while layer ``i`` computes, layer ``i + 1``'s all-gather is already in flight. The
gathered copy is freed once the layer's forward is done: the tensors the layer's ops save for
the backward that are (views of) the gathered parameters are kept as placeholders
(``torch.autograd.graph.saved_tensors_hooks``) and the backward gathers the layer again when it
first needs one, starting the previous layer's gather meanwhile; the activations are kept, as
torch's FSDP does. The transpose of each layer's gather is one reduce-scatter (per dtype) of its
gradients. Peak memory: the sharded parameters plus about two gathered layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import optree
import torch
import torch.utils.checkpoint

from . import _comm, _compile, _vma
from ._collectives import _by_dtype, _vary
from ._comm import untracked
from ._errors import ArgumentError
from ._mesh import AxisGroup
from ._primitives import (
    AllGather,
    AllGatherCoalesced,
    ReduceScatterCoalesced,
    _functorch_active,
    _pack,
    _untracked,
    apply,
    split_blocks,
    unpack_gathered,
)
from ._spec import parse_spec

__all__ = ["fsdp_scan"]

_H = TypeVar("_H")


def fsdp_scan(
    layer_fn: Callable[[Any, _H], _H],
    layers,
    h: _H,
    axis="dp",
    *,
    dims=0,
    prefetch: bool = True,
) -> _H:
    """Run ``h = layer_fn(layer, h)`` over FSDP layers, gathering each one only while it is used.

    Call it inside ``fs.shard_map``. ``layers`` holds this rank's blocks of the layers'
    parameters, split over mesh axis ``axis``: a list (or tuple) of per-layer pytrees, or one
    pytree whose leaves stack the layers along their first dim. ``layer_fn`` receives one
    layer's pytree with its split leaves all-gathered along their split dim, and the carry ``h``
    (any value), and returns the next carry; ``fsdp_scan`` returns the last one.

    ``dims`` says where each leaf is split over ``axis``: an int (every leaf along that dim), or
    a pytree prefix of one layer (or of ``layers``) whose leaves are ints, ``None`` (not split:
    passed as is) or the spec string the leaf is stored with (``"(dp d) e"``: the dim that
    names ``axis``; for stacked layers the spec includes the leading layer dim).

    Per layer: one all-gather per dtype in the forward, started while the previous layer
    computes; the gathered copy is freed after the layer's forward and gathered again in the
    backward (one more all-gather per dtype, the previous layer's started meanwhile), and the
    gradients leave in one reduce-scatter per dtype. Activations are kept for the backward as
    usual. ``prefetch=False`` gathers each layer when it is reached instead.

    The blocks may be uneven, as `fs.shard` cuts a dim the axis size does not divide (10 rows
    over 4 ranks: 3, 3, 3 and 1; empty blocks where there are more ranks than rows): they travel
    padded to the longest block and are cut back, and so do their gradients; the scan then
    first compares its leaves' block shapes across ``axis`` (one small all-gather per call).

    Under ``torch.compile`` (``fs.compile``, or ``torch.compile(fullgraph=True)``) each layer's
    gather, one all-gather per dtype, is a ``torch.utils.checkpoint`` region whose every op must
    be recomputed (SimpleFSDP's recipe): the compiled backward gathers the layer again instead of
    keeping the gathered copy, and its gradients leave in one reduce-scatter per dtype, the
    collectives of the eager call. What the backward keeps: as eager, the sharded parameters and
    no gathered copy; the layer's activations are kept or recomputed as torch.compile's
    partitioner decides (eager keeps them). When each gather runs and its result is freed is the
    compiled graph's order (inductor may reorder it): the eager prefetch is not reproduced.
    Uneven blocks are refused under compile (as every shard_map input with uneven blocks).

    Under torch.func transforms (``vmap``, ``jvp``, ``grad``, ``jacrev``, ...) each split leaf is
    gathered by its own all-gather when its layer is reached (no prefetch; the gathered copies
    are kept for the backward): the transforms do not compose with the saved-tensor hooks.

    Examples:
        >>> @fs.shard_map(mesh=mesh, in_specs=(specs, "(dp b) d"), out_specs="")
        ... def loss_fn(params, x):   # specs["blocks"]: one {"w": "(dp d) f", "b": "(dp f)"} per layer
        ...     def layer(p, h):      # p: one layer, gathered
        ...         return torch.tanh(h @ p["w"] + p["b"])
        ...     h = fs.fsdp_scan(layer, params["blocks"], x, "dp", dims=specs["blocks"])
        ...     return fs.pmean(h.pow(2).mean(), "dp")
    """
    tr = _vma.current("fsdp_scan")
    g = tr.mesh.axis_group(axis, "fsdp_scan")
    items, stacked = _layer_list(layers)
    if not items:
        return h
    per_layer = _resolve_dims(dims, layers, items, stacked, g, tr.mesh.axis_names)
    if g.size == 1 or all(d is None for ds in per_layer for d in ds):  # nothing to gather
        for layer in items:
            h = layer_fn(layer(), h)
        return h
    bits = tr.mesh.bits(g.names)
    # uneven blocks (torch.chunk's cut) travel padded to the longest and are cut back
    lens = _block_lengths(items, per_layer, stacked, g) if tr.uneven else [[None] * len(d) for d in per_layer]
    if _functorch_active():
        # under torch.func transforms (vmap, jvp, grad, jacrev, ...): each leaf gathered when its layer
        # is reached, by the all-gather whose batching and forward-mode rules the collectives have
        # (no prefetch, no placeholders: saved tensor hooks do not compose with the transforms)
        for get, ldims, llens in zip(items, per_layer, lens):
            h = layer_fn(_gathered_plain(get(), ldims, llens, g, tr, bits), h)
        return h
    if _compile.compiling():
        return _scan_compiled(layer_fn, items, per_layer, lens, g, tr, bits, h)
    states: list[_Layer] = []
    for get, ldims, llens in zip(items, per_layer, lens):
        states.append(_Layer(get, ldims, llens, g, tr, bits, states[-1] if states else None, prefetch))
    pending: list | None = states[0].start()
    for i, st in enumerate(states):
        gathered = st.finish(pending or [])
        # prefetch: the next layer's gather is in flight while this layer computes
        pending = states[i + 1].start() if prefetch and i + 1 < len(states) else None
        h = st.run(layer_fn, gathered, h)
        del gathered
        if pending is None and i + 1 < len(states):
            pending = states[i + 1].start()
    return h


# -- the layers ---------------------------------------------------------------------------


def _layer_list(layers):
    """``(getters, stacked)``: one function per layer returning its pytree (inside the trace)."""
    if isinstance(layers, (list, tuple)):
        return [lambda x=x: x for x in layers], False
    leaves, treedef = optree.tree_flatten(layers, none_is_leaf=True)
    accessors = optree.tree_flatten_with_accessor(layers, none_is_leaf=True)[0]
    sizes = []
    for x, acc in zip(leaves, accessors):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            what = f"a {tuple(x.shape)} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ArgumentError(
                f"fs.fsdp_scan: layers is one pytree, so each leaf stacks the layers along dim 0, "
                f"but {acc.codify('layers')} is {what}; pass a tensor with a leading layer dim, "
                f"or a list of per-layer pytrees"
            )
        sizes.append((acc.codify("layers"), x.shape[0]))
    if len({n for _, n in sizes}) > 1:
        listed = ", ".join(f"{p}: {n}" for p, n in sizes)
        raise ArgumentError(
            f"fs.fsdp_scan: the leaves of stacked layers must have the same leading (layer) dim, "
            f"got {listed}; stack every leaf with one entry per layer"
        )
    n = sizes[0][1] if sizes else 0
    return [lambda i=i: treedef.unflatten([x[i] for x in leaves]) for i in range(n)], True


def _resolve_dims(dims, layers, items, stacked: bool, g: AxisGroup, mesh_axes) -> list[list]:
    """For each layer, the gather dim of each leaf (flattened with None as a leaf), or None."""
    if stacked:
        target = layers
        try:
            one_flat = optree.broadcast_prefix(dims, target, none_is_leaf=True)
        except ValueError:
            raise _dims_mismatch(dims, target, "layers") from None
        one = items[0]()  # the shape of one layer's leaves
        leaves = optree.tree_leaves(one, none_is_leaf=True)
        paths = [a.codify("layers") for a in optree.tree_flatten_with_accessor(one, none_is_leaf=True)[0]]
        got = [_dim_of(d, x, p, g, mesh_axes, stacked=True) for d, x, p in zip(one_flat, leaves, paths)]
        return [got] * len(items)
    flat: list | None
    try:  # a prefix of the whole list (one entry per layer) ...
        flat = optree.broadcast_prefix(dims, list(layers), none_is_leaf=True)  # type: ignore[arg-type]
    except ValueError:  # ... or of one layer
        flat = None
    out = []
    start = 0
    for i, get in enumerate(items):
        one = get()
        leaves, _ = optree.tree_flatten(one, none_is_leaf=True)
        acc = optree.tree_flatten_with_accessor(one, none_is_leaf=True)[0]
        paths = [a.codify(f"layers[{i}]") for a in acc]
        if flat is not None:
            mine = flat[start : start + len(leaves)]
            start += len(leaves)
        else:
            try:
                mine = optree.broadcast_prefix(dims, one, none_is_leaf=True)
            except ValueError:
                raise _dims_mismatch(dims, one, f"layers[{i}]") from None
        out.append([_dim_of(d, x, p, g, mesh_axes, stacked=False) for d, x, p in zip(mine, leaves, paths)])
    return out


def _dims_mismatch(dims, target, what: str) -> ArgumentError:
    paths = [a.codify(what) for a in optree.tree_flatten_with_accessor(target, none_is_leaf=True)[0]]
    shown = ", ".join(paths[:6]) + (", ..." if len(paths) > 6 else "")
    return ArgumentError(
        f"fs.fsdp_scan: dims={dims!r} is not a prefix of the structure of {what} (leaves {shown}); "
        f"give an int, or a pytree shaped like one layer (or like layers) of ints, None or spec strings"
    )


def _dim_of(d, x, path: str, g: AxisGroup, mesh_axes, stacked: bool):
    """The gather dim of leaf ``x`` (one layer's) from its ``dims`` entry ``d``."""
    if not isinstance(x, torch.Tensor):
        return None
    if d is None:
        return None
    if isinstance(d, str):
        return _dim_from_spec(d, x, path, g, mesh_axes, stacked)
    if not isinstance(d, int) or isinstance(d, bool) or not -x.dim() <= d < x.dim():
        raise ArgumentError(
            f"fs.fsdp_scan: dims gives {d!r} for {path} of shape {tuple(x.shape)}; give a dim "
            f"in [-{x.dim()}, {x.dim()}), None (not split) or the leaf's spec string"
        )
    return d % x.dim()


def _dim_from_spec(spec: str, x, path: str, g: AxisGroup, mesh_axes, stacked: bool):
    parsed = parse_spec(spec)
    axes = g.names
    hits = []
    for i, dim in enumerate(parsed.dims):
        split = [n for n in dim.names if n in mesh_axes]
        if any(a in split for a in axes):
            hits.append((i, dim, split))
    if not hits:
        return None  # not split over the axis: used as is
    where = f"fs.fsdp_scan: {path} is stored with spec {spec!r}"
    axis_txt = axes[0] if len(axes) == 1 else "(" + " ".join(axes) + ")"
    if len(hits) > 1:
        raise ArgumentError(f"{where}, which splits {len(hits)} dims over {axis_txt}; split one dim over it")
    i, dim, split = hits[0]
    if tuple(split[-len(axes) :]) != axes:
        fixed = " ".join([n for n in split if n not in axes] + list(axes) + [dim.names[-1]])
        raise ArgumentError(
            f"{where}: {axis_txt} must be the innermost mesh axis of dim {str(dim)!r} (after "
            f"{', '.join(n for n in split if n not in axes)}) so that gathering it gives a "
            f"contiguous block; store it as '({fixed})'"
        )
    ellipsis = [k for k, dd in enumerate(parsed.dims) if dd.ellipsis]
    if ellipsis and ellipsis[0] < i:
        i = i - len(parsed.dims)  # counted from the end
    if stacked:
        if i == 0:
            raise ArgumentError(
                f"{where}, whose first dim (the layer dim of stacked layers) is split over "
                f"{axis_txt}; split another dim, e.g. '{' '.join([dim.names[-1], *map(str, parsed.dims[1:])])}'"
            )
        if i > 0:
            i -= 1
    return i % x.dim()


def _block_lengths(items, per_layer, stacked: bool, g: AxisGroup) -> list[list]:
    """In a call with uneven blocks: for each layer, each split leaf's block length along its
    gather dim at every index of the axis, or None where they agree (one small all-gather of
    the shapes, for the whole scan). Blocks that differ elsewhere raise on every rank alike."""
    layers = items[:1] if stacked else items  # stacked layers share their shapes
    xs, where = [], []
    for i, get in enumerate(layers):
        one = get()
        leaves = optree.tree_leaves(one, none_is_leaf=True)
        acc = optree.tree_flatten_with_accessor(one, none_is_leaf=True)[0]
        for j, d in enumerate(per_layer[i]):
            if d is not None:
                xs.append(leaves[j])
                where.append((i, j, d, acc[j].codify("layers" if stacked else f"layers[{i}]")))
    out: list[list] = [[None] * len(ds) for ds in per_layer]
    if not xs:
        return out
    shapes = _comm.gather_shapes(
        xs, g, None, "fs.fsdp_scan", [w[3] for w in where], ArgumentError
    )  # [index][k]
    for k, (i, j, d, path) in enumerate(where):
        got = [s[k] for s in shapes]
        rest = [s[:d] + s[d + 1 :] for s in got]
        if any(len(s) != len(got[0]) or r != rest[0] for s, r in zip(got, rest)):
            held = "; ".join(f"index {r}: {s}" for r, s in enumerate(got))
            ax = " ".join(g.names)
            raise ArgumentError(
                f"fs.fsdp_scan: {path} has blocks of different shapes on the ranks of {ax} ({held}) beyond its "
                f"split dim {d}, so they are not the blocks of one parameter gathered along dim {d}; store it "
                f"split along that one dim over {ax} (as fs.shard cuts it), or give its dims entry as None"
            )
        lengths = tuple(s[d] for s in got)
        if len(set(lengths)) > 1:
            out[i][j] = lengths
    return [out[0]] * len(items) if stacked else out


def _padded(x: torch.Tensor, dim: int, lens) -> torch.Tensor:
    """``x`` zero-padded along ``dim`` to the longest block (as it travels in the all-gather)."""
    if lens is None or x.shape[dim] == max(lens):
        return x
    shape = list(x.shape)
    shape[dim] = max(lens)
    out = x.new_zeros(shape)
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


def _gathered_leaves(blocks: torch.Tensor, xs, dims, lens) -> list:
    """The gathered ``[N, total]`` rows of a layer's packed (padded) leaves, each concatenated
    along its dim, the padding of uneven blocks cut off."""
    shapes = []
    for x, d, ln in zip(xs, dims, lens):
        shape = list(x.shape)
        if ln is not None:
            shape[d] = max(ln)
        shapes.append(shape)
    ys = unpack_gathered(blocks, shapes, dims, True)
    for k, (y, d, ln) in enumerate(zip(ys, dims, lens)):
        if ln is not None:
            ys[k] = torch.cat([p.narrow(d, 0, n) for p, n in zip(y.split(max(ln), d), ln)], d)
    return ys


def _spread(ct: torch.Tensor, g: AxisGroup, dim: int, lens) -> torch.Tensor:
    """A gathered leaf's cotangent with each index's block padded to the longest (the even layout
    the reduce-scatter cuts)."""
    if lens is None:
        return ct
    blocks = split_blocks(ct, g.size, dim, lens)  # [N, *padded block]
    shape = list(blocks.shape[1:])
    shape[dim] *= g.size
    return blocks.movedim(0, dim).reshape(shape)


def _gathered_plain(tree, dims, lens, g: AxisGroup, tr, bits: int):
    """One layer's pytree with its split leaves gathered one by one (`fsdp_scan` under torch.func)."""
    leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True)
    for j, (d, ln) in enumerate(zip(dims, lens)):
        if d is not None:
            x = _vary(leaves[j], tr, _vma.get(leaves[j], tr), bits)
            y = apply(AllGather, x, g, d, True if ln is None else tuple(ln))
            _vma.tag(y, tr, _vma.get(x, tr) | bits)
            y._fshard_gathered = g.names
            leaves[j] = y
    return treedef.unflatten(leaves)


def _scan_compiled(layer_fn, items, per_layer, lens, g: AxisGroup, tr, bits: int, h):
    """`fsdp_scan` under torch.compile: each layer's gather (one all-gather per dtype) is a
    checkpointed region whose every op must be recomputed, so the compiled backward gathers the
    layer again instead of keeping the gathered copy (SimpleFSDP's recipe); the rest of the layer
    is compiled as written, its activations kept or recomputed as torch.compile decides."""
    for get, ldims, llens in zip(items, per_layer, lens):
        if any(ln is not None for ln in llens):  # shard_map refuses uneven inputs under compile
            raise AssertionError("fs.fsdp_scan: uneven blocks reached a compiled scan")
        leaves, treedef = optree.tree_flatten(get(), none_is_leaf=True)
        idx = [j for j, d in enumerate(ldims) if d is not None]
        vs = [_vma.get(leaves[j], tr) for j in idx]
        xs = [_vary(leaves[j], tr, v, bits) for j, v in zip(idx, vs)]
        groups = list(_by_dtype(xs, range(len(xs))).values())
        dims = [tuple(ldims[idx[k]] for k in grp) for grp in groups]
        with untracked():  # the region untracked (the outputs are tagged below)
            ys = torch.utils.checkpoint.checkpoint(
                _gather_groups, g, groups, dims, *xs, use_reentrant=False, context_fn=_recompute_gathers
            )
        for j, k, v in zip(idx, range(len(xs)), vs):
            y = ys[k]
            _vma.tag(y, tr, v | bits)
            y._fshard_gathered = g.names
            leaves[j] = y
        h = layer_fn(treedef.unflatten(leaves), h)
    return h


def _gather_groups(g: AxisGroup, groups, dims, *xs):
    out: list = [None] * len(xs)
    for grp, gdims in zip(groups, dims):
        ys = apply(AllGatherCoalesced, g, gdims, True, False, *[xs[k] for k in grp])
        for k, y in zip(grp, ys):
            out[k] = y
    return tuple(out)


def _must_recompute(ctx, op, *args, **kwargs):
    return torch.utils.checkpoint.CheckpointPolicy.MUST_RECOMPUTE


def _recompute_gathers():
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(_must_recompute)


class _Layer:
    """One layer's gather: its split leaves, their dims and the state of its gathers."""

    def __init__(self, get, dims, lens, g: AxisGroup, tr, bits: int, prev, prefetch: bool):
        self.get, self.dims, self.g, self.tr, self.bits = get, dims, g, tr, bits
        self.all_lens = lens  # per leaf: block lengths at each index (uneven), or None
        self.lens: list = []  # of them, those of the split leaves
        self.prev = prev  # the layer before: its gather starts while this one's backward runs
        self.prefetch = prefetch
        self.tree: tuple | None = None  # (leaves, treedef) between start and run
        self.xs: list = []  # the split leaves (made varying over the axis)
        self.idx: list[int] = []  # their positions among the layer's leaves
        self.groups: list[list[int]] = []  # positions in xs, one list per dtype
        self.saved = 0  # placeholders left in the graph for saved gathered tensors
        self.left = 0  # of them, not yet unpacked in this backward
        self.cache: list | None = None  # the leaves gathered again in the backward
        self.bwd: list | None = None  # handles of the backward gather, when prefetched

    def start(self) -> list:
        """Start this layer's all-gathers (one per dtype); returns their handles."""
        tree = self.get()
        leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True)
        self.tree = (leaves, treedef)
        tr, bits = self.tr, self.bits
        self.idx = [j for j, d in enumerate(self.dims) if d is not None]
        self.lens = [self.all_lens[j] for j in self.idx]
        self.xs = [_vary(leaves[j], tr, _vma.get(leaves[j], tr), bits) for j in self.idx]
        self.groups = list(_by_dtype(self.xs, range(len(self.xs))).values())
        return self._start_all()

    def _start_all(self) -> list:
        with untracked(), torch.no_grad():
            return [
                _comm.all_gather_start(
                    _pack([_padded(self.xs[k], self.dims[self.idx[k]], self.lens[k]) for k in grp]), self.g
                )
                for grp in self.groups
            ]

    def finish(self, handles) -> list:
        """The gathered leaves (differentiable: their gradient is one reduce-scatter per dtype)."""
        out: list = [None] * len(self.xs)
        tr, bits = self.tr, self.bits
        for grp, handle in zip(self.groups, handles):
            dims = tuple(self.dims[self.idx[k]] for k in grp)
            lens = tuple(self.lens[k] for k in grp)
            ys = apply(_Gathered, self.g, dims, lens, handle, *[self.xs[k] for k in grp])
            for k, y in zip(grp, ys):
                _vma.tag(y, tr, _vma.get(self.xs[k], tr) | bits)
                y._fshard_gathered = self.g.names
                out[k] = y
        return out

    def run(self, layer_fn, gathered: list, h):
        assert self.tree is not None  # set by start
        leaves, treedef = self.tree
        full = list(leaves)
        for j, y in zip(self.idx, gathered):
            full[j] = y
        tree = treedef.unflatten(full)
        del full
        if not torch.is_grad_enabled():
            return layer_fn(tree, h)
        ptrs: dict = {}  # storage of a gathered leaf -> (its index, offset, dtype)
        with untracked():
            for k, y in enumerate(gathered):
                st = y.untyped_storage()
                if st.nbytes():
                    ptrs.setdefault(st.data_ptr(), (k, y.storage_offset(), y.dtype))
        del gathered

        def pack(t):
            try:
                with untracked():
                    st = t.untyped_storage()
                    hit = ptrs.get(st.data_ptr()) if st.nbytes() else None
                    if hit is None or t.dtype != hit[2] or t.is_conj() or t.is_neg():
                        return t
                    saved = _Saved(self, hit[0], t.size(), t.stride(), t.storage_offset() - hit[1])
            except (RuntimeError, NotImplementedError):  # no storage (functorch wrappers, ...)
                return t
            self.saved += 1
            return saved

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            out = layer_fn(tree, h)
        self.tree = None
        cache = self.tr.pvary_cache  # a cached pvary of a gathered leaf would keep it alive
        if cache and ptrs:
            for key in [key for key, (x, _) in cache.items() if _storage_ptr(x) in ptrs]:
                del cache[key]
        return out

    def regathered(self) -> list:
        """The gathered leaves in the backward (gathered again on first use; freed after the last)."""
        if self.cache is None:
            handles = self.bwd if self.bwd is not None else self._start_all()
            self.bwd = None
            self.cache = self._pieces(handles)
            self.left = self.saved
            prev = self.prev
            if self.prefetch and prev is not None and prev.saved and prev.cache is None and prev.bwd is None:
                prev.bwd = prev._start_all()
        got = self.cache
        self.left -= 1
        if self.left <= 0:
            self.cache = None
        return got

    def _pieces(self, handles) -> list:
        out: list = [None] * len(self.xs)
        with untracked(), torch.no_grad():
            for grp, handle in zip(self.groups, handles):
                xs = [self.xs[k] for k in grp]
                dims = [self.dims[self.idx[k]] for k in grp]
                lens = [self.lens[k] for k in grp]
                for k, y in zip(grp, _gathered_leaves(handle.wait(), xs, dims, lens)):
                    out[k] = y
        return out


def _storage_ptr(t) -> int | None:
    try:
        with untracked():
            st = t.untyped_storage()
            return st.data_ptr() if st.nbytes() else None
    except (RuntimeError, NotImplementedError):
        return None


class _Saved:
    """A placeholder in the autograd graph for a saved (view of a) gathered parameter."""

    __slots__ = ("layer", "k", "size", "stride", "offset")

    def __init__(self, layer: _Layer, k: int, size, stride, offset: int):
        self.layer, self.k, self.size, self.stride, self.offset = layer, k, size, stride, offset


def _unpack(saved):
    if not isinstance(saved, _Saved):
        return saved
    y = saved.layer.regathered()[saved.k]
    with untracked():
        return y.as_strided(saved.size, saved.stride, y.storage_offset() + saved.offset)


class _Gathered(torch.autograd.Function):
    """The end of a layer's all-gather (packed leaves of one dtype); the transpose is one
    reduce-scatter of their gradients."""

    @staticmethod
    @_untracked
    def forward(g, dims, lens, handle, *xs):
        return tuple(_gathered_leaves(handle.wait(), xs, dims, lens))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[:3]

    @staticmethod
    @_untracked
    def backward(ctx, *cts):
        g, dims, lens = ctx.args
        padded = [_spread(ct, g, d, ln) for ct, d, ln in zip(cts, dims, lens)]
        grads = apply(ReduceScatterCoalesced, g, dims, True, *padded)
        mine = tuple(y if ln is None else y.narrow(d, 0, ln[g.index]) for y, d, ln in zip(grads, dims, lens))
        return (None, None, None, None, *mine)
