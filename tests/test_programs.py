"""Autodiff through shard_map: a matrix of programs x layouts x world sizes x gradient paths.

Every case runs on real gloo ranks (the session's rank pools, see conftest.py). Each rank
builds the same global tensors from fixed seeds, runs the program (from programs.py) with
fshard, runs the same math in plain torch on the global tensors (the single-process
reference), and compares values and gradients at tight tolerances. It also asserts the exact
collectives fshard issued, forward and backward, as ``(kind, axes, nbytes)`` records
(``fs.count_collectives``). Rank functions return a list of problems (empty when all is
well) so the assertion message shows every mismatch of every rank at once (helpers.py).

Gradient paths:

* ``inside``: the VJP is taken inside the shard_map'd function (``torch.autograd.grad``
  on local tensors with this rank's block of the cotangent) and the gradients are
  returned as outputs with their parameter's spec.
* ``outside-sharded`` / ``outside-plain``: the shard_map'd function is differentiated
  from outside, on global values. Split inputs are passed as ``fs.Sharded`` (their
  ``.grad`` is Sharded) or as plain global tensors (their ``.grad`` is the full gradient
  on every rank, which costs one all_gather per split dim in the backward).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tests.conftest import run_ranks
from tests.helpers import (
    assert_ok,
    check_counts,
    close,
    expected_counts,
    full,
    is_split,
    local_slice_backward,
    randn,
)
from tests.programs import PATHS, PROGRAMS

# == the driver (one job on every rank) =====================================================


def _run_case(prog, axes, path, dtype_name, opts, bucketed=False):
    """``bucketed=False``: one gradient all-reduce per input (``bucket_mb=0``), the records
    asserted exactly. ``bucketed=True``: the default buckets; the same values and gradients, the
    same bytes per (kind, axes), and no more calls (`_check_bucketed`)."""
    import fshard as fs

    bucket_mb = 25.0 if bucketed else 0

    dtype = getattr(torch, dtype_name)
    mesh = fs.Mesh(**axes)
    c = PROGRAMS[prog](mesh, dtype, **opts)
    errs: list[str] = []
    shard_specs = getattr(c, "shard_specs", {})
    ct_spec = c.out_spec.split("|")[0].strip()

    # single-process reference on the global tensors
    ref_in = {k: v.clone().requires_grad_(k in c.diff) for k, v in c.inputs.items()}
    ref_out = c.ref(ref_in)
    ct = randn(99, *ref_out.shape, dtype=dtype)
    ref_grads = dict(zip(c.diff, torch.autograd.grad(ref_out, [ref_in[k] for k in c.diff], ct)))
    want_fwd, want_bwd = expected_counts(mesh, c.fwd), expected_counts(mesh, c.bwd)

    def arg(k, v, grad):
        spec = shard_specs.get(k, c.specs[k])
        if path != "outside-plain" and is_split(spec, mesh):
            s = fs.shard(v, mesh, spec)
            return s.requires_grad_(True) if grad else s
        return v.clone().requires_grad_(grad)

    if path == "inside":

        def inside(t, ct_local):
            t = dict(t)
            for k in c.diff:
                t[k] = t[k].detach().requires_grad_(True)
            out = c.local(t)
            gs = torch.autograd.grad(out, [t[k] for k in c.diff], ct_local)
            return out.detach(), dict(zip(c.diff, gs))

        f = fs.shard_map(
            inside,
            mesh=mesh,
            in_specs=(c.specs, ct_spec),
            out_specs=(c.out_spec, {k: c.specs[k] for k in c.diff}),
            bucket_mb=bucket_mb,
        )
        args = {k: arg(k, v, False) for k, v in c.inputs.items()}
        if shard_specs:  # the relayout of Sharded inputs happens before f, without gradient
            want_fwd += expected_counts(mesh, c.sharded_fwd)
        with fs.count_collectives() as counts:
            out, grads = f(args, ct)
        _check(errs, "forward+backward inside f", counts, want_fwd + want_bwd, bucketed)
    else:
        f = fs.shard_map(c.local, mesh=mesh, in_specs=(c.specs,), out_specs=c.out_spec, bucket_mb=bucket_mb)
        args = {k: arg(k, v, k in c.diff) for k, v in c.inputs.items()}
        if path == "outside-sharded" and shard_specs:
            want_fwd += expected_counts(mesh, c.sharded_fwd)
            want_bwd += expected_counts(mesh, c.sharded_bwd)
        with fs.count_collectives() as fwd:
            out = f(args)
        check_counts(errs, "forward", fwd, want_fwd)
        if isinstance(out, fs.Sharded):
            out_local, ct_local = out.local, fs.shard(ct, mesh, ct_spec).local
        else:
            out_local, ct_local = out, ct
        with fs.count_collectives() as bwd:
            torch.autograd.backward(out_local, ct_local)
        if path == "outside-plain":
            for k in c.diff:
                want_bwd += expected_counts(
                    mesh, local_slice_backward(mesh, c.specs[k], c.inputs[k].shape, dtype.itemsize)
                )
        _check(errs, "backward", bwd, want_bwd, bucketed)
        grads = {k: args[k].grad for k in c.diff}
        for k in c.diff:
            if isinstance(args[k], fs.Sharded) and not isinstance(grads[k], (fs.Sharded, type(None))):
                errs.append(f"grad of Sharded input {k} is {type(grads[k]).__name__}, not Sharded")
            if isinstance(args[k], torch.Tensor) and isinstance(grads[k], fs.Sharded):
                errs.append(f"grad {k}: plain input got a Sharded gradient")

    close(errs, "output", full(out), ref_out, dtype)
    for k in c.diff:
        g = grads[k]
        close(errs, f"grad {k}", full(g) if g is not None else None, ref_grads[k], dtype)
    return errs


def _check(errs, what, counts, want, bucketed):
    if not bucketed:
        check_counts(errs, what, counts, want)
        return
    # Buckets merge gradient all-reduces over the same axes: the same bytes, no more calls.
    got_bytes, want_bytes, got_calls, want_calls = Counter(), Counter(), Counter(), Counter()
    for (kind, axes, n), k in want.items():
        want_bytes[kind, axes] += n * k
        want_calls[kind, axes] += k
    for kind, axes, n in counts.records:
        got_bytes[kind, axes] += n
        got_calls[kind, axes] += 1
    if got_bytes != want_bytes or any(got_calls[k] > want_calls[k] for k in got_calls):
        errs.append(
            f"{what}: bucketed collectives differ\n      got  {sorted(got_calls.items())} {sorted(got_bytes.items())}"
            f"\n      want {sorted(want_calls.items())} {sorted(want_bytes.items())}"
        )


def _cases():
    f32, f64 = "float32", "float64"
    cases = [
        ("worked", {"dp": 1}, {}, f32),
        ("worked", {"dp": 2}, {}, f32),
        ("worked", {"dp": 4}, {}, f64),
        ("worked", {"dp": 4}, {"diff": ("x", "y")}, f32),
        ("dp_mlp", {"dp": 1}, {}, f32),
        ("dp_mlp", {"dp": 2}, {}, f32),
        ("dp_mlp", {"dp": 4}, {}, f64),
        ("dp_mlp", {"dp": 8}, {}, f32),
        ("fsdp", {"dp": 1}, {}, f32),
        ("fsdp", {"dp": 2}, {}, f32),
        ("fsdp", {"dp": 4}, {}, f32),
        ("fsdp", {"dp": 2}, {"invariant": True}, f32),
        ("tp_mlp", {"tp": 1}, {}, f32),
        ("tp_mlp", {"tp": 2}, {}, f32),
        ("tp_mlp", {"tp": 4}, {}, f64),
        ("tp_mlp", {"tp": 2}, {"x_grad": True}, f32),
        ("tp_mlp", {"tp": 4}, {"x_grad": True}, f32),
        ("tp_attn", {"tp": 1}, {}, f32),
        ("tp_attn", {"tp": 2}, {"x_grad": True}, f32),
        ("tp_attn", {"tp": 4}, {}, f32),
        ("dp_tp", {"dp": 1, "tp": 2}, {}, f32),
        ("dp_tp", {"dp": 2, "tp": 1}, {}, f32),
        ("dp_tp", {"dp": 2, "tp": 2}, {}, f64),
        ("dp_tp", {"dp": 4, "tp": 2}, {}, f32),
        ("fsdp_tp", {"dp": 2, "tp": 1}, {}, f32),
        ("fsdp_tp", {"dp": 2, "tp": 2}, {}, f32),
        ("fsdp_tp", {"dp": 2, "tp": 4}, {}, f32),
        ("ulysses", {"sp": 1}, {}, f32),
        ("ulysses", {"sp": 2}, {}, f32),
        ("ulysses", {"sp": 4}, {}, f64),
        ("cmatmul", {"tp": 1}, {}, f32),
        ("cmatmul", {"tp": 2}, {}, f32),
        ("cmatmul", {"tp": 4}, {}, f32),
        ("pipeline", {"pp": 1}, {}, f32),
        ("pipeline", {"pp": 2}, {}, f32),
        ("pipeline", {"pp": 4}, {}, f64),
        ("dp_out", {"dp": 2}, {}, f32),
        ("dp_out", {"dp": 4}, {}, f32),
        ("tp_partial", {"tp": 2}, {}, f32),
        ("tp_partial", {"tp": 4}, {}, f32),
        ("tp_partial", {"tp": 2}, {"scatter": True}, f32),
        ("tp_partial", {"tp": 4}, {"scatter": True}, f32),
        ("reshard", {"dp": 2}, {}, f32),
        ("reshard", {"dp": 4}, {}, f32),
        ("fsdp2d", {"dp": 2, "tp": 2}, {}, f32),
        ("fsdp2d", {"dp": 2, "tp": 2}, {"order": ("tp", "dp")}, f32),
        ("fsdp2d", {"dp": 2, "tp": 4}, {"order": ("tp", "dp")}, f32),
        ("vocab_ce", {"tp": 1}, {}, f32),
        ("vocab_ce", {"tp": 2}, {}, f32),
        ("vocab_ce", {"tp": 4}, {}, f64),
    ]
    for prog, axes, opts, dt in cases:
        mesh_id = "x".join(f"{k}{v}" for k, v in axes.items())
        opt_id = "-".join(f"{k}={v if not isinstance(v, tuple) else '+'.join(v)}" for k, v in opts.items())
        paths = ("outside-sharded", "outside-plain") if opts.get("scatter") else PATHS
        for path in paths:
            ident = "-".join(x for x in (prog, mesh_id, opt_id, dt, path) if x)
            yield pytest.param(prog, axes, opts, dt, path, id=ident)


@pytest.mark.parametrize("prog, axes, opts, dtype, path", list(_cases()))
def test_program_matrix(prog, axes, opts, dtype, path):
    world = math.prod(axes.values())
    assert_ok(run_ranks(world, _run_case, prog, axes, path, dtype, opts))


_BUCKETED = [
    c
    for c in _cases()
    if c.values[0] in ("worked", "dp_mlp", "fsdp", "dp_tp", "fsdp_tp", "ulysses", "dp_out", "vocab_ce")
    and math.prod(c.values[1].values()) > 1
]


@pytest.mark.parametrize("prog, axes, opts, dtype, path", _BUCKETED)
def test_program_matrix_bucketed(prog, axes, opts, dtype, path):
    world = math.prod(axes.values())
    assert_ok(run_ranks(world, _run_case, prog, axes, path, dtype, opts, True))
