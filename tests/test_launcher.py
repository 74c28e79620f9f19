"""Tests of the launcher's autoscaler request (no Ray): it asks for one storage slot per server
kept and per server starting, follows them down as well as up, and is withdrawn at the end.

The request goes to a recorder standing in for ``ray.autoscaler.sdk.request_resources`` (Ray's
API, not ours); tests/test_autoscaling.py checks the same against Ray's real autoscaler.
"""

from __future__ import annotations

from typing import Any

from pocketflow.control.launcher import Launcher, LaunchSpec, tier_resource

DRAM = tier_resource("dram")
NVME = tier_resource("nvme")


def launcher(live: dict[str, int], sent: list[list[dict[str, float]]], *,
             use_resources: bool = True, fail: list[bool] | None = None) -> Launcher:
    def request(bundles: list[dict[str, float]]) -> None:
        if fail and fail[0]:
            raise RuntimeError("Ray is not initialized yet")
        sent.append(bundles)

    return Launcher(
        LaunchSpec(data_dir="/nonexistent",
                   capacity_bytes_by_tier={"dram": 1, "nvme": 1}, use_resources=use_resources),
        secret=b"s" * 32,
        live_slots=lambda: dict(live),
        request_resources=request,
    )


def test_the_request_follows_the_servers_kept_and_starting_down_as_well_as_up() -> None:
    live = {"dram": 2}
    sent: list[list[dict[str, Any]]] = []
    slots = launcher(live, sent)
    assert slots.follow()
    assert sent[-1] == [{DRAM: 1.0}] * 2
    assert not slots.follow(), "an unchanged request is not sent again"
    with slots.starting("nvme"):
        # Asked for at once, before the launch waits for a node.
        assert sent[-1] == [{DRAM: 1.0}] * 2 + [{NVME: 1.0}]
        live["nvme"] = 1  # the launched server is taken in
    assert len(sent) == 2, "taken in: the same slots, nothing sent"
    live["nvme"] = 0  # retired
    assert slots.follow()
    assert sent[-1] == [{DRAM: 1.0}] * 2
    slots.withdraw()
    assert sent[-1] == []
    assert slots.requested_slots() == {}
    outcomes = [r["outcome"] for r in slots.resource_requests]
    assert outcomes == ["requested", "requested", "requested", "withdrawn"]


def test_a_launch_that_fails_gives_its_slot_back() -> None:
    live = {"dram": 2}
    sent: list[list[dict[str, Any]]] = []
    slots = launcher(live, sent)
    try:
        with slots.starting("dram"):
            assert sent[-1] == [{DRAM: 1.0}] * 3
            raise TimeoutError("not up in time")
    except TimeoutError:
        pass
    assert sent[-1] == [{DRAM: 1.0}] * 2


def test_a_failed_request_is_sent_again_by_the_next_follow() -> None:
    live = {"dram": 1}
    sent: list[list[dict[str, Any]]] = []
    fail = [True]
    slots = launcher(live, sent, fail=fail)
    assert slots.follow()
    assert sent == [] and slots.resource_requests[-1]["outcome"].startswith("request failed")
    fail[0] = False
    assert slots.follow()
    assert sent == [[{DRAM: 1.0}]]


def test_without_storage_resources_nothing_is_asked() -> None:
    sent: list[list[dict[str, Any]]] = []
    slots = launcher({"dram": 2}, sent, use_resources=False)
    assert not slots.follow()
    with slots.starting("dram"):
        pass
    slots.withdraw()
    assert sent == []
