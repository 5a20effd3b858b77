"""The pytree ``fs.all_gather`` of uneven blocks accepts what gathering its leaves one at a time
accepts, with the same values and gradients, on real gloo ranks.

A dict of parameters cut unevenly (torch.chunk's blocks: 3 and 2 rows, 1, 1, 1 and 0, a
dim-1 split, an even leaf, two dtypes) gathered as one pytree (one all-gather per dtype, after one
small all-gather of every leaf's shape) and leaf by leaf, varying and ``invariant=True``, on
1- and 2-axis meshes of 2 and 4 ranks, combining on and off: the loss and the gradients of
every leaf against the same computation in one process. Blocks that differ other than along the
gathered dim raise the same CollectiveError in both forms (the pytree form naming the leaf).
"""

from __future__ import annotations

import optree
import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, env_vars, randn

F64 = torch.float64
DIMS = {"w": 0, "b": 0, "e": 0, "h": 1}


def _params():
    return {
        "w": randn(1, 5, 3, dtype=F64),  # 5 rows: 3, 2 over two ranks; 2, 2, 1, 0 over four
        "b": randn(2, 3, dtype=F64),  # 3: 2, 1; 1, 1, 1, 0
        "e": randn(3, 8, 2, dtype=F64),  # even
        "h": randn(4, 2, 7, dtype=torch.float32),  # 7 columns: 4, 3; 2, 2, 2, 1 (another dtype)
    }


def _specs(axes):
    group = " ".join(axes)
    return {"w": f"({group} a) c", "b": f"({group} d)", "e": f"({group} e) f", "h": f"g ({group} h)"}


def _use(p):
    """A loss that uses every element of every gathered leaf, in its position."""
    w, b, e, h = p["w"], p["b"], p["e"], p["h"].double()
    pos = torch.arange(1, w.shape[0] + 1, dtype=F64)[:, None]
    return (
        (torch.tanh(w * pos) ** 2).sum()
        + (b.cumsum(0) ** 2).sum()
        + (e @ e.T).sum()
        + (h.cumsum(1) ** 3).sum()
    )


def _rank_tree_vs_leaves(mesh_shape, axes, combine):
    mesh = fs.Mesh(**mesh_shape)
    errs: list[str] = []
    P = _params()
    ref = {k: v.clone().requires_grad_(True) for k, v in P.items()}
    want = _use(ref)
    want.backward()
    specs = _specs(axes)
    counts = {}
    for invariant in (False, True):
        for form in ("tree", "leaves"):
            where = f"{form}, invariant={invariant}, FSHARD_COMBINE={combine}"

            def f(p, form=form, invariant=invariant):
                with fs.count_collectives() as c:  # the gathers alone
                    if form == "tree":
                        g = fs.all_gather(p, axes, dim=DIMS, tiled=True, invariant=invariant)
                    else:
                        g = {
                            k: fs.all_gather(v, axes, dim=DIMS[k], tiled=True, invariant=invariant)
                            for k, v in p.items()
                        }
                    g = {k: v * 1 for k, v in g.items()}  # (combined gathers run at their first use)
                counts[form, invariant] = dict(c.by_kind())
                return _use(g) if invariant else fs.pmean(_use(g), axes)

            step = fs.shard_map(f, mesh=mesh, in_specs=(specs,), out_specs="")
            p = {k: v.clone().requires_grad_(True) for k, v in P.items()}
            with env_vars(FSHARD_COMBINE=combine):
                loss = step(p)
                loss.backward()
            close(errs, f"{where}: loss", loss, want, F64)
            for k in P:
                close(errs, f"{where}: grad {k}", p[k].grad, ref[k].grad, P[k].dtype)
    ag = ("all_gather", tuple(axes))
    for invariant in (False, True):
        # the pytree form: one all-gather of every leaf's shape, one all-gather per dtype
        if counts["tree", invariant].get(ag) != 3:
            errs.append(
                f"tree, invariant={invariant}: collectives {counts['tree', invariant]}, want 3 all-gathers"
            )
        if counts["leaves", invariant].get(ag) != 8:  # per leaf: its shape, then its blocks
            errs.append(f"leaves, invariant={invariant}: collectives {counts['leaves', invariant]}")
    return errs


@pytest.mark.parametrize(
    ("world", "mesh_shape", "axes"),
    [
        (2, {"dp": 2}, ("dp",)),
        (4, {"dp": 4}, ("dp",)),
        (4, {"dp": 2, "tp": 2}, ("dp", "tp")),
        (4, {"dp": 2, "tp": 2}, ("tp",)),  # over one axis of two: the other replicates
    ],
    ids=["dp2", "dp4", "dp2xtp2", "tp-of-dp2xtp2"],
)
@pytest.mark.parametrize("combine", ["1", "0"])
@pytest.mark.timeout(300)  # several calls and backwards per rank, on a loaded machine
def test_tree_gather_of_uneven_blocks_as_per_leaf(world, mesh_shape, axes, combine):
    assert_ok(run_ranks(world, _rank_tree_vs_leaves, mesh_shape, axes, combine, timeout=240))


def _rank_tree_errors():
    mesh = fs.Mesh(dp=4)
    P = {k: v for k, v in _params().items() if k in ("w", "e")}  # one leaf that cannot be stacked
    out = []
    for form in ("tree", "leaves"):

        def f(p, form=form):  # untiled: stacking blocks of different lengths is no gather
            if form == "tree":
                g = fs.all_gather(p, "dp", dim=0, tiled=False, invariant=True)
            else:
                g = {k: fs.all_gather(v, "dp", dim=0, tiled=False, invariant=True) for k, v in p.items()}
            return optree.tree_map(lambda t: t.sum(), g)

        try:
            specs = {k: v for k, v in _specs(("dp",)).items() if k in P}
            fs.shard_map(f, mesh=mesh, in_specs=(specs,), out_specs="")(P)
            out.append("no error")
        except fs.CollectiveError as e:
            out.append(str(e))
    return out


@pytest.mark.timeout(300)  # several calls and backwards per rank, on a loaded machine
def test_tree_gather_errors_as_per_leaf():
    tail = (
        "has a different shape on different ranks of dp (index 0: (2, 3); index 1: (2, 3); index 2: (1, 3); "
        "index 3: (0, 3)), because an input of this call is split unevenly (torch.chunk's blocks); "
        "fs.all_gather needs the same shape on every rank. Pad the blocks to the largest "
        "(torch.nn.functional.pad) or reduce them to a shape that agrees (e.g. x.sum(0)) first; "
        "fs.all_gather(x, axis, dim, tiled=True) (of a tensor or a pytree) accepts blocks that differ along dim"
    )
    got = run_ranks(4, _rank_tree_errors, timeout=240)
    assert (
        got
        == [
            [
                f"fs.all_gather over dp: the operand at x['w'] {tail}",
                f"fs.all_gather over dp: the operand {tail}",
            ]
        ]
        * 4
    )
