"""The failure detector, built without Ray over real servers: a silent server that answers is
alive, a stopped one (SIGSTOP) is suspect, a killed one (SIGKILL) is gone."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from control_roles import sigstop, start_node

from pocketflow.control.admin import AdminTokens
from pocketflow.control.failure_detector import FailureDetector
from pocketflow.control.membership import Membership
from pocketflow.control.nodes import DirectNodes
from pocketflow.processes import wait_gone

DEAD_AFTER_S = 0.2
PROBE_TIMEOUT_S = 1.0
HUNG_SERVERS = 3
HUNG_PROBE_BOUND_S = 2 * PROBE_TIMEOUT_S
"""One probe deadline for all the hung servers, with slack for a loaded machine (called one
after another they would take ``HUNG_SERVERS`` deadlines)."""


def test_silent_servers_are_alive_suspect_or_gone_by_what_they_do(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    secret, secret_file = cluster_secret_file
    members = Membership()
    probe = AdminTokens(secret, timeout_s=PROBE_TIMEOUT_S)
    detector = FailureDetector(members, probe=probe, nodes=DirectNodes(),
                               dead_after_s=DEAD_AFTER_S)
    started = [start_node(secret_file, f"fd-{name}") for name in ("ok", "stopped", "killed")]
    try:
        for node, info in started:
            members.add(info, node)
        (_, ok), (_, stopped), (_, killed) = started
        time.sleep(DEAD_AFTER_S * 2)  # no heartbeats outside Ray: every server is silent
        sigstop(stopped.server_pid)
        os.kill(killed.server_pid, signal.SIGKILL)
        assert not wait_gone([killed.server_process()], timeout_s=10)
        assert set(detector.silent()) == {"fd-ok", "fd-stopped", "fd-killed"}

        assert detector.gone() == ["fd-killed"]
        # The one that answered the probe counts as heard from (after the sleep above, before
        # the stopped one's probe ran out); the stopped one is suspect.
        silent = detector.silent()
        assert silent.get("fd-ok", 0.0) + DEAD_AFTER_S < silent["fd-killed"], silent
        assert members.suspects() == ["fd-stopped"]
        # A suspect is not probed again before SUSPECT_RECHECK_S (a hung probe costs seconds).
        began = time.monotonic()
        assert detector.gone() == ["fd-killed"]
        assert time.monotonic() - began < PROBE_TIMEOUT_S

        os.kill(stopped.server_pid, signal.SIGCONT)
        members.heartbeat("fd-stopped", {})
        assert members.suspects() == []
    finally:
        for node, info in started:
            if info.server_process().alive():
                os.kill(info.server_pid, signal.SIGCONT)
            node.stop()
        probe.close()


def test_hung_servers_cost_one_probe_deadline_together(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """Silent servers are probed at once: three hung ones (SIGSTOP) become suspects within
    about one probe deadline, not one each (the monitor loop's other work waits behind it)."""
    secret, secret_file = cluster_secret_file
    members = Membership()
    probe = AdminTokens(secret, timeout_s=PROBE_TIMEOUT_S)
    detector = FailureDetector(members, probe=probe, nodes=DirectNodes(),
                               dead_after_s=DEAD_AFTER_S)
    started = [start_node(secret_file, f"fh-{index}") for index in range(HUNG_SERVERS)]
    stopped: list[int] = []
    try:
        for node, info in started:
            members.add(info, node)
        time.sleep(DEAD_AFTER_S * 2)  # no heartbeats outside Ray: every server is silent
        for _, info in started:
            sigstop(info.server_pid)
            stopped.append(info.server_pid)
        began = time.monotonic()
        assert detector.gone() == []
        probed_s = time.monotonic() - began
        assert members.suspects() == [f"fh-{index}" for index in range(HUNG_SERVERS)]
        assert probed_s < HUNG_PROBE_BOUND_S, (
            f"probing {HUNG_SERVERS} hung servers took {probed_s:.1f}s")
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        for node, _ in started:
            node.stop()
        probe.close()
