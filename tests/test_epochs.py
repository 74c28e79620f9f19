"""Tests of epochs: a running job grows onto more servers and its clients follow transparently."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from control_roles import (
    ADMIN_TIMEOUT_S,
    FAN_OUT_BOUND_S,
    register,
    retry_until_confirmed,
    roles,
    sigstop,
)
from fixtures_cluster import keys_on

from pocketflow.client import connect
from pocketflow.cluster import LocalCluster
from pocketflow.control.epochs import SET_EPOCH_RETRY_FIRST_S, Epochs
from pocketflow.control.repair import REPAIR_RETRY_S, Repairer
from pocketflow.errors import StaleEpoch
from pocketflow.handle import JobHandle, LostServer


def test_a_growing_job_moves_to_a_new_epoch_and_old_data_stays_readable(
    local_cluster: LocalCluster,
) -> None:
    with local_cluster.register_job("growing", {"data_size_bytes": "8MiB"}) as job:
        first = job.handle
        weighted = {s.node_id for s in first.servers if s.weight > 0}
        with job.connect() as pf:
            pf.create_bucket("b")
            for i in range(40):
                pf.put("b", f"old-{i}", f"v{i}".encode())

            grown = local_cluster.control.grow_job(job.job_id, {"data_size_bytes": "300MiB"})
            assert grown.epoch == first.epoch + 1
            assert {s.node_id for s in first.servers} <= {s.node_id for s in grown.servers}
            assert {s.node_id for s in grown.servers if s.weight > 0} > weighted

            # The client still holds the first handle: it gets stale_epoch, adopts, and retries.
            for i in range(40):
                assert pf.get("b", f"old-{i}") == f"v{i}".encode()
            for i in range(40):
                pf.put("b", f"new-{i}", b"n")
            assert pf.get("b", "new-39") == b"n"
            assert local_cluster.control.job_handle(job.job_id).epoch == grown.epoch

        import ray

        from pocketflow.control import METADATA_ACTOR_NAME, NAMESPACE

        metadata = ray.get_actor(METADATA_ACTOR_NAME, namespace=NAMESPACE)
        record = ray.get(metadata.get_job.remote(job.job_id), timeout=30)
        assert record["epoch"] == grown.epoch
        assert record["weight_map"] == grown.weight_map()
        assert record["hints"]["data_size_bytes"] == 300 * 1024 * 1024


# -- the Epochs role, built without Ray -----------------------------------------------------------


def test_a_job_moved_off_a_lost_server_follows_without_ray(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """``Epochs`` over real servers: the new map reaches the job's live servers and its log
    record, the lost server is remembered, and a client holding the old map adopts the new one
    from the first server it calls."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        built.start("ep-0")
        built.start("ep-1")
        lost = built.start("ep-2")
        handle = register(built, "moving")
        assert {s.node_id for s in handle.servers} == {"ep-0", "ep-1", "ep-2"}
        with connect(handle, op_timeout_s="5s") as pf:
            pf.create_bucket("b")
            with built.lock:
                moved = built.epochs.move_off_lost(LostServer(lost.node_id, lost.address))
            assert moved == [handle.job_id]
            now = built.jobs.record(handle.job_id).handle
            assert now.epoch == handle.epoch + 1
            assert [s.node_id for s in now.lost] == ["ep-2"]
            assert all(s.node_id != "ep-2" or s.weight == 0 for s in now.servers)
            assert built.metadata.get_job(handle.job_id)["epoch"] == now.epoch
            for index in range(20):
                pf.put("b", f"k{index}", b"v")
            assert pf.handle.epoch == now.epoch
            assert pf.handle.weight_map() == now.weight_map()


def test_a_lost_servers_share_of_a_reservation_moves_at_once_to_a_server_with_room(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """A job that loses the server holding most of its share gets that share packed afresh on a
    server with room in the same epoch (it used to keep only the sliver its other server held,
    so its reservation counted on no server)."""
    _, secret_file = cluster_secret_file
    mib = 1024 * 1024
    with roles(secret_file) as built:
        for node_id in ("lr-0", "lr-1", "lr-2"):
            built.start(node_id, capacity_bytes=16 * mib)
        # lr-0 is left with 1 KiB of room, so best fit gives the next job a sliver of it.
        register(built, "filler", {"data_size_bytes": 16 * mib - 1024})
        handle = register(built, "big", {"data_size_bytes": 16 * mib})
        weights = {s.node_id: s.weight for s in handle.servers}
        assert 0 < weights["lr-0"] < 1e-3 and weights["lr-1"] > 0.99, weights
        lost = built.membership.get("lr-1")
        assert lost is not None
        with built.lock:
            built.membership.forget("lr-1")
            built.epochs.move_off_lost(LostServer(lost.node_id, lost.address))
        now = {s.node_id: s.weight for s in built.jobs.record(handle.job_id).handle.servers}
        assert "lr-1" not in now
        assert sum(now.values()) == pytest.approx(1.0) and now["lr-2"] > 0.99, now


def test_a_share_no_server_had_room_for_is_placed_once_one_has(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """The share of a lost server that fits nowhere stays missing (the epoch still moves at
    once), and the repair places it on a server that joins later."""
    _, secret_file = cluster_secret_file
    mib = 1024 * 1024
    with roles(secret_file) as built:
        built.start("sh-0", capacity_bytes=16 * mib)
        lost = built.start("sh-1", capacity_bytes=16 * mib)
        register(built, "filler", {"data_size_bytes": 16 * mib})  # all of sh-0 (best fit)
        handle = register(built, "short", {"data_size_bytes": 8 * mib})
        assert {s.node_id for s in handle.servers if s.weight > 0} == {"sh-1"}
        repairer = Repairer(built.jobs, built.allocator, built.epochs)
        with built.lock:
            built.membership.forget("sh-1")
            repairer.note(built.epochs.move_off_lost(LostServer(lost.node_id, lost.address)))
            assert repairer.short_jobs() == [handle.job_id]
            assert repairer.repair() == []  # no room anywhere, nothing to launch
        moved = built.jobs.record(handle.job_id).handle
        assert moved.epoch == handle.epoch + 1
        assert not any(s.weight > 0 for s in moved.servers)
        built.start("sh-2", capacity_bytes=16 * mib)
        with built.lock:
            assert repairer.repair() == [], "it waits REPAIR_RETRY_S after a failed attempt"
            assert repairer.repair(now_s=time.monotonic() + REPAIR_RETRY_S) == [handle.job_id]
            assert repairer.short_jobs() == []
        repaired = built.jobs.record(handle.job_id).handle
        assert {s.node_id: s.weight for s in repaired.servers if s.weight > 0} == {"sh-2": 1.0}
        with connect(repaired, op_timeout_s="5s") as pf:
            pf.create_bucket("b")
            pf.put("b", "k", b"v")
            assert pf.get("b", "k") == b"v"


def test_a_server_that_misses_a_new_epoch_is_told_again_until_it_confirms(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """A server stopped (SIGSTOP) while its job moves to a new epoch does not confirm it; the
    retry (the monitor loop's ``due``/``send``/``settle``) tells it once it runs again, so a
    client holding the old map is sent the new one by that server too."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        built.start("uc-0")
        stopped = built.start("uc-1")
        handle = register(built, "unconfirmed")
        sigstop(stopped.server_pid)
        try:
            with built.lock:
                built.epochs.move(handle.job_id, handle.servers)
            assert built.epochs.unconfirmed() == {handle.job_id: ["uc-1"]}
            time.sleep(SET_EPOCH_RETRY_FIRST_S)
            with built.lock:
                due = built.epochs.due()
            confirmed, failed = Epochs.send(due, built.retry_admin)
            assert (confirmed, failed) == ([], ["uc-1"])
            with built.lock:
                built.epochs.settle(confirmed, failed)
        finally:
            os.kill(stopped.server_pid, signal.SIGCONT)
        retry_until_confirmed(built, "the stopped server never confirmed")
        # The server holds the new epoch: a write with the old map is told it.
        with pytest.raises(StaleEpoch):
            built.admin.client(stopped.address).set_epoch(
                handle.job_id, handle.epoch, handle.weight_map())


HUNG_SERVERS = 3
"""Servers SIGSTOPped at once below: called one after another they would cost three admin
deadlines, well past the bound the tests allow."""

def test_a_registration_and_a_retry_pass_wait_one_deadline_however_many_servers_hang(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """The first epoch goes to the job's servers at once: with three of its four servers hung
    (SIGSTOP), ``announce`` returns within about one admin deadline, the healthy server confirms
    at once and the hung ones stay unconfirmed; a retry pass (``send``) also waits one deadline
    for all of them, and once they run again the retries confirm them."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        built.start("hg-0")
        hung = [built.start(f"hg-{index}") for index in range(1, 1 + HUNG_SERVERS)]
        hung_ids = [info.node_id for info in hung]
        stopped: list[int] = []
        try:
            for info in hung:
                sigstop(info.server_pid)
                stopped.append(info.server_pid)
            started = time.monotonic()
            with built.lock:
                handle = register(built, "hanging")
            registered_s = time.monotonic() - started
            assert {s.node_id for s in handle.servers} == {"hg-0", *hung_ids}
            assert registered_s < FAN_OUT_BOUND_S, (
                f"the registration waited {registered_s:.1f}s on {HUNG_SERVERS} hung servers")
            assert built.epochs.unconfirmed() == {handle.job_id: hung_ids}

            time.sleep(SET_EPOCH_RETRY_FIRST_S)
            with built.lock:
                due = built.epochs.due()
            assert sorted(call.node_id for call in due) == hung_ids
            started = time.monotonic()
            confirmed, failed = Epochs.send(due, built.retry_admin)
            sent_s = time.monotonic() - started
            assert (confirmed, failed) == ([], hung_ids)
            assert sent_s < FAN_OUT_BOUND_S, (
                f"a retry pass waited {sent_s:.1f}s on {HUNG_SERVERS} hung servers")
            with built.lock:
                built.epochs.settle(confirmed, failed)
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        retry_until_confirmed(built, "the hung servers never confirmed")
        # Every server holds the epoch: each takes the job's writes (a server not told of the
        # job refuses them as job_not_registered).
        with connect(handle, op_timeout_s="5s") as pf:
            pf.create_bucket("b")
            for node_id in ("hg-0", *hung_ids):
                on, _ = keys_on(handle, node_id, on_min=1)
                pf.put("b", on[0], node_id.encode())
                assert pf.get("b", on[0]) == node_id.encode()


def test_a_suspect_gets_weight_zero_and_its_weight_back_without_being_called(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """``suspend`` moves a job off a hung server (weight 0, listed in ``suspects``) without
    waiting on it; ``resume`` gives the weight back once it answers."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        built.start("sp-0")
        hung = built.start("sp-1")
        handle = register(built, "suspended")
        weight = next(s.weight for s in handle.servers if s.node_id == "sp-1")
        assert weight > 0
        sigstop(hung.server_pid)
        try:
            built.membership.mark_suspect("sp-1")
            started = time.monotonic()
            with built.lock:
                assert built.epochs.suspend("sp-1") == [handle.job_id]
                assert built.epochs.suspend("sp-1") == []  # listed already
            assert time.monotonic() - started < ADMIN_TIMEOUT_S, "suspend waited on the suspect"
            now = built.jobs.record(handle.job_id).handle
            assert now.suspects == ("sp-1",)
            entry = next(s for s in now.servers if s.node_id == "sp-1")
            assert entry.weight == 0 and not entry.persist
            assert any(s.weight > 0 for s in now.servers)
            on, _ = keys_on(now, "sp-1", on_min=0)
            assert on == [], "new keys still go to the suspect"
            assert built.metadata.get_job(handle.job_id)["held_weights"] == {
                "sp-1": [weight, False]}
            assert built.epochs.unconfirmed() == {handle.job_id: ["sp-1"]}
        finally:
            os.kill(hung.server_pid, signal.SIGCONT)
        built.membership.heartbeat("sp-1", {})
        with built.lock:
            assert built.epochs.resume("sp-1") == [handle.job_id]
        back = built.jobs.record(handle.job_id).handle
        assert back.suspects == () and back.epoch == now.epoch + 1
        assert next(s.weight for s in back.servers if s.node_id == "sp-1") == weight
        assert built.epochs.unconfirmed() == {}
        assert JobHandle.from_json(back.to_json()) == back

