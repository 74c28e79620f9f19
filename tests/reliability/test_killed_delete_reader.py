"""A DELETE read of a striped object is delivered exactly once, or the object stays.

Each round of the kill test stores an object of many data blocks on three private real servers,
starts a reader process, SIGSTOPs one server that holds some of the object's blocks but not its
record (so the read cannot finish), lets the reader start ``get(delete=True)``, and SIGKILLs it
by pid 0-150 ms later (before, during or after the read of the record); then SIGCONTs the server.
The object must still be readable whole and DELETE-readable by the next reader, which frees it.
Before the fix the record was claimed before the blocks were read, so every round lost the object
and orphaned its blocks. At the end the job's used bytes on every server are back to what they
were before the first put.

The ``get_each`` kill test reads 160 objects of one data block with ``get_each(delete=True)``
in a reader process, SIGSTOPs it 0-60 ms (adapted per round) into the call and SIGKILLs it. A
claim is final (see docs/ARCHITECTURE.md, DELETE on read): what the reader claimed is gone with
it, every other object stays whole, and the server counts exactly the objects left, in objects
and used bytes.

The race test starts DELETE readers of one striped object behind a barrier (``get``,
``get_each`` and ``get_file`` with ``delete=True``, over the direct and the gRPC small-op path):
exactly one gets the bytes, the others ``ObjectNotFound``, and no block is left behind.
"""

from __future__ import annotations

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
from fixtures_servers import CLIENT_OPTIONS, TEST_BLOCK_SIZE_BYTES, ServerSet

from pocketflow.client import Client, connect
from pocketflow.errors import ObjectNotFound
from pocketflow.handle import JobHandle, ServerInfo

KILL_ROUNDS = 6
KILL_AFTER_S_MAX = 0.15
OBJECT_BYTES = 24 * TEST_BLOCK_SIZE_BYTES + 12345
"""Twenty-five data blocks over three servers."""
PRIVATE_SERVER_BYTES = 64 * 1024 * 1024
READER_START_TIMEOUT_S = 60.0
USAGE_SETTLE_TIMEOUT_S = 20.0
RACE_ROUNDS = 3
RACE_READERS = 3

_READER = """
import sys
from pocketflow.client import connect
from pocketflow.handle import JobHandle
handle = JobHandle.from_json(sys.stdin.readline())
with connect(handle, op_timeout_s="10s") as pf:
    pf.exists("b", "warm")
    print("start", flush=True)
    sys.stdin.readline()  # "go": one of the servers is stopped now
    data = pf.get("b", sys.argv[1], delete=True)
    print("done", len(data), flush=True)
"""


def _job_usage(servers: ServerSet, handle: JobHandle) -> dict[str, dict[str, int]]:
    usage = {}
    for info in handle.servers:
        with servers.admin(info.address) as admin:
            usage[info.node_id] = admin.stats().get("jobs", {}).get(handle.job_id, {})
    return usage


def _used_bytes(servers: ServerSet, handle: JobHandle) -> dict[str, int]:
    return {node: job.get("used_bytes", 0) for node, job in _job_usage(servers, handle).items()}


def _settled_usage(servers: ServerSet, handle: JobHandle, baseline: dict[str, int]) -> dict:
    """The job's used bytes per server once they are back to ``baseline`` (a killed reader's
    stream may hold block bytes until its server sees the connection go), or after the bound."""
    deadline = time.monotonic() + USAGE_SETTLE_TIMEOUT_S
    used = _used_bytes(servers, handle)
    while used != baseline and time.monotonic() < deadline:
        time.sleep(0.2)
        used = _used_bytes(servers, handle)
    return used


def test_a_delete_reader_killed_mid_read_loses_nothing(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    for node in ("delread-0", "delread-1", "delread-2"):
        servers, _ = server_factory(node, capacity_bytes=PRIVATE_SERVER_BYTES)
    handle = servers.handle()
    rng = random.Random(20261129)
    data = rng.randbytes(OBJECT_BYTES)
    lost: list[str] = []
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        baseline = _used_bytes(servers, handle)
        for round_ in range(KILL_ROUNDS):
            key = f"striped-{round_}"
            pf.put("b", key, data)
            usage = _job_usage(servers, handle)
            # A server with some of the blocks and not the record: the read waits on it.
            stopped = next(node for node, job in usage.items()
                           if job.get("objects", 0) == 0 and job.get("used_bytes", 0) > 0)
            stopped_pid = servers.process(stopped).pid
            reader = subprocess.Popen(
                [sys.executable, "-c", _READER, key], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True,
            )
            try:
                assert reader.stdin is not None and reader.stdout is not None
                reader.stdin.write(handle.to_json() + "\n")
                reader.stdin.flush()
                started = reader.stdout.readline().strip()
                assert started == "start", f"round {round_}: reader said {started!r}"
                os.kill(stopped_pid, signal.SIGSTOP)
                reader.stdin.write("go\n")
                reader.stdin.flush()
                time.sleep(rng.uniform(0.0, KILL_AFTER_S_MAX))
            finally:
                os.kill(reader.pid, signal.SIGKILL)
                reader.wait(timeout=READER_START_TIMEOUT_S)
                os.kill(stopped_pid, signal.SIGCONT)
            said = reader.stdout.read()
            reader.stdout.close()
            reader.stdin.close()
            assert "done" not in said, f"round {round_}: read past a stopped server: {said!r}"
            try:
                assert pf.get("b", key) == data, f"round {round_}: the object stayed corrupt"
            except ObjectNotFound:
                lost.append(key)
                continue
            # The next DELETE reader gets it whole, and it is gone after.
            assert pf.get("b", key, delete=True) == data
            with pytest.raises(ObjectNotFound):
                pf.get("b", key)
        assert not lost, f"lost {lost} of {KILL_ROUNDS} rounds"
        used = _settled_usage(servers, handle, baseline)
    assert used == baseline, f"blocks left behind: {used} (before: {baseline})"


def _read_get(pf: Client, key: str, _: Path) -> bytes:
    return pf.get("b", key, delete=True)


def _read_each(pf: Client, key: str, _: Path) -> bytes:
    [got] = pf.get_each("b", [key], delete=True)
    if isinstance(got, Exception):
        raise got
    return got


def _read_file(pf: Client, key: str, where: Path) -> bytes:
    pf.get_file("b", key, where, delete=True)
    return where.read_bytes()


@pytest.mark.parametrize("small_ops", ["direct", "flight"])
@pytest.mark.parametrize(
    "read", [_read_get, _read_each, _read_file], ids=["get", "get_each", "get_file"]
)
def test_concurrent_delete_readers_one_gets_it(
    storage_servers: ServerSet, job_handle: JobHandle, tmp_path: Path, small_ops: str,
    read: Callable[[Client, str, Path], bytes],
) -> None:
    data = random.Random(7).randbytes(6 * TEST_BLOCK_SIZE_BYTES + 99)
    readers = [connect(job_handle, small_ops=small_ops, **CLIENT_OPTIONS)
               for _ in range(RACE_READERS)]
    try:
        writer = readers[0]
        writer.create_bucket("b")
        baseline = _used_bytes(storage_servers, job_handle)
        for round_ in range(RACE_ROUNDS):
            key = f"raced-{round_}"
            writer.put("b", key, data)
            barrier = threading.Barrier(RACE_READERS, timeout=READER_START_TIMEOUT_S)
            got: list[bytes | Exception] = [b""] * RACE_READERS

            def race(
                n: int, key: str = key, barrier: threading.Barrier = barrier,
                got: list[bytes | Exception] = got,
            ) -> None:
                barrier.wait()
                try:
                    got[n] = read(readers[n], key, tmp_path / f"{key}-{n}")
                except ObjectNotFound as exc:
                    got[n] = exc

            threads = [threading.Thread(target=race, args=(n,)) for n in range(RACE_READERS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=READER_START_TIMEOUT_S)
                assert not thread.is_alive()
            winners = [g for g in got if isinstance(g, bytes)]
            assert len(winners) == 1, f"round {round_}: {got}"
            assert winners[0] == data
            assert sum(isinstance(g, ObjectNotFound) for g in got) == RACE_READERS - 1
            with pytest.raises(ObjectNotFound):
                writer.get("b", key)
        used = _settled_usage(storage_servers, job_handle, baseline)
        assert used == baseline, f"blocks left behind: {used} (before: {baseline})"
    finally:
        for reader in readers:
            reader.close()


EACH_KILL_ROUNDS = 6
EACH_OBJECTS = 160
EACH_OBJECT_BYTES = 256 * 1024
"""One data block each (a wide shuffle's partitions): claimed with their block by one READ."""
EACH_IO_THREADS = 4
EACH_STOP_AFTER_S_FIRST = 0.06
"""The first round stops the reader up to this long into its call; a round that stopped it
after its last claim halves the bound, one that stopped it before its first doubles it (up to
``EACH_STOP_AFTER_S_LIMIT``), so the rounds land mid-call on a quiet machine as on a loaded one."""
EACH_STOP_AFTER_S_LIMIT = 1.0

_EACH_READER = """
import sys
from pocketflow.client import connect
from pocketflow.handle import JobHandle
handle = JobHandle.from_json(sys.stdin.readline())
keys = sys.argv[1].split(",")
with connect(handle, op_timeout_s="10s", io_threads=int(sys.argv[2])) as pf:
    pf.exists("b", keys[0])
    print("start", flush=True)
    sys.stdin.readline()  # "go"
    got = pf.get_each("b", keys, delete=True)
    print("done", sum(isinstance(g, bytes) for g in got), flush=True)
"""


def test_a_get_each_delete_reader_killed_mid_call_loses_only_what_it_claimed(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    """A reader process SIGSTOPped 0-60 ms (adapted per round) into ``get_each(delete=True)``
    over one-block objects, then SIGKILLed: every object it had not claimed stays whole and
    DELETE-readable, every object it claimed (returned to the dead call, or in flight, at most
    ``io_threads`` of those) is gone with it, and the server's accounting (the job's objects
    and used bytes) is exactly that of the objects left once the killed connection is gone: no
    block of a cut transfer stays held."""
    servers, info = server_factory("eachkill-0", capacity_bytes=PRIVATE_SERVER_BYTES)
    handle = servers.handle()
    rng = random.Random(20261130)
    rounds_mid_call = 0
    stop_after_s_max = EACH_STOP_AFTER_S_FIRST
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        empty = _job_usage(servers, handle)[info.node_id]
        for round_ in range(EACH_KILL_ROUNDS):
            data = {f"each-{round_}-{i:03d}": rng.randbytes(EACH_OBJECT_BYTES)
                    for i in range(EACH_OBJECTS)}
            pf.put_many("b", list(data.items()))
            full = _job_usage(servers, handle)[info.node_id]
            assert full.get("objects") == EACH_OBJECTS + empty.get("objects", 0), full
            # Objects of one size: keys of one length: each is charged the same bytes.
            per_object_bytes, rest = divmod(full["used_bytes"] - empty.get("used_bytes", 0),
                                            EACH_OBJECTS)
            assert rest == 0 and per_object_bytes >= EACH_OBJECT_BYTES, full
            reader = subprocess.Popen(
                [sys.executable, "-c", _EACH_READER, ",".join(data), str(EACH_IO_THREADS)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            try:
                assert reader.stdin is not None and reader.stdout is not None
                reader.stdin.write(handle.to_json() + "\n")
                reader.stdin.flush()
                assert reader.stdout.readline().strip() == "start", f"round {round_}"
                reader.stdin.write("go\n")
                reader.stdin.flush()
                time.sleep(rng.uniform(0.0, stop_after_s_max))
                os.kill(reader.pid, signal.SIGSTOP)
                stopped = _job_usage(servers, handle)[info.node_id]
            finally:
                os.kill(reader.pid, signal.SIGKILL)
                reader.wait(timeout=READER_START_TIMEOUT_S)
            said = reader.stdout.read()
            reader.stdout.close()
            reader.stdin.close()
            left = {key: value for key, value in data.items()
                    if _still_whole(pf, key, value, round_)}
            if 0 < len(left) < EACH_OBJECTS and "done" not in said:
                rounds_mid_call += 1
            elif not left:
                stop_after_s_max /= 2
            elif len(left) == EACH_OBJECTS:
                stop_after_s_max = min(2 * stop_after_s_max, EACH_STOP_AFTER_S_LIMIT)
            # Once the killed connection is gone, the server counts exactly the objects left.
            expected_objects = len(left) + empty.get("objects", 0)
            expected_bytes = empty.get("used_bytes", 0) + len(left) * per_object_bytes
            deadline = time.monotonic() + USAGE_SETTLE_TIMEOUT_S
            usage = _job_usage(servers, handle)[info.node_id]
            while ((usage.get("objects", 0), usage.get("used_bytes", 0))
                   != (expected_objects, expected_bytes) and time.monotonic() < deadline):
                time.sleep(0.1)
                usage = _job_usage(servers, handle)[info.node_id]
            assert (usage.get("objects", 0), usage.get("used_bytes", 0)) == (
                expected_objects, expected_bytes
            ), f"round {round_}: {usage} with {len(left)} objects left (stopped at {stopped})"
            # The objects left are DELETE-readable whole by the next reader, which frees them.
            got = pf.get_each("b", list(left), delete=True)
            assert got == list(left.values()), f"round {round_}"
            assert _used_bytes(servers, handle)[info.node_id] == empty.get("used_bytes", 0)
    assert rounds_mid_call > 0, "no round stopped the reader between its first and last claim"


def _still_whole(pf: Client, key: str, value: bytes, round_: int) -> bool:
    """Whether ``key`` is still there (then it must be whole); gone is the only other answer."""
    try:
        got = pf.get("b", key)
    except ObjectNotFound:
        return False
    assert got == value, f"round {round_}: {key} is there but not whole"
    return True
