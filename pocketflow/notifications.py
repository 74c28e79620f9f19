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

The listener follows the job's map: a server that joins it after the subscription (a grown job,
a grant's new epoch) is subscribed as soon as the client sees the new map, and a server whose
subscription ended (it restarted, or dropped it) is subscribed again. Either way the events of
that server in between are not known, and a gap with ``dropped == DROPPED_UNKNOWN`` (-1) says
so, naming the server. A server that cannot be reached is retried with a jittered backoff; only
one that stays unreachable for ``PUMP_RETRY_WINDOW_S`` ends its events, raised from ``get``. Each
``events`` call confirms the events the last one brought (``keep``, ``acked``: docs/PROTOCOL.md),
so a call whose reply was lost, because it timed out while its server was paused, costs no event.

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

from pocketflow.errors import (
    InvalidRequest,
    JobNotRegistered,
    ObjectNotFound,
    PocketflowError,
    StaleEpoch,
    Unavailable,
)
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
from pocketflow.retry import backoff_s

if TYPE_CHECKING:
    from pocketflow.client import Client

__all__ = ["Event", "Listener", "EVENT_OPS", "SUBSCRIBER_EVENTS_DEFAULT", "DROPPED_UNKNOWN"]

EVENT_OPS = ("put", "delete", "enqueue", "dequeue", "lease_expired")
"""Operations a subscription can ask for."""
POLL_TIMEOUT_MS = 2000
"""Longest one parked ``events`` call waits before the listener's thread calls again."""
CLOSE_TIMEOUT_S = 10.0
"""How long :meth:`Listener.close` waits for its threads."""
DROPPED_UNKNOWN = -1
"""``Event.dropped`` of a gap whose size is not known (see the module doc)."""
PUMP_RETRY_WINDOW_S = 30.0
"""How long a server's events are retried while it cannot be reached (or does not know the
job yet: a restarted server until the control plane tells it) before the error is raised."""
PUMP_BACKOFF_BASE_S = 0.05
PUMP_BACKOFF_CAP_S = 2.0
"""The jittered backoff between those retries."""


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
        # Subscriptions and pump threads, one per server of the map (bounded by its size).
        self._members = threading.Lock()
        self._subscriptions: dict[str, int] = {}
        self._threads: list[threading.Thread] = []
        view = client._view
        try:
            for address in sorted({s.address for s in view.handle.servers}):
                self._subscriptions[address] = self._subscribe(address)
        except BaseException:
            self.close()
            raise
        for address in list(self._subscriptions):
            self._start_pump(address)

    def _subscribe(self, address: str) -> int:
        view = self._client._view
        result = self._client._connection(address).action(ACTION_SUBSCRIBE, action_body(
            view.ctx, bucket=self.bucket, prefix=self.prefix, ops=list(self.ops),
            capacity=self.capacity))
        return int(result["subscription"])

    def _start_pump(self, address: str) -> None:
        thread = threading.Thread(target=self._pump, args=(address,), daemon=True,
                                  name=f"pocketflow-events-{address}")
        self._threads.append(thread)
        thread.start()

    def _follow_map(self) -> None:
        """Subscribe on the servers of the client's current map that have no subscription yet
        (they joined the map after this listener began): their events until now are unknown."""
        addresses = {s.address for s in self._client._view.handle.servers}
        with self._members:
            joined = sorted(addresses - set(self._subscriptions))
            for address in joined:
                if self._closed.is_set():
                    return
                try:
                    self._subscriptions[address] = self._subscribe(address)
                except PocketflowError:
                    continue  # tried again on the next pass of any pump
                self._push([Event("gap", self.bucket, "", address, -1, DROPPED_UNKNOWN)])
                self._start_pump(address)

    def _push(self, events: list[Event]) -> None:
        with self._cond:
            for event in events:
                if len(self._buffer) >= self.capacity:
                    lost = self._buffer.popleft()
                    self._lost_here += lost.dropped if lost.op == "gap" else 1
                self._buffer.append(event)
            self._cond.notify_all()

    def _fail(self, exc: PocketflowError) -> None:
        if not self._closed.is_set():
            with self._cond:
                self._errors.append(exc)
                self._cond.notify_all()

    def _pump(self, address: str) -> None:
        """Park ``events`` calls on one server until the listener closes; follow the map, and
        ride out a server that cannot be reached for up to ``PUMP_RETRY_WINDOW_S``."""
        failing_since: float | None = None
        attempt = 0
        # The highest sequence number got from this server's subscription (None: none yet).
        # Each call confirms it (``keep``), so the server keeps what it returned until the next
        # call: a call whose reply was lost (it timed out while the server was paused, and the
        # server answered it later, to nobody) costs no event, the next call returns them again.
        acked: int | None = None
        while not self._closed.is_set():
            self._follow_map()
            view = self._client._view
            with self._members:
                subscription = self._subscriptions.get(address)
            try:
                if subscription is None:
                    # The server lost the subscription: make it again; what came in between
                    # is unknown.
                    subscription = self._subscribe(address)
                    with self._members:
                        self._subscriptions[address] = subscription
                    acked = None  # a restarted server numbers its events afresh
                    self._push([Event("gap", self.bucket, "", address, -1, DROPPED_UNKNOWN)])
                confirm = {} if acked is None else {"acked": acked}
                result: dict[str, Any] = self._client._connection(address).action(
                    ACTION_EVENTS, action_body(view.ctx, subscription=subscription,
                                               timeout_ms=POLL_TIMEOUT_MS, keep=True,
                                               **confirm))
            except StaleEpoch as exc:
                try:
                    self._client._adopt(exc)  # the next pass follows the new map
                except PocketflowError as failed:
                    self._fail(failed)
                    return
                continue
            except ObjectNotFound:
                with self._members:
                    self._subscriptions.pop(address, None)
                continue
            except (Unavailable, JobNotRegistered) as exc:
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since > PUMP_RETRY_WINDOW_S:
                    self._fail(exc)
                    return
                self._closed.wait(backoff_s(attempt, base_s=PUMP_BACKOFF_BASE_S,
                                            cap_s=PUMP_BACKOFF_CAP_S))
                attempt += 1
                continue
            except PocketflowError as exc:
                self._fail(exc)
                return
            failing_since, attempt = None, 0
            batch: list[Event] = []
            dropped = int(result.get("dropped", 0))
            if dropped:
                batch.append(Event("gap", self.bucket, "", address, -1, dropped))
            for e in result.get("events", ()):
                seq = int(e["seq"])
                if acked is not None and seq <= acked:
                    continue  # returned again: the reply that had it did arrive
                batch.append(Event(e["op"], e["bucket"], e["key"], address, seq))
                acked = seq
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
        with self._members:
            subscriptions = dict(self._subscriptions)
        for address, sid in subscriptions.items():
            try:
                self._client._connection(address).action(
                    ACTION_UNSUBSCRIBE, action_body(view.ctx, subscription=sid))
            except (ObjectNotFound, PocketflowError):
                pass
        with self._members:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(CLOSE_TIMEOUT_S)
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<pocketflow.Listener {self.bucket}/{self.prefix}* ops={self.ops}>"
