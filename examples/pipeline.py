"""GPipe-style pipeline parallel training over a "pp" axis with ppermute and microbatches.

A stack of residual layers is split by layer over "pp" ("(pp l) i o"): rank s holds
stage s. The batch is cut into microbatches. At clock tick t, stage 0 reads
microbatch t, every other stage reads what its predecessor sent at tick t - 1, each
stage applies its layers, and one ``fs.ppermute`` passes every activation one stage
on. Stage s works on microbatch t - s, so after microbatches + stages - 1 ticks the
last stage has produced every output (the idle ticks at both ends are the pipeline
"bubble"). A masked ``fs.psum`` then hands the outputs from the last stage to every
rank. The backward is the same schedule reversed, for free: the transpose of each
ppermute is the ppermute back, and each stage's gradient stays on its stage.

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/pipeline.py
    torchrun --nproc-per-node 4 examples/pipeline.py

The script trains a few steps with SGD and checks the outputs, every loss and the
final parameters against the plain sequential model in single-process torch, and
exits non-zero if they disagree.
"""

import argparse
import sys

import torch
import torch.distributed as dist

import fshard as fs


def check(name, got, want, tol=1e-4):
    """Exit non-zero, naming ``name``, if ``got`` is not close to the reference ``want``."""
    if not torch.allclose(got, want, rtol=tol, atol=tol):
        err = (got - want).abs().max().item()
        sys.exit(
            f"rank {dist.get_rank()}: {name} disagrees with the single-process reference "
            f"(max abs error {err:.3g})"
        )


def layers(p, h):
    """Plain torch: apply the residual layers stacked in p["w"] (l, d, d) and p["b"] (l, d)."""
    for w, b in zip(p["w"], p["b"]):
        h = h + torch.tanh(h @ w + b)
    return h


def pipeline(p, x):
    """Per shard: p holds this stage's layers; x (microbatches, mb, d) is the whole input."""
    n, stage = fs.axis_size("pp"), fs.axis_index("pp")
    m = x.shape[0]
    to_next = [(i, i + 1) for i in range(n - 1)]
    carry, outputs = torch.zeros_like(x[0]), []
    for t in range(m + n - 1):
        h = layers(p, torch.where(stage == 0, x[min(t, m - 1)], carry))  # stage s: microbatch t - s
        outputs.append(h)
        if t < m + n - 2:
            carry = fs.ppermute(h, "pp", to_next)  # send to the next stage
    y = torch.stack(outputs[n - 1 :])  # on the last stage: the outputs of microbatches 0 .. m-1
    return fs.psum(torch.where(stage == n - 1, y, 0.0), "pp")  # from the last stage to everyone


def main():
    parser = argparse.ArgumentParser(description="GPipe pipeline parallel training")
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--d", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    fs.init()
    mesh = fs.Mesh(pp=dist.get_world_size())
    specs = {"w": "(pp l) i o", "b": "(pp l) o"}
    pipe = fs.shard_map(pipeline, mesh=mesh, in_specs=(specs, "m b d"), out_specs="m b d")

    gen = torch.Generator().manual_seed(args.seed)
    n_layers, d = args.layers_per_stage * mesh.size, args.d
    global_params = {"w": torch.randn(n_layers, d, d, generator=gen) / d**0.5, "b": torch.zeros(n_layers, d)}
    params = {k: fs.shard(v, mesh, specs[k]) for k, v in global_params.items()}
    shape = (args.microbatches, args.microbatch_size, d)
    x, target = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)  # one batch, fitted
    opt = fs.optim.sgd(args.lr)
    opt_state = opt.init(params)

    # Single-process reference: the same layers applied in sequence to the whole batch.
    ref = {k: v.clone().requires_grad_() for k, v in global_params.items()}
    ref_opt = torch.optim.SGD(list(ref.values()), lr=args.lr)

    def loss_fn(p, x, target):  # mean squared error, plus the outputs (for the check)
        y = pipe(p, x)
        return (y - target).square().mean(), y.detach()

    for i in range(args.steps):
        with fs.count_collectives() as counts:
            (loss, y), grads = fs.value_and_grad(loss_fn, has_aux=True)(params, x, target)
        params, opt_state = opt.update(params, grads, opt_state)
        ref_opt.zero_grad()
        ref_y = layers(ref, x.flatten(0, 1)).view(shape)
        ref_loss = (ref_y - target).square().mean()
        ref_loss.backward()
        ref_opt.step()
        check(f"outputs at step {i}", y, ref_y.detach())
        check(f"loss at step {i}", loss, ref_loss.detach())
        if dist.get_rank() == 0:
            print(f"step {i}: loss {loss.item():.4f}  collectives {counts}")
    for k in params:
        check(f"{k} after {args.steps} steps", params[k].full(), ref[k].detach())

    if dist.get_rank() == 0:
        print(
            f"pipeline: OK (pp={mesh.size}, {n_layers} layers, {args.microbatches} microbatches) "
            f"outputs, losses and parameters match the single-process reference"
        )


if __name__ == "__main__":
    main()
