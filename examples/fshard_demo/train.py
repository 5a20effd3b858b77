"""Training: the step functions, the training loop, checkpoints and resumption, the reference check.

The loss and its gradients are computed inside one ``fs.shard_map`` (:func:`make_train_step`):
every gradient collective follows from the specs; none is written by hand. Clipping
(``fs.optim.clip_by_global_norm``) and AdamW (``fs.optim.adamw``) then update the Sharded
parameters leaf by leaf, each in its own layout.

``--check-reference`` trains the same steps again in one process (a 1x1 mesh: the same code
with every collective a no-op) and compares every step's loss (:func:`_check_reference`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import time

import torch

import fshard as fs
from fshard import checkpoint

from .data import Task
from .model import Config, forward, fsdp_dims, init_params, loss_fn, unshard
from .plot import plot_metrics

__all__ = ["child_pythonpath", "make_eval_step", "make_train_step", "train"]


def make_train_step(cfg: Config, mesh: fs.Mesh, specs, *, weight_decay=0.01, clip=1.0, betas=(0.9, 0.98)):
    """The training step ``(params, opt_state, tokens, lr) -> (params, opt_state, loss, grad_norm)``.

    ``tokens`` is the global batch (every rank passes the same tensor; shard_map keeps this
    rank's rows). The loss and gradients come from ``fs.value_and_grad`` inside one
    ``fs.shard_map``: fshard turns each replicated parameter's use with dp-split data into one
    all-reduce over dp, each FSDP all-gather into a reduce-scatter, each tp psum's transpose
    into a no-op, and the Megatron "f" operator (the psum over tp of the activations'
    gradient) appears by itself where a tp-replicated activation meets a tp-split weight.
    Clipping and AdamW then run leaf by leaf on the local blocks of the Sharded gradients
    (one all-reduce for the global norm), so optimizer state is laid out like the parameters.
    """
    dp_dims = fsdp_dims(specs)

    def loss_and_grads(params, tokens):
        return fs.value_and_grad(loss_fn)(params, tokens, cfg, dp_dims)

    grad_step = fs.shard_map(loss_and_grads, mesh=mesh, in_specs=(specs, "(dp b) t"), out_specs=("", specs))

    def train_step(params, opt_state, tokens, lr):
        loss, grads = grad_step(params, tokens)
        # Clipping and AdamW run leaf by leaf on the global (Sharded) values: both work inside
        # shard_map too, but here the optimizer state never has to be described by specs.
        grads, norm = fs.optim.clip_by_global_norm(grads, clip)
        opt = fs.optim.adamw(lr, betas=betas, weight_decay=weight_decay)
        params, opt_state = opt.update(params, grads, opt_state)
        return params, opt_state, loss, norm

    return train_step


def make_eval_step(cfg: Config, mesh: fs.Mesh, specs):
    """Greedy decoding of the answers: ``(params, prompts, answers) -> (n_correct, predictions)``."""
    dp_dims = fsdp_dims(specs)

    @torch.no_grad()
    def evaluate(params, prompts, answers):
        p = unshard(params, dp_dims)  # gather FSDP parameters once for all decoding steps
        seq = prompts
        for _ in range(cfg.digits + 1):
            nxt = forward(p, seq, cfg)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        pred = seq[:, prompts.shape[1] :]
        correct = (pred == answers).all(dim=1).float().sum()
        return fs.psum(correct, "dp"), pred

    return fs.shard_map(
        evaluate, mesh=mesh, in_specs=(specs, "(dp b) t", "(dp b) a"), out_specs=("", "(dp b) a")
    )


def _lr(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


class _Progress:
    """Rank 0's progress line: updated in place on a terminal, printed every N steps otherwise."""

    def __init__(self, total: int, start: int, every: int | None, enabled: bool):
        self.total, self.start, self.enabled = total, start, enabled
        self.tty = enabled and sys.stdout.isatty()
        self.every = every or (1 if self.tty else max(1, (total - start) // 10))
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float, tok_s: float, ms: float) -> None:
        done = step + 1
        if not self.enabled or not (done % self.every == 0 or done == self.total):
            return
        frac = done / self.total
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        eta = (time.perf_counter() - self.t0) / max(1, done - self.start) * (self.total - done)
        line = (
            f"step {done:5d}/{self.total} [{bar}] loss {loss:.4f} | {tok_s / 1000:6.1f}k tok/s | "
            f"{ms:6.1f} ms/step | eta {eta:4.0f}s"
        )
        print("\r" + line if self.tty else line, end="" if self.tty else "\n", flush=True)

    def note(self, text: str) -> None:
        if self.enabled:
            print(("\r\033[K" if self.tty else "") + text, flush=True)

    def close(self) -> None:
        if self.tty:
            print()


def _format_counts(counts) -> str:
    by = counts.by_kind()
    return ", ".join(f"{n} {kind}[{','.join(axes)}]" for (kind, axes), n in sorted(by.items())) or "none"


def _profile_summary(prof, steps: int) -> str:
    """Time per step in fshard's collectives, by kind and axes, from the profiler's labels
    (``fshard.{kind}[{axes}] {bytes}B``), on this rank (wall time inside each call)."""
    by: dict = {}
    for ev in prof.events():
        if ev.name.startswith("fshard."):
            key = ev.name.split(" ")[0][len("fshard.") :]
            calls, us = by.get(key, (0, 0.0))
            by[key] = (calls + 1, us + ev.cpu_time_total)
    total = sum(us for _, us in by.values()) / steps / 1e3
    parts = ", ".join(
        f"{k} {us / steps / 1e3:.1f} ms ({calls // steps}x)"
        for k, (calls, us) in sorted(by.items(), key=lambda kv: -kv[1][1])
    )
    return (
        f"  time in collectives per step (rank 0, {steps} profiled steps): {total:.1f} ms = {parts or 'none'}"
    )


def _read_json(path: str):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


def _run_key(args, cfg: Config) -> dict:
    """What must not change between a run and its resumption (the loss curve depends on it)."""
    keys = ("seed", "batch", "lr", "warmup", "steps", "weight_decay", "clip")
    return {"config": dataclasses.asdict(cfg), **{k: getattr(args, k) for k in keys}}


def _start_or_resume(args, state, metrics, mesh_text, show):
    """Resume from the latest checkpoint (``--resume``, or by itself when a launcher restarted the
    ranks after a failure: ``fs.restart_count() > 0``) or clear old ones: ``(state, start, metrics)``."""
    ckpt_dir = os.path.join(args.out, "ckpt")
    if not args.resume and fs.restart_count() == 0:  # after a launcher's restart, always resume
        if show and os.path.isdir(ckpt_dir):
            if checkpoint.latest_step(ckpt_dir) is not None:
                print(
                    f"starting from scratch: removing old checkpoints in {ckpt_dir} (--resume continues them)"
                )
            for name in os.listdir(ckpt_dir):
                if name.startswith(("step_", ".tmp_step_", ".old_step_")):
                    shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
        return state, 0, metrics
    latest = checkpoint.latest_step(ckpt_dir)
    if latest is None:
        if show:
            print(f"no checkpoint in {ckpt_dir}: starting from scratch")
        return state, 0, metrics
    old = _read_json(os.path.join(args.out, "metrics.json"))
    if old and old.get("run") != metrics["run"]:
        diff = sorted(k for k in metrics["run"] if old["run"].get(k) != metrics["run"][k])
        raise SystemExit(
            f"fshard-demo: --resume with other settings than the checkpointed run ({', '.join(diff)} "
            f"differ); pass the same --steps/--batch/--lr/model flags, or use another --out"
        )
    t0 = time.perf_counter()
    state = checkpoint.load(ckpt_dir, state, step=latest)  # resharded to this run's mesh and layout
    if old:
        metrics = old
        metrics["losses"] = [x for x in old["losses"] if x[0] < latest]
        metrics["evals"] = [x for x in old["evals"] if x[0] <= latest]
        metrics["resumes"] = [x for x in old["resumes"] if x["step"] < latest]
        metrics.pop("reference_losses", None)
    metrics["resumes"].append({"step": latest, "mesh": mesh_text, "layout": args.layout})
    if show:
        where = os.path.join(ckpt_dir, f"step_{latest:08d}")
        print(
            f"resumed from {where} (step {latest}) on Mesh({mesh_text.replace(',', ', ')}), "
            f"layout {args.layout}, in {time.perf_counter() - t0:.1f} s"
        )
    return state, latest, metrics


def train(args, cfg: Config, mesh: fs.Mesh) -> int:
    """Train (or, with ``--role reference``, re-train a window of) the run that ``args`` describes.

    Runs on every rank of the initialized process group, on ``mesh`` (axes ``dp`` and ``tp``);
    ``args`` are the parsed command-line flags (:mod:`fshard_demo.cli`). Returns the exit code.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = args.role == "reference"
    show = rank == 0 and not reference  # rank 0 alone prints
    check = args.check_reference and not reference
    dp, tp = mesh.shape["dp"], mesh.shape["tp"]
    mesh_text = f"dp={dp},tp={tp}"
    task = Task(cfg.digits, args.seed)
    ckpt_dir = os.path.join(args.out, "ckpt")
    anchors_dir = os.path.join(args.out, "reference", "anchors")
    metrics_path = os.path.join(args.out, "metrics.json")
    tokens_per_step = args.batch * (cfg.seq_len - 1)

    params, specs = init_params(args.seed, cfg, mesh, args.layout)
    state = {"params": params, "opt": fs.optim.adamw(args.lr).init(params)}
    train_step = make_train_step(cfg, mesh, specs, weight_decay=args.weight_decay, clip=args.clip)
    lr_of = functools.partial(_lr, args=args)
    if args.compile:  # one graph per rank: the tracking runs once, at trace time
        train_step = fs.compile(train_step, backend=args.compile)
        # a tensor learning rate: a float would be a constant of the graph (a recompile per step)
        lr_of = lambda step: torch.tensor(_lr(step, args))  # noqa: E731
    eval_step = make_eval_step(cfg, mesh, specs)
    metrics = {
        "run": _run_key(args, cfg),
        "mesh": mesh_text,
        "layout": args.layout,
        "losses": [],
        "evals": [],
        "resumes": [],
    }
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    if reference:
        start = args.start
        anchors = set(checkpoint.steps(args.anchors)) if args.anchors else set()
    else:
        state, start, metrics = _start_or_resume(args, state, metrics, mesh_text, show)
        anchors = set()
        if check and rank == 0:
            shutil.rmtree(anchors_dir, ignore_errors=True)
    if world > 1:
        dist.barrier()  # rank 0 has cleared old checkpoints and anchors
    stop = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    if show:
        blk = specs["blocks"][0]
        print(
            f"fshard demo: GPT ({cfg.n_layers} layers, d={cfg.d_model}, {cfg.n_heads} heads, "
            f"{cfg.n_params / 1e6:.2f}M params) learns {cfg.digits}-digit addition\n"
            f"  {world} ranks, Mesh(dp={dp}, tp={tp}), layout {args.layout}; global batch {args.batch} "
            f"({tokens_per_step} tokens), steps {start}..{stop} of {args.steps}\n"
            f"  specs: wq {blk['wq']!r}, wo {blk['wo']!r}, w1 {blk['w1']!r}, w2 {blk['w2']!r}, "
            f"wte {specs['wte']!r}",
            flush=True,
        )
    eval_tokens = task.eval_set(args.eval_size)
    n_prompt = 2 * cfg.digits + 2

    last_eval = {}

    def evaluate(step):
        correct, pred = eval_step(state["params"], eval_tokens[:, :n_prompt], eval_tokens[:, n_prompt:])
        acc = float(correct) / args.eval_size
        metrics["evals"] = [e for e in metrics["evals"] if e[0] != step] + [[step, acc]]
        last_eval.update(step=step, acc=acc, pred=pred)
        return acc

    if start == 0 and not reference:
        evaluate(0)
    progress = _Progress(stop, start, args.log_every, show)
    counts = None
    # (a compiled step is counted with inductor only: fs.count_collectives reads its compiled calls)
    countable = args.compile in (None, "inductor")
    step_times, cpu_times = [], []
    # --profile N: torch.profiler over N steps (after the first, which plans the shard_map)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    profiled, profile_text = 0, None
    t_run = time.perf_counter()
    for step in range(start, stop):
        if step in anchors:  # reference: restart from the sharded run's state
            state = checkpoint.load(args.anchors, state, step=step)
        elif check and step > 0 and (step == start or step % args.ref_every == 0):
            checkpoint.save(anchors_dir, state, step=step)
        tokens = task.batch(step, args.batch)  # the same global batch on every rank, a function of step
        t0, c0 = time.perf_counter(), time.process_time()
        counting = (
            countable and counts is None
        )  # count the collectives of the first step (every step has the same)
        profiling = prof is not None and step > start and profiled < args.profile
        if profiling and profiled == 0:
            prof.__enter__()
        with fs.count_collectives() if counting else contextlib.nullcontext() as counted:
            state["params"], state["opt"], loss, _ = train_step(
                state["params"], state["opt"], tokens, lr_of(step)
            )
            loss = float(loss)
        dt = time.perf_counter() - t0
        if profiling:
            profiled += 1
            if profiled == args.profile or step + 1 == stop:
                prof.__exit__(None, None, None)
                profile_text = _profile_summary(prof, profiled)
                prof = None
        if counting:
            counts = counted
        if step > start:  # the first call also plans the shard_map
            step_times.append(dt)
            cpu_times.append(time.process_time() - c0)
        metrics["losses"].append([step, loss])
        progress.update(step, loss, tokens_per_step / dt, 1000 * dt)
        done = step + 1
        if reference:
            if rank == 0 and args.log_every and done % args.log_every == 0:
                print(f"  reference: step {done}/{stop} loss {loss:.4f}", flush=True)
        elif done == stop or (args.ckpt_every and done % args.ckpt_every == 0):
            checkpoint.save(ckpt_dir, state, step=done)
            acc = evaluate(done)
            progress.note(f"step {done}: checkpoint saved, held-out exact match {100 * acc:.1f}%")
            if rank == 0:
                _write_json(metrics_path, metrics)
        elif args.eval_every and done % args.eval_every == 0:
            acc = evaluate(done)
            progress.note(f"step {done}: held-out exact match {100 * acc:.1f}%")
    wall = time.perf_counter() - t_run
    progress.close()
    if reference:
        if rank == 0:
            _write_json(metrics_path, metrics)
        return 0

    if last_eval.get("step") != stop:
        evaluate(stop)
    acc, pred = last_eval["acc"], last_eval["pred"]
    pred = pred.full() if isinstance(pred, fs.Sharded) else pred  # a collective: every rank
    if world > 1:
        dist.barrier()
    dist.destroy_process_group()  # the other ranks are done; rank 0 reports (and may run the reference)
    if rank != 0:
        return 0

    print("== summary ==")
    if step_times:
        n = len(step_times)
        mean_dt = sum(step_times) / n
        recent = [v for _, v in metrics["losses"][-20:]]
        print(
            f"  trained steps {start}..{stop} of {args.steps} in {wall:.1f} s: "
            f"{1000 * mean_dt:.1f} ms/step, {tokens_per_step / mean_dt / 1000:.1f}k tokens/s "
            f"on {world} ranks "
            f"(rank 0 busy {1000 * sum(cpu_times) / n:.1f} ms/step on the CPU)"
        )
        print(
            f"  final loss {metrics['losses'][-1][1]:.4f} "
            f"(mean of the last {len(recent)} steps {sum(recent) / len(recent):.4f})"
        )
    print(
        f"  held-out exact match {100 * acc:.1f}% ({round(acc * args.eval_size)}/{args.eval_size} sums of "
        f"pairs never trained on), e.g."
    )
    for i in range(4):
        prompt = task.render(eval_tokens[i, :n_prompt])
        want = task.render(eval_tokens[i, n_prompt:].flip(0)).lstrip("0") or "0"
        got = task.render(pred[i].flip(0)).lstrip("0") or "0"
        print(f"    {prompt}{got:<5} {'ok' if got == want else f'wrong (expected {want})'}")
    if counts is not None:
        print(f"  collectives per training step (rank 0): {counts.total} = {_format_counts(counts)}")
    if profile_text is not None:
        print(profile_text)
    status = _check_reference(args, metrics, start, stop) if check and stop > start else 0
    _write_json(metrics_path, metrics)
    png = os.path.join(args.out, "loss.png")
    history = [f"{metrics.get('layout', '?')} on {metrics.get('mesh', '?')}"]
    history += [f"{r['layout']} on {r['mesh']}" for r in metrics["resumes"]]
    try:
        plot_metrics(
            metrics,
            png,
            f"fshard demo: {cfg.digits}-digit addition, {cfg.n_params / 1e6:.2f}M params, "
            + " -> ".join(history),
        )
    except ImportError:
        png = "not drawn (matplotlib is not installed: pip install 'fshard[demo]')"
    print(f"  checkpoint {os.path.join(ckpt_dir, f'step_{stop:08d}')}, loss curve {png}")
    return status


def child_pythonpath(current: str | None) -> str:
    """``PYTHONPATH`` for a child process: first the directories that hold this ``fshard`` and
    this package (a source checkout need not be installed), then ``current``."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(os.path.dirname(os.path.abspath(fs.__file__)))
    return os.pathsep.join(dict.fromkeys(x for x in (root, here, current) if x))


_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _check_reference(args, metrics: dict, start: int, stop: int) -> int:
    """Train steps ``start..stop`` again in one process (Mesh(dp=1, tp=1)) and compare every loss.

    Rounding differs between the sharded and the 1-process run (sums are split differently),
    and training amplifies such differences exponentially while the model learns (they grow
    by about 100x per 50 steps here), so two correct float32 runs drift apart over hundreds of
    steps. The reference therefore restarts from the sharded run's parameters and optimizer
    state every ``--ref-every`` steps, loading the checkpoints the sharded run saved on its
    own mesh (a resharding load); each window then starts from identical values.
    """
    ref_out = os.path.join(args.out, "reference")
    anchors = os.path.join(ref_out, "anchors")
    same = (
        "steps",
        "batch",
        "lr",
        "warmup",
        "weight_decay",
        "clip",
        "seed",
        "d_model",
        "n_heads",
        "n_layers",
        "d_mlp",
        "digits",
        "eval_size",
    )
    argv = [
        "-m",
        __package__,
        "--role",
        "reference",
        "--nprocs",
        "1",
        "--dp",
        "1",
        "--tp",
        "1",
        "--layout",
        args.layout,
        "--out",
        ref_out,
        "--start",
        str(start),
        "--stop-after",
        str(stop),
        "--anchors",
        anchors,
        "--log-every",
        str(max(1, (stop - start) // 4)),
    ]
    for name in same:
        argv += [f"--{name.replace('_', '-')}", repr(getattr(args, name))]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCH_ENV and not k.startswith(("TORCHELASTIC_", "ROLE_", "GROUP_"))
    }
    env["PYTHONPATH"] = child_pythonpath(env.get("PYTHONPATH"))
    print(
        f"--check-reference: training steps {start}..{stop} again in one process (Mesh(dp=1, tp=1)), "
        f"restarting from the sharded run's state every {args.ref_every} steps ...",
        flush=True,
    )
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], check=False, env=env)
    shutil.rmtree(anchors, ignore_errors=True)
    if proc.returncode:
        print(f"--check-reference: FAIL: the reference run exited with code {proc.returncode}")
        return 1
    ref = {s: v for s, v in _read_json(os.path.join(ref_out, "metrics.json"))["losses"]}
    ours = {s: v for s, v in metrics["losses"] if start <= s < stop}
    diffs = {s: abs(v - ref[s]) for s, v in ours.items() if s in ref}
    if len(diffs) != len(ours):
        print(f"--check-reference: FAIL: the reference has {len(diffs)} of the {len(ours)} steps")
        return 1
    at = max(diffs, key=diffs.get)
    first = max(d for s, d in diffs.items() if s == start or s % args.ref_every == 0)
    metrics["reference_losses"] = sorted(ref.items())
    ok = diffs[at] <= args.tolerance
    print(
        f"--check-reference: {len(diffs)} steps in {time.perf_counter() - t0:.0f} s: "
        f"max |loss - reference loss| = {diffs[at]:.1e} (at step {at}; on the first step of each window "
        f"{first:.1e}), tolerance {args.tolerance:.0e}: {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1
