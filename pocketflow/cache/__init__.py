"""A read-through cache over S3 (Faa$T): S3 objects read again and again are kept in pocketflow
storage, validated by lease, filled once per miss, prewarmed from what the last run read.
"""

from typing import Any

_LAZY = {"connect": "pocketflow.cache.client", "CacheClient": "pocketflow.cache.client",
         "CacheSpec": "pocketflow.cache.spec", "S3Source": "pocketflow.cache.source"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pocketflow.cache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
