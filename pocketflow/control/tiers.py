"""Storage tier specifications: what one server of each tier offers and costs (configuration).

API summary (for the controller and the simulator):

- :class:`TierSpec` — one tier: per-server throughput (bytes/s), capacity (bytes), cost per hour,
  and whether it is a low-latency tier (DRAM) reserved for latency-sensitive jobs.
- :class:`ClusterSpec` — the tiers in latency-preference order (DRAM first) plus the per-task
  bandwidth used to turn ``max_concurrent_tasks`` into a throughput (default 600 Mb/s).
- :data:`I3_2XLARGE` — i3.2xlarge storage servers, the instance type of Pocket's (OSDI'18)
  evaluation, with the figures and sources below.
- :func:`local_spec` — a spec for small local servers (``LocalCluster``), sized by the caller.

The i3.2xlarge figures, and where each one comes from. The paper's own text (Table 3 and the
controller section) could not be retrieved, so no figure below is quoted from the paper; each is
traced to a source that was read:

- 60 GB of DRAM usable for data per server, 8 Gb/s (1 GB/s) of network throughput per server and
  600 Mb/s per task: the constants of Pocket's reference controller (github.com/stanford-mast/
  pocket, ``controller/controller.py``: ``DRAM_NODE_GB = 60``, ``NODE_Mbps = 8000``,
  ``PER_LAMBDA_MAX_Mbps = 600`` "AWS Lambda approximate per-lambda network limit"). That
  controller models each storage server as one tier: a DRAM server (60 GB, 8 Gb/s) or a
  Flash/ReFlex server (``FLASH_NODE_GB = 2000``, 8 Gb/s), as :data:`I3_2XLARGE` does.
- NVMe capacity per server: 1900 GB, the i3.2xlarge's one 1.9 TB NVMe SSD (AWS instance
  specification: 8 vCPU, 61 GiB, 1 x 1900 GB NVMe, "up to 10 Gb/s"). The reference controller
  rounds it to 2000 GB; ``tests/test_hints.py`` reproduces its arithmetic with a spec built
  from its constants, so the 100 GB difference never hides a rule difference.
- $0.624 per hour: the on-demand price of an i3.2xlarge in us-east-1. Both tiers run on the
  same instance type, so they cost the same per server; NVMe is far cheaper per byte.
"""

from __future__ import annotations

from dataclasses import dataclass

TIER_DRAM = "dram"
TIER_NVME = "nvme"

GB = 1000**3
MEGABIT_BYTES = 1_000_000 // 8

PER_TASK_THROUGHPUT_BYTES_PER_S_DEFAULT = 600 * MEGABIT_BYTES
"""600 Mb/s (reference controller's ``PER_LAMBDA_MAX_Mbps``) in bytes per second (75 MB/s)."""


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
