"""``fs.compile``'s bucketing of per-leaf all-gathers and reduce-scatters, on real gloo ranks (2).

The per-leaf FSDP program (one ``fs.all_gather`` per split parameter, then ``loss.backward()``)
compiled with inductor: its gathers and their transposes run as one all-gather and one
reduce-scatter (packed and unpacked by fshard's ops, not by generated code), with leaves gathered
along their first dim and along another, and a leaf cast to another dtype just before its
gather. Loss and gradients against the same step run eagerly and against plain torch on the
global tensors in one process; the collectives against the profiler's events and eager's
``fs.count_collectives``.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, full, mse, randn

N = 2  # ranks
SPECS = {"w1": "d (dp h)", "b": "(dp h)", "w2": "(dp h) o"}
DIMS = {"w1": 1, "b": 0, "w2": 0}  # the dim each leaf is split (and gathered) along


def _init():
    # b is kept in float64 and gathered in float32: the bucket converts it as it packs it
    return {"w1": randn(0, 4, 8) / 2, "b": randn(1, 8, dtype=torch.float64) / 4, "w2": randn(2, 8, 3) / 3}


def _batch(i, b=8):
    return randn(100 + i, b, 4), randn(200 + i, b, 3)


def _mlp(p, x):
    return torch.tanh(x @ p["w1"] + p["b"].to(torch.float32)) @ p["w2"]


def _functional_ops(fn, *args) -> dict:
    """How many all-gathers and reduce-scatters ran during ``fn(*args)`` (the functional
    collectives' profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args)
    names = [e.name for e in prof.events() if e.name.startswith("_c10d_functional::")]
    return {
        k: sum(n.startswith(f"_c10d_functional::{k}") for n in names)
        for k in ("all_gather", "reduce_scatter")
    }


def _rank_fsdp_leaves():
    import fshard as fs

    torch._dynamo.reset()
    errs: list[str] = []
    dp = fs.Mesh(dp=N)

    def loss_fn(p, x, y):
        full_p = {
            k: fs.all_gather(t if k != "b" else t.to(torch.float32), "dp", dim=DIMS[k], tiled=True)
            for k, t in p.items()
        }
        return fs.pmean(mse(torch.tanh(x @ full_p["w1"] + full_p["b"]) @ full_p["w2"], y), "dp")

    f = fs.shard_map(loss_fn, mesh=dp, in_specs=(SPECS, "(dp b) d", "(dp b) o"), out_specs="")

    def step(p, x, y):
        loss = f(p, x, y)
        loss.backward()
        return loss.detach()

    init = _init()
    eager_p, comp_p = fs.shard(init, dp, SPECS), fs.shard(init, dp, SPECS)
    for p in (*eager_p.values(), *comp_p.values()):
        p.local.requires_grad_(True)
    x, y = _batch(0)
    with fs.count_collectives() as eager_counted:
        eager_loss = step(eager_p, x, y)
    with torch._inductor.config.patch(compile_threads=1):
        compiled = fs.compile(step)
        got_loss = compiled(comp_p, x, y)  # traced and compiled
        close(errs, "loss vs eager", got_loss, eager_loss)
        for k in init:
            close(errs, f"grad {k} vs eager", comp_p[k].local.grad, eager_p[k].local.grad)
            comp_p[k].local.grad = None
        with fs.count_collectives() as counted:
            ops = _functional_ops(compiled, comp_p, x, y)
    if ops != {"all_gather": 1, "reduce_scatter": 1}:
        errs.append(f"{ops} in the compiled step, want one bucket each way")
    # counted: one bucket each way (b's bytes in float32) and the pmean; eager moves the same bytes
    # (it flushes its combined gathers at b's cast: two all-gathers and two reduce-scatters)
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        got_bytes, eager_bytes = (
            sum(n for k, _, n in c.records if k == kind) for c in (counted, eager_counted)
        )
        if got_bytes != eager_bytes:
            errs.append(f"{kind}: {got_bytes} bytes counted compiled, {eager_bytes} eager")
    if counted.calls != 7 or eager_counted.calls != 7:  # three leaves each way, and the pmean
        errs.append(f"{counted.calls} calls counted compiled, {eager_counted.calls} eager")
    want_records = [("all_gather", ("dp",), 4 * (4 * 4 + 4 + 4 * 3)), ("all_reduce", ("dp",), 4)]
    want_records.append(("reduce_scatter", ("dp",), 4 * (4 * 8 + 8 + 8 * 3)))
    if sorted(counted.records) != want_records:
        errs.append(f"counted {counted.records}, want {want_records}")
    if sorted(counted.combined) != [("all_gather", ("dp",), 3), ("reduce_scatter", ("dp",), 3)]:
        errs.append(f"combined {counted.combined}")
    X, Y = full(x), full(y)
    want, want_loss = torch.func.grad_and_value(lambda p: mse(_mlp(p, X), Y))(init)  # one process
    close(errs, "loss vs one process", got_loss, want_loss)
    rank = torch.distributed.get_rank()
    for k in init:
        got = comp_p[k].local.grad
        if got is None or got.dtype != init[k].dtype:
            errs.append(f"grad {k}: {None if got is None else got.dtype}, want {init[k].dtype}")
            continue
        block = want[k].chunk(N, DIMS[k])[rank]
        close(errs, f"grad {k} vs one process", got, block)
    return errs


@pytest.mark.timeout(240)  # inductor compiles C++ kernels with gcc: slow on a loaded 2-core machine
def test_compiled_fsdp_leaves_bucketed_along_any_dim_and_dtype_match_one_process():
    assert_ok(run_ranks(N, _rank_fsdp_leaves, timeout=220))
