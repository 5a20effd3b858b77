"""Time the demo GPT's training step under each desync-tag setting, interleaved in one run.

Not a test and not part of ``benchmarks.run``: the measurement behind the default of
``FSHARD_DESYNC_TAGS`` (see ``fshard/_watchdog.py``): ``0`` (no tags), ``reduce`` (the all-reduces
carry tags in their buffer) and ``all`` (the other collectives all-gather a tag after their data).
Every rank builds the step of each layout once, then runs ``rounds`` interleaved rounds of
``steps`` steps per setting (the order rotates every round). Rank 0 reports per layout the median
and minimum time per step of each setting, their ratios to ``0``, and the collectives of one step.

    python -m benchmarks.desync_tags --world 2 --model 10x --rounds 12
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import fshard as fs
from fshard import _watchdog

from . import gpt
from .timing import timed_block

LAYOUTS = ("dp", "fsdp", "dp_tp", "fsdp_tp")
SETTINGS = {"0": (False, False), "reduce": (True, False), "all": (True, True)}


def _step(cfg, weights, tokens, layout: str):
    from fshard_demo.model import fsdp_dims, loss_fn, param_specs

    world = dist.get_world_size()
    tp = 2 if layout.endswith("tp") and world >= 2 else 1
    mesh = fs.Mesh(dp=world // tp, tp=tp)
    specs = param_specs(cfg, layout)
    flat_specs = gpt.from_tree(specs, cfg)
    flat = {}
    for n, w in weights.items():
        s = fs.shard(w, mesh, flat_specs[n])
        flat[n] = fs.Sharded(torch.nn.Parameter(s.local.clone()), mesh, s.layout)
    params = gpt.to_tree(flat, cfg)
    locals_ = [p.local for p in flat.values()]
    dims = fsdp_dims(specs)
    f = fs.shard_map(
        lambda p, t: loss_fn(p, t, cfg, dims), mesh=mesh, in_specs=(specs, "(dp b) t"), out_specs=""
    )

    def step():
        for t in locals_:
            t.grad = None
        f(params, tokens).backward()

    return step


def _rank(model: str, batch: int, steps: int, rounds: int, layouts: list[str]) -> dict:
    torch.manual_seed(0)
    cfg = gpt.MODELS[model]
    weights = gpt.make_weights(cfg)
    tokens = gpt.make_tokens(cfg, batch)["tokens"]
    out: dict = {}
    saved = _watchdog.S.tags, _watchdog.S.gather_tags
    for layout in layouts:
        step = _step(cfg, weights, tokens, layout)
        times: dict[str, list[float]] = {name: [] for name in SETTINGS}
        counts = {}
        for name, tags in SETTINGS.items():
            _watchdog.S.tags, _watchdog.S.gather_tags = tags
            for _ in range(2):  # warm-up
                step()
            with fs.count_collectives() as c:
                step()
            counts[name] = {f"{k}{list(ax)}": n for (k, ax), n in sorted(c.by_kind().items())}
        names = list(SETTINGS)
        for r in range(rounds):
            for name in names[r % 3 :] + names[: r % 3]:
                _watchdog.S.tags, _watchdog.S.gather_tags = SETTINGS[name]
                times[name].append(timed_block(step, steps))
        out[layout] = (times, counts)
    _watchdog.S.tags, _watchdog.S.gather_tags = saved
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", default="demo", choices=sorted(gpt.MODELS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    a = ap.parse_args()
    res = fs.launch(_rank, a.world, (a.model, a.batch, a.steps, a.rounds, a.layouts), timeout=3600)
    cfg = gpt.MODELS[a.model]
    print(f"model {a.model} ({cfg.n_params / 1e6:.2f}M parameters), batch {a.batch}, world {a.world}")
    print(
        f"{'layout':8s} {'setting':8s} {'median ms':>9s} {'ratio':>6s} {'min ms':>8s} {'ratio':>6s}  collectives"
    )
    for layout, (times, counts) in res[0].items():
        base = [1e3 * t for t in times["0"]]
        for name in SETTINGS:
            ms = [1e3 * t for t in times[name]]
            med, lo = statistics.median(ms), min(ms)
            print(
                f"{layout:8s} {name:8s} {med:9.2f} {med / statistics.median(base):6.3f} {lo:8.2f} "
                f"{lo / min(base):6.3f}  {counts[name] if name == '0' else ''}"
            )


if __name__ == "__main__":
    main()
