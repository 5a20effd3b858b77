"""fshard's flagship demo: a small GPT learns 3-digit addition, trained with dp x tp on local ranks.

The model is a GPT-style decoder written as pure functions over a parameter pytree. The loss and
its gradients are computed inside one ``fs.shard_map``: Megatron tensor parallelism splits the
attention heads and the MLP over ``tp`` (one ``fs.psum`` after the attention output and one after
the MLP output), the batch is split over ``dp``, and every gradient collective follows from the
specs; none is written by hand. Clipping (``fs.optim.clip_by_global_norm``) and AdamW
(``fs.optim.adamw``) then update the Sharded parameters leaf by leaf, each in its own layout.

The task is generated at run time (no download): ``"123+456="`` followed by the digits of the
sum in reverse order (``"9750"`` for 579), loss on the answer tokens only. One pair of operands
in 20 never appears in training; the held-out exact-match accuracy is measured on those pairs
by greedy decoding. Batches are a function of the step, so a resumed run sees the same data.

Run (each command runs the same code; without RANK in the environment the program relaunches
itself on ``--nprocs`` local ranks with ``python -m fshard.run``)::

    fshard-demo                                        # 4 ranks, dp=2 x tp=2, 800 steps
    python examples/train_gpt.py --layout fsdp_tp      # also FSDP (ZeRO-3) over dp
    python -m fshard.run -n 4 examples/train_gpt.py    # explicit launcher
    torchrun --nproc-per-node 4 examples/train_gpt.py  # or torchrun
    fshard-demo --check-reference                      # compare every loss with a 1-process run

    # stop half way, then resume on another mesh shape: the loss curve continues
    fshard-demo --out run1 --stop-after 400
    fshard-demo --out run1 --resume --dp 1 --tp 4

Layouts (``--layout``): ``dp_tp`` (default: Megatron TP over tp, data parallel over dp),
``fsdp_tp`` (the same, with every parameter and its optimizer state also split over dp and
all-gathered inside the step), ``dp`` (pure data parallel), ``fsdp`` (pure FSDP).

``--check-reference`` trains the same steps again in one process (a 1x1 mesh: the same code
with every collective a no-op) and compares every step's loss. Float32 rounding differs between
the two and training amplifies it exponentially, so the 1-process run restarts from the sharded
run's state every ``--ref-every`` steps; the largest difference must stay below ``--tolerance``.

Outputs in ``--out``: ``ckpt/step_*`` (sharded checkpoints, `fshard.checkpoint`),
``metrics.json`` (losses, evaluations, resumes) and ``loss.png`` (the loss curve).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import optree
import torch
import torch.nn.functional as F

import fshard as fs
from fshard import checkpoint

__all__ = [
    "Config",
    "Task",
    "init",
    "param_specs",
    "forward",
    "loss_fn",
    "make_train_step",
    "make_eval_step",
    "main",
]

LAYOUTS = ("dp_tp", "fsdp_tp", "dp", "fsdp")
PLUS, EQUALS = 10, 11  # tokens 0-9 are the digits


# == the model: pure functions over a parameter pytree ====================================


@dataclass(frozen=True)
class Config:
    """Model size. ``n_heads`` and ``d_mlp`` must be divisible by tp; every dim by dp for FSDP."""

    digits: int = 3  # operand length; the task's sequences have 3 * digits + 3 tokens
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    d_mlp: int = 512
    vocab: int = 16  # 12 tokens, padded so that FSDP can split it

    @property
    def seq_len(self) -> int:
        return 3 * self.digits + 3

    @property
    def n_params(self) -> int:
        d, f = self.d_model, self.d_mlp
        block = 4 * d * d + 2 * d * f + 4 * d
        return self.n_layers * block + 2 * self.vocab * d + self.seq_len * d + 2 * d


def param_specs(cfg: Config, layout: str) -> dict:
    """The spec string of every parameter for ``layout`` (a pytree shaped like the params).

    ``tp`` splits the heads of q/k/v (columns), the rows of the attention output projection,
    the MLP's hidden units (columns of w1, rows of w2). FSDP layouts also split one other dim
    of every parameter over ``dp``; the step all-gathers it before use.

    Examples:
        >>> param_specs(Config(n_layers=1), "fsdp_tp")["blocks"][0]["wq"]
        '(dp d) (tp e)'
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    tp = layout in ("dp_tp", "fsdp_tp")
    fsdp = layout in ("fsdp", "fsdp_tp")

    def t(label):  # split over tp
        return f"(tp {label})" if tp else label

    def z(label):  # split over dp (FSDP)
        return f"(dp {label})" if fsdp else label

    block = {
        "ln1_w": z("d"), "ln1_b": z("d"),
        "wq": f"{z('d')} {t('e')}", "wk": f"{z('d')} {t('e')}", "wv": f"{z('d')} {t('e')}",
        "wo": f"{t('e')} {z('d')}",
        "ln2_w": z("d"), "ln2_b": z("d"),
        "w1": f"{z('d')} {t('f')}",
        "w2": f"{t('f')} {z('d')}",
    }
    return {
        "wte": f"v {z('d')}",
        "wpe": f"p {z('d')}",
        "blocks": [dict(block) for _ in range(cfg.n_layers)],
        "lnf_w": z("d"), "lnf_b": z("d"),
        "w_out": f"{z('d')} v",
    }


def init(seed: int, cfg: Config, mesh: fs.Mesh, layout: str = "dp_tp"):
    """Initialize the parameters on ``mesh`` in ``layout``: ``(params, specs)``.

    The global values depend only on ``seed`` and ``cfg`` (``fs.random.normal`` draws each
    global tensor from its own seed), so every mesh shape and layout starts from the same model.

    Examples:
        >>> mesh = fs.Mesh(dp=2, tp=2)
        >>> params, specs = init(0, Config(), mesh, "dp_tp")
        >>> params["blocks"][0]["wq"].spec, params["blocks"][0]["wq"].local.shape
        ('d (tp e)', torch.Size([128, 64]))
    """
    specs = param_specs(cfg, layout)
    d, f, v = cfg.d_model, cfg.d_mlp, cfg.vocab
    shapes = {
        "wte": (v, d), "wpe": (cfg.seq_len, d), "lnf_w": (d,), "lnf_b": (d,), "w_out": (d, v),
        "blocks": [
            {"ln1_w": (d,), "ln1_b": (d,), "wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d),
             "ln2_w": (d,), "ln2_b": (d,), "w1": (d, f), "w2": (f, d)}
            for _ in range(cfg.n_layers)
        ],
    }
    proj_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2's scaled init of the residual projections
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    paths, shape_leaves, treedef = optree.tree_flatten_with_path(shapes, is_leaf=is_shape)
    spec_leaves = treedef.flatten_up_to(specs)
    leaves = []
    for i, (path, shape, spec) in enumerate(zip(paths, shape_leaves, spec_leaves)):
        name = path[-1]
        if name.endswith("_w"):
            leaves.append(fs.shard(torch.ones(shape), mesh, spec))
        elif name.endswith("_b"):
            leaves.append(fs.shard(torch.zeros(shape), mesh, spec))
        else:
            std = proj_std if name in ("wo", "w2") else 0.02
            leaves.append(fs.random.normal(seed * 1000 + i, shape, std=std, mesh=mesh, spec=spec))
    return treedef.unflatten(leaves), specs


def _dp_dims(specs):
    """For each parameter, the dim its spec splits over dp (FSDP), or -1."""

    def dim_of(spec):
        for i, dim in enumerate(fs.parse_spec(spec).dims):
            if "dp" in dim.names:
                return i
        return -1

    return optree.tree_map(dim_of, specs)


def _unshard(params, dp_dims):
    """All-gather the FSDP-split parameters over dp (the gradient becomes a reduce-scatter)."""
    return optree.tree_map(
        lambda w, dim: w if dim < 0 else fs.all_gather(w, "dp", dim=dim, tiled=True), params, dp_dims
    )


def forward(params, tokens, cfg: Config, dp_dims=None):
    """Per-shard forward pass: local token block ``(b, s)`` -> logits ``(b, s, vocab)``.

    Runs inside ``fs.shard_map``. q/k/v/w1 hold this rank's columns (heads, hidden units)
    and wo/w2 its rows, so the attention and MLP outputs are partial sums completed by
    ``fs.psum(..., "tp")``; every other value is replicated over tp.
    """
    p = params if dp_dims is None else _unshard(params, dp_dims)
    b, s = tokens.shape
    x = p["wte"][tokens] + p["wpe"][:s]
    d = cfg.d_model
    hd = d // cfg.n_heads
    for blk in p["blocks"]:
        h = F.layer_norm(x, (d,), blk["ln1_w"], blk["ln1_b"])
        q, k, v = (
            (h @ blk[w]).view(b, s, -1, hd).transpose(1, 2)  # (b, local heads, s, hd)
            for w in ("wq", "wk", "wv")
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(b, s, -1)
        x = x + fs.psum(a @ blk["wo"], "tp")
        h = F.layer_norm(x, (d,), blk["ln2_w"], blk["ln2_b"])
        x = x + fs.psum(F.gelu(h @ blk["w1"]) @ blk["w2"], "tp")
    x = F.layer_norm(x, (d,), p["lnf_w"], p["lnf_b"])
    return x @ p["w_out"]


def loss_fn(params, tokens, cfg: Config, dp_dims=None):
    """Mean cross-entropy on the answer tokens of the whole global batch (``fs.pmean`` over dp)."""
    n_ans = cfg.digits + 1
    logits = forward(params, tokens[:, :-1], cfg, dp_dims)[:, -n_ans:]
    local = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, -n_ans:].reshape(-1))
    return fs.pmean(local, "dp")


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
    dp_dims = _dp_dims(specs)

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
    dp_dims = _dp_dims(specs)

    @torch.no_grad()
    def evaluate(params, prompts, answers):
        p = _unshard(params, dp_dims)  # gather FSDP parameters once for all decoding steps
        seq = prompts
        for _ in range(cfg.digits + 1):
            nxt = forward(p, seq, cfg)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        pred = seq[:, prompts.shape[1]:]
        correct = (pred == answers).all(dim=1).float().sum()
        return fs.psum(correct, "dp"), pred

    return fs.shard_map(
        evaluate, mesh=mesh, in_specs=(specs, "(dp b) t", "(dp b) a"), out_specs=("", "(dp b) a")
    )


# == the task: 3-digit addition ===========================================================


class Task:
    """``a+b=`` then the digits of ``a + b`` reversed, as tokens; one pair in 20 is held out.

    Training operands have 1 to ``digits`` digits (each length equally likely), so short
    problems teach the model early which digits line up, and training has no long loss
    plateau; the held-out evaluation uses operands drawn uniformly below ``10**digits``.
    Batches are a pure function of ``(seed, step)``, so a resumed run sees the same data.

    Examples:
        >>> t = Task(digits=3)
        >>> t.render(t.encode(torch.tensor([123]), torch.tensor([456]))[0])
        '123+456=9750'
    """

    def __init__(self, digits: int = 3, seed: int = 0):
        self.digits = digits
        self.seed = seed
        self.high = 10**digits

    def held_out(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Whether the pair ``(a, b)`` belongs to the held-out split (about 1 in 20)."""
        h = (a * 1_000_003 + b * 998_244_353 + 12345) % 1_000_000_007
        return (h * 48271 % 2_147_483_647) % 20 == 0

    def _digits(self, x: torch.Tensor, n: int) -> torch.Tensor:
        powers = 10 ** torch.arange(n - 1, -1, -1)
        return (x[:, None] // powers) % 10

    def encode(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        n = a.shape[0]
        d = self.digits
        return torch.cat(
            [
                self._digits(a, d), torch.full((n, 1), PLUS), self._digits(b, d), torch.full((n, 1), EQUALS),
                self._digits(a + b, d + 1).flip(1),
            ],
            dim=1,
        )

    def _pairs(self, seed: int, n: int, held_out: bool):
        g = torch.Generator().manual_seed(seed)
        got_a, got_b, have = [], [], 0
        while have < n:
            if held_out:  # uniform below 10**digits
                a = torch.randint(0, self.high, (4 * n,), generator=g)
                b = torch.randint(0, self.high, (4 * n,), generator=g)
            else:  # a random length from 1 to digits, then uniform below 10**length
                a, b = (
                    (torch.rand(4 * n, generator=g, dtype=torch.float64)
                     * 10.0 ** torch.randint(1, self.digits + 1, (4 * n,), generator=g)).long()
                    for _ in range(2)
                )
            keep = self.held_out(a, b) == held_out
            got_a.append(a[keep])
            got_b.append(b[keep])
            have += int(keep.sum())
        return torch.cat(got_a)[:n], torch.cat(got_b)[:n]

    def batch(self, step: int, size: int) -> torch.Tensor:
        """The training batch of ``step``: ``(size, seq_len)`` tokens, never a held-out pair."""
        a, b = self._pairs(self.seed * 1_000_003 + step, size, held_out=False)
        return self.encode(a, b)

    def eval_set(self, size: int) -> torch.Tensor:
        """``size`` held-out problems (fixed for a seed)."""
        a, b = self._pairs(self.seed * 1_000_003 - 1, size, held_out=True)
        return self.encode(a, b)

    def render(self, tokens) -> str:
        chars = "0123456789+="
        return "".join(chars[int(t)] if int(t) < len(chars) else "?" for t in tokens)


# == training =============================================================================


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
    add("--check-reference", action="store_true",
        help="then train the same steps in one process and compare every loss (exit 1 if they differ)")
    add("--ref-every", type=int, default=25,
        help="--check-reference: restart the 1-process run from the sharded run's state every N steps")
    add("--tolerance", type=float, default=1e-3, help="--check-reference: largest allowed |loss difference|")
    add("--log-every", type=int, default=None, help="progress line every N steps; unset: 10 lines (tty: all)")
    # Internal, for the --check-reference run: its role, first step, and the sharded run's states.
    add("--role", choices=("train", "reference"), default="train", help=argparse.SUPPRESS)
    add("--start", type=int, default=0, help=argparse.SUPPRESS)
    add("--anchors", default=None, help=argparse.SUPPRESS)
    return p


def _lr(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


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
        problems.append(f"FSDP splits d_model={cfg.d_model} and vocab={cfg.vocab} over dp={dp}: "
                        f"not divisible")
    if problems:
        raise SystemExit("fshard-demo: bad configuration:\n" + "\n".join(f"  - {p}" for p in problems))


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


def _plot(metrics: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s, _ in metrics["losses"]]
    losses = [v for _, v in metrics["losses"]]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ref = metrics.get("reference_losses")
    if ref:  # a broad band under the sharded run's curve: where they agree, the band is centred on it
        ax.plot([s for s, _ in ref], [v for _, v in ref], lw=3.5, color="tab:orange", alpha=0.45,
                label="1-process reference (--check-reference)")
    ax.plot(steps, losses, lw=0.7, color="tab:blue", alpha=0.6, label="training loss (per step)")
    if len(losses) >= 20:
        window = [losses[max(0, i - 19): i + 1] for i in range(len(losses))]
        ax.plot(steps, [sum(w) / len(w) for w in window], lw=1.8, color="tab:blue",
                label="training loss (20-step mean)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy on answer digits")
    for r in metrics.get("resumes", []):
        ax.axvline(r["step"], color="tab:red", ls=":", lw=1.2)
        ax.text(r["step"], 0.62, f" resumed on\n {r['mesh']}\n ({r['layout']})", fontsize=8, color="tab:red",
                ha="left", va="center", transform=ax.get_xaxis_transform())
    handles, labels = ax.get_legend_handles_labels()
    evals = metrics.get("evals", [])
    if evals:
        ax2 = ax.twinx()
        ax2.plot([e[0] for e in evals], [100 * e[1] for e in evals], "o-", color="tab:green", ms=4,
                 label="held-out exact match (%)")
        ax2.set_ylim(0, 100)
        ax2.set_ylabel("held-out exact match (%)", color="tab:green")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="lower left", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _run_key(args, cfg: Config) -> dict:
    """What must not change between a run and its resumption (the loss curve depends on it)."""
    keys = ("seed", "batch", "lr", "warmup", "steps", "weight_decay", "clip")
    return {"config": dataclasses.asdict(cfg), **{k: getattr(args, k) for k in keys}}


def _start_or_resume(args, state, metrics, mesh_text, show):
    """Resume from the latest checkpoint (``--resume``) or clear old ones: ``(state, start, metrics)``."""
    ckpt_dir = os.path.join(args.out, "ckpt")
    if not args.resume:
        if show and os.path.isdir(ckpt_dir):
            if checkpoint.latest_step(ckpt_dir) is not None:
                print(f"starting from scratch: removing old checkpoints in {ckpt_dir} "
                      f"(--resume continues them)")
            for name in os.listdir(ckpt_dir):
                if name.startswith(("step_", ".tmp_step_")):
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
        print(f"resumed from {where} (step {latest}) on Mesh({mesh_text.replace(',', ', ')}), "
              f"layout {args.layout}, in {time.perf_counter() - t0:.1f} s")
    return state, latest, metrics


def _train(args) -> int:
    import torch.distributed as dist

    fs.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = args.role == "reference"
    show = rank == 0 and not reference  # rank 0 alone prints
    check = args.check_reference and not reference
    try:
        cfg, dp, tp = _validate(args, world)
    except SystemExit:
        if rank:
            raise SystemExit(1) from None  # the same problem on every rank: rank 0 alone says it
        raise
    mesh = fs.Mesh(dp=dp, tp=tp)
    mesh_text = f"dp={dp},tp={tp}"
    task = Task(cfg.digits, args.seed)
    ckpt_dir = os.path.join(args.out, "ckpt")
    anchors_dir = os.path.join(args.out, "reference", "anchors")
    metrics_path = os.path.join(args.out, "metrics.json")
    tokens_per_step = args.batch * (cfg.seq_len - 1)

    params, specs = init(args.seed, cfg, mesh, args.layout)
    state = {"params": params, "opt": fs.optim.adamw(args.lr).init(params)}
    train_step = make_train_step(cfg, mesh, specs, weight_decay=args.weight_decay, clip=args.clip)
    eval_step = make_eval_step(cfg, mesh, specs)
    metrics = {"run": _run_key(args, cfg), "mesh": mesh_text, "layout": args.layout,
               "losses": [], "evals": [], "resumes": []}
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
    step_times, cpu_times = [], []
    t_run = time.perf_counter()
    for step in range(start, stop):
        if step in anchors:  # reference: restart from the sharded run's state
            state = checkpoint.load(args.anchors, state, step=step)
        elif check and step > 0 and (step == start or step % args.ref_every == 0):
            checkpoint.save(anchors_dir, state, step=step)
        tokens = task.batch(step, args.batch)  # the same global batch on every rank, a function of step
        t0, c0 = time.perf_counter(), time.process_time()
        counting = counts is None  # count the collectives of the first step (every step has the same)
        with fs.count_collectives() if counting else contextlib.nullcontext() as counted:
            state["params"], state["opt"], loss, _ = train_step(
                state["params"], state["opt"], tokens, _lr(step, args)
            )
            loss = float(loss)
        dt = time.perf_counter() - t0
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
        print(f"  trained steps {start}..{stop} of {args.steps} in {wall:.1f} s: "
              f"{1000 * mean_dt:.1f} ms/step, {tokens_per_step / mean_dt / 1000:.1f}k tokens/s "
              f"on {world} ranks "
              f"(rank 0 busy {1000 * sum(cpu_times) / n:.1f} ms/step on the CPU)")
        print(f"  final loss {metrics['losses'][-1][1]:.4f} "
              f"(mean of the last {len(recent)} steps {sum(recent) / len(recent):.4f})")
    print(f"  held-out exact match {100 * acc:.1f}% ({round(acc * args.eval_size)}/{args.eval_size} sums of "
          f"pairs never trained on), e.g.")
    for i in range(4):
        prompt = task.render(eval_tokens[i, :n_prompt])
        want = task.render(eval_tokens[i, n_prompt:].flip(0)).lstrip("0") or "0"
        got = task.render(pred[i].flip(0)).lstrip("0") or "0"
        print(f"    {prompt}{got:<5} {'ok' if got == want else f'wrong (expected {want})'}")
    if counts is not None:
        print(f"  collectives per training step (rank 0): {counts.total} = {_format_counts(counts)}")
    status = _check_reference(args, metrics, start, stop) if check and stop > start else 0
    _write_json(metrics_path, metrics)
    png = os.path.join(args.out, "loss.png")
    history = [f"{metrics.get('layout', '?')} on {metrics.get('mesh', '?')}"]
    history += [f"{r['layout']} on {r['mesh']}" for r in metrics["resumes"]]
    try:
        _plot(metrics, png, f"fshard demo: {cfg.digits}-digit addition, {cfg.n_params / 1e6:.2f}M params, "
                            + " -> ".join(history))
    except ImportError:
        png = "not drawn (matplotlib is not installed: pip install 'fshard[demo]')"
    print(f"  checkpoint {os.path.join(ckpt_dir, f'step_{stop:08d}')}, loss curve {png}")
    return status


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
    same = ("steps", "batch", "lr", "warmup", "weight_decay", "clip", "seed",
            "d_model", "n_heads", "n_layers", "d_mlp", "digits", "eval_size")
    argv = ["-m", "fshard.demo", "--role", "reference", "--nprocs", "1", "--dp", "1", "--tp", "1",
            "--layout", args.layout, "--out", ref_out, "--start", str(start), "--stop-after", str(stop),
            "--anchors", anchors, "--log-every", str(max(1, (stop - start) // 4))]
    for name in same:
        argv += [f"--{name.replace('_', '-')}", repr(getattr(args, name))]
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_ENV and not k.startswith(("TORCHELASTIC_", "ROLE_", "GROUP_"))}
    root = os.path.dirname(os.path.dirname(os.path.abspath(fs.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH")) if x)
    print(f"--check-reference: training steps {start}..{stop} again in one process (Mesh(dp=1, tp=1)), "
          f"restarting from the sharded run's state every {args.ref_every} steps ...", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], env=env)
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
    print(f"--check-reference: {len(diffs)} steps in {time.perf_counter() - t0:.0f} s: "
          f"max |loss - reference loss| = {diffs[at]:.1e} (at step {at}; on the first step of each window "
          f"{first:.1e}), tolerance {args.tolerance:.0e}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main(argv=None) -> int:
    """Entry point of ``fshard-demo`` and ``examples/train_gpt.py``; returns the exit code.

    Without ``RANK`` in the environment and with ``--nprocs`` > 1, relaunches itself on
    ``--nprocs`` local ranks (``python -m fshard.run -n NPROCS -m fshard.demo ARGS``);
    under ``fshard.run`` or ``torchrun`` it trains on the existing world.

    Examples:
        >>> from fshard.demo import main
        >>> main(["--steps", "200", "--out", "runs/short"])   # doctest: +SKIP
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if "RANK" not in os.environ and args.nprocs > 1:
        from fshard.run import main as run_main

        _validate(args, args.nprocs)  # report a bad configuration once, before starting any rank
        root = os.path.dirname(os.path.dirname(os.path.abspath(fs.__file__)))
        os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x)
        return run_main(["-n", str(args.nprocs), "-m", "fshard.demo", *argv])
    return _train(args)


if __name__ == "__main__":
    sys.exit(main())
