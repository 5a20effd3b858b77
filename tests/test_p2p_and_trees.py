"""Multi-rank tests of point-to-point ppermute, results on one rank, pytrees, per-rank data and
profiler labels.

- ``fs.ppermute`` is point to point: values and gradients against plain torch (full cycles, partial
  pairs, a single pair, self pairs, 2-axis meshes; more in ``test_collectives.py``), and ranks that no
  pair involves issue nothing.
- ``Sharded.full(dst=r)``, ``fs.full(tree, dst=r)`` and ``fs.reduce_to``: the value on rank ``r``
  only, one gather / reduce over the ranks that hold distinct data, None elsewhere.
- Pytrees: ``fs.shard`` with a spec prefix tree, and the tree forms of the collectives; psum, pmean,
  all_gather and psum_scatter coalesce the leaves of one dtype into one collective, forward and
  backward (values and gradients against plain torch on the global tensors).
- ``fs.Sharded.from_local``: per-rank blocks, checked to tile one global value (uneven blocks in
  ``test_uneven.py``).
- ``torch.profiler`` sees every collective as ``fshard.{kind}[{axes}] {nbytes}B``.

Global tensors are built in the test process; rank functions compute with fshard and return what the
test compares.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.distributed as dist

import fshard as fs
from fshard import _comm
from tests.conftest import run_ranks
from tests.test_collectives import _check_case


def _randn(seed, *shape, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _records(counts):
    return sorted(counts.records)


# =============================================================================================
# ppermute: point to point


@pytest.mark.parametrize(
    ("mesh_id", "axis", "perm"),
    [
        ("w2-dp2", "dp", [(0, 1)]),  # a single pair
        ("w2-dp2", "dp", [(1, 0)]),
        ("w2-dp2", "dp", [(0, 0), (1, 1)]),  # self pairs: local copies
        ("w4-dp4", "dp", [(0, 3)]),
        ("w4-dp4", "dp", [(2, 1), (1, 2)]),  # a swap inside a larger axis
        ("w4-dp4", "dp", [(0, 1), (1, 2), (2, 3), (3, 0)]),  # full cycle
        ("w4-dp4", "dp", [(3, 1), (2, 2), (0, 3)]),  # partial, with a self pair
        ("w4-dp2tp2", "tp", [(1, 0)]),  # a single pair per tp group
        ("w4-dp2tp2", "dp", [(0, 1), (1, 0)]),
        ("w4-dp2tp2", ("dp", "tp"), [(3, 0)]),
        ("w4-dp2tp2", ("tp", "dp"), [(0, 3), (3, 1)]),  # axis order differs from the mesh
        ("w4-dp2tp2", ("tp", "dp"), [(i, (i + 1) % 4) for i in range(4)]),
    ],
    ids=lambda v: str(v).replace(" ", ""),
)
def test_ppermute_values_and_gradients(mesh_id, axis, perm):
    _check_case(mesh_id, "ppermute", axis, {"perm": perm}, (2, 3))


def _rank_ppermute_counts(axis, perm, backward):
    """The (kind, axes, nbytes) records of one ppermute on Mesh(dp=2, tp=2), forward and backward."""
    mesh = fs.Mesh(dp=2, tp=2)
    xs = fs.shard(_randn(0, 4, 6), mesh, "(dp a) (tp b)")
    xs.local.requires_grad_(True)
    fn = fs.shard_map(
        lambda x: fs.ppermute(x, axis, perm), mesh=mesh, in_specs="(dp a) (tp b)", out_specs="(dp a) (tp b)"
    )
    with fs.count_collectives() as fwd:
        out = fn(xs)
    with fs.count_collectives() as bwd:
        if backward:
            out.local.backward(torch.ones_like(out.local))
    grad = xs.local.grad
    return _records(fwd), _records(bwd), None if grad is None else grad.abs().sum().item()


def test_ppermute_ranks_outside_perm_do_not_communicate():
    nbytes = 2 * 3 * 8  # a (2, 3) float64 block
    # ("dp", "tp") index i is rank i; (0 -> 3): ranks 1 and 2 take no part, forward or backward
    got = run_ranks(4, _rank_ppermute_counts, ("dp", "tp"), [(0, 3)], True)
    axes = ("dp", "tp")
    assert got[0][:2] == ([("ppermute", axes, nbytes)], [("ppermute", axes, 0)])
    assert got[3][:2] == ([("ppermute", axes, 0)], [("ppermute", axes, nbytes)])
    assert got[1][:2] == ([], []) and got[2][:2] == ([], [])
    # the gradient reaches the source only (ones sent back from rank 3); others get zeros
    assert [g[2] for g in got] == [6.0, 0.0, 0.0, 0.0]
    # a self pair is a local copy: no communication at all
    got = run_ranks(4, _rank_ppermute_counts, ("dp", "tp"), [(1, 1), (2, 2)], True)
    assert all(g[:2] == ([], []) for g in got)
    assert [g[2] for g in got] == [0.0, 6.0, 6.0, 0.0]


def test_ppermute_one_pair_per_group():
    # over tp, (1 -> 0) pairs rank 1 with rank 0 and rank 3 with rank 2: every rank takes part
    got = run_ranks(4, _rank_ppermute_counts, "tp", [(1, 0)], False)
    sent = ("ppermute", ("tp",), 48)
    received = ("ppermute", ("tp",), 0)
    assert [g[0] for g in got] == [[received], [sent], [received], [sent]]


# =============================================================================================
# results on one rank: Sharded.full(dst), fs.full(tree, dst), fs.reduce_to


def _rank_full_dst(spec, X, dst):
    mesh = fs.Mesh(dp=2, tp=2)
    xs = fs.shard(X, mesh, spec)
    with fs.count_collectives() as c:
        got = xs.full(dst=dst)
    return got, _records(c)


@pytest.mark.parametrize(
    ("spec", "dst", "members"),
    [
        ("(dp b) (tp k)", 0, {0: ("dp", "tp"), 1: ("dp", "tp"), 2: ("dp", "tp"), 3: ("dp", "tp")}),
        ("(tp dp b) k", 2, {r: ("dp", "tp") for r in range(4)}),  # split over both, not in mesh order
        ("(dp b) k", 3, {1: ("dp",), 3: ("dp",)}),  # tp replicates: only dst's tp index sends
        ("b (tp k)", 1, {0: ("tp",), 1: ("tp",)}),
        ("b k", 2, {}),  # replicated: no communication
    ],
)
def test_full_on_one_rank(spec, dst, members):
    X = _randn(1, 8, 6)
    results = run_ranks(4, _rank_full_dst, spec, X, dst)
    mesh_shape = {"dp": 2, "tp": 2}
    nsplit = 1
    for a in ("dp", "tp"):
        if a in spec:
            nsplit *= mesh_shape[a]
    block_bytes = X.numel() // nsplit * 8
    for rank, (got, records) in enumerate(results):
        if rank == dst:
            torch.testing.assert_close(got, X, rtol=0, atol=0)
        else:
            assert got is None, f"rank {rank} got a value"
        want = [("gather", members[rank], block_bytes)] if rank in members else []
        assert records == want, f"rank {rank}: {records}"


def _rank_full_tree(X, Y, dst):
    mesh = fs.Mesh(dp=2, tp=2)
    tree = {"x": fs.shard(X, mesh, "(dp b) (tp k)"), "y": [fs.shard(Y, mesh, "(tp n)"), 7]}
    everywhere = fs.full(tree)
    with fs.count_collectives() as c:
        on_dst = fs.full(tree, dst=dst)
    return everywhere, on_dst, c.by_kind()


def test_full_of_a_tree():
    X, Y = _randn(2, 4, 6), _randn(3, 4)
    results = run_ranks(4, _rank_full_tree, X, Y, 1)
    for rank, (everywhere, on_dst, _) in enumerate(results):
        assert optree.tree_structure(everywhere) == optree.tree_structure({"x": X, "y": [Y, 7]})
        torch.testing.assert_close(everywhere["x"], X)
        torch.testing.assert_close(everywhere["y"][0], Y)
        assert everywhere["y"][1] == 7
        if rank == 1:
            torch.testing.assert_close(on_dst["x"], X)
            torch.testing.assert_close(on_dst["y"][0], Y)
            assert on_dst["y"][1] == 7
        else:
            assert on_dst is None
    # one gather per Sharded leaf; Y is split over tp only: rank 1's tp group is ranks 0 and 1
    assert results[1][2] == {("gather", ("dp", "tp")): 1, ("gather", ("tp",)): 1}
    assert results[2][2] == {("gather", ("dp", "tp")): 1}


def _rank_reduce_to(dst, axis):
    mesh = fs.Mesh(dp=2, tp=2)
    r = dist.get_rank()
    tree = {"loss": _randn(10 + r, 3), "stats": [_randn(20 + r, 2, 2)], "n": torch.tensor(r + 1)}
    with fs.count_collectives() as c:
        got = fs.reduce_to(tree, mesh, dst=dst, axis=axis)
    with fs.count_collectives() as c1:
        one = fs.reduce_to(tree["loss"], mesh, dst)
    return got, one, _records(c), _records(c1)


@pytest.mark.parametrize(
    ("dst", "axis", "ranks"),
    [(0, None, (0, 1, 2, 3)), (3, None, (0, 1, 2, 3)), (3, "dp", (1, 3)), (2, ("tp",), (2, 3))],
)
def test_reduce_to(dst, axis, ranks):
    results = run_ranks(4, _rank_reduce_to, dst, axis)
    want = {
        "loss": sum(_randn(10 + r, 3) for r in ranks),
        "stats": [sum(_randn(20 + r, 2, 2) for r in ranks)],
        "n": torch.tensor(sum(r + 1 for r in ranks)),
    }
    axes = ("dp", "tp") if axis is None else (axis,) if isinstance(axis, str) else axis
    for rank, (got, one, records, records1) in enumerate(results):
        if rank == dst:
            assert optree.tree_structure(got) == optree.tree_structure(want)
            torch.testing.assert_close(got["loss"], want["loss"])
            torch.testing.assert_close(got["stats"][0], want["stats"][0])
            assert got["n"].dtype == torch.int64 and got["n"].item() == want["n"].item()
            torch.testing.assert_close(one, sum(_randn(10 + r, 3) for r in range(4)))
        else:
            assert got is None and one is None
        # the two float64 leaves go in one reduce, the int64 count in another
        want_records = sorted([("reduce", axes, (3 + 4) * 8), ("reduce", axes, 8)]) if rank in ranks else []
        assert records == want_records, f"rank {rank}: {records}"
        assert records1 == [("reduce", ("dp", "tp"), 24)]


def _rank_one_rank_errors():
    mesh = fs.Mesh(dp=2, tp=2)
    xs = fs.shard(torch.ones(4, 2), mesh, "(dp b) k")
    calls = {
        "full_dst_range": lambda: xs.full(dst=4),
        "full_dst_type": lambda: xs.full(dst="0"),
        "tree_dst": lambda: fs.full({"x": xs}, dst=-1),
        "reduce_dst": lambda: fs.reduce_to(torch.ones(2), mesh, dst=5),
        "reduce_not_tensor": lambda: fs.reduce_to(2.0, mesh),
        "reduce_leaf": lambda: fs.reduce_to({"a": torch.ones(2), "b": 3}, mesh),
        "reduce_axis": lambda: fs.reduce_to(torch.ones(2), mesh, axis="tpp"),
        "reduce_inside": lambda: fs.shard_map(
            lambda x: fs.reduce_to(x, mesh), mesh=mesh, in_specs="(dp b)", out_specs="(dp b)"
        )(torch.ones(4)),
    }
    out = {}
    for name, call in calls.items():
        with fs.count_collectives() as c:
            try:
                call()
                out[name] = ("no error",)
            except fs.FshardError as e:
                out[name] = (type(e).__name__, str(e), c.total)
    return out


def test_one_rank_errors():
    expected = {
        "full_dst_range": (
            "ArgumentError",
            "Sharded.full: dst=4 must be a global rank of Mesh(dp=2, tp=2), in [0, 4)",
        ),
        "full_dst_type": (
            "ArgumentError",
            "Sharded.full: dst='0' must be a global rank of Mesh(dp=2, tp=2), in [0, 4)",
        ),
        "tree_dst": ("ArgumentError", "fs.full: dst=-1 must be a global rank of Mesh(dp=2, tp=2), in [0, 4)"),
        "reduce_dst": (
            "ArgumentError",
            "fs.reduce_to: dst=5 must be a global rank of Mesh(dp=2, tp=2), in [0, 4)",
        ),
        "reduce_not_tensor": ("ArgumentError", "fs.reduce_to expects a torch.Tensor, got float"),
        "reduce_leaf": (
            "ArgumentError",
            "fs.reduce_to expects a torch.Tensor or a pytree of tensors, got int at x['b']",
        ),
        "reduce_axis": (
            "CollectiveError",
            "fs.reduce_to: 'tpp' is not an axis of Mesh(dp=2, tp=2) (did you mean 'tp'?)",
        ),
        "reduce_inside": (
            "CollectiveError",
            "fs.reduce_to sums per-rank tensors outside fs.shard_map; inside it, use fs.psum(x, axis) (every rank "
            "gets the sum) and return the result",
        ),
    }
    for rank, got in enumerate(run_ranks(4, _rank_one_rank_errors)):
        for name, (kind, text) in expected.items():
            assert got[name][:2] == (kind, text), (rank, name, got[name])
            assert got[name][2] == 0, f"rank {rank} {name}: communication before the error"


# =============================================================================================
# pytrees: fs.shard with a spec prefix tree


def _rank_shard_tree(tree, specs, src):
    mesh = fs.Mesh(dp=2, tp=2)
    arg = tree if src is None or dist.get_rank() == src else None
    with fs.count_collectives() as c:
        out = fs.shard(arg, mesh, specs, src=src)
    leaves = optree.tree_leaves(out)
    assert all(isinstance(x, fs.Sharded) for x in leaves)
    return (
        optree.tree_map(lambda s: s.spec, out),
        optree.tree_map(lambda s: s.local.clone(), out),
        fs.full(out),
        c.by_kind(),
    )


@pytest.mark.parametrize("src", [None, 2])
def test_shard_a_tree_with_a_spec_prefix(src):
    tree = {
        "layers": [{"w": _randn(1, 4, 6), "b": _randn(2, 6)}, {"w": _randn(3, 4, 6), "b": _randn(4, 6)}],
        "emb": _randn(5, 8, 2),
        "scale": _randn(6, 3),
    }
    specs = {"layers": [{"w": "(dp a) (tp b)", "b": "(tp b)"}] * 2, "emb": "(dp tp v) d", "scale": None}
    results = run_ranks(4, _rank_shard_tree, tree, specs, src)
    coords = [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, (spec_tree, local, full, kinds) in enumerate(results):
        dp, tp = coords[rank]
        assert spec_tree == {
            "layers": [{"w": "(dp a) (tp b)", "b": "(tp b)"}] * 2,
            "emb": "(dp tp v) d",
            "scale": "d0",  # None: "...", replicated
        }
        for i in range(2):
            w, b = tree["layers"][i]["w"], tree["layers"][i]["b"]
            assert torch.equal(local["layers"][i]["w"], w[2 * dp : 2 * dp + 2, 3 * tp : 3 * tp + 3])
            assert torch.equal(local["layers"][i]["b"], b[3 * tp : 3 * tp + 3])
        assert torch.equal(local["emb"], tree["emb"][2 * rank : 2 * rank + 2])
        assert torch.equal(local["scale"], tree["scale"])
        assert optree.tree_all(optree.tree_map(torch.equal, full, tree))
        # with src: one broadcast of the structure, one scatter per leaf; without: no communication
        assert kinds == ({} if src is None else {("broadcast", ("world",)): 1, ("scatter", ("world",)): 6})


def _rank_shard_tree_errors():
    mesh = fs.Mesh(dp=2, tp=2)
    calls = {
        "keys": lambda: fs.shard({"a": torch.ones(4), "c": torch.ones(2)}, mesh, {"a": "(dp n)", "b": "n"}),
        "arity": lambda: fs.shard([torch.ones(4)] * 3, mesh, ["(dp n)", "n"]),
        "nested": lambda: fs.shard({"l": [torch.ones(4)] * 2}, mesh, {"l": {"w": "(dp n)"}}),
        "tuple": lambda: fs.shard([torch.ones(4)] * 2, mesh, ("(dp n)", "n")),
        "leaf": lambda: fs.shard({"a": torch.ones(4), "step": 3}, mesh, "(dp n)"),
        "no_tensor": lambda: fs.shard([1.0, 2.0], mesh, "b"),
        "two_bad_specs": lambda: fs.shard(
            {"a": torch.ones(3, 2), "b": torch.ones(4), "c": torch.ones(5)},
            mesh,
            {"a": "(dp n) k z", "b": "(tp n)", "c": "(tq n)"},
        ),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = ("no error",)
        except fs.FshardError as e:
            out[name] = (type(e).__name__, str(e))
    return out


def test_shard_tree_errors():
    mesh = "Mesh(dp=2, tp=2)"
    expected = {
        "keys": (
            "SpecError",
            "fs.shard: the spec tree does not match the structure of x: spec has keys ['a', 'b'] but x has "
            "keys ['a', 'c']\nfix: give one spec per leaf, or one spec for a whole subtree",
        ),
        "arity": (
            "SpecError",
            "fs.shard: the spec tree does not match the structure of x: spec has 2 entries but x has 3\n"
            "fix: give one spec per leaf, or one spec for a whole subtree",
        ),
        "nested": (
            "SpecError",
            "fs.shard: the spec tree does not match the structure of x: spec['l'] is a dict with keys ['w'] "
            "but x['l'] is a list of 2\nfix: give one spec per leaf, or one spec for a whole subtree",
        ),
        "tuple": (
            "SpecError",
            "fs.shard: the spec tree does not match the structure of x: spec is a tuple of 2 but x is a list "
            "of 2\nfix: give one spec per leaf, or one spec for a whole subtree",
        ),
        "leaf": (
            "ArgumentError",
            "fs.shard expects a torch.Tensor or a pytree of tensors, got int at x['step']",
        ),
        "no_tensor": ("ArgumentError", "fs.shard expects a torch.Tensor, got list"),
        "two_bad_specs": (
            "SpecError",
            f"fs.shard at x['a']: spec '(dp n) k z' for shape (3, 2) on {mesh}:\n"
            "  - the spec names 3 dims but the tensor has 2; write one name per dim, or '...' for unsplit dims\n"
            f"fs.shard at x['c']: spec '(tq n)' for shape (5,) on {mesh}:\n"
            f"  - 'tq' in (tq n) is not an axis of {mesh} (did you mean 'tp'?); a group lists mesh axes "
            "first, then one dim label",
        ),
    }
    got = run_ranks(4, _rank_shard_tree_errors)
    assert all(g == got[0] for g in got)
    for name, want in expected.items():
        assert got[0][name] == want, (name, got[0][name])


def _rank_shard_src_tree_leaf():
    mesh = fs.Mesh(dp=2)
    tree = {"a": torch.ones(4), "step": 3} if dist.get_rank() == 0 else None
    try:
        fs.shard(tree, mesh, "(dp n)", src=0)
    except fs.ArgumentError as e:
        return str(e)
    return "no error"


def test_shard_src_tree_with_a_non_tensor_leaf_raises_on_every_rank():
    want = "fs.shard(src=0) needs a tensor or a pytree of tensors on rank 0, got int at x['step']"
    assert run_ranks(2, _rank_shard_src_tree_leaf) == [want, want]


# =============================================================================================
# pytrees: collectives; coalesced psum / pmean / all_gather / psum_scatter

# Each leaf's global tensor has leading dims (dp=2, tp=2): rank (i, j) holds leaf[i, j]. An
# output invariant over tp comes back with a tp dim of size 1.

_IN = "(dp i) (tp j) ..."
_OUT_VARYING = "(dp i) (tp j) ..."
_OUT_TP_INVARIANT = "(dp i) j ..."


def _tree_case(case):
    """(fs op on the tree of blocks, out_spec, plain-torch reference on the tree of global leaves)."""

    def each(fn):
        return lambda t: optree.tree_map(fn, t)

    def gather(x, dim, tiled):  # reference all_gather over tp of block x[i, j], per (i, j)
        def one(i):
            blocks = [x[i, jj] for jj in range(2)]
            return torch.cat(blocks, dim) if tiled else torch.stack(blocks, dim)

        return torch.stack([torch.stack([one(i)] * 2) for i in range(2)])

    def scatter(x, dim):  # reference psum_scatter over tp (tiled) of block x[i, j]
        return torch.stack(
            [torch.stack([(x[i, 0] + x[i, 1]).chunk(2, dim)[j] for j in range(2)]) for i in range(2)]
        )

    return {
        "psum": (lambda t: fs.psum(t, "tp"), _OUT_TP_INVARIANT, each(lambda x: x.sum(1, keepdim=True))),
        "pmean": (lambda t: fs.pmean(t, "tp"), _OUT_TP_INVARIANT, each(lambda x: x.mean(1, keepdim=True))),
        "all_gather_tiled": (
            lambda t: fs.all_gather(t, "tp", dim=0, tiled=True),
            _OUT_VARYING,
            each(lambda x: gather(x, 0, True)),
        ),
        "all_gather_stacked_last": (
            lambda t: fs.all_gather(t, "tp", dim=-1),
            _OUT_VARYING,
            each(lambda x: gather(x, -1, False)),
        ),
        "all_gather_invariant": (
            lambda t: fs.all_gather(t, "tp", dim=0, tiled=True, invariant=True),
            _OUT_TP_INVARIANT,
            each(lambda x: gather(x, 0, True)[:, :1]),
        ),
        "psum_scatter": (
            lambda t: fs.psum_scatter(t, "tp", dim=0, tiled=True),
            _OUT_VARYING,
            each(lambda x: scatter(x, 0)),
        ),
        "pmax": (lambda t: fs.pmax(t, "tp"), _OUT_TP_INVARIANT, each(lambda x: x.amax(1, keepdim=True))),
        "ppermute": (
            lambda t: fs.ppermute(t, "tp", [(0, 1)]),
            _OUT_VARYING,
            each(lambda x: torch.stack([torch.zeros_like(x[:, 0]), x[:, 0]], 1)),
        ),
    }[case]


def _tree_input():
    return {
        "a": _randn(1, 2, 2, 4, 3),
        "b": [_randn(2, 2, 2, 2), _randn(3, 2, 2, 6, 2, 2)],
        "c": _randn(4, 2, 2, 2, 4, dtype=torch.float32),
    }


def _rank_tree_collective(case, X, W):
    mesh = fs.Mesh(dp=2, tp=2)
    op, out_spec, _ = _tree_case(case)

    def f(t):
        blocks = optree.tree_map(lambda x: x.reshape(x.shape[2:]), t)
        out = op(blocks)
        return optree.tree_map(lambda y: y.reshape((1, 1, *y.shape)), out)

    fn = fs.shard_map(f, mesh=mesh, in_specs=_IN, out_specs=out_spec)
    # values and gradients: plain global inputs, global outputs
    Xg = optree.tree_map(lambda x: x.clone().requires_grad_(True), X)
    full = fs.full(fn(Xg))
    loss = sum((y * w).sum() for y, w in zip(optree.tree_leaves(full), optree.tree_leaves(W)))
    loss.backward()
    grads = optree.tree_map(lambda x: x.grad, Xg)
    # collectives of the op alone: Sharded inputs, backward from the local outputs
    xs = fs.shard(X, mesh, _IN)
    for s in optree.tree_leaves(xs):
        s.local.requires_grad_(True)
    with fs.count_collectives() as fwd:
        out = fn(xs)
    locals_ = [y.local if isinstance(y, fs.Sharded) else y for y in optree.tree_leaves(out)]
    with fs.count_collectives() as bwd:
        torch.autograd.backward(locals_, [torch.ones_like(y) for y in locals_])
    return optree.tree_map(torch.Tensor.detach, full), grads, dict(fwd.by_kind()), dict(bwd.by_kind())


# (forward, backward) collectives: two dtypes (float64 a, b[0], b[1]; float32 c) -> two collectives
_TREE_COUNTS = {
    "psum": ({("all_reduce", ("tp",)): 2}, {}),
    "pmean": ({("all_reduce", ("tp",)): 2}, {}),
    "all_gather_tiled": ({("all_gather", ("tp",)): 2}, {("reduce_scatter", ("tp",)): 2}),
    "all_gather_stacked_last": ({("all_gather", ("tp",)): 2}, {("reduce_scatter", ("tp",)): 2}),
    "all_gather_invariant": ({("all_gather", ("tp",)): 2}, {}),
    "psum_scatter": ({("reduce_scatter", ("tp",)): 2}, {("all_gather", ("tp",)): 2}),
    "pmax": ({("all_reduce", ("tp",)): 4}, {("all_reduce", ("tp",)): 4}),  # leaf by leaf (+ tie counts)
    "ppermute": ({("ppermute", ("tp",)): 4}, {("ppermute", ("tp",)): 4}),  # leaf by leaf
}


@pytest.mark.parametrize("case", list(_TREE_COUNTS))
def test_tree_collective_values_gradients_and_counts(case):
    X = _tree_input()
    if case == "pmax":  # few distinct values: ties across ranks
        X = optree.tree_map(lambda x: (x * 2).round().clamp(-1, 1), X)
    Xr = optree.tree_map(lambda x: x.clone().requires_grad_(True), X)
    ref = _tree_case(case)[2](Xr)
    W = optree.tree_map(lambda y: _randn(7, *y.shape, dtype=y.dtype), ref)
    sum((y * w).sum() for y, w in zip(optree.tree_leaves(ref), optree.tree_leaves(W))).backward()
    want_fwd, want_bwd = _TREE_COUNTS[case]
    for rank, (full, grads, fwd, bwd) in enumerate(run_ranks(4, _rank_tree_collective, case, X, W)):
        assert optree.tree_structure(full) == optree.tree_structure(ref)
        for path, got, want in zip(optree.tree_paths(ref), optree.tree_leaves(full), optree.tree_leaves(ref)):
            torch.testing.assert_close(got, want.detach(), msg=lambda m, p=path, r=rank: f"rank {r} {p}: {m}")
        for path, got, x in zip(optree.tree_paths(Xr), optree.tree_leaves(grads), optree.tree_leaves(Xr)):
            torch.testing.assert_close(got, x.grad, msg=lambda m, p=path, r=rank: f"rank {r} grad {p}: {m}")
        assert fwd == want_fwd, f"rank {rank} forward: {fwd}"
        assert bwd == want_bwd, f"rank {rank} backward: {bwd}"


def _rank_one_dtype_tree(X):
    mesh = fs.Mesh(dp=2, tp=2)
    xs = fs.shard(X, mesh, "(dp i) (tp j) ...")
    for s in optree.tree_leaves(xs):
        s.local.requires_grad_(True)

    def f(t):
        t = optree.tree_map(lambda x: x.reshape(x.shape[2:]), t)
        s = fs.psum(t, ("dp", "tp"))
        g = fs.all_gather(t, "dp", dim=0, tiled=True)
        total_s = sum(y.sum() for y in optree.tree_leaves(s))  # invariant
        total_g = sum(y.sum() for y in optree.tree_leaves(g))  # varying over dp and tp
        return total_s, fs.psum(total_g, ("dp", "tp"))

    fn = fs.shard_map(f, mesh=mesh, in_specs="(dp i) (tp j) ...", out_specs=("", ""))
    with fs.count_collectives() as fwd:
        a, b = fn(xs)
    with fs.count_collectives() as bwd:
        (a + b).backward()
    return dict(fwd.by_kind()), dict(bwd.by_kind()), _records(fwd)


def test_one_dtype_tree_is_one_collective():
    X = {"w": _randn(1, 2, 2, 4, 3), "b": _randn(2, 2, 2, 3), "layers": [_randn(3, 2, 2, 2, 2)] * 3}
    n = 4 * 3 + 3 + 3 * 4
    for rank, (fwd, bwd, records) in enumerate(run_ranks(4, _rank_one_dtype_tree, X)):
        # forward: one all-reduce and one all-gather for the whole tree (plus the psum of the scalar
        # total); backward: one reduce-scatter
        assert fwd == {("all_reduce", ("dp", "tp")): 2, ("all_gather", ("dp",)): 1}, (rank, fwd)
        assert bwd == {("reduce_scatter", ("dp",)): 1}, (rank, bwd)
        assert ("all_reduce", ("dp", "tp"), n * 8) in records and ("all_gather", ("dp",), n * 8) in records


def _rank_mixed_varying_psum(X, Y):
    mesh = fs.Mesh(dp=2, tp=2)

    def f(x, y):  # x varies over dp and tp, y over dp only: same dtype, different reductions
        out = fs.psum({"x": x.reshape(x.shape[2:]), "y": y.reshape(y.shape[1:])}, ("dp", "tp"))
        return out["x"], out["y"]

    fn = fs.shard_map(f, mesh=mesh, in_specs=("(dp i) (tp j) ...", "(dp i) ..."), out_specs=("...", "..."))
    Xg, Yg = X.clone().requires_grad_(True), Y.clone().requires_grad_(True)
    with fs.count_collectives() as c:
        sx, sy = fn(Xg, Yg)
    (sx.sum() * 2 + (sy * sy).sum()).backward()
    return sx.detach(), sy.detach(), Xg.grad, Yg.grad, c.by_kind()


def test_psum_tree_with_leaves_of_different_varying_axes():
    X, Y = _randn(1, 2, 2, 3), _randn(2, 2, 4)
    Xr, Yr = X.clone().requires_grad_(True), Y.clone().requires_grad_(True)
    sx, sy = Xr.sum((0, 1)), Yr.sum(0) * 2  # y is the same on both tp ranks: counted twice
    (sx.sum() * 2 + (sy * sy).sum()).backward()
    for rank, (gx, gy, dx, dy, kinds) in enumerate(run_ranks(4, _rank_mixed_varying_psum, X, Y)):
        torch.testing.assert_close(gx, sx.detach())
        torch.testing.assert_close(gy, sy.detach())
        torch.testing.assert_close(dx, Xr.grad, msg=lambda m, r=rank: f"rank {r} dx: {m}")
        torch.testing.assert_close(dy, Yr.grad, msg=lambda m, r=rank: f"rank {r} dy: {m}")
        assert kinds[("all_reduce", ("dp", "tp"))] == 1 and kinds[("all_reduce", ("dp",))] == 1, kinds


def _rank_tree_collective_errors():
    mesh = fs.Mesh(dp=2, tp=2)
    calls = {
        "leaf": lambda x: fs.psum({"x": x, "n": 3}, "tp"),
        "bare": lambda x: fs.psum(b"3", "tp"),
        "dim": lambda x: fs.all_gather({"x": x, "v": x[0]}, "tp", dim=2),
        "scatter": lambda x: fs.psum_scatter([x, x[:, :1]], "tp", dim=1, tiled=True),
        "axis": lambda x: fs.all_gather([x], "tpp"),
        "perm": lambda x: fs.ppermute({"x": x}, "tp", [(0, 2)]),
    }
    out = {}
    for name, call in calls.items():
        fn = fs.shard_map(call, mesh=mesh, in_specs="(dp a) b", out_specs="(dp a) b")
        with fs.count_collectives() as c:
            try:
                fn(torch.ones(4, 2))
                out[name] = ("no error",)
            except fs.FshardError as e:
                out[name] = (type(e).__name__, str(e), c.total)
    return out


def test_tree_collective_errors():
    expected = {
        "leaf": "fs.psum expects a torch.Tensor or a pytree of tensors, got int at x['n']",
        "bare": "fs.psum expects a torch.Tensor or a pytree of tensors, got bytes",
        "dim": "fs.all_gather at x['v']: dim=2 is out of range for a tensor of 2 dims",
        "scatter": "fs.psum_scatter at x[1]: dim 1 of shape (2, 1) has size 1, which the axis size 2 does "
        "not divide; pad it to 2",
        "axis": "fs.all_gather: 'tpp' is not an axis of Mesh(dp=2, tp=2) (did you mean 'tp'?)",
        "perm": "fs.ppermute: bad perm [(0, 2)] for axis 'tp' of size 2: indices must lie in [0, 2)",
    }
    for rank, got in enumerate(run_ranks(4, _rank_tree_collective_errors)):
        for name, text in expected.items():
            assert got[name] == ("CollectiveError", text, 0), (rank, name, got[name])


# =============================================================================================
# fs.Sharded.from_local


def _rank_from_local(X, uneven):
    mesh = fs.Mesh(dp=4)
    r = dist.get_rank()
    block = X[2 * r : 2 * r + 2]
    if uneven and r == 3:
        block = block[:1]
    try:
        with fs.count_collectives() as c:
            s = fs.Sharded.from_local(block, mesh, "(dp b) d")
    except fs.SpecError as e:
        return str(e)
    return s.shape, s.spec, s.full(), c.by_kind()


def test_from_local():
    X = _randn(1, 8, 3)
    for shape, spec, full, kinds in run_ranks(4, _rank_from_local, X, False):
        assert shape == (8, 3) and spec == "(dp b) d"
        assert torch.equal(full, X)
        assert kinds == {("all_gather", ("dp",)): 1}  # the shape check
    # an uneven last batch (2, 2, 2, 1 rows: torch.chunk's blocks of 7 rows) is a 7-row global batch
    for shape, spec, full, kinds in run_ranks(4, _rank_from_local, X, True):
        assert shape == (7, 3) and spec == "(dp b) d"
        assert torch.equal(full, X[:7])
        assert kinds == {("all_gather", ("dp",)): 1}


# =============================================================================================
# torch.profiler labels


def _rank_profiled():
    from torch.profiler import ProfilerActivity, profile

    mesh = fs.Mesh(dp=2)
    X = _randn(0, 4, 3).requires_grad_(True)

    def f(x):
        return fs.psum(x, "dp") + fs.all_gather(x, "dp", tiled=True)[:2]

    fn = fs.shard_map(f, mesh=mesh, in_specs="(dp b) k", out_specs="(dp b) k")
    fn(X)  # warm up (plans) outside the trace
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn(X).full()
        out.sum().backward()
    names = sorted({e.name for e in prof.events() if e.name.startswith("fshard.")})
    quiet = _comm._span("all_reduce", ("dp",), 8) is _comm._NO_SPAN
    return names, quiet


def test_profiler_labels():
    for names, quiet in run_ranks(2, _rank_profiled):
        # forward psum and all_gather of a (2, 3) float64 block; full() gathers the (2, 3) output;
        # backward: the all_gather's reduce-scatter (4 x 3), the input slice's all-gather
        assert names == [
            "fshard.all_gather[dp] 48B",
            "fshard.all_reduce[dp] 48B",
            "fshard.reduce_scatter[dp] 96B",
        ], names
        assert quiet  # no profiler running: the shared no-op context


# =============================================================================================
# all_gather of a pytree with one dim per leaf: one coalesced all-gather, one reduce-scatter back


def _rank_gather_dims(A, B):
    mesh = fs.Mesh(dp=4)

    @fs.shard_map(mesh=mesh, in_specs=({"a": "(dp r) c", "b": "c (dp k)"},), out_specs="")
    def f(p):
        full = fs.all_gather(p, "dp", dim={"a": 0, "b": 1}, tiled=True)
        return fs.pmean((full["a"] @ full["b"]).tanh().sum(), "dp")

    a = fs.shard(A, mesh, "(dp r) c").requires_grad_(True)  # stored split: no gradient gathers
    b = fs.shard(B, mesh, "c (dp k)").requires_grad_(True)
    with fs.count_collectives() as c:
        loss = f({"a": a, "b": b})
        loss.backward()
    try:
        fs.shard_map(
            lambda p: fs.all_gather(p, "dp", dim={"a": 0}, tiled=True)["a"].sum(),
            mesh=mesh,
            in_specs=({"a": "(dp r) c", "b": "c (dp k)"},),
            out_specs="",
            check=False,
        )({"a": a, "b": b})
        err = None
    except fs.CollectiveError as e:
        err = str(e)
    return loss.detach(), a.grad.full(), b.grad.full(), c.by_kind(), err


def test_all_gather_tree_with_a_dim_per_leaf():
    A, B = _randn(1, 8, 4), _randn(2, 4, 8)
    a, b = A.clone().requires_grad_(True), B.clone().requires_grad_(True)
    want = (a @ b).tanh().sum()
    want.backward()
    for loss, ga, gb, kinds, err in run_ranks(4, _rank_gather_dims, A, B):
        torch.testing.assert_close(loss, want.detach())
        torch.testing.assert_close(ga, a.grad)
        torch.testing.assert_close(gb, b.grad)
        # one coalesced all-gather (and the loss's all-reduce); one reduce-scatter back
        assert kinds == {
            ("all_gather", ("dp",)): 1,
            ("reduce_scatter", ("dp",)): 1,
            ("all_reduce", ("dp",)): 1,
        }
        assert err == (
            "fs.all_gather: dim must be an int or a pytree of ints matching x (or a prefix of it); "
            "got dim={'a': 0} for x with structure PyTreeSpec({'a': *, 'b': *})"
        )
