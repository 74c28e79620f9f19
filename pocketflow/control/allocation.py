"""Older DRAM-first allocation policy, kept until the controller uses the packing policy (pure).

:mod:`pocketflow.control.packing` (with :mod:`pocketflow.control.hints`) supersedes it: it places
a job's throughput and capacity, not only its size, and names the servers to launch when the job
does not fit. ``Placement`` and ``Allocation`` are shared with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pocketflow.control.packing import Allocation, Placement
from pocketflow.control.tiers import TIER_DRAM, TIER_NVME
from pocketflow.errors import CapacityExhausted, ClusterError

__all__ = [
    "TIER_DRAM",
    "TIER_NVME",
    "TIERS",
    "Allocation",
    "AllocationRequest",
    "Placement",
    "ServerState",
    "allocate",
]

TIERS = (TIER_DRAM, TIER_NVME)

# A server with no free bytes still gets this relative weight, so that its share is not zero and
# a job that fits nowhere else can still reach it (the server then refuses with capacity_exhausted).
WEIGHT_FLOOR = 1e-3


@dataclass(frozen=True)
class ServerState:
    """What the policy knows about one storage server at allocation time."""

    node_id: str
    tier: str
    capacity_bytes: int
    used_bytes: int
    long_running: bool
    draining: bool = False

    @property
    def free_bytes(self) -> int:
        """Bytes not yet used on the server (never negative)."""
        return max(self.capacity_bytes - self.used_bytes, 0)


@dataclass(frozen=True)
class AllocationRequest:
    """The part of a job's hints the allocation policy reads.

    ``data_size_bytes`` is the job's expected peak of live data; ``None`` means unknown, which
    the policy treats as "fits in the preferred tier".
    """

    latency_sensitive: bool = True
    data_size_bytes: int | None = None


def allocate(request: AllocationRequest, servers: Sequence[ServerState]) -> Allocation:
    """Choose a job's servers and weights from its hints and the servers' current usage.

    Latency-sensitive jobs (Pocket Table 3): DRAM first; NVMe is added only when the hinted data
    size exceeds the free DRAM, with a share proportional to the overflow. Latency-insensitive
    jobs get no DRAM for their data. Within a tier, servers are weighted by their free bytes.
    Long-running servers are always in the map so that PERSIST puts have somewhere to go; when a
    long-running server is not chosen for the job's data it appears with weight 0.

    Raises ``ClusterError`` when no server of a usable tier is active, and ``CapacityExhausted``
    when the hinted data size exceeds the free bytes of every usable tier together.
    """
    active = sorted((s for s in servers if not s.draining), key=lambda s: s.node_id)
    dram = [s for s in active if s.tier == TIER_DRAM]
    nvme = [s for s in active if s.tier == TIER_NVME]
    shares = _tier_shares(request, dram=dram, nvme=nvme)

    weights: dict[str, float] = {}
    for tier_servers, share in ((dram, shares[TIER_DRAM]), (nvme, shares[TIER_NVME])):
        if share <= 0.0:
            continue
        for node_id, weight in _weights_by_free_bytes(tier_servers, share=share).items():
            weights[node_id] = weight

    placements = []
    for server in active:
        if server.node_id in weights or server.long_running:
            placements.append(
                Placement(
                    node_id=server.node_id,
                    weight=weights.get(server.node_id, 0.0),
                    persist=server.long_running,
                )
            )
    return Allocation(placements=tuple(placements))


def _tier_shares(
    request: AllocationRequest, *, dram: list[ServerState], nvme: list[ServerState]
) -> dict[str, float]:
    """Fraction of the job's data that each tier should receive (sums to 1)."""
    dram_free = sum(s.free_bytes for s in dram)
    nvme_free = sum(s.free_bytes for s in nvme)
    size = request.data_size_bytes

    if not request.latency_sensitive:
        if not nvme:
            raise ClusterError("a latency-insensitive job needs an NVMe server; none is active")
        if size is not None and size > nvme_free:
            raise CapacityExhausted(
                f"job hints {size} bytes but the NVMe tier has {nvme_free} bytes free"
            )
        return {TIER_DRAM: 0.0, TIER_NVME: 1.0}

    if not dram and not nvme:
        raise ClusterError("no active storage server")
    if not dram:
        if size is not None and size > nvme_free:
            raise CapacityExhausted(
                f"job hints {size} bytes but the cluster has {nvme_free} bytes free"
            )
        return {TIER_DRAM: 0.0, TIER_NVME: 1.0}
    if size is None or size <= dram_free or not nvme:
        if size is not None and size > dram_free:
            raise CapacityExhausted(
                f"job hints {size} bytes but the cluster has {dram_free} bytes free"
            )
        return {TIER_DRAM: 1.0, TIER_NVME: 0.0}
    if size > dram_free + nvme_free:
        raise CapacityExhausted(
            f"job hints {size} bytes but the cluster has {dram_free + nvme_free} bytes free"
        )
    dram_share = dram_free / size
    return {TIER_DRAM: dram_share, TIER_NVME: 1.0 - dram_share}


def _weights_by_free_bytes(servers: list[ServerState], *, share: float) -> dict[str, float]:
    """Split ``share`` over ``servers`` in proportion to their free bytes."""
    total_capacity = sum(s.capacity_bytes for s in servers) or 1
    raw = {
        s.node_id: max(s.free_bytes / total_capacity, WEIGHT_FLOOR) for s in servers
    }
    total = sum(raw.values())
    return {node_id: share * w / total for node_id, w in raw.items()}
