"""The partial-sum check: an output whose out_spec marks it as a partial sum (``| sum(y)``) over an
axis it does not vary over is refused (JAX: ``Invariant -> Unreduced``), where it used to be summed
over its equal copies without a word (``y``'s size times the value).

On 2x2 meshes (4 gloo ranks): the full message, the same on every rank, raised before the outputs'
collectives; with combining on and off; under ``torch.compile`` (at trace time); for the leaves of an
``fs.PerRank`` output; ``check=False`` keeps the old sum (documented); and the partial sums that are
right still reduce to the value plain torch computes on the global tensors in one process.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import env_vars, randn

A, B = randn(0, 4, 6), randn(1, 6, 5)


def _call(fn, *args):
    """What ``fn(*args)`` gives on this rank: ("ok", the global value) or ("SpecError", text), with
    the collectives issued."""
    import fshard as fs

    with fs.count_collectives() as c:
        try:
            out = fn(*args)
        except fs.SpecError as e:
            return "SpecError", str(e), c.total
    if isinstance(out, tuple):
        out = tuple(o.full() if isinstance(o, fs.Sharded) else o for o in out)
    elif isinstance(out, fs.Sharded):
        out = out.full()
    return "ok", out, c.total


def _rank_partial(combine: str, check: bool):
    import fshard as fs

    with env_vars(FSHARD_COMBINE=combine):
        mesh = fs.Mesh(x=2, y=2)
        out = {}

        def mm(a, b):
            return a @ b

        # the program: k is not split over y, so a @ b is already complete on every rank of y
        f = fs.shard_map(
            mm, mesh=mesh, in_specs=("(x i) k", "k j"), out_specs="(x i) j | sum(y)", check=check
        )
        out["flat"] = _call(f, A, B)
        # the right program: k split over y, each rank of y holds one term of the sum
        g = fs.shard_map(mm, mesh=mesh, in_specs=("(x i) (y k)", "(y k) j"), out_specs="(x i) j | sum(y)")
        out["partial"] = _call(g, A, B)
        # summed over two axes, varying over one of them (y) and not the other (x)
        h = fs.shard_map(
            mm, mesh=mesh, in_specs=("i (y k)", "(y k) j"), out_specs="i j | sum(x y)", check=check
        )
        out["one of two"] = _call(h, A, B)
        # a reduce-scatter form: summed over y and split over y
        s = fs.shard_map(mm, mesh=mesh, in_specs=("i k", "k j"), out_specs="(y i) j | sum(y)", check=check)
        out["scatter"] = _call(s, A, B)

        # a psum inside f (combined into one collective, or not), then the result marked as a partial sum again
        def two(a, b):
            return fs.psum(a @ b, "y"), fs.psum(b, "y"), a @ b

        t = fs.shard_map(
            two,
            mesh=mesh,
            in_specs=("(x i) (y k)", "(y k) j"),
            out_specs=("(x i) j | sum(y)", "k j | sum(y)", "(x i) j"),
            check=check,
        )
        out["after psum"] = _call(t, A, B)
    return out


def _want_flat_message(path, spec, ax, n, drop):
    return (
        f"  - {path} does not vary over mesh axis {ax} (it is the same on every rank of {ax}), but out_spec "
        f"{spec!r} marks it as a partial sum over {ax}, which would add up its {n} equal copies ({n} times the "
        f"value); {drop} to return the value as it is, or make each rank of {ax} compute its own term of the sum "
        f"(e.g. split the contracted dim over {ax} in the in_specs); to add the {n} copies on purpose, return "
        f"fs.pvary(x, {ax!r})"
    )


@pytest.mark.parametrize("combine", ["1", "0"])
def test_partial_sum_of_a_value_that_does_not_vary_is_refused(combine):
    got = run_ranks(4, _rank_partial, combine, True, timeout=120)
    head = "fs.shard_map({}): 1 problem with out_specs (partial-sum check):\n"
    flat = head.format("_rank_partial.<locals>.mm") + _want_flat_message(
        "out", "(x i) j | sum(y)", "y", 2, "drop '| sum(y)' from the out_spec"
    )
    one_of_two = head.format("_rank_partial.<locals>.mm") + _want_flat_message(
        "out", "i j | sum(x y)", "x", 2, "drop x from its 'sum(x y)'"
    )
    scatter = head.format("_rank_partial.<locals>.mm") + _want_flat_message(
        "out", "(y i) j | sum(y)", "y", 2, "drop '| sum(y)' from the out_spec"
    )
    after = (
        "fs.shard_map(_rank_partial.<locals>.two): 3 problems with out_specs (replication and partial-sum checks):\n"
        + _want_flat_message("out[0]", "(x i) j | sum(y)", "y", 2, "drop '| sum(y)' from the out_spec")
        + "\n"
        + _want_flat_message("out[1]", "k j | sum(y)", "y", 2, "drop '| sum(y)' from the out_spec")
        + "\n  - out[2] varies over mesh axis y but out_spec '(x i) j' says it is replicated over y; reduce it "
        "inside f (fs.psum / fs.pmean over 'y'), mark it as a partial sum with '| sum(y)', split a dim over y "
        "in the out_spec, or pass check=False if you know it is the same on every rank"
    )
    for out in got:  # every rank raises the same error, before the outputs' collectives
        assert out["flat"] == ("SpecError", flat, 0)
        assert out["one of two"] == ("SpecError", one_of_two, 0)
        assert out["scatter"] == ("SpecError", scatter, 0)
        # f's own psums ran (one combined all-reduce, or two), the outputs' none
        assert out["after psum"] == ("SpecError", after, 1 if combine == "1" else 2)
        kind, value, _ = out["partial"]
        assert kind == "ok"
        torch.testing.assert_close(value, A @ B)


@pytest.mark.parametrize("combine", ["1", "0"])
def test_partial_sum_unchecked_sums_the_copies(combine):
    # check=False: as before the check, each rank's copy counts as one term (documented on shard_map)
    got = run_ranks(4, _rank_partial, combine, False, timeout=120)
    for out in got:
        assert out["flat"][0] == "ok" and out["one of two"][0] == "ok" and out["scatter"][0] == "ok"
        torch.testing.assert_close(out["flat"][1], 2 * (A @ B))
        torch.testing.assert_close(out["one of two"][1], 2 * (A @ B))
        torch.testing.assert_close(out["scatter"][1], 2 * (A @ B))
        kind, value, _ = out["after psum"]
        assert kind == "ok"
        torch.testing.assert_close(value[0], 2 * (A @ B))
        torch.testing.assert_close(value[1], 2 * B.reshape(2, 3, 5).sum(0))


def _rank_partial_grad():
    """The gradient of a right partial sum against plain torch (the check does not change it)."""
    import fshard as fs

    mesh = fs.Mesh(x=2, y=2)
    f = fs.shard_map(
        lambda a, b: a @ b, mesh=mesh, in_specs=("(x i) (y k)", "(y k) j"), out_specs="(x i) j | sum(y)"
    )
    a, b = A.clone().requires_grad_(), B.clone().requires_grad_()
    (f(a, b).full() ** 2).sum().backward()
    return a.grad, b.grad


def test_right_partial_sum_gradient_matches_one_process():
    a, b = A.clone().requires_grad_(), B.clone().requires_grad_()
    ((a @ b) ** 2).sum().backward()
    for ga, gb in run_ranks(4, _rank_partial_grad, timeout=120):
        torch.testing.assert_close(ga, a.grad)
        torch.testing.assert_close(gb, b.grad)


def _rank_per_rank_and_compiled():
    import fshard as fs

    torch._dynamo.reset()
    mesh = fs.Mesh(x=2, y=2)
    out = {}

    # the leaves of an fs.PerRank output vary over its axes (x); summed over y, they must vary over y
    def per_rank(a, b):
        return fs.PerRank({"w": a @ b}, "x")

    f = fs.shard_map(per_rank, mesh=mesh, in_specs=("(x i) k", "k j"), out_specs="i j | sum(y)")
    out["PerRank flat"] = _call(f, A, B)
    g = fs.shard_map(per_rank, mesh=mesh, in_specs=("(x i) (y k)", "(y k) j"), out_specs="i j | sum(y)")
    kind, value, _ = _call(g, A, B)
    out["PerRank partial"] = (kind, value.tree["w"], value.index)

    # compiled: the check runs at trace time
    c = fs.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=("(x i) k", "k j"), out_specs="(x i) j | sum(y)")
    try:
        torch.compile(c, backend="aot_eager", fullgraph=True)(A, B)
        out["compiled"] = "nothing raised"
    except Exception as e:
        out["compiled"] = f"{type(e).__name__}: {e}".split("\n\nfrom user code:")[0]
    ok = fs.shard_map(
        lambda a, b: a @ b, mesh=mesh, in_specs=("(x i) (y k)", "(y k) j"), out_specs="(x i) j | sum(y)"
    )
    out["compiled partial"] = torch.compile(ok, backend="aot_eager", fullgraph=True)(A, B).full()
    return out


def test_partial_check_for_per_rank_outputs_and_compiled_calls():
    got = run_ranks(4, _rank_per_rank_and_compiled, timeout=300)
    per_rank = (
        "fs.shard_map(_rank_per_rank_and_compiled.<locals>.per_rank): 1 problem with out_specs (partial-sum check):\n"
        + _want_flat_message("out.tree['w']", "i j | sum(y)", "y", 2, "drop '| sum(y)' from the out_spec")
    )
    compiled = (
        "InternalTorchDynamoError: SpecError: fs.shard_map(_rank_per_rank_and_compiled.<locals>.<lambda>): "
        "1 problem with out_specs (partial-sum check):\n"
        + _want_flat_message("out", "(x i) j | sum(y)", "y", 2, "drop '| sum(y)' from the out_spec")
    )
    for out in got:
        assert out["PerRank flat"] == ("SpecError", per_rank, 0)
        kind, value, index = out["PerRank partial"]
        assert kind == "ok"
        torch.testing.assert_close(value, (A @ B).chunk(2)[index])
        assert out["compiled"] == compiled
        torch.testing.assert_close(out["compiled partial"], A @ B)
