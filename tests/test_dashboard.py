"""The operator's Grafana dashboard (examples/grafana-dashboard.json) queries only series that
pocketflow exports: each panel's metric names are scraped from a real storage server's
Prometheus endpoint after real operations, or from Ray's metrics export of the session's
cluster for the controller's ``ray_pocketflow_*`` families. So renaming a metric without the
dashboard (or a typo in a panel) fails here, and so does a server family no panel shows."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pocketflow.client import Client
from pocketflow.cluster import LocalCluster

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana-dashboard.json"
SCRAPE_TIMEOUT_S = 10.0
RAY_EXPORT_WAIT_S = 90.0
"""Bound on waiting for Ray's metrics agent to export the controller's families (it reports
every few seconds)."""
SERIES_NAME = re.compile(r"\b((?:ray_)?pocketflow_[a-z_]+)\b")
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")
SERVER_FAMILY_SUFFIXES = ("_bucket", "_count", "_sum", "_created")


def dashboard_queries() -> dict[str, list[str]]:
    """Panel title -> its PromQL expressions (rows' nested panels included), plus the template
    variables' queries under ``variable <name>``."""
    board = json.loads(DASHBOARD.read_text())
    queries: dict[str, list[str]] = {}

    def visit(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            visit(panel.get("panels", []))
            if panel.get("type") != "row":
                queries[panel["title"]] = [t["expr"] for t in panel.get("targets", [])]

    visit(board["panels"])
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries[f"variable {variable['name']}"] = [
                query["query"] if isinstance(query, dict) else query]
    return queries


def scrape(url: str) -> dict[str, set[str]]:
    """Sample name -> the label names it carries, in one scrape of ``url``."""
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:
        text = reply.read().decode()
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def ray_metrics_url() -> str:
    """Ray's Prometheus export of this node (the metrics agent the controller reports to)."""
    import ray

    node = next(n for n in ray.nodes() if n["Alive"])
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def check_queries(queries: dict[str, list[str]], exported: dict[str, set[str]]) -> list[str]:
    """What is wrong with the queries against the exported series: an unknown series name, a
    grouping label no named series carries, a panel with no query."""
    problems = []
    for title, exprs in queries.items():
        if not exprs:
            problems.append(f"{title}: no query")
        for expr in exprs:
            names = SERIES_NAME.findall(expr)
            if not names:
                problems.append(f"{title}: {expr!r} names no pocketflow series")
            labels: set[str] = {"le"}
            for name in names:
                if name not in exported:
                    problems.append(f"{title}: {name} is not exported")
                labels |= exported.get(name, set())
            for group in GROUPING.findall(expr):
                for label in (part.strip() for part in group.split(",")):
                    if label and label not in labels:
                        problems.append(f"{title}: groups by {label!r}, which {names} lack")
    return problems


def test_the_dashboard_is_valid_grafana_json_with_panels_and_variables() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["title"] and board["uid"]
    queries = dashboard_queries()
    assert len([t for t in queries if not t.startswith("variable")]) >= 10
    assert {"variable node", "variable tier"} <= set(queries)
    # The parser sees the histogram, the counters and the controller's families.
    names = {n for exprs in queries.values() for e in exprs for n in SERIES_NAME.findall(e)}
    assert "pocketflow_op_duration_seconds_bucket" in names
    assert "ray_pocketflow_jobs" in names


def test_every_server_panel_queries_series_a_real_server_exports(
    storage_servers: Any, client: Client
) -> None:
    # Real operations first: a labelled family (requests by op, latency by op) has no series
    # until its first request.
    client.create_bucket("dash")
    client.put("dash", "k", b"v" * 1024)
    assert client.get("dash", "k", delete=True) == b"v" * 1024
    exported: dict[str, set[str]] = {}
    for process in storage_servers.processes:
        for name, labels in scrape(process.metrics_url).items():
            exported.setdefault(name, set()).update(labels)
    server_queries = {
        title: [e for e in exprs if "ray_pocketflow_" not in e]
        for title, exprs in dashboard_queries().items()
    }
    server_queries = {title: exprs for title, exprs in server_queries.items() if exprs}
    assert check_queries(server_queries, exported) == []

    # And every family a server exports is on the dashboard.
    shown = {n for exprs in server_queries.values() for e in exprs
             for n in SERIES_NAME.findall(e)}
    families = {name for name in exported if name.startswith("pocketflow_")}
    unshown = sorted(
        f for f in families
        if f not in shown and not any(f.endswith(s) and f[: -len(s)] + "_bucket" in shown
                                      for s in SERVER_FAMILY_SUFFIXES)
    )
    assert unshown == []


def test_every_controller_panel_queries_series_ray_exports_for_the_controller(
    local_cluster: LocalCluster,
) -> None:
    # A registration and a deregistration move the controller's counters; its gauges are set
    # on every pass of its monitor loop.
    with local_cluster.register_job("dashboard", {"data_size_bytes": "1MiB"}):
        pass
    controller_queries = {
        title: [e for e in exprs if "ray_pocketflow_" in e]
        for title, exprs in dashboard_queries().items()
    }
    controller_queries = {title: exprs for title, exprs in controller_queries.items() if exprs}
    assert controller_queries
    url = ray_metrics_url()
    deadline = time.monotonic() + RAY_EXPORT_WAIT_S
    while True:
        exported = scrape(url)
        problems = check_queries(controller_queries, exported)
        # A counter Ray has not seen move yet is not exported at all: the sizing actions, on a
        # cluster that does not autoscale. Such a family must be one the controller declares,
        # under the name Ray gives the counters that did move (``ray_<name>_total``).
        pending = [p for p in problems if "ray_pocketflow_sizing_actions_total" in p]
        if problems == pending or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    assert [p for p in problems if p not in pending] == []
    assert "ray_pocketflow_registrations_total" in exported
    if pending:
        from pocketflow.control.cluster_metrics import ClusterMetrics

        declared = ClusterMetrics()._ray
        assert declared is not None
        assert type(declared["sizing_actions"]).__name__ == "Counter"
        assert declared["sizing_actions"]._name == "pocketflow_sizing_actions"
        assert tuple(declared["sizing_actions"]._tag_keys) == ("action",)
