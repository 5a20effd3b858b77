"""``fs.compile``'d functions called inside an eager shard_map call: compiled regions.

A region is a function compiled on its own and called from an eagerly run ``f`` (torchtitan's
per-block compile: ``block = fs.compile(block_fn)``, then ``block(params[i], h)`` in ``f``). Traced
with the eager call's tracking state in view, Dynamo would read that state (the call's trace id,
its caches, the tags of this call's tensors) as constants of the graph and recompile at every call.
So a region is traced apart from the call, as a compiled shard_map call is: the call's trace is
set aside while the compiled function runs, and the traced function makes a trace of its own
(`_run`), tags its tensor arguments with the masks they have in the eager call (closure constants
of the compiled function, one compiled function per pattern of masks), and tracks the body at
trace time. The masks of its outputs, constants of the trace, are returned with its result and put
on the outputs in the eager call. Inside, ``fs.psum`` and the other collectives act over the same mesh, and the
implicit casts of invariant inputs that need a gradient are in the graph (their transposes, the
gradient all-reduces, in the compiled backward).

The rule of an op applies to the region as a whole exactly as to the ops inside it, so the values,
gradients and masks are the eager call's. Calls the region does not cover run the function eagerly
in the call (as every torch.compile'd function does there, `_dynamo_hooks`): a call with uneven
blocks, a shard_map call nested in another, ``fs.debug``, ``fs.no_sync``, ``fs.count_collectives``
with a backend other than inductor, a torch-function mode of
the caller's entered inside ``f`` (`_jit._region_trace`).
"""

from __future__ import annotations

import types
from typing import Any

import optree
import torch

from . import _vma
from ._comm import untracked
from ._scalars import _stack

__all__ = ["Region", "active_eager_trace"]


def active_eager_trace() -> _vma.Trace | None:
    """The innermost shard_map call if it runs eagerly with tracking, else None."""
    tr = _stack[-1] if _stack else None
    if tr is None or tr.compiled or tr._mode is None:
        return None
    return tr


def _run(fn, mesh, where: str, masks: tuple, args, kwargs):
    """The traced body of a region: ``fn`` under a trace of its own, its tensor arguments tagged
    with ``masks``. Views of them are tagged (a tag set on an argument itself would be a side
    effect Dynamo replays on the caller's tensor). Returns ``fn``'s result and, constants of the
    trace returned as such by the compiled function, the masks of its leaves and those of the
    arguments after it ran (an argument written in place varies as the value written into it)."""
    tr = _vma.Trace(mesh, where)
    with tr:
        tree: Any = (args, kwargs)
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
        local = []
        for x, m in zip(leaves, masks):
            if isinstance(x, torch.Tensor):
                with untracked():
                    x = x.view_as(x)
                if m:
                    _vma.tag(x, tr, m)
            local.append(x)
        args, kwargs = optree.tree_unflatten(spec, local)
        out = fn(*args, **kwargs)
        outs = optree.tree_leaves(out, none_is_leaf=True)
        got = tuple(_vma.get(o, tr) if isinstance(o, torch.Tensor) else 0 for o in outs)
        # an argument written in place with a value that varies more (the in-place rule tagged it)
        written = tuple(_vma.get(x, tr) if isinstance(x, torch.Tensor) else 0 for x in local)
    return out, (got, written)


def _region_code(fn, mesh, where, masks):
    def region(*args, **kwargs):
        return _run(fn, mesh, where, masks, args, kwargs)

    return region


def _cast(x, tr: _vma.Trace):
    """A region's argument ``x`` cast to vary over the call's taint (a tensor needing a gradient)."""
    if not isinstance(x, torch.Tensor):
        return x
    have = _vma.get(x, tr)
    return _vma.pvary(x, tr, have, have | tr.taint)


class Region:
    """The compiled forms of one ``fs.compile``'d function for calls inside eager shard_map calls:
    one per (mesh, shard_map'd function, masks of the arguments)."""

    def __init__(self, fn, compile_fn):
        self.fn = fn
        self.compile_fn = compile_fn  # torch.compile with fs.compile's settings
        self.compiled: dict[tuple, Any] = {}

    def __call__(self, tr: _vma.Trace, args, kwargs):
        with untracked():  # (fshard's bookkeeping, unseen by the tracking mode)
            tree: Any = (args, kwargs)
            given = optree.tree_leaves(tree, none_is_leaf=True)  # (before the casts: written in place too)
            if tr.taint:  # after a branch on a varying value the arguments vary like it (cast as ops cast)
                tree = optree.tree_map(lambda x: _cast(x, tr), tree, none_is_leaf=True)
                args, kwargs = tree
            leaves = optree.tree_leaves(tree, none_is_leaf=True)
            masks = tuple(_vma.get(x, tr) if isinstance(x, torch.Tensor) else 0 for x in leaves)
        key = (id(tr.mesh), tr.where, masks)
        hit = self.compiled.get(key)
        if hit is None:
            region = _region_code(self.fn, tr.mesh, tr.where, masks)
            # a code object of its own: Dynamo's cache (and recompile limit) is per code object
            region = types.FunctionType(
                region.__code__.replace(), region.__globals__, self._name(), None, region.__closure__
            )
            hit = self.compiled[key] = (self.compile_fn(region), tr.mesh)
        compiled = hit[0]
        if tr.queue is not None:  # collectives queued in the call run first, in issue order
            tr.queue.flush()
        if tr.pending is not None:
            tr.pending.drain()
        _stack.pop()  # the call's trace and its tracking mode set aside while the region runs
        try:
            with torch.overrides._pop_mode_temporarily():
                out, (got, written) = compiled(*args, **kwargs)
        finally:
            _stack.append(tr)
        if written != masks:  # as the eager in-place rule does: the written argument varies as its value
            for x, g, m, w in zip(leaves, given, masks, written):
                if w != m:
                    _vma.tag(x, tr, w)
                    if g is not x:  # a cast's operand: the write reached it through the cast's view
                        _vma.tag(g, tr, w)
        outs = optree.tree_leaves(out, none_is_leaf=True)
        for o, m in zip(outs, got):
            if isinstance(o, torch.Tensor):
                if m:
                    _vma.tag(o, tr, m)
                elif hasattr(o, _vma._ATTR):
                    delattr(o, _vma._ATTR)
        return out

    def _name(self) -> str:
        return f"fs.compile({getattr(self.fn, '__qualname__', type(self.fn).__name__)}) region"
