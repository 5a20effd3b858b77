"""docs/api.md is generated from the docstrings by docs/gen_api.py, and must stay up to date.

The page is regenerated in memory and compared with the file, so a changed signature or
docstring, or a new public name, fails here until ``python docs/gen_api.py`` is run. The
generator's pieces (summary, examples, signatures, an entry) are checked on small objects.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import re
from pathlib import Path

import pytest

import fshard as fs

ROOT = Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def test_api_page_is_up_to_date():
    want = gen.render()
    have = gen.PAGE.read_text(encoding="utf-8")
    if have != want:
        diff = "".join(
            difflib.unified_diff(
                have.splitlines(keepends=True), want.splitlines(keepends=True), "docs/api.md", "generated"
            )
        )
        pytest.fail(f"docs/api.md is out of date: run python docs/gen_api.py\n{diff[:6000]}")


def test_every_public_name_has_an_entry():
    page = gen.PAGE.read_text(encoding="utf-8")
    headings = set(re.findall(r"^### (fs\.[\w.]+)$", page, flags=re.MULTILINE))
    submodules = ("optim", "random", "checkpoint")
    want = {f"fs.{name}" for name in fs.__all__ if name not in submodules}
    want |= {f"fs.{m}.{name}" for m in submodules for name in getattr(fs, m).__all__}
    assert sorted(want - headings) == []


def _sample(x: int, /, y: str = "a", *args, z: float | None = None, **kw) -> list[int]:
    """First line of the summary,
    second line of the summary.

    More text that is left out.

    Args:
        x: left out.

    Examples:
        >>> _sample(1)
        []

        >>> _sample(2, z=1.0)
        []

    Raises:
        ValueError: left out.
    """
    return []


_SENTINEL = object()


def _with_sentinel(a, b=_SENTINEL, *, c: int = 0):
    """Uses :func:`~fshard.shard` and :class:`fshard.Mesh`."""


def test_summary_is_the_first_paragraph_on_one_line():
    assert gen.summary(_sample) == "First line of the summary, second line of the summary."
    assert gen.summary(_with_sentinel) == "Uses `shard` and `fshard.Mesh`."


def test_examples_is_the_dedented_examples_section():
    assert gen.examples(_sample) == ">>> _sample(1)\n[]\n\n>>> _sample(2, z=1.0)\n[]"
    assert gen.examples(_with_sentinel) == ""


def test_signatures_keep_markers_annotations_and_name_sentinels():
    assert (
        gen.signature("f", _sample)
        == "f(x: int, /, y: str = 'a', *args, z: float | None = None, **kw) -> list[int]"
    )
    assert gen.signature("g", _with_sentinel) == "g(a, b=_SENTINEL, *, c: int = 0)"
    assert gen.signature("f", _sample, width=40) == (
        "f(\n    x: int,\n    /,\n    y: str = 'a',\n    *args,\n    z: float | None = None,\n    **kw,\n) -> list[int]"
    )


def test_an_entry_in_full():
    assert "\n".join(gen.entry("fs.sample", _sample)) == (
        "### fs.sample\n"
        "\n"
        "<!-- no-test: signature -->\n"
        "```python\n"
        "fs.sample(x: int, /, y: str = 'a', *args, z: float | None = None, **kw) -> list[int]\n"
        "```\n"
        "\n"
        "First line of the summary, second line of the summary.\n"
        "\n"
        "Examples:\n"
        "\n"
        "```pycon\n"
        ">>> _sample(1)\n"
        "[]\n"
        "\n"
        ">>> _sample(2, z=1.0)\n"
        "[]\n"
        "```\n"
    )


def test_a_public_name_not_placed_in_a_section_is_an_error(monkeypatch):
    monkeypatch.setattr(
        gen, "SECTIONS", [(t, i, [n for n in names if n != "psum"]) for t, i, names in gen.SECTIONS]
    )
    with pytest.raises(gen.StaleConfig) as info:
        gen.render()
    assert (
        str(info.value) == "docs/gen_api.py: SECTIONS is out of date: fshard.psum is public but in no section"
    )


def test_a_public_member_neither_shown_nor_hidden_is_an_error(monkeypatch):
    shown, hidden = gen.MEMBERS["Layout"]
    monkeypatch.setitem(gen.MEMBERS, "Layout", ([m for m in shown if m != "block"] + ["blocks"], hidden))
    with pytest.raises(gen.StaleConfig) as info:
        gen.render()
    assert str(info.value) == (
        "docs/gen_api.py: MEMBERS is out of date: fshard.Layout has no public member 'blocks'; "
        "fshard.Layout.block is neither shown nor hidden"
    )


def test_public_surface_loads_lazily():
    """Every name in __all__ is in the lazy table and resolves to an object defined in fshard;
    the TYPE_CHECKING imports list the same names; import fshard alone does not import torch."""
    import subprocess
    import sys

    from fshard import _LAZY

    assert sorted(_LAZY) == sorted(fs.__all__)
    for name in fs.__all__:
        obj = getattr(fs, name)
        assert (getattr(obj, "__module__", None) or obj.__name__).startswith("fshard"), name
    tree = ast.parse(Path(fs.__file__).read_text())
    guard = next(
        n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"
    )
    typed = {a.name for n in guard.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert typed == set(fs.__all__), sorted(typed ^ set(fs.__all__))
    out = subprocess.run(
        [sys.executable, "-c", "import sys, fshard, fshard.run; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"
    with pytest.raises(AttributeError, match="module 'fshard' has no attribute 'shardmap'"):
        fs.shardmap  # noqa: B018
