"""Data-dependent Python control flow on varying values, and shapes of uneven blocks.

- A branch (``if``, a comparison, ``int()``, ``range()``) on a value that varies over axes A runs
  as written; every value made afterwards counts as varying over A (the ranks may have taken
  different paths), so a replicated out_spec claim on it fails with a message naming the branch,
  unless the value comes out of a collective over A made after the branch (``fs.psum``/``pmean``).
- Sizes of uneven blocks are tracked per dim: only a dim whose size can differ between ranks
  gives a `VaryingInt`; the others are plain ints (``if x.shape[1] == 1``, ``loss / y.shape[1]``,
  ``range(x.shape[1])`` are ordinary Python).

Values and gradients are compared with the same computation done by plain torch on the global
tensors in one process, on 2 and 4 ranks, with uneven splits, combining on and off, check=False.
"""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from tests.conftest import run_ranks
from tests.helpers import env_vars

F64 = torch.float64


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# =============================================================================================
# HF-like mask code: `if mask.all(): ... else: ...` on a dp-split attention mask


def _masked_mean(x, mask, w):
    """The model: what HF's mask code does (a Python branch on the whole mask), then a loss."""
    if mask.all():  # no padding: no masking needed
        h = x @ w
    else:
        h = (x @ w) * mask.unsqueeze(-1)
    return h.pow(2).sum(), mask.sum()


def _rank_mask(n, X, M, W, combine, check):
    mesh = fs.Mesh(dp=n)
    w = W.clone().requires_grad_(True)

    def f(x, mask, w):
        total, count = _masked_mean(x, mask, w)
        return fs.psum(total, "dp") / fs.psum(count, "dp").to(F64)  # made after the psums: varying

    def g(x, mask, w):
        total, count = _masked_mean(x, mask, w)
        return fs.psum(total, "dp")  # a psum's result: replicated

    with env_vars(FSHARD_COMBINE=combine):
        out = fs.shard_map(
            g, mesh=mesh, in_specs=("(dp b) s d", "(dp b) s", "d e"), out_specs="", check=check
        )(X, M, w)
        out.backward()
        try:
            fs.shard_map(f, mesh=mesh, in_specs=("(dp b) s d", "(dp b) s", "d e"), out_specs="")(X, M, W)
            err = "no error"
        except fs.SpecError as e:
            err = str(e)
    return out.detach(), w.grad, err


@pytest.mark.parametrize("n,rows", [(2, 3), (4, 5)])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("combine,check", [(1, True), (0, False)])
def test_branch_on_a_varying_mask(n, rows, padded, combine, check):
    X, W = _randn(0, rows, 4, 3), _randn(1, 3, 2)
    M = torch.ones(rows, 4, dtype=F64)
    if padded:
        M[-1, 2:] = 0  # the last sequence is padded: the last rank takes the other branch
    w = W.clone().requires_grad_(True)
    h = (X @ w) * M.unsqueeze(-1)
    want = h.pow(2).sum()
    want.backward()
    for r, (got, gw, err) in enumerate(run_ranks(n, _rank_mask, n, X, M, W, combine, check)):
        torch.testing.assert_close(got, want.detach(), msg=f"rank {r} value")
        torch.testing.assert_close(gw, w.grad, msg=f"rank {r} grad w")
        assert err == (
            "fs.shard_map(_rank_mask.<locals>.f): 1 problem with out_specs (replication check):\n"
            "  - out varies over mesh axis dp but out_spec '' says it is replicated over dp; reduce it inside f "
            "(fs.psum / fs.pmean over 'dp'), mark it as a partial sum with '| sum(dp)', split a dim over dp in "
            "the out_spec, or pass check=False if you know it is the same on every rank\n"
            "f branched on a value that varies across ranks (bool() (a Python if, while, and/or or assert) of a "
            f"value that varies over mesh axis 'dp', at test_branches.py:{_LINE_ALL}), so the ranks may have run different code from there on: "
            "every value made after it (and any value it may have chosen) counts as varying over those axes; "
            "reduce the output after the branch (the result of fs.psum / fs.pmean / fs.all_gather(..., "
            "invariant=True) over them is the same on every rank), or select with torch.where(cond, a, b) "
            "instead of the branch"
        )


_LINE_ALL = _masked_mean.__code__.co_firstlineno + 2


# =============================================================================================
# a branch may choose between values made before it: they count as varying too


def _rank_choose(route):
    mesh = fs.Mesh(dp=2)

    def f(x):
        a = x.sum() * 0 + 1.0  # invariant values made before the branch
        b = torch.tensor(2.0, dtype=F64)
        s = fs.psum(x.sum(), "dp")
        if route == "chosen":
            return a if x.sum() > 0 else b  # rank 0 picks a, rank 1 picks b
        if route == "psum_of_chosen":
            return fs.psum(a if x.sum() > 0 else b, "dp")  # 1 + 2 on every rank
        if route == "psum_before":
            t = s * 2 if x.sum() > 0 else s  # a psum made before the branch, chosen by it
            return t
        if route == "int":
            k = int(x.sum().item() > 0)  # a plain int from a varying value
            return torch.tensor(float(k), dtype=F64) * a
        if route == "range":
            acc = a * 0
            for _ in range(int(x.sum() > 0)):  # a loop count from a varying value
                acc = acc + 1
            return fs.psum(acc, "dp")  # 1 + 0 on every rank
        if route == "psum_number":
            return fs.psum(3 if x.sum() > 0 else 5, "dp")  # 3 + 5: summed, not 3 * 2 or 5 * 2
        raise AssertionError(route)

    x = torch.tensor([1.0, -1.0], dtype=F64)
    if route == "psum_number":
        return fs.shard_map(f, mesh=mesh, in_specs="(dp b)", out_specs=None)(x)
    try:
        return fs.shard_map(f, mesh=mesh, in_specs="(dp b)", out_specs="")(x).item()
    except fs.SpecError as e:
        return str(e).splitlines()[1][:60]


@pytest.mark.parametrize(
    "route,want",
    [
        ("chosen", "  - out varies over mesh axis dp but out_spec '' says it is "),
        ("psum_of_chosen", 3.0),
        ("psum_before", "  - out varies over mesh axis dp but out_spec '' says it is "),
        ("int", "  - out varies over mesh axis dp but out_spec '' says it is "),
        ("range", 1.0),
        ("psum_number", 8),
    ],
)
def test_a_branch_taints_what_it_may_choose(route, want):
    assert run_ranks(2, _rank_choose, route) == [want, want]


# =============================================================================================
# shapes of uneven blocks: only the sizes that differ between ranks are tracked numbers


def _kinds(sizes) -> str:
    """'i' for a plain int, 'V' for a tracked VaryingInt, per size."""
    return "".join({"VaryingInt": "V", "int": "i"}.get(type(n).__name__, "?") for n in sizes)


def _rank_shapes(n, X, W, V):
    mesh = fs.Mesh(dp=n)
    w = W.clone().requires_grad_(True)
    v = V.clone().requires_grad_(True)

    def f(x, w, v):
        got = {
            "x": _kinds(x.shape),
            "size1": _kinds([x.size(1), x.size(-1)]),
            "numel": _kinds([x.numel()]),
            "reshape": _kinds(x.reshape(-1, x.shape[2]).shape),  # merges the uneven dim
            "flatten1": _kinds(x.flatten(1).shape),  # merges two even dims
            "transpose": _kinds(x.transpose(0, 1).shape),
            "matmul": _kinds((x @ w).shape),
            "cat": _kinds(torch.cat([x, x], 1).shape),
            "sum0": _kinds(x.sum(0).shape),
            "slice": _kinds(x[:, : x.shape[0]].shape),  # a bound from the uneven dim
        }
        if x.shape[1] == 1:  # plain: no branch on a varying value
            raise AssertionError("seq len")
        acc = x.new_zeros(())
        for i in range(x.shape[1]):  # plain
            acc = acc + x[:, i].sum()
        wg = fs.all_gather(v, "dp", dim=0, tiled=True)  # vocab 250 cut 63, 63, 63, 61 (or 125, 125)
        logits = x @ w @ wg.T
        got["logits"] = _kinds(logits.shape)
        got["len"] = len(x.transpose(0, 1))  # plain: the even dim
        loss = fs.psum(logits.pow(2).sum(), "dp") / x.shape[1] / logits.shape[-1]  # replicated
        return loss, fs.psum(acc, "dp"), got

    g = fs.shard_map(f, mesh=mesh, in_specs=("(dp b) s d", "d e", "(dp v) e"), out_specs=("", "", None))
    loss, acc, got = g(X, w, v)
    loss.backward()
    return loss.detach(), acc, w.grad, v.grad, got


@pytest.mark.parametrize("n,rows", [(2, 3), (4, 5), (4, 4)])
def test_only_uneven_sizes_are_tracked(n, rows):
    X, W, V = _randn(2, rows, 4, 3), _randn(3, 3, 2), _randn(4, 250, 2)
    w, v = W.clone().requires_grad_(True), V.clone().requires_grad_(True)
    logits = X @ w @ v.T
    loss = logits.pow(2).sum() / 4 / 250
    loss.backward()
    uneven = rows % n != 0
    b = "V" if uneven else "i"
    want = {
        "x": b + "ii",
        "size1": "ii",
        "numel": b,
        "reshape": b + "i",
        "flatten1": b + "i",
        "transpose": "i" + b + "i",
        "matmul": b + "ii",
        "cat": b + "ii",
        "sum0": "ii",
        "slice": b + b + "i",
        "logits": b + "ii",
        "len": 4,
    }
    for r, (got_loss, got_acc, gw, gv, got) in enumerate(run_ranks(n, _rank_shapes, n, X, W, V)):
        torch.testing.assert_close(got_loss, loss.detach(), msg=f"rank {r} loss")
        torch.testing.assert_close(got_acc, X.sum(), msg=f"rank {r} acc")
        torch.testing.assert_close(gw, w.grad, msg=f"rank {r} grad w")
        torch.testing.assert_close(gv, v.grad, msg=f"rank {r} grad v")
        assert got == want, f"rank {r}"


# =============================================================================================
# GPT-2 (Hugging Face, a tiny config, random init): an uneven batch with a padded attention_mask


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=250, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return GPT2LMHeadModel(cfg).double().eval()


def _gpt2_loss_sum(m, params, ids, mask):
    logits = torch.func.functional_call(m, params, (ids,), {"attention_mask": mask}).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    )
    return (ce * mask[:, 1:].reshape(-1)).sum()


def _rank_gpt2(n, ids, mask):
    m = _gpt2()
    params = {k: v.detach().clone().requires_grad_(True) for k, v in m.named_parameters()}

    def f(params, ids, mask):
        return fs.psum(_gpt2_loss_sum(m, params, ids, mask), "dp")

    mesh = fs.Mesh(dp=n)
    loss = fs.shard_map(f, mesh=mesh, in_specs=("...", "(dp b) s", "(dp b) s"), out_specs="")(
        params, ids, mask
    )
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in params.items()}


def test_gpt2_with_a_padded_mask_and_an_uneven_batch():
    pytest.importorskip("transformers")
    ids = torch.randint(0, 250, (3, 8), generator=torch.Generator().manual_seed(1))  # 3 rows over 2 ranks
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[-1, 5:] = 0  # the last sequence is padded
    m = _gpt2()
    params = {k: v.detach().clone().requires_grad_(True) for k, v in m.named_parameters()}
    want = _gpt2_loss_sum(m, params, ids, mask)
    want.backward()
    for r, (loss, grads) in enumerate(run_ranks(2, _rank_gpt2, 2, ids, mask, timeout=110)):
        torch.testing.assert_close(loss, want.detach(), msg=f"rank {r} loss")
        for k, g in grads.items():
            torch.testing.assert_close(g, params[k].grad, msg=f"rank {r} grad {k}")


# =============================================================================================
# an op returning its operand (w.to(w.device)) on a function of a parameter behind the gradient
# boundary: its twin was registered as derived from itself (endless recursion at its first cast)


def _rank_same_object(X, W):
    mesh = fs.Mesh(dp=2)
    w = W.clone().requires_grad_(True)

    def f(x, w):
        h = w * 2  # an invariant function of w: its twin is derived from w's
        h = h.to(h.device)  # h itself
        return fs.psum((x @ h).sum(), "dp")

    loss = fs.shard_map(f, mesh=mesh, in_specs=("(dp b) d", "d e"), out_specs="")(X, w)
    loss.backward()
    return loss.detach(), w.grad


def test_an_op_returning_its_operand_keeps_the_twin():
    X, W = _randn(5, 3, 4), _randn(6, 4, 2)
    w = W.clone().requires_grad_(True)
    want = (X @ (w * 2)).sum()
    want.backward()
    for r, (loss, gw) in enumerate(run_ranks(2, _rank_same_object, X, W)):
        torch.testing.assert_close(loss, want.detach(), msg=f"rank {r} loss")
        torch.testing.assert_close(gw, w.grad, msg=f"rank {r} grad w")


# =============================================================================================
# a comparison of tracked sizes that comes out the same on every rank is a plain bool


def _rank_size_compare(X, W, route):
    mesh = fs.Mesh(dp=2)

    def f(x, w):
        n = x.shape[0]  # 2 and 1: tracked, with both ranks' values
        if (n >= 1) if route == "same" else (n > 1):  # the same on both ranks / not
            return w * 2
        return w * 3

    try:
        return fs.shard_map(f, mesh=mesh, in_specs=("(dp b) d", "d e"), out_specs="d e")(X, W)
    except fs.SpecError as e:
        return str(e).splitlines()[-1].split(" a value that varies over")[0]


def test_a_size_comparison_the_same_on_every_rank_is_plain():
    X, W = _randn(7, 3, 2), _randn(8, 2, 2)
    for got in run_ranks(2, _rank_size_compare, X, W, "same"):
        torch.testing.assert_close(got, W * 2)
    assert (
        run_ranks(2, _rank_size_compare, X, W, "differs")
        == ["f branched on a value that varies across ranks (a comparison of"] * 2
    )
