"""The ``Controller`` actor: registers jobs, hands out job handles, frees jobs' data, reports."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pocketflow.auth import make_token, read_secret_file
from pocketflow.control import NAMESPACE
from pocketflow.control.admin import AdminTokens
from pocketflow.control.cluster_metrics import ClusterMetrics
from pocketflow.control.hints import JobDemand, demand_from_hints
from pocketflow.control.launcher import Launcher, LaunchSpec
from pocketflow.control.leases import LeaseTable
from pocketflow.control.metadata import Metadata
from pocketflow.control.packing import (
    Allocation,
    PackResult,
    ServerLoad,
    grow,
    pack,
    with_allocations,
)
from pocketflow.control.packing import Placement as PackedPlacement
from pocketflow.control.prefix_grants import (
    WAITING_MAX,
    PrefixGrants,
    Waiting,
    grants_from_record,
    grants_record,
)
from pocketflow.control.sizing import (
    AddServer,
    AddThreads,
    RemoveServer,
    RemoveThreads,
    ServerUtilization,
    SizingBounds,
    decide,
)
from pocketflow.control.storage_node import HEARTBEAT_INTERVAL_MS_DEFAULT, StorageNodeInfo
from pocketflow.control.tiers import TIER_NVME, ClusterSpec, local_spec
from pocketflow.errors import (
    CapacityExhausted,
    ClusterError,
    ConfigError,
    InvalidRequest,
    JobNotRegistered,
    PocketflowError,
)
from pocketflow.handle import POOLS_MAX, ROUTES_MAX, JobHandle, LostServer, Routes, ServerInfo
from pocketflow.prefixes import check_prefix, check_prefix_lease_ms
from pocketflow.protocol import EPOCH_MAP_MAX_BYTES, LEASE_PREFIXES_MAX
from pocketflow.tls import read_ca
from pocketflow.transport import AdminClient

log = logging.getLogger(__name__)

T = TypeVar("T")

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

LEASE_EXPIRIES_PER_PASS_MAX = 16
"""Most jobs with a run-out lease (dead drivers) deregistered per monitor pass."""

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

RESTORE_SERVERS_MAX = 4096
"""Most storage nodes a restarted controller takes back."""
RESTORED_GRANT_GRACE_S = 10.0
"""Shortest life a restarted controller gives a prefix grant it took back from the log, so that
the drivers' renewals (which failed while it came up) reach it before the grant lapses."""

PROBE_TIMEOUT_S_MIN = 1.0
"""Shortest deadline of the direct ``stats`` probe of a server whose heartbeats are late.

The probe's deadline is ``dead_after`` (at least this): a server busy on a loaded machine is
not stopped for one slow answer, while a killed one refuses the connection at once and a hung
one is declared dead ``dead_after`` later (about twice ``dead_after`` after it hung)."""

SUSPECT_RECHECK_S = 5.0
"""How often a suspect server (silent, not answering, but its process is running: hung, stopped
or overloaded) is probed again; between probes the failure detector skips it."""

NODE_CALL_TIMEOUT_S = 5.0
"""Deadline of asking a server's ``StorageNode`` actor whether its process still runs."""

DEAD_SERVERS_KEPT_MAX = 256
"""Most dead servers remembered for ``status``; the oldest are forgotten past it."""

REGISTER_TIMEOUT_S_DEFAULT = 60.0
"""How long a registration (or a job's growth) may wait for servers it launches."""

LAUNCH_ROUNDS_MAX = 4
"""Most rounds of "pack, launch the shortfall, pack again" in one registration."""

RELAXED_THROUGHPUT_SHARE = 0.99
"""Share of a tier's free throughput granted to a job that wants more and cannot launch servers
(below 1 so rounding in the packing never turns "all of it" into "not enough")."""

SIZING_INTERVAL_MS_DEFAULT = 5000
"""How often the sizing loop (when enabled) looks at the heartbeats and acts."""

SIZING_ACTIONS_KEPT_MAX = 64
"""Most sizing actions remembered for ``status``."""

DRAIN_NODE_TIMEOUT_S = 30.0
"""How long ``drain_node`` waits for the node's servers to exit."""

DRAIN_POLL_S = 0.2
"""How often ``drain_node`` looks whether the drained servers are gone."""

PREFIX_WAIT_S_MAX = 30.0
"""Longest a prefix declaration may wait for DRAM (well inside the driver's call deadline)."""

POOL_DRAM = "dram"
"""Pool name of the DRAM servers a job's granted prefixes are routed to."""
POOL_NVME = "nvme"
"""Pool name of the NVMe servers a job's spilled prefixes are routed to."""
SERVER_POOL_PREFIX = "dram-"
"""Pools of one DRAM server each (``dram-0``, ...): where prefixes granted on one server go."""

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class JobRecord:
    """What the controller remembers about a registered job."""

    handle: JobHandle
    hints: dict[str, Any]
    registered_at_unix_s: float
    demand: dict[str, Any] = field(default_factory=dict)

    def job_demand(self) -> JobDemand:
        """The demand the job was packed with (:class:`JobDemand`)."""
        return JobDemand.from_dict(self.demand)

    def allocation(self) -> Allocation:
        """The job's current weight map as a packing :class:`Allocation`."""
        return Allocation(
            tuple(
                PackedPlacement(node_id=s.node_id, weight=s.weight, persist=s.persist)
                for s in self.handle.servers
            )
        )

    @classmethod
    def from_metadata(
        cls,
        record: dict[str, Any],
        *,
        token: str,
        block_size_bytes: int,
        tls_ca: str | None = None,
    ) -> JobRecord:
        """A record read back from the ``Metadata`` actor (:meth:`to_metadata` output), with a
        new ``token`` (the log holds none)."""
        handle = JobHandle(
            job_id=str(record["job_id"]),
            name=str(record["name"]),
            epoch=FIRST_EPOCH,
            servers=(),
            token=token,
            block_size_bytes=block_size_bytes,
            tls_ca=tls_ca,
        ).with_weight_map(record["weight_map"])
        return cls(
            handle=handle,
            hints=dict(record.get("hints", {})),
            registered_at_unix_s=float(record["registered_at_unix_s"]),
            demand=dict(record.get("demand", {})),
        )

    def to_metadata(self) -> dict[str, Any]:
        """The record as stored by the ``Metadata`` actor (JSON-compatible)."""
        return {
            "job_id": self.handle.job_id,
            "name": self.handle.name,
            "epoch": self.handle.epoch,
            "weight_map": self.handle.weight_map(),
            "hints": self.hints,
            "demand": self.demand,
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

    Thin glue over the placement policies (:func:`pocketflow.control.hints.demand_from_hints`
    and :func:`pocketflow.control.packing.pack`), the ``Metadata`` actor (job records and op
    log) and the storage servers' admin actions. Storage servers are announced with
    :meth:`add_server`.

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
        cluster_spec: ClusterSpec | None = None,
        launch: LaunchSpec | None = None,
        register_timeout_s: float = REGISTER_TIMEOUT_S_DEFAULT,
        sizing: SizingBounds | None = None,
        sizing_interval_ms: int = SIZING_INTERVAL_MS_DEFAULT,
        tls_dir: str | None = None,
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
        self._tls_ca = read_ca(tls_dir)
        self._admin = AdminTokens(
            Path(secret_file), timeout_s=ADMIN_CALL_TIMEOUT_S, tls_dir=tls_dir
        )
        # Used only by the monitor thread (AdminTokens is not shared between threads).
        self._probe = AdminTokens(
            Path(secret_file),
            timeout_s=max(PROBE_TIMEOUT_S_MIN, dead_after_ms / 1000.0),
            tls_dir=tls_dir,
        )
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
        self._leases = LeaseTable()
        # DRAM granted to declared prefixes (prefix_grants.py); guarded by ``_lock``, whose
        # condition wakes the declarations waiting for it.
        self._grants = PrefixGrants()
        self._grants_changed = threading.Condition(self._lock)
        self._grants_seen: dict[str, Any] = {**self._grants.summary(), "dram_free_bytes": {}}
        # Routed prefixes whose grant lapsed, per job: dropped from its map at its next epoch.
        self._lapsed_routes: dict[str, set[str]] = {}
        # Renewals take only this lock, so a lease does not run out while its renewal waits
        # behind a registration (one that waits for a restarting Metadata actor, or a launch).
        # Taken after ``_lock`` when both are held.
        self._lease_lock = threading.Lock()
        # Lease lengths written to the Metadata records (for a restart), and those being written.
        self._leases_logged: dict[str, int] = {}
        self._leases_logging: set[str] = set()
        self._lease_logger = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease-log")
        self._cluster_spec = cluster_spec
        self._launcher = Launcher(launch) if launch is not None else None
        self._launched: dict[str, Any] = {}
        self._register_timeout_s = register_timeout_s
        self._draining: set[str] = set()
        # Silent servers whose process still runs: ``node_id -> monotonic time last probed``.
        # Not dead (never stopped, data kept) and given no new jobs until they answer again.
        self._suspects: dict[str, float] = {}
        self._sizing = sizing
        self._sizing_interval_s = sizing_interval_ms / 1000.0
        self._sizing_last_action_s: float | None = None
        self._sizing_next_s = time.monotonic() + self._sizing_interval_s
        self._sizing_actions: list[dict[str, Any]] = []
        self._metrics = ClusterMetrics()
        self._stopping = threading.Event()
        self._restored: dict[str, Any] | None = None
        if _restarted_by_ray():
            self._restored = self._restore()
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
        """Every live storage server, ordered by node id.

        Takes no lock (a copy of the table is atomic), so it never waits behind a registration
        that is launching servers.
        """
        return sorted(list(self._servers.values()), key=lambda info: info.node_id)

    def heartbeat(self, node_id: str, stats: dict[str, Any]) -> None:
        """Take a heartbeat: ``stats`` is the server's ``stats`` answer (docs/PROTOCOL.md).

        Heartbeats of unknown or dead servers are ignored: a dead server stays dead.
        """
        with self._heartbeat_lock:
            if node_id not in self._last_heartbeat:
                return
            self._last_heartbeat[node_id] = time.monotonic()
            self._keep_newer_stats(node_id, stats)
            if self._suspects.pop(node_id, None) is not None:
                log.warning("storage server %s answers again; no longer suspect", node_id)

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
        try:
            stats = self._admin.sampled_stats(info.address)
        except PocketflowError as exc:
            log.info("stats of %s failed: %s", info.node_id, exc)
            return
        with self._heartbeat_lock:
            if info.node_id in self._last_heartbeat:
                self._keep_newer_stats(info.node_id, stats)

    def dead_servers(self) -> dict[str, dict[str, Any]]:
        """Servers declared dead: ``node_id -> {"address", "tier", "reason", "at_unix_s"}``."""
        return {n: dict(d) for n, d in list(self._dead.items())}

    def check_failures(self) -> list[str]:
        """Declare dead every server whose heartbeats are missing for ``dead_after_ms``, that does
        not answer a direct probe either, and whose process is gone (or whose node cannot say).

        A silent server whose process still runs (hung, SIGSTOPped, overloaded) is a *suspect*
        instead: never stopped, its data kept, no new jobs placed on it, probed again every
        ``SUSPECT_RECHECK_S``; its next heartbeat or answer clears it.

        Runs in the background every ``MONITOR_INTERVAL_S_MAX`` at most; returns the node ids
        declared dead by this call.
        """
        declared = []
        for node_id in self._silent_servers():
            info = self._servers.get(node_id)
            if info is not None:
                with self._heartbeat_lock:
                    probed = self._suspects.get(node_id)
                if probed is not None and time.monotonic() - probed < SUSPECT_RECHECK_S:
                    continue
                if self._answers(info):
                    continue
                if self._process_runs(node_id):
                    # Hung, stopped or overloaded, not gone: its data stays, it gets no new
                    # jobs, and its clients' calls fail within their op timeout meanwhile.
                    with self._heartbeat_lock:
                        if node_id not in self._suspects:
                            log.warning("storage server %s is silent but its process runs; "
                                        "suspect, not dead", node_id)
                        self._suspects[node_id] = time.monotonic()
                    continue
            with self._lock:
                # Re-checked under the lock: a heartbeat may have come in meanwhile.
                silent_s = self._silent_servers().get(node_id)
                if silent_s is None:
                    continue
                if node_id in self._draining:
                    self._retire(node_id)
                    continue
                self.declare_dead(node_id, reason=f"no heartbeat for {silent_s:.1f}s")
            declared.append(node_id)
        return declared

    def _answers(self, info: StorageNodeInfo) -> bool:
        """Whether a silent server still answers ``stats`` within the probe's deadline.

        Heartbeats travel through Ray and can be late on a loaded machine; a server that
        answers is alive and its answer counts as a heartbeat. A killed server refuses the
        connection at once, a hung one costs one probe deadline (``dead_after``).
        """
        try:
            stats = self._probe.sampled_stats(info.address)
        except PocketflowError:
            self._probe.forget(info.address)
            return False
        log.warning("heartbeats of %s are late but it answers; still alive", info.node_id)
        self.heartbeat(info.node_id, stats)
        return True

    def _process_runs(self, node_id: str) -> bool:
        """Whether the server's process still runs, by its ``StorageNode`` actor (on the
        server's own machine). An actor that cannot answer counts as gone."""
        import ray

        node = self._nodes.get(node_id)
        if node is None:
            return False
        try:
            return bool(ray.get(node.alive.remote(), timeout=NODE_CALL_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - any failure to answer means gone
            log.info("the node of %s did not answer: %s", node_id, exc)
            return False

    def suspect_servers(self) -> list[str]:
        """Servers that are silent but whose process runs (see ``check_failures``)."""
        with self._heartbeat_lock:
            return sorted(self._suspects)

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
            self._admin.forget(info.address)
            log.warning("storage server %s declared dead: %s", node_id, reason)
            moved: list[str] = []
            try:
                moved = self._move_jobs_off(LostServer(node_id, info.address))
            finally:
                # Listed as dead only once its jobs have moved (dead_servers reads without the
                # lock): whoever sees it dead also finds the jobs' new epochs on the servers.
                self._remember_dead(node_id, address=info.address, tier=info.tier, reason=reason)
        if node is not None:
            try:
                node.stop.remote()
            except Exception as exc:  # the actor itself is gone
                log.info("could not ask %s to stop: %s", node_id, exc)
        return moved

    def _move_jobs_off(self, lost: LostServer) -> list[str]:
        """Move every job whose map holds ``lost`` to a new epoch without it; returns their ids.
        Callers hold the lock."""
        moved = [
            job_id
            for job_id, record in self._jobs.items()
            if any(s.node_id == lost.node_id for s in record.handle.servers)
        ]
        for job_id in moved:
            # The map remembers the lost server, so that reads of what it held raise
            # DataUnavailable instead of ObjectNotFound (see pocketflow.handle).
            record = self._jobs[job_id]
            self._jobs[job_id] = dataclasses.replace(record, handle=record.handle.with_lost(lost))
            self._exclude_from_job(job_id, lost.node_id)
        return moved

    def _remember_dead(
        self, node_id: str, *, address: str, tier: str, reason: str, keep_known: bool = False
    ) -> None:
        """List a server as dead (the oldest beyond ``DEAD_SERVERS_KEPT_MAX`` are forgotten);
        with ``keep_known``, a server already listed keeps its entry."""
        if keep_known and node_id in self._dead:
            return
        self._dead[node_id] = {
            "address": address, "tier": tier, "reason": reason, "at_unix_s": time.time()
        }
        while len(self._dead) > DEAD_SERVERS_KEPT_MAX:
            del self._dead[next(iter(self._dead))]

    # -- jobs -------------------------------------------------------------------------------

    def register_job(self, name: str, hints: dict[str, Any]) -> JobHandle:
        """Register a job: allocate its servers, tell them its epoch, return its handle.

        ``hints`` is :meth:`pocketflow.job.Hints.to_dict` output.
        """
        validate_job_name(name)
        with self._lock:
            handle = self._register_job_locked(name, hints)
        self._metrics.count("registrations")
        return handle

    def _register_job_locked(self, name: str, hints: dict[str, Any]) -> JobHandle:
        job_id = self._new_job_id(name)
        demand = demand_from_hints(hints, self._spec())
        deadline = time.monotonic() + self._register_timeout_s
        allocation = self._pack_or_launch(
            lambda loads, d: pack(d, loads, self._spec()), demand=demand, deadline_s=deadline
        )
        servers = self._server_infos(allocation)
        handle = JobHandle(
            job_id=job_id,
            name=name,
            epoch=FIRST_EPOCH,
            servers=servers,
            token=make_token(self._secret, job_id, ttl_s=self._token_ttl_s),
            block_size_bytes=self._block_size_bytes,
            tls_ca=self._tls_ca,
        )
        weight_map = handle.weight_map()
        for server in servers:
            self._admin.client(server.address).set_epoch(job_id, FIRST_EPOCH, weight_map)
        record = JobRecord(
            handle=handle,
            hints=dict(hints),
            registered_at_unix_s=time.time(),
            demand=demand.to_dict(),
        )
        self._call_metadata("put_job", record.to_metadata())
        self._jobs[job_id] = record
        log.info("registered job %s on %s", job_id, ", ".join(s.node_id for s in servers))
        return handle

    def grow_job(self, job_id: str, hints: dict[str, Any]) -> JobHandle:
        """Give a running job more room: a new epoch whose weight map adds servers.

        ``hints`` are the job's new hints. Servers are launched when the growth does not fit.
        Every server of the old map stays in the new one (weight 0 at least), so data written
        under older epochs stays readable; clients holding the old handle get ``stale_epoch``
        with the new map and retry. Returns the new handle (the old one if nothing changed).
        """
        with self._lock:
            record = self._record(job_id)
            old = record.job_demand()
            new = demand_from_hints(hints, self._spec())
            current = record.allocation()
            deadline = time.monotonic() + self._register_timeout_s
            allocation = self._pack_or_launch(
                lambda loads, d: grow(
                    current,
                    old=old if d is new else _without_throughput(old),
                    new=d,
                    servers=loads,
                    spec=self._spec(),
                ),
                demand=new,
                deadline_s=deadline,
            )
            if allocation == current:
                return record.handle
            self._jobs[job_id] = dataclasses.replace(
                record, hints=dict(hints), demand=new.to_dict()
            )
            return self._move_to_epoch(job_id, self._server_infos(allocation))

    def deregister_job(self, job_id: str) -> dict[str, Any]:
        """Forget a job and free all its non-PERSIST data on every server.

        Returns ``{"job_id", "deleted", "freed_bytes", "unreachable": [node ids]}``. Raises
        ``JobNotRegistered`` for a job that is not registered.
        """
        with self._lock:
            if job_id not in self._jobs:
                raise JobNotRegistered(f"job {job_id!r} is not registered")
            del self._jobs[job_id]
            with self._lease_lock:
                self._leases.release(job_id)
                self._leases_logged.pop(job_id, None)
            self._grants.release_job(job_id, "the job was deregistered while it waited")
            self._lapsed_routes.pop(job_id, None)
            self._serve_grants_locked()
            self._grants_changed.notify_all()  # its waiting declarations end now
            self._call_metadata("remove_job", job_id, True)
        self._metrics.count("deregistrations")
        results, unreachable = self._admin_on_every_server(
            f"delete_job {job_id}", lambda admin: admin.delete_job(job_id)
        )
        deleted = freed_bytes = 0
        for info, result in results:
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

    def _admin_on_every_server(
        self, what: str, call: Callable[[AdminClient], T]
    ) -> tuple[list[tuple[StorageNodeInfo, T]], list[str]]:
        """Run ``call`` with the admin client of every live server, one after another. Returns
        the servers that answered with their results, and the node ids of those that failed
        (logged, their connection forgotten)."""
        results: list[tuple[StorageNodeInfo, T]] = []
        unreachable: list[str] = []
        for info in self.servers():
            try:
                results.append((info, call(self._admin.client(info.address))))
            except PocketflowError as exc:
                log.warning("%s on %s failed: %s", what, info.node_id, exc)
                self._admin.forget(info.address)
                unreachable.append(info.node_id)
        return results, unreachable

    # -- PERSIST data of ended jobs (`pocketflow persist ls/rm`) ---------------------------------

    def persist_list(self) -> dict[str, Any]:
        """What jobs that are no longer registered left on the servers (their PERSIST data).

        Returns ``{"jobs": [{"job_id", "servers": {node id: {"objects", "used_bytes"}},
        "objects", "used_bytes"}], "unreachable": [node ids]}``, jobs sorted by id. Read from
        each server's ``stats`` now, not from the last heartbeat.
        """
        registered = set(self._jobs)
        jobs: dict[str, dict[str, Any]] = {}
        results, unreachable = self._admin_on_every_server("stats", lambda admin: admin.stats())
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

    def persist_delete(self, job_ids: list[str]) -> dict[str, Any]:
        """Delete everything, PERSIST data included, that the named ended jobs left on every
        server. Raises ``InvalidRequest`` (and deletes nothing) if one of them is registered.

        Returns ``{"deleted", "freed_bytes", "unreachable": [node ids]}``.
        """
        job_ids = list(dict.fromkeys(job_ids))
        if not job_ids:
            raise InvalidRequest("name at least one job")
        running = [job_id for job_id in job_ids if job_id in self._jobs]
        if running:
            raise InvalidRequest(
                f"job(s) {', '.join(running)} are registered: deregister them first"
            )
        results, unreachable = self._admin_on_every_server(
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

    # -- restart ------------------------------------------------------------------------------

    def _restore(self) -> dict[str, Any]:
        """Rebuild the tables after Ray restarted this actor (the previous instance crashed): the
        storage servers from their ``StorageNode`` actors (which go on sending heartbeats to
        this actor), the jobs from the ``Metadata`` actor's records, with a new token each and
        a new lease for each job that had one. Tasks notice nothing: they talk to the servers.

        Dead servers are rebuilt from nodes whose process is gone and from the jobs' ``lost``
        lists, draining marks from the servers' own stats, prefix grants from the jobs'
        records (:meth:`_restore_grants`). Returns what was restored (``restored()``).
        Not restored: servers launched by the crashed instance (Ray ends them with it), and the
        sizing history.
        """
        import ray

        from pocketflow.control import STORAGE_NODE_ACTOR_PREFIX

        names = sorted(
            str(entry["name"])
            for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry.get("namespace") == NAMESPACE
            and str(entry.get("name", "")).startswith(STORAGE_NODE_ACTOR_PREFIX)
        )
        servers: list[str] = []
        for name in names[:RESTORE_SERVERS_MAX]:
            try:
                node = ray.get_actor(name, namespace=NAMESPACE)
                info, alive = ray.get(
                    [node.info.remote(), node.alive.remote()], timeout=ADMIN_CALL_TIMEOUT_S
                )
            except Exception as exc:  # noqa: BLE001 - a node that cannot answer is left out
                log.warning("restart: storage node %s did not answer: %s", name, exc)
                continue
            if not alive:
                self._remember_dead(info.node_id, address=info.address, tier=info.tier,
                                    reason="its process was gone when the controller restarted")
                continue
            self.add_server(info, node)
            servers.append(info.node_id)
            try:
                stats = ray.get(node.stats.remote(), timeout=ADMIN_CALL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - the next heartbeat brings them
                log.warning("restart: stats of %s failed: %s", info.node_id, exc)
                continue
            with self._heartbeat_lock:
                self._keep_newer_stats(info.node_id, stats)
            if stats.get("draining"):
                self._draining.add(info.node_id)
        now_s = time.monotonic()
        jobs: list[str] = []
        leases: dict[str, int] = {}
        logged_grants: dict[str, object] = {}
        for record in self._call_metadata("jobs"):
            job_id = str(record["job_id"])
            token = make_token(self._secret, job_id, ttl_s=self._token_ttl_s)
            self._jobs[job_id] = JobRecord.from_metadata(
                record, token=token, block_size_bytes=self._block_size_bytes,
                tls_ca=self._tls_ca,
            )
            if record.get("lease_ms"):
                with self._lease_lock:
                    self._leases.renew(job_id, lease_ms=int(record["lease_ms"]), now_s=now_s)
                    self._leases_logged[job_id] = int(record["lease_ms"])
                leases[job_id] = int(record["lease_ms"])
            if record.get("grants"):
                logged_grants[job_id] = record["grants"]
            jobs.append(job_id)
        grants = self._restore_grants(logged_grants, now_s)
        # Servers in the jobs' maps that are gone are lost now, as the failure detector would
        # have declared them: their jobs move to new epochs without them.
        gone = {
            s.node_id: LostServer(s.node_id, s.address)
            for record in self._jobs.values() for s in record.handle.servers
            if s.node_id not in self._servers
        }
        for lost in gone.values():
            with self._lock:
                moved = self._move_jobs_off(lost)
            log.warning("restart: %s is gone; moved jobs %s off it", lost.node_id, moved)
        for job_id, record in self._jobs.items():
            for lost in record.handle.lost:
                self._remember_dead(
                    lost.node_id, address=lost.address, tier="unknown", keep_known=True,
                    reason=f"lost by job {job_id} before the controller restarted",
                )
        log.warning("restarted after a crash: restored %d storage servers, %d jobs and %d "
                    "prefix grants", len(servers), len(jobs), grants)
        return {"servers": servers, "jobs": jobs, "leases": leases, "grants": grants}

    def _restore_grants(self, logged: dict[str, object], now_s: float) -> int:
        """Take back the prefix grants the jobs' records hold (written with each route change)
        before anything moves a job to a new epoch: each gets a whole lease from now, at least
        ``RESTORED_GRANT_GRACE_S`` (the drivers' renewals failed while this instance came up,
        and reach it only once their next period comes), so the keepers that go on renewing
        keep it, and a grant nobody renews (its prefix ended just before the crash) lapses
        then. Shares on servers that are not back are dropped; a prefix no longer routed is
        skipped. Returns how many were taken back."""
        restored = 0
        for job_id, record in logged.items():
            job = self._jobs.get(job_id)
            if job is None:
                continue
            routed = {prefix for prefix, _pool in job.handle.routes.routes}
            for grant in grants_from_record(job_id, record, now_s):
                shares = {n: b for n, b in grant.shares.items() if n in self._servers}
                if grant.prefix not in routed or not shares:
                    continue
                grant.shares = shares
                grant.expires_at_s = max(grant.expires_at_s, now_s + RESTORED_GRANT_GRACE_S)
                restored += self._grants.restore(grant)
        self._prefix_grants_locked()  # status shows them from the start
        return restored

    def restored(self) -> dict[str, Any] | None:
        """What this instance rebuilt after a crash (``{"servers", "jobs", "leases", "grants"}``,
        leases as job id -> lease_ms, grants as a count), or ``None`` if it is the first
        instance."""
        return self._restored

    def pid(self) -> int:
        """This actor's process id (to tell instances apart, and for fault tests)."""
        return os.getpid()

    # -- leases (driver liveness; policy in control/leases.py) ----------------------------------

    def renew_lease(self, job_id: str, lease_ms: int) -> float:
        """Start or extend a job's lease by ``lease_ms``; returns the seconds it now lasts.

        A job whose lease runs out (its driver died) is deregistered by the monitor loop, which
        frees its non-PERSIST data. Raises ``JobNotRegistered`` for an unknown job.
        """
        now_s = time.monotonic()
        # No ``_lock``: a renewal must not wait behind a registration. A job deregistered just
        # after this check leaves a lease that expire_leases finds and releases.
        if job_id not in self._jobs:
            raise JobNotRegistered(f"job {job_id!r} is not registered")
        with self._lease_lock:
            self._leases.renew(job_id, lease_ms=lease_ms, now_s=now_s)
            log_it = (self._leases_logged.get(job_id) != lease_ms
                      and job_id not in self._leases_logging)
            if log_it:
                self._leases_logging.add(job_id)
        if log_it:
            # A restarted controller gives the job a lease of this length again. Logged on a
            # thread of its own: a renewal must not wait for the Metadata actor either.
            self._lease_logger.submit(self._log_lease, job_id, lease_ms)
        return lease_ms / 1000.0

    def _log_lease(self, job_id: str, lease_ms: int) -> None:
        """Record a job's lease length in its Metadata record; a failure is retried by the next
        renewal."""
        try:
            self._call_metadata("update_job", job_id, {"lease_ms": int(lease_ms)})
            with self._lease_lock:
                self._leases_logged[job_id] = lease_ms
        except JobNotRegistered:
            pass  # deregistered meanwhile
        except Exception as exc:  # noqa: BLE001 - logged; the next renewal tries again
            log.warning("logging the lease of job %s failed: %s", job_id, exc)
        finally:
            with self._lease_lock:
                self._leases_logging.discard(job_id)

    def expire_leases(self) -> list[str]:
        """Deregister up to ``LEASE_EXPIRIES_PER_PASS_MAX`` jobs whose lease ran out."""
        with self._lease_lock:
            due = self._leases.expired(now_s=time.monotonic(), limit=LEASE_EXPIRIES_PER_PASS_MAX)
        expired = []
        for job_id in due:
            with self._lock:
                # Re-checked once no registration runs (renewals do not wait for it): the
                # driver may have renewed meanwhile.
                with self._lease_lock:
                    lease = self._leases.get(job_id)
                if lease is None or lease.expires_at_s > time.monotonic():
                    continue
            log.warning("job %s: its driver's lease ran out; deregistering it", job_id)
            try:
                self.deregister_job(job_id)
            except JobNotRegistered:
                with self._lease_lock:
                    self._leases.release(job_id)
            expired.append(job_id)
        return expired

    def renew_token(self, job_id: str) -> JobHandle:
        """Give a registered job a new token valid for the cluster's token TTL from now; returns
        the job's handle with it (later handles carry it too). The old token stays valid until it
        expires. Raises ``JobNotRegistered``.
        """
        # No ``_lock``: the driver's lease thread calls this, and must not wait behind a
        # registration. An epoch move racing with it may keep the older token in the record;
        # both tokens are valid, and the caller gets the new one.
        record = self._record(job_id)
        token = make_token(self._secret, job_id, ttl_s=self._token_ttl_s)
        handle = dataclasses.replace(record.handle, token=token)
        if self._jobs.get(job_id) is record:
            self._jobs[job_id] = dataclasses.replace(record, handle=handle)
        return handle

    def job_handle(self, job_id: str) -> JobHandle:
        """The handle of a registered job. Raises ``JobNotRegistered``."""
        with self._lock:
            return self._record(job_id).handle

    def jobs(self) -> list[str]:
        """Ids of every registered job, oldest first."""
        with self._lock:
            return list(self._jobs)

    # -- prefix grants (policy in control/prefix_grants.py) ------------------------------------

    def declare_prefixes(
        self,
        job_id: str,
        requests: list[tuple[str, int]],
        lease_ms: int,
        wait_s: float,
    ) -> dict[str, Any]:
        """Place declared prefixes of a job: grant each ``(prefix, size_bytes)`` DRAM, waiting
        for it in the FIFO at most ``wait_s``; what is still waiting then spills to NVMe.

        Granted prefixes are routed to the job's DRAM pool and spilled ones to its NVMe pool,
        in one new epoch (``set_epoch`` on the job's servers). A prefix that is granted already
        keeps its grant (renewed), one that spilled keeps its route. Returns ``{"handle",
        "dram": [...], "nvme": [...], "default": [...], "waited_s"}``; ``default`` lists the
        prefixes no pool could take (no NVMe server), left to the job's weights. Raises
        ``JobNotRegistered``, and ``InvalidRequest`` for a bad request or more routes than a
        map holds.
        """
        requests = _declarations(requests)
        check_prefix_lease_ms(lease_ms)
        if not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= PREFIX_WAIT_S_MAX:
            raise InvalidRequest(f"wait_s must be a number in 0..{PREFIX_WAIT_S_MAX}")
        started = time.monotonic()
        with self._grants_changed:
            record = self._record(job_id)
            self._expire_grants_locked(started)
            live = self._grants.granted(job_id)
            self._grants.renew(job_id, [p for p, _ in requests if p in live], started)
            lapsed = self._lapsed_routes.get(job_id, set())
            routed = {p for p, _pool in record.handle.routes.routes if p not in lapsed}
            todo = [(p, n) for p, n in requests if p not in live and p not in routed]
            if len(routed | {p for p, _ in todo}) > ROUTES_MAX:
                raise InvalidRequest(f"a job routes at most {ROUTES_MAX} prefixes")
            # Each new route adds `"prefix":"pool",` to the map servers must accept.
            grown = len(json.dumps(record.handle.weight_map(), separators=(",", ":"))) + sum(
                len(json.dumps(p)) + 8 for p, _ in todo)
            if grown > EPOCH_MAP_MAX_BYTES:
                raise InvalidRequest(
                    f"the routes would make the job's weight map larger than "
                    f"{EPOCH_MAP_MAX_BYTES} bytes: declare fewer or shorter sized prefixes")
            waiting = Waiting(job_id, collections.deque(todo), lease_ms / 1000.0)
            if todo and self._grants.waiting() < WAITING_MAX:
                self._grants.enqueue(waiting)
                self._serve_grants_locked()
                deadline = started + wait_s
                while waiting.pending and waiting.cancelled is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._grants_changed.wait(left)
                self._grants.leave(waiting)
                self._serve_grants_locked()  # what waited behind this one may fit now
            if waiting.cancelled is not None:
                raise JobNotRegistered(f"job {job_id!r}: {waiting.cancelled}")
            spilled = [p for p, _ in waiting.pending]
            handle, placed = self._route_locked(job_id, waiting.granted, spilled)
        waited_s = time.monotonic() - started
        if waiting.granted or spilled:
            log.info("job %s: %d prefixes granted DRAM, %d spilled after %.2f s", job_id,
                     len(waiting.granted), len(spilled), waited_s)
        return {
            "handle": handle,
            "dram": list(waiting.granted),
            "nvme": [p for p in spilled if placed],
            "default": [] if placed else spilled,
            "waited_s": waited_s,
        }

    def renew_prefixes(self, job_id: str, prefixes: list[str]) -> int:
        """Extend the grants of a job's ``prefixes`` by their lease (one call per renewal period
        from the driver); returns how many of them hold a grant. Raises ``JobNotRegistered``."""
        # Not under ``_lock``: a renewal must not wait behind a registration (the grants have a
        # lock of their own); the monitor pass takes lapsed grants back.
        self._record(job_id)
        return self._grants.renew(job_id, list(prefixes), time.monotonic())

    def end_prefixes(self, job_id: str, prefixes: list[str]) -> int:
        """Take back the grants of a job's ``prefixes`` now (the job ended them: its servers
        freed their data) and give the DRAM to waiting declarations first; their routes go with
        the next route change, as a lapsed grant's do. Returns how many held a grant. Raises
        ``JobNotRegistered``, and ``InvalidRequest`` for more than ``LEASE_PREFIXES_MAX``
        prefixes."""
        if not isinstance(prefixes, list) or len(prefixes) > LEASE_PREFIXES_MAX or not all(
                isinstance(p, str) for p in prefixes):
            raise InvalidRequest(f"prefixes must be a list of at most {LEASE_PREFIXES_MAX} str")
        with self._lock:
            self._record(job_id)
            ended = self._grants.end(job_id, prefixes)
            if ended:
                self._lapsed_routes.setdefault(job_id, set()).update(g.prefix for g in ended)
                self._serve_grants_locked()
        return len(ended)

    def expire_grants(self) -> int:
        """Take back the grants whose lease lapsed and give their DRAM to waiting declarations;
        returns how many lapsed."""
        with self._lock:
            return self._expire_grants_locked(time.monotonic())

    def prefix_grants(self) -> dict[str, Any]:
        """Live grants, granted bytes, waiting declarations and prefixes, and the DRAM each
        DRAM server has left for new grants (``dram_free_bytes``)."""
        with self._lock:
            return self._prefix_grants_locked()

    def _prefix_grants_locked(self) -> dict[str, Any]:
        free = {node_id: max(free, 0) for node_id, free in self._dram_free(grants=True).items()}
        self._grants_seen = {**self._grants.summary(), "dram_free_bytes": free}
        return self._grants_seen

    def _prefix_grants_now(self) -> dict[str, Any]:
        """:meth:`prefix_grants` without waiting: when a registration holds the lock (it may
        wait for a launch), the figures of the last time they were computed, ``stale``."""
        if not self._lock.acquire(blocking=False):
            return {**self._grants_seen, "stale": True}
        try:
            return self._prefix_grants_locked()
        finally:
            self._lock.release()

    def _record(self, job_id: str) -> JobRecord:
        """The record of a registered job, else ``JobNotRegistered``."""
        record = self._jobs.get(job_id)
        if record is None:
            raise JobNotRegistered(f"job {job_id!r} is not registered")
        return record

    def _expire_grants_locked(self, now_s: float) -> int:
        lapsed = self._grants.expire(now_s)
        for grant in lapsed:
            if grant.job_id in self._jobs:
                self._lapsed_routes.setdefault(grant.job_id, set()).add(grant.prefix)
        if lapsed:
            self._serve_grants_locked()
        return len(lapsed)

    def _serve_grants_locked(self) -> None:
        """Give free DRAM to the waiting declarations (in order) and wake them."""
        if not self._grants.waiting():
            return
        # Grants not counted: ``serve`` takes them off itself.
        free = self._dram_free(grants=False)
        if self._grants.serve(free, self._dram_pool, time.monotonic()):
            self._grants_changed.notify_all()

    def _dram_free(self, *, grants: bool) -> dict[str, int]:
        """What each active DRAM server has neither reserved for jobs nor (with ``grants``)
        granted to prefixes."""
        return {
            load.node_id: load.capacity_bytes - load.allocated_capacity_bytes
            for load in self._server_loads(grants=grants)
            if load.tier == POOL_DRAM and load.active
        }

    def _pool(self, job_id: str, name: str) -> list[str]:
        """The members of a job's pool ``name``: those its map names already (routed keys must
        not move), else every live, active server of that tier."""
        record = self._jobs.get(job_id)
        if record is not None:
            named = record.handle.routes.pool_map().get(name)
            if named:
                return [m for m in named if m in self._servers]
        return sorted(
            info.node_id for info in self._servers.values()
            if info.tier == name and info.node_id not in self._draining
            and info.node_id not in self._suspects
        )

    def _dram_pool(self, job_id: str) -> list[str]:
        return self._pool(job_id, POOL_DRAM)

    def _route_locked(
        self, job_id: str, granted: list[str], spilled: list[str]
    ) -> tuple[JobHandle, bool]:
        """Route ``granted`` prefixes to the job's DRAM pool and ``spilled`` ones to its NVMe
        pool, dropping routes whose grant lapsed, in a new epoch when anything changed. Returns
        the job's handle and whether spilled prefixes had an NVMe pool to go to."""
        record = self._jobs[job_id]
        handle = record.handle
        lapsed = self._lapsed_routes.pop(job_id, set()) - set(granted) - set(spilled)
        routes = handle.routes.without(lapsed) if lapsed else handle.routes
        defined = routes.pool_map()
        pools: dict[str, list[str]] = {}
        new: dict[str, str] = {}
        grants = self._grants.granted(job_id)
        spread: list[str] = []
        for prefix in granted:  # a grant on one server routes the prefix to that server alone
            grant = grants.get(prefix)
            name = None
            if grant is not None and len(grant.shares) == 1:
                name = _server_pool(next(iter(grant.shares)), {**defined, **pools})
            if name is None:
                spread.append(prefix)
            else:
                pools.setdefault(name, list(grant.shares))
                new[prefix] = name
        for name, prefixes in ((POOL_DRAM, spread), (POOL_NVME, spilled)):
            members = self._pool(job_id, name)
            if prefixes and members:
                pools.setdefault(name, members)
                new.update(dict.fromkeys(prefixes, name))
        placed = not spilled or POOL_NVME in pools
        if not new and not lapsed:
            return handle, placed
        routes = routes.with_routes({n: m for n, m in pools.items() if n not in defined}, new)
        servers = list(handle.servers)
        listed = {s.node_id for s in servers}
        for _name, members in routes.pools:
            for node_id in members:
                info = self._servers.get(node_id)
                if node_id not in listed and info is not None:
                    servers.append(ServerInfo(node_id, info.address, info.tier, 0.0))
                    listed.add(node_id)
        return self._move_to_epoch(job_id, tuple(servers), routes=routes), placed

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
            with self._heartbeat_lock:
                stats = self._heartbeat_stats.get(info.node_id) or {}
                seen = self._last_heartbeat.get(info.node_id, now)
            row["reachable"] = True
            row["heartbeat_age_ms"] = int((now - seen) * 1000)
            row["bytes_in_per_s"] = int(stats.get("bytes_in_per_s", 0))
            row["bytes_out_per_s"] = int(stats.get("bytes_out_per_s", 0))
            row["throughput_bytes_per_s"] = _measured_throughput(stats)
            row["used_bytes"] = int(stats.get("used_bytes", 0))
            row["objects"] = int(stats.get("objects", 0))
            row["draining"] = bool(stats.get("draining", False))
            row["cpu_utilization"] = float(stats.get("cpu_utilization", 0.0))
            row["jobs"] = dict(stats.get("jobs", {}))
            # The totals the server's /metrics counters hold (as of its latest heartbeat).
            for name in ("requests_total", "received_bytes_total", "sent_bytes_total"):
                row[name] = int(stats.get(name, 0))
            for name in ("threads", "cores", "cores_max"):
                row[name] = int(stats[name]) if name in stats else None
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
            "draining": sorted(list(self._draining)),
            "suspect": self.suspect_servers(),
            "sizing_actions": self.sizing_actions(),
            "prefix_grants": self._prefix_grants_now(),
            "cluster_metrics": dict(self._metrics.values),
            "resource_requests": list(self._launcher.resource_requests)
            if self._launcher is not None
            else [],
        }

    def close(self) -> None:
        """Stop the background loops and close the admin connections (the actor is ending)."""
        self._stopping.set()
        self._lease_logger.shutdown(wait=False, cancel_futures=True)
        monitor = self._monitor
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout=ADMIN_CALL_TIMEOUT_S * 2)
        self._probe.close()
        with self._lock:
            self._admin.close()
            launched, self._launched = dict(self._launched), {}
        if launched:
            import ray

            try:
                ray.get(
                    [node.stop.remote() for node in launched.values()],
                    timeout=ADMIN_CALL_TIMEOUT_S * 3,
                )
            except Exception as exc:
                log.warning("launched storage nodes did not stop cleanly: %s", exc)
            for node in launched.values():
                try:
                    ray.kill(node, no_restart=True)
                except Exception as exc:
                    log.warning("could not kill a launched storage node: %s", exc)

    # -- internals --------------------------------------------------------------------------

    def _spec(self) -> ClusterSpec:
        """The tier specifications packing uses: the configured ones, else the servers' sizes."""
        if self._cluster_spec is not None:
            return self._cluster_spec
        sizes: dict[str, int] = {}
        for info in self._servers.values():
            sizes[info.tier] = max(sizes.get(info.tier, 0), info.capacity_bytes)
        if self._launcher is not None:
            for tier, size in self._launcher.spec.capacity_bytes_by_tier.items():
                sizes.setdefault(tier, size)
        return local_spec(
            dram_capacity_bytes=sizes.get("dram", 1),
            nvme_capacity_bytes=sizes.get(TIER_NVME),
        )

    def _server_loads(
        self, *, excluding_job: str | None = None, grants: bool = True
    ) -> list[ServerLoad]:
        """Every live server with its measured use and what registered jobs (and, with
        ``grants``, declared prefixes) reserve on it.

        A server's throughput is what it reports it can move (``throughput_bytes_per_s`` of its
        latest heartbeat), else its tier's nominal figure.
        """
        spec = self._spec()
        loads = []
        for info in self.servers():
            stats = self._latest_stats(info.node_id) or {}
            throughput = _measured_throughput(stats) or (
                spec.tier(info.tier).throughput_bytes_per_s if spec.has_tier(info.tier) else 1
            )
            loads.append(
                ServerLoad(
                    node_id=info.node_id,
                    tier=info.tier,
                    capacity_bytes=info.capacity_bytes,
                    throughput_bytes_per_s=throughput,
                    used_bytes=int(stats.get("used_bytes", 0)),
                    long_running=info.long_running,
                    draining=info.node_id in self._draining
                    or info.node_id in self._suspects
                    or bool(stats.get("draining", False)),
                )
            )
        jobs = [
            (record.job_demand(), record.allocation())
            for job_id, record in self._jobs.items()
            if record.demand and job_id != excluding_job
        ]
        loads = with_allocations(loads, jobs)
        granted = self._grants.reserved_by_server() if grants else {}
        return [
            dataclasses.replace(
                load, allocated_capacity_bytes=load.allocated_capacity_bytes + granted[load.node_id]
            ) if load.node_id in granted else load
            for load in loads
        ]

    def _pack_or_launch(
        self,
        solve: Any,
        *,
        demand: JobDemand,
        deadline_s: float,
    ) -> Allocation:
        """Pack with ``solve(loads, demand)``; launch the shortfall and pack again until it fits.

        Without a launcher, a job whose throughput does not fit gets the free throughput of its
        first tier (spread over that tier's servers), failing that it is packed by capacity alone
        (its throughput over-committed either way, logged); one whose capacity does not fit is
        refused with ``CapacityExhausted``, as is a registration whose servers are not up by
        ``deadline_s``. Callers hold the lock.
        """
        result: PackResult | None = None
        for _ in range(LAUNCH_ROUNDS_MAX):
            loads = self._server_loads()
            result = solve(loads, demand)
            if result.fits and not any(p.weight > 0 for p in result.allocation.placements):
                # Nothing can take the job's data (e.g. no server of its tier is active).
                result = PackResult(result.allocation, {demand.tiers[0]: 1})
            if result.fits:
                return result.allocation
            if self._launcher is None or not all(
                self._launcher.can_launch(t) for t in result.shortfall
            ):
                for relaxed_demand in _relaxed_demands(demand, loads):
                    relaxed = solve(loads, relaxed_demand)
                    if relaxed.fits and any(p.weight > 0 for p in relaxed.allocation.placements):
                        log.warning(
                            "throughput of %d bytes/s over-committed (%d granted): no server can "
                            "be launched",
                            demand.throughput_bytes_per_s,
                            relaxed_demand.throughput_bytes_per_s,
                        )
                        return relaxed.allocation
                raise CapacityExhausted(
                    f"the job needs more servers ({result.shortfall}) and none can be launched"
                )
            self._launch_shortfall(result.shortfall, deadline_s=deadline_s)
        raise CapacityExhausted(
            f"the job still does not fit after {LAUNCH_ROUNDS_MAX} launch rounds "
            f"(short of {result.shortfall if result else {}})"
        )

    def _launch_shortfall(self, shortfall: dict[str, int], *, deadline_s: float) -> None:
        """Launch ``{tier: count}`` servers and add them; bounded by ``servers_max``."""
        assert self._launcher is not None
        limit = self._launcher.spec.servers_max
        for tier, count in sorted(shortfall.items()):
            for _ in range(count):
                if len(self._servers) >= limit:
                    raise CapacityExhausted(f"the cluster is at its limit of {limit} servers")
                self.launch_server(tier, deadline_s=deadline_s)

    def launch_server(
        self, tier: str, *, long_running: bool = False, deadline_s: float | None = None
    ) -> StorageNodeInfo:
        """Start a new storage server of ``tier`` and make it available for new jobs."""
        if self._launcher is None:
            raise ClusterError("this controller cannot launch storage servers")
        if deadline_s is None:
            deadline_s = time.monotonic() + self._register_timeout_s
        with self._lock:
            node_id = self._next_node_id(tier)
            info, node = self._launcher.launch(
                node_id=node_id, tier=tier, long_running=long_running, deadline_s=deadline_s
            )
            self._launched[node_id] = node
            self.add_server(info, node)
            return info

    def _next_node_id(self, tier: str) -> str:
        taken = set(self._servers) | set(self._dead) | set(self._launched)
        index = 0
        while f"{tier}-{index}" in taken:
            index += 1
        return f"{tier}-{index}"

    def _server_infos(self, allocation: Allocation) -> tuple[ServerInfo, ...]:
        """The weight map of ``allocation`` with each live server's address and tier."""
        return tuple(
            ServerInfo(
                node_id=p.node_id,
                address=self._servers[p.node_id].address,
                tier=self._servers[p.node_id].tier,
                weight=p.weight,
                persist=p.persist,
            )
            for p in allocation.placements
            if p.node_id in self._servers
        )

    def _new_job_id(self, name: str) -> str:
        for _ in range(JOB_ID_ATTEMPTS_MAX):
            job_id = f"{name}-{secrets.token_hex(JOB_ID_SUFFIX_BYTES)}"
            if job_id not in self._jobs:
                return job_id
        raise ClusterError(f"could not find a free job id for {name!r}")

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
            try:
                self._publish_metrics()
            except Exception:
                log.exception("cluster metrics")
            try:
                self.expire_leases()
            except Exception:
                log.exception("lease expiry")
            try:
                self.expire_grants()
            except Exception:
                log.exception("prefix grant expiry")
            if self._sizing is not None and time.monotonic() >= self._sizing_next_s:
                self._sizing_next_s = time.monotonic() + self._sizing_interval_s
                try:
                    self.size_cluster()
                except Exception:
                    log.exception("sizing loop")

    def _publish_metrics(self) -> None:
        """Refresh the cluster gauges (see :mod:`pocketflow.control.cluster_metrics`)."""
        servers: dict[str, int] = {}
        capacity: dict[str, int] = {}
        allocated: dict[str, float] = {}
        with self._lock:
            for info in self._servers.values():
                servers[info.tier] = servers.get(info.tier, 0) + 1
                capacity[info.tier] = capacity.get(info.tier, 0) + info.capacity_bytes
            for record in self._jobs.values():
                wanted = float(record.demand.get("capacity_bytes", 0) or 0)
                total_weight = sum(s.weight for s in record.handle.servers) or 1.0
                for server in record.handle.servers:
                    allocated[server.tier] = (
                        allocated.get(server.tier, 0.0) + wanted * server.weight / total_weight
                    )
            jobs = len(self._jobs)
            dead = len(self._dead)
        for tier in capacity:
            allocated.setdefault(tier, 0.0)
        self._metrics.refresh(
            jobs=jobs, servers=servers, capacity_bytes=capacity, allocated_bytes=allocated,
            dead_servers=dead,
        )

    def cluster_metrics(self) -> dict[str, Any]:
        """The numbers last published as cluster metrics."""
        self._publish_metrics()
        return dict(self._metrics.values)

    def size_cluster(self) -> dict[str, Any]:
        """Run the sizing policy once on the latest heartbeats and carry out its action.

        Vertical scaling (up and down) is the servers' ``set_cores`` action; a new server is
        launched only when the cluster may launch servers. Returns ``{"action", "reason", ...}``.
        """
        if self._sizing is None:
            return {"action": "none", "reason": "sizing is disabled"}
        with self._lock:
            action = decide(
                self._utilizations(),
                self._sizing,
                now_s=time.monotonic(),
                last_action_s=self._sizing_last_action_s,
            )
            done: dict[str, Any] = {"action": type(action).__name__, "reason": action.reason}
            if isinstance(action, (AddThreads, RemoveThreads)):
                done["node_id"] = action.node_id
                done["cores"] = action.threads
                info = self._servers.get(action.node_id)
                try:
                    if info is None:
                        raise ClusterError(f"{action.node_id} is gone")
                    self._admin.client(info.address).set_cores(action.threads)
                except PocketflowError as exc:
                    log.warning("sizing: set_cores on %s failed: %s", action.node_id, exc)
                    done["skipped"] = True
                else:
                    self._refresh_stats(info)
                self._sizing_last_action_s = time.monotonic()
            elif isinstance(action, AddServer):
                if self._launcher is None or not self._launcher.can_launch(action.tier):
                    done["skipped"] = True
                else:
                    info = self.launch_server(action.tier, long_running=action.long_running)
                    done["node_id"] = info.node_id
                    self._sizing_last_action_s = time.monotonic()
            elif isinstance(action, RemoveServer):
                self.drain_server(action.node_id)
                done["node_id"] = action.node_id
                self._sizing_last_action_s = time.monotonic()
            if done["action"] != "NoAction":
                log.info("sizing: %s", done)
                self._sizing_actions.append({**done, "at_unix_s": time.time()})
                del self._sizing_actions[:-SIZING_ACTIONS_KEPT_MAX]
                self._metrics.count("sizing_actions", done["action"])
            return done

    def sizing_actions(self) -> list[dict[str, Any]]:
        """The latest sizing actions, oldest first."""
        return list(self._sizing_actions)

    def drain_server(self, node_id: str) -> dict[str, Any]:
        """Take a server out of service without losing live data.

        It gets weight 0 for new jobs, every job that writes to it moves to a new epoch where
        its weight is 0 (it stays in the map, so its data stays readable), and the server is told
        to refuse writes and exit once it holds no data; the failure detector then retires it
        quietly. The last ``long_running_min`` long-running servers are never drained.
        """
        with self._lock:
            info = self._servers.get(node_id)
            if info is None:
                raise ClusterError(f"no live storage server {node_id!r}")
            if info.long_running:
                active = [
                    s for s in self._servers.values()
                    if s.long_running and s.node_id not in self._draining
                ]
                floor = self._sizing.long_running_min if self._sizing else 2
                if len(active) <= floor:
                    raise ClusterError(
                        f"{node_id} is one of the last {floor} long-running servers"
                    )
            self._draining.add(node_id)
            # New epochs first, so that a client still writing to the server is told the new
            # map (stale_epoch) rather than refused (draining).
            for job_id, record in list(self._jobs.items()):
                entry = next((s for s in record.handle.servers if s.node_id == node_id), None)
                if entry is None or (entry.weight <= 0.0 and not entry.persist):
                    continue
                kept = tuple(
                    dataclasses.replace(s, weight=0.0, persist=False)
                    if s.node_id == node_id
                    else s
                    for s in record.handle.servers
                )
                if not any(s.weight > 0 for s in kept):
                    self._exclude_from_job(job_id, node_id, keep_readable=True)
                else:
                    self._move_to_epoch(job_id, kept)
            try:
                result = self._admin.client(info.address).drain(exit_when_empty=True)
                empty = int(self._admin.client(info.address).stats().get("objects", 1)) == 0
            except PocketflowError as exc:
                # Gone already: an empty server exits as soon as it is told to drain.
                log.info("%s after drain: %s", node_id, exc)
                result, empty = {"draining": True}, True
            if empty:
                self._retire(node_id)
                return {"node_id": node_id, **result, "retired": True}
            log.info("draining storage server %s", node_id)
            return {"node_id": node_id, **result, "retired": False}

    def drain_node(
        self, ray_node_id: str, timeout_s: float = DRAIN_NODE_TIMEOUT_S
    ) -> dict[str, Any]:
        """Drain every storage server on Ray node ``ray_node_id`` before the node is removed.

        Each server is drained as by :meth:`drain_server` (so no live data is lost: a server
        holding data keeps serving reads until its jobs free it). Waits up to ``timeout_s`` for
        the servers to exit and be retired. Returns ``{"node", "retired", "still_draining",
        "refused"}``; the node is safe to remove when ``still_draining`` and ``refused`` are
        empty.
        """
        with self._lock:
            targets = sorted(
                n for n, info in self._servers.items() if info.ray_node_id == ray_node_id
            )
        refused: dict[str, str] = {}
        for node_id in targets:
            try:
                self.drain_server(node_id)
            except ClusterError as exc:
                refused[node_id] = str(exc)
        waiting = [n for n in targets if n not in refused]
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_S)
            with self._lock:
                waiting = [n for n in waiting if n in self._servers]
        return {
            "node": ray_node_id,
            "retired": [n for n in targets if n not in refused and n not in waiting],
            "still_draining": waiting,
            "refused": refused,
        }

    def _retire(self, node_id: str) -> None:
        """Forget a drained server that has exited; its jobs' maps drop it. Callers lock."""
        info = self._servers.pop(node_id, None)
        if info is None:
            return
        self._draining.discard(node_id)
        node = self._nodes.pop(node_id, None)
        self._launched.pop(node_id, None)
        with self._heartbeat_lock:
            self._last_heartbeat.pop(node_id, None)
            self._heartbeat_stats.pop(node_id, None)
        self._admin.forget(info.address)
        for job_id, record in list(self._jobs.items()):
            if any(s.node_id == node_id for s in record.handle.servers):
                kept = tuple(s for s in record.handle.servers if s.node_id != node_id)
                self._move_to_epoch(job_id, kept)
        log.info("storage server %s drained and retired", node_id)
        if node is not None:
            try:
                import ray

                node.stop.remote()
                ray.kill(node, no_restart=True)
            except Exception as exc:
                log.info("could not stop the node of %s: %s", node_id, exc)

    def _utilizations(self) -> list[ServerUtilization]:
        """Each live server's latest heartbeat as the sizing policy's sample.

        The policy's "threads" of a server are the CPU cores it runs on (``set_cores``), and its
        CPU fraction is its CPU use over those cores.
        """
        rows = []
        # The packing's view of each server already holds the throughput it measured (or its
        # tier's nominal one), its measured use and what registered jobs reserve on it.
        for load in self._server_loads():
            stats = self._latest_stats(load.node_id) or {}
            # A job's reservation counts as used: a server launched for a job that has not
            # written yet must not look idle.
            used = max(int(stats.get("used_bytes", 0)), load.allocated_capacity_bytes)
            cores = max(int(stats.get("cores", 1)), 1)
            rows.append(
                ServerUtilization(
                    node_id=load.node_id,
                    tier=load.tier,
                    cpu_fraction=float(stats.get("cpu_utilization", 0.0)) / cores,
                    net_bytes_per_s=float(
                        stats.get("bytes_in_per_s", 0) + stats.get("bytes_out_per_s", 0)
                    ),
                    net_capacity_bytes_per_s=float(load.throughput_bytes_per_s),
                    used_bytes=used,
                    capacity_bytes=load.capacity_bytes,
                    threads=cores,
                    threads_max=max(int(stats.get("cores_max", cores)), cores),
                    long_running=load.long_running,
                    draining=load.node_id in self._draining,
                )
            )
        return rows

    def _exclude_from_job(
        self, job_id: str, node_id: str, *, keep_readable: bool = False
    ) -> None:
        """Move a job to a new epoch whose weight map no longer holds ``node_id``.

        When no server with a positive weight is left, the job's data servers are allocated
        afresh on the live servers. Callers hold the lock.
        """
        record = self._jobs[job_id]
        kept = [
            dataclasses.replace(s, weight=0.0, persist=False) if s.node_id == node_id else s
            for s in record.handle.servers
            if keep_readable or s.node_id != node_id
        ]
        if not any(s.weight > 0 for s in kept):
            try:
                demand = record.job_demand() if record.demand else demand_from_hints(
                    record.hints, self._spec()
                )
                fresh = self._server_infos(
                    self._pack_or_launch(
                        lambda loads, d: pack(d, loads, self._spec()),
                        demand=demand,
                        deadline_s=time.monotonic() + self._register_timeout_s,
                    )
                )
            except PocketflowError as exc:
                log.error("job %s lost its last data server %s: %s", job_id, node_id, exc)
                fresh = ()
            known = {s.node_id for s in kept}
            kept = [s for s in kept if s.node_id not in {f.node_id for f in fresh}]
            kept += [f for f in fresh if f.node_id not in known or f.weight > 0]
        self._move_to_epoch(job_id, tuple(sorted(kept, key=lambda s: s.node_id)),
                            routes=record.handle.routes.without_member(node_id))

    def _move_to_epoch(
        self, job_id: str, servers: tuple[ServerInfo, ...], routes: Routes | None = None
    ) -> JobHandle:
        """Give a job the next epoch with ``servers`` (and ``routes``, else its routes stay):
        tell the servers, then record it.

        Callers hold the lock. A server that does not answer ``set_epoch`` in time is logged and
        left to the failure detector.
        """
        record = self._jobs[job_id]
        handle = dataclasses.replace(
            record.handle, epoch=record.handle.epoch + 1, servers=servers,
            routes=record.handle.routes if routes is None else routes,
        )
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
        changed = record.to_metadata()
        fields = {k: changed[k] for k in ("epoch", "weight_map", "hints", "demand")}
        # The job's prefix grants go with its routes, so a restarted controller keeps them.
        fields["grants"] = grants_record(self._grants.granted(job_id))
        self._call_metadata("update_job", job_id, fields)
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


def _measured_throughput(stats: dict[str, Any]) -> int:
    """The bytes per second a server's ``stats`` say it can move; 0 when they do not say."""
    try:
        return max(int(stats.get("throughput_bytes_per_s", 0)), 0)
    except (TypeError, ValueError):
        return 0


def _without_throughput(demand: JobDemand) -> JobDemand:
    """``demand`` asking for capacity only (when throughput cannot be had)."""
    return dataclasses.replace(demand, throughput_bytes_per_s=0)


def _relaxed_demands(demand: JobDemand, loads: Sequence[ServerLoad]) -> list[JobDemand]:
    """What to ask for, in order, when ``demand``'s throughput cannot be had.

    First all the free throughput of the job's first tier (so the job is spread over every
    server of that tier that has any, rather than packed by capacity onto one), then capacity
    alone.
    """
    first_tier = demand.tiers[0] if demand.tiers else None
    available = sum(
        load.free_throughput_bytes_per_s
        for load in loads
        if load.active and load.tier == first_tier
    )
    granted = min(int(available * RELAXED_THROUGHPUT_SHARE), demand.throughput_bytes_per_s)
    relaxed = [_without_throughput(demand)]
    if granted > 0:
        relaxed.insert(0, dataclasses.replace(demand, throughput_bytes_per_s=granted))
    return relaxed


def _server_pool(node_id: str, pools: dict[str, list[str]]) -> str | None:
    """The name of the pool of ``node_id`` alone among ``pools`` (``dram-<k>``), or a new one;
    ``None`` when a map has no room for another pool (two stay for ``dram`` and ``nvme``)."""
    for name, members in pools.items():
        if name.startswith(SERVER_POOL_PREFIX) and members == [node_id]:
            return name
    if len(set(pools) | {POOL_DRAM, POOL_NVME}) >= POOLS_MAX:
        return None
    return next(f"{SERVER_POOL_PREFIX}{k}" for k in range(POOLS_MAX)
                if f"{SERVER_POOL_PREFIX}{k}" not in pools)


def _declarations(requests: Any) -> list[tuple[str, int]]:
    """``[(prefix, size_bytes), ...]`` checked: declared prefixes, sizes >= 0, no repeats."""
    if not isinstance(requests, (list, tuple)) or len(requests) > ROUTES_MAX:
        raise InvalidRequest(f"declare at most {ROUTES_MAX} prefixes as [(prefix, size), ...]")
    checked: list[tuple[str, int]] = []
    seen: set[str] = set()
    for item in requests:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise InvalidRequest(f"a declaration is (prefix, size_bytes), got {item!r:.100}")
        prefix, size = check_prefix(item[0]), item[1]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidRequest(f"size_bytes of {prefix!r} must be an int >= 0, got {size!r}")
        if prefix in seen:
            raise InvalidRequest(f"prefix {prefix!r} declared twice in one call")
        seen.add(prefix)
        checked.append((prefix, size))
    return checked


def _restarted_by_ray() -> bool:
    """Whether this process is a Ray actor that Ray restarted after a crash."""
    import sys

    if "ray" not in sys.modules:
        return False
    import ray

    if not ray.is_initialized():
        return False
    try:
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not inside an actor
        return False
