"""Multi-rank tests of ``fs.shard_map``, ``fs.Sharded`` / ``fs.shard`` and DTensor interop.

Expected local blocks and global values are computed in the test process with plain torch from the
global tensors (``narrow`` at the block index given by the rank's mesh coordinate, first listed axis
major), never taken from fshard's own output.
"""

from __future__ import annotations

import collections
import math
import pickle
from dataclasses import field

import optree
import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks

MESH_2x2 = {"dp": 2, "tp": 2}


def _expected_block(X, dims_axes, coord, mesh_shape):
    """Rank ``coord``'s block of global ``X``: dim d split over ``dims_axes[d]`` (first axis major)."""
    b = X
    for d, axes in enumerate(dims_axes):
        if axes:
            n = math.prod(mesh_shape[a] for a in axes)
            idx = 0
            for a in axes:
                idx = idx * mesh_shape[a] + coord[a]
            size = X.shape[d] // n
            b = b.narrow(d, idx * size, size)
    return b


def _plain(t):
    """A fresh tensor with ``t``'s values (no autograd history, no Python attributes)."""
    return torch.empty_like(t).copy_(t.detach())


def _global(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# spec forms: identity-like f with in_spec == out_spec, plain global input


def _rank_spec_form(mesh_shape, spec, X, W):
    mesh = fs.Mesh(dict(mesh_shape))
    X = X.clone().requires_grad_(True)
    seen = {}

    def f(x):
        seen["local_in"] = x
        return x * 2

    out = fs.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec)(X)
    if isinstance(out, fs.Sharded):
        info = ("Sharded", tuple(out.shape), _plain(out.local), out.spec)
        full = out.full()
    else:
        info = ("Tensor", tuple(out.shape), _plain(out), None)
        full = out
    (full * W).sum().backward()
    return mesh.coordinate, _plain(seen["local_in"]), info, _plain(full), X.grad


SPEC_FORMS = [
    # (mesh, spec, global shape, axes per dim (independent of the parser), spec text of the Sharded)
    (MESH_2x2, "b n", (4, 6), [(), ()], None),
    (MESH_2x2, "(dp b) n", (4, 6), [("dp",), ()], "(dp b) n"),
    (MESH_2x2, "(tp b) n", (4, 6), [("tp",), ()], "(tp b) n"),
    (MESH_2x2, "(dp tp b) n", (8, 3), [("dp", "tp"), ()], "(dp tp b) n"),
    (MESH_2x2, "(tp dp b) n", (8, 3), [("tp", "dp"), ()], "(tp dp b) n"),
    (MESH_2x2, "(dp b) (tp n)", (4, 6), [("dp",), ("tp",)], "(dp b) (tp n)"),
    (MESH_2x2, "(tp b) (dp n)", (4, 6), [("tp",), ("dp",)], "(tp b) (dp n)"),
    (MESH_2x2, "b (tp dp n)", (3, 8), [(), ("tp", "dp")], "b (tp dp n)"),
    (MESH_2x2, "(dp b) ...", (4, 3, 5), [("dp",), (), ()], "(dp b) d1 d2"),
    (MESH_2x2, "... (tp n)", (3, 5, 4), [(), (), ("tp",)], "d0 d1 (tp n)"),
    (MESH_2x2, "(dp b) ... (tp n)", (2, 3, 5, 4), [("dp",), (), (), ("tp",)], "(dp b) d1 d2 (tp n)"),
    (MESH_2x2, "... (dp tp n)", (8,), [("dp", "tp")], "(dp tp n)"),  # "..." matching no dim
    (MESH_2x2, "...", (3, 4), [(), ()], None),
    (MESH_2x2, "", (), [], None),  # a scalar
    ({"dp": 2}, "(dp b) n", (4, 2), [("dp",), ()], "(dp b) n"),
    ({"dp": 2, "tp": 2, "pp": 2}, "(pp tp b) (dp n)", (8, 4), [("pp", "tp"), ("dp",)], "(pp tp b) (dp n)"),
]


@pytest.mark.parametrize(
    ("mesh_shape", "spec", "shape", "dims_axes", "sharded_spec"),
    SPEC_FORMS,
    ids=[f"{'x'.join(map(str, m.values()))}:{s or 'scalar'}" for m, s, *_ in SPEC_FORMS],
)
def test_spec_forms(mesh_shape, spec, shape, dims_axes, sharded_spec):
    world = math.prod(mesh_shape.values())
    X = _global(shape)
    W = _global(shape, seed=1)
    coords = set()
    for coord, local_in, (kind, gshape, local_out, text), full, grad in run_ranks(
        world, _rank_spec_form, mesh_shape, spec, X, W
    ):
        coords.add(tuple(coord.values()))
        block = _expected_block(X, dims_axes, coord, mesh_shape)
        torch.testing.assert_close(local_in, block)
        torch.testing.assert_close(local_out, 2 * block)
        assert gshape == shape
        assert kind == ("Sharded" if sharded_spec else "Tensor")
        assert text == sharded_spec
        torch.testing.assert_close(full, 2 * X)
        torch.testing.assert_close(grad, 2 * W)
    assert len(coords) == world  # one rank per mesh coordinate


# ---------------------------------------------------------------------------------------------
# fs.shard (with and without src), .full(), .reshard()


def _rank_shard(spec, X, src):
    mesh = fs.Mesh(dp=2, tp=2)
    with fs.count_collectives() as c:
        if src is None:
            s = fs.shard(X, mesh, spec)
        else:
            s = fs.shard(X if mesh.rank == src else None, mesh, spec, src=src)
    n_shard = [r[0] for r in c.records]
    with fs.count_collectives() as c:
        full = s.full()
    return (
        mesh.coordinate,
        s.local,
        tuple(s.shape),
        s.dtype,
        s.spec,
        full,
        n_shard,
        sorted(c.by_kind().items()),
    )


SHARD_CASES = [
    ("(dp b) n", [("dp",), ()], {("all_gather", ("dp",)): 1}),
    ("(tp dp b) n", [("tp", "dp"), ()], {("all_gather", ("tp", "dp")): 1}),
    ("(tp b) (dp n)", [("tp",), ("dp",)], {("all_gather", ("tp",)): 1, ("all_gather", ("dp",)): 1}),
    ("b n", [(), ()], {}),
]


@pytest.mark.parametrize("src", [None, 0, 3], ids=["no_src", "src0", "src3"])
@pytest.mark.parametrize(("spec", "dims_axes", "full_kinds"), SHARD_CASES, ids=[c[0] for c in SHARD_CASES])
def test_shard_and_full(spec, dims_axes, full_kinds, src):
    X = _global((8, 4)).to(torch.float32)
    for coord, local, shape, dtype, text, full, n_shard, kinds in run_ranks(4, _rank_shard, spec, X, src):
        assert torch.equal(local, _expected_block(X, dims_axes, coord, MESH_2x2))
        assert shape == (8, 4) and dtype == torch.float32 and text == spec
        assert torch.equal(full, X)
        assert dict(kinds) == full_kinds
        if src is None:
            assert n_shard == []  # every rank slices its own block: no communication


def _rank_shard_src_counted():
    mesh = fs.Mesh(dp=2, tp=2)
    X = torch.arange(8.0).reshape(8, 1) if mesh.rank == 0 else None
    with fs.count_collectives() as c:
        fs.shard(X, mesh, "(dp tp b) n", src=0)
    return [r[0] for r in c.records]


def test_shard_with_src_is_counted():
    # count_collectives: "Every byte fshard moves goes through" fshard's comm layer, and "scatter" is a
    # documented record kind; fs.shard(..., src=r) scatters the blocks from rank r.
    for kinds in run_ranks(4, _rank_shard_src_counted):
        assert "scatter" in kinds, kinds


def _rank_reshard(src_spec, dst_spec, X, W):
    mesh = fs.Mesh(dp=2, tp=2)
    s = fs.shard(X, mesh, src_spec)
    s.local.requires_grad_(True)
    with fs.count_collectives() as c:
        r = s.reshard(dst_spec)
    kinds = sorted(c.by_kind().items())
    full = r.full()
    (full * W).sum().backward()
    return mesh.coordinate, r.local.detach(), r.spec, tuple(r.shape), full.detach(), s.grad.local, kinds


DP, TP, DPTP, TPDP, NONE = ("dp",), ("tp",), ("dp", "tp"), ("tp", "dp"), ()
RESHARD_CASES = [
    # (from, axes per dim, to, axes per dim, expected collectives)
    ("(dp b) n", [DP, NONE], "b (dp n)", [NONE, DP], {("all_to_all", DP): 1}),
    ("(dp b) (tp n)", [DP, TP], "b (tp dp n)", [NONE, TPDP], {("all_to_all", DP): 1}),
    ("(dp tp b) n", [DPTP, NONE], "(dp b) (tp n)", [DP, TP], {("all_to_all", TP): 1}),
    # two splits swapping dims: gather both, then slice locally
    ("(dp b) (tp n)", [DP, TP], "(tp b) (dp n)", [TP, DP], {("all_gather", DP): 1, ("all_gather", TP): 1}),
    ("(dp b) n", [DP, NONE], "b n", [NONE, NONE], {("all_gather", DP): 1}),
    ("(dp tp b) n", [DPTP, NONE], "b n", [NONE, NONE], {("all_gather", DPTP): 1}),
    ("(tp dp b) n", [TPDP, NONE], "(tp b) n", [TP, NONE], {("all_gather", DP): 1}),
    ("b n", [NONE, NONE], "(dp b) (tp n)", [DP, TP], {}),
    ("(dp b) n", [DP, NONE], "(dp tp b) n", [DPTP, NONE], {}),
    ("(dp b) n", [DP, NONE], "(dp x) n", [DP, NONE], {}),  # only the label differs: nothing moves
]


@pytest.mark.parametrize(
    ("src", "src_axes", "dst", "dims_axes", "kinds"),
    RESHARD_CASES,
    ids=[f"{c[0]}->{c[2]}" for c in RESHARD_CASES],
)
def test_reshard(src, src_axes, dst, dims_axes, kinds):
    X = _global((8, 8))
    W = _global((8, 8), seed=1)
    for coord, local, text, shape, full, grad_local, got_kinds in run_ranks(4, _rank_reshard, src, dst, X, W):
        torch.testing.assert_close(local, _expected_block(X, dims_axes, coord, MESH_2x2))
        torch.testing.assert_close(full, X)
        torch.testing.assert_close(grad_local, _expected_block(W, src_axes, coord, MESH_2x2))
        assert text == dst and shape == (8, 8)
        assert dict(got_kinds) == kinds


# ---------------------------------------------------------------------------------------------
# Sharded inputs to shard_map: same layout (used as is) and a different layout (re-laid-out)


def _rank_sharded_input(stored, in_spec, X, W):
    mesh = fs.Mesh(dp=2, tp=2)
    s = fs.shard(X, mesh, stored)
    s.local.requires_grad_(True)
    seen = {}

    def f(x):
        seen["x"] = x
        return fs.psum(x.sum(0, keepdim=True), "dp")

    fn = fs.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs="one (tp n)")
    with fs.count_collectives() as c:
        out = fn(s)
    kinds = sorted(c.by_kind().items())
    full = out.full() if isinstance(out, fs.Sharded) else out
    (full * W).sum().backward()
    return mesh.coordinate, _plain(seen["x"]), _plain(full), s.grad.local, kinds


@pytest.mark.parametrize(
    ("stored", "in_spec", "relayout_kinds"),
    [
        ("(dp b) (tp n)", "(dp b) (tp n)", {}),
        ("b (tp dp n)", "(dp b) (tp n)", {("all_to_all", ("dp",)): 1}),
        ("b (dp tp n)", "(dp b) (tp n)", None),  # needs data across tp groups: any collectives
        ("b n", "(dp b) (tp n)", {}),
    ],
    ids=["same_layout", "relayout_all_to_all", "relayout_general", "relayout_slice"],
)
def test_sharded_input(stored, in_spec, relayout_kinds):
    X = _global((4, 8))
    W = _global((1, 8), seed=1)
    in_axes = [("dp",), ("tp",)]
    stored_axes = {
        "(dp b) (tp n)": [DP, TP],
        "b (tp dp n)": [NONE, TPDP],
        "b (dp tp n)": [NONE, DPTP],
        "b n": [NONE, NONE],
    }[stored]
    for coord, x, full, grad_local, kinds in run_ranks(4, _rank_sharded_input, stored, in_spec, X, W):
        torch.testing.assert_close(x, _expected_block(X, in_axes, coord, MESH_2x2))
        torch.testing.assert_close(full, X.sum(0, keepdim=True))
        # d/dX of sum(W * X.sum(0)) is W broadcast over rows; each rank holds its stored block of it
        torch.testing.assert_close(grad_local, _expected_block(W.expand(4, 8), stored_axes, coord, MESH_2x2))
        if relayout_kinds is not None:
            expect = dict(relayout_kinds)
            expect[("all_reduce", ("dp",))] = 1  # the psum inside f
            assert dict(kinds) == expect


# ---------------------------------------------------------------------------------------------
# outputs: split -> Sharded, replicated -> plain tensor, partial sums -> reduced


def _rank_outputs(case, X):
    mesh = fs.Mesh(dp=2, tp=2)
    Xr = X.clone().requires_grad_(True)
    # x: block of X, rows split over dp, cols over tp; f returns per-rank values, some of them partial sums
    specs = {
        # name: (f, out_spec)
        "split": (lambda x: x * 3, "(dp b) (tp n)"),
        "replicated": (lambda x: fs.psum(fs.psum(x.sum(), "tp"), "dp"), ""),
        "partial_allreduce": (lambda x: x.sum(1, keepdim=True), "(dp b) one | sum(tp)"),
        "partial_allreduce_plain": (lambda x: x.sum(), "| sum(dp tp)"),
        "partial_reduce_scatter": (lambda x: x.t().contiguous(), "(tp k) (dp b) | sum(tp)"),
        "partial_two_axes_scatter": (lambda x: x.t().contiguous(), "(dp tp k) b | sum(dp tp)"),
        "partial_reduce_scatter_minor": (lambda x: x.t().contiguous(), "(dp tp k) b | sum(tp)"),
    }
    f, out_spec = specs[case]
    fn = fs.shard_map(f, mesh=mesh, in_specs="(dp b) (tp n)", out_specs=out_spec)
    with fs.count_collectives() as c:
        out = fn(Xr)
    kinds = sorted(c.by_kind().items())
    if isinstance(out, fs.Sharded):
        kind, shape, full = "Sharded", tuple(out.shape), out.full()
    else:
        kind, shape, full = "Tensor", tuple(out.shape), out
    full.sum().backward()
    return kind, shape, full.detach(), Xr.grad, kinds


def _ref_outputs(case, X):
    """Global result of each case: the out_spec says how the per-rank outputs combine."""
    blocks = X.reshape(2, 4, 2, 4).permute(0, 2, 1, 3)  # [dp, tp, 4, 4]
    if case == "split":
        return 3 * X
    if case == "replicated":
        return X.sum()
    if case == "partial_allreduce":  # sum over tp of row sums of the blocks, rows split over dp
        return torch.cat([sum(blocks[d, t].sum(1, keepdim=True) for t in range(2)) for d in range(2)])
    if case == "partial_allreduce_plain":
        return X.sum()
    if case == "partial_reduce_scatter":  # dim 1 over dp; the tp-sum of x.t() scattered over tp in dim 0
        return torch.cat([sum(blocks[d, t].t() for t in range(2)) for d in range(2)], dim=1)
    if case == "partial_two_axes_scatter":  # sum over all ranks, dim 0 scattered over (dp tp)
        return sum(blocks[d, t].t() for d in range(2) for t in range(2))
    if case == "partial_reduce_scatter_minor":  # per dp: sum over tp, then dim 0 split (dp tp)
        return torch.cat([sum(blocks[d, t].t() for t in range(2)) for d in range(2)], dim=0)
    raise AssertionError(case)


OUTPUT_CASES = {
    # case: (kind, collectives of the shard_map call)
    "split": ("Sharded", {}),
    "replicated": ("Tensor", {("all_reduce", ("tp",)): 1, ("all_reduce", ("dp",)): 1}),
    "partial_allreduce": ("Sharded", {("all_reduce", ("tp",)): 1}),
    "partial_allreduce_plain": ("Tensor", {("all_reduce", ("dp", "tp")): 1}),
    "partial_reduce_scatter": ("Sharded", {("reduce_scatter", ("tp",)): 1}),
    "partial_two_axes_scatter": ("Sharded", {("reduce_scatter", ("dp", "tp")): 1}),
    "partial_reduce_scatter_minor": ("Sharded", {("reduce_scatter", ("tp",)): 1}),
}


@pytest.mark.parametrize("case", list(OUTPUT_CASES))
def test_outputs(case):
    X = _global((8, 8))
    Xr = X.clone().requires_grad_(True)
    ref = _ref_outputs(case, Xr)
    ref.sum().backward()
    kind_expect, kinds_expect = OUTPUT_CASES[case]
    for kind, shape, full, grad, kinds in run_ranks(4, _rank_outputs, case, X):
        assert kind == kind_expect
        assert shape == tuple(ref.shape)
        torch.testing.assert_close(full, ref.detach())
        torch.testing.assert_close(grad, Xr.grad)
        assert dict(kinds) == kinds_expect


# ---------------------------------------------------------------------------------------------
# a value invariant over an axis, returned under an out_spec that splits a dim over that axis:
# the global result holds one copy per rank, so the gradient sums the copies' cotangents


def _rank_invariant_under_split_spec(which, X, W):
    mesh = fs.Mesh(dp=2)
    X = X.clone().requires_grad_(True)
    if which == "replicated_input":
        fn = fs.shard_map(lambda x: x, mesh=mesh, in_specs="c n", out_specs="(dp c) n")
    else:  # psum result
        fn = fs.shard_map(lambda x: fs.psum(x, "dp"), mesh=mesh, in_specs="(dp c) n", out_specs="(dp c) n")
    full = fn(X).full()
    (full * W).sum().backward()
    return full.detach(), X.grad


@pytest.mark.parametrize("which", ["replicated_input", "psum_result"])
def test_invariant_value_under_split_out_spec_gradient(which):
    X = _global((2, 3))
    W = _global((4, 3) if which == "replicated_input" else (2, 3), seed=1)
    Xr = X.clone().requires_grad_(True)
    if which == "replicated_input":
        ref = torch.cat([Xr, Xr])  # each dp rank returns the whole X: global = X stacked twice
    else:
        s = Xr.sum(0, keepdim=True)
        ref = torch.cat([s, s])  # each dp rank returns the psum of its row
    (ref * W).sum().backward()
    results = run_ranks(2, _rank_invariant_under_split_spec, which, X, W)
    for rank, (full, grad) in enumerate(results):
        torch.testing.assert_close(full, ref.detach())
        torch.testing.assert_close(grad, Xr.grad, msg=lambda m, rank=rank: f"rank {rank} gradient: {m}")


# ---------------------------------------------------------------------------------------------
# outputs are ordinary tensors: they pickle (torch.save, returning them from a rank, queues)


def _rank_pickle_output():
    mesh = fs.Mesh(dp=2)
    X = torch.arange(4.0)
    out = fs.shard_map(lambda x: fs.psum(x, "dp"), mesh=mesh, in_specs="(dp n)", out_specs="n")(X)
    s = fs.shard_map(
        lambda x: fs.all_gather(x, "dp", tiled=True), mesh=mesh, in_specs="(dp n)", out_specs="(dp m)"
    )(X)
    problems = []
    for name, t in [("plain output", out), ("Sharded output .local", s.local)]:
        try:
            pickle.dumps(t)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{name}: {type(e).__name__}: {e}; attributes: {sorted(vars(t))}")
    return problems


def test_outputs_are_picklable():
    for problems in run_ranks(2, _rank_pickle_output):
        assert problems == []


# ---------------------------------------------------------------------------------------------
# pytrees


Pair = collections.namedtuple("Pair", ["a", "b"])


@optree.dataclasses.dataclass(namespace="")
class Params:
    w: torch.Tensor
    b: torch.Tensor
    name: str = field(default="layer", metadata={"pytree_node": False})


def _rank_pytrees(X, Y, Z):
    mesh = fs.Mesh(dp=2, tp=2)
    got = {}

    def f(d, lst, pair, params, k, none):
        got["types"] = (type(d).__name__, type(lst).__name__, type(pair).__name__, type(params).__name__)
        got["shapes"] = {
            "d.x": tuple(d["x"].shape),
            "d.opt": d["opt"],
            "d.sub.y": tuple(d["sub"]["y"].shape),
            "lst0": tuple(lst[0].shape),
            "lst1": lst[1],
            "pair.a": tuple(pair.a.shape),
            "pair.b": tuple(pair.b.shape),
            "params.w": tuple(params.w.shape),
            "params.b": tuple(params.b.shape),
            "params.name": params.name,
            "k": k,
            "none": none,
        }
        y = fs.psum(params.w.sum() + params.b.sum(), "tp")
        return {
            "x": d["x"] * 2,
            "pair": Pair(pair.a + 1, None),
            "list": [lst[0], "tag", 7],
            "params": Params(params.w * 1.0, params.b * 1.0, name="out"),
            "y": fs.psum(y, "dp"),
        }

    fn = fs.shard_map(
        f,
        mesh=mesh,
        in_specs=(
            {"x": "(dp b) n", "opt": None, "sub": "(tp r) c"},  # None subtree; prefix spec for "sub"
            ["(dp b) (tp n)", "ignored for non-tensors"],
            Pair("(dp b) n", "r2 (tp c2)"),
            "(tp r) c",  # one spec for the whole dataclass
            "",  # a non-tensor argument
            "",  # None
        ),
        out_specs={
            "x": "(dp b) n",
            "pair": Pair("(dp b) n", None),
            "list": "(dp b) (tp n)",  # prefix over a list with non-tensors
            "params": Params("(tp r) c", "(tp r) c", name="out"),
            "y": "",
        },
    )
    out = fn({"x": X, "opt": None, "sub": {"y": Z}}, [X, 3.5], Pair(X, Y), Params(Z, Z, name="p"), 11, None)
    res = {
        "x": out["x"].full(),
        "pair_a": out["pair"].a.full(),
        "pair_b": out["pair"].b,
        "list0": out["list"][0].full(),
        "list_rest": out["list"][1:],
        "params_w": out["params"].w.full(),
        "params_name": out["params"].name,
        "params_type": type(out["params"]).__name__,
        "pair_type": type(out["pair"]).__name__,
        "y": out["y"].detach(),
    }
    return got, res


def test_pytrees():
    X = _global((4, 6))
    Y = _global((3, 4), seed=1)
    Z = _global((4, 5), seed=2)
    for got, res in run_ranks(4, _rank_pytrees, X, Y, Z):
        assert got["types"] == ("dict", "list", "Pair", "Params")
        assert got["shapes"] == {
            "d.x": (2, 6),
            "d.opt": None,
            "d.sub.y": (2, 5),
            "lst0": (2, 3),
            "lst1": 3.5,
            "pair.a": (2, 6),
            "pair.b": (3, 2),
            "params.w": (2, 5),
            "params.b": (2, 5),
            "params.name": "p",
            "k": 11,
            "none": None,
        }
        torch.testing.assert_close(res["x"], 2 * X)
        torch.testing.assert_close(res["pair_a"], X + 1)
        assert res["pair_b"] is None and res["pair_type"] == "Pair"
        torch.testing.assert_close(res["list0"], X)
        assert res["list_rest"] == ["tag", 7]
        torch.testing.assert_close(res["params_w"], Z)
        assert res["params_name"] == "out" and res["params_type"] == "Params"
        # w and b are both Z split over tp: psum over tp gives 2 * Z.sum(), invariant over dp; psum over dp
        # of that invariant value multiplies it by 2
        torch.testing.assert_close(res["y"], 4 * Z.sum())


def _rank_prefix_dict_grad(X, Y):
    mesh = fs.Mesh(dp=2, tp=2)
    params = {"w1": X.clone().requires_grad_(True), "w2": Y.clone().requires_grad_(True)}

    def loss(p):
        return fs.pmean((p["w1"] ** 2).sum() + p["w2"].sum() * fs.axis_index("dp"), "dp")

    out = fs.shard_map(loss, mesh=mesh, in_specs=("(dp a) b",), out_specs="")(params)
    out.backward()
    return out.detach(), params["w1"].grad, params["w2"].grad


def test_prefix_spec_for_a_dict_and_gradients():
    X = _global((4, 3))
    Y = _global((4, 3), seed=1)
    Xr, Yr = X.clone().requires_grad_(True), Y.clone().requires_grad_(True)
    # per dp rank d: sum(X_d ** 2) + sum(Y_d) * d, then the mean over the two dp ranks
    X_b, Y_b = Xr.reshape(2, 2, 3), Yr.reshape(2, 2, 3)
    ref = sum((X_b[d] ** 2).sum() + Y_b[d].sum() * d for d in range(2)) / 2
    ref.backward()
    for out, gx, gy in run_ranks(4, _rank_prefix_dict_grad, X, Y):
        torch.testing.assert_close(out, ref.detach())
        torch.testing.assert_close(gx, Xr.grad)
        torch.testing.assert_close(gy, Yr.grad)


# ---------------------------------------------------------------------------------------------
# the replication check


def _varies_over_tp(x):
    return x * fs.axis_index("tp")


def _varies_over_both(x):
    return x + fs.axis_index(("dp", "tp"))


def _rank_replication_check(fn_name, out_spec, check):
    mesh = fs.Mesh(dp=2, tp=2)
    f = {"tp": _varies_over_tp, "both": _varies_over_both}[fn_name]
    fn = fs.shard_map(f, mesh=mesh, in_specs="(dp b) n", out_specs=out_spec, check=check)
    with fs.count_collectives() as c:
        try:
            out = fn(torch.ones(4, 3))
        except fs.SpecError as e:
            return "SpecError", str(e), c.total
    return "ok", (out.full() if isinstance(out, fs.Sharded) else out), mesh.coordinate


def test_replication_check_raises_before_communication():
    results = run_ranks(4, _rank_replication_check, "tp", "(dp b) n", True)
    expected = (
        "fs.shard_map(_varies_over_tp): 1 problem with out_specs (replication check):\n"
        "  - out varies over mesh axis tp but out_spec '(dp b) n' says it is replicated over tp; reduce it "
        "inside f (fs.psum / fs.pmean over 'tp'), mark it as a partial sum with '| sum(tp)', split a dim "
        "over tp in the out_spec, or pass check=False if you know it is the same on every rank"
    )
    for kind, text, total in results:
        assert kind == "SpecError"
        assert text == expected
        assert total == 0


def test_replication_check_two_axes():
    results = run_ranks(4, _rank_replication_check, "both", "b n", True)
    expected = (
        "fs.shard_map(_varies_over_both): 1 problem with out_specs (replication check):\n"
        "  - out varies over mesh axes dp, tp but out_spec 'b n' says it is replicated over dp, tp; "
        "reduce it inside f (fs.psum / fs.pmean over ('dp', 'tp')), mark it as a partial sum with "
        "'| sum(dp tp)', split a dim over dp, tp in the out_spec, or pass check=False if you know it is the "
        "same on every rank"
    )
    assert [r[:2] for r in results] == [("SpecError", expected)] * 4
    assert [r[2] for r in results] == [0] * 4


def test_replication_check_disabled():
    # with check=False the per-rank values are taken as they are: rank (dp, tp) holds ones * tp, and
    # .full() gathers the dp blocks of its own tp index
    for kind, out, coord in run_ranks(4, _rank_replication_check, "tp", "(dp b) n", False):
        assert kind == "ok"
        torch.testing.assert_close(out, torch.full((4, 3), float(coord["tp"])))


# ---------------------------------------------------------------------------------------------
# the plan cache


def _rank_plan_cache():
    mesh = fs.Mesh(dp=2, tp=2)
    fn = fs.shard_map(
        lambda x, k: fs.psum(x, "dp") * k, mesh=mesh, in_specs=("(dp b) n", ""), out_specs="b n"
    )
    sizes = []
    for shape, k in [((4, 3), 1), ((4, 3), 2), ((4, 3), 5), ((6, 3), 1), ((4, 3), 1)]:
        fn(torch.ones(shape), k)
        sizes.append((len(fn._in_plans), len(fn._out_plans)))
    fn(fs.shard(torch.ones(4, 3), mesh, "(dp b) n"), 1)
    sizes.append((len(fn._in_plans), len(fn._out_plans)))
    fn(torch.ones(4, 3, dtype=torch.float64), 1)
    sizes.append((len(fn._in_plans), len(fn._out_plans)))
    return sizes


def test_plan_cache():
    for sizes in run_ranks(4, _rank_plan_cache):
        # same shapes (and a non-tensor leaf of the same type) reuse the plans; a new shape, a Sharded
        # input and a new dtype each add one input plan
        assert sizes == [(1, 1), (1, 1), (1, 1), (2, 2), (2, 2), (3, 2), (4, 3)]


# ---------------------------------------------------------------------------------------------
# DTensor interop


def _rank_dtensor(spec, X):
    from torch.distributed.tensor import DTensor

    mesh = fs.Mesh(dp=2, tp=2)
    s = fs.shard(X, mesh, spec)
    dt = s.to_dtensor()
    assert isinstance(dt, DTensor)
    back = fs.from_dtensor(dt)
    return (
        [str(p) for p in dt.placements],
        tuple(dt.shape),
        dt.full_tensor(),
        torch.equal(dt.to_local(), s.local),
        back.spec,
        tuple(back.shape),
        torch.equal(back.local, s.local),
        back.mesh == mesh,
    )


@pytest.mark.parametrize(
    ("spec", "placements", "back_spec"),
    [
        ("(dp b) (tp n)", ["S(0)", "S(1)"], "(dp d0) (tp d1)"),
        ("(dp tp b) n", ["S(0)", "S(0)"], "(dp tp d0) d1"),
        ("b (tp n)", ["R", "S(1)"], "d0 (tp d1)"),
        ("b n", ["R", "R"], "d0 d1"),
    ],
)
def test_dtensor_round_trip(spec, placements, back_spec):
    X = _global((8, 4))
    for got in run_ranks(4, _rank_dtensor, spec, X):
        pl, shape, full, same_local, bspec, bshape, back_same, same_mesh = got
        assert pl == placements
        assert shape == (8, 4)
        torch.testing.assert_close(full, X)
        assert same_local and back_same and same_mesh
        assert bspec == back_spec and bshape == (8, 4)


def _rank_dtensor_bad_order():
    mesh = fs.Mesh(dp=2, tp=2)
    s = fs.shard(torch.ones(8, 2), mesh, "(tp dp b) n")
    try:
        s.to_dtensor()
    except fs.SpecError as e:
        return str(e)
    return "no error"


def test_to_dtensor_order_not_expressible():
    for text in run_ranks(4, _rank_dtensor_bad_order):
        assert text == (
            "Sharded.to_dtensor: dim 0 is split over ('tp', 'dp'), not in mesh order ('dp', 'tp'); "
            "reshard to (dp tp ...) first"
        )


# ---------------------------------------------------------------------------------------------
# a 1-rank world: everything is local


def _rank_one_rank_world():
    mesh = fs.Mesh(dp=1, tp=1)
    X = torch.arange(12.0).reshape(4, 3).requires_grad_(True)

    def f(x, w):
        return (
            fs.psum(x @ w, "tp"),
            fs.all_gather(x, "dp", tiled=True),
            fs.axis_index(("dp", "tp")),
            fs.axis_size("dp"),
        )

    fn = fs.shard_map(
        f, mesh=mesh, in_specs=("(dp b) (tp k)", "(tp k) n"), out_specs=("(dp b) n", "(dp c) k", "", "")
    )
    w = torch.ones(3, 2)
    with fs.count_collectives() as c:
        y, g, i, n = fn(X, w)
        y.full().sum().backward()
        s = fs.shard(X.detach(), mesh, "(dp tp b) k").reshard("b (tp dp k)")
    return (
        type(y).__name__,
        y.local.detach(),
        tuple(y.shape),
        g.full().detach(),
        int(i),
        n,
        c.total,
        X.grad,
        s.local,
    )


def _check_one_rank(res):
    kind, y_local, y_shape, g, i, n, total, grad, s_local = res
    X = torch.arange(12.0).reshape(4, 3)
    assert kind == "Sharded"
    torch.testing.assert_close(y_local, X @ torch.ones(3, 2))
    assert y_shape == (4, 2)
    torch.testing.assert_close(g, X)
    assert (i, n, total) == (0, 1, 0)
    torch.testing.assert_close(grad, torch.full((4, 3), 2.0))
    torch.testing.assert_close(s_local, X)


def test_one_rank_world_pool():
    (res,) = run_ranks(1, _rank_one_rank_world)
    _check_one_rank(res)


def test_one_rank_world_without_distributed():
    import torch.distributed as dist

    assert not dist.is_initialized()
    _check_one_rank(_rank_one_rank_world())


# --- a spec given for a whole subtree is a template: its labels are not tied across the leaves ---


def _subtree_spec_template():
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(8, 16, generator=g), "w2": torch.randn(16, 4, generator=g)}

    out = fs.shard_map(
        lambda p: fs.psum(p["w1"].sum() + p["w2"].sum(), "dp"),
        mesh=mesh,
        in_specs=("(dp n) ...",),
        out_specs="",
    )(params)
    want = params["w1"].sum() + params["w2"].sum()
    return float((out - want).abs())


def test_one_spec_for_a_dict_of_differently_sized_parameters(ranks):
    errs = ranks(2, _subtree_spec_template)
    assert all(e < 1e-4 for e in errs), errs
