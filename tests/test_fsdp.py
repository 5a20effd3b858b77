"""``fs.fsdp_scan``: FSDP layers gathered one at a time, prefetched, freed after use.

Layers whose parameters are stored split over dp (along different dims, one leaf replicated,
one of another dtype) are run with ``fs.fsdp_scan`` inside ``fs.shard_map`` on 2 and 4 gloo
ranks and on a dp x tp mesh; the loss and every parameter gradient are compared with plain
torch on the global tensors in one process. The collectives are counted (per layer and dtype:
one all-gather in the forward, one in the backward, one reduce-scatter), the prefetch is seen
in the number of all-gathers issued when each layer starts, and weak references show that no
gathered parameter outlives its layer's forward.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, randn

L, B, D, FF = 3, 8, 8, 12
SPECS = {"w": "(dp d) f", "u": "f (dp d)", "b": "(dp f)", "s": "d", "g": "(dp d)"}
DIMS = {"w": 0, "u": 1, "b": 0, "s": None, "g": 0}
AG, RS, AR = ("all_gather", ("dp",)), ("reduce_scatter", ("dp",)), ("all_reduce", ("dp",))


def _params():
    """L layers of global parameters: float64, except g (float32)."""
    out = []
    for i in range(L):
        k = 10 * i
        out.append(
            {
                "w": randn(k, D, FF, dtype=torch.float64) * 0.4,
                "u": randn(k + 1, FF, D, dtype=torch.float64) * 0.4,
                "b": randn(k + 2, FF, dtype=torch.float64) * 0.1,
                "s": 1 + randn(k + 3, D, dtype=torch.float64) * 0.1,
                "g": randn(k + 4, D, dtype=torch.float32) * 0.1,
            }
        )
    return out


def _layer(p, h):
    z = torch.tanh(h @ p["w"] + p["b"])
    side = (h @ p["u"].T).sum(-1, keepdim=True) * 0.1  # a view of a gathered leaf, saved
    return h + (z @ p["u"]) * p["s"] + p["g"].double() + side


def _reference(ps, x):
    ref = [{k: v.detach().clone().requires_grad_(True) for k, v in p.items()} for p in ps]
    h = x
    for p in ref:
        h = _layer(p, h)
    loss = h.pow(2).mean()
    loss.backward()
    return loss.detach(), [{k: v.grad for k, v in p.items()} for p in ref]


def _rank_scan(n, form, dims_kind, prefetch, ps, x):
    mesh = fs.Mesh(dp=n)
    if form == "list":
        params = [{k: fs.shard(v, mesh, SPECS[k]).requires_grad_(True) for k, v in p.items()} for p in ps]
        specs = [dict(SPECS) for _ in ps]
        dims = specs if dims_kind == "specs" else DIMS
    else:  # stacked: one tensor per leaf with a leading layer dim
        specs = {k: f"l {s}" for k, s in SPECS.items()}
        params = {
            k: fs.shard(torch.stack([p[k] for p in ps]), mesh, specs[k]).requires_grad_(True) for k in SPECS
        }
        dims = specs if dims_kind == "specs" else DIMS
    starts, refs = [], []

    def layer(p, h):
        starts.append(fwd.by_kind()[AG])  # all-gathers issued when this layer starts
        assert all(r() is None for r in refs), "a gathered leaf of an earlier layer is alive"
        refs.extend(weakref.ref(p[k]) for k in ("w", "u", "b", "g"))
        return _layer(p, h)

    def f(params, x):
        h = fs.fsdp_scan(layer, params, x, "dp", dims=dims, prefetch=prefetch)
        return fs.pmean(h.pow(2).mean(), "dp")

    step = fs.shard_map(f, mesh=mesh, in_specs=(specs, "(dp b) d"), out_specs="")
    with fs.count_collectives() as fwd:
        loss = step(params, x)
    alive = sum(r() is not None for r in refs)
    with fs.count_collectives() as bwd:
        loss.backward()
    errs: list[str] = []
    want_loss, want_grads = _reference(ps, x)
    close(errs, "loss", loss, want_loss, torch.float64)
    for i in range(L):
        for k in SPECS:
            got = params[i][k].grad.full() if form == "list" else params[k].grad.full()[i]
            dtype = torch.float32 if k == "g" else torch.float64
            close(errs, f"grad of layer {i} {k}", got, want_grads[i][k], dtype)
    if alive:
        errs.append(f"{alive} gathered leaves alive after the forward")
    # per layer: one all-gather per dtype (float64, float32) in the forward and again in the
    # backward, one reduce-scatter per dtype; the loss's pmean; one bucket for the replicated s
    want_fwd = {AG: 2 * L, AR: 1}
    want_bwd = {AG: 2 * L, RS: 2 * L, AR: 1}
    if dict(fwd.by_kind()) != want_fwd:
        errs.append(f"forward collectives {dict(fwd.by_kind())}, want {want_fwd}")
    if dict(bwd.by_kind()) != want_bwd:
        errs.append(f"backward collectives {dict(bwd.by_kind())}, want {want_bwd}")
    ahead = 1 if prefetch else 0
    want_starts = [2 * min(i + 1 + ahead, L) for i in range(L)]
    if starts != want_starts:
        errs.append(f"all-gathers issued when each layer starts: {starts}, want {want_starts}")
    return errs


@pytest.mark.parametrize(
    "n, form, dims_kind, prefetch",
    [
        (2, "list", "specs", True),
        (4, "list", "ints", True),
        (4, "stacked", "specs", True),
        (2, "stacked", "ints", False),
    ],
)
def test_fsdp_scan_matches_one_process(n, form, dims_kind, prefetch):
    ps = _params()
    x = randn(99, B, D, dtype=torch.float64)
    assert_ok(run_ranks(n, _rank_scan, n, form, dims_kind, prefetch, ps, x))


# -- fsdp x tp: Megatron MLP layers whose parameters are also split over dp ----------------

TP_SPECS = {"w1": "(dp d) (tp f)", "b1": "(tp f)", "w2": "(tp f) (dp d)", "b2": "(dp d)"}


def _tp_params():
    return [
        {
            "w1": randn(50 + i, D, FF, dtype=torch.float64) * 0.4,
            "b1": randn(60 + i, FF, dtype=torch.float64) * 0.1,
            "w2": randn(70 + i, FF, D, dtype=torch.float64) * 0.4,
            "b2": randn(80 + i, D, dtype=torch.float64) * 0.1,
        }
        for i in range(L)
    ]


def _tp_layer(p, h, psum=lambda t: fs.psum(t, "tp")):
    return h + psum(F.gelu(h @ p["w1"] + p["b1"]) @ p["w2"]) + p["b2"]


def _rank_fsdp_tp(ps, x):
    mesh = fs.Mesh(dp=2, tp=2)
    params = [{k: fs.shard(v, mesh, TP_SPECS[k]).requires_grad_(True) for k, v in p.items()} for p in ps]
    specs = [dict(TP_SPECS) for _ in ps]

    def f(params, x):
        h = fs.fsdp_scan(_tp_layer, params, x, "dp", dims=specs)
        return fs.pmean(h.pow(2).mean(), "dp")

    step = fs.shard_map(f, mesh=mesh, in_specs=(specs, "(dp b) d"), out_specs="")
    with fs.count_collectives() as fwd:
        loss = step(params, x)
    with fs.count_collectives() as bwd:
        loss.backward()
    ref = [{k: v.detach().clone().requires_grad_(True) for k, v in p.items()} for p in ps]
    h = x
    for p in ref:
        h = _tp_layer(p, h, psum=lambda t: t)
    want = h.pow(2).mean()
    want.backward()
    errs: list[str] = []
    close(errs, "loss", loss, want, torch.float64)
    for i in range(L):
        for k in TP_SPECS:
            close(errs, f"grad of layer {i} {k}", params[i][k].grad.full(), ref[i][k].grad, torch.float64)
    # w1, w2 and b2 are split over dp (b1 is not: it is used as stored): one gather per layer
    # in the forward and one in the backward, one reduce-scatter per layer
    got = (fwd.by_kind()[AG], bwd.by_kind()[AG], bwd.by_kind()[RS])
    if got != (L, L, L):
        errs.append(f"dp all-gathers forward, backward and reduce-scatters {got}, want {(L, L, L)}")
    return errs


def test_fsdp_scan_dp_x_tp_matches_one_process():
    x = randn(98, B, D, dtype=torch.float64)
    assert_ok(run_ranks(4, _rank_fsdp_tp, _tp_params(), x))


# -- errors ---------------------------------------------------------------------------------


def _ones(*shape):
    return torch.ones(*shape, dtype=torch.float64)


ERRORS = {
    "axis_not_innermost": (
        lambda: ([{"w": _ones(2, 3)}], {"w": "(dp tp d) f"}),
        "fs.fsdp_scan: layers[0]['w'] is stored with spec '(dp tp d) f': dp must be the innermost "
        "mesh axis of dim '(dp tp d)' (after tp) so that gathering it gives a contiguous block; "
        "store it as '(tp dp d)'",
    ),
    "two_dims": (
        lambda: ([{"w": _ones(2, 3)}], {"w": "(dp a) (dp b)"}),
        "fs.fsdp_scan: layers[0]['w'] is stored with spec '(dp a) (dp b)', which splits 2 dims "
        "over dp; split one dim over it",
    ),
    "dim_out_of_range": (
        lambda: ([{"w": _ones(2, 3)}], {"w": 2}),
        "fs.fsdp_scan: dims gives 2 for layers[0]['w'] of shape (2, 3); give a dim in [-2, 2), "
        "None (not split) or the leaf's spec string",
    ),
    "dims_structure": (
        lambda: ([{"w": _ones(2, 3)}], {"v": 0}),
        "fs.fsdp_scan: dims={'v': 0} is not a prefix of the structure of layers[0] (leaves "
        "layers[0]['w']); give an int, or a pytree shaped like one layer (or like layers) of "
        "ints, None or spec strings",
    ),
    "stacked_lengths": (
        lambda: ({"w": _ones(3, 2, 3), "b": _ones(2, 3)}, 0),
        "fs.fsdp_scan: the leaves of stacked layers must have the same leading (layer) dim, got "
        "layers['b']: 2, layers['w']: 3; stack every leaf with one entry per layer",
    ),
    "stacked_scalar": (
        lambda: ({"w": _ones(3, 2), "s": _ones(())}, 0),
        "fs.fsdp_scan: layers is one pytree, so each leaf stacks the layers along dim 0, but "
        "layers['s'] is a () tensor; pass a tensor with a leading layer dim, or a list of "
        "per-layer pytrees",
    ),
    "stacked_layer_dim_split": (
        lambda: ({"w": _ones(2, 2, 3)}, {"w": "(dp l) d f"}),
        "fs.fsdp_scan: layers['w'] is stored with spec '(dp l) d f', whose first dim (the layer "
        "dim of stacked layers) is split over dp; split another dim, e.g. 'l d f'",
    ),
}


def _rank_errors():
    mesh = fs.Mesh(dp=2, tp=2)
    out = {}
    for name, (make, _) in ERRORS.items():
        layers, dims = make()

        def f(x, layers=layers, dims=dims, name=name):
            try:
                fs.fsdp_scan(lambda p, h: h, layers, x, "dp", dims=dims)
            except fs.ArgumentError as e:
                out[name] = str(e)
            return x

        with fs.count_collectives() as counts:
            fs.shard_map(f, mesh=mesh, in_specs="b", out_specs="b")(_ones(4))
        if counts.total:
            out[name + " (collectives)"] = str(counts)
    return out


def test_fsdp_scan_errors():
    for rank, got in enumerate(run_ranks(4, _rank_errors)):
        for name, (_, want) in ERRORS.items():
            assert got.get(name) == want, f"rank {rank} {name}: {got.get(name)!r}"
        assert not [k for k in got if k.endswith("(collectives)")], got


def test_fsdp_scan_outside_shard_map():
    with pytest.raises(fs.CollectiveError) as e:
        fs.fsdp_scan(lambda p, h: h, [{"w": _ones(2)}], _ones(2), "dp")
    assert str(e.value) == (
        "fs.fsdp_scan can only be called inside a function run by fs.shard_map, where mesh axes "
        "have names; wrap the calling function with fs.shard_map(f, mesh=..., in_specs=..., "
        "out_specs=...)"
    )
