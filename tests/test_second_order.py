"""Second order through shard_map: Hessian-vector products of a data-parallel loss.

Inside f (autograd with create_graph, and torch.func.grad of grad) and from outside, compared with
plain torch on the global tensors. Runs on real gloo ranks and returns its list of problems (see
helpers.py).
"""

from __future__ import annotations

import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, randn


def _hvp():
    """Second order: Hessian-vector products of a data-parallel loss, inside f and from outside."""
    import fshard as fs

    errs: list[str] = []
    dt = torch.float64
    mesh = fs.Mesh(dp=2)
    w, x, v = randn(1, 3, dtype=dt), randn(2, 4, 3, dtype=dt), randn(3, 3, dtype=dt)

    def loss_local(w, x):
        return fs.pmean((torch.tanh(x @ w) ** 2).mean(), "dp")

    wr = w.clone().requires_grad_(True)
    (gr,) = torch.autograd.grad((torch.tanh(x @ wr) ** 2).mean(), wr, create_graph=True)
    (ref,) = torch.autograd.grad((gr * v).sum(), wr)

    def inside(w, x, v):
        w = w.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(loss_local(w, x), w, create_graph=True)
        (hv,) = torch.autograd.grad((g * v).sum(), w)
        hv2 = torch.func.grad(lambda w: (torch.func.grad(lambda w: loss_local(w, x))(w) * v).sum())(
            w.detach()
        )
        return hv, hv2

    hv, hv2 = fs.shard_map(inside, mesh=mesh, in_specs=("d", "(dp b) d", "d"), out_specs=("d", "d"))(w, x, v)
    close(errs, "hvp inside (autograd, create_graph)", hv, ref, dt)
    close(errs, "hvp inside (torch.func.grad of grad)", hv2, ref, dt)
    f = fs.shard_map(loss_local, mesh=mesh, in_specs=("d", "(dp b) d"), out_specs="")
    wg = w.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(wg, x), wg, create_graph=True)
    (hv,) = torch.autograd.grad((g * v).sum(), wg)
    close(errs, "hvp outside", hv, ref, dt)
    return errs


def test_hessian_vector_product():
    assert_ok(run_ranks(2, _hvp))
