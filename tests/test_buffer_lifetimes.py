"""Buffers of collectives in flight outlive every Python reference to them, on real gloo ranks.

Each program launches collectives whose operands are temporaries, drops every Python reference
to them, collects garbage and refills the allocator with same-sized tensors of a sentinel value,
and only then lets the collectives finish: rank 1 sleeps before joining each one, so rank 0's
are still in flight (its operands not yet sent) while it churns. A buffer freed too early would
be reused by the churn and show as sentinel values (or a heap abort). Checked against plain
torch on the global tensors in one process: ``async_op=True`` all_gather / psum_scatter /
ppermute, the combined per-leaf all_gathers of a `Flight` (forward) and their early
reduce-scatters (backward), and a flight abandoned by an exception before its results were used.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, env_vars

SENTINEL = 7.0e6
DELAY = 0.3  # seconds rank 1 arrives late at each collective


def _late() -> None:
    """Rank 1 arrives late: rank 0's collective just launched is still in flight."""
    if dist.get_rank() == 1:
        time.sleep(DELAY)


def _churn(numels) -> None:
    """Collect garbage and reuse freed memory of these sizes (and a few around them) with sentinels."""
    gc.collect()
    junk = [torch.full((n + k,), SENTINEL) for n in numels for k in (0, 1, 16) for _ in range(4)]
    junk += [torch.full((n,), SENTINEL, dtype=torch.float64) for n in numels]
    del junk


class _ChurnInBackward(torch.autograd.Function):
    """Identity; its backward (between the early reduce-scatters) makes rank 1 late and churns."""

    @staticmethod
    def forward(x, numels):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.numels = inputs[1]

    @staticmethod
    def backward(ctx, ct):
        _late()
        _churn(ctx.numels)
        return ct, None


def _rank_async_operands_dropped(X):
    mesh = fs.Mesh(dp=2)
    numels = [X.numel() // 2, X.numel(), 2 * X.numel()]

    def f(x):
        _late()
        ag = fs.all_gather(x * 3.0, "dp", dim=0, tiled=True, async_op=True)  # its operand: a temporary
        _churn(numels)
        _late()
        rs = fs.psum_scatter(torch.cat([x, x + 1.0]) * 2.0, "dp", dim=0, tiled=True, async_op=True)
        _churn(numels)
        _late()
        pp = fs.ppermute(x - 5.0, "dp", [(0, 1), (1, 0)], async_op=True)
        _churn(numels)
        return ag.wait(), rs.wait(), pp.wait()

    ag, rs, pp = fs.shard_map(
        f, mesh=mesh, in_specs="(dp b) d", out_specs=("(dp r) d", "(dp b) d", "(dp b) d")
    )(X)
    x0, x1 = X.chunk(2)
    errs: list = []
    close(errs, "all_gather", ag.full(), torch.cat([X, X]) * 3.0)  # each rank's copy
    close(errs, "psum_scatter", rs.full(), torch.cat([(x0 + x1) * 2.0, (x0 + x1 + 2.0) * 2.0]))
    close(errs, "ppermute", pp.full(), torch.cat([x1, x0]) - 5.0)
    return errs


def test_async_operands_dropped_before_the_wait():
    X = torch.randn(64, 32, generator=torch.Generator().manual_seed(11))
    assert_ok(run_ranks(2, _rank_async_operands_dropped, X))


def _combined_step(ws, numels, abandon: bool):
    """One all_gather per leaf of a temporary (combined, one bucket each, two in flight), used one
    at a time with churn in between, forward and backward; ``abandon``: raise before any use."""

    def f(*ws):
        _late()
        ys = [fs.all_gather(w * 2.0, "dp", dim=0, tiled=True) for w in ws]
        _churn(numels)  # flushes the queue: the first buckets are launched, their operands dropped
        if abandon:
            raise ValueError("abandoned")
        out = []
        for y in ys:
            _churn(numels)
            _late()  # the next bucket, launched by this use, is in flight during the next churn
            out.append(_ChurnInBackward.apply(y.sin(), numels))
        return tuple(fs.psum(o.sum(), "dp") for o in out)

    return fs.shard_map(f, mesh=fs.Mesh(dp=2), in_specs="(dp r) c", out_specs="...")(*ws)


def _rank_combined_operands_dropped(blocks):
    errs: list = []
    numels = sorted({b.numel() // 2 for b in blocks} | {b.numel() for b in blocks})
    ws = [b.clone().requires_grad_(True) for b in blocks]
    with env_vars(FSHARD_COMBINE_MB=1 / 2**20, FSHARD_COMBINE_AHEAD=2):  # one bucket per leaf
        try:
            _combined_step(ws, numels, abandon=True)
            errs.append("the abandoned step did not raise")
        except ValueError as e:
            if str(e) != "abandoned":
                errs.append(f"the abandoned step raised {e!r}")
        _late()
        _churn(numels)  # the abandoned flight's buffers: still owned by the collectives, if running
        outs = _combined_step(ws, numels, abandon=False)
        sum(o * (i + 1) for i, o in enumerate(outs)).backward()
    for i, (o, b, w) in enumerate(zip(outs, blocks, ws)):
        close(errs, f"value {i}", o, 2 * (2.0 * b).sin().sum())
        close(errs, f"grad {i}", w.grad, 2 * (i + 1) * 2.0 * (2.0 * b).cos())
    return errs


def test_combined_gathers_operands_dropped_forward_backward_and_abandoned():
    g = torch.Generator().manual_seed(12)
    blocks = [torch.randn(r, 48, generator=g) for r in (16, 8, 32, 4, 24)]  # global (dp r) c leaves
    assert_ok(run_ranks(2, _rank_combined_operands_dropped, blocks))
