"""Cluster sizing policy: keep CPU, network and per-tier capacity within utilization bounds (pure).

API summary (for the controller's sizing loop and the simulator):

- ``decide(servers, bounds, now_s=..., last_action_s=..., pending=...) -> SizingAction``
  where ``servers`` are :class:`ServerUtilization` samples (latest heartbeat of each server),
  ``bounds`` a :class:`SizingBounds` (lower/upper utilization, default 0.6/0.8, cool-down,
  minimum long-running servers, server and thread limits), ``last_action_s`` the time of the
  last action the caller executed (``None``: never) and ``pending`` the servers per tier that
  were launched and are not up yet.
- The action is one of :class:`AddThreads` (vertical scaling of one server),
  :class:`AddServer` (launch a server of a tier), :class:`RemoveServers` (drain one or more
  servers and let them exit), :class:`RemoveThreads` (vertical scale-down of one server) or
  :class:`NoAction` (with the reason). Every action has a ``reason`` for logs.
- ``cluster_utilization(servers) -> ClusterUtilization`` — the aggregate the rules look at.

The rules, checked in this order:

1. Fewer active long-running servers than ``bounds.long_running_min`` (2): add a long-running
   server of the first tier seen (or ``bounds.default_tier``). Not subject to the cool-down.
2. Vertical first, after ``bounds.vertical_cooldown_s`` since the last action: a server whose
   CPU is above the upper bound and that may run more threads gets enough threads to bring its
   CPU to the middle of the band (twice as many when saturated; at least ``bounds.threads_step``
   more, at most its maximum).
   Threads are cheap and local, so their cool-down is short.
3. Scale-down, when no dimension is above the upper bound and no server is starting (removal
   goes first so that capacity follows demand down as fast as it follows it up): remove
   servers that are not long-running, fewest held bytes first, several at once, as long as no
   dimension would then rise above the upper bound (hysteresis: the removed servers' CPU,
   network and held bytes count against the servers that stay, so what registered jobs hold
   always fits in what is left). An *empty* server (no data and no reservation) goes at once,
   after the short vertical cool-down only, whatever the other dimensions; a server holding
   data goes only when every dimension is below the lower bound and the full cool-down has
   passed (its drain waits for the data to be freed).
4. Cool-down: within ``bounds.cooldown_s`` of the last action, do nothing more, so that the
   effect of an action shows in the samples before the next one (no flapping).
5. A dimension above the upper bound (a tier's data, the mean CPU, the aggregate network):
   add a server of that tier (for CPU or network: the tier of the busiest server), unless a
   server of that tier is already starting (counting the servers a registration is launching)
   or ``bounds.servers_max`` is reached. A tier grows on the data its servers hold
   (``used_bytes``, measured), not on what jobs reserve (``reserved_bytes``): a registration
   launches the servers its reservation needs, so a reservation that is met but not yet written
   must not launch another server, which no job's key would reach. Everywhere else (rule 3) a
   server counts what it holds, its data or its reservation whichever is larger, so capacity
   never drops below what registered jobs hold.
6. Otherwise (and no server is starting), a server whose CPU is below the lower bound and that
   runs more than ``bounds.threads_min`` threads releases threads: as many as keep its CPU at or
   below the middle of the band (so rule 2 never adds them back), at least ``threads_min``. This
   comes after removal, so a removable idle server goes at once (as in Pocket) instead of first
   shrinking; it reaches the servers that stay (long-running ones, or a cluster held by one
   dimension in the band), whose idle cores go back to the machine. Releasing threads is cheap
   and reversible (rule 2 adds them back), but not urgent: it waits for the full cool-down and
   is chosen only when no dimension is above the upper bound.

Utilization counts active servers only (not draining, not dead).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerUtilization:
    """One server's latest utilization sample and sizing-relevant facts.

    ``cpu_fraction`` is the busy fraction of the cores the server may use (0..1);
    ``net_bytes_per_s`` is its network traffic (in plus out) against
    ``net_capacity_bytes_per_s``.
    """

    node_id: str
    tier: str
    cpu_fraction: float
    net_bytes_per_s: float
    net_capacity_bytes_per_s: float
    used_bytes: int
    """The bytes the server holds (measured)."""
    capacity_bytes: int
    threads: int = 1
    threads_max: int = 1
    long_running: bool = False
    draining: bool = False
    dead: bool = False
    reserved_bytes: int = 0
    """What registered jobs reserve on the server (their share of their capacity demand)."""

    @property
    def held_bytes(self) -> int:
        """What the server holds for sizing down: its data or its reservation, the larger (a
        server launched for a job that has not written yet must not look idle)."""
        return max(self.used_bytes, self.reserved_bytes)

    @property
    def active(self) -> bool:
        """Whether the server counts for sizing (neither draining nor dead)."""
        return not (self.draining or self.dead)


@dataclass(frozen=True)
class SizingBounds:
    """Utilization bounds and limits of the sizing policy."""

    lower: float = 0.6
    upper: float = 0.8
    cooldown_s: float = 10.0
    vertical_cooldown_s: float = 2.0
    long_running_min: int = 2
    servers_max: int = 64
    threads_step: int = 1
    threads_min: int = 1
    default_tier: str = "dram"

    def __post_init__(self) -> None:
        if not 0.0 <= self.lower < self.upper <= 1.0:
            raise ValueError(f"need 0 <= lower < upper <= 1, got {self.lower}, {self.upper}")
        if (self.cooldown_s < 0 or self.threads_step < 1 or self.long_running_min < 0
                or self.threads_min < 1):
            raise ValueError(
                "cooldown_s >= 0, threads_step >= 1, long_running_min >= 0, threads_min >= 1"
            )
        if not 0 <= self.vertical_cooldown_s <= self.cooldown_s:
            raise ValueError("need 0 <= vertical_cooldown_s <= cooldown_s")
        if self.servers_max < self.long_running_min:
            raise ValueError("servers_max must be >= long_running_min")


@dataclass(frozen=True)
class AddThreads:
    """Vertical scaling: let server ``node_id`` run ``threads`` threads."""

    node_id: str
    threads: int
    reason: str


@dataclass(frozen=True)
class RemoveThreads:
    """Vertical scale-down: let server ``node_id`` run only ``threads`` threads."""

    node_id: str
    threads: int
    reason: str


@dataclass(frozen=True)
class AddServer:
    """Horizontal scaling: launch a server of ``tier`` (long-running if ``long_running``)."""

    tier: str
    reason: str
    long_running: bool = False


@dataclass(frozen=True)
class RemoveServers:
    """Scale down: drain the servers ``node_ids`` (weight 0 for new data), each exiting once it
    holds no data."""

    node_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class NoAction:
    """Nothing to do, and why."""

    reason: str


SizingAction = AddThreads | AddServer | RemoveServers | RemoveThreads | NoAction


@dataclass(frozen=True)
class ClusterUtilization:
    """Aggregate utilization of the active servers (each value 0..1; 0 with no servers).

    ``capacity_by_tier`` is what each tier holds (:attr:`ServerUtilization.held_bytes`) over
    its capacity; ``data_by_tier`` the data alone, which is what grows a tier (rule 5).
    """

    cpu: float
    net: float
    capacity_by_tier: dict[str, float] = field(default_factory=dict)
    data_by_tier: dict[str, float] = field(default_factory=dict)

    def highest(self) -> float:
        """The highest utilization of any dimension."""
        return max([self.cpu, self.net, *self.capacity_by_tier.values()])


def cluster_utilization(servers: Sequence[ServerUtilization]) -> ClusterUtilization:
    """Mean CPU, aggregate network and per-tier capacity use of the active servers."""
    active = [s for s in servers if s.active]
    if not active:
        return ClusterUtilization(cpu=0.0, net=0.0)
    cpu = sum(s.cpu_fraction for s in active) / len(active)
    net_capacity = sum(s.net_capacity_bytes_per_s for s in active)
    net = sum(s.net_bytes_per_s for s in active) / net_capacity if net_capacity > 0 else 0.0
    capacity: dict[str, float] = {}
    data: dict[str, float] = {}
    for tier in sorted({s.tier for s in active}):
        total = sum(s.capacity_bytes for s in active if s.tier == tier)
        held = sum(s.held_bytes for s in active if s.tier == tier)
        used = sum(s.used_bytes for s in active if s.tier == tier)
        capacity[tier] = held / total if total > 0 else 0.0
        data[tier] = used / total if total > 0 else 0.0
    return ClusterUtilization(cpu=cpu, net=net, capacity_by_tier=capacity, data_by_tier=data)


def decide(
    servers: Sequence[ServerUtilization],
    bounds: SizingBounds,
    *,
    now_s: float,
    last_action_s: float | None = None,
    pending: Mapping[str, int] | None = None,
) -> SizingAction:
    """The next sizing action for the cluster (rules in the module docstring)."""
    pending = pending or {}
    active = sorted((s for s in servers if s.active), key=lambda s: s.node_id)
    long_running = [s for s in active if s.long_running]
    if len(long_running) < bounds.long_running_min:
        tier = active[0].tier if active else bounds.default_tier
        return AddServer(
            tier,
            f"{len(long_running)} long-running servers, minimum {bounds.long_running_min}",
            long_running=True,
        )
    elapsed_s = math.inf if last_action_s is None else now_s - last_action_s
    if elapsed_s < bounds.vertical_cooldown_s:
        return NoAction(f"cool-down: last action {elapsed_s:.1f}s ago")

    target = (bounds.lower + bounds.upper) / 2
    for server in sorted(active, key=lambda s: (-s.cpu_fraction, s.node_id)):
        if server.cpu_fraction > bounds.upper and server.threads < server.threads_max:
            # A saturated CPU hides how much more it needs: double the threads.
            load = 2.0 * target if server.cpu_fraction >= 1.0 else server.cpu_fraction
            wanted = math.ceil(server.threads * load / target)
            threads = min(max(wanted, server.threads + bounds.threads_step), server.threads_max)
            return AddThreads(
                server.node_id,
                threads,
                f"cpu {server.cpu_fraction:.0%} > {bounds.upper:.0%} on {server.node_id}",
            )

    usage = cluster_utilization(active)
    hot = _hot_tier(active, usage, bounds)
    starting = sum(pending.values())
    below = usage.highest() < bounds.lower
    if hot is None and starting == 0:
        removal = _removals(
            active, usage, bounds, holding_data=below and elapsed_s >= bounds.cooldown_s
        )
        if removal is not None:
            return removal

    if elapsed_s < bounds.cooldown_s:
        return NoAction(f"cool-down: last action {elapsed_s:.1f}s ago")

    if hot is not None:
        tier, reason = hot
        if pending.get(tier, 0) > 0:
            return NoAction(f"{reason}; a {tier} server is already starting")
        if len(active) + starting >= bounds.servers_max:
            return NoAction(f"{reason}; at the limit of {bounds.servers_max} servers")
        return AddServer(tier, reason)

    if starting == 0:
        release = _thread_release(active, bounds, target)
        if release is not None:
            return release
    if not below:
        return NoAction(f"within bounds (highest {usage.highest():.0%})")
    if starting > 0:
        return NoAction("below bounds, but servers are still starting")
    return NoAction("below bounds, but no server can be removed")


def _removals(
    active: list[ServerUtilization],
    usage: ClusterUtilization,
    bounds: SizingBounds,
    *,
    holding_data: bool,
) -> RemoveServers | None:
    """Rule 3: the servers to drain now, if any.

    Candidates, fewest used bytes first: empty servers always, servers holding data only with
    ``holding_data``. Each is taken while the servers that stay could carry the load of every
    server taken so far without a dimension above the upper bound.
    """
    candidates = sorted(
        (s for s in active
         if not s.long_running and (s.held_bytes == 0 or holding_data)),
        key=lambda s: (s.held_bytes, s.node_id),
    )
    taken: list[ServerUtilization] = []
    for candidate in candidates:
        chosen = {s.node_id for s in taken} | {candidate.node_id}
        rest = [s for s in active if s.node_id not in chosen]
        if _utilization_without(rest, [*taken, candidate]).highest() <= bounds.upper:
            taken.append(candidate)
    if not taken:
        return None
    empty = all(s.held_bytes == 0 for s in taken)
    reason = (
        f"{len(taken)} empty server(s) not needed (highest {usage.highest():.0%})"
        if empty
        else f"all below {bounds.lower:.0%} (highest {usage.highest():.0%})"
    )
    return RemoveServers(tuple(s.node_id for s in taken), reason)


def _thread_release(
    active: list[ServerUtilization], bounds: SizingBounds, target: float
) -> RemoveThreads | None:
    """Rule 6: the idlest server running more threads than it needs, and how many to keep."""
    for server in sorted(active, key=lambda s: (s.cpu_fraction, s.node_id)):
        if server.cpu_fraction >= bounds.lower or server.threads <= bounds.threads_min:
            continue
        # Keep enough threads for the CPU to land at most in the middle of the band.
        needed = math.ceil(server.threads * max(server.cpu_fraction, 0.0) / target)
        threads = max(needed, bounds.threads_min)
        if threads < server.threads:
            return RemoveThreads(
                server.node_id,
                threads,
                f"cpu {server.cpu_fraction:.0%} < {bounds.lower:.0%} on {server.node_id} "
                f"with {server.threads} threads",
            )
    return None


def _hot_tier(
    active: list[ServerUtilization], usage: ClusterUtilization, bounds: SizingBounds
) -> tuple[str, str] | None:
    """The tier to grow and why, if any dimension is above the upper bound."""
    # The data, not the reservations (rule 5): a met reservation launches nothing.
    for tier, used in sorted(usage.data_by_tier.items(), key=lambda kv: (-kv[1], kv[0])):
        if used > bounds.upper:
            return tier, f"{tier} data {used:.0%} of capacity > {bounds.upper:.0%}"
    if usage.cpu > bounds.upper:
        busiest = max(active, key=lambda s: (s.cpu_fraction, s.node_id))
        return busiest.tier, f"cpu {usage.cpu:.0%} > {bounds.upper:.0%}"
    if usage.net > bounds.upper:
        busiest = max(
            active,
            key=lambda s: (s.net_bytes_per_s / (s.net_capacity_bytes_per_s or 1), s.node_id),
        )
        return busiest.tier, f"network {usage.net:.0%} > {bounds.upper:.0%}"
    return None


def _utilization_without(
    rest: list[ServerUtilization], removed: Sequence[ServerUtilization]
) -> ClusterUtilization:
    """Utilization once ``removed`` are gone and their load has moved to ``rest``.

    Their CPU and network load move to the remaining servers; what they hold stays counted
    against their tiers (new data of those tiers lands on the remaining servers).
    """
    if not rest:
        return ClusterUtilization(cpu=1.0, net=1.0)
    cpu = (sum(s.cpu_fraction for s in rest) + sum(s.cpu_fraction for s in removed)) / len(rest)
    net_capacity = sum(s.net_capacity_bytes_per_s for s in rest)
    net_used = sum(s.net_bytes_per_s for s in rest) + sum(s.net_bytes_per_s for s in removed)
    net = net_used / net_capacity if net_capacity > 0 else 1.0
    capacity: dict[str, float] = {}
    for tier in sorted({s.tier for s in rest} | {s.tier for s in removed}):
        total = sum(s.capacity_bytes for s in rest if s.tier == tier)
        held = sum(s.held_bytes for s in [*rest, *removed] if s.tier == tier)
        capacity[tier] = held / total if total > 0 else (1.0 if held else 0.0)
    return ClusterUtilization(cpu=cpu, net=net, capacity_by_tier=capacity)
