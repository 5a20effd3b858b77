"""Global values that live split across ranks: `Sharded`, `shard`, DTensor interop, and
results on one rank (`Sharded.full` with ``dst``, `full` over pytrees, `reduce_to`)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import overload

import optree
import torch
import torch.distributed as dist

from . import _comm, _vma
from ._errors import ArgumentError, CollectiveError, MeshError, SpecError
from ._layout import Layout, bind_or_raise, chunk_sizes
from ._mesh import Mesh
from ._primitives import AllGatherInvariant, AllToAll, LocalSlice, _functorch_active
from ._primitives import apply as _apply
from ._spec import Spec

__all__ = ["Sharded", "shard", "from_dtensor", "full", "reduce_to"]


class Sharded:
    """A global tensor stored as one block per rank: the local block, the mesh and the layout.

    ``shape`` and ``dtype`` describe the global value; ``local`` is this rank's block.
    Build one with `shard` or get one from a ``shard_map`` output whose spec splits
    a dimension. Sharded values are optree leaves.

    Examples:
        >>> w = fs.shard(torch.randn(8, 4), mesh, "(tp n) k")
        >>> w.shape, w.local.shape         # on a mesh with tp=2
        (torch.Size([8, 4]), torch.Size([4, 4]))
        >>> torch.equal(w.full(), full_w)
        True
    """

    __slots__ = ("local", "mesh", "layout", "_shape", "__weakref__")

    def __init__(self, local: torch.Tensor, mesh: Mesh, spec, *, shape=None, check: bool = True):
        if not isinstance(local, torch.Tensor):
            raise ArgumentError(f"fs.Sharded needs a torch.Tensor local block, got {type(local).__name__}")
        if not isinstance(mesh, Mesh):
            raise ArgumentError(f"fs.Sharded needs an fs.Mesh, got {type(mesh).__name__}")
        self.local = local
        self.mesh = mesh
        self._shape = None
        # The spec is checked first, with no communication (a bad spec fails on every rank alike).
        self.layout = (
            spec
            if isinstance(spec, Layout)
            else bind_or_raise(spec, mesh, local.shape, "fs.Sharded", local=True)
        )
        if shape is not None:  # the global shape is given: check this rank's block against it
            self._shape = _check_shape(local, mesh, self.layout, shape, spec)
        elif check and mesh.size > 1:
            self._shape = _global_shape_of_blocks(local, mesh, self.layout)

    @classmethod
    def from_local(cls, local: torch.Tensor, mesh: Mesh, spec, *, shape=None) -> Sharded:
        """A Sharded value from the block each rank loaded itself (per-rank data loading).

        Each rank passes its own block: for a batch split over ``dp``, the rows its
        ``DistributedSampler`` (or any per-rank loader) gave it. ``spec`` describes the global
        value, so a block of shape ``(32, 128)`` with spec ``"(dp b) d"`` on ``dp=4`` is the
        block of a ``(128, 128)`` global value, block ``i`` held by the rank at ``dp`` index
        ``i``. Nothing is copied or sent but one small all-gather that checks that every rank's
        block fits (blocks that do not tile a global value raise here, on every rank, instead
        of failing later in a collective).

        Blocks may be uneven when they are the pieces torch.chunk cuts (10 rows over 4 ranks:
        3, 3, 3 and 1; a rank may hold 0 rows): the global shape is then found from the
        gathered block shapes. With ``shape=`` (the global shape, as for DTensor's
        ``from_local``) nothing is sent: each rank checks its own block against ``shape``.

        Args:
            local: this rank's block.
            mesh: the mesh.
            spec: the layout of the global value, e.g. ``"(dp b) d"``.
            shape: the global shape, if known (no communication then).

        Raises:
            SpecError: when the blocks are not the blocks of one global value, or the spec does
                not fit.

        Examples:
            >>> sampler = DistributedSampler(dataset, num_replicas=mesh.axis_size("dp"),
            ...                              rank=mesh.axis_index("dp"), drop_last=True)
            >>> for xb, yb in DataLoader(dataset, batch_size=32, sampler=sampler, drop_last=True):
            ...     x = fs.Sharded.from_local(xb, mesh, "(dp b) d")   # global batch: 32 * dp rows
            ...     y = fs.Sharded.from_local(yb, mesh, "(dp b)")
            ...     loss = step(params, x, y)
            >>> part = torch.chunk(rows, 4)[rank]                 # 10 rows: 3, 3, 3, 1
            >>> x = fs.Sharded.from_local(part, mesh, "(dp b) d", shape=(10, 64))
        """
        return cls(local, mesh, spec, shape=shape, check=True)

    @classmethod
    def _wrap(cls, local: torch.Tensor, mesh: Mesh, layout: Layout, shape=None) -> Sharded:
        """A Sharded value from a block fshard itself computed (no checks, no communication).
        ``shape``: the global shape, needed when the blocks may be uneven."""
        self = cls.__new__(cls)
        self.local, self.mesh, self.layout, self._shape = local, mesh, layout, shape
        return self

    def _like(self, local: torch.Tensor) -> Sharded:
        """A Sharded value with this one's mesh, layout and global shape, holding ``local``."""
        return Sharded._wrap(local, self.mesh, self.layout, self._shape)

    # -- global description -----------------------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        """The global shape."""
        if (s := self._shape) is None:  # an even split: every block has the same shape
            # (not stored in _shape: a compiled call's plan guards on ``_shape is None``, and an eager
            # call that stored it would make the next compiled call recompile)
            s = torch.Size(self.layout.global_shape(self.local.shape, self.mesh.shape))
        return s

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def ndim(self) -> int:
        return self.local.dim()

    def dim(self) -> int:
        return self.local.dim()

    @property
    def spec(self) -> str:
        """The layout as spec text, e.g. ``"(dp b) d"``."""
        return self.layout.spec_text()

    @property
    def requires_grad(self) -> bool:
        return self.local.requires_grad

    def requires_grad_(self, flag: bool = True) -> Sharded:
        self.local.requires_grad_(flag)
        return self

    @property
    def grad(self) -> Sharded | None:
        """The gradient of the local block, as a Sharded value with the same layout."""
        g = self.local.grad
        return None if g is None else self._like(g)

    def detach(self) -> Sharded:
        return self._like(self.local.detach())

    def __repr__(self) -> str:
        return (
            f"Sharded(shape={tuple(self.shape)}, dtype={self.dtype}, spec={self.spec!r}, "
            f"mesh={self.mesh!r}, local_shape={tuple(self.local.shape)})"
        )

    # -- moving data ------------------------------------------------------------------------

    @overload
    def full(self) -> torch.Tensor: ...
    @overload
    def full(self, dst: int | None) -> torch.Tensor | None: ...

    def full(self, dst: int | None = None) -> torch.Tensor | None:
        """The global value as a plain tensor: on every rank, or only on rank ``dst``.

        Without ``dst``, every rank gets it (one all-gather per split dim); differentiable:
        the gradient of the result flows back to this rank's block. With ``dst=r`` (a global
        rank), only rank ``r`` gets it and every other rank gets None: one ``dist.gather`` of
        the blocks to ``r``, over the axes that split the value (ranks holding copies of
        ``r``'s blocks send nothing). Not differentiable (a detached result): for logging,
        evaluation and saving. Every rank of the mesh must call it, as for any collective.

        Args:
            dst: the global rank that receives the value, or None for every rank.

        Raises:
            ArgumentError: when ``dst`` is not a rank of the mesh.

        Examples:
            >>> w = fs.shard(torch.arange(8.0), mesh, "(dp n)")
            >>> full_w = w.full(dst=0)        # the tensor on rank 0, None on the others
        """
        if dst is not None:
            _refuse_transform(
                f"Sharded.full(dst={dst})",
                f"the gather to rank {dst} is not differentiable and has no batching rule; call .full() inside "
                f"the transform (every rank gets the value), and .full(dst={dst}) on the transform's result",
            )
            return _gather_to(self, _check_dst(self.mesh, dst, "Sharded.full"))
        x, shape, mesh = self.local, self.shape, self.mesh
        for d, axes in enumerate(self.layout.dims):
            if axes:
                sizes = self.layout.block_sizes(d, shape[d], mesh.shape)
                x = _apply(AllGatherInvariant, x, mesh.axis_group(axes), d, _tiling(sizes))
        return x

    def reshard(self, spec) -> Sharded:
        """The same global value in another layout, moved with the fewest collectives.

        A split that disappears is all-gathered, a new split is a local slice (no
        communication), and a split that moves from one dim to another is one all_to_all
        (when both dims split evenly; uneven blocks are gathered and sliced).

        Examples:
            >>> x = fs.shard(t, mesh, "(sp s) h d")
            >>> y = x.reshard("s (sp h) d")     # one all_to_all over sp
        """
        shape = self.shape
        target = bind_or_raise(spec, self.mesh, shape, "Sharded.reshard")
        local = relayout(self.local, self.mesh, self.layout, target, shape)
        return Sharded._wrap(local, self.mesh, target, shape)

    def to_dtensor(self):
        """This value as a PyTorch ``DTensor`` on ``mesh.device_mesh`` (no communication).

        Raises:
            SpecError: when a dim is split over several axes in an order other than the mesh's,
                which DTensor placements cannot express.
        """
        from torch.distributed.tensor import DTensor, Replicate, Shard

        names = self.mesh.axis_names
        placements = [Replicate() for _ in names]
        for d, axes in enumerate(self.layout.dims):
            idx = [names.index(a) for a in axes]
            if idx != sorted(idx):
                raise SpecError(
                    f"Sharded.to_dtensor: dim {d} is split over {axes}, not in mesh order {names}; "
                    f"reshard to ({' '.join(sorted(axes, key=names.index))} ...) first"
                )
            for i in idx:
                placements[i] = Shard(d)
        shape = self.shape
        stride = torch.empty(0).new_empty(shape, device="meta").stride() if shape else ()
        return DTensor.from_local(
            self.local, self.mesh.device_mesh, placements, run_check=False, shape=shape, stride=stride
        )


def _tiling(sizes: tuple[int, ...]):
    """The ``tiled`` argument of the gather/slice primitives for blocks of ``sizes``: True when
    they are equal, else the sizes themselves (uneven blocks, exchanged padded)."""
    return True if all(n == sizes[0] for n in sizes) else sizes


def _check_shape(local: torch.Tensor, mesh: Mesh, layout: Layout, shape, spec) -> torch.Size:
    """``shape`` as the global shape of which ``local`` is this rank's block, or a SpecError."""
    shape = torch.Size(shape)
    want = layout.local_shape(shape, mesh.shape, mesh.coordinate) if len(shape) == local.dim() else None
    if want is None or tuple(local.shape) != want:
        coord = " ".join(f"{a}={i}" for a, i in mesh.coordinate.items())
        raise SpecError(
            f"fs.Sharded: the local block of shape {tuple(local.shape)} is not the block of global shape "
            f"{tuple(shape)} that spec {str(spec)!r} gives the rank at {coord} on {mesh!r}"
            + (
                f" ({want}, as torch.chunk cuts it)"
                if want is not None
                else f" (the spec has {local.dim()} dims)"
            )
            + "; pass the global shape of the whole value, or cut the blocks with torch.chunk"
        )
    return shape


def _global_shape_of_blocks(local: torch.Tensor, mesh: Mesh, layout: Layout, who=None) -> torch.Size | None:
    """The global shape of which every rank's ``local`` is a block: None when the blocks are
    equal (an even split), else found from the gathered shapes; a SpecError (on every rank
    alike) when the blocks are not torch.chunk's blocks of one global value; an ArgumentError
    naming ``who`` (or from_local) for blocks of different dtypes. One small all-gather
    (`_comm.gather_shapes`)."""
    g = mesh.axis_group(mesh.axis_names, "Sharded")
    where, paths = who or ("fs.Sharded.from_local", None)  # paths: None or [the value's key path]
    shapes = [s[0] for s in _comm.gather_shapes([local], g, mesh.device, where, paths, ArgumentError)]
    if all(sh == shapes[0] for sh in shapes):
        return None
    coords = [_coord_of(mesh, r) for r in mesh.ranks]
    shape: list[int] | None = None
    if all(len(sh) == local.dim() for sh in shapes) and local.dim() <= 8:
        shape = []
        for d, axes in enumerate(layout.dims):
            if not axes:
                shape.append(shapes[0][d])
                continue
            per_index: dict[int, int] = {}
            for c, sh in zip(coords, shapes):
                per_index.setdefault(layout.block_index(d, mesh.shape, c), sh[d])
            shape.append(sum(per_index.values()))
        if all(layout.local_shape(shape, mesh.shape, c) == sh for c, sh in zip(coords, shapes)):
            return torch.Size(shape)
    by: dict = {}
    for rank, sh in zip(mesh.ranks, shapes):
        by.setdefault(sh, []).append(rank)
    held = "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {sh}" for sh, r in by.items()
    )
    cut = (
        f"; as torch.chunk cuts a global shape {tuple(shape)}, they would be "
        + "; ".join(
            f"rank {r}: {layout.local_shape(shape, mesh.shape, c)}" for r, c in zip(mesh.ranks, coords)
        )
        if shape is not None
        else ""
    )
    raise SpecError(
        f"fs.Sharded: the local blocks for spec {layout.spec_text()!r} on {mesh!r} are not the blocks of one "
        f"global value ({held}){cut}; cut the blocks with torch.chunk (uneven blocks are fine: the first "
        f"ones are the longer), drop or pad the uneven last batch (e.g. DataLoader(drop_last=True)), or "
        f"gather it whole and use fs.shard(x, mesh, spec, src=0)"
    )


def _check_dst(mesh: Mesh, dst, where: str) -> int:
    """``dst`` as a global rank of ``mesh``, or an ArgumentError naming the ranks."""
    ranks = mesh.ranks
    if isinstance(dst, int) and not isinstance(dst, bool) and dst in ranks:
        return dst
    contiguous = list(ranks) == list(range(ranks[0], ranks[0] + len(ranks)))
    which = f"in [{ranks[0]}, {ranks[0] + len(ranks)})" if contiguous else f"in {list(ranks)}"
    raise ArgumentError(f"{where}: dst={dst!r} must be a global rank of {mesh!r}, {which}")


def _dst_group(mesh: Mesh, axes: tuple[str, ...], dst: int):
    """The group over ``axes`` (mesh order, size > 1) that holds rank ``dst``, for a result on ``dst``.

    Returns ``(group, index of dst along it, dst's coordinate)``, with group None when this rank
    is not in it (it holds the same position as dst on other axes only if it is). Touches the
    group on every rank first: a group made on first use is made by every rank of the world.
    """
    g = mesh.axis_group(axes) if axes else None
    if g is not None and g.size > 1:
        g.group  # noqa: B018  (collective when the group is made on first use)
    coord, mine = _coord_of(mesh, dst), mesh.coordinate
    if any(mine[a] != coord[a] for a in mesh.axis_names if a not in axes):
        return None, 0, coord
    index = 0
    for a in axes:
        index = index * mesh.shape[a] + coord[a]
    return g, index, coord


def _gather_to(x: Sharded, dst: int) -> torch.Tensor | None:
    """``x.full(dst=dst)``: one gather over the axes that split ``x``, to ``dst``."""
    mesh, layout = x.mesh, x.layout
    axes = tuple(a for a in mesh.axis_names if a in layout.split_axes and mesh.shape[a] > 1)
    local = x.local.detach()
    if not axes:
        return local.clone() if _my_rank(mesh) == dst else None
    g, index, coord = _dst_group(mesh, axes, dst)
    if g is None:
        return None
    shape = x.shape
    largest = layout.local_shape(shape, mesh.shape)  # uneven blocks travel padded to the largest
    blocks = _comm.gather_blocks(_pad_to(local, largest), g, index)  # [N, *block] on dst, row i from index i
    if blocks is None:
        return None
    out = torch.empty(shape, dtype=local.dtype, device=local.device)
    for i in range(g.size):
        c, rem = dict(coord), i
        for a in reversed(axes):
            c[a] = rem % mesh.shape[a]
            rem //= mesh.shape[a]
        dest = _block(out, layout, mesh, c)
        dest.copy_(blocks[i][tuple(slice(0, n) for n in dest.shape)])
    return out


def _pad_to(x: torch.Tensor, shape) -> torch.Tensor:
    """``x`` zero-padded at the end of each dim to ``shape`` (``x`` itself when it has it)."""
    if tuple(x.shape) == tuple(shape):
        return x
    out = x.new_zeros(shape)
    out[tuple(slice(0, n) for n in x.shape)] = x
    return out


def _my_rank(mesh: Mesh) -> int:
    coord = mesh.coordinate
    flat = 0
    for a in mesh.axis_names:
        flat = flat * mesh.shape[a] + coord[a]
    return mesh.ranks[flat]


def full(tree, dst: int | None = None):
    """Every `Sharded` leaf of a pytree as its global value; other leaves as they are.

    The pytree form of `Sharded.full`: without ``dst`` every rank gets the tree
    (differentiable); with ``dst=r``, rank ``r`` gets it and every other rank gets None (one
    gather per Sharded leaf, not differentiable).

    Args:
        tree: a pytree whose leaves may be `Sharded` values (or one Sharded value).
        dst: the global rank that receives the values, or None for every rank.

    Examples:
        >>> params = fs.shard(init_params, mesh, {"w": "(tp h) d", "b": "..."})
        >>> state = fs.full(params, dst=0)      # a dict of plain tensors on rank 0, None elsewhere
        >>> if state is not None:
        ...     torch.save(state, "params.pt")
    """
    leaves, treedef = optree.tree_flatten(tree)
    if dst is None:
        return optree.tree_unflatten(treedef, [x.full() if isinstance(x, Sharded) else x for x in leaves])
    _refuse_transform(
        f"fs.full(tree, dst={dst})",
        f"the gather to rank {dst} is not differentiable and has no batching rule; call fs.full(tree) inside "
        f"the transform (every rank gets the values), and fs.full(..., dst={dst}) on the transform's result",
    )
    meshes = [x.mesh for x in leaves if isinstance(x, Sharded)]
    if not meshes:  # nothing to gather
        return tree if (dist.get_rank() if dist.is_initialized() else 0) == dst else None
    _check_dst(meshes[0], dst, "fs.full")
    out = [x.full(dst) if isinstance(x, Sharded) else x for x in leaves]
    return optree.tree_unflatten(treedef, out) if _my_rank(meshes[0]) == dst else None


def _transform_name() -> str:
    """The innermost running torch.func transform, as the user wrote it."""
    from torch._C._functorch import TransformType as T
    from torch._C._functorch import peek_interpreter_stack

    names = {
        T.Vmap: "vmap",
        T.Jvp: "jvp (forward mode: jvp, jacfwd, hessian)",
        T.Grad: "grad (reverse mode: grad, vjp, jacrev)",
    }
    return "torch.func." + names.get(peek_interpreter_stack().key(), "transforms")


def _refuse_transform(where: str, why: str) -> None:
    """An `ArgumentError` for a transfer to or from one rank under a torch.func transform."""
    if _functorch_active():
        raise ArgumentError(f"{where} under {_transform_name()}: {why}")


def reduce_to(x, mesh: Mesh, dst: int = 0, *, axis=None):
    """Sum per-rank tensors onto one rank: the sum on rank ``dst``, None on every other rank.

    For values each rank computed on its own, outside `shard_map` (a loss, metric counts,
    statistics) that only one rank needs, e.g. for logging: one ``dist.reduce``, cheaper than
    an all-reduce. Inside `shard_map`, use `psum` (every rank gets the sum).

    With ``axis`` (a mesh axis name or a tuple of names), only the ranks that share ``dst``'s
    position on the other axes are summed (the ranks along ``axis`` through ``dst``); the other
    ranks send nothing. Without it, every rank of the mesh is summed.

    ``x`` may be a pytree of tensors (a dict of metrics, say): the leaves of one dtype are summed
    in one reduce. Every rank summed must pass the same structure, shapes and dtypes. The result
    is not differentiable.

    Args:
        x: a tensor, or a pytree of tensors.
        mesh: the mesh whose ranks hold the values.
        dst: the global rank that receives the sum.
        axis: the mesh axes to sum over (default: all of them).

    Raises:
        ArgumentError: when ``dst`` is not a rank of the mesh or ``x`` holds something other than tensors.
        CollectiveError: for an unknown axis, or when called inside `shard_map`.

    Examples:
        >>> total = fs.reduce_to({"loss": loss_sum, "n": n_tokens}, mesh, dst=0)
        >>> if total is not None:
        ...     print(total["loss"] / total["n"])
        >>> s = fs.reduce_to(local_count, mesh, dst=0, axis="dp")   # over dp only (tp holds copies)
    """
    if _vma.active() is not None:
        raise CollectiveError(
            "fs.reduce_to sums per-rank tensors outside fs.shard_map; inside it, use fs.psum(x, axis) "
            "(every rank gets the sum) and return the result"
        )
    _refuse_transform(
        "fs.reduce_to",
        "the sum onto one rank is not differentiable and has no batching rule; call it on the transform's "
        "result, or sum inside fs.shard_map with fs.psum",
    )
    leaves, treedef, _ = _tensor_tree(x, "fs.reduce_to")
    dst = _check_dst(mesh, dst, "fs.reduce_to")
    names = mesh.check_axes(axis, "reduce_to") if axis is not None else mesh.axis_names
    axes = tuple(a for a in mesh.axis_names if a in names and mesh.shape[a] > 1)
    g, index, _ = _dst_group(mesh, axes, dst)
    if g is None and axes:
        return None
    with torch.no_grad(), _comm.untracked():
        out: list = [None] * len(leaves)
        groups: dict = {}
        for i, t in enumerate(leaves):
            groups.setdefault((t.dtype, t.device), []).append(i)
        for idx in groups.values():
            buf = torch.cat([leaves[i].reshape(-1) for i in idx])
            if g is not None:
                _comm.reduce_(buf, g, index)
            for i, part in zip(idx, buf.split([leaves[i].numel() for i in idx])):
                out[i] = part.view(leaves[i].shape)
    if _my_rank(mesh) != dst:
        return None
    return optree.tree_unflatten(treedef, out)


def relayout(x: torch.Tensor, mesh: Mesh, a: Layout, b: Layout, shape) -> torch.Tensor:
    """Move local block ``x`` of a value of global ``shape`` from layout ``a`` to layout ``b``
    (differentiable)."""
    if a.dims == b.dims:
        return x
    remove: dict[int, tuple[int, tuple[str, ...]]] = {}  # dim -> (axes kept before, axes removed)
    add: dict[int, tuple[int, tuple[str, ...]]] = {}
    for d, (pa, pb) in enumerate(zip(a.dims, b.dims)):
        k = 0
        while k < min(len(pa), len(pb)) and pa[k] == pb[k]:
            k += 1
        if pa[k:]:
            remove[d] = (k, pa[k:])
        if pb[k:]:
            add[d] = (k, pb[k:])
    even = a.is_even(shape, mesh.shape) and b.is_even(shape, mesh.shape)
    # A split that moves from one dim to another (innermost on both): one all_to_all.
    if even and len(remove) == 1 and len(add) == 1:
        (i, (_, ra)), (j, (_, rb)) = next(iter(remove.items())), next(iter(add.items()))
        if i != j and ra == rb and len(ra) == 1:
            return _apply(AllToAll, x, mesh.axis_group(ra[0]), j, i)

    def tiling(d: int, k: int, axes: tuple[str, ...]):
        # the blocks of this rank's piece of dim d (cut by the k axes both layouts share) over axes
        if even:
            return True
        piece = shape[d]
        for ax in a.dims[d][:k]:
            piece = _piece(piece, mesh.shape[ax], mesh.coordinate[ax])
        return _tiling(chunk_sizes(piece, [mesh.shape[ax] for ax in axes]))

    for d, (k, axes) in remove.items():
        x = _apply(AllGatherInvariant, x, mesh.axis_group(axes), d, tiling(d, k, axes))
    for d, (k, axes) in add.items():
        x = _apply(LocalSlice, x, mesh.axis_group(axes), d, tiling(d, k, axes))
    return x


def _piece(size: int, n: int, i: int) -> int:
    """The length of piece ``i`` of ``size`` cut into ``n`` by torch.chunk."""
    return chunk_sizes(size, [n])[i]


def shard(x, mesh: Mesh, spec, *, src: int | None = None):
    """Split a global tensor, or a pytree of them, into `Sharded` values.

    Without ``src``, every rank passes the same global tensor and keeps its own block
    (a copy, so the global tensor can be freed; no communication). With ``src=r``, only
    rank ``r`` needs the tensor (others may pass None): it scatters the blocks.

    ``x`` may be a pytree of tensors (a dict of parameters, say); the result is the same tree
    of Sharded values. ``spec`` is then one spec for every leaf or a prefix tree of specs, as
    ``in_specs`` is for `shard_map`: one spec per leaf, or one for a whole subtree (None
    means ``"..."``: replicated). With ``src``, the other ranks learn the tree's structure,
    shapes and dtypes from rank ``r`` (one broadcast), then one scatter per leaf.

    Args:
        x: the global tensor, or a pytree of tensors.
        mesh: the mesh.
        spec: the layout, e.g. ``"(dp b) (tp d)"``, or a prefix tree of layouts.
        src: the global rank holding the data, or None.

    Raises:
        SpecError: for a spec that does not fit the tensor or the mesh, or a spec tree that
            does not match the structure of ``x``.

    Examples:
        >>> w = fs.shard(torch.randn(1024, 256), mesh, "(tp h) d")
        >>> w = fs.shard(data if rank == 0 else None, mesh, "(dp b) d", src=0)
        >>> params = fs.shard({"w1": w1, "b1": b1, "w2": w2}, mesh,
        ...                   {"w1": "d (tp h)", "b1": "(tp h)", "w2": "(tp h) d"})
        >>> layers = fs.shard([w_a, w_b, w_c], mesh, "(tp h) d")     # one spec for all
    """
    if src is None:
        if isinstance(x, torch.Tensor):
            return _shard_one(x, mesh, spec, "fs.shard")
        leaves, treedef, paths = _tensor_tree(x, "fs.shard")
        specs = _spec_leaves(spec, x, len(leaves), "fs.shard")
        done = _each(lambda i: _shard_one(leaves[i], mesh, specs[i], f"fs.shard at {paths[i]}"), len(leaves))
        return optree.tree_unflatten(treedef, done)
    # scatter from one rank
    _refuse_transform(
        f"fs.shard(src={src})",
        f"the scatter from rank {src} has no batching or forward-mode rule; call fs.shard without src "
        f"(every rank passes the global tensor and keeps its block: no communication), or outside the transform",
    )
    if not dist.is_initialized():
        return shard(x, mesh, spec)
    meta: list = [None]
    if dist.get_rank() == src:
        meta = [_src_meta(x, src)]
    _comm.broadcast_object(meta, src)  # every rank raises the same error instead of waiting in a scatter
    if isinstance(meta[0], str):
        raise ArgumentError(meta[0])
    if isinstance(meta[0], _Leaf):
        return _scatter_one(x, meta[0], mesh, spec, src, "fs.shard")
    metas, treedef = optree.tree_flatten(meta[0])
    specs = _spec_leaves(spec, meta[0], len(metas), "fs.shard")
    paths = [a.codify("x") for a in optree.tree_flatten_with_accessor(meta[0])[0]]
    xs = optree.tree_leaves(x) if dist.get_rank() == src else [None] * len(metas)
    layouts = _each(
        lambda i: bind_or_raise(specs[i], mesh, metas[i].shape, f"fs.shard at {paths[i]}"), len(metas)
    )
    out = [_scatter_one(xs[i], metas[i], mesh, layouts[i], src, "fs.shard") for i in range(len(metas))]
    return optree.tree_unflatten(treedef, out)


@dataclass(frozen=True)
class _Leaf:
    """What the other ranks learn of one tensor of ``fs.shard(src=r)``: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _src_meta(x, src: int):
    """On the source rank: a `_Leaf`, a tree of them, or the error every rank will raise."""
    if isinstance(x, torch.Tensor):
        return _Leaf(tuple(x.shape), x.dtype)
    accessors, leaves, _ = optree.tree_flatten_with_accessor(x)
    bad = [i for i, t in enumerate(leaves) if not isinstance(t, torch.Tensor)]
    if len(bad) == len(leaves):  # None, or no tensor at all
        return f"fs.shard(src={src}) needs a tensor on rank {src}, got {type(x).__name__}"
    if bad:
        return (
            f"fs.shard(src={src}) needs a tensor or a pytree of tensors on rank {src}, got "
            f"{type(leaves[bad[0]]).__name__} at {accessors[bad[0]].codify('x')}"
        )
    tree = optree.tree_map(lambda t: _Leaf(tuple(t.shape), t.dtype), x)
    try:
        pickle.dumps(tree)
    except Exception as e:  # a custom pytree node the other ranks cannot rebuild
        return (
            f"fs.shard(src={src}): the pytree on rank {src} cannot be sent to the other ranks "
            f"({type(e).__name__}: {e}); use dicts, lists and tuples, or one fs.shard call per tensor"
        )
    return tree


def _shard_one(x: torch.Tensor, mesh: Mesh, spec, where: str) -> Sharded:
    layout = bind_or_raise(spec, mesh, x.shape, where)
    local = _block(x, layout, mesh, mesh.coordinate)
    return Sharded._wrap(local.clone() if local is not x else local, mesh, layout, x.shape)


def _scatter_one(x, meta: _Leaf, mesh: Mesh, spec, src: int, where: str) -> Sharded:
    """One tensor of ``fs.shard(src=r)``: rank ``r`` scatters the blocks of ``x``."""
    layout = bind_or_raise(spec, mesh, meta.shape, where)
    largest = layout.local_shape(meta.shape, mesh.shape)  # uneven blocks travel padded to the largest
    out = torch.empty(largest, dtype=meta.dtype, device=mesh.device)
    blocks = None
    if dist.get_rank() == src:
        assert isinstance(x, torch.Tensor)  # checked on rank src, and told to every rank
        blocks = [
            _pad_to(_block(x, layout, mesh, _coord_of(mesh, r)).to(mesh.device), largest).contiguous()
            for r in range(dist.get_world_size())
        ]
    _comm.scatter(out, blocks, src)
    mine = layout.local_shape(meta.shape, mesh.shape, mesh.coordinate)
    if mine != largest:
        out = out[tuple(slice(0, n) for n in mine)].clone()
    return Sharded._wrap(out, mesh, layout, torch.Size(meta.shape))


def _tensor_tree(x, where: str):
    """Leaves, treedef and key paths of a pytree of tensors, or an ArgumentError naming the culprit."""
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(x)
    bad = [i for i, t in enumerate(leaves) if not isinstance(t, torch.Tensor)]
    if bad and len(bad) == len(leaves):  # a bare value, or no tensor at all
        raise ArgumentError(f"{where} expects a torch.Tensor, got {type(x).__name__}")
    if bad:
        raise ArgumentError(
            f"{where} expects a torch.Tensor or a pytree of tensors, got {type(leaves[bad[0]]).__name__} "
            f"at {accessors[bad[0]].codify('x')}"
        )
    return leaves, treedef, [a.codify("x") for a in accessors]


def _spec_leaves(spec, tree, n: int, where: str) -> list:
    """One spec per leaf of ``tree`` from a spec or a prefix tree of specs (None: ``"..."``)."""
    if spec is None:
        spec = "..."
    if isinstance(spec, (str, Spec, Layout)):
        return [spec] * n
    spec = optree.tree_map(lambda s: "..." if s is None else s, spec, none_is_leaf=True)
    spec_leaves, spec_def = optree.tree_flatten(spec, is_leaf=lambda s: isinstance(s, (str, Spec, Layout)))
    index_tree = optree.tree_unflatten(spec_def, list(range(len(spec_leaves))))
    try:
        which = optree.broadcast_prefix(index_tree, tree)
    except ValueError:
        why = _mismatch(spec, tree, "spec", "x") or "the spec tree is not a prefix of the structure of x"
        raise SpecError(
            f"{where}: the spec tree does not match the structure of x: {why}\n"
            f"fix: give one spec per leaf, or one spec for a whole subtree"
        ) from None
    return [spec_leaves[k] for k in which]


def _describe(x) -> str:
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)}"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    if isinstance(x, (torch.Tensor, _Leaf)):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def _mismatch(spec, tree, spath: str, tpath: str) -> str | None:
    """The first place where a spec prefix tree and a value tree part ways, in words."""
    if isinstance(spec, (str, Spec, Layout)):
        return None
    if isinstance(spec, dict):
        if not isinstance(tree, dict):
            return f"{spath} is {_describe(spec)} but {tpath} is {_describe(tree)}"
        if set(spec) != set(tree):
            return f"{spath} has keys {sorted(map(str, spec))} but {tpath} has keys {sorted(map(str, tree))}"
        pairs = [(spec[k], tree[k], f"{spath}[{k!r}]", f"{tpath}[{k!r}]") for k in spec]
    elif isinstance(spec, (list, tuple)):
        if type(tree) is not type(spec):
            return f"{spath} is {_describe(spec)} but {tpath} is {_describe(tree)}"
        if len(spec) != len(tree):
            return f"{spath} has {len(spec)} entries but {tpath} has {len(tree)}"
        pairs = [(a, b, f"{spath}[{i}]", f"{tpath}[{i}]") for i, (a, b) in enumerate(zip(spec, tree))]
    else:
        return None
    return next((m for m in (_mismatch(*p) for p in pairs) if m), None)


def _each(fn, n: int) -> list:
    """``[fn(0), ..., fn(n - 1)]``, raising one SpecError with every leaf's problems."""
    out, errors = [], []
    for i in range(n):
        try:
            out.append(fn(i))
        except SpecError as e:
            errors.append(str(e))
    if errors:
        raise SpecError("\n".join(errors))
    return out


def _block(x: torch.Tensor, layout: Layout, mesh: Mesh, coord: dict) -> torch.Tensor:
    """The block of global ``x`` held at mesh coordinate ``coord`` (a view)."""
    for d, (start, n) in enumerate(layout.block(x.shape, mesh.shape, coord)):
        if layout.dims[d]:
            x = x.narrow(d, start, n)
    return x


def _coord_of(mesh: Mesh, rank: int) -> dict[str, int]:
    flat = mesh.ranks.index(rank)
    coord = {}
    for n in reversed(mesh.axis_names):
        coord[n] = flat % mesh.shape[n]
        flat //= mesh.shape[n]
    return coord


_meshes_by_dm: dict = {}


def from_dtensor(dt) -> Sharded:
    """A `Sharded` view of a PyTorch ``DTensor`` (partial placements are reduced first).

    Examples:
        >>> s = fs.from_dtensor(dtensor)
        >>> s.spec
        '(dp d0) d1'
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    dm = dt.device_mesh
    hit = _meshes_by_dm.get(id(dm))
    if hit is None or hit[0] is not dm:
        hit = (dm, Mesh.from_device_mesh(dm))
        _meshes_by_dm[id(dm)] = hit
    mesh = hit[1]
    if any(isinstance(p, Partial) for p in dt.placements):
        dt = dt.redistribute(dm, [Replicate() if isinstance(p, Partial) else p for p in dt.placements])
    dims: list[list[str]] = [[] for _ in range(dt.dim())]
    for name, p in zip(mesh.axis_names, dt.placements):
        if isinstance(p, Shard):
            dims[p.dim].append(name)
        elif not isinstance(p, Replicate):
            raise MeshError(
                f"fs.from_dtensor: placement {p!r} is not supported; redistribute to Shard/Replicate"
            )
    layout = Layout(tuple(tuple(d) for d in dims), tuple(None for _ in dims))
    return Sharded._wrap(dt.to_local(), mesh, layout, dt.shape)
