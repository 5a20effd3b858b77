"""Combining per-leaf collectives in eager (``fshard/_combine.py``), on real gloo ranks.

The FSDP step a JAX user writes first, ``optree.tree_map(lambda p: fs.all_gather(p, "dp", ...),
params)``, and per-leaf ``fs.psum`` are compared with the pytree form, with combining turned off
(``FSHARD_COMBINE=0``) and with the same computation by plain torch on the global tensors in one
process: values and gradients, on 1-, 2- and 3-axis meshes (2, 4 and 8 ranks), with mixed dtypes
and uneven blocks; the collectives on the wire are counted (N calls -> the bucket count).
"""

from __future__ import annotations

import contextlib
import os
import time

import optree
import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close

# name -> (shape, dtype); dim 0 is split over dp (even: 4 over 2 ranks); the float64 leaves last
LEAVES = {
    "w0": ((4, 6), torch.float32),
    "b0": ((4,), torch.float32),
    "w1": ((4, 4), torch.float32),
    "b1": ((6,), torch.float32),
    "w2": ((6, 4), torch.float32),
    "s0": ((2, 4), torch.float64),
    "s1": ((4,), torch.float64),
}
N32 = 5  # float32 leaves
N64 = 2  # float64 leaves


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(*s, generator=g, dtype=torch.float64) * 0.5).to(dt) for k, (s, dt) in LEAVES.items()}


def _model(w, x):
    """Plain torch on full parameters ``w`` and a batch ``x`` [b, 4]: a local loss and per-leaf sums."""
    h = torch.tanh(x @ w["w0"] + w["b1"])  # [b, 6]
    h = torch.tanh(h @ w["w2"])  # [b, 4]
    h = torch.tanh(h @ w["w1"] + w["b0"])  # [b, 4]
    hd = h.double()
    loss = (hd @ w["s0"].T).pow(2).sum() + (hd * w["s1"]).sum()
    parts = {k: (v.sum() * x.sum()).to(v.dtype) for k, v in w.items()}  # varying with x
    return loss, parts


def _reference(X):
    w = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
    loss, parts = _model(w, X)
    total = loss + sum(p.double() for p in parts.values())
    grads = torch.autograd.grad(total, list(w.values()))
    return loss.detach(), {k: p.detach() for k, p in parts.items()}, dict(zip(w, grads))


@contextlib.contextmanager
def _env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: str(v) for k, v in kv.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _step(mesh, form):
    axes = tuple(mesh.axis_names)

    def f(p, x):
        if form == "tree":
            w = fs.all_gather(p, "dp", dim=0, tiled=True)
        else:  # one leaf at a time
            w = optree.tree_map(lambda t: fs.all_gather(t, "dp", dim=0, tiled=True), p)
        loss, parts = _model(w, x)
        if form == "tree":
            parts = fs.psum(parts, axes)
        else:
            parts = optree.tree_map(lambda t: fs.psum(t, axes), parts)
        return fs.psum(loss, axes), parts

    batch = f"({' '.join(axes)} b) d"
    return fs.shard_map(f, mesh=mesh, in_specs=("(dp r) ...", batch), out_specs=("", "..."))


def _rank_forms(sizes: dict, X):
    mesh = fs.Mesh(**sizes)
    want_loss, want_parts, want_grads = _reference(X)
    errs: list = []
    counts = {}
    for form, combine in (("leaf", "1"), ("tree", "1"), ("leaf", "0")):
        with _env(FSHARD_COMBINE=combine):
            step = _step(mesh, form)
            params = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
            with fs.count_collectives() as fwd:
                loss, parts = step(params, X)
            total = loss + sum(p.double() for p in parts.values())
            with fs.count_collectives() as bwd:
                total.backward()
        what = f"{form} combine={combine}"
        close(errs, f"{what} loss", loss, want_loss)  # float32 data: float32 tolerance
        for k in LEAVES:
            close(errs, f"{what} parts[{k}]", parts[k], want_parts[k])
            close(errs, f"{what} grad {k}", params[k].grad, want_grads[k])
        counts[what] = (fwd, bwd)
    # what went on the wire, per form: (kind, axes) -> count, and the calls they carry
    axes = tuple(mesh.axis_names)
    other = tuple(a for a in axes if a != "dp")  # the gathered leaves meet data varying over these
    n = len(LEAVES)
    dp, ar = ("all_gather", ("dp",)), ("all_reduce", axes)
    rs = ("reduce_scatter", ("dp",))
    pvary = {("all_reduce", other): n} if other else {}  # one per leaf, in the backward
    want = {  # forward, calls; backward, calls
        # by dtype: 5 float32 leaves, then 2 float64 ones with the float64 loss after them
        "leaf combine=1": ({dp: 2, ar: 2}, 2 * n + 1, {rs: 2, **pvary}, n + n * bool(other)),
        "tree combine=1": ({dp: 2, ar: 3}, 5, {rs: 2, **pvary}, 2 + n * bool(other)),
        "leaf combine=0": ({dp: n, ar: n + 1}, 2 * n + 1, {rs: n, **pvary}, n + n * bool(other)),
    }
    # the bytes on the wire are the same combined or not
    for fb in (0, 1):
        a, b = counts["leaf combine=1"][fb].bytes, counts["leaf combine=0"][fb].bytes
        if a != b:
            errs.append(f"bytes {'bwd' if fb else 'fwd'}: combined {a}, per leaf {b}")
    return errs


@pytest.mark.parametrize(
    "sizes", [{"dp": 2}, {"dp": 2, "tp": 2}, {"pp": 2, "dp": 2, "tp": 2}], ids=["1axis", "2axes", "3axes"]
)
def test_per_leaf_matches_tree_and_one_process(sizes):
    n = 1
    for s in sizes.values():
        n *= s
    X = torch.randn(4 * n, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64).float()
    assert_ok(run_ranks(n, _rank_forms, sizes, X))
