"""The ``Controller`` actor: a facade over the control plane's role modules that owns their lock
and the monitor loop (registration, leases, prefix grants, failure detection, sizing, status)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from pocketflow.auth import SECRET_MIN_BYTES
from pocketflow.control.admin import AdminTokens
from pocketflow.control.allocator import (
    REGISTER_TIMEOUT_S_DEFAULT,
    Allocator,
    without_throughput,
)
from pocketflow.control.caches import Caches
from pocketflow.control.call_counts import CallCounts, counted_calls
from pocketflow.control.cluster_metrics import ClusterMetrics
from pocketflow.control.draining import DRAIN_NODE_TIMEOUT_S, DRAIN_POLL_S, Drainer
from pocketflow.control.epochs import Epochs
from pocketflow.control.failure_detector import (
    DEAD_AFTER_MS_DEFAULT,
    HEARTBEAT_INTERVAL_MS_MIN,
    PROBE_TIMEOUT_S_MIN,
    FailureDetector,
)
from pocketflow.control.hints import JobDemand, demand_from_hints
from pocketflow.control.job_ends import JobEnds
from pocketflow.control.job_leases import JobLeases
from pocketflow.control.job_table import (
    TOKEN_TTL_S_DEFAULT,
    JobRecord,
    JobTable,
    validate_job_name,
    validate_request_id,
)
from pocketflow.control.launcher import Launcher, LaunchSpec
from pocketflow.control.leases import check_lease_ms
from pocketflow.control.membership import Membership
from pocketflow.control.metadata_calls import MetadataCalls
from pocketflow.control.nodes import RayNodes
from pocketflow.control.packing import Allocation, PackResult, ServerLoad, grow
from pocketflow.control.persist_admin import PersistAdmin
from pocketflow.control.prefix_grants import PrefixGrants
from pocketflow.control.prefix_routes import PrefixRoutes
from pocketflow.control.repair import Repairer
from pocketflow.control.reporting import job_rows, metric_figures, server_rows
from pocketflow.control.restore import load_init_data, restarted_by_ray, restore
from pocketflow.control.scaling import SIZING_INTERVAL_MS_DEFAULT, Scaler
from pocketflow.control.sizing import SizingBounds
from pocketflow.control.storage_node import HEARTBEAT_INTERVAL_MS_DEFAULT, StorageNodeInfo
from pocketflow.control.tiers import ClusterSpec
from pocketflow.errors import ClusterError, ConfigError, JobNotRegistered, PocketflowError
from pocketflow.handle import JobHandle, LostServer
from pocketflow.tls import ClusterCA

log = logging.getLogger(__name__)

__all__ = ["Controller", "SIZING_INTERVAL_MS_DEFAULT", "validate_job_name"]

MONITOR_INTERVAL_S_MAX = 0.25
"""Longest pause between two runs of the failure detector."""

GROW_ROUNDS_MAX = 3
"""Most times ``grow_job`` packs a job again because it moved to a new epoch (a drain, a death)
while the growth's launch waited for a node."""

ADMIN_CALL_TIMEOUT_S = 5.0
"""Deadline of one admin call (``set_epoch``, ``delete_job``, ``drain``) to a storage server."""

LAUNCHED_STOP_TIMEOUT_S = 3 * ADMIN_CALL_TIMEOUT_S
"""How long ``close`` waits for the servers this controller launched to stop."""

CALLS_SERVED = CallCounts()
"""The calls this process's controller served from outside, per method (:meth:`calls_served`)."""


@counted_calls(CALLS_SERVED, internal=("__init__", "_monitor_loop"))
class Controller:
    """Registers jobs, computes their weight maps, issues tokens and frees their data.

    The Ray actor of the control plane, and a facade: each role lives in a module of its own,
    with its own state, built and tested without Ray (as Ray's GCS server composes its node,
    health-check, job and resource managers):

    - :class:`~pocketflow.control.membership.Membership`: the live servers, their heartbeats,
      the dead, suspect and draining ones;
    - :class:`~pocketflow.control.failure_detector.FailureDetector`: which silent servers are
      gone and which only suspect;
    - :class:`~pocketflow.control.job_table.JobTable` and
      :class:`~pocketflow.control.job_leases.JobLeases`: the registered jobs, their tokens and
      their drivers' leases;
    - :class:`~pocketflow.control.allocator.Allocator`: packing demands onto servers, launching
      the shortfall;
    - :class:`~pocketflow.control.epochs.Epochs`: moving jobs to new weight maps;
    - :class:`~pocketflow.control.prefix_routes.PrefixRoutes`: DRAM grants of declared prefixes
      and their routes;
    - :class:`~pocketflow.control.draining.Drainer` and
      :class:`~pocketflow.control.scaling.Scaler`: draining, retiring, sizing;
    - :class:`~pocketflow.control.persist_admin.PersistAdmin`: ended jobs' PERSIST data;
    - :mod:`~pocketflow.control.reporting`: status and cluster metrics;
    - :mod:`~pocketflow.control.restore`: the one loader a restarted instance starts from.

    This class wires them, takes the lock that guards their tables (``_lock``; heartbeats, job
    leases and prefix-grant renewals have locks of their own so that they never wait behind a
    registration that launches servers), runs the monitor loop, and forwards calls.

    Each server's ``StorageNode`` actor pushes a heartbeat (the server's ``stats``) every
    ``heartbeat_interval_ms``; a server silent for ``dead_after_ms`` that does not answer a
    probe and whose process is gone is declared dead, and every job whose map holds it moves to a
    new epoch without it (clients get ``stale_epoch`` and the new map from any live server).

    ``secret`` is the cluster secret and ``ca`` the cluster CA (``None`` without TLS), both in
    memory: the controller mints tokens with the one and signs the certificates of the servers
    it launches with the other; neither is ever written to a file. ``metadata`` is the
    ``Metadata`` actor's handle, or a plain :class:`~pocketflow.control.metadata.Metadata` object
    when the controller runs outside Ray.
    """

    def __init__(
        self,
        *,
        secret: bytes,
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
        ca: ClusterCA | None = None,
        nodes: Any = None,
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
        self._heartbeat_interval_ms = int(heartbeat_interval_ms)
        self._lock = threading.RLock()
        # Wakes the prefix declarations waiting for DRAM (under ``_lock``).
        self._grants_changed = threading.Condition(self._lock)
        # Request ids of registrations under way, and what wakes their retries (under
        # ``_lock``): a registration's launch waits without the lock.
        self._registering: set[str] = set()
        self._registered = threading.Condition(self._lock)
        self._stopping = threading.Event()
        self._nodes = RayNodes() if nodes is None else nodes
        if len(secret) < SECRET_MIN_BYTES:
            raise ConfigError(f"the cluster secret must be at least {SECRET_MIN_BYTES} bytes")
        tls_ca = ca.cert_pem if ca is not None else None
        self._admin = AdminTokens(secret, timeout_s=ADMIN_CALL_TIMEOUT_S, tls_ca=tls_ca)
        self._metadata = MetadataCalls(metadata)
        self._metrics = ClusterMetrics()
        self._membership = Membership()
        self._detector = FailureDetector(
            self._membership,
            # Used only by the monitor thread (AdminTokens is not shared between threads).
            probe=AdminTokens(
                secret, timeout_s=max(PROBE_TIMEOUT_S_MIN, dead_after_ms / 1000.0), tls_ca=tls_ca
            ),
            nodes=self._nodes,
            dead_after_s=dead_after_ms / 1000.0,
        )
        self._jobs = JobTable(
            secret=secret,
            token_ttl_s=token_ttl_s,
            block_size_bytes=block_size_bytes,
            tls_ca=tls_ca,
        )
        self._leases = JobLeases(self._metadata)
        grants = PrefixGrants()
        self._allocator = Allocator(
            self._membership, self._jobs, grants,
            cluster_spec=cluster_spec,
            launcher=Launcher(
                launch, live_slots=self._membership.count_by_tier, secret=secret, ca=ca
            ) if launch is not None else None,
            register_timeout_s=register_timeout_s,
            add_server=self.add_server,
        )
        self._allocator.unlocked = self._unlocked
        self._epochs = Epochs(
            self._jobs, self._allocator, grants, self._membership,
            admin=self._admin, call_metadata=self._metadata,
        )
        # Used only by the monitor thread: the retries of set_epoch and of job ends.
        self._monitor_admin = AdminTokens(secret, timeout_s=ADMIN_CALL_TIMEOUT_S, tls_ca=tls_ca)
        self._ends = JobEnds(
            self._membership, admin=self._admin, retry_admin=self._monitor_admin,
            call_metadata=self._metadata,
        )
        self._routes = PrefixRoutes(
            grants, self._jobs, self._membership, self._allocator, self._epochs,
            wake=self._grants_changed.notify_all,
        )
        self._repairer = Repairer(self._jobs, self._allocator, self._epochs)
        self._drainer = Drainer(
            self._membership, self._jobs, self._epochs, self._allocator,
            admin=self._admin, nodes=self._nodes,
            **({"long_running_min": sizing.long_running_min} if sizing is not None else {}),
        )
        self._scaler = None if sizing is None else Scaler(
            sizing, self._membership, self._allocator,
            admin=self._admin, metrics=self._metrics, interval_ms=sizing_interval_ms,
            refresh_stats=self._refresh_stats,
            record=lambda action: self._metadata("record_sizing", action),
        )
        self._persist = PersistAdmin(
            self._membership, self._jobs, admin=self._admin, refresh_stats=self._refresh_stats
        )
        self._caches = Caches(
            self._jobs, self._leases, register=self.register_job, grow=self.grow_job,
            call_metadata=self._metadata, spec=self._allocator.spec,
        )
        self._restored: dict[str, Any] | None = None
        if restarted_by_ray():
            init = load_init_data(self._metadata)
            with self._lock:
                self._restored = restore(
                    init, membership=self._membership, jobs=self._jobs, leases=self._leases,
                    routes=self._routes, epochs=self._epochs, ends=self._ends,
                    add_server=self.add_server,
                    launched=self._allocator.launched, end_node=self._nodes.stop_and_kill,
                )
                if self._scaler is not None:
                    self._scaler.restore(init.sizing)
                # Jobs moved off servers that did not come back get their share again.
                self._repairer.note(self._restored["jobs"])
                self._restored["sizing_actions"] = len(init.sizing)
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
            self._membership.add(info, node)
            # A server that joins (or is back under its node id) learns every live job's map
            # that names it.
            self._epochs.resync(info.node_id)
        self._nodes.start_heartbeats(node, self._heartbeat_interval_ms)

    def knows_server(self, node_id: str) -> bool:
        """Whether ``node_id`` is a live server of this controller (a launched ``StorageNode``
        that no controller knows stops itself). Takes no lock."""
        return node_id in self._membership

    def servers(self) -> list[StorageNodeInfo]:
        """Every live storage server, ordered by node id.

        Takes no lock (a copy of the table is atomic), so it never waits behind a registration
        that is launching servers.
        """
        return self._membership.servers()

    def heartbeat(self, node_id: str, stats: dict[str, Any]) -> None:
        """Take a heartbeat: ``stats`` is the server's ``stats`` answer (docs/PROTOCOL.md).

        Heartbeats of unknown or dead servers are ignored: a dead server stays dead.
        """
        self._membership.heartbeat(node_id, stats)

    def _refresh_stats(self, info: StorageNodeInfo) -> None:
        """Read a server's ``stats`` now (after a change the next heartbeat would lag behind)."""
        try:
            stats = self._admin.sampled_stats(info.address)
        except PocketflowError as exc:
            log.info("stats of %s failed: %s", info.node_id, exc)
            return
        self._membership.take_stats(info.node_id, stats)

    def dead_servers(self) -> dict[str, dict[str, Any]]:
        """Servers declared dead: ``node_id -> {"address", "tier", "reason", "at_unix_s"}``."""
        return self._membership.dead_servers()

    def suspect_servers(self) -> list[str]:
        """Servers that are silent but whose process runs (see ``check_failures``)."""
        return self._membership.suspects()

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
        for node_id in self._detector.gone():
            with self._lock:
                # Re-checked under the lock: a heartbeat may have come in meanwhile.
                silent_s = self._detector.silent().get(node_id)
                if silent_s is None:
                    continue
                if self._membership.is_draining(node_id):
                    self._drainer.retire(node_id)
                    continue
                self.declare_dead(node_id, reason=f"no heartbeat for {silent_s:.1f}s")
            declared.append(node_id)
        return declared

    def declare_dead(self, node_id: str, *, reason: str) -> list[str]:
        """Forget a failed server and move every job that used it to a new epoch without it.

        The server's ``StorageNode`` is told to stop it (a hung server must not come back and
        serve an old epoch). Returns the ids of the jobs that moved to a new epoch.
        """
        with self._lock:
            forgotten = self._membership.forget(node_id)
            if forgotten is None:
                return []
            info, node = forgotten
            self._admin.forget(info.address)
            log.warning("storage server %s declared dead: %s", node_id, reason)
            moved: list[str] = []
            try:
                moved = self._epochs.move_off_lost(LostServer(node_id, info.address))
                self._repairer.note(moved)
            finally:
                # Listed as dead only once its jobs have moved (dead_servers reads without the
                # lock): whoever sees it dead also finds the jobs' new epochs on the servers.
                self._membership.remember_dead(
                    node_id, address=info.address, tier=info.tier, reason=reason
                )
            launched = self._allocator.launched.pop(node_id, None) is not None
        if launched:
            # A launched node is a detached actor: ended here, or it would hold its Ray node's
            # storage slot (and the node) for good.
            self._nodes.stop_and_kill(node, node_id)
        else:
            self._nodes.stop(node, node_id)
        return moved

    def reroute_suspects(self) -> dict[str, list[str]]:
        """Move the jobs of every suspect server (hung: silent, not answering, its process
        running) to a new epoch where it has weight 0 and is listed in ``suspects``, and those
        of a suspect that answers again (or whose jobs' maps name it from before a restart) to
        one that gives its weight back. Runs in the monitor loop; returns ``{"suspended":
        [job ids], "resumed": [job ids]}``."""
        suspended: list[str] = []
        resumed: list[str] = []
        with self._lock:
            suspects = set(self._membership.suspects())
            listed = {n for record in self._jobs.records() for n in record.handle.suspects}
            for node_id in sorted(suspects):
                if node_id in self._membership:
                    suspended += self._epochs.suspend(node_id)
            for node_id in sorted(listed - suspects):
                if node_id in self._membership:
                    resumed += self._epochs.resume(node_id)
        return {"suspended": suspended, "resumed": resumed}

    def confirm_epochs(self) -> int:
        """Retry the ``set_epoch`` calls that servers have not confirmed (each server on its
        own deadline, without the lock); returns how many were confirmed now."""
        with self._lock:
            due = self._epochs.due()
        if not due:
            return 0
        confirmed, failed = Epochs.send(due, self._monitor_admin)
        with self._lock:
            self._epochs.settle(confirmed, failed)
        return len(confirmed)

    # -- jobs -------------------------------------------------------------------------------

    def register_job(
        self,
        name: str,
        hints: dict[str, Any],
        request_id: str | None = None,
        lease_ms: int | None = None,
    ) -> JobHandle:
        """Register a job: allocate its servers, log it, tell them its epoch, return its handle.

        ``hints`` is :meth:`pocketflow.Hints.to_dict` output. ``request_id`` names the
        request: a registered job registered by the same request id is returned as it is (the
        driver retries a registration whose answer it did not get, e.g. when this actor crashed
        after logging it and a restarted instance took it back). With ``lease_ms`` the job's
        lease starts now and is logged with the job, so a job whose driver never got its handle
        (or died before its first renewal) ends when the lease runs out, also after a restart.
        """
        validate_job_name(name)
        validate_request_id(request_id)
        if lease_ms is not None:
            check_lease_ms(lease_ms)
        with self._lock:
            if request_id is not None:
                # A retry of a registration still under way (its launch waits for a node
                # without the lock) waits for it, then answers with its job.
                self._registered.wait_for(
                    lambda: request_id not in self._registering,
                    timeout=self._allocator.register_timeout_s,
                )
                found = self._jobs.by_request(request_id)
                if found is not None:
                    log.info("registration %s was answered already: job %s", request_id,
                             found.handle.job_id)
                    return found.handle
                if request_id in self._registering:
                    raise ClusterError(f"registration {request_id} is still under way")
            with self._registering_request(request_id):
                handle = self._register_locked(name, hints, request_id, lease_ms)
        self._metrics.count("registrations")
        return handle

    @contextlib.contextmanager
    def _registering_request(self, request_id: str | None) -> Iterator[None]:
        """Mark ``request_id`` as being registered for the block (under ``_lock``), and wake
        its retries when it is done, registered or not. At most one entry per call in flight
        (the actor's ``max_concurrency``)."""
        if request_id is None:
            yield
            return
        self._registering.add(request_id)
        try:
            yield
        finally:
            self._registering.discard(request_id)
            self._registered.notify_all()

    def _register_locked(
        self, name: str, hints: dict[str, Any], request_id: str | None, lease_ms: int | None
    ) -> JobHandle:
        """:meth:`register_job` once its request is known to be new; called under ``_lock``."""
        job_id = self._jobs.new_job_id(name)
        demand = demand_from_hints(hints, self._allocator.spec())
        servers = self._allocator.server_infos(self._allocator.pack_new(demand))
        handle = self._jobs.new_handle(job_id, name, servers)
        record = JobRecord(
            handle=handle,
            hints=dict(hints),
            registered_at_unix_s=time.time(),
            demand=demand.to_dict(),
            request_id=request_id,
        )
        # Logged first, with its lease: a crash from here on leaves a job that a restarted
        # instance takes back, with a lease that ends it unless its driver renews it.
        logged = record.to_metadata()
        if lease_ms is not None:
            logged["lease_ms"] = lease_ms
        self._metadata("put_job", logged)
        # A server that does not confirm the first epoch is retried by the monitor loop.
        self._epochs.announce(handle, demand)
        self._jobs.put(record)
        if lease_ms is not None:
            self._leases.start(job_id, lease_ms=lease_ms, now_s=time.monotonic())
        log.info("registered job %s on %s", job_id, ", ".join(s.node_id for s in servers))
        return handle

    def register_timeout_s(self) -> float:
        """How long a registration (or growth) may wait for the servers it launches; drivers
        bound their calls that may launch by it (``ControlPlane.launch_call_timeout_s``)."""
        return self._allocator.register_timeout_s

    def grow_job(self, job_id: str, hints: dict[str, Any]) -> JobHandle:
        """Give a running job more room: a new epoch whose weight map adds servers.

        ``hints`` are the job's new hints. Servers are launched when the growth does not fit.
        Every server of the old map stays in the new one (weight 0 at least), so data written
        under older epochs stays readable; clients holding the old handle get ``stale_epoch``
        with the new map and retry. Returns the new handle (the old one if nothing changed).
        """
        with self._lock:
            for _ in range(GROW_ROUNDS_MAX):
                record = self._jobs.record(job_id)
                old = record.job_demand()
                new = demand_from_hints(hints, self._allocator.spec())
                current = record.allocation()
                # A launch waits for its node with the lock released (other calls must not
                # queue behind it); the job may move meanwhile, so the answer counts only for
                # the map it was packed from.
                allocation = self._allocator.pack_or_launch(
                    functools.partial(_grown, current, old, new, self._allocator.spec()),
                    demand=new,
                    deadline_s=self._allocator.deadline_s(),
                    release_lock=True,
                )
                latest = self._jobs.record(job_id)
                if latest.handle != record.handle:
                    log.info("job %s moved while its growth launched; packing it again", job_id)
                    continue
                if allocation == current:
                    return record.handle
                self._jobs.put(
                    dataclasses.replace(record, hints=dict(hints), demand=new.to_dict())
                )
                return self._epochs.move(job_id, self._allocator.server_infos(allocation))
            raise ClusterError(
                f"job {job_id} moved to a new epoch during each of {GROW_ROUNDS_MAX} attempts "
                f"to grow it"
            )

    def deregister_job(self, job_id: str) -> dict[str, Any]:
        """Forget a job and free all its non-PERSIST data on every server.

        The job's end (``delete_job``) goes to every live server; the servers that do not
        confirm it are logged with the job's removal and retried until they do (see
        :class:`~pocketflow.control.job_ends.JobEnds`). Returns ``{"job_id", "deleted",
        "freed_bytes", "unreachable": [node ids]}`` (``unreachable``: not confirmed yet). Raises
        ``JobNotRegistered`` for a job that is not registered.
        """
        with self._lock:
            if self._jobs.remove(job_id) is None:
                raise JobNotRegistered(f"job {job_id!r} is not registered")
            self._leases.release(job_id)
            self._routes.release_job(job_id)
            targets = sorted(self._membership.ids())
            # Logged with the servers that must confirm the end, so that a restarted
            # controller goes on ending it where it did not.
            self._metadata("remove_job", job_id, True, targets)
        self._metrics.count("deregistrations")
        results, unreachable = self._ends.end(job_id, targets)
        deleted = freed_bytes = 0
        for node_id, result in results:
            deleted += int(result.get("deleted", 0))
            freed_bytes += int(result.get("freed_bytes", 0))
            info = self._membership.get(node_id)
            if info is not None:
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
        with self._lock:
            return self._jobs.record(job_id).handle

    def jobs(self) -> list[str]:
        """Ids of every registered job, oldest first."""
        with self._lock:
            return list(self._jobs)

    def renew_token(self, job_id: str) -> JobHandle:
        """Give a registered job a new token valid for the cluster's token TTL from now; returns
        the job's handle with it (later handles carry it too). The old token stays valid until it
        expires. Raises ``JobNotRegistered``.
        """
        # No ``_lock``: the driver's lease thread calls this, and must not wait behind a
        # registration.
        return self._jobs.renew_token(job_id)

    # -- PERSIST data of ended jobs (`pocketflow persist ls/rm`) ---------------------------------

    def persist_list(self) -> dict[str, Any]:
        """What jobs that are no longer registered left on the servers (their PERSIST data).

        Returns ``{"jobs": [{"job_id", "servers": {node id: {"objects", "used_bytes"}},
        "objects", "used_bytes"}], "unreachable": [node ids]}``, jobs sorted by id. Read from
        each server's ``stats`` now, not from the last heartbeat.
        """
        return self._persist.list()

    def persist_delete(self, job_ids: list[str]) -> dict[str, Any]:
        """Delete everything, PERSIST data included, that the named ended jobs left on every
        server. Raises ``InvalidRequest`` (and deletes nothing) if one of them is registered.

        Returns ``{"deleted", "freed_bytes", "unreachable": [node ids]}``.
        """
        return self._persist.delete(job_ids)

    # -- named caches (pocketflow.cache; control/caches.py) -----------------------------------

    def open_cache(self, name: str, hints: dict[str, Any], idle_ms: int,
                   run_id: str | None = None, run_lease_ms: int | None = None) -> dict[str, Any]:
        """Find or register the job of cache ``name`` and (re)start its lease at ``idle_ms``, or
        start run ``run_id``'s lease; returns ``{"handle", "created", "predecessor",
        "capacity_bytes"}`` (``Caches.open``)."""
        with self._lock:
            return self._caches.open(name, hints, idle_ms=idle_ms, run_id=run_id,
                                     run_lease_ms=run_lease_ms)

    def renew_cache_run(self, job_id: str, run_id: str, run_lease_ms: int, idle_ms: int) -> None:
        """Renew a cache run's lease (``Caches.renew_run``); no ``_lock``, as ``renew_lease``."""
        self._caches.renew_run(job_id, run_id, run_lease_ms=run_lease_ms, idle_ms=idle_ms)

    def end_cache_run(self, job_id: str, run_id: str, idle_ms: int) -> bool:
        """A cache run ended; the cache idles when it was the last (``Caches.end_run``)."""
        return self._caches.end_run(job_id, run_id, idle_ms=idle_ms)

    def resize_cache(self, job_id: str, hints: dict[str, Any]) -> JobHandle:
        """Grow or shrink a cache's reservation to ``hints`` (see ``Caches.resize``)."""
        with self._lock:
            return self._caches.resize(job_id, hints)

    # -- restart ------------------------------------------------------------------------------

    def restored(self) -> dict[str, Any] | None:
        """What this instance rebuilt after a crash (``{"servers", "jobs", "leases", "grants",
        "sizing_actions"}``, leases as job id -> lease_ms, grants and sizing actions as counts),
        or ``None`` if it is the first instance."""
        return self._restored

    def pid(self) -> int:
        """This actor's process id (to tell instances apart, and for fault tests)."""
        return os.getpid()

    def calls_served(self) -> dict[str, int]:
        """How many calls this instance's process served from outside, per method (this one
        included): what benchmarks count to show which work reaches the control plane."""
        return CALLS_SERVED.snapshot()

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
        self._leases.renew(job_id, lease_ms=lease_ms, now_s=now_s)
        return lease_ms / 1000.0

    def expire_leases(self) -> list[str]:
        """Deregister up to ``LEASE_EXPIRIES_PER_PASS_MAX`` jobs whose lease ran out."""
        expired = []
        for job_id in self._leases.due(now_s=time.monotonic()):
            with self._lock:
                # Re-checked once no registration runs (renewals do not wait for it): the
                # driver may have renewed meanwhile.
                lease = self._leases.get(job_id)
                if lease is None or lease.expires_at_s > time.monotonic():
                    continue
            log.warning("job %s: its driver's lease ran out; deregistering it", job_id)
            try:
                self.deregister_job(job_id)
            except JobNotRegistered:
                self._leases.release(job_id)
            expired.append(job_id)
        return expired

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
        with self._grants_changed:
            return self._routes.declare(
                job_id, requests, lease_ms, wait_s, wait=self._grants_changed.wait
            )

    def renew_prefixes(self, job_id: str, prefixes: list[str]) -> int:
        """Extend the grants of a job's ``prefixes`` by their lease (one call per renewal period
        from the driver); returns how many of them hold a grant. Raises ``JobNotRegistered``."""
        # Not under ``_lock``: a renewal must not wait behind a registration (the grants have a
        # lock of their own); the monitor pass takes lapsed grants back.
        return self._routes.renew(job_id, prefixes)

    def end_prefixes(self, job_id: str, prefixes: list[str]) -> int:
        """Take back the grants of a job's ``prefixes`` now (the job ended them: its servers
        freed their data) and give the DRAM to waiting declarations first; their routes go with
        the next route change, as a lapsed grant's do. Returns how many held a grant. Raises
        ``JobNotRegistered``, and ``InvalidRequest`` for more than ``LEASE_PREFIXES_MAX``
        prefixes."""
        with self._lock:
            return self._routes.end(job_id, prefixes)

    def expire_grants(self) -> int:
        """Take back the grants whose lease lapsed and give their DRAM to waiting declarations;
        returns how many lapsed."""
        with self._lock:
            return self._routes.expire(time.monotonic())

    def prefix_grants(self) -> dict[str, Any]:
        """Live grants, granted bytes, waiting declarations and prefixes, and the DRAM each
        DRAM server has left for new grants (``dram_free_bytes``)."""
        with self._lock:
            return self._routes.summary()

    def _prefix_grants_now(self) -> dict[str, Any]:
        """:meth:`prefix_grants` without waiting: when a registration holds the lock (it may
        wait for a launch), the figures of the last time they were computed, ``stale``."""
        if not self._lock.acquire(blocking=False):
            return self._routes.last_summary()
        try:
            return self._routes.summary()
        finally:
            self._lock.release()

    # -- sizing, launching and draining ---------------------------------------------------------

    def launch_server(
        self, tier: str, *, long_running: bool = False, deadline_s: float | None = None
    ) -> StorageNodeInfo:
        """Start a new storage server of ``tier`` and make it available for new jobs (the wait
        for it does not hold the lock)."""
        with self._lock:
            return self._allocator.launch_server(
                tier, long_running=long_running, deadline_s=deadline_s, release_lock=True
            )

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        """Release ``_lock`` entirely, however deep this thread holds it, for a wait that must
        not hold up other calls (a launch waiting for a node), then take it back as it was.
        ``RLock._release_save``/``_acquire_restore`` are what ``threading.Condition.wait`` uses
        to do the same."""
        saved = self._lock._release_save()  # type: ignore[attr-defined]
        try:
            yield
        finally:
            self._lock._acquire_restore(saved)  # type: ignore[attr-defined]

    def repair_jobs(self) -> list[str]:
        """Place the share that jobs' maps lack since a server of theirs died where no other
        had room, launching servers when the cluster may (see
        :class:`~pocketflow.control.repair.Repairer`); returns the ids of the jobs moved to a
        new epoch."""
        with self._lock:
            return self._repairer.repair()

    def size_cluster(self) -> dict[str, Any]:
        """Run the sizing policy once on the latest heartbeats and carry out its action.

        Vertical scaling (up and down) is the servers' ``set_cores`` action; a new server is
        launched only when the cluster may launch servers. Returns ``{"action", "reason", ...}``.
        """
        if self._scaler is None:
            return {"action": "none", "reason": "sizing is disabled"}
        with self._lock:
            return self._scaler.size(
                launch_server=self.launch_server, drain_server=self.drain_server
            )

    def sizing_actions(self) -> list[dict[str, Any]]:
        """The latest sizing actions, oldest first."""
        return self._scaler.actions() if self._scaler is not None else []

    def drain_server(self, node_id: str) -> dict[str, Any]:
        """Take a server out of service without losing live data (see
        :meth:`pocketflow.control.draining.Drainer.drain`)."""
        with self._lock:
            return self._drainer.drain(node_id)

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
        targets = sorted(
            info.node_id for info in self._membership.servers()
            if info.ray_node_id == ray_node_id
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
            waiting = [n for n in waiting if n in self._membership]
        return {
            "node": ray_node_id,
            "retired": [n for n in targets if n not in refused and n not in waiting],
            "still_draining": waiting,
            "refused": refused,
        }

    # -- reporting --------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Servers (with their latest heartbeat), per-tier capacity, registered and dead jobs.

        Reads only the heartbeats, never the servers. ``dead_servers`` lists the servers the
        failure detector declared dead.
        """
        servers, tiers = server_rows(self._membership)
        return {
            "servers": servers,
            "tiers": tiers,
            "jobs": job_rows(self._jobs),
            "dead_servers": self.dead_servers(),
            "draining": sorted(list(self._membership.draining)),
            "suspect": self.suspect_servers(),
            "epochs_unconfirmed": self._epochs_unconfirmed_now(),
            "drains_holding": self._drainer.holding(),
            "retired_servers": self._drainer.retired(),
            "job_ends_pending": self._ends.pending(),
            "sizing_actions": self.sizing_actions(),
            "prefix_grants": self._prefix_grants_now(),
            "cluster_metrics": dict(self._metrics.values),
            "resource_requests": self._allocator.resource_requests(),
        }

    def _epochs_unconfirmed_now(self) -> dict[str, list[str]]:
        """Which servers have not confirmed which job's epoch, without waiting for the lock
        (empty while a registration holds it)."""
        if not self._lock.acquire(blocking=False):
            return {}
        try:
            return self._epochs.unconfirmed()
        finally:
            self._lock.release()

    def cluster_metrics(self) -> dict[str, Any]:
        """The numbers last published as cluster metrics."""
        self._publish_metrics()
        return dict(self._metrics.values)

    def _publish_metrics(self) -> None:
        with self._lock:
            figures = metric_figures(self._membership, self._jobs)
        self._metrics.refresh(**figures)

    # -- the monitor loop and the end -----------------------------------------------------------

    def _monitor_loop(self) -> None:
        """Run the failure detector, lease and grant expiry, metrics and sizing until ``close``;
        an error is logged and the loop goes on."""
        interval_s = min(self._heartbeat_interval_ms / 2000.0, MONITOR_INTERVAL_S_MAX)
        while not self._stopping.wait(interval_s):
            try:
                self.check_failures()
            except Exception:
                log.exception("failure detector")
            try:
                self.reroute_suspects()
            except Exception:
                log.exception("rerouting around suspects")
            try:
                self.confirm_epochs()
            except Exception:
                log.exception("set_epoch retries")
            try:
                self._ends.retry()
            except Exception:
                log.exception("job end retries")
            try:
                with self._lock:
                    self._drainer.go_on()
            except Exception:
                log.exception("drains")
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
            try:
                self.repair_jobs()
            except Exception:
                log.exception("job repair")
            if self._scaler is not None and self._scaler.due():
                try:
                    self.size_cluster()
                except Exception:
                    log.exception("sizing loop")
            try:
                self._follow_resource_requests()
            except Exception:
                log.exception("autoscaler requests")

    def _follow_resource_requests(self) -> None:
        """Keep the autoscaler asked for the storage slots of the servers kept and starting
        (servers retire, die and are drained without launches knowing)."""
        launcher = self._allocator.launcher
        if launcher is not None:
            launcher.follow()

    def close(self) -> None:
        """Stop the background loops, stop the servers this controller launched, withdraw its
        autoscaler request and close the admin connections (the actor is ending)."""
        self._stopping.set()
        self._leases.close()
        monitor = self._monitor
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout=ADMIN_CALL_TIMEOUT_S * 2)
        self._detector.close()
        self._monitor_admin.close()
        with self._lock:
            self._admin.close()
            launched, self._allocator.launched = dict(self._allocator.launched), {}
        if launched:
            self._nodes.stop_all(list(launched.values()), timeout_s=LAUNCHED_STOP_TIMEOUT_S)
        if self._allocator.launcher is not None:
            self._allocator.launcher.withdraw()


def _grown(
    current: Allocation, old: JobDemand, new: JobDemand, spec: ClusterSpec,
    loads: list[ServerLoad], demand: JobDemand,
) -> PackResult:
    """A job's growth from ``old`` to ``demand`` on ``loads`` (one round of ``grow_job``'s
    packing; ``demand`` is ``new``, or ``new`` relaxed, whose old throughput is then dropped
    too)."""
    return grow(
        current,
        old=old if demand is new else without_throughput(old),
        new=demand,
        servers=loads,
        spec=spec,
    )
