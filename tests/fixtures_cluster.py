"""Pytest plugin: one embedded local cluster (Ray + real storage servers) for the whole session."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from pocketflow.cluster import LocalCluster
from pocketflow.errors import ServerStartError
from pocketflow.server_process import find_server_binary

STATS_SETTLE_TIMEOUT_S = 10.0
"""How long to wait for the servers' statistics (sampled every second) to show a change."""


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    """The session's local cluster: 2 DRAM servers (long-running) and 1 NVMe server.

    Ray is started once, pinned to 2 CPUs with a small object store; everything the cluster
    started is stopped by process id at the end of the session, also when tests failed.
    """
    try:
        find_server_binary()
    except ServerStartError as exc:
        pytest.skip(f"storage server binary not built: {exc}")
    cluster = LocalCluster(
        dram_servers=2,
        nvme_servers=1,
        dram_capacity="128MiB",
        nvme_capacity="256MiB",
        block_size="1MiB",
        num_cpus=2,
        object_store_memory="80MiB",
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def used_bytes(cluster: LocalCluster) -> dict[str, int]:
    """``node_id -> used_bytes`` from the servers' latest statistics."""
    return {s["node_id"]: int(s["used_bytes"]) for s in cluster.status()["servers"]}


def wait_for(
    predicate: Callable[[], bool], *, timeout_s: float = STATS_SETTLE_TIMEOUT_S
) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
