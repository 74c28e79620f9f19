"""The Lithops storage backend ``pocket``: Lithops' storage interface over a pocketflow job.

Use it by registering a pocketflow job and giving Lithops its handle::

    from pocketflow_lithops.storage import lithops_config

    job = pocketflow.register_job("etl", hints)
    fexec = lithops.FunctionExecutor(config=lithops_config(job.handle))

Lithops imports the backend as ``lithops.storage.backends.pocket`` (the import hook in
``_pocketflow_lithops`` provides that name in every interpreter, workers included). Its
configuration section is::

    pocket:
      handle: '<JobHandle JSON>'     # or handle_file: /path/to/handle.json
      storage_bucket: lithops        # the bucket Lithops keeps its job data in (default)
      persist_buckets: [outputs]     # user buckets whose objects outlive the job (default none)

Lithops buckets are pocketflow buckets of the same name in the job. A bucket is created the first
time something is put into it, so a fresh job needs no set-up. The put flags follow from what an
object is (:mod:`pocketflow_lithops.object_kinds`): a job's call arguments and a call's start
marker are write-once, everything else is overwritten as in S3; only user objects in
``persist_buckets`` are written with PERSIST; nothing is read with DELETE, since no kind is read
exactly once in every code path (Lithops deletes a job's objects itself). Missing keys
raise Lithops' own :class:`~lithops.storage.utils.StorageNoSuchKeyError`; deleting a missing key
is not an error, as in S3. Workers talk straight to the storage servers with the handle, never to
Ray. Lithops forks its workers right after using the storage; a before-fork hook disconnects the
cached clients so that the children can open gRPC channels of their own.
"""

from __future__ import annotations

import fnmatch
import io
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from lithops.storage.utils import StorageNoSuchKeyError

from pocketflow.client import Client
from pocketflow.errors import (
    BucketExists,
    BucketNotFound,
    InvalidRequest,
    NotFound,
    ObjectNotFound,
    PocketflowError,
)
from pocketflow.handle import JobHandle
from pocketflow_lithops.object_kinds import WriteFlags, object_kind, write_flags
from pocketflow_lithops.worker_clients import ClientCache

__all__ = [
    "BACKEND_NAME",
    "PocketStorageBackend",
    "StorageBackend",
    "load_config",
    "lithops_config",
]

logger = logging.getLogger(__name__)

BACKEND_NAME = "pocket"
"""The storage backend name in Lithops' configuration (``lithops: {storage: pocket}``)."""

STORAGE_BUCKET_DEFAULT = "lithops"
"""The pocketflow bucket Lithops keeps function payloads, statuses and results in."""

MONITORING_INTERVAL_DEFAULT_S = 0.1
"""How often Lithops' storage monitor lists a job's status keys.

Lithops' default is 1-2 s, made for object stores that bill per LIST; a listing here is one
pipelined action per server, so polling every 100 ms costs little and keeps short jobs short.
"""

DELETE_THREADS_MAX = 8
"""``delete_objects`` runs at most this many deletes at once (they share pipelined sessions)."""

CLIENTS_CACHED_MAX = 8
"""Clients kept per process, one per distinct handle; Lithops builds many backend objects."""

_OPEN_RANGE_BYTES = 1 << 62
"""The length asked for by an open-ended Range (``bytes=L-``); the read stops at the end."""

_T = TypeVar("_T")
_clients = ClientCache(CLIENTS_CACHED_MAX)


def lithops_config(
    handle: JobHandle | str,
    *,
    storage_bucket: str = STORAGE_BUCKET_DEFAULT,
    persist_buckets: Iterable[str] = (),
    compute_backend: str = "localhost",
    runtime: str | None = None,
    monitoring_interval_s: float = MONITORING_INTERVAL_DEFAULT_S,
    log_level: str | None = None,
) -> dict[str, Any]:
    """A Lithops configuration dict whose storage is the pocketflow job of ``handle``.

    With ``compute_backend="localhost"`` (the default) the workers run as subprocesses of
    ``runtime`` (default ``sys.executable``) with Lithops' version-1 localhost executor.
    Objects put into ``persist_buckets`` (user buckets, never ``storage_bucket``) are written with
    PERSIST and outlive the job. Merge more Lithops settings into the returned dict as needed.
    """
    handle_json = handle.to_json() if isinstance(handle, JobHandle) else str(handle)
    JobHandle.from_json(handle_json)  # Fail here, not in a worker, on a malformed handle.
    lithops_section: dict[str, Any] = {
        "backend": compute_backend,
        "storage": BACKEND_NAME,
        "monitoring_interval": monitoring_interval_s,
    }
    if log_level is not None:
        lithops_section["log_level"] = log_level
    section: dict[str, Any] = {
        "handle": handle_json,
        "storage_bucket": storage_bucket,
        "persist_buckets": list(persist_buckets),
    }
    section["persist_buckets"] = _persist_buckets(section)  # Fail here, not in a worker.
    config: dict[str, Any] = {"lithops": lithops_section, BACKEND_NAME: section}
    if compute_backend == "localhost":
        config["localhost"] = {"runtime": runtime or sys.executable, "version": 1}
    return config


def load_config(config_data: dict[str, Any]) -> None:
    """Check and complete the ``pocket`` section of a Lithops configuration (Lithops calls it).

    Requires ``handle`` (a JobHandle's JSON, or the dict it encodes) or ``handle_file``; fills in
    ``storage_bucket``, ``persist_buckets`` (checked: a list of bucket names without the storage
    bucket) and a short ``monitoring_interval`` unless the user set them.
    """
    section = config_data.get(BACKEND_NAME)
    if not isinstance(section, dict):
        raise InvalidRequest(
            f"the '{BACKEND_NAME}' section is mandatory in the Lithops configuration "
            "when storage is 'pocket' (see pocketflow_lithops.storage)"
        )
    section["handle"] = _handle_json(section)
    section.pop("handle_file", None)
    section.setdefault("storage_bucket", STORAGE_BUCKET_DEFAULT)
    section["persist_buckets"] = _persist_buckets(section)
    lithops_section = config_data.setdefault("lithops", {})
    lithops_section.setdefault("monitoring_interval", MONITORING_INTERVAL_DEFAULT_S)


def _handle_json(section: dict[str, Any]) -> str:
    """The handle of a ``pocket`` section as checked JSON."""
    handle = section.get("handle")
    if handle is None and section.get("handle_file"):
        with open(os.path.expanduser(str(section["handle_file"])), encoding="utf-8") as f:
            handle = f.read()
    if handle is None:
        raise InvalidRequest(f"'handle' or 'handle_file' is mandatory under '{BACKEND_NAME}'")
    if isinstance(handle, JobHandle):
        return handle.to_json()
    if isinstance(handle, dict):
        handle = json.dumps(handle)
    return JobHandle.from_json(str(handle)).to_json()


def _persist_buckets(section: dict[str, Any]) -> list[str]:
    """The checked ``persist_buckets`` of a ``pocket`` section (a list of bucket names).

    Lithops' storage bucket may not be one: Lithops' own objects there are dead once the job ends
    and would only hold capacity until their PERSIST TTL.
    """
    buckets = section.get("persist_buckets") or []
    if not isinstance(buckets, (list, tuple)) or not all(isinstance(b, str) and b for b in buckets):
        raise InvalidRequest(f"'persist_buckets' must be a list of bucket names, got {buckets!r}")
    storage_bucket = section.get("storage_bucket", STORAGE_BUCKET_DEFAULT)
    if storage_bucket in buckets:
        raise InvalidRequest(
            f"'persist_buckets' may not hold the storage bucket {storage_bucket!r}, where Lithops "
            "keeps its job data; put outputs that must outlive the job in a bucket of their own"
        )
    return list(dict.fromkeys(buckets))


def _client_for(handle_json: str) -> Client:
    """The process's client for a handle: one per handle, at most ``CLIENTS_CACHED_MAX``.

    The cache disconnects its clients before the process forks (Lithops forks its workers and a
    process per call right after using the storage).
    """
    return _clients.get(handle_json)


def _parse_range(header: str) -> tuple[int | None, int | None]:
    """``'bytes=L-H'`` -> ``(L, H)`` (inclusive); ``'bytes=L-'`` -> ``(L, None)``;
    ``'bytes=-N'`` -> ``(None, N)`` (the last N bytes)."""
    unit, sep, spec = header.strip().partition("=")
    first, dash, last = spec.strip().partition("-")
    if unit.strip() != "bytes" or not sep or not dash or "," in spec:
        raise InvalidRequest(f"unsupported Range {header!r}: expected 'bytes=L-H'")
    try:
        if not first:
            return None, int(last)
        return int(first), int(last) if last else None
    except ValueError as exc:
        raise InvalidRequest(f"malformed Range {header!r}") from exc


class PocketStorageBackend:
    """Lithops' storage interface over one pocketflow job; Lithops builds it from its config."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self._handle_json = _handle_json(config)
        self._storage_bucket = str(config.get("storage_bucket", STORAGE_BUCKET_DEFAULT))
        self._persist_buckets = frozenset(_persist_buckets(config))
        self._client = _client_for(self._handle_json)
        logger.debug("pocket storage backend for %r", self._client)

    def get_client(self) -> Client:
        """The pocketflow :class:`~pocketflow.client.Client` behind this backend."""
        return self._client

    # -- buckets ---------------------------------------------------------------------------------

    def create_bucket(self, bucket_name: str) -> None:
        """Create the bucket unless it exists."""
        try:
            self._client.create_bucket(bucket_name)
        except BucketExists:
            pass

    def head_bucket(self, bucket_name: str) -> dict[str, Any]:
        """``{'ResponseMetadata': {'HTTPStatusCode': 200}}``, or StorageNoSuchKeyError."""
        try:
            next(iter(self._client.enumerate(bucket_name, page_size=1)), None)
        except BucketNotFound:
            raise StorageNoSuchKeyError(bucket_name, "") from None
        return {"ResponseMetadata": {"HTTPStatusCode": 200}}

    # -- objects ---------------------------------------------------------------------------------

    def write_flags(self, bucket_name: str, key: str) -> WriteFlags:
        """The put flags of ``bucket_name/key``, from the kind of object it is."""
        kind = object_kind(bucket_name, key, storage_bucket=self._storage_bucket)
        return write_flags(kind, persist_bucket=bucket_name in self._persist_buckets)

    def put_object(self, bucket_name: str, key: str, data: Any) -> None:
        """Store ``data`` (str, bytes-like or binary file object) with the flags of its kind.

        A write-once kind raises :class:`~pocketflow.errors.ObjectExists` if the key is held;
        the others replace what is there.
        """
        flags = self.write_flags(bucket_name, key)
        if isinstance(data, str):
            data = data.encode("utf-8")
        elif isinstance(data, io.TextIOBase):
            data = data.read().encode("utf-8")
        # A binary stream is uploaded block by block, never read whole.
        stream = data if hasattr(data, "read") else None
        self._with_bucket(bucket_name, lambda: self._client.put(
            bucket_name, key, data, persist=flags.persist, overwrite=flags.overwrite
        ), stream=stream)

    def get_object(
        self,
        bucket_name: str,
        key: str,
        stream: bool = False,
        extra_get_args: dict[str, Any] | None = None,
    ) -> Any:
        """The object's bytes, or a binary file object with ``stream``.

        ``extra_get_args={'Range': 'bytes=L-H'}`` reads bytes L..H inclusive (also ``bytes=L-``
        and ``bytes=-N``), cut at the object's end.
        """
        byte_range = (extra_get_args or {}).get("Range")
        try:
            if byte_range is None:
                if stream:
                    return self._client.open(bucket_name, key, "rb")
                return self._client.get(bucket_name, key)
            data = self._get_range(bucket_name, key, str(byte_range))
        except NotFound:
            raise StorageNoSuchKeyError(bucket_name, key) from None
        return io.BytesIO(data) if stream else data

    def _get_range(self, bucket_name: str, key: str, byte_range: str) -> bytes:
        first, last = _parse_range(byte_range)
        if first is None:
            assert last is not None
            size = self._client.lookup(bucket_name, key).size
            first, last = max(size - last, 0), size - 1
            if last < first:
                return b""
        if last is None:
            # get_range cuts at the object's end, like a slice: no size lookup needed.
            return self._client.get_range(bucket_name, key, first, _OPEN_RANGE_BYTES)
        if last < first:
            raise InvalidRequest(f"Range {byte_range!r} ends before it starts")
        return self._client.get_range(bucket_name, key, first, last - first + 1)

    def head_object(self, bucket_name: str, key: str) -> dict[str, Any]:
        """``{'content-length': '<size>'}``, or StorageNoSuchKeyError."""
        try:
            info = self._client.lookup(bucket_name, key)
        except NotFound:
            raise StorageNoSuchKeyError(bucket_name, key) from None
        return {"content-length": str(info.size)}

    def delete_object(self, bucket_name: str, key: str) -> None:
        """Delete an object; deleting a missing one is not an error (as in S3)."""
        try:
            self._client.delete(bucket_name, key)
        except (ObjectNotFound, BucketNotFound):
            pass

    def delete_objects(self, bucket_name: str, key_list: Iterable[str]) -> None:
        """Delete many objects, up to ``DELETE_THREADS_MAX`` at once; missing ones are skipped."""
        keys = list(dict.fromkeys(key_list))
        if len(keys) <= 1:
            for key in keys:
                self.delete_object(bucket_name, key)
            return
        with ThreadPoolExecutor(min(DELETE_THREADS_MAX, len(keys))) as pool:
            for _ in pool.map(lambda key: self.delete_object(bucket_name, key), keys):
                pass

    # -- listings --------------------------------------------------------------------------------

    def list_objects(
        self, bucket_name: str, prefix: str | None = None, match_pattern: str | None = None
    ) -> list[dict[str, Any]]:
        """``[{'Key': key, 'Size': size}, ...]`` of the keys that start with ``prefix``.

        ``prefix`` is a plain string prefix: ``/`` is not a delimiter, so ``a/b`` lists ``a/b/c``
        and ``a/b_c`` alike. ``match_pattern`` (a glob) filters further. A missing bucket lists
        nothing.
        """
        try:
            infos = self._client.list(bucket_name, prefix or "")
        except BucketNotFound:
            return []
        objects = [{"Key": info.key, "Size": info.size} for info in infos]
        if match_pattern is not None:
            objects = [o for o in objects if fnmatch.fnmatchcase(o["Key"], match_pattern)]
        return objects

    def list_keys(self, bucket_name: str, prefix: str | None = None) -> list[str]:
        """The keys that start with ``prefix`` (see :meth:`list_objects`), sorted."""
        return [o["Key"] for o in self.list_objects(bucket_name, prefix)]

    # -- files -----------------------------------------------------------------------------------

    def upload_file(
        self,
        file_name: str,
        bucket: str,
        key: str | None = None,
        extra_args: dict[str, Any] | None = None,
        config: Any = None,
    ) -> bool:
        """Store a local file (memory-mapped, not read whole) with the flags of its kind;
        ``False`` if that failed."""
        key = key if key is not None else os.path.basename(file_name)
        flags = self.write_flags(bucket, key)
        try:
            self._with_bucket(bucket, lambda: self._client.put_file(
                bucket, key, file_name, persist=flags.persist, overwrite=flags.overwrite
            ))
        except (OSError, PocketflowError):
            logger.error("upload of %s to %s/%s failed", file_name, bucket, key, exc_info=True)
            return False
        return True

    def download_file(
        self,
        bucket: str,
        key: str,
        file_name: str | None = None,
        extra_args: dict[str, Any] | None = None,
        config: Any = None,
    ) -> bool:
        """Write an object to a local file (directories created); ``False`` if that failed."""
        file_name = file_name if file_name is not None else key
        try:
            directory = os.path.dirname(file_name)
            if directory:
                os.makedirs(directory, exist_ok=True)
            self._client.get_file(bucket, key, file_name)
        except (OSError, PocketflowError):
            logger.error("download of %s/%s to %s failed", bucket, key, file_name, exc_info=True)
            return False
        return True

    # -- helpers ---------------------------------------------------------------------------------

    def _with_bucket(
        self, bucket_name: str, write: Callable[[], _T], *, stream: Any = None
    ) -> _T:
        """Run a write; if the bucket does not exist yet, create it and write once more.

        A ``stream`` the failed attempt may have read from is first sought back to where it
        was; one that cannot seek fails with the BucketNotFound.
        """
        start = _position(stream)
        try:
            return write()
        except BucketNotFound:
            if stream is not None and (start is None or not _seek(stream, start)):
                raise
        self.create_bucket(bucket_name)
        return write()


def _position(stream: Any) -> int | None:
    """Where a seekable stream is; ``None`` for anything else."""
    try:
        return int(stream.tell()) if stream is not None and stream.seekable() else None
    except (AttributeError, OSError, ValueError):
        return None


def _seek(stream: Any, position: int) -> bool:
    """Seek a stream back to ``position``; whether that worked."""
    try:
        stream.seek(position)
    except (AttributeError, OSError, ValueError):
        return False
    return True


StorageBackend = PocketStorageBackend
"""The name Lithops looks up in a storage backend module."""
