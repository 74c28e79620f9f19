"""An NVMe server SIGKILLed while large puts are in flight and their last chunks are still being
written behind them (issue: the NVMe write-behind's worst moment).

What must hold: every put either returned before the kill or raised a typed error; none hangs
(each ends within the client's bounds); a later read of a put that returned gets a typed
dead-server error, never other bytes; and a server restarted on the same file starts empty, so
a read there is ``ObjectNotFound``, never the bytes of a write that may not have reached the
device.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from fixtures_servers import ServerSet

from pocketflow.client import connect
from pocketflow.errors import DataUnavailable, ObjectNotFound, PocketflowError
from pocketflow.handle import ServerInfo

MiB = 1024 * 1024
OBJECT_BYTES = 8 * MiB
"""Large puts: striped in 1 MiB blocks, the last chunks of each written behind the put."""
WRITERS = 4
PUTS_PER_WRITER = 12
KILL_AFTER_PUTS = 3
"""The server dies as soon as this many puts returned: the others are in flight then."""
CAPACITY_BYTES = 512 * MiB
CLIENT_OPTIONS = {"op_timeout_s": "5s", "rpc_timeout_s": "5s", "stream_timeout_s": "10s",
                  "connect_timeout_s": "1s"}
BARRIER_TIMEOUT_S = 60.0
"""Bound on the puts reaching the kill (a loaded machine)."""
ENDED_WITHIN_S = 30.0
"""How soon after the kill every writer must have ended (the client's bounds are 5-10 s)."""


def _payload(writer: int, index: int) -> bytes:
    """Bytes of one put, distinct per put (a seeded digest stream, so a stale read shows)."""
    seed = hashlib.sha256(f"{writer}/{index}".encode()).digest()
    return (seed * (OBJECT_BYTES // len(seed) + 1))[:OBJECT_BYTES]


def test_puts_in_flight_when_an_nvme_server_is_killed_end_typed_and_bounded(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]], tmp_path: Path,
) -> None:
    servers, info = server_factory("killed-nvme-0", tier="nvme", capacity_bytes=CAPACITY_BYTES)
    handle = servers.handle(servers=[info])
    process = servers.process(info.node_id)
    returned: list[str] = []
    failed: dict[str, PocketflowError] = {}
    lock = threading.Lock()
    enough = threading.Event()

    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")

        def write(writer: int) -> None:
            for index in range(PUTS_PER_WRITER):
                key = f"w{writer}/p{index:02d}"
                try:
                    pf.put("b", key, _payload(writer, index))
                except PocketflowError as exc:
                    with lock:
                        failed[key] = exc
                    return
                with lock:
                    returned.append(key)
                    if len(returned) >= KILL_AFTER_PUTS:
                        enough.set()

        threads = [threading.Thread(target=write, args=(w,), daemon=True)
                   for w in range(WRITERS)]
        for thread in threads:
            thread.start()
        assert enough.wait(BARRIER_TIMEOUT_S), "the puts never reached the kill"
        os.kill(process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for thread in threads:
            thread.join(max(0.0, killed_at + ENDED_WITHIN_S - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "a put hung after the server died"
        # Writers still putting at the kill failed, each with the dead-server error.
        assert failed, "every put had finished before the kill: nothing was in flight"
        for key, exc in failed.items():
            assert isinstance(exc, DataUnavailable), (key, exc)
        # A put that returned is read back as a typed dead-server error, bounded.
        for key in returned:
            started = time.monotonic()
            try:
                data = pf.get("b", key)
            except DataUnavailable:
                pass
            else:
                raise AssertionError(f"{key}: {len(data)} bytes from a dead server")
            assert time.monotonic() - started < ENDED_WITHIN_S

    # Restarted on the same file, the server starts empty: nothing of the old writes is served.
    restarted = servers.start("killed-nvme-0-restarted", "nvme", CAPACITY_BYTES,
                              nvme_path=tmp_path / f"{info.node_id}.img")
    handle = servers.handle(servers=[restarted])
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        for key in [*returned, *failed]:
            try:
                data = pf.get("b", key)
            except ObjectNotFound:
                continue
            raise AssertionError(f"{key}: a restarted server served {len(data)} old bytes")
        # And it works: a put and its read round-trip on the file the killed server wrote.
        pf.put("b", "after", _payload(99, 0))
        assert pf.get("b", "after") == _payload(99, 0)
        pf.delete("b", "after")
    # Its stats name the room deleted blocks' writes still hold: none, once they completed.
    deadline = time.monotonic() + ENDED_WITHIN_S
    with servers.admin(restarted.address) as admin:
        while (stats := admin.stats())["freeing_bytes"] != 0:
            assert time.monotonic() < deadline, stats
            time.sleep(0.01)
    servers.delete_job(handle)
