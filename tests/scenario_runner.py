"""Runs a scenario script of tests/scenarios in a child process with its own Ray, bounded in time.

Ray can be initialised once per process and the pytest session already runs the session cluster's
Ray, so scenarios that need a cluster of their own run as scripts that print one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCENARIOS = Path(__file__).parent / "scenarios"


def run_scenario(name: str, *, timeout_s: float) -> dict[str, Any]:
    """Run ``tests/scenarios/<name>.py``; returns the JSON object of its last output line.

    The script runs in its own session; on timeout the whole process group is killed.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    proc = subprocess.Popen(
        [sys.executable, str(SCENARIOS / f"{name}.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"scenario {name} did not finish in {timeout_s:.0f}s: {err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])
