"""Tests of the hints-to-demand policy and of Pocket's Table 3 examples on i3.2xlarge servers."""

from __future__ import annotations

import pytest

from pocketflow.control.hints import JobDemand, demand_from_hints, derive_demand, servers_needed
from pocketflow.control.packing import pack
from pocketflow.control.tiers import (
    GB,
    I3_2XLARGE,
    PER_TASK_THROUGHPUT_BYTES_PER_S_DEFAULT,
    ClusterSpec,
    TierSpec,
    local_spec,
)
from pocketflow.errors import ClusterError
from pocketflow.job import Hints

GBPS = 1_000_000_000  # one gigabyte per second


def table3(hints: dict[str, object]) -> dict[str, int]:
    """Hints -> servers of each tier a job gets on an empty i3.2xlarge cluster (Table 3)."""
    demand = demand_from_hints(Hints.coerce(hints), I3_2XLARGE)
    return pack(demand, [], I3_2XLARGE).shortfall


# -- Pocket Table 3 on i3.2xlarge: hints -> resulting allocation (tier and server counts) ---------


def test_table3_i3_2xlarge_figures() -> None:
    dram, nvme = I3_2XLARGE.tier("dram"), I3_2XLARGE.tier("nvme")
    assert dram.throughput_bytes_per_s == nvme.throughput_bytes_per_s == 8000 * 125_000
    assert dram.capacity_bytes == 60 * GB
    assert nvme.capacity_bytes == 1900 * GB
    assert dram.low_latency and not nvme.low_latency
    assert I3_2XLARGE.per_task_throughput_bytes_per_s == 75_000_000  # 600 Mb/s


def test_table3_no_hints_is_the_conservative_spread_default() -> None:
    demand = demand_from_hints(Hints(), I3_2XLARGE)
    assert demand.spread
    assert demand.tiers == ("dram", "nvme")  # DRAM first, then NVMe
    assert demand.throughput_bytes_per_s == demand.capacity_bytes == 0


def test_table3_concurrent_tasks_give_throughput_then_capacity_by_ratio() -> None:
    # N = 100 tasks x 600 Mb/s = 60 Gb/s = 7.5 GB/s -> 8 DRAM servers; capacity follows from the
    # DRAM servers' capacity-to-throughput ratio (60 GB per GB/s): 450 GB.
    demand = demand_from_hints(Hints(max_concurrent_tasks=100), I3_2XLARGE)
    assert demand.throughput_bytes_per_s == 7_500_000_000
    assert demand.capacity_bytes == 450 * GB
    assert table3({"max_concurrent_tasks": 100}) == {"dram": 8}


def test_table3_capacity_only_gives_throughput_by_ratio() -> None:
    demand = demand_from_hints(Hints(data_size_bytes=120 * GB), I3_2XLARGE)
    assert demand.throughput_bytes_per_s == 2 * GBPS
    assert table3({"data_size_bytes": 120 * GB}) == {"dram": 2}


def test_table3_peak_throughput_only_gives_capacity_by_ratio() -> None:
    demand = demand_from_hints(Hints(peak_throughput_bytes_per_s=3 * GBPS), I3_2XLARGE)
    assert demand.capacity_bytes == 180 * GB
    assert table3({"peak_throughput_bytes_per_s": 3 * GBPS}) == {"dram": 3}


def test_table3_peak_throughput_wins_over_concurrent_tasks() -> None:
    demand = derive_demand(
        I3_2XLARGE, max_concurrent_tasks=1000, peak_throughput_bytes_per_s=GBPS
    )
    assert demand.throughput_bytes_per_s == GBPS


def test_table3_latency_insensitive_gets_no_dram() -> None:
    # 250 tasks -> 18.75 GB/s -> 19 NVMe servers; capacity by the NVMe ratio (1900 GB per GB/s).
    demand = demand_from_hints(
        Hints(latency_sensitive=False, max_concurrent_tasks=250), I3_2XLARGE
    )
    assert demand.tiers == ("nvme",)
    assert demand.capacity_bytes == 18.75 * 1900 * GB
    assert table3({"latency_sensitive": False, "max_concurrent_tasks": 250}) == {"nvme": 19}


def test_table3_latency_insensitive_capacity_and_throughput_both_hinted() -> None:
    hints = {
        "latency_sensitive": False,
        "data_size_bytes": 1000 * GB,
        "peak_throughput_bytes_per_s": 5 * GBPS,
    }
    assert table3(hints) == {"nvme": 5}  # throughput-bound
    hints["data_size_bytes"] = 10_000 * GB
    assert table3(hints) == {"nvme": 6}  # capacity-bound: ceil(10 TB / 1.9 TB)


def test_table3_latency_sensitive_capacity_bound_spills_to_nvme() -> None:
    # 200 GB at 1 GB/s: one DRAM server for the throughput holds 60 GB; the rest goes to NVMe.
    hints = {"data_size_bytes": 200 * GB, "peak_throughput_bytes_per_s": GBPS}
    assert table3(hints) == {"dram": 1, "nvme": 1}


# -- derivation details ---------------------------------------------------------------------


def test_per_task_bandwidth_is_configurable() -> None:
    spec = ClusterSpec(tiers=I3_2XLARGE.tiers, per_task_throughput_bytes_per_s=10_000_000)
    demand = derive_demand(spec, max_concurrent_tasks=10)
    assert demand.throughput_bytes_per_s == 100_000_000
    assert PER_TASK_THROUGHPUT_BYTES_PER_S_DEFAULT == 600 * 1_000_000 // 8


def test_cheapest_tier_is_chosen_for_latency_insensitive_jobs() -> None:
    ssd = TierSpec("ssd", 500_000_000, 4000 * GB, 0.30, low_latency=False)
    hdd = TierSpec("hdd", 100_000_000, 16_000 * GB, 0.20, low_latency=False)
    spec = ClusterSpec(tiers=(I3_2XLARGE.tier("dram"), ssd, hdd))
    # Throughput-bound: 1 GB/s needs 2 SSD servers ($0.60) or 10 HDD servers ($2.00).
    fast = derive_demand(
        spec, latency_sensitive=False, data_size_bytes=100 * GB, peak_throughput_bytes_per_s=GBPS
    )
    assert fast.tiers == ("ssd", "hdd")
    # Capacity-bound: 64 TB at 100 MB/s needs 16 SSD servers ($4.80) or 4 HDD servers ($0.80).
    big = derive_demand(
        spec,
        latency_sensitive=False,
        data_size_bytes=64_000 * GB,
        peak_throughput_bytes_per_s=100_000_000,
    )
    assert big.tiers == ("hdd", "ssd")


def test_latency_insensitive_without_a_non_dram_tier_is_a_cluster_error() -> None:
    spec = local_spec(dram_capacity_bytes=256 << 20)
    with pytest.raises(ClusterError):
        derive_demand(spec, latency_sensitive=False)


def test_demand_from_hints_accepts_the_controllers_dict() -> None:
    hints = Hints(max_concurrent_tasks=4, data_size_bytes="1GiB")
    assert demand_from_hints(hints.to_dict(), I3_2XLARGE) == demand_from_hints(hints, I3_2XLARGE)


def test_demand_round_trips_through_dict() -> None:
    demand = derive_demand(I3_2XLARGE, max_concurrent_tasks=7)
    assert JobDemand.from_dict(demand.to_dict()) == demand


def test_servers_needed_takes_the_binding_dimension() -> None:
    nvme = I3_2XLARGE.tier("nvme")
    assert servers_needed(nvme, throughput_bytes_per_s=GBPS, capacity_bytes=0) == 1
    assert servers_needed(nvme, throughput_bytes_per_s=GBPS + 1, capacity_bytes=0) == 2
    assert servers_needed(nvme, throughput_bytes_per_s=0, capacity_bytes=3800 * GB) == 2


def test_invalid_specs_are_refused() -> None:
    with pytest.raises(ValueError):
        TierSpec("dram", 0, 1, 1.0, low_latency=True)
    with pytest.raises(ValueError):
        ClusterSpec(tiers=())
    with pytest.raises(ValueError):
        ClusterSpec(tiers=(I3_2XLARGE.tier("dram"), I3_2XLARGE.tier("dram")))
    with pytest.raises(KeyError):
        I3_2XLARGE.tier("tape")
