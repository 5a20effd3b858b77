"""Seeded randomness that does not depend on the mesh.

* `normal` / `uniform` build a parameter from a seed so that its *global* value
  is the same whatever the mesh: a 4-rank run starts from exactly the weights of a 1-rank
  run. Each rank generates the global tensor on the CPU and keeps its block, which is
  simple and exact; it costs the global tensor's size in host memory once at init.
* `generator` and `dropout` give per-shard random numbers inside ``shard_map``:
  streams differ across the mesh axes a value varies over and agree across the axes it is
  replicated over, so replicas stay identical.
"""

from __future__ import annotations

import hashlib

import torch

from . import _vma
from ._comm import untracked
from ._errors import ArgumentError
from ._mesh import Mesh
from ._sharded import Sharded, shard

__all__ = ["normal", "uniform", "generator", "dropout"]


def _global(seed: int, shape, dtype, fill) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    t = torch.empty(tuple(shape), dtype=torch.float32)
    fill(t, g)
    return t.to(dtype)


def _place(t: torch.Tensor, mesh: Mesh | None, spec, device):
    if mesh is None:
        return t.to(device) if device is not None else t
    if spec is None:
        raise ArgumentError("fs.random: pass spec= together with mesh= (the layout of the result)")
    s = shard(t.to(mesh.device), mesh, spec)
    return s


def normal(
    seed: int,
    shape,
    *,
    mean: float = 0.0,
    std: float = 1.0,
    mesh: Mesh | None = None,
    spec=None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> torch.Tensor | Sharded:
    """A normal tensor whose global value depends only on ``seed`` and ``shape``.

    With ``mesh`` and ``spec`` the result is a `Sharded` value holding this rank's
    block; without, a plain tensor.

    Examples:
        >>> w = fs.random.normal(0, (1024, 256), std=0.02, mesh=mesh, spec="(tp h) d")
    """
    t = _global(seed, shape, dtype, lambda t, g: t.normal_(mean, std, generator=g))
    return _place(t, mesh, spec, device)


def uniform(
    seed: int,
    shape,
    *,
    low: float = 0.0,
    high: float = 1.0,
    mesh: Mesh | None = None,
    spec=None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> torch.Tensor | Sharded:
    """A uniform tensor whose global value depends only on ``seed`` and ``shape`` (see `normal`).

    Examples:
        >>> b = fs.random.uniform(1, (256,), low=-0.1, high=0.1, mesh=mesh, spec="(tp d)")
    """
    t = _global(seed, shape, dtype, lambda t, g: t.uniform_(low, high, generator=g))
    return _place(t, mesh, spec, device)


def _mix(seed: int, coords: tuple) -> int:
    h = hashlib.blake2b(repr((int(seed), coords)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def generator(seed: int, like: torch.Tensor | None = None, *, axes=None, device=None) -> torch.Generator:
    """A ``torch.Generator`` for per-shard random numbers inside ``shard_map``.

    The stream is seeded from ``seed`` and this rank's index along ``axes`` (by default the
    axes ``like`` varies over), so it differs across those axes and agrees across the rest;
    numbers drawn from it in this call vary over those axes (for the replication check).

    Inside ``shard_map`` an op that draws from torch's global generator (``F.dropout``,
    ``torch.rand``, ``randn_like``, ``normal_``, ... without ``generator=``) gives each rank
    its own numbers, so its result varies over every mesh axis. Any other explicit
    ``generator=`` is taken at its word: a draw from it varies only as its operands do, so a
    generator seeded alike on every rank gives replicated numbers.

    Examples:
        >>> g = fs.random.generator(step, like=h)
        >>> noise = torch.randn(h.shape, generator=g)
    """
    tr = _vma.current("random.generator")
    mesh = tr.mesh
    if axes is None:
        names = mesh.names_of(_vma.get(like, tr)) if like is not None else ()
    else:
        names = mesh.check_axes(axes, "random.generator")
    coords = tuple((n, mesh.axis_index(n)) for n in names)
    dev = device if device is not None else (like.device if like is not None else mesh.device)
    g = torch.Generator(device=dev).manual_seed(_mix(seed, coords))
    return _vma.tag_generator(g, tr, mesh.bits(names))  # its draws vary over those axes


def dropout(x: torch.Tensor, p: float, seed: int, *, training: bool = True) -> torch.Tensor:
    """Inverted dropout inside ``shard_map`` with a mask that is independent across the axes ``x`` varies over.

    Ranks holding replicas of ``x`` draw the same mask, so replicas stay identical (and the
    replication check still holds); ranks holding different shards draw independent masks.

    Examples:
        >>> h = fs.random.dropout(h, 0.1, seed=step)
    """
    if not training or p == 0.0:
        return x
    g = generator(seed, like=x)
    with untracked():
        keep = torch.rand(x.shape, generator=g, device=x.device) >= p
        mask = keep.to(x.dtype) / (1.0 - p)
    return x * mask
