"""A DELETE read of a striped object is delivered exactly once, or the object stays.

Each round of the kill test stores an object of many data blocks on three private real servers,
starts a reader process, SIGSTOPs one server that holds some of the object's blocks but not its
record (so the read cannot finish), lets the reader start ``get(delete=True)``, and SIGKILLs it
by pid 0-150 ms later (before, during or after the read of the record); then SIGCONTs the server.
The object must still be readable whole and DELETE-readable by the next reader, which frees it.
Before the fix the record was claimed before the blocks were read, so every round lost the object
and orphaned its blocks. At the end the job's used bytes on every server are back to what they
were before the first put.

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
