"""Rules of the codebase that keep it readable: the import graph of ``fshard/`` is acyclic (each
module imports only modules above it, docs/architecture.md), and no module grows past 800 lines.

Imports inside functions count too: a lazy import that closes a cycle is still a cycle, only
hidden from Python's import-time check.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fshard"
MAX_LINES = 800


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports (``from . import x``, ``from ._x import y``,
    at any depth of the file)."""
    modules = {p.stem for p in package.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in sorted(package.glob("*.py")):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(alias.name for alias in node.names)
        graph[path.stem] = (deps & modules) - {path.stem}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk meets, each as a path that ends where it starts."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(u: str) -> None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                cycles.append(path[path.index(v) :] + [v])
            elif v not in state:
                visit(v)
        path.pop()
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u)
    return cycles


def test_find_cycles_finds_a_cycle_through_a_lazy_import():
    # the checker itself can fail: the cycle this rule was written for (_debug -> _shard_map ->
    # _stages -> _debug) is found, and a DAG has none
    graph = {
        "_debug": {"_shard_map"},
        "_shard_map": {"_stages"},
        "_stages": {"_debug", "_comm"},
        "_comm": set(),
    }
    assert find_cycles(graph) == [["_debug", "_shard_map", "_stages", "_debug"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_import_graph_is_acyclic():
    graph = import_graph(PACKAGE)
    assert "_shard_map" in graph and "_comm" in graph["_primitives"]  # the graph was read
    cycles = [" -> ".join(c) for c in find_cycles(graph)]
    assert cycles == [], f"import cycles in fshard/: {cycles}"


def test_no_module_is_over_800_lines():
    long = {p.name: n for p in PACKAGE.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these modules (one concept per file): {long}"
