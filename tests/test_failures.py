"""Tests of failure handling: a storage server that dies or hangs is declared dead within bounds.

Each test adds its own storage server to the session cluster and kills or stops only that one;
the session's servers are never touched.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fixtures_cluster import extra_server, wait_for

from pocketflow.client import connect
from pocketflow.cluster import LocalCluster
from pocketflow.config import ClientConfig
from pocketflow.control import CONTROLLER_ACTOR_NAME, NAMESPACE
from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.errors import DataUnavailable
from pocketflow.placement import Placement

DEAD_AFTER_S = 3.0
"""The session cluster's default ``dead_after``."""

DETECTION_SLACK_S = 3.5
"""Allowed lateness of the failure detector on a loaded 2-core machine."""

READ_TIMEOUT_S = 2.0
"""The client's ``op_timeout_s`` in these tests: a hung server is given up after it."""

KEYS = 48


def _controller() -> Any:
    import ray

    return ray.get_actor(CONTROLLER_ACTOR_NAME, namespace=NAMESPACE)


@pytest.fixture
def extra(local_cluster: LocalCluster) -> Iterator[tuple[StorageNodeInfo, Any]]:
    """A DRAM server of this test only (see ``fixtures_cluster.extra_server``)."""
    with extra_server(local_cluster, prefix="extra") as added:
        yield added


def _keys_on(job_handle: Any, node_id: str) -> tuple[list[str], list[str]]:
    """The test keys placed on ``node_id`` and those placed elsewhere."""
    placement = Placement(job_handle.servers)
    keys = [f"k{i}" for i in range(KEYS)]
    on = [k for k in keys if placement.server_for(k.encode(), 0).node_id == node_id]
    off = [k for k in keys if k not in on]
    return on, off


def test_killed_server_is_declared_dead_and_its_jobs_move_on(
    local_cluster: LocalCluster, extra: tuple[StorageNodeInfo, Any]
) -> None:
    import ray

    info, _ = extra
    controller = _controller()
    with local_cluster.register_job("victim") as victim, local_cluster.register_job(
        "bystander", {"latency_sensitive": False}
    ) as bystander:
        assert info.node_id in {s.node_id for s in victim.handle.servers}
        assert info.node_id not in {s.node_id for s in bystander.handle.servers}
        on, off = _keys_on(victim.handle, info.node_id)
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


def test_hung_server_gives_data_unavailable_within_the_failure_bound_and_is_not_dead(
    local_cluster: LocalCluster, extra: tuple[StorageNodeInfo, Any]
) -> None:
    """With the default client settings (no timeout given), a read of a SIGSTOPped server's data
    fails within the control plane's failure bound, never after a long RPC deadline. The
    control plane tells a hung process from a dead one: the server becomes a suspect (no new
    jobs), is neither stopped nor declared dead, and once it runs again its data is all there."""
    import ray

    info, _ = extra
    controller = _controller()
    default_op_timeout_s = ClientConfig().op_timeout_s
    assert default_op_timeout_s <= DEAD_AFTER_S
    with local_cluster.register_job("hung") as job:
        on, off = _keys_on(job.handle, info.node_id)
        assert on and off
        with job.connect() as pf:
            pf.create_bucket("b")
            for key in on[:4] + off[:4]:
                pf.put("b", key, b"v")
            os.kill(info.server_pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(DataUnavailable):
                    pf.get("b", on[0])
                assert time.monotonic() - started < default_op_timeout_s + DETECTION_SLACK_S
                started = time.monotonic()
                with pytest.raises(DataUnavailable):
                    pf.exists("b", on[1])  # a new session to the hung server
                assert time.monotonic() - started < default_op_timeout_s + DETECTION_SLACK_S
                # Silent for dead_after, then the probe waits dead_after for an answer; the
                # process runs, so it is a suspect, not dead.
                assert wait_for(
                    lambda: info.node_id
                    in ray.get(controller.suspect_servers.remote(), timeout=30),
                    timeout_s=2 * DEAD_AFTER_S + DETECTION_SLACK_S + 5,
                )
                assert info.node_id not in ray.get(controller.dead_servers.remote(), timeout=30)
                assert info.server_process().alive()
                with local_cluster.register_job("newcomer") as newcomer:
                    assert info.node_id not in {s.node_id for s in newcomer.handle.servers}
                # Keys on the other servers are served meanwhile.
                assert pf.get("b", off[0]) == b"v"
                os.kill(info.server_pid, signal.SIGCONT)
                # Running again: heartbeats clear the suspicion, and nothing was lost.
                assert wait_for(
                    lambda: info.node_id
                    not in ray.get(controller.suspect_servers.remote(), timeout=30),
                    timeout_s=DEAD_AFTER_S + DETECTION_SLACK_S + 10,
                )
                for key in on[:4] + off[:4]:
                    assert pf.get("b", key) == b"v"
            finally:
                if info.server_process().alive():
                    os.kill(info.server_pid, signal.SIGKILL)
