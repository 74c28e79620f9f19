"""A Ray cluster on this machine run by Ray's real autoscaler, for the elasticity tests and the
trace benchmark.

Ray's autoscaler (v1, ``StandardAutoscaler`` in the head's monitor process) with its fake
multi-node provider: each worker node it launches is a raylet on this machine. Ray ships this
test bed as ``ray.cluster_utils.AutoscalingCluster``, which cannot be used as is here: its config
generator reads an ``example.yaml`` that the Ray 2.60 wheel does not include, and its ``start()``
and ``shutdown()`` run ``ray stop --force``, which ends every Ray process on the machine (other
test sessions' clusters included). So this module writes the provider's config itself, starts
the head in this process (``ray.cluster_utils.Cluster`` with ``autoscaling_config``) on ports of
its own (the provider's nodes join the head's GCS port, given in the config) and in a temporary
directory of its own, with token authentication set explicitly (a token of its own, in that
directory), and stops only the processes it started, by process id: the worker nodes' processes
(children of the monitor) first, then the head's.

::

    with AutoscalingRay(head_resources={"pocketflow_storage_dram": 2},
                        node_types=[NodeType("storage", {"pocketflow_storage_dram": 1})]) as ray_:
        ray_.connect()
        ...  # pocketflow.LocalCluster(storage_resources=True, autoscale=True) joins it
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import pocketflow
from pocketflow.control.loopback import keep_ray_on_loopback
from pocketflow.processes import ProcessRef, descendants, terminate

log = logging.getLogger(__name__)

OBJECT_STORE_BYTES = 80 * 1024 * 1024
"""Object store of each node: small, as on the 2-core machines the tests run on."""

IDLE_TIMEOUT_S_DEFAULT = 3.0
"""How long a worker node may stay idle before the autoscaler removes it."""

AUTOSCALER_UPDATE_INTERVAL_S = 1
"""How often the autoscaler looks at the cluster (Ray's default is 5 s)."""

AUTOSCALER_HEARTBEAT_TIMEOUT_S = 10
"""After how long without a report the autoscaler takes a worker node for unhealthy and
terminates it (Ray's default is 30 s)."""

NODE_HEALTH_CHECK_PERIOD_MS = 1000
"""How often the GCS checks that each node's raylet is alive (Ray's default is 3 s); with
``NODE_HEALTH_CHECK_FAILURES`` missed checks, a killed node is found dead in a few seconds."""

NODE_HEALTH_CHECK_FAILURES = 3
"""Missed health checks after which the GCS declares a node dead (Ray's default is 5)."""

START_ATTEMPTS_MAX = 3
"""Most attempts at starting the head: Ray gives a head 30 s to register its raylet (not
configurable), which a loaded 2-core machine sometimes misses."""

STOP_TIMEOUT_S = 10.0
"""How long each stop step waits before SIGKILL."""

NODE_PROCESSES_MAX = 256
"""Most processes one worker node is expected to run (a bound on what a kill walks)."""

_FAKE_PROVIDER = "fake_multinode"
_HEAD_NODE_TYPE = "ray.head.default"


@dataclass(frozen=True)
class NodeType:
    """A worker node type of the autoscaler: its resources (``CPU`` default 1) and limits."""

    name: str
    resources: Mapping[str, float]
    min_workers: int = 0
    max_workers: int = 2
    object_store_bytes: int = OBJECT_STORE_BYTES

    def config(self) -> dict[str, Any]:
        resources = {"CPU": 1, **dict(self.resources)}
        resources["object_store_memory"] = self.object_store_bytes
        return {
            "resources": resources,
            "node_config": {},
            "min_workers": self.min_workers,
            "max_workers": self.max_workers,
        }


@dataclass
class AutoscalingRay:
    """A Ray head with Ray's autoscaler and its fake multi-node provider (module doc)."""

    head_resources: Mapping[str, float]
    node_types: Sequence[NodeType]
    head_cpus: int = 1
    idle_timeout_s: float = IDLE_TIMEOUT_S_DEFAULT
    upscaling_speed: float = 10.0
    work_dir: Path | None = None
    _cluster: Any = field(default=None, init=False, repr=False)
    _own_dir: bool = field(default=False, init=False, repr=False)
    _saved_env: dict[str, str | None] = field(default_factory=dict, init=False, repr=False)
    _connected: bool = field(default=False, init=False, repr=False)

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> AutoscalingRay:
        """Write the autoscaler config and start the head with the monitor (the autoscaler)."""
        from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID
        from ray.cluster_utils import Cluster

        if self.work_dir is None:
            # Short: Ray's Unix socket paths live under it.
            self.work_dir = Path(tempfile.mkdtemp(prefix="pfas-", dir="/tmp"))
            self._own_dir = True
        gcs_port = _free_port()
        config_path = self.work_dir / "autoscaling.json"
        config_path.write_text(json.dumps(self._config(gcs_port)))
        token_path = self.work_dir / "auth_token"
        token_path.write_text(secrets.token_hex(32))
        token_path.chmod(0o600)
        keep_ray_on_loopback()
        self._set_env({
            # Token authentication, explicitly, with a token of this cluster's own.
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token_path),
            "RAY_AUTH_TOKEN": None,
            "RAY_FAKE_CLUSTER": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "AUTOSCALER_UPDATE_INTERVAL_S": str(AUTOSCALER_UPDATE_INTERVAL_S),
            "AUTOSCALER_HEARTBEAT_TIMEOUT_S": str(AUTOSCALER_HEARTBEAT_TIMEOUT_S),
            # Ray's workers import the pocketflow this process imports (a source checkout
            # need not be installed).
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(Path(pocketflow.__file__).resolve().parents[1]),
                            os.environ.get("PYTHONPATH")) if p
            ),
        })
        # The provider's head entry has this id; the head's raylet must report it.
        saved_id = os.environ.get("RAY_OVERRIDE_NODE_ID_FOR_TESTING")
        os.environ["RAY_OVERRIDE_NODE_ID_FOR_TESTING"] = FAKE_HEAD_NODE_ID
        try:
            for attempt in range(1, START_ATTEMPTS_MAX + 1):
                session_dir = self.work_dir / f"ray-{attempt}"
                try:
                    self._cluster = Cluster(
                        initialize_head=True,
                        head_node_args={
                            "num_cpus": self.head_cpus,
                            "resources": dict(self.head_resources),
                            "object_store_memory": OBJECT_STORE_BYTES,
                            "gcs_server_port": gcs_port,
                            "temp_dir": str(session_dir),
                            "autoscaling_config": str(config_path),
                            "include_dashboard": False,
                            # Ray starts its API server even without the dashboard and checks
                            # that its port is free: Ray's default (8265) is often held by
                            # another Ray on this machine, and that failed the head's start.
                            "dashboard_port": _free_port(),
                            "dashboard_agent_listen_port": 0,
                            "_system_config": {
                                "health_check_period_ms": NODE_HEALTH_CHECK_PERIOD_MS,
                                "health_check_failure_threshold": NODE_HEALTH_CHECK_FAILURES,
                            },
                        },
                        shutdown_at_exit=False,
                    )
                    break
                except Exception as exc:
                    # What this attempt started runs with its session directory in its
                    # command line: ended by pid, and the head started again.
                    left = terminate(_processes_mentioning(session_dir), timeout_s=STOP_TIMEOUT_S)
                    if left:
                        log.error("head processes survived SIGKILL: %s", [r.pid for r in left])
                    if attempt == START_ATTEMPTS_MAX:
                        raise
                    log.warning("the Ray head did not start (%s); starting it again", exc)
                    gcs_port = _free_port()
                    config_path.write_text(json.dumps(self._config(gcs_port)))
        except BaseException:
            self.stop()
            raise
        finally:
            if saved_id is None:
                os.environ.pop("RAY_OVERRIDE_NODE_ID_FOR_TESTING", None)
            else:
                os.environ["RAY_OVERRIDE_NODE_ID_FOR_TESTING"] = saved_id
        return self

    @property
    def session_dir(self) -> Path | None:
        """The running head's Ray session directory (its logs are under ``logs/``)."""
        if self._cluster is None:
            return None
        return Path(self._cluster.head_node.get_session_dir_path())

    def connect(self, namespace: str | None = None) -> None:
        """Connect this process to the cluster (``ray.init``)."""
        import ray

        from pocketflow.control import NAMESPACE

        ray.init(
            address=self.address, namespace=namespace or NAMESPACE, log_to_driver=False,
            logging_level=logging.WARNING,
        )
        self._connected = True

    def stop(self) -> None:
        """Stop every process this cluster started, by pid: the worker nodes' first (the
        monitor launched them), then the head's; then remove the work directory."""
        import ray

        if self._connected and ray.is_initialized():
            ray.shutdown()
        self._connected = False
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            head = cluster.head_node
            monitor = _monitor_process(head)
            if monitor is not None:
                workers = [r for r in (ProcessRef.of(p) for p in descendants(monitor.pid)) if r]
                left = terminate(workers, timeout_s=STOP_TIMEOUT_S)
                if left:
                    log.error("worker node processes survived SIGKILL: %s", [r.pid for r in left])
            tree = _head_processes(head)
            try:
                cluster.shutdown()
            except Exception as exc:  # noqa: BLE001 - ended by pid below
                log.warning("head shutdown: %s", exc)
            left = terminate([r for r in tree if r.alive()], timeout_s=STOP_TIMEOUT_S)
            if left:
                log.error("head processes survived SIGKILL: %s", [r.pid for r in left])
        self._restore_env()
        if self._own_dir and self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> AutoscalingRay:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- what runs ------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The head's GCS address (``ray.init(address=...)``)."""
        if self._cluster is None:
            raise RuntimeError("the cluster is not running")
        return str(self._cluster.address)

    def worker_nodes(self) -> list[str]:
        """Hex ids of the live worker nodes (the head excluded), sorted."""
        import ray
        from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

        return sorted(
            n["NodeID"] for n in ray.nodes()
            if n["Alive"] and n["NodeID"] != FAKE_HEAD_NODE_ID
        )

    def resource_request(self) -> list[dict[str, float]]:
        """The bundles of the standing ``request_resources`` request the autoscaler reads (empty
        when there is none)."""
        from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
        if not raw:
            return []
        return [dict(b) for b in json.loads(raw) if b]

    def node_processes(self, node_id: str) -> list[ProcessRef]:
        """The processes of worker node ``node_id``: its raylet and everything under it (the
        actors and task workers it runs, and what they started, such as storage servers)."""
        cluster = self._cluster
        monitor = _monitor_process(cluster.head_node) if cluster is not None else None
        if monitor is None:
            return []
        raylets = [
            pid for pid in descendants(monitor.pid)
            if _process_name(pid) == "raylet" and _node_id_of_raylet(pid) == node_id
        ]
        found: list[ProcessRef] = []
        for raylet in raylets:
            for pid in [raylet, *sorted(descendants(raylet))][:NODE_PROCESSES_MAX]:
                ref = ProcessRef.of(pid)
                if ref is not None:
                    found.append(ref)
        return found

    def kill_node(self, node_id: str) -> list[int]:
        """SIGKILL worker node ``node_id``: its raylet and everything on it at once, as a machine
        that loses power; returns the pids killed. The autoscaler sees the node die."""
        refs = self.node_processes(node_id)
        for ref in refs:
            ref.signal(signal.SIGSTOP)  # nothing on it reacts to the others' deaths first
        for ref in refs:
            ref.signal(signal.SIGKILL)
        return [r.pid for r in refs]

    # -- internals ----------------------------------------------------------------------------

    def _config(self, gcs_port: int) -> dict[str, Any]:
        types = {t.name: t.config() for t in self.node_types}
        types[_HEAD_NODE_TYPE] = {
            "resources": {"CPU": self.head_cpus, **dict(self.head_resources)},
            "node_config": {},
            "max_workers": 0,
        }
        return {
            "cluster_name": f"pocketflow-{gcs_port}",
            "max_workers": sum(t.max_workers for t in self.node_types),
            "upscaling_speed": self.upscaling_speed,
            "idle_timeout_minutes": self.idle_timeout_s / 60.0,
            "provider": {
                "type": _FAKE_PROVIDER,
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
                # The provider's nodes join this head, not the default port 6379.
                "gcs_address": f"127.0.0.1:{gcs_port}",
            },
            "available_node_types": types,
            "head_node_type": _HEAD_NODE_TYPE,
            "auth": {},
            "docker": {},
            "initialization_commands": [],
            "setup_commands": [],
            "head_setup_commands": [],
            "worker_setup_commands": [],
            "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
            "file_mounts": {},
            "cluster_synced_files": [],
            "file_mounts_sync_continuously": False,
            "rsync_exclude": [],
            "rsync_filter": [],
        }

    def _set_env(self, values: Mapping[str, str | None]) -> None:
        for key, value in values.items():
            self._saved_env.setdefault(key, os.environ.get(key))
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _refresh_ray_config()

    def _restore_env(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env.clear()


def _refresh_ray_config() -> None:
    """Make this process's Ray see the authentication settings just set in the environment."""
    try:
        from ray._raylet import Config

        Config.initialize("")
    except Exception as exc:  # noqa: BLE001 - an older Ray without the cached config
        log.debug("Ray config not refreshed: %s", exc)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _monitor_process(head: Any) -> ProcessRef | None:
    """The head's monitor process (the autoscaler, parent of the worker nodes' processes)."""
    from ray._private import ray_constants

    infos = getattr(head, "all_processes", {}).get(ray_constants.PROCESS_TYPE_MONITOR, [])
    for info in infos:
        ref = ProcessRef.of(info.process.pid)
        if ref is not None:
            return ref
    return None


def _head_processes(head: Any) -> list[ProcessRef]:
    """The head's processes (GCS, raylet, monitor, agents, ...) and everything under them."""
    pids: set[int] = set()
    for infos in getattr(head, "all_processes", {}).values():
        for info in infos:
            pid = info.process.pid
            pids.add(pid)
            pids |= descendants(pid)
    return [r for r in (ProcessRef.of(p) for p in sorted(pids)) if r]


def _processes_mentioning(path: Path) -> list[ProcessRef]:
    """Descendants of this process whose command line names ``path``."""
    needle = str(path).encode()
    found = []
    for pid in sorted(descendants()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            ref = ProcessRef.of(pid)
            if ref is not None:
                found.append(ref)
    return found


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _node_id_of_raylet(pid: int) -> str:
    """The node id a fake worker node's raylet runs as (from its environment)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    for entry in environ:
        if entry.startswith(b"RAY_OVERRIDE_NODE_ID_FOR_TESTING="):
            return entry.split(b"=", 1)[1].decode()
    return ""


def wait_until(predicate: Any, *, timeout_s: float, interval_s: float = 0.2) -> bool:
    """Check ``predicate`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
