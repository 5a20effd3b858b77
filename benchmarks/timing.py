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


def time_contenders(
    preps: dict[str, Prepared], *, warmup: int, steps: int, rounds: int, group=None
) -> dict[str, dict[str, list[float]]]:
    """Per-step wall and main-thread CPU seconds for every contender.

    Every contender first runs ``warmup`` untimed steps. Then ``rounds`` rounds run; in each, every
    contender in turn (same fixed order every round) runs ``steps // rounds`` timed steps after a
    barrier, so slow drift (thermal, other load) hits all contenders alike. The garbage collector is
    frozen after one full collection, collected (young generations) before and disabled during each timed
    block. CPU time is ``time.thread_time()`` of the
    calling thread: work done by gloo's own threads is not in it, waiting for them is wall time only.
    """
    names = list(preps)
    # one full collection, then move everything that exists into the permanent generation so the cheap
    # young-generation collections before each block are all that is needed
    gc.collect()
    gc.freeze()
    try:
        return _time(preps, names, warmup, steps, rounds, group)
    finally:
        gc.unfreeze()


def timed_block(step, steps: int, group=None) -> float:
    """Wall seconds per step of ``steps`` calls of ``step``, between barriers (every rank's block
    starts together and ends when the slowest rank's does): one sample of an interleaved round."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier(group=group)
    return (time.perf_counter() - t0) / steps


def _time(preps, names, warmup, steps, rounds, group):
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
            gc.collect(1)
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
        if any(_defer_to_subclass(t) for t in types):
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


def _defer_to_subclass(t) -> bool:
    """Tensor subclasses that desugar into other ops (DTensor, and any user subclass, e.g. fshard's,
    with its own ``__torch_dispatch__``) are let through first, so that the collectives they issue come
    back to this mode. torch's internal subclasses (FakeTensor, FunctionalTensor) are not deferred."""
    if not isinstance(t, type) or t in (torch.Tensor, torch.nn.Parameter):
        return False
    if (t.__module__ or "").startswith("torch._subclasses"):
        return False
    return issubclass(t, torch.Tensor) and "__torch_dispatch__" in {
        k for c in t.__mro__ if c not in (torch.Tensor, torch._C.TensorBase, object) for k in vars(c)
    }


def count_comms(prep: Prepared, group=None) -> dict[str, Any]:
    """Collectives of one step (after warm-up, so lazy one-time set-up traffic is not counted)."""
    dist.barrier(group=group)
    fs_counts = None
    with contextlib.ExitStack() as stack:
        try:  # fshard's own record of what it issued (forward and backward), next to the dispatcher's
            import fshard

            fs_counts = stack.enter_context(fshard.count_collectives())
        except ImportError:
            pass
        c = stack.enter_context(CommCounter())
        prep.step()
    dist.barrier(group=group)
    out: dict[str, Any] = {"count": c.count, "bytes": c.bytes, "ops": dict(sorted(c.ops.items()))}
    if fs_counts is not None and fs_counts.total:
        out["fshard"] = {
            "count": fs_counts.total,
            "bytes": fs_counts.bytes,
            "kinds": {f"{k}[{','.join(a)}]": n for (k, a), n in sorted(fs_counts.by_kind().items())},
        }
    return out


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


class AllocProfile:
    """Records CPU allocator events (``torch.profiler``, profile_memory=True) over a region.

    Use ``with AllocProfile() as ap: <build>; <warm-up step>; for ...: with ap.measured(): step()``.
    Levels are counted from the region start. ``peak`` = the highest level reached during a measured
    step; ``kept`` = the level between measured steps and at the end (what stays allocated: parameters,
    gradients, optimizer state and any buffers or caches the contender keeps, e.g. DDP buckets).

    These readings are upper bounds: a block that the main thread allocated and a gloo worker thread
    frees (it holds collective buffers until it lets go of its work item) is not always reported as freed
    by the profiler, so stray blocks can pile up in the level. They never make a reading too low, so the
    smallest reading over the measured steps is kept (and ``run.py`` takes the smallest over ranks).
    Blocks allocated before the region and freed inside it are not seen either.
    """

    MARKER = "fshard_bench_measured_step_"

    def __init__(self):
        self.kept: int | None = None
        self.peak: int | None = None
        self._prof = None
        self._quiet = None
        self._n = 0

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._quiet = _quiet_stderr()
        self._quiet.__enter__()
        try:
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        except Exception:
            self._quiet.__exit__(None, None, None)
            raise
        return self

    def measured(self):
        from torch.profiler import record_function

        self._n += 1
        return record_function(f"{self.MARKER}{self._n}")

    def __exit__(self, *exc):
        try:
            self._prof.__exit__(*exc)
        finally:
            self._quiet.__exit__(None, None, None)
        if exc[0] is None:
            self._analyze()
        return False

    def _analyze(self) -> None:
        try:
            events = list(self._prof.profiler.kineto_results.events())
        except AttributeError:  # pragma: no cover - profiler internals moved
            return
        windows = sorted((e.start_ns(), e.end_ns()) for e in events if e.name().startswith(self.MARKER))
        mem = sorted(
            (e.start_ns(), e.nbytes())
            for e in events
            if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
        )
        level, k = 0, 0
        peaks = [None] * len(windows)
        starts = [None] * len(windows)
        for ts, nbytes in mem:
            while k < len(windows) and ts > windows[k][1]:
                k += 1
            for w in range(k, len(windows)):  # windows this event is at or before
                if starts[w] is None and ts >= windows[w][0]:
                    starts[w] = level
            level += nbytes
            if k < len(windows) and windows[k][0] <= ts <= windows[k][1]:
                peaks[k] = level if peaks[k] is None else max(peaks[k], level)
        for w in range(len(windows)):
            if starts[w] is None:
                starts[w] = level
        peaks = [p for p in peaks if p is not None]
        self.peak = min(peaks) if peaks else None
        self.kept = min(starts[1:] + [level])


def state_bytes(prep: Prepared) -> dict[str, int] | None:
    """Bytes of the params / grads / optimizer state this rank keeps (``Prepared.state``)."""
    if prep.state is None:
        return None
    st = prep.state()
    out = {k: storage_bytes(st.get(k, [])) for k in ("params", "grads", "optim")}
    out["state"] = out["params"] + out["grads"] + out["optim"]
    return out
