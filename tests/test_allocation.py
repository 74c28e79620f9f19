"""Tests of the allocation policy (pure: no Ray, no servers)."""

from __future__ import annotations

import pytest

from pocketflow.control.allocation import (
    AllocationRequest,
    ServerState,
    allocate,
)
from pocketflow.errors import CapacityExhausted, ClusterError

MIB = 1024 * 1024


def dram(node_id: str, *, used: int = 0, capacity: int = 256 * MIB, **kw: object) -> ServerState:
    return ServerState(node_id, "dram", capacity, used, long_running=True, **kw)


def nvme(node_id: str, *, used: int = 0, capacity: int = 1024 * MIB, **kw: object) -> ServerState:
    return ServerState(node_id, "nvme", capacity, used, long_running=False, **kw)


CLUSTER = [dram("dram-0"), dram("dram-1"), nvme("nvme-0")]


def test_latency_sensitive_default_uses_dram_only() -> None:
    allocation = allocate(AllocationRequest(), CLUSTER)
    assert allocation.weights() == {"dram-0": 0.5, "dram-1": 0.5}
    assert all(p.persist for p in allocation.placements)


def test_latency_sensitive_fitting_in_dram_adds_no_nvme() -> None:
    allocation = allocate(AllocationRequest(data_size_bytes=512 * MIB), CLUSTER)
    assert set(allocation.weights()) == {"dram-0", "dram-1"}


def test_nvme_added_for_the_overflow_beyond_free_dram() -> None:
    servers = [dram("dram-0", used=56 * MIB), dram("dram-1", used=56 * MIB), nvme("nvme-0")]
    # 400 MiB free in DRAM, 800 MiB hinted: half of the data goes to NVMe.
    allocation = allocate(AllocationRequest(data_size_bytes=800 * MIB), servers)
    weights = allocation.weights()
    assert weights["nvme-0"] == pytest.approx(0.5)
    assert weights["dram-0"] == pytest.approx(0.25)
    assert weights["dram-1"] == pytest.approx(0.25)
    assert sum(weights.values()) == pytest.approx(1.0)
    nvme_placement = next(p for p in allocation.placements if p.node_id == "nvme-0")
    assert not nvme_placement.persist


def test_dram_servers_weighted_by_free_bytes() -> None:
    servers = [dram("dram-0", used=192 * MIB), dram("dram-1"), nvme("nvme-0")]
    weights = allocate(AllocationRequest(), servers).weights()
    assert weights["dram-1"] == pytest.approx(4 * weights["dram-0"])


def test_latency_insensitive_gets_no_dram_data_but_keeps_persist_servers() -> None:
    allocation = allocate(AllocationRequest(latency_sensitive=False), CLUSTER)
    weights = allocation.weights()
    assert weights == {"dram-0": 0.0, "dram-1": 0.0, "nvme-0": 1.0}
    persist = {p.node_id for p in allocation.placements if p.persist}
    assert persist == {"dram-0", "dram-1"}


def test_latency_insensitive_without_nvme_is_refused() -> None:
    with pytest.raises(ClusterError):
        allocate(AllocationRequest(latency_sensitive=False), [dram("dram-0")])


def test_too_large_for_the_cluster_is_capacity_exhausted() -> None:
    with pytest.raises(CapacityExhausted):
        allocate(AllocationRequest(data_size_bytes=4096 * MIB), CLUSTER)
    with pytest.raises(CapacityExhausted):
        allocate(AllocationRequest(latency_sensitive=False, data_size_bytes=2048 * MIB), CLUSTER)
    with pytest.raises(CapacityExhausted):
        allocate(AllocationRequest(data_size_bytes=300 * MIB), [dram("dram-0")])


def test_draining_servers_are_left_out() -> None:
    servers = [dram("dram-0", draining=True), dram("dram-1"), nvme("nvme-0")]
    assert allocate(AllocationRequest(), servers).weights() == {"dram-1": 1.0}


def test_nvme_only_cluster_serves_latency_sensitive_jobs() -> None:
    assert allocate(AllocationRequest(), [nvme("nvme-0")]).weights() == {"nvme-0": 1.0}


def test_no_active_server_is_a_cluster_error() -> None:
    with pytest.raises(ClusterError):
        allocate(AllocationRequest(), [])
    with pytest.raises(ClusterError):
        allocate(AllocationRequest(), [dram("dram-0", draining=True)])


def test_full_server_keeps_a_small_positive_weight() -> None:
    servers = [dram("dram-0", used=256 * MIB), dram("dram-1")]
    weights = allocate(AllocationRequest(), servers).weights()
    assert 0 < weights["dram-0"] < 0.01
    assert weights["dram-1"] > 0.99


def test_allocation_is_ordered_and_deterministic() -> None:
    shuffled = [CLUSTER[2], CLUSTER[0], CLUSTER[1]]
    first = allocate(AllocationRequest(data_size_bytes=10 * MIB), shuffled)
    second = allocate(AllocationRequest(data_size_bytes=10 * MIB), CLUSTER)
    assert first == second
    assert [p.node_id for p in first.placements] == ["dram-0", "dram-1"]
