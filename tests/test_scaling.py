"""Tests of elasticity: launching servers for a job that does not fit, and the sizing loop.

The scenario needs a cluster of its own with autoscaling on, and this process's Ray belongs to
the session cluster, so it runs in a child process (tests/scenarios/scaling.py), bounded in time.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from scenario_runner import run_scenario

SCENARIO_TIMEOUT_S = 180.0
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def scaling() -> dict[str, Any]:
    return run_scenario("scaling", timeout_s=SCENARIO_TIMEOUT_S)


def test_registration_launches_a_server_when_the_job_does_not_fit(
    scaling: dict[str, Any],
) -> None:
    initial = set(scaling["initial"])
    assert initial == {"dram-0", "dram-1"}
    assert set(scaling["big_servers"]) - initial
    assert scaling["big_roundtrip"]


def test_idle_launched_servers_are_drained_and_long_running_ones_stay(
    scaling: dict[str, Any],
) -> None:
    assert scaling["scaled_down"]
    assert scaling["after_idle"] == ["dram-0", "dram-1"]
    assert any(action == "RemoveServers" for action, _ in scaling["actions"])


def test_a_job_the_server_limit_cannot_hold_launches_nothing(scaling: dict[str, Any]) -> None:
    """Its shortfall (three servers) is checked against ``servers_max`` (two more) before any
    launch: launching up to the limit and then refusing it left idle servers behind."""
    assert scaling["after_too_big"] == ["dram-0", "dram-1"], scaling
    assert scaling["removals_since_too_big"] == 0, "no server was launched, so none drained"
    assert scaling["too_big"].startswith("CapacityExhausted"), scaling["too_big"]
    assert "limited to 4" in scaling["too_big"], scaling["too_big"]


def test_launched_long_running_servers_get_the_persist_ttl(scaling: dict[str, Any]) -> None:
    assert scaling["launched_persist_ttl_ms"] == {"long_running": 90 * 60 * 1000, "ephemeral": 0}


def test_launched_servers_serve_tls_with_certificates_the_controller_signs(
    scaling: dict[str, Any],
) -> None:
    """Issue 29 item 5: the controller holds the cluster CA (in memory) and signs the
    certificate of each server it launches; the scenario reads their stats over TLS."""
    assert scaling["launched_tls"] == [True, True]


def test_a_full_tier_gets_another_server(scaling: dict[str, Any]) -> None:
    assert scaling["scaled_up"]
    assert len(scaling["after_fill"]) > 2
    assert scaling["actions"][-1][0] == "AddServer"


def _controller(cluster_secret_file: Any, *, cooldown_s: float) -> Any:
    """A controller of the test's own (no Ray, no failure detection) whose sizing loop waits
    ``cooldown_s`` between actions on servers and not at all between actions on cores."""
    from pocketflow.control.controller import Controller
    from pocketflow.control.metadata import Metadata
    from pocketflow.control.sizing import SizingBounds

    secret, _ = cluster_secret_file
    return Controller(secret=secret, metadata=Metadata(), block_size_bytes=MiB,
                      failure_detection=False,
                      sizing=SizingBounds(cooldown_s=cooldown_s, vertical_cooldown_s=0.0))


def _dram_servers(server_factory: Any, long_running: dict[str, bool]) -> tuple[Any, list[Any]]:
    """8 MiB DRAM servers of the test's own, by name and whether each is long-running: their
    set and the ``StorageNodeInfo`` each one's StorageNode would register."""
    from pocketflow.control.storage_node import StorageNodeInfo
    from pocketflow.processes import ProcessRef

    infos = []
    for name, lasting in long_running.items():
        servers, info = server_factory(name, capacity_bytes=8 * MiB, long_running=lasting)
        ref = ProcessRef.of(servers.process(name).pid)
        assert ref is not None
        infos.append(StorageNodeInfo(
            node_id=name, tier="dram", address=info.address, capacity_bytes=8 * MiB,
            long_running=lasting, server_pid=ref.pid, server_start_time=ref.start_time,
            actor_pid=os.getpid(),
        ))
    return servers, infos


def test_a_busy_server_gets_more_cores_before_more_servers(
    server_factory: Any, cluster_secret_file: Any
) -> None:
    """Vertical first: the sizing loop gives a server whose cores are busy another core, and
    takes it back once the server is idle."""
    controller = _controller(cluster_secret_file, cooldown_s=0.0)
    try:
        servers, infos = _dram_servers(server_factory, {"busy-0": True, "busy-1": True})
        with servers.admin(infos[0].address) as admin:
            cores_max = int(admin.stats()["cores_max"])
            if cores_max < 2:
                pytest.skip("the server may use only one core here")
            admin.set_cores(1)
            sample = admin.stats()
        for info in infos:
            controller.add_server(info)
        # The heartbeat a StorageNode would send, with the first server's one core busy.
        controller.heartbeat("busy-0", {**sample, "cpu_utilization": 0.95})
        done = controller.size_cluster()
        assert done["action"] == "AddThreads" and done["node_id"] == "busy-0", done
        assert not done.get("skipped")
        with servers.admin(infos[0].address) as admin:
            sample = admin.stats()
        assert int(sample["cores"]) == 2
        # Idle again: the core is released (vertical scale-down), the servers stay.
        controller.heartbeat("busy-0", {**sample, "cpu_utilization": 0.1})
        done = controller.size_cluster()
        assert done["action"] == "RemoveThreads" and done["node_id"] == "busy-0", done
        assert done["cores"] == 1 and not done.get("skipped")
        with servers.admin(infos[0].address) as admin:
            assert int(admin.stats()["cores"]) == 1
        assert {s.node_id for s in controller.servers()} == {"busy-0", "busy-1"}
    finally:
        controller.close()


def test_idle_launched_servers_are_drained_together_in_one_sizing_action(
    server_factory: Any, cluster_secret_file: Any
) -> None:
    """Capacity follows demand down at once: every empty server the others do not need is
    drained in one sizing action (one per cool-down before), and the long-running ones stay."""
    from pocketflow.processes import wait_gone

    controller = _controller(cluster_secret_file, cooldown_s=60.0)
    try:
        servers, infos = _dram_servers(
            server_factory, {"lr-0": True, "lr-1": True, "idle-2": False, "idle-3": False})
        for info in infos:
            controller.add_server(info)
            with servers.admin(info.address) as admin:
                controller.heartbeat(info.node_id, admin.stats())
        done = controller.size_cluster()
        assert done["action"] == "RemoveServers", done
        assert sorted(done["drained"]) == ["idle-2", "idle-3"], done
        assert {s.node_id for s in controller.servers()} == {"lr-0", "lr-1"}
        assert not wait_gone([i.server_process() for i in infos[2:]], timeout_s=10.0)
    finally:
        controller.close()


def test_a_reservation_that_is_met_but_not_written_launches_no_server(
    server_factory: Any, cluster_secret_file: Any
) -> None:
    """A job whose registration got the room it reserves (87.5% of DRAM here) and that has
    written little does not make the sizing loop add a server: the loop grows a tier on the
    data its servers hold. On reservations alone it launched two DRAM nodes in the trace that
    no job's key ever reached."""
    from pocketflow.client import connect

    controller = _controller(cluster_secret_file, cooldown_s=0.0)
    try:
        servers, infos = _dram_servers(server_factory, {"held-0": True, "held-1": True})
        for info in infos:
            controller.add_server(info)
        handle = controller.register_job("reserved", {"data_size_bytes": 14 * MiB})
        assert {s.node_id for s in handle.servers if s.weight > 0} == {"held-0", "held-1"}
        with connect(handle, op_timeout_s="10s") as pf:
            pf.create_bucket("b")
            pf.put("b", "k", b"x" * MiB)
        for info in infos:
            with servers.admin(info.address) as admin:
                controller.heartbeat(info.node_id, admin.stats())
        actions = [controller.size_cluster() for _ in range(3)]
        assert all(a["action"] != "AddServer" for a in actions), actions
        # The reservation is held: neither server looks idle to the loop.
        held = {u.node_id: u.held_bytes for u in controller._scaler.utilizations()}
        assert sum(held.values()) >= 14 * MiB - 1024, held
    finally:
        controller.close()
