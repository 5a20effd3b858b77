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
