"""One job must not cost another its reservation (docs/ARCHITECTURE.md, "Bigger than DRAM"),
against real server processes and two real jobs: a job's charge on a server is admitted if it
stays within its share of the job's reservation there, or if the server's free bytes after it
still cover every other job's unused share; otherwise it is ``CapacityExhausted`` naming the
bytes "reserved for other jobs", which the client treats as a full tier (it overflows to the
job's NVMe). The shares travel in the map the controller sends (``set_epoch``'s
``reserved_bytes``, built by :func:`pocketflow.control.epochs.map_with_reservations`)."""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from control_roles import register, roles
from fixtures_servers import CLIENT_OPTIONS, ServerSet

from pocketflow.client import connect
from pocketflow.control.epochs import map_with_reservations
from pocketflow.control.hints import JobDemand
from pocketflow.errors import BucketExists, CapacityExhausted
from pocketflow.handle import JobHandle, ServerInfo

MiB = 1024 * 1024
KiB = 1024
DRAM_BYTES = 8 * MiB
"""The DRAM server's capacity; 1/64 of it is kept for records."""
DATA_ROOM_BYTES = DRAM_BYTES - DRAM_BYTES // 64
NVME_BYTES = 64 * MiB
B_RESERVED_BYTES = 4 * MiB
"""Job B's reservation, all of it on the DRAM server (its weight there is 1)."""
A_RESERVED_BYTES = 1 * MiB
OBJECT_BYTES = 64 * KiB
B_OBJECTS = 60
"""What B writes: 60 objects of 64 KiB (3.75 MiB and their index entries), within its 4 MiB."""

ServerFactory = Callable[..., tuple[ServerSet, ServerInfo]]
TwoJobs = tuple[ServerSet, ServerInfo, ServerInfo, JobHandle, JobHandle]


def payload(seed: int) -> bytes:
    return random.Random(seed).randbytes(OBJECT_BYTES)


def used(servers: ServerSet, job_id: str, info: ServerInfo, field: str = "used_bytes") -> int:
    with servers.admin(info.address) as admin:
        stats = admin.stats()
    return int(stats.get("jobs", {}).get(job_id, {}).get(field, 0))


def job(servers: ServerSet, chosen: list[ServerInfo], reserved_bytes: int) -> JobHandle:
    """A job over ``chosen`` whose map, as the controller sends it, reserves ``reserved_bytes``
    (packed by the weights: all on the DRAM server)."""
    handle = servers.handle(servers=chosen, set_epoch=False)
    demand = JobDemand(throughput_bytes_per_s=0, capacity_bytes=reserved_bytes, tiers=("dram",))
    sent = map_with_reservations(handle, demand)
    assert sent["reserved_bytes"] == {chosen[0].node_id: reserved_bytes}
    for server in chosen:
        with servers.admin(server.address) as admin:
            admin.set_epoch(handle.job_id, handle.epoch, sent)
    return handle


def cluster(factory: ServerFactory) -> tuple[ServerSet, ServerInfo, ServerInfo]:
    """One DRAM server that takes the jobs' data and an NVMe server in their maps with weight 0
    (where a job's writes overflow)."""
    servers, dram = factory("dram-r", "dram", DRAM_BYTES, long_running=True, weight=1.0)
    _, nvme = factory("nvme-r", "nvme", NVME_BYTES, long_running=True, weight=0.0)
    return servers, dram, nvme


@pytest.fixture
def two_jobs(server_factory: ServerFactory) -> TwoJobs:
    """The :func:`cluster`'s servers (set, DRAM, NVMe) and two jobs over both: A reserving
    ``A_RESERVED_BYTES``, B ``B_RESERVED_BYTES``."""
    servers, dram, nvme = cluster(server_factory)
    a = job(servers, [dram, nvme], A_RESERVED_BYTES)
    b = job(servers, [dram, nvme], B_RESERVED_BYTES)
    return servers, dram, nvme, a, b


def test_a_job_beyond_its_reservation_leaves_another_its_whole_reservation(
    two_jobs: TwoJobs,
) -> None:
    servers, dram, nvme, a, b = two_jobs
    a_written = {f"a/{i:03d}": payload(i) for i in range(160)}
    b_written = {f"b/{i:03d}": payload(1000 + i) for i in range(B_OBJECTS)}
    with connect(a, **CLIENT_OPTIONS) as pa, connect(b, **CLIENT_OPTIONS) as pb:
        pa.create_bucket("x")
        pb.create_bucket("x")
        # A writes 10 MiB, far beyond its reservation and the server: every write succeeds,
        # what B's unused reservation keeps off DRAM going on to NVMe.
        assert pa.put_many("x", list(a_written.items())) == len(a_written)
        a_dram = used(servers, a.job_id, dram)
        assert a_dram <= DATA_ROOM_BYTES - B_RESERVED_BYTES, a_dram
        assert a_dram > DATA_ROOM_BYTES - B_RESERVED_BYTES - 2 * OBJECT_BYTES, a_dram
        assert used(servers, a.job_id, nvme) > 4 * MiB
        # B then writes its whole reservation, all of it on DRAM.
        assert pb.put_many("x", list(b_written.items())) == len(b_written)
        assert used(servers, b.job_id, dram, "reserved_bytes") == B_RESERVED_BYTES
        assert used(servers, b.job_id, nvme, "reserved_bytes") == 0
        assert used(servers, b.job_id, nvme) == 0
        assert used(servers, b.job_id, dram) >= B_OBJECTS * OBJECT_BYTES
        # Nothing of either is lost.
        assert pa.get_many("x", list(a_written)) == list(a_written.values())
        assert pb.get_many("x", list(b_written)) == list(b_written.values())
    # B's end releases its reservation and its data: A's next writes fit DRAM again (a new
    # client of A's, which has not seen DRAM refuse it lately).
    servers.delete_job(b)
    more = {f"more/{i:03d}": payload(5000 + i) for i in range(32)}
    before_nvme = used(servers, a.job_id, nvme)
    with connect(a, **CLIENT_OPTIONS) as pa:
        assert pa.put_many("x", list(more.items())) == len(more)
        assert used(servers, a.job_id, nvme) == before_nvme
        assert used(servers, a.job_id, dram) >= a_dram + len(more) * OBJECT_BYTES
        assert pa.get_many("x", list(more)) == list(more.values())
        assert pa.get_many("x", list(a_written)) == list(a_written.values())
    servers.delete_job(a)
    assert used(servers, a.job_id, dram) == 0


def test_the_controller_tells_each_server_its_share_and_ending_a_job_releases_it(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """Through the controller's roles (packing, epochs, job ends; no Ray): a job registered
    with a data size reserves it on the server it was packed on, a job registered without hints
    is refused the rest there, naming that share, and is admitted again once the first ends."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        built.start("rs-0", capacity_bytes=DRAM_BYTES)
        b = register(built, "reserving", {"data_size_bytes": B_RESERVED_BYTES})
        a = register(built, "unhinted")
        assert [s.node_id for s in a.servers] == [s.node_id for s in b.servers] == ["rs-0"]
        with connect(a, **CLIENT_OPTIONS) as pa:
            pa.create_bucket("x")
            with pytest.raises(CapacityExhausted, match=(
                    rf"beyond the {B_RESERVED_BYTES} bytes reserved for other jobs")):
                for i in range(200):
                    pa.put("x", f"k/{i:03d}", payload(i))
        with connect(b, **CLIENT_OPTIONS) as pb:
            pb.create_bucket("x")
            for i in range(B_OBJECTS):
                pb.put("x", f"k/{i:03d}", payload(1000 + i))
        jobs = built.admin.client(b.servers[0].address).stats()["jobs"]
        assert jobs[b.job_id]["reserved_bytes"] == B_RESERVED_BYTES
        assert jobs[a.job_id]["reserved_bytes"] == 0
        with built.lock:
            confirmed, unreachable = built.ends.end(b.job_id, ["rs-0"])
        assert unreachable == [], (confirmed, unreachable)
        with connect(a, **CLIENT_OPTIONS) as pa:
            for i in range(200, 200 + B_OBJECTS):
                pa.put("x", f"k/{i:03d}", payload(i))


def test_a_job_without_another_tier_is_refused_naming_the_others_reservations(
    server_factory: ServerFactory,
) -> None:
    servers, dram, _ = cluster(server_factory)
    b = job(servers, [dram], B_RESERVED_BYTES)
    a = servers.handle(servers=[dram])  # no reservation, as a job registered without hints
    with connect(a, **CLIENT_OPTIONS) as pa:
        pa.create_bucket("x")
        written = 0
        with pytest.raises(CapacityExhausted) as refused:
            for i in range(200):
                pa.put("x", f"k/{i:03d}", payload(i))
                written += 1
        message = str(refused.value)
        assert "reserved for other jobs" in message, message
        # Its figures agree: what is free beyond the others' reservations is less than the
        # request, and both together are what the tier has free for data.
        match = re.search(
            r"(\d+) bytes requested, (\d+) bytes free beyond the (\d+) bytes reserved for other "
            r"jobs \(capacity (\d+) bytes, of which (\d+) kept for records\); this job holds "
            r"(\d+) bytes of its reservation of (\d+) bytes here", message)
        assert match, message
        requested, free, others, capacity, kept, holds, reserved = map(int, match.groups())
        assert (others, capacity, kept, reserved) == (
            B_RESERVED_BYTES, DRAM_BYTES, DRAM_BYTES // 64, 0)
        assert free < requested
        assert holds == used(servers, a.job_id, dram)
        assert capacity - kept - holds - others == free
        # The refused write left nothing; every earlier one reads back.
        assert pa.get_many("x", [f"k/{i:03d}" for i in range(written)]) == [
            payload(i) for i in range(written)]
    with connect(b, **CLIENT_OPTIONS) as pb:
        pb.create_bucket("x")
        for i in range(B_OBJECTS):
            pb.put("x", f"k/{i:03d}", payload(1000 + i))
    servers.delete_job(a)
    servers.delete_job(b)


def test_two_jobs_writing_at_once_leave_the_reserving_one_its_reservation(
    two_jobs: TwoJobs,
) -> None:
    servers, dram, nvme, a, b = two_jobs
    # Three writers of A (11.25 MiB together) against one of B: unguarded, A's writers would
    # fill DRAM before B's got far.
    parts = [(a, {f"a{w}/{i:03d}": payload(100 * w + i) for i in range(60)}) for w in range(3)]
    parts.append((b, {f"b/{i:03d}": payload(1000 + i) for i in range(B_OBJECTS)}))
    start = threading.Barrier(len(parts))
    errors: list[BaseException] = []

    def writer(handle: JobHandle, items: dict[str, bytes]) -> None:
        try:
            with connect(handle, **CLIENT_OPTIONS) as pf:
                try:
                    pf.create_bucket("x")
                except BucketExists:
                    pass
                start.wait(timeout=30)
                for key, data in items.items():
                    pf.put("x", key, data)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=part) for part in parts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    # B's writes all landed on DRAM, in its reservation; A's rest went on to NVMe.
    assert used(servers, b.job_id, nvme) == 0
    assert used(servers, b.job_id, dram) >= B_OBJECTS * OBJECT_BYTES
    assert used(servers, a.job_id, nvme) > 4 * MiB
    for handle, items in parts:
        with connect(handle, **CLIENT_OPTIONS) as pf:
            assert pf.get_many("x", list(items)) == list(items.values())
    servers.delete_job(a)
    servers.delete_job(b)
