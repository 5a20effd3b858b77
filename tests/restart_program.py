"""A small FSDP training loop that checkpoints every few steps and resumes from the latest one.

The program of the restart tests (tests/test_restart.py) and of ``benchmarks/restarts.py``: run it
under a launcher that restarts failed ranks and it continues from its latest checkpoint::

    python -m fshard.run -n 2 --max-restarts 1 -m tests.restart_program OUT --kill-at 17
    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:0 -m tests.restart_program OUT --kill-at 17

``--kill-at S``: on the first attempt, rank 1 kills itself (SIGKILL) before step ``S``.
``--kill-in-save S``: on the first attempt, rank 1 kills itself in the middle of the checkpoint
of step ``S`` (after writing its first block). Rank 0 appends one line per attempt to
``OUT/attempts.txt`` (attempt number, the step it resumed from, what the checkpoint directory
held) and writes the final parameters, gathered, to ``OUT/final.pt``.

`train` is also called on the test-suite's rank pools for the uninterrupted run;
`reference` is the same training by plain torch in one process.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F

SPECS = {"w1": "(dp d) h", "b1": "(dp h)", "w2": "(dp h) c"}
LR = 1e-2
D, H, C, BATCH = 8, 16, 4, 16


def global_params(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(D, H, generator=gen) / D**0.5,
        "b1": torch.zeros(H),
        "w2": torch.randn(H, C, generator=gen) / H**0.5,
    }


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: a function of the step alone, so a resumed run sees the same data."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, D, generator=gen), torch.randint(C, (BATCH,), generator=gen)


def loss_fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.gelu(x @ p["w1"] + p["b1"]) @ p["w2"], y)


def reference(steps: int) -> dict:
    """The same training by plain torch (torch.optim.AdamW on the global batches), in one process."""
    params = {k: v.clone().requires_grad_() for k, v in global_params().items()}
    opt = torch.optim.AdamW(list(params.values()), lr=LR)
    for step in range(steps):
        opt.zero_grad()
        loss_fn(params, *batch(step)).backward()
        opt.step()
    return {k: v.detach() for k, v in params.items()}


def _kill_in_save() -> None:
    """Rank 1 dies by SIGKILL right after DCP wrote its first block of the next save."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    real = dcp_fs._write_item

    def write_then_die(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    dcp_fs._write_item = write_then_die


def train(ckpt: str, steps: int, every: int, *, kill_at=None, kill_in_save=None, log=None) -> dict:
    """Train ``steps`` steps (resuming from the latest checkpoint in ``ckpt``), saving every ``every``;
    return the final parameters, gathered, on every rank."""
    import torch.distributed as dist

    import fshard as fs
    from fshard import checkpoint

    fs.init()
    rank, attempt = dist.get_rank(), fs.restart_count()
    mesh = fs.Mesh(dp=dist.get_world_size())
    opt = fs.optim.adamw(LR)
    params = fs.shard(global_params(), mesh, SPECS)
    state = {"params": params, "opt": opt.init(params)}
    start = checkpoint.latest_step(ckpt) or 0
    if log is not None and rank == 0:
        held = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
        with open(log, "a") as fh:
            fh.write(f"attempt {attempt} start {start} held {held}\n")
    if start:
        state = checkpoint.load(ckpt, state, step=start)

    @fs.shard_map(mesh=mesh, in_specs=(SPECS, "(dp b) d", "(dp b)"), out_specs="")
    def sharded_loss(p, x, y):
        return fs.pmean(loss_fn(fs.all_gather(p, "dp", dim=0, tiled=True), x, y), "dp")

    first = attempt == 0 and rank == 1
    for step in range(start, steps):
        if first and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        _, grads = fs.value_and_grad(sharded_loss)(state["params"], *batch(step))
        state["params"], state["opt"] = opt.update(state["params"], grads, state["opt"])
        if (step + 1) % every == 0:
            if first and step + 1 == kill_in_save:
                _kill_in_save()
            checkpoint.save(ckpt, state, step=step + 1)
    return {k: v.full() for k, v in state["params"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory for the checkpoints, attempts.txt and final.pt")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-in-save", type=int, default=None)
    args = parser.parse_args()
    import torch.distributed as dist

    os.makedirs(args.out, exist_ok=True)
    final = train(
        os.path.join(args.out, "ckpt"),
        args.steps,
        args.every,
        kill_at=args.kill_at,
        kill_in_save=args.kill_in_save,
        log=os.path.join(args.out, "attempts.txt"),
    )
    if dist.get_rank() == 0:
        torch.save(final, os.path.join(args.out, "final.pt"))


if __name__ == "__main__":
    main()
