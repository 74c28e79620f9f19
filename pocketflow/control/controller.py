"""The ``Controller`` actor: registers jobs, hands out job handles, frees jobs' data, reports."""

from __future__ import annotations

import dataclasses
import logging
import re
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pocketflow.auth import make_token, read_secret_file
from pocketflow.control.admin import AdminTokens
from pocketflow.control.allocation import AllocationRequest, ServerState, allocate
from pocketflow.control.metadata import Metadata
from pocketflow.control.storage_node import HEARTBEAT_INTERVAL_MS_DEFAULT, StorageNodeInfo
from pocketflow.errors import (
    ClusterError,
    ConfigError,
    InvalidRequest,
    JobNotRegistered,
    PocketflowError,
)
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

HEARTBEAT_INTERVAL_MS_MIN = 50
"""Shortest accepted heartbeat interval."""

DEAD_AFTER_MS_DEFAULT = 3000
"""A storage server whose heartbeats are missing for this long is declared dead."""

MONITOR_INTERVAL_S_MAX = 0.25
"""Longest pause between two runs of the failure detector."""

ADMIN_CALL_TIMEOUT_S = 5.0
"""Deadline of one admin call (``set_epoch``, ``delete_job``, ``drain``) to a storage server."""

DEAD_SERVERS_KEPT_MAX = 256
"""Most dead servers remembered for ``status``; the oldest are forgotten past it."""

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

    Each server's ``StorageNode`` actor pushes a heartbeat (the server's ``stats``) every
    ``heartbeat_interval_ms``; status and allocation read the latest heartbeat instead of calling
    the servers. A background failure detector declares a server dead when its heartbeats are
    missing for ``dead_after_ms``: the server is forgotten for new jobs, and every job whose weight
    map holds it moves to a new epoch without it (``set_epoch`` on the remaining servers, each call
    bounded by ``ADMIN_CALL_TIMEOUT_S``), so the job's clients get ``stale_epoch`` and the new map
    from any live server.

    The actor runs with several threads (``max_concurrency``) so heartbeats are taken while a
    registration waits; one lock guards the servers and jobs tables.

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
        heartbeat_interval_ms: int = HEARTBEAT_INTERVAL_MS_DEFAULT,
        dead_after_ms: int = DEAD_AFTER_MS_DEFAULT,
        failure_detection: bool = True,
    ) -> None:
        if heartbeat_interval_ms < HEARTBEAT_INTERVAL_MS_MIN:
            raise ConfigError(
                f"heartbeat_interval_ms must be at least {HEARTBEAT_INTERVAL_MS_MIN}, "
                f"got {heartbeat_interval_ms}"
            )
        if dead_after_ms <= heartbeat_interval_ms:
            raise ConfigError(
                f"dead_after_ms ({dead_after_ms}) must exceed heartbeat_interval_ms "
                f"({heartbeat_interval_ms})"
            )
        self._secret = read_secret_file(secret_file)
        self._admin = AdminTokens(Path(secret_file), timeout_s=ADMIN_CALL_TIMEOUT_S)
        self._metadata = metadata
        self._block_size_bytes = block_size_bytes
        self._token_ttl_s = token_ttl_s
        self._heartbeat_interval_ms = int(heartbeat_interval_ms)
        self._dead_after_s = dead_after_ms / 1000.0
        self._lock = threading.RLock()
        # Heartbeats take only this lock, so they never wait behind a registration.
        self._heartbeat_lock = threading.Lock()
        self._servers: dict[str, StorageNodeInfo] = {}
        self._nodes: dict[str, Any] = {}
        self._last_heartbeat: dict[str, float] = {}
        self._heartbeat_stats: dict[str, dict[str, Any]] = {}
        self._dead: dict[str, dict[str, Any]] = {}
        self._jobs: dict[str, JobRecord] = {}
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        if failure_detection:
            self._monitor = threading.Thread(
                target=self._monitor_loop, name="pocketflow-monitor", daemon=True
            )
            self._monitor.start()

    # -- servers ----------------------------------------------------------------------------

    def add_server(self, info: StorageNodeInfo, node: Any = None) -> None:
        """Make a started storage server available for new jobs.

        ``node`` is its ``StorageNode`` actor; when given, the node is told to send heartbeats to
        this controller. Adding counts as a first heartbeat.
        """
        with self._lock:
            if info.node_id in self._servers:
                raise ClusterError(f"storage server {info.node_id} is already known")
            self._servers[info.node_id] = info
            self._nodes[info.node_id] = node
            self._dead.pop(info.node_id, None)
            with self._heartbeat_lock:
                self._last_heartbeat[info.node_id] = time.monotonic()
        if node is not None:
            node.start_heartbeats.remote(self._own_handle(), self._heartbeat_interval_ms)

    def servers(self) -> list[StorageNodeInfo]:
        """Every live storage server, ordered by node id."""
        with self._lock:
            return [self._servers[n] for n in sorted(self._servers)]

    def heartbeat(self, node_id: str, stats: dict[str, Any]) -> None:
        """Take a heartbeat: ``stats`` is the server's ``stats`` answer (docs/PROTOCOL.md).

        Heartbeats of unknown or dead servers are ignored: a dead server stays dead.
        """
        with self._heartbeat_lock:
            if node_id not in self._last_heartbeat:
                return
            self._last_heartbeat[node_id] = time.monotonic()
            self._keep_newer_stats(node_id, stats)

    def _keep_newer_stats(self, node_id: str, stats: dict[str, Any]) -> None:
        """Keep ``stats`` unless a sample taken later is already kept. Callers hold the lock.

        A heartbeat sampled before a ``_refresh_stats`` may arrive after it; it must not
        bring back usage that a deregistration has freed.
        """
        kept = self._heartbeat_stats.get(node_id)
        sampled = float(stats.get("sampled_at_unix_s", 0.0))
        if kept is None or sampled >= float(kept.get("sampled_at_unix_s", 0.0)):
            self._heartbeat_stats[node_id] = dict(stats)

    def _refresh_stats(self, info: StorageNodeInfo) -> None:
        """Read a server's ``stats`` now (after a change the next heartbeat would lag behind)."""
        sampled = time.time()
        try:
            stats = self._admin.client(info.address).stats()
        except PocketflowError as exc:
            log.info("stats of %s failed: %s", info.node_id, exc)
            return
        stats["sampled_at_unix_s"] = sampled
        with self._heartbeat_lock:
            if info.node_id in self._last_heartbeat:
                self._keep_newer_stats(info.node_id, stats)

    def dead_servers(self) -> dict[str, dict[str, Any]]:
        """Servers declared dead: ``node_id -> {"address", "tier", "reason", "at_unix_s"}``."""
        with self._lock:
            return {n: dict(d) for n, d in self._dead.items()}

    def check_failures(self) -> list[str]:
        """Declare dead every server whose heartbeats are missing for ``dead_after_ms``.

        Runs in the background every ``MONITOR_INTERVAL_S_MAX`` at most; returns the node ids
        declared dead by this call.
        """
        declared = []
        for node_id in self._silent_servers():
            with self._lock:
                # Re-checked under the lock: a heartbeat may have come in meanwhile.
                silent_s = self._silent_servers().get(node_id)
                if silent_s is None:
                    continue
                self.declare_dead(node_id, reason=f"no heartbeat for {silent_s:.1f}s")
            declared.append(node_id)
        return declared

    def _silent_servers(self) -> dict[str, float]:
        """``node_id -> seconds since its last heartbeat`` for servers silent too long."""
        now = time.monotonic()
        with self._heartbeat_lock:
            return {
                node_id: now - seen
                for node_id, seen in self._last_heartbeat.items()
                if now - seen > self._dead_after_s
            }

    def declare_dead(self, node_id: str, *, reason: str) -> list[str]:
        """Forget a failed server and move every job that used it to a new epoch without it.

        The server's ``StorageNode`` is told to stop it (a hung server must not come back and
        serve an old epoch). Returns the ids of the jobs that moved to a new epoch.
        """
        with self._lock:
            info = self._servers.pop(node_id, None)
            if info is None:
                return []
            node = self._nodes.pop(node_id, None)
            with self._heartbeat_lock:
                self._last_heartbeat.pop(node_id, None)
                self._heartbeat_stats.pop(node_id, None)
            self._dead[node_id] = {
                "address": info.address,
                "tier": info.tier,
                "reason": reason,
                "at_unix_s": time.time(),
            }
            while len(self._dead) > DEAD_SERVERS_KEPT_MAX:
                del self._dead[next(iter(self._dead))]
            self._admin.forget(info.address)
            log.warning("storage server %s declared dead: %s", node_id, reason)
            moved = [
                job_id
                for job_id, record in self._jobs.items()
                if any(s.node_id == node_id for s in record.handle.servers)
            ]
            for job_id in moved:
                self._exclude_from_job(job_id, node_id)
        if node is not None:
            try:
                node.stop.remote()
            except Exception as exc:  # the actor itself is gone
                log.info("could not ask %s to stop: %s", node_id, exc)
        return moved

    # -- jobs -------------------------------------------------------------------------------

    def register_job(self, name: str, hints: dict[str, Any]) -> JobHandle:
        """Register a job: allocate its servers, tell them its epoch, return its handle.

        ``hints`` is :meth:`pocketflow.job.Hints.to_dict` output.
        """
        validate_job_name(name)
        with self._lock:
            return self._register_job_locked(name, hints)

    def _register_job_locked(self, name: str, hints: dict[str, Any]) -> JobHandle:
        job_id = self._new_job_id(name)
        servers = self._allocate(hints)
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
        with self._lock:
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
            self._refresh_stats(info)
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
            with self._lock:
                return self._jobs[job_id].handle
        except KeyError:
            raise JobNotRegistered(f"job {job_id!r} is not registered") from None

    def jobs(self) -> list[str]:
        """Ids of every registered job, oldest first."""
        with self._lock:
            return list(self._jobs)

    # -- reporting --------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Servers (with their latest heartbeat), per-tier capacity, registered and dead jobs.

        Reads only the heartbeats, never the servers. ``dead_servers`` lists the servers the
        failure detector declared dead.
        """
        servers = []
        tiers: dict[str, dict[str, int]] = {}
        now = time.monotonic()
        for info in self.servers():
            row: dict[str, Any] = asdict(info)
            stats = self._latest_stats(info.node_id)
            with self._heartbeat_lock:
                seen = self._last_heartbeat.get(info.node_id, now)
            row["reachable"] = True
            row["heartbeat_age_ms"] = int((now - seen) * 1000)
            row["bytes_in_per_s"] = int(stats.get("bytes_in_per_s", 0)) if stats else 0
            row["bytes_out_per_s"] = int(stats.get("bytes_out_per_s", 0)) if stats else 0
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
            for record in list(self._jobs.values())
        ]
        return {
            "servers": servers,
            "tiers": tiers,
            "jobs": jobs,
            "dead_servers": self.dead_servers(),
        }

    def close(self) -> None:
        """Stop the background loops and close the admin connections (the actor is ending)."""
        self._stopping.set()
        monitor = self._monitor
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout=ADMIN_CALL_TIMEOUT_S * 2)
        with self._lock:
            self._admin.close()

    # -- internals --------------------------------------------------------------------------

    def _allocate(self, hints: dict[str, Any]) -> tuple[ServerInfo, ...]:
        """A weight map for a job with ``hints`` over the live servers. Callers hold the lock."""
        request = AllocationRequest(
            latency_sensitive=bool(hints.get("latency_sensitive", True)),
            data_size_bytes=hints.get("data_size_bytes"),
        )
        allocation = allocate(request, self._server_states())
        return tuple(
            ServerInfo(
                node_id=p.node_id,
                address=self._servers[p.node_id].address,
                tier=self._servers[p.node_id].tier,
                weight=p.weight,
                persist=p.persist,
            )
            for p in allocation.placements
        )

    def _new_job_id(self, name: str) -> str:
        for _ in range(JOB_ID_ATTEMPTS_MAX):
            job_id = f"{name}-{secrets.token_hex(JOB_ID_SUFFIX_BYTES)}"
            if job_id not in self._jobs:
                return job_id
        raise ClusterError(f"could not find a free job id for {name!r}")

    def _server_states(self) -> list[ServerState]:
        """Usage of every live server from its latest heartbeat."""
        states = []
        for info in self.servers():
            stats = self._latest_stats(info.node_id)
            states.append(
                ServerState(
                    node_id=info.node_id,
                    tier=info.tier,
                    capacity_bytes=info.capacity_bytes,
                    used_bytes=int(stats.get("used_bytes", 0)) if stats else 0,
                    long_running=info.long_running,
                    draining=bool(stats.get("draining", False)) if stats else False,
                )
            )
        return states

    def _latest_stats(self, node_id: str) -> dict[str, Any] | None:
        """The statistics of the server's latest heartbeat, ``None`` before the first one."""
        with self._heartbeat_lock:
            return self._heartbeat_stats.get(node_id)

    def _own_handle(self) -> Any:
        """This actor's handle, for the storage nodes' heartbeats."""
        import ray

        return ray.get_runtime_context().current_actor

    def _monitor_loop(self) -> None:
        """Run the failure detector until ``close``; an error is logged and the loop goes on."""
        interval_s = min(self._heartbeat_interval_ms / 2000.0, MONITOR_INTERVAL_S_MAX)
        while not self._stopping.wait(interval_s):
            try:
                self.check_failures()
            except Exception:
                log.exception("failure detector")

    def _exclude_from_job(self, job_id: str, node_id: str) -> None:
        """Move a job to a new epoch whose weight map no longer holds ``node_id``.

        When no server with a positive weight is left, the job's data servers are allocated
        afresh on the live servers. Callers hold the lock.
        """
        record = self._jobs[job_id]
        kept = [s for s in record.handle.servers if s.node_id != node_id]
        if not any(s.weight > 0 for s in kept):
            try:
                fresh = self._allocate(record.hints)
            except PocketflowError as exc:
                log.error("job %s lost its last data server %s: %s", job_id, node_id, exc)
                fresh = ()
            known = {s.node_id for s in kept}
            kept = [s for s in kept if s.node_id not in {f.node_id for f in fresh}]
            kept += [f for f in fresh if f.node_id not in known or f.weight > 0]
        self._move_to_epoch(job_id, tuple(sorted(kept, key=lambda s: s.node_id)))

    def _move_to_epoch(self, job_id: str, servers: tuple[ServerInfo, ...]) -> JobHandle:
        """Give a job the next epoch with ``servers``: tell the servers, then record it.

        Callers hold the lock. A server that does not answer ``set_epoch`` in time is logged and
        left to the failure detector.
        """
        record = self._jobs[job_id]
        handle = dataclasses.replace(record.handle, epoch=record.handle.epoch + 1, servers=servers)
        weight_map = handle.weight_map()
        for server in servers:
            try:
                self._admin.client(server.address).set_epoch(job_id, handle.epoch, weight_map)
            except PocketflowError as exc:
                log.warning(
                    "set_epoch %s/%d on %s failed: %s", job_id, handle.epoch, server.node_id, exc
                )
                self._admin.forget(server.address)
        record = dataclasses.replace(record, handle=handle)
        self._jobs[job_id] = record
        self._call_metadata("put_job", record.to_metadata())
        log.info(
            "job %s moved to epoch %d on %s",
            job_id, handle.epoch, ", ".join(s.node_id for s in servers),
        )
        return handle

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
