"""Functional gradients over pytrees of tensors and `Sharded` values."""

from __future__ import annotations

import functools

import optree
import torch

from . import _buckets, _scalars, _shapes, _vma
from ._comm import untracked
from ._errors import FshardError
from ._primitives import _functorch_active
from ._sharded import Sharded

__all__ = ["value_and_grad", "grad"]


def _prepare(tree):
    tr = _vma.active()
    if tr is None:
        return _prepare_in(tree, None)
    # Inside shard_map: the bookkeeping below is not the user's computation, so it runs unseen by
    # the tracking mode (every attribute read and op per leaf would otherwise go through it); the
    # new tensors get their varying axes explicitly.
    with untracked():
        return _prepare_in(tree, tr)


def _path(treedef, i: int) -> str:
    """The key path of leaf ``i`` of the differentiated arguments (named in errors)."""
    return "grad argument" + "".join(f"[{k!r}]" for k in optree.treespec_paths(treedef)[i])


def _primal(x, tr):
    """A differentiable copy of ``x``; inside shard_map it varies like ``x`` where ``x`` is read whole
    (`_scalars.same_value`) and keeps ``x``'s shapes at every rank (uneven blocks)."""
    t = x.detach().requires_grad_(True)
    if tr is not None:
        _scalars.same_value(t, x, tr)
        if tr.uneven:
            _shapes.put(t, tr, _shapes.of(x, tr))
    return t


def _prepare_in(tree, tr):
    leaves, treedef = optree.tree_flatten(tree)
    prim, new = [], []
    for x in leaves:
        if isinstance(x, Sharded):
            t = _primal(x.local, tr)
            prim.append(t)
            new.append(x._like(t))
        elif isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
            t = _primal(x, tr)
            prim.append(t)
            new.append(t)
        else:
            prim.append(None)
            new.append(x)
    boundary: dict = {}  # leaf index -> (BoundaryState, index at the boundary)
    if tr is not None and tr.bucket_mb:
        # inside shard_map: the gradient reductions of these tensors go in buckets (_buckets)
        idx = [i for i, x in enumerate(new) if isinstance(x, torch.Tensor) and prim[i] is x]
        masks = [_vma.get(new[i], tr) for i in idx]
        all_bits = tr.mesh.bits(tr.mesh.axis_names)
        vis = _buckets.wrap(
            [new[i] for i in idx],
            masks,
            tr,
            all_bits,
            tr.bucket_mb,
            path=lambda k: _path(treedef, idx[k]),
            defer=False,  # (the gradients are values returned: fs.no_sync keeps none of them pending)
        )
        for i, v in zip(idx, vis):
            if v is not new[i]:
                hit = tr.twins.get(id(v))
                if hit is not None:
                    boundary[i] = (hit[3], hit[2])
                if tr.uneven:
                    _shapes.put(v, tr, _shapes.of(new[i], tr))
            new[i] = v
    return leaves, treedef, prim, optree.tree_unflatten(treedef, new), boundary


def value_and_grad(f, argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False):
    """Make a function that returns ``f``'s value and its gradient w.r.t. ``args[argnums]``.

    Works on plain tensors inside a ``shard_map``'d function (a whole training step inside
    shard_map) and on global values outside it (differentiating a ``shard_map``'d function).
    Gradients have the structure of the differentiated argument; a `Sharded` leaf gets
    a Sharded gradient in its own layout, a plain tensor its full gradient. ``f`` must
    return a scalar tensor (or ``(scalar, aux)`` with ``has_aux=True``).

    Under torch.func transforms it differentiates with ``torch.func.grad_and_value``, so
    ``vmap`` of it trains an ensemble and ``jvp`` of it gives Hessian-vector products.

    Examples:
        >>> loss_and_grads = fs.value_and_grad(loss_fn)
        >>> loss, grads = loss_and_grads(params, batch)
        >>> losses, grads = torch.func.vmap(fs.value_and_grad(loss_fn), in_dims=(0, None))(ensemble, batch)
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(f)
    def wrapped(*args):
        args = list(args)
        preps = {}
        for i in nums:
            if i >= len(args):
                raise FshardError(
                    f"value_and_grad: argnums={argnums} but only {len(args)} arguments were given"
                )
        if _functorch_active():  # under vmap, jvp, grad, ...: torch.func's own gradient
            return _functional(f, args, nums, argnums, has_aux)
        for i in nums:
            preps[i] = _prepare(args[i])
            args[i] = preps[i][3]
        with torch.enable_grad():
            out = f(*args)
        value, aux = out if has_aux else (out, None)
        _check_scalar(value)
        prims = [t for i in nums for t in preps[i][2] if t is not None]
        grads = iter(torch.autograd.grad(value, prims, allow_unused=True) if prims else ())
        tr = _vma.active()
        results = []
        for i in nums:
            leaves, treedef, prim, _, boundary = preps[i]
            out_leaves = []
            for k, (x, t) in enumerate(zip(leaves, prim)):
                if t is None:
                    out_leaves.append(None)
                    continue
                g = next(grads)
                if g is None:
                    g = torch.zeros_like(t)
                elif tr is not None and tr.taint and k in boundary:
                    with untracked():
                        _reduced_alone(g, t, tr, *boundary[k])
                out_leaves.append(x._like(g) if isinstance(x, Sharded) else g)
            results.append(optree.tree_unflatten(treedef, out_leaves))
        g_out = results[0] if isinstance(argnums, int) else tuple(results)
        if tr is None:
            out = value.detach()
        else:  # the same bytes: a collective's result stays one (`_scalars.same_value`)
            with untracked():
                out = value.detach()
                _scalars.same_value(out, value, tr)
        return ((out, aux), g_out) if has_aux else (out, g_out)

    return wrapped


def _reduced_alone(g, t, tr, state, k: int) -> None:
    """After a branch on a varying value (`_scalars.taint`): the gradient ``g`` of the primal ``t``
    that no invariant use reached is the all-reduce of its bucket over its axis group (`_buckets`):
    this rank's own gradient summed with the other ranks' of that group, whatever path each rank
    took, as DDP sums it; the same on every rank of the group (`_vma.tag_result`), so it is no
    value the branch made. (A gradient an invariant use added to is local: it stays tainted.)"""
    group = state.alone[k]
    if group is not None:
        _vma.tag_result(g, tr, _vma.get(t, tr), tr.mesh.bits(group.names))


def _check_scalar(value) -> None:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise FshardError(
            f"value_and_grad: f must return a scalar tensor, got "
            f"{type(value).__name__}{'' if not isinstance(value, torch.Tensor) else tuple(value.shape)}"
        )


def _differentiable(x) -> bool:
    return isinstance(x, Sharded) or (
        isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())
    )


def _functional(f, args, nums, argnums, has_aux):
    """`value_and_grad` under torch.func transforms (an ensemble: ``vmap(fs.value_and_grad(loss))``),
    by ``torch.func.grad_and_value`` over the differentiable leaves (a `Sharded` leaf's block)."""
    preps = {i: optree.tree_flatten(args[i]) for i in nums}
    slots = [[k for k, x in enumerate(preps[i][0]) if _differentiable(x)] for i in nums]
    prims = [[preps[i][0][k] for k in ks] for i, ks in zip(nums, slots)]
    prims = [[x.local if isinstance(x, Sharded) else x for x in ps] for ps in prims]

    def inner(*flat):
        call = list(args)
        for i, ks, ps in zip(nums, slots, flat):
            leaves, treedef = preps[i]
            new = list(leaves)
            for k, p in zip(ks, ps):
                new[k] = leaves[k]._like(p) if isinstance(leaves[k], Sharded) else p
            call[i] = optree.tree_unflatten(treedef, new)
        out = f(*call)
        value, aux = out if has_aux else (out, None)
        _check_scalar(value)
        return value, (aux,) if has_aux else ()  # torch.func refuses a None aux

    gs, (value, aux) = torch.func.grad_and_value(inner, argnums=tuple(range(len(nums))), has_aux=True)(*prims)
    aux = aux[0] if has_aux else None
    results = []
    for i, ks, g in zip(nums, slots, gs):
        leaves, treedef = preps[i]
        out_leaves: list = [None] * len(leaves)
        for k, gk in zip(ks, g):
            out_leaves[k] = leaves[k]._like(gk) if isinstance(leaves[k], Sharded) else gk
        results.append(optree.tree_unflatten(treedef, out_leaves))
    g_out = results[0] if isinstance(argnums, int) else tuple(results)
    return ((value, aux), g_out) if has_aux else (value, g_out)


def grad(f, argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False):
    """Like `value_and_grad`, returning only the gradient (and aux with ``has_aux``).

    Examples:
        >>> grads = fs.grad(loss_fn)(params, batch)
    """
    vg = value_and_grad(f, argnums, has_aux=has_aux)

    @functools.wraps(f)
    def wrapped(*args):
        out, g = vg(*args)
        return (g, out[1]) if has_aux else g

    return wrapped
