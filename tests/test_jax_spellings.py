"""JAX spellings: ``axis_name=`` for the mesh axis and ``psum(1, axis)`` for the axis size.

Each collective called with ``axis_name=`` is compared with plain torch on the global tensors;
the mistakes JAX users make raise with their full messages on every rank.
"""

from __future__ import annotations

import torch

import fshard as fs
from tests.conftest import run_ranks


def _rank_spellings(X):
    mesh = fs.Mesh(dp=2, tp=2)

    def f(x):
        out = {
            "psum": fs.psum(x, axis_name="tp"),
            "pmean": fs.pmean(x, axis_name="dp"),
            "pmax": fs.pmax(x, axis_name="tp"),
            "gather": fs.all_gather(x, axis_name="tp", dim=1, tiled=True),
            "scatter": fs.psum_scatter(x.repeat(1, 2), axis_name="tp", dim=1, tiled=True),
            "perm": fs.ppermute(x, axis_name="dp", perm=[(0, 1), (1, 0)]),
            "a2a": fs.all_to_all(x.repeat(2, 1), axis_name="tp", split_dim=0, concat_dim=1),
        }
        sizes = (
            fs.psum(1, "tp"),
            fs.psum(1, ("dp", "tp")),
            fs.psum(2.5, axis_name="dp"),
            fs.pmean(3.0, "dp"),
            fs.axis_size(axis_name="tp"),
            fs.axis_index(axis_name="dp").tolist(),
        )
        return {k: v.sum().reshape(1) for k, v in out.items()}, sizes

    outs, sizes = fs.shard_map(
        f, mesh=mesh, in_specs="(dp b) (tp d)", out_specs=("(dp tp r)", None), check=False
    )(X)
    return {k: v.full() for k, v in outs.items()}, sizes


def test_axis_name_and_psum_of_one():
    X = torch.arange(16.0).reshape(4, 4)
    results = run_ranks(4, _rank_spellings, X)
    blocks = {(i, j): X[2 * i : 2 * i + 2, 2 * j : 2 * j + 2] for i in range(2) for j in range(2)}
    for r, (outs, sizes) in enumerate(results):
        assert sizes[:5] == (2, 4, 5.0, 3.0, 2)
        assert sizes[5] == r // 2  # this rank's dp index
        for key, want in {
            "psum": [(blocks[i, 0] + blocks[i, 1]).sum() for i in range(2) for _ in range(2)],
            "pmean": [((blocks[0, j] + blocks[1, j]) / 2).sum() for _ in range(2) for j in range(2)],
            "pmax": [torch.maximum(blocks[i, 0], blocks[i, 1]).sum() for i in range(2) for _ in range(2)],
            "gather": [X[2 * i : 2 * i + 2].sum() for i in range(2) for _ in range(2)],
            "scatter": [(blocks[i, 0] + blocks[i, 1]).sum() for i in range(2) for _ in range(2)],
            "perm": [blocks[1 - i, j].sum() for i in range(2) for j in range(2)],
            "a2a": [(blocks[i, 0] + blocks[i, 1]).sum() for i in range(2) for _ in range(2)],
        }.items():
            got = outs[key]
            torch.testing.assert_close(got, torch.stack(want), msg=f"rank {r} {key}")


def _rank_spelling_errors(which):
    mesh = fs.Mesh(tp=2)

    def f(x):
        if which == "dim":
            return fs.all_gather(x, axis_name="tp", axis=0, tiled=True)
        return fs.psum(x, "tp", axis_name="tp")

    try:
        fs.shard_map(f, mesh=mesh, in_specs="(tp b)", out_specs="(tp b)", check=False)(torch.ones(4))
    except fs.ArgumentError as e:
        return str(e)
    return "no error"


def test_axis_name_mistakes():
    assert (
        run_ranks(2, _rank_spelling_errors, "dim")
        == [
            "fs.all_gather: axis=0 is a tensor dim in JAX's spelling; fshard calls it dim= and takes the "
            "mesh axis as axis_name= or the second argument: fs.all_gather(x, 'tp', dim=0)"
        ]
        * 2
    )
    assert (
        run_ranks(2, _rank_spelling_errors, "twice")
        == [
            "fs.psum: the mesh axis is given twice ('tp' and axis_name='tp'); give it once, as "
            "fs.psum(x, 'tp') or fs.psum(x, axis_name='tp')"
        ]
        * 2
    )
