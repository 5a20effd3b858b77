"""Combining per-leaf collectives in eager (``fshard/_combine.py``), on real gloo ranks.

The FSDP step a JAX user writes first, ``optree.tree_map(lambda p: fs.all_gather(p, "dp", ...),
params)``, and per-leaf ``fs.psum`` are compared with the pytree form, with combining turned off
(``FSHARD_COMBINE=0``) and with the same computation by plain torch on the global tensors in one
process: values and gradients, on 1-, 2- and 3-axis meshes (2, 4 and 8 ranks), with mixed dtypes
and uneven blocks; the collectives on the wire are counted (N calls -> the bucket count).
"""

from __future__ import annotations

import time

import optree
import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, env_vars

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
    return {
        k: (torch.randn(*s, generator=g, dtype=torch.float64) * 0.5).to(dt) for k, (s, dt) in LEAVES.items()
    }


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
        with env_vars(FSHARD_COMBINE=combine):
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
    other = tuple(a for a in axes if a != "dp")
    n = len(LEAVES)
    dp, ar = ("all_gather", ("dp",)), ("all_reduce", axes)
    rs = ("reduce_scatter", ("dp",))
    # the gathered leaves (and their sums, in parts) meet data varying over the other axes: the
    # pvary's transpose, an all_reduce, for each of them in the backward
    pvary = {("all_reduce", other): 2 * n} if other else {}
    grads_in = {dp: n}  # the gradients of the global inputs, gathered from their blocks
    want = {  # forward, calls; backward, calls
        # a bucket per dtype (float32 and float64 leaves interleave in optree's sorted key order);
        # the float64 loss joins the float64 parts
        "leaf combine=1": (
            {dp: 2, ar: 2},
            2 * n + 1,
            {rs: 2, **grads_in, **pvary},
            2 * n + 2 * n * bool(other),
        ),
        # the pytree all_gather is queued leaf by leaf (a call per leaf), the pytree psum is not
        "tree combine=1": ({dp: 2, ar: 3}, n + 3, {rs: 2, **grads_in, **pvary}, 2 * n + 2 * n * bool(other)),
        "leaf combine=0": (
            {dp: n, ar: n + 1},
            2 * n + 1,
            {rs: n, **grads_in, **pvary},
            2 * n + 2 * n * bool(other),
        ),
    }
    for what, (fwd_kinds, fwd_calls, bwd_kinds, bwd_calls) in want.items():
        fwd, bwd = counts[what]
        if dict(fwd.by_kind()) != fwd_kinds or fwd.calls != fwd_calls:
            errs.append(f"{what} forward: {fwd!r}, want {fwd_kinds} carrying {fwd_calls} calls")
        if dict(bwd.by_kind()) != bwd_kinds or bwd.calls != bwd_calls:
            errs.append(f"{what} backward: {bwd!r}, want {bwd_kinds} carrying {bwd_calls} calls")
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


# == cases on one 2-rank job ===================================================================


def _gathered(mesh, f, in_specs, out_specs, *args):
    """Run ``fs.shard_map(f)`` on ``args`` (cloned, needing gradients), outputs marked `V` summed
    over dp (fs.psum, one leaf at a time), and the backward of the outputs' sums weighted 1, 2, ...;
    returns the outputs, the gradients and the forward's and backward's counts."""
    single = not isinstance(out_specs, tuple)
    specs = (out_specs,) if single else out_specs

    def g(*a):
        outs = f(*a)
        outs = (outs,) if single else outs
        return tuple(fs.psum(o, "dp") if s is V else o for o, s in zip(outs, specs))

    args = [a.clone().requires_grad_(True) for a in args]
    step = fs.shard_map(
        g, mesh=mesh, in_specs=in_specs, out_specs=tuple("..." if s is V else s for s in specs)
    )
    with fs.count_collectives() as fwd:
        outs = step(*args)
    with fs.count_collectives() as bwd:
        sum(o.double().sum() * (i + 1) for i, o in enumerate(outs)).backward()
    return outs, [a.grad for a in args], fwd, bwd


V = "summed"  # an out_spec for `_gathered`: the result varies over dp, fs.psum over dp returns it


def _summed(t):
    """The sum over the 2 ranks of dp of a value ``t`` each of them holds."""
    return 2 * t


def _kinds(counts, kind="all_gather") -> dict:
    """The collectives of ``kind`` in ``counts``: (kind, axes) -> number."""
    return {k: n for k, n in counts.by_kind().items() if k[0] == kind}


def _buckets(counts, kind="all_gather") -> list:
    """The number of calls each combined collective of ``kind`` carried."""
    return [n for k, _, n in counts.combined if k == kind]


def _rank_cases(X):
    mesh = fs.Mesh(dp=2)
    rank = mesh.axis_index("dp")
    errs: list = []
    A, B, C = X[0:4, 0:3], X[4:8, 0:3], X[8:12, 0:3]  # global (4, 3) blocks, split over dp
    AG, RS = ("all_gather", ("dp",)), ("reduce_scatter", ("dp",))

    # a result used at once: nothing to combine, each call communicates on its own
    def used_at_once(a, b):
        ya = fs.all_gather(a, "dp", tiled=True)
        za = ya * 2  # uses ya: flushes its all_gather
        return za, fs.all_gather(b, "dp", tiled=True)

    (za, yb), (ga, gb), fwd, bwd = _gathered(mesh, used_at_once, "(dp r) c", (V, V), A, B)
    close(errs, "used at once: value", za, _summed(A * 2))
    close(errs, "used at once: value b", yb, _summed(B))
    # gradients: an output's weight (1, 2) x its factor x 2 (the ranks' copies, reduce-scattered)
    close(errs, "used at once: grad", ga, torch.full_like(A, 4.0))
    close(errs, "used at once: grad b", gb, torch.full_like(B, 4.0))
    if _kinds(fwd) != {AG: 2} or _buckets(fwd) != [1, 1]:
        errs.append(f"used at once: forward {fwd!r}, want 2 all_gathers")

    # a cast of each leaf before its gather (mixed precision, the JAX form) leaves the queue open
    def cast_each(a, b, c):
        return tuple(fs.all_gather(t.double(), "dp", tiled=True) for t in (a, b, c))

    outs, grads, fwd, bwd = _gathered(mesh, cast_each, "(dp r) c", (V,) * 3, A, B, C)
    for k, (o, t) in enumerate(zip(outs, (A, B, C))):
        close(errs, f"cast: value {k}", o, _summed(t).double(), torch.float64)
        close(errs, f"cast: grad {k}", grads[k], torch.full_like(t, 2.0 * (k + 1)))
    if _buckets(fwd) != [3] or _buckets(bwd, "reduce_scatter") != [3]:
        errs.append(f"cast: {fwd.combined} then {bwd.combined}, want one bucket of 3 calls each way")

    # ranks use the results in different orders: the queue runs whole, in issue order
    def any_order(a, b, c):
        ys = [fs.all_gather(t, "dp", tiled=True) for t in (a, b, c)]
        order = [0, 1, 2] if rank == 0 else [2, 0, 1]
        acc = {i: ys[i].sin() for i in order}
        return acc[0], acc[1], acc[2]

    t0 = time.monotonic()
    outs, grads, fwd, bwd = _gathered(mesh, any_order, "(dp r) c", (V,) * 3, A, B, C)
    if time.monotonic() - t0 > 30:
        errs.append(f"any order: took {time.monotonic() - t0:.1f} s")
    for i, (o, g, t) in enumerate(zip(outs, grads, (A, B, C))):
        close(errs, f"any order: value {i}", o, _summed(t.sin()))
        close(errs, f"any order: grad {i}", g, t.cos() * (i + 1) * 2)
    if _kinds(fwd) != {AG: 1} or _buckets(fwd) != [3] or _buckets(fwd, "all_reduce") != [3]:
        errs.append(f"any order: forward {fwd!r} {fwd.combined}, want one all_gather of 3 calls")
    if _kinds(bwd, "reduce_scatter") != {RS: 1} or _buckets(bwd, "reduce_scatter") != [3]:
        errs.append(f"any order: backward {bwd!r}, want one reduce_scatter of 3 calls")

    # the operand of a call is the queued result of the one before (same kind and axes)
    def nested(a):
        y = fs.all_gather(a, "dp", dim=0, tiled=True)  # (4, 3), varies over dp
        return fs.all_gather(y, "dp", dim=1, tiled=False)  # (4, 2, 3)

    (y,), (ga,), fwd, _ = _gathered(mesh, nested, "(dp r) c", V, A)
    close(errs, "nested: value", y, _summed(torch.stack([A, A], 1)))
    close(errs, "nested: grad", ga, torch.full_like(A, 4.0))  # 2 copies, each summed over 2 ranks
    if _kinds(fwd) != {AG: 2}:
        errs.append(f"nested: forward {fwd!r}, want 2 all_gathers")

    # dtypes are never mixed: a bucket per dtype, run in the order of their first calls
    def dtypes(a, b, c):
        ys = [fs.all_gather(t, "dp", tiled=True) for t in (a, b.double(), c, b)]
        return tuple(ys)

    outs, grads, fwd, _ = _gathered(mesh, dtypes, "(dp r) c", (V,) * 4, A, B, C)
    for o, want in zip(outs, (A, B.double(), C, B)):
        close(errs, f"dtypes: value {o.dtype}", o, _summed(want))
    close(errs, "dtypes: grad b", grads[1], torch.full_like(B, 12.0))  # (2 + 4) x 2
    if _kinds(fwd) != {AG: 2} or _buckets(fwd) != [3, 1]:  # a, c, b | b.double()
        errs.append(f"dtypes: forward {fwd!r} {fwd.combined}, want 2 all_gathers of 3 and 1 calls")

    # invariant=True: combined, gradient the local slice (no communication in the backward)
    def invariant(a, b):
        return tuple(fs.all_gather(t, "dp", tiled=True, invariant=True) for t in (a, b))

    outs, grads, fwd, bwd = _gathered(mesh, invariant, "(dp r) c", ("r c",) * 2, A, B)
    close(errs, "invariant: value", outs[1], B)
    close(errs, "invariant: grad", grads[1], torch.full_like(B, 2.0))
    if _kinds(fwd) != {AG: 1} or _kinds(bwd, "reduce_scatter"):
        errs.append(
            f"invariant: forward {fwd!r}, backward {bwd!r}; want 1 all_gather, then no reduce_scatter"
        )

    # a size cap: results of 48 bytes each, at most 96 bytes a bucket -> 2 calls a bucket
    def capped(a, b, c):
        return tuple(fs.all_gather(t, "dp", tiled=True) for t in (a, b, c, a, b))

    with env_vars(FSHARD_COMBINE_MB=96 / 2**20):
        outs, grads, fwd, bwd = _gathered(mesh, capped, "(dp r) c", (V,) * 5, A, B, C)
    close(errs, "capped: value", outs[4], _summed(B))
    close(errs, "capped: grad a", grads[0], torch.full_like(A, 10.0))  # outputs 1 and 4, x 2
    if _buckets(fwd) != [2, 2, 1] or _buckets(bwd, "reduce_scatter") != [1, 2, 2]:
        errs.append(f"capped: {fwd.combined} then {bwd.combined}, want buckets of 2, 2, 1 calls")

    # the pytree form is queued leaf by leaf: the same size-capped buckets
    def capped_tree(a, b, c):
        return tuple(fs.all_gather([a, b, c, a, b], "dp", tiled=True))

    with env_vars(FSHARD_COMBINE_MB=96 / 2**20):
        outs, grads, fwd, bwd = _gathered(mesh, capped_tree, "(dp r) c", (V,) * 5, A, B, C)
    close(errs, "capped tree: value", outs[4], _summed(B))
    close(errs, "capped tree: grad a", grads[0], torch.full_like(A, 10.0))
    if _buckets(fwd) != [2, 2, 1] or _buckets(bwd, "reduce_scatter") != [1, 2, 2]:
        errs.append(f"capped tree: {fwd.combined} then {bwd.combined}, want buckets of 2, 2, 1 calls")
    with env_vars(FSHARD_COMBINE="0"):  # one all_gather of the five leaves, one reduce_scatter back
        outs, grads, fwd, bwd = _gathered(mesh, capped_tree, "(dp r) c", (V,) * 5, A, B, C)
    close(errs, "tree, combining off: grad a", grads[0], torch.full_like(A, 10.0))
    if _kinds(fwd) != {AG: 1} or _kinds(bwd, "reduce_scatter") != {("reduce_scatter", ("dp",)): 1}:
        errs.append(f"tree, combining off: {fwd!r} then {bwd!r}, want 1 all_gather, 1 reduce_scatter")

    # errors of a call among queued ones: the same text; the queued calls still run right
    def errors(a, b):
        ya = fs.all_gather(a, "dp", tiled=True)
        msgs = []
        for bad in (lambda: fs.all_gather(b, "dq", tiled=True), lambda: fs.all_gather(b, "dp", dim=3)):
            try:
                bad()
            except fs.FshardError as e:
                msgs.append(str(e))
        yb = fs.psum(b, "dp")
        errors.msgs = msgs
        return ya, yb

    (ya, yb), (ga, gb), fwd, _ = _gathered(mesh, errors, "(dp r) c", (V, "r c"), A, B)
    want_msgs = [
        "fs.all_gather: 'dq' is not an axis of Mesh(dp=2) (did you mean 'dp'?)",
        "fs.all_gather: dim=3 is out of range for a tensor of 3 dims",
    ]
    if errors.msgs != want_msgs:
        errs.append(f"errors: {errors.msgs}")
    close(errs, "errors: value", ya, _summed(A))
    close(errs, "errors: psum", yb, B[:2] + B[2:])
    close(errs, "errors: grad", ga, torch.full_like(A, 2.0))

    # per-leaf psum under no_grad, and the opt-out
    def sums(a, b, c):
        return tuple(fs.psum(t, "dp") for t in (a, b, c))

    for combine, want_ar in (("1", 1), ("0", 3)):
        with env_vars(FSHARD_COMBINE=combine), torch.no_grad():
            step = fs.shard_map(sums, mesh=mesh, in_specs="(dp r) c", out_specs="r c")
            with fs.count_collectives() as fwd:
                outs = step(A, B, C)
        for o, t in zip(outs, (A, B, C)):
            close(errs, f"psum combine={combine}: value", o, t[:2] + t[2:])
        if _kinds(fwd, "all_reduce") != {("all_reduce", ("dp",)): want_ar} or fwd.calls != 3:
            errs.append(f"psum combine={combine}: {fwd!r}, want {want_ar} all_reduces carrying 3 calls")
    return errs


def test_combining_cases():
    X = torch.randn(12, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64).float()
    t0 = time.monotonic()
    assert_ok(run_ranks(2, _rank_cases, X, timeout=60))
    assert time.monotonic() - t0 < 60


def _rank_uneven(W):
    mesh = fs.Mesh(dp=2)
    errs: list = []

    def f(a, b):  # blocks of 3 and 2 rows: checked shapes, gathered unevenly, never combined
        return tuple(fs.all_gather(t, "dp", tiled=True) for t in (a, b))

    (ya, yb), (ga, gb), fwd, bwd = _gathered(mesh, f, "(dp r) c", (V, V), W, W * 2)
    close(errs, "uneven: value", yb, _summed(W * 2))
    close(errs, "uneven: grad", gb, torch.full_like(W, 4.0))  # 2 (the weight) x 2 (two copies summed)
    if _buckets(fwd) or bwd.combined or _kinds(bwd, "reduce_scatter") != {("reduce_scatter", ("dp",)): 2}:
        errs.append(f"uneven: {fwd!r} {fwd.combined}, want one all_gather per call, none combined")
    return errs


def test_uneven_blocks_not_combined():
    W = torch.randn(5, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    assert_ok(run_ranks(2, _rank_uneven, W))


def _rank_forward_ad(W, T):
    """Per-leaf fs.all_gather and fs.psum under forward-mode AD: run one call at a time (the
    combined Functions have no jvp rule), with plain torch's primals and tangents."""
    import torch.autograd.forward_ad as fwAD

    mesh = fs.Mesh(dp=2)
    errs: list = []

    def f(ws, ts):
        with fwAD.dual_level():
            duals = [fwAD.make_dual(w, t) for w, t in zip(ws, ts)]
            full = [fs.all_gather(d, "dp", dim=0, tiled=True, invariant=True) for d in duals]  # per leaf
            sums = [fs.psum(d.sin(), "dp") for d in duals]
            outs = [*full, *sums]
            return [fwAD.unpack_dual(o).primal for o in outs], [fwAD.unpack_dual(o).tangent for o in outs]

    step = fs.shard_map(f, mesh=mesh, in_specs=("(dp r) c", "(dp r) c"), out_specs=("...", "..."))
    with fs.count_collectives() as counts:
        primals, tangents = step(list(W), list(T))
    blocks = [w.view(2, -1, w.shape[-1]) for w in W]
    tblocks = [t.view(2, -1, t.shape[-1]) for t in T]
    want_p = [*W, *(b.sin().sum(0) for b in blocks)]
    want_t = [*T, *((b.cos() * tb).sum(0) for b, tb in zip(blocks, tblocks))]
    for i, (p, t, wp, wt) in enumerate(zip(primals, tangents, want_p, want_t)):
        close(errs, f"forward AD primal {i}", p, wp)
        close(errs, f"forward AD tangent {i}", t, wt)
    # each call at once: one collective for its primal, one for its tangent
    if counts.combined or dict(counts.by_kind()) != {("all_gather", ("dp",)): 4, ("all_reduce", ("dp",)): 4}:
        errs.append(
            f"forward AD: {counts!r} {counts.combined}, want 4 all_gathers, 4 all_reduces, none combined"
        )
    return errs


def test_forward_mode_ad_is_never_combined():
    g = torch.Generator().manual_seed(4)
    W = [torch.randn(4, 3, generator=g), torch.randn(6, 2, generator=g)]
    T = [torch.randn(4, 3, generator=g), torch.randn(6, 2, generator=g)]
    assert_ok(run_ranks(2, _rank_forward_ad, W, T))


# == an autograd.Function applied to a queued result =========================================


class _Scale(torch.autograd.Function):
    """``3 * x``, written as users write a custom Function: fshard does not see ``apply``."""

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, ct):
        return ct * 3


def _rank_function_on_queued(sizes: dict, X, W):
    """The result of a queued psum and of queued all_gathers (varying and invariant) goes straight
    into a custom autograd.Function: the gradient must reach the operands, as with combining off.
    (Before the fix the Function kept the unfilled result's empty history and the gradient through
    it was dropped: a wrong gradient, no error.)"""
    mesh = fs.Mesh(**sizes)
    axes = tuple(mesh.axis_names)
    out = {}
    for combine in ("1", "0"):
        with env_vars(FSHARD_COMBINE=combine):

            def f(w, x):
                full = _Scale.apply(fs.all_gather(w, "dp", dim=0, tiled=True))  # [8, 4]
                same = _Scale.apply(fs.all_gather(w, "dp", dim=0, tiled=True, invariant=True))
                h = torch.tanh(x @ full.T) + torch.tanh(x @ same.T)
                s = _Scale.apply(fs.psum(h.sum(), axes))
                extra = fs.all_gather(w, "dp", dim=0, tiled=True, invariant=True)  # used by torch ops
                return s + (extra * extra).sum()

            w = W.clone().requires_grad_(True)
            loss = fs.shard_map(f, mesh=mesh, in_specs=("(dp r) c", f"({' '.join(axes)} b) c"), out_specs="")(
                w, X
            )
            loss.backward()
            out[combine] = (loss.detach(), w.grad)
    # one process: the same math on the global tensors (the psum makes the loss the global sum)
    wr = W.clone().requires_grad_(True)
    h = torch.tanh(X @ (3 * wr).T) + torch.tanh(X @ (3 * wr).T)
    ref = 3 * h.sum() + (wr * wr).sum()
    ref.backward()
    errs: list = []
    for combine, (loss, grad) in out.items():
        close(errs, f"combine={combine} loss", loss, ref.detach())
        close(errs, f"combine={combine} grad", grad, wr.grad)
    return errs


@pytest.mark.parametrize("sizes", [{"dp": 2}, {"dp": 2, "tp": 2}], ids=["1axis", "2axes"])
def test_custom_function_on_a_queued_result_gets_its_gradient(sizes):
    n = 1
    for s in sizes.values():
        n *= s
    X = torch.randn(4 * n, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    W = torch.randn(8, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64).float() * 0.3
    assert_ok(run_ranks(n, _rank_function_on_queued, sizes, X, W))
