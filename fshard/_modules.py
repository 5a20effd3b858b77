"""``torch.nn.Module`` buffers under data parallelism: `sync_buffers` and `check_buffers`.

A module used inside a shard_map'd function (captured by a closure, or called with
``torch.func.functional_call``) updates its buffers on every rank with that rank's own data:
BatchNorm's running statistics then drift apart across the data-parallel ranks, where DDP
broadcasts rank 0's buffers. ``sync_buffers`` averages the floating buffers over a mesh axis
inside the call (one all-reduce per dtype); ``check_buffers`` compares a digest of every buffer
across the mesh (one small all-gather) and raises on every rank alike when they differ.
"""

from __future__ import annotations

import hashlib

import torch

from . import _comm, _vma
from ._collectives import pmean, pvary
from ._debug import _groups
from ._errors import ArgumentError, TracingError, report
from ._mesh import Mesh

__all__ = ["sync_buffers", "check_buffers"]


def _module(module, where: str) -> torch.nn.Module:
    if not isinstance(module, torch.nn.Module):
        raise ArgumentError(f"fs.{where} needs a torch.nn.Module, got {type(module).__name__}")
    return module


def sync_buffers(module: torch.nn.Module, axis) -> None:
    """Replace every floating-point buffer of ``module`` by its mean over mesh axis ``axis``, in place.

    Call it inside the function run by ``fs.shard_map``, after the forward pass that updated the
    buffers. Each rank's BatchNorm updates its running statistics with its own batch; afterwards
    every rank along ``axis`` holds the same values. With equal per-rank batches,
    ``running_mean`` is then exactly the one a single process computes on the whole batch, and
    ``running_var`` is the mean of the per-rank (unbiased) batch variances, which leaves out the
    spread between the per-rank means (DDP keeps rank 0's buffers instead). Integer buffers
    (``num_batches_tracked``) are left as they are: every rank counts the same steps.

    The buffers of one dtype travel in one all-reduce over ``axis``; it runs under
    ``torch.no_grad()`` and adds nothing to the backward.

    Args:
        module: the module whose buffers (``module.named_buffers()``, submodules included) to average.
        axis: a mesh axis name, or a tuple of names (the data-parallel axes).

    Raises:
        CollectiveError: when called outside a function run by ``fs.shard_map``, or ``axis`` is
            not an axis of the mesh.
        ArgumentError: when ``module`` is not a ``torch.nn.Module``.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
        >>> @fs.shard_map(mesh=mesh, in_specs=("(dp b) d",), out_specs="")
        ... def loss_fn(x):
        ...     loss = fs.pmean(model(x).square().mean(), "dp")
        ...     fs.sync_buffers(model, "dp")      # the same running statistics on every rank
        ...     return loss
    """
    bufs = [b for b in _module(module, "sync_buffers").buffers() if b.is_floating_point()]
    tr = _vma.current("sync_buffers")
    g = tr.mesh.axis_group(axis, "sync_buffers")
    if not bufs or g.size == 1:
        return
    with torch.no_grad():
        # A buffer updated in place inside f is not tracked (it reads as the same on every rank,
        # which it is not): mark it as varying over axis, so that pmean really averages it.
        means = pmean([pvary(b, axis) for b in bufs], axis)
        for b, m in zip(bufs, means):
            # Through .data: the write does not bump the buffer's autograd version. BatchNorm in
            # training mode saves its running statistics for the backward but does not read them
            # there, so the backward after this call must not fail on them.
            b.data.copy_(m)


def _digest(name: str, t: torch.Tensor) -> int:
    with _comm.untracked():
        data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    h = hashlib.blake2b(f"{name} {t.dtype} {tuple(t.shape)}".encode(), digest_size=7)
    h.update(data)
    return int.from_bytes(h.digest(), "little")


def _varying_axes(col: list[int], mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes along which ``col`` (one value per mesh position, row-major) changes."""
    names, sizes = mesh.axis_names, [mesh.shape[n] for n in mesh.axis_names]
    coords = []  # the row-major coordinate of every position
    for flat in range(len(col)):
        c, rem = [], flat
        for s in reversed(sizes):
            c.append(rem % s)
            rem //= s
        coords.append(c[::-1])
    out = []
    for d, n in enumerate(names):
        lines: dict = {}
        for c, v in zip(coords, col):
            lines.setdefault(tuple(c[:d] + c[d + 1 :]), set()).add(v)
        if any(len(vals) > 1 for vals in lines.values()):
            out.append(n)
    return tuple(out)


def check_buffers(module: torch.nn.Module, mesh: Mesh, axis=None) -> None:
    """Raise `TracingError`, on every rank alike, if a buffer of ``module`` differs across ranks.

    One all-gather over the whole mesh of a small digest of every buffer (``module.named_buffers()``,
    submodules included, integer buffers too); no buffer is sent. Call it outside
    ``fs.shard_map``, every rank at the same point (it is a collective), e.g. every few hundred
    steps or before saving a checkpoint, to catch running statistics that drifted apart because
    `sync_buffers` was not called. Every rank must hold a module of the same structure.

    Args:
        module: the module to check.
        mesh: the mesh the ranks form.
        axis: the mesh axes along which the buffers must agree (a name or a tuple); by default
            every axis. A tensor-parallel model whose ranks hold different blocks checks ``"dp"``.

    Raises:
        TracingError: naming every buffer that differs, the axes it differs along, which ranks
            hold equal copies, and the `sync_buffers` call that fixes it.
        ArgumentError: when ``module`` is not a ``torch.nn.Module`` or ``mesh`` is not an ``fs.Mesh``.
        CollectiveError: when ``axis`` is not an axis of the mesh.

    Examples:
        >>> for step, (x, y) in enumerate(batches):
        ...     loss = train_step(x, y)
        ...     if step % 100 == 0:
        ...         fs.check_buffers(model, mesh)   # raises if the ranks' running statistics drifted
    """
    _module(module, "check_buffers")
    if not isinstance(mesh, Mesh):
        raise ArgumentError(f"fs.check_buffers needs an fs.Mesh, got {type(mesh).__name__}")
    axes = mesh.axis_names if axis is None else mesh.check_axes(axis, "check_buffers")
    named = list(module.named_buffers())
    if not named or mesh.size == 1:
        return
    g = mesh.axis_group(mesh.axis_names, "check_buffers")
    mine = [_digest(n, b) for n, b in named]
    with _comm.untracked():
        t = torch.tensor(mine, dtype=torch.int64, device=mesh.device)
        rows = _comm.all_gather_blocks(t, g).tolist()
    problems, fix_axes = [], set()
    for k, (name, _) in enumerate(named):
        col = [row[k] for row in rows]
        along = [a for a in _varying_axes(col, mesh) if a in axes]
        if not along:
            continue
        fix_axes.update(along)
        problems.append(f"{name} differs along {', '.join(along)} (equal within: {_groups(col, mesh)})")
    if not problems:
        return
    fix = [a for a in mesh.axis_names if a in fix_axes]
    arg = repr(fix[0]) if len(fix) == 1 else repr(tuple(fix))
    n = len(problems)
    raise TracingError(
        report(
            f"fs.check_buffers: {n} buffer{'s' if n > 1 else ''} of the module differ across the ranks of "
            f"{mesh!r}, as BatchNorm running statistics do when each rank updates them with its own "
            f"batch; call fs.sync_buffers(module, {arg}) inside the shard_map'd function after the forward "
            f"(it replaces every floating buffer by its mean over {', '.join(fix)}), or update the "
            f"buffers the same way on every rank",
            problems,
        )
    )
