"""Compiled calls track what eager tracks: the tensor operations Dynamo traces without modes.

Dynamo (torch 2.13) traces some tensor operations without the active torch-function modes:
``x.T`` and the other attributes that make a tensor, iterating over and unpacking a tensor,
``abs(x)``, and the tensors of a multi-output op (``x.unbind()``, ``x.chunk()``) could not be
tagged. Their results read as invariant, so ``fs.psum(x.T, "dp")`` of a varying ``x`` compiled to
``x.T * 2`` (a silent wrong value) and ``x.chunk(2)`` did not compile. Each construct below is
compiled on its own and compared with the eager call and with the same computation by plain torch
on the global tensor in one process (``psum`` of ``g(block)``: the sum over the ranks' blocks), on 2
ranks; a construct eager refuses is refused compiled with the same message. Then gradients through
``w.T`` of a tensor-parallel weight, and ``compute_dtype`` (mixed precision), compiled against eager
and one process.
"""

from __future__ import annotations

import math

import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, randn

N = 2


def _iadd(a):
    c = torch.zeros_like(a)
    c += a  # (the in-place operator's syntax)
    return c


def _unpack_tuple(a):
    r0, r1 = tuple(a)
    return r0 - r1


CONSTRUCTS = {  # name -> g, applied to this rank's block of X; f returns fs.psum(g(block), "dp")
    "x.T": lambda a: a.T,
    "x.mT": lambda a: a.mT,
    "x.H": lambda a: a.H,
    "x.real": lambda a: a.real,
    "x.data": lambda a: a.data * 1,
    "(x * 1).T.contiguous()": lambda a: (a * 1).T.contiguous(),
    "unpack a, b = x": lambda a: (lambda r0, r1: r0 + r1)(*a),
    "for row in x": lambda a: sum(r for r in a),
    "list(x)[0]": lambda a: list(a)[0],
    "zip(x, x)": lambda a: sum(r * s for r, s in zip(a, a)),
    "enumerate(x)": lambda a: sum(r * i for i, r in enumerate(a)),
    "reversed(x)": lambda a: torch.stack(list(reversed(a))),
    "r0, r1 = tuple(x)": _unpack_tuple,
    "sum(x)": lambda a: sum(a),
    "c += x": _iadd,
    "abs(x)": lambda a: abs(-a),
    "+x": lambda a: +a,
    "-x": lambda a: -a,
    "2 ** x": lambda a: 2**a,
    "1.0 + x": lambda a: 1.0 + a,
    "~(x > 3)": lambda a: (~(a > 3)).float(),
    "x.unbind(0)[1]": lambda a: a.unbind(0)[1],
    "x.chunk(2, 1)[1]": lambda a: a.chunk(2, 1)[1],
    "x.split(1)[1]": lambda a: tuple(a.split(1))[1],
    "x.max(1).values": lambda a: a.max(1).values,
    "torch.sort(x)[0]": lambda a: torch.sort(a, 1, descending=True)[0],
    "x[0] = x[1]": lambda a: (lambda c: (c.__setitem__(0, a[1]), c)[1])(a.clone()),
    "len(x) * x": lambda a: a * len(a),
    "torch.as_strided(x)": lambda a: torch.as_strided(a, (2, 2), (4, 1)),
    "torch.as_tensor(x)": lambda a: torch.as_tensor(a) * 1,
    "math.floor(x.sum())": lambda a: a * math.floor(a.sum() / 3),
    "float(x.sum())": lambda a: a * float(a.sum()),
    "int(x.sum())": lambda a: a * int(a.sum()),
}


def _rank_constructs(X):
    import torch.distributed as dist

    import fshard as fs

    mesh = fs.Mesh(dp=dist.get_world_size())
    out = {}
    graphs = []

    def backend(gm, example_inputs):  # counts the graphs: each construct really compiled, in one
        graphs.append(gm)
        return gm.forward

    def run(name, body):
        torch._dynamo.reset()  # (else the shared code object hits Dynamo's recompile limit)
        sm = fs.shard_map(body, mesh=mesh, in_specs="(dp a) b", out_specs="...")
        got = {}
        graphs.clear()
        for how, fn in (("eager", sm), ("compiled", torch.compile(sm, backend=backend, fullgraph=True))):
            try:
                got[how] = ("value", fn(X))
            except Exception as e:  # noqa: BLE001  (eager's error must be the compiled call's)
                got[how] = ("error", str(e).split("\n\nfrom user code:")[0])  # (without Dynamo's notes)
        got["graphs"] = len(graphs)
        out[name] = got

    # the constructs eager computes, in one function (one trace); each refused one on its own
    values = {k: g for k, g in CONSTRUCTS.items() if k not in REFUSED}
    run("values", lambda a: {k: fs.psum(g(a), "dp") for k, g in values.items()})
    for name in REFUSED:
        run(name, lambda a, g=CONSTRUCTS[name]: fs.psum(g(a), "dp"))
    return out


REFUSED = {  # eager runs them (tainting the call); compiled refuses (math.floor: Dynamo refuses it first)
    "math.floor(x.sum())": "float() of",
    "float(x.sum())": "float() of",
    "int(x.sum())": "int() of",
}


def test_operations_dynamo_traces_without_modes_are_tracked_as_in_eager():
    X = torch.arange(1.0, 17.0).reshape(4, 4)
    got = run_ranks(N, _rank_constructs, X, timeout=110)
    blocks = X.chunk(N)
    for r in range(N):
        eager, compiled = got[r]["values"]["eager"], got[r]["values"]["compiled"]
        assert eager[0] == compiled[0] == "value", (r, eager, compiled)
        assert got[r]["values"]["graphs"] == 1, r  # compiled whole: no graph break, no fallback
        for name, g in CONSTRUCTS.items():
            if name in REFUSED:
                continue
            want = sum(g(b) for b in blocks)  # psum: the sum of g over the ranks' blocks
            torch.testing.assert_close(eager[1][name], want, msg=f"{name} eager, rank {r}")
            torch.testing.assert_close(compiled[1][name], want, msg=f"{name} compiled, rank {r}")
        for name, what in REFUSED.items():
            eager, compiled = got[r][name]["eager"], got[r][name]["compiled"]
            assert eager[0] == "value" and compiled[0] == "error", (name, eager, compiled)
            want = sum(CONSTRUCTS[name](b) for b in blocks)  # psum after the branch: the same everywhere
            torch.testing.assert_close(eager[1], want, msg=f"{name} eager, rank {r}")
            if name.startswith("math.floor"):
                assert compiled[1].startswith("Could not guard on data-dependent expression"), compiled
            else:
                assert compiled[1] == (
                    f"TracingError: fs.shard_map(_rank_constructs.<locals>.<lambda>): {what} a value that varies "
                    "over mesh axis 'dp' in a compiled call (Dynamo would branch at trace time on one rank's "
                    "value); select between values with torch.where(cond, a, b), or call it eagerly"
                ), (name, r, compiled)


# -- draws from torch's global generator: each rank its own, compiled as eager ------------------------

DRAWS = {
    "torch.rand": lambda w: w * torch.rand(4),
    "torch.rand_like": lambda w: w * torch.rand_like(w),
    "torch.randn_like": lambda w: w * torch.randn_like(w),
    "torch.randint_like": lambda w: w * torch.randint_like(w, 0, 5),
    "torch.normal": lambda w: torch.normal(w, 1.0),
    "w.uniform_()": lambda w: w.clone().uniform_(),
    "torch.bernoulli": lambda w: torch.bernoulli(w.sigmoid()),
    "F.dropout": lambda w: torch.nn.functional.dropout(w, 0.5),
    "F.rrelu": lambda w: torch.nn.functional.rrelu(w - 1, training=True),
}


def _rank_draws(w):
    import torch.distributed as dist

    import fshard as fs

    mesh = fs.Mesh(dp=dist.get_world_size())
    out = {}
    for name, g in DRAWS.items():
        torch._dynamo.reset()
        sm = fs.shard_map(g, mesh=mesh, in_specs="...", out_specs="...")
        got = []
        for fn in (sm, torch.compile(sm, backend="eager", fullgraph=True)):
            try:
                fn(w)
                got.append("no error")
            except Exception as e:  # noqa: BLE001
                got.append(str(e).split("\n\nfrom user code:")[0])
        out[name] = got
    return out


def test_draws_from_the_global_generator_vary_over_every_axis_compiled_as_eager():
    got = run_ranks(N, _rank_draws, torch.ones(4), timeout=110)
    for r in range(N):
        for name in DRAWS:
            eager, compiled = got[r][name]
            assert "replication check" in eager and "out varies over mesh axis dp" in eager, (name, eager)
            assert compiled == "SpecError: " + eager, (name, r, compiled)


# -- gradients through w.T of a tensor-parallel weight; compute_dtype -------------------------------


def _tp_body(w1, w2, x):
    import fshard as fs

    # w1 (tp-split rows: this rank's hidden units) used as w1.T: the attribute read must be tracked
    h = torch.tanh(x @ w1.T)
    return (fs.psum(h @ w2, "tp") ** 2).mean() + fs.psum((h**2).sum(), "tp") / 10


def _mixed_body(w1, w2, b, x, y):
    import fshard as fs

    h = torch.tanh(x @ w1 + b)
    return fs.pmean(((h @ w2.T - y) ** 2).mean(), "dp")  # w2.T: an invariant function of a cast input


def _rank_gradients(args_tp, args_dp):
    import torch.distributed as dist
    from torch._dynamo.backends.common import aot_autograd

    import fshard as fs

    torch._dynamo.reset()
    out: dict = {}
    reduces: list = []

    def capture(gm, example_inputs):  # the dtypes of the gradient all-reduces in the graphs
        for node in gm.graph.nodes:
            if node.op == "call_function" and "all_reduce" in str(node.target):
                reduces.append(node.args[0].meta["val"].dtype)
        return gm

    backend = aot_autograd(fw_compiler=capture, bw_compiler=capture)
    tp = fs.Mesh(tp=dist.get_world_size())
    sm = fs.shard_map(_tp_body, mesh=tp, in_specs=("(tp h) d", "(tp h) o", "..."), out_specs="")
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        step = fs.value_and_grad(sm, argnums=(0, 1))
        out["tp eager"] = step(*args_tp)
        out["tp compiled"] = torch.compile(step, backend="aot_eager", fullgraph=True)(*args_tp)
        dp = fs.Mesh(dp=dist.get_world_size())
        specs = ("...", "...", "...", "(dp b) d", "(dp b) o")
        for name, bucket_mb in (("bucketed", 25.0), ("unbucketed", None)):
            mixed = fs.shard_map(
                _mixed_body,
                mesh=dp,
                in_specs=specs,
                out_specs="",
                compute_dtype=torch.bfloat16,
                bucket_mb=bucket_mb,
            )
            out[f"mixed {name}"] = fs.value_and_grad(mixed, argnums=(0, 1, 2))(*args_dp)
        step = fs.value_and_grad(mixed, argnums=(0, 1, 2))
        out["mixed compiled"] = torch.compile(step, backend=backend, fullgraph=True)(*args_dp)
    out["reduce dtypes"] = reduces
    return out


def test_compiled_gradients_through_attributes_and_compute_dtype_match_eager_and_one_process():
    w1, w2, x = randn(0, 6, 4).requires_grad_(), randn(1, 6, 3).requires_grad_(), randn(2, 5, 4)
    d = {k: v.detach().clone().requires_grad_() for k, v in {"w1": w1, "w2": w2}.items()}
    h = torch.tanh(x @ d["w1"].T)
    loss = ((h @ d["w2"]) ** 2).mean() + (h**2).sum() / 10
    want_tp = (loss.detach(), torch.autograd.grad(loss, [d["w1"], d["w2"]]))
    p = [randn(3, 5, 8), randn(4, 2, 8), randn(5, 8)]
    xd, yd = randn(6, 8, 5), randn(7, 8, 2)
    args_dp = [t.requires_grad_() for t in p] + [xd, yd]
    # one process, with the casts compute_dtype makes (every floating input to bfloat16)
    q = [t.detach().clone().requires_grad_() for t in p]
    bf = [t.to(torch.bfloat16) for t in [*q, xd, yd]]
    h = torch.tanh(bf[3] @ bf[0] + bf[2])
    loss = ((h @ bf[1].T - bf[4]) ** 2).mean()
    want_dp = (loss.detach(), torch.autograd.grad(loss, q))
    got = run_ranks(N, _rank_gradients, (w1, w2, x), args_dp, timeout=110)
    problems = []
    for r, out in enumerate(got):
        errs: list = []
        for how in ("tp eager", "tp compiled"):
            close(errs, f"{how} loss", out[how][0], want_tp[0])
            for i, (g, w) in enumerate(zip(out[how][1], want_tp[1])):
                close(errs, f"{how} grad {i}", g, w)
        assert not errs, errs
        ref = out["mixed bucketed"]
        for how in ("mixed unbucketed", "mixed compiled"):  # the same reductions, in float32
            torch.testing.assert_close(out[how][0], ref[0], rtol=0, atol=0, msg=f"rank {r} {how} loss")
            for i, (g, w) in enumerate(zip(out[how][1], ref[1])):
                assert g.dtype == torch.float32, (how, i)
                torch.testing.assert_close(g, w, rtol=0, atol=0, msg=f"rank {r} {how} grad {i}")
        # against one process in bfloat16: equal up to bfloat16 rounding
        torch.testing.assert_close(ref[0].float(), want_dp[0].float(), rtol=2e-2, atol=2e-2)
        for i, (g, w) in enumerate(zip(ref[1], want_dp[1])):
            torch.testing.assert_close(g, w.float(), rtol=3e-2, atol=3e-2, msg=f"rank {r} mixed grad {i}")
        # the loss's pmean (bfloat16), then the three gradient sums in float32 (none in bfloat16)
        assert out["reduce dtypes"] == [torch.bfloat16] + [torch.float32] * 3, out["reduce dtypes"]
        problems.append(errs)
    assert_ok(problems)
