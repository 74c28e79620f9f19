"""32 client processes at once against real storage servers, every read checked byte for byte
(issue 12: the reliability suite).

Each client is a spawned process with a client of its own on one job over the session's three
servers (two DRAM, one NVMe; no Ray). After a common start, every client first races all the
others for the same keys with DELETE-on-read (exactly one winner per key), then, for a bounded
time and number of operations, puts objects of mixed sizes (1 KiB to 2 MiB, log-uniform: small
objects and large ones striped over blocks), reads them back, reads them with DELETE, and reads
shared objects that the other clients read at the same time. An object's bytes are derived from
its (writer, sequence number), so every read is compared with what was written. At the end
nothing is left: every server's used bytes are back where they were.
"""

from __future__ import annotations

import math
import multiprocessing
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from fixtures_cluster import wait_for
from fixtures_servers import CLIENT_OPTIONS, ServerSet

from pocketflow.client import Client, connect
from pocketflow.errors import ObjectNotFound, PocketflowError
from pocketflow.handle import JobHandle

CLIENTS = 32
RUN_S = 10.0
"""How long each client runs its mixed operations after the common start."""
OPS_PER_CLIENT_MAX = 300
"""... and at most this many of them."""
OPS_PER_CLIENT_MIN = 5
"""Fewest operations a client must have done for the run to count."""
LIVE_OBJECTS_MAX = 4
"""Most objects of its own a client holds at once (bounds the servers' bytes in use)."""
SIZE_MIN_BYTES = 1024
SIZE_MAX_BYTES = 2 * 1024 * 1024
SHARED_OBJECTS = 16
"""Objects every client reads, concurrently with the others."""
RACE_KEYS = 32
"""Keys every client tries to read with DELETE at the same time."""
START_TIMEOUT_S = 90.0
"""Bound on spawning and connecting every client (32 interpreters on 2 cores)."""
FINISH_TIMEOUT_S = RUN_S + 90.0
"""Bound on every client's run after the start, draining included."""
ERRORS_KEPT_MAX = 8
"""Most error and wrong-read descriptions one client reports."""
STATS_TIMEOUT_S = 10.0
BUCKET = "load"
SHARED_WRITER = CLIENTS
"""Writer id of the shared objects (the test process)."""
RACE_WRITER = CLIENTS + 1
"""Writer id of the raced objects (the test process)."""


def object_key(writer: int, seq: int) -> str:
    """Key of object ``seq`` of ``writer``."""
    return f"w{writer:02d}/{seq:05d}"


def object_bytes(writer: int, seq: int) -> bytes:
    """The bytes of object ``seq`` of ``writer``: its size and content follow from the pair."""
    rng = random.Random((writer << 32) | seq)
    size = int(math.exp(rng.uniform(math.log(SIZE_MIN_BYTES), math.log(SIZE_MAX_BYTES))))
    return rng.randbytes(size)


@dataclass
class ClientFigures:
    """What one client process did and saw."""

    client: int
    ops: Counter[str] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    bytes_written: int = 0
    bytes_read: int = 0
    race_wins: list[int] = field(default_factory=list)
    wrong_reads: int = 0
    errors: int = 0
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if len(self.notes) < ERRORS_KEPT_MAX:
            self.notes.append(f"client {self.client}: {text}")


# -- one client process -------------------------------------------------------------------------


def _read(pf: Client, figures: ClientFigures, kind: str, writer: int, seq: int, *,
          delete: bool = False) -> None:
    """Read one object, time it, and compare it byte for byte with what was written."""
    key = object_key(writer, seq)
    started = time.perf_counter()
    data = pf.get(BUCKET, key, delete=delete)
    figures.latencies_s.append(time.perf_counter() - started)
    figures.ops[kind] += 1
    figures.bytes_read += len(data)
    expected = object_bytes(writer, seq)
    if data != expected:
        figures.wrong_reads += 1
        figures.note(f"wrong read of {key}: {len(data)} bytes, expected {len(expected)}")


def _race(pf: Client, figures: ClientFigures) -> None:
    """Read every raced key with DELETE, each client starting at another key."""
    for i in range(RACE_KEYS):
        seq = (figures.client + i) % RACE_KEYS
        try:
            _read(pf, figures, "race", RACE_WRITER, seq, delete=True)
            figures.race_wins.append(seq)
        except ObjectNotFound:
            figures.ops["race lost"] += 1


def _load(pf: Client, figures: ClientFigures) -> None:
    """Mixed puts and reads for ``RUN_S`` (at most ``OPS_PER_CLIENT_MAX``), then delete what is
    left by reading it with DELETE."""
    client = figures.client
    rng = random.Random(client)
    live: deque[int] = deque()
    next_seq = 0
    deadline = time.monotonic() + RUN_S
    for _ in range(OPS_PER_CLIENT_MAX):
        if time.monotonic() >= deadline:
            break
        choice = rng.random()
        try:
            if not live or (len(live) < LIVE_OBJECTS_MAX and choice < 0.35):
                seq, next_seq = next_seq, next_seq + 1
                data = object_bytes(client, seq)
                started = time.perf_counter()
                pf.put(BUCKET, object_key(client, seq), data)
                figures.latencies_s.append(time.perf_counter() - started)
                figures.ops["put"] += 1
                figures.bytes_written += len(data)
                live.append(seq)
            elif choice < 0.6:
                _read(pf, figures, "get shared", SHARED_WRITER, rng.randrange(SHARED_OBJECTS))
            elif choice < 0.8:
                _read(pf, figures, "get", client, rng.choice(live))
            else:
                seq = live.popleft()
                _read(pf, figures, "get delete", client, seq, delete=True)
                if pf.exists(BUCKET, object_key(client, seq)):
                    figures.wrong_reads += 1
                    figures.note(f"{object_key(client, seq)} still exists after a DELETE read")
        except PocketflowError as exc:
            figures.errors += 1
            figures.note(repr(exc))
    while live:
        seq = live.popleft()
        try:
            _read(pf, figures, "get delete", client, seq, delete=True)
        except PocketflowError as exc:
            figures.errors += 1
            figures.note(f"draining {object_key(client, seq)}: {exc!r}")


def _client_main(client: int, handle_json: str, ready: Any, start: Any, results: Any) -> None:
    """One client process: connect, say so, wait for the common start, race, load, report."""
    figures = ClientFigures(client)
    said_ready = False
    try:
        with connect(handle_json, **CLIENT_OPTIONS) as pf:
            pf.lookup(BUCKET, object_key(SHARED_WRITER, client % SHARED_OBJECTS))
            ready.put(client)
            said_ready = True
            if not start.wait(START_TIMEOUT_S):
                raise TimeoutError("no start")
            _race(pf, figures)
            _load(pf, figures)
    except BaseException as exc:  # noqa: BLE001 - reported to the test process
        figures.errors += 1
        figures.note(repr(exc))
    finally:
        if not said_ready:
            ready.put(client)
        results.put(figures)


# -- the test -----------------------------------------------------------------------------------


def _server_used_bytes(servers: ServerSet, handle: JobHandle) -> dict[str, int]:
    """``node_id -> used_bytes`` of each of the job's servers (all jobs)."""
    used = {}
    for server in handle.servers:
        with servers.admin(server.address) as admin:
            used[server.node_id] = int(admin.stats()["used_bytes"])
    return used


def _percentile(sorted_values: list[float], fraction: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]


def test_32_client_processes_read_exactly_what_was_written(
    storage_servers: ServerSet, job_handle: JobHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = _server_used_bytes(storage_servers, job_handle)
    context = multiprocessing.get_context("spawn")
    ready, results, start = context.Queue(), context.Queue(), context.Event()
    processes = [
        context.Process(target=_client_main, name=f"load-client-{i}", daemon=True,
                        args=(i, job_handle.to_json(), ready, start, results))
        for i in range(CLIENTS)
    ]
    began = time.monotonic()
    with connect(job_handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket(BUCKET)
        pf.put_many(BUCKET, [(object_key(SHARED_WRITER, i), object_bytes(SHARED_WRITER, i))
                             for i in range(SHARED_OBJECTS)])
        pf.put_many(BUCKET, [(object_key(RACE_WRITER, i), object_bytes(RACE_WRITER, i))
                             for i in range(RACE_KEYS)])
        figures: list[ClientFigures] = []
        try:
            for process in processes:
                process.start()
            deadline = time.monotonic() + START_TIMEOUT_S
            for _ in processes:
                ready.get(timeout=max(0.1, deadline - time.monotonic()))
            spawn_s = time.monotonic() - began
            start.set()
            started = time.monotonic()
            deadline = started + FINISH_TIMEOUT_S
            for _ in processes:
                figures.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
            run_s = time.monotonic() - started
        finally:
            start.set()
            for process in processes:
                process.join(timeout=5)
                if process.is_alive():
                    process.kill()
                    process.join(timeout=5)

        notes = [n for f in figures for n in f.notes]
        assert sum(f.wrong_reads for f in figures) == 0, notes
        assert sum(f.errors for f in figures) == 0, notes
        assert all(sum(n for kind, n in f.ops.items() if not kind.startswith("race"))
                   >= OPS_PER_CLIENT_MIN for f in figures), [dict(f.ops) for f in figures]
        # Every raced key went to exactly one client, whole.
        wins = Counter(seq for f in figures for seq in f.race_wins)
        assert wins == Counter(range(RACE_KEYS)), wins
        # The shared objects are intact after everyone read them; then nothing is left.
        for i in range(SHARED_OBJECTS):
            assert pf.get(BUCKET, object_key(SHARED_WRITER, i), delete=True) == object_bytes(
                SHARED_WRITER, i)
        assert pf.list(BUCKET) == []
        pf.delete_bucket(BUCKET)
    assert wait_for(lambda: _server_used_bytes(storage_servers, job_handle) == baseline,
                    timeout_s=STATS_TIMEOUT_S), (baseline,
                                                 _server_used_bytes(storage_servers, job_handle))

    ops = Counter[str]()
    for f in figures:
        ops.update(f.ops)
    latencies = sorted(x for f in figures for x in f.latencies_s)
    total_ops = sum(ops.values())
    written = sum(f.bytes_written for f in figures)
    read = sum(f.bytes_read for f in figures)
    with capsys.disabled():
        print(
            f"\n{CLIENTS} clients: {total_ops} ops in {run_s:.1f} s ({total_ops / run_s:.0f}/s; "
            + ", ".join(f"{k} {v}" for k, v in sorted(ops.items()))
            + f"); {written / 2**20:.0f} MiB written, {read / 2**20:.0f} MiB read and verified; "
            f"0 wrong reads, 0 errors; latency p50 {_percentile(latencies, 0.5) * 1e3:.1f} ms, "
            f"p99 {_percentile(latencies, 0.99) * 1e3:.1f} ms, max {latencies[-1] * 1e3:.0f} ms; "
            f"spawn {spawn_s:.1f} s; used bytes back to baseline"
        )
