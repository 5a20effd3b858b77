"""Peak resident memory of each contender, one contender per set of fresh rank processes.

The memory table of ``benchmarks.run`` reads the allocator through ``torch.profiler``, which does
not always see gloo's worker threads free collective buffers (its readings are upper bounds, and
they move by several MiB between runs). This script reads the operating system instead: glibc is
told to map every block of 64 KiB or more on its own (``MALLOC_MMAP_THRESHOLD_=65536``), so that a
freed tensor goes back to the system at once and the resident set follows the live tensors; the
peak (``VmHWM``) is reset after the first step (``/proc/self/clear_refs``) and read after the
timed ones. Columns, per rank (the largest rank shown): *between steps* = resident MiB after a
step; *step peak* = the highest resident MiB during the steps; *step rise* = their difference
(activations, gathered parameters, communication buffers). Linux only.

    python -m benchmarks.peak_rss --world 2 4 --bench gpt_fsdp --contenders fsdp2 fshard_layer fshard_layer_reshard
"""

from __future__ import annotations

import argparse
import os
import time


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _rank(bench: str, params: dict, name: str, steps: int) -> tuple[float, float]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .run import _build_all, _case_inputs

    rank, world = dist.get_rank(), dist.get_world_size()
    env = (rank, world, dist.group.WORLD, init_device_mesh("cpu", (world,), mesh_dim_names=("x",)))
    weights, data = _case_inputs(bench, params, world)
    preps, status = _build_all(env, bench, params, "adam", weights, data, {name}, clone=False)
    if status[name] != "ok":
        raise RuntimeError(f"{name}: {status[name]}")
    prep = preps[name]
    del weights, data
    prep.step()
    time.sleep(0.05)
    dist.barrier()
    between = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    for _ in range(steps):
        prep.step()
        time.sleep(0.02)
    return between / 1024, _status_kib("VmHWM") / 1024


def main() -> None:
    import fshard as fs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--bench", default="gpt_fsdp")
    ap.add_argument("--model", default="10x")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--contenders", nargs="+", required=True)
    a = ap.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by each rank's glibc at start
    params = {"model": a.model, "batch": a.batch}
    print(f"{a.bench} {params}: resident MiB per rank (largest rank), {a.steps} steps")
    print(f"{'world':>5s} {'contender':24s} {'between steps':>14s} {'step peak':>10s} {'step rise':>10s}")
    for world in a.world:
        for name in a.contenders:
            res = fs.launch(_rank, world, (a.bench, params, name, a.steps), timeout=600)
            between = max(r[0] for r in res)
            peak = max(r[1] for r in res)
            rise = max(r[1] - r[0] for r in res)
            print(f"{world:5d} {name:24s} {between:14.1f} {peak:10.1f} {rise:10.1f}", flush=True)


if __name__ == "__main__":
    main()
