"""The driver's view of the control plane: find the ``Controller`` actor and call it."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Protocol

from pocketflow.control import CONTROLLER_ACTOR_NAME, NAMESPACE
from pocketflow.control.loopback import keep_ray_on_loopback
from pocketflow.errors import ClusterError, PocketflowError
from pocketflow.handle import JobHandle
from pocketflow.hints import Hints

CALL_TIMEOUT_S = 60.0
"""Deadline of one call to the controller (those that may launch servers: see
``LAUNCH_CALL_MARGIN_S``)."""

LAUNCH_CALL_MARGIN_S = 30.0
"""A call that may launch servers (a registration, a growth, a cache's opening or resizing) waits
for them up to the cluster's registration timeout; its deadline is that timeout plus this
margin for the controller's own work around the launch (packing, logging, telling the servers),
and at least ``CALL_TIMEOUT_S``."""

PROBE_TIMEOUT_S = 3.0
"""How long to wait for a TCP connection to an explicit Ray address before giving up."""

RAY_ADDRESS_ENV = "RAY_ADDRESS"
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
RAY_AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
RAY_AUTH_TOKEN_PATH_DEFAULT = "~/.ray/auth_token"

STARTED_CLUSTERS_MAX = 64
"""Most running clusters this process remembers having started (each forgets itself on stop)."""


class HasControlPlane(Protocol):
    """A cluster as jobs see it: something with a control plane (``LocalCluster`` is one)."""

    @property
    def control(self) -> ControlPlane: ...


_started_lock = threading.Lock()
_started: list[HasControlPlane] = []


def remember_started(cluster: HasControlPlane) -> None:
    """Note a cluster this process started and that now runs (the latest is the default one
    of :func:`pocketflow.register_job`); the oldest are forgotten past
    ``STARTED_CLUSTERS_MAX``."""
    with _started_lock:
        _started.append(cluster)
        del _started[:-STARTED_CLUSTERS_MAX]


def forget_started(cluster: HasControlPlane) -> None:
    """Forget a cluster that stops."""
    with _started_lock:
        if cluster in _started:
            _started.remove(cluster)


def last_started() -> Any:
    """The most recently started cluster of this process that still runs, else ``None``."""
    with _started_lock:
        return _started[-1] if _started else None


class ControlPlane:
    """Calls the ``Controller`` actor and turns Ray's errors into pocketflow errors.

    A pocketflow error raised inside the actor (``JobNotRegistered``, ``CapacityExhausted``, ...)
    is re-raised here as itself; a dead or unreachable controller is a ``ClusterError``.
    """

    def __init__(self, controller: Any, *, register_timeout_s: float | None = None) -> None:
        self._controller = controller
        # The cluster's registration timeout (asked of the controller on first use if not
        # given): what bounds the calls that may launch servers.
        self._register_timeout_s = register_timeout_s

    def launch_call_timeout_s(self) -> float:
        """Deadline of a call that may launch servers: the cluster's registration timeout plus
        ``LAUNCH_CALL_MARGIN_S``, at least ``CALL_TIMEOUT_S`` (a registration waiting for a node
        from the autoscaler must not be given up by its driver before the controller does)."""
        if self._register_timeout_s is None:
            self._register_timeout_s = float(self._call("register_timeout_s"))
        return max(CALL_TIMEOUT_S, self._register_timeout_s + LAUNCH_CALL_MARGIN_S)

    def register(
        self, name: str, hints: Any, *, request_id: str | None = None, lease_ms: int | None = None
    ) -> JobHandle:
        """Register a job; returns its handle.

        ``hints`` is a :class:`pocketflow.Hints` or a mapping of its fields (sizes as numbers
        or strings such as ``"8MiB"``), checked here as :func:`pocketflow.register_job` does.
        ``request_id`` names this registration: a retry with the same id (after a
        ``ClusterError``) gets the job the first attempt registered, if it did. With ``lease_ms``
        the job's lease starts now (see ``Controller.register_job``).
        """
        return self._call(
            "register_job", name, Hints.coerce(hints).to_dict(), request_id, lease_ms,
            timeout_s=self.launch_call_timeout_s(),
        )

    def grow_job(self, job_id: str, hints: Any) -> JobHandle:
        """Give a running job more room (new hints): a new epoch with added servers.

        ``hints`` is a :class:`pocketflow.Hints` or a mapping of its fields.
        """
        return self._call("grow_job", job_id, Hints.coerce(hints).to_dict(),
                          timeout_s=self.launch_call_timeout_s())

    def open_cache(self, name: str, hints: Any, idle_ms: int, run_id: str | None = None,
                   run_lease_ms: int | None = None) -> dict[str, Any]:
        """Find or register the job of cache ``name``, (re)starting its lease at ``idle_ms`` or
        starting run ``run_id``'s lease: ``{"handle", "created", "predecessor",
        "capacity_bytes"}`` (``Controller.open_cache``)."""
        return self._call("open_cache", name, Hints.coerce(hints).to_dict(), idle_ms, run_id,
                          run_lease_ms, timeout_s=self.launch_call_timeout_s())

    def renew_cache_run(self, job_id: str, run_id: str, run_lease_ms: int, idle_ms: int) -> None:
        """Renew a cache run's lease (``Controller.renew_cache_run``)."""
        self._call("renew_cache_run", job_id, run_id, run_lease_ms, idle_ms)

    def end_cache_run(self, job_id: str, run_id: str, idle_ms: int) -> bool:
        """A cache run ended (``Controller.end_cache_run``); whether other runs keep it."""
        return bool(self._call("end_cache_run", job_id, run_id, idle_ms))

    def resize_cache(self, job_id: str, hints: Any) -> JobHandle:
        """Grow or shrink a cache's reservation (``Controller.resize_cache``)."""
        return self._call("resize_cache", job_id, Hints.coerce(hints).to_dict(),
                          timeout_s=self.launch_call_timeout_s())

    def drain_node(self, ray_node_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """Drain every storage server of a Ray node before removing the node (bounded wait)."""
        return self._call("drain_node", ray_node_id, min(timeout_s, CALL_TIMEOUT_S / 2))

    def drain_server(self, node_id: str) -> dict[str, Any]:
        """Remove a storage server without losing live data (see ``Controller.drain_server``)."""
        return self._call("drain_server", node_id)

    def deregister(self, job_id: str) -> dict[str, Any]:
        """Deregister a job, freeing its non-PERSIST data; returns what was freed."""
        return self._call("deregister_job", job_id)

    def renew_lease(self, job_id: str, lease_ms: int) -> float:
        """Start or extend a job's lease (see ``Controller.renew_lease``)."""
        return self._call("renew_lease", job_id, lease_ms)

    def declare_prefixes(
        self, job_id: str, requests: list[tuple[str, int]], lease_ms: int, wait_s: float
    ) -> dict[str, Any]:
        """Grant declared prefixes DRAM or spill them (``Controller.declare_prefixes``)."""
        return self._call("declare_prefixes", job_id, list(requests), lease_ms, wait_s)

    def renew_prefixes(self, job_id: str, prefixes: list[str]) -> int:
        """Extend the grants of a job's prefixes (``Controller.renew_prefixes``)."""
        return self._call("renew_prefixes", job_id, list(prefixes))

    def end_prefixes(self, job_id: str, prefixes: list[str]) -> int:
        """Take a job's grants of ended prefixes back now (``Controller.end_prefixes``)."""
        return self._call("end_prefixes", job_id, list(prefixes))

    def renew_token(self, job_id: str) -> JobHandle:
        """A new token for a registered job, in its current handle (``Controller.renew_token``)."""
        return self._call("renew_token", job_id)

    def job_handle(self, job_id: str) -> JobHandle:
        """The handle of a registered job."""
        return self._call("job_handle", job_id)

    def persist_list(self) -> dict[str, Any]:
        """PERSIST data left by jobs that are no longer registered (``Controller.persist_list``)."""
        return self._call("persist_list")

    def persist_delete(self, job_ids: list[str]) -> dict[str, Any]:
        """Delete what the named ended jobs left, PERSIST data included
        (``Controller.persist_delete``)."""
        return self._call("persist_delete", list(job_ids))

    def status(self) -> dict[str, Any]:
        """Servers, tiers and jobs, as reported by ``Controller.status``."""
        return self._call("status")

    def _call(self, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

        try:
            return ray.get(getattr(self._controller, method).remote(*args), timeout=timeout_s)
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, PocketflowError):
                raise cause from None
            raise ClusterError(f"controller.{method} failed: {exc}") from exc
        except RayActorError as exc:
            raise ClusterError(f"the pocketflow controller is gone: {exc}") from exc
        except GetTimeoutError as exc:
            raise ClusterError(
                f"controller.{method} did not answer within {timeout_s:.0f}s"
            ) from exc
        except RayError as exc:
            raise ClusterError(f"controller.{method} failed: {exc}") from exc


def connect_control_plane(address: str | None = None) -> ControlPlane:
    """Find the ``Controller`` of a running pocketflow cluster.

    ``address`` is a Ray address (``"auto"``, ``"host:port"``); default ``$RAY_ADDRESS`` or
    ``"auto"``. Joins that Ray cluster as a driver if this process is not connected to Ray yet.
    """
    imported = sys.modules.get("ray")
    if imported is None or not imported.is_initialized():
        target = address or os.environ.get(RAY_ADDRESS_ENV) or "auto"
        if target == "auto" or _is_loopback(target):
            # Local clusters listen on 127.0.0.1 only; Ray would otherwise rewrite a loopback
            # address to the machine's network address before connecting.
            keep_ray_on_loopback()
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Before importing Ray: it reads its authentication mode when imported.
        _use_ray_token_if_available(ray_imported=imported is not None)
        _probe(target)
    import ray

    if not ray.is_initialized():
        try:
            ray.init(
                address=target,
                namespace=NAMESPACE,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ClusterError(
                f"no Ray cluster at {target!r}: {exc}; start one with `pocketflow up --local` "
                "or use pocketflow.LocalCluster()"
            ) from exc
    try:
        controller = ray.get_actor(CONTROLLER_ACTOR_NAME, namespace=NAMESPACE)
    except ValueError as exc:
        raise ClusterError(
            "no pocketflow controller in this Ray cluster; start one with "
            "`pocketflow up --local` or use pocketflow.LocalCluster()"
        ) from exc
    return ControlPlane(controller)


def _use_ray_token_if_available(*, ray_imported: bool) -> None:
    """Turn on Ray's token authentication when this machine has a Ray token.

    A local cluster started by ``ray.init`` requires the token, but Ray only looks for it itself
    when it finds the cluster on its own; an explicit address (``pocketflow status --address``)
    needs this. Ray reads the mode when it is imported, so an already imported Ray is told to
    read its configuration again.
    """
    if RAY_AUTH_MODE_ENV in os.environ:
        return
    token_path = Path(
        os.environ.get(RAY_AUTH_TOKEN_PATH_ENV) or RAY_AUTH_TOKEN_PATH_DEFAULT
    ).expanduser()
    if not (os.environ.get(RAY_AUTH_TOKEN_ENV) or token_path.is_file()):
        return
    os.environ[RAY_AUTH_MODE_ENV] = "token"
    if ray_imported:
        try:
            from ray._raylet import Config  # Ray's own way to re-read its configuration

            Config.initialize("")
        except (ImportError, AttributeError) as exc:
            logging.getLogger(__name__).warning("could not refresh Ray's configuration: %s", exc)


def _probe(address: str) -> None:
    """Fail fast on an explicit ``host:port`` nobody listens on (``ray.init`` retries for long)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ClusterError(
            f"no Ray cluster at {address!r} ({exc}); start one with `pocketflow up --local`"
        ) from exc


def _is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0] if ":" in address else address
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")
