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

import itertools
import zlib

import torch

from . import _comm, _compile, _vma
from ._comm import untracked
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
    (plans of kind ``passed`` are not tensors and are skipped). After a branch on a varying value
    (`_scalars.taint`) the ranks also compare what they return (`_agree`), and all raise alike."""
    problems = []
    kinds = set()
    fresh = 0  # the axes some output counts as replicated over as a collective's result made after a branch
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
        fresh |= tr.taint & ~p.allowed & ~v
    if tr.taint_why is not None and mesh.size > 1:
        failed, differ = _agree(mesh, leaves, plans, passed, bool(problems), fresh)
        if failed and not problems:
            problems.append(_failed_elsewhere(failed))
            kinds.add("replication")
        elif differ is not None and not problems:
            problems.append(_differs(leaves, plans, passed, mesh, *differ))
            kinds.add("replication")
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


def _agree(mesh, leaves, plans, passed, bad: bool, fresh: int) -> tuple[list, tuple | None]:
    """After a branch on a varying value, what the ranks return, compared in one small all-gather
    over the mesh, so that every rank raises alike (the ranks run the same code up to their first
    such branch, so all of them come here; after it their outputs may differ even in number, so
    each rank sends a row of a fixed size): whether its check failed (``bad``), the axes some
    output passed it on only as a collective's result made after a branch (``fresh``), and per
    mesh axis a digest of the outputs its out_specs replicate over that axis. Such a result is the
    same on every rank, but the ranks may have returned different ones (``psum(a)`` on some ranks,
    ``psum(b)`` on others); the digests must agree along each of those axes. Returns the global
    ranks whose check failed, and ``(axis, ranks)`` of a group whose digests differ, or None."""
    names = mesh.axis_names
    digests: dict = {}
    row = [int(bad), fresh]
    for a in names:
        b = mesh.bits((a,))
        held = []
        if not bad:
            for i, (x, p) in enumerate(zip(leaves, plans)):
                if p.kind is not passed and not p.allowed & b:
                    if i not in digests:
                        digests[i] = _digest(x)
                    held.append((i, digests[i]))
        row.append(zlib.crc32(repr(held).encode()) << 31 ^ zlib.adler32(repr(held).encode()))
    with untracked():
        t = torch.tensor(row, dtype=torch.int64, device=mesh.device)
        rows = _comm.all_gather_blocks(t, mesh.axis_group(names, "shard_map")).tolist()
    failed = [mesh.ranks[m] for m, r in enumerate(rows) if r[0]]
    if failed:
        return failed, None
    relied = 0
    for r in rows:
        relied |= r[1]
    coords = list(itertools.product(*[range(mesh.shape[a]) for a in names]))
    for k, a in enumerate(names):
        if not relied & mesh.bits((a,)):
            continue
        for c in coords:
            if c[k]:
                continue  # each group of a once: from its member at index 0
            group = [
                m2 for m2, c2 in enumerate(coords) if all(c2[j] == c[j] for j in range(len(c)) if j != k)
            ]
            if len({rows[m2][2 + k] for m2 in group}) > 1:
                return [], (a, [mesh.ranks[m2] for m2 in group])
    return [], None


def _digest(x) -> int:
    """A digest of the bytes of tensor ``x`` (and of its dtype and shape): equal bytes give equal
    digests on every rank. Exact integer arithmetic: the bytes as int32 (or uint8) words, weighted
    by position within rows of 2**15 words (sums below 2**62), each row's sum taken modulo two
    primes and weighted by row; two 31-bit sums in one number."""
    with untracked():
        t = x.detach()
        if t.is_complex():
            t = torch.view_as_real(t)
        b = t.contiguous().reshape(-1).view(torch.uint8)
        w = b.view(torch.int32) if b.numel() % 4 == 0 else b
        n = w.numel()
        width = 1 << 15
        head = zlib.crc32(f"{x.dtype} {tuple(x.shape)}".encode())
        if not n:
            return head
        words = torch.nn.functional.pad(w.to(torch.int64), (0, -n % width)).view(-1, width)
        pos = (torch.arange(width, dtype=torch.int64, device=w.device) * 40503) % 65521 + 1
        rowsum = (words * pos).sum(1)
        k = torch.arange(rowsum.numel(), dtype=torch.int64, device=w.device)
        out = head
        for prime, mult in ((2147483647, 48271), (2147483629, 69621)):
            weight = (k * mult + 12345) % prime + 1
            out = (out << 31) ^ int(((rowsum % prime) * weight % prime).sum().item())
        return out & ((1 << 62) - 1)


def _differs(leaves, plans, passed, mesh, axis: str, ranks: list) -> str:
    """The outputs replicated over ``axis`` hold other bytes on some of ``ranks`` (one group of it)."""
    held = [
        p.path for x, p in zip(leaves, plans) if p.kind is not passed and not p.allowed & mesh.bits((axis,))
    ]
    what = held[0] if len(held) == 1 else f"one of {', '.join(held)}"
    return (
        f"{what} differs between ranks {', '.join(map(str, ranks))} (a group of mesh axis {axis}), which its "
        f"out_spec replicates over {axis}: each rank returned the result of a collective over {axis} (or of "
        f"fs.value_and_grad or an fs.optim update) made after the branch, the same on every rank, but not the "
        f"same one (the ranks took their own paths: psum(a) on some, psum(b) on others); return one reduction "
        f"made after the last branch, on every rank alike"
    )


def _failed_elsewhere(ranks: list) -> str:
    """This rank's outputs passed the check, another rank's did not (after a branch on a varying value)."""
    return (
        f"the outputs of {'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} failed this check "
        f"(the error there names them), this rank's passed: the ranks took their own paths after the branch"
    )


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
