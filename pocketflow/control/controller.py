"""The ``Controller`` actor: registers jobs, hands out job handles, frees jobs' data, reports."""

from __future__ import annotations

import logging
import re
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pocketflow.auth import make_token, read_secret_file
from pocketflow.control.admin import AdminTokens
from pocketflow.control.allocation import AllocationRequest, ServerState, allocate
from pocketflow.control.metadata import Metadata
from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.errors import ClusterError, InvalidRequest, JobNotRegistered, PocketflowError
from pocketflow.handle import JobHandle, ServerInfo

log = logging.getLogger(__name__)

JOB_NAME_MAX_BYTES = 100
"""Longest job name; the job id adds a dash and a random suffix (JOB_ID_MAX_BYTES is 128)."""

JOB_ID_SUFFIX_BYTES = 3
"""Random bytes of a job id's suffix (printed as 6 hex digits)."""

JOB_ID_ATTEMPTS_MAX = 16
"""How many random suffixes to try before giving up on a unique job id."""

TOKEN_TTL_S_DEFAULT = 24 * 3600.0
"""Lifetime of a job's capability token."""

FIRST_EPOCH = 1

METADATA_CALL_TIMEOUT_S = 30.0
"""Deadline of one call to the ``Metadata`` actor (well inside the driver's controller deadline)."""

METADATA_CALL_ATTEMPTS_MAX = 64
"""Most attempts of one ``Metadata`` call while Ray restarts the actor (within the deadline)."""

METADATA_RETRY_PAUSE_S = 0.25
"""Pause between attempts of a ``Metadata`` call that found the actor dead or restarting."""

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class JobRecord:
    """What the controller remembers about a registered job."""

    handle: JobHandle
    hints: dict[str, Any]
    registered_at_unix_s: float

    def to_metadata(self) -> dict[str, Any]:
        """The record as stored by the ``Metadata`` actor (JSON-compatible)."""
        return {
            "job_id": self.handle.job_id,
            "name": self.handle.name,
            "epoch": self.handle.epoch,
            "weight_map": self.handle.weight_map(),
            "hints": self.hints,
            "registered_at_unix_s": self.registered_at_unix_s,
        }


def validate_job_name(name: str) -> str:
    """Check a job name: 1-100 bytes of letters, digits, ``.``, ``_``, ``-``; alphanumeric first."""
    if not isinstance(name, str) or not _JOB_NAME.match(name):
        raise InvalidRequest(
            f"invalid job name {name!r}: use letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    if len(name.encode()) > JOB_NAME_MAX_BYTES:
        raise InvalidRequest(f"job name longer than {JOB_NAME_MAX_BYTES} bytes: {name!r}")
    return name


class Controller:
    """Registers jobs, computes their weight maps, issues tokens and frees their data.

    Thin glue over the allocation policy (:func:`pocketflow.control.allocation.allocate`), the
    ``Metadata`` actor (job records and op log) and the storage servers' admin actions. Storage
    servers are announced with :meth:`add_server`.

    ``metadata`` is the ``Metadata`` actor's handle, or a plain :class:`Metadata` object when the
    controller runs outside Ray.
    """

    def __init__(
        self,
        *,
        secret_file: str,
        metadata: Any,
        block_size_bytes: int,
        token_ttl_s: float = TOKEN_TTL_S_DEFAULT,
    ) -> None:
        self._secret = read_secret_file(secret_file)
        self._admin = AdminTokens(Path(secret_file))
        self._metadata = metadata
        self._block_size_bytes = block_size_bytes
        self._token_ttl_s = token_ttl_s
        self._servers: dict[str, StorageNodeInfo] = {}
        self._jobs: dict[str, JobRecord] = {}

    # -- servers ----------------------------------------------------------------------------

    def add_server(self, info: StorageNodeInfo) -> None:
        """Make a started storage server available for new jobs."""
        if info.node_id in self._servers:
            raise ClusterError(f"storage server {info.node_id} is already known")
        self._servers[info.node_id] = info

    def servers(self) -> list[StorageNodeInfo]:
        """Every known storage server, ordered by node id."""
        return [self._servers[n] for n in sorted(self._servers)]

    # -- jobs -------------------------------------------------------------------------------

    def register_job(self, name: str, hints: dict[str, Any]) -> JobHandle:
        """Register a job: allocate its servers, tell them its epoch, return its handle.

        ``hints`` is :meth:`pocketflow.job.Hints.to_dict` output.
        """
        validate_job_name(name)
        job_id = self._new_job_id(name)
        request = AllocationRequest(
            latency_sensitive=bool(hints.get("latency_sensitive", True)),
            data_size_bytes=hints.get("data_size_bytes"),
        )
        allocation = allocate(request, self._server_states())
        servers = tuple(
            ServerInfo(
                node_id=p.node_id,
                address=self._servers[p.node_id].address,
                tier=self._servers[p.node_id].tier,
                weight=p.weight,
                persist=p.persist,
            )
            for p in allocation.placements
        )
        handle = JobHandle(
            job_id=job_id,
            name=name,
            epoch=FIRST_EPOCH,
            servers=servers,
            token=make_token(self._secret, job_id, ttl_s=self._token_ttl_s),
            block_size_bytes=self._block_size_bytes,
        )
        weight_map = handle.weight_map()
        for server in servers:
            self._admin.client(server.address).set_epoch(job_id, FIRST_EPOCH, weight_map)
        record = JobRecord(handle=handle, hints=dict(hints), registered_at_unix_s=time.time())
        self._call_metadata("put_job", record.to_metadata())
        self._jobs[job_id] = record
        log.info("registered job %s on %s", job_id, ", ".join(s.node_id for s in servers))
        return handle

    def deregister_job(self, job_id: str) -> dict[str, Any]:
        """Forget a job and free all its non-PERSIST data on every server.

        Returns ``{"job_id", "deleted", "freed_bytes", "unreachable": [node ids]}``. Raises
        ``JobNotRegistered`` for a job that is not registered.
        """
        if job_id not in self._jobs:
            raise JobNotRegistered(f"job {job_id!r} is not registered")
        del self._jobs[job_id]
        self._call_metadata("remove_job", job_id, True)
        deleted = freed_bytes = 0
        unreachable: list[str] = []
        for info in self.servers():
            try:
                result = self._admin.client(info.address).delete_job(job_id)
            except PocketflowError as exc:
                log.warning("delete_job %s on %s failed: %s", job_id, info.node_id, exc)
                self._admin.forget(info.address)
                unreachable.append(info.node_id)
                continue
            deleted += int(result.get("deleted", 0))
            freed_bytes += int(result.get("freed_bytes", 0))
        log.info("deregistered job %s: freed %d bytes", job_id, freed_bytes)
        return {
            "job_id": job_id,
            "deleted": deleted,
            "freed_bytes": freed_bytes,
            "unreachable": unreachable,
        }

    def job_handle(self, job_id: str) -> JobHandle:
        """The handle of a registered job. Raises ``JobNotRegistered``."""
        try:
            return self._jobs[job_id].handle
        except KeyError:
            raise JobNotRegistered(f"job {job_id!r} is not registered") from None

    def jobs(self) -> list[str]:
        """Ids of every registered job, oldest first."""
        return list(self._jobs)

    # -- reporting --------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Servers (with their latest statistics), per-tier capacity and registered jobs."""
        servers = []
        tiers: dict[str, dict[str, int]] = {}
        for info in self.servers():
            row: dict[str, Any] = asdict(info)
            stats = self._stats_or_none(info)
            row["reachable"] = stats is not None
            row["used_bytes"] = int(stats.get("used_bytes", 0)) if stats else 0
            row["objects"] = int(stats.get("objects", 0)) if stats else 0
            row["draining"] = bool(stats.get("draining", False)) if stats else False
            row["cpu_utilization"] = float(stats.get("cpu_utilization", 0.0)) if stats else 0.0
            row["jobs"] = dict(stats.get("jobs", {})) if stats else {}
            servers.append(row)
            tier = tiers.setdefault(
                info.tier, {"servers": 0, "capacity_bytes": 0, "used_bytes": 0}
            )
            tier["servers"] += 1
            tier["capacity_bytes"] += info.capacity_bytes
            tier["used_bytes"] += row["used_bytes"]
        jobs = [
            {
                "job_id": record.handle.job_id,
                "name": record.handle.name,
                "epoch": record.handle.epoch,
                "weight_map": record.handle.weight_map(),
                "registered_at_unix_s": record.registered_at_unix_s,
            }
            for record in self._jobs.values()
        ]
        return {"servers": servers, "tiers": tiers, "jobs": jobs}

    def close(self) -> None:
        """Close the admin connections (the actor is about to be killed)."""
        self._admin.close()

    # -- internals --------------------------------------------------------------------------

    def _new_job_id(self, name: str) -> str:
        for _ in range(JOB_ID_ATTEMPTS_MAX):
            job_id = f"{name}-{secrets.token_hex(JOB_ID_SUFFIX_BYTES)}"
            if job_id not in self._jobs:
                return job_id
        raise ClusterError(f"could not find a free job id for {name!r}")

    def _server_states(self) -> list[ServerState]:
        """Current usage of every server; unreachable servers count as draining."""
        states = []
        for info in self.servers():
            stats = self._stats_or_none(info)
            states.append(
                ServerState(
                    node_id=info.node_id,
                    tier=info.tier,
                    capacity_bytes=info.capacity_bytes,
                    used_bytes=int(stats.get("used_bytes", 0)) if stats else 0,
                    long_running=info.long_running,
                    draining=stats is None or bool(stats.get("draining", False)),
                )
            )
        return states

    def _stats_or_none(self, info: StorageNodeInfo) -> dict[str, Any] | None:
        try:
            return self._admin.client(info.address).stats()
        except PocketflowError as exc:
            log.warning("stats of %s failed: %s", info.node_id, exc)
            self._admin.forget(info.address)
            return None

    def _call_metadata(self, method: str, *args: Any) -> Any:
        if isinstance(self._metadata, Metadata):
            return getattr(self._metadata, method)(*args)
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        # While Ray restarts a dead Metadata actor (which replays its log), calls fail with
        # RayActorError; they are retried until the deadline. Every Metadata mutation may be
        # retried safely (put_job replaces, remove_job is called with missing_ok).
        deadline = time.monotonic() + METADATA_CALL_TIMEOUT_S
        for attempt in range(METADATA_CALL_ATTEMPTS_MAX):
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                break
            try:
                return ray.get(getattr(self._metadata, method).remote(*args), timeout=left_s)
            except GetTimeoutError:
                break
            except RayActorError as exc:
                log.warning("metadata.%s failed (attempt %d): %s", method, attempt + 1, exc)
                time.sleep(min(METADATA_RETRY_PAUSE_S, max(0.0, deadline - time.monotonic())))
        raise ClusterError(
            f"metadata.{method} did not answer within {METADATA_CALL_TIMEOUT_S:.0f}s"
        )
