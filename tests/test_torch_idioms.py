"""Plain torch autograd idioms with shard_map: they behave as they do in one process.

loss.backward() inside f, gradients accumulated over several calls, torch.func over a whole
shard_map'd function (plain and Sharded inputs), and an in-place SGD loop inside one call. Every
case runs on real gloo ranks and returns its list of problems (see helpers.py); the programs are
those of the matrix (programs.py).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, check_counts, close, expected_counts, full, randn
from tests.programs import PROGRAMS


def _grad_accumulation():
    """Two microbatches, two calls, two .backward(): gradients accumulate like plain torch."""
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    errs: list[str] = []
    c = PROGRAMS["dp_mlp"](mesh, torch.float32)
    params = {k: c.inputs[k].clone().requires_grad_(True) for k in c.diff}
    ref = {k: c.inputs[k].clone().requires_grad_(True) for k in c.diff}
    f = fs.shard_map(c.local, mesh=mesh, in_specs=(c.specs,), out_specs="")
    with fs.count_collectives() as counts:
        for mb in range(2):
            xb, yb = randn(30 + mb, 4, 4), randn(40 + mb, 4, 3)
            f({**params, "x": xb, "y": yb}).backward()
            c.ref({**ref, "x": xb, "y": yb}).backward()
    for k in c.diff:
        close(errs, f"accumulated grad {k}", params[k].grad, ref[k].grad, torch.float32)
    # per call: the loss's all-reduce, and one bucket holding every parameter's gradient
    want = Counter({("all_reduce", ("dp",), 4): 2})
    want[("all_reduce", ("dp",), sum(c.inputs[k].numel() * 4 for k in c.diff))] += 2
    check_counts(errs, "two steps", counts, want)
    return errs


def test_gradient_accumulation_over_calls():
    assert_ok(run_ranks(2, _grad_accumulation))


def _backward_inside(prog):
    """loss.backward() inside f; p.grad is returned with the parameter's spec."""
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    errs: list[str] = []
    c = PROGRAMS[prog](mesh, torch.float32)

    def inside(t):
        t = dict(t)
        for k in c.diff:
            t[k] = t[k].detach().requires_grad_(True)
        loss = c.local(t)
        loss.backward()
        return loss.detach(), {k: t[k].grad for k in c.diff}

    f = fs.shard_map(inside, mesh=mesh, in_specs=(c.specs,), out_specs=("", {k: c.specs[k] for k in c.diff}))
    with fs.count_collectives() as counts:
        loss, grads = f(c.inputs)
    check_counts(
        errs, "forward+backward", counts, expected_counts(mesh, c.fwd) + expected_counts(mesh, c.bwd)
    )
    ref_in = {k: v.clone().requires_grad_(k in c.diff) for k, v in c.inputs.items()}
    ref_loss = c.ref(ref_in)
    ref_loss.backward()
    close(errs, "loss", loss, ref_loss, torch.float32)
    for k in c.diff:
        close(errs, f"grad {k}", full(grads[k]), ref_in[k].grad, torch.float32)
    return errs


@pytest.mark.parametrize("prog", ["dp_mlp", "fsdp"])
def test_loss_backward_inside_f(prog):
    assert_ok(run_ranks(2, _backward_inside, prog))


# -- torch.func over a whole shard_map'd function ---------------------------------------------


def _torch_func_outside():
    """torch.func.grad / vjp of a whole shard_map'd function, from outside."""
    import fshard as fs

    errs: list[str] = []
    dt = torch.float64
    mesh = fs.Mesh(dp=2)
    x, y = randn(1, 3, dtype=dt), randn(2, 4, 3, dtype=dt)
    f = fs.shard_map(
        lambda x, y: fs.psum((x * y).sum(0), "dp") + x, mesh=mesh, in_specs=("d", "(dp n) d"), out_specs="d"
    )
    try:
        g = torch.func.grad(lambda x: f(x, y).sum())(x)
        close(errs, "torch.func.grad (worked case)", g, y.sum(0) + 1, dt)
        ct = randn(3, 3, dtype=dt)
        out, vjp = torch.func.vjp(f, x, y)
        gx, gy = vjp(ct)
        close(errs, "torch.func.vjp value", out, (x * y).sum(0) + x, dt)
        close(errs, "torch.func.vjp x", gx, (ct * y).sum(0) + ct, dt)
        close(errs, "torch.func.vjp y (plain split input: full gradient)", gy, (ct * x).expand(4, 3), dt)
    except Exception as e:  # noqa: BLE001  (report, same on every rank)
        errs.append(
            f"torch.func over a shard_map'd function with plain inputs raised {type(e).__name__}: {e}"
        )

    # Megatron MLP with Sharded parameters: differentiate the local blocks through Sharded wrappers
    tmesh = fs.Mesh(tp=2)
    c = PROGRAMS["tp_mlp"](tmesh, dt)
    tp = fs.shard_map(c.local, mesh=tmesh, in_specs=(c.specs,), out_specs=c.out_spec)
    sh = {k: fs.shard(c.inputs[k], tmesh, c.specs[k]) for k in ("w1", "b1", "w2")}
    ct = randn(99, 3, 4, dtype=dt)
    ref_in = {k: v.clone().requires_grad_(True) for k, v in c.inputs.items()}
    ref_g = torch.autograd.grad(c.ref(ref_in), [ref_in["w1"], ref_in["w2"]], ct)

    def global_fn(w1_local, w2_local):
        args = dict(
            c.inputs,
            b1=sh["b1"],
            w1=fs.Sharded(w1_local, tmesh, sh["w1"].layout),
            w2=fs.Sharded(w2_local, tmesh, sh["w2"].layout),
        )
        return tp(args)

    try:
        out, vjp = torch.func.vjp(global_fn, sh["w1"].local, sh["w2"].local)
        g1, g2 = vjp(ct)
        close(errs, "torch.func.vjp tp value", out, c.ref(c.inputs), dt)
        close(errs, "torch.func.vjp tp w1", fs.Sharded(g1, tmesh, sh["w1"].layout).full(), ref_g[0], dt)
        close(errs, "torch.func.vjp tp w2", fs.Sharded(g2, tmesh, sh["w2"].layout).full(), ref_g[1], dt)
    except Exception as e:  # noqa: BLE001
        errs.append(f"torch.func.vjp through Sharded inputs raised {type(e).__name__}: {e}")
    return errs


def test_torch_func_through_whole_shard_map():
    assert_ok(run_ranks(2, _torch_func_outside))


# -- in-place updates inside f -----------------------------------------------------------------


def _inplace_sgd_loop_inside():
    """Several SGD steps inside one shard_map call, updating the weight in place under no_grad.

    Plain torch code; it must behave as it does in one process.
    """
    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(dp=2)
    w0, x, y = randn(1, 3, 2), randn(2, 4, 3), randn(3, 4, 2)

    def train(w, x, y):
        w = w.detach().requires_grad_(True)
        for _ in range(3):
            loss = fs.pmean(((x @ w - y) ** 2).mean(), "dp")
            (g,) = torch.autograd.grad(loss, w)
            with torch.no_grad():
                w.sub_(0.1 * g)
        return w.detach()

    f = fs.shard_map(train, mesh=mesh, in_specs=("d o", "(dp b) d", "(dp b) o"), out_specs="d o")
    # As in plain torch, f's `w.detach()` shares storage with the caller's w0 (inputs are
    # passed as views, never copied), so the in-place updates reach w0: keep a copy.
    w0 = w0.clone()
    start = w0.clone()
    try:
        got = f(w0, x, y)
    except RuntimeError as e:
        errs.append(f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return errs
    w = start.requires_grad_(True)
    for _ in range(3):
        (g,) = torch.autograd.grad(((x @ w - y) ** 2).mean(), w)
        with torch.no_grad():
            w.sub_(0.1 * g)
    close(errs, "trained w", got, w, torch.float32)
    return errs


def test_inplace_weight_update_loop_inside_f():
    assert_ok(run_ranks(2, _inplace_sgd_loop_inside))
