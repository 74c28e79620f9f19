"""The many-objects shuffle (``benchmarks/many_objects.py``) in its reduced form on the session
cluster: the 65,536-object layout (256 mappers x 256 reducers) at 16 bytes per object, on Ray
tasks. It validates, leaves nothing behind, and asks the controller a fixed number of things
per job (and lease renewals per time), never one per object; the servers' memory measurement
runs at a small count. No speed or memory goal is asserted here (those are the benchmark's, on
a quiet machine)."""

from __future__ import annotations

import pytest
from fixtures_cluster import used_bytes, wait_for
from pocketflow_lithops.shuffle_executors import RayShuffleExecutor

from benchmarks.many_objects import (
    PERIODIC_CALLS,
    controller_calls,
    run_shape,
    server_memory_per_object,
    shuffle_calls,
)
from pocketflow.cluster import LocalCluster
from pocketflow.control.leases import LEASE_MS_DEFAULT

WIDE_TASKS = 256
"""Mappers, and reducers, of the wide shuffle: 65,536 objects."""
SHUFFLE_TIMEOUT_S = 600.0
"""Bound on the wide shuffle's stages on a loaded 2-core machine."""
JOB_CALLS_MAX = 8
"""Most controller calls one shuffle's job may make whatever its objects and its time
(registration, deregistration), besides its lease renewals; a call per object would be 65,536."""


def test_the_65536_object_shuffle_validates_with_no_controller_call_per_object(
    local_cluster: LocalCluster,
) -> None:
    baseline = used_bytes(local_cluster)
    executor = RayShuffleExecutor(tasks_max=4)
    wide = run_shape(local_cluster, executor, tasks=WIDE_TASKS, object_bytes=16,
                     timeout_s=SHUFFLE_TIMEOUT_S)
    assert wide["ok"], wide["problems"]
    assert wide["objects"] == 65_536 and wide["regenerated"] == 0
    # The controller counted what the shuffle asked of it: registration and deregistration,
    # and the driver's lease renewals (one per third of the lease while it ran), not one call
    # per object.
    calls = dict(wide["controller_calls"])
    assert calls.pop("register_job") == 1 and calls.pop("deregister_job") == 1, calls
    renewals = calls.pop("renew_lease", 0)
    assert renewals <= wide["job_s"] / (LEASE_MS_DEFAULT / 3000) + 2, wide
    assert sum(calls.values()) <= JOB_CALLS_MAX, wide["controller_calls"]
    # Every object was read with DELETE and the job ended: nothing is left on the servers.
    assert wait_for(lambda: used_bytes(local_cluster) == baseline), used_bytes(local_cluster)


def test_the_controller_counts_only_calls_from_outside(local_cluster: LocalCluster) -> None:
    before = controller_calls()
    local_cluster.status()
    local_cluster.status()
    after = controller_calls()
    assert after["status"] - before.get("status", 0) == 2
    assert after["calls_served"] == before["calls_served"] + 1
    # The monitor loop's own calls (failure checks, lease expiry) are not counted.
    assert "check_failures" not in after and "expire_leases" not in after, after
    assert shuffle_calls(before, after) == {}
    assert {"status", "calls_served", "heartbeat"} <= PERIODIC_CALLS


@pytest.mark.parametrize("object_bytes", [0, 4096])
def test_the_servers_memory_per_object_is_measured(
    local_cluster: LocalCluster, object_bytes: int
) -> None:
    measured = server_memory_per_object(local_cluster, objects=2048, object_bytes=object_bytes)
    assert measured["objects_stored"] == 2048, measured
    assert measured["rss_growth_bytes"] >= 0, measured
