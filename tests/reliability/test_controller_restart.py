"""A controller that crashes (SIGKILL) is restarted by Ray and rebuilds its state from the
Metadata actor's records and the storage nodes (issue 17, item 2): a shuffle whose mappers run
while the controller dies completes with a verified output, a task reading and writing meanwhile
never notices, the job stays registered (its driver's lease renewals reach the new instance),
``status`` shows the same jobs, and deregistration and new registrations work.

The shuffle's tasks are those of ``test_killed_server_mid_shuffle`` (spawned pool, public API)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fixtures_cluster import controller_actor, used_bytes, wait_for
from test_killed_server_mid_shuffle import (
    MAPPERS,
    OUTPUT_BUCKET,
    POOL_PROCESSES,
    RECORDS,
    REDUCERS,
    SEED,
    SHUFFLE_BUCKET,
    TASK_TIMEOUT_S,
    _map_task,
    _reduce_task,
    _run_all,
    output_key,
)

from pocketflow.cluster import LocalCluster
from pocketflow.control import METADATA_ACTOR_NAME, NAMESPACE, STORAGE_NODE_ACTOR_PREFIX
from pocketflow.control.leases import LEASE_MS_DEFAULT
from pocketflow.control.storage_node import StorageNode
from pocketflow.demo import SortConfig, check_output, describe_partition
from pocketflow.errors import PocketflowError

RESTART_BOUND_S = 60.0
"""How long Ray may take to bring the controller back on a loaded 2-core machine."""
TASK_OPS_MAX = 1_000_000
"""Bound of the task thread's loop, with ``TASK_SECONDS_MAX``."""
TASK_SECONDS_MAX = 180.0
GRANT_BYTES = 4 * 1024 * 1024
"""Size of the prefix granted DRAM before the crash."""


def _controller_pid() -> int:
    import ray

    return int(ray.get(controller_actor().pid.remote(), timeout=30))


def _status_or_none(cluster: LocalCluster) -> dict[str, Any] | None:
    try:
        return cluster.control.status()
    except PocketflowError:
        return None


@pytest.fixture
def dead_named_server(local_cluster: LocalCluster) -> Iterator[str]:
    """A storage node named as the cluster names its own, whose server was SIGKILLed and then
    declared dead by the controller; its actor is killed afterwards."""
    import ray

    node_id = f"restart-dead-{uuid.uuid4().hex[:6]}"
    node = ray.remote(StorageNode).options(
        name=STORAGE_NODE_ACTOR_PREFIX + node_id, namespace=NAMESPACE, num_cpus=0
    ).remote(node_id=node_id, tier="dram", capacity_bytes=16 * 1024 * 1024,
             secret=local_cluster.secret)
    try:
        info = ray.get(node.start.remote(), timeout=60)
        ray.get(controller_actor().add_server.remote(info, node), timeout=30)
        os.kill(info.server_pid, signal.SIGKILL)
        assert wait_for(lambda: node_id in local_cluster.control.status()["dead_servers"],
                        timeout_s=30), "the killed server was not declared dead"
        yield node_id
    finally:
        ray.kill(node, no_restart=True)


def test_a_killed_controller_comes_back_with_its_jobs_and_tasks_never_notice(
    local_cluster: LocalCluster, dead_named_server: str
) -> None:
    import ray

    baseline = used_bytes(local_cluster)
    dead_node_id = dead_named_server
    config = SortConfig(mappers=MAPPERS, reducers=REDUCERS, records=RECORDS, seed=SEED)
    context = multiprocessing.get_context("spawn")
    # Leaving the pool's block terminates its worker processes (by pid), also on a failure.
    with local_cluster.register_job("restart", lease_ms=LEASE_MS_DEFAULT) as job, \
            context.Pool(POOL_PROCESSES) as pool, job.keep([]) as keeper:
        # A sized prefix granted DRAM, kept renewed by the driver through the crash (its
        # route moves the job to its second epoch).
        assert job.declare("granted", size_bytes=GRANT_BYTES) == "dram"
        keeper.add("granted")
        granted_before = local_cluster.status()["prefix_grants"]["granted_bytes"]
        assert granted_before >= GRANT_BYTES

        before = local_cluster.control.status()
        servers_before = sorted(s["node_id"] for s in before["servers"])
        jobs_before = {j["job_id"]: j["epoch"] for j in before["jobs"]}
        assert job.job_id in jobs_before

        # A task writes and reads back through the whole crash and restart.
        failures: list[BaseException] = []
        ops = [0]
        stop = threading.Event()

        def task() -> None:
            deadline = time.monotonic() + TASK_SECONDS_MAX
            with job.connect() as client:
                client.create_bucket("b")
                for i in range(TASK_OPS_MAX):
                    if stop.is_set() or time.monotonic() > deadline:
                        return
                    value = f"value-{i}".encode() * 50
                    try:
                        client.put("b", f"k{i}", value)
                        if client.get("b", f"k{i}", delete=True) != value:
                            failures.append(AssertionError(f"wrong bytes for k{i}"))
                    except BaseException as exc:  # noqa: BLE001 - reported below
                        failures.append(exc)
                        return
                    ops[0] += 1

        thread = threading.Thread(target=task, daemon=True)
        thread.start()
        assert wait_for(lambda: ops[0] > 50), "the task did not start"
        handle_json = job.handle.to_json()
        with job.connect() as pf:
            pf.create_bucket(SHUFFLE_BUCKET)
            pf.create_bucket(OUTPUT_BUCKET)
        maps = pool.starmap_async(
            _map_task, [(handle_json, config, m, None) for m in range(MAPPERS)], chunksize=1
        )
        time.sleep(0.5)  # the mappers are starting or running

        # The lease length its driver's first renewal logs (on a thread of the controller).
        metadata = ray.get_actor(METADATA_ACTOR_NAME, namespace=NAMESPACE)
        assert wait_for(lambda: "lease_ms" in ray.get(metadata.get_job.remote(job.job_id)))

        first_pid = _controller_pid()
        os.kill(first_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert wait_for(lambda: _status_or_none(local_cluster) is not None,
                        timeout_s=RESTART_BOUND_S), "the controller did not come back"
        restarted_in_s = time.monotonic() - killed_at
        assert _controller_pid() != first_pid
        restored = ray.get(controller_actor().restored.remote(), timeout=30)
        assert restored is not None and job.job_id in restored["jobs"]
        # The lease its driver had is given back from the log, not started by a renewal.
        assert restored["leases"][job.job_id] == LEASE_MS_DEFAULT
        # So is the prefix's DRAM grant: the new instance does not give that DRAM away again.
        assert restored["grants"] >= 1
        assert local_cluster.status()["prefix_grants"]["granted_bytes"] == granted_before

        after = local_cluster.control.status()
        assert sorted(s["node_id"] for s in after["servers"]) == servers_before
        # The dead server is still known as dead (its node's process is gone).
        assert dead_node_id in after["dead_servers"]
        assert {j["job_id"]: j["epoch"] for j in after["jobs"]} == jobs_before
        assert local_cluster.control.job_handle(job.job_id).servers == job.handle.servers

        # The shuffle completes: its tasks never needed the controller.
        mapped = maps.get(TASK_TIMEOUT_S)
        outcomes = _run_all(pool, _reduce_task,
                            [(handle_json, r, MAPPERS) for r in range(REDUCERS)])
        assert all(o.complete for o in outcomes), outcomes
        with job.connect() as pf:
            outputs = [pf.get(OUTPUT_BUCKET, output_key(r), delete=True) for r in range(REDUCERS)]
            assert pf.list(SHUFFLE_BUCKET) == []
        checks = [describe_partition(r, data) for r, data in enumerate(outputs)]
        input_checksum = sum(m.checksum for m in mapped) % (1 << 64)
        assert sum(m.records for m in mapped) == RECORDS
        assert check_output(config, input_checksum=input_checksum, checks=checks) == []

        # Past a whole lease after the restart the job is still registered: its driver's
        # renewals reached the new instance, which gave the job its lease again.
        time.sleep(LEASE_MS_DEFAULT / 1000.0 + 1.0)
        assert job.job_id in {j["job_id"] for j in local_cluster.control.status()["jobs"]}
        # The keeper's renewals reached the new instance too: the grant did not lapse.
        assert local_cluster.status()["prefix_grants"]["granted_bytes"] == granted_before
        ops_at_check = ops[0]
        assert wait_for(lambda: ops[0] > ops_at_check + 50), ("the task stalled", ops, failures[:3])
        stop.set()
        thread.join(30)
        assert failures == [], failures[:3]
        print(f"controller restarted in {restarted_in_s:.1f} s; a {MAPPERS}x{REDUCERS} shuffle "
              f"of {RECORDS} records completed across it and a task ran {ops[0]} put+get pairs "
              "with no error")

        # The restarted controller registers new jobs.
        with local_cluster.register_job("after-restart") as other:
            with other.connect() as client:
                client.create_bucket("b")
                client.put("b", "k", b"v")
    # ... and deregisters the restored one, freeing its data.
    assert job.job_id not in {j["job_id"] for j in local_cluster.control.status()["jobs"]}
    assert wait_for(lambda: used_bytes(local_cluster) == baseline), (
        used_bytes(local_cluster), baseline
    )


# -- crash windows: a restart slower than a lease, a registration cut by the crash -----------------

SHORT_LEASE_MS = 2000
"""A lease much shorter than the slow restart below, and long enough that renewals every third
of it keep it on a loaded machine (a 1 s lease ran out at load 25)."""
METADATA_STOP_S = 6.0
"""How long the Metadata actor is stopped (SIGSTOP), so that a restarted controller waits for
it: three short leases, well inside the restore's Metadata deadline (30 s)."""
REGISTRATION_WAIT_S = 30.0
"""How long the test waits for the registration cut by the crash (the driver retries it)."""


def _metadata_pid() -> int:
    import ray

    metadata = ray.get_actor(METADATA_ACTOR_NAME, namespace=NAMESPACE)
    return int(ray.get(metadata.log_info.remote(), timeout=30)["pid"])


def _jobs_named(cluster: LocalCluster, name: str) -> list[str]:
    return [j["job_id"] for j in cluster.control.status()["jobs"] if j["job_id"].startswith(
        name + "-")]


def _controller_lock_held(timeout_s: float) -> bool:
    """Whether a call that takes the controller's lock (``jobs``) waits past ``timeout_s``."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        ray.get(controller_actor().jobs.remote(), timeout=timeout_s)
    except GetTimeoutError:
        return True
    return False


def test_a_driver_keeps_its_job_through_a_restart_longer_than_its_lease(
    local_cluster: LocalCluster,
) -> None:
    """Item 4 of issue 29: the restarted controller waits for a stopped Metadata actor for three
    leases, while the driver's renewals fail; its renewal thread goes on, the new instance gives
    the job its lease back with time to renew it, and the job stays registered."""
    from pocketflow.control.restore import RESTORED_LEASE_GRACE_S

    metadata_pid = _metadata_pid()
    with local_cluster.register_job("slow-restart", lease_ms=SHORT_LEASE_MS) as job:
        first_pid = _controller_pid()
        os.kill(metadata_pid, signal.SIGSTOP)
        try:
            os.kill(first_pid, signal.SIGKILL)
            time.sleep(METADATA_STOP_S)
        finally:
            os.kill(metadata_pid, signal.SIGCONT)
        assert wait_for(lambda: _status_or_none(local_cluster) is not None,
                        timeout_s=RESTART_BOUND_S), "the controller did not come back"
        import ray

        restored = ray.get(controller_actor().restored.remote(), timeout=30)
        assert restored is not None and job.job_id in restored["jobs"]
        # Past the restored lease's grace and a few more leases: the driver's renewals reach
        # the new instance, so the job is still registered.
        time.sleep(RESTORED_LEASE_GRACE_S + 3 * SHORT_LEASE_MS / 1000.0)
        assert job.job_id in _jobs_named(local_cluster, "slow-restart"), (
            "the job of a live driver was deregistered after the restart")
    assert _jobs_named(local_cluster, "slow-restart") == []


def test_a_registration_cut_by_a_crash_registers_one_job(local_cluster: LocalCluster) -> None:
    """Item 7 of issue 29: the controller is killed while a registration waits for the Metadata
    actor (stopped); whether or not the Metadata actor then logs the job, the driver's
    registration ends with one job, the one its retry finds or makes, and nothing else."""
    import threading

    name = f"cut-{uuid.uuid4().hex[:6]}"
    metadata_pid = _metadata_pid()
    first_pid = _controller_pid()
    outcome: dict[str, Any] = {}

    def driver() -> None:
        try:
            outcome["job"] = local_cluster.register_job(name, lease_ms=SHORT_LEASE_MS * 2)
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    os.kill(metadata_pid, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=driver, daemon=True)
        thread.start()
        # The registration holds the controller's lock while it waits for the Metadata actor.
        assert wait_for(lambda: _controller_lock_held(1.0), timeout_s=30), (
            "the registration did not reach the controller")
        os.kill(first_pid, signal.SIGKILL)
        time.sleep(1.0)
    finally:
        os.kill(metadata_pid, signal.SIGCONT)
    thread.join(REGISTRATION_WAIT_S + RESTART_BOUND_S)
    assert not thread.is_alive(), "the registration did not end"
    assert "error" not in outcome, outcome.get("error")
    job = outcome["job"]
    try:
        assert _jobs_named(local_cluster, name) == [job.job_id]
        with job.connect() as client:
            client.create_bucket("b")
            client.put("b", "k", b"v")
    finally:
        job.deregister()
    assert _jobs_named(local_cluster, name) == []
