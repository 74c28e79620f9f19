"""A fence whose PERSIST store never landed does not block its key (issue 28, write-once).

A PERSIST put whose PERSIST home is another server than the key's arbiter fences the arbiter
first; if its store then times out, the fence stays (the store can still land later). An
ephemeral put that finds such a fence stores through it, write-once on the PERSIST home, so
exactly one of the fenced store and the later put lands, and the key reads as that one.
Real servers: the PERSIST home is SIGSTOPped so that the store times out, then either killed
(the store never lands) or continued (it lands, racing the later put).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures_servers import ServerAt, ServerSet, records_of, split_keys, wait_exited
from test_write_once import SPLIT_SERVER_BYTES

from pocketflow.client import Client, connect
from pocketflow.errors import ObjectExists, ObjectNotFound, Unavailable
from pocketflow.handle import ServerInfo
from pocketflow.protocol import OP_LOOKUP
from pocketflow.server_process import ServerSpec

SHORT_TIMEOUTS = {"op_timeout_s": "1s", "rpc_timeout_s": "1s", "stream_timeout_s": "10s"}
"""A writer whose store on a stopped server times out quickly."""
PATIENT_TIMEOUTS = {"op_timeout_s": "20s", "rpc_timeout_s": "20s", "stream_timeout_s": "20s"}
"""Writers that wait for a stopped server to be continued."""
EXIT_WAIT_S = 10.0
WAIT_S = 15.0
RACED_KEYS = 8
MID_VALUE = bytes(range(256)) * 1200
"""An object of one data block (above the small-object bound, below the block size)."""


def _split_job(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> tuple[ServerSet, ServerInfo, ServerInfo]:
    """Two servers of which one is long-running: PERSIST homes differ from ephemeral ones."""
    servers, persist_home = server_factory("fence-long", "dram", SPLIT_SERVER_BYTES,
                                           long_running=True, weight=0.5)
    _, arbiter = server_factory("fence-short", "dram", SPLIT_SERVER_BYTES, weight=0.5)
    return servers, persist_home, arbiter


def _fenced(pf: Client, arbiter: ServerInfo, bucket: str, key: str) -> bool:
    reply = pf._call(pf._view, arbiter, OP_LOOKUP, 0, bucket.encode(), key.encode())
    return reply.status == 0 and reply.header is not None and reply.header.fence


def _wait_until(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def test_an_ephemeral_put_stores_through_a_fence_whose_persist_store_never_landed(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    servers, persist_home, arbiter = _split_job(server_factory)
    handle = servers.handle()
    with connect(handle, **SHORT_TIMEOUTS) as first:
        first.create_bucket("b")
        key, mid, persisted, other = split_keys(first._view.handle, 4, "split")
        pid = servers.process("fence-long").pid
        os.kill(pid, signal.SIGSTOP)
        try:
            for fenced_key in (key, mid, persisted):
                with pytest.raises(Unavailable):
                    first.put("b", fenced_key, b"persist", persist=True)
                assert _fenced(first, arbiter, "b", fenced_key)
        finally:
            # Never continued: the store it holds dies with it.
            os.kill(pid, signal.SIGKILL)
    wait_exited(pid, timeout_s=EXIT_WAIT_S)
    restarted = ServerAt(
        ServerSpec(node_id="fence-long", tier="dram", capacity_bytes=SPLIT_SERVER_BYTES,
                   secret_file=cluster_secret_file[1], long_running=True, threads=1,
                   metrics=False),
        persist_home.address,
    )
    restarted.start()
    try:
        servers.set_epoch(handle, [persist_home])
        with connect(handle, **PATIENT_TIMEOUTS) as later:
            # A PERSIST put of another key creates the bucket on the restarted server.
            later.put("b", other, b"other", persist=True)
            with pytest.raises(ObjectNotFound):
                later.get("b", key)
            later.put("b", key, b"ephemeral")  # before: ObjectExists, and the key absent
            assert later.get("b", key) == b"ephemeral"
            assert len(records_of(later, "b", key)) == 1
            for persist in (False, True):
                with pytest.raises(ObjectExists):
                    later.put("b", key, b"again", persist=persist)
            assert later.get("b", key, delete=True) == b"ephemeral"
            assert not later.exists("b", key)
            # An object of one data block, which goes up in one trip with its record, too.
            later.put("b", mid, MID_VALUE)
            assert later.get("b", mid) == MID_VALUE
            assert len(records_of(later, "b", mid)) == 1
            with pytest.raises(ObjectExists):
                later.put("b", mid, MID_VALUE)
            # A PERSIST put that finds the fence goes on to its store, which decides the same way.
            later.put("b", persisted, b"persist again", persist=True)
            assert later.get("b", persisted) == b"persist again"
            assert len(records_of(later, "b", persisted)) == 1
            for persist in (False, True):
                with pytest.raises(ObjectExists):
                    later.put("b", persisted, b"third", persist=persist)
    finally:
        restarted.stop()


def test_a_late_persist_store_and_a_put_through_its_fence_have_one_winner(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    """Fenced PERSIST stores wait on a stopped PERSIST home (their writers still waiting, or
    timed out) while other writers store through the fences; once it is continued, exactly one
    writer of each key wins, the key reads as the winner's, and later puts of it are refused.
    The writers that store through the fences hold a session to the PERSIST home already, the
    fencing ones open theirs: so the stores through the fences land first, and a waiting fencing
    writer refused as existing must keep its fence (or a third writer would win as well)."""
    servers, _, arbiter = _split_job(server_factory)
    handle = servers.handle()
    with connect(handle, **PATIENT_TIMEOUTS) as setup:
        setup.create_bucket("b")
        keys = split_keys(setup._view.handle, 2 * RACED_KEYS, "split")
    outcomes: dict[str, list[tuple[str, str]]] = {key: [] for key in keys}

    def put(pf: Client, who: str, key: str, value: bytes, persist: bool) -> None:
        try:
            pf.put("b", key, value, persist=persist)
        except ObjectExists:
            outcomes[key].append((who, "exists"))
        except Unavailable:
            outcomes[key].append((who, "unknown"))
        except Exception as exc:  # noqa: BLE001 - recorded, then asserted absent
            outcomes[key].append((who, repr(exc)))
        else:
            outcomes[key].append((who, "won"))

    with connect(handle, **PATIENT_TIMEOUTS) as fencing, \
            connect(handle, **SHORT_TIMEOUTS) as impatient, \
            connect(handle, **PATIENT_TIMEOUTS) as through:
        # A read of a key absent on its arbiter asks the PERSIST home: a session opens there.
        assert not through.exists("b", keys[0])
        pid = servers.process("fence-long").pid
        os.kill(pid, signal.SIGSTOP)
        threads: list[threading.Thread] = []
        try:
            for n, key in enumerate(keys):
                pf, who = (fencing, "waiting") if n % 2 == 0 else (impatient, "timed-out")
                threads.append(threading.Thread(target=put, args=(pf, who, key, b"persist",
                                                                  True)))
                threads[-1].start()
            _wait_until("every fence is placed",
                        lambda: all(_fenced(through, arbiter, "b", k) for k in keys))
            for key in keys:
                threads.append(threading.Thread(target=put, args=(through, "through", key,
                                                                  b"ephemeral", False)))
                threads[-1].start()
            time.sleep(2.0)  # the impatient writers time out; the others wait
        finally:
            os.kill(pid, signal.SIGCONT)
        for thread in threads:
            thread.join(timeout=WAIT_S * 2)
            assert not thread.is_alive()
        refused_waiting = 0
        for key in keys:
            told = dict(outcomes[key])
            assert set(told.values()) <= {"won", "exists", "unknown"}, outcomes[key]
            value = through.get("b", key)
            assert len(records_of(through, "b", key)) == 1, (key, outcomes[key])
            winners = [who for who, outcome in outcomes[key] if outcome == "won"]
            # Nobody but the winner was told it won, and the winner's value is what reads.
            possible = ["through"] if value == b"ephemeral" else ["waiting"]
            assert winners in ([], possible), (key, outcomes[key], value)
            refused_waiting += told.get("waiting") == "exists"
            for persist in (False, True):
                with pytest.raises(ObjectExists):
                    through.put("b", key, b"again", persist=persist)
        print(f"waiting fencing writers refused as existing: {refused_waiting} of {RACED_KEYS}")
