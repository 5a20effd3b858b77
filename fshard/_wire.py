"""What a collective puts on the wire: the dtypes each backend takes, and exact stand-ins for the rest.

torch's gloo backend moves and reduces float32, float64, float16, bfloat16, int8, uint8, int32,
int64 and bool (complex sums as pairs of reals) and fails on any other dtype with a bare "Invalid
scalar type" (int16, uint16, uint32, uint64, the float8 dtypes); its NCCL backend also moves the
float8 dtypes but refuses to reduce them. Every collective of ``_comm`` asks `plan` (a cached
lookup by backend, device type, dtype and kind of collective) how to send its operand:

- moving data (all-gather, all-to-all, broadcast, point to point, gather, scatter): a dtype the
  backend does not move travels as its bytes (a view as uint8: free, and exact for every dtype);
- a sum, max or min: int16 and uint16 travel as int32, uint32 as int64 (exact there; the cast
  back wraps as the dtype's own arithmetic does), uint64 as the int64 of the same bits (two's
  complement addition is the same bits; for max and min its sign bit flipped, so that signed
  order is unsigned order), the float8 dtypes as float32: max and min are exact, and a sum is
  rounded to float8 once, as ``x.float().sum(0).to(dtype)`` of the global tensor (torch has no
  float8 sum; summing in float8 across ranks would round at every step, in an order that depends
  on the backend's algorithm);
- any other dtype (a complex max, a packed float4 sum) raises `CollectiveError` before anything is
  sent, on every rank alike (they hold the same dtypes), naming the dtypes the backend takes.

A backend fshard does not know (``fake``, ``mpi``, a custom one) gets its operands as they are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._errors import CollectiveError

_f8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")]
_F8 = frozenset(_f8)
_F8_ALL = _F8 | frozenset(getattr(torch, n) for n in ("float8_e8m0fnu",) if hasattr(torch, n))
_BASIC = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)
_COMPLEX = frozenset({torch.complex64, torch.complex128})
MOVES = {"gloo": _BASIC, "nccl": _BASIC | _F8}
"""The dtypes each backend moves as they are (torch's ProcessGroupGloo and ProcessGroupNCCL)."""
REDUCES = {"gloo": _BASIC, "nccl": _BASIC}
"""The dtypes each backend reduces as they are (complex: sums only, as pairs of reals)."""
_UPCAST = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
_SIGN = torch.iinfo(torch.int64).min

_plans: dict[tuple, tuple | None] = {}
_MISS = object()


def backend(g, device: torch.device) -> str:
    """The name of the backend that runs ``g``'s collectives on ``device`` (cached on ``g``)."""
    b = g.backend
    if b is None:
        b = g.backend = str(dist.get_backend(g.group))  # type: ignore[arg-type]
    if ":" in b:  # "cpu:gloo,cuda:nccl": one backend per device type
        for part in b.split(","):
            dev, _, name = part.partition(":")
            if dev == device.type:
                return name
        return b
    return b


def plan(g, t: torch.Tensor, kind: str) -> tuple | None:
    """How ``t`` travels in a collective of ``kind`` (``"move"``, ``"sum"``, ``"max"``, ``"min"``,
    or another reduction's name) over ``g``: None as it is, else ``(wire dtype, mode)`` for `to_wire`
    and `from_wire`. Raises `CollectiveError` for a dtype the backend cannot take."""
    if t.dtype in _BASIC:  # every backend fshard knows takes these as they are (and others: as is)
        return None
    b = g.backend
    if b is None:
        backend(g, t.device)
        b = g.backend
    key = (b, t.device.type, t.dtype, kind)
    how: Any = _plans.get(key, _MISS)
    if how is _MISS:
        how = _plans[key] = _plan(backend(g, t.device), t.dtype, kind)
    if how is not None and how[1] == "error":
        raise CollectiveError(_refusal(g, t, kind, how[0]))
    return how


def _plan(name: str, dtype: torch.dtype, kind: str) -> tuple | None:
    moves = MOVES.get(name)
    if moves is None:
        return None  # a backend we do not know: it reports its own errors
    if kind == "move":
        return None if dtype in moves else (torch.uint8, "bytes")
    if dtype in REDUCES[name] or (dtype in _COMPLEX and kind in ("sum", "avg")):
        return None
    if kind in ("sum", "max", "min"):
        if dtype in _UPCAST:
            return (_UPCAST[dtype], "cast")
        if dtype == torch.uint64:
            return (torch.int64, "view" if kind == "sum" else "flip")
        if dtype in _F8_ALL:
            return (torch.float32, "cast")
    return (name, "error")


def _refusal(g, t: torch.Tensor, kind: str, name: str) -> str:
    from ._watchdog import _site

    file, line, _, api, _ = _site()
    where = f"fs.{api}" if api else f"a {kind} all-reduce"
    at = f" at {file}:{line}" if file else ""
    takes = sorted(str(d).replace("torch.", "") for d in REDUCES[name])
    dt = str(t.dtype).replace("torch.", "")
    return (
        f"{where} over {' '.join(g.names) or 'the world'}{at}: the {name} backend cannot take a {kind} of "
        f"dtype {dt} (shape {tuple(t.shape)}); it reduces {', '.join(takes)} (complex: sums only), and fshard "
        f"also int16, uint16, uint32, uint64 and the float8 dtypes (sum, max, min). Cast the operand to one of "
        f"them first, e.g. x.to(torch.float32)"
    )


def to_wire(t: torch.Tensor, how: tuple) -> torch.Tensor:
    """``t`` (contiguous) as it travels (see `plan`); a view of it for the bit-for-bit modes."""
    dt, mode = how
    if mode == "cast":
        return t.to(dt)
    if mode == "bytes":
        return t.reshape(-1).view(dt)
    if mode == "view":
        return t.view(dt)
    return t.view(dt) ^ _SIGN  # "flip"


def from_wire(w: torch.Tensor, dtype: torch.dtype, how: tuple, shape=None) -> torch.Tensor:
    """The value of dtype ``dtype`` that ``w`` carries (its shape ``shape`` for bytes)."""
    mode = how[1]
    if mode == "cast":
        return w.to(dtype)
    if mode == "bytes":
        return w.view(dtype).view(shape)
    if mode == "view":
        return w.view(dtype)
    return (w ^ _SIGN).view(dtype)
