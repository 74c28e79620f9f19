"""Import hook that makes ``lithops.storage.backends.pocket`` resolve to pocketflow's backend.

Lithops loads a storage backend named ``<name>`` by importing ``lithops.storage.backends.<name>``
(a ``StorageBackend`` class) and ``lithops.storage.backends.<name>.config`` (a ``load_config``
function). pocketflow's backend lives in :mod:`pocketflow_lithops.storage`; this hook
adds a meta-path finder that answers for exactly those two module names with small modules that
re-export it, so Lithops' installed files are never edited.

The ``pocketflow_lithops.pth`` file installed with the package imports this module when any
interpreter starts, which is what makes the backend reachable in Lithops' worker and cleaner
subprocesses. The module is top level and imports nothing of pocketflow, Lithops or pyarrow, so
it costs an interpreter start a few microseconds; the backend itself is imported only when
Lithops asks for it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

BACKEND_PACKAGE = "lithops.storage.backends.pocket"
"""The module name Lithops imports for ``storage: pocket``."""

TARGET_MODULE = "pocketflow_lithops.storage"
"""Where the backend is implemented."""

# Alias module name -> the names it re-exports from TARGET_MODULE.
_EXPORTS = {
    BACKEND_PACKAGE: ("StorageBackend",),
    BACKEND_PACKAGE + ".config": ("load_config",),
}


class _AliasLoader(importlib.abc.Loader):
    """Fills an alias module with the names it re-exports from the backend module."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # The default module object.

    def exec_module(self, module: ModuleType) -> None:
        target = importlib.import_module(TARGET_MODULE)
        names = _EXPORTS[module.__name__]
        for name in names:
            setattr(module, name, getattr(target, name))
        module.__all__ = list(names)
        module.__doc__ = f"Lithops' name for {TARGET_MODULE} (see _pocketflow_lithops)."


class PocketBackendFinder(importlib.abc.MetaPathFinder):
    """Finds the ``pocket`` storage backend modules of Lithops and nothing else."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _EXPORTS:
            return None
        is_package = fullname == BACKEND_PACKAGE
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(), is_package=is_package)
        if is_package:
            # An empty search path: the ``config`` submodule is found by this finder too.
            spec.submodule_search_locations = []
        return spec


def install() -> None:
    """Add the finder to ``sys.meta_path`` once; later calls do nothing."""
    if not any(isinstance(finder, PocketBackendFinder) for finder in sys.meta_path):
        sys.meta_path.append(PocketBackendFinder())


install()
