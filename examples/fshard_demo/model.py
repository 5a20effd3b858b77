"""The model: a GPT-style decoder written as pure functions over a parameter pytree.

Everything here is a function of the parameters, the tokens and a :class:`Config` (any size),
so the same model can be trained by the demo, benchmarked, or checked against a 1-process run::

    import fshard as fs
    from fshard_demo.model import Config, fsdp_dims, init_params, loss_fn

    cfg = Config(d_model=256, n_heads=8, n_layers=4, d_mlp=1024)
    params, specs = init_params(0, cfg, mesh, "fsdp_tp")   # Sharded leaves and their specs
    dims = fsdp_dims(specs)
    grad_step = fs.shard_map(
        lambda p, tokens: fs.value_and_grad(loss_fn)(p, tokens, cfg, dims),
        mesh=mesh, in_specs=(specs, "(dp b) t"), out_specs=("", specs),
    )
    loss, grads = grad_step(params, tokens)  # tokens: (batch, cfg.seq_len) global, e.g. Task.batch

:func:`forward` and :func:`loss_fn` run inside ``fs.shard_map`` on each rank's blocks: Megatron
tensor parallelism splits the attention heads and the MLP over the mesh axis ``tp`` (one
``fs.psum`` after the attention output and one after the MLP output), the batch is split over
``dp``, and FSDP layouts all-gather the parameters over ``dp`` before use, one block at a time
(``fs.fsdp_scan``; the embeddings and the head with :func:`unshard`).
The mesh has the two axes ``dp`` and ``tp``, either of size 1; on ``Mesh(dp=1, tp=1)`` (one
process) every collective is a no-op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import optree
import torch
import torch.nn.functional as F

import fshard as fs

__all__ = [
    "LAYOUTS",
    "Config",
    "block",
    "forward",
    "fsdp_dims",
    "init_params",
    "loss_fn",
    "param_specs",
    "unshard",
]

LAYOUTS = ("dp_tp", "fsdp_tp", "dp", "fsdp")


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
        "ln1_w": z("d"),
        "ln1_b": z("d"),
        "wq": f"{z('d')} {t('e')}",
        "wk": f"{z('d')} {t('e')}",
        "wv": f"{z('d')} {t('e')}",
        "wo": f"{t('e')} {z('d')}",
        "ln2_w": z("d"),
        "ln2_b": z("d"),
        "w1": f"{z('d')} {t('f')}",
        "w2": f"{t('f')} {z('d')}",
    }
    return {
        "wte": f"v {z('d')}",
        "wpe": f"p {z('d')}",
        "blocks": [dict(block) for _ in range(cfg.n_layers)],
        "lnf_w": z("d"),
        "lnf_b": z("d"),
        "w_out": f"{z('d')} v",
    }


def init_params(seed: int, cfg: Config, mesh: fs.Mesh, layout: str = "dp_tp"):
    """Initialize the parameters on ``mesh`` in ``layout``: ``(params, specs)``.

    The global values depend only on ``seed`` and ``cfg`` (``fs.random.normal`` draws each
    global tensor from its own seed), so every mesh shape and layout starts from the same model.

    Examples:
        >>> mesh = fs.Mesh(dp=2, tp=2)
        >>> params, specs = init_params(0, Config(), mesh, "dp_tp")
        >>> params["blocks"][0]["wq"].spec, params["blocks"][0]["wq"].local.shape
        ('d (tp e)', torch.Size([128, 64]))
    """
    specs = param_specs(cfg, layout)
    d, f, v = cfg.d_model, cfg.d_mlp, cfg.vocab
    shapes = {
        "wte": (v, d),
        "wpe": (cfg.seq_len, d),
        "lnf_w": (d,),
        "lnf_b": (d,),
        "w_out": (d, v),
        "blocks": [
            {
                "ln1_w": (d,),
                "ln1_b": (d,),
                "wq": (d, d),
                "wk": (d, d),
                "wv": (d, d),
                "wo": (d, d),
                "ln2_w": (d,),
                "ln2_b": (d,),
                "w1": (d, f),
                "w2": (f, d),
            }
            for _ in range(cfg.n_layers)
        ],
    }
    proj_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2's scaled init of the residual projections
    is_shape = lambda x: isinstance(x, tuple)
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


def fsdp_dims(specs):
    """For each parameter, the dim its spec splits over dp (FSDP), or -1: the ``dp_dims`` of
    :func:`forward` and :func:`loss_fn`.

    Examples:
        >>> fsdp_dims(param_specs(Config(n_layers=1), "fsdp_tp"))["blocks"][0]["wq"]
        0
    """

    def dim_of(spec):
        for i, dim in enumerate(fs.parse_spec(spec).dims):
            if "dp" in dim.names:
                return i
        return -1

    return optree.tree_map(dim_of, specs)


def unshard(params, dp_dims):
    """All-gather the FSDP-split parameters over dp (the gradient becomes a reduce-scatter).

    The split parameters are gathered together, each along its own dim: one coalesced
    all-gather (per dtype), whose transpose is one reduce-scatter.
    """
    leaves, treedef = optree.tree_flatten(params)
    dims = treedef.flatten_up_to(dp_dims)
    idx = [i for i, d in enumerate(dims) if d >= 0]
    out = list(leaves)
    if idx:
        gathered = fs.all_gather([leaves[i] for i in idx], "dp", dim=[dims[i] for i in idx], tiled=True)
        for i, w in zip(idx, gathered):
            out[i] = w
    return treedef.unflatten(out)


def block(blk, x, cfg: Config):
    """One decoder block on the residual stream ``x`` (``(b, s, d)``), with ``blk`` gathered over dp.

    q/k/v/w1 hold this rank's columns (heads, hidden units) and wo/w2 its rows, so the attention
    and MLP outputs are partial sums completed by ``fs.psum(..., "tp")``.
    """
    b, s, d = x.shape
    hd = d // cfg.n_heads
    h = F.layer_norm(x, (d,), blk["ln1_w"], blk["ln1_b"])
    q, k, v = (
        (h @ blk[w]).view(b, s, -1, hd).transpose(1, 2)  # (b, local heads, s, hd)
        for w in ("wq", "wk", "wv")
    )
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    a = a.transpose(1, 2).reshape(b, s, -1)
    x = x + fs.psum(a @ blk["wo"], "tp")
    h = F.layer_norm(x, (d,), blk["ln2_w"], blk["ln2_b"])
    return x + fs.psum(F.gelu(h @ blk["w1"]) @ blk["w2"], "tp")


def forward(params, tokens, cfg: Config, dp_dims=None):
    """Per-shard forward pass: local token block ``(b, s)`` -> logits ``(b, s, vocab)``.

    Runs inside ``fs.shard_map``; every value but the tp-split weights and the attention heads
    is replicated over tp. With ``dp_dims`` (FSDP layouts, :func:`fsdp_dims`) the blocks run
    through ``fs.fsdp_scan``: one block's parameters gathered at a time (the next block's gather
    in flight meanwhile), freed after its forward and gathered again in the backward; the
    embeddings and the head are gathered once (:func:`unshard`).
    """
    blocks = params["blocks"]
    top = {k: v for k, v in params.items() if k != "blocks"}
    fsdp = dp_dims is not None and any(d >= 0 for d in optree.tree_leaves(dp_dims))
    if fsdp:
        top = unshard(top, {k: v for k, v in dp_dims.items() if k != "blocks"})
    s = tokens.shape[1]
    x = top["wte"][tokens] + top["wpe"][:s]
    if fsdp:
        dims = optree.tree_map(lambda d: None if d < 0 else d, dp_dims["blocks"], none_is_leaf=True)
        x = fs.fsdp_scan(lambda blk, x: block(blk, x, cfg), blocks, x, "dp", dims=dims)
    else:
        for blk in blocks:
            x = block(blk, x, cfg)
    x = F.layer_norm(x, (cfg.d_model,), top["lnf_w"], top["lnf_b"])
    return x @ top["w_out"]


def loss_fn(params, tokens, cfg: Config, dp_dims=None):
    """Mean cross-entropy on the answer tokens of the whole global batch (``fs.pmean`` over dp)."""
    n_ans = cfg.digits + 1
    logits = forward(params, tokens[:, :-1], cfg, dp_dims)[:, -n_ans:]
    local = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, -n_ans:].reshape(-1))
    return fs.pmean(local, "dp")
