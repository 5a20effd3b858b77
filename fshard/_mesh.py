"""Named device meshes over torch.distributed process groups.

A `Mesh` names the axes of a row-major grid of ranks (rank = dp_index * tp_size +
tp_index for ``Mesh(dp=2, tp=2)``). It is built on torch's ``DeviceMesh``, which owns the
per-axis process groups. Groups over several axes at once are made when the mesh is built
(up to 4 axes of size > 1; beyond that, on the first collective over them). Every group
fshard makes gets the timeout of the default process group (``fs.init(timeout=...)``).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from ._env import hold_groups
from ._errors import CollectiveError, MeshError, did_you_mean
from ._spec import is_valid_name
from ._watchdog import collective_timeout

__all__ = ["Mesh"]


class AxisGroup:
    """Everything a collective needs about one axis or a tuple of axes (built once, cached).

    ``index`` is this rank's position along the axes (first axis major); ``group_index`` is
    its rank inside ``group``, whose ranks are ordered like the mesh. ``order`` maps an
    index along the axes (as the user listed them) to the group rank, or is None when the
    two agree. Everything but ``group`` is known without communication; ``group`` is looked
    up (or, for a combination of axes not made with the mesh, created) on first access.
    """

    __slots__ = (
        "names",
        "size",
        "index",
        "order",
        "global_ranks",
        "_group",
        "_make",
        "pg_name",
        "real",
        "gloo",
        "backend",
    )

    def __init__(
        self,
        names: tuple[str, ...],
        size: int,
        index: int,
        order: tuple[int, ...] | None,
        global_ranks: tuple[int, ...],
        make: Callable[[], object] | None = None,
    ):
        self.names = names
        self.size = size
        self.index = index
        self.order = order
        self.global_ranks = global_ranks  # global rank of each index along the axes
        self._group: object | None = None
        self._make = make
        self.pg_name: str | None = None  # the ProcessGroup's name, once made (read by traced code)
        # Whether the group's collectives move data (not the "fake" backend), once asked
        # (``_comm._real``). Kept here, not in a table keyed by the group: a module-level table
        # would keep the group, and its threads, alive past `_release_groups`.
        self.real: bool | None = None
        self.gloo: bool | None = None  # a gloo group, once asked (``_inflight.serial``)
        self.backend: str | None = None  # the group's backend name, once asked (``_wire.backend``)

    @property
    def group(self) -> object | None:
        """The ProcessGroup; None when ``size == 1`` or the world is local."""
        if self._make is not None:
            self._group, self._make = self._make(), None
            self.pg_name = getattr(self._group, "group_name", None)
            if self.pg_name is not None:
                GROUP_AXES[self.pg_name] = self.names
        return self._group

    def __repr__(self) -> str:
        return f"AxisGroup({self.names}, size={self.size})"


GROUP_AXES: dict[str, tuple[str, ...]] = {}
"""The mesh axes of each process group fshard made, by the group's name (how a compiled graph's
collectives name their group; read by `fs.count_collectives` for compiled calls)."""

_EAGER_AXES = 4  # meshes with at most this many axes of size > 1 make every multi-axis group up front
_SHARED: dict = {}  # (names, sizes, device type) -> (DeviceMesh, AxisGroups, world group, groups)
_BY_DEVICE_MESH: dict = {}  # id(DeviceMesh) -> (DeviceMesh, AxisGroups, world group, groups)


def _release_groups() -> list:
    """Drop every reference fshard's meshes hold to process groups (their AxisGroups, the groups
    over several axes, the DeviceMeshes' registries) and return the groups (see
    ``_env.release_groups``: at exit, so that the groups' threads end before interpreter shutdown).
    A mesh used afterwards raises `MeshError` on its first collective."""
    held: list = []
    entries = list(_SHARED.values()) + list(_BY_DEVICE_MESH.values())
    _SHARED.clear()
    _BY_DEVICE_MESH.clear()
    for dm, axis_groups, _, pgs in entries:
        for g in axis_groups.values():
            if g._group is not None:
                held.append(g._group)
            g._group, g._make = None, (_released if g.size > 1 else None)
        held.extend(pgs.values())
        pgs.clear()
        registry = getattr(dm, "_pg_registry", None)
        if isinstance(registry, dict):
            held.extend(registry.values())
            registry.clear()
    return held


def _released() -> object:
    raise MeshError(
        "this mesh's process groups were torn down (at exit, or at the end of a pool job); "
        "build a new fs.Mesh after fs.init()"
    )


hold_groups(_release_groups)


def _pg_options(backend: str | None, timeout: timedelta):
    """Backend options carrying ``timeout``, for torch's DeviceMesh (None for other backends)."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
    else:
        return None
    options._timeout = timeout
    return options


def _axis_overrides(sizes: tuple[int, ...], world: int, backend: str | None) -> dict | None:
    """``init_device_mesh``'s ``backend_override``: the world's timeout for the groups it makes.

    An axis spanning the world reuses the default group (which has that timeout already), except
    for gloo on a CUDA machine, where DeviceMesh makes a new group for it.
    """
    timeout = collective_timeout()
    if timeout is None or _pg_options(backend, timeout) is None:
        return None
    new_world_group = backend == "gloo" and torch.cuda.is_available()
    overrides = {
        d: _pg_options(backend, timeout) for d, s in enumerate(sizes) if s != world or new_world_group
    }
    return overrides or None


def _local_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_BY_TEXT: dict[str, Mesh] = {}  # the latest mesh made of each key, by the key's text


def by_text(text: str) -> Mesh:
    """The mesh of key text ``text``, read from this module's global table.

    Compiled code reads a call's mesh here rather than from the shard_map'd function: Dynamo
    takes the ints it reads through a global (the axis sizes, this rank's coordinates) as
    constants of the graph, guarded, while ints read through a function's arguments become
    symbolic when they change between traces of the same code (two shard_map'd functions on two
    meshes compiled in one process), and fshard's planning cannot run on symbolic axis sizes.
    Equal meshes (same key) are interchangeable; the table holds the latest one made, whose
    process groups are those of the current ``fs.init``."""
    return _BY_TEXT[text]


class Mesh:
    """A grid of ranks with named axes, row-major over the default process group.

    Building a mesh is collective: every rank must build it, in the same order as its other
    collectives. It creates the process group of every axis and, when at most 4 axes have size
    > 1, of every combination of them (a mesh of the same shape reuses them). Afterwards, sizes,
    indices and coordinates (`axis_size`, `axis_index`, `coordinate`) never communicate. On a
    mesh with more than 4 axes of size > 1, the group of a combination of axes is created by the
    first collective over it, which every rank of the world must then reach, as usual for a
    collective. Groups get the timeout of the default process group (``fs.init(timeout=...)``).

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
            if not is_valid_name(name):
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

        Collective like building a `Mesh` when the DeviceMesh spans the world (its per-axis
        groups are used as they are; groups over several axes are made the first time a
        DeviceMesh is wrapped). For a DeviceMesh over part of the world, groups over several
        axes are made by the first collective over them.

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

                dm = init_device_mesh(
                    self.device.type,
                    sizes,
                    mesh_dim_names=names,
                    backend_override=_axis_overrides(sizes, world, self._backend),
                )
                shared = _SHARED[cache_key] = (dm, {}, world_group, {})
                _BY_DEVICE_MESH[id(dm)] = shared  # Mesh.from_device_mesh(mesh.device_mesh) shares it
            self._device_mesh = shared[0]
        elif device_mesh is not None:
            shared = _BY_DEVICE_MESH.get(id(device_mesh))
            if shared is None or shared[0] is not device_mesh or shared[2] is not dist.group.WORLD:
                shared = _BY_DEVICE_MESH[id(device_mesh)] = (device_mesh, {}, dist.group.WORLD, {})
        else:
            shared = (None, {}, None, {})
        if self._device_mesh is not None:
            coord = self._device_mesh.get_coordinate()
            self._coord = tuple(int(c) for c in coord)
            self._ranks = tuple(int(r) for r in self._device_mesh.mesh.flatten().tolist())
        else:
            self._coord = tuple(0 for _ in names)
            self._ranks = (rank,)
        self.rank = rank
        self._groups: dict[tuple[str, ...], AxisGroup] = shared[1]
        self._pgs: dict[tuple[int, ...], object] = shared[3]  # sorted dims (size > 1) -> group
        self._key = (names, sizes, self._ranks)
        self._text = repr(self._key)  # a string: compiled code finds the mesh by it (`by_text`)
        _BY_TEXT[self._text] = self  # the latest: its groups are live after a re-init
        # Bits for axes that can vary (size > 1); used by varying-axes tracking.
        self._bits = {n: (1 << i) for i, (n, s) in enumerate(zip(names, sizes)) if s > 1}
        self._make_multi_axis_groups(world)

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

    def axis_size(self, name: str | tuple[str, ...], where: str = "axis_size") -> int:
        """Size of one axis, or the product for a tuple of axes (a plain int from the mesh's
        shape: no axis group, whose attributes are trace-time results under torch.compile)."""
        size = 1
        for n in self.check_axes(name, where):
            size *= self._shape[n]
        return size

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
        got = None if torch.compiler.is_compiling() else self._groups.get(key)
        if got is not None:
            return got
        return self._new_axis_group(key, axis, where)

    @torch._dynamo.assume_constant_result  # under torch.compile: run at trace time, a constant
    def _new_axis_group(self, key: tuple, axis, where: str) -> AxisGroup:
        got = self._groups.get(key)
        if got is None:
            got = self._groups[key] = self._make_group(self.check_axes(axis, where))
        if torch.compiler.is_compiling():  # its process group too: traced code only reads it
            got.group  # noqa: B018
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
        # Only the axes of size > 1 decide the members: ("dp", "tp") with tp=1 is dp's group.
        varying = tuple(sorted(d for d in dims if self._sizes[d] > 1))
        make: Callable[[], object] | None = None
        if size > 1 and len(varying) == 1:
            make = functools.partial(self.device_mesh.get_group, varying[0])
        elif size > 1:
            make = functools.partial(self._group_of, varying)
        return AxisGroup(names, size, index, order, tuple(members), make)

    def _rank_at(self, coord) -> int:
        flat = 0
        for c, s in zip(coord, self._sizes):
            flat = flat * s + c
        return self._ranks[flat]

    def _make_multi_axis_groups(self, world: int) -> None:
        """Make the group of every combination of 2 or more axes of size > 1 (collective).

        Only for a mesh spanning the world (every rank then enumerates the same groups) with at
        most `_EAGER_AXES` such axes: 2^k - k - 1 combinations for k axes, the one spanning every
        axis being the world group itself.
        """
        varying = [d for d, s in enumerate(self._sizes) if s > 1]
        if self._device_mesh is None or self._size != world or len(varying) > _EAGER_AXES:
            return
        for k in range(2, len(varying) + 1):
            for dims in itertools.combinations(varying, k):
                self._group_of(dims)

    def _group_of(self, dims: tuple[int, ...]) -> object:
        """The group over mesh dims ``dims`` (sorted, each of size > 1), made on first request."""
        got = self._pgs.get(dims)
        if got is None:
            got = self._pgs[dims] = self._new_group(dims)
        return got

    def _new_group(self, dims) -> object:
        if math.prod(self._sizes[d] for d in dims) == dist.get_world_size():
            return dist.group.WORLD  # every rank is a member: the default group is that group
        # Every rank enumerates every subgroup in the same order (new_group is collective).
        other = [d for d in range(len(self._names)) if d not in dims]
        subgroups = []
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
        mine, _ = dist.new_subgroups_by_enumeration(
            subgroups, backend=self._backend, timeout=collective_timeout()
        )
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
