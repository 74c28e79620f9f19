"""Tests of elasticity: launching servers for a job that does not fit, and the sizing loop.

The scenario needs a cluster of its own with autoscaling on, and this process's Ray belongs to
the session cluster, so it runs in a child process (tests/scenarios/scaling.py), bounded in time.
"""

from __future__ import annotations

from typing import Any

import pytest
from scenario_runner import run_scenario

SCENARIO_TIMEOUT_S = 180.0


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
    assert any(action == "RemoveServer" for action, _ in scaling["actions"])


def test_a_full_tier_gets_another_server(scaling: dict[str, Any]) -> None:
    assert scaling["scaled_up"]
    assert len(scaling["after_fill"]) > 2
    assert scaling["actions"][-1][0] == "AddServer"
