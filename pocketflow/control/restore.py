"""Restore after a crash: one loader reads what survives a controller (the ``StorageNode``
actors, the ``Metadata`` log) and hands each role its records."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pocketflow.control import NAMESPACE, STORAGE_NODE_ACTOR_PREFIX
from pocketflow.control.epochs import Epochs
from pocketflow.control.job_ends import JobEnds
from pocketflow.control.job_leases import JobLeases
from pocketflow.control.job_table import JobTable
from pocketflow.control.membership import Membership
from pocketflow.control.prefix_routes import PrefixRoutes
from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.handle import LostServer

log = logging.getLogger(__name__)

RESTORE_SERVERS_MAX = 4096
"""Most storage nodes a restarted controller takes back."""

RESTORE_CALL_TIMEOUT_S = 5.0
"""Deadline of each call to a ``StorageNode`` actor while restoring."""

RESTORED_LEASE_GRACE_S = 10.0
"""Shortest life of a job lease taken back from the log: the driver's renewals failed while the
controller came up and back off (``pocketflow.job.RENEW_BACKOFF_MAX_S``, or a third of the lease);
the first one that reaches the new instance must find the job still there."""


@dataclass(frozen=True)
class RestoredNode:
    """A ``StorageNode`` found by a restarted controller: its server's info, whether the
    server's process runs, and its latest ``stats`` (``None`` if they could not be read)."""

    info: StorageNodeInfo
    node: Any
    alive: bool
    stats: dict[str, Any] | None = None


@dataclass(frozen=True)
class InitData:
    """What a restarted controller starts from: the storage nodes, the jobs' log records and
    the sizing history."""

    nodes: list[RestoredNode] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    sizing: list[dict[str, Any]] = field(default_factory=list)
    """The sizing actions the crashed instance logged, oldest first."""
    endings: dict[str, list[str]] = field(default_factory=dict)
    """Ended jobs whose end some server had not confirmed: ``job_id -> node ids``."""


def restarted_by_ray() -> bool:
    """Whether this process is a Ray actor that Ray restarted after a crash."""
    if "ray" not in sys.modules:
        return False
    import ray

    if not ray.is_initialized():
        return False
    try:
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not inside an actor
        return False


def load_init_data(call_metadata: Callable[..., Any]) -> InitData:
    """Read the storage nodes from their named ``StorageNode`` actors (which go on sending
    heartbeats to the restarted actor), the jobs and the sizing history from the ``Metadata``
    records. A node that cannot answer is left out."""
    import ray

    names = sorted(
        str(entry["name"])
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry.get("namespace") == NAMESPACE
        and str(entry.get("name", "")).startswith(STORAGE_NODE_ACTOR_PREFIX)
    )
    nodes = []
    for name in names[:RESTORE_SERVERS_MAX]:
        try:
            node = ray.get_actor(name, namespace=NAMESPACE)
            info, alive = ray.get(
                [node.info.remote(), node.alive.remote()], timeout=RESTORE_CALL_TIMEOUT_S
            )
        except Exception as exc:  # noqa: BLE001 - a node that cannot answer is left out
            log.warning("restart: storage node %s did not answer: %s", name, exc)
            continue
        stats = None
        if alive:
            try:
                stats = ray.get(node.stats.remote(), timeout=RESTORE_CALL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - the next heartbeat brings them
                log.warning("restart: stats of %s failed: %s", info.node_id, exc)
        nodes.append(RestoredNode(info, node, bool(alive), stats))
    return InitData(
        nodes=nodes,
        jobs=list(call_metadata("jobs")),
        sizing=list(call_metadata("sizing_actions")),
        endings=dict(call_metadata("endings")),
    )


def restore(
    init: InitData,
    *,
    membership: Membership,
    jobs: JobTable,
    leases: JobLeases,
    routes: PrefixRoutes,
    epochs: Epochs,
    ends: JobEnds,
    add_server: Callable[[StorageNodeInfo, Any], None],
    launched: dict[str, Any] | None = None,
    end_node: Callable[[Any, str], None] | None = None,
) -> dict[str, Any]:
    """Rebuild the roles' tables from ``init``, under the controller's lock: the live servers
    (``add_server``, which starts their heartbeats), dead ones from nodes whose process is gone
    and from the jobs' ``lost`` lists, draining marks from the servers' own stats, the jobs with
    a new token each and a new lease for each job that had one (at least
    ``RESTORED_LEASE_GRACE_S``), and the prefix grants from the jobs' records. Jobs whose map
    names a server that is not back move to a new epoch without it; every server is then sent
    every live job's map again (retried until it confirms), and the job ends the crashed
    instance had not finished go on. Tasks notice nothing: they talk to the servers.

    Servers the crashed instance launched (detached ``StorageNode`` actors, ``info.launched``)
    go back into ``launched``, the controller's table of the nodes it stops when it closes; the
    node of a launched server whose process is gone is ended with ``end_node(node, node_id)``
    (it would hold its Ray node's storage slot for good).

    Returns ``{"servers", "jobs", "leases", "grants"}``.
    """
    servers: list[str] = []
    for found in init.nodes:
        info = found.info
        if not found.alive:
            membership.remember_dead(
                info.node_id, address=info.address, tier=info.tier,
                reason="its process was gone when the controller restarted",
            )
            if info.launched and end_node is not None:
                end_node(found.node, info.node_id)
            continue
        add_server(info, found.node)
        if info.launched and launched is not None:
            launched[info.node_id] = found.node
        servers.append(info.node_id)
        if found.stats is None:
            continue
        membership.take_stats(info.node_id, found.stats)
        if found.stats.get("draining"):
            membership.draining.add(info.node_id)
    now_s = time.monotonic()
    restored_jobs: list[str] = []
    restored_leases: dict[str, int] = {}
    logged_grants: dict[str, object] = {}
    for record in init.jobs:
        job_id = str(record["job_id"])
        jobs.put(jobs.from_metadata(record))
        if record.get("lease_ms"):
            leases.start(job_id, lease_ms=int(record["lease_ms"]), now_s=now_s,
                         at_least_s=RESTORED_LEASE_GRACE_S)
            restored_leases[job_id] = int(record["lease_ms"])
        if record.get("grants"):
            logged_grants[job_id] = record["grants"]
        restored_jobs.append(job_id)
    grants = routes.restore(logged_grants, now_s)
    # Servers in the jobs' maps that are gone are lost now, as the failure detector would have
    # declared them: their jobs move to new epochs without them.
    gone = {
        s.node_id: LostServer(s.node_id, s.address)
        for record in jobs.records() for s in record.handle.servers
        if s.node_id not in membership
    }
    for lost in gone.values():
        moved = epochs.move_off_lost(lost)
        log.warning("restart: %s is gone; moved jobs %s off it", lost.node_id, moved)
    # Every server is told every live job's current map (the crash may have cut a registration
    # or an epoch move short), and the ends the crashed instance had not finished go on.
    epochs.resync()
    ends.restore(init.endings)
    for job_id, record in jobs.items():
        for lost in record.handle.lost:
            membership.remember_dead(
                lost.node_id, address=lost.address, tier="unknown", keep_known=True,
                reason=f"lost by job {job_id} before the controller restarted",
            )
    log.warning("restarted after a crash: restored %d storage servers, %d jobs and %d "
                "prefix grants", len(servers), len(restored_jobs), grants)
    return {"servers": servers, "jobs": restored_jobs, "leases": restored_leases,
            "grants": grants}
