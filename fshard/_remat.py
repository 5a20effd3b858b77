"""``fs.remat``: recompute a function's intermediates in the backward instead of keeping them.

JAX's ``jax.checkpoint`` for shard_map code, on ``torch.utils.checkpoint`` (non-reentrant). The
recomputation runs during the backward, after the shard_map call has returned, so it re-enters
that call's trace: collectives inside the function work, and values keep their varying axes. The
FSDP use: gather a layer's parameters inside a rematerialized function, so the gathered copy is
freed after the layer's forward and gathered again in the backward.
"""

from __future__ import annotations

import functools

import optree
import torch
import torch.utils.checkpoint

from . import _compile, _vma
from ._primitives import _functorch_active

__all__ = ["remat"]


def remat(fn):
    """Make ``fn`` keep only its inputs for the backward and recompute the rest there.

    Collectives inside ``fn`` run again during the backward (an FSDP layer's all_gather is
    issued twice: in the forward and in the recomputation), in exchange for not keeping the
    gathered parameters and the activations of ``fn`` alive between forward and backward.
    Under torch.func transforms (``vmap``, ``jvp``, ``grad``, ``jacrev``, ...) ``fn`` runs as
    is: its intermediates are kept (the transforms do not support recomputation hooks).

    Under ``torch.compile`` it is ``torch.utils.checkpoint`` traced by Dynamo: the compiled
    backward recomputes ``fn``, collectives included, from its inputs (a recomputed value the
    backward does not use is dropped from the graph, so it may issue fewer collectives than
    eager). fshard tags the values ``fn`` computes while tracing it, a side effect Dynamo
    accepts inside a checkpoint only with
    ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True``: ``fs.compile``
    sets it, and so does tracing ``fs.remat`` under plain ``torch.compile`` (for the rest of the
    process: the recomputation then skips the forward's Python side effects, which fshard's own
    are).

    Examples:
        >>> @fs.remat
        ... def layer(p_shard, h):
        ...     w = fs.all_gather(p_shard["w"], "dp", dim=0, tiled=True)   # freed after use
        ...     return torch.tanh(h @ w)
    """

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        if _compile.compiling():
            _compile.allow_checkpoint_side_effects()
        if _functorch_active():
            # under torch.func transforms: computed once and kept (torch.func.grad, vjp, jacrev and
            # hessian do not support checkpoint's saved tensor hooks); the values are the same
            return fn(*args, **kwargs)
        tr = _vma.active()
        if tr is not None and _compile.compiling():
            return _compiled(fn, tr, args, kwargs)

        def run(*a, **k):
            if tr is None or _vma.active() is tr:
                return fn(*a, **k)
            with tr:  # the recomputation in the backward: re-enter the call's trace
                return fn(*a, **k)

        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)

    return inner


def _compiled(fn, tr, args, kwargs):
    """`remat` while Dynamo traces: ``checkpoint`` traced as a region (a higher-order op).

    Dynamo traces the region's body in a graph of its own, where the call's `VmaMode` does not
    see the ops: the body is traced under a mode of its own for the same trace (so its implicit
    casts and tags are eager's), and the masks of its outputs, plain ints at trace time, are put
    on the region's outputs, which Dynamo makes anew. The region's op itself (Dynamo's
    ``tag_activation_checkpoint``, which the call's mode sees with all the region's inputs) runs
    as is (`_vma._as_is`): the plain rule cast an invariant input that needs a gradient to vary like
    the weights beside it, so its whole gradient was summed over the ranks (a Megatron block's
    residual input: a false replication error, or twice the gradient). Untracked, the body's ops gave untagged
    (invariant) results: a psum of them multiplied instead of summing, and a Megatron layer gave
    other values than eager."""
    masks: list[list[int]] = []

    def run(*a, **k):
        if tr.mesh.tracked:
            with _vma.VmaMode(tr):
                out = fn(*a, **k)
        else:
            out = fn(*a, **k)
        masks.append([_vma.get(t, tr) for t in _tensors(out)])
        return out

    out = torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)
    for t, m in zip(_tensors(out), masks[-1]):
        _vma.tag(t, tr, m)
    return out


def _tensors(tree) -> list:
    return [t for t in optree.tree_leaves(tree, none_is_leaf=True) if isinstance(t, torch.Tensor)]
