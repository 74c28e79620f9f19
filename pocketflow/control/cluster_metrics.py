"""Cluster metrics of the controller, published through ``ray.util.metrics`` so they appear in
Ray's own metrics export (``ray_pocketflow_*`` on each node's metrics agent) and dashboard.

The controller refreshes the gauges from its tables on every pass of its monitor loop; the
counters move as things happen. ``pocketflow status`` shows the same numbers from the same
tables (``cluster_metrics`` in the status).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

SIZING_ACTIONS = ("AddServer", "RemoveServers", "AddThreads", "RemoveThreads")
"""Sizing actions counted by name; any other is counted as ``other`` (a bounded tag set)."""


class ClusterMetrics:
    """The controller's metric families; inert (numbers kept, nothing exported) outside Ray."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {
            "jobs": 0, "servers": {}, "capacity_bytes": {}, "allocated_bytes": {},
            "dead_servers": 0, "sizing_actions": {}, "registrations": 0, "deregistrations": 0,
        }
        try:
            from ray.util import metrics
        except ImportError:  # pragma: no cover - ray is a dependency
            self._ray = None
            return
        tier = ("tier",)
        self._ray = {
            "jobs": metrics.Gauge("pocketflow_jobs", description="Registered jobs."),
            "servers": metrics.Gauge(
                "pocketflow_servers", description="Live storage servers.", tag_keys=tier
            ),
            "capacity_bytes": metrics.Gauge(
                "pocketflow_capacity_bytes", description="Capacity of the live servers.",
                tag_keys=tier,
            ),
            "allocated_bytes": metrics.Gauge(
                "pocketflow_allocated_bytes",
                description="Capacity allocated to registered jobs (their hints, by weight).",
                tag_keys=tier,
            ),
            "dead_servers": metrics.Gauge(
                "pocketflow_dead_servers", description="Servers declared dead (kept list)."
            ),
            "sizing_actions": metrics.Counter(
                "pocketflow_sizing_actions", description="Sizing actions carried out.",
                tag_keys=("action",),
            ),
            "registrations": metrics.Counter(
                "pocketflow_registrations", description="Jobs registered."
            ),
            "deregistrations": metrics.Counter(
                "pocketflow_deregistrations",
                description="Jobs deregistered (by their driver or at lease expiry).",
            ),
        }

    def refresh(
        self,
        *,
        jobs: int,
        servers: Mapping[str, int],
        capacity_bytes: Mapping[str, int],
        allocated_bytes: Mapping[str, float],
        dead_servers: int,
    ) -> None:
        """Set the gauges from the controller's tables."""
        self.values.update(
            jobs=jobs, servers=dict(servers), capacity_bytes=dict(capacity_bytes),
            allocated_bytes={t: int(v) for t, v in allocated_bytes.items()},
            dead_servers=dead_servers,
        )
        if self._ray is None:
            return
        try:
            self._ray["jobs"].set(jobs)
            self._ray["dead_servers"].set(dead_servers)
            for name in ("servers", "capacity_bytes", "allocated_bytes"):
                for tier, value in self.values[name].items():
                    self._ray[name].set(value, tags={"tier": tier})
        except Exception:  # metrics must never stop the monitor loop
            log.exception("publishing cluster metrics")

    def count(self, name: str, tag: str | None = None) -> None:
        """Count one registration, deregistration or sizing action (``tag``: its name)."""
        if name == "sizing_actions":
            tag = tag if tag in SIZING_ACTIONS else "other"
            counts = self.values["sizing_actions"]
            counts[tag] = counts.get(tag, 0) + 1
        else:
            self.values[name] += 1
        if self._ray is None:
            return
        try:
            if tag is None:
                self._ray[name].inc()
            else:
                self._ray[name].inc(tags={"action": tag})
        except Exception:
            log.exception("publishing cluster metrics")
