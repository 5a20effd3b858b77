"""A tensor parallel transformer block: attention heads and MLP split over "tp".

Pre-LayerNorm block, causal self-attention then a GELU MLP, both with residuals.
The q, k and v projections are split by columns ("d (tp hd)"), which hands each tp
rank whole heads (hd = heads * head_dim, and heads is divisible by tp); each rank
runs attention for its own heads, and the output projection, split by rows
("(tp hd) d"), gives a partial sum that one psum completes. The MLP is the Megatron
pair of ``tensor_parallel_mlp.py``. So a block costs two all-reduces forward and two
backward (the implicit ``pvary`` of each LayerNorm output where it meets the split
weights); LayerNorm parameters and the residual stream stay replicated.

The block is written once, as plain torch, with the sum over ranks passed in: the
sharded run uses ``fs.psum`` on local blocks, the single-process reference runs the
same function on the global tensors with no sum at all.

Run from the repository root (with fshard installed: ``pip install -e .``)::

    python -m fshard.run -n 4 examples/tensor_parallel_block.py
    torchrun --nproc-per-node 4 examples/tensor_parallel_block.py
    python -m fshard.run -n 4 examples/tensor_parallel_block.py --compile   # the block compiled (inductor)

The script checks the output and the gradients of every parameter and of x against
the single-process reference, and exits non-zero if they disagree.
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


PARAM_SPECS = {
    "ln1_g": "d",
    "ln1_b": "d",
    "wq": "d (tp hd)",
    "wk": "d (tp hd)",
    "wv": "d (tp hd)",
    "wo": "(tp hd) d",
    "ln2_g": "d",
    "ln2_b": "d",
    "w1": "d (tp f)",
    "b1": "(tp f)",
    "w2": "(tp f) d",
    "b2": "d",
}


def block(p, x, head_dim, reduce):
    """Transformer block on x (b, s, d) with the heads in p's q/k/v columns; reduce() sums over ranks."""
    b, s, d = x.shape

    def heads(t):  # (b, s, heads * head_dim) -> (b, heads, s, head_dim)
        return t.view(b, s, -1, head_dim).transpose(1, 2)

    h = F.layer_norm(x, (d,), p["ln1_g"], p["ln1_b"])
    a = F.scaled_dot_product_attention(
        heads(h @ p["wq"]), heads(h @ p["wk"]), heads(h @ p["wv"]), is_causal=True
    )
    x = x + reduce(a.transpose(1, 2).reshape(b, s, -1) @ p["wo"])
    h = F.layer_norm(x, (d,), p["ln2_g"], p["ln2_b"])
    return x + reduce(F.gelu(h @ p["w1"] + p["b1"]) @ p["w2"]) + p["b2"]


def main():
    parser = argparse.ArgumentParser(description="tensor parallel transformer block")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--d", type=int, default=16)
    parser.add_argument("--heads", type=int, default=4, help="divisible by the world size")
    parser.add_argument("--head-dim", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=32, help="divisible by the world size")
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
    mesh = fs.Mesh(tp=dist.get_world_size())
    tp_block = fs.shard_map(
        lambda p, x: block(p, x, args.head_dim, lambda t: fs.psum(t, "tp")),
        mesh=mesh,
        in_specs=(PARAM_SPECS, "b s d"),
        out_specs="b s d",
    )
    if args.compile:  # traced on the first call, again for the call without gradients
        tp_block = fs.compile(tp_block, backend=args.compile)
    counting = args.compile in (None, "inductor")  # fs.count_collectives counts inductor's graphs only

    gen = torch.Generator().manual_seed(args.seed)
    sizes = {"d": args.d, "hd": args.heads * args.head_dim, "f": args.ffn}
    global_params = {}
    for k, spec in PARAM_SPECS.items():  # a spec names each dim, so it also gives the global shape
        shape = [sizes[dim.names[-1]] for dim in fs.parse_spec(spec).dims]
        global_params[k] = torch.randn(shape, generator=gen) / shape[0] ** 0.5
    x = torch.randn(args.batch, args.seq, args.d, generator=gen)
    ct = torch.randn(args.batch, args.seq, args.d, generator=gen)  # a fixed cotangent for the loss
    params = {k: fs.shard(v, mesh, PARAM_SPECS[k]) for k, v in global_params.items()}

    def loss_fn(p, x):
        return (tp_block(p, x) * ct).sum()

    with fs.count_collectives() if counting else contextlib.nullcontext() as counts:
        loss, (grads, gx) = fs.value_and_grad(loss_fn, argnums=(0, 1))(params, x)
    y = tp_block(params, x)

    # Single-process reference: the same block on the global tensors, nothing to sum.
    ref = {k: v.clone().requires_grad_() for k, v in global_params.items()}
    xr = x.clone().requires_grad_()
    ref_y = block(ref, xr, args.head_dim, reduce=lambda t: t)
    (ref_y * ct).sum().backward()

    check("y", y, ref_y.detach())
    check("loss", loss, (ref_y * ct).sum().detach())
    check("dloss/dx", gx, xr.grad)
    for k in params:
        check(f"dloss/d{k}", grads[k].full(), ref[k].grad)

    if dist.get_rank() == 0:
        if counting:
            print(f"forward and backward: {counts}")
        print(
            f"tensor_parallel_block: OK (tp={mesh.size}, {args.heads} heads) output and gradients "
            f"match the single-process reference"
        )


if __name__ == "__main__":
    main()
