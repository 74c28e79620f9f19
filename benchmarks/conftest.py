"""Fixtures of the pytest-benchmark suite: the peers, started once per session, stopped by pid.

``--bench-peers`` picks the peers (default ``pocketflow-dram,redis,tcp``); every test that takes
the ``peer`` fixture runs once per peer. The pocketflow cluster is started only if a pocketflow
peer is chosen, and the peers are skipped (not failed) when the storage server is not built.
A test marked ``@pytest.mark.peers("redis", ...)`` runs only on those of the chosen peers (an
operation some peers do not have); with none of them chosen it is skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.peers import Peer, PocketflowPeer, RedisPeer, S3Peer, TcpPeer
from benchmarks.workloads import MiB

DEFAULT_PEERS = "pocketflow-dram,redis,tcp"
KNOWN_PEERS = ("pocketflow-dram", "pocketflow-nvme", "redis", "s3", "tcp")
OBJECT_MAX_BYTES = 64 * MiB


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--bench-peers``: comma-separated peers to measure."""
    parser.addoption(
        "--bench-peers", default=DEFAULT_PEERS,
        help=f"comma-separated subset of {','.join(KNOWN_PEERS)} (default {DEFAULT_PEERS})",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Declare the ``peers`` marker."""
    config.addinivalue_line(
        "markers", "peers(*names): run the test only on these of the --bench-peers"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize every test that uses ``peer`` over the chosen peers (and its marker's)."""
    if "peer" in metafunc.fixturenames:
        names = [n.strip() for n in metafunc.config.getoption("--bench-peers").split(",")]
        unknown = sorted(set(names) - set(KNOWN_PEERS))
        if unknown:
            raise pytest.UsageError(f"unknown --bench-peers {unknown}; known: {KNOWN_PEERS}")
        marker = metafunc.definition.get_closest_marker("peers")
        if marker is not None:
            names = [n for n in names if n in marker.args]
        metafunc.parametrize("peer", names, indirect=True, scope="session")


@pytest.fixture(scope="session")
def pocketflow_cluster() -> Iterator[Any]:
    """A local pocketflow cluster (2 DRAM servers, 1 NVMe server) for the whole session."""
    from pocketflow.cluster import LocalCluster
    from pocketflow.errors import ServerStartError
    from pocketflow.server_process import find_server_binary

    try:
        find_server_binary()
    except ServerStartError as exc:
        pytest.skip(f"pocketflow storage server not built: {exc}")
    with LocalCluster(
        dram_servers=2, nvme_servers=1, dram_capacity="512MiB", nvme_capacity="1GiB"
    ) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def peer(request: pytest.FixtureRequest) -> Iterator[Peer]:
    """One started peer (by name, from the parametrization)."""
    name = request.param
    started: Peer
    if name.startswith("pocketflow-"):
        cluster = request.getfixturevalue("pocketflow_cluster")
        started = PocketflowPeer(cluster, tier=name.removeprefix("pocketflow-"))
    elif name == "redis":
        started = RedisPeer()
    elif name == "s3":
        started = S3Peer()
    else:
        started = TcpPeer(object_max_bytes=OBJECT_MAX_BYTES)
    try:
        started.start()
        yield started
    finally:
        started.stop()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """A table of the percentiles and throughput each benchmark put in ``extra_info``."""
    session = getattr(config, "_benchmarksession", None)
    benchmarks = getattr(session, "benchmarks", None) or []
    rows = [
        (b.group or "", b.name, b.extra_info) for b in benchmarks
        if b.extra_info and "p50_us" in b.extra_info
    ]
    if not rows:
        return
    terminalreporter.section("p50 / p99 latency and throughput (from the raw round timings)")
    group_width = max(24, *(len(group) for group, _, _ in rows))
    name_width = max(42, *(len(name) for _, name, _ in rows))
    terminalreporter.line(
        f"{'group':<{group_width}} {'test':<{name_width}} {'p50 us':>10} {'p99 us':>10} "
        f"{'ops/s':>10} {'GB/s':>8}"
    )
    for group, name, info in sorted(rows):
        terminalreporter.line(
            f"{group:<{group_width}} {name:<{name_width}} {info['p50_us']:>10.1f} "
            f"{info['p99_us']:>10.1f} {info['ops_per_s']:>10.0f} {info['gb_per_s']:>8.3f}"
        )
    terminalreporter.line(
        f"(ops/s counts objects, listed keys or jobs; 1-minute load average at the end: "
        f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs)"
    )
