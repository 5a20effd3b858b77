"""``torch.compile`` of shard_map'd code: the few places where fshard meets Dynamo.

fshard has one implementation of a shard_map call, eager and compiled alike: under
``torch.compile`` Dynamo inlines ``_ShardMapped.__call__``, the planning, `VmaMode`'s
``__torch_function__`` (which reads and sets the varying-axes tags on tensors) and the
primitives, so the replication check and the spec errors run at trace time with eager's
messages, and the graph holds only torch ops and the functional collectives. What Dynamo cannot
trace is kept out of the traced path here:

- the autograd Functions' forward-mode rules (``jvp``): Dynamo refuses a Function that defines
  one, so the primitives' rules read as torch's default while compiling (`hide_jvp`);
- functorch's wrapper test (a C function Dynamo cannot inline): no tensor Dynamo traces is a
  functorch wrapper, so its polyfill answers False;
- a call's input planning and out_specs check: run at trace time as constants (``_static``),
  where the inputs have static shapes and plain containers; otherwise the pure, ``lru_cache``'d
  spec parsing and binding are traced through without the cache;
- the trace ids (an ``itertools.count``): read at trace time as a constant (`next_id`);
- a dict whose leaves are all constants (a spec tree): torch's polyfill of optree's dict flatten
  runs optree's own function on it (constant folding), whose metadata since optree 0.20 (a
  ``DictMetaData``) Dynamo cannot hold; the folding is turned off so the polyfill is traced
  (`_trace_dict_flatten`), and so is the unflatten's, whose metadata is then the polyfill's;
- the tracking mode's rule for an op (``_vma._classify``) is decided at trace time as a
  constant: a handler by its name, as Dynamo cannot guard a function taken as a constant;
- an autograd Function applied to values that need no gradient (a transpose's collective, in a
  backward): ``_primitives.apply`` runs its forward itself, as ``apply`` would (Dynamo passes a
  ``*args`` forward a ctx in front of its arguments there).

What is not yet supported under compile raises a `TracingError` naming the construct at trace
time (`refuse`), never a silent fallback that changes results.
"""

from __future__ import annotations

import contextlib
import functools
import itertools

import torch

from . import _dynamo_hooks
from ._errors import TracingError
from ._trace_time import fail

__all__ = [
    "compiling",
    "refuse",
    "check_call",
    "check_transforms",
    "fail",
    "hide_jvp",
    "mark_backward",
    "keep_collectives_in_place",
    "allow_checkpoint_side_effects",
    "next_id",
    "allow_cached",
]

compiling = torch.compiler.is_compiling
"""Whether Dynamo is tracing the running code (a constant True in traced code, False in eager)."""


class _JvpRule:
    """An autograd Function's ``jvp`` that Dynamo does not see: while torch.compile compiles, the
    attribute reads as ``Function.jvp`` (Dynamo refuses a Function with a custom forward-mode
    rule, and a compiled graph has no forward mode), at any other time as the rule itself."""

    def __init__(self, fn):
        self.fn = fn

    def __get__(self, obj, cls=None):
        return _BASE_JVP if compiling() else self.fn


_BASE_JVP = torch.autograd.Function.jvp


def hide_jvp(classes) -> None:
    """Hide the ``jvp`` of each autograd Function in ``classes`` from Dynamo (`_JvpRule`)."""
    for cls in classes:
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
            rule = cls.__dict__.get("jvp")
            if isinstance(rule, staticmethod):
                setattr(cls, "jvp", _JvpRule(rule.__func__))  # noqa: B010


def mark_backward(classes) -> None:
    """Make the backward of each autograd Function in ``classes`` trace as backward nodes.

    Dynamo traces a Function's backward into a subgraph that the compiled graph replays when it
    traces ``torch.autograd.grad`` (``fs.value_and_grad``, ``loss.backward()``); the replayed nodes
    take their metadata from the subgraph's, which lacks torch's mark of backward nodes
    (``autograd_backward``). torch's rematerialization of checkpointed regions (``fs.remat``,
    ``fs.fsdp_scan``'s gathers) in a graph holding forward and backward finds the backward by
    that mark: unmarked, a collective's transpose would split the backward in pieces and the
    compilation fail. While Dynamo traces the backward, the mark is set."""
    for cls in classes:
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
            rule = cls.__dict__.get("backward")
            if isinstance(rule, staticmethod):
                setattr(cls, "backward", staticmethod(_marked(rule.__func__)))  # noqa: B010


def _marked(fn):
    @functools.wraps(fn)
    def backward(*args):
        if not compiling():
            return fn(*args)
        _mark(True)
        try:
            return fn(*args)
        finally:
            _mark(False)

    return backward


_marks: list[contextlib.ExitStack] = []  # one per backward being traced (innermost last)


@torch._dynamo.assume_constant_result  # run at trace time, not traced
def _mark(on: bool) -> bool:
    """Start (or end) the backward mark of the graph nodes Dynamo creates (as Dynamo does for
    ``fx.traceback.annotate``: the node metadata preserved, with torch's backward flag set)."""
    if on:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.fx.traceback.preserve_node_meta())
        stack.enter_context(torch.fx.traceback._set_autograd_backward())
        _marks.append(stack)
    elif _marks:
        _marks.pop().close()
    return on


def _keep_backward_collectives(graph) -> None:
    """Inductor's joint-graph pass that keeps the collectives of a compiled backward in the
    backward: each such node is tagged ``must_be_in_backward`` for the partitioner.

    The min-cut partitioner computes in the forward whatever it can reach from the forward's
    inputs alone. A backward collective whose operand does not depend on the incoming gradients
    on some rank (a zero gradient block: ``fs.ppermute``'s source-only rank; a parameter that no
    op of this rank used) would be moved into that rank's forward while the other ranks run it in
    their backward: the ranks would pair different collectives (wrong values, or a hang). A
    collective runs where the eager program runs it, on every rank."""
    nodes = list(graph.nodes)
    if not any(n.op == "placeholder" and "tangents" in str(n.target) for n in nodes):
        return  # not a joint graph: nothing to partition
    for node in nodes:
        # AOT tags the nodes it traced for the forward "is_forward" (the backward's keep the
        # metadata of the nodes they replay: none, or torch's mark of backward nodes)
        if (
            getattr(node.target, "namespace", None) == "_c10d_functional"
            and node.meta.get("partitioner_tag") != "is_forward"
        ):
            node.meta["partitioner_tag"] = "must_be_in_backward"


_KEEP: list = []  # the pass, made once (inductor's cache keys a pass by its uuid)


@torch._dynamo.assume_constant_result  # run at trace time, not traced
def keep_collectives_in_place() -> bool:
    """Add `_keep_backward_collectives` to inductor's joint-graph passes (once; after any pass the
    user set there), and turn inductor's peak-memory reordering and AOTAutograd's elimination of
    common subexpressions off (see below), while Dynamo traces a shard_map call: before inductor
    partitions and schedules the graph."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    if not _KEEP:

        class KeepBackwardCollectives(CustomGraphPass):
            __call__ = staticmethod(_keep_backward_collectives)

            def uuid(self) -> str:
                return "fshard.keep_backward_collectives.1"

        _KEEP.append(KeepBackwardCollectives())
    keep = _KEEP[0]
    passes = config.joint_custom_pre_pass
    listed = list(passes) if isinstance(passes, (list, tuple)) else [] if passes is None else [passes]
    if keep not in listed:
        config.joint_custom_pre_pass = [*listed, keep] if listed else keep
    # Inductor's peak-memory reordering of the scheduler's nodes (torch 2.13) can run a kernel
    # that reads an in-place collective's buffer (``all_reduce_`` then ``wait_tensor``, the
    # lowering of every functional all-reduce) before the collective: seen in a 4-layer
    # tensor-parallel residual stack's backward, whose layer-0 kernel summed layer 1's
    # input-gradient block before its all-reduce over "tp" ran (the loss right, the early
    # layers' gradients 15-65% off, different on the ranks of "tp"). Inductor picks the order
    # of least estimated peak memory among a few sorts, so the bug comes and goes with the
    # buffers' sizes and dtypes. Off while the graphs of a shard_map call are compiled: a
    # memory heuristic, never a change of values.
    config.reorder_for_peak_memory = False
    # AOTAutograd's common-subexpression elimination merges two collectives whose operands the
    # graph computes alike: on one rank only, where that rank's constants made them alike (a
    # pipeline's first stage sends tanh(0 @ w) at two bubble steps), while its peers run both and
    # waited for the second forever (4 stages under inductor). Off while the graphs of a shard_map
    # call are compiled (inductor still merges common subexpressions inside its kernels).
    torch._functorch.config.cse = False
    return True


@torch._dynamo.assume_constant_result  # run at trace time, not traced
def allow_checkpoint_side_effects() -> bool:
    """Let Dynamo trace ``fs.remat``'s body inside ``torch.utils.checkpoint`` although fshard tags
    the values it computes (a trace-time side effect the recomputation need not replay): set
    ``skip_fwd_side_effects_in_bwd_under_checkpoint`` (as `fs.compile` does), before Dynamo
    reaches the checkpoint."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    return True


_ids = itertools.count(1)


@torch._dynamo.assume_constant_result
def next_id() -> int:
    """A fresh trace id; while compiling, taken once at trace time and baked in as a constant."""
    return next(_ids)


def allow_cached(*fns) -> None:
    """Let Dynamo trace through these pure ``lru_cache``'d functions (it ignores the cache, which
    is exact for a pure function) without its warning."""
    allow = getattr(torch._dynamo.utils, "allow_lru_cache_wrapper_trace_without_warning", None)
    if allow is not None:
        for fn in fns:
            allow(fn)


def refuse(construct: str, fix: str) -> None:
    """Raise a TracingError naming ``construct`` when torch.compile is tracing it."""
    if compiling():
        fail(
            TracingError,
            f"{construct} is not supported inside torch.compile yet (fshard refuses rather than "
            f"compiling something that would mean another thing than the eager call); {fix}",
        )


@torch._dynamo.assume_constant_result
def _in_transform() -> bool:
    """Whether a torch.func transform is running; while compiling, read at trace time (Dynamo
    enters the transforms' levels for real while it traces their bodies) and baked in."""
    return torch._C._are_functorch_transforms_active()


def check_transforms() -> None:
    """While compiling, refuse torch.func transforms around or inside a shard_map'd body: Dynamo
    (torch 2.13) traces an autograd Function's forward under them and drops its custom backward
    and jvp (pytorch/pytorch#193279, #192985; ``tests/test_torch_limits.py`` watches for the fix),
    so a collective's transpose is lost (a gradient taken inside ``f`` of an invariant parameter
    would miss its psum): the graph would mean another thing than eager."""
    if compiling() and _in_transform():
        fail(
            TracingError,
            "torch.func transforms (grad, vjp, jvp, vmap, jacrev, hessian, ...) inside or around a "
            "shard_map'd function are not supported inside torch.compile yet (fshard refuses rather "
            "than compiling something that would mean another thing than the eager call); under them "
            "Dynamo drops the custom backward and jvp of the autograd Functions fshard's collectives "
            "are (pytorch/pytorch#193279): call the transform eagerly, or use fs.value_and_grad / "
            "loss.backward() in the compiled step",
        )


def check_call(name: str, counting: bool = False) -> None:
    """While compiling, refuse the shard_map options a compiled call does not support yet."""
    if not _dynamo_hooks.INSTALLED:
        refuse(
            f"fs.shard_map({name}) on this torch version",
            "fshard could not hook the tensor operations Dynamo traces without torch-function modes "
            "(x.T, iterating over a tensor, abs(x)); call it eagerly",
        )
    if counting:
        refuse(
            f"fs.shard_map({name}) under fs.count_collectives",
            "compile the step with fs.compile and the inductor backend, whose compiled calls "
            "fs.count_collectives counts, or count an eager call of the step",
        )


def _no_functorch_wrappers() -> None:
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    try:

        @torch._dynamo.substitute_in_graph(wrapped, skip_signature_check=True)
        def _is_wrapped(tensor: torch.Tensor) -> bool:  # traced tensors are never functorch wrappers
            return False

    except (ValueError, TypeError):  # already given a polyfill (by torch, or a reload)
        pass


_no_functorch_wrappers()


def _trace_dict_flatten() -> None:
    import optree

    entry = optree.register_pytree_node.get(dict)
    if entry is None or type(entry.flatten_func({})[1]) is list:  # optree < 0.20: folding is fine
        return
    try:
        import torch._dynamo.polyfills.pytree  # noqa: F401  (registers torch's polyfills)
        from torch._dynamo.variables import PolyfilledFunctionVariable

        handlers = PolyfilledFunctionVariable._get_polyfill_handlers()
    except (ImportError, AttributeError):  # another torch: nothing to turn off
        return
    # the polyfills' metadata is their own: folding either one runs optree's function on the other's
    for fn in (entry.flatten_func, entry.unflatten_func):
        handler = handlers.get(fn)
        if handler is not None:
            setattr(handler, "__torch_dynamo_can_constant_fold_through__", False)  # noqa: B010


_trace_dict_flatten()
