"""Repair: a job that lost a server where no live server had room for its share gets that share
back, on servers with room or on servers launched for it when the cluster may launch."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pocketflow.control.allocator import Allocator
from pocketflow.control.epochs import Epochs
from pocketflow.control.hints import JobDemand, demand_from_hints
from pocketflow.control.job_table import JobRecord, JobTable
from pocketflow.control.packing import missing_share
from pocketflow.errors import PocketflowError

log = logging.getLogger(__name__)

REPAIRS_PER_PASS_MAX = 4
"""Most jobs repaired in one pass of the monitor loop (each may wait for launched servers)."""

REPAIR_RETRY_S = 10.0
"""How long a job whose repair failed (no room, no server could be launched) waits before its
next attempt; the wait doubles with each failure, up to ``REPAIR_RETRY_MAX_S``."""

REPAIR_RETRY_MAX_S = 300.0
"""Longest wait between two repair attempts of one job (each launch waits for a node up to the
registration timeout, so failures must not repeat often)."""

REPAIRS_NOTED_MAX = 4096
"""Most jobs waiting for a repair (as many as the job table holds); the oldest are dropped past
it."""


@dataclass
class _Pending:
    """A job noted for repair: when to try next, and how long to wait after a failure."""

    next_try_s: float
    wait_s: float = REPAIR_RETRY_S


class Repairer:
    """Places the share jobs lost with their servers. Every method is called under the
    controller's lock; a repair's launch waits for its servers with that lock released.

    Only jobs noted here (:meth:`note`: moved off a server that died) are repaired: a job left
    short by a drain keeps its map (the sizing loop drains only what the others can carry, and
    launching for an operator's drain would undo it).
    """

    def __init__(self, jobs: JobTable, allocator: Allocator, epochs: Epochs) -> None:
        self._jobs = jobs
        self._allocator = allocator
        self._epochs = epochs
        self._pending: dict[str, _Pending] = {}

    def note(self, job_ids: Iterable[str], *, now_s: float | None = None) -> None:
        """Repair these jobs (moved off a dead server) if their maps lack share."""
        now_s = time.monotonic() if now_s is None else now_s
        for job_id in job_ids:
            self._pending.setdefault(job_id, _Pending(now_s))
        while len(self._pending) > REPAIRS_NOTED_MAX:
            del self._pending[next(iter(self._pending))]

    def short_jobs(self) -> list[str]:
        """Ids of the noted jobs (still registered) whose map places less than all of their
        demand."""
        return [
            job_id for job_id in self._pending
            if (record := self._jobs.get(job_id)) is not None
            and missing_share(record.allocation(), self._demand(record)) > 0
        ]

    def repair(self, *, now_s: float | None = None) -> list[str]:
        """Give up to ``REPAIRS_PER_PASS_MAX`` noted jobs that are due the share they lack
        (launching the shortfall, within the registration timeout, when the cluster may);
        returns the ids of the jobs moved to a new epoch. Jobs that need nothing (any more)
        are forgotten."""
        now_s = time.monotonic() if now_s is None else now_s
        short = set(self.short_jobs())
        for job_id in [j for j in self._pending if j not in short]:
            del self._pending[job_id]
        repaired: list[str] = []
        due = [job_id for job_id, pending in self._pending.items() if pending.next_try_s <= now_s]
        for job_id in due[:REPAIRS_PER_PASS_MAX]:
            record = self._jobs.get(job_id)
            pending = self._pending.get(job_id)
            if record is None or pending is None:
                continue  # deregistered, or repaired, while an earlier repair launched
            try:
                # A launch waits for its node with the controller's lock released, so other
                # calls (registrations, renewals, heartbeats) do not queue behind it.
                fixed = self._allocator.refilled_or_launched(record, release_lock=True)
            except PocketflowError as exc:
                log.warning("job %s is short of %.0f%% of its share (next try in %.0f s): %s",
                            job_id, 100 * missing_share(record.allocation(), self._demand(record)),
                            pending.wait_s, exc)
                fixed = record.handle.servers
            latest = self._jobs.get(job_id)
            if latest is None:
                self._pending.pop(job_id, None)
                continue
            if latest.handle != record.handle:
                # Moved meanwhile (another epoch: a drain, a death, a growth): this answer is
                # for a map that is gone; the next pass looks at the new one.
                log.info("job %s changed while its repair launched; repaired next pass", job_id)
                continue
            if fixed == record.handle.servers:
                pending.next_try_s = now_s + pending.wait_s
                pending.wait_s = min(pending.wait_s * 2, REPAIR_RETRY_MAX_S)
                continue
            del self._pending[job_id]
            self._epochs.move(job_id, fixed)
            log.info("job %s: its missing share is placed again", job_id)
            repaired.append(job_id)
        return repaired

    def _demand(self, record: JobRecord) -> JobDemand:
        if record.demand:
            return record.job_demand()
        return demand_from_hints(record.hints, self._allocator.spec())
