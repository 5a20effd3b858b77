"""Mixture of experts with expert parallelism: top-1 routing, fixed capacity, all_to_all.

The experts are split over the "ep" axis ("(ep e) d h"), and so are the tokens
("(ep t) d"); the router is replicated. Each rank routes its own tokens to their
top-1 expert and packs them into a fixed-size buffer per expert (``capacity`` slots
per expert per rank; a token past its expert's capacity is dropped and outputs zero,
as in GShard/Switch). Because every buffer has the same shape, one all_to_all sends
each expert its buffers from every rank, each rank runs its own experts, and a
second all_to_all brings the results home, where they are scaled by the gate.
The router's gradient is all-reduced over ep (the implicit ``pvary``) and the
gradient of an all_to_all is the all_to_all back (only the second one needs it
here: the dispatch of the tokens x, which need no gradient, has nothing to send).

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/moe.py
    torchrun --nproc-per-node 4 examples/moe.py
    python -m fshard.run -n 4 examples/moe.py --compile   # loss and gradients compiled (inductor)

The script trains a few steps with SGD and checks the outputs, the losses, the
gradients and the final parameters against a token-by-token loop in plain
single-process torch, and exits non-zero if they disagree.
"""

import argparse
import contextlib
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fshard as fs


def check(name, got, want, tol=1e-4):
    """Exit non-zero, naming ``name``, if ``got`` is not close to the reference ``want``."""
    if not torch.allclose(got, want, rtol=tol, atol=tol):
        err = (got - want).abs().max().item()
        sys.exit(
            f"rank {dist.get_rank()}: {name} disagrees with the single-process reference "
            f"(max abs error {err:.3g})"
        )


def moe_layer(p, x, capacity):
    """Per shard: x (t, d) are my tokens, p["w1"] (e, d, h) and p["w2"] (e, h, d) my experts.

    Returns the outputs for my tokens and the fraction of them that was dropped.
    """
    probs = torch.softmax(x @ p["router"], dim=-1)  # (t, experts): the router is replicated
    gate, expert = probs.max(dim=-1)  # top-1
    onehot = F.one_hot(expert, probs.shape[-1]).to(x.dtype)  # (t, experts)
    pos = (onehot.cumsum(0) * onehot).sum(-1).long() - 1  # each token's place in its expert's queue
    kept = (pos < capacity).to(x.dtype)  # tokens past capacity are dropped
    slot = F.one_hot(pos.clamp(max=capacity - 1), capacity) * kept[:, None]  # (t, capacity)
    dispatch = onehot[:, :, None] * slot[:, None, :]  # (t, experts, capacity): 1 where token t goes
    buffers = torch.einsum("tec,td->ecd", dispatch, x)  # (experts, capacity, d)
    buffers = fs.all_to_all(buffers, "ep", split_dim=0, concat_dim=1)  # (my experts, ep * capacity, d)
    out = torch.einsum("ech,ehd->ecd", F.gelu(torch.einsum("ecd,edh->ech", buffers, p["w1"])), p["w2"])
    out = fs.all_to_all(out, "ep", split_dim=1, concat_dim=0)  # (experts, capacity, d): my tokens' results
    return torch.einsum("tec,ecd->td", dispatch * gate[:, None, None], out), 1 - kept.mean()


def reference_moe(p, x, groups, capacity):
    """Plain torch, token by token: capacity counts per expert within each of ``groups`` token groups."""
    probs = torch.softmax(x @ p["router"], dim=-1)
    gate, expert = probs.max(dim=-1)
    rows = []
    for group in torch.arange(len(x)).chunk(groups):
        used = [0] * probs.shape[-1]
        for t in group.tolist():
            e = expert[t].item()
            used[e] += 1
            ffn = F.gelu(x[t] @ p["w1"][e]) @ p["w2"][e]
            rows.append(gate[t] * ffn if used[e] <= capacity else torch.zeros_like(x[t]))
    return torch.stack(rows)


def main():
    parser = argparse.ArgumentParser(description="expert parallel mixture of experts")
    parser.add_argument("--tokens", type=int, default=32, help="global tokens (divisible by the world size)")
    parser.add_argument("--d", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--capacity", type=int, default=2, help="slots per expert per rank")
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
    mesh = fs.Mesh(ep=dist.get_world_size())
    specs = {"router": "d e", "w1": "(ep e) d h", "w2": "(ep e) h d"}

    @fs.shard_map(mesh=mesh, in_specs=(specs, "(ep t) d", "(ep t) d"), out_specs=("", ("(ep t) d", "")))
    def loss_fn(p, x, target):  # runs on local blocks
        y, dropped = moe_layer(p, x, args.capacity)
        return fs.pmean((y - target).square().mean(), "ep"), (y.detach(), fs.pmean(dropped, "ep"))

    gen = torch.Generator().manual_seed(args.seed)
    d, h, e = args.d, args.hidden, args.experts_per_rank * mesh.size
    global_params = {
        "router": torch.randn(d, e, generator=gen),
        "w1": torch.randn(e, d, h, generator=gen) / d**0.5,
        "w2": torch.randn(e, h, d, generator=gen) / h**0.5,
    }
    params = {k: fs.shard(v, mesh, specs[k]) for k, v in global_params.items()}
    x, target = torch.randn(args.tokens, d, generator=gen), torch.randn(args.tokens, d, generator=gen)
    opt = fs.optim.sgd(args.lr)
    opt_state = opt.init(params)

    # Single-process reference: the token-by-token loop on the global tensors.
    ref = {k: v.clone().requires_grad_() for k, v in global_params.items()}
    loss_and_grads = fs.value_and_grad(loss_fn, has_aux=True)
    if args.compile:
        loss_and_grads = fs.compile(loss_and_grads, backend=args.compile)  # traced on the first call
    counting = args.compile in (None, "inductor")  # fs.count_collectives counts inductor's graphs only
    for i in range(args.steps):
        with fs.count_collectives() if counting else contextlib.nullcontext() as counts:
            (loss, (y, dropped)), grads = loss_and_grads(params, x, target)
        ref_y = reference_moe(ref, x, mesh.size, args.capacity)
        ref_loss = (ref_y - target).square().mean()
        ref_grads = torch.autograd.grad(ref_loss, list(ref.values()))
        check(f"outputs at step {i}", y.full(), ref_y.detach())
        check(f"loss at step {i}", loss, ref_loss.detach())
        for (k, g), ref_g in zip(grads.items(), ref_grads):
            check(f"dloss/d{k} at step {i}", g.full(), ref_g)  # Sharded like the parameter
        params, opt_state = opt.update(params, grads, opt_state)
        with torch.no_grad():
            for v, g in zip(ref.values(), ref_grads):
                v -= args.lr * g
        if dist.get_rank() == 0:
            seen = f"  collectives {counts}" if counting else ""
            print(f"step {i}: loss {loss.item():.4f}  dropped {dropped.item():.0%} of tokens{seen}")
    for k in params:
        check(f"{k} after {args.steps} steps", params[k].full(), ref[k].detach())

    if dist.get_rank() == 0:
        print(
            f"moe: OK (ep={mesh.size}, {e} experts, capacity {args.capacity}) outputs, gradients and "
            f"parameters match the single-process reference"
        )


if __name__ == "__main__":
    main()
