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

from .common import Ctx, Prepared  # noqa: F401  (the signature the functions below use)

tp_mlp_fshard = None
dp_mlp_fshard = None
fsdp_mlp_fshard = None
shard_map_overhead_fshard = None
