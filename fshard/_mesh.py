"""Named device meshes over torch.distributed process groups.

A `Mesh` names the axes of a row-major grid of ranks (rank = dp_index * tp_size +
tp_index for ``Mesh(dp=2, tp=2)``). It is built on torch's ``DeviceMesh``, which owns the
per-axis process groups; groups over several axes at once are made on first use.
"""

from __future__ import annotations

import keyword
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._errors import CollectiveError, MeshError, did_you_mean

__all__ = ["Mesh"]


@dataclass(frozen=True, eq=False)
class AxisGroup:
    """Everything a collective needs about one axis or a tuple of axes (built once, cached).

    ``index`` is this rank's position along the axes (first axis major); ``group_index`` is
    its rank inside ``group``, whose ranks are ordered like the mesh. ``order`` maps an
    index along the axes (as the user listed them) to the group rank, or is None when the
    two agree.
    """

    names: tuple[str, ...]
    size: int
    index: int
    group: object | None  # ProcessGroup, None when size == 1 or the world is local
    order: tuple[int, ...] | None
    global_ranks: tuple[int, ...]  # global rank of each index along the axes

    def __repr__(self) -> str:
        return f"AxisGroup({self.names}, size={self.size})"


_SHARED: dict = {}


def _local_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Mesh:
    """A grid of ranks with named axes, row-major over the default process group.

    Args:
        shape: a mapping from axis name to size, in major-to-minor order. Axis sizes may
            also be given as keywords.

    Raises:
        MeshError: when the sizes do not multiply to the world size, when
            torch.distributed is not initialized for a mesh of more than one rank, or for a
            bad axis name or size.

    Examples:
        >>> import fshard as fs
        >>> fs.init()                      # one rank when run as a plain script
        >>> mesh = fs.Mesh(dp=1)
        >>> mesh.shape, mesh.axis_index("dp")
        ({'dp': 1}, 0)

    Under ``python -m fshard.run -n 4 script.py`` the same script would use
    ``fs.Mesh(dp=2, tp=2)``.
    """

    def __init__(self, shape: dict[str, int] | None = None, /, **axes: int):
        if shape is not None and axes:
            raise MeshError("give the mesh shape either as a dict or as keywords, not both")
        spec = dict(shape if shape is not None else axes)
        if not spec:
            raise MeshError("a mesh needs at least one axis, for example fs.Mesh(dp=2)")
        for name, size in spec.items():
            if (
                not isinstance(name, str)
                or not name.isidentifier()
                or keyword.iskeyword(name)
                or name.startswith("_")
                or name.endswith("_")
            ):
                raise MeshError(
                    f"mesh axis name {name!r} cannot appear in a spec: use a Python identifier that is "
                    f"not a keyword and does not start or end with '_'"
                )
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh axis {name!r} has size {size!r}; sizes must be positive integers")
        self._init(tuple(spec), tuple(spec.values()), device_mesh=None)

    @classmethod
    def from_device_mesh(cls, device_mesh) -> Mesh:
        """Wrap an existing torch ``DeviceMesh`` with named dims.

        Examples:
            >>> from torch.distributed.device_mesh import init_device_mesh
            >>> dm = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
            >>> fs.Mesh.from_device_mesh(dm).axis_names
            ('dp',)
        """
        names = device_mesh.mesh_dim_names
        if not names:
            raise MeshError("the DeviceMesh has no mesh_dim_names; build it with mesh_dim_names=(...)")
        self = cls.__new__(cls)
        self._init(tuple(names), tuple(device_mesh.mesh.shape), device_mesh=device_mesh)
        return self

    # -- construction -------------------------------------------------------------------

    def _init(self, names, sizes, device_mesh) -> None:
        rank, world = _local_world()
        size = math.prod(sizes)
        shape_text = ", ".join(f"{n}={s}" for n, s in zip(names, sizes))
        self._names = names
        self._sizes = sizes
        self._shape = dict(zip(names, sizes))
        self._size = size
        if device_mesh is None and size != world:
            if not dist.is_initialized() and size > 1:
                raise MeshError(
                    f"Mesh({shape_text}) needs {size} ranks but torch.distributed is not initialized; "
                    f"call fs.init() in a script started with `python -m fshard.run -n {size} script.py` "
                    f"(or torchrun --nproc-per-node {size}), or run the function with "
                    f"fs.launch(fn, nprocs={size})"
                )
            raise MeshError(
                f"Mesh({shape_text}) has {size} rank{'s' if size != 1 else ''} but the world has {world}; "
                f"choose axis sizes whose product is {world}"
            )
        self._backend = dist.get_backend() if dist.is_initialized() else None
        if self._backend == "nccl" and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._device_mesh = device_mesh
        cache_key = None
        if device_mesh is None and dist.is_initialized():
            # Meshes of the same shape share one DeviceMesh and its process groups: making
            # groups is collective and costly, and equal meshes are interchangeable.
            # Keyed by the world group object itself: a destroyed and re-initialized world
            # must not reuse the old groups.
            world_group = dist.group.WORLD
            cache_key = (names, sizes, self.device.type)
            shared = _SHARED.get(cache_key)
            if shared is None or shared[2] is not world_group:
                from torch.distributed.device_mesh import init_device_mesh

                dm = init_device_mesh(self.device.type, sizes, mesh_dim_names=names)
                shared = _SHARED[cache_key] = (dm, {}, world_group)
            self._device_mesh = shared[0]
        if self._device_mesh is not None:
            coord = self._device_mesh.get_coordinate()
            self._coord = tuple(int(c) for c in coord)
            self._ranks = tuple(int(r) for r in self._device_mesh.mesh.flatten().tolist())
        else:
            self._coord = tuple(0 for _ in names)
            self._ranks = (rank,)
        self.rank = rank
        self._groups: dict[tuple[str, ...], AxisGroup] = _SHARED[cache_key][1] if cache_key else {}
        self._key = (names, sizes, self._ranks)
        # Bits for axes that can vary (size > 1); used by varying-axes tracking.
        self._bits = {n: (1 << i) for i, (n, s) in enumerate(zip(names, sizes)) if s > 1}

    # -- public accessors ---------------------------------------------------------------

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axis names, major to minor."""
        return self._names

    @property
    def shape(self) -> dict[str, int]:
        """A dict from axis name to size (a fresh copy)."""
        return dict(self._shape)

    @property
    def size(self) -> int:
        """The number of ranks in the mesh."""
        return self._size

    @property
    def device_mesh(self):
        """The torch ``DeviceMesh`` underneath (for DTensor and checkpoint interop)."""
        if self._device_mesh is None:
            raise MeshError(
                "this 1-rank mesh was built without torch.distributed; call fs.init() before "
                "fs.Mesh(...) to get a DeviceMesh"
            )
        return self._device_mesh

    def axis_size(self, name: str | tuple[str, ...]) -> int:
        """Size of one axis, or the product for a tuple of axes."""
        return self.axis_group(name, "axis_size").size

    def axis_index(self, name: str | tuple[str, ...]) -> int:
        """This rank's coordinate along an axis (first axis major for a tuple)."""
        return self.axis_group(name, "axis_index").index

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global rank at each mesh position, row-major (``ranks[0]`` is the first position)."""
        return self._ranks

    @property
    def tracked(self) -> bool:
        """Whether any axis has size > 1 (values can vary, so shard_map tracks varying axes)."""
        return bool(self._bits)

    @property
    def coordinate(self) -> dict[str, int]:
        """This rank's coordinate on every axis."""
        return dict(zip(self._names, self._coord))

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in self._shape.items()) + ")"

    # -- axes and groups ----------------------------------------------------------------

    def check_axes(self, axis, where: str) -> tuple[str, ...]:
        """Normalize ``axis`` (a name or tuple of names) and check it against the mesh."""
        names = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(axis, (tuple, list)) else None
        if names is None or not names or not all(isinstance(n, str) for n in names):
            raise CollectiveError(
                f"fs.{where}: axis must be a mesh axis name or a tuple of names, got {axis!r}; "
                f"mesh axes are {self._names}"
            )
        for n in names:
            if n not in self._shape:
                hint = did_you_mean(n, self._names)
                raise CollectiveError(f"fs.{where}: {n!r} is not an axis of {self!r}{hint}")
        if len(set(names)) != len(names):
            raise CollectiveError(f"fs.{where}: axis {axis!r} names an axis twice")
        return names

    def axis_group(self, axis, where: str = "collective") -> AxisGroup:
        """The cached `AxisGroup` for an axis or tuple of axes."""
        key = axis if type(axis) is tuple else tuple(axis) if type(axis) is list else (axis,)
        got = self._groups.get(key)
        if got is not None:
            return got
        names = self.check_axes(axis, where)
        got = self._make_group(names)
        self._groups[key] = got
        return got

    def _make_group(self, names: tuple[str, ...]) -> AxisGroup:
        dims = [self._names.index(n) for n in names]
        sizes = [self._sizes[d] for d in dims]
        size = math.prod(sizes)
        index = 0
        for d in dims:
            index = index * self._sizes[d] + self._coord[d]
        # Global ranks of the members, enumerated along the requested axes (first major).
        members = []
        for flat in range(size):
            coord = list(self._coord)
            rem = flat
            for d, s in reversed(list(zip(dims, sizes))):
                coord[d] = rem % s
                rem //= s
            members.append(self._rank_at(coord))
        sorted_members = sorted(members)
        order: tuple[int, ...] | None = tuple(sorted_members.index(r) for r in members)
        if order == tuple(range(size)):
            order = None
        group = None
        if size > 1:
            if len(names) == 1:
                group = self._device_mesh.get_group(names[0])
            else:
                group = self._new_group(dims)
        return AxisGroup(names, size, index, group, order, tuple(members))

    def _rank_at(self, coord) -> int:
        flat = 0
        for c, s in zip(coord, self._sizes):
            flat = flat * s + c
        return self._ranks[flat]

    def _new_group(self, dims) -> object:
        # Every rank enumerates every subgroup in the same order (new_group is collective).
        other = [d for d in range(len(self._names)) if d not in dims]
        subgroups = []
        import itertools

        for fixed in itertools.product(*[range(self._sizes[d]) for d in other]):
            ranks = []
            for inner in itertools.product(*[range(self._sizes[d]) for d in sorted(dims)]):
                coord = [0] * len(self._names)
                for d, c in zip(other, fixed):
                    coord[d] = c
                for d, c in zip(sorted(dims), inner):
                    coord[d] = c
                ranks.append(self._rank_at(coord))
            subgroups.append(sorted(ranks))
        mine, _ = dist.new_subgroups_by_enumeration(subgroups, backend=self._backend)
        return mine

    def bits(self, names: tuple[str, ...]) -> int:
        """Bit mask of the axes (size-1 axes have no bit: nothing can vary over them)."""
        b = 0
        for n in names:
            b |= self._bits.get(n, 0)
        return b

    def names_of(self, bits: int) -> tuple[str, ...]:
        """Axis names of a bit mask, in mesh order."""
        return tuple(n for n in self._names if self._bits.get(n, 0) & bits)
