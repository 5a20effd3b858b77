"""RESULTS.md and results.png from the results dict ``run.py`` builds (also saved as results.json).

Regenerate from a saved run: ``python -m benchmarks.report benchmarks/results.json``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from .contenders import BENCHES

NA = "n/a"


def _ms(s: float | None) -> str:
    if s is None:
        return NA
    ms = s * 1e3
    return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return NA
    return f"{a / b:.2f}×"


def _bytes(n: int | None) -> str:
    if n is None:
        return NA
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n} B"


def _ok(r: dict | None) -> bool:
    return bool(r) and r.get("status") == "ok"


def _val(r: dict | None, key: str):
    return r.get(key) if _ok(r) else None


def _status(r: dict | None) -> str:
    if r is None:
        return NA
    s = r.get("status", NA)
    if s.startswith("n/a"):
        return NA
    return s


def _best_dtensor(case: dict, key: str):
    rows = case["contenders"]
    vals = [_val(rows.get(n), key) for n in BENCHES[case["bench"]].dtensor]
    vals = [v for v in vals if v is not None]
    return min(vals) if vals else None


# ----------------------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------------------


def markdown(results: dict[str, Any], png_name: str | None = "results.png") -> str:
    m = results["machine"]
    L: list[str] = []
    smoke = " (smoke run: tiny sizes, not meaningful)" if results.get("smoke") else ""
    L.append("# fshard benchmark results" + smoke)
    L.append("")
    L.append(f"- Machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), {m['os']}")
    L.append(
        f"- torch {m['torch']}, Python {m['python']}, gloo backend on 127.0.0.1, "
        f"`torch.set_num_threads(1)` per rank, CPU only"
    )
    L.append(f"- Command (from the repo root): `{results['command']}`")
    L.append(f"- Date: {m['date']}; total run time {results.get('seconds', 0):.0f} s")
    if m.get("commit"):
        dirty = " (with uncommitted changes in `fshard/`)" if m.get("dirty") else ""
        L.append(f"- fshard at commit {m['commit']}{dirty}")
    if m.get("load_start") is not None:
        L.append(
            f"- Load average (1/5/15 min) at start {m['load_start']}, at end {m.get('load_end')} "
            f"(anything well above 0 means other processes shared the {m['cores']} cores)"
        )
    L.append("")
    L.append(
        "Method: every contender of a benchmark is built in the same rank processes from the same "
        "initial weights and data (fixed seed), warmed up, then timed in interleaved rounds (each "
        "round runs every contender in the same fixed order, after a barrier, GC disabled). Numbers "
        "are medians of per-step times; per rank first, then the slowest rank. *Wall* is "
        "`time.perf_counter`, *CPU* is `time.thread_time` of the main thread (Python + dispatch + "
        "compute on that thread; gloo's own threads are not in it). Ratios are against the "
        "hand-written contender (`× hw`); `fshard ÷` columns give fshard's time over that row's. "
        "Collectives are counted over one step with a `TorchDispatchMode` (c10d and functional "
        "collectives); bytes = full logical buffer per collective (all_reduce buffer, all_gather "
        "output, reduce_scatter input), per rank. When the load average is high, wall times include "
        "time spent descheduled; the main-thread CPU times and their ratios are then the steadier "
        "numbers."
    )
    L.append("")

    # summary
    L.append("## Summary")
    L.append("")
    L.append(
        "| world | benchmark | size | hand-written ms (wall / CPU) | torch-native ms, wall / CPU (× hw) "
        "| fshard ms (wall / CPU) | fshard / hand-written (wall / CPU) | fshard / best torch-native "
        "(wall / CPU) |"
    )
    L.append("|---|---|---|---|---|---|---|---|")
    for run in results["runs"]:
        for case in run["cases"]:
            if case["bench"].startswith("gpt_"):
                continue
            rows, b = case["contenders"], BENCHES[case["bench"]]
            hw, fs = rows.get(b.baseline), rows.get("fshard")
            native = "<br>".join(
                f"{n}: {_ms(_val(rows.get(n), 'wall_median'))} / {_ms(_val(rows.get(n), 'cpu_median'))} "
                f"({_ratio(_val(rows.get(n), 'wall_median'), _val(hw, 'wall_median'))} / "
                f"{_ratio(_val(rows.get(n), 'cpu_median'), _val(hw, 'cpu_median'))})"
                if _ok(rows.get(n))
                else f"{n}: {_status(rows.get(n))}"
                for n in b.dtensor
            )
            L.append(
                f"| {run['world']} | {case['bench']} | {case['label']} "
                f"| {_ms(_val(hw, 'wall_median'))} / {_ms(_val(hw, 'cpu_median'))} | {native} "
                f"| {_ms(_val(fs, 'wall_median'))} / {_ms(_val(fs, 'cpu_median'))} "
                f"| {_ratio(_val(fs, 'wall_median'), _val(hw, 'wall_median'))} / "
                f"{_ratio(_val(fs, 'cpu_median'), _val(hw, 'cpu_median'))} "
                f"| {_ratio(_val(fs, 'wall_median'), _best_dtensor(case, 'wall_median'))} / "
                f"{_ratio(_val(fs, 'cpu_median'), _best_dtensor(case, 'cpu_median'))} |"
            )
    L.append("")
    L.extend(_gpt_md(results))
    L.extend(_targets_md(results))
    if png_name:
        L.append(f"![results]({png_name})")
        L.append("")

    for run in results["runs"]:
        w = run["world"]
        L.append(f"## World {w}")
        L.append("")
        if run.get("verify"):
            L.extend(_verify_md(run))
        for sk in run.get("skipped", []):
            L.append(f"*{sk['bench']} {sk['label']}: not run at world {w}: {sk['why']}.*")
            L.append("")
        for case in run["cases"]:
            L.extend(_case_md(case, w))
        if run.get("memory"):
            L.extend(_memory_md(run))
    return "\n".join(L).rstrip() + "\n"


def _verify_md(run) -> list[str]:
    L = [
        f"### Verification (world {run['world']}): loss, gradients (and parameters after one SGD step "
        "where the benchmark has an optimizer), gathered, vs a single-process reference",
        "",
        "| benchmark | size | contender | result | max rel. error | worst |",
        "|---|---|---|---|---|---|",
    ]
    for v in run["verify"]:
        for name, r in v["contenders"].items():
            if r.get("status") == "ok":
                res = "pass" if r["passed"] else "**FAIL**"
                L.append(
                    f"| {v['bench']} | {v['label']} | {name} | {res} | {r['max_rel_err']:.1e} "
                    f"| {r['worst']} |"
                )
            else:
                L.append(f"| {v['bench']} | {v['label']} | {name} | {_status(r)} | | |")
    L.append("")
    return L


def _case_md(case, world) -> list[str]:
    b = BENCHES[case["bench"]]
    rows = case["contenders"]
    hw, fs = rows.get(b.baseline), rows.get("fshard")
    min_count, min_bytes = case["min_comm"]
    L = [
        f"### {case['bench']} {case['label']} (world {world})",
        "",
        f"{b.title}. Hand-written minimum: "
        f"{min_count} collectives, {_bytes(min_bytes)} per step ({b.min_comm_doc}).",
        "",
        "| contender | wall ms (median) | wall p10–p90 | CPU ms (median) | wall × hw | CPU × hw "
        "| fshard ÷ this (wall / CPU) | collectives / step | bytes / step | bytes ÷ minimum | ops |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if not _ok(r):
            L.append(f"| {name} | {_status(r)} | | | | | | | | | |")
            continue
        comm = r["comm"]
        ops = ", ".join(f"{k.replace('.default', '')}×{v}" for k, v in comm["ops"].items()) or "–"
        if comm.get("fshard"):
            fc = comm["fshard"]
            kinds = ", ".join(f"{k}×{v}" for k, v in fc["kinds"].items())
            ops += f"; fs.count_collectives: {fc['count']} ({kinds}), {_bytes(fc['bytes'])} handed in"
        L.append(
            f"| {name} | {_ms(r['wall_median'])} | {_ms(r['wall_p10'])}–{_ms(r['wall_p90'])} "
            f"| {_ms(r['cpu_median'])} | {_ratio(r['wall_median'], _val(hw, 'wall_median'))} "
            f"| {_ratio(r['cpu_median'], _val(hw, 'cpu_median'))} "
            f"| {_ratio(_val(fs, 'wall_median'), r['wall_median'])} / "
            f"{_ratio(_val(fs, 'cpu_median'), r['cpu_median'])} "
            f"| {comm['count']} | {_bytes(comm['bytes'])} "
            f"| {_ratio(comm['bytes'], min_bytes) if min_bytes else ('–' if not comm['bytes'] else NA)} "
            f"| {ops} |"
        )
    L.append(
        f"\n{rows[next(iter(rows))].get('n', 0) if _ok(rows[next(iter(rows))]) else ''} timed steps "
        "per contender per rank.\n"
    )
    return L


def _memory_md(run) -> list[str]:
    L = [
        f"### Memory per rank (world {run['world']}, Adam)",
        "",
        "*params / grads / optimizer state* = bytes of the distinct storages the contender reports keeping "
        "(DTensors: their local shard), largest rank. The allocator columns come from `torch.profiler` CPU "
        "allocation events over building the contender + 4 steps, counted from before the build: *kept* = "
        "bytes still allocated between steps (everything the contender holds, also DDP buckets, FSDP "
        "buffers, caches), *step peak* = highest level during a step (adds activations, gathered "
        "parameters, communication buffers). The profiler does not always see gloo's worker threads free "
        "collective buffers, so allocator readings are upper bounds; the smallest over the last 3 steps "
        "and over ranks is shown.",
        "",
        "| layout | model | contender | params | grads | optimizer state | sum | kept (allocator) "
        "| step peak (allocator) | sum ÷ minimum | peak ÷ minimum sum |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mem in run["memory"]:
        mn = mem["minimum"]
        L.append(
            f"| {mem['layout']} | {mem['label']} | *minimum* | {_bytes(mn['params'])} "
            f"| {_bytes(mn['grads'])} | {_bytes(mn['optim'])} | {_bytes(mn['state'])} | | | | |"
        )
        for name, r in mem["contenders"].items():
            if not _ok(r):
                L.append(f"| {mem['layout']} | {mem['label']} | {name} | {_status(r)} | | | | | | | |")
                continue
            L.append(
                f"| {mem['layout']} | {mem['label']} | {name} ({mem['bench']}) | {_bytes(r['params'])} "
                f"| {_bytes(r['grads'])} | {_bytes(r['optim'])} | {_bytes(r['state'])} "
                f"| {_bytes(r['kept'])} | {_bytes(r['peak'])} | {_ratio(r['state'], mn['state'])} "
                f"| {_ratio(r['peak'], mn['state'])} |"
            )
    L.append("")
    return L


# ----------------------------------------------------------------------------------------------------------
# GPT section and targets
# ----------------------------------------------------------------------------------------------------------

GPT_LAYOUTS = {"gpt_dp": "dp", "gpt_fsdp": "fsdp", "gpt_dp_tp": "dp × tp", "gpt_fsdp_tp": "fsdp × tp"}
FSHARD_VARIANTS = ("fshard", "fshard_nobucket", "fshard_vg")


def _gpt_cases(run) -> list[dict]:
    return [c for c in run["cases"] if c["bench"].startswith("gpt_")]


def _native(case) -> str:
    return BENCHES[case["bench"]].dtensor[0]


def _mesh(case) -> str:
    m = case.get("mesh") or {}
    return f"dp={m.get('dp', '?')}, tp={m.get('tp', '?')}"


def _model(case) -> str:
    info = case.get("model") or {}
    n = info.get("n_params")
    size = f" ({n / 1e6:.2f}M, {info.get('tensors')} tensors)" if n else ""
    return f"{case['params']['model']}{size}, batch {case['params']['batch']}"


def _wc(r) -> str:
    if not _ok(r):
        return _status(r)
    return f"{_ms(r['wall_median'])} / {_ms(r['cpu_median'])}"


def _wc_ratio(a, b) -> str:
    if not (_ok(a) and _ok(b)):
        return NA
    return f"{_ratio(a['wall_median'], b['wall_median'])} / {_ratio(a['cpu_median'], b['cpu_median'])}"


def _comm(r) -> str:
    if not _ok(r):
        return _status(r)
    return f"{r['comm']['count']} · {_bytes(r['comm']['bytes'])}"


def _gpt_md(results) -> list[str]:
    runs = [(run["world"], _gpt_cases(run)) for run in results["runs"]]
    if not any(cs for _, cs in runs):
        return []
    L = [
        "## GPT: the demo's model, one tensor per parameter",
        "",
        "The demo's decoder (`fshard_demo.model`) at its default size and at about 10x the parameters, one "
        "training step: zero the gradients, forward, backward, every gradient collective (no optimizer "
        "step). *floor* = hand-written torch.distributed on plain tensors (dp: one flat all_reduce of all "
        "gradients; fsdp: one flat all_gather + one reduce_scatter; tp: Megatron f/g); torch-native = DDP "
        "(dp), FSDP2 `fully_shard` per block + root (fsdp), DTensor `parallelize_module` over tp + DDP over "
        "dp (dp × tp), the same TP plan + FSDP2 (fsdp × tp), all on an `nn.Module` with the same "
        "parameters and forward. fshard = the demo's `loss_fn` under `fs.shard_map` with the layout's "
        "specs and `loss.backward()`, with the default `bucket_mb` (*fshard*) and `bucket_mb=0` "
        "(*bucket 0*); *demo step* = the demo's own `fs.value_and_grad(loss_fn)` inside `fs.shard_map` "
        "(data-parallel layouts). Cells are wall / main-thread CPU ms per step (median, slowest rank).",
        "",
        "| world | layout (mesh) | model | floor | torch-native | fshard | bucket 0 | demo step "
        "| fshard ÷ floor | fshard ÷ torch-native | bucket 0 ÷ floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, cs in runs:
        for c in cs:
            rows = c["contenders"]
            hw, nat, fs = rows.get("handwritten"), rows.get(_native(c)), rows.get("fshard")
            nb, vg = rows.get("fshard_nobucket"), rows.get("fshard_vg")
            L.append(
                f"| {world} | {GPT_LAYOUTS[c['bench']]} ({_mesh(c)}) | {_model(c)} | {_wc(hw)} "
                f"| {_native(c)}: {_wc(nat)} | {_wc(fs)} | {_wc(nb)} | {_wc(vg) if vg else '–'} "
                f"| {_wc_ratio(fs, hw)} | {_wc_ratio(fs, nat)} | {_wc_ratio(nb, hw)} |"
            )
    L += [
        "",
        "Collectives per step · bytes per rank (counted at the dispatcher for every contender; bytes = "
        "all_reduce buffer, all_gather output, reduce_scatter input). *fs.count_collectives* is fshard's "
        "own record of the same step (bytes there = what each rank hands in: an all_gather's input). "
        'The demo\'s `loss_fn` ends in `fs.pmean(loss, "dp")`, so fshard returns the global mean loss: '
        "one scalar all_reduce over dp that the other contenders (which return the rank's own loss) "
        "do not issue.",
        "",
        "| world | layout | model | minimum | floor | torch-native | fshard | bucket 0 | demo step "
        "| fshard per fs.count_collectives |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, cs in runs:
        for c in cs:
            rows = c["contenders"]
            fs = rows.get("fshard")
            own = NA
            if _ok(fs) and fs["comm"].get("fshard"):
                fc = fs["comm"]["fshard"]
                own = f"{fc['count']}: " + ", ".join(f"{k}×{v}" for k, v in fc["kinds"].items())
            vg = rows.get("fshard_vg")
            L.append(
                f"| {world} | {GPT_LAYOUTS[c['bench']]} | {c['params']['model']} "
                f"| {c['min_comm'][0]} · {_bytes(c['min_comm'][1])} | {_comm(rows.get('handwritten'))} "
                f"| {_native(c)}: {_comm(rows.get(_native(c)))} | {_comm(fs)} "
                f"| {_comm(rows.get('fshard_nobucket'))} | {_comm(vg) if vg else '–'} | {own} |"
            )
    skipped = [(run["world"], sk) for run in results["runs"] for sk in run.get("skipped", [])]
    if skipped:
        L.append("")
        for world, sk in skipped:
            L.append(f"Not run: {sk['bench']} {sk['label']} at world {world} ({sk['why']}).")
    L.append("")
    return L


def _verdict(value: float | None, limit: float, unit: str = "×") -> str:
    if value is None:
        return NA
    if value <= limit:
        return "met"
    if unit != "×":
        return f"**missed** by {value - limit:g}"
    pct = (value / limit - 1) * 100
    return f"**missed** by {pct:.1f}%" if pct < 1 else f"**missed** by {pct:.0f}%"


def _find(run, bench: str, model: str | None = None) -> list[dict]:
    return [
        c
        for c in run["cases"]
        if c["bench"] == bench and (model is None or c["params"].get("model") == model)
    ]


def _targets_md(results) -> list[str]:
    gpt_runs = [run for run in results["runs"] if _gpt_cases(run)]
    L: list[str] = []
    if gpt_runs:
        L += [
            "## Targets: GPT (filled from this run)",
            "",
            "Wall-clock medians decide (main-thread CPU ratios in brackets: steadier when other processes "
            "share the cores). *fshard* = default `bucket_mb`.",
            "",
            "Where a target is missed, the structural reasons (true of every run): fshard's step also "
            "all-reduces the loss (the demo's `loss_fn` returns the global mean; the DDP and FSDP2 programs "
            "return a local loss), so its count is one above theirs at equal buckets; the gradient buckets "
            "follow DDP (a first bucket of at most 1 MiB, then 25 MiB), so the demo's dp step has two; the "
            "FSDP layouts gather layer by layer (`fs.fsdp_scan`: one all-gather per block in the forward and "
            "one in the backward, one reduce-scatter per block, the embeddings and head apart), which is "
            "FSDP2's pattern and its memory, not the floor's one flat all-gather. Against the floor (one flat "
            "vector, no per-parameter ops) fshard pays the per-op tracking of varying axes in Python (the CPU "
            "ratio). Wall ratios on a 2-core machine running 2-4 ranks plus gloo's threads move by 10-20% "
            "between runs; repeated A/B runs of one cell are the way to compare two versions.",
            "",
            "| target | world | layout | model | this run | verdict |",
            "|---|---|---|---|---|---|",
        ]
        ratio_targets = [
            ("fshard dp ≤ 1.0× DDP", "gpt_dp", "ddp", 1.0),
            ("fshard fsdp ≤ 1.0× FSDP2", "gpt_fsdp", "fsdp2", 1.0),
            ("fshard dp × tp ≤ 0.8× DTensor 2-D (TP + DDP)", "gpt_dp_tp", "dtensor_tp_ddp", 0.8),
        ]
        for title, bench, other, limit in ratio_targets:
            for run in gpt_runs:
                for c in _find(run, bench):
                    fs, o = c["contenders"].get("fshard"), c["contenders"].get(other)
                    if not (_ok(fs) and _ok(o)):
                        continue
                    w = fs["wall_median"] / o["wall_median"]
                    cpu = fs["cpu_median"] / o["cpu_median"]
                    L.append(
                        f"| {title} | {run['world']} | {GPT_LAYOUTS[bench]} ({_mesh(c)}) | {c['params']['model']} "
                        f"| {w:.2f}× ({cpu:.2f}× CPU) | {_verdict(w, limit)} |"
                    )
        for run in gpt_runs:
            for c in _gpt_cases(run):
                fs, hw = c["contenders"].get("fshard"), c["contenders"].get("handwritten")
                if not (_ok(fs) and _ok(hw)):
                    continue
                w = fs["wall_median"] / hw["wall_median"]
                cpu = fs["cpu_median"] / hw["cpu_median"]
                L.append(
                    f"| fshard ≤ 1.1× the hand-written floor | {run['world']} | {GPT_LAYOUTS[c['bench']]} "
                    f"({_mesh(c)}) | {c['params']['model']} | {w:.2f}× ({cpu:.2f}× CPU) | {_verdict(w, 1.1)} |"
                )
        for run in gpt_runs:
            for c in _gpt_cases(run):
                fs, o = c["contenders"].get("fshard"), c["contenders"].get(_native(c))
                if not (_ok(fs) and _ok(o)):
                    continue
                n, m = fs["comm"]["count"], o["comm"]["count"]
                verdict = "met" if n <= m else f"**missed** by {n - m} ({n / max(m, 1):.1f}×)"
                L.append(
                    f"| collectives per step ≤ {_native(c)}'s | {run['world']} | {GPT_LAYOUTS[c['bench']]} "
                    f"| {c['params']['model']} | {n} vs {m} (floor {c['contenders']['handwritten']['comm']['count']}"
                    f", minimum {c['min_comm'][0]}) | {verdict} |"
                )
        for run in gpt_runs:
            for c in _gpt_cases(run):
                fs = c["contenders"].get("fshard")
                if not _ok(fs) or not c["min_comm"][1]:
                    continue
                r = fs["comm"]["bytes"] / c["min_comm"][1]
                # 16 bytes of slack: the loss scalar fshard's pmean all-reduces
                ok = fs["comm"]["bytes"] <= c["min_comm"][1] + 16
                L.append(
                    f"| bytes per step = minimum | {run['world']} | {GPT_LAYOUTS[c['bench']]} | {c['params']['model']} "
                    f"| {_bytes(fs['comm']['bytes'])} vs {_bytes(c['min_comm'][1])} ({r:.3f}×) "
                    f"| {'met' if ok else f'**missed** by {(r - 1) * 100:.1f}%'} |"
                )
        L.extend(_whole_model_targets(gpt_runs))
        for run in results["runs"]:
            for mem in run.get("memory", []):
                if mem["bench"] != "gpt_fsdp":
                    continue
                fs, o = mem["contenders"].get("fshard"), mem["contenders"].get("fsdp2")
                if not (_ok(fs) and _ok(o)) or not fs.get("peak") or not o.get("peak"):
                    continue
                r = fs["peak"] / o["peak"]
                L.append(
                    f"| peak memory per rank ≤ 1.1× FSDP2's | {run['world']} | fsdp | {mem['params']['model']} "
                    f"| {_bytes(fs['peak'])} vs {_bytes(o['peak'])} ({r:.2f}×; kept {_bytes(fs.get('kept'))} vs "
                    f"{_bytes(o.get('kept'))}) | {_verdict(r, 1.1)} |"
                )
        L.append("")
    L.extend(_mlp_targets_md(results))
    return L


def _whole_model_targets(gpt_runs) -> list[str]:
    """The targets of fshard's whole-model FSDP forms (every parameter gathered at the top of the
    step, kept through the backward) against FSDP2 on the root only (``fsdp2_whole``), when run."""
    L = []
    for run in gpt_runs:
        for c in _find(run, "gpt_fsdp"):
            rows = c["contenders"]
            whole, block = rows.get("fsdp2_whole"), rows.get("fsdp2")
            if not _ok(whole):
                continue
            best = min((r for r in (whole, block) if _ok(r)), key=lambda r: r["wall_median"])
            best_cpu = min(r["cpu_median"] for r in (whole, block) if _ok(r))
            for name, title, other, other_cpu, limit in (
                ("fshard_tree", "fshard_tree ≤ 1.0× FSDP2 whole-model", whole, whole["cpu_median"], 1.0),
                (
                    "fshard_leaf",
                    "fshard_leaf ≤ 1.1× the better of FSDP2 whole-model and per-block",
                    best,
                    best_cpu,
                    1.1,
                ),
            ):
                fs = rows.get(name)
                if not _ok(fs):
                    continue
                w = fs["wall_median"] / other["wall_median"]
                cpu = fs["cpu_median"] / other_cpu
                L.append(
                    f"| {title} | {run['world']} | fsdp ({_mesh(c)}) | {c['params']['model']} "
                    f"| {w:.2f}× ({cpu:.2f}× CPU) | {_verdict(w, limit)} |"
                )
    for run in gpt_runs:
        for mem in run.get("memory", []):
            o = mem["contenders"].get("fsdp2_whole")
            if mem["bench"] != "gpt_fsdp" or not _ok(o) or not o.get("peak"):
                continue
            for name in ("fshard_leaf", "fshard_tree"):
                fs = mem["contenders"].get(name)
                if not _ok(fs) or not fs.get("peak"):
                    continue
                r = fs["peak"] / o["peak"]
                L.append(
                    f"| {name} peak memory per rank ≤ 1.05× FSDP2 whole-model's | {run['world']} | fsdp "
                    f"| {mem['params']['model']} | {_bytes(fs['peak'])} vs {_bytes(o['peak'])} ({r:.2f}×) "
                    f"| {_verdict(r, 1.05)} |"
                )
    return L


def _mlp_targets_md(results) -> list[str]:
    """The earlier targets of the MLP / overhead benchmarks, from this run."""
    rows = []

    def ratio_row(title, bench, hidden, other, limit, strict=False):
        for run in results["runs"]:
            for c in run["cases"]:
                if c["bench"] != bench or c["params"].get("hidden") != hidden:
                    continue
                fs, o = c["contenders"].get("fshard"), c["contenders"].get(other)
                if not (_ok(fs) and _ok(o)):
                    continue
                w, cpu = fs["wall_median"] / o["wall_median"], fs["cpu_median"] / o["cpu_median"]
                met = (w < limit) if strict else (w <= limit)
                rows.append(
                    f"| {title} | {run['world']} | {w:.2f}× ({cpu:.2f}× CPU) "
                    f"| {'met' if met else f'**missed** by {(w / limit - 1) * 100:.0f}%'} |"
                )

    ratio_row("tp_mlp h1024 b64: fshard ≤ 1.05× hand-written", "tp_mlp", 1024, "handwritten", 1.05)
    ratio_row("tp_mlp h256 b8: fshard ≤ 1.3× hand-written", "tp_mlp", 256, "handwritten", 1.3)
    ratio_row("tp_mlp h256 b8: fshard ≤ 0.6× parallelize_module", "tp_mlp", 256, "dtensor_parallelize", 0.6)
    ratio_row(
        "tp_mlp h1024 b64: fshard < 1× parallelize_module", "tp_mlp", 1024, "dtensor_parallelize", 1.0, True
    )
    for run in results["runs"]:
        for c in run["cases"]:
            if c["bench"] != "shard_map_overhead":
                continue
            fs, o = c["contenders"].get("fshard"), c["contenders"].get("dtensor_local_map")
            if _ok(fs) and _ok(o):
                met = fs["wall_median"] < o["wall_median"]
                rows.append(
                    f"| shard_map overhead ({c['params']['n_inputs']} inputs) below local_map's | {run['world']} "
                    f"| {_ms(fs['wall_median'])} vs {_ms(o['wall_median'])} ms | {'met' if met else '**missed**'} |"
                )
    for run in results["runs"]:
        for c in run["cases"]:
            if c["bench"] not in ("tp_mlp", "dp_mlp", "fsdp_mlp"):
                continue
            fs = c["contenders"].get("fshard")
            if not _ok(fs):
                continue
            n, b = fs["comm"]["count"], fs["comm"]["bytes"]
            mn, mb = c["min_comm"]
            loss_note = "; fshard also all-reduces the loss scalar" if c["bench"] != "tp_mlp" else ""
            met = b <= mb + 16 and n <= mn + (1 if loss_note else 0)
            rows.append(
                f"| {c['bench']} {c['label']}: collectives and bytes = minimum | {run['world']} "
                f"| {n} collectives (minimum {mn}{loss_note}), {b / mb:.3f}× bytes "
                f"| {'met' if met else '**missed**'} |"
            )
    for run in results["runs"]:
        for mem in run.get("memory", []):
            if mem["bench"].startswith("gpt_"):
                continue
            fs = mem["contenders"].get("fshard")
            if _ok(fs) and fs.get("state"):
                r = fs["state"] / mem["minimum"]["state"]
                rows.append(
                    f"| memory ({mem['layout']}): params + grads + Adam state within 10% of the minimum "
                    f"| {run['world']} | {r:.2f}× | {_verdict(r, 1.1)} |"
                )
    if not rows:
        return []
    return [
        "## Targets: MLP and shard_map overhead (filled from this run)",
        "",
        "| target | world | this run (wall; CPU in brackets) | verdict |",
        "|---|---|---|---|",
        *rows,
        "",
    ]


# ----------------------------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------------------------


def plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = []  # (kind, run, item)
    for run in results["runs"]:
        panels += [("time", run, case) for case in run["cases"]]
        if run.get("memory"):
            panels.append(("memory", run, run["memory"]))
    if not panels:
        return False
    ncols = min(4, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.0 * ncols, 3.4 * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, (kind, run, item) in zip(flat, panels):
        if kind == "time":
            _plot_case(ax, run, item)
        else:
            _plot_memory(ax, run, item)
    for ax in flat[len(panels) :]:
        ax.axis("off")
    flat[0].legend(fontsize=7)
    m = results["machine"]
    fig.suptitle(
        f"fshard benchmarks: median per step, {m['cpu']}, {m['cores']} cores, torch {m['torch']}"
        + (" (smoke run)" if results.get("smoke") else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _short(name: str) -> str:
    return name.replace("dtensor_", "dt_")


def _plot_case(ax, run, case) -> None:
    rows = case["contenders"]
    names = list(rows)
    wall = [(_val(rows[n], "wall_median") or 0) * 1e3 for n in names]
    cpu = [(_val(rows[n], "cpu_median") or 0) * 1e3 for n in names]
    xs = list(range(len(names)))
    ax.bar([x - 0.2 for x in xs], wall, 0.4, label="wall", color="#4C72B0")
    ax.bar([x + 0.2 for x in xs], cpu, 0.4, label="main-thread CPU", color="#DD8452")
    top = max(wall + cpu + [1e-9])
    hw = _val(rows.get(BENCHES[case["bench"]].baseline), "wall_median")
    for x, n in zip(xs, names):
        if not _ok(rows[n]):
            ax.text(x, top * 0.03, NA, ha="center", va="bottom", fontsize=8)
        elif hw:
            ax.text(
                x - 0.2, wall[x], f"{rows[n]['wall_median'] / hw:.2f}×", ha="center", va="bottom", fontsize=6
            )
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks(xs)
    ax.set_xticklabels([_short(n) for n in names], rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("ms / step", fontsize=8)
    ax.set_title(f"world {run['world']}: {case['bench']} {case['label']}", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)


def _plot_memory(ax, run, mems) -> None:
    labels, p, g, o, peak = [], [], [], [], []
    for mem in mems:
        for n, r in mem["contenders"].items():
            labels.append(f"{mem['layout']}: {_short(n)}")
            p.append((_val(r, "params") or 0) / 2**20)
            g.append((_val(r, "grads") or 0) / 2**20)
            o.append((_val(r, "optim") or 0) / 2**20)
            peak.append((_val(r, "peak") or 0) / 2**20)
    xs = list(range(len(labels)))
    ax.bar(xs, p, label="params", color="#55A868")
    ax.bar(xs, g, bottom=p, label="grads", color="#C44E52")
    ax.bar(xs, o, bottom=[a + b for a, b in zip(p, g)], label="Adam state", color="#8172B2")
    ax.scatter(
        [x for x, v in zip(xs, peak) if v],
        [v for v in peak if v],
        marker="_",
        s=120,
        color="black",
        label="step peak (allocator)",
        zorder=3,
    )
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=6)
    ax.set_ylabel("MiB per rank", fontsize=8)
    ax.set_title(f"world {run['world']}: memory per rank (Adam)", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=6)


_KEPT = re.compile(r"<!-- (?P<name>[\w-]+): begin -->.*?<!-- (?P=name): end -->\n?", re.S)


def kept_sections(md: str) -> str:
    """The sections of an existing RESULTS.md written by other scripts or by hand, between
    ``<!-- name: begin -->`` and ``<!-- name: end -->`` markers (kept when the tables are rewritten)."""
    return "".join(m.group(0).rstrip("\n") + "\n\n" for m in _KEPT.finditer(md))


HISTORY_NOTE = (
    "Earlier runs, the sections other scripts wrote (`benchmarks/compiled.py`, `restarts.py`, ...) and "
    "one-off measurements: [HISTORY.md](HISTORY.md), newest first."
)


def write(results: dict[str, Any], md_path: Path, png_path: Path) -> str:
    """Write today's report to ``md_path`` (and the plot). The sections that other scripts or a person
    added to the previous report (between ``<!-- name: begin/end -->`` markers) belonged to an older
    run: they move to the top of ``HISTORY.md`` beside it, under the date and commit of that run."""
    has_plot = plot(results, Path(png_path))
    md = markdown(results, Path(png_path).name if has_plot else None)
    md = md.replace("\n\n", f"\n\n{HISTORY_NOTE}\n\n", 1)
    old = Path(md_path).read_text() if Path(md_path).exists() else ""
    kept = kept_sections(old)
    if kept and not results.get("smoke"):
        history = Path(md_path).with_name("HISTORY.md")
        text = history.read_text() if history.exists() else HISTORY_HEAD
        when = re.search(r"^- Date: ([^;\n]*)", old, re.M)
        commit = re.search(r"^- fshard at commit (\S+)", old, re.M)
        head = f"## Added to the report of {when.group(1) if when else 'an earlier run'}"
        head += f" (commit {commit.group(1)})" if commit else ""
        body = kept.replace("\n## ", "\n### ").replace("<!-- ", "<!-- old ")
        text = text.replace(HISTORY_MARK, f"{HISTORY_MARK}\n{head}\n\n{body.rstrip()}\n", 1)
        history.write_text(text)
    Path(md_path).write_text(md)
    return md


HISTORY_MARK = "<!-- newest first: below this line -->"
HISTORY_HEAD = f"""# fshard benchmark history

What `benchmarks/RESULTS.md` no longer shows: sections of earlier reports, newest first.

{HISTORY_MARK}
"""


if __name__ == "__main__":
    src = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results.json")
    res = json.loads(src.read_text())
    print(write(res, src.parent / "RESULTS.md", src.parent / "results.png"))
