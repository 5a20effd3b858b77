"""Pipelines of per-rank stages (``fs.PerRank`` + ``fs.switch`` on a varying index) under torch.compile.

The GPipe pipeline of tests/test_stages.py (an embedding on stage 0, a different hidden width per
stage, a head on the last stage, microbatches passed on with ``fs.ppermute``) compiled with
``torch.compile(..., fullgraph=True)``: each rank's graph holds its own stage's code. Its loss and
every stage's gradients are compared with the same sequential model in one process and with the
eager call, on pp=2, pp=4 and dp=2 x pp=2, with ``loss.backward()`` outside the compiled call and
``fs.value_and_grad`` inside it, under aot_eager (every mesh) and inductor (a subset: each rank
compiles its own graph, tens of seconds each on a small machine).

What each table row guards:

- a stage that ignores what it is passed (stage 0 never reads the activation stage n-1 sent; the
  last stage returns constants as its activation) kept its side of the collectives: before,
  AOTAutograd dropped the ppermute whose result reached no output on that rank only, and the ranks
  it sent to waited forever (forward), or the backward lost the gradient's return trip;
- a switch output keeps the varying axes the branch gave it (a lost tag cast the result over
  ``dp`` once more: every gradient doubled under dp x pp);
- one graph per rank (no graph break, no recompile on the second call), and every rank's graphs
  hold the same collectives: a ppermute per tick, forward and backward.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, compile_counter
from tests.test_stages import DT, _data, pipeline, reference, stage_params


def _step(shape):
    import fshard as fs

    mesh = fs.Mesh(**shape)
    n, dp = mesh.axis_size("pp"), shape.get("dp", 1)
    tokens, targets = _data(dp)
    count = tokens.numel()

    def f(p, x, y):
        total = pipeline(p, x, y)
        return fs.psum(total, "dp") / count if "dp" in shape else total / count

    spec = "m (dp b)" if "dp" in shape else "m b"
    step = fs.shard_map(f, mesh=mesh, in_specs=(None, spec, spec), out_specs="")

    def params():
        return fs.PerRank.build(mesh, "pp", [functools.partial(stage_params, s, n) for s in range(n)])

    return mesh, n, step, params, tokens, targets


def _loss_and_grads(fn, params, tokens, targets, how):
    """(loss, this stage's gradients): ``fs.value_and_grad`` inside ``fn`` or backward outside."""
    import fshard as fs

    if how == "value_and_grad":
        loss, grads = fn(params, tokens, targets)
        if not isinstance(grads, fs.PerRank):
            raise AssertionError(f"gradients are a {type(grads).__name__}, not a PerRank")
        return loss.detach(), torch.utils._pytree.tree_leaves(grads.tree)
    leaves = torch.utils._pytree.tree_leaves(params.tree)
    for t in leaves:
        t.requires_grad_()
    loss = fn(params, tokens, targets)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


def _rank_pipeline(shape, backends, hows):
    import fshard as fs

    errs: list[str] = []
    out: dict = {}
    mesh, n, step, params, tokens, targets = _step(shape)
    s = mesh.axis_index("pp")
    want_loss, want, _ = reference(n, tokens, targets)
    for how in hows:
        fn = fs.value_and_grad(step) if how == "value_and_grad" else step
        eager_loss, eager_grads = _loss_and_grads(fn, params(), tokens, targets, how)
        for backend in backends:
            torch._dynamo.reset()
            counter, stats = compile_counter()
            with torch._dynamo.config.patch(trace_autograd_ops=True):
                compiled = torch.compile(
                    fn, backend=counter if backend == "aot_eager" else backend, fullgraph=True
                )
                for call in range(2):  # the second call reuses the graph
                    loss, grads = _loss_and_grads(compiled, params(), tokens, targets, how)
                    where = f"{backend}, {how}, call {call}"
                    close(errs, f"{where}: loss vs one process", loss, want_loss, DT)
                    close(errs, f"{where}: loss vs eager", loss, eager_loss, DT)
                    if len(grads) != len(want[s]):
                        errs.append(f"{where}: stage {s}: {len(grads)} gradients, want {len(want[s])}")
                    for k, (a, b, c) in enumerate(zip(grads, want[s], eager_grads)):
                        close(errs, f"{where}: stage {s} gradient {k} vs one process", a, b, DT)
                        close(errs, f"{where}: stage {s} gradient {k} vs eager", a, c, DT)
            if backend == "aot_eager":
                out[(how, "graphs")] = stats["graphs"]
                out[(how, "ops")] = sorted(stats["ops"])
    return errs, out


CASES = [
    (2, {"pp": 2}, ("aot_eager", "inductor"), ("backward", "value_and_grad")),
    (4, {"pp": 4}, ("aot_eager",), ("backward", "value_and_grad")),
    (4, {"dp": 2, "pp": 2}, ("aot_eager",), ("backward", "value_and_grad")),
    (4, {"dp": 2, "pp": 2}, ("inductor",), ("value_and_grad",)),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n,shape,backends,hows", CASES, ids=["pp2", "pp4", "dp2xpp2", "dp2xpp2-inductor"])
def test_compiled_pipeline_of_per_rank_stages_matches_one_process_and_eager(n, shape, backends, hows):
    got = run_ranks(n, _rank_pipeline, shape, backends, hows, timeout=380)
    assert_ok([errs for errs, _ in got])
    if "aot_eager" not in backends:
        return
    for how in hows:
        # one graph per rank, reused by the second call
        assert [out[(how, "graphs")] for _, out in got] == [1] * n, how
        # every rank's compiled graphs hold the same collectives (none dropped on one rank)
        ops = [out[(how, "ops")] for _, out in got]
        assert all(o == ops[0] for o in ops), (how, ops)
        stages = shape["pp"]
        ticks = 3 + stages - 1  # microbatches + bubble (tests/test_stages.py: M = 3)
        # a ppermute per tick but the last, forward and backward (all_to_all_single each)
        assert ops[0].count("all_to_all_single") == 2 * (ticks - 1), ops[0]


# == collectives inside the branches: compared per group ====================================


def _rank_branch_collectives(backend):
    """pp=2 x tp=2: stage 1's branch sums over tp, stage 0's does not. The ranks of a tp group run
    the same branch, so their graphs agree where they must (on the collectives over their tp
    group); the ranks of the mesh as a whole do not, and must not be refused for it."""
    import fshard as fs

    mesh = fs.Mesh(pp=2, tp=2)
    x = torch.arange(1.0, 9.0, dtype=DT)  # "(tp d)"
    c = fs.PerRank.build(mesh, "pp", lambda s: torch.tensor(float(s + 1), dtype=DT))

    def f(c, x):
        branches = [lambda c, x: (x * c).sum(), lambda c, x: fs.psum((x * c).sum(), "tp")]
        return fs.psum(fs.switch(fs.axis_index("pp"), branches, c, x), ("pp", "tp"))

    sm = fs.shard_map(f, mesh=mesh, in_specs=(None, "(tp d)"), out_specs="")
    errs: list[str] = []
    want = (1.0 + 2 * 2.0) * x.sum()  # stage 0's two blocks once, stage 1's psum on both its ranks
    want_grad = x.sum() * (1.0 if mesh.axis_index("pp") == 0 else 2.0)
    for name, fn in (("eager", sm), (backend, torch.compile(sm, backend=backend, fullgraph=True))):
        torch._dynamo.reset()
        leaf = c.tree.detach().clone().requires_grad_()
        loss = fn(fs.PerRank(leaf, "pp", mesh), x)
        loss.backward()
        close(errs, f"{name}: loss", loss, want, DT)
        close(errs, f"{name}: this stage's gradient", leaf.grad, want_grad, DT)
    return errs


def test_branches_with_collectives_over_other_axes_compile_and_match_one_process():
    assert_ok(run_ranks(4, _rank_branch_collectives, "aot_eager", timeout=110))


def _rank_group_differs():
    """pp=2 x tp=2, rank 1 alone adds a psum over tp: its tp group (ranks 0, 1) disagrees; every
    rank of the mesh raises the same error at trace time (ranks 2 and 3 too, whose group agrees)."""
    import torch.distributed as dist

    import fshard as fs

    mesh = fs.Mesh(pp=2, tp=2)
    rank = dist.get_rank()

    def f(x):
        y = x * 2
        if rank == 1:
            y = fs.psum(y, "tp")
        return y

    sm = fs.shard_map(f, mesh=mesh, in_specs="(tp d)", out_specs="(tp d)")
    torch._dynamo.reset()
    try:
        fs.compile(sm, backend="aot_eager")(torch.ones(4))
        return "nothing raised", f.__code__.co_firstlineno
    except Exception as err:  # noqa: BLE001  (the exception's type and text are compared)
        return f"{type(err).__name__}: {err}", f.__code__.co_firstlineno


def test_a_group_whose_ranks_trace_different_collectives_makes_every_rank_raise():
    got = run_ranks(4, _rank_group_differs, timeout=110)
    first = got[0][1]
    want = (
        "CollectiveError: fshard: the ranks of the group over tp (ranks 0, 1) traced different collectives "
        "into their compiled graphs of fs.shard_map(_rank_group_differs.<locals>.f):\n"
        f"  - rank 0: no collective #1 (it traced 0)\n"
        f"  - rank 1: #1 all_reduce (sum) over tp of float32 (2,) at test_compile_stages.py:{first + 3}\n"
        "Nothing was sent: every rank raised this error while Dynamo traced the call, before its graph "
        "ran. Every rank must issue the same collectives over a group in the same order (op, axes, shape, "
        "dtype, call site): look for a collective in a branch on the rank or on per-rank data (if rank == 0, "
        "a loop whose length differs by rank) and make every rank reach it"
    )
    for rank, (message, _) in enumerate(got):
        assert message == want, f"rank {rank}"
