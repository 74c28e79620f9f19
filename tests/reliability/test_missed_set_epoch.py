"""A server that missed a job's first ``set_epoch`` (contract A: only registered jobs write; the
controller tells a job's servers its epoch and retries each until it confirms). The server is
SIGSTOPped while ``register_job`` runs, so the registration's ``set_epoch`` times out there: the
job is registered all the same, the server is listed as unconfirmed, and once it runs again the
monitor loop's retry reaches it within ``CONFIRM_BOUND_S``. A put in the gap gets the typed
``JobNotRegistered`` (nothing is stored, nothing lost), and every put after the retry succeeds.

The test adds its own server to the session cluster and stops only that one.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from control_roles import sigstop
from fixtures_cluster import DETECTION_SLACK_S, keys_on, wait_for

from pocketflow.cluster import LocalCluster
from pocketflow.control.controller import ADMIN_CALL_TIMEOUT_S, MONITOR_INTERVAL_S_MAX
from pocketflow.control.epochs import SET_EPOCH_RETRY_MAX_S
from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.errors import JobNotRegistered

REGISTER_BOUND_S = ADMIN_CALL_TIMEOUT_S + 30.0
"""A registration waits at most one admin call on the stopped server (plus a loaded machine)."""
CONFIRM_BOUND_S = SET_EPOCH_RETRY_MAX_S + ADMIN_CALL_TIMEOUT_S + MONITOR_INTERVAL_S_MAX \
    + DETECTION_SLACK_S
"""The documented bound (docs/ARCHITECTURE.md, "Registered jobs"): a server that answers again
is sent the job's epoch within one retry pause, one admin call and one monitor pass."""


def test_a_server_that_missed_a_jobs_first_set_epoch_gets_it_from_the_retry(
    local_cluster: LocalCluster, added_server: tuple[StorageNodeInfo, Any]
) -> None:
    info, _ = added_server
    outcome: dict[str, Any] = {}

    def register() -> None:
        try:
            outcome["job"] = local_cluster.register_job("missed-epoch")
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome["error"] = exc

    sigstop(info.server_pid)
    try:
        thread = threading.Thread(target=register)
        thread.start()
        thread.join(REGISTER_BOUND_S)
        assert not thread.is_alive(), "the registration waited on the stopped server for good"
    finally:
        os.kill(info.server_pid, signal.SIGCONT)
    assert "error" not in outcome, f"one hung server failed the registration: {outcome}"
    job = outcome["job"]
    try:
        handle = job.handle
        assert any(s.node_id == info.node_id and s.weight > 0 for s in handle.servers)
        on, _ = keys_on(handle, info.node_id, on_min=8)
        with job.connect(op_timeout_s="5s") as pf:
            # Until the retry reaches it, the server refuses the job's writes, typed; then they
            # go through. The bucket is created on every server of the job, this one too.
            deadline = time.monotonic() + CONFIRM_BOUND_S
            while True:
                try:
                    pf.create_bucket("b")
                    pf.put("b", on[0], b"first")
                    break
                except JobNotRegistered as exc:
                    assert f"not registered on server {info.node_id}" in str(exc), exc
                assert time.monotonic() < deadline, "the retry never reached the server"
                time.sleep(0.05)
            for key in on[1:]:
                pf.put("b", key, key.encode())
            assert pf.get_many("b", on) == [b"first", *(k.encode() for k in on[1:])]
        assert wait_for(
            lambda: job.job_id not in local_cluster.status()["epochs_unconfirmed"],
            timeout_s=CONFIRM_BOUND_S,
        ), "the controller never counted the server's epoch as confirmed"
    finally:
        job.deregister()
