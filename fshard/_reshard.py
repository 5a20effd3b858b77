"""``fs.reshard_after_forward``: gathered parameters freed after the forward, gathered again in the backward.

The per-leaf FSDP form, ``optree.tree_map(lambda p: fs.all_gather(p, "dp", dim=0, tiled=True),
params)`` at the top of the step (or inside each layer), keeps every gathered parameter alive
from the forward to the backward: autograd saves them for the weight-times-activation
gradients. That is JAX's behaviour and FSDP2's with ``reshard_after_forward=False``. Inside
this scope the all_gather results autograd saves are kept as placeholders instead
(``torch.autograd.graph.saved_tensors_hooks``, as `fs.fsdp_scan` does per layer): the backward
gathers them again when it first needs one, one all-gather per combined bucket (or per call),
and drops them after their last use. Memory then follows FSDP2's ``reshard_after_forward=True``:
the sharded parameters plus the buckets the backward is working on, for one more all-gather of
the gathered parameters per step.

What is gathered again, and how:

- the result of an ``fs.all_gather`` issued in the scope while gradients are recorded (combined
  per-leaf calls, a pytree call, a single call, ``async_op=True``, ``invariant=True``), or a view
  of one (``w.T``, ``w[:k]``, ``w.view(...)``) that an op saves; a copy made from one (``w.to(bf16)``)
  is kept as usual;
- by the same collective as in the forward, from the operands of the call (the shards, which
  the parameters hold anyway), in the order the backward asks for them, which is the same on
  every rank; a shard changed in place between the forward and the backward raises;
- under ``create_graph`` (double backward) the gather is made differentiable again, so
  second-order gradients reach the shards as they do without the scope.

Not applied (the gathered results are kept, the values are the same) under torch.func
transforms (which refuse saved-tensor hooks) and while torch.compile traces (the compiled
backward keeps or recomputes what its partitioner decides).
"""

from __future__ import annotations

import contextlib

import torch

from . import _comm, _counts, _state, _vma
from ._comm import untracked
from ._errors import ArgumentError
from ._primitives import (
    AllGather,
    AllGatherCoalesced,
    AllGatherInvariant,
    _arrange,
    apply,
    gather_operand,
    pack_operands,
    tilings,
    unpack_gathered,
)

__all__ = [
    "reshard_after_forward",
    "active",
    "Gathers",
    "Single",
    "Many",
    "gather_again",
    "gather_again_many",
    "note",
]

_ATTR = "_fshard_regather"
_scopes: list = []


@_state.job_state(order=40)
def _reset() -> None:
    """A new job: no gather-again scope an earlier job left open."""
    _scopes.clear()


def active() -> bool:
    """Whether an all_gather issued now gets its results gathered again in the backward."""
    return bool(_scopes) and torch.is_grad_enabled()


class reshard_after_forward(contextlib.ContextDecorator):
    """Free gathered parameters after the forward and gather them again in the backward.

    Inside this context (or the function it decorates), the ``fs.all_gather`` results that
    autograd saves for the backward, and views of them, are not kept: the backward gathers
    them again (one all-gather per combined bucket) when it first needs them and frees them
    after their last use, as FSDP2's ``reshard_after_forward=True``. Values and gradients are
    unchanged (second order included); the cost is one more all-gather of the gathered
    parameters per step. Use it around the forward, inside ``f`` or around the whole call.

    Not applied under torch.func transforms or while torch.compile traces (the results are
    then kept, as outside the context). `fs.fsdp_scan` already does this per layer.

    Examples:
        >>> def loss_fn(params, x):
        ...     with fs.reshard_after_forward():
        ...         full = optree.tree_map(lambda p: fs.all_gather(p, "dp", dim=0, tiled=True), params)
        ...         return fs.pmean(model(full, x).mean(), "dp")
    """

    def __enter__(self):
        if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
            scope = None
        else:
            scope = _Scope()
            scope.hooks.__enter__()
            _scopes.append(scope)
        self.__dict__.setdefault("_entered", []).append(scope)  # (re-entrant, as a decorator)
        return self

    def __exit__(self, *exc):
        scope = self._entered.pop()
        if scope is not None:
            _scopes.remove(scope)
            scope.last = None
            scope.hooks.__exit__(*exc)
            _forget_casts()
        return False


class _Scope:
    """One entry of `reshard_after_forward`: its hooks, and the last gather made in it (the
    backward gathers again in the reverse order: each one starts the one before it)."""

    __slots__ = ("hooks", "last")

    def __init__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        self.last: Gathers | None = None


def _forget_casts() -> None:
    """Drop the running call's cached casts (pvary) of gathered results: the cache would keep them
    alive until the call returns, through a backward run inside it (``fs.value_and_grad`` in f)."""
    tr = _vma.active()
    cache = tr.pvary_cache if tr is not None else None
    if cache:
        with untracked():
            for key in [key for key, (x, _) in cache.items() if _entry(x) is not None]:
                del cache[key]


def _entry(t):
    e = getattr(t, _ATTR, None)
    if e is None and t._base is not None:
        e = getattr(t._base, _ATTR, None)
    return e


class Gathers:
    """The results of one gather (a call, or a combined bucket) that can be gathered again.

    ``run`` (`Single`, `Many`) makes the results from the operands ``xs`` with the same layouts
    as in the forward: ``run.start(xs)`` launches the all-gather, ``run.finish(handle, xs)`` waits
    and unpacks; ``run.grad(xs)`` differentiably (double backward). The backward gathers the
    last bucket of the forward first; when one is gathered, the one made before it is started
    (``prev``), so that it is on the wire while the backward computes, as FSDP2 prefetches."""

    __slots__ = ("run", "xs", "versions", "saved", "left", "cache", "handle", "prev", "spent")

    def __init__(self, run):
        self.run = run
        self.xs: list = []
        self.versions: list[int] = []
        self.saved = 0  # placeholders left in the graph
        self.left = 0  # of them, not yet unpacked in this backward
        self.cache: list | None = None
        self.handle = None  # its all-gather in the backward, when started ahead (prefetched)
        self.spent = False  # gathered again and used up in this backward (not to be started ahead)
        scope = _scopes[-1] if _scopes else None
        self.prev: Gathers | None = scope.last if scope is not None else None
        if scope is not None:
            scope.last = self

    def add(self, x: torch.Tensor) -> int:
        """Take one more operand; returns its result's index."""
        with untracked():  # (inside f: attribute reads must not reach VmaMode, which would flush)
            self.xs.append(x)
            self.versions.append(x._version)
        return len(self.xs) - 1

    def _check(self) -> None:
        for x, v in zip(self.xs, self.versions):
            if x._version != v:
                raise ArgumentError(
                    f"fs.reshard_after_forward: the operand of an fs.all_gather (a {str(x.dtype)[6:]} "
                    f"shard of shape {tuple(x.shape)}) was modified in place between the forward and "
                    f"the backward, which gathers it again; update parameters after the backward, or "
                    f"gather outside fs.reshard_after_forward to keep the gathered copy"
                )

    def _start(self):
        with torch.no_grad():
            return self.run.start(self.xs)

    def results(self) -> list:
        """The results, gathered again (once per backward; freed after the last placeholder)."""
        if torch.is_grad_enabled():  # create_graph: differentiable, not cached
            self._check()
            if self.handle is not None:  # started ahead: waited for and dropped
                self.handle, handle = None, self.handle
                handle.wait()
            return self.run.grad(self.xs)
        if self.cache is None:
            handle, self.handle = self.handle, None
            if handle is None:
                self._check()
                handle = self._start()
            self.spent = False
            prev = self.prev  # (a bucket used up already, e.g. the head's, used first: not again)
            if (
                prev is not None
                and prev.saved
                and prev.cache is None
                and prev.handle is None
                and not prev.spent
            ):
                prev._check()
                prev.handle = prev._start()
            with torch.no_grad():
                self.cache = self.run.finish(handle, self.xs)
            self.left = self.saved
        got = self.cache
        self.left -= 1
        if self.left <= 0:
            self.cache = None
            self.spent = True
        return got


def note(y: torch.Tensor, gathers: Gathers, k: int, root: bool = True) -> None:
    """Mark result ``k`` of ``gathers`` (and, with ``root``, the tensor it is a view of, when it
    is the only result in it) so that saved views of it become placeholders."""
    with untracked():
        setattr(y, _ATTR, (gathers, k, False))
        b = y._base
        if root and b is not None:
            setattr(b, _ATTR, (gathers, k, True))


class Single:
    """One all_gather's result gathered again, as in the forward (``cls``: its Function)."""

    __slots__ = ("cls", "g", "dim", "tiled")

    def __init__(self, cls, g, dim, tiled):
        self.cls, self.g, self.dim, self.tiled = cls, g, dim, tiled

    def start(self, xs):
        return _comm.all_gather_start(gather_operand(xs[0], self.dim, self.tiled), self.g)

    def finish(self, handle, xs) -> list:
        return [_arrange(handle.wait(), xs[0].shape, self.g.size, self.dim, self.tiled)]

    def grad(self, xs) -> list:
        return [apply(self.cls, xs[0], self.g, self.dim, self.tiled)]


class Many:
    """The results of a coalesced all_gather, or of a combined bucket of per-leaf calls
    (``contiguous``: its results were made contiguous, and `fs.count_collectives` counts its
    calls), gathered again with one all-gather."""

    __slots__ = ("g", "dims", "tiled", "invariant", "contiguous")

    def __init__(self, g, dims, tiled, invariant, contiguous: bool = False):
        self.g, self.dims, self.tiled, self.invariant = g, dims, tiled, invariant
        self.contiguous = contiguous

    def start(self, xs):
        handle = _comm.all_gather_start(pack_operands(xs, self.dims, self.tiled), self.g)
        if self.contiguous:  # a combined bucket: the collective carries its calls again
            _counts.record_combined("all_gather", self.g, len(xs))
        return handle

    def finish(self, handle, xs) -> list:
        ys = unpack_gathered(handle.wait(), [x.shape for x in xs], self.dims, self.tiled)
        return [y.contiguous() for y in ys] if self.contiguous else ys

    def grad(self, xs) -> list:
        ys = apply(AllGatherCoalesced, self.g, tuple(self.dims), self.tiled, self.invariant, *xs)
        return [y.contiguous() for y in ys] if self.contiguous else list(ys)


def gather_again(y: torch.Tensor, x, cls, g, dim, tiled) -> None:
    """``y = cls(x, g, dim, tiled)`` (one all_gather) is gathered again in the backward."""
    with untracked():
        grad = y.requires_grad
    if grad:
        gathers = Gathers(Single(cls, g, dim, tiled))
        note(y, gathers, gathers.add(x))


def gather_again_many(ys, xs, g, dims, tiled, invariant) -> None:
    """The results ``ys`` of one coalesced all_gather of ``xs`` are gathered again in the backward."""
    with untracked():
        grad = ys[0].requires_grad
    if not grad:
        return
    if len(ys) == 1:
        gather_again(
            ys[0], xs[0], AllGatherInvariant if invariant else AllGather, g, dims[0], tilings(tiled, 1)[0]
        )
        return
    gathers = Gathers(Many(g, dims, tiled, invariant))
    for x, y in zip(xs, ys):  # the results share one buffer: they are marked, not the buffer
        note(y, gathers, gathers.add(x), root=False)


class _Saved:
    """A placeholder in the autograd graph for a saved (view of a) gathered result."""

    __slots__ = ("gathers", "k", "root", "size", "stride", "offset")

    def __init__(self, gathers: Gathers, k: int, root: bool, size, stride, offset: int):
        self.gathers, self.k, self.root = gathers, k, root
        self.size, self.stride, self.offset = size, stride, offset


def _pack(t):
    with untracked():
        e = getattr(t, _ATTR, None)
        via = t
        if e is None:
            b = t._base
            if b is None:
                return t
            e = getattr(b, _ATTR, None)
            if e is None:
                return t
            via = b
        if t.dtype != via.dtype or t.is_conj() or t.is_neg():
            return t
        gathers, k, root = e
        gathers.saved += 1
        return _Saved(gathers, k, root, t.size(), t.stride(), t.storage_offset() - via.storage_offset())


def _unpack(saved):
    if not isinstance(saved, _Saved):
        return saved
    with untracked():
        y = saved.gathers.results()[saved.k]
        if saved.root:
            y = y._base
        return y.as_strided(saved.size, saved.stride, y.storage_offset() + saved.offset)
