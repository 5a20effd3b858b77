"""Dim labels across the specs of one shard_map call: named labels tie, the anonymous ``_`` never does.

A label names one logical dim, so every dim written with the same label must have the same global
size in every argument of a call. ``_`` is the anonymous label: each ``_`` is its own unnamed dim,
so specs generated per leaf (``optree.tree_map(lambda t: "(dp _) _", params)``) or one written
spec reused for several arguments bind whatever the shapes. Results are compared with plain torch
on the global tensors, and the message of a tie that fails is asserted in full.
"""

from __future__ import annotations

import optree
import pytest

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, randn

# parameters of different shapes whose first dims the mesh (dp=2) divides; optree orders the
# leaves by key (b, w1, w2), and so do the messages
SHAPES = {"w1": (8, 6), "w2": (4, 10), "b": (2, 3)}


def _params():
    return {k: randn(i, *shape) for i, (k, shape) in enumerate(SHAPES.items())}


def _scale(p):
    return optree.tree_map(lambda t: 2 * t, p)


def _add(x, y):
    return x + 1, y - 1


def _per_leaf_specs(template):
    """Specs generated per leaf (each leaf its own spec object, not one shared template)."""
    mesh = fs.Mesh(dp=2, tp=2)
    params = _params()
    specs = optree.tree_map(lambda t: template, params)
    f = fs.shard_map(_scale, mesh=mesh, in_specs=(specs,), out_specs=specs)
    try:
        out = f(params)
    except fs.SpecError as e:
        return "SpecError", str(e)
    errs: list[str] = []
    for k, x in params.items():
        if not isinstance(out[k], fs.Sharded):
            errs.append(f"{k}: got {type(out[k]).__name__}, want Sharded")
            continue
        if out[k].spec != template:
            errs.append(f"{k}: spec {out[k].spec!r}, want {template!r}")
        close(errs, k, out[k].full(), 2 * x)
    return "ok", errs


def test_specs_generated_per_leaf_with_anonymous_labels_bind_any_shapes():
    results = run_ranks(4, _per_leaf_specs, "(dp _) _")
    assert [r[0] for r in results] == ["ok"] * 4, results[0]
    assert_ok([r[1] for r in results])


def test_specs_generated_per_leaf_with_named_labels_tie_and_say_how_to_untie():
    results = run_ranks(4, _per_leaf_specs, "(dp a) b")
    assert results == [results[0]] * 4, "ranks disagree"
    kind, text = results[0]
    assert kind == "SpecError"
    assert text == (
        "fs.shard_map(_scale): 4 problems with in_specs:\n"
        "  - dim 'a' has size 2 in args[0]['b'] but size 8 in args[0]['w1'] (spec '(dp a) b', shape "
        "(8, 6)); a label names one logical dim, so its global size must agree everywhere; rename one "
        "of them, or write _ for a dim that should not tie\n"
        "  - dim 'b' has size 3 in args[0]['b'] but size 6 in args[0]['w1'] (spec '(dp a) b', shape "
        "(8, 6)); a label names one logical dim, so its global size must agree everywhere; rename one "
        "of them, or write _ for a dim that should not tie\n"
        "  - dim 'a' has size 2 in args[0]['b'] but size 4 in args[0]['w2'] (spec '(dp a) b', shape "
        "(4, 10)); a label names one logical dim, so its global size must agree everywhere; rename one "
        "of them, or write _ for a dim that should not tie\n"
        "  - dim 'b' has size 3 in args[0]['b'] but size 10 in args[0]['w2'] (spec '(dp a) b', shape "
        "(4, 10)); a label names one logical dim, so its global size must agree everywhere; rename one "
        "of them, or write _ for a dim that should not tie"
    )


def _same_spec_for_two_arguments(in_specs, out_specs):
    mesh = fs.Mesh(dp=2, tp=2)
    x, y = randn(10, 4, 6), randn(11, 6, 10)
    f = fs.shard_map(_add, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    try:
        gx, gy = f(x, y)
    except fs.SpecError as e:
        return "SpecError", str(e)
    errs: list[str] = []
    close(errs, "x + 1", gx.full(), x + 1)
    close(errs, "y - 1", gy.full(), y - 1)
    specs = out_specs if isinstance(out_specs, tuple) else (out_specs, out_specs)
    errs += [f"spec {got.spec!r}, want {want!r}" for got, want in zip((gx, gy), specs) if got.spec != want]
    return "ok", errs


@pytest.mark.parametrize(
    "in_specs, out_specs",
    [
        pytest.param(("(dp _) _", "(dp _) _"), ("(dp _) _", "(dp _) _"), id="written-twice"),
        pytest.param(("(dp _) (tp _)",) * 2, ("(dp _) (tp _)",) * 2, id="one-object-reused"),
        pytest.param(("(dp b) _", "(dp c) (tp _)"), ("(dp _) _", "(dp _) (tp _)"), id="mixed-with-names"),
    ],
)
def test_one_anonymous_spec_for_several_arguments(in_specs, out_specs):
    results = run_ranks(4, _same_spec_for_two_arguments, in_specs, out_specs)
    assert [r[0] for r in results] == ["ok"] * 4, results[0]
    assert_ok([r[1] for r in results])


def test_named_labels_still_tie_next_to_anonymous_ones():
    results = run_ranks(4, _same_spec_for_two_arguments, ("(dp b) _", "(dp b) _"), "(dp _) _")
    assert results == [results[0]] * 4, "ranks disagree"
    assert results[0] == (
        "SpecError",
        "fs.shard_map(_add): 1 problem with in_specs:\n"
        "  - dim 'b' has size 4 in args[0] but size 6 in args[1] (spec '(dp b) _', shape (6, 10)); a "
        "label names one logical dim, so its global size must agree everywhere; rename one of them, "
        "or write _ for a dim that should not tie",
    )
