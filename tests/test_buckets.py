"""Bucketed gradient all-reduces (``shard_map(..., bucket_mb=...)``), on real gloo ranks.

A data-parallel MLP written as users write it (one tensor per parameter) is differentiated with
and without buckets; values and gradients are compared with the same computation done by plain
torch on the global batch in one process, and the backward's collectives are counted.
"""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks

SIZES = [(6, 8), (8,), (8, 8), (8,), (8, 3), (3,)]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(*s, generator=g, dtype=torch.float64) * 0.3 for i, s in enumerate(SIZES)}


def _mlp(p, x, wd):
    h = torch.tanh(x @ p["p0"] + p["p1"])
    h = torch.tanh(h @ p["p2"] + p["p3"])
    y = h @ p["p4"] + p["p5"]
    loss = y.pow(2).mean()
    return loss, wd * sum((v * v).sum() for v in p.values())


def _reference(X, wd):
    p = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
    data, reg = _mlp(p, X, wd)
    loss = data + reg
    grads = torch.autograd.grad(loss, list(p.values()))
    return loss.detach(), dict(zip(p, grads))


def _rank_dp(X, bucket_mb, wd, how):
    mesh = fs.Mesh(dp=4)
    params = {k: v.clone().requires_grad_(True) for k, v in _params().items()}

    def f(p, x):
        data, reg = _mlp(p, x, wd)
        # the data term varies over dp; the weight-decay term uses the parameters invariantly
        return fs.pmean(data, "dp") + reg

    step = fs.shard_map(f, mesh=mesh, in_specs=("...", "(dp b) d"), out_specs="", bucket_mb=bucket_mb)
    with fs.count_collectives() as fwd:
        loss = step(params, X)
    with fs.count_collectives() as bwd:
        if how == "create_graph":
            grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
            hvp = torch.autograd.grad(sum(g.sum() for g in grads), list(params.values()))
            grads = [g.detach() for g in grads]
        else:
            loss.backward()
            grads = [p.grad for p in params.values()]
            hvp = None
    return loss.detach(), dict(zip(params, grads)), bwd.records, fwd.total, hvp


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_one_bucket_per_step(wd):
    X = torch.randn(16, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_loss, ref_grads = _reference(X, wd)
    nbytes = sum(v.numel() * 8 for v in _params().values())
    for loss, grads, records, _, _ in run_ranks(4, _rank_dp, X, 25.0, wd, "backward"):
        torch.testing.assert_close(loss, ref_loss)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], msg=k)
        assert records == [("all_reduce", ("dp",), nbytes)]  # one flat all-reduce, the minimum bytes


def test_small_buckets_and_per_parameter_path_agree():
    X = torch.randn(16, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref_loss, ref_grads = _reference(X, 0.01)
    sizes = [v.numel() * 8 for v in _params().values()]
    # 400-byte buckets: parameters are packed in order while they fit (a larger one goes alone)
    limit = 400 / 2**20
    per_param = run_ranks(4, _rank_dp, X, 0, 0.01, "backward")
    small = run_ranks(4, _rank_dp, X, limit, 0.01, "backward")
    for (l0, g0, r0, _, _), (l1, g1, r1, _, _) in zip(per_param, small):
        torch.testing.assert_close(l0, ref_loss)
        torch.testing.assert_close(l1, ref_loss)
        for k in ref_grads:
            torch.testing.assert_close(g0[k], ref_grads[k], msg=k)
            torch.testing.assert_close(g1[k], ref_grads[k], msg=k)
        assert sorted(r0) == sorted(("all_reduce", ("dp",), n) for n in sizes)
        buckets, cur = [], 0
        for n in sizes:
            if cur and cur + n > 400:
                buckets.append(cur)
                cur = 0
            cur += n
        buckets.append(cur)
        assert sorted(r1) == sorted(("all_reduce", ("dp",), n) for n in buckets)


def test_create_graph_keeps_reductions_differentiable():
    X = torch.randn(16, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    p = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
    data, reg = _mlp(p, X, 0.01)
    grads = torch.autograd.grad(data + reg, list(p.values()), create_graph=True)
    ref_hvp = torch.autograd.grad(sum(g.sum() for g in grads), list(p.values()))
    for _loss, got, _, _, hvp in run_ranks(4, _rank_dp, X, 25.0, 0.01, "create_graph"):
        for k, g in zip(p, grads):
            torch.testing.assert_close(got[k], g.detach(), msg=k)
        for a, b in zip(hvp, ref_hvp):
            torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------
# gradient accumulation without reducing every micro-batch


def _rank_no_sync(Xs):
    mesh = fs.Mesh(dp=4)
    params = {k: v.clone().requires_grad_(True) for k, v in _params().items()}

    def f(p, x):
        data, reg = _mlp(p, x, 0.01)
        return fs.pmean(data, "dp") + reg

    step = fs.shard_map(f, mesh=mesh, in_specs=("...", "(dp b) d"), out_specs="")
    records = []
    with fs.no_sync():
        for X in Xs[:-1]:
            loss = step(params, X)
            with fs.count_collectives() as bwd:
                loss.backward()
            records.append(bwd.records)
    loss = step(params, Xs[-1])
    with fs.count_collectives() as bwd:
        loss.backward()
    records.append(bwd.records)
    return {k: p.grad for k, p in params.items()}, records


def test_no_sync_accumulates_then_reduces_once():
    Xs = [
        torch.randn(16, 6, generator=torch.Generator().manual_seed(10 + i), dtype=torch.float64)
        for i in range(3)
    ]
    p = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
    total = 0
    for X in Xs:
        data, reg = _mlp(p, X, 0.01)
        total = total + data + reg
    ref = dict(zip(p, torch.autograd.grad(total, list(p.values()))))
    nbytes = sum(v.numel() * 8 for v in _params().values())
    for grads, records in run_ranks(4, _rank_no_sync, Xs):
        for k in ref:
            torch.testing.assert_close(grads[k], ref[k], msg=k)
        assert records == [[], [], [("all_reduce", ("dp",), nbytes)]]


# ---------------------------------------------------------------------------------------------
# mixed precision: bfloat16 compute, float32 parameters and reductions


def _rank_mixed(X, reduce_dtype):
    mesh = fs.Mesh(dp=4)
    params = {k: v.float().clone().requires_grad_(True) for k, v in _params().items()}

    def f(p, x):
        assert x.dtype == torch.bfloat16 and all(v.dtype == torch.bfloat16 for v in p.values())
        data, _ = _mlp(p, x, 0.0)
        return fs.pmean(data, "dp")

    step = fs.shard_map(
        f,
        mesh=mesh,
        in_specs=("...", "(dp b) d"),
        out_specs="",
        compute_dtype=torch.bfloat16,
        reduce_dtype=reduce_dtype,
    )
    loss = step(params, X.float())
    with fs.count_collectives() as bwd:
        loss.backward()
    return loss.detach(), {k: p.grad for k, p in params.items()}, bwd.records


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_mixed_precision_against_one_process_with_the_same_casts(reduce_dtype):
    X = torch.randn(16, 6, generator=torch.Generator().manual_seed(4))
    p = {k: v.float().clone().requires_grad_(True) for k, v in _params().items()}
    # one process, the same casts: parameters and data to bfloat16, gradients back to float32
    losses = [_mlp({k: v.bfloat16() for k, v in p.items()}, xb.bfloat16(), 0.0)[0] for xb in X.split(4)]
    ref_loss = sum(losses) / 4
    ref = dict(zip(p, torch.autograd.grad(ref_loss, list(p.values()))))
    nbytes = sum(v.numel() for v in _params().values()) * (4 if reduce_dtype == torch.float32 else 2)
    for loss, grads, records in run_ranks(4, _rank_mixed, X, reduce_dtype):
        assert loss.dtype == torch.bfloat16
        torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=2e-2, atol=2e-2)
        for k in ref:
            assert grads[k].dtype == torch.float32
            torch.testing.assert_close(grads[k], ref[k], rtol=3e-2, atol=3e-2, msg=k)
        assert records == [("all_reduce", ("dp",), nbytes)]


# ---------------------------------------------------------------------------------------------
# parameters first used through a view or another invariant function still go in the bucket


def _rank_derived(X, bucket_mb):
    mesh = fs.Mesh(dp=4)
    g = torch.Generator().manual_seed(5)
    params = {
        "w": (torch.randn(6, 6, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True),
        "pos": (torch.randn(10, 6, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True),
        "scale": torch.ones(6, dtype=torch.float64, requires_grad=True),
    }

    def f(p, x):
        s = x.shape[1]
        h = x + p["pos"][:s]  # a slice of the table (as GPT's wpe[:s])
        h = torch.tanh(h @ p["w"].T)  # the transpose
        h = h * (p["scale"] * 2.0)  # an invariant function of the parameter
        return fs.pmean(h.pow(2).mean(), "dp")

    step = fs.shard_map(f, mesh=mesh, in_specs=("...", "(dp b) s d"), out_specs="", bucket_mb=bucket_mb)
    loss = step(params, X)
    with fs.count_collectives() as bwd:
        loss.backward()
    return loss.detach(), {k: v.grad for k, v in params.items()}, bwd.records


def test_views_and_functions_of_parameters_are_bucketed():
    X = torch.randn(8, 5, 6, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    p = {
        "w": (torch.randn(6, 6, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True),
        "pos": (torch.randn(10, 6, generator=g, dtype=torch.float64) * 0.3).requires_grad_(True),
        "scale": torch.ones(6, dtype=torch.float64, requires_grad=True),
    }
    h = torch.tanh((X + p["pos"][:5]) @ p["w"].T) * (p["scale"] * 2.0)
    ref_loss = h.pow(2).mean()
    ref = dict(zip(p, torch.autograd.grad(ref_loss, list(p.values()))))
    nbytes = (36 + 60 + 6) * 8
    for bucket_mb, want in ((25.0, [("all_reduce", ("dp",), nbytes)]), (0, None)):
        for loss, grads, records in run_ranks(4, _rank_derived, X, bucket_mb):
            torch.testing.assert_close(loss, ref_loss.detach())
            for k in ref:
                torch.testing.assert_close(grads[k], ref[k], msg=k)
            if want is not None:
                assert records == want  # one bucket, the parameters' full sizes
            else:  # per use: the slice (5 rows of pos), the transpose, the scaled vector
                assert sorted(records) == sorted(
                    [
                        ("all_reduce", ("dp",), 30 * 8),
                        ("all_reduce", ("dp",), 36 * 8),
                        ("all_reduce", ("dp",), 6 * 8),
                    ]
                )


def _rank_mixed_operands(X, V, A, B):
    mesh = fs.Mesh(tp=4)
    x = X.clone().requires_grad_(True)
    a, b = A.clone().requires_grad_(True), B.clone().requires_grad_(True)

    def f(x, a, b, v):
        w = a @ b  # invariant, needs a gradient, not itself an input
        h = x + w  # a function of the input x *and* of w: its cast must not go through x's twin
        return fs.psum((torch.tanh(h @ v)).sum(), "tp")

    loss = fs.shard_map(f, mesh=mesh, in_specs=("b d", "d k", "k d", "d (tp e)"), out_specs="")(x, a, b, V)
    loss.backward()
    return x.grad, a.grad, b.grad


def test_function_of_an_input_and_another_differentiable_tensor():
    X, V = _randn_like(7, 4, 4), _randn_like(8, 4, 8)
    A, B = _randn_like(9, 4, 2), _randn_like(10, 2, 4)
    x, a, b = (t.clone().requires_grad_(True) for t in (X, A, B))
    torch.tanh((x + a @ b) @ V).sum().backward()
    for gx, ga, gb in run_ranks(4, _rank_mixed_operands, X, V, A, B):
        torch.testing.assert_close(gx, x.grad)
        torch.testing.assert_close(ga, a.grad)
        torch.testing.assert_close(gb, b.grad)


def _randn_like(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _taps(t) -> int:
    """The TwinTap nodes in the autograd graph behind ``t``."""
    seen, todo, n = set(), [t.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        n += type(node).__name__ == "TwinTapBackward"
        todo.extend(nxt for nxt, _ in node.next_functions)
    return n


def _rank_taps(X, bucket_mb):
    mesh = fs.Mesh(dp=4)
    params = {k: v.clone().requires_grad_(True) for k, v in _params().items()}

    def f(p, x):
        return fs.pmean(_mlp(p, x, 0.0)[0], "dp")

    step = fs.shard_map(f, mesh=mesh, in_specs=("...", "(dp b) d"), out_specs="", bucket_mb=bucket_mb)
    loss = step(params, X)
    taps = _taps(loss)
    with fs.count_collectives() as bwd:
        loss.backward()
    return taps, bwd.by_kind()[("all_reduce", ("dp",))], loss.detach(), [p.grad for p in params.values()]


@pytest.mark.parametrize("bucket_mb", [25.0, 0.0002])
def test_taps_only_where_a_bucket_can_launch_early(bucket_mb):
    """All six gradients (1.3 KB) fit in one bucket at the default size: no tap is made (it could
    not launch before the boundary); with 200-byte buckets each parameter gets a tap, and the
    buckets launch during the backward. The values are the one process's either way."""
    X = torch.randn(16, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want_loss, want = _reference(X, 0.0)
    for taps, reduces, loss, grads in run_ranks(4, _rank_taps, X, bucket_mb):
        assert taps == (0 if bucket_mb == 25.0 else len(SIZES))
        # 200-byte buckets: one per parameter (in reverse order, each neighbour pair passes 200 bytes)
        assert reduces == (1 if bucket_mb == 25.0 else len(SIZES))
        torch.testing.assert_close(loss, want_loss)
        for g, k in zip(grads, want):
            torch.testing.assert_close(g, want[k])
