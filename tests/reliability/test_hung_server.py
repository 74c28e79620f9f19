"""A hung storage server (SIGSTOPped: alive, silent) is told from a dead one (issue 12, item 1,
control side): reads of its data fail within the failure bound, it is suspected, not stopped, and
once it runs again nothing it held is lost.

The test adds its own server to the session cluster and stops only that one.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
from fixtures_cluster import (
    DEAD_AFTER_S,
    DETECTION_SLACK_S,
    controller_actor,
    keys_on,
    wait_for,
)

from pocketflow.cluster import LocalCluster
from pocketflow.config import ClientConfig
from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.errors import DataUnavailable


def test_hung_server_gives_data_unavailable_within_the_failure_bound_and_is_not_dead(
    local_cluster: LocalCluster, added_server: tuple[StorageNodeInfo, Any]
) -> None:
    """With the default client settings (no timeout given), a read of a SIGSTOPped server's data
    fails within the control plane's failure bound, never after a long RPC deadline. The
    control plane tells a hung process from a dead one: the server becomes a suspect (no new
    jobs), is neither stopped nor declared dead, and once it runs again its data is all there."""
    import ray

    info, _ = added_server
    controller = controller_actor()
    default_op_timeout_s = ClientConfig().op_timeout_s
    assert default_op_timeout_s <= DEAD_AFTER_S
    with local_cluster.register_job("hung") as job:
        # At least two keys on the hung server: one read on the session the puts opened, one
        # on a new session.
        on, off = keys_on(job.handle, info.node_id, on_min=2)
        assert len(on) >= 2 and off
        with job.connect() as pf:
            pf.create_bucket("b")
            for key in on[:4] + off[:4]:
                pf.put("b", key, b"v")
            os.kill(info.server_pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(DataUnavailable):
                    pf.get("b", on[0])
                assert time.monotonic() - started < default_op_timeout_s + DETECTION_SLACK_S
                started = time.monotonic()
                with pytest.raises(DataUnavailable):
                    pf.exists("b", on[1])  # a new session to the hung server
                assert time.monotonic() - started < default_op_timeout_s + DETECTION_SLACK_S
                # Silent for dead_after, then the probe waits dead_after for an answer; the
                # process runs, so it is a suspect, not dead.
                assert wait_for(
                    lambda: info.node_id
                    in ray.get(controller.suspect_servers.remote(), timeout=30),
                    timeout_s=2 * DEAD_AFTER_S + DETECTION_SLACK_S + 5,
                )
                assert info.node_id not in ray.get(controller.dead_servers.remote(), timeout=30)
                assert info.server_process().alive()
                with local_cluster.register_job("newcomer") as newcomer:
                    assert info.node_id not in {s.node_id for s in newcomer.handle.servers}
                # Keys on the other servers are served meanwhile.
                assert pf.get("b", off[0]) == b"v"
                os.kill(info.server_pid, signal.SIGCONT)
                # Running again: heartbeats clear the suspicion, and nothing was lost.
                assert wait_for(
                    lambda: info.node_id
                    not in ray.get(controller.suspect_servers.remote(), timeout=30),
                    timeout_s=DEAD_AFTER_S + DETECTION_SLACK_S + 10,
                )
                for key in on[:4] + off[:4]:
                    assert pf.get("b", key) == b"v"
            finally:
                if info.server_process().alive():
                    os.kill(info.server_pid, signal.SIGKILL)
