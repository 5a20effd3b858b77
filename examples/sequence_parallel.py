"""Sequence parallel causal self-attention with all_to_all (DeepSpeed-Ulysses style).

Activations are split along the sequence over the "sp" axis ("b (sp s) d"), so
everything position-wise (projections, MLPs, norms) runs locally. Attention needs
the whole sequence, so around it two all_to_alls swap which dim is split:

    q, k, v  (b, s/sp, H, dh) --all_to_all--> (b, s, H/sp, dh)   whole sequence, my heads
    output   (b, s, H/sp, dh) --all_to_all--> (b, s/sp, H, dh)   back to my positions

q, k and v travel in one all_to_all. The projection weights are replicated; each
one's gradient is all-reduced once over sp (the implicit ``pvary`` where it meets
sp-split data), and the gradient of an all_to_all is the all_to_all back.

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/sequence_parallel.py
    torchrun --nproc-per-node 4 examples/sequence_parallel.py
    python -m fshard.run -n 4 examples/sequence_parallel.py --compile   # attention compiled (inductor)

The script checks the output and the gradients of x and of every weight against plain
single-process attention on the global tensors, and exits non-zero if they disagree.
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


def ulysses_attention(p, x, heads):
    """Per shard: x is (b, s / sp, d), my slice of the sequence; returns the same slice of the output."""
    b, s_local, _ = x.shape
    qkv = torch.stack([x @ p["wq"], x @ p["wk"], x @ p["wv"]]).view(3, b, s_local, heads, -1)
    qkv = fs.all_to_all(qkv, "sp", split_dim=3, concat_dim=2)  # (3, b, s, heads / sp, dh)
    q, k, v = qkv.transpose(2, 3)  # each (b, heads / sp, s, dh)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)  # (b, s, heads / sp, dh)
    a = fs.all_to_all(a, "sp", split_dim=1, concat_dim=2)  # (b, s / sp, heads, dh)
    return a.reshape(b, s_local, -1) @ p["wo"]


def reference_attention(p, x, heads):
    """Plain single-process causal multi-head attention on the global x (b, s, d)."""
    b, s, _ = x.shape
    q, k, v = ((x @ p[w]).view(b, s, heads, -1).transpose(1, 2) for w in ("wq", "wk", "wv"))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return a.transpose(1, 2).reshape(b, s, -1) @ p["wo"]


def main():
    parser = argparse.ArgumentParser(description="sequence parallel (Ulysses) attention")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16, help="divisible by the world size")
    parser.add_argument("--d", type=int, default=16)
    parser.add_argument("--heads", type=int, default=4, help="divisible by the world size")
    parser.add_argument("--head-dim", type=int, default=4)
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
    mesh = fs.Mesh(sp=dist.get_world_size())
    attention = fs.shard_map(
        lambda p, x: ulysses_attention(p, x, args.heads),
        mesh=mesh,
        in_specs=("...", "b (sp s) d"),
        out_specs="b (sp s) d",
    )

    gen = torch.Generator().manual_seed(args.seed)
    d, hd = args.d, args.heads * args.head_dim
    params = {
        "wq": torch.randn(d, hd, generator=gen) / d**0.5,
        "wk": torch.randn(d, hd, generator=gen) / d**0.5,
        "wv": torch.randn(d, hd, generator=gen) / d**0.5,
        "wo": torch.randn(hd, d, generator=gen) / hd**0.5,
    }
    x = torch.randn(args.batch, args.seq, d, generator=gen)
    ct = torch.randn(args.batch, args.seq, d, generator=gen)  # a fixed cotangent for the loss
    xs, cts = fs.shard(x, mesh, "b (sp s) d"), fs.shard(ct, mesh, "b (sp s) d")

    # The loss stays sequence-split: each rank dots its positions, one psum adds them up.
    dot = fs.shard_map(
        lambda y, c: fs.psum((y * c).sum(), "sp"),
        mesh=mesh,
        in_specs=("b (sp s) d", "b (sp s) d"),
        out_specs="",
    )

    if args.compile:  # traced on the first call, again for the call that needs gradients
        attention = fs.compile(attention, backend=args.compile)
    counting = args.compile in (None, "inductor")  # fs.count_collectives counts inductor's graphs only
    count = fs.count_collectives if counting else contextlib.nullcontext

    def loss_fn(p, x):
        return dot(attention(p, x), cts)

    with count() as fwd:
        y = attention(params, xs)
    with count() as both:
        loss, (grads, gx) = fs.value_and_grad(loss_fn, argnums=(0, 1))(params, xs)

    # Single-process reference on the global tensors.
    ref = {k: v.clone().requires_grad_() for k, v in params.items()}
    xr = x.clone().requires_grad_()
    ref_y = reference_attention(ref, xr, args.heads)
    (ref_y * ct).sum().backward()

    check("y", y.full(), ref_y.detach())
    check("loss", loss, (ref_y * ct).sum().detach())
    check("dloss/dx", gx.full(), xr.grad)
    for k in params:
        check(f"dloss/d{k}", grads[k], ref[k].grad)  # replicated weights: plain, whole gradients

    if dist.get_rank() == 0:
        if counting:
            print(f"forward:                     {fwd}")
            print(f"loss, forward and backward:  {both}")
        print(
            f"sequence_parallel: OK (sp={mesh.size}, seq {args.seq}) output and gradients "
            f"match the single-process reference"
        )


if __name__ == "__main__":
    main()
