"""What stays the same on every rank after a Python branch on a varying value.

A branch on a value that varies over ``dp`` taints the call (`fshard._scalars.taint`): the ranks
may run different code from there on. Made after the branch (and after any later one):

- the result of a collective over ``dp`` (``fs.psum``, ``fs.pmean``, ``fs.pmax``, ``fs.all_gather``
  to an invariant result) is the same on every rank of ``dp``: a replicated out_spec accepts it;
- a local op on such a result is not (the ranks may have applied different ones): refused with the
  replication check's message, which names the branch;
- ``fs.value_and_grad``'s value (``f``'s own reduced result) and the gradients of parameters
  replicated over ``dp`` (each its bucket's all-reduce over ``dp``, DDP's sum of the ranks' own
  gradients), and an ``fs.optim`` update computed from them, are accepted;
- ranks that return *different* collective results (``psum(a)`` on some, ``psum(b)`` on others)
  are caught at run time: the ranks compare digests of what they return, and every rank raises.

Every value and gradient is compared with plain torch on the global tensors in one process, where
each data-parallel block takes the branch its rank takes; on 2 and 4 ranks, 1- and 2-axis meshes.
"""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import assert_ok, close, full

F64 = torch.float64
LR = 0.1
MESHES = [(2, {"dp": 2}), (4, {"dp": 4}), (4, {"dp": 2, "tp": 2})]
MESH_IDS = ["dp2", "dp4", "dp2xtp2"]


def _data(dp: int):
    """x: 2 rows per dp block, one block per rank with x.sum() <= 0 (its rank takes the other branch)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * dp, 3, generator=g, dtype=F64)
    x[:2] = -x[:2].abs()  # block 0: negative sum
    x[2:4] = x[2:4].abs()  # block 1: positive sum
    w = torch.randn(3, 4, generator=g, dtype=F64) / 2
    return x, w


def _block_loss(x, w):
    """The model: a Python branch on the block's data (varying over dp), then a loss term."""
    if x.sum() > 0:
        h = x @ w
    else:
        h = (x @ w) * 0.5
    return (h * h).sum()


def _reference(x, w, dp: int):
    """Per dp block as its rank computes it: the terms, in block order."""
    return torch.stack([_block_loss(xb, w) for xb in x.chunk(dp)])


def _specs(shape: dict):
    w_spec = "d (tp e)" if "tp" in shape else "d e"
    return ("(dp b) d", w_spec), w_spec


def _local_loss(x, w, shape):
    term = _block_loss(x, w)
    return fs.psum(term, "tp") if "tp" in shape else term  # columns of w split over tp


# =============================================================================================
# (a) a collective's result after the branch is replicated; (b) a local op on it is not


def _rank_collective(shape, route):
    dp = shape["dp"]
    x, w = _data(dp)
    in_specs, _ = _specs(shape)
    axes = tuple(shape)

    def f(x, w):
        term = _local_loss(x, w, shape)
        if route == "psum":
            return fs.psum(term, "dp")
        if route == "pmean":
            return fs.pmean(term, "dp")
        if route == "psum_all_axes":  # over every axis at once (tp: the partial sums too)
            return fs.psum(_block_loss(x, w), axes)
        if route == "pmax":
            return fs.pmax(term, "dp")
        if route == "all_gather":
            return fs.all_gather(term.reshape(1), "dp", dim=0, tiled=True, invariant=True)
        if route == "local_op":
            return fs.psum(term, "dp") * 2  # made after the branch: the ranks may differ
        if route == "later_branch":
            s = fs.psum(term, "dp")
            if x.sum() > 0:  # a later branch may choose between values made before it
                pass
            return s
        raise AssertionError(route)

    out_spec = "..." if route == "all_gather" else ""
    try:
        return fs.shard_map(f, mesh=fs.Mesh(**shape), in_specs=in_specs, out_specs=out_spec)(x, w)
    except fs.SpecError as e:
        return str(e)


_NOTE = (
    "f branched on a value that varies across ranks (bool() (a Python if, while, and/or or assert) of a "
    "value that varies over mesh axis 'dp', at test_branch_collectives.py:{line}), so the ranks may have run "
    "different code from there on: every value made after it (and any value it may have chosen) counts as "
    "varying over those axes; reduce the output after the branch (the result of fs.psum / fs.pmean / "
    "fs.all_gather(..., invariant=True) over them is the same on every rank), or select with "
    "torch.where(cond, a, b) instead of the branch"
)


def _message(name: str, line: int) -> str:
    return (
        f"fs.shard_map({name}): 1 problem with out_specs (replication check):\n"
        "  - out varies over mesh axis dp but out_spec '' says it is replicated over dp; reduce it inside f "
        "(fs.psum / fs.pmean over 'dp'), mark it as a partial sum with '| sum(dp)', split a dim over dp in "
        "the out_spec, or pass check=False if you know it is the same on every rank\n"
        + _NOTE.format(line=line)
    )


_LINE_BRANCH = _block_loss.__code__.co_firstlineno + 2


@pytest.mark.parametrize("n,shape", MESHES, ids=MESH_IDS)
@pytest.mark.parametrize("route", ["psum", "pmean", "psum_all_axes", "pmax", "all_gather"])
def test_a_collective_after_the_branch_is_replicated(n, shape, route):
    x, w = _data(shape["dp"])
    terms = _reference(x, w, shape["dp"])
    want = {
        "psum": terms.sum(),
        "pmean": terms.mean(),
        "psum_all_axes": terms.sum(),
        "pmax": terms.max(),
        "all_gather": terms,
    }[route]
    for r, got in enumerate(run_ranks(n, _rank_collective, shape, route)):
        assert not isinstance(got, str), f"rank {r}: {got}"
        torch.testing.assert_close(got, want, msg=f"rank {r}")


@pytest.mark.parametrize("n,shape", MESHES, ids=MESH_IDS)
@pytest.mark.parametrize("route", ["local_op", "later_branch"])
def test_a_local_op_after_the_branch_is_refused(n, shape, route):
    # later_branch: a psum made after the first branch, returned after a second one (over the
    # same axis, so the note names the first)
    want = _message("_rank_collective.<locals>.f", _LINE_BRANCH)
    assert run_ranks(n, _rank_collective, shape, route) == [want] * n


# =============================================================================================
# ranks that return different collective results: every rank raises


def _rank_chosen(shape):
    x, w = _data(shape["dp"])
    in_specs, _ = _specs(shape)

    def both(a, b):  # one call site for the two psums, so that the desync tags agree
        return fs.psum(a, "dp"), fs.psum(b, "dp")

    def f(x, w):
        term = _local_loss(x, w, shape)
        if x.sum() > 0:
            return both(term, term * 10)[0]
        return both(term, term * 10)[1]  # the same collectives, the other result

    try:
        fs.shard_map(f, mesh=fs.Mesh(**shape), in_specs=in_specs, out_specs="")(x, w)
        return "no error"
    except fs.SpecError as e:
        return str(e)


@pytest.mark.parametrize("n,shape", MESHES, ids=MESH_IDS)
def test_different_collective_results_are_caught(n, shape):
    got = run_ranks(n, _rank_chosen, shape)
    assert len(set(got)) == 1, got  # every rank raises the same error
    # the first group of dp (blocks 0 and 1 take different branches)
    ranks = ", ".join(map(str, _dp_group_ranks(shape)))
    assert got[0] == (
        "fs.shard_map(_rank_chosen.<locals>.f): 1 problem with out_specs (replication check):\n"
        f"  - out differs between ranks {ranks} (a group of mesh axis dp), which its out_spec replicates over "
        "dp: each rank returned the result of a collective over dp (or of fs.value_and_grad or an fs.optim "
        "update) made after the branch, the same on every rank, but not the same one (the ranks took their "
        "own paths: psum(a) on some, psum(b) on others); return one reduction made after the last branch, on "
        "every rank alike\n" + _NOTE.format(line=_LINE_BRANCH)
    )


def _rank_one_fails(shape):
    x, w = _data(shape["dp"])
    in_specs, _ = _specs(shape)

    def ps(t):  # one call site for both paths' psums, so that the desync tags agree
        return fs.psum(t, "dp")

    def f(x, w):
        if x.sum() > 0:
            return ps(_local_loss(x, w, shape))
        return ps(_local_loss(x, w, shape)) * 2  # a local op: this rank's check fails

    try:
        fs.shard_map(f, mesh=fs.Mesh(**shape), in_specs=in_specs, out_specs="")(x, w)
        return "no error"
    except fs.SpecError as e:
        return str(e)


_LINE_ONE = _rank_one_fails.__code__.co_firstlineno + 8


@pytest.mark.parametrize("n,shape", MESHES, ids=MESH_IDS)
def test_a_check_that_fails_on_some_ranks_fails_on_all(n, shape):
    dp, tp = shape["dp"], shape.get("tp", 1)
    x, _ = _data(dp)
    bad = [d for d, xb in enumerate(x.chunk(dp)) if not xb.sum() > 0]  # the blocks whose ranks fail
    failing = [d * tp + t for d in bad for t in range(tp)]
    word = "rank" if len(failing) == 1 else "ranks"
    note = _NOTE.format(line=_LINE_ONE)
    head = "fs.shard_map(_rank_one_fails.<locals>.f): 1 problem with out_specs (replication check):\n"
    own = (
        "  - out varies over mesh axis dp but out_spec '' says it is replicated over dp; reduce it inside f "
        "(fs.psum / fs.pmean over 'dp'), mark it as a partial sum with '| sum(dp)', split a dim over dp in "
        "the out_spec, or pass check=False if you know it is the same on every rank\n"
    )
    elsewhere = (
        f"  - the outputs of {word} {', '.join(map(str, failing))} failed this check (the error there names "
        "them), this rank's passed: the ranks took their own paths after the branch\n"
    )
    want = [head + (own if r in failing else elsewhere) + note for r in range(n)]
    assert run_ranks(n, _rank_one_fails, shape) == want


def _dp_group_ranks(shape) -> list[int]:
    """The global ranks of the first group of dp (tp index 0), row-major dp x tp."""
    tp = shape.get("tp", 1)
    return [d * tp for d in range(shape["dp"])]


# =============================================================================================
# (c) fs.value_and_grad with the branch inside the loss, and an fs.optim step


def _rank_value_and_grad(shape, optimizer, bucket_mb):
    dp = shape["dp"]
    x, w = _data(dp)
    in_specs, w_spec = _specs(shape)
    opt = fs.optim.sgd(LR, momentum=0.9) if optimizer == "sgd" else fs.optim.adamw(LR)

    def loss(w, x):
        return fs.pmean(_local_loss(x, w, shape), "dp")

    def step(w, x):
        value, g = fs.value_and_grad(loss)(w, x)
        new, _ = opt.update(w, g, opt.init(w))
        return value, g, new

    kw = {} if bucket_mb == "default" else {"bucket_mb": bucket_mb}
    try:
        value, g, new = fs.shard_map(
            step, mesh=fs.Mesh(**shape), in_specs=(w_spec, in_specs[0]), out_specs=("", w_spec, w_spec), **kw
        )(w, x)
    except fs.SpecError as e:
        return str(e)
    return value, full(g), full(new)


def _reference_step(dp: int, optimizer):
    x, w = _data(dp)
    wr = w.clone().requires_grad_(True)
    value = _reference(x, wr, dp).mean()
    value.backward()
    p = w.clone().requires_grad_(True)
    p.grad = wr.grad.clone()
    opt = torch.optim.SGD([p], lr=LR, momentum=0.9) if optimizer == "sgd" else torch.optim.AdamW([p], lr=LR)
    opt.step()
    return value.detach(), wr.grad, p.detach()


@pytest.mark.parametrize("n,shape", MESHES, ids=MESH_IDS)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_value_and_grad_with_a_branch_in_the_loss(n, shape, optimizer):
    want_value, want_grad, want_new = _reference_step(shape["dp"], optimizer)
    errs = []
    for r, got in enumerate(run_ranks(n, _rank_value_and_grad, shape, optimizer, "default")):
        if isinstance(got, str):
            errs.append(f"rank {r}: {got}")
            continue
        value, g, new = got
        close(errs, f"rank {r} value", value, want_value, F64)
        close(errs, f"rank {r} grad", g, want_grad, F64)
        close(errs, f"rank {r} after an {optimizer} step", new, want_new, F64)
    assert_ok([errs])


def test_value_and_grad_without_buckets_keeps_the_gradient_tainted():
    # bucket_mb=None: each use's cast sums its own gradient, so no single all-reduce makes it
    got = run_ranks(2, _rank_value_and_grad, {"dp": 2}, "sgd", None)
    assert [g.splitlines()[1] for g in got] == [
        "  - out[1] varies over mesh axis dp but out_spec 'd e' says it is replicated over dp; reduce it inside "
        "f (fs.psum / fs.pmean over 'dp'), mark it as a partial sum with '| sum(dp)', split a dim over dp in "
        "the out_spec, or pass check=False if you know it is the same on every rank"
    ] * 2


def _rank_branch_first():
    x, w = _data(2)

    def loss(w, x):
        return fs.pmean(_block_loss(x, w), "dp")

    def step(w, x):
        if x.sum() > 0:  # before fs.value_and_grad: the branch may have chosen what it differentiates
            pass
        return fs.value_and_grad(loss)(w, x)

    try:
        fs.shard_map(step, mesh=fs.Mesh(dp=2), in_specs=("d e", "(dp b) d"), out_specs=("", "d e"))(w, x)
        return "no error"
    except fs.SpecError as e:
        return str(e).splitlines()[1]


def test_a_branch_before_value_and_grad_taints_its_gradients():
    assert (
        run_ranks(2, _rank_branch_first)
        == [
            "  - out[1] varies over mesh axis dp but out_spec 'd e' says it is replicated over dp; reduce it inside "
            "f (fs.psum / fs.pmean over 'dp'), mark it as a partial sum with '| sum(dp)', split a dim over dp in "
            "the out_spec, or pass check=False if you know it is the same on every rank"
        ]
        * 2
    )


# =============================================================================================
# a view attribute (w.T), iteration and a compiled region after the branch: their results vary
# like the branch, so the tensor they read is cast first (its gradient summed over dp)


def _rank_transposed(bucket_mb):
    x, w = _data(2)
    wt = w.T.contiguous().requires_grad_(True)

    def f(x, wt):
        if x.sum() > 0:
            h = x @ wt.T  # a view attribute of a replicated tensor, made after the branch
        else:
            h = (x @ torch.stack(list(wt)).T) * 0.5  # its rows, iterated after the branch
        return fs.psum((h * h).sum(), "dp")

    kw = {} if bucket_mb == "default" else {"bucket_mb": bucket_mb}
    loss = fs.shard_map(f, mesh=fs.Mesh(dp=2), in_specs=("(dp b) d", "e d"), out_specs="", **kw)(x, wt)
    loss.backward()
    return loss.detach(), wt.grad


@pytest.mark.parametrize("bucket_mb", ["default", None])
def test_a_view_attribute_after_the_branch_sums_its_gradient(bucket_mb):
    x, w = _data(2)
    wt = w.T.contiguous().requires_grad_(True)
    want = _reference(x, wt.T, 2).sum()
    want.backward()
    for r, (loss, g) in enumerate(run_ranks(2, _rank_transposed, bucket_mb)):
        torch.testing.assert_close(loss, want.detach(), msg=f"rank {r} loss")
        torch.testing.assert_close(g, wt.grad, msg=f"rank {r} grad")


def _rank_region():
    x, w = _data(2)
    w = w.clone().requires_grad_(True)
    scaled = fs.compile(lambda w: w * 0.5, backend="aot_eager")  # a compiled region inside the call

    def f(x, w):
        if x.sum() > 0:
            h = x @ w
        else:
            h = x @ scaled(w)  # the region's result, made after the branch: varies like it
        return fs.psum((h * h).sum(), "dp")

    loss = fs.shard_map(f, mesh=fs.Mesh(dp=2), in_specs=("(dp b) d", "d e"), out_specs="")(x, w)
    loss.backward()
    return loss.detach(), w.grad


def test_a_compiled_region_after_the_branch_sums_its_gradient():
    x, w = _data(2)
    w = w.clone().requires_grad_(True)
    want = _reference(x, w, 2).sum()
    want.backward()
    for r, (loss, g) in enumerate(run_ranks(2, _rank_region, timeout=110)):
        torch.testing.assert_close(loss, want.detach(), msg=f"rank {r} loss")
        torch.testing.assert_close(g, w.grad, msg=f"rank {r} grad")


# =============================================================================================
# uneven FSDP: fs.value_and_grad's primals keep their blocks' shapes at every rank


def _rank_uneven_primals():
    from fshard import _scalars

    mesh = fs.Mesh(dp=4)
    emb = torch.randn(250, 3, generator=torch.Generator().manual_seed(1), dtype=F64)  # 63, 63, 63, 61 rows
    ids = torch.arange(8).reshape(8, 1) * 31
    seen = {}

    def loss(emb, ids):
        table = fs.all_gather(emb, "dp", dim=0, tiled=True)
        h = torch.nn.functional.embedding(ids, table)
        seen["batch"] = type(h.shape[0]).__name__  # 2 rows on every rank: a plain int
        seen["rows"] = type(emb.shape[0]).__name__  # 63 or 61: tracked
        if h.shape[0] != ids.shape[0]:  # HF's `batch_size != position_ids.shape[0]`: no branch
            raise AssertionError("batch")
        seen["tainted"] = _scalars._stack[-1].taint != 0
        return fs.psum((h * h).sum(), "dp")

    def step(emb, ids):
        return fs.value_and_grad(loss)(emb, ids)

    value, g = fs.shard_map(step, mesh=mesh, in_specs=("(dp v) e", "(dp b) t"), out_specs=("", "(dp v) e"))(
        emb, ids
    )
    return seen, value, full(g)


def test_uneven_fsdp_primals_keep_their_shapes():
    emb = torch.randn(250, 3, generator=torch.Generator().manual_seed(1), dtype=F64).requires_grad_(True)
    ids = torch.arange(8).reshape(8, 1) * 31
    want = torch.nn.functional.embedding(ids, emb).pow(2).sum()
    want.backward()
    for r, (seen, value, g) in enumerate(run_ranks(4, _rank_uneven_primals)):
        assert seen == {"batch": "int", "rows": "VaryingInt", "tainted": False}, f"rank {r}"
        torch.testing.assert_close(value, want.detach(), msg=f"rank {r} value")
        torch.testing.assert_close(g, emb.grad, msg=f"rank {r} grad")
