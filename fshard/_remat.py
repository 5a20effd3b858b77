"""``fs.remat``: recompute a function's intermediates in the backward instead of keeping them.

JAX's ``jax.checkpoint`` for shard_map code, on ``torch.utils.checkpoint`` (non-reentrant). The
recomputation runs during the backward, after the shard_map call has returned, so it re-enters
that call's trace: collectives inside the function work, and values keep their varying axes. The
FSDP use: gather a layer's parameters inside a rematerialized function, so the gathered copy is
freed after the layer's forward and gathered again in the backward.
"""

from __future__ import annotations

import functools

import torch.utils.checkpoint

from . import _compile, _vma
from ._errors import TracingError
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
    sets it; under plain ``torch.compile`` set it, or fs.remat raises a TracingError saying so.
    On a mesh with more than one axis it is refused under compile (a TracingError): compiled,
    a Megatron layer inside it gave other values than eager.

    Examples:
        >>> @fs.remat
        ... def layer(p_shard, h):
        ...     w = fs.all_gather(p_shard["w"], "dp", dim=0, tiled=True)   # freed after use
        ...     return torch.tanh(h @ w)
    """

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        if _compile.compiling() and not torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint:
            _compile.fail(
                TracingError,
                f"fs.remat({getattr(fn, '__name__', 'fn')}) under torch.compile needs "
                "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True (fshard "
                "tags the values computed inside it, a trace-time side effect the recomputation in "
                "the backward need not replay); compile with fs.compile, which sets it, or set it",
            )
        tr0 = _vma.active()
        if tr0 is not None and _compile.compiling() and sum(s > 1 for s in tr0.mesh.shape.values()) > 1:
            # compiled on a dp x tp mesh, a Megatron layer inside fs.remat gave other values than
            # eager (torch 2.13; not understood yet): refused rather than compiled wrong
            _compile.refuse(
                f"fs.remat({getattr(fn, '__name__', 'fn')}) on a mesh with more than one axis "
                f"(Mesh({', '.join(f'{n}={k}' for n, k in tr0.mesh.shape.items())}))",
                "call the step eagerly, or leave fs.remat out of the compiled step (fs.fsdp_scan "
                "compiles on such meshes)",
            )
        if _functorch_active():
            # under torch.func transforms: computed once and kept (torch.func.grad, vjp, jacrev and
            # hessian do not support checkpoint's saved tensor hooks); the values are the same
            return fn(*args, **kwargs)
        tr = _vma.active()

        def run(*a, **k):
            if tr is None or _vma.active() is tr:
                return fn(*a, **k)
            with tr:  # the recomputation in the backward: re-enter the call's trace
                return fn(*a, **k)

        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)

    return inner
