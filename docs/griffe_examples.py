"""A griffe extension for the API reference: read fshard's docstrings as mkdocstrings expects.

Two habits of fshard's docstrings that Sphinx accepts but griffe renders badly:

* a doctest section headed ``Example:`` (griffe parses only the plural ``Examples:`` as code;
  the singular becomes an admonition in which ``>>>`` lines render as nested block quotes);
* Sphinx roles such as ``:class:`Sharded``` and ``:func:`~fshard.shard```, which Markdown
  shows literally. They become code spans (the last dotted component when written with ``~``).

Loaded by mkdocs.yml; not part of the site.
"""

from __future__ import annotations

import re

from griffe import Extension

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", flags=re.MULTILINE)
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|exc|data|obj):`(~?)([^`]+)`")


def _role(match: re.Match) -> str:
    target = match.group(2)
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class FshardDocstrings(Extension):
    def on_instance(self, *, obj, **kwargs) -> None:
        docstring = obj.docstring
        if docstring is None:
            return
        text = _EXAMPLE.sub(r"\1Examples:", docstring.value)
        docstring.value = _ROLE.sub(_role, text)
