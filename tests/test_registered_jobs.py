"""Only registered jobs write (docs/PROTOCOL.md, "Registered jobs"): a storage server that starts
anew knows no job, so it refuses a live job's writes until the controller's epochs role sends it
the job's map, and then takes them. Real servers, the roles built without Ray."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from control_roles import register, roles
from fixtures_servers import ServerAt, wait_exited

from pocketflow.client import connect
from pocketflow.control.epochs import Epochs
from pocketflow.errors import JobNotRegistered
from pocketflow.server_process import ServerSpec

CAPACITY_BYTES = 16 * 1024 * 1024
EXIT_WAIT_S = 10.0


def test_a_restarted_server_refuses_a_live_job_until_the_controller_sends_its_map(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        info = built.start("rs-0")
        handle = register(built, "restarted")
        with connect(handle, op_timeout_s="5s") as pf:
            pf.create_bucket("b")
            pf.put("b", "before", b"1")

        os.kill(info.server_pid, signal.SIGKILL)
        wait_exited(info.server_pid, timeout_s=EXIT_WAIT_S)
        restarted = ServerAt(
            ServerSpec(node_id="rs-0", tier="dram", capacity_bytes=CAPACITY_BYTES,
                       secret_file=secret_file, threads=1, metrics=False),
            info.address,
        )
        restarted.start()
        try:
            with connect(handle, op_timeout_s="5s") as pf:
                # The new process knows no job: the job's valid token writes nothing yet.
                with pytest.raises(JobNotRegistered, match="not registered on server rs-0"):
                    pf.create_bucket("b")
                with pytest.raises(JobNotRegistered):
                    pf.put("b", "early", b"x")
                # The controller sees the server (back) and sends it every live job's map, as
                # `Controller.add_server` does.
                with built.lock:
                    assert built.epochs.resync("rs-0") == 1
                    due = built.epochs.due()
                confirmed, failed = Epochs.send(due, built.retry_admin)
                assert ([c.node_id for c in confirmed], failed) == (["rs-0"], [])
                with built.lock:
                    built.epochs.settle(confirmed, failed)
                assert built.epochs.unconfirmed() == {}
                pf.create_bucket("b")
                pf.put("b", "after", b"2")
                assert pf.get("b", "after") == b"2"
                assert not pf.exists("b", "early")
        finally:
            restarted.stop()
