"""``shard_map``: run a per-shard function on local blocks and stitch the outputs.

Sections: API; planning (cached per input signature); error checking and messages;
eager evaluation. Planning is pure bookkeeping done once per (treedef, shapes, dtypes,
layouts); a call then costs a dict lookup, local slicing, ``f`` itself and exactly the
collectives the output specs imply.
"""

from __future__ import annotations

import collections
import enum
import functools
import math

import optree
import torch

from . import (
    _buckets,
    _checks,
    _compile,
    _counts,
    _debug,
    _mesh,
    _no_sync_graph,
    _shapes,
    _spec,
    _stages,
    _static,
    _traced_order,
    _vma,
)
from ._buckets import DEFAULT_BUCKET_MB, _ScaleCotangent
from ._checks import problems_report as _report
from ._errors import ArgumentError, FshardError, SpecError
from ._layout import Layout, bind
from ._mesh import Mesh
from ._out_shapes import agree
from ._primitives import AllReduce, LocalSlice, ReduceScatter, _functorch_active
from ._primitives import apply as _apply
from ._sharded import Sharded, _tiling, from_dtensor, relayout
from ._spec import ANONYMOUS, Spec, parse_spec

__all__ = ["shard_map"]

_Tensor = torch.Tensor

PLAN_CACHE_SIZE = 256
"""Plans kept per shard_map'd function for each of inputs and outputs (least recently used
dropped first): a function called with many distinct shapes does not grow without bound."""


# == API ==================================================================================


def shard_map(
    f=None,
    /,
    *,
    mesh: Mesh,
    in_specs,
    out_specs,
    check: bool = True,
    bucket_mb: float | None = DEFAULT_BUCKET_MB,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
):
    """Run ``f`` once per rank on the local blocks of its inputs, as one global function.

    Args:
        f: the per-shard function. It receives plain local ``torch.Tensor`` blocks (non-tensor
            leaves pass through) and may call the named-axis collectives (``fs.psum``, ...).
            Omit it to use ``shard_map`` as a decorator.
        mesh: the `Mesh`.
        in_specs: a pytree prefix of the positional arguments: one spec per argument,
            or one spec for a whole subtree (a dict of parameters). A spec is einops-style
            text such as ``"(dp b) s (tp d)"``; ``"..."`` (or None) means replicated.
            Non-tensor leaves (ints, floats, strings) pass through whatever their spec.
        out_specs: a pytree prefix of ``f``'s output. A spec may end in ``| sum(axes)`` to
            mark an unreduced partial sum, reduced on the way out (an all-reduce, or a
            reduce-scatter when the summed axis also splits a dim).
        check: check that each output is invariant over every mesh axis its out_spec
            does not mention, and varies over every axis its ``| sum(...)`` names (a value that
            is the same on every rank of ``y`` is no partial sum over ``y``: summing its copies
            would multiply it by ``y``'s size); before the outputs' communication, identically on
            every rank. ``check=False`` sums a partial-sum output's copies as they are (``y``'s
            size times the value, each rank's copy taken as one term), and takes an output
            varying over an axis its out_spec replicates to be the same on every rank of those axes
            (its value is this rank's) and, as JAX's ``check_vma=False``, divides its
            gradient by the product of the sizes of the axes it is tracked as varying over
            but its out_spec replicates: each rank's copy sends its cotangent back through
            ``f``, and the replicated inputs' gradients sum the copies, so without the
            division they would be that product times too large. Outputs that tracking proves
            replicated are untouched. A value that in fact differs across those ranks gets
            the mean of its ranks' gradient contributions.
        bucket_mb: the gradient all-reduces of inputs that are replicated over an axis and
            meet data varying over it (data parallel) are grouped into flat buckets of at most
            this many MiB, launched together once the backward through ``f`` is done, instead
            of one blocking all-reduce per input. ``None`` or ``0``: one per input, as the
            backward reaches it. Values and gradients are the same either way. Under
            `fs.no_sync` the reductions of leaf inputs are deferred to the next call outside it.
        compute_dtype: mixed precision, as FSDP2's ``param_dtype``: every floating-point input
            block is cast to this dtype before ``f`` (parameters stay in their own dtype; their
            gradients come back in it).
        reduce_dtype: the dtype of the gradient all-reduces of the inputs (default: each
            input's own dtype, e.g. float32 gradients for float32 parameters under a bfloat16
            ``compute_dtype``), bucketed or not, eager or compiled.

    Returns:
        The global function. A plain tensor argument is the global value (the same on
        every rank) and is sliced locally; a `Sharded` argument is used as is, or
        re-laid-out if its layout differs. Outputs whose spec splits a dim are
        `Sharded`; others are plain tensors, the same on every rank.

    Raises:
        SpecError: for bad specs, shapes or pytrees, naming each argument's key path.

    Examples:
        >>> mesh = fs.Mesh(dp=2, tp=2)
        >>> @fs.shard_map(mesh=mesh, in_specs=("(dp b) (tp k)", "(tp k) n"), out_specs="(dp b) n")
        ... def matmul(x, w):
        ...     return fs.psum(x @ w, "tp")
        >>> y = matmul(torch.randn(8, 6), torch.randn(6, 5))   # Sharded, global shape (8, 5)
    """
    if f is None:
        return functools.partial(
            shard_map,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check=check,
            bucket_mb=bucket_mb,
            compute_dtype=compute_dtype,
            reduce_dtype=reduce_dtype,
        )
    if not isinstance(mesh, Mesh):
        raise ArgumentError(f"fs.shard_map: mesh must be an fs.Mesh, got {type(mesh).__name__}")
    return _ShardMapped(f, mesh, in_specs, out_specs, check, bucket_mb, compute_dtype, reduce_dtype)


class InKind(enum.Enum):
    """How an input leaf becomes its local block."""

    PASS = "pass"  # not a tensor: passed through
    GLOBAL = "global"  # a plain tensor holding the global value: sliced locally
    SHARDED = "sharded"  # a Sharded value in the wanted layout: its local block
    RESHARD = "reshard"  # a Sharded value in another layout: moved first
    PER_RANK = "per_rank"  # a leaf of an fs.PerRank value: this rank's own, sliced like GLOBAL (_stages)


class OutKind(enum.Enum):
    """What an output leaf becomes."""

    PASS = "pass"  # not a tensor: returned as is
    PLAIN = "plain"  # a plain tensor, the same on every rank
    SHARDED = "sharded"  # a Sharded value


_LOCALIZE = {InKind.PASS: 0, InKind.GLOBAL: 1, InKind.PER_RANK: 1, InKind.SHARDED: 2, InKind.RESHARD: 3}


class _InPlan:
    """How to turn one input leaf into its local block."""

    __slots__ = ("kind", "code", "layout", "bits", "slices", "groups", "path")

    def __init__(self, kind: InKind, layout=None, bits=0, slices=(), groups=(), path=""):
        self.kind = kind
        # what _localize does, as an int: a compiled call reads its plan as a constant, and Dynamo
        # guards an enum read from it by identity, through a name its guards cannot see (_static)
        self.code = _LOCALIZE[kind]  # (PER_RANK, set later by _stages, is sliced as GLOBAL)
        self.layout = layout
        self.bits = bits
        self.path = path
        self.slices = slices  # ((dim, start, length), ...)
        self.groups = groups  # ((dim, AxisGroup, tiled), ...) for differentiable slicing


class _OutPlan:
    __slots__ = ("kind", "layout", "allowed", "summed", "reduce", "scatter", "path", "spec", "uneven")

    def __init__(self, kind: OutKind, layout=None, allowed=0, reduce=None, scatter=(), path="", spec=""):
        self.kind = kind
        self.layout = layout
        self.allowed = allowed  # vma bits the value may vary over
        self.summed: tuple[str, ...] = ()  # the axes of its '| sum(...)': it must vary over them
        self.reduce = reduce  # AxisGroup for an all-reduce of partial axes, or None
        self.scatter = scatter  # ((dim, AxisGroup, tiled), ...) reduce-scatters
        self.path = path
        self.spec = spec
        self.uneven = False  # a reduce-scatter into uneven blocks


class _ShardMapped(_static.Fixed):
    def __init__(
        self,
        f,
        mesh,
        in_specs,
        out_specs,
        check,
        bucket_mb=DEFAULT_BUCKET_MB,
        compute_dtype=None,
        reduce_dtype=None,
    ):
        functools.update_wrapper(self, f, updated=())
        self.f = f
        self._mesh = mesh
        self._mesh_text = mesh._text
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.check = check
        self.name = getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or repr(f)
        self._in_plans: collections.OrderedDict = collections.OrderedDict()
        self._out_plans: collections.OrderedDict = collections.OrderedDict()
        self._tracked = mesh.tracked  # any axis of size > 1: varying-axes tracking on
        self._bucket_mb = bucket_mb or 0.0
        self._compute_dtype = compute_dtype
        self._reduce_dtype = reduce_dtype
        self._all_bits = mesh.bits(mesh.axis_names)
        self._out_specs_checked = False
        self._per_rank: dict = {}  # treedef -> the treedef f sees (fs.PerRank values unwrapped, _stages)
        self._id = _static.register(self)  # by which compiled calls plan at trace time (_static)

    @property
    def mesh(self) -> Mesh:
        """The mesh; while compiling, read through a global (`_mesh.by_text`) so that Dynamo
        specializes its sizes and coordinates."""
        return _mesh.by_text(self._mesh_text) if _compile.compiling() else self._mesh

    def __repr__(self) -> str:
        return f"shard_map({self.name}, mesh={self.mesh!r})"

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise ArgumentError(
                f"fs.shard_map({self.name}) takes positional arguments only (in_specs matches them "
                f"by position); got keyword arguments {sorted(kwargs)}"
            )
        outer = _vma.active()
        if outer is not None:
            raise FshardError(
                f"fs.shard_map({self.name}) was called inside fs.shard_map({outer.where}); "
                f"nested shard_map is not supported: call the inner function's body directly on the "
                f"local tensors, using collectives for communication"
            )
        leaves, treedef = optree.tree_flatten(args)
        compiling = _compile.compiling()
        defer = None
        if compiling:  # planned at trace time, each time Dynamo traces (its guards are the cache)
            defer = _no_sync_graph.mode()  # fs.no_sync: a guard of the graph
            _compile.check_call(self.name, _counts.counting_refused())
            key = None
            hit = _static.input_plan(self, leaves, treedef)  # the eager planning, a constant (_static)
        else:
            key = (treedef, *[(x.shape, x.dtype) if type(x) is _Tensor else _leaf_key(x) for x in leaves])
            hit = self._in_plans.get(key)
        if hit is None:
            if any(_is_dtensor(x) for x in leaves):  # DTensor in: as fs.from_dtensor
                leaves = [from_dtensor(x) if _is_dtensor(x) else x for x in leaves]
                args = optree.tree_unflatten(treedef, leaves)
                return self(*args)
            hit = self._plan_hit(args, leaves, treedef)
            if not compiling:
                _remember(self._in_plans, key, hit)
        elif not compiling and len(self._in_plans) > 8:  # keep the LRU order once there are several plans
            self._in_plans.move_to_end(key)
        plans, global_idx, masks, label_sizes, uneven = hit
        if compiling:
            if uneven:
                _compile.refuse(
                    f"fs.shard_map({self.name}) with uneven blocks (a dim not divisible by its mesh axes)",
                    "pad the inputs to a multiple of the mesh axes' sizes, or call it eagerly",
                )
            # (no flag for Dynamo to guard on: checked at each trace, as a constant where it can be)
            if self._id is None:
                self._precheck_out_specs()
            else:
                _static.precheck_out_specs(self._id)
        elif not self._out_specs_checked:
            self._precheck_out_specs()
        mesh = self.mesh
        if _debug.enabled:
            _debug.check_inputs(self.name, mesh, leaves, plans, InKind.GLOBAL)
            _stages.debug_check_inputs(self.name, mesh, args, leaves, plans, InKind.PER_RANK)
        # (compiled: Dynamo cannot read _version; in-place updates of global inputs go unchecked)
        versions = [] if compiling else [leaves[i]._version for i in global_idx]
        if compiling:  # the collectives traced from here on, compared with the other ranks' at the end
            _traced_order.begin()
        tr = _vma.Trace(mesh, self.name)
        tr.uneven = uneven
        local_treedef = treedef
        if compiling:
            if _stages.has_per_rank(args):  # fs.PerRank arguments (_stages): f sees their trees
                tr.shapes_differ, local_treedef = True, _stages.local_treedef(args)
        elif self._per_rank:
            tr.shapes_differ = treedef in self._per_rank
            local_treedef = self._per_rank.get(treedef, treedef)
        # (compiled: no buckets, also for fs.value_and_grad inside f; one all-reduce per input)
        tr.bucket_mb = self._bucket_mb if self._tracked and not compiling else 0.0
        local = [_localize(x, p, tr, mesh) for x, p in zip(leaves, plans)]
        if not tr.bucket_mb and not compiling and torch.is_grad_enabled():  # (named in the casts' tags)
            tr.inputs = {
                id(x): p.path for x, p in zip(local, plans) if type(x) is _Tensor and x.requires_grad
            }
            # without buckets, fs.no_sync keeps the parameters' gradients pending as compiled calls do
            defer = None if _functorch_active() else _no_sync_graph.mode()
        deferred = _defer_leaves(self.name, defer, leaves, plans, local, tr) if defer else None
        if self._compute_dtype is not None or (
            self._bucket_mb
            and self._tracked
            and torch.is_grad_enabled()
            and any(isinstance(x, _Tensor) and x.requires_grad for x in local)
            and not _functorch_active()
            and not compiling  # compiled: one all-reduce per input, as the backward reaches it
        ):
            # bucketed gradient reductions and compute_dtype casts for the inputs (_buckets.wrap)
            casts = (self._compute_dtype, self._reduce_dtype, lambda i: plans[i].path)  # (+ key paths)
            local = _buckets.wrap(local, masks, tr, self._all_bits, tr.bucket_mb, *casts)
        _shapes.set_inputs(leaves, plans, local, tr)  # uneven blocks: their shapes at every position
        local_args = optree.tree_unflatten(local_treedef, local)
        with tr:
            out = self.f(*local_args)
        if deferred:
            _no_sync_graph.check_used(deferred)
        if versions:
            _checks.check_unmodified(self.name, leaves, plans, global_idx, versions, tr)
        out_leaves, out_treedef = optree.tree_flatten(out)
        okey = (
            None
            if compiling
            else (
                out_treedef,
                *[(x.shape, x.dtype) if type(x) is _Tensor else _leaf_key(x) for x in out_leaves],
            )
        )
        if _debug.enabled:
            _stages.debug_check_outputs(self.name, mesh, out, uneven)  # + PerRank
        ohit = None if compiling else self._out_plans.get(okey)
        if ohit is None:
            oplans = self._plan_outputs(out, out_leaves, out_treedef)
            ohit = (oplans, any(p.uneven for p in oplans))  # (plans, some output scattered unevenly)
            if not compiling:
                _remember(self._out_plans, okey, ohit)
        elif len(self._out_plans) > 8:
            self._out_plans.move_to_end(okey)
        oplans, out_uneven = ohit
        if self._tracked:
            if self.check:
                _checks.check_outputs(self.name, mesh, out_leaves, oplans, tr, OutKind.PASS)
            elif torch.is_grad_enabled():
                out_leaves = _scale_unchecked(out_leaves, oplans, tr)
            if torch.is_grad_enabled():
                # An output invariant over an axis its spec splits (or, under check=False, sums
                # over) holds one copy per index: cast it to varying so its gradient sums over them.
                out_leaves = [_vary_out(x, p, tr) for x, p in zip(out_leaves, oplans)]
        shapes = None
        if tr.uneven or out_uneven:  # (tr.uneven: also set by f's own collectives)
            split = [i for i, p in enumerate(oplans) if p.kind is OutKind.SHARDED]
            if split:  # every rank's blocks checked alike, before the outputs' collectives
                per_rank = _stages.per_rank_leaves(out)
                shapes = agree(
                    self.name, mesh, out_leaves, oplans, split, label_sizes, tr.ragged, per_rank, tr.uneven
                )
        done = [_finish(x, p, mesh) for x, p in zip(out_leaves, oplans)]
        if shapes:
            for i, shape in shapes.items():
                done[i]._shape = shape
        if compiling:
            _traced_order.agree(self.name, self._mesh_text)
        return optree.tree_unflatten(out_treedef, done)

    # == planning ===========================================================================

    def _plan_hit(self, args, leaves, treedef) -> tuple:
        """The plan of a call: ``(plans, indices of the global inputs, varying bits per leaf,
        global size of each dim label, whether some input has uneven blocks)``."""
        plans, sizes = self._plan_inputs(args, leaves, treedef)
        uneven = any(
            p.kind is not InKind.PASS and not p.layout.is_even(x.shape, self.mesh.shape)
            for x, p in zip(leaves, plans)
        )
        return (
            plans,
            tuple(i for i, p in enumerate(plans) if p.kind is InKind.GLOBAL),
            [p.bits for p in plans],  # varying axes of each block (0 for non-tensors)
            sizes,  # the global size of each dim label
            uneven,  # some input has uneven blocks
        )

    def _plan_inputs(self, args, leaves, treedef):
        mesh = self.mesh
        specs, paths, shared = _broadcast_specs(self.in_specs, args, "in_specs", self.name, "args")
        problems: list[str] = []
        plans = []
        label_sizes: dict[str, tuple[int, str]] = {}
        for x, spec, path, template in zip(leaves, specs, paths, shared):
            if not isinstance(x, (_Tensor, Sharded)):
                plans.append(_InPlan(InKind.PASS))
                continue
            shape = tuple(x.shape)
            try:
                layout, probs = _bind(spec, mesh, len(shape))
            except SpecError as e:
                problems.append(f"{path}: {_indent(str(e))}")
                plans.append(None)
                continue
            if layout is None:
                problems += [f"{path} (shape {shape}) with spec {str(spec)!r}: {p}" for p in probs]
                plans.append(None)
                continue
            if layout.partial:
                problems.append(
                    f"{path} (shape {shape}) with spec {str(spec)!r}: a partial-sum spec (| sum(...)) is only valid in "
                    f"out_specs; pass the reduced value instead"
                )
            for i, lab in enumerate(layout.labels):
                if lab is None or lab == ANONYMOUS or template:
                    continue
                seen = label_sizes.setdefault(lab, (shape[i], path))
                if seen[0] != shape[i]:
                    problems.append(
                        f"dim {lab!r} has size {seen[0]} in {seen[1]} but size {shape[i]} in {path} "
                        f"(spec {str(spec)!r}, shape {shape}); a label names one logical dim, so its "
                        f"global size must agree everywhere; rename one of them, or write _ for a dim "
                        f"that should not tie"
                    )
            if isinstance(x, Sharded) and x.mesh != mesh:
                problems.append(
                    f"{path} is a Sharded value on {x.mesh!r}, not on this shard_map's mesh "
                    f"{mesh!r}; move it with fs.shard(value.full(), mesh, spec)"
                )
            plans.append(self._in_plan(x, layout, path))
        per_rank = _stages.per_rank_leaves(args)
        if per_rank:  # leaves of fs.PerRank values: this rank's own, varying over their axes
            problems += _stages.mark_inputs(plans, per_rank, specs, paths, mesh, InKind)
            if not _compile.compiling():  # (compiled: worked out at each trace, see __call__)
                self._per_rank[treedef] = _stages.local_treedef(args)
        if problems:
            raise SpecError(_report(self.name, "in_specs", problems))
        return plans, {lab: size for lab, (size, _) in label_sizes.items()}

    def _in_plan(self, x, layout: Layout, path: str) -> _InPlan:
        mesh = self.mesh
        bits = mesh.bits(layout.split_axes)
        if isinstance(x, Sharded):
            if x.layout.dims == layout.dims:
                return _InPlan(InKind.SHARDED, layout, bits, path=path)
            return _InPlan(InKind.RESHARD, layout, bits, path=path)
        block = layout.block(x.shape, mesh.shape, mesh.coordinate)
        slices = tuple((d, *block[d]) for d, axes in enumerate(layout.dims) if axes)
        groups = tuple(
            (d, mesh.axis_group(axes), _tiling(layout.block_sizes(d, x.shape[d], mesh.shape)))
            for d, axes in enumerate(layout.dims)
            if axes
        )
        return _InPlan(InKind.GLOBAL, layout, bits, slices, groups, path)

    def _precheck_out_specs(self):
        """Problems of out_specs that do not depend on f's outputs, found before f runs."""
        is_spec = lambda s: isinstance(s, (str, Spec))  # noqa: E731
        accessors, specs, _ = optree.tree_flatten_with_accessor(self.out_specs, is_leaf=is_spec)
        problems = []
        for acc, spec in zip(accessors, specs):
            path = acc.codify("out_specs")
            try:
                parsed = parse_spec(spec)
            except SpecError as e:
                problems.append(f"{path}: {_indent(str(e))}")
                continue
            ndim = sum(1 for d in parsed.dims if not d.ellipsis)
            _, probs = _bind(parsed, self.mesh, ndim)
            problems += [f"{path} {str(spec)!r}: {p}" for p in probs]
        if problems:
            raise SpecError(_report(self.name, "out_specs", problems))
        if not _compile.compiling():
            self._out_specs_checked = True

    def _plan_outputs(self, out, leaves, treedef):
        mesh = self.mesh
        specs, paths, _ = _broadcast_specs(self.out_specs, out, "out_specs", self.name, "out")
        problems: list[str] = []
        plans = []
        for x, spec, path in zip(leaves, specs, paths):
            if not isinstance(x, _Tensor):
                if isinstance(x, Sharded):
                    problems.append(f"{path}: f returned a Sharded value; return local tensors from f")
                plans.append(_OutPlan(OutKind.PASS))
                continue
            shape = tuple(x.shape)
            try:
                layout, probs = _bind(spec, mesh, len(shape))
            except SpecError as e:
                problems.append(f"{path}: {_indent(str(e))}")
                plans.append(None)
                continue
            if layout is None:
                problems += [f"{path} (local shape {shape}) with spec {str(spec)!r}: {p}" for p in probs]
                plans.append(None)
                continue
            scatter = []
            for d, sc in layout.scatter_dims:  # the local dim is cut as torch.chunk cuts it
                scatter.append(
                    (d, mesh.axis_group(sc), _tiling(layout.block_sizes(d, shape[d], mesh.shape, sc)))
                )
            reduce = mesh.axis_group(layout.reduce_axes) if layout.reduce_axes else None
            allowed = mesh.bits(layout.split_axes + layout.partial)
            kind = OutKind.SHARDED if layout.is_split else OutKind.PLAIN
            plan = _OutPlan(kind, layout.reduced(), allowed, reduce, tuple(scatter), path, str(spec))
            plan.uneven = any(t is not True for _, _, t in scatter)
            plan.summed = layout.partial
            plans.append(plan)
        per_rank = _stages.per_rank_leaves(out)
        if per_rank:  # leaves of fs.PerRank outputs: they may vary over its axes, returned as they are
            problems += _stages.mark_outputs(plans, per_rank, specs, paths, mesh, OutKind)
        if problems:
            raise SpecError(_report(self.name, "out_specs", problems))
        return plans


# == eager evaluation =====================================================================


_compile.allow_cached(bind, _spec._parse_cached)  # pure: Dynamo traces them without their cache


def _remember(cache: collections.OrderedDict, key, value) -> None:
    cache[key] = value
    if len(cache) > PLAN_CACHE_SIZE:
        cache.popitem(last=False)


_DTensor = None


def _is_dtensor(x) -> bool:
    global _DTensor
    if not isinstance(x, _Tensor) or type(x) is _Tensor:
        return False
    if _DTensor is None:
        from torch.distributed.tensor import DTensor

        _DTensor = DTensor
    return isinstance(x, _DTensor)


def _leaf_key(x):
    if isinstance(x, _Tensor):
        return ("D", x.shape, x.dtype) if _is_dtensor(x) else (x.shape, x.dtype)
    if isinstance(x, Sharded):
        return ("S", x.shape, x.local.shape, x.dtype, x.layout, x.mesh)
    return type(x)


def _localize(x, p: _InPlan, tr, mesh):
    code = p.code  # (not p.kind: see _InPlan)
    if code == 0:  # PASS
        return x
    if code == 1:  # GLOBAL, PER_RANK
        if p.slices:
            if torch.is_grad_enabled() and _vma.may_need_grad(x):  # (also a tangent that needs one)
                for d, g, tiled in p.groups:
                    x = _apply(LocalSlice, x, g, d, tiled)
            else:
                for d, start, n in p.slices:
                    x = x.narrow(d, start, n)
    elif code == 2:  # SHARDED
        x = x.local
    else:  # RESHARD
        b = p.layout
        if _compile.compiling():  # a layout made in traced code: Dynamo cannot call the methods
            b = Layout(b.dims, b.labels, b.partial)  # of one in a plan made at trace time (_static)
        x = relayout(x.local, mesh, x.layout, b, x.shape)
    if code < 3 and not (code == 1 and p.slices) and _compile.compiling():
        # compiled: f gets an alias of the input, so that nothing in f guards on the input's
        # identity (the casts are cached by id: Dynamo guards on the id of a graph input, and a
        # step given new parameter tensors each call, as fs.optim returns them, recompiled)
        x = x.view_as(x)
    if p.bits:
        _vma.tag(x, tr, p.bits)
    return x


def _defer_leaves(name: str, mode: str, leaves, plans, local, tr) -> list:
    """Compiled or without gradient buckets, under fs.no_sync or with gradients pending: the leaf
    inputs (parameters, each whole in f) whose casts keep or take their pending gradients
    (`_no_sync_graph`)."""
    if not torch.is_grad_enabled():
        return []
    out = []
    if tr.inputs is None:
        tr.inputs = {}
    for x, p, y in zip(leaves, plans, local):
        if p.code == 2:  # an fs.Sharded input in its layout: its local block may be a parameter
            x = x.local
        elif p.code != 1 or p.slices:
            continue
        if type(x) is _Tensor and x.is_leaf and x.requires_grad:
            d = _no_sync_graph.Deferred(x, p.path, mode, name, tr.mesh)
            tr.inputs[id(y)] = d
            out.append(d)
    return out


def _vary_out(x, p: _OutPlan, tr):
    if p.kind is OutKind.PASS or not p.allowed or not _vma.may_need_grad(x):
        return x
    v = _vma.get(x, tr)
    if p.allowed & ~v:
        return _vma.pvary(x, tr, v, v | p.allowed)
    return x


def _scale_unchecked(leaves: list, plans, tr) -> list:
    """Under ``check=False``: divide the cotangent of each output tracked as varying over axes its
    out_spec says it is replicated over by the product of their sizes (JAX's ``check_vma=False``
    rule, restricted to the axes tracking cannot prove invariant).

    Such an output is taken to be the same on every rank of those axes; each of the N copies
    then sends its cotangent back through ``f``, and the transposes sum the N contributions into
    the replicated inputs: N times the true gradient without the division.
    """
    out = None
    sizes = tr.mesh.shape
    for i, (x, p) in enumerate(zip(leaves, plans)):
        if p.kind is OutKind.PASS or not _vma.may_need_grad(x):
            continue
        v = _vma.get(x, tr)
        extra = v & ~p.allowed
        if extra:
            if out is None:
                out = list(leaves)
            n = math.prod([sizes[a] for a in tr.mesh.names_of(extra)])
            out[i] = _vma.tag(_apply(_ScaleCotangent, x, 1.0 / n), tr, v)
    return leaves if out is None else out


def _finish(x, p: _OutPlan, mesh):
    kind = p.kind
    if kind is OutKind.PASS:
        return x
    if p.reduce is not None:
        x = _apply(AllReduce, x, p.reduce)
    for d, g, tiled in p.scatter:
        x = _apply(ReduceScatter, x, g, d, tiled)
    if kind is OutKind.PLAIN:
        return x
    return Sharded._wrap(x, mesh, p.layout)


# == helpers ==============================================================================


def _bind(spec, mesh: Mesh, ndim: int):
    if not isinstance(spec, (str, Spec)):
        raise SpecError(f'a spec must be a string like "(dp b) d", got {type(spec).__name__}: {spec!r}')
    return bind(spec, tuple(mesh.shape.items()), ndim)  # bind is lru_cached


def _broadcast_specs(specs, tree, what, name, root):
    """Broadcast a spec prefix tree over ``tree``.

    Returns (spec per leaf, key path per leaf, whether that spec also covers other leaves).
    A spec that covers several leaves is a template: its labels are not tied across them.
    """
    accessors, _, _ = optree.tree_flatten_with_accessor(tree)
    paths = [a.codify(root) for a in accessors]
    if specs is None:
        specs = "..."
    if isinstance(specs, (str, Spec)):
        return [specs] * len(paths), paths, [len(paths) > 1] * len(paths)
    if root == "args" and isinstance(specs, list):
        specs = tuple(specs)
    # None as a spec means replicated ("..."), as P() does in JAX.
    specs = optree.tree_map(lambda s: "..." if s is None else s, specs, none_is_leaf=True)
    is_spec = lambda s: isinstance(s, (str, Spec))  # noqa: E731
    spec_leaves, spec_def = optree.tree_flatten(specs, is_leaf=is_spec)
    index_tree = optree.tree_unflatten(spec_def, list(range(len(spec_leaves))))
    try:
        which = optree.broadcast_prefix(index_tree, tree)
    except ValueError as e:
        where = "arguments" if root == "args" else "outputs"
        why = _mismatch(specs, tree, what, root) or str(e).split("\n")[0][:300]
        fix = (
            "give one spec per positional argument (a tuple), or one spec for a whole subtree"
            if root == "args"
            else "give one spec per output, or one spec for a whole subtree"
        )
        raise SpecError(
            f"fs.shard_map({name}): {what} does not match the structure of the {where}: {why}\nfix: {fix}"
        ) from None
    uses: dict[int, int] = {}
    for k in which:
        uses[k] = uses.get(k, 0) + 1
    return [spec_leaves[k] for k in which], paths, [uses[k] > 1 for k in which]


def _describe(x) -> str:
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)}"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    if isinstance(x, (torch.Tensor, Sharded)):
        return f"a {type(x).__name__} of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def _mismatch(specs, tree, spath: str, tpath: str) -> str | None:
    """The first place where a spec prefix tree and a value tree part ways, in words."""
    if isinstance(specs, (str, Spec)):
        return None
    if isinstance(specs, dict):
        if not isinstance(tree, dict):
            return f"{spath} is {_describe(specs)} but {tpath} is {_describe(tree)}"
        if set(specs) != set(tree):
            return f"{spath} has keys {sorted(map(str, specs))} but {tpath} has keys {sorted(map(str, tree))}"
        for k in specs:
            got = _mismatch(specs[k], tree[k], f"{spath}[{k!r}]", f"{tpath}[{k!r}]")
            if got:
                return got
        return None
    if isinstance(specs, (list, tuple)):
        if not isinstance(tree, (list, tuple)):
            return f"{spath} is {_describe(specs)} but {tpath} is {_describe(tree)}"
        if len(specs) != len(tree):
            if tpath == "args":
                return f"{spath} has {len(specs)} entries but f got {len(tree)} positional arguments"
            return f"{spath} has {len(specs)} entries but {tpath} has {len(tree)}"
        for i, (a, b) in enumerate(zip(specs, tree)):
            got = _mismatch(a, b, f"{spath}[{i}]", f"{tpath}[{i}]")
            if got:
                return got
        return None
    return None


def _indent(text: str) -> str:
    return text.replace("\n", "\n    ")
