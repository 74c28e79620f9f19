"""PERSIST data of ended jobs (``pocketflow persist ls/rm``): what jobs that are no longer
registered left on the servers, and deleting it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pocketflow.control.admin import AdminTokens
from pocketflow.control.job_table import JobTable
from pocketflow.control.membership import Membership
from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.errors import InvalidRequest

log = logging.getLogger(__name__)


class PersistAdmin:
    """Lists and deletes ended jobs' data, asking every live server now (not the heartbeats).

    Runs outside the controller's lock (it waits on every server); ``refresh_stats(info)``
    reads a server's stats after a deletion.
    """

    def __init__(
        self,
        membership: Membership,
        jobs: JobTable,
        *,
        admin: AdminTokens,
        refresh_stats: Callable[[StorageNodeInfo], None],
    ) -> None:
        self._membership = membership
        self._jobs = jobs
        self._admin = admin
        self._refresh_stats = refresh_stats

    def list(self) -> dict[str, Any]:
        """``{"jobs": [{"job_id", "servers": {node id: {"objects", "used_bytes"}}, "objects",
        "used_bytes"}], "unreachable": [node ids]}``, jobs sorted by id."""
        registered = set(self._jobs)
        jobs: dict[str, dict[str, Any]] = {}
        results, unreachable = self._admin.on_every_server(
            self._membership.servers(), "stats", lambda admin: admin.stats()
        )
        for info, stats in results:
            for job_id, usage in dict(stats.get("jobs", {})).items():
                if job_id in registered:
                    continue
                row = jobs.setdefault(
                    job_id, {"job_id": job_id, "servers": {}, "objects": 0, "used_bytes": 0}
                )
                objects, used = int(usage.get("objects", 0)), int(usage.get("used_bytes", 0))
                row["servers"][info.node_id] = {"objects": objects, "used_bytes": used}
                row["objects"] += objects
                row["used_bytes"] += used
        return {"jobs": [jobs[j] for j in sorted(jobs)], "unreachable": unreachable}

    def delete(self, job_ids: list[str]) -> dict[str, Any]:
        """Delete everything, PERSIST data included, that the named ended jobs left on every
        server. Raises ``InvalidRequest`` (and deletes nothing) if one of them is registered.
        Returns ``{"deleted", "freed_bytes", "unreachable": [node ids]}``."""
        job_ids = list(dict.fromkeys(job_ids))
        if not job_ids:
            raise InvalidRequest("name at least one job")
        running = [job_id for job_id in job_ids if job_id in self._jobs]
        if running:
            raise InvalidRequest(
                f"job(s) {', '.join(running)} are registered: deregister them first"
            )
        results, unreachable = self._admin.on_every_server(
            self._membership.servers(),
            "persist delete",
            lambda admin: [admin.delete_job(job_id, persist=True) for job_id in job_ids],
        )
        deleted = freed_bytes = 0
        for info, per_job in results:
            deleted += sum(int(result.get("deleted", 0)) for result in per_job)
            freed_bytes += sum(int(result.get("freed_bytes", 0)) for result in per_job)
            self._refresh_stats(info)
        log.info("deleted the data of ended jobs %s: freed %d bytes", job_ids, freed_bytes)
        return {"deleted": deleted, "freed_bytes": freed_bytes, "unreachable": unreachable}
