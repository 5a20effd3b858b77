"""Replicated values meeting split ones inside f: the gradient of the implicit pvary.

A replicated (invariant) input that meets a split (varying) value is cast to varying once per
distinct tensor; the backward of that cast is one all_reduce of its gradient. These cases pin the
gradient (the worked case of the gradients tutorial: sum(y) + 1, not sum(y) + N) and the exact
number of those all_reduces when a tensor is used twice or sliced. Every case runs on real gloo ranks and
returns its list of problems (see helpers.py).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, check_counts, close, randn


def _worked_explicit():
    """d/dx [psum(x * y, "dp") + x] = sum(y) + 1 (not sum(y) + N), on both gradient paths."""
    import fshard as fs

    mesh = fs.Mesh(dp=4)
    errs: list[str] = []
    x, y = randn(1, 3, dtype=torch.float64), randn(2, 8, 3, dtype=torch.float64)
    want = y.sum(0) + 1

    def body(x, y):
        return fs.psum((x * y).sum(0), "dp") + x

    # (a) inside f, with fs.value_and_grad and with torch.autograd.grad
    def inside(x, y):
        _, g1 = fs.value_and_grad(lambda x: body(x, y).sum())(x)
        xr = x.detach().requires_grad_(True)
        (g2,) = torch.autograd.grad(body(xr, y).sum(), xr)
        return g1, g2

    g1, g2 = fs.shard_map(inside, mesh=mesh, in_specs=("d", "(dp n) d"), out_specs=("d", "d"))(x, y)
    close(errs, "inside value_and_grad", g1, want, torch.float64)
    close(errs, "inside autograd.grad", g2, want, torch.float64)
    # (b) outside, on the global function
    f = fs.shard_map(body, mesh=mesh, in_specs=("d", "(dp n) d"), out_specs="d")
    xg = x.clone().requires_grad_(True)
    f(xg, y).sum().backward()
    close(errs, "outside .backward()", xg.grad, want, torch.float64)
    _, g3 = fs.value_and_grad(lambda x: f(x, y).sum())(x)
    close(errs, "outside fs.value_and_grad", g3, want, torch.float64)
    if torch.allclose(xg.grad, y.sum(0) + 4):
        errs.append("outside gradient is sum(y) + N")
    return errs


def test_worked_case_gradient_is_sum_plus_one():
    assert_ok(run_ranks(4, _worked_explicit))


def _tied_weights(transposed):
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    errs: list[str] = []
    w, x = randn(1, 3, 3), randn(2, 4, 3)

    def body(w, x):
        h = torch.tanh(x @ w)
        h = torch.tanh(h @ w)  # the same tensor again: the cached cast is reused
        if transposed:
            h = h @ w.T  # w.T is a new tensor, an invariant function of w: cast through w's twin
        return h

    f = fs.shard_map(
        lambda w, x: fs.pmean(body(w, x).pow(2).mean(), "dp"),
        mesh=mesh,
        in_specs=("d e", "(dp b) d"),
        out_specs="",
    )
    wg = w.clone().requires_grad_(True)
    loss = f(wg, x)
    with fs.count_collectives() as bwd:
        loss.backward()
    wr = w.clone().requires_grad_(True)
    body(wr, x).pow(2).mean().backward()
    close(errs, "grad w", wg.grad, wr.grad, torch.float32)
    # Hand-written minimum: one all_reduce of w's gradient. w is an input, so the casts of w
    # and of w.T both go through its twin and its gradient is reduced once, in the bucket.
    check_counts(errs, "backward", bwd, Counter({("all_reduce", ("dp",), 36): 1}))
    return errs


@pytest.mark.parametrize("transposed", [False, True], ids=["same-tensor", "with-transpose"])
def test_replicated_weight_used_twice(transposed):
    assert_ok(run_ranks(2, _tied_weights, transposed))


def _sliced_per_microbatch(explicit):
    """A replicated input indexed per microbatch (x[t]) meets split weights once per slice."""
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    errs: list[str] = []
    x, w = randn(1, 3, 2, 4), randn(2, 4, 4)

    def body(x, w):
        if explicit:
            x = fs.pvary(x, "dp")  # one cast of the whole tensor: one all_reduce of its gradient
        return fs.psum(sum((x[t] @ w).sum() for t in range(3)), "dp")

    f = fs.shard_map(body, mesh=mesh, in_specs=("m b d", "d (dp e)"), out_specs="")
    xg = x.clone().requires_grad_(True)
    out = f(xg, w)
    with fs.count_collectives() as bwd:
        out.backward()
    xr = x.clone().requires_grad_(True)
    sum((xr[t] @ w).sum() for t in range(3)).backward()
    close(errs, "grad x", xg.grad, xr.grad, torch.float32)
    # Hand-written minimum: one all_reduce of x's whole gradient (3 * 2 * 4 floats). Implicitly,
    # each slice x[t] is cast through x's twin (x is an input), so x's gradient is reduced once.
    want = {("all_reduce", ("dp",), 96): 1}
    check_counts(errs, "backward", bwd, Counter(want))
    return errs


@pytest.mark.parametrize("explicit", [False, True], ids=["implicit", "explicit-pvary"])
def test_replicated_input_sliced_per_microbatch(explicit):
    assert_ok(run_ranks(2, _sliced_per_microbatch, explicit))
