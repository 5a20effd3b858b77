"""Tests for the partition-spec parser (fshard._spec)."""

from __future__ import annotations

import ast
import doctest
import keyword
import re
import warnings
from pathlib import Path

import pytest
from einops.parsing import ParsedExpression
from hypothesis import given, settings
from hypothesis import strategies as st

import fshard._spec as spec_module
from fshard._errors import SpecError
from fshard._spec import Dim, Spec, parse_spec

E = Dim((), ellipsis=True)


def N(name: str) -> Dim:
    return Dim((name,))


def G(*names: str) -> Dim:
    return Dim(names, grouped=True)


# ------------------------------------------------------------------------------------------------
# valid specs: text -> expected structure -> canonical text

VALID = [
    ("", Spec(()), ""),
    ("   ", Spec(()), ""),
    ("b", Spec((N("b"),)), "b"),
    ("b s d", Spec((N("b"), N("s"), N("d"))), "b s d"),
    ("  b   s  ", Spec((N("b"), N("s"))), "b s"),
    ("(dp b) s (tp d)", Spec((G("dp", "b"), N("s"), G("tp", "d"))), "(dp b) s (tp d)"),
    ("( dp  b )", Spec((G("dp", "b"),)), "(dp b)"),
    ("(dp tp b)", Spec((G("dp", "tp", "b"),)), "(dp tp b)"),
    ("(b)", Spec((G("b"),)), "(b)"),
    ("a(b c)", Spec((N("a"), G("b", "c"))), "a (b c)"),
    ("(a)(b)", Spec((G("a"), G("b"))), "(a) (b)"),
    ("...", Spec((E,)), "..."),
    ("... d", Spec((E, N("d"))), "... d"),
    ("b ... d", Spec((N("b"), E, N("d"))), "b ... d"),
    ("(dp b)...", Spec((G("dp", "b"), E)), "(dp b) ..."),
    ("...(tp d)", Spec((E, G("tp", "d"))), "... (tp d)"),
    ("b n | sum(tp)", Spec((N("b"), N("n")), ("tp",)), "b n | sum(tp)"),
    ("(tp b) n | sum(dp tp)", Spec((G("tp", "b"), N("n")), ("dp", "tp")), "(tp b) n | sum(dp tp)"),
    ("b n|sum( tp )", Spec((N("b"), N("n")), ("tp",)), "b n | sum(tp)"),
    ("b n |  sum (tp  dp)  ", Spec((N("b"), N("n")), ("tp", "dp")), "b n | sum(tp dp)"),
    ("| sum(tp)", Spec((), ("tp",)), "| sum(tp)"),
    ("|sum(tp)", Spec((), ("tp",)), "| sum(tp)"),
    ("... | sum(dp)", Spec((E,), ("dp",)), "... | sum(dp)"),
    # duplicates are recorded as written; the binder reports them
    ("b b", Spec((N("b"), N("b"))), "b b"),
    ("(dp b) (dp c)", Spec((G("dp", "b"), G("dp", "c"))), "(dp b) (dp c)"),
    ("b | sum(tp tp)", Spec((N("b"),), ("tp", "tp")), "b | sum(tp tp)"),
    # names: identifiers with digits, inner underscores, unicode; "sum" and "axis" are plain names
    ("x1 a_b B2c", Spec((N("x1"), N("a_b"), N("B2c"))), "x1 a_b B2c"),
    ("αβ (dp é)", Spec((N("αβ"), G("dp", "é"))), "αβ (dp é)"),
    ("sum (tp d)", Spec((N("sum"), G("tp", "d"))), "sum (tp d)"),
    ("axis (sum)", Spec((N("axis"), G("sum"))), "axis (sum)"),
    ("b | sum(sum)", Spec((N("b"),), ("sum",)), "b | sum(sum)"),
    # "_" is the anonymous label: allowed alone, as a bare dim or a group's label, and repeated
    ("_", Spec((N("_"),)), "_"),
    ("(dp _) _", Spec((G("dp", "_"), N("_"))), "(dp _) _"),
    ("_ ... (tp _)", Spec((N("_"), E, G("tp", "_"))), "_ ... (tp _)"),
    ("(_)(dp  _)|sum(tp)", Spec((G("_"), G("dp", "_")), ("tp",)), "(_) (dp _) | sum(tp)"),
]


@pytest.mark.parametrize(("text", "expected", "canonical"), VALID)
def test_valid_specs(text, expected, canonical):
    spec = parse_spec(text)
    assert spec == expected
    assert str(spec) == canonical
    assert parse_spec(str(spec)) == spec


def test_spec_helpers():
    spec = parse_spec("(dp b) ... s | sum(tp)")
    assert spec.has_ellipsis
    assert spec.names() == ("dp", "b", "s")
    assert spec.partial == ("tp",)
    assert not parse_spec("b s").has_ellipsis
    assert parse_spec("").names() == ()
    assert str(Dim(("dp", "b"))) == "(dp b)"  # several names print as a group even without the flag


def test_spec_passes_through_and_is_cached():
    spec = parse_spec("(dp b) s")
    assert parse_spec(spec) is spec
    assert parse_spec("(dp b) s") is spec


def test_str_subclass_is_parsed_as_plain_text():
    class Text(str):
        def __str__(self) -> str:
            return "not the spec"

    assert parse_spec(Text("b s")) == Spec((N("b"), N("s")))


def test_specs_are_frozen_and_hashable():
    spec = parse_spec("(dp b) s | sum(tp)")
    with pytest.raises(AttributeError):
        spec.partial = ()  # type: ignore[misc]
    assert hash(spec) == hash(parse_spec("(dp b)  s|sum(tp)"))


# ------------------------------------------------------------------------------------------------
# invalid specs: whole messages

INVALID = [
    (
        "(dp b s",
        'invalid spec "(dp b s": unbalanced parenthesis\n  (dp b s\n  ^\nfix: close the group with ")"',
    ),
    (
        "b (tp d",
        'invalid spec "b (tp d": unbalanced parenthesis\n  b (tp d\n    ^\nfix: close the group with ")"',
    ),
    (
        "b s)",
        'invalid spec "b s)": ")" without a matching "("\n'
        "  b s)\n"
        "     ^\n"
        'fix: remove the ")" or open a group with "("',
    ),
    (
        "(dp (tp b))",
        'invalid spec "(dp (tp b))": nested parentheses\n'
        "  (dp (tp b))\n"
        "      ^\n"
        'fix: groups are one level deep: write "(a b c)", not "(a (b c))"',
    ),
    (
        "b ( ) s",
        'invalid spec "b ( ) s": empty group "()"\n'
        "  b ( ) s\n"
        "    ^\n"
        'fix: put the mesh axes and the dim label inside, e.g. "(tp d)", or remove the "()"',
    ),
    (
        "b-s",
        'invalid spec "b-s": unexpected character "-"\n'
        "  b-s\n"
        "   ^\n"
        'fix: names use letters, digits and "_"; separate them with spaces',
    ),
    (
        "b,s",
        'invalid spec "b,s": unexpected character ","\n'
        "  b,s\n"
        "   ^\n"
        'fix: names use letters, digits and "_"; separate them with spaces',
    ),
    (
        "b\ts",
        'invalid spec "b\\ts": unexpected character "\\t"\n'
        "  b\\ts\n"
        "   ^\n"
        'fix: names use letters, digits and "_"; separate them with spaces',
    ),
    (
        "b\n(tp d",
        'invalid spec "b\\n(tp d": unexpected character "\\n"\n'
        "  b\\n(tp d\n"
        "   ^\n"
        'fix: names use letters, digits and "_"; separate them with spaces',
    ),
    (
        "b \u2026",
        'invalid spec "b \u2026": unexpected character "\u2026"\n'
        "  b \u2026\n"
        "    ^\n"
        'fix: write the ellipsis as three dots, "..."',
    ),
    (
        "... b ...",
        'invalid spec "... b ...": more than one "..."\n'
        "  ... b ...\n"
        "        ^\n"
        'fix: use "..." at most once in a spec',
    ),
    (
        "(dp ...)",
        'invalid spec "(dp ...)": "..." inside a group\n'
        "  (dp ...)\n"
        "      ^\n"
        'fix: "..." stands for unsplit dims and cannot be split; move it out of the parentheses',
    ),
    (
        "b .. d",
        'invalid spec "b .. d": ".." is not an ellipsis\n'
        "  b .. d\n"
        "    ^\n"
        'fix: write the ellipsis as exactly three dots, "..."',
    ),
    (
        "b....",
        'invalid spec "b....": "...." is not an ellipsis\n'
        "  b....\n"
        "   ^\n"
        'fix: write the ellipsis as exactly three dots, "..."',
    ),
    (
        "b...",
        'invalid spec "b...": missing space before "..."\n'
        "  b...\n"
        "   ^\n"
        'fix: separate "..." from names with a space',
    ),
    (
        "...b",
        'invalid spec "...b": missing space before "b"\n'
        "  ...b\n"
        "     ^\n"
        'fix: separate "..." from names with a space',
    ),
    (
        "b | max(tp)",
        'invalid spec "b | max(tp)": unknown reduction "max" after "|"\n'
        "  b | max(tp)\n"
        "      ^\n"
        'fix: only partial sums are supported: "| sum(tp)"',
    ),
    (
        "b | (tp)",
        'invalid spec "b | (tp)": expected "sum(" after "|", found "("\n'
        "  b | (tp)\n"
        "      ^\n"
        'fix: write the partial-sum axes as "| sum(tp)"',
    ),
    (
        "b | sum()",
        'invalid spec "b | sum()": "sum()" names no axis\n'
        "  b | sum()\n"
        "         ^\n"
        'fix: name the mesh axes the value is a partial sum over, e.g. "| sum(tp)", or remove the suffix',
    ),
    (
        "b | sum(tp",
        'invalid spec "b | sum(tp": unbalanced parenthesis in "sum("\n'
        "  b | sum(tp\n"
        "         ^\n"
        'fix: close it with ")"',
    ),
    (
        "b | sum tp",
        'invalid spec "b | sum tp": expected "(" after "sum"\n'
        "  b | sum tp\n"
        "          ^\n"
        'fix: write the axes in parentheses, e.g. "| sum(tp)"',
    ),
    (
        "b | sum",
        'invalid spec "b | sum": expected "(" after "sum"\n'
        "  b | sum\n"
        "         ^\n"
        'fix: write the axes in parentheses, e.g. "| sum(tp)"',
    ),
    (
        "b | sum(tp) | sum(dp)",
        'invalid spec "b | sum(tp) | sum(dp)": more than one "|"\n'
        "  b | sum(tp) | sum(dp)\n"
        "              ^\n"
        'fix: write all partial-sum axes in one suffix, e.g. "b n | sum(dp tp)"',
    ),
    (
        "b || sum(tp)",
        'invalid spec "b || sum(tp)": more than one "|"\n'
        "  b || sum(tp)\n"
        "     ^\n"
        'fix: write all partial-sum axes in one suffix, e.g. "b n | sum(dp tp)"',
    ),
    (
        "b |",
        'invalid spec "b |": nothing after "|"\n'
        "  b |\n"
        "     ^\n"
        'fix: write the partial-sum axes as "| sum(tp)", or remove the "|"',
    ),
    (
        "b | sum(tp) d",
        'invalid spec "b | sum(tp) d": unexpected text after "sum(...)"\n'
        "  b | sum(tp) d\n"
        "              ^\n"
        'fix: the "| sum(...)" suffix must end the spec',
    ),
    (
        "b | sum(dp, tp)",
        'invalid spec "b | sum(dp, tp)": unexpected character ","\n'
        "  b | sum(dp, tp)\n"
        "            ^\n"
        'fix: list the mesh axes separated by spaces, e.g. "| sum(dp tp)"',
    ),
    (
        "b | sum(...)",
        'invalid spec "b | sum(...)": "..." inside "sum(...)"\n'
        "  b | sum(...)\n"
        "          ^\n"
        'fix: list the mesh axes separated by spaces, e.g. "| sum(dp tp)"',
    ),
    (
        "b sum(tp)",
        'invalid spec "b sum(tp)": "sum(...)" without "|" before it\n'
        "  b sum(tp)\n"
        "    ^\n"
        'fix: mark a partial sum as "b n | sum(tp)"',
    ),
    (
        "b 3",
        'invalid spec "b 3": "3" is a number, not a name\n'
        "  b 3\n"
        "    ^\n"
        'fix: give the dim a name, or write "_" for an unnamed dim; specs have no numeric axes like '
        'einops\' "1" or "3"',
    ),
    (
        "(1 b)",
        'invalid spec "(1 b)": "1" is a number, not a name\n'
        "  (1 b)\n"
        "   ^\n"
        'fix: give the dim a name, or write "_" for an unnamed dim; specs have no numeric axes like '
        'einops\' "1" or "3"',
    ),
    (
        "b 2d",
        'invalid spec "b 2d": "2d" is not a valid name\n'
        "  b 2d\n"
        "    ^\n"
        'fix: names are Python identifiers: letters, digits and "_", not starting with a digit',
    ),
    (
        "_b s",
        'invalid spec "_b s": "_b" starts with "_"\n'
        "  _b s\n"
        "  ^\n"
        'fix: names must not start or end with "_" (einops\' rule); e.g. write "b"',
    ),
    (
        "b (tp d_)",
        'invalid spec "b (tp d_)": "d_" ends with "_"\n'
        "  b (tp d_)\n"
        "        ^\n"
        'fix: names must not start or end with "_" (einops\' rule); e.g. write "d"',
    ),
    (
        "b __",
        'invalid spec "b __": "__" starts with "_"\n'
        "  b __\n"
        "    ^\n"
        'fix: names must not start or end with "_" (einops\' rule); rename it, or write "_" for an unnamed dim',
    ),
    (
        "(dp _b)",
        'invalid spec "(dp _b)": "_b" starts with "_"\n'
        "  (dp _b)\n"
        "      ^\n"
        'fix: names must not start or end with "_" (einops\' rule); e.g. write "b"',
    ),
    (
        "b | sum(_)",
        'invalid spec "b | sum(_)": "_" in "sum(...)"\n'
        "  b | sum(_)\n"
        "          ^\n"
        'fix: "_" is the anonymous dim label, not a mesh axis; name the mesh axes, e.g. "| sum(tp)"',
    ),
    (
        "b | sum(__)",
        'invalid spec "b | sum(__)": "__" starts with "_"\n'
        "  b | sum(__)\n"
        "          ^\n"
        'fix: names must not start or end with "_" (einops\' rule); rename it',
    ),
    (
        "b | sum(_tp)",
        'invalid spec "b | sum(_tp)": "_tp" starts with "_"\n'
        "  b | sum(_tp)\n"
        "          ^\n"
        'fix: names must not start or end with "_" (einops\' rule); e.g. write "tp"',
    ),
    (
        "for b",
        'invalid spec "for b": "for" is a Python keyword\n'
        "  for b\n"
        "  ^\n"
        "fix: pick a name that is not a Python keyword",
    ),
]


@pytest.mark.parametrize(("text", "message"), INVALID, ids=[text for text, _ in INVALID])
def test_invalid_spec_messages(text, message):
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (3, "spec must be a string, got int: 3"),
        (None, "spec must be a string, got NoneType: None"),
        (b"b s", "spec must be a string, got bytes: b'b s'"),
        (["b", "s"], "spec must be a string, got list: ['b', 's']"),
        (["b"] * 30, "spec must be a string, got list: " + repr(["b"] * 30)[:77] + "..."),
    ],
)
def test_non_string_input(value, message):
    with pytest.raises(SpecError) as info:
        parse_spec(value)
    assert str(info.value) == message


def test_spec_error_is_a_value_error():
    with pytest.raises(ValueError):
        parse_spec("b (")


# ------------------------------------------------------------------------------------------------
# module hygiene


def test_module_does_not_import_torch():
    tree = ast.parse(Path(spec_module.__file__).read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "torch" not in imported


def test_docstring_examples():
    failed, attempted = doctest.testmod(spec_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert attempted > 0
    assert failed == 0


# ------------------------------------------------------------------------------------------------
# property tests

FRAGMENTS = [
    "b",
    "dp",
    "tp",
    "sum",
    "sum(",
    "axis",
    "for",
    "1",
    "3",
    "_",
    "é",
    "\u00b2",
    " ",
    "  ",
    "(",
    ")",
    ".",
    "...",
    "|",
    "| sum(",
    "-",
    ",",
    "\t",
    "\n",
    "\u2026",
    "\u00a0",
    "\x00",
]
spec_like_text = st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join)
spec_alphabet_text = st.text(alphabet="abdpst_19 ().|-\u2026", max_size=20)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), spec_like_text, spec_alphabet_text))
def test_any_text_parses_or_raises_spec_error(text):
    try:
        spec = parse_spec(text)
    except SpecError as err:
        lines = str(err).split("\n")
        assert len(lines) == 4
        assert lines[0].startswith('invalid spec "')
        assert lines[1].startswith("  ")
        assert re.fullmatch(r"  *\^", lines[2])
        assert len(lines[2]) <= len(lines[1]) + 1
        assert lines[3].startswith("fix: ")
    else:
        assert isinstance(spec, Spec)
        assert parse_spec(str(spec)) == spec


names = st.one_of(
    st.text(alphabet="abcdnpstxyz", min_size=1, max_size=3),
    st.sampled_from(["dp", "tp", "sum", "axis", "b1", "a_b", "αβ", "é"]),
).filter(lambda name: not keyword.iskeyword(name))


dim_names = st.one_of(names, st.just("_"))  # "_", the anonymous label, is not a mesh axis name


@st.composite
def structured_specs(draw):
    """A valid spec built from parts, plus a rendering of it with random spacing."""
    dims = []
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.booleans()):
            dims.append(Dim((draw(dim_names),)))
        else:
            dims.append(Dim(tuple(draw(st.lists(dim_names, min_size=1, max_size=3))), grouped=True))
    if draw(st.booleans()):
        dims.insert(draw(st.integers(0, len(dims))), Dim((), ellipsis=True))
    partial = tuple(draw(st.lists(names, max_size=3))) if draw(st.booleans()) else ()

    def space(least: int) -> str:
        return " " * draw(st.integers(least, 2))

    parts = [space(0)]
    for i, dim in enumerate(dims):
        if i:
            parts.append(space(1))
        if dim.ellipsis:
            parts.append("...")
        elif dim.grouped:
            parts.append("(" + space(0) + space(1).join(dim.names) + space(0) + ")")
        else:
            parts.append(dim.names[0])
    if partial:
        parts += [space(0), "|", space(0), "sum", space(0), "("]
        parts += [space(0), space(1).join(partial), space(0), ")"]
    parts.append(space(0))
    return Spec(tuple(dims), partial), "".join(parts)


@settings(max_examples=300, deadline=None)
@given(structured_specs())
def test_structured_specs_round_trip(case):
    expected, text = case
    spec = parse_spec(text)
    assert spec == expected
    canonical = str(spec)
    assert parse_spec(canonical) == spec
    assert str(parse_spec(canonical)) == canonical
    assert spec.has_ellipsis == any(dim.ellipsis for dim in expected.dims)
    assert spec.names() == tuple(name for dim in expected.dims for name in dim.names)


@settings(max_examples=300, deadline=None)
@given(structured_specs())
def test_dims_part_agrees_with_einops(case):
    expected, _ = case
    dims_text = " ".join(str(dim) for dim in expected.dims)
    with warnings.catch_warnings():  # einops discourages the name "axis"; fshard allows it
        warnings.simplefilter("ignore")
        composition = ParsedExpression(dims_text, allow_underscore=True, allow_duplicates=True).composition
    ours = ["\u2026" if dim.ellipsis else list(dim.names) for dim in parse_spec(dims_text).dims]
    assert composition == ours
