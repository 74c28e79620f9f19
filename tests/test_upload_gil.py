"""A streamed upload never waits with the interpreter lock held (issue 28, item 6): reading its
version while another thread commits it cannot deadlock (the commit holds the upload and needs
the lock to release the caller's blocks), and one dropped by the garbage collector before its
commit frees its blocks with the lock released, so other threads run meanwhile."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from fixtures_servers import TEST_BLOCK_SIZE_BYTES, ServerSet

from pocketflow.client import connect
from pocketflow.handle import ServerInfo

ROUNDS = 20
BLOCKS = 6  # more than one send group (4 MiB) of 1 MiB blocks

_VERSION_DURING_COMMIT = f"""
import sys, threading
from pocketflow.client import connect
from pocketflow.handle import JobHandle

pf = connect(JobHandle.from_json(sys.stdin.read()))
pf.create_bucket("b")
block = bytearray(b"x" * {TEST_BLOCK_SIZE_BYTES})
for round in range({ROUNDS}):
    upload = pf._core.upload("b", f"k{{round}}", persist=False)
    for index in range(1, {BLOCKS} + 1):
        upload.add(index, memoryview(block))
    done = threading.Event()

    def spin():
        while not done.is_set():
            upload.version

    spinner = threading.Thread(target=spin)
    spinner.start()
    upload.commit({BLOCKS * TEST_BLOCK_SIZE_BYTES}, False)
    done.set()
    spinner.join()
print("committed", {ROUNDS})
"""


def test_reading_the_version_while_another_thread_commits_does_not_deadlock(
    storage_servers: ServerSet,
) -> None:
    handle = storage_servers.handle()
    try:
        # A deadlock hangs the interpreter for good: run it in a child that the timeout ends.
        out = subprocess.run([sys.executable, "-c", _VERSION_DURING_COMMIT],
                             input=handle.to_json(), capture_output=True, text=True,
                             timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["committed", str(ROUNDS)]
    finally:
        storage_servers.delete_job(handle)


def test_an_upload_dropped_before_its_commit_frees_its_blocks_without_the_lock(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    servers, info = server_factory("drop-0", capacity_bytes=64 * 1024 * 1024)
    handle = servers.handle()
    options = {"op_timeout_s": "2s", "rpc_timeout_s": "2s", "connect_timeout_s": "2s"}
    with connect(handle, **options) as pf:
        pf.create_bucket("b")
        upload = pf._core.upload("b", "dropped", persist=False)
        block = bytearray(b"x" * TEST_BLOCK_SIZE_BYTES)
        for index in range(1, BLOCKS + 1):
            upload.add(index, memoryview(block))
        ticks = [0]
        stop = threading.Event()

        def tick() -> None:
            while not stop.is_set():
                ticks[0] += 1
                time.sleep(0.01)

        ticker = threading.Thread(target=tick)
        ticker.start()
        pid = servers.process(info.node_id).pid
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            before = ticks[0]
            del upload  # its sends and the freeing of its blocks wait on the stopped server
            gc.collect()
            waited_s = time.monotonic() - started
            during = ticks[0] - before
        finally:
            os.kill(pid, signal.SIGCONT)
            stop.set()
            ticker.join(timeout=10)
        assert waited_s > 0.5, "the drop did not wait on the server: nothing was measured"
        # The ticker runs about every 10 ms whenever it can take the lock.
        assert during >= 10, (during, waited_s)
