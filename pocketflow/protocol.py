"""The wire protocol of docs/PROTOCOL.md: limits, object header, exchange frames, tickets, bodies.

Every constant here mirrors ``servers/crates/protocol/src/limits.rs`` by name and value (a test
reads that file and pins them). All integers on the wire are little-endian. This module does no
I/O; ``transport.py`` moves the bytes it builds.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence

from pocketflow.errors import InvalidRequest
from pocketflow.records import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from typing import Any

# -- limits (mirrors limits.rs) --------------------------------------------------------------------

SMALL_OBJECT_MAX_BYTES = 64 * 1024
"""Largest object stored as a single block-0 record and moved over the DoExchange session."""
BLOCK_SIZE_DEFAULT_BYTES = 1024 * 1024
"""Default size of one data block of a large object."""
BLOCK_SIZE_MAX_BYTES = 16 * 1024 * 1024
"""Largest data block a client may declare."""
APPEND_SEGMENT_DEFAULT_BYTES = 4 * 1024 * 1024
"""Bytes of one append-file segment unless the file says otherwise."""
SUBSCRIBER_EVENTS_DEFAULT = 4096
"""Events a subscription keeps (per server, and in the listener) unless it says otherwise."""
BATCH_MAX_BYTES = 4 * 1024 * 1024
"""Largest piece of a block carried by one DoPut or DoGet record batch."""
MESSAGE_MAX_BYTES = 16 * 1024 * 1024
"""gRPC message size limit, both directions, on both ends."""
FRAME_MAX_BYTES = 8 * 1024 * 1024
"""Largest DoExchange frame (request or reply) in bytes."""
FRAME_OPS_MAX = 1024
"""Most operations in one DoExchange request frame."""
SESSION_INFLIGHT_MAX = 256
"""Most operations of one DoExchange session the server runs at once."""
OVERFLOW_VALUE_MAX_BYTES = 4096
"""Largest value of an overflowed manifest (``HEADER_FLAG_OVERFLOW``): the JSON list of the
servers its data blocks skipped because they were full."""
KEY_MAX_BYTES = 1024
"""Longest key in bytes."""
BUCKET_NAME_MAX_BYTES = 255
"""Longest bucket name in bytes."""
JOB_ID_MAX_BYTES = 128
"""Longest job id in bytes."""
TICKET_RANGES_MAX = 4096
"""Most ranges in one DoGet ticket."""
ENUMERATE_LIMIT_MAX = 10_000
"""Most keys returned by one enumerate call."""
STATS_INTERVAL_MS = 1000
"""Interval of the statistics sampler."""
FRAME_VERSION = 1
"""Version byte that opens every DoExchange frame."""
ADMIN_JOB_ID = "__admin__"
"""Reserved job id of control-plane (admin) tokens."""
READY_LINE_PREFIX = "POCKETFLOW_SERVER_READY"
"""Line the server prints on stdout once it listens, followed by ``host:port``."""
EPOCH_MAP_MAX_BYTES = 1024 * 1024
"""Largest weight map (compact JSON) accepted by ``set_epoch`` and returned in ``stale_epoch``."""
WAIT_KEYS_MAX = 1024
"""Most keys one ``wait`` action names."""
WAIT_TIMEOUT_MAX_MS = 30_000
"""Longest a ``wait`` action is parked before it returns the keys still missing."""
CHANNEL_WAIT_MAX_MS = 10_000
"""Longest a queue op parks on the server; a client waits longer by repeating the op."""
QUEUE_ITEMS_MAX = 1 << 20
"""Most items one queue segment holds."""
APPEND_SEGMENT_MAX_BYTES = 64 * 1024 * 1024
"""Largest append-file segment."""
APPEND_READ_MAX_BYTES = 1024 * 1024
"""Most bytes one append-file read returns."""
SUBSCRIBER_EVENTS_MAX = 65_536
"""Most events one subscription keeps before it loses its oldest."""
EVENTS_BATCH_MAX = 1024
"""Most events one ``events`` call returns."""
LEASE_MS_MIN = 100
"""Shortest prefix lease."""
LEASE_MS_MAX = 600_000
"""Longest prefix lease."""
LEASE_PREFIXES_MAX = 4096
"""Most prefixes one ``renew_leases`` call names."""
PINS_PER_PROCESS_MAX = 4096
"""Most pins one process holds on one server (PIN beyond it is refused: the reader copies)."""
PINNED_ARENA_DIVISOR = 2
"""A server pins at most its DRAM arena's capacity divided by this, over all jobs."""
PINNED_JOB_DIVISOR = 2
"""One job pins at most its server's pin budget divided by this."""
PIN_SWEEP_INTERVAL_MS = 50
"""Interval of the server's sweep of pins held by processes that are gone."""

# -- exchange operations ---------------------------------------------------------------------------

OP_PUT = 1
OP_GET = 2
OP_DELETE = 3
OP_LOOKUP = 4
OP_ENQUEUE = 5
OP_DEQUEUE = 6
OP_QUEUE_INFO = 7
OP_APPEND = 8
OP_READ_APPEND = 9
OP_READ_RECORDS = 10
OP_PIN = 11
OP_UNPIN = 12

OP_FLAG_DELETE = 1
"""GET: remove the object as part of the read (DELETE-on-read)."""
OP_FLAG_PERSIST = 2
"""PUT: the object is PERSIST."""
OP_FLAG_OVERWRITE = 4
"""PUT: replace an existing object instead of failing with ``already_exists``."""
OP_FLAG_SEAL = 8
"""QUEUE_INFO and READ_APPEND: seal the segment (creating it sealed if absent)."""
OP_FLAG_CLAIM_WHOLE = 16
"""GET with DELETE: claim only a small object's record; a striped object's manifest stays for
its reader to take after reading the blocks (a ``delete`` conditional on the version)."""

REPLY_FLAG_HEADER = 1
"""Reply flag: a 32-byte object header follows the reply's fixed part."""

HEADER_LEN_BYTES = 32
HEADER_FLAG_PERSIST = 1
HEADER_FLAG_FENCE = 2
"""A write-once fence, not an object: a record of no bytes on a key's ephemeral home that
stands for its PERSIST record (docs/PROTOCOL.md, Write-once)."""
HEADER_FLAG_OVERFLOW = 4
"""Header flag of a manifest whose data blocks skipped full servers, which the record's value
names (docs/ARCHITECTURE.md, "Bigger than DRAM")."""

# -- actions ---------------------------------------------------------------------------------------

ACTION_LOOKUP = "lookup"
ACTION_DELETE = "delete"
ACTION_DELETE_BLOCKS = "delete_blocks"
ACTION_ENUMERATE = "enumerate"
ACTION_CREATE_BUCKET = "create_bucket"
ACTION_DELETE_BUCKET = "delete_bucket"
ACTION_DELETE_PREFIX = "delete_prefix"
ACTION_DELETE_JOB = "delete_job"
ACTION_SET_EPOCH = "set_epoch"
ACTION_STATS = "stats"
ACTION_DRAIN = "drain"
ACTION_SET_CORES = "set_cores"
ACTION_WAIT = "wait"
ACTION_SUBSCRIBE = "subscribe"
ACTION_EVENTS = "events"
ACTION_UNSUBSCRIBE = "unsubscribe"
ACTION_RENEW_LEASES = "renew_leases"
ACTION_END_LEASES = "end_leases"

DATA_COLUMN_NAME = "data"
"""Name of the single non-nullable binary column of DoPut and DoGet streams."""

# -- struct layouts --------------------------------------------------------------------------------

HEADER_STRUCT = struct.Struct("<QQIIII")
FRAME_HEADER_STRUCT = struct.Struct("<B3xQI")
OP_STRUCT = struct.Struct("<QBBHHxxI")
REPLY_FRAME_HEADER_STRUCT = struct.Struct("<B3xI")
REPLY_STRUCT = struct.Struct("<QBBxxI")
PUT_BATCH_META_STRUCT = struct.Struct("<IQ")
GET_PIECE_META_STRUCT = struct.Struct("<IQQ")

assert HEADER_STRUCT.size == HEADER_LEN_BYTES
assert FRAME_HEADER_STRUCT.size == 16
assert OP_STRUCT.size == 20
assert REPLY_FRAME_HEADER_STRUCT.size == 8
assert REPLY_STRUCT.size == 16
assert PUT_BATCH_META_STRUCT.size == 12
assert GET_PIECE_META_STRUCT.size == 20

FRAME_HEADER_LEN_BYTES = FRAME_HEADER_STRUCT.size
OP_FIXED_LEN_BYTES = OP_STRUCT.size + HEADER_LEN_BYTES
"""Bytes of one request op before its bucket, key and value."""
ZERO_HEADER = bytes(HEADER_LEN_BYTES)


class ObjectHeader(NamedTuple):
    """Size, layout and flags of one object, as stored with its block-0 record."""

    version: int
    size: int
    block_count: int = 0
    block_size: int = 0
    flags: int = 0

    @property
    def persist(self) -> bool:
        """Whether the object is PERSIST."""
        return bool(self.flags & HEADER_FLAG_PERSIST)

    @property
    def fence(self) -> bool:
        """Whether the record is a write-once fence, not an object."""
        return bool(self.flags & HEADER_FLAG_FENCE)

    @property
    def is_small(self) -> bool:
        """Whether the object's bytes are inline in block 0."""
        return self.block_count == 0

    @property
    def overflowed(self) -> bool:
        """Whether this manifest's data blocks skipped full servers (named by its value)."""
        return bool(self.flags & HEADER_FLAG_OVERFLOW)

    def data_block_len(self, index: int) -> int:
        """Length of data block ``index`` (1-based) of a large object."""
        if not 1 <= index <= self.block_count:
            raise IndexError(f"block {index} outside 1..{self.block_count}")
        return min(self.block_size, self.size - (index - 1) * self.block_size)

    def encode(self) -> bytes:
        """The 32-byte little-endian encoding."""
        return HEADER_STRUCT.pack(
            self.version, self.size, self.block_count, self.block_size, self.flags, 0
        )

    @classmethod
    def decode(cls, buf: bytes | memoryview, offset: int = 0) -> ObjectHeader:
        """Decode 32 bytes at ``offset``; the reserved field is ignored."""
        version, size, block_count, block_size, flags, _ = HEADER_STRUCT.unpack_from(buf, offset)
        return cls(version, size, block_count, block_size, flags)

    def to_json(self) -> dict[str, Any]:
        """The JSON form used by action results."""
        return {
            "version": self.version,
            "size": self.size,
            "block_count": self.block_count,
            "block_size": self.block_size,
            "persist": self.persist,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ObjectHeader:
        """Parse the JSON form used by action results."""
        return cls(
            int(doc["version"]),
            int(doc["size"]),
            int(doc.get("block_count", 0)),
            int(doc.get("block_size", 0)),
            HEADER_FLAG_PERSIST if doc.get("persist") else 0,
        )


def small_header(version: int, size: int, *, persist: bool) -> ObjectHeader:
    """Header of a small object (bytes inline in block 0)."""
    return ObjectHeader(version, size, 0, 0, HEADER_FLAG_PERSIST if persist else 0)


def large_header(version: int, size: int, block_size: int, *, persist: bool) -> ObjectHeader:
    """Header of a large object striped in data blocks of ``block_size`` bytes."""
    block_count = -(-size // block_size)
    return ObjectHeader(
        version, size, block_count, block_size, HEADER_FLAG_PERSIST if persist else 0
    )


def check_bucket(bucket: str) -> bytes:
    """UTF-8 encoding of a bucket name, or :class:`InvalidRequest` if it breaks the limits."""
    if not isinstance(bucket, str):
        raise InvalidRequest(f"bucket must be a str, got {type(bucket).__name__}")
    raw = bucket.encode("utf-8")
    if not 1 <= len(raw) <= BUCKET_NAME_MAX_BYTES:
        raise InvalidRequest(
            f"bucket name must be 1..{BUCKET_NAME_MAX_BYTES} bytes, "
            f"got {len(raw)}"
        )
    return raw


KEY_FAST_MAX_CHARS = KEY_MAX_BYTES // 4
"""A str key of 1 to this many characters is within ``KEY_MAX_BYTES`` in UTF-8 (at most 4
bytes a character): :func:`check_keys` passes it without encoding it."""


def check_keys(keys: Iterable[str]) -> None:
    """:func:`check_key` for every key of a batch, without encoding the short ones: a batch of
    many small objects (a shuffle's partitions) paid an encoding and a call per key. A key
    the core cannot encode (a lone surrogate) is refused by the core as by ``check_key``."""
    for key in keys:
        if type(key) is not str or not 0 < len(key) <= KEY_FAST_MAX_CHARS:
            check_key(key)


def check_key(key: str) -> bytes:
    """UTF-8 encoding of a key, or :class:`InvalidRequest` if it breaks the limits."""
    if not isinstance(key, str):
        raise InvalidRequest(f"key must be a str, got {type(key).__name__}")
    raw = key.encode("utf-8")
    if not 1 <= len(raw) <= KEY_MAX_BYTES:
        raise InvalidRequest(
            f"key must be 1..{KEY_MAX_BYTES} bytes, got {len(raw)}"
        )
    return raw


# -- exchange frames -------------------------------------------------------------------------------


def encode_op_parts(
    parts: list[Any],
    request_id: int,
    op: int,
    flags: int,
    bucket: bytes,
    key: bytes,
    header: bytes = ZERO_HEADER,
    value: bytes | bytearray | memoryview = b"",
) -> int:
    """Append one request op to ``parts`` (joined later into a frame); returns its length."""
    value_len = len(value)
    parts.append(OP_STRUCT.pack(request_id, op, flags, len(bucket), len(key), value_len))
    parts.append(header)
    parts.append(bucket)
    parts.append(key)
    if value_len:
        parts.append(value)
    return OP_FIXED_LEN_BYTES + len(bucket) + len(key) + value_len


def encode_frame(epoch: int, op_count: int, op_parts: Sequence[Any]) -> bytes:
    """Join a request frame from its op count and the parts built by :func:`encode_op_parts`."""
    if not 1 <= op_count <= FRAME_OPS_MAX:
        raise InvalidRequest(f"frame op count {op_count} outside 1..{FRAME_OPS_MAX}")
    return FRAME_HEADER_STRUCT.pack(FRAME_VERSION, epoch, op_count) + b"".join(op_parts)


class Reply(NamedTuple):
    """One operation's reply: status byte (0 OK, else a gRPC code), header, body."""

    request_id: int
    status: int
    header: ObjectHeader | None
    body: memoryview


def decode_reply_frame(buf: bytes | memoryview | Any) -> list[Reply]:
    """Decode a reply frame; bodies are zero-copy unsigned-byte views into ``buf``."""
    view = memoryview(buf)
    if view.format != "B":
        view = view.cast("B")  # pyarrow buffers export signed bytes
    if len(view) < REPLY_FRAME_HEADER_STRUCT.size:
        raise InvalidRequest(f"reply frame of {len(view)} bytes is truncated")
    version, count = REPLY_FRAME_HEADER_STRUCT.unpack_from(view, 0)
    if version != FRAME_VERSION:
        raise InvalidRequest(f"reply frame version {version}, expected {FRAME_VERSION}")
    replies: list[Reply] = []
    at = REPLY_FRAME_HEADER_STRUCT.size
    end = len(view)
    unpack_reply = REPLY_STRUCT.unpack_from
    for _ in range(count):
        if at + REPLY_STRUCT.size > end:
            raise InvalidRequest("reply frame is truncated")
        request_id, status, flags, body_len = unpack_reply(view, at)
        at += REPLY_STRUCT.size
        header = None
        if flags & REPLY_FLAG_HEADER:
            if at + HEADER_LEN_BYTES > end:
                raise InvalidRequest("reply frame is truncated")
            header = ObjectHeader.decode(view, at)
            at += HEADER_LEN_BYTES
        if at + body_len > end:
            raise InvalidRequest("reply frame is truncated")
        replies.append(Reply(request_id, status, header, view[at:at + body_len]))
        at += body_len
    return replies


def encode_reply_frame(replies: Iterable[Reply]) -> bytes:
    """Encode a reply frame (the server's side; used by tests and tools)."""
    parts: list[bytes] = []
    count = 0
    for reply in replies:
        flags = REPLY_FLAG_HEADER if reply.header is not None else 0
        parts.append(REPLY_STRUCT.pack(reply.request_id, reply.status, flags, len(reply.body)))
        if reply.header is not None:
            parts.append(reply.header.encode())
        parts.append(bytes(reply.body))
        count += 1
    return REPLY_FRAME_HEADER_STRUCT.pack(FRAME_VERSION, count) + b"".join(parts)


class RequestOp(NamedTuple):
    """One decoded request op (the server's view; used by tests and tools)."""

    request_id: int
    op: int
    flags: int
    bucket: str
    key: str
    header: ObjectHeader
    value: bytes


def decode_request_frame(buf: bytes | memoryview) -> tuple[int, list[RequestOp]]:
    """Decode a request frame into ``(epoch, ops)`` (the server's side; for tests and tools)."""
    view = memoryview(buf)
    version, epoch, count = FRAME_HEADER_STRUCT.unpack_from(view, 0)
    if version != FRAME_VERSION:
        raise InvalidRequest(f"frame version {version}, expected {FRAME_VERSION}")
    at = FRAME_HEADER_STRUCT.size
    ops: list[RequestOp] = []
    for _ in range(count):
        request_id, op, flags, bucket_len, key_len, value_len = OP_STRUCT.unpack_from(view, at)
        at += OP_STRUCT.size
        header = ObjectHeader.decode(view, at)
        at += HEADER_LEN_BYTES
        bucket = bytes(view[at:at + bucket_len]).decode()
        at += bucket_len
        key = bytes(view[at:at + key_len]).decode()
        at += key_len
        value = bytes(view[at:at + value_len])
        at += value_len
        ops.append(RequestOp(request_id, op, flags, bucket, key, header, value))
    if at != len(view):
        raise InvalidRequest("frame has trailing bytes")
    return epoch, ops


# -- JSON bodies -----------------------------------------------------------------------------------

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def context(job_id: str, epoch: int, token: str) -> dict[str, Any]:
    """The capability context every request carries."""
    return {"job": job_id, "epoch": epoch, "token": token}


def exchange_descriptor(ctx: dict[str, Any]) -> bytes:
    """Command of the FlightDescriptor that opens a DoExchange session."""
    return _dumps({"ctx": ctx}).encode()


def put_descriptor(
    ctx: dict[str, Any], *, bucket: str, key: str, version: int, block_size: int, persist: bool
) -> bytes:
    """Command of the FlightDescriptor of a DoPut stream of data blocks."""
    return _dumps({
        "ctx": ctx, "bucket": bucket, "key": key, "version": version,
        "block_size": block_size, "persist": persist,
    }).encode()


def get_ticket(
    ctx: dict[str, Any],
    *,
    bucket: str,
    key: str,
    version: int,
    ranges: Sequence[tuple[int, int, int]],
    delete: bool,
) -> bytes:
    """A DoGet ticket for ``ranges`` of ``(block index, offset in block, length)``."""
    if not 1 <= len(ranges) <= TICKET_RANGES_MAX:
        raise InvalidRequest(f"ticket range count {len(ranges)} outside 1..{TICKET_RANGES_MAX}")
    return _dumps({
        "ctx": ctx, "bucket": bucket, "key": key, "version": version,
        "ranges": [list(r) for r in ranges], "delete": delete,
    }).encode()


def action_body(ctx: dict[str, Any], **fields: Any) -> bytes:
    """Body of a DoAction request: the context plus the action's fields."""
    return _dumps({"ctx": ctx, **fields}).encode()


def encode_json(doc: Any) -> str:
    """Compact JSON, as used on the wire."""
    return _dumps(doc)


# -- app_metadata of data streams ------------------------------------------------------------------


def encode_put_batch_meta(block_index: int, block_len: int) -> bytes:
    """12-byte app_metadata of one DoPut batch: block index, block length."""
    return PUT_BATCH_META_STRUCT.pack(block_index, block_len)


def decode_put_batch_meta(buf: bytes | memoryview) -> tuple[int, int]:
    """Decode 12-byte DoPut batch app_metadata into ``(block index, block length)``."""
    if len(buf) != PUT_BATCH_META_STRUCT.size:
        raise InvalidRequest(f"DoPut app_metadata must be 12 bytes, got {len(buf)}")
    index, length = PUT_BATCH_META_STRUCT.unpack_from(buf, 0)
    return index, length


def encode_get_piece_meta(block_index: int, offset: int, length: int) -> bytes:
    """20-byte app_metadata of one DoGet batch: block index, offset in block, piece length."""
    return GET_PIECE_META_STRUCT.pack(block_index, offset, length)


def decode_get_piece_meta(buf: bytes | memoryview | Any) -> tuple[int, int, int]:
    """Decode 20-byte DoGet batch app_metadata into ``(block index, offset, length)``."""
    if len(buf) != GET_PIECE_META_STRUCT.size:
        raise InvalidRequest(f"DoGet app_metadata must be 20 bytes, got {len(buf)}")
    index, offset, length = GET_PIECE_META_STRUCT.unpack_from(buf, 0)
    return index, offset, length
