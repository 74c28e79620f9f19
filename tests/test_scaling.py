"""Tests of elasticity: launching servers for a job that does not fit, and the sizing loop.

The scenario needs a cluster of its own with autoscaling on, and this process's Ray belongs to
the session cluster, so it runs in a child process (tests/scenarios/scaling.py), bounded in time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIO = Path(__file__).parent / "scenarios" / "scaling.py"
SCENARIO_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def scaling() -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    proc = subprocess.Popen(
        [sys.executable, str(SCENARIO)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=SCENARIO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"scaling scenario did not finish in {SCENARIO_TIMEOUT_S:.0f}s: {err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_registration_launches_a_server_when_the_job_does_not_fit(
    scaling: dict[str, object],
) -> None:
    initial = set(scaling["initial"])  # type: ignore[arg-type]
    assert initial == {"dram-0", "dram-1"}
    assert set(scaling["big_servers"]) - initial  # type: ignore[arg-type]
    assert scaling["big_roundtrip"]


def test_idle_launched_servers_are_drained_and_long_running_ones_stay(
    scaling: dict[str, object],
) -> None:
    assert scaling["scaled_down"]
    assert scaling["after_idle"] == ["dram-0", "dram-1"]
    assert any(action == "RemoveServer" for action, _ in scaling["actions"])  # type: ignore[attr-defined]


def test_a_full_tier_gets_another_server(scaling: dict[str, object]) -> None:
    assert scaling["scaled_up"]
    assert len(scaling["after_fill"]) > 2  # type: ignore[arg-type]
    assert scaling["actions"][-1][0] == "AddServer"  # type: ignore[index]
