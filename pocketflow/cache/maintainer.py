"""The cache's maintainer, in the driver that opened it: it reads the run's access queue to keep
each entry's recency and the bytes held, evicts the least recently read entries beyond the
cache's capacity, grows the capacity when the run's working set outgrows it, and aggregates the
working set the run leaves for the next one.

What it knows comes from the tasks' access batches (a task flushes its batch about once a
second and when it closes), so the bytes held can run ahead of it by what fills since the last
batches added; every ``RESYNC_S`` it lists the entries themselves and takes their sizes as the
truth, which also finds entries nobody read in this run (earlier runs', replaced versions',
orphans of a killed fill): they are the least recent of all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from pocketflow.cache.access_log import ACCESS_QUEUE_ITEMS_MAX, drain
from pocketflow.cache.records import ENTRY_BUCKET, cache_key, entry_key
from pocketflow.cache.working_set import WorkingSet
from pocketflow.errors import PocketflowError

if TYPE_CHECKING:
    from pocketflow.cache.client import CacheClient

__all__ = ["Maintainer", "ENTRIES_TRACKED_MAX", "RESYNC_S", "EVICTIONS_PER_PASS_MAX",
           "ACCESS_ITEMS_PER_PASS_MAX", "EVICT_TO"]

log = logging.getLogger(__name__)

ENTRIES_TRACKED_MAX = 1_000_000
"""Most entries the maintainer tracks; past this the least recent are evicted."""
RESYNC_S = 30.0
"""How often the maintainer lists the entries to correct what it believes is held."""
EVICTIONS_PER_PASS_MAX = 512
"""Most entries one pass evicts (the next pass goes on)."""
ACCESS_ITEMS_PER_PASS_MAX = ACCESS_QUEUE_ITEMS_MAX
"""Most access batches one pass dequeues."""
EVICT_TO = 0.9
"""Eviction, once the bytes held exceed the capacity, goes down to this share of it."""


class Maintainer:
    """Recency, bytes held, eviction and the working set of one run of a cache (thread-safe:
    :meth:`run_pass` runs on the maintainer's thread, the rest may be read from any)."""

    def __init__(
        self, client: CacheClient, run_id: str, *, capacity_bytes: int,
        on_working_set: Callable[[WorkingSet], None] | None = None,
    ) -> None:
        self._client = client
        self._run_id = run_id
        self._lock = threading.Lock()
        self._recency: OrderedDict[str, int] = OrderedDict()
        self._held_bytes = 0
        self._capacity_bytes = capacity_bytes
        self._resynced_s: float | None = None
        self._on_working_set = on_working_set
        self.working_set = WorkingSet()
        self.evictions = 0
        self.evicted_bytes = 0
        self.reads = 0
        self.fills = 0
        self.refused_fills = 0
        self.refused_bytes = 0
        self._refused_pending = 0

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held_bytes

    @property
    def entries(self) -> int:
        with self._lock:
            return len(self._recency)

    @property
    def capacity_bytes(self) -> int:
        with self._lock:
            return self._capacity_bytes

    @property
    def entry_bytes_mean(self) -> float | None:
        """The mean size of the entries held, None while none is."""
        with self._lock:
            return self._held_bytes / len(self._recency) if self._recency else None

    @property
    def refused_pending(self) -> int:
        """The fills refused for want of room that :meth:`take_refused` has not taken yet."""
        with self._lock:
            return self._refused_pending

    def take_refused(self) -> int:
        """The fills refused for want of room since the last call (the cache's cue to grow)."""
        with self._lock:
            refused, self._refused_pending = self._refused_pending, 0
            return refused

    def set_capacity(self, capacity_bytes: int) -> None:
        with self._lock:
            self._capacity_bytes = capacity_bytes

    def recent(self, count: int) -> list[str]:
        """The ``count`` most recently read entries, most recent last (for tests and status)."""
        with self._lock:
            return list(self._recency)[-count:]

    def run_pass(self, *, before_evict: Callable[[], None] | None = None) -> None:
        """One pass: resync if due, take the access batches in, run ``before_evict`` (the
        cache's chance to grow), evict beyond the capacity."""
        if self._resynced_s is None or time.monotonic() - self._resynced_s >= RESYNC_S:
            self.resync()
        self.take_accesses()
        if before_evict is not None:
            before_evict()
        self.evict()
        if self._on_working_set is not None:
            self._on_working_set(self.working_set)

    def take_accesses(self) -> int:
        """Dequeue the run's access batches (at most ``ACCESS_ITEMS_PER_PASS_MAX``); returns the
        accesses taken in."""
        taken = 0
        try:
            for access in drain(self._client.client, self._run_id,
                                items_max=ACCESS_ITEMS_PER_PASS_MAX):
                taken += 1
                name = entry_key(cache_key(access.bucket, access.key), access.etag)
                with self._lock:
                    self.reads += access.reads
                    self.fills += access.fills
                    if access.reads:
                        self.working_set.add(access.bucket, access.key, access.size,
                                             access.reads)
                    if access.refused:
                        self.refused_fills += access.refused
                        self.refused_bytes += access.refused * access.size
                        self._refused_pending += access.refused
                        if not access.fills and access.reads <= access.refused:
                            # Read only by the fills refused: not held.
                            continue
                    if name not in self._recency:
                        self._held_bytes += access.size
                        self._recency[name] = access.size
                    self._recency.move_to_end(name)
        except PocketflowError as exc:
            log.warning("cache %s: reading the access queue failed: %s",
                        self._client.spec.name, exc)
        return taken

    def evict(self) -> int:
        """Evict the least recently read entries while the bytes held exceed the capacity (down
        to ``EVICT_TO`` of it, at most ``EVICTIONS_PER_PASS_MAX``); returns how many."""
        evicted = 0
        while evicted < EVICTIONS_PER_PASS_MAX:
            with self._lock:
                over = (self._held_bytes > self._capacity_bytes
                        or len(self._recency) > ENTRIES_TRACKED_MAX)
                if evicted and self._held_bytes <= self._capacity_bytes * EVICT_TO:
                    over = False
                if not over or not self._recency:
                    break
                name, size = self._recency.popitem(last=False)
                self._held_bytes -= size
            try:
                self._client.evict(name)
            except PocketflowError as exc:
                log.warning("cache %s: evicting %s failed: %s", self._client.spec.name, name, exc)
                break
            evicted += 1
            self.evictions += 1
            self.evicted_bytes += size
        return evicted

    def resync(self) -> None:
        """List the entries: those not tracked join as the least recent, tracked ones that are
        gone are forgotten, and the bytes held become the listed sizes."""
        listed: dict[str, int] = {}
        try:
            for page in self._client.client.enumerate(ENTRY_BUCKET):
                for info in page:
                    listed[info.key] = info.size
                    if len(listed) >= ENTRIES_TRACKED_MAX:
                        break
                if len(listed) >= ENTRIES_TRACKED_MAX:
                    break
        except PocketflowError as exc:
            log.warning("cache %s: listing entries failed: %s", self._client.spec.name, exc)
            return
        with self._lock:
            untracked = [(n, s) for n, s in listed.items() if n not in self._recency]
            for name in [n for n in self._recency if n not in listed]:
                del self._recency[name]
            for name in self._recency:
                self._recency[name] = listed[name]
            oldest = OrderedDict(untracked)
            oldest.update(self._recency)
            self._recency = oldest
            self._held_bytes = sum(self._recency.values())
            self._resynced_s = time.monotonic()
