"""The embedded local cluster: Ray, the control-plane actors and storage servers on 127.0.0.1."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pocketflow.auth import new_secret
from pocketflow.config import parse_duration, parse_size
from pocketflow.control import (
    CONTROLLER_ACTOR_NAME,
    METADATA_ACTOR_NAME,
    NAMESPACE,
    STORAGE_NODE_ACTOR_PREFIX,
)
from pocketflow.control.leases import LEASE_MS_DEFAULT
from pocketflow.control.loopback import keep_ray_on_loopback
from pocketflow.control.plane import ControlPlane, forget_started, last_started, remember_started
from pocketflow.control.tiers import TIER_DRAM, TIER_NVME, local_spec
from pocketflow.errors import ClusterError, ConfigError, PocketflowError
from pocketflow.hints import Hints
from pocketflow.job import Job, register_job
from pocketflow.processes import ProcessRef, children, descendants, terminate, wait_gone
from pocketflow.protocol import BLOCK_SIZE_MAX_BYTES
from pocketflow.tls import ClusterCA, cluster_ca_name, new_cluster_ca, write_ca_cert

if TYPE_CHECKING:
    from pocketflow.control.launcher import LaunchSpec
    from pocketflow.control.storage_node import StorageNodeInfo

log = logging.getLogger(__name__)

SERVERS_MAX = 64
"""Most storage servers one local cluster starts."""

OBJECT_STORE_BYTES_DEFAULT = 80 * 1024 * 1024
"""Ray object store size when this cluster starts Ray; pocketflow keeps no data in it."""

START_TIMEOUT_S = 120.0
"""How long starting the actors and their servers may take."""

STOP_TIMEOUT_S = 15.0
"""How long each stop step waits before escalating (actor call, then SIGTERM, then SIGKILL)."""

GCS_PROBE_TIMEOUT_S = 1.0
"""How long stopping waits for a TCP connection to Ray's GCS to learn whether it is there."""

METADATA_RESTARTS_MAX = 100
"""How many times Ray restarts a dead ``Metadata`` actor (it replays its log on each start)."""

CONTROLLER_CONCURRENCY_MAX = 8
"""Threads of the ``Controller`` actor: heartbeats are taken while a registration waits."""

CONTROLLER_RESTARTS_MAX = 10
"""How many crashes of the ``Controller`` actor Ray repairs by restarting it."""


@dataclass(frozen=True)
class _NodePlan:
    node_id: str
    tier: str
    capacity_bytes: int
    long_running: bool


class LocalCluster:
    """A pocketflow cluster on this machine, started and stopped by this process.

    Starts Ray (unless this process is already connected to Ray), makes a fresh cluster secret (in
    memory: see :attr:`secret`), and starts the ``Metadata``, ``StorageNode`` (one per storage
    server) and ``Controller`` actors. Every server is long-running (holds PERSIST data, DRAM
    first, NVMe for what DRAM cannot hold); NVMe servers keep their data in a file of the
    temporary directory, which must support O_DIRECT (``/tmp`` on ext4 does, tmpfs does not).
    Every server listens on 127.0.0.1 on a random port. PERSIST objects expire ``persist_ttl``
    after they are written (``None``: never). The ``Metadata`` actor logs every change to
    ``metadata_log`` (default ``metadata.log`` in the temporary directory; a shared path survives
    the node).

    Use it as a context manager::

        with pocketflow.LocalCluster() as cluster:
            with cluster.register_job("sort") as job:
                ...

    ``stop`` (also on leaving the block, on an exception, and at interpreter exit) stops every
    process the cluster started, by process id, and stops Ray if the cluster started it.

    Elasticity is off by default, so the servers are exactly the ones asked for. With
    ``autoscale=True`` the controller launches servers (up to ``servers_max``) when a job does not
    fit, and with a ``sizing_interval`` too it runs the sizing loop (add a server above 80%
    utilization, drain one below 60%, ``sizing_cooldown`` between actions). Each node sends a
    heartbeat every ``heartbeat_interval``; a server silent for ``dead_after`` is declared dead.

    On a multi-node Ray cluster (this process connected to it first), ``storage_resources=True``
    places every storage server, the initial ones and the launched ones, on a node that
    advertises a free ``pocketflow_storage_<tier>`` resource unit; when none has one, the
    controller asks Ray's autoscaler (``request_resources``) and the launch waits, bounded by
    ``register_timeout``.

    Every server listens on the address of the Ray node it runs on (127.0.0.1 here, since the
    embedded Ray stays on loopback; a node's own address on a multi-node cluster). With
    ``tls=True`` the cluster makes a CA named after it, in memory (only its certificate is written,
    to ``tls/ca.pem`` in its temporary directory); each server gets a certificate the CA signs for
    its address (its key made by its node, and handed to it over stdin) and accepts TLS
    connections only, and every job handle carries the CA certificate (``JobHandle.tls_ca``).
    The controller holds the CA too, and signs the certificates of the servers it launches. A
    server on a non-loopback address refuses to start without TLS. Each server also serves
    Prometheus metrics on a port of its own (``status()["servers"][i]["metrics_url"]``).
    """

    def __init__(
        self,
        dram_servers: int = 2,
        nvme_servers: int = 1,
        dram_capacity: int | str = "256MiB",
        nvme_capacity: int | str = "1GiB",
        block_size: int | str = "1MiB",
        *,
        num_cpus: int = 2,
        object_store_memory: int | str = OBJECT_STORE_BYTES_DEFAULT,
        server_threads: int | None = None,
        token_ttl: float | str = "24h",
        tmp_dir: str | os.PathLike[str] | None = None,
        heartbeat_interval: float | str = "1s",
        dead_after: float | str = "3s",
        autoscale: bool = False,
        servers_max: int = SERVERS_MAX,
        register_timeout: float | str = "60s",
        sizing_interval: float | str | None = None,
        sizing_cooldown: float | str = "10s",
        storage_resources: bool = False,
        metadata_log: str | os.PathLike[str] | None = None,
        persist_ttl: float | str | None = "24h",
        tls: bool = False,
    ) -> None:
        if dram_servers < 0 or nvme_servers < 0 or dram_servers + nvme_servers == 0:
            raise ConfigError("a local cluster needs at least one storage server")
        if dram_servers + nvme_servers > SERVERS_MAX:
            raise ConfigError(f"a local cluster runs at most {SERVERS_MAX} storage servers")
        if num_cpus < 1:
            raise ConfigError(f"num_cpus must be at least 1, got {num_cpus}")
        self._dram_capacity_bytes = parse_size(dram_capacity, name="dram_capacity")
        self._nvme_capacity_bytes = parse_size(nvme_capacity, name="nvme_capacity")
        self._block_size_bytes = parse_size(block_size, name="block_size")
        if not 0 < self._block_size_bytes <= BLOCK_SIZE_MAX_BYTES:
            raise ConfigError(f"block_size must be 1..{BLOCK_SIZE_MAX_BYTES} bytes")
        self._object_store_bytes = parse_size(object_store_memory, name="object_store_memory")
        self._token_ttl_s = parse_duration(token_ttl, name="token_ttl")
        self._heartbeat_interval_ms = int(
            parse_duration(heartbeat_interval, name="heartbeat_interval") * 1000
        )
        self._dead_after_ms = int(parse_duration(dead_after, name="dead_after") * 1000)
        if self._dead_after_ms <= self._heartbeat_interval_ms:
            raise ConfigError("dead_after must be longer than heartbeat_interval")
        if not dram_servers + nvme_servers <= servers_max <= SERVERS_MAX:
            raise ConfigError(f"servers_max must be between the initial servers and {SERVERS_MAX}")
        self._autoscale = autoscale
        self._servers_max = servers_max
        self._register_timeout_s = parse_duration(register_timeout, name="register_timeout")
        # The sizing loop runs only with autoscale and an interval; tests keep it off.
        self._sizing_interval_ms = (
            None
            if sizing_interval is None or not autoscale
            else int(parse_duration(sizing_interval, name="sizing_interval") * 1000)
        )
        self._sizing_cooldown_s = parse_duration(sizing_cooldown, name="sizing_cooldown")
        self._storage_resources = storage_resources
        self._tls = bool(tls)
        self._num_cpus = num_cpus
        self._server_threads = server_threads
        self._tmp_dir = None if tmp_dir is None else Path(tmp_dir)
        self._metadata_log = None if metadata_log is None else Path(metadata_log)
        # PERSIST objects live on the long-running servers; None keeps them until those exit.
        self._persist_ttl_ms = (
            None
            if persist_ttl is None
            else max(1, int(parse_duration(persist_ttl, name="persist_ttl") * 1000))
        )
        self._plans = [
            _NodePlan(f"dram-{i}", TIER_DRAM, self._dram_capacity_bytes, long_running=True)
            for i in range(dram_servers)
        ] + [
            # Long-running too: PERSIST outputs bigger than DRAM go on to NVMe, and every job's
            # map holds the NVMe servers (weight 0 when unchosen) for what outgrows its DRAM.
            _NodePlan(f"nvme-{i}", TIER_NVME, self._nvme_capacity_bytes, long_running=True)
            for i in range(nvme_servers)
        ]

        # The cluster secret and CA live in this process's memory (and the control plane's),
        # never in a file: see `secret`.
        self._secret = new_secret()
        self._ca: ClusterCA | None = None
        self._lock = threading.Lock()
        self._state = "new"
        self._work_dir: Path | None = None
        self._owns_ray = False
        self._ray_roots: list[ProcessRef] = []
        self._ray_address: str | None = None
        self._metadata: Any = None
        self._controller: Any = None
        self._nodes: dict[str, Any] = {}
        self._infos: dict[str, StorageNodeInfo] = {}
        self._launched_infos: dict[str, StorageNodeInfo] = {}
        self._control: ControlPlane | None = None

    # -- lifecycle --------------------------------------------------------------------------

    @classmethod
    def current(cls) -> LocalCluster | None:
        """The most recently started cluster of this process that is still running."""
        current = last_started()
        return current if isinstance(current, LocalCluster) else None

    def start(self) -> LocalCluster:
        """Start Ray (if needed), the actors and the storage servers; returns ``self``."""
        with self._lock:
            if self._state != "new":
                raise ClusterError(f"this LocalCluster is {self._state}; create a new one")
            self._state = "starting"
        try:
            self._work_dir = Path(
                tempfile.mkdtemp(prefix="pocketflow-", dir=self._tmp_dir)
            )
            if self._tls:
                self._ca = new_cluster_ca(cluster_ca_name(self.work_dir.name))
                # Only the CA's certificate (public) is written, for clients and operators.
                write_ca_cert(self.work_dir / "tls", self._ca.cert_pem)
            self._start_ray()
            self._start_actors()
        except BaseException:
            self.stop()
            raise
        with self._lock:
            self._state = "running"
        remember_started(self)
        atexit.register(_stop_at_exit, weakref.ref(self))
        return self

    def stop(self) -> None:
        """Stop every process this cluster started, by process id; safe to call more than once.

        Order: each ``StorageNode`` stops its server, the actors are killed, any server still alive
        is terminated by pid, then Ray is shut down if this cluster started it and any Ray process
        still alive is terminated by pid. Finally the temporary directory is removed.
        """
        with self._lock:
            if self._state in ("stopping", "stopped"):
                return
            never_started = self._state == "new"
            self._state = "stopping"
        if never_started:
            # Nothing of it runs: touching Ray here would reach whatever Ray cluster this
            # process is connected to (another LocalCluster's), so only the pool is freed.
            self._free_arena_pool()
            with self._lock:
                self._state = "stopped"
            return
        forget_started(self)
        try:
            self._stop_actors()
            leftover = terminate(
                [
                    info.server_process()
                    for info in [*self._infos.values(), *self._launched_infos.values()]
                ],
                timeout_s=STOP_TIMEOUT_S,
            )
            if leftover:
                log.error("storage servers survived SIGKILL: %s", [r.pid for r in leftover])
            self._stop_ray()
            self._free_arena_pool()
        finally:
            if self._work_dir is not None:
                shutil.rmtree(self._work_dir, ignore_errors=True)
            with self._lock:
                self._state = "stopped"

    @staticmethod
    def _free_arena_pool() -> None:
        """Remove the free slots of the host's cache read pool (the tasks' processes that held
        them are gone by now; a slot another live process holds is left)."""
        try:
            from pocketflow.cache.client import free_arena_pool

            free_arena_pool()
        except Exception as exc:  # best effort: stopping must not fail over a cleanup
            log.debug("freeing the cache's shared-memory pool failed: %s", exc)

    def __enter__(self) -> LocalCluster:
        if self._state == "new":
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- what runs --------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the cluster is started and not stopped."""
        return self._state == "running"

    @property
    def control(self) -> ControlPlane:
        """The control plane (the ``Controller`` actor) of this cluster."""
        if self._control is None:
            raise ClusterError("the local cluster is not running")
        return self._control

    @property
    def ray_address(self) -> str:
        """The Ray cluster's GCS address (``host:port``), for ``ray.init(address=...)``."""
        if self._ray_address is None:
            raise ClusterError("the local cluster is not running")
        return self._ray_address

    @property
    def work_dir(self) -> Path:
        """The cluster's own temporary directory (metadata log, NVMe data files, CA certificate)."""
        if self._work_dir is None:
            raise ClusterError("the local cluster is not started")
        return self._work_dir

    @property
    def metadata_log(self) -> Path:
        """The ``Metadata`` actor's append-only log (default: ``metadata.log`` in ``work_dir``)."""
        return self._metadata_log or self.work_dir / "metadata.log"

    @property
    def secret(self) -> bytes:
        """The cluster secret that keys every capability token. It lives in the memory of this
        process, the controller, the storage nodes and the servers only (never in a file or on a
        command line): pass it to nothing a task can read."""
        return self._secret

    @property
    def tls_dir(self) -> Path | None:
        """The cluster's TLS directory (the CA certificate, ``ca.pem``), ``None`` without TLS."""
        return self.work_dir / "tls" if self._tls else None

    @property
    def tls_ca(self) -> str | None:
        """The cluster CA certificate (PEM) clients trust, ``None`` without TLS."""
        return self._ca.cert_pem if self._ca is not None else None

    @property
    def block_size_bytes(self) -> int:
        """Block size of large objects in the handles this cluster issues."""
        return self._block_size_bytes

    @property
    def persist_ttl_ms(self) -> int | None:
        """How long PERSIST objects live on the long-running servers (``None``: until deleted)."""
        return self._persist_ttl_ms

    @property
    def servers(self) -> tuple[StorageNodeInfo, ...]:
        """The started storage servers, in start order (DRAM first)."""
        return tuple(self._infos[p.node_id] for p in self._plans if p.node_id in self._infos)

    @property
    def owns_ray(self) -> bool:
        """Whether this cluster started Ray (and therefore stops it)."""
        return self._owns_ray

    def process_ids(self) -> dict[str, list[int]]:
        """Live process ids this cluster started: ``{"servers": [...], "ray": [...]}``.

        ``"ray"`` lists Ray's own processes and workers (actors included), and is empty when the
        cluster joined a Ray instance it did not start.
        """
        servers = [i.server_pid for i in self._infos.values() if i.server_process().alive()]
        ray_pids = sorted({r.pid for r in self._ray_tree()} - set(servers))
        return {"servers": sorted(servers), "ray": ray_pids}

    def status(self) -> dict[str, Any]:
        """Servers, tiers and registered jobs, as the controller reports them."""
        return self.control.status()

    def register_job(
        self,
        name: str,
        hints: Hints | Mapping[str, Any] | None = None,
        *,
        lease_ms: int | None = LEASE_MS_DEFAULT,
        **options: Any,
    ) -> Job:
        """Register a job on this cluster (see :func:`pocketflow.register_job`)."""
        return register_job(name, hints, cluster=self, lease_ms=lease_ms, **options)

    def __repr__(self) -> str:
        return (
            f"<LocalCluster {self._state} servers="
            f"{[p.node_id for p in self._plans]} work_dir={self._work_dir}>"
        )

    # -- internals --------------------------------------------------------------------------

    def _start_ray(self) -> None:
        import ray

        if ray.is_initialized():
            self._owns_ray = False
        else:
            keep_ray_on_loopback()
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            before = children()
            # Ray's workers must import pocketflow even from a source checkout that is not
            # installed; they inherit the environment of the Ray processes started here.
            saved_path = os.environ.get("PYTHONPATH")
            package_parent = str(Path(__file__).resolve().parent.parent)
            os.environ["PYTHONPATH"] = os.pathsep.join(
                p for p in (package_parent, saved_path) if p
            )
            try:
                ray.init(
                    address="local",
                    num_cpus=self._num_cpus,
                    object_store_memory=self._object_store_bytes,
                    include_dashboard=False,
                    namespace=NAMESPACE,
                    log_to_driver=False,
                    logging_level=logging.WARNING,
                )
            except Exception as exc:  # noqa: BLE001 - Ray's start fails with plain Exception too
                # What the failed start left running (its GCS, a raylet that missed its bound)
                # was started here: ended by pid, so that nothing is left behind.
                started = children() - before
                started |= {d for pid in started for d in descendants(pid)}
                left = [ref for ref in (ProcessRef.of(pid) for pid in started) if ref]
                with contextlib.suppress(Exception):
                    ray.shutdown()
                terminate(left, timeout_s=STOP_TIMEOUT_S)
                raise ClusterError(ray_start_error(exc)) from exc
            finally:
                if saved_path is None:
                    os.environ.pop("PYTHONPATH", None)
                else:
                    os.environ["PYTHONPATH"] = saved_path
            self._owns_ray = True
            self._ray_roots = [
                ref for ref in (ProcessRef.of(pid) for pid in children() - before) if ref
            ]
        self._ray_address = ray.get_runtime_context().gcs_address

    def _start_actors(self) -> None:
        import ray

        from pocketflow.control.controller import SIZING_INTERVAL_MS_DEFAULT, Controller
        from pocketflow.control.launcher import tier_resource
        from pocketflow.control.metadata import Metadata
        from pocketflow.control.sizing import SizingBounds
        from pocketflow.control.storage_node import StorageNode

        options = {"namespace": NAMESPACE, "num_cpus": 0, "max_restarts": 0}
        try:
            ray.get_actor(CONTROLLER_ACTOR_NAME, namespace=NAMESPACE)
        except ValueError:
            pass
        else:
            raise ClusterError("a pocketflow cluster is already running in this Ray instance")

        # The control plane stays on this process's node: on a multi-node cluster a zero-CPU
        # actor may land on any node, and the autoscaler removes a node whose resources are idle
        # whatever actors it runs (a storage node, once its server retired).
        control_options = dict(options)
        if self._storage_resources:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            control_options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False
            )
        # Ray restarts a dead Metadata actor, which replays its log (see control/metadata.py).
        self._metadata = (
            ray.remote(Metadata)
            .options(name=METADATA_ACTOR_NAME,
                     **{**control_options, "max_restarts": METADATA_RESTARTS_MAX})
            .remote(str(self.metadata_log))
        )
        for plan in self._plans:
            nvme_path = (
                str(self.work_dir / f"{plan.node_id}.data") if plan.tier == TIER_NVME else None
            )
            node_options = dict(options)
            if self._storage_resources:
                node_options["resources"] = {tier_resource(plan.tier): 1}
            self._nodes[plan.node_id] = (
                ray.remote(StorageNode)
                .options(name=STORAGE_NODE_ACTOR_PREFIX + plan.node_id, **node_options)
                .remote(
                    node_id=plan.node_id,
                    tier=plan.tier,
                    capacity_bytes=plan.capacity_bytes,
                    secret=self._secret,
                    long_running=plan.long_running,
                    nvme_path=nvme_path,
                    threads=self._server_threads,
                    persist_ttl_ms=self._persist_ttl_ms if plan.long_running else None,
                    tls_ca=self.tls_ca,
                )
            )
        starts = {
            node_id: node.start.remote(self._sign(node_id, node))
            for node_id, node in self._nodes.items()
        }
        first_error: BaseException | None = None
        for node_id, ref in starts.items():
            try:
                self._infos[node_id] = ray.get(ref, timeout=START_TIMEOUT_S)
            except Exception as exc:
                first_error = first_error or _unwrap(exc, f"starting storage node {node_id}")
        if first_error is not None:
            raise first_error

        # Ray restarts a crashed Controller, which rebuilds its state from the Metadata actor's
        # records and the storage nodes (pocketflow.control.restore).
        self._controller = (
            ray.remote(Controller)
            .options(
                name=CONTROLLER_ACTOR_NAME,
                max_concurrency=CONTROLLER_CONCURRENCY_MAX,
                **{**control_options, "max_restarts": CONTROLLER_RESTARTS_MAX},
            )
            .remote(
                secret=self._secret,
                metadata=self._metadata,
                block_size_bytes=self._block_size_bytes,
                token_ttl_s=self._token_ttl_s,
                heartbeat_interval_ms=self._heartbeat_interval_ms,
                dead_after_ms=self._dead_after_ms,
                cluster_spec=local_spec(
                    dram_capacity_bytes=self._dram_capacity_bytes,
                    nvme_capacity_bytes=self._nvme_capacity_bytes,
                ),
                launch=self._launch_spec() if self._autoscale else None,
                register_timeout_s=self._register_timeout_s,
                sizing=None
                if self._sizing_interval_ms is None
                else SizingBounds(
                    cooldown_s=self._sizing_cooldown_s,
                    vertical_cooldown_s=min(self._sizing_cooldown_s, 2.0),
                    servers_max=self._servers_max,
                ),
                sizing_interval_ms=self._sizing_interval_ms or SIZING_INTERVAL_MS_DEFAULT,
                ca=self._ca,
            )
        )
        try:
            ray.get(
                [
                    self._controller.add_server.remote(info, self._nodes[info.node_id])
                    for info in self.servers
                ],
                timeout=START_TIMEOUT_S,
            )
        except Exception as exc:
            raise _unwrap(exc, "starting the controller") from exc
        self._control = ControlPlane(
            self._controller, register_timeout_s=self._register_timeout_s
        )

    def _launch_spec(self) -> LaunchSpec:
        """How the controller starts more servers of this cluster (``autoscale=True``)."""
        from pocketflow.control.launcher import LaunchSpec

        return LaunchSpec(
            data_dir=str(self.work_dir),
            capacity_bytes_by_tier={
                TIER_DRAM: self._dram_capacity_bytes,
                TIER_NVME: self._nvme_capacity_bytes,
            },
            threads=self._server_threads,
            persist_ttl_ms=self._persist_ttl_ms,
            use_resources=self._storage_resources,
            servers_max=self._servers_max,
        )

    def _sign(self, node_id: str, node: Any) -> str | None:
        """The certificate this cluster's CA signs for ``node``'s request (``None`` without
        TLS)."""
        import ray

        if self._ca is None:
            return None
        try:
            request = ray.get(node.certificate_request.remote(), timeout=START_TIMEOUT_S)
        except Exception as exc:
            raise _unwrap(exc, f"starting storage node {node_id}") from exc
        return self._ca.sign(request, node_id)

    def _stop_actors(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        if self._gcs_gone():
            # Killed under us (another user's `ray stop`): every call through Ray would wait
            # out Ray's own bound on reaching the GCS (60 s) and then end this process. The
            # actors died with it; their servers are ended by pid after this.
            log.warning("Ray's GCS at %s is gone: not stopping the actors through it",
                        self._ray_address)
            self._control = None
            return
        if self._nodes:
            refs = [node.stop.remote() for node in self._nodes.values()]
            try:
                ray.get(refs, timeout=STOP_TIMEOUT_S)
            except Exception as exc:
                log.warning("storage nodes did not stop cleanly: %s", exc)
        if self._controller is not None:
            # Servers the controller launched are stopped by it; their pids are kept so that
            # `stop` can still terminate any survivor by pid.
            try:
                for info in ray.get(self._controller.servers.remote(), timeout=STOP_TIMEOUT_S):
                    self._launched_infos.setdefault(info.node_id, info)
            except Exception as exc:
                log.warning("could not list the controller's servers: %s", exc)
            try:
                ray.get(self._controller.close.remote(), timeout=STOP_TIMEOUT_S)
            except Exception as exc:
                log.warning("controller did not close cleanly: %s", exc)
        for actor in [self._controller, self._metadata, *self._nodes.values()]:
            if actor is None:
                continue
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:
                log.warning("could not kill actor: %s", exc)
        self._control = None
        self._end_launched_nodes()
        if self._autoscale and self._storage_resources:
            _withdraw_resource_request()

    def _gcs_gone(self) -> bool:
        """Whether Ray's GCS of this cluster refuses connections (it is not running)."""
        if self._ray_address is None:
            return False
        host, _, port = self._ray_address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)),
                                     timeout=GCS_PROBE_TIMEOUT_S).close()
        except ConnectionRefusedError:
            return True
        except (OSError, ValueError):  # slow or unknown: not known to be gone
            return False
        return False

    def _end_launched_nodes(self) -> None:
        """End every ``StorageNode`` actor of pocketflow's namespace still alive: the nodes the
        controller launched are detached actors (they outlive a crashed controller), and a
        controller that could not close leaves them running. Their servers exit with them."""
        import ray

        try:
            named = ray.util.list_named_actors(all_namespaces=True)
        except Exception as exc:  # noqa: BLE001 - Ray is going away
            log.warning("could not list the storage nodes left: %s", exc)
            return
        for entry in named:
            name = str(entry.get("name", ""))
            if entry.get("namespace") != NAMESPACE or not name.startswith(
                STORAGE_NODE_ACTOR_PREFIX
            ):
                continue
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            except Exception as exc:  # noqa: BLE001 - ended meanwhile
                log.info("storage node %s: %s", name, exc)

    def _stop_ray(self) -> None:
        if not self._owns_ray:
            return
        import ray

        tree = self._ray_tree()
        ray.shutdown()
        leftover = terminate(wait_gone(tree, timeout_s=STOP_TIMEOUT_S), timeout_s=STOP_TIMEOUT_S)
        if leftover:
            log.error("Ray processes survived SIGKILL: %s", [r.pid for r in leftover])

    def _ray_tree(self) -> list[ProcessRef]:
        """Ray's processes started by this cluster and all their descendants, alive now."""
        tree = {r for r in self._ray_roots if r.alive()}
        for root in list(tree):
            for pid in descendants(root.pid):
                ref = ProcessRef.of(pid)
                if ref is not None:
                    tree.add(ref)
        return sorted(tree, key=lambda r: r.pid)


def _withdraw_resource_request() -> None:
    """Clear the autoscaler request for storage slots (the controller withdraws it when it
    closes; this covers a controller that crashed or could not close)."""
    try:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[])
    except Exception as exc:  # noqa: BLE001 - no autoscaler API, or Ray is going away
        log.warning("could not withdraw the autoscaler request: %s", exc)


def _unwrap(exc: BaseException, doing: str) -> BaseException:
    """The pocketflow error inside a Ray error, else a ``ClusterError`` describing it."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, PocketflowError):
        return cause
    if isinstance(exc, PocketflowError):
        return exc
    error = ClusterError(f"{doing} failed: {exc}")
    # Raised later, outside the except block: keep the Ray error as the cause explicitly.
    error.__cause__ = exc
    return error


def ray_start_error(exc: BaseException) -> str:
    """What to tell the user when Ray did not start in this process."""
    message = f"could not start Ray: {str(exc).strip() or type(exc).__name__}"
    if "timed out" in str(exc):
        message += (
            " (Ray gives a node's raylet 30 s to start, which a heavily loaded machine can miss: "
            "try again when it is quieter, or start Ray once with `pocketflow up --local` and "
            "pass its address)"
        )
    return message


def _stop_at_exit(ref: weakref.ReferenceType[LocalCluster]) -> None:
    cluster = ref()
    if cluster is not None:
        cluster.stop()
