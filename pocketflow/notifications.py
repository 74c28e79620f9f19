"""Notifications: subscribe to a job's operations on a bucket prefix.

::

    with pf.subscribe("shuffle", "map/", ops=("put", "delete")) as listener:
        event = listener.get(timeout_s=5)     # an Event, or None when 5 s pass
        if event is not None and event.op == "gap":
            print(f"lost {event.dropped} events")

A subscription lives on every storage server of the job's map (the servers the job's data is
on): each keeps the events of its own operations in one order (its sequence numbers) in a buffer
of ``capacity`` events; when the buffer is full the oldest event is lost and counted. The
listener parks one ``events`` call per server (the server answers as soon as an event comes, so
nothing polls) on a thread of its own, and merges what they bring into one local buffer of the
same bound. Events of one server come out in that server's order; events of different servers
are not ordered with each other. Lost events surface as one ``Event(op="gap", dropped=n)`` in
their place, so a subscriber sees every event of a burst or an explicit count of what it missed.

Operations: ``put`` (an object was written), ``delete`` (deleted, or read with DELETE),
``enqueue``, ``dequeue`` (queues: the key is the queue's name), ``lease_expired`` (a prefix lease
lapsed and its data was freed; the key is the prefix, the bucket empty). Bulk deletions
(``delete_prefix``, ``delete_bucket``, job deregistration) do not report each key.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from pocketflow.errors import InvalidRequest, ObjectNotFound, PocketflowError
from pocketflow.protocol import (
    ACTION_EVENTS,
    ACTION_SUBSCRIBE,
    ACTION_UNSUBSCRIBE,
    KEY_MAX_BYTES,
    SUBSCRIBER_EVENTS_DEFAULT,
    SUBSCRIBER_EVENTS_MAX,
    action_body,
    check_bucket,
)

if TYPE_CHECKING:
    from pocketflow.client import Client

__all__ = ["Event", "Listener", "EVENT_OPS", "SUBSCRIBER_EVENTS_DEFAULT"]

EVENT_OPS = ("put", "delete", "enqueue", "dequeue", "lease_expired")
"""Operations a subscription can ask for."""
POLL_TIMEOUT_MS = 2000
"""Longest one parked ``events`` call waits before the listener's thread calls again."""
CLOSE_TIMEOUT_S = 10.0
"""How long :meth:`Listener.close` waits for its threads."""


class Event(NamedTuple):
    """One operation, or (``op == "gap"``) a count of events lost before the next one."""

    op: str
    bucket: str
    key: str
    server: str
    seq: int
    dropped: int = 0


class Listener:
    """The events of one subscription (build it with ``Client.subscribe``); close it when done.

    Thread-safe. Raises the error that ended a server's subscription (a server that restarted,
    or one that dropped the subscription after 60 s without a poll) from :meth:`get`, once.
    """

    def __init__(self, client: Client, bucket: str, prefix: str, ops: tuple[str, ...], *,
                 capacity: int = SUBSCRIBER_EVENTS_DEFAULT) -> None:
        check_bucket(bucket)
        if not isinstance(prefix, str) or len(prefix.encode()) > KEY_MAX_BYTES:
            raise InvalidRequest(f"prefix must be a str of at most {KEY_MAX_BYTES} bytes")
        ops = tuple(ops)
        if not ops or any(op not in EVENT_OPS for op in ops):
            raise InvalidRequest(f"ops must be some of {EVENT_OPS}, got {ops}")
        if not isinstance(capacity, int) or not 1 <= capacity <= SUBSCRIBER_EVENTS_MAX:
            raise InvalidRequest(f"capacity must be an int in 1..{SUBSCRIBER_EVENTS_MAX}")
        self._client = client
        self.bucket, self.prefix, self.ops, self.capacity = bucket, prefix, ops, capacity
        self._cond = threading.Condition()
        self._buffer: collections.deque[Event] = collections.deque()
        self._lost_here = 0
        self._errors: list[PocketflowError] = []
        self._closed = threading.Event()
        view = client._view
        addresses = sorted({s.address for s in view.handle.servers})
        self._subscriptions: dict[str, int] = {}
        try:
            for address in addresses:
                result = client._connection(address).action(ACTION_SUBSCRIBE, action_body(
                    view.ctx, bucket=bucket, prefix=prefix, ops=list(ops), capacity=capacity))
                self._subscriptions[address] = int(result["subscription"])
        except BaseException:
            self.close()
            raise
        self._threads = [
            threading.Thread(target=self._pump, args=(address, sid), daemon=True,
                             name=f"pocketflow-events-{address}")
            for address, sid in self._subscriptions.items()
        ]
        for thread in self._threads:
            thread.start()

    def _push(self, events: list[Event]) -> None:
        with self._cond:
            for event in events:
                if len(self._buffer) >= self.capacity:
                    lost = self._buffer.popleft()
                    self._lost_here += lost.dropped if lost.op == "gap" else 1
                self._buffer.append(event)
            self._cond.notify_all()

    def _pump(self, address: str, subscription: int) -> None:
        """Park ``events`` calls on one server until the listener closes."""
        while not self._closed.is_set():
            view = self._client._view
            try:
                result: dict[str, Any] = self._client._connection(address).action(
                    ACTION_EVENTS, action_body(view.ctx, subscription=subscription,
                                               timeout_ms=POLL_TIMEOUT_MS))
            except PocketflowError as exc:
                if not self._closed.is_set():
                    with self._cond:
                        self._errors.append(exc)
                        self._cond.notify_all()
                return
            batch: list[Event] = []
            dropped = int(result.get("dropped", 0))
            if dropped:
                batch.append(Event("gap", self.bucket, "", address, -1, dropped))
            batch.extend(Event(e["op"], e["bucket"], e["key"], address, int(e["seq"]))
                         for e in result.get("events", ()))
            if batch:
                self._push(batch)

    def get(self, timeout_s: float | None = None) -> Event | None:
        """The next event, waiting up to ``timeout_s`` (default: not at all); ``None`` when the
        time passed."""
        deadline = time.monotonic() + (timeout_s or 0.0)
        with self._cond:
            while True:
                if self._lost_here:
                    lost, self._lost_here = self._lost_here, 0
                    return Event("gap", self.bucket, "", "", -1, lost)
                if self._buffer:
                    return self._buffer.popleft()
                if self._errors:
                    raise self._errors.pop(0)
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    return None
                self._cond.wait(left)

    def close(self) -> None:
        """End the subscription on every server and stop the listener's threads."""
        if self._closed.is_set():
            return
        self._closed.set()
        view = self._client._view
        for address, sid in getattr(self, "_subscriptions", {}).items():
            try:
                self._client._connection(address).action(
                    ACTION_UNSUBSCRIBE, action_body(view.ctx, subscription=sid))
            except (ObjectNotFound, PocketflowError):
                pass
        for thread in getattr(self, "_threads", ()):
            thread.join(CLOSE_TIMEOUT_S)
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<pocketflow.Listener {self.bucket}/{self.prefix}* ops={self.ops}>"
