"""A rank that finishes exits with code 0, every time, within a bounded time (real gloo ranks).

A gloo group's threads (two workers and a transport loop per group) end only when the group
object is freed; ``destroy_process_group`` does not free the groups fshard's meshes hold. Left
alive into interpreter shutdown, a worker that frees a finished collective's tensors calls into a
finalizing interpreter and the rank aborts after its script has finished ("terminate called
without an active exception"). fshard's exit hook (and a pool rank's end) therefore releases the
meshes' groups while the interpreter is whole, and nothing else of fshard may keep a group (a
table keyed by groups did, once), nor may torch's functions whose default argument is the world
group (``torch.distributed.nn.functional``, imported with ``torch._dynamo`` after ``fs.init``).
Checked here by listing the threads of each rank from an exit hook that runs after fshard's, on a
4-rank job doing what the demo does, eager and compiled, with and without the desync tags.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_ranks

ROOT = Path(__file__).resolve().parent.parent
ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BOUND = 150.0  # seconds the whole 4-rank job may take, start to exit (15-40 s on a busy machine)

SCRIPT = """
import atexit, os, sys
import torch, torch.distributed as dist
import fshard as fs
from fshard._errors import MeshError

def threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as fh:
                names.append(fh.read().strip())
        except FileNotFoundError:  # the thread ended between the listing and the read: not running
            pass
    return names

def after_fshard():  # registered before fs.init: runs after fshard's exit hook (LIFO)
    gloo = sorted(n for n in threads() if "gloo" in n)
    try:
        mesh.axis_group("dp").group
        late = "no error"
    except MeshError as exc:
        late = str(exc)
    print(f"rank {os.environ['RANK']} at exit: gloo threads {gloo}; late use: {late}", flush=True)

atexit.register(after_fshard)
fs.init()
# Imported after the world exists (as torch._dynamo does): its functions' default arguments
# (group=group.WORLD) then hold the world group.
import torch.distributed.nn.functional
rank = dist.get_rank()
mesh = fs.Mesh(dp=2, tp=2)
gen = torch.Generator().manual_seed(0)
w = torch.randn(8, 8, generator=gen)
x = torch.randn(8, 8, generator=gen)

@fs.shard_map(mesh=mesh, in_specs=("(dp a) (tp b)", "(dp n) a"), out_specs="")
def loss(w, x):
    w = fs.all_gather(w, "dp", dim=0, async_op=True, tiled=True).wait()
    return fs.pmean(fs.psum((x @ w).square().sum(), "tp"), "dp")

value, grad = fs.value_and_grad(loss)(fs.shard(w, mesh, "(dp a) (tp b)"), x)
ref_w = w.clone().requires_grad_(True)
ref = (x @ ref_w).square().sum() / 2
ref.backward()
assert torch.allclose(value, ref.detach(), rtol=1e-5), (value, ref)
assert torch.allclose(grad.full(), ref_w.grad, rtol=1e-5)
if sys.argv[1] == "fshard-destroys":  # the compiled path: functional collectives by group name
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = compiled(fs.shard(w, mesh, "(dp a) (tp b)"), x)
    assert torch.allclose(got, ref.detach(), rtol=1e-5), (got, ref)
busy = sorted(n for n in threads() if "gloo" in n)
print(f"rank {rank} running: {len(busy)} gloo threads", flush=True)
if sys.argv[1] == "script-destroys":  # the demo's ending: the script tears the default group down
    dist.barrier()
    dist.destroy_process_group()
"""


def _clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


@pytest.mark.timeout(180)  # 4 ranks compiling on 2 busy cores; the bound is asserted below
@pytest.mark.parametrize("ending", ["fshard-destroys", "script-destroys"])
def test_a_finished_4_rank_job_exits_0_with_every_gloo_thread_ended(tmp_path, ending):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = _clean_env()
    if ending == "script-destroys":
        env["FSHARD_DESYNC_TAGS"] = "1"  # the opt-in tags: their own collectives on every group
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "fshard.run", "-n", "4", str(script), ending],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=170,  # below the test's timeout; the bound that matters is asserted below
    )
    assert time.monotonic() - t0 < BOUND
    assert out.returncode == 0, out.stdout + out.stderr
    assert "terminate called" not in out.stderr
    assert "Warning" not in out.stderr, out.stderr  # the release reads torch.distributed quietly
    late = (
        "this mesh's process groups were torn down (at exit, or at the end of a pool job); "
        "build a new fs.Mesh after fs.init()"
    )
    for rank in range(4):
        # While running: a world group, a dp group and a tp group, each with its gloo threads.
        running = re.search(rf"rank {rank} running: (\d+) gloo threads", out.stdout)
        assert running and int(running.group(1)) >= 6, out.stdout
        # After fshard's exit hook: none left for interpreter shutdown.
        assert f"rank {rank} at exit: gloo threads []; late use: {late}" in out.stdout, out.stdout


CASE = """
def f(x, group=None):
    return group

def g(x, *, group=None):
    return group

class C:
    def m(self, group=None):
        return group
"""


def _rank_destroyed_defaults():
    import types

    import torch.distributed as dist

    from fshard import _env

    sub = dist.new_group([0, 1])
    mod = types.ModuleType("torch.distributed._fshard_defaults_case")
    exec(CASE, mod.__dict__)
    mod.f.__defaults__ = (sub,)
    mod.g.__kwdefaults__ = {"group": sub}
    mod.C.m.__defaults__ = (sub,)
    world = dist.group.WORLD
    exec("def live(x, group=WORLD):\n    return group", {"WORLD": world}, mod.__dict__)
    sys.modules[mod.__name__] = mod
    try:
        _env._drop_destroyed_defaults()  # every group alive: nothing changes
        before = [mod.f(0) is sub, mod.g(0) is sub, mod.C().m() is sub, mod.live(0) is world]
        dist.destroy_process_group(sub)
        _env._drop_destroyed_defaults()
        after = [mod.f(0), mod.g(0), mod.C().m(), mod.live(0) is world]
    finally:
        del sys.modules[mod.__name__]
    return before, after


def test_destroyed_groups_in_torch_default_arguments_become_none_and_live_ones_stay():
    # torch.distributed.nn.functional's group=group.WORLD defaults would keep a destroyed world
    # (and its threads) alive; None means the default group to c10d.
    for before, after in run_ranks(2, _rank_destroyed_defaults):
        assert before == [True, True, True, True]
        assert after == [None, None, None, True]
