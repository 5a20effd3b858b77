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
"""

from __future__ import annotations

import hashlib
import os

import torch

from . import _comm, _watchdog
from ._comm import untracked
from ._errors import TracingError

__all__ = ["debug"]

enabled: bool = os.environ.get("FSHARD_DEBUG", "") not in ("", "0")


class debug:
    """Turn fshard's cross-rank debug checks on (or off) inside a ``with`` block.

    Checks cost one or two small all-gathers per ``shard_map`` call and one per collective (the
    collective's fingerprint: every rank of the group must be issuing the same one); set
    ``FSHARD_DEBUG=1`` in the environment to turn them on for a whole run. Turn debug mode on on
    every rank alike: the checks are collectives themselves.

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


def _gather(values: list[int], mesh) -> list[list[int]]:
    """Every rank's ``values`` (equal lengths), in mesh order."""
    g = mesh.axis_group(mesh.axis_names, "debug")
    t = torch.tensor(values, dtype=torch.int64, device=mesh.device)
    return _comm.all_gather_blocks(t, g).tolist()


def _groups(rows: list, mesh) -> str:
    by: dict = {}
    for rank, row in zip(mesh.ranks, rows):
        by.setdefault(repr(row), []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for r in by.values())


def check_inputs(name: str, mesh, leaves, plans, kind) -> None:
    """Plain tensor inputs (plans of ``kind``, shard_map's ``InKind.GLOBAL``) must hold the same
    global value on every rank."""
    idx = [i for i, p in enumerate(plans) if p.kind is kind]
    if not idx or mesh.size == 1:
        return
    rows = _gather([_digest(leaves[i]) for i in idx], mesh)
    bad = [k for k in range(len(idx)) if len({row[k] for row in rows}) > 1]
    if bad:
        parts = []
        for k in bad:
            col = [row[k] for row in rows]
            parts.append(f"{plans[idx[k]].path} differs across ranks (equal within: {_groups(col, mesh)})")
        raise TracingError(
            f"fs.shard_map({name}) [debug]: {'; '.join(parts)}; a plain tensor argument is the global value, "
            f"the same on every rank: seed random generators the same way on every rank, take one rank's "
            f"copy with fs.shard(x, mesh, spec, src=0), or pass per-rank blocks as fs.Sharded(local, mesh, spec)"
        )


def check_outputs(name: str, mesh, leaves, key, uneven: bool = False) -> None:
    """Outputs must have the same structure and local shapes on every rank (with ``uneven`` blocks:
    the same numbers of dims)."""
    if mesh.size == 1:
        return
    shapes = [
        (x.dim() if uneven else tuple(x.shape)) if isinstance(x, torch.Tensor) else None for x in leaves
    ]
    sig = int.from_bytes(hashlib.blake2b(repr((key[0], shapes)).encode(), digest_size=7).digest(), "little")
    rows = _gather([sig], mesh)
    if len({row[0] for row in rows}) == 1:
        return
    raise TracingError(
        f"fs.shard_map({name}) [debug]: f returned outputs whose structure or local shapes differ across "
        f"ranks (equal within: {_groups([row[0] for row in rows], mesh)}); a data-dependent shape (x[mask], nonzero, unique) on a varying value differs per rank: pad it to "
        f"a fixed size (torch.where with a fill value) or return the mask with the values"
    )
