"""The autograd links of an ``fs.switch`` on a varying index (`_stages.switch`).

Each rank runs only its own branch, so what the backward does must not depend on which branch
ran: `SwitchIn` and `SwitchOut` tie every differentiable operand to every floating-point output
through a token, so that every operand gets a gradient on every rank (zeros where the branch
ignored it) and the backward issues the same collectives on every rank. Compiled, each rank's
graph holds its own branch, and AOTAutograd drops work whose result reaches no output: the
token's gradient and `keep_operands` fold every operand and every output's gradient in as zeros,
so no rank's graph loses its side of a collective its peers issue.
"""

from __future__ import annotations

import torch

from . import _compile, _vma
from ._comm import untracked
from ._primitives import apply as _apply

_Tensor = torch.Tensor

__all__: list[str] = []  # internal


def keep_operands(leaves: list, flat: list, tr) -> list:
    """Compiled: ``leaves`` with every tensor operand folded into each floating-point output as a
    zero (a sum over none of its elements), so that every rank's graph keeps what made the operands. AOTAutograd drops work whose
    result reaches no output; a branch that ignores an operand (a pipeline's first stage and the
    activation the last one sent) dropped that rank's side of a collective its peers issued, and
    they waited for it forever."""
    ops = [x for x in flat if isinstance(x, _Tensor)]
    if not ops:
        return leaves
    with untracked(), torch.no_grad():
        zeros = [x.detach().reshape(-1)[:0].abs().sum().float() for x in ops]  # (abs: complex too)
        zero = zeros[0]
        for z in zeros[1:]:
            zero = zero + z
    out = list(leaves)
    for k, y in enumerate(out):  # each output: the caller may use any of them alone
        if isinstance(y, _Tensor) and (y.is_floating_point() or y.is_complex()):
            with untracked():
                out[k] = _vma.tag(y + zero.to(y.dtype), tr, _vma.get(y, tr))
    return out


class SwitchIn(torch.autograd.Function):
    """Identity on the differentiable operands, plus a token that links the outputs to them: in
    the backward every operand gets a gradient (zeros where the branch ignored it)."""

    @staticmethod
    def forward(*xs):
        with untracked():
            return (*[x.view_as(x) for x in xs], torch.zeros((), dtype=xs[0].dtype, device=xs[0].device))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.token = (output[-1].dtype, output[-1].device)

    @staticmethod
    def backward(ctx, *cts):
        if not _compile.compiling() or cts[-1] is None:
            return cts[:-1]
        # compiled: the token's gradient (what reached the outputs) folded in, as a zero, so that
        # each rank's backward graph keeps the work that made it (see keep_operands)
        zero = cts[-1].reshape(-1)[:0].sum()
        return tuple(None if c is None else c + zero.to(c.dtype) for c in cts[:-1])

    @staticmethod
    def jvp(ctx, *ts):  # identity: the tangents pass through, the token's is zero
        dtype, device = ctx.token
        return (
            *[None if t is None else t.view_as(t) for t in ts],
            torch.zeros((), dtype=dtype, device=device),
        )

    @staticmethod
    def vmap(info, in_dims, *xs):
        return _apply(SwitchIn, *xs), (*in_dims, None)


class SwitchOut(torch.autograd.Function):
    """Identity on the branch's floating-point outputs, with the token as an extra input: the outputs
    need a gradient on every rank, and the backward of any of them reaches every operand."""

    @staticmethod
    def forward(token, *ys):
        with untracked():
            return tuple(y.view_as(y) for y in ys)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.token = (inputs[0].shape, inputs[0].dtype, inputs[0].device)

    @staticmethod
    def backward(ctx, *cts):
        shape, dtype, device = ctx.token
        token = torch.zeros(shape, dtype=dtype, device=device)
        if _compile.compiling():  # every output's gradient folded in, as a zero (see SwitchIn)
            for c in cts:
                if c is not None:
                    token = token + c.reshape(-1)[:0].sum().to(dtype)
        return (token, *cts)

    @staticmethod
    def jvp(ctx, _, *ts):
        return tuple(None if t is None else t.view_as(t) for t in ts)

    @staticmethod
    def vmap(info, in_dims, token, *ys):
        return _apply(SwitchOut, token, *ys), tuple(in_dims[1:])


_compile.hide_jvp([SwitchIn, SwitchOut])  # (torch.compile traces Functions without a jvp)
