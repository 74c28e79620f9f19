"""How a cache lays out its state in its pocketflow job: bucket and key names, and the small
records it keeps there (an entry's metadata, a fill's claim and its outcome), with their codecs.
Pure: no I/O.

Per cached S3 object (``ckey`` is :func:`cache_key` of its bucket and key):

- ``meta/<ckey>``: :class:`Meta`, overwritten in place: the version held (ETag, size), or that
  the key is missing in S3, and when S3 last confirmed it (``validated_ms``).
- ``entries/<ckey>@<etag digest>``: the object's bytes, written once per version, so two
  processes filling the same version write the same key and the second is refused harmlessly.
- ``claims/<ckey>``: :class:`Claim`, written once by the process that fetches the key from S3
  while it does (single flight), removed when it is done.
- ``done/<ckey>@<fill id>``: :class:`Outcome` of that fetch, which the processes that found the
  claim wait for (the server's ``wait`` action); removed a short while later.
- ``records/``: the runs' access queues and the applications' working sets.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any

from pocketflow.errors import InvalidRequest, PocketflowError
from pocketflow.protocol import KEY_MAX_BYTES

__all__ = [
    "META_BUCKET", "ENTRY_BUCKET", "CLAIM_BUCKET", "DONE_BUCKET", "RECORD_BUCKET", "BUCKETS",
    "CACHE_KEY_MAX_BYTES", "cache_key", "entry_key", "done_key", "steal_key", "new_fill_id",
    "owner_id", "Meta", "Claim", "Outcome", "STATE_VALUE", "STATE_MISSING", "STATE_ERROR",
    "STATE_UNCACHED",
]

META_BUCKET = "meta"
ENTRY_BUCKET = "entries"
CLAIM_BUCKET = "claims"
DONE_BUCKET = "done"
RECORD_BUCKET = "records"
BUCKETS = (META_BUCKET, ENTRY_BUCKET, CLAIM_BUCKET, DONE_BUCKET, RECORD_BUCKET)
"""Every bucket a cache's job holds."""

CACHE_KEY_MAX_BYTES = KEY_MAX_BYTES - 64
"""Longest cache key kept readable (``<bucket>/<key>``); the suffixes of entries, outcomes and
steal markers take the rest of a pocketflow key. A longer one is hashed."""

STATE_VALUE = "value"
"""The key exists in S3; its bytes are cached."""
STATE_MISSING = "missing"
"""The key does not exist in S3 (a negative entry, under the same validation lease)."""
STATE_ERROR = "error"
"""A fetch failed (an outcome only; never cached in ``meta``)."""
STATE_UNCACHED = "uncached"
"""A fetch succeeded but the cache had no room: whoever waited reads S3 itself (outcome only)."""

_STATES_META = (STATE_VALUE, STATE_MISSING)
_STATES_OUTCOME = (STATE_VALUE, STATE_MISSING, STATE_ERROR, STATE_UNCACHED)
RECORD_VERSION = 1


def cache_key(bucket: str, key: str) -> str:
    """The name of an S3 object in the cache: ``<bucket>/<key>`` (bucket names hold no ``/``),
    or ``<bucket>#<sha256 of key>`` when that would be longer than ``CACHE_KEY_MAX_BYTES``
    (bucket names hold no ``#`` either, so the two forms never meet)."""
    if not isinstance(bucket, str) or not bucket or "/" in bucket or "#" in bucket:
        raise InvalidRequest(f"not an S3 bucket name: {bucket!r}")
    if not isinstance(key, str) or not key:
        raise InvalidRequest(f"an S3 key is a non-empty str, got {key!r}")
    name = f"{bucket}/{key}"
    if len(name.encode("utf-8")) <= CACHE_KEY_MAX_BYTES:
        return name
    return f"{bucket}#{hashlib.sha256(key.encode('utf-8')).hexdigest()}"


def entry_key(ckey: str, etag: str) -> str:
    """Where the bytes of version ``etag`` of ``ckey`` live."""
    return f"{ckey}@{hashlib.sha1(etag.encode('utf-8')).hexdigest()[:20]}"


def done_key(ckey: str, fill_id: str) -> str:
    """Where the outcome of fill ``fill_id`` of ``ckey`` is written."""
    return f"{ckey}@{fill_id}"


def steal_key(ckey: str, fill_id: str) -> str:
    """The write-once marker whose writer alone takes over fill ``fill_id`` of ``ckey`` after
    its claim's deadline passed (in the claims bucket, beside the claim)."""
    return f"{ckey}!{fill_id}"


def new_fill_id() -> str:
    """A random id for one fetch of one key (64 bits)."""
    return secrets.token_hex(8)


def owner_id() -> str:
    """Who claims: host and process id (for messages and tests; nothing depends on it)."""
    return f"{socket.gethostname()}:{os.getpid()}"


_ENCODER = json.JSONEncoder(separators=(",", ":"))
"""One encoder for every record (``json.dumps`` with separators builds a new one per call, a
third of a record's encoding time; a prewarm encodes four records per key)."""


def _dump(fields: dict[str, Any]) -> bytes:
    return _ENCODER.encode({"v": RECORD_VERSION, **fields}).encode()


def _load(raw: bytes | memoryview, what: str) -> dict[str, Any]:
    try:
        fields = json.loads(bytes(raw))
    except ValueError:
        raise InvalidRequest(f"a cache {what} record is not JSON") from None
    if not isinstance(fields, dict) or fields.get("v") != RECORD_VERSION:
        raise InvalidRequest(f"a cache {what} record of an unknown version")
    return fields


@dataclass(frozen=True)
class Meta:
    """What the cache holds for a key, and when S3 last confirmed it (``validated_ms``: unix
    ms at which the confirming request was sent, so the confirmation is never dated later than
    the state it saw)."""

    state: str
    etag: str
    size: int
    validated_ms: int

    def fresh(self, now_ms: int, lease_ms: int) -> bool:
        """Whether the validation lease still holds (never, with a lease of 0)."""
        return lease_ms > 0 and now_ms - self.validated_ms < lease_ms

    def encode(self) -> bytes:
        return _dump({"s": self.state, "e": self.etag, "n": self.size, "t": self.validated_ms})

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> Meta:
        f = _load(raw, "meta")
        try:
            meta = cls(str(f["s"]), str(f["e"]), int(f["n"]), int(f["t"]))
        except (KeyError, TypeError, ValueError):
            raise InvalidRequest("a cache meta record lacks a field") from None
        if meta.state not in _STATES_META or meta.size < 0:
            raise InvalidRequest(f"a cache meta record of state {meta.state!r}")
        return meta

    @classmethod
    def of_reply(cls, raw: Any) -> Meta | None:
        """The meta in one reply of a batched read (``get_each``), or ``None`` where the read
        failed (its ``PocketflowError`` in place of the bytes) or the record does not decode."""
        if isinstance(raw, PocketflowError):
            return None
        try:
            return cls.decode(raw)
        except InvalidRequest:
            return None


@dataclass(frozen=True)
class Claim:
    """A fetch in progress: its id and the unix ms until which its owner answers for it (the
    owner moves the deadline on while a long download runs)."""

    fill_id: str
    deadline_ms: int
    owner: str

    def encode(self) -> bytes:
        return _dump({"f": self.fill_id, "d": self.deadline_ms, "o": self.owner})

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> Claim:
        f = _load(raw, "claim")
        try:
            return cls(str(f["f"]), int(f["d"]), str(f["o"]))
        except (KeyError, TypeError, ValueError):
            raise InvalidRequest("a cache claim record lacks a field") from None


@dataclass(frozen=True)
class Outcome:
    """How a fetch ended: the version cached (``value``), the key missing in S3, an S3 error
    (``code``, ``status``, ``message`` as :func:`pocketflow.errors.s3_error` takes them), or a
    value the cache had no room for (``uncached``)."""

    state: str
    etag: str = ""
    size: int = 0
    code: str = ""
    status: int = 0
    message: str = ""

    def encode(self) -> bytes:
        return _dump({"s": self.state, "e": self.etag, "n": self.size, "c": self.code,
                      "h": self.status, "m": self.message[:1024]})

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> Outcome:
        f = _load(raw, "outcome")
        try:
            outcome = cls(str(f["s"]), str(f["e"]), int(f["n"]), str(f["c"]), int(f["h"]),
                          str(f["m"]))
        except (KeyError, TypeError, ValueError):
            raise InvalidRequest("a cache outcome record lacks a field") from None
        if outcome.state not in _STATES_OUTCOME:
            raise InvalidRequest(f"a cache outcome of state {outcome.state!r}")
        return outcome
