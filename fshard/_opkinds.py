"""How the varying-axes mode treats each torch op: the plain rule, the in-place rule, or a handler.

Pure tables and functions of the op (no trace, no tensors): ``_vma.VmaMode`` asks `_kind_of` once
per op and caches the answer; under ``torch.compile`` the answer is a trace-time constant.
"""

from __future__ import annotations

import torch

from ._dynamo_hooks import VIEW_ATTRS

_Tensor = torch.Tensor

_PLAIN = object()
_INPLACE = object()
_INPLACE_DUNDERS = frozenset(
    "__setitem__ __iadd__ __isub__ __imul__ __itruediv__ __ifloordiv__ __imod__ __ipow__ "
    "__iand__ __ior__ __ixor__ __ilshift__ __irshift__ __imatmul__".split()
)


@torch._dynamo.assume_constant_result  # under torch.compile: decided at trace time, as a constant
def _kind_of(func):
    """`_classify`'s answer as a constant Dynamo can hold: the plain or in-place rule, or the name
    of a handler in `_HANDLERS` (a function taken as a trace-time constant could not be guarded)."""
    special = {
        torch.autograd.grad: "_autograd_grad",
        _Tensor.__int__: "_refuse_varying",
        _Tensor.__index__: "_refuse_varying",
        _Tensor.__float__: "_refuse_varying",
        _Tensor.item: "_to_python",
        _Tensor.tolist: "_to_python",
        _Tensor.__bool__: "_refuse_varying",
        _Tensor.numpy: "_refuse_varying",
        _Tensor.__iter__: "_iterate",
        _Tensor.shape.__get__: "_shape",  # type: ignore[attr-defined]
        _Tensor.size: "_shape",
        _Tensor.numel: "_shape",
        _Tensor.nelement: "_shape",
        _Tensor.__len__: "_length",
    }.get(func)
    if special is not None:
        return special
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") == "__get__" and getattr(owner, "__name__", "") in VIEW_ATTRS:
        if getattr(owner, "__objclass__", None) is torch._C.TensorBase:
            return "_view_attr"
    if func in _data_dependent_ops():
        return "_data_dependent"
    name = getattr(func, "__name__", "")
    if name == "tag_activation_checkpoint":  # fs.remat's region, compiled: tracked inside (_remat)
        return "_as_is"
    if name in _RANDOM_OPS:
        return "_random"
    if name.startswith("_foreach_"):
        return "_foreach"
    if name in _INPLACE_DUNDERS or (
        name.endswith("_") and not name.startswith("_") and name != "requires_grad_"
    ):
        return _INPLACE
    return _PLAIN


def _data_dependent_ops() -> frozenset:
    """The ops whose output shape may depend on the values of their operands."""
    T = _Tensor
    return frozenset(
        (
            T.__getitem__,  # with a boolean mask
            torch.masked_select,
            T.masked_select,
            torch.nonzero,
            T.nonzero,
            torch.argwhere,
            T.argwhere,
            torch.unique,
            T.unique,
            torch.unique_consecutive,
            T.unique_consecutive,
            torch.where,  # with one argument
            torch.repeat_interleave,  # with tensor repeats
            T.repeat_interleave,
        )
    )


# -- draws from random number generators ------------------------------------------------------

# Ops that draw random numbers, by name (torch functions, Tensor methods, torch.nn.functional and
# torch.nn.init functions alike).
_RANDOM_OPS = frozenset(
    "rand randn rand_like randn_like randint randint_like randperm bernoulli bernoulli_ multinomial "
    "normal normal_ uniform_ random_ exponential_ geometric_ log_normal_ cauchy_ poisson binomial "
    "_standard_gamma _sample_dirichlet gumbel_softmax trunc_normal_ xavier_uniform_ xavier_normal_ "
    "kaiming_uniform_ kaiming_normal_ orthogonal_ sparse_ dropout dropout1d dropout2d dropout3d "
    "alpha_dropout feature_alpha_dropout feature_dropout native_dropout rrelu rrelu_ dropout_ "
    "alpha_dropout_ feature_dropout_ feature_alpha_dropout_".split()
)
# Ops that draw only in training: name -> (position of the training flag, its default, position
# of the inplace flag or None); a dropout's p is its second argument (p == 0 keeps everything).
_TRAINING = {
    "dropout": (2, True, 3),
    "dropout1d": (2, True, 3),
    "dropout2d": (2, True, 3),
    "dropout3d": (2, True, 3),
    "alpha_dropout": (2, False, 3),
    "feature_alpha_dropout": (2, False, 3),
    "feature_dropout": (2, False, None),
    "native_dropout": (2, False, None),
    "dropout_": (2, False, None),
    "alpha_dropout_": (2, False, None),
    "feature_dropout_": (2, False, None),
    "feature_alpha_dropout_": (2, False, None),
    "rrelu": (3, False, 4),
    "rrelu_": (3, False, None),
}


@torch._dynamo.assume_constant_result  # under torch.compile: a trace-time constant
def _random_rule(func) -> tuple:
    """What `_vma._random` needs of a random op, as constants Dynamo can hold (it cannot trace
    string methods on a traced function's name): ``(name, label, training rule or None, whether
    it writes its first argument (a name ending in "_"), whether it always draws (rrelu))``."""
    name = getattr(func, "__name__", "")
    mod = getattr(func, "__module__", None)
    label = f"{mod}.{name}" if mod else f"Tensor.{name}"
    return name, label, _TRAINING.get(name), name.endswith("_"), name.startswith("rrelu")


def _draws(rule, always: bool, args, kwargs) -> bool:
    """Whether a dropout-like op draws: it is training and its p is not 0 (``rule``, ``always``:
    `_random_rule`'s)."""
    if rule is None:
        return True
    pos, default, _ = rule
    if "training" in kwargs or "train" in kwargs:
        training = kwargs.get("training", kwargs.get("train"))
    else:
        training = args[pos] if len(args) > pos else default
    if not training:
        return False
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    return always or p != 0
