"""Compiled GPT steps: compiled fshard against eager fshard and the compiled torch-native recipe.

Not part of ``benchmarks.run`` (compiling takes tens of seconds per contender on a small CPU
machine): the compiled column of issue "compiled sharded steps", for the demo's GPT (one tensor per
parameter, ``benchmarks/gpt.py``) in three layouts. One step = zero the gradients, forward,
backward, gradients complete (no optimizer), on the global batch split over ``dp``. The contenders
are the builders of ``benchmarks.gpt`` and ``benchmarks.fshard_contenders`` (the same models as
``benchmarks.run``'s GPT benchmarks), eager and compiled:

* ``--layout dp``: fshard (``fs.shard_map(loss_fn)``, ``loss.backward()``) eager and under
  ``fs.compile`` (one graph, backward traced, gradient all-reduces bucketed by inductor); DDP eager
  and ``torch.compile(DDP(module))`` with ``loss.backward()`` outside (Dynamo's DDP optimizer splits
  the graph at the bucket boundaries). Reference: DDP compiled.
* ``--layout fsdp``: fshard with one ``fs.all_gather`` per split parameter at the top of the step,
  eager, compiled (``fs.compile`` buckets the all-gathers and reduce-scatters at eager's combining
  cap), and compiled with inductor's all-gather / reduce-scatter bucketing at inductor's own size
  cap (``bucket_all_gathers_fx`` / ``bucket_reduce_scatters_fx`` = "all", size determinators None);
  fshard with the demo's blocks through ``fs.fsdp_scan`` (one block gathered at a time, gathered
  again in the backward: the GPT benchmarks' ``fshard``), eager and compiled; FSDP2 (``fully_shard``
  per block and the root) eager and with ``torch.compile`` of the root module, backward outside.
  Reference: FSDP2 compiled.
* In every layout, "regions": the eager fshard step (and in the fsdp layout the eager
  ``fs.fsdp_scan`` step) with the demo's decoder block an ``fs.compile``'d function, a compiled
  region called for every layer (torchtitan's per-block compile, the form compiled FSDP2 takes
  here: one block compiled, the rest of the step eager).
* ``--layout dp_tp``: mesh (dp, tp=2) (dp = 1 on 2 ranks: pure tensor parallelism); fshard with the
  demo's dp x tp specs, eager and compiled; DTensor TP (``parallelize_module``) + DDP over dp, eager
  and ``torch.compile`` of the DDP module. Reference: DTensor compiled.

Every contender's loss and gradients (gathered to full tensors, the demo's layout) are checked
against eager fshard's before timing: a contender with a missing or wrong gradient is an error, not
a result. Then all are timed in interleaved rounds (each round a different rotation). Rank 0
prints per contender the median and minimum wall time per step, the ratio to the reference, the
first call (in the timing run, compiled one after the other), the number of graphs Dynamo compiled
on it, and the collectives of one step (torch profiler events of the c10d / functional collective
ops; bucketed collectives count once). Unless ``--no-first-alone``, each compiled contender's first
call is also timed alone, in fresh processes with inductor's caches off, with Dynamo's tracing and
the C++ compiler's seconds.

    python -m benchmarks.compiled --world 2 --model demo --layout dp --rounds 9 --steps 3
    python -m benchmarks.compiled --layout fsdp --only "fshard fsdp_scan regions"
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist

import fshard as fs

from . import gpt
from .timing import timed_block

REFERENCE = {"dp": "DDP compiled", "fsdp": "FSDP2 compiled", "dp_tp": "DTensor compiled"}
# inductor's all-gather / reduce-scatter bucketing at its own size cap: the size determinators set back
# to inductor's default (None), over the cap fs.compile sets (eager's combining cap)
BUCKET_AG_RS = {
    "bucket_all_gathers_fx": "all",
    "bucket_all_gathers_fx_bucket_size_determinator": None,
    "bucket_reduce_scatters_fx": "all",
    "bucket_reduce_scatters_fx_bucket_size_determinator": None,
}


def contenders(layout: str) -> list[str]:
    """The contenders of ``layout``, in the order they are built and first called."""
    native = {"dp": "DDP", "fsdp": "FSDP2", "dp_tp": "DTensor"}[layout]
    out = ["fshard eager", "fshard compiled", "fshard regions"]
    if layout == "fsdp":
        out += ["fshard compiled ag/rs buckets", "fshard fsdp_scan eager", "fshard fsdp_scan compiled"]
        out += ["fshard fsdp_scan regions"]
    return out + [f"{native} eager", f"{native} compiled"]


def _ctx(layout: str, model: str, batch: int, weights, tokens):
    from .common import Ctx

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _ctx.__dict__.get("mesh")
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = _ctx.__dict__["mesh"] = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
    return Ctx(
        rank,
        world,
        dist.group.WORLD,
        mesh,
        f"gpt_{layout}",
        {"model": model, "batch": batch},
        None,
        {k: v.clone() for k, v in weights.items()},
        {"tokens": tokens.clone()},
    )


def _fshard(
    ctx, backend: str | None, options: dict | None = None, scan: bool = False, regions: str | None = None
):
    """The fshard step; with ``backend``, the loss and ``loss.backward()`` under ``fs.compile`` (the
    gradients set to None outside, as every contender does inside its step). In the fsdp layout the
    split parameters are gathered one leaf at a time at the top of the step, or (``scan``) per block
    by the demo's ``fs.fsdp_scan``."""
    from .common import Prepared
    from .fshard_contenders import _gather_per_leaf, _gpt_values, gpt_loss

    gather = _gather_per_leaf if ctx.bench == "gpt_fsdp" and not scan else None
    f, params, tokens, flat = gpt_loss(ctx, gather=gather)
    locals_ = [p.local for p in flat.values()]

    def inner(params, tokens):
        loss = f(params, tokens)
        loss.backward()
        return loss.detach()

    if backend is not None:
        # a code object of its own: Dynamo caches graphs per code object, and two compiled variants
        # (with and without extra inductor options) must not share one
        tag = f"{'scan_' if scan else ''}{len(options or {})}"
        inner.__code__ = inner.__code__.replace(co_name=f"fshard_step_{tag}")
        inner = fs.compile(inner, backend=backend, options=options)

    if regions is not None:  # eager step, each decoder block an fs.compile'd region (one graph for all)
        from fshard_demo import model as demo

        plain_block = demo.block

        def blk_fn(blk, x, cfg):
            return plain_block(blk, x, cfg)

        blk_fn.__code__ = blk_fn.__code__.replace(co_name=f"fshard_block_{ctx.bench}")
        region_block = fs.compile(blk_fn, backend=regions)

        def step():
            for t in locals_:
                t.grad = None
            demo.block = region_block
            try:
                return inner(params, tokens)
            finally:
                demo.block = plain_block

        return Prepared(step, _gpt_values(ctx, lambda: {n: p.grad for n, p in flat.items()}))

    def step():
        for t in locals_:
            t.grad = None
        return inner(params, tokens)

    return Prepared(step, _gpt_values(ctx, lambda: {n: p.grad for n, p in flat.items()}))


def build(name: str, ctx, backend: str):
    """Contender ``name`` (see ``contenders``) on ``ctx``: a ``Prepared``."""
    compiled = backend if name.endswith(("compiled", "buckets")) else None
    if name.startswith("fshard") and name.endswith("regions"):
        return _fshard(ctx, None, scan="fsdp_scan" in name, regions=backend)
    if name.startswith("fshard"):
        options = BUCKET_AG_RS if name.endswith("buckets") else None
        return _fshard(ctx, compiled, options, scan="fsdp_scan" in name)
    native = {"DDP": gpt.ddp, "FSDP2": gpt.fsdp2, "DTensor": gpt.dtensor_tp_ddp}[name.split()[0]]
    return native(ctx, backend=compiled)


_COLLECTIVE_NS = ("c10d::", "_c10d_functional::", "c10d_functional::")


def count_collectives(step) -> dict[str, int]:
    """Collective ops of one call of ``step``, from the torch profiler's CPU events (eager and
    compiled code alike call them through the dispatcher): ``c10d::*`` (torch.distributed, DDP,
    FSDP2) and ``_c10d_functional::*`` (DTensor, compiled graphs), the outermost one only (a
    functional collective runs a ``c10d`` one); waits are not counted."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    dist.barrier()

    def collective(e) -> bool:
        skip = ("wait", "barrier", "_wrap_tensor_autograd")
        return e.name.startswith(_COLLECTIVE_NS) and not any(s in e.name for s in skip)

    def outermost(e) -> bool:  # a functional collective calls the c10d op inside it: counted once
        parent = e.cpu_parent
        while parent is not None:
            if collective(parent):
                return False
            parent = parent.cpu_parent
        return True

    ops = Counter(e.name for e in prof.events() if collective(e) and outermost(e))
    return dict(sorted(ops.items()))


def _check(name: str, got: dict, ref: dict) -> None:
    for k in ref:
        if got.get(k) is None:
            raise AssertionError(f"{name}: no value for {k}")
        torch.testing.assert_close(
            got[k], ref[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{name}: {k}: {m}"
        )


def _values(name: str, prep, loss) -> dict:
    try:
        return prep.values(loss)
    except (AttributeError, TypeError) as e:  # a None gradient where a tensor was expected
        raise AssertionError(f"{name}: gradients missing ({type(e).__name__}: {e})") from e


def _compile_stats() -> dict[str, float]:
    """Seconds spent in Dynamo's bytecode tracing and in the C++ compiler, from Dynamo's metrics."""
    from torch._dynamo.utils import compile_times

    out = {"trace": 0.0, "cc": 0.0}
    for line in compile_times(repr="str").splitlines():
        name, _, vals = line.partition(", ")
        key = {"bytecode_tracing": "trace", "compile_file": "cc"}.get(name)
        if key:
            out[key] += sum(float(v) for v in vals.split(", "))
    return out


def _inputs(model: str, batch: int):
    cfg = gpt.MODELS[model]
    return gpt.make_weights(cfg), gpt.make_tokens(cfg, batch)["tokens"]


def _selected(layout: str, only) -> list[str]:
    """``contenders(layout)``, or those named in ``only`` with eager fshard (every contender's values
    are checked against it) and the layout's reference."""
    names = contenders(layout)
    if not only:
        return names
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise SystemExit(f"--only: no contender {unknown} in layout {layout}; its contenders: {names}")
    keep = {"fshard eager", REFERENCE[layout], *only}
    return [n for n in names if n in keep]


def _first_call(layout: str, name: str, model: str, batch: int, backend: str) -> dict[str, float]:
    """One compiled contender's first call, in fresh processes with inductor's caches off (kernels
    compiled for an earlier contender in the same process would otherwise be reused)."""
    torch.manual_seed(0)
    torch._inductor.config.compile_threads = 1
    torch._inductor.config.force_disable_caches = True
    weights, tokens = _inputs(model, batch)
    prep = build(name, _ctx(layout, model, batch, weights, tokens), backend)
    dist.barrier()
    t0 = time.perf_counter()
    prep.step()
    dist.barrier()
    return {"first": time.perf_counter() - t0, **_compile_stats()}


def _rank(
    layout: str, model: str, batch: int, steps: int, rounds: int, backend: str, only: tuple = ()
) -> dict:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 4
    torch._inductor.config.compile_threads = 1  # the ranks share the machine's cores
    weights, tokens = _inputs(model, batch)
    names = _selected(layout, only)
    preps = {n: build(n, _ctx(layout, model, batch, weights, tokens), backend) for n in names}
    first: dict[str, float] = {}
    graphs: dict[str, int] = {}
    vals: dict[str, dict] = {}
    for name in names:
        before = counters["stats"]["unique_graphs"]
        dist.barrier()
        t0 = time.perf_counter()
        loss = preps[name].step()
        dist.barrier()
        first[name] = time.perf_counter() - t0
        graphs[name] = counters["stats"]["unique_graphs"] - before
        vals[name] = _values(name, preps[name], loss)
    # every contender's loss and gradients are eager fshard's (fp32 tolerance)
    for name in names[1:]:
        _check(name, vals[name], vals["fshard eager"])
    del vals
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(timed_block(preps[name].step, steps))
    comms = {name: count_collectives(preps[name].step) for name in names}
    recompiles = counters["stats"]["unique_graphs"] - sum(graphs.values())
    return {"times": times, "first": first, "graphs": graphs, "comms": comms, "recompiles": recompiles}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", default="demo", choices=sorted(gpt.MODELS))
    ap.add_argument("--layout", default="dp", choices=sorted(REFERENCE))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument(
        "--no-first-alone",
        action="store_true",
        help="skip timing each compiled contender's first call alone in fresh processes",
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated contenders to run (with eager fshard and the reference), e.g. "
        "'fshard regions,fshard fsdp_scan regions'",
    )
    a = ap.parse_args()
    only = tuple(n.strip() for n in a.only.split(",") if n.strip())
    names = _selected(a.layout, only)
    dp, tp = gpt.mesh_shape(a.layout, a.world)
    run_args = (a.layout, a.model, a.batch, a.steps, a.rounds, a.backend, only)
    res = fs.launch(_rank, a.world, run_args, timeout=3600)[0]
    firsts = {}
    if not a.no_first_alone:
        for name in names:
            if name.endswith(("compiled", "buckets", "regions")):
                args = (a.layout, name, a.model, a.batch, a.backend)
                firsts[name] = fs.launch(_first_call, a.world, args, timeout=3600)[0]
    cfg = gpt.MODELS[a.model]
    ref_name = REFERENCE[a.layout]
    with open("/proc/loadavg") as fh:
        load = " ".join(fh.read().split()[:3])
    print(
        f"layout {a.layout} (mesh dp={dp} x tp={tp}), model {a.model} ({cfg.n_params / 1e6:.2f}M "
        f"parameters), batch {a.batch}, world {a.world}, backend {a.backend}, {a.rounds} rounds x "
        f"{a.steps} steps; graphs compiled after the first calls: {res['recompiles']}; load {load}"
    )
    print(
        f"{'contender':30s} {'median ms':>9s} {'min ms':>8s} {'vs ' + ref_name:>20s} "
        f"{'first call s':>12s} {'graphs':>6s} {'collectives':>11s}"
    )
    ref = statistics.median(res["times"][ref_name])
    for name, ts in res["times"].items():
        med = statistics.median(ts)
        print(
            f"{name:30s} {1e3 * med:9.2f} {1e3 * min(ts):8.2f} {med / ref:20.3f} "
            f"{res['first'][name]:12.1f} {res['graphs'][name]:6d} {sum(res['comms'][name].values()):11d}"
        )
    print("collectives of one step (rank 0):")
    for name, ops in res["comms"].items():
        print(f"  {name:30s} " + ", ".join(f"{k} x{v}" for k, v in ops.items()))
    if firsts:
        print(
            "first call alone (fresh processes, inductor caches off): seconds; of which Dynamo "
            "tracing, C++ compiler"
        )
        ref_first = firsts[ref_name]["first"]
        for name, st in firsts.items():
            print(
                f"{name:30s} {st['first']:6.1f} s ({st['first'] / ref_first:.2f}x {ref_name}); "
                f"tracing {st['trace']:.1f} s, C++ {st['cc']:.1f} s"
            )


if __name__ == "__main__":
    main()
