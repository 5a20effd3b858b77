"""torch.func transforms through shard_map and its collectives: jvp, vmap, jacrev, jacfwd, hessian.

Each check runs a transform of (or inside) a shard_map'd function on real gloo ranks and compares
it with the same transform of the global function by plain torch in one process; under vmap the
collectives are counted (one per batch, not one per batch element). Tracking stays sound: a
value computed by a transform inside f varies like what it was computed from, so the replication
check still refuses it as a replicated output. Rank functions return their lists of problems
(see helpers.py).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.func import grad, grad_and_value, hessian, jacfwd, jacrev, jvp, vmap

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, randn

DT = torch.float64


def _kinds(counts) -> Counter:
    return Counter(kind for kind, _, _ in counts.records)


def _want(errs, what, counts, **kinds):
    got = _kinds(counts)
    if got != Counter(kinds):
        errs.append(f"{what}: collectives {dict(got)}, want {kinds}")


def _mlp(x, w1, w2):
    return torch.tanh(x @ w1) @ w2


def _one_axis():
    """2 ranks, 1-axis meshes: every collective under jvp and vmap, transforms of f and inside f."""
    import torch.autograd.forward_ad as fwAD

    import fshard as fs

    errs: list[str] = []
    tp, dp = fs.Mesh(tp=2), fs.Mesh(dp=2)
    x, w1, w2, t1 = (
        randn(1, 4, 6, dtype=DT),
        randn(2, 6, 8, dtype=DT),
        randn(3, 8, 5, dtype=DT),
        randn(4, 6, 8, dtype=DT),
    )

    # -- tensor-parallel MLP (psum): jvp, vmap, jacrev, jacfwd, of f and inside f
    def tp_mlp(x, w1, w2):
        return fs.psum(_mlp(x, w1, w2), "tp")

    f = fs.shard_map(tp_mlp, mesh=tp, in_specs=("b d", "d (tp h)", "(tp h) o"), out_specs="b o")
    want = jvp(lambda w: _mlp(x, w, w2), (w1,), (t1,))
    got = jvp(lambda w: f(x, w, w2), (w1,), (t1,))
    close(errs, "tp jvp primal", got[0], want[0], DT)
    close(errs, "tp jvp tangent", got[1], want[1], DT)

    def inside(x, w1, w2, t1):
        return jvp(lambda w: tp_mlp(x, w, w2), (w1,), (t1,))

    g = fs.shard_map(
        inside, mesh=tp, in_specs=("b d", "d (tp h)", "(tp h) o", "d (tp h)"), out_specs=("b o", "b o")
    )
    got = g(x, w1, w2, t1)
    close(errs, "tp jvp inside f, primal", got[0], want[0], DT)
    close(errs, "tp jvp inside f, tangent", got[1], want[1], DT)

    xb = randn(5, 3, 4, 6, dtype=DT)
    with fs.count_collectives() as c:
        got = vmap(f, in_dims=(0, None, None))(xb, w1, w2)
    close(errs, "tp vmap over inputs", got, _mlp(xb, w1, w2), DT)
    _want(errs, "tp vmap over inputs", c, all_reduce=1)
    if c.records and c.records[0][2] != 3 * 4 * 5 * 8:
        errs.append(
            f"tp vmap: the all-reduce moved {c.records[0][2]} bytes, want the whole batch {3 * 4 * 5 * 8}"
        )

    jr = jacrev(lambda w: _mlp(x, w, w2))(w1)
    close(errs, "tp jacrev", jacrev(lambda w: f(x, w, w2))(w1), jr, DT)
    close(errs, "tp jacfwd", jacfwd(lambda w: f(x, w, w2))(w1), jr, DT)
    close(
        errs,
        "tp jacfwd(jacrev) wrt w2",
        jacfwd(jacrev(lambda w: f(x, w1, w).sum()))(w2),
        jacfwd(jacrev(lambda w: _mlp(x, w1, w).sum()))(w2),
        DT,
    )

    # -- data-parallel loss: ensembles, per-example gradients inside f, hessian, jvp(grad)
    w, xs, v = randn(5, 3, dtype=DT), randn(6, 4, 3, dtype=DT), randn(7, 3, dtype=DT)

    def loss_ref(w, x):
        return (torch.tanh(x @ w) ** 2).mean()

    loss = fs.shard_map(
        lambda w, x: fs.pmean(loss_ref(w, x), "dp"), mesh=dp, in_specs=("d", "(dp b) d"), out_specs=""
    )
    ens = randn(8, 7, 3, dtype=DT)  # an ensemble of 7 replicated parameter vectors
    with fs.count_collectives() as c:
        gs, ls = vmap(grad_and_value(lambda w: loss(w, xs)))(ens)
    rg, rl = vmap(grad_and_value(lambda w: loss_ref(w, xs)))(ens)
    close(errs, "ensemble losses", ls, rl, DT)
    close(errs, "ensemble gradients", gs, rg, DT)
    _want(errs, "ensemble (the loss, the gradient's psum)", c, all_reduce=2)

    close(
        errs,
        "hessian of a dp loss",
        hessian(lambda w: loss(w, xs))(w),
        hessian(lambda w: loss_ref(w, xs))(w),
        DT,
    )
    got = jvp(grad(lambda w: loss(w, xs)), (w,), (v,))
    want = jvp(grad(lambda w: loss_ref(w, xs)), (w,), (v,))
    close(errs, "jvp(grad) (forward-over-reverse hvp)", got[1], want[1], DT)

    def example_loss(w, xi):
        return torch.tanh(xi @ w) ** 2

    ref = vmap(grad(example_loss), in_dims=(None, 0))(w, xs)  # [4, 3]

    def per_example(w, x):  # invariant w: each example's gradient is summed over dp (as in JAX)
        return vmap(grad(example_loss), in_dims=(None, 0))(w, x)

    def per_example_local(w, x):  # pvary first: this rank's own per-example gradients
        return vmap(grad(example_loss), in_dims=(None, 0))(fs.pvary(w, "dp"), x)

    with fs.count_collectives() as c:
        got = fs.shard_map(per_example, mesh=dp, in_specs=("d", "(dp b) d"), out_specs="b d")(w, xs)
    close(errs, "per-example grads of an invariant w", got, ref[:2] + ref[2:], DT)
    _want(errs, "per-example grads of an invariant w", c, all_reduce=1)
    with fs.count_collectives() as c:
        got = fs.shard_map(per_example_local, mesh=dp, in_specs=("d", "(dp b) d"), out_specs="(dp b) d")(
            w, xs
        ).full()
    close(errs, "per-example grads after pvary", got, ref, DT)
    _want(errs, "per-example grads after pvary (only .full())", c, all_gather=1)

    x32 = xs.float()  # pmean of a 0-dim float32 value keeps a float32 tangent
    got = jvp(
        fs.shard_map(lambda x: fs.pmean(x.sum(), "dp"), mesh=dp, in_specs="(dp b) d", out_specs=""),
        (x32,),
        (x32,),
    )
    close(errs, "pmean jvp of a 0-dim float32", got[1], x32.sum() / 2)

    # -- FSDP all_gather (even and uneven) and psum_scatter (uneven) under jvp and vmap
    for rows in (6, 5):
        wf, tf = randn(9, rows, 4, dtype=DT), randn(10, rows, 4, dtype=DT)
        fsdp = fs.shard_map(
            lambda w, x: torch.tanh(x @ fs.all_gather(w, "dp", tiled=True)),
            mesh=dp,
            in_specs=("(dp d) h", "(dp b) d"),
            out_specs="(dp b) h",
        )
        xf = randn(11, 4, rows, dtype=DT)
        want = jvp(lambda w, xf=xf: torch.tanh(xf @ w), (wf,), (tf,))
        got = jvp(lambda w, f=fsdp, xf=xf: f(w, xf).full(), (wf,), (tf,))
        close(errs, f"fsdp all_gather jvp ({rows} rows) primal", got[0], want[0], DT)
        close(errs, f"fsdp all_gather jvp ({rows} rows) tangent", got[1], want[1], DT)
        wb = randn(12, 3, rows, 4, dtype=DT)
        with fs.count_collectives() as c:
            got = vmap(lambda w, f=fsdp, xf=xf: f(w, xf).full())(wb)
        close(errs, f"fsdp all_gather vmap ({rows} rows)", got, torch.tanh(xf @ wb), DT)
        # the weight and .full(); uneven: + the all_gather's shape check and the output's shapes
        if _kinds(c)["all_gather"] != 2 + 2 * (rows % 2):
            errs.append(f"fsdp vmap ({rows} rows): {c.records}")

    xr = randn(13, 2, 5, 3, dtype=DT)  # dp blocks of rows summed, the 5 rows scattered 3 / 2
    rs = fs.shard_map(
        lambda x: fs.psum_scatter(x[0], "dp", dim=0, tiled=True),
        mesh=dp,
        in_specs="(dp k) n m",
        out_specs="(dp n) m",
    )
    xrb, trb = randn(14, 4, 2, 5, 3, dtype=DT), randn(15, 2, 5, 3, dtype=DT)
    with fs.count_collectives() as c:
        got = vmap(lambda x: rs(x).full())(xrb)
    close(errs, "psum_scatter (uneven) vmap", got, xrb.sum(1), DT)
    if _kinds(c)["reduce_scatter"] != 1:
        errs.append(f"psum_scatter vmap: {c.records}")
    got = jvp(lambda x: rs(x).full(), (xr,), (trb,))
    close(errs, "psum_scatter (uneven) jvp tangent", got[1], trb.sum(0), DT)

    # -- ppermute ring, all_to_all, pmax (ties), pbroadcast, coalesced pytrees, async
    ring = fs.shard_map(
        lambda x: x * fs.ppermute(x, "dp", [(0, 1), (1, 0)]),
        mesh=dp,
        in_specs="(dp b) d",
        out_specs="(dp b) d",
    )
    xp, tp_ = randn(16, 4, 3, dtype=DT), randn(17, 4, 3, dtype=DT)

    def ring_ref(x):
        return x * torch.cat([x[2:], x[:2]])

    got = jvp(lambda x: ring(x).full(), (xp,), (tp_,))
    want = jvp(ring_ref, (xp,), (tp_,))
    close(errs, "ppermute ring jvp tangent", got[1], want[1], DT)
    xpb = randn(18, 3, 4, 3, dtype=DT)
    with fs.count_collectives() as c:
        got = vmap(lambda x: ring(x).full())(xpb)
    close(errs, "ppermute ring vmap", got, vmap(ring_ref)(xpb), DT)
    _want(errs, "ppermute ring vmap", c, ppermute=1, all_gather=1)

    sp = fs.Mesh(sp=2)
    a2a = fs.shard_map(
        lambda q: torch.sin(fs.all_to_all(q, "sp", split_dim=2, concat_dim=1)),
        mesh=sp,
        in_specs="b (sp s) h d",
        out_specs="b s (sp h) d",
    )
    qb = randn(19, 3, 2, 4, 6, 2, dtype=DT)  # a batch of 3 (b s h d) inputs
    with fs.count_collectives() as c:
        got = vmap(lambda q: a2a(q).full())(qb)
    close(errs, "all_to_all vmap", got, torch.sin(qb), DT)
    _want(errs, "all_to_all vmap", c, all_to_all=1, all_gather=1)
    got = jvp(lambda q: a2a(q).full(), (qb[0],), (qb[1],))
    close(errs, "all_to_all jvp tangent", got[1], torch.cos(qb[0]) * qb[1], DT)

    xm = torch.tensor([[1.0, 5.0, 2.0], [3.0, 5.0, 0.0]], dtype=DT)  # a tie in column 1
    tm = randn(20, 2, 3, dtype=DT)
    pm = fs.shard_map(lambda x: fs.pmax(x[0], "dp"), mesh=dp, in_specs="(dp k) n", out_specs="n")
    got = jvp(pm, (xm,), (tm,))
    want = jvp(lambda x: torch.amax(x, 0), (xm,), (tm,))
    close(errs, "pmax jvp (ties averaged)", got[1], want[1], DT)
    close(errs, "pmax vmap", vmap(pm)(torch.stack([xm, -xm])), torch.stack([xm.amax(0), (-xm).amax(0)]), DT)
    bc = fs.shard_map(lambda x: fs.pbroadcast(x[0], "dp", 1), mesh=dp, in_specs="(dp k) n", out_specs="n")
    close(errs, "pbroadcast jvp tangent", jvp(bc, (xm,), (tm,))[1], tm[1], DT)
    close(errs, "pbroadcast vmap", vmap(bc)(torch.stack([xm, -xm])), torch.stack([xm[1], -xm[1]]), DT)

    tree = fs.shard_map(
        lambda a, b: fs.psum({"a": a[0] * 2, "b": torch.sin(b[0])}, "dp"),
        mesh=dp,
        in_specs=("(dp k) n", "(dp k) m"),
        out_specs={"a": "n", "b": "m"},
    )
    ab, bb = randn(21, 3, 2, 4, dtype=DT), randn(22, 2, 5, dtype=DT)
    with fs.count_collectives() as c:
        got = vmap(tree, in_dims=(0, None))(ab, bb)  # one batched and one unbatched leaf
    close(errs, "coalesced psum vmap (batched leaf)", got["a"], 2 * ab.sum(1), DT)
    close(errs, "coalesced psum vmap (unbatched leaf)", got["b"], torch.sin(bb).sum(0).expand(3, 5), DT)
    _want(errs, "coalesced psum vmap", c, all_reduce=1)
    got = jvp(lambda a, b: tree(a, b)["b"], (ab[0], bb), (ab[1], bb))
    close(errs, "coalesced psum jvp tangent", got[1], (torch.cos(bb) * bb).sum(0), DT)
    gtree = fs.shard_map(
        lambda a, b: fs.all_gather({"a": a, "b": b}, "dp", dim={"a": 0, "b": 1}, tiled=True, invariant=True),
        mesh=dp,
        in_specs=("(dp k) n", "m (dp j)"),
        out_specs={"a": "k n", "b": "m j"},
    )
    with fs.count_collectives() as c:
        got = vmap(gtree)(ab, torch.stack([bb.T] * 3))
    close(errs, "coalesced all_gather vmap", got["a"], ab, DT)
    close(errs, "coalesced all_gather vmap (dim 1)", got["b"], torch.stack([bb.T] * 3), DT)
    _want(errs, "coalesced all_gather vmap", c, all_gather=1)
    got = jvp(lambda a: gtree(a, bb.T)["a"], (ab[0],), (ab[1],))
    close(errs, "coalesced all_gather jvp tangent", got[1], ab[1], DT)

    agasync = fs.shard_map(
        lambda x: torch.sin(fs.all_gather(x, "dp", tiled=True, async_op=True).wait()),
        mesh=dp,
        in_specs="(dp b) d",
        out_specs="b d",
        check=False,
    )
    got = jvp(agasync, (xp,), (tp_,))
    close(errs, "async all_gather under jvp", got[1], torch.cos(xp) * tp_, DT)
    close(errs, "async all_gather under vmap", vmap(agasync)(xpb), torch.sin(xpb), DT)

    def dual(x, t):  # torch.autograd.forward_ad through an asynchronous all_gather's end
        with fwAD.dual_level():
            y = fs.all_gather(fwAD.make_dual(x, t), "dp", tiled=True, async_op=True).wait()
            return tuple(fwAD.unpack_dual(torch.sin(y)))

    got = fs.shard_map(
        dual, mesh=dp, in_specs=("(dp b) d", "(dp b) d"), out_specs=("b d", "b d"), check=False
    )(xp, tp_)
    close(errs, "forward_ad through async all_gather", got[1], torch.cos(xp) * tp_, DT)
    return errs


def _two_axis():
    """4 ranks, mesh dp x tp: per-example gradients of a tensor-parallel MLP inside a data-parallel
    shard_map, with the per-example norm summed over tp; jacfwd and vmap of the whole program."""
    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(dp=2, tp=2)
    x, w1, w2 = randn(1, 6, 4, dtype=DT), randn(2, 4, 8, dtype=DT), randn(3, 8, 3, dtype=DT)

    def example_loss(w1, xi, w2):
        return (fs.psum(_mlp(xi, w1, w2), "tp") ** 2).sum()

    def per_example(w1, x, w2):
        g = vmap(grad(example_loss), in_dims=(None, 0, None))(fs.pvary(w1, "dp"), x, w2)
        norms = fs.psum((g**2).sum((1, 2)), "tp").sqrt()  # each example's full gradient norm
        return g, norms

    def ref_loss(w1, xi):
        return (_mlp(xi, w1, w2) ** 2).sum()

    ref = vmap(grad(ref_loss), in_dims=(None, 0))(w1, x)
    f = fs.shard_map(
        per_example,
        mesh=mesh,
        in_specs=("d (tp h)", "(dp b) d", "(tp h) o"),
        out_specs=("(dp b) d (tp h)", "(dp b)"),
    )
    with fs.count_collectives() as c:
        g, norms = f(w1, x, w2)
        g, norms = g.full(), norms.full()
    close(errs, "2-axis per-example grads", g, ref, DT)
    close(errs, "2-axis per-example norms", norms, ref.flatten(1).norm(dim=1), DT)
    want = Counter({("all_reduce", ("tp",)): 2, ("all_gather", ("dp",)): 2, ("all_gather", ("tp",)): 1})
    got = Counter((k, a) for k, a, _ in c.records)
    if got != want:
        errs.append(f"2-axis per-example: collectives {sorted(got.items())}, want {sorted(want.items())}")

    mlp = fs.shard_map(
        lambda x, w1, w2: fs.psum(_mlp(x, w1, w2), "tp"),
        mesh=mesh,
        in_specs=("(dp b) d", "d (tp h)", "(tp h) o"),
        out_specs="(dp b) o",
    )
    close(
        errs,
        "2-axis jacfwd",
        jacfwd(lambda w: mlp(x, w, w2).full())(w1),
        jacrev(lambda w: _mlp(x, w, w2))(w1),
        DT,
    )
    xb = randn(4, 3, 5, 4, dtype=DT)  # 5 rows: uneven blocks over dp
    with fs.count_collectives() as c:
        got = vmap(lambda x: mlp(x, w1, w2).full())(xb)
    close(errs, "2-axis vmap, uneven blocks", got, _mlp(xb, w1, w2), DT)
    if _kinds(c)["all_reduce"] != 1:
        errs.append(f"2-axis vmap: {c.records}")
    return errs


def _escapes():
    """A value computed by vmap or jvp inside f varies like its inputs: the replication check
    refuses it as a replicated output, with its usual message."""
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    x, w = randn(1, 4, 3, dtype=DT), randn(2, 3, dtype=DT)
    msgs = []
    progs = {
        "vmap": (lambda x, w: vmap(lambda r: (r * w).sum())(x), "b"),
        "vmap then an op": (lambda x, w: vmap(torch.sin)(x) * 2, "b d"),
        "jvp tangent": (lambda x, w: jvp(lambda w: (x @ w).sum(), (w,), (torch.ones_like(w),))[1], ""),
    }
    for name, (fn, spec) in progs.items():
        fn.__name__ = fn.__qualname__ = "f"
        try:
            fs.shard_map(fn, mesh=mesh, in_specs=("(dp b) d", "d"), out_specs=spec)(x, w)
            msgs.append(f"{name}: no error")
        except fs.SpecError as e:
            msgs.append(f"{name}: {e}")
    return msgs


def test_one_axis_meshes():
    assert_ok(run_ranks(2, _one_axis))


def test_two_axis_mesh():
    assert_ok(run_ranks(4, _two_axis))


def test_transformed_values_keep_their_varying_axes():
    def msg(spec):
        return (
            "fs.shard_map(f): 1 problem with out_specs (replication check):\n"
            f"  - out varies over mesh axis dp but out_spec '{spec}' says it is replicated over dp; reduce it "
            "inside f (fs.psum / fs.pmean over 'dp'), mark it as a partial sum with '| sum(dp)', split a dim "
            "over dp in the out_spec, or pass check=False if you know it is the same on every rank"
        )

    want = [f"vmap: {msg('b')}", f"vmap then an op: {msg('b d')}", f"jvp tangent: {msg('')}"]
    for got in run_ranks(2, _escapes):
        assert got == want
