"""Full text of the user-facing errors of shard_map, Sharded / fs.shard and Mesh.

Spec-parse errors are covered in test_spec.py. Every multi-rank case runs on all ranks of a 4-rank
world inside ``fs.count_collectives``: the error must be the same on every rank and come before any
communication (except fs.shard(src=...), whose other ranks learn the shape from one broadcast before
they can check it). Expected texts are written from the message templates in the sources.
"""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from fshard._errors import RankError
from tests.conftest import run_ranks

MESH = "Mesh(dp=2, tp=2)"


# --- per-shard functions with readable names (messages quote f's __qualname__) -----------------


def _ident(x):
    return x


def _two(x, y):
    return x


def _three(x, y, z):
    return x


def _kw(x, y=None):
    return x


def _first_of_dict(d):
    return d["w"]


def _returns_sharded(x):
    return fs.shard(torch.ones(4), fs.Mesh(dp=2, tp=2), "(dp b)")


# --- the cases: name -> (callable(mesh), exception type name, expected text) --------------------

ONES43 = (4, 3)


def _sm(f, mesh, in_specs, out_specs, *shapes):
    return fs.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(
        *(torch.ones(s) for s in shapes)
    )


def _head(name, n=1, what="in_specs"):
    return f"fs.shard_map({name}): {n} problem{'s' if n != 1 else ''} with {what}:\n"


_GROUP_HINT = "a group lists mesh axes first, then one dim label"

CASES = {
    "unknown_axis_did_you_mean": (
        lambda m: _sm(_ident, m, "(dq b) n", "(dp b) n", ONES43),
        "SpecError",
        _head("_ident")
        + f"  - args[0] (shape (4, 3)) with spec '(dq b) n': 'dq' in (dq b) is not an axis of "
        f"{MESH} (did you mean 'dp'?); {_GROUP_HINT}",
    ),
    "unknown_axis_no_hint": (
        lambda m: _sm(_ident, m, ("(zz b) n",), "(dp b) n", ONES43),
        "SpecError",
        _head("_ident")
        + f"  - args[0] (shape (4, 3)) with spec '(zz b) n': 'zz' in (zz b) is not an axis of "
        f"{MESH}; {_GROUP_HINT}",
    ),
    "unknown_axis_in_sum_out_spec": (
        lambda m: _sm(_ident, m, "(dp b) n", "(dp b) n | sum(tq)", ONES43),
        "SpecError",
        _head("_ident", what="out_specs") + "  - out_specs '(dp b) n | sum(tq)': "
        f"sum(tq) names 'tq', which is not an axis of {MESH} (did you mean 'tp'?)",
    ),
    "axis_twice_two_dims": (
        lambda m: _sm(_ident, m, "(dp b) (dp n)", "(dp b) n", (4, 4)),
        "SpecError",
        _head("_ident") + "  - args[0] (shape (4, 4)) with spec '(dp b) (dp n)': mesh axis 'dp' splits both "
        "dim 0 and dim 1; an axis can split one dim only",
    ),
    "axis_twice_one_group": (
        lambda m: _sm(_ident, m, "(dp dp b) n", "(dp b) n", (8, 3)),
        "SpecError",
        _head("_ident") + "  - args[0] (shape (8, 3)) with spec '(dp dp b) n': mesh axis 'dp' appears twice "
        "in (dp dp b)",
    ),
    "rank_mismatch": (
        lambda m: _sm(_ident, m, "(dp b) n", "(dp b) n", (4, 3, 2)),
        "SpecError",
        _head("_ident") + "  - args[0] (shape (4, 3, 2)) with spec '(dp b) n': the spec names 2 dims but the "
        "tensor has 3; write one name per dim, or '...' for unsplit dims",
    ),
    "rank_mismatch_one_dim": (
        lambda m: _sm(_ident, m, "(dp b)", "(dp b) n", ONES43),
        "SpecError",
        _head("_ident")
        + "  - args[0] (shape (4, 3)) with spec '(dp b)': the spec names 1 dim but the tensor "
        "has 2; write one name per dim, or '...' for unsplit dims",
    ),
    "rank_mismatch_ellipsis": (
        lambda m: _sm(_ident, m, "(dp b) ... n c", "(dp b) n", ONES43),
        "SpecError",
        _head("_ident") + "  - args[0] (shape (4, 3)) with spec '(dp b) ... n c': the spec names 3 dims "
        "besides '...' but the tensor has 2; remove dims from the spec",
    ),
    "rank_mismatch_output": (
        lambda m: _sm(_ident, m, "(dp b) n", "(dp b)", ONES43),
        "SpecError",
        _head("_ident", what="out_specs") + "  - out (local shape (2, 3)) with spec '(dp b)': the spec names "
        "1 dim but the tensor has 2; write one name per dim, or '...' for unsplit dims",
    ),
    "summed_axis_not_last_in_group": (
        lambda m: _sm(_ident, m, "(dp tp b) n", "(tp dp b) n | sum(tp)", (8, 3)),
        "SpecError",
        _head("_ident", what="out_specs") + "  - out_specs '(tp dp b) n | sum(tp)': dim 0 "
        "is split over ('tp', 'dp') and summed over ('tp',): the summed axes must come last in the group so "
        "that a reduce-scatter produces the block",
    ),
    "label_is_mesh_axis": (
        lambda m: _sm(_ident, m, "dp n", "(dp b) n", ONES43),
        "SpecError",
        _head("_ident")
        + f"  - args[0] (shape (4, 3)) with spec 'dp n': 'dp' is a mesh axis of {MESH}, so it "
        "cannot label dim 0: write (dp x) to split this dim over dp, or rename the dim",
    ),
    "label_sizes_differ": (
        lambda m: _sm(_two, m, ("(dp b) n", "(dp b) m"), "(dp b) n", ONES43, (6, 5)),
        "SpecError",
        _head("_two") + "  - dim 'b' has size 4 in args[0] but size 6 in args[1] (spec '(dp b) m', shape "
        "(6, 5)); a label names one logical dim, so its global size must agree everywhere; rename one of "
        "them, or write _ for a dim that should not tie",
    ),
    "partial_spec_on_input": (
        lambda m: _sm(_ident, m, "(dp b) n | sum(tp)", "(dp b) n", ONES43),
        "SpecError",
        _head("_ident")
        + "  - args[0] (shape (4, 3)) with spec '(dp b) n | sum(tp)': a partial-sum spec (| sum(...)) is "
        "only valid in out_specs; pass the reduced value instead",
    ),
    "several_problems": (
        lambda m: _sm(_three, m, ("(dq b) n", "(dp c) tp", "(tp c) m k"), "(dp b) n", ONES43, (5, 2), (4, 3)),
        "SpecError",
        _head("_three", 3)
        + f"  - args[0] (shape (4, 3)) with spec '(dq b) n': 'dq' in (dq b) is not an axis of {MESH} "
        f"(did you mean 'dp'?); {_GROUP_HINT}\n"
        f"  - args[1] (shape (5, 2)) with spec '(dp c) tp': 'tp' is a mesh axis of {MESH}, so it cannot "
        "label dim 1: write (tp x) to split this dim over tp, or rename the dim\n"
        "  - args[2] (shape (4, 3)) with spec '(tp c) m k': the spec names 3 dims but the tensor has 2; "
        "write one name per dim, or '...' for unsplit dims",
    ),
    "several_problems_one_spec": (
        lambda m: _sm(_ident, m, "(dp b) (dp n) tp", "(dp b) n", (4, 4, 2)),
        "SpecError",
        _head("_ident", 2)
        + "  - args[0] (shape (4, 4, 2)) with spec '(dp b) (dp n) tp': mesh axis 'dp' splits both dim 0 and "
        "dim 1; an axis can split one dim only\n"
        f"  - args[0] (shape (4, 4, 2)) with spec '(dp b) (dp n) tp': 'tp' is a mesh axis of {MESH}, so it "
        "cannot label dim 2: write (tp x) to split this dim over tp, or rename the dim",
    ),
    "bad_spec_type": (
        lambda m: _sm(_ident, m, (3,), "(dp b) n", ONES43),
        "SpecError",
        _head("_ident") + '  - args[0]: a spec must be a string like "(dp b) d", got int: 3',
    ),
    "bad_out_spec_type": (
        lambda m: _sm(_ident, m, "(dp b) n", 3.5, ONES43),
        "SpecError",
        _head("_ident", what="out_specs") + "  - out_specs: spec must be a string, got float: 3.5",
    ),
    "keyword_arguments": (
        lambda m: fs.shard_map(_kw, mesh=m, in_specs=("b", "b"), out_specs="b")(
            torch.ones(2), y=torch.ones(2)
        ),
        "ArgumentError",
        (
            "fs.shard_map(_kw) takes positional arguments only (in_specs matches them by position); got "
            "keyword arguments ['y']"
        ),
    ),
    "mesh_not_a_mesh": (
        lambda m: fs.shard_map(_ident, mesh={"dp": 2, "tp": 2}, in_specs="b", out_specs="b"),
        "ArgumentError",
        "fs.shard_map: mesh must be an fs.Mesh, got dict",
    ),
    "sharded_on_other_mesh": (
        lambda m: fs.shard_map(_ident, mesh=m, in_specs="(dp b) n", out_specs="(dp b) n")(
            fs.shard(torch.ones(4, 3), fs.Mesh(dp=4), "(dp b) n")
        ),
        "SpecError",
        _head("_ident") + "  - args[0] is a Sharded value on Mesh(dp=4), not on this shard_map's mesh "
        f"{MESH}; move it with fs.shard(value.full(), mesh, spec)",
    ),
    "f_returns_sharded": (
        lambda m: fs.shard_map(_returns_sharded, mesh=m, in_specs="b", out_specs="(dp b)")(torch.ones(2)),
        "SpecError",
        _head("_returns_sharded", what="out_specs")
        + "  - out: f returned a Sharded value; return local tensors from f",
    ),
    # Sharded / fs.shard
    "shard_unknown_axis": (
        lambda m: fs.shard(torch.ones(4, 3), m, "(dq b) n"),
        "SpecError",
        (
            f"fs.shard: spec '(dq b) n' for shape (4, 3) on {MESH}:\n  - 'dq' in (dq b) is not an axis of "
            f"{MESH} (did you mean 'dp'?); {_GROUP_HINT}"
        ),
    ),
    "shard_partial_spec": (
        lambda m: fs.shard(torch.ones(4, 3), m, "(dp b) n | sum(tp)"),
        "SpecError",
        (
            f"fs.shard: spec '(dp b) n | sum(tp)' for shape (4, 3) on {MESH}:\n  - a partial-sum spec (| "
            "sum(...)) describes a shard_map output, not a stored value"
        ),
    ),
    "shard_rank_mismatch_src": (
        lambda m: fs.shard(torch.ones(4, 3) if m.rank == 0 else None, m, "(dp b)", src=0),
        "SpecError",
        (
            f"fs.shard: spec '(dp b)' for shape (4, 3) on {MESH}:\n  - the spec names 1 dim but the tensor "
            "has 2; write one name per dim, or '...' for unsplit dims"
        ),
    ),
    "shard_not_a_tensor": (
        lambda m: fs.shard([1.0, 2.0], m, "b"),
        "ArgumentError",
        "fs.shard expects a torch.Tensor, got list",
    ),
    "sharded_constructor_bad_spec": (
        lambda m: fs.Sharded(torch.ones(2, 3), m, "(dp b)"),
        "SpecError",
        (
            f"fs.Sharded: spec '(dp b)' for local shape (2, 3) on {MESH}:\n  - the spec names 1 dim but the "
            "tensor has 2; write one name per dim, or '...' for unsplit dims"
        ),
    ),
    "sharded_constructor_not_tensor": (
        lambda m: fs.Sharded([1.0], m, "b"),
        "ArgumentError",
        "fs.Sharded needs a torch.Tensor local block, got list",
    ),
    # Mesh on a 4-rank world
    "mesh_smaller_than_world": (
        lambda m: fs.Mesh(dp=2),
        "MeshError",
        "Mesh(dp=2) has 2 ranks but the world has 4; choose axis sizes whose product is 4",
    ),
    "mesh_larger_than_world": (
        lambda m: fs.Mesh({"dp": 4, "tp": 2}),
        "MeshError",
        "Mesh(dp=4, tp=2) has 8 ranks but the world has 4; choose axis sizes whose product is 4",
    ),
}


# fs.shard(src=r): the other ranks learn the global shape from rank r's broadcast before they can check the
# spec against it; nothing else moves before any error.
COMM_BEFORE_ERROR = {"shard_rank_mismatch_src": [("broadcast", ("world",), 0)]}


def _rank_error(case):
    mesh = fs.Mesh(dp=2, tp=2)
    fs.Mesh(dp=4)  # build every mesh a case uses up front (making groups is not what we count)
    call = CASES[case][0]
    with fs.count_collectives() as c:
        try:
            call(mesh)
        except Exception as e:  # noqa: BLE001
            return type(e).__name__, str(e), c.records
    return "no error", "", c.records


@pytest.mark.parametrize("case", list(CASES))
def test_error_text(case):
    _, kind, text = CASES[case]
    results = run_ranks(4, _rank_error, case)
    assert [r[:2] for r in results] == [results[0][:2]] * 4, "ranks disagree"
    got_kind, got_text, _ = results[0]
    assert got_kind == kind
    assert got_text == text
    assert [r[2] for r in results] == [COMM_BEFORE_ERROR.get(case, [])] * 4, "communication before the error"


def test_error_classes():
    assert issubclass(fs.SpecError, fs.FshardError) and issubclass(fs.SpecError, ValueError)
    assert issubclass(fs.MeshError, fs.FshardError) and issubclass(fs.CollectiveError, fs.FshardError)
    assert issubclass(fs.FshardError, RuntimeError)
    # wrong argument types are FshardErrors that `except TypeError` still catches
    assert issubclass(fs.ArgumentError, fs.FshardError) and issubclass(fs.ArgumentError, TypeError)
    assert (
        issubclass(fs.CheckpointError, fs.FshardError) and fs.checkpoint.CheckpointError is fs.CheckpointError
    )


# --- pytree structure mismatches (the message says in words where specs and values part ways) --------


_IN_FIX = "fix: give one spec per positional argument (a tuple), or one spec for a whole subtree"
_OUT_FIX = "fix: give one spec per output, or one spec for a whole subtree"

STRUCTURE_CASES = {
    # name: (f, in_specs, out_specs, args, expected text)
    "too_few_in_specs": (
        _three,
        ("(dp b) n", "b"),
        "(dp b) n",
        (torch.ones(4, 3), 1, 2),
        (
            "fs.shard_map(_three): in_specs does not match the structure of the arguments: in_specs "
            f"has 2 entries but f got 3 positional arguments\n{_IN_FIX}"
        ),
    ),
    "dict_keys": (
        _first_of_dict,
        ({"v": "(dp b) n"},),
        "(dp b) n",
        ({"w": torch.ones(4, 3)},),
        (
            "fs.shard_map(_first_of_dict): in_specs does not match the structure of the arguments: "
            f"in_specs[0] has keys ['v'] but args[0] has keys ['w']\n{_IN_FIX}"
        ),
    ),
    "dict_spec_not_wrapped": (
        _first_of_dict,
        {"w": "(dp b) n"},
        "(dp b) n",
        ({"w": torch.ones(4, 3)},),
        (
            "fs.shard_map(_first_of_dict): in_specs does not match the structure of the arguments: "
            f"in_specs is a dict with keys ['w'] but args is a tuple of 1\n{_IN_FIX}"
        ),
    ),
    "out_specs_tuple_for_one_output": (
        _ident,
        "(dp b) n",
        ("(dp b) n", "b"),
        (torch.ones(4, 3),),
        # f's output is the local (2, 3) block
        (
            "fs.shard_map(_ident): out_specs does not match the structure of the outputs: out_specs is a "
            f"tuple of 2 but out is a Tensor of shape (2, 3)\n{_OUT_FIX}"
        ),
    ),
}


def _rank_structure(case):
    f, in_specs, out_specs, args, _ = STRUCTURE_CASES[case]
    mesh = fs.Mesh(dp=2, tp=2)
    with fs.count_collectives() as c:
        try:
            fs.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)
        except Exception as e:  # noqa: BLE001
            return type(e).__name__, str(e), c.total
    return "no error", "", c.total


@pytest.mark.parametrize("case", list(STRUCTURE_CASES))
def test_structure_mismatch(case):
    expected = STRUCTURE_CASES[case][-1]
    results = run_ranks(4, _rank_structure, case)
    for kind, text, total in results:
        assert kind == "SpecError"
        assert text == expected
        assert total == 0


# --- Mesh in a single process without torch.distributed ------------------------------------------


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda: fs.Mesh(dp=2, tp=2),
            (
                "Mesh(dp=2, tp=2) needs 4 ranks but torch.distributed is not initialized; call fs.init() in "
                "a script started with `python -m fshard.run -n 4 script.py` (or torchrun --nproc-per-node "
                "4), or run the function with fs.launch(fn, nprocs=4)"
            ),
        ),
        (
            lambda: fs.Mesh({"x": 3}),
            (
                "Mesh(x=3) needs 3 ranks but torch.distributed is not initialized; call fs.init() in a "
                "script started with `python -m fshard.run -n 3 script.py` (or torchrun --nproc-per-node "
                "3), or run the function with fs.launch(fn, nprocs=3)"
            ),
        ),
        (lambda: fs.Mesh({"dp": 2}, tp=2), "give the mesh shape either as a dict or as keywords, not both"),
        (lambda: fs.Mesh(), "a mesh needs at least one axis, for example fs.Mesh(dp=2)"),
        (lambda: fs.Mesh({}), "a mesh needs at least one axis, for example fs.Mesh(dp=2)"),
        (
            lambda: fs.Mesh({"1x": 1}),
            (
                "mesh axis name '1x' cannot appear in a spec: use a Python identifier that is not a keyword "
                "and does not start or end with '_'"
            ),
        ),
        (
            lambda: fs.Mesh({3: 1}),
            (
                "mesh axis name 3 cannot appear in a spec: use a Python identifier that is not a keyword and "
                "does not start or end with '_'"
            ),
        ),
        (lambda: fs.Mesh(dp=0), "mesh axis 'dp' has size 0; sizes must be positive integers"),
        (lambda: fs.Mesh(dp=True), "mesh axis 'dp' has size True; sizes must be positive integers"),
        (lambda: fs.Mesh(dp=2.0), "mesh axis 'dp' has size 2.0; sizes must be positive integers"),
        (
            lambda: fs.Mesh(dp=1).device_mesh,
            (
                "this 1-rank mesh was built without torch.distributed; call fs.init() before fs.Mesh(...) "
                "to get a DeviceMesh"
            ),
        ),
    ],
    ids=[
        "2x2",
        "3",
        "dict_and_keywords",
        "no_axes",
        "empty_dict",
        "bad_name",
        "non_str_name",
        "size_0",
        "size_bool",
        "size_float",
        "device_mesh",
    ],
)
def test_mesh_errors_single_process(make, expected):
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(fs.MeshError) as err:
        make()
    assert str(err.value) == expected


def test_single_process_shard_map_errors_match():
    # a 1-rank mesh without torch.distributed reports the same texts as a multi-rank world
    mesh = fs.Mesh(dp=1)
    with pytest.raises(fs.SpecError) as err:
        fs.shard_map(_ident, mesh=mesh, in_specs="(dq b) n", out_specs="(dp b) n")(torch.ones(4, 3))
    assert str(err.value) == (
        _head("_ident") + "  - args[0] (shape (4, 3)) with spec '(dq b) n': 'dq' in (dq b) is not an axis of "
        f"Mesh(dp=1) (did you mean 'dp'?); {_GROUP_HINT}"
    )
    with pytest.raises(fs.CollectiveError) as err:
        fs.shard_map(lambda x: fs.psum(x, "dpp"), mesh=mesh, in_specs="b", out_specs="b")(torch.ones(2))
    assert str(err.value) == "fs.psum: 'dpp' is not an axis of Mesh(dp=1) (did you mean 'dp'?)"


def test_shard_map_specs_cannot_be_reassigned():
    # its plans are cached (and compiled into graphs): a reassigned spec would go unseen
    mapped = fs.shard_map(_ident, mesh=fs.Mesh(dp=1), in_specs="(dp b) n", out_specs="(dp b) n")
    x = torch.arange(12.0).reshape(4, 3)
    assert torch.equal(mapped(x).full(), x)
    for name in ("in_specs", "out_specs", "check", "f"):
        with pytest.raises(AttributeError) as err:
            setattr(mapped, name, "b n")
        assert str(err.value) == (
            f"fs.shard_map(_ident): {name} cannot be reassigned (the plans made from it are cached, and "
            "compiled into graphs); make a new fs.shard_map(f, mesh=..., in_specs=..., out_specs=...) instead"
        )
    assert mapped.in_specs == "(dp b) n"
    assert torch.equal(mapped(x).full(), x)


# --- fs.shard(src=r) with no tensor on rank r ------------------------------------------------------


def _rank_shard_src_missing():
    mesh = fs.Mesh(dp=2)
    fs.shard(None, mesh, "(dp b)", src=0)  # rank 0 is the source but passes None
    return "no error"


def test_shard_src_missing_tensor_raises_on_every_rank():
    # The mistake is detectable on rank 0 only; the other ranks must not be left waiting for rank 0 in a
    # collective: every rank should raise the same error (the pool reports each rank's exception).
    with pytest.raises(RankError) as err:
        run_ranks(2, _rank_shard_src_missing, timeout=30)
    text = str(err.value)
    msg = "raised fshard.ArgumentError: fs.shard(src=0) needs a tensor on rank 0, got NoneType"
    # whichever rank's report arrives first is named first; both must have raised
    first, other = (0, 1) if f"rank 0 (of 2) {msg}" in text else (1, 0)
    assert f"rank {first} (of 2) {msg}" in text, text.splitlines()[:3]
    assert f"also: rank {other} raised fshard.ArgumentError" in text, text.splitlines()[:3]
