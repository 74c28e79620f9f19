"""Channels between tasks on the storage servers: FIFO queues and shared append files.

::

    q = pf.queue("work", "map/7/out", max_items=1000)
    q.enqueue(b"item", timeout_s=5)       # waits up to 5 s while the queue is full
    item = q.dequeue(timeout_s=5)          # the item, or None when 5 s pass
    log = pf.append_file("work", "reduce/3")
    log.append(b"a whole record")          # atomic: never torn or interleaved with another
    for record in log: ...

Both live on the storage servers in *segments* ``(name, 0), (name, 1), ...``: segment ``i`` is
on the server that the job's placement picks for block ``i`` of ``name``, and travels over the
same exchange sessions as small objects (items and records are at most
``SMALL_OBJECT_MAX_BYTES``). A segment is *sealed* when it cannot grow (an append file's segment
is full, or a server ran out of room); writers then go on in the next segment, and readers move
on once a sealed segment has nothing more for them, so one queue or file can outgrow one server
while each segment keeps its order. Each object keeps the segment it reached as a hint; a new one
finds its way from segment 0 (at most :data:`SEGMENTS_MAX` segments).

Segments are placed with the weight map in force when they are first used. A map change (a
grown job, a lost server) can move where a new client looks for an existing segment: channels
are meant for the tasks of one stage, not to outlive resizing.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from pocketflow.errors import (
    CapacityExhausted,
    InvalidRequest,
    QueueFull,
    SegmentSealed,
    error_from_status,
)
from pocketflow.protocol import (
    APPEND_READ_MAX_BYTES,
    APPEND_SEGMENT_DEFAULT_BYTES,
    APPEND_SEGMENT_MAX_BYTES,
    CHANNEL_WAIT_MAX_MS,
    HEADER_STRUCT,
    OP_APPEND,
    OP_DEQUEUE,
    OP_ENQUEUE,
    OP_FLAG_SEAL,
    OP_QUEUE_INFO,
    OP_READ_APPEND,
    OP_READ_RECORDS,
    QUEUE_ITEMS_MAX,
    SMALL_OBJECT_MAX_BYTES,
    ObjectHeader,
    Reply,
    check_bucket,
    check_key,
)
from pocketflow.transport import _reply

if TYPE_CHECKING:
    from pocketflow.client import Client

__all__ = ["Queue", "AppendFile", "RecordPosition", "SEGMENTS_MAX", "APPEND_SEGMENT_DEFAULT_BYTES"]

SEGMENTS_MAX = 64
"""Most segments one queue or append file spans (each on the server its index places it on)."""
APPEND_BATCH_MAX = 256
"""Most records one ``append_many`` sends in one pipelined round (the session's in-flight
bound; within the native run's ``PLACED_OPS_MAX``)."""
_LENGTH = struct.Struct("<I")


def _args(a: int = 0, b: int = 0, c: int = 0, d: int = 0, e: int = 0) -> bytes:
    """A queue or append op's arguments, in the op's 32 header bytes."""
    return HEADER_STRUCT.pack(a, b, c, d, e, 0)


class _Channel:
    """What queues and append files share: a name in a bucket, segments placed by index."""

    def __init__(self, client: Client, bucket: str, name: str) -> None:
        self._client = client
        self.bucket = bucket
        self.name = name
        self._bucket_raw = check_bucket(bucket)
        self._name_raw = check_key(name)

    def _call(self, op: int, segment: int, args: bytes, value: Any = b"", flags: int = 0) -> Reply:
        """Run one op on the server of ``segment``; returns its OK reply or raises its error.
        The native core places it, and adopts a newer map and runs it again on
        ``stale_epoch``."""
        server, status, header, body = self._client._core.call_placed(
            op, flags, self._bucket_raw, self._name_raw, segment, args, value
        )
        reply = _reply((status, header, body))
        if reply.status == 0:
            return reply
        raise error_from_status(reply.status, reply.body, server=server)

    def _run(self, segment: int, ops: list[tuple[int, int, bytes, Any]]) -> list[Reply]:
        """Run ``ops``, ``(op, flags, args, value)`` tuples, pipelined over one session of
        ``segment``'s server; returns each op's reply, in order (errors are per op). The
        native core places them, adopts a newer map on ``stale_epoch`` and creates the bucket
        on a server added to the job after it was made, and runs the refused ops again."""
        raw = self._client._core.run_placed(self._bucket_raw, self._name_raw, segment, ops)
        return [_reply(reply) for reply in raw]

    def _wait_ms(self, deadline: float) -> int:
        """The server-side wait of the next op: what is left, within the server's bound and
        well within the client's own reply timeout."""
        left_ms = max(0.0, deadline - time.monotonic()) * 1000
        cap_ms = min(CHANNEL_WAIT_MAX_MS, self._client.config.op_timeout_s * 500)
        return int(min(left_ms, cap_ms))

    @staticmethod
    def _next_segment(segment: int) -> int:
        if segment + 1 >= SEGMENTS_MAX:
            raise CapacityExhausted(
                f"capacity_exhausted: {SEGMENTS_MAX} segments used, none has room"
            )
        return segment + 1


class Queue(_Channel):
    """A bounded FIFO queue on the storage servers (build it with ``Client.queue``).

    Each item is delivered exactly once, whatever the number of concurrent consumers: the server
    takes it off the queue as part of the dequeue. ``max_items`` bounds the queue (at most
    ``QUEUE_ITEMS_MAX``); an enqueue into a full queue waits for room up to its timeout, then
    raises :class:`QueueFull`. Thread-safe; any number of clients may use one queue by name.
    """

    def __init__(self, client: Client, bucket: str, name: str, *, max_items: int) -> None:
        super().__init__(client, bucket, name)
        if not isinstance(max_items, int) or not 1 <= max_items <= QUEUE_ITEMS_MAX:
            raise InvalidRequest(f"max_items must be an int in 1..{QUEUE_ITEMS_MAX}")
        self.max_items = max_items
        self._head = 0
        self._tail = 0

    def __repr__(self) -> str:
        return f"<pocketflow.Queue {self.bucket}/{self.name} max_items={self.max_items}>"

    def _info(self, segment: int, *, seal: bool = False, bound: int = 1) -> ObjectHeader:
        reply = self._call(OP_QUEUE_INFO, segment, _args(c=segment, d=bound),
                           flags=OP_FLAG_SEAL if seal else 0)
        assert reply.header is not None
        return reply.header

    def _bound_of(self, segment: int) -> int:
        """The bound a new segment gets: ``max_items`` less what earlier segments still hold,
        so the whole queue never holds more than ``max_items``."""
        if segment == 0:
            return self.max_items
        held = sum(self._info(s).size for s in range(segment))
        return self.max_items - held

    def enqueue(self, data: Any, *, timeout_s: float | None = None) -> None:
        """Add ``data`` (bytes-like, at most ``SMALL_OBJECT_MAX_BYTES``) at the tail. While the
        queue is full, wait up to ``timeout_s`` (default: not at all) for room, then raise
        :class:`QueueFull`. Raises :class:`CapacityExhausted` if no server has room."""
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        if len(view) > SMALL_OBJECT_MAX_BYTES:
            raise InvalidRequest(
                f"a queue item is at most {SMALL_OBJECT_MAX_BYTES} bytes, got {len(view)}"
            )
        deadline = time.monotonic() + (timeout_s or 0.0)
        segment = self._tail
        bound = self.max_items
        while True:
            try:
                self._call(OP_ENQUEUE, segment,
                           _args(a=self._wait_ms(deadline), c=segment, d=max(bound, 1)), view)
                self._tail = segment
                return
            except QueueFull:
                if time.monotonic() >= deadline:
                    raise
            except SegmentSealed:
                segment = self._next_segment(segment)
                bound = self._bound_of(segment)
            except CapacityExhausted:
                # This segment's server is full: seal it and go on in the next one.
                self._info(segment, seal=True, bound=bound)
                segment = self._next_segment(segment)
                bound = self._bound_of(segment)
            if bound < 1:
                raise QueueFull(
                    f"queue_full: {self.name} holds its maximum of {self.max_items} items"
                )

    def dequeue(self, *, timeout_s: float | None = None) -> bytes | None:
        """Take the item at the head; while the queue is empty, wait up to ``timeout_s``
        (default: not at all). Returns the item, or ``None`` when the time passed."""
        deadline = time.monotonic() + (timeout_s or 0.0)
        segment = self._head
        while True:
            reply = self._call(OP_DEQUEUE, segment, _args(a=self._wait_ms(deadline), c=segment))
            header = reply.header
            assert header is not None
            if header.version == 1:
                self._head = segment
                return bytes(reply.body)
            if header.flags & 1:
                # Sealed and empty: everything of this segment was taken; go on.
                if segment + 1 >= SEGMENTS_MAX:
                    return None
                segment += 1
                continue
            if time.monotonic() >= deadline:
                self._head = segment
                return None

    def __len__(self) -> int:
        """Items in the queue now (over its segments)."""
        total = 0
        for segment in range(self._head, SEGMENTS_MAX):
            header = self._info(segment)
            total += header.size
            if not header.flags & 1:
                break
        return total


class RecordPosition(NamedTuple):
    """Where an append put its record: segment, byte offset and record index in it."""

    segment: int
    offset: int
    index: int


class AppendFile(_Channel):
    """A file on the storage servers that many writers append whole records to (build it with
    ``Client.append_file``).

    Each :meth:`append` is atomic: a record (1 byte to ``SMALL_OBJECT_MAX_BYTES``) lands whole,
    after every record appended before it on its segment, never torn or interleaved with another
    writer's. Readers iterate records (``for record in file``) or read bytes by offset
    (:meth:`read`); the file's bytes are its segments' records back to back. A segment holds
    ``segment_bytes`` (default 4 MiB); the file grows over segments on the job's servers.
    """

    def __init__(self, client: Client, bucket: str, key: str, *,
                 segment_bytes: int = APPEND_SEGMENT_DEFAULT_BYTES) -> None:
        super().__init__(client, bucket, key)
        if not isinstance(segment_bytes, int) or not (
            SMALL_OBJECT_MAX_BYTES <= segment_bytes <= APPEND_SEGMENT_MAX_BYTES
        ):
            raise InvalidRequest(
                f"segment_bytes must be in {SMALL_OBJECT_MAX_BYTES}..{APPEND_SEGMENT_MAX_BYTES}"
            )
        self.segment_bytes = segment_bytes
        self._tail = 0

    def __repr__(self) -> str:
        return f"<pocketflow.AppendFile {self.bucket}/{self.name}>"

    def append(self, record: Any) -> RecordPosition:
        """Append ``record`` whole; returns where it landed. Raises :class:`CapacityExhausted`
        if no server has room."""
        view = memoryview(record).cast("B") if not isinstance(record, bytes) else record
        if not 1 <= len(view) <= SMALL_OBJECT_MAX_BYTES:
            raise InvalidRequest(
                f"a record is 1..{SMALL_OBJECT_MAX_BYTES} bytes, got {len(view)}"
            )
        segment = self._tail
        while True:
            try:
                reply = self._call(OP_APPEND, segment,
                                   _args(b=self.segment_bytes, c=segment), view)
            except SegmentSealed:
                segment = self._next_segment(segment)
                continue
            except CapacityExhausted:
                self._call(OP_READ_APPEND, segment, _args(c=segment), flags=OP_FLAG_SEAL)
                segment = self._next_segment(segment)
                continue
            self._tail = segment
            header = reply.header
            assert header is not None
            return RecordPosition(segment, header.size, header.version)

    def append_many(self, records: list[Any]) -> list[RecordPosition]:
        """Append each record whole, pipelined (one round trip per segment reached, not per
        record); returns where each landed, in the order given. The records of one call run
        concurrently, so their order among themselves in the file is not fixed (each one's
        bytes never interleave with another's)."""
        views = [memoryview(r).cast("B") if not isinstance(r, bytes) else r for r in records]
        for view in views:
            if not 1 <= len(view) <= SMALL_OBJECT_MAX_BYTES:
                raise InvalidRequest(
                    f"a record is 1..{SMALL_OBJECT_MAX_BYTES} bytes, got {len(view)}"
                )
        positions: list[RecordPosition | None] = [None] * len(views)
        pending = list(range(len(views)))
        segment = self._tail
        while pending:
            failures: list[Reply] = []
            args = _args(b=self.segment_bytes, c=segment)
            for start in range(0, len(pending), APPEND_BATCH_MAX):
                batch = pending[start:start + APPEND_BATCH_MAX]
                replies = self._run(segment, [(OP_APPEND, 0, args, views[i]) for i in batch])
                for i, reply in zip(batch, replies, strict=True):
                    if reply.status != 0:
                        failures.append(reply)
                        continue
                    assert reply.header is not None
                    positions[i] = RecordPosition(segment, reply.header.size,
                                                  reply.header.version)
            pending = [i for i in pending if positions[i] is None]
            if not pending:
                break
            errors = [error_from_status(r.status, r.body) for r in failures]
            other = next((e for e in errors if not isinstance(e, SegmentSealed | CapacityExhausted)
                          or isinstance(e, QueueFull)), None)
            if other is not None:
                raise other
            if any(not isinstance(e, SegmentSealed) for e in errors):
                # The segment's server is full: seal it so nobody waits on it, go on.
                self._call(OP_READ_APPEND, segment, _args(c=segment), flags=OP_FLAG_SEAL)
            segment = self._next_segment(segment)
        self._tail = segment
        return positions  # type: ignore[return-value]

    def _state(self, segment: int) -> ObjectHeader:
        reply = self._call(OP_READ_APPEND, segment, _args(c=segment))
        assert reply.header is not None
        return reply.header

    def size(self) -> int:
        """Bytes appended so far (over every segment)."""
        total = 0
        for segment in range(SEGMENTS_MAX):
            state = self._state(segment)
            total += state.size
            if not state.flags & 1:
                break
        return total

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of the file, cut at its end (like a slice)."""
        if offset < 0 or length < 0:
            raise InvalidRequest("offset and length must be >= 0")
        parts: list[bytes] = []
        start = 0  # file offset of the segment's first byte
        end = offset + length
        for segment in range(SEGMENTS_MAX):
            if offset >= end:
                break
            state = self._state(segment)
            seg_len = state.size
            stop = min(end, start + seg_len)
            if offset < stop:
                # Every piece of this segment at once, pipelined over one session.
                ops = [(OP_READ_APPEND, 0,
                        _args(a=at - start, c=segment, d=min(stop - at, APPEND_READ_MAX_BYTES)),
                        b"")
                       for at in range(offset, stop, APPEND_READ_MAX_BYTES)]
                for reply in self._run(segment, ops):
                    if reply.status != 0:
                        raise error_from_status(reply.status, reply.body)
                    parts.append(bytes(reply.body))
                offset = stop
            if not state.flags & 1:
                break
            start += seg_len
        return b"".join(parts)

    def records(self) -> Iterator[bytes]:
        """Every record in file order (segment by segment, in append order within each),
        up to what was appended when the iteration reaches the last segment."""
        for segment in range(SEGMENTS_MAX):
            index = 0
            while True:
                reply = self._call(OP_READ_RECORDS, segment,
                                   _args(a=index, c=segment, d=APPEND_READ_MAX_BYTES))
                header = reply.header
                assert header is not None
                count = header.version
                body = memoryview(reply.body)
                at = 0
                for _ in range(count):
                    (n,) = _LENGTH.unpack_from(body, at)
                    yield bytes(body[at + 4:at + 4 + n])
                    at += 4 + n
                index += count
                if count == 0:
                    break
            if not header.flags & 1:
                return

    def __iter__(self) -> Iterator[bytes]:
        return self.records()
