"""Helpers for the tests of the control plane's role modules, which build them without Ray:
real storage servers under ``StorageNode`` objects of this process, and the roles wired as the
``Controller`` wires them."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pocketflow.auth import read_secret_file
from pocketflow.control.admin import AdminTokens
from pocketflow.control.allocator import Allocator
from pocketflow.control.draining import Drainer
from pocketflow.control.epochs import Epochs
from pocketflow.control.hints import demand_from_hints
from pocketflow.control.job_ends import JobEnds
from pocketflow.control.job_leases import JobLeases
from pocketflow.control.job_table import JobRecord, JobTable
from pocketflow.control.membership import Membership
from pocketflow.control.metadata import Metadata
from pocketflow.control.metadata_calls import MetadataCalls
from pocketflow.control.nodes import DirectNodes
from pocketflow.control.prefix_grants import PrefixGrants
from pocketflow.control.prefix_routes import PrefixRoutes
from pocketflow.control.storage_node import StorageNode, StorageNodeInfo
from pocketflow.handle import JobHandle

ADMIN_TIMEOUT_S = 3.0
FAN_OUT_BOUND_S = 2 * ADMIN_TIMEOUT_S
"""How long a fan-out over hung servers may take: one admin deadline, with generous slack for a
loaded machine (a bound that ends the wait, not a speed)."""
BLOCK_SIZE_BYTES = 1024 * 1024
TOKEN_TTL_S = 3600.0


def start_node(
    secret_file: Path,
    node_id: str,
    *,
    tier: str = "dram",
    capacity_bytes: int = 16 * 1024 * 1024,
    long_running: bool = False,
    data_dir: Path | None = None,
) -> tuple[StorageNode, StorageNodeInfo]:
    """A ``StorageNode`` object of this process (no Ray) with its server started."""
    nvme_path = str(data_dir / f"{node_id}.img") if tier == "nvme" and data_dir else None
    node = StorageNode(
        node_id=node_id, tier=tier, capacity_bytes=capacity_bytes,
        secret=read_secret_file(secret_file), long_running=long_running, nvme_path=nvme_path,
        threads=1,
    )
    return node, node.start()


@dataclass
class Roles:
    """The role modules wired as the ``Controller`` wires them, without Ray."""

    secret_file: Path
    metadata: Metadata
    membership: Membership
    jobs: JobTable
    leases: JobLeases
    allocator: Allocator
    epochs: Epochs
    routes: PrefixRoutes
    drainer: Drainer
    admin: AdminTokens
    nodes: DirectNodes
    ends: JobEnds
    retry_admin: AdminTokens
    """The monitor thread's admin connections (retries)."""
    lock: threading.RLock = field(default_factory=threading.RLock)
    started: list[StorageNode] = field(default_factory=list)

    def add(self, node: StorageNode, info: StorageNodeInfo) -> None:
        self.membership.add(info, node)

    def start(self, node_id: str, **options: Any) -> StorageNodeInfo:
        """Start one more server and add it."""
        node, info = start_node(self.secret_file, node_id, **options)
        self.started.append(node)
        self.add(node, info)
        return info


@contextmanager
def roles(
    secret_file: Path, *, metadata: Metadata | None = None, **allocator_options: Any
) -> Iterator[Roles]:
    """The roles over no servers yet (add them with :meth:`Roles.start`), logging to
    ``metadata`` (default: a fresh one); every server started through them is stopped by pid
    at the end."""
    metadata = Metadata() if metadata is None else metadata
    calls = MetadataCalls(metadata)
    membership = Membership()
    jobs = JobTable(
        secret=read_secret_file(secret_file), token_ttl_s=TOKEN_TTL_S,
        block_size_bytes=BLOCK_SIZE_BYTES, tls_ca=None,
    )
    grants = PrefixGrants()
    admin = AdminTokens(read_secret_file(secret_file), timeout_s=ADMIN_TIMEOUT_S)
    nodes = DirectNodes()
    lock = threading.RLock()
    changed = threading.Condition(lock)
    allocator = Allocator(
        membership, jobs, grants,
        cluster_spec=allocator_options.get("cluster_spec"), launcher=None,
        register_timeout_s=10.0, add_server=membership.add,
    )
    epochs = Epochs(jobs, allocator, grants, membership, admin=admin, call_metadata=calls)
    retry_admin = AdminTokens(read_secret_file(secret_file), timeout_s=ADMIN_TIMEOUT_S)
    ends = JobEnds(membership, admin=admin, retry_admin=retry_admin, call_metadata=calls)
    routes = PrefixRoutes(grants, jobs, membership, allocator, epochs, wake=changed.notify_all)
    drainer = Drainer(membership, jobs, epochs, allocator, admin=admin, nodes=nodes)
    built = Roles(
        secret_file=secret_file, metadata=metadata, membership=membership, jobs=jobs,
        leases=JobLeases(calls), allocator=allocator, epochs=epochs, routes=routes,
        drainer=drainer, admin=admin, nodes=nodes, lock=lock, ends=ends,
        retry_admin=retry_admin,
    )
    try:
        yield built
    finally:
        built.leases.close()
        admin.close()
        retry_admin.close()
        for node in built.started:
            node.stop()


def register(built: Roles, name: str, hints: dict[str, Any] | None = None) -> JobHandle:
    """Register a job on the roles' servers the way the controller does (packed, told to its
    servers, logged, recorded); returns its handle."""
    demand = demand_from_hints(hints or {}, built.allocator.spec())
    job_id = built.jobs.new_job_id(name)
    handle = built.jobs.new_handle(
        job_id, name, built.allocator.server_infos(built.allocator.pack_new(demand))
    )
    built.epochs.announce(handle, demand)
    record = JobRecord(handle=handle, hints=dict(hints or {}), registered_at_unix_s=time.time(),
                       demand=demand.to_dict())
    built.metadata.put_job(record.to_metadata())
    built.jobs.put(record)
    return handle


STOP_WAIT_S = 10.0
"""How long :func:`sigstop` waits for every thread of the process to be stopped."""


def sigstop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped (a thread running on another
    core when the signal is sent may otherwise still answer a request sent right after)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + STOP_WAIT_S
    while not all(_thread_state(pid, task) in ("T", "t", None)
                  for task in os.listdir(f"/proc/{pid}/task")):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.01)


def _thread_state(pid: int, task: str) -> str | None:
    try:
        with open(f"/proc/{pid}/task/{task}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None  # the thread ended


CONFIRM_WAIT_S = 30.0
"""How long a test runs the monitor's retries for servers that answer again to confirm."""


def retry_until_confirmed(built: Roles, never: str) -> None:
    """Run the monitor loop's retry pass (``due``, ``send``, ``settle``) until every server
    confirmed its job's epoch; fails with ``never`` after ``CONFIRM_WAIT_S``."""
    deadline = time.monotonic() + CONFIRM_WAIT_S
    while built.epochs.unconfirmed():
        assert time.monotonic() < deadline, never
        time.sleep(0.2)
        with built.lock:
            due = built.epochs.due()
        confirmed, failed = Epochs.send(due, built.retry_admin)
        with built.lock:
            built.epochs.settle(confirmed, failed)
