"""Allocation, with the ``Allocator`` role built without Ray over real servers: a job is packed
onto the live servers that may take data, reservations count, and a job that cannot fit (and
cannot launch) is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from control_roles import register, roles

from pocketflow.control.hints import demand_from_hints
from pocketflow.errors import CapacityExhausted

MIB = 1024 * 1024


def test_jobs_are_packed_on_active_servers_and_reservations_count(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        for name in ("al-0", "al-1", "al-2"):
            built.start(name, capacity_bytes=16 * MIB)
        built.membership.draining.add("al-1")
        built.membership.mark_suspect("al-2")
        loads = {load.node_id: load for load in built.allocator.server_loads()}
        assert loads["al-0"].active and not loads["al-1"].active and not loads["al-2"].active

        first = register(built, "first", {"data_size_bytes": 12 * MIB})
        assert {s.node_id for s in first.servers if s.weight > 0} == {"al-0"}
        reserved = {load.node_id: load.allocated_capacity_bytes
                    for load in built.allocator.server_loads()}
        assert reserved["al-0"] >= 12 * MIB

        # 12 MiB are reserved on the only active server: another 12 MiB do not fit, and this
        # allocator cannot launch servers.
        demand = demand_from_hints({"data_size_bytes": 12 * MIB}, built.allocator.spec())
        with pytest.raises(CapacityExhausted):
            built.allocator.pack_new(demand)
        # The suspect answers again: it takes new jobs.
        built.membership.heartbeat("al-2", {})
        second = register(built, "second", {"data_size_bytes": 12 * MIB})
        weighted = {s.node_id for s in second.servers if s.weight > 0}
        assert "al-2" in weighted and "al-1" not in weighted
