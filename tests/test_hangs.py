"""Every failure ends within a bounded, configurable time (real gloo ranks, wall-clock bounds).

* a rank that raises under ``python -m fshard.run`` (or torchrun) exits at once and is named;
* ranks whose launcher is killed (torchrun, ``python -m fshard.run``) end at once, not orphaned in a collective;
* every process group fshard creates gets the configured timeout, on meshes of several axes too;
* ``fs.launch(timeout=...)`` is not cut short by a shorter in-rank backstop;
* sizes and indices of axis tuples need no group, and multi-axis groups are made with the mesh;
* ``python -m fshard.run -n N`` warns when N is far beyond the machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fshard._launch as launch_module
from fshard._errors import FshardError, RankError
from fshard._launch import RankPool, init, launch

ROOT = Path(__file__).resolve().parent.parent
ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BOUND = 30.0  # seconds: every failure below must end well within this


def _clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


# --- 1. a raising rank ends the job at once and is the one named --------------------------------------

RAISE_SCRIPT = """
import sys, time
import torch, torch.distributed as dist
import fshard as fs

fs.init()
bad = int(sys.argv[1])
if dist.get_rank() == bad:
    raise ValueError(f"deliberate failure on rank {bad} at t={time.time():.3f}")
dist.all_reduce(torch.ones(1))  # blocks: the failed rank never joins
time.sleep(600)
"""


def _failed_at(text):
    return float(re.search(r"deliberate failure on rank \d+ at t=([0-9.]+)", text).group(1))


@pytest.mark.parametrize("nprocs, bad", [(2, 1), (2, 0), (4, 1), (4, 0)])
def test_fshard_run_raising_rank_exits_at_once_and_is_named(tmp_path, nprocs, bad):
    script = tmp_path / "raise.py"
    script.write_text(RAISE_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "fshard.run", "-n", str(nprocs), str(script), str(bad)],
        env=_clean_env(),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=110,  # below pytest-timeout's 120 s; the bound that matters is asserted below
    )
    ended = time.time()
    assert out.returncode == 1, out.stderr
    assert ended - _failed_at(out.stderr) < BOUND  # it used to wait for the 30-minute timeout
    blamed = [line for line in out.stderr.splitlines() if line.startswith("fshard.run: rank")]
    assert len(blamed) == 1, out.stderr
    assert re.fullmatch(
        rf"fshard\.run: rank {bad} \(pid \d+\) raised ValueError: deliberate failure on rank {bad} "
        r"at t=[0-9.]+( and exited with code 1)?(; terminating the \d other running rank\(s\))?",
        blamed[0],
    ), blamed[0]


def test_torchrun_raising_rank_exits_at_once(tmp_path):
    script = tmp_path / "raise.py"
    script.write_text(RAISE_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), "1"],
        env=_clean_env(),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=110,  # below pytest-timeout's 120 s; the bound that matters is asserted below
    )
    ended = time.time()
    assert out.returncode != 0
    assert ended - _failed_at(out.stderr) < BOUND
    # The rank recorded its exception in torchrun's error file: torchrun's report quotes it.
    assert "error_file:" in out.stderr and "ValueError: deliberate failure on rank 1" in out.stderr


ORPHAN_SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
import fshard as fs

fs.init()
rank = dist.get_rank()
with open(os.path.join(sys.argv[1], f"pid{rank}.part"), "w") as fh:
    fh.write(str(os.getpid()))
os.replace(os.path.join(sys.argv[1], f"pid{rank}.part"), os.path.join(sys.argv[1], f"pid{rank}"))
if rank == 0:
    dist.all_reduce(torch.ones(1))  # waits for rank 1, which never joins
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("launcher", ["torchrun", "fshard.run"])
def test_ranks_of_a_killed_launcher_end_at_once(tmp_path, launcher):
    # torchrun starts each rank in a session of its own: killing the agent with SIGKILL takes none
    # of them along. fs.init's launcher watch ends them, saying why (before, they waited, orphaned,
    # in the all_reduce until the 30-minute timeout, holding their ports against the next attempt).
    # python -m fshard.run's ranks are killed by the kernel with it (PR_SET_PDEATHSIG), or by the watch.
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN_SCRIPT)
    module = "torch.distributed.run" if launcher == "torchrun" else "fshard.run"
    count = "--nproc-per-node" if launcher == "torchrun" else "-n"
    agent = subprocess.Popen(
        [sys.executable, "-m", module, count, "2", str(script), str(tmp_path)],
        env=_clean_env(),
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"pid{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and agent.poll() is None, "the ranks did not start"
            time.sleep(0.1)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
        time.sleep(1.0)  # rank 0 is in its all_reduce, rank 1 asleep
        assert all(_running(pid) for pid in pids)
        agent.kill()
        killed = time.monotonic()
        while any(_running(pid) for pid in pids) and time.monotonic() - killed < BOUND:
            time.sleep(0.05)
        took = time.monotonic() - killed
        assert not any(_running(pid) for pid in pids), "the orphaned ranks still run"
        assert took < 5.0, took  # the watch looks twice a second
        out = agent.communicate(timeout=30)[0].decode()  # the ranks held the pipe: it closed with them
    finally:
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        if agent.poll() is None:
            agent.kill()
    lines = sorted(line for line in out.splitlines() if "its launcher" in line)
    said = [
        f"fshard: rank {r}: its launcher (process {agent.pid}) has exited; ending this rank, which would "
        "otherwise wait in its collectives until they time out"
        for r in (0, 1)
    ]
    if launcher == "torchrun":
        assert lines == said, out
    else:  # the kernel's SIGKILL comes first, as a rule
        assert set(lines) <= set(said), out


def test_a_rank_leaving_with_sys_exit_mid_collective_is_named_within_the_timeout(tmp_path):
    # Rank 1 leaves with sys.exit(3) while rank 0 waits for it in a collective. It cannot know
    # its exit code at exit, so it waits for rank 0 at the exit barrier, for half of fs.init's
    # timeout, then leaves; rank 0 then fails (a consequence), and the launcher names rank 1.
    script = tmp_path / "leave.py"
    script.write_text(
        "import sys, time, torch, torch.distributed as dist\n"
        "import fshard as fs\n"
        "fs.init(timeout=6)\n"
        "if dist.get_rank() == 1:\n"
        "    print(f'leaving at t={time.time():.3f}', flush=True)\n"
        "    sys.exit(3)\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "fshard.run", "-n", "2", str(script)],
        env=_clean_env(),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=110,  # below pytest-timeout's 120 s; the bound that matters is asserted below
    )
    left = float(re.search(r"leaving at t=([0-9.]+)", out.stdout).group(1))
    assert time.time() - left < BOUND
    assert out.returncode == 3, out.stderr
    blamed = [line for line in out.stderr.splitlines() if line.startswith("fshard.run: rank")]
    assert len(blamed) == 1 and re.fullmatch(
        r"fshard\.run: rank 1 \(pid \d+\) exited with code 3(; terminating the \d other running rank\(s\))?",
        blamed[0],
    ), out.stderr


def _record(path, exc_type, text, secondary=False):
    from fshard._env import write_error_file

    try:
        raise exc_type(text)
    except exc_type as exc:
        write_error_file(path, exc, exc.__traceback__, secondary=secondary)


def test_the_launcher_blames_the_rank_that_failed_first(tmp_path):
    from fshard.run import _root_cause

    files = [str(tmp_path / f"rank{r}.json") for r in range(4)]
    # Nothing recorded: the lowest rank that exited with an error.
    assert _root_cause([None, -15, 1, None], files, final=False) == (1, "was killed by SIGTERM")
    # Only consequences recorded: wait for the culprit, then name the earliest.
    _record(files[3], RuntimeError, "Connection closed by peer", secondary=True)
    assert _root_cause([None, None, None, 1], files, final=False) is None
    assert _root_cause([None, None, None, 1], files, final=True) == (
        3,
        "raised RuntimeError: Connection closed by peer and exited with code 1",
    )
    # A rank that exited with an error and recorded nothing comes before a consequence.
    assert _root_cause([None, 3, None, 1], files, final=False) == (1, "exited with code 3")
    # A rank that recorded its own exception comes first, even if still on its way out.
    _record(files[2], KeyError, "no such batch")
    assert _root_cause([None, 3, None, 1], files, final=False) == (2, "raised KeyError: 'no such batch'")
    assert _root_cause([1, 3, 1, 1], files, final=True) == (
        2,
        "raised KeyError: 'no such batch' and exited with code 1",
    )


RECORD_LATE_SCRIPT = """
import os, sys, time
from fshard._env import ERROR_FILE_ENV, write_error_file

rank, path = os.environ["RANK"], os.environ[ERROR_FILE_ENV]

def record(exc):
    try:
        raise exc
    except RuntimeError as err:
        write_error_file(path, err, err.__traceback__, secondary=True)

if rank == "1":  # its connection closed by rank 0's timeout: a consequence, recorded at once
    record(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    sys.exit(1)
if rank == "0":  # timed out; asks the others where they are (up to 2.5 s), then records the blame
    time.sleep(4)
    err = RuntimeError("rank 0 timed out after 6 s")
    err.fshard_blame = ([2], "did not arrive at #1 all_reduce, where rank 0 timed out waiting for it after 6 s")
    record(err)
    sys.exit(1)
time.sleep(60)  # rank 2: stuck elsewhere
"""


def test_the_launcher_waits_for_the_blame_a_timed_out_rank_records_after_asking_the_others(tmp_path):
    # A rank whose collective timed out records which ranks did not arrive only after asking them
    # (up to 2.5 s); meanwhile the peers whose connections its timeout closed fail at once. The
    # launcher used to give up waiting after 2 s and name one of those instead.
    script = tmp_path / "late.py"
    script.write_text(RECORD_LATE_SCRIPT)
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "fshard.run", "-n", "3", str(script)],
        env=_clean_env(),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - t0 < BOUND
    assert out.returncode == 1, out.stderr
    assert re.fullmatch(
        r"fshard\.run: rank 2 \(pid \d+\) did not arrive at #1 all_reduce, where rank 0 timed out waiting "
        r"for it after 6 s; terminating it and the \d other running rank\(s\)\n",
        out.stderr,
    ), out.stderr


# --- 2. every group fshard creates gets the configured timeout ----------------------------------------


def _timeout_of(group):
    import torch

    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _mesh_group_timeouts():
    import torch.distributed as dist

    import fshard as fs

    mesh = fs.Mesh(dp=2, tp=2)
    per_axis = sorted({_timeout_of(g) for g in mesh.device_mesh.get_all_groups()})
    multi = _timeout_of(mesh.axis_group(("dp", "tp")).group)
    enumerated = _timeout_of(mesh._new_group((0,)))  # the path of combinations not spanning the world
    return dist.get_rank(), per_axis, multi, enumerated


def _skip_collectives_on_rank3():
    """Rank 3 skips a collective on a per-axis group (tp) and on a multi-axis one (dp, tp)."""
    import torch
    import torch.distributed as dist

    import fshard as fs

    mesh = fs.Mesh(dp=2, tp=2)
    rank = dist.get_rank()
    waits = {}
    if rank == 3:
        return waits
    for axes in ("tp", ("dp", "tp")):
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=mesh.axis_group(axes).group)
        except RuntimeError as exc:
            waits[str(axes)] = (str(exc).split("] ", 1)[-1].split(".")[0], time.monotonic() - start)
    return waits


def test_mesh_groups_get_the_configured_timeout_and_a_skipped_collective_fails_within_it():
    with RankPool(4, collective_timeout=3) as pool:
        assert pool.run(_mesh_group_timeouts) == [(r, [3.0], 3.0, 3.0) for r in range(4)]
        start = time.monotonic()
        waits = pool.run(_skip_collectives_on_rank3, timeout=60)
        assert time.monotonic() - start < BOUND  # two 3 s timeouts, one after the other on rank 2
    message = "Timed out waiting 3000ms for recv operation to complete"
    assert waits[3] == {}
    for rank in range(3):
        # rank 2 waits on its tp group (with rank 3); every rank waits on (dp, tp).
        expected = {"('dp', 'tp')", "tp"} if rank == 2 else {"('dp', 'tp')"}
        assert set(waits[rank]) == expected, waits
        for text, seconds in waits[rank].values():
            assert text == message and 2.5 < seconds < BOUND


# --- 3. fs.launch(timeout=...) is honoured end to end ---------------------------------------------------


def _wait_for_peer(delay):
    """Rank 0 waits in an all-reduce while rank 1 works for ``delay`` seconds first."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(delay)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _pid():
    return os.getpid()


def test_launch_timeout_is_not_cut_short_by_a_shorter_backstop(monkeypatch):
    monkeypatch.setattr(launch_module, "_BACKSTOP", 1.0)  # the pools' default in-rank timeout
    with RankPool(2) as pool:  # the backstop alone: a 2 s wait for a peer fails
        pool.run(_pid)  # started
        start = time.monotonic()
        with pytest.raises(RankError, match="Timed out waiting 1000ms"):
            pool.run(_wait_for_peer, 2.0, timeout=30)
        assert time.monotonic() - start < BOUND
    # fs.launch gives the ranks' groups its own timeout (plus a margin): the same job succeeds.
    start = time.monotonic()
    assert launch(_wait_for_peer, 2, args=(2.0,), timeout=60) == [2.0, 2.0]
    assert time.monotonic() - start < 60


def test_timeouts_must_be_positive_numbers():
    with pytest.raises(FshardError) as info:
        RankPool(2, collective_timeout=0)
    assert str(info.value) == (
        "fs.RankPool(collective_timeout=...): timeout must be a positive number of seconds "
        "(or None for torch's default), got 0"
    )
    with pytest.raises(FshardError) as info:
        launch(_wait_for_peer, 2, args=(0,), timeout=-1)
    assert str(info.value) == (
        "fs.launch(): timeout must be a positive number of seconds (or None for torch's default), got -1"
    )
    with pytest.raises(FshardError) as info:
        init(timeout="5")
    assert str(info.value) == (
        "fshard.init(): timeout must be a positive number of seconds (or None for torch's default), got '5'"
    )


# --- 4. multi-axis groups are made with the mesh; sizes and indices need no group ----------------------

GROUPS_SCRIPT = """
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import fshard as fs

dist.init_process_group("fake", rank=5, world_size=32, store=FakeStore())
groups = lambda: len(dist.distributed_c10d._world.pg_map)
before = groups()
mesh = fs.Mesh(a=2, b=2, c=2, d=4)
made = groups() - before
fs.Mesh(a=2, b=2, c=2, d=4)                       # the same shape reuses them
again = groups() - before
start = groups()
probe = (mesh.axis_index(("a", "b")), mesh.axis_size(("b", "d")), mesh.axis_index(("a", "c", "d")))
has_group = mesh.axis_group(("b", "c")).group is not None
print("4 axes:", made, again, probe, has_group, groups() - start)
big = fs.Mesh(a=2, b=2, c=2, d=2, e=2)
start = groups()
probe = (big.axis_index(("a", "e")), big.axis_size(("a", "b", "c")))
no_group_yet = groups() - start
big.axis_group(("a", "e")).group
print("5 axes:", probe, no_group_yet, groups() - start)
"""


def test_multi_axis_groups_are_made_with_the_mesh_and_indices_need_none():
    out = subprocess.run(
        [sys.executable, "-c", GROUPS_SCRIPT], env=_clean_env(), capture_output=True, text=True, timeout=110
    )
    assert out.returncode == 0, out.stderr
    # 4 axis groups plus the 11 - 1 combinations (a, b, c, d together is the world group itself);
    # Rank 5 is at a=0, b=0, c=1, d=1 of the first mesh, at a=0, b=0, c=1, d=0, e=1 of the second.
    assert out.stdout.splitlines() == [
        "4 axes: 14 14 (0, 8, 5) True 0",
        "5 axes: (1, 8) 0 1",
    ]


# --- 5. fshard.run warns when the world is far beyond the machine ------------------------------------


def test_capacity_warning_texts():
    from fshard.run import _capacity_warnings

    assert _capacity_warnings(4, 2, 16 * 2**30) == []
    assert _capacity_warnings(100, 4, 8 * 2**30) == [
        "fshard.run: warning: 100 ranks need about 22.5 GiB of memory (100 x ~230 MiB, one Python "
        "process with torch each) but only 8.0 GiB is available, so ranks may be killed for lack of "
        "memory; use -n 35 or fewer, or a machine with more memory",
        "fshard.run: warning: 100 ranks on 4 CPU(s) is 25 ranks per CPU, so start-up and every "
        "collective will be very slow; use -n 16 or fewer, or a machine with more CPUs",
    ]


def test_fshard_run_prints_the_capacity_warning(tmp_path, monkeypatch, capsys):
    import fshard.run

    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    monkeypatch.setattr(fshard.run, "_machine", lambda: (1, 512 * 2**20))
    assert fshard.run.main(["-n", "5", str(script)]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == fshard.run._capacity_warnings(5, 1, 512 * 2**20)
    assert len(err.splitlines()) == 2
