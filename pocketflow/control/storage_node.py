"""The ``StorageNode`` actor: starts one storage server, sends its heartbeats, stops it by pid."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pocketflow.control.admin import AdminTokens
from pocketflow.control.tiers import TIER_DRAM
from pocketflow.errors import PocketflowError, ServerStartError
from pocketflow.processes import ProcessRef
from pocketflow.server_process import ServerKeys, ServerSpec, StorageServerProcess
from pocketflow.tls import server_key_and_request

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_MS_DEFAULT = 1000
"""How often a storage node reports its server's statistics to the controller."""

HEARTBEAT_INTERVAL_MS_MIN = 50
"""Shortest accepted heartbeat interval."""

HEARTBEAT_STATS_TIMEOUT_S = 2.0
"""Deadline of the ``stats`` call a heartbeat makes; a hung server then sends no heartbeat."""

HEARTBEATS_IN_FLIGHT_MAX = 2
"""Most heartbeats sent to the controller and not yet delivered; further ones are skipped."""

ORPHAN_CHECK_INTERVAL_S = 5.0
"""How often a launched node asks whether a live controller knows its server."""

ORPHAN_CHECKS_MAX = 2
"""Consecutive answers "unknown" (or no controller at all) after which a launched node stops its
server and ends itself: its controller is gone for good, or restarted without it."""

ORPHAN_CALL_TIMEOUT_S = 5.0
"""Deadline of one orphan check's call to the controller; a call that does not answer (the
controller is restarting or busy) decides nothing."""


@dataclass(frozen=True)
class StorageNodeInfo:
    """Where a started storage server listens and which processes run it."""

    node_id: str
    tier: str
    address: str
    capacity_bytes: int
    long_running: bool
    server_pid: int
    server_start_time: float
    actor_pid: int
    ray_node_id: str = ""
    """The Ray node the server runs on (hex id), empty outside Ray."""
    metrics_url: str = ""
    """Where the server serves Prometheus metrics (``http://host:port/metrics``)."""
    tls: bool = False
    """Whether every connection to the server must use TLS."""
    launched: bool = False
    """Whether the controller launched it (a detached actor the controller stops), as opposed to
    one its cluster started."""

    def server_process(self) -> ProcessRef:
        """The server process, for stopping it by pid when its actor cannot."""
        return ProcessRef(pid=self.server_pid, start_time=self.server_start_time)


class StorageNode:
    """Supervises one ``pocketflow-server`` process.

    The server is started with ``--parent-pid`` set to this actor's process, so it exits by itself
    if the actor dies. Its keys (the cluster ``secret`` and, with TLS, its certificate and key)
    reach it over stdin (``--keys-from-stdin``): never on its command line or in a file. With
    ``tls_ca`` (the cluster CA certificate) the node makes its server's key itself, sends a
    certificate request for the node's address (:meth:`certificate_request`) to whoever holds the
    CA (the process that started the cluster, or the controller), and :meth:`start` takes the
    signed certificate; the key never leaves the node.

    The actor is thin glue: it starts, describes, queries and stops its server, and, once
    :meth:`start_heartbeats` is called, a background thread pushes the server's statistics to the
    controller every heartbeat interval (fire and forget, at most ``HEARTBEATS_IN_FLIGHT_MAX``
    undelivered). A server that does not answer ``stats`` within ``HEARTBEAT_STATS_TIMEOUT_S``
    or has exited sends no heartbeat; the controller's failure detector notices the silence.

    A node the controller ``launched`` is a detached actor (it outlives a crash of the controller,
    which takes it back when Ray restarts it); once started it asks the controller every
    ``ORPHAN_CHECK_INTERVAL_S`` whether it knows the server, and after ``ORPHAN_CHECKS_MAX``
    answers in a row that it does not (or that there is no controller) it stops its server and
    ends itself, so a node left behind by a controller that is gone for good, or by a launch the
    restarted controller never saw finish, frees its Ray node.
    """

    def __init__(
        self,
        *,
        node_id: str,
        tier: str,
        capacity_bytes: int,
        secret: bytes,
        long_running: bool = False,
        nvme_path: str | None = None,
        threads: int | None = None,
        persist_ttl_ms: int | None = None,
        tls_ca: str | None = None,
        launched: bool = False,
    ) -> None:
        # The server listens on the address Ray knows this node by (127.0.0.1 on an embedded
        # cluster); with TLS its certificate names that address.
        host = node_address()
        self._secret = secret
        self._tls_ca = tls_ca
        self._tls_key_pem: str | None = None
        self._tls_request_pem: str | None = None
        if tls_ca is not None:
            self._tls_key_pem, self._tls_request_pem = server_key_and_request(node_id, host)
        self._spec = ServerSpec(
            node_id=node_id,
            tier=tier,
            capacity_bytes=capacity_bytes,
            long_running=long_running,
            nvme_path=Path(nvme_path) if nvme_path else None,
            threads=threads,
            parent_pid=os.getpid(),
            persist_ttl_ms=persist_ttl_ms,
            listen_host=host,
            shared_dram=shares_dram(tier, host, tls=tls_ca is not None),
        )
        self._process: StorageServerProcess | None = None
        self._admin = AdminTokens(secret, tls_ca=tls_ca)
        self._info: StorageNodeInfo | None = None
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        self._heartbeats_sent = 0
        self._launched = launched
        self._orphan_thread: threading.Thread | None = None

    def certificate_request(self) -> str | None:
        """The certificate request (PEM) for this node's server, ``None`` without TLS."""
        return self._tls_request_pem

    def start(self, tls_cert_pem: str | None = None) -> StorageNodeInfo:
        """Start the server and wait until it listens; returns where it runs. With TLS,
        ``tls_cert_pem`` is the certificate the cluster CA signed for :meth:`certificate_request`
        (``ServerStartError`` without it)."""
        if self._process is not None:
            raise ServerStartError(f"server {self._spec.node_id} already started")
        if self._tls_ca is not None and tls_cert_pem is None:
            raise ServerStartError(
                f"server {self._spec.node_id} uses TLS: start it with its signed certificate"
            )
        keys = ServerKeys(
            secret=self._secret,
            tls_cert_pem=tls_cert_pem if self._tls_ca is not None else None,
            tls_key_pem=self._tls_key_pem,
        )
        self._process = StorageServerProcess(dataclasses.replace(self._spec, keys=keys))
        address = self._process.start()
        ref = ProcessRef.of(self._process.pid)
        if ref is None:
            raise ServerStartError(
                f"server {self._spec.node_id} exited right after start: "
                + self._process.stderr_tail()
            )
        self._info = StorageNodeInfo(
            node_id=self._spec.node_id,
            tier=self._spec.tier,
            address=address,
            capacity_bytes=self._spec.capacity_bytes,
            long_running=self._spec.long_running,
            server_pid=ref.pid,
            server_start_time=ref.start_time,
            actor_pid=os.getpid(),
            ray_node_id=_ray_node_id(),
            metrics_url=self._process.metrics_url or "",
            tls=self._tls_ca is not None,
            launched=self._launched,
        )
        if self._launched and _running_ray() is not None:
            self._orphan_thread = threading.Thread(
                target=self._orphan_watch, name=f"orphan-watch-{self._spec.node_id}",
                daemon=True,
            )
            self._orphan_thread.start()
        return self._info

    def info(self) -> StorageNodeInfo:
        """Where the server runs. Raises ``ServerStartError`` before ``start``."""
        if self._info is None:
            raise ServerStartError(f"server {self._spec.node_id} is not started")
        return self._info

    def alive(self) -> bool:
        """Whether the server process is running."""
        return self._process is not None and self._process.alive()

    def stats(self) -> dict[str, Any]:
        """The server's last statistics sample (see docs/PROTOCOL.md, Statistics)."""
        return self._admin.client(self.info().address).stats()

    def stderr_tail(self) -> str:
        """The last lines the server wrote to stderr, for diagnosing failures."""
        return self._process.stderr_tail() if self._process is not None else ""

    def start_heartbeats(self, controller: Any, interval_ms: int) -> None:
        """Push the server's statistics to ``controller.heartbeat`` every ``interval_ms``.

        ``controller`` is the ``Controller`` actor's handle. Calling it again does nothing.
        """
        if self._heartbeat_thread is not None:
            return
        interval_s = max(int(interval_ms), HEARTBEAT_INTERVAL_MS_MIN) / 1000.0
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop,
            args=(controller, interval_s),
            name=f"heartbeat-{self._spec.node_id}",
            daemon=True,
        )
        self._heartbeat_thread.start()

    def heartbeats_sent(self) -> int:
        """How many heartbeats this node has sent (for tests and diagnostics)."""
        return self._heartbeats_sent

    def stop_heartbeats(self) -> None:
        """Stop sending heartbeats (the controller then sees the server as silent)."""
        self._heartbeat_stop.set()
        thread = self._heartbeat_thread
        if thread is not None:
            thread.join(timeout=HEARTBEAT_STATS_TIMEOUT_S + 1.0)

    def stop(self) -> int | None:
        """Stop the heartbeats, then the server by its pid (SIGTERM, then SIGKILL).

        Returns the server's exit status.
        """
        self.stop_heartbeats()
        self._admin.close()
        return self._process.stop() if self._process is not None else None

    def _orphan_watch(self) -> None:
        """Stop the server and end this actor once no live controller knows it (class doc)."""
        import ray

        from pocketflow.control import CONTROLLER_ACTOR_NAME, NAMESPACE

        node_id = self._spec.node_id
        unknown = 0
        while not self._heartbeat_stop.wait(ORPHAN_CHECK_INTERVAL_S):
            try:
                controller = ray.get_actor(CONTROLLER_ACTOR_NAME, namespace=NAMESPACE)
            except ValueError:
                known: bool | None = False  # no controller of that name: gone for good
            else:
                try:
                    known = bool(ray.get(controller.knows_server.remote(node_id),
                                         timeout=ORPHAN_CALL_TIMEOUT_S))
                except Exception as exc:  # noqa: BLE001 - restarting or busy: decides nothing
                    log.info("orphan check of %s: the controller did not answer: %s",
                             node_id, exc)
                    known = None
            if known is None:
                continue
            unknown = 0 if known else unknown + 1
            if unknown >= ORPHAN_CHECKS_MAX:
                break
        else:
            return
        log.warning("storage server %s: no controller knows it; stopping it", node_id)
        self.stop()
        try:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - already ending
            log.info("ending the node of %s: %s", node_id, exc)

    def _heartbeat_loop(self, controller: Any, interval_s: float) -> None:
        import ray

        admin = AdminTokens(
            self._secret, timeout_s=HEARTBEAT_STATS_TIMEOUT_S, tls_ca=self._tls_ca
        )
        in_flight: list[Any] = []
        node_id = self._spec.node_id
        try:
            while not self._heartbeat_stop.wait(interval_s):
                if not self.alive():
                    log.warning("server %s exited; heartbeats stop", node_id)
                    return
                try:
                    stats = admin.sampled_stats(self.info().address)
                except PocketflowError as exc:
                    log.warning("no heartbeat from %s: stats failed: %s", node_id, exc)
                    admin.forget(self.info().address)
                    continue
                if in_flight:
                    _, in_flight = ray.wait(in_flight, num_returns=len(in_flight), timeout=0)
                if len(in_flight) >= HEARTBEATS_IN_FLIGHT_MAX:
                    log.warning("controller is slow; heartbeat of %s skipped", node_id)
                    continue
                try:
                    in_flight.append(controller.heartbeat.remote(node_id, stats))
                except Exception as exc:  # the controller actor is gone or Ray is shutting down
                    log.warning("heartbeat of %s not sent: %s", node_id, exc)
                    continue
                self._heartbeats_sent += 1
        finally:
            admin.close()


def _running_ray() -> Any:
    """The ``ray`` module when this process is connected to Ray, else ``None``."""
    try:
        import ray
    except ImportError:
        return None
    return ray if ray.is_initialized() else None


SHARED_DRAM_ENV = "POCKETFLOW_SHARED_DRAM"
"""Set to ``0`` to keep a local cluster's DRAM arenas private (no zero-copy reads)."""


def shares_dram(tier: str, host: str, *, tls: bool) -> bool:
    """Whether a server of ``tier`` on ``host`` shares its DRAM arena with the processes of this
    host and uid: a DRAM server of a single-user local cluster (loopback, no TLS), unless
    ``$POCKETFLOW_SHARED_DRAM`` is ``0``. Any process of the uid can then read every job's
    bytes in the arena, so a cluster with TLS (many users' nodes) never shares it."""
    if tier != TIER_DRAM or tls or os.environ.get(SHARED_DRAM_ENV, "1") == "0":
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def node_address() -> str:
    """The address of the Ray node this process runs on (``127.0.0.1`` outside Ray)."""
    ray = _running_ray()
    return "127.0.0.1" if ray is None else str(ray.util.get_node_ip_address())


def _ray_node_id() -> str:
    """The id of the Ray node this process runs on, or ``""`` outside Ray."""
    ray = _running_ray()
    return "" if ray is None else str(ray.get_runtime_context().get_node_id())
