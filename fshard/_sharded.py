"""Global values that live split across ranks: `Sharded`, `shard`, DTensor interop."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _comm
from ._errors import ArgumentError, MeshError, SpecError, report
from ._layout import Layout, bind_or_raise, divisibility_problems
from ._mesh import Mesh
from ._primitives import AllGatherInvariant, AllToAll, LocalSlice
from ._primitives import apply as _apply

__all__ = ["Sharded", "shard", "from_dtensor"]


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

    __slots__ = ("local", "mesh", "layout", "__weakref__")

    def __init__(self, local: torch.Tensor, mesh: Mesh, spec, *, check: bool = True):
        if not isinstance(local, torch.Tensor):
            raise ArgumentError(f"fs.Sharded needs a torch.Tensor local block, got {type(local).__name__}")
        if not isinstance(mesh, Mesh):
            raise ArgumentError(f"fs.Sharded needs an fs.Mesh, got {type(mesh).__name__}")
        self.local = local
        self.mesh = mesh
        self.layout = (
            spec
            if isinstance(spec, Layout)
            else bind_or_raise(spec, mesh, local.shape, "fs.Sharded", local=True)
        )
        if check and mesh.size > 1:
            _check_blocks(local, mesh, self.layout)

    @classmethod
    def _wrap(cls, local: torch.Tensor, mesh: Mesh, layout: Layout) -> Sharded:
        """A Sharded value from a block fshard itself computed (no checks, no communication)."""
        self = cls.__new__(cls)
        self.local, self.mesh, self.layout = local, mesh, layout
        return self

    # -- global description -----------------------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        """The global shape."""
        return torch.Size(self.layout.global_shape(self.local.shape, self.mesh.shape))

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
        return None if g is None else Sharded._wrap(g, self.mesh, self.layout)

    def detach(self) -> Sharded:
        return Sharded._wrap(self.local.detach(), self.mesh, self.layout)

    def __repr__(self) -> str:
        return (
            f"Sharded(shape={tuple(self.shape)}, dtype={self.dtype}, spec={self.spec!r}, "
            f"mesh={self.mesh!r}, local_shape={tuple(self.local.shape)})"
        )

    # -- moving data ------------------------------------------------------------------------

    def full(self) -> torch.Tensor:
        """Gather the global value as a plain tensor on every rank (one all_gather per split dim).

        Differentiable: the gradient of the result flows back to this rank's block.
        """
        x = self.local
        for d, axes in enumerate(self.layout.dims):
            if axes:
                x = _apply(AllGatherInvariant, x, self.mesh.axis_group(axes), d, True)
        return x

    def reshard(self, spec) -> Sharded:
        """The same global value in another layout, moved with the fewest collectives.

        A split that disappears is all-gathered, a new split is a local slice (no
        communication), and a split that moves from one dim to another is one all_to_all.

        Examples:
            >>> x = fs.shard(t, mesh, "(sp s) h d")
            >>> y = x.reshard("s (sp h) d")     # one all_to_all over sp
        """
        target = bind_or_raise(spec, self.mesh, self.shape, "Sharded.reshard")
        return Sharded._wrap(relayout(self.local, self.mesh, self.layout, target), self.mesh, target)

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


def _check_blocks(local: torch.Tensor, mesh: Mesh, layout: Layout) -> None:
    """Every rank's block must have the same shape and dtype (one small all-gather)."""
    g = mesh.axis_group(mesh.axis_names, "Sharded")
    mine = [local.dim(), *local.shape, *([0] * (8 - local.dim()))][:9] if local.dim() <= 8 else [local.dim()]
    with _comm.untracked():
        t = torch.tensor(mine + [0] * (9 - len(mine)), dtype=torch.int64, device=mesh.device)
        rows = _comm.all_gather_blocks(t, g).tolist()
    if all(row == rows[0] for row in rows):
        return
    by: dict = {}
    for rank, row in zip(mesh.ranks, rows):
        by.setdefault(tuple(row[1 : 1 + row[0]]), []).append(rank)
    held = "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {shape}" for shape, r in by.items()
    )
    raise SpecError(
        f"fs.Sharded: the local blocks for spec {layout.spec_text()!r} on {mesh!r} differ in shape across "
        f"ranks ({held}); every rank must hold an equal block, so the global shape is the same everywhere: "
        f"drop or pad the uneven last batch (e.g. DataLoader(drop_last=True)), or gather it whole and use "
        f"fs.shard(x, mesh, spec, src=0)"
    )


def relayout(x: torch.Tensor, mesh: Mesh, a: Layout, b: Layout) -> torch.Tensor:
    """Move local block ``x`` from layout ``a`` to layout ``b`` (differentiable)."""
    if a.dims == b.dims:
        return x
    remove: dict[int, tuple[str, ...]] = {}
    add: dict[int, tuple[str, ...]] = {}
    for d, (pa, pb) in enumerate(zip(a.dims, b.dims)):
        k = 0
        while k < min(len(pa), len(pb)) and pa[k] == pb[k]:
            k += 1
        if pa[k:]:
            remove[d] = pa[k:]
        if pb[k:]:
            add[d] = pb[k:]
    # A split that moves from one dim to another (innermost on both): one all_to_all.
    if len(remove) == 1 and len(add) == 1:
        (i, ra), (j, rb) = next(iter(remove.items())), next(iter(add.items()))
        if i != j and ra == rb and len(ra) == 1:
            return _apply(AllToAll, x, mesh.axis_group(ra[0]), j, i)
    for d, axes in remove.items():
        x = _apply(AllGatherInvariant, x, mesh.axis_group(axes), d, True)
    for d, axes in add.items():
        x = _apply(LocalSlice, x, mesh.axis_group(axes), d, True)
    return x


def shard(x: torch.Tensor | None, mesh: Mesh, spec, *, src: int | None = None) -> Sharded:
    """Split a global tensor into a `Sharded` value.

    Without ``src``, every rank passes the same global tensor and keeps its own block
    (a copy, so the global tensor can be freed; no communication). With ``src=r``, only
    rank ``r`` needs the tensor (others may pass None): it scatters the blocks.

    Args:
        x: the global tensor.
        mesh: the mesh.
        spec: the layout, e.g. ``"(dp b) (tp d)"``.
        src: the global rank holding the data, or None.

    Raises:
        SpecError: for a spec that does not fit the tensor or the mesh.

    Examples:
        >>> w = fs.shard(torch.randn(1024, 256), mesh, "(tp h) d")
        >>> w = fs.shard(data if rank == 0 else None, mesh, "(dp b) d", src=0)
    """
    if src is None:
        if not isinstance(x, torch.Tensor):
            raise ArgumentError(f"fs.shard expects a torch.Tensor, got {type(x).__name__}")
        layout = bind_or_raise(spec, mesh, x.shape, "fs.shard")
        local = _block(x, layout, mesh, mesh.coordinate)
        return Sharded._wrap(local.clone() if local is not x else local, mesh, layout)
    # scatter from one rank
    if not dist.is_initialized():
        return shard(x, mesh, spec)
    meta: list = [None]
    if dist.get_rank() == src:
        if isinstance(x, torch.Tensor):
            meta = [(tuple(x.shape), x.dtype)]
        else:  # tell every rank, so all of them raise instead of waiting in the scatter
            meta = [f"fs.shard(src={src}) needs a tensor on rank {src}, got {type(x).__name__}"]
    _comm.broadcast_object(meta, src)
    if isinstance(meta[0], str):
        raise ArgumentError(meta[0])
    shape, dtype = meta[0]
    layout = bind_or_raise(spec, mesh, shape, "fs.shard")
    local_shape = layout.local_shape(shape, mesh.shape)
    out = torch.empty(local_shape, dtype=dtype, device=mesh.device)
    blocks = None
    if dist.get_rank() == src:
        assert isinstance(x, torch.Tensor)  # checked above, on every rank
        blocks = [
            _block(x, layout, mesh, _coord_of(mesh, r)).contiguous().to(mesh.device)
            for r in range(dist.get_world_size())
        ]
    _comm.scatter(out, blocks, src)
    return Sharded._wrap(out, mesh, layout)


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
    problems = divisibility_problems(layout, dt.shape, mesh.shape)
    if problems:
        raise SpecError(report("fs.from_dtensor: uneven shards are not supported", problems))
    return Sharded._wrap(dt.to_local(), mesh, layout)
