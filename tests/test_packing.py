"""Tests of the online bin-packing policy (pure: no Ray, no servers)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pocketflow.control.hints import JobDemand, derive_demand
from pocketflow.control.packing import (
    Allocation,
    Placement,
    ServerLoad,
    allocated_by_server,
    grow,
    missing_share,
    pack,
    refill,
    remove_server,
    with_allocations,
)
from pocketflow.control.tiers import GB, I3_2XLARGE

SPEC = I3_2XLARGE
GBPS = 1_000_000_000


def dram(node_id: str, **kw: object) -> ServerLoad:
    kw.setdefault("long_running", True)
    return ServerLoad(node_id, "dram", 60 * GB, GBPS, **kw)  # type: ignore[arg-type]


def nvme(node_id: str, **kw: object) -> ServerLoad:
    return ServerLoad(node_id, "nvme", 1900 * GB, GBPS, **kw)  # type: ignore[arg-type]


def demand(throughput: float, capacity: float, *, latency_sensitive: bool = True) -> JobDemand:
    tiers = ("dram", "nvme") if latency_sensitive else ("nvme",)
    return JobDemand(int(throughput), int(capacity), tiers, latency_sensitive=latency_sensitive)


def test_small_job_fits_on_one_server_and_keeps_persist_servers() -> None:
    servers = [dram("d0"), dram("d1"), nvme("n0")]
    result = pack(demand(0.5 * GBPS, 10 * GB), servers, SPEC)
    assert result.fits
    weights = result.allocation.weights()
    assert sum(weights.values()) == pytest.approx(1.0)
    assert sorted(weights) == ["d0", "d1"]  # long-running servers are always in the map
    assert sorted(weights.values()) == [0.0, 1.0]
    assert all(p.persist for p in result.allocation.placements)


def test_job_spreads_over_servers_in_proportion_to_what_each_takes() -> None:
    servers = [dram("d0"), dram("d1", allocated_throughput_bytes_per_s=GBPS // 2)]
    result = pack(demand(1.5 * GBPS, 30 * GB), servers, SPEC)
    assert result.fits
    weights = result.allocation.weights()
    # d1 has 0.5 GB/s free (one third of the job), d0 takes the remaining two thirds.
    assert weights["d1"] == pytest.approx(1 / 3)
    assert weights["d0"] == pytest.approx(2 / 3)


def test_best_fit_fills_the_smallest_gap_first() -> None:
    servers = [
        dram("d0"),
        dram("d1", allocated_throughput_bytes_per_s=int(0.8 * GBPS)),
        dram("d2", allocated_throughput_bytes_per_s=int(0.5 * GBPS)),
    ]
    weights = pack(demand(0.2 * GBPS, GB), servers, SPEC).allocation.weights()
    assert weights["d1"] == pytest.approx(1.0)
    assert weights["d0"] == weights["d2"] == 0.0


def test_latency_sensitive_uses_dram_first_then_existing_nvme() -> None:
    servers = [dram("d0"), dram("d1"), nvme("n0")]
    result = pack(demand(1 * GBPS, 200 * GB), servers, SPEC)
    assert result.fits
    weights = result.allocation.weights()
    # Each DRAM server holds 60 of 200 GB (0.3 of the job); NVMe takes the remaining 0.4.
    assert weights["d0"] == pytest.approx(0.3)
    assert weights["d1"] == pytest.approx(0.3)
    assert weights["n0"] == pytest.approx(0.4)
    assert not next(p for p in result.allocation.placements if p.node_id == "n0").persist


def test_latency_insensitive_gets_no_dram_share() -> None:
    servers = [dram("d0"), dram("d1"), nvme("n0")]
    result = pack(demand(GBPS, 100 * GB, latency_sensitive=False), servers, SPEC)
    assert result.allocation.weights() == {"d0": 0.0, "d1": 0.0, "n0": 1.0}


def test_job_that_does_not_fit_names_the_servers_to_launch() -> None:
    servers = [dram("d0"), dram("d1")]
    result = pack(demand(4.5 * GBPS, 4.5 * 60 * GB), servers, SPEC)
    assert not result.fits
    assert result.shortfall == {"dram": 3}  # 2.5 GB/s left over
    launched = servers + [dram(f"d{i}", long_running=False) for i in range(2, 5)]
    again = pack(demand(4.5 * GBPS, 4.5 * 60 * GB), launched, SPEC)
    assert again.fits
    assert sum(again.allocation.weights().values()) == pytest.approx(1.0)


def test_shortfall_of_latency_insensitive_job_is_nvme() -> None:
    result = pack(demand(3 * GBPS, 100 * GB, latency_sensitive=False), [dram("d0")], SPEC)
    assert result.shortfall == {"nvme": 3}


def test_draining_and_dead_servers_get_nothing() -> None:
    servers = [dram("d0", draining=True), dram("d1", dead=True), dram("d2", long_running=False)]
    result = pack(demand(0.5 * GBPS, GB), servers, SPEC)
    assert result.allocation.weights() == {"d2": 1.0}


def test_spread_default_covers_every_server_of_the_first_tier_with_room() -> None:
    spread = derive_demand(SPEC)
    servers = [dram("d0"), dram("d1", used_bytes=45 * GB), nvme("n0")]
    weights = pack(spread, servers, SPEC).allocation.weights()
    assert set(weights) == {"d0", "d1"}
    assert weights["d0"] == pytest.approx(4 * weights["d1"])
    full = [dram("d0", used_bytes=60 * GB), dram("d1", used_bytes=60 * GB), nvme("n0")]
    weights = pack(spread, full, SPEC).allocation.weights()
    assert weights == {"d0": 0.0, "d1": 0.0, "n0": 1.0}


def test_spread_with_no_server_asks_for_one() -> None:
    assert pack(derive_demand(SPEC), [], SPEC).shortfall == {"dram": 1}


def test_bookkeeping_counts_weight_times_demand() -> None:
    job = demand(GBPS, 60 * GB)
    allocation = Allocation((Placement("d0", 0.25, True), Placement("d1", 0.75, True)))
    assert allocated_by_server([(job, allocation), (job, allocation)]) == {
        "d0": (GBPS // 2, 30 * GB),
        "d1": (3 * GBPS // 2, 90 * GB),
    }
    loads = with_allocations([dram("d0"), dram("d1"), dram("d2")], [(job, allocation)])
    assert [s.allocated_throughput_bytes_per_s for s in loads] == [GBPS // 4, 3 * GBPS // 4, 0]


def test_second_job_goes_where_the_first_left_room() -> None:
    servers = [dram("d0"), dram("d1")]
    first = demand(1.5 * GBPS, 30 * GB)
    a = pack(first, servers, SPEC).allocation
    loaded = with_allocations(servers, [(first, a)])
    b = pack(demand(0.5 * GBPS, 10 * GB), loaded, SPEC)
    assert b.fits
    used = allocated_by_server([(first, a), (demand(0.5 * GBPS, 10 * GB), b.allocation)])
    assert all(throughput <= GBPS for throughput, _ in used.values())


def test_grow_keeps_old_servers_and_adds_new_ones() -> None:
    servers = [dram("d0"), dram("d1"), dram("d2", long_running=False)]
    old = demand(GBPS, 60 * GB)
    allocation = pack(old, servers, SPEC).allocation
    assert allocation.weights()["d0"] == pytest.approx(1.0)
    loaded = with_allocations(servers, [(old, allocation)])
    new = demand(2.5 * GBPS, 150 * GB)
    grown = grow(allocation, old=old, new=new, servers=loaded, spec=SPEC)
    assert grown.fits
    weights = grown.allocation.weights()
    assert set(allocation.weights()) <= set(weights)
    assert weights["d0"] == pytest.approx(0.4)  # its 1 GB/s of the new 2.5 GB/s
    assert weights["d1"] + weights["d2"] == pytest.approx(0.6)
    assert sum(weights.values()) == pytest.approx(1.0)


def test_grow_beyond_the_cluster_names_a_shortfall_and_keeps_old_entries() -> None:
    servers = [dram("d0"), dram("d1")]
    old = demand(GBPS, 60 * GB)
    allocation = pack(old, servers, SPEC).allocation
    loaded = with_allocations(servers, [(old, allocation)])
    grown = grow(allocation, old=old, new=demand(3 * GBPS, 180 * GB), servers=loaded, spec=SPEC)
    assert grown.shortfall == {"dram": 1}
    assert set(allocation.weights()) <= set(grown.allocation.weights())


def test_grow_without_growth_returns_the_same_map() -> None:
    servers = [dram("d0"), dram("d1")]
    old = demand(GBPS, 60 * GB)
    allocation = pack(old, servers, SPEC).allocation
    same = grow(allocation, old=old, new=old, servers=servers, spec=SPEC)
    assert same.allocation == allocation and same.fits


def test_remove_dead_server_replaces_its_share() -> None:
    servers = [dram("d0"), dram("d1"), dram("d2", long_running=False)]
    job = demand(1.5 * GBPS, 90 * GB)
    allocation = pack(job, servers, SPEC).allocation
    dead_id = max(allocation.weights(), key=lambda n: allocation.weights()[n])
    loaded = with_allocations(servers, [(job, allocation)])
    result = remove_server(allocation, dead_id, demand=job, servers=loaded, spec=SPEC)
    assert result.fits
    weights = result.allocation.weights()
    assert dead_id not in weights
    assert sum(weights.values()) == pytest.approx(1.0)


def test_remove_server_without_room_left_names_a_shortfall() -> None:
    servers = [dram("d0"), dram("d1")]
    job = demand(2 * GBPS, 120 * GB)
    allocation = pack(job, servers, SPEC).allocation
    loaded = with_allocations(servers, [(job, allocation)])
    result = remove_server(allocation, "d0", demand=job, servers=loaded, spec=SPEC)
    assert result.shortfall == {"dram": 1}
    assert "d0" not in result.allocation.weights()


def test_remove_server_of_a_spread_job_renormalizes() -> None:
    spread = derive_demand(SPEC)
    servers = [dram("d0"), dram("d1"), dram("d2")]
    allocation = pack(spread, servers, SPEC).allocation
    result = remove_server(allocation, "d1", demand=spread, servers=servers, spec=SPEC)
    assert result.allocation.weights() == pytest.approx({"d0": 0.5, "d2": 0.5})


def test_refill_places_a_leaving_servers_share_where_there_is_room_and_keeps_it_readable() -> None:
    servers = [dram("d0"), dram("d1", long_running=False), dram("d2", long_running=False)]
    job = demand(GBPS, 60 * GB)
    allocation = pack(job, servers, SPEC).allocation
    leaving = max(allocation.weights(), key=lambda n: allocation.weights()[n])
    loaded = with_allocations(servers, [(job, allocation)])
    draining = [replace(s, draining=True) if s.node_id == leaving else s for s in loaded]
    result = refill(allocation, demand=job, servers=draining, spec=SPEC, leaving=[leaving])
    assert result.fits
    weights = result.allocation.weights()
    assert weights[leaving] == 0.0, "a leaving server stays in the map, at weight 0"
    assert not next(p for p in result.allocation.placements if p.node_id == leaving).persist
    assert sum(weights.values()) == pytest.approx(1.0)
    assert missing_share(result.allocation, job) == 0.0


def test_refill_without_room_leaves_the_share_missing_and_names_the_shortfall() -> None:
    servers = [dram("d0"), dram("d1")]
    job = demand(2 * GBPS, 120 * GB)
    allocation = pack(job, servers, SPEC).allocation
    loaded = with_allocations(servers, [(job, allocation)])
    lost = [s for s in loaded if s.node_id != "d0"]
    without = Allocation(tuple(p for p in allocation.placements if p.node_id != "d0"))
    assert missing_share(without, job) == pytest.approx(0.5)
    result = refill(without, demand=job, servers=lost, spec=SPEC)
    assert result.shortfall == {"dram": 1}
    assert missing_share(result.allocation, job) == pytest.approx(0.5)
    # A server with room joins: the missing half goes there.
    joined = [*lost, dram("d2", long_running=False)]
    result = refill(without, demand=job, servers=joined, spec=SPEC)
    assert result.fits and result.allocation.weights()["d2"] == pytest.approx(0.5)


def test_refill_of_a_spread_job_renormalizes_and_it_never_misses_a_share() -> None:
    spread = derive_demand(SPEC)
    servers = [dram("d0"), dram("d1"), dram("d2")]
    allocation = pack(spread, servers, SPEC).allocation
    result = refill(allocation, demand=spread, servers=servers, spec=SPEC, leaving=["d1"])
    assert result.allocation.weights() == pytest.approx({"d0": 0.5, "d1": 0.0, "d2": 0.5})
    assert missing_share(result.allocation, spread) == 0.0


def test_unknown_tier_in_demand_is_refused() -> None:
    with pytest.raises(ValueError):
        pack(JobDemand(1, 1, ("tape",)), [dram("d0")], SPEC)


def test_packing_is_deterministic_whatever_the_server_order() -> None:
    servers = [dram("d0"), dram("d1"), nvme("n0"), nvme("n1")]
    job = demand(2.2 * GBPS, 300 * GB)
    first = pack(job, servers, SPEC)
    second = pack(job, list(reversed(servers)), SPEC)
    assert first == second


def test_grow_from_the_spread_default_places_the_whole_new_demand() -> None:
    servers = [dram("d0"), dram("d1"), dram("d2", long_running=False)]
    spread = derive_demand(SPEC)
    allocation = pack(spread, servers, SPEC).allocation
    new = demand(2.5 * GBPS, 150 * GB)
    grown = grow(allocation, old=spread, new=new, servers=servers, spec=SPEC)
    assert grown.fits
    weights = grown.allocation.weights()
    assert set(weights) == {"d0", "d1", "d2"}
    assert sum(weights.values()) == pytest.approx(1.0)
    assert allocated_by_server([(new, grown.allocation)])["d2"][0] <= GBPS


def test_random_clusters_are_never_overcommitted() -> None:
    import random

    rng = random.Random(7)
    for _ in range(300):
        servers = []
        for i in range(rng.randint(0, 6)):
            make = dram if rng.random() < 0.5 else nvme
            server = make(f"s{i}", long_running=i < 2)
            servers.append(
                ServerLoad(
                    server.node_id,
                    server.tier,
                    server.capacity_bytes,
                    server.throughput_bytes_per_s,
                    allocated_capacity_bytes=int(rng.random() * server.capacity_bytes),
                    allocated_throughput_bytes_per_s=int(rng.random() * GBPS),
                    long_running=server.long_running,
                    draining=rng.random() < 0.1,
                )
            )
        job = demand(
            rng.uniform(0.01, 4) * GBPS,
            rng.uniform(0.1, 500) * GB,
            latency_sensitive=rng.random() < 0.7,
        )
        result = pack(job, servers, SPEC)
        by_id = {s.node_id: s for s in servers}
        for placement in result.allocation.placements:
            server = by_id[placement.node_id]
            if placement.weight > 0:
                assert server.active and server.tier in job.tiers
                assert placement.weight * job.throughput_bytes_per_s <= (
                    server.free_throughput_bytes_per_s * (1 + 1e-9) + 1
                )
                assert placement.weight * job.capacity_bytes <= (
                    server.free_capacity_bytes * (1 + 1e-9) + 1
                )
            assert placement.persist == server.long_running
        if result.fits:
            assert sum(result.allocation.weights().values()) == pytest.approx(1.0)
        else:
            # Launching the shortfall (fresh servers) always makes the job fit.
            fresh = [
                (dram if tier == "dram" else nvme)(f"new-{tier}-{i}", long_running=False)
                for tier, count in result.shortfall.items()
                for i in range(count)
            ]
            assert pack(job, servers + fresh, SPEC).fits, (job, result.shortfall)
