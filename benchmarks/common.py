"""What every contender gets (``Ctx``) and returns (``Prepared``), plus the shared model and references.

The model of every training benchmark is the same two-layer MLP::

    y = Linear(4h -> h)(GELU(Linear(h -> 4h)(x)))        # nn.Sequential indices "0", "1", "2"

with parameters named like ``nn.Sequential``'s: ``0.weight`` (4h, h), ``0.bias`` (4h,), ``2.weight`` (h, 4h),
``2.bias`` (h,). Initial weights and data come from a fixed seed and are identical on every rank and for
every contender (each contender gets its own fresh copy in its ``Ctx``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

PARAM_NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")
SEED = 1234

# Optimizer hyper-parameters shared by every contender and by the references.
ADAM_KW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=False)
SGD_KW = dict(lr=0.1, momentum=0.0, foreach=False)


# ----------------------------------------------------------------------------------------------------------
# What a contender returns
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    """A built contender.

    step:   one benchmark step, the only thing that is timed. For the training benchmarks it zeroes the
            gradients, runs forward + backward (+ the optimizer step when ``ctx.optim`` is set) and returns
            the loss (a tensor; this rank's view of it is fine). For ``shard_map_overhead`` it returns the
            outputs of the call.
    values: (verify only, not timed) given what ``step()`` returned, the *full, global* values to compare
            with the single-process reference: keys ``"loss"``, ``"grad/<param name>"``, ``"grad/x"`` (TP
            only), ``"param/<param name>"`` (after the step, when ``ctx.optim`` is set), ``"out/<i>"``
            (overhead benchmark). Gathering inside is fine: every rank calls it. ``Ctx`` has helpers.
    state:  (memory only, not timed) ``{"params": [...], "grads": [...], "optim": [...]}`` -- the tensors
            this rank keeps between steps. ``ctx.memory_state(params, optimizer)`` builds it.
    """

    step: Callable[[], Any]
    values: Callable[[Any], dict[str, torch.Tensor]] | None = None
    state: Callable[[], dict[str, list[torch.Tensor]]] | None = None


def as_prepared(obj: Any) -> Prepared:
    """Contenders may return a bare ``step`` callable; wrap it."""
    if isinstance(obj, Prepared):
        return obj
    if callable(obj):
        return Prepared(step=obj)
    raise TypeError(f"a contender must return Prepared or a callable, got {type(obj).__name__}")


# ----------------------------------------------------------------------------------------------------------
# What a contender gets
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    """Everything a contender needs; a fresh one (with fresh weight/data copies) per contender.

    rank, world:  this process and the number of processes (gloo, CPU, one 1-D mesh over all ranks).
    group:        the default process group.
    mesh:         a 1-D ``DeviceMesh("cpu", (world,), mesh_dim_names=("x",))``.
    bench:        benchmark name (``tp_mlp``, ``dp_mlp``, ``fsdp_mlp``, ``shard_map_overhead``).
    params:       the case's sizes, e.g. ``{"hidden": 256, "batch": 8}`` or ``{"n_inputs": 16, ...}``.
    optim:        ``None`` (no optimizer step), ``"adam"`` or ``"sgd"``; use ``make_optimizer``.
    weights:      full initial parameters by name (see ``PARAM_NAMES``); same on every rank.
    data:         full (global) inputs: ``"x"`` of shape (batch, hidden) for the MLP benchmarks, where batch
                  is the *global* batch (DP/FSDP contenders take ``local_batch``); ``"in/<i>"`` for the
                  overhead benchmark, sharded along dim 0.
    """

    rank: int
    world: int
    group: Any
    mesh: Any
    bench: str
    params: dict
    optim: str | None
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    data: dict[str, torch.Tensor] = field(default_factory=dict)

    # -- sharding helpers -------------------------------------------------------------------------------
    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous chunk of ``t`` along ``dim`` (a copy)."""
        assert t.shape[dim] % self.world == 0, (tuple(t.shape), dim, self.world)
        return t.tensor_split(self.world, dim=dim)[self.rank].contiguous().clone()

    def local_batch(self, t: torch.Tensor) -> torch.Tensor:
        return self.shard(t, 0)

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` (not for timed code)."""
        t = full(t).detach().contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)

    def mean_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        t = full(t).detach().clone()
        dist.all_reduce(t, group=self.group)
        return t / self.world

    # -- model helpers ----------------------------------------------------------------------------------
    def make_mlp(self) -> nn.Sequential:
        """The benchmark MLP as ``nn.Sequential`` holding this ctx's (full) initial weights."""
        return make_mlp(self.weights)

    def make_optimizer(self, params) -> torch.optim.Optimizer | None:
        """The benchmark's optimizer over ``params`` (local shards or DTensors), or None."""
        return make_optimizer(params, self.optim)

    @staticmethod
    def zero_grad(tensors) -> None:
        for t in tensors:
            t.grad = None

    @staticmethod
    def memory_state(
        params, optimizer: torch.optim.Optimizer | None = None, extra_grads=()
    ) -> dict[str, list[torch.Tensor]]:
        params = list(params)
        grads = [p.grad for p in params if p.grad is not None] + list(extra_grads)
        optim = []
        if optimizer is not None:
            for st in optimizer.state.values():
                optim.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        return {"params": params, "grads": grads, "optim": optim}


def make_optimizer(params, optim: str | None) -> torch.optim.Optimizer | None:
    params = list(params)
    if optim is None:
        return None
    if optim == "adam":
        return torch.optim.Adam(params, **ADAM_KW)
    if optim == "sgd":
        return torch.optim.SGD(params, **SGD_KW)
    raise ValueError(optim)


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value, or the tensor itself."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor()
    return t


# ----------------------------------------------------------------------------------------------------------
# Shared weights, data and the model
# ----------------------------------------------------------------------------------------------------------


def make_weights(hidden: int, seed: int = SEED) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + hidden)
    h, f = hidden, 4 * hidden
    return {
        "0.weight": torch.randn(f, h, generator=g) / math.sqrt(h),
        "0.bias": torch.randn(f, generator=g) * 0.1,
        "2.weight": torch.randn(h, f, generator=g) / math.sqrt(f),
        # offset so the outputs do not cancel in sum/mean losses (keeps the loss well-conditioned for
        # relative comparisons at float32)
        "2.bias": 1.0 + torch.randn(h, generator=g) * 0.1,
    }


def make_mlp_data(hidden: int, batch: int, seed: int = SEED) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 7919 * hidden + batch)
    return {"x": torch.randn(batch, hidden, generator=g)}


def make_overhead_data(n_inputs: int, rows: int, cols: int, seed: int = SEED) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + n_inputs)
    return {f"in/{i}": torch.randn(rows, cols, generator=g) for i in range(n_inputs)}


def make_mlp(weights: dict[str, torch.Tensor]) -> nn.Sequential:
    f, h = weights["0.weight"].shape
    m = nn.Sequential(nn.Linear(h, f), nn.GELU(), nn.Linear(f, h))
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(weights[name])
    return m


def mlp_forward(x, w1, b1, w2, b2):
    """The benchmark MLP, functionally."""
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def trivial_fn(*xs):
    """The function of the shard_map overhead benchmark: elementwise, no communication."""
    return tuple(x * 2.0 for x in xs)


# ----------------------------------------------------------------------------------------------------------
# Single-process references (verify)
# ----------------------------------------------------------------------------------------------------------


def reference_values(bench: str, weights, data, optim: str | None) -> dict[str, torch.Tensor]:
    """The full values a correct contender's ``Prepared.values`` must reproduce."""
    if bench == "shard_map_overhead":
        ins = [data[f"in/{i}"] for i in range(len(data))]
        return {f"out/{i}": o for i, o in enumerate(trivial_fn(*ins))}

    m = make_mlp({k: v.clone() for k, v in weights.items()})
    x = data["x"].clone()
    if bench == "tp_mlp":
        x.requires_grad_(True)
        loss = m(x).sum()
    elif bench in ("dp_mlp", "fsdp_mlp"):
        loss = m(x).mean()
    else:
        raise KeyError(bench)
    loss.backward()
    out = {"loss": loss.detach()}
    params = dict(m.named_parameters())
    for n in PARAM_NAMES:
        out[f"grad/{n}"] = params[n].grad.detach().clone()
    if bench == "tp_mlp":
        out["grad/x"] = x.grad.detach().clone()
    if optim is not None:
        make_optimizer(m.parameters(), optim).step()
        for n in PARAM_NAMES:
            out[f"param/{n}"] = params[n].detach().clone()
    return out


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (0 when both are zero)."""
    got = full(got).detach().to(torch.float64).reshape(ref.shape)
    ref = ref.detach().to(torch.float64)
    den = ref.abs().max().item() if ref.numel() else 0.0
    num = (got - ref).abs().max().item() if ref.numel() else 0.0
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


# -- hand-written Megatron tensor parallelism (the MLP and GPT floors) --


class CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all_reduce of the input gradient over tp in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all_reduce of the partial output over tp in forward, identity backward."""

    @staticmethod
    def forward(ctx, y, group):
        dist.all_reduce(y, group=group)
        ctx.mark_dirty(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None
