"""The access log of a cache run: tasks batch what they read (key, size, reads, fills) and
enqueue it on the run's queue in the cache's job; the driver's maintainer dequeues it to keep
recency, the bytes held and the run's working set. Losing a batch (a full queue, a killed task)
costs only bookkeeping, never a read."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from pocketflow.cache.records import RECORD_BUCKET
from pocketflow.errors import InvalidRequest, PocketflowError

if TYPE_CHECKING:
    from pocketflow.client import Client

__all__ = ["Access", "AccessRecorder", "access_queue_name", "decode_batch", "encode_batches",
           "ACCESS_QUEUE_ITEMS_MAX", "ACCESS_ITEM_MAX_BYTES", "ACCESS_KEYS_BUFFERED_MAX",
           "ACCESS_FLUSH_S"]

log = logging.getLogger(__name__)

ACCESS_QUEUE_ITEMS_MAX = 4096
"""Most batches a run's access queue holds (each at most ``ACCESS_ITEM_MAX_BYTES``)."""
ACCESS_ITEM_MAX_BYTES = 16 * 1024
"""Largest batch enqueued at once."""
ACCESS_KEYS_BUFFERED_MAX = 4096
"""Most distinct keys a client buffers before it flushes."""
ACCESS_FLUSH_S = 1.0
"""A client flushes on its next read once its oldest buffered access is this old."""

_VERSION = 1


class Access(NamedTuple):
    """What one batch says about one key: its size and version (the cached entry's ETag), how
    often it was read, how many times this process filled it from S3 (each fill adds ``size``
    bytes to the cache), and how many of its fills the cache's storage refused for want of
    room (``refused``: the key was read from S3 and not cached)."""

    bucket: str
    key: str
    size: int
    etag: str
    reads: int
    fills: int
    refused: int = 0


def access_queue_name(run_id: str) -> str:
    """The queue (in the ``records`` bucket) a run's accesses go to."""
    return f"access/{run_id}"


def encode_batches(accesses: list[Access]) -> list[bytes]:
    """``accesses`` as queue items of at most ``ACCESS_ITEM_MAX_BYTES`` each."""
    items: list[bytes] = []
    rows: list[list[object]] = []
    used = 0
    for a in accesses:
        row: list[object] = [a.bucket, a.key, a.size, a.etag, a.reads, a.fills]
        if a.refused:
            row.append(a.refused)
        cost = len(json.dumps(row, separators=(",", ":")).encode()) + 1
        if cost + 32 > ACCESS_ITEM_MAX_BYTES:
            continue  # a key this long is left out of the bookkeeping
        if rows and used + cost + 32 > ACCESS_ITEM_MAX_BYTES:
            items.append(_encode(rows))
            rows, used = [], 0
        rows.append(row)
        used += cost
    if rows:
        items.append(_encode(rows))
    return items


def _encode(rows: list[list[object]]) -> bytes:
    return json.dumps({"v": _VERSION, "a": rows}, separators=(",", ":")).encode()


def decode_batch(raw: bytes) -> list[Access]:
    """The accesses of one queue item; :class:`InvalidRequest` if it is not one."""
    try:
        data = json.loads(raw)
        if data.get("v") != _VERSION:
            raise ValueError("version")
        accesses = []
        for row in data["a"]:
            # A seventh field, the refused fills, is there only when there were some.
            b, k, n, e, r, f, *rest = row
            if len(rest) > 1:
                raise ValueError("fields")
            accesses.append(Access(str(b), str(k), int(n), str(e), int(r), int(f),
                                   int(rest[0]) if rest else 0))
        return accesses
    except (ValueError, TypeError, KeyError, AttributeError):
        raise InvalidRequest("not a cache access batch") from None


class AccessRecorder:
    """A task's buffer of accesses, flushed to the run's queue (thread-safe)."""

    def __init__(self, client: Client, run_id: str) -> None:
        self._queue = client.queue(RECORD_BUCKET, access_queue_name(run_id),
                                   max_items=ACCESS_QUEUE_ITEMS_MAX)
        self._lock = threading.Lock()
        self._buffer: dict[tuple[str, str], list[Any]] = {}
        self._oldest_s: float | None = None
        self.dropped_batches = 0

    def note(self, bucket: str, key: str, size: int, etag: str, *, read: bool = True,
             filled: bool = False, refused: bool = False) -> None:
        """Count one read (and/or one fill, or one fill refused) of version ``etag`` of
        ``bucket/key``."""
        with self._lock:
            row = self._buffer.get((bucket, key))
            if row is None:
                row = self._buffer[(bucket, key)] = [size, etag, 0, 0, 0]
            row[0] = size
            row[1] = etag
            row[2] += int(read)
            row[3] += int(filled)
            row[4] += int(refused)
            if self._oldest_s is None:
                self._oldest_s = time.monotonic()
            due = (len(self._buffer) >= ACCESS_KEYS_BUFFERED_MAX
                   or time.monotonic() - self._oldest_s >= ACCESS_FLUSH_S)
        if due:
            self.flush()

    def flush(self) -> None:
        """Enqueue what is buffered, without waiting: a full queue drops the batch (counted)."""
        with self._lock:
            rows, self._buffer, self._oldest_s = self._buffer, {}, None
        if not rows:
            return
        accesses = [Access(b, k, n, e, r, f, x) for (b, k), (n, e, r, f, x) in rows.items()]
        for item in encode_batches(accesses):
            try:
                self._queue.enqueue(item, timeout_s=0)
            except PocketflowError as exc:
                self.dropped_batches += 1
                log.debug("cache access batch dropped: %s", exc)


def drain(client: Client, run_id: str, *, items_max: int) -> Iterator[Access]:
    """Dequeue up to ``items_max`` batches of a run's queue (not waiting for more) and yield
    their accesses; a batch that does not decode is skipped."""
    queue = client.queue(RECORD_BUCKET, access_queue_name(run_id), max_items=ACCESS_QUEUE_ITEMS_MAX)
    for _ in range(items_max):
        raw = queue.dequeue(timeout_s=0)
        if raw is None:
            return
        try:
            yield from decode_batch(raw)
        except InvalidRequest:
            log.warning("cache run %s: an access batch that does not decode was skipped", run_id)
