"""Storage tier specifications: what one server of each tier offers and costs (configuration).

API summary (for the controller and the simulator):

- :class:`TierSpec` — one tier: per-server throughput (bytes/s), capacity (bytes), cost per hour,
  and whether it is a low-latency tier (DRAM) reserved for latency-sensitive jobs.
- :class:`ClusterSpec` — the tiers in latency-preference order (DRAM first) plus the per-task
  bandwidth used to turn ``max_concurrent_tasks`` into a throughput (default 600 Mb/s).
- :data:`I3_2XLARGE` — Pocket's (OSDI'18) evaluation figures for i3.2xlarge storage servers.
- :func:`local_spec` — a spec for small local servers (``LocalCluster``), sized by the caller.

The i3.2xlarge figures, and where they come from (the paper's Table 3 text itself was not
available to us, so each value is traced to a source we could check):

- 8 vCPU, 61 GiB DRAM, one 1.9 TB NVMe SSD, "up to 10 Gb/s" network: the AWS instance
  specification the paper cites for its storage servers.
- 60 GB of DRAM usable for data per server, and 8 Gb/s (1 GB/s) of achievable network throughput
  per server: the constants of Pocket's reference controller (``DRAM_NODE_GB = 60``,
  ``NODE_Mbps = 8000``). NVMe capacity per server is the instance's 1.9 TB (the reference
  controller rounds it to 2000 GB).
- 600 Mb/s per task: the per-lambda network limit of the paper and its reference controller
  (``PER_LAMBDA_MAX_Mbps = 600``).
- $0.624 per hour: the on-demand price of an i3.2xlarge in us-east-1 at the time of the paper.
  Both tiers run on the same instance type, so they cost the same per server; NVMe is far cheaper
  per byte.
"""

from __future__ import annotations

from dataclasses import dataclass

TIER_DRAM = "dram"
TIER_NVME = "nvme"

GB = 1000**3
MEGABIT_BYTES = 1_000_000 // 8

PER_TASK_THROUGHPUT_BYTES_PER_S_DEFAULT = 600 * MEGABIT_BYTES
"""600 Mb/s, Pocket's per-lambda network limit, in bytes per second (75 MB/s)."""


@dataclass(frozen=True)
class TierSpec:
    """What one storage server of a tier offers: throughput, capacity, cost.

    ``low_latency`` marks DRAM-like tiers: latency-insensitive jobs never get them.
    """

    name: str
    throughput_bytes_per_s: int
    capacity_bytes: int
    cost_per_hour: float
    low_latency: bool

    def __post_init__(self) -> None:
        if self.throughput_bytes_per_s <= 0:
            raise ValueError(f"tier {self.name}: throughput_bytes_per_s must be > 0")
        if self.capacity_bytes <= 0:
            raise ValueError(f"tier {self.name}: capacity_bytes must be > 0")
        if self.cost_per_hour < 0:
            raise ValueError(f"tier {self.name}: cost_per_hour must be >= 0")

    @property
    def capacity_per_throughput_s(self) -> float:
        """Capacity-to-throughput ratio: bytes of capacity per byte/s of throughput."""
        return self.capacity_bytes / self.throughput_bytes_per_s


@dataclass(frozen=True)
class ClusterSpec:
    """The storage tiers a cluster can run, in latency-preference order (DRAM first)."""

    tiers: tuple[TierSpec, ...]
    per_task_throughput_bytes_per_s: int = PER_TASK_THROUGHPUT_BYTES_PER_S_DEFAULT

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("a cluster spec needs at least one tier")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tier names in {names}")
        if self.per_task_throughput_bytes_per_s <= 0:
            raise ValueError("per_task_throughput_bytes_per_s must be > 0")

    def tier(self, name: str) -> TierSpec:
        """The spec of tier ``name``. Raises ``KeyError`` for an unknown tier."""
        for spec in self.tiers:
            if spec.name == name:
                return spec
        raise KeyError(f"unknown tier {name!r}; known: {', '.join(t.name for t in self.tiers)}")

    def has_tier(self, name: str) -> bool:
        """Whether the cluster can run servers of tier ``name``."""
        return any(t.name == name for t in self.tiers)


I3_2XLARGE = ClusterSpec(
    tiers=(
        TierSpec(
            name=TIER_DRAM,
            throughput_bytes_per_s=8000 * MEGABIT_BYTES,
            capacity_bytes=60 * GB,
            cost_per_hour=0.624,
            low_latency=True,
        ),
        TierSpec(
            name=TIER_NVME,
            throughput_bytes_per_s=8000 * MEGABIT_BYTES,
            capacity_bytes=1900 * GB,
            cost_per_hour=0.624,
            low_latency=False,
        ),
    ),
)
"""Pocket's i3.2xlarge storage servers (figures and sources in the module docstring)."""


def local_spec(
    *,
    dram_capacity_bytes: int,
    nvme_capacity_bytes: int | None = None,
    throughput_bytes_per_s: int = 1000 * MEGABIT_BYTES,
    per_task_throughput_bytes_per_s: int = PER_TASK_THROUGHPUT_BYTES_PER_S_DEFAULT,
) -> ClusterSpec:
    """A spec for small local servers: a DRAM tier and, if sized, an NVMe tier.

    Costs are nominal (NVMe cheaper than DRAM per server) so the cheapest-tier rule still
    prefers NVMe for latency-insensitive jobs.
    """
    tiers = [
        TierSpec(TIER_DRAM, throughput_bytes_per_s, dram_capacity_bytes, 1.0, low_latency=True)
    ]
    if nvme_capacity_bytes is not None:
        tiers.append(
            TierSpec(TIER_NVME, throughput_bytes_per_s, nvme_capacity_bytes, 0.5, low_latency=False)
        )
    return ClusterSpec(
        tiers=tuple(tiers), per_task_throughput_bytes_per_s=per_task_throughput_bytes_per_s
    )
