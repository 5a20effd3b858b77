"""One function per contender per benchmark, the ``CONTENDERS`` registry and the benchmark cases.

A contender is ``def <bench>_<name>(ctx: Ctx) -> Prepared`` (or a bare ``step`` callable). It builds its
model/state from ``ctx.weights`` / ``ctx.data`` (identical on every rank, fixed seed) outside of the
timed region and returns a ``step()`` closure; see ``common.Prepared`` for the optional ``values`` (for
``--verify``) and ``state`` (for the memory table) hooks.

Registry values may be a function, ``None`` (shown as "n/a"), or a ``"module:attribute"`` string that is
imported lazily (an ``ImportError`` / ``NotImplementedError`` / ``None`` there is also shown as "n/a").
The fshard entries point into ``benchmarks/fshard_contenders.py``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .common import PARAM_NAMES, CopyToTP, Ctx, Prepared, ReduceFromTP, full, mlp_forward, trivial_fn

# ----------------------------------------------------------------------------------------------------------
# Collectives (the flat-tensor variants were renamed in recent torch; use whichever exists)
# ----------------------------------------------------------------------------------------------------------

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _dtensor_api():
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    return DTensor, Partial, Replicate, Shard


# ----------------------------------------------------------------------------------------------------------
# 1. Tensor-parallel MLP: Linear(h->4h) column-split, GELU, Linear(4h->h) row-split; loss = sum(output).
#    x requires grad (as if it came from a previous layer), so the input gradient is all-reduced too.
# ----------------------------------------------------------------------------------------------------------


def _tp_values(
    ctx: Ctx, x, grads: dict[str, Callable[[], torch.Tensor]], params: dict[str, Callable[[], torch.Tensor]]
):
    def values(loss):
        out = {"loss": full(loss).detach(), "grad/x": full(x.grad)}
        out.update({f"grad/{n}": g() for n, g in grads.items()})
        if ctx.optim is not None:
            out.update({f"param/{n}": p() for n, p in params.items()})
        return out

    return values


def tp_mlp_handwritten(ctx: Ctx) -> Prepared:
    """Local shards + two autograd.Functions (Megatron f/g): one all_reduce forward, one backward."""
    W, group = ctx.weights, ctx.group
    w1 = torch.nn.Parameter(ctx.shard(W["0.weight"], 0))
    b1 = torch.nn.Parameter(ctx.shard(W["0.bias"], 0))
    w2 = torch.nn.Parameter(ctx.shard(W["2.weight"], 1))
    b2 = torch.nn.Parameter(W["2.bias"].clone())
    x = ctx.data["x"].clone().requires_grad_(True)
    params = [w1, b1, w2, b2]
    opt = ctx.make_optimizer(params)

    def step():
        w1.grad = b1.grad = w2.grad = b2.grad = x.grad = None
        xi = CopyToTP.apply(x, group)
        hdn = F.gelu(F.linear(xi, w1, b1))
        y = ReduceFromTP.apply(F.linear(hdn, w2), group) + b2
        loss = y.sum()
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    values = _tp_values(
        ctx,
        x,
        grads={
            "0.weight": lambda: ctx.gather(w1.grad, 0),
            "0.bias": lambda: ctx.gather(b1.grad, 0),
            "2.weight": lambda: ctx.gather(w2.grad, 1),
            "2.bias": lambda: b2.grad.detach(),
        },
        params={
            "0.weight": lambda: ctx.gather(w1, 0),
            "0.bias": lambda: ctx.gather(b1, 0),
            "2.weight": lambda: ctx.gather(w2, 1),
            "2.bias": lambda: b2.detach(),
        },
    )
    return Prepared(step, values, lambda: ctx.memory_state(params, opt))


def tp_mlp_dtensor_parallelize(ctx: Ctx) -> Prepared:
    """``parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = ctx.make_mlp()
    parallelize_module(model, ctx.mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = ctx.data["x"].clone().requires_grad_(True)
    params = list(model.parameters())
    opt = ctx.make_optimizer(params)

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        loss = model(x).sum()
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    named = dict(model.named_parameters())
    values = _tp_values(
        ctx,
        x,
        grads={n: (lambda n=n: full(named[n].grad)) for n in PARAM_NAMES},
        params={n: (lambda n=n: full(named[n].detach())) for n in PARAM_NAMES},
    )
    return Prepared(step, values, lambda: ctx.memory_state(params, opt))


def tp_mlp_dtensor_local_map(ctx: Ctx) -> Prepared:
    """DTensor parameters + ``local_map`` over the local MLP body; output is Partial, redistributed."""
    from torch.distributed.tensor.experimental import local_map

    DTensor, Partial, Replicate, Shard = _dtensor_api()
    mesh, W = ctx.mesh, ctx.weights

    def param(t, placement):
        local = ctx.shard(t, placement.dim) if isinstance(placement, Shard) else t.clone()
        return torch.nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False))

    w1, b1 = param(W["0.weight"], Shard(0)), param(W["0.bias"], Shard(0))
    w2, b2 = param(W["2.weight"], Shard(1)), param(W["2.bias"], Replicate())
    x = ctx.data["x"].clone().requires_grad_(True)
    params = [w1, b1, w2, b2]
    opt = ctx.make_optimizer(params)

    def body(x, w1, b1, w2):
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2)  # a partial sum of the output on each rank

    mlp = local_map(
        body,
        out_placements=[Partial()],
        in_placements=([Replicate()], [Shard(0)], [Shard(0)], [Shard(1)]),
        in_grad_placements=([Partial()], [Shard(0)], [Shard(0)], [Shard(1)]),
        device_mesh=mesh,
    )
    replicate = [Replicate()]

    def step():
        w1.grad = b1.grad = w2.grad = b2.grad = x.grad = None
        xd = DTensor.from_local(x, mesh, replicate, run_check=False)
        y = mlp(xd, w1, b1, w2).redistribute(mesh, replicate) + b2
        loss = y.to_local().sum()
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    values = _tp_values(
        ctx,
        x,
        grads={n: (lambda p=p: full(p.grad)) for n, p in zip(PARAM_NAMES, params)},
        params={n: (lambda p=p: full(p.detach())) for n, p in zip(PARAM_NAMES, params)},
    )
    return Prepared(step, values, lambda: ctx.memory_state(params, opt))


# ----------------------------------------------------------------------------------------------------------
# 2a. Data parallel: every rank holds the whole MLP, takes batch/world rows; loss = mean over its rows
#     (the mean over ranks of that is the global mean); gradients averaged over ranks; optimizer step.
# ----------------------------------------------------------------------------------------------------------


def _dp_values(ctx: Ctx, grads, params):
    def values(loss):
        out = {"loss": ctx.mean_over_ranks(loss)}
        out.update({f"grad/{n}": g() for n, g in grads.items()})
        if ctx.optim is not None:
            out.update({f"param/{n}": p() for n, p in params.items()})
        return out

    return values


def dp_mlp_handwritten(ctx: Ctx) -> Prepared:
    """Replicated model; .grad are views of one flat buffer; one all_reduce of it per step."""
    model = ctx.make_mlp()
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    off = 0
    for p in params:
        p.grad = flat[off : off + p.numel()].view_as(p)
        off += p.numel()
    opt = ctx.make_optimizer(params)
    x = ctx.local_batch(ctx.data["x"])
    world, group = ctx.world, ctx.group

    def step():
        flat.zero_()
        loss = model(x).mean()
        loss.backward()
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        if opt is not None:
            opt.step()
        return loss

    named = dict(model.named_parameters())
    values = _dp_values(
        ctx,
        grads={n: (lambda n=n: named[n].grad.detach().clone()) for n in PARAM_NAMES},
        params={n: (lambda n=n: named[n].detach().clone()) for n in PARAM_NAMES},
    )
    return Prepared(step, values, lambda: ctx.memory_state(params, opt))


def dp_mlp_ddp(ctx: Ctx) -> Prepared:
    """``DistributedDataParallel(model)`` with default settings."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = ctx.make_mlp()
    ddp = DDP(model, process_group=ctx.group)
    params = list(model.parameters())
    opt = ctx.make_optimizer(params)
    x = ctx.local_batch(ctx.data["x"])

    def step():
        for p in params:
            p.grad = None
        loss = ddp(x).mean()
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    named = dict(model.named_parameters())
    values = _dp_values(
        ctx,
        grads={n: (lambda n=n: named[n].grad.detach().clone()) for n in PARAM_NAMES},
        params={n: (lambda n=n: named[n].detach().clone()) for n in PARAM_NAMES},
    )
    return Prepared(step, values, lambda: ctx.memory_state(params, opt))


# ----------------------------------------------------------------------------------------------------------
# 2b. FSDP (ZeRO-3 with the whole MLP as one unit): each rank keeps 1/world of the flat parameters,
#     gradients and optimizer state; per step one all_gather of the parameters (forward) and one
#     reduce_scatter (average) of the gradients (backward). Same data split and loss as data parallel.
# ----------------------------------------------------------------------------------------------------------


def _flat_leaves(flat, grad_flat, sizes, shapes) -> list[torch.Tensor]:
    """Views of ``flat`` as leaf tensors whose ``.grad`` are the matching views of ``grad_flat``.

    (A function, so that no loop variable keeps a view -- and with it a whole flat buffer -- alive.)
    """
    total = sum(sizes)
    leaves = [v.view(s).requires_grad_(True) for v, s in zip(flat[:total].split(sizes), shapes)]
    for leaf, g in zip(leaves, grad_flat[:total].split(sizes)):
        leaf.grad = g.view(leaf.shape)
    return leaves


def fsdp_mlp_handwritten(ctx: Ctx) -> Prepared:
    """Flat parameter shard; all_gather -> functional forward/backward into a flat grad buffer ->
    reduce_scatter(AVG) -> optimizer on the shard."""
    W, world, group = ctx.weights, ctx.world, ctx.group
    shapes = [W[n].shape for n in PARAM_NAMES]
    sizes = [W[n].numel() for n in PARAM_NAMES]
    total = sum(sizes)
    per_rank = -(-total // world)
    padded = per_rank * world
    flat_init = torch.zeros(padded)
    torch.cat([W[n].reshape(-1) for n in PARAM_NAMES], out=flat_init[:total])
    shard = torch.nn.Parameter(flat_init[ctx.rank * per_rank : (ctx.rank + 1) * per_rank].clone())
    opt = ctx.make_optimizer([shard])
    x = ctx.local_batch(ctx.data["x"])
    avg = dist.ReduceOp.AVG

    def step():
        shard.grad = None
        full_flat = torch.empty(padded)
        _all_gather_flat(full_flat, shard.detach(), group=group)
        gflat = torch.zeros(padded)  # backward accumulates straight into it (the .grad are views)
        leaves = _flat_leaves(full_flat, gflat, sizes, shapes)
        loss = mlp_forward(x, *leaves).mean()
        loss.backward()
        loss = loss.detach()  # drop the graph: it holds the leaves, which hold the gathered parameters
        del leaves, full_flat  # free the gathered parameters before communicating
        gshard = torch.empty(per_rank)
        _reduce_scatter_flat(gshard, gflat, op=avg, group=group)
        del gflat
        shard.grad = gshard
        if opt is not None:
            opt.step()
        return loss

    def unflatten(t):
        return dict(zip(PARAM_NAMES, (v.view(s) for v, s in zip(t[:total].split(sizes), shapes))))

    def values(loss):
        out = {"loss": ctx.mean_over_ranks(loss)}
        out.update({f"grad/{n}": g for n, g in unflatten(ctx.gather(shard.grad, 0)).items()})
        if ctx.optim is not None:
            out.update({f"param/{n}": p for n, p in unflatten(ctx.gather(shard.detach(), 0)).items()})
        return out

    return Prepared(step, values, lambda: ctx.memory_state([shard], opt))


def fsdp_mlp_fsdp2(ctx: Ctx) -> Prepared:
    """``torch.distributed.fsdp.fully_shard(model, mesh=mesh)`` on the root (one FSDP unit)."""
    from torch.distributed.fsdp import fully_shard

    model = ctx.make_mlp()
    fully_shard(model, mesh=ctx.mesh)
    params = list(model.parameters())
    opt = ctx.make_optimizer(params)
    x = ctx.local_batch(ctx.data["x"])

    def step():
        for p in params:
            p.grad = None
        loss = model(x).mean()
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    named = dict(model.named_parameters())
    values = _dp_values(
        ctx,
        grads={n: (lambda n=n: full(named[n].grad)) for n in PARAM_NAMES},
        params={n: (lambda n=n: full(named[n].detach())) for n in PARAM_NAMES},
    )
    return Prepared(step, values, lambda: ctx.memory_state(params, opt))


# ----------------------------------------------------------------------------------------------------------
# 3. shard_map call overhead: ``trivial_fn`` (x -> 2x for each input) on n inputs sharded along dim 0.
#    "handwritten" is the floor: the function called directly on the local shards.
# ----------------------------------------------------------------------------------------------------------


def _overhead_inputs(ctx: Ctx) -> list[torch.Tensor]:
    return [ctx.shard(ctx.data[f"in/{i}"], 0) for i in range(ctx.params["n_inputs"])]


def shard_map_overhead_handwritten(ctx: Ctx) -> Prepared:
    """Direct call on local shards (no wrapper at all)."""
    xs = _overhead_inputs(ctx)

    def step():
        return trivial_fn(*xs)

    def values(outs):
        return {f"out/{i}": ctx.gather(o, 0) for i, o in enumerate(outs)}

    return Prepared(step, values)


def shard_map_overhead_dtensor_local_map(ctx: Ctx) -> Prepared:
    """``local_map(trivial_fn, ...)`` called on Shard(0) DTensors, returning Shard(0) DTensors."""
    from torch.distributed.tensor.experimental import local_map

    DTensor, _, _, Shard = _dtensor_api()
    n = ctx.params["n_inputs"]
    xs = [DTensor.from_local(t, ctx.mesh, [Shard(0)], run_check=False) for t in _overhead_inputs(ctx)]
    fn = local_map(
        trivial_fn,
        out_placements=tuple([Shard(0)] for _ in range(n)),
        in_placements=tuple([Shard(0)] for _ in range(n)),
        device_mesh=ctx.mesh,
    )

    def step():
        return fn(*xs)

    def values(outs):
        return {f"out/{i}": full(o) for i, o in enumerate(outs)}

    return Prepared(step, values)


# ----------------------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------------------

_F = "benchmarks.fshard_contenders:"

# bench -> contender -> function | None | "module:attr". Order = the fixed order contenders run in.
CONTENDERS: dict[str, dict[str, Any]] = {
    "tp_mlp": {
        "handwritten": tp_mlp_handwritten,
        "dtensor_parallelize": tp_mlp_dtensor_parallelize,
        "dtensor_local_map": tp_mlp_dtensor_local_map,
        "fshard": _F + "tp_mlp_fshard",
    },
    "dp_mlp": {
        "handwritten": dp_mlp_handwritten,
        "ddp": dp_mlp_ddp,
        "fshard": _F + "dp_mlp_fshard",
    },
    "fsdp_mlp": {
        "handwritten": fsdp_mlp_handwritten,
        "fsdp2": fsdp_mlp_fsdp2,
        "fshard": _F + "fsdp_mlp_fshard",
    },
    "shard_map_overhead": {
        "handwritten": shard_map_overhead_handwritten,
        "dtensor_local_map": shard_map_overhead_dtensor_local_map,
        "fshard": _F + "shard_map_overhead_fshard",
    },
}

# The demo's GPT (one tensor per parameter; benchmarks/gpt.py): the hand-written floor, the torch-native
# recipe of the layout, and fshard: default bucket_mb, bucket_mb=0, and (in the data-parallel layouts,
# where buckets apply) the demo's own step, value_and_grad inside shard_map; in the FSDP layouts also
# the parameters gathered at the top of the step, one leaf at a time (combined, and with
# FSHARD_COMBINE=0) and as one pytree, next to FSDP2 wrapping the root only (fsdp2_whole).
_G = "benchmarks.gpt:"
GPT_NATIVE = {"gpt_dp": "ddp", "gpt_fsdp": "fsdp2", "gpt_dp_tp": "dtensor_tp_ddp", "gpt_fsdp_tp": "fsdp2_tp"}
for _bench, _native in GPT_NATIVE.items():
    CONTENDERS[_bench] = {
        "handwritten": _G + "handwritten",
        _native: _G + _native,
        # FSDP2 on the root only (one group): the counterpart of the whole-model forms below
        **({"fsdp2_whole": _G + "fsdp2_whole"} if _bench == "gpt_fsdp" else {}),
        "fshard": _F + "gpt_fshard",
        "fshard_nobucket": _F + "gpt_fshard_nobucket",
    }
    if not _bench.startswith("gpt_fsdp"):
        CONTENDERS[_bench]["fshard_vg"] = _F + "gpt_fshard_vg"
    else:  # FSDP without fs.fsdp_scan: one all_gather per leaf (combined by fshard, or not), or one of the tree
        CONTENDERS[_bench]["fshard_leaf"] = _F + "gpt_fshard_leaf"
        CONTENDERS[_bench]["fshard_leaf_nocombine"] = _F + "gpt_fshard_leaf_nocombine"
        CONTENDERS[_bench]["fshard_leaf_sync"] = _F + "gpt_fshard_leaf_sync"
        CONTENDERS[_bench]["fshard_tree"] = _F + "gpt_fshard_tree"
        CONTENDERS[_bench]["fshard_leaf_reshard"] = _F + "gpt_fshard_leaf_reshard"
        CONTENDERS[_bench]["fshard_tree_reshard"] = _F + "gpt_fshard_tree_reshard"
        CONTENDERS[_bench]["fshard_layer"] = _F + "gpt_fshard_layer"
        CONTENDERS[_bench]["fshard_layer_reshard"] = _F + "gpt_fshard_layer_reshard"


class Unavailable(Exception):
    """A contender that is not there (yet): reported as n/a, never an error."""


def resolve(entry: Any) -> Callable[[Ctx], Any]:
    """The contender function for a registry entry; raises ``Unavailable`` for n/a."""
    if entry is None:
        raise Unavailable("not registered")
    if isinstance(entry, str):
        mod_name, _, attr = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(mod_name), attr, None)
        except ImportError as e:
            raise Unavailable(f"import failed: {e}") from e
        if entry is None:
            raise Unavailable("not written yet")
    return entry


def build(entry: Any, ctx: Ctx) -> Prepared:
    """Resolve and call a contender; ImportError / NotImplementedError become ``Unavailable``."""
    from .common import as_prepared

    fn = resolve(entry)
    try:
        return as_prepared(fn(ctx))
    except (ImportError, NotImplementedError) as e:
        raise Unavailable(f"{type(e).__name__}: {e}") from e


# ----------------------------------------------------------------------------------------------------------
# Benchmarks and cases
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bench:
    title: str
    optim: str | None  # optimizer used when timing (verify uses SGD instead of Adam)
    baseline: str  # the hand-written minimum the ratios are taken against
    dtensor: tuple[str, ...]  # the torch-native contenders (for "fshard / DTensor")
    min_comm: Callable[[dict, int], tuple[int, int]]  # (collectives, bytes) per step, hand-written minimum
    min_comm_doc: str


def _mlp_param_count(h: int) -> int:
    return 2 * 4 * h * h + 4 * h + h


BENCHES: dict[str, Bench] = {
    "tp_mlp": Bench(
        "Tensor-parallel MLP step (forward + backward, loss = sum)",
        None,
        "handwritten",
        ("dtensor_parallelize", "dtensor_local_map"),
        lambda p, w: (2, 2 * p["batch"] * p["hidden"] * 4),
        "2 all_reduce of batch x hidden fp32 (output in forward, input grad in backward)",
    ),
    "dp_mlp": Bench(
        "Data-parallel MLP step (forward + backward + Adam); flat-vector floor: every contender keeps the "
        "parameters as one flat vector (fshard too), which no user writes -- see the GPT benchmarks",
        "adam",
        "handwritten",
        ("ddp",),
        lambda p, w: (1, _mlp_param_count(p["hidden"]) * 4),
        "1 all_reduce of all gradients (fp32)",
    ),
    "fsdp_mlp": Bench(
        "FSDP MLP step (forward + backward + Adam), one unit; flat-vector floor: every contender keeps the "
        "parameters as one flat vector (fshard too), which no user writes -- see the GPT benchmarks",
        "adam",
        "handwritten",
        ("fsdp2",),
        lambda p, w: (2, 2 * _mlp_param_count(p["hidden"]) * 4),
        "1 all_gather of the parameters + 1 reduce_scatter of the gradients (fp32, full size)",
    ),
    "shard_map_overhead": Bench(
        "shard_map call overhead (x -> 2x on n sharded inputs)",
        None,
        "handwritten",
        ("dtensor_local_map",),
        lambda p, w: (0, 0),
        "no communication",
    ),
}


def _gpt_min_comm(layout: str) -> Callable[[dict, int], tuple[int, int]]:
    def f(p: dict, w: int) -> tuple[int, int]:
        from . import gpt

        return gpt.min_comm(layout, p, w)

    return f


_GPT_TITLES = {
    "gpt_dp": "GPT, data parallel (replicated parameters, batch split over dp)",
    "gpt_fsdp": "GPT, FSDP (every parameter split over dp, all-gathered for use)",
    "gpt_dp_tp": "GPT, data x tensor parallel (Megatron heads / MLP split over tp, batch over dp)",
    "gpt_fsdp_tp": "GPT, FSDP x tensor parallel",
}
_GPT_DOCS = {
    "gpt_dp": "dp: 1 all_reduce of all gradients",
    "gpt_fsdp": "dp: 1 all_gather of all parameters + 1 reduce_scatter of all gradients",
    "gpt_dp_tp": "dp: 1 all_reduce of the tp-local gradients; tp: 2 all_reduce of activations per block "
    "forward, 2 backward",
    "gpt_fsdp_tp": "dp: 1 all_gather + 1 reduce_scatter of the tp-local parameters / gradients; tp: 2 "
    "all_reduce of activations per block forward, 2 backward",
}
for _bench, _native in GPT_NATIVE.items():
    BENCHES[_bench] = Bench(
        _GPT_TITLES[_bench] + ", one step: forward + backward + gradient collectives (no optimizer)",
        None,
        "handwritten",
        (_native,),
        _gpt_min_comm(_bench.removeprefix("gpt_")),
        _GPT_DOCS[_bench] + " (fp32; nothing over an axis of size 1)",
    )


@dataclass(frozen=True)
class Case:
    bench: str
    params: dict = field(hash=False)
    warmup: int = 10
    steps: int = 100  # timed steps per contender, split evenly over `rounds`
    rounds: int = 5

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.params.items())


@dataclass(frozen=True)
class MemCase:
    layout: str  # replicated | fsdp | tp
    bench: str
    params: dict = field(hash=False)


def skip_reason(case: Case, world: int, smoke: bool) -> str | None:
    """Why a case is not run at ``world`` (None: it is). On 2 ranks the *_tp layouts have the mesh
    dp=1 x tp=2, where fsdp x tp is the same computation as dp x tp: timed once, as dp x tp."""
    if case.bench == "gpt_fsdp_tp" and not smoke:
        from . import gpt

        if gpt.mesh_shape("fsdp_tp", world)[0] == 1:
            return "mesh dp=1 x tp=2: nothing to shard over dp, the same computation as gpt_dp_tp"
    return None


def cases(smoke: bool) -> list[Case]:
    if smoke:
        return [
            Case("tp_mlp", {"hidden": 64, "batch": 4}, warmup=2, steps=6, rounds=2),
            Case("dp_mlp", {"hidden": 64, "batch": 8}, warmup=2, steps=6, rounds=2),
            Case("fsdp_mlp", {"hidden": 64, "batch": 8}, warmup=2, steps=6, rounds=2),
            Case("shard_map_overhead", {"n_inputs": 1, "rows": 4, "cols": 4}, warmup=2, steps=20, rounds=2),
            Case("shard_map_overhead", {"n_inputs": 16, "rows": 4, "cols": 4}, warmup=2, steps=20, rounds=2),
            *(Case(b, {"model": "tiny", "batch": 8}, warmup=1, steps=4, rounds=2) for b in GPT_NATIVE),
        ]
    # step counts keep a `--world 2 4` run within about 15 minutes on a 2-core machine
    return [
        Case("tp_mlp", {"hidden": 256, "batch": 8}, warmup=20, steps=300, rounds=6),
        Case("tp_mlp", {"hidden": 1024, "batch": 64}, warmup=4, steps=60, rounds=6),
        Case("dp_mlp", {"hidden": 512, "batch": 64}, warmup=4, steps=60, rounds=6),
        Case("fsdp_mlp", {"hidden": 512, "batch": 64}, warmup=4, steps=60, rounds=6),
        Case("shard_map_overhead", {"n_inputs": 1, "rows": 8, "cols": 8}, warmup=50, steps=1500, rounds=6),
        Case("shard_map_overhead", {"n_inputs": 16, "rows": 8, "cols": 8}, warmup=50, steps=1500, rounds=6),
        *(Case(b, {"model": "demo", "batch": 64}, warmup=2, steps=20, rounds=4) for b in GPT_NATIVE),
        *(Case(b, {"model": "10x", "batch": 32}, warmup=2, steps=10, rounds=5) for b in GPT_NATIVE),
    ]


def mem_cases(smoke: bool) -> list[MemCase]:
    p = {"hidden": 64, "batch": 8} if smoke else {"hidden": 512, "batch": 64}
    g = {"model": "tiny", "batch": 8} if smoke else {"model": "10x", "batch": 32}
    return [
        MemCase("replicated", "dp_mlp", p),
        MemCase("fsdp", "fsdp_mlp", p),
        MemCase("tp", "tp_mlp", p),
        MemCase("GPT fsdp", "gpt_fsdp", g),
    ]
