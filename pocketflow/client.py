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
objects are striped over the job and read and written in parallel; an object of one data block
keeps it with its manifest, on the server of ``(key, 0)``, so its put is one round trip.

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

import io
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence

from pocketflow import _core
from pocketflow.config import ClientConfig
from pocketflow.errors import (
    BucketExists,
    BucketNotFound,
    DataLost,
    DataUnavailable,
    InvalidRequest,
    ObjectNotFound,
    PocketflowError,
    StaleEpoch,
)
from pocketflow.handle import JobHandle, ServerInfo
from pocketflow.layout import (
    STALE_EPOCH_RETRIES_MAX,
    View,
    view_of,
)
from pocketflow.protocol import (
    ACTION_CREATE_BUCKET,
    ACTION_DELETE_BUCKET,
    ACTION_DELETE_PREFIX,
    ACTION_LOOKUP,
    APPEND_SEGMENT_DEFAULT_BYTES,
    ENUMERATE_LIMIT_MAX,
    KEY_MAX_BYTES,
    OP_DELETE,
    OP_FLAG_CLAIM_WHOLE,
    OP_FLAG_DELETE,
    OP_GET,
    OP_LOOKUP,
    SMALL_OBJECT_MAX_BYTES,
    SUBSCRIBER_EVENTS_DEFAULT,
    ZERO_HEADER,
    ObjectHeader,
    Reply,
    action_body,
    check_bucket,
    check_key,
    check_keys,
    encode_json,
)
from pocketflow.records import TYPE_CHECKING, Record
from pocketflow.transport import ServerConnection

if TYPE_CHECKING:
    import logging
    import mmap
    from concurrent.futures import ThreadPoolExecutor
    from typing import IO, Any, BinaryIO, Literal, TypeVar, overload

    from pocketflow.channels import AppendFile, Queue
    from pocketflow.notifications import Listener

__all__ = ["Client", "ObjectInfo", "connect", "STALE_EPOCH_RETRIES_MAX"]


def _log() -> logging.Logger:
    """This module's logger, imported on first use like ``concurrent.futures`` (which imports
    ``logging`` too) and ``pathlib``: each task process connects afresh, and these three cost a
    fresh ``import pocketflow`` + ``connect`` a quarter of its time (benchmarks/import_connect.py)
    though a task that puts and gets on one server uses none of them."""
    import logging

    return logging.getLogger(__name__)


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
PROBE_BUCKET = "pocketflow-probe"
"""Bucket of the lookup :meth:`Client.unreachable_servers` asks every server (no job has it)."""
PROBE_KEY = "probe"
"""Key of that lookup."""

if TYPE_CHECKING:
    T = TypeVar("T")


class ObjectInfo(Record):
    """What a listing or a lookup knows of an object.

    ``persist`` is ``None`` when the source does not say (``enumerate`` reports key and size only).
    """

    __slots__ = ("key", "size", "persist")
    key: str
    size: int
    persist: bool | None

    def __init__(self, key: str, size: int, persist: bool | None = None) -> None:
        self._set(
            key=key,
            size=size,
            persist=persist,
        )


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
            handle = handle.replace(block_size_bytes=self._config.block_size_bytes)
        self._lock = threading.Lock()
        self._core = self._make_core(handle)
        self._view_cached: tuple[int, View] = (self._core.generation(), view_of(handle))
        # The newest handle given to this client (a renewed token): what a forked child starts
        # from, since it cannot ask its parent's native core (whose locks a fork may have held).
        self._handle_given = handle
        self._connections: dict[str, ServerConnection] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        _LIVE_CLIENTS.add(self)

    def _make_core(self, handle: JobHandle) -> Any:
        """The native object layer of ``handle``'s job: its view, connections and reads."""
        cfg = self._config
        return _core.Objects(
            handle.to_json(),
            sessions_max=cfg.sessions_per_server,
            op_timeout_s=cfg.op_timeout_s,
            first_reply_timeout_s=cfg.connect_timeout_s,
            rpc_timeout_s=cfg.rpc_timeout_s,
            stream_timeout_s=cfg.stream_timeout_s,
            io_threads=cfg.io_threads,
            exchange_window=cfg.exchange_window,
            direct=cfg.small_ops == "direct",
            tls_ca=handle.tls_ca.encode("ascii") if handle.tls_ca is not None else None,
        )

    @property
    def _view(self) -> View:
        """The view of the weight map in use: the native core's, which adopts newer maps."""
        generation, view = self._view_cached
        current = self._core.generation()
        if current != generation:
            view = view_of(JobHandle.from_json(self._core.handle_json()))
            self._view_cached = (current, view)
        return view

    def _forget_after_fork(self) -> None:
        """In a forked child: drop the parent's connections and threads (a native connection
        made by the parent refuses calls in the child and is never torn down there); new ones
        are made on first use, on the child's own native runtime. The parent's native core is
        left untouched (its locks may have been held at the fork): the child makes its own."""
        self._lock = threading.Lock()
        handle = self._view_cached[1].handle.updated_by(self._handle_given)
        self._core = self._make_core(handle)
        self._view_cached = (self._core.generation(), view_of(handle))
        self._connections = {}
        self._executor = None
        if self._closed:
            # Closed in the parent, closed here too.
            self._core.close(reopen=False)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def handle(self) -> JobHandle:
        """The job handle in use, with the newest weight map this client has seen."""
        return self._view.handle

    @property
    def config(self) -> ClientConfig:
        """The resolved client settings."""
        return self._config

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Close every session and connection; the client cannot be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._connections.clear()
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        self._core.close(reopen=False)

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
            updated = current.updated_by(handle)
            self._handle_given = updated
            self._core.set_handle(updated.to_json())

    def disconnect(self) -> None:
        """Close every connection but keep the client usable: the next call reconnects.

        Not needed around ``fork()``: a forked child makes connections of its own on first use.
        Calls in flight on other threads finish on the connections they hold.
        """
        with self._lock:
            if self._closed:
                return
            self._connections.clear()
        self._core.close(reopen=True)

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

    def unreachable_servers(self) -> list[ServerInfo]:
        """The servers of the job's map that do not answer now (:class:`DataUnavailable`), each
        asked once, all at the same time; empty when every server answers.

        A lookup of a key that no job has is the question: any answer, ``not_found`` included,
        counts. It is what a task asks before it waits for the control plane to move its job off
        a server it cannot reach: when none of the job's servers answers, no newer map can reach
        the task (a map is learnt from a live server's answer), so waiting cannot help.
        """
        for attempt in range(STALE_EPOCH_RETRIES_MAX + 1):
            view = self._view
            servers = _distinct_servers(view.handle.servers)
            body = action_body(view.ctx, bucket=PROBE_BUCKET, key=PROBE_KEY)

            def run(server: ServerInfo, body: bytes = body) -> PocketflowError | None:
                try:
                    self._connection(server.address).action(ACTION_LOOKUP, body)
                except PocketflowError as exc:
                    return exc
                return None

            results = self._parallel([lambda s=s: run(s) for s in servers])
            stale = next((r for r in results if isinstance(r, StaleEpoch)), None)
            if stale is None or attempt == STALE_EPOCH_RETRIES_MAX:
                return [s for s, r in zip(servers, results, strict=True)
                        if isinstance(r, DataUnavailable)]
            self._adopt(stale)
        raise AssertionError("unreachable")

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
        from pocketflow.channels import Queue

        return Queue(self, bucket, name, max_items=max_items)

    def append_file(self, bucket: str, key: str, *,
                    segment_bytes: int = APPEND_SEGMENT_DEFAULT_BYTES) -> AppendFile:
        """A shared append file named ``key`` in ``bucket`` (see
        :class:`pocketflow.channels.AppendFile`); it exists once something is appended."""
        from pocketflow.channels import AppendFile

        return AppendFile(self, bucket, key, segment_bytes=segment_bytes)

    def subscribe(self, bucket: str, prefix: str = "", *,
                  ops: Iterable[str] = ("put", "delete"),
                  capacity: int = SUBSCRIBER_EVENTS_DEFAULT) -> Listener:
        """A listener of ``ops`` on keys of ``bucket`` starting with ``prefix``, on every server
        of the job (see :mod:`pocketflow.notifications`); close it when done."""
        from pocketflow.notifications import Listener

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
        A bytes-like ``data`` is read in place without the interpreter lock while the put runs:
        do not change it until ``put`` returns (other threads run meanwhile). A small object's
        bytes are read once, so a retry (a newer map, a bucket made on a new server) sends what
        the first attempt sent; a large object's blocks are read as they are sent, so changing
        them meanwhile stores a mix of old and new bytes.
        Raises :class:`ObjectExists` if the key holds an object and ``overwrite`` is false,
        :class:`CapacityExhausted` if a server is full (nothing of the object remains),
        :class:`BucketNotFound`, :class:`PersistNotSupported`, :class:`DataUnavailable`,
        :class:`ServerSuspect` (the key's write-once check needs a hung server),
        :class:`ClientBusy` (every session of this client to a server stayed busy).
        """
        check_bucket(bucket)
        check_key(key)
        if _is_stream(data):
            from pocketflow.objectfile import ObjectWriter

            with ObjectWriter(self, bucket, key, persist=persist, overwrite=overwrite) as writer:
                writer.write_from(data)  # type: ignore[arg-type]
            return
        self._core.put(bucket, key, _as_view(data), persist=persist, overwrite=overwrite)

    def get(self, bucket: str, key: str, *, delete: bool = False) -> bytes:
        """The object's bytes; with ``delete`` the object is removed as it is read.

        Among concurrent readers with ``delete``, exactly one gets the object and the others get
        :class:`ObjectNotFound` (:class:`DataUnavailable` once the job has lost a server: see the
        module doc). A reader that fails or dies before it has the bytes leaves the object in
        place: a striped object is removed only after its blocks are read (one more round trip,
        a ``delete`` of the version read). Raises :class:`ObjectNotFound`,
        :class:`BucketNotFound`, :class:`DataUnavailable`.
        """
        check_bucket(bucket)
        check_key(key)
        return self._core.get(bucket, key, delete=delete)

    def get_into(self, bucket: str, key: str, buffer: Any, *, delete: bool = False) -> int:
        """Read the object into ``buffer`` (any writable bytes-like object); returns its size.

        The bytes are copied once, from the received messages straight into ``buffer``. If the
        buffer is smaller than the object, :class:`InvalidRequest` is raised and the object is
        left in place (with ``delete``, it is put back under its original version).
        """
        dest = _writable_view(buffer)
        check_bucket(bucket)
        check_key(key)
        return self._core.get_into(bucket, key, dest, delete=delete)

    def get_range(self, bucket: str, key: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of the object, cut at its end (like a slice)."""
        if offset < 0 or length < 0:
            raise InvalidRequest("offset and length must be >= 0")
        check_bucket(bucket)
        check_key(key)
        return self._core.get_range(bucket, key, offset, length)

    def lookup(self, bucket: str, key: str) -> ObjectInfo:
        """Size and PERSIST flag of an object; raises :class:`ObjectNotFound` if it is absent."""
        check_bucket(bucket)
        check_key(key)
        size, persist = self._core.lookup(bucket, key)
        return ObjectInfo(key, size, persist)

    def exists(self, bucket: str, key: str) -> bool:
        """Whether the object exists (a :meth:`lookup` that answers ``False`` when it does not;
        after the job lost a server, a key on no live server raises :class:`DataUnavailable`)."""
        try:
            self.lookup(bucket, key)
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

    def delete_if_lost(self, bucket: str, key: str) -> bool:
        """Delete the object only if its bytes are lost (a read raises :class:`DataLost`);
        returns whether it deleted it.

        Only the version that read lost is deleted: the record's version is looked up first,
        then the object is read, and only if that read raises :class:`DataLost` is a delete
        conditional on the looked-up version sent. A version written since (its writer's rerun,
        after another reader deleted the lost one) is a different version, which the conditional
        delete leaves in place. Raises what :meth:`lookup` raises (:class:`ObjectNotFound`,
        :class:`DataUnavailable`, ...) and any error of the read other than :class:`DataLost`.
        """
        bucket_raw = check_bucket(bucket)
        key_raw = check_key(key)
        server, reply = self._fetch_record(bucket, bucket_raw, key_raw, OP_LOOKUP, 0)
        if reply.header is None:
            raise ObjectNotFound(f"{bucket}/{key}")
        try:
            self._core.get(bucket, key, delete=False)
        except DataLost:
            return bool(self._core.claim_record(
                server, bucket, key, reply.header.encode(), bytes(reply.body)
            ))
        return False

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
            import mmap

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
        for attempt in range(DELETE_READ_RETRIES_MAX + 1):
            try:
                return self._get_file_once(bucket, bucket_raw, key, key_raw, path, delete=delete)
            except _LostClaim as lost:
                if attempt == DELETE_READ_RETRIES_MAX:
                    raise lost.error from None
        raise AssertionError("the last attempt returns or raises")

    def _get_file_once(
        self, bucket: str, bucket_raw: bytes, key: str, key_raw: bytes,
        path: str | os.PathLike[str], *, delete: bool,
    ) -> int:
        # With delete a small object's record is claimed as it is read; a striped object's is
        # taken after its blocks are written (``Client.get``'s rule, in the native core).
        server, reply = self._fetch_record(
            bucket, bucket_raw, key_raw, OP_GET,
            OP_FLAG_DELETE | OP_FLAG_CLAIM_WHOLE if delete else 0,
        )
        header = reply.header
        from pathlib import Path

        target = Path(path)
        try:
            if header is None or header.block_count == 0:
                target.write_bytes(reply.body)
                return len(reply.body)
            f = open(target, "w+b")  # noqa: SIM115 - closed below, or right here on failure
            try:
                f.truncate(header.size)
                import mmap

                mapped = mmap.mmap(f.fileno(), header.size)
            except BaseException:
                f.close()
                raise
        except OSError:
            if delete and header is not None and header.block_count == 0:
                self._restore_record(server, bucket, key, header, reply.body)
            raise
        with f:
            try:
                try:
                    self._read_blocks(
                        bucket, key, key_raw, header, 0, header.size, delete=False,
                        dest=memoryview(mapped), value=reply.body,
                    )
                except ObjectNotFound as exc:
                    if not delete:
                        raise
                    raise _LostClaim(exc) from None  # a block the winner of a race freed
                mapped.flush()
            finally:
                _close_mmap(mapped)
        if delete and not self._core.claim_record(
            server, bucket, key, header.encode(), bytes(reply.body)
        ):
            raise _LostClaim(ObjectNotFound(f"{bucket}/{key} was taken by another reader"))
        return header.size

    if TYPE_CHECKING:  # the variants are for type checkers; typing costs each task its import
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
        from pocketflow.objectfile import ObjectReader, ObjectWriter

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

        All of it runs in the native core with the GIL released. Small objects are pipelined
        over one session per server, all servers in parallel, in rounds of at most 4,096
        objects and 64 MiB; large ones form the last round and are put afterwards, up to
        ``LARGE_OBJECTS_IN_FLIGHT_MAX`` at once. On an error the first one (in the order of
        ``items``) is raised after every other object of its round has been tried; later rounds
        are not sent. A large object that fails leaves none of its blocks behind.
        """
        check_bucket(bucket)
        # A bytes object is already a flat view of bytes: no memoryview is made for it (a
        # shuffle's mapper hands over hundreds of small partitions per call).
        checked = [(key, data if type(data) is bytes else _as_view(data)) for key, data in items]
        check_keys(key for key, _ in checked)
        return self._core.put_many(bucket, checked, persist=persist, overwrite=overwrite)

    def get_many(
        self, bucket: str, keys: Iterable[str], *, delete: bool = False
    ) -> list[bytes]:
        """The bytes of many objects, in the order of ``keys``.

        All of it runs in the native core with the GIL released: block-0 reads are pipelined
        over one session per server, all servers in parallel; large objects' blocks are fetched
        afterwards, up to ``LARGE_OBJECTS_IN_FLIGHT_MAX`` objects at once; with ``delete``, an
        object of one data block is read again by a READ that claims its record with the block
        (as :meth:`get` does), ``io_threads`` of them at once. Every object is read
        before an error is raised: the first failure in key order (with ``delete``, the objects
        read are gone).
        """
        check_bucket(bucket)
        key_list = list(keys)
        check_keys(key_list)
        return self._core.get_many(bucket, key_list, delete=delete)

    def get_each(
        self, bucket: str, keys: Iterable[str], *, delete: bool = False
    ) -> list[bytes | PocketflowError]:
        """Like :meth:`get_many`, but each key's own outcome: its bytes, or the error that key
        met (:class:`ObjectNotFound`, :class:`DataUnavailable`, ...), which is returned in its
        place instead of raised. For readers that handle a lost input themselves, such as a
        shuffle's reducer reading its partitions with ``delete``: every object found is read
        (and with ``delete`` consumed), and none of it is dropped because another key failed.
        """
        check_bucket(bucket)
        key_list = list(keys)
        check_keys(key_list)
        return self._core.get_many(bucket, key_list, delete=delete, each=True)

    def get_many_into(
        self, bucket: str, keys: Iterable[str], buffer: Any, offsets: Sequence[int],
        sizes: Sequence[int],
    ) -> list[PocketflowError | None]:
        """Read object ``i`` of ``keys`` into ``buffer[offsets[i]:offsets[i] + sizes[i]]``
        (a writable C-contiguous buffer; the ranges inside it and apart), as :meth:`get_many`
        reads (block-0 reads pipelined per server, then the large objects' blocks), with no
        ``bytes`` made: a reader that keeps many objects in one buffer mapped with huge pages
        faults its memory in 2 MiB at a time. Each key's outcome: None once its range holds the
        object, or its error (:class:`InvalidRequest` if the object is not ``sizes[i]`` bytes).
        """
        check_bucket(bucket)
        key_list = list(keys)
        for key in key_list:
            check_key(key)
        return self._core.get_many_into(bucket, key_list, buffer, list(offsets), list(sizes))

    def pin_views(self, bucket: str, keys: Iterable[str]) -> list[memoryview | None]:
        """Read ``keys`` in place where this host's servers share their DRAM arena: per key a
        read-only ``memoryview`` of the object's bytes, pinned in the server's memory (no copy;
        the bytes never change while any view of them lives, whatever happens to the object or
        its server, and a child forked meanwhile keeps private copies of them),
        a view of a small object's bytes (which came with the reply), or None for a key this
        call did not read (a server of another host or without a shared arena, an object of
        several data blocks or on NVMe, a pin refused at a bound, an object not found): read
        those as usual. The pins are released, batched, when their views are gone, also after
        this client is closed (by the process that pinned them: a forked child's inherited
        views are private copies of the bytes).
        """
        check_bucket(bucket)
        key_list = list(keys)
        check_keys(key_list)
        return [None if r is None else memoryview(r).toreadonly()
                for r in self._core.pin_views(bucket, key_list)]

    def get_shared(self, bucket: str, keys: Iterable[str]) -> list[memoryview | PocketflowError]:
        """Like :meth:`get_each`, each object as a read-only ``memoryview``: read in place by
        :meth:`pin_views` where it can be, else read (copied) as :meth:`get_each` reads."""
        key_list = list(keys)
        out: list[memoryview | PocketflowError | None] = list(self.pin_views(bucket, key_list))
        rest = [i for i, view in enumerate(out) if view is None]
        if rest:
            for i, read in zip(rest, self.get_each(bucket, [key_list[i] for i in rest]),
                               strict=True):
                out[i] = read if isinstance(read, PocketflowError) else memoryview(read)
        return out  # type: ignore[return-value]

    @property
    def shared_counts(self) -> dict[str, int]:
        """This client's zero-copy reads so far: objects read in place (``pinned``), small ones
        that came with a pin's reply (``values``), and those left to a copying read
        (``copied``)."""
        pinned, values, copied = self._core.shared_counts()
        return {"pinned": pinned, "values": values, "copied": copied}

    # -- waiting -----------------------------------------------------------------------------

    def wait_for(self, bucket: str, keys: Iterable[str], *, timeout_s: float) -> list[str]:
        """Block until every key exists or ``timeout_s`` passes; returns the keys still missing
        (in the order given).

        The native core does it with the GIL released (``waits.rs``). Keys already written are
        found first by one pipelined ``LOOKUP`` per server over the small-op sessions (for up to
        ``exchange_window`` keys); with ``timeout_s`` 0 that is the whole check. Only the keys
        still missing are parked on the servers that hold their block 0 (the ``wait`` action,
        at most ``WAIT_TIMEOUT_MAX_MS`` per call, every server at once), which answer as soon as
        the last of their keys is put, so a reader waiting for another task's output neither
        polls with ``not_found`` nor sleeps longer than needed. After the job's map changed
        (epoch > 1) keys written under an earlier map are also looked for where that map put
        them. Raises :class:`DataUnavailable` (with ``server``) when a server holding awaited
        keys cannot be reached, :class:`BucketNotFound`.
        """
        check_bucket(bucket)
        key_list = list(keys)
        check_keys(key_list)
        # The core awaits a repeated key once and checks the timeout (InvalidRequest).
        return self._core.wait_for(bucket, key_list, float(timeout_s))

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
        # The native core asks every server (in parallel, then a page at a time) and merges.
        for page in self._core.enumerate(bucket, prefix, page_size):
            yield [ObjectInfo(key, size) for key, size in page]

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
                # The native core owns the connection (its reads use the same sessions).
                connection = ServerConnection.wrap(
                    self._core.connection(address),
                    exchange_command=lambda: self._view.exchange_command,
                    op_timeout_s=self._config.op_timeout_s,
                )
                self._connections[address] = connection
            return connection

    def _executor_get(self) -> ThreadPoolExecutor:
        """The I/O threads (data blocks), made on first use."""
        return self._pool_get("_executor", self._config.io_threads, "pocketflow-io")

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
                from concurrent.futures import ThreadPoolExecutor

                executor = ThreadPoolExecutor(max_workers=workers,
                                              thread_name_prefix=thread_prefix)
                setattr(self, attribute, executor)
            return executor

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
        """Adopt the newer weight map a ``stale_epoch`` error carries (the native core keeps
        the map in use; an older or equal epoch changes nothing)."""
        weight_map = stale.weight_map
        if weight_map is None:
            raise stale
        try:
            adopted = self._core.adopt_weight_map(encode_json(weight_map))
        except (InvalidRequest, ValueError):
            raise stale from None
        if adopted:
            _log().debug("job %s: adopted weight map epoch %s", self._view.handle.job_id,
                      weight_map.get("epoch"))

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
    ) -> tuple[str, Reply]:
        """Run a GET, LOOKUP or DELETE of block 0 where the object lives (see module doc), in
        the native core; returns the address of the server that answered and its reply.

        A GET or LOOKUP that finds the key on no live server of a job that lost servers raises
        :class:`DataUnavailable` (unless ``lost_unavailable`` is false).
        """
        address, header, body = self._core.fetch_record(
            bucket, key_raw.decode(), op, flags, lost_unavailable=lost_unavailable
        )
        return address, Reply(0, 0, None if header is None else ObjectHeader(*header), body)

    def _restore_record(
        self, server: str, bucket: str, key: str, header: ObjectHeader,
        body: bytes | memoryview,
    ) -> None:
        """Put back a record claimed by a DELETE read that could not be delivered."""
        try:
            # A small object's bytes, or a manifest's value (an overflowed one's skipped
            # servers).
            self._core.restore_record(server, bucket, key, header.encode(), body)
        except PocketflowError as exc:
            _log().warning("could not restore %s/%s after a failed DELETE read: %s",
                           bucket, key, exc)

    # -- internals: small and large puts -----------------------------------------------------

    def _put_small(
        self, bucket: str, bucket_raw: bytes, key_raw: bytes, value: memoryview | bytes, *,
        persist: bool, overwrite: bool,
    ) -> None:
        self._core.put(bucket, key_raw.decode(), value, persist=persist, overwrite=overwrite)

    # -- internals: data blocks --------------------------------------------------------------

    def _read_blocks(
        self, bucket: str, key: str, key_raw: bytes, header: ObjectHeader, start: int, end: int,
        *, delete: bool, dest: memoryview | None = None, value: bytes | memoryview = b"",
    ) -> Any:
        """Read object bytes ``[start, end)`` of a large object from its data blocks, in the
        native core (servers and tickets in parallel, GIL released, blocks written under an
        earlier map found by probing). ``value`` is the manifest record's value (the servers an
        overflowed object's blocks skipped).

        With ``dest`` the bytes land in ``dest[0:end-start]`` and the count is returned;
        without, they land in a ``bytes`` of the exact size, filled in place, which is returned.
        """
        return self._core.read_blocks(bucket, key, header.encode(), start, end, delete=delete,
                                      dest=dest, value=bytes(value))

    def _delete_blocks(self, bucket: str, key: str, key_raw: bytes, header: ObjectHeader) -> None:
        """Free a version's data blocks (best effort: a failure leaves garbage, not an error)."""
        self._core.delete_blocks(bucket, key, header.encode())





DELETE_READ_RETRIES_MAX = 1
"""How many more times ``get_file(delete=True)`` reads a key again after another reader took
the striped version it read, or an overwrite replaced it (the native core's bound of the same
name, for ``get``)."""


class _LostClaim(Exception):
    """A DELETE read of a striped object lost the version it read: ``error`` if it was the last
    try."""

    def __init__(self, error: ObjectNotFound) -> None:
        super().__init__(str(error))
        self.error = error


_LIVE_CLIENTS: weakref.WeakSet[Client] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_LIVE_CLIENTS):
        client._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _stale_reply(exc: StaleEpoch) -> Reply:
    """A reply standing for a session that failed with ``stale_epoch`` before running the op."""
    body = "stale_epoch: " + encode_json(exc.weight_map) if exc.weight_map is not None else ""
    return Reply(0, exc.grpc_code, None, memoryview(body.encode()))


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
