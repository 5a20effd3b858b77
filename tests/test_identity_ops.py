"""Ops that may return their operand itself, on a replicated parameter used with dp-split data.

``w.to(x.device)``, ``w.float()`` of a float tensor, ``w.contiguous()`` of a contiguous one,
``w.requires_grad_()``, ``torch.atleast_1d(w)``, ``F.dropout(w, training=False)`` and the like
return ``w`` itself, not a new tensor (Hugging Face GPT-2 does ``position_embeds.to(device)``).
Such a result must neither become its own twin in the gradient buckets (it made shard_map
recurse without end), nor retag its operand as varying; and an in-place op on a function of a
parameter (``(w * 2).mul_(3)``) must not leave a twin of the old value behind (the call computed
with ``2 * w`` instead of ``6 * w`` without a word). Every case is run on real gloo ranks with
the default buckets, without buckets (``bucket_mb=None``) and with 1-byte buckets (a tap per
input), combining on and off, through ``fs.value_and_grad`` and ``loss.backward()``, on 1- and
2-axis meshes; loss and gradients are compared with the same computation by plain torch on the
global batch in one process. A small compiled case (aot_eager, fullgraph) is compared with eager
and with one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, env_vars, randn

ROWS, D = 8, 4
F64 = torch.float64


def _scaled(h, x):
    return (x * h).pow(2).sum() + (x * h).sum()


def _inplace_after_use(w, x):
    h = w * 2
    first = _scaled(h, x)
    h.mul_(3)  # h changed after a varying use: later uses see 6 w
    return first + _scaled(h, x)


def _inplace_on_base(w, x):
    h = w * 2
    v = h.view(-1)  # a view made before the base changes in place: it sees 6 w too
    h.mul_(3)
    return _scaled(v, x)


def _ops() -> dict:
    """name -> (dtype of w, term(w, x)): a scalar, a sum over the rows of ``x``."""
    one = {
        "to(device)": (F64, lambda w, x: w.to(x.device)),
        "to(dtype)": (F64, lambda w, x: w.to(F64)),
        "to(device, dtype)": (F64, lambda w, x: w.to(x.device, F64)),
        "to(other)": (F64, lambda w, x: w.to(x)),
        "type_as": (F64, lambda w, x: w.type_as(x)),
        "type(dtype)": (F64, lambda w, x: w.type(F64)),
        "double": (F64, lambda w, x: w.double()),
        "float": (torch.float32, lambda w, x: w.float()),
        "half": (torch.float16, lambda w, x: w.half()),
        "contiguous": (F64, lambda w, x: w.contiguous()),
        "view_as": (F64, lambda w, x: w.view_as(w)),
        "expand_as": (F64, lambda w, x: w.expand_as(w)),
        "reshape": (F64, lambda w, x: w.reshape(w.shape)),
        "view": (F64, lambda w, x: w.view(w.shape)),
        "flatten": (F64, lambda w, x: w.flatten()),
        "atleast_1d": (F64, lambda w, x: torch.atleast_1d(w)),
        "cpu": (F64, lambda w, x: w.cpu()),
        "conj": (F64, lambda w, x: w.conj()),
        "resolve_conj": (F64, lambda w, x: w.resolve_conj()),
        "sum_to_size": (F64, lambda w, x: w.sum_to_size(D)),
        "dropout(training=False)": (F64, lambda w, x: F.dropout(w, 0.5, training=False)),
        "requires_grad_": (F64, lambda w, x: w.requires_grad_()),
        "chained": (F64, lambda w, x: w.to(x.device).contiguous().double().type_as(x)),
        "detach": (F64, lambda w, x: w + w.detach()),
        ".data": (F64, lambda w, x: w + w.data),
        "mul_ (non-leaf)": (F64, lambda w, x: (w * 2).mul_(3)),
        "add_ (non-leaf)": (F64, lambda w, x: w.clone().add_(1.5)),
        "to(device).mul_": (F64, lambda w, x: (w * 2).to(x.device).mul_(3)),
    }
    ops = {k: (dt, lambda w, x, op=op: _scaled(op(w, x), x)) for k, (dt, op) in one.items()}
    ops["in place after a use"] = (F64, _inplace_after_use)
    ops["in place on a view's base"] = (F64, _inplace_on_base)
    return ops


BUCKETS = {"default": {}, "None": {"bucket_mb": None}, "1 byte": {"bucket_mb": 1 / 2**20}}


def _inputs(dtype):
    w = (randn(0, D) / 2).to(dtype)
    b = randn(1, D, dtype=F64) / 3  # a second parameter: two gradients to bucket
    x, z = randn(2, ROWS, D, dtype=F64), randn(3, ROWS, D, dtype=F64)
    c = randn(4, 2, D, dtype=F64)  # an invariant batch: the invariant uses of w
    return w, b, x, z, c


def _data(term, w, b, x):
    return term(w, x) + (x * b).sum()


def _reference(term, dtype, axes):
    """Loss and gradients of (w, b) by plain torch on the global batch in one process."""
    w, b, X, Z, c = _inputs(dtype)
    w, b = w.requires_grad_(), b.requires_grad_()
    if axes == 1:
        loss = _data(term, w, b, X)
    else:  # each pmean's axis has 2 ranks and the rows are split in 2 along it
        loss = (_data(term, w, b, X) + _data(term, w, b, Z)) / 2
    loss = loss + 0.25 * term(w, c)
    gw, gb = torch.autograd.grad(loss, (w, b))
    return loss.detach(), gw, gb


def _step(mesh, axes: int, world: int, term, kw):
    import fshard as fs

    if axes == 1:
        # pmean divides the sum over the rows by the world; the invariant use of w outside it
        def f(w, b, x, z, c):
            return fs.pmean(_data(term, w, b, x), "dp") * world + 0.25 * term(w, c)

        specs = ("...", "...", "(dp r) d", "...", "...")
    else:

        def f(w, b, x, z, c):
            data = fs.pmean(_data(term, w, b, x), "dp") + fs.pmean(_data(term, w, b, z), "tp")
            return data + 0.25 * term(w, c)

        specs = ("...", "...", "(dp r) d", "(tp r) d", "...")
    return fs.shard_map(f, mesh=mesh, in_specs=specs, out_specs="", **kw)


def _run(step, dtype, how):
    """``step``'s loss and the gradients of (w, b), by ``fs.value_and_grad`` or ``loss.backward()``."""
    import fshard as fs

    w, b, x, z, c = _inputs(dtype)
    w, b = w.requires_grad_(), b.requires_grad_()
    if how == "value_and_grad":
        loss, (gw, gb) = fs.value_and_grad(step, argnums=(0, 1))(w, b, x, z, c)
        return loss, gw, gb
    loss = step(w, b, x, z, c)
    loss.backward()
    return loss, w.grad, b.grad


def _rank_ops(axes: int, names: list):
    import torch.distributed as dist

    import fshard as fs

    world = dist.get_world_size()
    ops = _ops()
    errs: list[str] = []
    mesh = fs.Mesh(dp=world) if axes == 1 else fs.Mesh(dp=2, tp=world // 2)
    for name in names:
        dtype, term = ops[name]
        ref = _reference(term, dtype, axes)
        tol = dtype
        for bname, kw in BUCKETS.items():
            step = _step(mesh, axes, world, term, kw)
            for combine in (1, 0):
                for how in ("value_and_grad", "backward"):
                    what = f"{name}, buckets {bname}, combine={combine}, {how}"
                    try:
                        with env_vars(FSHARD_COMBINE=combine):
                            loss, gw, gb = _run(step, dtype, how)
                    except RecursionError:
                        errs.append(f"{what}: RecursionError")
                        continue
                    close(errs, f"{what}: loss", loss, ref[0], tol)
                    close(errs, f"{what}: grad w", gw, ref[1], tol)
                    close(errs, f"{what}: grad b", gb, ref[2])
    return errs


def _names():
    return list(_ops())


@pytest.mark.parametrize("half", [0, 1])  # (two jobs of half the ops each: shorter under load)
@pytest.mark.parametrize(("world", "axes"), [(2, 1), (4, 1), (4, 2)])
def test_ops_returning_their_operand_against_one_process(world, axes, half):
    assert_ok(run_ranks(world, _rank_ops, axes, _names()[half::2], timeout=110))


def _rank_operand_keeps_its_axes(bucket_mb):
    """An op that returns its invariant operand while another operand varies (``w.type_as(x)``,
    ``w.to(x)``) under ``torch.no_grad()``, or on a tensor that needs no gradient: the operand
    stays invariant (it was tagged varying, so that the uses of ``w`` after it went uncast and its
    gradient was not summed over the ranks, and an invariant output of ``c`` was refused)."""
    import fshard as fs

    errs: list[str] = []
    w, b, x, z, c = _inputs(F64)
    kw = {} if bucket_mb == "default" else {"bucket_mb": bucket_mb}

    def f(w, x, c):
        with torch.no_grad():
            w.type_as(x)  # (results that vary over dp: a norm for logging, say)
            w.to(x)
        c.type_as(x)
        c.to(x)
        return fs.pmean((x * w).pow(2).sum(), "dp"), c.sum()

    step = fs.shard_map(f, mesh=fs.Mesh(dp=2), in_specs=("...", "(dp r) d", "..."), out_specs=("", ""), **kw)
    for combine in (1, 0):
        wr = w.clone().requires_grad_()
        with env_vars(FSHARD_COMBINE=combine):
            loss, total = step(wr, x, c)
        loss.backward()
        W = w.clone().requires_grad_()
        ref = (x * W).pow(2).sum() / 2
        ref.backward()
        close(errs, f"combine={combine}: loss", loss, ref, F64)
        close(errs, f"combine={combine}: grad", wr.grad, W.grad, F64)
        close(errs, f"combine={combine}: c.sum()", total, c.sum(), F64)
    return errs


@pytest.mark.parametrize("bucket_mb", ["default", None, 1 / 2**20])
def test_an_operand_returned_keeps_its_axes(bucket_mb):
    assert_ok(run_ranks(2, _rank_operand_keeps_its_axes, bucket_mb))


def _body(w, b, x):
    """Ops returning their operand, ``w.T`` used twice and ``w.mT`` (compiled: Dynamo named them
    ``args[0].T``, and the pvary cache's identity check failed its own guard), an in-place op on
    a function of ``w`` after ``w`` itself was cast (compiled: the in-place rule compared the id of
    a tensor of the graph with the input's, which Dynamo refused); a sum over the rows of ``x``."""
    h = x @ w + x @ w.to(x.device).contiguous().double().type_as(x)
    h = h + x @ w.T + (x @ w.mT).pow(2) + (x @ w.T).sin()
    h = h + x @ (w * 2).mul_(3) + b.requires_grad_()
    return h.pow(2).sum()


def _rank_compiled():
    import fshard as fs

    torch._dynamo.reset()
    errs: list[str] = []
    n = 2

    def f(w, b, x):
        return fs.pmean(_body(w, b, x), "dp") * n + 0.25 * (w.T * w).sum()

    step = fs.shard_map(f, mesh=fs.Mesh(dp=n), in_specs=("...", "...", "(dp r) d"), out_specs="")
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    W, B, X = randn(5, D, D, dtype=F64) / 3, randn(6, D, dtype=F64) / 3, randn(7, ROWS, D, dtype=F64) / 2
    w, b = W.clone().requires_grad_(), B.clone().requires_grad_()
    ref = _body(w, b, X) + 0.25 * (w.T * w).sum()
    ref_grads = torch.autograd.grad(ref, (w, b))
    for name, fn in (("eager", step), ("compiled", compiled)):
        for call in range(2):  # the second call runs the compiled graph its guards let through
            w, b = W.clone().requires_grad_(), B.clone().requires_grad_()
            loss = fn(w, b, X)
            loss.backward()
            close(errs, f"{name} call {call}: loss", loss, ref, F64)
            close(errs, f"{name} call {call}: grad w", w.grad, ref_grads[0], F64)
            close(errs, f"{name} call {call}: grad b", b.grad, ref_grads[1], F64)
    return errs


def test_compiled_against_eager_and_one_process():
    assert_ok(run_ranks(2, _rank_compiled, timeout=110))
