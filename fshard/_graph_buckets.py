"""The bucketing of ``fs.compile``'s graphs: per-leaf all-gathers and reduce-scatters merged.

`bucket` groups a post-grad graph's collectives as inductor's ``bucket_*_fx = "all"`` passes do
(the same grouping functions: adjacent collectives of one group and dtype, up to a size cap, none
depending on another of its bucket), and merges each bucket into one collective:

- all-reduces with inductor's merge (a concatenation, one all-reduce, views of its result);
- all-gathers and reduce-scatters with fshard's: the inputs are packed into the bucket, and a
  gathered bucket unpacked into one tensor per leaf, by ops inductor does not generate code for
  (``fshard::bucket_gather_in``, ``fshard::bucket_gather_out``, ``fshard::bucket_scatter_in``;
  what FSDP2 does with ``torch.split_with_sizes_copy``). Inductor's own merge writes those copies
  as graph code, which it fuses into the kernels of the step that first read (or last write)
  each leaf: one large packing kernel, and compute kernels that read their leaves at their own
  offsets into the bucket (so two layers' otherwise equal kernels differ), all compiled with
  gcc on the step's first call. On the demo GPT (2 layers) the compiled fsdp step has 17 C++
  kernels this way, 21 with inductor's merge (benchmarks/RESULTS.md).

``fshard::tile_blocks`` and ``fshard::untile_blocks`` are the layout copies of a tiled all-gather
or reduce-scatter along a dim other than the first (``_primitives``), kept out of the generated
kernels for the same reason.

The values and the collectives on the wire are inductor's merge's: one all-gather per bucket of the
leaves' flat blocks, rank after rank; one reduce-scatter of each rank's blocks side by side.
With a ``bucket_*_bucket_mode`` other than ``"default"`` in inductor's options, inductor's merge
of that mode runs instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["bucket"]

_F = torch.ops._c10d_functional


@torch.library.custom_op("fshard::bucket_gather_in", mutates_args=())
def _gather_in(xs: list[torch.Tensor], world: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """An all-gather bucket: ``world`` slots of the leaves' flat tensors, this rank's filled."""
    sizes = [x.numel() for x in xs]
    total = sum(sizes)
    out = torch.empty(world * total, dtype=dtype, device=xs[0].device)
    slot = out.narrow(0, rank * total, total)
    if all(x.dtype == dtype for x in xs):
        torch.cat([x.reshape(-1) for x in xs], out=slot)
    else:
        for dst, x in zip(slot.split(sizes), xs):
            dst.copy_(x.reshape(-1))
    return out


@_gather_in.register_fake
def _gather_in_fake(xs: list[torch.Tensor], world: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(world * sum(x.numel() for x in xs), dtype=dtype, device=xs[0].device)


@torch.library.custom_op("fshard::bucket_gather_out", mutates_args=())
def _gather_out(got: torch.Tensor, world: int, sizes: list[int]) -> list[torch.Tensor]:
    """A gathered bucket as one flat tensor per leaf: its ``world`` blocks, rank after rank (what
    the leaf's own all-gather returns)."""
    outs = [got.new_empty(world * n) for n in sizes]
    torch.split_with_sizes_copy(
        got.view(world, -1), sizes, dim=1, out=[o.view(world, n) for o, n in zip(outs, sizes)]
    )
    return outs


@_gather_out.register_fake
def _gather_out_fake(got: torch.Tensor, world: int, sizes: list[int]) -> list[torch.Tensor]:
    return [got.new_empty(world * n) for n in sizes]


@torch.library.custom_op("fshard::bucket_scatter_in", mutates_args=())
def _scatter_in(xs: list[torch.Tensor], world: int) -> torch.Tensor:
    """A reduce-scatter bucket: rank ``r``'s block of every leaf, side by side, rank after rank."""
    total = sum(x.numel() for x in xs)
    out = xs[0].new_empty(total)
    torch.cat([x.reshape(world, -1) for x in xs], dim=1, out=out.view(world, -1))
    return out


@_scatter_in.register_fake
def _scatter_in_fake(xs: list[torch.Tensor], world: int) -> torch.Tensor:
    return xs[0].new_empty(sum(x.numel() for x in xs))


def _gather_merged(ins: list[torch.Tensor], group: Any, world: int, rank: int, dtype: torch.dtype) -> list:
    """The traced body of a merged all-gather bucket (``ins``: each leaf's flat block)."""
    sizes = [x.numel() for x in ins]
    total = sum(sizes)
    buf = torch.ops.fshard.bucket_gather_in(ins, world, rank, dtype)
    got = _F.wait_tensor(
        _F.all_gather_into_tensor_out(buf.narrow(0, rank * total, total), world, group, out=buf)
    )
    return list(torch.ops.fshard.bucket_gather_out(got, world, sizes))


def _scatter_merged(ins: list[torch.Tensor], group: Any, world: int, op: str) -> list:
    """The traced body of a merged reduce-scatter bucket (``ins``: each leaf's ``world`` blocks)."""
    packed = torch.ops.fshard.bucket_scatter_in(ins, world)
    got = _F.wait_tensor(_F.reduce_scatter_tensor(packed, op, world, group))
    return [
        p.view(x.shape[0] // world, *x.shape[1:])
        for p, x in zip(got.split([x.numel() // world for x in ins]), ins)
    ]


def _merge(graph: torch.fx.Graph, nodes: list, kind: str) -> None:
    """Replace the collectives ``nodes`` (one bucket) and their waits by fshard's merged form."""
    import torch.distributed as dist
    from torch._inductor.fx_passes import bucketing as b
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.utils._pytree import tree_map

    group = nodes[0].args[-1]
    group_val = group.meta["val"] if isinstance(group, torch.fx.Node) else group
    extra = [group] if isinstance(group, torch.fx.Node) else None
    fn: Callable[..., list]
    rest: tuple
    if kind == "all_gather":
        world = nodes[0].args[1]
        rank = dist.get_rank(_resolve_process_group(b._resolve_group_name(group)))
        dtype = nodes[0].meta["val"].dtype
        fn, rest = _gather_merged, (group_val, world, rank, dtype)
    else:
        _, op, world, _ = nodes[0].args
        fn, rest = _scatter_merged, (group_val, world, op)

    def trace_args(ins: list) -> tuple:
        return (tree_map(lambda n: n.meta["val"], ins), *rest)

    b.process_collective_bucket(graph, nodes, fn, trace_args, extra_graph_inps=extra)


def bucket(graph: torch.fx.Graph, ar_mb, ag_mb, rs_mb, note) -> bool:
    """Bucket the graph's collectives (caps in MB by bucket index; None: inductor's default);
    ``note(kind, buckets)`` is told each kind's buckets. Returns whether anything was merged."""
    from torch._inductor import config
    from torch._inductor.fx_passes import bucketing as b

    default = b.bucket_cap_mb_by_bucket_idx_default
    gm = graph.owning_module
    assert gm is not None, "inductor's post-grad graphs belong to a GraphModule"
    rs_mode = config.bucket_reduce_scatters_bucket_mode
    rs = b.bucket_reduce_scatter_by_mb(gm, rs_mb or default, None, rs_mode)
    if rs:
        note("reduce_scatter", rs)
        if rs_mode == "default":
            for nodes in rs:
                _merge(graph, nodes, "reduce_scatter")
        else:
            b.merge_reduce_scatter(gm, rs, rs_mode)
    ar = b.bucket_all_reduce_by_mb(gm, ar_mb or default)
    note("all_reduce", ar)
    for nodes in ar:
        b.merge_all_reduce_bucket(graph, nodes, "all")
    ag_mode = config.bucket_all_gathers_bucket_mode
    ag = b.bucket_all_gather_by_mb(gm, ag_mb or default, None, ag_mode)
    if ag:
        note("all_gather", ag)
        if ag_mode == "default":
            for nodes in ag:
                _merge(graph, nodes, "all_gather")
        else:
            b.merge_all_gather(gm, ag, ag_mode)
    return bool(rs or ar or ag)


@torch.library.custom_op("fshard::tile_blocks", mutates_args=())
def _tile_blocks(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """Gathered ``[n, *shape]`` blocks concatenated along ``dim`` (a tiled all-gather's result
    along a dim other than the first), in a new tensor."""
    shape = list(blocks.shape[1:])
    shape[dim] *= blocks.shape[0]
    out = blocks.new_empty(shape)
    out.view(*blocks.shape[1 : dim + 1], blocks.shape[0], *blocks.shape[dim + 1 :]).copy_(
        blocks.movedim(0, dim)
    )
    return out


@_tile_blocks.register_fake
def _tile_blocks_fake(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(blocks.shape[1:])
    shape[dim] *= blocks.shape[0]
    return blocks.new_empty(shape)


@torch.library.custom_op("fshard::untile_blocks", mutates_args=())
def _untile_blocks(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``x`` cut into ``n`` blocks along ``dim`` (not the first), as ``[n, *block]`` in a new
    tensor: what a tiled reduce-scatter along ``dim`` hands in."""
    shape = list(x.shape)
    shape[dim : dim + 1] = [n, shape[dim] // n]
    out = x.new_empty([n, *shape[:dim], *shape[dim + 1 :]])
    out.copy_(x.reshape(shape).movedim(dim, 0))
    return out


@_untile_blocks.register_fake
def _untile_blocks_fake(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] //= n
    return x.new_empty([n, *shape])
