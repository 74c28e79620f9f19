"""Import hook that makes ``lithops.storage.backends.pocket`` and ``...pocket_cache`` resolve
to pocketflow's backends.

Lithops loads a storage backend named ``<name>`` by importing ``lithops.storage.backends.<name>``
(a ``StorageBackend`` class) and ``lithops.storage.backends.<name>.config`` (a ``load_config``
function). pocketflow's backends live in :mod:`pocketflow_lithops.storage` (``pocket``: a
pocketflow job) and :mod:`pocketflow_lithops.cached_storage` (``pocket_cache``: S3 through a
pocketflow cache); this hook adds a meta-path finder that answers for exactly those module names
with small modules that re-export them, so Lithops' installed files are never edited.

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
"""Where the ``pocket`` backend is implemented."""

CACHE_BACKEND_PACKAGE = "lithops.storage.backends.pocket_cache"
"""The module name Lithops imports for ``storage: pocket_cache`` (and ``pocket_cache://`` URLs)."""

CACHE_TARGET_MODULE = "pocketflow_lithops.cached_storage"
"""Where the ``pocket_cache`` backend is implemented."""

# Alias module name -> the module it re-exports from and the names it re-exports.
_EXPORTS = {
    BACKEND_PACKAGE: (TARGET_MODULE, ("StorageBackend",)),
    BACKEND_PACKAGE + ".config": (TARGET_MODULE, ("load_config",)),
    CACHE_BACKEND_PACKAGE: (CACHE_TARGET_MODULE, ("StorageBackend",)),
    CACHE_BACKEND_PACKAGE + ".config": (CACHE_TARGET_MODULE, ("load_config",)),
}
_PACKAGES = (BACKEND_PACKAGE, CACHE_BACKEND_PACKAGE)


class _AliasLoader(importlib.abc.Loader):
    """Fills an alias module with the names it re-exports from the backend module."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # The default module object.

    def exec_module(self, module: ModuleType) -> None:
        target_name, names = _EXPORTS[module.__name__]
        target = importlib.import_module(target_name)
        for name in names:
            setattr(module, name, getattr(target, name))
        module.__all__ = list(names)
        module.__doc__ = f"Lithops' name for {target_name} (see _pocketflow_lithops)."


class PocketBackendFinder(importlib.abc.MetaPathFinder):
    """Finds the ``pocket`` and ``pocket_cache`` storage backend modules of Lithops and
    nothing else."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _EXPORTS:
            return None
        is_package = fullname in _PACKAGES
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
