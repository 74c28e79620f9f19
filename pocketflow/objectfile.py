"""File objects over pocketflow objects: a seekable lazy reader and a block-streaming writer.

``Client.open(bucket, key, "rb")`` wraps :class:`ObjectReader` in an ``io.BufferedReader``: it
fetches block 0 once, then only the byte ranges that are read, straight into the caller's buffer.
``Client.open(bucket, key, "wb")`` returns an :class:`ObjectWriter`: it sends each block to its
server as soon as the block fills, so an object of any size needs only a few blocks of memory,
and commits the object (its block 0) on ``close()``. Neither is thread-safe, like built-in files.
"""

from __future__ import annotations

import io
import os
from typing import Any, BinaryIO

from pocketflow.errors import InvalidRequest
from pocketflow.layout import ObjectHost
from pocketflow.protocol import (
    OP_GET,
    SMALL_OBJECT_MAX_BYTES,
    ObjectHeader,
    check_bucket,
    check_key,
)

__all__ = ["ObjectReader", "ObjectWriter"]


class ObjectReader(io.RawIOBase):
    """Unbuffered, seekable reads of one object; fetches only what is read.

    The object is pinned to the version found when the reader was opened: if it is deleted or
    replaced, later reads of its data blocks raise :class:`~pocketflow.errors.ObjectNotFound`.
    """

    def __init__(self, client: ObjectHost, bucket: str, key: str) -> None:
        super().__init__()
        self._client = client
        self._bucket = bucket
        self._key = key
        self._key_raw = check_key(key)
        _, reply = client._fetch_record(bucket, check_bucket(bucket), self._key_raw, OP_GET, 0)
        header = reply.header
        self._header: ObjectHeader | None = header if header and header.block_count else None
        self._small: bytes | None = None if self._header else bytes(reply.body)
        # A manifest's value: the servers an overflowed object's blocks skipped.
        self._value = bytes(reply.body) if self._header else b""
        self._size = self._header.size if self._header else len(self._small or b"")
        self._pos = 0

    @property
    def size(self) -> int:
        """Object size in bytes."""
        return self._size

    @property
    def block_size(self) -> int:
        """The object's data block size (a good read size); 0 for a small object."""
        return self._header.block_size if self._header else 0

    @property
    def name(self) -> str:
        """``bucket/key``."""
        return f"{self._bucket}/{self._key}"

    def readable(self) -> bool:
        """Always true."""
        return True

    def seekable(self) -> bool:
        """Always true."""
        return True

    def tell(self) -> int:
        """Current position."""
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Move the position (past the end is allowed; reads there return nothing)."""
        self._check_not_closed()
        if whence == os.SEEK_SET:
            position = offset
        elif whence == os.SEEK_CUR:
            position = self._pos + offset
        elif whence == os.SEEK_END:
            position = self._size + offset
        else:
            raise InvalidRequest(f"invalid whence {whence}")
        if position < 0:
            raise InvalidRequest(f"negative seek position {position}")
        self._pos = position
        return position

    def readinto(self, buffer: Any) -> int:
        """Read up to ``len(buffer)`` bytes straight into ``buffer``; 0 at the end."""
        self._check_not_closed()
        dest = memoryview(buffer).cast("B")
        count = min(len(dest), self._size - self._pos)
        if count <= 0:
            return 0
        start = self._pos
        if self._header is None:
            assert self._small is not None
            dest[:count] = self._small[start:start + count]
        else:
            self._client._read_blocks(
                self._bucket, self._key, self._key_raw, self._header, start, start + count,
                delete=False, dest=dest[:count], value=self._value,
            )
        self._pos = start + count
        return count

    def readall(self) -> bytes:
        """The rest of the object, fetched in parallel from its servers."""
        self._check_not_closed()
        start = self._pos
        if start >= self._size:
            return b""
        self._pos = self._size
        if self._header is None:
            assert self._small is not None
            return self._small[start:]
        return self._client._read_blocks(
            self._bucket, self._key, self._key_raw, self._header, start, self._size, delete=False,
            value=self._value,
        )

    def _check_not_closed(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed object reader")


class ObjectWriter(io.BufferedIOBase):
    """Writes one new object block by block; ``close()`` commits it, :meth:`abort` discards it.

    Leaving a ``with`` block by an exception aborts; a writer that is garbage-collected without
    ``close()`` commits nothing and frees what it sent.
    """

    def __init__(
        self, client: ObjectHost, bucket: str, key: str, *, persist: bool = False,
        overwrite: bool = False,
    ) -> None:
        super().__init__()
        self._client = client
        self._bucket = bucket
        self._bucket_raw = check_bucket(bucket)
        self._key = key
        self._key_raw = check_key(key)
        self._persist = persist
        self._overwrite = overwrite
        self._block_size = client.handle.block_size_bytes
        self._buffer = bytearray(self._block_size)
        self._fill = 0
        self._held: list[memoryview] = []
        self._held_bytes = 0
        self._upload: Any = None
        """The native streamed upload (``_core.Upload``), made when the object turns out large."""
        self._next_index = 1
        self._size = 0
        self._finished = False

    @property
    def name(self) -> str:
        """``bucket/key``."""
        return f"{self._bucket}/{self._key}"

    def writable(self) -> bool:
        """Always true."""
        return True

    def tell(self) -> int:
        """Bytes written so far."""
        return self._size

    def write(self, data: Any) -> int:
        """Append bytes; full blocks are sent as they fill. Returns ``len(data)``."""
        self._check_open()
        view = memoryview(data).cast("B")
        total = len(view)
        at = 0
        while at < total:
            take = min(self._block_size - self._fill, total - at)
            self._buffer[self._fill:self._fill + take] = view[at:at + take]
            self._fill += take
            at += take
            if self._fill == self._block_size:
                self._emit_block()
        self._size += total
        return total

    def write_from(self, stream: BinaryIO) -> int:
        """Copy a binary stream to its end, reading straight into the block buffer."""
        self._check_open()
        readinto = getattr(stream, "readinto", None)
        total = 0
        while True:
            if readinto is not None:
                count = readinto(memoryview(self._buffer)[self._fill:])
                if count is None:
                    raise InvalidRequest("non-blocking streams without data are not supported")
                if count == 0:
                    return total
                self._fill += count
                self._size += count
                total += count
                if self._fill == self._block_size:
                    self._emit_block()
            else:
                chunk = stream.read(self._block_size - self._fill)
                if not chunk:
                    return total
                total += self.write(chunk)

    def close(self) -> None:
        """Commit the object (its block 0 goes last); the writer is closed even on failure."""
        if self.closed:
            return
        try:
            if not self._finished:
                self._finished = True
                self._commit()
        finally:
            super().close()

    def abort(self) -> None:
        """Discard the object: free every block sent and close without committing."""
        if self._finished:
            if not self.closed:
                super().close()
            return
        self._finished = True
        try:
            if self._upload is not None:
                self._upload.abort()
        finally:
            self._held.clear()
            super().close()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()

    def __del__(self) -> None:
        try:
            if not self.closed:
                self.abort()
        except Exception:  # noqa: BLE001 - nothing can be reported from a finalizer
            pass

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed or self._finished:
            raise ValueError("I/O operation on closed object writer")

    def _emit_block(self) -> None:
        block = memoryview(self._buffer)[:self._fill]
        self._buffer = bytearray(self._block_size)
        self._fill = 0
        self._held.append(block)
        self._held_bytes += len(block)
        if self._upload is None and self._held_bytes <= SMALL_OBJECT_MAX_BYTES:
            return  # Might still end up a small object.
        self._send_held()

    def _send_held(self) -> None:
        if self._upload is None:
            self._upload = self._client._core.upload(self._bucket, self._key,
                                                     persist=self._persist)
        try:
            for block in self._held:
                self._upload.add(self._next_index, block)
                self._next_index += 1
        except BaseException:
            self._held.clear()
            self._finished = True
            self._upload.abort()
            raise
        self._held.clear()
        self._held_bytes = 0

    def _commit(self) -> None:
        client = self._client
        if self._upload is None and self._held_bytes + self._fill <= SMALL_OBJECT_MAX_BYTES:
            value = b"".join([*self._held, memoryview(self._buffer)[:self._fill]])
            self._held.clear()
            client._put_small(self._bucket, self._bucket_raw, self._key_raw, value,
                              persist=self._persist, overwrite=self._overwrite)
            return
        if self._fill:
            self._held.append(memoryview(self._buffer)[:self._fill])
            self._fill = 0
        self._send_held()
        # Sends what is queued, waits, then stores the manifest; on failure the blocks are
        # freed unless the manifest was sent and its outcome is unknown.
        self._upload.commit(self._size, self._overwrite)
