"""The checks of a shard_map call's results, run after ``f`` and before any output is reduced.

`check_unmodified`: a global input changed in place inside ``f``. `check_outputs`: each output's
varying axes against its out_spec, in one pass, both ways: an output that varies over an axis its
spec replicates (the replication check, JAX's ``Varying -> Invariant``), and an output marked as a
partial sum over an axis it does not vary over (JAX's ``Invariant -> Unreduced``: summing its equal
copies would multiply it by the axis size). Both read only the tracked masks, which are the same on
every rank, so every rank raises the same error, before the outputs' collectives. Under
``torch.compile`` they run at trace time (`_compile.fail`).
"""

from __future__ import annotations

from . import _compile, _vma
from ._errors import SpecError, TracingError, report

__all__ = ["check_unmodified", "check_outputs", "problems_report"]


def problems_report(name: str, what: str, problems: list[str], kind: str | None = None) -> str:
    n = len(problems)
    head = f"fs.shard_map({name}): {n} problem{'s' if n != 1 else ''} with {what}"
    if kind:
        head += f" ({kind})"
    return report(head, problems)


def check_unmodified(name: str, leaves, plans, global_idx, versions, tr) -> None:
    """A plain global input changed in place inside f so that the ranks' copies now differ: a
    block of it (each rank changed its own block), or all of it with a varying value. (An
    update with the same value on every rank is plain torch behaviour and stays allowed.)"""
    changed = [
        plans[i].path
        for i, v in zip(global_idx, versions)
        if leaves[i]._version != v and (plans[i].slices or _vma.get(leaves[i], tr))
    ]
    if changed:
        raise TracingError(
            f"fs.shard_map({name}): f modified {', '.join(changed)} in place; "
            f"{'it is' if len(changed) == 1 else 'they are'} (a block of) the global tensor you passed, "
            f"so each rank changed its own copy and the ranks' copies now disagree; clone inside f "
            f"(x = x.clone()) before updating, or pass an fs.Sharded value (fs.shard(x, mesh, spec)), "
            f"whose block each rank owns and may update in place"
        )


def check_outputs(name: str, mesh, leaves, plans, tr, passed) -> None:
    """Raise one SpecError listing every output whose varying axes its out_spec contradicts
    (plans of kind ``passed`` are not tensors and are skipped)."""
    problems = []
    kinds = set()
    for x, p in zip(leaves, plans):
        if p.kind is passed:
            continue
        v = _vma.get(x, tr) | _vma.taint_of(x, tr)  # (after a branch on a varying value: may vary)
        extra = v & ~p.allowed
        if extra:
            problems.append(_replicated(x, p, mesh.names_of(extra)))
            kinds.add("replication")
        same = mesh.bits(p.summed) & ~v if p.summed else 0
        if same:
            problems.append(_not_partial(p, mesh, mesh.names_of(same)))
            kinds.add("partial-sum")
    if not problems:
        return
    which = " and ".join(sorted(kinds, reverse=True))
    msg = problems_report(name, "out_specs", problems, kind=f"{which} check{'s' if len(kinds) > 1 else ''}")
    if "replication" in kinds:
        msg += _vma.taint_note(tr)
    drew = _vma.global_draw(tr) if "replication" in kinds else None
    if drew is not None:
        msg += (
            f"\nf drew random numbers from torch's global generator ({drew}), which gives each rank "
            f"numbers of its own, so they vary over every mesh axis; draw them with fs.random, whose "
            f"streams agree across the axes a value is replicated over: fs.random.dropout(x, p, "
            f"seed=step) for dropout, or pass generator=fs.random.generator(seed, like=x) to "
            f"torch.rand, torch.randn, torch.bernoulli, Tensor.normal_ and the rest"
        )
    _compile.fail(SpecError, msg)


def _replicated(x, p, axes: tuple[str, ...]) -> str:
    """An output varying over ``axes``, which its out_spec replicates."""
    ax = ", ".join(axes)
    tup = repr(axes[0]) if len(axes) == 1 else repr(axes)
    word = "axis" if len(axes) == 1 else "axes"
    gathered = getattr(x, "_fshard_gathered", None)
    if gathered is not None and set(axes) <= set(gathered):
        return (
            f"{p.path} is an fs.all_gather over {ax}, which varies over {ax} (its gradient is "
            f"reduce-scattered back to each rank's block), but out_spec {p.spec!r} says it is "
            f"replicated over {ax}; gather with fs.all_gather(..., invariant=True) to return the "
            f"gathered value as replicated, or split a dim over {ax} in the out_spec and return "
            f"the block"
        )
    return (
        f"{p.path} varies over mesh {word} {ax} but out_spec {p.spec!r} says it is replicated "
        f"over {ax}; reduce it inside f (fs.psum / fs.pmean over {tup}), mark it as a "
        f"partial sum with '| sum({' '.join(axes)})', split a dim over {ax} in the "
        f"out_spec, or pass check=False if you know it is the same on every rank"
    )


def _not_partial(p, mesh, axes: tuple[str, ...]) -> str:
    """An output marked as a partial sum over ``axes``, over which it does not vary."""
    ax = ", ".join(axes)
    tup = repr(axes[0]) if len(axes) == 1 else repr(axes)
    word = "axis" if len(axes) == 1 else "axes"
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    summed = f"sum({' '.join(p.summed)})"
    drop = (
        f"drop '| {summed}' from the out_spec"
        if set(axes) == set(p.summed)
        else f"drop {ax} from its '{summed}'"
    )
    return (
        f"{p.path} does not vary over mesh {word} {ax} (it is the same on every rank of {ax}), but out_spec "
        f"{p.spec!r} marks it as a partial sum over {ax}, which would add up its {n} equal copies ({n} times "
        f"the value); {drop} to return the value as it is, or make each rank of {ax} compute its own term of "
        f"the sum (e.g. split the contracted dim over {ax} in the in_specs); to add the {n} copies on purpose, "
        f"return fs.pvary(x, {tup})"
    )
