"""torch behaviours that fshard refuses around, checked on the installed torch (one process).

Each test asserts that a limit fshard's documentation and refusals name still holds, so that the
torch version that lifts it fails here, and the refusal can go. They compare a compiled function
with the same function run eagerly by plain torch (no fshard involved).
"""

from __future__ import annotations

import torch


class _TwiceBackward(torch.autograd.Function):
    """The identity, whose backward doubles the cotangent (as a psum over 2 ranks would)."""

    @staticmethod
    def forward(x):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, ct):
        return ct * 2

    @staticmethod
    def jvp(ctx, t):
        return t * 2


def _loss(w, x):
    return (_TwiceBackward.apply(w) * x).sum()


def test_dynamo_drops_an_autograd_functions_backward_and_jvp_under_torch_func():
    # pytorch/pytorch#193279 (grad) and #192985 (jvp): fshard's collectives are autograd Functions
    # whose backward is their transpose, so torch.func transforms in a compiled shard_map call are
    # refused (fshard/_compile.py, check_transforms; docs/tutorial/09-compiling.md). When this test
    # fails, the installed torch keeps the rules: lift the refusal and test the transforms compiled.
    w, x = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)

    def grad(w, x):
        return torch.func.grad(_loss)(w, x)

    def jvp(w, x):
        return torch.func.jvp(lambda v: _loss(v, x), (w,), (torch.ones_like(w),))[1]

    torch._dynamo.reset()
    eager_grad, eager_jvp = grad(w, x), jvp(w, x)
    torch.testing.assert_close(eager_grad, 2 * x)  # eager: the custom rules
    torch.testing.assert_close(eager_jvp, 2 * x.sum())
    compiled_grad = torch.compile(grad, backend="aot_eager", fullgraph=True)(w, x)
    compiled_jvp = torch.compile(jvp, backend="aot_eager", fullgraph=True)(w, x)
    torch._dynamo.reset()
    torch.testing.assert_close(compiled_grad, x)  # compiled: the forward's own derivative
    torch.testing.assert_close(compiled_jvp, x.sum())
