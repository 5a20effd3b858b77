"""Sharded checkpoints of pytrees, resharded on load, through ``torch.distributed.checkpoint``.

`save` writes a pytree of `fshard.Sharded` values, plain tensors (replicated:
the same on every rank) and Python scalars as one DCP checkpoint: every rank writes its own
blocks, once per distinct block (replicas are deduplicated). `load` reads it back into
the layouts of a ``like`` pytree, which may live on a mesh of another shape or another world
size: DCP works on global shapes, so a model trained at ``dp=2, tp=2`` resumes at
``dp=1, tp=4``, at ``dp=4``, or in one process.

The state-dict keys are the pytree key paths joined by dots (``params.blocks.0.wq``,
``opt.m.blocks.0.wq``, ``opt.step``), so a checkpoint can also be read by plain
``torch.distributed.checkpoint`` code, and a ``like`` tree that holds only part of the saved
tree (just ``{"params": ...}``) loads that part.

With ``step=``, checkpoints are kept side by side in one directory as ``step_00000100`` and so
on; each is written under a temporary name and renamed when complete, so an interrupted save
never shadows the previous one, and `latest_step` finds the newest complete checkpoint.

Examples:
    >>> import fshard as fs
    >>> from fshard import checkpoint
    >>> mesh = fs.Mesh(dp=2, tp=2)                         # 4 ranks
    >>> w = fs.random.normal(0, (8, 4), mesh=mesh, spec="(tp n) k")
    >>> where = checkpoint.save("ckpt", {"w": w, "step": 10}, step=10)   # 'ckpt/step_00000010'
    >>> mesh1 = fs.Mesh(dp=1, tp=4)                        # later, same 4 ranks (or another run)
    >>> like = {"w": fs.shard(torch.zeros(8, 4), mesh1, "(tp n) k"), "step": 0}
    >>> state = checkpoint.load("ckpt", like)              # the latest step: {"w": Sharded, "step": 10}
"""

from __future__ import annotations

import os
import re
import shutil
import warnings

import optree
import torch
import torch.distributed as dist

from ._errors import CheckpointError
from ._layout import Layout
from ._sharded import Sharded

__all__ = ["save", "load", "latest_step", "steps", "CheckpointError"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
_METADATA = ".metadata"  # the file DCP's FileSystemWriter writes last, on the coordinator rank
_SCALARS = (bool, int, float, complex, str, bytes)


# == API ==================================================================================


def save(path, tree, *, step: int | None = None) -> str:
    """Save a pytree of Sharded values, replicated tensors and Python scalars.

    Every rank must call it with the same tree structure (a collective). Each rank writes the
    blocks it holds; a block held by several ranks (a replicated tensor, a value split over
    ``tp`` but replicated over ``dp``) is written once.

    Args:
        path: the checkpoint directory. With ``step``, the parent directory of the checkpoints:
            this one is written to ``path/step_{step:08d}``.
        tree: a pytree whose leaves are `fshard.Sharded` values, ``torch.Tensor``
            (taken as replicated: the same global value on every rank) or Python scalars.
            ``None`` is an empty subtree. Keys are the leaves' key paths joined by ``"."``.
        step: a training step; see ``path``. An existing checkpoint of the same step is
            replaced.

    Returns:
        The directory written.

    Raises:
        CheckpointError: for a leaf of another type, or two leaves whose key paths join to
            the same key.

    Examples:
        >>> state = {"params": params, "opt": opt_state}     # Sharded leaves, "step": int
        >>> fshard.checkpoint.save("out/ckpt", state, step=100)
        'out/ckpt/step_00000100'
    """
    import torch.distributed.checkpoint as dcp

    keys, leaves, _ = _flatten(tree, "save")
    state_dict = {}
    problems = []
    for key, x in zip(keys, leaves):
        try:
            state_dict[key] = _saveable(x)
        except CheckpointError as e:
            problems.append(f"{key}: {e}")
    if problems:
        raise CheckpointError(_bullets("fshard.checkpoint.save: cannot save", problems))
    path = os.fspath(path)
    final = os.path.join(path, f"step_{int(step):08d}") if step is not None else path
    distributed = dist.is_available() and dist.is_initialized()
    rank0 = not distributed or dist.get_rank() == 0
    if step is None:
        tmp = final
    else:
        tmp = os.path.join(path, f".tmp_step_{int(step):08d}")
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)  # left behind by an interrupted save
            os.makedirs(tmp)
        _barrier(distributed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")
        dcp.save(state_dict, checkpoint_id=tmp, no_dist=not distributed)
    if step is not None:
        _barrier(distributed)
        if rank0:
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
        _barrier(distributed)
    return final


def load(path, like, *, step: int | None = None):
    """Load a checkpoint into the layouts of ``like``, resharding as needed.

    Every rank must call it with the same tree structure (a collective).

    Args:
        path: a checkpoint directory written by `save`, or the parent directory of
            ``step_*`` checkpoints, in which case the latest complete one is loaded (or
            ``step`` if given).
        like: a pytree giving the target: a `fshard.Sharded` leaf is loaded in its
            layout on its mesh (the mesh and layout may differ from the saved ones; only the
            global shape must match), a ``torch.Tensor`` leaf as the full global value on
            every rank, a Python scalar as the saved scalar. The values in ``like`` are not
            read or modified: freshly initialized parameters and optimizer state do.
            ``like`` may hold a subset of the saved keys.
        step: with a parent directory, the step to load.

    Returns:
        A tree with the structure of ``like`` holding the saved values.

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (or no ``step_*`` checkpoint in it).
        CheckpointError: keys of ``like`` missing from the checkpoint, global shapes that differ,
            or a tensor saved where ``like`` has a scalar (all problems listed at once).

    Examples:
        >>> mesh = fs.Mesh(dp=1, tp=4)                     # trained at dp=2, tp=2
        >>> params, specs = init(seed, cfg, mesh)          # fresh values in the new layout
        >>> like = {"params": params, "opt": opt.init(params)}
        >>> state = fshard.checkpoint.load("out/ckpt", like)   # latest step
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt = _resolve(os.fspath(path), step)
    distributed = dist.is_available() and dist.is_initialized()
    saved = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    keys, leaves, treedef = _flatten(like, "load")
    state_dict = {}
    finish = []
    problems = []
    for key, x in zip(keys, leaves):
        md = saved.get(key)
        if md is None:
            problems.append(f"{key}: not in the checkpoint{_close_keys(key, saved)}")
            continue
        is_tensor = isinstance(x, (Sharded, torch.Tensor))
        if is_tensor != isinstance(md, TensorStorageMetadata):
            what = "a tensor" if isinstance(md, TensorStorageMetadata) else "a non-tensor value"
            problems.append(f"{key}: the checkpoint holds {what}, but like has {_describe(x)}")
            continue
        if is_tensor and tuple(md.size) != tuple(x.shape):
            problems.append(
                f"{key}: saved with global shape {tuple(md.size)}, but like has global shape {tuple(x.shape)}"
            )
            continue
        if not is_tensor and not isinstance(x, _SCALARS):
            problems.append(f"{key}: like has {_describe(x)}; leaves must be Sharded, tensors or scalars")
            continue
        target, done = _target(x)
        state_dict[key] = target
        finish.append((key, done))
    if problems:
        raise CheckpointError(
            _bullets(f"fshard.checkpoint.load: the checkpoint {ckpt!r} does not fit like", problems)
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")
        dcp.load(state_dict, checkpoint_id=ckpt, no_dist=not distributed)
    out = [done(state_dict[key]) for key, done in finish]
    return optree.tree_unflatten(treedef, out)


def latest_step(path) -> int | None:
    """The step of the newest complete ``step_*`` checkpoint under ``path``, or None.

    Examples:
        >>> step = fshard.checkpoint.latest_step("out/ckpt")   # None before the first save
    """
    found = _steps(os.fspath(path))
    return found[-1] if found else None


def steps(path) -> list[int]:
    """The steps of all complete ``step_*`` checkpoints under ``path``, in increasing order.

    Examples:
        >>> fshard.checkpoint.steps("out/ckpt")
        [250, 500, 750]
    """
    return _steps(os.fspath(path))


# == helpers ==============================================================================


def _flatten(tree, where):
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(tree)
    keys = [".".join(str(getattr(e, "field", e.entry)) for e in a) for a in accessors]
    seen: dict[str, str] = {}
    dups = []
    for key, a in zip(keys, accessors):
        code = a.codify("tree")
        if key in seen:
            dups.append(f"{seen[key]} and {code} both make the key {key!r}")
        seen.setdefault(key, code)
    if dups:
        raise CheckpointError(_bullets(f"fshard.checkpoint.{where}: duplicate state-dict keys", dups))
    return keys, leaves, treedef


def _mesh_order(x: Sharded) -> Layout:
    """``x``'s layout with every multi-axis split listed in mesh order (what DTensor can express)."""
    names = x.mesh.axis_names
    dims = tuple(tuple(sorted(axes, key=names.index)) for axes in x.layout.dims)
    return x.layout if dims == x.layout.dims else Layout(dims, x.layout.labels)


@torch.no_grad()
def _saveable(x):
    if isinstance(x, Sharded):
        if x.mesh.size == 1:
            return x.local.detach()
        layout = _mesh_order(x)
        if layout is not x.layout:
            x = x.reshard(layout)
        return Sharded(x.local.detach(), x.mesh, x.layout).to_dtensor()
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, _SCALARS):
        return x
    raise CheckpointError(f"{_describe(x)} is not a Sharded value, a tensor or a Python scalar")


def _target(x):
    """A buffer DCP loads into in place, and how to turn it into the result leaf."""
    if isinstance(x, Sharded):
        buf = torch.empty_like(x.local, requires_grad=False)
        if x.mesh.size == 1:
            return buf, lambda t: Sharded(t, x.mesh, x.layout)
        layout = _mesh_order(x)
        if layout is not x.layout:
            buf = torch.empty(layout.local_shape(x.shape, x.mesh.shape), dtype=x.dtype, device=x.device)

        def done(dt):
            s = Sharded(dt.to_local(), x.mesh, layout)
            return s.reshard(x.layout) if layout is not x.layout else s

        return Sharded(buf, x.mesh, layout).to_dtensor(), done
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, requires_grad=False), lambda t: t
    return x, lambda v: v


def _steps(path: str) -> list[int]:
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(path, name, _METADATA)):
            out.append(int(m.group(1)))
    return sorted(out)


def _resolve(path: str, step: int | None) -> str:
    if step is not None:
        ckpt = os.path.join(path, f"step_{int(step):08d}")
        if not os.path.isfile(os.path.join(ckpt, _METADATA)):
            have = _steps(path)
            raise FileNotFoundError(
                f"fshard.checkpoint.load: no checkpoint of step {step} in {path!r}"
                + (f"; it has steps {have}" if have else "")
            )
        return ckpt
    if os.path.isfile(os.path.join(path, _METADATA)):
        return path
    found = _steps(path)
    if not found:
        raise FileNotFoundError(
            f"fshard.checkpoint.load: {path!r} is neither a checkpoint (no {_METADATA} file) nor a "
            f"directory of step_* checkpoints"
        )
    return os.path.join(path, f"step_{found[-1]:08d}")


def _barrier(distributed: bool) -> None:
    if distributed:
        dist.barrier()


def _describe(x) -> str:
    if isinstance(x, Sharded):
        return f"a Sharded value of global shape {tuple(x.shape)}"
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def _close_keys(key: str, saved) -> str:
    import difflib

    close = difflib.get_close_matches(key, list(saved), n=2, cutoff=0.6)
    return f" (close saved keys: {', '.join(close)})" if close else ""


def _bullets(head: str, problems: list[str]) -> str:
    n = len(problems)
    return f"{head} ({n} problem{'s' if n != 1 else ''}):\n" + "\n".join(f"  - {p}" for p in problems)
