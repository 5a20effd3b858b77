"""The exception hierarchy: one root, a subclass per kind of mistake users catch."""

from __future__ import annotations

__all__ = [
    "FshardError",
    "SpecError",
    "MeshError",
    "CollectiveError",
    "ArgumentError",
    "CheckpointError",
    "TracingError",
    "RankError",
]


class FshardError(RuntimeError):
    """Root of every error fshard raises on purpose."""


class SpecError(FshardError, ValueError):
    """A partition spec is malformed or does not fit the value or the mesh it is used with."""


class MeshError(FshardError):
    """A mesh cannot be built, or does not fit the process group it lives on."""


class CollectiveError(FshardError):
    """A collective was called where it cannot run (outside shard_map, unknown axis, bad arguments)."""


class TracingError(FshardError):
    """A value that varies across ranks is used inside shard_map where fshard cannot track it (an
    in-place write it cannot differentiate, a Python branch on it in a compiled call)."""


class ArgumentError(FshardError, TypeError):
    """An argument of the wrong type was passed to an fshard function (also a ``TypeError``)."""


class CheckpointError(FshardError, ValueError):
    """A checkpoint cannot be saved or loaded: bad tree, missing or mismatched keys, corrupt files."""


class RankError(FshardError):
    """A rank launched by fshard failed; carries the rank and its traceback.

    Attributes:
        rank: the rank that failed first.
        remote_traceback: the formatted traceback from that rank.
    """

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        return (type(self), (self.args[0], self.rank, self.remote_traceback))


# Public classes print as ``fshard.SpecError`` (how users import them), not the private module.
for _cls in (
    FshardError,
    SpecError,
    MeshError,
    CollectiveError,
    TracingError,
    ArgumentError,
    CheckpointError,
    RankError,
):
    _cls.__module__ = "fshard"
del _cls


def did_you_mean(name: str, choices) -> str:
    """`` (did you mean 'x'?)`` for the one closest choice, or ``""`` when none is close or two tie.

    A choice with the same letters (a transposition, ``pd`` for ``dp``) wins outright.
    """
    import difflib

    choices = list(choices)
    same = [c for c in choices if sorted(c) == sorted(name) and c != name]
    if len(same) == 1:
        return f" (did you mean {same[0]!r}?)"
    scored = sorted(((difflib.SequenceMatcher(None, name, c).ratio(), c) for c in choices), reverse=True)
    if not scored or scored[0][0] < 0.5 or (len(scored) > 1 and scored[1][0] == scored[0][0]):
        return ""
    return f" (did you mean {scored[0][1]!r}?)"


def report(head: str, problems) -> str:
    """The one shape of a multi-problem message: ``head:`` then one ``  - problem`` line each."""
    return head + ":\n" + "\n".join(f"  - {p}" for p in problems)


# gloo raises plain RuntimeErrors; these texts mark a failure caused by another rank.
_COMM_ERROR_MARKERS = (
    "gloo/transport/",
    "Connection closed by peer",
    "Connection reset by peer",
    "pair closure",  # "Application timeout caused pair closure": a peer's timeout closed this pair
    "Broken pipe",
    "Socket Timeout",
    "Timed out waiting",
)


def is_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) looks like a consequence of another
    rank failing, rather than a root cause."""
    current: BaseException | None = exc
    seen = 0
    while current is not None and seen < 10:
        if any(c.__name__ == "DistError" for c in type(current).__mro__):  # torch.distributed.DistError
            return True
        text = str(current)
        if any(marker in text for marker in _COMM_ERROR_MARKERS):
            return True
        current = current.__cause__ or current.__context__
        seen += 1
    return False
