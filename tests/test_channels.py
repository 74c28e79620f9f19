"""FIFO queues and shared append files on real storage servers: exactly-once dequeue under
concurrent consumers, bounds and blocking waits, whole appends from many writers, and channels
that outgrow one server."""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Callable

import pytest

from pocketflow import _core
from pocketflow.client import Client, connect
from pocketflow.errors import BucketNotFound, InvalidRequest, QueueFull
from pocketflow.handle import JobHandle
from pocketflow.placement import Placement
from pocketflow.protocol import (
    FRAME_MAX_BYTES,
    HEADER_STRUCT,
    OP_READ_APPEND,
    SMALL_OBJECT_MAX_BYTES,
)
from tests.fixtures_servers import CLIENT_OPTIONS, ServerSet

CONSUMERS = 16
PRODUCERS = 4
ITEMS_PER_PRODUCER = 250
WRITERS = 16
RECORDS_PER_WRITER = 60


def _run_threads(targets: list[Callable[[], None]], timeout_s: float) -> None:
    errors: list[BaseException] = []

    def guard(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=guard, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in time"
    assert not errors, errors[0]


def test_each_item_is_dequeued_exactly_once_by_16_concurrent_consumers(
    job_handle: JobHandle, client: Client
) -> None:
    client.create_bucket("q")
    got: list[list[bytes]] = [[] for _ in range(CONSUMERS)]
    producers_done = threading.Event()

    def producer(p: int) -> Callable[[], None]:
        def run() -> None:
            with connect(job_handle, **CLIENT_OPTIONS) as pf:
                queue = pf.queue("q", "stage/work", max_items=100)
                for i in range(ITEMS_PER_PRODUCER):
                    queue.enqueue(b"%d-%06d" % (p, i), timeout_s=20)
        return run

    def consumer(c: int) -> Callable[[], None]:
        def run() -> None:
            with connect(job_handle, **CLIENT_OPTIONS) as pf:
                queue = pf.queue("q", "stage/work", max_items=100)
                while True:
                    item = queue.dequeue(timeout_s=0.5)
                    if item is not None:
                        got[c].append(item)
                    elif producers_done.is_set():
                        return
        return run

    consumers = [consumer(c) for c in range(CONSUMERS)]
    threads = [threading.Thread(target=t, daemon=True) for t in consumers]
    for thread in threads:
        thread.start()
    _run_threads([producer(p) for p in range(PRODUCERS)], timeout_s=60)
    producers_done.set()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    everything = [item for items in got for item in items]
    expected = {b"%d-%06d" % (p, i) for p in range(PRODUCERS) for i in range(ITEMS_PER_PRODUCER)}
    assert len(everything) == len(expected), "an item was lost or delivered twice"
    assert set(everything) == expected
    assert sum(1 for items in got if items) > 1, "the consumers did not share the work"
    # Per producer, each consumer saw that producer's items in order (FIFO).
    for items in got:
        for p in range(PRODUCERS):
            mine = [item for item in items if item.startswith(b"%d-" % p)]
            assert mine == sorted(mine)
    assert len(client.queue("q", "stage/work")) == 0


def test_a_full_queue_refuses_or_waits_for_room(client: Client) -> None:
    client.create_bucket("q")
    queue = client.queue("q", "bounded", max_items=2)
    queue.enqueue(b"a")
    queue.enqueue(b"b")
    assert len(queue) == 2
    started = time.monotonic()
    with pytest.raises(QueueFull):
        queue.enqueue(b"c")
    with pytest.raises(QueueFull):
        queue.enqueue(b"c", timeout_s=0.3)
    assert time.monotonic() - started >= 0.3

    def make_room() -> None:
        time.sleep(0.3)
        assert client.queue("q", "bounded", max_items=2).dequeue() == b"a"

    helper = threading.Thread(target=make_room)
    helper.start()
    queue.enqueue(b"c", timeout_s=10)  # parked until the dequeue makes room
    helper.join(10)
    assert [queue.dequeue(), queue.dequeue(), queue.dequeue()] == [b"b", b"c", None]


def test_a_blocking_dequeue_wakes_on_the_enqueue_and_times_out_with_none(
    client: Client,
) -> None:
    client.create_bucket("q")
    queue = client.queue("q", "wake", max_items=8)
    started = time.monotonic()
    assert queue.dequeue(timeout_s=0.3) is None
    assert time.monotonic() - started >= 0.3
    result: list[bytes | None] = []
    waiter = threading.Thread(target=lambda: result.append(queue.dequeue(timeout_s=20)))
    started = time.monotonic()
    waiter.start()
    time.sleep(0.3)
    client.queue("q", "wake", max_items=8).enqueue(b"x" * SMALL_OBJECT_MAX_BYTES)
    waiter.join(20)
    assert result == [b"x" * SMALL_OBJECT_MAX_BYTES]
    assert time.monotonic() - started < 10, "the dequeue was not woken by the enqueue"


def test_queue_errors_are_typed(client: Client) -> None:
    with pytest.raises(InvalidRequest):
        client.queue("q", "n", max_items=0)
    with pytest.raises(BucketNotFound):
        client.queue("no-such-bucket", "n").enqueue(b"x")
    client.create_bucket("q")
    with pytest.raises(InvalidRequest):
        client.queue("q", "n").enqueue(b"x" * (SMALL_OBJECT_MAX_BYTES + 1))
    with pytest.raises(InvalidRequest):
        client.append_file("q", "f").append(b"")


def test_a_queue_and_a_file_are_freed_with_their_prefix(client: Client) -> None:
    client.create_bucket("q")
    queue = client.queue("q", "map/7/q", max_items=8)
    queue.enqueue(b"one")
    log = client.append_file("q", "map/7/log")
    log.append(b"record")
    client.delete_prefix("q", "map/7/")
    assert queue.dequeue() is None
    assert list(log) == []


def test_a_queue_spans_servers_when_one_cannot_hold_it(server_factory) -> None:
    servers, _ = server_factory("small-0", "dram", 4 * 1024 * 1024)
    server_factory("small-1", "dram", 4 * 1024 * 1024)
    server_factory("small-2", "dram", 4 * 1024 * 1024)
    handle = servers.handle()
    item_bytes = 60 * 1024
    count = 150  # ~9 MiB: more than two of the servers hold
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("q")
        queue = pf.queue("q", "big", max_items=1000)
        for i in range(count):
            queue.enqueue(struct.pack("<I", i) * (item_bytes // 4))
        assert len(queue) == count
        used = {pf._view.placement.server_for(b"big", s).node_id
                for s in range(queue._tail + 1)}
        assert queue._tail > 0 and len(used) > 1, "the queue never left its first server"
        fresh = pf.queue("q", "big", max_items=1000)
        for i in range(count):
            item = fresh.dequeue(timeout_s=5)
            assert item is not None and struct.unpack_from("<I", item)[0] == i
        assert fresh.dequeue() is None


def _record(writer: int, seq: int) -> bytes:
    body = bytes([writer]) * (100 + (writer * 37 + seq * 101) % 1900)
    head = struct.pack("<HI", writer, seq)
    return head + body + hashlib.sha256(head + body).digest()


def _check_record(record: bytes) -> tuple[int, int]:
    writer, seq = struct.unpack_from("<HI", record)
    assert hashlib.sha256(record[:-32]).digest() == record[-32:], "torn or interleaved record"
    assert record == _record(writer, seq)
    return writer, seq


def test_appends_of_16_writers_are_whole_and_the_file_grows_over_servers(
    job_handle: JobHandle, client: Client
) -> None:
    client.create_bucket("f")
    segment_bytes = SMALL_OBJECT_MAX_BYTES  # the smallest segment, so the file spans many

    def writer(w: int) -> Callable[[], None]:
        def run() -> None:
            with connect(job_handle, **CLIENT_OPTIONS) as pf:
                log = pf.append_file("f", "reduce/0", segment_bytes=segment_bytes)
                for seq in range(RECORDS_PER_WRITER):
                    log.append(_record(w, seq))
        return run

    _run_threads([writer(w) for w in range(WRITERS)], timeout_s=120)
    log = client.append_file("f", "reduce/0", segment_bytes=segment_bytes)
    records = list(log)
    seen = [_check_record(r) for r in records]
    assert len(seen) == WRITERS * RECORDS_PER_WRITER
    assert set(seen) == {(w, s) for w in range(WRITERS) for s in range(RECORDS_PER_WRITER)}
    for w in range(WRITERS):  # each writer's records in its append order
        assert [s for ww, s in seen if ww == w] == list(range(RECORDS_PER_WRITER))
    whole = b"".join(records)
    assert log.size() == len(whole)
    assert log.read(0, len(whole) + 10) == whole
    assert log.read(12_345, 200_000) == whole[12_345:212_345]
    segments = len(whole) // segment_bytes + 1
    servers = {client._view.placement.server_for(b"reduce/0", s).node_id for s in range(segments)}
    assert len(servers) > 1, "the file never left its first server"


def test_append_many_pipelines_whole_records_over_segments(client: Client) -> None:
    client.create_bucket("f")
    log = client.append_file("f", "many", segment_bytes=SMALL_OBJECT_MAX_BYTES)
    records = [_record(w, s) for w in range(4) for s in range(40)]  # ~170 KB: several segments
    positions = log.append_many(records)
    assert len(positions) == len(records)
    assert len({p.segment for p in positions}) > 1
    assert len(set(positions)) == len(positions)
    got = list(log)
    assert sorted(got) == sorted(records)
    for record in got:
        _check_record(record)
    assert log.read(0, log.size()) == b"".join(got)


def _grown_from_two(storage_servers: ServerSet) -> tuple[JobHandle, JobHandle, str]:
    """A job's handle on two of the session's servers, the handle of its map grown to all
    three (epoch 2, told to no server yet), and a channel name whose segment 0 the grown map
    places on the added server."""
    two = [s for s in storage_servers.infos if s.node_id != "nvme-0"]
    handle = storage_servers.handle(servers=two)
    grown = handle.with_weight_map(
        {"epoch": 2, "servers": [s.to_row() for s in storage_servers.infos]})
    placement = Placement.of_handle(grown)
    name = next(n for n in (f"channel-{i}" for i in range(1000))
                if placement.server_for(n.encode(), 0).node_id == "nvme-0")
    return handle, grown, name


@pytest.mark.parametrize("session_before", [False, True], ids=["new-session", "pooled-session"])
def test_append_many_adopts_a_new_map_and_makes_the_bucket_on_the_added_server(
    storage_servers: ServerSet, session_before: bool
) -> None:
    # The job grows from two servers to three while the writer still holds the map of two, and
    # the file is named so that its segment 0 lands, under the grown map, on the added server,
    # which has never seen the bucket. One append_many is then refused as stale (when its session
    # opens, or, over a session pooled before the change, frame by frame), adopts the new map,
    # is refused there with bucket_not_found, makes the bucket and runs again: all inside the
    # native core. Its records fill more than one request frame, and each must land once.
    handle, grown, name = _grown_from_two(storage_servers)
    records = [bytes([i]) * SMALL_OBJECT_MAX_BYTES for i in range(140)]
    assert sum(map(len, records)) > FRAME_MAX_BYTES
    try:
        with connect(handle, **CLIENT_OPTIONS) as pf, connect(handle, **CLIENT_OPTIONS) as old:
            pf.create_bucket("b")
            log = pf.append_file("b", name, segment_bytes=16 * 1024 * 1024)
            if session_before:
                # A session to the segment's home under the map of two, pooled for the batch.
                assert log.size() == 0
            storage_servers.set_epoch(grown)
            positions = log.append_many(records)
            assert pf.handle.epoch == 2
            assert {p.segment for p in positions} == {0}
            # Every record once, back to back: none ran twice, none was lost.
            spans = sorted((p.offset, len(r)) for p, r in zip(positions, records, strict=True))
            assert [offset for offset, _ in spans] == [
                sum(n for _, n in spans[:i]) for i in range(len(spans))]
            total = sum(map(len, records))
            assert log.size() == total
            assert sorted(log) == sorted(records)
            in_file = [r for _, r in sorted(zip(positions, records, strict=True))]
            # A reader still on the map of two adopts the new one and finds the same bytes.
            assert old.append_file("b", name).read(0, total) == b"".join(in_file)
            assert old.handle.epoch == 2
    finally:
        storage_servers.delete_job(grown)


def test_a_pipelined_run_is_bounded_and_adopts_a_new_map_for_reads(
    storage_servers: ServerSet,
) -> None:
    # The native run behind append_many and read, called as they call it: a batch of reads on a
    # client that still holds the map of two adopts the grown map and reads where it places the
    # segment; more ops than one run carries is a typed error before anything is sent.
    handle, grown, name = _grown_from_two(storage_servers)
    try:
        with connect(grown, **CLIENT_OPTIONS) as pf, connect(handle, **CLIENT_OPTIONS) as old:
            storage_servers.set_epoch(grown)
            pf.create_bucket("b")
            pf.append_file("b", name).append_many([b"%04d" % i for i in range(100)])
            # READ_APPEND of 4 bytes at 4 i of segment 0 (args: offset, -, segment, length).
            pieces = [(OP_READ_APPEND, 0, HEADER_STRUCT.pack(4 * i, 0, 0, 4, 0, 0), b"")
                      for i in range(100)]
            replies = old._core.run_placed(b"b", name.encode(), 0, pieces)
            assert old.handle.epoch == 2
            assert [status for status, _, _ in replies] == [0] * 100
            assert sorted(bytes(body) for _, _, body in replies) == [
                b"%04d" % i for i in range(100)]
            too_many = pieces * (_core.PLACED_OPS_MAX // len(pieces) + 1)
            with pytest.raises(InvalidRequest, match=f"at most {_core.PLACED_OPS_MAX}"):
                old._core.run_placed(b"b", name.encode(), 0, too_many)
    finally:
        storage_servers.delete_job(grown)


def test_channels_work_over_doexchange_sessions_too(job_handle: JobHandle) -> None:
    with connect(job_handle, small_ops="flight", **CLIENT_OPTIONS) as pf:
        pf.create_bucket("x")
        queue = pf.queue("x", "q", max_items=4)
        for i in range(4):
            queue.enqueue(b"%d" % i)
        with pytest.raises(QueueFull):
            queue.enqueue(b"full", timeout_s=0.2)
        assert [queue.dequeue(timeout_s=1) for _ in range(5)] == [b"0", b"1", b"2", b"3", None]
        log = pf.append_file("x", "f")
        log.append_many([b"a" * 100, b"b" * 200])
        log.append(b"c")
        assert sorted(log) == [b"a" * 100, b"b" * 200, b"c"]
        assert log.size() == 301
