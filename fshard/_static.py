"""A compiled shard_map call's input plan, made at trace time as a constant.

Under ``torch.compile`` Dynamo interprets every bytecode of the code it traces, and a call's
planning (broadcasting the in_specs over the arguments' pytree, parsing and binding each spec,
the blocks of each input) is most of the bytecode of a shard_map call: interpreted, it took
about half the tracing time of the demo GPT step. The plan depends only on things Dynamo
specializes on anyway: the arguments' pytree structure, each leaf's kind, shape and dtype, a
`Sharded` leaf's layout and mesh, the in_specs and the mesh. So a compiled call describes its
inputs by those constants (`input_plan`, traced: a few bytecodes per leaf) and hands them to
`_plan`, which Dynamo runs at trace time as a plain function (``assume_constant_result``): it
rebuilds the arguments with stand-in leaves (meta tensors, `Sharded` values of meta blocks) and
runs the eager planning, `_ShardMapped._plan_inputs`, on them. The plan is the eager one, the
SpecErrors are eager's, raised at trace time; the plan is baked into the graph, and Dynamo's
guards on what the description read (shapes, dtypes, layouts, the structure) retrace, and so
replan, when any of it changes.

A call falls back to planning in traced code (the same functions, interpreted) where the
description would not be exact: a shape with a symbolic size (dynamic shapes), a pytree node
other than dict, list, tuple and None, a tensor subclass (a DTensor argument), or a shard_map
made inside the compiled function (it has no id here).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import optree
import torch
import torch.fx.experimental.symbolic_shapes

from . import _compile, _mesh
from ._layout import Layout
from ._sharded import Sharded

__all__ = ["Fixed", "register", "input_plan", "precheck_out_specs"]


class Fixed:
    """Base of a shard_map'd function: what its plans are made from (``f``, ``in_specs``,
    ``out_specs``, ``check``) is set once. The plans are cached per call signature, and a compiled
    call's plan is a constant of its graph: a reassigned spec would leave both meaning the old one."""

    _FIXED = frozenset(("f", "in_specs", "out_specs", "check"))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._FIXED and name in self.__dict__:
            raise AttributeError(
                f"fs.shard_map({self.__dict__.get('name', '?')}): {name} cannot be reassigned (the plans "
                f"made from it are cached, and compiled into graphs); make a new fs.shard_map(f, mesh=..., "
                f"in_specs=..., out_specs=...) instead"
            )
        object.__setattr__(self, name, value)


_BY_ID: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_ids = itertools.count(1)
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_has_static_value = torch.fx.experimental.symbolic_shapes.has_static_value
_NODES = (dict, list, tuple, type(None))


def register(sm) -> str | None:
    """An id for shard_map'd function ``sm``, by which `_plan` finds it at trace time; None for
    one made while Dynamo traces (its planning is traced). A string: Dynamo makes an int it reads
    symbolic when it changes between traces of the same code (two shard_map'd functions), and a
    symbolic int cannot be passed to a trace-time function."""
    if _compile.compiling():
        return None
    i = f"shard_map#{next(_ids)}"
    _BY_ID[i] = sm
    return i


def _structure(treedef):
    """The pytree structure ``treedef`` as nested tuples ``(type, entries, children)`` (None for a
    leaf); ``False`` when some node is not a dict, list, tuple or None."""
    if treedef.is_leaf():
        return None
    t = treedef.type
    if t not in _NODES:
        return False
    children = []
    for c in treedef.children():
        s = _structure(c)
        if s is False:
            return False
        children.append(s)
    return (t, tuple(treedef.entries()), tuple(children))


def _static_shape(shape) -> tuple | None:
    """``shape`` as a tuple of ints; None when a size is symbolic (Dynamo's dynamic shapes: a
    symbolic int reads as an int in traced code, and only this test, which Dynamo answers at
    trace time, tells them apart)."""
    out = tuple(shape)
    for s in out:
        if not _has_static_value(s):
            return None
    return out


def _describe(x):
    """A leaf as constants: ``(shape, dtype)`` for a plain tensor, ``(local shape, dtype, dims,
    labels, partial, mesh text, global shape or None)`` for a Sharded value, ``()`` for a value
    that is not a tensor; None where there is no exact description (see the module docstring)."""
    t = type(x)
    if t is _Tensor or t is _Parameter:
        shape = _static_shape(x.shape)
        return None if shape is None else (shape, x.dtype)
    if isinstance(x, Sharded):
        local, layout, full = x.local, x.layout, x._shape
        shape = _static_shape(local.shape)
        if shape is None:
            return None
        if full is not None:
            full = _static_shape(full)
            if full is None:
                return None
        return (shape, local.dtype, layout.dims, layout.labels, layout.partial, x.mesh._text, full)
    if isinstance(x, _Tensor):  # another tensor subclass (a DTensor): planned in traced code
        return None
    return ()


def input_plan(sm, leaves: list, treedef):
    """The input plan of a compiled call of ``sm`` on ``leaves`` (of ``treedef``), made at trace
    time by the eager planning (`_plan`); None when it must be planned in traced code."""
    sm_id = sm._id
    if sm_id is None:
        return None
    structure = _structure(treedef)
    if structure is False:
        return None
    descs = []
    for x in leaves:
        d = _describe(x)
        if d is None:
            return None
        descs.append(d)
    return _plan(sm_id, structure, tuple(descs))


class _Pass:
    """The stand-in of a leaf that is not a tensor (planned as passed through)."""


def _rebuild(structure, leaves):
    if structure is None:
        return next(leaves)
    t, entries, children = structure
    kids = [_rebuild(c, leaves) for c in children]
    if t is dict:
        return dict(zip(entries, kids))
    if t is type(None):
        return None
    return t(kids)


def _stand_in(desc):
    if not desc:
        return _Pass()
    if len(desc) == 2:
        return torch.empty(desc[0], dtype=desc[1], device="meta")
    shape, dtype, dims, labels, partial, mesh_text, full = desc
    local = torch.empty(shape, dtype=dtype, device="meta")
    return Sharded._wrap(
        local,
        _mesh.by_text(mesh_text),
        Layout(dims, labels, partial),
        None if full is None else torch.Size(full),
    )


@torch._dynamo.assume_constant_result  # run at trace time, not traced: its result is a constant
def _plan(sm_id: str, structure, descs: tuple):
    """The eager planning of a call of shard_map'd function ``sm_id`` on arguments rebuilt from
    their description: ``(plans, global indices, varying bits per leaf, label sizes, uneven)``,
    as ``_ShardMapped.__call__`` caches it (raises its SpecErrors)."""
    sm = _BY_ID[sm_id]
    args = _rebuild(structure, iter([_stand_in(d) for d in descs]))
    leaves, treedef = optree.tree_flatten(args)
    if len(leaves) != len(descs):  # (cannot happen: the structure is the arguments')
        raise AssertionError(f"fshard: rebuilt {len(leaves)} leaves for {len(descs)}")
    return sm._plan_hit(args, leaves, treedef)


@torch._dynamo.assume_constant_result  # run (and raising) at trace time, not traced
def precheck_out_specs(sm_id: str) -> bool:
    """``_ShardMapped._precheck_out_specs`` of ``sm_id`` at trace time (raises its SpecErrors)."""
    _BY_ID[sm_id]._precheck_out_specs()
    return True
