"""Object layout: how a large object lies in data blocks over a job's servers, and the upload of
those blocks that precedes the commit of the object's block-0 record (its manifest).

This is the layer between the sessions (:mod:`pocketflow.transport`, the native core) and the API
(:mod:`pocketflow.client`); the file objects (:mod:`pocketflow.objectfile`) sit on it too. Neither
it nor they import the client: they see it through :class:`ObjectHost`, the operations of its that
they use, so the modules import one way only (client -> objectfile -> layout -> transport).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

from pocketflow.config import ClientConfig
from pocketflow.errors import (
    BucketNotFound,
    CapacityExhausted,
    DataUnavailable,
    InternalError,
    PocketflowError,
    StaleEpoch,
)
from pocketflow.handle import JobHandle, ServerInfo
from pocketflow.placement import Placement
from pocketflow.protocol import ObjectHeader, Reply, exchange_descriptor, put_descriptor
from pocketflow.transport import ServerConnection

__all__ = [
    "BlockUploader",
    "ObjectHost",
    "STALE_EPOCH_RETRIES_MAX",
    "View",
    "new_version",
    "refused",
    "view_of",
]

log = logging.getLogger(__name__)

STREAM_GROUP_BYTES_MIN = 4 * 1024 * 1024
"""A streamed upload sends a server's blocks once this many bytes are waiting for it."""
STREAM_PENDING_GROUPS_MAX = 4
"""A streamed upload holds at most this many groups' worth of unsent bytes in total."""
STALE_EPOCH_RETRIES_MAX = 4
"""How many times one call adopts a newer weight map and retries."""


@dataclass(frozen=True, slots=True)
class View:
    """One consistent weight map of a job: handle, placement, context; a client swaps it whole
    when it adopts a new epoch."""

    handle: JobHandle
    placement: Placement
    ctx: dict[str, Any]
    exchange_command: bytes

    @property
    def epoch(self) -> int:
        return self.handle.epoch


def view_of(handle: JobHandle) -> View:
    """The view of ``handle``'s weight map."""
    ctx = handle.context()
    return View(handle, Placement(handle.servers), ctx, exchange_descriptor(ctx))


def new_version() -> int:
    """A random non-zero version for a new object."""
    # os.urandom, not the random module: a program that seeds `random` must not make two writers
    # of one key pick the same version.
    return int.from_bytes(os.urandom(8), "little") or 1


class ObjectHost(Protocol):
    """The client operations that uploads and file objects use; :class:`pocketflow.client.Client`
    is the implementation. Private names: this is an interface inside the package, not an API."""

    _view: View

    @property
    def config(self) -> ClientConfig: ...

    @property
    def handle(self) -> JobHandle: ...

    def _connection(self, address: str) -> ServerConnection: ...

    def _executor_get(self) -> ThreadPoolExecutor: ...

    def _adopt(self, stale: StaleEpoch) -> None: ...

    def _block_server(
        self, view: View, key_raw: bytes, index: int, persist: bool
    ) -> ServerInfo: ...

    def _repair_bucket(self, view: View, bucket: str, server: ServerInfo) -> bool: ...

    def _delete_block_groups(
        self, bucket: str, key: str, version: int, groups: dict[str, list[int]]
    ) -> None: ...

    def _fetch_record(
        self, bucket: str, bucket_raw: bytes, key_raw: bytes, op: int, flags: int, *,
        lost_unavailable: bool = True,
    ) -> tuple[str, Reply]: ...

    def _read_blocks(
        self, bucket: str, key: str, key_raw: bytes, header: ObjectHeader, start: int, end: int,
        *, delete: bool, dest: memoryview | None = None,
    ) -> Any: ...

    def _put_small(
        self, bucket: str, bucket_raw: bytes, key_raw: bytes, value: memoryview | bytes, *,
        persist: bool, overwrite: bool,
    ) -> None: ...

    def _put_record(
        self, bucket: str, bucket_raw: bytes, key_raw: bytes, header: ObjectHeader,
        value: bytes | bytearray | memoryview, *, persist: bool, overwrite: bool,
        uploader: BlockUploader | None = None,
    ) -> None: ...

    def _uploader(
        self, bucket: str, key: str, key_raw: bytes, block_size: int, *, persist: bool,
        streamed: bool,
    ) -> BlockUploader: ...


class BlockUploader:
    """Writes the data blocks of one new version of an object, many servers in parallel.

    Blocks are grouped per server and each group goes over one DoPut stream. For data already in
    memory (``streamed=False``) every server's blocks form one group, sent when :meth:`finish` is
    called; for a stream, a server's group is sent once ``STREAM_GROUP_BYTES_MIN`` bytes wait for
    it, so memory stays bounded. :meth:`abort` frees every block sent so far.
    """

    def __init__(
        self, client: ObjectHost, bucket: str, key: str, key_raw: bytes, block_size: int, *,
        persist: bool, streamed: bool,
    ) -> None:
        self.version = new_version()
        self._client = client
        self._bucket = bucket
        self._key = key
        self._key_raw = key_raw
        self._block_size = block_size
        self._persist = persist
        self._group_bytes = max(STREAM_GROUP_BYTES_MIN, block_size) if streamed else None
        self._pending: dict[str, list[tuple[int, memoryview]]] = {}
        self._pending_bytes: dict[str, int] = {}
        self._pending_total = 0
        self._placed: dict[str, set[int]] = {}
        self._lock = threading.Lock()
        self._futures: set[Future[None]] = set()
        self._errors: list[BaseException] = []
        self._inflight_max = client.config.io_threads
        self._done = False
        self.committing = False
        """Set when the block-0 record has been sent (the commit may have happened)."""
        self.committed = False
        """Set when the server stored the block-0 record: the blocks now belong to the object."""

    def add(self, index: int, data: memoryview) -> None:
        """Queue data block ``index`` (1-based); may send groups and raise earlier failures."""
        self._raise_failed()
        view = self._client._view
        address = self._client._block_server(view, self._key_raw, index, self._persist).address
        self._pending.setdefault(address, []).append((index, data))
        self._pending_bytes[address] = self._pending_bytes.get(address, 0) + len(data)
        self._pending_total += len(data)
        if self._group_bytes is None:
            return
        if self._pending_bytes[address] >= self._group_bytes:
            self._submit(address)
        elif self._pending_total >= STREAM_PENDING_GROUPS_MAX * self._group_bytes:
            self._submit(max(self._pending_bytes, key=self._pending_bytes.__getitem__))

    def finish(self) -> None:
        """Send everything still queued and wait; raises the first failure (nothing is freed:
        the caller calls :meth:`abort`)."""
        addresses = list(self._pending)
        inline = addresses.pop() if addresses else None
        for address in addresses:
            self._submit(address)
        if inline is not None:
            blocks = self._take(inline)
            try:
                self._send(inline, blocks)
            except BaseException as exc:  # noqa: BLE001 - collected, raised below
                self._errors.append(exc)
        self._wait(0)
        self._raise_failed()

    def abort(self, cause: BaseException | None = None) -> None:
        """Wait for sends in progress, then free every block this upload placed anywhere.

        Does nothing once the object is committed. If the commit was sent and ``cause`` leaves
        its outcome unknown (a lost connection, a timeout, an interrupt), the blocks are kept:
        the record may be stored and point at them (if not, they stay as garbage until the job
        is deleted, which is better than an object whose blocks are gone).
        """
        if self._done:
            return
        self._done = True
        if self.committed:
            return
        if self.committing and not refused(cause):
            log.warning("the commit of %s/%s has an unknown outcome (%s); its blocks are kept",
                        self._bucket, self._key, cause)
            for future in list(self._futures):
                future.cancel()
            self._wait(0, raise_errors=False)
            return
        for future in list(self._futures):
            future.cancel()
        self._wait(0, raise_errors=False)
        with self._lock:
            groups = {address: sorted(blocks) for address, blocks in self._placed.items() if blocks}
        if groups:
            client = self._client
            client._delete_block_groups(self._bucket, self._key, self.version, groups)

    # -- internals ---------------------------------------------------------------------------

    def _take(self, address: str) -> list[tuple[int, memoryview]]:
        blocks = self._pending.pop(address)
        self._pending_total -= self._pending_bytes.pop(address)
        with self._lock:
            self._placed.setdefault(address, set()).update(index for index, _ in blocks)
        return blocks

    def _submit(self, address: str) -> None:
        blocks = self._take(address)
        self._wait(self._inflight_max - 1)
        future = self._client._executor_get().submit(self._send, address, blocks)
        self._futures.add(future)

    def _wait(self, most_left: int, *, raise_errors: bool = True) -> None:
        while len(self._futures) > most_left:
            done, _ = wait(self._futures, return_when=FIRST_COMPLETED)
            for future in done:
                self._futures.discard(future)
                if future.cancelled():
                    continue
                exc = future.exception()
                if exc is not None:
                    self._errors.append(exc)
        if raise_errors:
            self._raise_failed()

    def _raise_failed(self) -> None:
        if self._errors:
            # CapacityExhausted is what the caller can act on; report it over follow-on failures.
            for error in self._errors:
                if isinstance(error, CapacityExhausted):
                    raise error
            raise self._errors[0]

    def _send(self, address: str, blocks: list[tuple[int, memoryview]],
              attempts_left: int = STALE_EPOCH_RETRIES_MAX) -> None:
        client = self._client
        repaired = False
        while True:
            view = client._view
            command = put_descriptor(view.ctx, bucket=self._bucket, key=self._key,
                                     version=self.version, block_size=self._block_size,
                                     persist=self._persist)
            try:
                client._connection(address).put_blocks(command, blocks)
                return
            except StaleEpoch as exc:
                if attempts_left == 0:
                    raise
                client._adopt(exc)
                self._send_replaced(blocks, attempts_left - 1)
                return
            except BucketNotFound:
                server = next((s for s in view.handle.servers if s.address == address), None)
                if repaired or server is None or not client._repair_bucket(view, self._bucket,
                                                                          server):
                    raise
                repaired = True

    def _send_replaced(self, blocks: list[tuple[int, memoryview]], attempts_left: int) -> None:
        """Send blocks again where the newly adopted weight map places them."""
        view = self._client._view
        regrouped: dict[str, list[tuple[int, memoryview]]] = {}
        for index, data in blocks:
            address = self._client._block_server(view, self._key_raw, index, self._persist).address
            regrouped.setdefault(address, []).append((index, data))
        with self._lock:
            for address, group in regrouped.items():
                self._placed.setdefault(address, set()).update(index for index, _ in group)
        for address, group in regrouped.items():
            self._send(address, group, attempts_left)


def refused(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a server's definite refusal (the operation did not happen), as opposed
    to a failure that leaves the outcome unknown (unreachable, timed out, interrupted, a bug)."""
    return isinstance(exc, PocketflowError) and not isinstance(
        exc, (DataUnavailable, InternalError)
    )
