"""Job leases held by drivers: renewed without waiting behind registrations, their lengths logged
so that a restarted controller gives each job its lease again (policy in control/leases.py)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pocketflow.control.leases import Lease, LeaseTable
from pocketflow.errors import JobNotRegistered

log = logging.getLogger(__name__)

LEASE_EXPIRIES_PER_PASS_MAX = 16
"""Most jobs with a run-out lease (dead drivers) deregistered per monitor pass."""


class JobLeases:
    """Each job's driver lease, with a lock of its own: a renewal must not wait behind a
    registration (one that waits for a restarting ``Metadata`` actor, or a launch), or the lease
    would run out while its renewal waits. The controller takes its own lock first when it holds
    both.

    ``call_metadata(method, *args)`` records a lease's length in the job's ``Metadata`` record,
    on a thread of its own (a renewal must not wait for the ``Metadata`` actor either).
    """

    def __init__(self, call_metadata: Callable[..., Any]) -> None:
        self._call_metadata = call_metadata
        self._lock = threading.Lock()
        self._leases = LeaseTable()
        # Lease lengths written to the Metadata records (for a restart), and those being written.
        self._logged: dict[str, int] = {}
        self._logging: set[str] = set()
        self._logger = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease-log")

    def renew(self, job_id: str, *, lease_ms: int, now_s: float) -> None:
        """Start or extend ``job_id``'s lease by ``lease_ms`` from ``now_s``; its length is
        logged (once per change) for a restart."""
        with self._lock:
            self._leases.renew(job_id, lease_ms=lease_ms, now_s=now_s)
            log_it = self._logged.get(job_id) != lease_ms and job_id not in self._logging
            if log_it:
                self._logging.add(job_id)
        if log_it:
            self._logger.submit(self._log_lease, job_id, lease_ms)

    def start(self, job_id: str, *, lease_ms: int, now_s: float, at_least_s: float = 0.0) -> None:
        """Start the lease of a job whose record holds its length already (one registered with
        its lease, or taken back from the log after a restart: then it lasts ``at_least_s``
        at least, so that its driver's renewals, which failed while the controller came up,
        reach it in time)."""
        with self._lock:
            self._leases.renew(job_id, lease_ms=lease_ms, now_s=now_s, at_least_s=at_least_s)
            self._logged[job_id] = lease_ms

    def release(self, job_id: str) -> None:
        """Forget a job's lease (the job ended)."""
        with self._lock:
            self._leases.release(job_id)
            self._logged.pop(job_id, None)

    def get(self, job_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(job_id)

    def due(self, *, now_s: float) -> list[str]:
        """Up to ``LEASE_EXPIRIES_PER_PASS_MAX`` jobs whose lease ran out by ``now_s``."""
        with self._lock:
            return self._leases.expired(now_s=now_s, limit=LEASE_EXPIRIES_PER_PASS_MAX)

    def _log_lease(self, job_id: str, lease_ms: int) -> None:
        """Record a job's lease length in its Metadata record; a failure is retried by the next
        renewal."""
        try:
            self._call_metadata("update_job", job_id, {"lease_ms": int(lease_ms)})
            with self._lock:
                self._logged[job_id] = lease_ms
        except JobNotRegistered:
            pass  # deregistered meanwhile
        except Exception as exc:  # noqa: BLE001 - logged; the next renewal tries again
            log.warning("logging the lease of job %s failed: %s", job_id, exc)
        finally:
            with self._lock:
                self._logging.discard(job_id)

    def close(self) -> None:
        self._logger.shutdown(wait=False, cancel_futures=True)
