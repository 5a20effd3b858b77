"""``nn.Module`` buffers under data parallelism: ``fs.sync_buffers`` and ``fs.check_buffers``.

A model whose first layer is ``BatchNorm1d`` (so its running statistics depend on the data only,
not on the weights) is trained with ``torch.optim.SGD`` inside ``fs.shard_map`` on real gloo ranks,
its parameters captured by closure. With ``fs.sync_buffers`` the running mean is the one plain torch
computes in one process on the whole batch, the running variance the documented mean of the per-rank
unbiased variances, and every rank holds the same bytes; without it ``fs.check_buffers`` raises,
with the same text on every rank. The errors of both functions are checked in full.
"""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks

D, STEPS, MOMENTUM = 6, 3, 0.1


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.BatchNorm1d(D, momentum=MOMENTUM),
        torch.nn.Linear(D, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 2),
    )


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, D, generator=g) * 3 + 1, torch.randn(16, 2, generator=g)) for _ in range(STEPS)]


def _train(mesh, split, sync):
    """Train ``_model()`` for STEPS steps, the batch split over ``split``; sync its buffers over ``sync``."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(x, y):
        loss = fs.pmean(torch.nn.functional.mse_loss(model(x), y), split)
        if sync is not None:
            fs.sync_buffers(model, sync)
        return loss

    step = fs.shard_map(loss_fn, mesh=mesh, in_specs=(f"({split} b) d", f"({split} b) c"), out_specs="")
    for x, y in _batches():
        opt.zero_grad()
        with fs.count_collectives() as counts:
            step(x, y).backward()
        opt.step()
    return model, counts


def _try_check(model, mesh, **kwargs):
    try:
        fs.check_buffers(model, mesh, **kwargs)
    except fs.TracingError as err:
        return str(err)
    return None


def _rank_train_dp(sync):
    mesh = fs.Mesh(dp=4)
    model, counts = _train(mesh, "dp", "dp" if sync else None)
    bn = model[0]
    with fs.count_collectives() as check_counts:
        message = _try_check(model, mesh)
    return {
        "mean": bn.running_mean.clone(),
        "var": bn.running_var.clone(),
        "tracked": int(bn.num_batches_tracked),
        "counts": counts,
        "check_counts": check_counts.by_kind(),
        "message": message,
    }


def _reference():
    """Plain torch in one process: the running mean on the whole batch, and the running variance
    sync_buffers documents (the mean of the four ranks' unbiased batch variances)."""
    bn = _model()[0]
    var = torch.ones(D)
    for x, _ in _batches():
        bn(x)  # training mode: updates the running statistics with the whole batch
        per_rank = torch.stack([x[4 * r : 4 * r + 4].var(0, unbiased=True) for r in range(4)])
        var = (1 - MOMENTUM) * var + MOMENTUM * per_rank.mean(0)
    return bn.running_mean, var


def test_sync_buffers_gives_the_one_process_running_mean():
    ref_mean, ref_var = _reference()
    results = run_ranks(4, _rank_train_dp, True)
    for r in results:
        torch.testing.assert_close(r["mean"], ref_mean, rtol=0, atol=1e-6)
        torch.testing.assert_close(r["var"], ref_var, rtol=1e-6, atol=1e-6)
        assert r["tracked"] == STEPS  # integer buffers are left as they are
        assert r["message"] is None  # check_buffers passes
        assert r["check_counts"] == {("all_gather", ("dp",)): 1}  # one digest per buffer, one all-gather
        # the loss, one per parameter (captured by closure: not bucketed), one for both float buffers
        n_params = len(list(_model().parameters()))
        assert r["counts"].by_kind() == {("all_reduce", ("dp",)): 1 + n_params + 1}
        buffers = [rec for rec in r["counts"].records if rec[2] == 2 * D * 4]
        assert len(buffers) == 1
    for r in results[1:]:  # every rank holds the same bytes
        assert torch.equal(r["mean"], results[0]["mean"]) and torch.equal(r["var"], results[0]["var"])


DIFFER_DP = (
    "fs.check_buffers: 2 buffers of the module differ across the ranks of {mesh}, as BatchNorm running "
    "statistics do when each rank updates them with its own batch; call fs.sync_buffers(module, 'dp') "
    "inside the shard_map'd function after the forward (it replaces every floating buffer by its mean "
    "over dp), or update the buffers the same way on every rank:\n"
    "  - 0.running_mean differs along dp (equal within: {groups})\n"
    "  - 0.running_var differs along dp (equal within: {groups})"
)


def test_check_buffers_without_sync_raises_on_every_rank():
    results = run_ranks(4, _rank_train_dp, False)
    want = DIFFER_DP.format(mesh="Mesh(dp=4)", groups="rank 0; rank 1; rank 2; rank 3")
    for r in results:
        assert r["message"] == want
        assert r["tracked"] == STEPS
    assert not torch.equal(results[0]["mean"], results[1]["mean"])


def _rank_train_dp_tp():
    """On dp=2 x tp=2 with the batch split over dp only, the buffers differ along dp alone."""
    mesh = fs.Mesh(dp=2, tp=2)
    unsynced, _ = _train(mesh, "dp", None)
    synced, _ = _train(mesh, "dp", "dp")
    return {
        "unsynced": _try_check(unsynced, mesh),
        "unsynced_tp": _try_check(unsynced, mesh, axis="tp"),  # equal along tp: passes
        "synced": _try_check(synced, mesh),
    }


def test_check_buffers_names_the_axes_and_the_ranks():
    results = run_ranks(4, _rank_train_dp_tp)
    want = DIFFER_DP.format(mesh="Mesh(dp=2, tp=2)", groups="ranks 0, 1; ranks 2, 3")
    for r in results:
        assert r == {"unsynced": want, "unsynced_tp": None, "synced": None}


def _rank_errors():
    mesh = fs.Mesh(dp=4)
    model = _model()
    out = {}

    def bad_axis(x):
        fs.sync_buffers(model, "pd")
        return x

    for name, call in {
        "sync_axis": lambda: fs.shard_map(bad_axis, mesh=mesh, in_specs="(dp b) d", out_specs="(dp b) d")(
            torch.ones(8, D)
        ),
        "check_axis": lambda: fs.check_buffers(model, mesh, axis="pd"),
    }.items():
        try:
            call()
        except fs.CollectiveError as err:
            out[name] = str(err)
    return out


def test_bad_axis_errors():
    for r in run_ranks(4, _rank_errors):
        assert r == {
            "sync_axis": "fs.sync_buffers: 'pd' is not an axis of Mesh(dp=4) (did you mean 'dp'?)",
            "check_axis": "fs.check_buffers: 'pd' is not an axis of Mesh(dp=4) (did you mean 'dp'?)",
        }


def test_sync_buffers_outside_shard_map():
    with pytest.raises(fs.CollectiveError) as err:
        fs.sync_buffers(_model(), "dp")
    assert str(err.value) == (
        "fs.sync_buffers can only be called inside a function run by fs.shard_map, where mesh axes have "
        "names; wrap the calling function with fs.shard_map(f, mesh=..., in_specs=..., out_specs=...)"
    )


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (
            lambda: fs.sync_buffers({"w": torch.ones(2)}, "dp"),
            "fs.sync_buffers needs a torch.nn.Module, got dict",
        ),
        (
            lambda: fs.check_buffers(torch.ones(2), None),
            "fs.check_buffers needs a torch.nn.Module, got Tensor",
        ),
        (lambda: fs.check_buffers(_model(), "dp"), "fs.check_buffers needs an fs.Mesh, got str"),
    ],
    ids=["sync_module", "check_module", "check_mesh"],
)
def test_argument_errors(call, expected):
    with pytest.raises(fs.ArgumentError) as err:
        call()
    assert str(err.value) == expected
