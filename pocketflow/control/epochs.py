"""Epochs: moving a job to a new weight map (``set_epoch`` on its servers, then the record and
its ``Metadata`` log), and moving jobs off a server that left."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from pocketflow.control.admin import AdminTokens
from pocketflow.control.allocator import Allocator
from pocketflow.control.job_table import JobTable
from pocketflow.control.prefix_grants import PrefixGrants, grants_record
from pocketflow.errors import PocketflowError
from pocketflow.handle import JobHandle, LostServer, Routes, ServerInfo

log = logging.getLogger(__name__)


class Epochs:
    """Gives jobs new epochs. Every method is called under the controller's lock.

    ``call_metadata(method, *args)`` writes the job's new map (and its prefix grants, which go
    with its routes) to its ``Metadata`` record, so a restarted controller finds it.
    """

    def __init__(
        self,
        jobs: JobTable,
        allocator: Allocator,
        grants: PrefixGrants,
        *,
        admin: AdminTokens,
        call_metadata: Callable[..., Any],
    ) -> None:
        self._jobs = jobs
        self._allocator = allocator
        self._grants = grants
        self._admin = admin
        self._call_metadata = call_metadata

    def announce(self, handle: JobHandle) -> None:
        """Tell each server of a new job's first map its epoch (a failure is raised)."""
        weight_map = handle.weight_map()
        for server in handle.servers:
            self._admin.client(server.address).set_epoch(handle.job_id, handle.epoch, weight_map)

    def move(
        self, job_id: str, servers: tuple[ServerInfo, ...], routes: Routes | None = None
    ) -> JobHandle:
        """Give a job the next epoch with ``servers`` (and ``routes``, else its routes stay):
        tell the servers, then record it.

        A server that does not answer ``set_epoch`` in time is logged and left to the failure
        detector.
        """
        record = self._jobs.record(job_id)
        handle = dataclasses.replace(
            record.handle, epoch=record.handle.epoch + 1, servers=servers,
            routes=record.handle.routes if routes is None else routes,
        )
        weight_map = handle.weight_map()
        for server in servers:
            try:
                self._admin.client(server.address).set_epoch(job_id, handle.epoch, weight_map)
            except PocketflowError as exc:
                log.warning(
                    "set_epoch %s/%d on %s failed: %s", job_id, handle.epoch, server.node_id, exc
                )
                self._admin.forget(server.address)
        record = dataclasses.replace(record, handle=handle)
        self._jobs.put(record)
        changed = record.to_metadata()
        fields = {k: changed[k] for k in ("epoch", "weight_map", "hints", "demand")}
        # The job's prefix grants go with its routes, so a restarted controller keeps them.
        fields["grants"] = grants_record(self._grants.granted(job_id))
        self._call_metadata("update_job", job_id, fields)
        log.info(
            "job %s moved to epoch %d on %s",
            job_id, handle.epoch, ", ".join(s.node_id for s in servers),
        )
        return handle

    def move_off_lost(self, lost: LostServer) -> list[str]:
        """Move every job whose map holds ``lost`` to a new epoch without it; returns their ids.

        The map remembers the lost server, so that reads of what it held raise
        ``DataUnavailable`` instead of ``ObjectNotFound`` (see :mod:`pocketflow.handle`).
        """
        moved = self._jobs.holding(lost.node_id)
        for job_id in moved:
            record = self._jobs.record(job_id)
            self._jobs.put(dataclasses.replace(record, handle=record.handle.with_lost(lost)))
            self.exclude(job_id, lost.node_id)
        return moved

    def exclude(self, job_id: str, node_id: str, *, keep_readable: bool = False) -> None:
        """Move a job to a new epoch whose weight map no longer holds ``node_id`` (with
        ``keep_readable``, holds it with weight 0).

        The server's share is packed afresh on the live servers with room, launching nothing
        (:meth:`Allocator.refilled`), so the epoch moves at once; what finds no room stays
        missing from the map until :class:`~pocketflow.control.repair.Repairer` places it,
        launching servers if the cluster may. A job none of whose data finds room gets a map
        without a weighted server (its clients' new keys are ``DataUnavailable`` until the
        repair) rather than one that still names a dead server: its readers learn at once what
        was lost, and no call waits for a launch.
        """
        record = self._jobs.record(job_id)
        kept = self._allocator.refilled(record, leaving=(node_id,))
        if not keep_readable:
            kept = tuple(s for s in kept if s.node_id != node_id)
        self.move(job_id, kept, routes=record.handle.routes.without_member(node_id))

    def drop(self, node_id: str) -> None:
        """Move every job whose map names ``node_id`` to a new epoch without it (a drained
        server that left: nothing of it is remembered)."""
        for job_id in self._jobs.holding(node_id):
            record = self._jobs.record(job_id)
            kept = tuple(s for s in record.handle.servers if s.node_id != node_id)
            self.move(job_id, kept)
