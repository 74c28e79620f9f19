"""One job must not cost another its reservation (docs/ARCHITECTURE.md, "Bigger than DRAM"),
against real server processes and two real jobs: a job's charge on a server is admitted if it
stays within its share of the job's reservation there, or if the server's free bytes after it
still cover every other job's unused share; otherwise it is ``CapacityExhausted`` naming the
bytes "reserved for other jobs", which the client treats as a full tier (it overflows to the
job's NVMe). The shares travel in the map the controller sends (``set_epoch``'s
``reserved_bytes``, built by :func:`pocketflow.control.epochs.map_with_reservations`)."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from control_roles import (
    FAN_OUT_BOUND_S,
    Roles,
    register,
    retry_until_confirmed,
    roles,
    sigstop,
)
from fixtures_servers import CLIENT_OPTIONS, ServerSet

from pocketflow.client import connect
from pocketflow.control.epochs import map_with_reservations
from pocketflow.control.hints import JobDemand
from pocketflow.control.metadata import Metadata
from pocketflow.control.restore import InitData, RestoredNode, restore
from pocketflow.errors import BucketExists, CapacityExhausted, StaleEpoch
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


DROPPED_OBJECTS = 100
"""What the unhinted job writes on the server the reserving job left: 6.25 MiB, more than the
server's data room less the reserving job's share (about 3.9 MiB)."""
B_KEPT_OBJECTS = 8
"""What the reserving job writes on ``rs-0`` before it leaves it (512 KiB): it stays there (a map
that no longer names the server no longer reads it) until the job's end frees it."""


def reserving_beside_unhinted(built: Roles) -> tuple[JobHandle, JobHandle]:
    """On server ``rs-0`` (started here, the only one so far): a job reserving
    ``B_RESERVED_BYTES`` there, which writes ``B_KEPT_OBJECTS`` in bucket ``x``, and one
    registered without hints (no share)."""
    rs0 = built.start("rs-0", capacity_bytes=DRAM_BYTES)
    b = register(built, "reserving", {"data_size_bytes": B_RESERVED_BYTES})
    a = register(built, "unhinted")
    assert [s.node_id for s in a.servers] == [s.node_id for s in b.servers] == ["rs-0"]
    with connect(b, **CLIENT_OPTIONS) as pb:
        pb.create_bucket("x")
        for i in range(B_KEPT_OBJECTS):
            pb.put("x", f"kept/{i}", payload(2000 + i))
    assert shares(built, rs0.address, b.job_id) == B_RESERVED_BYTES
    return a, b


def shares(built: Roles, address: str, job_id: str, field: str = "reserved_bytes") -> int:
    """``job_id``'s share of its reservation (or another ``field`` of its usage) on the server
    at ``address``, as it reports it (its stats list every job with a bucket or a share
    there)."""
    jobs = built.admin.client(address).stats().get("jobs", {})
    return int(jobs.get(job_id, {}).get(field, 0))


def write_into_the_room_left(built: Roles, a: JobHandle, b: JobHandle) -> None:
    """The reserving job ``b`` left ``rs-0``: ``a`` writes ``DROPPED_OBJECTS`` there (room its
    share kept free while ``rs-0`` held it), a stale ``set_epoch`` of ``b``'s first map (naming
    its share there) cannot bring the share back, and ``b``'s end, sent to every live server
    as ``deregister_job`` sends it, frees what ``b`` left there."""
    rs0 = a.servers[0].address
    assert shares(built, rs0, b.job_id) == 0
    with connect(a, **CLIENT_OPTIONS) as pa:
        pa.create_bucket("x")
        written = {f"k/{i:03d}": payload(i) for i in range(DROPPED_OBJECTS)}
        for key, data in written.items():
            pa.put("x", key, data)
        assert pa.get_many("x", list(written)) == list(written.values())
    first = map_with_reservations(b, JobDemand(
        throughput_bytes_per_s=0, capacity_bytes=B_RESERVED_BYTES, tiers=("dram",)))
    assert first["reserved_bytes"] == {"rs-0": B_RESERVED_BYTES}
    with pytest.raises(StaleEpoch):
        built.admin.client(rs0).set_epoch(b.job_id, b.epoch, first)
    assert shares(built, rs0, b.job_id) == 0
    assert shares(built, rs0, b.job_id, "used_bytes") >= B_KEPT_OBJECTS * OBJECT_BYTES
    with built.lock:
        built.jobs.remove(b.job_id)
        targets = sorted(built.membership.ids())
    confirmed, unreachable = built.ends.end(b.job_id, targets)
    assert (sorted(n for n, _ in confirmed), unreachable) == (["rs-0", "rs-1"], [])
    assert b.job_id not in built.admin.client(rs0).stats().get("jobs", {})


def test_a_server_a_job_moved_off_gives_up_the_jobs_share(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """Through the controller's roles (no Ray): a job moved off a live server altogether
    (``exclude`` without ``keep_readable``, which production reaches only for a server that
    left the cluster: this tests the safety net of ``Epochs.move``'s ``left``) no longer holds
    its share there, so a job without one may write into that room; its share goes with it to
    the server it moved to."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        a, b = reserving_beside_unhinted(built)
        rs1 = built.start("rs-1", capacity_bytes=DRAM_BYTES)
        with built.lock:
            built.epochs.exclude(b.job_id, "rs-0")
        moved = built.jobs.record(b.job_id).handle
        assert [s.node_id for s in moved.servers] == ["rs-1"]
        assert built.epochs.unconfirmed() == {}
        # rs-1 lists the job's share in its stats although the job has no bucket there yet.
        assert shares(built, rs1.address, b.job_id) == B_RESERVED_BYTES
        write_into_the_room_left(built, a, b)


def test_a_hung_server_a_job_moved_off_does_not_hold_up_the_move_and_learns_it_later(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """The server a job moves off is hung (SIGSTOP): the move returns within one admin
    deadline, the server stays unconfirmed (though the new map does not name it) until the
    monitor's retries reach it once it runs again, and then gives up the job's share."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        a, b = reserving_beside_unhinted(built)
        built.start("rs-1", capacity_bytes=DRAM_BYTES)
        rs0 = built.membership.get("rs-0")
        pid = rs0.server_pid
        sigstop(pid)
        try:
            started = time.monotonic()
            with built.lock:
                built.epochs.exclude(b.job_id, "rs-0")
            moved_s = time.monotonic() - started
            assert moved_s < FAN_OUT_BOUND_S, f"the move waited {moved_s:.1f}s on rs-0"
            assert built.epochs.unconfirmed() == {b.job_id: ["rs-0"]}
            # A second move while it hangs: the retry carries the newest map.
            with built.lock:
                latest = built.epochs.move(b.job_id, built.jobs.record(b.job_id).handle.servers)
        finally:
            os.kill(pid, signal.SIGCONT)
        retry_until_confirmed(built, "rs-0 never learnt the job left it")
        # The retry carried the newest map: rs-0 holds its epoch, so the one before is stale.
        with pytest.raises(StaleEpoch):
            built.admin.client(rs0.address).set_epoch(
                b.job_id, latest.epoch - 1, map_with_reservations(latest, JobDemand(
                    throughput_bytes_per_s=0, capacity_bytes=B_RESERVED_BYTES,
                    tiers=("dram",))))
        write_into_the_room_left(built, a, b)


def test_a_restarted_controller_tells_a_server_only_an_earlier_map_named_that_the_job_left(
    cluster_secret_file: tuple[bytes, Path], tmp_path: Path
) -> None:
    """The controller crashes while the server a job moved off has not confirmed the move
    (it hung, SIGSTOP, and runs again): the restarted roles, which know only the log, find the
    server among the job's earlier maps and tell it the job's current map, so it gives up the
    share."""
    _, secret_file = cluster_secret_file
    metadata = Metadata(tmp_path / "metadata.log")
    with roles(secret_file, metadata=metadata) as before:
        a, b = reserving_beside_unhinted(before)
        before.start("rs-1", capacity_bytes=DRAM_BYTES)
        infos = [before.membership.get(n) for n in ("rs-0", "rs-1")]
        sigstop(infos[0].server_pid)
        try:
            with before.lock:
                before.epochs.exclude(b.job_id, "rs-0")
            assert before.epochs.unconfirmed() == {b.job_id: ["rs-0"]}
        finally:
            os.kill(infos[0].server_pid, signal.SIGCONT)
        init = InitData(
            nodes=[RestoredNode(info, node, True, node.stats())
                   for info, node in zip(infos, before.started, strict=True)],
            jobs=metadata.jobs(),
        )
        with roles(secret_file, metadata=metadata) as after:
            with after.lock:
                restore(init, membership=after.membership, jobs=after.jobs,
                        leases=after.leases, routes=after.routes, epochs=after.epochs,
                        ends=after.ends, add_server=after.membership.add)
            assert "rs-0" in after.epochs.unconfirmed()[b.job_id]
            retry_until_confirmed(after, "rs-0 never learnt the job left it")
            write_into_the_room_left(after, a, b)


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
    # The server counted the refusal under "reserved", to A, and lists B (a share, no bucket).
    with servers.admin(dram.address) as admin:
        stats = admin.stats()
    refusals = stats["jobs"][a.job_id]["capacity_refusals"]
    assert refusals["reserved"] >= 1, refusals
    assert refusals == stats["capacity_refusals"]
    assert sum(refusals.values()) == refusals["reserved"]
    assert stats["jobs"][b.job_id]["reserved_bytes"] == B_RESERVED_BYTES
    assert stats["jobs"][b.job_id]["used_bytes"] == 0
    assert sum(stats["jobs"][b.job_id]["capacity_refusals"].values()) == 0
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


def test_a_drain_leaves_the_reserving_job_at_weight_0_and_its_share_there_at_0(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """Through a drain, as production moves jobs (no Ray): the reserving job moves to weight 0
    on the drained server (its map still names it, so what it wrote there stays readable), and
    the map it is sent there names no share for it (``map_with_reservations`` leaves out zero
    capacities), so the server reports its share 0. The job without a share holds the drain
    with its queue there (its map stays; the server is not told to drain yet) and writes into
    the room the share kept, more than the server could take while the share held."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        a, b = reserving_beside_unhinted(built)
        built.start("rs-1", capacity_bytes=DRAM_BYTES)
        rs0 = a.servers[0].address
        with connect(a, **CLIENT_OPTIONS) as pa:
            pa.create_bucket("x")
            queue = pa.queue("x", "held", max_items=8)
            queue.enqueue(b"held")
            with built.lock:
                result = built.drainer.drain("rs-0")
            assert result["holding_channels"] == [a.job_id], result
            assert built.admin.client(rs0).stats()["draining"] is False
            assert built.jobs.record(a.job_id).handle == a
            moved = built.jobs.record(b.job_id).handle
            weights = {s.node_id: s.weight for s in moved.servers}
            assert weights == {"rs-0": 0.0, "rs-1": pytest.approx(1.0)}, weights
            assert built.epochs.unconfirmed() == {}
            assert shares(built, rs0, b.job_id) == 0
            assert shares(built, rs0, b.job_id, "used_bytes") >= B_KEPT_OBJECTS * OBJECT_BYTES
            written = {f"k/{i:03d}": payload(i) for i in range(DROPPED_OBJECTS)}
            for key, data in written.items():
                pa.put("x", key, data)
            assert pa.get_many("x", list(written)) == list(written.values())
            assert queue.dequeue() == b"held"
        with connect(moved, **CLIENT_OPTIONS) as pb:
            kept = [f"kept/{i}" for i in range(B_KEPT_OBJECTS)]
            assert pb.get_many("x", kept) == [payload(2000 + i) for i in range(B_KEPT_OBJECTS)]
