"""`fs.switch` types its results by what its branches return (as JAX types ``lax.switch``), joined with
the index's varying axes, where it used to type them by its operands: a program whose branches
return values that do not depend on a y-varying operand is accepted (it was refused), and gives what
plain torch gives on the global tensors in one process, values and gradients. The index's axes stay
in the join: a switch on a y-varying index returning an invariant operand's functions is still
refused as replicated over y (JAX's own rule would accept it and return the y=0 rank's value). Where
the branches cannot be traced on fake tensors (a data-dependent op, a collective) the operands type
the results, as before. On a 2x2 mesh (4 gloo ranks), combining on and off.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import env_vars, randn

A, B = randn(0, 4, 3), randn(1, 4, 3)


def _double(a, b):
    return a * 2


def _shift(a, b):
    return a + 1


def _uses_b(a, b):
    return a + b.sum()


def _masked(a, b):
    return a + a[a > 0].sum()  # a data-dependent shape: not traceable on fake tensors


def _psum_b(a, b):
    import fshard as fs

    return a + fs.psum(b, "y").sum()


def _psum_b_double(a, b):
    import fshard as fs

    return a * 2 + fs.psum(b, "y").mean()


CALLS: list = []  # (branch, whether it ran on fake tensors), on this rank


def _counted_0(a, b):
    from torch._subclasses.fake_tensor import FakeTensor

    CALLS.append((0, isinstance(a, FakeTensor)))
    return a * 2


def _counted_1(a, b):
    from torch._subclasses.fake_tensor import FakeTensor

    CALLS.append((1, isinstance(a, FakeTensor)))
    return a + 1


def _rank_cache():
    """Each branch runs once on fake tensors per signature; the rank's own branch runs at every call."""
    import fshard as fs

    mesh = fs.Mesh(x=2, y=2)
    CALLS.clear()

    def f(a, b):
        return fs.switch(fs.axis_index("x"), [_counted_0, _counted_1], a, b)

    sm = fs.shard_map(f, mesh=mesh, in_specs=("(x i) j", "(y i) j"), out_specs="(x i) j")
    for _ in range(3):
        sm(A, B)
    sm(A[:, :2], B[:, :2])  # another signature: traced again
    return mesh.coordinate["x"], list(CALLS)


def test_switch_traces_each_branch_once_per_signature():
    for x, calls in run_ranks(4, _rank_cache, timeout=120):
        fake = [(0, True), (1, True)]
        real = [(x, False)]
        assert calls == fake + real * 3 + fake + real, (x, calls)


def _catch(fn):
    import fshard as fs

    try:
        out = fn()
    except fs.FshardError as e:
        return type(e).__name__, str(e)
    return "ok", out


def _rank_switch(combine: str):
    import fshard as fs

    with env_vars(FSHARD_COMBINE=combine):
        mesh = fs.Mesh(x=2, y=2)
        out = {}

        def ignores_b(a, b):  # b varies over y; neither branch reads it
            h = fs.switch(fs.axis_index("x"), [_double, _shift], a, b)
            return h, fs.psum(b, "y")  # a collective outside the switch (queued, with combining)

        f = fs.shard_map(ignores_b, mesh=mesh, in_specs=("(x i) j", "(y i) j"), out_specs=("(x i) j", "i j"))
        a, b = A.clone().requires_grad_(), B.clone().requires_grad_()
        got = _catch(lambda: f(a, b))
        if got[0] == "ok":
            h, s = got[1]
            ((h.full() ** 2).sum() + (s * torch.arange(3.0)).sum()).backward()
            out["ignores b"] = ("ok", h.full().detach(), s.detach(), a.grad, b.grad)
            out["ignores b again"] = f(A, B)[0].full()  # the branches' types from the cache
        else:
            out["ignores b"] = got
        # no gradient anywhere
        with torch.no_grad():
            out["no grad"] = _catch(lambda: f(A, B)[0].full())

        # one branch reads b: the result varies over y, refused as replicated over y (JAX refuses too)
        def reads_b(a, b):
            return fs.switch(fs.axis_index("x"), [_double, _uses_b], a, b)

        g = fs.shard_map(reads_b, mesh=mesh, in_specs=("(x i) j", "(y i) j"), out_specs="(x i) j")
        out["reads b"] = _catch(lambda: g(A, B))

        # one branch reads b, the other not; summed over y outside the switch (the other branch's
        # result is cast to vary over y on its ranks, whose gradient sums over y)
        def mixed(a, b):
            return fs.psum(fs.switch(fs.axis_index("x"), [_uses_b, _shift], a, b), "y")

        m = fs.shard_map(mixed, mesh=mesh, in_specs=("(x i) j", "(y i) j"), out_specs="(x i) j")
        a, b = A.clone().requires_grad_(), B.clone().requires_grad_()
        hm = m(a, b).full()
        (hm * torch.arange(12.0).reshape(4, 3)).sum().backward()
        out["mixed"] = (hm.detach(), a.grad, b.grad)

        # branches that call a collective: the trace on fake tensors sends nothing (the collective
        # stops it, and the operands type the result); the real branch's psum is the only one issued
        def collective(a, b):
            return fs.pmean(fs.switch(fs.axis_index("x"), [_psum_b, _psum_b_double], a, b), "y")

        c = fs.shard_map(collective, mesh=mesh, in_specs=("(x i) j", "(y i) j"), out_specs="(x i) j")
        with fs.count_collectives() as counts:
            res = c(A, B)
        out["collective"] = res.full()
        out["collective counts"] = counts.by_kind()

        # a branch that cannot run on fake tensors: typed by the operands, as before
        def untraceable(a, b):
            return fs.switch(fs.axis_index("x"), [_double, _masked], a, b)

        u = fs.shard_map(untraceable, mesh=mesh, in_specs=("(x i) j", "(y i) j"), out_specs="(x i) j")
        out["untraceable"] = _catch(lambda: u(A, B))

        # the index varies over y, the branches return functions of an operand invariant over y: the
        # ranks along y return different values, so the result varies over y (JAX would accept it as
        # replicated over y, and return the y=0 rank's branch on every rank)
        def y_index(a):
            return fs.switch(fs.axis_index("y"), [lambda a: a * 2, lambda a: a + 1], a)

        yi = fs.shard_map(y_index, mesh=mesh, in_specs=("(x i) j",), out_specs="(x i) j")
        out["y index"] = _catch(lambda: yi(A))

        # a partial sum over y of the switch's result, which does not vary over y (the partial-sum check)
        def partial(a, b):
            return fs.switch(fs.axis_index("x"), [_double, _shift], a, b)

        ps = fs.shard_map(partial, mesh=mesh, in_specs=("(x i) j", "(y i) j"), out_specs="(x i) j | sum(y)")
        out["partial"] = _catch(lambda: ps(A, B))
    return out


def _reference():
    a, b = A.clone().requires_grad_(), B.clone().requires_grad_()
    h = torch.cat([a[:2] * 2, a[2:] + 1])
    s = b.reshape(2, 2, 3).sum(0)
    ((h**2).sum() + (s * torch.arange(3.0)).sum()).backward()
    return h.detach(), s.detach(), a.grad, b.grad


def _mixed_reference():
    a, b = A.clone().requires_grad_(), B.clone().requires_grad_()
    bs = b.reshape(2, 2, 3).sum((1, 2))  # each y block's sum
    h = torch.cat([2 * a[:2] + bs.sum(), 2 * (a[2:] + 1)])
    (h * torch.arange(12.0).reshape(4, 3)).sum().backward()
    return h.detach(), a.grad, b.grad


def _replicated_y(name, spec="(x i) j"):
    return (
        f"fs.shard_map(_rank_switch.<locals>.{name}): 1 problem with out_specs (replication check):\n"
        f"  - out varies over mesh axis y but out_spec {spec!r} says it is replicated over y; reduce it inside f "
        "(fs.psum / fs.pmean over 'y'), mark it as a partial sum with '| sum(y)', split a dim over y in the "
        "out_spec, or pass check=False if you know it is the same on every rank"
    )


@pytest.mark.parametrize("combine", ["1", "0"])
def test_switch_types_its_results_by_its_branches(combine):
    h, s, ga, gb = _reference()
    mixed = _mixed_reference()
    for out in run_ranks(4, _rank_switch, combine, timeout=180):
        kind, *got = out["ignores b"]
        assert kind == "ok", got
        torch.testing.assert_close(got[0], h)
        torch.testing.assert_close(got[1], s)
        torch.testing.assert_close(got[2], ga)
        torch.testing.assert_close(got[3], gb)
        torch.testing.assert_close(out["ignores b again"], h)
        for got_m, want_m in zip(out["mixed"], mixed):
            torch.testing.assert_close(got_m, want_m)
        assert out["no grad"][0] == "ok"
        torch.testing.assert_close(out["no grad"][1], h)
        torch.testing.assert_close(
            out["collective"],
            torch.cat([A[:2] + B.sum(0).sum(), A[2:] * 2 + B.reshape(2, 2, 3).sum(0).mean()]),
        )
        assert out["collective counts"] == {("all_reduce", ("y",)): 2}  # the branch's psum and the pmean
        assert out["reads b"] == ("SpecError", _replicated_y("reads_b"))
        assert out["untraceable"] == ("SpecError", _replicated_y("untraceable"))
        assert out["y index"] == ("SpecError", _replicated_y("y_index"))
        assert out["partial"] == (
            "SpecError",
            "fs.shard_map(_rank_switch.<locals>.partial): 1 problem with out_specs (partial-sum check):\n"
            "  - out does not vary over mesh axis y (it is the same on every rank of y), but out_spec "
            "'(x i) j | sum(y)' marks it as a partial sum over y, which would add up its 2 equal copies (2 times "
            "the value); drop '| sum(y)' from the out_spec to return the value as it is, or make each rank of y "
            "compute its own term of the sum (e.g. split the contracted dim over y in the in_specs); to add the 2 "
            "copies on purpose, return fs.pvary(x, 'y')",
        )
