"""The Lithops storage backend ``pocket_cache``: S3 read through a pocketflow cache
(:mod:`pocketflow.cache`), so a Lithops job's inputs are read from pocketflow while they are
cached and from S3 once per miss, and prewarmed from what the last run read.

Lithops reads a map's object inputs through the storage backend their URL names, in the driver
(listing, sizes) and in every worker (the object or its chunk). Name the inputs
``pocket_cache://<s3 bucket>/<key or prefix>`` and give the executor the cache's spec::

    from pocketflow.cache import open_cache
    from pocketflow_lithops.cached_storage import cached_storage_config

    with open_cache("inputs", source, app="wordcount", prewarm=True) as cache:
        config = cached_storage_config(cache, lithops_config(job.handle))  # any Lithops config
        fexec = lithops.FunctionExecutor(config=config)
        fexec.map(count_words, ["pocket_cache://corpus/part-00000", ...])  # obj.data_stream

A job whose calls each read many keys uses the process's cache client directly:
``inputs(spec_json).get_many(bucket, keys)``. As the executor's own storage
(``lithops: {storage: pocket_cache}``) it keeps Lithops' job data in S3, written through.

The backend follows S3: reads of missing keys raise Lithops' ``StorageNoSuchKeyError``, a
delete of a missing key is not an error, listings are S3's (not cached), writes and deletes go
through to S3 and update the cache. Every other S3 failure is pocketflow's typed
:class:`~pocketflow.errors.S3Error`. The section of Lithops' configuration::

    pocket_cache:
      spec: '<CacheSpec JSON>'      # or spec_file: /path/to/spec.json
      storage_bucket: lithops       # only when it is the executor's storage: an S3 bucket
"""

from __future__ import annotations

import fnmatch
import io
import json
import logging
import os
from collections.abc import Iterable
from typing import Any

from lithops.storage.utils import StorageNoSuchKeyError

from pocketflow.cache.client import CacheClient, shared_client
from pocketflow.cache.spec import CacheSpec
from pocketflow.errors import InvalidRequest, S3BucketNotFound, S3ObjectNotFound

__all__ = ["BACKEND_NAME", "PocketCacheStorageBackend", "StorageBackend", "load_config",
           "cached_storage_config", "inputs", "URL_SCHEME"]

logger = logging.getLogger(__name__)

BACKEND_NAME = "pocket_cache"
"""The storage backend name in Lithops' configuration and in object URLs."""

URL_SCHEME = f"{BACKEND_NAME}://"
"""How a map's object inputs read through the cache are named."""

GENERATED_STORAGE_BUCKET = "lithops-pocket-cache"
"""Lithops' storage bucket when the section names none."""

_OPEN_RANGE_BYTES = 1 << 62


def cached_storage_config(cache: Any, config: dict[str, Any] | None = None, *,
                          storage_bucket: str | None = None) -> dict[str, Any]:
    """``config`` (a Lithops configuration, copied) with the ``pocket_cache`` section for
    ``cache`` (a :class:`~pocketflow.cache.Cache`, its :class:`CacheSpec` or its JSON).
    ``storage_bucket`` is needed only to make it the executor's storage as well."""
    spec = getattr(cache, "spec", cache)
    spec_json = spec.to_json() if isinstance(spec, CacheSpec) else str(spec)
    CacheSpec.from_json(spec_json)  # fail here, not in a worker
    merged = dict(config or {})
    section: dict[str, Any] = {"spec": spec_json}
    if storage_bucket is not None:
        section["storage_bucket"] = storage_bucket
    merged[BACKEND_NAME] = section
    return merged


def load_config(config_data: dict[str, Any]) -> None:
    """Check the ``pocket_cache`` section of a Lithops configuration (Lithops calls it)."""
    section = config_data.get(BACKEND_NAME)
    if not isinstance(section, dict):
        raise InvalidRequest(f"the '{BACKEND_NAME}' section is mandatory in the Lithops "
                             "configuration to read through a cache (see "
                             "pocketflow_lithops.cached_storage)")
    section["spec"] = _spec_json(section)
    section.pop("spec_file", None)


def _spec_json(section: dict[str, Any]) -> str:
    spec = section.get("spec")
    if spec is None and section.get("spec_file"):
        with open(os.path.expanduser(str(section["spec_file"])), encoding="utf-8") as f:
            spec = f.read()
    if spec is None:
        raise InvalidRequest(f"'spec' or 'spec_file' is mandatory under '{BACKEND_NAME}'")
    if isinstance(spec, dict):
        spec = json.dumps(spec)
    return CacheSpec.from_json(str(spec)).to_json()


def inputs(spec_json: str) -> CacheClient:
    """This process's client of the cache of ``spec_json``
    (:func:`pocketflow.cache.shared_client`): for calls that read many keys at once."""
    return shared_client(spec_json)


class PocketCacheStorageBackend:
    """Lithops' storage interface over S3 through a pocketflow cache."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self._spec_json = _spec_json(config)
        self._cache = inputs(self._spec_json)

    def get_client(self) -> CacheClient:
        """The :class:`~pocketflow.cache.CacheClient` behind this backend."""
        return self._cache

    # -- buckets -------------------------------------------------------------------------------

    def generate_bucket_name(self) -> str:
        """The S3 bucket Lithops keeps its job data in when this is the executor's storage and
        the section names none (Lithops asks; an inputs-only use never writes there)."""
        return GENERATED_STORAGE_BUCKET

    def create_bucket(self, bucket_name: str) -> None:
        self._cache.source_store.create_bucket(bucket_name)

    def head_bucket(self, bucket_name: str) -> dict[str, Any]:
        try:
            self._cache.source_store.head_bucket(bucket_name)
        except S3BucketNotFound:
            raise StorageNoSuchKeyError(bucket_name, "") from None
        return {"ResponseMetadata": {"HTTPStatusCode": 200}}

    # -- objects -------------------------------------------------------------------------------

    def put_object(self, bucket_name: str, key: str, data: Any) -> None:
        """Write through the cache to S3 (str, bytes-like or a binary file object)."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        elif hasattr(data, "read"):
            data = data.read()
            if isinstance(data, str):
                data = data.encode("utf-8")
        self._cache.put(bucket_name, key, data)

    def get_object(self, bucket_name: str, key: str, stream: bool = False,
                   extra_get_args: dict[str, Any] | None = None) -> Any:
        """The object's bytes through the cache, or a file object with ``stream``;
        ``extra_get_args={'Range': 'bytes=L-H'}`` reads a part (also ``L-`` and ``-N``)."""
        byte_range = (extra_get_args or {}).get("Range")
        try:
            if byte_range is None:
                data = self._cache.get(bucket_name, key)
            else:
                data = self._get_range(bucket_name, key, str(byte_range))
        except (S3ObjectNotFound, S3BucketNotFound):
            raise StorageNoSuchKeyError(bucket_name, key) from None
        finally:
            self._cache.flush()
        return io.BytesIO(data) if stream else data

    def _get_range(self, bucket_name: str, key: str, byte_range: str) -> bytes:
        from pocketflow_lithops.storage import _parse_range

        first, last = _parse_range(byte_range)
        if first is None:
            assert last is not None
            size = self._cache.stat(bucket_name, key)[1]
            first, last = max(size - last, 0), size - 1
            if last < first:
                return b""
        if last is None:
            return self._cache.get_range(bucket_name, key, first, _OPEN_RANGE_BYTES)
        if last < first:
            raise InvalidRequest(f"Range {byte_range!r} ends before it starts")
        return self._cache.get_range(bucket_name, key, first, last - first + 1)

    def head_object(self, bucket_name: str, key: str) -> dict[str, Any]:
        """``{'content-length', 'ETag'}``: from the cache while the lease holds, else S3's
        HEAD (nothing is fetched)."""
        try:
            etag, size = self._cache.stat(bucket_name, key)
        except (S3ObjectNotFound, S3BucketNotFound):
            raise StorageNoSuchKeyError(bucket_name, key) from None
        return {"content-length": str(size), "ETag": f'"{etag}"'}

    def delete_object(self, bucket_name: str, key: str) -> None:
        """Delete in S3 (a missing key is not an error) and in the cache."""
        self._cache.delete(bucket_name, key)

    def delete_objects(self, bucket_name: str, key_list: Iterable[str]) -> None:
        for key in dict.fromkeys(key_list):
            self.delete_object(bucket_name, key)

    # -- listings ------------------------------------------------------------------------------

    def list_objects(self, bucket_name: str, prefix: str | None = None,
                     match_pattern: str | None = None) -> list[dict[str, Any]]:
        """``[{'Key', 'Size'}, ...]`` under ``prefix`` as S3 lists them now; a missing bucket
        lists nothing."""
        try:
            found = self._cache.list(bucket_name, prefix or "")
        except S3BucketNotFound:
            return []
        objects = [{"Key": key, "Size": size} for key, size in found]
        if match_pattern is not None:
            objects = [o for o in objects if fnmatch.fnmatchcase(o["Key"], match_pattern)]
        return objects

    def list_keys(self, bucket_name: str, prefix: str | None = None) -> list[str]:
        return [o["Key"] for o in self.list_objects(bucket_name, prefix)]

    # -- files ---------------------------------------------------------------------------------

    def upload_file(self, file_name: str, bucket: str, key: str | None = None,
                    extra_args: dict[str, Any] | None = None, config: Any = None) -> bool:
        key = key if key is not None else os.path.basename(file_name)
        try:
            with open(file_name, "rb") as f:
                self._cache.put(bucket, key, f.read())
        except Exception:  # noqa: BLE001 - Lithops' interface reports failure as False
            logger.error("upload of %s to %s/%s failed", file_name, bucket, key, exc_info=True)
            return False
        return True

    def download_file(self, bucket: str, key: str, file_name: str | None = None,
                      extra_args: dict[str, Any] | None = None, config: Any = None) -> bool:
        file_name = file_name if file_name is not None else key
        try:
            directory = os.path.dirname(file_name)
            if directory:
                os.makedirs(directory, exist_ok=True)
            data = self._cache.get(bucket, key)
            with open(file_name, "wb") as f:
                f.write(data)
        except Exception:  # noqa: BLE001 - Lithops' interface reports failure as False
            logger.error("download of %s/%s to %s failed", bucket, key, file_name,
                         exc_info=True)
            return False
        finally:
            self._cache.flush()
        return True


StorageBackend = PocketCacheStorageBackend
"""The name Lithops looks up in a storage backend module."""
