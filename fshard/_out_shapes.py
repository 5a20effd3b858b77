"""The global shapes of a call's Sharded outputs when their blocks may differ across ranks.

In a call with uneven blocks (an input cut unevenly, a reduce-scatter into uneven blocks inside
``f`` or by an out_spec, or a data-dependent shape on a varying value) no rank knows alone
whether every rank returned the block its out_spec describes: a rank whose block is right
cannot see that another's is not. So, before the outputs' reductions, the ranks exchange the
shapes of their split outputs in one small all-gather for the whole call (`_comm.gather_shapes`),
and every rank then checks every rank's blocks alike: each output gets its global shape, or the
same SpecError is raised on every rank, before any of the outputs' collectives. Even calls
never come here (their blocks all have one shape, known from the plan), and compiled calls
refuse uneven blocks at trace time; a call whose blocks are even until its out_specs
reduce-scatter some unevenly knows every rank's shapes from its own (no exchange).

Leaves of an `fs.PerRank` output may differ from one index of its axes to the next (even in
structure), so theirs are exchanged over the other axes only, between the ranks that share
their index: one more small all-gather, in calls that return such leaves split unevenly.
"""

from __future__ import annotations

import itertools

import torch

from . import _comm, _compile
from ._errors import SpecError, report
from ._layout import ANONYMOUS, chunk_sizes
from ._mesh import Mesh

__all__ = ["agree", "ragged_error"]


def agree(
    name: str,
    mesh: Mesh,
    leaves,
    plans,
    split,
    label_sizes: dict,
    ragged: bool,
    per_rank: dict,
    exchange: bool,
) -> dict:
    """``{leaf index: global shape}`` for the outputs ``split`` (indices of the leaves whose plans
    make Sharded values), from every rank's block shapes; raises the same SpecError on every rank
    (of the group that exchanged them) when blocks are not torch.chunk's cut of one global value,
    or a partial sum's shape differs across the ranks that sum it. ``ragged``: an op in ``f`` gave
    data-dependent shapes, so the inputs' dim sizes tell nothing about the outputs'. Without
    ``exchange`` (a call whose blocks were all even until its outputs' reduce-scatters cut some
    unevenly) every rank holds the shapes this rank holds, and nothing is communicated."""
    if exchange:
        _compile.refuse(
            f"fs.shard_map({name}) with outputs in uneven blocks",
            "pad the outputs to a multiple of the mesh axes' sizes, or call it eagerly",
        )
    groups: dict[tuple[str, ...], list[int]] = {}
    for i in split:  # the world, or the axes other than an fs.PerRank value's own
        own = per_rank[i].axes if i in per_rank else ()
        groups.setdefault(tuple(a for a in mesh.axis_names if a not in own), []).append(i)
    out: dict = {}
    for axes, idx in groups.items():
        if not axes or all(mesh.shape[a] == 1 for a in axes):
            continue
        coords = _members(mesh, axes)
        if exchange:
            g = mesh.axis_group(axes, "Sharded")
            paths = [f"output {plans[i].path}" for i in idx]
            rows = _comm.gather_shapes(  # rows[member][k]; their dtypes must agree too
                [leaves[i] for i in idx], g, mesh.device, f"fs.shard_map({name})", paths
            )
        else:
            rows = [[tuple(leaves[i].shape) for i in idx]] * len(coords)
        problems = []
        for k, i in enumerate(idx):
            shape, problem = _check(mesh, plans[i], coords, [r[k] for r in rows], label_sizes, ragged)
            if problem is not None:
                problems.append(problem)
            out[i] = shape
        if problems:
            n = len(problems)
            raise SpecError(
                f"fs.shard_map({name}): {problems[0]}"
                if n == 1
                else report(f"fs.shard_map({name}): {n} outputs whose blocks make no global value", problems)
            )
    return out


def _members(mesh: Mesh, axes: tuple[str, ...]) -> list[dict]:
    """The mesh coordinates of the ranks of the group over ``axes``, in its order (first axis
    major; the other axes at this rank's coordinate)."""
    mine = mesh.coordinate
    out = []
    for idx in itertools.product(*[range(mesh.shape[a]) for a in axes]):
        c = dict(mine)
        c.update(zip(axes, idx))
        out.append(c)
    return out


def _index(coord: dict, mesh: Mesh, axes) -> int:
    i = 0
    for a in axes:
        i = i * mesh.shape[a] + coord[a]
    return i


def _check(mesh: Mesh, p, coords, pre, label_sizes, ragged):
    """``(global shape or None, problem or None)`` of one output, from the shapes ``pre`` that the
    ranks at ``coords`` hold before its reductions."""
    layout = p.layout
    summed = tuple(
        a
        for a in mesh.axis_names
        if (p.reduce and a in p.reduce.names) or any(a in g.names for _, g, _ in p.scatter)
    )
    if summed:  # a partial sum: the same shape on the ranks that sum it
        by: dict = {}
        for c, sh in zip(coords, pre):
            by.setdefault(tuple(c[a] for a in mesh.axis_names if a not in summed), set()).add(sh)
        if any(len(s) > 1 for s in by.values()):
            ax = " ".join(summed)
            return None, (
                f"output {p.path} is a partial sum over {ax} (out_spec {p.spec!r}), "
                f"but its shape differs across the ranks of {ax} ({_held(mesh, coords, pre)}); the ranks that "
                f"sum a value must return the same shape: pad it to one size (torch.nn.functional.pad), or "
                f"reduce it to a shape that agrees first"
            )
    blocks = []  # each rank's block after the reduce-scatters its spec implies
    for c, sh in zip(coords, pre):
        sh = list(sh)
        for d, g, _ in p.scatter:
            if d < len(sh):
                sh[d] = chunk_sizes(sh[d], [mesh.shape[a] for a in g.names])[_index(c, mesh, g.names)]
        blocks.append(tuple(sh))
    ndim = len(layout.dims)
    held = _held(mesh, coords, blocks)
    if any(len(b) != ndim for b in blocks):
        return None, _error(p, held, None, None, "their numbers of dims differ", None)
    shape: list[int] = []
    known: dict[int, str] = {}  # how a dim's global size is known
    for d, axes in enumerate(layout.dims):
        lab = layout.labels[d]
        scattered = [g for dd, g, _ in p.scatter if dd == d]
        if not axes:
            shape.append(blocks[0][d])  # (must agree: checked below with the rest)
        elif scattered and len(scattered[0].names) == len(axes):
            shape.append(pre[0][d])  # the size the reduce-scatter cut
            known[d] = f"dim {d} is reduce-scattered from size {pre[0][d]}"
        elif not ragged and lab is not None and lab != ANONYMOUS and lab in label_sizes:
            shape.append(label_sizes[lab])
            known[d] = f"dim {d} is labelled {lab!r}, of size {label_sizes[lab]} among the inputs"
        else:  # a size no rank knows alone: the sum of one block per index
            per_index: dict[int, int] = {}
            for c, b in zip(coords, blocks):
                per_index.setdefault(layout.block_index(d, mesh.shape, c), b[d])
            shape.append(sum(per_index.values()))
    wants = [layout.local_shape(shape, mesh.shape, c) for c in coords]
    if all(w == b for w, b in zip(wants, blocks)):
        return torch.Size(shape), None
    if ragged:
        return None, ragged_error(p, held)
    bad = next(d for d in range(ndim) if any(w[d] != b[d] for w, b in zip(wants, blocks)))
    if not layout.dims[bad]:
        known[bad] = f"dim {bad} is not split (every rank returns it whole, of one size)"
    return None, _error(p, held, tuple(shape), _held(mesh, coords, wants), known.get(bad, ""), bad)


def _held(mesh: Mesh, coords, shapes) -> str:
    """Each rank's shape, in words: ``ranks 0, 1, 2: (1, 4); rank 3: (0, 4)``."""
    ranks = [mesh.ranks[_index(c, mesh, mesh.axis_names)] for c in coords]
    by: dict = {}
    for r, sh in zip(ranks, shapes):
        by.setdefault(tuple(sh), []).append(r)
    return "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {sh}" for sh, r in by.items()
    )


def _error(p, held, shape, want, known, bad) -> str:
    split = [d for d, axes in enumerate(p.layout.dims) if axes]
    if bad is None or not p.layout.dims[bad]:
        bad = split[0]
    axes = p.layout.dims[bad]
    ax = axes[0] if len(axes) == 1 else "(" + " ".join(axes) + ")"
    arg = repr(axes[0] if len(axes) == 1 else tuple(axes))
    if shape is None:
        why = known
    elif known:
        why = f"{known}, so the global shape is {shape}, which torch.chunk cuts into {want}"
    else:
        why = f"torch.chunk would cut the global shape {shape} they add up to into {want}"
    return (
        f"output {p.path} with out_spec {p.spec!r} returns blocks that make no global value split over {ax}: "
        f"the ranks return local shapes {held}, but {why}; return the block the spec describes (torch.chunk's "
        f"cut of the global value: the first blocks are the longer), give the dim a label no input uses to "
        f"return each rank's block as it is (e.g. '({' '.join(axes)} r)' for one row per rank, such as a "
        f"statistic of its block), or gather the blocks inside f with fs.all_gather(y, {arg}, dim={bad}, "
        f"tiled=True, invariant=True) and return that with a replicated out_spec"
    )


def ragged_error(p, held: str) -> str:
    split = [d for d, axes in enumerate(p.layout.dims) if axes]
    axes = p.layout.dims[split[0]]
    arg = repr(axes[0] if len(axes) == 1 else tuple(axes))
    return (
        f"output {p.path} has blocks whose shapes depend on the data ({held}), and they "
        f"are not the blocks torch.chunk cuts for out_spec {p.spec!r}, so they make no global value (an op in f "
        f"such as x[mask], nonzero or unique gave each rank its own size); return a block padded to a fixed size "
        f"with the count of its valid rows, or gather the blocks inside f with "
        f"fs.all_gather(y, {arg}, dim={split[0]}, tiled=True, invariant=True) and return that with a replicated "
        f"out_spec"
    )
