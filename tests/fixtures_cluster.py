"""Pytest plugin: one embedded local cluster (Ray + real storage servers) for the whole session,
and what tests need to add a server of their own to it (to kill or stop) and find its keys."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from pocketflow.cluster import LocalCluster
from pocketflow.control import CONTROLLER_ACTOR_NAME, NAMESPACE
from pocketflow.control.storage_node import StorageNode, StorageNodeInfo
from pocketflow.errors import ServerStartError
from pocketflow.handle import JobHandle
from pocketflow.placement import Placement
from pocketflow.server_process import find_server_binary

STATS_SETTLE_TIMEOUT_S = 10.0
"""How long to wait for the servers' statistics (sampled every second) to show a change."""
DEAD_AFTER_S = 3.0
"""The session cluster's default ``dead_after``."""
DETECTION_SLACK_S = 3.5
"""Allowed lateness of the failure detector on a loaded 2-core machine."""
PLACED_KEYS = 48
"""How many test keys :func:`keys_on` places at least."""
PLACED_KEYS_MAX = 4096
"""Most test keys :func:`keys_on` draws while too few land on (or off) the node."""


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    """The session's local cluster: 2 DRAM servers and 1 NVMe server, all long-running.

    Ray is started once, pinned to 2 CPUs with a small object store; everything the cluster
    started is stopped by process id at the end of the session, also when tests failed.
    """
    try:
        find_server_binary()
    except ServerStartError as exc:
        # A missing binary is a broken install, not a reason to pass: fail every cluster test.
        pytest.fail(f"storage server binary not built ({exc}); run `make install`", pytrace=False)
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


@contextmanager
def extra_server(
    cluster: LocalCluster, *, prefix: str = "extra", capacity_bytes: int = 64 * 1024 * 1024
) -> Iterator[tuple[StorageNodeInfo, Any]]:
    """A DRAM server added to the session cluster for one test (to kill or stop), removed after.

    Yields its info and its ``StorageNode`` actor. Afterwards the controller forgets it (declared
    dead unless it already is), its process is killed by pid and its actor is killed, so the
    session's own servers are never touched.
    """
    import ray

    node_id = f"{prefix}-{uuid.uuid4().hex[:6]}"
    node = ray.remote(StorageNode).options(namespace=NAMESPACE, num_cpus=0).remote(
        node_id=node_id,
        tier="dram",
        capacity_bytes=capacity_bytes,
        secret=cluster.secret,
    )
    info = ray.get(node.start.remote(), timeout=60)
    controller = ray.get_actor(CONTROLLER_ACTOR_NAME, namespace=NAMESPACE)
    ray.get(controller.add_server.remote(info, node), timeout=30)
    try:
        yield info, node
    finally:
        ray.get(controller.declare_dead.remote(node_id, reason="test over"), timeout=60)
        if info.server_process().alive():
            os.kill(info.server_pid, signal.SIGKILL)
        ray.kill(node, no_restart=True)


@pytest.fixture
def added_server(local_cluster: LocalCluster) -> Iterator[tuple[StorageNodeInfo, Any]]:
    """A DRAM server of this test only, to kill or stop (see :func:`extra_server`)."""
    with extra_server(local_cluster, prefix="extra") as added:
        yield added


def controller_actor() -> Any:
    """The session cluster's controller actor."""
    import ray

    return ray.get_actor(CONTROLLER_ACTOR_NAME, namespace=NAMESPACE)


def keys_on(
    handle: JobHandle, node_id: str, *, on_min: int = 1, off_min: int = 1
) -> tuple[list[str], list[str]]:
    """Of test keys ``k0``, ``k1``, ..., those ``handle``'s map places on ``node_id`` and those
    it places elsewhere: ``PLACED_KEYS`` keys, and more (up to ``PLACED_KEYS_MAX``) while
    fewer than ``on_min`` land on the node or fewer than ``off_min`` elsewhere. A node of
    small weight in a job's map (the map depends on the job, whose id is random) may get one
    key of ``PLACED_KEYS`` or none."""
    placement = Placement(handle.servers)
    on: list[str] = []
    off: list[str] = []
    for i in range(PLACED_KEYS_MAX):
        if i >= PLACED_KEYS and len(on) >= on_min and len(off) >= off_min:
            break
        key = f"k{i}"
        (on if placement.server_for(key.encode(), 0).node_id == node_id else off).append(key)
    return on, off
