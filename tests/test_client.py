"""The client against real storage server processes: happy paths and error paths alike."""

from __future__ import annotations

import io
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures_servers import CLIENT_OPTIONS, ServerSet, run_with_handle

from pocketflow.auth import make_token
from pocketflow.client import Client, ObjectInfo, connect
from pocketflow.errors import (
    BucketExists,
    BucketNotFound,
    CapacityExhausted,
    DataUnavailable,
    InvalidRequest,
    ObjectExists,
    ObjectNotFound,
    PermissionDenied,
    PersistNotSupported,
)
from pocketflow.handle import JobHandle, ServerInfo
from pocketflow.placement import Placement
from pocketflow.protocol import SMALL_OBJECT_MAX_BYTES

MiB = 1024 * 1024
STATS_TIMEOUT_S = 6.0


def payload(size: int, seed: int = 0) -> bytes:
    """Deterministic pseudo-random bytes."""
    return random.Random(seed).randbytes(size)


def job_used_bytes(servers: ServerSet, job_id: str, address: str) -> int:
    with servers.admin(address) as admin:
        stats = admin.stats()
    return int(stats.get("jobs", {}).get(job_id, {}).get("used_bytes", 0))


def wait_until(predicate, timeout_s: float = STATS_TIMEOUT_S) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


# -- small objects -------------------------------------------------------------------------------


def test_small_put_get_round_trip(client: Client) -> None:
    client.create_bucket("b")
    for size in (0, 1, 1024, SMALL_OBJECT_MAX_BYTES):
        data = payload(size, size)
        client.put("b", f"k{size}", data)
        assert client.get("b", f"k{size}") == data
        assert client.lookup("b", f"k{size}") == ObjectInfo(f"k{size}", size, False)
    client.put("b", "from-bytearray", bytearray(b"abc"))
    client.put("b", "from-memoryview", memoryview(b"xxabcxx")[2:5])
    assert client.get("b", "from-bytearray") == client.get("b", "from-memoryview") == b"abc"


def test_missing_key_and_missing_bucket(client: Client) -> None:
    client.create_bucket("b")
    with pytest.raises(ObjectNotFound):
        client.get("b", "absent")
    with pytest.raises(ObjectNotFound):
        client.lookup("b", "absent")
    with pytest.raises(ObjectNotFound):
        client.delete("b", "absent")
    assert not client.exists("b", "absent")
    with pytest.raises(BucketNotFound):
        client.get("nobucket", "k")
    with pytest.raises(BucketNotFound):
        client.put("nobucket", "k", b"v")
    with pytest.raises(BucketNotFound):
        client.put("nobucket", "big", payload(3 * MiB))
    with pytest.raises(BucketNotFound):
        list(client.enumerate("nobucket"))


def test_buckets(client: Client) -> None:
    client.create_bucket("b")
    with pytest.raises(BucketExists):
        client.create_bucket("b")
    client.put("b", "k", b"v")
    client.put("b", "big", payload(2 * MiB + 3))
    assert client.delete_bucket("b") >= 2 * MiB
    with pytest.raises(BucketNotFound):
        client.get("b", "k")
    with pytest.raises(BucketNotFound):
        client.delete_bucket("b")
    with pytest.raises(InvalidRequest):
        client.create_bucket("")
    with pytest.raises(InvalidRequest):
        client.put("b", "k" * 1025, b"v")


def test_write_once_and_overwrite(client: Client) -> None:
    client.create_bucket("b")
    client.put("b", "k", b"first")
    with pytest.raises(ObjectExists):
        client.put("b", "k", b"second")
    assert client.get("b", "k") == b"first"
    client.put("b", "k", b"second", overwrite=True)
    assert client.get("b", "k") == b"second"
    # Large over small, large over large, small over large.
    big1, big2 = payload(3 * MiB + 5, 1), payload(2 * MiB, 2)
    client.put("b", "k", big1, overwrite=True)
    assert client.get("b", "k") == big1
    with pytest.raises(ObjectExists):
        client.put("b", "k", big2)
    assert client.get("b", "k") == big1
    client.put("b", "k", big2, overwrite=True)
    assert client.get("b", "k") == big2
    client.put("b", "k", b"small again", overwrite=True)
    assert client.get("b", "k") == b"small again"


def test_delete(client: Client) -> None:
    client.create_bucket("b")
    client.put("b", "small", b"v")
    client.put("b", "large", payload(4 * MiB))
    client.delete("b", "small")
    client.delete("b", "large")
    for key in ("small", "large"):
        with pytest.raises(ObjectNotFound):
            client.get("b", key)
    client.put("b", "large", b"reused key")
    assert client.get("b", "large") == b"reused key"


# -- large objects -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [SMALL_OBJECT_MAX_BYTES + 1, MiB, 5 * MiB + 12345])
def test_large_round_trip(client: Client, size: int) -> None:
    client.create_bucket("b")
    data = payload(size, size)
    client.put("b", "obj", data)
    assert client.get("b", "obj") == data
    assert client.lookup("b", "obj").size == size


def test_large_object_is_striped_over_servers(
    storage_servers: ServerSet, client: Client, job_handle: JobHandle
) -> None:
    client.create_bucket("b")
    client.put("b", "striped", payload(12 * MiB))
    assert wait_until(lambda: all(
        job_used_bytes(storage_servers, job_handle.job_id, s.address) >= MiB
        for s in job_handle.servers
    ))


def test_ranged_reads_at_block_boundaries(client: Client) -> None:
    client.create_bucket("b")
    data = payload(3 * MiB + 100, 7)
    client.put("b", "obj", data)
    for offset in (0, 1, MiB - 1, MiB, MiB + 1, 2 * MiB - 3, 3 * MiB, 3 * MiB + 99):
        for length in (1, 2, 7, MiB, 2 * MiB + 5):
            assert client.get_range("b", "obj", offset, length) == data[offset:offset + length]
    assert client.get_range("b", "obj", len(data), 10) == b""
    assert client.get_range("b", "obj", len(data) + 10, 10) == b""
    client.put("b", "small", b"0123456789")
    assert client.get_range("b", "small", 3, 4) == b"3456"
    assert client.get_range("b", "small", 8, 100) == b"89"
    with pytest.raises(InvalidRequest):
        client.get_range("b", "obj", -1, 5)


def test_get_into(client: Client) -> None:
    client.create_bucket("b")
    data = payload(2 * MiB + 17, 3)
    client.put("b", "large", data)
    client.put("b", "small", b"tiny")
    target = bytearray(len(data) + 10)
    assert client.get_into("b", "large", target) == len(data)
    assert target[:len(data)] == data
    view = memoryview(bytearray(8))
    assert client.get_into("b", "small", view) == 4 and bytes(view[:4]) == b"tiny"
    with pytest.raises(InvalidRequest):
        client.get_into("b", "large", bytearray(10))
    with pytest.raises(InvalidRequest):
        client.get_into("b", "large", bytearray(10), delete=True)
    with pytest.raises(InvalidRequest):
        client.get_into("b", "small", bytearray(2), delete=True)
    with pytest.raises(InvalidRequest):
        client.get_into("b", "small", b"readonly")
    # Too-small buffers left the objects in place, even with delete.
    assert client.get("b", "large") == data and client.get("b", "small") == b"tiny"
    exact = bytearray(len(data))
    assert client.get_into("b", "large", exact, delete=True) == len(data) and exact == data
    with pytest.raises(ObjectNotFound):
        client.get("b", "large")


def test_put_from_stream(client: Client) -> None:
    client.create_bucket("b")
    for size in (10, SMALL_OBJECT_MAX_BYTES, SMALL_OBJECT_MAX_BYTES + 1, 6 * MiB + 1):
        data = payload(size, size)
        client.put("b", f"s{size}", io.BytesIO(data))
        assert client.get("b", f"s{size}") == data


# -- DELETE on read ------------------------------------------------------------------------------


def _race_delete_reads(client: Client, key: str, readers: int) -> tuple[list[bytes], int]:
    """``readers`` threads get ``key`` with DELETE at once; returns (values got, misses)."""
    barrier = threading.Barrier(readers)
    got: list[bytes] = []
    missed: list[BaseException] = []
    lock = threading.Lock()

    def read() -> None:
        barrier.wait()
        try:
            value = client.get("b", key, delete=True)
            with lock:
                got.append(value)
        except ObjectNotFound as exc:
            with lock:
                missed.append(exc)

    threads = [threading.Thread(target=read) for _ in range(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return got, len(missed)


@pytest.mark.parametrize("size", [100, 3 * MiB])
def test_delete_on_read_exactly_once_across_threads(client: Client, size: int) -> None:
    client.create_bucket("b")
    readers = 6
    for round_ in range(3):
        data = payload(size, round_)
        key = f"once-{round_}"
        client.put("b", key, data)
        got, misses = _race_delete_reads(client, key, readers)
        assert got == [data]
        assert misses == readers - 1
        with pytest.raises(ObjectNotFound):
            client.get("b", key)


def test_delete_on_read_frees_space(
    storage_servers: ServerSet, client: Client, job_handle: JobHandle
) -> None:
    client.create_bucket("b")
    client.put("b", "big", payload(6 * MiB))
    client.put("b", "small", payload(1000))
    assert client.get("b", "big", delete=True)
    assert client.get("b", "small", delete=True)
    assert wait_until(lambda: all(
        job_used_bytes(storage_servers, job_handle.job_id, s.address) == 0
        for s in job_handle.servers
    ))


# -- PERSIST -------------------------------------------------------------------------------------


def test_persist_goes_to_long_running_servers_and_outlives_the_job(
    storage_servers: ServerSet, client: Client, job_handle: JobHandle
) -> None:
    client.create_bucket("b")
    client.put("b", "kept-small", b"persisted", persist=True)
    client.put("b", "kept-large", payload(3 * MiB, 9), persist=True)
    client.put("b", "ephemeral", b"gone soon")
    assert client.lookup("b", "kept-small").persist is True
    assert client.get("b", "kept-small") == b"persisted"
    assert client.get("b", "kept-large") == payload(3 * MiB, 9)
    storage_servers.delete_job(job_handle)
    assert client.get("b", "kept-small") == b"persisted"
    assert client.get("b", "kept-large") == payload(3 * MiB, 9)
    with pytest.raises(ObjectNotFound):
        client.get("b", "ephemeral")
    client.delete("b", "kept-small")
    client.delete("b", "kept-large")
    with pytest.raises(ObjectNotFound):
        client.get("b", "kept-large")


def test_persist_needs_a_long_running_server(storage_servers: ServerSet) -> None:
    short_lived = [s for s in storage_servers.infos if not s.persist]
    handle = storage_servers.handle(servers=short_lived)
    try:
        with connect(handle, **CLIENT_OPTIONS) as pf:
            pf.create_bucket("b")
            with pytest.raises(PersistNotSupported):
                pf.put("b", "k", b"v", persist=True)
            pf.put("b", "k", b"v")
    finally:
        storage_servers.delete_job(handle)


def test_server_refuses_persist_when_not_long_running(storage_servers: ServerSet) -> None:
    # A map that wrongly marks a short-lived server as long-running: the server refuses.
    liar = next(s for s in storage_servers.infos if not s.persist)

    handle = storage_servers.handle(servers=[liar.replace(persist=True)])
    try:
        with connect(handle, **CLIENT_OPTIONS) as pf:
            pf.create_bucket("b")
            with pytest.raises(PersistNotSupported):
                pf.put("b", "k", b"v", persist=True)
            with pytest.raises(PersistNotSupported):
                pf.put("b", "big", payload(2 * MiB), persist=True)
    finally:
        storage_servers.delete_job(handle)


# -- security ------------------------------------------------------------------------------------


def test_a_client_given_a_renewed_token_keeps_working_past_the_old_ones_expiry(
    storage_servers: ServerSet, job_handle: JobHandle
) -> None:

    ttl_s = 3.0
    short = job_handle.replace(
        token=make_token(storage_servers.secret, job_handle.job_id, ttl_s=ttl_s))
    expires_at = time.monotonic() + ttl_s
    with connect(short, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("renew")
        # Pooled sessions (and block connections) opened with the short-lived token.
        for i in range(8):
            pf.put("renew", f"k{i}", payload(1000, i))
        pf.put("renew", "big", payload(2 * MiB, 99))
        renewed = job_handle.replace(
            token=make_token(storage_servers.secret, job_handle.job_id, ttl_s=60))
        pf.update_handle(renewed)
        assert pf.handle.token == renewed.token
        time.sleep(max(0.0, expires_at - time.monotonic()) + 0.5)
        # Every call after the old token's expiry works: the servers ended the old sessions at
        # the expiry, and the client replaced them with sessions on the new token.
        for i in range(8):
            assert pf.get("renew", f"k{i}") == payload(1000, i)
        assert pf.get("renew", "big") == payload(2 * MiB, 99)
        pf.put("renew", "after", b"v")
        with pytest.raises(InvalidRequest, match="not of this client's job"):
            pf.update_handle(renewed.replace(job_id="another-job"))


def test_wrong_token_is_permission_denied(storage_servers: ServerSet, job_handle: JobHandle
                                          ) -> None:

    forged = job_handle.replace(
        token=make_token(b"not the cluster secret at all!", job_handle.job_id, ttl_s=60))
    other_jobs = job_handle.replace(
        token=make_token(storage_servers.secret, "someone-else", ttl_s=60))
    expired = job_handle.replace(
        token=make_token(storage_servers.secret, job_handle.job_id, ttl_s=0.001))
    time.sleep(0.01)
    for handle in (forged, other_jobs, expired):
        with connect(handle, **CLIENT_OPTIONS) as pf:
            with pytest.raises(PermissionDenied):
                pf.create_bucket("b")
            with pytest.raises(PermissionDenied):
                pf.put("b", "k", b"v")
            with pytest.raises(PermissionDenied):
                pf.get("b", "k")
            with pytest.raises(PermissionDenied):
                pf.put("b", "big", payload(2 * MiB))


def test_jobs_are_isolated(storage_servers: ServerSet, client: Client) -> None:
    client.create_bucket("b")
    client.put("b", "secret", b"of job one")
    other = storage_servers.handle()
    try:
        with connect(other, **CLIENT_OPTIONS) as pf:
            with pytest.raises(BucketNotFound):
                pf.get("b", "secret")
            pf.create_bucket("b")
            with pytest.raises(ObjectNotFound):
                pf.get("b", "secret")
            assert pf.list("b") == []
    finally:
        storage_servers.delete_job(other)
    assert client.get("b", "secret") == b"of job one"


# -- capacity and failures -----------------------------------------------------------------------


def test_capacity_exhausted_leaves_nothing_behind(server_factory) -> None:  # noqa: ANN001
    servers, small = server_factory("tiny-0", capacity_bytes=2 * MiB)
    _, roomy = server_factory("roomy-0", capacity_bytes=32 * MiB)
    handle = servers.handle()
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        # What the tiny server cannot hold goes on to the roomy one (tests/test_overflow.py);
        # more than both hold is refused.
        with pytest.raises(CapacityExhausted):
            pf.put("b", "too-big", payload(40 * MiB))
        with pytest.raises(ObjectNotFound):
            pf.get("b", "too-big")
        assert wait_until(lambda: all(
            job_used_bytes(servers, handle.job_id, s.address) == 0 for s in (small, roomy)
        ))
        # Small objects fill the tiny server until it refuses; the roomy one takes the rest.
        only_tiny = servers.handle(servers=[small])
        with connect(only_tiny, **CLIENT_OPTIONS) as tiny:
            tiny.create_bucket("b")
            stored = 0
            with pytest.raises(CapacityExhausted):
                for i in range(200):
                    tiny.put("b", f"fill-{i}", payload(SMALL_OBJECT_MAX_BYTES, i))
                    stored += 1
            assert 0 < stored < 200
            tiny.delete("b", "fill-0")
            tiny.put("b", "after-free", payload(1000))
            with pytest.raises(CapacityExhausted):
                tiny.put_many("b", [(f"many-{i}", payload(SMALL_OBJECT_MAX_BYTES, i))
                                    for i in range(10)])


def test_large_objects_on_one_server_commit_with_their_blocks(server_factory) -> None:  # noqa: ANN001
    # On one server every block lives on block 0's home, so each upload also stores the
    # manifest (one round trip): a refused one must leave neither a visible object nor a block.
    servers, info = server_factory("single-0", capacity_bytes=8 * MiB)
    handle = servers.handle()

    def used() -> int:
        return job_used_bytes(servers, handle.job_id, info.address)

    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        first = payload(3 * MiB + 5, 1)
        pf.put("b", "k", first)
        assert pf.get("b", "k") == first
        one_object = used()
        # Write-once: the loser's blocks are freed with its manifest.
        with pytest.raises(ObjectExists):
            pf.put("b", "k", payload(3 * MiB + 5, 2))
        assert pf.get("b", "k") == first
        assert wait_until(lambda: used() == one_object)
        # An overwrite frees the blocks of the version it replaced.
        second = payload(3 * MiB + 5, 3)
        pf.put("b", "k", second, overwrite=True)
        assert pf.get("b", "k") == second
        assert wait_until(lambda: used() == one_object)
        # Blocks 1-4 fit, block 5 does not: the put fails and nothing of it remains.
        with pytest.raises(CapacityExhausted):
            pf.put("b", "partial", payload(5 * MiB, 4))
        with pytest.raises(ObjectNotFound):
            pf.get("b", "partial")
        assert wait_until(lambda: used() == one_object)
        assert [info.key for info in pf.list("b")] == ["k"]


def test_dead_server_is_data_unavailable_promptly(server_factory) -> None:  # noqa: ANN001
    servers, info = server_factory("doomed-0", capacity_bytes=16 * MiB)
    handle = servers.handle()
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        pf.put("b", "k", b"v")
        pf.put("b", "big", payload(2 * MiB))
        servers.process("doomed-0").kill()
        for action in (
            lambda: pf.get("b", "k"),
            lambda: pf.put("b", "k2", b"v"),
            lambda: pf.get("b", "big"),
            lambda: pf.put("b", "big2", payload(2 * MiB)),
            lambda: pf.get_many("b", ["k", "k2"]),
            lambda: pf.create_bucket("c"),
        ):
            started = time.monotonic()
            with pytest.raises(DataUnavailable):
                action()
            assert time.monotonic() - started < 5.0
    with connect(handle, **CLIENT_OPTIONS) as fresh:
        started = time.monotonic()
        with pytest.raises(DataUnavailable):
            fresh.get("b", "k")
        assert time.monotonic() - started < 5.0
    assert info.address


def test_unreachable_servers_names_the_dead_ones_only(server_factory) -> None:  # noqa: ANN001
    servers, alive = server_factory("alive-0", capacity_bytes=8 * MiB)
    _, doomed = server_factory("doomed-1", capacity_bytes=8 * MiB)
    handle = servers.handle()
    with connect(handle, **CLIENT_OPTIONS) as pf:
        assert pf.unreachable_servers() == []
        servers.process("doomed-1").kill()
        assert [s.node_id for s in pf.unreachable_servers()] == ["doomed-1"]
        servers.process("alive-0").kill()
        started = time.monotonic()
        assert {s.node_id for s in pf.unreachable_servers()} == {"alive-0", "doomed-1"}
        assert time.monotonic() - started < 5.0
    assert alive.address != doomed.address


def _process_state(pid: int) -> str:
    """The one-letter state of a process (``T`` when stopped), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_hung_server_times_out(server_factory) -> None:  # noqa: ANN001
    import os
    import signal

    servers, _ = server_factory("sleepy-0", capacity_bytes=16 * MiB)
    handle = servers.handle()
    process = servers.process("sleepy-0")
    # Long stream deadlines: the progress watchdog (op_timeout_s) must fire first.
    with connect(handle, op_timeout_s="1s", rpc_timeout_s="2s", stream_timeout_s="60s") as pf:
        pf.create_bucket("b")
        pf.put("b", "k", b"v")
        pf.put("b", "big", payload(3 * MiB))
        os.kill(process.pid, signal.SIGSTOP)
        assert wait_until(lambda: _process_state(process.pid) == "T", timeout_s=5)
        try:
            for action in (lambda: pf.get("b", "k"), lambda: pf.get_many("b", ["k"]),
                           lambda: pf.lookup("b", "big"), lambda: pf.list("b")):
                started = time.monotonic()
                with pytest.raises(DataUnavailable):
                    action()
                assert time.monotonic() - started < 4.0
        finally:
            os.kill(process.pid, signal.SIGCONT)
        assert pf.get("b", "k") == b"v"
        header_known = pf.open("b", "big")
        os.kill(process.pid, signal.SIGSTOP)
        assert wait_until(lambda: _process_state(process.pid) == "T", timeout_s=5)
        try:
            started = time.monotonic()
            with pytest.raises(DataUnavailable):
                header_known.read()
            assert time.monotonic() - started < 4.0
        finally:
            os.kill(process.pid, signal.SIGCONT)
        header_known.close()
        assert pf.get("b", "big") == payload(3 * MiB)


# -- many objects, listing -----------------------------------------------------------------------


def test_put_many_get_many(client: Client) -> None:
    client.create_bucket("b")
    items = [(f"item-{i:04d}", payload(i % 3000, i)) for i in range(600)]
    items.append(("large-1", payload(2 * MiB + 1, 1)))
    items.append(("large-2", payload(SMALL_OBJECT_MAX_BYTES + 1, 2)))
    assert client.put_many("b", items) == len(items)
    keys = [key for key, _ in items]
    assert client.get_many("b", keys) == [value for _, value in items]
    with pytest.raises(ObjectExists):
        client.put_many("b", items[:3])
    client.put_many("b", [(items[0][0], b"replaced")], overwrite=True)
    assert client.get("b", items[0][0]) == b"replaced"
    with pytest.raises(ObjectNotFound):
        client.get_many("b", [items[1][0], "absent"])
    taken = client.get_many("b", keys[1:50], delete=True)
    assert taken == [value for _, value in items[1:50]]
    with pytest.raises(ObjectNotFound):
        client.get_many("b", keys[1:3])
    assert client.get_many("b", []) == []


def test_put_many_takes_any_flat_buffer_and_refuses_the_rest(client: Client) -> None:
    """bytes go to the core as they are, other buffers as flat byte views (an array of 4-byte
    ints is stored as its bytes); a value that is no buffer, or not contiguous, is refused with
    InvalidRequest before anything is stored."""
    import array

    client.create_bucket("b")
    ints = array.array("I", [1, 2, 3])
    items = [("bytes", b"plain"), ("bytearray", bytearray(b"mutable")),
             ("view", memoryview(b"0123456789")[2:5]), ("ints", ints), ("empty", b"")]
    assert client.put_many("b", items) == len(items)
    assert client.get_many("b", [key for key, _ in items]) == [
        b"plain", b"mutable", b"234", ints.tobytes(), b""]
    for bad in ("text", 42, memoryview(b"0123456789")[::2]):
        with pytest.raises(InvalidRequest):
            client.put_many("b", [("first", b"ok"), ("bad", bad)])  # type: ignore[list-item]
        assert not client.exists("b", "first")


def test_put_many_sends_bytes_values_uncopied_and_lets_go_of_them(client: Client) -> None:
    """The core sends a ``bytes`` value as it is (it cannot change), holding a reference to it
    while it does; every such reference is dropped by the time put_many returns, stored or
    refused, so a mapper's partitions are freed with its own references to them."""
    import sys

    class Tagged(bytes):
        pass

    client.create_bucket("b")
    values = [bytes([i]) * (1000 + i) for i in range(64)] + [Tagged(b"subclass")]
    items = [(f"k{i:03d}", v) for i, v in enumerate(values)]
    before = [sys.getrefcount(v) for v in values]
    assert client.put_many("b", items) == len(items)
    assert [sys.getrefcount(v) for v in values] == before
    assert client.get_many("b", [key for key, _ in items]) == values
    with pytest.raises(InvalidRequest):
        client.put_many("b", [("again", values[0]), ("bad", memoryview(b"0123")[::2])])
    assert [sys.getrefcount(v) for v in values] == before
    with pytest.raises(ObjectExists):
        client.put_many("b", items[:2])
    assert [sys.getrefcount(v) for v in values] == before


def test_enumerate_merges_servers_and_pages(client: Client) -> None:
    client.create_bucket("b")
    keys = sorted(f"part-{i:05d}" for i in range(250))
    client.put_many("b", [(key, key.encode()) for key in keys])
    client.put("b", "other-big", payload(2 * MiB))
    pages = list(client.enumerate("b", "part-", page_size=37))
    assert all(1 <= len(page) <= 37 for page in pages)
    assert [info.key for page in pages for info in page] == keys
    assert all(info.size == len(info.key) for page in pages for info in page)
    listed = client.list("b")
    assert [info.key for info in listed] == sorted([*keys, "other-big"])
    assert next(info for info in listed if info.key == "other-big").size == 2 * MiB
    assert list(client.enumerate("b", "nothing-")) == []
    with pytest.raises(InvalidRequest):
        client.enumerate("b", page_size=0)
    assert client.delete_prefix("b", "part-000") == 100
    assert len(client.list("b", "part-")) == 150


# -- files ---------------------------------------------------------------------------------------


def test_file_objects(client: Client) -> None:
    client.create_bucket("b")
    data = payload(3 * MiB + 333, 5)
    with client.open("b", "streamed", "wb") as writer:
        at = 0
        step = 100_003
        while at < len(data):
            writer.write(data[at:at + step])
            at += step
    with client.open("b", "streamed", "rb") as reader:
        assert reader.read(10) == data[:10]
        reader.seek(MiB - 3)
        assert reader.read(6) == data[MiB - 3:MiB + 3]
        buffer = bytearray(MiB + 7)
        reader.seek(2 * MiB - 1)
        assert reader.readinto(buffer) == len(buffer)
        assert buffer == data[2 * MiB - 1:3 * MiB + 6]
        reader.seek(-5, io.SEEK_END)
        assert reader.read() == data[-5:]
        reader.seek(0)
        assert reader.read() == data
    # Objects of one data block (the block, held until the commit, goes with the manifest).
    for size in (MiB, MiB - 3):
        one = payload(size, 6)
        with client.open("b", f"one-{size}", "wb") as writer:
            writer.write(one[:400_000])
            writer.write(one[400_000:])
        assert client.get("b", f"one-{size}") == one
        with client.open("b", f"one-{size}", "rb") as reader:
            reader.seek(size - 10)
            assert reader.read() == one[-10:]
        assert client.get("b", f"one-{size}", delete=True) == one
        assert not client.exists("b", f"one-{size}")
    with client.open("b", "tiny", "wb") as writer:
        writer.write(b"hello ")
        writer.write(b"world")
    with client.open("b", "tiny") as reader:
        assert reader.read() == b"hello world"
    with pytest.raises(RuntimeError):
        with client.open("b", "aborted", "wb") as writer:
            writer.write(payload(3 * MiB))
            raise RuntimeError("the task failed half way")
    with pytest.raises(ObjectNotFound):
        client.get("b", "aborted")
    with pytest.raises(ObjectNotFound):
        client.open("b", "absent")
    with pytest.raises(InvalidRequest):
        client.open("b", "x", "r+")  # type: ignore[call-overload]


def test_put_file_get_file(client: Client, tmp_path: Path) -> None:
    client.create_bucket("b")
    for size in (0, 5000, 3 * MiB + 1):
        source = tmp_path / f"in-{size}"
        source.write_bytes(payload(size, size))
        assert client.put_file("b", f"f{size}", source) == size
        target = tmp_path / f"out-{size}"
        assert client.get_file("b", f"f{size}", target) == size
        assert target.read_bytes() == source.read_bytes()


# -- epochs and other processes ------------------------------------------------------------------


def test_stale_epoch_adopts_new_map_and_old_data_stays_readable(storage_servers: ServerSet
                                                               ) -> None:
    two = [s for s in storage_servers.infos if s.node_id != "nvme-0"]
    handle = storage_servers.handle(servers=two)
    try:
        with connect(handle, **CLIENT_OPTIONS) as pf:
            pf.create_bucket("b")
            old = {f"old-{i}": payload(200, i) for i in range(60)}
            pf.put_many("b", old.items())
            pf.put("b", "old-large", payload(6 * MiB, 1))
            grown = handle.with_weight_map({
                "epoch": 2,
                "servers": [s.to_row() for s in storage_servers.infos],
            })
            storage_servers.set_epoch(grown)
            pf.put("b", "new-0", b"after growth")  # stale -> adopt -> retry
            assert pf.handle.epoch == 2 and len(pf.handle.servers) == 3
            pf.put_many("b", [(f"new-{i}", payload(100, i)) for i in range(1, 60)])
            assert pf.get_many("b", list(old)) == list(old.values())
            assert pf.get("b", "old-large") == payload(6 * MiB, 1)
            assert pf.get_range("b", "old-large", MiB - 1, 3 * MiB) == payload(6 * MiB, 1)[
                MiB - 1:4 * MiB - 1]
            assert len(pf.list("b", "new-")) == 60
            pf.put("b", "new-large", payload(5 * MiB, 2))
            assert pf.get("b", "new-large", delete=True) == payload(5 * MiB, 2)
        with connect(grown, **CLIENT_OPTIONS) as fresh:
            assert fresh.get("b", "old-7") == old["old-7"]
            fresh.delete("b", "old-large")
            with pytest.raises(ObjectNotFound):
                fresh.get("b", "old-large")
    finally:
        storage_servers.delete_job(handle)


def _child_task(handle_json: str, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    try:
        with connect(handle_json, op_timeout_s="10s") as pf:
            value = pf.get("b", "from-parent")
            pf.put("b", "from-child", value[::-1])
        queue.put("ok")
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put(repr(exc))


def test_another_process_connects_with_only_the_handle_json(client: Client,
                                                            job_handle: JobHandle) -> None:
    client.create_bucket("b")
    client.put("b", "from-parent", b"0123456789" * 500)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_child_task, args=(job_handle.to_json(), queue))
    child.start()
    try:
        assert queue.get(timeout=60) == "ok"
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    assert client.get("b", "from-child") == (b"0123456789" * 500)[::-1]


def test_connect_options_and_context_manager(job_handle: JobHandle) -> None:
    with connect(job_handle.to_json(), exchange_window=8, io_threads=2) as pf:
        assert pf.config.exchange_window == 8
        assert pf.handle == job_handle
        pf.create_bucket("b")
        pf.put_many("b", [(f"k{i}", b"v") for i in range(100)])
        assert len(pf.get_many("b", [f"k{i}" for i in range(100)])) == 100
    with pytest.raises(InvalidRequest):
        pf.put("b", "after-close", b"v")
    with pytest.raises(InvalidRequest):
        connect(42)  # type: ignore[arg-type]


def job_total_used_bytes(servers: ServerSet, handle: JobHandle) -> int:
    return sum(job_used_bytes(servers, handle.job_id, s.address) for s in handle.servers)


def test_losing_writer_and_overwrite_free_their_blocks(
    storage_servers: ServerSet, client: Client, job_handle: JobHandle
) -> None:
    client.create_bucket("b")
    first, second = payload(4 * MiB, 1), payload(6 * MiB, 2)
    client.put("b", "k", first)
    with pytest.raises(ObjectExists):
        client.put("b", "k", second)
    # The loser's orphan blocks are gone: only the first version is stored.
    assert wait_until(lambda: 4 * MiB <= job_total_used_bytes(storage_servers, job_handle)
                      < 5 * MiB)
    client.put("b", "k", second, overwrite=True)
    assert wait_until(lambda: 6 * MiB <= job_total_used_bytes(storage_servers, job_handle)
                      < 7 * MiB)
    assert client.get("b", "k") == second


def test_threads_share_one_client(client: Client) -> None:
    client.create_bucket("b")
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(40):
                size = 3 * MiB if i % 13 == 0 else 100 + i
                data = payload(size, worker * 1000 + i)
                client.put("b", f"w{worker}-{i}", data)
                assert client.get("b", f"w{worker}-{i}", delete=i % 2 == 0) == data
            keys = [f"w{worker}-{i}" for i in range(1, 40, 2)]
            assert len(client.get_many("b", keys)) == len(keys)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert len(client.list("b")) == 6 * 20


@pytest.mark.parametrize("window", [1, 4, 256])
def test_pipelining_windows_and_frame_limits(job_handle: JobHandle, window: int) -> None:
    with connect(job_handle, exchange_window=window, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        # 60 KiB values: a window of 256 needs more than one 8 MiB frame.
        count = 150 if window == 256 else 40
        items = [(f"k{i}", payload(60 * 1024, i)) for i in range(count)]
        pf.put_many("b", items)
        assert pf.get_many("b", [k for k, _ in items], delete=True) == [v for _, v in items]


def test_draining_server_refuses_writes_serves_reads(server_factory) -> None:  # noqa: ANN001
    from pocketflow.errors import ServerDraining

    servers, info = server_factory("drained-0", capacity_bytes=16 * MiB)
    handle = servers.handle()
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        pf.put("b", "k", b"v")
        pf.put("b", "big", payload(2 * MiB))
        with servers.admin(info.address) as admin:
            assert admin.drain(exit_when_empty=False)["draining"] is True
            assert admin.stats()["draining"] is True
        with pytest.raises(ServerDraining):
            pf.put("b", "k2", b"v")
        with pytest.raises(ServerDraining):
            pf.put("b", "big2", payload(2 * MiB))
        assert pf.get("b", "k") == b"v"
        assert pf.get("b", "big", delete=True) == payload(2 * MiB)
        pf.delete("b", "k")


def test_stale_epoch_on_each_kind_of_first_call(storage_servers: ServerSet) -> None:
    two = [s for s in storage_servers.infos if s.node_id != "nvme-0"]
    first_calls = {
        "large put": lambda pf: pf.put("b", "big", payload(5 * MiB, 3)),
        "get_many": lambda pf: pf.get_many("b", ["seed"]),
        "put_many": lambda pf: pf.put_many("b", [(f"m{i}", b"x") for i in range(30)]),
        "enumerate": lambda pf: pf.list("b"),
        "create_bucket": lambda pf: pf.create_bucket("c"),
        "lookup": lambda pf: pf.lookup("b", "seed"),
        # Queues and append files named so that segment 0 lands on the server the new map
        # adds, which has never seen the bucket.
        "enqueue": lambda pf: pf.queue("b", new_home, max_items=4).enqueue(b"item"),
        "append": lambda pf: pf.append_file("b", new_home).append(b"record"),
        "append_many": lambda pf: pf.append_file("b", new_home).append_many([b"a", b"b"]),
    }
    grown_placement = Placement.of_handle(storage_servers.handle(set_epoch=False).with_weight_map(
        {"epoch": 5, "servers": [s.to_row() for s in storage_servers.infos]}))
    new_home = next(name for name in (f"channel-{i}" for i in range(1000))
                    if grown_placement.server_for(name.encode(), 0).node_id == "nvme-0")
    for name, call in first_calls.items():
        handle = storage_servers.handle(servers=two)
        try:
            with connect(handle, **CLIENT_OPTIONS) as pf:
                pf.create_bucket("b")
                pf.put("b", "seed", b"seed")
                grown = handle.with_weight_map(
                    {"epoch": 5, "servers": [s.to_row() for s in storage_servers.infos]})
                storage_servers.set_epoch(grown)
                call(pf)
                assert pf.handle.epoch == 5, name
                assert pf.get("b", "seed") == b"seed", name
                for i in range(20):
                    pf.put("b", f"after-{i}", payload(3000, i))
                    assert pf.get("b", f"after-{i}") == payload(3000, i)
        finally:
            storage_servers.delete_job(handle)


def _forked_task(pf: Client, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    try:
        value = pf.get("b", "k")
        pf.put("b", "from-child", value + b"-child")
        queue.put(pf.get("b", "from-child"))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put(repr(exc))


def test_a_forked_child_uses_the_client_it_inherited(client: Client) -> None:
    # The parent used the client (its sessions are open) and forks without any preparation:
    # the child's calls run on a native runtime and connections of its own.
    client.create_bucket("b")
    client.put("b", "k", b"v")
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_forked_task, args=(client, queue))
    child.start()
    try:
        outcome = queue.get(timeout=30)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert outcome == b"v-child"
    assert client.get("b", "k") == b"v"  # the parent is unaffected
    assert client.get("b", "from-child") == b"v-child"


_FORK_AFTER_DISCONNECT_SCRIPT = """
import os, random, sys
from pocketflow.client import connect

client = connect(sys.stdin.read())
client.create_bucket("b")
large = random.Random(7).randbytes(64 * 1024 * 40)
client.put("b", "large", large)
for _ in range(3):
    assert client.get("b", "large") == large
    client.disconnect()
    pid = os.fork()
    if pid == 0:
        ok = client.get("b", "large") == large
        client.put("b", "from-child", b"c")
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    assert client.get("b", "from-child") == b"c"  # the parent reconnects
    client.delete("b", "from-child")
print("ok")
"""


def test_a_child_forked_after_disconnect_connects_on_its_own(job_handle: JobHandle) -> None:
    assert run_with_handle(_FORK_AFTER_DISCONNECT_SCRIPT, job_handle, timeout_s=90) == ["ok"]


_FORK_STORM_SCRIPT = """
import os, random, sys, threading
from pocketflow.client import connect
from pocketflow.errors import BucketExists

client = connect(sys.stdin.read())
try:
    client.create_bucket("storm")
except BucketExists:
    pass
large = random.Random(3).randbytes(3 * 1024 * 1024 + 17)
client.put("storm", "large", large)
stop = threading.Event()
reads = [0]
wrong = [0]


def keep_reading():  # another thread is mid-call whenever the main thread forks
    while not stop.is_set():
        wrong[0] += client.get("storm", "large") != large
        wrong[0] += client.get("storm", "small") != b"s" if reads[0] else 0
        client.put("storm", "small", b"s", overwrite=True)
        reads[0] += 1


reader = threading.Thread(target=keep_reading)
reader.start()
failed = 0
for i in range(200):  # as a Lithops worker: use the storage, then fork a process that does
    client.put("storm", f"parent-{i}", b"p", overwrite=True)
    pid = os.fork()
    if pid == 0:
        try:
            ok = client.get("storm", f"parent-{i}") == b"p"
            client.put("storm", f"child-{i}", b"c")
            ok = ok and client.get("storm", "large") == large
        except BaseException:
            os._exit(3)
        os._exit(0 if ok else 4)
    _, status = os.waitpid(pid, 0)
    failed += status != 0
stop.set()
reader.join()
children = sum(client.exists("storm", f"child-{i}") for i in range(200))
print(failed, children, wrong[0], reads[0] > 0)
"""


def test_two_hundred_forks_mid_use_each_get_a_working_client(job_handle: JobHandle) -> None:
    # No disconnect, a thread mid-call at every fork: every child reads and writes on its own.
    failed, children, wrong, read = run_with_handle(_FORK_STORM_SCRIPT, job_handle, timeout_s=240)
    assert (failed, children, wrong, read) == ("0", "200", "0", "True")


def _keys_homed_apart(placement: Placement, home: str, *, blocks: int, count: int) -> list[str]:
    """Keys whose block 0 lives on ``home`` and none of whose data blocks do."""
    found = []
    for i in range(10_000):
        key = f"apart-{i}".encode()
        if placement.server_for(key, 0).node_id == home and all(
            placement.server_for(key, b).node_id != home for b in range(1, blocks + 1)
        ):
            found.append(key.decode())
            if len(found) == count:
                return found
    raise AssertionError(f"fewer than {count} such keys in 10,000 tries")


def test_lost_commit_reply_keeps_the_blocks(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    """When the block-0 put reached its server but its reply never came, the object may be
    stored: its data blocks must not be freed (the object would be unreadable), and the put still
    reports the failure. The block-0 server is SIGSTOPped with a session to it already open: the
    commit waits in its socket, the client gives up after its op timeout, and once the server
    runs again it stores the record, which must find every block. The reads wait for that
    record first: a read on another connection may reach the resumed server before it took the
    commit waiting in the old session's socket."""
    servers, home = server_factory("commit-0", "dram", 32 * MiB)
    server_factory("commit-1", "dram", 32 * MiB)
    server_factory("commit-2", "dram", 32 * MiB)
    handle = servers.handle()
    placement = Placement(handle.servers)
    data = payload(3 * MiB, 5)
    streamed = payload(3 * MiB, 6)
    key, writer_key = _keys_homed_apart(placement, home.node_id, blocks=3, count=2)
    pid = servers.process(home.node_id).pid
    with connect(handle, op_timeout_s="1s", rpc_timeout_s="10s", stream_timeout_s="30s") as pf:
        pf.create_bucket("b")
        assert not pf.exists("b", key)  # opens (and pools) a session to the home server
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(DataUnavailable):
                pf.put("b", key, data)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert pf.wait_for("b", [key], timeout_s=10) == []
        assert pf.get("b", key) == data
        assert not pf.exists("b", writer_key)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(DataUnavailable), pf.open("b", writer_key, "wb") as writer:
                writer.write(streamed)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert pf.wait_for("b", [writer_key], timeout_s=10) == []
        assert pf.get("b", writer_key) == streamed


def test_put_many_reports_a_bucket_missing_everywhere(job_handle: JobHandle) -> None:
    """A bucket that no server of the job has cannot be repaired: put_many reports it and stores
    nothing, for small and large objects alike."""
    with connect(job_handle, **CLIENT_OPTIONS) as pf:
        with pytest.raises(BucketNotFound):
            pf.put_many("never-made", [("k", b"v")])
        with pytest.raises(BucketNotFound):
            pf.put_many("never-made", [("big", payload(2 * MiB, 3))])
        pf.create_bucket("never-made")
        assert pf.list("never-made") == []


def test_get_file_with_delete_keeps_the_object_when_the_file_cannot_be_written(
    client: Client, tmp_path: Path
) -> None:
    client.create_bucket("b")
    small, large = b"small value", payload(3 * MiB, 9)
    client.put("b", "small", small)
    client.put("b", "large", large)
    missing_dir = tmp_path / "no-such-dir" / "out"
    for key in ("small", "large"):
        with pytest.raises(FileNotFoundError):
            client.get_file("b", key, missing_dir, delete=True)
    assert client.get("b", "small") == small
    assert client.get("b", "large") == large
    assert client.get_file("b", "large", tmp_path / "out", delete=True) == len(large)
    assert (tmp_path / "out").read_bytes() == large
    with pytest.raises(ObjectNotFound):
        client.get("b", "large")


def test_wait_for_returns_when_the_last_key_is_put(client: Client) -> None:
    client.create_bucket("w")
    keys = [f"part-{i}" for i in range(6)]
    client.put("w", keys[0], b"early")
    started = time.monotonic()
    assert client.wait_for("w", keys, timeout_s=0.3) == keys[1:]
    assert time.monotonic() - started >= 0.3

    def writer() -> None:
        for key in keys[1:]:
            time.sleep(0.05)
            client.put("w", key, payload(100_000 if key == keys[-1] else 10, 1))

    thread = threading.Thread(target=writer)
    started = time.monotonic()
    thread.start()
    try:
        assert client.wait_for("w", keys, timeout_s=20) == []
    finally:
        thread.join()
    # Parked on the servers and woken by the last put, not by the 20 s deadline.
    assert time.monotonic() - started < 5.0
    # Keys already written are found without waiting, also with no time to wait.
    assert client.wait_for("w", keys + keys[:2], timeout_s=0) == []
    assert client.get("w", keys[-1], delete=True) == payload(100_000, 1)
    assert client.wait_for("w", [keys[-1]], timeout_s=0) == [keys[-1]]
    assert client.wait_for("w", [keys[-1], keys[0], keys[-1]], timeout_s=0) == [keys[-1]]
    assert client.wait_for("w", [keys[-1], keys[0]], timeout_s=0.2) == [keys[-1]]
    with pytest.raises(BucketNotFound):
        client.wait_for("nope", ["k"], timeout_s=0.1)
    with pytest.raises(BucketNotFound):
        client.wait_for("nope", ["k"], timeout_s=0)
    with pytest.raises(InvalidRequest):
        client.wait_for("w", ["k"], timeout_s=-1)


def test_wait_for_on_a_dead_server_is_data_unavailable(server_factory) -> None:  # noqa: ANN001
    servers, info = server_factory("doomed-w", capacity_bytes=16 * MiB)
    with connect(servers.handle(), **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        servers.process("doomed-w").kill()
        started = time.monotonic()
        with pytest.raises(DataUnavailable) as caught:
            pf.wait_for("b", ["k"], timeout_s=20)
        assert time.monotonic() - started < 5.0
        assert caught.value.server == info.address


_FORK_AFTER_RENEWAL_SCRIPT = """
import dataclasses, os, sys, time
from pocketflow.auth import make_token
from pocketflow.client import connect
from pocketflow.handle import JobHandle

lines = sys.stdin.read().split("\\n")
renewed, secret, ttl_s = JobHandle.from_json(lines[0]), bytes.fromhex(lines[1]), float(lines[2])
# A token that expires soon, minted here so that a slow start does not use it up.
short = renewed.replace(token=make_token(secret, renewed.job_id, ttl_s=ttl_s))
client = connect(short)
client.create_bucket("b")
client.put("b", "before", b"p")
client.update_handle(renewed)      # the token a driver renewed, before the first token expires
pid = os.fork()
if pid == 0:
    time.sleep(ttl_s + 1.0)        # the first token has expired by now
    try:
        client.put("b", "from-child", b"c")
    except BaseException as exc:
        print(repr(exc), file=sys.stderr, flush=True)
        os._exit(3)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
print("stored", client.get("b", "from-child").decode() if client.exists("b", "from-child") else "-")
closed = connect(renewed)         # a token that stays valid: only the close may refuse
closed.put("b", "closed-parent", b"p")
closed.close()
pid = os.fork()
if pid == 0:
    try:
        closed.put("b", "closed-child", b"c")
    except BaseException:
        os._exit(0)                # refused: the client was closed before the fork
    os._exit(4)
_, status = os.waitpid(pid, 0)
print("closed-child", os.waitstatus_to_exitcode(status))
print("closed-stored", int(client.exists("b", "closed-child")))
client.close()
"""


def test_a_child_forked_after_a_renewal_uses_the_renewed_token_and_a_closed_client_stays_closed(
    storage_servers: ServerSet,
) -> None:
    """Issue 28, item 5: a child forked after ``update_handle`` starts with the renewed token
    (before: the handle its parent cached, whose token had expired by the child's put), and a
    client closed in the parent is closed in a child too (before: its put was stored)."""
    short_ttl_s = 4.0
    handle = storage_servers.handle()
    try:
        out = subprocess.run(
            [sys.executable, "-c", _FORK_AFTER_RENEWAL_SCRIPT],
            input=f"{handle.to_json()}\n{storage_servers.secret.hex()}\n{short_ttl_s}",
            capture_output=True, text=True, timeout=90, check=False,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["child", "0", "stored", "c", "closed-child", "0",
                                     "closed-stored", "0"], (
            out.stdout, out.stderr)
    finally:
        storage_servers.delete_job(handle)
