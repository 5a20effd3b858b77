"""Text pictures of layouts: which rank holds which block."""

from __future__ import annotations

import itertools

from ._errors import ArgumentError
from ._layout import bind_or_raise
from ._mesh import Mesh
from ._sharded import Sharded

__all__ = ["visualize"]


def visualize(x: Sharded | str, shape=None, mesh: Mesh | None = None) -> str:
    """Describe which ranks hold which block of a sharded value (no communication).

    Pass a `Sharded` value, or a spec with ``shape=`` and ``mesh=`` to see a layout
    before building it. Blocks are listed as index ranges of the global value, with the
    ranks (and their mesh coordinates) that hold a copy. Uneven blocks (torch.chunk's cut)
    are listed with their shapes.

    Examples:
        >>> print(fs.visualize("(dp b) (tp k)", shape=(8, 6), mesh=fs.Mesh(dp=2, tp=2)))
        (8, 6) as '(dp b) (tp k)' on Mesh(dp=2, tp=2): 4 blocks of (4, 3), 1 copy each
          [0:4, 0:3]  rank 0 (dp=0 tp=0)
          [0:4, 3:6]  rank 1 (dp=0 tp=1)
          [4:8, 0:3]  rank 2 (dp=1 tp=0)
          [4:8, 3:6]  rank 3 (dp=1 tp=1)
    """
    if isinstance(x, Sharded):
        layout, shape, mesh = x.layout, tuple(x.shape), x.mesh
    else:
        if shape is None or mesh is None:
            raise ArgumentError("fs.visualize(spec, shape=..., mesh=...) needs both shape and mesh")
        shape = tuple(shape)
        layout = bind_or_raise(x, mesh, shape, "fs.visualize")
    sizes = mesh.shape
    names = mesh.axis_names
    blocks: dict[tuple, list[tuple[int, dict]]] = {}
    for flat, coord in enumerate(itertools.product(*[range(sizes[n]) for n in names])):
        c = dict(zip(names, coord))
        rng = tuple((start, start + n) for start, n in layout.block(shape, sizes, c))
        blocks.setdefault(rng, []).append((mesh.ranks[flat], c))
    even = layout.is_even(shape, sizes)
    of = f"of {layout.local_shape(shape, sizes)}" if even else "cut as torch.chunk cuts (uneven)"
    copies = mesh.size // len(blocks)
    lines = [
        f"{shape} as {layout.spec_text()!r} on {mesh!r}: {len(blocks)} block{'s' if len(blocks) != 1 else ''} "
        f"{of}, {copies} cop{'ies' if copies != 1 else 'y'} each"
    ]
    for rng, holders in sorted(blocks.items()):
        where = ", ".join(f"rank {r} ({' '.join(f'{k}={v}' for k, v in c.items())})" for r, c in holders)
        size = "" if even else f" {tuple(b - a for a, b in rng)}"
        lines.append(f"  [{', '.join(f'{a}:{b}' for a, b in rng)}]{size}  {where}")
    return "\n".join(lines)
