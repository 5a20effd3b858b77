"""The gradients of the collectives themselves, inside f.

Each collective's VJP (psum, all_gather invariant or varying, psum_scatter, all_to_all,
ppermute) is taken with torch.func and with torch.autograd on the same local function and
compared with its closed form; psum / pmean of invariant values, pmax with a tie and pbroadcast
are checked against plain torch on the global tensors. Every case runs on real gloo ranks and
returns its list of problems (see helpers.py).
"""

from __future__ import annotations

from collections import Counter

import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, check_counts, close, full, randn


def _torch_func_inside():
    """torch.func.grad / vjp of local functions that call fshard collectives, inside f."""
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    n = 2
    errs: list[str] = []
    dt = torch.float64
    w, x = randn(1, 3, dtype=dt), randn(2, 4, 3, dtype=dt)
    c = randn(3, 4, dtype=dt)
    ws = randn(4, 4, dtype=dt)

    def both(fn, arg, ct=None):
        """torch.func and torch.autograd on the same local function: (func result, autograd result)."""
        a = arg.detach().requires_grad_(True)
        if ct is None:
            got = torch.func.grad(fn)(arg)
            (want,) = torch.autograd.grad(fn(a), a)
        else:
            _, vjp = torch.func.vjp(fn, arg)
            (got,) = vjp(ct)
            (want,) = torch.autograd.grad(fn(a), a, ct)
        return got, want

    # psum with a replicated primal: the implicit pvary's psum runs in the backward
    f1 = fs.shard_map(
        lambda w, x: both(lambda w: fs.psum((w * x).sum(), "dp"), w),
        mesh=mesh,
        in_specs=("d", "(dp n) d"),
        out_specs=("d", "d"),
    )
    with fs.count_collectives() as counts:
        got, want = f1(w, x)
    close(errs, "func.grad psum", got, x.sum(0), dt)
    close(errs, "autograd psum", want, x.sum(0), dt)
    check_counts(
        errs,
        "func.grad psum (+ autograd)",
        counts,
        Counter({("all_reduce", ("dp",), 8): 2, ("all_reduce", ("dp",), 24): 2}),
    )
    # vjp through psum
    ct = randn(5, 2, 3, dtype=dt)
    f2 = fs.shard_map(
        lambda w, x, ct: both(lambda w: fs.psum(w * x, "dp"), w, ct),
        mesh=mesh,
        in_specs=("d", "(dp n) d", "m d"),
        out_specs=("d", "d"),
    )
    got, want = f2(w, x, ct)
    ref = (ct * x.view(n, 2, 3).sum(0)).sum(0)
    close(errs, "func.vjp psum", got, ref, dt)
    close(errs, "autograd psum vjp", want, ref, dt)
    # all_gather: invariant result (local slice backward) and varying result (reduce_scatter)
    f3 = fs.shard_map(
        lambda ws, c: (
            both(lambda ws: (fs.all_gather(ws, "dp", tiled=True, invariant=True) * c).sum(), ws)
            + both(lambda ws: fs.psum((fs.all_gather(ws, "dp", tiled=True) * c).sum(), "dp"), ws)
        ),
        mesh=mesh,
        in_specs=("(dp n)", "n"),
        out_specs=("(dp n)",) * 4,
    )
    g_inv, a_inv, g_var, a_var = (full(t) for t in f3(ws, c))
    close(errs, "func.grad all_gather(invariant)", g_inv, c, dt)
    close(errs, "autograd all_gather(invariant)", a_inv, c, dt)
    # psum of the (identical) per-rank sums is n times the sum: gradient n * c
    close(errs, "func.grad all_gather", g_var, n * c, dt)
    close(errs, "autograd all_gather", a_var, n * c, dt)
    # psum_scatter: the vjp is an all_gather of the cotangent, so every rank's gradient is the whole ct
    v = randn(6, n * 4, 3, dtype=dt)  # local (4, 3) per rank; psum_scatter keeps a (2, 3) block
    ct4 = randn(7, n * 2, 3, dtype=dt)
    f4 = fs.shard_map(
        lambda v, ct: both(lambda v: fs.psum_scatter(v, "dp", dim=0, tiled=True), v, ct),
        mesh=mesh,
        in_specs=("(dp r) c", "(dp q) c"),
        out_specs=("(dp r) c", "(dp r) c"),
    )
    got, want = (full(t) for t in f4(v, ct4))
    close(errs, "func.vjp psum_scatter", got, ct4.repeat(n, 1), dt)
    close(errs, "autograd psum_scatter", want, ct4.repeat(n, 1), dt)
    # all_to_all: a relayout of the same global tensor, so the global gradient is the cotangent
    xa = randn(8, 2, 4, 4, dtype=dt)  # (b, s, h): s split over dp going in, h split coming out
    cta = randn(9, 2, 4, 4, dtype=dt)
    f5 = fs.shard_map(
        lambda x, ct: both(lambda x: fs.all_to_all(x, "dp", split_dim=2, concat_dim=1), x, ct),
        mesh=mesh,
        in_specs=("b (dp s) h", "b s (dp h)"),
        out_specs=("b (dp s) h",) * 2,
    )
    got, want = (full(t) for t in f5(xa, cta))
    close(errs, "func.vjp all_to_all", got, cta, dt)
    close(errs, "autograd all_to_all", want, cta, dt)
    # ppermute ring shift by one: grad of block i is the cotangent of block i + 1
    xp, ctp = randn(10, n * 2, 3, dtype=dt), randn(11, n * 2, 3, dtype=dt)
    ring = [(i, (i + 1) % n) for i in range(n)]
    f6 = fs.shard_map(
        lambda x, ct: both(lambda x: fs.ppermute(x, "dp", ring), x, ct),
        mesh=mesh,
        in_specs=("(dp r) c", "(dp r) c"),
        out_specs=("(dp r) c",) * 2,
    )
    got, want = (full(t) for t in f6(xp, ctp))
    ref = ctp.view(n, 2, 3).roll(-1, 0).reshape(n * 2, 3)
    close(errs, "func.vjp ppermute", got, ref, dt)
    close(errs, "autograd ppermute", want, ref, dt)
    return errs


def test_torch_func_inside_shard_map():
    assert_ok(run_ranks(2, _torch_func_inside))


# -- collectives on invariant values, pmax, pbroadcast ----------------------------------------


def _invariant_and_extrema():
    import fshard as fs

    errs: list[str] = []
    dt = torch.float64
    mesh = fs.Mesh(dp=2, tp=2)
    x = randn(1, 3, dtype=dt)

    # psum of an invariant value is x * axis size (by definition), and so is its gradient
    def inv(x):
        a = fs.psum(x, "dp")
        b = fs.pmean(x, ("dp", "tp"))
        return a, b

    f = fs.shard_map(inv, mesh=mesh, in_specs=("d",), out_specs=("d", "d"))
    xg = x.clone().requires_grad_(True)
    with fs.count_collectives() as counts:
        a, b = f(xg)
        (a.sum() + b.sum()).backward()
    close(errs, "psum(invariant)", a, 2 * x, dt)
    close(errs, "pmean(invariant)", b, x, dt)
    close(errs, "grad psum+pmean of invariant", xg.grad, torch.full_like(x, 3.0), dt)
    check_counts(errs, "invariant psum/pmean", counts, Counter())

    # pmax over a split value, with a tie: the cotangent is split evenly among the holders
    v = torch.tensor([[1.0, 5.0, 2.0], [3.0, 5.0, 0.0]], dtype=dt)  # rows split over dp; column 1 ties
    fm = fs.shard_map(lambda v: fs.pmax(v, "dp"), mesh=mesh, in_specs=("(dp r) c",), out_specs="r c")
    vg = v.clone().requires_grad_(True)
    out = fm(vg)
    ct = torch.tensor([[1.0, 2.0, 3.0]], dtype=dt)
    out.backward(ct)
    vr = v.clone().requires_grad_(True)
    ref = vr.amax(0, keepdim=True)
    ref.backward(ct)
    close(errs, "pmax value", out, ref, dt)
    close(errs, "pmax grad", vg.grad, vr.grad, dt)

    # pbroadcast: every index gets index src's block; the cotangent goes back to src only
    fb = fs.shard_map(
        lambda v: fs.pbroadcast(v, "dp", src=1), mesh=mesh, in_specs=("(dp r) c",), out_specs="r c"
    )
    vg = v.clone().requires_grad_(True)
    out = fb(vg)
    out.backward(ct)
    close(errs, "pbroadcast value", out, v[1:], dt)
    close(errs, "pbroadcast grad", vg.grad, torch.cat([torch.zeros_like(ct), ct]), dt)
    return errs


def test_invariant_collectives_pmax_pbroadcast():
    assert_ok(run_ranks(4, _invariant_and_extrema))
