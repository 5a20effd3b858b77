"""Debug mode: cross-rank checks that cost communication, off by default.

``with fs.debug():`` (or ``FSHARD_DEBUG=1`` in the environment) makes every shard_map call
check, with one or two small all-gathers over the mesh, what no rank can see alone:

* plain tensor inputs (global values, so the same on every rank) hold the same bytes on every
  rank (a digest per input is compared);
* outputs have the same structure and local shapes on every rank (data-dependent shapes such
  as ``x[mask]`` differ per rank);

and every collective checks, with one small all-gather over its group before it is issued, that
every rank of the group is issuing the same one (sequence number, op, axes, shape, dtype, call
site; see ``_watchdog``), raising `CollectiveError` on every rank otherwise.

A failed check raises `TracingError` on every rank with the same message.

Compiled calls check the inputs and outputs the same way, at every run of the graph: each check
is one `gathered_check` (a row of small ints per rank, all-gathered, and a `checker` that raises
when the rows disagree), which Dynamo traces into the graph as the all-gather and the
``fshard::debug_check`` op; what is known at trace time (shapes, tree structures) is a constant of
the row, what is not (the inputs' digests, a dynamic dim's size) an op computing it as the graph
runs. A compiled graph's collectives are compared with the other ranks' once per trace
(`_traced_order`) instead of each being checked as it runs.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
from collections.abc import Callable
from typing import Any

import optree
import torch

from . import _comm, _watchdog
from ._comm import untracked
from ._errors import TracingError
from ._scalars import symbolic

__all__ = ["debug"]

enabled: bool = os.environ.get("FSHARD_DEBUG", "") not in ("", "0")


class debug:
    """Turn fshard's cross-rank debug checks on (or off) inside a ``with`` block.

    Checks cost one or two small all-gathers per ``shard_map`` call and one per collective (the
    collective's fingerprint: every rank of the group must be issuing the same one); set
    ``FSHARD_DEBUG=1`` in the environment to turn them on for a whole run. Turn debug mode on on
    every rank alike: the checks are collectives themselves. A call compiled under debug mode
    (``torch.compile``, ``fs.compile``) holds the input and output checks in its graph and makes
    them at every run.

    Examples:
        >>> with fs.debug():
        ...     loss = step(params, batch)   # raises TracingError if ranks were given different batches
    """

    def __init__(self, on: bool = True):
        self.on = on
        self._saved: list[bool] = []

    def __enter__(self) -> debug:
        global enabled
        self._saved.append(enabled)
        enabled = _watchdog.S.check = self.on
        return self

    def __exit__(self, *exc) -> None:
        global enabled
        enabled = _watchdog.S.check = self._saved.pop()


def _digest(t: torch.Tensor) -> int:
    with untracked():
        data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def _sig(obj) -> int:
    """A digest of ``repr(obj)``: the same object, the same number on every rank."""
    return _sig_text(repr(obj))


def _sig_text(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


_sig_at_trace_time = torch._dynamo.assume_constant_result(_sig)


@torch._dynamo.assume_constant_result
def _repr_at_trace_time(obj) -> str:
    return repr(obj)


def sig_with_dims(static, dims: list) -> Any:
    """``_sig((static, tuple(dims)))``: a digest of a description (``static``: Python literals) and
    of the sizes it lists apart (``dims``: the dims of the shapes it describes). While Dynamo traces
    with dynamic shapes, some of ``dims`` are symbolic: the digest is then made as the graph runs
    (`_sig_op`), by the same formula, so that ranks compare their sizes at each run."""
    if not torch.compiler.is_compiling():
        return _sig((static, tuple(dims)))
    if not any(symbolic(d) for d in dims):
        return _sig_at_trace_time((static, tuple(dims)))
    return _SIG(list(dims), _repr_at_trace_time(static))


@torch.library.custom_op("fshard::debug_sig", mutates_args=())
def _sig_op(dims: list[int], static: str) -> torch.Tensor:
    """`sig_with_dims` in a compiled graph with symbolic sizes: a 0-d int64 tensor on the CPU."""
    return torch.tensor(_sig_text(f"({static}, {tuple(dims)!r})"), dtype=torch.int64)


@_sig_op.register_fake
def _sig_fake(dims: list[int], static: str) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


_SIG = torch.ops.fshard.debug_sig.default


def digest(tensors: list) -> Any:
    """A digest of the bytes of ``tensors`` (a list of them): an int, or while Dynamo traces a 0-d
    int64 tensor the graph computes as it runs (`_digest_op`), so that a compiled call compares the
    values of each run."""
    if torch.compiler.is_compiling():
        with untracked():
            return _DIGEST([t.detach() for t in tensors])
    return _sig([_digest(t) for t in tensors]) if len(tensors) != 1 else _digest(tensors[0])


@torch.library.custom_op("fshard::debug_digest", mutates_args=())
def _digest_op(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`digest` of ``tensors`` in a compiled graph: a 0-d int64 tensor on the CPU."""
    return torch.tensor(digest(tensors), dtype=torch.int64)


@_digest_op.register_fake
def _digest_fake(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


_DIGEST = torch.ops.fshard.debug_digest.default

# -- checks of one row per rank ------------------------------------------------------------------

_CHECKERS: dict[str, Callable] = {}


def checker(fn: Callable) -> Callable:
    """Register ``fn(rows, ranks, *data)`` (it raises when the ranks' rows disagree) for
    `gathered_check`, by name: a compiled graph names it in its code."""
    _CHECKERS[f"{fn.__module__}.{fn.__qualname__}"] = fn
    return fn


def gathered_check(mesh, where: str, row: list, fn: Callable, *data) -> None:
    """Gather ``row`` (ints, or `digest` tensors while compiling) from every rank of ``mesh`` (one
    small all-gather) and call ``fn(rows, mesh.ranks, *data)`` (a `checker`; ``data``: Python
    literals), which raises the same error on every rank when the rows disagree.

    Eager, ``fn`` is called at once. While Dynamo traces, the all-gather is traced into the graph,
    followed by the ``fshard::debug_check`` op, which calls ``fn`` with the gathered rows each time
    the graph runs: a compiled call checks every run, as an eager call does."""
    g = mesh.axis_group(mesh.axis_names, where)
    if not torch.compiler.is_compiling():
        with untracked():
            t = torch.tensor(row, dtype=torch.int64, device=mesh.device)
            rows = _comm.all_gather_blocks(t, g).tolist()
        fn(rows, tuple(mesh.ranks), *data)
        return
    with untracked():
        parts = [
            v.to(mesh.device)
            if isinstance(v, torch.Tensor)
            else torch.tensor(v, dtype=torch.int64, device=mesh.device)
            for v in row
        ]
        rows_t = _comm.all_gather_blocks(torch.stack(parts), g)
    _CHECK(rows_t, _spec_at_trace_time(fn, tuple(mesh.ranks), data))


@torch._dynamo.assume_constant_result
def _spec_at_trace_time(fn: Callable, ranks: tuple, data: tuple) -> str:
    key = f"{fn.__module__}.{fn.__qualname__}"
    spec = repr((key, ranks, data))
    if ast.literal_eval(spec) != (key, ranks, data):  # (fshard's own checks pass literals only)
        raise TypeError(f"fshard: a debug check's data must be Python literals, got {data!r}")
    return spec


@torch.library.custom_op(
    "fshard::debug_check",
    mutates_args=(),
    # its Python must run at every run of the graph: not captured in a CUDA graph
    tags=(torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else (),
)
def _check_op(rows: torch.Tensor, spec: str) -> None:
    """A compiled graph's `gathered_check`: the checker ``spec`` names, on the gathered ``rows``."""
    key, ranks, data = _parse(spec)
    _CHECKERS[key](rows.tolist(), ranks, *data)


@_check_op.register_fake
def _check_fake(rows: torch.Tensor, spec: str) -> None:
    return None


@functools.lru_cache(maxsize=256)
def _parse(spec: str) -> tuple:
    return ast.literal_eval(spec)


_CHECK = torch.ops.fshard.debug_check.default
torch.fx.node.has_side_effect(_CHECK)  # kept by dead-code elimination: it has no users


def _groups(rows: list, mesh) -> str:
    return groups_text(rows, tuple(mesh.ranks))


def groups_text(rows: list, ranks) -> str:
    """``rank 0, 1; rank 2``: the ranks (in mesh order) grouped by equal rows."""
    by: dict = {}
    for rank, row in zip(ranks, rows):
        by.setdefault(repr(row), []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for r in by.values())


def check_inputs(name: str, mesh, leaves, plans, kind) -> None:
    """Plain tensor inputs (plans of ``kind``, shard_map's ``InKind.GLOBAL``) must hold the same
    global value on every rank."""
    idx = [i for i, p in enumerate(plans) if p.kind is kind]
    if not idx or mesh.size == 1:
        return
    paths = tuple(str(plans[i].path) for i in idx)
    gathered_check(mesh, "debug", [digest([leaves[i]]) for i in idx], _inputs_differ, name, paths)


@checker
def _inputs_differ(rows: list, ranks: tuple, name: str, paths: tuple) -> None:
    bad = [k for k in range(len(paths)) if len({row[k] for row in rows}) > 1]
    if bad:
        parts = []
        for k in bad:
            col = [row[k] for row in rows]
            parts.append(f"{paths[k]} differs across ranks (equal within: {groups_text(col, ranks)})")
        raise TracingError(
            f"fs.shard_map({name}) [debug]: {'; '.join(parts)}; a plain tensor argument is the global value, "
            f"the same on every rank: seed random generators the same way on every rank, take one rank's "
            f"copy with fs.shard(x, mesh, spec, src=0), or pass per-rank blocks as fs.Sharded(local, mesh, spec)"
        )


def check_outputs(name: str, mesh, out, uneven: bool = False) -> None:
    """Outputs (the tree ``out``) must have the same structure and local shapes on every rank (with
    ``uneven`` blocks: the same numbers of dims)."""
    if mesh.size == 1:
        return
    dims: list = []

    def leaf(x):
        if not isinstance(x, torch.Tensor):
            return None
        return x.dim() if uneven else shape_of(x, dims)

    gathered_check(mesh, "debug", [sig_with_dims(skeleton_of(out, leaf), dims)], _outputs_differ, name)


def shape_of(x: torch.Tensor, dims: list) -> str:
    """The shape of ``x`` in a `sig_with_dims` description: its sizes go to ``dims``."""
    dims.extend(x.shape)
    return f"shape{x.dim()}"


def skeleton_of(tree, leaf: Callable, is_leaf: Callable | None = None):
    """``tree`` with each leaf replaced by ``leaf(x)`` (its shape, ...): its structure and the leaves'
    descriptions as plain containers, which `sig_with_dims` digests (also while Dynamo traces, where the tree's
    structure object is not a constant)."""
    return optree.tree_map(leaf, tree, is_leaf=is_leaf, none_is_leaf=True)


@checker
def _outputs_differ(rows: list, ranks: tuple, name: str) -> None:
    if len({row[0] for row in rows}) == 1:
        return
    raise TracingError(
        f"fs.shard_map({name}) [debug]: f returned outputs whose structure or local shapes differ across "
        f"ranks (equal within: {groups_text([row[0] for row in rows], ranks)}); a data-dependent shape (x[mask], nonzero, unique) on a varying value differs per rank: pad it to "
        f"a fixed size (torch.where with a fill value) or return the mask with the values"
    )
