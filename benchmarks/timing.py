"""Timing (wall + main-thread CPU), collective counting and per-rank memory accounting.

All functions here run inside one rank and are called by every rank in the same order.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .common import Prepared

# ----------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------


def time_contenders(preps: dict[str, Prepared], *, warmup: int, steps: int, rounds: int,
                    group=None) -> dict[str, dict[str, list[float]]]:
    """Per-step wall and main-thread CPU seconds for every contender.

    Every contender first runs ``warmup`` untimed steps. Then ``rounds`` rounds run; in each, every
    contender in turn (same fixed order every round) runs ``steps // rounds`` timed steps after a
    barrier, so slow drift (thermal, other load) hits all contenders alike. The garbage collector is
    collected before and disabled during each timed block. CPU time is ``time.thread_time()`` of the
    calling thread: work done by gloo's own threads is not in it, waiting for them is wall time only.
    """
    names = list(preps)
    for name in names:
        dist.barrier(group=group)
        step = preps[name].step
        for _ in range(warmup):
            step()
    per_round = max(1, steps // max(1, rounds))
    out = {n: {"wall": [], "cpu": []} for n in names}
    perf, tt = time.perf_counter, time.thread_time
    for _ in range(rounds):
        for name in names:
            step = preps[name].step
            wall, cpu = out[name]["wall"], out[name]["cpu"]
            gc.collect()
            dist.barrier(group=group)
            gc.disable()
            try:
                for _ in range(per_round):
                    w0, c0 = perf(), tt()
                    step()
                    c1, w1 = tt(), perf()
                    wall.append(w1 - w0)
                    cpu.append(c1 - c0)
            finally:
                gc.enable()
    return out


def summarize(samples: dict[str, list[float]]) -> dict[str, float]:
    w, c = samples["wall"], samples["cpu"]
    return {
        "wall_median": statistics.median(w),
        "cpu_median": statistics.median(c),
        "wall_p10": _quantile(w, 0.1),
        "wall_p90": _quantile(w, 0.9),
        "n": len(w),
    }


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# ----------------------------------------------------------------------------------------------------------
# Collective counting
# ----------------------------------------------------------------------------------------------------------

_COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd", "monitored_barrier")


def _tensor_bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


class CommCounter(TorchDispatchMode):
    """Counts collectives that reach the dispatcher: ``c10d.*`` (torch.distributed calls, DDP, FSDP2 --
    including the ones the autograd engine issues in backward) and ``_c10d_functional.*`` (DTensor).

    DTensor arguments are passed on (``NotImplemented``) so DTensor can desugar into the functional
    collectives first; those come back here as plain-tensor ops and are counted then.

    bytes of a collective = the largest of its tensor arguments (summed over lists): the full buffer of an
    all_reduce, the gathered output of an all_gather, the full input of a reduce_scatter.
    """

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}
        self.count = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(_is_dtensor_type(t) for t in types):
            return NotImplemented
        ns = getattr(func, "namespace", "")
        if ns in _COMM_NAMESPACES:
            key = str(func)  # e.g. "c10d.allreduce_.default"
            if not any(skip in key for skip in _NOT_COLLECTIVES):
                self.ops[key] = self.ops.get(key, 0) + 1
                self.count += 1
                sizes = [_tensor_bytes(a) for a in args] + [_tensor_bytes(v) for v in kwargs.values()]
                self.bytes += max(sizes, default=0)
        return func(*args, **kwargs)


def _is_dtensor_type(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, type) and issubclass(t, DTensor)


def count_comms(prep: Prepared, group=None) -> dict[str, Any]:
    """Collectives of one step (after warm-up, so lazy one-time set-up traffic is not counted)."""
    dist.barrier(group=group)
    with CommCounter() as c:
        prep.step()
    dist.barrier(group=group)
    return {"count": c.count, "bytes": c.bytes, "ops": dict(sorted(c.ops.items()))}


# ----------------------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors count their local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def _quiet_stderr():
    """The CPU profiler prints start/stop lines and allocation warnings on fd 2; hide them."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def step_transient_peak(prep: Prepared) -> int | None:
    """Peak bytes allocated above the level at the start of a step (CPU allocator, via the profiler).

    Two steps are profiled and only the second is measured, so every block it frees was allocated under
    the profiler and is accounted (blocks from before profiling are freed "of unknown size").
    """
    try:
        from torch.profiler import ProfilerActivity, profile, record_function
    except ImportError:  # pragma: no cover
        return None
    marker = "fshard_bench_measured_step"
    with _quiet_stderr():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            prep.step()
            with record_function(marker):
                prep.step()
    try:
        events = list(prof.profiler.kineto_results.events())
    except AttributeError:  # pragma: no cover - profiler internals moved
        return None
    starts = [e.start_ns() for e in events if e.name() == marker]
    if not starts:
        return None
    t0 = min(starts)
    mem = sorted((e.start_ns(), e.nbytes()) for e in events
                 if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    level, peak = 0, 0
    for ts, nbytes in mem:
        if ts < t0:
            continue
        level += nbytes
        peak = max(peak, level)
    return peak


def measure_memory(prep: Prepared, group=None) -> dict[str, Any] | None:
    """Bytes this rank keeps between steps (params / grads / optimizer state) and the step's peak."""
    if prep.state is None:
        return None
    dist.barrier(group=group)
    st = prep.state()
    out = {k: storage_bytes(st.get(k, [])) for k in ("params", "grads", "optim")}
    out["state"] = out["params"] + out["grads"] + out["optim"]
    transient = step_transient_peak(prep)
    out["transient"] = transient
    out["peak"] = None if transient is None else out["state"] + transient
    dist.barrier(group=group)
    return out
