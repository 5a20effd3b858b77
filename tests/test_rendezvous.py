"""fs.init's rendezvous: one job per store, and waits that end on Ctrl-C (real launches).

* a second job started on the port of a running job is refused at once on the ranks that reach
  the running job's store, with a message naming the port, both jobs and the fix; the running
  job goes on undisturbed (before: the second job's rank 1 joined the running job's gloo mesh and
  waited in its first collective until the 30-minute timeout);
* Ctrl-C while ranks wait for a slow rank 0 ends every rank within seconds, each saying why
  (before: the ranks sat in the store's connect, in C++, until the launcher killed them, silently);
* each of the rendezvous' errors, in full (in process, on a store the test hosts).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fshard import _rendezvous
from fshard._env import free_port
from fshard._errors import FshardError

ROOT = Path(__file__).resolve().parent.parent
ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ENV_VARS += ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")
FIX = (
    "Another job is using port {port}. Give this job a port of its own (`python -m fshard.run --master-port` / "
    "`torchrun --master-port`, or MASTER_PORT), or leave the port out so that the launcher picks a free one."
)


def _clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _wait_for(paths, proc, seconds, what):
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, f"{what}: the launcher ended early ({proc.returncode})"
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.1)


def _end(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.communicate(timeout=30)


# --- 1. a second job on a taken port ------------------------------------------------------------------

JOB_SCRIPT = """
import os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
import fshard as fs

out, role = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
(out / f"{role}-id{rank}").write_text(os.environ["TORCHELASTIC_RUN_ID"])
if role == "B" and rank == 0:
    time.sleep(300)  # slow to start: rank 1 reaches the port first
fs.init()
step = 0
while True:
    stop = torch.tensor([float(rank == 0 and (out / "stop").exists())])
    dist.broadcast(stop, 0)
    if stop.item():
        break
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x)
    assert x.tolist() == [3.0, 3.0, 3.0], x  # 1 + 2
    step += 1
    (out / f"{role}-step{rank}.part").write_text(str(step))
    os.replace(out / f"{role}-step{rank}.part", out / f"{role}-step{rank}")
    time.sleep(0.05)
print(f"{role} rank {rank}: {step} steps", flush=True)
"""


@pytest.mark.parametrize("first", ["fshard.run", "torchrun"])
def test_a_second_job_on_the_port_of_a_running_job_is_refused_and_the_running_job_goes_on(tmp_path, first):
    # The running job under fshard.run (its rank 0 hosts the store) or torchrun (its agent does);
    # the second under fshard.run. (A second torchrun's agent fails to host the store itself.)
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    port = free_port()

    def start(role):
        launcher = (
            ["fshard.run", "-n"]
            if role == "B" or first == "fshard.run"
            else ["torch.distributed.run", "--nproc-per-node"]
        )
        cmd = [sys.executable, "-m", *launcher, "2", "--master-port", str(port), str(script)]
        return subprocess.Popen(
            [*cmd, str(tmp_path), role],
            env=_clean_env(),
            cwd=str(ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    a = start("A")
    b = None
    try:
        _wait_for([tmp_path / "A-step0", tmp_path / "A-step1"], a, 100, "job A training")
        b = start("B")
        _wait_for([tmp_path / "B-id1"], b, 100, "job B's rank 1 starting")
        started = time.monotonic()
        _, b_err = b.communicate(timeout=60)  # before: rank 1 waited in A's collective for 30 minutes
        took = time.monotonic() - started
        steps_then = int((tmp_path / "A-step0").read_text())
        time.sleep(1.0)
        assert a.poll() is None, "job A was disturbed"
        assert int((tmp_path / "A-step0").read_text()) > steps_then, "job A stopped training"
        (tmp_path / "stop").write_text("")
        a_out, a_err = a.communicate(timeout=60)
    finally:
        for proc in (a, b):
            if proc is not None:
                _end(proc)
    assert a.returncode == 0, a_err
    assert "Traceback" not in a_err, a_err
    assert sorted(re.findall(r"A rank (\d): (\d+) steps", a_out)) and len(a_out.splitlines()) == 2, a_out
    assert b.returncode == 1, b_err
    assert took < 40, took
    run_a = (tmp_path / "A-id0").read_text()
    run_b = (tmp_path / "B-id1").read_text()
    assert run_a != run_b and run_b.startswith("fshard-")
    assert (
        run_a.startswith("fshard-") if first == "fshard.run" else run_a == "none"
    )  # torchrun's default rdzv id
    message = (
        f"fshard.init(): rank 1 of job '{run_b}' (2 ranks) reached the rendezvous store at 127.0.0.1:{port}, "
        f"which belongs to job '{run_a}' (2 ranks): this rank did not join it, and the other job goes on "
        f"undisturbed. {FIX.format(port=port)}"
    )
    lines = b_err.splitlines()
    assert f"fshard.FshardError: {message}" in lines, b_err
    said = [line for line in lines if line.startswith("fshard.run: rank")]
    assert said == [
        f"fshard.run: rank 1 (pid {said[0].split('pid ')[1].split(')')[0]}) raised fshard.FshardError: {message} and "
        "exited with code 1; terminating the 1 other running rank(s)"
    ], b_err


# --- 2. Ctrl-C while ranks wait for a slow rank 0 -----------------------------------------------------

SLOW_RANK0 = """
import os, sys, time
from pathlib import Path
import torch
import fshard as fs

rank = os.environ["RANK"]
(Path(sys.argv[1]) / f"pid{rank}").write_text(str(os.getpid()))
if rank == "0":
    time.sleep(300)  # slow to start
(Path(sys.argv[1]) / f"ready{rank}").write_text("")
fs.init()
print("joined", flush=True)
"""


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("launcher", ["fshard.run", "torchrun"])
def test_ctrl_c_while_ranks_wait_for_a_slow_rank_0_ends_every_rank_at_once_saying_why(tmp_path, launcher):
    script = tmp_path / "slow.py"
    script.write_text(SLOW_RANK0)
    port = free_port()
    if launcher == "fshard.run":
        cmd = ["fshard.run", "-n", "4", "--master-port", str(port)]
    else:
        cmd = ["torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(port)]
    proc = subprocess.Popen(
        [sys.executable, "-m", *cmd, str(script), str(tmp_path)],
        env=_clean_env(),
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pids = []
    try:
        _wait_for(
            [tmp_path / f"ready{r}" for r in (1, 2, 3)] + [tmp_path / "pid0"], proc, 100, "ranks starting"
        )
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(4)]
        time.sleep(1.5)  # in the rendezvous: the store's connect (fshard.run), the wait for rank 0 (torchrun)
        assert all(_running(pid) for pid in pids)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        while any(_running(pid) for pid in pids) and time.monotonic() - sent < 30:
            time.sleep(0.05)
        took = time.monotonic() - sent
        _, err = proc.communicate(timeout=60)
        ended = time.monotonic() - sent
    finally:
        _end(proc)
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    # Before: 10 s (fshard.run's SIGKILL) or 30 s (torchrun's), and nothing said. (torchrun's agent
    # itself takes its time to end, once its ranks have.)
    assert took < 5, (took, err)
    assert ended < (10 if launcher == "fshard.run" else 40), (ended, err)
    if launcher == "fshard.run":
        assert proc.returncode == 128 + signal.SIGINT, err
    # As a rule in the store's connect (fshard.run: rank 0 hosts it) or in the wait for rank 0 to say
    # which job it is (torchrun: the agent hosts the store); on a busy machine a rank may still be
    # on its way there.
    phase = "waiting for the store at|waiting for rank 0 to start the job at|joining the job at"
    what = rf"({phase}) [\w.]+:{port}"
    said = sorted(
        line for line in err.splitlines() if "interrupted" in line and line.startswith("fshard: rank")
    )
    assert len(said) == 3, err
    for rank, line in zip((1, 2, 3), said):
        assert re.fullmatch(rf"fshard: rank {rank}: interrupted \(SIGINT\) while {what}; ending", line), line
    if launcher == "fshard.run":
        assert (
            "fshard.run: SIGINT: passed on to the 4 running rank(s); those still running in 10 s will be "
            "killed (a second signal kills them now)"
        ) in err.splitlines(), err


# --- 3. each error of the rendezvous, in full ---------------------------------------------------------


@pytest.fixture
def host_store():
    """A store the test hosts, as a running job's rank 0 would."""
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    yield port, store
    del store


def _join(port, rank, *, hosts_store=False, timeout=30.0, prefix=None):
    from datetime import timedelta

    return _rendezvous.join(
        "127.0.0.1",
        port,
        rank,
        2,
        hosts_store=hosts_store,
        prefix=prefix,
        timeout=timeout,
        store_timeout=timedelta(seconds=10),
    )


def test_a_rank_of_another_job_is_refused_with_both_jobs_named(host_store, monkeypatch):
    port, store = host_store
    store.set(_rendezvous.JOB_KEY, json.dumps({"run_id": "fshard-aaaa", "world_size": 2}))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "fshard-bbbb")
    with pytest.raises(FshardError) as info:
        _join(port, 1)
    assert str(info.value) == (
        f"fshard.init(): rank 1 of job 'fshard-bbbb' (2 ranks) reached the rendezvous store at 127.0.0.1:{port}, "
        f"which belongs to job 'fshard-aaaa' (2 ranks): this rank did not join it, and the other job goes on "
        f"undisturbed. {FIX.format(port=port)}"
    )
    # Nothing of the intruder's was written: it only read.
    assert not store.check(["fshard/rank/1"]) and not store.check(["fshard/joined"])
    # Started by hand (no run id), with another world size:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    store.set(_rendezvous.JOB_KEY, json.dumps({"run_id": None, "world_size": 4}))
    with pytest.raises(
        FshardError, match=r"rank 1 of a job without a run id \(2 ranks\) reached .* belongs to a "
    ):
        _join(port, 1)


def test_a_second_copy_of_a_rank_is_refused(host_store, monkeypatch):
    port, store = host_store
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    store.set(_rendezvous.JOB_KEY, json.dumps({"run_id": None, "world_size": 2}))  # started by hand
    store.add("fshard/rank/1", 1)  # its rank 1 has joined
    with pytest.raises(FshardError) as info:
        _join(port, 1)
    assert str(info.value) == (
        f"fshard.init(): rank 1 of a job without a run id (2 ranks) reached the rendezvous store at "
        f"127.0.0.1:{port}, where a rank 1 has already joined: two copies of the job were started on the "
        f"same port (by hand, or under one run id); this one did not join. {FIX.format(port=port)}"
    )


def test_a_store_that_says_nothing_of_its_job_is_refused(host_store, monkeypatch):
    port, _ = host_store  # a program that does not join with fs.init (no job key)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "fshard-bbbb")
    monkeypatch.setattr(_rendezvous, "_OWNER_WAIT", 0.5)
    with pytest.raises(FshardError) as info:
        _join(port, 1)
    assert str(info.value) == (
        f"fshard.init(): rank 1 of job 'fshard-bbbb' (2 ranks) reached a rendezvous store at 127.0.0.1:{port} "
        "that did not say which job owns it within 0.5 s: it is not this job's (its rank 0 would have said "
        "so at once) but another program's, which does not join with fs.init; this rank did not join it. "
        f"{FIX.format(port=port)}"
    )


def test_rank_0_on_a_taken_port_says_so():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(FshardError) as info:
            _join(port, 0, hosts_store=True)
    assert str(info.value) == (
        f"fshard.init(): rank 0 cannot host the rendezvous store at 127.0.0.1:{port}: the port is already "
        f"in use. {FIX.format(port=port)}"
    )


def test_ranks_that_do_not_join_and_a_store_that_never_comes_are_named_at_the_timeout(
    host_store, monkeypatch
):
    host_port, _ = host_store
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    port = free_port()
    with pytest.raises(FshardError) as info:
        _join(port, 0, hosts_store=True, timeout=0.5)  # rank 1 never comes
    assert str(info.value) == (
        f"fshard.init(): rank 0 timed out after 0.5 s waiting for the other ranks to join at "
        f"127.0.0.1:{port}: rank 1 did not"
    )
    # In a launcher's store (torchrun's agent hosts it; the job's keys under a prefix of its own):
    with pytest.raises(FshardError) as info:
        _join(host_port, 1, timeout=0.5, prefix="fshard/run/attempt_0/")
    assert str(info.value) == (
        f"fshard.init(): rank 1 timed out after 0.5 s waiting for rank 0 to join at 127.0.0.1:{host_port}: "
        "rank 0 did not call fs.init()"
    )
    port = free_port()  # nothing listens there
    with pytest.raises(FshardError) as info:
        _join(port, 1, timeout=0.5)
    assert str(info.value) == (
        f"fshard.init(): rank 1 found no rendezvous store at 127.0.0.1:{port} (hosted by rank 0) within the "
        "rendezvous timeout: rank 0 did not start, or MASTER_ADDR/MASTER_PORT differ between the ranks"
    )


def test_the_ranks_of_one_job_join_and_share_the_store(monkeypatch):
    # The two ranks of one job, rank 1 first (it waits for rank 0's store), each on a thread.
    import threading

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "fshard-cccc")
    port = free_port()
    got = {}

    def rank(r):
        got[r] = _join(port, r, hosts_store=r == 0)

    one = threading.Thread(target=rank, args=(1,))
    one.start()
    time.sleep(0.3)
    rank(0)
    one.join(timeout=30)
    got[0].set("hello", "from 0")
    assert got[1].get("hello") == b"from 0"
    assert json.loads(got[1].get(_rendezvous.JOB_KEY)) == {"run_id": "fshard-cccc", "world_size": 2}
