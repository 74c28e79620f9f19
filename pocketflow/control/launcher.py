"""Starting storage servers on demand: one ``StorageNode`` Ray actor per server, bounded waits."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pocketflow.control import NAMESPACE, STORAGE_NODE_ACTOR_PREFIX
from pocketflow.control.storage_node import StorageNode, StorageNodeInfo
from pocketflow.errors import CapacityExhausted, ClusterError

log = logging.getLogger(__name__)

RESOURCE_PREFIX = "pocketflow_storage_"
"""Custom Ray resource a node advertises per storage-server slot of a tier (``..._dram``)."""

RESOURCE_REQUESTS_KEPT_MAX = 64
"""Most autoscaler requests remembered for ``status``."""


def tier_resource(tier: str) -> str:
    """The custom Ray resource a server of ``tier`` needs one unit of."""
    return RESOURCE_PREFIX + tier


@dataclass(frozen=True)
class LaunchSpec:
    """How the controller starts a storage server of each tier.

    ``capacity_bytes_by_tier`` says which tiers can be launched and how big each server is.
    NVMe servers keep their data in a file of ``data_dir``. With ``use_resources``, each
    ``StorageNode`` actor requests one unit of :func:`tier_resource` so that Ray places it on a
    node that advertises storage slots of that tier; without it the actor runs anywhere (a local
    cluster). ``persist_ttl_ms`` is given to long-running servers (their PERSIST lifetime).
    With ``tls_dir`` (the cluster's TLS directory, see :mod:`pocketflow.tls`) every server gets
    a certificate for its node address and accepts TLS connections only.
    """

    secret_file: str
    data_dir: str
    capacity_bytes_by_tier: dict[str, int]
    threads: int | None = None
    persist_ttl_ms: int | None = None
    use_resources: bool = False
    servers_max: int = 64
    extra_options: dict[str, Any] = field(default_factory=dict)
    tls_dir: str | None = None


class Launcher:
    """Starts ``StorageNode`` actors and their servers, each start bounded by a deadline.

    When a server cannot be placed because no Ray node has a free slot of its tier, the launcher
    asks Ray's autoscaler for one (``ray.autoscaler.sdk.request_resources``; harmless without an
    autoscaler) and remembers the request for ``status``.
    """

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.resource_requests: list[dict[str, Any]] = []

    def can_launch(self, tier: str) -> bool:
        """Whether servers of ``tier`` can be launched at all."""
        return tier in self.spec.capacity_bytes_by_tier

    def launch(
        self, *, node_id: str, tier: str, long_running: bool, deadline_s: float
    ) -> tuple[StorageNodeInfo, Any]:
        """Start one server; returns its info and ``StorageNode`` actor handle.

        ``deadline_s`` is a ``time.monotonic()`` instant. Raises ``CapacityExhausted`` when the
        server is not up by then (the half-started actor is killed) and ``ClusterError`` when the
        tier cannot be launched.
        """
        import ray
        from ray.exceptions import GetTimeoutError

        if not self.can_launch(tier):
            raise ClusterError(f"this cluster cannot launch {tier} servers")
        options: dict[str, Any] = {
            "name": STORAGE_NODE_ACTOR_PREFIX + node_id,
            "namespace": NAMESPACE,
            "num_cpus": 0,
            "max_restarts": 0,
            **self.spec.extra_options,
        }
        if self.spec.use_resources:
            options["resources"] = {tier_resource(tier): 1}
        nvme_path = (
            str(Path(self.spec.data_dir) / f"{node_id}.data") if tier != "dram" else None
        )
        node = ray.remote(StorageNode).options(**options).remote(
            node_id=node_id,
            tier=tier,
            capacity_bytes=self.spec.capacity_bytes_by_tier[tier],
            secret_file=self.spec.secret_file,
            long_running=long_running,
            nvme_path=nvme_path,
            threads=self.spec.threads,
            persist_ttl_ms=self.spec.persist_ttl_ms if long_running else None,
            tls_dir=self.spec.tls_dir,
        )
        ref = node.start.remote()
        requested = False
        while True:
            remaining = deadline_s - time.monotonic()
            if remaining <= 0:
                ray.kill(node, no_restart=True)
                raise CapacityExhausted(
                    f"storage server {node_id} ({tier}) was not up in time"
                    + (" (no node had a free slot; autoscaler asked)" if requested else "")
                )
            try:
                info = ray.get(ref, timeout=min(remaining, 1.0))
                break
            except GetTimeoutError:
                if self.spec.use_resources and not requested:
                    requested = self._request_slot(tier)
            except Exception:
                ray.kill(node, no_restart=True)
                raise
        log.info("launched storage server %s (%s) at %s", node_id, tier, info.address)
        return info, node

    def _request_slot(self, tier: str) -> bool:
        """Ask the autoscaler for a node with one more slot of ``tier``, if none is free."""
        import ray

        resource = tier_resource(tier)
        if ray.available_resources().get(resource, 0) >= 1:
            return False
        bundle = {resource: 1}
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[bundle])
            outcome = "requested"
        except Exception as exc:  # no autoscaler API in this Ray, or no cluster to ask
            outcome = f"request failed: {exc}"
        log.warning("no free %s slot: autoscaler %s", resource, outcome)
        self.resource_requests.append(
            {"bundle": bundle, "at_unix_s": time.time(), "outcome": outcome}
        )
        del self.resource_requests[:-RESOURCE_REQUESTS_KEPT_MAX]
        return True
