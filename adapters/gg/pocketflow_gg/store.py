"""Where a build's objects live: a pocketflow job (the point of this package) or, for the
benchmark's peer, a redis-server. Workers get a *store spec* string and open the store with it:
a pocketflow job handle's JSON, or ``redis://host:port/db?prefix=P``.

Two namespaces: ``gg-blobs`` (values and thunks, keyed by content name, and each thunk's
*plan* under ``plan-<thunk name>``: which inputs to read with DELETE, whether its outputs
PERSIST) and ``gg-reductions`` (thunk reference -> the name it reduced to). Content-named
writes are idempotent: an existing object of that name holds the same bytes, so a second put is
skipped. Keys are the names themselves, at the bucket root, unless the build is scoped to prefix
leases: then a key is ``<prefix>/<name>`` (:mod:`pocketflow_gg.scope`), and the thunk's plan
says where its inputs are and where its outputs go.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Protocol

from pocketflow_gg.errors import GGError, MissingObject

BLOBS = "gg-blobs"
REDUCTIONS = "gg-reductions"
BUCKETS = (BLOBS, REDUCTIONS)
PLAN_PREFIX = "plan-"
"""A thunk's plan is ``plan-<thunk name>`` in ``BLOBS``, next to the thunk (one batch reads
both)."""


def plan_key(thunk_name: str) -> str:
    """The key of a thunk's plan."""
    return PLAN_PREFIX + thunk_name


@dataclass
class IOStats:
    """Time and bytes a process spent on the store, for the per-thunk I/O figures."""

    seconds: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    ops: int = 0
    deleted_bytes: int = 0
    _started: list[float] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"io_s": self.seconds, "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written, "ops": self.ops,
                "deleted_bytes": self.deleted_bytes}


class Store(Protocol):
    """What the driver and the workers need of a key-value store."""

    spec: str
    store_id: str
    stats: IOStats

    def put(self, bucket: str, key: str, data: bytes, *, persist: bool = False,
            overwrite: bool = False) -> bool: ...

    def get(self, bucket: str, key: str, *, delete: bool = False) -> bytes | None: ...

    def get_many(self, bucket: str, keys: list[str], *, delete: bool = False) -> list[bytes]:
        """Every key's bytes in one batch; :class:`MissingObject` if one is absent."""
        ...

    def put_many(self, bucket: str, items: list[tuple[str, bytes]], *, persist: bool = False,
                 overwrite: bool = False) -> None:
        """Store many objects in one batch; keys that exist are skipped (unless
        ``overwrite``)."""
        ...

    def exists(self, bucket: str, key: str) -> bool: ...

    def missing(self, bucket: str, keys: list[str]) -> list[str]:
        """The keys that hold no object, in one batch."""
        ...

    def get_found(self, bucket: str, keys: list[str]) -> dict[str, bytes]:
        """The bytes of the keys that hold an object, in one batch (absent keys are left
        out)."""
        ...

    def is_persistent(self, bucket: str, key: str) -> bool: ...

    def close(self) -> None: ...


class _Timed:
    stats: IOStats

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.stats.seconds += time.perf_counter() - started
            self.stats.ops += 1


class PocketflowStore(_Timed):
    """The build's objects in a pocketflow job: PERSIST and DELETE-on-read are pocketflow's."""

    def __init__(self, handle_json: str, *, client: Any = None) -> None:
        from pocketflow.client import connect
        from pocketflow.handle import JobHandle

        self.spec = handle_json
        self.store_id = JobHandle.from_json(handle_json).job_id
        self.stats = IOStats()
        self._client = client if client is not None else connect(handle_json)
        self._own_client = client is None

    def create_buckets(self) -> None:
        """Create the three buckets (the driver does this once per job)."""
        for bucket in BUCKETS:
            self._client.create_bucket(bucket)

    def put(self, bucket: str, key: str, data: bytes, *, persist: bool = False,
            overwrite: bool = False) -> bool:
        """Store ``data``; False if the key already held an object (and ``overwrite`` is off)."""
        from pocketflow.errors import ObjectExists

        try:
            self._timed(self._client.put, bucket, key, data, persist=persist, overwrite=overwrite)
        except ObjectExists:
            return False
        self.stats.bytes_written += len(data)
        return True

    def get(self, bucket: str, key: str, *, delete: bool = False) -> bytes | None:
        """The object's bytes, or None if it does not exist."""
        from pocketflow.errors import ObjectNotFound

        try:
            data = self._timed(self._client.get, bucket, key, delete=delete)
        except ObjectNotFound:
            return None
        self.stats.bytes_read += len(data)
        if delete:
            self.stats.deleted_bytes += len(data)
        return data

    def get_many(self, bucket: str, keys: list[str], *, delete: bool = False) -> list[bytes]:
        from pocketflow.errors import ObjectNotFound

        if not keys:
            return []
        try:
            datas = self._timed(self._client.get_many, bucket, keys, delete=delete)
        except ObjectNotFound as exc:
            raise MissingObject(f"{bucket}: {exc}") from exc
        size = sum(len(d) for d in datas)
        self.stats.bytes_read += size
        if delete:
            self.stats.deleted_bytes += size
        return list(datas)

    def put_many(self, bucket: str, items: list[tuple[str, bytes]], *, persist: bool = False,
                 overwrite: bool = False) -> None:
        from pocketflow.errors import ObjectExists

        if not items:
            return
        try:
            self._timed(self._client.put_many, bucket, items, persist=persist,
                        overwrite=overwrite)
        except ObjectExists:
            # Content-named objects written before: store the rest one by one.
            for key, data in items:
                self.put(bucket, key, data, persist=persist, overwrite=overwrite)
            return
        self.stats.bytes_written += sum(len(d) for _, d in items)

    def exists(self, bucket: str, key: str) -> bool:
        return bool(self._timed(self._client.exists, bucket, key))

    def missing(self, bucket: str, keys: list[str]) -> list[str]:
        if not keys:
            return []
        # A wait of 0 s is one pipelined lookup per server.
        return list(self._timed(self._client.wait_for, bucket, keys, timeout_s=0))

    def get_found(self, bucket: str, keys: list[str]) -> dict[str, bytes]:
        from pocketflow.errors import ObjectNotFound, PocketflowError

        if not keys:
            return {}
        found: dict[str, bytes] = {}
        for key, outcome in zip(keys, self._timed(self._client.get_each, bucket, keys),
                                strict=True):
            if isinstance(outcome, ObjectNotFound):
                continue
            if isinstance(outcome, PocketflowError):
                raise outcome
            found[key] = outcome
            self.stats.bytes_read += len(outcome)
        return found

    def is_persistent(self, bucket: str, key: str) -> bool:
        return bool(self._client.lookup(bucket, key).persist)

    def close(self) -> None:
        if self._own_client:
            self._client.close()


class RedisStore(_Timed):
    """The same namespaces on a redis-server (the benchmark's peer): ``GETDEL`` for DELETE;
    PERSIST has no meaning there (nothing expires), so outputs are written as any object."""

    def __init__(self, spec: str) -> None:
        import redis

        parsed = urllib.parse.urlsplit(spec)
        if parsed.scheme != "redis" or not parsed.hostname or not parsed.port:
            raise GGError(f"not a redis store spec: {spec!r}")
        query = urllib.parse.parse_qs(parsed.query)
        self.spec = spec
        self.store_id = (query.get("prefix") or ["gg"])[0]
        self.stats = IOStats()
        db = int(parsed.path.lstrip("/") or 0)
        self._redis = redis.Redis(host=parsed.hostname, port=parsed.port, db=db,
                                  socket_timeout=60)

    def _key(self, bucket: str, key: str) -> str:
        return f"{self.store_id}/{bucket}/{key}"

    def put(self, bucket: str, key: str, data: bytes, *, persist: bool = False,
            overwrite: bool = False) -> bool:
        stored = self._timed(self._redis.set, self._key(bucket, key), data, nx=not overwrite)
        if stored:
            self.stats.bytes_written += len(data)
        return bool(stored)

    def get(self, bucket: str, key: str, *, delete: bool = False) -> bytes | None:
        full = self._key(bucket, key)
        data = self._timed(self._redis.getdel if delete else self._redis.get, full)
        if data is not None:
            self.stats.bytes_read += len(data)
            if delete:
                self.stats.deleted_bytes += len(data)
        return data

    def get_many(self, bucket: str, keys: list[str], *, delete: bool = False) -> list[bytes]:
        if not keys:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            (pipe.getdel if delete else pipe.get)(self._key(bucket, key))
        datas = self._timed(pipe.execute)
        for key, data in zip(keys, datas, strict=True):
            if data is None:
                raise MissingObject(f"{bucket}/{key} is not in the store")
        size = sum(len(d) for d in datas)
        self.stats.bytes_read += size
        if delete:
            self.stats.deleted_bytes += size
        return list(datas)

    def put_many(self, bucket: str, items: list[tuple[str, bytes]], *, persist: bool = False,
                 overwrite: bool = False) -> None:
        if not items:
            return
        pipe = self._redis.pipeline(transaction=False)
        for key, data in items:
            pipe.set(self._key(bucket, key), data, nx=not overwrite)
        stored = self._timed(pipe.execute)
        self.stats.bytes_written += sum(len(d) for (_, d), ok in zip(items, stored, strict=True)
                                        if ok)

    def exists(self, bucket: str, key: str) -> bool:
        return bool(self._timed(self._redis.exists, self._key(bucket, key)))

    def missing(self, bucket: str, keys: list[str]) -> list[str]:
        if not keys:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._key(bucket, key))
        found = self._timed(pipe.execute)
        return [key for key, there in zip(keys, found, strict=True) if not there]

    def get_found(self, bucket: str, keys: list[str]) -> dict[str, bytes]:
        if not keys:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.get(self._key(bucket, key))
        datas = self._timed(pipe.execute)
        found = {key: data for key, data in zip(keys, datas, strict=True) if data is not None}
        self.stats.bytes_read += sum(len(d) for d in found.values())
        return found

    def is_persistent(self, bucket: str, key: str) -> bool:
        return False

    def close(self) -> None:
        self._redis.close()


def open_store(spec: str) -> Store:
    """The store a spec names (see the module doc)."""
    if spec.startswith("redis://"):
        return RedisStore(spec)
    if spec.lstrip().startswith("{"):
        return PocketflowStore(spec)
    raise GGError(f"unknown store spec {spec[:40]!r}: a job handle's JSON or redis://...")


def need(store: Store, bucket: str, key: str, *, delete: bool = False) -> bytes:
    """``store.get`` that raises :class:`MissingObject` for an absent key."""
    data = store.get(bucket, key, delete=delete)
    if data is None:
        raise MissingObject(f"{bucket}/{key} is not in the store")
    return data


@dataclass(frozen=True)
class Plan:
    """What the driver tells the worker of one thunk besides its name, through the store.

    ``located`` maps an input's name to the prefix it is stored under (inputs not named are at
    the bucket root); ``outputs_at`` is the prefix the outputs and reductions go under (``""``:
    the root). Both are set only for a build scoped to prefix leases
    (:mod:`pocketflow_gg.scope`)."""

    delete_inputs: tuple[str, ...] = ()
    persist_outputs: bool = False
    located: tuple[tuple[str, str], ...] = ()
    outputs_at: str = ""

    def to_bytes(self) -> bytes:
        raw: dict[str, Any] = {"delete": list(self.delete_inputs),
                               "persist": self.persist_outputs}
        if self.located:
            raw["at"] = dict(self.located)
        if self.outputs_at:
            raw["out"] = self.outputs_at
        return json.dumps(raw).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Plan:
        raw = json.loads(data)
        return cls(delete_inputs=tuple(raw.get("delete", ())),
                   persist_outputs=bool(raw.get("persist", False)),
                   located=tuple(sorted(raw.get("at", {}).items())),
                   outputs_at=str(raw.get("out", "")))
