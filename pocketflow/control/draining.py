"""Draining: taking a storage server out of service without losing live data, and retiring it
once it has left."""

from __future__ import annotations

import logging
from typing import Any

from pocketflow.control.admin import AdminTokens
from pocketflow.control.allocator import Allocator
from pocketflow.control.epochs import Epochs
from pocketflow.control.job_table import JobTable
from pocketflow.control.membership import Membership
from pocketflow.errors import ClusterError, PocketflowError

log = logging.getLogger(__name__)

DRAIN_NODE_TIMEOUT_S = 30.0
"""How long ``drain_node`` waits for the node's servers to exit."""

DRAIN_POLL_S = 0.2
"""How often ``drain_node`` looks whether the drained servers are gone."""

LONG_RUNNING_MIN_DEFAULT = 2
"""Long-running servers never drained when the cluster has no sizing bounds."""


class Drainer:
    """Drains and retires servers. Every method is called under the controller's lock."""

    def __init__(
        self,
        membership: Membership,
        jobs: JobTable,
        epochs: Epochs,
        allocator: Allocator,
        *,
        admin: AdminTokens,
        nodes: Any,
        long_running_min: int = LONG_RUNNING_MIN_DEFAULT,
    ) -> None:
        self._membership = membership
        self._jobs = jobs
        self._epochs = epochs
        self._allocator = allocator
        self._admin = admin
        self._nodes = nodes
        self._long_running_min = long_running_min

    def drain(self, node_id: str) -> dict[str, Any]:
        """Take a server out of service without losing live data.

        It gets weight 0 for new jobs, every job that writes to it moves to a new epoch where
        its weight is 0 (it stays in the map, so its data stays readable), and the server is told
        to refuse writes and exit once it holds no data; the failure detector then retires it
        quietly. The last ``long_running_min`` long-running servers are never drained.
        """
        info = self._membership.get(node_id)
        if info is None:
            raise ClusterError(f"no live storage server {node_id!r}")
        if info.long_running:
            active = [
                s for s in self._membership.servers()
                if s.long_running and not self._membership.is_draining(s.node_id)
            ]
            floor = self._long_running_min
            if len(active) <= floor:
                raise ClusterError(
                    f"{node_id} is one of the last {floor} long-running servers"
                )
        self._membership.draining.add(node_id)
        # New epochs first, so that a client still writing to the server is told the new
        # map (stale_epoch) rather than refused (draining).
        # Its share of each job moves to servers with room (packed afresh, as a new job's is),
        # so that the job's reservation keeps counting where its new data goes.
        for job_id, record in self._jobs.items():
            entry = next((s for s in record.handle.servers if s.node_id == node_id), None)
            if entry is None or (entry.weight <= 0.0 and not entry.persist):
                continue
            kept = self._allocator.refilled(record, leaving=(node_id,))
            if not any(s.weight > 0 for s in kept):
                self._epochs.exclude(job_id, node_id, keep_readable=True)
            else:
                self._epochs.move(job_id, kept)
        try:
            result = self._admin.client(info.address).drain(exit_when_empty=True)
            empty = int(self._admin.client(info.address).stats().get("objects", 1)) == 0
        except PocketflowError as exc:
            # Gone already: an empty server exits as soon as it is told to drain.
            log.info("%s after drain: %s", node_id, exc)
            result, empty = {"draining": True}, True
        if empty:
            self.retire(node_id)
            return {"node_id": node_id, **result, "retired": True}
        log.info("draining storage server %s", node_id)
        return {"node_id": node_id, **result, "retired": False}

    def retire(self, node_id: str) -> None:
        """Forget a drained server that has exited; its jobs' maps drop it."""
        forgotten = self._membership.forget(node_id)
        if forgotten is None:
            return
        info, node = forgotten
        self._membership.draining.discard(node_id)
        self._allocator.launched.pop(node_id, None)
        self._admin.forget(info.address)
        self._epochs.drop(node_id)
        log.info("storage server %s drained and retired", node_id)
        self._nodes.stop_and_kill(node, node_id)
