"""fshard: JAX-style functional sharding on PyTorch.

Write a per-shard function over plain tensors, annotate inputs and outputs with
einops-style partition specs, and wrap it in `shard_map`::

    import fshard as fs

    mesh = fs.Mesh(dp=2, tp=2)

    @fs.shard_map(mesh=mesh, in_specs=("(dp b) (tp k)", "(tp k) n"), out_specs="(dp b) n")
    def matmul(x, w):
        return fs.psum(x @ w, "tp")
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers and editors; at run time, names load on first use (below)
    from . import checkpoint, optim, random  # submodules: fs.optim.adamw, fs.random.normal
    from ._autodiff import grad, value_and_grad
    from ._buckets import no_sync
    from ._collectives import (
        Pending,
        all_gather,
        all_to_all,
        axis_index,
        axis_size,
        pbroadcast,
        pmax,
        pmean,
        pmin,
        ppermute,
        psum,
        psum_scatter,
        pvary,
    )
    from ._counts import CollectiveCounts, count_collectives
    from ._debug import debug
    from ._env import restart_count
    from ._errors import (
        ArgumentError,
        CheckpointError,
        CollectiveError,
        FshardError,
        MeshError,
        RankError,
        SpecError,
        TracingError,
    )
    from ._fsdp import fsdp_scan
    from ._jit import compile
    from ._launch import RankPool, init, launch
    from ._layout import Layout
    from ._mesh import Mesh
    from ._modules import check_buffers, sync_buffers
    from ._remat import remat
    from ._reshard import reshard_after_forward
    from ._shard_map import shard_map
    from ._sharded import Sharded, from_dtensor, full, reduce_to, shard
    from ._spec import Spec, parse_spec
    from ._stages import PerRank, switch
    from ._visualize import visualize

# Public name -> the module that defines it. Importing fshard imports nothing else (no torch):
# a name's module is imported on first use, so ``python -m fshard.run`` starts at once.
_LAZY = {
    "checkpoint": "checkpoint",  # a submodule
    "optim": "optim",  # a submodule
    "random": "random",  # a submodule
    "grad": "_autodiff",
    "value_and_grad": "_autodiff",
    "no_sync": "_buckets",
    "Pending": "_collectives",
    "all_gather": "_collectives",
    "all_to_all": "_collectives",
    "axis_index": "_collectives",
    "axis_size": "_collectives",
    "pbroadcast": "_collectives",
    "pmax": "_collectives",
    "pmean": "_collectives",
    "pmin": "_collectives",
    "ppermute": "_collectives",
    "psum": "_collectives",
    "psum_scatter": "_collectives",
    "pvary": "_collectives",
    "CollectiveCounts": "_counts",
    "count_collectives": "_counts",
    "debug": "_debug",
    "ArgumentError": "_errors",
    "CheckpointError": "_errors",
    "CollectiveError": "_errors",
    "FshardError": "_errors",
    "MeshError": "_errors",
    "RankError": "_errors",
    "SpecError": "_errors",
    "TracingError": "_errors",
    "fsdp_scan": "_fsdp",
    "compile": "_jit",
    "RankPool": "_launch",
    "init": "_launch",
    "launch": "_launch",
    "restart_count": "_env",
    "Layout": "_layout",
    "Mesh": "_mesh",
    "check_buffers": "_modules",
    "sync_buffers": "_modules",
    "remat": "_remat",
    "reshard_after_forward": "_reshard",
    "shard_map": "_shard_map",
    "Sharded": "_sharded",
    "from_dtensor": "_sharded",
    "full": "_sharded",
    "reduce_to": "_sharded",
    "shard": "_sharded",
    "Spec": "_spec",
    "parse_spec": "_spec",
    "PerRank": "_stages",
    "switch": "_stages",
    "visualize": "_visualize",
}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'fshard' has no attribute {name!r}")
    value = importlib.import_module(f"fshard.{mod}")
    if name != mod:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    # mesh and specs
    "Mesh",
    "Spec",
    "parse_spec",
    "Layout",
    # the transform and global values
    "shard_map",
    "Sharded",
    "shard",
    "from_dtensor",
    "full",
    "reduce_to",
    "visualize",
    "debug",
    # per-rank values (pipeline stages)
    "PerRank",
    "switch",
    # collectives
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "pbroadcast",
    "pvary",
    "Pending",
    "axis_index",
    "axis_size",
    # autodiff
    "grad",
    "value_and_grad",
    "no_sync",
    "remat",
    "fsdp_scan",
    "reshard_after_forward",
    "count_collectives",
    "CollectiveCounts",
    # compiling
    "compile",
    # launching
    "init",
    "launch",
    "RankPool",
    "restart_count",
    # nn.Module buffers
    "sync_buffers",
    "check_buffers",
    # submodules
    "checkpoint",
    "optim",
    "random",
    # errors
    "FshardError",
    "SpecError",
    "MeshError",
    "CollectiveError",
    "ArgumentError",
    "CheckpointError",
    "TracingError",
    "RankError",
]
