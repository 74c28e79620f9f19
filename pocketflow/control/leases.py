"""Job leases: a driver renews its job's lease; a job whose lease ran out is cleaned up (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from pocketflow.errors import ConfigError

LEASE_MS_DEFAULT = 10_000
"""Lease a driver asks for unless told otherwise; it renews every third of it."""

LEASE_MS_MIN = 100
"""Shortest lease accepted (renewing more often than every ~33 ms would be busy work)."""

LEASE_MS_MAX = 24 * 3600 * 1000
"""Longest lease accepted."""

LEASES_MAX = 65_536
"""Most leases held at once (more than the jobs a cluster registers at once)."""


@dataclass(frozen=True)
class Lease:
    """One job's lease: how long it lasts and when it runs out (monotonic seconds)."""

    job_id: str
    lease_ms: int
    expires_at_s: float


def check_lease_ms(lease_ms: int) -> int:
    """``lease_ms`` if it is an int in ``LEASE_MS_MIN..LEASE_MS_MAX``, else ``ConfigError``."""
    if isinstance(lease_ms, bool) or not isinstance(lease_ms, int):
        raise ConfigError(f"lease_ms must be an int, got {lease_ms!r}")
    if not LEASE_MS_MIN <= lease_ms <= LEASE_MS_MAX:
        raise ConfigError(f"lease_ms must be in {LEASE_MS_MIN}..{LEASE_MS_MAX}, got {lease_ms}")
    return lease_ms


class LeaseTable:
    """Leases by job id. A job without a lease never expires (its driver did not ask for one).

    Time is passed in (``now_s``, monotonic seconds), so the policy is tested without sleeping.
    """

    def __init__(self, *, leases_max: int = LEASES_MAX) -> None:
        self._leases: dict[str, Lease] = {}
        self._leases_max = leases_max

    def renew(
        self, job_id: str, *, lease_ms: int, now_s: float, at_least_s: float = 0.0
    ) -> Lease:
        """Start or extend ``job_id``'s lease to ``lease_ms`` from ``now_s`` (to ``at_least_s``
        from ``now_s`` if that is longer: a lease taken back after a restart)."""
        check_lease_ms(lease_ms)
        if job_id not in self._leases and len(self._leases) >= self._leases_max:
            raise ConfigError(f"too many leases (at most {self._leases_max})")
        lease = Lease(job_id, lease_ms, now_s + max(lease_ms / 1000.0, at_least_s))
        self._leases[job_id] = lease
        return lease

    def release(self, job_id: str) -> None:
        """Forget ``job_id``'s lease (the job was deregistered); unknown ids are ignored."""
        self._leases.pop(job_id, None)

    def get(self, job_id: str) -> Lease | None:
        """``job_id``'s lease, if it has one."""
        return self._leases.get(job_id)

    def expired(self, *, now_s: float, limit: int) -> list[str]:
        """Up to ``limit`` jobs whose lease ran out by ``now_s``, longest expired first.

        They keep their leases until :meth:`release`, so a failed cleanup is found again.
        """
        due = [lease for lease in self._leases.values() if lease.expires_at_s <= now_s]
        due.sort(key=lambda lease: lease.expires_at_s)
        return [lease.job_id for lease in due[:limit]]

    def __len__(self) -> int:
        return len(self._leases)
