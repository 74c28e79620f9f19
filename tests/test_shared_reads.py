"""Zero-copy reads from this host's servers (``Client.pin_views``, ``Client.get_shared``): objects
pinned in a server's shared DRAM arena, read in place, with their guarantees tested at their
worst moments on real server processes: the bytes of a pin never change (overwrite, delete,
reuse of the memory, a forked child's inherited views after the parent unpinned), a SIGKILLed
reader's pins go by the sweep, a SIGSTOPped one keeps them, views that outlive their client or
their server still unpin (and never release a restarted server's pins), every refusal (a bound,
NVMe, another uid, a wrong token) costs a copy, never the bytes."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from fixtures_servers import CLIENT_OPTIONS, SERVER_THREADS, ServerAt, ServerSet

from pocketflow.client import Client, connect
from pocketflow.errors import CapacityExhausted, ObjectNotFound, PermissionDenied
from pocketflow.handle import JobHandle, ServerInfo
from pocketflow.server_process import ServerSpec

MIB = 1024 * 1024
SWEEP_WAIT_S = 15.0
"""A dead reader's pins go within about two sweep intervals; a loaded 2-core machine may take
far longer, so tests wait this long and assert that the sweep (not an unpin) released them."""


def _value(key: str, size: int) -> bytes:
    """``size`` bytes that depend on ``key`` (repeated digest)."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def _pins(servers: ServerSet, info: ServerInfo) -> dict[str, Any]:
    """The server's pin table counters (its ``stats``)."""
    with servers.admin(info.address) as admin:
        return admin.stats()["pins"]


def _wait_pins(servers: ServerSet, info: ServerInfo, count: int, *, timeout_s: float) -> float:
    """Wait until the server holds ``count`` pins; returns the seconds it took."""
    start = time.monotonic()
    while True:
        pins = _pins(servers, info)["pins"]
        if pins == count:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"{pins} pins, expected {count}"
        time.sleep(0.02)


@pytest.fixture
def shared_server(server_factory: Callable[..., tuple[ServerSet, ServerInfo]]
                  ) -> tuple[ServerSet, ServerInfo, JobHandle]:
    """A private DRAM server of 32 MiB with its arena shared, and a job on it alone."""
    servers, info = server_factory("shared-0", "dram", 32 * MIB, shared_dram=True)
    return servers, info, servers.handle(servers=[info])


def _put(pf: Client, keys: list[str], size: int) -> list[bytes]:
    pf.create_bucket("b")
    values = [_value(k, size) for k in keys]
    pf.put_many("b", list(zip(keys, values, strict=True)))
    return values


def test_views_are_the_objects_and_their_pins_go_with_them(
        shared_server: tuple[ServerSet, ServerInfo, JobHandle]) -> None:
    servers, info, handle = shared_server
    with connect(handle, **CLIENT_OPTIONS) as pf:
        keys = [f"k{i}" for i in range(6)]
        values = _put(pf, keys, MIB)
        pf.put("b", "small", b"tiny")
        views = pf.pin_views("b", [*keys, "small", "absent"])
        assert [bytes(v) for v in views[:6]] == values  # type: ignore[arg-type]
        assert bytes(views[6]) == b"tiny"  # type: ignore[arg-type]
        assert views[7] is None, "a key not found is left to the usual read"
        assert all(v is not None and v.readonly for v in views[:7])
        with pytest.raises(TypeError):
            views[0][0] = 1  # type: ignore[index]
        assert pf.shared_counts == {"pinned": 6, "values": 1, "copied": 1}
        pins = _pins(servers, info)
        assert (pins["pins"], pins["pinned_bytes"]) == (6, 6 * MIB)
        # A slice keeps its pin: the pins go only with the last view.
        kept = views[2][10:20]  # type: ignore[index]
        del views
        _wait_pins(servers, info, 1, timeout_s=5)
        assert bytes(kept) == values[2][10:20]
        del kept
        _wait_pins(servers, info, 0, timeout_s=5)
        shared = pf.get_shared("b", [*keys, "absent"])
        assert [bytes(v) for v in shared[:6]] == values  # type: ignore[arg-type]
        assert isinstance(shared[6], ObjectNotFound)


def test_overwrite_delete_and_reuse_leave_a_pinned_view_intact(
        shared_server: tuple[ServerSet, ServerInfo, JobHandle]) -> None:
    servers, info, handle = shared_server
    with connect(handle, **CLIENT_OPTIONS) as pf:
        keys = [f"k{i}" for i in range(4)]
        values = _put(pf, keys, MIB)
        views = pf.pin_views("b", keys)
        pf.put("b", keys[0], b"\x00" * MIB, overwrite=True)
        pf.delete("b", keys[1])
        pf.delete("b", keys[2])
        # Fill the arena with other objects: none may take a pinned extent.
        filler = [f"fill{i}" for i in range(12)]
        pf.put_many("b", [(k, b"\xff" * MIB) for k in filler])
        assert [bytes(v) for v in views] == values  # type: ignore[arg-type]
        with servers.admin(info.address) as admin:
            used = admin.stats()["used_bytes"]
        del views
        _wait_pins(servers, info, 0, timeout_s=5)
        with servers.admin(info.address) as admin:
            freed = used - admin.stats()["used_bytes"]
        assert freed >= 3 * MIB, "the replaced and deleted blocks are freed once unpinned"
        assert bytes(pf.get("b", keys[0])) == b"\x00" * MIB


_READER = r"""
import hashlib, sys, time
from pocketflow.client import connect
from pocketflow.handle import JobHandle
handle = JobHandle.from_json(sys.stdin.readline())
keys = sys.argv[1].split(",")
with connect(handle, op_timeout_s="10s", rpc_timeout_s="10s") as pf:
    views = pf.pin_views("b", keys)
    assert all(v is not None for v in views), views
    digests = [hashlib.sha256(v).hexdigest() for v in views]
    print("pinned", flush=True)
    sys.stdin.readline()  # until the test says go on
    again = [hashlib.sha256(v).hexdigest() for v in views]
    print("same" if again == digests else "changed", flush=True)
"""


def _reader(handle: JobHandle, keys: list[str]) -> subprocess.Popen[str]:
    """A fresh process that pins ``keys`` and waits, its views held, for a line on stdin."""
    proc = subprocess.Popen([sys.executable, "-c", _READER, ",".join(keys)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(handle.to_json() + "\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "pinned"
    return proc


def test_a_sigkilled_readers_pins_go_within_the_bound_and_the_memory_is_reused(
        shared_server: tuple[ServerSet, ServerInfo, JobHandle]) -> None:
    servers, info, handle = shared_server
    with connect(handle, **CLIENT_OPTIONS) as pf:
        keys = [f"k{i}" for i in range(6)]
        _put(pf, keys, MIB)
        reader = _reader(handle, keys)
        try:
            assert _pins(servers, info)["pins"] == 6
            for key in keys:
                pf.delete("b", key)
            os.kill(reader.pid, signal.SIGKILL)
            reader.wait(timeout=10)
            _wait_pins(servers, info, 0, timeout_s=SWEEP_WAIT_S)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait(timeout=10)
        assert _pins(servers, info)["swept_total"] == 6
        # The memory is reused: 28 MiB of new objects fit in the 32 MiB arena only if the
        # reader's 6 MiB went back to it.
        news = [(f"new{i}", _value(f"new{i}", MIB)) for i in range(28)]
        pf.put_many("b", news)
        assert [bytes(v) for v in pf.get_many("b", [k for k, _ in news])] == [
            v for _, v in news]


def test_a_full_arena_refuses_what_the_swept_test_fits_while_pins_hold(
        shared_server: tuple[ServerSet, ServerInfo, JobHandle]) -> None:
    # The counterpart of the test above: with the 6 MiB still pinned (deleted, not swept),
    # the same 28 MiB does not fit, so that test's fill proves the swept bytes were reused.
    servers, info, handle = shared_server
    with connect(handle, **CLIENT_OPTIONS) as pf:
        keys = [f"k{i}" for i in range(6)]
        _put(pf, keys, MIB)
        views = pf.pin_views("b", keys)
        for key in keys:
            pf.delete("b", key)
        with pytest.raises(CapacityExhausted):
            pf.put_many("b", [(f"new{i}", _value(f"new{i}", MIB)) for i in range(28)])
        del views
        _wait_pins(servers, info, 0, timeout_s=SWEEP_WAIT_S)


def test_a_sigstopped_reader_keeps_its_pins_and_its_bytes(
        shared_server: tuple[ServerSet, ServerInfo, JobHandle]) -> None:
    servers, info, handle = shared_server
    with connect(handle, **CLIENT_OPTIONS) as pf:
        keys = [f"k{i}" for i in range(4)]
        _put(pf, keys, MIB)
        reader = _reader(handle, keys)
        assert reader.stdin is not None and reader.stdout is not None
        try:
            os.kill(reader.pid, signal.SIGSTOP)
            pf.put_many("b", [(k, b"\x01" * MIB) for k in keys], overwrite=True)
            pf.put_many("b", [(f"fill{i}", b"\x02" * MIB) for i in range(8)])
            # A second reader, SIGKILLed while the first is stopped: once its pins are swept,
            # a sweep has run since the stop, and kept the stopped reader's.
            pf.put("b", "other", _value("other", MIB))
            other = _reader(handle, ["other"])
            os.kill(other.pid, signal.SIGKILL)
            other.wait(timeout=10)
            _wait_pins(servers, info, 4, timeout_s=SWEEP_WAIT_S)
            pins = _pins(servers, info)
            assert (pins["pins"], pins["swept_total"]) == (4, 1), "a stopped process keeps its pins"
            os.kill(reader.pid, signal.SIGCONT)
            reader.stdin.write("go\n")
            reader.stdin.flush()
            assert reader.stdout.readline().strip() == "same"
            assert reader.wait(timeout=30) == 0
        finally:
            if reader.poll() is None:
                os.kill(reader.pid, signal.SIGCONT)
                reader.kill()
                reader.wait(timeout=10)
        _wait_pins(servers, info, 0, timeout_s=5)


def test_a_full_pin_table_costs_copies_not_bytes(
        server_factory: Callable[..., tuple[ServerSet, ServerInfo]]) -> None:
    # 8 MiB of arena: the server pins 4 MiB at most, a job 2 MiB of it.
    servers, info = server_factory("small-0", "dram", 8 * MIB, shared_dram=True)
    handle = servers.handle(servers=[info])
    with connect(handle, **CLIENT_OPTIONS) as pf:
        keys = [f"k{i}" for i in range(5)]
        values = _put(pf, keys, MIB - 4096)
        views = pf.pin_views("b", keys)
        pinned = [v for v in views if v is not None]
        assert len(pinned) == 2
        pins = _pins(servers, info)
        assert pins["job_pinned_bytes_max"] == 2 * MIB and pins["refused_total"] == 3
        url = servers.process("small-0").metrics_url
        assert url is not None
        with urllib.request.urlopen(url, timeout=10) as reply:
            metrics = {line.split("{")[0].split(" ")[0]: line.rsplit(" ", 1)[1]
                       for line in reply.read().decode().splitlines()
                       if line.startswith("pocketflow_pin")}
        assert metrics["pocketflow_pin_refusals_total"] == "3"
        assert metrics["pocketflow_pins"] == "2"
        shared = pf.get_shared("b", keys)
        assert [bytes(v) for v in shared] == values  # type: ignore[arg-type]
        assert pf.shared_counts["copied"] == 3 + 5
        del views, pinned, shared
        _wait_pins(servers, info, 0, timeout_s=5)


def test_a_stopped_reader_at_its_jobs_bound_costs_another_job_neither_pins_nor_room(
        server_factory: Callable[..., tuple[ServerSet, ServerInfo]]) -> None:
    """The shared bound's worst moment: one job's reader holds all its job may pin, in a
    process that is SIGSTOPped (its pins stay) and whose objects were deleted under it (their
    room stays taken). Another job on the same server still pins what it reads and writes what
    fits beside, with the right bytes: the per-job bound, not the server's, is what one job
    takes."""
    # 8 MiB of arena: the server pins 4 MiB at most, a job 2 MiB of it.
    servers, info = server_factory("two-jobs-0", "dram", 8 * MIB, shared_dram=True)
    first = servers.handle(servers=[info])
    second = servers.handle(servers=[info])
    size = MIB - 4096
    with connect(first, **CLIENT_OPTIONS) as pf:
        keys = ["a0", "a1"]
        _put(pf, keys, size)
        reader = _reader(first, keys)
        try:
            os.kill(reader.pid, signal.SIGSTOP)
            pf.put("b", "a2", _value("a2", size))
            assert pf.pin_views("b", ["a2"]) == [None], "the first job is at its bound"
            for key in keys:
                pf.delete("b", key)
            pins = _pins(servers, info)
            assert pins["pins"] == 2 and pins["pinned_bytes"] == 2 * size
            with connect(second, **CLIENT_OPTIONS) as other:
                theirs = [f"b{i}" for i in range(2)]
                values = _put(other, theirs, size)
                views = other.pin_views("b", theirs)
                assert all(v is not None for v in views), "the other job may still pin"
                assert [bytes(v) for v in views] == values  # type: ignore[arg-type]
                more = [(f"c{i}", _value(f"c{i}", size)) for i in range(2)]
                other.put_many("b", more)
                assert [bytes(other.get("b", k)) for k, _ in more] == [v for _, v in more]
                del views
        finally:
            os.kill(reader.pid, signal.SIGCONT)
            reader.kill()
            reader.wait(timeout=10)
    _wait_pins(servers, info, 0, timeout_s=SWEEP_WAIT_S)


def test_a_wrong_token_or_another_jobs_pin_is_refused(
        shared_server: tuple[ServerSet, ServerInfo, JobHandle]) -> None:
    servers, info, handle = shared_server
    with connect(handle, **CLIENT_OPTIONS) as pf:
        _put(pf, ["k0"], MIB)
    other = servers.handle(servers=[info])
    with connect(other, **CLIENT_OPTIONS) as pf:
        assert pf.pin_views("b", ["k0"]) == [None], "another job's object is not its to pin"
    forged = JobHandle.from_json(handle.to_json().replace(handle.token, handle.token[:-4] + "AAAA"))
    with connect(forged, **CLIENT_OPTIONS) as pf:
        assert pf.pin_views("b", ["k0"]) == [None]
        assert isinstance(pf.get_shared("b", ["k0"])[0], PermissionDenied)
    assert _pins(servers, info)["granted_total"] == 0


_OTHER_UID = r"""
import hashlib, os, sys
from pocketflow.client import connect
from pocketflow.handle import JobHandle
os.setgid(65534)  # after the imports: nobody may not read this interpreter's files
os.setuid(65534)
handle = JobHandle.from_json(sys.stdin.readline())
with connect(handle, op_timeout_s="10s", rpc_timeout_s="10s") as pf:
    shared = pf.get_shared("b", sys.argv[1].split(","))
    digest = hashlib.sha256(b"".join(bytes(v) for v in shared)).hexdigest()
    print(digest, pf.shared_counts["pinned"], pf.shared_counts["copied"])
"""


def test_a_process_of_another_uid_copies(
        shared_server: tuple[ServerSet, ServerInfo, JobHandle]) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a child as another uid")
    servers, info, handle = shared_server
    with connect(handle, **CLIENT_OPTIONS) as pf:
        keys = [f"k{i}" for i in range(3)]
        values = _put(pf, keys, MIB)
    # A fresh interpreter that becomes nobody (not a fork of this threaded one), with a time
    # limit and ended by its pid if it overruns.
    child = subprocess.Popen([sys.executable, "-c", _OTHER_UID, ",".join(keys)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        out, err = child.communicate(handle.to_json() + "\n", timeout=60)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
    assert child.returncode == 0, err
    assert out.split() == [hashlib.sha256(b"".join(values)).hexdigest(), "0", "3"], \
        "another uid cannot map the arena: it copies"
    _wait_pins(servers, info, 0, timeout_s=5)


def test_nvme_objects_are_copied(
        server_factory: Callable[..., tuple[ServerSet, ServerInfo]]) -> None:
    servers, info = server_factory("nvme-p", "nvme", 16 * MIB)
    handle = servers.handle(servers=[info])
    with connect(handle, **CLIENT_OPTIONS) as pf:
        keys = ["a", "b"]
        values = _put(pf, keys, MIB)
        assert pf.pin_views("b", keys) == [None, None]
        assert [bytes(v) for v in pf.get_shared("b", keys)] == values  # type: ignore[arg-type]


def test_the_caches_views_are_pinned_in_place_with_copies_for_the_rest(
        server_factory: Callable[..., tuple[ServerSet, ServerInfo]], s3_server: Any,
        s3_bucket: str) -> None:
    from fixtures_s3 import boto3_client

    from pocketflow.cache.client import CacheClient, create_buckets
    from pocketflow.cache.spec import CacheSpec

    # 16 MiB of arena: the job may pin 4 MiB, so a round of 6 entries is pinned in part.
    servers, info = server_factory("cache-0", "dram", 16 * MIB, shared_dram=True)
    handle = servers.handle(servers=[info])
    with connect(handle, **CLIENT_OPTIONS) as pf:
        create_buckets(pf)
    s3 = boto3_client(s3_server)
    keys = [f"c/{i}" for i in range(6)]
    expected = [_value(k, MIB - 4096) for k in keys]
    for key, body in zip(keys, expected, strict=True):
        s3.put_object(Bucket=s3_bucket, Key=key, Body=body)
    s3.close()
    spec = CacheSpec(name="zc", handle=handle, source=s3_server, lease_ms=60_000)
    with CacheClient(spec) as cache:
        cache.get_many(s3_bucket, keys)
        cache.flush()
        views = cache.get_views(s3_bucket, keys)
        assert [bytes(v) for v in views] == expected
        kinds = [type(v.obj).__name__ for v in views]
        assert kinds.count("SharedView") == 4, kinds  # the job's 4 MiB of pins, then copies
        assert cache.stats.pinned == 4
        assert _pins(servers, info)["refused_total"] == 2
        del views
    _wait_pins(servers, info, 0, timeout_s=SWEEP_WAIT_S)
    assert _pins(servers, info)["swept_total"] == 0, "the views' pins were unpinned"


def test_unpins_go_through_after_the_jobs_map_changed(
        shared_server: tuple[ServerSet, ServerInfo, JobHandle]) -> None:
    servers, info, handle = shared_server
    with connect(handle, **CLIENT_OPTIONS) as pf:
        _put(pf, ["k0", "k1"], MIB)
        views = pf.pin_views("b", ["k0", "k1"])
        assert _pins(servers, info)["pins"] == 2
        # The job moves to epoch 2; this client still holds epoch 1's map.
        servers.set_epoch(handle.replace(epoch=2))
        del views
        _wait_pins(servers, info, 0, timeout_s=5)


_OTHER_NAMESPACE = r"""
import hashlib, os, sys
from pocketflow.client import connect
from pocketflow.handle import JobHandle
handle = JobHandle.from_json(sys.stdin.readline())
with connect(handle, op_timeout_s="10s", rpc_timeout_s="10s") as pf:
    shared = pf.get_shared("b", sys.argv[1].split(","))
    digest = hashlib.sha256(b"".join(bytes(v) for v in shared)).hexdigest()
    print(os.getpid(), digest, pf.shared_counts["pinned"], pf.shared_counts["copied"])
"""


def test_a_reader_in_another_pid_namespace_gives_its_pins_back_and_copies(
        shared_server: tuple[ServerSet, ServerInfo, JobHandle]) -> None:
    if os.getuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a new pid namespace")
    servers, info, handle = shared_server
    keys = [f"k{i}" for i in range(3)]
    with connect(handle, **CLIENT_OPTIONS) as pf:
        values = _put(pf, keys, MIB)
    result = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", _OTHER_NAMESPACE, ",".join(keys)],
        input=handle.to_json() + "\n", capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    pid, digest, pinned, copied = result.stdout.split()
    assert pid == "1", "the reader is its namespace's first process"
    assert digest == hashlib.sha256(b"".join(values)).hexdigest()
    assert (pinned, copied) == ("0", "3")
    # Its pins were taken under pid 1, which names the server side's init (never swept): they
    # went because the reader gave them back.
    pins = _pins(servers, info)
    assert pins["granted_total"] >= 1 and pins["pins"] == 0 and pins["swept_total"] == 0


def test_keys_whose_home_moved_are_pinned_at_their_earlier_home(
        server_factory: Callable[..., tuple[ServerSet, ServerInfo]]) -> None:
    servers, first = server_factory("grow-0", "dram", 64 * MIB, shared_dram=True)
    _, added = server_factory("grow-1", "dram", 64 * MIB, shared_dram=True)
    before = servers.handle(servers=[first])
    keys = [f"k{i}" for i in range(12)]
    with connect(before, **CLIENT_OPTIONS) as pf:
        values = _put(pf, keys, MIB)
    # Grown: about half the keys' homes are now the added server, where nothing of them is.
    grown = before.replace(epoch=2, servers=(first, added), earlier=before.earlier_after())
    servers.set_epoch(grown)
    with connect(grown, **CLIENT_OPTIONS) as pf:
        views = pf.pin_views("b", keys)
        assert [bytes(v) for v in views] == values  # type: ignore[arg-type]
        assert pf.shared_counts["pinned"] == len(keys)
        assert _pins(servers, first)["granted_total"] == len(keys)
        assert _pins(servers, added)["granted_total"] == 0
        del views
        _wait_pins(servers, first, 0, timeout_s=5)


def test_a_stale_unpin_never_releases_a_restarted_servers_pin(
        shared_server: tuple[ServerSet, ServerInfo, JobHandle]) -> None:
    servers, info, handle = shared_server
    with connect(handle, **CLIENT_OPTIONS) as pf:
        _put(pf, ["old"], MIB)
        old = pf.pin_views("b", ["old"])  # the first pin of the first server
        assert old[0] is not None
        first = servers.process(info.node_id)
        os.kill(first.pid, signal.SIGKILL)
        first.stop()
        # Another server at the same address: its pins are not the first one's.
        again = ServerAt(ServerSpec(node_id=info.node_id, tier="dram", capacity_bytes=32 * MIB,
                                    secret_file=servers.secret_file, threads=SERVER_THREADS,
                                    shared_dram=True), info.address)
        servers.processes.append(again)
        assert again.start() == info.address
        servers.set_epoch(handle)
        keys = [f"new{i}" for i in range(4)]
        values = _put(pf, keys, MIB)
        new = pf.pin_views("b", keys)
        assert _pins(servers, info)["pins"] == 4
        # The old view's unpin goes to the new server; then one of 2 MiB, unpinned after it by
        # the same thread: once its bytes are gone, so was the old unpin sent.
        del old
        pf.put("b", "marker", _value("marker", 2 * MIB))
        marker = pf.pin_views("b", ["marker"])
        del marker
        start = time.monotonic()
        while True:
            pins = _pins(servers, info)
            if pins["pinned_bytes"] < 6 * MIB:
                break
            assert time.monotonic() - start < SWEEP_WAIT_S, pins
            time.sleep(0.02)
        assert (pins["pins"], pins["pinned_bytes"]) == (4, 4 * MIB), \
            "the old server's unpin released none of the new server's pins"
        assert [bytes(v) for v in new] == values  # type: ignore[arg-type]
        del new
        _wait_pins(servers, info, 0, timeout_s=SWEEP_WAIT_S)


def _arena_mappings() -> int:
    """This process's mappings of a server's shared arena."""
    with open("/proc/self/maps") as maps:
        return sum("pocketflow-dram" in line for line in maps)


def test_views_outliving_their_client_still_unpin_and_a_dead_servers_arena_is_unmapped(
        shared_server: tuple[ServerSet, ServerInfo, JobHandle]) -> None:
    servers, info, handle = shared_server
    before = _arena_mappings()
    keys = [f"k{i}" for i in range(3)]
    with connect(handle, **CLIENT_OPTIONS) as pf:
        values = _put(pf, keys, MIB)
        views = pf.pin_views("b", keys)
        assert _pins(servers, info)["pins"] == 3
    # Closed: the views still read, and their pins go when they do.
    assert [bytes(v) for v in views] == values  # type: ignore[arg-type]
    del views
    _wait_pins(servers, info, 0, timeout_s=SWEEP_WAIT_S)
    # The client dropped as well as closed, then the views.
    pf = connect(handle, **CLIENT_OPTIONS)
    views = pf.pin_views("b", keys)
    assert _pins(servers, info)["pins"] == 3
    pf.close()
    del pf
    del views
    _wait_pins(servers, info, 0, timeout_s=SWEEP_WAIT_S)
    assert _pins(servers, info)["swept_total"] == 0, "unpinned, not swept"
    # A server that dies: once no view holds its arena, this process maps it no more, with
    # the client still open.
    with connect(handle, **CLIENT_OPTIONS) as pf:
        views = pf.pin_views("b", keys)
        assert _arena_mappings() == before + 1
        process = servers.process(info.node_id)
        os.kill(process.pid, signal.SIGKILL)
        process.stop()
        assert [bytes(v) for v in views] == values  # type: ignore[arg-type]
        del views
        assert _arena_mappings() == before


def test_a_forked_childs_inherited_views_keep_their_bytes_after_the_parent_unpins(
        shared_server: tuple[ServerSet, ServerInfo, JobHandle]) -> None:
    servers, info, handle = shared_server
    with connect(handle, **CLIENT_OPTIONS) as pf:
        value = _put(pf, ["z"], MIB)[0]
        view = pf.pin_views("b", ["z"])[0]
        assert view is not None
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            code = 1
            try:
                os.close(to_child_w)
                os.close(from_child_r)
                os.read(to_child_r, 1)  # until the parent has unpinned and refilled the arena
                os.write(from_child_w, hashlib.sha256(view).hexdigest().encode())
                code = 0
            finally:
                os._exit(code)
        os.close(to_child_r)
        os.close(from_child_w)
        done, status = 0, 0
        try:
            # The parent drops its view (its pin goes), deletes the object and fills the arena
            # with other bytes: the freed extent is reused.
            del view
            _wait_pins(servers, info, 0, timeout_s=SWEEP_WAIT_S)
            pf.delete("b", "z")
            filled = 0
            with pytest.raises(CapacityExhausted):
                for i in range(40):
                    pf.put("b", f"fill{i}", b"\xee" * MIB)
                    filled += 1
            assert filled >= 28
            os.write(to_child_w, b"g")
            got = b""
            deadline = time.monotonic() + 60
            while len(got) < 64 and time.monotonic() < deadline:
                chunk = os.read(from_child_r, 64 - len(got))
                if not chunk:
                    break
                got += chunk
            while time.monotonic() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                time.sleep(0.02)
        finally:
            if not done:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            os.close(to_child_w)
            os.close(from_child_r)
        assert done and os.WEXITSTATUS(status) == 0
        assert got.decode() == hashlib.sha256(value).hexdigest(), \
            "the child's view kept the object's bytes"
