"""Binding a spec to a mesh and a tensor rank: layouts, shapes and the problems of a bad spec.

Rank-free unit tests of ``fshard._layout``: ``bind(spec, axis_sizes, ndim)`` returns
``(layout, problems)``; a layout gives the mesh axes of each dim (``dims``, ``split_axes``), block
and global shapes (``local_shape`` / ``global_shape``), its canonical spec text (``spec_text``),
and which block each mesh coordinate holds (``block``: torch.chunk's cut, uneven when the mesh does
not divide a dim; more in ``test_uneven.py``). Expectations are computed
here independently: for random meshes and specs built from known parts (hypothesis), and as full
problem texts for the usual mistakes.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fshard._layout import bind

MESH_AXES = ("dp", "tp", "pp", "sp")
LABELS = ("b", "s", "h", "d", "k", "n")

DP2 = (("dp", 2),)
TP4 = (("tp", 4),)
DP2_TP2 = (("dp", 2), ("tp", 2))
DP2_TP3 = (("dp", 2), ("tp", 3))


# == random valid specs: what was written, and the layout it must bind to ====================


@st.composite
def written_specs(draw):
    """A mesh and a valid spec written from known parts, with the layout it must bind to.

    Each mesh axis splits at most one dim (in the order drawn, which is the written order and
    need not be the mesh's), labels are distinct and not mesh axes except the anonymous ``_``
    (any number of dims), an optional ``...`` stands for unsplit dims, and the ``| sum(...)`` axes
    split no dim.
    """
    names = draw(st.lists(st.sampled_from(MESH_AXES), unique=True, max_size=4))
    sizes = draw(st.lists(st.integers(1, 4), min_size=len(names), max_size=len(names)))
    axis_sizes = tuple(zip(names, sizes))
    n_written = draw(st.integers(0, 4))
    labels = draw(st.lists(st.sampled_from(LABELS), unique=True, min_size=n_written, max_size=n_written))
    labels = [draw(st.sampled_from((label, "_"))) for label in labels]
    handed_out = draw(st.permutations(names))
    owner = [draw(st.integers(-1, n_written - 1)) for _ in handed_out]
    split = [tuple(a for a, o in zip(handed_out, owner) if o == i) for i in range(n_written)]
    unused = [a for a, o in zip(handed_out, owner) if o == -1]
    partial = draw(st.lists(st.sampled_from(unused), unique=True)) if unused else []
    # a dim with a label only may still be written in parentheses: "(b)"
    entries = [
        f"({' '.join(axes + (label,))})" if axes or draw(st.booleans()) else label
        for axes, label in zip(split, labels)
    ]
    dims, dim_labels = list(split), list(labels)
    if draw(st.booleans()):  # '...' somewhere, standing for 0 to 2 unsplit dims
        pos, n_ell = draw(st.integers(0, n_written)), draw(st.integers(0, 2))
        entries.insert(pos, "...")
        dims[pos:pos] = [()] * n_ell
        dim_labels[pos:pos] = [None] * n_ell
    suffix = f"| sum({' '.join(partial)})" if partial else ""
    text = " ".join(entries + [suffix]).strip()
    return text, axis_sizes, tuple(dims), tuple(dim_labels), tuple(partial)


def _canonical_text(dims, labels, partial):
    """The spec text of a layout: ``(axes label)`` for a split dim, ``d<i>`` for a dim under ``...``."""
    parts = [
        f"({' '.join(axes)} {label or f'd{i}'})" if axes else (label or f"d{i}")
        for i, (axes, label) in enumerate(zip(dims, labels))
    ]
    suffix = f"| sum({' '.join(partial)})" if partial else ""
    return " ".join(parts + [suffix]).strip()


@settings(max_examples=200, deadline=None)
@given(written_specs())
def test_bind_splits_each_dim_over_its_grouped_axes_in_written_order(case):
    text, axis_sizes, dims, labels, partial = case
    layout, problems = bind(text, axis_sizes, len(dims))
    assert problems == ()
    assert layout.dims == dims
    assert layout.labels == labels
    assert layout.split_axes == tuple(a for axes in dims for a in axes)
    assert layout.spec_text() == _canonical_text(dims, labels, partial)
    # the canonical text binds to the same placement
    again, problems = bind(layout.spec_text(), axis_sizes, len(dims))
    assert problems == ()
    assert again.dims == dims
    assert again.spec_text() == layout.spec_text()


@settings(max_examples=200, deadline=None)
@given(written_specs(), st.data())
def test_block_shape_times_axis_sizes_is_the_global_shape(case, data):
    text, axis_sizes, dims, _, _ = case
    mesh_shape = dict(axis_sizes)
    layout, _ = bind(text, axis_sizes, len(dims))
    block = tuple(data.draw(st.lists(st.integers(1, 5), min_size=len(dims), max_size=len(dims))))
    whole = tuple(n * math.prod(mesh_shape[a] for a in axes) for n, axes in zip(block, dims))
    assert layout.global_shape(block, mesh_shape) == whole
    assert layout.local_shape(whole, mesh_shape) == block
    assert layout.is_even(whole, mesh_shape)


@settings(max_examples=200, deadline=None)
@given(written_specs(), st.data())
def test_blocks_tile_the_global_value_as_torch_chunk_cuts(case, data):
    text, axis_sizes, dims, _, _ = case
    mesh_shape = dict(axis_sizes)
    layout, _ = bind(text, axis_sizes, len(dims))
    shape = data.draw(st.lists(st.integers(0, 12), min_size=len(dims), max_size=len(dims)))
    parts = [math.prod(mesh_shape[a] for a in axes) for axes in dims]
    assert layout.is_even(shape, mesh_shape) == all(size % n == 0 for size, n in zip(shape, parts))
    names = list(mesh_shape)
    coords = [{}]
    for a in names:
        coords = [{**c, a: i} for c in coords for i in range(mesh_shape[a])]
    for d, axes in enumerate(dims):
        # the blocks of dim d, by block index: disjoint, in order, covering it, the first the longer
        by_index = {}
        for c in coords:
            by_index.setdefault(layout.block_index(d, mesh_shape, c), layout.block(shape, mesh_shape, c)[d])
        assert sorted(by_index) == list(range(parts[d]))
        pieces = [by_index[i] for i in range(parts[d])]
        assert sum(n for _, n in pieces) == shape[d]
        assert all(a[0] + a[1] == b[0] or b[1] == 0 for a, b in zip(pieces, pieces[1:]))
        assert [n for _, n in pieces] == sorted((n for _, n in pieces), reverse=True) or len(axes) > 1
        if len(axes) == 1:  # one axis: exactly torch.chunk's pieces, then empty ones
            chunks = [t.numel() for t in torch.arange(shape[d]).chunk(parts[d])] if shape[d] else []
            assert [n for _, n in pieces] == chunks + [0] * (parts[d] - len(chunks))


# == examples =================================================================================


BIND_EXAMPLES = [
    ("b d", DP2, 2, ((), ()), ()),
    ("(dp b) d", DP2, 2, (("dp",), ()), ("dp",)),
    ("(b) d", DP2, 2, ((), ()), ()),
    (
        "(tp b) (dp pp k)",
        (("dp", 2), ("tp", 2), ("pp", 2)),
        2,
        (("tp",), ("dp", "pp")),
        ("tp", "dp", "pp"),
    ),
    ("(tp dp b)", DP2_TP2, 1, (("tp", "dp"),), ("tp", "dp")),
    ("... (tp d)", DP2_TP2, 3, ((), (), ("tp",)), ("tp",)),
    ("(dp b) ...", DP2_TP2, 1, (("dp",),), ("dp",)),
    ("(dp tp b) n | sum(pp)", (("dp", 2), ("tp", 2), ("pp", 2)), 2, (("dp", "tp"), ()), ("dp", "tp")),
    ("(dp _) _", DP2, 2, (("dp",), ()), ("dp",)),
    ("_ (dp _) (tp _)", DP2_TP2, 3, ((), ("dp",), ("tp",)), ("dp", "tp")),
]


@pytest.mark.parametrize(
    "spec, axis_sizes, ndim, dims, split_axes", BIND_EXAMPLES, ids=[c[0] for c in BIND_EXAMPLES]
)
def test_bind_examples(spec, axis_sizes, ndim, dims, split_axes):
    layout, problems = bind(spec, axis_sizes, ndim)
    assert problems == ()
    assert layout.dims == dims
    assert layout.split_axes == split_axes


TEXT_EXAMPLES = [
    ("(dp b) d", DP2, 2, "(dp b) d"),
    ("( dp  b )   d", DP2, 2, "(dp b) d"),
    ("(b) s", DP2, 2, "b s"),
    ("... (tp d)", DP2_TP2, 3, "d0 d1 (tp d)"),
    ("b ... d", DP2, 3, "b d1 d"),
    ("b n | sum(tp)", DP2_TP2, 2, "b n | sum(tp)"),
    ("(dp tp b) n | sum(tp)", DP2_TP2, 2, "(dp tp b) n | sum(tp)"),
    ("| sum(dp)", DP2, 0, "| sum(dp)"),
    ("", DP2, 0, ""),
    ("(dp _)  (_)", DP2, 2, "(dp _) _"),
    ("_ ... (tp _)", DP2_TP2, 3, "_ d1 (tp _)"),
]


@pytest.mark.parametrize(
    "spec, axis_sizes, ndim, text", TEXT_EXAMPLES, ids=[c[0] or "empty" for c in TEXT_EXAMPLES]
)
def test_spec_text_examples(spec, axis_sizes, ndim, text):
    layout, problems = bind(spec, axis_sizes, ndim)
    assert problems == ()
    assert layout.spec_text() == text


def test_local_and_global_shape_examples():
    layout, _ = bind("(dp b) (tp k)", DP2_TP3, 2)
    assert layout.local_shape((8, 9), {"dp": 2, "tp": 3}) == (4, 3)
    assert layout.global_shape((4, 3), {"dp": 2, "tp": 3}) == (8, 9)
    layout, _ = bind("... (dp tp d)", DP2_TP2, 3)
    assert layout.local_shape((5, 6, 8), {"dp": 2, "tp": 2}) == (5, 6, 2)
    assert layout.global_shape((5, 6, 2), {"dp": 2, "tp": 2}) == (5, 6, 8)


# == the problems of a bad spec, in full ======================================================

_NDIMS = "write one name per dim, or '...' for unsplit dims"


@pytest.mark.parametrize(
    "spec, axis_sizes, ndim, problems",
    [
        pytest.param(
            "b d", DP2, 3, [f"the spec names 2 dims but the tensor has 3; {_NDIMS}"], id="too-few-dims"
        ),
        pytest.param("b", DP2, 2, [f"the spec names 1 dim but the tensor has 2; {_NDIMS}"], id="one-dim"),
        pytest.param(
            "(dp b) d", DP2, 1, [f"the spec names 2 dims but the tensor has 1; {_NDIMS}"], id="too-many"
        ),
        pytest.param(
            "b ... d k",
            DP2,
            2,
            ["the spec names 3 dims besides '...' but the tensor has 2; remove dims from the spec"],
            id="too-many-besides-ellipsis",
        ),
        pytest.param(
            "(dp a) (dp b)",
            DP2_TP2,
            2,
            ["mesh axis 'dp' splits both dim 0 and dim 1; an axis can split one dim only"],
            id="axis-splits-two-dims",
        ),
        pytest.param(
            "(dp dp a)", DP2, 1, ["mesh axis 'dp' appears twice in (dp dp a)"], id="axis-twice-in-a-group"
        ),
        pytest.param(
            "dp d",
            DP2,
            2,
            [
                (
                    "'dp' is a mesh axis of Mesh(dp=2), so it cannot label dim 0: write (dp x) to split "
                    "this dim over dp, or rename the dim"
                )
            ],
            id="mesh-axis-as-label",
        ),
        pytest.param(
            "b tp",
            DP2_TP2,
            2,
            [
                (
                    "'tp' is a mesh axis of Mesh(dp=2, tp=2), so it cannot label dim 1: write (tp x) to split "
                    "this dim over tp, or rename the dim"
                )
            ],
            id="mesh-axis-as-second-label",
        ),
        pytest.param(
            "(dp tp) d",
            DP2_TP2,
            2,
            ["group (dp tp) of dim 0 has no dim label; add one after the mesh axes, e.g. (dp tp x)"],
            id="group-without-label",
        ),
        pytest.param(
            "b (tp b)",
            DP2_TP2,
            2,
            ["label 'b' names both dim 0 and dim 1; give each dim its own name"],
            id="label-twice",
        ),
        pytest.param(
            "b | sum(pd)",
            DP2,
            1,
            ["sum(pd) names 'pd', which is not an axis of Mesh(dp=2) (did you mean 'dp'?)"],
            id="sum-axis-not-in-mesh",
        ),
        pytest.param(
            "b | sum(zz)",
            DP2_TP2,
            1,
            ["sum(zz) names 'zz', which is not an axis of Mesh(dp=2, tp=2)"],
            id="sum-axis-not-in-mesh-no-suggestion",
        ),
        pytest.param("b | sum(dp dp)", DP2, 1, ["sum(...) names axis 'dp' twice"], id="sum-axis-twice"),
        pytest.param(
            "(b dp)",
            DP2,
            1,
            ["in (b dp) the mesh axes must come before the dim label: write (dp b)"],
            id="label-before-axes",
        ),
        pytest.param(
            "(pd tp b)",
            DP2_TP2,
            1,
            [
                (
                    "'pd' in (pd tp b) is not an axis of Mesh(dp=2, tp=2) (did you mean 'dp'?); a group lists "
                    "mesh axes first, then one dim label"
                )
            ],
            id="unknown-axis-in-group",
        ),
        pytest.param(
            "(tp dp b) | sum(tp)",
            DP2_TP2,
            1,
            [
                (
                    "dim 0 is split over ('tp', 'dp') and summed over ('tp',): the summed axes must come last "
                    "in the group so that a reduce-scatter produces the block"
                )
            ],
            id="summed-axis-not-last",
        ),
        pytest.param(
            "(dp a) (dp a)",
            DP2,
            2,
            [
                "mesh axis 'dp' splits both dim 0 and dim 1; an axis can split one dim only",
                "label 'a' names both dim 0 and dim 1; give each dim its own name",
            ],
            id="every-problem-at-once",
        ),
        pytest.param(
            "(_ dp)",
            DP2,
            1,
            ["in (_ dp) the mesh axes must come before the dim label: write (dp _)"],
            id="anonymous-label-before-axes",
        ),
        pytest.param(
            "(dp _ _)",
            DP2,
            1,
            [
                (
                    "'_' in (dp _ _) is not an axis of Mesh(dp=2); a group lists mesh axes first, then one "
                    "dim label"
                )
            ],
            id="two-anonymous-labels-in-a-group",
        ),
        pytest.param(
            "(dp _) (dp _)",
            DP2,
            2,
            ["mesh axis 'dp' splits both dim 0 and dim 1; an axis can split one dim only"],
            id="anonymous-labels-do-not-tie-but-axes-still-split-one-dim",
        ),
    ],
)
def test_bind_problems(spec, axis_sizes, ndim, problems):
    layout, got = bind(spec, axis_sizes, ndim)
    assert layout is None
    assert list(got) == problems


def test_anonymous_label_is_kept_and_never_reported_twice():
    layout, problems = bind("(dp _) _ _", DP2, 3)
    assert problems == ()
    assert layout.labels == ("_", "_", "_")
    assert str(layout) == "(dp _) _ _"
    # a named label still may not name two dims, next to anonymous ones
    _, problems = bind("(dp _) b (tp b) _", DP2_TP2, 4)
    assert problems == ("label 'b' names both dim 1 and dim 2; give each dim its own name",)
