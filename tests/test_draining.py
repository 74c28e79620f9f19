"""Draining and retiring servers, with the ``Drainer`` role built without Ray over real
servers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from control_roles import register, roles, sigstop
from fixtures_cluster import keys_on

from pocketflow.client import connect
from pocketflow.control.draining import UNTOLD_RETRY_S
from pocketflow.errors import ClusterError
from pocketflow.processes import wait_gone

EXIT_TIMEOUT_S = 10.0


def test_a_drained_server_keeps_its_data_readable_and_an_empty_one_retires_at_once(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        full = built.start("dr-0")
        empty = built.start("dr-1")
        built.start("dr-2")
        handle = register(built, "draining")
        with connect(handle, op_timeout_s="5s") as pf:
            pf.create_bucket("b")
            keys, _ = keys_on(handle, "dr-0", on_min=5)
            for key in keys:
                pf.put("b", key, key.encode())
            with built.lock:
                result = built.drainer.drain("dr-0")
            assert result["retired"] is False
            entry = next(s for s in built.jobs.record(handle.job_id).handle.servers
                         if s.node_id == "dr-0")
            assert entry.weight == 0.0, "a draining server takes no new data"
            assert "dr-0" in built.membership and built.membership.is_draining("dr-0")
            for key in keys:
                assert pf.get("b", key) == key.encode()

            with built.lock:
                result = built.drainer.drain("dr-1")
            assert result["retired"] is True
            assert built.drainer.retired()[-1]["node_id"] == "dr-1"
            # Its stats after the drain said so, or it exited at once (an empty server does).
            assert built.drainer.retired()[-1]["how"] in ("empty", "exited once empty")
            assert not wait_gone([empty.server_process()], timeout_s=EXIT_TIMEOUT_S)
            assert "dr-1" not in built.membership
            assert all(s.node_id != "dr-1"
                       for s in built.jobs.record(handle.job_id).handle.servers)
            assert full.server_process().alive()
        with pytest.raises(ClusterError):
            with built.lock:
                built.drainer.drain("dr-1")



def test_a_server_that_does_not_answer_its_drain_keeps_its_data_and_is_told_again(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """A drain whose ``drain`` call gets no answer (the server stopped, as on a machine at load
    20) must not take the silence for "gone, so empty": it was retired and its node stopped with
    the job's objects on it. It stays draining, keeps its data, and the monitor loop tells it
    again once it answers."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        stopped = built.start("dn-0")
        built.start("dn-1")
        built.start("dn-2")
        handle = register(built, "unanswered")
        with connect(handle, op_timeout_s="10s") as pf:
            pf.create_bucket("b")
            keys, _ = keys_on(handle, "dn-0", on_min=3)
            for key in keys:
                pf.put("b", key, key.encode())
            pid = stopped.server_process().pid
            sigstop(pid)
            try:
                with built.lock:
                    result = built.drainer.drain("dn-0")
                assert result["retired"] is False, result
                assert "dn-0" in built.membership and built.membership.is_draining("dn-0")
                assert stopped.server_process().alive(), "a server holding data was stopped"
            finally:
                os.kill(pid, signal.SIGCONT)
            with built.lock:
                assert built.drainer.go_on() == [], "not again at once"
                later_s = time.monotonic() + UNTOLD_RETRY_S
                assert built.drainer.go_on(now_s=later_s) == ["dn-0"], "told once it answers"
            assert "dn-0" in built.membership, "it holds data: it drains, it is not retired"
            for key in keys:
                assert pf.get("b", key) == key.encode()
            assert built.admin.client(stopped.address).stats()["draining"] is True
            with built.lock:
                assert built.drainer.go_on(now_s=later_s + UNTOLD_RETRY_S) == [], "told once"
            assert all(r["node_id"] != "dn-0" for r in built.drainer.retired())


def test_a_drained_servers_share_of_a_reservation_moves_to_a_server_with_room(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """Draining a server that holds most of a job's share packs that share afresh on a server
    with room, so the job's reservation still counts in full (it used to keep only the sliver
    its other server held, 1 KiB of 16 MiB here, and count on no server)."""
    _, secret_file = cluster_secret_file
    mib = 1024 * 1024
    with roles(secret_file) as built:
        for node_id in ("rs-0", "rs-1", "rs-2"):
            built.start(node_id, capacity_bytes=16 * mib)
        # rs-0 is left with 1 KiB of room, so best fit gives the next job a sliver of it.
        register(built, "filler", {"data_size_bytes": 16 * mib - 1024})
        handle = register(built, "big", {"data_size_bytes": 16 * mib})
        weights = {s.node_id: s.weight for s in handle.servers}
        assert 0 < weights["rs-0"] < 1e-3 and weights["rs-1"] > 0.99, weights
        with connect(handle, op_timeout_s="5s") as pf:
            # Data on rs-1 keeps it draining (an empty server would retire at once).
            pf.create_bucket("b")
            keys, _ = keys_on(handle, "rs-1", on_min=1, off_min=0)
            pf.put("b", keys[0], b"kept")
            with built.lock:
                built.drainer.drain("rs-1")
            assert pf.get("b", keys[0]) == b"kept"
        servers = {s.node_id: s for s in built.jobs.record(handle.job_id).handle.servers}
        assert servers["rs-1"].weight == 0.0, "the drained server stays, readable, at weight 0"
        assert sum(s.weight for s in servers.values()) == pytest.approx(1.0)
        assert servers["rs-2"].weight > 0.99, servers
        reserved = {load.node_id: load.allocated_capacity_bytes
                    for load in built.allocator.server_loads() if load.active}
        assert reserved["rs-2"] >= 16 * mib - 2048, reserved


def test_a_job_with_channels_on_a_drained_server_keeps_its_map_until_they_are_gone(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """Issue 29 item 2, without Ray: a job whose queue lives on the drained server keeps its map
    (so the queue is found), the server is not told to drain; once the queue is deleted the job
    moves off and the server, empty, is retired."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        held = built.start("dc-0")
        built.start("dc-1")
        handle = register(built, "channels")
        on, _ = keys_on(handle, "dc-0", on_min=1)
        with connect(handle, op_timeout_s="5s") as pf:
            pf.create_bucket("b")
            queue = pf.queue("b", on[0], max_items=8)
            for index in range(5):
                queue.enqueue(f"i{index}".encode())
            with built.lock:
                result = built.drainer.drain("dc-0")
            assert result["retired"] is False and result["holding_channels"] == [handle.job_id]
            assert built.jobs.record(handle.job_id).handle == handle  # the map stays
            assert built.admin.client(held.address).stats()["draining"] is False
            assert [queue.dequeue() for _ in range(5)] == [f"i{i}".encode() for i in range(5)]
            # An empty queue is still a segment there: the job stays held.
            built.membership.take_stats("dc-0", built.admin.sampled_stats(held.address))
            with built.lock:
                assert built.drainer.go_on() == []
            pf.delete_bucket("b")
        built.membership.take_stats("dc-0", built.admin.sampled_stats(held.address))
        with built.lock:
            assert built.drainer.go_on() == ["dc-0"]
        assert "dc-0" not in built.membership
        assert not wait_gone([held.server_process()], timeout_s=EXIT_TIMEOUT_S)
        assert all(s.node_id != "dc-0" for s in built.jobs.record(handle.job_id).handle.servers)
