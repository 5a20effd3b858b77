"""Idioms of shard_map'd code under plain ``torch.compile(fullgraph=True)``, against eager and one
process: dividing by ``fs.axis_size`` (a plain int taken from the mesh's shape; it was an attribute
of a trace-time axis group, which Dynamo could not hold: InternalTorchDynamoError), and a residual
around a psum inside ``fs.remat`` with Dynamo's checkpoint setting left as it was (fshard sets
``skip_fwd_side_effects_in_bwd_under_checkpoint`` itself while tracing the region; it raised a
TracingError asking the user to). Values and gradients of a weighted sum, on a 2-axis mesh.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, randn

ROWS, D = 8, 4


def _rank_idioms():
    import fshard as fs

    torch._dynamo.reset()
    mesh = fs.Mesh(dp=2, tp=2)
    programs = {
        "x @ w / axis_size": (
            lambda w, x: (x @ w) / fs.axis_size(("dp", "tp")),
            lambda W, X: (X @ W) / 4,
        ),
        "remat residual around psum": (
            lambda w, x: fs.remat(lambda w, h: h + fs.psum(torch.tanh(h @ w), "tp") / 2)(w, x),
            lambda W, X: X + torch.tanh(X @ W),
        ),
    }
    W, X = randn(0, D, D) / 2, randn(1, ROWS, D)
    weights = torch.linspace(0.5, 1.5, ROWS * D).view(ROWS, D)

    def run(fn):
        w, x = W.clone().requires_grad_(), X.clone().requires_grad_()
        y = fn(w, x)
        y = fs.full(y) if isinstance(y, fs.Sharded) else y
        return (y.detach(), *torch.autograd.grad((y * weights).sum(), (w, x)))

    errs: list[str] = []
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
        for name, (body, ref) in programs.items():
            f = fs.shard_map(body, mesh=mesh, in_specs=("...", "(dp b) d"), out_specs="(dp b) d")
            want, eager = run(ref), run(f)
            got = run(torch.compile(f, backend="aot_eager", fullgraph=True))
            for what, e, g, r in zip(("value", "grad w", "grad x"), eager, got, want):
                close(errs, f"{name}: eager {what} vs one process", e, r)
                close(errs, f"{name}: compiled {what} vs one process", g, r)
    return errs


@pytest.mark.timeout(240)
def test_compiled_idioms_match_eager_and_one_process():
    assert_ok(run_ranks(4, _rank_idioms, timeout=200))
