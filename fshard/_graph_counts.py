"""``fs.count_collectives`` for ``fs.compile``'d calls: the collectives of the graph inductor runs.

A compiled call runs no fshard Python, so nothing is counted as it runs unless the graph itself
says so. ``fs.compile`` gives inductor a graph pass (`CountingPass`) that runs after the graph's
autograd split, on the forward and on the backward graph alike:

1. it buckets the graph's all-reduces, all-gathers and reduce-scatters (`_graph_buckets`:
   inductor's grouping, what ``bucket_*_fx`` would do a few passes later, with fshard's packing
   of the all-gather and reduce-scatter buckets; fshard turns those settings off and runs the
   bucketing here, so that what it counts next is what runs);
2. it reads the functional collectives left in the graph: kind, mesh axes (by the process
   group's name), bytes each rank hands in, and how many collectives each bucket merged;
3. it appends one call of the ``fshard::count_collectives`` op, whose argument is that list as a
   string: at run time, under ``fs.count_collectives``, the op adds the list to the counts (and
   does nothing otherwise, one op call per graph run). The list lives in the graph's code, so a
   graph loaded from inductor's cache counts as well. A graph with dynamic shapes (a dim that
   changed between calls) hands in a symbolic number of bytes: the list then says ``$k``, and
   the op receives the size (the element count of the collective's inputs, times their item size)
   as its ``k``-th symbolic argument, computed by the graph as it runs.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch

__all__ = ["CountingPass", "count_op"]

_KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
"""The functional collectives fshard issues (and inductor's bucketed forms), by fshard's kind."""


@torch.library.custom_op(
    "fshard::count_collectives",
    mutates_args=(),
    # its Python must run at every run of the graph: not captured in a CUDA graph (mode=
    # "reduce-overhead" replays the graph around it)
    tags=(torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else (),
)
def _count(token: torch.Tensor, records: str, sizes: list[int]) -> None:
    """Add a compiled graph's collectives (``records``, see `_encode`; ``sizes``: the bytes that
    were symbolic when the graph was compiled, in the order of their ``$k``) to the active counts."""
    from ._counts import _recorders

    if not _recorders:
        return
    wire, combined = _decode(records)
    if sizes:
        wire = [(k, a, sizes[int(n[1:])] if isinstance(n, str) else n) for k, a, n in wire]
    for r in _recorders:
        r.records.extend(wire)
        r.combined.extend(combined)


@_count.register_fake
def _count_fake(token: torch.Tensor, records: str, sizes: list[int]) -> None:
    return None


count_op = torch.ops.fshard.count_collectives.default
torch.fx.node.has_side_effect(count_op)  # kept by dead-code elimination: it has no users


def _encode(wire: list, combined: list) -> str:
    rows = [f"w {k} {','.join(a)} {n}" for k, a, n in wire]
    rows += [f"c {k} {','.join(a)} {n}" for k, a, n in combined]
    return ";".join(rows)


@functools.lru_cache(maxsize=256)
def _decode(records: str) -> tuple[list, list]:
    wire: list = []
    combined: list = []
    for row in records.split(";") if records else ():
        tag, kind, axes, n = row.split(" ")
        (wire if tag == "w" else combined).append(
            (kind, tuple(axes.split(",")), n if n[0] == "$" else int(n))
        )
    return wire, combined


def _bytes(arg: Any) -> Any:
    """The bytes of a collective's inputs (``arg``: a node or a list of them): an int, or a symbolic
    one (a ``torch.SymInt``) in a graph with dynamic shapes."""
    if isinstance(arg, (list, tuple)):
        return sum(_bytes(a) for a in arg)
    val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _symbolic(n: Any) -> bool:
    return isinstance(n, torch.SymInt) and not isinstance(n.node.maybe_as_int(), int)


def _size_node(graph: torch.fx.Graph, arg: Any) -> Any:
    """A node computing the bytes of ``arg`` (a node or a list of them) as the graph runs."""
    if isinstance(arg, (list, tuple)):
        parts = [_size_node(graph, a) for a in arg]
        total = parts[0]
        for p in parts[1:]:
            total = _sym_op(graph, operator.add, total, p)
        return total
    val = arg.meta["val"]
    if not _symbolic(val.numel()):
        return int(val.numel()) * val.element_size()
    numel = graph.call_function(torch.ops.aten.sym_numel.default, (arg,))
    numel.meta["val"] = val.numel()
    return _sym_op(graph, operator.mul, numel, val.element_size())


def _sym_op(graph: torch.fx.Graph, op, a: Any, b: Any) -> Any:
    if not isinstance(a, torch.fx.Node) and not isinstance(b, torch.fx.Node):
        return op(a, b)
    node = graph.call_function(op, (a, b))
    node.meta["val"] = op(*[x.meta["val"] if isinstance(x, torch.fx.Node) else x for x in (a, b)])
    return node


def _collective(node: torch.fx.Node) -> str | None:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "_c10d_functional":
        return None
    return _KINDS.get(target._schema.name.split("::")[-1])


def _group_name(node: torch.fx.Node) -> str | None:
    for a in (*node.args, *node.kwargs.values()):
        if isinstance(a, str) and a in _axes():
            return a
    return None


def _axes() -> dict:
    from ._mesh import GROUP_AXES

    return GROUP_AXES


def _read(graph: torch.fx.Graph) -> list:
    """The graph's collectives: ``(kind, axes, bytes this rank hands in)``."""
    wire: list = []
    names = _axes()
    for node in graph.nodes:
        kind = _collective(node)
        if kind is None:
            continue
        name = _group_name(node)
        axes = names[name] if name is not None else ("?",)
        nbytes = _bytes(node.args[0]) if node.args else 0
        if kind == "all_to_all":  # fs.ppermute compiles as an all-to-all that sends one block
            kind, nbytes = _permute(node, nbytes)
            if kind is None:
                continue
        wire.append((kind, axes, nbytes, node.args[0] if _symbolic(nbytes) else None))
    return wire


def _permute(node: torch.fx.Node, nbytes: int) -> tuple[str | None, int]:
    """An all-to-all with at most one non-empty block each way is fs.ppermute's: the bytes this rank
    sends (fshard counts a ppermute so); one with no block at all is issued by a rank no pair
    involves, which eager does not issue."""
    got, sent = node.args[1], node.args[2]  # (input, output_split_sizes, input_split_sizes, group)
    if not (isinstance(got, (list, tuple)) and isinstance(sent, (list, tuple))):
        return "all_to_all", nbytes
    splits = [s for s in (*got, *sent) if isinstance(s, int)]
    if len(splits) != len(got) + len(sent):
        return "all_to_all", nbytes
    got_n, sent_n = splits[: len(got)], splits[len(got) :]
    if sum(1 for s in sent_n if s) > 1 or sum(1 for s in got_n if s) > 1:
        return "all_to_all", nbytes
    total = sum(sent_n)
    if not total and not any(got_n):
        return None, 0
    return "ppermute", nbytes if total else 0


class CountingPass(torch._inductor.custom_graph_pass.CustomGraphPass):
    """Inductor's post-grad pass of ``fs.compile`` (see the module docstring). ``caps``: the size
    caps (MB, by bucket index) of the all-reduce, all-gather and reduce-scatter buckets, as
    ``bucket_*_fx = "all"`` would bucket with them (None: inductor's default cap); without
    ``caps`` nothing is bucketed. ``user``: a post-grad pass of the caller's, run first."""

    def __init__(self, caps: tuple | None, user=None):
        self.caps = caps
        self.user = user

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.user is not None:
            self.user(graph)
        combined = _bucket(graph, *self.caps) if self.caps is not None else []
        read = _read(graph)
        if not read:
            return
        token = next(n for n in graph.nodes if _collective(n) is not None).args[0]
        if isinstance(token, (list, tuple)):
            token = token[0]
        out = next(n for n in reversed(graph.nodes) if n.op == "output")
        with graph.inserting_before(out):
            sizes: list = []  # the symbolic bytes, computed as the graph runs
            wire = []
            for kind, axes, nbytes, arg in read:
                if arg is not None:
                    nbytes = f"${len(sizes)}"
                    sizes.append(_size_node(graph, arg))
                wire.append((kind, axes, nbytes))
            node = graph.call_function(count_op, (token, _encode(wire, combined), sizes))
            node.meta["val"] = None

    def uuid(self) -> Any:
        user = self.user.uuid() if hasattr(self.user, "uuid") else repr(self.user)
        caps = None if self.caps is None else [getattr(c, "__qualname__", repr(c)) for c in self.caps]
        # the mesh axes of each process group are written into the graph (its count): a graph from
        # inductor's cache compiled where the same group had other axes must not be reused
        return ("fshard.count_collectives", 4, caps, user, sorted(_axes().items()))


def _bucket(graph: torch.fx.Graph, ar_mb, ag_mb, rs_mb) -> list:
    """Bucket the graph's collectives (`_graph_buckets.bucket`); returns ``(kind, axes, calls)``
    of each bucket of several."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    from ._graph_buckets import bucket

    combined: list = []

    def note(kind: str, buckets) -> None:
        for nodes in buckets:
            if len(nodes) > 1:
                name = _group_name(nodes[0])
                combined.append((kind, _axes()[name] if name is not None else ("?",), len(nodes)))

    if bucket(graph, ar_mb, ag_mb, rs_mb, note):
        stable_topological_sort(graph)
    return combined
