"""Job ends: a deregistered job's end (``delete_job``) reaches every server that was live when it
ended, retried on each server until it confirms, and the pending ends outlive a controller crash
(they are in the ``Metadata`` log)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pocketflow.control.admin import AdminTokens
from pocketflow.control.membership import Membership
from pocketflow.errors import PocketflowError

log = logging.getLogger(__name__)

END_RETRY_FIRST_S = 0.5
"""Pause before the first retry of a job's end on a server that did not confirm it."""

END_RETRY_MAX_S = 5.0
"""Longest pause between two retries of a job's end on one server."""

ENDING_JOBS_MAX = 4096
"""Most ended jobs whose end some server has not confirmed yet (as the Metadata actor's
``JOBS_MAX``); past it the oldest is given up, logged."""


@dataclass
class _Retry:
    """When to try a server again, and the pause after that if it fails again."""

    next_try_s: float
    pause_s: float


class JobEnds:
    """The ended jobs whose end some live server has not confirmed.

    ``end`` runs ``delete_job`` on the given servers once (the deregistration's own call, which
    reports what it freed); the servers that did not answer stay pending, with their node ids
    logged through ``call_metadata`` (the ``Metadata`` record of the end), and ``retry`` (the
    monitor loop, outside the controller's lock) tries each of them again on its own deadline
    (both call the servers at once, within one admin deadline for all, so hung servers cost one
    timeout together; a server that fails is not tried again in the same pass; a suspect, hung,
    is not called at all until it answers again). A server that
    leaves the cluster (declared dead, retired) is dropped: its process is stopped, and a server
    process that starts anew refuses every job it was not told about.
    A restarted controller takes the pending ends back with :meth:`restore`.

    ``retry_admin`` is used only by the monitor thread (admin connections are not shared between
    threads); the table has a lock of its own.
    """

    def __init__(
        self,
        membership: Membership,
        *,
        admin: AdminTokens,
        retry_admin: AdminTokens,
        call_metadata: Callable[..., Any],
    ) -> None:
        self._membership = membership
        self._admin = admin
        self._retry_admin = retry_admin
        self._call_metadata = call_metadata
        self._lock = threading.Lock()
        # Held while a job's pending servers are read and written to the log, so that two
        # threads logging the same job write in the order they read.
        self._log_lock = threading.Lock()
        self._pending: dict[str, dict[str, _Retry]] = {}

    def end(self, job_id: str, node_ids: list[str]) -> tuple[list[tuple[str, dict[str, Any]]],
                                                            list[str]]:
        """End ``job_id`` on the live servers among ``node_ids`` (whose end the caller logged
        already); returns ``[(node_id, delete_job result)]`` of those that confirmed and the node
        ids of those that did not (pending from now)."""
        targets = [info for info in (self._membership.get(n) for n in node_ids) if info]
        # A suspect (hung) is not asked: the call would only wait. Its end is pending from now,
        # sent once it answers again.
        suspects = [i.node_id for i in targets if self._membership.is_suspect(i.node_id)]
        results, unreachable = self._admin.on_every_server(
            [i for i in targets if i.node_id not in suspects], f"delete_job {job_id}",
            lambda admin: admin.delete_job(job_id),
        )
        unreachable = sorted([*unreachable, *suspects])
        self._settle(job_id, unreachable)
        return [(info.node_id, result) for info, result in results], unreachable

    def restore(self, endings: dict[str, list[str]]) -> None:
        """Take back the pending ends a crashed instance logged; retried from now."""
        now_s = time.monotonic()
        with self._lock:
            for job_id, node_ids in endings.items():
                self._pending[job_id] = {n: _Retry(now_s, END_RETRY_FIRST_S) for n in node_ids}
            self._bound()

    def pending(self) -> dict[str, list[str]]:
        """``job_id -> node ids`` that have not confirmed the job's end."""
        with self._lock:
            return {job_id: sorted(nodes) for job_id, nodes in self._pending.items()}

    def retry(self) -> int:
        """Try the due pending ends once each: the servers at once, each server's ends one after
        another (a server that fails is skipped for the rest of the pass), within one admin
        deadline; returns how many were confirmed."""
        now_s = time.monotonic()
        with self._lock:
            due = [
                (job_id, node_id)
                for job_id, nodes in self._pending.items()
                for node_id, retry in nodes.items()
                if retry.next_try_s <= now_s
            ]
        by_server: dict[str, list[str]] = {}
        for job_id, node_id in due:
            by_server.setdefault(node_id, []).append(job_id)
        addresses: dict[str, str] = {}
        touched: set[str] = set()
        for node_id, job_ids in by_server.items():
            info = self._membership.get(node_id)
            if info is None:
                touched.update(job_ids)
                for job_id in job_ids:
                    self._drop(job_id, node_id)  # gone from the cluster: nothing left to end
            elif not self._membership.is_suspect(node_id):
                # A suspect waits until it answers again (the call would only wait).
                addresses[node_id] = info.address
                touched.update(job_ids)
        outcomes = self._retry_admin.fan_out_in_order(
            ((node_id, address, by_server[node_id])
             for node_id, address in sorted(addresses.items())),
            lambda admin, job_id: admin.delete_job(job_id),
        )
        confirmed = 0
        for node_id, address in sorted(addresses.items()):
            ended, error = outcomes[node_id]
            for job_id in ended:
                log.warning("job %s ended on %s at last", job_id, node_id)
                self._drop(job_id, node_id)
                confirmed += 1
            if error is not None:
                log.info("delete_job on %s failed again: %s", node_id, error)
                self._retry_admin.forget(address)
                for job_id in by_server[node_id]:
                    if job_id not in ended:
                        self._backoff(job_id, node_id)
        for job_id in sorted(touched):
            self._log(job_id)
        return confirmed

    def _settle(self, job_id: str, unreachable: list[str]) -> None:
        """Keep ``unreachable`` pending for ``job_id`` (none: the end is complete) and log it."""
        now_s = time.monotonic()
        with self._lock:
            if unreachable:
                self._pending[job_id] = {
                    n: _Retry(now_s + END_RETRY_FIRST_S, END_RETRY_FIRST_S) for n in unreachable
                }
                self._bound()
            else:
                self._pending.pop(job_id, None)
        self._log(job_id)

    def _drop(self, job_id: str, node_id: str) -> None:
        with self._lock:
            nodes = self._pending.get(job_id)
            if nodes is not None:
                nodes.pop(node_id, None)

    def _backoff(self, job_id: str, node_id: str) -> None:
        with self._lock:
            retry = self._pending.get(job_id, {}).get(node_id)
            if retry is not None:
                retry.pause_s = min(retry.pause_s * 2, END_RETRY_MAX_S)
                retry.next_try_s = time.monotonic() + retry.pause_s

    def _log(self, job_id: str) -> None:
        """Write what is still pending of ``job_id``'s end to its Metadata record (none: the
        record goes). A failure is logged; the next change writes it again."""
        with self._log_lock:
            with self._lock:
                nodes = self._pending.get(job_id)
                remaining = sorted(nodes) if nodes else []
                if not remaining:
                    self._pending.pop(job_id, None)
            try:
                self._call_metadata("update_ending", job_id, remaining)
            except PocketflowError as exc:
                log.warning("logging the end of job %s failed: %s", job_id, exc)

    def _bound(self) -> None:
        """Give up the oldest pending ends past ``ENDING_JOBS_MAX``. Callers hold the lock."""
        while len(self._pending) > ENDING_JOBS_MAX:
            job_id = next(iter(self._pending))
            log.error("giving up the end of job %s on %s: more than %d ends pending", job_id,
                      sorted(self._pending[job_id]), ENDING_JOBS_MAX)
            del self._pending[job_id]
