"""Hugging Face `transformers` models under fshard, written as a user writes them (shared by
tests/test_hf_models.py and the docs page docs/hf-models.md, which shows the same code).

A model is built once from a tiny config (random weights from a fixed seed, nothing downloaded)
and called with ``torch.func.functional_call`` inside ``fs.shard_map`` on the parameters that
shard_map hands to ``f``. Each layout is a function of the parameter names: the spec of each
parameter, how the global parameter is presented to shard_map (GPT-2's fused ``c_attn`` seen with
q, k and v as a dim of its own, so that each of them is split per head), and how ``f`` turns its
local blocks back into the module's parameters (an ``fs.all_gather`` for FSDP). Tensor parallelism
changes the module itself, once (Megatron style): the row-parallel projections sum their partial
products over ``tp`` with ``fs.psum``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call

import fshard as fs

VOCAB = 250
SEQ = 12


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny GPT-2 or Llama with random weights drawn from ``seed`` (the global RNG is restored)."""
    import transformers

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if kind == "gpt2":
            cfg = transformers.GPT2Config(
                n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, use_cache=False, bos_token_id=1,
                eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            )  # fmt: skip
            return transformers.GPT2LMHeadModel(cfg)
        cfg = transformers.LlamaConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(cfg)


def batch(n: int, seed: int, pad: bool):
    """Token ids, a tokenizer-style attention mask (1 = token, 0 = pad; right padding) and labels
    (-100 on pads), for ``n`` sequences of SEQ tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB, (n, SEQ), generator=g)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    if pad:
        lengths = torch.randint(3, SEQ + 1, (n,), generator=g)
        lengths[0] = SEQ  # at least one full row
        mask = (torch.arange(SEQ) < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def token_loss(model, params, ids, mask, labels):
    """The sum of the next-token losses of the valid tokens, and their number (plain torch); no
    attention_mask passed to the model when ``mask`` is None."""
    kwargs = {} if mask is None else {"attention_mask": mask}
    logits = functional_call(model, params, (ids,), kwargs).logits
    targets = labels[:, 1:].reshape(-1)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets, reduction="sum")
    return loss, (targets != -100).sum().float()


# == layouts ===============================================================================


def fused_qkv(name: str) -> bool:
    return name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias")


def tp_spec(kind: str, name: str, shape) -> str:
    """Megatron-style tensor parallelism: column-parallel projections split their outputs over
    tp, row-parallel ones their inputs; everything else is replicated."""
    if kind == "gpt2":  # Conv1D weights are (in, out)
        if fused_qkv(name):  # seen as (d, 3, d) and (3, d): q, k and v each split per head
            return "_ _ (tp _)" if name.endswith("weight") else "_ (tp _)"
        if name.endswith("mlp.c_fc.weight"):
            return "_ (tp _)"
        if name.endswith("mlp.c_fc.bias"):
            return "(tp _)"
        if name.endswith("c_proj.weight"):  # attention's and the MLP's output projections
            return "(tp _) _"
        return "..."
    # Llama: nn.Linear weights are (out, in), no biases
    if any(name.endswith(f"{p}.weight") for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        return "(tp _) _"
    if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
        return "_ (tp _)"
    return "..."


def present(kind: str, layout: str, params: dict) -> dict:
    """The tree handed to shard_map: GPT-2's fused qkv seen with q, k, v as a dim under tp."""
    if layout != "tp" or kind != "gpt2":
        return dict(params)
    out = {}
    for name, p in params.items():
        if fused_qkv(name):
            p = p.unflatten(-1, (3, p.shape[-1] // 3))  # (d, 3d) -> (d, 3, d); (3d,) -> (3, d)
        out[name] = p
    return out


def specs(kind: str, layout: str, params: dict) -> dict:
    if layout == "dp":
        return {name: "..." for name in params}
    if layout == "fsdp":
        return {name: "(dp _) ..." for name in params}  # each parameter's dim 0 split over dp
    return {name: tp_spec(kind, name, p.shape) for name, p in params.items()}


def local_params(kind: str, layout: str, tree: dict) -> dict:
    """Inside f: the module's parameters from this rank's blocks."""
    if layout == "fsdp":
        return {name: fs.all_gather(p, "dp", dim=0, tiled=True) for name, p in tree.items()}
    if layout == "tp" and kind == "gpt2":
        return {name: p.flatten(-2) if fused_qkv(name) else p for name, p in tree.items()}
    return tree


def megatron(model: torch.nn.Module, tp: int) -> torch.nn.Module:
    """Make ``model`` the per-rank module of tensor parallelism over ``tp`` ranks (in place)."""
    if hasattr(model, "transformer"):  # GPT-2
        for block in model.transformer.h:
            block.attn.split_size = block.attn.embed_dim // tp  # this rank's q, k, v: n_head / tp heads
            block.attn.c_attn.nf //= tp  # a Conv1D's output width (column-parallel: 1/tp of it here)
            block.mlp.c_fc.nf //= tp
            row_parallel_conv1d(block.attn.c_proj)
            row_parallel_conv1d(block.mlp.c_proj)
    else:  # Llama: no biases, so a hook that sums the output is enough
        for layer in model.model.layers:
            layer.self_attn.o_proj.register_forward_hook(psum_tp)
            layer.mlp.down_proj.register_forward_hook(psum_tp)
    return model


def row_parallel_conv1d(conv) -> None:
    """GPT-2's Conv1D with its weight's rows split over tp: sum the partial products over tp,
    then add the (replicated) bias once."""

    def forward(x):
        return fs.psum(x @ conv.weight, "tp") + conv.bias

    conv.forward = forward


def psum_tp(module, args, out):
    return fs.psum(out, "tp")
