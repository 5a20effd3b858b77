"""Gradients of a compiled tensor-parallel residual stack under real inductor, against eager and
one process.

Each layer is ``h = h + psum(tanh(h @ w + b) @ v, "tp") * scale.float()`` (``scale`` a replicated
float64 parameter), on dp=2 x tp=2, the loss ``pmean((h ** 2).mean(), "dp")``, and
``loss.backward()`` outside the compiled call. Inductor's peak-memory reordering of the
backward's kernels ran layer 0's kernel, which reads layer 1's input-gradient block, before that
block's in-place all-reduce over "tp": the loss was right and the early layers' gradients were
15-65% off (with 4 layers and the float64 parameter; the reordering picks the sort of least
estimated peak memory, so smaller programs were scheduled right by chance). fshard turns that
reordering off while a shard_map call is traced (``_compile.keep_collectives_in_place``).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, randn

LAYERS, B, D, H = 4, 2, 4, 2  # rows per dp rank, model width, hidden per tp rank


def _inputs(ndp, ntp):
    t = {"x": randn(1, ndp * B, D)}
    for i in range(LAYERS):
        t[f"w{i}"] = randn(10 + i, D, ntp * H) / 2
        t[f"b{i}"] = randn(20 + i, ntp * H) * 0.1
        t[f"v{i}"] = randn(30 + i, ntp * H, D) / 2
        t[f"s{i}"] = (1 + randn(40 + i, D) * 0.1).to(torch.float64)
    return t


def _specs():
    s = {"x": "(dp b) d"}
    for i in range(LAYERS):
        s.update({f"w{i}": "d (tp h)", f"b{i}": "(tp h)", f"v{i}": "(tp h) d", f"s{i}": "d"})
    return s


def _stack(t, psum=lambda y: y):
    h = t["x"]
    for i in range(LAYERS):
        y = torch.tanh(h @ t[f"w{i}"] + t[f"b{i}"]) @ t[f"v{i}"]
        h = h + psum(y) * t[f"s{i}"].float()
    return h


def _rank(backend_name):
    import fshard as fs

    torch._dynamo.reset()
    mesh = fs.Mesh(dp=2, tp=2)

    def local(t):
        return fs.pmean((_stack(t, lambda y: fs.psum(y, "tp")) ** 2).mean(), "dp")

    f = fs.shard_map(local, mesh=mesh, in_specs=(_specs(),), out_specs="")
    inputs = _inputs(2, 2)
    diff = [k for k in inputs if k != "x"]

    def run(fn):
        t = {k: v.clone().requires_grad_(k != "x") for k, v in inputs.items()}
        loss = fn(t)
        loss = fs.full(loss) if isinstance(loss, fs.Sharded) else loss
        loss.backward()
        return [loss.detach()] + [t[k].grad for k in diff]

    want = run(lambda t: (_stack(t) ** 2).mean())
    eager = run(f)
    if backend_name == "fs.compile":
        fn = fs.compile(f)
    else:
        fn = torch.compile(f, backend="inductor", fullgraph=True)
    got = run(fn)
    errs: list[str] = []
    for what, e, g, r in zip(["loss", *diff], eager, got, want):
        close(errs, f"eager {what} vs one process", e, r)
        close(errs, f"{backend_name} {what} vs one process", g, r)
    return errs


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["fs.compile", "inductor"])
def test_residual_stack_gradients(backend):
    assert_ok(run_ranks(4, _rank, backend, timeout=880))
