"""The ``Metadata`` actor: job records and an append-only log of control-plane operations."""

from __future__ import annotations

import time
from typing import Any

from pocketflow.errors import ClusterError, JobNotRegistered

JOBS_MAX = 4096
"""Most jobs registered at once; registering one more is refused."""

OP_LOG_ENTRIES_MAX = 100_000
"""Most op-log entries kept in memory; the oldest are dropped past it (see ``ops``)."""


class Metadata:
    """Job records plus an append-only, in-memory op log.

    Every change is appended to the op log first, then applied, so that a later restart can rebuild
    the job table by replaying the log. Each entry carries a sequence number that never repeats.
    """

    def __init__(self) -> None:
        self._jobs: dict[str, dict[str, Any]] = {}
        self._ops: list[dict[str, Any]] = []
        self._next_seq = 1

    def put_job(self, record: dict[str, Any]) -> int:
        """Record a newly registered job (``record["job_id"]`` names it); returns the op's seq."""
        job_id = record["job_id"]
        if job_id not in self._jobs and len(self._jobs) >= JOBS_MAX:
            raise ClusterError(f"too many registered jobs (at most {JOBS_MAX})")
        seq = self._append("register_job", job_id=job_id, record=record)
        self._jobs[job_id] = record
        return seq

    def remove_job(self, job_id: str) -> dict[str, Any]:
        """Forget a job; returns its record. Raises ``JobNotRegistered`` if it is unknown."""
        if job_id not in self._jobs:
            raise JobNotRegistered(f"job {job_id!r} is not registered")
        self._append("deregister_job", job_id=job_id)
        return self._jobs.pop(job_id)

    def get_job(self, job_id: str) -> dict[str, Any]:
        """The record of one job. Raises ``JobNotRegistered`` if it is unknown."""
        try:
            return self._jobs[job_id]
        except KeyError:
            raise JobNotRegistered(f"job {job_id!r} is not registered") from None

    def jobs(self) -> list[dict[str, Any]]:
        """Records of every registered job, oldest first."""
        return list(self._jobs.values())

    def ops(self, since_seq: int = 0) -> list[dict[str, Any]]:
        """Op-log entries with a sequence number greater than ``since_seq``, oldest first."""
        return [op for op in self._ops if op["seq"] > since_seq]

    def _append(self, kind: str, **fields: Any) -> int:
        seq = self._next_seq
        self._next_seq += 1
        self._ops.append({"seq": seq, "op": kind, "at_unix_s": time.time(), **fields})
        if len(self._ops) > OP_LOG_ENTRIES_MAX:
            del self._ops[: len(self._ops) - OP_LOG_ENTRIES_MAX]
        return seq
