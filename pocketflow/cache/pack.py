"""Packs: the bytes of a run's small entries in one S3 object, so that the next run's prewarm
fetches them with a few ranged GETs instead of one GET each.

A prewarm of many small objects is bound by the requests, not the bytes: each GET costs our
worker and the S3 server about as much CPU as 4 KiB of data costs nothing (the benchmark's
20,000 objects of 4 KiB took 712 us of the worker's CPU and 778 us of SeaweedFS's per GET).
When a run ends and its working set is copied to S3 (``working_set_url``), the entries of at
most ``PACK_OBJECT_BYTES_MAX`` bytes whose ETag is their bytes' MD5 (an object put whole, as
small objects are) go, in the record's order and up to ``PACK_BYTES_MAX`` in all, into one
object next to it (``<working set key>.pack-<run>``), and the record says which keys it holds,
at which ETag. A run whose entries are those of the last pack keeps that pack.

A prewarm from such a record takes each batch's packed keys from the pack: one ListObjectsV2
page (the validation, as a read's revalidation of up to 1000 keys) and ranged GETs of the
pack (each at most ``PACK_RANGE_BYTES_MAX``). A key is filled from the pack only when the
listing shows the packed ETag and size, and the packed bytes have that MD5; its ``meta`` is
dated when the listing was sent, so the staleness bound is a listing's. Any other key (changed,
missing from the listing, pack unreadable) is fetched from S3 on its own, as without a pack.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import Any

from pocketflow.cache.records import ENTRY_BUCKET, META_BUCKET, STATE_VALUE, Meta, cache_key
from pocketflow.cache.records import entry_key as _entry_key
from pocketflow.cache.source import S3Store
from pocketflow.cache.working_set import KeyUse, PackEntry, PackRef
from pocketflow.errors import PocketflowError

__all__ = ["PACK_OBJECT_BYTES_MAX", "PACK_BYTES_MAX", "PACK_RANGE_BYTES_MAX",
           "PACK_RANGE_GAP_BYTES", "PACK_READ_KEYS", "PACK_PART_BYTES", "pack_key", "build_pack",
           "read_packed", "listed_versions", "md5_etag", "PACK_LISTINGS_MAX"]

log = logging.getLogger(__name__)

PACK_OBJECT_BYTES_MAX = 64 * 1024
"""Largest object packed (the size up to which a GET costs mostly its request)."""
PACK_BYTES_MAX = 256 * 1024 * 1024
"""Most bytes of one pack (its keys are the first of the record's order that fit)."""
PACK_RANGE_BYTES_MAX = 16 * 1024 * 1024
"""Most bytes of one ranged GET of a pack."""
PACK_RANGE_GAP_BYTES = 256 * 1024
"""Bytes between two wanted entries of a pack that one ranged GET still reads over (further
apart, a second range is asked)."""
PACK_READ_KEYS = 4096
"""Entries read from the cache at once while a pack is built."""
PACK_LISTINGS_MAX = 4
"""Listings that validate one batch's packed keys at most: a batch whose keys lie in a few
ranges of S3's order (a run whose tasks read two shares at once) gets one listing from the
first key not reached yet, up to this many; keys still not reached are fetched alone."""
PACK_PART_BYTES = 16 * 1024 * 1024
"""A pack is uploaded in parts of this many bytes (one multipart upload; one PUT when it fits
in one part), so building it holds a few parts' bytes at most, not the whole pack."""

_MD5 = re.compile(r"^[0-9a-f]{32}$")


def md5_etag(etag: str) -> bool:
    """Whether ``etag`` is an MD5 of the object's bytes (the ETag of an object put whole,
    without SSE-KMS): only those are packed, and their bytes checked against it."""
    return _MD5.match(etag) is not None


def pack_key(record_key: str, run_id: str) -> str:
    """The S3 key of run ``run_id``'s pack, next to its record's copy ``record_key``."""
    return f"{record_key}.pack-{run_id}"


def build_pack(pf: Any, store: S3Store, uses: Sequence[KeyUse], bucket: str, key: str, *,
               previous: PackRef | None) -> PackRef | None:
    """Pack the cached entries of ``uses`` (a run's working set, in its order) that fit
    (:data:`PACK_OBJECT_BYTES_MAX`, :data:`PACK_BYTES_MAX`) into the S3 object ``bucket/key``,
    reading them from the cache through ``pf`` (the cache job's client); returns the pack, or
    ``previous`` when it holds exactly those entries, in any order (nothing is written then),
    or None when none is cached. ``previous`` is kept only if a HEAD finds it at its size.
    Raises the :class:`PocketflowError` of a failed read or PUT."""
    chosen: list[KeyUse] = []
    room = PACK_BYTES_MAX
    for use in uses:
        if 0 < use.size <= min(PACK_OBJECT_BYTES_MAX, room):
            chosen.append(use)
            room -= use.size
    wanted: list[tuple[KeyUse, str]] = []  # (use, etag of its cached version)
    for start in range(0, len(chosen), PACK_READ_KEYS):
        piece = chosen[start:start + PACK_READ_KEYS]
        metas = pf.get_each(META_BUCKET, [cache_key(u.bucket, u.key) for u in piece])
        for use, raw in zip(piece, metas, strict=True):
            meta = Meta.of_reply(raw)
            if (meta is not None and meta.state == STATE_VALUE and meta.size == use.size
                    and md5_etag(meta.etag)):
                wanted.append((use, meta.etag))
    if not wanted:
        return None
    if previous is not None and len(previous.entries) == len(wanted) and (
            {(e.bucket, e.key, e.etag, e.size) for e in previous.entries}
            == {(u.bucket, u.key, etag, u.size) for u, etag in wanted}) and _still_there(
            store, previous):
        return previous
    entries: list[PackEntry] = []
    parts = _parts(pf, wanted, entries)
    first = next(parts, None)
    if not entries:
        return None  # every entry evicted since its meta was read: nothing is written
    store.put_parts(bucket, key, chain([first or b""], parts))
    return PackRef(bucket, key, tuple(entries))


def _still_there(store: S3Store, pack: PackRef) -> bool:
    """Whether S3 still holds ``pack`` at its size (a HEAD): another run from the same record
    may have replaced and deleted it, and a record must not name a pack that is gone."""
    try:
        _, size = store.head(pack.bucket, pack.key)
    except PocketflowError as exc:
        log.info("the last pack %s is not kept: %s", pack.key, exc)
        return False
    return size == pack.size


def _parts(pf: Any, wanted: list[tuple[KeyUse, str]], entries: list[PackEntry],
           ) -> Iterator[bytes]:
    """The pack's bytes in parts of about ``PACK_PART_BYTES`` (the last one shorter), read
    from the cache a piece of at most ``PACK_READ_KEYS`` keys and ``PACK_PART_BYTES`` at a
    time; each entry packed is appended to ``entries`` as its part is made (an entry evicted
    meanwhile, or whose bytes are not its ETag's MD5, is left out)."""
    body = bytearray()
    offset = 0
    start = 0
    while start < len(wanted):
        piece: list[tuple[KeyUse, str]] = []
        piece_bytes = 0
        while (start < len(wanted) and len(piece) < PACK_READ_KEYS
               and (not piece or piece_bytes + wanted[start][0].size <= PACK_PART_BYTES)):
            piece.append(wanted[start])
            piece_bytes += wanted[start][0].size
            start += 1
        datas = pf.get_each(ENTRY_BUCKET, [_entry_key(cache_key(u.bucket, u.key), etag)
                                           for u, etag in piece])
        for (use, etag), data in zip(piece, datas, strict=True):
            if isinstance(data, PocketflowError) or len(data) != use.size:
                continue  # evicted since its meta was read
            if hashlib.md5(data, usedforsecurity=False).hexdigest() != etag:
                continue
            entries.append(PackEntry(use.bucket, use.key, etag, offset, use.size))
            offset += use.size
            body += data
            if len(body) >= PACK_PART_BYTES:
                yield bytes(body)
                body = bytearray()
    if body or not offset:
        yield bytes(body)


def listed_versions(store: S3Store, bucket: str, keys: Sequence[str],
                    ) -> dict[str, tuple[str, int]]:
    """``(etag, size)`` of those of ``keys`` S3 lists, from at most ``PACK_LISTINGS_MAX``
    listings (:meth:`S3Store.list_keys`), each from the first key the ones before did not
    reach. Raises the :class:`~pocketflow.errors.S3Error` of a failed listing."""
    found: dict[str, tuple[str, int]] = {}
    remaining = list(keys)
    for _ in range(PACK_LISTINGS_MAX):
        if not remaining:
            break
        listed = store.list_keys(bucket, remaining)
        found.update(listed.found)
        remaining = [k for k in remaining if k not in listed.found and k not in listed.absent]
    return found


def read_packed(store: S3Store, pack_bucket: str, pack_object: str,
                entries: Sequence[PackEntry]) -> dict[str, bytes]:
    """The bytes of ``entries`` (of one pack, one S3 bucket's keys) by key, read with ranged
    GETs (entries close together share one, of at most :data:`PACK_RANGE_BYTES_MAX`); an entry
    whose bytes are not its ETag's MD5 is left out. Raises the
    :class:`~pocketflow.errors.S3Error` of a failed GET."""
    ordered = sorted(entries, key=lambda e: e.offset)
    ranges: list[list[PackEntry]] = []
    for entry in ordered:
        if ranges:
            first, last = ranges[-1][0], ranges[-1][-1]
            end = last.offset + last.size
            if (entry.offset - end <= PACK_RANGE_GAP_BYTES
                    and entry.offset + entry.size - first.offset <= PACK_RANGE_BYTES_MAX):
                ranges[-1].append(entry)
                continue
        ranges.append([entry])
    out: dict[str, bytes] = {}
    for group in ranges:
        start = group[0].offset
        data = store.get_range(pack_bucket, pack_object, start,
                               group[-1].offset + group[-1].size - 1)
        view = memoryview(data)
        for entry in group:
            piece = view[entry.offset - start:entry.offset - start + entry.size]
            if hashlib.md5(piece, usedforsecurity=False).hexdigest() == entry.etag:
                out[entry.key] = bytes(piece)
    return out
