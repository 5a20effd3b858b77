"""The fshard contenders: one function per benchmark, registered in ``contenders.CONTENDERS``.

Each is ``def <bench>_fshard(ctx: Ctx) -> Prepared`` (a bare ``step`` callable is accepted too). Until a
function is written it stays ``None`` here, and the report shows "n/a"; raising ``ImportError`` or
``NotImplementedError`` while building does the same, so the suite keeps running while fshard grows.

Rules, so the comparison stays fair (look at the hand-written contender of the same benchmark in
``contenders.py`` -- it is the reference for what one step does):

* Build everything (mesh, sharded parameters, jitted/compiled things, optimizer) *outside* ``step``;
  only ``step()`` is timed. Start from ``ctx.weights`` / ``ctx.data`` (full tensors, same on every rank),
  use ``ctx.shard(t, dim)`` / ``ctx.local_batch(t)`` to cut this rank's part, ``ctx.mesh`` or
  ``ctx.group`` / ``ctx.world`` / ``ctx.rank`` for the device mesh, and ``ctx.make_optimizer(params)``
  (returns ``None`` when the benchmark has no optimizer step; Adam when timing, SGD under --verify).
* ``step()`` = zero the grads (set to None), forward, backward, ``opt.step()`` if there is an optimizer;
  return the loss. Gradients must be *complete* after ``step()`` (all collectives done).
* ``values(loss)`` (for ``--verify``, untimed): the full global values, keys ``loss``,
  ``grad/<name>`` for ``common.PARAM_NAMES``, plus ``grad/x`` for ``tp_mlp`` and ``param/<name>`` when
  ``ctx.optim`` is set; ``out/<i>`` for ``shard_map_overhead``. ``ctx.gather`` / ``ctx.mean_over_ranks``
  / ``common.full`` help.
* ``state()`` (memory table, untimed): ``ctx.memory_state(params, opt)`` over this rank's tensors.

Per benchmark:

tp_mlp (``ctx.params``: hidden, batch; no optimizer when timing, Adam for the memory table)
    ``loss = sum(Linear2(GELU(Linear1(x))))`` with x = ``ctx.data["x"]`` (batch, hidden), *requiring
    grad*, replicated on every rank; ``0.weight``/``0.bias`` column-split (dim 0), ``2.weight`` row-split
    (dim 1), ``2.bias`` replicated. Minimum: one all_reduce forward, one backward.
dp_mlp (hidden, batch = global batch; Adam)
    Replicated parameters, this rank's ``ctx.local_batch(x)``, ``loss = mean(out)`` over the local rows,
    gradients averaged over ranks. Minimum: one all_reduce of all gradients.
fsdp_mlp (hidden, batch; Adam)
    Like dp_mlp, but parameters, gradients and optimizer state sharded 1/world per rank. Minimum: one
    all_gather of the parameters, one reduce_scatter of the gradients.
gpt_dp, gpt_fsdp, gpt_dp_tp, gpt_fsdp_tp (model, batch; no optimizer when timing)
    The demo's GPT (``benchmarks/gpt.py``): ``gpt_fshard`` runs ``fshard_demo.model.loss_fn`` under
    ``fs.shard_map`` with the layout's ``param_specs`` and calls ``loss.backward()`` (default ``bucket_mb``);
    ``gpt_fshard_nobucket`` the same with ``bucket_mb=0``; ``gpt_fshard_vg`` the demo's own step
    (``fs.value_and_grad`` inside ``fs.shard_map``). In the FSDP layouts the demo runs its blocks through
    ``fs.fsdp_scan`` (one block gathered at a time, the next one's gather in flight, freed after use and
    gathered again in the backward), as FSDP2 per block does. Minimum: see ``gpt.min_comm``.
shard_map_overhead (n_inputs, rows, cols)
    ``common.trivial_fn`` (x -> 2x for each input) through shard_map over ``n_inputs`` inputs
    ``ctx.data["in/<i>"]`` sharded along dim 0; ``step()`` returns the outputs. Measures the per-call
    cost against calling the function on the local shards directly.

Example skeleton::

    def tp_mlp_fshard(ctx: Ctx) -> Prepared:
        import fshard
        w1 = ...  # sharded params from ctx.weights
        x = ctx.data["x"].clone().requires_grad_(True)
        opt = ctx.make_optimizer([...])
        def step():
            ...; loss.backward()
            if opt is not None:
                opt.step()
            return loss
        def values(loss):
            return {"loss": loss.detach(), "grad/x": x.grad, "grad/0.weight": ..., ...}
        return Prepared(step, values, lambda: ctx.memory_state([...], opt))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fshard as fs

from .common import PARAM_NAMES, Ctx, Prepared, mlp_forward, trivial_fn

_MESHES: dict = {}


def _mesh(ctx: Ctx) -> fs.Mesh:
    """The benchmark's 1-D DeviceMesh (axis "x") as an fshard mesh, built once per process."""
    m = _MESHES.get(id(ctx.mesh))
    if m is None or m[0] is not ctx.mesh:
        m = _MESHES[id(ctx.mesh)] = (ctx.mesh, fs.Mesh.from_device_mesh(ctx.mesh))
    return m[1]


def _param(local: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(local.contiguous().clone())


def tp_mlp_fshard(ctx: Ctx) -> Prepared:
    """Megatron TP written as specs: W1 "(x h) k", W2 "k (x h)", one psum; no f/g operators."""
    mesh, W = _mesh(ctx), ctx.weights
    w1 = fs.Sharded(_param(ctx.shard(W["0.weight"], 0)), mesh, "(x h) k")
    b1 = fs.Sharded(_param(ctx.shard(W["0.bias"], 0)), mesh, "(x h)")
    w2 = fs.Sharded(_param(ctx.shard(W["2.weight"], 1)), mesh, "k (x h)")
    b2 = _param(W["2.bias"])
    x = ctx.data["x"].clone().requires_grad_(True)
    locals_ = [w1.local, b1.local, w2.local, b2]
    opt = ctx.make_optimizer(locals_)

    @fs.shard_map(mesh=mesh, in_specs=("b k", "(x h) k", "(x h)", "k (x h)", "k"), out_specs="b k")
    def mlp(x, w1, b1, w2, b2):
        return fs.psum(F.linear(F.gelu(F.linear(x, w1, b1)), w2), "x") + b2

    def step():
        for t in locals_:
            t.grad = None
        x.grad = None
        loss = mlp(x, w1, b1, w2, b2).sum()
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    def values(loss):
        out = {"loss": loss.detach(), "grad/x": x.grad}
        for n, p in zip(PARAM_NAMES, (w1, b1, w2)):
            out[f"grad/{n}"] = p.grad.full()
            if ctx.optim is not None:
                out[f"param/{n}"] = p.detach().full()
        out["grad/2.bias"] = b2.grad
        if ctx.optim is not None:
            out["param/2.bias"] = b2.detach()
        return out

    return Prepared(step, values, lambda: ctx.memory_state(locals_, opt))


def _flat(ctx: Ctx, pad_to: int = 1):
    W = ctx.weights
    shapes = [W[n].shape for n in PARAM_NAMES]
    sizes = [W[n].numel() for n in PARAM_NAMES]
    total = sum(sizes)
    padded = -(-total // pad_to) * pad_to
    flat = torch.zeros(padded)
    torch.cat([W[n].reshape(-1) for n in PARAM_NAMES], out=flat[:total])
    return flat, shapes, sizes, total


def _unflatten(flat, shapes, sizes, total):
    return [v.view(s) for v, s in zip(flat[:total].split(sizes), shapes)]


def dp_mlp_fshard(ctx: Ctx) -> Prepared:
    """Replicated flat parameters, batch "(x b) k", loss = pmean over x: one all_reduce of gradients."""
    mesh = _mesh(ctx)
    flat0, shapes, sizes, total = _flat(ctx)
    flat = _param(flat0)
    opt = ctx.make_optimizer([flat])
    x = ctx.data["x"]

    @fs.shard_map(mesh=mesh, in_specs=("n", "(x b) k"), out_specs="")
    def loss_fn(flat, x):
        flat = fs.pvary(flat, "x")  # one cast for all parameters: one gradient all_reduce
        return fs.pmean(mlp_forward(x, *_unflatten(flat, shapes, sizes, total)).mean(), "x")

    def step():
        flat.grad = None
        loss = loss_fn(flat, x)
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    def values(loss):
        out = {"loss": loss.detach()}
        out.update({f"grad/{n}": g for n, g in zip(PARAM_NAMES, _unflatten(flat.grad, shapes, sizes, total))})
        if ctx.optim is not None:
            out.update(
                {
                    f"param/{n}": p.detach()
                    for n, p in zip(PARAM_NAMES, _unflatten(flat, shapes, sizes, total))
                }
            )
        return out

    return Prepared(step, values, lambda: ctx.memory_state([flat], opt))


def fsdp_mlp_fshard(ctx: Ctx) -> Prepared:
    """Flat parameters split "(x n)": all_gather in f, and its transpose reduce-scatters the gradients."""
    mesh = _mesh(ctx)
    flat0, shapes, sizes, total = _flat(ctx, pad_to=ctx.world)
    shard = fs.shard(flat0, mesh, "(x n)")
    shard = fs.Sharded(_param(shard.local), mesh, shard.layout)
    opt = ctx.make_optimizer([shard.local])
    x = ctx.data["x"]

    @fs.shard_map(mesh=mesh, in_specs=("(x n)", "(x b) k"), out_specs="")
    def loss_fn(flat, x):
        full = fs.all_gather(flat, "x", tiled=True)
        return fs.pmean(mlp_forward(x, *_unflatten(full, shapes, sizes, total)).mean(), "x")

    def step():
        shard.local.grad = None
        loss = loss_fn(shard, x)
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    def values(loss):
        out = {"loss": loss.detach()}
        g = shard.grad.full()
        out.update({f"grad/{n}": t for n, t in zip(PARAM_NAMES, _unflatten(g, shapes, sizes, total))})
        if ctx.optim is not None:
            p = shard.detach().full()
            out.update({f"param/{n}": t for n, t in zip(PARAM_NAMES, _unflatten(p, shapes, sizes, total))})
        return out

    return Prepared(step, values, lambda: ctx.memory_state([shard.local], opt))


def shard_map_overhead_fshard(ctx: Ctx) -> Prepared:
    """``fs.shard_map(trivial_fn)`` on Sharded "(x r) c" inputs, returning Sharded outputs."""
    mesh = _mesh(ctx)
    n = ctx.params["n_inputs"]
    xs = [fs.Sharded(ctx.shard(ctx.data[f"in/{i}"], 0), mesh, "(x r) c") for i in range(n)]
    fn = fs.shard_map(trivial_fn, mesh=mesh, in_specs="(x r) c", out_specs="(x r) c")

    def step():
        return fn(*xs)

    def values(outs):
        return {f"out/{i}": o.full() for i, o in enumerate(outs)}

    return Prepared(step, values)


# ----------------------------------------------------------------------------------------------------------
# The demo's GPT (benchmarks/gpt.py): its loss under fs.shard_map with the layout's specs
# ----------------------------------------------------------------------------------------------------------


def _gpt_setup(ctx: Ctx):
    """The layout's specs, Sharded parameters (leaf locals that collect .grad) and the fshard mesh."""
    from fshard_demo.model import fsdp_dims, param_specs

    from . import gpt

    su = gpt.Setup(ctx)
    key = ("gpt", su.dp, su.tp)
    m = _MESHES.get(key)
    if m is None or m[0] is not su.dm:
        m = _MESHES[key] = (su.dm, fs.Mesh.from_device_mesh(su.dm))
    mesh = m[1]
    specs = param_specs(su.cfg, su.layout)
    flat_specs = gpt.from_tree(specs, su.cfg)
    flat = {}
    for n in gpt.names(su.cfg):
        s = fs.shard(ctx.weights[n], mesh, flat_specs[n])
        flat[n] = fs.Sharded(_param(s.local), mesh, s.layout)
    return su, mesh, specs, fsdp_dims(specs), flat


def _per_layer_loss(p, tokens, cfg, dims):
    """The demo's ``loss_fn`` with each block's parameters gathered (one ``fs.all_gather`` per leaf)
    just before the block runs, in a plain loop: per-block FSDP written the JAX way."""
    import torch.nn.functional as F

    from fshard_demo.model import block

    top = _gather_per_leaf(
        {k: v for k, v in p.items() if k != "blocks"}, {k: v for k, v in dims.items() if k != "blocks"}
    )
    n_ans = cfg.digits + 1
    t = tokens[:, :-1]
    x = top["wte"][t] + top["wpe"][: t.shape[1]]
    for blk, d in zip(p["blocks"], dims["blocks"]):
        x = block(_gather_per_leaf(blk, d), x, cfg)
    x = F.layer_norm(x, (cfg.d_model,), top["lnf_w"], top["lnf_b"])
    logits = (x @ top["w_out"])[:, -n_ans:]
    local = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, -n_ans:].reshape(-1))
    return fs.pmean(local, "dp")


def gpt_loss(ctx: Ctx, bucket_mb: float | None = None, gather=None, reshard: bool = False):
    """The layout's loss as ``f = fs.shard_map(loss_fn)``: ``(f, params, tokens, flat)``, called as
    ``f(params, tokens)``; ``flat`` maps every demo name to its ``Sharded`` parameter (whose local
    tensor collects ``.grad``). ``gather(params, dims)``: FSDP without ``fs.fsdp_scan`` (the split
    parameters gathered at the top of the step, then the demo's plain forward); ``reshard``: the body
    under ``fs.reshard_after_forward`` (gathered parameters freed after the forward, gathered again
    in the backward)."""
    from fshard_demo.model import loss_fn

    from . import gpt

    su, mesh, specs, dims, flat = _gpt_setup(ctx)
    cfg = su.cfg
    kw = {} if bucket_mb is None else {"bucket_mb": bucket_mb}
    if gather is None:
        body = lambda p, t: loss_fn(p, t, cfg, dims)  # noqa: E731
    elif gather == "per_layer":
        body = lambda p, t: _per_layer_loss(p, t, cfg, dims)  # noqa: E731
        if reshard:
            body = fs.reshard_after_forward()(body)
    else:
        body = lambda p, t: loss_fn(gather(p, dims), t, cfg)  # noqa: E731
        if reshard:
            body = fs.reshard_after_forward()(body)
    f = fs.shard_map(body, mesh=mesh, in_specs=(specs, "(dp b) t"), out_specs="", **kw)
    return f, gpt.to_tree(flat, cfg), su.tokens, flat


def _gpt_values(ctx: Ctx, grads):
    from . import gpt

    def values(loss):
        out = {"loss": gpt._loss_value(ctx, loss)}
        out.update({f"grad/{n}": g.full() if isinstance(g, fs.Sharded) else g for n, g in grads().items()})
        return out

    return values


def _gpt_backward(ctx: Ctx, bucket_mb: float | None) -> Prepared:
    """``loss = shard_map(loss_fn)(params, tokens); loss.backward()``: gradients land in each parameter's
    local ``.grad`` (the data-parallel ones reduced in buckets of ``bucket_mb``)."""
    f, params, tokens, flat = gpt_loss(ctx, bucket_mb=bucket_mb)
    locals_ = [p.local for p in flat.values()]
    opt = ctx.make_optimizer(locals_)

    def step():
        for t in locals_:
            t.grad = None
        loss = f(params, tokens)
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    values = _gpt_values(ctx, lambda: {n: p.grad for n, p in flat.items()})
    return Prepared(step, values, lambda: ctx.memory_state(locals_, opt))


def gpt_fshard(ctx: Ctx) -> Prepared:
    """The demo's loss under ``fs.shard_map`` (default ``bucket_mb``), ``loss.backward()``."""
    return _gpt_backward(ctx, None)


def gpt_fshard_nobucket(ctx: Ctx) -> Prepared:
    """The same with ``bucket_mb=0``: one gradient all-reduce per parameter, as backward reaches it."""
    return _gpt_backward(ctx, 0)


def gpt_fshard_vg(ctx: Ctx) -> Prepared:
    """The demo's own step (``fshard_demo.train.make_train_step`` without the optimizer):
    ``fs.value_and_grad(loss_fn)`` inside ``fs.shard_map``, gradients returned with the parameters' specs."""
    from fshard_demo.model import loss_fn

    from . import gpt

    su, mesh, specs, dims, flat = _gpt_setup(ctx)
    cfg = su.cfg
    params = gpt.to_tree({n: p.detach() for n, p in flat.items()}, cfg)
    if ctx.optim is not None:
        raise NotImplementedError("the value_and_grad step returns gradients; no torch optimizer here")
    grad_step = fs.shard_map(
        lambda p, t: fs.value_and_grad(loss_fn)(p, t, cfg, dims),
        mesh=mesh,
        in_specs=(specs, "(dp b) t"),
        out_specs=("", specs),
    )
    tokens = su.tokens
    last: dict = {}

    def step():
        loss, grads = grad_step(params, tokens)
        last["grads"] = grads
        return loss

    values = _gpt_values(ctx, lambda: gpt.from_tree(last["grads"], cfg))
    return Prepared(step, values)


def _gpt_gathered(ctx: Ctx, gather, reshard: bool = False) -> Prepared:
    """FSDP written without ``fs.fsdp_scan``: ``gather(params, dims)`` all-gathers the split parameters
    at the top of the step, then the demo's plain forward; ``loss.backward()``."""
    f, params, tokens, flat = gpt_loss(ctx, gather=gather, reshard=reshard)
    locals_ = [p.local for p in flat.values()]
    opt = ctx.make_optimizer(locals_)

    def step():
        for t in locals_:
            t.grad = None
        loss = f(params, tokens)
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    values = _gpt_values(ctx, lambda: {n: p.grad for n, p in flat.items()})
    return Prepared(step, values, lambda: ctx.memory_state(locals_, opt))


def _gather_per_leaf(p, dims):
    """The program a JAX user writes first: one ``fs.all_gather`` per parameter (fshard combines them)."""
    import optree

    return optree.tree_map(lambda t, d: t if d < 0 else fs.all_gather(t, "dp", dim=d, tiled=True), p, dims)


def gpt_fshard_leaf(ctx: Ctx) -> Prepared:
    """FSDP one leaf at a time: ``optree.tree_map(lambda p: fs.all_gather(p, "dp", ...), params)``."""
    return _gpt_gathered(ctx, _gather_per_leaf)


def _with_env(prepared: Prepared, name: str, value: str) -> Prepared:
    """``prepared`` whose step runs with the environment variable ``name`` set to ``value``."""
    import os

    inner = prepared.step

    def step():
        old = os.environ.get(name)
        os.environ[name] = value
        try:
            return inner()
        finally:
            if old is None:
                del os.environ[name]
            else:
                os.environ[name] = old

    return Prepared(step, prepared.values, prepared.state)


def gpt_fshard_leaf_nocombine(ctx: Ctx) -> Prepared:
    """The same with combining off (``FSHARD_COMBINE=0``): one all_gather and one reduce_scatter per leaf."""
    return _with_env(_gpt_gathered(ctx, _gather_per_leaf), "FSHARD_COMBINE", "0")


def gpt_fshard_leaf_sync(ctx: Ctx) -> Prepared:
    """Combined without overlap (``FSHARD_COMBINE_AHEAD=0``): a flush runs its buckets and waits."""
    return _with_env(_gpt_gathered(ctx, _gather_per_leaf), "FSHARD_COMBINE_AHEAD", "0")


def gpt_fshard_tree(ctx: Ctx) -> Prepared:
    """FSDP with the pytree form: one ``fs.all_gather`` of all split parameters (``unshard``)."""
    from fshard_demo.model import unshard

    return _gpt_gathered(ctx, unshard)


def gpt_fshard_leaf_reshard(ctx: Ctx) -> Prepared:
    """``fshard_leaf`` under ``fs.reshard_after_forward``: the gathered parameters freed after the
    forward and gathered again in the backward, as FSDP2's ``reshard_after_forward=True``."""
    return _gpt_gathered(ctx, _gather_per_leaf, reshard=True)


def gpt_fshard_tree_reshard(ctx: Ctx) -> Prepared:
    """``fshard_tree`` under ``fs.reshard_after_forward``."""
    from fshard_demo.model import unshard

    return _gpt_gathered(ctx, unshard, reshard=True)


def gpt_fshard_layer(ctx: Ctx) -> Prepared:
    """Per-block FSDP written the JAX way: each block's leaves gathered one at a time (combined)
    right before the block, in a plain loop; autograd keeps the gathered blocks for the backward."""
    return _gpt_gathered(ctx, "per_layer")


def gpt_fshard_layer_reshard(ctx: Ctx) -> Prepared:
    """``fshard_layer`` under ``fs.reshard_after_forward``: each block's gathered parameters freed
    after its forward and gathered again in the backward (FSDP2 per block's pattern)."""
    return _gpt_gathered(ctx, "per_layer", reshard=True)
