"""A combined collective that fails on some ranks leaves no state behind on any of them.

A queued (combined) collective runs when ``f`` returns, inside the trace's exit. If it raises
there on some ranks only, those ranks must still end the trace as the others do: no queued work,
no trace on fshard's stack, no varying-axes mode left on torch's function-mode stack (a mode left
there tracks every later op of that process, adds implicit pvary casts, and makes its backward
issue all-reduces where its peers issue reduce-scatters: gloo aborts). The next job on the same
pool must agree with plain torch. The pool also ends whatever an earlier job left open.
"""

from __future__ import annotations

import torch

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok
from tests.test_combine import _rank_forms


def _leftovers() -> tuple[int, list[str]]:
    """fshard's traces still running and torch function modes still pushed on this rank."""
    from torch.overrides import _get_current_function_mode_stack

    from fshard import _vma

    return len(_vma._stack), [type(m).__name__ for m in _get_current_function_mode_stack()]


def _rank_fails_in_a_combined_psum(X):
    import torch.distributed as dist

    from fshard import _watchdog

    rank = dist.get_rank()
    errs: list = []

    def f(x):
        if rank == 0:
            a = fs.psum(x, "dp")  # queued; run (and failing) at the op below, inside f
            return fs.psum(a * 2.0, "dp")
        return fs.psum(x * 2.0, "dp")  # queued; run (and failing) when f returns, in the trace's exit

    # the ranks pair different collectives: the tags sent with the data make both raise
    saved, _watchdog.S.tags = _watchdog.S.tags, True
    try:
        fs.shard_map(f, mesh=fs.Mesh(dp=2), in_specs="(dp b)", out_specs="(dp b)")(X)
        errs.append(f"rank {rank}: no error")
        message = ""
    except fs.CollectiveError as err:
        message = str(err)
    finally:
        _watchdog.S.tags = saved
    head = "fshard: the ranks of the group over dp (ranks 0, 1) ran different collectives together:\n"
    if not message.startswith(head):
        errs.append(f"rank {rank}: {message!r}")
    left = _leftovers()
    if left != (0, []):
        errs.append(f"rank {rank} after the failed call: {left[0]} traces, function modes {left[1]}")
    return errs


def test_a_combined_psum_failing_at_trace_exit_on_one_rank_leaves_no_state():
    X = torch.randn(16, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64).float()
    assert_ok(run_ranks(2, _rank_fails_in_a_combined_psum, torch.arange(8.0)))
    # the same pool: combined forward and backward agree with plain torch on every rank
    assert_ok(run_ranks(2, _rank_forms, {"dp": 2}, X))


def _rank_leaves_a_trace_open():
    from fshard import _vma

    mesh = fs.Mesh(dp=2)
    _vma.Trace(mesh, "a job that never returned").__enter__()  # a trace, its mode, a queue
    _vma.active().queue = object()  # never run: reset drops it without running it
    _vma.VmaMode(_vma.Trace(mesh, "a mode alone")).__enter__()
    return _leftovers()


def _rank_state():
    return _leftovers()


def test_the_pool_ends_what_an_earlier_job_left_open():
    assert run_ranks(2, _rank_leaves_a_trace_open) == [(1, ["VmaMode", "VmaMode"])] * 2
    assert run_ranks(2, _rank_state) == [(0, [])] * 2
    X = torch.randn(16, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64).float()
    assert_ok(run_ranks(2, _rank_forms, {"dp": 2}, X))


_KEPT: list = []


def _rank_leaves_no_sync_and_a_counter_open():
    """A job that enters fs.no_sync and fs.count_collectives and never leaves them, with a
    gradient kept pending: what a job that raised inside both would leave."""
    from fshard import _buckets, _counts

    mesh = fs.Mesh(dp=2)
    w = torch.ones(3, requires_grad=True)
    fs.no_sync().__enter__()
    counter = fs.count_collectives()
    counter.__enter__()
    _KEPT.append(counter)  # (a generator closed by the garbage collector would leave by itself)
    f = fs.shard_map(
        lambda w, x: fs.psum((w * x).sum(), "dp"), mesh=mesh, in_specs=("...", "(dp b) d"), out_specs=""
    )
    f(w, torch.ones(4, 3)).backward()
    return _buckets._sync, len(_buckets._PENDING), len(_counts._recorders), w  # (w kept alive)


def _rank_a_step_after_it():
    """The next job's step: reduced at once (no no_sync left on), counted by nothing it did not
    enter, its gradient that of plain torch."""
    from fshard import _buckets, _counts

    state = (_buckets._sync, len(_buckets._PENDING), len(_counts._recorders))
    mesh = fs.Mesh(dp=2)
    w = torch.ones(3, requires_grad=True)
    x = torch.arange(12.0).reshape(4, 3)
    f = fs.shard_map(
        lambda w, x: fs.psum((w * x).sum(), "dp"), mesh=mesh, in_specs=("...", "(dp b) d"), out_specs=""
    )
    with fs.count_collectives() as counts:
        f(w, x).backward()
    from fshard import _state

    return state, w.grad.tolist(), counts.total, _state.registered()


def test_a_new_job_starts_outside_what_an_earlier_job_left_entered():
    left = run_ranks(2, _rank_leaves_no_sync_and_a_counter_open)
    assert [r[:3] for r in left] == [(False, 1, 1)] * 2
    after = run_ranks(2, _rank_a_step_after_it)
    want = torch.arange(12.0).reshape(4, 3).sum(0).tolist()  # plain torch: d/dw sum(w * x)
    for state, grad, total, _ in after:
        assert state == (True, 0, 0)
        assert grad == want
        assert total >= 1  # the gradient's all-reduce, seen by this job's own counter
    names = after[0][3]  # the resets a pool rank runs before each job, in their order
    assert names[:4] == [
        "fshard._watchdog.reset",
        "fshard._vma.reset",
        "fshard._combine.reset",
        "fshard._inflight.forget",
    ], names
    assert {"fshard._buckets._reset", "fshard._counts._reset", "fshard._reshard._reset"} <= set(names)
