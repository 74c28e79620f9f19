"""Job ends, with the ``JobEnds`` role built without Ray over real servers: a server that does
not confirm a job's end (stopped) is retried until it does, and a crashed controller's pending
ends are taken back from the Metadata log."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from control_roles import ADMIN_TIMEOUT_S, register, roles, sigstop

from pocketflow.client import connect
from pocketflow.control.job_ends import END_RETRY_FIRST_S
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


HUNG_SERVERS = 3
"""Servers SIGSTOPped at once below: called one after another they would cost three admin
deadlines, well past ``FAN_OUT_BOUND_S``."""

FAN_OUT_BOUND_S = 2 * ADMIN_TIMEOUT_S
"""How long an end or a retry pass over hung servers may take: one admin deadline, with
generous slack for a loaded machine (a bound that ends the wait, not a speed)."""


def test_an_end_and_its_retries_wait_one_deadline_however_many_servers_hang(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """A job's end reaches its servers at once: with three of four hung (SIGSTOP), ``end``
    and a retry pass each return within about one admin deadline, the healthy server confirms
    at once, and the hung ones confirm after they run again."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        built.start("jh-0")
        hung = [built.start(f"jh-{index}") for index in range(1, 1 + HUNG_SERVERS)]
        hung_ids = [info.node_id for info in hung]
        handle = register(built, "ending-hung")
        assert {s.node_id for s in handle.servers} == {"jh-0", *hung_ids}
        stopped: list[int] = []
        try:
            for info in hung:
                sigstop(info.server_pid)
                stopped.append(info.server_pid)
            built.jobs.remove(handle.job_id)
            started = time.monotonic()
            confirmed, unreachable = built.ends.end(handle.job_id, ["jh-0", *hung_ids])
            ended_s = time.monotonic() - started
            assert [n for n, _ in confirmed] == ["jh-0"] and unreachable == hung_ids
            assert ended_s < FAN_OUT_BOUND_S, (
                f"the end waited {ended_s:.1f}s on {HUNG_SERVERS} hung servers")
            time.sleep(END_RETRY_FIRST_S)
            started = time.monotonic()
            assert built.ends.retry() == 0
            retried_s = time.monotonic() - started
            assert retried_s < FAN_OUT_BOUND_S, (
                f"a retry pass waited {retried_s:.1f}s on {HUNG_SERVERS} hung servers")
            assert built.ends.pending() == {handle.job_id: hung_ids}
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        _retry_until_ended(built.ends, handle.job_id)
        for info in hung:
            assert handle.job_id not in built.admin.client(info.address).stats().get("jobs", {})


def test_a_suspects_end_waits_for_it_to_answer_without_waiting_on_it(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """A suspect (hung: SIGSTOPped, marked by the failure detector) is not asked for a job's
    end, neither by the deregistration nor by the monitor's retries (each call would wait one
    admin deadline); its end stays pending and reaches it once it answers again."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        built.start("js-0")
        hung = built.start("js-1")
        handle = register(built, "ending-suspect")
        sigstop(hung.server_pid)
        try:
            built.membership.mark_suspect("js-1")
            built.jobs.remove(handle.job_id)
            started = time.monotonic()
            confirmed, unreachable = built.ends.end(handle.job_id, ["js-0", "js-1"])
            assert [n for n, _ in confirmed] == ["js-0"] and unreachable == ["js-1"]
            time.sleep(END_RETRY_FIRST_S)
            assert built.ends.retry() == 0
            waited_s = time.monotonic() - started - END_RETRY_FIRST_S
            assert waited_s < ADMIN_TIMEOUT_S, f"the end waited {waited_s:.1f}s on the suspect"
            assert built.ends.pending() == {handle.job_id: ["js-1"]}
        finally:
            os.kill(hung.server_pid, signal.SIGCONT)
        built.membership.heartbeat("js-1", {})  # it answers again: no longer suspect
        _retry_until_ended(built.ends, handle.job_id)
        assert handle.job_id not in built.admin.client(hung.address).stats().get("jobs", {})
