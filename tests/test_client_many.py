"""put_many and get_many against real storage servers: many large objects at once, mixed with
small ones, and the failure of some objects of a call."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable

import pytest
from fixtures_cluster import wait_for
from fixtures_servers import CLIENT_OPTIONS, TEST_BLOCK_SIZE_BYTES, ServerSet, run_with_handle

from pocketflow.client import LARGE_OBJECTS_IN_FLIGHT_MAX, Client, connect
from pocketflow.errors import CapacityExhausted, InvalidRequest, ObjectExists, ObjectNotFound
from pocketflow.handle import JobHandle
from pocketflow.protocol import KEY_FAST_MAX_CHARS, KEY_MAX_BYTES, SMALL_OBJECT_MAX_BYTES

MiB = 1024 * 1024
PART_BYTES = 1_250_000
"""A shuffle partition's size: two data blocks of the tests' 1 MiB block size."""
STATS_TIMEOUT_S = 6.0
OBJECT_OVERHEAD_BYTES_MAX = 4096
"""What a server charges a stored part beyond its bytes (index entries, allocation rounding): far
less than any of its blocks, so a block left behind always shows."""


def payload(size: int, seed: int) -> bytes:
    """Deterministic pseudo-random bytes."""
    return random.Random(seed).randbytes(size)


def job_used_bytes(servers: ServerSet, handle: JobHandle) -> int:
    total = 0
    for server in handle.servers:
        with servers.admin(server.address) as admin:
            stats = admin.stats()
        total += int(stats.get("jobs", {}).get(handle.job_id, {}).get("used_bytes", 0))
    return total


def wait_until(predicate: Callable[[], bool]) -> bool:
    return wait_for(predicate, timeout_s=STATS_TIMEOUT_S)


def native_threads() -> int:
    """The threads of this process, as the kernel counts them (native ones included)."""
    return len(os.listdir("/proc/self/task"))


def max_threads_during(call: Callable[[], object]) -> int:
    """Run ``call`` while sampling this process's thread count; returns the largest seen."""
    peak = native_threads()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, native_threads())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        call()
    finally:
        done.set()
        sampler.join()
    return peak - 1  # the sampler itself


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("io_threads", [1, 2, 8])
def test_many_large_objects_round_trip(
    storage_servers: ServerSet, job_handle: JobHandle, io_threads: int
) -> None:
    # More objects than are ever in flight, of sizes that end inside, at and past a block.
    sizes = [PART_BYTES, SMALL_OBJECT_MAX_BYTES + 1, MiB, 2 * MiB + 1, 3 * MiB + 17]
    items = [(f"part-{i}", payload(sizes[i % len(sizes)], i)) for i in range(3 * 4 + 1)]
    keys = [key for key, _ in items]
    with connect(job_handle, io_threads=io_threads, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        assert pf.put_many("b", items) == len(items)
        assert pf.get_many("b", keys) == [value for _, value in items]
        assert pf.get_many("b", list(reversed(keys))) == [value for _, value in reversed(items)]
        assert [pf.lookup("b", key).size for key in keys] == [len(value) for _, value in items]
        assert pf.get_many("b", keys, delete=True) == [value for _, value in items]
        assert not any(pf.exists("b", key) for key in keys)
        with pytest.raises(ObjectNotFound):
            pf.get_many("b", keys[:1])
    assert wait_until(lambda: job_used_bytes(storage_servers, job_handle) == 0)


def test_mixed_small_and_large(storage_servers: ServerSet, client: Client,
                               job_handle: JobHandle) -> None:
    client.create_bucket("b")
    sizes = [0, 10, SMALL_OBJECT_MAX_BYTES, SMALL_OBJECT_MAX_BYTES + 1, PART_BYTES, 3 * MiB]
    items = [(f"m-{i}", payload(sizes[i % len(sizes)], 100 + i)) for i in range(4 * len(sizes))]
    keys = [key for key, _ in items]
    assert client.put_many("b", items) == len(items)
    assert client.get_many("b", keys) == [value for _, value in items]
    assert client.get_many("b", keys, delete=True) == [value for _, value in items]
    assert client.list("b") == []
    assert wait_until(lambda: job_used_bytes(storage_servers, job_handle) == 0)


def test_overwrite_of_many_large_objects_frees_the_old_versions(
    storage_servers: ServerSet, client: Client, job_handle: JobHandle
) -> None:
    client.create_bucket("b")
    old = [(f"o-{i}", payload(3 * MiB, i)) for i in range(6)]
    new = [(f"o-{i}", payload(PART_BYTES, 50 + i)) for i in range(6)]
    client.put_many("b", old)
    with pytest.raises(ObjectExists):
        client.put_many("b", new)
    assert client.get_many("b", [key for key, _ in old]) == [value for _, value in old]
    assert client.put_many("b", new, overwrite=True) == len(new)
    assert client.get_many("b", [key for key, _ in new]) == [value for _, value in new]
    expected = len(new) * PART_BYTES
    assert wait_until(
        lambda: expected <= job_used_bytes(storage_servers, job_handle) < expected + MiB
    )


# -- failures ------------------------------------------------------------------------------------


def test_a_failed_large_object_raises_the_first_error_after_the_others_are_stored(
    storage_servers: ServerSet, client: Client, job_handle: JobHandle
) -> None:
    client.create_bucket("b")
    taken = {"part-3": payload(2 * MiB, 1000), "part-5": b"a small object"}
    client.put_many("b", taken.items())
    before = job_used_bytes(storage_servers, job_handle)
    items = [(f"part-{i}", payload(PART_BYTES, i)) for i in range(12)]
    with pytest.raises(ObjectExists) as raised:
        client.put_many("b", items)
    assert "part-3" in str(raised.value)  # the first failure in the order of the items
    # Every other object was stored, and the objects that were there are untouched.
    stored = [(key, value) for key, value in items if key not in taken]
    assert client.get_many("b", [key for key, _ in stored]) == [value for _, value in stored]
    assert client.get_many("b", list(taken)) == list(taken.values())
    # The losers' blocks are gone: only the stored objects were added.
    added = sum(len(value) for _, value in stored)
    most = added + len(stored) * OBJECT_OVERHEAD_BYTES_MAX
    assert wait_until(
        lambda: added <= job_used_bytes(storage_servers, job_handle) - before <= most
    )
    client.get_many("b", [key for key, _ in items], delete=True)
    assert wait_until(lambda: job_used_bytes(storage_servers, job_handle) == 0)


def test_a_full_server_stores_what_fits_and_leaves_nothing_of_the_rest(
    server_factory,  # noqa: ANN001
) -> None:
    # Room for five parts, not six: the parts in flight at once fill less than that, so a part
    # is refused only once some parts are stored.
    assert LARGE_OBJECTS_IN_FLIGHT_MAX < 5
    servers, tiny = server_factory("tiny-0", capacity_bytes=7 * MiB)
    handle = servers.handle(servers=[tiny])
    items = [(f"part-{i}", payload(PART_BYTES, i)) for i in range(12)]
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        with pytest.raises(CapacityExhausted):
            pf.put_many("b", items)
        stored = [(key, value) for key, value in items if pf.exists("b", key)]
        assert 0 < len(stored) < len(items)
        assert pf.get_many("b", [key for key, _ in stored]) == [value for _, value in stored]
        added = sum(len(value) for _, value in stored)
        most = added + len(stored) * OBJECT_OVERHEAD_BYTES_MAX
        assert wait_until(lambda: added <= job_used_bytes(servers, handle) <= most)
        # Once the stored ones are read away, the refused ones fit.
        pf.get_many("b", [key for key, _ in stored], delete=True)
        refused = [(key, value) for key, value in items if (key, value) not in stored]
        assert pf.put_many("b", refused[:4]) == 4
        assert pf.get_many("b", [key for key, _ in refused[:4]], delete=True) == [
            value for _, value in refused[:4]
        ]
        assert wait_until(lambda: job_used_bytes(servers, handle) == 0)


def test_get_many_reads_every_object_before_raising(client: Client) -> None:
    client.create_bucket("b")
    items = [(f"g-{i}", payload(PART_BYTES, i)) for i in range(8)]
    client.put_many("b", items)
    keys = [key for key, _ in items]
    with pytest.raises(ObjectNotFound):
        client.get_many("b", [keys[0], "absent", *keys[1:]], delete=True)
    # With delete, every object found was read and is gone.
    assert not any(client.exists("b", key) for key in keys)


def test_get_each_gives_every_key_its_own_outcome(client: Client) -> None:
    """get_each raises nothing for a key's failure: a missing key's ObjectNotFound stands in its
    place, and every object found (small or striped) is returned and, with delete, consumed."""
    client.create_bucket("b")
    items = [(f"e-{i}", payload(PART_BYTES if i % 2 else 100, i)) for i in range(6)]
    client.put_many("b", items)
    keys = [key for key, _ in items]
    results = client.get_each("b", [keys[0], "absent", *keys[1:]], delete=True)
    assert isinstance(results[1], ObjectNotFound)
    assert [r for i, r in enumerate(results) if i != 1] == [value for _, value in items]
    assert not any(client.exists("b", key) for key in keys)
    again = client.get_each("b", keys)
    assert all(isinstance(r, ObjectNotFound) for r in again)


def test_get_each_delete_of_one_block_objects_gives_each_to_one_reader(
    storage_servers: ServerSet, job_handle: JobHandle, client: Client
) -> None:
    """Objects of one data block (a wide shuffle's partitions) read with get_each(delete) by
    several readers at once over the same keys (each object is claimed with its block by one
    READ): every object reaches exactly one reader, whole, the others get ObjectNotFound in its
    place, and nothing of the objects is left on the servers."""
    client.create_bucket("b")
    size = SMALL_OBJECT_MAX_BYTES * 3
    assert size < TEST_BLOCK_SIZE_BYTES
    items = [(f"one-{i}", payload(size + i, i)) for i in range(24)]
    client.put_many("b", items)
    keys = [key for key, _ in items]
    readers = 4
    outcomes: list[list[bytes | Exception]] = [[] for _ in range(readers)]
    start = threading.Barrier(readers)

    def read(reader: int) -> None:
        start.wait(10)
        outcomes[reader] = client.get_each("b", keys, delete=True)

    threads = [threading.Thread(target=read, args=(r,)) for r in range(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for at, (_, value) in enumerate(items):
        got = [outcome[at] for outcome in outcomes]
        assert [g for g in got if isinstance(g, bytes)] == [value]
        assert sum(isinstance(g, ObjectNotFound) for g in got) == readers - 1
    assert wait_until(lambda: job_used_bytes(storage_servers, job_handle) == 0)


def test_batch_calls_check_keys_as_single_calls_do(client: Client) -> None:
    """The batch calls check their keys without encoding the short ones: a key that is not a
    str, empty or longer than KEY_MAX_BYTES in UTF-8 is refused with InvalidRequest and the
    batch stores, reads or deletes nothing; keys at the edges of the fast path pass or fail by
    their encoded length, and a key that cannot be encoded fails as a single call's does."""
    client.create_bucket("b")
    widest = "\U0001f600" * KEY_FAST_MAX_CHARS  # 4 bytes a character: exactly KEY_MAX_BYTES
    longest = "k" * KEY_MAX_BYTES
    client.put_many("b", [(widest, b"w"), (longest, b"l")])
    assert client.get_many("b", [widest, longest]) == [b"w", b"l"]
    too_wide = "\U0001f600" * (KEY_FAST_MAX_CHARS + 1)
    for bad in ("", "k" * (KEY_MAX_BYTES + 1), too_wide, b"bytes-key", 7):
        with pytest.raises(InvalidRequest):
            client.put_many("b", [("fine", b"x"), (bad, b"y")])  # type: ignore[list-item]
        for call in (client.get_many, client.get_each):
            with pytest.raises(InvalidRequest):
                call("b", ["fine", bad], delete=True)  # type: ignore[list-item]
        with pytest.raises(InvalidRequest):
            client.wait_for("b", [widest, bad], timeout_s=0)  # type: ignore[list-item]
    assert not client.exists("b", "fine")
    assert client.get_many("b", [widest, longest]) == [b"w", b"l"]
    lone = "\ud800"
    with pytest.raises(UnicodeEncodeError):
        client.put("b", lone, b"x")
    with pytest.raises(UnicodeEncodeError):
        client.put_many("b", [(lone, b"x")])
    with pytest.raises(UnicodeEncodeError):
        client.get_many("b", [lone])


# -- threads -------------------------------------------------------------------------------------


def test_object_threads_are_bounded_and_stop_on_close(job_handle: JobHandle) -> None:
    """put_many and get_many move large objects on native threads of their own (the calling
    thread takes part): at most LARGE_OBJECTS_IN_FLIGHT_MAX objects at once, each on at most one
    thread per server, and none of those threads outlives the call."""
    servers = len({s.address for s in job_handle.servers})
    bound = LARGE_OBJECTS_IN_FLIGHT_MAX - 1 + LARGE_OBJECTS_IN_FLIGHT_MAX * (servers - 1)
    with connect(job_handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")  # starts the native runtime: its threads are the baseline
        items = [(f"t-{i}", payload(PART_BYTES, i)) for i in range(16)]
        for call in (lambda: pf.put_many("b", items),
                     lambda: pf.get_many("b", [key for key, _ in items])):
            baseline = native_threads()
            peak = max_threads_during(call)
            assert 0 < peak - baseline <= bound
            assert wait_until(lambda baseline=baseline: native_threads() == baseline)
        assert pf.get_many("b", [key for key, _ in items]) == [value for _, value in items]


_FORK_SCRIPT = """
import os, random, signal, sys
from pocketflow.client import connect

client = connect(sys.stdin.read())
client.create_bucket("b")
parts = [random.Random(i).randbytes(1_250_000) for i in range(8)]
for round in range(2):
    keys = [f"{round}-{i}" for i in range(8)]
    client.put_many("b", list(zip(keys, parts)))  # starts the object threads
    client.disconnect()
    pid = os.fork()
    if pid == 0:  # the parent's object threads are not the child's
        signal.alarm(60)  # a child that hangs dies, and the parent sees it
        child_keys = [f"child-{round}-{i}" for i in range(8)]
        client.put_many("b", list(zip(child_keys, parts)))
        ok = client.get_many("b", keys + child_keys, delete=True) == parts + parts
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    assert client.list("b") == []
print("ok")
"""


def test_a_forked_child_moves_many_objects_on_threads_of_its_own(job_handle: JobHandle) -> None:
    assert run_with_handle(_FORK_SCRIPT, job_handle, timeout_s=120) == ["ok"]
