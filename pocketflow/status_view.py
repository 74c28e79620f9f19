"""Terminal view of ``Controller.status()``: servers, tiers and jobs as aligned tables (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

BAR_WIDTH = 10
"""Characters of a utilization bar."""

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; whole bytes below 1 KiB."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_rate(bytes_per_s: float) -> str:
    """A transfer rate, e.g. ``"12.0 MiB/s"``."""
    return format_bytes(bytes_per_s) + "/s"


def percent(used: float, total: float) -> str:
    """``used`` of ``total`` as ``"12.5%"``, or ``"-"`` without a total."""
    return f"{100.0 * used / total:.1f}%" if total > 0 else "-"


def bar(used: float, total: float, width: int = BAR_WIDTH) -> str:
    """A fixed-width utilization bar, ``"[###-------]"``."""
    filled = 0 if total <= 0 else min(width, int(width * used / total + 0.5))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], *, right: set[int]) -> list[str]:
    """Aligned lines: columns separated by two spaces, those in ``right`` right-aligned."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [
            str(cell).rjust(width) if i in right else str(cell).ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def server_state(row: Mapping[str, Any], draining: set[str]) -> str:
    """``live``, ``draining`` or ``unreachable`` for a known server."""
    if not row.get("reachable", True):
        return "unreachable"
    if row.get("draining") or row["node_id"] in draining:
        return "draining"
    return "live"


def _cores(row: Mapping[str, Any]) -> str:
    cores, cores_max = row.get("cores"), row.get("cores_max")
    if cores is None:
        return "-"
    return f"{cores}/{cores_max}" if cores_max else str(cores)


def job_bytes(status: Mapping[str, Any], field: str = "used_bytes") -> dict[str, int]:
    """Bytes each job holds (``used_bytes``) or has reserved (``reserved_bytes``), summed over
    the servers' latest statistics."""
    held: dict[str, int] = {}
    for row in status.get("servers", []):
        for job_id, usage in (row.get("jobs") or {}).items():
            held[job_id] = held.get(job_id, 0) + int(usage.get(field, 0))
    return held


REFUSAL_LIMITS = ("data", "records", "reserved", "extent", "freeing")
"""The limits a server counts its ``capacity_exhausted`` refusals by (docs/PROTOCOL.md,
"Statistics"), in the order they are shown."""


def job_refusals(status: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Each job's refused writes by limit, summed over the servers' latest statistics."""
    refused: dict[str, dict[str, int]] = {}
    for row in status.get("servers", []):
        for job_id, usage in (row.get("jobs") or {}).items():
            counts = refused.setdefault(job_id, dict.fromkeys(REFUSAL_LIMITS, 0))
            for limit, n in (usage.get("capacity_refusals") or {}).items():
                counts[limit] = counts.get(limit, 0) + int(n)
    return refused


def format_refusals(counts: Mapping[str, int] | None, *, sep: str = ",") -> str:
    """Nonzero refusal counts as ``"extent:5,reserved:2"`` (``sep`` between them), or ``"-"``."""
    shown = [f"{limit}:{n}" for limit, n in (counts or {}).items() if int(n)]
    return sep.join(shown) or "-"


def _servers_section(status: Mapping[str, Any]) -> list[str]:
    draining = set(status.get("draining", []))
    dead: Mapping[str, Mapping[str, Any]] = status.get("dead_servers", {}) or {}
    rows = []
    states: dict[str, int] = {"live": 0, "draining": 0, "unreachable": 0, "dead": 0}
    for row in status.get("servers", []):
        state = server_state(row, draining)
        states[state] += 1
        used, capacity = int(row.get("used_bytes", 0)), int(row.get("capacity_bytes", 0))
        rows.append([
            row["node_id"], row["tier"], row["address"], state,
            "-" if row.get("threads") is None else str(row["threads"]), _cores(row),
            f"{format_bytes(used)} / {format_bytes(capacity)}", percent(used, capacity),
            f"{100.0 * float(row.get('cpu_utilization', 0.0)):.0f}%",
            format_rate(row.get("bytes_in_per_s", 0)), format_rate(row.get("bytes_out_per_s", 0)),
            str(row.get("objects", 0)), str(row.get("requests_total", 0)),
            format_bytes(row.get("received_bytes_total", 0)),
            format_bytes(row.get("sent_bytes_total", 0)),
            "yes" if row.get("long_running") else "no",
        ])
    for node_id, info in sorted(dead.items()):
        states["dead"] += 1
        rows.append([
            node_id, str(info.get("tier", "-")), str(info.get("address", "-")), "dead",
            "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
        ])
    summary = ", ".join(f"{n} {state}" for state, n in states.items() if n)
    header = [
        "NODE", "TIER", "ADDRESS", "STATE", "THREADS", "CORES", "USED / CAPACITY", "USED%",
        "CPU", "NET IN", "NET OUT", "OBJECTS", "REQUESTS", "RECEIVED", "SENT", "PERSIST",
    ]
    lines = [f"SERVERS ({summary or 'none'})"]
    lines += table(header, rows, right={4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14})
    for node_id, info in sorted(dead.items()):
        if info.get("reason"):
            lines.append(f"  {node_id} dead: {info['reason']}")
    for row in status.get("servers", []):
        refused = format_refusals(row.get("capacity_refusals"), sep=", ")
        if refused != "-":
            lines.append(f"  {row['node_id']} refused writes (by limit): {refused}")
    return lines


def _tiers_section(status: Mapping[str, Any]) -> list[str]:
    rows = []
    for tier, totals in sorted((status.get("tiers") or {}).items()):
        used, capacity = int(totals.get("used_bytes", 0)), int(totals.get("capacity_bytes", 0))
        rows.append([
            tier, str(totals.get("servers", 0)), format_bytes(used), format_bytes(capacity),
            percent(used, capacity), bar(used, capacity),
        ])
    header = ["TIER", "SERVERS", "USED", "CAPACITY", "USED%", "UTILIZATION"]
    return ["TIERS", *table(header, rows, right={1, 2, 3, 4})]


def _jobs_section(status: Mapping[str, Any]) -> list[str]:
    jobs = status.get("jobs") or []
    held = job_bytes(status)
    reserved = job_bytes(status, "reserved_bytes")
    refused = job_refusals(status)
    rows = []
    for job in jobs:
        servers = (job.get("weight_map") or {}).get("servers") or []
        weights = " ".join(f"{s[0]}:{float(s[3]):.2f}" for s in servers)
        job_id = job["job_id"]
        rows.append([
            job_id, str(job.get("name", "")), str(job.get("epoch", "")),
            format_bytes(held.get(job_id, 0)), format_bytes(reserved.get(job_id, 0)),
            format_refusals(refused.get(job_id)), weights or "-",
        ])
    lines = [f"JOBS ({len(jobs)})"]
    if rows:
        header = ["JOB", "NAME", "EPOCH", "BYTES", "RESERVED", "REFUSED", "SERVERS (node:weight)"]
        lines += table(header, rows, right={2, 3, 4})
    return lines


def format_status(status: Mapping[str, Any]) -> str:
    """The whole status as text: servers, tiers, jobs, and recent sizing actions if any."""
    lines = _servers_section(status) + [""] + _tiers_section(status) + [""]
    lines += _jobs_section(status)
    metrics = status.get("cluster_metrics")
    if metrics:
        lines += ["", (
            f"CLUSTER METRICS: {metrics.get('jobs', 0)} jobs, "
            f"{metrics.get('registrations', 0)} registered and "
            f"{metrics.get('deregistrations', 0)} deregistered since start, "
            f"{metrics.get('dead_servers', 0)} dead servers; allocated "
            + ", ".join(
                f"{tier} {format_bytes(n)}"
                for tier, n in sorted((metrics.get("allocated_bytes") or {}).items())
            )
        ).rstrip()]
        lines += ["  (servers' Prometheus metrics: " + ", ".join(
            str(row["metrics_url"]) for row in status.get("servers", []) if row.get("metrics_url")
        ) + ")"]
    actions = status.get("sizing_actions") or []
    if actions:
        lines += ["", "RECENT SIZING ACTIONS"]
        lines += [
            f"  {a.get('action')} {a.get('node_id', '')} {a.get('reason', '')}".rstrip()
            for a in actions[-5:]
        ]
    return "\n".join(lines) + "\n"
