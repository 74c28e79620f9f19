"""Prefix grants (Jiffy's capacity multiplexing, for real): a sized prefix gets DRAM when there is
room, waits in order for DRAM that lapsing prefixes give back, and spills to NVMe at its deadline;
its keys are routed to the tier it got. The bookkeeping alone, then the real controller and
servers of the session cluster."""

from __future__ import annotations

import collections
import json
import threading
import time

import pytest

from pocketflow.cluster import LocalCluster
from pocketflow.control.prefix_grants import (
    EXPIRY_SLACK_S,
    Grant,
    PrefixGrants,
    Waiting,
    grants_from_record,
    grants_record,
)
from pocketflow.errors import InvalidRequest, JobNotRegistered, ObjectNotFound
from pocketflow.placement import Placement
from pocketflow.protocol import LEASE_PREFIXES_MAX
from tests.fixtures_cluster import wait_for

LEASE_MS = 1000
MIB = 1024 * 1024


def _waiting(job: str, *sizes: int, lease_s: float = 1.0) -> Waiting:
    pending = collections.deque((f"{job}/p{i}", size) for i, size in enumerate(sizes))
    return Waiting(job, pending, lease_s)


def test_waiting_declarations_are_served_in_order_and_lapses_give_dram_back() -> None:
    grants = PrefixGrants()
    free = {"d0": 100, "d1": 100}
    pool = lambda job_id: ["d0", "d1"]  # noqa: E731 - every job spreads over both servers
    a, b, c = _waiting("a", 150), _waiting("b", 120), _waiting("c", 10)
    for waiting in (a, b, c):
        grants.enqueue(waiting)
    assert grants.serve(free, pool, now_s=0.0)
    # a fits on no one server: an even share of 75 on each. b needs 60 on each (or 120 on one)
    # and does not fit; c, small as it is, waits behind it.
    assert a.granted == ["a/p0"] and b.granted == [] and c.granted == []
    assert grants.reserved_by_server() == {"d0": 75, "d1": 75}
    grants.leave(a)
    assert not grants.serve(free, pool, now_s=0.5)
    # Renewed, a's grant outlives its first lease; unrenewed, it lapses one lease later.
    assert grants.renew("a", ["a/p0", "not-granted"], now_s=0.9) == 1
    assert grants.expire(now_s=1.0 + EXPIRY_SLACK_S) == []
    lapsed = grants.expire(now_s=1.9 + EXPIRY_SLACK_S)
    assert [g.prefix for g in lapsed] == ["a/p0"]
    assert grants.serve(free, pool, now_s=2.0)
    # b spreads (60 each); c fits whole on one server, which its route will name alone.
    assert b.granted == ["b/p0"] and c.granted == ["c/p0"]
    assert grants.granted("b")["b/p0"].shares == {"d0": 60, "d1": 60}
    assert grants.granted("c")["c/p0"].shares == {"d1": 10}
    assert grants.summary()["grants"] == 2
    grants.release_job("b", "gone")
    assert grants.reserved_by_server() == {"d1": 10}
    # A prefix goes whole to the server with the most room, so one-server grants fill both.
    d = _waiting("d", 50, 50, 45, 40)
    grants.enqueue(d)
    assert grants.serve(free, pool, now_s=2.0)
    assert [list(g.shares.items()) for g in grants.granted("d").values()] == [
        [("d0", 50)], [("d1", 50)], [("d0", 45)], [("d1", 40)]]
    assert [g.prefix for g in grants.end("d", ["d/p1", "d/p3", "never"])] == ["d/p1", "d/p3"]
    assert grants.reserved_by_server() == {"d0": 95, "d1": 10}


def test_a_deregistered_job_ends_its_waiting_declarations() -> None:
    grants = PrefixGrants()
    waiting = _waiting("j", 10**9)
    grants.enqueue(waiting)
    assert not grants.serve({"d0": 10}, lambda job_id: ["d0"], now_s=0.0)
    grants.release_job("j", "deregistered")
    assert waiting.cancelled == "deregistered" and grants.waiting() == 0


def test_grants_go_through_a_metadata_record_and_come_back_with_a_whole_lease() -> None:
    grants = {"s/0": Grant("j", "s/0", {"dram-0": 5 * MIB}, 2.0, expires_at_s=1.0),
              "s/1": Grant("j", "s/1", {"dram-0": MIB, "dram-1": MIB}, 2.0, expires_at_s=1.5)}
    record = json.loads(json.dumps(grants_record(grants)))  # what the log holds
    back = grants_from_record("j", record, now_s=100.0)
    assert [(g.prefix, g.shares, g.lease_s) for g in back] == [
        (p, g.shares, g.lease_s) for p, g in grants.items()]
    assert {g.expires_at_s for g in back} == {100.0 + 2.0 + EXPIRY_SLACK_S}
    table = PrefixGrants()
    assert all(table.restore(g) for g in back)
    assert table.reserved_by_server() == {"dram-0": 6 * MIB, "dram-1": MIB}
    # What does not parse is skipped, not a failed restart.
    bad = {"a": {"shares": {"d": "x"}, "lease_s": 1}, "b": {"lease_s": 1}, "c": 7,
           "d": {"shares": {"d": -1}, "lease_s": 1}, "e": {"shares": {"d": 1}, "lease_s": 0},
           "ok": {"shares": {"d": 1}, "lease_s": 1}}
    assert [g.prefix for g in grants_from_record("j", bad, now_s=0.0)] == ["ok"]
    assert grants_from_record("j", None, now_s=0.0) == []


def _grant_state(cluster: LocalCluster) -> dict:
    return cluster.status()["prefix_grants"]


def _job_bytes_by_tier(cluster: LocalCluster, job_id: str) -> dict[str, int]:
    tiers: dict[str, int] = {}
    for server in cluster.status()["servers"]:
        used = int(server["jobs"].get(job_id, {}).get("used_bytes", 0))
        tiers[server["tier"]] = tiers.get(server["tier"], 0) + used
    return tiers


def test_a_sized_prefix_waits_for_lapsing_dram_and_a_late_one_spills(
    local_cluster: LocalCluster,
) -> None:
    hints = {"data_size_bytes": "1MiB"}
    with local_cluster.register_job("grants-a", hints, prefix_lease_ms=LEASE_MS) as a, \
            local_cluster.register_job("grants-b", hints, prefix_lease_ms=LEASE_MS) as b:
        free = _grant_state(local_cluster)["dram_free_bytes"]
        assert len(free) == 2, free
        # A prefix of `half` (what the fuller DRAM server has left) fits whole on either
        # server: each of two such prefixes is granted one server, and a third does not fit.
        half = min(free.values()) // MIB * MIB
        assert half >= 16 * MIB, f"the session cluster's DRAM is taken: {free}"
        a.declare("in")
        placed = a.declare_many([("s/0", ["in"], half), ("s/1", ["in"], half)], wait_s=0)
        assert placed == {"s/0": "dram", "s/1": "dram"}
        routes, pools = a.handle.routes.route_map(), a.handle.routes.pool_map()
        assert sorted(routes) == ["s/0", "s/1"]
        homes = [pools[routes[p]] for p in ("s/0", "s/1")]
        assert all(len(home) == 1 for home in homes) and homes[0] != homes[1], (routes, pools)
        placement = Placement.of_handle(a.handle)
        for prefix, home in zip(("s/0", "s/1"), homes, strict=True):
            servers = {placement.server_for(f"{prefix}/k{i}".encode()) for i in range(32)}
            assert {s.node_id for s in servers} == set(home)
            assert {s.tier for s in servers} == {"dram"}
        keeper = a.keep(["s/0", "s/1"])
        try:
            # b's prefix does not fit while a's are renewed: it waits, then spills to NVMe.
            started = time.monotonic()
            assert b.declare("late", size_bytes=half, wait_s=1.5) == "nvme"
            assert time.monotonic() - started >= 1.4
            b_keeper = b.keep(["late"])
            with b.connect() as pf:
                pf.create_bucket("x")
                pf.put("x", "late/k", b"n" * MIB)
                assert wait_for(lambda: _job_bytes_by_tier(local_cluster, b.job_id)
                                .get("nvme", 0) >= MIB)
            # Another declaration waits; releasing a's prefixes hands their DRAM to it.
            outcome: dict = {}

            def declare() -> None:
                begun = time.monotonic()
                outcome["placed"] = b.declare("r", size_bytes=half, wait_s=10)
                outcome["waited_s"] = time.monotonic() - begun

            waiter = threading.Thread(target=declare)
            waiter.start()
            assert wait_for(lambda: _grant_state(local_cluster)["waiting_declarations"] == 1,
                            timeout_s=5)
            time.sleep(1.0)  # a's leases are renewed: nothing lapses, b keeps waiting
            assert "placed" not in outcome
            keeper.release("s/0")
            released = time.monotonic()
            waiter.join(10)
            assert outcome["placed"] == "dram"
            # Within two lease periods of the release (the lease, the slack, the monitor pass).
            assert time.monotonic() - released < 2 * LEASE_MS / 1000
            b_keeper.add("r")
            with b.connect() as pf:
                pf.create_bucket("y")
                pf.put("y", "r/k", b"d" * MIB)
                assert pf.get("y", "r/k") == b"d" * MIB
                assert pf.get("x", "late/k") == b"n" * MIB
                assert wait_for(lambda: _job_bytes_by_tier(local_cluster, b.job_id)
                                .get("dram", 0) >= MIB)
            b_keeper.close()
        finally:
            keeper.close()
        assert Placement.of_handle(b.handle).server_for(b"r/k").tier == "dram"
        routes = b.handle.routes.route_map()
        assert routes["late"] == "nvme" and routes["r"].startswith("dram-"), routes
    # Deregistered jobs hold no grants.
    assert wait_for(lambda: _grant_state(local_cluster)["grants"] == 0, timeout_s=5)


def test_a_task_with_an_older_handle_adopts_the_routes(local_cluster: LocalCluster) -> None:
    from pocketflow import connect

    with local_cluster.register_job("grants-adopt", {"data_size_bytes": "1MiB"},
                                    prefix_lease_ms=LEASE_MS) as job:
        old = job.handle
        with connect(old) as task:
            task.create_bucket("b")
            assert job.declare("spill", size_bytes=0, wait_s=0) == "dram"
            with job.keep(["spill"]):
                # The task's first request meets the new epoch and takes its routes.
                task.put("b", "spill/k", b"v")
                assert task.handle.epoch == job.handle.epoch
                assert task.handle.routes == job.handle.routes
                assert task.get("b", "spill/k") == b"v"


def test_bad_declarations_are_refused_and_lose_nothing(local_cluster: LocalCluster) -> None:
    with local_cluster.register_job("grants-bad", {"data_size_bytes": "1MiB"}) as job:
        epoch = job.handle.epoch
        for size in (-1, 1.5, True):
            with pytest.raises(InvalidRequest):
                job.declare("p", size_bytes=size)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest):
            job.declare("p", ["undeclared"], size_bytes=1)
        with pytest.raises(InvalidRequest):
            job.declare("p", size_bytes=1, wait_s=-1)
        with pytest.raises(InvalidRequest):
            job.declare_many([("q", (), 1), ("q", (), 2)])
        assert job.handle.epoch == epoch and not job.handle.routes
        assert job.declare("p", size_bytes="1MiB", wait_s=0) == "dram"
    with pytest.raises(JobNotRegistered):
        job._control.declare_prefixes(job.job_id, [("p", 1)], LEASE_MS, 0)


def test_routes_drop_a_leaving_server_and_an_emptied_pool() -> None:
    from pocketflow.handle import Routes

    routes = Routes.of({"dram": ["d0", "d1"], "nvme": ["n0"]},
                       {"a": "dram", "b": "nvme", "c/d": "nvme"})
    assert routes.without_member("d1").pool_map() == {"dram": ["d0"], "nvme": ["n0"]}
    left = routes.without_member("n0")
    assert left.pool_map() == {"dram": ["d0", "d1"]} and left.route_map() == {"a": "dram"}
    with pytest.raises(InvalidRequest):
        Routes.of({"dram": ["d0"]}, {"a": "nvme"})  # names no pool
    with pytest.raises(InvalidRequest):
        Routes.of({"Bad Name": ["d0"]}, {})
    with pytest.raises(InvalidRequest):
        Routes.of({"dram": ["d0"]}, {"a/": "dram"})


def test_kept_prefixes_stay_renewed_across_the_epochs_declarations_make(
    local_cluster: LocalCluster, caplog: pytest.LogCaptureFixture,
) -> None:
    with local_cluster.register_job("grants-renew", {"data_size_bytes": "1MiB"},
                                    prefix_lease_ms=LEASE_MS) as job, job.connect() as pf:
        pf.create_bucket("b")
        job.declare("in")
        pf.put("b", "in/k", b"kept")
        with job.keep(["in"]) as keeper:
            for i in range(3):  # each declaration is a new epoch the keeper's client meets
                assert job.declare(f"out{i}", ["in"], size_bytes=MIB, wait_s=0) == "dram"
                keeper.add(f"out{i}")
                time.sleep(LEASE_MS / 1000)
            assert pf.get("b", "in/k") == b"kept"
            renewals = keeper.renewals
        assert renewals >= 6
        assert job.handle.epoch >= 4
    # A renewal that met a newer epoch took its map and renewed again: none failed.
    assert not [r for r in caplog.records if "renewing prefix" in r.getMessage()]


def test_deregistering_a_job_ends_its_waiting_declaration(local_cluster: LocalCluster) -> None:
    hints = {"data_size_bytes": "1MiB"}
    with local_cluster.register_job("grants-hog", hints, prefix_lease_ms=LEASE_MS) as hog:
        free = _grant_state(local_cluster)["dram_free_bytes"]
        everything = 2 * min(free.values()) // MIB * MIB
        with hog.keep([]) as keeper:
            assert hog.declare("all", size_bytes=everything, wait_s=0) == "dram"
            keeper.add("all")
            waiter = local_cluster.register_job("grants-waiter", hints)
            outcome: dict = {}

            def declare() -> None:
                try:
                    waiter.declare("p", size_bytes=everything, wait_s=20)
                except JobNotRegistered as exc:
                    outcome["error"] = exc

            thread = threading.Thread(target=declare)
            thread.start()
            assert wait_for(lambda: _grant_state(local_cluster)["waiting_declarations"] == 1,
                            timeout_s=5)
            begun = time.monotonic()
            waiter.deregister()
            thread.join(10)
            assert isinstance(outcome.get("error"), JobNotRegistered)
            assert time.monotonic() - begun < 2.0
            assert _grant_state(local_cluster)["waiting_declarations"] == 0


def test_ending_a_prefix_frees_it_at_once_and_hands_its_dram_to_the_waiting(
    local_cluster: LocalCluster, caplog: pytest.LogCaptureFixture,
) -> None:
    hints = {"data_size_bytes": "1MiB"}
    long_lease_ms = 5000  # a lapse could not explain what happens within a second
    with local_cluster.register_job("grants-end", hints, prefix_lease_ms=long_lease_ms) as a, \
            local_cluster.register_job("grants-next", hints) as b, a.connect() as pf:
        free = _grant_state(local_cluster)["dram_free_bytes"]
        everything = 2 * min(free.values()) // MIB * MIB
        pf.create_bucket("x")
        assert a.declare("s/0", size_bytes=everything, wait_s=0) == "dram"
        a.declare_many([("s/1", (), None), ("s/0/sub", (), None)])
        with a.keep(["s/0", "s/1"]) as keeper:
            pf.put("x", "s/0/k", b"a" * MIB)
            pf.put("x", "s/0/sub/k", b"c")
            pf.put("x", "s/1/k", b"b")
            outcome: dict = {}

            def declare() -> None:
                outcome["placed"] = b.declare("r", size_bytes=everything, wait_s=10)

            waiter = threading.Thread(target=declare)
            waiter.start()
            assert wait_for(lambda: _grant_state(local_cluster)["waiting_declarations"] == 1,
                            timeout_s=5)
            begun = time.monotonic()
            freed = a.end(["s/0"])
            waiter.join(10)
            assert outcome["placed"] == "dram"
            assert time.monotonic() - begun < 1.0
            assert freed > MIB
            for key in ("s/0/k", "s/0/sub/k"):
                with pytest.raises(ObjectNotFound):
                    pf.get("x", key)
            assert "s/0" not in a.prefix_leases.dag and "s/0/sub" not in a.prefix_leases.dag
            # The keeper goes on renewing what was not ended, and nothing else.
            renewals = keeper.renewals
            assert wait_for(lambda: keeper.renewals >= renewals + 2, timeout_s=10)
            assert pf.get("x", "s/1/k") == b"b"
            assert a.end(["s/0"]) == 0  # ended already
    assert not [r for r in caplog.records if "prefixes failed" in r.getMessage()]
    with pytest.raises(InvalidRequest):
        local_cluster.control.end_prefixes(a.job_id, ["p"] * (LEASE_PREFIXES_MAX + 1))
    with pytest.raises(JobNotRegistered):
        local_cluster.control.end_prefixes(a.job_id, ["s/1"])
