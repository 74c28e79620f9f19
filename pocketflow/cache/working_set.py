"""Working sets (pure): what a run read (keys, sizes, how often), the record it leaves for the
next run, which keys a prewarm fetches first, and the capacity a cache asks for.

A key's *benefit* is the S3 time a cached copy saves the next run: each read costs a request's
round trip plus its bytes at a stream's bandwidth, so ``reads * (S3_REQUEST_S + size /
S3_STREAM_BYTES_PER_S)``. A prewarm fills its capacity with the keys of the highest benefit per
byte (so many small, often read keys beat one large one read once) and fetches them largest
benefit first, so the reads that gain most are cached earliest.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from pocketflow.errors import InvalidRequest

__all__ = [
    "KeyUse", "WorkingSet", "RunRecord", "plan_prewarm", "benefit_s", "target_capacity_bytes",
    "resize_wanted", "S3_REQUEST_S", "S3_STREAM_BYTES_PER_S", "WORKING_SET_KEYS_MAX",
    "CAPACITY_HEADROOM", "CAPACITY_MIN_BYTES", "GROW_WHEN_SHORT", "SHRINK_WHEN_UNDER",
    "RECORD_BYTES_MAX", "PackEntry", "PackRef", "ENTRY_RECORDS_BYTES", "ENTRY_BYTES_ASSUMED",
    "BOOKKEEPING_BYTES", "ENTRIES_RESERVED_MAX", "reservation_bytes", "capacity_of_reservation",
]

S3_REQUEST_S = 0.010
"""What one S3 request costs before its bytes (a round trip to a remote store; the GETs of a
4 KiB object measured 5 ms against a local SeaweedFS on a loaded machine)."""
S3_STREAM_BYTES_PER_S = 100 * 1024 * 1024
"""One S3 request's transfer rate (a single stream of S3 moves about 100 MB/s)."""
WORKING_SET_KEYS_MAX = 200_000
"""Most keys a run's working set keeps (the most read ones when there are more)."""
RECORD_BYTES_MAX = 64 * 1024 * 1024
"""Largest encoded run record read back."""
CAPACITY_HEADROOM = 1.25
"""A cache asks for its working set times this (room for versions changing under it)."""
CAPACITY_MIN_BYTES = 16 * 1024 * 1024
"""The smallest capacity a cache asks for."""
GROW_WHEN_SHORT = 1.10
"""A cache grows once its target exceeds its capacity by this factor."""
SHRINK_WHEN_UNDER = 0.5
"""... and shrinks once its target is below this share of its capacity."""
ENTRY_RECORDS_BYTES = 768
"""What one entry costs the storage servers beside its bytes, as their budget charges it
(docs/ARCHITECTURE.md, "Bigger than DRAM"): its bytes rounded up to the DRAM tier's 64-byte
granularity, the index records of the entry and of its ``meta`` (64 bytes each plus their keys),
the ``meta``'s value (about 80 bytes, rounded up) and its fill's outcome, which lingers 10 s
(another record of about the same size), for keys of up to about 100 bytes."""
ENTRY_BYTES_ASSUMED = 4096
"""The mean entry size a cache's reservation assumes before it holds or recorded any entry
(smaller entries cost more per byte: if their fills are refused, the refusals grow the cache
and the next reservation takes the sizes it then knows)."""
BOOKKEEPING_BYTES = 4 * 1024 * 1024
"""What a cache reserves beside its entries for its other records (claims, access batches,
working-set records)."""
ENTRIES_RESERVED_MAX = 1_000_000
"""Most entries a reservation covers (the maintainer tracks no more, ``ENTRIES_TRACKED_MAX``)."""


class KeyUse(NamedTuple):
    """One key of a working set: its S3 bucket and key, size, and reads in the run."""

    bucket: str
    key: str
    size: int
    reads: int


def benefit_s(use: KeyUse) -> float:
    """The S3 seconds a cached copy of ``use`` saves a run that reads as this one did."""
    return use.reads * (S3_REQUEST_S + use.size / S3_STREAM_BYTES_PER_S)


class WorkingSet:
    """What a run read so far, aggregated per key (at most ``WORKING_SET_KEYS_MAX`` keys; past
    that, keys read once are dropped first)."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, str], list[int]] = {}
        self.bytes_read = 0
        self.reads = 0

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, bucket: str, key: str, size: int, reads: int) -> None:
        """Count ``reads`` reads of ``bucket/key`` (of ``size`` bytes)."""
        self.reads += reads
        self.bytes_read += reads * size
        row = self._keys.get((bucket, key))
        if row is None:
            if len(self._keys) >= WORKING_SET_KEYS_MAX:
                self._trim()
            self._keys[(bucket, key)] = [size, reads]
            return
        row[0] = size
        row[1] += reads

    def _trim(self) -> None:
        """Drop the least read tenth of the keys."""
        ranked = sorted(self._keys.items(), key=lambda item: item[1][1])
        for name, _ in ranked[: max(1, len(ranked) // 10)]:
            del self._keys[name]

    def uses(self) -> list[KeyUse]:
        return [KeyUse(b, k, size, reads) for (b, k), (size, reads) in self._keys.items()]

    @property
    def distinct_bytes(self) -> int:
        """The bytes of the distinct keys read: what holding all of it takes."""
        return sum(size for size, _ in self._keys.values())


class PackEntry(NamedTuple):
    """One object held in a pack: its S3 bucket and key, the ETag of the bytes packed, and
    where they are in the pack."""

    bucket: str
    key: str
    etag: str
    offset: int
    size: int


@dataclass(frozen=True)
class PackRef:
    """A run's pack (:mod:`pocketflow.cache.pack`): the S3 object ``bucket/key`` holding the
    bytes of its small entries one after another, as ``entries`` say."""

    bucket: str
    key: str
    entries: tuple[PackEntry, ...]

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)


@dataclass(frozen=True)
class RunRecord:
    """What a run of an application leaves for the next one: its working set, how long it ran
    and how many bytes it read (its read bandwidth, for the next run's hints)."""

    app: str
    run_id: str
    recorded_ms: int
    duration_s: float
    keys: tuple[KeyUse, ...]
    pack: PackRef | None = None

    @property
    def bytes_read(self) -> int:
        return sum(u.size * u.reads for u in self.keys)

    @property
    def distinct_bytes(self) -> int:
        return sum(u.size for u in self.keys)

    @property
    def read_bytes_per_s(self) -> int:
        return int(self.bytes_read / self.duration_s) if self.duration_s > 0 else 0

    @property
    def entry_bytes_mean(self) -> float:
        """The run's mean entry size (``ENTRY_BYTES_ASSUMED`` for a run that read nothing)."""
        return self.distinct_bytes / len(self.keys) if self.keys else float(ENTRY_BYTES_ASSUMED)

    def encode(self) -> bytes:
        body: dict[str, Any] = {"v": 1, "app": self.app, "run": self.run_id,
                                "t": self.recorded_ms, "d": self.duration_s,
                                "k": [list(u) for u in self.keys]}
        if self.pack is not None:
            # Each packed entry as its index in ``k`` and its ETag; its offset is the sum of
            # the sizes packed before it.
            index = {(u.bucket, u.key): i for i, u in enumerate(self.keys)}
            body["p"] = {"b": self.pack.bucket, "k": self.pack.key,
                         "e": [[index[(e.bucket, e.key)], e.etag] for e in self.pack.entries]}
        return zlib.compress(json.dumps(body, separators=(",", ":")).encode(), 6)

    @classmethod
    def decode(cls, raw: bytes) -> RunRecord:
        try:
            text = zlib.decompressobj().decompress(raw, RECORD_BYTES_MAX)
            body: dict[str, Any] = json.loads(text)
            if body.get("v") != 1:
                raise ValueError("version")
            keys = tuple(KeyUse(str(b), str(k), int(n), int(r)) for b, k, n, r in body["k"])
            pack = None
            if body.get("p") is not None:
                entries: list[PackEntry] = []
                offset = 0
                for i, etag in body["p"]["e"]:
                    use = keys[int(i)]
                    entries.append(PackEntry(use.bucket, use.key, str(etag), offset, use.size))
                    offset += use.size
                pack = PackRef(str(body["p"]["b"]), str(body["p"]["k"]), tuple(entries))
            return cls(str(body["app"]), str(body["run"]), int(body["t"]), float(body["d"]),
                       keys, pack)
        except (ValueError, TypeError, KeyError, IndexError, zlib.error):
            raise InvalidRequest("not a cache run record") from None


def plan_prewarm(uses: Iterable[KeyUse], capacity_bytes: int) -> list[KeyUse]:
    """The keys a prewarm fetches, in the order it fetches them: the highest benefit per byte
    that fit in ``capacity_bytes``, then sorted by benefit, largest first."""
    chosen: list[KeyUse] = []
    room = capacity_bytes
    for use in sorted(uses, key=lambda u: benefit_s(u) / max(u.size, 1), reverse=True):
        if use.size <= room and use.reads > 0:
            chosen.append(use)
            room -= use.size
    chosen.sort(key=benefit_s, reverse=True)
    return chosen


def target_capacity_bytes(working_set_bytes: int, *, capacity_max_bytes: int | None) -> int:
    """The capacity a cache whose working set is ``working_set_bytes`` asks for."""
    target = max(int(working_set_bytes * CAPACITY_HEADROOM), CAPACITY_MIN_BYTES)
    return min(target, capacity_max_bytes) if capacity_max_bytes is not None else target


def reservation_bytes(capacity_bytes: int, *, entry_bytes_mean: float) -> int:
    """What a cache of ``capacity_bytes`` (of entries' bytes) reserves on the storage servers,
    its entries being ``entry_bytes_mean`` bytes on average: the bytes, each entry's records
    (``ENTRY_RECORDS_BYTES``) and ``BOOKKEEPING_BYTES``. A cache whose bytes held stay within
    its capacity then stays within its reservation, so its fills are not refused for its
    share of shared servers."""
    mean = max(float(entry_bytes_mean), 1.0)
    entries = min(math.ceil(capacity_bytes / mean), ENTRIES_RESERVED_MAX)
    return capacity_bytes + entries * ENTRY_RECORDS_BYTES + BOOKKEEPING_BYTES


def capacity_of_reservation(reserved_bytes: int, *, entry_bytes_mean: float) -> int:
    """The capacity whose :func:`reservation_bytes` is ``reserved_bytes`` (at most), for
    entries of ``entry_bytes_mean`` bytes: what a live generation reserving that holds."""
    mean = max(float(entry_bytes_mean), 1.0)
    room = max(reserved_bytes - BOOKKEEPING_BYTES, 0)
    capacity = int(room * mean / (mean + ENTRY_RECORDS_BYTES))
    if capacity / mean > ENTRIES_RESERVED_MAX:
        # Past the entries a reservation covers, the rest is entries' bytes.
        capacity = room - ENTRIES_RESERVED_MAX * ENTRY_RECORDS_BYTES
    # The entries' count rounds up in reservation_bytes: step down until it fits.
    while capacity > 0 and reservation_bytes(capacity, entry_bytes_mean=mean) > reserved_bytes:
        capacity -= max(1, ENTRY_RECORDS_BYTES)
    return max(capacity, 0)


def resize_wanted(capacity_bytes: int, target_bytes: int) -> bool:
    """Whether a cache of ``capacity_bytes`` should move to ``target_bytes`` (a band, so that
    it does not resize for every small change)."""
    return (target_bytes > capacity_bytes * GROW_WHEN_SHORT
            or target_bytes < capacity_bytes * SHRINK_WHEN_UNDER)
