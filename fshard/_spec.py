"""Partition specs: einops-style text saying how each dim of a value is laid out on a mesh.

A spec names every dim of a value in order, like one side of an einops pattern::

    "b s d"              three unsplit dims labeled b, s and d
    "(dp b) s (tp d)"    dim 0 split over mesh axis dp, dim 2 over mesh axis tp
    "... d"              any number of unsplit leading dims, then d
    ""                   a scalar (no dims)
    "b n | sum(tp)"      an unreduced partial sum over mesh axis tp
    "(dp _) _"           anonymous dims: each ``_`` is its own unnamed dim

A label names one logical dim, so the binder and shard_map tie dims that share a label (the
same global size everywhere in one call). ``_`` is the anonymous label: it never ties, neither
with another ``_`` nor across specs, and renders back as ``_``. Other names may not start or end
with ``_`` (einops' rule).

Inside a group the mesh-axis names come first and the dim label last, but this
module does not know which names are mesh axes: it records the names of each dim
as written, and the binder decides later, against a mesh, what they mean (and
reports duplicate names with that context).

The parser is pure Python (no torch). Every malformed spec raises
`fshard._errors.SpecError` with a message that quotes the spec, puts a
caret under the offending column and suggests a fix::

    invalid spec "(dp b s": unbalanced parenthesis
      (dp b s
      ^
    fix: close the group with ")"

Examples:
    >>> spec = parse_spec("(dp b) s | sum(tp)")
    >>> spec.dims[0]
    Dim(names=('dp', 'b'), grouped=True, ellipsis=False)
    >>> spec.partial
    ('tp',)
    >>> str(spec)
    '(dp b) s | sum(tp)'
"""

from __future__ import annotations

import functools
import keyword
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NoReturn

from einops.parsing import ParsedExpression

from ._compile import compiling
from ._errors import SpecError

__all__ = ["Dim", "Spec", "parse_spec"]


@dataclass(frozen=True)
class Dim:
    """One dim of a spec, as written.

    Attributes:
        names: the names written for this dim, in order: ``("b",)`` for ``b``,
            ``("dp", "b")`` for ``(dp b)``, ``()`` for ``...``.
        grouped: the dim was written in parentheses (``(b)`` is grouped, ``b`` is not).
        ellipsis: this entry is ``...`` (any number of unsplit dims).

    Examples:
        >>> str(Dim(("dp", "b"), grouped=True))
        '(dp b)'
        >>> str(Dim((), ellipsis=True))
        '...'
    """

    names: tuple[str, ...]
    grouped: bool = False
    ellipsis: bool = False

    def __str__(self) -> str:
        if self.ellipsis:
            return "..."
        if self.grouped or len(self.names) != 1:
            return "(" + " ".join(self.names) + ")"
        return self.names[0]


@dataclass(frozen=True)
class Spec:
    """A parsed partition spec.

    Attributes:
        dims: one `Dim` per written dim entry, in order (``...`` is one entry).
        partial: the mesh axes named in a ``| sum(...)`` suffix, in written order;
            ``()`` when the value is not a partial sum.

    Examples:
        >>> spec = parse_spec("...  (tp d)|sum( dp )")
        >>> spec.has_ellipsis, spec.names(), spec.partial
        (True, ('tp', 'd'), ('dp',))
        >>> str(spec)
        '... (tp d) | sum(dp)'
    """

    dims: tuple[Dim, ...]
    partial: tuple[str, ...] = ()

    def __str__(self) -> str:
        """Canonical text: ``parse_spec(str(spec)) == spec``."""
        body = " ".join(str(dim) for dim in self.dims)
        if not self.partial:
            return body
        suffix = "| sum(" + " ".join(self.partial) + ")"
        return f"{body} {suffix}" if body else suffix

    @property
    def has_ellipsis(self) -> bool:
        """Whether one of the dims is ``...``.

        Examples:
            >>> parse_spec("... d").has_ellipsis
            True
        """
        return any(dim.ellipsis for dim in self.dims)

    def names(self) -> tuple[str, ...]:
        """All names written in the dims (not the partial-sum axes), flattened, in order.

        Examples:
            >>> parse_spec("(dp b) ... s | sum(tp)").names()
            ('dp', 'b', 's')
        """
        return tuple(name for dim in self.dims for name in dim.names)


def parse_spec(text: str | Spec) -> Spec:
    """Parse a partition spec; a `Spec` passes through unchanged.

    Results for strings are cached, so parsing the same spec again is cheap. A dim label
    names one logical dim (dims that share it must agree in size); ``_`` is the anonymous
    label, which never ties: ``"(dp _) _"`` splits the first of two unnamed dims over dp.

    Args:
        text: the spec text, e.g. ``"(dp b) s (tp d)"`` or ``"b n | sum(tp)"``.

    Returns:
        The parsed `Spec`.

    Raises:
        SpecError: ``text`` is not a string or not a valid spec; the message points
            at the offending column and suggests a fix.

    Examples:
        >>> parse_spec("(dp b) s").dims[0]
        Dim(names=('dp', 'b'), grouped=True, ellipsis=False)
        >>> parse_spec("") == Spec(())
        True
        >>> str(parse_spec("(dp _)  _"))
        '(dp _) _'
    """
    if isinstance(text, Spec):
        return text
    if not isinstance(text, str):
        shown = repr(text)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise SpecError(f"spec must be a string, got {type(text).__name__}: {shown}")
    return _parse_cached(str.__str__(text))


# ----------------------------------------------------------------------------------------------
# Implementation. einops' ParsedExpression reports no columns, accepts things fshard rejects
# ("1", "3", "()", "(...)", "…") and forgets whether a single name was parenthesized, so a small
# scanner does the positional work; einops' parser then confirms the dims part is a valid side of
# an einops pattern (with "_" allowed, as in einops.pack and einops.einsum), so every accepted spec
# can be used to build einops patterns once its "_" dims are given names.

_Fail = Callable[[int, str, str], NoReturn]
_Token = tuple[int, int, str, str]  # (start column, end column, kind, text); kind: name ( ) ...

_NAME_HINT = 'names use letters, digits and "_"; separate them with spaces'
_SUM_HINT = 'list the mesh axes separated by spaces, e.g. "| sum(dp tp)"'
ANONYMOUS = "_"  # the anonymous dim label: never tied to another dim


@functools.lru_cache(maxsize=4096)
def _parse_cached(text: str) -> Spec:
    def fail(col: int, reason: str, fix: str) -> NoReturn:
        raise SpecError(_message(text, col, reason, fix))

    bars = [i for i, char in enumerate(text) if char == "|"]
    if len(bars) > 1:
        fail(
            bars[1], 'more than one "|"', 'write all partial-sum axes in one suffix, e.g. "b n | sum(dp tp)"'
        )
    end = bars[0] if bars else len(text)
    dims = _parse_dims(text, end, fail)
    partial = _parse_partial(text, end + 1, fail) if bars else ()
    if compiling():  # traced by torch.compile, which cannot trace warning filters: skip the cross-check
        return Spec(dims, partial)
    try:
        with warnings.catch_warnings():  # einops warns about some names ("axis"); fshard allows them
            warnings.simplefilter("ignore")
            ParsedExpression(text[:end], allow_underscore=True, allow_duplicates=True)
    except Exception as err:  # the scanner accepted what einops rejects: an fshard bug, still a SpecError
        reason = " ".join(str(err).split())
        fail(0, f"rejected by the einops parser: {reason}", "this is a bug in fshard, please report it")
    return Spec(dims, partial)


def _show(text: str) -> str:
    """Text as shown in messages: non-printable characters escaped, so carets line up."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def _message(text: str, col: int, reason: str, fix: str) -> str:
    shown = _show(text)
    pad = " " * len(_show(text[:col]))
    return f'invalid spec "{shown}": {reason}\n  {shown}\n  {pad}^\nfix: {fix}'


def _is_name_char(char: str) -> bool:
    return char.isalnum() or char == "_"  # einops' alphabet for identifiers


def _tokens(text: str, start: int, end: int, fail: _Fail, hint: str) -> Iterator[_Token]:
    """Split ``text[start:end]`` into names, parentheses and ellipses; reject any other character."""
    i = start
    while i < end:
        char = text[i]
        if char == " ":
            i += 1
        elif char in "()":
            yield i, i + 1, char, char
            i += 1
        elif char == ".":
            j = i
            while j < end and text[j] == ".":
                j += 1
            if j - i != 3:
                fail(
                    i, f'"{text[i:j]}" is not an ellipsis', 'write the ellipsis as exactly three dots, "..."'
                )
            yield i, j, "...", "..."
            i = j
        elif _is_name_char(char):
            j = i
            while j < end and _is_name_char(text[j]):
                j += 1
            yield i, j, "name", text[i:j]
            i = j
        elif char == "\u2026":
            fail(i, 'unexpected character "\u2026"', 'write the ellipsis as three dots, "..."')
        else:
            fail(i, f'unexpected character "{_show(char)}"', hint)


def is_valid_name(name) -> bool:
    """The one rule for names in specs, shared with mesh axis names: a Python identifier that
    is not a keyword and neither starts nor ends with ``_`` (einops' rule)."""
    return (
        isinstance(name, str)
        and name.isidentifier()
        and not keyword.iskeyword(name)
        and not name.startswith("_")
        and not name.endswith("_")
    )


def _check_name(name: str, col: int, fail: _Fail, *, axis: bool = False) -> None:
    """Reject a name that is not a valid label or axis name (``axis``: a ``sum(...)`` entry),
    saying which part of `is_valid_name` it breaks."""
    if is_valid_name(name):
        return
    if name == ANONYMOUS:
        if axis:
            fail(
                col,
                '"_" in "sum(...)"',
                '"_" is the anonymous dim label, not a mesh axis; name the mesh axes, e.g. "| sum(tp)"',
            )
        return
    if name.isdigit():
        fail(
            col,
            f'"{name}" is a number, not a name',
            'give the dim a name, or write "_" for an unnamed dim; specs have no numeric axes like '
            'einops\' "1" or "3"',
        )
    if not name.isidentifier():
        fail(
            col,
            f'"{name}" is not a valid name',
            'names are Python identifiers: letters, digits and "_", not starting with a digit',
        )
    if keyword.iskeyword(name):
        fail(col, f'"{name}" is a Python keyword', "pick a name that is not a Python keyword")
    if name.startswith("_") or name.endswith("_"):
        where = "starts" if name.startswith("_") else "ends"
        core = name.strip("_")
        if core.isidentifier() and not keyword.iskeyword(core):
            fix = f'names must not start or end with "_" (einops\' rule); e.g. write "{core}"'
        elif axis:
            fix = 'names must not start or end with "_" (einops\' rule); rename it'
        else:
            fix = 'names must not start or end with "_" (einops\' rule); rename it, or write "_" for an unnamed dim'
        fail(col, f'"{name}" {where} with "_"', fix)


def _parse_dims(text: str, end: int, fail: _Fail) -> tuple[Dim, ...]:
    dims: list[Dim] = []
    group: list[str] | None = None
    group_col = 0
    seen_ellipsis = False
    prev: _Token | None = None
    for token in _tokens(text, 0, end, fail, _NAME_HINT):
        col, _, kind, value = token
        if prev is not None and prev[1] == col and {kind, prev[2]} == {"name", "..."}:
            fail(col, f'missing space before "{value}"', 'separate "..." from names with a space')
        if kind == "(":
            if group is not None:
                fail(col, "nested parentheses", 'groups are one level deep: write "(a b c)", not "(a (b c))"')
            if prev is not None and prev[1] == col and prev[3] == "sum":
                fail(prev[0], '"sum(...)" without "|" before it', 'mark a partial sum as "b n | sum(tp)"')
            group, group_col = [], col
        elif kind == ")":
            if group is None:
                fail(col, '")" without a matching "("', 'remove the ")" or open a group with "("')
            if not group:
                fail(
                    group_col,
                    'empty group "()"',
                    'put the mesh axes and the dim label inside, e.g. "(tp d)", or remove the "()"',
                )
            dims.append(Dim(tuple(group), grouped=True))
            group = None
        elif kind == "...":
            if group is not None:
                fail(
                    col,
                    '"..." inside a group',
                    '"..." stands for unsplit dims and cannot be split; move it out of the parentheses',
                )
            if seen_ellipsis:
                fail(col, 'more than one "..."', 'use "..." at most once in a spec')
            seen_ellipsis = True
            dims.append(Dim((), ellipsis=True))
        else:
            _check_name(value, col, fail)
            if group is None:
                dims.append(Dim((value,)))
            else:
                group.append(value)
        prev = token
    if group is not None:
        fail(group_col, "unbalanced parenthesis", 'close the group with ")"')
    return tuple(dims)


def _parse_partial(text: str, start: int, fail: _Fail) -> tuple[str, ...]:
    """Parse what follows ``|``: ``sum(`` then one or more axis names then ``)``."""
    tokens = _tokens(text, start, len(text), fail, _SUM_HINT)
    token = next(tokens, None)
    if token is None:
        fail(len(text), 'nothing after "|"', 'write the partial-sum axes as "| sum(tp)", or remove the "|"')
    col, _, kind, value = token
    if kind != "name":
        fail(col, f'expected "sum(" after "|", found "{value}"', 'write the partial-sum axes as "| sum(tp)"')
    if value != "sum":
        fail(col, f'unknown reduction "{value}" after "|"', 'only partial sums are supported: "| sum(tp)"')
    token = next(tokens, None)
    if token is None or token[2] != "(":
        fail(
            len(text) if token is None else token[0],
            'expected "(" after "sum"',
            'write the axes in parentheses, e.g. "| sum(tp)"',
        )
    open_col = token[0]
    axes: list[str] = []
    while True:
        token = next(tokens, None)
        if token is None:
            fail(open_col, 'unbalanced parenthesis in "sum("', 'close it with ")"')
        col, _, kind, value = token
        if kind == ")":
            break
        if kind != "name":
            fail(col, f'"{value}" inside "sum(...)"', _SUM_HINT)
        _check_name(value, col, fail, axis=True)
        axes.append(value)
    if not axes:
        fail(
            open_col,
            '"sum()" names no axis',
            'name the mesh axes the value is a partial sum over, e.g. "| sum(tp)", or remove the suffix',
        )
    token = next(tokens, None)
    if token is not None:
        fail(token[0], 'unexpected text after "sum(...)"', 'the "| sum(...)" suffix must end the spec')
    return tuple(axes)
