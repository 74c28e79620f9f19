"""A task's side of a read-through cache: reads served from pocketflow while S3's confirmation
of an entry holds, revalidated with one conditional request (or one listing for many keys)
after it, filled from S3 by exactly one process per miss; writes and deletes go through to S3.

The read of a batch of keys, in rounds of at most ``ROUND_KEYS_MAX``:

1. The keys' ``meta`` records, one pipelined read. A *fresh* one (validated less than the lease
   ago) is a hit: its entry is read, and S3 is not asked.
2. A *stale* one is revalidated: with a conditional GET (``If-None-Match`` its ETag) per key, or,
   for ``LIST_REVALIDATE_MIN`` keys or more, with ListObjectsV2 pages over them (one request per
   1000 keys). Unchanged keys get their ``meta`` rewritten with the new validation time and are
   hits; a changed key whose new bytes came with the answer is refilled with them; others are
   misses. The entries of stale values are read while S3 answers, the renewed metas written
   while they are read. After a read that listed, its publisher thread lists the page of keys
   that follow the batch and renews the metas of those cached unchanged
   (:meth:`CacheClient._renew_following`), for the tasks that read them next.
3. A miss is filled under a *claim* (``claims/<ckey>``, written once, so one process wins): the
   winner reads S3 and has its bytes at once; the client's publisher thread then writes the
   entry, then ``meta``, then the fill's outcome (``done/<ckey>@<fill>``), then removes the
   claim, while the reader goes on (``flush`` and ``close`` wait for it; a process that ends
   without either, e.g. by ``os._exit``, leaves its claims to be taken over once ``claim_ms``
   passed, as a killed filler's, and its fills uncached). The others park on the
   storage server for that outcome (``Client.wait_for``) and read the entry the winner wrote. A
   miss costs its reader two round trips to the cache before the S3 request (the ``meta`` read
   and the claim's write-once put; the claim is read back only when some write of the batch
   met a rival's claim) and none after it. A claim carries a deadline its owner moves on during
   a long download; once it passed with no outcome (the owner died), one waiter takes the fill
   over (the write-once ``steal`` marker decides which) and the others wait for it.

If the cache's storage fails (a full tier, an unreachable server), reads go to S3 directly and
are counted as ``bypassed``: the cache is a shortcut, never a new way to fail.

Staleness bound: a read returns a version of the object that S3 held at some instant no more
than ``lease_ms`` before the read began (``validated_ms`` is taken before the confirming
request is sent; processes on several hosts add their clocks' skew). Writes and deletes through
the cache update the entry before they return, so a later read through the cache sees them,
unless a revalidation (a read's or a listing ahead) begun before the write finishes after it,
which still keeps the bound."""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import accumulate, islice
from typing import Any

from pocketflow import _core
from pocketflow.cache.access_log import AccessRecorder
from pocketflow.cache.records import (
    BUCKETS,
    CLAIM_BUCKET,
    DONE_BUCKET,
    ENTRY_BUCKET,
    META_BUCKET,
    STATE_ERROR,
    STATE_MISSING,
    STATE_UNCACHED,
    STATE_VALUE,
    Claim,
    Meta,
    Outcome,
    cache_key,
    done_key,
    entry_key,
    new_fill_id,
    owner_id,
    steal_key,
)
from pocketflow.cache.source import LIST_PAGE_KEYS, NOT_MODIFIED, Fetched, S3Store
from pocketflow.cache.spec import CacheSpec
from pocketflow.errors import (
    CapacityExhausted,
    InternalError,
    InvalidRequest,
    ObjectExists,
    ObjectNotFound,
    PocketflowError,
    S3Error,
    S3ObjectNotFound,
    s3_error,
)

__all__ = ["CacheClient", "CacheStats", "connect", "shared_client", "create_buckets",
           "ROUND_KEYS_MAX", "LIST_REVALIDATE_MIN", "WAIT_SLICE_S", "READ_ATTEMPTS_MAX",
           "S3_PARALLEL_MAX", "DONE_LINGER_S", "PUBLISH_PENDING_BYTES_MAX", "LOOKAHEAD_KEYS",
           "WAIT_HEAD_KEYS"]

log = logging.getLogger(__name__)

ROUND_KEYS_MAX = 1024
"""Most keys one round of a batch read handles (its pipelined reads and writes)."""
LIST_REVALIDATE_MIN = 2
"""Stale keys of one round from which a listing revalidates them instead of conditional GETs
(one listing page answers for up to 1000 keys; keys it does not reach within its bound are
asked one conditional GET each)."""
WAIT_SLICE_S = 2.0
"""A waiter looks at the claims it waits on at least this often (to see a lapsed one)."""
READ_ATTEMPTS_MAX = 4
"""Rounds a key may go around (its entry replaced or evicted under the read, a claim stolen)
before it is read from S3 directly."""
S3_PARALLEL_MAX = 16
"""S3 requests one client has in flight by default (S3 does not pipeline; each is a
connection)."""
S3_PARALLEL_LIMIT = 256
"""Most S3 requests in flight a client may be given."""
DONE_LINGER_S = 10.0
"""How long a fill's outcome stays for waiters that have not read it yet."""
DONE_PENDING_MAX = 4096
"""Outcomes a client keeps waiting to remove; past this the oldest go at once."""
PUT_CHUNK_KEYS = 4096
"""``put_many`` sends at most this many objects per round and stops at a failed round, so
writes go out in chunks no larger (and no larger than ``PUT_CHUNK_BYTES``)."""
PUT_CHUNK_BYTES = 32 * 1024 * 1024
"""Most bytes of one chunk of pipelined writes."""
HELD_CLAIMS_MAX = 65_536
"""Claims a client holds ahead of its fetches (:meth:`CacheClient.claim_ahead`, a prewarm's
window); past this it claims no more."""
HELD_CLAIM_MARGIN_MS = 2_000
"""A claim held ahead is used without reading it back while its deadline is at least this far
off (no waiter takes a claim over before its deadline; the margin covers clock skew)."""
LANE_WAIT_SLICE_S = 1.0
"""A reader of S3 answers in order looks at least this often whether a lane failed."""
WAIT_HEAD_KEYS = 256
"""A reader waiting for other processes' fills of many keys waits for this many at a time, in
the order it reads them, and reads their entries while the later ones are still being fetched
(one pipelined wait and read per head: a prewarm fills in pieces of ``PUBLISH_PIECE_KEYS``)."""
PUBLISH_PIECE_BYTES = 16 * 1024 * 1024
PUBLISH_PIECE_KEYS = 256
"""A batch of fills goes to the publisher in pieces of at most this many bytes or keys, each as
soon as its S3 answers are in."""
LOOKAHEAD_KEYS = 1000
"""Keys that follow a revalidated batch which one listing (one request) renews after the read,
for the tasks that read them next (0: none)."""
PUBLISH_PENDING_BYTES_MAX = 256 * 1024 * 1024
"""Bytes of S3 answers a client holds for fills its publisher thread has not written to the
cache yet; a reader whose fill would pass this waits for the publisher first (a fill larger than
this alone waits until nothing else is pending)."""


@dataclass
class CacheStats:
    """What a client's reads were: ``fresh`` hits (no S3 request), ``revalidated`` hits (one
    validation), ``waited`` (filled by another process while this one waited), ``filled``
    (fetched from S3 by this process to be cached; one the cache then could not take moves to
    ``bypassed`` once the publisher met the failure: the counts settle at ``flush``),
    ``bypassed`` (read from S3 without the cache),
    ``missing`` (the key is not in S3). ``hits`` counts every read served from the cache;
    ``listings`` the revalidations by listing and ``listed_keys`` the keys their pages held
    (those revalidated and others in their range); ``renewed_ahead`` the metas of keys
    following a revalidated batch that a listing renewed (:meth:`CacheClient._renew_following`);
    ``wait_slices`` the waits parked on the servers for other processes' fills;
    ``fill_round_trips`` the calls to the cache a reader made for its misses between reading
    their ``meta`` and having their bytes (the claim's put, its read back if a rival's claim was
    met); the writes of a fill happen after, on the publisher thread. ``packed`` counts the
    fills (within ``filled``) whose bytes a prewarm took from a pack
    (:mod:`pocketflow.cache.pack`) instead of a GET of their own. ``pinned`` counts the
    entries ``get_views`` read in place, pinned in a storage server's shared DRAM arena (no
    copy; :meth:`Client.pin_views`). ``refused`` counts the fills (within ``bypassed``) that
    the cache's storage refused for want of room (``CapacityExhausted``): each is also logged
    to the run's access queue, so the run's maintainer grows the cache (docs/ARCHITECTURE.md,
    "What a cache reserves, and fills the servers refuse")."""

    fresh: int = 0
    revalidated: int = 0
    waited: int = 0
    filled: int = 0
    bypassed: int = 0
    missing: int = 0
    validations: int = 0
    listings: int = 0
    listed_keys: int = 0
    renewed_ahead: int = 0
    bytes_read: int = 0
    steals: int = 0
    wait_slices: int = 0
    fill_round_trips: int = 0
    packed: int = 0
    pinned: int = 0
    refused: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def hits(self) -> int:
        return self.fresh + self.revalidated + self.waited

    @property
    def reads(self) -> int:
        return self.hits + self.filled + self.bypassed + self.missing

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def to_dict(self) -> dict[str, int]:
        with self._lock:
            out = {name: getattr(self, name) for name in (
                "fresh", "revalidated", "waited", "filled", "bypassed", "missing",
                "validations", "listings", "listed_keys", "renewed_ahead", "bytes_read", "steals",
                "wait_slices",
                "fill_round_trips", "packed", "pinned", "refused")}
        out["hits"] = out["fresh"] + out["revalidated"] + out["waited"]
        return out


class _Retry(Exception):
    """A key must go around again (its entry went away under the read, a claim was taken over)."""


class _Bypass(Exception):
    """The cache's storage failed for this key: read S3 directly."""


Result = bytes | PocketflowError

_STORED = "stored"
_REFUSED = "refused"
_FAILED = "failed"
"""What became of an entry written (:meth:`CacheClient._store_entries`)."""

_NOT_CACHED = ObjectNotFound("not_found: no meta record (looked up)")
"""What :meth:`CacheClient._metas_mostly_missing` returns for a key with no ``meta``."""


class CacheClient:
    """Reads and writes S3 objects through a cache (build it with :func:`connect`).

    Thread-safe. ``get``/``get_many``/``get_each``/``get_views`` read; ``put``/``delete``
    write through;
    ``invalidate`` drops an entry; ``prefetch`` fills keys without returning them (prewarming).
    """

    def __init__(self, spec: CacheSpec, *, client: Any = None, record_reads: bool = True,
                 s3_parallel: int = S3_PARALLEL_MAX, linger_claims: bool = False) -> None:
        """``client``: a client of the cache's job to use (default: one of its own).
        ``record_reads`` False logs this client's fills to the run's access queue but not its
        reads (a prewarm's reads are not the run's working set). ``s3_parallel``: S3 requests
        in flight at once. ``linger_claims``: a fill's claim stays until its outcome is
        removed (``DONE_LINGER_S``) instead of going as soon as the fill is written, so that
        a reader that found no ``meta`` just before the fill was written finds the claim, and
        with it the outcome, instead of claiming and fetching the key again (a prewarm, whose
        fills land while the tasks read the same keys)."""
        if not 1 <= s3_parallel <= S3_PARALLEL_LIMIT:
            raise InvalidRequest(f"s3_parallel must be in 1..{S3_PARALLEL_LIMIT}")
        self._s3_parallel = s3_parallel
        from pocketflow.client import connect as connect_job

        self.spec = spec
        self._own_client = client is None
        self._pf = connect_job(spec.handle) if client is None else client
        self._s3 = S3Store(spec.source)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._owner = owner_id()
        self.stats = CacheStats()
        self._recorder = (AccessRecorder(self._pf, spec.run_id)
                          if spec.run_id is not None else None)
        self._record_reads = record_reads
        self._done_lock = threading.Lock()
        # (when, outcome's key, the fill's claim if it lingers with its outcome)
        self._done_due: deque[tuple[float, str, tuple[str, Claim] | None]] = deque()
        self._linger_claims = linger_claims
        self._publisher: ThreadPoolExecutor | None = None
        self._held_lock = threading.Lock()
        self._held: dict[str, Claim] = {}
        self._held_renewer: threading.Thread | None = None
        self._held_stop = threading.Event()
        self._pending = threading.Condition()
        self._pending_bytes = 0
        self._pending_fills = 0
        self._known_lock = threading.Lock()
        # Bytes a prefetch's caller already has, validated at the time given (a prewarm's pack).
        self._known: dict[str, tuple[Fetched, int]] = {}
        self._closed = False

    # -- lifetime ------------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The pocketflow client of the cache's job."""
        return self._pf

    @property
    def source_store(self) -> S3Store:
        """The S3 requests of the cache's source (for what the cache does not cover: buckets)."""
        return self._s3

    def update_spec(self, spec: CacheSpec) -> None:
        """Take a newer spec of the same cache (a renewed token, a resized map)."""
        self.spec = spec
        self._pf.update_handle(spec.handle)

    @property
    def outcomes_pending(self) -> int:
        """Fill outcomes (and lingering claims) this client has yet to remove."""
        with self._done_lock:
            return len(self._done_due)

    def flush(self) -> None:
        """Wait for this client's fills to be written to the cache, send the buffered access
        records and remove the fill outcomes that are due."""
        self._drain_publisher()
        if self._recorder is not None:
            self._recorder.flush()
        self._remove_done(everything=False)

    def close(self) -> None:
        """Flush, remove every pending fill outcome, close the job's client if it made it."""
        if self._closed:
            return
        self._closed = True
        self._held_stop.set()
        try:
            self._drain_publisher()
            with self._held_lock:
                unused = list(self._held.items())
                self._held.clear()
            if unused:
                # Claims taken ahead for fetches that will not happen now: readers waiting on
                # them go around and fill the keys themselves.
                self._release_claims(unused)
            if self._recorder is not None:
                self._recorder.flush()
            self._remove_done(everything=True)
        finally:
            with self._pool_lock:
                if self._pool is not None:
                    self._pool.shutdown(wait=True)
                    self._pool = None
                if self._publisher is not None:
                    self._publisher.shutdown(wait=True)
                    self._publisher = None
            if self._own_client:
                self._pf.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reads ---------------------------------------------------------------------------------

    def get(self, bucket: str, key: str) -> bytes:
        """The object's bytes. Raises :class:`~pocketflow.errors.S3ObjectNotFound` if S3 has no
        such key, other :class:`~pocketflow.errors.S3Error` kinds as S3 fails."""
        result = self.get_each(bucket, [key])[0]
        if isinstance(result, PocketflowError):
            raise result
        return result

    def get_many(self, bucket: str, keys: Iterable[str]) -> list[bytes]:
        """The bytes of many objects, in order; every key is read before the first error (in
        key order) is raised."""
        results = self.get_each(bucket, keys)
        for result in results:
            if isinstance(result, PocketflowError):
                raise result
        return results  # type: ignore[return-value]

    def get_each(self, bucket: str, keys: Iterable[str]) -> list[Result]:
        """Like :meth:`get_many`, but each key's own outcome: its bytes or its error."""
        return self._read(bucket, keys, want_data=True)

    def get_views(self, bucket: str, keys: Iterable[str]) -> list[memoryview]:
        """Like :meth:`get_many`, but each object as a read-only ``memoryview``. A cached entry
        on a server of this host that shares its DRAM arena (a local cluster's) is read in
        place: pinned in the server's memory, no copy, made present in this process before the
        call returns; the pin lasts while any view of it lives (:meth:`Client.pin_views`). The
        other entries of a round are read into one buffer, mapped with huge pages when it is
        2 MiB or more, which a fresh process faults in 2 MiB at a time instead of 4 KiB per
        ``bytes``; the buffer lives while any of its views does. Keep only what is needed."""
        results = self._read(bucket, keys, want_data=True, views=True)
        for result in results:
            if isinstance(result, PocketflowError):
                raise result
        return [r if isinstance(r, memoryview) else memoryview(r)  # type: ignore[arg-type]
                for r in results]

    def _read(self, bucket: str, keys: Iterable[str], *, want_data: bool,
              views: bool = False) -> list[Result]:
        key_list = list(keys)
        ckeys = [cache_key(bucket, k) for k in key_list]
        results: list[Result | None] = [None] * len(key_list)
        listed: list[str] = []
        for start in range(0, len(key_list), ROUND_KEYS_MAX):
            index = list(range(start, min(start + ROUND_KEYS_MAX, len(key_list))))
            self._read_round(bucket, key_list, ckeys, index, results, want_data=want_data,
                             views=views, listed=listed)
        if listed and want_data and LOOKAHEAD_KEYS > 0 and self.spec.lease_ms > 0:
            # After the reader has its bytes: its listing found its keys stale, so the keys
            # that follow them (other tasks' shares of the same inputs) likely are too. Not
            # after a prefetch: a prewarm goes on to the following keys itself.
            after = max(listed)
            self._later(lambda: self._renew_following(bucket, after))
        self._remove_done(everything=False)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def get_range(self, bucket: str, key: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of the object, cut at its end. A fresh entry is
        read in part; otherwise the whole object is read (and cached) first."""
        if offset < 0 or length < 0:
            raise InvalidRequest("offset and length must be >= 0")
        ckey = cache_key(bucket, key)
        meta = self._meta(ckey)
        if meta is not None and meta.state == STATE_VALUE and meta.fresh(_now_ms(),
                                                                         self.spec.lease_ms):
            try:
                data = self._pf.get_range(ENTRY_BUCKET, entry_key(ckey, meta.etag), offset,
                                          length)
            except ObjectNotFound:
                pass
            except PocketflowError as exc:
                log.debug("cache %s: range of %s bypassed: %s", self.spec.name, ckey, exc)
            else:
                self.stats.add(fresh=1, bytes_read=len(data))
                self._note(bucket, key, meta.size, meta.etag)
                return data
        return self.get(bucket, key)[offset:offset + length]

    def stat(self, bucket: str, key: str) -> tuple[str, int]:
        """The object's ETag and size: from its entry while the lease holds (no S3 request),
        else one HEAD request (the object is not fetched)."""
        ckey = cache_key(bucket, key)
        meta = self._meta_or_none(ckey)
        if meta is not None and meta.fresh(_now_ms(), self.spec.lease_ms):
            if meta.state == STATE_MISSING:
                raise self._missing(bucket, key, fresh=True)
            return meta.etag, meta.size
        return self._s3.head(bucket, key)

    def list(self, bucket: str, prefix: str = "") -> list[tuple[str, int]]:
        """Every ``(key, size)`` of the S3 bucket under ``prefix``, sorted, as S3 lists it now
        (listings are not cached)."""
        return self._s3.list_objects(bucket, prefix)

    def prefetch(self, bucket: str, keys: Sequence[str], *,
                 known: dict[str, Fetched] | None = None, known_ms: int = 0) -> int:
        """Make ``keys`` fresh in the cache (fill or revalidate them) without reading their
        cached bytes; returns how many of them S3 holds. Other readers of a key being fetched
        wait for this fetch instead of starting their own. ``known``: the current version of
        some of the keys, which S3 confirmed with a request sent at ``known_ms`` (unix ms): a
        key of them that needs a fill is filled with those bytes, dated ``known_ms``, without
        a GET (a prewarm's pack, :mod:`pocketflow.cache.pack`)."""
        ckeys_known = [cache_key(bucket, k) for k in known or ()]
        if known:
            with self._known_lock:
                for ckey, fetched in zip(ckeys_known, known.values(), strict=True):
                    self._known[ckey] = (fetched, known_ms)
        try:
            results = self._read(bucket, keys, want_data=False)
        finally:
            if ckeys_known:
                with self._known_lock:
                    for ckey in ckeys_known:
                        self._known.pop(ckey, None)
            # Claims held ahead for keys that needed no fill (hits), or that a failed read
            # left unfilled: released, so nobody waits on them until they lapse.
            unused = self._take_held([cache_key(bucket, k) for k in keys])
            if unused:
                self._release_claims(list(unused.items()))
        return sum(1 for r in results if not isinstance(r, PocketflowError))

    def claim_ahead(self, bucket: str, keys: Sequence[str]) -> int:
        """Claim ``keys`` for fills this client will make soon (a prewarm's next keys), so that
        readers of them wait for those fills instead of fetching the keys themselves. A later
        read or :meth:`prefetch` of a key by this client fills it under the claim held; the
        claims still held when the client closes are removed. While claims are held a thread
        of the client moves their deadlines on (:meth:`renew_held`, every quarter of
        ``claim_ms``; a fill's own download does every third), so a prewarm far behind its
        window is still waited for; if this process dies they lapse within ``claim_ms`` and
        waiters take them over. Returns how
        many keys were claimed (a key another process claimed, or past ``HELD_CLAIMS_MAX``
        held, is not)."""
        ckeys = list(dict.fromkeys(cache_key(bucket, k) for k in keys))
        with self._held_lock:
            ckeys = [c for c in ckeys if c not in self._held]
            ckeys = ckeys[:max(0, HELD_CLAIMS_MAX - len(self._held))]
        if not ckeys:
            return 0
        deadline_ms = _now_ms() + self.spec.claim_ms
        mine = {c: Claim(new_fill_id(), deadline_ms, self._owner) for c in ckeys}
        try:
            written, _ = self._put_all(CLAIM_BUCKET, [(c, mine[c].encode()) for c in ckeys],
                                       tolerate=ObjectExists)
            if written:
                won = ckeys
            else:
                held = self._pf.get_each(CLAIM_BUCKET, ckeys)
                won = [c for c, raw in zip(ckeys, held, strict=True)
                       if not isinstance(raw, PocketflowError) and _claim_id(raw)
                       == mine[c].fill_id]
        except PocketflowError as exc:
            log.info("cache %s: claiming ahead failed (%s)", self.spec.name, exc)
            return 0
        with self._held_lock:
            for c in won:
                self._held[c] = mine[c]
            start = bool(won) and (self._held_renewer is None
                                   or not self._held_renewer.is_alive())
            if start and not self._closed:
                self._held_renewer = threading.Thread(
                    target=self._renew_held_loop, daemon=True,
                    name=f"pocketflow-cache-claims-{self.spec.name}")
                self._held_renewer.start()
        return len(won)

    def _renew_held_loop(self) -> None:
        """Move the held claims on every quarter of ``claim_ms`` until none is held or the
        client closes."""
        period_s = self.spec.claim_ms / 4000
        while not self._held_stop.wait(period_s):
            with self._held_lock:
                if not self._held:
                    self._held_renewer = None
                    return
            self.renew_held()

    def renew_held(self) -> int:
        """Move on the deadlines of the claims held ahead that have less than two thirds of
        ``claim_ms`` left (and more than a sixth of it, at most ``HELD_CLAIM_MARGIN_MS``: one
        nearer its deadline may have been taken over, and its fill reads it back); returns how
        many were moved."""
        now_ms = _now_ms()
        claim_ms = self.spec.claim_ms
        margin_ms = min(HELD_CLAIM_MARGIN_MS, claim_ms // 6)
        # Under the lock, so that a claim a fill takes (and a publisher then removes) is never
        # written again after its removal.
        with self._held_lock:
            due = {c: claim for c, claim in self._held.items()
                   if margin_ms < claim.deadline_ms - now_ms < claim_ms * 2 // 3}
            if not due:
                return 0
            moved = {c: Claim(claim.fill_id, now_ms + claim_ms, claim.owner)
                     for c, claim in due.items()}
            try:
                self._put_all(CLAIM_BUCKET, [(c, m.encode()) for c, m in moved.items()],
                              overwrite=True)
            except PocketflowError as exc:
                log.info("cache %s: held claims not moved on (%s)", self.spec.name, exc)
                return 0
            self._held.update(moved)
        return len(moved)

    def _take_held(self, ckeys: list[str]) -> dict[str, Claim]:
        with self._held_lock:
            return {c: self._held.pop(c) for c in ckeys if c in self._held}

    # -- writes --------------------------------------------------------------------------------

    def put(self, bucket: str, key: str, data: bytes | bytearray | memoryview) -> str:
        """Write ``data`` to S3 and cache it as the key's current version; returns its ETag.

        If the cache cannot take it, the entry is dropped instead, so that no later read
        serves the version this write replaced. This client's fills still being written are
        written first (so none lands after this write)."""
        self._drain_publisher()
        ckey = cache_key(bucket, key)
        sent_ms = _now_ms()
        etag = self._s3.put(bucket, key, data)
        size = len(memoryview(data).cast("B"))
        old = self._meta_or_none(ckey)
        try:
            self._store_entry(ckey, etag, data)
            self._pf.put(META_BUCKET, ckey, Meta(STATE_VALUE, etag, size, sent_ms).encode(),
                         overwrite=True)
        except PocketflowError as exc:
            log.info("cache %s: %s not cached after a write (%s); entry dropped",
                     self.spec.name, ckey, exc)
            self._drop(ckey)
            return etag
        if old is not None and old.state == STATE_VALUE and old.etag != etag:
            self._delete_entry(ckey, old.etag)
        self._note(bucket, key, size, etag, read=False, filled=True)
        return etag

    def delete(self, bucket: str, key: str) -> None:
        """Delete the key in S3; the cache then holds that it is missing (after this client's
        fills still being written)."""
        self._drain_publisher()
        ckey = cache_key(bucket, key)
        sent_ms = _now_ms()
        self._s3.delete(bucket, key)
        old = self._meta_or_none(ckey)
        try:
            self._pf.put(META_BUCKET, ckey, Meta(STATE_MISSING, "", 0, sent_ms).encode(),
                         overwrite=True)
        except PocketflowError:
            self._drop(ckey)
        if old is not None and old.state == STATE_VALUE:
            self._delete_entry(ckey, old.etag)

    def invalidate(self, bucket: str, key: str) -> bool:
        """Drop the key's entry (the next read goes to S3), after this client's fills still
        being written; returns whether there was one."""
        self._drain_publisher()
        return self._drop(cache_key(bucket, key))

    def evict(self, entry: str) -> bool:
        """Remove the entry named ``entry`` (``<cache key>@<version digest>``, as listed in the
        entries bucket), and its key's meta if that still points at it (a reader then fills it
        again); returns whether the entry was there. The maintainer's eviction; an entry a
        newer version replaced, or a fill left behind, goes the same way."""
        ckey = entry.rpartition("@")[0]
        meta = self._meta_or_none(ckey)
        if meta is not None and meta.state == STATE_VALUE and entry_key(ckey, meta.etag) == entry:
            try:
                self._pf.delete(META_BUCKET, ckey)
            except PocketflowError:
                pass
        try:
            self._pf.delete(ENTRY_BUCKET, entry)
        except ObjectNotFound:
            return False
        return True

    # -- the read round ------------------------------------------------------------------------

    def _read_round(self, bucket: str, keys: list[str], ckeys: list[str], index: list[int],
                    results: list[Result | None], *, want_data: bool,
                    views: bool = False, listed: list[str] | None = None) -> None:
        pending = index
        for _attempt in range(READ_ATTEMPTS_MAX):
            if not pending:
                return
            pending = self._attempt(bucket, keys, ckeys, pending, results, want_data=want_data,
                                    views=views, listed=listed)
        for i in pending:
            results[i] = self._bypass(bucket, keys[i])

    def _attempt(self, bucket: str, keys: list[str], ckeys: list[str], pending: list[int],
                 results: list[Result | None], *, want_data: bool,
                 views: bool = False, listed: list[str] | None = None) -> list[int]:
        """One pass over ``pending`` keys; returns those that must go around again. Without
        ``want_data``, a hit's entry is only checked to exist (``results`` gets ``b""``).
        ``listed`` gets the last key of each listing that revalidated keys."""
        try:
            names = [ckeys[i] for i in pending]
            metas = (self._pf.get_each(META_BUCKET, names) if want_data
                     else self._metas_mostly_missing(names))
        except PocketflowError as exc:
            log.info("cache %s: reading S3 directly (%s)", self.spec.name, exc)
            for i in pending:
                results[i] = self._bypass(bucket, keys[i])
            return []
        now_ms = _now_ms()
        fresh: list[tuple[int, Meta]] = []
        stale: list[tuple[int, Meta]] = []
        misses: list[tuple[int, Meta | None]] = []
        for i, raw in zip(pending, metas, strict=True):
            if isinstance(raw, ObjectNotFound):
                misses.append((i, None))
                continue
            if isinstance(raw, PocketflowError):
                results[i] = self._bypass(bucket, keys[i])
                continue
            try:
                meta = Meta.decode(raw)
            except InvalidRequest:
                misses.append((i, None))
                continue
            if meta.fresh(now_ms, self.spec.lease_ms):
                fresh.append((i, meta))
            else:
                stale.append((i, meta))
        again: list[int] = []
        for i, meta in fresh:
            if meta.state == STATE_MISSING:
                results[i] = self._missing(bucket, keys[i], fresh=True)
        values = [(i, m) for i, m in fresh if m.state == STATE_VALUE]
        # An entry gone under a fresh meta (evicted meanwhile) is filled again.
        misses += self._read_entries(bucket, keys, ckeys, values, results, counter="fresh",
                                     want_data=want_data, views=views)
        if stale:
            # The entries of stale values are read while S3 is asked about them (most are
            # unchanged): the read costs the longer of the two, not their sum.
            early = None
            if want_data:
                values_stale = [(i, m) for i, m in stale if m.state == STATE_VALUE]
                names = [entry_key(ckeys[i], m.etag) for i, m in values_stale]
                if names:
                    early = (names, self._threads().submit(
                        self._entries, names, [m.size for _, m in values_stale], views=views))
            renewals: list[Future[None]] = []
            revalidated, more_misses = self._revalidate(bucket, keys, ckeys, stale, results,
                                                        renewals, listed)
            misses += self._read_entries(bucket, keys, ckeys, revalidated, results,
                                         counter="revalidated", want_data=want_data, views=views,
                                         early=_early_entries(early))
            misses += more_misses
            for renewal in renewals:
                renewal.result()
        if misses:
            again += self._fill(bucket, keys, ckeys, misses, results)
        return again

    def _entries(self, names: list[str], sizes: list[int], *, views: bool) -> list[Any]:
        """The entries ``names`` as ``get_each`` returns them; with ``views`` each a read-only
        ``memoryview`` of its ``sizes`` bytes: read in place from a server of this host that
        shares its DRAM arena (:meth:`Client.pin_views`, no copy), the others read into one
        buffer (:func:`_arena`). An entry of another size than its meta says is an
        :class:`InternalError`."""
        if not views:
            return self._pf.get_each(ENTRY_BUCKET, names)
        out: list[Any] = list(self._pf.pin_views(ENTRY_BUCKET, names))
        pinned = 0
        for name, size, view in zip(names, sizes, out, strict=True):
            if view is not None and len(view) != size:
                raise InternalError(f"cache {self.spec.name}: entry {name} is {len(view)} "
                                    f"bytes, not {size}")
            pinned += view is not None and isinstance(view.obj, _core.SharedView)
        if pinned:
            self.stats.add(pinned=pinned)
        rest = [i for i, view in enumerate(out) if view is None]
        if not rest:
            return out
        rest_sizes = [sizes[i] for i in rest]
        offsets = list(accumulate(rest_sizes, initial=0))
        arena = _arena(offsets[-1])
        outcomes = self._pf.get_many_into(ENTRY_BUCKET, [names[i] for i in rest], arena,
                                          offsets[:-1], rest_sizes)
        whole = memoryview(arena).toreadonly()
        for i, start, size, outcome in zip(rest, offsets[:-1], rest_sizes, outcomes,
                                           strict=True):
            if isinstance(outcome, InvalidRequest):
                raise InternalError(f"cache {self.spec.name}: entry {names[i]}: {outcome}")
            out[i] = whole[start:start + size] if outcome is None else outcome
        return out

    def _metas_mostly_missing(self, names: list[str]) -> list[Any]:
        """The ``meta`` records of ``names`` as ``get_each`` returns them, for a prefetch, whose
        keys are mostly not cached yet: one lookup of which exist (names only), then a read of
        those, so that a missing key costs no error object (a prewarm of a fresh cache spent
        a seventh of its Python time making them)."""
        absent = set(self._pf.wait_for(META_BUCKET, names, timeout_s=0))
        present = [n for n in names if n not in absent]
        read = dict(zip(present, self._pf.get_each(META_BUCKET, present) if present else [],
                        strict=True))
        return [read.get(n, _NOT_CACHED) for n in names]

    def _read_entries(self, bucket: str, keys: list[str], ckeys: list[str],
                      found: list[tuple[int, Meta]], results: list[Result | None], *,
                      counter: str, want_data: bool = True, views: bool = False,
                      early: dict[str, Any] | None = None) -> list[tuple[int, Meta]]:
        """Read the entries ``found`` point at (without ``want_data``, only look them up);
        returns those whose entry went away (evicted or replaced since their meta was read).
        ``early``: entries read already, by name (one not there is read now)."""
        if not found:
            return []
        names = [entry_key(ckeys[i], m.etag) for i, m in found]
        try:
            if want_data and early:
                rest = [(name, m.size) for name, (_, m) in zip(names, found, strict=True)
                        if name not in early]
                read = dict(zip([n for n, _ in rest],
                                self._entries([n for n, _ in rest], [z for _, z in rest],
                                              views=views) if rest else [], strict=True))
                datas: list[Any] = [early[n] if n in early else read[n] for n in names]
            elif want_data:
                datas = self._entries(names, [m.size for _, m in found], views=views)
            else:
                absent = set(self._pf.wait_for(ENTRY_BUCKET, names, timeout_s=0))
                datas = [ObjectNotFound(name) if name in absent else None for name in names]
        except PocketflowError as exc:
            log.info("cache %s: reading S3 directly (%s)", self.spec.name, exc)
            for i, _ in found:
                results[i] = self._bypass(bucket, keys[i])
            return []
        gone: list[tuple[int, Meta]] = []
        served = 0
        for (i, meta), data in zip(found, datas, strict=True):
            if isinstance(data, ObjectNotFound):
                gone.append((i, meta))
                continue
            if data is None:
                results[i] = b""
                self._note(bucket, keys[i], meta.size, meta.etag)
                continue
            if isinstance(data, PocketflowError):
                results[i] = self._bypass(bucket, keys[i])
                continue
            if len(data) != meta.size:
                raise InternalError(
                    f"cache {self.spec.name}: entry of {ckeys[i]} holds {len(data)} bytes, its "
                    f"meta says {meta.size}"
                )
            results[i] = data
            served += len(data)
            self._note(bucket, keys[i], meta.size, meta.etag)
        self.stats.add(bytes_read=served, **{counter: len(found) - len(gone)})
        return gone

    # -- revalidation --------------------------------------------------------------------------

    def _revalidate(self, bucket: str, keys: list[str], ckeys: list[str],
                    stale: list[tuple[int, Meta]], results: list[Result | None],
                    renewals: list[Future[None]], listed_last: list[str] | None = None,
                    ) -> tuple[list[tuple[int, Meta]], list[tuple[int, Meta | None]]]:
        """Ask S3 about stale entries. Returns the unchanged ones (their meta being renewed:
        the write is added to ``renewals``) and the misses; changed keys whose new bytes came
        back are refilled and their results set."""
        sent_ms = _now_ms()
        unchanged: list[tuple[int, Meta]] = []
        misses: list[tuple[int, Meta | None]] = []
        gone: list[tuple[int, Meta]] = []
        by_get = stale
        if len(stale) >= LIST_REVALIDATE_MIN:
            try:
                listed = self._s3.list_keys(bucket, [keys[i] for i, _ in stale])
            except S3Error as exc:
                log.info("cache %s: listing to revalidate failed (%s); asking per key",
                         self.spec.name, exc)
            else:
                self.stats.add(listings=1, listed_keys=listed.listed)
                if listed_last is not None:
                    listed_last.append(max(keys[i] for i, _ in stale))
                by_get = []
                for i, meta in stale:
                    seen = listed.found.get(keys[i])
                    if seen is not None:
                        etag, size = seen
                        if meta.state == STATE_VALUE and etag == meta.etag and size == meta.size:
                            unchanged.append((i, meta))
                        else:
                            misses.append((i, meta))
                    elif keys[i] in listed.absent:
                        gone.append((i, meta))
                    else:
                        by_get.append((i, meta))
        if by_get:
            answers = self._s3_each(
                bucket, [(keys[i], meta.etag if meta.state == STATE_VALUE else None)
                 for i, meta in by_get])
            self.stats.add(validations=len(by_get))
            refills: list[tuple[int, Meta, Fetched]] = []
            for (i, meta), answer in zip(by_get, answers, strict=True):
                if answer is NOT_MODIFIED:
                    unchanged.append((i, meta))
                elif isinstance(answer, S3ObjectNotFound):
                    gone.append((i, meta))
                elif isinstance(answer, PocketflowError):
                    results[i] = answer
                else:
                    refills.append((i, meta, answer))
            self._refill(bucket, keys, ckeys, refills, sent_ms, results)
        if gone:
            self._mark_missing(ckeys, gone, sent_ms)
            for i, _ in gone:
                results[i] = self._missing(bucket, keys[i], fresh=False)
        if unchanged:
            renewed = [(i, Meta(m.state, m.etag, m.size, sent_ms)) for i, m in unchanged]
            replacing = [(ckeys[i], old, new) for (i, old), (_, new)
                         in zip(unchanged, renewed, strict=True)]

            def renew() -> None:
                try:
                    self._renew_unchanged(replacing)
                except PocketflowError as exc:
                    log.debug("cache %s: renewing validations failed: %s", self.spec.name, exc)

            # While the entries are read: the read needs S3's answer, not its record (the
            # round waits for it before it returns, so this client's next read finds it).
            renewals.append(self._threads().submit(renew))
            missing_now = [(i, m) for i, m in renewed if m.state == STATE_MISSING]
            for i, _ in missing_now:
                results[i] = self._missing(bucket, keys[i], fresh=False)
            unchanged = [(i, m) for i, m in renewed if m.state == STATE_VALUE]
        if len(stale) >= LIST_REVALIDATE_MIN:
            # A listing validated them all at once; count each key's share as one validation.
            self.stats.add(validations=len(stale) - len(by_get))
        return unchanged, misses

    def _renew_unchanged(self, replacing: list[tuple[str, Meta, Meta]]) -> int:
        """Write each ``(ckey, old, new)``'s ``new`` meta where the record still holds ``old``
        (the meta the round read before asking S3); returns how many. Re-read right before the
        write: a meta written meanwhile (another task's refill with a newer ETag, or its
        renewal) is left as it is, not reverted to the version S3 held when this round asked.
        The store has no compare-and-swap put, so a write landing between this re-read and
        the put (one round trip) can still be overwritten."""
        current = self._pf.get_each(META_BUCKET, [ckey for ckey, _, _ in replacing])
        records = [(ckey, new.encode()) for (ckey, old, new), raw
                   in zip(replacing, current, strict=True) if Meta.of_reply(raw) == old]
        if records:
            self._put_all(META_BUCKET, records, overwrite=True)
        return len(records)

    def _renew_following(self, bucket: str, after: str) -> None:
        """Renew the validation of the cached keys that follow ``after`` in S3's order (within
        its "directory", the prefix up to its last ``/``): one ListObjectsV2 page of up to
        ``LOOKAHEAD_KEYS`` keys, then the metas of those keys the cache holds with the ETag and
        size the page lists get the page's time as their ``validated_ms``, as a listing that
        revalidated them for a read would (the same bound: S3 held that version when the page
        was asked for). So the tasks of a run that read the inputs after this reader's find
        them fresh instead of each listing its own share. Best effort, off the reader's path:
        a failure leaves the metas as they were."""
        sent_ms = _now_ms()
        try:
            following = self._s3.list_after(bucket, after, LOOKAHEAD_KEYS)
        except S3Error as exc:
            log.info("cache %s: listing ahead failed (%s)", self.spec.name, exc)
            return
        self.stats.add(listings=1, listed_keys=len(following))
        try:
            self._renew_listed(bucket, following, sent_ms)
        except PocketflowError as exc:
            log.info("cache %s: renewing the keys after %s failed (%s)", self.spec.name, after,
                     exc)

    def renew(self, bucket: str, keys: Sequence[str],
              stop: threading.Event | None = None) -> int:
        """Revalidate the cached ``keys`` ahead of their reads: ListObjectsV2 pages over them
        (:meth:`S3Store.list_keys`, ``LIST_PAGE_KEYS`` keys at a time, in S3's order), then the
        metas of those the cache holds with the ETag and size a page lists get that page's send
        time as their ``validated_ms``, as a read's revalidation would (the staleness bound is
        a listing's). A run's driver does this for the last run's working set when it opens
        the cache (:func:`~pocketflow.cache.open_cache`), while the run's first tasks start,
        so that they find their keys fresh instead of each waiting on a listing. Keys changed,
        deleted or not cached are left as they are (their readers revalidate or fill them).
        Nothing is renewed with a lease of 0. Best effort: an S3 or cache error ends it, with
        what it renewed so far; ``stop`` set ends it between pages. Returns the metas
        renewed."""
        if self.spec.lease_ms <= 0:
            return 0
        ordered = sorted(set(keys))
        renewed = 0
        for start in range(0, len(ordered), LIST_PAGE_KEYS):
            if stop is not None and stop.is_set():
                break
            chunk = ordered[start:start + LIST_PAGE_KEYS]
            sent_ms = _now_ms()
            try:
                listed = self._s3.list_keys(bucket, chunk)
                self.stats.add(listings=1, listed_keys=listed.listed)
                renewed += self._renew_listed(
                    bucket, [(k, *listed.found[k]) for k in chunk if k in listed.found], sent_ms)
            except PocketflowError as exc:  # S3Error among them
                log.info("cache %s: revalidating ahead failed (%s)", self.spec.name, exc)
                break
        return renewed

    def _renew_listed(self, bucket: str, listed: list[tuple[str, str, int]],
                      sent_ms: int) -> int:
        """Give the cached keys of ``listed`` (``(key, etag, size)`` from a listing sent at
        ``sent_ms``) whose meta holds that ETag and size, and is older, ``sent_ms`` as their
        ``validated_ms``; returns how many. The metas are read after the listing, right
        before the write: one refilled with a newer ETag by then differs from the listing and
        is left. As in :meth:`_renew_unchanged`, a refill landing between that read and the
        write (one round trip) can still be overwritten (no compare-and-swap put)."""
        if not listed:
            return 0
        ckeys = [cache_key(bucket, key) for key, _, _ in listed]
        metas = self._metas_mostly_missing(ckeys)
        records: list[tuple[str, bytes]] = []
        for ckey, (_, etag, size), raw in zip(ckeys, listed, metas, strict=True):
            meta = Meta.of_reply(raw)
            if (meta is not None and meta.state == STATE_VALUE and meta.etag == etag
                    and meta.size == size and meta.validated_ms < sent_ms):
                records.append((ckey, Meta(STATE_VALUE, etag, size, sent_ms).encode()))
        if records:
            self._put_all(META_BUCKET, records, overwrite=True)
        self.stats.add(renewed_ahead=len(records))
        return len(records)

    def _refill(self, bucket: str, keys: list[str], ckeys: list[str],
                refills: list[tuple[int, Meta, Fetched]], sent_ms: int,
                results: list[Result | None]) -> None:
        """Cache changed objects whose new bytes a conditional GET returned."""
        for i, old, fetched in refills:
            results[i] = fetched.data
            try:
                self._store_entry(ckeys[i], fetched.etag, fetched.data)
                self._pf.put(META_BUCKET, ckeys[i],
                             Meta(STATE_VALUE, fetched.etag, fetched.size, sent_ms).encode(),
                             overwrite=True)
            except PocketflowError as exc:
                log.info("cache %s: %s not refilled (%s)", self.spec.name, ckeys[i], exc)
                self._drop(ckeys[i])
                self.stats.add(bypassed=1, bytes_read=fetched.size)
                continue
            if old.state == STATE_VALUE and old.etag != fetched.etag:
                self._delete_entry(ckeys[i], old.etag)
            self.stats.add(filled=1, bytes_read=fetched.size)
            self._note(bucket, keys[i], fetched.size, fetched.etag, filled=True)

    def _mark_missing(self, ckeys: list[str], gone: list[tuple[int, Meta]],
                      sent_ms: int) -> None:
        try:
            self._put_all(META_BUCKET, [(ckeys[i], Meta(STATE_MISSING, "", 0, sent_ms).encode())
                                        for i, _ in gone], overwrite=True)
        except PocketflowError as exc:
            log.debug("cache %s: marking keys missing failed: %s", self.spec.name, exc)
            for i, _ in gone:
                self._drop(ckeys[i])
        for i, meta in gone:
            if meta.state == STATE_VALUE:
                self._delete_entry(ckeys[i], meta.etag)

    # -- fills (single flight) -----------------------------------------------------------------

    def _fill(self, bucket: str, keys: list[str], ckeys: list[str],
              misses: list[tuple[int, Meta | None]], results: list[Result | None]) -> list[int]:
        """Fill ``misses`` under claims; returns the keys that must go around again."""
        now_ms = _now_ms()
        deadline_ms = now_ms + self.spec.claim_ms
        held = self._take_held([ckeys[i] for i, _ in misses])
        mine = {i: held.get(ckeys[i]) or Claim(new_fill_id(), deadline_ms, self._owner)
                for i, _ in misses}
        try:
            written, calls = self._put_all(
                CLAIM_BUCKET, [(ckeys[i], mine[i].encode()) for i, _ in misses
                               if ckeys[i] not in held],
                tolerate=ObjectExists)
            self.stats.add(fill_round_trips=calls)
            # A claim held ahead whose deadline is near may have been taken over: read back.
            written = written and all(c.deadline_ms - HELD_CLAIM_MARGIN_MS > now_ms
                                      for c in held.values())
            if written:
                # Every claim is ours: no rival's to read back (the common, uncontended case).
                current: list[Any] = [mine[i].encode() for i, _ in misses]
            else:
                current = self._pf.get_each(CLAIM_BUCKET, [ckeys[i] for i, _ in misses])
                self.stats.add(fill_round_trips=1)
        except PocketflowError as exc:
            log.info("cache %s: claims failed (%s); reading S3 directly", self.spec.name, exc)
            # No room for the claims is no room for the fills: counted as refused fills.
            refused = isinstance(exc, CapacityExhausted)
            for i, _ in misses:
                results[i] = self._bypass(bucket, keys[i], refused=refused)
            return []
        won: list[tuple[int, Meta | None, Claim]] = []
        waiting: list[tuple[int, Claim]] = []
        again: list[int] = []
        for (i, old), raw in zip(misses, current, strict=True):
            if isinstance(raw, ObjectNotFound):
                again.append(i)  # another fill ended between our claim and the read: look again
                continue
            if isinstance(raw, PocketflowError):
                results[i] = self._bypass(bucket, keys[i])
                continue
            try:
                claim = Claim.decode(raw)
            except InvalidRequest:
                results[i] = self._bypass(bucket, keys[i])
                continue
            if claim.fill_id == mine[i].fill_id:
                won.append((i, old, claim))
            else:
                waiting.append((i, claim))
        if won:
            self._fetch_and_fill(bucket, keys, ckeys, won, results)
        if waiting:
            again += self._wait_fills(bucket, keys, ckeys, waiting, results)
        return again

    def _fetch_and_fill(self, bucket: str, keys: list[str], ckeys: list[str],
                        won: list[tuple[int, Meta | None, Claim]],
                        results: list[Result | None]) -> None:
        """Fetch the keys whose claims this client won; their results are set as soon as S3
        answered, and the fill is handed to the publisher thread (:meth:`_publish`) in pieces
        of at most ``PUBLISH_PIECE_BYTES`` / ``PUBLISH_PIECE_KEYS`` as their answers come (in
        order), so that writing the first keys to the cache overlaps fetching the others.
        Keys whose bytes a prefetch was given (``known``) are filled with them first."""
        if self._known:
            with self._known_lock:
                known = {i: self._known.pop(ckeys[i]) for i, _, _ in won
                         if ckeys[i] in self._known}
            if known:
                self._fill_known(bucket, keys, ckeys,
                                 [w for w in won if w[0] in known], known, results)
                won = [w for w in won if w[0] not in known]
                if not won:
                    return
        sent_ms = _now_ms()
        fetched = self._s3_iter(bucket, [(keys[i], None) for i, _, _ in won],
                                renew=[(ckeys[i], claim) for i, _, claim in won])
        fill: list[tuple[int, str, str, Meta | None, Claim, Any]] = []
        held_bytes = 0
        for (i, old, claim), answer in zip(won, fetched, strict=True):
            if fill and (held_bytes >= PUBLISH_PIECE_BYTES or len(fill) >= PUBLISH_PIECE_KEYS):
                self._publish_later(bucket, fill, sent_ms, held_bytes)
                fill, held_bytes = [], 0
            if isinstance(answer, S3ObjectNotFound):
                results[i] = answer
                self.stats.add(missing=1)
            elif isinstance(answer, S3Error):
                results[i] = answer
            else:
                assert isinstance(answer, Fetched)
                results[i] = answer.data
                held_bytes += answer.size
                self.stats.add(filled=1, bytes_read=answer.size)
            fill.append((i, keys[i], ckeys[i], old, claim, answer))
        self._publish_later(bucket, fill, sent_ms, held_bytes)

    def _fill_known(self, bucket: str, keys: list[str], ckeys: list[str],
                    won: list[tuple[int, Meta | None, Claim]],
                    known: dict[int, tuple[Fetched, int]],
                    results: list[Result | None]) -> None:
        """Fill the claimed keys ``won`` with the bytes ``known`` of them, each dated when S3
        confirmed it, in pieces as :meth:`_fetch_and_fill` does."""
        by_ms: dict[int, list[tuple[int, Meta | None, Claim]]] = {}
        for w in won:
            by_ms.setdefault(known[w[0]][1], []).append(w)
        for sent_ms, group in by_ms.items():
            fill: list[tuple[int, str, str, Meta | None, Claim, Any]] = []
            held_bytes = 0
            for i, old, claim in group:
                if fill and (held_bytes >= PUBLISH_PIECE_BYTES
                             or len(fill) >= PUBLISH_PIECE_KEYS):
                    self._publish_later(bucket, fill, sent_ms, held_bytes)
                    fill, held_bytes = [], 0
                answer = known[i][0]
                results[i] = answer.data
                held_bytes += answer.size
                self.stats.add(filled=1, packed=1, bytes_read=answer.size)
                fill.append((i, keys[i], ckeys[i], old, claim, answer))
            self._publish_later(bucket, fill, sent_ms, held_bytes)

    # -- publishing fills (the publisher thread) -------------------------------------------------

    def _publish_later(self, bucket: str, fill: list[Any], sent_ms: int, held_bytes: int) -> None:
        """Queue ``fill`` for the publisher thread, within ``PUBLISH_PENDING_BYTES_MAX``."""
        self._later(lambda: self._publish(bucket, fill, sent_ms), held_bytes)

    def _later(self, work: Callable[[], None], held_bytes: int = 0) -> None:
        """Run ``work`` (writes to the cache that no reader of this client waits for) on the
        publisher thread, in the order queued; ``held_bytes`` it holds count against
        ``PUBLISH_PENDING_BYTES_MAX``."""
        with self._pending:
            while self._pending_fills and (self._pending_bytes + held_bytes
                                           > PUBLISH_PENDING_BYTES_MAX):
                self._pending.wait()
            self._pending_bytes += held_bytes
            self._pending_fills += 1
        with self._pool_lock:
            if self._publisher is None:
                self._publisher = ThreadPoolExecutor(1, thread_name_prefix="cache-publish")
            publisher = self._publisher

        def run() -> None:
            try:
                work()
            except Exception as exc:  # noqa: BLE001 - claims lapse and are taken over; logged
                log.warning("cache %s: publishing a fill failed: %s", self.spec.name, exc)
            finally:
                with self._pending:
                    self._pending_bytes -= held_bytes
                    self._pending_fills -= 1
                    self._pending.notify_all()

        publisher.submit(run)

    def _drain_publisher(self) -> None:
        """Wait until every queued fill is published."""
        with self._pending:
            while self._pending_fills:
                self._pending.wait()

    def _publish(self, bucket: str, fill: list[Any], sent_ms: int) -> None:
        """Write a fill to the cache: its entries, then their ``meta``, then each key's outcome
        for the waiters, then remove its claims."""
        values = [(i, ckey, answer) for i, _key, ckey, _old, _claim, answer in fill
                  if isinstance(answer, Fetched)]
        stored = self._store_entries([(entry_key(ckey, a.etag), a.data)
                                      for _, ckey, a in values])
        outcomes: dict[int, Outcome] = {}
        metas: list[tuple[str, bytes]] = []
        refused: set[int] = set()  # fills the cache's storage had no room for
        for (i, ckey, answer), status in zip(values, stored, strict=True):
            if status == _REFUSED:
                refused.add(i)
            if status == _STORED:
                metas.append((ckey, Meta(STATE_VALUE, answer.etag, answer.size,
                                         sent_ms).encode()))
                outcomes[i] = Outcome(STATE_VALUE, answer.etag, answer.size)
            else:
                outcomes[i] = Outcome(STATE_UNCACHED, answer.etag, answer.size)
        for i, _key, ckey, _old, _claim, answer in fill:
            if isinstance(answer, S3ObjectNotFound):
                outcomes[i] = Outcome(STATE_MISSING)
                metas.append((ckey, Meta(STATE_MISSING, "", 0, sent_ms).encode()))
            elif isinstance(answer, S3Error):
                outcomes[i] = Outcome(STATE_ERROR, code=answer.code, status=answer.status,
                                      message=answer.detail)
        try:
            self._put_all(META_BUCKET, metas, overwrite=True)
        except PocketflowError as exc:
            log.info("cache %s: writing entries' meta failed (%s)", self.spec.name, exc)
            for i, _key, ckey, _old, _claim, _answer in fill:
                outcome = outcomes[i]
                if outcome.state == STATE_VALUE:
                    if isinstance(exc, CapacityExhausted):
                        refused.add(i)
                    outcomes[i] = Outcome(STATE_UNCACHED, outcome.etag, outcome.size)
                    self._delete_entry(ckey, outcome.etag)
        self._finish_fills([(ckey, claim, outcomes[i])
                            for i, _key, ckey, _old, claim, _answer in fill])
        uncached = 0
        for i, key, ckey, old, _claim, _answer in fill:
            outcome = outcomes[i]
            if outcome.state == STATE_VALUE:
                if old is not None and old.state == STATE_VALUE and old.etag != outcome.etag:
                    self._delete_entry(ckey, old.etag)
                self._note(bucket, key, outcome.size, outcome.etag, filled=True)
            elif outcome.state == STATE_UNCACHED:
                uncached += 1
                if i in refused:
                    # The read happened (from S3): the key is in the run's working set, and
                    # the refusal tells the maintainer the cache is short.
                    self._note(bucket, key, outcome.size, outcome.etag, refused=True)
            elif outcome.state == STATE_MISSING:
                if old is not None and old.state == STATE_VALUE:
                    self._delete_entry(ckey, old.etag)
        # Counted as filled when S3 answered; those the cache could not take were bypassed.
        self.stats.add(filled=-uncached, bypassed=uncached, refused=len(refused))

    def _store_entries(self, items: list[tuple[str, Any]]) -> list[str]:
        """Write entries, pipelined in chunks; for each, ``_STORED``, ``_REFUSED`` (the
        storage had no room: ``CapacityExhausted``) or ``_FAILED`` (a chunk that failed is
        written again one entry at a time, so one entry's error costs only that entry)."""
        stored: list[str] = []
        for chunk in _chunks(items, lambda item: len(memoryview(item[1]).cast("B"))):
            try:
                self._pf.put_many(ENTRY_BUCKET, chunk)
                stored += [_STORED] * len(chunk)
                continue
            except PocketflowError as exc:
                log.debug("cache %s: entries written one by one (%s)", self.spec.name, exc)
            for name, data in chunk:
                try:
                    self._store_entry_named(name, data)
                    stored.append(_STORED)
                except CapacityExhausted as exc:
                    log.info("cache %s: no room for %s (%s)", self.spec.name, name, exc)
                    stored.append(_REFUSED)
                except PocketflowError as exc:
                    log.info("cache %s: %s not stored (%s)", self.spec.name, name, exc)
                    stored.append(_FAILED)
        return stored

    def _store_entry(self, ckey: str, etag: str, data: Any) -> None:
        self._store_entry_named(entry_key(ckey, etag), data)

    def _store_entry_named(self, name: str, data: Any) -> None:
        try:
            self._pf.put(ENTRY_BUCKET, name, data)
        except ObjectExists:
            pass  # the same version, written by another process

    def _finish_fills(self, fills: list[tuple[str, Claim, Outcome]]) -> None:
        """Publish each fill's outcome, then remove its claim (only if it is still ours)."""
        try:
            self._put_all(DONE_BUCKET, [(done_key(ckey, c.fill_id), outcome.encode())
                                        for ckey, c, outcome in fills], tolerate=ObjectExists)
        except PocketflowError as exc:
            log.info("cache %s: fill outcomes not written (%s)", self.spec.name, exc)
        if not self._linger_claims:
            self._release_claims([(ckey, c) for ckey, c, _ in fills])
        due = time.monotonic() + DONE_LINGER_S
        with self._done_lock:
            for ckey, c, _ in fills:
                self._done_due.append((due, done_key(ckey, c.fill_id),
                                       (ckey, c) if self._linger_claims else None))

    def _release_claims(self, claims: list[tuple[str, Claim]]) -> None:
        try:
            taken = self._pf.get_each(CLAIM_BUCKET, [ckey for ckey, _ in claims], delete=True)
        except PocketflowError as exc:
            log.info("cache %s: claims not removed (%s)", self.spec.name, exc)
            return
        for (ckey, claim), raw in zip(claims, taken, strict=True):
            if isinstance(raw, PocketflowError):
                continue
            try:
                found = Claim.decode(raw)
            except InvalidRequest:
                continue
            if found.fill_id != claim.fill_id:
                # Someone else's claim (ours was taken over and a new fill began): put it back.
                try:
                    self._pf.put(CLAIM_BUCKET, ckey, raw)
                except PocketflowError:
                    pass

    def _wait_fills(self, bucket: str, keys: list[str], ckeys: list[str],
                    waiting: list[tuple[int, Claim]], results: list[Result | None]) -> list[int]:
        """Wait for other processes' fills; returns keys to look at again."""
        give_up_s = time.monotonic() + self.spec.fill_wait_s
        claims = dict(waiting)  # in the order read
        waited_on = dict(waiting)
        again: list[int] = []
        while claims:
            # The first ``WAIT_HEAD_KEYS`` claims still waited on, in the order read (a prewarm
            # fills in that order): their entries are read as soon as they all landed, while
            # the later ones are still being fetched, so that once the last fill lands only its
            # head is left to read.
            head = dict(islice(claims.items(), WAIT_HEAD_KEYS))
            done = {i: done_key(ckeys[i], c.fill_id) for i, c in head.items()}
            left_s = give_up_s - time.monotonic()
            # Claims all lapsed already (their owners died long ago): look, do not wait.
            lapsed = all(c.deadline_ms < _now_ms() for c in head.values())
            try:
                if left_s > 0 and not lapsed:
                    self.stats.add(wait_slices=1)
                    self._pf.wait_for(DONE_BUCKET, list(done.values()),
                                      timeout_s=min(WAIT_SLICE_S, left_s))
                outcomes = self._pf.get_each(DONE_BUCKET, list(done.values()))
            except PocketflowError as exc:
                log.info("cache %s: waiting for fills failed (%s)", self.spec.name, exc)
                for i in claims:
                    results[i] = self._bypass(bucket, keys[i])
                return again
            finished: list[tuple[int, Outcome]] = []
            for i, raw in zip(list(done), outcomes, strict=True):
                if isinstance(raw, PocketflowError):
                    continue
                try:
                    finished.append((i, Outcome.decode(raw)))
                except InvalidRequest:
                    results[i] = self._bypass(bucket, keys[i])
                    claims.pop(i)
            values: list[tuple[int, Meta]] = []
            for i, outcome in finished:
                claims.pop(i)
                if outcome.state == STATE_VALUE:
                    values.append((i, Meta(STATE_VALUE, outcome.etag, outcome.size, 0)))
                elif outcome.state == STATE_MISSING:
                    results[i] = self._missing(bucket, keys[i], fresh=True)
                elif outcome.state == STATE_ERROR:
                    results[i] = s3_error(outcome.code, outcome.status, outcome.message,
                                          bucket=bucket, key=keys[i])
                else:
                    results[i] = self._bypass(bucket, keys[i])
            # A waited-for entry gone already (replaced or evicted): look again.
            gone = [i for i, _ in self._read_entries(bucket, keys, ckeys, values, results,
                                                     counter="waited")]
            # A lingering claim past its deadline whose fill's entry is gone (its owner died
            # before removing it) would send every reader of the key round again to the same
            # outcome: remove it, so that the next round fills the key afresh.
            now_ms = _now_ms()
            lapsed_fills = [(ckeys[i], waited_on[i]) for i in gone
                            if waited_on[i].deadline_ms < now_ms]
            if lapsed_fills:
                self._release_claims(lapsed_fills)
            again += gone
            if not claims:
                break
            if time.monotonic() >= give_up_s:
                for i in claims:
                    results[i] = self._bypass(bucket, keys[i])
                break
            if any(i in claims for i in head):
                # The head did not all land within the slice: look at every claim still
                # waited on (a lapsed or replaced one, wherever it is).
                again += self._recheck_claims(ckeys, claims)
        return again

    def _recheck_claims(self, ckeys: list[str], claims: dict[int, Claim]) -> list[int]:
        """Look at the claims still waited on after a slice: a claim that is gone or belongs
        to a new fill sends its key around again (its entry may be fresh now, or the new fill
        is waited on); one whose deadline passed with no outcome (its owner died or hangs) is
        taken over: the one waiter whose write-once steal marker lands removes it, and every
        waiter goes around to claim the key afresh. A claim whose owner moved the deadline on
        is waited on again. Changes ``claims``; returns the keys to go around."""
        order = list(claims)
        try:
            current = self._pf.get_each(CLAIM_BUCKET, [ckeys[i] for i in order])
        except PocketflowError:
            return []
        now_ms = _now_ms()
        again = []
        for i, raw in zip(order, current, strict=True):
            old = claims[i]
            if isinstance(raw, PocketflowError):
                if isinstance(raw, ObjectNotFound):
                    claims.pop(i)
                    again.append(i)
                continue
            try:
                claim = Claim.decode(raw)
            except InvalidRequest:
                continue
            if claim.fill_id != old.fill_id:
                claims.pop(i)
                again.append(i)
                continue
            claims[i] = claim
            if claim.deadline_ms >= now_ms:
                continue
            claims.pop(i)
            again.append(i)
            marker = steal_key(ckeys[i], old.fill_id)
            try:
                self._pf.put(CLAIM_BUCKET, marker, b"1")
            except PocketflowError:
                continue  # another waiter takes it over (or the cache failed): look again
            log.warning("cache %s: fill %s of %s by %s lapsed; taking it over",
                        self.spec.name, old.fill_id, ckeys[i], old.owner)
            self.stats.add(steals=1)
            try:
                taken = self._pf.get(CLAIM_BUCKET, ckeys[i], delete=True)
                if Claim.decode(taken).fill_id != old.fill_id:
                    self._pf.put(CLAIM_BUCKET, ckeys[i], taken)  # a new fill's: put it back
            except (PocketflowError, InvalidRequest):
                pass
            try:
                self._pf.delete(CLAIM_BUCKET, marker)
            except PocketflowError:
                pass
        return again

    # -- helpers -------------------------------------------------------------------------------

    def _s3_each(self, bucket: str, asks: list[tuple[str, str | None]], *,
                 renew: list[tuple[str, Claim]] | None = None,
                 ) -> list[Fetched | Any | PocketflowError]:
        """GET each ``(key, if_none_match)`` of ``bucket``, at most ``S3_PARALLEL_MAX`` at
        once (a claim in ``renew`` is moved on during its download); each answer (or
        :data:`NOT_MODIFIED`) or its error, in order."""
        return list(self._s3_iter(bucket, asks, renew=renew))

    def _s3_iter(self, bucket: str, asks: list[tuple[str, str | None]], *,
                 renew: list[tuple[str, Claim]] | None = None,
                 ) -> Iterator[Fetched | Any | PocketflowError]:
        """:meth:`_s3_each`'s answers as they come, in order (every request is sent at once,
        ``S3_PARALLEL_MAX`` in flight)."""
        renewals = renew or [None] * len(asks)  # type: ignore[list-item]

        def one(j: int) -> Any:
            key, etag = asks[j]
            claim = renewals[j]
            try:
                answer = self._s3.get(bucket, key, if_none_match=etag,
                                      on_progress=self._renewer(claim) if claim else None)
            except S3Error as exc:
                return exc
            return answer

        if len(asks) == 1:
            return iter([one(0)])
        return self._in_lanes(one, len(asks))

    def _in_lanes(self, one: Callable[[int], Any], count: int) -> Iterator[Any]:
        """``one(0) .. one(count - 1)`` on at most ``s3_parallel`` pool threads, each a *lane*
        that takes the next index until none is left; their answers in order, each as soon as
        it and those before it are in. One future per lane, not per request: a prewarm of small
        objects spent a sixth of its Python time making a future (and its lock) per GET."""
        answers: list[Any] = [None] * count
        landed = [False] * count
        ready = threading.Condition()
        next_index = iter(range(count))  # next() on a range iterator is atomic under the GIL
        # The answer the reader is blocked on (-1: it is not blocked). A lane wakes the reader
        # only when it lands that one: woken for every answer, the reader took the GIL once
        # per GET, mostly for answers it was not waiting for yet (a fifth of a small-object
        # prewarm's GIL-holding samples were those wake-ups).
        blocked_on = [-1]

        def lane() -> None:
            try:
                for j in iter(lambda: next(next_index, None), None):
                    answer = one(j)
                    with ready:
                        answers[j] = answer
                        landed[j] = True
                        if blocked_on[0] == j:
                            ready.notify()
            finally:
                with ready:
                    ready.notify()  # a lane that ended (or failed) wakes the reader to look

        pool = self._threads()
        lanes = [pool.submit(lane) for _ in range(min(count, self._s3_parallel))]

        def ordered() -> Iterator[Any]:
            for j in range(count):
                with ready:
                    while not landed[j]:
                        failed = next((f for f in lanes if f.done() and f.exception()), None)
                        if failed is not None:
                            raise failed.exception()  # type: ignore[misc]
                        blocked_on[0] = j
                        ready.wait(LANE_WAIT_SLICE_S)
                        blocked_on[0] = -1
                    answer, answers[j] = answers[j], None
                yield answer

        return ordered()

    def _renewer(self, claim: tuple[str, Claim]) -> Callable[[], None]:
        """Moves a claim's deadline on every third of the claim time during a long download."""
        ckey, original = claim
        claim_ms = self.spec.claim_ms
        state = {"renewed_s": time.monotonic()}

        def renew() -> None:
            if time.monotonic() - state["renewed_s"] < claim_ms / 3000:
                return
            state["renewed_s"] = time.monotonic()
            moved = Claim(original.fill_id, _now_ms() + claim_ms, original.owner)
            try:
                self._pf.put(CLAIM_BUCKET, ckey, moved.encode(), overwrite=True)
            except PocketflowError as exc:
                log.debug("cache %s: claim of %s not moved on: %s", self.spec.name, ckey, exc)

        return renew

    def _threads(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._s3_parallel,
                                                thread_name_prefix="cache-s3")
            return self._pool

    def _put_all(self, bucket: str, items: list[tuple[str, Any]], *, overwrite: bool = False,
                 tolerate: type[PocketflowError] | None = None) -> tuple[bool, int]:
        """``put_many`` in chunks (:func:`_chunks`); an error of the ``tolerate`` kind (a claim
        already there) is not one. Used for small records only: a chunk's first error hides
        the others', which the callers read back or can afford to lose. Returns whether every
        item was written (no tolerated error met) and the number of calls made."""
        written, calls = True, 0
        for chunk in _chunks(items, lambda item: len(memoryview(item[1]).cast("B"))):
            calls += 1
            try:
                self._pf.put_many(bucket, chunk, overwrite=overwrite)
            except PocketflowError as exc:
                if tolerate is None or not isinstance(exc, tolerate):
                    raise
                written = False
        return written, calls

    def _meta(self, ckey: str) -> Meta | None:
        try:
            return Meta.decode(self._pf.get(META_BUCKET, ckey))
        except (ObjectNotFound, InvalidRequest):
            return None

    def _meta_or_none(self, ckey: str) -> Meta | None:
        try:
            return self._meta(ckey)
        except PocketflowError:
            return None

    def _drop(self, ckey: str) -> bool:
        """Remove a key's meta and entry; whether there was a meta."""
        try:
            raw = self._pf.get(META_BUCKET, ckey, delete=True)
        except PocketflowError:
            return False
        try:
            meta = Meta.decode(raw)
        except InvalidRequest:
            return True
        if meta.state == STATE_VALUE:
            self._delete_entry(ckey, meta.etag)
        return True

    def _delete_entry(self, ckey: str, etag: str) -> None:
        try:
            self._pf.delete(ENTRY_BUCKET, entry_key(ckey, etag))
        except PocketflowError:
            pass  # gone already, or left for the maintainer's sweep

    def _missing(self, bucket: str, key: str, *, fresh: bool) -> S3ObjectNotFound:
        self.stats.add(missing=1)
        error = s3_error("NoSuchKey", 404, "the key does not exist"
                         + (" (cached)" if fresh else ""), bucket=bucket, key=key)
        assert isinstance(error, S3ObjectNotFound)
        return error

    def _bypass(self, bucket: str, key: str, *, refused: bool = False) -> Result:
        """Read S3 directly, without the cache; ``refused``: because the cache's storage had no
        room for the fill (counted, and logged to the run's access queue as a refused fill)."""
        try:
            fetched = self._s3.get(bucket, key)
        except S3ObjectNotFound as exc:
            self.stats.add(missing=1)
            return exc
        except S3Error as exc:
            return exc
        assert isinstance(fetched, Fetched)
        self.stats.add(bypassed=1, bytes_read=fetched.size, refused=int(refused))
        if refused:
            self._note(bucket, key, fetched.size, fetched.etag, refused=True)
        return fetched.data

    def _note(self, bucket: str, key: str, size: int, etag: str, *, read: bool = True,
              filled: bool = False, refused: bool = False) -> None:
        if self._recorder is not None and (filled or refused or self._record_reads):
            self._recorder.note(bucket, key, size, etag, read=read and self._record_reads,
                                filled=filled, refused=refused)

    def _remove_done(self, *, everything: bool) -> None:
        """Remove the fill outcomes whose linger is over (all of them with ``everything``)."""
        now_s = time.monotonic()
        with self._done_lock:
            due = []
            lingering: list[tuple[str, Claim]] = []
            while self._done_due and (everything or self._done_due[0][0] <= now_s
                                      or len(self._done_due) > DONE_PENDING_MAX):
                _, name, claim = self._done_due.popleft()
                due.append(name)
                if claim is not None:
                    lingering.append(claim)
        if lingering:
            # Before their outcomes: a reader that finds a claim then finds its outcome too.
            self._release_claims(lingering)
        if due:
            try:
                self._pf.get_each(DONE_BUCKET, due, delete=True)
            except PocketflowError as exc:
                log.debug("cache %s: fill outcomes not removed: %s", self.spec.name, exc)


def create_buckets(client: Any) -> None:
    """Create the cache's buckets in its job (:data:`~pocketflow.cache.records.BUCKETS`), those
    that exist already left as they are."""
    from pocketflow.errors import BucketExists

    for bucket in BUCKETS:
        try:
            client.create_bucket(bucket)
        except BucketExists:
            pass


def _chunks(items: list[Any], size_of: Callable[[Any], int]) -> list[list[Any]]:
    """``items`` cut into runs of at most ``PUT_CHUNK_KEYS`` items and ``PUT_CHUNK_BYTES``
    (an item larger than that is a run of its own)."""
    chunks: list[list[Any]] = []
    current: list[Any] = []
    used = 0
    for item in items:
        size = size_of(item)
        if current and (len(current) >= PUT_CHUNK_KEYS or used + size > PUT_CHUNK_BYTES):
            chunks.append(current)
            current, used = [], 0
        current.append(item)
        used += size
    if current:
        chunks.append(current)
    return chunks


def _early_entries(early: tuple[list[str], Any] | None) -> dict[str, Any] | None:
    """The entries a speculative read returned, by name (None if it failed: they are read
    again)."""
    if early is None:
        return None
    names, future = early
    try:
        return dict(zip(names, future.result(), strict=True))
    except PocketflowError as exc:
        log.debug("cache: reading entries while revalidating failed: %s", exc)
        return None


ARENA_HUGE_FROM_BYTES = 2 * 1024 * 1024
"""A round's entries read as views go in a private mapping with huge pages from this size (a
transparent huge page's); below it in a ``bytearray``."""


ARENA_POOL_SLOTS = 4
"""Shared-memory buffers a host keeps for ``get_views`` rounds (:func:`_pooled_arena`): one per
reader at once, so 2 Lithops workers' calls and a margin."""
ARENA_POOL_SLOT_BYTES_MAX = 128 * 1024 * 1024
"""Largest round a pool slot takes (a larger one gets a private mapping); with
``ARENA_POOL_SLOTS`` the most memory the pool keeps in ``/dev/shm`` (512 MiB)."""
ARENA_POOL_ENV = "POCKETFLOW_CACHE_ARENA_POOL"
"""``0``: read every round into a private mapping (no pool); an absolute path: the pool's
directory (default ``/dev/shm/pocketflow-arenas-<uid>``)."""


class _Slot(mmap.mmap):
    """A pool slot's mapping; its file stays locked, for this process, while the mapping (and
    so any view of it) lives."""

    _lock_fd = -1

    def __del__(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock: the next reader may take the slot
            self._lock_fd = -1


def _arena_pool_path() -> str | None:
    """Where this user's pool directory is (``ARENA_POOL_ENV``), or None where there is none."""
    setting = os.environ.get(ARENA_POOL_ENV, "")
    if setting == "0":
        return None
    if setting.startswith("/"):
        return setting
    if os.path.isdir("/dev/shm"):
        return f"/dev/shm/pocketflow-arenas-{os.getuid()}"
    return None


def _arena_pool_dir() -> str | None:
    """This user's pool directory (``ARENA_POOL_ENV``; made ``0700``), or None where there is
    none or it is not this user's alone."""
    path = _arena_pool_path()
    if path is None:
        return None
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        info = os.lstat(path)
    except OSError:
        return None
    import stat

    if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
            or info.st_mode & 0o077):
        return None
    return path


def _pooled_arena(size: int) -> mmap.mmap | None:
    """A buffer of ``size`` bytes in a shared-memory slot of this host's pool, or None (no slot
    free, no pool, no room in ``/dev/shm``). The slots are files in ``/dev/shm`` that outlive
    the processes reading into them, each locked (``flock``) by the one using it: their pages
    stay allocated and mapped by the host, so a fresh process (Lithops forks one per call)
    neither zeroes new pages nor, in a VM that hands free memory back to its host (free page
    reporting, as this machine's Firecracker guest does), faults them in from the host, which
    cost 150-200 ms of kernel time per 64 MiB. Mapped with ``MAP_POPULATE``: its page tables
    filled in one call, not by a fault per page."""
    if size > ARENA_POOL_SLOT_BYTES_MAX:
        return None
    directory = _arena_pool_dir()
    if directory is None:
        return None
    import fcntl

    for slot in range(ARENA_POOL_SLOTS):
        try:
            fd = os.open(f"{directory}/slot-{slot}",
                         os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        try:
            if os.fstat(fd).st_size < size:
                # Its pages allocated now (ENOSPC if /dev/shm is full), not at a write into
                # the mapping, where a full tmpfs would kill the reader with SIGBUS.
                os.posix_fallocate(fd, 0, size)
            region = _Slot(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except (OSError, ValueError) as exc:
            os.close(fd)
            log.debug("arena pool slot %d unusable: %s", slot, exc)
            return None
        region._lock_fd = fd
        return region
    return None


def free_arena_pool() -> int:
    """Remove the free slots of this user's shared-memory pool (:func:`_pooled_arena`), and its
    directory once empty; returns the slots removed. A slot is free when its lock can be taken
    (``flock``, non-blocking): one a live process holds (its views, or a forked child's copy
    of its descriptor) is left, and keeps its memory until that process ends. A reader that
    opened a slot just before it was removed still locks and uses it, as a file nobody else
    can open (its pages go when it ends); the next reader creates the slot again. Called when
    a :class:`~pocketflow.cluster.LocalCluster` stops and at the end of the test suite."""
    directory = _arena_pool_path()
    if directory is None:
        return 0
    import fcntl

    removed = 0
    for slot in range(ARENA_POOL_SLOTS):
        path = f"{directory}/slot-{slot}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # absent (or not ours to open)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # held by a live process
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    try:
        os.rmdir(directory)
    except OSError:
        pass  # absent, or a held slot (or anything else) is left in it
    return removed


def _arena(size: int) -> Any:
    """A writable buffer of ``size`` bytes for a round's entries: from
    ``ARENA_HUGE_FROM_BYTES`` on a slot of the host's pool (:func:`_pooled_arena`) when one is
    free, else an anonymous private mapping advised to use huge pages (where the kernel has
    them off it works as 4 KiB pages)."""
    if size < ARENA_HUGE_FROM_BYTES:
        return bytearray(size)
    pooled = _pooled_arena(size)
    if pooled is not None:
        return pooled
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass  # no huge pages here: plain pages
    return region


def _claim_id(raw: Any) -> str | None:
    """The fill id of a stored claim, ``None`` if it is not one."""
    try:
        return Claim.decode(raw).fill_id
    except InvalidRequest:
        return None


def _now_ms() -> int:
    return int(time.time() * 1000)


SHARED_CLIENTS_MAX = 8
"""Clients :func:`shared_client` keeps per process, one per spec."""

_shared_lock = threading.Lock()
_shared: OrderedDict[tuple[int, str], CacheClient] = OrderedDict()


def shared_client(spec_json: str) -> CacheClient:
    """This process's client of the cache of ``spec_json``, made on first use and kept (at most
    ``SHARED_CLIENTS_MAX``, least recently used closed): for serverless workers that run many
    calls per process and fork one per call (a forked child makes its own)."""
    key = (os.getpid(), spec_json)
    with _shared_lock:
        client = _shared.get(key)
        if client is None:
            client = _shared[key] = CacheClient(CacheSpec.from_json(spec_json))
        _shared.move_to_end(key)
        evicted = []
        while len(_shared) > SHARED_CLIENTS_MAX:
            evicted.append(_shared.popitem(last=False))
    for (pid, _), old in evicted:
        if pid == os.getpid():
            old.close()
    return client


def _reset_shared_lock_in_child() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()  # a lock held by another thread at fork stays held


os.register_at_fork(after_in_child=_reset_shared_lock_in_child)


def connect(spec: CacheSpec | str, **options: Any) -> CacheClient:
    """A client of the cache described by ``spec`` (a :class:`CacheSpec` or its JSON), for a
    task in any process; ``options`` go to the job's :func:`pocketflow.connect`."""
    if isinstance(spec, str):
        spec = CacheSpec.from_json(spec)
    if options:
        from pocketflow.client import connect as connect_job

        return CacheClient(spec, client=connect_job(spec.handle, **options))
    return CacheClient(spec)
