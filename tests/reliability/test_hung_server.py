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
from control_roles import sigstop
from fixtures_cluster import (
    DEAD_AFTER_S,
    DETECTION_SLACK_S,
    controller_actor,
    keys_on,
    wait_for,
)

from pocketflow.auth import admin_token
from pocketflow.client import connect
from pocketflow.cluster import LocalCluster
from pocketflow.config import ClientConfig
from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.errors import DataUnavailable, JobNotRegistered
from pocketflow.transport import AdminClient


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
                # Its keys are readable once the job's map gives it back its weight (until
                # then a read that needs it is ServerSuspect: the map says it hangs). That epoch
                # follows the heartbeat that cleared it by one monitor pass.
                assert wait_for(
                    lambda: info.node_id not in _handle_of(job.job_id).suspects,
                    timeout_s=REROUTE_BOUND_S,
                ), "the job's map never gave the server back"
                for key in on[:4] + off[:4]:
                    assert pf.get("b", key) == b"v"
            finally:
                if info.server_process().alive():
                    os.kill(info.server_pid, signal.SIGKILL)


REROUTE_BOUND_S = 2 * DEAD_AFTER_S + DETECTION_SLACK_S + 5
"""Silent for dead_after, a probe of dead_after, then one monitor pass, with slack."""


def _handle_of(job_id: str) -> Any:
    import ray

    return ray.get(controller_actor().job_handle.remote(job_id), timeout=30)


def test_a_hung_servers_jobs_move_around_it_and_get_it_back(
    local_cluster: LocalCluster, added_server: tuple[StorageNodeInfo, Any]
) -> None:
    """Issue 29 item 1 (contract D, controller half): once a SIGSTOPped server is suspect, every
    job whose map names it moves to a new epoch in which it has weight 0 and is listed in
    ``suspects`` (so new keys go to the other servers); when it runs again, a later epoch gives
    its weight back and drops it from ``suspects``."""
    info, _ = added_server
    with local_cluster.register_job("around") as job:
        first = job.handle
        weight = next(s.weight for s in first.servers if s.node_id == info.node_id)
        assert weight > 0
        sigstop(info.server_pid)
        try:
            assert wait_for(lambda: info.node_id in _handle_of(job.job_id).suspects,
                            timeout_s=REROUTE_BOUND_S), "the job never moved off the hung server"
            moved = _handle_of(job.job_id)
            assert moved.epoch > first.epoch
            entry = next(s for s in moved.servers if s.node_id == info.node_id)
            assert entry.weight == 0 and not entry.persist
            on, off = keys_on(moved, info.node_id, on_min=0)
            assert on == [] and off, "new keys of the moved map still go to the hung server"
        finally:
            os.kill(info.server_pid, signal.SIGCONT)
        assert wait_for(lambda: info.node_id not in _handle_of(job.job_id).suspects,
                        timeout_s=REROUTE_BOUND_S), "the server never got its weight back"
        back = _handle_of(job.job_id)
        assert back.epoch > moved.epoch
        assert next(s.weight for s in back.servers if s.node_id == info.node_id) == weight


def test_a_job_ended_while_a_server_hung_ends_there_once_it_runs(
    local_cluster: LocalCluster, added_server: tuple[StorageNodeInfo, Any]
) -> None:
    """Issue 29 item 3 (contract A, controller half): a deregistration that a SIGSTOPped server
    cannot confirm is retried until it does: once the server runs again the job's data there is
    freed and its old token can no longer write there."""
    info, _ = added_server
    job = local_cluster.register_job("ended-late")
    on, _ = keys_on(job.handle, info.node_id, on_min=3)
    with job.connect() as pf:
        pf.create_bucket("b")
        for key in on[:-1]:
            pf.put("b", key, b"v" * 1000)
    handle = job.handle
    sigstop(info.server_pid)
    try:
        result = job.deregister()
        assert info.node_id in result["unreachable"]
        assert info.node_id in local_cluster.status()["job_ends_pending"].get(handle.job_id, [])
    finally:
        os.kill(info.server_pid, signal.SIGCONT)
    assert wait_for(lambda: handle.job_id not in local_cluster.status()["job_ends_pending"],
                    timeout_s=REROUTE_BOUND_S), "the job's end never reached the server"
    with AdminClient(info.address, admin_token(local_cluster.secret, ttl_s=60)) as admin:
        assert handle.job_id not in admin.stats().get("jobs", {})
    with connect(handle, op_timeout_s="5s") as pf:
        with pytest.raises(JobNotRegistered):
            pf.put("b", on[-1], b"x")


def test_new_keys_are_written_while_a_server_of_the_job_hangs(
    local_cluster: LocalCluster, added_server: tuple[StorageNodeInfo, Any]
) -> None:
    """Issue 29 item 1 end to end (contract D, both halves): once the controller lists a
    SIGSTOPped server as a suspect, a client of the job writes new keys, each within its
    ``op_timeout_s``; only keys the hung server may hold (the map before the suspicion placed
    them there) are refused, at once, as ``ServerSuspect``; nothing is written twice, and once
    the server runs again its keys are all there."""
    from pocketflow.errors import ObjectExists, ServerSuspect
    from pocketflow.placement import Placement

    info, _ = added_server
    op_timeout_s = 3.0
    with local_cluster.register_job("writes-around") as job:
        on, off = keys_on(job.handle, info.node_id, on_min=2)
        with job.connect(op_timeout_s=f"{op_timeout_s}s") as pf:
            pf.create_bucket("b")
            for key in on + off:
                pf.put("b", key, b"old")
            sigstop(info.server_pid)
            try:
                assert wait_for(lambda: info.node_id in _handle_of(job.job_id).suspects,
                                timeout_s=REROUTE_BOUND_S), "the job never moved off the server"
                # A call to a live server brings the client the new map (stale_epoch).
                assert pf.get("b", off[0]) == b"old"
                written, refused = [], []
                for i in range(40):
                    key = f"new-{i}"
                    started = time.monotonic()
                    try:
                        pf.put("b", key, b"new")
                        written.append(key)
                    except ServerSuspect:
                        refused.append(key)
                    assert time.monotonic() - started < op_timeout_s, key
                before = Placement(job.handle.servers)
                assert refused == [key for key in (f"new-{i}" for i in range(40))
                                   if before.server_for(key.encode()).node_id == info.node_id]
                assert written
                for key in on:
                    with pytest.raises(ServerSuspect):
                        pf.put("b", key, b"twice")
            finally:
                os.kill(info.server_pid, signal.SIGCONT)
            assert wait_for(lambda: info.node_id not in _handle_of(job.job_id).suspects,
                            timeout_s=REROUTE_BOUND_S), "the server never got its weight back"
            for key in on + off:
                assert pf.get("b", key) == b"old"
                with pytest.raises(ObjectExists):
                    pf.put("b", key, b"twice")
            for key in written:
                assert pf.get("b", key) == b"new"
