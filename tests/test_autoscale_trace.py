"""The trace benchmark of issue 31 (benchmarks/autoscale_trace.py) runs end to end at a tiny size.

``python -m benchmarks.autoscale_trace --tiny`` starts its own Ray head with Ray's autoscaler
(the fake multi-node provider: worker nodes are raylets on this machine), replays three short,
staggered jobs on pocketflow, the simulator on the same trace, and writes its JSON and PNG. It
runs in a child process of its own session (it starts a Ray of its own), bounded in time. This
checks the script and what it proves (every job's data read back, drained servers empty,
nothing left after the stop), never a speed: the figures come from the full trace on a quiet
machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

TINY_RUN_TIMEOUT_S = 420.0
"""Bound on the tiny run (about a minute on a quiet machine; raylets start slowly under load)."""

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(TINY_RUN_TIMEOUT_S + 60)
def test_the_trace_benchmark_runs_a_tiny_trace_end_to_end(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.autoscale_trace", "--tiny", "--out", str(tmp_path)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TINY_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the tiny trace did not finish in {TINY_RUN_TIMEOUT_S:.0f} s: {err[-3000:]}")
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    (json_path,) = tmp_path.glob("*-autoscale-trace-tiny.json")
    (png_path,) = tmp_path.glob("*-autoscale-trace-tiny.png")
    result = json.loads(json_path.read_text())
    assert png_path.read_bytes().startswith(PNG_MAGIC)

    jobs = result["jobs"]
    assert sorted(jobs) == ["build", "pipeline", "sort"]
    for name, job in jobs.items():
        assert job["error"] is None and job["verified"], (name, job)
        assert job["objects"] >= 1 and job["deregistered_s"] is not None, (name, job)
    assert result["nothing_lost"]
    assert result["drained_servers_empty"], (
        result["drained_servers_retired_how"], result["drained_servers_last_seen"]
    )
    left = result["nothing_left"]
    assert left["ok"] and left["worker_nodes"] == 0 and left["request_after"] == [], left

    # The build (40 MiB) and the sort (48 MiB on NVMe) do not fit the head's two 16 MiB
    # servers: the autoscaler launched a node for each, and the split of each launch is known.
    launched_tiers = {row["tier"] for row in result["scale_up"]}
    assert {"dram", "nvme"} <= launched_tiers, result["scale_up"]
    for row in result["scale_up"]:
        for key in ("requested_s", "autoscaler_took_s", "node_up_s", "server_up_s"):
            assert row[key] is not None, row
        assert row["node_up_s"] <= row["server_up_s"], row
        # A server's start is split from its wait for the other nodes of its launch batch.
        assert row["waited_for_batch_s"] >= 0 and row["server_start_after_batch_s"] is not None
        assert row["waited_for_batch_s"] <= row["server_start_s"] + 0.01, row
    # Every launched server a job used was retired after its last job left.
    used = [row for row in result["scale_down"] if row["jobs"]]
    assert used and all(row["released_after_s"] is not None for row in used), used

    gbs = result["gb_seconds"]
    assert gbs["demanded"] > 0 and gbs["allocated"] > 0 and gbs["simulator_allocated"] > 0, gbs
    assert result["samples"] and result["simulator_samples"]
