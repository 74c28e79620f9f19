"""Tests of a multi-node Ray cluster: storage servers placed by custom resources, the autoscaler
asked when no node has room, a server started on an added node, and the node drained before it
goes. Runs tests/scenarios/multinode.py (``ray.cluster_utils.Cluster``) in a child process."""

from __future__ import annotations

from typing import Any

import pytest
from scenario_runner import run_scenario

SCENARIO_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def multinode() -> dict[str, Any]:
    return run_scenario("multinode", timeout_s=SCENARIO_TIMEOUT_S)


def test_long_running_servers_start_where_storage_slots_are(multinode: dict[str, Any]) -> None:
    assert multinode["initial_on_head"]


def test_a_job_that_needs_room_gets_a_server_on_an_added_node(multinode: dict[str, Any]) -> None:
    assert multinode["autoscaler_asked"], multinode.get("resource_requests")
    assert multinode["servers_on_new_node"] == ["dram-2"]
    assert multinode["job_uses_new_node"]


def test_a_job_that_fits_does_not_wait_behind_a_launch(multinode: dict[str, Any]) -> None:
    """A registration waiting for a node from the autoscaler does not hold the controller:
    another that fits the servers there are registers meanwhile."""
    assert multinode["fits_registered_while_launch_waits"]
    assert multinode["retry_answered_with_the_same_job"], "one job per registration request"


def test_a_job_that_fits_does_not_wait_behind_a_growths_launch(
    multinode: dict[str, Any],
) -> None:
    """``grow_job`` waiting for a node does not hold the controller either (it did: a
    registration that fitted waited for the growth's node)."""
    assert multinode["fits_registered_while_growth_waits"]
    assert multinode["growth_uses_new_node"]


def test_a_node_is_drained_without_losing_live_data(multinode: dict[str, Any]) -> None:
    assert multinode["drain_waits_for_live_data"]
    assert multinode["data_readable_while_draining"]
    drained = multinode["drained"]
    assert drained["retired"] == ["dram-2"]
    assert drained["still_draining"] == [] and drained["refused"] == {}
    assert multinode["after_remove"] == ["dram-0", "dram-1"]
    assert multinode["dead_after_remove"] == []
