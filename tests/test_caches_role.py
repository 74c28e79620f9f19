"""The control plane's named caches (``control/caches.py``), built without Ray over real
storage servers: one live job per cache name, its lease, the generation that ended before it,
a shrunk reservation, and finding a cache again after a controller restart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from control_roles import Roles, register, roles

from pocketflow.auth import verify_token
from pocketflow.control.caches import Caches, cache_job_name, check_cache_name
from pocketflow.control.hints import demand_from_hints
from pocketflow.errors import ConfigError, InvalidRequest, JobNotRegistered
from pocketflow.handle import JobHandle

MiB = 1024 * 1024


def _caches(built: Roles, *, grow: Any = None) -> Caches:
    def no_growth(job_id: str, hints: dict[str, Any]) -> JobHandle:
        pytest.fail(f"{job_id} grew on {hints}")

    return Caches(
        built.jobs, built.leases,
        register=lambda name, hints: register(built, name, hints),
        grow=grow or no_growth,
        call_metadata=lambda method, *args: getattr(built.metadata, method)(*args),
        spec=built.allocator.spec,
    )


def test_a_name_has_one_live_job_with_a_lease(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    secret, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        built.start("dram-0", long_running=True)
        caches = _caches(built)
        first = caches.open("inputs", {"data_size_bytes": 4 * MiB}, idle_ms=60_000)
        assert first["created"] and first["predecessor"] is None
        handle = first["handle"]
        assert handle.name == cache_job_name("inputs") == "cache.inputs"
        assert built.leases.get(handle.job_id).lease_ms == 60_000
        again = caches.open("inputs", {}, idle_ms=5_000)
        assert not again["created"] and again["handle"].job_id == handle.job_id
        assert built.leases.get(handle.job_id).lease_ms == 5_000
        assert caches.handle("inputs").job_id == handle.job_id
        other = caches.open("other", {}, idle_ms=5_000)
        assert other["handle"].job_id != handle.job_id
        with pytest.raises(JobNotRegistered):
            caches.handle("never-opened")
        with pytest.raises(ConfigError):
            caches.open("inputs", {}, idle_ms=10)
        for bad in ("", "-x", "a/b", "x" * 91, 7):
            with pytest.raises(InvalidRequest):
                check_cache_name(bad)  # type: ignore[arg-type]

        # The generation ends (its lease ran out and the controller deregistered it): the next
        # open starts a new one and hands over the old one's handle, with a valid token.
        built.jobs.remove(handle.job_id)
        built.leases.release(handle.job_id)
        second = caches.open("inputs", {}, idle_ms=5_000)
        assert second["created"] and second["handle"].job_id != handle.job_id
        predecessor = second["predecessor"]
        assert predecessor.job_id == handle.job_id
        assert predecessor.servers == handle.servers
        verify_token(secret, predecessor.job_id, predecessor.token)
        # It stays the predecessor while this generation lives.
        assert caches.open("inputs", {}, idle_ms=5_000)["predecessor"].job_id == handle.job_id


def test_a_shrink_keeps_the_map_and_reserves_less(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        built.start("dram-0", long_running=True, capacity_bytes=64 * MiB)
        caches = _caches(built)
        handle = caches.open("c", {"data_size_bytes": 32 * MiB}, idle_ms=60_000)["handle"]
        before = built.allocator.dram_free(grants=False)["dram-0"]
        shrunk = caches.resize(handle.job_id, {"data_size_bytes": 8 * MiB})
        assert shrunk.epoch == handle.epoch and shrunk.servers == handle.servers
        record = built.jobs.record(handle.job_id)
        expected = demand_from_hints({"data_size_bytes": 8 * MiB}, built.allocator.spec())
        assert record.demand == expected.to_dict()
        assert built.metadata.get_job(handle.job_id)["demand"] == expected.to_dict()
        assert built.allocator.dram_free(grants=False)["dram-0"] > before
        job = register(built, "plain", {})
        with pytest.raises(InvalidRequest):
            caches.resize(job.job_id, {"data_size_bytes": MiB})


def test_a_restarted_controller_finds_caches_by_their_jobs(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        built.start("dram-0", long_running=True)
        handle = _caches(built).open("kept", {}, idle_ms=60_000)["handle"]
        restarted = _caches(built)  # a new role over the restored job table
        found = restarted.open("kept", {}, idle_ms=60_000)
        assert not found["created"] and found["handle"].job_id == handle.job_id


def test_runs_keep_their_cache_and_the_last_one_ending_starts_its_idle_time(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """A run's lease, not ``idle``, keeps the cache while the run lasts: a driver renewing less
    often than ``idle`` (late on a loaded machine) no longer loses its cache mid-run (the cache
    test with ``idle="1s"`` saw its job deregistered under a live run: every renewal set the
    job's lease to ``idle``). One run ending leaves the cache to the others; the last one
    ending starts the idle time; a run whose lease lapsed (its driver died) holds nothing."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        built.start("dram-0", long_running=True)
        caches = _caches(built)
        idle_ms = 200
        first = caches.open("runs", {}, idle_ms=idle_ms, run_id="r1", run_lease_ms=60_000)
        job_id = first["handle"].job_id
        assert caches.open("runs", {}, idle_ms=idle_ms, run_id="r2",
                           run_lease_ms=60_000)["handle"].job_id == job_id
        assert built.leases.get(job_id).lease_ms == 60_000 + idle_ms
        time.sleep(3 * idle_ms / 1000)
        assert job_id not in built.leases.due(now_s=time.monotonic()), "held by its runs"

        assert caches.end_run(job_id, "r1", idle_ms=idle_ms), "r2 still holds it"
        assert built.leases.get(job_id).lease_ms == 60_000 + idle_ms
        assert not caches.end_run(job_id, "r2", idle_ms=idle_ms)
        assert built.leases.get(job_id).lease_ms == idle_ms
        time.sleep(3 * idle_ms / 1000)
        assert job_id in built.leases.due(now_s=time.monotonic()), "idle after the last run"

        caches.renew_run(job_id, "dead", run_lease_ms=100, idle_ms=idle_ms)
        time.sleep(0.3)
        assert not caches.end_run(job_id, "other", idle_ms=idle_ms), "a lapsed run holds nothing"

        with pytest.raises(JobNotRegistered):
            caches.renew_run("no-such-job", "r", run_lease_ms=1000, idle_ms=idle_ms)
        with pytest.raises(JobNotRegistered):
            caches.end_run("no-such-job", "r", idle_ms=idle_ms)
        plain = register(built, "plain", {})
        with pytest.raises(InvalidRequest):
            caches.renew_run(plain.job_id, "r", run_lease_ms=1000, idle_ms=idle_ms)
        with pytest.raises(ConfigError):
            caches.renew_run(job_id, "r", run_lease_ms=10, idle_ms=idle_ms)
        with pytest.raises(InvalidRequest):
            caches.renew_run(job_id, "", run_lease_ms=1000, idle_ms=idle_ms)
