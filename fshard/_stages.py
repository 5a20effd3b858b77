"""Per-rank values and branching on a rank's index: pipeline stages whose parameters differ in shape.

`PerRank` holds, on each rank, that rank's own pytree (its pipeline stage's parameters, say),
varying over some mesh axes (``"pp"``) and replicated over the others (``"dp"``). Passed to a
``shard_map``'d function, its leaves reach ``f`` as they are (no slicing, no gathering), tagged as
varying over those axes, so their gradients are never summed over them; returned from ``f``, the
tree comes back as a `PerRank` value. `switch` runs this rank's branch of a list (one per stage)
and types what it returns by what every branch returns (each traced on fake tensors) and the
index's axes, the same on every rank.

Hooks used by ``_shard_map``: `per_rank_leaves`, `mark_inputs`, `mark_outputs`, `unwrap`,
`debug_check_inputs`, `debug_check_outputs`.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode

from . import _comm, _compile, _debug, _scalars, _vma, _watchdog
from ._comm import untracked
from ._errors import ArgumentError, CollectiveError, SpecError, TracingError
from ._mesh import Mesh
from ._primitives import apply as _apply
from ._sharded import Sharded
from ._switch_links import SwitchIn as _SwitchIn
from ._switch_links import SwitchOut as _SwitchOut
from ._switch_links import keep_operands as _keep_operands

__all__ = ["PerRank", "switch"]

_Tensor = torch.Tensor


# == per-rank values ======================================================================


class PerRank:
    """This rank's own pytree: a value that varies over mesh ``axes`` and is replicated over the others.

    Each rank holds only its own tree (the parameters of its pipeline stage), so trees may differ
    in structure and shapes from one index along ``axes`` to the next: an embedding on stage 0,
    wider layers on stage 1, a head on the last stage. The ranks that share an index along ``axes``
    (the copies along the other axes, e.g. ``"dp"``) hold the same tree.

    As a ``shard_map`` argument, ``f`` receives ``tree`` itself: this rank's plain tensors, not
    sliced and not gathered, varying over ``axes``. Their gradients are summed over the other axes
    where ``f`` uses them with data that varies over those (data parallel over ``"dp"``), never over
    ``axes``. The in_spec of a `PerRank` argument is ``None`` (the tensors as they are), or a spec
    that splits their dims over *other* axes (each index's tree is then sliced like a global value
    over those, e.g. ``"(tp o) i"`` for tensor parallelism inside a stage). Returning
    ``fs.PerRank(tree, axes)`` from ``f`` gives a `PerRank` value back, with no communication (its
    out_spec: ``None``, or a split over other axes).

    `PerRank` is a pytree node: `value_and_grad` of a `PerRank` argument returns `PerRank`
    gradients, and ``fs.optim`` updates return `PerRank` parameters.

    Checks: outside ``shard_map`` the constructor checks (one small all-gather over the mesh,
    when some other axis has size > 1) that the ranks sharing an index hold trees of the same
    structure, shapes and dtypes, and raises the same `SpecError` on every rank otherwise. Under
    `fs.debug`, each ``shard_map`` call also checks that they hold the same values. Inside
    ``shard_map`` (``mesh`` defaults to the call's mesh) nothing is communicated: the call's
    replication check applies to the other axes.

    Args:
        tree: this rank's pytree of tensors.
        axes: the mesh axis (or tuple of axes) the value varies over, e.g. ``"pp"``.
        mesh: the `Mesh` (the running call's mesh inside ``shard_map``).

    Raises:
        ArgumentError: for an unknown axis, a missing mesh, or a leaf that is a `Sharded` or
            `PerRank` value.
        SpecError: when ranks that share an index hold trees of different structure or shapes.

    Examples:
        >>> mesh = fs.Mesh(dp=2, pp=2)
        >>> params = fs.PerRank.build(mesh, "pp", [init_embed_and_layers, init_layers_and_head])
        >>> params.index, params.axes          # this rank's stage
        (1, ('pp',))
        >>> pipe = fs.shard_map(pipeline, mesh=mesh, in_specs=(None, "(dp b) s"), out_specs="")
        >>> loss, grads = fs.value_and_grad(pipe)(params, tokens)   # grads: a PerRank, this stage's
    """

    __slots__ = ("tree", "mesh", "axes")

    def __init__(self, tree, axes, mesh: Mesh | None = None):
        tr = _vma.active()
        if mesh is None:
            if tr is None:
                raise ArgumentError(
                    "fs.PerRank: pass mesh= (the fs.Mesh whose axes the value varies over); only inside "
                    "fs.shard_map does it default to the call's mesh"
                )
            mesh = tr.mesh
        if not isinstance(mesh, Mesh):
            raise ArgumentError(f"fs.PerRank: mesh must be an fs.Mesh, got {type(mesh).__name__}")
        if tr is not None and mesh != tr.mesh:
            raise ArgumentError(
                f"fs.PerRank: mesh {mesh!r} is not the mesh {tr.mesh!r} of the running fs.shard_map({tr.where})"
            )
        self.tree, self.mesh, self.axes = tree, mesh, _check_axes(mesh, axes, "fs.PerRank")
        for path, x in zip(*optree.tree_flatten_with_path(tree)[:2]):
            if isinstance(x, (Sharded, PerRank)):
                where = "tree" + "".join(f"[{k!r}]" for k in path)
                raise ArgumentError(
                    f"fs.PerRank: {where} is an fs.{type(x).__name__} value; a per-rank value holds this "
                    f"rank's own plain tensors (use .full() or .tree to get them)"
                )
        if tr is None:
            _check_replicas(self)
        else:
            tr.shapes_differ = True  # each index's tree its own shapes (see switch's typing)

    @classmethod
    def build(cls, mesh: Mesh, axes, build) -> PerRank:
        """Build only this rank's tree: ``build[i]()`` (or ``build(i)``) for this rank's index ``i``.

        As each rank of ``torch.distributed.pipelining`` builds only its own stage: the other
        stages' parameters are never made here.

        Args:
            mesh: the `Mesh`.
            axes: the axis (or axes) the value varies over, e.g. ``"pp"``.
            build: one entry per index along ``axes`` (a callable returning that index's tree, or
                the tree), or one callable taking the index.

        Raises:
            ArgumentError: when ``build`` is a list whose length is not the size of ``axes``.

        Examples:
            >>> params = fs.PerRank.build(mesh, "pp", [lambda: embed_stage(seed=0), lambda: head_stage(seed=1)])
            >>> params = fs.PerRank.build(mesh, "pp", lambda stage: init_stage(stage))
        """
        if not isinstance(mesh, Mesh):
            raise ArgumentError(f"fs.PerRank.build: mesh must be an fs.Mesh, got {type(mesh).__name__}")
        names = _check_axes(mesh, axes, "fs.PerRank.build")
        g = mesh.axis_group(names, "PerRank.build")
        if callable(build):
            tree = build(g.index)
        else:
            entries = list(build)
            if len(entries) != g.size:
                raise ArgumentError(
                    f"fs.PerRank.build: got {len(entries)} entries for axis {_axes_text(names)} of size "
                    f"{g.size}; give one per index (a callable returning that index's tree), or one callable "
                    f"taking the index"
                )
            entry = entries[g.index]
            tree = entry() if callable(entry) else entry
        return cls(tree, names, mesh)

    @classmethod
    def _wrap(cls, tree, mesh: Mesh, axes: tuple[str, ...]) -> PerRank:
        """A PerRank value fshard computed (from an unflatten, or an output): no checks."""
        self = cls.__new__(cls)
        self.tree, self.mesh, self.axes = tree, mesh, axes
        return self

    @property
    def index(self) -> int:
        """This rank's index along ``axes`` (first axis major): the stage it holds."""
        return self.mesh.axis_index(self.axes)

    def __repr__(self) -> str:
        leaves, treedef = optree.tree_flatten(self.tree)
        shapes = [tuple(x.shape) if isinstance(x, _Tensor) else type(x).__name__ for x in leaves]
        return (
            f"PerRank(axes={self.axes}, index={self.index}, mesh={self.mesh!r}, "
            f"{len(leaves)} leaves {shapes if len(shapes) <= 8 else str(shapes[:8])[:-1] + ', ...]'})"
        )


def _flatten(p: Any):
    return (p.tree,), (p.mesh, p.axes), ("tree",)


def _unflatten(aux: Any, children: Any) -> Any:
    return PerRank._wrap(children[0], aux[0], aux[1])


optree.register_pytree_node(
    PerRank,  # type: ignore[arg-type]
    _flatten,
    _unflatten,
    path_entry_type=optree.GetAttrEntry,
    namespace=getattr(optree.registry, "__GLOBAL_NAMESPACE"),  # seen by every optree.tree_flatten
)


def _check_axes(mesh: Mesh, axes, where: str) -> tuple[str, ...]:
    try:
        return mesh.check_axes(axes, where.removeprefix("fs."))
    except CollectiveError as e:
        raise ArgumentError(str(e)) from None


def _axes_text(names: tuple[str, ...]) -> str:
    return repr(names[0]) if len(names) == 1 else repr(names)


def _tree_sig(tree) -> int:
    """A digest of a tree's structure and its leaves' shapes, dtypes and device types."""
    dims: list = []
    return _debug.sig_with_dims(_debug.skeleton_of(tree, _own_leaf(dims)), dims)


def _replica_axes(mesh: Mesh, axes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if a not in axes and mesh.shape[a] > 1)


def _odd_groups(ranks, rows: list[list[int]], col: int) -> list[str]:
    """For each key (rows[r][0]) whose rows disagree in column ``col``: which ranks (``ranks``: the
    mesh's, in mesh order) hold what."""
    by_key: dict = {}
    for rank, row in zip(ranks, rows):
        by_key.setdefault(row[0], {}).setdefault(row[col], []).append(rank)
    out = []
    for key, by_val in sorted(by_key.items()):
        if len(by_val) > 1:
            held = " vs ".join(
                f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for r in by_val.values()
            )
            out.append(f"index {key}: {held}")
    return out


def _check_replicas(p: PerRank) -> None:
    """The ranks that share ``p``'s index must hold trees of one structure, shapes and dtypes."""
    mesh = p.mesh
    replicas = _replica_axes(mesh, p.axes)
    if not replicas:
        return
    row = [p.index, _tree_sig(p.tree)]
    if _debug.enabled:
        row.append(_values_sig(optree.tree_leaves(p.tree)))
    _debug.gathered_check(mesh, "PerRank", row, _copies_differ, p.axes, replicas, _debug.enabled)


@_debug.checker
def _copies_differ(rows: list, ranks: tuple, axes: tuple, replicas: tuple, debug: bool) -> None:
    odd = _odd_groups(ranks, rows, 1)
    if odd:
        raise SpecError(
            f"fs.PerRank: the ranks that hold the same index along {_axes_text(axes)} (the copies along "
            f"{', '.join(map(repr, replicas))}) hold trees of different structure, shapes, dtypes or device types "
            f"({'; '.join(odd)}); a per-rank value is replicated over the other axes: build it the same way on "
            f"every rank of an index (e.g. fs.PerRank.build(mesh, {_axes_text(axes)}, [...]) with the same seeds)"
        )
    if debug:
        _raise_values(axes, replicas, _odd_groups(ranks, rows, 2), "fs.PerRank [debug]")


def _values_sig(leaves) -> Any:
    """A digest of the values of the tensors among ``leaves`` (`_debug.digest`)."""
    return _debug.digest([x for x in leaves if isinstance(x, _Tensor)])


def _raise_values(axes, replicas, odd: list[str], where: str) -> None:
    if odd:
        raise TracingError(
            f"{where}: the per-rank values over {_axes_text(axes)} differ between ranks that hold the same index "
            f"({'; '.join(odd)}); they are replicated over {', '.join(map(repr, replicas))}: initialize them "
            f"with the same seed on every rank of an index, and update them with gradients that are summed "
            f"over {', '.join(map(repr, replicas))}"
        )


# == shard_map hooks ======================================================================


def _is_per_rank(x) -> bool:
    return isinstance(x, PerRank)


def per_rank_leaves(tree) -> dict[int, PerRank]:
    """``{leaf index: the PerRank value it is part of}`` for the leaves of ``tree`` inside one."""
    out: dict[int, PerRank] = {}
    i = 0
    for top in optree.tree_leaves(tree, is_leaf=_is_per_rank):
        if isinstance(top, PerRank):
            n = len(optree.tree_leaves(top.tree))
            for k in range(i, i + n):
                out[k] = top
            i += n
        else:
            i += 1
    return out


def mark_inputs(plans, per_rank: dict, specs, paths, mesh: Mesh, kinds) -> list[str]:
    """Turn the plans of the inputs inside PerRank values into ``kinds.PER_RANK`` plans varying
    over the value's axes (sliced over the spec's axes like a global value); returns problems."""
    problems = []
    for i, pr in per_rank.items():
        p = plans[i]
        if p is None or p.kind is kinds.PASS:
            continue
        path, spec = paths[i], str(specs[i])
        if pr.mesh != mesh:
            problems.append(
                f"{path} is part of an fs.PerRank value on {pr.mesh!r}, not on this shard_map's mesh {mesh!r}"
            )
            continue
        if p.kind is not kinds.GLOBAL:
            continue  # a Sharded leaf: refused when the PerRank value was built
        clash = [a for a in pr.axes if a in p.layout.split_axes]
        if clash:
            problems.append(
                f"{path} with spec {spec!r} splits a dim over {', '.join(map(repr, clash))}, an axis its "
                f"fs.PerRank value varies over (each rank already holds only its own value); split only over "
                f"the other axes, or give the spec None"
            )
            continue
        p.kind = kinds.PER_RANK
        p.bits |= mesh.bits(pr.axes)
    return problems


def mark_outputs(plans, per_rank: dict, specs, paths, mesh: Mesh, kinds) -> list[str]:
    """Let the outputs inside PerRank values vary over the value's axes; returns problems."""
    problems = []
    for i, pr in per_rank.items():
        p = plans[i]
        if p is None or p.kind is kinds.PASS:
            continue
        bits = mesh.bits(pr.axes)
        if p.allowed & bits:
            clash = mesh.names_of(p.allowed & bits)
            problems.append(
                f"{paths[i]} with spec {str(specs[i])!r} splits or sums over {', '.join(map(repr, clash))}, an axis "
                f"its fs.PerRank value varies over (each rank returns its own value); split only over the other "
                f"axes, or give the spec None"
            )
            continue
        p.allowed |= bits
    return problems


def unwrap(tree):
    """``tree`` with each PerRank value replaced by its tree (what ``f`` receives)."""
    return optree.tree_map(lambda x: x.tree if isinstance(x, PerRank) else x, tree, is_leaf=_is_per_rank)


def has_per_rank(args) -> bool:
    """Whether ``args`` holds a PerRank value."""
    return any(isinstance(x, PerRank) for x in optree.tree_leaves(args, is_leaf=_is_per_rank))


def local_treedef(args):
    """The treedef of what ``f`` receives for ``args``: each PerRank value replaced by its tree."""
    return optree.tree_structure(unwrap(args))


def _union_axes(mesh: Mesh, values) -> tuple[str, ...]:
    axes = {a for p in values for a in p.axes}
    return tuple(a for a in mesh.axis_names if a in axes)


def debug_check_inputs(name: str, mesh: Mesh, args, leaves, plans, kind) -> None:
    """fs.debug: the per-rank inputs hold the same values on the ranks that share their index."""
    tops = [x for x in optree.tree_leaves(args, is_leaf=_is_per_rank) if isinstance(x, PerRank)]
    if not tops:
        return
    axes = _union_axes(mesh, tops)
    replicas = _replica_axes(mesh, axes)
    if not replicas:
        return
    vals = [x for x, p in zip(leaves, plans) if p is not None and p.kind is kind]
    row = [_index(mesh, axes), _values_sig(vals)]
    _debug.gathered_check(mesh, "debug", row, _per_rank_inputs_differ, axes, replicas, name)


def _index(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """This rank's index along ``axes`` (a plain int: a constant of a compiled graph)."""
    return int(mesh.axis_index(axes))


@_debug.checker
def _per_rank_inputs_differ(rows: list, ranks: tuple, axes: tuple, replicas: tuple, name: str) -> None:
    _raise_values(axes, replicas, _odd_groups(ranks, rows, 1), f"fs.shard_map({name}) [debug]")


def debug_check_outputs(name: str, mesh: Mesh, out, uneven: bool = False) -> None:
    """fs.debug's output check, with the trees inside PerRank outputs compared only between the
    ranks that share their index (they may differ from one index to the next). In a call with
    ``uneven`` blocks (inputs cut unevenly) the outputs' numbers of dims are compared, not their
    sizes, which differ by design; `_out_shapes` then checks every rank's blocks (a block that is
    not torch.chunk's cut raises the same SpecError on every rank)."""
    tops = optree.tree_leaves(out, is_leaf=_is_per_rank, none_is_leaf=True)
    per_rank = [x for x in tops if isinstance(x, PerRank)]
    if not per_rank:
        _debug.check_outputs(name, mesh, out, uneven)
        return
    if mesh.size == 1:
        return
    axes = _union_axes(mesh, per_rank)
    dims: list = []

    def top(x):
        if isinstance(x, PerRank):
            return ("PerRank", x.axes)
        return _debug.shape_of(x, dims) if isinstance(x, _Tensor) else None

    common = _debug.sig_with_dims(_debug.skeleton_of(out, top, is_leaf=_is_per_rank), dims)
    dims = []
    own = _debug.sig_with_dims(_debug.skeleton_of(tuple(x.tree for x in per_rank), _own_leaf(dims)), dims)
    _debug.gathered_check(
        mesh, "debug", [_index(mesh, axes), common, own], _per_rank_outputs_differ, axes, name
    )


@_debug.checker
def _per_rank_outputs_differ(rows: list, ranks: tuple, axes: tuple, name: str) -> None:
    odd = _odd_groups(ranks, rows, 2)
    if len({r[1] for r in rows}) > 1:
        odd.insert(0, f"equal within: {_debug.groups_text([r[1] for r in rows], ranks)}")
    if odd:
        raise TracingError(
            f"fs.shard_map({name}) [debug]: f returned outputs whose structure or local shapes differ across "
            f"ranks ({'; '.join(odd)}; the trees of fs.PerRank outputs are compared only between ranks with the "
            f"same index along {_axes_text(axes)}); a data-dependent shape (x[mask], nonzero, unique) on a varying "
            f"value differs per rank: pad it to a fixed size (torch.where with a fill value)"
        )


def _own_leaf(dims: list):
    def leaf(x):
        if isinstance(x, _Tensor):
            return (_debug.shape_of(x, dims), str(x.dtype), x.device.type)
        return type(x).__name__

    return leaf


# == switch ===============================================================================


def switch(index, branches, *operands):
    """Run ``branches[index](*operands)`` on this rank: the sanctioned way to branch on a varying index.

    A Python ``if`` on ``fs.axis_index("pp")`` raises inside ``shard_map`` (each rank would take its
    own branch unseen by the tracking); ``switch`` is ``jax.lax.switch`` for per-rank code: each rank
    runs only its own branch (eagerly), so branches may hold different layers with different shapes.
    Inside branch ``s`` the stage number is a plain Python constant (bind it with
    ``functools.partial`` or a default argument).

    What it returns is typed as JAX types a switch, by what the branches return: each output varies
    over the axes that output of any branch varies over, and over the index's axes (ranks with
    different indices return different branches' values). For that every branch is run once per
    signature (the branches, the operands' structure, shapes, dtypes and varying axes) on fake
    tensors, with no data, communication or gradient (its Python code runs). Where that cannot tell
    (a branch that calls a collective, uses a data-dependent op such as ``.item()``, or returns
    another structure; a call with ``fs.PerRank`` values, uneven blocks or an earlier switch on a
    varying index, where a shape may differ from rank to rank) every output varies over the index's
    axes and every axis an operand varies over.

    Rules, because each rank runs a different branch:

    - Collectives over the index's axes (``"pp"``) must be issued by every branch alike (same kind,
      order and shapes), or kept outside the switch; collectives over other axes are free (the
      ranks along them run the same branch).
    - Code outside ``switch`` runs the same on every rank. Outputs need a gradient on every rank
      when any operand does (a branch may return constants, e.g. at a pipeline bubble), and every
      operand that needs a gradient gets one (zeros where a branch ignores it), so the backward
      issues the same collectives on every rank as long as the outputs are used the same way.
    - A tensor that needs a gradient and is the same on every rank of the index's axes (replicated
      over ``"pp"``) must be passed as an operand, not captured by a branch: its gradient is summed
      over those axes (one all-reduce in the backward, on every rank). Captured, it raises
      `TracingError` (on the ranks whose branch uses it). Per-rank values (`PerRank` leaves) and
      tensors computed from them vary over the axes already and may be captured.
    - Out-of-range indices raise `ArgumentError` on the ranks that have one (no clamping).

    Compiled (``torch.compile`` or ``fs.compile``), each rank's graph holds its own branch, and
    the outputs are typed by the operands (as above where the branches cannot be traced).

    Args:
        index: a 0-dim integer tensor (``fs.axis_index("pp")``, or computed from it) or an int.
        branches: a sequence of callables, one per index value.
        *operands: pytrees passed to the chosen branch.

    Returns:
        What the branch returned; tensors (and Python numbers) tagged as varying over the axes above.

    Raises:
        ArgumentError: for an index that is not an integer scalar, or out of range on this rank.
        TracingError: when a branch uses a captured tensor that needs a gradient and does not vary
            over the index's axes.

    Examples:
        >>> stage = fs.axis_index("pp")
        >>> h, loss = fs.switch(stage, [first_stage, middle_stage, last_stage], params, h_in)
    """
    tr = _vma.current("switch")
    branches = list(branches) if not callable(branches) else None
    if not branches or not all(callable(b) for b in branches):
        raise ArgumentError(
            "fs.switch: branches must be a non-empty sequence of callables, one per index value"
        )
    i, bits = _index_value(index, tr)
    if not 0 <= i < len(branches):
        axes = tr.mesh.names_of(bits)
        along = f" (this rank's index along {', '.join(map(repr, axes))})" if axes else ""
        raise ArgumentError(
            f"fs.switch: index {i}{along} is out of range for {len(branches)} branch{'es' if len(branches) != 1 else ''}; give one branch per "
            f"index value"
        )
    if not bits:  # the same branch on every rank
        return branches[i](*operands)
    flat, treedef = optree.tree_flatten(operands)
    grad = torch.is_grad_enabled()
    diff = [k for k, x in enumerate(flat) if isinstance(x, _Tensor) and x.requires_grad] if grad else []
    masks = [_vma.get(x, tr) if isinstance(x, _Tensor) else _scalars._scan(x, tr.id) for x in flat]
    union = bits
    for k in diff:  # a differentiable operand varies over the index's axes in the branch (cast below)
        masks[k] |= bits
    for m in masks:
        union |= m
    # What the outputs vary over, the same on every rank whichever branch it runs (as JAX types a
    # switch by what its branches return): each output leaf's join over every branch, each traced
    # once per signature on fake tensors, and the index's axes (ranks with different indices return
    # different branches' values). Where the branches cannot be traced so (see _branch_types): the
    # index's axes and every axis an operand varies over, for every output.
    typed = _branch_types(branches, flat, treedef, masks, tr, bits)
    if typed is None:
        for k in diff:
            masks[k] = union
    token = None
    if diff:
        # Each differentiable operand is cast to vary over the index's axes (and, typed by the
        # operands, over every axis of the join): pvary, its gradient summed over the axes it
        # lacked (an input's sum goes in the call's gradient buckets, once per call however many
        # switches and microbatches use it). Every cast happens on every rank, and _SwitchIn hands
        # each operand a gradient on every rank, so the sums match up across ranks whichever
        # branch used what.
        for k in diff:
            flat[k] = _vma.pvary(flat[k], tr, _vma.get(flat[k], tr), masks[k])
        got = _apply(_SwitchIn, *[flat[k] for k in diff])
        for k, v in zip(diff, got[:-1]):
            flat[k] = _vma.tag(v, tr, masks[k])
        token = got[-1]
        operands = optree.tree_unflatten(treedef, flat)
    uneven, ragged = tr.uneven, tr.ragged  # a data-dependent shape in one branch is known to its ranks only
    allowed = union if typed is None else -1  # (typed by the branches: their traces saw every tensor)
    outer, tr.branch = tr.branch, tr.branch | bits
    try:
        with _BranchGuard(tr, bits, allowed, i), _watchdog.anonymous_sites():  # branches differ by rank
            out = branches[i](*operands)
            # the collectives the branch queued (fshard/_combine.py) run now, inside it (as every rank's
            # branch issued them, without call sites), and its results are filled before they leave it
            _vma.current("switch")
    finally:
        tr.branch = outer
    tr.uneven, tr.ragged = uneven, ragged
    tr.shapes_differ = True  # the branches' results may differ in shape from one index to the next
    leaves, otreedef = optree.tree_flatten(out)
    types = [union] * len(leaves) if typed is None else _check_typed(typed, leaves, otreedef, tr, i)
    if _compile.compiling():
        leaves = _keep_operands(leaves, flat, tr)
    for k, x in enumerate(leaves):
        if isinstance(x, _Tensor) and grad and x.requires_grad:
            own = _vma.get(x, tr)
            others = types[k] & ~bits
            if others & ~own:
                # truly the same on the ranks along those axes (they run the same branch): a cast
                # whose gradient sums over them, issued by all of them alike
                leaves[k] = _vma.pvary(x, tr, own, own | others)
    if token is not None:
        fl = [
            k
            for k, x in enumerate(leaves)
            if isinstance(x, _Tensor) and (x.is_floating_point() or x.is_complex())
        ]
        if fl:
            got = _apply(_SwitchOut, token, *[leaves[k] for k in fl])
            for k, v in zip(fl, got):
                leaves[k] = _vma.tag(v, tr, types[k])
    return optree.tree_unflatten(otreedef, [_tag_leaf(x, tr, t) for x, t in zip(leaves, types)])


_TYPES: collections.OrderedDict = collections.OrderedDict()
_TYPES_SIZE = 64  # signatures whose branch types are kept (least recently used dropped first)


def _branch_types(branches, flat, treedef, masks, tr, bits) -> tuple | None:
    """``(output treedef, varying axes per output leaf)``: the join of what every branch returns on
    the operands (leaf ``k`` varying over ``masks[k]``), traced on fake tensors, and the index's axes
    ``bits``. Cached per signature (the branches, the operands' structure, shapes, dtypes and
    masks). None where tracing cannot tell, and the operands type the outputs instead (sound: a
    result varies over at most the index's and the operands' axes):

    - a branch that cannot run on fake tensors (a data-dependent op: ``.item()``, ``nonzero``, ...),
      that calls a collective (nothing is sent: the collective raises, `_comm.abstract`), or whose
      output structure differs from another branch's;
    - a call where a value's shape may differ from rank to rank (uneven or data-dependent blocks,
      `PerRank` values, results of an earlier switch on a varying index): the branches would be
      traced on each rank's own shapes, and could trace on some ranks and not on others, so the
      ranks could disagree about the types. The decision reads only what every rank agrees on.
    """
    if tr.uneven or tr.ragged or tr.shapes_differ or _compile.compiling():
        return None  # (compiled: each rank's graph holds its own branch only; typed by the operands)
    key = refs = None
    try:
        desc = [
            (tuple(x.shape), x.dtype, x.device, m) if isinstance(x, _Tensor) else (type(x), x, m)
            for x, m in zip(flat, masks)
        ]
        key = (tuple(map(id, branches)), treedef, tuple(desc), tr.mesh._text, bits)
        hash(key)
        refs = [weakref.ref(b) for b in branches]
    except TypeError:  # an operand that is not hashable, or a branch that takes no weak reference
        key = None
    if key is not None:
        hit = _TYPES.get(key)
        if hit is not None and all(r() is b for r, b in zip(hit[0], branches)):
            _TYPES.move_to_end(key)
            return hit[1]
    got = _trace_branches(branches, flat, treedef, masks, tr, bits)
    if key is not None:
        _TYPES[key] = (refs, got)
        if len(_TYPES) > _TYPES_SIZE:
            _TYPES.popitem(last=False)
    return got


def _trace_branches(branches, flat, treedef, masks, tr, bits) -> tuple | None:
    """Run every branch on fake stand-ins of the operands (no data, no communication, no gradient)
    under the call's tracking, and join the varying axes of what they return; None if one fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    saved = tr.uneven, tr.ragged, tr.shapes_differ
    otree, types = None, []
    try:
        with torch.no_grad(), _comm.abstract(), _watchdog.anonymous_sites():
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with untracked():
                fakes = [mode.from_tensor(x) if isinstance(x, _Tensor) else x for x in flat]
            for x, m in zip(fakes, masks):
                if isinstance(x, _Tensor):
                    _vma.tag(x, tr, m)
            with mode:
                for b in branches:
                    leaves, od = optree.tree_flatten(b(*optree.tree_unflatten(treedef, fakes)))
                    got = [
                        _vma.get(x, tr) if isinstance(x, _Tensor) else _scalars._scan(x, tr.id)
                        for x in leaves
                    ]
                    if otree is None:
                        otree, types = od, [bits | v for v in got]
                    elif od != otree:
                        return None
                    else:
                        types = [t | v for t, v in zip(types, got)]
    except Exception:  # not traceable so: typed by the operands
        return None
    finally:
        tr.uneven, tr.ragged, tr.shapes_differ = saved
    return otree, types


def _check_typed(typed, leaves, otreedef, tr, i) -> list[int]:
    """The types of branch ``i``'s outputs, as its trace found them (a branch that behaves otherwise
    on its real operands than on fake ones, e.g. by the values, cannot be typed from its trace)."""
    otree, types = typed
    bad = otreedef != otree
    for x, t in zip(leaves, types):
        if not bad and isinstance(x, _Tensor) and _vma.get(x, tr) & ~t:
            bad = True
    if bad:
        raise TracingError(
            f"fs.switch in fs.shard_map({tr.where}): branch {i} returned a value whose structure or varying axes "
            f"differ from what the same branch returned when traced on fake tensors of the operands' shapes (the "
            f"branch depends on the operands' values, or on state that changed in between); make the branches "
            f"return the same structure, varying over the same axes, whatever the values"
        )
    return types


def _index_value(index, tr) -> tuple[int, int]:
    """The index as a Python int and its varying axes."""
    if isinstance(index, _Tensor):
        if (
            index.numel() != 1
            or index.dtype.is_floating_point
            or index.is_complex()
            or index.dtype == torch.bool
        ):
            raise ArgumentError(
                f"fs.switch: index must be an integer scalar (fs.axis_index(...) or an int), got a tensor of "
                f"shape {tuple(index.shape)} and dtype {index.dtype}"
            )
        bits = _vma.get(index, tr)
        with untracked():
            return int(index.item()), bits
    if isinstance(index, int) and not isinstance(index, bool):
        return _scalars.plain(index), _scalars._scan(index, tr.id)
    raise ArgumentError(
        f"fs.switch: index must be an integer scalar (fs.axis_index(...) or an int), got {type(index).__name__}"
    )


def _tag_leaf(x, tr, bits: int):
    """A tensor (or Python number) of the switch's output tagged as varying over ``bits`` as well (a
    tensor that lacks them is tagged through a view, so tensors shared with other code keep their tags)."""
    if not bits:
        return x
    if isinstance(x, _Tensor):
        have = _vma.get(x, tr)
        if have & bits == bits:
            return x
        with untracked():
            v = x.view_as(x)
        return _vma.tag(v, tr, have | bits)
    if isinstance(x, (int, float, _scalars.VaryingFloat)) and not isinstance(x, bool):
        base = _scalars.plain(x)
        base = int(base) if isinstance(base, int) else float(base)
        return _scalars._varying_scalar(base, tr.id, bits | _scalars._scan(x, tr.id))
    return x


class _BranchGuard(TorchFunctionMode):
    """Inside a branch, refuse tensors whose types would make the ranks disagree: one that varies
    over an axis no operand varies over (the branches' results would vary over different axes on
    different ranks), and a captured one that needs a gradient and does not vary over the index's
    axes (its gradient would be summed over them only on the ranks whose branch used it)."""

    def __init__(self, tr, bits: int, union: int, i: int):
        super().__init__()
        self.tr, self.bits, self.union, self.i = tr, bits, union, i

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with untracked():
            for a in itertools.chain(args, kwargs.values()):
                if isinstance(a, _Tensor):
                    self._check(a)
                elif type(a) in (list, tuple):
                    for b in a:
                        if isinstance(b, _Tensor):
                            self._check(b)
        return func(*args, **kwargs)

    def _check(self, a) -> None:
        v = _vma.get(a, self.tr)
        head = f"fs.switch in fs.shard_map({self.tr.where}): branch {self.i} uses a tensor of shape {tuple(a.shape)}"
        if v & ~self.union:
            extra = ", ".join(map(repr, self.tr.mesh.names_of(v & ~self.union)))
            raise TracingError(
                f"{head} that varies over {extra}, which neither the index nor any operand varies over (a captured "
                f"tensor, or the result of a collective): the results of every branch must vary over the same axes on "
                f"every rank; pass it (or a tensor that varies over {extra}) to the branches as an operand"
            )
        if a.requires_grad and v & self.bits != self.bits and torch.is_grad_enabled():
            ax = ", ".join(map(repr, self.tr.mesh.names_of(self.bits)))
            raise TracingError(
                f"{head} that needs a gradient and is the same on every rank of {ax} (captured by the branch, not "
                f"passed as an operand); its gradient must be summed over {ax} on every rank, which only an operand "
                f"gets: pass it to the branches as an operand, fs.switch(index, branches, ..., x)"
            )
