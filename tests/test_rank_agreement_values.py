"""Values and gradients that must agree across ranks, and did not: three silent-wrong-value holes.

* ``check=False`` gradients: an output that is the same on every rank in fact but tracked as
  varying (a ``ppermute`` of a replicated value around a full ring, ``fs.switch`` with identical
  branches), returned under a replicated out_spec: the cotangent of each of its N copies flows
  back through ``f`` and the transposes sum them, so its gradient must be divided by N.
* Draws from torch's global generator inside ``f`` (``F.dropout``, ``torch.rand``, ...): each rank
  draws its own numbers, so their results vary over every mesh axis, and the replication check
  says so.
* ``fs.optim.clip_grad_norm_``: the global norm of local gradient blocks, where torch's own
  function would clip each rank by its local norm.

Each program's values and gradients are compared with plain torch on the global tensors in the
test process, on real gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close

DT = torch.float64
D = 3  # width of every value


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _ring(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# 1. check=False: an output tracked as varying but returned as replicated


def _sq(w):
    return w * w


def _ring_sum(x):
    """The sum of x over 'r', by hand: N-1 ppermutes around the ring (the same on every rank in fact)."""
    n = fs.axis_size("r")
    acc, s = x, x
    for _ in range(n - 1):
        s = fs.ppermute(s, "r", _ring(n))
        acc = acc + s
    return acc


def _programs(n: int, a: int, b: int) -> dict:
    """name -> (mesh axes, f(w, x), in_specs, out_spec, reference(W, X) on the global tensors).

    ``w`` (shape (D,)) is replicated; ``x`` (shape (2 n, D)) is split as in_specs says."""
    one = {"r": n}
    two = {"a": a, "b": b}
    return {
        # replicated w sent around the full ring: the same on every rank, tracked as varying over r
        "ring": (
            one,
            lambda w, x: fs.ppermute(w.sin(), "r", _ring(n)),
            ("d", "(r k) d"),
            "d",
            lambda W, X: W.sin(),
        ),
        # a varying x summed over r by ppermutes: the gradient reaches the varying input too
        "ring_sum": (
            one,
            lambda w, x: _ring_sum(x * w),
            ("d", "(r k) d"),
            "k d",
            lambda W, X: (X * W).reshape(n, -1, D).sum(0),
        ),
        # every rank runs a branch of its own, all alike
        "switch": (
            one,
            lambda w, x: fs.switch(fs.axis_index("r"), [_sq] * n, w),
            ("d", "(r k) d"),
            "d",
            _sq_ref,
        ),
        # 2-axis mesh, output tracked as varying over 'a' only (divide by |a|, not by the mesh)
        "ring_a": (
            two,
            lambda w, x: fs.ppermute(w.sin(), "a", _ring(a)),
            ("d", "(b k) d"),
            "d",
            lambda W, X: W.sin(),
        ),
        # over both axes (divide by |a| |b|)
        "ring_ab": (
            two,
            lambda w, x: fs.ppermute(fs.ppermute(w.sin(), "a", _ring(a)), "b", _ring(b)),
            ("d", "(b k) d"),
            "d",
            lambda W, X: W.sin(),
        ),
        # split over b by its spec, tracked varying over a too: only 'a' is extra
        "split_b_ring_a": (
            two,
            lambda w, x: fs.ppermute(x * w, "a", _ring(a)),
            ("d", "(b k) d"),
            "(b k) d",
            lambda W, X: X * W,
        ),
    }


def _sq_ref(W, X):
    return W * W


def _rank_unchecked(n: int, a: int, b: int, W, X, C):
    errs: list[str] = []
    for name, (axes, body, in_specs, out_spec, ref) in _programs(n, a, b).items():
        mesh = fs.Mesh(**axes)
        f = fs.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check=False)
        w, x = W.clone().requires_grad_(True), X.clone().requires_grad_(True)
        want_w, want_x = W.clone().requires_grad_(True), X.clone().requires_grad_(True)
        want = ref(want_w, want_x)
        c = C[name]
        (want * c).sum().backward()

        y = f(w, x)
        y = y.full() if isinstance(y, fs.Sharded) else y
        close(errs, f"{name}: value", y, want, DT)
        (y * c).sum().backward()  # loss.backward()
        close(errs, f"{name}: backward grad w", w.grad, want_w.grad, DT)
        close(
            errs,
            f"{name}: backward grad x",
            x.grad if x.grad is not None else torch.zeros_like(X),
            want_x.grad if want_x.grad is not None else torch.zeros_like(X),
            DT,
        )

        def loss(w, x, f=f, c=c):
            out = f(w, x)
            return ((out.full() if isinstance(out, fs.Sharded) else out) * c).sum()

        v, (gw, gx) = fs.value_and_grad(loss, argnums=(0, 1))(W, X)
        close(errs, f"{name}: value_and_grad value", v, (want * c).sum(), DT)
        close(errs, f"{name}: value_and_grad grad w", gw, want_w.grad, DT)
        close(
            errs,
            f"{name}: value_and_grad grad x",
            gx,
            want_x.grad if want_x.grad is not None else torch.zeros_like(X),
            DT,
        )

    # second order: d/dw of |dy/dw|^2 for y = ring-sent w^3 (the same on every rank)
    mesh = fs.Mesh(r=n)
    f = fs.shard_map(
        lambda w: fs.ppermute(w**3, "r", _ring(n)), mesh=mesh, in_specs="d", out_specs="d", check=False
    )
    w = W.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(w).sum(), w, create_graph=True)
    close(errs, "second order: first grad", g, 3 * W**2, DT)
    (g * g).sum().backward()
    close(errs, "second order: grad of |grad|^2", w.grad, 36 * W**3, DT)

    # nothing added when tracking proves the output replicated (a psum), nor under check=True
    for check in (False, True):
        g2 = fs.shard_map(
            lambda w, x: fs.psum(x * w, "r"),
            mesh=mesh,
            in_specs=("d", "(r k) d"),
            out_specs="k d",
            check=check,
        )
        y = g2(W.clone().requires_grad_(True), X)
        if type(y.grad_fn).__name__ == "_ScaleCotangentBackward":
            errs.append(f"check={check}: a psum output got a cotangent scale")
    return errs


@pytest.mark.parametrize("n,a,b", [(2, 2, 1), (4, 2, 2), (8, 4, 2)])
def test_check_false_gradients_of_replicated_outputs(n, a, b):
    W, X = _randn(0, D), _randn(1, 2 * n, D)
    C = {
        name: _randn(10 + i, *ref(W, X).shape)
        for i, (name, (_, _, _, _, ref)) in enumerate(_programs(n, a, b).items())
    }
    assert_ok(run_ranks(n, _rank_unchecked, n, a, b, W, X, C))
