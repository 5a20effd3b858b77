"""Binding a parsed spec to a mesh and a tensor rank: the `Layout`.

A layout says, for each tensor dimension, which mesh axes split it (major first), plus the
axes over which the value is an unreduced partial sum. Binding is pure and cached; it
returns problems as strings so that shard_map can report every failure of a call at once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ._errors import SpecError, did_you_mean, report
from ._spec import ANONYMOUS, Dim, Spec, parse_spec

__all__ = ["Layout", "bind", "bind_or_raise", "chunk_sizes"]


class _cached:
    """``functools.cached_property`` without its lock (Python 3.11's), which torch.compile cannot
    trace: the value lands in the instance's ``__dict__``, where later lookups find it first."""

    def __init__(self, fn):
        self.func = fn  # the names functools.cached_property uses (read by docs/gen_api.py)
        self.attrname = fn.__name__
        self.__doc__ = fn.__doc__

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        value = obj.__dict__[self.attrname] = self.func(obj)
        return value


@dataclass(frozen=True)
class Layout:
    """How a global tensor is laid out over a mesh: the bound form of a spec.

    Attributes:
        dims: per tensor dim, the mesh axes that split it, major first (``()``: not split).
        labels: per tensor dim, the dim's name in the spec (None under ``...``; ``"_"`` for an
            anonymous dim, which is tied to no other dim).
        partial: mesh axes over which a shard_map output is an unreduced partial sum
            (``| sum(...)``); ``()`` for stored values.

    Examples:
        >>> layout = fs.Sharded(torch.zeros(4, 3), mesh, "(dp b) d").layout   # mesh: dp=2
        >>> layout.dims, layout.split_axes, str(layout)
        ((('dp',), ()), ('dp',), '(dp b) d')
    """

    dims: tuple[tuple[str, ...], ...]
    labels: tuple[str | None, ...]
    partial: tuple[str, ...] = ()

    @_cached
    def split_axes(self) -> tuple[str, ...]:
        """Every mesh axis that splits some dim, in dim order."""
        return tuple(a for d in self.dims for a in d)

    @property
    def is_split(self) -> bool:
        """Whether any dim is split."""
        return bool(self.split_axes)

    def __hash__(self) -> int:  # cached: layouts are part of shard_map's per-call plan key
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.dims, self.labels, self.partial))
            object.__setattr__(self, "_hash", h)
        return h

    def same_placement(self, other: Layout) -> bool:
        """Same splits and partial sums (labels may differ)."""
        return self.dims == other.dims and self.partial == other.partial

    # -- partial sums: what an output needs on the way out -----------------------------------

    @_cached
    def scatter_dims(self) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """``(dim, axes)`` for each dim split over summed axes: a reduce-scatter over ``axes``."""
        partial = set(self.partial)
        out = []
        for d, axes in enumerate(self.dims):
            summed = tuple(a for a in axes if a in partial)
            if summed:
                out.append((d, summed))
        return tuple(out)

    @_cached
    def reduce_axes(self) -> tuple[str, ...]:
        """Summed axes that split no dim: an all-reduce over them."""
        return tuple(a for a in self.partial if a not in self.split_axes)

    def reduced(self) -> Layout:
        """The layout of the value once its partial sums are reduced."""
        return Layout(self.dims, self.labels) if self.partial else self

    # -- shapes and blocks -------------------------------------------------------------------
    #
    # A dim of size S split over axes (a1, a2, ...) is cut as torch.chunk cuts it, one axis after
    # the other (DTensor's rule): into pieces of ceil(S / size(a1)) along a1 (the last may be
    # shorter, and pieces past the end are empty), each piece the same way along a2, and so on.
    # When the product of the axis sizes divides S, every block has S / product rows.

    def is_even(self, shape, mesh_shape: dict) -> bool:
        """Whether every split dim of a global ``shape`` divides into equal blocks."""
        return all(
            not axes or size % math.prod([mesh_shape[a] for a in axes]) == 0
            for size, axes in zip(shape, self.dims)
        )

    def local_shape(self, shape, mesh_shape: dict, coord: dict | None = None) -> tuple[int, ...]:
        """The shape of the block of a global ``shape`` held at ``coord`` (any coordinate when
        the split is even; the largest block, that of coordinate 0, when ``coord`` is None)."""
        if coord is None:
            coord = dict.fromkeys(mesh_shape, 0)
        return tuple(n for _, n in self.block(shape, mesh_shape, coord))

    def global_shape(self, shape, mesh_shape: dict) -> tuple[int, ...]:
        """The global shape whose blocks all have ``shape`` (an even split)."""
        return tuple(s * math.prod([mesh_shape[a] for a in d]) for s, d in zip(shape, self.dims))

    def block_index(self, dim: int, mesh_shape: dict, coord: dict) -> int:
        """Index of the block of ``dim`` held at mesh coordinate ``coord`` (first axis major)."""
        idx = 0
        for a in self.dims[dim]:
            idx = idx * mesh_shape[a] + coord[a]
        return idx

    def block(self, shape, mesh_shape: dict, coord: dict) -> tuple[tuple[int, int], ...]:
        """``(start, length)`` per dim of the block of a global ``shape`` held at ``coord``.

        The one place that says which part of a global value a rank holds: torch.chunk's cut,
        one split axis after the other, so blocks may be uneven (10 rows over 4 ranks: 3, 3, 3,
        1) or empty (3 rows over 4 ranks: 1, 1, 1, 0).

        Examples:
            >>> layout.block((8, 6), {"dp": 2, "tp": 2}, {"dp": 1, "tp": 0})   # "(dp b) (tp k)"
            ((4, 4), (0, 3))
            >>> layout.block((10, 6), {"dp": 4}, {"dp": 3})                     # "(dp b) k"
            ((9, 1), (0, 6))
        """
        out = []
        for size, axes in zip(shape, self.dims):
            start = 0
            for a in axes:
                size, off = _chunk(size, mesh_shape[a], coord[a])
                start += off
            out.append((start, size))
        return tuple(out)

    def block_sizes(
        self, dim: int, size: int, mesh_shape: dict, axes: tuple[str, ...] | None = None
    ) -> tuple[int, ...]:
        """The lengths along ``dim`` of the blocks of a piece of ``size`` split over ``axes``
        (default: every axis that splits ``dim``), in the order of the group over ``axes``."""
        return chunk_sizes(size, [mesh_shape[a] for a in (self.dims[dim] if axes is None else axes)])

    def spec_text(self) -> str:
        """The layout as spec text; unnamed dims are written ``d0``, ``d1``, ..."""
        dims = tuple(
            Dim(tuple(axes) + (label or f"d{i}",), grouped=bool(axes))
            for i, (axes, label) in enumerate(zip(self.dims, self.labels))
        )
        return str(Spec(dims, tuple(self.partial)))

    def __str__(self) -> str:
        return self.spec_text()


@functools.lru_cache(maxsize=4096)
def bind(
    spec: Spec | str, axis_sizes: tuple[tuple[str, int], ...], ndim: int
) -> tuple[Layout | None, tuple[str, ...]]:
    """Bind ``spec`` to a mesh (as ``((name, size), ...)``) for a tensor of ``ndim`` dims.

    Returns ``(layout, problems)``; layout is None when there are problems. Raises
    SpecError for malformed text (from the parser). Two dims may not share a label, except the
    anonymous label ``_``, which never ties.
    """
    spec = parse_spec(spec)
    mesh = dict(axis_sizes)
    names = tuple(mesh)
    mesh_text = "Mesh(" + ", ".join(f"{n}={s}" for n, s in axis_sizes) + ")"
    problems: list[str] = []

    explicit = [d for d in spec.dims if not d.ellipsis]
    if spec.has_ellipsis:
        if len(explicit) > ndim:
            problems.append(
                f"the spec names {len(explicit)} dims besides '...' but the tensor has {ndim}; "
                f"remove dims from the spec"
            )
            return None, tuple(problems)
    elif len(explicit) != ndim:
        problems.append(
            f"the spec names {len(explicit)} dim{'s' if len(explicit) != 1 else ''} but the tensor has "
            f"{ndim}; write one name per dim, or '...' for unsplit dims"
        )
        return None, tuple(problems)

    dims: list[tuple[str, ...]] = []
    labels: list[str | None] = []
    used: dict[str, int] = {}
    seen_labels: dict[str, int] = {}
    for d in spec.dims:
        if d.ellipsis:
            n_ell = ndim - len(explicit)
            dims.extend(() for _ in range(n_ell))
            labels.extend(None for _ in range(n_ell))
            continue
        pos = len(dims)
        written = f"({' '.join(d.names)})" if d.grouped else d.names[0]
        axes = [n for n in d.names if n in mesh]
        rest = [n for n in d.names if n not in mesh]
        label = None
        if not d.grouped:
            if axes:
                problems.append(
                    f"{written!r} is a mesh axis of {mesh_text}, so it cannot label dim {pos}: write "
                    f"({written} x) to split this dim over {written}, or rename the dim"
                )
            else:
                label = rest[0]
        else:
            if not rest:
                problems.append(
                    f"group {written} of dim {pos} has no dim label; add one after the mesh axes, "
                    f"e.g. ({' '.join(d.names)} x)"
                )
            elif len(rest) > 1:
                for n in rest[:-1]:
                    problems.append(
                        f"{n!r} in {written} is not an axis of {mesh_text}{did_you_mean(n, names)}; "
                        f"a group lists mesh axes first, then one dim label"
                    )
                label = rest[-1]
            else:
                label = rest[0]
                if d.names[-1] != label:
                    problems.append(
                        f"in {written} the mesh axes must come before the dim label: write "
                        f"({' '.join(axes)} {label})"
                    )
        for a in axes:
            if a in used:
                problems.append(
                    f"mesh axis {a!r} splits both dim {used[a]} and dim {pos}; an axis can split one dim only"
                    if used[a] != pos
                    else f"mesh axis {a!r} appears twice in {written}"
                )
            used.setdefault(a, pos)
        if label is not None and label != ANONYMOUS:
            if label in seen_labels:
                problems.append(
                    f"label {label!r} names both dim {seen_labels[label]} and dim {pos}; "
                    f"give each dim its own name"
                )
            seen_labels.setdefault(label, pos)
        dims.append(tuple(axes))
        labels.append(label)

    seen_partial: set[str] = set()
    for a in spec.partial:
        if a not in mesh:
            problems.append(
                f"sum({a}) names {a!r}, which is not an axis of {mesh_text}{did_you_mean(a, names)}"
            )
        elif a in seen_partial:
            problems.append(f"sum(...) names axis {a!r} twice")
        seen_partial.add(a)
    for i, split in enumerate(dims):
        part = [a for a in split if a in seen_partial]
        if part and split[len(split) - len(part) :] != tuple(part):
            problems.append(
                f"dim {i} is split over {split} and summed over {tuple(part)}: the summed axes must "
                f"come last in the group so that a reduce-scatter produces the block"
            )
    if problems:
        return None, tuple(problems)
    return Layout(tuple(dims), tuple(labels), tuple(spec.partial)), ()


def _chunk(size: int, n: int, i: int) -> tuple[int, int]:
    """``(length, start)`` of piece ``i`` of ``size`` cut into ``n`` as torch.chunk cuts it."""
    c = -(-size // n)
    start = min(c * i, size)
    return min(c, size - start), start


def chunk_sizes(size: int, ns) -> tuple[int, ...]:
    """Lengths of the pieces of ``size`` cut over axes of sizes ``ns`` (major first), in order.

    Examples:
        >>> chunk_sizes(10, [4]), chunk_sizes(10, [2, 2]), chunk_sizes(3, [4])
        ((3, 3, 3, 1), (3, 2, 3, 2), (1, 1, 1, 0))
    """
    out = [size]
    for n in ns:
        out = [_chunk(s, n, i)[0] for s in out for i in range(n)]
    return tuple(out)


def bind_or_raise(spec, mesh, shape, where: str, *, local: bool = False) -> Layout:
    """Bind ``spec`` for a stored value of ``shape`` on ``mesh``, or raise one SpecError listing
    every problem. ``local=True``: ``shape`` is a block's shape (only said in the message)."""
    layout: Layout | None
    found: tuple[str, ...]
    if isinstance(spec, Layout):
        layout, found = spec, ()
    elif not isinstance(spec, (str, Spec)):
        raise SpecError(
            f'{where}: a spec must be a string like "(dp b) d", got {type(spec).__name__}: {spec!r}'
        )
    else:
        layout, found = bind(spec, tuple(mesh.shape.items()), len(shape))
    problems = list(found)
    if layout is not None and layout.partial:
        problems.append("a partial-sum spec (| sum(...)) describes a shard_map output, not a stored value")
    if problems or layout is None:
        word = "local shape" if local else "shape"
        raise SpecError(
            report(f"{where}: spec {str(spec)!r} for {word} {tuple(shape)} on {mesh!r}", problems)
        )
    return layout
