"""GPipe-style pipeline parallel training over a "pp" axis, with stages of different shapes.

A small language-model-shaped network is cut into stages: stage 0 holds the token embedding and
its layers, each stage has its own hidden width, and the last stage holds the output head. As in
``torch.distributed.pipelining``, each rank builds only its own stage: the parameters are an
``fs.PerRank`` value (``fs.PerRank.build`` calls only this rank's entry of a list of builders),
passed to the shard_map'd function as this rank's plain tensors and varying over "pp", so their
gradients are never summed over "pp". Inside, ``fs.switch`` runs this rank's stage code.

The batch is cut into microbatches. At clock tick t, stage s works on microbatch t - s: stage 0
embeds the tokens, every other stage reads what its predecessor sent at tick t - 1, and one
``fs.ppermute`` passes every activation one stage on. Ticks where a stage has no microbatch (the
pipeline "bubble") return zeros. The last stage sums the cross-entropy of its microbatches, and a
``fs.psum`` over "pp" gives every rank the loss. The backward is the same schedule reversed, for
free: the transpose of each ppermute is the ppermute back, and each stage's gradient stays on its
stage (a `PerRank` gradient, updated there by ``fs.optim.sgd``).

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/pipeline.py
    torchrun --nproc-per-node 4 examples/pipeline.py
    python -m fshard.run -n 4 examples/pipeline.py --compile   # loss and gradients compiled (inductor)

The script trains a few steps with SGD and checks every loss and each stage's final parameters
against the plain sequential model in single-process torch, and exits non-zero if they disagree.
"""

import argparse
import contextlib
import functools
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fshard as fs


def check(name, got, want, tol=1e-4):
    """Exit non-zero, naming ``name``, if ``got`` is not close to the reference ``want``."""
    if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol):
        err = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
        sys.exit(
            f"rank {dist.get_rank()}: {name} disagrees with the single-process reference "
            f"(shapes {tuple(got.shape)} and {tuple(want.shape)}, max abs error {err:.3g})"
        )


def hidden_width(args, s):
    """Stage s's hidden width: each stage has its own."""
    return args.d * (s + 2) // 2


def init_stage(args, s, n):
    """Stage s of n (plain tensors): an embedding on stage 0, its residual MLP layers, a head on the last."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + s)
    d, h = args.d, hidden_width(args, s)
    p = {
        "layers": [
            {
                "w1": torch.randn(d, h, generator=gen) / d**0.5,
                "b1": torch.zeros(h),
                "w2": torch.randn(h, d, generator=gen) / h**0.5,
            }
            for _ in range(args.layers_per_stage)
        ]
    }
    if s == 0:
        p["embed"] = torch.randn(args.vocab, d, generator=gen)
    if s == n - 1:
        p["head"] = torch.randn(d, args.vocab, generator=gen) / d**0.5
    return p


def layers(p, h):
    """Plain torch: the residual MLP layers of one stage."""
    for lay in p["layers"]:
        h = h + torch.tanh(h @ lay["w1"] + lay["b1"]) @ lay["w2"]
    return h


def stage(s, n, t, p, tokens, targets, carry):
    """Stage s at clock tick t (plain Python: s, n and t are ints here): microbatch t - s."""
    i, m = t - s, tokens.shape[0]
    if not 0 <= i < m:  # the bubble: nothing to do on this tick
        return torch.zeros_like(carry), torch.zeros(())
    h = layers(p, p["embed"][tokens[i]] if s == 0 else carry)
    if s < n - 1:
        return h, torch.zeros(())
    return torch.zeros_like(h), F.cross_entropy(h @ p["head"], targets[i], reduction="sum")


def pipeline(p, tokens, targets):
    """Per shard: p is this stage's parameters; tokens, targets (microbatches, mb) the whole batch."""
    n, index = fs.axis_size("pp"), fs.axis_index("pp")
    m, mb = tokens.shape
    d = p["layers"][0]["w1"].shape[0]  # the activation width between stages
    stages = [functools.partial(stage, s, n) for s in range(n)]
    to_next = [(i, i + 1) for i in range(n - 1)]
    carry, total = torch.zeros(mb, d), torch.zeros(())
    for t in range(m + n - 1):
        h, loss = fs.switch(index, stages, t, p, tokens, targets, carry)  # this rank's stage
        total = total + loss
        if t < m + n - 2:
            carry = fs.ppermute(h, "pp", to_next)  # send to the next stage
    return fs.psum(total, "pp") / tokens.numel()  # the mean loss, from the last stage to everyone


def reference_loss(stages, tokens, targets):
    """The same network applied in sequence to the whole batch, in one process."""
    h = stages[0]["embed"][tokens.reshape(-1)]
    for p in stages:
        h = layers(p, h)
    return F.cross_entropy(h @ stages[-1]["head"], targets.reshape(-1))


def main():
    parser = argparse.ArgumentParser(
        description="GPipe pipeline parallel training, stages of different shapes"
    )
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--d", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
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

    fs.init()
    mesh = fs.Mesh(pp=dist.get_world_size())
    n = mesh.size
    pipe = fs.shard_map(pipeline, mesh=mesh, in_specs=(None, "m b", "m b"), out_specs="")

    # Each rank builds only its own stage.
    params = fs.PerRank.build(mesh, "pp", [functools.partial(init_stage, args, s, n) for s in range(n)])
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.microbatches, args.microbatch_size)
    tokens = torch.randint(0, args.vocab, shape, generator=gen)
    targets = torch.randint(0, args.vocab, shape, generator=gen)  # one batch, fitted
    opt = fs.optim.sgd(args.lr)
    opt_state = opt.init(params)

    # Single-process reference: every stage, applied in sequence to the whole batch.
    ref = [init_stage(args, s, n) for s in range(n)]
    ref_leaves = [t.requires_grad_() for p in ref for t in torch.utils._pytree.tree_leaves(p)]
    ref_opt = torch.optim.SGD(ref_leaves, lr=args.lr)

    loss_and_grads = fs.value_and_grad(pipe)
    if args.compile:
        loss_and_grads = fs.compile(loss_and_grads, backend=args.compile)  # traced on the first call
    counting = args.compile in (None, "inductor")  # fs.count_collectives counts inductor's graphs only
    for i in range(args.steps):
        with fs.count_collectives() if counting else contextlib.nullcontext() as counts:
            loss, grads = loss_and_grads(params, tokens, targets)
        params, opt_state = opt.update(params, grads, opt_state)  # PerRank in, PerRank out
        ref_opt.zero_grad()
        ref_loss = reference_loss(ref, tokens, targets)
        ref_loss.backward()
        ref_opt.step()
        check(f"loss at step {i}", loss, ref_loss.detach())
        if dist.get_rank() == 0:
            print(f"step {i}: loss {loss.item():.4f}" + (f"  collectives {counts}" if counting else ""))
    s = params.index  # this rank's stage: compared with the reference's stage s, nothing gathered
    mine = torch.utils._pytree.tree_leaves(params.tree)
    want = torch.utils._pytree.tree_leaves(ref[s])
    if len(mine) != len(want):
        sys.exit(f"rank {dist.get_rank()}: stage {s} has {len(mine)} parameters, the reference {len(want)}")
    for k, (a, b) in enumerate(zip(mine, want)):
        check(f"stage {s} parameter {k} after {args.steps} steps", a, b.detach())

    if dist.get_rank() == 0:
        widths = [hidden_width(args, s) for s in range(n)]
        print(
            f"pipeline: OK (pp={n}, {args.layers_per_stage} layers per stage, hidden widths {widths}, "
            f"{args.microbatches} microbatches) losses and every stage's parameters match the "
            f"single-process reference"
        )


if __name__ == "__main__":
    main()
