"""Operands' shapes across ranks, for the collectives of a call with uneven blocks.

In a call with an input split unevenly (torch.chunk's blocks), ranks may hold operands of
different shapes. A collective over such operands would fail on some ranks and wait forever
on others; so in such calls every collective first gathers its operands' shapes (one small
all-gather, `_comm.gather_shapes`, which also compares their dtypes) and either raises the same
error on every rank or, for a tiled all_gather of blocks that differ only along the gathered
dim, gathers them unevenly (`uneven_tiling`).
"""

from __future__ import annotations

from . import _comm
from ._errors import CollectiveError

__all__ = ["same_shapes", "uneven_tiling"]


def same_shapes(shapes, g, where: str, paths=None) -> None:
    """A CollectiveError (the same on every rank) when the operands' shapes (at each index of ``g``,
    `_comm.gather_shapes`: one small all-gather) differ across ``g``."""
    if all(s == shapes[0] for s in shapes):
        return
    ax = " ".join(g.names)
    k = next(k for k in range(len(shapes[0])) if any(s[k] != shapes[0][k] for s in shapes))
    held = "; ".join(f"index {i}: {s[k]}" for i, s in enumerate(shapes))
    at = f" at {paths[k]}" if paths else ""
    raise CollectiveError(
        f"fs.{where} over {ax}: the operand{at} has a different shape on different ranks of {ax} ({held}), "
        f"because an input of this call is split unevenly (torch.chunk's blocks); fs.{where} needs the same "
        f"shape on every rank. Pad the blocks to the largest (torch.nn.functional.pad) or reduce them to a "
        f"shape that agrees (e.g. x.sum(0)) first; fs.all_gather(x, axis, dim, tiled=True) (of a tensor or "
        f"a pytree) accepts blocks that differ along dim"
    )


def uneven_tiling(x, g, dim: int, tiled: bool, shapes=None, k: int = 0, path=None):
    """``tiled`` for an all_gather in a call with uneven blocks: the block lengths along ``dim`` when the
    ranks' blocks differ only there (tiled), else ``tiled`` or an error (``shapes``: at each index, a
    pytree's leaves' shapes, gathered once; ``x`` its leaf ``k`` at ``path``)."""
    if shapes is None:
        shapes = _comm.gather_shapes([x], g, None, "fs.all_gather", None if path is None else [path])
    col = [[s[k]] for s in shapes]
    if all(s == col[0] for s in col):
        return tiled
    same_rest = all(
        len(s[0]) == x.dim() and s[0][:dim] + s[0][dim + 1 :] == x.shape[:dim] + x.shape[dim + 1 :]
        for s in col
    )
    if tiled and same_rest:
        return tuple(s[0][dim] for s in col)
    same_shapes(col, g, "all_gather", None if path is None else [path])
    return tiled
