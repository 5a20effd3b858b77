"""Binding a parsed spec to a mesh and a tensor rank: the `Layout`.

A layout says, for each tensor dimension, which mesh axes split it (major first), plus the
axes over which the value is an unreduced partial sum. Binding is pure and cached; it
returns problems as strings so that shard_map can report every failure of a call at once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ._errors import did_you_mean
from ._spec import Spec, parse_spec

__all__ = ["Layout", "bind"]


@dataclass(frozen=True)
class Layout:
    """Per-dimension mesh axes (major first), labels, and partial-sum axes."""

    dims: tuple[tuple[str, ...], ...]
    labels: tuple[str | None, ...]
    partial: tuple[str, ...] = ()

    @functools.cached_property
    def split_axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d)

    @property
    def is_split(self) -> bool:
        return bool(self.split_axes)

    def same_placement(self, other: "Layout") -> bool:
        return self.dims == other.dims and self.partial == other.partial

    def local_shape(self, shape, mesh_shape: dict) -> tuple[int, ...]:
        return tuple(s // math.prod(mesh_shape[a] for a in d) for s, d in zip(shape, self.dims))

    def global_shape(self, shape, mesh_shape: dict) -> tuple[int, ...]:
        return tuple(s * math.prod(mesh_shape[a] for a in d) for s, d in zip(shape, self.dims))

    def spec_text(self) -> str:
        parts = []
        for i, (axes, label) in enumerate(zip(self.dims, self.labels)):
            name = label or f"d{i}"
            parts.append(f"({' '.join(axes)} {name})" if axes else name)
        text = " ".join(parts)
        if self.partial:
            text += f" | sum({' '.join(self.partial)})"
        return text

    def __str__(self) -> str:
        return self.spec_text()


@functools.lru_cache(maxsize=4096)
def bind(spec: Spec | str, axis_sizes: tuple[tuple[str, int], ...], ndim: int) -> tuple[Layout | None, tuple[str, ...]]:
    """Bind ``spec`` to a mesh (as ``((name, size), ...)``) for a tensor of ``ndim`` dims.

    Returns ``(layout, problems)``; layout is None when there are problems. Raises
    SpecError for malformed text (from the parser).
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
                    f"mesh axis {a!r} splits both dim {used[a]} and dim {pos}; an axis can split "
                    f"one dim only"
                    if used[a] != pos
                    else f"mesh axis {a!r} appears twice in {written}"
                )
            used.setdefault(a, pos)
        if label is not None:
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
            problems.append(f"sum({a}) names {a!r}, which is not an axis of {mesh_text}{did_you_mean(a, names)}")
        elif a in seen_partial:
            problems.append(f"sum(...) names axis {a!r} twice")
        seen_partial.add(a)
    for i, axes in enumerate(dims):
        part = [a for a in axes if a in seen_partial]
        if part and tuple(axes[len(axes) - len(part) :]) != tuple(part):
            problems.append(
                f"dim {i} is split over {axes} and summed over {tuple(part)}: the summed axes must "
                f"come last in the group so that a reduce-scatter produces the block"
            )
    if problems:
        return None, tuple(problems)
    return Layout(tuple(dims), tuple(labels), tuple(spec.partial)), ()


def divisibility_problems(layout: Layout, shape, mesh_shape: dict) -> list[str]:
    """Problems for dims whose size the product of their axis sizes does not divide."""
    out = []
    for i, (size, axes) in enumerate(zip(shape, layout.dims)):
        if not axes:
            continue
        n = math.prod(mesh_shape[a] for a in axes)
        if size % n:
            over = " and ".join(f"{a} (size {mesh_shape[a]})" for a in axes)
            label = f" ({layout.labels[i]})" if layout.labels[i] else ""
            out.append(
                f"dim {i}{label} of size {size} is split over {over}, and {n} does not divide {size}; "
                f"pad it to {-(-size // n) * n}"
            )
    return out
