"""Restarting after a failure: ``python -m fshard.run --max-restarts`` and ``torchrun --max-restarts``.

A 2-rank FSDP training loop (tests/restart_program.py) checkpoints every 5 steps and resumes from
the latest checkpoint; one rank is SIGKILLed, the launcher restarts every rank, and the final
parameters must be bit-identical to an uninterrupted run's (on the suite's 2-rank pool) and
close to plain torch's in one process. Every launched run is bounded in time and must leave no
process behind (each runs in a session of its own, killed whole if it overruns).
"""

from __future__ import annotations

import os
import re
import textwrap
import time

import pytest
import torch

from benchmarks.restarts import launcher, run_bounded
from tests.conftest import run_ranks
from tests.restart_program import global_params, reference, train

STEPS, EVERY = 20, 5
BOUND = 100.0  # seconds one kill-and-restart run may take on a busy 2-core machine


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("uninterrupted") / "ckpt")
    finals = run_ranks(2, train, ckpt, STEPS, EVERY)
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    ref = reference(STEPS)
    for k, v in finals[0].items():  # plain torch agrees up to float reduction order
        torch.testing.assert_close(v, ref[k], rtol=1e-5, atol=1e-6)
    return finals[0], ckpt


def _run(cmd, out_dir):
    code, out, seconds, left = run_bounded(cmd, BOUND + 20)
    assert code is not None, f"timed out after {seconds:.0f} s:\n{out[-3000:]}"
    assert not left, "a process of the run was left behind"
    assert seconds < BOUND, f"took {seconds:.0f} s"
    assert code == 0, out[-4000:]
    final = torch.load(os.path.join(out_dir, "final.pt"))
    with open(os.path.join(out_dir, "attempts.txt")) as fh:
        attempts = fh.read().splitlines()
    return out, final, attempts


def _load_step(ckpt, step):
    from fshard import checkpoint

    step0 = torch.zeros((), dtype=torch.int64)  # fs.optim counts steps in a tensor
    like = {"params": global_params(), "opt": {"step": step0, "m": global_params(), "v": global_params()}}
    return checkpoint.load(ckpt, like, step=step)


@pytest.mark.timeout(150)
def test_fshard_run_restarts_after_a_rank_is_killed_mid_save(uninterrupted, tmp_path):
    want, ref_ckpt = uninterrupted
    out_dir = str(tmp_path)
    cmd = [*launcher("fshard", 2, 1), "-m", "tests.restart_program", out_dir, "--kill-in-save", "15"]
    out, final, attempts = _run(cmd, out_dir)
    # rank 1 died inside the save of step 15: the partial .tmp_ checkpoint was not read, and the
    # restart resumed from step 10
    assert attempts == [
        "attempt 0 start 0 held []",
        "attempt 1 start 10 held ['.tmp_step_00000015', 'step_00000005', 'step_00000010']",
    ]
    lines = [x for x in out.splitlines() if x.startswith("fshard.run:")]
    assert re.fullmatch(
        r"fshard\.run: rank 1 \(pid \d+\) was killed by SIGKILL(; terminating the 1 other running rank\(s\))?",
        lines[0],
    ), lines
    assert lines[1:] == ["fshard.run: restarting all 2 rank(s) in 1 s (restart 1 of 1)"]
    assert all(torch.equal(final[k], want[k]) for k in want)
    # the checkpoint before the killed save is exact: the uninterrupted run's step 10, bit for bit
    ckpt = os.path.join(out_dir, "ckpt")
    got, ref = _load_step(ckpt, 10), _load_step(ref_ckpt, 10)
    assert got["opt"]["step"] == ref["opt"]["step"] == 10
    for part in ("params", "m", "v"):
        a = got[part] if part == "params" else got["opt"][part]
        b = ref[part] if part == "params" else ref["opt"][part]
        assert all(torch.equal(a[k], b[k]) for k in b), part
    assert sorted(os.listdir(ckpt)) == [f"step_{s:08d}" for s in (5, 10, 15, 20)]


@pytest.mark.timeout(150)
def test_torchrun_c10d_restart_joins_the_world_again(uninterrupted, tmp_path):
    # torchrun's c10d rendezvous keeps its store across restarts: fs.init joins under a prefix of
    # its own per attempt, or gloo would read the dead ranks' addresses ("Connection refused")
    want, _ = uninterrupted
    out_dir = str(tmp_path)
    cmd = [*launcher("torchrun", 2, 1), "-m", "tests.restart_program", out_dir, "--kill-at", "17"]
    out, final, attempts = _run(cmd, out_dir)
    assert attempts == [
        "attempt 0 start 0 held []",
        "attempt 1 start 15 held ['step_00000005', 'step_00000010', 'step_00000015']",
    ]
    assert "Connection refused" not in out
    assert all(torch.equal(final[k], want[k]) for k in want)


def test_restart_count_backoff_and_giving_up(tmp_path):
    # no torch in the ranks: only the launcher's restart rules
    script = tmp_path / "always_fails.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys
            import fshard as fs
            if os.environ["RANK"] == "1":  # prints, then fails (rank 0 may be stopped at any time)
                print("attempt", fs.restart_count(), os.environ["TORCHELASTIC_RESTART_COUNT"],
                      os.environ["TORCHELASTIC_MAX_RESTARTS"], flush=True)
                sys.exit(3)
            """
        )
    )
    t0 = time.monotonic()
    code, out, seconds, left = run_bounded([*launcher("fshard", 2, 2), str(script)], 60)
    assert code == 3 and not left
    assert 3.0 <= seconds < 45  # backoffs of 1 s and 2 s
    assert time.monotonic() - t0 < 60
    assert [x for x in out.splitlines() if x.startswith("attempt")] == [
        "attempt 0 0 2",
        "attempt 1 1 2",
        "attempt 2 2 2",
    ]
    lines = [x for x in out.splitlines() if x.startswith("fshard.run:")]
    failed = (
        r"fshard\.run: rank 1 \(pid \d+\) exited with code 3(; terminating the [01] other running rank\(s\))?"
    )
    assert len(lines) == 6 and all(re.fullmatch(failed, lines[i]) for i in (0, 2, 4)), lines
    assert lines[1::2] == [
        "fshard.run: restarting all 2 rank(s) in 1 s (restart 1 of 2)",
        "fshard.run: restarting all 2 rank(s) in 2 s (restart 2 of 2)",
        "fshard.run: giving up: the last of 2 restart(s) failed too",
    ]


def test_max_restarts_must_not_be_negative(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("")
    code, out, _, left = run_bounded([*launcher("fshard", 2, -1), str(script)], 60)
    assert code == 2 and not left
    assert out.strip().splitlines()[-1] == "python -m fshard.run: error: --max-restarts must be >= 0"


def test_an_error_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """torchrun's agent reads the error file of a rank that ended; one left empty by a rank stopped
    halfway through writing it made the agent itself fail (JSONDecodeError) instead of restarting
    the ranks (seen once in the torchrun restart test). The file is now written aside and moved
    into place: a write cut short leaves the previous state (here: no file), never a partial one."""
    import json

    from fshard import _env

    path = str(tmp_path / "error.json")
    err = RuntimeError("boom " * 5000)  # a message longer than one write buffer

    real_dump = json.dump

    def cut_short(obj, fh, **kw):
        fh.write('{"message": {"mess')  # part of the JSON, then the process "dies"
        fh.flush()
        raise KeyboardInterrupt

    monkeypatch.setattr(_env.json, "dump", cut_short)
    with pytest.raises(KeyboardInterrupt):
        _env.write_error_file(path, err, None)
    assert not os.path.exists(path)

    monkeypatch.setattr(_env.json, "dump", real_dump)
    _env.write_error_file(path, err, None)
    with open(path) as fh:
        assert json.load(fh)["message"]["message"].startswith("RuntimeError: boom")
    assert _env.read_error_file(path).message.startswith("RuntimeError: boom")
    assert os.listdir(tmp_path) == ["error.json"]  # the next write took the cut-short one's place
