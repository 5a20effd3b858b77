"""Multi-rank tests of the named-axis collectives (fshard._collectives) inside ``fs.shard_map``.

Every case builds a global input ``X`` of shape ``(*mesh sizes, *block)`` in the test process, splits
its leading dims over every mesh axis (so each rank holds one distinct block), runs one collective on
the block inside ``fs.shard_map``, gathers the global output with ``.full()`` and differentiates
``(full * W).sum()`` w.r.t. ``X``. The test process computes the same global output and gradient with
plain torch (autograd over indexing, ``sum``, ``cat``, ``stack``, ``amax``, ...) and compares.

Outputs that are invariant over the collective's axes are returned with the coordinate dims of those
axes unsplit (size 1), so they are checked as replicated values; varying outputs keep one coordinate
per rank.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks

# (world size, mesh shape as ((axis, size), ...)) with ids
MESHES = {
    "w1-dp1": (1, (("dp", 1),)),
    "w2-dp2": (2, (("dp", 2),)),
    "w4-dp4": (4, (("dp", 4),)),
    "w4-dp2tp2": (4, (("dp", 2), ("tp", 2))),
    "w8-dp2tp2pp2": (8, (("dp", 2), ("tp", 2), ("pp", 2))),
}

# ops whose result is invariant over the collective's axes
_INVARIANT_RESULT = {"psum", "pmean", "pmax", "pmin", "pbroadcast"}


def _invariant_result(op, kw):
    return op in _INVARIANT_RESULT or (op == "all_gather" and kw.get("invariant", False))


def _axes(axis):
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _group_size(mesh_shape, axis):
    sizes = dict(mesh_shape)
    return math.prod(sizes[a] for a in _axes(axis))


# ---------------------------------------------------------------------------------------------
# rank side


def _apply(op, b, axis, kw):
    if op == "psum":
        return fs.psum(b, axis)
    if op == "pmean":
        return fs.pmean(b, axis)
    if op == "pmax":
        return fs.pmax(b, axis)
    if op == "pmin":
        return fs.pmin(b, axis)
    if op == "all_gather":
        return fs.all_gather(b, axis, **kw)
    if op == "psum_scatter":
        return fs.psum_scatter(b, axis, **kw)
    if op == "all_to_all":
        return fs.all_to_all(b, axis, **kw)
    if op == "ppermute":
        return fs.ppermute(b, axis, kw["perm"])
    if op == "pbroadcast":
        return fs.pbroadcast(b, axis, **kw)
    if op == "pvary":
        return fs.pvary(b, axis)
    if op == "axis_index":
        i = fs.axis_index(axis)
        assert i.dtype == torch.int64 and i.dim() == 0
        return b * (i + 1) + i * 0.5
    if op == "axis_size":
        n = fs.axis_size(axis)
        assert type(n) is int
        return b * n
    raise AssertionError(op)


def _specs(names, axis, inv_in, inv_out):
    g = _axes(axis)
    in_spec = " ".join(f"c{i}" if (inv_in and a in g) else f"({a} c{i})" for i, a in enumerate(names))
    out_spec = " ".join(f"c{i}" if (inv_out and a in g) else f"({a} c{i})" for i, a in enumerate(names))
    return in_spec + " ...", out_spec + " ..."


def _rank_collective(mesh_shape, op, axis, kw, inv_in, X, W):
    mesh = fs.Mesh(dict(mesh_shape))
    names = mesh.axis_names
    k = len(names)
    in_spec, out_spec = _specs(names, axis, inv_in, _invariant_result(op, kw))

    kw = dict(kw)
    noncontig = kw.pop("_noncontiguous", False)

    def f(x):
        b = x.reshape(x.shape[k:])
        if noncontig:  # same values, transposed strides
            b = b.transpose(-1, -2).contiguous().transpose(-1, -2)
            assert not b.is_contiguous()
        y = _apply(op, b, axis, kw)
        return y.reshape((1,) * k + tuple(y.shape))

    X = X.clone().requires_grad_(True)
    fn = fs.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec)
    out = fn(X)
    full = out.full() if isinstance(out, fs.Sharded) else out
    (full * W).sum().backward()
    return full.detach(), X.grad, type(out).__name__


# ---------------------------------------------------------------------------------------------
# reference side (plain torch on the global tensors, one process)


def _reference(mesh_shape, op, axis, kw, inv_in, X):
    """The global output of the collective case, computed from global ``X`` with plain torch."""
    names = [a for a, _ in mesh_shape]
    sizes = [s for _, s in mesh_shape]
    gdims = [names.index(a) for a in _axes(axis)]
    gsizes = [sizes[d] for d in gdims]
    n = math.prod(gsizes)
    inv_out = _invariant_result(op, kw)
    out_sizes = [1 if (inv_out and d in gdims) else s for d, s in enumerate(sizes)]

    def block(coord):
        c = list(coord)
        if inv_in:
            for d in gdims:
                c[d] = 0
        return X[tuple(c)]

    outs = []
    for c in itertools.product(*map(range, out_sizes)):
        members = []
        for j in range(n):  # group index j -> coordinate (first listed axis major)
            cc, rem = list(c), j
            for d, s in reversed(list(zip(gdims, gsizes, strict=True))):
                cc[d] = rem % s
                rem //= s
            members.append(block(cc))
        idx = 0
        for d in gdims:
            idx = idx * sizes[d] + c[d]
        mine = members[idx]
        if op == "psum":
            y = sum(members[1:], members[0])
        elif op == "pmean":
            y = sum(members[1:], members[0]) / n
        elif op == "pmax":
            y = torch.stack(members).amax(0)
        elif op == "pmin":
            y = torch.stack(members).amin(0)
        elif op == "all_gather":
            dim = kw.get("dim", 0)
            y = torch.cat(members, dim) if kw.get("tiled", False) else torch.stack(members, dim)
        elif op == "psum_scatter":
            s, dim = sum(members[1:], members[0]), kw.get("dim", 0)
            y = s.chunk(n, dim)[idx] if kw.get("tiled", False) else s.select(dim, idx)
        elif op == "all_to_all":
            y = torch.cat([m.chunk(n, kw["split_dim"])[idx] for m in members], kw["concat_dim"])
        elif op == "ppermute":
            src = {d: s for s, d in kw["perm"]}.get(idx)
            y = members[src] if src is not None else torch.zeros_like(mine)
        elif op == "pbroadcast":
            y = members[kw.get("src", 0)]
        elif op == "pvary":
            y = mine
        elif op == "axis_index":
            y = mine * (idx + 1) + idx * 0.5
        elif op == "axis_size":
            y = mine * n
        else:
            raise AssertionError(op)
        outs.append(y)
    return torch.stack(outs).reshape(*out_sizes, *outs[0].shape)


def _input(mesh_shape, op, axis, inv_in, block, seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [1 if (inv_in and a in _axes(axis)) else s for a, s in mesh_shape]
    shape = (*sizes, *block)
    if op in ("pmax", "pmin"):  # few distinct values: plenty of ties across ranks
        return torch.randint(0, 3, shape, generator=g).to(torch.float64)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _check_case(mesh_id, op, axis, kw, block, inv_in=False, seed=0):
    world, mesh_shape = MESHES[mesh_id]
    X = _input(mesh_shape, op, axis, inv_in, block, seed)
    Xr = X.clone().requires_grad_(True)
    ref = _reference(mesh_shape, op, axis, kw, inv_in, Xr)
    W = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    ((ref * W).sum() + (Xr * 0).sum()).backward()  # "+ 0 * X": X gets a (zero) grad even if unused
    results = run_ranks(world, _rank_collective, mesh_shape, op, axis, kw, inv_in, X, W)
    for rank, (full, grad, _kind) in enumerate(results):
        assert full.shape == ref.shape, f"rank {rank}: output shape {tuple(full.shape)} != {tuple(ref.shape)}"
        torch.testing.assert_close(full, ref.detach(), msg=lambda m, rank=rank: f"rank {rank} forward: {m}")
        assert grad is not None, f"rank {rank}: no gradient reached the input"
        torch.testing.assert_close(grad, Xr.grad, msg=lambda m, rank=rank: f"rank {rank} gradient: {m}")
    # a split out_spec gives a Sharded value, an unsplit one a plain tensor
    split = not _invariant_result(op, kw) or len(mesh_shape) > len(_axes(axis))
    assert results[0][2] == ("Sharded" if split else "Tensor")


# ---------------------------------------------------------------------------------------------
# the cases


def _variants(n):
    """(op, kwargs, block shape, invariant input) for a collective group of size ``n``."""
    ring = [(i, (i + 1) % n) for i in range(n)]
    partial = [(i, i + 1) for i in range(n - 1)]  # index 0 receives nothing -> zeros
    return [
        ("psum", {}, (3, 4), False),
        ("psum", {}, (3, 4), True),  # invariant input: multiplied by the axis size
        ("pmean", {}, (3, 4), False),
        ("pmean", {}, (3, 4), True),
        ("pmax", {}, (3, 4), False),
        ("pmin", {}, (3, 4), False),
        ("all_gather", {"dim": 0}, (2, 3, 4), False),
        ("all_gather", {"dim": 1}, (2, 3, 4), False),
        ("all_gather", {"dim": -1}, (2, 3, 4), False),
        ("all_gather", {"dim": -2, "tiled": False}, (2, 3, 4), False),
        ("all_gather", {"dim": 0, "tiled": True}, (2, 3, 4), False),
        ("all_gather", {"dim": -2, "tiled": True}, (2, 3, 4), False),
        ("all_gather", {"dim": 1, "invariant": True}, (2, 3, 4), False),
        ("all_gather", {"dim": -1, "tiled": True, "invariant": True}, (2, 3, 4), False),
        ("all_gather", {"dim": 0, "tiled": True}, (2, 3, 4), True),  # invariant input: implicit pvary
        ("psum_scatter", {"dim": 0, "tiled": True}, (2 * n, 3, 4), False),
        ("psum_scatter", {"dim": -1, "tiled": True}, (2, 3, 2 * n), False),
        ("psum_scatter", {"dim": 1}, (2, n, 4), False),
        ("psum_scatter", {"dim": -3, "tiled": False}, (n, 3, 4), False),
        ("all_to_all", {"split_dim": 0, "concat_dim": 2}, (2 * n, 3, 4), False),
        ("all_to_all", {"split_dim": 2, "concat_dim": 0}, (2, 3, 2 * n), False),
        ("all_to_all", {"split_dim": -1, "concat_dim": 1}, (2, 3, n), False),
        ("all_to_all", {"split_dim": 0, "concat_dim": -3}, (2 * n, 3, 4), False),  # split == concat
        ("ppermute", {"perm": ring}, (2, 3), False),
        ("ppermute", {"perm": partial}, (2, 3), False),
        ("ppermute", {"perm": [(s, d) for d, s in ring]}, (2, 3), False),  # the reverse ring
        ("ppermute", {"perm": [(n - 1, 0)]}, (2, 3), False),  # a single pair (point to point)
        ("pbroadcast", {"src": 0}, (2, 3), False),
        ("pbroadcast", {"src": n - 1}, (2, 3), False),
        ("pvary", {}, (2, 3), True),
        ("axis_index", {}, (2, 3), False),
        ("axis_index", {}, (2, 3), True),  # invariant input meets a varying index: implicit pvary
        ("axis_size", {}, (2, 3), False),
    ]


def _kw_id(kw):
    parts = []
    for k, v in kw.items():
        if k == "perm":
            continue
        parts.append(k.strip("_") if v is True and k.startswith("_") else f"{k}={v}")
    return ",".join(parts)


def _cases():
    axes_by_mesh = {
        "w1-dp1": ["dp", ("dp",)],
        "w2-dp2": ["dp", ("dp",)],
        "w4-dp4": ["dp"],
        "w4-dp2tp2": ["tp", "dp", ("dp", "tp"), ("tp", "dp")],
    }
    out = []
    for mesh_id, axes in axes_by_mesh.items():
        for axis in axes:
            n = _group_size(MESHES[mesh_id][1], axis)
            for vi, (op, kw, block, inv_in) in enumerate(_variants(n)):
                if mesh_id == "w4-dp4" and op in ("pmean", "axis_size", "pvary"):
                    continue
                axis_id = axis if isinstance(axis, str) else "(" + ",".join(axis) + ")"
                cid = f"{mesh_id}-{axis_id}-{vi:02d}-{op}"
                if _kw_id(kw):
                    cid += f"[{_kw_id(kw)}]"
                if inv_in:
                    cid += "-invariant_in"
                out.append(pytest.param(mesh_id, op, axis, kw, block, inv_in, id=cid))
    # non-contiguous blocks (transposed strides) on the 2x2 mesh
    nc = {"_noncontiguous": True}
    for axis in ["tp", ("tp", "dp")]:
        n = _group_size(MESHES["w4-dp2tp2"][1], axis)
        axis_id = axis if isinstance(axis, str) else "(" + ",".join(axis) + ")"
        for op, kw, block in [
            ("psum", {}, (3, 4)),
            ("pmax", {}, (3, 4)),
            ("all_gather", {"dim": 0, "tiled": True}, (2, 3, 4)),
            ("all_gather", {"dim": 2}, (2, 3, 4)),
            ("psum_scatter", {"dim": -1, "tiled": True}, (2, 3, 2 * n)),
            ("all_to_all", {"split_dim": 2, "concat_dim": 1}, (2, 3, 2 * n)),
            ("ppermute", {"perm": [(i, (i + 1) % n) for i in range(n)]}, (2, 3)),
            ("pbroadcast", {"src": 1}, (2, 3)),
        ]:
            out.append(
                pytest.param(
                    "w4-dp2tp2",
                    op,
                    axis,
                    {**kw, **nc},
                    block,
                    False,
                    id=f"w4-dp2tp2-{axis_id}-noncontiguous-{op}",
                )
            )
    # 8 ranks: few cases (the pool is slow to start), mostly over axis tuples
    w8 = "w8-dp2tp2pp2"
    out += [
        pytest.param(w8, "psum", "tp", {}, (3, 4), False, id=f"{w8}-tp-psum"),
        pytest.param(w8, "psum", ("pp", "dp"), {}, (3, 4), True, id=f"{w8}-(pp,dp)-psum-invariant_in"),
        pytest.param(w8, "pmax", ("dp", "tp", "pp"), {}, (3, 4), False, id=f"{w8}-(dp,tp,pp)-pmax"),
        pytest.param(
            w8,
            "all_gather",
            ("pp", "dp"),
            {"dim": 1, "tiled": True},
            (2, 3),
            False,
            id=f"{w8}-(pp,dp)-all_gather[tiled]",
        ),
        pytest.param(
            w8,
            "psum_scatter",
            ("tp", "pp", "dp"),
            {"dim": 0, "tiled": True},
            (8, 2),
            False,
            id=f"{w8}-(tp,pp,dp)-psum_scatter[tiled]",
        ),
        pytest.param(
            w8,
            "all_to_all",
            ("dp", "pp"),
            {"split_dim": 1, "concat_dim": 0},
            (2, 4),
            False,
            id=f"{w8}-(dp,pp)-all_to_all",
        ),
        pytest.param(
            w8,
            "ppermute",
            ("pp", "tp"),
            {"perm": [(0, 2), (2, 1), (1, 0)]},
            (2, 3),
            False,
            id=f"{w8}-(pp,tp)-ppermute-partial",
        ),
        pytest.param(w8, "axis_index", ("tp", "dp", "pp"), {}, (2,), True, id=f"{w8}-(tp,dp,pp)-axis_index"),
    ]
    return out


@pytest.mark.parametrize(("mesh_id", "op", "axis", "kw", "block", "inv_in"), _cases())
def test_collective_values_and_gradients(mesh_id, op, axis, kw, block, inv_in):
    _check_case(mesh_id, op, axis, kw, block, inv_in)


@pytest.mark.parametrize(
    ("mesh_id", "axis"), [("w2-dp2", "dp"), ("w4-dp2tp2", ("tp", "dp"))], ids=["w2-dp", "w4-(tp,dp)"]
)
def test_all_gather_invariant_of_an_invariant_input(mesh_id, axis):
    # all_gather(..., invariant=True) of a value that is already invariant over the axis: the global
    # result is n copies of x, so x's gradient is the sum of the n cotangent blocks, on every rank
    _check_case(mesh_id, "all_gather", axis, {"dim": 0, "tiled": True, "invariant": True}, (2, 3), True)


# ---------------------------------------------------------------------------------------------
# explicit small cases (readable expected values derived by hand from the global inputs)


def _rank_psum_pmax_float32():
    mesh = fs.Mesh(dp=2, tp=2)
    # rank r (= 2 * dp + tp) holds [r, 5 - r, 1]: ties on every rank in the last column
    X = torch.stack([torch.tensor([float(r), 5.0 - r, 1.0]) for r in range(4)]).reshape(2, 2, 3)

    def f(x):
        b = x.reshape(3)
        return fs.psum(b, "tp").reshape(1, 3), fs.pmax(b, ("dp", "tp")).reshape(1, 3)

    fn = fs.shard_map(f, mesh=mesh, in_specs="(dp i) (tp j) n", out_specs=("(dp i) n", "i n"))
    s, m = fn(X)
    return s.full(), m


def test_psum_and_pmax_float32_by_hand():
    res = run_ranks(4, _rank_psum_pmax_float32)
    # ranks (dp, tp): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1); rank r holds [r, 5-r, 1]
    expect_sum = torch.tensor([[0.0 + 1, 5 + 4, 2], [2.0 + 3, 3 + 2, 2]])
    expect_max = torch.tensor([[3.0, 5.0, 1.0]])
    for s, m in res:
        assert s.dtype == torch.float32 and m.dtype == torch.float32
        torch.testing.assert_close(s, expect_sum)
        torch.testing.assert_close(m, expect_max)


# ---------------------------------------------------------------------------------------------
# collective counts (forward and backward), measured around one collective on a Sharded input


def _rank_counts(case):
    mesh = fs.Mesh(dp=2, tp=2)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(4, 4, generator=g, dtype=torch.float64)
    spec_in = {"inv": "n (dp m)", "var": "(tp n) (dp m)"}
    ops = {
        "psum_varying": ("var", lambda x: fs.psum(x, "tp"), "n (dp m)"),
        "psum_varying_pair": ("var", lambda x: fs.psum(x, ("tp", "dp")), "n m"),
        "psum_invariant": ("inv", lambda x: fs.psum(x, "tp"), "n (dp m)"),
        "pmean_invariant": ("inv", lambda x: fs.pmean(x, "tp"), "n (dp m)"),
        "all_gather": ("var", lambda x: fs.all_gather(x, "tp", dim=0, tiled=True), "(tp r) (dp m)"),
        "all_gather_invariant": (
            "var",
            lambda x: fs.all_gather(x, "tp", dim=0, tiled=True, invariant=True),
            "n (dp m)",
        ),
        "psum_scatter": ("var", lambda x: fs.psum_scatter(x, "tp", dim=0, tiled=True), "(tp n) (dp m)"),
        "all_to_all": ("var", lambda x: fs.all_to_all(x, "tp", split_dim=1, concat_dim=0), "(tp r) (dp m)"),
        "ppermute": ("var", lambda x: fs.ppermute(x, "tp", [(0, 1), (1, 0)]), "(tp n) (dp m)"),
        "pmax": ("var", lambda x: fs.pmax(x, "tp"), "n (dp m)"),
        "pbroadcast": ("var", lambda x: fs.pbroadcast(x, "tp", 1), "n (dp m)"),
        "pvary": ("inv", lambda x: fs.pvary(x, "tp"), "(tp r) (dp m)"),
        # a replicated (over tp) value used twice with tp-varying values: one pvary, one psum backward
        "implicit_pvary_twice": (
            "inv",
            lambda x: x * fs.axis_index("tp") + x * (fs.axis_index("tp") + 1),
            "(tp r) (dp m)",
        ),
    }
    which, body, out_spec = ops[case]
    xs = fs.shard(X, mesh, spec_in[which])
    xs.local.requires_grad_(True)
    fn = fs.shard_map(lambda x: body(x), mesh=mesh, in_specs=spec_in[which], out_specs=out_spec)
    with fs.count_collectives() as fwd:
        out = fn(xs)
    local = out.local if isinstance(out, fs.Sharded) else out
    with fs.count_collectives() as bwd:
        local.backward(torch.ones_like(local))
    return dict(fwd.by_kind()), dict(bwd.by_kind()), fwd.total, bwd.total


COUNT_CASES = {
    # case: (forward kinds, backward kinds)
    "psum_varying": ({("all_reduce", ("tp",)): 1}, {}),
    "psum_varying_pair": ({("all_reduce", ("dp", "tp")): 1}, {}),
    "psum_invariant": ({}, {}),
    "pmean_invariant": ({}, {}),
    "all_gather": ({("all_gather", ("tp",)): 1}, {("reduce_scatter", ("tp",)): 1}),
    "all_gather_invariant": ({("all_gather", ("tp",)): 1}, {}),
    "psum_scatter": ({("reduce_scatter", ("tp",)): 1}, {("all_gather", ("tp",)): 1}),
    "all_to_all": ({("all_to_all", ("tp",)): 1}, {("all_to_all", ("tp",)): 1}),
    "ppermute": ({("ppermute", ("tp",)): 1}, {("ppermute", ("tp",)): 1}),
    "pmax": ({("all_reduce", ("tp",)): 1}, {("all_reduce", ("tp",)): 1}),  # tie counts
    "pbroadcast": ({("broadcast", ("tp",)): 1}, {}),
    "pvary": ({}, {("all_reduce", ("tp",)): 1}),
    "implicit_pvary_twice": ({}, {("all_reduce", ("tp",)): 1}),
}


@pytest.mark.parametrize("case", list(COUNT_CASES))
def test_count_collectives(case):
    fwd_expect, bwd_expect = COUNT_CASES[case]
    for rank, (fwd, bwd, nf, nb) in enumerate(run_ranks(4, _rank_counts, case)):
        assert fwd == fwd_expect, f"rank {rank} forward: {fwd}"
        assert bwd == bwd_expect, f"rank {rank} backward: {bwd}"
        assert nf == sum(fwd_expect.values()) and nb == sum(bwd_expect.values())


def _rank_psum_invariant_value():
    mesh = fs.Mesh(dp=2, tp=2)
    X = torch.arange(6.0).reshape(2, 3)
    with fs.count_collectives() as c:
        y = fs.shard_map(lambda x: fs.psum(x, ("dp", "tp")), mesh=mesh, in_specs="a b", out_specs="a b")(X)
    return y.detach(), c.total


def test_psum_of_invariant_value_multiplies_by_axis_size():
    for y, total in run_ranks(4, _rank_psum_invariant_value):
        torch.testing.assert_close(y, 4 * torch.arange(6.0).reshape(2, 3))
        assert total == 0


# ---------------------------------------------------------------------------------------------
# pmax / pmin gradients with ties, against torch.amax / amin over the stacked global values


def _rank_extremum_ties(op):
    mesh = fs.Mesh(dp=2, tp=2)
    # columns: unique max on rank 3; tie between ranks 0 and 2; tie on all four ranks
    X = torch.tensor([[1.0, 7.0, 2.0], [0.0, 3.0, 2.0], [-1.0, 7.0, 2.0], [9.0, 6.0, 2.0]])
    X = (X if op == "pmax" else -X).reshape(2, 2, 3).requires_grad_(True)
    W = torch.tensor([[1.0, 10.0, 100.0]])

    def f(x):
        return getattr(fs, op)(x.reshape(3), ("dp", "tp")).reshape(1, 3)

    y = fs.shard_map(f, mesh=mesh, in_specs="(dp i) (tp j) n", out_specs="i n")(X)
    (y * W).sum().backward()
    return y.detach(), X.grad


@pytest.mark.parametrize("op", ["pmax", "pmin"])
def test_extremum_gradient_split_among_ties(op):
    X = torch.tensor([[1.0, 7.0, 2.0], [0.0, 3.0, 2.0], [-1.0, 7.0, 2.0], [9.0, 6.0, 2.0]])
    X = (X if op == "pmax" else -X).requires_grad_(True)
    ref = X.amax(0, keepdim=True) if op == "pmax" else X.amin(0, keepdim=True)
    (ref * torch.tensor([[1.0, 10.0, 100.0]])).sum().backward()
    # by hand: column 0 -> rank 3 gets 1; column 1 -> ranks 0 and 2 get 5 each; column 2 -> 25 each
    assert X.grad.tolist() == [[0.0, 5.0, 25.0], [0.0, 0.0, 25.0], [0.0, 5.0, 25.0], [1.0, 0.0, 25.0]]
    for y, grad in run_ranks(4, _rank_extremum_ties, op):
        torch.testing.assert_close(y, ref.detach())
        torch.testing.assert_close(grad.reshape(4, 3), X.grad)


# ---------------------------------------------------------------------------------------------
# the worked case from the semantics notes: f(x, y) = psum(x * y, "dp") + x, x replicated


def _rank_worked_case():
    mesh = fs.Mesh(dp=2, tp=2)
    x = torch.tensor([1.5, -2.0], requires_grad=True)
    Y = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], requires_grad=True)
    fn = fs.shard_map(
        lambda x, y: fs.psum(x * y, "dp") + x, mesh=mesh, in_specs=("n", "(dp tp b) n"), out_specs="(tp b) n"
    )
    with fs.count_collectives() as c:
        out = fn(x, Y)
        full = out.full()
        full.sum().backward()
    return full.detach(), x.grad, Y.grad, dict(c.by_kind())


def test_worked_case_replicated_input_gradient():
    x = torch.tensor([1.5, -2.0], requires_grad=True)
    Y = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], requires_grad=True)
    # global: rows of Y are split over (dp tp); psum over dp adds the rows at the same tp index
    Yb = Y.reshape(2, 2, 2)  # [dp, tp, n]
    ref = (x * Yb).sum(0) + x  # [tp, n]
    ref.sum().backward()
    for full, gx, gY, _kinds in run_ranks(4, _rank_worked_case):
        torch.testing.assert_close(full, ref.detach())
        torch.testing.assert_close(gx, x.grad)  # sum(y) + 1, not sum(y) + world size
        torch.testing.assert_close(gY, Y.grad)


# ---------------------------------------------------------------------------------------------
# torch.func through collectives


def _rank_func_grad():
    mesh = fs.Mesh(dp=2)
    X = torch.arange(1.0, 5.0, dtype=torch.float64)

    def loss(x):
        def f(b):
            return fs.psum((b * b).sum(), "dp")

        return fs.shard_map(f, mesh=mesh, in_specs="(dp n)", out_specs="")(x)

    return torch.func.grad(loss)(X)


def test_torch_func_grad_through_shard_map():
    X = torch.arange(1.0, 5.0, dtype=torch.float64)
    for g in run_ranks(2, _rank_func_grad):
        torch.testing.assert_close(g, 2 * X)


# ---------------------------------------------------------------------------------------------
# errors


def test_collective_outside_shard_map():
    for name, call in [
        ("psum", lambda: fs.psum(torch.ones(2), "dp")),
        ("all_gather", lambda: fs.all_gather(torch.ones(2), "dp")),
        ("axis_index", lambda: fs.axis_index("dp")),
        ("axis_size", lambda: fs.axis_size("dp")),
    ]:
        with pytest.raises(fs.CollectiveError) as err:
            call()
        assert str(err.value) == (
            f"fs.{name} can only be called inside a function run by fs.shard_map, where mesh axes have "
            "names; wrap the calling function with fs.shard_map(f, mesh=..., in_specs=..., out_specs=...)"
        )


def _rank_collective_errors():
    mesh = fs.Mesh(dp=2, tp=2)
    calls = {
        "unknown": lambda x: fs.psum(x, "tpp"),
        "unknown_no_hint": lambda x: fs.pmax(x, "zz"),
        "unknown_in_tuple": lambda x: fs.all_gather(x, ("dp", "dpp")),
        "twice": lambda x: fs.psum(x, ("dp", "dp")),
        "bad_axis_type": lambda x: fs.psum(x, 3),
        "axis_index_unknown": lambda x: x + fs.axis_index("pd"),
        "not_tensor": lambda x: fs.psum("3.0", "dp"),  # (a Python number is fine: psum(1, "dp"))
        "scatter_nondiv": lambda x: fs.psum_scatter(
            {"w": x}, "tp", dim=1, tiled=True
        ),  # (one tensor: uneven blocks)
        "scatter_untiled": lambda x: fs.psum_scatter(x, "tp", dim=1),
        "a2a_dim": lambda x: fs.all_to_all(x, "tp", split_dim=2, concat_dim=0),
        "ppermute_range": lambda x: fs.ppermute(x, "tp", [(0, 2)]),
        "ppermute_dup": lambda x: fs.ppermute(x, "tp", [(0, 1), (1, 1)]),
        "ppermute_type": lambda x: fs.ppermute(x, "tp", [0, 1]),
        "pbroadcast_src": lambda x: fs.pbroadcast(x, "tp", src=2),
    }
    out = {}
    for name, call in calls.items():
        fn = fs.shard_map(call, mesh=mesh, in_specs="(dp a) b", out_specs="(dp a) b")
        with fs.count_collectives() as c:
            try:
                fn(torch.ones(4, 3))
                out[name] = ("no error", c.total)
            except fs.FshardError as e:
                out[name] = (type(e).__name__, str(e), c.total)
    return out


def test_collective_errors_inside_shard_map():
    expected = {
        "unknown": "fs.psum: 'tpp' is not an axis of Mesh(dp=2, tp=2) (did you mean 'tp'?)",
        "unknown_no_hint": "fs.pmax: 'zz' is not an axis of Mesh(dp=2, tp=2)",
        "unknown_in_tuple": "fs.all_gather: 'dpp' is not an axis of Mesh(dp=2, tp=2) (did you mean 'dp'?)",
        "twice": "fs.psum: axis ('dp', 'dp') names an axis twice",
        "bad_axis_type": "fs.psum: axis must be a mesh axis name or a tuple of names, got 3; "
        "mesh axes are ('dp', 'tp')",
        "axis_index_unknown": "fs.axis_index: 'pd' is not an axis of Mesh(dp=2, tp=2) (did you mean 'dp'?)",
        "not_tensor": "fs.psum expects a torch.Tensor or a pytree of tensors, got str",
        "scatter_nondiv": "fs.psum_scatter at x['w']: dim 1 of shape (2, 3) has size 3, which the axis size 2 does "
        "not divide; pad it to 4",
        "scatter_untiled": "fs.psum_scatter: with tiled=False dim 1 must have the axis size 2, but x has "
        "shape (2, 3); pass tiled=True to split it into 2 blocks",
        "a2a_dim": "fs.all_to_all: split_dim=2 is out of range for a tensor of 2 dims",
        "ppermute_range": "fs.ppermute: bad perm [(0, 2)] for axis 'tp' of size 2: indices must lie "
        "in [0, 2)",
        "ppermute_dup": "fs.ppermute: bad perm [(0, 1), (1, 1)] for axis 'tp' of size 2: each index may "
        "appear at most once as a source and once as a destination",
        "ppermute_type": "fs.ppermute: perm must be a list of (source, destination) index pairs, got [0, 1]",
        "pbroadcast_src": "fs.pbroadcast: src=2 must be an index in [0, 2) of axis 'tp'",
    }
    results = run_ranks(4, _rank_collective_errors)
    for rank, got in enumerate(results):
        assert got == results[0], f"rank {rank} differs from rank 0"
        for name, text in expected.items():
            assert got[name][0] == "CollectiveError", (name, got[name])
            assert got[name][1] == text, name
            assert got[name][2] == 0, f"{name}: communication before the error"


# ---------------------------------------------------------------------------------------------
# partly invariant inputs and axis lists


def _rank_partly_invariant(X, W):
    mesh = fs.Mesh(dp=2, tp=2)
    X = X.clone().requires_grad_(True)
    # x is split over dp only (invariant over tp): psum over (dp, tp) all-reduces over dp and
    # multiplies by the tp size
    fn = fs.shard_map(lambda x: fs.psum(x, ("tp", "dp")), mesh=mesh, in_specs="(dp b) n", out_specs="b n")
    with fs.count_collectives() as c:
        y = fn(X)
    (y * W).sum().backward()
    return y.detach(), X.grad, dict(c.by_kind())


def test_psum_over_axes_some_invariant():
    g = torch.Generator().manual_seed(3)
    X = torch.randn(4, 3, generator=g, dtype=torch.float64)
    W = torch.randn(2, 3, generator=g, dtype=torch.float64)
    Xr = X.clone().requires_grad_(True)
    ref = 2 * (Xr[:2] + Xr[2:])
    (ref * W).sum().backward()
    for y, grad, kinds in run_ranks(4, _rank_partly_invariant, X, W):
        torch.testing.assert_close(y, ref.detach())
        torch.testing.assert_close(grad, Xr.grad)
        assert kinds == {("all_reduce", ("dp",)): 1}


def _rank_axis_list():
    mesh = fs.Mesh(dp=2, tp=2)
    X = torch.arange(8.0).reshape(4, 2)
    out = {}
    for name, axis in [("tuple", ("tp", "dp")), ("list", ["tp", "dp"])]:

        def f(x, axis=axis):
            return (
                fs.psum(x, axis),
                fs.all_gather(x, axis, tiled=True, invariant=True),
                (fs.axis_index(axis) + 0 * x.sum()).reshape(1),
                torch.tensor(float(fs.axis_size(axis))),
            )

        fn = fs.shard_map(f, mesh=mesh, in_specs="(dp tp b) n", out_specs=("b n", "b n", "(dp tp i)", ""))
        try:
            s, g, i, n = fn(X)
            out[name] = (s.detach(), g.detach(), i.full(), n.detach())
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_axis_as_list_same_as_tuple():
    # Mesh.check_axes accepts a list of axis names like a tuple
    for out in run_ranks(4, _rank_axis_list):
        assert not isinstance(out["tuple"], str), out["tuple"]
        s, g, i, n = out["tuple"]
        torch.testing.assert_close(s, torch.tensor([[12.0, 16.0]]))
        torch.testing.assert_close(g, torch.arange(8.0)[[0, 1, 4, 5, 2, 3, 6, 7]].reshape(4, 2))  # tp major
        torch.testing.assert_close(
            i, torch.tensor([0.0, 2.0, 1.0, 3.0])
        )  # rank (dp, tp) has index 2 * tp + dp
        assert n.item() == 4
        assert not isinstance(out["list"], str), out["list"]
        for a, b in zip(out["tuple"], out["list"], strict=True):
            torch.testing.assert_close(a, b)
