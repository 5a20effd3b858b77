"""Write docs/api.md, the API reference, from fshard's docstrings.

For every public name (``fshard.__all__``, and the public names of ``fshard.optim``,
``fshard.random`` and ``fshard.checkpoint``) the page gives a heading, the signature, the first
paragraph of the docstring and its Examples block, plus one line per public member of a class.
It is plain Markdown, so it reads the same on the site, on GitHub and in an editor.

Run it after changing a public signature or docstring::

    python docs/gen_api.py            # rewrites docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md is out of date

``tests/test_api_page.py`` regenerates the page in memory and fails when the file differs, and
when a public name or member is not placed below (in ``SECTIONS`` or ``MEMBERS``).
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any, ForwardRef

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "api.md"

# (title, intro or "", names of fshard.__all__ in the order shown)
SECTIONS: list[tuple[str, str, list[str]]] = [
    ("Meshes and specs", "", ["Mesh", "Spec", "parse_spec", "Layout"]),
    (
        "shard_map and global values",
        "",
        ["shard_map", "Sharded", "shard", "from_dtensor", "full", "reduce_to", "visualize", "debug"],
    ),
    (
        "Collectives",
        "Call these inside a function run by `fs.shard_map`. `axis` is a mesh axis name or a tuple of\n"
        "names, passed positionally (JAX's `axis_name=`). The [collectives page](tutorial/03-collectives.md)\n"
        "has a table of what each one costs and its gradient.",
        [
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
            "axis_index",
            "axis_size",
            "Pending",
        ],
    ),
    (
        "Pipeline stages: per-rank values",
        "Values that differ from one rank to the next along an axis (each pipeline stage's own\n"
        "parameters, of its own shapes), and running this rank's branch. The\n"
        "[collectives page](tutorial/03-collectives.md#pipeline-stages-of-different-shapes) has a worked pipeline.",
        ["PerRank", "switch"],
    ),
    ("Autodiff", "", ["value_and_grad", "grad", "no_sync", "remat", "fsdp_scan", "reshard_after_forward"]),
    ("Modules", "", ["sync_buffers", "check_buffers"]),
    ("Counting collectives", "", ["count_collectives", "CollectiveCounts"]),
    (
        "Compiling",
        "The [compiling page](tutorial/09-compiling.md) says what compiles, what is refused and why.",
        ["compile"],
    ),
    ("Launching", "", ["init", "launch", "RankPool", "restart_count"]),
    ("Optimizers: `fs.optim`", "", ["optim"]),
    ("Randomness: `fs.random`", "", ["random"]),
    ("Checkpoints: `fs.checkpoint`", "", ["checkpoint"]),
    (
        "Errors",
        "Every error fshard raises on purpose is an `fs.FshardError`, itself a `RuntimeError`. Some\n"
        "kinds also derive from the built-in exception they refine (shown in parentheses), so that\n"
        "`except ValueError` still catches an `fs.SpecError`.",
        [
            "FshardError",
            "SpecError",
            "MeshError",
            "CollectiveError",
            "ArgumentError",
            "CheckpointError",
            "TracingError",
            "RankError",
        ],
    ),
]

# Classes whose public members are chosen by hand: (shown, in order; left out on purpose).
# Any other public member of these classes makes the generator fail, so that a new method is
# either documented or hidden deliberately. Other classes show every public method and property.
MEMBERS: dict[str, tuple[list[str], list[str]]] = {
    "Mesh": (
        [
            "axis_names",
            "shape",
            "size",
            "coordinate",
            "device_mesh",
            "axis_size",
            "axis_index",
            "from_device_mesh",
        ],
        ["ranks", "tracked", "check_axes", "axis_group", "bits", "names_of"],
    ),
    "Layout": (
        [
            "split_axes",
            "is_split",
            "scatter_dims",
            "reduce_axes",
            "reduced",
            "local_shape",
            "global_shape",
            "block",
            "spec_text",
        ],
        ["same_placement", "block_index", "is_even", "block_sizes"],
    ),
    "Sharded": (
        [
            "local",
            "mesh",
            "layout",
            "shape",
            "dtype",
            "device",
            "ndim",
            "spec",
            "full",
            "reshard",
            "to_dtensor",
            "from_local",
            "grad",
            "requires_grad",
            "requires_grad_",
            "detach",
            "dim",
        ],
        [],
    ),
}

# What a slot attribute holds (slots have no docstring of their own).
ATTRIBUTES: dict[str, str] = {
    "Sharded.local": "this rank's block, a plain `torch.Tensor`.",
    "Sharded.mesh": "the `Mesh` the value lives on.",
    "Sharded.layout": "the `Layout`: the spec bound to the mesh and the global shape.",
}

_SUBMODULES = ("optim", "random", "checkpoint")
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|exc|data|obj):`(~?)([^`]+)`")
_SECTION = re.compile(r"^(Examples?):\s*$")
_HEADER = re.compile(r"^[A-Z][A-Za-z ]*:\s*$")  # a Google-style section header (Args:, Returns:, ...)

HEADER = """\
# API reference

<!-- Generated by docs/gen_api.py from the docstrings: edit those, then run
     python docs/gen_api.py (tests/test_api_page.py checks that this page is up to date). -->

Everything here is reachable as `import fshard as fs`: `fs.NAME` for the names below, and
`fs.optim.NAME`, `fs.random.NAME` and `fs.checkpoint.NAME` for the three submodules (also
`from fshard import checkpoint`). Each entry gives the signature, the summary and the examples
of its docstring; `help(fs.NAME)` shows the whole docstring, with every argument and error.
"""


class StaleConfig(Exception):
    """A public name or member that SECTIONS or MEMBERS does not place."""


class _Raw:
    """Shown as its text, unquoted (annotations kept as strings, sentinel defaults by name)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _inline(text: str) -> str:
    """Sphinx roles as code spans, as griffe_examples.py does for the site."""

    def role(m: re.Match) -> str:
        target = m.group(2)
        return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"

    return _ROLE.sub(role, text)


def _doc(obj) -> str:
    return inspect.cleandoc(obj.__doc__) if isinstance(getattr(obj, "__doc__", None), str) else ""


def summary(obj) -> str:
    """The first paragraph of ``obj``'s docstring, as one Markdown paragraph."""
    lines: list[str] = []
    for line in _doc(obj).splitlines():
        if not line.strip():
            break
        lines.append(line.strip())
    return _inline(" ".join(lines))


def examples(obj) -> str:
    """The body of the docstring's ``Examples:`` (or ``Example:``) section, dedented, or ''."""
    lines = _doc(obj).splitlines()
    for i, line in enumerate(lines):
        if _SECTION.match(line):
            body: list[str] = []
            for text in lines[i + 1 :]:
                if text.strip() and not text.startswith((" ", "\t")):
                    break
                body.append(text)
            return textwrap.dedent("\n".join(body)).strip("\n")
    return ""


def _named_default(value, module: ModuleType | None):
    """A default whose repr shows a memory address (a sentinel) is shown by its module name."""
    if " at 0x" not in repr(value):
        return value
    for name, held in vars(module or {}).items():
        if held is value:
            return _Raw(name)
    return _Raw("...")


def _parameters(obj, skip_first: bool) -> tuple[list[str], str]:
    """The parameters of ``obj`` as text (with ``/`` and ``*`` markers) and the return annotation."""
    sig = inspect.signature(obj)
    module = inspect.getmodule(obj)
    params = list(sig.parameters.values())[1 if skip_first else 0 :]
    out: list[str] = []
    pos_only = False
    kw_marker = True
    for p in params:
        ann = p.annotation
        if isinstance(ann, ForwardRef):
            ann = ann.__forward_arg__
        if isinstance(ann, str):
            ann = _Raw(ann)
        default = p.default if p.default is p.empty else _named_default(p.default, module)
        text = str(p.replace(annotation=ann, default=default))
        if p.kind is p.POSITIONAL_ONLY:
            pos_only = True
        elif pos_only:
            out.append("/")
            pos_only = False
        if p.kind is p.VAR_POSITIONAL:
            kw_marker = False
        elif p.kind is p.KEYWORD_ONLY and kw_marker:
            out.append("*")
            kw_marker = False
        out.append(text)
    if pos_only:
        out.append("/")
    ret = sig.return_annotation
    if ret is sig.empty or ret in ("None", None) and inspect.isclass(obj):
        returns = ""
    else:
        returns = f" -> {ret if isinstance(ret, str) else inspect.formatannotation(ret)}"
    return out, returns


def signature(prefix: str, obj, *, skip_first: bool = False, width: int = 100) -> str:
    """``prefix(params) -> ret``, one parameter per line when it does not fit in ``width``."""
    params, returns = _parameters(obj, skip_first)
    line = f"{prefix}({', '.join(params)}){returns}"
    if len(line) <= width:
        return line
    body = "".join(f"    {p},\n" for p in params)
    return f"{prefix}(\n{body}){returns}"


def _code(lang: str, text: str, reason: str) -> list[str]:
    """A fenced block; python blocks carry the marker that tests/test_docs.py asks for."""
    marker = [f"<!-- no-test: {reason} -->"] if lang == "python" else []
    return [*marker, f"```{lang}", text, "```", ""]


def _example_block(obj) -> list[str]:
    text = examples(obj)
    if not text:
        return []
    lang = "pycon" if text.lstrip().startswith(">>>") else "python"
    return ["Examples:", "", *_code(lang, text, "docstring example: a fragment, not a whole program")]


def _class_signature(qual: str, cls: type) -> str:
    if issubclass(cls, BaseException):
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        return f"class {qual}({bases})"
    return "class " + signature(qual, cls)


def _member(cls: type, name: str) -> str:
    """One list item: the member's signature and the first paragraph of its docstring."""
    raw = inspect.getattr_static(cls, name)
    fn: Any
    if isinstance(raw, (classmethod, staticmethod)):
        fn = raw.__func__
        text = signature(f".{name}", fn, skip_first=isinstance(raw, classmethod), width=10_000)
        kind = f" ({type(raw).__name__})"
    elif isinstance(raw, property) or hasattr(raw, "func") and hasattr(raw, "attrname"):
        fn = raw.fget if isinstance(raw, property) else raw.func  # property or cached_property
        ret = inspect.signature(fn).return_annotation
        text = f".{name}" + ("" if ret is inspect.Signature.empty else f": {ret}")
        kind = " (property)"
    elif inspect.isfunction(raw):
        fn = raw
        text = signature(f".{name}", fn, skip_first=True, width=10_000)
        kind = ""
    else:  # a slot or another plain attribute
        about = ATTRIBUTES.get(f"{cls.__name__}.{name}", "")
        return f"- `.{name}` (attribute)" + (f": {about}" if about else "")
    about = summary(fn) if _doc(fn) else ""
    return f"- `{text}`{kind}" + (f": {about}" if about else "")


def _public_members(cls: type) -> list[str]:
    names = []
    for name, raw in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(raw, (classmethod, staticmethod, property)) or inspect.isfunction(raw):
            names.append(name)
        elif hasattr(raw, "func") and hasattr(raw, "attrname"):  # functools.cached_property
            names.append(name)
        elif type(raw).__name__ == "member_descriptor":  # __slots__
            names.append(name)
    return names


def _members(name: str, cls: type) -> list[str]:
    public = _public_members(cls)
    if name in MEMBERS:
        shown, hidden = MEMBERS[name]
        unknown = [m for m in shown + hidden if m not in public]
        unplaced = [m for m in public if m not in shown and m not in hidden]
        problems = [f"fshard.{name} has no public member {m!r}" for m in unknown]
        problems += [f"fshard.{name}.{m} is neither shown nor hidden" for m in unplaced]
        if problems:
            raise StaleConfig(f"docs/gen_api.py: MEMBERS is out of date: {'; '.join(problems)}")
    else:
        shown = [m for m in public if type(vars(cls)[m]).__name__ != "member_descriptor"]
    if not shown:
        return []
    return ["Members:", "", *[_member(cls, m) for m in shown], ""]


def entry(qual: str, obj, level: int = 3) -> list[str]:
    """The lines of one entry: heading, signature, summary, examples, members."""
    out = [f"{'#' * level} {qual}", ""]
    if inspect.isclass(obj):
        out += _code("python", _class_signature(qual, obj), "signature")
    elif callable(obj):
        out += _code("python", signature(qual, obj), "signature")
    about = summary(obj)
    if about:
        out += [about, ""]
    out += _example_block(obj)
    if inspect.isclass(obj) and not issubclass(obj, BaseException):
        out += _members(qual.rsplit(".", 1)[-1], obj)
    return out


def _anchor(qual: str) -> str:
    """The heading id the site's toc extension gives ``### qual``."""
    return re.sub(r"[^\w-]", "", qual.lower())


def module_entries(fs: ModuleType, short: str) -> list[str]:
    mod = getattr(fs, short)
    out: list[str] = []
    about = summary(mod)
    if about:
        out += [about, ""]
    top = {id(getattr(fs, n)): n for n in fs.__all__}
    for name in mod.__all__:
        obj = getattr(mod, name)
        qual = f"fs.{short}.{name}"
        if id(obj) in top and top[id(obj)] != short:
            same = f"fs.{top[id(obj)]}"
            out += [f"### {qual}", "", f"The same class as [`{same}`](#{_anchor(same)}).", ""]
            continue
        out += entry(qual, obj)
    return out


def render() -> str:
    """The text of docs/api.md for the fshard that is imported."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    fs = importlib.import_module("fshard")
    placed = [n for _, _, names in SECTIONS for n in names]
    missing = [n for n in fs.__all__ if n not in placed]
    extra = [n for n in placed if n not in fs.__all__]
    problems = [f"fshard.{n} is public but in no section" for n in missing]
    problems += [f"{n!r} is not in fshard.__all__" for n in extra]
    if problems:
        raise StaleConfig(f"docs/gen_api.py: SECTIONS is out of date: {'; '.join(problems)}")
    lines = [HEADER]
    for title, intro, names in SECTIONS:
        lines += [f"## {title}", ""]
        if intro:
            lines += [intro, ""]
        for name in names:
            if name in _SUBMODULES:
                lines += module_entries(fs, name)
            else:
                lines += entry(f"fs.{name}", getattr(fs, name))
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    try:
        text = render()
    except StaleConfig as err:
        print(err, file=sys.stderr)
        return 1
    if argv[1:] == ["--check"]:
        if PAGE.read_text(encoding="utf-8") != text:
            print("docs/api.md is out of date: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
