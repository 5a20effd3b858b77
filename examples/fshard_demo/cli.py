"""The command line: flags, configuration checks, relaunching on local ranks, ``main``."""

from __future__ import annotations

import argparse
import os
import sys

import fshard as fs

from .model import LAYOUTS, Config
from .train import child_pythonpath, train

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fshard-demo",
        description="Train a small GPT on 3-digit addition with fshard (dp x tp on local ranks).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add("--layout", choices=LAYOUTS, default="dp_tp", help="parallel layout of the parameters")
    add("--nprocs", type=int, default=4, help="ranks to launch when run as a plain process")
    add("--dp", type=int, default=None, help="data-parallel axis size; unset: world size / tp")
    add("--tp", type=int, default=None, help="tensor-parallel axis size; unset: 2 for *_tp layouts, else 1")
    add("--steps", type=int, default=800, help="total training steps (sets the LR schedule)")
    add("--stop-after", type=int, default=None, help="stop (with a checkpoint) after this step")
    add("--batch", type=int, default=128, help="global batch size (sequences)")
    add("--lr", type=float, default=1e-3, help="peak learning rate (warmup, then cosine to 10%%)")
    add("--warmup", type=int, default=50, help="linear warmup steps")
    add("--weight-decay", type=float, default=0.01)
    add("--clip", type=float, default=1.0, help="clip gradients to this global norm")
    add("--seed", type=int, default=0, help="seed of the initial parameters and of the data")
    add("--d-model", type=int, default=Config.d_model)
    add("--n-heads", type=int, default=Config.n_heads)
    add("--n-layers", type=int, default=Config.n_layers)
    add("--d-mlp", type=int, default=Config.d_mlp)
    add("--digits", type=int, default=Config.digits, help="operand digits")
    add("--eval-size", type=int, default=1024, help="held-out problems to evaluate")
    add("--eval-every", type=int, default=100, help="evaluate held-out accuracy every N steps")
    add("--out", default="fshard_demo_out", help="output directory (checkpoints, metrics, plot)")
    add("--ckpt-every", type=int, default=200, help="checkpoint every N steps (0: only at the end)")
    add("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    add(
        "--max-restarts",
        type=int,
        default=0,
        help="when run as a plain process: restart every rank up to N times after a failure, "
        "resuming from the latest checkpoint",
    )
    add(
        "--check-reference",
        action="store_true",
        help="then train the same steps in one process and compare every loss (exit 1 if they differ)",
    )
    add(
        "--ref-every",
        type=int,
        default=25,
        help="--check-reference: restart the 1-process run from the sharded run's state every N steps",
    )
    add("--tolerance", type=float, default=1e-3, help="--check-reference: largest allowed |loss difference|")
    add("--log-every", type=int, default=None, help="progress line every N steps; unset: 10 lines (tty: all)")
    add(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="compile the training step with fs.compile (backend inductor, or the one named: aot_eager, "
        "...): the first step compiles (tens of seconds), later steps run the graph, without the "
        "per-op tracking",
    )
    add("--profile", type=int, default=0, help="profile N steps and print the time spent in collectives")
    # Internal, for the --check-reference run: its role, first step, and the sharded run's states.
    add("--role", choices=("train", "reference"), default="train", help=argparse.SUPPRESS)
    add("--start", type=int, default=0, help=argparse.SUPPRESS)
    add("--anchors", default=None, help=argparse.SUPPRESS)
    return p


def _mesh_shape(args, world: int) -> tuple[int, int]:
    tp_layout = args.layout in ("dp_tp", "fsdp_tp")
    tp, dp = args.tp, args.dp
    if not tp_layout and tp not in (None, 1):
        raise SystemExit(f"fshard-demo: --layout {args.layout} has no tensor parallelism; drop --tp {tp}")
    if tp is None:
        tp = (world // dp if dp else (2 if world % 2 == 0 else 1)) if tp_layout else 1
    if dp is None:
        dp = world // tp if tp and world % tp == 0 else 0
    if dp * tp != world:
        raise SystemExit(f"fshard-demo: --dp {args.dp} x --tp {args.tp} does not fit the world size {world}")
    return dp, tp


def _cfg(args) -> Config:
    names = ("digits", "d_model", "n_heads", "n_layers", "d_mlp")
    return Config(**{name: getattr(args, name) for name in names})


def _validate(args, world: int) -> tuple[Config, int, int]:
    """The model config and mesh shape ``(cfg, dp, tp)``; SystemExit with every problem if they do not fit."""
    dp, tp = _mesh_shape(args, world)
    cfg = _cfg(args)
    _check_cfg(cfg, args, dp, tp)
    return cfg, dp, tp


def _check_cfg(cfg: Config, args, dp: int, tp: int) -> None:
    problems = []
    if cfg.d_model % cfg.n_heads:
        problems.append(f"--d-model {cfg.d_model} is not divisible by --n-heads {cfg.n_heads}")
    if cfg.n_heads % tp:
        problems.append(f"--n-heads {cfg.n_heads} is not divisible by tp={tp} (heads are split over tp)")
    if cfg.d_mlp % tp:
        problems.append(f"--d-mlp {cfg.d_mlp} is not divisible by tp={tp}")
    if args.batch % dp or args.eval_size % dp:
        problems.append(f"--batch {args.batch} and --eval-size {args.eval_size} must be divisible by dp={dp}")
    if args.layout.startswith("fsdp") and (cfg.d_model % dp or cfg.vocab % dp):
        problems.append(
            f"FSDP splits d_model={cfg.d_model} and vocab={cfg.vocab} over dp={dp}: not divisible"
        )
    if problems:
        raise SystemExit("fshard-demo: bad configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def _run_rank(args) -> int:
    """One rank of the run: join the process group, check the configuration, train."""
    import torch.distributed as dist

    fs.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        cfg, dp, tp = _validate(args, world)
    except SystemExit:
        if rank:
            raise SystemExit(1) from None  # the same problem on every rank: rank 0 alone says it
        raise
    return train(args, cfg, fs.Mesh(dp=dp, tp=tp))


def main(argv=None) -> int:
    """Entry point of ``fshard-demo`` and ``examples/train_gpt.py``; returns the exit code.

    Without ``RANK`` in the environment and with ``--nprocs`` > 1, relaunches itself on
    ``--nprocs`` local ranks (``python -m fshard.run -n NPROCS -m fshard_demo ARGS``);
    under ``fshard.run`` or ``torchrun`` it trains on the existing world.

    Examples:
        >>> from fshard_demo import main
        >>> main(["--steps", "200", "--out", "runs/short"])   # doctest: +SKIP
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if "RANK" not in os.environ and args.nprocs > 1:
        from fshard.run import main as run_main

        _validate(args, args.nprocs)  # report a bad configuration once, before starting any rank
        os.environ["PYTHONPATH"] = child_pythonpath(os.environ.get("PYTHONPATH"))
        restarts = ["--max-restarts", str(args.max_restarts)] if args.max_restarts else []
        return run_main(["-n", str(args.nprocs), *restarts, "-m", __package__, *argv])
    return _run_rank(args)
