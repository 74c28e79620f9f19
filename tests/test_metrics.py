"""Prometheus metrics of real storage servers, scraped over HTTP during a job and parsed with
``prometheus_client``'s own parser: the counters move by exactly the operations the test made,
the gauges show capacity and use, and ``status`` reads the same totals. The controller's cluster
metrics (``ray.util.metrics``) are reported in ``status`` too."""

from __future__ import annotations

import os
import urllib.request
from collections import Counter
from typing import Any

import pytest
from fixtures_cluster import wait_for
from prometheus_client.parser import text_string_to_metric_families

from pocketflow import Hints
from pocketflow.cluster import LocalCluster
from pocketflow.errors import ObjectNotFound
from pocketflow.placement import Placement

SMALL_BYTES = 100
BIG_BYTES = 3 * 1024 * 1024 + 5
SCRAPE_TIMEOUT_S = 10.0


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``(sample name, sorted labels without node_id/tier) -> value`` of one scrape."""
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(
                (k, v) for k, v in sample.labels.items() if k not in ("node_id", "tier")
            ))
            samples[(sample.name, labels)] = sample.value
    return samples


def scrape_all(cluster: LocalCluster) -> dict[str, dict[Any, float]]:
    return {s["node_id"]: scrape(s["metrics_url"]) for s in cluster.status()["servers"]}


def summed(scrapes: dict[str, dict[Any, float]], name: str, **labels: str) -> float:
    """Sum of a sample over every server, for samples whose labels include ``labels``."""
    total = 0.0
    for samples in scrapes.values():
        for (sample, sample_labels), value in samples.items():
            if sample == name and set(labels.items()) <= set(sample_labels):
                total += value
    return total


def test_every_server_has_a_metrics_url(local_cluster: LocalCluster) -> None:
    for server in local_cluster.status()["servers"]:
        url = server["metrics_url"]
        host = server["address"].rsplit(":", 1)[0]
        assert url.startswith(f"http://{host}:") and url.endswith("/metrics"), server
        samples = scrape(url)
        assert samples[("pocketflow_capacity_bytes", ())] == server["capacity_bytes"]


def test_counters_move_by_exactly_the_operations_made(local_cluster: LocalCluster) -> None:
    hints = Hints(data_size_bytes="16MiB")
    big = os.urandom(BIG_BYTES)
    with local_cluster.register_job("metrics", hints) as job, job.connect() as pf:
        pf.create_bucket("m")
        before = scrape_all(local_cluster)
        for i in range(5):
            pf.put("m", f"s{i}", bytes([i]) * SMALL_BYTES)
        for i in range(3):
            assert pf.get("m", f"s{i}") == bytes([i]) * SMALL_BYTES
        with pytest.raises(ObjectNotFound):
            pf.get("m", "missing")
        pf.put("m", "big", big)
        assert pf.get("m", "big") == big
        after = scrape_all(local_cluster)

        def moved(name: str, **labels: str) -> float:
            return summed(after, name, **labels) - summed(before, name, **labels)

        # Small puts are one exchange op each, small gets one direct READ each; the big object
        # adds an exchange put and a READ for its block-0 record (the manifest), and its data
        # blocks travel as direct block transfers. When all its data blocks live on block 0's
        # home, the manifest is committed with their upload instead of by an exchange put.
        placement = Placement(pf.handle.servers)
        blocks = -(-BIG_BYTES // pf.handle.block_size_bytes)
        homes = {placement.server_for(b"big").node_id} | {
            placement.data_block_server(b"big", i, block_count=blocks).node_id
            for i in range(1, blocks + 1)
        }
        manifest_puts = 0 if len(homes) == 1 else 1
        assert moved(
            "pocketflow_requests_total", rpc="exchange", op="put", result="ok"
        ) == 5 + manifest_puts
        assert moved("pocketflow_requests_total", rpc="direct_read", op="get", result="ok") == 4
        assert moved("pocketflow_requests_total", rpc="exchange", op="get") == 0
        assert moved("pocketflow_requests_total", rpc="direct_put", op="put", result="ok") >= 1
        assert moved("pocketflow_requests_total", rpc="direct_get", op="get", result="ok") >= 1
        assert moved(
            "pocketflow_requests_total", rpc="direct_read", op="get", result="not_found"
        ) == 1
        # Value bytes: exactly what the test wrote and read.
        assert moved("pocketflow_received_bytes_total") == 5 * SMALL_BYTES + BIG_BYTES
        assert moved("pocketflow_sent_bytes_total") == 3 * SMALL_BYTES + BIG_BYTES
        # Every request observed its latency.
        ops = moved("pocketflow_op_duration_seconds_count")
        requests = moved("pocketflow_requests_total")
        assert ops == requests >= 10
        assert summed(after, "pocketflow_used_bytes") >= 5 * SMALL_BYTES + BIG_BYTES
        assert summed(after, "pocketflow_jobs") >= 1

        # `status` shows the same totals (after the next heartbeat brings them).
        def status_caught_up() -> bool:
            rows = local_cluster.status()["servers"]
            return sum(r["received_bytes_total"] for r in rows) >= summed(
                after, "pocketflow_received_bytes_total"
            )

        assert wait_for(status_caught_up)


def test_a_scrape_of_another_path_is_refused(local_cluster: LocalCluster) -> None:
    url = local_cluster.status()["servers"][0]["metrics_url"].replace("/metrics", "/other")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S)
    assert refused.value.code == 404


def test_cluster_metrics_count_registrations_and_jobs(local_cluster: LocalCluster) -> None:
    first = Counter(local_cluster.status()["cluster_metrics"])
    with local_cluster.register_job("metrics-count"):
        during = local_cluster.status()["cluster_metrics"]
        assert during["registrations"] == first["registrations"] + 1
        assert wait_for(lambda: local_cluster.status()["cluster_metrics"]["jobs"] >= 1)
    after = local_cluster.status()["cluster_metrics"]
    assert after["deregistrations"] == first["deregistrations"] + 1
    tiers = {s["tier"] for s in local_cluster.status()["servers"]}
    assert set(after["servers"]) == tiers
    assert after["capacity_bytes"]["dram"] == sum(
        s["capacity_bytes"] for s in local_cluster.status()["servers"] if s["tier"] == "dram"
    )


def test_cluster_metrics_reach_rays_metrics_export(local_cluster: LocalCluster) -> None:
    """The controller's ``ray.util.metrics`` appear on the node's Ray metrics agent, the
    endpoint Prometheus scrapes in a Ray deployment (as ``ray_pocketflow_*``)."""
    import time

    import ray

    port = ray._private.worker._global_node.metrics_export_port
    with local_cluster.register_job("metrics-export"):
        deadline = time.monotonic() + 90
        names: set[str] = set()
        jobs: list[float] = []
        while time.monotonic() < deadline:
            scraped = scrape(f"http://127.0.0.1:{port}/metrics")
            names = {name for name, _ in scraped if name.startswith("ray_pocketflow_")}
            jobs = [v for (name, _), v in scraped.items() if name == "ray_pocketflow_jobs"]
            # The export lags the controller by its report interval: wait for this job.
            if jobs and max(jobs) >= 1 and "ray_pocketflow_registrations_total" in names:
                break
            time.sleep(2)
    assert "ray_pocketflow_registrations_total" in names, sorted(names)
    assert jobs and max(jobs) >= 1, jobs
    assert {"ray_pocketflow_servers", "ray_pocketflow_capacity_bytes"} <= names
