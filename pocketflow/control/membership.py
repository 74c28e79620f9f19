"""Membership: the live storage servers, their latest heartbeats, and who is dead, suspect or
draining (the controller's node table)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.errors import ClusterError

log = logging.getLogger(__name__)

DEAD_SERVERS_KEPT_MAX = 256
"""Most dead servers remembered for ``status``; the oldest are forgotten past it."""


class Membership:
    """The servers the controller knows, with each one's ``StorageNode`` handle and heartbeats.

    Heartbeats and suspect marks have a lock of their own (``heartbeat_lock``), so a heartbeat
    never waits behind the controller's lock (a registration that launches servers holds it for
    seconds); the controller takes its own lock first when it holds both. The server table
    itself is changed only under the controller's lock; readers copy it without a lock (a copy
    of a dict is atomic).
    """

    def __init__(self) -> None:
        self.heartbeat_lock = threading.Lock()
        self._servers: dict[str, StorageNodeInfo] = {}
        self._nodes: dict[str, Any] = {}
        self._last_heartbeat: dict[str, float] = {}
        self._stats: dict[str, dict[str, Any]] = {}
        self._dead: dict[str, dict[str, Any]] = {}
        # Silent servers whose process still runs: ``node_id -> monotonic time last probed``.
        # Not dead (never stopped, data kept) and given no new jobs until they answer again.
        self._suspects: dict[str, float] = {}
        self.draining: set[str] = set()

    # -- the server table -------------------------------------------------------------------

    def add(self, info: StorageNodeInfo, node: Any) -> None:
        """Take a started server in; adding counts as its first heartbeat. ``ClusterError`` if
        it is known already."""
        if info.node_id in self._servers:
            raise ClusterError(f"storage server {info.node_id} is already known")
        self._servers[info.node_id] = info
        self._nodes[info.node_id] = node
        self._dead.pop(info.node_id, None)
        with self.heartbeat_lock:
            self._last_heartbeat[info.node_id] = time.monotonic()

    def forget(self, node_id: str) -> tuple[StorageNodeInfo, Any] | None:
        """Drop a server (dead or retired) with its heartbeats; returns its info and node, or
        ``None`` if it is not known."""
        info = self._servers.pop(node_id, None)
        if info is None:
            return None
        node = self._nodes.pop(node_id, None)
        with self.heartbeat_lock:
            self._last_heartbeat.pop(node_id, None)
            self._stats.pop(node_id, None)
            self._suspects.pop(node_id, None)
        return info, node

    def get(self, node_id: str) -> StorageNodeInfo | None:
        """A live server's info, ``None`` if it is not live."""
        return self._servers.get(node_id)

    def node(self, node_id: str) -> Any:
        """A live server's ``StorageNode`` handle (``None`` if it has none or is not live)."""
        return self._nodes.get(node_id)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._servers

    def __len__(self) -> int:
        return len(self._servers)

    def ids(self) -> set[str]:
        """Node ids of the live servers."""
        return set(self._servers)

    def count_by_tier(self) -> dict[str, int]:
        """How many live servers (draining and suspect ones included) each tier has."""
        counts: dict[str, int] = {}
        for info in list(self._servers.values()):
            counts[info.tier] = counts.get(info.tier, 0) + 1
        return counts

    def servers(self) -> list[StorageNodeInfo]:
        """Every live server, ordered by node id (a copy, taken without a lock)."""
        return sorted(list(self._servers.values()), key=lambda info: info.node_id)

    # -- heartbeats ---------------------------------------------------------------------------

    def heartbeat(self, node_id: str, stats: dict[str, Any]) -> None:
        """Take a heartbeat (the server's ``stats``). Heartbeats of unknown or dead servers are
        ignored: a dead server stays dead. A suspect that beats is no longer suspect."""
        with self.heartbeat_lock:
            if node_id not in self._last_heartbeat:
                return
            self._last_heartbeat[node_id] = time.monotonic()
            self._keep_newer_stats(node_id, stats)
            if self._suspects.pop(node_id, None) is not None:
                log.warning("storage server %s answers again; no longer suspect", node_id)

    def take_stats(self, node_id: str, stats: dict[str, Any]) -> None:
        """Keep a ``stats`` sample read directly (not a heartbeat) of a known server."""
        with self.heartbeat_lock:
            if node_id in self._last_heartbeat:
                self._keep_newer_stats(node_id, stats)

    def _keep_newer_stats(self, node_id: str, stats: dict[str, Any]) -> None:
        """Keep ``stats`` unless a sample taken later is already kept. Callers hold the lock.

        A heartbeat sampled before a direct read may arrive after it; it must not bring back
        usage that a deregistration has freed.
        """
        kept = self._stats.get(node_id)
        sampled = float(stats.get("sampled_at_unix_s", 0.0))
        if kept is None or sampled >= float(kept.get("sampled_at_unix_s", 0.0)):
            self._stats[node_id] = dict(stats)

    def latest_stats(self, node_id: str) -> dict[str, Any] | None:
        """The statistics of the server's latest heartbeat, ``None`` before the first one."""
        with self.heartbeat_lock:
            return self._stats.get(node_id)

    def heartbeat_age_s(self, node_id: str, now_s: float) -> float:
        """Seconds since the server's last heartbeat (0 for an unknown one)."""
        with self.heartbeat_lock:
            return now_s - self._last_heartbeat.get(node_id, now_s)

    def silent(self, *, dead_after_s: float) -> dict[str, float]:
        """``node_id -> seconds since its last heartbeat`` for servers silent too long."""
        now = time.monotonic()
        with self.heartbeat_lock:
            return {
                node_id: now - seen
                for node_id, seen in self._last_heartbeat.items()
                if now - seen > dead_after_s
            }

    # -- suspects -------------------------------------------------------------------------------

    def suspect_probed_at(self, node_id: str) -> float | None:
        """When a suspect server was last probed (monotonic), ``None`` if it is not suspect."""
        with self.heartbeat_lock:
            return self._suspects.get(node_id)

    def mark_suspect(self, node_id: str) -> None:
        """A silent server whose process runs: suspect from now (its next heartbeat clears it)."""
        with self.heartbeat_lock:
            if node_id not in self._suspects:
                log.warning("storage server %s is silent but its process runs; "
                            "suspect, not dead", node_id)
            self._suspects[node_id] = time.monotonic()

    def is_suspect(self, node_id: str) -> bool:
        return node_id in self._suspects

    def suspects(self) -> list[str]:
        """Servers that are silent but whose process runs."""
        with self.heartbeat_lock:
            return sorted(self._suspects)

    # -- the dead -----------------------------------------------------------------------------

    def remember_dead(
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

    def dead_servers(self) -> dict[str, dict[str, Any]]:
        """Servers declared dead: ``node_id -> {"address", "tier", "reason", "at_unix_s"}``."""
        return {n: dict(d) for n, d in list(self._dead.items())}

    def dead_ids(self) -> set[str]:
        return set(self._dead)

    # -- draining ---------------------------------------------------------------------------

    def is_draining(self, node_id: str) -> bool:
        return node_id in self.draining

    def unavailable(self, node_id: str) -> bool:
        """Whether new data must not go to the server (draining or suspect)."""
        return node_id in self.draining or node_id in self._suspects
