"""fs.value_and_grad and fs.grad over pytrees of parameters, outside and inside shard_map.

A Megatron MLP on a dp x tp mesh with nested parameters (Sharded and plain leaves), auxiliary
outputs and several argnums; values, gradients (their structure, type and spec) and the exact
collectives are compared with plain torch on the global tensors. Every case runs on real gloo
ranks and returns its list of problems (see helpers.py).
"""

from __future__ import annotations

import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, check_counts, close, expected_counts, full, mse, randn

_VG_SPECS = {"mlp": {"w1": "k (tp n)", "b1": "(tp n)"}, "w2": "(tp n) k", "b2": "k"}


def _vg_params(dtype=torch.float64):
    return {
        "mlp": {"w1": randn(3, 4, 4, dtype=dtype) / 2, "b1": randn(4, 4, dtype=dtype) * 0.1},
        "w2": randn(5, 4, 4, dtype=dtype) / 2,
        "b2": randn(6, 4, dtype=dtype) * 0.1,
    }


def _vg_loss(p, x, y, psum=lambda h: h, pmean=lambda v: v):
    h = torch.nn.functional.gelu(x @ p["mlp"]["w1"] + p["mlp"]["b1"]) @ p["w2"]
    return pmean(mse(psum(h) + p["b2"], y))


def _vg_reference(x, y):
    import optree

    params = optree.tree_map(lambda t: t.clone().requires_grad_(True), _vg_params())
    xr = x.clone().requires_grad_(True)
    loss = _vg_loss(params, xr, y)
    leaves = optree.tree_leaves(params)
    grads = torch.autograd.grad(loss, leaves + [xr])
    return loss, optree.tree_unflatten(optree.tree_structure(params), list(grads[:-1])), grads[-1]


def _value_and_grad_outside():
    import optree

    import fshard as fs

    mesh = fs.Mesh(dp=2, tp=2)
    errs: list[str] = []
    x, y = randn(1, 4, 4, dtype=torch.float64), randn(2, 4, 4, dtype=torch.float64)
    raw = _vg_params()
    params = {
        "mlp": {k: fs.shard(v, mesh, _VG_SPECS["mlp"][k]) for k, v in raw["mlp"].items()},
        "w2": fs.shard(raw["w2"], mesh, _VG_SPECS["w2"]),
        "b2": raw["b2"],  # replicated: a plain tensor
    }
    loss_fn = fs.shard_map(
        lambda p, x, y: _vg_loss(p, x, y, lambda h: fs.psum(h, "tp"), lambda v: fs.pmean(v, "dp")),
        mesh=mesh,
        in_specs=(_VG_SPECS, "(dp b) k", "(dp b) k"),
        out_specs="",
    )

    def with_aux(p, x, y):
        loss = loss_fn(p, x, y)
        return loss, {"twice": 2 * loss}

    with fs.count_collectives() as counts:
        (loss, aux), (grads, gx) = fs.value_and_grad(with_aux, argnums=(0, 1), has_aux=True)(params, x, y)
    ref_loss, ref_grads, ref_gx = _vg_reference(x, y)
    close(errs, "loss", loss, ref_loss, torch.float64)
    close(errs, "aux", aux["twice"], 2 * ref_loss, torch.float64)
    if loss.requires_grad:
        errs.append("value_and_grad returned a value that still requires grad")
    if optree.tree_structure(grads) != optree.tree_structure(params):
        errs.append(
            f"grads structure {optree.tree_structure(grads)} != params {optree.tree_structure(params)}"
        )
    for path, g, p, r in zip(
        optree.tree_paths(grads),
        optree.tree_leaves(grads),
        optree.tree_leaves(params),
        optree.tree_leaves(ref_grads),
    ):
        if isinstance(p, fs.Sharded) != isinstance(g, fs.Sharded):
            errs.append(f"grad {path}: {type(g).__name__} for a {type(p).__name__} parameter")
        elif isinstance(p, fs.Sharded) and g.spec != p.spec:
            errs.append(f"grad {path}: spec {g.spec!r} != parameter spec {p.spec!r}")
        close(errs, f"grad {path}", full(g), r, torch.float64)
    close(errs, "grad x (plain split input: full gradient)", gx, ref_gx, torch.float64)
    e = 8
    want = expected_counts(
        mesh,
        [("all_reduce", ("tp",), 2 * 4 * e), ("all_reduce", ("dp",), e)]
        # the parameters' gradients, in one bucket (local sizes 8, 2, 8, 4)
        + [("all_reduce", ("dp",), sum((8, 2, 8, 4)) * e)]
        # x meets tp-split weights: its gradient is summed over tp
        + [("all_reduce", ("tp",), 2 * 4 * e)]
        # x is a plain split input: its full gradient is gathered
        + [("all_gather", ("dp",), 2 * 4 * e)],
    )
    check_counts(errs, "value_and_grad", counts, want)
    return errs


def test_value_and_grad_pytree_outside():
    assert_ok(run_ranks(4, _value_and_grad_outside))


def _value_and_grad_inside():
    import optree

    import fshard as fs

    mesh = fs.Mesh(dp=2, tp=2)
    errs: list[str] = []
    x, y = randn(1, 4, 4, dtype=torch.float64), randn(2, 4, 4, dtype=torch.float64)

    def step(p, x, y):
        def loss_fn(p, x):
            loss = _vg_loss(p, x, y, lambda h: fs.psum(h, "tp"), lambda v: fs.pmean(v, "dp"))
            return loss, loss.detach() * 2

        (loss, aux), (grads, gx) = fs.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(p, x)
        g_only = fs.grad(lambda p: loss_fn(p, x)[0])(p)
        return loss, aux, grads, gx, g_only

    f = fs.shard_map(
        step,
        mesh=mesh,
        in_specs=(_VG_SPECS, "(dp b) k", "(dp b) k"),
        out_specs=("", "", _VG_SPECS, "(dp b) k", _VG_SPECS),
    )
    with fs.count_collectives() as counts:
        loss, aux, grads, gx, g_only = f(_vg_params(), x, y)
    ref_loss, ref_grads, ref_gx = _vg_reference(x, y)
    e = 8
    fwd = [("all_reduce", ("tp",), 2 * 4 * e), ("all_reduce", ("dp",), e)]
    per_param = [("all_reduce", ("dp",), sum((8, 2, 8, 4)) * e)]  # the parameters' gradients: one bucket
    x_grad = [("all_reduce", ("tp",), 2 * 4 * e)]
    # value_and_grad (params and x), then fs.grad (params only)
    check_counts(errs, "inside", counts, expected_counts(mesh, 2 * fwd + 2 * per_param + x_grad))
    close(errs, "loss", loss, ref_loss, torch.float64)
    close(errs, "aux", aux, 2 * ref_loss, torch.float64)
    for name, tree in (("value_and_grad", grads), ("grad", g_only)):
        for path, g, r in zip(
            optree.tree_paths(tree), optree.tree_leaves(tree), optree.tree_leaves(ref_grads)
        ):
            close(errs, f"{name} {path}", full(g), r, torch.float64)
    close(errs, "grad x", full(gx), ref_gx, torch.float64)
    return errs


def test_value_and_grad_pytree_inside():
    assert_ok(run_ranks(4, _value_and_grad_inside))
