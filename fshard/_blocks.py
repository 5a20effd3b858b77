"""The layout copies around fshard's block-stacked communication (`_comm`): pure tensor reshapes
that make a collective's operand (``[N, *block]`` blocks, a flat buffer of several tensors) from
the tensors a collective of `_primitives` is given, and its result from what came back.

``tiled`` below is True (concatenate along ``dim``), False (stack in a new ``dim``), or a tuple
of block lengths along ``dim``, one per group index: uneven blocks (torch.chunk's cut, see
Layout.block), exchanged padded to the longest and trimmed after. The coalesced forms take one
``tiled`` for all their tensors, or a tuple of one entry per tensor (``tilings``).
"""

from __future__ import annotations

import math

import torch

from . import _comm, _graph_buckets  # noqa: F401  (_graph_buckets: registers fshard::tile_blocks)
from ._mesh import AxisGroup

_compiling = torch.compiler.is_compiling


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor that is not a view, sharing its storage (no copy).

    An autograd Function's output that is a view of a buffer made inside ``forward`` cannot be
    modified in place ("Output 0 of ... is a view"); the buffer is private, so the output may
    own its storage instead.
    """
    if t._base is None or _compiling():  # traced code has no views to worry about
        return t
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


# -- one tensor ---------------------------------------------------------------------------


def gather_dim(x: torch.Tensor, g: AxisGroup, dim: int, tiled) -> torch.Tensor:
    """All-gather ``x`` along ``dim``: stacked in a new dim, or concatenated when ``tiled``."""
    return _arrange(_comm.all_gather_blocks(gather_operand(x, dim, tiled), g), x.shape, g.size, dim, tiled)


def gather_operand(x: torch.Tensor, dim: int, tiled) -> torch.Tensor:
    """What each rank hands to the all-gather: ``x``, padded to the longest block when uneven."""
    return _pad(x, dim, max(tiled)) if isinstance(tiled, tuple) else x


def _pad(x: torch.Tensor, dim: int, m: int) -> torch.Tensor:
    """``x`` zero-padded at the end of ``dim`` to length ``m``."""
    if x.shape[dim] == m:
        return x
    shape = list(x.shape)
    shape[dim] = m
    out = x.new_zeros(shape)
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


def _arrange(blocks: torch.Tensor, shape, n: int, dim: int, tiled) -> torch.Tensor:
    """Gathered ``[N, *shape]`` blocks (padded to the longest when uneven) as the all_gather
    result along ``dim``."""
    if isinstance(tiled, tuple):
        return torch.cat([blocks[i].narrow(dim, 0, k) for i, k in enumerate(tiled)], dim)
    if not tiled:
        return _owned(blocks.movedim(0, dim))
    if dim and _compiling():  # a copy that inductor leaves as it is (see _graph_buckets)
        return torch.ops.fshard.tile_blocks(blocks, dim)
    out = list(shape)
    out[dim] *= n
    return _owned(blocks.movedim(0, dim).reshape(out))


def split_blocks(x: torch.Tensor, n: int, dim: int, tiled) -> torch.Tensor:
    """``x`` as ``[n, *block]``: block j is the j-th piece of ``dim`` (padded when uneven)."""
    if isinstance(tiled, tuple):
        m = max(tiled)
        return torch.stack([_pad(p, dim, m) for p in x.split(list(tiled), dim)])
    if not tiled:
        return x.movedim(dim, 0)
    shape = list(x.shape)
    shape[dim : dim + 1] = [n, shape[dim] // n]
    return x.reshape(shape).movedim(dim, 0)


def scatter_dim(x: torch.Tensor, g: AxisGroup, dim: int, tiled) -> torch.Tensor:
    """Reduce-scatter ``x`` along ``dim`` (removed, or shrunk by the group size when ``tiled``)."""
    if dim and tiled is True and _compiling():  # as in _arrange
        blocks = torch.ops.fshard.untile_blocks(x, g.size, dim)
    else:
        blocks = split_blocks(x, g.size, dim, tiled)
    return scattered_block(_comm.reduce_scatter_blocks(blocks, g), g, dim, tiled)


def scattered_block(out: torch.Tensor, g: AxisGroup, dim: int, tiled) -> torch.Tensor:
    """A reduce-scatter's block of `split_blocks` as the psum_scatter result (trimmed when uneven)."""
    if isinstance(tiled, tuple) and out.shape[dim] != tiled[g.index]:
        return out.narrow(dim, 0, tiled[g.index]).clone()
    return _owned(out)


def local_block(x: torch.Tensor, g: AxisGroup, dim: int, tiled) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (no communication)."""
    if isinstance(tiled, tuple):
        i = g.index
        return x.narrow(dim, sum(tiled[:i]), tiled[i])
    if not tiled:
        return x.select(dim, g.index)
    s = x.shape[dim] // g.size
    return x.narrow(dim, g.index * s, s)


def a2a_dim(x: torch.Tensor, g: AxisGroup, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Split ``split_dim`` into group-size blocks, exchange them, concatenate along ``concat_dim``."""
    blocks = split_blocks(x, g.size, split_dim, True)
    got = _comm.all_to_all_blocks(blocks, g)  # [N, *block]; row i came from index i
    shape = list(blocks.shape[1:])
    shape[concat_dim] *= g.size
    return _owned(got.movedim(0, concat_dim).reshape(shape))


# -- coalesced forms: n tensors of one dtype, one collective --------------------------------


def _pack(xs) -> torch.Tensor:
    """The tensors ``xs`` (one dtype) flattened into one new contiguous buffer."""
    return torch.cat([x.reshape(-1) for x in xs])


def tilings(tiled, n: int) -> tuple:
    """One ``tiled`` entry per tensor of a coalesced collective: ``tiled`` itself when it is
    one already (a tuple, one entry each), else ``tiled`` n times."""
    return tiled if type(tiled) is tuple else (tiled,) * n


def pick(tiled, idx):
    """The ``tiled`` argument of a coalesced collective of the tensors at ``idx`` only."""
    return tuple(tiled[i] for i in idx) if type(tiled) is tuple else tiled


def pack_operands(xs, dims, tiled) -> torch.Tensor:
    """What each rank hands to a coalesced all-gather: ``xs`` packed, each padded to its
    longest block along its dim where its blocks are uneven."""
    if type(tiled) is not tuple:
        return _pack(xs)
    return _pack([gather_operand(x, d, t) for x, d, t in zip(xs, dims, tiled)])


def _gather_many(xs, g: AxisGroup, dims, tiled):
    """``gather_dim`` of each of ``xs`` (one dtype) along its ``dims`` entry, with one all-gather."""
    blocks = _comm.all_gather_blocks(pack_operands(xs, dims, tiled), g)  # [N, total]; row i from index i
    return tuple(unpack_gathered(blocks, [x.shape for x in xs], dims, tiled))


def unpack_gathered(blocks: torch.Tensor, shapes, dims, tiled) -> list:
    """Gathered ``[N, total]`` rows of packed tensors of ``shapes`` (those given to
    `pack_operands`) as each one's all_gather result along its ``dims`` entry (stacked, or
    concatenated when ``tiled``; uneven blocks trimmed of their padding)."""
    n = blocks.shape[0]
    out = []
    offset = 0
    for shape, dim, t in zip(shapes, dims, tilings(tiled, len(shapes))):
        if type(t) is tuple:  # uneven: the blocks travelled padded to the longest
            shape = list(shape)
            shape[dim] = max(t)
        k = math.prod(shape)
        piece = blocks[:, offset : offset + k].reshape(n, *shape)
        offset += k
        if type(t) is tuple:
            out.append(_arrange(piece, shape, n, dim, t))
            continue
        piece = piece.movedim(0, dim)
        if t:
            full = list(shape)
            full[dim] *= n
            piece = piece.reshape(full)
        out.append(_owned(piece))
    return out


def _scatter_many(xs, g: AxisGroup, dims, tiled):
    """``scatter_dim`` of each of ``xs`` (one dtype) along its ``dims`` entry, with one reduce-scatter."""
    ts = tilings(tiled, len(xs))
    parts = [split_blocks(x, g.size, dim, t) for x, dim, t in zip(xs, dims, ts)]  # [N, *block] each
    buf = torch.cat([p.reshape(g.size, -1) for p in parts], dim=1)  # [N, total]
    mine = _comm.reduce_scatter_blocks(buf, g)  # [total]
    sizes = [p[0].numel() for p in parts]
    return tuple(
        scattered_block(m.view(p.shape[1:]), g, dim, t)
        for m, p, dim, t in zip(mine.split(sizes), parts, dims, ts)
    )
