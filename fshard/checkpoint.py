"""Sharded checkpoints of pytrees, resharded on load, through ``torch.distributed.checkpoint``.

`save` writes a pytree of `fshard.Sharded` values, plain tensors (replicated:
the same on every rank), `fshard.PerRank` values (each pipeline stage's own tree, keyed by its
index: ``stages.pp=1.w``) and Python scalars as one DCP checkpoint: every rank writes its own
blocks, once per distinct block (replicas are deduplicated). `load` reads it back into
the layouts of a ``like`` pytree, which may live on a mesh of another shape or another world
size: DCP works on global shapes, so a model trained at ``dp=2, tp=2`` resumes at
``dp=1, tp=4``, at ``dp=4``, or in one process.

The state-dict keys are the pytree key paths joined by dots (``params.blocks.0.wq``,
``opt.m.blocks.0.wq``, ``opt.step``), so a checkpoint can also be read by plain
``torch.distributed.checkpoint`` code, and a ``like`` tree that holds only part of the saved
tree (just ``{"params": ...}``) loads that part.

With ``step=``, checkpoints are kept side by side in one directory as ``step_00000100`` and so
on, and `latest_step` finds the newest.

Every save is atomic, with or without ``step=``. The checkpoint ``<name>`` is written to
``.tmp_<name>`` beside it, with a manifest of the sha256 of every file (``fshard-manifest.json``,
written last), then renamed into place. A checkpoint it replaces is first renamed to
``.old_<name>`` and deleted once the new one is in place. The rule for readers (`load`, `steps`,
`latest_step`): a ``.tmp_*`` directory is never read; ``.old_<name>`` is read only when
``<name>`` is not a complete checkpoint (a save stopped between the two renames left the previous
checkpoint there); the next save of ``<name>`` deletes both. So an interrupted save leaves the previous
checkpoint, never a mix of old and new files.

What loading trusts: nothing in the checkpoint runs code. DCP's ``.metadata`` is unpickled with an
allowlist (DCP's metadata classes, torch sizes and dtypes, paths, builtin containers), tensors and
scalars with ``torch.load(weights_only=True)``, the manifest is JSON; anything else raises
`CheckpointError`. The manifest catches damaged files (a flipped byte, a truncated copy), not
tampering: whoever can write the files can rewrite the manifest too. A checkpoint without a
manifest (written by plain DCP code) loads unverified.

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

import dataclasses
import functools
import hashlib
import json
import operator
import os
import pickle
import re
import shutil
import types

import optree
import torch
import torch.distributed as dist

from ._errors import CheckpointError, report
from ._layout import Layout
from ._sharded import Sharded
from ._stages import PerRank

__all__ = ["save", "load", "latest_step", "steps", "CheckpointError"]

_STEP_DIR = re.compile(r"^(?:\.old_)?step_(\d+)$")  # a checkpoint, or one set aside by a save
_METADATA = ".metadata"  # the file DCP's FileSystemWriter writes last, on the coordinator rank
_MANIFEST = "fshard-manifest.json"  # sha256 of every file, written after DCP is done
_MANIFEST_FORMAT = "fshard.checkpoint/1"
_SCALARS = (bool, int, float, complex, str, bytes)
_FIX = (
    "The file is damaged, or was not written by fshard.checkpoint.save: load another step "
    "(fshard.checkpoint.steps lists them) or save again"
)


# == API ==================================================================================


def save(path, tree, *, step: int | None = None) -> str:
    """Save a pytree of Sharded values, replicated tensors and Python scalars.

    Every rank must call it with the same tree structure (a collective). Each rank writes the
    blocks it holds; a block held by several ranks (a replicated tensor, a value split over
    ``tp`` but replicated over ``dp``) is written once. The save is atomic: the checkpoint is
    written beside its place and renamed into it when complete (see the module docstring).

    Args:
        path: the checkpoint directory, replaced as a whole: it must be new, empty, or an
            earlier checkpoint. With ``step``, the parent directory of the checkpoints: this one
            is written to ``path/step_{step:08d}``.
        tree: a pytree whose leaves are `fshard.Sharded` values, ``torch.Tensor``
            (taken as replicated: the same global value on every rank) or Python scalars.
            ``None`` is an empty subtree. Keys are the leaves' key paths joined by ``"."``.
        step: a training step, a non-negative int; see ``path``. An existing checkpoint of the
            same step is replaced.

    Returns:
        The directory written.

    Raises:
        CheckpointError: for a leaf of another type, two leaves whose key paths join to the
            same key, a bad ``step``, a ``path`` that is neither new, empty nor a checkpoint,
            or a failed write (the previous checkpoint is then left as it was).

    Examples:
        >>> state = {"params": params, "opt": opt_state}     # Sharded leaves, "step": int
        >>> fshard.checkpoint.save("out/ckpt", state, step=100)
        'out/ckpt/step_00000100'
    """
    import torch.distributed.checkpoint as dcp

    step = _check_step(step, "save")
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
    final = _step_dir(path, step) if step is not None else path
    tmp, old = _beside(final, "tmp"), _beside(final, "old")
    distributed = dist.is_available() and dist.is_initialized()
    _together(distributed, "save", lambda: _prepare(final, tmp, whole_dir=step is None), rank0=True)
    try:
        dcp.save(state_dict, checkpoint_id=tmp, no_dist=not distributed)
    except _dcp_classes().CheckpointException as e:
        raise CheckpointError(
            f"fshard.checkpoint.save: torch.distributed.checkpoint failed to write {tmp!r} "
            f"({_failures(e)}); {final!r} was left as it was"
        ) from None
    names = _together(distributed, "save", lambda: sorted(os.listdir(tmp)), rank0=True)[0]
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    mine = names[rank::world]  # the files this rank hashes
    shares = _together(distributed, "save", lambda: {n: _digest(os.path.join(tmp, n)) for n in mine})
    files = {n: d for share in shares for n, d in share.items()}
    _together(distributed, "save", lambda: _commit(final, tmp, old, files), rank0=True)
    return final


def load(path, like, *, step: int | None = None):
    """Load a checkpoint into the layouts of ``like``, resharding as needed.

    Every rank must call it with the same tree structure (a collective). The files are checked
    against the checkpoint's manifest of sha256 sums first, and nothing read from them runs code
    (see the module docstring for what is trusted).

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
        step: with a parent directory, the step to load (a non-negative int).

    Returns:
        A tree with the structure of ``like`` holding the saved values.

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (or no ``step_*`` checkpoint in it).
        CheckpointError: keys of ``like`` missing from the checkpoint, global shapes that differ,
            or a tensor saved where ``like`` has a scalar (all problems listed at once); files
            that differ from the manifest, or that cannot be read (the file is named); a bad
            ``step``.

    Examples:
        >>> mesh = fs.Mesh(dp=1, tp=4)                     # trained at dp=2, tp=2
        >>> params, specs = init(seed, cfg, mesh)          # fresh values in the new layout
        >>> like = {"params": params, "opt": opt.init(params)}
        >>> state = fshard.checkpoint.load("out/ckpt", like)   # latest step
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    step = _check_step(step, "load")
    ckpt = _resolve(os.fspath(path), step)
    distributed = dist.is_available() and dist.is_initialized()
    manifest = _read_manifest(ckpt)
    if manifest is not None and _METADATA in manifest:
        _raise_damaged(ckpt, _verify(ckpt, {_METADATA: manifest[_METADATA]}))
    classes = _dcp_classes()
    reader = classes.Reader(ckpt)
    saved = reader.read_metadata().state_dict_metadata
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
    if manifest is not None:
        names = sorted(n for n in manifest if n != _METADATA)
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        mine = {n: manifest[n] for n in names[rank::world]}  # the files this rank checks
        found = _together(distributed, "load", lambda: _verify(ckpt, mine))
        _raise_damaged(ckpt, sorted(p for share in found for p in share))
    try:
        dcp.load(state_dict, storage_reader=reader, planner=classes.Planner(), no_dist=not distributed)
    except classes.CheckpointException as e:
        raise _load_failure(e, ckpt) from None
    out = [done(state_dict[key]) for key, done in finish]
    return optree.tree_unflatten(treedef, out)


def latest_step(path) -> int | None:
    """The step of the newest complete ``step_*`` checkpoint under ``path``, or None.

    A step whose save was interrupted between renaming the previous checkpoint aside and renaming
    the new one in counts (its previous checkpoint is what `load` reads).

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
    treedef = optree.tree_structure(tree)
    # An fs.PerRank value holds this rank's own tree (a pipeline stage's parameters): its leaves
    # are keyed by the rank's index along the PerRank's axes ("stages.pp=1.w"), so every index's
    # tree is saved (once, by one of its copies) and each rank loads its own.
    tree = optree.tree_map(_index_per_rank, tree, is_leaf=lambda x: isinstance(x, PerRank))
    accessors, leaves, _ = optree.tree_flatten_with_accessor(tree)
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


def _index_per_rank(x):
    if not isinstance(x, PerRank):
        return x
    mesh, index = x.mesh, 0
    for a in x.axes:
        index = index * mesh.shape[a] + mesh.coordinate[a]
    return {f"{'_'.join(x.axes)}={index}": x.tree}


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
        return x._like(x.local.detach()).to_dtensor()
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
            return buf, x._like
        layout = _mesh_order(x)
        if layout is not x.layout:
            buf = torch.empty(
                layout.local_shape(x.shape, x.mesh.shape, x.mesh.coordinate), dtype=x.dtype, device=x.device
            )

        def done(dt):
            s = Sharded._wrap(dt.to_local(), x.mesh, layout, x.shape)
            return s.reshard(x.layout) if layout is not x.layout else s

        return Sharded._wrap(buf, x.mesh, layout, x.shape).to_dtensor(), done
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, requires_grad=False), lambda t: t
    return x, lambda v: v


def _check_step(step, where: str) -> int | None:
    """``step`` as an int: None, or a non-negative int (not a bool, not a float)."""
    if step is None:
        return None
    try:
        value = None if isinstance(step, bool) else operator.index(step)
    except TypeError:
        value = None
    if value is None or value < 0:
        raise CheckpointError(
            f"fshard.checkpoint.{where}: step must be a non-negative int, got {step!r} "
            f"({type(step).__name__}); pass the training step as a whole number, such as step=100"
        )
    return value


# -- where checkpoints live ---------------------------------------------------------------


def _step_dir(path: str, step: int) -> str:
    return os.path.join(path, f"step_{step:08d}")


def _beside(final: str, kind: str) -> str:
    """``.tmp_<name>`` or ``.old_<name>`` in the directory holding ``final``."""
    norm = os.path.normpath(final)
    if os.path.basename(norm) in ("", ".", ".."):
        norm = os.path.abspath(norm)
    head, name = os.path.split(norm)
    return os.path.join(head, f".{kind}_{name}")


def _complete(ckpt: str) -> bool:
    return os.path.isfile(os.path.join(ckpt, _METADATA))


def _found(final: str) -> str | None:
    """The directory to read for the checkpoint ``final``: itself, or the one a stopped save set aside."""
    if _complete(final):
        return final
    old = _beside(final, "old")
    return old if _complete(old) else None


def _steps(path: str) -> list[int]:
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = {int(m.group(1)) for m in map(_STEP_DIR.match, names) if m}
    return sorted(s for s in found if _found(_step_dir(path, s)) is not None)


def _resolve(path: str, step: int | None) -> str:
    if step is not None:
        ckpt = _found(_step_dir(path, step))
        if ckpt is None:
            have = _steps(path)
            raise FileNotFoundError(
                f"fshard.checkpoint.load: no checkpoint of step {step} in {path!r}"
                + (f"; it has steps {have}" if have else "")
            )
        return ckpt
    if _complete(path):
        return path
    found = _steps(path)
    if found:
        last = _found(_step_dir(path, found[-1]))
        assert last is not None  # _steps lists complete checkpoints only
        return last
    ckpt = _found(path)
    if ckpt is not None:
        return ckpt
    raise FileNotFoundError(
        f"fshard.checkpoint.load: {path!r} is neither a checkpoint (no {_METADATA} file) nor a "
        f"directory of step_* checkpoints"
    )


# -- atomic saves (rank 0 renames; the file system is shared, as DCP assumes) ---------------


def _prepare(final: str, tmp: str, whole_dir: bool) -> None:
    """Check that ``final`` may be replaced, and make an empty ``tmp`` to write into."""
    if whole_dir:
        _check_replaceable(final)
    try:
        _remove(tmp)  # left behind by an interrupted save
        os.makedirs(tmp)
    except OSError as e:
        raise CheckpointError(
            f"fshard.checkpoint.save: cannot create {tmp!r} ({type(e).__name__}: {e}); the checkpoint "
            f"is written there first, so its directory must be writable"
        ) from None


def _check_replaceable(final: str) -> None:
    if os.path.lexists(final) and not os.path.isdir(final):
        raise CheckpointError(
            f"fshard.checkpoint.save: {final!r} is a file; pass a directory path (a new or empty "
            f"directory, or an earlier checkpoint)"
        )
    real, cwd = os.path.realpath(final), os.path.realpath(os.getcwd())
    if cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep):
        raise CheckpointError(
            f"fshard.checkpoint.save: {final!r} holds the current directory, and save replaces the "
            f"whole directory; pass a subdirectory, such as 'ckpt'"
        )
    names = sorted(os.listdir(final)) if os.path.isdir(final) else []
    subdirs = [n for n in names if os.path.isdir(os.path.join(final, n))]
    if names and (subdirs or not _complete(final)):
        shown = ", ".join((subdirs or names)[:3]) + (", ..." if len(subdirs or names) > 3 else "")
        raise CheckpointError(
            f"fshard.checkpoint.save: {final!r} is neither empty nor a checkpoint (it holds "
            f"{shown}), and save without step= replaces the whole directory; pass a new or empty "
            f"directory, or step= to keep checkpoints side by side in it as step_*"
        )


def _commit(final: str, tmp: str, old: str, files: dict) -> None:
    """Write the manifest into the complete ``tmp``, then move it to ``final`` (the old one aside first)."""
    try:
        with open(os.path.join(tmp, _MANIFEST), "w", encoding="utf-8") as f:
            json.dump({"format": _MANIFEST_FORMAT, "files": files}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if _complete(final):
            _remove(old)  # final is complete: a leftover aside is not needed
            os.replace(final, old)
        elif os.path.lexists(final):
            _remove(final)  # not a checkpoint (an empty directory, say): nothing to keep
        # else a save stopped between the renames may have left the previous checkpoint in `old`:
        # it stays readable until `final` is in place.
        os.replace(tmp, final)
    except OSError as e:
        raise CheckpointError(
            f"fshard.checkpoint.save: cannot move the new checkpoint into {final!r} "
            f"({type(e).__name__}: {e}); the previous one still loads, and saving again cleans up"
        ) from None
    _fsync_dir(os.path.dirname(os.path.abspath(final)))
    try:
        _remove(old)
    except OSError:
        pass  # the new checkpoint is in place; readers ignore `old`, and the next save removes it


def _remove(directory: str) -> None:
    """Delete a checkpoint directory, its markers first: a half-deleted one never looks complete."""
    if not os.path.lexists(directory):
        return
    if os.path.isdir(directory) and not os.path.islink(directory):
        for marker in (_MANIFEST, _METADATA):
            try:
                os.unlink(os.path.join(directory, marker))
            except FileNotFoundError:
                pass
        shutil.rmtree(directory)
    else:
        os.unlink(directory)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory
    finally:
        os.close(fd)


def _together(distributed: bool, where: str, fn, rank0: bool = False) -> list:
    """Run ``fn`` on every rank (or on rank 0 alone); return every rank's result, or raise on all.

    A rank that fails must not leave the others waiting in the next collective: every rank
    gets every rank's outcome, and all raise the same CheckpointError.
    """
    rank = dist.get_rank() if distributed else 0
    try:
        out = (True, fn() if rank == 0 or not rank0 else None)
    except CheckpointError as e:
        out = (False, str(e))
    except Exception as e:
        out = (False, f"fshard.checkpoint.{where}: {type(e).__name__} on rank {rank}: {e}")
    outs: list = [out]
    if distributed:
        outs = [None] * dist.get_world_size()
        dist.all_gather_object(outs, out)
    failed = [msg for ok, msg in outs if not ok]
    if failed:
        raise CheckpointError(failed[0])
    return [value for _, value in outs]


# -- checksums ----------------------------------------------------------------------------


def _digest(file: str) -> dict:
    h = hashlib.sha256()
    size = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"sha256": h.hexdigest(), "bytes": size}


def _read_manifest(ckpt: str) -> dict | None:
    """``{file name: {"sha256", "bytes"}}`` from the checkpoint's manifest, or None without one."""
    file = os.path.join(ckpt, _MANIFEST)
    try:
        with open(file, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(_unreadable(file, ckpt, f"{type(e).__name__}: {e}")) from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    ok = (
        isinstance(manifest, dict)
        and manifest.get("format") == _MANIFEST_FORMAT
        and isinstance(files, dict)
        and all(
            _plain_name(n) and isinstance(d, dict) and set(d) == {"sha256", "bytes"} for n, d in files.items()
        )
    )
    if not ok:
        raise CheckpointError(_unreadable(file, ckpt, f"it is not a {_MANIFEST_FORMAT} manifest"))
    return files


def _plain_name(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name


def _verify(ckpt: str, files: dict) -> list[str]:
    """The problems of the files ``files`` lists, one line each."""
    problems = []
    for name, want in sorted(files.items()):
        try:
            got = _digest(os.path.join(ckpt, name))
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        if got["bytes"] != want["bytes"]:
            problems.append(f"{name}: {got['bytes']} bytes, but {want['bytes']} were written")
        elif got["sha256"] != want["sha256"]:
            problems.append(f"{name}: its sha256 differs from the one recorded when it was written")
    return problems


def _raise_damaged(ckpt: str, problems: list[str]) -> None:
    if problems:
        head = (
            f"fshard.checkpoint.load: the checkpoint {ckpt!r} is damaged: files differ from its "
            f"{_MANIFEST}; load another step (fshard.checkpoint.steps lists them) or save again"
        )
        raise CheckpointError(_bullets(head, problems))


# -- reading without running code from the checkpoint --------------------------------------


def _unreadable(file: str, ckpt: str, reason: str) -> str:
    return f"fshard.checkpoint.load: cannot read {file!r} of the checkpoint {ckpt!r}: {reason}. {_FIX}"


class _Refused(Exception):
    """Raised inside DCP's reading; the reader turns it into a CheckpointError naming the file."""


# What DCP's .metadata pickle may refer to: its metadata dataclasses, torch sizes, dtypes, layouts,
# paths (the checkpoint id) and builtin containers. Nothing here runs code when called.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # looks a torch.layout up by name
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "list", "tuple", "dict", "complex", "slice"},
}


def _allowed(module: str, name: str) -> bool:
    if name in _METADATA_CLASSES.get(module, ()):
        return True
    if module == "torch":  # torch.float32, torch.strided, torch.contiguous_format pickle by name
        return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if not _allowed(module, name):
            raise _Refused(
                f"it refers to {module}.{name}, which checkpoint metadata never holds (refused: "
                f"loading never runs code from a checkpoint)"
            )
        return super().find_class(module, name)


def _read_metadata(file: str, ckpt: str):
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise
    except _Refused as e:
        raise CheckpointError(_unreadable(file, ckpt, str(e))) from None
    except EOFError:
        raise CheckpointError(_unreadable(file, ckpt, "it ends early (truncated)")) from None
    except Exception as e:  # pickle raises many kinds on garbage
        raise CheckpointError(_unreadable(file, ckpt, f"{type(e).__name__}: {e}")) from None
    if not isinstance(md, Metadata):
        raise CheckpointError(
            _unreadable(
                file, ckpt, f"it holds a {type(md).__name__}, not torch.distributed.checkpoint metadata"
            )
        )
    return md


@functools.cache
def _dcp_classes():
    """DCP's reader and load planner, made safe (built on first use: importing DCP is slow)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        """FileSystemReader with allowlisted metadata unpickling, naming the file of any failure."""

        def __init__(self, ckpt: str):
            super().__init__(ckpt)
            self.ckpt = ckpt

        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            name = _METADATA if rank is None else f"__{rank}{_METADATA}"
            md = _read_metadata(os.path.join(self.ckpt, name), self.ckpt)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def read_data(self, plan, planner):
            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for name, items in per_file.items():
                try:
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
                except Exception as e:
                    reason = str(e) if isinstance(e, _Refused) else f"{type(e).__name__}: {e}"
                    raise CheckpointError(
                        _unreadable(os.path.join(self.ckpt, name), self.ckpt, reason)
                    ) from None
            fut = torch.futures.Future()
            fut.set_result(None)
            return fut

    class Planner(DefaultLoadPlanner):
        """DefaultLoadPlanner loading scalars with ``weights_only=True`` (DCP's own uses False)."""

        def __init__(self):
            super().__init__(flatten_state_dict=False)  # fshard's state dicts are flat already

        def load_bytes(self, read_item, value):
            key = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError:
                obj = None  # something other than plain data
            if not isinstance(obj, _SCALARS):
                raise _Refused(
                    f"the saved value of {key!r} is not a Python scalar (refused: loading never "
                    f"runs code from a checkpoint)"
                )
            self.original_state_dict[key] = obj  # the dict dcp.load returns values through

    return types.SimpleNamespace(Reader=Reader, Planner=Planner, CheckpointException=CheckpointException)


def _failures(e) -> str:
    """The first failure of a DCP ``CheckpointException``: ``rank 1: OSError: ...``."""
    failures = getattr(e, "failures", None) or {}
    for rank in sorted(failures):
        exc = failures[rank][0]
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return str(e)


def _load_failure(e, ckpt: str) -> CheckpointError:
    """A CheckpointError for a DCP ``CheckpointException`` raised while loading ``ckpt``."""
    failures = getattr(e, "failures", None) or {}
    for rank in sorted(failures):
        exc = failures[rank][0]
        if isinstance(exc, CheckpointError):
            return CheckpointError(str(exc))
    return CheckpointError(
        f"fshard.checkpoint.load: torch.distributed.checkpoint failed to read {ckpt!r} ({_failures(e)})"
    )


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
    return report(f"{head} ({n} problem{'s' if n != 1 else ''})", problems)
