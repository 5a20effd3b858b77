"""Text pictures of layouts: which rank holds which block."""

from __future__ import annotations

import itertools
import math

from ._mesh import Mesh
from ._sharded import Sharded, _bind_or_raise

__all__ = ["visualize"]


def visualize(x: Sharded | str, shape=None, mesh: Mesh | None = None) -> str:
    """Describe which ranks hold which block of a sharded value (no communication).

    Pass a `Sharded` value, or a spec with ``shape=`` and ``mesh=`` to see a layout
    before building it. Blocks are listed as index ranges of the global value, with the
    ranks (and their mesh coordinates) that hold a copy.

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
            raise TypeError("fs.visualize(spec, shape=..., mesh=...) needs both shape and mesh")
        shape = tuple(shape)
        layout = _bind_or_raise(x, mesh, len(shape), shape, "fs.visualize")
    sizes = mesh.shape
    names = mesh.axis_names
    blocks: dict[tuple, list[tuple[int, dict]]] = {}
    for flat, coord in enumerate(itertools.product(*[range(sizes[n]) for n in names])):
        c = dict(zip(names, coord))
        rng = []
        for d, axes in enumerate(layout.dims):
            n = math.prod(sizes[a] for a in axes)
            idx = 0
            for a in axes:
                idx = idx * sizes[a] + c[a]
            step = shape[d] // n
            rng.append((idx * step, (idx + 1) * step))
        blocks.setdefault(tuple(rng), []).append((mesh._ranks[flat] if mesh._ranks else flat, c))
    local = layout.local_shape(shape, sizes)
    copies = mesh.size // len(blocks)
    lines = [
        f"{shape} as {layout.spec_text()!r} on {mesh!r}: {len(blocks)} block{'s' if len(blocks) != 1 else ''} "
        f"of {tuple(local)}, {copies} cop{'ies' if copies != 1 else 'y'} each"
    ]
    for rng, holders in sorted(blocks.items()):
        where = ", ".join(f"rank {r} ({' '.join(f'{k}={v}' for k, v in c.items())})" for r, c in holders)
        lines.append(f"  [{', '.join(f'{a}:{b}' for a, b in rng)}]  {where}")
    return "\n".join(lines)
