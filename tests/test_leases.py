"""Job leases: the pure lease table, and a killed driver's job cleaned up by the controller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from fixtures_cluster import used_bytes, wait_for

from pocketflow.cluster import LocalCluster
from pocketflow.control.leases import LEASE_MS_MIN, LeaseTable, check_lease_ms
from pocketflow.errors import ClusterError, ConfigError, JobNotRegistered

DRIVER_LEASE_MS = 2000
"""The driver renews every third of it; a 1 s lease expired a live driver's job whenever its
renewal thread stalled for 0.7 s on a loaded machine."""
DRIVER_START_TIMEOUT_S = 90.0
"""A driver subprocess joins Ray, registers and writes; joining Ray takes a few seconds."""

CLEANUP_BOUND_S = 10.0
"""Lease (2 s) plus a monitor pass plus deregistration plus fresh statistics, with margin."""


def test_a_lease_runs_out_unless_renewed() -> None:
    table = LeaseTable()
    table.renew("a", lease_ms=1000, now_s=100.0)
    table.renew("b", lease_ms=5000, now_s=100.0)
    assert table.expired(now_s=100.9, limit=10) == []
    assert table.expired(now_s=101.0, limit=10) == ["a"]
    table.renew("a", lease_ms=1000, now_s=100.9)
    assert table.expired(now_s=101.5, limit=10) == []
    assert table.expired(now_s=106.0, limit=10) == ["a", "b"]
    assert table.expired(now_s=106.0, limit=1) == ["a"]  # the longest expired first
    # An expired lease stays until released, so a failed cleanup is retried.
    assert table.expired(now_s=106.0, limit=10) == ["a", "b"]
    table.release("a")
    table.release("unknown")
    assert table.expired(now_s=106.0, limit=10) == ["b"]
    assert table.get("a") is None and len(table) == 1


def test_leases_are_bounded_and_checked() -> None:
    table = LeaseTable(leases_max=2)
    table.renew("a", lease_ms=1000, now_s=0.0)
    table.renew("b", lease_ms=1000, now_s=0.0)
    table.renew("b", lease_ms=2000, now_s=0.0)  # renewing an existing lease is always fine
    with pytest.raises(ConfigError):
        table.renew("c", lease_ms=1000, now_s=0.0)
    for bad in (0, LEASE_MS_MIN - 1, 10**12, 1.5, True, "1s"):
        with pytest.raises(ConfigError):
            check_lease_ms(bad)  # type: ignore[arg-type]


_DRIVER = textwrap.dedent(
    """
    import sys, time
    import pocketflow
    from pocketflow.control.plane import connect_control_plane

    control = connect_control_plane(sys.argv[1])
    job = pocketflow.register_job("dying-driver", cluster=control, lease_ms=int(sys.argv[2]))
    with job.connect() as client:
        client.create_bucket("b")
        for i in range(4):
            client.put("b", f"k{i}", bytes(300_000))
        client.put("b", "small", b"x" * 1000)
    print(job.job_id, flush=True)
    time.sleep(600)
    """
)


def test_the_job_of_a_killed_driver_is_deregistered_and_its_data_freed(
    local_cluster: LocalCluster, tmp_path: Path
) -> None:
    baseline = used_bytes(local_cluster)
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    package_parent = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": package_parent}
    driver = subprocess.Popen(
        [sys.executable, str(script), local_cluster.ray_address, str(DRIVER_LEASE_MS)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
    )
    try:
        deadline = time.monotonic() + DRIVER_START_TIMEOUT_S
        job_id = ""
        assert driver.stdout is not None
        while not job_id and time.monotonic() < deadline and driver.poll() is None:
            job_id = driver.stdout.readline().strip()
        assert job_id, "the driver did not register its job"
        assert any(j["job_id"] == job_id for j in local_cluster.control.status()["jobs"])
        assert wait_for(lambda: sum(used_bytes(local_cluster).values())
                        > sum(baseline.values()) + 1_000_000)
        # Alive drivers keep their job: well past the lease, it is still registered.
        time.sleep(2 * DRIVER_LEASE_MS / 1000)
        assert any(j["job_id"] == job_id for j in local_cluster.control.status()["jobs"])

        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
        killed = time.monotonic()
        assert wait_for(
            lambda: all(j["job_id"] != job_id for j in local_cluster.control.status()["jobs"]),
            timeout_s=CLEANUP_BOUND_S,
        ), "the dead driver's job is still registered"
        assert wait_for(lambda: used_bytes(local_cluster) == baseline,
                        timeout_s=CLEANUP_BOUND_S), (used_bytes(local_cluster), baseline)
        assert time.monotonic() - killed < 2 * CLEANUP_BOUND_S
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=10)



def test_the_renewal_thread_keeps_trying_while_the_controller_is_gone(
    local_cluster: LocalCluster,
) -> None:
    """With its controller unreachable for longer than a lease, a driver's renewal thread goes
    on trying (with backoff) for as long as its job lives, and ends when the job does."""
    import threading

    import ray

    from pocketflow.control.controller import Controller
    from pocketflow.control.metadata import Metadata
    from pocketflow.control.plane import ControlPlane
    from pocketflow.job import RENEW_BACKOFF_MAX_S, _renew_lease

    controller = ray.remote(Controller).options(num_cpus=0).remote(
        secret=local_cluster.secret, metadata=Metadata(),
        block_size_bytes=local_cluster.block_size_bytes, failure_detection=False,
    )
    control = ControlPlane(controller)
    with pytest.raises(JobNotRegistered):
        control.renew_lease("nobody-000000", 300)
    ray.kill(controller, no_restart=True)
    # ray.kill only asks Ray to end the actor: a call made right after it can
    # still reach the live actor, so wait (bounded) for the first ClusterError.
    deadline = time.monotonic() + 30
    while True:
        try:
            control.renew_lease("nobody-000000", 300)
        except JobNotRegistered:
            assert time.monotonic() < deadline, "the killed controller still answers"
            time.sleep(0.05)
            continue
        except ClusterError:
            break
        pytest.fail("renew_lease of an unknown job returned normally")

    stop = threading.Event()
    thread = threading.Thread(target=_renew_lease, args=(control, "j", 300, stop, lambda: None),
                              daemon=True)
    thread.start()
    thread.join(timeout=3 * 0.3 + RENEW_BACKOFF_MAX_S)
    assert thread.is_alive(), "the renewal thread gave up while its job may still live"
    stop.set()
    thread.join(timeout=RENEW_BACKOFF_MAX_S + 10)
    assert not thread.is_alive(), "the renewal thread did not end with its job"


def test_a_bad_lease_is_refused_before_the_job_registers(local_cluster: LocalCluster) -> None:
    import pocketflow

    before = {j["job_id"] for j in local_cluster.control.status()["jobs"]}
    with pytest.raises(ConfigError):
        pocketflow.register_job("bad-lease", cluster=local_cluster, lease_ms=LEASE_MS_MIN - 1)
    with pytest.raises(ConfigError):
        local_cluster.register_job("bad-lease", lease_ms=LEASE_MS_MIN - 1)
    assert {j["job_id"] for j in local_cluster.control.status()["jobs"]} == before
