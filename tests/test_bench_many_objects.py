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
    markdown,
    run_shape,
    server_memory_per_object,
    shuffle_calls,
    summarize,
)
from benchmarks.shuffle_cpu import measure, report
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


def _run(tasks: int, job_s: float, renewals: int, repeat: int = 0) -> dict[str, object]:
    """A shuffle's figures as ``run_shape`` reports them: registration and deregistration, and
    ``renewals`` lease renewals over ``job_s``."""
    calls = {"register_job": 1, "deregister_job": 1, "renew_lease": renewals}
    return {"mappers": tasks, "objects": tasks * tasks, "object_bytes": 16, "job_s": job_s,
            "repeat": repeat, "map_writes_s_mean": 0.0, "reduce_reads_s_mean": 0.0,
            "reduce_parked_s_mean": 0.0, "ok": True, "controller_calls": calls,
            "controller_calls_total": sum(calls.values()), "controller_calls_per_job": 2,
            "controller_calls_per_object": 2 / (tasks * tasks), "controller_renewals": renewals,
            "controller_renewals_per_s": renewals / job_s}


def test_a_longer_shuffle_s_renewals_do_not_count_as_calls_growing_with_objects() -> None:
    # The wide shuffle ran longer and so renewed its lease more often: that is per second, not
    # per object (the quiet run said "controller calls grow with objects: yes" for it).
    runs = [_run(256, job_s=5.3, renewals=2), _run(16, job_s=1.5, renewals=1)]
    memory = [{"objects": 4096, "objects_stored": 4096, "object_bytes": 0,
               "rss_growth_bytes": 819_200, "rss_growth_per_object": 200.0}]
    summary = summarize(runs, memory, wide=256, narrow=16)
    assert summary["controller_calls_grow_with_objects"] is False, summary
    assert summary["256"]["controller_calls_per_job_max"] == 2
    assert "**no**" in markdown({
        "config": {"wide": 256, "narrow": 16, "total_bytes": 1 << 30, "tasks_max": 4,
                   "repeats": 1},
        "summary": summary, "machine": {"cpu_model": "x", "cores": 2,
                                        "load_avg_1m_at_start": 0.0},
        "executor": "ray", "shape": "full", "commit": {"commit": None}, "started": "now",
        "duration_s": 0.0, "memory": memory})
    # A call per object would still show.
    runs[0]["controller_calls_per_job"] = 65_538
    assert summarize(runs, memory, wide=256, narrow=16)["controller_calls_grow_with_objects"]


def test_the_shuffle_s_cpu_per_object_is_measured_in_process(local_cluster: LocalCluster) -> None:
    """benchmarks/shuffle_cpu at a small size: both shapes validate, every figure is there, and
    every object was read with DELETE and each job ended (nothing left on the servers)."""
    baseline = used_bytes(local_cluster)
    result = measure(local_cluster, wide=16, narrow=4, total_bytes=1 << 20, rounds=1)
    for tasks in (16, 4):
        shape = result["summary"][str(tasks)]
        assert shape["valid"], result
        assert shape["objects"] == tasks * tasks and shape["tasks_cpu_s"] > 0, result
        assert shape["servers_cpu_s"] >= 0 and shape["user_cpu_s"] >= 0, result
    assert result["summary"]["cpu_ratio"] > 0
    assert "CPU, wide over narrow" in report(result, wide=16, narrow=4)
    assert wait_for(lambda: used_bytes(local_cluster) == baseline), used_bytes(local_cluster)
