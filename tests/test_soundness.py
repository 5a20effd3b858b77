"""Soundness of varying-axes tracking in eager code: values that could escape the tracker.

Each program is a per-shard function written as users write it (tensor bounds in a Python slice,
``.item()`` numbers, index tensors, ``torch.where`` on a rank-dependent condition, in-place updates
of collective outputs). Values and gradients are compared with the same computation done by plain
torch on the global tensors in the test process; escapes that cannot be tracked must raise
``fs.TracingError`` with the full message, identically on every rank.
"""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# sequence-parallel positional embedding: a replicated table sliced with rank-dependent bounds

N_SP, S, D = 4, 8, 3  # 4 ranks over sp, 8 positions, width 3


def _pos_program(route):
    """The per-shard function: x (local positions) plus this rank's rows of the table ``pos``."""

    def f(x, pos):
        n = x.shape[0]
        i = fs.axis_index("sp")
        if route == "tensor_slice":
            rows = pos[i * n : (i + 1) * n]
        elif route == "item_slice":
            k = i.item()
            rows = pos[k * n : (k + 1) * n]
        elif route == "item_narrow":
            rows = pos.narrow(0, i.item() * n, n)
        elif route == "tensor_narrow":
            rows = pos.narrow(0, i * n, n)
        elif route == "index_select":
            rows = pos.index_select(0, i * n + torch.arange(n))
        elif route == "gather":
            idx = (i * n + torch.arange(n)).unsqueeze(1).expand(n, pos.shape[1])
            rows = torch.gather(pos, 0, idx)
        elif route == "index_tensor":
            rows = pos[i * n + torch.arange(n)]
        elif route == "tolist_index":
            rows = pos[[k + i.item() * n for k in range(n)]]
        elif route == "where_mask":  # rows of pos whose index falls in this rank's range, others zero
            j = torch.arange(pos.shape[0]).unsqueeze(1)
            sel = torch.where((j >= i * n) & (j < (i + 1) * n), pos, 0.0)  # other rows zero
            rows = sel.reshape(-1, n, pos.shape[1]).sum(0)
        elif route == "masked_fill":
            j = torch.arange(pos.shape[0]).unsqueeze(1)
            sel = pos.masked_fill((j < i * n) | (j >= (i + 1) * n), 0.0)
            rows = sel.narrow(0, i * n, n)
        else:
            raise AssertionError(route)
        return (x + rows).pow(2)

    return f


ROUTES = [
    "tensor_slice",
    "item_slice",
    "item_narrow",
    "tensor_narrow",
    "index_select",
    "gather",
    "index_tensor",
    "tolist_index",
    "where_mask",
    "masked_fill",
]


def _rank_pos(route, X, P):
    mesh = fs.Mesh(sp=N_SP)
    pos = P.clone().requires_grad_(True)
    x = X.clone().requires_grad_(True)
    g = fs.shard_map(_pos_program(route), mesh=mesh, in_specs=("(sp s) d", "p d"), out_specs="(sp s) d")
    y = g(x, pos)
    loss = (y.full() * torch.arange(1.0, 1 + S * D, dtype=X.dtype).reshape(S, D)).sum()
    loss.backward()
    return y.full().detach(), x.grad, pos.grad


@pytest.mark.parametrize("route", ROUTES)
def test_rank_dependent_slice_of_replicated_table(route):
    X, P = _randn(0, S, D), _randn(1, S, D)
    # reference: the global computation, position s uses row s of the table
    x, pos = X.clone().requires_grad_(True), P.clone().requires_grad_(True)
    y = (x + pos).pow(2)
    (y * torch.arange(1.0, 1 + S * D, dtype=X.dtype).reshape(S, D)).sum().backward()
    for r, (got_y, got_gx, got_gp) in enumerate(run_ranks(N_SP, _rank_pos, route, X, P)):
        torch.testing.assert_close(got_y, y.detach(), msg=f"rank {r} value")
        torch.testing.assert_close(got_gx, x.grad, msg=f"rank {r} grad x")
        torch.testing.assert_close(got_gp, pos.grad, msg=f"rank {r} grad pos (one sum over sp, not per-rank)")


def _rank_replication_check(route):
    mesh = fs.Mesh(sp=N_SP)
    pos = torch.arange(float(S * D)).reshape(S, D)

    def f(pos):
        i = fs.axis_index("sp")
        if route == "slice":
            return pos[i * 2 : i * 2 + 2]
        if route == "item_tensor":
            return torch.tensor(i.item() * 1.0 + pos.sum().item())
        if route == "item_arith":
            return pos[0, 0] * (1 + i.item() * 2.5)
        raise AssertionError(route)

    try:
        fs.shard_map(f, mesh=mesh, in_specs="p d", out_specs="...")(pos)
    except fs.SpecError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("route", ["slice", "item_tensor", "item_arith"])
def test_per_rank_values_fail_the_replication_check(route):
    # A per-rank slice or a tensor built from a per-rank .item() must not pass as replicated.
    texts = run_ranks(N_SP, _rank_replication_check, route)
    assert texts == [texts[0]] * N_SP, "ranks disagree"
    assert texts[0] == (
        "fs.shard_map(_rank_replication_check.<locals>.f): 1 problem with out_specs (replication check):\n"
        "  - out varies over mesh axis sp but out_spec '...' says it is replicated over sp; reduce it inside f "
        "(fs.psum / fs.pmean over 'sp'), mark it as a partial sum with '| sum(sp)', split a dim over sp in the "
        "out_spec, or pass check=False if you know it is the same on every rank"
    )


# ---------------------------------------------------------------------------------------------
# escapes that cannot be tracked: a clear error, the same on every rank


def _rank_escape(route):
    mesh = fs.Mesh(pp=2, dp=2)

    def f(x):
        i = fs.axis_index("pp")
        if route == "if":
            if i == 0:
                return x * 2
            return x
        if route == "int":
            return x[int(i)]
        if route == "float":
            return x * float(i)
        if route == "index":
            return [x, x * 2][i]
        if route == "numpy":
            return torch.from_numpy(x.numpy())
        if route == "inplace_grad":
            h = x * 1.0  # invariant over pp, needs a gradient
            h[0] = i.double()
            return h
        raise AssertionError(route)

    x = torch.ones(2, 3, dtype=torch.float64, requires_grad=route == "inplace_grad")
    try:
        out = fs.shard_map(f, mesh=mesh, in_specs="...", out_specs="(pp a) ...")(
            x.unsqueeze(0).expand(2, 2, 3)
        )
    except fs.TracingError as e:
        return str(e)
    return out.full().detach()


_HEAD = "fs.shard_map(_rank_escape.<locals>.f): "
_ONES = torch.ones(2, 2, 3, dtype=torch.float64)
ESCAPES = {  # a branch on a varying value runs (the result varies over pp, as its out_spec says)
    "if": torch.cat([_ONES * 2, _ONES]),  # pp 0 doubles x, pp 1 returns it
    "int": torch.ones(4, 3, dtype=torch.float64),  # x[0] on pp 0, x[1] on pp 1
    "float": torch.cat([_ONES * 0, _ONES]),
    "index": torch.cat([_ONES, _ONES * 2]),
    "numpy": torch.cat([_ONES, _ONES]),  # x is invariant: .numpy() of an invariant tensor is fine
    "inplace_grad": (
        "in-place __setitem__ writes a value that varies over mesh axis 'pp' into a tensor that needs a "
        "gradient and does not vary over them, so its gradient could not be summed over those axes; use the "
        "out-of-place op (e.g. torch.where, index_put, x = x + y), or fs.pvary(x, ...) before writing into it"
    ),
}


@pytest.mark.parametrize("route", list(ESCAPES))
def test_escapes_run_or_raise_on_every_rank(route):
    texts = run_ranks(4, _rank_escape, route)
    want = ESCAPES[route]
    if isinstance(want, torch.Tensor):
        for r, got in enumerate(texts):
            torch.testing.assert_close(got, want, msg=f"rank {r}")
        return
    assert texts == [texts[0]] * 4, "ranks disagree"
    assert texts[0] == _HEAD + want


def _rank_numpy_varying():
    mesh = fs.Mesh(dp=2)

    def f(x):
        return torch.from_numpy(x.numpy()).sum()

    try:
        fs.shard_map(f, mesh=mesh, in_specs="(dp b)", out_specs="")(torch.ones(4))
    except fs.SpecError as e:
        return str(e)
    return "no error"


def test_numpy_of_varying_taints_the_call():
    # what is built from the numpy array varies like x: its replicated claim fails, naming the line
    texts = run_ranks(2, _rank_numpy_varying)
    assert texts == [texts[0]] * 2
    line = _rank_numpy_varying.__code__.co_firstlineno + 4
    assert texts[0] == (
        "fs.shard_map(_rank_numpy_varying.<locals>.f): 1 problem with out_specs (replication check):\n"
        "  - out varies over mesh axis dp but out_spec '' says it is replicated over dp; reduce it inside f "
        "(fs.psum / fs.pmean over 'dp'), mark it as a partial sum with '| sum(dp)', split a dim over dp in the "
        "out_spec, or pass check=False if you know it is the same on every rank\n"
        "f branched on a value that varies across ranks (.numpy() of a value that varies over mesh axis 'dp', "
        f"at test_soundness.py:{line}), so the ranks may have run different code from there on: every value "
        "made after it (and any value it may have chosen) counts as varying over those axes; reduce the output "
        "after the branch (the result of fs.psum / fs.pmean / fs.all_gather(..., invariant=True) over them is "
        "the same on every rank), or select with torch.where(cond, a, b) instead of the branch"
    )


# ---------------------------------------------------------------------------------------------
# rank-dependent selection between tracked values keeps working (pipelines)


def _rank_where_select(X, W):
    mesh = fs.Mesh(pp=2)
    w = W.clone().requires_grad_(True)

    def f(x, w):
        stage = fs.axis_index("pp")
        h = torch.where(stage == 0, x @ w, x)  # stage 0 applies w, stage 1 passes x through
        return fs.psum(h.sum(), "pp")

    loss = fs.shard_map(f, mesh=mesh, in_specs=("b d", "d e"), out_specs="")(X, w)
    loss.backward()
    return loss.detach(), w.grad


def test_where_on_stage_index():
    X, W = _randn(2, 4, 3), _randn(3, 3, 3)
    w = W.clone().requires_grad_(True)
    ref = (X @ w).sum() + X.sum()
    ref.backward()
    for loss, gw in run_ranks(2, _rank_where_select, X, W):
        torch.testing.assert_close(loss, ref.detach())
        torch.testing.assert_close(gw, w.grad)


# ---------------------------------------------------------------------------------------------
# collective outputs are ordinary tensors: in-place updates work under autograd


def _rank_inplace_after(kind, X, Z):
    mesh = fs.Mesh(dp=4)
    x = X.clone().requires_grad_(True)
    z = Z.clone().requires_grad_(True)
    n = 4

    def f(x, z):
        if kind == "ppermute":
            y = fs.ppermute(x, "dp", [(i, (i + 1) % n) for i in range(n)])
        elif kind == "ppermute_partial":
            y = fs.ppermute(x, "dp", [(0, 1), (2, 3)])
        elif kind == "all_gather":
            y = fs.all_gather(x, "dp", dim=0, tiled=True)[: x.shape[0]]
            y = y * 1.0
        elif kind == "all_gather_untiled":
            y = fs.all_gather(x, "dp", dim=0)
            y += z.unsqueeze(0) * 0
            y = y[0]
        elif kind == "psum_scatter":
            y = fs.psum_scatter(x.repeat(n, 1), "dp", dim=0, tiled=True)
        elif kind == "all_to_all":
            y = fs.all_to_all(x.repeat(n, 1), "dp", split_dim=0, concat_dim=0)[: x.shape[0]]
            y = y * 1.0
        else:
            raise AssertionError(kind)
        y += z
        y.mul_(2.0)
        return y

    y = fs.shard_map(f, mesh=mesh, in_specs=("(dp b) d", "(dp b) d"), out_specs="(dp b) d")(x, z)
    full = y.full()
    (full * full).sum().backward()
    return full.detach(), x.grad, z.grad


def _reference_inplace_after(kind, X, Z):
    n, b = 4, X.shape[0] // 4
    x, z = X.clone().requires_grad_(True), Z.clone().requires_grad_(True)
    xs, zs = x.split(b), z.split(b)
    if kind == "ppermute":
        ys = [xs[(i - 1) % n] for i in range(n)]
    elif kind == "ppermute_partial":
        zero = torch.zeros_like(xs[0])
        ys = [zero, xs[0], zero, xs[2]]
    elif kind in ("all_gather", "all_gather_untiled", "all_to_all"):
        ys = [xs[0]] * n
    elif kind == "psum_scatter":
        total = sum(xs)
        ys = [total] * n
    ys = [(y + zi) * 2.0 for y, zi in zip(ys, zs)]
    full = torch.cat(ys)
    (full * full).sum().backward()
    return full.detach(), x.grad, z.grad


@pytest.mark.parametrize(
    "kind", ["ppermute", "ppermute_partial", "all_gather", "all_gather_untiled", "psum_scatter", "all_to_all"]
)
def test_inplace_update_of_collective_output(kind):
    X, Z = _randn(4, 8, 3), _randn(5, 8, 3)
    want = _reference_inplace_after(kind, X, Z)
    for r, got in enumerate(run_ranks(4, _rank_inplace_after, kind, X, Z)):
        for name, g, w in zip(("value", "grad x", "grad z"), got, want):
            torch.testing.assert_close(g, w, msg=f"rank {r} {name}")


# ---------------------------------------------------------------------------------------------
# rank-inconsistent inputs and outputs


def _rank_sharded_uneven():
    import torch.distributed as dist

    mesh = fs.Mesh(dp=4)
    rows = 1 if dist.get_rank() == 1 else 3  # not torch.chunk's blocks (those would be 3, 3, 3, 1)
    try:
        fs.Sharded(torch.ones(rows, 2), mesh, "(dp b) d")
    except fs.SpecError as e:
        return str(e)
    return "no error"


def test_sharded_from_uneven_blocks_raises_on_every_rank():
    texts = run_ranks(4, _rank_sharded_uneven)
    assert texts == [texts[0]] * 4
    assert texts[0] == (
        "fs.Sharded: the local blocks for spec '(dp b) d' on Mesh(dp=4) are not the blocks of one global "
        "value (ranks 0, 2, 3: (3, 2); rank 1: (1, 2)); as torch.chunk cuts a global shape (10, 2), they "
        "would be rank 0: (3, 2); rank 1: (3, 2); rank 2: (3, 2); rank 3: (1, 2); cut the blocks with "
        "torch.chunk (uneven blocks are fine: the first ones are the longer), drop or pad the uneven last "
        "batch (e.g. DataLoader(drop_last=True)), or gather it whole and use fs.shard(x, mesh, spec, src=0)"
    )


def _rank_sharded_even(X):
    import torch.distributed as dist

    mesh = fs.Mesh(dp=2)
    r = dist.get_rank()
    with fs.count_collectives() as counts:
        s = fs.Sharded(X[r * 2 : r * 2 + 2].clone(), mesh, "(dp b) d")
        unchecked = fs.Sharded(X[r * 2 : r * 2 + 2].clone(), mesh, "(dp b) d", check=False)
    return s.full(), unchecked.full(), counts.total


def test_sharded_from_per_rank_blocks():
    X = _randn(6, 4, 3)
    for full, full2, n in run_ranks(2, _rank_sharded_even, X):
        torch.testing.assert_close(full, X)
        torch.testing.assert_close(full2, X)
        assert n == 1  # the checked constructor costs one small all-gather; check=False none


def _rank_inplace_input(route):
    mesh = fs.Mesh(dp=2)
    x = torch.arange(8.0).reshape(4, 2)

    def f(x):
        if route == "block":
            x.mul_(2)  # each rank doubles its own block of its copy of x
        elif route == "varying":
            x.add_(fs.axis_index("dp").float())  # x is replicated here, the added value is not
        elif route == "same":
            x.add_(1.0)  # the same update on every rank: plain torch behaviour, allowed
        return x.sum(0, keepdim=True) * 0

    spec = "(dp b) d" if route == "block" else "b d"
    try:
        fs.shard_map(f, mesh=mesh, in_specs=spec, out_specs="(dp b) d")(x)
    except fs.TracingError as e:
        return str(e)
    return x


@pytest.mark.parametrize("route", ["block", "varying", "same"])
def test_inplace_update_of_a_global_input(route):
    got = run_ranks(2, _rank_inplace_input, route)
    if route == "same":
        for x in got:
            torch.testing.assert_close(x, torch.arange(8.0).reshape(4, 2) + 1)
        return
    assert got == [got[0]] * 2
    assert got[0] == (
        "fs.shard_map(_rank_inplace_input.<locals>.f): f modified args[0] in place; it is (a block of) the "
        "global tensor you passed, so each rank changed its own copy and the ranks' copies now disagree; "
        "clone inside f (x = x.clone()) before updating, or pass an fs.Sharded value (fs.shard(x, mesh, "
        "spec)), whose block each rank owns and may update in place"
    )


def _rank_dtensor_input(X):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = fs.Mesh(dp=2)
    dt = distribute_tensor(X.clone(), mesh.device_mesh, [Shard(0)])

    def f(x):
        return fs.psum(x.sum(0), "dp")

    return fs.shard_map(f, mesh=mesh, in_specs="(dp b) d", out_specs="d")(dt)


def test_dtensor_argument_is_converted():
    X = _randn(7, 4, 3)
    for got in run_ranks(2, _rank_dtensor_input, X):
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, X.sum(0))


def _rank_all_gather_returned():
    mesh = fs.Mesh(tp=2)

    def f(w):
        return fs.all_gather(w, "tp", dim=0, tiled=True)

    try:
        fs.shard_map(f, mesh=mesh, in_specs="(tp h) d", out_specs="h d")(torch.ones(4, 2))
    except fs.SpecError as e:
        return str(e)
    return "no error"


def test_returned_all_gather_suggests_invariant():
    texts = run_ranks(2, _rank_all_gather_returned)
    assert texts == [texts[0]] * 2
    assert texts[0] == (
        "fs.shard_map(_rank_all_gather_returned.<locals>.f): 1 problem with out_specs (replication check):\n"
        "  - out is an fs.all_gather over tp, which varies over tp (its gradient is reduce-scattered back to "
        "each rank's block), but out_spec 'h d' says it is replicated over tp; gather with "
        "fs.all_gather(..., invariant=True) to return the gathered value as replicated, or split a dim over "
        "tp in the out_spec and return the block"
    )


def _rank_debug(route):
    import torch.distributed as dist

    mesh = fs.Mesh(dp=2)
    r = dist.get_rank()

    def f(x):
        if route == "shapes":
            return x[x > 0.5]  # a data-dependent shape
        return x * 2

    x = (
        torch.tensor([0.1, 0.9, 0.8, 0.7])
        if route == "shapes"
        else torch.ones(4) * (1 + (r if route == "inputs" else 0))
    )
    spec_out = "(dp b)"
    try:
        with fs.debug(), fs.count_collectives() as counts:
            fs.shard_map(f, mesh=mesh, in_specs="(dp b)", out_specs=spec_out)(x)
    except fs.TracingError as e:
        return str(e)
    return ("no error", counts.total)


def test_debug_mode_checks():
    assert run_ranks(2, _rank_debug, "ok") == [("no error", 2)] * 2  # one check of inputs, one of outputs
    texts = run_ranks(2, _rank_debug, "inputs")
    assert texts == [texts[0]] * 2
    assert texts[0] == (
        "fs.shard_map(_rank_debug.<locals>.f) [debug]: args[0] differs across ranks (equal within: rank 0; "
        "rank 1); a plain tensor argument is the global value, the same on every rank: seed random generators "
        "the same way on every rank, take one rank's copy with fs.shard(x, mesh, spec, src=0), or pass "
        "per-rank blocks as fs.Sharded(local, mesh, spec)"
    )
    texts = run_ranks(2, _rank_debug, "shapes")
    assert texts == [texts[0]] * 2
    assert texts[0] == (
        "fs.shard_map(_rank_debug.<locals>.f) [debug]: f returned outputs whose structure or local shapes "
        "differ across ranks (equal within: rank 0; rank 1); a data-dependent shape (x[mask], nonzero, "
        "unique) on a varying value differs per rank: pad it to a fixed size (torch.where with a fill value) "
        "or return the mask with the values"
    )


def test_plan_cache_is_bounded():
    from fshard import _shard_map

    mesh = fs.Mesh(dp=1)
    f = fs.shard_map(lambda x: x * 2, mesh=mesh, in_specs="(dp b)", out_specs="(dp b)")
    for n in range(1, _shard_map.PLAN_CACHE_SIZE + 40):
        f(torch.ones(n))
    assert len(f._in_plans) == _shard_map.PLAN_CACHE_SIZE
    assert len(f._out_plans) == _shard_map.PLAN_CACHE_SIZE
    # the most recent shapes are kept, and a hit still gives the right value
    torch.testing.assert_close(f(torch.ones(5)).full(), torch.full((5,), 2.0))
