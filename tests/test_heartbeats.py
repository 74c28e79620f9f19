"""Tests of heartbeats: storage nodes push their servers' statistics to the controller."""

from __future__ import annotations

import pytest
from fixtures_cluster import used_bytes, wait_for

from pocketflow.cluster import LocalCluster
from pocketflow.control import NAMESPACE, STORAGE_NODE_ACTOR_PREFIX
from pocketflow.errors import ConfigError

HEARTBEAT_SETTLE_TIMEOUT_S = 10.0


def test_every_node_sends_heartbeats(local_cluster: LocalCluster) -> None:
    import ray

    nodes = [
        ray.get_actor(STORAGE_NODE_ACTOR_PREFIX + info.node_id, namespace=NAMESPACE)
        for info in local_cluster.servers
    ]
    before = ray.get([node.heartbeats_sent.remote() for node in nodes], timeout=30)

    def all_advanced() -> bool:
        after = ray.get([node.heartbeats_sent.remote() for node in nodes], timeout=30)
        return all(a > b for a, b in zip(after, before, strict=True))

    assert wait_for(all_advanced, timeout_s=HEARTBEAT_SETTLE_TIMEOUT_S)


def test_status_is_fed_by_recent_heartbeats(local_cluster: LocalCluster) -> None:
    def fresh() -> bool:
        rows = local_cluster.status()["servers"]
        return all(row["heartbeat_age_ms"] < 2500 for row in rows)

    assert wait_for(fresh, timeout_s=HEARTBEAT_SETTLE_TIMEOUT_S)
    row = local_cluster.status()["servers"][0]
    for field in ("cpu_utilization", "bytes_in_per_s", "bytes_out_per_s", "used_bytes"):
        assert field in row
    assert isinstance(local_cluster.status()["dead_servers"], dict)


def test_heartbeats_carry_the_usage_of_new_data(local_cluster: LocalCluster) -> None:
    with local_cluster.register_job("heartbeat-usage") as job:
        before = sum(used_bytes(local_cluster).values())
        with job.connect() as pf:
            pf.create_bucket("b")
            for i in range(8):
                pf.put("b", f"k{i}", b"x" * 200_000)
            assert wait_for(
                lambda: sum(used_bytes(local_cluster).values()) >= before + 8 * 200_000,
                timeout_s=HEARTBEAT_SETTLE_TIMEOUT_S,
            )


def test_dead_after_must_exceed_the_heartbeat_interval() -> None:
    with pytest.raises(ConfigError):
        LocalCluster(heartbeat_interval="2s", dead_after="1s")
