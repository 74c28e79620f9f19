"""The native loopback peer (``tcp-native``): the Rust ``pocketflow-loopback`` server and client
as the benchmark runs them, and their framing against the Python TCP peer's. Real processes
throughout; nothing here asserts a speed."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.peers import TcpPeer  # noqa: E402
from benchmarks.pool import ClientPool, PhaseError  # noqa: E402
from benchmarks.process import ServerStartError  # noqa: E402
from benchmarks.tcp import TcpClient  # noqa: E402
from benchmarks.tcp_native import (  # noqa: E402
    BINARY_ENV,
    NativeClientError,
    NativeTcpPeer,
    NativeTcpSpec,
    loopback_binary,
)
from benchmarks.workloads import DELETE, GET, GET_MANY, PUT, PUT_MANY, KiB, run_phase  # noqa: E402

OBJECT_MAX_BYTES = 256 * KiB


@pytest.fixture
def native_peer() -> Iterator[NativeTcpPeer]:
    if loopback_binary() is None:
        pytest.fail("pocketflow-loopback is not built: run `make install`")
    peer = NativeTcpPeer(object_max_bytes=OBJECT_MAX_BYTES)
    peer.start()
    yield peer
    peer.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is gone too.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_the_pool_runs_every_shape_in_native_clients(native_peer: NativeTcpPeer) -> None:
    spec = native_peer.spec()
    keys = [[f"c{c}/{i}" for i in range(250)] for c in range(2)]
    prefixes = ["c0/", "c1/"]
    with ClientPool(2) as pool:
        for phase, size, latencies in (
            (PUT, 200 * KiB, 250), (GET, 200 * KiB, 250), (PUT_MANY, KiB, 3), (GET_MANY, KiB, 3),
        ):
            results = pool.run(spec, phase, prefixes=prefixes, keys=keys, size_bytes=size,
                               batch_ops=100)
            for result in results:
                assert (result.phase, result.ops, result.bytes) == (phase, 250, 250 * size)
                assert len(result.latencies_ns) == latencies
                assert all(n > 0 for n in result.latencies_ns)
                assert result.start_ns <= result.end_ns
            # The two clients started together, on the driver's clock.
            starts = sorted(r.start_ns for r in results)
            assert starts[1] - starts[0] < 10**9
        pool.run(spec, DELETE, prefixes=prefixes, keys=keys, size_bytes=KiB)
        # A GET larger than the server holds ends that client's connection: a phase error
        # that says why, and the pool is still usable after the client is forgotten.
        with pytest.raises(PhaseError, match="connection closed"):
            pool.run(NativeTcpSpec(port=spec.port, binary=spec.binary,
                                   object_max_bytes=2 * OBJECT_MAX_BYTES),
                     GET, prefixes=["x/"], keys=[["x/0"]], size_bytes=2 * OBJECT_MAX_BYTES)
        (again,) = pool.run(spec, GET, prefixes=["y/"], keys=[["y/0"]], size_bytes=KiB)
        assert again.ops == 1


def test_a_phase_time_bound_stops_the_native_loop(native_peer: NativeTcpPeer) -> None:
    client = native_peer.spec().connect()
    try:
        keys = [str(i) for i in range(100_000)]
        result = run_phase(client, PUT, prefix="", keys=keys, size_bytes=KiB, seconds_max=0.05)
        assert 1 <= result.ops < len(keys)
        assert len(result.latencies_ns) == result.ops
    finally:
        client.close()


def test_the_native_and_python_peers_speak_one_framing(native_peer: NativeTcpPeer) -> None:
    # The Python client against the native server.
    spec = native_peer.spec()
    python_client = TcpClient(spec.host, spec.port)
    try:
        python_client.put(b"x" * 100_000)
        assert len(python_client.get(OBJECT_MAX_BYTES)) == OBJECT_MAX_BYTES
        python_client.put_many([b"a" * 10, b"b" * 20])
        assert [len(v) for v in python_client.get_many([3, 0, 7])] == [3, 0, 7]
    finally:
        python_client.close()
    # The native client against the Python server.
    python_peer = TcpPeer(object_max_bytes=OBJECT_MAX_BYTES)
    python_peer.start()
    try:
        client = NativeTcpSpec(port=python_peer.spec().port, binary=spec.binary,
                               object_max_bytes=OBJECT_MAX_BYTES).connect()
        try:
            keys = [str(i) for i in range(20)]
            for phase in (PUT, GET, PUT_MANY, GET_MANY):
                result = run_phase(client, phase, prefix="", keys=keys,
                                   size_bytes=OBJECT_MAX_BYTES // 4, batch_ops=8)
                assert (result.ops, result.bytes) == (20, 20 * OBJECT_MAX_BYTES // 4)
        finally:
            client.close()
    finally:
        python_peer.stop()


def test_stopping_leaves_no_process(native_peer: NativeTcpPeer) -> None:
    server_pid = native_peer.pid
    client = native_peer.spec().connect()
    client_pid = client._proc.pid
    assert server_pid is not None and _alive(server_pid) and _alive(client_pid)
    client.close()
    assert not _alive(client_pid)
    with pytest.raises(NativeClientError, match="gone"):
        client.timed_phase(GET, keys=["k"], size_bytes=1, batch_ops=1, start_at_ns=None,
                           seconds_max=None)
    native_peer.stop()
    assert not _alive(server_pid)


def test_a_missing_binary_is_a_clear_start_error(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "nothing-here"))
    peer = NativeTcpPeer()
    with pytest.raises(ServerStartError, match="make install"):
        peer.start()
    peer.stop()
