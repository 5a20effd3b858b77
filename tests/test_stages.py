"""Pipeline stages of different shapes: ``fs.PerRank`` values and ``fs.switch``, on real gloo ranks.

A pipeline whose stages differ in shape (an embedding on stage 0, a different hidden width per
stage, a head on the last stage) holds each stage's parameters only on that stage's ranks
(``fs.PerRank``) and runs each stage's code with ``fs.switch``. Its loss and every stage's
parameter gradients are compared with the same sequential model run by plain torch in one process,
on meshes pp=2, pp=4 and dp=2 x pp=2; the errors are checked by their full text.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close

VOCAB, D, MB, M = 11, 6, 4, 3  # vocabulary, boundary width, microbatch size, microbatches
DT = torch.float64


def hidden(s: int) -> int:
    """Stage s's hidden width: a different one per stage."""
    return 5 + 3 * s


def stage_params(s: int, n: int, layers: int = 1) -> dict:
    """Stage s of n: its own parameters (seeded by s), shapes depending on s."""
    g = torch.Generator().manual_seed(100 + s)

    def rnd(*shape):
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 0.4).to(DT)

    p: dict = {
        "layers": [
            {"w1": rnd(D, hidden(s)), "b1": rnd(hidden(s)), "w2": rnd(hidden(s), D)} for _ in range(layers)
        ]
    }
    if s == 0:
        p["embed"] = rnd(VOCAB, D)
    if s == n - 1:
        p["head"] = rnd(D, VOCAB)
    return p


def run_layers(p, h):
    for lay in p["layers"]:
        h = h + torch.tanh(h @ lay["w1"] + lay["b1"]) @ lay["w2"]
    return h


def reference(n, tokens, targets, tied=None):
    """The sequential model in one process: loss and each stage's gradients (and tied's)."""
    params = [stage_params(s, n) for s in range(n)]
    leaves = [t.requires_grad_() for p in params for t in torch.utils._pytree.tree_leaves(p)]
    extra = [tied.clone().requires_grad_()] if tied is not None else []
    h = params[0]["embed"][tokens.reshape(-1)]
    if tied is not None:
        h = h + extra[0]
    for p in params:
        h = run_layers(p, h)
    logits = h @ params[-1]["head"]
    if tied is not None:
        logits = logits + (h * extra[0]).sum(-1, keepdim=True)
    loss = F.cross_entropy(logits, targets.reshape(-1))
    grads = torch.autograd.grad(loss, leaves + extra)
    out, k = [], 0
    for p in params:
        nl = len(torch.utils._pytree.tree_leaves(p))
        out.append(grads[k : k + nl])
        k += nl
    return loss.detach(), out, (grads[-1] if extra else None)


def run_stage(s, n, t, p, tokens, targets, carry, tied=None):
    """Stage s at clock tick t: microbatch t - s; constants in the bubble."""
    i = t - s
    m = tokens.shape[0]
    zero_h, zero_l = torch.zeros(tokens.shape[1], D, dtype=DT), torch.zeros((), dtype=DT)
    if not 0 <= i < m:
        return zero_h, zero_l
    h = p["embed"][tokens[i]] if s == 0 else carry
    if s == 0 and tied is not None:
        h = h + tied
    h = run_layers(p, h)
    if s < n - 1:
        return h, zero_l
    logits = h @ p["head"]
    if tied is not None:
        logits = logits + (h * tied).sum(-1, keepdim=True)
    # a sum over this microbatch's tokens; divided by the global token count outside
    return zero_h, F.cross_entropy(logits, targets[i], reduction="sum")


def pipeline(p, tokens, targets, *tied):
    """GPipe over "pp": stage s runs microbatch t - s at tick t; the loss is summed on the last stage."""
    n, stage = fs.axis_size("pp"), fs.axis_index("pp")
    m, mb = tokens.shape
    to_next = [(i, i + 1) for i in range(n - 1)]
    branches = [functools.partial(run_stage, s, n) for s in range(n)]
    carry = torch.zeros(mb, D, dtype=DT)
    total = torch.zeros((), dtype=DT)
    for t in range(m + n - 1):
        h, loss = fs.switch(stage, branches, t, p, tokens, targets, carry, *tied)
        total = total + loss
        if t < m + n - 2:
            carry = fs.ppermute(h, "pp", to_next)
    return fs.psum(total, "pp")


def _data(dp):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (M, MB * dp), generator=g)
    targets = torch.randint(0, VOCAB, (M, MB * dp), generator=g)
    return tokens, targets


def _rank_gradients(shape, tied_on):
    mesh = fs.Mesh(**shape)
    n, dp = mesh.axis_size("pp"), shape.get("dp", 1)
    tokens, targets = _data(dp)
    tied = torch.randn(D, generator=torch.Generator().manual_seed(3), dtype=DT) * 0.3 if tied_on else None
    params = fs.PerRank.build(mesh, "pp", [functools.partial(stage_params, s, n) for s in range(n)])
    errs: list[str] = []
    if params.index != mesh.axis_index("pp") or params.axes != ("pp",):
        errs.append(f"index {params.index}, axes {params.axes}")
    count = tokens.numel()

    def f(p, x, y, *extra):
        total = pipeline(p, x, y, *extra)
        return fs.psum(total, "dp") / count if "dp" in mesh.axis_names else total / count

    spec = "m (dp b)" if "dp" in shape else "m b"
    in_specs = (None, spec, spec) + ((None,) if tied_on else ())
    step = fs.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs="")
    args = (params, tokens, targets) + ((tied,) if tied_on else ())
    argnums = (0, 3) if tied_on else 0
    with fs.count_collectives() as counts:
        loss, grads = fs.value_and_grad(step, argnums=argnums)(*args)
    grads, gtied = grads if tied_on else (grads, None)
    want_loss, want, want_tied = reference(n, tokens, targets, tied)
    close(errs, "loss", loss, want_loss, DT)
    if not isinstance(grads, fs.PerRank) or grads.axes != ("pp",):
        errs.append(f"gradients are {type(grads).__name__}, not a PerRank over pp")
        return errs
    s = mesh.axis_index("pp")
    got = torch.utils._pytree.tree_leaves(grads.tree)
    if len(got) != len(want[s]):
        errs.append(f"stage {s}: {len(got)} gradients, want {len(want[s])}")
    for k, (a, b) in enumerate(zip(got, want[s])):
        close(errs, f"stage {s} gradient {k}", a, b, DT)
    if tied_on:
        close(errs, "tied gradient", gtied, want_tied, DT)
    # no gradient reduction over pp: pp collectives are the ppermutes, the loss psum, the tied psum
    by = counts.by_kind()
    pp_reduces = by.get(("all_reduce", ("pp",)), 0)
    if pp_reduces != 1 + (1 if tied_on else 0):
        errs.append(f"all-reduces over pp: {pp_reduces} ({counts})")
    return errs


@pytest.mark.parametrize(
    "n,shape,tied",
    [
        (2, {"pp": 2}, False),
        (4, {"pp": 4}, False),
        (4, {"dp": 2, "pp": 2}, False),
        (2, {"pp": 2}, True),
        (4, {"dp": 2, "pp": 2}, True),
    ],
    ids=["pp2", "pp4", "dp2xpp2", "pp2-tied", "dp2xpp2-tied"],
)
def test_pipeline_gradients_match_one_process(n, shape, tied):
    assert_ok(run_ranks(n, _rank_gradients, shape, tied))
