"""Time the data-parallel step of the demo GPT with several bucket sizes, next to DDP.

Not a test and not part of ``benchmarks.run``: a quick look at what launching the gradient
buckets during the backward (instead of all at its end) is worth. Every rank builds each
contender once, then runs interleaved timing rounds of ``steps`` steps (forward + backward,
no optimizer); rank 0 reports the median time per step over rounds, with the min and max.

    python -m benchmarks.bucket_overlap --world 2 --model 10x --batch 32 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import fshard as fs

from . import gpt
from .timing import timed_block


def _fshard_step(cfg, weights, tokens, bucket_mb):
    from fshard_demo.model import loss_fn, param_specs

    mesh = fs.Mesh(dp=dist.get_world_size(), tp=1)  # the demo names both axes
    specs = param_specs(cfg, "dp")
    flat = {n: w.clone().requires_grad_(True) for n, w in weights.items()}
    params = gpt.to_tree(flat, cfg)
    f = fs.shard_map(
        lambda p, t: loss_fn(p, t, cfg),
        mesh=mesh,
        in_specs=(specs, "(dp b) t"),
        out_specs="",
        bucket_mb=bucket_mb,
    )

    def step():
        for t in flat.values():
            t.grad = None
        f(params, tokens).backward()

    return step


def _ddp_step(cfg, weights, tokens, bucket_cap_mb):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(gpt.make_module(cfg, weights), bucket_cap_mb=bucket_cap_mb)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = tokens.tensor_split(world)[rank].contiguous()
    n_ans = cfg.digits + 1

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(local[:, :-1])[:, -n_ans:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), local[:, -n_ans:].reshape(-1))
        loss.backward()

    return step


def _rank(model: str, batch: int, steps: int, rounds: int, sizes: list[float]) -> dict:
    torch.manual_seed(0)
    cfg = gpt.MODELS[model]
    weights = gpt.make_weights(cfg)
    tokens = gpt.make_tokens(cfg, batch)["tokens"]
    contenders = {f"fshard bucket_mb={mb:g}": _fshard_step(cfg, weights, tokens, mb) for mb in sizes}
    contenders["DDP (bucket_cap_mb=25)"] = _ddp_step(cfg, weights, tokens, 25)
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for step in contenders.values():  # warm-up
        for _ in range(3):
            step()
    for _ in range(rounds):
        for name, step in contenders.items():
            times[name].append(timed_block(step, steps))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", default="demo", choices=sorted(gpt.MODELS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0, 1.0, 0.25, 0.0])
    a = ap.parse_args()
    res = fs.launch(_rank, a.world, (a.model, a.batch, a.steps, a.rounds, a.bucket_mb), timeout=1800)
    cfg = gpt.MODELS[a.model]
    print(f"model {a.model} ({cfg.n_params / 1e6:.2f}M parameters), batch {a.batch}, world {a.world}")
    print(f"{'contender':28s} {'median ms/step':>14s} {'min':>8s} {'max':>8s}")
    for name, ts in res[0].items():
        ms = [1e3 * t for t in ts]
        print(f"{name:28s} {statistics.median(ms):14.2f} {min(ms):8.2f} {max(ms):8.2f}")


if __name__ == "__main__":
    main()
