"""Gradient buckets launched during the backward, in the order gradients become ready.

The MLP of test_buckets (``p0 .. p5``: three layers, used in that order) is differentiated on
real gloo ranks with small buckets. Gradients are compared with plain torch on the global batch
in one process and with the per-parameter path (``bucket_mb=0``); the backward's all-reduces are
recorded in launch order. A hook on the first layer's output (it fires when that layer's backward
is about to run, i.e. before the gradients of ``p0`` and ``p1`` are computed) records how many
all-reduces were already launched: the proof that buckets go out while the backward goes on.

Expected buckets are packed here from the parameter sizes: the backward makes the gradients
ready last layer first (``p5, p4, ..., p0``), and a bucket takes them while they fit in
``bucket_mb`` (a larger one goes alone).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import fshard as fs
from tests.conftest import run_ranks
from tests.test_buckets import SIZES, _mlp, _params

LIMIT = 400  # bytes: buckets of 280, 512, 64 and 384 bytes for the float64 MLP, in ready order
READY = [5, 4, 3, 2, 1, 0]  # the order in which the backward completes the parameters' gradients


def _pack(nbytes: list[int], limit: int) -> list[int]:
    """Greedy buckets of at most ``limit`` bytes, in the given order (a larger item alone)."""
    out, cur = [], 0
    for n in nbytes:
        if cur and cur + n > limit:
            out.append(cur)
            cur = 0
        cur += n
    out.append(cur)
    return out


def _expected(itemsize: int = 8, limit: int = LIMIT) -> list:
    sizes = [torch.Size(SIZES[i]).numel() * itemsize for i in READY]
    return [("all_reduce", ("dp",), n) for n in _pack(sizes, limit)]


def _reference(Xs, wd=0.0):
    p = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
    total = 0
    for X in Xs:
        data, reg = _mlp(p, X, wd)
        total = total + data + reg
    return total.detach(), dict(zip(p, torch.autograd.grad(total, list(p.values()))))


def _mlp_logged(p, x, log, counter, extra=None):
    """The MLP of test_buckets; ``log`` gets the number of all-reduces launched so far (in the
    count ``counter[0]``) when the backward reaches the first layer's output, before the
    gradients of ``p0`` and ``p1`` are computed."""
    h = torch.tanh(x @ p["p0"] + p["p1"])
    h.register_hook(lambda g: log.append(len(counter[0].records)))
    if extra is not None:
        extra(h)
    h = torch.tanh(h @ p["p2"] + p["p3"])
    y = h @ p["p4"] + p["p5"]
    return fs.pmean(y.pow(2).mean(), "dp")


def _data(seed: int, rows: int = 16):
    return torch.randn(rows, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# ready order, launch during the backward, equal to one process and to the per-parameter path


def _rank_ready_order(X, sizes):
    mesh = fs.Mesh(dp=dist.get_world_size())
    out = []
    for bucket_mb in sizes:
        params = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
        log: list[int] = []
        counter: list = [None]
        f = functools.partial(_mlp_logged, log=log, counter=counter)
        step = fs.shard_map(f, mesh=mesh, in_specs=("...", "(dp b) d"), out_specs="", bucket_mb=bucket_mb)
        loss = step(params, X)
        with fs.count_collectives() as counter[0]:
            loss.backward()
        out.append((loss.detach(), {k: p.grad for k, p in params.items()}, counter[0].records, log))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_buckets_in_ready_order_launched_during_the_backward(world):
    X = _data(1)
    ref_loss, ref = _reference([X])
    sizes = [torch.Size(SIZES[i]).numel() * 8 for i in READY]
    for small, per_param, one in run_ranks(world, _rank_ready_order, X, (LIMIT / 2**20, 0, 25.0)):
        (l0, g0, r0, log0), (l1, g1, r1, log1), (l2, g2, r2, log2) = small, per_param, one
        for loss, grads in ((l0, g0), (l1, g1), (l2, g2)):
            torch.testing.assert_close(loss, ref_loss)
            for k in ref:
                torch.testing.assert_close(grads[k], ref[k], msg=k)
        for k in ref:  # bucketed and per-parameter sums are the same additions
            torch.testing.assert_close(g0[k], g1[k], msg=k, rtol=0, atol=1e-15)
        # small buckets: packed in ready order, launched in that order
        assert r0 == _expected()
        # the buckets of p5..p3 (280 B) and of p2 (512 B) went before layer 1's backward ran
        assert log0 == [2]
        # per parameter: one blocking all-reduce each, as the backward reaches it
        assert r1 == [("all_reduce", ("dp",), n) for n in sizes] and log1 == [4]
        # one bucket holds everything: it can only go at the end, as before
        assert r2 == [("all_reduce", ("dp",), sum(sizes))] and log2 == [0]


# ---------------------------------------------------------------------------------------------
# unused inputs, a backward run twice (retain_graph), a backward abandoned by an exception


class _Stop(Exception):
    pass


def _rank_unused_twice_abandoned(X, bucket_mb):
    mesh = fs.Mesh(dp=dist.get_world_size())
    params = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
    # u1: cast with pvary (its twin's tap exists) but its use never reaches the loss;
    # u2: never used at all
    params["u1"] = torch.ones(8, 3, dtype=torch.float64, requires_grad=True)
    params["u2"] = torch.ones(5, dtype=torch.float64, requires_grad=True)
    log: list[int] = []
    counter: list = [None]
    stop = [True]

    def maybe_raise(g):
        if stop[0]:
            stop[0] = False
            raise _Stop

    def f(p, x):
        def extra(h):
            _ = h.detach() @ p["u1"]  # varying data meets u1: its twin is made, never reached
            h.register_hook(maybe_raise)  # after the logging hook

        return _mlp_logged(p, x, log, counter, extra)

    step = fs.shard_map(f, mesh=mesh, in_specs=("...", "(dp b) d"), out_specs="", bucket_mb=bucket_mb)
    records = []
    loss = step(params, X)
    with fs.count_collectives() as counter[0]:
        try:  # abandoned: the hook raises once layer 2's buckets are out
            loss.backward(retain_graph=True)
        except _Stop:
            pass
    records.append(counter[0].records)
    abandoned = {k: p.grad for k, p in params.items()}
    for _ in range(2):  # the same graph, twice: gradients add up
        with fs.count_collectives() as counter[0]:
            loss.backward(retain_graph=True)
        records.append(counter[0].records)
    twice = {k: p.grad.clone() if p.grad is not None else None for k, p in params.items()}
    for p in params.values():
        p.grad = None
    loss = step(params, X)
    with fs.count_collectives() as counter[0]:  # the next step
        loss.backward()
    records.append(counter[0].records)
    return abandoned, twice, {k: p.grad for k, p in params.items()}, records, log


@pytest.mark.parametrize("bucket_mb", [LIMIT / 2**20, 25.0])
def test_unused_inputs_retain_graph_and_abandoned_backward(bucket_mb):
    X = _data(2)
    _, ref = _reference([X])
    want = _expected(limit=int(bucket_mb * 2**20))
    for abandoned, twice, nxt, records, log in run_ranks(2, _rank_unused_twice_abandoned, X, bucket_mb):
        assert all(g is None for g in abandoned.values())  # the boundary never ran
        # the first backward launched what was full before the hook raised, then stopped
        assert records[0] == want[: log[0]]
        assert records[1:] == [want, want, want]
        for k in ref:
            torch.testing.assert_close(twice[k], 2 * ref[k], msg=k)
            torch.testing.assert_close(nxt[k], ref[k], msg=k)
        for k in ("u1", "u2"):
            assert twice[k] is None and nxt[k] is None


# ---------------------------------------------------------------------------------------------
# fs.value_and_grad inside shard_map, create_graph


def _rank_value_and_grad(X, bucket_mb):
    mesh = fs.Mesh(dp=dist.get_world_size())
    params = _params()

    def f(p, x):
        def loss(q, y):
            data, reg = _mlp(q, y, 0.01)
            return fs.pmean(data, "dp") + reg

        return fs.value_and_grad(loss)(p, x)

    step = fs.shard_map(
        f, mesh=mesh, in_specs=("...", "(dp b) d"), out_specs=("", "..."), bucket_mb=bucket_mb
    )
    with fs.count_collectives() as c:
        loss, grads = step(params, X)
    return loss, grads, c.records


def _rank_create_graph(X, bucket_mb):
    mesh = fs.Mesh(dp=dist.get_world_size())
    params = {k: v.clone().requires_grad_(True) for k, v in _params().items()}

    def f(p, x):
        data, reg = _mlp(p, x, 0.01)
        return fs.pmean(data, "dp") + reg

    step = fs.shard_map(f, mesh=mesh, in_specs=("...", "(dp b) d"), out_specs="", bucket_mb=bucket_mb)
    loss = step(params, X)
    grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
    hvp = torch.autograd.grad(sum(g.sum() for g in grads), list(params.values()))
    return [g.detach() for g in grads], hvp


def _rank_vg_and_create_graph(X, bucket_mb):
    return _rank_value_and_grad(X, bucket_mb), _rank_create_graph(X, bucket_mb)


@pytest.mark.parametrize("world", [2, 4])
def test_value_and_grad_inside_and_create_graph(world):
    X = _data(3)
    ref_loss, ref = _reference([X], wd=0.01)
    p = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
    data, reg = _mlp(p, X, 0.01)
    g_ref = torch.autograd.grad(data + reg, list(p.values()), create_graph=True)
    hvp_ref = torch.autograd.grad(sum(g.sum() for g in g_ref), list(p.values()))
    for vg, cg in run_ranks(world, _rank_vg_and_create_graph, X, LIMIT / 2**20):
        loss, grads, records = vg
        torch.testing.assert_close(loss, ref_loss)
        for k in ref:
            torch.testing.assert_close(grads[k], ref[k], msg=k)
        # the loss's pmean (one scalar, in the forward), then value_and_grad's buckets
        assert records == [("all_reduce", ("dp",), 8), *_expected()]
        grads, hvp = cg
        for a, b in zip(grads, g_ref):
            torch.testing.assert_close(a, b.detach())
        for a, b in zip(hvp, hvp_ref):
            torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------
# no_sync with small buckets and mixed precision: nothing launched early for deferred inputs


def _rank_no_sync_mixed(Xs):
    mesh = fs.Mesh(dp=dist.get_world_size())
    params = {k: v.float().clone().requires_grad_(True) for k, v in _params().items()}
    f = lambda p, x: fs.pmean(_mlp(p, x, 0.0)[0], "dp")  # noqa: E731
    step = fs.shard_map(
        f,
        mesh=mesh,
        in_specs=("...", "(dp b) d"),
        out_specs="",
        bucket_mb=LIMIT / 2 / 2**20,
        compute_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
    )
    records = []
    with fs.no_sync():
        for X in Xs[:-1]:
            loss = step(params, X.float())
            with fs.count_collectives() as c:
                loss.backward()
            records.append(c.records)
    loss = step(params, Xs[-1].float())
    with fs.count_collectives() as c:
        loss.backward()
    records.append(c.records)
    return {k: p.grad for k, p in params.items()}, records


def test_no_sync_and_mixed_precision_with_small_buckets():
    Xs = [_data(20 + i) for i in range(3)]
    p = {k: v.float().clone().requires_grad_(True) for k, v in _params().items()}
    # one process, the same casts: parameters and data in bfloat16, gradients back to float32
    total = 0
    for X in Xs:
        for xb in X.float().split(8):
            total = total + _mlp({k: v.bfloat16() for k, v in p.items()}, xb.bfloat16(), 0.0)[0] / 2
    ref = dict(zip(p, torch.autograd.grad(total, list(p.values()))))
    # float32 reductions, 200-byte buckets, in ready order
    want = _expected(itemsize=4, limit=LIMIT // 2)
    for grads, records in run_ranks(2, _rank_no_sync_mixed, Xs):
        for k in ref:
            assert grads[k].dtype == torch.float32
            torch.testing.assert_close(grads[k], ref[k], rtol=3e-2, atol=3e-2, msg=k)
        assert records == [[], [], want]
