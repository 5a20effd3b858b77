"""NaN and inf through every reduction, the dtypes a backend does not take, and ranks whose blocks
differ in dtype: each case ends in torch's value on the global tensor or in the same clear error on
every rank (gloo groups of 2 and 4 ranks, combining on and off)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import env_vars

NAN, INF = float("nan"), float("inf")


def _same(errs, what, got, want):
    """Exact agreement, NaN where torch has NaN (and nowhere else), same dtype and shape."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        errs.append(f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}")
        return
    g, w = got.detach().double(), want.detach().double()
    if not torch.equal(g.isnan(), w.isnan()) or not torch.equal(g.nan_to_num(0.0), w.nan_to_num(0.0)):
        errs.append(f"{what}: got {got.tolist()}, want {want.tolist()}")


# ---------------------------------------------------------------------------------------------
# NaN and inf through the reductions


def _global_with_nans(n: int) -> torch.Tensor:
    """``[n, 4, 4]``: the block of each of ``n`` ranks. Column 0: one rank's NaN; column 1: +inf
    on one rank, -inf on another (the sum is NaN); column 2: a NaN and an inf; column 3: finite."""
    X = torch.arange(n * 16, dtype=torch.float32).reshape(n, 4, 4) % 7 - 3
    X[n - 2, :, 0] = NAN  # not the last rank: gloo's MAX dropped a NaN met before the largest value
    X[0, 1:, 1] = INF
    X[n - 1, 1:, 1] = -INF
    X[n - 1, 2, 2] = NAN
    X[0, 2, 2] = INF
    X[1, 3, 3] = -INF
    return X


def _rank_nan_reductions(sizes: dict, axes: tuple, combine: str):
    n = math.prod(sizes.values())
    mesh = fs.Mesh(**sizes)
    X = _global_with_nans(n)
    G = X.reshape(n * 4, 4)
    red = " ".join(axes)
    spec = f"({red} r) c"
    errs: list = []
    want = {
        "psum": X.sum(0),
        "pmean": X.mean(0),
        "pmax": X.amax(0),
        "pmin": X.amin(0),
        "psum_scatter": X.sum(0),
        "out_spec sum": X.sum(0),
    }
    with env_vars(FSHARD_COMBINE=combine):
        got = {
            "psum": fs.shard_map(lambda x: fs.psum(x, axes), mesh=mesh, in_specs=spec, out_specs="r c")(G),
            "pmean": fs.shard_map(lambda x: fs.pmean(x, axes), mesh=mesh, in_specs=spec, out_specs="r c")(G),
            "pmax": fs.shard_map(lambda x: fs.pmax(x, axes), mesh=mesh, in_specs=spec, out_specs="r c")(G),
            "pmin": fs.shard_map(lambda x: fs.pmin(x, axes), mesh=mesh, in_specs=spec, out_specs="r c")(G),
            "psum_scatter": fs.shard_map(
                lambda x: fs.psum_scatter(x, axes, dim=0, tiled=True),
                mesh=mesh,
                in_specs=spec,
                out_specs=spec,
            )(G).full()
            if 4 % n == 0
            else None,
            "out_spec sum": fs.shard_map(
                lambda x: x * 1, mesh=mesh, in_specs=spec, out_specs=f"r c | sum({red})"
            )(G),
        }
        # pytree and per-leaf calls in one step (combined into one collective when combining is on)
        two = fs.shard_map(
            lambda x: (fs.psum(x[:2], axes), fs.psum(x[2:], axes)),
            mesh=mesh,
            in_specs=spec,
            out_specs=("r c", "r c"),
        )(G)
    for k, v in got.items():
        if v is not None:
            _same(errs, k, v, want[k])
    _same(errs, "two psums", torch.cat(two), X.sum(0))
    return errs


@pytest.mark.parametrize(
    "n, sizes, axes",
    [
        (2, {"dp": 2}, ("dp",)),
        (4, {"dp": 4}, ("dp",)),
        (4, {"dp": 2, "tp": 2}, ("dp", "tp")),
    ],
    ids=["2-dp", "4-dp", "4-dp,tp"],
)
@pytest.mark.parametrize("combine", ["1", "0"])
def test_nan_and_inf_reach_every_rank_as_torch_gives_them(n, sizes, axes, combine):
    # the reference itself: torch's reductions of the global tensor propagate NaN and inf
    X = _global_with_nans(n)
    assert X.amax(0)[:, 0].isnan().all() and X.amin(0)[2, 2].isnan() and X.sum(0)[1:, 1].isnan().all()
    for errs in run_ranks(n, _rank_nan_reductions, sizes, axes, combine):
        assert errs == []


def _rank_pmax_of_one_nan():
    mesh = fs.Mesh(dp=4)
    x = torch.tensor([1.0, 2.0, NAN, 4.0])
    out = {}
    for op in ("pmax", "pmin"):
        f = fs.shard_map(
            lambda x, op=op: getattr(fs, op)(x, "dp"), mesh=mesh, in_specs="(dp a)", out_specs="a"
        )
        out[op] = f(x).item()
    return out


def test_pmax_of_1_2_nan_4_is_nan_on_every_rank():
    # the case: gloo's MAX gave 2.0 on every rank
    assert math.isnan(torch.tensor([1.0, 2.0, NAN, 4.0]).amax().item())
    for out in run_ranks(4, _rank_pmax_of_one_nan):
        assert math.isnan(out["pmax"]) and math.isnan(out["pmin"])


def _rank_clip_inf(n: int, poison: bool):
    mesh = fs.Mesh(dp=n)
    W = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    G = torch.linspace(-2.0, 3.0, 24).reshape(8, 3)
    if poison:
        G[5, 1] = NAN  # in one rank's block only
    p = fs.shard(W, mesh, "(dp a) b")
    p.local.grad = fs.shard(G, mesh, "(dp a) b").local.clone()
    b = torch.linspace(0.5, 1.5, 3)  # replicated parameter
    b.grad = torch.tensor([0.25, -4.0, 1.0])
    norm = fs.optim.clip_grad_norm_([p, b], 1.0, norm_type=INF)
    return norm, p._like(p.local.grad).full(), b.grad


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("poison", [False, True])
def test_clip_grad_norm_inf_as_torch_on_the_full_gradient(n, poison):
    W = torch.zeros(8, 3, requires_grad=True)
    W.grad = torch.linspace(-2.0, 3.0, 24).reshape(8, 3)
    if poison:
        W.grad[5, 1] = NAN
    b = torch.zeros(3, requires_grad=True)
    b.grad = torch.tensor([0.25, -4.0, 1.0])
    want = torch.nn.utils.clip_grad_norm_([W, b], 1.0, norm_type=INF)
    assert math.isnan(want.item()) == poison
    for norm, gW, gb in run_ranks(n, _rank_clip_inf, n, poison):
        errs: list = []
        _same(errs, "norm", norm, want)
        _same(errs, "W.grad", gW, W.grad)
        _same(errs, "b.grad", gb, b.grad)
        assert errs == []


def _rank_extremum_nan_grad(op: str):
    from torch.func import jvp

    mesh = fs.Mesh(dp=2, tp=2)
    X = torch.tensor([[1.0, NAN, 2.0], [0.0, 3.0, 2.0], [-1.0, 7.0, NAN], [9.0, 6.0, 2.0]])
    X = (X if op == "pmax" else -X).reshape(2, 2, 3).requires_grad_(True)
    W = torch.tensor([[1.0, 10.0, 100.0]])
    f = fs.shard_map(
        lambda x: getattr(fs, op)(x.reshape(3), ("dp", "tp")).reshape(1, 3),
        mesh=mesh,
        in_specs="(dp i) (tp j) n",
        out_specs="i n",
    )
    y = f(X)
    (y * W).sum().backward()
    T = torch.linspace(-1.0, 1.0, 12).reshape(2, 2, 3)
    tangent = jvp(f, (X.detach(),), (T,))[1]
    return y.detach(), X.grad, tangent


@pytest.mark.parametrize("op", ["pmax", "pmin"])
def test_extremum_gradient_and_tangent_with_nan_as_torch_amax(op):
    from torch.func import jvp

    X = torch.tensor([[1.0, NAN, 2.0], [0.0, 3.0, 2.0], [-1.0, 7.0, NAN], [9.0, 6.0, 2.0]])
    X = (X if op == "pmax" else -X).requires_grad_(True)
    ref = X.amax(0, keepdim=True) if op == "pmax" else X.amin(0, keepdim=True)
    (ref * torch.tensor([[1.0, 10.0, 100.0]])).sum().backward()
    T = torch.linspace(-1.0, 1.0, 12).reshape(4, 3)
    red = (lambda x: x.amax(0, keepdim=True)) if op == "pmax" else (lambda x: x.amin(0, keepdim=True))
    want_t = jvp(red, (X.detach(),), (T,))[1]
    assert X.grad[:, 1:].isnan().all() and not X.grad[:, 0].isnan().any()  # torch: NaN in NaN columns
    for y, grad, tangent in run_ranks(4, _rank_extremum_nan_grad, op):
        errs: list = []
        _same(errs, "value", y, ref)
        _same(errs, "grad", grad.reshape(4, 3), X.grad)
        _same(errs, "tangent", tangent, want_t)
        assert errs == []


# ---------------------------------------------------------------------------------------------
# dtypes gloo does not take: moved as bytes, reduced in a wider dtype, or refused clearly

_INTS = {  # dtype: (bits, signed)
    torch.int16: (16, True),
    torch.uint16: (16, False),
    torch.uint32: (32, False),
    torch.uint64: (64, False),
}
_F8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _values(dt, n: int) -> list:
    """``n`` blocks of 2 x 3 values of ``dt``, near its ends so that sums wrap (as python ints or
    floats)."""
    if dt in _INTS:
        bits, signed = _INTS[dt]
        top = 2 ** (bits - 1) - 1 if signed else 2**bits - 1
        lo = -(2 ** (bits - 1)) if signed else 0
        base = [top, top - 5, lo, lo + 7, 3, (top + lo) // 2]
        pick = [[[base[(r + 2 * i + j) % 6] for j in range(3)] for i in range(2)] for r in range(n)]
        return [[[v - r if v - r >= lo else v + r for v in row] for row in blk] for r, blk in enumerate(pick)]
    vals = [448.0 if dt == torch.float8_e4m3fn else 57344.0, -2.5, 0.375, 3.0, -0.5, 13.0]
    out = [[[vals[(r + 2 * i + j) % 6] for j in range(3)] for i in range(2)] for r in range(n)]
    out[n - 2][0][1] = NAN
    return out


def _wrap(v: int, dt) -> int:
    bits, signed = _INTS[dt]
    v %= 2**bits
    return v - 2**bits if signed and v >= 2 ** (bits - 1) else v


def _reference(dt, n: int):
    """psum, pmax, pmin of the ``n`` blocks, computed in python ints (wrapping as the dtype does) or,
    for float8, in float32 rounded once to ``dt`` (torch has no float8 sum)."""
    vals = _values(dt, n)
    if dt in _INTS:
        cols = [[[vals[r][i][j] for r in range(n)] for j in range(3)] for i in range(2)]
        return {
            "psum": torch.tensor([[_wrap(sum(c), dt) for c in row] for row in cols], dtype=dt),
            "pmax": torch.tensor([[max(c) for c in row] for row in cols], dtype=dt),
            "pmin": torch.tensor([[min(c) for c in row] for row in cols], dtype=dt),
        }
    S = torch.tensor(vals, dtype=torch.float32).to(dt).float()
    return {"psum": S.sum(0).to(dt), "pmax": S.amax(0).to(dt), "pmin": S.amin(0).to(dt)}


def _rank_dtypes(n: int, combine: str):
    mesh = fs.Mesh(dp=n)
    errs: list = []
    with env_vars(FSHARD_COMBINE=combine):
        for dt in [*_INTS, *_F8, torch.complex64, torch.bool]:
            if dt in _INTS:
                X = torch.tensor(_values(dt, n), dtype=dt)
            elif dt in _F8:
                X = torch.tensor(_values(dt, n), dtype=torch.float32).to(dt)
            elif dt == torch.complex64:
                X = torch.complex(torch.arange(n * 6.0), -torch.arange(n * 6.0)).reshape(n, 2, 3)
            else:
                X = (torch.arange(n * 6) % 3 == 0).reshape(n, 2, 3)
            G = X.reshape(n * 2, 3)
            spec = "(dp r) c"
            name = str(dt).replace("torch.", "")
            if dt in _INTS or dt in _F8:
                want = _reference(dt, n)
                for op in ("psum", "pmax", "pmin"):
                    f = fs.shard_map(
                        lambda x, op=op: getattr(fs, op)(x, "dp"), mesh=mesh, in_specs=spec, out_specs="r c"
                    )
                    _same_bits(errs, f"{name} {op}", f(G), want[op])
                if n == 2:  # psum_scatter: each rank's block of rows of the sum (2 rows over 2 ranks)
                    f = fs.shard_map(
                        lambda x: fs.psum_scatter(x, "dp", dim=0, tiled=True),
                        mesh=mesh,
                        in_specs=spec,
                        out_specs=spec,
                    )
                    _same_bits(errs, f"{name} psum_scatter", f(G).full(), want["psum"])
            # the data movements: exact for every dtype
            f = fs.shard_map(
                lambda x: fs.all_gather(x, "dp", tiled=True, invariant=True),
                mesh=mesh,
                in_specs=spec,
                out_specs="r c",
            )
            _same_bits(errs, f"{name} all_gather", f(G), G)
            f = fs.shard_map(
                lambda x: fs.all_gather(x, "dp", tiled=True), mesh=mesh, in_specs=spec, out_specs="(dp r) c"
            )
            _same_bits(errs, f"{name} all_gather (varying)", f(G).full(), G.repeat(n, 1))
            H = G[:, [j % 3 for j in range(2 * n)]]  # 2 n columns: 2 to each rank
            f = fs.shard_map(
                lambda x: fs.all_to_all(x, "dp", split_dim=1, concat_dim=0),
                mesh=mesh,
                in_specs="(dp r) c",
                out_specs="r (dp c)",
            )
            _same_bits(errs, f"{name} all_to_all", f(H).full(), H)
            perm = [(i, (i + 1) % n) for i in range(n)]
            f = fs.shard_map(
                lambda x, perm=perm: fs.ppermute(x, "dp", perm), mesh=mesh, in_specs=spec, out_specs=spec
            )
            _same_bits(
                errs, f"{name} ppermute", f(G).full(), X[[(i - 1) % n for i in range(n)]].reshape(n * 2, 3)
            )
            f = fs.shard_map(
                lambda x: fs.pbroadcast(x, "dp", n - 1), mesh=mesh, in_specs=spec, out_specs="r c"
            )
            _same_bits(errs, f"{name} pbroadcast", f(G), X[n - 1])
            s = fs.shard(G if dist.get_rank() == 0 else None, mesh, spec, src=0)
            _same_bits(errs, f"{name} fs.shard(src=0)", s.local, X[dist.get_rank()])
            full = s.full(dst=n - 1)
            if dist.get_rank() == n - 1:
                _same_bits(errs, f"{name} Sharded.full(dst)", full, G)
    return errs


def _same_bits(errs, what, got, want):
    """Equal values of one dtype (NaN where want has NaN), compared through exact wider dtypes."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        errs.append(f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}")
    elif got.dtype.is_floating_point or got.dtype.is_complex:
        g, w = torch.view_as_real(got) if got.is_complex() else got.double(), None
        w = torch.view_as_real(want) if want.is_complex() else want.double()
        if not torch.equal(g.isnan(), w.isnan()) or not torch.equal(g.nan_to_num(0.0), w.nan_to_num(0.0)):
            errs.append(f"{what}: got {got.double().tolist()}, want {want.double().tolist()}")
    elif got.tolist() != want.tolist():
        errs.append(f"{what}: got {got.tolist()}, want {want.tolist()}")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("combine", ["1", "0"])
def test_dtypes_gloo_lacks_reduce_and_move_as_torch_on_the_global_tensor(n, combine):
    # the references wrap as the dtypes do (int16: 32767 + 32762 wraps to -7)
    assert _wrap(32767 + 32762, torch.int16) == -7 and _wrap(2**64 + 3, torch.uint64) == 3
    for errs in run_ranks(n, _rank_dtypes, n, combine):
        assert errs == []


def _rank_refused():
    mesh = fs.Mesh(dp=dist.get_world_size())
    x = torch.ones(2 * dist.get_world_size(), 3, dtype=torch.complex64)

    def f(x):
        return fs.pmax(x, "dp")

    try:
        fs.shard_map(f, mesh=mesh, in_specs="(dp r) c", out_specs="r c")(x)
    except fs.CollectiveError as e:
        return str(e), f.__code__.co_firstlineno + 1
    return None, None


@pytest.mark.parametrize("n", [2, 4])
def test_a_dtype_no_backend_reduces_is_refused_on_every_rank(n):
    for msg, line in run_ranks(n, _rank_refused):
        assert msg == (
            f"fs.pmax over dp at {__file__}:{line}: the gloo backend cannot take a max of dtype complex64 "
            "(shape (2, 3)); it reduces bfloat16, bool, float16, float32, float64, int32, int64, int8, uint8 "
            "(complex: sums only), and fshard also int16, uint16, uint32, uint64 and the float8 dtypes (sum, max, "
            "min). Cast the operand to one of them first, e.g. x.to(torch.float32)"
        )


# ---------------------------------------------------------------------------------------------
# ranks whose blocks differ in dtype


def _rank_from_local_dtypes(odd: int):
    mesh = fs.Mesh(dp=dist.get_world_size())
    dt = torch.float64 if dist.get_rank() == odd else torch.float32
    try:
        fs.Sharded.from_local(torch.ones(2, 3, dtype=dt), mesh, "(dp b) d")
    except fs.ArgumentError as e:
        return str(e)
    return None


@pytest.mark.parametrize("n", [2, 4])
def test_from_local_refuses_blocks_of_different_dtypes_on_every_rank(n):
    odd = n - 1
    others = ", ".join(str(r) for r in range(n) if r != odd)
    held = f"rank{'s' if n > 2 else ''} {others}: torch.float32 on cpu; rank {odd}: torch.float64 on cpu"
    for msg in run_ranks(n, _rank_from_local_dtypes, odd):
        assert msg == (
            f"fs.Sharded.from_local over dp: the operand has a different dtype or device type on different ranks "
            f"({held}); every rank must hand the same dtype on the same kind of device (a collective of mismatched "
            f"dtypes fails inside the backend). Cast it on every rank alike, e.g. x.to(torch.float32) where the "
            f"ranks' values are made (a per-rank loader's batch as it is loaded)"
        )


def _rank_uneven_dtypes():
    n = dist.get_world_size()
    mesh = fs.Mesh(dp=n)
    X = torch.arange(5.0 * 3).reshape(5, 3)  # uneven blocks: torch.chunk's cut of 5 rows

    def f(x):
        y = x.double() if mesh.axis_index("dp") == n - 1 else x  # one rank's operand in float64
        return fs.psum(y.sum(0), "dp")

    try:
        fs.shard_map(f, mesh=mesh, in_specs="(dp b) d", out_specs="d")(X)
    except fs.CollectiveError as e:
        return str(e)
    return None


@pytest.mark.parametrize("n", [2, 4])
def test_collective_in_an_uneven_call_refuses_operands_of_different_dtypes(n):
    others = ", ".join(str(r) for r in range(n - 1))
    held = f"rank{'s' if n > 2 else ''} {others}: torch.float32 on cpu; rank {n - 1}: torch.float64 on cpu"
    for msg in run_ranks(n, _rank_uneven_dtypes):
        assert msg == (
            f"fs.psum over dp: the operand has a different dtype or device type on different ranks ({held}); "
            f"every rank must hand the same dtype on the same kind of device (a collective of mismatched dtypes "
            f"fails inside the backend). Cast it on every rank alike, e.g. x.to(torch.float32) where the ranks' "
            f"values are made (a per-rank loader's batch as it is loaded)"
        )


def _rank_compiled_nan(n: int):
    mesh = fs.Mesh(dp=n)
    X = _global_with_nans(n)
    G = X.reshape(n * 4, 4)

    def step(g):
        return (
            fs.shard_map(lambda x: fs.pmax(x, "dp"), mesh=mesh, in_specs="(dp r) c", out_specs="r c")(g),
            fs.shard_map(lambda x: fs.pmin(x, "dp"), mesh=mesh, in_specs="(dp r) c", out_specs="r c")(g),
        )

    got = torch.compile(step, backend="eager", fullgraph=True)(G)
    errs: list = []
    _same(errs, "compiled pmax", got[0], X.amax(0))
    _same(errs, "compiled pmin", got[1], X.amin(0))
    return errs


@pytest.mark.parametrize("n", [2, 4])
def test_compiled_pmax_and_pmin_carry_the_nan_mask(n):
    # compiled, the marks are the whole NaN mask, in the same buffer (no host read of a flag)
    for errs in run_ranks(n, _rank_compiled_nan, n, timeout=240):
        assert errs == []
