"""Functional optimizers and global-norm clipping over sharded pytrees.

An optimizer is a pair of pure functions, ``init(params) -> state`` and
``update(params, grads, state) -> (params, state)``. Each works leaf by leaf on local
blocks, so optimizer state is laid out exactly like its parameter (an FSDP-sharded
parameter has FSDP-sharded moments) and no update needs communication. Leaves may be
plain tensors (inside ``shard_map``, or replicated values outside it) or
`fshard.Sharded` values.

Why functional rather than ``torch.optim``: parameters here are pytrees passed to and
returned from pure functions, often as `Sharded` wrappers whose local tensors are
replaced each step; ``torch.optim`` keys its state on tensor identity. ``torch.optim``
over the local blocks (``[p.local for p in leaves]``) still works when the parameters are
updated in place; `local_tensors` gives that list, and `clip_grad_norm_` clips their gradients
by the global norm (``torch.nn.utils.clip_grad_norm_`` would clip each rank by its own blocks' norm).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import optree
import torch
import torch.distributed as dist

from . import _vma
from ._comm import all_reduce, untracked
from ._errors import ArgumentError
from ._sharded import Sharded
from ._stages import PerRank

__all__ = [
    "Optimizer",
    "sgd",
    "adamw",
    "clip_by_global_norm",
    "clip_grad_norm_",
    "global_norm",
    "local_tensors",
]


class Optimizer(NamedTuple):
    """A functional optimizer: ``init(params) -> state``, ``update(params, grads, state) -> (params, state)``."""

    init: Callable
    update: Callable


def local_tensors(tree) -> list[torch.Tensor]:
    """The local tensor of every leaf (``.local`` for Sharded leaves), in tree order."""
    return [x.local if isinstance(x, Sharded) else x for x in optree.tree_leaves(tree)]


def _split(tree):
    leaves, treedef = optree.tree_flatten(tree)
    return [x.local if isinstance(x, Sharded) else x for x in leaves], leaves, treedef


def _join(locals_, like, treedef):
    return optree.tree_unflatten(
        treedef,
        [x._like(t) if isinstance(x, Sharded) else t for t, x in zip(locals_, like)],
    )


def _tensor_masks(tr, tree, treedef, per: list) -> int:
    """Add the varying axes of ``tree``'s tensors to ``per`` (one mask per parameter leaf) where
    ``tree`` lines up with the parameters (``treedef``), or to the mask returned (the rest)."""
    shared = 0
    if optree.tree_structure(tree) == treedef:
        for k, x in enumerate(optree.tree_leaves(tree)):
            t = x.local if isinstance(x, Sharded) else x
            if isinstance(t, torch.Tensor):
                per[k] |= _vma.get(t, tr)
    elif isinstance(tree, (dict, list, tuple)):
        for sub in tree.values() if isinstance(tree, dict) else tree:
            shared |= _tensor_masks(tr, sub, treedef, per)
    elif isinstance(tree, Sharded):
        shared |= _vma.get(tree.local, tr)
    elif isinstance(tree, torch.Tensor):
        shared |= _vma.get(tree, tr)
    return shared


def _retag(tr, tree, treedef, per: list, shared: int) -> None:
    """Tag ``tree``'s tensors as fresh results (`_vma.tag_result`) varying over their operands' axes."""
    if optree.tree_structure(tree) == treedef:
        for k, x in enumerate(optree.tree_leaves(tree)):
            t = x.local if isinstance(x, Sharded) else x
            if isinstance(t, torch.Tensor):
                m = per[k] | shared
                _vma.tag_result(t, tr, m, tr.taint & ~m)
    elif isinstance(tree, (dict, list, tuple)):
        for sub in tree.values() if isinstance(tree, dict) else tree:
            _retag(tr, sub, treedef, per, shared)
    elif isinstance(tree, (Sharded, torch.Tensor)):
        t = tree.local if isinstance(tree, Sharded) else tree
        _vma.tag_result(t, tr, shared, tr.taint & ~shared)


def _uniform(fn, *extra) -> _Uniform:
    """``fn``, an optimizer's ``init`` or ``update``, whose results vary only like their operands
    (and the tensors of ``extra``: a tensor ``lr``) after a branch on a varying value in the call
    (`_scalars.taint`), instead of counting as made by the branch: ``fn`` is fshard's, the same
    ops on every rank whatever the values, so its results agree wherever its operands do (a
    parameter's update from its fs.value_and_grad gradient, reduced over the data-parallel axes,
    is replicated as the parameter is). The replication check verifies that the ranks' results
    agree (`_checks`): an optimizer a branch chose would give other results."""
    return _Uniform(fn, extra)


class _Uniform:
    """The callable `_uniform` returns: an object rather than a ``functools.wraps`` closure, so that
    an optimizer built inside a compiled step (``opt = fs.optim.adamw(lr)`` in the step) traces:
    Dynamo cannot copy a nested function's ``__dict__``."""

    __slots__ = ("fn", "extra", "__wrapped__")

    def __init__(self, fn, extra: tuple):
        self.fn, self.extra = fn, extra
        self.__wrapped__ = fn  # (inspect.signature and help() follow it)

    def __call__(self, params, *rest):
        fn = self.fn
        tr = _vma.active()
        if tr is None or not tr.taint:
            return fn(params, *rest)
        treedef = optree.tree_structure(params)
        per = [0] * treedef.num_leaves
        shared = 0
        with untracked():  # (fshard's bookkeeping, unseen by the tracking mode)
            for x in self.extra:
                if isinstance(x, torch.Tensor):
                    shared |= _vma.get(x, tr)
            for tree in (params, *rest):
                shared |= _tensor_masks(tr, tree, treedef, per)
        out = fn(params, *rest)
        with untracked():
            _retag(tr, out, treedef, per, shared)
        return out


def _step0(locals_) -> torch.Tensor:
    """The step count of a fresh optimizer state: a 0-d int64 tensor on the parameters' device.

    A tensor rather than an int: a compiled training step then takes the same graph at every
    step (an int input would be a new constant, and a recompile, at the next step)."""
    return torch.zeros((), dtype=torch.int64, device=locals_[0].device if locals_ else None)


def _scalar_dtype(locals_) -> torch.dtype:
    """float64 when a parameter is float64, else float32: the dtype of the step-size scalars."""
    return torch.float64 if any(t.dtype == torch.float64 for t in locals_) else torch.float32


def sgd(
    lr: float | torch.Tensor, momentum: float = 0.0, *, nesterov: bool = False, weight_decay: float = 0.0
) -> Optimizer:
    """Stochastic gradient descent with optional momentum, as ``torch.optim.SGD`` computes it.

    The state is ``{"step": 0-d int64 tensor, "momentum": buffers like params}`` (no buffers
    without momentum). ``lr`` is a float, or a 0-d tensor for a schedule inside a compiled step
    (`adamw` says why).

    Examples:
        >>> opt = fs.optim.sgd(0.1, momentum=0.9)
        >>> state = opt.init(params)
        >>> params, state = opt.update(params, grads, state)
    """

    def init(params):
        p, like, treedef = _split(params)
        if momentum == 0.0:
            return {"step": _step0(p)}
        return {"step": _step0(p), "momentum": _join([torch.zeros_like(t) for t in p], like, treedef)}

    @torch.no_grad()
    def update(params, grads, state):
        p, like, treedef = _split(params)
        g, _, _ = _split(grads)
        g = list(g)
        if weight_decay:
            g = torch._foreach_add(g, p, alpha=weight_decay)
        new_state = {"step": state["step"] + 1}
        if momentum:
            # the buffer starts at zero, so the first step sets it to g, as torch's first step does
            buf, _, _ = _split(state["momentum"])
            buf = torch._foreach_mul(buf, momentum)
            torch._foreach_add_(buf, g)
            new_state["momentum"] = _join(buf, like, treedef)
            g = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
        if isinstance(lr, torch.Tensor):  # a schedule's value: an input of a compiled step
            new_p = torch._foreach_sub(p, torch._foreach_mul(g, lr))
        else:
            new_p = torch._foreach_add(p, g, alpha=-lr)
        return _join(new_p, like, treedef), new_state

    return Optimizer(_uniform(init), _uniform(update, lr))


def adamw(
    lr: float | torch.Tensor,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> Optimizer:
    """AdamW (decoupled weight decay), as ``torch.optim.AdamW`` computes it.

    The state is ``{"step": 0-d int64 tensor, "m": ..., "v": ...}``, the moments laid out like
    the parameters. The step count is a tensor, and the bias corrections are computed from it as
    tensors (as torch's ``capturable`` Adam does), so a ``torch.compile``'d training step is the
    same graph at every step. ``lr`` is a float, or a 0-d tensor: under ``torch.compile`` a new
    float at each step (a schedule) costs one recompile, after which Dynamo treats it as a
    symbolic input; a tensor is an input of the graph from the start.

    Examples:
        >>> opt = fs.optim.adamw(3e-4, weight_decay=0.1)
        >>> state = opt.init(params)
        >>> params, state = opt.update(params, grads, state)
    """
    b1, b2 = betas

    def init(params):
        p, like, treedef = _split(params)
        return {
            "step": _step0(p),
            "m": _join([torch.zeros_like(t) for t in p], like, treedef),
            "v": _join([torch.zeros_like(t) for t in p], like, treedef),
        }

    @torch.no_grad()
    def update(params, grads, state):
        p, like, treedef = _split(params)
        g, _, _ = _split(grads)
        m, _, _ = _split(state["m"])
        v, _, _ = _split(state["v"])
        step = state["step"] + 1
        # the bias corrections from the step count, a tensor: a compiled step is the same graph
        # at every step (torch's capturable Adam computes them the same way)
        t = torch.as_tensor(step, dtype=_scalar_dtype(p), device=p[0].device if p else None)
        bc1 = 1 - b1**t
        bc2_sqrt = (1 - b2**t).sqrt()
        p = torch._foreach_mul(p, 1 - lr * weight_decay)
        m = torch._foreach_mul(m, b1)
        torch._foreach_add_(m, g, alpha=1 - b1)
        v = torch._foreach_mul(v, b2)
        torch._foreach_addcmul_(v, g, g, value=1 - b2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_div_(denom, -lr / bc1)  # p + m / (denom / -step_size) = p - step_size * m / denom
        torch._foreach_addcdiv_(p, m, denom)
        return _join(p, like, treedef), {
            "step": step,
            "m": _join(m, like, treedef),
            "v": _join(v, like, treedef),
        }

    return Optimizer(_uniform(init), _uniform(update, lr))


@torch.no_grad()
def global_norm(grads) -> torch.Tensor:
    """The L2 norm of all gradients together, each element counted once.

    A gradient split over some mesh axes is summed over exactly those axes; a replicated
    one is counted once. Inside ``shard_map`` the varying axes of each gradient decide; on
    global values, each Sharded leaf's layout does, and the tensors of an `fs.PerRank` vary
    over its axes (each pipeline stage's gradients counted once). One all-reduce in all.

    Examples:
        >>> norm = fs.optim.global_norm(grads)
    """
    return _global_norm(grads, 2.0)


def _global_norm(grads, norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm (p > 0, or inf) of the leaves of ``grads``, each element counted once.

    Each leaf's sum of ``|g|^p`` is divided by its number of copies on the mesh (the ranks that
    hold the same block) and the sums are added over the whole mesh with one all-reduce; the
    inf-norm is one all-reduce of the maximum. Computed in float32 at least (float64 leaves in
    float64)."""
    tr = _vma.active()
    leaves: list = []
    per_rank: dict[int, tuple[str, ...]] = {}  # id(leaf) -> the axes of the fs.PerRank holding it
    mesh = tr.mesh if tr is not None else None
    for x in optree.tree_leaves(grads, is_leaf=lambda v: isinstance(v, PerRank)):
        if isinstance(x, PerRank):  # this rank's own tensors: they vary over the PerRank's axes
            inner = optree.tree_leaves(x.tree)
            per_rank.update((id(t), tuple(x.axes)) for t in inner)
            leaves += inner
        else:
            leaves.append(x)
        if mesh is None and isinstance(x, (Sharded, PerRank)):
            mesh = x.mesh
    inf = math.isinf(norm_type)
    total = None
    for x in leaves:
        if isinstance(x, Sharded):
            split = x.layout.split_axes
            t = x.local
        elif isinstance(x, torch.Tensor) and id(x) in per_rank and tr is None:
            split = per_rank[id(x)]
            t = x
        elif isinstance(x, torch.Tensor):
            if tr is not None:
                split = tr.mesh.names_of(_vma.get(x, tr))
            else:
                split = ()
            t = x
        else:
            continue
        with untracked():
            m = t.detach().to(torch.promote_types(t.dtype, torch.float32)).abs()
            if inf:  # copies agree: the maximum needs no correction
                term = m.max() if m.numel() else m.new_zeros(())
                total = term if total is None else torch.maximum(total, term)
                continue
            term = m.square().sum() if norm_type == 2.0 else m.pow(norm_type).sum()
            if mesh is not None:
                copies = mesh.size // math.prod([mesh.axis_size(a) for a in split]) if split else mesh.size
                term = term / copies
            total = term if total is None else total + term
    if total is None:
        return torch.zeros(())
    with untracked():
        if mesh is not None and mesh.size > 1:
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            total = all_reduce(total, mesh.axis_group(mesh.axis_names), op)
            if tr is not None:  # the same on every rank, also after a branch on a varying value
                _vma.tag_result(total, tr, 0, tr.mesh.bits(mesh.axis_names))
        if inf:
            return total
        return total.sqrt() if norm_type == 2.0 else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_by_global_norm(grads, max_norm: float):
    """Scale ``grads`` so their global norm is at most ``max_norm``; returns ``(grads, norm)``.

    Examples:
        >>> grads, norm = fs.optim.clip_by_global_norm(grads, 1.0)
    """
    norm = global_norm(grads)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    g, like, treedef = _split(grads)
    tensors = [t for t in g if isinstance(t, torch.Tensor)]
    scaled = iter(torch._foreach_mul(tensors, scale) if tensors else [])
    out = [next(scaled) if isinstance(t, torch.Tensor) else t for t in g]
    return _join(out, like, treedef), norm


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded parameters: clip every gradient by the global norm.

    ``parameters`` is a `Sharded` parameter, a plain tensor, or an iterable (or pytree) of them,
    whose gradients ``loss.backward()`` set (``p.local.grad`` for a Sharded ``p``, ``p.grad``
    for a plain tensor, which is taken to be replicated: the same on every rank). The norm is
    that of the global gradients, each element counted once (one all-reduce, as `global_norm`);
    every local gradient is then scaled in place by ``max_norm / (norm + 1e-6)`` clamped to 1,
    as torch does. Returns the total norm.

    ``torch.nn.utils.clip_grad_norm_`` over the local blocks (``[p.local for p in params]``)
    computes each rank's norm of its own blocks, so ranks clip by different factors and their
    replicas of the parameters drift apart.

    Args:
        parameters: the parameters whose gradients to clip.
        max_norm: the largest norm allowed.
        norm_type: ``p`` of the p-norm (``float("inf")`` for the largest absolute value).

    Raises:
        ArgumentError: for a ``norm_type`` that is not a positive number or inf.

    Examples:
        >>> loss_fn(params, x, y).backward()
        >>> norm = fs.optim.clip_grad_norm_(params.values(), max_norm=1.0)
        >>> opt.step()
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ArgumentError(
            f"fs.optim.clip_grad_norm_: norm_type must be a positive number or float('inf'), got "
            f"{norm_type!r}; use 2.0 for the L2 norm"
        )
    if isinstance(parameters, (torch.Tensor, Sharded)):
        parameters = [parameters]
    elif not isinstance(parameters, (list, tuple, dict)):
        parameters = list(parameters)  # a generator such as model.parameters()
    grads: list = []
    for p in optree.tree_leaves(parameters):
        if isinstance(p, Sharded):
            if p.local.grad is not None:
                grads.append(p._like(p.local.grad))
        elif isinstance(p, torch.Tensor) and p.grad is not None:
            grads.append(p.grad)
    if not grads:
        return torch.tensor(0.0)
    total = _global_norm(grads, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        t = g.local if isinstance(g, Sharded) else g
        t.mul_(coef.to(device=t.device, dtype=t.dtype))
    return total
