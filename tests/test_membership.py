"""Membership (the controller's node table), built and tested without Ray."""

from __future__ import annotations

import time

import pytest

from pocketflow.control.membership import DEAD_SERVERS_KEPT_MAX, Membership
from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.errors import ClusterError


def _info(node_id: str, tier: str = "dram") -> StorageNodeInfo:
    return StorageNodeInfo(
        node_id=node_id, tier=tier, address="127.0.0.1:1", capacity_bytes=1 << 20,
        long_running=False, server_pid=1, server_start_time=0.0, actor_pid=1,
    )


def test_a_server_is_added_once_and_listed_in_order() -> None:
    members = Membership()
    members.add(_info("dram-1"), None)
    members.add(_info("dram-0"), None)
    with pytest.raises(ClusterError):
        members.add(_info("dram-0"), None)
    assert [s.node_id for s in members.servers()] == ["dram-0", "dram-1"]
    assert "dram-0" in members and len(members) == 2


def test_heartbeats_of_unknown_servers_are_ignored_and_old_samples_never_replace_newer() -> None:
    members = Membership()
    members.heartbeat("ghost", {"used_bytes": 5})
    assert members.latest_stats("ghost") is None
    members.add(_info("dram-0"), None)
    members.heartbeat("dram-0", {"used_bytes": 10, "sampled_at_unix_s": 2.0})
    # A heartbeat sampled before the kept sample (it travelled slowly) must not bring back
    # usage the newer sample no longer shows.
    members.heartbeat("dram-0", {"used_bytes": 99, "sampled_at_unix_s": 1.0})
    assert members.latest_stats("dram-0")["used_bytes"] == 10
    members.take_stats("dram-0", {"used_bytes": 0, "sampled_at_unix_s": 3.0})
    assert members.latest_stats("dram-0")["used_bytes"] == 0


def test_a_silent_server_is_listed_until_it_beats_and_a_beat_clears_a_suspect() -> None:
    members = Membership()
    members.add(_info("dram-0"), None)
    assert members.silent(dead_after_s=0.05) == {}
    time.sleep(0.1)
    assert set(members.silent(dead_after_s=0.05)) == {"dram-0"}
    members.mark_suspect("dram-0")
    assert members.suspects() == ["dram-0"] and members.unavailable("dram-0")
    members.heartbeat("dram-0", {})
    assert members.suspects() == [] and not members.unavailable("dram-0")
    assert members.silent(dead_after_s=0.05) == {}


def test_a_forgotten_server_beats_no_more_and_the_dead_list_is_bounded() -> None:
    members = Membership()
    members.add(_info("dram-0"), "node")
    info, node = members.forget("dram-0")
    assert info.node_id == "dram-0" and node == "node"
    assert members.forget("dram-0") is None
    members.heartbeat("dram-0", {"used_bytes": 1})
    assert members.latest_stats("dram-0") is None and members.silent(dead_after_s=0) == {}
    for index in range(DEAD_SERVERS_KEPT_MAX + 3):
        members.remember_dead(f"d-{index}", address="a", tier="dram", reason="test")
    dead = members.dead_servers()
    assert len(dead) == DEAD_SERVERS_KEPT_MAX and "d-0" not in dead
    members.remember_dead("d-5", address="b", tier="dram", reason="again", keep_known=True)
    assert members.dead_servers()["d-5"]["reason"] == "test"
    # A server that comes back under a dead server's id is live again.
    members.add(_info("d-5"), None)
    assert "d-5" not in members.dead_servers()
