"""The GPT benchmarks: the demo's decoder (``fshard_demo.model``), one tensor per parameter, as users write it.

Four layouts (``gpt_dp``, ``gpt_fsdp``, ``gpt_dp_tp``, ``gpt_fsdp_tp``) at two sizes (the demo's default
``Config()`` and one about 10x larger in parameters). One step = zero the gradients, forward, backward and
the gradient collectives (no optimizer step when timing; Adam for the memory table), on the global batch
of token sequences, split over the mesh axis ``dp``; ``tp`` (2 when the world size allows it) splits the
attention heads and the MLP hidden units (Megatron).

Contenders here (the torch side; the fshard ones are in ``fshard_contenders.py``):

* ``handwritten`` -- the floor: a functional forward over plain tensors (the demo's math, written with
  torch.distributed only). dp: the gradients are views of one flat buffer, one ``all_reduce`` of it after
  backward. fsdp: one flat parameter shard, one ``all_gather`` before forward, one ``reduce_scatter`` of
  the flat gradients after backward. tp: Megatron's f/g autograd functions (one all_reduce of the
  activations in forward and one of their gradient in backward per attention and per MLP block).
* ``ddp`` -- ``DistributedDataParallel`` over an ``nn.Module`` GPT (``GPT`` below) with default settings.
* ``fsdp2`` -- ``fully_shard`` per block, then the root (as torchtitan does).
* ``fsdp2_whole`` -- ``fully_shard`` on the root only: one group, every parameter gathered once and
  kept through the backward (the root's default ``reshard_after_forward``).
* ``dtensor_tp_ddp`` -- ``parallelize_module`` with ``ColwiseParallel`` on q/k/v/w1 and ``RowwiseParallel``
  on wo/w2 over the ``tp`` dim of a 2-D ``DeviceMesh``, then DDP over its ``dp`` dim (torch's TP + DDP
  recipe: ``_pre_dp_module_transform``).
* ``fsdp2_tp`` -- the same TP plan, then ``fully_shard`` per block and the root over the ``dp`` dim.

The ``nn.Module`` stores the projections as ``nn.Linear`` weights, i.e. ``(out, in)``: the transpose of the
demo's ``(in, out)`` matrices (``x @ w`` there is ``F.linear(x, w.T)`` here); every other parameter has the
demo's shape. Gradients are compared in the demo's layout.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

try:
    from fshard_demo.model import Config, param_specs
except ImportError:  # a source checkout without the demo installed: it lives in examples/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from fshard_demo.model import Config, param_specs

from .common import SEED, CopyToTP, Ctx, Prepared, ReduceFromTP, full

LAYOUTS = ("dp", "fsdp", "dp_tp", "fsdp_tp")

MODELS: dict[str, Config] = {
    "demo": Config(),  # the demo's default: d=128, 4 heads, 2 layers, d_mlp=512 (0.40M parameters)
    "10x": Config(d_model=256, n_heads=8, n_layers=5, d_mlp=1024),  # 3.95M parameters
    "tiny": Config(d_model=32, n_heads=4, n_layers=1, d_mlp=64),  # smoke runs only
}

# demo-layout dim that tp splits, per block matrix (columns of q/k/v/w1, rows of wo/w2)
_TP_DIM = {"wq": 1, "wk": 1, "wv": 1, "w1": 1, "wo": 0, "w2": 0}
_BLOCK_KEYS = ("ln1_w", "ln1_b", "wq", "wk", "wv", "wo", "ln2_w", "ln2_b", "w1", "w2")
_TOP_KEYS = ("wte", "wpe", "lnf_w", "lnf_b", "w_out")


def layout_of(bench: str) -> str:
    return bench.removeprefix("gpt_")


def cfg_of(params: dict) -> Config:
    return MODELS[params["model"]]


def mesh_shape(layout: str, world: int) -> tuple[int, int]:
    """(dp, tp): tp is 2 for the *_tp layouts (so world 2 is pure TP, world 4 is 2 x 2), else 1."""
    tp = 2 if layout.endswith("_tp") and world % 2 == 0 else 1
    return world // tp, tp


def names(cfg: Config) -> list[str]:
    """Every parameter's name, demo layout: ``wte``, ``wpe``, ``blocks.<i>.<key>``, ``lnf_w``, ..."""
    out = ["wte", "wpe"]
    for i in range(cfg.n_layers):
        out += [f"blocks.{i}.{k}" for k in _BLOCK_KEYS]
    return out + ["lnf_w", "lnf_b", "w_out"]


def tp_dim(name: str) -> int:
    """The demo-layout dim of ``name`` that tp splits, or -1."""
    return _TP_DIM.get(name.rsplit(".", 1)[-1], -1)


# ----------------------------------------------------------------------------------------------------------
# Weights, data, the functional model (demo layout)
# ----------------------------------------------------------------------------------------------------------


def make_weights(cfg: Config, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Full initial parameters, demo layout and init (N(0, 0.02), GPT-2's scaled residual projections);
    layer-norm weights and biases get some noise so that their gradients are not special."""
    g = torch.Generator().manual_seed(seed + cfg.n_params)
    d, f, v = cfg.d_model, cfg.d_mlp, cfg.vocab
    shapes = {"wte": (v, d), "wpe": (cfg.seq_len, d), "lnf_w": (d,), "lnf_b": (d,), "w_out": (d, v)}
    block = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, f), "w2": (f, d)}
    block.update({k: (d,) for k in ("ln1_w", "ln1_b", "ln2_w", "ln2_b")})
    proj_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    out = {}
    for n in names(cfg):
        key = n.rsplit(".", 1)[-1]
        shape = shapes[key] if key in shapes else block[key]
        if key.endswith("_w"):
            out[n] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif key.endswith("_b"):
            out[n] = 0.1 * torch.randn(shape, generator=g)
        else:
            out[n] = torch.randn(shape, generator=g) * (proj_std if key in ("wo", "w2") else 0.02)
    return out


def make_tokens(cfg: Config, batch: int, seed: int = SEED) -> dict[str, torch.Tensor]:
    """A global batch of token sequences ``(batch, seq_len)`` over the task's 12 tokens."""
    g = torch.Generator().manual_seed(seed + 31 * batch + cfg.n_params)
    return {"tokens": torch.randint(0, 12, (batch, cfg.seq_len), generator=g)}


def to_tree(flat: dict[str, Any], cfg: Config) -> dict:
    """Flat names -> the demo's parameter pytree (``{"wte", ..., "blocks": [{...}, ...]}``)."""
    tree = {k: flat[k] for k in _TOP_KEYS}
    tree["blocks"] = [{k: flat[f"blocks.{i}.{k}"] for k in _BLOCK_KEYS} for i in range(cfg.n_layers)]
    return tree


def from_tree(tree: dict, cfg: Config) -> dict[str, Any]:
    flat = {k: tree[k] for k in _TOP_KEYS}
    for i, blk in enumerate(tree["blocks"]):
        flat.update({f"blocks.{i}.{k}": blk[k] for k in _BLOCK_KEYS})
    return {n: flat[n] for n in names(cfg)}


def forward(p: dict, tokens: torch.Tensor, cfg: Config, tp_group=None) -> torch.Tensor:
    """The demo's ``forward`` in plain torch over the demo's pytree (this rank's tp blocks when
    ``tp_group`` is given: Megatron f before q/k/v and w1, g after wo and w2)."""
    b, s = tokens.shape
    x = p["wte"][tokens] + p["wpe"][:s]
    d = cfg.d_model
    hd = d // cfg.n_heads
    for blk in p["blocks"]:
        h = F.layer_norm(x, (d,), blk["ln1_w"], blk["ln1_b"])
        if tp_group is not None:
            h = CopyToTP.apply(h, tp_group)
        q, k, v = ((h @ blk[w]).view(b, s, -1, hd).transpose(1, 2) for w in ("wq", "wk", "wv"))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(b, s, -1) @ blk["wo"]
        if tp_group is not None:
            a = ReduceFromTP.apply(a, tp_group)
        x = x + a
        h = F.layer_norm(x, (d,), blk["ln2_w"], blk["ln2_b"])
        if tp_group is not None:
            h = CopyToTP.apply(h, tp_group)
        m = F.gelu(h @ blk["w1"]) @ blk["w2"]
        if tp_group is not None:
            m = ReduceFromTP.apply(m, tp_group)
        x = x + m
    x = F.layer_norm(x, (d,), p["lnf_w"], p["lnf_b"])
    return x @ p["w_out"]


def answer_loss(logits: torch.Tensor, tokens: torch.Tensor, cfg: Config) -> torch.Tensor:
    """The demo's loss on this rank's rows: mean cross-entropy on the answer tokens."""
    n_ans = cfg.digits + 1
    return F.cross_entropy(logits[:, -n_ans:].reshape(-1, cfg.vocab), tokens[:, -n_ans:].reshape(-1))


def loss_fn(p: dict, tokens: torch.Tensor, cfg: Config, tp_group=None) -> torch.Tensor:
    return answer_loss(forward(p, tokens[:, :-1], cfg, tp_group), tokens, cfg)


def reference_values(weights: dict[str, torch.Tensor], data: dict, cfg: Config) -> dict[str, torch.Tensor]:
    """Loss and every gradient of one process on the whole global batch (plain torch, no fshard)."""
    leaves = {n: w.clone().requires_grad_(True) for n, w in weights.items()}
    loss = loss_fn(to_tree(leaves, cfg), data["tokens"], cfg)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    out = {"loss": loss.detach()}
    out.update({f"grad/{n}": g for n, g in zip(leaves, grads)})
    return out


# ----------------------------------------------------------------------------------------------------------
# The nn.Module (DDP, FSDP2, DTensor TP)
# ----------------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        d, f = cfg.d_model, cfg.d_mlp
        self.d, self.hd = d, d // cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.w1 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln1(x)
        # -1 heads: this rank's heads after ColwiseParallel (local outputs), all of them otherwise
        q, k, v = (w(h).view(b, s, -1, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.w2(F.gelu(self.w1(self.ln2(x))))


class GPT(nn.Module):
    """The demo's GPT as an ``nn.Module``: same parameters (Linear weights transposed), same forward."""

    def __init__(self, cfg: Config):
        super().__init__()
        d = cfg.d_model
        self.wte = nn.Embedding(cfg.vocab, d)
        self.wpe = nn.Parameter(torch.zeros(cfg.seq_len, d))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.lnf = nn.LayerNorm(d)
        self.w_out = nn.Linear(d, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.wte(tokens) + self.wpe[:s]
        for blk in self.blocks:
            x = blk(x)
        return self.w_out(self.lnf(x))


_LN = {"ln1_w": "ln1.weight", "ln1_b": "ln1.bias", "ln2_w": "ln2.weight", "ln2_b": "ln2.bias"}


def module_name(name: str) -> tuple[str, bool]:
    """Demo name -> (``GPT`` parameter name, stored transposed?)."""
    top = {"wte": "wte.weight", "wpe": "wpe", "lnf_w": "lnf.weight", "lnf_b": "lnf.bias"}
    if name in top:
        return top[name], False
    if name == "w_out":
        return "w_out.weight", True
    prefix, key = name.rsplit(".", 1)
    if key in _LN:
        return f"{prefix}.{_LN[key]}", False
    return f"{prefix}.{key}.weight", True


def make_module(cfg: Config, weights: dict[str, torch.Tensor]) -> GPT:
    m = GPT(cfg)
    params = dict(m.named_parameters())
    with torch.no_grad():
        for n, w in weights.items():
            mn, t = module_name(n)
            params[mn].copy_(w.T if t else w)
    return m


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel, RowwiseParallel
    return {"wq": col(), "wk": col(), "wv": col(), "wo": row(), "w1": col(), "w2": row()}


# ----------------------------------------------------------------------------------------------------------
# Meshes and small helpers
# ----------------------------------------------------------------------------------------------------------

_DEVICE_MESHES: dict = {}


def device_mesh(dp: int, tp: int):
    """The 2-D ``DeviceMesh("cpu", (dp, tp), ("dp", "tp"))``, built once per process (collective: every
    rank builds the contenders in the same order)."""
    dm = _DEVICE_MESHES.get((dp, tp))
    if dm is None:
        from torch.distributed.device_mesh import init_device_mesh

        dm = _DEVICE_MESHES[(dp, tp)] = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    return dm


class Setup:
    """What every GPT contender starts from: config, layout, 2-D mesh, groups and this rank's rows."""

    def __init__(self, ctx: Ctx):
        self.cfg = cfg_of(ctx.params)
        self.layout = layout_of(ctx.bench)
        self.dp, self.tp = mesh_shape(self.layout, ctx.world)
        self.dm = device_mesh(self.dp, self.tp)
        self.dp_group, self.tp_group = self.dm.get_group("dp"), self.dm.get_group("tp")
        self.dp_rank, self.tp_rank = self.dm.get_local_rank("dp"), self.dm.get_local_rank("tp")
        self.fsdp = self.layout.startswith("fsdp")
        self.tokens = ctx.data["tokens"]
        self.local_tokens = self.tokens.tensor_split(self.dp)[self.dp_rank].contiguous()


def gather_group(t: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Concatenate ``t`` over ``group`` along ``dim`` (not for timed code)."""
    t = t.detach().contiguous()
    if size == 1:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=dim)


def _tp_block(w: torch.Tensor, name: str, su: Setup) -> torch.Tensor:
    dim = tp_dim(name)
    return w if dim < 0 or su.tp == 1 else w.tensor_split(su.tp, dim=dim)[su.tp_rank]


def _tp_full(g: torch.Tensor, name: str, su: Setup) -> torch.Tensor:
    dim = tp_dim(name)
    return g.detach().clone() if dim < 0 else gather_group(g, dim, su.tp_group, su.tp)


def _loss_value(ctx: Ctx, loss: torch.Tensor) -> torch.Tensor:
    # a rank's loss is the mean over its dp rows (the same on every tp rank): the global mean is the
    # mean over all ranks
    return ctx.mean_over_ranks(loss.detach())


def _module_values(ctx: Ctx, cfg: Config, model: nn.Module, local_full=None):
    """``values`` for an nn.Module contender: gradients as full tensors in the demo's layout."""
    params = dict(model.named_parameters())

    def values(loss):
        out = {"loss": _loss_value(ctx, loss)}
        for n in names(cfg):
            mn, t = module_name(n)
            g = params[mn].grad
            g = local_full(n, g) if local_full is not None else full(g)
            out[f"grad/{n}"] = g.T if t else g
        return out

    return values


def _module_step(model: nn.Module, params: list, tokens: torch.Tensor, cfg: Config, opt):
    inputs = tokens[:, :-1].contiguous()

    def step():
        for p in params:
            p.grad = None
        loss = answer_loss(model(inputs), tokens, cfg)
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    return step


# ----------------------------------------------------------------------------------------------------------
# Contenders (torch side)
# ----------------------------------------------------------------------------------------------------------


def _flat_leaves(flat, grad_flat, sizes, shapes) -> list[torch.Tensor]:
    """Views of ``flat`` as leaf tensors whose ``.grad`` are the matching views of ``grad_flat``."""
    total = sum(sizes)
    leaves = [v.view(s).requires_grad_(True) for v, s in zip(flat[:total].split(sizes), shapes)]
    for leaf, g in zip(leaves, grad_flat[:total].split(sizes)):
        leaf.grad = g.view(leaf.shape)
    return leaves


def handwritten(ctx: Ctx) -> Prepared:
    """The floor, torch.distributed only: the functional forward on plain tensors; dp: one flat
    all_reduce of the gradients; fsdp: one flat all_gather + one reduce_scatter; tp: Megatron f/g."""
    from .contenders import _all_gather_flat, _reduce_scatter_flat

    su = Setup(ctx)
    cfg, dp = su.cfg, su.dp
    order = names(cfg)
    local = {n: _tp_block(ctx.weights[n], n, su).contiguous() for n in order}
    shapes = [local[n].shape for n in order]
    sizes = [local[n].numel() for n in order]
    total = sum(sizes)
    tp_group = su.tp_group if su.tp > 1 else None
    tokens = su.local_tokens
    dp_group = su.dp_group

    if not su.fsdp:
        leaves = [local[n].clone().requires_grad_(True) for n in order]
        flat = torch.zeros(total)
        for leaf, g in zip(leaves, flat.split(sizes)):
            leaf.grad = g.view(leaf.shape)  # backward accumulates into the flat buffer
        tree = to_tree(dict(zip(order, leaves)), cfg)
        opt = ctx.make_optimizer(leaves)

        def step():
            flat.zero_()
            loss = loss_fn(tree, tokens, cfg, tp_group)
            loss.backward()
            if dp > 1:
                dist.all_reduce(flat, group=dp_group)
                flat.div_(dp)
            if opt is not None:
                opt.step()
            return loss

        def grads():
            return {n: leaf.grad for n, leaf in zip(order, leaves)}

        def state():
            return ctx.memory_state(leaves, opt)

    else:
        per_rank = -(-total // dp)
        padded = per_rank * dp
        flat_init = torch.zeros(padded)
        torch.cat([local[n].reshape(-1) for n in order], out=flat_init[:total])
        shard = torch.nn.Parameter(flat_init[su.dp_rank * per_rank : (su.dp_rank + 1) * per_rank].clone())
        del flat_init
        opt = ctx.make_optimizer([shard])
        avg = dist.ReduceOp.AVG

        def step():
            shard.grad = None
            if dp > 1:
                full_flat = torch.empty(padded)
                _all_gather_flat(full_flat, shard.detach(), group=dp_group)
            else:
                full_flat = shard.detach()
            gflat = torch.zeros(padded)
            leaves = _flat_leaves(full_flat, gflat, sizes, shapes)
            loss = loss_fn(to_tree(dict(zip(order, leaves)), cfg), tokens, cfg, tp_group)
            loss.backward()
            loss = loss.detach()
            del leaves, full_flat  # free the gathered parameters before communicating
            if dp > 1:
                gshard = torch.empty(per_rank)
                _reduce_scatter_flat(gshard, gflat, op=avg, group=dp_group)
            else:
                gshard = gflat
            del gflat
            shard.grad = gshard
            if opt is not None:
                opt.step()
            return loss

        def grads():
            g = gather_group(shard.grad, 0, dp_group, dp)[:total]
            return {n: v.view(s) for n, v, s in zip(order, g.split(sizes), shapes)}

        def state():
            return ctx.memory_state([shard], opt)

    def values(loss):
        out = {"loss": _loss_value(ctx, loss)}
        out.update({f"grad/{n}": _tp_full(g, n, su) for n, g in grads().items()})
        return out

    return Prepared(step, values, state)


def _compiled(model: nn.Module, backend: str | None) -> nn.Module:
    """``torch.compile(model, backend=backend)`` (the step's ``loss.backward()`` stays outside the
    compiled forward), or ``model`` when ``backend`` is None."""
    return model if backend is None else torch.compile(model, backend=backend)


def ddp(ctx: Ctx, backend: str | None = None) -> Prepared:
    """``DistributedDataParallel(GPT)`` over the dp group, default settings; with ``backend``,
    ``torch.compile(DDP(GPT))`` (Dynamo's DDP optimizer splits the graph at the bucket boundaries)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    su = Setup(ctx)
    model = make_module(su.cfg, ctx.weights)
    wrapped = _compiled(DDP(model, process_group=su.dp_group), backend)
    params = list(model.parameters())
    opt = ctx.make_optimizer(params)
    step = _module_step(wrapped, params, su.local_tokens, su.cfg, opt)
    return Prepared(step, _module_values(ctx, su.cfg, model), lambda: ctx.memory_state(params, opt))


def fsdp2(ctx: Ctx, backend: str | None = None) -> Prepared:
    """``fully_shard`` on every block, then on the root, over the dp mesh dim (torchtitan's recipe);
    with ``backend``, ``torch.compile`` of the root module."""
    from torch.distributed.fsdp import fully_shard

    su = Setup(ctx)
    model = make_module(su.cfg, ctx.weights)
    if su.tp > 1:
        raise NotImplementedError("fsdp2 is the contender of the 1-D fsdp layout")
    mesh = su.dm["dp"]
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    opt = ctx.make_optimizer(params)
    step = _module_step(_compiled(model, backend), params, su.local_tokens, su.cfg, opt)
    return Prepared(step, _module_values(ctx, su.cfg, model), lambda: ctx.memory_state(params, opt))


def fsdp2_whole(ctx: Ctx, reshard_after_forward: bool | None = None) -> Prepared:
    """``fully_shard`` on the root only (one group for all parameters) over the dp mesh dim, with
    FSDP2's default ``reshard_after_forward`` (``None``: ``False`` for a root): one all-gather of
    every parameter before the forward, kept through the backward, one reduce-scatter after it --
    the torch-native counterpart of the whole-model forms (``fshard_leaf``, ``fshard_tree``).
    ``reshard_after_forward=True`` frees the gathered parameters after the forward and gathers
    them all again when the backward starts."""
    from torch.distributed.fsdp import fully_shard

    su = Setup(ctx)
    if su.tp > 1:
        raise NotImplementedError("fsdp2_whole is a contender of the 1-D fsdp layout")
    model = make_module(su.cfg, ctx.weights)
    fully_shard(model, mesh=su.dm["dp"], reshard_after_forward=reshard_after_forward)
    params = list(model.parameters())
    opt = ctx.make_optimizer(params)
    step = _module_step(model, params, su.local_tokens, su.cfg, opt)
    return Prepared(step, _module_values(ctx, su.cfg, model), lambda: ctx.memory_state(params, opt))


def _tp_module(su: Setup, weights) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    model = make_module(su.cfg, weights)
    tp_mesh = su.dm["tp"]
    for blk in model.blocks:
        parallelize_module(blk, tp_mesh, tp_plan())
    return model


def _module_tp_dim(name: str) -> int:
    """The dim of the *module* parameter of demo ``name`` that TP splits (Linear weights are (out, in))."""
    d = tp_dim(name)
    return -1 if d < 0 else 1 - d


def dtensor_tp_ddp(ctx: Ctx, backend: str | None = None) -> Prepared:
    """``parallelize_module`` (Colwise q/k/v/w1, Rowwise wo/w2) over tp, then DDP over dp (torch's
    TP + DDP composition: ``_pre_dp_module_transform`` turns the DTensor parameters into local ones);
    with ``backend``, every block compiled after TP (torchtitan's recipe; ``torch.compile`` of the
    whole DDP module failed in its second backward in torch 2.13: "backward through the graph a
    second time")."""
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
    from torch.nn.parallel import DistributedDataParallel as DDP

    su = Setup(ctx)
    model = _tp_module(su, ctx.weights)
    if backend is not None:  # torchtitan's order: TP, then each block compiled, then data parallel
        for blk in model.blocks:
            blk.compile(backend=backend)
    _pre_dp_module_transform(model)
    wrapped = DDP(model, process_group=su.dp_group)
    params = list(model.parameters())
    opt = ctx.make_optimizer(params)
    step = _module_step(wrapped, params, su.local_tokens, su.cfg, opt)

    def local_full(n, g):
        g = full(g)
        dim = _module_tp_dim(n)
        return g.detach().clone() if dim < 0 else gather_group(g, dim, su.tp_group, su.tp)

    return Prepared(
        step, _module_values(ctx, su.cfg, model, local_full), lambda: ctx.memory_state(params, opt)
    )


def fsdp2_tp(ctx: Ctx) -> Prepared:
    """``parallelize_module`` over tp, then ``fully_shard`` per block and the root over dp (torchtitan)."""
    from torch.distributed.fsdp import fully_shard

    su = Setup(ctx)
    model = _tp_module(su, ctx.weights)
    mesh = su.dm["dp"]
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    opt = ctx.make_optimizer(params)
    step = _module_step(model, params, su.local_tokens, su.cfg, opt)
    return Prepared(step, _module_values(ctx, su.cfg, model), lambda: ctx.memory_state(params, opt))


# ----------------------------------------------------------------------------------------------------------
# Minimum communication and memory (the floor)
# ----------------------------------------------------------------------------------------------------------


def local_numels(cfg: Config, layout: str, world: int) -> dict[str, int]:
    """Elements per rank of every parameter in ``layout`` (fsdp: each split over dp)."""
    dp, tp = mesh_shape(layout, world)
    flat_specs = from_tree(param_specs(cfg, layout), cfg)
    out = {}
    for n, w in make_shapes(cfg).items():
        numel = math.prod(w)
        if "(tp" in flat_specs[n] and tp > 1:
            numel //= tp
        if "(dp" in flat_specs[n]:
            numel = -(-numel // dp)
        out[n] = numel
    return out


def make_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    d, f, v = cfg.d_model, cfg.d_mlp, cfg.vocab
    top = {"wte": (v, d), "wpe": (cfg.seq_len, d), "lnf_w": (d,), "lnf_b": (d,), "w_out": (d, v)}
    block = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, f), "w2": (f, d)}
    block.update({k: (d,) for k in ("ln1_w", "ln1_b", "ln2_w", "ln2_b")})
    return {n: top[n] if n in top else block[n.rsplit(".", 1)[-1]] for n in names(cfg)}


def min_comm(layout: str, params: dict, world: int) -> tuple[int, int]:
    """(collectives, bytes) per step of the floor: bytes counted as the harness counts them (the full
    buffer of an all_reduce, the gathered output of an all_gather, the full input of a reduce_scatter)."""
    cfg = cfg_of(params)
    dp, tp = mesh_shape(layout, world)
    # tp-local parameter elements (before any dp split)
    numel = sum(math.prod(s) // (tp if tp_dim(n) >= 0 else 1) for n, s in make_shapes(cfg).items())
    count = nbytes = 0
    if tp > 1:  # per block: g after attention and MLP (forward), f before them (backward)
        act = (params["batch"] // dp) * (cfg.seq_len - 1) * cfg.d_model * 4
        count += 4 * cfg.n_layers
        nbytes += 4 * cfg.n_layers * act
    if dp > 1:
        if layout.startswith("fsdp"):
            padded = -(-numel // dp) * dp
            count += 2
            nbytes += 2 * padded * 4
        else:
            count += 1
            nbytes += numel * 4
    return count, nbytes


def min_comm_doc(layout: str) -> str:
    parts = []
    if layout.startswith("fsdp"):
        parts.append("dp: 1 all_gather of all parameters + 1 reduce_scatter of all gradients")
    else:
        parts.append("dp: 1 all_reduce of all gradients")
    if layout.endswith("_tp"):
        parts.append("tp: 4 all_reduce of the activations per block (2 forward, 2 backward)")
    return "; ".join(parts) + "; fp32, none over an axis of size 1"


def memory_minimum(layout: str, params: dict, world: int) -> dict[str, int]:
    n = sum(local_numels(cfg_of(params), layout, world).values())
    return {"params": 4 * n, "grads": 4 * n, "optim": 8 * n, "state": 16 * n}
