"""Tests of the cluster sizing policy (pure: no Ray, no servers)."""

from __future__ import annotations

import pytest

from pocketflow.control.sizing import (
    AddServer,
    AddThreads,
    NoAction,
    RemoveServers,
    RemoveThreads,
    ServerUtilization,
    SizingBounds,
    cluster_utilization,
    decide,
)

GIB = 1 << 30
NET = 1_000_000_000.0
BOUNDS = SizingBounds(cooldown_s=5.0)


class _AnyReason(str):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, str)

    __hash__ = str.__hash__


ANY_REASON = _AnyReason()


def server(
    node_id: str,
    *,
    tier: str = "dram",
    cpu: float = 0.7,
    net: float = 0.7,
    used: float = 0.7,
    long_running: bool = False,
    threads: int = 1,
    threads_max: int = 1,
    **kw: object,
) -> ServerUtilization:
    return ServerUtilization(
        node_id,
        tier,
        cpu_fraction=cpu,
        net_bytes_per_s=net * NET,
        net_capacity_bytes_per_s=NET,
        used_bytes=int(used * 10 * GIB),
        capacity_bytes=10 * GIB,
        threads=threads,
        threads_max=threads_max,
        long_running=long_running,
        **kw,  # type: ignore[arg-type]
    )


def base(**kw: object) -> list[ServerUtilization]:
    """Two long-running DRAM servers and one launched one, all within bounds by default."""
    return [
        server("lr-0", long_running=True, **kw),  # type: ignore[arg-type]
        server("lr-1", long_running=True, **kw),  # type: ignore[arg-type]
        server("dram-2", **kw),  # type: ignore[arg-type]
    ]


def test_within_bounds_does_nothing() -> None:
    action = decide(base(), BOUNDS, now_s=100.0)
    assert isinstance(action, NoAction)
    assert "within bounds" in action.reason


def test_hot_cpu_scales_vertically_first() -> None:
    servers = base()
    servers[2] = server("dram-2", cpu=0.95, threads=2, threads_max=4)
    action = decide(servers, BOUNDS, now_s=100.0)
    assert action == AddThreads("dram-2", 3, action.reason)


def test_hot_cpu_without_thread_room_adds_a_server_of_the_busiest_tier() -> None:
    servers = [
        server("lr-0", long_running=True, cpu=0.9),
        server("lr-1", long_running=True, cpu=0.9),
        server("nvme-0", tier="nvme", cpu=0.95),
    ]
    action = decide(servers, BOUNDS, now_s=100.0)
    assert isinstance(action, AddServer)
    assert action.tier == "nvme"
    assert not action.long_running


def test_hot_network_adds_a_server() -> None:
    action = decide(base(net=0.9), BOUNDS, now_s=100.0)
    assert isinstance(action, AddServer) and action.tier == "dram"
    assert "network" in action.reason


def test_full_tier_adds_a_server_of_that_tier() -> None:
    servers = base() + [server("nvme-0", tier="nvme", used=0.95)]
    action = decide(servers, BOUNDS, now_s=100.0)
    assert isinstance(action, AddServer) and action.tier == "nvme"


def test_no_second_server_while_one_of_the_tier_is_starting() -> None:
    action = decide(base(net=0.9), BOUNDS, now_s=100.0, pending={"dram": 1})
    assert isinstance(action, NoAction) and "starting" in action.reason


def test_server_limit_is_respected() -> None:
    bounds = SizingBounds(servers_max=3)
    action = decide(base(net=0.9), bounds, now_s=100.0)
    assert isinstance(action, NoAction) and "limit" in action.reason


def test_idle_cluster_removes_the_emptiest_launched_server_of_the_least_used_tier() -> None:
    servers = [
        server("lr-0", long_running=True, cpu=0.1, net=0.1, used=0.3),
        server("lr-1", long_running=True, cpu=0.1, net=0.1, used=0.3),
        server("dram-2", cpu=0.1, net=0.1, used=0.3),
        server("nvme-0", tier="nvme", cpu=0.1, net=0.1, used=0.2),
        server("nvme-1", tier="nvme", cpu=0.1, net=0.1, used=0.05),
    ]
    action = decide(servers, BOUNDS, now_s=100.0)
    assert isinstance(action, RemoveServers)
    assert action.node_ids[0] == "nvme-1"


def test_long_running_servers_are_never_removed() -> None:
    servers = [
        server("lr-0", long_running=True, cpu=0.0, net=0.0, used=0.0),
        server("lr-1", long_running=True, cpu=0.0, net=0.0, used=0.0),
    ]
    action = decide(servers, BOUNDS, now_s=100.0)
    assert isinstance(action, NoAction) and "no server can be removed" in action.reason


def test_removal_that_would_push_a_dimension_over_the_upper_bound_is_held_back() -> None:
    # 55% network over three servers becomes 82.5% over two: stay.
    servers = base(cpu=0.1, net=0.55, used=0.1)
    action = decide(servers, BOUNDS, now_s=100.0)
    assert isinstance(action, NoAction)


def test_one_dimension_in_band_blocks_scale_down() -> None:
    servers = base(cpu=0.1, net=0.1, used=0.65)
    assert isinstance(decide(servers, BOUNDS, now_s=100.0), NoAction)


def test_cooldown_holds_every_action() -> None:
    hot = base(net=0.95)
    assert isinstance(decide(hot, BOUNDS, now_s=100.0, last_action_s=97.0), NoAction)
    assert isinstance(decide(hot, BOUNDS, now_s=100.0, last_action_s=95.0), AddServer)
    idle = base(cpu=0.0, net=0.0, used=0.0)
    assert isinstance(decide(idle, BOUNDS, now_s=100.0, last_action_s=99.0), NoAction)
    assert isinstance(decide(idle, BOUNDS, now_s=100.0, last_action_s=90.0), RemoveServers)


def test_too_few_long_running_servers_adds_one_even_in_cooldown() -> None:
    servers = [server("lr-0", long_running=True), server("lr-1", long_running=True, dead=True)]
    action = decide(servers, BOUNDS, now_s=100.0, last_action_s=99.9)
    assert isinstance(action, AddServer) and action.long_running
    empty = decide([], BOUNDS, now_s=0.0)
    assert isinstance(empty, AddServer) and empty.tier == "dram"


def test_draining_and_dead_servers_do_not_count() -> None:
    servers = base(cpu=0.1, net=0.1, used=0.1) + [
        server("dram-9", cpu=1.0, net=1.0, used=1.0, draining=True),
        server("dram-8", cpu=1.0, net=1.0, used=1.0, dead=True),
    ]
    usage = cluster_utilization(servers)
    assert usage.cpu == pytest.approx(0.1)
    assert usage.net == pytest.approx(0.1)
    assert usage.capacity_by_tier == {"dram": pytest.approx(0.1)}
    action = decide(servers, BOUNDS, now_s=100.0)
    assert action == RemoveServers(("dram-2",), action.reason)


def test_bounds_are_validated() -> None:
    with pytest.raises(ValueError):
        SizingBounds(lower=0.8, upper=0.6)
    with pytest.raises(ValueError):
        SizingBounds(servers_max=1)
    assert SizingBounds().lower == 0.6 and SizingBounds().upper == 0.8


def test_random_clusters_never_lose_long_running_servers_or_overshoot() -> None:
    import random

    rng = random.Random(11)
    for _ in range(500):
        servers = [
            server(
                f"s{i}",
                tier=rng.choice(["dram", "nvme"]),
                cpu=rng.random() * 0.7,
                net=rng.random() * 0.7,
                used=rng.random() * 0.7,
                long_running=i < 2,
                draining=i >= 2 and rng.random() < 0.1,
            )
            for i in range(rng.randint(2, 8))
        ]
        action = decide(servers, BOUNDS, now_s=100.0)
        if isinstance(action, RemoveServers):
            removed = [s for s in servers if s.node_id in action.node_ids]
            assert len(removed) == len(action.node_ids) >= 1
            assert all(not s.long_running and s.active for s in removed)
            before = cluster_utilization(servers)
            assert before.highest() < BOUNDS.lower or all(s.used_bytes == 0 for s in removed)
            active = [s for s in servers if s.active]
            rest = [s for s in active if s not in removed]
            net_after = sum(s.net_bytes_per_s for s in active) / (NET * len(rest))
            cpu_after = sum(s.cpu_fraction for s in active) / len(rest)
            assert net_after <= BOUNDS.upper and cpu_after <= BOUNDS.upper
            # What the servers hold (data and reservations) fits in what stays.
            for tier in {s.tier for s in removed}:
                held = sum(s.used_bytes for s in active if s.tier == tier)
                left = sum(s.capacity_bytes for s in rest if s.tier == tier)
                assert held <= BOUNDS.upper * left
        elif isinstance(action, AddServer):
            assert cluster_utilization(servers).highest() > BOUNDS.upper


def test_vertical_step_aims_at_the_middle_of_the_band() -> None:
    servers = base()
    servers[2] = server("dram-2", cpu=0.9, threads=4, threads_max=16)
    action = decide(servers, BOUNDS, now_s=100.0)
    assert action == AddThreads("dram-2", 6, action.reason)  # 4 x 0.9 / 0.7 = 5.1 -> 6
    servers[2] = server("dram-2", cpu=1.0, threads=4, threads_max=16)
    action = decide(servers, BOUNDS, now_s=100.0)
    assert action == AddThreads("dram-2", 8, action.reason)  # saturated: double
    servers[2] = server("dram-2", cpu=1.0, threads=12, threads_max=16)
    action = decide(servers, BOUNDS, now_s=100.0)
    assert action == AddThreads("dram-2", 16, action.reason)  # at most the maximum


def test_threads_have_a_shorter_cooldown_than_servers() -> None:
    servers = base(net=0.9)
    servers[2] = server("dram-2", cpu=0.95, net=0.9, threads=1, threads_max=2)
    # 1 s after the last action: nothing; 3 s after: threads, not yet a server.
    assert isinstance(decide(servers, BOUNDS, now_s=100.0, last_action_s=99.0), NoAction)
    action = decide(servers, BOUNDS, now_s=100.0, last_action_s=97.0)
    assert isinstance(action, AddThreads)
    servers[2] = server("dram-2", cpu=0.95, net=0.9, threads=2, threads_max=2)
    assert isinstance(decide(servers, BOUNDS, now_s=100.0, last_action_s=97.0), NoAction)
    assert isinstance(decide(servers, BOUNDS, now_s=100.0, last_action_s=94.0), AddServer)


def test_idle_threads_are_released_down_to_the_middle_of_the_band() -> None:
    # Long-running servers stay; their idle cores go: 8 threads at 10% need ceil(8 x 0.1 / 0.7).
    servers = [
        server("lr-0", long_running=True, cpu=0.1, net=0.1, used=0.1, threads=8, threads_max=8),
        server("lr-1", long_running=True, cpu=0.3, net=0.1, used=0.1, threads=1, threads_max=8),
    ]
    action = decide(servers, BOUNDS, now_s=100.0)
    assert action == RemoveThreads("lr-0", 2, action.reason)
    # CPU after the release stays in the band: rule 2 does not add them back.
    after = [server("lr-0", long_running=True, cpu=0.1 * 8 / 2, net=0.1, used=0.1, threads=2,
                    threads_max=8), servers[1]]
    assert not isinstance(decide(after, BOUNDS, now_s=200.0), (AddThreads, RemoveThreads))
    # Fully idle: down to threads_min, never below.
    idle = [server("lr-0", long_running=True, cpu=0.0, net=0.0, used=0.0, threads=4,
                   threads_max=8), servers[1]]
    assert decide(idle, BOUNDS, now_s=100.0) == RemoveThreads("lr-0", 1, ANY_REASON)
    bounds = SizingBounds(cooldown_s=5.0, threads_min=2)
    assert decide(idle, bounds, now_s=100.0) == RemoveThreads("lr-0", 2, ANY_REASON)
    idle[0] = server("lr-0", long_running=True, cpu=0.0, net=0.0, used=0.0, threads=2,
                     threads_max=8)
    assert isinstance(decide(idle, bounds, now_s=100.0), NoAction)
    with pytest.raises(ValueError):
        SizingBounds(threads_min=0)


def test_removing_an_idle_server_comes_before_releasing_threads() -> None:
    servers = base(cpu=0.05, net=0.05, used=0.05)
    servers[2] = server("dram-2", cpu=0.05, net=0.05, used=0.05, threads=4, threads_max=4)
    assert isinstance(decide(servers, BOUNDS, now_s=100.0), RemoveServers)


def test_threads_are_not_released_while_a_dimension_is_hot_or_in_cooldown() -> None:
    servers = base(cpu=0.1, net=0.9, used=0.1)
    servers[2] = server("dram-2", cpu=0.1, net=0.9, used=0.1, threads=4, threads_max=4)
    assert isinstance(decide(servers, BOUNDS, now_s=100.0), AddServer)
    calm = base(cpu=0.1, net=0.1, used=0.65)  # capacity in the band: no removal
    calm[2] = server("dram-2", cpu=0.1, net=0.1, used=0.65, threads=4, threads_max=4)
    assert isinstance(decide(calm, BOUNDS, now_s=100.0, last_action_s=97.0), NoAction)
    assert isinstance(decide(calm, BOUNDS, now_s=100.0, last_action_s=90.0), RemoveThreads)
    assert isinstance(decide(calm, BOUNDS, now_s=100.0, pending={"dram": 1}), NoAction)


def test_empty_servers_go_at_once_and_together_within_the_cool_down() -> None:
    # A job ended: its two launched servers hold nothing now, while the long-running ones hold
    # data in the band. Both go in one action, 3 s after the last one (cool-down 5 s).
    servers = base(cpu=0.1, net=0.1, used=0.65)[:2] + [
        server("dram-2", cpu=0.0, net=0.0, used=0.0),
        server("dram-3", cpu=0.0, net=0.0, used=0.0),
    ]
    action = decide(servers, BOUNDS, now_s=100.0, last_action_s=97.0)
    assert action == RemoveServers(("dram-2", "dram-3"), ANY_REASON)
    # Within the short vertical cool-down nothing happens yet.
    assert isinstance(decide(servers, BOUNDS, now_s=100.0, last_action_s=99.0), NoAction)


def test_an_empty_server_the_others_need_stays() -> None:
    # The network is at 60% over three servers; taking it would leave 90% on the other two.
    servers = base(cpu=0.1, net=0.9, used=0.1)[:2] + [server("dram-2", net=0.0, used=0.0)]
    assert isinstance(decide(servers, BOUNDS, now_s=100.0), NoAction)


def test_servers_holding_data_go_together_when_demand_drops_but_not_below_what_jobs_hold() -> None:
    # Five launched servers each 20% full: together 1 server's worth plus the long-running
    # ones. Several go at once, as many as keep capacity use at or below 80%.
    servers = [
        server("lr-0", long_running=True, cpu=0.1, net=0.1, used=0.2),
        server("lr-1", long_running=True, cpu=0.1, net=0.1, used=0.2),
        *(server(f"dram-{i}", cpu=0.1, net=0.1, used=0.2) for i in range(2, 7)),
    ]
    action = decide(servers, BOUNDS, now_s=100.0)
    assert isinstance(action, RemoveServers) and len(action.node_ids) == 5
    # Seven servers at 20%: 1.4 servers of bytes; two servers left would be 70% full.
    rest = [s for s in servers if s.node_id not in action.node_ids]
    assert cluster_utilization(rest).highest() <= BOUNDS.upper or len(rest) == 2
    held = sum(s.used_bytes for s in servers)
    assert held <= BOUNDS.upper * sum(s.capacity_bytes for s in rest)
    # Holding data, they wait for the full cool-down.
    assert isinstance(decide(servers, BOUNDS, now_s=100.0, last_action_s=97.0), NoAction)


def test_a_met_reservation_that_no_one_writes_grows_no_tier() -> None:
    """A registration launches what its reservation needs; the sizing loop grows a tier on the
    data its servers hold. A job reserving 90% of DRAM and writing 10% of it launches nothing
    (it launched two DRAM servers that no key ever reached in the trace); the same job with 90%
    written does grow the tier."""
    reserved = int(0.9 * 10 * GIB)
    unwritten = [server(s.node_id, long_running=s.long_running, used=0.1,
                        reserved_bytes=reserved) for s in base()]
    action = decide(unwritten, BOUNDS, now_s=100.0)
    assert not isinstance(action, AddServer), action
    # What the servers hold for sizing down is their reservation: none of them looks idle.
    assert cluster_utilization(unwritten).capacity_by_tier == {"dram": pytest.approx(0.9)}
    written = [server(s.node_id, long_running=s.long_running, used=0.9,
                      reserved_bytes=reserved) for s in base()]
    action = decide(written, BOUNDS, now_s=100.0)
    assert isinstance(action, AddServer) and action.tier == "dram", action
    assert "data" in action.reason


def test_a_server_holding_only_a_reservation_is_not_empty() -> None:
    """A launched server whose job has not written yet holds its reservation: it is not drained
    at once as an empty server, and the others cannot take its reservation over the bound."""
    servers = base(cpu=0.1, net=0.1, used=0.5)[:2] + [
        server("dram-2", cpu=0.0, net=0.0, used=0.0, reserved_bytes=int(0.9 * 10 * GIB)),
    ]
    action = decide(servers, BOUNDS, now_s=100.0, last_action_s=97.0)
    assert not isinstance(action, RemoveServers), action
    assert not isinstance(decide(servers, BOUNDS, now_s=100.0), RemoveServers)
