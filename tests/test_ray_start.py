"""A local cluster whose Ray node does not come up in Ray's fixed 30 s start-up wait (a machine
too busy to start its raylet; here the test stops the raylet with SIGSTOP) fails with a
``ClusterError`` that says so, and leaves none of the processes it started, the stopped raylet
included, while its interpreter goes on.

Ray raises a bare ``Exception`` for it, which ``pocketflow demo`` printed as a traceback
(tests/test_demo.py holds the other start failure, an ``OSError``, which needs no wait).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pocketflow.processes import ProcessRef, descendants, terminate, wait_gone

DEMO_TIMEOUT_S = 240.0
"""Bound on the demo: Ray's 30 s wait, then stopping what it started (SIGTERM, and SIGKILL for
the stopped raylet after the cluster's 15 s grace), with slack for a loaded machine."""
POLL_INTERVAL_S = 0.02
"""How often the test looks for the raylet among the demo's processes (it must stop it before
it registers, which takes Ray well over this)."""
GONE_TIMEOUT_S = 20.0
DEMO_ARGS = ["demo", "--records", "2000", "--mappers", "1", "--reducers", "1", "--processes",
             "1", "--no-progress"]
# The CLI's own entry point, then what is left of the processes it started while this
# interpreter (a library user's, say) goes on.
DEMO_SCRIPT = f"""
from pocketflow.cli import main
from pocketflow.processes import ProcessRef, descendants
code = main({DEMO_ARGS!r})
left = [pid for pid in descendants() if (ref := ProcessRef.of(pid)) and ref.alive()]
print("exit", code, "left", ",".join(map(str, sorted(left))) or "-")
"""


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@pytest.mark.slow
def test_a_raylet_that_never_registers_fails_the_demo_clearly_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    stdout, stderr = tmp_path / "demo.out", tmp_path / "demo.err"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    seen: dict[int, ProcessRef] = {}
    stopped: ProcessRef | None = None
    with stdout.open("w") as out, stderr.open("w") as err:
        demo = subprocess.Popen([sys.executable, "-c", DEMO_SCRIPT],
                                stdout=out, stderr=err, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + DEMO_TIMEOUT_S
        while demo.poll() is None and time.monotonic() < deadline:
            for pid in descendants(demo.pid):
                if pid not in seen and (ref := ProcessRef.of(pid)) is not None:
                    seen[pid] = ref
                if stopped is None and _comm(pid) == "raylet":
                    stopped = seen.get(pid)
                    os.kill(pid, signal.SIGSTOP)
            time.sleep(POLL_INTERVAL_S)
        assert demo.poll() is not None, f"the demo still runs after {DEMO_TIMEOUT_S} s"
        assert stopped is not None, "the test never saw the demo's raylet"
        message = stderr.read_text()
        assert demo.returncode == 0, message
        assert stdout.read_text().split()[-4:] == ["exit", "1", "left", "-"], stdout.read_text()
        assert "Traceback" not in message, message
        assert "Ray gives a node's raylet 30 s to start" in message, message
        # Ray logs a line or two of its own first.
        assert any(line.startswith("pocketflow demo: could not start Ray")
                   for line in message.splitlines()), message
        left = wait_gone(list(seen.values()), timeout_s=GONE_TIMEOUT_S)
        assert left == [], f"processes of the demo still alive: {[r.pid for r in left]}"
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=GONE_TIMEOUT_S)
        terminate([ref for ref in seen.values() if ref.alive()], timeout_s=1.0)
