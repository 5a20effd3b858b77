"""Differentially private SGD, data parallel: per-example gradients clipped and noised.

The batch is split over the "dp" axis and the parameters are replicated. Inside the step,
``torch.func.vmap(torch.func.grad(loss))`` gives each local example's own gradient; each is
clipped to norm ``--clip`` (the norm over all parameters), the clipped gradients are summed
over the local examples and then over dp (one all-reduce for all of them), Gaussian noise of
scale ``--sigma * --clip`` is added, and the sum is divided by the global batch size.

The parameters are marked varying with ``fs.pvary`` before the vmap: the gradient of a
replicated parameter is summed over dp (its transpose is a psum, as in JAX), which would mix
the examples of different ranks before the clipping; the gradient of a varying one is this
rank's own. The noise is drawn outside from a seed (the same on every rank) and passed in
replicated, so that the single-process reference can add the same noise.

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/per_example_dp_sgd.py
    torchrun --nproc-per-node 4 examples/per_example_dp_sgd.py
    # --compile is not supported yet: the step's vmap(grad(...)) does not compile inside shard_map

The script trains a few steps and checks every loss and the final parameters against the same
DP-SGD in plain single-process torch (per-example gradients of the global batch with
``torch.func``), and exits non-zero if they disagree. It also checks that a step issues exactly
two all-reduces: the loss and the summed clipped gradients.
"""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.func import grad_and_value, vmap

import fshard as fs


def check(name, got, want, tol=1e-4):
    """Exit non-zero, naming ``name``, if ``got`` is not close to the reference ``want``."""
    if not torch.allclose(got, want, rtol=tol, atol=tol):
        err = (got - want).abs().max().item()
        sys.exit(
            f"rank {dist.get_rank()}: {name} disagrees with the single-process reference "
            f"(max abs error {err:.3g})"
        )


def init_params(seed, d, hidden, classes):
    gen = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(d, hidden, generator=gen) / d**0.5,
        "b1": torch.zeros(hidden),
        "w2": torch.randn(hidden, classes, generator=gen) / hidden**0.5,
        "b2": torch.zeros(classes),
    }


def example_loss(params, x, label):
    """Plain torch: the cross-entropy of one example (x: [d], label: a 0-dim tensor)."""
    h = F.gelu(x @ params["w1"] + params["b1"])
    return F.cross_entropy((h @ params["w2"] + params["b2"])[None], label[None])


def clipped_sum(params, x, labels, clip):
    """Plain torch: the per-example gradients of the batch, each clipped to norm ``clip``, summed;
    and the per-example losses."""
    grads, losses = vmap(grad_and_value(example_loss), in_dims=(None, 0, 0))(params, x, labels)
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)  # [batch]
    scale = (clip / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.einsum("b,b...->...", scale, g) for k, g in grads.items()}, losses


def main():
    parser = argparse.ArgumentParser(description="data parallel DP-SGD with per-example clipping")
    parser.add_argument("--batch", type=int, default=16, help="global batch (divisible by the world size)")
    parser.add_argument("--d", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--clip", type=float, default=0.5, help="per-example gradient norm bound")
    parser.add_argument("--sigma", type=float, default=0.3, help="noise multiplier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="compile the step with fs.compile (inductor, or the backend named: aot_eager, ...)",
    )
    args = parser.parse_args()
    if args.compile:
        # fshard refuses torch.func transforms inside a compiled shard_map call (a TracingError at
        # trace time), and the per-example gradients are vmap(grad(...)) inside the step
        sys.exit(
            "per_example_dp_sgd: --compile is not supported yet: fshard does not compile torch.func "
            "transforms (the step's vmap of grad) inside shard_map; run it without --compile"
        )

    fs.init()
    mesh = fs.Mesh(dp=dist.get_world_size())

    def train_step(params, x, labels, noise):  # runs on local blocks
        local = fs.pvary(params, "dp")  # per-example gradients of this rank's own examples
        sums, losses = clipped_sum(local, x, labels, args.clip)
        sums = fs.psum(sums, "dp")  # one all-reduce for every parameter
        n = args.batch
        new = {k: params[k] - args.lr * (sums[k] + noise[k]) / n for k in params}
        return new, fs.pmean(losses.mean(), "dp")

    step = fs.shard_map(
        train_step, mesh=mesh, in_specs=("...", "(dp b) d", "(dp b)", "..."), out_specs=("...", "")
    )

    params = init_params(args.seed, args.d, args.hidden, args.classes)
    ref = {k: v.clone() for k, v in params.items()}
    expected = {("all_reduce", ("dp",)): 2} if mesh.size > 1 else {}
    data = torch.Generator().manual_seed(args.seed + 1)
    for i in range(args.steps):
        x = torch.randn(args.batch, args.d, generator=data)  # the global batch, the same on every rank
        labels = torch.randint(args.classes, (args.batch,), generator=data)
        noise = {k: args.sigma * args.clip * torch.randn(v.shape, generator=data) for k, v in params.items()}
        with fs.count_collectives() as counts:
            params, loss = step(params, x, labels, noise)

        # Single-process reference: the same DP-SGD step on the global batch.
        sums, losses = clipped_sum(ref, x, labels, args.clip)
        ref = {k: ref[k] - args.lr * (sums[k] + noise[k]) / args.batch for k in ref}
        check(f"loss at step {i}", loss, losses.mean())
        if counts.by_kind() != expected:
            sys.exit(f"rank {dist.get_rank()}: expected collectives {expected} per step, got {counts}")
        if dist.get_rank() == 0:
            print(f"step {i}: loss {loss.item():.4f}  collectives {counts}")
    for k in params:
        check(f"{k} after {args.steps} steps", params[k], ref[k])

    if dist.get_rank() == 0:
        print(
            f"per_example_dp_sgd: OK (dp={mesh.size}) losses and parameters match the single-process reference"
        )


if __name__ == "__main__":
    main()
