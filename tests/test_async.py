"""Asynchronous collectives (``async_op=True`` + ``Pending.wait()``), on real gloo ranks.

Each program computes with a started collective in flight, then waits; values and gradients are
compared with plain torch on the global tensors in one process, and the collectives issued with
those of the synchronous form.
"""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks

N = 4


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _rank_async(kind, X, W, async_op):
    mesh = fs.Mesh(tp=N)
    x, w = X.clone().requires_grad_(True), W.clone().requires_grad_(True)

    def f(x, w):
        if kind == "ppermute":
            pend = fs.ppermute(x, "tp", [(i, (i + 1) % N) for i in range(N)], async_op=async_op)
        elif kind == "ppermute_pair":
            pend = fs.ppermute(x, "tp", [(0, 2)], async_op=async_op)
        elif kind == "all_gather":
            pend = fs.all_gather(x, "tp", dim=0, tiled=True, async_op=async_op)
        elif kind == "all_gather_stacked":
            pend = fs.all_gather(x, "tp", dim=1, async_op=async_op)
        elif kind == "psum_scatter":
            pend = fs.psum_scatter(x.repeat(N, 1) * 1.5, "tp", dim=0, tiled=True, async_op=async_op)
        local = torch.tanh(x @ w)  # computed while the transfer is in flight
        y = pend.wait() if async_op else pend
        assert pend.wait() is y if async_op else True  # a second wait returns the same tensor
        return (y.reshape(-1).sum() * local.sum()).reshape(1)

    with fs.count_collectives() as counts:
        out = fs.shard_map(f, mesh=mesh, in_specs=("(tp b) d", "d e"), out_specs="(tp r)")(x, w)
        out.full().pow(2).sum().backward()
    return out.full().detach(), x.grad, w.grad, sorted(counts.records)


def _reference(kind, X, W):
    x, w = X.clone().requires_grad_(True), W.clone().requires_grad_(True)
    xs = x.split(X.shape[0] // N)
    outs = []
    for r in range(N):
        if kind == "ppermute":
            y = xs[(r - 1) % N]
        elif kind == "ppermute_pair":
            y = xs[0] if r == 2 else torch.zeros_like(xs[0])
        elif kind in ("all_gather", "all_gather_stacked"):
            y = x
        elif kind == "psum_scatter":
            y = sum(xs) * 1.5
        local = torch.tanh(xs[r] @ w)
        outs.append((y.reshape(-1).sum() * local.sum()).reshape(1))
    full = torch.cat(outs)
    full.pow(2).sum().backward()
    return full.detach(), x.grad, w.grad


KINDS = ["ppermute", "ppermute_pair", "all_gather", "all_gather_stacked", "psum_scatter"]


@pytest.mark.parametrize("kind", KINDS)
def test_async_matches_reference_and_sync(kind):
    X, W = _randn(0, 8, 3), _randn(1, 3, 2)
    want = _reference(kind, X, W)
    got_async = run_ranks(N, _rank_async, kind, X, W, True)
    got_sync = run_ranks(N, _rank_async, kind, X, W, False)
    for r, (a, s) in enumerate(zip(got_async, got_sync)):
        for name, g, ref in zip(("value", "grad x", "grad w"), a[:3], want):
            torch.testing.assert_close(g, ref, msg=f"rank {r} {name}")
        assert a[3] == s[3], f"rank {r}: async issued {a[3]}, sync {s[3]}"


def _rank_async_errors(which):
    mesh = fs.Mesh(tp=2)

    def f(x):
        if which == "tree":
            fs.ppermute({"a": x}, "tp", [(0, 1), (1, 0)], async_op=True)
        else:
            fs.all_gather(x, "tp", invariant=True, async_op=True)
        return x

    try:
        fs.shard_map(f, mesh=mesh, in_specs="(tp b)", out_specs="(tp b)")(torch.ones(4))
    except fs.CollectiveError as e:
        return str(e)
    return "no error"


def test_async_errors():
    assert (
        run_ranks(2, _rank_async_errors, "tree")
        == ["fs.ppermute: async_op=True takes a single tensor, not a pytree; start one per leaf"] * 2
    )
    assert (
        run_ranks(2, _rank_async_errors, "invariant")
        == [
            "fs.all_gather: async_op=True is not supported with invariant=True; gather asynchronously "
            "without it, or synchronously with invariant=True"
        ]
        * 2
    )
