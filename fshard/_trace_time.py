"""Raising an error while Dynamo traces: from trace time, as itself.

An exception raised in code Dynamo traces reaches the user as Dynamo's ``Unsupported: Observed
exception``, without its text. `fail` raises it from a function Dynamo runs at trace time instead
(``assume_constant_result``), which Dynamo reports wrapped in its ``InternalTorchDynamoError``
with fshard's text (``fs.compile`` unwraps it), as the eager call raises it.
"""

from __future__ import annotations

import torch

__all__ = ["fail"]


def fail(kind: type, message: str):
    """Raise ``kind(message)``; while Dynamo traces, from trace time as itself."""
    if torch.compiler.is_compiling():
        _raise_at_trace_time(kind, message)
    raise kind(message)


@torch._dynamo.assume_constant_result  # run (and raising) at trace time, not traced
def _raise_at_trace_time(kind: type, message: str):
    raise kind(message)
