"""Epochs: moving a job to a new weight map (``set_epoch`` on its servers, then the record and
its ``Metadata`` log), making sure every server of the map learns it (retried per server until
it confirms), and moving jobs off a server that left or around one that hangs."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pocketflow.control.admin import AdminTokens
from pocketflow.control.allocator import Allocator
from pocketflow.control.hints import JobDemand, demand_from_hints
from pocketflow.control.job_table import JobRecord, JobTable
from pocketflow.control.membership import Membership
from pocketflow.control.packing import Allocation, Placement, allocated_by_server
from pocketflow.control.prefix_grants import PrefixGrants, grants_record
from pocketflow.errors import JobNotRegistered, PocketflowError, StaleEpoch
from pocketflow.handle import JobHandle, LostServer, Routes, ServerInfo
from pocketflow.transport import AdminClient

log = logging.getLogger(__name__)

SET_EPOCH_RETRY_FIRST_S = 0.5
"""Pause before the first retry of a ``set_epoch`` that a server did not confirm."""

SET_EPOCH_RETRY_MAX_S = 5.0
"""Longest pause between two retries of a ``set_epoch`` on one server."""


@dataclass
class _Unconfirmed:
    """A server that has not confirmed a job's epoch ``epoch``: when to try it again.
    ``left``: the server left the job's map (a live server must still learn the epoch whose map
    does not name it, which ends its share of the job's reservation)."""

    epoch: int
    next_try_s: float
    pause_s: float
    left: bool = False


@dataclass(frozen=True)
class EpochCall:
    """One ``set_epoch`` to retry: the job's current epoch and map for one server."""

    job_id: str
    node_id: str
    address: str
    epoch: int
    weight_map: dict[str, Any]


class Epochs:
    """Gives jobs new epochs. Every method is called under the controller's lock, except
    :meth:`send` (the monitor loop's retries, which wait on servers).

    A new map is sent to each server of it at once (``admin``, one call each), and to each live
    server that the job's previous map named and the new one does not (the new map's
    ``reserved_bytes`` does not name it: its share of the job's reservation ends, so other jobs
    may write into that room). A server that does not confirm it in time, or that is suspect
    (hung: the call would only wait), stays *unconfirmed*, and the monitor loop retries it
    (:meth:`due`, :meth:`send`, :meth:`settle`) on its own deadline, with backoff, with the
    job's current map, until it confirms, the job ends or the server leaves the cluster. A
    server that joins (or comes back after a restart of the controller) is sent every live job's
    map that names it, or that only the job's earlier maps name (:meth:`resync`). The
    unconfirmed table holds at most one entry per live server for each registered job (as
    bounded as the job table and the membership).

    ``call_metadata(method, *args)`` writes the job's new map (and its prefix grants, which go
    with its routes, and the weights held back from suspects) to its ``Metadata`` record, so a
    restarted controller finds it.
    """

    def __init__(
        self,
        jobs: JobTable,
        allocator: Allocator,
        grants: PrefixGrants,
        membership: Membership,
        *,
        admin: AdminTokens,
        call_metadata: Callable[..., Any],
    ) -> None:
        self._jobs = jobs
        self._allocator = allocator
        self._grants = grants
        self._membership = membership
        self._admin = admin
        self._call_metadata = call_metadata
        self._unconfirmed: dict[tuple[str, str], _Unconfirmed] = {}

    def announce(self, handle: JobHandle, demand: JobDemand) -> None:
        """Tell each server of a new job's first map (packed for ``demand``) its epoch. A server
        that does not confirm it (hung, or restarting, when the registration runs) does not fail
        the registration: it stays unconfirmed and the monitor loop retries it until it does, as
        for any new map; meanwhile it refuses the job's writes as ``job_not_registered``."""
        self._publish(handle, demand)

    def move(
        self,
        job_id: str,
        servers: tuple[ServerInfo, ...],
        routes: Routes | None = None,
        *,
        suspects: tuple[str, ...] | None = None,
        held_weights: dict[str, list[Any]] | None = None,
    ) -> JobHandle:
        """Give a job the next epoch with ``servers`` (and ``routes``, ``suspects`` and the
        weights held back from them, else those of its current map): tell the servers, then
        record it. Suspects and held weights of servers the map no longer names are dropped; the
        live servers it no longer names are told the new epoch too (their share of the job's
        reservation ends)."""
        record = self._jobs.record(job_id)
        named = {s.node_id for s in servers}
        left = tuple(s for s in record.handle.servers if s.node_id not in named)
        suspects = record.handle.suspects if suspects is None else suspects
        held = record.held_weights if held_weights is None else held_weights
        kept = tuple(n for n in suspects if n in named)
        # The map carries the held weights too: clients place the keys a suspect may hold by
        # them, and refuse only those (docs/ARCHITECTURE.md, "A hung server").
        handle = record.handle.replace(
            epoch=record.handle.epoch + 1, servers=servers,
            routes=record.handle.routes if routes is None else routes,
            # Where the earlier maps placed keys: write-once puts look for a key only there.
            earlier=record.handle.earlier_after(),
            suspects=kept,
            held_weights=tuple(sorted((n, float(w[0]), bool(w[1]))
                                      for n, w in held.items() if n in kept)),
        )
        record = dataclasses.replace(
            record, handle=handle,
            held_weights={n: w for n, w in held.items() if n in handle.suspects},
        )
        self._publish(handle, _demand_of(record), left=left)
        self._jobs.put(record)
        changed = record.to_metadata()
        fields = {k: changed[k] for k in ("epoch", "weight_map", "hints", "demand",
                                           "held_weights")}
        # The job's prefix grants go with its routes, so a restarted controller keeps them.
        fields["grants"] = grants_record(self._grants.granted(job_id))
        self._call_metadata("update_job", job_id, fields)
        log.info(
            "job %s moved to epoch %d on %s%s",
            job_id, handle.epoch, ", ".join(s.node_id for s in servers),
            f" (suspect: {', '.join(handle.suspects)})" if handle.suspects else "",
        )
        return handle

    def _publish(
        self, handle: JobHandle, demand: JobDemand | None, *, left: tuple[ServerInfo, ...] = ()
    ) -> None:
        """Send a job's new map to the servers of it and to the live ones among ``left`` (named
        by the job's previous map, not by this one) at once (one deadline for all: a hung
        server costs one admin call's timeout however many hang); those that do not confirm
        (suspects are not even asked) stay unconfirmed, retried by the monitor loop. The
        unconfirmed table is touched only here, in the calling thread."""
        weight_map = map_with_reservations(handle, demand)
        now_s = time.monotonic()
        # A server that left the cluster is not told: its process is stopped, and a server
        # process that starts anew holds no share of a job it was not told about.
        dropped = {s.node_id for s in left if self._membership.get(s.node_id) is not None}
        told = [*handle.servers, *(s for s in left if s.node_id in dropped)]
        asked: list[ServerInfo] = []
        for server in told:
            if self._membership.is_suspect(server.node_id):
                self._unconfirmed[(handle.job_id, server.node_id)] = _Unconfirmed(
                    handle.epoch, now_s, SET_EPOCH_RETRY_FIRST_S,
                    left=server.node_id in dropped,
                )
            else:
                asked.append(server)
        outcomes = self._admin.fan_out(
            (server.node_id, server.address, functools.partial(
                _set_epoch, job_id=handle.job_id, epoch=handle.epoch, weight_map=weight_map))
            for server in asked
        )
        for server in asked:
            key = (handle.job_id, server.node_id)
            outcome = outcomes[server.node_id]
            if isinstance(outcome, PocketflowError):
                log.warning("set_epoch %s/%d on %s failed: %s; retrying", handle.job_id,
                            handle.epoch, server.node_id, outcome)
                self._admin.forget(server.address)
                self._unconfirmed[key] = _Unconfirmed(
                    handle.epoch, time.monotonic() + SET_EPOCH_RETRY_FIRST_S,
                    SET_EPOCH_RETRY_FIRST_S, left=server.node_id in dropped,
                )
                continue
            self._unconfirmed.pop(key, None)

    def resync(self, node_id: str | None = None) -> int:
        """Mark the current map of every job that names ``node_id`` (every server, without
        one) unconfirmed there, due now: a server that joins, or every server after the
        controller restarted, is told every live job's epoch. So is a live server that only
        the job's earlier maps name (as far as the map remembers them: it may hold a share of
        the job's reservation from one of them, which the current map ends). Returns how many
        were marked."""
        now_s = time.monotonic()
        marked = 0
        for job_id, record in self._jobs.items():
            named = {s.node_id for s in record.handle.servers}
            earlier = {n for placement in record.handle.earlier or ()
                       for n, _, _ in placement.servers} - named
            for server_id in sorted(named | earlier):
                if node_id is not None and server_id != node_id:
                    continue
                if server_id in earlier and self._membership.get(server_id) is None:
                    continue
                self._unconfirmed[(job_id, server_id)] = _Unconfirmed(
                    record.handle.epoch, now_s, SET_EPOCH_RETRY_FIRST_S,
                    left=server_id in earlier,
                )
                marked += 1
        return marked

    def unconfirmed(self) -> dict[str, list[str]]:
        """``job_id -> node ids`` that have not confirmed the job's current epoch."""
        found: dict[str, list[str]] = {}
        for job_id, node_id in sorted(self._unconfirmed):
            found.setdefault(job_id, []).append(node_id)
        return found

    def due(self) -> list[EpochCall]:
        """The ``set_epoch`` calls to retry now (suspects wait until they answer again), each
        with the job's current map; entries of jobs or servers that are gone are dropped, as
        are those of servers the map no longer names unless they were sent a map without them
        (``left``: they must learn that they left it)."""
        now_s = time.monotonic()
        calls = []
        for key, entry in list(self._unconfirmed.items()):
            job_id, node_id = key
            record = self._jobs.get(job_id)
            info = self._membership.get(node_id)
            if record is None or info is None or not (record.holds(node_id) or entry.left):
                del self._unconfirmed[key]
                continue
            if entry.next_try_s > now_s or self._membership.is_suspect(node_id):
                continue
            calls.append(EpochCall(job_id, node_id, info.address, record.handle.epoch,
                                   map_with_reservations(record.handle, _demand_of(record))))
        return calls

    @staticmethod
    def send(calls: list[EpochCall], admin: AdminTokens) -> tuple[list[EpochCall], list[str]]:
        """Make the ``set_epoch`` calls with ``admin`` (the monitor thread's connections): the
        servers at once, each server's calls one after another, a server that fails skipped for
        the rest of its calls, all within one admin deadline (a server that has not answered by
        then failed). Returns the calls that were confirmed and the node ids that failed. Takes
        no lock."""
        by_server: dict[str, list[EpochCall]] = {}
        for call in calls:
            by_server.setdefault(call.node_id, []).append(call)
        outcomes = admin.fan_out_in_order(
            ((node_id, mine[0].address, mine) for node_id, mine in sorted(by_server.items())),
            _retry_set_epoch,
        )
        confirmed: list[EpochCall] = []
        failed: list[str] = []
        for node_id, mine in sorted(by_server.items()):
            done, error = outcomes[node_id]
            confirmed += done
            if error is not None:
                log.info("set_epoch on %s failed again: %s", node_id, error)
                admin.forget(mine[0].address)
                failed.append(node_id)
        return confirmed, failed

    def settle(self, confirmed: list[EpochCall], failed: list[str]) -> None:
        """Take what :meth:`send` did: confirmed epochs leave the table (unless a newer one is
        waiting), failed servers' entries wait longer."""
        for call in confirmed:
            entry = self._unconfirmed.get((call.job_id, call.node_id))
            if entry is not None and entry.epoch <= call.epoch:
                del self._unconfirmed[(call.job_id, call.node_id)]
                log.info("job %s: %s confirmed epoch %d", call.job_id, call.node_id, call.epoch)
        now_s = time.monotonic()
        down = set(failed)
        for (_job_id, node_id), entry in self._unconfirmed.items():
            if node_id in down and entry.next_try_s <= now_s:
                entry.pause_s = min(entry.pause_s * 2, SET_EPOCH_RETRY_MAX_S)
                entry.next_try_s = now_s + entry.pause_s

    def suspend(self, node_id: str) -> list[str]:
        """Move every job whose map names ``node_id`` (a suspect: hung) to a new epoch in which
        it has weight 0 and is listed in ``suspects``, so new keys go elsewhere; its weight is
        held back for :meth:`resume`. A job left with no weighted server gets fresh ones. Returns
        the ids of the jobs moved."""
        moved = []
        for job_id in self._jobs.holding(node_id):
            record = self._jobs.record(job_id)
            if node_id in record.handle.suspects:
                continue
            entry = next(s for s in record.handle.servers if s.node_id == node_id)
            servers = [
                s.replace(weight=0.0, persist=False) if s.node_id == node_id else s
                for s in record.handle.servers
            ]
            if not any(s.weight > 0 for s in servers):
                servers = self._with_fresh_servers(record, servers, node_id)
            self.move(
                job_id, tuple(sorted(servers, key=lambda s: s.node_id)),
                suspects=(*record.handle.suspects, node_id),
                held_weights={**record.held_weights, node_id: [entry.weight, entry.persist]},
            )
            moved.append(job_id)
        return moved

    def resume(self, node_id: str) -> list[str]:
        """Move every job that lists ``node_id`` as a suspect (it answers again) to a new epoch
        that gives it back the weight held for it and no longer lists it. Returns the ids of the
        jobs moved."""
        moved = []
        for job_id, record in self._jobs.items():
            if node_id not in record.handle.suspects:
                continue
            weight, persist = record.held_weights.get(node_id, [0.0, False])
            servers = tuple(
                s.replace(weight=float(weight), persist=bool(persist))
                if s.node_id == node_id else s
                for s in record.handle.servers
            )
            self.move(
                job_id, servers,
                suspects=tuple(n for n in record.handle.suspects if n != node_id),
                held_weights={n: w for n, w in record.held_weights.items() if n != node_id},
            )
            moved.append(job_id)
        return moved

    def _with_fresh_servers(
        self, record: JobRecord, kept: list[ServerInfo], node_id: str
    ) -> list[ServerInfo]:
        """``kept`` (no server of which has weight) plus servers packed afresh for the job on
        the live, active servers; ``kept`` alone if none can be had (logged)."""
        try:
            demand = record.job_demand() if record.demand else demand_from_hints(
                record.hints, self._allocator.spec()
            )
            fresh = self._allocator.server_infos(self._allocator.pack_new(demand))
        except PocketflowError as exc:
            log.error("job %s lost its last data server %s: %s", record.handle.job_id, node_id,
                      exc)
            fresh = ()
        known = {s.node_id for s in kept}
        kept = [s for s in kept if s.node_id not in {f.node_id for f in fresh}]
        return kept + [f for f in fresh if f.node_id not in known or f.weight > 0]

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


def map_with_reservations(handle: JobHandle, demand: JobDemand | None) -> dict[str, Any]:
    """The map ``set_epoch`` sends: the handle's weight map and, as ``"reserved_bytes":
    {node_id: bytes}``, each server's share of the job's reservation (its weight times the
    demand's capacity, as the allocator counts it on that server), so that a server keeps the
    share the job has not used free of other jobs' writes (docs/ARCHITECTURE.md, "Bigger than
    DRAM"). Clients ignore the field."""
    weight_map = handle.weight_map()
    if demand is None:
        return weight_map
    allocation = Allocation(tuple(Placement(node_id=s.node_id, weight=s.weight, persist=s.persist)
                                  for s in handle.servers))
    shares = {node_id: capacity for node_id, (_, capacity)
              in sorted(allocated_by_server([(demand, allocation)]).items()) if capacity > 0}
    if shares:
        weight_map["reserved_bytes"] = shares
    return weight_map


def _demand_of(record: JobRecord) -> JobDemand | None:
    """The demand ``record``'s job was packed with (None for a record without one)."""
    return record.job_demand() if record.demand else None


def _set_epoch(admin: AdminClient, *, job_id: str, epoch: int, weight_map: dict[str, Any]) -> None:
    """One ``set_epoch`` (a pool thread's call): a ``StaleEpoch`` answer means the server holds a
    newer map already, which confirms this one."""
    try:
        admin.set_epoch(job_id, epoch, weight_map)
    except StaleEpoch:
        pass


def _retry_set_epoch(admin: AdminClient, call: EpochCall) -> None:
    """One ``set_epoch`` retry (a pool thread's call): a ``JobNotRegistered`` answer is logged
    and counts as confirmed (the job ended meanwhile); other errors stop the server's retries."""
    try:
        _set_epoch(admin, job_id=call.job_id, epoch=call.epoch, weight_map=call.weight_map)
    except JobNotRegistered as exc:
        log.warning("set_epoch %s/%d on %s: %s", call.job_id, call.epoch, call.node_id, exc)
