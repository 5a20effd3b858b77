"""Uneven splits: blocks cut as torch.chunk cuts them (DTensor's rule), on real gloo groups.

- ``Layout.block`` against ``torch.chunk`` and DTensor's own block computation (rank-free).
- ``fs.shard`` (also ``src=``), ``Sharded.full`` (also ``dst=``), ``reshard``, ``from_local``
  (shapes found from the blocks, or given), ``fs.visualize``: blocks and values against the
  global tensor, on 1-, 2- and 3-axis meshes, with empty blocks where there are more ranks
  than rows.
- ``shard_map`` with uneven inputs (plain global tensors and Sharded values, in another layout
  too), uneven outputs (global shapes from the inputs' labels, from a reduce-scatter, or
  gathered), values and gradients against the same computation in one process.
- Collectives inside f: a tiled all_gather of uneven blocks works (and its gradient); other
  collectives over operands whose shapes differ raise the same error on every rank.
- Checkpoints and DTensor interop with uneven blocks.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import fshard as fs
from fshard import checkpoint
from fshard._layout import bind, chunk_sizes
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, randn

F64 = torch.float64

# =============================================================================================
# Rank-free: which block each coordinate holds


@pytest.mark.parametrize("size", [0, 1, 3, 5, 10, 13])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_block_is_torch_chunk(size, n):
    layout, _ = bind("(dp b) d", (("dp", n),), 2)
    pieces = [p.shape[0] for p in torch.arange(size).chunk(n)] if size else []
    pieces += [0] * (n - len(pieces))  # torch.chunk returns fewer pieces; the other ranks hold none
    starts = [0]
    for p in pieces[:-1]:
        starts.append(starts[-1] + p)
    got = [layout.block((size, 7), {"dp": n}, {"dp": i}) for i in range(n)]
    assert [b[0][1] for b in got] == pieces
    assert [b[0][0] for b in got if b[0][1]] == [s for s, p in zip(starts, pieces) if p]
    assert all(b[1] == (0, 7) for b in got)
    assert chunk_sizes(size, [n]) == tuple(pieces)


def test_blocks_match_dtensor():
    """Nested splits are cut one axis after the other, as DTensor cuts Shard placements."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    cases = [
        ((Shard(0), Shard(0)), "(a b x) y"),
        ((Shard(0), Shard(1)), "(a x) (b y)"),
        ((Replicate(), Shard(0)), "(b x) y"),
    ]
    checked = 0
    for size in range(0, 14):
        for ms in [(2, 2), (4, 2), (2, 3), (3, 4)]:
            mesh_shape = {"a": ms[0], "b": ms[1]}
            for placements, spec in cases:
                layout, _ = bind(spec, tuple(mesh_shape.items()), 2)
                for c in itertools.product(range(ms[0]), range(ms[1])):
                    shape, offset = _compute_local_shape_and_global_offset(
                        (size, size + 1), ms, list(c), placements
                    )
                    block = layout.block((size, size + 1), mesh_shape, {"a": c[0], "b": c[1]})
                    assert tuple(n for _, n in block) == tuple(shape), (size, ms, spec, c)
                    # offsets agree wherever the block holds data
                    assert all(s == o for (s, n), o in zip(block, offset) if n), (size, ms, spec, c)
                    checked += 1
    assert checked > 1000


# =============================================================================================
# Sharded values: shard, full, reshard, from_local, visualize


def _rank_sharded(mesh_shape, spec, shape, new_spec):
    mesh = fs.Mesh(**mesh_shape)
    X = randn(7, *shape, dtype=F64)
    errs: list[str] = []
    x = fs.shard(X, mesh, spec)
    layout = x.layout
    want = X[tuple(slice(s, s + n) for s, n in layout.block(shape, mesh.shape, mesh.coordinate))]
    close(errs, "local block", x.local, want, F64)
    if tuple(x.shape) != shape:
        errs.append(f"shape {tuple(x.shape)} != {shape}")
    close(errs, "full()", x.full(), X, F64)
    on0 = x.full(dst=0)
    if dist.get_rank() == 0:
        close(errs, "full(dst=0)", on0, X, F64)
    elif on0 is not None:
        errs.append("full(dst=0) returned a value on another rank")
    y = fs.shard(X if dist.get_rank() == 0 else None, mesh, spec, src=0)
    close(errs, "shard(src=0) block", y.local, want, F64)
    z = x.reshard(new_spec)
    want_z = X[tuple(slice(s, s + n) for s, n in z.layout.block(shape, mesh.shape, mesh.coordinate))]
    close(errs, f"reshard {new_spec!r} block", z.local, want_z, F64)
    close(errs, f"reshard {new_spec!r} full", z.full(), X, F64)
    back = z.reshard(spec)
    close(errs, "reshard back", back.local, want, F64)
    # from_local: the global shape found from the blocks, or given
    f1 = fs.Sharded.from_local(want.clone(), mesh, spec)
    f2 = fs.Sharded.from_local(want.clone(), mesh, spec, shape=shape)
    for name, f in (("from_local", f1), ("from_local(shape=)", f2)):
        if tuple(f.shape) != shape:
            errs.append(f"{name}: shape {tuple(f.shape)} != {shape}")
        close(errs, f"{name} full", f.full(), X, F64)
    return errs


@pytest.mark.parametrize(
    ("world", "mesh_shape", "spec", "shape", "new_spec"),
    [
        (2, {"dp": 2}, "(dp b) d", (5, 3), "b (dp d)"),
        (4, {"dp": 4}, "(dp b) d", (10, 6), "b (dp d)"),  # 3, 3, 3, 1 rows; 2, 2, 2, 0 cols
        (4, {"dp": 4}, "(dp b) d", (3, 2), "b d"),  # an empty block
        (8, {"dp": 8}, "(dp b) d", (3, 5), "b (dp d)"),  # five empty blocks
        (4, {"dp": 2, "tp": 2}, "(dp tp b) d", (10, 3), "(dp b) (tp d)"),  # nested: 3, 2, 3, 2
        (4, {"dp": 2, "tp": 2}, "(dp b) (tp d)", (5, 7), "(tp b) (dp d)"),
        (8, {"pp": 2, "dp": 2, "tp": 2}, "(pp b) (dp tp d)", (3, 11), "(pp dp b) (tp d)"),
    ],
)
def test_sharded_uneven(world, mesh_shape, spec, shape, new_spec):
    assert_ok(run_ranks(world, _rank_sharded, mesh_shape, spec, shape, new_spec))


def _rank_from_local_errors():
    mesh = fs.Mesh(dp=4)
    r = dist.get_rank()
    X = torch.arange(14.0).reshape(7, 2)
    out = []
    # 1, 2, 2, 2 rows: not the blocks torch.chunk cuts (2, 2, 2, 1)
    block = X[:1] if r == 0 else X[1 + 2 * (r - 1) : 3 + 2 * (r - 1)]
    try:
        fs.Sharded.from_local(block, mesh, "(dp b) d")
    except fs.SpecError as e:
        out.append(str(e))
    try:  # a block that is not this rank's block of the given global shape
        fs.Sharded.from_local(X[:2], mesh, "(dp b) d", shape=(7, 2))
    except fs.SpecError as e:
        out.append(str(e))
    return out


def test_from_local_errors():
    got = run_ranks(4, _rank_from_local_errors)
    first = (
        "fs.Sharded: the local blocks for spec '(dp b) d' on Mesh(dp=4) are not the blocks of one global "
        "value (rank 0: (1, 2); ranks 1, 2, 3: (2, 2)); as torch.chunk cuts a global shape (7, 2), they "
        "would be rank 0: (2, 2); rank 1: (2, 2); rank 2: (2, 2); rank 3: (1, 2); cut the blocks with "
        "torch.chunk (uneven blocks are fine: the first ones are the longer), drop or pad the uneven last "
        "batch (e.g. DataLoader(drop_last=True)), or gather it whole and use fs.shard(x, mesh, spec, src=0)"
    )
    assert [g[0] for g in got] == [first] * 4
    assert got[0][1:] == []  # rank 0 does hold (2, 2) of (7, 2)
    assert got[3][1] == (
        "fs.Sharded: the local block of shape (2, 2) is not the block of global shape (7, 2) that spec "
        "'(dp b) d' gives the rank at dp=3 on Mesh(dp=4) ((1, 2), as torch.chunk cuts it); pass the global "
        "shape of the whole value, or cut the blocks with torch.chunk"
    )


def _rank_visualize():
    mesh = fs.Mesh(dp=4)
    return fs.visualize(fs.shard(torch.zeros(10, 6), mesh, "(dp b) d"))


def test_visualize_uneven():
    want = "\n".join(
        [
            "(10, 6) as '(dp b) d' on Mesh(dp=4): 4 blocks cut as torch.chunk cuts (uneven), 1 copy each",
            "  [0:3, 0:6] (3, 6)  rank 0 (dp=0)",
            "  [3:6, 0:6] (3, 6)  rank 1 (dp=1)",
            "  [6:9, 0:6] (3, 6)  rank 2 (dp=2)",
            "  [9:10, 0:6] (1, 6)  rank 3 (dp=3)",
        ]
    )
    assert run_ranks(4, _rank_visualize) == [want] * 4


# =============================================================================================
# shard_map with uneven inputs and outputs: values and gradients against one process


def _model(x, w, b):
    return torch.tanh(x @ w + b)


def _rank_shard_map(mesh_shape, x_spec, shape, as_sharded):
    mesh = fs.Mesh(**mesh_shape)
    errs: list[str] = []
    X = randn(1, *shape, dtype=F64)
    W = randn(2, shape[1], 4, dtype=F64)
    B = randn(3, 4, dtype=F64)
    # reference: one process
    Xr, Wr, Br = (t.clone().requires_grad_(True) for t in (X, W, B))
    yr = _model(Xr, Wr, Br)
    lr = (yr**2).sum()
    lr.backward()

    @fs.shard_map(mesh=mesh, in_specs=(x_spec, "d h", "h"), out_specs=("(dp b) h", ""))
    def step(x, w, b):
        y = _model(x, w, b)
        return y, fs.psum((y**2).sum(), "dp")

    x_in = X.clone().requires_grad_(True)
    arg = fs.shard(X, mesh, "b (dp d)" if "dp" in mesh_shape else "b d") if as_sharded else x_in
    if as_sharded:
        arg.requires_grad_(True)
    w, b = W.clone().requires_grad_(True), B.clone().requires_grad_(True)
    with fs.count_collectives():
        y, loss = step(arg, w, b)
    if tuple(y.shape) != tuple(yr.shape):
        errs.append(f"y.shape {tuple(y.shape)} != {tuple(yr.shape)}")
    close(errs, "y", y.full(), yr, F64)
    close(errs, "loss", loss, lr, F64)
    loss.backward()
    close(errs, "grad w", w.grad, Wr.grad, F64)
    close(errs, "grad b", b.grad, Br.grad, F64)
    gx = arg.grad.full() if as_sharded else x_in.grad
    close(errs, "grad x", gx, Xr.grad, F64)
    # a second call takes the cached plan
    y2, _ = step(arg, w, b)
    close(errs, "y (cached plan)", y2.full(), yr, F64)
    return errs


@pytest.mark.parametrize(
    ("world", "mesh_shape", "x_spec", "shape", "as_sharded"),
    [
        (2, {"dp": 2}, "(dp b) d", (5, 3), False),
        (4, {"dp": 4}, "(dp b) d", (10, 3), False),
        (4, {"dp": 4}, "(dp b) d", (10, 3), True),  # a Sharded input in another (uneven) layout
        (4, {"dp": 4}, "(dp b) d", (3, 5), False),  # an empty block
        (8, {"dp": 8}, "(dp b) d", (6, 9), True),
        (4, {"dp": 2, "tp": 2}, "(dp b) d", (7, 3), False),
    ],
)
def test_shard_map_uneven(world, mesh_shape, x_spec, shape, as_sharded):
    assert_ok(run_ranks(world, _rank_shard_map, mesh_shape, x_spec, shape, as_sharded))


def _rank_outputs():
    """Output global shapes: from a tied label, from a reduce-scatter's cut, or gathered."""
    mesh = fs.Mesh(dp=4)
    errs: list[str] = []
    X = randn(4, 10, 3, dtype=F64)
    P = randn(5, 4, 7, dtype=F64)  # a partial sum per rank: reduce-scattered into 2, 2, 2, 1 rows

    @fs.shard_map(
        mesh=mesh, in_specs=("(dp b) d", "r n"), out_specs=("(dp b) d", "(dp _) d", "(dp n) k | sum(dp)")
    )
    def f(x, p):
        i = fs.axis_index("dp")
        return x * 2, x + 1, p * (i + 1)

    with fs.count_collectives() as c:
        a, b, s = f(X, P)
    for name, got, want in (("labelled", a, X * 2), ("anonymous", b, X + 1), ("scattered", s, P * 10)):
        if tuple(got.shape) != tuple(want.shape):
            errs.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        close(errs, name, got.full(), want, F64)
    # one reduce-scatter, and one small all-gather of block shapes for the anonymous output
    kinds = dict(c.by_kind())
    if kinds != {("reduce_scatter", ("dp",)): 1, ("all_gather", ("dp",)): 1}:
        errs.append(f"collectives {kinds}")
    return errs


def test_shard_map_uneven_outputs():
    assert_ok(run_ranks(4, _rank_outputs))


# =============================================================================================
# Collectives inside f


def _rank_collectives_inside():
    mesh = fs.Mesh(dp=4)
    errs: list[str] = []
    X = randn(6, 10, 3, dtype=F64)
    W = randn(7, 3, 3, dtype=F64)

    @fs.shard_map(mesh=mesh, in_specs=("(dp b) d", "d k"), out_specs="")
    def gathered(x, w):
        whole = fs.all_gather(x @ w, "dp", dim=0, tiled=True)  # blocks of 3, 3, 3, 1 rows
        return fs.pmean((whole.cumsum(0) ** 2).sum(), "dp")

    w = W.clone().requires_grad_(True)
    x = X.clone().requires_grad_(True)
    loss = gathered(x, w)
    wr, xr = W.clone().requires_grad_(True), X.clone().requires_grad_(True)
    lr = (((xr @ wr).cumsum(0)) ** 2).sum()
    lr.backward()
    loss.backward()
    close(errs, "loss", loss, lr, F64)
    close(errs, "grad w", w.grad, wr.grad, F64)
    close(errs, "grad x", x.grad, xr.grad, F64)

    @fs.shard_map(mesh=mesh, in_specs="(dp b) d", out_specs="d")
    def wrong(x):
        return fs.psum(x[:1].sum(0), "dp")  # each rank's first row (none on an empty block)

    @fs.shard_map(mesh=mesh, in_specs="(dp b) d", out_specs="b d")
    def wrong_sum(x):
        return fs.psum(x, "dp")

    @fs.shard_map(mesh=mesh, in_specs="(dp b) d", out_specs="d")
    def right_sum(x):
        return fs.psum(x.sum(0), "dp")  # shapes agree: fine

    close(errs, "psum of agreeing shapes", right_sum(X), X.sum(0), F64)
    close(errs, "psum, shapes agree", wrong(X), X[[0, 3, 6, 9]].sum(0), F64)
    try:
        wrong_sum(X)
        errs.append("psum of uneven blocks did not raise")
    except fs.CollectiveError as e:
        return errs, str(e)
    return errs, None


def test_collectives_inside_uneven():
    got = run_ranks(4, _rank_collectives_inside)
    assert_ok([e for e, _ in got])
    want = (
        "fs.psum over dp: the operand has a different shape on different ranks of dp (index 0: (3, 3); "
        "index 1: (3, 3); index 2: (3, 3); index 3: (1, 3)), because an input of this call is split unevenly "
        "(torch.chunk's blocks); fs.psum needs the same shape on every rank. Pad the blocks to the largest "
        "(torch.nn.functional.pad) or reduce them to a shape that agrees (e.g. x.sum(0)) first; "
        "fs.all_gather(x, axis, dim, tiled=True) (of a tensor or a pytree) accepts blocks that differ along dim"
    )
    assert [m for _, m in got] == [want] * 4


# =============================================================================================
# Checkpoints and DTensor


def _rank_checkpoint(path):
    mesh = fs.Mesh(dp=4)
    errs: list[str] = []
    X = randn(8, 10, 5, dtype=F64)
    checkpoint.save(path, {"x": fs.shard(X, mesh, "(dp b) d"), "y": fs.shard(X[:3], mesh, "(dp b) d")})
    like = {"x": fs.shard(torch.zeros(10, 5, dtype=F64), mesh, "b (dp d)"), "y": torch.zeros(3, 5, dtype=F64)}
    got = checkpoint.load(path, like)
    close(
        errs,
        "x loaded in another uneven layout",
        got["x"].local,
        X[:, mesh.coordinate["dp"] * 2 : (mesh.coordinate["dp"] + 1) * 2],
        F64,
    )
    close(errs, "x full", got["x"].full(), X, F64)
    close(errs, "y (3 rows over 4 ranks) loaded whole", got["y"], X[:3], F64)
    return errs


def test_checkpoint_uneven(tmp_path):
    assert_ok(run_ranks(4, _rank_checkpoint, str(tmp_path / "ckpt")))


def _rank_dtensor():
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = fs.Mesh(dp=2, tp=2)
    errs: list[str] = []
    X = randn(9, 10, 5, dtype=F64)
    s = fs.shard(X, mesh, "(dp tp b) d")
    dt = s.to_dtensor()
    close(errs, "to_dtensor full_tensor", dt.full_tensor(), X, F64)
    close(errs, "to_dtensor local", dt.to_local(), s.local, F64)
    d2 = distribute_tensor(X, mesh.device_mesh, [Shard(1), Shard(0)])  # 5 cols over dp, 10 rows over tp
    back = fs.from_dtensor(d2)
    if tuple(back.shape) != (10, 5):
        errs.append(f"from_dtensor shape {tuple(back.shape)}")
    close(errs, "from_dtensor full", back.full(), X, F64)
    return errs


def test_dtensor_uneven():
    assert_ok(run_ranks(4, _rank_dtensor))


# =============================================================================================
# psum_scatter into uneven blocks inside f


def _rank_psum_scatter_uneven():
    mesh = fs.Mesh(dp=4)
    errs: list[str] = []
    X = randn(10, 8, 10, dtype=F64)  # 8 rows: 2 per rank; the reduce-scatter cuts 10 columns
    W = randn(11, 10, 10, dtype=F64)

    @fs.shard_map(mesh=mesh, in_specs=("(dp b) d", "d k"), out_specs=("b (dp k)", ""))
    def f(x, w):
        part = x.T @ (x @ w)  # (10, 10): this rank's partial sum
        block = fs.psum_scatter(part, "dp", dim=1, tiled=True)  # 3, 3, 3, 1 columns
        whole = fs.all_gather(block, "dp", dim=1, tiled=True)  # the uneven blocks again
        return block, fs.pmean((whole**2).sum(), "dp")

    w = W.clone().requires_grad_(True)
    block, loss = f(X, w)
    wr = W.clone().requires_grad_(True)
    full = X.T @ (X @ wr)
    lr = (full**2).sum()
    lr.backward()
    loss.backward()
    if tuple(block.shape) != (10, 10):
        errs.append(f"shape {tuple(block.shape)}")
    close(errs, "scattered", block.full(), full, F64)
    close(errs, "loss", loss, lr, F64)
    close(errs, "grad w", w.grad, wr.grad, F64)
    return errs


def test_psum_scatter_uneven():
    assert_ok(run_ranks(4, _rank_psum_scatter_uneven))
