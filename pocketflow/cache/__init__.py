"""A read-through cache over S3 (Faa$T): S3 objects that runs read again and again are kept in
pocketflow storage, trusted for a validation lease, filled from S3 once per miss, prewarmed
from what the application's last run read, and sized by its working set::

    from pocketflow.cache import S3Source, connect, open_cache

    source = S3Source(endpoint_url="http://127.0.0.1:8333")
    with open_cache("inputs", source, app="wordcount", prewarm=True) as cache:
        spec_json = cache.spec.to_json()                  # what tasks receive
        ...                                               # in any process, no Ray needed:
        with connect(spec_json) as inputs:
            data = inputs.get("my-bucket", "part-00007")  # a hit, or one fill from S3
            parts = inputs.get_many("my-bucket", keys)

The parts, one concern per module: :mod:`~pocketflow.cache.client` (a task's reads and writes:
hits, revalidation, single-flight fills), :mod:`~pocketflow.cache.cache` (the driver: the cache's
life, maintenance, prewarm, the run's record), :mod:`~pocketflow.cache.maintainer` (recency,
eviction), :mod:`~pocketflow.cache.working_set` (working sets, prewarm order, sizing; pure),
:mod:`~pocketflow.cache.source` (the S3 requests, typed errors), :mod:`~pocketflow.cache.records`
(the layout in the cache's job), :mod:`~pocketflow.cache.access_log`,
:mod:`~pocketflow.cache.spec`; the control plane's side is :mod:`pocketflow.control.caches`.
Needs boto3 (``pip install pocketflow[cache]``). Names are imported on first use.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pocketflow.cache.cache import Cache, open_cache
    from pocketflow.cache.client import CacheClient, CacheStats, connect, shared_client
    from pocketflow.cache.source import S3Source, request_counts
    from pocketflow.cache.spec import CacheSpec

__all__ = ["open_cache", "Cache", "connect", "shared_client", "CacheClient", "CacheStats",
           "CacheSpec", "S3Source", "request_counts"]

_LAZY = {"open_cache": "pocketflow.cache.cache", "Cache": "pocketflow.cache.cache",
         "connect": "pocketflow.cache.client", "shared_client": "pocketflow.cache.client",
         "CacheClient": "pocketflow.cache.client",
         "CacheStats": "pocketflow.cache.client", "CacheSpec": "pocketflow.cache.spec",
         "S3Source": "pocketflow.cache.source", "request_counts": "pocketflow.cache.source"}
"""Public names imported on first use, and the module each comes from."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pocketflow.cache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
