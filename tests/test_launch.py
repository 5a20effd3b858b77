"""Multi-process tests of fshard._launch (init, launch, RankPool) and the fshard.run launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fshard._errors import FshardError, RankError
from fshard._launch import RankPool, init, launch

ROOT = Path(__file__).resolve().parent.parent
ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --- rank functions (module level: the ranks import them by reference) ---------------------------


def _rank_and_sum(scale=1.0, *, offset=0.0):
    import torch
    import torch.distributed as dist

    t = torch.tensor([scale * (dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item() + offset


def _fail_on(bad_rank):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank} at t={time.time()}")
    dist.all_reduce(torch.ones(1))  # blocks: the failed rank never joins
    return "unreachable"


def _exit_on(bad_rank, code):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        os._exit(code)
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def _pid():
    return os.getpid()


def _sleep(seconds):
    time.sleep(seconds)


def _init_twice():
    import torch.distributed as dist

    init()
    init()
    return dist.get_rank(), dist.get_world_size(), dist.get_backend(), os.environ["RANK"]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _expected(n, scale=1.0, offset=0.0):
    return [(r, n, scale * n * (n + 1) / 2 + offset) for r in range(n)]


# --- launch -----------------------------------------------------------------------------------------


# 1 and 2 ranks here; fs.launch on 3 ranks below. fs.launch is a one-shot RankPool, whose 4-rank
# world (start-up, results in rank order) every run_ranks(4, ...) test of the suite uses.
@pytest.mark.parametrize("n", [1, 2])
def test_launch_returns_per_rank_results(n):
    assert launch(_rank_and_sum, n, args=(2.0,), kwargs={"offset": 0.5}) == _expected(n, 2.0, 0.5)


def test_launch_raising_rank_reports_traceback_and_kills_blocked_ranks():
    with pytest.raises(RankError) as info:
        launch(_fail_on, 3, args=(1,))
    err = info.value
    failed_at = float(str(err).split("t=")[1].split()[0])
    assert time.time() - failed_at < 30  # well before gloo's own 60 s timeout would free them
    assert err.rank == 1
    assert "rank 1" in str(err)
    assert "deliberate failure on rank 1" in str(err)
    assert "ValueError" in err.remote_traceback and "_fail_on" in err.remote_traceback
    assert "[0, 2]" in str(err)  # the ranks blocked in all_reduce were killed


def test_launch_reports_rank_that_exits_without_raising():
    with pytest.raises(RankError, match="exited with code 3 without returning a result") as info:
        launch(_exit_on, 2, args=(1, 3))
    assert info.value.rank == 1


def test_unpicklable_function_is_rejected_before_reaching_the_ranks(ranks):
    with pytest.raises(FshardError, match="module level"):
        ranks(2, lambda: 1)


# --- RankPool and the conftest pools ------------------------------------------------------------------


def test_rank_pool_reuse_restart_and_timeout():
    with RankPool(2, grace=1.0) as pool:
        pids = pool.run(_pid)
        assert len(set(pids)) == 2 and pool.run(_pid) == pids  # same workers across jobs
        assert pool.run(_rank_and_sum) == _expected(2)

        with pytest.raises(RankError, match="deliberate failure on rank 0"):
            pool.run(_fail_on, 0)
        assert not any(_alive(pid) for pid in pids)  # broken world torn down
        new_pids = pool.run(_pid)  # transparently restarted
        assert set(new_pids).isdisjoint(pids)
        assert pool.run(_rank_and_sum, 3.0) == _expected(2, 3.0)

        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"timed out after 2 s: rank\(s\) \[0, 1\]") as info:
            pool.run(_sleep, 60, timeout=2)
        assert time.monotonic() - t0 < 20
        assert "_sleep" in str(info.value)  # the Python stacks of the hung ranks
        last_pids = pool.run(_pid)
        assert set(last_pids).isdisjoint(new_pids)
    assert not any(_alive(pid) for pid in last_pids)  # close() stopped the workers
    with pytest.raises(FshardError, match="closed"):
        pool.run(_pid)


def test_ranks_fixture_and_init_is_idempotent_inside_ranks(ranks):
    assert ranks(2, _init_twice) == [(0, 2, "gloo", "0"), (1, 2, "gloo", "1")]
    assert ranks(2, _rank_and_sum, offset=1.0) == _expected(2, 1.0, 1.0)


# --- init -------------------------------------------------------------------------------------------


def _clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def test_init_without_environment_makes_a_single_rank_world():
    code = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from fshard._launch import init
        init(); init()
        t = torch.ones(2); dist.all_reduce(t)
        print(dist.get_rank(), dist.get_world_size(), dist.get_backend(), t.tolist())
        dist.destroy_process_group()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "0 1 gloo [1.0, 1.0]"


def test_init_with_partial_environment_names_the_missing_variable(monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in the test process")
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(FshardError, match="MASTER_ADDR, MASTER_PORT") as info:
        init()
    assert "fshard.run" in str(info.value) and "torchrun" in str(info.value)
    assert not dist.is_initialized()


# --- python -m fshard.run ---------------------------------------------------------------------------


def _fshard_run(*args, timeout=60, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "fshard.run", *map(str, args)],
        env=_clean_env(),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def test_run_script_all_reduces(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, torch, torch.distributed as dist
            from fshard._launch import init
            init()
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            line = f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item()} argv {sys.argv[1:]}"
            sys.stdout.write(line + "\\n")  # one write: ranks share the pipe
            sys.stdout.flush()
            dist.destroy_process_group()
            """
        )
    )
    out = _fshard_run("-n", 2, script, "--flag", "x")
    assert out.returncode == 0, out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r} of 2 sum 3.0 argv ['--flag', 'x']" for r in range(2)]


def test_run_module_with_prefix_sets_torchrun_environment(tmp_path):
    (tmp_path / "fshard_run_probe.py").write_text(
        f"import os, sys\nprint(' '.join(f'{{k}}={{os.environ[k]}}' for k in {ENV_VARS!r}), *sys.argv[1:])\n"
    )
    env = _clean_env()
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "fshard.run", "--nprocs", "2", "--prefix"]
        + ["-m", "fshard_run_probe", "a", "-n", "5"],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.splitlines())
    assert len(lines) == 2
    port = lines[0].split("MASTER_PORT=")[1].split()[0]
    for rank, line in enumerate(lines):
        assert line == (
            f"[rank{rank}]: RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 "
            f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} a -n 5"
        )


def test_run_failing_rank_terminates_the_others(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(7)\ntime.sleep(60)\n"
    )
    t0 = time.monotonic()
    out = _fshard_run("-n", 3, script, timeout=60)
    assert time.monotonic() - t0 < 30
    assert out.returncode == 7
    assert "rank 1" in out.stderr


def test_run_forwards_sigterm(tmp_path):
    script = tmp_path / "sleepy.py"
    script.write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path({str(tmp_path)!r}, 'pid' + os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "fshard.run", "-n", "2", str(script)],
        env=_clean_env(),
        cwd=str(ROOT),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        pid_files = [tmp_path / f"pid{r}" for r in range(2)]
        deadline = time.monotonic() + 30
        while not all(f.exists() and f.read_text() for f in pid_files):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
        assert not any(_alive(int(f.read_text())) for f in pid_files)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- the shared environment rules -------------------------------------------------------------------


def test_pool_ranks_and_fshard_run_share_one_torchrun_environment():
    from fshard._env import torchrun_env

    assert torchrun_env(1, 4, 29500, agent_store=True) == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    elastic = torchrun_env(0, 2, 29500, agent_store=False, run_id="r1")
    assert elastic["TORCHELASTIC_RUN_ID"] == "r1" and elastic["ROLE_WORLD_SIZE"] == "2"
    assert elastic["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def test_exit_codes_are_described_and_passed_on_one_way():
    from fshard._env import describe_exit, exit_status

    assert [describe_exit(c) for c in (0, 3, -9, None)] == [
        "exited with code 0",
        "exited with code 3",
        "was killed by SIGKILL",
        "disappeared",
    ]
    assert [exit_status(c) for c in (0, 3, -9, -15)] == [0, 3, 137, 143]


def test_the_launcher_does_not_import_torch():
    # fshard.run and what it imports (fshard._env, fshard._errors) load without torch; the
    # package's own __init__ is bypassed here, since it imports the torch-based modules.
    code = textwrap.dedent(
        f"""
        import sys, types
        pkg = types.ModuleType("fshard")
        pkg.__path__ = [{str(ROOT / "fshard")!r}]
        sys.modules["fshard"] = pkg
        import fshard.run
        fshard.run._capacity_warnings(2, 2, 2**33)
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --- how ranks start: a fork server that imported torch once, or spawn ----------------------------


def _what_a_rank_sees():
    import torch.distributed as dist

    from fshard import _debug, _watchdog

    print(f"out of rank {dist.get_rank()}", flush=True)
    print(f"err of rank {dist.get_rank()}", file=sys.stderr, flush=True)
    return {
        "var": os.environ.get("FSHARD_TEST_VAR"),
        "debug": _debug.enabled,
        "tags": (_watchdog.S.tags, _watchdog.S.gather_tags),
        "sum": _rank_and_sum()[2],
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is used on Linux only")
@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_ranks_take_the_owners_environment_and_output_however_they_start(start, monkeypatch, capfd):
    # A forked rank has the fork server's environment and output streams; it must behave as a
    # spawned one: its owner's variables (set after the server started, and read by fshard when it
    # is imported) and its owner's stdout/stderr at the time the pool starts.
    from fshard import _launch

    with RankPool(2) as pool:  # the fork server exists from here on (in forkserver mode)
        pool.run(_rank_and_sum)
    monkeypatch.setenv("FSHARD_RANK_START", start)
    monkeypatch.setenv("FSHARD_TEST_VAR", "set-after-the-server-started")
    monkeypatch.setenv("FSHARD_DEBUG", "1")
    monkeypatch.setenv("FSHARD_DESYNC_TAGS", "all")
    assert _launch._context().get_start_method() == start
    with RankPool(2) as pool:
        seen = pool.run(_what_a_rank_sees)
    for got in seen:
        assert got["var"] == "set-after-the-server-started"
        assert got["debug"] is True
        assert got["tags"] == (True, True)
        assert got["sum"] == 3.0
    out, err = capfd.readouterr()
    assert sorted(line for line in out.splitlines() if line.startswith("out of rank")) == [
        "out of rank 0",
        "out of rank 1",
    ]
    assert sorted(line for line in err.splitlines() if line.startswith("err of rank")) == [
        "err of rank 0",
        "err of rank 1",
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is used on Linux only")
def test_a_changed_torch_variable_makes_ranks_spawn(monkeypatch):
    # torch reads some variables when it is imported: the fork server imported it with the values
    # it started with, so once one of them changes, ranks are spawned instead.
    from fshard import _launch

    monkeypatch.delenv("FSHARD_RANK_START", raising=False)
    with RankPool(1) as pool:
        pool.run(_rank_and_sum)
    assert _launch._context().get_start_method() == "forkserver"
    monkeypatch.setenv(
        "TORCH_SHOW_CPP_STACKTRACES", "1" if os.environ.get("TORCH_SHOW_CPP_STACKTRACES") != "1" else "0"
    )
    assert _launch._context().get_start_method() == "spawn"
