"""A driver's handle on a named cache for one run of an application: opens (or creates) the
cache through the control plane, keeps it alive, hands tasks its spec, maintains it (recency,
eviction, capacity) while the run goes on, prewarms it from the application's last working set,
and records this run's working set when the run ends."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from pocketflow.auth import token_expiry_unix_ms
from pocketflow.cache.client import CacheClient, create_buckets
from pocketflow.cache.maintainer import Maintainer
from pocketflow.cache.pack import build_pack, pack_key
from pocketflow.cache.prewarm import (
    PREWARM_BATCH_KEYS,
    PREWARM_CLAIM_AHEAD_KEYS,
    WORKER_START_TIMEOUT_S,
    Workers,
    batches_of,
)
from pocketflow.cache.records import RECORD_BUCKET
from pocketflow.cache.source import S3Source, S3Store, add_request_counts
from pocketflow.cache.spec import (
    CLAIM_MS_DEFAULT,
    FILL_WAIT_S_DEFAULT,
    LEASE_MS_DEFAULT,
    CacheSpec,
    check_lease_ms,
)
from pocketflow.cache.working_set import (
    CAPACITY_MIN_BYTES,
    ENTRY_BYTES_ASSUMED,
    PackRef,
    RunRecord,
    WorkingSet,
    capacity_of_reservation,
    plan_prewarm,
    reservation_bytes,
    resize_wanted,
    target_capacity_bytes,
)
from pocketflow.config import parse_duration, parse_size
from pocketflow.control.caches import check_cache_name
from pocketflow.control.leases import LEASE_MS_MAX, LEASE_MS_MIN
from pocketflow.control.plane import ControlPlane, connect_control_plane, last_started
from pocketflow.errors import (
    CapacityExhausted,
    ConfigError,
    InvalidRequest,
    ObjectNotFound,
    PersistNotSupported,
    PocketflowError,
    S3Error,
)
from pocketflow.handle import JobHandle

__all__ = ["Cache", "open_cache", "IDLE_DEFAULT_S", "CAPACITY_DEFAULT_BYTES",
           "MAINTAIN_INTERVAL_S", "PREWARM_BATCH_KEYS", "PREWARM_CLAIM_AHEAD_KEYS",
           "working_set_key"]

log = logging.getLogger(__name__)

IDLE_DEFAULT_S = 600.0
"""How long a cache lives after its last driver let it go (its entries are freed then)."""
CAPACITY_DEFAULT_BYTES = 64 * 1024 * 1024
"""Capacity of a new cache with nothing recorded to size it by."""
MAINTAIN_INTERVAL_S = 0.25
"""Pause between two maintainer passes."""
SIZING_INTERVAL_S = 2.0
"""How often the maintainer considers growing the cache."""
STOP_TIMEOUT_S = 30.0
"""How long closing waits for the prewarm and maintainer threads."""
RUN_LEASE_MS = 30_000
"""A run's lease on its cache (``Caches.renew_run``): a driver that stops renewing (killed,
stopped, starved on a loaded machine) keeps the cache in use this long, and the cache's idle time
starts after it; a live driver renews it every ``RUN_LEASE_MS / LEASE_RENEW_DIVISOR``, whatever
``idle`` is."""
LEASE_RENEW_DIVISOR = 3
"""Renewals per run lease (two may be lost or late before the lease runs out)."""


def working_set_key(app: str) -> str:
    """Where (in the records bucket) application ``app``'s last working set is kept."""
    return f"working-sets/{check_cache_name(app)}"


def _control(cluster: Any) -> ControlPlane:
    if isinstance(cluster, ControlPlane):
        return cluster
    if cluster is not None:
        return cluster.control
    current = last_started()
    if current is not None:
        return current.control
    return connect_control_plane()


def _s3_url(url: str) -> tuple[str, str]:
    bucket, sep, key = url.removeprefix("s3://").partition("/")
    if not url.startswith("s3://") or not sep or not bucket or not key:
        raise InvalidRequest(f"an S3 URL is s3://bucket/key, got {url!r}")
    return bucket, key


class Cache:
    """One run's handle on a named cache (make it with :func:`open_cache`; use it as a context
    manager). ``spec`` (or ``spec.to_json()``) is what tasks pass to
    :func:`pocketflow.cache.connect`."""

    def __init__(
        self, name: str, control: ControlPlane, opened: dict[str, Any], *, source: S3Source,
        app: str | None, lease_ms: int, idle_ms: int, capacity_bytes: int, autosize: bool,
        capacity_max_bytes: int | None, working_set_url: str | None, claim_ms: int,
        fill_wait_s: float, run_id: str,
    ) -> None:
        self.name = name
        self.app = app
        self._control = control
        self._handle: JobHandle = opened["handle"]
        self._predecessor: JobHandle | None = opened["predecessor"]
        self.created: bool = opened["created"]
        self._idle_ms = idle_ms
        self._autosize = autosize
        self._capacity_max_bytes = capacity_max_bytes
        self._working_set_url = working_set_url
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started_s = time.monotonic()
        self._token_received_ms = int(time.time() * 1000)
        self.run_id = run_id
        self.spec = CacheSpec(name=name, handle=self._handle, source=source, lease_ms=lease_ms,
                              run_id=self.run_id, claim_ms=claim_ms, fill_wait_s=fill_wait_s)
        self._client = CacheClient(self.spec)
        create_buckets(self._client.client)
        # What the cache reserves on the servers covers its entries' records too
        # (``reservation_bytes``). A live generation keeps the capacity it had (its last run
        # fitted it to its working set): what its reservation holds, for entries of the size
        # assumed until the last run's record (``_start``) tells the real one.
        asked = reservation_bytes(capacity_bytes, entry_bytes_mean=ENTRY_BYTES_ASSUMED)
        self._reserved_bytes = int(opened.get("capacity_bytes") or asked)
        held_capacity = (capacity_bytes if self.created or self._reserved_bytes == asked
                         else capacity_of_reservation(self._reserved_bytes,
                                                      entry_bytes_mean=ENTRY_BYTES_ASSUMED))
        self._maintainer = Maintainer(self._client, self.run_id,
                                      capacity_bytes=held_capacity if autosize
                                      else capacity_bytes)
        self._fixed_resize = not autosize and self._reserved_bytes != asked
        self._sized_s = time.monotonic()
        self._refused_s = float("-inf")  # when a growth was last refused (monotonic s)
        self._previous: RunRecord | None = None
        self._previous_from: str | None = None
        self.prewarm_planned = 0
        self.renewed_at_open = 0
        self.prewarm_done_s: float | None = None
        self.prewarm_ended_unix: float | None = None
        self._prewarm: Workers | None = None
        self._prewarm_done = threading.Event()
        self._prewarm_done.set()
        self._threads: list[threading.Thread] = []
        self._closed = False

    # -- what tasks and callers see --------------------------------------------------------------

    @property
    def handle(self) -> JobHandle:
        """The cache's job handle (its current one: renewed tokens, resized maps)."""
        return self._handle

    @property
    def job_id(self) -> str:
        return self._handle.job_id

    @property
    def capacity_bytes(self) -> int:
        return self._maintainer.capacity_bytes

    @property
    def client(self) -> CacheClient:
        """The driver's own client of the cache (its reads are logged with the run's)."""
        return self._client

    @property
    def prewarm_fetched(self) -> int:
        """Keys the prewarm fetched so far."""
        return self._prewarm.fetched if self._prewarm is not None else 0

    @property
    def prewarm_pids(self) -> list[int]:
        """The prewarm's worker processes (tests stop and kill them)."""
        return self._prewarm.pids if self._prewarm is not None else []

    @property
    def maintainer(self) -> Maintainer:
        return self._maintainer

    def connect(self) -> CacheClient:
        """A new client of the cache in this process."""
        return CacheClient(self.spec)

    def status(self) -> dict[str, Any]:
        """The cache's state as the maintainer sees it, and the prewarm's progress."""
        m = self._maintainer
        return {
            "name": self.name, "job_id": self.job_id, "run_id": self.run_id,
            "capacity_bytes": m.capacity_bytes, "held_bytes": m.held_bytes,
            "entries": m.entries, "evictions": m.evictions, "evicted_bytes": m.evicted_bytes,
            "reads": m.reads, "fills": m.fills,
            # Fills the servers refused for want of room (those reads went to S3), and the
            # bytes the cache reserves there for its capacity.
            "refused_fills": m.refused_fills, "refused_bytes": m.refused_bytes,
            "reserved_bytes": self._reserved_bytes,
            "working_set_keys": len(m.working_set),
            "working_set_bytes": m.working_set.distinct_bytes,
            "renewed_at_open": self.renewed_at_open,
            "prewarm_planned": self.prewarm_planned, "prewarm_fetched": self.prewarm_fetched,
            "prewarm_from": self._previous_from, "prewarm_s": self.prewarm_done_s,
            "prewarm_ended_unix": self.prewarm_ended_unix,
            "prewarm_objects_per_s": (self.prewarm_fetched / self.prewarm_done_s
                                      if self.prewarm_done_s else None),
            "prewarm_stats": (dict(self._prewarm.stats)
                              if self._prewarm is not None else None),
            # The workers' CPU seconds (those that ended): with ``prewarm_fetched`` the
            # prewarm's CPU per object, which bounds its rate on a machine whose cores it
            # shares with the run (and, in the benchmarks, with the S3 server).
            "prewarm_cpu_s": (self._prewarm.cpu_ms / 1000
                              if self._prewarm is not None else None),
            # ... of which in the kernel, and before the workers fetched (their start).
            "prewarm_cpu_system_s": (self._prewarm.cpu_system_ms / 1000
                                     if self._prewarm is not None else None),
            "prewarm_start_cpu_s": (self._prewarm.start_cpu_ms / 1000
                                    if self._prewarm is not None else None),
        }

    def wait_prewarmed(self, timeout_s: float) -> bool:
        """Wait until the prewarm finished (or there is none); whether it did within
        ``timeout_s``."""
        return self._prewarm_done.wait(timeout_s)

    def maintain_now(self) -> None:
        """Run a maintainer pass now, in this thread (tests, and before a measurement), as the
        maintainer's own loop runs it: grow first, then evict."""
        with self._lock:
            self._maintainer.run_pass(before_evict=self._grow_if_short)

    # -- starting ------------------------------------------------------------------------------

    def _start(self, *, prewarm: bool) -> None:
        if self._fixed_resize:
            self._resize(self.capacity_bytes, 0)
        if self.app is not None:
            self._previous = self._load_previous()
        if self._previous is not None and self._autosize and not self.created:
            # The live generation's reservation was made for the last run's entries.
            self._maintainer.set_capacity(capacity_of_reservation(
                self._reserved_bytes, entry_bytes_mean=self._previous_entry_bytes_mean()))
        if self._previous is not None and self._autosize:
            wanted = target_capacity_bytes(self._previous.distinct_bytes,
                                           capacity_max_bytes=self._capacity_max_bytes)
            if resize_wanted(self.capacity_bytes, wanted):
                self._resize(wanted, self._previous.read_bytes_per_s,
                             entry_bytes_mean=self._previous_entry_bytes_mean())
        if prewarm and self._previous is not None:
            plan = plan_prewarm(self._previous.keys, self.capacity_bytes)
            self.prewarm_planned = len(plan)
            self._prewarm_done.clear()
            self._start_prewarm(plan)
        elif self._previous is not None and self.spec.lease_ms > 0 and not self.created:
            # The cache lives on from an earlier run: its entries of the last run's working
            # set are likely held but past their lease. Revalidate them here, while the run's
            # first tasks start, so that those find them fresh instead of each waiting on a
            # listing (a prewarm revalidates the keys it goes through itself).
            self._spawn("renew", self._renew_working_set)
        self._spawn("maintain", self._maintain_loop)
        self._spawn("lease", self._lease_loop)

    def _spawn(self, role: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=f"pocketflow-cache-{role}-{self.name}",
                                  daemon=True)
        self._threads.append(thread)
        thread.start()

    def _load_previous(self) -> RunRecord | None:
        """The application's last run record: this generation's, the ended generation's (a
        PERSIST object it left), or the S3 copy at ``working_set_url``."""
        assert self.app is not None
        key = working_set_key(self.app)
        sources: list[tuple[str, Callable[[], bytes]]] = [
            ("cache", lambda: self._client.client.get(RECORD_BUCKET, key))]
        if self._predecessor is not None:
            predecessor = self._predecessor

            def from_predecessor() -> bytes:
                from pocketflow.client import connect

                with connect(predecessor) as old:
                    return old.get(RECORD_BUCKET, key)

            sources.append(("predecessor", from_predecessor))
        if self._working_set_url is not None:
            bucket, s3_key = _s3_url(self._working_set_url)
            store = S3Store(self.spec.source)

            def from_s3() -> bytes:
                fetched = store.get(bucket, s3_key)
                return fetched.data  # type: ignore[union-attr]

            sources.append(("s3", from_s3))
        for origin, read in sources:
            try:
                record = RunRecord.decode(read())
            except (ObjectNotFound, S3Error, InvalidRequest) as exc:
                log.debug("cache %s: no working set of %s in %s: %s", self.name, self.app,
                          origin, exc)
                continue
            except PocketflowError as exc:
                log.warning("cache %s: reading the working set of %s from %s failed: %s",
                            self.name, self.app, origin, exc)
                continue
            self._previous_from = origin
            return record
        return None

    def _renew_working_set(self) -> None:
        """Revalidate the last run's working set with listings, bucket by bucket, in S3's order
        (:meth:`CacheClient.renew`): the metas of the keys held unchanged are dated when their
        page was sent. Counted in ``renewed_at_open``."""
        assert self._previous is not None
        by_bucket: dict[str, list[str]] = {}
        for use in self._previous.keys:
            by_bucket.setdefault(use.bucket, []).append(use.key)
        for bucket, keys in by_bucket.items():
            if self._stop.is_set():
                return
            self.renewed_at_open += self._client.renew(bucket, keys, self._stop)

    def _start_prewarm(self, plan: list[Any]) -> None:
        """Fetch the planned keys in batches, largest benefit first, in worker processes
        (:mod:`pocketflow.cache.prewarm`), each with its next ``PREWARM_CLAIM_AHEAD_KEYS``
        claimed ahead (its first window before this returns, within
        ``WORKER_START_TIMEOUT_S``, so that the run's first tasks find it): tasks asking for a
        key claimed or in flight wait for the prewarm's fill. The workers' S3 requests are
        added to this process's :func:`~pocketflow.cache.source.request_counts` as they end."""

        def ended() -> None:
            self.prewarm_done_s = time.monotonic() - self._started_s
            self.prewarm_ended_unix = time.time()
            self._prewarm_done.set()

        workers = Workers(self.spec.to_json(), batches_of(plan),
                          on_requests=add_request_counts,
                          pack=self._previous.pack if self._previous is not None else None)
        self._prewarm = workers
        if not workers.wait_started(WORKER_START_TIMEOUT_S):
            log.warning("cache %s: a prewarm worker did not claim its first keys within %.0f s",
                        self.name, WORKER_START_TIMEOUT_S)

        def watch() -> None:
            workers.done.wait()
            ended()

        self._spawn("prewarm", watch)

    # -- running ---------------------------------------------------------------------------------

    def _maintain_loop(self) -> None:
        while not self._stop.wait(MAINTAIN_INTERVAL_S):
            try:
                with self._lock:
                    # Grow before evicting: what outgrew the capacity may stay if it may grow.
                    self._maintainer.run_pass(before_evict=self._grow_if_short)
            except Exception as exc:  # noqa: BLE001 - the loop outlives one bad pass, logged
                log.warning("cache %s: maintainer pass failed: %s", self.name, exc)

    def _grow_if_short(self) -> None:
        """Grow (never shrink: a run's working set so far is not yet all of it) once the run's
        working set, or the bytes held, outgrow the capacity, or fills were refused for want of
        room on the servers: to the larger of the working set's target and twice the capacity
        (geometric growth, so a growing run resizes a logarithmic number of times), within
        ``capacity_max``. The reservation asked for covers the entries' records at the mean
        entry size held (``reservation_bytes``), so a cache at ``capacity_max`` whose fills
        were refused still reserves again for the same capacity if its reservation was short.

        Growth for the working set waits ``SIZING_INTERVAL_S`` after the last resize; growth
        because the bytes held are over the capacity, or because fills were refused, does not
        (the eviction that follows would otherwise throw away entries of a working set that
        fits ``capacity_max``: the 1 GiB benchmark's cold run evicted 192 of its 1024 entries
        while growing from 64 MiB; and the refused fills' reads go to S3, and the next run's
        too: the 4 KiB benchmark's cold run had 6,732 of 20,000 fills refused and never grew),
        unless the last such growth was refused less than ``SIZING_INTERVAL_S`` ago."""
        if not self._autosize:
            return
        now_s = time.monotonic()
        over = self._maintainer.held_bytes > self.capacity_bytes
        short = over or self._maintainer.refused_pending > 0
        refused_lately = now_s - self._refused_s < SIZING_INTERVAL_S
        if (not short or refused_lately) and now_s - self._sized_s < SIZING_INTERVAL_S:
            return
        refused = self._maintainer.take_refused()
        working_set = self._maintainer.working_set
        needed = max(working_set.distinct_bytes, self._maintainer.held_bytes)
        wanted = target_capacity_bytes(needed, capacity_max_bytes=self._capacity_max_bytes)
        doubled = self.capacity_bytes * 2
        if self._capacity_max_bytes is not None:
            doubled = min(doubled, self._capacity_max_bytes)
        grown = max(wanted, doubled, self.capacity_bytes)
        mean = self._entry_bytes_mean()
        outgrown = wanted > self.capacity_bytes and resize_wanted(self.capacity_bytes, wanted)
        reserves_enough = grown == self.capacity_bytes and reservation_bytes(
            grown, entry_bytes_mean=mean) <= self._reserved_bytes
        if not outgrown and (not refused or reserves_enough):
            # Nothing outgrew it, or it is at its maximum and reserves enough for it.
            return
        self._sized_s = now_s
        if not self._resize(grown, self._read_bytes_per_s(working_set), entry_bytes_mean=mean):
            self._refused_s = now_s

    def _entry_bytes_mean(self) -> float:
        """The mean entry size to reserve for: of the entries held, else of the run's working
        set, else of the last run's, else ``ENTRY_BYTES_ASSUMED``."""
        held = self._maintainer.entry_bytes_mean
        if held is not None:
            return held
        working_set = self._maintainer.working_set
        if len(working_set):
            return working_set.distinct_bytes / len(working_set)
        return self._previous_entry_bytes_mean()

    def _previous_entry_bytes_mean(self) -> float:
        previous = self._previous
        return previous.entry_bytes_mean if previous is not None else float(ENTRY_BYTES_ASSUMED)

    def _read_bytes_per_s(self, working_set: WorkingSet) -> int:
        elapsed_s = max(time.monotonic() - self._started_s, 1e-3)
        return int(working_set.bytes_read / elapsed_s)

    def _resize(self, capacity_bytes: int, read_bytes_per_s: int, *,
                entry_bytes_mean: float | None = None) -> bool:
        """Ask the control plane for ``capacity_bytes`` of entries of ``entry_bytes_mean``
        bytes (default: :meth:`_entry_bytes_mean`) with their records
        (``reservation_bytes``); whether it granted them."""
        if entry_bytes_mean is None:
            entry_bytes_mean = self._entry_bytes_mean()
        reserved = reservation_bytes(capacity_bytes, entry_bytes_mean=entry_bytes_mean)
        hints: dict[str, Any] = {"data_size_bytes": reserved, "latency_sensitive": True}
        if read_bytes_per_s > 0:
            hints["peak_throughput_bytes_per_s"] = read_bytes_per_s
        try:
            handle = self._control.resize_cache(self.job_id, hints)
        except CapacityExhausted as exc:
            log.warning("cache %s: cannot resize to %d bytes: %s", self.name, capacity_bytes, exc)
            return False
        log.info("cache %s: capacity %d -> %d bytes (%d reserved)", self.name,
                 self.capacity_bytes, capacity_bytes, reserved)
        self._maintainer.set_capacity(capacity_bytes)
        self._reserved_bytes = reserved
        self._adopt(handle)
        return True

    def _adopt(self, handle: JobHandle) -> None:
        if handle.epoch < self._handle.epoch:
            return
        self._handle = handle
        self.spec = self.spec.with_handle(handle)
        self._client.update_spec(self.spec)

    def _lease_loop(self) -> None:
        """Renew the run's lease while the run lasts (the cache ends ``idle`` after its last
        run ended or stopped renewing), and the cache's token once half of its life is gone."""
        period_s = RUN_LEASE_MS / 1000 / LEASE_RENEW_DIVISOR
        while not self._stop.wait(period_s):
            try:
                self._control.renew_cache_run(self.job_id, self.run_id, RUN_LEASE_MS,
                                              self._idle_ms)
                self._renew_token_if_due()
            except PocketflowError as exc:
                log.warning("cache %s: renewing its lease failed: %s", self.name, exc)

    def _renew_token_if_due(self) -> None:
        expiry_ms = token_expiry_unix_ms(self._handle.token)
        now_ms = int(time.time() * 1000)
        if now_ms >= expiry_ms - (expiry_ms - self._token_received_ms) / 2:
            self._token_received_ms = now_ms
            self._adopt(self._control.renew_token(self.job_id))

    # -- ending ----------------------------------------------------------------------------------

    def close(self) -> dict[str, Any]:
        """End the run: stop prewarming and maintaining, record the run's working set (with
        PERSIST, and at ``working_set_url``), fit the capacity to it, and let the cache's idle
        time start. Returns the final :meth:`status`. A second call does nothing."""
        if self._closed:
            return self.status()
        self._closed = True
        self._stop.set()
        if self._prewarm is not None:
            # Its workers write their fills' records and remove their outcomes as they end.
            self._prewarm.stop()
        for thread in self._threads:
            thread.join(timeout=STOP_TIMEOUT_S)
        try:
            self._client.flush()
            with self._lock:
                self._maintainer.take_accesses()
                self._maintainer.evict()
            if self.app is not None and len(self._maintainer.working_set):
                self._record(self._maintainer.working_set)
            try:
                self._client.client.delete_prefix(RECORD_BUCKET, f"access/{self.run_id}")
            except PocketflowError as exc:
                log.debug("cache %s: the run's access queue stays: %s", self.name, exc)
            try:
                # The cache's idle time starts now, unless another run still uses it.
                self._control.end_cache_run(self.job_id, self.run_id, self._idle_ms)
            except PocketflowError as exc:
                log.warning("cache %s: ending its run's lease failed: %s", self.name, exc)
        finally:
            self._client.close()
        return self.status()

    def _record(self, working_set: WorkingSet) -> None:
        assert self.app is not None
        duration_s = time.monotonic() - self._started_s
        uses = tuple(working_set.uses())
        pack = None
        if self._working_set_url is not None:
            pack = self._pack(uses)
        record = RunRecord(self.app, self.run_id, int(time.time() * 1000), duration_s, uses,
                           pack)
        raw = record.encode()
        # Whether both copies of the record (the cache's and S3's) now name this run's pack:
        # only then may the pack the last record named go (a copy that failed still names it).
        replaced = True
        try:
            self._client.client.put(RECORD_BUCKET, working_set_key(self.app), raw,
                                    persist=True, overwrite=True)
        except PersistNotSupported:
            log.warning("cache %s: no long-running server: the working set of %s is kept "
                        "only while the cache lives", self.name, self.app)
            try:
                self._client.client.put(RECORD_BUCKET, working_set_key(self.app), raw,
                                        overwrite=True)
            except PocketflowError as exc:
                replaced = False
                log.warning("cache %s: recording the working set of %s failed: %s",
                            self.name, self.app, exc)
        except PocketflowError as exc:
            replaced = False
            log.warning("cache %s: recording the working set of %s failed: %s", self.name,
                        self.app, exc)
        if self._working_set_url is not None:
            bucket, key = _s3_url(self._working_set_url)
            try:
                S3Store(self.spec.source).put(bucket, key, raw)
            except S3Error as exc:
                replaced = False
                log.warning("cache %s: copying the working set to %s failed: %s", self.name,
                            self._working_set_url, exc)
            previous_pack = self._previous.pack if self._previous is not None else None
            if (replaced and previous_pack is not None
                    and (pack is None or (pack.bucket, pack.key)
                         != (previous_pack.bucket, previous_pack.key))
                    and previous_pack.bucket == bucket
                    and previous_pack.key.startswith(pack_key(key, ""))):
                # No record names it any more (this run packed other entries, or nothing). A
                # prewarm still reading it GETs its keys alone; a run that started from the
                # same record and keeps it may still name it (docs/ARCHITECTURE.md, Packs).
                try:
                    S3Store(self.spec.source).delete(previous_pack.bucket, previous_pack.key)
                except S3Error as exc:
                    log.info("cache %s: the last pack %s stays: %s", self.name,
                             previous_pack.key, exc)
        if self._autosize:
            wanted = target_capacity_bytes(record.distinct_bytes,
                                           capacity_max_bytes=self._capacity_max_bytes)
            if resize_wanted(self.capacity_bytes, wanted):
                self._resize(wanted, record.read_bytes_per_s,
                             entry_bytes_mean=record.entry_bytes_mean)

    def _pack(self, uses: tuple[Any, ...]) -> PackRef | None:
        """The run's small entries packed next to the working set's S3 copy
        (:mod:`pocketflow.cache.pack`), or the last run's pack if it holds the same; None
        when there is nothing to pack or packing failed (the next prewarm GETs each key)."""
        assert self._working_set_url is not None
        bucket, key = _s3_url(self._working_set_url)
        previous = self._previous.pack if self._previous is not None else None
        try:
            return build_pack(self._client.client, S3Store(self.spec.source), uses, bucket,
                              pack_key(key, self.run_id), previous=previous)
        except PocketflowError as exc:
            log.warning("cache %s: packing the small entries of %s failed: %s", self.name,
                        self.app, exc)
            return None

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<pocketflow.cache.Cache {self.name} job={self.job_id} run={self.run_id}>"


def open_cache(
    name: str,
    source: S3Source | str,
    *,
    app: str | None = None,
    prewarm: bool = False,
    lease_ms: int = LEASE_MS_DEFAULT,
    idle: float | str = IDLE_DEFAULT_S,
    capacity: int | str | None = None,
    capacity_max: int | str | None = None,
    working_set_url: str | None = None,
    claim_ms: int = CLAIM_MS_DEFAULT,
    fill_wait_s: float = FILL_WAIT_S_DEFAULT,
    cluster: Any = None,
) -> Cache:
    """Open the cache ``name`` over ``source`` (an :class:`S3Source`, or an endpoint URL) for
    one run, creating it if it has no live generation; use the result as a context manager.

    - ``app``: the application this run belongs to; its working set is recorded when the run
      ends and, with ``prewarm=True``, the last run's is fetched as this one starts (in the
      background: tasks may start at once; one asking for a key being fetched waits for it).
    - ``lease_ms``: the validation lease (0: every read asks S3).
    - ``idle``: the cache lives this long after its last run closed it, or after a dead
      driver's run lease (``RUN_LEASE_MS``) lapsed (then its entries are freed; the recorded
      working sets stay, with PERSIST).
    - ``capacity``: fixed capacity; by default it follows the working set (the last run's when
      one is recorded, else ``CAPACITY_DEFAULT_BYTES``), grown during a run up to
      ``capacity_max`` and fitted to the run's working set at its end.
    - ``working_set_url``: ``s3://bucket/key`` where the working set is also kept, so a run on
      a fresh cluster can prewarm from it.
    - ``cluster``: as for :func:`pocketflow.register_job`.
    """
    check_cache_name(name)
    if app is not None:
        check_cache_name(app)
    if isinstance(source, str):
        source = S3Source(endpoint_url=source)
    check_lease_ms(lease_ms)
    idle_ms = int(parse_duration(idle, name="idle") * 1000)
    if not LEASE_MS_MIN <= idle_ms <= LEASE_MS_MAX:
        raise ConfigError(f"idle must be in {LEASE_MS_MIN} ms..{LEASE_MS_MAX} ms")
    if working_set_url is not None:
        _s3_url(working_set_url)
    capacity_max_bytes = None if capacity_max is None else parse_size(capacity_max,
                                                                      name="capacity_max")
    autosize = capacity is None
    capacity_bytes = (CAPACITY_DEFAULT_BYTES if capacity is None
                      else parse_size(capacity, name="capacity"))
    if capacity_max_bytes is not None:
        capacity_bytes = min(capacity_bytes, capacity_max_bytes)
    if capacity_bytes < (CAPACITY_MIN_BYTES if autosize else 1):
        raise ConfigError(f"capacity must be at least {CAPACITY_MIN_BYTES} bytes")
    control = _control(cluster)
    run_id = secrets.token_hex(6)
    reserved = reservation_bytes(capacity_bytes, entry_bytes_mean=ENTRY_BYTES_ASSUMED)
    opened = control.open_cache(
        name, {"data_size_bytes": reserved, "latency_sensitive": True}, idle_ms,
        run_id, RUN_LEASE_MS)
    cache = Cache(
        name, control, opened, source=source, app=app, lease_ms=lease_ms, idle_ms=idle_ms,
        capacity_bytes=capacity_bytes, autosize=autosize, capacity_max_bytes=capacity_max_bytes,
        working_set_url=working_set_url, claim_ms=claim_ms, fill_wait_s=fill_wait_s,
        run_id=run_id,
    )
    try:
        cache._start(prewarm=prewarm)
    except BaseException:
        cache.close()
        raise
    return cache
