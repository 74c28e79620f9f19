"""Cluster sizing: runs the sizing policy (control/sizing.py) on the latest heartbeats and carries
out its action (more or fewer cores, a new server, a drain)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from pocketflow.control.admin import AdminTokens
from pocketflow.control.allocator import Allocator
from pocketflow.control.cluster_metrics import ClusterMetrics
from pocketflow.control.membership import Membership
from pocketflow.control.sizing import (
    AddServer,
    AddThreads,
    RemoveServers,
    RemoveThreads,
    ServerUtilization,
    SizingBounds,
    decide,
)
from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.errors import ClusterError, PocketflowError

log = logging.getLogger(__name__)

SIZING_INTERVAL_MS_DEFAULT = 5000
"""How often the sizing loop (when enabled) looks at the heartbeats and acts."""

SIZING_ACTIONS_KEPT_MAX = 64
"""Most sizing actions remembered for ``status``."""


class Scaler:
    """The sizing loop's state (when it last acted, what it did) and one step of it.

    :meth:`size` is called under the controller's lock; ``refresh_stats(info)`` reads a
    server's stats after a change.
    """

    def __init__(
        self,
        bounds: SizingBounds,
        membership: Membership,
        allocator: Allocator,
        *,
        admin: AdminTokens,
        metrics: ClusterMetrics,
        interval_ms: int = SIZING_INTERVAL_MS_DEFAULT,
        refresh_stats: Callable[[StorageNodeInfo], None],
        record: Callable[[dict[str, Any]], Any] | None = None,
    ) -> None:
        self.bounds = bounds
        self._membership = membership
        self._allocator = allocator
        self._admin = admin
        self._metrics = metrics
        self._refresh_stats = refresh_stats
        self._interval_s = interval_ms / 1000.0
        self._last_action_s: float | None = None
        self._next_s = time.monotonic() + self._interval_s
        self._actions: list[dict[str, Any]] = []
        self._record = record

    def due(self) -> bool:
        """Whether the monitor loop should size the cluster now (and when next)."""
        if time.monotonic() < self._next_s:
            return False
        self._next_s = time.monotonic() + self._interval_s
        return True

    def size(
        self,
        *,
        launch_server: Callable[..., StorageNodeInfo],
        drain_server: Callable[[str], Any],
    ) -> dict[str, Any]:
        """Run the policy once and carry out its action; ``{"action", "reason", ...}``.

        Vertical scaling (up and down) is the servers' ``set_cores`` action; a new server is
        launched only when the cluster may launch servers.
        """
        launcher = self._allocator.launcher
        action = decide(
            self.utilizations(),
            self.bounds,
            now_s=time.monotonic(),
            last_action_s=self._last_action_s,
            # A registration's launch waits without the controller's lock: while it does,
            # nothing is removed and its tier gets no second server.
            pending=launcher.starting_counts() if launcher is not None else {},
        )
        done: dict[str, Any] = {"action": type(action).__name__, "reason": action.reason}
        if isinstance(action, (AddThreads, RemoveThreads)):
            done["node_id"] = action.node_id
            done["cores"] = action.threads
            info = self._membership.get(action.node_id)
            try:
                if info is None:
                    raise ClusterError(f"{action.node_id} is gone")
                self._admin.client(info.address).set_cores(action.threads)
            except PocketflowError as exc:
                log.warning("sizing: set_cores on %s failed: %s", action.node_id, exc)
                done["skipped"] = True
            else:
                self._refresh_stats(info)
            self._last_action_s = time.monotonic()
        elif isinstance(action, AddServer):
            if launcher is None or not launcher.can_launch(action.tier):
                done["skipped"] = True
            else:
                info = launch_server(action.tier, long_running=action.long_running)
                done["node_id"] = info.node_id
                self._last_action_s = time.monotonic()
        elif isinstance(action, RemoveServers):
            done["node_ids"] = list(action.node_ids)
            drained = []
            for node_id in action.node_ids:
                try:
                    drain_server(node_id)
                except ClusterError as exc:  # gone meanwhile, or one of the last long-running
                    log.warning("sizing: drain of %s refused: %s", node_id, exc)
                    continue
                drained.append(node_id)
            done["drained"] = drained
            if not drained:
                done["skipped"] = True
            self._last_action_s = time.monotonic()
        if done["action"] != "NoAction":
            log.info("sizing: %s", done)
            entry = {**done, "at_unix_s": time.time()}
            self._actions.append(entry)
            del self._actions[:-SIZING_ACTIONS_KEPT_MAX]
            self._metrics.count("sizing_actions", done["action"])
            if self._record is not None:
                # Logged, so that a restarted controller keeps its history and its cool-down.
                try:
                    self._record(entry)
                except PocketflowError as exc:
                    log.warning("sizing action not logged: %s", exc)
        return done

    def restore(self, actions: list[dict[str, Any]]) -> None:
        """Take back the history a crashed instance logged: the actions for ``status``, and the
        time of the last one, so that the cool-down goes on where it was."""
        self._actions = [dict(a) for a in actions][-SIZING_ACTIONS_KEPT_MAX:]
        if self._actions:
            ago_s = max(time.time() - float(self._actions[-1].get("at_unix_s", 0.0)), 0.0)
            self._last_action_s = time.monotonic() - ago_s

    def actions(self) -> list[dict[str, Any]]:
        """The latest sizing actions, oldest first."""
        return list(self._actions)

    def utilizations(self) -> list[ServerUtilization]:
        """Each live server's latest heartbeat as the sizing policy's sample.

        The policy's "threads" of a server are the CPU cores it runs on (``set_cores``), and its
        CPU fraction is its CPU use over those cores.
        """
        rows = []
        # The packing's view of each server already holds the throughput it measured (or its
        # tier's nominal one), its measured use and what registered jobs reserve on it.
        for load in self._allocator.server_loads():
            stats = self._membership.latest_stats(load.node_id) or {}
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
                    used_bytes=int(stats.get("used_bytes", 0)),
                    # A server launched for a job that has not written yet must not look idle;
                    # but a reservation alone grows no tier (sizing.py, rule 5).
                    reserved_bytes=load.allocated_capacity_bytes,
                    capacity_bytes=load.capacity_bytes,
                    threads=cores,
                    threads_max=max(int(stats.get("cores_max", cores)), cores),
                    long_running=load.long_running,
                    draining=self._membership.is_draining(load.node_id),
                )
            )
        return rows
