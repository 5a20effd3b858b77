"""The differentiable communication primitives: one ``torch.autograd.Function`` per collective.

Each Function's ``backward`` is its transpose, written in terms of the other Functions here, so
adding a collective with its transpose touches this file (plus the public wrapper in
``_collectives.py`` and ``__init__``). The module depends only on the communication layer
(``_comm``): varying-axes tracking (``_vma``) and the public collectives build on it.

=====================  ==============================  ===================================
Function               forward                         backward (transpose)
=====================  ==============================  ===================================
Pvary                  identity                        AllReduce (psum), no-op if unused
AllReduce              all-reduce (psum)               Pvary: identity, no communication
AllGather              all-gather                      ReduceScatter
AllGatherInvariant     all-gather to an invariant      LocalSlice: no communication
LocalSlice             this rank's block               AllGatherInvariant
ReduceScatter          reduce-scatter                  AllGather
AllToAll               all-to-all                      AllToAll, split and concat swapped
PPermute               point-to-point pairs            PPermute with the pairs reversed
Broadcast              broadcast from one index        cotangent kept on the source only
Extremum               all-reduce max / min            to the ranks holding the extremum,
                                                       split evenly among ties
AllReduceCoalesced     one all-reduce of n tensors     Pvary of each: no communication
AllGatherCoalesced     one all-gather of n tensors     ReduceScatterCoalesced (or the local
                                                       slices, for an invariant result)
ReduceScatterCoalesced one reduce-scatter of n         AllGatherCoalesced
=====================  ==============================  ===================================

The coalesced Functions serve the pytree forms of the collectives: n tensors of one dtype are
packed into one flat buffer, moved with one collective and unpacked (`_blocks`: uneven blocks
padded to the longest, each tensor with its own ``tiled`` entry).

Every Function has a separate ``setup_context``, so ``loss.backward()``,
``torch.autograd.grad``, ``torch.func.grad`` and ``torch.func.vjp`` all pass through. Outputs
are never views of buffers made inside ``forward``, so users may update them in place.

The other torch.func transforms go through two more staticmethods per Function. ``jvp``, the
forward-mode rule: the collectives are linear, so the tangent goes through the same Function
(pmax / pmin: `AllReduce` of the tangent of the selected element, averaged among ties as the
backward splits the cotangent). A rule, and a backward, that may itself be differentiated (a
reverse pass over a tangent: ``jacrev(jacfwd(f))``; a double backward) applies Functions, never
bare communication, views or slices, so that the outer pass finds each step's transpose. ``vmap``, the batching rule: the batch dim moves to
the front, the collective's ``dim`` (``split_dim``, ``concat_dim``) shifts past it, and one
collective moves the whole batch (in a call with uneven blocks, once the ranks agree on its size:
`same_batch`). So ``vmap``, ``jvp``, ``jacrev``, ``jacfwd`` and ``hessian``
compose with shard_map, of it and inside it.
"""

from __future__ import annotations

import functools

import torch

from . import _comm, _compile
from ._blocks import (
    _arrange,
    _gather_many,
    _owned,
    _pack,
    _scatter_many,
    a2a_dim,
    gather_dim,
    gather_operand,
    local_block,
    pack_operands,
    pick,
    scatter_dim,
    scattered_block,
    split_blocks,
    tilings,
    unpack_gathered,
)
from ._comm import untracked
from ._errors import CollectiveError
from ._mesh import AxisGroup
from ._scalars import _stack as _traces

__all__ = [
    "apply",
    "Pvary",
    "PvaryInput",
    "AllReduce",
    "AllGather",
    "AllGatherInvariant",
    "LocalSlice",
    "ReduceScatter",
    "AllToAll",
    "PPermute",
    "Broadcast",
    "Extremum",
    "AllReduceCoalesced",
    "AllGatherCoalesced",
    "ReduceScatterCoalesced",
    "PPermuteDone",
    "AllGatherDone",
    "ReduceScatterDone",
    "split_blocks",
    "gather_dim",
    "gather_operand",
    "unpack_gathered",
    "pack_operands",
    "tilings",
    "pick",
    "scatter_dim",
    "scattered_block",
    "local_block",
    "invariant_slice",
    "a2a_dim",
]

_FUNCTION_APPLY = torch._C._FunctionBase.__dict__["apply"]
_functorch_active = torch._C._are_functorch_transforms_active
_functorch_level = torch._C._functorch.maybe_current_level
_compiling = torch.compiler.is_compiling


def apply(cls, *args):
    """``cls.apply(*args)`` without the ``inspect.signature`` call that ``Function.apply`` makes
    for setup_context-style Functions (about 13 us each); the full path under torch.func and
    while torch.compile traces (Dynamo traces ``Function.apply``, not the fast path)."""
    if _functorch_active():
        return cls.apply(*args)
    if _compiling():
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return cls.apply(*args)
        # nothing to differentiate (a transpose's own collective, in a backward): the forward, as
        # apply runs it; Dynamo would pass a varargs forward a ctx in front of its arguments
        with torch.no_grad():
            return cls.forward(*args)
    return _FUNCTION_APPLY.__get__(None, cls)(*args)


def _untracked(fn):
    """Run an autograd-Function body with shard_map's tracking mode out of the way."""

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        with untracked():
            return fn(*args, **kwargs)

    return inner


def _front(x, bdim):
    """A vmap rule's operand with its batch dim first (``None``: not batched, as is)."""
    return x if not bdim else x.movedim(bdim, 0)


def _psum_values(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """The all-reduce of ``x`` inside a transpose or a forward-mode rule: through `AllReduce`
    under torch.func transforms (``x`` may be batched), else directly."""
    if _functorch_active():
        return apply(AllReduce, x, g)
    return _comm.all_reduce(x, g)


# what a batched collective is, for its error (`same_batch`): the Function's communication, by the
# public functions (and the rules) that apply it
_REDUCE = "all_reduce (fs.psum, fs.pmean, fs.pmax, fs.pmin, or a gradient's sum over the ranks)"
_GATHER = "all_gather (fs.all_gather, or the gradient of fs.psum_scatter)"
_SCATTER = "reduce_scatter (fs.psum_scatter, or the gradient of fs.all_gather)"
_MOVES = {
    "AllReduce": _REDUCE,
    "AllReduceCoalesced": _REDUCE,
    "Extremum": _REDUCE,
    "AllGather": _GATHER,
    "AllGatherInvariant": _GATHER,
    "AllGatherCoalesced": _GATHER,
    "ReduceScatter": _SCATTER,
    "ReduceScatterCoalesced": _SCATTER,
    "AllToAll": "all_to_all (fs.all_to_all)",
    "PPermute": "ppermute (fs.ppermute)",
    "Broadcast": "broadcast (fs.pbroadcast)",
}


def same_batch(info, g: AxisGroup, cls, device) -> None:
    """A batching rule's check, in a call with uneven blocks: the vmap batch (``info.batch_size``) has
    the same size at every index of ``g``, or the same CollectiveError is raised on every rank.

    One collective moves the whole batch, element ``i`` of every rank together, so the batch must
    agree as the operands' shapes do. The public collectives compare those (`_comm.gather_shapes`),
    but under the batching wrapper they see one element's shape, and the batch of a tangent
    (``jacfwd`` with respect to a split input) or of a cotangent (``jacrev`` of a split output) is
    not on the operand at all: only the rule sees it. A batch made from a split dim differs where
    the blocks do; sent as it is, the collective ends gloo (sizes that differ) or waits forever.

    The sizes travel over ``g``'s axes and every other axis along which the call's ranks run the
    same code (not those of a branch on a varying value, `_scalars.taint`, nor of a running
    `fs.switch` index): a rank whose own group agrees still raises when another group of the same
    collective does not, instead of waiting for that group's ranks in its next collective. Even
    calls skip the check (their batches come from shapes that agree), and so does a vmap entered
    outside ``f``; the others pay one small all-gather per batched collective."""
    tr = _traces[-1] if _traces else None
    if g.size == 1 or tr is None or not tr.uneven:
        return
    below = _functorch_level()  # the level under this rule's vmap (the rule runs with it popped)
    if tr.level is not None and (below is None or below < tr.level):
        return  # a vmap entered outside f: its batch came from global values, the same everywhere
    mesh, apart = tr.mesh, tr.mesh.names_of(tr.taint | tr.branch)
    wide = tuple(a for a in mesh.axis_names if a in g.names or a not in apart)
    others = [a for a in wide if a not in g.names]  # which group of g a rank is in
    mine = [info.batch_size, g.index, *(mesh.coordinate[a] for a in others)]
    with untracked():
        rows = _comm.all_gather_blocks(torch.tensor(mine, device=device), mesh.axis_group(wide)).tolist()
    groups: dict = {}
    for n, i, *at in rows:
        groups.setdefault(tuple(at), {})[i] = n
    bad = next(((at, sizes) for at, sizes in groups.items() if len(set(sizes.values())) > 1), None)
    if bad is None:
        return
    ax = " ".join(g.names)
    where = ", ".join(f"{a}={c}" for a, c in zip(others, bad[0]))
    held = ("where " + where + ": " if where else "") + "; ".join(
        f"index {i}: {n}" for i, n in sorted(bad[1].items())
    )
    raise CollectiveError(
        f"{_MOVES[cls.__name__]} over {ax} under torch.func.vmap: the batch has a different size on different "
        f"ranks of {ax} ({held}), because an input of this call is split unevenly (torch.chunk's blocks) and "
        f"the batch was made from a split dim: vmap over it, jacfwd or hessian with respect to a split input, "
        f"or jacrev of a split output (their batch is that input's or output's size). One collective moves "
        f"the whole batch, element i of every rank together, so every rank of {ax} must map as many. vmap "
        f"over a dim that is not split unevenly; differentiate with respect to a split input by jacrev or "
        f"grad of a replicated (e.g. psum'd) result; or apply the transform from outside, to the shard_map'd "
        f"function (torch.func.jacfwd(fs.shard_map(f, ...)) is the global function's Jacobian)"
    )


def invariant_slice(ct: torch.Tensor, g: AxisGroup, dim: int, tiled) -> torch.Tensor:
    """This rank's block of the cotangent of an invariant all_gather; `LocalSlice` when differentiated
    (a plain slice would transpose to this rank's block padded with zeros, not the gather)."""
    if torch.is_grad_enabled() or _functorch_active():
        return apply(LocalSlice, ct, g, dim, tiled)
    return local_block(ct, g, dim, tiled)


# -- autograd Functions -------------------------------------------------------------------


class Pvary(torch.autograd.Function):
    """Identity forward; the backward sums the cotangent over the newly varying axes."""

    @staticmethod
    def forward(x, g):
        with untracked():
            return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g = inputs[1]

    @staticmethod
    def backward(ctx, ct):
        if torch.is_grad_enabled() or _functorch_active():  # double backward, or ct batched
            return apply(AllReduce, ct, ctx.g), None
        return _comm.all_reduce(ct, ctx.g), None

    @staticmethod
    def jvp(ctx, x_t, _):  # the tangent is cast as the primal is: a reverse pass over it sums
        return apply(Pvary, x_t, ctx.g)

    @staticmethod
    def vmap(info, in_dims, x, g):
        return apply(Pvary, x, g), in_dims[0]


class PvaryInput(torch.autograd.Function):
    """`Pvary` of a shard_map input outside the gradient buckets (``bucket_mb=0``): the backward's all-reduce
    carries the input's key path in its tags (ranks whose ``f`` used different inputs raise, not sum them)."""

    @staticmethod
    def forward(x, g, path):
        with untracked():
            return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g, ctx.path = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, ct):
        if torch.is_grad_enabled() or _functorch_active():  # double backward, or ct batched: as Pvary's
            return apply(AllReduce, ct, ctx.g), None, None
        return _comm.all_reduce(ct, ctx.g, what=f"the gradient of {ctx.path}"), None, None

    @staticmethod
    def jvp(ctx, x_t, *_):  # (forward-mode AD outside torch.func: the cast, as Pvary's)
        return apply(Pvary, x_t, ctx.g)


class AllReduce(torch.autograd.Function):
    """psum: all-reduce forward; the transpose is pvary (identity, whose own transpose is psum)."""

    @staticmethod
    @_untracked
    def forward(x, g):
        return _comm.all_reduce(x, g)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g = inputs[1]

    @staticmethod
    def backward(ctx, ct):
        if torch.is_grad_enabled() or _functorch_active():  # differentiated: the pvary transposes to psum
            return apply(Pvary, ct, ctx.g), None
        return ct, None

    @staticmethod
    def jvp(ctx, x_t, _):  # linear: the tangent goes through the same collective
        return apply(AllReduce, x_t, ctx.g)

    @staticmethod
    def vmap(info, in_dims, x, g):  # elementwise: one all-reduce of the whole batch
        same_batch(info, g, AllReduce, x.device)
        return apply(AllReduce, x, g), in_dims[0]


class AllGather(torch.autograd.Function):
    """all_gather of a varying value; the transpose is a reduce-scatter (the FSDP pattern)."""

    @staticmethod
    @_untracked
    def forward(x, g, dim, tiled):
        return gather_dim(x, g, dim, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        return apply(ReduceScatter, ct, *ctx.args), None, None, None

    @staticmethod
    @_untracked
    def jvp(ctx, x_t, *_):
        return apply(AllGather, x_t, *ctx.args)

    @staticmethod
    @_untracked
    def vmap(info, in_dims, x, g, dim, tiled):  # the batch dim first, ``dim`` after it
        same_batch(info, g, AllGather, x.device)
        return apply(AllGather, _front(x, in_dims[0]), g, dim + 1, tiled), 0


class AllGatherInvariant(torch.autograd.Function):
    """all_gather whose result is invariant; the transpose is this rank's slice (no communication)."""

    @staticmethod
    @_untracked
    def forward(x, g, dim, tiled):
        return gather_dim(x, g, dim, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        return invariant_slice(ct, *ctx.args), None, None, None

    @staticmethod
    @_untracked
    def jvp(ctx, x_t, *_):
        return apply(AllGatherInvariant, x_t, *ctx.args)

    @staticmethod
    @_untracked
    def vmap(info, in_dims, x, g, dim, tiled):  # the batch dim first, ``dim`` after it
        same_batch(info, g, AllGatherInvariant, x.device)
        return apply(AllGatherInvariant, _front(x, in_dims[0]), g, dim + 1, tiled), 0


class LocalSlice(torch.autograd.Function):
    """This rank's block of an invariant value (no communication); gradient: all_gather."""

    @staticmethod
    @_untracked
    def forward(x, g, dim, tiled):
        return local_block(x, g, dim, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        return apply(AllGatherInvariant, ct, *ctx.args), None, None, None

    @staticmethod
    @_untracked
    def jvp(ctx, x_t, *_):  # the slice with its transpose: a reverse pass over the tangent gathers
        return apply(LocalSlice, x_t, *ctx.args)

    @staticmethod
    @_untracked
    def vmap(info, in_dims, x, g, dim, tiled):  # the batch dim first, ``dim`` after it
        return apply(LocalSlice, _front(x, in_dims[0]), g, dim + 1, tiled), 0


class ReduceScatter(torch.autograd.Function):
    """psum_scatter; the transpose is an all-gather."""

    @staticmethod
    @_untracked
    def forward(x, g, dim, tiled):
        return scatter_dim(x, g, dim, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        return apply(AllGather, ct, *ctx.args), None, None, None

    @staticmethod
    @_untracked
    def jvp(ctx, x_t, *_):
        return apply(ReduceScatter, x_t, *ctx.args)

    @staticmethod
    @_untracked
    def vmap(info, in_dims, x, g, dim, tiled):  # the batch dim first, ``dim`` after it
        same_batch(info, g, ReduceScatter, x.device)
        return apply(ReduceScatter, _front(x, in_dims[0]), g, dim + 1, tiled), 0


class AllToAll(torch.autograd.Function):
    """all_to_all; the transpose is the all_to_all with split and concat dims swapped."""

    @staticmethod
    @_untracked
    def forward(x, g, split_dim, concat_dim):
        return a2a_dim(x, g, split_dim, concat_dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        g, split_dim, concat_dim = ctx.args
        return apply(AllToAll, ct, g, concat_dim, split_dim), None, None, None

    @staticmethod
    @_untracked
    def jvp(ctx, x_t, *_):
        return apply(AllToAll, x_t, *ctx.args)

    @staticmethod
    @_untracked
    def vmap(info, in_dims, x, g, split_dim, concat_dim):
        same_batch(info, g, AllToAll, x.device)
        return apply(AllToAll, _front(x, in_dims[0]), g, split_dim + 1, concat_dim + 1), 0


class PPermute(torch.autograd.Function):
    """ppermute by (source, destination) pairs; the transpose reverses the pairs."""

    @staticmethod
    @_untracked
    def forward(x, g, perm):
        return _owned(_comm.permute(x, g, perm))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g, ctx.perm = inputs[1:]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        inverse = tuple((d, s) for s, d in ctx.perm)
        return apply(PPermute, ct, ctx.g, inverse), None, None

    @staticmethod
    @_untracked
    def jvp(ctx, x_t, *_):
        return apply(PPermute, x_t, ctx.g, ctx.perm)

    @staticmethod
    @_untracked
    def vmap(info, in_dims, x, g, perm):
        same_batch(info, g, PPermute, x.device)
        return apply(PPermute, x, g, perm), in_dims[0]


class Broadcast(torch.autograd.Function):
    """pbroadcast from index ``src``; the cotangent stays on the source, others get zeros."""

    @staticmethod
    @_untracked
    def forward(x, g, src):
        return _comm.broadcast(x, g, src)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g, ctx.src = inputs[1:]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        if torch.is_grad_enabled() or _functorch_active():  # differentiated: ct is invariant, so cast,
            ct = apply(Pvary, ct, ctx.g)  # and zeroed in the graph (the cast's transpose on every rank)
            return ct.masked_fill(torch.tensor(ctx.g.index != ctx.src, device=ct.device), 0), None, None
        return (ct if ctx.g.index == ctx.src else torch.zeros_like(ct)), None, None

    @staticmethod
    @_untracked
    def jvp(ctx, x_t, *_):
        return apply(Broadcast, x_t, ctx.g, ctx.src)

    @staticmethod
    @_untracked
    def vmap(info, in_dims, x, g, src):
        same_batch(info, g, Broadcast, x.device)
        return apply(Broadcast, x, g, src), in_dims[0]


class Extremum(torch.autograd.Function):
    """pmax / pmin; the cotangent goes to the ranks holding the extremum, split among ties."""

    @staticmethod
    @_untracked
    def forward(x, g, op):  # (owned: the max may be a view of the buffer its NaN marks rode in)
        return _owned(_comm.all_reduce(x, g, op))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g = inputs[1]
        ctx.save_for_backward(inputs[0], output)
        ctx.save_for_forward(inputs[0], output)

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        x, y = ctx.saved_tensors
        hit = (x == y).to(ct.dtype)
        ties = _psum_values(hit, ctx.g)
        if torch.is_grad_enabled() or _functorch_active():  # differentiable: ct is invariant
            ct = apply(Pvary, ct, ctx.g)
        return ct * hit / ties, None, None

    @staticmethod
    @_untracked
    def jvp(ctx, x_t, *_):  # the tangent of the selected element, averaged among ties
        x, y = ctx.saved_tensors
        hit = (x == y).to(x_t.dtype)
        return apply(AllReduce, x_t * hit / _psum_values(hit, ctx.g), ctx.g)

    @staticmethod
    @_untracked
    def vmap(info, in_dims, x, g, op):
        same_batch(info, g, Extremum, x.device)
        return apply(Extremum, x, g, op), in_dims[0]


# -- coalesced forms: n tensors of one dtype, one collective --------------------------------


class AllReduceCoalesced(torch.autograd.Function):
    """psum of n tensors with one all-reduce; the transpose is pvary of each (no communication)."""

    @staticmethod
    @_untracked
    def forward(g, *xs):
        buf = _pack(xs)
        _comm.all_reduce_(buf, g)
        return tuple(_owned(p.view(x.shape)) for p, x in zip(buf.split([x.numel() for x in xs]), xs))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g = inputs[0]

    @staticmethod
    def backward(ctx, *cts):
        if torch.is_grad_enabled() or _functorch_active():  # differentiated: the pvary transposes to psum
            return (None, *(apply(Pvary, ct, ctx.g) for ct in cts))
        return (None, *cts)

    @staticmethod
    @_untracked
    def jvp(ctx, _, *ts):
        have = [i for i, t in enumerate(ts) if t is not None]
        out: list = [None] * len(ts)
        if have:
            for i, t in zip(have, apply(AllReduceCoalesced, ctx.g, *(ts[i] for i in have))):
                out[i] = t
        return tuple(out)

    @staticmethod
    @_untracked
    def vmap(info, in_dims, g, *xs):  # batched and unbatched operands in one all-reduce
        same_batch(info, g, AllReduceCoalesced, xs[0].device)
        return apply(AllReduceCoalesced, g, *xs), tuple(in_dims[1:])


class AllGatherCoalesced(torch.autograd.Function):
    """all_gather of n tensors with one all-gather; ``dims`` has one (normalized) dim per tensor.

    The transpose is one coalesced reduce-scatter, or, for an ``invariant`` result, each
    tensor's local slice (no communication), as for `AllGather` and `AllGatherInvariant`.
    """

    @staticmethod
    @_untracked
    def forward(g, dims, tiled, invariant, *xs):
        return _gather_many(xs, g, dims, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[:4]

    @staticmethod
    @_untracked
    def backward(ctx, *cts):
        g, dims, tiled, invariant = ctx.args
        if invariant:
            grads = tuple(
                invariant_slice(ct, g, d, t) for ct, d, t in zip(cts, dims, tilings(tiled, len(cts)))
            )
        else:
            grads = apply(ReduceScatterCoalesced, g, dims, tiled, *cts)
        return (None, None, None, None, *grads)

    @staticmethod
    @_untracked
    def jvp(ctx, _g, _d, _t, _i, *ts):
        g, dims, tiled, invariant = ctx.args
        return _coalesced_jvp(
            AllGatherCoalesced, ts, lambda i: (g, tuple(dims[k] for k in i), pick(tiled, i), invariant)
        )

    @staticmethod
    @_untracked
    def vmap(info, in_dims, g, dims, tiled, invariant, *xs):
        same_batch(info, g, AllGatherCoalesced, xs[0].device)
        bdims = in_dims[4:]
        xs, dims = _coalesced_front(xs, dims, bdims)
        return apply(AllGatherCoalesced, g, dims, tiled, invariant, *xs), _coalesced_out(bdims)


class ReduceScatterCoalesced(torch.autograd.Function):
    """psum_scatter of n tensors with one reduce-scatter; the transpose is `AllGatherCoalesced`."""

    @staticmethod
    @_untracked
    def forward(g, dims, tiled, *xs):
        return _scatter_many(xs, g, dims, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[:3]

    @staticmethod
    @_untracked
    def backward(ctx, *cts):
        g, dims, tiled = ctx.args
        return (None, None, None, *apply(AllGatherCoalesced, g, dims, tiled, False, *cts))

    @staticmethod
    @_untracked
    def jvp(ctx, _g, _d, _t, *ts):
        g, dims, tiled = ctx.args
        return _coalesced_jvp(
            ReduceScatterCoalesced, ts, lambda i: (g, tuple(dims[k] for k in i), pick(tiled, i))
        )

    @staticmethod
    @_untracked
    def vmap(info, in_dims, g, dims, tiled, *xs):
        same_batch(info, g, ReduceScatterCoalesced, xs[0].device)
        bdims = in_dims[3:]
        xs, dims = _coalesced_front(xs, dims, bdims)
        return apply(ReduceScatterCoalesced, g, dims, tiled, *xs), _coalesced_out(bdims)


def _coalesced_jvp(cls, ts, head):
    """The tangents of a coalesced gather or scatter: the same collective of those given
    (``None``: no tangent, for inputs that are not dual; ``head(indices)``: its arguments)."""
    have = [i for i, t in enumerate(ts) if t is not None]
    out: list = [None] * len(ts)
    if have:
        ys = apply(cls, *head(have), *(ts[i] for i in have))
        for i, y in zip(have, ys):
            out[i] = y
    return tuple(out)


def _coalesced_front(xs, dims, bdims):
    """Operands of a batched coalesced gather or scatter with their batch dims first, and the
    collective's dims shifted past them (unbatched operands as they are)."""
    xs = tuple(_front(x, b) for x, b in zip(xs, bdims))
    return xs, tuple(d if b is None else d + 1 for d, b in zip(dims, bdims))


def _coalesced_out(bdims) -> tuple:
    return tuple(None if b is None else 0 for b in bdims)


# -- the ends of asynchronous collectives (``async_op=True``) ------------------------------
#
# The communication was started by a ``_comm.*_start`` function and is carried by ``handle``;
# forward waits for it. The transposes and the forward-mode rules are the synchronous collectives
# above. Under torch.func transforms the public collectives run synchronously (a started
# collective cannot be batched after the fact), so these Functions need no batching rule.


class PPermuteDone(torch.autograd.Function):
    """The end of an asynchronous ppermute; the transpose reverses the pairs."""

    @staticmethod
    @_untracked
    def forward(x, g, perm, handle):
        return _owned(handle.wait())

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g, ctx.perm = inputs[1], inputs[2]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        inverse = tuple((d, s) for s, d in ctx.perm)
        return apply(PPermute, ct, ctx.g, inverse), None, None, None

    @staticmethod
    @_untracked
    def jvp(ctx, x_t, *_):
        return apply(PPermute, x_t, ctx.g, ctx.perm)


class AllGatherDone(torch.autograd.Function):
    """The end of an asynchronous all_gather; the transpose is a reduce-scatter."""

    @staticmethod
    @_untracked
    def forward(x, g, dim, tiled, handle):
        return _arrange(handle.wait(), x.shape, g.size, dim, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:4]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        return apply(ReduceScatter, ct, *ctx.args), None, None, None, None

    @staticmethod
    @_untracked
    def jvp(ctx, x_t, *_):
        return apply(AllGather, x_t, *ctx.args)


class ReduceScatterDone(torch.autograd.Function):
    """The end of an asynchronous psum_scatter; the transpose is an all-gather."""

    @staticmethod
    @_untracked
    def forward(x, g, dim, tiled, handle):
        return scattered_block(handle.wait(), g, dim, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:4]

    @staticmethod
    @_untracked
    def backward(ctx, ct):
        return apply(AllGather, ct, *ctx.args), None, None, None, None

    @staticmethod
    @_untracked
    def jvp(ctx, x_t, *_):
        return apply(ReduceScatter, x_t, *ctx.args)


_compile.hide_jvp(list(globals().values()))  # torch.compile traces Functions without a jvp
_compile.mark_backward(list(globals().values()))  # and their backward as backward nodes
