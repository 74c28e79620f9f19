"""Allocation: packs a job's demand onto the live servers' free room, launching servers for the
shortfall when the cluster may (policies in control/packing.py and control/hints.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from pocketflow.control.hints import JobDemand, demand_from_hints
from pocketflow.control.job_table import JobRecord, JobTable
from pocketflow.control.launcher import Launcher, LaunchRequest
from pocketflow.control.membership import Membership
from pocketflow.control.packing import (
    Allocation,
    PackResult,
    ServerLoad,
    pack,
    refill,
    with_allocations,
)
from pocketflow.control.prefix_grants import PrefixGrants
from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.control.tiers import TIER_NVME, ClusterSpec, local_spec
from pocketflow.errors import CapacityExhausted, ClusterError, PocketflowError
from pocketflow.handle import ServerInfo

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S_DEFAULT = 60.0
"""How long a registration (or a job's growth) may wait for servers it launches."""

LAUNCH_ROUNDS_MAX = 4
"""Most rounds of "pack, launch the shortfall, pack again" in one registration."""

RELAXED_THROUGHPUT_SHARE = 0.99
"""Share of a tier's free throughput granted to a job that wants more and cannot launch servers
(below 1 so rounding in the packing never turns "all of it" into "not enough")."""

Solve = Callable[[list[ServerLoad], JobDemand], PackResult]
"""A packing of a demand onto server loads (:func:`pack`, or a job's growth)."""


class Allocator:
    """Turns demands into weight maps over the live servers.

    ``add_server(info, node)`` takes a launched server in (the controller's, which also starts
    its heartbeats). Every method is called under the controller's lock. A registration's or
    the sizing loop's launch waits for its servers with that lock released (``unlocked``, the
    controller's): a launch waits for a node from the autoscaler, seconds to minutes, and other
    registrations, renewals and launches must not queue behind it.
    """

    def __init__(
        self,
        membership: Membership,
        jobs: JobTable,
        grants: PrefixGrants,
        *,
        cluster_spec: ClusterSpec | None,
        launcher: Launcher | None,
        register_timeout_s: float,
        add_server: Callable[[StorageNodeInfo, Any], None],
    ) -> None:
        self._membership = membership
        self._jobs = jobs
        self._grants = grants
        self._cluster_spec = cluster_spec
        self.launcher = launcher
        self.register_timeout_s = register_timeout_s
        self._add_server = add_server
        # StorageNode actors this controller launched (it stops them when it closes).
        self.launched: dict[str, Any] = {}
        # Releases the controller's lock for a block (set by the controller; none: kept).
        self.unlocked: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
        )
        # Node ids of servers being launched (taken while their launch waits unlocked).
        self._launching: set[str] = set()

    def deadline_s(self) -> float:
        """The monotonic instant by which servers launched from now must be up."""
        return time.monotonic() + self.register_timeout_s

    def spec(self) -> ClusterSpec:
        """The tier specifications packing uses: the configured ones, else the servers' sizes."""
        if self._cluster_spec is not None:
            return self._cluster_spec
        sizes: dict[str, int] = {}
        for info in self._membership.servers():
            sizes[info.tier] = max(sizes.get(info.tier, 0), info.capacity_bytes)
        if self.launcher is not None:
            for tier, size in self.launcher.spec.capacity_bytes_by_tier.items():
                sizes.setdefault(tier, size)
        return local_spec(
            dram_capacity_bytes=sizes.get("dram", 1),
            nvme_capacity_bytes=sizes.get(TIER_NVME),
        )

    def server_loads(
        self, *, excluding_job: str | None = None, grants: bool = True
    ) -> list[ServerLoad]:
        """Every live server with its measured use and what registered jobs (and, with
        ``grants``, declared prefixes) reserve on it.

        A server's throughput is what it reports it can move (``throughput_bytes_per_s`` of its
        latest heartbeat), else its tier's nominal figure.
        """
        spec = self.spec()
        loads = []
        for info in self._membership.servers():
            stats = self._membership.latest_stats(info.node_id) or {}
            throughput = measured_throughput(stats) or (
                spec.tier(info.tier).throughput_bytes_per_s if spec.has_tier(info.tier) else 1
            )
            loads.append(
                ServerLoad(
                    node_id=info.node_id,
                    tier=info.tier,
                    capacity_bytes=info.capacity_bytes,
                    throughput_bytes_per_s=throughput,
                    used_bytes=int(stats.get("used_bytes", 0)),
                    long_running=info.long_running,
                    draining=self._membership.unavailable(info.node_id)
                    or bool(stats.get("draining", False)),
                )
            )
        jobs = [
            (record.job_demand(), record.allocation())
            for job_id, record in self._jobs.items()
            if record.demand and job_id != excluding_job
        ]
        loads = with_allocations(loads, jobs)
        granted = self._grants.reserved_by_server() if grants else {}
        return [
            dataclasses.replace(
                load, allocated_capacity_bytes=load.allocated_capacity_bytes + granted[load.node_id]
            ) if load.node_id in granted else load
            for load in loads
        ]

    def dram_free(self, *, grants: bool) -> dict[str, int]:
        """What each active DRAM server has neither reserved for jobs nor (with ``grants``)
        granted to prefixes."""
        return {
            load.node_id: load.capacity_bytes - load.allocated_capacity_bytes
            for load in self.server_loads(grants=grants)
            if load.tier == "dram" and load.active
        }

    def pack_new(self, demand: JobDemand) -> Allocation:
        """A fresh allocation of ``demand`` (launching servers if need be, waiting for them with
        the controller's lock released: the job is in no table yet)."""
        return self.pack_or_launch(
            lambda loads, d: pack(d, loads, self.spec()),
            release_lock=True,
            demand=demand,
            deadline_s=self.deadline_s(),
        )

    def pack_or_launch(
        self, solve: Solve, *, demand: JobDemand, deadline_s: float, release_lock: bool = False
    ) -> Allocation:
        """Pack with ``solve(loads, demand)``; launch the shortfall and pack again until it fits.
        With ``release_lock``, the launches wait with the controller's lock released, and the job
        is packed again on what the cluster holds once they are up; the caller holds nothing
        that a concurrent call may change (a new job), or checks, once this returns, that the
        job it packs did not change meanwhile (a growth, a repair).

        Without a launcher, a job whose throughput does not fit gets the free throughput of its
        first tier (spread over that tier's servers), failing that it is packed by capacity alone
        (its throughput over-committed either way, logged); one whose capacity does not fit is
        refused with ``CapacityExhausted``, as is a registration whose servers are not up by
        ``deadline_s``.
        """
        result: PackResult | None = None
        for _ in range(LAUNCH_ROUNDS_MAX):
            loads = self.server_loads()
            result = solve(loads, demand)
            if result.fits and not any(p.weight > 0 for p in result.allocation.placements):
                # Nothing can take the job's data (e.g. no server of its tier is active).
                result = PackResult(result.allocation, {demand.tiers[0]: 1})
            if result.fits:
                return result.allocation
            if self.launcher is None or not all(
                self.launcher.can_launch(t) for t in result.shortfall
            ):
                for relaxed_demand in relaxed_demands(demand, loads):
                    relaxed = solve(loads, relaxed_demand)
                    if relaxed.fits and any(p.weight > 0 for p in relaxed.allocation.placements):
                        log.warning(
                            "throughput of %d bytes/s over-committed (%d granted): no server can "
                            "be launched",
                            demand.throughput_bytes_per_s,
                            relaxed_demand.throughput_bytes_per_s,
                        )
                        return relaxed.allocation
                raise CapacityExhausted(_does_not_fit(demand, loads, result.shortfall))
            self._launch_shortfall(
                result.shortfall, deadline_s=deadline_s, release_lock=release_lock
            )
        raise CapacityExhausted(
            f"the job still does not fit after {LAUNCH_ROUNDS_MAX} launch rounds "
            f"(short of {result.shortfall if result else {}})"
        )

    def refilled(
        self, record: JobRecord, *, leaving: tuple[str, ...] = ()
    ) -> tuple[ServerInfo, ...]:
        """A job's map with the share it lacks placed on live servers with room, launching
        nothing (:func:`~pocketflow.control.packing.refill`); ``leaving`` servers stay in it at
        weight 0.

        Where the job's throughput finds no room, its capacity alone is placed (throughput
        over-committed, logged), as a registration that cannot launch does. What still does not
        fit stays missing: the job's weights then sum to less than 1.
        """
        demand = self._demand(record)
        loads = self.server_loads()
        result = refill(
            record.allocation(), demand=demand, servers=loads, spec=self.spec(), leaving=leaving
        )
        if not result.fits and demand.throughput_bytes_per_s > 0:
            relaxed = refill(
                record.allocation(), demand=without_throughput(demand), servers=loads,
                spec=self.spec(), leaving=leaving,
            )
            log.warning(
                "job %s: no room for its throughput once %s left; placed by capacity",
                record.handle.job_id, ", ".join(leaving) or "servers",
            )
            result = relaxed
        if not result.fits:
            log.warning(
                "job %s: no room for all of its share (short of %s); weights left short",
                record.handle.job_id, result.shortfall,
            )
        return self.server_infos(result.allocation)

    def refilled_or_launched(
        self, record: JobRecord, *, leaving: tuple[str, ...] = (), release_lock: bool = False
    ) -> tuple[ServerInfo, ...]:
        """:meth:`refilled`, launching servers for what finds no room (within the registration
        timeout; ``CapacityExhausted`` or ``ClusterError`` when they cannot be had). With
        ``release_lock`` the launches wait with the controller's lock released: the caller
        checks that the job did not change meanwhile before it uses the answer."""
        demand = self._demand(record)
        solve = functools.partial(_refill, record.allocation(), self.spec(), leaving)
        return self.server_infos(
            self.pack_or_launch(solve, demand=demand, deadline_s=self.deadline_s(),
                                release_lock=release_lock)
        )

    def _demand(self, record: JobRecord) -> JobDemand:
        """The demand a job was packed with (from its hints for a record without one)."""
        if record.demand:
            return record.job_demand()
        return demand_from_hints(record.hints, self.spec())

    def _launch_shortfall(
        self, shortfall: dict[str, int], *, deadline_s: float, release_lock: bool = False
    ) -> None:
        """Launch ``{tier: count}`` servers, all at once, and add those that came up; bounded by
        ``servers_max`` (nothing is launched past it, counting launches under way)."""
        assert self.launcher is not None
        limit = self.launcher.spec.servers_max
        tiers = [tier for tier, count in sorted(shortfall.items()) for _ in range(count)]
        if len(self._membership) + len(self._launching) + len(tiers) > limit:
            raise CapacityExhausted(
                f"the job needs {len(tiers)} more servers and the cluster is limited to {limit}"
                + (f" ({len(self._launching)} being launched)" if self._launching else "")
            )
        self.launch_servers(tiers, deadline_s=deadline_s, release_lock=release_lock)

    def launch_server(
        self, tier: str, *, long_running: bool = False, deadline_s: float | None = None,
        release_lock: bool = False,
    ) -> StorageNodeInfo:
        """Start a new storage server of ``tier`` and add it."""
        (info,) = self.launch_servers(
            [tier], long_running=long_running, deadline_s=deadline_s, release_lock=release_lock
        )
        return info

    def launch_servers(
        self, tiers: list[str], *, long_running: bool = False, deadline_s: float | None = None,
        release_lock: bool = False,
    ) -> list[StorageNodeInfo]:
        """Start one server of each of ``tiers`` at once and add each that comes up; raises the
        first launch's error after adding the others (they are of use, and the sizing loop
        drains what stays idle). With ``release_lock``, the wait for the servers runs with the
        controller's lock released; their node ids stay taken meanwhile."""
        if self.launcher is None:
            raise ClusterError("this controller cannot launch storage servers")
        if deadline_s is None:
            deadline_s = self.deadline_s()
        requests: list[LaunchRequest] = []
        for tier in tiers:
            taken = {r.node_id for r in requests}
            requests.append(LaunchRequest(self._next_node_id(tier, taken=taken), tier,
                                          long_running))
        ids = {r.node_id for r in requests}
        added: list[StorageNodeInfo] = []
        first_error: PocketflowError | None = None
        self._launching |= ids
        try:
            # Each counts as starting (its slot asked of the autoscaler) until it is taken in.
            with contextlib.ExitStack() as starting:
                for request in requests:
                    starting.enter_context(self.launcher.starting(request.tier))
                with self.unlocked() if release_lock else contextlib.nullcontext():
                    outcomes = self.launcher.launch_many(requests, deadline_s=deadline_s)
                for outcome in outcomes:
                    if isinstance(outcome, PocketflowError):
                        first_error = first_error or outcome
                        continue
                    info, node = outcome
                    self.launched[info.node_id] = node
                    self._add_server(info, node)
                    added.append(info)
        finally:
            self._launching -= ids
        if first_error is not None:
            raise first_error
        return added

    def _next_node_id(self, tier: str, *, taken: set[str] | None = None) -> str:
        taken = (taken or set()) | self._membership.ids() | self._membership.dead_ids() | set(
            self.launched
        ) | self._launching
        index = 0
        while f"{tier}-{index}" in taken:
            index += 1
        return f"{tier}-{index}"

    def server_infos(self, allocation: Allocation) -> tuple[ServerInfo, ...]:
        """The weight map of ``allocation`` with each live server's address and tier."""
        infos = []
        for p in allocation.placements:
            info = self._membership.get(p.node_id)
            if info is not None:
                infos.append(ServerInfo(
                    node_id=p.node_id, address=info.address, tier=info.tier,
                    weight=p.weight, persist=p.persist,
                ))
        return tuple(infos)

    def resource_requests(self) -> list[dict[str, Any]]:
        """What the launcher asked Ray's autoscaler for (``status``)."""
        return list(self.launcher.resource_requests) if self.launcher is not None else []


def _refill(
    allocation: Allocation,
    spec: ClusterSpec,
    leaving: tuple[str, ...],
    loads: list[ServerLoad],
    demand: JobDemand,
) -> PackResult:
    """The packing of a refill on each round of :meth:`Allocator.pack_or_launch`."""
    return refill(allocation, demand=demand, servers=loads, spec=spec, leaving=leaving)


def measured_throughput(stats: dict[str, Any]) -> int:
    """The bytes per second a server's ``stats`` say it can move; 0 when they do not say."""
    try:
        return max(int(stats.get("throughput_bytes_per_s", 0)), 0)
    except (TypeError, ValueError):
        return 0


def without_throughput(demand: JobDemand) -> JobDemand:
    """``demand`` asking for capacity only (when throughput cannot be had)."""
    return dataclasses.replace(demand, throughput_bytes_per_s=0)


def relaxed_demands(demand: JobDemand, loads: Sequence[ServerLoad]) -> list[JobDemand]:
    """What to ask for, in order, when ``demand``'s throughput cannot be had.

    First all the free throughput of the job's first tier (so the job is spread over every
    server of that tier that has any, rather than packed by capacity onto one), then capacity
    alone.
    """
    first_tier = demand.tiers[0] if demand.tiers else None
    available = sum(
        load.free_throughput_bytes_per_s
        for load in loads
        if load.active and load.tier == first_tier
    )
    granted = min(int(available * RELAXED_THROUGHPUT_SHARE), demand.throughput_bytes_per_s)
    relaxed = [without_throughput(demand)]
    if granted > 0:
        relaxed.insert(0, dataclasses.replace(demand, throughput_bytes_per_s=granted))
    return relaxed


def _does_not_fit(demand: JobDemand, loads: list[ServerLoad], shortfall: dict[str, int]) -> str:
    """Why a registration is refused: the job's reservation against what the tiers it may use
    have free (neither reserved by other jobs nor used), in the figures packing compared."""
    free = []
    for tier in demand.tiers:
        servers = [load for load in loads if load.tier == tier and load.active]
        free.append(f"{tier} {sum(load.free_capacity_bytes for load in servers)} bytes on "
                    f"{len(servers)} servers")
    return (
        f"the job's reservation does not fit: {demand.capacity_bytes} bytes and "
        f"{demand.throughput_bytes_per_s} bytes/s over {', '.join(demand.tiers)}, with "
        f"{'; '.join(free)} free; it needs {sum(shortfall.values())} more servers "
        f"({', '.join(f'{n} {t}' for t, n in sorted(shortfall.items()))}) and none can be "
        "launched"
    )
