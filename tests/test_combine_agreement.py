"""Combined collectives keep the checks of the collectives they combine, on real gloo ranks.

Eager combining (``fshard/_combine.py``) packs the per-leaf collectives a rank queued into one
buffer, whose size depends on what that rank queued. A rank that skips one of two psums, skips an
all_gather, or runs an all_gather where its peers psum, must end with the same `CollectiveError` on
every rank of the group within seconds (never a hang, never gloo fed buffers of different sizes),
with combining on and off, with ``FSHARD_DESYNC_TAGS`` at ``reduce`` and ``all``, and under
``fs.debug()``, on 2x2 and 2x2x2 meshes; the groups that agree get the values of plain torch. And a
pipeline whose ``fs.switch`` branches call collectives over tp gives the loss and gradients of one
process with combining on and off.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from pathlib import Path

import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, env_vars

HERE = os.path.basename(__file__)
BOUND = 60.0  # seconds for a whole job of cases (each error ends at once: no timeout is waited for)
SKIP = 1  # the rank that disagrees
FIX = (
    "Every rank must issue the same collectives over a group in the same order (op, axes, shape, dtype, "
    "call site): look for a collective in a branch on the rank or on per-rank data (if rank == 0, a loop "
    "whose length differs by rank) and make every rank reach it. fs.debug() (or FSHARD_DEBUG=1) checks "
    "each collective before it is sent"
)
BEFORE = (
    "Nothing was sent: every rank of the group raised this error before the collective (the tags exchanged "
    "before it disagreed)"
)


def _line(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i + 1 for i, text in enumerate(lines) if text.endswith(f"# {marker}"))


# (combining, FSHARD_DESYNC_TAGS level, fs.debug) -> the cases run in that mode. Without combining,
# uncombined collectives are checked when they end (by the tags sent with them): with the tags on
# the all-reduces only ("reduce", the default) an all_gather carries none, so a skipped one is not
# caught; and an all_gather met by a psum (buffers of different sizes) is caught before it is sent
# only by fs.debug() (documented in docs/debugging.md).
MODES = {
    ("on", "reduce", False): ("psum", "gather", "gvp"),
    ("on", "all", False): ("psum", "gather", "gvp"),
    ("off", "reduce", False): ("psum",),
    ("off", "all", False): ("psum", "gather"),
    ("off", "reduce", True): ("psum", "gather", "gvp"),
}
LEVELS = {"reduce": (True, False), "all": (True, True)}


def _case(name, rank, ax):
    def psum(x):
        y = x * 2.0
        p = fs.psum(x, ax) if rank != SKIP else None  # psum-first
        q = fs.psum(y, ax)  # psum-second
        return q if p is None else q + p

    def gather(x):
        y = x * 2.0
        p = fs.all_gather(x, ax, dim=0, tiled=True) if rank != SKIP else None  # gather-first
        q = fs.all_gather(y, ax, dim=0, tiled=True)  # gather-second
        return q[:4] if p is None else q[:4] + p[:4]

    def gvp(x):
        if rank == SKIP:
            return fs.all_gather(x, ax, dim=0, tiled=True)[:4]  # gvp-gather
        return fs.psum(x, ax)  # gvp-psum

    return {"psum": psum, "gather": gather, "gvp": gvp}[name]


def _rank_matrix(shape, ax, spec, X):
    import torch.distributed as dist

    from fshard import _watchdog

    rank = dist.get_rank()
    mesh = fs.Mesh(**shape)
    out = {}
    saved = (_watchdog.S.tags, _watchdog.S.gather_tags)
    try:
        for (comb, level, debug), cases in MODES.items():
            _watchdog.S.tags, _watchdog.S.gather_tags = LEVELS[level]
            for name in cases:
                # fs.debug() checks the outputs over the whole mesh after f: there the group is the mesh
                f = _case(name, rank, tuple(shape) if debug else ax)
                _watchdog.reset()  # every case starts at collective #1 on every rank
                start = time.monotonic()
                try:
                    with env_vars(FSHARD_COMBINE="1" if comb == "on" else "0"):
                        with fs.debug() if debug else contextlib.nullcontext():
                            got = fs.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec)(X).local
                    out[(comb, level, debug, name)] = ("value", got, time.monotonic() - start)
                except fs.CollectiveError as err:
                    out[(comb, level, debug, name)] = ("error", str(err), time.monotonic() - start)
    finally:
        _watchdog.S.tags, _watchdog.S.gather_tags = saved
    return out


def _rank_ready():
    return True


def _coords(shape, rank):
    sizes = list(shape.values())
    c = []
    for s in reversed(sizes):
        c.append(rank % s)
        rank //= s
    return dict(zip(shape, reversed(c)))


@pytest.mark.parametrize(
    "shape,ax",
    [({"a": 2, "b": 2}, "a"), ({"a": 2, "b": 2, "c": 2}, ("a", "c"))],
    ids=["2x2", "2x2x2"],
)
def test_a_rank_that_disagrees_raises_on_every_rank_of_its_group_in_every_mode(shape, ax):
    world = 1
    for s in shape.values():
        world *= s
    axes = list(shape)
    spec = f"({' '.join(axes)} n)"
    X = torch.arange(4.0 * world)
    run_ranks(world, _rank_ready)  # the pool's start (tens of seconds on busy cores) is not timed
    start = time.monotonic()
    got = run_ranks(world, _rank_matrix, shape, ax, spec, X)
    assert time.monotonic() - start < BOUND
    names = (ax,) if isinstance(ax, str) else ax
    coords = [_coords(shape, r) for r in range(world)]

    def same_group(r, q):
        return all(coords[r][a] == coords[q][a] for a in axes if a not in names)

    group = [r for r in range(world) if same_group(r, SKIP)]
    peers = [r for r in group if r != SKIP]
    over = ",".join(names)
    ranks_text = "ranks " + ", ".join(map(str, group))
    peers_text = ("ranks " if len(peers) > 1 else "rank ") + ", ".join(map(str, peers))
    blocks = X.reshape(*shape.values(), 4)
    dims = tuple(axes.index(a) for a in names)

    def at(marker):
        return f"at {HERE}:{_line(marker)}"

    def rows(pairs):
        lines = sorted(pairs, key=lambda p: min(p[0]))
        return "\n".join(
            f"  - {'ranks' if len(r) > 1 else 'rank'} {', '.join(map(str, r))}: {d}" for r, d in lines
        )

    f32 = "float32"
    combined = {  # combining on: the buckets, checked before the data is sent
        "psum": [
            (
                peers,
                f"#1 all_reduce (fs.psum) over {over} of {f32} (8,) {at('psum-first')}, combining 2 calls "
                "of psum: (4,), (4,)",
            ),
            (
                [SKIP],
                f"#1 all_reduce (fs.psum) over {over} of {f32} (4,) {at('psum-second')}, combining 1 call "
                "of psum: (4,)",
            ),
        ],
        "gather": [
            (
                peers,
                f"#1 all_gather (fs.all_gather) over {over} of {f32} (8,) {at('gather-first')}, combining "
                "2 calls of tiled all_gather: (4,) at dim 0, (4,) at dim 0",
            ),
            (
                [SKIP],
                f"#1 all_gather (fs.all_gather) over {over} of {f32} (4,) {at('gather-second')}, "
                "combining 1 call of tiled all_gather: (4,) at dim 0",
            ),
        ],
        "gvp": [
            (
                peers,
                f"#1 all_reduce (fs.psum) over {over} of {f32} (4,) {at('gvp-psum')}, combining 1 call of "
                "psum: (4,)",
            ),
            (
                [SKIP],
                f"#1 all_gather (fs.all_gather) over {over} of {f32} (4,) {at('gvp-gather')}, combining "
                "1 call of tiled all_gather: (4,) at dim 0",
            ),
        ],
    }
    for (comb, level, debug), cases in MODES.items():
        if debug:
            names, group, peers = tuple(shape), list(range(world)), [r for r in range(world) if r != SKIP]
            over, ranks_text = ",".join(names), "ranks " + ", ".join(map(str, range(world)))
            peers_text = "ranks " + ", ".join(map(str, peers))
        for name in cases:
            key = (comb, level, debug, name)
            for r in range(world):
                kind, value, took = got[r][key]
                assert took < 15, (key, r, took)  # at once: no rank waited for a timeout
                if r in group:
                    assert kind == "error", (key, r, value)
                    assert value == got[SKIP][key][1], (key, r)  # the same message on every rank
                    continue
                assert kind == "value", (key, r, value)
                c = coords[r]
                if name == "gather":  # the first block of the group's gathers, 2x + x
                    idx = tuple(0 if a in names else c[a] for a in axes)
                    want = blocks[idx] * 3
                else:  # the sum over the group (of x and 2x for "psum")
                    rest = tuple(c[a] for a in axes if a not in names)
                    want = blocks.sum(dims)[rest] * (3 if name == "psum" else 1)
                torch.testing.assert_close(value, want)
            message = got[SKIP][key][1]
            if comb == "on":
                assert message == (
                    f"fshard: the ranks of the group over {over} ({ranks_text}) ran different collectives "
                    f"together:\n{rows(combined[name])}\n{BEFORE}. {FIX}"
                ), key
            elif debug:
                assert message.startswith(
                    f"fshard [debug]: the ranks of the group over {over} ({ranks_text}) disagree about their "
                    "next collective:\n"
                ), key
                assert peers_text in message and f"rank {SKIP}:" in message, key
            else:
                assert message.startswith(
                    f"fshard: the ranks of the group over {over} ({ranks_text}) ran different collectives "
                    "together:\n"
                ), key


# -- fs.switch over pp whose branches call collectives over tp ------------------------------------

D, H, MB, M = 4, 6, 3, 3
DT = torch.float64


def _stage_params(s):
    g = torch.Generator().manual_seed(40 + s)
    return {
        "w1": torch.randn(H, D, generator=g, dtype=DT) * 0.5,  # used transposed
        "w2": torch.randn(H, D, generator=g, dtype=DT) * 0.5,
    }


def _run_stage(s, n, t, p, xs, carry):
    i = t - s
    zero_h, zero_l, zero_a = (
        torch.zeros(MB, D, dtype=DT),
        torch.zeros((), dtype=DT),
        torch.zeros(MB, H, dtype=DT),
    )
    if not 0 <= i < M:
        return zero_h, zero_l, zero_a
    h = xs[i] if s == 0 else carry
    # column-parallel w1, row-parallel w2 (a psum over tp), and w1's activations gathered over tp
    a = torch.tanh(h @ p["w1"].T)
    full = fs.all_gather(a, "tp", dim=1, tiled=True, invariant=True)
    h = h + fs.psum(a @ p["w2"], "tp") + torch.tanh(full).mean(1, keepdim=True)
    act = fs.all_gather(a, "tp", dim=1, tiled=True)  # a queued result, returned by the branch as it is
    if s < n - 1:
        return h, zero_l, act
    # a queued psum as the branch's result (h is the same on every tp rank: a share of it each)
    return zero_h, fs.psum((h * h).sum() / fs.axis_size("tp"), "tp"), act


def _pipeline(p, xs):
    n, stage = fs.axis_size("pp"), fs.axis_index("pp")
    branches = [functools.partial(_run_stage, s, n) for s in range(n)]
    carry = torch.zeros(MB, D, dtype=DT)
    total = torch.zeros((), dtype=DT)
    for t in range(M + n - 1):
        h, loss, act = fs.switch(stage, branches, t, p, xs, carry)
        total = total + loss + torch.sin(act).mean()
        if t < M + n - 2:
            carry = fs.ppermute(h, "pp", [(k, k + 1) for k in range(n - 1)])
    return fs.pmean(fs.psum(total, "pp"), "tp")  # the same on every tp rank, tagged varying over tp


def _reference(n, xs):
    params = [{k: v.clone().requires_grad_() for k, v in _stage_params(s).items()} for s in range(n)]
    x = xs.clone().requires_grad_()
    total = torch.zeros((), dtype=DT)
    for i in range(M):
        h = x[i]
        for p in params:
            a = torch.tanh(h @ p["w1"].T)
            h = h + a @ p["w2"] + torch.tanh(a).mean(1, keepdim=True)
            total = total + torch.sin(a).mean()
        total = total + (h * h).sum()
    grads = torch.autograd.grad(total, [x, *[v for p in params for v in p.values()]])
    return (
        total.detach(),
        grads[0],
        [dict(zip(p, grads[1 + 2 * s : 3 + 2 * s])) for s, p in enumerate(params)],
    )


def _psum_in_branch_0(x):
    return fs.psum(x * 1.0, "pp")  # a queued psum over the index's axis, the branch's result as it is


def _psum_in_branch_1(x):
    y = x * 2.0
    return fs.psum(y, "pp")  # the same collective, from another line


def _psums_in_branches(x):
    return fs.switch(fs.axis_index("pp"), [_psum_in_branch_0, _psum_in_branch_1], x)


def _rank_switch_over_tp(shape):
    mesh = fs.Mesh(**shape)
    n = mesh.axis_size("pp")
    xs = torch.randn(M, MB, D, generator=torch.Generator().manual_seed(9), dtype=DT)
    want_loss, want_dx, want = _reference(n, xs)
    s = mesh.axis_index("pp")
    specs = ("(tp h) d", None)
    errs: list[str] = []
    x = torch.arange(12.0, dtype=DT)  # stage s holds block s
    for comb in ("1", "0"):  # every branch psums over pp alike (other scales): one sum, x0 + 2 x1
        with env_vars(FSHARD_COMBINE=comb):
            try:
                got = fs.shard_map(_psums_in_branches, mesh=mesh, in_specs="(pp n)", out_specs="(pp n)")(x)
                close(errs, f"combine={comb} psum in branches", got.local, x[:6] + 2 * x[6:], DT)
            except fs.FshardError as err:
                errs.append(f"FSHARD_COMBINE={comb}: psum in branches: {type(err).__name__}: {err}")
    for comb in ("1", "0"):
        params = fs.PerRank.build(mesh, "pp", [functools.partial(_stage_params, j) for j in range(n)])
        step = fs.shard_map(_pipeline, mesh=mesh, in_specs=specs, out_specs="")
        with env_vars(FSHARD_COMBINE=comb):
            try:
                loss, (g, gx) = fs.value_and_grad(step, argnums=(0, 1))(params, xs)
            except fs.FshardError as err:
                errs.append(f"FSHARD_COMBINE={comb}: {type(err).__name__}: {err}")
                continue
        close(errs, f"combine={comb} loss", loss, want_loss, DT)
        close(errs, f"combine={comb} input gradient", gx, want_dx, DT)
        for name in ("w1", "w2"):  # this stage's whole gradients (the tp blocks gathered)
            close(errs, f"combine={comb} stage {s} {name} gradient", g.tree[name], want[s][name], DT)
    return errs


@pytest.mark.parametrize("n,shape", [(4, {"pp": 2, "tp": 2})], ids=["pp2xtp2"])
def test_switch_branches_with_collectives_over_tp_match_one_process(n, shape):
    assert_ok(run_ranks(n, _rank_switch_over_tp, shape))
