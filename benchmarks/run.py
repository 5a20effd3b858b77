"""Entry point: ``python -m benchmarks.run --world 2 [4] [--smoke] [--verify]`` (from the repo root).

For each world size, ``world`` ranks are spawned (torch.multiprocessing, gloo on 127.0.0.1, a free port,
one torch thread each). Every rank runs every contender of every benchmark in the same process and in
the same fixed order, with interleaved timing rounds. Rank 0 gathers the per-rank numbers; the parent
writes ``RESULTS.md``, ``results.png`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import logging
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    commit, dirty = None, None
    try:
        root = HERE.parent
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "fshard"], cwd=root, capture_output=True, text=True
        ).stdout
        dirty = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "commit": commit,
        "dirty": dirty,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "load_start": _loadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _command(argv: list[str]) -> str:
    shown, skip = [], False
    for a in argv:  # output locations are machine paths: keep them out of the report
        if skip:
            skip = False
            continue
        if a == "--out-dir":
            skip = True
            continue
        if a.startswith("--out-dir="):
            continue
        shown.append(a)
    return " ".join(["python -m benchmarks.run", *map(shlex.quote, shown)])


# ----------------------------------------------------------------------------------------------------------
# Inside one rank
# ----------------------------------------------------------------------------------------------------------


_T0 = time.perf_counter()


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"{time.perf_counter() - _T0:6.1f}s {msg}", flush=True)


def _case_inputs(bench: str, params: dict, world: int):
    from .common import make_mlp_data, make_overhead_data, make_weights

    if bench == "shard_map_overhead":
        return {}, make_overhead_data(params["n_inputs"], params["rows"] * world, params["cols"])
    if bench.startswith("gpt_"):
        from . import gpt

        cfg = gpt.cfg_of(params)
        return gpt.make_weights(cfg), gpt.make_tokens(cfg, params["batch"])
    return make_weights(params["hidden"]), make_mlp_data(params["hidden"], params["batch"])


def _build_all(env, bench: str, params: dict, optim, weights, data, only=None, clone=True):
    """Build every registered contender of ``bench``; statuses agreed on by all ranks.

    Each contender gets its own copies of ``weights`` / ``data`` (``clone=False``: the given tensors,
    for a single contender whose inputs were made outside the measured region).
    """
    import torch.distributed as dist

    from .common import Ctx
    from .contenders import CONTENDERS, Unavailable, build

    rank, world, group, mesh = env
    preps, statuses = {}, {}
    for name, entry in CONTENDERS[bench].items():
        if only and name not in only:
            continue
        cp = (lambda d: {k: v.clone() for k, v in d.items()}) if clone else dict
        ctx = Ctx(rank, world, group, mesh, bench, dict(params), optim, cp(weights), cp(data))
        try:
            prep, status = build(entry, ctx), "ok"
        except Unavailable as e:
            prep, status = None, f"n/a: {e}"
        except Exception as e:  # a broken contender is reported, the others still run
            traceback.print_exc()
            prep, status = None, f"error: {type(e).__name__}: {e}"
        everyone = [None] * world
        dist.all_gather_object(everyone, status, group=group)
        bad = [s for s in everyone if s != "ok"]
        statuses[name] = bad[0] if bad else "ok"
        if not bad:
            preps[name] = prep
    return preps, statuses


def _verify_case(env, case, tol: float, only) -> dict:
    import torch.distributed as dist

    from .common import reference_values, rel_error
    from .contenders import BENCHES

    rank, world, group, _ = env
    optim = "sgd" if BENCHES[case.bench].optim else None
    weights, data = _case_inputs(case.bench, case.params, world)
    if case.bench.startswith("gpt_"):
        from . import gpt

        ref = gpt.reference_values(weights, data, gpt.cfg_of(case.params))
    else:
        ref = reference_values(case.bench, weights, data, optim)
    preps, statuses = _build_all(env, case.bench, case.params, optim, weights, data, only)
    res = {}
    for name, status in statuses.items():
        if status != "ok":
            res[name] = {"status": status}
            continue
        prep = preps[name]
        if prep.values is None:
            res[name] = {"status": "no values() hook", "passed": False}
            continue
        try:
            got = prep.values(prep.step())
            errs = {k: (rel_error(got[k], v) if k in got else float("inf")) for k, v in ref.items()}
            local = {"errs": errs, "exc": None}
        except Exception as e:
            traceback.print_exc()
            local = {"errs": {}, "exc": f"{type(e).__name__}: {e}"}
        every = [None] * world
        dist.all_gather_object(every, local, group=group)
        excs = [r["exc"] for r in every if r["exc"]]
        if excs:
            res[name] = {"status": f"error: {excs[0]}", "passed": False}
            continue
        merged = {k: max(r["errs"][k] for r in every) for k in ref}
        worst = max(merged, key=merged.get) if merged else ""
        missing = sorted(k for k, v in merged.items() if v == float("inf"))
        passed = all(v <= tol for v in merged.values())
        res[name] = {
            "status": "ok",
            "passed": passed,
            "max_rel_err": merged.get(worst, 0.0),
            "worst": worst,
            "missing": missing,
            "errs": merged,
        }
    del preps
    gc.collect(1)
    return res


def _gather_to_rank0(obj, env):
    import torch.distributed as dist

    rank, world, group, _ = env
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def _time_case(env, case, only) -> dict:
    from .contenders import BENCHES
    from .timing import count_comms, summarize, time_contenders

    rank = env[0]
    bench = BENCHES[case.bench]
    t0 = time.perf_counter()
    weights, data = _case_inputs(case.bench, case.params, env[1])
    preps, statuses = _build_all(env, case.bench, case.params, bench.optim, weights, data, only)
    t1 = time.perf_counter()
    samples = time_contenders(preps, warmup=case.warmup, steps=case.steps, rounds=case.rounds, group=env[2])
    t2 = time.perf_counter()
    local = {}
    for name, prep in preps.items():
        local[name] = {**summarize(samples[name]), "comm": count_comms(prep, group=env[2])}
    phases = {"build": t1 - t0, "timing": t2 - t1, "count": time.perf_counter() - t2}
    every = _gather_to_rank0(local, env)
    del preps, samples
    gc.collect(1)
    if rank != 0:
        return {}
    out = {}
    for name, status in statuses.items():
        if status != "ok":
            out[name] = {"status": status}
            continue
        per_rank = [r[name] for r in every]
        out[name] = {
            "status": "ok",
            # the slowest rank decides the step time
            "wall_median": max(r["wall_median"] for r in per_rank),
            "cpu_median": max(r["cpu_median"] for r in per_rank),
            "wall_p10": max(r["wall_p10"] for r in per_rank),
            "wall_p90": max(r["wall_p90"] for r in per_rank),
            "n": per_rank[0]["n"],
            "wall_median_per_rank": [r["wall_median"] for r in per_rank],
            "cpu_median_per_rank": [r["cpu_median"] for r in per_rank],
            "comm": per_rank[0]["comm"],
            "comm_max_count": max(r["comm"]["count"] for r in per_rank),
        }
    extra = {}
    if case.bench.startswith("gpt_"):
        from . import gpt

        cfg = gpt.cfg_of(case.params)
        dp, tp = gpt.mesh_shape(gpt.layout_of(case.bench), env[1])
        extra = {
            "mesh": {"dp": dp, "tp": tp},
            "model": {"n_params": cfg.n_params, "tensors": len(gpt.names(cfg))},
        }
    return {
        "bench": case.bench,
        "label": case.label,
        "params": case.params,
        **extra,
        "phase_seconds": phases,
        "min_comm": list(bench.min_comm(case.params, env[1])),
        "contenders": out,
    }


def _memory_case(env, mcase, only) -> dict:
    """Each contender built and stepped alone under the allocator profiler (with Adam)."""
    import torch.distributed as dist

    from .contenders import CONTENDERS
    from .timing import AllocProfile, state_bytes

    rank, world, group, _ = env
    local, statuses = {}, {}
    for name in CONTENDERS[mcase.bench]:
        if only and name not in only:
            continue
        # fresh inputs made before the profiler starts: the contender's ctx copies are not its memory
        weights, data = _case_inputs(mcase.bench, mcase.params, world)
        gc.collect(1)
        dist.barrier(group=group)
        prep, preps, alloc = None, {}, None
        try:
            with AllocProfile() as alloc:
                preps, st = _build_all(
                    env, mcase.bench, mcase.params, "adam", weights, data, {name}, clone=False
                )
                prep = preps.get(name)
                if prep is not None:
                    # short pauses let buffers that gloo's worker threads release right after a
                    # collective completes be freed before the next step / the end of the region
                    prep.step()
                    time.sleep(0.02)
                    for _ in range(3):
                        with alloc.measured():
                            prep.step()
                        time.sleep(0.02)
        except Exception:  # profiler trouble: fall back to the storage accounting only
            traceback.print_exc()
            if prep is None:
                preps, st = _build_all(env, mcase.bench, mcase.params, "adam", weights, data, {name})
                prep = preps.get(name)
                if prep is not None:
                    prep.step()
            alloc = None
        statuses[name] = st[name]
        if prep is not None:
            sb = state_bytes(prep) or {}
            local[name] = {
                **{k: sb.get(k) for k in ("params", "grads", "optim", "state")},
                "kept": alloc.kept if alloc else None,
                "peak": alloc.peak if alloc else None,
            }
        del prep, preps
        dist.barrier(group=group)
    every = _gather_to_rank0(local, env)
    if rank != 0:
        return {}
    out = {}
    for name, status in statuses.items():
        if status != "ok":
            out[name] = {"status": status}
            continue
        per_rank = [r[name] for r in every]
        merged = {"status": "ok"}
        for k in ("params", "grads", "optim", "state", "kept", "peak"):
            vals = [r[k] for r in per_rank]
            # storage accounting: the largest rank; allocator readings are upper bounds: the smallest
            pick = min if k in ("kept", "peak") else max
            merged[k] = None if any(v is None for v in vals) else pick(vals)
        out[name] = merged
    return {
        "layout": mcase.layout,
        "bench": mcase.bench,
        "label": " ".join(f"{k}={v}" for k, v in mcase.params.items()),
        "params": mcase.params,
        "minimum": memory_minimum(mcase, world),
        "contenders": out,
    }


def memory_minimum(mcase, world: int) -> dict[str, int]:
    """Bytes per rank of params / grads / Adam state a perfect implementation of the layout keeps."""
    if mcase.bench.startswith("gpt_"):
        from . import gpt

        return gpt.memory_minimum(gpt.layout_of(mcase.bench), mcase.params, world)
    h = mcase.params["hidden"]
    big = 2 * 4 * h * h + 4 * h  # 0.weight, 0.bias, 2.weight
    n = {"replicated": big + h, "fsdp": -(-(big + h) // world), "tp": big // world + h}[mcase.layout]
    return {"params": 4 * n, "grads": 4 * n, "optim": 8 * n, "state": 16 * n}


def _rank_main(rank: int, world: int, port: int, opts: dict, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")
    # DTensor logs a warning when gathering a 2-D sharded parameter in two steps (verify only)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=opts["timeout"]),
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
        env = (rank, world, dist.group.WORLD, mesh)
        _log(rank, f"[world {world}] process group and mesh ready")
        result = _run_rank(env, opts)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: after the profiler-based memory pass, gloo/profiler threads can
    # abort the process there ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_rank(env, opts) -> dict:
    from .contenders import cases, mem_cases, skip_reason

    rank, world = env[0], env[1]
    only_b, only_c = set(opts["bench"] or []), set(opts["contenders"] or [])
    sel = [c for c in cases(opts["smoke"]) if not only_b or c.bench in only_b]
    if opts["scale"] != 1.0:
        sel = [
            dataclasses.replace(
                c,
                warmup=max(1, round(c.warmup * opts["scale"])),
                steps=max(c.rounds, round(c.steps * opts["scale"])),
            )
            for c in sel
        ]
    msel = [m for m in mem_cases(opts["smoke"]) if not only_b or m.bench in only_b]
    result: dict[str, Any] = {"world": world, "verify": [], "cases": [], "memory": [], "skipped": []}
    kept = []
    for c in sel:
        why = skip_reason(c, world, opts["smoke"])
        if why is None:
            kept.append(c)
        else:
            result["skipped"].append({"bench": c.bench, "label": c.label, "why": why})
    sel = kept
    t0 = time.perf_counter()

    if opts["verify"]:
        ok = True
        for case in sel:
            res = _verify_case(env, case, opts["tol"], only_c)
            result["verify"].append({"bench": case.bench, "label": case.label, "contenders": res})
            for name, r in res.items():
                if r["status"] == "ok":
                    line = (
                        f"{'PASS' if r['passed'] else 'FAIL'} max rel err {r['max_rel_err']:.2e} "
                        f"({r['worst']})" + (f" missing {r['missing']}" if r["missing"] else "")
                    )
                    ok &= r["passed"]
                else:
                    line = r["status"]
                    ok &= not r["status"].startswith("error") and r.get("passed", True)
                _log(rank, f"[world {world}] verify {case.bench} {case.label} {name}: {line}")
        result["verify_ok"] = ok
        if not ok:
            _log(rank, f"[world {world}] verification FAILED: skipping timing")
            return result
    if opts["verify_only"]:
        return result

    for case in sel:
        t = time.perf_counter()
        res = _time_case(env, case, only_c)
        if rank == 0:
            result["cases"].append(res)
            parts = []
            for name, r in res["contenders"].items():
                parts.append(
                    f"{name} {r['wall_median'] * 1e3:.3f} ms"
                    if r["status"] == "ok"
                    else f"{name} {r['status'].split(':')[0]}"
                )
            _log(
                rank,
                f"[world {world}] {case.bench} {case.label}: "
                + ", ".join(parts)
                + f"  ({time.perf_counter() - t:.1f} s: "
                + ", ".join(f"{k} {v:.1f}" for k, v in res["phase_seconds"].items())
                + ")",
            )
    if not opts["no_memory"]:
        for mcase in msel:
            res = _memory_case(env, mcase, only_c)
            if rank == 0:
                result["memory"].append(res)
                _log(rank, f"[world {world}] memory {mcase.layout} ({mcase.bench} {res['label']}) done")
    result["seconds"] = time.perf_counter() - t0
    return result


# ----------------------------------------------------------------------------------------------------------
# Parent
# ----------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--world", type=int, nargs="+", default=[2], help="world size(s), e.g. --world 2 4")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, few steps (CI); world 2 unless given")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check loss/grads/params of every contender against a single-process reference "
        "before timing; a failure skips timing and exits 1",
    )
    p.add_argument("--verify-only", action="store_true", help="with --verify: stop after verification")
    p.add_argument("--tol", type=float, default=1e-5, help="relative tolerance for --verify")
    p.add_argument(
        "--bench",
        nargs="+",
        default=None,
        help="only these benchmarks (tp_mlp dp_mlp fsdp_mlp shard_map_overhead)",
    )
    p.add_argument("--contenders", nargs="+", default=None, help="only these contenders")
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every case's warm-up and timed step counts (e.g. 0.2 for a quick look)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the memory table")
    p.add_argument(
        "--out-dir",
        default=None,
        help="where RESULTS.md / results.png / results.json go (default: benchmarks/; with "
        "--smoke the report is only printed unless this is given)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="gloo collective timeout, seconds")
    args = p.parse_args(argv)
    if args.verify_only:
        args.verify = True
    return args


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    opts = {
        "smoke": args.smoke,
        "verify": args.verify,
        "verify_only": args.verify_only,
        "tol": args.tol,
        "bench": args.bench,
        "contenders": args.contenders,
        "no_memory": args.no_memory,
        "timeout": args.timeout,
        "scale": args.scale,
    }
    results = {"machine": machine_info(), "command": _command(argv), "smoke": args.smoke, "runs": []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as td:
        for world in args.world:
            out_path = os.path.join(td, f"world{world}.json")
            print(f"== world {world}: spawning {world} ranks (gloo, 127.0.0.1) ==", flush=True)
            mp.spawn(_rank_main, args=(world, _free_port(), opts, out_path), nprocs=world, join=True)
            with open(out_path) as f:
                results["runs"].append(json.load(f))
    results["seconds"] = time.perf_counter() - t0
    results["machine"]["load_end"] = _loadavg()
    print(f"== total {results['seconds']:.1f} s ==", flush=True)

    if args.verify and not all(r.get("verify_ok", True) for r in results["runs"]):
        print("verification failed", file=sys.stderr)
        return 1
    if args.verify_only:
        return 0

    from . import report

    if args.smoke and not args.out_dir:
        # a smoke run exercises the report but keeps no files: the markdown goes to stdout only
        with tempfile.TemporaryDirectory(prefix="fshard-bench-smoke-") as td:
            print(report.write(results, Path(td) / "RESULTS.md", Path(td) / "results.png"))
        print("smoke run: report printed above, no files kept (use --out-dir to keep them)")
        return 0
    out_dir = Path(args.out_dir) if args.out_dir else HERE
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.json", "w") as f:
        json.dump(results, f, indent=1)
    md = report.write(results, out_dir / "RESULTS.md", out_dir / "results.png")
    print(md)
    print(f"wrote {out_dir / 'RESULTS.md'}, {out_dir / 'results.png'}, {out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
