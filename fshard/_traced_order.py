"""Ranks that trace different collectives into a compiled call: a `CollectiveError` on every rank,
raised at trace time, before any of their graphs runs.

Eager, the ranks' collectives are checked as they run (`_watchdog`: the tags an all-reduce carries,
``fs.debug``'s fingerprints). A compiled graph holds only the functional collectives, with no tag
and no record, and each rank compiles its own graph: ranks whose graphs differ in their
collectives (a Python branch on the rank, ``if mesh.axis_index("dp") == 0: y = fs.psum(y, "dp")``,
or a loop whose length differs by rank) paired different collectives when the graphs ran, and hung
(seen with gloo, until the process group's timeout) or returned wrong values.

While Dynamo traces a shard_map call, each collective fshard issues in it is noted (`note`, run at
trace time: its op, axes, dtype and shape, and the user's line); the backward's collectives are
among them, as Dynamo traces the primitives' backward rules with their forward. At the end of the
call's trace the ranks of the mesh compare their sequences (`agree`), group by group: the ranks
of one group must have traced the same collectives over that group, in the same order, and
nothing else is compared (each rank's graph may hold its own code elsewhere: an ``fs.switch``
branch per pipeline stage, with its own parameters' reductions and collectives over tp in one
stage only). Where a group's ranks differ, every rank of the mesh (each reads every sequence, so
each finds the same group) raises the same error, naming the first collective where they part.
The order of collectives of different groups is not compared. Nothing of this is in
the graph: a call of an already-compiled graph costs nothing.

The comparison goes through the rendezvous store (each rank sets its sequence under a key of the
call and its trace count, then reads the others'), never through a collective of the process
groups: a rank that traces alone (a recompile on one rank only: a guard on per-rank data, a
graph break on one rank) must not pair its check with the others' compiled collectives. Such a
rank waits for the others' sequences at most `WAIT` seconds (and at most half the process
group's timeout), then warns that the call is not checked, withdraws its key and stops checking
that call (so do the others when they next trace it alone). Limits:

* a check that waited out its time leaves the call unchecked from then on, on that rank; a rank
  reaching the check after a peer gave up may still raise alone (the others then meet its
  missing collectives: gloo's timeout);
* collectives outside a shard_map call in a compiled function, and ``fs.compile``'d regions
  called inside an eager call (traced apart from any call), are not compared;
* a job without a rendezvous store (a process group made from a store fshard cannot reach) is
  not checked.

What the partitioner does with the traced collectives is the same on every rank: a backward
collective stays in the backward (``_compile.keep_collectives_in_place``) and a forward one is never
recomputed there (torch saves collectives' results), so the sequences checked here are the
graphs'.
"""

from __future__ import annotations

import json
import os
import time
import warnings
import zlib

import torch
import torch.distributed as dist

from . import _compile, _mesh
from . import _watchdog as _watch
from ._errors import CollectiveError

__all__ = ["begin", "note", "agree"]

_log: list[tuple] = []  # the collectives noted in the call being traced
_on = [False]  # a shard_map call is being traced
_FSHARD_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


@torch._dynamo.assume_constant_result  # run at trace time, not traced
def begin() -> bool:
    """Start noting the collectives of the shard_map call Dynamo traces now."""
    _log.clear()
    _on[0] = True
    return True


@torch._dynamo.assume_constant_result  # run at trace time, not traced
def note(kind: str, op: str, names: tuple, dtype: torch.dtype, shape: tuple | None) -> bool:
    """Note a collective traced in the call (``op``: a reduction's, or ""; ``shape`` None: one
    that differs by rank, as a ``ppermute``'s blocks; a dim traced symbolically is -1)."""
    if _on[0]:
        what = f"{kind} ({op})" if op else kind
        back = " in the backward" if _compile._marks else ""  # (a primitive's backward being traced)
        _log.append((what, tuple(names), str(dtype).replace("torch.", ""), shape, _user_line() + back))
    return True


def _user_line() -> str:
    """``file:line`` of the innermost traced frame outside fshard and torch."""
    try:
        stack = torch._guards.TracingContext.extract_stack()
    except Exception:  # noqa: BLE001  (no tracing context: no line)
        return ""
    for frame in reversed(stack):
        name = os.path.abspath(frame.filename)
        if not name.startswith(_FSHARD_DIR) and not name.startswith(_TORCH_DIR):
            return f"{os.path.basename(name)}:{frame.lineno}"
    return ""


def _key(c: tuple) -> int:
    return zlib.crc32(repr(c[:4]).encode()) & 0x7FFFFFFF  # (the line is not compared: as fs.debug's tag)


def _describe(i: int, c: tuple) -> str:
    kind, names, dtype, shape, line = c
    size = "" if shape is None else " " + str(tuple("?" if d == -1 else d for d in shape))
    where = f" at {line}" if line and not line.startswith(" ") else line
    return f"#{i + 1} {kind} over {','.join(names)} of {dtype}{size}{where}"


WAIT = 120.0  # seconds a rank waits for the other ranks' sequences of a traced call
_POLL = 0.02
_traces: dict[tuple, int] = {}  # (the mesh's ranks, the call's name) -> traces of it on this rank
_unchecked: set[tuple] = set()  # calls whose check once waited out its time: not checked again


@torch._dynamo.assume_constant_result  # run at trace time, not traced
def agree(where: str, mesh_text: str) -> bool:
    """At the end of the traced call of ``fs.shard_map(where)``: compare the noted collectives with
    the other ranks of the mesh; raise the same `CollectiveError` on every rank if they differ."""
    _on[0] = False
    log = list(_log)
    _log.clear()
    mesh = _mesh.by_text(mesh_text)
    call = (mesh.ranks, where)
    if mesh.size == 1 or not dist.is_initialized() or call in _unchecked:
        return True
    try:
        store = _watch._store("traced collectives")
    except Exception:  # noqa: BLE001  (no default store: not checked)
        return True
    n = _traces[call] = _traces.get(call, 0) + 1
    prefix = f"fshard/traced/{zlib.crc32(repr(call).encode())}/{n}/"
    mine = prefix + str(dist.get_rank())
    store.set(mine, json.dumps([[_key(c), _describe(i, c), list(c[1])] for i, c in enumerate(log)]))
    keys = [prefix + str(r) for r in mesh.ranks]
    deadline = time.monotonic() + _wait()
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [r for r, k in zip(mesh.ranks, keys) if k != mine and not store.check([k])]
            store.delete_key(mine)
            _unchecked.add(call)
            warnings.warn(
                f"fshard: the collectives traced into the compiled graph of fs.shard_map({where}) "
                f"were not compared with the other ranks': {_watch._ranks_text(missing)} did not "
                f"trace the call within {_wait():g} s (a recompile on this rank only, or a rank "
                f"held up elsewhere); this call is not checked again",
                UserWarning,
                stacklevel=2,
            )
            return True
        time.sleep(_POLL)
    everyone = {r: json.loads(store.get(k)) for r, k in zip(mesh.ranks, keys)}
    differ = _first_group_that_differs(everyone, mesh)
    if differ is None:
        return True
    names, seqs = differ
    k = next(
        i
        for i in range(max(map(len, seqs.values())))
        if len({s[i][0] if i < len(s) else None for s in seqs.values()}) > 1
    )
    by: dict[str, list[int]] = {}
    for r, s in seqs.items():
        by.setdefault(s[k][1] if k < len(s) else f"no collective #{k + 1} (it traced {len(s)})", []).append(r)
    bullets = "\n".join(
        f"  - {_watch._ranks_text(sorted(r))}: {d}" for d, r in sorted(by.items(), key=lambda kv: min(kv[1]))
    )
    who = "mesh" if len(seqs) == mesh.size else f"group over {','.join(names)}"
    raise CollectiveError(
        f"fshard: the ranks of the {who} ({_watch._ranks_text(sorted(seqs))}) traced different "
        f"collectives into their compiled graphs of fs.shard_map({where}):\n{bullets}\n"
        f"Nothing was sent: every rank raised this error while Dynamo traced the call, before its "
        f"graph ran. {_watch._ORDER_FIX}"
    )


def _first_group_that_differs(seqs: dict, mesh) -> tuple | None:
    """``(axes, {rank: its collectives over axes})`` of the first group whose ranks traced
    different collectives over its axes, or None. Only the ranks of one group must agree, on the
    collectives over that group: each rank's graph may hold its own code elsewhere (an ``fs.switch``
    branch per pipeline stage: parameters of other shapes, collectives over tp in one stage only)."""
    names = list(mesh.axis_names)
    sizes = [mesh.axis_size(a) for a in names]
    where = {}
    for i, r in enumerate(mesh.ranks):  # each rank's coordinates (row-major, as the mesh's ranks)
        coords = []
        for n in reversed(sizes):
            coords.append(i % n)
            i //= n
        where[r] = list(reversed(coords))
    for axes in sorted({tuple(c[2]) for s in seqs.values() for c in s}):
        groups: dict[tuple, list] = {}
        for r in seqs:  # the ranks that share the coordinates off these axes
            groups.setdefault(tuple(x for a, x in zip(names, where[r]) if a not in axes), []).append(r)
        for members in groups.values():
            sub = {r: [c for c in seqs[r] if tuple(c[2]) == axes] for r in members}
            if len({tuple(c[0] for c in s) for s in sub.values()}) > 1:  # (not the lines: as the tags)
                return axes, sub
    return None


def _wait() -> float:
    """`WAIT`, and at most half the process group's timeout (the others may be waiting in it)."""
    timeout = _watch.collective_timeout()
    return WAIT if timeout is None else min(WAIT, timeout.total_seconds() / 2)
