"""``fs.no_sync`` without gradient buckets: the pending gradients of parameters, as graph ops.

Eager calls keep a parameter's unreduced gradient pending in their gradient buckets
(`_buckets.GradBoundary`); compiled calls, and eager ones with ``bucket_mb=None``, have no buckets
(each replicated input's gradient is all-reduced as the backward reaches its cast), so the cast of
a *leaf* input (a parameter, whose block in ``f`` is the whole tensor) is this module's
`PvaryLeaf` instead, in one of two forms, chosen when the call starts (`mode`; compiled, at trace
time: a guard of the graph):

- ``"defer"`` (a call under ``fs.no_sync``): the backward adds this rank's unreduced gradient to
  the parameter's pending sum (the ``fshard::defer_grad`` op) and gives the parameter nothing
  through this cast; the invariant part of its gradient accumulates in ``p.grad`` as usual.
- ``"take"`` (the first call outside the block, while some gradient is pending): the backward
  all-reduces its gradient plus the pending sum (``fshard::take_grad``), one reduction for all
  the micro-batches, as eager's buckets do.

The pending sums are eager's (`_buckets._PENDING`), so eager and compiled micro-batch steps mix.
A call compiled while nothing is pending has neither form: its graph is the plain one. A
parameter with a pending sum that the compiled ``"take"`` call does not cast (no varying use in
``f``) raises when the call runs (``fshard::pending_unused``): its sum would stay pending.
"""

from __future__ import annotations

import torch

from . import _buckets, _comm, _compile
from ._comm import untracked
from ._errors import FshardError
from ._mesh import AxisGroup
from ._primitives import AllReduce, Pvary, apply

__all__ = ["mode", "Deferred", "PvaryLeaf", "check_used"]

_GROUPS: dict[str, AxisGroup] = {}  # key -> the axis group (kept alive: its key is its id)

_CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def mode() -> str | None:
    """``"defer"`` under fs.no_sync, ``"take"`` outside it while gradients are pending, else None.
    Read at trace time: Dynamo guards the graph on the flags read (not on the pending sums)."""
    if not _buckets._sync:
        return "defer"
    return "take" if _buckets._any_pending else None


@torch._dynamo.assume_constant_result  # under torch.compile: run at trace time, a constant
def _key(mesh, names: tuple) -> str:
    """A key for ``mesh``'s axis group over ``names``, which the ops below find it by."""
    g = mesh.axis_group(names, "pvary")
    key = str(id(g))
    _GROUPS[key] = g
    return key


def _accumulates(leaf: torch.Tensor) -> bool:
    """Whether the running backward accumulates into ``leaf.grad`` (``loss.backward()``) rather than
    returning gradients (``torch.autograd.grad``): only the former may keep a gradient pending."""
    try:
        with torch.enable_grad():  # (the edge of a leaf is found through a view of it)
            node = torch.autograd.graph.get_gradient_edge(leaf).node
    except AttributeError:  # (no edge to ask about, as in a compiled backward: taken as backward())
        return True
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # torch refuses a leaf's node while autograd.grad() runs: gradients are returned
        return False


@torch.library.custom_op("fshard::defer_grad", mutates_args=(), tags=_CUDAGRAPH_UNSAFE)
def _defer_op(leaf: torch.Tensor, ct: torch.Tensor, group: str, what: str) -> None:
    """Add ``ct`` (this rank's unreduced gradient of ``leaf`` over ``group``) to its pending sum."""
    _buckets._add_pending(leaf, _GROUPS[group], ct, what)


@_defer_op.register_fake
def _defer_fake(leaf: torch.Tensor, ct: torch.Tensor, group: str, what: str) -> None:
    return None


@torch.library.custom_op("fshard::take_grad", mutates_args=(), tags=_CUDAGRAPH_UNSAFE)
def _take_op(leaf: torch.Tensor, ct: torch.Tensor, group: str, what: str) -> torch.Tensor:
    """``ct`` plus the pending sum of ``leaf`` (which is dropped)."""
    hit = _buckets._take_pending(leaf, _GROUPS[group], what)
    return ct.clone() if hit is None else ct + hit[1].to(ct.dtype)


@_take_op.register_fake
def _take_fake(leaf: torch.Tensor, ct: torch.Tensor, group: str, what: str) -> torch.Tensor:
    return torch.empty_like(ct)


@torch.library.custom_op("fshard::pending_unused", mutates_args=(), tags=_CUDAGRAPH_UNSAFE)
def _unused_op(leaf: torch.Tensor, what: str) -> None:
    """Raise if ``leaf`` has a pending sum: the compiled call that should reduce it does not."""
    if _buckets._pending_group(leaf) is not None:
        raise FshardError(
            f"fs.no_sync kept the gradient of {what} pending, and this call, the first outside fs.no_sync, "
            f"does not use it with values that vary over a mesh axis, so it cannot reduce it (it is compiled, "
            f"or has bucket_mb=None): call this step eagerly with gradient buckets (bucket_mb, 25 MB by "
            f"default), which reduce every pending gradient"
        )


@_unused_op.register_fake
def _unused_fake(leaf: torch.Tensor, what: str) -> None:
    return None


_DEFER = torch.ops.fshard.defer_grad.default
_TAKE = torch.ops.fshard.take_grad.default
_UNUSED = torch.ops.fshard.pending_unused.default
torch.fx.node.has_side_effect(_DEFER)  # kept by dead-code elimination: they have no users
torch.fx.node.has_side_effect(_UNUSED)


class PvaryLeaf(torch.autograd.Function):
    """`Pvary` of a call's leaf input ``x`` (``leaf`` itself, or an alias of it) under ``mode``."""

    @staticmethod
    def forward(x, leaf, g, mode, key, what):
        with untracked():
            return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, leaf, ctx.g, ctx.mode, ctx.key, ctx.what = inputs
        ctx.save_for_backward(leaf)

    @staticmethod
    def backward(ctx, ct):
        (leaf,) = ctx.saved_tensors
        # create_graph: a differentiable reduction, nothing deferred (as eager's buckets); eager, a
        # backward that returns gradients (torch.autograd.grad) rather than accumulating them: the
        # reduction, as outside fs.no_sync (a compiled backward cannot tell: it defers)
        if torch.is_grad_enabled() or (
            ctx.mode == "defer" and not _compile.compiling() and not _accumulates(leaf)
        ):
            return apply(AllReduce, ct, ctx.g), None, None, None, None, None
        with untracked():  # (the ops out of the tracking mode's way, as every primitive's backward)
            if ctx.mode == "defer":
                _DEFER(leaf, ct, ctx.key, ctx.what)
                return None, None, None, None, None, None
            total = _TAKE(leaf, ct, ctx.key, ctx.what)
        return (
            _comm.all_reduce(total, ctx.g, what=f"the gradient of {ctx.what}"),
            None,
            None,
            None,
            None,
            None,
        )

    @staticmethod
    def jvp(ctx, x_t, *_):  # (forward-mode AD: the cast, as Pvary's; nothing is kept pending)
        return apply(Pvary, x_t, ctx.g)


_compile.hide_jvp([PvaryLeaf])  # as the primitives': torch.compile traces Functions without a jvp
_compile.mark_backward([PvaryLeaf])  # and their backward as backward nodes


class Deferred:
    """A compiled call's leaf input under `mode`: its ``leaf``, key path and the axis group of its
    first cast (whose gradient is the one kept pending; a cast over other axes is reduced at once)."""

    __slots__ = ("leaf", "path", "mode", "group", "name", "mesh")

    def __init__(self, leaf: torch.Tensor, path, mode: str, name: str, mesh):
        self.leaf, self.path, self.mode, self.name, self.mesh = leaf, path, mode, name, mesh
        self.group: AxisGroup | None = None

    def cast(self, x: torch.Tensor, g: AxisGroup, apply, plain):
        if self.group is not None and self.group is not g:
            return apply(plain, x, g)
        self.group = g
        what = f"{self.path} (an input of {self.name})"
        return apply(PvaryLeaf, x, self.leaf, g, self.mode, _key(self.mesh, g.names), what)


def check_used(deferred: list) -> None:
    """In a ``"take"`` call: each leaf input ``f`` did not cast raises when the call runs if it has
    a pending gradient."""
    for d in deferred:
        if d.mode == "take" and d.group is None:
            _UNUSED(d.leaf, f"{d.path} (an input of {d.name})")
