"""Job ends, with the ``JobEnds`` role built without Ray over real servers: a server that does
not confirm a job's end (stopped) is retried until it does, and a crashed controller's pending
ends are taken back from the Metadata log."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from control_roles import register, roles, sigstop

from pocketflow.client import connect
from pocketflow.control.metadata import Metadata
from pocketflow.errors import JobNotRegistered

RETRY_BOUND_S = 30.0


def _retry_until_ended(ends, job_id: str) -> None:  # noqa: ANN001 - JobEnds
    deadline = time.monotonic() + RETRY_BOUND_S
    while job_id in ends.pending():
        assert time.monotonic() < deadline, f"the end of {job_id} was never confirmed"
        ends.retry()
        time.sleep(0.1)


def test_an_end_a_stopped_server_missed_is_retried_until_it_is_final_there(
    cluster_secret_file: tuple[bytes, Path], tmp_path: Path
) -> None:
    _, secret_file = cluster_secret_file
    metadata = Metadata(tmp_path / "metadata.log")
    with roles(secret_file, metadata=metadata) as built:
        built.start("je-0")
        stopped = built.start("je-1")
        handle = register(built, "ended")
        with connect(handle, op_timeout_s="5s") as pf:
            pf.create_bucket("b")
            for index in range(20):
                pf.put("b", f"k{index}", b"v" * 100)
        sigstop(stopped.server_pid)
        try:
            targets = sorted(built.membership.ids())
            built.jobs.remove(handle.job_id)
            metadata.remove_job(handle.job_id, True, targets)
            confirmed, unreachable = built.ends.end(handle.job_id, targets)
            assert [n for n, _ in confirmed] == ["je-0"] and unreachable == ["je-1"]
            assert built.ends.pending() == {handle.job_id: ["je-1"]}
            assert metadata.endings() == {handle.job_id: ["je-1"]}
            # A restarted controller would take it back from the log.
            assert Metadata(tmp_path / "metadata.log").endings() == {handle.job_id: ["je-1"]}
        finally:
            os.kill(stopped.server_pid, signal.SIGCONT)
        _retry_until_ended(built.ends, handle.job_id)
        assert metadata.endings() == {}
        # The job ended on the server that missed it: its data is freed, and its old token can
        # write nothing there any more.
        stats = built.admin.client(stopped.address).stats()
        assert handle.job_id not in stats.get("jobs", {})
        only_stopped = handle.with_weight_map(
            {"epoch": handle.epoch, "servers": [
                [s.node_id, s.address, s.tier, 1.0, 0] for s in handle.servers
                if s.node_id == "je-1"]})
        with connect(only_stopped, op_timeout_s="5s") as pf:
            with pytest.raises(JobNotRegistered):
                pf.put("b", "late", b"x")


def test_pending_ends_survive_a_controller_restart(
    cluster_secret_file: tuple[bytes, Path], tmp_path: Path
) -> None:
    _, secret_file = cluster_secret_file
    metadata = Metadata(tmp_path / "metadata.log")
    with roles(secret_file, metadata=metadata) as before:
        stopped = before.start("jr-0")
        handle = register(before, "ending")
        with connect(handle, op_timeout_s="5s") as pf:
            pf.create_bucket("b")
            pf.put("b", "k", b"v")
        sigstop(stopped.server_pid)
        try:
            before.jobs.remove(handle.job_id)
            metadata.remove_job(handle.job_id, True, ["jr-0"])
            _, unreachable = before.ends.end(handle.job_id, ["jr-0"])
            assert unreachable == ["jr-0"]
        finally:
            os.kill(stopped.server_pid, signal.SIGCONT)
        # A new instance (over the same server) takes the pending end back from the log.
        with roles(secret_file, metadata=Metadata(tmp_path / "metadata.log")) as after:
            after.add(before.started[0], stopped)
            after.ends.restore(after.metadata.endings())
            _retry_until_ended(after.ends, handle.job_id)
            assert after.metadata.endings() == {}
            stats = after.admin.client(stopped.address).stats()
            assert handle.job_id not in stats.get("jobs", {})
