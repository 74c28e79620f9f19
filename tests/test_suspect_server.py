"""A hung server in a job's map (contract D, client half; issue 29 item 1): the control plane
lists it in the map's ``suspects`` with weight 0 and the weight it had in ``held_weights``. New
keys are placed around it, a write-once check or a read that needs it is refused at once with
``ServerSuspect`` (never a wait on it), and every other key is written and read as usual.

The map is set here through the admin ``set_epoch`` on real servers, one of them SIGSTOPped."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from control_roles import register, roles, sigstop
from fixtures_servers import ServerSet

from pocketflow.client import connect
from pocketflow.errors import ObjectExists, ObjectNotFound, ServerSuspect
from pocketflow.handle import JobHandle, ServerInfo
from pocketflow.placement import Placement

KEYS = 60
# Far above the client's op timeout below: a call that waited on the hung server would pass it.
CALL_BOUND_S = 2.0
OPTIONS = {"op_timeout_s": "6s", "rpc_timeout_s": "6s", "connect_timeout_s": "2s"}


def _suspect_map(handle: JobHandle, suspect: ServerInfo) -> dict:
    """The next epoch's map of ``handle`` with ``suspect`` listed as hung."""
    weight_map = handle.weight_map()
    rows = []
    for row in weight_map["servers"]:
        row = list(row)
        if row[0] == suspect.node_id:
            row[3], row[4] = 0.0, 0
        rows.append(row)
    return dict(weight_map, epoch=handle.epoch + 1, servers=rows,
                suspects=[suspect.node_id],
                held_weights={suspect.node_id: [suspect.weight, int(suspect.persist)]})


def test_a_suspect_server_refuses_fast_only_the_keys_that_need_it(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    for node in ("hung-0", "hung-1", "hung-2"):
        servers, _ = server_factory(node, capacity_bytes=16 * 1024 * 1024)
    handle = servers.handle()
    suspect = servers.infos[2]
    before = Placement.of_handle(handle)
    old_keys = [f"old-{i}" for i in range(KEYS)]
    with connect(handle, **OPTIONS) as pf:
        pf.create_bucket("b")
        pf.put_many("b", [(key, key.encode()) for key in old_keys])
        # The control plane moves the job to a map where the suspect has weight 0 ...
        suspect_map = _suspect_map(handle, suspect)
        for server in servers.infos:
            with servers.admin(server.address) as admin:
                admin.set_epoch(handle.job_id, handle.epoch + 1, suspect_map)
        pid = servers.process(suspect.node_id).pid
        os.kill(pid, signal.SIGSTOP)
        try:
            # ... which this client learns from a live server's stale_epoch answer.
            first = next(k for k in old_keys if before.server_for(k.encode()) != suspect)
            assert pf.get("b", first) == first.encode()
            written, refused = [], []
            for i in range(KEYS):
                key = f"new-{i}"
                started = time.monotonic()
                try:
                    pf.put("b", key, key.encode())
                    written.append(key)
                except ServerSuspect:
                    refused.append(key)
                assert time.monotonic() - started < CALL_BOUND_S, key
            # Only keys the map before the suspicion placed on the suspect are refused.
            assert refused == [k for k in (f"new-{i}" for i in range(KEYS))
                               if before.server_for(k.encode()) == suspect]
            assert written and refused
            for key in written:
                assert pf.get("b", key) == key.encode()
            # Reads: keys held elsewhere read as usual, keys the suspect may hold fail fast.
            for key in old_keys:
                started = time.monotonic()
                if before.server_for(key.encode()) == suspect:
                    with pytest.raises(ServerSuspect):
                        pf.get("b", key)
                else:
                    assert pf.get("b", key) == key.encode()
                assert time.monotonic() - started < CALL_BOUND_S, key
        finally:
            os.kill(pid, signal.SIGCONT)
        # Answering again, its keys are all there, and nothing was written twice.
        resumed = dict(handle.weight_map(), epoch=handle.epoch + 2)
        for server in servers.infos:
            with servers.admin(server.address) as admin:
                admin.set_epoch(handle.job_id, handle.epoch + 2, resumed)
        for key in old_keys:
            assert pf.get("b", key) == key.encode()
        with pytest.raises(ObjectNotFound):
            pf.get("b", refused[0])


def test_the_controllers_suspect_map_keeps_new_keys_written(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """Both halves of contract D: the controller's Epochs role moves the job off a SIGSTOPped
    server (weight 0, listed in ``suspects``, its weight in ``held_weights``); a client of the
    job keeps writing new keys within its op timeout, is refused fast only the keys the server
    may hold, and nothing is written twice."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        for node in ("cs-0", "cs-1"):
            built.start(node)
        hung = built.start("cs-2")
        handle = register(built, "suspect-map")
        before = Placement.of_handle(handle)
        with connect(handle, **OPTIONS) as pf:
            pf.create_bucket("b")
            old_keys = [f"old-{i}" for i in range(KEYS)]
            pf.put_many("b", [(key, key.encode()) for key in old_keys])
            sigstop(hung.server_pid)
            try:
                built.membership.mark_suspect("cs-2")
                with built.lock:
                    assert built.epochs.suspend("cs-2") == [handle.job_id]
                moved = built.jobs.record(handle.job_id).handle
                assert [n for n, _, _ in moved.held_weights] == ["cs-2"]
                pf.update_handle(moved)
                refused = []
                for i in range(KEYS):
                    key = f"new-{i}"
                    started = time.monotonic()
                    try:
                        pf.put("b", key, key.encode())
                    except ServerSuspect:
                        refused.append(key)
                    assert time.monotonic() - started < CALL_BOUND_S, key
                assert refused == [f"new-{i}" for i in range(KEYS)
                                   if before.server_for(f"new-{i}".encode()).node_id == "cs-2"]
                assert len(refused) < KEYS // 2
            finally:
                os.kill(hung.server_pid, signal.SIGCONT)
            built.membership.heartbeat("cs-2", {})
            with built.lock:
                assert built.epochs.resume("cs-2") == [handle.job_id]
            pf.update_handle(built.jobs.record(handle.job_id).handle)
            # Answering again: the refused keys are free, every old key is there once.
            for key in refused:
                pf.put("b", key, key.encode())
            for key in old_keys:
                assert pf.get("b", key) == key.encode()
            with pytest.raises(ObjectExists):
                pf.put("b", old_keys[0], b"twice")
