"""The program catalogue of the autodiff matrix (tests/test_programs.py).

A program builder ``(mesh, dtype, **opts)`` returns a namespace with: the global ``inputs``, their
``specs``, the names to differentiate (``diff``), the per-shard function ``local`` (with
collectives), the reference ``ref`` (plain torch on the global tensors), the ``out_spec``, and the
exact forward / backward collective records (``fwd`` / ``bwd``) of the canonical run (split inputs
as Sharded, or differentiated inside f). Optional: ``shard_specs`` (Sharded inputs stored in
another layout than their in_spec) with the records of their relayout (``sharded_fwd`` /
``sharded_bwd``).

Builders run inside the ranks (they read the mesh) and are looked up by name in ``PROGRAMS``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from tests.helpers import gelu_mlp, mse, randn

# The gradient paths of the matrix (see tests/test_programs.py).
PATHS = ("inside", "outside-sharded", "outside-plain")


# == model pieces (plain torch) =============================================================


def _attention(q, k, v):
    """Causal softmax attention on (..., s, e) tensors."""
    s = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return scores.softmax(-1) @ v


def _mlp_params(dtype, d, h, o):
    return {
        "w1": randn(10, d, h, dtype=dtype) / math.sqrt(d),
        "b1": randn(11, h, dtype=dtype) * 0.1,
        "w2": randn(12, h, o, dtype=dtype) / math.sqrt(h),
        "b2": randn(13, o, dtype=dtype) * 0.1,
    }


def _mlp(t, x):
    return torch.tanh(x @ t["w1"] + t["b1"]) @ t["w2"] + t["b2"]


def _heads_attention(x, wq, wk, wv, eh):
    def heads(w):
        return (x @ w).unflatten(-1, (-1, eh)).transpose(1, 2)  # (b, h, s, eh)

    o = _attention(heads(wq), heads(wk), heads(wv))
    return o.transpose(1, 2).flatten(2)


# == programs ===============================================================================


def _p_worked(mesh, dtype, diff=("x",)):
    """The worked case of the gradients tutorial: f(x, y) = psum(x * y, "dp") + x, x replicated, y split: d/dx = sum(y) + 1."""
    import fshard as fs

    n, e = mesh.size, dtype.itemsize
    inputs = {"x": randn(1, 3, dtype=dtype), "y": randn(2, 2 * n, 3, dtype=dtype)}
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


def _p_dp_mlp(mesh, dtype, diff=("w1", "b1", "w2", "b2")):
    """Data parallel: replicated params, batch split over dp, loss = pmean(local loss)."""
    import fshard as fs

    n, e = mesh.size, dtype.itemsize
    inputs = _mlp_params(dtype, 4, 6, 3)
    inputs["x"] = randn(20, 2 * n, 4, dtype=dtype)
    inputs["y"] = randn(21, 2 * n, 3, dtype=dtype)
    return SimpleNamespace(
        inputs=inputs,
        specs={"w1": "d h", "b1": "h", "w2": "h o", "b2": "o", "x": "(dp b) d", "y": "(dp b) o"},
        diff=tuple(diff),
        local=lambda t: fs.pmean(mse(_mlp(t, t["x"]), t["y"]), "dp"),
        ref=lambda t: mse(_mlp(t, t["x"]), t["y"]),
        out_spec="",
        fwd=[("all_reduce", ("dp",), e)],
        bwd=[("all_reduce", ("dp",), inputs[p].numel() * e) for p in diff],
    )


def _p_fsdp(mesh, dtype, invariant=False):
    """FSDP: params split over dp on dim 0, all_gathered inside f (backward: reduce_scatter)."""
    import fshard as fs

    n, e = mesh.size, dtype.itemsize
    inputs = _mlp_params(dtype, 8, 8, 4)
    inputs["x"] = randn(20, 2 * n, 8, dtype=dtype)
    inputs["y"] = randn(21, 2 * n, 4, dtype=dtype)
    params = ("w1", "b1", "w2", "b2")

    def local(t):
        g = {p: fs.all_gather(t[p], "dp", dim=0, tiled=True, invariant=invariant) for p in params}
        return fs.pmean(mse(_mlp(g, t["x"]), t["y"]), "dp")

    full = {p: inputs[p].numel() * e for p in params}
    # the four per-leaf all_gathers (issued before any result is used) run as one (fshard/_combine.py)
    total = sum(full.values())
    if invariant:  # gathered value is replicated: pvary at use, backward one all_reduce of it
        bwd = [("all_reduce", ("dp",), full[p]) for p in params]
    else:  # the combined all_gather's transpose: one reduce_scatter
        bwd = [("reduce_scatter", ("dp",), total)]
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
        ref=lambda t: mse(_mlp(t, t["x"]), t["y"]),
        out_spec="",
        fwd=[("all_gather", ("dp",), total // n), ("all_reduce", ("dp",), e)],
        bwd=bwd,
    )


def _p_tp_mlp(mesh, dtype, x_grad=False):
    """Megatron MLP: W1 column-split, W2 row-split, x replicated; one psum forward."""
    import fshard as fs

    n, e = mesh.size, dtype.itemsize
    b, k = 3, 4
    inputs = {
        "x": randn(1, b, k, dtype=dtype),
        "w1": randn(2, k, 2 * n, dtype=dtype) / 2,
        "b1": randn(3, 2 * n, dtype=dtype) * 0.1,
        "w2": randn(4, 2 * n, k, dtype=dtype) / math.sqrt(2 * n),
        "b2": randn(5, k, dtype=dtype) * 0.1,
    }
    diff = ("w1", "b1", "w2", "b2") + (("x",) if x_grad else ())
    return SimpleNamespace(
        inputs=inputs,
        specs={"x": "b k", "w1": "k (tp n)", "b1": "(tp n)", "w2": "(tp n) k", "b2": "k"},
        diff=diff,
        local=lambda t: fs.psum(gelu_mlp(t, t["x"]), "tp") + t["b2"],
        ref=lambda t: gelu_mlp(t, t["x"]) + t["b2"],
        out_spec="b k",
        fwd=[("all_reduce", ("tp",), b * k * e)],
        bwd=[("all_reduce", ("tp",), b * k * e)] if x_grad else [],
    )


def _p_tp_attn(mesh, dtype, x_grad=False):
    """Attention with heads split over tp: q/k/v column-split, out-projection row-split."""
    import fshard as fs

    e = dtype.itemsize
    b, s, d, h, eh = 2, 5, 6, 4, 2
    inputs = {
        "x": randn(1, b, s, d, dtype=dtype),
        "wq": randn(2, d, h * eh, dtype=dtype) / math.sqrt(d),
        "wk": randn(3, d, h * eh, dtype=dtype) / math.sqrt(d),
        "wv": randn(4, d, h * eh, dtype=dtype) / math.sqrt(d),
        "wo": randn(5, h * eh, d, dtype=dtype) / math.sqrt(h * eh),
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
        "x": randn(1, ndp * b, k, dtype=dtype),
        "y": randn(2, ndp * b, k, dtype=dtype),
        "w1": randn(3, k, ntp * hn, dtype=dtype) / 2,
        "b1": randn(4, ntp * hn, dtype=dtype) * 0.1,
        "w2": randn(5, ntp * hn, k, dtype=dtype) / math.sqrt(ntp * hn),
        "b2": randn(6, k, dtype=dtype) * 0.1,
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
        local=lambda t: fs.pmean(mse(fs.psum(gelu_mlp(t, t["x"]), "tp") + t["b2"], t["y"]), "dp"),
        ref=lambda t: mse(gelu_mlp(t, t["x"]) + t["b2"], t["y"]),
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
        "x": randn(1, ndp * b, k, dtype=dtype),
        "y": randn(2, ndp * b, k, dtype=dtype),
        "w1": randn(3, k, ntp * hn, dtype=dtype) / 2,
        "b1": randn(4, ntp * hn, dtype=dtype) * 0.1,
        "w2": randn(5, ntp * hn, k, dtype=dtype) / math.sqrt(ntp * hn),
        "b2": randn(6, k, dtype=dtype) * 0.1,
    }
    params = ("w1", "b1", "w2", "b2")
    gdim = {"w1": 0, "b1": 0, "w2": 1, "b2": 0}

    def local(t):
        g = dict(t)
        for p in params:
            g[p] = fs.all_gather(t[p], "dp", dim=gdim[p], tiled=True)
        return fs.pmean(mse(fs.psum(gelu_mlp(g, g["x"]), "tp") + g["b2"], g["y"]), "dp")

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
        ref=lambda t: mse(gelu_mlp(t, t["x"]) + t["b2"], t["y"]),
        out_spec="",
        # the four all_gathers run as one (fshard/_combine.py), their transpose as one reduce_scatter
        fwd=[("all_gather", ("dp",), sum(gathered.values()) // ndp)]
        + [("all_reduce", ("tp",), b * k * e), ("all_reduce", ("dp",), e)],
        bwd=[("reduce_scatter", ("dp",), sum(gathered.values()))],
    )


def _p_ulysses(mesh, dtype):
    """Ulysses sequence parallel: seq-split -> all_to_all -> head-split attention -> back."""
    import fshard as fs

    n, e = mesh.size, dtype.itemsize
    b, s, d, h, eh = 2, 8, 6, 4, 2
    inputs = {
        "x": randn(1, b, s, d, dtype=dtype),
        "wq": randn(2, d, h * eh, dtype=dtype) / math.sqrt(d),
        "wk": randn(3, d, h * eh, dtype=dtype) / math.sqrt(d),
        "wv": randn(4, d, h * eh, dtype=dtype) / math.sqrt(d),
        "wo": randn(5, h * eh, d, dtype=dtype) / math.sqrt(h * eh),
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
    inputs = {"x": randn(1, n * m, k, dtype=dtype), "w": randn(2, k, n * nn, dtype=dtype)}
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
    inputs = {"w": randn(1, p, d, d, dtype=dtype) / math.sqrt(d), "x": randn(2, mb, b, d, dtype=dtype)}
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
    inputs["x"] = randn(20, 2 * n, 4, dtype=dtype)
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
        "x": randn(1, b, k, dtype=dtype),
        "w1": randn(2, k, 2 * n, dtype=dtype) / 2,
        "b1": randn(3, 2 * n, dtype=dtype) * 0.1,
        "w2": randn(4, 2 * n, k, dtype=dtype) / math.sqrt(2 * n),
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
        local=lambda t: gelu_mlp(t, t["x"]),
        ref=lambda t: gelu_mlp(t, t["x"]),
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
    inputs = {"x": randn(1, b, d, dtype=dtype), "w": randn(2, d, o, dtype=dtype)}
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
    inputs["x"] = randn(20, 2 * n, 8, dtype=dtype)
    inputs["y"] = randn(21, 2 * n, o, dtype=dtype)
    params = ("w1", "b1", "w2", "b2")
    ax = " ".join(order)

    def local(t):
        g = {p: fs.all_gather(t[p], order, dim=0, tiled=True) for p in params}
        return fs.pmean(mse(_mlp(g, t["x"]), t["y"]), ("dp", "tp"))

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
        ref=lambda t: mse(_mlp(t, t["x"]), t["y"]),
        out_spec="",
        # the per-leaf all_gathers run as one (fshard/_combine.py), their transpose as one reduce_scatter
        fwd=[("all_gather", order, sum(full.values()) // n), ("all_reduce", ("dp", "tp"), e)],
        bwd=[("reduce_scatter", order, sum(full.values()))],
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
        "emb": randn(3, vocab, d, dtype=dtype),
        "head": randn(4, d, vocab, dtype=dtype),
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
