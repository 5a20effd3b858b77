"""torch.func transforms through the rest of fshard: fs.remat, fs.fsdp_scan, fs.switch / fs.PerRank,
Sharded inputs, fs.shard / .full() / reshard, fs.value_and_grad; and the varying axes of a dual.

Each program runs on real gloo ranks over 1-, 2- and 3-axis meshes (2, 4 and 8 ranks), with uneven
blocks, and is compared with the same transform of the global function by plain torch in one
process. Under vmap the collectives are counted: a batch of B moves in the collectives of one call
(the count is that of the same program without vmap). The table in
docs/tutorial/08-transforms.md lists what these tests check.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch
from torch.func import grad, grad_and_value, jacfwd, jacrev, jvp, vmap

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, randn

DT = torch.float64

# mesh shapes by world size; the batch is split over every axis, cut unevenly (rows % ranks != 0)
MESHES = {2: {"dp": 2}, 4: {"dp": 2, "pp": 2}, 8: {"dp": 2, "tp": 2, "pp": 2}}
ROWS = {2: 5, 4: 6, 8: 10}


def _kinds(counts) -> Counter:
    return Counter((kind, axes) for kind, axes, _ in counts.records)


def _same_counts(errs, what, batched, single):
    """Under vmap the whole batch moves in the collectives of one call."""
    if _kinds(batched) != _kinds(single):
        errs.append(
            f"{what}: under vmap {sorted(_kinds(batched).items())}, one call {sorted(_kinds(single).items())}"
        )


def _layer(x, w):
    return torch.tanh(x @ w)


def _loss_ref(w, x):
    return (_layer(x, w) ** 2).sum()


def _constructs(n: int):
    """remat, fsdp_scan, shard / full / reshard, Sharded inputs and fs.value_and_grad under vmap,
    jvp and grad, on a mesh of ``n`` ranks with the batch cut unevenly over all its axes."""
    import torch.distributed as dist

    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(**MESHES[n])
    axes = tuple(mesh.axis_names)
    batch = f"({' '.join(axes)} b) d"
    x = randn(1, ROWS[n], 4, dtype=DT)
    w, v = randn(2, 4, 3, dtype=DT), randn(3, 4, 3, dtype=DT)
    ens = randn(4, 3, 4, 3, dtype=DT)  # an ensemble of 3 replicated weights

    # -- fs.remat: transforms of f and inside f
    lay = fs.remat(_layer)
    loss = fs.shard_map(
        lambda w, x: fs.psum((lay(x, w) ** 2).sum(), axes), mesh=mesh, in_specs=("d h", batch), out_specs=""
    )
    with fs.count_collectives() as c1:
        g1 = grad(lambda w: loss(w, x))(w)
    close(errs, "remat grad", g1, grad(_loss_ref)(w, x), DT)
    with fs.count_collectives() as c:
        gs, ls = vmap(grad_and_value(lambda w: loss(w, x)))(ens)
    rg, rl = vmap(grad_and_value(_loss_ref), in_dims=(0, None))(ens, x)
    close(errs, "remat vmap(grad_and_value) values", ls, rl, DT)
    close(errs, "remat vmap(grad_and_value) grads", gs, rg, DT)
    _same_counts(errs, "remat vmap(grad)", c, c1)
    got, want = jvp(lambda w: loss(w, x), (w,), (v,)), jvp(lambda w: _loss_ref(w, x), (w,), (v,))
    close(errs, "remat jvp tangent", got[1], want[1], DT)
    close(errs, "remat jacrev", jacrev(lambda w: loss(w, x))(w), jacrev(_loss_ref)(w, x), DT)
    close(errs, "remat jacfwd", jacfwd(lambda w: loss(w, x))(w), jacrev(_loss_ref)(w, x), DT)

    def per_example(w, x):  # inside f: per-example gradients through a remat'd layer
        return vmap(grad(lambda w, xi: (lay(xi, w) ** 2).sum()), in_dims=(None, 0))(fs.pvary(w, axes), x)

    got = fs.shard_map(
        per_example, mesh=mesh, in_specs=("d h", batch), out_specs=f"({' '.join(axes)} b) d h"
    )(w, x).full()
    close(
        errs,
        "remat per-example grads inside f",
        got,
        vmap(grad(lambda w, xi: (_layer(xi, w) ** 2).sum()), in_dims=(None, 0))(w, x),
        DT,
    )

    # -- fs.fsdp_scan: 2 layers split over dp (5 rows: uneven), the batch over every axis
    l0, l1, t0 = randn(5, 5, 4, dtype=DT), randn(6, 4, 5, dtype=DT), randn(7, 5, 4, dtype=DT)
    xf = randn(8, ROWS[n], 5, dtype=DT)

    def scan_loss(ls, x):
        h = fs.fsdp_scan(lambda p, h: torch.tanh(h @ p["w"]), ls, x, "dp", dims=0)
        return fs.psum((h**2).sum(), axes)

    def scan_ref(l0, x):
        return (torch.tanh(torch.tanh(x @ l0) @ l1) ** 2).sum()

    sl = fs.shard_map(
        scan_loss, mesh=mesh, in_specs=([{"w": "(dp _) _"}] * 2, f"({' '.join(axes)} b) d"), out_specs=""
    )

    def scan_of(l0):
        return sl([{"w": l0}, {"w": l1}], xf)

    with fs.count_collectives() as c1:
        g1 = grad(scan_of)(l0)
    close(errs, "fsdp_scan grad", g1, grad(scan_ref)(l0, xf), DT)
    e0 = torch.stack([l0, t0, l0 - t0])
    with fs.count_collectives() as c:
        gs = vmap(grad(scan_of))(e0)
    close(errs, "fsdp_scan vmap(grad)", gs, vmap(grad(scan_ref), in_dims=(0, None))(e0, xf), DT)
    _same_counts(errs, "fsdp_scan vmap(grad)", c, c1)
    got, want = jvp(scan_of, (l0,), (t0,)), jvp(lambda w: scan_ref(w, xf), (l0,), (t0,))
    close(errs, "fsdp_scan jvp primal", got[0], want[0], DT)
    close(errs, "fsdp_scan jvp tangent", got[1], want[1], DT)
    close(errs, "fsdp_scan jacfwd", jacfwd(scan_of)(l0), g1, DT)

    # -- fs.shard / .full() / reshard outside shard_map, and a Sharded input, under vmap and jvp
    wide = randn(9, 5, 6, dtype=DT)  # 5 rows over dp: uneven
    wb = torch.stack([wide, 2 * wide, -wide])

    def moved(w):
        return fs.shard(w, mesh, "(dp r) c").reshard(f"r ({axes[-1]} c)").full()

    with fs.count_collectives() as c1:
        moved(wide)
    with fs.count_collectives() as c:
        got = vmap(moved)(wb)
    close(errs, "shard / reshard / full under vmap", got, wb, DT)
    _same_counts(errs, "shard / reshard / full under vmap", c, c1)
    got = jvp(moved, (wide,), (wb[2],))
    close(errs, "shard / reshard / full jvp tangent", got[1], wb[2], DT)
    # the gradient reaches this rank's block of the global tensor (as in eager autograd): summed over
    # the ranks, each block once per copy (the ranks along the axes other than dp hold copies)
    got = grad(lambda w: (moved(w) ** 2).sum())(wide)
    leaf = wide.clone().requires_grad_(True)
    (eager,) = torch.autograd.grad((moved(leaf) ** 2).sum(), leaf)
    close(errs, "shard / reshard / full grad (as eager autograd)", got, eager, DT)
    total = got.clone()
    dist.all_reduce(total)
    close(errs, "shard / reshard / full grad (summed over ranks)", total / (n // 2), 2 * wide, DT)
    S = fs.shard(wide, mesh, "(dp r) c")
    fS = fs.shard_map(
        lambda s, x: fs.pmean(torch.sin(x @ s).sum(), axes), mesh=mesh, in_specs=("r c", batch), out_specs=""
    )
    xs = randn(10, ROWS[n], 5, dtype=DT)
    xsb = torch.stack([xs, xs * 0.5])
    with fs.count_collectives() as c1:
        fS(S, xs)
    with fs.count_collectives() as c:
        got = vmap(lambda x: fS(S, x))(xsb)
    close(errs, "Sharded input, vmap over data", got, vmap(lambda x: torch.sin(x @ wide).sum() / n)(xsb), DT)
    _same_counts(errs, "Sharded input, vmap over data", c, c1)
    got = jvp(lambda x: fS(S, x), (xs,), (xs * 0.5,))
    want = jvp(lambda x: torch.sin(x @ wide).sum() / n, (xs,), (xs * 0.5,))
    close(errs, "Sharded input, jvp tangent", got[1], want[1], DT)

    # -- check=False: a varying output taken as replicated (its cotangent divided by the copies)
    unchecked = fs.shard_map(
        lambda w, x: (_layer(x[:1], w) ** 2).sum() * 0 + (w**2).sum(),
        mesh=mesh,
        in_specs=("d h", batch),
        out_specs="",
        check=False,
    )
    with fs.count_collectives() as c1:
        grad(lambda w: unchecked(w, x))(w)
    with fs.count_collectives() as c:
        got = vmap(grad(lambda w: unchecked(w, x)))(ens)
    close(errs, "check=False vmap(grad)", got, 2 * ens, DT)
    _same_counts(errs, "check=False vmap(grad)", c, c1)
    close(
        errs, "check=False jvp tangent", jvp(lambda w: unchecked(w, x), (w,), (v,))[1], 2 * (w * v).sum(), DT
    )

    # -- fs.value_and_grad under vmap: an ensemble, of f and inside f; a Sharded parameter
    with fs.count_collectives() as c1:
        fs.value_and_grad(lambda w: loss(w, x))(w)
    with fs.count_collectives() as c:
        ls, gs = vmap(fs.value_and_grad(lambda w: loss(w, x)))(ens)
    close(errs, "vmap(fs.value_and_grad) of f, values", ls, rl, DT)
    close(errs, "vmap(fs.value_and_grad) of f, grads", gs, rg, DT)
    _same_counts(errs, "vmap(fs.value_and_grad) of f", c, c1)
    (ls, aux), gs = vmap(fs.value_and_grad(lambda w: (loss(w, x), w.sum()), has_aux=True))(ens)
    close(errs, "vmap(fs.value_and_grad(has_aux)) aux", aux, ens.sum((1, 2)), DT)
    got = jvp(lambda w: fs.grad(lambda w: loss(w, x))(w), (w,), (v,))  # forward over reverse: an hvp
    close(errs, "jvp(fs.grad) (hvp)", got[1], jvp(lambda w: grad(_loss_ref)(w, x), (w,), (v,))[1], DT)

    def ens_inside(e, x):
        return vmap(fs.value_and_grad(lambda w: fs.psum((_layer(x, w) ** 2).sum(), axes)))(e)

    got = fs.shard_map(ens_inside, mesh=mesh, in_specs=("e d h", batch), out_specs=("e", "e d h"))(ens, x)
    close(errs, "vmap(fs.value_and_grad) inside f, values", got[0], rl, DT)
    close(errs, "vmap(fs.value_and_grad) inside f, grads", got[1], rg, DT)

    def sharded_grad(w):  # a Sharded leaf: its gradient comes back Sharded, in its layout
        _, g = fs.value_and_grad(lambda s: fS(s, xs))(fs.shard(w, mesh, "(dp r) c"))
        return g.full()

    got = vmap(sharded_grad)(wb)
    close(
        errs,
        "vmap(fs.value_and_grad) of a Sharded leaf",
        got,
        vmap(grad(lambda w: torch.sin(xs @ w).sum() / n))(wb),
        DT,
    )
    return errs


def _stages(n: int):
    """fs.switch over PerRank stage parameters: vmap, jvp and vmap(grad) of f and inside f."""
    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(**MESHES[n]) if n > 2 else fs.Mesh(pp=2)
    other = tuple(a for a in mesh.axis_names if a != "pp")
    ws = [randn(1, 4, 4, dtype=DT), randn(2, 4, 4, dtype=DT)]
    P = fs.PerRank.build(mesh, "pp", [lambda: ws[0], lambda: ws[1]])

    def branches():
        return [lambda w, x: torch.tanh(x @ w), lambda w, x: torch.sin(x @ w)]

    def body(p, x):
        y = fs.switch(fs.axis_index("pp"), branches(), p, x)
        return fs.psum((y**2).sum(), "pp")

    spec = f"({' '.join(other)} b) d" if other else "b d"
    f = fs.shard_map(
        lambda p, x: fs.pmean(body(p, x), other) if other else body(p, x),
        mesh=mesh,
        in_specs=(None, spec),
        out_specs="",
    )
    size = 1
    for a in other:
        size *= mesh.shape[a]

    def ref(x):
        return ((torch.tanh(x @ ws[0]) ** 2).sum() + (torch.sin(x @ ws[1]) ** 2).sum()) / size

    x, t = randn(3, ROWS[n], 4, dtype=DT), randn(4, ROWS[n], 4, dtype=DT)
    xb = torch.stack([x, t, x - t])
    close(errs, "switch jvp tangent", jvp(lambda x: f(P, x), (x,), (t,))[1], jvp(ref, (x,), (t,))[1], DT)
    with fs.count_collectives() as c1:
        grad(lambda x: f(P, x))(x)
    with fs.count_collectives() as c:
        got = vmap(grad(lambda x: f(P, x)))(xb)
    close(errs, "switch vmap(grad) over inputs", got, vmap(grad(ref))(xb), DT)
    _same_counts(errs, "switch vmap(grad)", c, c1)
    got = vmap(lambda x: f(P, x))(xb)
    close(errs, "switch vmap", got, vmap(ref)(xb), DT)

    def per_stage_jvp(p, x, t):  # inside f: jvp through the switch w.r.t. the stage parameters
        def stage_loss(p):
            return (fs.switch(fs.axis_index("pp"), branches(), p, x) ** 2).sum()

        tangent = jvp(stage_loss, (p,), (t,))[1]
        return fs.pmean(fs.psum(tangent, "pp"), other) if other else fs.psum(tangent, "pp")

    T = fs.PerRank.build(mesh, "pp", [lambda: ws[1], lambda: ws[0]])  # a tangent per stage
    got = fs.shard_map(per_stage_jvp, mesh=mesh, in_specs=(None, "b d", None), out_specs="")(P, x, T)
    want = (
        jvp(lambda w: (torch.tanh(x @ w) ** 2).sum(), (ws[0],), (ws[1],))[1]
        + jvp(lambda w: (torch.sin(x @ w) ** 2).sum(), (ws[1],), (ws[0],))[1]
    )
    close(errs, "switch jvp inside f w.r.t. PerRank parameters", got, want, DT)
    return errs


def _duals(n: int):
    """A dual whose tangent varies more than its primal (an invariant parameter, a tangent made from
    split data) varies like its tangent: a psum of the tangent sums it over the ranks (not the axis
    size times this rank's), and the replication check refuses it as a replicated output."""
    import torch.autograd.forward_ad as fwAD

    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(**MESHES[n])
    axes = tuple(mesh.axis_names)
    x, w = randn(11, 2 * n, 3, dtype=DT), randn(12, 3, dtype=DT)
    want = x.view(n, 2, 3)[:, 0].sum(0)  # the first row of every rank's block, summed
    specs = dict(mesh=mesh, in_specs=(f"({' '.join(axes)} b) d", "d"))

    def through_jvp(x, w):
        return jvp(lambda w: fs.psum(w * 1.0, axes), (w,), (x[0],))[1]

    def through_forward_ad(x, w):
        with fwAD.dual_level():
            return fwAD.unpack_dual(fs.psum(fwAD.make_dual(w, x[0]) * 1.0, axes)).tangent

    def jvp_of_collective(x, w):  # the tangent meets the collective directly
        return jvp(lambda w: fs.psum(w, axes), (w,), (x[0],))[1]

    for fn in (through_jvp, through_forward_ad, jvp_of_collective):
        close(
            errs,
            f"psum of a varying tangent ({fn.__name__})",
            fs.shard_map(fn, **specs, out_specs="d")(x, w),
            want,
            DT,
        )
    msgs = []
    for fn in (
        lambda x, w: jvp(lambda w: w * 2.0, (w,), (x[0],))[1],
        lambda x, w: jvp(lambda w: w, (w,), (x[0],))[1],
    ):
        fn.__name__ = fn.__qualname__ = "f"
        try:
            fs.shard_map(fn, **specs, out_specs="d")(x, w)
            msgs.append("no error")
        except fs.SpecError as e:
            msgs.append(str(e))
    return errs, msgs


def _refusals():
    """Transfers to or from one rank under a transform: an ArgumentError on every rank, before any
    communication, naming the construct, the transform and the fix."""
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    w = randn(1, 5, 3, dtype=DT)
    progs = [
        lambda: vmap(lambda w: fs.shard(w, mesh, "(dp r) c", src=0).full())(torch.stack([w, w])),
        lambda: jvp(lambda w: fs.shard(w, mesh, "(dp r) c").full(dst=0), (w,), (w,)),
        lambda: vmap(lambda w: fs.full({"w": fs.shard(w, mesh, "(dp r) c")}, dst=1)["w"])(
            torch.stack([w, w])
        ),
        lambda: grad(lambda w: fs.reduce_to(w.sum(), mesh))(w),
    ]
    msgs, slowest = [], 0.0
    for prog in progs:
        t0 = time.monotonic()
        try:
            prog()
            msgs.append("no error")
        except fs.ArgumentError as e:
            msgs.append(str(e))
        slowest = max(slowest, time.monotonic() - t0)
    return msgs, slowest


def _job(n: int):
    errs = _constructs(n) + _stages(n)
    more, msgs = _duals(n)
    return errs + more, msgs, _refusals() if n == 2 else None


REPLICATED = (
    "fs.shard_map(f): 1 problem with out_specs (replication check):\n"
    "  - out varies over mesh axis dp but out_spec 'd' says it is replicated over dp; reduce it inside f "
    "(fs.psum / fs.pmean over 'dp'), mark it as a partial sum with '| sum(dp)', split a dim over dp in the "
    "out_spec, or pass check=False if you know it is the same on every rank"
)


REFUSALS = [
    "fs.shard(src=0) under torch.func.vmap: the scatter from rank 0 has no batching or forward-mode rule; call "
    "fs.shard without src (every rank passes the global tensor and keeps its block: no communication), or outside "
    "the transform",
    "Sharded.full(dst=0) under torch.func.jvp (forward mode: jvp, jacfwd, hessian): the gather to rank 0 is not "
    "differentiable and has no batching rule; call .full() inside the transform (every rank gets the value), and "
    ".full(dst=0) on the transform's result",
    "fs.full(tree, dst=1) under torch.func.vmap: the gather to rank 1 is not differentiable and has no batching "
    "rule; call fs.full(tree) inside the transform (every rank gets the values), and fs.full(..., dst=1) on the "
    "transform's result",
    "fs.reduce_to under torch.func.grad (reverse mode: grad, vjp, jacrev): the sum onto one rank is not "
    "differentiable and has no batching rule; call it on the transform's result, or sum inside fs.shard_map with "
    "fs.psum",
]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_constructs_under_transforms(n):
    """remat, fsdp_scan, switch / PerRank, Sharded boundaries, fs.value_and_grad and duals on 1-, 2-
    and 3-axis meshes; on 2 ranks also the refusals, with their full messages."""
    results = run_ranks(n, _job, n)
    assert_ok([errs for errs, _, _ in results])
    if n == 2:
        want = [REPLICATED] * 2
        for _, msgs, refusals in results:
            assert msgs == want
            msgs, slowest = refusals
            assert msgs == REFUSALS
            assert slowest < 10, f"a refusal took {slowest:.1f} s: it waited for the other ranks"
    else:  # the same refusal, naming every axis
        for _, msgs, _ in results:
            assert all(
                m.startswith("fs.shard_map(f): 1 problem with out_specs (replication check)") for m in msgs
            ), msgs


# -- forward-mode AD (torch.autograd.forward_ad) through the implicit cast of an unbucketed input ----


def _rank_forward_ad_unbucketed(W, X, T):
    import torch.autograd.forward_ad as fwAD

    import fshard as fs

    mesh = fs.Mesh(dp=2)

    def f(w, x):
        return fs.psum(torch.tanh(x @ w).sum(), "dp")

    out = {}
    for bucket_mb in (0, 25.0):  # without buckets the cast names its input (PvaryInput); with them a twin
        sm = fs.shard_map(f, mesh=mesh, in_specs=("...", "(dp b) d"), out_specs="", bucket_mb=bucket_mb)
        with fwAD.dual_level():
            y = sm(fwAD.make_dual(W.clone().requires_grad_(True), T), X)  # (grad too: the cast is made)
            out[f"tangent {bucket_mb}"] = fwAD.unpack_dual(y).tangent
        w = W.clone().requires_grad_(True)
        sm(w, X).backward()
        out[f"grad {bucket_mb}"] = w.grad
    return out


def test_forward_ad_and_gradients_through_an_unbucketed_input_cast_match_one_process():
    W, X, T = randn(0, 4, 3), randn(1, 8, 4), randn(2, 4, 3)
    w = W.clone().requires_grad_(True)
    ref = torch.tanh(X @ w).sum()
    (grad_ref,) = torch.autograd.grad(ref, w)
    tangent_ref = (grad_ref * T).sum()  # the directional derivative along T
    for r, out in enumerate(run_ranks(2, _rank_forward_ad_unbucketed, W, X, T)):
        for bucket_mb in (0, 25.0):
            torch.testing.assert_close(out[f"tangent {bucket_mb}"], tangent_ref, msg=f"rank {r} {bucket_mb}")
            torch.testing.assert_close(out[f"grad {bucket_mb}"], grad_ref, msg=f"rank {r} {bucket_mb}")
