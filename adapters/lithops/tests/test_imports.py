"""The adapter's modules import each other without a cycle, counting every import wherever it
stands in a file (top level, inside a function, under ``TYPE_CHECKING``): a deferred import
that closes a circle is still a dependency a reader has to follow both ways."""

from __future__ import annotations

import ast
from pathlib import Path

import pocketflow_lithops

PACKAGE = "pocketflow_lithops"
PACKAGE_DIR = Path(pocketflow_lithops.__file__).parent


def _modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE_DIR.glob("*.py") if p.stem != "__init__")


def _imports_of(module: str) -> set[str]:
    """The modules of the package that ``<module>.py`` imports anywhere."""
    tree = ast.parse((PACKAGE_DIR / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == PACKAGE:
                found.update(alias.name for alias in node.names)
            elif node.module.startswith(f"{PACKAGE}."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(f"{PACKAGE}."):
                    found.add(alias.name.split(".")[1])
    return found & set(_modules())


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, str] = {}
    cycles: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                cycles.append(" -> ".join([*path, module, imported]))
            elif imported not in state:
                visit(imported, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    return cycles


def test_the_adapters_modules_have_no_import_cycle() -> None:
    graph = {module: _imports_of(module) - {module} for module in _modules()}
    assert _cycles(graph) == []


def test_the_import_graph_is_read() -> None:
    # Guards the test above against a parser that finds nothing, and the cycle finder against
    # missing one.
    assert {"shuffle_tasks", "append_shuffle", "shuffle_result"} <= _imports_of("shuffle")
    assert "shuffle" not in _imports_of("append_shuffle")
    assert _cycles({"a": {"b"}, "b": {"a"}}) == ["a -> b -> a"]
