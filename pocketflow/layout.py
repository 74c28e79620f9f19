"""The view of a job's weight map that the Python side of the client places with, and the client
operations the file objects use.

The object layout itself (data blocks over a job's servers, the block upload that precedes the
manifest commit, reads with their fallbacks) lives in the native core (``pocketflow._core``,
``servers/crates/client``). This module sits between the sessions (:mod:`pocketflow.transport`)
and the API (:mod:`pocketflow.client`); the file objects (:mod:`pocketflow.objectfile`) sit on it
too. Neither it nor they import the client: they see it through :class:`ObjectHost`, so the
modules import one way only (client -> objectfile -> layout -> transport).
"""

from __future__ import annotations

from pocketflow.handle import JobHandle
from pocketflow.placement import Placement
from pocketflow.protocol import ObjectHeader, Reply, exchange_descriptor
from pocketflow.records import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from typing import Any, Protocol
else:
    # ObjectHost is an interface for type checkers only (nothing checks it at run time), and
    # typing costs every task process its import.
    Protocol = object

__all__ = [
    "ObjectHost",
    "STALE_EPOCH_RETRIES_MAX",
    "View",
    "view_of",
]

STALE_EPOCH_RETRIES_MAX = 4
"""How many times one call adopts a newer weight map and retries (the native core's bound)."""


class View(NamedTuple):
    """One consistent weight map of a job: handle, placement, context; a client swaps it whole
    when it adopts a new epoch. (A NamedTuple, not a dataclass: every task process imports this
    module, and a NamedTuple costs a tenth of a dataclass to define.)"""

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
    return View(handle, Placement.of_handle(handle), ctx, exchange_descriptor(ctx))


class ObjectHost(Protocol):
    """The client operations that file objects use; :class:`pocketflow.client.Client` is the
    implementation. Private names: this is an interface inside the package, not an API."""

    _core: Any
    """The native object layer (``pocketflow._core.Objects``)."""

    @property
    def handle(self) -> JobHandle: ...

    def _fetch_record(
        self, bucket: str, bucket_raw: bytes, key_raw: bytes, op: int, flags: int, *,
        lost_unavailable: bool = True,
    ) -> tuple[str, Reply]: ...

    def _read_blocks(
        self, bucket: str, key: str, key_raw: bytes, header: ObjectHeader, start: int, end: int,
        *, delete: bool, dest: memoryview | None = None, value: bytes | memoryview = b"",
    ) -> Any: ...

    def _put_small(
        self, bucket: str, bucket_raw: bytes, key_raw: bytes, value: memoryview | bytes, *,
        persist: bool, overwrite: bool,
    ) -> None: ...
