"""Tests of failure handling: a storage server that dies is declared dead within bounds.

Each test adds its own storage server to the session cluster and kills only that one; the
session's servers are never touched. (A hung server: tests/reliability/test_hung_server.py.)
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from fixtures_cluster import (
    DEAD_AFTER_S,
    DETECTION_SLACK_S,
    controller_actor,
    keys_on,
    wait_for,
)

from pocketflow.client import connect
from pocketflow.cluster import LocalCluster
from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.errors import DataUnavailable

READ_TIMEOUT_S = 2.0
"""The client's ``op_timeout_s`` in these tests: a dead server is given up after it."""


def test_killed_server_is_declared_dead_and_its_jobs_move_on(
    local_cluster: LocalCluster, added_server: tuple[StorageNodeInfo, Any]
) -> None:
    import ray

    info, _ = added_server
    controller = controller_actor()
    with local_cluster.register_job("victim") as victim, local_cluster.register_job(
        "bystander", {"latency_sensitive": False}
    ) as bystander:
        assert info.node_id in {s.node_id for s in victim.handle.servers}
        assert info.node_id not in {s.node_id for s in bystander.handle.servers}
        on, off = keys_on(victim.handle, info.node_id)
        assert on and off
        with victim.connect(op_timeout_s=READ_TIMEOUT_S) as pf, bystander.connect() as other:
            pf.create_bucket("b")
            other.create_bucket("b")
            for key in on + off:
                pf.put("b", key, key.encode() * 100)
            other.put("b", "before", b"1")

            os.kill(info.server_pid, signal.SIGKILL)
            killed_at = time.monotonic()

            started = time.monotonic()
            with pytest.raises(DataUnavailable):
                pf.get("b", on[0])
            assert time.monotonic() - started < DEAD_AFTER_S

            assert wait_for(
                lambda: info.node_id
                in ray.get(controller.dead_servers.remote(), timeout=30),
                timeout_s=DEAD_AFTER_S + DETECTION_SLACK_S + 5,
            )
            detected_s = time.monotonic() - killed_at
            assert detected_s < DEAD_AFTER_S + DETECTION_SLACK_S, detected_s

            handle = ray.get(controller.job_handle.remote(victim.job_id), timeout=30)
            assert handle.epoch == victim.handle.epoch + 1
            assert info.node_id not in {s.node_id for s in handle.servers}
            assert any(s.weight > 0 for s in handle.servers)

            # The new map remembers the lost server (in the handle JSON too).
            assert [s.node_id for s in handle.lost] == [info.node_id]
            assert info.address in handle.to_json()

            # The old client learns the new map from a live server and keeps working.
            assert pf.get("b", off[0]) == off[0].encode() * 100
            assert pf.handle.epoch == handle.epoch
            pf.put("b", "after", b"new")
            assert pf.get("b", "after") == b"new"
            # ... and what the dead server held is unavailable, not "not found".
            with pytest.raises(DataUnavailable):
                pf.get("b", on[-1])

            # So it is for a fresh client with the controller's new handle, at once (the dead
            # server is not in its map, so nothing waits on it); live keys read fine.
            with connect(handle.to_json()) as fresh:
                started = time.monotonic()
                with pytest.raises(DataUnavailable) as lost:
                    fresh.get("b", on[-1])
                assert time.monotonic() - started < DEAD_AFTER_S
                assert lost.value.server == info.address
                with pytest.raises(DataUnavailable):
                    fresh.exists("b", on[-1])
                assert all(fresh.get("b", key) == key.encode() * 100 for key in off)
                assert fresh.get("b", "after") == b"new"
                # A key that a waiter expects is still awaited, not failed.
                assert fresh.wait_for("b", [on[-1], "after"], timeout_s=0.2) == [on[-1]]

            # The other job never noticed.
            assert ray.get(
                controller.job_handle.remote(bystander.job_id), timeout=30
            ).epoch == bystander.handle.epoch
            assert other.get("b", "before") == b"1"

        with local_cluster.register_job("newcomer") as newcomer:
            assert info.node_id not in {s.node_id for s in newcomer.handle.servers}
    assert info.node_id not in {s["node_id"] for s in local_cluster.status()["servers"]}
