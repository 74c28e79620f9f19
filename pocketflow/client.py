"""The pocketflow client: a job's tasks put and get objects straight on its storage servers.

::

    with pocketflow.connect(handle) as pf:
        pf.create_bucket("shuffle")
        pf.put("shuffle", "map-3/part-7", payload)
        data = pf.get("shuffle", "map-3/part-7", delete=True)

Where things go. Block 0 of every object (a small object's bytes, or a large object's manifest)
lives on the server that :mod:`pocketflow.placement` picks for ``(key, 0)``; PERSIST objects are
placed over the job's long-running servers instead. A large object's data block ``i`` lives on the
server picked for ``(key, i)`` (over the long-running servers for PERSIST objects), so large
objects are striped over the job and read and written in parallel.

Reads look for block 0 on the ephemeral placement first, then on the PERSIST placement if that
is another server, so a reader need not know how an object was written. After the job's weight map
has changed (epoch > 1), a key that is not found where the current map puts it is also looked for
on the other servers of the map in rendezvous order, because data is never moved when a job is
resized; a job whose map never changed pays nothing for this. Once the job has lost a server to a
failure (the map's ``lost`` list), a read of a key (or a data block) that no live server of the
map holds raises :class:`DataUnavailable` naming a lost server, not :class:`ObjectNotFound`: it
may have been on the lost server, and the client cannot tell.

Small objects (up to ``SMALL_OBJECT_MAX_BYTES``) and every block-0 operation travel over pipelined
DoExchange sessions; data blocks over DoPut and DoGet streams, one per server, in parallel on
``io_threads`` threads. ``put_many`` and ``get_many`` move up to ``LARGE_OBJECTS_IN_FLIGHT_MAX``
large objects at once, each on a thread of its own that waits for its blocks. A server that
answers ``stale_epoch`` sends the job's new weight map; the client adopts it and retries, up to
:data:`STALE_EPOCH_RETRIES_MAX` times.
"""

from __future__ import annotations

import dataclasses
import heapq
import io
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, Literal, TypeVar, overload

from pocketflow.channels import APPEND_SEGMENT_DEFAULT_BYTES, AppendFile, Queue
from pocketflow.config import ClientConfig
from pocketflow.errors import (
    BucketExists,
    BucketNotFound,
    DataUnavailable,
    InternalError,
    InvalidRequest,
    NotFound,
    ObjectExists,
    ObjectNotFound,
    PocketflowError,
    StaleEpoch,
    error_from_status,
)
from pocketflow.handle import JobHandle, ServerInfo
from pocketflow.layout import (
    STALE_EPOCH_RETRIES_MAX,
    BlockUploader,
    View,
    new_version,
    view_of,
)
from pocketflow.notifications import SUBSCRIBER_EVENTS_DEFAULT, Listener
from pocketflow.objectfile import ObjectReader, ObjectWriter
from pocketflow.protocol import (
    ACTION_CREATE_BUCKET,
    ACTION_DELETE,
    ACTION_DELETE_BLOCKS,
    ACTION_DELETE_BUCKET,
    ACTION_DELETE_PREFIX,
    ACTION_ENUMERATE,
    ACTION_WAIT,
    ENUMERATE_LIMIT_MAX,
    KEY_MAX_BYTES,
    OP_DELETE,
    OP_FLAG_DELETE,
    OP_FLAG_OVERWRITE,
    OP_FLAG_PERSIST,
    OP_GET,
    OP_LOOKUP,
    OP_PUT,
    SMALL_OBJECT_MAX_BYTES,
    TICKET_RANGES_MAX,
    WAIT_KEYS_MAX,
    WAIT_TIMEOUT_MAX_MS,
    ZERO_HEADER,
    ObjectHeader,
    Reply,
    action_body,
    check_bucket,
    check_key,
    encode_json,
    get_ticket,
    large_header,
    small_header,
)
from pocketflow.transport import ExchangeOp, ServerConnection, new_bytes, run_groups

__all__ = ["Client", "ObjectInfo", "connect", "STALE_EPOCH_RETRIES_MAX"]

log = logging.getLogger(__name__)

PUT_MANY_CHUNK_OPS = 4096
"""``put_many`` sends at most this many small objects per round of pipelined sessions."""
PUT_MANY_CHUNK_BYTES = 64 * 1024 * 1024
"""... and at most this many bytes."""
LARGE_OBJECTS_IN_FLIGHT_MAX = 4
"""``put_many`` and ``get_many`` move at most this many large objects at once (fewer if
``io_threads`` is smaller); each one already spreads its blocks over the I/O threads."""
READ_TICKET_BLOCKS_MIN = 4
"""Fewest blocks of one object that one read ticket carries: a large object's blocks on one
server are read as several tickets in parallel, each at least this many blocks."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a listing or a lookup knows of an object.

    ``persist`` is ``None`` when the source does not say (``enumerate`` reports key and size only).
    """

    key: str
    size: int
    persist: bool | None = None


def _as_view(data: Any) -> memoryview:
    """A flat byte view of a bytes-like object, without copying."""
    try:
        view = memoryview(data)
    except TypeError as exc:
        raise InvalidRequest(f"expected a bytes-like object, got {type(data).__name__}") from exc
    if not view.c_contiguous:
        raise InvalidRequest("data must be a C-contiguous buffer")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def _writable_view(buffer: Any) -> memoryview:
    view = _as_view(buffer)
    if view.readonly:
        raise InvalidRequest("buffer must be writable (bytearray, memoryview, numpy array, mmap)")
    return view


def _is_stream(data: Any) -> bool:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return False
    try:
        memoryview(data).release()
        return False
    except TypeError:
        return hasattr(data, "read")


class Client:
    """A connection of one process to one job's storage servers.

    Thread-safe: any number of threads may share one client. Build it with :func:`connect`; close
    it with :meth:`close` or use it as a context manager.
    """

    def __init__(self, handle: JobHandle, config: ClientConfig | None = None) -> None:
        self._config = config if config is not None else ClientConfig.resolve()
        if "block_size_bytes" in self._config.explicit:
            handle = dataclasses.replace(handle, block_size_bytes=self._config.block_size_bytes)
        self._view = view_of(handle)
        self._lock = threading.Lock()
        self._connections: dict[str, ServerConnection] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._objects_executor: ThreadPoolExecutor | None = None
        self._objects_in_flight = min(LARGE_OBJECTS_IN_FLIGHT_MAX, self._config.io_threads)
        self._repaired_buckets: set[tuple[str, str]] = set()
        self._closed = False
        _LIVE_CLIENTS.add(self)

    def _forget_after_fork(self) -> None:
        """In a forked child: drop the parent's connections and threads (a native connection
        made by the parent refuses calls in the child and is never torn down there); new ones
        are made on first use, on the child's own native runtime."""
        self._lock = threading.Lock()
        self._connections = {}
        self._executor = None
        self._objects_executor = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def handle(self) -> JobHandle:
        """The job handle in use, with the newest weight map this client has seen."""
        return self._view.handle

    @property
    def config(self) -> ClientConfig:
        """The resolved client settings."""
        return self._config

    def close(self) -> None:
        """Close every session and connection; the client cannot be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections.values())
            self._connections.clear()
            executor, self._executor = self._executor, None
            objects_executor, self._objects_executor = self._objects_executor, None
        # Object threads wait on the I/O threads, so they stop first.
        for pool in (objects_executor, executor):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        for connection in connections:
            connection.close()

    def update_handle(self, handle: JobHandle) -> None:
        """Take a newer handle of the same job: a renewed token (``Job.renew_token``) or a newer
        weight map. New sessions and requests use it at once; sessions opened with the old token
        are ended by their server when it expires and are then replaced, without failing a call.
        Raises :class:`InvalidRequest` for another job's handle.
        """
        if not isinstance(handle, JobHandle):
            raise InvalidRequest(f"expected a JobHandle, got {type(handle).__name__}")
        with self._lock:
            current = self._view.handle
            if handle.job_id != current.job_id:
                raise InvalidRequest(
                    f"handle of job {handle.job_id!r}, not of this client's job {current.job_id!r}"
                )
            self._view = view_of(current.updated_by(handle))

    def disconnect(self) -> None:
        """Close every connection but keep the client usable: the next call reconnects.

        Not needed around ``fork()``: a forked child makes connections of its own on first use.
        Calls in flight on other threads finish on the connections they hold.
        """
        with self._lock:
            if self._closed:
                return
            connections = list(self._connections.values())
            self._connections.clear()
        for connection in connections:
            connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        view = self._view
        return (
            f"<pocketflow.Client job={view.handle.job_id!r} epoch={view.epoch} "
            f"servers={len(view.handle.servers)}>"
        )

    # -- buckets -----------------------------------------------------------------------------

    def create_bucket(self, bucket: str) -> None:
        """Create ``bucket`` on every server of the job.

        Raises :class:`BucketExists` if every server already has it; servers that lack it (for
        instance ones added to the job later) get it either way.
        """
        check_bucket(bucket)
        results = self._on_every_server(ACTION_CREATE_BUCKET, bucket=bucket)
        self._raise_errors(results, tolerated=BucketExists)

    def delete_bucket(self, bucket: str) -> int:
        """Delete ``bucket`` and every object in it on every server; returns the bytes freed.

        Raises :class:`BucketNotFound` if no server has it.
        """
        check_bucket(bucket)
        results = self._on_every_server(ACTION_DELETE_BUCKET, bucket=bucket)
        return self._sum_field(results, "freed_bytes")

    def delete_prefix(self, bucket: str, prefix: str) -> int:
        """Delete every object of ``bucket`` whose key starts with ``prefix``; returns how many."""
        check_bucket(bucket)
        if len(prefix.encode()) > KEY_MAX_BYTES:
            raise InvalidRequest(f"prefix longer than {KEY_MAX_BYTES} bytes")
        results = self._on_every_server(ACTION_DELETE_PREFIX, bucket=bucket, prefix=prefix)
        return self._sum_field(results, "deleted")

    @staticmethod
    def _raise_errors(results: list[Any], *, tolerated: type[PocketflowError]) -> None:
        """Raise the first error other than ``tolerated``, or ``tolerated`` if every server did."""
        errors = [r for r in results if isinstance(r, PocketflowError)]
        others = [e for e in errors if not isinstance(e, tolerated)]
        if others:
            raise others[0]
        if errors and len(errors) == len(results):
            raise errors[0]

    @classmethod
    def _sum_field(cls, results: list[Any], name: str) -> int:
        cls._raise_errors(results, tolerated=BucketNotFound)
        return sum(int(r.get(name, 0)) for r in results if isinstance(r, dict))

    def _on_every_server(self, action: str, **fields: Any) -> list[Any]:
        """Run an action on every server of the map; per server, its result or its error."""
        for attempt in range(STALE_EPOCH_RETRIES_MAX + 1):
            view = self._view
            body = action_body(view.ctx, **fields)
            servers = _distinct_servers(view.handle.servers)

            def run(server: ServerInfo, body: bytes = body) -> Any:
                try:
                    return self._connection(server.address).action(action, body)
                except PocketflowError as exc:
                    return exc

            results = self._parallel([lambda s=s: run(s) for s in servers])
            stale = next((r for r in results if isinstance(r, StaleEpoch)), None)
            if stale is None:
                return results
            if attempt == STALE_EPOCH_RETRIES_MAX:
                raise stale
            self._adopt(stale)
        raise AssertionError("unreachable")

    # -- channels ----------------------------------------------------------------------------

    def queue(self, bucket: str, name: str, *, max_items: int = 1024) -> Queue:
        """A bounded FIFO queue named ``name`` in ``bucket``, kept on the storage servers (see
        :class:`pocketflow.channels.Queue`); it exists once something is enqueued."""
        return Queue(self, bucket, name, max_items=max_items)

    def append_file(self, bucket: str, key: str, *,
                    segment_bytes: int = APPEND_SEGMENT_DEFAULT_BYTES) -> AppendFile:
        """A shared append file named ``key`` in ``bucket`` (see
        :class:`pocketflow.channels.AppendFile`); it exists once something is appended."""
        return AppendFile(self, bucket, key, segment_bytes=segment_bytes)

    def subscribe(self, bucket: str, prefix: str = "", *,
                  ops: Iterable[str] = ("put", "delete"),
                  capacity: int = SUBSCRIBER_EVENTS_DEFAULT) -> Listener:
        """A listener of ``ops`` on keys of ``bucket`` starting with ``prefix``, on every server
        of the job (see :mod:`pocketflow.notifications`); close it when done."""
        return Listener(self, bucket, prefix, tuple(ops), capacity=capacity)

    # -- single objects ----------------------------------------------------------------------

    def put(
        self,
        bucket: str,
        key: str,
        data: bytes | bytearray | memoryview | BinaryIO | IO[bytes],
        *,
        persist: bool = False,
        overwrite: bool = False,
    ) -> None:
        """Store ``data`` under ``key``; write-once unless ``overwrite``.

        ``data`` is any bytes-like object (not copied) or a binary stream (read block by block).
        Raises :class:`ObjectExists` if the key holds an object and ``overwrite`` is false,
        :class:`CapacityExhausted` if a server is full (nothing of the object remains),
        :class:`BucketNotFound`, :class:`PersistNotSupported`, :class:`DataUnavailable`.
        """
        bucket_raw = check_bucket(bucket)
        key_raw = check_key(key)
        if _is_stream(data):
            with ObjectWriter(self, bucket, key, persist=persist, overwrite=overwrite) as writer:
                writer.write_from(data)  # type: ignore[arg-type]
            return
        view = _as_view(data)
        if len(view) <= SMALL_OBJECT_MAX_BYTES:
            self._put_small(bucket, bucket_raw, key_raw, view, persist=persist, overwrite=overwrite)
        else:
            self._put_large(bucket, bucket_raw, key, key_raw, view, persist=persist,
                            overwrite=overwrite)

    def get(self, bucket: str, key: str, *, delete: bool = False) -> bytes:
        """The object's bytes; with ``delete`` the object is removed as it is read.

        Among concurrent readers with ``delete``, exactly one gets the object and the others get
        :class:`ObjectNotFound` (:class:`DataUnavailable` once the job has lost a server: see the
        module doc). Raises :class:`ObjectNotFound`, :class:`BucketNotFound`,
        :class:`DataUnavailable`.
        """
        bucket_raw = check_bucket(bucket)
        key_raw = check_key(key)
        _, reply = self._fetch_record(
            bucket, bucket_raw, key_raw, OP_GET, OP_FLAG_DELETE if delete else 0
        )
        header = reply.header
        if header is None or header.block_count == 0:
            return bytes(reply.body)
        return self._read_blocks(bucket, key, key_raw, header, 0, header.size, delete=delete)

    def get_into(self, bucket: str, key: str, buffer: Any, *, delete: bool = False) -> int:
        """Read the object into ``buffer`` (any writable bytes-like object); returns its size.

        The bytes are copied once, from the received messages straight into ``buffer``. If the
        buffer is smaller than the object, :class:`InvalidRequest` is raised and the object is
        left in place (with ``delete``, it is put back under its original version).
        """
        dest = _writable_view(buffer)
        bucket_raw = check_bucket(bucket)
        key_raw = check_key(key)
        server, reply = self._fetch_record(
            bucket, bucket_raw, key_raw, OP_GET, OP_FLAG_DELETE if delete else 0
        )
        header = reply.header
        size = len(reply.body) if header is None else header.size
        if size > len(dest):
            if delete and header is not None:
                self._restore_record(server, bucket_raw, key_raw, header, reply.body)
            raise InvalidRequest(f"buffer of {len(dest)} bytes is too small for {size} bytes")
        if header is None or header.block_count == 0:
            dest[:size] = reply.body
            return size
        self._read_blocks(bucket, key, key_raw, header, 0, size, delete=delete, dest=dest)
        return size

    def get_range(self, bucket: str, key: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of the object, cut at its end (like a slice)."""
        if offset < 0 or length < 0:
            raise InvalidRequest("offset and length must be >= 0")
        bucket_raw = check_bucket(bucket)
        key_raw = check_key(key)
        _, reply = self._fetch_record(bucket, bucket_raw, key_raw, OP_GET, 0)
        header = reply.header
        if header is None or header.block_count == 0:
            return bytes(reply.body[offset:offset + length])
        end = min(header.size, offset + length)
        if offset >= end:
            return b""
        return self._read_blocks(bucket, key, key_raw, header, offset, end, delete=False)

    def lookup(self, bucket: str, key: str) -> ObjectInfo:
        """Size and PERSIST flag of an object; raises :class:`ObjectNotFound` if it is absent."""
        bucket_raw = check_bucket(bucket)
        key_raw = check_key(key)
        _, reply = self._fetch_record(bucket, bucket_raw, key_raw, OP_LOOKUP, 0)
        header = reply.header
        if header is None:
            raise InternalError("internal: lookup reply without a header")
        return ObjectInfo(key, header.size, header.persist)

    def exists(self, bucket: str, key: str) -> bool:
        """Whether the object exists (a :meth:`lookup` that answers ``False`` when it does not;
        after the job lost a server, a key on no live server raises :class:`DataUnavailable`)."""
        try:
            self.lookup(bucket, key)
        except ObjectNotFound:
            return False
        return True

    def _exists_live(self, bucket: str, key: str) -> bool:
        """Whether a live server of the job holds the object (never :class:`DataUnavailable`
        for a key that may have been lost: a waiter keeps waiting for it to be written)."""
        try:
            self._fetch_record(bucket, check_bucket(bucket), check_key(key), OP_LOOKUP, 0,
                               lost_unavailable=False)
        except ObjectNotFound:
            return False
        return True

    def delete(self, bucket: str, key: str) -> None:
        """Delete an object (its record and data blocks); raises :class:`ObjectNotFound`."""
        bucket_raw = check_bucket(bucket)
        key_raw = check_key(key)
        _, reply = self._fetch_record(bucket, bucket_raw, key_raw, OP_DELETE, 0)
        if reply.header is not None and reply.header.block_count:
            self._delete_blocks(bucket, key, key_raw, reply.header)

    # -- files -------------------------------------------------------------------------------

    def put_file(
        self,
        bucket: str,
        key: str,
        path: str | os.PathLike[str],
        *,
        persist: bool = False,
        overwrite: bool = False,
    ) -> int:
        """Store a local file (memory-mapped, not read into memory); returns its size."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size <= SMALL_OBJECT_MAX_BYTES:
                self.put(bucket, key, f.read(), persist=persist, overwrite=overwrite)
                return size
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                self.put(bucket, key, mapped, persist=persist, overwrite=overwrite)
            finally:
                _close_mmap(mapped)
        return size

    def get_file(
        self, bucket: str, key: str, path: str | os.PathLike[str], *, delete: bool = False
    ) -> int:
        """Write an object to a local file (created or truncated); returns its size.

        With ``delete``, if the file cannot be created or written before any data block is
        read, the object is put back (like :meth:`get_into`) and the ``OSError`` raised.
        """
        bucket_raw = check_bucket(bucket)
        key_raw = check_key(key)
        server, reply = self._fetch_record(
            bucket, bucket_raw, key_raw, OP_GET, OP_FLAG_DELETE if delete else 0
        )
        header = reply.header
        target = Path(path)
        try:
            if header is None or header.block_count == 0:
                target.write_bytes(reply.body)
                return len(reply.body)
            f = open(target, "w+b")  # noqa: SIM115 - closed below, or right here on failure
            try:
                f.truncate(header.size)
                mapped = mmap.mmap(f.fileno(), header.size)
            except BaseException:
                f.close()
                raise
        except OSError:
            if delete and header is not None:
                self._restore_record(server, bucket_raw, key_raw, header, reply.body)
            raise
        with f:
            try:
                self._read_blocks(
                    bucket, key, key_raw, header, 0, header.size, delete=delete,
                    dest=memoryview(mapped),
                )
                mapped.flush()
            finally:
                _close_mmap(mapped)
        return header.size

    @overload
    def open(
        self, bucket: str, key: str, mode: Literal["rb"] = "rb", *,
        persist: bool = False, overwrite: bool = False,
    ) -> io.BufferedReader: ...

    @overload
    def open(
        self, bucket: str, key: str, mode: Literal["wb"], *,
        persist: bool = False, overwrite: bool = False,
    ) -> io.BufferedIOBase: ...

    def open(
        self, bucket: str, key: str, mode: str = "rb", *,
        persist: bool = False, overwrite: bool = False,
    ) -> io.BufferedIOBase:
        """A file object over an object.

        ``"rb"``: a buffered, seekable reader that fetches only the blocks it reads.
        ``"wb"``: a writer that streams each block to its server as soon as it fills and commits
        the object on ``close()``; leaving a ``with`` block by an exception discards it.
        """
        if mode == "rb":
            reader = ObjectReader(self, bucket, key)
            buffer_size = max(reader.block_size, io.DEFAULT_BUFFER_SIZE)
            return io.BufferedReader(reader, buffer_size=buffer_size)
        if mode == "wb":
            return ObjectWriter(self, bucket, key, persist=persist, overwrite=overwrite)
        raise InvalidRequest(f"mode must be 'rb' or 'wb', got {mode!r}")

    # -- many objects ------------------------------------------------------------------------

    def put_many(
        self,
        bucket: str,
        items: Iterable[tuple[str, bytes | bytearray | memoryview]],
        *,
        persist: bool = False,
        overwrite: bool = False,
    ) -> int:
        """Store many objects; returns how many were stored.

        Small objects are pipelined over one session per server, all servers in parallel, in
        rounds of at most ``PUT_MANY_CHUNK_OPS`` objects and ``PUT_MANY_CHUNK_BYTES``; large ones
        form the last round and are put afterwards, up to ``LARGE_OBJECTS_IN_FLIGHT_MAX`` at once.
        On an error the first one (in the order of ``items``) is raised after every other object
        of its round has been stored; later rounds are not sent. A large object that fails leaves
        none of its blocks behind.
        """
        bucket_raw = check_bucket(bucket)
        flags = (OP_FLAG_PERSIST if persist else 0) | (OP_FLAG_OVERWRITE if overwrite else 0)
        large: list[tuple[str, bytes, memoryview]] = []
        ops: list[ExchangeOp] = []
        batch_bytes = 0
        stored = 0
        for key, data in items:
            key_raw = check_key(key)
            view = _as_view(data)
            if len(view) > SMALL_OBJECT_MAX_BYTES:
                large.append((key, key_raw, view))
                continue
            header = small_header(new_version(), len(view), persist=persist).encode()
            ops.append(ExchangeOp(OP_PUT, flags, bucket_raw, key_raw, header, view))
            batch_bytes += len(view)
            if len(ops) >= PUT_MANY_CHUNK_OPS or batch_bytes >= PUT_MANY_CHUNK_BYTES:
                self._put_ops(bucket, bucket_raw, ops, persist=persist, overwrite=overwrite)
                stored += len(ops)
                ops, batch_bytes = [], 0
        if ops:
            self._put_ops(bucket, bucket_raw, ops, persist=persist, overwrite=overwrite)
            stored += len(ops)
        errors = self._for_each_object([
            lambda key=key, key_raw=key_raw, view=view: self._put_large(
                bucket, bucket_raw, key, key_raw, view, persist=persist, overwrite=overwrite
            )
            for key, key_raw, view in large
        ])
        first_error = next((error for error in errors if error is not None), None)
        if first_error is not None:
            raise first_error
        return stored + len(large)

    def get_many(
        self, bucket: str, keys: Iterable[str], *, delete: bool = False
    ) -> list[bytes]:
        """The bytes of many objects, in the order of ``keys``.

        Block-0 reads are pipelined over one session per server, all servers in parallel; large
        objects' blocks are fetched afterwards, up to ``LARGE_OBJECTS_IN_FLIGHT_MAX`` objects at
        once. Every object is read before an error is raised: :class:`ObjectNotFound` for the
        first missing key, or the first other failure (with ``delete``, the objects read are
        gone).
        """
        bucket_raw = check_bucket(bucket)
        key_list = list(keys)
        flags = OP_FLAG_DELETE if delete else 0
        ops = [
            ExchangeOp(OP_GET, flags, bucket_raw, check_key(key), tag=i)
            for i, key in enumerate(key_list)
        ]
        results: list[bytes | None] = [None] * len(key_list)
        large: list[tuple[int, ObjectHeader]] = []
        missing: list[int] = []
        first_error: PocketflowError | None = None
        for attempt in range(STALE_EPOCH_RETRIES_MAX + 1):
            view = self._view
            groups = self._group_ops(view, ops, persist=False)
            self._run_groups(view, groups)
            retry: list[ExchangeOp] = []
            stale: StaleEpoch | None = None
            for address, group in groups.items():
                for op in group:
                    reply = op.reply
                    assert reply is not None
                    if reply.status == 0:
                        header = reply.header
                        if header is not None and header.block_count:
                            large.append((op.tag, header))
                        else:
                            results[op.tag] = bytes(reply.body)
                        continue
                    error = error_from_status(reply.status, reply.body, server=address)
                    if isinstance(error, StaleEpoch) and attempt < STALE_EPOCH_RETRIES_MAX:
                        stale = error
                        retry.append(op)
                    elif isinstance(error, NotFound):
                        missing.append(op.tag)
                    elif first_error is None:
                        first_error = error
            if stale is not None:
                self._adopt(stale)
            ops = retry
            if not ops:
                break
        for index in missing:
            # Fallback placements (PERSIST, earlier maps) are probed one key at a time.
            try:
                _, reply = self._fetch_record(
                    bucket, bucket_raw, check_key(key_list[index]), OP_GET, flags
                )
            except PocketflowError as exc:
                if first_error is None:
                    first_error = exc
                continue
            header = reply.header
            if header is not None and header.block_count:
                large.append((index, header))
            else:
                results[index] = bytes(reply.body)

        def read(index: int, header: ObjectHeader) -> None:
            key = key_list[index]
            results[index] = self._read_blocks(
                bucket, key, check_key(key), header, 0, header.size, delete=delete
            )

        errors = self._for_each_object([
            lambda index=index, header=header: read(index, header) for index, header in large
        ])
        for error in errors:
            if error is None:
                continue
            if not isinstance(error, PocketflowError):
                raise error
            if first_error is None:
                first_error = error
        if first_error is not None:
            raise first_error
        return [r if r is not None else b"" for r in results]

    # -- waiting -----------------------------------------------------------------------------

    def wait_for(self, bucket: str, keys: Iterable[str], *, timeout_s: float) -> list[str]:
        """Block until every key exists or ``timeout_s`` passes; returns the keys still missing
        (in the order given).

        Keys already written are found first by one pipelined ``LOOKUP`` per server over the
        small-op sessions (a round trip on the calling thread, like :meth:`exists`; for up to
        ``exchange_window`` keys); with ``timeout_s`` 0 that is the whole check. Only the keys
        still missing are parked on the servers (the ``wait`` action, at most
        ``WAIT_TIMEOUT_MAX_MS`` per call), which answer as soon as the last of their keys is
        put, so a reader waiting for another task's output neither polls with ``not_found``
        nor sleeps longer than needed. The action is a gRPC call whose thread handoffs cost
        milliseconds on a busy machine, which a reader whose input is already there should not
        pay. Keys are grouped by the server that holds their block 0, servers waited on in
        parallel. After the job's map changed (epoch > 1) keys written under an earlier map
        are also looked for with :meth:`exists`. Raises :class:`DataUnavailable` (with
        ``server``) when a server holding awaited keys cannot be reached,
        :class:`BucketNotFound`.
        """
        bucket_raw = check_bucket(bucket)
        wanted = list(dict.fromkeys(keys))
        key_raws = {key: check_key(key) for key in wanted}
        if not 0 <= timeout_s < float("inf"):
            raise InvalidRequest(f"timeout_s must be finite and >= 0, got {timeout_s}")
        deadline = time.monotonic() + timeout_s
        # Up to a session window of keys, one pipelined round trip per server finds those
        # already written; more keys would take several, and the wait action checks them all
        # in one call per server anyway.
        written: set[str] = set()
        settled = False  # every key found or ObjectNotFound: the lookups were the whole check
        if len(wanted) <= self._config.exchange_window:
            view = self._view
            lookups = [ExchangeOp(OP_LOOKUP, 0, bucket_raw, key_raws[key], tag=key)
                       for key in wanted]
            lookup_groups = self._group_ops(view, lookups, persist=False)
            self._run_groups(view, lookup_groups)
            settled = True
            for address, group in lookup_groups.items():
                for op in group:
                    assert op.reply is not None
                    if op.reply.status == 0:
                        written.add(op.tag)
                        continue
                    error = error_from_status(op.reply.status, op.reply.body, server=address)
                    if isinstance(error, ObjectNotFound):
                        continue
                    # A missing bucket or a newer map to adopt: the wait action sorts it out.
                    if not isinstance(error, (NotFound, StaleEpoch)):
                        raise error
                    settled = False
        wanted = [key for key in wanted if key not in written]
        if wanted and self._view.epoch > 1:
            wanted = [key for key in wanted if not self._exists_live(bucket, key)]
        if timeout_s == 0 and settled:
            return wanted
        # One parked call must end before the client gives up on the action's RPC.
        call_ms_max = max(1, min(WAIT_TIMEOUT_MAX_MS,
                                 int(1000 * self._config.rpc_timeout_s) - 1000))
        missing = wanted
        for attempt in range(STALE_EPOCH_RETRIES_MAX + 1):
            view = self._view
            groups: dict[str, list[str]] = {}
            for key in missing:
                address = view.placement.server_for(key_raws[key], 0).address
                groups.setdefault(address, []).append(key)
            chunks = [
                (address, group[at:at + WAIT_KEYS_MAX])
                for address, group in groups.items()
                for at in range(0, len(group), WAIT_KEYS_MAX)
            ]

            def run(address: str, chunk: list[str], ctx: dict[str, Any] = view.ctx) -> Any:
                left = chunk
                while True:
                    left_ms = int(1000 * (deadline - time.monotonic()))
                    body = action_body(ctx, bucket=bucket, keys=left,
                                       timeout_ms=max(0, min(left_ms, call_ms_max)))
                    try:
                        result = self._connection(address).action(ACTION_WAIT, body)
                    except StaleEpoch as exc:
                        return exc
                    left = [str(key) for key in result.get("missing", left)]
                    if not left or left_ms <= call_ms_max:
                        return left

            results = self._parallel([
                lambda address=address, chunk=chunk: run(address, chunk)
                for address, chunk in chunks
            ])
            stale = next((r for r in results if isinstance(r, StaleEpoch)), None)
            missing = [
                key for (_, chunk), result in zip(chunks, results, strict=True)
                for key in (chunk if isinstance(result, StaleEpoch) else result)
            ]
            if stale is None or not missing:
                order = {key: i for i, key in enumerate(wanted)}
                return sorted(missing, key=order.__getitem__)
            if attempt == STALE_EPOCH_RETRIES_MAX:
                raise stale
            self._adopt(stale)
        raise AssertionError("unreachable")

    # -- listing -----------------------------------------------------------------------------

    def enumerate(
        self, bucket: str, prefix: str = "", *, page_size: int = 1000
    ) -> Iterator[list[ObjectInfo]]:
        """Pages of the bucket's objects whose key starts with ``prefix``, sorted by key.

        Every server of the job is listed and the answers merged; each page holds at most
        ``page_size`` objects. Raises :class:`BucketNotFound` if no server has the bucket.
        """
        check_bucket(bucket)
        if not 1 <= page_size <= ENUMERATE_LIMIT_MAX:
            raise InvalidRequest(f"page_size must be 1..{ENUMERATE_LIMIT_MAX}")
        if len(prefix.encode()) > KEY_MAX_BYTES:
            raise InvalidRequest(f"prefix longer than {KEY_MAX_BYTES} bytes")
        return self._enumerate_pages(bucket, prefix, page_size)

    def list(self, bucket: str, prefix: str = "") -> list[ObjectInfo]:
        """Every object of the bucket under ``prefix`` (all pages of :meth:`enumerate`)."""
        return [info for page in self.enumerate(bucket, prefix) for info in page]

    def _enumerate_pages(
        self, bucket: str, prefix: str, page_size: int
    ) -> Iterator[list[ObjectInfo]]:
        servers = _distinct_servers(self._view.handle.servers)

        def fetch(server: ServerInfo, start_after: str | None) -> dict[str, Any] | None:
            fields: dict[str, Any] = {"bucket": bucket, "prefix": prefix, "limit": page_size}
            if start_after is not None:
                fields["start_after"] = start_after
            for attempt in range(STALE_EPOCH_RETRIES_MAX + 1):
                body = action_body(self._view.ctx, **fields)
                try:
                    return self._connection(server.address).action(ACTION_ENUMERATE, body)
                except BucketNotFound:
                    return None
                except StaleEpoch as exc:
                    if attempt == STALE_EPOCH_RETRIES_MAX:
                        raise
                    self._adopt(exc)
            raise AssertionError("unreachable")

        first = self._parallel([lambda s=s: fetch(s, None) for s in servers])
        if servers and all(result is None for result in first):
            raise BucketNotFound(f"bucket_not_found: {bucket}")
        # Per server: buffered keys, and whether the server has more after them.
        buffers: list[list[tuple[str, int]]] = []
        more: list[bool] = []
        heap: list[tuple[str, int, int]] = []  # (key, server slot, position in its buffer)
        for slot, result in enumerate(first):
            keys = _keys_of(result)
            buffers.append(keys)
            more.append(bool(result and result.get("truncated")) and bool(keys))
            if keys:
                heap.append((keys[0][0], slot, 0))
        heapq.heapify(heap)
        page: list[ObjectInfo] = []
        last_key: str | None = None
        while heap:
            key, slot, at = heapq.heappop(heap)
            size = buffers[slot][at][1]
            if key != last_key:
                page.append(ObjectInfo(key, size))
                last_key = key
                if len(page) == page_size:
                    yield page
                    page = []
            at += 1
            if at == len(buffers[slot]) and more[slot]:
                result = fetch(servers[slot], buffers[slot][-1][0])
                buffers[slot] = _keys_of(result)
                more[slot] = bool(result and result.get("truncated")) and bool(buffers[slot])
                at = 0
            if at < len(buffers[slot]):
                heapq.heappush(heap, (buffers[slot][at][0], slot, at))
        if page:
            yield page

    # -- internals: connections and threads --------------------------------------------------

    def _connection(self, address: str) -> ServerConnection:
        connection = self._connections.get(address)
        if connection is not None:
            return connection
        with self._lock:
            if self._closed:
                raise InvalidRequest("the client is closed")
            connection = self._connections.get(address)
            if connection is None:
                cfg = self._config
                connection = ServerConnection(
                    address,
                    exchange_command=lambda: self._view.exchange_command,
                    sessions_max=cfg.sessions_per_server,
                    op_timeout_s=cfg.op_timeout_s,
                    first_reply_timeout_s=cfg.connect_timeout_s,
                    rpc_timeout_s=cfg.rpc_timeout_s,
                    stream_timeout_s=cfg.stream_timeout_s,
                    direct=cfg.small_ops == "direct",
                    tls_ca=self._view.handle.tls_ca,
                )
                self._connections[address] = connection
            return connection

    def _executor_get(self) -> ThreadPoolExecutor:
        """The I/O threads (data blocks), made on first use."""
        return self._pool_get("_executor", self._config.io_threads, "pocketflow-io")

    def _objects_executor_get(self) -> ThreadPoolExecutor:
        """The object threads of ``put_many``/``get_many``, made on first use."""
        return self._pool_get(
            "_objects_executor", max(1, self._objects_in_flight - 1), "pocketflow-objects"
        )

    def _pool_get(self, attribute: str, workers: int, thread_prefix: str) -> ThreadPoolExecutor:
        """The thread pool kept in ``attribute``, made on first use; none for a closed client."""
        executor = getattr(self, attribute)
        if executor is not None:
            return executor
        with self._lock:
            if self._closed:
                raise InvalidRequest("the client is closed")
            executor = getattr(self, attribute)
            if executor is None:
                executor = ThreadPoolExecutor(max_workers=workers,
                                              thread_name_prefix=thread_prefix)
                setattr(self, attribute, executor)
            return executor

    def _for_each_object(self, tasks: Sequence[Callable[[], None]]) -> list[BaseException | None]:
        """Run whole-object tasks, up to ``LARGE_OBJECTS_IN_FLIGHT_MAX`` at once; returns each
        task's failure (or ``None``) in order, once every task taken has finished.

        The calling thread takes tasks too, and the others run on the client's object threads,
        never on the I/O threads: a task waits for the I/O threads to move its blocks, and a
        bounded pool whose threads wait on that same pool can deadlock. An interrupt of the
        calling thread stops the taking of new tasks and is raised once the running ones end.
        """
        errors: list[BaseException | None] = [None] * len(tasks)
        lock = threading.Lock()
        taken = 0
        stopped = False

        def drain() -> None:
            nonlocal taken, stopped
            while True:
                with lock:
                    if stopped or taken == len(tasks):
                        return
                    index = taken
                    taken += 1
                try:
                    tasks[index]()
                except Exception as exc:  # noqa: BLE001 - returned to the caller, in order
                    errors[index] = exc
                except BaseException:
                    with lock:
                        stopped = True
                    raise

        helpers = min(self._objects_in_flight, len(tasks)) - 1
        futures = [self._objects_executor_get().submit(drain) for _ in range(helpers)]
        try:
            drain()
        finally:
            # A helper still queued behind another call's tasks is not needed any more.
            for future in futures:
                future.cancel()
            wait(futures)
        # A helper stopped by something other than an Exception left tasks untaken: the call
        # did not do its work, so that is raised rather than reported as success.
        for future in futures:
            if not future.cancelled() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        return errors

    def _parallel(self, tasks: Sequence[Callable[[], T]]) -> list[T]:
        """Run tasks on the I/O threads, the first one on the calling thread; re-raise the first
        failure after all have finished. Tasks must not themselves call ``_parallel``."""
        if len(tasks) == 1:
            return [tasks[0]()]
        if not tasks:
            return []
        futures = [self._executor_get().submit(task) for task in tasks[1:]]
        results: list[Any] = [None] * len(tasks)
        errors: list[BaseException] = []
        try:
            results[0] = tasks[0]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others finish
            errors.append(exc)
        for i, future in enumerate(futures, start=1):
            try:
                results[i] = future.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
        if errors:
            raise errors[0]
        return results

    def _adopt(self, stale: StaleEpoch) -> None:
        """Adopt the newer weight map a ``stale_epoch`` error carries."""
        weight_map = stale.weight_map
        if weight_map is None:
            raise stale
        with self._lock:
            current = self._view.handle
            try:
                epoch = int(weight_map.get("epoch", 0))
            except (TypeError, ValueError):
                raise stale from None
            if epoch > current.epoch:
                self._view = view_of(current.with_weight_map(weight_map))
                log.debug("job %s: adopted weight map epoch %d", current.job_id, epoch)

    # -- internals: block 0 ------------------------------------------------------------------

    def _call(self, view: View, server: ServerInfo, op: int, flags: int, bucket_raw: bytes,
              key_raw: bytes, header: bytes = ZERO_HEADER,
              value: bytes | bytearray | memoryview = b"") -> Reply:
        return self._connection(server.address).call(
            view.epoch, op, flags, bucket_raw, key_raw, header, value
        )

    def _fetch_record(
        self, bucket: str, bucket_raw: bytes, key_raw: bytes, op: int, flags: int, *,
        lost_unavailable: bool = True,
    ) -> tuple[ServerInfo, Reply]:
        """Run a GET, LOOKUP or DELETE of block 0 where the object lives (see module doc).

        A GET or LOOKUP that finds the key on no live server of a job that lost servers raises
        :class:`DataUnavailable` (unless ``lost_unavailable`` is false).
        """
        for attempt in range(STALE_EPOCH_RETRIES_MAX + 1):
            view = self._view
            primary = view.placement.server_for(key_raw, 0)
            try:
                reply = self._call(view, primary, op, flags, bucket_raw, key_raw)
            except StaleEpoch as exc:
                # A new session's opening context was stale: the session never ran the op.
                reply = _stale_reply(exc)
            if reply.status == 0:
                return primary, reply
            error = error_from_status(reply.status, reply.body, server=primary.address)
            if isinstance(error, StaleEpoch):
                if attempt == STALE_EPOCH_RETRIES_MAX:
                    raise error
                self._adopt(error)
                continue
            if not isinstance(error, NotFound):
                raise error
            found, stale, bucket_seen = self._probe_fallbacks(
                view, primary, op, flags, bucket_raw, key_raw
            )
            if found is not None:
                return found
            if stale is not None:
                if attempt == STALE_EPOCH_RETRIES_MAX:
                    raise stale
                self._adopt(stale)
                continue
            if isinstance(error, BucketNotFound) and bucket_seen:
                error = ObjectNotFound(
                    f"not_found: {bucket}/{key_raw.decode()}", server=primary.address
                )
            if isinstance(error, ObjectNotFound) and op != OP_DELETE and lost_unavailable:
                lost = _lost_error(view, f"{bucket}/{key_raw.decode()}")
                if lost is not None:
                    raise lost from error
            raise error
        raise AssertionError("unreachable")

    def _probe_fallbacks(
        self, view: View, primary: ServerInfo, op: int, flags: int, bucket_raw: bytes,
        key_raw: bytes,
    ) -> tuple[tuple[ServerInfo, Reply] | None, StaleEpoch | None, bool]:
        """Try block 0 on the PERSIST placement, then (epoch > 1) every other server."""
        candidates: list[ServerInfo] = []
        if view.placement.has_persist():
            persist_server = view.placement.server_for(key_raw, 0, persist=True)
            if persist_server.node_id != primary.node_id:
                candidates.append(persist_server)
        if view.epoch > 1:
            seen = {primary.node_id, *(c.node_id for c in candidates)}
            candidates += [s for s in view.placement.ranked(key_raw) if s.node_id not in seen]
        bucket_seen = False
        for server in candidates:
            try:
                reply = self._call(view, server, op, flags, bucket_raw, key_raw)
            except StaleEpoch as exc:
                return None, exc, bucket_seen
            if reply.status == 0:
                return (server, reply), None, True
            error = error_from_status(reply.status, reply.body, server=server.address)
            if isinstance(error, StaleEpoch):
                return None, error, bucket_seen
            if isinstance(error, ObjectNotFound):
                bucket_seen = True
            elif not isinstance(error, BucketNotFound):
                raise error
        return None, None, bucket_seen

    def _put_record(
        self, bucket: str, bucket_raw: bytes, key_raw: bytes, header: ObjectHeader,
        value: bytes | bytearray | memoryview, *, persist: bool, overwrite: bool,
        uploader: BlockUploader | None = None,
    ) -> None:
        """Store block 0 (the commit point); on overwrite, free what it replaced.

        ``uploader`` (a large object's) is told when the record is sent and when it is stored,
        so that a failure afterwards never frees the blocks of a stored object.
        """
        flags = (OP_FLAG_PERSIST if persist else 0) | (OP_FLAG_OVERWRITE if overwrite else 0)
        header_raw = header.encode()
        repaired = False
        for attempt in range(STALE_EPOCH_RETRIES_MAX + 1):
            view = self._view
            server = view.placement.server_for(key_raw, 0, persist=persist)
            if uploader is not None:
                uploader.committing = True
            try:
                reply = self._call(view, server, OP_PUT, flags, bucket_raw, key_raw, header_raw,
                                   value)
            except StaleEpoch as exc:
                reply = _stale_reply(exc)
            if reply.status == 0:
                if uploader is not None:
                    uploader.committed = True
                if overwrite:
                    self._after_overwrite(view, bucket, bucket_raw, key_raw, server, reply.header,
                                          persist=persist)
                    return
                rivals = self._rivals(view, key_raw, server, persist=persist)
                if rivals:
                    found = self._find_rival_records(view, bucket_raw, [(key_raw, rivals)])
                    rival = found.get(key_raw)
                    if rival is not None:
                        if uploader is not None:
                            uploader.committed = False  # its blocks are freed by its abort
                        raise self._withdraw(view, bucket, bucket_raw, key_raw, server, header,
                                             rival)
                return
            error = error_from_status(reply.status, reply.body, server=server.address)
            if isinstance(error, StaleEpoch) and attempt < STALE_EPOCH_RETRIES_MAX:
                self._adopt(error)
                continue
            if isinstance(error, BucketNotFound) and not repaired:
                repaired = self._repair_bucket(view, bucket, server)
                if repaired:
                    continue
            raise error
        raise AssertionError("unreachable")

    def _rivals(
        self, view: View, key_raw: bytes, written: ServerInfo, *, persist: bool
    ) -> list[ServerInfo]:
        """The other servers where a read would find block 0 of ``key_raw``: the home of the
        other placement (PERSIST or ephemeral) and, once the job changed maps, every server of
        the map (see :meth:`_probe_fallbacks`). A non-overwrite put checks them after writing,
        so that write-once holds per key, not per server."""
        placement = view.placement
        rivals: list[ServerInfo] = []
        if placement.has_persist():
            try:
                rivals.append(placement.server_for(key_raw, 0, persist=not persist))
            except PocketflowError:
                pass  # no server of the other placement: nothing to find there
        if view.epoch > 1:
            rivals += placement.ranked(key_raw)
        seen = {written.node_id}
        unique = []
        for server in rivals:
            if server.node_id not in seen:
                seen.add(server.node_id)
                unique.append(server)
        return unique

    def _find_rival_records(
        self, view: View, bucket_raw: bytes, checks: list[tuple[bytes, list[ServerInfo]]]
    ) -> dict[bytes, ServerInfo]:
        """LOOKUP each key on its rival servers, all servers at once; returns, per key found on
        one, that server. A server that cannot answer is skipped (its reads fail too)."""
        groups: dict[str, list[ExchangeOp]] = {}
        servers: dict[str, ServerInfo] = {}
        for key_raw, rivals in checks:
            for server in rivals:
                servers[server.address] = server
                groups.setdefault(server.address, []).append(
                    ExchangeOp(OP_LOOKUP, 0, bucket_raw, key_raw)
                )
        self._run_groups(view, groups)
        found: dict[bytes, ServerInfo] = {}
        for address, ops in groups.items():
            for op in ops:
                if op.reply is not None and op.reply.status == 0:
                    found.setdefault(op.key, servers[address])
        return found

    def _withdraw(
        self, view: View, bucket: str, bucket_raw: bytes, key_raw: bytes, written: ServerInfo,
        header: ObjectHeader, rival: ServerInfo,
    ) -> ObjectExists:
        """Take back a put that found the key already held on ``rival``: remove its record
        (only that version: an overwrite that replaced it stays) and say why it lost."""
        body = action_body(view.ctx, bucket=bucket, key=key_raw.decode(), version=header.version)
        try:
            self._connection(written.address).action(ACTION_DELETE, body)
        except NotFound:
            pass  # already gone (read with DELETE, or replaced by an overwrite)
        except PocketflowError as exc:
            log.warning("could not withdraw the losing put of %r: %s", key_raw, exc)
        return ObjectExists(
            f"already_exists: {bucket}/{key_raw.decode()} is held on {rival.node_id}",
            server=rival.address,
        )

    def _after_overwrite(
        self, view: View, bucket: str, bucket_raw: bytes, key_raw: bytes, written: ServerInfo,
        replaced: ObjectHeader | None, *, persist: bool,
    ) -> None:
        """Free the replaced version's blocks; a PERSIST overwrite also removes an ephemeral
        version, which readers would otherwise find first.

        (An ephemeral overwrite of a PERSIST object leaves the PERSIST version on its
        long-running server, where reads no longer reach it until the ephemeral one is deleted;
        checking for it would cost every overwrite a round trip.)
        """
        key = key_raw.decode()
        if replaced is not None and replaced.block_count:
            self._delete_blocks(bucket, key, key_raw, replaced)
        if not persist:
            return
        other = view.placement.server_for(key_raw, 0, persist=False)
        if other.node_id == written.node_id:
            return
        try:
            reply = self._call(view, other, OP_DELETE, 0, bucket_raw, key_raw)
        except PocketflowError as exc:
            log.warning("could not remove the ephemeral version of %r: %s", key, exc)
            return
        if reply.status == 0 and reply.header is not None and reply.header.block_count:
            self._delete_blocks(bucket, key, key_raw, reply.header)

    def _restore_record(
        self, server: ServerInfo, bucket_raw: bytes, key_raw: bytes, header: ObjectHeader,
        body: memoryview,
    ) -> None:
        """Put back a record claimed by a DELETE read that could not be delivered."""
        flags = OP_FLAG_PERSIST if header.persist else 0
        value = body if header.block_count == 0 else b""
        try:
            reply = self._call(self._view, server, OP_PUT, flags, bucket_raw, key_raw,
                               header.encode(), value)
        except PocketflowError as exc:
            reply = Reply(0, exc.grpc_code, None, memoryview(str(exc).encode()))
        if reply.status != 0:
            log.warning("could not restore %r after a failed DELETE read: %s", key_raw,
                        error_from_status(reply.status, reply.body))

    def _repair_bucket(self, view: View, bucket: str, server: ServerInfo) -> bool:
        """Create ``bucket`` on a server that lacks it if another server of the job has it.

        Buckets live per server; a server added to the job after the bucket was created learns of
        it here, on the first put that reaches it.
        """
        if (server.address, bucket) in self._repaired_buckets:
            return False
        probe = action_body(view.ctx, bucket=bucket, prefix="", limit=1)
        known = False
        for other in _distinct_servers(view.handle.servers):
            if other.address == server.address:
                continue
            try:
                self._connection(other.address).action(ACTION_ENUMERATE, probe)
            except PocketflowError:
                continue
            known = True
            break
        if not known:
            return False
        try:
            self._connection(server.address).action(
                ACTION_CREATE_BUCKET, action_body(view.ctx, bucket=bucket)
            )
        except BucketExists:
            pass
        self._repaired_buckets.add((server.address, bucket))
        return True

    # -- internals: small and large puts -----------------------------------------------------

    def _put_small(
        self, bucket: str, bucket_raw: bytes, key_raw: bytes, value: memoryview | bytes, *,
        persist: bool, overwrite: bool,
    ) -> None:
        header = small_header(new_version(), len(value), persist=persist)
        self._put_record(bucket, bucket_raw, key_raw, header, value, persist=persist,
                         overwrite=overwrite)

    def _put_large(
        self, bucket: str, bucket_raw: bytes, key: str, key_raw: bytes, data: memoryview, *,
        persist: bool, overwrite: bool,
    ) -> None:
        block_size = self._view.handle.block_size_bytes
        uploader = self._uploader(bucket, key, key_raw, block_size, persist=persist, streamed=False)
        try:
            for index, at in enumerate(range(0, len(data), block_size), start=1):
                uploader.add(index, data[at:at + block_size])
            uploader.finish()
            header = large_header(uploader.version, len(data), block_size, persist=persist)
            self._put_record(bucket, bucket_raw, key_raw, header, b"", persist=persist,
                             overwrite=overwrite, uploader=uploader)
        except BaseException as exc:
            uploader.abort(exc)
            raise

    def _uploader(
        self, bucket: str, key: str, key_raw: bytes, block_size: int, *, persist: bool,
        streamed: bool,
    ) -> BlockUploader:
        return BlockUploader(self, bucket, key, key_raw, block_size, persist=persist,
                             streamed=streamed)

    def _put_ops(
        self, bucket: str, bucket_raw: bytes, ops: list[ExchangeOp], *, persist: bool,
        overwrite: bool,
    ) -> None:
        """Run PUT ops pipelined; retry stale-epoch and repairable missing-bucket failures."""
        first_error: PocketflowError | None = None
        replaced: list[tuple[bytes, ServerInfo, ObjectHeader | None]] = []
        stored: list[tuple[ExchangeOp, ServerInfo]] = []
        repaired: set[str] = set()
        for attempt in range(STALE_EPOCH_RETRIES_MAX + 1):
            view = self._view
            groups = self._group_ops(view, ops, persist=persist)
            self._run_groups(view, groups)
            retry: list[ExchangeOp] = []
            stale: StaleEpoch | None = None
            servers = {s.address: s for s in view.handle.servers}
            for address, group in groups.items():
                missing_bucket: list[ExchangeOp] = []
                for op in group:
                    reply = op.reply
                    assert reply is not None
                    if reply.status == 0:
                        if overwrite:
                            replaced.append((op.key, servers[address], reply.header))
                        else:
                            stored.append((op, servers[address]))
                        continue
                    error = error_from_status(reply.status, reply.body, server=address)
                    if isinstance(error, StaleEpoch) and attempt < STALE_EPOCH_RETRIES_MAX:
                        stale = error
                        retry.append(op)
                    elif (isinstance(error, BucketNotFound) and address not in repaired
                          and attempt < STALE_EPOCH_RETRIES_MAX):
                        missing_bucket.append(op)
                    elif first_error is None:
                        first_error = error
                if missing_bucket:
                    repaired.add(address)
                    if self._repair_bucket(view, bucket, servers[address]):
                        retry += missing_bucket
                    elif first_error is None:
                        first_error = error_from_status(
                            missing_bucket[0].reply.status,  # type: ignore[union-attr]
                            missing_bucket[0].reply.body,  # type: ignore[union-attr]
                            server=address,
                        )
            if stale is not None:
                self._adopt(stale)
            ops = retry
            if not ops:
                break
        if overwrite:
            view = self._view
            for key_raw, server, header in replaced:
                self._after_overwrite(view, bucket, bucket_raw, key_raw, server, header,
                                      persist=persist)
        else:
            lost = self._check_rivals(bucket, bucket_raw, stored, persist=persist)
            if first_error is None:
                first_error = lost
        if first_error is not None:
            raise first_error

    def _check_rivals(
        self, bucket: str, bucket_raw: bytes, stored: list[tuple[ExchangeOp, ServerInfo]], *,
        persist: bool,
    ) -> ObjectExists | None:
        """Write-once per key for a batch: withdraw every stored op whose key another server
        holds (see :meth:`_rivals`); returns the error of the first, or ``None``."""
        view = self._view
        checks = []
        for op, server in stored:
            rivals = self._rivals(view, op.key, server, persist=persist)
            if rivals:
                checks.append((op.key, rivals))
        if not checks:
            return None
        found = self._find_rival_records(view, bucket_raw, checks)
        first: ObjectExists | None = None
        for op, server in stored:
            rival = found.get(op.key)
            if rival is None:
                continue
            lost = self._withdraw(view, bucket, bucket_raw, op.key, server,
                                  ObjectHeader.decode(op.header), rival)
            first = first or lost
        return first

    def _group_ops(
        self, view: View, ops: Sequence[ExchangeOp], *, persist: bool
    ) -> dict[str, list[ExchangeOp]]:
        groups: dict[str, list[ExchangeOp]] = {}
        servers = view.placement.servers_for([op.key for op in ops], 0, persist=persist)
        for op, server in zip(ops, servers, strict=True):
            op.reply = None
            address = server.address
            group = groups.get(address)
            if group is None:
                groups[address] = [op]
            else:
                group.append(op)
        return groups

    def _run_groups(self, view: View, groups: dict[str, list[ExchangeOp]]) -> None:
        """Run each server's ops over one of its sessions, servers in parallel.

        An op whose session failed before its reply came gets a synthetic reply carrying the
        failure (a stale opening context, an unreachable server), so callers handle every
        outcome per op, in one place.
        """
        window = self._config.exchange_window
        failures = run_groups([
            (self._connection(address), view.epoch, group, window)
            for address, group in groups.items()
        ])
        for group, failure in zip(groups.values(), failures, strict=True):
            if failure is None:
                continue
            failed = _failure_reply(failure)
            for op in group:
                if op.reply is None:
                    op.reply = failed

    # -- internals: data blocks --------------------------------------------------------------

    def _block_server(self, view: View, key_raw: bytes, index: int, persist: bool) -> ServerInfo:
        return view.placement.server_for(key_raw, index, persist=persist)

    def _read_blocks(
        self, bucket: str, key: str, key_raw: bytes, header: ObjectHeader, start: int, end: int,
        *, delete: bool, dest: memoryview | None = None,
    ) -> Any:
        """Read object bytes ``[start, end)`` of a large object from its data blocks.

        With ``dest`` the bytes land in ``dest[0:end-start]`` and the count is returned;
        without, they land in a ``bytes`` of the exact size, filled in place, which is returned.
        Each server's ranges are read by the native core with the GIL released, as tickets of at
        least ``READ_TICKET_BLOCKS_MIN`` blocks in parallel, servers in parallel too.
        """
        view = self._view
        block_size = header.block_size
        first = start // block_size + 1
        last = (end - 1) // block_size + 1
        groups: dict[str, list[tuple[int, int, int, int]]] = {}
        for index in range(first, last + 1):
            block_start = (index - 1) * block_size
            low = max(start, block_start)
            high = min(end, block_start + block_size, header.size)
            server = self._block_server(view, key_raw, index, header.persist)
            groups.setdefault(server.address, []).append(
                (index, low - block_start, high - low, low - start)
            )
        expected = end - start
        target: Any = dest if dest is not None else new_bytes(expected)
        received: dict[int, int] = {}
        lock = threading.Lock()

        def fetch(address: str, chunk: list[tuple[int, int, int, int]]) -> None:
            try:
                self._get_ranges_current(address, bucket, key, header.version, chunk,
                                         target, received, lock, delete=delete)
            except NotFound:
                if view.epoch <= 1:
                    raise
                self._fetch_moved_blocks(view, bucket, key, key_raw, header, address,
                                         chunk, target, received, lock, delete=delete)

        # A server's ranges are cut into tickets read in parallel over its connections: at
        # least READ_TICKET_BLOCKS_MIN blocks each, so the I/O threads share a large object.
        per_ticket = max(READ_TICKET_BLOCKS_MIN,
                         -(-(last - first + 1) // self._config.io_threads))
        per_ticket = min(per_ticket, TICKET_RANGES_MAX)
        self._parallel([
            lambda address=address, chunk=ranges[at:at + per_ticket]: fetch(address, chunk)
            for address, ranges in groups.items()
            for at in range(0, len(ranges), per_ticket)
        ])
        if sum(received.values()) != expected:
            raise InternalError(
                f"internal: read {sum(received.values())} bytes of {key!r}, expected {expected}"
            )
        return expected if dest is not None else target

    def _get_ranges_current(
        self, address: str, bucket: str, key: str, version: int,
        ranges: list[tuple[int, int, int, int]], target: Any, received: dict[int, int],
        lock: threading.Lock, *, delete: bool,
    ) -> None:
        """One DoGet of ``ranges`` (``block, offset, length, dest_at``) into ``target`` with the
        newest context, counting what arrived per block in ``received``; a stale epoch
        (refused before any byte was sent) is adopted and the ticket sent again."""
        for attempt in range(STALE_EPOCH_RETRIES_MAX + 1):
            ticket = get_ticket(self._view.ctx, bucket=bucket, key=key, version=version,
                                ranges=[(index, offset, length) for index, offset, length, _
                                        in ranges],
                                delete=delete)
            try:
                counts, error = self._connection(address).get_ranges(ticket, ranges, target)
            except StaleEpoch as exc:
                if attempt == STALE_EPOCH_RETRIES_MAX:
                    raise
                self._adopt(exc)
                continue
            with lock:
                for (index, _, _, _), count in zip(ranges, counts, strict=True):
                    if count:
                        received[index] = received.get(index, 0) + count
            if error is not None:
                raise error
            return

    def _fetch_moved_blocks(
        self, view: View, bucket: str, key: str, key_raw: bytes, header: ObjectHeader,
        tried: str, ranges: list[tuple[int, int, int, int]], target: Any,
        received: dict[int, int], lock: threading.Lock, *, delete: bool,
    ) -> None:
        """Find blocks written under an earlier weight map: probe the other servers in order."""
        for index, offset, length, dest_at in ranges:
            with lock:
                if received.get(index, 0) == length:
                    continue
                received.pop(index, None)
            for server in view.placement.ranked(key_raw, index):
                if server.address == tried:
                    continue
                try:
                    self._get_ranges_current(server.address, bucket, key, header.version,
                                             [(index, offset, length, dest_at)], target,
                                             received, lock, delete=delete)
                    break
                except NotFound:
                    with lock:
                        received.pop(index, None)
                    continue
            else:
                what = f"block {index} of {bucket}/{key}"
                lost = _lost_error(view, what)
                if lost is not None:
                    raise lost
                raise ObjectNotFound(f"not_found: {what} is on no server of the job")

    def _delete_blocks(self, bucket: str, key: str, key_raw: bytes, header: ObjectHeader) -> None:
        """Free a version's data blocks (best effort: a failure leaves garbage, not an error)."""
        view = self._view
        blocks = range(1, header.block_count + 1)
        if view.epoch > 1:
            # Blocks may have been placed under an earlier map: ask every server.
            groups = {s.address: list(blocks) for s in _distinct_servers(view.handle.servers)}
        else:
            groups = {}
            for index in blocks:
                server = self._block_server(view, key_raw, index, header.persist)
                groups.setdefault(server.address, []).append(index)
        self._delete_block_groups(bucket, key, header.version, groups)

    def _delete_block_groups(
        self, bucket: str, key: str, version: int, groups: dict[str, list[int]]
    ) -> None:
        """Free the given blocks of one version, servers in parallel; failures are logged."""

        def run(address: str, indices: list[int]) -> None:
            try:
                for attempt in range(STALE_EPOCH_RETRIES_MAX + 1):
                    body = action_body(self._view.ctx, bucket=bucket, key=key, version=version,
                                       blocks=indices)
                    try:
                        self._connection(address).action(ACTION_DELETE_BLOCKS, body)
                        return
                    except StaleEpoch as exc:
                        if attempt == STALE_EPOCH_RETRIES_MAX:
                            raise
                        self._adopt(exc)
            except PocketflowError as exc:
                log.warning("could not free %d blocks of %s/%s on %s: %s", len(indices), bucket,
                            key, address, exc)

        self._parallel([
            lambda address=address, indices=indices: run(address, indices)
            for address, indices in groups.items()
        ])


_LIVE_CLIENTS: weakref.WeakSet[Client] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_LIVE_CLIENTS):
        client._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _lost_error(view: View, what: str) -> DataUnavailable | None:
    """The error for ``what`` being on no live server of a job that lost servers, or ``None``
    when the job lost none (then it is simply not found)."""
    lost = view.handle.lost
    if not lost:
        return None
    names = ", ".join(s.node_id for s in lost)
    return DataUnavailable(
        f"unavailable: {what} is on no live server of the job; it may have been on a lost "
        f"server ({names})", server=lost[-1].address,
    )


def _stale_reply(exc: StaleEpoch) -> Reply:
    """A reply standing for a session that failed with ``stale_epoch`` before running the op."""
    body = "stale_epoch: " + encode_json(exc.weight_map) if exc.weight_map is not None else ""
    return Reply(0, exc.grpc_code, None, memoryview(body.encode()))


def _failure_reply(exc: PocketflowError) -> Reply:
    """A reply standing for an op whose session failed with ``exc``."""
    if isinstance(exc, StaleEpoch):
        return _stale_reply(exc)
    return Reply(0, exc.grpc_code, None, memoryview(exc.message.encode()))


def _keys_of(result: dict[str, Any] | None) -> list[tuple[str, int]]:
    if not result:
        return []
    return [(str(item["key"]), int(item.get("size", 0))) for item in result.get("keys", [])]


def _distinct_servers(servers: Iterable[ServerInfo]) -> list[ServerInfo]:
    seen: set[str] = set()
    distinct: list[ServerInfo] = []
    for server in servers:
        if server.address not in seen:
            seen.add(server.address)
            distinct.append(server)
    return distinct


def _close_mmap(mapped: mmap.mmap) -> None:
    try:
        mapped.close()
    except BufferError:
        # A view still exported (a batch not yet collected); the mapping closes when it goes.
        pass


def connect(handle: JobHandle | str, **options: Any) -> Client:
    """Connect to a job's storage servers with its handle (a :class:`JobHandle` or its JSON).

    ``options`` are :class:`~pocketflow.config.ClientConfig` settings (``exchange_window``,
    ``io_threads``, ``op_timeout_s``, ...); unset ones come from ``POCKETFLOW_*`` environment
    variables, then the config file. No server is contacted until the first call.
    """
    if isinstance(handle, (str, bytes)):
        handle = JobHandle.from_json(handle)
    if not isinstance(handle, JobHandle):
        raise InvalidRequest(f"expected a JobHandle or its JSON, got {type(handle).__name__}")
    return Client(handle, ClientConfig.resolve(**options))
