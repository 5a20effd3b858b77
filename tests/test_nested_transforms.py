"""Every nesting of two derivatives, of a shard_map'd function and inside one, over every collective.

The outer transform differentiates the inner one's computation, tangents and cotangents included:
``jacrev(jacfwd(f))``, ``vjp`` of ``jvp``, ``loss.backward()`` of a forward-mode tangent. Such a
reverse pass over a forward-mode rule once gave each rank only its own block of a split input's
gradient (``[6, 0, 0, 0]`` on rank 0 of four, ``[0, 12, 0, 0]`` on rank 1, where every rank should
have had ``[6, 12, 18, 24]``): the tangent of a split input was sliced to the rank's block by a plain
slice (the slice with its transpose, which gathers every rank's block, was taken only when the
primal needed a gradient, and a forward-mode dual's primal does not), and the tangent of a cast to
varying passed through unrecorded (its transpose, the sum over the ranks, was lost).

Each program is a scalar loss of a split input ``x`` (rows cut over every mesh axis, evenly and
not) and a replicated ``w`` (or the other way round) through one collective followed by a
nonlinearity, so that second derivatives couple the ranks' blocks. The nestings (``grad``,
``vjp``, ``jvp``, ``jacfwd``, ``jacrev`` two deep, ``hessian``; ``backward`` of ``forward_ad``
tangents, with respect to the primals and to the tangents, and of ``create_graph`` gradients, with
combining on and off) are compared, on every rank, with the same nesting of the global function
computed by plain torch in one process; inside ``f`` the nestings of ``grad``, ``vjp``, ``jvp`` and
``jacrev`` (results laid out as the inputs) likewise. Every program runs the nestings most likely to
go wrong (`AROUND`, `INSIDE_KEY`, the ones through torch.autograd); a few run all of them (a full
table for every program is too slow for CI). 1-axis meshes of 2 and 4 ranks, a 2-axis mesh of 4 and
a 3-axis mesh of 8.

With uneven blocks, the transforms inside ``f`` that map over a batch (``vmap``, ``jacfwd``,
``jacrev``, ``hessian``, nested two deep) have a table of their own (one job per world size): a
batch the same on every rank must give the global function's result, a batch made from the split
dim the same CollectiveError on every rank (it ended gloo: ``jacfwd`` by a split input sent each
rank's own number of basis vectors in one collective).
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.func as tf

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, env_vars, randn

DT = torch.float64


def _h(v, w):
    """A nonlinear head of a vector (after the collective: the ranks' blocks couple)."""
    return (v**3 / (1 + w**2)).sum() + (v * w).sum() ** 2


def _a(x, w):
    return torch.sin(x * w).sum(0)


def _blocks(x, sizes):
    """The row blocks of ``x`` cut over mesh axes of ``sizes``, one axis after the other (torch.chunk's
    cut, as fshard's layouts), in rank order."""
    out = [x]
    for n in sizes:
        out = [p for b in out for p in _chunk(b, n)]
    return out


def _chunk(x, n):
    ps = list(torch.chunk(x, n))
    return ps + [x[:0]] * (n - len(ps))  # torch.chunk may give fewer pieces than asked


# -- the programs: name -> (local loss of (x, w, axes), global loss of (x, w, sizes), x spec,
# w spec, even rows only, needs two axes); sizes: the mesh's axis sizes in order.
def _programs():
    import fshard as fs

    def grouped(x, w, sizes, fn):  # per block, the last axis innermost
        return [fn(b, w) for b in _blocks(x, sizes)]

    def last_groups(vs, n_last):
        return [vs[i : i + n_last] for i in range(0, len(vs), n_last)]

    return {
        "psum": (
            lambda x, w, A: _h(fs.psum(_a(x, w), A), w),
            lambda x, w, S: _h(_a(x, w), w),
        ),
        "pmean": (
            lambda x, w, A: _h(fs.pmean(_a(x, w), A), w),
            lambda x, w, S: _h(_a(x, w) / _prod(S), w),
        ),
        "pvary": (
            lambda x, w, A: _h(fs.psum((torch.sin(x) * fs.pvary(w, A)).sum(0), A), w),
            lambda x, w, S: _h((torch.sin(x) * w).sum(0), w),
        ),
        "all_gather tiled invariant": (
            lambda x, w, A: _h(fs.all_gather(torch.sin(x * w), A, tiled=True, invariant=True).sum(0), w),
            lambda x, w, S: _h(_a(x, w), w),
        ),
        "all_gather tiled varying": (
            lambda x, w, A: fs.pmean(_h(fs.all_gather(torch.sin(x * w), A, tiled=True).sum(0), w), A),
            lambda x, w, S: _h(_a(x, w), w),
        ),
        "all_gather stacked invariant": (
            lambda x, w, A: _h(fs.all_gather(_a(x, w), A, invariant=True).prod(0), w),
            lambda x, w, S: _h(torch.stack(grouped(x, w, S, _a)).prod(0), w),
        ),
        "all_gather stacked varying": (
            lambda x, w, A: fs.pmean(_h(fs.all_gather(_a(x, w), A)[-1], w), A),
            lambda x, w, S: _h(grouped(x, w, S, _a)[-1], w),
        ),
        "psum_scatter": (
            lambda x, w, A: fs.psum((fs.psum_scatter(_a(x, w), A, tiled=True) ** 3).sum(), A),
            lambda x, w, S: (_a(x, w) ** 3).sum(),
        ),
        "ppermute": (
            lambda x, w, A: fs.psum((fs.ppermute(_a(x, w), A, _ring(A)) ** 2 * _a(x, w)).sum(), A),
            lambda x, w, S: sum((p**2 * q).sum() for p, q in _pairs(grouped(x, w, S, _a))),
        ),
        "all_to_all": (
            lambda x, w, A: fs.psum((fs.all_to_all(torch.sin(x * w), A, 1, 0).sum(0) ** 3).sum(), A),
            lambda x, w, S: (_a(x, w) ** 3).sum(),
            "even",
        ),
        "pmax": (
            lambda x, w, A: _h(fs.pmax(_a(x, w), A), w),
            lambda x, w, S: _h(torch.stack(grouped(x, w, S, _a)).amax(0), w),
        ),
        "pmin": (
            lambda x, w, A: _h(fs.pmin(_a(x, w), A), w),
            lambda x, w, S: _h(torch.stack(grouped(x, w, S, _a)).amin(0), w),
        ),
        "pbroadcast": (
            lambda x, w, A: _h(fs.pbroadcast(_a(x, w), A, src=1), w),
            lambda x, w, S: _h(grouped(x, w, S, _a)[1], w),
        ),
        "w split, x replicated": (
            lambda x, w, A: fs.psum((_a(_c(x), w) ** 3).sum(), A) + fs.psum(_c(x).sum() * w.sum(), A) ** 2,
            lambda x, w, S: (_a(_c(x), w) ** 3).sum() + (_c(x).sum() * w.sum()) ** 2,
            "w split",
        ),
        "psum over the last axis, then the others": (
            lambda x, w, A: fs.psum((fs.psum(_a(x, w), A[-1]) ** 3).sum(), A[:-1]),
            lambda x, w, S: sum((sum(g) ** 3).sum() for g in last_groups(grouped(x, w, S, _a), S[-1])),
            "two axes",
        ),
        "all_gather over the last axis, psum over the others": (
            lambda x, w, A: fs.pmean(fs.psum(_h(fs.all_gather(_a(x, w), A[-1]).prod(0), w), A[:-1]), A[-1]),
            lambda x, w, S: sum(
                _h(torch.stack(g).prod(0), w) for g in last_groups(grouped(x, w, S, _a), S[-1])
            ),
            "two axes",
        ),
    }


def _c(x):
    return x.sum(1, keepdim=True)


def _prod(sizes):
    out = 1
    for s in sizes:
        out *= s
    return out


def _ring(A):
    import fshard as fs

    n = fs.axis_size(A)
    return [(i, (i + 1) % n) for i in range(n)]


def _pairs(vs):  # (what ppermute brought, the rank's own) per rank
    return [(vs[i - 1], vs[i]) for i in range(len(vs))]


# -- the derivative operators: each maps a function of (x, w) to another ----------------------


def _fixed(shape, seed):
    """Fixed weights of ``shape`` (no random draw: they are made under vmap too)."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=DT).mul(0.7 + 0.13 * seed).add(seed).sin().reshape(shape)


def _weights(tree, seed):
    """Fixed weights shaped as ``tree``'s leaves (the same in both computations)."""
    leaves, spec = torch.utils._pytree.tree_flatten(tree)
    return torch.utils._pytree.tree_unflatten([_fixed(t.shape, seed + i) for i, t in enumerate(leaves)], spec)


def _dot(tree, seed, psum_first=None):
    """A scalar of ``tree``: the sum of its leaves weighted by `_weights`."""
    leaves = torch.utils._pytree.tree_leaves(tree)
    ws = torch.utils._pytree.tree_leaves(_weights(tree, seed))
    return sum((t * r).sum() for t, r in zip(leaves, ws))


def _tangents(x, w):
    return _fixed(x.shape, 50), _fixed(w.shape, 51)


OPS = {
    "grad": lambda F: lambda x, w: tf.grad(lambda x, w: _dot(F(x, w), 60), argnums=(0, 1))(x, w),
    "vjp": lambda F: lambda x, w: _vjp(F, x, w),
    "jvp": lambda F: lambda x, w: tf.jvp(F, (x, w), _tangents(x, w))[1],
    "jacfwd": lambda F: tf.jacfwd(F, argnums=(0, 1)),
    "jacrev": lambda F: tf.jacrev(F, argnums=(0, 1)),
}


def _vjp(F, x, w):
    out, pull = tf.vjp(F, x, w)
    return pull(_weights(out, 70))


def _nestings():
    """name -> the operator of two derivatives (functions of (x, w) to functions of (x, w))."""
    out = {f"{o}({i})": (lambda F, o=o, i=i: OPS[o](OPS[i](F))) for o in OPS for i in OPS}
    out["hessian"] = lambda F: tf.hessian(F, argnums=(0, 1))
    return out


def _autograd_nestings(F, x, w):
    """The nestings through torch.autograd: name -> (x, w)-gradients of a scalar of the inner result."""
    out = {}
    tx, tw = _tangents(x, w)
    # backward of a forward_ad tangent: with respect to the primals, and to the tangents
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with fwAD.dual_level():
        t = fwAD.unpack_dual(F(fwAD.make_dual(xr, tx), fwAD.make_dual(wr, tw))).tangent
    out["backward(forward_ad) primals"] = torch.autograd.grad(_dot(t, 80), (xr, wr))
    txr, twr = tx.clone().requires_grad_(True), tw.clone().requires_grad_(True)
    with fwAD.dual_level():
        t = fwAD.unpack_dual(F(fwAD.make_dual(x, txr), fwAD.make_dual(w, twr))).tangent
    out["backward(forward_ad) tangents"] = torch.autograd.grad(_dot(t, 81), (txr, twr))
    # double backward (create_graph)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    g = torch.autograd.grad(F(xr, wr), (xr, wr), create_graph=True)
    out["backward(create_graph)"] = torch.autograd.grad(_dot(g, 82), (xr, wr))
    return out


# -- inside f: nestings whose results are laid out as (x, w), or a scalar ----------------------

# (not jacfwd with respect to a split input: its basis vectors perturb every rank's block at
# once, so it gives the sum of the ranks' partials, not the global Jacobian's block)
INSIDE = ("grad", "vjp", "jvp", "jacrev")


def _inside_op(name, F, psums):
    """A derivative operator inside f: grad-like ones of a scalar (``psums``, one per input, make
    the scalar of an (x-like, w-like) pair whole: the global dot), jvp with the tangents given."""
    if name == "jvp":
        return lambda x, w, tx, tw: tf.jvp(lambda x, w: F(x, w, tx, tw), (x, w), (tx, tw))[1]

    def scalar(x, w, tx, tw):
        y = F(x, w, tx, tw)
        if isinstance(y, tuple):  # (x-like, w-like): a split input's part summed over the ranks
            return psums[0]((y[0] * tx).sum()) + psums[1]((y[1] * tw).sum())
        return y

    if name == "vjp":

        def vjp(x, w, tx, tw):
            out, pull = tf.vjp(lambda x, w: scalar(x, w, tx, tw), x, w)
            return pull(torch.ones_like(out))

        return vjp
    if name == "grad":
        return lambda x, w, tx, tw: tf.grad(lambda x, w: scalar(x, w, tx, tw), argnums=(0, 1))(x, w)
    jac = tf.jacfwd if name == "jacfwd" else tf.jacrev
    return lambda x, w, tx, tw: jac(lambda x, w: scalar(x, w, tx, tw), argnums=(0, 1))(x, w)


def _inside(o, i, L, psums):
    inner = _inside_op(i, lambda x, w, tx, tw: L(x, w), psums)
    return _inside_op(o, inner, psums)


# -- the rank job ----------------------------------------------------------------------------

MESHES = {2: [{"x": 2}], 4: [{"x": 4}, {"dp": 2, "tp": 2}], 8: [{"dp": 2, "tp": 2, "pp": 2}]}


@contextlib.contextmanager
def _case(what):
    """Name the case in an error (raised on every rank alike: the job ends there)."""
    try:
        yield
    except Exception as e:
        raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e


# the nestings every program runs (around f, and inside f); the programs of ``full`` run every one
AROUND = ("jacrev(jacfwd)", "vjp(jvp)", "jvp(vjp)", "grad(jvp)", "hessian")
INSIDE_KEY = (("grad", "jvp"), ("vjp", "jvp"), ("jvp", "grad"), ("grad", "grad"))


def _rank(n: int, full=(), inside=True):
    import fshard as fs

    errs: list[str] = []
    all_nestings = _nestings()
    for shape in MESHES[n]:
        mesh = fs.Mesh(**shape)
        A = tuple(mesh.axis_names)
        S = tuple(shape.values())
        for pname, (local, ref, *opts) in _programs().items():
            if "two axes" in opts and len(A) < 2:
                continue
            for rows in (n, n + 1):  # uneven: a block of 0 rows on 4 and 8 ranks
                if "even" in opts and rows % n:
                    continue
                if "w split" in opts:
                    if rows % n:
                        continue
                    specs = ("r d", f"({' '.join(A)} d)")
                else:
                    specs = (f"({' '.join(A)} r) d", "d")
                # columns: as many as ranks (psum_scatter and all_to_all split them)
                x, w = randn(1, rows, n, dtype=DT), randn(2, n, dtype=DT) / 2
                F = fs.shard_map(
                    lambda x, w, local=local, A=A: local(x, w, A), mesh=mesh, in_specs=specs, out_specs=""
                )

                def G(x, w, ref=ref, S=S):
                    return ref(x, w, S)

                where = f"{shape} {pname} rows={rows}"
                for name in all_nestings if pname in full else AROUND:
                    nest = all_nestings[name]
                    with _case(f"{where} {name}"):
                        got = nest(F)(x, w)
                    _close_trees(errs, f"{where} {name}", got, nest(G)(x, w))
                wants = _autograd_nestings(G, x, w)
                for combine in ("1", "0"):  # per-leaf collectives combined (eager autograd) or not
                    with env_vars(FSHARD_COMBINE=combine), _case(f"{where} through torch.autograd"):
                        gots = _autograd_nestings(F, x, w)
                    for name, want in wants.items():
                        _close_trees(errs, f"{where} {name} FSHARD_COMBINE={combine}", gots[name], want)
                if inside:
                    pairs = [(o, i) for o in INSIDE for i in INSIDE] if pname in full else INSIDE_KEY
                    _inside_cases(errs, where, mesh, A, S, local, ref, specs, x, w, pairs)
    return errs


def _inside_cases(errs, where, mesh, A, S, local, ref, specs, x, w, pairs):
    import fshard as fs

    tx, tw = _tangents(x, w)
    for o, i in pairs:
        psums = tuple((lambda s: fs.psum(s, A)) if "(" in spec else (lambda s: s) for spec in specs)
        nest = _inside(o, i, lambda x, w: local(x, w, A), psums)
        want = _inside(o, i, lambda x, w: ref(x, w, S), (lambda s: s, lambda s: s))(x, w, tx, tw)
        out_specs = tuple(specs) if isinstance(want, tuple) else ""
        with _case(f"{where} inside f {o}({i})"):
            got = fs.shard_map(nest, mesh=mesh, in_specs=specs + specs, out_specs=out_specs)(x, w, tx, tw)
        got = (
            tuple(t.full() if isinstance(t, fs.Sharded) else t for t in got)
            if isinstance(got, tuple)
            else got
        )
        _close_trees(errs, f"{where} inside f {o}({i})", got, want)


def _close_trees(errs, what, got, want):
    gl, gs = torch.utils._pytree.tree_flatten(got)
    wl, ws = torch.utils._pytree.tree_flatten(want)
    if gs != ws:
        errs.append(f"{what}: structure {gs}, want {ws}")
        return
    for k, (g, v) in enumerate(zip(gl, wl)):
        close(errs, f"{what} [{k}]", g, v, DT)


@pytest.mark.timeout(900)  # many cases in one job per pool (about 2-4 min each, more under load)
@pytest.mark.parametrize("n, full", [(2, ("psum", "all_gather tiled invariant")), (4, ("ppermute",))])
def test_nested_derivatives_match_one_process(n, full):
    assert_ok(run_ranks(n, _rank, n, full, timeout=900))


@pytest.mark.timeout(900)
def test_nested_derivatives_on_a_three_axis_mesh_match_one_process():
    assert_ok(run_ranks(8, _rank, 8, (), False, timeout=900))


# -- inside f, uneven blocks: transforms that map over a batch -----------------------------------
#
# vmap, jacfwd, jacrev and hessian inside f map their function over a batch, and one collective moves
# the whole batch. With x's rows cut unevenly, a batch made from what the cut leaves alone (a batch
# dim of x or of w, the basis of the replicated w, the one element of a replicated result's
# cotangent) agrees over the ranks: those nestings must equal the same nesting of the global
# function. A batch made from a split dim (vmap over the rows, jacfwd or hessian by x, jacrev of an
# x-shaped output) has each rank's own size: no collective can pair its elements, and every rank
# raises the same CollectiveError before any of it is sent (it ended gloo, or waited forever).

NB = 3  # the size of a batch dim of x or w


def _uneven_programs():
    """`_programs` whose blocks may be uneven, with all_to_all of a value that does not keep the
    split dim (its exchange of ``sin(x * w)`` needs even blocks; a permutation keeps the sum)."""
    import fshard as fs

    progs = {k: v for k, v in _programs().items() if not ({"even", "w split"} & set(v[2:]))}
    progs["all_to_all"] = (
        lambda x, w, A: fs.psum((fs.all_to_all(_a(x, w)[:, None] * w, A, 1, 0) ** 3).sum(), A),
        lambda x, w, S: sum(((_a(b, w)[:, None] * w) ** 3).sum() for b in _blocks(x, S)),
    )
    return progs


# name -> (the transform of a loss L(x, w), the input given a leading batch dim, the result's layout:
# "" replicated, "x" as x, "x b" as x with a batch dim first, "x e" as x with one more dim last)
BATCH_AGREES = {
    "vmap over a batch of x": (lambda L: tf.vmap(L, (0, None)), "x", ""),
    "vmap over a batch of w": (lambda L: tf.vmap(L, (None, 0)), "w", ""),
    "jacfwd by w": (lambda L: tf.jacfwd(L, 1), "", ""),
    "jacrev by w": (lambda L: tf.jacrev(L, 1), "", ""),
    "hessian by w": (lambda L: tf.hessian(L, 1), "", ""),
    "jacrev(jacfwd) by w": (lambda L: tf.jacrev(tf.jacfwd(L, 1), 1), "", ""),
    "jacrev by x": (lambda L: tf.jacrev(L, 0), "", "x"),
    "jacfwd by w of jacrev by x": (lambda L: tf.jacfwd(tf.jacrev(L, 0), 1), "", "x e"),
    "jacfwd by w of an x-shaped result": (lambda L: tf.jacfwd(lambda x, w: x * L(x, w), 1), "", "x e"),
    "vmap(grad by x)": (lambda L: tf.vmap(tf.grad(L, 0), (0, None)), "x", "x b"),
    "vmap(jacfwd by w)": (lambda L: tf.vmap(tf.jacfwd(L, 1), (0, None)), "x", ""),
    "jacfwd(vmap) by w": (lambda L: tf.jacfwd(tf.vmap(L, (None, 0)), 1), "w", ""),
}

# name -> (the transform, its batch on a rank holding a block of r rows and d columns)
BATCH_SPLIT = {
    "jacfwd by x": (lambda L: tf.jacfwd(L, 0), lambda r, d: r * d),
    "hessian by x": (lambda L: tf.hessian(L, 0), lambda r, d: r * d),
    "vmap over the split rows": (lambda L: tf.vmap(lambda xi, w: L(xi[None], w), (0, None)), lambda r, d: r),
    "jacrev of an x-shaped result": (lambda L: tf.jacrev(lambda x, w: x.sum(1) * L(x, w), 1), lambda r, d: r),
}

_MOVES = (  # what fshard names the collective the batch reached
    "all_reduce (fs.psum, fs.pmean, fs.pmax, fs.pmin, or a gradient's sum over the ranks)",
    "all_gather (fs.all_gather, or the gradient of fs.psum_scatter)",
    "reduce_scatter (fs.psum_scatter, or the gradient of fs.all_gather)",
    "all_to_all (fs.all_to_all)",
    "ppermute (fs.ppermute)",
    "broadcast (fs.pbroadcast)",
)


def _split_batch_message(moves, ax, held):
    return (
        f"{moves} over {ax} under torch.func.vmap: the batch has a different size on different ranks of "
        f"{ax} ({held}), because an input of this call is split unevenly (torch.chunk's blocks) and the "
        f"batch was made from a split dim: vmap over it, jacfwd or hessian with respect to a split input, "
        f"or jacrev of a split output (their batch is that input's or output's size). One collective moves "
        f"the whole batch, element i of every rank together, so every rank of {ax} must map as many. vmap "
        f"over a dim that is not split unevenly; differentiate with respect to a split input by jacrev or "
        f"grad of a replicated (e.g. psum'd) result; or apply the transform from outside, to the shard_map'd "
        f"function (torch.func.jacfwd(fs.shard_map(f, ...)) is the global function's Jacobian)"
    )


def _split_batch_messages(A, S, batches):
    """The messages a batch of ``batches`` (each rank's, in rank order) may raise: for a collective of
    each kind over each group of axes the programs use (all of them, the last, the others). The
    first group of the collective (ranks in mesh order) whose batches differ is named, by the
    coordinates that tell it from the collective's other groups."""
    coords = list(itertools.product(*[range(s) for s in S]))
    out = set()
    for G in {A, A[-1:], A[:-1]} - {()}:
        others = [a for a in A if a not in G]
        groups: dict = {}
        for c, n in zip(coords, batches):
            i = 0
            for a in G:
                i = i * S[A.index(a)] + c[A.index(a)]
            groups.setdefault(tuple(c[A.index(a)] for a in others), {})[i] = n
        bad = next(((at, v) for at, v in groups.items() if len(set(v.values())) > 1), None)
        if bad is None:
            continue
        where = ", ".join(f"{a}={c}" for a, c in zip(others, bad[0]))
        held = "; ".join(f"index {i}: {n}" for i, n in sorted(bad[1].items()))
        held = f"where {where}: {held}" if where else held
        out |= {_split_batch_message(m, " ".join(G), held) for m in _MOVES}
    return out


UNEVEN = {
    2: [({"x": 2}, 3)],
    4: [({"x": 4}, 6), ({"dp": 2, "tp": 2}, 5)],
    8: [({"dp": 2, "tp": 2, "pp": 2}, 9)],
}


def _rank_uneven_batches(n: int, only=()):
    import fshard as fs

    errs: list[str] = []
    for shape, rows in UNEVEN[n]:  # rows % n != 0; 6 over 4 ranks: 2, 2, 2, 0
        mesh = fs.Mesh(**shape)
        A, S = tuple(mesh.axis_names), tuple(shape.values())
        xs = f"({' '.join(A)} r) d"
        blocks = [len(b) for b in _blocks(torch.zeros(rows), S)]
        layouts = {"": "...", "x": xs, "x b": f"b {xs}", "x e": f"{xs} e"}
        for pname, (local, ref, *opts) in _uneven_programs().items():
            if ("two axes" in opts and len(A) < 2) or (only and pname not in only):
                continue
            where = f"{shape} rows={rows} {pname}"

            def L(x, w, local=local, A=A):
                return local(x, w, A)

            def G(x, w, ref=ref, S=S):
                return ref(x, w, S)

            for tname, (T, batched, out) in BATCH_AGREES.items():
                x = randn(1, *((NB,) if batched == "x" else ()), rows, n, dtype=DT)
                w = randn(2, *((NB,) if batched == "w" else ()), n, dtype=DT) / 2
                specs = (f"b {xs}" if batched == "x" else xs, "b d" if batched == "w" else "d")
                F = fs.shard_map(T(L), mesh=mesh, in_specs=specs, out_specs=layouts[out])
                with _case(f"{where} inside f {tname}"):
                    got = F(x, w)
                got = got.full() if isinstance(got, fs.Sharded) else got
                close(errs, f"{where} inside f {tname}", got, T(G)(x, w), DT)
            x, w = randn(1, rows, n, dtype=DT), randn(2, n, dtype=DT) / 2
            for tname, (T, batch) in BATCH_SPLIT.items():
                F = fs.shard_map(T(L), mesh=mesh, in_specs=(xs, "d"), out_specs="...")
                try:
                    F(x, w)
                    errs.append(f"{where} inside f {tname}: no error")
                except fs.CollectiveError as e:
                    if str(e) not in _split_batch_messages(A, S, [batch(r, n) for r in blocks]):
                        errs.append(f"{where} inside f {tname}: message {str(e)!r}")
    if n == 4:
        _batch_split_over_other_axes(errs)
    return errs


def _batch_split_over_other_axes(errs):
    """A batch that differs only across the groups of a collective (rows cut over dp, summed over tp)
    is fine: each group's ranks map as many. So it is where only some ranks run the collective,
    after a branch on a value that varies over dp or in an fs.switch branch on dp (the check then
    leaves dp out)."""
    import fshard as fs

    mesh = fs.Mesh(dp=2, tp=2)
    x, w = randn(1, 5, 4, dtype=DT), randn(2, 4, dtype=DT)

    def rows(x, w):
        return tf.vmap(lambda xi: fs.psum((torch.sin(xi) * w).sum(), "tp"))(x)

    def f(x, w):
        y = rows(x, w)
        if fs.axis_index("dp") == 0:  # the dp=0 ranks only: another batched psum over tp
            y = y + 2 * rows(x, w)
        return y

    def switched(x, w):  # the same in an fs.switch branch on dp (the check leaves dp out there too)
        y = fs.switch(fs.axis_index("dp"), [lambda x, w: rows(x, w) + 2 * rows(x, w), rows], x, w)
        return fs.pmean(y, "tp")  # (typed by its operands, which vary over tp: the same on every rank)

    want = (torch.sin(x) * w).sum(1)
    want = torch.cat([3 * want[:3], want[3:]])  # rows 0-2 on dp=0
    for name, fn in (("after a branch", f), ("in fs.switch", switched)):
        with _case(f"rows over dp, psum over tp, {name}"):
            got = fs.shard_map(fn, mesh=mesh, in_specs=("(dp r) (tp d)", "(tp d)"), out_specs="(dp r)")(x, w)
        close(errs, f"rows over dp, psum over tp, {name}", got.full(), want, DT)


# on 8 ranks (slow on a small machine), the collectives whose blocks a third axis cuts differently
EIGHT = (
    "psum",
    "all_gather tiled varying",
    "psum_scatter",
    "all_to_all",
    "psum over the last axis, then the others",
)


@pytest.mark.timeout(600)  # one job per world size: about 20 s, 60 s and 40 s
@pytest.mark.parametrize("n, only", [(2, ()), (4, ()), (8, EIGHT)])
def test_batching_transforms_inside_f_with_uneven_blocks(n, only):
    assert_ok(run_ranks(n, _rank_uneven_batches, n, only, timeout=600))
