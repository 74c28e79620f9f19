"""Data bigger than a job's DRAM goes on to its NVMe (docs/ARCHITECTURE.md, "Bigger than DRAM"),
against real server processes: a write a full server refuses is placed again without it, its
manifest stays at its home (which keeps a reserve for records) and names what its blocks
skipped, and every read path, DELETE claim, listing, wait and write-once check finds the object
as before. ``CapacityExhausted`` comes only when no server of the job has room, and its message
names every server's limit with figures that agree."""

from __future__ import annotations

import io
import random
import re
from collections.abc import Callable

import pytest
from fixtures_servers import CLIENT_OPTIONS, ServerSet

from pocketflow.client import connect
from pocketflow.errors import CapacityExhausted, ObjectExists, ObjectNotFound
from pocketflow.handle import ServerInfo
from pocketflow.protocol import SMALL_OBJECT_MAX_BYTES

MiB = 1024 * 1024
KiB = 1024
DRAM_BYTES = 8 * MiB
"""Each DRAM server's capacity: the job writes about five times both."""
NVME_BYTES = 96 * MiB
RESERVE_DIVISOR = 64
"""A tier keeps 1/64 of its capacity for records (servers/crates/store/src/capacity.rs)."""

ServerFactory = Callable[..., tuple[ServerSet, ServerInfo]]


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def used(servers: ServerSet, job_id: str, info: ServerInfo) -> int:
    with servers.admin(info.address) as admin:
        stats = admin.stats()
    return int(stats.get("jobs", {}).get(job_id, {}).get("used_bytes", 0))


def tiers(factory: ServerFactory) -> tuple[ServerSet, list[ServerInfo]]:
    """Two small DRAM servers that take the job's data, and an NVMe server in its map with
    weight 0, as the controller packs a job whose hints fit DRAM; all long-running but one."""
    servers, dram_0 = factory("dram-a", "dram", DRAM_BYTES, long_running=True, weight=0.5)
    _, dram_1 = factory("dram-b", "dram", DRAM_BYTES, weight=0.5)
    _, nvme = factory("nvme-a", "nvme", NVME_BYTES, long_running=True, weight=0.0)
    return servers, [dram_0, dram_1, nvme]


def test_a_job_bigger_than_its_dram_goes_on_to_nvme_and_reads_back(
    server_factory: ServerFactory,
) -> None:
    servers, (dram_0, dram_1, nvme) = tiers(server_factory)
    handle = servers.handle()
    small = {f"small/{i:03d}": payload(40 * KiB + i, i) for i in range(150)}
    one_block = {f"one/{i:03d}": payload(700 * KiB + i, 1000 + i) for i in range(30)}
    striped = {f"striped/{i}": payload(3 * MiB + 7 * i, 2000 + i) for i in range(4)}
    persisted = {f"out/{i}": payload(2 * MiB + i, 3000 + i) for i in range(4)}
    written = {**small, **one_block, **striped}
    total = sum(map(len, written.values())) + sum(map(len, persisted.values()))
    assert total > 2.5 * (2 * DRAM_BYTES)
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        # put_many (small and large), put, and PERSIST: all succeed although DRAM is full.
        assert pf.put_many("b", list(small.items())) == len(small)
        assert pf.put_many("b", list(one_block.items())) == len(one_block)
        for key, data in striped.items():
            pf.put("b", key, data)
        for key, data in persisted.items():
            pf.put("b", key, data, persist=True)
        everything = {**written, **persisted}
        # Most bytes are on NVMe; DRAM is full up to about its reserve for records.
        on = {s.node_id: used(servers, handle.job_id, s) for s in (dram_0, dram_1, nvme)}
        assert on["nvme-a"] > total / 2, on
        for dram in ("dram-a", "dram-b"):
            assert on[dram] > DRAM_BYTES * 0.8, on
        # Every read path finds every object whole.
        assert pf.get_many("b", list(everything)) == list(everything.values())
        for key, data in everything.items():
            assert pf.get("b", key) == data, key
            assert pf.lookup("b", key).size == len(data)
        key, data = "striped/2", striped["striped/2"]
        assert pf.get_range("b", key, MiB - 5, 2 * MiB) == data[MiB - 5:3 * MiB - 5]
        with pf.open("b", key) as reader:
            reader.seek(2 * MiB + 3)
            assert reader.read(100) == data[2 * MiB + 3:2 * MiB + 103]
        into = bytearray(len(one_block["one/007"]))
        assert pf.get_into("b", "one/007", into) == len(into)
        assert bytes(into) == one_block["one/007"]
        # Listings name every key once; a waiter finds overflowed keys at once.
        assert sorted(info.key for info in pf.list("b")) == sorted(everything)
        assert pf.wait_for("b", list(one_block), timeout_s=0.0) == []
        assert pf.lookup("b", "out/1").persist
        # Write-once holds for overflowed keys.
        for key in ("small/001", "one/001", "striped/1", "out/1"):
            with pytest.raises(ObjectExists):
                pf.put("b", key, b"second writer")
        # DELETE-on-read: exactly one reader gets it, its blocks are freed.
        assert pf.get("b", "one/003", delete=True) == one_block["one/003"]
        with pytest.raises(ObjectNotFound):
            pf.get("b", "one/003")
        # Overwrite and delete free the overflowed versions' blocks.
        pf.put("b", "striped/0", b"small now", overwrite=True)
        assert pf.get("b", "striped/0") == b"small now"
        for key in [k for k in everything if k not in ("one/003",)]:
            pf.delete("b", key)
        assert pf.list("b") == []
        left = {s.node_id: used(servers, handle.job_id, s) for s in (dram_0, dram_1, nvme)}
        assert all(v == 0 for v in left.values()), left
    servers.delete_job(handle)


def test_a_streamed_upload_goes_on_to_nvme_when_dram_fills(server_factory: ServerFactory) -> None:
    servers, (dram_0, dram_1, nvme) = tiers(server_factory)
    handle = servers.handle()
    data = payload(3 * DRAM_BYTES, 7)
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        with pf.open("b", "stream", "wb") as writer:
            for at in range(0, len(data), 300 * KiB):
                writer.write(data[at:at + 300 * KiB])
        assert pf.get("b", "stream") == data
        assert used(servers, handle.job_id, nvme) > DRAM_BYTES
        assert pf.get("b", "stream", delete=True) == data
        assert all(used(servers, handle.job_id, s) == 0 for s in (dram_0, dram_1, nvme))
    servers.delete_job(handle)


def _numbers(text: str, pattern: str) -> list[int]:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in {text!r}"
    return [int(g) for g in match.groups()]


def test_capacity_exhausted_comes_only_when_every_server_is_full_and_says_why(
    server_factory: ServerFactory,
) -> None:
    servers, (dram_0, dram_1, nvme) = tiers(server_factory)
    handle = servers.handle()
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        stored = 0
        with pytest.raises(CapacityExhausted) as full:
            for i in range(200):
                pf.put("b", f"fill/{i}", payload(2 * MiB, i))
                stored += 1
        # Every server took its share before the job's tiers were full.
        assert stored * 2 * MiB > NVME_BYTES + DRAM_BYTES
        message = str(full.value)
        assert "no server of the job has room for b/fill/" in message
        for node_id in ("dram-a", "dram-b", "nvme-a"):
            assert f"{node_id}: capacity_exhausted: " in message, message
        # The figures of each refusal agree: what was asked is more than what is free under
        # the limit named, and the capacity and reserve are the server's.
        for part in message.split("; ")[1:] if "; " in message else []:
            if "free for data" in part:
                requested, free, capacity, reserve = _numbers(
                    part, r"(\d+) bytes requested, (\d+) bytes free for data \(capacity (\d+) "
                    r"bytes, of which (\d+) kept for records\)")
                assert requested > free
                assert capacity in (DRAM_BYTES, NVME_BYTES)
                assert reserve == capacity // RESERVE_DIVISOR
            elif "no free extent" in part:
                requested, free, largest = _numbers(
                    part, r"no free extent of (\d+) bytes: (\d+) bytes free in pieces, the "
                    r"largest (\d+) bytes")
                assert largest < requested
        # Freed space is used again.
        pf.delete("b", "fill/0")
        pf.put("b", "after", payload(MiB, 99))
        assert pf.get("b", "after") == payload(MiB, 99)
    servers.delete_job(handle)


def test_a_full_server_alone_says_which_limit_it_hit(server_factory: ServerFactory) -> None:
    servers, only = server_factory("alone-0", "dram", 4 * MiB, long_running=True)
    handle = servers.handle()
    reserve = 4 * MiB // RESERVE_DIVISOR
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        # Small objects fill the tier up to its reserve for records.
        count = 0
        with pytest.raises(CapacityExhausted) as full:
            for i in range(200):
                pf.put("b", f"s{i:03d}", payload(SMALL_OBJECT_MAX_BYTES - 100, i))
                count += 1
        message = str(full.value)
        requested, free, capacity, kept = _numbers(
            message, r"(\d+) bytes requested, (\d+) bytes free for data \(capacity (\d+) bytes, "
            r"of which (\d+) kept for records\)")
        assert (capacity, kept) == (4 * MiB, reserve) and requested > free
        assert "alone-0" in message
        # Holes of one small object each: a 1 MiB block finds room but no extent that large.
        for i in range(0, count, 2):
            pf.delete("b", f"s{i:03d}")
        with pytest.raises(CapacityExhausted) as fragmented:
            pf.put("b", "big", payload(MiB, 1))
        requested, free, largest = _numbers(
            str(fragmented.value), r"no free extent of (\d+) bytes: (\d+) bytes free in "
            r"pieces, the largest (\d+) bytes")
        assert free >= requested > largest
    servers.delete_job(handle)


def test_overflowed_objects_survive_a_job_reading_them_through_the_flight_path(
    server_factory: ServerFactory,
) -> None:
    # The same reads over DoExchange and DoGet (small_ops="flight"), which carry the manifest's
    # list of skipped servers in the exchange GET's reply.
    servers, (dram_0, dram_1, nvme) = tiers(server_factory)
    handle = servers.handle()
    data = {f"k{i}": payload(900 * KiB, i) for i in range(40)}
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        pf.put_many("b", list(data.items()))
    assert used(servers, handle.job_id, nvme) > 0
    with connect(handle, small_ops="flight", **CLIENT_OPTIONS) as flight:
        assert flight.get_many("b", list(data)) == list(data.values())
        buffer = io.BytesIO()
        with flight.open("b", "k3") as reader:
            buffer.write(reader.read())
        assert buffer.getvalue() == data["k3"]
    servers.delete_job(handle)
