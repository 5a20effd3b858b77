"""Compiled collectives on 1-, 2- and 3-axis meshes, several shard_map'd functions and meshes per
process, against the same computation by plain torch on the global tensors in one process.

Each case is a shard_map'd function compiled on its own (``fs.compile``, aot_eager) and called on
the same global inputs as eagerly; values and the gradients of a weighted sum of the output (with
respect to the replicated or split weight and the split batch) are compared with plain torch.
All cases of a rank job share the code of ``shard_map``'s call, so every compile after the first
is a recompile of the same code on another mesh: a regression test for axis sizes that Dynamo
made symbolic after the first mesh (fshard's planning then failed with "BUILD_STRING type
error"). ``fs.ppermute`` compiles as one all-to-all in which each rank sends only to its pair
(Dynamo cannot trace point-to-point ops); the cases count the collectives in the graphs.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, randn

ROWS, D = 16, 8


def _cases(n: int):
    """name -> (body, in_specs, out_specs, shard_map kwargs, reference on global (W, X)); the
    batch rows are split over ``dp`` (of size ``n``)."""
    import fshard as fs

    ring = [(i, (i + 1) % n) for i in range(n)]
    rows = ROWS // n

    def blocks(t):
        return t.reshape(n, rows, *t.shape[1:])

    return {
        "ppermute": (
            lambda w, x: fs.ppermute(x @ w, "dp", ring),
            ("...", "(dp b) d"),
            "(dp b) d",
            {},
            lambda W, X: blocks(X @ W).roll(1, 0).reshape(ROWS, D),  # block i goes to i + 1
        ),
        # pairs that leave ranks out: a rank in no pair (or only sending, or only receiving)
        # still joins the compiled all-to-all, else the others wait for it
        "ppermute (one pair)": (
            lambda w, x: fs.ppermute(x @ w, "dp", [(0, 1)]),
            ("...", "(dp b) d"),
            "(dp b) d",
            {},
            lambda W, X: torch.cat([torch.zeros(rows, D), blocks(X @ W)[0], torch.zeros(ROWS - 2 * rows, D)]),
        ),
        "ppermute (chain)": (
            lambda w, x: fs.ppermute(x @ w, "dp", [(i, i + 1) for i in range(n - 1)]),
            ("...", "(dp b) d"),
            "(dp b) d",
            {},
            lambda W, X: torch.cat([torch.zeros(rows, D), (X @ W)[: ROWS - rows]]),
        ),
        "all_to_all": (
            lambda w, x: fs.all_to_all(x @ w, "dp", 1, 0),
            ("...", "(dp b) d"),
            "b (dp d)",
            {},
            lambda W, X: X @ W,
        ),
        "psum_scatter": (
            lambda w, x: fs.psum_scatter(x @ w, "dp", dim=1, tiled=True),
            ("...", "(dp b) d"),
            "b (dp d)",
            {},
            lambda W, X: blocks(X @ W).sum(0),
        ),
        "all_gather (fsdp)": (
            lambda w, x: torch.tanh(x @ fs.all_gather(w, "dp", dim=0, tiled=True)),
            ("(dp i) o", "(dp b) d"),
            "(dp b) d",
            {},
            lambda W, X: torch.tanh(X @ W),
        ),
        "pmean": (
            lambda w, x: fs.pmean(torch.tanh(x @ w).pow(2).mean(), "dp"),
            ("...", "(dp b) d"),
            "",
            {},
            lambda W, X: torch.tanh(X @ W).pow(2).mean(),
        ),
        "psum, check=False": (
            lambda w, x: fs.psum((x @ w).sum(0), "dp"),
            ("...", "(dp b) d"),
            "...",
            {"check": False},
            lambda W, X: (X @ W).sum(0),
        ),
        "partial sum out": (
            lambda w, x: (x @ w).sum(0),
            ("...", "(dp b) d"),
            "... | sum(dp)",
            {},
            lambda W, X: (X @ W).sum(0),
        ),
        "axis_index": (
            lambda w, x: (x @ w) * (fs.axis_index("dp") + 1),
            ("...", "(dp b) d"),
            "(dp b) d",
            {},
            lambda W, X: (blocks(X @ W) * torch.arange(1, n + 1).view(n, 1, 1)).reshape(ROWS, D),
        ),
    }


def _run(fn, w, x):
    """fn's global output and the gradients of a weighted sum of it with respect to w and x."""
    import fshard as fs

    w, x = w.clone().requires_grad_(), x.clone().requires_grad_()
    y = fn(w, x)
    y = fs.full(y) if isinstance(y, fs.Sharded) else y
    weights = torch.linspace(0.5, 1.5, y.numel()).view(y.shape)
    gw, gx = torch.autograd.grad((y * weights).sum(), (w, x))
    return y.detach(), gw, gx


def _rank_meshes(meshes, only=None):
    import fshard as fs
    from tests.helpers import compile_counter

    torch._dynamo.reset()
    errs: list[str] = []
    ops: dict = {}
    W, X = randn(0, D, D) / 3, randn(1, ROWS, D)
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=512):
        for shape in meshes:
            mesh = fs.Mesh(**shape)
            label = "x".join(f"{k}={v}" for k, v in shape.items())
            for name, (body, ins, outs, kw, ref) in _cases(shape["dp"]).items():
                if only is not None and name not in only.get(label, (name,)):
                    continue
                f = fs.shard_map(body, mesh=mesh, in_specs=ins, out_specs=outs, **kw)
                backend, stats = compile_counter()
                want = _run(ref, W, X)
                eager = _run(f, W, X)
                got = _run(torch.compile(f, backend=backend, fullgraph=True), W, X)
                for what, e, g, r in zip(("value", "grad w", "grad x"), eager, got, want):
                    close(errs, f"{label} {name}: eager {what} vs one process", e, r)
                    close(errs, f"{label} {name}: compiled {what} vs one process", g, r)
                ops[f"{label} {name}"] = (stats["graphs"], sorted(stats["ops"]))
    return errs, ops


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("world", "meshes", "only"),
    [
        # two meshes, one process: the second mesh's compiles retrace the first's code; every
        # case on the 2-axis mesh, three on the others (compiling is slow on a small machine)
        (
            4,
            [{"dp": 4}, {"dp": 2, "tp": 2}],
            {
                "dp=4": ("ppermute", "ppermute (one pair)", "ppermute (chain)", "pmean"),
                "dp=2xtp=2": (
                    "ppermute",
                    "all_to_all",
                    "psum_scatter",
                    "all_gather (fsdp)",
                    "pmean",
                    "psum, check=False",
                    "partial sum out",
                    "axis_index",
                ),
            },
        ),
        (
            8,
            [{"pp": 2, "dp": 2, "tp": 2}],
            {"pp=2xdp=2xtp=2": ("ppermute", "all_gather (fsdp)", "psum_scatter")},
        ),
    ],
    ids=["1+2axes", "3axes"],
)
def test_compiled_collectives_match_one_process_on_every_mesh(world, meshes, only):
    got = run_ranks(world, _rank_meshes, meshes, only, timeout=200)
    assert_ok([errs for errs, _ in got])
    for _, ops in got:
        for key, (graphs, names) in ops.items():
            assert graphs == 1, key  # fullgraph, traced once per function
            if key.endswith(" ppermute") or " ppermute (" in key:
                # one all-to-all forward, one backward (the inverse ring); the gradients of the
                # replicated weight (a psum) and of the global batch (its blocks gathered)
                assert names == [
                    "all_gather_into_tensor",
                    "all_reduce",
                    "all_to_all_single",
                    "all_to_all_single",
                ], (key, names)
