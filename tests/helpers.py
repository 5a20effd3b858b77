"""Helpers shared by the multi-rank test modules.

A rank function (module level in a test module, so that the ranks import it by reference; see
conftest.py) builds the same global tensors on every rank from fixed seeds (:func:`randn`),
compares fshard's results with a plain-torch reference at a tolerance chosen by dtype
(:func:`close`) and the collectives it issued with the expected ``(kind, axes, nbytes)`` records
(:func:`expected_counts`, :func:`check_counts`). It returns a list of problems, empty when all is
well; the test asserts the per-rank lists with :func:`assert_ok`, so that one failure shows every
mismatch of every rank at once.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections import Counter

import torch

__all__ = [
    "TOL",
    "assert_ok",
    "check_counts",
    "close",
    "compile_counter",
    "env_vars",
    "expected_counts",
    "full",
    "gelu_mlp",
    "is_split",
    "local_slice_backward",
    "mse",
    "randn",
    "spec_dims",
]

# (rtol, atol) per dtype name
TOL = {"float16": (1e-2, 1e-2), "float32": (1e-5, 1e-6), "float64": (1e-10, 1e-12)}


# == environment ===========================================================================


@contextlib.contextmanager
def env_vars(**kv):
    """Set environment variables (fshard's ``FSHARD_*`` switches) for a block, in this rank's
    process, and put back what was there before (also when the block raises)."""
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: str(v) for k, v in kv.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# == tensors and comparisons ================================================================


def randn(seed, *shape, dtype=torch.float32):
    """A standard normal tensor from ``seed``, identical on every rank (drawn in float64)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(dtype)


def close(errs, what, got, want, dtype=torch.float32):
    """Append to ``errs`` how ``got`` differs from ``want`` (None, shape, dtype or values).

    ``dtype`` selects the tolerance from :data:`TOL` (the computation's dtype, float32 by default).
    """
    rtol, atol = TOL[str(dtype).replace("torch.", "")]
    if got is None:
        errs.append(f"{what}: got None")
        return
    got, want = got.detach(), want.detach()
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        errs.append(f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
        return
    if not torch.allclose(got, want, rtol=rtol, atol=atol):
        err = (got - want).abs().max().item()
        errs.append(f"{what}: max abs error {err:.3g} (max |want| {want.abs().max().item():.3g})")


def full(x):
    """The global value of a Sharded; a plain tensor (or None) as is."""
    import fshard as fs

    return x.full() if isinstance(x, fs.Sharded) else x


def assert_ok(results):
    """Assert that every rank's list of problems is empty, showing them all, rank by rank."""
    errs = [f"rank {r}: {e}" for r, es in enumerate(results) for e in es]
    assert not errs, "\n".join(errs)


# == collective records =====================================================================


def expected_counts(mesh, records):
    """Expected records as a Counter; fshard issues nothing over axes of total size 1."""
    return Counter((k, tuple(a), int(n)) for k, a, n in records if math.prod(mesh.shape[x] for x in a) > 1)


def check_counts(errs, what, counts, want):
    """Append to ``errs`` when the records of ``counts`` (``fs.count_collectives``) are not ``want``."""
    got = Counter(counts.records)
    if got != want:
        errs.append(
            f"{what}: collectives differ\n      got  {sorted(got.items())}\n      want {sorted(want.items())}"
        )


def spec_dims(spec, mesh):
    """The mesh axes splitting each dim of an einops-style spec (labels dropped)."""
    dims = []
    for m in re.finditer(r"\(([^)]*)\)|(\S+)", spec.split("|")[0]):
        names = (m.group(1) or m.group(2)).split()
        dims.append(tuple(n for n in names if n in mesh.shape))
    return dims


def is_split(spec, mesh):
    """Whether some mesh axis splits some dim of ``spec``."""
    return any(spec_dims(spec, mesh))


def local_slice_backward(mesh, spec, shape, elsize):
    """Records of the all_gathers that the backward of slicing a plain global input issues."""
    shape = list(shape)
    out = []
    for d, axes in enumerate(spec_dims(spec, mesh)):
        if axes:
            shape[d] //= math.prod(mesh.shape[a] for a in axes)
            out.append(("all_gather", axes, math.prod(shape) * elsize))
    return out


# == torch.compile =========================================================================


def compile_counter():
    """A torch.compile backend that runs the AOT graphs as they are (aot_eager) and counts.

    Returns ``(backend, stats)``: ``stats["graphs"]`` is the number of graphs Dynamo made (a
    graph break or a recompile adds one), ``stats["ops"]`` the names of the ``_c10d_functional``
    collectives in the forward and backward graphs (``wait_tensor`` left out)."""
    from torch._dynamo.backends.common import aot_autograd

    stats: dict = {"graphs": 0, "ops": []}

    def capture(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and "_c10d_functional" in str(node.target):
                name = str(node.target).split(".")[-2]
                if name != "wait_tensor":
                    stats["ops"].append(name)
        return gm

    inner = aot_autograd(fw_compiler=capture, bw_compiler=capture)

    def backend(gm, example_inputs):
        stats["graphs"] += 1
        return inner(gm, example_inputs)

    return backend, stats


# == reference computations (plain torch) ===================================================


def mse(a, b):
    """Mean squared error."""
    return ((a - b) ** 2).mean()


def gelu_mlp(p, x):
    """``gelu(x @ w1 + b1) @ w2`` (the output bias, if any, is the caller's: it follows a psum)."""
    return torch.nn.functional.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]
