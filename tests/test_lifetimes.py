"""Lifetimes on real servers: PERSIST objects outlive their job and expire after the server's
PERSIST TTL; ``set_cores`` changes a running server's CPU cores and keeps its data."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures_cluster import used_bytes, wait_for
from fixtures_servers import CLIENT_OPTIONS, ServerSet

from pocketflow.auth import admin_token
from pocketflow.client import connect
from pocketflow.cluster import LocalCluster
from pocketflow.errors import BucketNotFound, InvalidRequest, JobNotRegistered, ObjectNotFound
from pocketflow.handle import ServerInfo
from pocketflow.transport import AdminClient

PERSIST_TTL_MS = 4000
"""Long enough for the writes and reads before it to finish on a loaded machine."""
EXPIRY_WAIT_S = 10.0
"""How long the PERSIST data may take to disappear after its TTL (sweeps every 250 ms)."""


def _thread_cpus(pid: int) -> set[str]:
    lists = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                lists.add(line.split(":", 1)[1].strip())
    return lists


def test_persist_objects_outlive_the_job_and_expire_after_the_ttl(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    servers, info = server_factory(
        "persist-0", capacity_bytes=16 * 1024 * 1024, long_running=True,
        persist_ttl_ms=PERSIST_TTL_MS,
    )
    with servers.admin(info.address) as admin:
        stats = admin.stats()
        assert stats["persist_ttl_ms"] == PERSIST_TTL_MS
        baseline = admin.stats()["used_bytes"]
    handle = servers.handle(servers=[info])
    big = bytes(range(256)) * 8192  # 2 MiB: a manifest and data blocks
    with connect(handle, **CLIENT_OPTIONS) as client:
        client.create_bucket("b")
        written = time.monotonic()
        client.put("b", "kept", b"persisted", persist=True)
        client.put("b", "big", big, persist=True)
        client.put("b", "scratch", b"ephemeral")
    servers.delete_job(handle)  # what deregistration does on every server
    with connect(handle, **CLIENT_OPTIONS) as client:
        assert client.get("b", "kept") == b"persisted"
        assert client.get("b", "big") == big
        with pytest.raises(ObjectNotFound):
            client.get("b", "scratch")
    assert time.monotonic() - written < PERSIST_TTL_MS / 1000

    deadline = time.monotonic() + PERSIST_TTL_MS / 1000 + EXPIRY_WAIT_S
    with servers.admin(info.address) as admin:
        while admin.stats()["used_bytes"] != baseline:
            assert time.monotonic() < deadline, "PERSIST data outlived its TTL"
            time.sleep(0.1)
        assert admin.stats()["objects"] == 0
    assert time.monotonic() - written >= PERSIST_TTL_MS / 1000
    with connect(handle, **CLIENT_OPTIONS) as client:
        # The deregistered job's bucket went with its last PERSIST object.
        with pytest.raises(BucketNotFound):
            client.get("b", "kept")


def test_set_cores_limits_a_running_server_and_keeps_its_data(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    servers, info = server_factory("cores-0")
    handle = servers.handle(servers=[info])
    with connect(handle, **CLIENT_OPTIONS) as client:
        client.create_bucket("b")
        client.put("b", "k", b"value")
    pid = servers.process("cores-0").pid
    with servers.admin(info.address) as admin:
        stats = admin.stats()
        cores_max = stats["cores_max"]
        assert stats["cores"] == cores_max
        before = _thread_cpus(pid)
        assert admin.set_cores(1) == {"cores": 1, "cores_max": cores_max}
        limited = _thread_cpus(pid)
        assert len(limited) == 1 and "," not in next(iter(limited))
        assert admin.stats()["cores"] == 1
        with connect(handle, **CLIENT_OPTIONS) as client:
            assert client.get("b", "k") == b"value"
        for bad in (0, cores_max + 1):
            with pytest.raises(InvalidRequest):
                admin.set_cores(bad)
        admin.set_cores(cores_max)
        assert _thread_cpus(pid) == before


def test_deregistration_frees_every_server_to_its_baseline(local_cluster: LocalCluster) -> None:
    baseline = used_bytes(local_cluster)
    with local_cluster.register_job("frees-all") as job:
        # The servers new keys go to: a DRAM job's map also names the long-running NVMe server
        # with weight 0 (the tier its writes overflow to), which these few keys never reach.
        servers = {s.node_id for s in job.handle.servers if s.weight > 0}
        assert servers, job.handle.servers
        with job.connect() as client:
            client.create_bucket("b")
            for i in range(24):
                client.put("b", f"small-{i}", b"s" * 5000)
            client.put("b", "large", bytes(3 * 1024 * 1024 + 17))
        assert wait_for(lambda: all(
            used_bytes(local_cluster)[n] > baseline[n] for n in servers
        )), (used_bytes(local_cluster), baseline, servers)
    assert wait_for(lambda: used_bytes(local_cluster) == baseline), (
        used_bytes(local_cluster), baseline
    )


def test_the_cluster_gives_long_running_servers_a_persist_ttl(local_cluster: LocalCluster) -> None:
    with AdminClient(local_cluster.servers[0].address, _admin_token(local_cluster)) as admin:
        stats = admin.stats()
    assert stats["long_running"] is True
    assert stats["persist_ttl_ms"] == 24 * 3600 * 1000
    for info in local_cluster.servers:
        if not info.long_running:
            with AdminClient(info.address, _admin_token(local_cluster)) as admin:
                assert admin.stats()["persist_ttl_ms"] == 0


def _admin_token(cluster: LocalCluster) -> str:
    return admin_token(cluster.secret, ttl_s=600)


def test_a_straggler_of_a_deregistered_job_cannot_write_and_still_reads_its_persist_data(
    local_cluster: LocalCluster,
) -> None:
    baseline = used_bytes(local_cluster)
    big = bytes(range(256)) * 8192  # 2 MiB: a manifest and data blocks
    with local_cluster.register_job("straggler") as job:
        handle = job.handle
        with job.connect() as client:
            client.create_bucket("b")
            client.put("b", "output", big, persist=True)
            client.put("b", "scratch", b"ephemeral")
    # A task that outlived its job keeps its handle and its (still unexpired) token.
    with connect(handle, **CLIENT_OPTIONS) as straggler:
        for write in (
            lambda: straggler.put("b", "late", b"x"),
            lambda: straggler.put("b", "late-large", big),
            lambda: straggler.put("b", "output", b"x", persist=True, overwrite=True),
            lambda: straggler.create_bucket("c"),
        ):
            with pytest.raises(JobNotRegistered, match="deregistered"):
                write()
        assert straggler.get("b", "output") == big
        with pytest.raises(ObjectNotFound):
            straggler.get("b", "scratch")
        straggler.delete("b", "output")
    # Nothing the straggler tried is left anywhere.
    assert wait_for(lambda: used_bytes(local_cluster) == baseline), (
        used_bytes(local_cluster), baseline
    )
