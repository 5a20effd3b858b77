"""Compiled data-parallel GPT steps: compiled fshard against eager fshard and compiled DDP.

Not part of ``benchmarks.run`` (compiling takes tens of seconds per contender on a small CPU
machine): the compiled column of issue "compiled sharded steps", for the demo's GPT in the
data-parallel layout. One step = forward, backward, gradients complete (no optimizer), on the
global batch split over ``dp``:

* ``fshard eager``: ``fs.shard_map(loss_fn)`` then ``loss.backward()`` (gradients in buckets);
* ``fshard compiled``: the same function under ``fs.compile`` (``torch.compile`` with
  ``fullgraph=True``, the backward traced, and with inductor the gradient all-reduces bucketed;
  see docs/tutorial/09-compiling.md);
* ``DDP eager`` and ``DDP compiled``: ``DistributedDataParallel`` over the ``nn.Module`` GPT, and
  ``torch.compile`` of the DDP module with ``loss.backward()`` outside (Dynamo's DDP optimizer
  splits the graph at bucket boundaries so that the all-reduces overlap the backward).

Each compiled contender is compiled on its first call (timed: "compile s"), checked against the
eager fshard gradients, then all are timed in interleaved rounds. Rank 0 prints the median and
minimum time per step, the ratio to compiled DDP, the first-call time and the graph count.

    python -m benchmarks.compiled --world 2 --model demo --backend inductor
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fshard as fs

from . import gpt


def _fshard(cfg, weights, tokens):
    from fshard_demo.model import loss_fn, param_specs

    mesh = fs.Mesh(dp=dist.get_world_size(), tp=1)
    specs = param_specs(cfg, "dp")
    flat = {n: w.clone().requires_grad_(True) for n, w in weights.items()}
    params = gpt.to_tree(flat, cfg)
    f = fs.shard_map(lambda p, t: loss_fn(p, t, cfg), mesh=mesh, in_specs=(specs, "(dp b) t"), out_specs="")

    def step(params, tokens):
        loss = f(params, tokens)
        loss.backward()
        return loss.detach()

    def grads():
        return {n: t.grad for n, t in flat.items()}

    def zero():
        for t in flat.values():
            t.grad = None

    return step, (params, tokens), grads, zero


def _ddp(cfg, weights, tokens, backend=None):
    """DDP's step; with ``backend``, ``torch.compile(DDP(module))`` (the documented way: Dynamo's DDP
    optimizer splits the forward graph at the bucket boundaries, the backward runs the compiled
    backward graphs with DDP's hooks). Compiling a step that calls ``loss.backward()`` on a DDP
    module with ``trace_autograd_ops`` is not a contender: in torch 2.13 it leaves every ``.grad``
    None and issues no all-reduce (every contender's gradients are checked in ``_rank``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = gpt.make_module(cfg, weights)
    model = DDP(module)
    if backend is not None:
        model = torch.compile(model, backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = tokens.tensor_split(world)[rank].contiguous()
    n_ans = cfg.digits + 1

    def step(model, local):
        logits = model(local[:, :-1])[:, -n_ans:]
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), local[:, -n_ans:].reshape(-1))
        loss.backward()
        return loss.detach()

    def zero():
        module.zero_grad(set_to_none=True)

    def grads():
        named = dict(module.named_parameters())
        out = {}
        for n in weights:
            mn, t = gpt.module_name(n)
            g = named[mn].grad
            out[n] = None if g is None else (g.T if t else g)
        return out

    return step, (model, local), grads, zero


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


def _first_call(which: str, model: str, batch: int, backend: str) -> dict[str, float]:
    """One compiled contender's first call, in fresh processes with inductor's caches off (kernels
    compiled for an earlier contender in the same process would otherwise be reused)."""
    torch.manual_seed(0)
    torch._inductor.config.compile_threads = 1
    torch._inductor.config.force_disable_caches = True
    cfg = gpt.MODELS[model]
    weights = gpt.make_weights(cfg)
    tokens = gpt.make_tokens(cfg, batch)["tokens"]
    if which == "fshard compiled":
        step, args, _, zero = _fshard(cfg, weights, tokens)
        step = fs.compile(step, backend=backend)
    else:
        step, args, _, zero = _ddp(cfg, weights, tokens, backend=backend)
    dist.barrier()
    t0 = time.perf_counter()
    step(*args)
    dist.barrier()
    return {"first": time.perf_counter() - t0, **_compile_stats()}


def _rank(model: str, batch: int, steps: int, rounds: int, backend: str) -> dict:
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 4
    torch._inductor.config.compile_threads = 1  # the ranks share the machine's cores
    cfg = gpt.MODELS[model]
    weights = gpt.make_weights(cfg)
    tokens = gpt.make_tokens(cfg, batch)["tokens"]
    fe_step, fe_args, fe_grads, fe_zero = _fshard(cfg, weights, tokens)
    fc_step, fc_args, fc_grads, fc_zero = _fshard(cfg, weights, tokens)
    de_step, de_args, de_grads, de_zero = _ddp(cfg, weights, tokens)
    dc_step, dc_args, dc_grads, dc_zero = _ddp(cfg, weights, tokens, backend=backend)
    compiled_fs = fs.compile(fc_step, backend=backend)
    contenders = {
        "fshard eager": (lambda: fe_step(*fe_args), fe_zero),
        "fshard compiled": (lambda: compiled_fs(*fc_args), fc_zero),
        "DDP eager": (lambda: de_step(*de_args), de_zero),
        "DDP compiled": (lambda: dc_step(*dc_args), dc_zero),
    }
    first: dict[str, float] = {}
    from torch._dynamo.utils import counters

    graphs: dict[str, int] = {}
    for name, (step, zero) in contenders.items():
        before = counters["stats"]["unique_graphs"]
        zero()
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        first[name] = time.perf_counter() - t0
        graphs[name] = counters["stats"]["unique_graphs"] - before
    # every contender's gradients are the eager fshard ones (fp32 tolerance; DDP averages over ranks
    # as the fshard loss, a mean over the global batch, does)
    eager = fe_grads()
    for label, got in (
        ("fshard compiled", fc_grads()),
        ("DDP eager", de_grads()),
        ("DDP compiled", dc_grads()),
    ):
        for n in eager:
            if got[n] is None:
                raise AssertionError(f"{label}: no gradient for {n}")
            torch.testing.assert_close(got[n], eager[n], rtol=1e-4, atol=1e-5, msg=f"{label}: {n}")
    times: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, zero = contenders[name]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                zero()
                step()
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / steps)
    recompiles = counters["stats"]["unique_graphs"] - sum(graphs.values())
    return {"times": times, "first": first, "graphs": graphs, "recompiles": recompiles}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", default="demo", choices=sorted(gpt.MODELS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--backend", default="inductor")
    a = ap.parse_args()
    res = fs.launch(_rank, a.world, (a.model, a.batch, a.steps, a.rounds, a.backend), timeout=3600)[0]
    firsts = {
        name: fs.launch(_first_call, a.world, (name, a.model, a.batch, a.backend), timeout=3600)[0]
        for name in ("fshard compiled", "DDP compiled")
    }
    cfg = gpt.MODELS[a.model]
    print(
        f"model {a.model} ({cfg.n_params / 1e6:.2f}M parameters), batch {a.batch}, world {a.world}, "
        f"backend {a.backend}; graphs compiled after the first calls: {res['recompiles']}"
    )
    print(
        f"{'contender':16s} {'median ms':>9s} {'min ms':>8s} {'vs DDP compiled':>15s} {'first call s':>12s} {'graphs':>6s}"
    )
    # first call: in the timing run (compiled contenders compiled one after the other, caches on)
    ref = statistics.median(res["times"]["DDP compiled"])
    for name, ts in res["times"].items():
        med = statistics.median(ts)
        print(
            f"{name:16s} {1e3 * med:9.2f} {1e3 * min(ts):8.2f} {med / ref:15.3f} "
            f"{res['first'][name]:12.1f} {res['graphs'][name]:6d}"
        )
    print(
        "first call alone (fresh processes, inductor caches off): seconds; of which Dynamo tracing, C++ compiler"
    )
    ref_first = firsts["DDP compiled"]["first"]
    for name, st in firsts.items():
        print(
            f"{name:16s} {st['first']:6.1f} s ({st['first'] / ref_first:.2f}x DDP compiled); "
            f"tracing {st['trace']:.1f} s, C++ {st['cc']:.1f} s"
        )


if __name__ == "__main__":
    main()
