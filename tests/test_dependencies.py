"""Every package declares what it imports (setup.cfg), so an install by role has what its code
needs and nothing a role does not use:

- the core (``pocketflow/``): each third-party module imported anywhere (deferred imports
  included) is a requirement of an extra, and ``install_requires`` stays empty: the client and
  the server binary need nothing but the wheel (the install smoke test runs them from a
  virtualenv that has nothing else);
- each adapter (``adapters/<name>/``): each third-party module it imports is a requirement of
  its own, or of one of its extras, or comes with the ``pocketflow`` extra it requires.

Modules map to distributions through the installed environment's metadata (``import yaml`` is
PyYAML), so this runs where ``make install`` installed everything.
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

CHECKOUT = Path(__file__).resolve().parent.parent
OWN_MODULES = {"pocketflow", "pocketflow_lithops", "_pocketflow_lithops", "pocketflow_gg",
               "pocketflow_this", "pocketflow_this_examples", "benchmarks"}
"""The project's own packages (``benchmarks`` is the source checkout's, which ``pocketflow
bench`` puts on the path)."""
ADAPTER_SOURCES = {
    "lithops": ["pocketflow_lithops", "_pocketflow_lithops.py"],
    "gg": ["pocketflow_gg"],
    "this": ["pocketflow_this", "examples"],
}
"""Each adapter's importable code, relative to its folder."""


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def third_party_imports(paths: list[Path]) -> dict[str, str]:
    """Top-level third-party module -> one file that imports it, over every ``.py`` file."""
    found: dict[str, str] = {}
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in OWN_MODULES:
                    found.setdefault(top, path.relative_to(CHECKOUT).as_posix())
    return found


def requirements(setup_cfg: Path) -> tuple[list[Requirement], dict[str, list[Requirement]]]:
    """``install_requires`` and ``extras_require`` of a setup.cfg."""
    config = configparser.ConfigParser()
    config.read(setup_cfg)

    def parse(text: str) -> list[Requirement]:
        return [Requirement(line.strip()) for line in text.splitlines()
                if line.strip() and not line.strip().startswith("#")]

    install = parse(config.get("options", "install_requires", fallback=""))
    extras = ({name: parse(value) for name, value in config.items("options.extras_require")}
              if config.has_section("options.extras_require") else {})
    return install, extras


CORE_INSTALL, CORE_EXTRAS = requirements(CHECKOUT / "setup.cfg")


def expanded(reqs: list[Requirement]) -> set[str]:
    """Distribution names that ``reqs`` install, ``pocketflow[extra]`` expanded."""
    names: set[str] = set()
    for req in reqs:
        names.add(normalized(req.name))
        if normalized(req.name) == "pocketflow":
            names |= expanded(CORE_INSTALL)
            for extra in req.extras:
                names |= expanded(CORE_EXTRAS[extra])
    return names


def undeclared(imports: dict[str, str], declared: set[str]) -> list[str]:
    """The imported modules none of whose distributions is declared."""
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for module, where in sorted(imports.items()):
        candidates = {normalized(d) for d in distributions.get(module, [module])}
        if not candidates & declared:
            missing.append(f"{module} (imported by {where}; from {sorted(candidates)})")
    return missing


def test_the_core_requires_nothing_and_its_extras_cover_its_imports() -> None:
    assert CORE_INSTALL == []
    imports = third_party_imports([CHECKOUT / "pocketflow"])
    assert {"ray", "cryptography", "numpy"} <= set(imports)  # the walk sees deferred imports
    declared = set().union(*(expanded(reqs) for reqs in CORE_EXTRAS.values()))
    assert undeclared(imports, declared) == []


@pytest.mark.parametrize("adapter", sorted(ADAPTER_SOURCES))
def test_each_adapter_declares_what_it_imports(adapter: str) -> None:
    folder = CHECKOUT / "adapters" / adapter
    install, extras = requirements(folder / "setup.cfg")
    assert "pocketflow" in {normalized(r.name) for r in install}
    imports = third_party_imports([folder / source for source in ADAPTER_SOURCES[adapter]])
    assert imports, "the walk found no third-party import"
    declared = expanded(install) | set().union(set(), *(expanded(r) for r in extras.values()))
    assert undeclared(imports, declared) == []


def test_an_adapter_requires_a_pocketflow_the_unrelated_pypi_project_cannot_satisfy() -> None:
    # PyPI's project of the same name is at 0.0.x: an unpinned requirement could resolve to it.
    for adapter in ADAPTER_SOURCES:
        install, _ = requirements(CHECKOUT / "adapters" / adapter / "setup.cfg")
        core = next(r for r in install if normalized(r.name) == "pocketflow")
        assert not core.specifier.contains("0.0.3"), adapter
        assert core.specifier.contains("0.1.0"), adapter
