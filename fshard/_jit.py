"""``fs.compile``: ``torch.compile`` set up for sharded steps (what ``jax.jit`` is to shard_map).

A sharded training step compiles with plain ``torch.compile(step, fullgraph=True)`` (see
docs/tutorial/09-compiling.md); three settings make it a good one, and `compile` sets them:

- ``fullgraph=True``: a graph break would silently run part of the step eagerly;
- ``torch._dynamo.config.trace_autograd_ops`` on while the function runs, so that
  ``loss.backward()`` and ``fs.value_and_grad`` (``torch.autograd.grad``) are traced into the
  graph instead of breaking it; and ``skip_fwd_side_effects_in_bwd_under_checkpoint``, so that
  ``fs.remat`` (a ``checkpoint``) may tag the values it computes (`CONFIG`);
- inductor's bucketing of the gradient all-reduces (``bucket_all_reduces_fx``): without it the
  compiled backward all-reduces each replicated parameter's gradient on its own (eager fshard
  reduces them in ``bucket_mb`` buckets, which are driven by autograd hooks Dynamo does not
  trace); and of the all-gathers and reduce-scatters, in buckets of at most
  ``FSHARD_COMBINE_MB`` (4 MB), the cap of eager's combining of per-leaf calls: the per-leaf
  FSDP program (``fs.all_gather`` of each parameter) then runs as a few coalesced all-gathers and
  reduce-scatters, as it does eagerly, instead of one per parameter (2x slower than compiled
  FSDP2 on the demo GPT without it). The bucketing runs in fshard's post-grad pass
  (``_graph_counts.CountingPass``: inductor's grouping, fshard's packing and unpacking of the
  buckets, ``_graph_buckets``), which then counts what is left in the graph, so that
  ``fs.count_collectives`` counts compiled calls.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["compile"]


def _bucket_mb(bucket_id: int) -> float:
    """The size cap, in MB, of inductor's all-gather and reduce-scatter buckets: eager's
    combining cap (``FSHARD_COMBINE_MB``). A module-level function: inductor's cache pickles it."""
    from ._combine import cap_bytes

    return cap_bytes() / 2**20


_BUCKETED = {
    "bucket_all_reduces_fx": "all",
    "bucket_all_reduces_fx_bucket_size_determinator": None,  # inductor's default caps
    "bucket_all_gathers_fx": "all",
    "bucket_all_gathers_fx_bucket_size_determinator": _bucket_mb,
    "bucket_reduce_scatters_fx": "all",
    "bucket_reduce_scatters_fx_bucket_size_determinator": _bucket_mb,
}

CONFIG = {"trace_autograd_ops": True, "skip_fwd_side_effects_in_bwd_under_checkpoint": True}
"""The Dynamo settings `compile` runs the compiled function with: ``loss.backward()`` and
``torch.autograd.grad`` traced into the graph; ``fs.remat``'s body, whose only side effects are
fshard's trace-time bookkeeping (the varying-axes tags), traced inside ``checkpoint``."""


def compile(  # noqa: A001 (fs.compile, as torch.compile)
    fn: Callable | None = None,
    *,
    backend: str | Callable = "inductor",
    dynamic: bool | None = None,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    bucket: bool = True,
) -> Callable:
    """Compile a sharded step with ``torch.compile``: one graph, backward traced, gradient
    all-reduces bucketed.

    ``fn`` is anything ``torch.compile(fullgraph=True)`` takes that fshard supports compiled
    (docs/tutorial/09-compiling.md): a ``shard_map``'d function, a function calling one then
    ``loss.backward()``, ``fs.value_and_grad`` of one, a whole step with an ``fs.optim`` update.
    Dynamo traces it on the first call; fshard's checks (specs, the replication check, what is
    refused under compile) run then, and later calls with the same shapes run the graph.

    Called inside an eagerly run shard_map'd function, ``fn`` is a compiled *region* (a
    transformer block compiled once and called for every layer, torchtitan's per-block compile):
    traced apart from the eager call, with its tensor arguments varying over the mesh axes they
    vary over in the call, it may call ``fs.psum`` and the other collectives, and its results vary
    as the eager ops would make them. One graph per pattern of varying axes and shapes; gradients
    of invariant arguments are reduced in its compiled backward. (A ``torch.compile``'d function
    called there runs eagerly instead, with a warning; so does a region called in a call with
    uneven blocks or nested in another shard_map call.)

    Args:
        fn: the function; without it, returns a decorator.
        backend: as ``torch.compile``'s (``"inductor"``, ``"aot_eager"``, a callable, ...).
        dynamic: as ``torch.compile``'s (``None``: a dim that changes is made dynamic on its
            second size).
        mode: as ``torch.compile``'s (inductor only).
        options: inductor options, on top of fshard's (its post-grad pass, which buckets as
            below and counts the collectives for ``fs.count_collectives``; a
            ``post_grad_custom_post_pass`` of the caller's runs first; a ``bucket_*_fx``
            option set to ``"none"`` turns the bucketing off, as ``bucket=False``).
        bucket: with the inductor backend, bucket the all-reduces of the graph (the compiled
            counterpart of ``shard_map``'s ``bucket_mb``), and its all-gathers and reduce-scatters
            in buckets of ``FSHARD_COMBINE_MB`` (eager's combining of per-leaf calls).

    Returns:
        The compiled function (``torch.compile``'s), called with ``trace_autograd_ops`` on. An
        error fshard raises while Dynamo traces (a bad spec, the replication check, a construct
        not supported under compile) is raised as itself (``fs.SpecError``, ``fs.TracingError``,
        ...), as the eager call raises it; plain ``torch.compile`` raises it wrapped in Dynamo's
        ``InternalTorchDynamoError``.

    Examples:
        >>> step = fs.compile(train_step)           # train_step calls loss.backward()
        >>> loss = step(params, batch)              # traced and compiled on this first call
        >>> @fs.compile(backend="aot_eager")
        ... def loss_and_grads(params, batch):
        ...     return fs.value_and_grad(loss_fn)(params, batch)
        >>> block = fs.compile(block_fn)             # a region: compiled once, every layer
        >>> @fs.shard_map(mesh=mesh, in_specs=("d (tp h)", "b d"), out_specs="b d")
        ... def f(w, x):                            # runs eagerly; block(w, x) runs its graph
        ...     return block(w, x)
    """
    if fn is None:
        return functools.partial(
            compile, backend=backend, dynamic=dynamic, mode=mode, options=options, bucket=bucket
        )
    kw: dict[str, Any] = {"backend": backend, "fullgraph": True, "dynamic": dynamic}
    counted = backend == "inductor"
    if counted:
        from ._graph_counts import CountingPass

        opts = dict(options or {})
        # the bucketing runs in fshard's pass, which counts what is left (fs.count_collectives),
        # as inductor's bucket_*_fx settings (the caller's, on top of fshard's) say
        cfg = {**_BUCKETED, **{k: opts.pop(k) for k in list(opts) if k in _BUCKETED}}
        kinds = ("all_reduces", "all_gathers", "reduce_scatters")
        on = bucket and all(cfg[f"bucket_{k}_fx"] != "none" for k in kinds)
        caps = tuple(cfg.get(f"bucket_{k}_fx_bucket_size_determinator") for k in kinds) if on else None
        opts["post_grad_custom_post_pass"] = CountingPass(caps, opts.get("post_grad_custom_post_pass"))
        kw["options"] = opts
        if mode is not None:
            kw["mode"] = mode
    elif options or mode is not None:
        raise ValueError(
            f"fs.compile: options= and mode= are inductor's; backend={backend!r} takes neither "
            "(leave them out, or use backend='inductor')"
        )
    compiled = torch.compile(fn, **kw)
    regions: list = []  # the compiled forms for calls inside eager shard_map calls (`_region`)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch._dynamo.config.patch(**CONFIG), _counted(counted):
            try:
                tr, why = _region_trace()
                if tr is None:
                    if why is not None:  # inside an eager call the region does not cover
                        _warn_eager(fn, why)
                        return fn(*args, **kwargs)
                    return compiled(*args, **kwargs)
                if not regions:
                    from ._region import Region

                    regions.append(Region(fn, lambda f: torch.compile(f, **kw)))
                return regions[0](tr, args, kwargs)
            except torch._dynamo.exc.InternalTorchDynamoError as e:
                err = _fshard_error(e)
                if err is None:
                    raise
                raise err from e  # fshard's own error (SpecError, TracingError, ...), as eager raises it

    run.compiled = compiled  # type: ignore[attr-defined]  # torch.compile's function, for explain()
    return run


def _region_trace():
    """``(trace, None)``: the eager shard_map call a compiled function called now runs in as a region
    (`_region`); ``(None, None)``: outside an eager call; ``(None, why)``: inside one the region does
    not cover (the function then runs eagerly): uneven blocks, a nested call, ``fs.debug``,
    ``fs.no_sync``, ``fs.count_collectives`` with a backend other than inductor, a torch.func
    transform, a torch-function mode entered inside ``f``."""
    from . import _scalars

    if not _scalars._stack:
        return None, None
    from ._region import active_eager_trace

    tr = active_eager_trace()
    if tr is None:
        return None, None
    if tr.uneven:
        return None, "with uneven blocks (a dim its mesh axes do not divide)"
    if len(_scalars._stack) > 1:
        return None, "nested in another shard_map call"
    from . import _buckets, _debug

    if _debug.enabled:
        return None, "under fs.debug (which checks each collective before it is sent, eagerly)"
    if not _buckets._sync:
        return None, "under fs.no_sync (a region would sum its gradients at once)"
    if torch._C._are_functorch_transforms_active():
        return None, (
            "under a torch.func transform (grad, vjp, jvp, vmap, ...), which Dynamo does not trace "
            "a compiled function inside when the transform was entered eagerly"
        )
    from . import _counts

    if _counts.counting_refused():
        return None, (
            "under fs.count_collectives with a backend other than inductor (only inductor's graphs "
            "count their own collectives)"
        )
    modes = torch.overrides._get_current_function_mode_stack()
    if not modes or modes[-1] is not tr._mode:
        return None, f"under a torch-function mode entered inside f ({type(modes[-1]).__name__})"
    return tr, None


EAGER_REGION = (
    "fshard: fs.compile({fn}) was called inside an eager call of fs.shard_map({where}) {why}: it runs "
    "eagerly there, with the call's values, gradients and collectives (docs/tutorial/09-compiling.md: "
    "what a compiled region covers)"
)
"""The warning given once per compiled function when a call falls outside what a region covers."""

_warned: set = set()


def _warn_eager(fn, why: str) -> None:
    from . import _scalars

    name = getattr(fn, "__qualname__", type(fn).__name__)
    where = _scalars._stack[-1].where
    if (name, where, why) not in _warned:
        _warned.add((name, where, why))
        warnings.warn(EAGER_REGION.format(fn=name, where=where, why=why), UserWarning, stacklevel=4)


def _fshard_error(e: BaseException) -> BaseException | None:
    """The fshard error that Dynamo wrapped in ``e`` when fshard raised it while tracing."""
    from ._errors import FshardError

    inner = e.__cause__ or e.__context__
    if not isinstance(inner, FshardError):
        return None
    # Dynamo appended where it was traced to the error's text; that is on ``e``, raised as the cause
    if inner.args and isinstance(inner.args[0], str):
        inner.args = (inner.args[0].split("\n\nfrom user code:")[0], *inner.args[1:])
    return inner


@contextlib.contextmanager
def _counted(on: bool):
    """While an inductor-compiled function runs, its graphs count their own collectives."""
    from . import _counts

    was = _counts.compiled_counted
    _counts.compiled_counted = on
    try:
        yield
    finally:
        _counts.compiled_counted = was
