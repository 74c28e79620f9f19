"""Status and cluster metrics: what the controller reports, read from the heartbeats and its
tables, never from the servers."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from pocketflow.control.allocator import measured_throughput
from pocketflow.control.job_table import JobTable
from pocketflow.control.membership import Membership


def server_rows(membership: Membership) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
    """Each live server with its latest heartbeat, and per-tier capacity and use."""
    servers = []
    tiers: dict[str, dict[str, int]] = {}
    now = time.monotonic()
    for info in membership.servers():
        row: dict[str, Any] = asdict(info)
        stats = membership.latest_stats(info.node_id) or {}
        row["reachable"] = True
        row["heartbeat_age_ms"] = int(membership.heartbeat_age_s(info.node_id, now) * 1000)
        row["bytes_in_per_s"] = int(stats.get("bytes_in_per_s", 0))
        row["bytes_out_per_s"] = int(stats.get("bytes_out_per_s", 0))
        row["throughput_bytes_per_s"] = measured_throughput(stats)
        row["used_bytes"] = int(stats.get("used_bytes", 0))
        row["objects"] = int(stats.get("objects", 0))
        row["draining"] = bool(stats.get("draining", False))
        row["cpu_utilization"] = float(stats.get("cpu_utilization", 0.0))
        row["jobs"] = dict(stats.get("jobs", {}))
        # Writes the server refused with capacity_exhausted since it started, by limit.
        row["capacity_refusals"] = {
            limit: int(n) for limit, n in dict(stats.get("capacity_refusals", {})).items()
        }
        # The totals the server's /metrics counters hold (as of its latest heartbeat).
        for name in ("requests_total", "received_bytes_total", "sent_bytes_total"):
            row[name] = int(stats.get(name, 0))
        for name in ("threads", "cores", "cores_max"):
            row[name] = int(stats[name]) if name in stats else None
        servers.append(row)
        tier = tiers.setdefault(info.tier, {"servers": 0, "capacity_bytes": 0, "used_bytes": 0})
        tier["servers"] += 1
        tier["capacity_bytes"] += info.capacity_bytes
        tier["used_bytes"] += row["used_bytes"]
    return servers, tiers


def job_rows(jobs: JobTable) -> list[dict[str, Any]]:
    """Each registered job with its epoch and weight map."""
    return [
        {
            "job_id": record.handle.job_id,
            "name": record.handle.name,
            "epoch": record.handle.epoch,
            "weight_map": record.handle.weight_map(),
            "registered_at_unix_s": record.registered_at_unix_s,
        }
        for record in jobs.records()
    ]


def metric_figures(membership: Membership, jobs: JobTable) -> dict[str, Any]:
    """The cluster gauges' figures, as :meth:`ClusterMetrics.refresh` takes them (see
    :mod:`pocketflow.control.cluster_metrics`). Called under the controller's lock; the
    gauges are set outside it."""
    servers: dict[str, int] = {}
    capacity: dict[str, int] = {}
    allocated: dict[str, float] = {}
    for info in membership.servers():
        servers[info.tier] = servers.get(info.tier, 0) + 1
        capacity[info.tier] = capacity.get(info.tier, 0) + info.capacity_bytes
    for record in jobs.records():
        wanted = float(record.demand.get("capacity_bytes", 0) or 0)
        total_weight = sum(s.weight for s in record.handle.servers) or 1.0
        for server in record.handle.servers:
            allocated[server.tier] = (
                allocated.get(server.tier, 0.0) + wanted * server.weight / total_weight
            )
    for tier in capacity:
        allocated.setdefault(tier, 0.0)
    return {
        "jobs": len(jobs), "servers": servers, "capacity_bytes": capacity,
        "allocated_bytes": allocated, "dead_servers": len(membership.dead_ids()),
    }
