"""The import structure: no circles between modules of the core or of the ``this`` adapter.

Every import counts, at module level or inside a function (an import deferred into a function
to break a circle is still a circle); imports under ``if TYPE_CHECKING:`` do not (they never
run). Read from the sources with ``ast``, so nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PACKAGES = {
    "pocketflow": ROOT,
    "pocketflow_this": ROOT / "adapters" / "this",
}
"""Packages checked, each with the directory that holds it."""

NATIVE_MODULES = {"pocketflow._core"}
"""Modules without Python source (the native client core)."""


def _modules(package: str, parent: Path) -> dict[str, Path]:
    found = {}
    for path in sorted((parent / package).rglob("*.py")):
        parts = list(path.relative_to(parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for statement in node.body:
                skipped.update(id(inner) for inner in ast.walk(statement))
    return skipped


def _imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The known modules that module ``name`` (at ``path``) imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_nodes(tree)
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in known else base)
    resolved = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_module_imports_itself_through_others(package: str) -> None:
    modules = _modules(package, PACKAGES[package])
    known = set(modules) | NATIVE_MODULES
    graph = {name: _imported(name, path, known) & set(modules) for name, path in modules.items()}
    assert _circles(graph) == []


def test_the_checker_finds_a_circle_through_a_deferred_import(tmp_path: Path) -> None:
    """The check itself: two modules of a package that import each other, one of them only
    inside a function, are a circle; a ``TYPE_CHECKING`` import is not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import g\n\ndef f():\n    return g()\n")
    (package / "b.py").write_text("def g():\n    from pkg import a\n    return a\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n")
    (package / "d.py").write_text("from pkg.c import x\n")
    modules = _modules("pkg", tmp_path)
    graph = {name: _imported(name, path, set(modules)) for name, path in modules.items()}
    assert _circles(graph) == [["pkg.a", "pkg.b"]]
