"""A cache's spec: the plain data a task needs to use a cache (its job handle, its S3 source,
its validation lease, the run it logs accesses to), passed as JSON like a job handle."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from pocketflow.cache.source import S3Source
from pocketflow.errors import InvalidRequest
from pocketflow.handle import JobHandle

__all__ = ["CacheSpec", "LEASE_MS_DEFAULT", "LEASE_MS_MAX", "FILL_WAIT_S_DEFAULT",
           "FILL_WAIT_S_MAX", "CLAIM_MS_DEFAULT", "check_lease_ms"]

LEASE_MS_DEFAULT = 5_000
"""How long S3's confirmation of an entry is trusted without asking again (the validation
lease): reads within it cost no S3 request; a read after it costs one conditional request."""

LEASE_MS_MAX = 24 * 3600 * 1000
"""Longest validation lease (a day)."""

FILL_WAIT_S_DEFAULT = 120.0
"""Longest a read waits for another process's fetch of the same key before reading S3 itself."""

FILL_WAIT_S_MAX = 3600.0

CLAIM_MS_DEFAULT = 30_000
"""How long a fetch's claim holds before its owner must move it on (every third of it during a
long download) or lose it to a waiting reader."""

CLAIM_MS_MIN = 100
CLAIM_MS_MAX = 3600 * 1000


def check_lease_ms(lease_ms: Any) -> int:
    """``lease_ms`` if it is a lease (0 = every read asks S3), else :class:`InvalidRequest`."""
    if isinstance(lease_ms, bool) or not isinstance(lease_ms, int) or not (
        0 <= lease_ms <= LEASE_MS_MAX
    ):
        raise InvalidRequest(f"lease_ms must be an int in 0..{LEASE_MS_MAX}, got {lease_ms!r}")
    return lease_ms


@dataclass(frozen=True)
class CacheSpec:
    """Everything a task needs to read through a cache (``pocketflow.cache.connect(spec)``).

    ``run_id`` names the run whose access queue the task's reads are logged to (the driver's
    :class:`~pocketflow.cache.Cache` reads it to keep recency, size the cache and record the
    working set); ``None`` logs nothing.
    """

    name: str
    handle: JobHandle
    source: S3Source
    lease_ms: int = LEASE_MS_DEFAULT
    run_id: str | None = None
    fill_wait_s: float = FILL_WAIT_S_DEFAULT
    claim_ms: int = CLAIM_MS_DEFAULT

    def __post_init__(self) -> None:
        check_lease_ms(self.lease_ms)
        if not 0 < self.fill_wait_s <= FILL_WAIT_S_MAX:
            raise InvalidRequest(f"fill_wait_s must be in (0, {FILL_WAIT_S_MAX}]")
        if isinstance(self.claim_ms, bool) or not isinstance(self.claim_ms, int) or not (
            CLAIM_MS_MIN <= self.claim_ms <= CLAIM_MS_MAX
        ):
            raise InvalidRequest(f"claim_ms must be an int in {CLAIM_MS_MIN}..{CLAIM_MS_MAX}")

    def with_handle(self, handle: JobHandle) -> CacheSpec:
        """The same spec over a newer handle of the cache's job (a new token or epoch)."""
        return replace(self, handle=handle)

    def to_json(self) -> str:
        return json.dumps({
            "name": self.name, "handle": json.loads(self.handle.to_json()),
            "source": self.source.to_dict(), "lease_ms": self.lease_ms, "run_id": self.run_id,
            "fill_wait_s": self.fill_wait_s, "claim_ms": self.claim_ms,
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> CacheSpec:
        try:
            data = json.loads(text)
            return cls(
                name=str(data["name"]),
                handle=JobHandle.from_json(json.dumps(data["handle"])),
                source=S3Source.from_dict(dict(data["source"])),
                lease_ms=data["lease_ms"],
                run_id=data.get("run_id"),
                fill_wait_s=float(data.get("fill_wait_s", FILL_WAIT_S_DEFAULT)),
                claim_ms=data.get("claim_ms", CLAIM_MS_DEFAULT),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidRequest):
                raise
            raise InvalidRequest(f"not a cache spec: {exc}") from None
