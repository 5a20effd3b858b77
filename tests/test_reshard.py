"""``fs.reshard_after_forward`` (``fshard/_reshard.py``) on real gloo ranks.

The per-leaf FSDP step (``fs.all_gather`` of each split parameter, then plain torch) run with and
without the scope, against the same computation by plain torch on the global tensors in one
process: values and gradients, on 1-, 2- and 3-axis meshes (2, 4 and 8 ranks), for every form of
gather (combined per-leaf calls, the pytree call, calls one at a time with ``FSHARD_COMBINE=0``,
``async_op=True``, uneven blocks), the step outside and inside ``fs.value_and_grad``, with
``check=False``, and second order (``create_graph``). Each case also checks what the scope is for:

- no gathered result is alive when the backward starts (a probe at the loss looks; without the
  scope the saved ones are, so the probe can fail);
- the backward gathers again exactly what the forward gathered and autograd saved: one more
  all-gather per combined bucket, or per saved call.
"""

from __future__ import annotations

import contextlib
import weakref

import optree
import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, env_vars

# name -> (rows, cols, dtype); dim 0 is split over dp
LEAVES = {
    "w0": (4, 6, torch.float32),
    "b0": (4, None, torch.float32),
    "w1": (4, 4, torch.float32),
    "b1": (6, None, torch.float32),
    "w2": (6, 4, torch.float32),
    "s0": (2, 4, torch.float64),
    "s1": (4, None, torch.float64),
}
# the leaves autograd saves: not the biases (an add saves nothing), nor w0 (it meets the data
# only, and its gradient needs the data, not w0); s0 is saved as a view (s0.T)
SAVED = ("w1", "w2", "s0", "s1")
UNEVEN = {"w0": 5, "b1": 7}  # rows of the uneven case (5 over 2 ranks: blocks of 3 and 2)


def _params(uneven=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, (r, c, dt) in LEAVES.items():
        r = UNEVEN.get(k, r) if uneven else r
        shape = (r,) if c is None else (r, c)
        out[k] = (torch.randn(*shape, generator=g, dtype=torch.float64) * 0.5).to(dt)
    return out


def _model(w, x):
    """Plain torch on full parameters: a scalar loss (float64)."""
    h = torch.tanh(x @ w["w0"][:4] + w["b1"][:6])  # [b, 6] (the uneven case uses the first rows)
    h = torch.tanh(h @ w["w2"])  # [b, 4]
    h = torch.tanh(h @ w["w1"] + w["b0"])
    hd = h.double()
    return (hd @ w["s0"].T).pow(2).sum() + (hd * w["s1"]).sum()


def _reference(X, uneven, second):
    w = {k: v.clone().requires_grad_(True) for k, v in _params(uneven).items()}
    loss = _model(w, X)
    grads = torch.autograd.grad(loss, list(w.values()), create_graph=second)
    if not second:
        return loss.detach(), dict(zip(w, grads)), None
    # a Hessian-vector product: d/dw of sum_k <grad_k, v_k>, v = the parameters themselves
    hvp = torch.autograd.grad(
        sum((g * p.detach()).sum() for g, p in zip(grads, w.values())), list(w.values())
    )
    return loss.detach(), {k: g.detach() for k, g in zip(w, grads)}, dict(zip(w, hvp))


class _Probe(torch.autograd.Function):
    """Identity on the loss whose backward (the first node of the backward) notes which of the
    weakly referenced gathered results are still alive."""

    @staticmethod
    def forward(ctx, x, refs, seen):
        ctx.refs, ctx.seen = refs, seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, ct):
        ctx.seen.append(sorted(k for k, r in ctx.refs.items() if r() is not None))
        return ct, None, None


def _gather(p, form):
    if form == "tree":
        return fs.all_gather(p, "dp", dim=0, tiled=True)
    if form == "async":
        pending = {k: fs.all_gather(t, "dp", dim=0, tiled=True, async_op=True) for k, t in p.items()}
        return {k: h.wait() for k, h in pending.items()}
    return optree.tree_map(lambda t: fs.all_gather(t, "dp", dim=0, tiled=True), p)


def _loss_fn(mesh, form, scope, refs, seen, probe=True):
    axes = tuple(mesh.axis_names)

    def f(p, x):
        with fs.reshard_after_forward() if scope else contextlib.nullcontext():
            w = _gather(p, form)
            if refs is not None:  # (not while compiling: Dynamo would trace the weak references)
                for k, t in w.items():
                    refs[k] = weakref.ref(t)
            loss = _model(w, x)
            if probe:
                loss = _Probe.apply(loss, refs, seen)
        return fs.psum(loss, axes)

    return f


def _case(mesh, X, form, combine, where, check, scope, second, uneven):
    """One step; returns (loss, grads, hvp or None, probe, forward counts, backward counts)."""
    axes = tuple(mesh.axis_names)
    refs: dict = {}
    seen: list = []
    f = _loss_fn(mesh, form, scope, refs, seen)
    specs = ("(dp r) ...", f"({' '.join(axes)} b) d")
    params = {k: v.clone().requires_grad_(True) for k, v in _params(uneven).items()}
    with env_vars(FSHARD_COMBINE=combine):
        if where == "inner":  # the backward inside the call: gradients come out as blocks
            step = fs.shard_map(
                fs.value_and_grad(f), mesh=mesh, in_specs=specs, out_specs=("", "(dp r) ..."), check=check
            )
            with fs.count_collectives() as fwd:
                loss, grads = step(params, X)
            bwd = fwd
            grads = {k: v.full() for k, v in grads.items()}
            return loss, grads, None, seen, fwd, bwd
        step = fs.shard_map(f, mesh=mesh, in_specs=specs, out_specs="", check=check)
        with fs.count_collectives() as fwd:
            loss = step(params, X)
        with fs.count_collectives() as bwd:
            grads = torch.autograd.grad(loss, list(params.values()), create_graph=second)
        hvp = None
        if second:
            total = sum((g * p.detach()).sum() for g, p in zip(grads, params.values()))
            hvp = dict(zip(params, torch.autograd.grad(total, list(params.values()))))
        return loss, dict(zip(params, grads)), hvp, seen, fwd, bwd


# form, FSHARD_COMBINE, where the backward runs, check, second order, uneven blocks
CASES = [
    ("leaf", "1", "outer", True, False, False),
    ("tree", "1", "outer", True, False, False),
    ("leaf", "0", "outer", True, False, False),
    ("async", "1", "outer", True, False, False),
    ("leaf", "1", "inner", True, False, False),
    ("leaf", "1", "outer", False, False, False),
    ("leaf", "1", "outer", True, True, False),
    ("leaf", "1", "outer", True, False, True),
    ("tree", "1", "outer", True, False, True),
    ("tree", "0", "outer", True, False, True),
]


def _rank_table(sizes: dict, X):
    mesh = fs.Mesh(**sizes)
    errs: list = []
    ag = ("all_gather", ("dp",))
    for form, combine, where, check, second, uneven in CASES:
        what = f"{form} combine={combine} {where} check={check} second={second} uneven={uneven}"
        want_loss, want_grads, want_hvp = _reference(X, uneven, second)
        counts = {}
        for scope in (False, True):
            loss, grads, hvp, seen, fwd, bwd = _case(
                mesh, X, form, combine, where, check, scope, second, uneven
            )
            tag = f"{what} scope={scope}"
            close(errs, f"{tag} loss", loss, want_loss, torch.float64)
            for k in LEAVES:
                tol = torch.float64 if k.startswith("s") else torch.float32
                close(errs, f"{tag} grad {k}", grads[k], want_grads[k], tol)
                if second:
                    close(errs, f"{tag} hvp {k}", hvp[k], want_hvp[k], tol)
            alive = seen[0] if seen else None
            if scope and alive != []:
                errs.append(f"{tag}: gathered results alive when the backward starts: {alive}")
            if not scope and (not alive or not set(SAVED) <= set(alive)):
                errs.append(f"{tag}: the probe saw {alive} alive without the scope, want at least {SAVED}")
            counts[scope] = (fwd.by_kind()[ag], bwd.by_kind()[ag])
        (f0, b0), (f1, b1) = counts[False], counts[True]
        if where == "inner":  # one count for the whole call: the extra gathers are the regathers
            extra = f1 - f0
            gathered = f0 - 2 * len(LEAVES) * 0  # (no gradient gathers of global inputs inside)
        else:
            extra = b1 - b0
            gathered = f1
        if f1 != f0 and where != "inner":
            errs.append(f"{what}: the forward gathered {f1} times with the scope, {f0} without")
        combined = combine == "1" and form in ("leaf", "tree") and not uneven
        want = gathered if combined else len(SAVED)
        if where == "inner":
            want = f0 if combined else len(SAVED)
        if form == "tree" and uneven:  # one coalesced all-gather per dtype (padded), each regathered once
            want = len({dt for _, _, dt in LEAVES.values()})
        if second:  # the create_graph gathers are differentiable (a coalesced call, or one per call)
            want = extra
        if extra != want:
            errs.append(f"{what}: the backward gathered {extra} more times with the scope, want {want}")
    return errs


@pytest.mark.parametrize(
    "sizes", [{"dp": 2}, {"dp": 2, "tp": 2}, {"pp": 2, "dp": 2, "tp": 2}], ids=["1axis", "2axes", "3axes"]
)
def test_reshard_after_forward_matches_one_process_and_frees(sizes):
    n = 1
    for s in sizes.values():
        n *= s
    X = torch.randn(4 * n, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64).float()
    assert_ok(run_ranks(n, _rank_table, sizes, X, timeout=110))


def _rank_modified(X):
    mesh = fs.Mesh(dp=2)
    refs: dict = {}
    f = _loss_fn(mesh, "leaf", True, refs, [])
    params = {k: v.clone().requires_grad_(True) for k, v in _params().items()}
    loss = fs.shard_map(f, mesh=mesh, in_specs=("(dp r) ...", "(dp b) d"), out_specs="")(params, X)
    with torch.no_grad():
        params["w1"].add_(1.0)  # before the backward: its shard is gathered again there
    try:
        loss.backward()
    except fs.ArgumentError as e:
        return str(e)
    return "no error"


def test_reshard_after_forward_refuses_a_shard_changed_before_the_backward():
    X = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    got = run_ranks(2, _rank_modified, X)
    want = (
        "fs.reshard_after_forward: the operand of an fs.all_gather (a float32 shard of shape (2, 4)) "
        "was modified in place between the forward and the backward, which gathers it again; update "
        "parameters after the backward, or gather outside fs.reshard_after_forward to keep the "
        "gathered copy"
    )
    assert got == [want, want]


def _rank_transformed(X):
    """Under torch.func.grad (which refuses saved-tensor hooks) the scope keeps the results: the
    same gradients as one process, no extra all-gather."""
    mesh = fs.Mesh(dp=2)
    f = fs.shard_map(
        _loss_fn(mesh, "leaf", True, {}, [], probe=False),
        mesh=mesh,
        in_specs=("(dp r) ...", "(dp b) d"),
        out_specs="",
    )
    params = _params()
    with fs.count_collectives() as counts:
        grads = torch.func.grad(lambda p: f(p, X))(params)
    _, want, _ = _reference(X, False, False)
    errs: list = []
    for k in LEAVES:
        close(errs, f"grad {k}", grads[k], want[k], torch.float64 if k.startswith("s") else torch.float32)
    got = counts.by_kind()[("all_gather", ("dp",))]
    plain = fs.shard_map(
        _loss_fn(mesh, "leaf", False, {}, [], probe=False),
        mesh=mesh,
        in_specs=("(dp r) ...", "(dp b) d"),
        out_specs="",
    )
    with fs.count_collectives() as counts:
        torch.func.grad(lambda p: plain(p, X))(params)
    if got != counts.by_kind()[("all_gather", ("dp",))]:
        errs.append(f"{got} all-gathers with the scope, {counts.by_kind()} without")
    return errs


def test_reshard_after_forward_under_torch_func_keeps_the_results():
    X = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    assert_ok(run_ranks(2, _rank_transformed, X))


def _rank_compiled(X):
    """Under fs.compile the scope is traced as a no-op (the compiled backward keeps or recomputes
    what its partitioner decides): the same values and gradients as one process, one graph."""
    mesh = fs.Mesh(dp=2)
    f = fs.shard_map(
        _loss_fn(mesh, "leaf", True, None, [], probe=False),
        mesh=mesh,
        in_specs=("(dp r) ...", "(dp b) d"),
        out_specs="",
    )
    step = fs.compile(fs.value_and_grad(f), backend="aot_eager")
    params = _params()
    errs: list = []
    want_loss, want, _ = _reference(X, False, False)
    for _ in range(2):  # the second call reuses the graph
        loss, grads = step(params, X)
        close(errs, "loss", loss, want_loss, torch.float64)
        for k in LEAVES:
            close(errs, f"grad {k}", grads[k], want[k], torch.float64 if k.startswith("s") else torch.float32)
    return errs


def test_reshard_after_forward_compiled_matches_one_process():
    X = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    assert_ok(run_ranks(2, _rank_compiled, X, timeout=110))


def _rank_with_others(X, W):
    """The scope with fs.remat around each layer, with fs.fsdp_scan (which frees per layer itself),
    and across fs.no_sync micro-batches: the one process's gradients every time."""
    mesh = fs.Mesh(dp=2)
    specs = [{"w": "(dp d) f"}] * len(W)

    def block(p, h):
        return torch.tanh(h @ p["w"])

    errs: list = []
    wr = [{"w": w.clone().requires_grad_(True)} for w in W]
    h = X
    for p in wr:
        h = block(p, h)
    h.pow(2).mean().backward()
    for mode in ("remat", "fsdp_scan", "no_sync"):
        params = [{"w": fs.shard(w, mesh, "(dp d) f").requires_grad_()} for w in W]

        @fs.shard_map(mesh=mesh, in_specs=(specs, "(dp b) d"), out_specs="")
        def loss_fn(ps, x, mode=mode):
            with fs.reshard_after_forward():
                h = x
                if mode == "fsdp_scan":
                    h = fs.fsdp_scan(block, ps, h, "dp", dims=specs)
                else:
                    for p in ps:
                        full = optree.tree_map(lambda t: fs.all_gather(t, "dp", dim=0, tiled=True), p)
                        h = fs.remat(block)(full, h) if mode == "remat" else block(full, h)
                return fs.pmean(h.pow(2).mean(), "dp")

        if mode == "no_sync":  # two micro-batches of the same data: twice the gradient
            with fs.no_sync():
                loss_fn(params, X).backward()
        loss_fn(params, X).backward()
        n = 2 if mode == "no_sync" else 1
        for i, (p, r) in enumerate(zip(params, wr)):
            close(errs, f"{mode} grad {i}", p["w"].grad.full() / n, r["w"].grad)
    return errs


def test_reshard_after_forward_with_remat_fsdp_scan_and_no_sync():
    g = torch.Generator().manual_seed(5)
    X = torch.randn(8, 4, generator=g)
    W = [torch.randn(4, 4, generator=g) * 0.5 for _ in range(3)]
    assert_ok(run_ranks(2, _rank_with_others, X, W))
