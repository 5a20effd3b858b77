"""``fs.remat``: recomputation in the backward re-enters the shard_map call (FSDP per layer).

An FSDP MLP (parameters stored split over dp, gathered per layer inside f) is differentiated with
and without ``fs.remat`` around each layer; values and gradients are compared with plain torch on
the global tensors in one process, the collectives are counted (the recomputation gathers again),
and the bytes kept for the backward are measured with saved-tensor hooks.
"""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks

D, L = 16, 3


def _weights():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(D, D, generator=g, dtype=torch.float64) * 0.3 for _ in range(L)]


def _layer(w_shard, h):
    w = fs.all_gather(w_shard, "dp", dim=0, tiled=True)
    return torch.tanh(h @ w)


def _rank_fsdp(X, use_remat):
    mesh = fs.Mesh(dp=4)
    ws = [fs.shard(w, mesh, "(dp i) o").requires_grad_(True) for w in _weights()]
    layer = fs.remat(_layer) if use_remat else _layer

    def f(ws, x):
        h = x
        for w in ws:
            h = layer(w, h)
        return fs.pmean(h.pow(2).mean(), "dp")

    step = fs.shard_map(f, mesh=mesh, in_specs=("(dp i) o", "(dp b) i"), out_specs="")
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with fs.count_collectives() as fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step(ws, X)
    with fs.count_collectives() as bwd:
        loss.backward()
    return loss.detach(), [w.grad.full() for w in ws], fwd.by_kind(), bwd.by_kind(), sum(saved)


@pytest.mark.parametrize("use_remat", [False, True])
def test_remat_fsdp_layers(use_remat):
    X = torch.randn(8, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ws = [w.clone().requires_grad_(True) for w in _weights()]
    h = X
    for w in ws:
        h = torch.tanh(h @ w)
    ref = h.pow(2).mean()
    ref_grads = torch.autograd.grad(ref, ws)
    results = run_ranks(4, _rank_fsdp, X, use_remat)
    for loss, grads, fwd, bwd, _ in results:
        torch.testing.assert_close(loss, ref.detach())
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r)
        assert fwd[("all_gather", ("dp",))] == L
        assert bwd[("reduce_scatter", ("dp",))] == L
        assert bwd[("all_gather", ("dp",))] == (L if use_remat else 0)  # gathered again to recompute


def test_remat_keeps_less_for_the_backward():
    X = torch.randn(8, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    plain = run_ranks(4, _rank_fsdp, X, False)[0][4]
    remat = run_ranks(4, _rank_fsdp, X, True)[0][4]
    # without remat, every layer after the first keeps its gathered weight (D*D float64) for the
    # backward; with remat only the inputs of each layer (a quarter of the weight, activations) stay
    gathered = (L - 1) * D * D * 8
    assert plain >= gathered and remat < gathered, (plain, remat)
