"""torch.func transforms entered inside ``f``, over a varying batch, with a parameter the transformed
function captures (invariant, so implicitly cast where it meets a row), under a gradient taken
outside ``f`` (``fs.value_and_grad``): ``vmap`` with each row's index (``xi[None]``, ``xi[1:]``)
and casts made under it, ``jvp`` (alone and under ``vmap``) and ``grad``.

Four faults found by trying these together, each fixed:

- an index of a ``vmap``'d row lost the row's varying axes (fshard read a functorch wrapper's mask
  only in the plain rule, not in indexing), so ``xi[None] @ w`` counted as invariant and the
  gradient of ``w`` was not summed over the ranks: each rank returned its own wrong gradient;
- a cast made under ``vmap`` of a parameter behind the gradient buckets raised "You tried to vmap
  over TwinTap";
- under ``jvp`` the parameter is a dual whose own ``requires_grad`` is False, so it was not cast
  where it met a varying row and the outer gradient was not summed either (silently);
- per-leaf all_gathers combined into one collective and first used inside ``vmap`` raised "You
  tried to vmap over Arrived" (the combined result was filled inside the transform).

Each program is compared with plain torch on the global tensors in one process, on 1-, 2- and
3-axis meshes with the batch cut unevenly over every axis, with and without gradient buckets, and
with ``check=False``.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, randn

DT = torch.float64
MESHES = {2: {"dp": 2}, 4: {"dp": 2, "tp": 2}, 8: {"dp": 2, "tp": 2, "pp": 2}}
ROWS = {2: 5, 4: 6, 8: 10}  # rows % ranks != 0: uneven blocks
D, H = 3, 4

# name -> per-row function of (row, w): each built from the row by the construct named
ROW_FNS = {
    "index None": lambda xi, w: torch.tanh(xi[None] @ w)[0],
    "slice": lambda xi, w: torch.tanh(xi[1:] @ w[1:]),
    "cast under vmap": lambda xi, w: torch.tanh(xi @ w),
    "index then op": lambda xi, w: torch.tanh((xi[None] * 2)[0] @ w) / 2,
}


def _rank(n: int):
    import torch.func as tf
    from torch.func import vmap

    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(**MESHES[n])
    axes = tuple(mesh.axis_names)
    rows = ROWS[n]
    w, x = randn(0, D, H, dtype=DT), randn(1, rows, D, dtype=DT)
    batch = f"({' '.join(axes)} b) d"
    for name, row in ROW_FNS.items():
        wr = w.clone().requires_grad_(True)
        want = (torch.func.vmap(lambda xi, row=row, wr=wr: row(xi, wr))(x) ** 2).sum()
        (want_g,) = torch.autograd.grad(want, wr)
        for opts in ({}, {"bucket_mb": 0}, {"check": False}):

            def loss(w, x, row=row):
                return fs.psum((vmap(lambda xi: row(xi, w))(x) ** 2).sum(), axes)

            sm = fs.shard_map(loss, mesh=mesh, in_specs=("...", batch), out_specs="", **opts)
            got, g = fs.value_and_grad(sm)(w, x)
            close(errs, f"{name} {opts}: loss", got, want, DT)
            close(errs, f"{name} {opts}: grad", g, want_g, DT)

    # forward mode inside f (alone, and per row under vmap), and grad inside f, under an outer grad
    t = randn(2, D, H, dtype=DT)

    def tangent(w, x):
        return tf.jvp(lambda w: torch.tanh(x @ w), (w,), (t,))[1]

    def rows_tangent(w, x):
        return tf.vmap(lambda xi: tf.jvp(lambda w: torch.tanh(xi[None] @ w)[0], (w,), (t,))[1])(x)

    def grad_norm(w, x):  # grad inside f of an invariant w is summed over the ranks (JAX's rule)
        return tf.grad(lambda w: torch.tanh(x[:, None][:, 0] @ w).sum())(w)

    cases = {  # name -> (loss inside f, the same loss of the global tensors)
        "jvp inside": (
            lambda w, x: fs.psum((tangent(w, x) ** 2).sum(), axes),
            lambda w: (tangent(w, x) ** 2).sum(),
        ),
        "vmap(jvp) inside": (
            lambda w, x: fs.psum((rows_tangent(w, x) ** 2).sum(), axes),
            lambda w: (tangent(w, x) ** 2).sum(),
        ),
        "grad inside": (
            lambda w, x: (grad_norm(w, x) ** 2).sum(),
            lambda w: (torch.autograd.grad(torch.tanh(x @ w).sum(), w, create_graph=True)[0] ** 2).sum(),
        ),
    }
    for name, (inside, ref) in cases.items():
        wr = w.clone().requires_grad_(True)
        want = ref(wr)
        (want_g,) = torch.autograd.grad(want, wr)
        for opts in ({}, {"bucket_mb": 0}, {"check": False}):
            sm = fs.shard_map(inside, mesh=mesh, in_specs=("...", batch), out_specs="", **opts)
            got, g = fs.value_and_grad(sm)(w, x)
            close(errs, f"{name} {opts}: loss", got, want, DT)
            close(errs, f"{name} {opts}: grad", g, want_g, DT)

    return errs


@pytest.mark.parametrize("n", [2, 4, 8])
def test_transforms_inside_f_under_an_outer_gradient(n):
    assert_ok(run_ranks(n, _rank, n, timeout=110))


def _rank_debug(rows: int):
    """fs.debug with uneven blocks: the outputs' blocks differ in size by design (it raised
    "f returned outputs whose structure or local shapes differ across ranks" on every such call)."""
    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(dp=2)
    x = randn(2, rows, D, dtype=DT)
    sm = fs.shard_map(
        lambda x: (x * 2, x.sum(0)), mesh=mesh, in_specs="(dp b) d", out_specs=("(dp b) d", "d | sum(dp)")
    )
    with fs.debug():
        y, s = sm(x)
    close(errs, f"rows {rows}: blocks", fs.full(y), 2 * x, DT)
    close(errs, f"rows {rows}: partial sums", fs.full(s), x.sum(0), DT)
    # a block of another rank (number of dims) on one rank is still caught, before any stitching
    rank = mesh.axis_index("dp")
    odd = fs.shard_map(lambda x: x if rank == 0 else x[None], mesh=mesh, in_specs="(dp b) d", out_specs="...")
    try:
        with fs.debug():
            odd(x)
        errs.append(f"rows {rows}: a block with another number of dims on rank 1 was not caught")
    except fs.TracingError as e:
        want = (
            "fs.shard_map(_rank_debug.<locals>.<lambda>) [debug]: f returned outputs whose structure or local "
            "shapes differ across ranks (equal within: rank 0; rank 1); a data-dependent shape (x[mask], "
            "nonzero, unique) on a varying value differs per rank: pad it to a fixed size (torch.where with a "
            "fill value) or return the mask with the values"
        )
        if str(e) != want:
            errs.append(f"rows {rows}: message {str(e)!r}")
    return errs


@pytest.mark.parametrize("rows", [4, 5])
def test_debug_accepts_uneven_blocks(rows):
    assert_ok(run_ranks(2, _rank_debug, rows))


def _rank_combined_gathers():
    """Per-leaf all_gathers issued before a vmap entered in f and first used inside it: combined
    into one collective, filled outside the transform (filled inside it, the combined result's
    autograd node raised "You tried to vmap over Arrived")."""
    import torch.func as tf

    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(dp=2)
    w1, w2, x = randn(3, 4, 6, dtype=DT), randn(4, 6, 6, dtype=DT), randn(5, 8, 4, dtype=DT)  # even blocks

    def loss(w1, w2, x):
        g1, g2 = (fs.all_gather(w, "dp", dim=0, tiled=True) for w in (w1, w2))
        rows = tf.vmap(lambda xi: torch.tanh(torch.tanh(xi[None] @ g1) @ g2)[0])(x)
        return fs.psum((rows**2).sum(), "dp")

    sm = fs.shard_map(loss, mesh=mesh, in_specs=("(dp d) h", "(dp h) k", "(dp b) d"), out_specs="")
    with fs.count_collectives() as counts:
        got, (g1, g2) = fs.value_and_grad(sm, argnums=(0, 1))(w1, w2, x)
    a, b = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    want = (torch.tanh(torch.tanh(x @ a) @ b) ** 2).sum()
    want1, want2 = torch.autograd.grad(want, (a, b))
    close(errs, "loss", got, want, DT)
    close(errs, "grad w1", fs.full(g1), want1, DT)
    close(errs, "grad w2", fs.full(g2), want2, DT)
    return errs, sorted(counts.combined)


def test_combined_gathers_first_used_inside_vmap():
    got = run_ranks(2, _rank_combined_gathers)
    assert_ok([e for e, _ in got])
    for _, combined in got:
        # the two gathers went as one collective, and so did their reduce-scatters in the backward
        # (the loss's psum: a bucket of its own)
        assert combined == [
            ("all_gather", ("dp",), 2),
            ("all_reduce", ("dp",), 1),
            ("reduce_scatter", ("dp",), 2),
        ], combined
