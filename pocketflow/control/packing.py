"""Online bin packing of a job's demand onto storage servers, producing its weight map (pure).

API summary (for the controller and the simulator):

- ``pack(demand, servers, spec) -> PackResult`` — place a new job. ``servers`` are
  :class:`ServerLoad` rows (capacity, throughput, what other jobs already hold, flags).
  ``PackResult.allocation`` is the weight map (:class:`Allocation` of :class:`Placement`);
  ``PackResult.shortfall`` is ``{tier: servers to launch}``, empty when the job fits. When it is
  not empty, launch those servers, then call ``pack`` again with them included (the allocation
  of a result with a shortfall covers only part of the job and must not be used).
- ``grow(allocation, old=..., new=..., servers=..., spec=...) -> PackResult`` — a running job's
  demand grew: the weight map for its next epoch; every server of the old map keeps its entry.
- ``remove_server(allocation, node_id, demand=..., servers=..., spec=...) -> PackResult`` — a
  server died or leaves: the map without it, its share re-placed on the other servers.
- ``refill(allocation, demand=..., servers=..., spec=..., leaving=...) -> PackResult`` — the
  share a map lacks (servers drained or lost) placed on servers with room; ``leaving`` servers
  stay in the map at weight 0. ``missing_share(allocation, demand)`` says how much it lacks.
- ``with_allocations(servers, jobs) -> list[ServerLoad]`` and
  ``allocated_by_server(jobs) -> {node_id: (throughput, capacity)}`` — the bookkeeping: what
  each server holds for the given ``(demand, allocation)`` pairs (weight x demand).

How a job is placed: ``demand.tiers`` are tried in order; within a tier, servers are filled
smallest gap first (best fit, as Pocket's controller does), each taking the largest share ``w``
of the job for which ``w x throughput`` and ``w x capacity`` fit in its free throughput and
capacity. Draining and dead servers get nothing. Weights are the shares (they sum to 1).
Long-running servers are always in the map (weight 0 when not chosen) and are the only ones with
``persist=True``. A ``spread`` demand (no hints) reserves nothing: its data is spread over every
active server of the first tier with free capacity, weighted by free bytes.

The shortfall: a latency-sensitive job launches servers of its first (DRAM) tier for the
throughput it still lacks, and spills the capacity those cannot hold to its next tier; other jobs
launch servers of their first (cheapest) tier.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from pocketflow.control.hints import JobDemand
from pocketflow.control.tiers import ClusterSpec

SHARE_EPSILON = 1e-9
"""Shares below this are rounding noise, not placement."""

WEIGHT_FLOOR = 1e-3
"""A full server in a spread job still gets this relative weight (the server then refuses)."""


@dataclass(frozen=True)
class ServerLoad:
    """What the packing knows about one storage server: size, what other jobs hold, flags.

    ``allocated_*`` are the reservations of jobs already placed (weight x demand, see
    :func:`with_allocations`); ``used_bytes`` is the measured use, which a spread job's
    weighting and the free capacity also respect.
    """

    node_id: str
    tier: str
    capacity_bytes: int
    throughput_bytes_per_s: int
    allocated_capacity_bytes: int = 0
    allocated_throughput_bytes_per_s: int = 0
    used_bytes: int = 0
    long_running: bool = False
    draining: bool = False
    dead: bool = False

    @property
    def active(self) -> bool:
        """Whether new placements may go to this server."""
        return not (self.draining or self.dead)

    @property
    def free_capacity_bytes(self) -> int:
        """Capacity neither reserved nor used (never negative)."""
        return max(
            self.capacity_bytes - max(self.allocated_capacity_bytes, self.used_bytes), 0
        )

    @property
    def free_throughput_bytes_per_s(self) -> int:
        """Throughput not reserved by other jobs (never negative)."""
        return max(self.throughput_bytes_per_s - self.allocated_throughput_bytes_per_s, 0)


@dataclass(frozen=True)
class Placement:
    """One server of a job's weight map.

    ``weight`` is the server's share of the job's non-PERSIST data (0 for a server that is in
    the map only to hold PERSIST objects or data of an older epoch); ``persist`` says whether
    PERSIST objects may be placed on it.
    """

    node_id: str
    weight: float
    persist: bool


@dataclass(frozen=True)
class Allocation:
    """A job's weight map, ordered by node id."""

    placements: tuple[Placement, ...]

    def weights(self) -> dict[str, float]:
        """``node_id -> weight`` for every server of the map."""
        return {p.node_id: p.weight for p in self.placements}

    def node_ids(self) -> list[str]:
        """Every server of the map, ordered by node id."""
        return [p.node_id for p in self.placements]


@dataclass(frozen=True)
class PackResult:
    """A weight map and, when the job does not fit, the servers to launch per tier."""

    allocation: Allocation
    shortfall: dict[str, int] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """Whether the job fits on the given servers (no server needs launching)."""
        return not self.shortfall


def pack(demand: JobDemand, servers: Sequence[ServerLoad], spec: ClusterSpec) -> PackResult:
    """Place a new job's demand on ``servers`` (module doc for the rules)."""
    _check_tiers(demand, spec)
    if demand.spread or (demand.throughput_bytes_per_s == 0 and demand.capacity_bytes == 0):
        return _pack_spread(demand, servers)
    shares, remaining = _fill(demand, servers, fraction=1.0)
    shortfall = _shortfall(demand, remaining, spec) if remaining > SHARE_EPSILON else {}
    return PackResult(_allocation(shares, servers), shortfall)


def grow(
    allocation: Allocation,
    *,
    old: JobDemand,
    new: JobDemand,
    servers: Sequence[ServerLoad],
    spec: ClusterSpec,
) -> PackResult:
    """The weight map of a running job's next epoch after its demand grew from ``old`` to ``new``.

    ``servers`` must already count the job's current reservation (``with_allocations``). Only
    the growth is placed, on free room; every server of the old map keeps its entry (weight 0 at
    least), so data written under older epochs stays reachable. Weights are each server's part
    of the new total.
    """
    _check_tiers(new, spec)
    old_weights = allocation.weights()
    if new.spread:
        return PackResult(_merge(allocation, servers, _pack_spread(new, servers).allocation))
    delta_throughput = max(new.throughput_bytes_per_s - old.throughput_bytes_per_s, 0)
    delta_capacity = max(new.capacity_bytes - old.capacity_bytes, 0)
    if delta_throughput == 0 and delta_capacity == 0:
        return PackResult(allocation)
    delta = replace(
        new, throughput_bytes_per_s=delta_throughput, capacity_bytes=delta_capacity
    )
    delta_shares, remaining = _fill(delta, servers, fraction=1.0)
    if remaining > SHARE_EPSILON:
        partial = _allocation(delta_shares, servers)
        return PackResult(
            _merge(allocation, servers, partial), _shortfall(delta, remaining, spec)
        )
    # Each server's part of the new total, per dimension; the weight is the larger part
    # (a weight covers both dimensions at once), normalized so the weights sum to 1.
    old_part = 0.0 if old.spread else 1.0
    parts: dict[str, float] = {}
    for node_id in set(old_weights) | set(delta_shares):
        w_old = old_weights.get(node_id, 0.0) * old_part
        x = delta_shares.get(node_id, 0.0)
        part = 0.0
        for old_amount, delta_amount, new_amount in (
            (old.throughput_bytes_per_s, delta_throughput, new.throughput_bytes_per_s),
            (old.capacity_bytes, delta_capacity, new.capacity_bytes),
        ):
            if new_amount > 0:
                part = max(part, (w_old * old_amount + x * delta_amount) / new_amount)
        parts[node_id] = part
    total = sum(parts.values())
    shares = {n: (p / total if total > 0 else 0.0) for n, p in parts.items()}
    return PackResult(_merge(allocation, servers, _allocation(shares, servers)))


def remove_server(
    allocation: Allocation,
    node_id: str,
    *,
    demand: JobDemand,
    servers: Sequence[ServerLoad],
    spec: ClusterSpec,
) -> PackResult:
    """The job's weight map without ``node_id`` (dead or leaving), its share placed elsewhere.

    ``servers`` must count the job's current reservation; the removed server is never chosen,
    whatever its flags say. When the lost share does not fit, the result names the shortfall.
    """
    _check_tiers(demand, spec)
    others = [s for s in servers if s.node_id != node_id]
    weights = {n: w for n, w in allocation.weights().items() if n != node_id}
    persist = {p.node_id: p.persist for p in allocation.placements if p.node_id != node_id}
    lost = allocation.weights().get(node_id, 0.0)
    kept = sum(weights.values())

    if demand.spread:
        if kept > SHARE_EPSILON:
            shares = {n: w / kept for n, w in weights.items()}
            return PackResult(_allocation(shares, others, keep=persist))
        fresh = _pack_spread(demand, others)
        return PackResult(_allocation(fresh.allocation.weights(), others, keep=persist))

    if lost <= SHARE_EPSILON:
        shares = {n: (w / kept if kept > SHARE_EPSILON else w) for n, w in weights.items()}
        return PackResult(_allocation(shares, others, keep=persist))
    extra, remaining = _fill(demand, others, fraction=lost)
    shares = dict(weights)
    for n, share in extra.items():
        shares[n] = shares.get(n, 0.0) + share
    shortfall = _shortfall(demand, remaining, spec) if remaining > SHARE_EPSILON else {}
    return PackResult(_allocation(shares, others, keep=persist), shortfall)


def refill(
    allocation: Allocation,
    *,
    demand: JobDemand,
    servers: Sequence[ServerLoad],
    spec: ClusterSpec,
    leaving: Iterable[str] = (),
) -> PackResult:
    """The job's weight map with the share it lacks placed on servers with room.

    A map lacks share when servers left it: a drained server keeps its entry at weight 0 (its
    data stays readable), a lost one is gone, and the other servers' weights then sum to less
    than 1, so the job's reservation (weight x demand) counts less than it needs. ``leaving``
    servers get weight 0 and ``persist=False`` here (they stay in the map) and are never chosen.
    The missing share is placed as a new job's is (best fit, tier order) on the active servers,
    which must count the job's current reservation (:func:`with_allocations`); what does not fit
    is the shortfall. A ``spread`` job reserves nothing: its kept weights are normalized, or it
    is spread afresh when none is left.
    """
    _check_tiers(demand, spec)
    gone = set(leaving)
    weights = {p.node_id: p.weight for p in allocation.placements if p.node_id not in gone}
    keep = {p.node_id: p.persist and p.node_id not in gone for p in allocation.placements}
    choosable = [s for s in servers if s.node_id not in gone]
    kept = sum(weights.values())
    if demand.spread:
        if kept > SHARE_EPSILON:
            shares = {n: w / kept for n, w in weights.items() if w > 0}
            return PackResult(_allocation(shares, choosable, keep=keep))
        fresh = _pack_spread(demand, choosable)
        return PackResult(_allocation(fresh.allocation.weights(), choosable, keep=keep),
                          fresh.shortfall)
    shares = {n: w for n, w in weights.items() if w > 0}
    missing = 1.0 - kept
    if missing <= SHARE_EPSILON:
        return PackResult(_allocation(shares, choosable, keep=keep))
    extra, remaining = _fill(demand, choosable, fraction=missing)
    for node_id, share in extra.items():
        shares[node_id] = shares.get(node_id, 0.0) + share
    shortfall = _shortfall(demand, remaining, spec) if remaining > SHARE_EPSILON else {}
    return PackResult(_allocation(shares, choosable, keep=keep), shortfall)


def missing_share(allocation: Allocation, demand: JobDemand) -> float:
    """The share of ``demand`` that ``allocation`` places nowhere (0 for a spread job, whose
    weights are relative)."""
    if demand.spread or (demand.throughput_bytes_per_s == 0 and demand.capacity_bytes == 0):
        return 0.0
    missing = 1.0 - sum(p.weight for p in allocation.placements)
    return missing if missing > SHARE_EPSILON else 0.0


def allocated_by_server(
    jobs: Iterable[tuple[JobDemand, Allocation]],
) -> dict[str, tuple[int, int]]:
    """``node_id -> (throughput bytes/s, capacity bytes)`` reserved by ``jobs`` together."""
    totals: dict[str, list[float]] = {}
    for demand, allocation in jobs:
        for placement in allocation.placements:
            entry = totals.setdefault(placement.node_id, [0.0, 0.0])
            entry[0] += placement.weight * demand.throughput_bytes_per_s
            entry[1] += placement.weight * demand.capacity_bytes
    return {n: (math.ceil(t - 1e-6), math.ceil(c - 1e-6)) for n, (t, c) in totals.items()}


def with_allocations(
    servers: Iterable[ServerLoad], jobs: Iterable[tuple[JobDemand, Allocation]]
) -> list[ServerLoad]:
    """``servers`` with ``allocated_*`` set to what ``jobs`` reserve on each."""
    totals = allocated_by_server(jobs)
    result = []
    for server in servers:
        throughput, capacity = totals.get(server.node_id, (0, 0))
        result.append(
            replace(
                server,
                allocated_throughput_bytes_per_s=throughput,
                allocated_capacity_bytes=capacity,
            )
        )
    return result


# -- internals ------------------------------------------------------------------------------


def _check_tiers(demand: JobDemand, spec: ClusterSpec) -> None:
    unknown = [t for t in demand.tiers if not spec.has_tier(t)]
    if unknown:
        raise ValueError(f"demand names tiers the cluster spec lacks: {unknown}")


def _share_room(server: ServerLoad, demand: JobDemand) -> float:
    """The largest share of ``demand`` whose throughput and capacity fit on ``server``."""
    room = math.inf
    if demand.throughput_bytes_per_s > 0:
        room = min(room, server.free_throughput_bytes_per_s / demand.throughput_bytes_per_s)
    if demand.capacity_bytes > 0:
        room = min(room, server.free_capacity_bytes / demand.capacity_bytes)
    return room


def _fill(
    demand: JobDemand, servers: Sequence[ServerLoad], *, fraction: float
) -> tuple[dict[str, float], float]:
    """Place ``fraction`` of ``demand``: shares per server and the fraction left over."""
    remaining = fraction
    shares: dict[str, float] = {}
    for tier in demand.tiers:
        if remaining <= SHARE_EPSILON:
            break
        candidates = [
            (room, s.node_id)
            for s in servers
            if s.active and s.tier == tier
            for room in (_share_room(s, demand),)
            if room > SHARE_EPSILON
        ]
        # Best fit: the smallest gap first keeps large free servers for large jobs.
        for room, node_id in sorted(candidates):
            take = min(room, remaining)
            shares[node_id] = shares.get(node_id, 0.0) + take
            remaining -= take
            if remaining <= SHARE_EPSILON:
                break
    return shares, max(remaining, 0.0)


def _shortfall(demand: JobDemand, remaining: float, spec: ClusterSpec) -> dict[str, int]:
    """Servers to launch, per tier, for the share ``remaining`` of ``demand``."""
    throughput = demand.throughput_bytes_per_s * remaining
    capacity = demand.capacity_bytes * remaining
    first = spec.tier(demand.tiers[0])
    if not (demand.latency_sensitive and first.low_latency and len(demand.tiers) > 1):
        count = max(
            math.ceil(throughput / first.throughput_bytes_per_s - SHARE_EPSILON),
            math.ceil(capacity / first.capacity_bytes - SHARE_EPSILON),
            1,
        )
        return {first.name: count}
    # DRAM for the throughput; the capacity those servers cannot hold spills to the next tier.
    count = max(math.ceil(throughput / first.throughput_bytes_per_s - SHARE_EPSILON), 1)
    held = count * first.capacity_bytes
    if capacity <= held * (1 + SHARE_EPSILON):
        return {first.name: count}
    spill_share = (capacity - held) / capacity
    spill = spec.tier(demand.tiers[1])
    spill_count = max(
        math.ceil(throughput * spill_share / spill.throughput_bytes_per_s - SHARE_EPSILON),
        math.ceil((capacity - held) / spill.capacity_bytes - SHARE_EPSILON),
        1,
    )
    return {first.name: count, spill.name: spill_count}


def _pack_spread(demand: JobDemand, servers: Sequence[ServerLoad]) -> PackResult:
    """The no-hints default: every active server of the first tier with room, by free bytes."""
    active = [s for s in servers if s.active]
    for tier in demand.tiers:
        tier_servers = [s for s in active if s.tier == tier]
        if any(s.free_capacity_bytes > 0 for s in tier_servers):
            break
    else:
        # Every tier is full (or empty): use the first tier that has servers at all.
        tier_servers = next(
            ([s for s in active if s.tier == t] for t in demand.tiers
             if any(s.tier == t for s in active)),
            [],
        )
    if not tier_servers:
        return PackResult(_allocation({}, servers), {demand.tiers[0]: 1})
    total_capacity = sum(s.capacity_bytes for s in tier_servers) or 1
    raw = {
        s.node_id: max(s.free_capacity_bytes / total_capacity, WEIGHT_FLOOR) for s in tier_servers
    }
    total = sum(raw.values())
    return PackResult(_allocation({n: w / total for n, w in raw.items()}, servers))


def _allocation(
    shares: dict[str, float],
    servers: Sequence[ServerLoad],
    *,
    keep: dict[str, bool] | None = None,
) -> Allocation:
    """A weight map from shares: chosen servers, plus active long-running ones at weight 0.

    ``keep`` names servers of an older map (with their persist flag) that stay in the map.
    """
    by_id = {s.node_id: s for s in servers}
    entries: dict[str, Placement] = {}
    for node_id, persist in (keep or {}).items():
        entries[node_id] = Placement(node_id, 0.0, persist)
    for server in servers:
        if server.long_running and server.active:
            entries[server.node_id] = Placement(server.node_id, 0.0, True)
    for node_id, share in shares.items():
        server = by_id.get(node_id)
        persist = server.long_running if server is not None else entries.get(
            node_id, Placement(node_id, 0.0, False)
        ).persist
        entries[node_id] = Placement(node_id, share, persist)
    return Allocation(tuple(entries[n] for n in sorted(entries)))


def _merge(old: Allocation, servers: Sequence[ServerLoad], new: Allocation) -> Allocation:
    """``new`` plus every server of ``old`` that ``new`` lacks, at weight 0."""
    entries = {p.node_id: p for p in new.placements}
    for placement in old.placements:
        entries.setdefault(placement.node_id, Placement(placement.node_id, 0.0, placement.persist))
    return Allocation(tuple(entries[n] for n in sorted(entries)))
