"""Autodiff through shard_map: a matrix of programs x layouts x world sizes.

Every case runs on real gloo ranks (the session's rank pools, see conftest.py). Each rank
builds the same global tensors from fixed seeds, runs the program with fshard, runs the
same math in plain torch on the global tensors (the single-process reference), and
compares values and gradients at tight tolerances. It also asserts the exact collectives
fshard issued, forward and backward, as ``(kind, axes, nbytes)`` records
(``fs.count_collectives``). Rank functions return a list of problems (empty when all is
well) so the assertion message shows every mismatch of every rank at once.

Gradient paths:

* ``inside``: the VJP is taken inside the shard_map'd function (``torch.autograd.grad``
  on local tensors with this rank's block of the cotangent) and the gradients are
  returned as outputs with their parameter's spec.
* ``outside-sharded`` / ``outside-plain``: the shard_map'd function is differentiated
  from outside, on global values. Split inputs are passed as ``fs.Sharded`` (their
  ``.grad`` is Sharded) or as plain global tensors (their ``.grad`` is the full gradient
  on every rank, which costs one all_gather per split dim in the backward).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import run_ranks

TOL = {"float32": (1e-5, 1e-6), "float64": (1e-10, 1e-12)}
PATHS = ("inside", "outside-sharded", "outside-plain")


# == helpers (run inside the ranks) =========================================================


def _randn(seed, *shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)


def _close(errs, what, got, want, dtype):
    rtol, atol = TOL[str(dtype).replace("torch.", "")]
    if got is None:
        errs.append(f"{what}: got None")
        return
    got, want = got.detach(), want.detach()
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        errs.append(f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
        return
    if not torch.allclose(got, want, rtol=rtol, atol=atol):
        err = (got - want).abs().max().item()
        errs.append(f"{what}: max abs error {err:.3g} (max |want| {want.abs().max().item():.3g})")


def _want(mesh, records):
    """Expected records as a Counter; fshard issues nothing over axes of total size 1."""
    return Counter((k, tuple(a), int(n)) for k, a, n in records if math.prod(mesh.shape[x] for x in a) > 1)


def _check_counts(errs, what, counts, want):
    got = Counter(counts.records)
    if got != want:
        errs.append(
            f"{what}: collectives differ\n      got  {sorted(got.items())}\n      want {sorted(want.items())}"
        )


def _spec_dims(spec, mesh):
    """The mesh axes splitting each dim of an einops-style spec (labels dropped)."""
    dims = []
    for m in re.finditer(r"\(([^)]*)\)|(\S+)", spec.split("|")[0]):
        names = (m.group(1) or m.group(2)).split()
        dims.append(tuple(n for n in names if n in mesh.shape))
    return dims


def _is_split(spec, mesh):
    return any(_spec_dims(spec, mesh))


def _local_slice_backward(mesh, spec, shape, elsize):
    """Records of the all_gathers that the backward of slicing a plain global input issues."""
    shape = list(shape)
    out = []
    for d, axes in enumerate(_spec_dims(spec, mesh)):
        if axes:
            shape[d] //= math.prod(mesh.shape[a] for a in axes)
            out.append(("all_gather", axes, math.prod(shape) * elsize))
    return out


def _full(x):
    import fshard as fs

    return x.full() if isinstance(x, fs.Sharded) else x


def _mse(a, b):
    return ((a - b) ** 2).mean()


def _attention(q, k, v):
    """Causal softmax attention on (..., s, e) tensors."""
    s = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return scores.softmax(-1) @ v


# == programs ===============================================================================
#
# A program builder returns: global inputs, in_specs, the names to differentiate, the
# per-shard function (with collectives), the reference (plain torch on global tensors),
# the out_spec, and the exact forward / backward collective records of the canonical run
# (split inputs as Sharded or differentiated inside f).


def _p_worked(mesh, dtype, diff=("x",)):
    """SEMANTICS.md: f(x, y) = psum(x * y, "dp") + x, x replicated, y split: d/dx = sum(y) + 1."""
    import fshard as fs

    n, e = mesh.size, dtype.itemsize
    inputs = {"x": _randn(1, 3, dtype=dtype), "y": _randn(2, 2 * n, 3, dtype=dtype)}
    return SimpleNamespace(
        inputs=inputs,
        specs={"x": "d", "y": "(dp n) d"},
        diff=tuple(diff),
        local=lambda t: fs.psum((t["x"] * t["y"]).sum(0), "dp") + t["x"],
        ref=lambda t: (t["x"] * t["y"]).sum(0) + t["x"],
        out_spec="d",
        fwd=[("all_reduce", ("dp",), 3 * e)],
        bwd=[("all_reduce", ("dp",), 3 * e)] if "x" in diff else [],
    )


def _mlp_params(dtype, d, h, o):
    return {
        "w1": _randn(10, d, h, dtype=dtype) / math.sqrt(d),
        "b1": _randn(11, h, dtype=dtype) * 0.1,
        "w2": _randn(12, h, o, dtype=dtype) / math.sqrt(h),
        "b2": _randn(13, o, dtype=dtype) * 0.1,
    }


def _mlp(t, x):
    return torch.tanh(x @ t["w1"] + t["b1"]) @ t["w2"] + t["b2"]


def _p_dp_mlp(mesh, dtype, diff=("w1", "b1", "w2", "b2")):
    """Data parallel: replicated params, batch split over dp, loss = pmean(local loss)."""
    import fshard as fs

    n, e = mesh.size, dtype.itemsize
    inputs = _mlp_params(dtype, 4, 6, 3)
    inputs["x"] = _randn(20, 2 * n, 4, dtype=dtype)
    inputs["y"] = _randn(21, 2 * n, 3, dtype=dtype)
    return SimpleNamespace(
        inputs=inputs,
        specs={"w1": "d h", "b1": "h", "w2": "h o", "b2": "o", "x": "(dp b) d", "y": "(dp b) o"},
        diff=tuple(diff),
        local=lambda t: fs.pmean(_mse(_mlp(t, t["x"]), t["y"]), "dp"),
        ref=lambda t: _mse(_mlp(t, t["x"]), t["y"]),
        out_spec="",
        fwd=[("all_reduce", ("dp",), e)],
        bwd=[("all_reduce", ("dp",), inputs[p].numel() * e) for p in diff],
    )


def _p_fsdp(mesh, dtype, invariant=False):
    """FSDP: params split over dp on dim 0, all_gathered inside f (backward: reduce_scatter)."""
    import fshard as fs

    n, e = mesh.size, dtype.itemsize
    inputs = _mlp_params(dtype, 8, 8, 4)
    inputs["x"] = _randn(20, 2 * n, 8, dtype=dtype)
    inputs["y"] = _randn(21, 2 * n, 4, dtype=dtype)
    params = ("w1", "b1", "w2", "b2")

    def local(t):
        g = {p: fs.all_gather(t[p], "dp", dim=0, tiled=True, invariant=invariant) for p in params}
        return fs.pmean(_mse(_mlp(g, t["x"]), t["y"]), "dp")

    full = {p: inputs[p].numel() * e for p in params}
    if invariant:  # gathered value is replicated: pvary at use, backward one all_reduce of it
        bwd = [("all_reduce", ("dp",), full[p]) for p in params]
    else:
        bwd = [("reduce_scatter", ("dp",), full[p]) for p in params]
    return SimpleNamespace(
        inputs=inputs,
        specs={
            "w1": "(dp d) h",
            "b1": "(dp h)",
            "w2": "(dp h) o",
            "b2": "(dp o)",
            "x": "(dp b) d",
            "y": "(dp b) o",
        },
        diff=params,
        local=local,
        ref=lambda t: _mse(_mlp(t, t["x"]), t["y"]),
        out_spec="",
        fwd=[("all_gather", ("dp",), full[p] // n) for p in params] + [("all_reduce", ("dp",), e)],
        bwd=bwd,
    )


def _gelu_mlp(t, x):
    return torch.nn.functional.gelu(x @ t["w1"] + t["b1"]) @ t["w2"]


def _p_tp_mlp(mesh, dtype, x_grad=False):
    """Megatron MLP: W1 column-split, W2 row-split, x replicated; one psum forward."""
    import fshard as fs

    n, e = mesh.size, dtype.itemsize
    b, k = 3, 4
    inputs = {
        "x": _randn(1, b, k, dtype=dtype),
        "w1": _randn(2, k, 2 * n, dtype=dtype) / 2,
        "b1": _randn(3, 2 * n, dtype=dtype) * 0.1,
        "w2": _randn(4, 2 * n, k, dtype=dtype) / math.sqrt(2 * n),
        "b2": _randn(5, k, dtype=dtype) * 0.1,
    }
    diff = ("w1", "b1", "w2", "b2") + (("x",) if x_grad else ())
    return SimpleNamespace(
        inputs=inputs,
        specs={"x": "b k", "w1": "k (tp n)", "b1": "(tp n)", "w2": "(tp n) k", "b2": "k"},
        diff=diff,
        local=lambda t: fs.psum(_gelu_mlp(t, t["x"]), "tp") + t["b2"],
        ref=lambda t: _gelu_mlp(t, t["x"]) + t["b2"],
        out_spec="b k",
        fwd=[("all_reduce", ("tp",), b * k * e)],
        bwd=[("all_reduce", ("tp",), b * k * e)] if x_grad else [],
    )


def _heads_attention(x, wq, wk, wv, eh):
    def heads(w):
        return (x @ w).unflatten(-1, (-1, eh)).transpose(1, 2)  # (b, h, s, eh)

    o = _attention(heads(wq), heads(wk), heads(wv))
    return o.transpose(1, 2).flatten(2)


def _p_tp_attn(mesh, dtype, x_grad=False):
    """Attention with heads split over tp: q/k/v column-split, out-projection row-split."""
    import fshard as fs

    e = dtype.itemsize
    b, s, d, h, eh = 2, 5, 6, 4, 2
    inputs = {
        "x": _randn(1, b, s, d, dtype=dtype),
        "wq": _randn(2, d, h * eh, dtype=dtype) / math.sqrt(d),
        "wk": _randn(3, d, h * eh, dtype=dtype) / math.sqrt(d),
        "wv": _randn(4, d, h * eh, dtype=dtype) / math.sqrt(d),
        "wo": _randn(5, h * eh, d, dtype=dtype) / math.sqrt(h * eh),
    }

    def body(t):
        return _heads_attention(t["x"], t["wq"], t["wk"], t["wv"], eh) @ t["wo"]

    diff = ("wq", "wk", "wv", "wo") + (("x",) if x_grad else ())
    return SimpleNamespace(
        inputs=inputs,
        specs={"x": "b s d", "wq": "d (tp f)", "wk": "d (tp f)", "wv": "d (tp f)", "wo": "(tp f) d"},
        diff=diff,
        local=lambda t: fs.psum(body(t), "tp"),
        ref=body,
        out_spec="b s d",
        fwd=[("all_reduce", ("tp",), b * s * d * e)],
        # x meets three tp-varying weights but is cast once: one all_reduce
        bwd=[("all_reduce", ("tp",), b * s * d * e)] if x_grad else [],
    )


def _p_dp_tp(mesh, dtype):
    """2-D mesh: batch over dp, Megatron MLP over tp, loss = pmean over dp."""
    import fshard as fs

    ndp, ntp, e = mesh.shape["dp"], mesh.shape["tp"], dtype.itemsize
    b, k, hn = 2, 4, 2
    inputs = {
        "x": _randn(1, ndp * b, k, dtype=dtype),
        "y": _randn(2, ndp * b, k, dtype=dtype),
        "w1": _randn(3, k, ntp * hn, dtype=dtype) / 2,
        "b1": _randn(4, ntp * hn, dtype=dtype) * 0.1,
        "w2": _randn(5, ntp * hn, k, dtype=dtype) / math.sqrt(ntp * hn),
        "b2": _randn(6, k, dtype=dtype) * 0.1,
    }
    params = ("w1", "b1", "w2", "b2")
    return SimpleNamespace(
        inputs=inputs,
        specs={
            "x": "(dp b) k",
            "y": "(dp b) k",
            "w1": "k (tp n)",
            "b1": "(tp n)",
            "w2": "(tp n) k",
            "b2": "k",
        },
        diff=params,
        local=lambda t: fs.pmean(_mse(fs.psum(_gelu_mlp(t, t["x"]), "tp") + t["b2"], t["y"]), "dp"),
        ref=lambda t: _mse(_gelu_mlp(t, t["x"]) + t["b2"], t["y"]),
        out_spec="",
        fwd=[("all_reduce", ("tp",), b * k * e), ("all_reduce", ("dp",), e)],
        bwd=[
            ("all_reduce", ("dp",), inputs[p].numel() // (ntp if p in ("w1", "b1", "w2") else 1) * e)
            for p in params
        ],
    )


def _p_fsdp_tp(mesh, dtype):
    """FSDP over dp on top of Megatron TP: every parameter split over dp, gathered inside f."""
    import fshard as fs

    ndp, ntp, e = mesh.shape["dp"], mesh.shape["tp"], dtype.itemsize
    b, k, hn = 2, 4, 2
    inputs = {
        "x": _randn(1, ndp * b, k, dtype=dtype),
        "y": _randn(2, ndp * b, k, dtype=dtype),
        "w1": _randn(3, k, ntp * hn, dtype=dtype) / 2,
        "b1": _randn(4, ntp * hn, dtype=dtype) * 0.1,
        "w2": _randn(5, ntp * hn, k, dtype=dtype) / math.sqrt(ntp * hn),
        "b2": _randn(6, k, dtype=dtype) * 0.1,
    }
    params = ("w1", "b1", "w2", "b2")
    gdim = {"w1": 0, "b1": 0, "w2": 1, "b2": 0}

    def local(t):
        g = dict(t)
        for p in params:
            g[p] = fs.all_gather(t[p], "dp", dim=gdim[p], tiled=True)
        return fs.pmean(_mse(fs.psum(_gelu_mlp(g, g["x"]), "tp") + g["b2"], g["y"]), "dp")

    gathered = {p: inputs[p].numel() // (ntp if p != "b2" else 1) * e for p in params}
    return SimpleNamespace(
        inputs=inputs,
        specs={
            "x": "(dp b) k",
            "y": "(dp b) k",
            "w1": "(dp k) (tp n)",
            "b1": "(tp dp n)",
            "w2": "(tp n) (dp k)",
            "b2": "(dp k)",
        },
        diff=params,
        local=local,
        ref=lambda t: _mse(_gelu_mlp(t, t["x"]) + t["b2"], t["y"]),
        out_spec="",
        fwd=[("all_gather", ("dp",), gathered[p] // ndp) for p in params]
        + [("all_reduce", ("tp",), b * k * e), ("all_reduce", ("dp",), e)],
        bwd=[("reduce_scatter", ("dp",), gathered[p]) for p in params],
    )


def _p_ulysses(mesh, dtype):
    """Ulysses sequence parallel: seq-split -> all_to_all -> head-split attention -> back."""
    import fshard as fs

    n, e = mesh.size, dtype.itemsize
    b, s, d, h, eh = 2, 8, 6, 4, 2
    inputs = {
        "x": _randn(1, b, s, d, dtype=dtype),
        "wq": _randn(2, d, h * eh, dtype=dtype) / math.sqrt(d),
        "wk": _randn(3, d, h * eh, dtype=dtype) / math.sqrt(d),
        "wv": _randn(4, d, h * eh, dtype=dtype) / math.sqrt(d),
        "wo": _randn(5, h * eh, d, dtype=dtype) / math.sqrt(h * eh),
    }

    def local(t):
        x = t["x"]  # (b, s/n, d)

        def heads(w):
            q = (x @ w).unflatten(-1, (h, eh))  # (b, s/n, h, eh)
            q = fs.all_to_all(q, "sp", split_dim=2, concat_dim=1)  # (b, s, h/n, eh)
            return q.transpose(1, 2)

        o = _attention(heads(t["wq"]), heads(t["wk"]), heads(t["wv"])).transpose(1, 2)  # (b, s, h/n, eh)
        o = fs.all_to_all(o, "sp", split_dim=1, concat_dim=2)  # (b, s/n, h, eh)
        return o.flatten(2) @ t["wo"]

    def ref(t):
        return _heads_attention(t["x"], t["wq"], t["wk"], t["wv"], eh) @ t["wo"]

    a2a = ("all_to_all", ("sp",), b * (s // n) * h * eh * e)
    params = ("wq", "wk", "wv", "wo")
    return SimpleNamespace(
        inputs=inputs,
        specs={"x": "b (sp s) d", "wq": "d f", "wk": "d f", "wv": "d f", "wo": "f d"},
        diff=params,
        local=local,
        ref=ref,
        out_spec="b (sp s) d",
        fwd=[a2a] * 4,
        bwd=[a2a] * 4 + [("all_reduce", ("sp",), inputs[p].numel() * e) for p in params],
    )


def _p_cmatmul(mesh, dtype):
    """Collective matmul: x row-split, W column-split; W blocks travel around a ppermute ring."""
    import fshard as fs

    n, e = mesh.size, dtype.itemsize
    m, k, nn = 2, 3, 2
    inputs = {"x": _randn(1, n * m, k, dtype=dtype), "w": _randn(2, k, n * nn, dtype=dtype)}
    me = mesh.axis_index("tp")
    ring = [(j, (j - 1) % n) for j in range(n)]  # index j+1's block arrives at j

    def local(t):
        cur, blocks = t["w"], [None] * n
        for step in range(n):
            blocks[(me + step) % n] = t["x"] @ cur
            if step < n - 1:
                cur = fs.ppermute(cur, "tp", ring)
        return torch.cat(blocks, dim=1)

    rec = ("ppermute", ("tp",), k * nn * e)
    return SimpleNamespace(
        inputs=inputs,
        specs={"x": "(tp m) k", "w": "k (tp n)"},
        diff=("x", "w"),
        local=local,
        ref=lambda t: t["x"] @ t["w"],
        out_spec="(tp m) n",
        fwd=[rec] * (n - 1),
        bwd=[rec] * (n - 1),
    )


def _p_pipeline(mesh, dtype, microbatches=3):
    """GPipe: one tanh layer per stage over "pp", microbatches streamed with ppermute."""
    import fshard as fs

    p, e = mesh.size, dtype.itemsize
    mb, b, d = microbatches, 2, 4
    inputs = {"w": _randn(1, p, d, d, dtype=dtype) / math.sqrt(d), "x": _randn(2, mb, b, d, dtype=dtype)}
    stage = mesh.axis_index("pp")
    fwd_pairs = [(i, i + 1) for i in range(p - 1)]

    def local(t):
        w, x = t["w"][0], t["x"]
        idx = fs.axis_index("pp")
        first, last = idx == 0, idx == p - 1
        recv, outs = None, []
        for step in range(mb + p - 1):
            fresh = x[step] if step < mb else torch.zeros_like(x[0])
            inp = fresh if recv is None else torch.where(first, fresh, recv)
            hid = torch.tanh(inp @ w)
            if step >= p - 1:
                outs.append(hid)
            if step < mb + p - 2:
                recv = fs.ppermute(hid, "pp", fwd_pairs)
        y = torch.stack(outs)
        return fs.psum(torch.where(last, y, torch.zeros_like(y)), "pp")

    def ref(t):
        outs = []
        for i in range(mb):
            hid = t["x"][i]
            for j in range(p):
                hid = torch.tanh(hid @ t["w"][j])
            outs.append(hid)
        return torch.stack(outs)

    hops = mb + p - 2
    return SimpleNamespace(
        inputs=inputs,
        specs={"w": "(pp l) d e", "x": "m b d"},
        diff=("w",),
        local=local,
        ref=ref,
        out_spec="m b d",
        fwd=[("ppermute", ("pp",), b * d * e if stage < p - 1 else 0)] * hops
        + [("all_reduce", ("pp",), mb * b * d * e)],
        bwd=[("ppermute", ("pp",), b * d * e if stage > 0 else 0)] * hops,
    )


def _p_dp_out(mesh, dtype):
    """Data parallel with a split output (per-example predictions): one all_reduce per parameter."""
    n, e = mesh.size, dtype.itemsize
    inputs = _mlp_params(dtype, 4, 6, 3)
    inputs["x"] = _randn(20, 2 * n, 4, dtype=dtype)
    params = ("w1", "b1", "w2", "b2")
    return SimpleNamespace(
        inputs=inputs,
        specs={"w1": "d h", "b1": "h", "w2": "h o", "b2": "o", "x": "(dp b) d"},
        diff=params,
        local=lambda t: _mlp(t, t["x"]),
        ref=lambda t: _mlp(t, t["x"]),
        out_spec="(dp b) o",
        fwd=[],
        bwd=[("all_reduce", ("dp",), inputs[p].numel() * e) for p in params],
    )


def _p_tp_partial(mesh, dtype, scatter=False):
    """Megatron MLP returning the unreduced partial sum; out_spec '| sum(tp)' reduces it on the way out.

    With ``scatter`` the rows are also split over tp, so the reduction is a reduce_scatter
    (sequence-parallel style) whose backward is an all_gather.
    """
    n, e = mesh.size, dtype.itemsize
    b, k = 2 * n, 4
    inputs = {
        "x": _randn(1, b, k, dtype=dtype),
        "w1": _randn(2, k, 2 * n, dtype=dtype) / 2,
        "b1": _randn(3, 2 * n, dtype=dtype) * 0.1,
        "w2": _randn(4, 2 * n, k, dtype=dtype) / math.sqrt(2 * n),
    }
    if scatter:
        out_spec, fwd, bwd = (
            "(tp b) k | sum(tp)",
            [("reduce_scatter", ("tp",), b * k * e)],
            [("all_gather", ("tp",), b // n * k * e)],
        )
    else:
        out_spec, fwd, bwd = "b k | sum(tp)", [("all_reduce", ("tp",), b * k * e)], []
    return SimpleNamespace(
        inputs=inputs,
        specs={"x": "b k", "w1": "k (tp n)", "b1": "(tp n)", "w2": "(tp n) k"},
        diff=("w1", "b1", "w2"),
        local=lambda t: _gelu_mlp(t, t["x"]),
        ref=lambda t: _gelu_mlp(t, t["x"]),
        out_spec=out_spec,
        fwd=fwd,
        bwd=bwd,
        # inside f the value is the local partial sum (full rows): its cotangent is the whole ct
        paths=("outside-sharded", "outside-plain") if scatter else PATHS,
    )


def _p_reshard(mesh, dtype):
    """A Sharded input in another layout than its in_spec is moved by one all_to_all (and back in the backward)."""
    import fshard as fs

    n, e = mesh.size, dtype.itemsize
    b, d, o = 2 * n, 2 * n, 3
    inputs = {"x": _randn(1, b, d, dtype=dtype), "w": _randn(2, d, o, dtype=dtype)}
    a2a = ("all_to_all", ("dp",), b * d // n * e)
    return SimpleNamespace(
        inputs=inputs,
        specs={"x": "b (dp d)", "w": "(dp d) o"},
        shard_specs={"x": "(dp b) d"},
        diff=("x", "w"),
        local=lambda t: fs.psum(t["x"] @ t["w"], "dp"),
        ref=lambda t: t["x"] @ t["w"],
        out_spec="b o",
        fwd=[("all_reduce", ("dp",), b * o * e)],
        bwd=[],
        sharded_fwd=[a2a],
        sharded_bwd=[a2a],
    )


def _p_fsdp2d(mesh, dtype, order=("dp", "tp")):
    """FSDP over both axes of a 2-D mesh: params split over ``order`` (major first), gathered over it."""
    import fshard as fs

    n, e = mesh.size, dtype.itemsize
    o = max(4, n)
    inputs = _mlp_params(dtype, 8, 8, o)
    inputs["x"] = _randn(20, 2 * n, 8, dtype=dtype)
    inputs["y"] = _randn(21, 2 * n, o, dtype=dtype)
    params = ("w1", "b1", "w2", "b2")
    ax = " ".join(order)

    def local(t):
        g = {p: fs.all_gather(t[p], order, dim=0, tiled=True) for p in params}
        return fs.pmean(_mse(_mlp(g, t["x"]), t["y"]), ("dp", "tp"))

    full = {p: inputs[p].numel() * e for p in params}
    return SimpleNamespace(
        inputs=inputs,
        specs={
            "w1": f"({ax} d) h",
            "b1": f"({ax} h)",
            "w2": f"({ax} h) o",
            "b2": f"({ax} o)",
            "x": "(dp tp b) d",
            "y": "(dp tp b) o",
        },
        diff=params,
        local=local,
        ref=lambda t: _mse(_mlp(t, t["x"]), t["y"]),
        out_spec="",
        fwd=[("all_gather", order, full[p] // n) for p in params] + [("all_reduce", ("dp", "tp"), e)],
        bwd=[("reduce_scatter", order, full[p]) for p in params],
    )


def _p_vocab_ce(mesh, dtype):
    """Megatron vocab-parallel embedding and cross-entropy (integer ids, axis_index, pmax, psum)."""
    import fshard as fs

    n, e = mesh.size, dtype.itemsize
    b, d, vocab = 5, 3, 4 * n
    vl = vocab // n
    inputs = {
        "ids": torch.randint(0, vocab, (b,), generator=torch.Generator().manual_seed(1)),
        "tgt": torch.randint(0, vocab, (b,), generator=torch.Generator().manual_seed(2)),
        "emb": _randn(3, vocab, d, dtype=dtype),
        "head": _randn(4, d, vocab, dtype=dtype),
    }

    def local(t):
        off = fs.axis_index("tp") * vl
        ids, tgt = t["ids"] - off, t["tgt"] - off
        inr = (ids >= 0) & (ids < vl)
        h = fs.psum(torch.nn.functional.embedding(ids.clamp(0, vl - 1), t["emb"]) * inr[:, None], "tp")
        logits = h @ t["head"]  # (b, vocab / n)
        m = fs.pmax(logits.detach().amax(-1), "tp")
        z = fs.psum(torch.exp(logits - m[:, None]).sum(-1), "tp")
        tin = (tgt >= 0) & (tgt < vl)
        picked = logits.gather(1, tgt.clamp(0, vl - 1)[:, None])[:, 0]
        tl = fs.psum(torch.where(tin, picked, torch.zeros_like(picked)), "tp")
        return (torch.log(z) + m - tl).mean()

    def ref(t):
        return torch.nn.functional.cross_entropy(
            torch.nn.functional.embedding(t["ids"], t["emb"]) @ t["head"], t["tgt"]
        )

    return SimpleNamespace(
        inputs=inputs,
        specs={"ids": "b", "tgt": "b", "emb": "(tp v) d", "head": "d (tp v)"},
        diff=("emb", "head"),
        local=local,
        ref=ref,
        out_spec="",
        fwd=[("all_reduce", ("tp",), b * d * e)] + [("all_reduce", ("tp",), b * e)] * 3,
        # the embedding output (replicated) meets the split head: its gradient is summed once
        bwd=[("all_reduce", ("tp",), b * d * e)],
    )


PROGRAMS = {
    "worked": _p_worked,
    "dp_mlp": _p_dp_mlp,
    "fsdp": _p_fsdp,
    "tp_mlp": _p_tp_mlp,
    "tp_attn": _p_tp_attn,
    "dp_tp": _p_dp_tp,
    "fsdp_tp": _p_fsdp_tp,
    "ulysses": _p_ulysses,
    "cmatmul": _p_cmatmul,
    "pipeline": _p_pipeline,
    "dp_out": _p_dp_out,
    "tp_partial": _p_tp_partial,
    "reshard": _p_reshard,
    "fsdp2d": _p_fsdp2d,
    "vocab_ce": _p_vocab_ce,
}


# == the driver (one job on every rank) =====================================================


def _run_case(prog, axes, path, dtype_name, opts):
    import fshard as fs

    dtype = getattr(torch, dtype_name)
    mesh = fs.Mesh(**axes)
    c = PROGRAMS[prog](mesh, dtype, **opts)
    errs: list[str] = []
    shard_specs = getattr(c, "shard_specs", {})
    ct_spec = c.out_spec.split("|")[0].strip()

    # single-process reference on the global tensors
    ref_in = {k: v.clone().requires_grad_(k in c.diff) for k, v in c.inputs.items()}
    ref_out = c.ref(ref_in)
    ct = _randn(99, *ref_out.shape, dtype=dtype)
    ref_grads = dict(zip(c.diff, torch.autograd.grad(ref_out, [ref_in[k] for k in c.diff], ct)))
    want_fwd, want_bwd = _want(mesh, c.fwd), _want(mesh, c.bwd)

    def arg(k, v, grad):
        spec = shard_specs.get(k, c.specs[k])
        if path != "outside-plain" and _is_split(spec, mesh):
            s = fs.shard(v, mesh, spec)
            return s.requires_grad_(True) if grad else s
        return v.clone().requires_grad_(grad)

    if path == "inside":

        def inside(t, ct_local):
            t = dict(t)
            for k in c.diff:
                t[k] = t[k].detach().requires_grad_(True)
            out = c.local(t)
            gs = torch.autograd.grad(out, [t[k] for k in c.diff], ct_local)
            return out.detach(), dict(zip(c.diff, gs))

        f = fs.shard_map(
            inside,
            mesh=mesh,
            in_specs=(c.specs, ct_spec),
            out_specs=(c.out_spec, {k: c.specs[k] for k in c.diff}),
        )
        args = {k: arg(k, v, False) for k, v in c.inputs.items()}
        if shard_specs:  # the relayout of Sharded inputs happens before f, without gradient
            want_fwd += _want(mesh, c.sharded_fwd)
        with fs.count_collectives() as counts:
            out, grads = f(args, ct)
        _check_counts(errs, "forward+backward inside f", counts, want_fwd + want_bwd)
    else:
        f = fs.shard_map(c.local, mesh=mesh, in_specs=(c.specs,), out_specs=c.out_spec)
        args = {k: arg(k, v, k in c.diff) for k, v in c.inputs.items()}
        if path == "outside-sharded" and shard_specs:
            want_fwd += _want(mesh, c.sharded_fwd)
            want_bwd += _want(mesh, c.sharded_bwd)
        with fs.count_collectives() as fwd:
            out = f(args)
        _check_counts(errs, "forward", fwd, want_fwd)
        if isinstance(out, fs.Sharded):
            out_local, ct_local = out.local, fs.shard(ct, mesh, ct_spec).local
        else:
            out_local, ct_local = out, ct
        with fs.count_collectives() as bwd:
            torch.autograd.backward(out_local, ct_local)
        if path == "outside-plain":
            for k in c.diff:
                want_bwd += _want(
                    mesh, _local_slice_backward(mesh, c.specs[k], c.inputs[k].shape, dtype.itemsize)
                )
        _check_counts(errs, "backward", bwd, want_bwd)
        grads = {k: args[k].grad for k in c.diff}
        for k in c.diff:
            if isinstance(args[k], fs.Sharded) and not isinstance(grads[k], (fs.Sharded, type(None))):
                errs.append(f"grad of Sharded input {k} is {type(grads[k]).__name__}, not Sharded")
            if isinstance(args[k], torch.Tensor) and isinstance(grads[k], fs.Sharded):
                errs.append(f"grad {k}: plain input got a Sharded gradient")

    _close(errs, "output", _full(out), ref_out, dtype)
    for k in c.diff:
        g = grads[k]
        _close(errs, f"grad {k}", _full(g) if g is not None else None, ref_grads[k], dtype)
    return errs


def _assert_ok(results):
    errs = [f"rank {r}: {e}" for r, es in enumerate(results) for e in es]
    assert not errs, "\n".join(errs)


def _cases():
    f32, f64 = "float32", "float64"
    cases = [
        ("worked", {"dp": 1}, {}, f32),
        ("worked", {"dp": 2}, {}, f32),
        ("worked", {"dp": 4}, {}, f64),
        ("worked", {"dp": 4}, {"diff": ("x", "y")}, f32),
        ("dp_mlp", {"dp": 1}, {}, f32),
        ("dp_mlp", {"dp": 2}, {}, f32),
        ("dp_mlp", {"dp": 4}, {}, f64),
        ("dp_mlp", {"dp": 8}, {}, f32),
        ("fsdp", {"dp": 1}, {}, f32),
        ("fsdp", {"dp": 2}, {}, f32),
        ("fsdp", {"dp": 4}, {}, f32),
        ("fsdp", {"dp": 2}, {"invariant": True}, f32),
        ("tp_mlp", {"tp": 1}, {}, f32),
        ("tp_mlp", {"tp": 2}, {}, f32),
        ("tp_mlp", {"tp": 4}, {}, f64),
        ("tp_mlp", {"tp": 2}, {"x_grad": True}, f32),
        ("tp_mlp", {"tp": 4}, {"x_grad": True}, f32),
        ("tp_attn", {"tp": 1}, {}, f32),
        ("tp_attn", {"tp": 2}, {"x_grad": True}, f32),
        ("tp_attn", {"tp": 4}, {}, f32),
        ("dp_tp", {"dp": 1, "tp": 2}, {}, f32),
        ("dp_tp", {"dp": 2, "tp": 1}, {}, f32),
        ("dp_tp", {"dp": 2, "tp": 2}, {}, f64),
        ("dp_tp", {"dp": 4, "tp": 2}, {}, f32),
        ("fsdp_tp", {"dp": 2, "tp": 1}, {}, f32),
        ("fsdp_tp", {"dp": 2, "tp": 2}, {}, f32),
        ("fsdp_tp", {"dp": 2, "tp": 4}, {}, f32),
        ("ulysses", {"sp": 1}, {}, f32),
        ("ulysses", {"sp": 2}, {}, f32),
        ("ulysses", {"sp": 4}, {}, f64),
        ("cmatmul", {"tp": 1}, {}, f32),
        ("cmatmul", {"tp": 2}, {}, f32),
        ("cmatmul", {"tp": 4}, {}, f32),
        ("pipeline", {"pp": 1}, {}, f32),
        ("pipeline", {"pp": 2}, {}, f32),
        ("pipeline", {"pp": 4}, {}, f64),
        ("dp_out", {"dp": 2}, {}, f32),
        ("dp_out", {"dp": 4}, {}, f32),
        ("tp_partial", {"tp": 2}, {}, f32),
        ("tp_partial", {"tp": 4}, {}, f32),
        ("tp_partial", {"tp": 2}, {"scatter": True}, f32),
        ("tp_partial", {"tp": 4}, {"scatter": True}, f32),
        ("reshard", {"dp": 2}, {}, f32),
        ("reshard", {"dp": 4}, {}, f32),
        ("fsdp2d", {"dp": 2, "tp": 2}, {}, f32),
        ("fsdp2d", {"dp": 2, "tp": 2}, {"order": ("tp", "dp")}, f32),
        ("fsdp2d", {"dp": 2, "tp": 4}, {"order": ("tp", "dp")}, f32),
        ("vocab_ce", {"tp": 1}, {}, f32),
        ("vocab_ce", {"tp": 2}, {}, f32),
        ("vocab_ce", {"tp": 4}, {}, f64),
    ]
    for prog, axes, opts, dt in cases:
        mesh_id = "x".join(f"{k}{v}" for k, v in axes.items())
        opt_id = "-".join(f"{k}={v if not isinstance(v, tuple) else '+'.join(v)}" for k, v in opts.items())
        paths = ("outside-sharded", "outside-plain") if opts.get("scatter") else PATHS
        for path in paths:
            ident = "-".join(x for x in (prog, mesh_id, opt_id, dt, path) if x)
            yield pytest.param(prog, axes, opts, dt, path, id=ident)


@pytest.mark.parametrize("prog, axes, opts, dtype, path", list(_cases()))
def test_program_matrix(prog, axes, opts, dtype, path):
    world = math.prod(axes.values())
    _assert_ok(run_ranks(world, _run_case, prog, axes, path, dtype, opts))


# == focused cases ===========================================================================


def _worked_explicit():
    """d/dx [psum(x * y, "dp") + x] = sum(y) + 1 (not sum(y) + N), on both gradient paths."""
    import fshard as fs

    mesh = fs.Mesh(dp=4)
    errs: list[str] = []
    x, y = _randn(1, 3, dtype=torch.float64), _randn(2, 8, 3, dtype=torch.float64)
    want = y.sum(0) + 1

    def body(x, y):
        return fs.psum((x * y).sum(0), "dp") + x

    # (a) inside f, with fs.value_and_grad and with torch.autograd.grad
    def inside(x, y):
        _, g1 = fs.value_and_grad(lambda x: body(x, y).sum())(x)
        xr = x.detach().requires_grad_(True)
        (g2,) = torch.autograd.grad(body(xr, y).sum(), xr)
        return g1, g2

    g1, g2 = fs.shard_map(inside, mesh=mesh, in_specs=("d", "(dp n) d"), out_specs=("d", "d"))(x, y)
    _close(errs, "inside value_and_grad", g1, want, torch.float64)
    _close(errs, "inside autograd.grad", g2, want, torch.float64)
    # (b) outside, on the global function
    f = fs.shard_map(body, mesh=mesh, in_specs=("d", "(dp n) d"), out_specs="d")
    xg = x.clone().requires_grad_(True)
    f(xg, y).sum().backward()
    _close(errs, "outside .backward()", xg.grad, want, torch.float64)
    _, g3 = fs.value_and_grad(lambda x: f(x, y).sum())(x)
    _close(errs, "outside fs.value_and_grad", g3, want, torch.float64)
    if torch.allclose(xg.grad, y.sum(0) + 4):
        errs.append("outside gradient is sum(y) + N")
    return errs


def test_worked_case_gradient_is_sum_plus_one():
    _assert_ok(run_ranks(4, _worked_explicit))


def _tied_weights(transposed):
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    errs: list[str] = []
    w, x = _randn(1, 3, 3), _randn(2, 4, 3)

    def body(w, x):
        h = torch.tanh(x @ w)
        h = torch.tanh(h @ w)  # the same tensor again: the cached cast is reused
        if transposed:
            h = h @ w.T  # w.T is a new tensor: a second cast
        return h

    f = fs.shard_map(
        lambda w, x: fs.pmean(body(w, x).pow(2).mean(), "dp"),
        mesh=mesh,
        in_specs=("d e", "(dp b) d"),
        out_specs="",
    )
    wg = w.clone().requires_grad_(True)
    loss = f(wg, x)
    with fs.count_collectives() as bwd:
        loss.backward()
    wr = w.clone().requires_grad_(True)
    body(wr, x).pow(2).mean().backward()
    _close(errs, "grad w", wg.grad, wr.grad, torch.float32)
    # Hand-written minimum: one all_reduce of w's gradient. fshard casts each distinct
    # tensor once per call, so w and w.T each get one (documented; above the minimum).
    n = 2 if transposed else 1
    _check_counts(errs, "backward", bwd, Counter({("all_reduce", ("dp",), 36): n}))
    return errs


@pytest.mark.parametrize("transposed", [False, True], ids=["same-tensor", "with-transpose"])
def test_replicated_weight_used_twice(transposed):
    _assert_ok(run_ranks(2, _tied_weights, transposed))


def _sliced_per_microbatch(explicit):
    """A replicated input indexed per microbatch (x[t]) meets split weights once per slice."""
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    errs: list[str] = []
    x, w = _randn(1, 3, 2, 4), _randn(2, 4, 4)

    def body(x, w):
        if explicit:
            x = fs.pvary(x, "dp")  # one cast of the whole tensor: one all_reduce of its gradient
        return fs.psum(sum((x[t] @ w).sum() for t in range(3)), "dp")

    f = fs.shard_map(body, mesh=mesh, in_specs=("m b d", "d (dp e)"), out_specs="")
    xg = x.clone().requires_grad_(True)
    out = f(xg, w)
    with fs.count_collectives() as bwd:
        out.backward()
    xr = x.clone().requires_grad_(True)
    sum((xr[t] @ w).sum() for t in range(3)).backward()
    _close(errs, "grad x", xg.grad, xr.grad, torch.float32)
    # Hand-written minimum: one all_reduce of x's whole gradient (3 * 2 * 4 floats). Implicitly,
    # each slice x[t] is a distinct tensor and is cast (and reduced) on its own.
    want = {("all_reduce", ("dp",), 96): 1} if explicit else {("all_reduce", ("dp",), 32): 3}
    _check_counts(errs, "backward", bwd, Counter(want))
    return errs


@pytest.mark.parametrize("explicit", [False, True], ids=["implicit", "explicit-pvary"])
def test_replicated_input_sliced_per_microbatch(explicit):
    _assert_ok(run_ranks(2, _sliced_per_microbatch, explicit))


def _grad_accumulation():
    """Two microbatches, two calls, two .backward(): gradients accumulate like plain torch."""
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    errs: list[str] = []
    c = _p_dp_mlp(mesh, torch.float32)
    params = {k: c.inputs[k].clone().requires_grad_(True) for k in c.diff}
    ref = {k: c.inputs[k].clone().requires_grad_(True) for k in c.diff}
    f = fs.shard_map(c.local, mesh=mesh, in_specs=(c.specs,), out_specs="")
    with fs.count_collectives() as counts:
        for mb in range(2):
            xb, yb = _randn(30 + mb, 4, 4), _randn(40 + mb, 4, 3)
            f({**params, "x": xb, "y": yb}).backward()
            c.ref({**ref, "x": xb, "y": yb}).backward()
    for k in c.diff:
        _close(errs, f"accumulated grad {k}", params[k].grad, ref[k].grad, torch.float32)
    want = Counter({("all_reduce", ("dp",), 4): 2})
    for k in c.diff:
        want[("all_reduce", ("dp",), c.inputs[k].numel() * 4)] += 2
    _check_counts(errs, "two steps", counts, want)
    return errs


def test_gradient_accumulation_over_calls():
    _assert_ok(run_ranks(2, _grad_accumulation))


def _backward_inside(prog):
    """loss.backward() inside f; p.grad is returned with the parameter's spec."""
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    errs: list[str] = []
    c = PROGRAMS[prog](mesh, torch.float32)

    def inside(t):
        t = dict(t)
        for k in c.diff:
            t[k] = t[k].detach().requires_grad_(True)
        loss = c.local(t)
        loss.backward()
        return loss.detach(), {k: t[k].grad for k in c.diff}

    f = fs.shard_map(inside, mesh=mesh, in_specs=(c.specs,), out_specs=("", {k: c.specs[k] for k in c.diff}))
    with fs.count_collectives() as counts:
        loss, grads = f(c.inputs)
    _check_counts(errs, "forward+backward", counts, _want(mesh, c.fwd) + _want(mesh, c.bwd))
    ref_in = {k: v.clone().requires_grad_(k in c.diff) for k, v in c.inputs.items()}
    ref_loss = c.ref(ref_in)
    ref_loss.backward()
    _close(errs, "loss", loss, ref_loss, torch.float32)
    for k in c.diff:
        _close(errs, f"grad {k}", _full(grads[k]), ref_in[k].grad, torch.float32)
    return errs


@pytest.mark.parametrize("prog", ["dp_mlp", "fsdp"])
def test_loss_backward_inside_f(prog):
    _assert_ok(run_ranks(2, _backward_inside, prog))


# -- fs.value_and_grad over pytrees --------------------------------------------------------------

_VG_SPECS = {"mlp": {"w1": "k (tp n)", "b1": "(tp n)"}, "w2": "(tp n) k", "b2": "k"}


def _vg_params(dtype=torch.float64):
    return {
        "mlp": {"w1": _randn(3, 4, 4, dtype=dtype) / 2, "b1": _randn(4, 4, dtype=dtype) * 0.1},
        "w2": _randn(5, 4, 4, dtype=dtype) / 2,
        "b2": _randn(6, 4, dtype=dtype) * 0.1,
    }


def _vg_loss(p, x, y, psum=lambda h: h, pmean=lambda v: v):
    h = torch.nn.functional.gelu(x @ p["mlp"]["w1"] + p["mlp"]["b1"]) @ p["w2"]
    return pmean(_mse(psum(h) + p["b2"], y))


def _vg_reference(x, y):
    import optree

    params = optree.tree_map(lambda t: t.clone().requires_grad_(True), _vg_params())
    xr = x.clone().requires_grad_(True)
    loss = _vg_loss(params, xr, y)
    leaves = optree.tree_leaves(params)
    grads = torch.autograd.grad(loss, leaves + [xr])
    return loss, optree.tree_unflatten(optree.tree_structure(params), list(grads[:-1])), grads[-1]


def _value_and_grad_outside():
    import optree

    import fshard as fs

    mesh = fs.Mesh(dp=2, tp=2)
    errs: list[str] = []
    x, y = _randn(1, 4, 4, dtype=torch.float64), _randn(2, 4, 4, dtype=torch.float64)
    raw = _vg_params()
    params = {
        "mlp": {k: fs.shard(v, mesh, _VG_SPECS["mlp"][k]) for k, v in raw["mlp"].items()},
        "w2": fs.shard(raw["w2"], mesh, _VG_SPECS["w2"]),
        "b2": raw["b2"],  # replicated: a plain tensor
    }
    loss_fn = fs.shard_map(
        lambda p, x, y: _vg_loss(p, x, y, lambda h: fs.psum(h, "tp"), lambda v: fs.pmean(v, "dp")),
        mesh=mesh,
        in_specs=(_VG_SPECS, "(dp b) k", "(dp b) k"),
        out_specs="",
    )

    def with_aux(p, x, y):
        loss = loss_fn(p, x, y)
        return loss, {"twice": 2 * loss}

    with fs.count_collectives() as counts:
        (loss, aux), (grads, gx) = fs.value_and_grad(with_aux, argnums=(0, 1), has_aux=True)(params, x, y)
    ref_loss, ref_grads, ref_gx = _vg_reference(x, y)
    _close(errs, "loss", loss, ref_loss, torch.float64)
    _close(errs, "aux", aux["twice"], 2 * ref_loss, torch.float64)
    if loss.requires_grad:
        errs.append("value_and_grad returned a value that still requires grad")
    if optree.tree_structure(grads) != optree.tree_structure(params):
        errs.append(
            f"grads structure {optree.tree_structure(grads)} != params {optree.tree_structure(params)}"
        )
    for path, g, p, r in zip(
        optree.tree_paths(grads),
        optree.tree_leaves(grads),
        optree.tree_leaves(params),
        optree.tree_leaves(ref_grads),
    ):
        if isinstance(p, fs.Sharded) != isinstance(g, fs.Sharded):
            errs.append(f"grad {path}: {type(g).__name__} for a {type(p).__name__} parameter")
        elif isinstance(p, fs.Sharded) and g.spec != p.spec:
            errs.append(f"grad {path}: spec {g.spec!r} != parameter spec {p.spec!r}")
        _close(errs, f"grad {path}", _full(g), r, torch.float64)
    _close(errs, "grad x (plain split input: full gradient)", gx, ref_gx, torch.float64)
    e = 8
    want = _want(
        mesh,
        [("all_reduce", ("tp",), 2 * 4 * e), ("all_reduce", ("dp",), e)]
        + [("all_reduce", ("dp",), n * e) for n in (8, 2, 8, 4)]  # one per parameter (local size)
        # x meets tp-split weights: its gradient is summed over tp
        + [("all_reduce", ("tp",), 2 * 4 * e)]
        # x is a plain split input: its full gradient is gathered
        + [("all_gather", ("dp",), 2 * 4 * e)],
    )
    _check_counts(errs, "value_and_grad", counts, want)
    return errs


def test_value_and_grad_pytree_outside():
    _assert_ok(run_ranks(4, _value_and_grad_outside))


def _value_and_grad_inside():
    import optree

    import fshard as fs

    mesh = fs.Mesh(dp=2, tp=2)
    errs: list[str] = []
    x, y = _randn(1, 4, 4, dtype=torch.float64), _randn(2, 4, 4, dtype=torch.float64)

    def step(p, x, y):
        def loss_fn(p, x):
            loss = _vg_loss(p, x, y, lambda h: fs.psum(h, "tp"), lambda v: fs.pmean(v, "dp"))
            return loss, loss.detach() * 2

        (loss, aux), (grads, gx) = fs.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(p, x)
        g_only = fs.grad(lambda p: loss_fn(p, x)[0])(p)
        return loss, aux, grads, gx, g_only

    f = fs.shard_map(
        step,
        mesh=mesh,
        in_specs=(_VG_SPECS, "(dp b) k", "(dp b) k"),
        out_specs=("", "", _VG_SPECS, "(dp b) k", _VG_SPECS),
    )
    with fs.count_collectives() as counts:
        loss, aux, grads, gx, g_only = f(_vg_params(), x, y)
    ref_loss, ref_grads, ref_gx = _vg_reference(x, y)
    e = 8
    fwd = [("all_reduce", ("tp",), 2 * 4 * e), ("all_reduce", ("dp",), e)]
    per_param = [("all_reduce", ("dp",), n * e) for n in (8, 2, 8, 4)]
    x_grad = [("all_reduce", ("tp",), 2 * 4 * e)]
    # value_and_grad (params and x), then fs.grad (params only)
    _check_counts(errs, "inside", counts, _want(mesh, 2 * fwd + 2 * per_param + x_grad))
    _close(errs, "loss", loss, ref_loss, torch.float64)
    _close(errs, "aux", aux, 2 * ref_loss, torch.float64)
    for name, tree in (("value_and_grad", grads), ("grad", g_only)):
        for path, g, r in zip(
            optree.tree_paths(tree), optree.tree_leaves(tree), optree.tree_leaves(ref_grads)
        ):
            _close(errs, f"{name} {path}", _full(g), r, torch.float64)
    _close(errs, "grad x", _full(gx), ref_gx, torch.float64)
    return errs


def test_value_and_grad_pytree_inside():
    _assert_ok(run_ranks(4, _value_and_grad_inside))


# -- torch.func ---------------------------------------------------------------------------------


def _torch_func_inside():
    """torch.func.grad / vjp of local functions that call fshard collectives, inside f."""
    import fshard as fs

    mesh = fs.Mesh(dp=2)
    n = 2
    errs: list[str] = []
    dt = torch.float64
    w, x = _randn(1, 3, dtype=dt), _randn(2, 4, 3, dtype=dt)
    c = _randn(3, 4, dtype=dt)
    ws = _randn(4, 4, dtype=dt)

    def both(fn, arg, ct=None):
        """torch.func and torch.autograd on the same local function: (func result, autograd result)."""
        a = arg.detach().requires_grad_(True)
        if ct is None:
            got = torch.func.grad(fn)(arg)
            (want,) = torch.autograd.grad(fn(a), a)
        else:
            _, vjp = torch.func.vjp(fn, arg)
            (got,) = vjp(ct)
            (want,) = torch.autograd.grad(fn(a), a, ct)
        return got, want

    # psum with a replicated primal: the implicit pvary's psum runs in the backward
    f1 = fs.shard_map(
        lambda w, x: both(lambda w: fs.psum((w * x).sum(), "dp"), w),
        mesh=mesh,
        in_specs=("d", "(dp n) d"),
        out_specs=("d", "d"),
    )
    with fs.count_collectives() as counts:
        got, want = f1(w, x)
    _close(errs, "func.grad psum", got, x.sum(0), dt)
    _close(errs, "autograd psum", want, x.sum(0), dt)
    _check_counts(
        errs,
        "func.grad psum (+ autograd)",
        counts,
        Counter({("all_reduce", ("dp",), 8): 2, ("all_reduce", ("dp",), 24): 2}),
    )
    # vjp through psum
    ct = _randn(5, 2, 3, dtype=dt)
    f2 = fs.shard_map(
        lambda w, x, ct: both(lambda w: fs.psum(w * x, "dp"), w, ct),
        mesh=mesh,
        in_specs=("d", "(dp n) d", "m d"),
        out_specs=("d", "d"),
    )
    got, want = f2(w, x, ct)
    ref = (ct * x.view(n, 2, 3).sum(0)).sum(0)
    _close(errs, "func.vjp psum", got, ref, dt)
    _close(errs, "autograd psum vjp", want, ref, dt)
    # all_gather: invariant result (local slice backward) and varying result (reduce_scatter)
    f3 = fs.shard_map(
        lambda ws, c: (
            both(lambda ws: (fs.all_gather(ws, "dp", tiled=True, invariant=True) * c).sum(), ws)
            + both(lambda ws: fs.psum((fs.all_gather(ws, "dp", tiled=True) * c).sum(), "dp"), ws)
        ),
        mesh=mesh,
        in_specs=("(dp n)", "n"),
        out_specs=("(dp n)",) * 4,
    )
    g_inv, a_inv, g_var, a_var = (_full(t) for t in f3(ws, c))
    _close(errs, "func.grad all_gather(invariant)", g_inv, c, dt)
    _close(errs, "autograd all_gather(invariant)", a_inv, c, dt)
    # psum of the (identical) per-rank sums is n times the sum: gradient n * c
    _close(errs, "func.grad all_gather", g_var, n * c, dt)
    _close(errs, "autograd all_gather", a_var, n * c, dt)
    # psum_scatter: the vjp is an all_gather of the cotangent, so every rank's gradient is the whole ct
    v = _randn(6, n * 4, 3, dtype=dt)  # local (4, 3) per rank; psum_scatter keeps a (2, 3) block
    ct4 = _randn(7, n * 2, 3, dtype=dt)
    f4 = fs.shard_map(
        lambda v, ct: both(lambda v: fs.psum_scatter(v, "dp", dim=0, tiled=True), v, ct),
        mesh=mesh,
        in_specs=("(dp r) c", "(dp q) c"),
        out_specs=("(dp r) c", "(dp r) c"),
    )
    got, want = (_full(t) for t in f4(v, ct4))
    _close(errs, "func.vjp psum_scatter", got, ct4.repeat(n, 1), dt)
    _close(errs, "autograd psum_scatter", want, ct4.repeat(n, 1), dt)
    # all_to_all: a relayout of the same global tensor, so the global gradient is the cotangent
    xa = _randn(8, 2, 4, 4, dtype=dt)  # (b, s, h): s split over dp going in, h split coming out
    cta = _randn(9, 2, 4, 4, dtype=dt)
    f5 = fs.shard_map(
        lambda x, ct: both(lambda x: fs.all_to_all(x, "dp", split_dim=2, concat_dim=1), x, ct),
        mesh=mesh,
        in_specs=("b (dp s) h", "b s (dp h)"),
        out_specs=("b (dp s) h",) * 2,
    )
    got, want = (_full(t) for t in f5(xa, cta))
    _close(errs, "func.vjp all_to_all", got, cta, dt)
    _close(errs, "autograd all_to_all", want, cta, dt)
    # ppermute ring shift by one: grad of block i is the cotangent of block i + 1
    xp, ctp = _randn(10, n * 2, 3, dtype=dt), _randn(11, n * 2, 3, dtype=dt)
    ring = [(i, (i + 1) % n) for i in range(n)]
    f6 = fs.shard_map(
        lambda x, ct: both(lambda x: fs.ppermute(x, "dp", ring), x, ct),
        mesh=mesh,
        in_specs=("(dp r) c", "(dp r) c"),
        out_specs=("(dp r) c",) * 2,
    )
    got, want = (_full(t) for t in f6(xp, ctp))
    ref = ctp.view(n, 2, 3).roll(-1, 0).reshape(n * 2, 3)
    _close(errs, "func.vjp ppermute", got, ref, dt)
    _close(errs, "autograd ppermute", want, ref, dt)
    return errs


def test_torch_func_inside_shard_map():
    _assert_ok(run_ranks(2, _torch_func_inside))


def _torch_func_outside():
    """torch.func.grad / vjp of a whole shard_map'd function, from outside."""
    import fshard as fs

    errs: list[str] = []
    dt = torch.float64
    mesh = fs.Mesh(dp=2)
    x, y = _randn(1, 3, dtype=dt), _randn(2, 4, 3, dtype=dt)
    f = fs.shard_map(
        lambda x, y: fs.psum((x * y).sum(0), "dp") + x, mesh=mesh, in_specs=("d", "(dp n) d"), out_specs="d"
    )
    try:
        g = torch.func.grad(lambda x: f(x, y).sum())(x)
        _close(errs, "torch.func.grad (worked case)", g, y.sum(0) + 1, dt)
        ct = _randn(3, 3, dtype=dt)
        out, vjp = torch.func.vjp(f, x, y)
        gx, gy = vjp(ct)
        _close(errs, "torch.func.vjp value", out, (x * y).sum(0) + x, dt)
        _close(errs, "torch.func.vjp x", gx, (ct * y).sum(0) + ct, dt)
        _close(errs, "torch.func.vjp y (plain split input: full gradient)", gy, (ct * x).expand(4, 3), dt)
    except Exception as e:  # noqa: BLE001  (report, same on every rank)
        errs.append(
            f"torch.func over a shard_map'd function with plain inputs raised {type(e).__name__}: {e}"
        )

    # Megatron MLP with Sharded parameters: differentiate the local blocks through Sharded wrappers
    tmesh = fs.Mesh(tp=2)
    c = _p_tp_mlp(tmesh, dt)
    tp = fs.shard_map(c.local, mesh=tmesh, in_specs=(c.specs,), out_specs=c.out_spec)
    sh = {k: fs.shard(c.inputs[k], tmesh, c.specs[k]) for k in ("w1", "b1", "w2")}
    ct = _randn(99, 3, 4, dtype=dt)
    ref_in = {k: v.clone().requires_grad_(True) for k, v in c.inputs.items()}
    ref_g = torch.autograd.grad(c.ref(ref_in), [ref_in["w1"], ref_in["w2"]], ct)

    def global_fn(w1_local, w2_local):
        args = dict(
            c.inputs,
            b1=sh["b1"],
            w1=fs.Sharded(w1_local, tmesh, sh["w1"].layout),
            w2=fs.Sharded(w2_local, tmesh, sh["w2"].layout),
        )
        return tp(args)

    try:
        out, vjp = torch.func.vjp(global_fn, sh["w1"].local, sh["w2"].local)
        g1, g2 = vjp(ct)
        _close(errs, "torch.func.vjp tp value", out, c.ref(c.inputs), dt)
        _close(errs, "torch.func.vjp tp w1", fs.Sharded(g1, tmesh, sh["w1"].layout).full(), ref_g[0], dt)
        _close(errs, "torch.func.vjp tp w2", fs.Sharded(g2, tmesh, sh["w2"].layout).full(), ref_g[1], dt)
    except Exception as e:  # noqa: BLE001
        errs.append(f"torch.func.vjp through Sharded inputs raised {type(e).__name__}: {e}")
    return errs


def test_torch_func_through_whole_shard_map():
    _assert_ok(run_ranks(2, _torch_func_outside))


# -- collectives on invariant values, pmax, pbroadcast ----------------------------------------


def _invariant_and_extrema():
    import fshard as fs

    errs: list[str] = []
    dt = torch.float64
    mesh = fs.Mesh(dp=2, tp=2)
    x = _randn(1, 3, dtype=dt)

    # psum of an invariant value is x * axis size (by definition), and so is its gradient
    def inv(x):
        a = fs.psum(x, "dp")
        b = fs.pmean(x, ("dp", "tp"))
        return a, b

    f = fs.shard_map(inv, mesh=mesh, in_specs=("d",), out_specs=("d", "d"))
    xg = x.clone().requires_grad_(True)
    with fs.count_collectives() as counts:
        a, b = f(xg)
        (a.sum() + b.sum()).backward()
    _close(errs, "psum(invariant)", a, 2 * x, dt)
    _close(errs, "pmean(invariant)", b, x, dt)
    _close(errs, "grad psum+pmean of invariant", xg.grad, torch.full_like(x, 3.0), dt)
    _check_counts(errs, "invariant psum/pmean", counts, Counter())

    # pmax over a split value, with a tie: the cotangent is split evenly among the holders
    v = torch.tensor([[1.0, 5.0, 2.0], [3.0, 5.0, 0.0]], dtype=dt)  # rows split over dp; column 1 ties
    fm = fs.shard_map(lambda v: fs.pmax(v, "dp"), mesh=mesh, in_specs=("(dp r) c",), out_specs="r c")
    vg = v.clone().requires_grad_(True)
    out = fm(vg)
    ct = torch.tensor([[1.0, 2.0, 3.0]], dtype=dt)
    out.backward(ct)
    vr = v.clone().requires_grad_(True)
    ref = vr.amax(0, keepdim=True)
    ref.backward(ct)
    _close(errs, "pmax value", out, ref, dt)
    _close(errs, "pmax grad", vg.grad, vr.grad, dt)

    # pbroadcast: every index gets index src's block; the cotangent goes back to src only
    fb = fs.shard_map(
        lambda v: fs.pbroadcast(v, "dp", src=1), mesh=mesh, in_specs=("(dp r) c",), out_specs="r c"
    )
    vg = v.clone().requires_grad_(True)
    out = fb(vg)
    out.backward(ct)
    _close(errs, "pbroadcast value", out, v[1:], dt)
    _close(errs, "pbroadcast grad", vg.grad, torch.cat([torch.zeros_like(ct), ct]), dt)
    return errs


def test_invariant_collectives_pmax_pbroadcast():
    _assert_ok(run_ranks(4, _invariant_and_extrema))


# -- plain-torch idioms inside f ------------------------------------------------------------------


def _inplace_sgd_loop_inside():
    """Several SGD steps inside one shard_map call, updating the weight in place under no_grad.

    Plain torch code; it must behave as it does in one process.
    """
    import fshard as fs

    errs: list[str] = []
    mesh = fs.Mesh(dp=2)
    w0, x, y = _randn(1, 3, 2), _randn(2, 4, 3), _randn(3, 4, 2)

    def train(w, x, y):
        w = w.detach().requires_grad_(True)
        for _ in range(3):
            loss = fs.pmean(((x @ w - y) ** 2).mean(), "dp")
            (g,) = torch.autograd.grad(loss, w)
            with torch.no_grad():
                w.sub_(0.1 * g)
        return w.detach()

    f = fs.shard_map(train, mesh=mesh, in_specs=("d o", "(dp b) d", "(dp b) o"), out_specs="d o")
    # As in plain torch, f's `w.detach()` shares storage with the caller's w0 (inputs are
    # passed as views, never copied), so the in-place updates reach w0: keep a copy.
    w0 = w0.clone()
    start = w0.clone()
    try:
        got = f(w0, x, y)
    except RuntimeError as e:
        errs.append(f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return errs
    w = start.requires_grad_(True)
    for _ in range(3):
        (g,) = torch.autograd.grad(((x @ w - y) ** 2).mean(), w)
        with torch.no_grad():
            w.sub_(0.1 * g)
    _close(errs, "trained w", got, w, torch.float32)
    return errs


def test_inplace_weight_update_loop_inside_f():
    _assert_ok(run_ranks(2, _inplace_sgd_loop_inside))


def _hvp():
    """Second order: Hessian-vector products of a data-parallel loss, inside f and from outside."""
    import fshard as fs

    errs: list[str] = []
    dt = torch.float64
    mesh = fs.Mesh(dp=2)
    w, x, v = _randn(1, 3, dtype=dt), _randn(2, 4, 3, dtype=dt), _randn(3, 3, dtype=dt)

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
    _close(errs, "hvp inside (autograd, create_graph)", hv, ref, dt)
    _close(errs, "hvp inside (torch.func.grad of grad)", hv2, ref, dt)
    f = fs.shard_map(loss_local, mesh=mesh, in_specs=("d", "(dp b) d"), out_specs="")
    wg = w.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(wg, x), wg, create_graph=True)
    (hv,) = torch.autograd.grad((g * v).sum(), wg)
    _close(errs, "hvp outside", hv, ref, dt)
    return errs


def test_hessian_vector_product():
    _assert_ok(run_ranks(2, _hvp))
