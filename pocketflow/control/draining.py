"""Draining: taking a storage server out of service without losing live data (objects and
channels), and retiring it once it has left."""

from __future__ import annotations

import logging
import time
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

UNTOLD_RETRY_S = 2.0
"""How often at most the monitor loop tells a draining server again whose ``drain`` got no
answer (each attempt may wait out an admin call's deadline under the controller's lock); a
suspect server (silent, its process running) is left alone until it answers again."""

EXIT_WAIT_S = 1.0
"""How long a drain waits for a server that stopped answering right after ``drain`` to exit
(an empty server exits as soon as it is told to drain) before leaving it to the failure
detector."""

RETIRED_KEPT_MAX = 64
"""Most retirements remembered for ``status`` (``retired_servers``)."""

LONG_RUNNING_MIN_DEFAULT = 2
"""Long-running servers never drained when the cluster has no sizing bounds."""


EMPTY = "empty"
"""A retired server's stats, right after it was told to drain, showed no object and no channel
entry."""
EXITED = "exited once empty"
"""A retired server exited after it was told to drain (it exits only once it holds nothing)."""
GONE = "gone"
"""A retired server's process was gone before it was told to drain: what it held is lost."""


class Drainer:
    """Drains and retires servers. Every method is called under the controller's lock.

    Objects of a drained server stay readable from a map that gives it weight 0 (reads fall back
    over every server of the map). Channels do not: a queue's or an append file's segment is
    found where the job's current map places it, so a map that gives the server weight 0 would
    send a fresh client elsewhere and leave the segments there unreachable. A job with channel
    data on the server (its ``channel_entries`` in the server's stats: segments, items,
    records) therefore keeps its map until that data is gone (its channels deleted, or the job
    ended); only then is it moved off, and only once no job holds channels there is the server
    told to drain (refuse writes, exit when empty). It is retired when it holds nothing: no
    object and no channel entry.
    """

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
        # Draining servers not told to drain yet: node id -> the jobs whose channels are there.
        self._holding: dict[str, set[str]] = {}
        # Draining servers whose ``drain`` call did not get through (hung or overloaded, their
        # process running) -> when to tell them again (:meth:`go_on`). Bounded by the live
        # servers (an entry goes with its server).
        self._untold: dict[str, float] = {}
        # The latest retirements and what showed the server empty, for ``status``.
        self._retired: list[dict[str, Any]] = []

    def drain(self, node_id: str) -> dict[str, Any]:
        """Take a server out of service without losing live data.

        It gets weight 0 for new jobs, and every job that writes to it moves to a new epoch where
        its weight is 0 (it stays in the map, so its objects stay readable), except the jobs that
        hold channel data there (see the class doc), which keep their map until it is gone. Once
        none does, the server is told to refuse writes and exit once it holds no data; the
        failure detector then retires it quietly. The last ``long_running_min`` long-running
        servers are never drained. Returns ``{"node_id", "draining", "retired",
        "holding_channels": [job ids]}``.
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
        try:
            stats = self._admin.client(info.address).stats()
        except PocketflowError as exc:
            # Gone already (an empty drained server exits), or not answering: nothing of it can
            # be read now, so no job is held for it.
            log.info("stats of %s before its drain: %s", node_id, exc)
            stats = {}
        with_channels = {
            job_id for job_id, usage in dict(stats.get("jobs", {})).items()
            if int(usage.get("channel_entries", 0)) > 0
        }
        held = set()
        # New epochs first, so that a client still writing to the server is told the new
        # map (stale_epoch) rather than refused (draining).
        for job_id, record in self._jobs.items():
            entry = next((s for s in record.handle.servers if s.node_id == node_id), None)
            if entry is None or (entry.weight <= 0.0 and not entry.persist):
                continue
            if job_id in with_channels:
                held.add(job_id)
                continue
            self._move_off(job_id, node_id)
        if held:
            self._holding[node_id] = held
            log.info("draining storage server %s: jobs %s hold channels there", node_id,
                     sorted(held))
            return {"node_id": node_id, "draining": True, "retired": False,
                    "holding_channels": sorted(held)}
        return self._finish(node_id)

    def holding(self) -> dict[str, list[str]]:
        """Draining servers not told to drain yet, with the jobs whose channels are there."""
        return {node_id: sorted(jobs) for node_id, jobs in self._holding.items()}

    def go_on(self, *, now_s: float | None = None) -> list[str]:
        """Move the held jobs whose channel data left a draining server (by its latest
        heartbeat) off it, and tell each server no job holds any more to drain, as well as each
        one an earlier ``drain`` did not reach (every ``UNTOLD_RETRY_S`` at most, and not while
        it is a suspect). Runs in the monitor loop; returns the node ids told to drain."""
        now_s = time.monotonic() if now_s is None else now_s
        told = []
        for node_id, next_try_s in sorted(self._untold.items()):
            if node_id not in self._membership:
                self._untold.pop(node_id, None)
                continue
            if now_s < next_try_s or self._membership.is_suspect(node_id):
                continue
            self._finish(node_id)
            if node_id not in self._untold:
                told.append(node_id)
        for node_id, held in list(self._holding.items()):
            if node_id not in self._membership:
                del self._holding[node_id]
                continue
            stats = self._membership.latest_stats(node_id) or {}
            usage = dict(stats.get("jobs", {}))
            for job_id in sorted(held):
                channels = int(dict(usage.get(job_id, {})).get("channel_entries", 0))
                if job_id in self._jobs and channels > 0:
                    continue
                held.discard(job_id)
                if job_id in self._jobs:
                    self._move_off(job_id, node_id)
            if not held:
                del self._holding[node_id]
                self._finish(node_id)
                told.append(node_id)
        return told

    def _move_off(self, job_id: str, node_id: str) -> None:
        """Give ``node_id`` weight 0 (and no PERSIST placement) in the job's next epoch, its
        share placed afresh on servers with room."""
        # Its share of the job moves to servers with room (packed afresh, as a new job's is),
        # so that the job's reservation keeps counting where its new data goes.
        kept = self._allocator.refilled(self._jobs.record(job_id), leaving=(node_id,))
        if not any(s.weight > 0 for s in kept):
            self._epochs.exclude(job_id, node_id, keep_readable=True)
        else:
            self._epochs.move(job_id, kept)

    def _finish(self, node_id: str) -> dict[str, Any]:
        """Tell the server to drain (refuse writes, exit once empty); retire it at once if it
        holds nothing (no object, no channel entry)."""
        info = self._membership.get(node_id)
        if info is None:
            return {"node_id": node_id, "draining": True, "retired": True}
        client = self._admin.client(info.address)
        try:
            result = client.drain(exit_when_empty=True)
        except PocketflowError as exc:
            if not self._process_exited(node_id):
                # Not answering (hung, stopped, overloaded) is no sign of being empty: it keeps
                # its data and is told again from the monitor loop.
                log.warning("drain of %s did not get through (%s); told again later",
                            node_id, exc)
                self._admin.forget(info.address)
                self._untold[node_id] = time.monotonic() + UNTOLD_RETRY_S
                return {"node_id": node_id, "draining": True, "retired": False}
            # Its process is gone: nothing is left to drain (what it held is lost already).
            log.info("%s is gone before its drain: %s", node_id, exc)
            self.retire(node_id, how=GONE)
            return {"node_id": node_id, "draining": True, "retired": True}
        else:
            self._untold.pop(node_id, None)
            how = EMPTY
            try:
                stats = client.stats()
                empty = (int(stats.get("objects", 1)) == 0
                         and int(stats.get("channel_entries", 0)) == 0)
            except PocketflowError as exc:
                how = EXITED
                # An empty server exits as soon as it is told to drain; one whose process still
                # runs is slow or holds data, and exits (then is retired by the failure
                # detector) only once it is empty.
                log.info("%s after drain: %s", node_id, exc)
                self._admin.forget(info.address)
                empty = self._exited(node_id)
        if empty:
            self.retire(node_id, how=how)
            return {"node_id": node_id, **result, "retired": True}
        log.info("draining storage server %s", node_id)
        return {"node_id": node_id, **result, "retired": False}

    def _process_exited(self, node_id: str) -> bool:
        """Whether the server's process is known to have ended (a node that does not answer
        says nothing: then it has not)."""
        return bool(self._nodes.process_exited(self._membership.node(node_id), node_id))

    def _exited(self, node_id: str) -> bool:
        """Whether the server's process is known to end within ``EXIT_WAIT_S``."""
        deadline = time.monotonic() + EXIT_WAIT_S
        while not self._process_exited(node_id):
            if time.monotonic() >= deadline:
                return False
            time.sleep(DRAIN_POLL_S)
        return True

    def retired(self) -> list[dict[str, Any]]:
        """The latest retirements, oldest first: ``{"node_id", "at_unix_s", "how"}`` where
        ``how`` says what showed the server empty (:data:`EMPTY`, :data:`EXITED`) or that it
        was gone without it (:data:`GONE`)."""
        return [dict(r) for r in self._retired]

    def retire(self, node_id: str, *, how: str | None = None) -> None:
        """Forget a drained server that has exited; its jobs' maps drop it. ``how`` says what
        showed it empty; without it, a server told to drain exited once empty (:data:`EXITED`:
        it exits only then) and one never told (holding channels, or its drain unanswered)
        is :data:`GONE`."""
        if how is None:
            how = GONE if node_id in self._holding or node_id in self._untold else EXITED
        forgotten = self._membership.forget(node_id)
        if forgotten is None:
            return
        self._retired.append({"node_id": node_id, "at_unix_s": time.time(), "how": how})
        del self._retired[:-RETIRED_KEPT_MAX]
        info, node = forgotten
        self._membership.draining.discard(node_id)
        self._holding.pop(node_id, None)
        self._untold.pop(node_id, None)
        self._allocator.launched.pop(node_id, None)
        self._admin.forget(info.address)
        self._epochs.drop(node_id)
        log.info("storage server %s drained and retired", node_id)
        self._nodes.stop_and_kill(node, node_id)
