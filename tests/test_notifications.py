"""Notifications on real storage servers: every event of a burst in each server's order, an
explicit gap count for a slow subscriber, queue events, and typed errors."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
from fixtures_servers import CLIENT_OPTIONS, ServerSet

from pocketflow.client import Client, connect
from pocketflow.errors import InvalidRequest
from pocketflow.handle import ServerInfo
from pocketflow.notifications import DROPPED_UNKNOWN, Event
from pocketflow.placement import Placement
from pocketflow.protocol import ACTION_EVENTS, ACTION_SUBSCRIBE, action_body

BURST = 300


def _drain(listener, *, expected: int, timeout_s: float = 10.0) -> list[Event]:
    """Events until ``expected`` operations (gaps count their losses) or nothing for 1 s."""
    got: list[Event] = []
    seen = 0
    while seen < expected:
        event = listener.get(timeout_s=timeout_s if not got else 1.0)
        if event is None:
            break
        got.append(event)
        seen += event.dropped if event.op == "gap" else 1
    return got


def test_a_subscriber_sees_every_event_of_a_burst_in_server_order(client: Client) -> None:
    client.create_bucket("n")
    with client.subscribe("n", "map/", ops=("put", "delete")) as listener:
        for i in range(BURST):
            client.put("n", f"map/{i}", b"x")
            client.put("n", f"other/{i}", b"x")  # another prefix: not reported
        for i in range(0, BURST, 3):
            client.delete("n", f"map/{i}")
        deletes = len(range(0, BURST, 3))
        events = _drain(listener, expected=BURST + deletes)
        assert listener.get(timeout_s=0.3) is None, "more events than operations"
    assert not [e for e in events if e.op == "gap"]
    puts = [e.key for e in events if e.op == "put"]
    assert sorted(puts) == sorted(f"map/{i}" for i in range(BURST))
    assert sorted(e.key for e in events if e.op == "delete") == sorted(
        f"map/{i}" for i in range(0, BURST, 3))
    for server in {e.server for e in events}:
        seqs = [e.seq for e in events if e.server == server]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        # Per server, a key's put comes before its delete.
        order = [(e.op, e.key) for e in events if e.server == server]
        for op, key in order:
            if op == "delete":
                assert order.index(("put", key)) < order.index(("delete", key))


def test_a_slow_subscriber_is_told_how_many_events_it_lost(client: Client) -> None:
    client.create_bucket("n")
    with client.subscribe("n", "", ops=("put",), capacity=16) as listener:
        client.put_many("n", [(f"k{i}", b"v") for i in range(BURST)])
        events = _drain(listener, expected=BURST)
    gaps = [e for e in events if e.op == "gap"]
    assert gaps, "a subscriber that kept 16 of 300 events was not told of a gap"
    assert sum(e.dropped for e in gaps) + sum(1 for e in events if e.op == "put") == BURST
    kept = [e.key for e in events if e.op == "put"]
    assert len(kept) == len(set(kept))


def test_queue_operations_are_events_and_bad_subscriptions_are_refused(client: Client) -> None:
    client.create_bucket("n")
    with client.subscribe("n", "jobs", ops=("enqueue", "dequeue")) as listener:
        queue = client.queue("n", "jobs", max_items=8)
        queue.enqueue(b"a")
        queue.enqueue(b"b")
        assert queue.dequeue() == b"a"
        events = _drain(listener, expected=3)
    assert [(e.op, e.key) for e in events] == [
        ("enqueue", "jobs"), ("enqueue", "jobs"), ("dequeue", "jobs")]
    with pytest.raises(InvalidRequest):
        client.subscribe("n", "", ops=("rename",))
    with pytest.raises(InvalidRequest):
        client.subscribe("n", "", ops=("put",), capacity=0)


def _events_until(listener, done, timeout_s: float = 20.0) -> list[Event]:  # noqa: ANN001
    """Events until ``done(events)`` holds, or ``timeout_s`` passed."""
    got: list[Event] = []
    deadline = time.monotonic() + timeout_s
    while not done(got) and time.monotonic() < deadline:
        event = listener.get(timeout_s=0.5)
        if event is not None:
            got.append(event)
    return got


def test_a_listener_follows_a_server_that_joined_the_map_and_says_what_it_missed(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    """Issue 28, item 4: a server added to the job's map after ``subscribe`` is subscribed once
    the client sees the map, with a gap of unknown size naming it; its events then come (before:
    none, and no gap)."""
    for node in ("join-0", "join-1", "join-2"):
        servers, _ = server_factory(node, capacity_bytes=16 * 1024 * 1024)
    first, joined = servers.infos[:2], servers.infos[2]
    handle = servers.handle(servers=first)
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("n")
        with pf.subscribe("n", "", ops=("put",)) as listener:
            grown = handle.with_weight_map({"epoch": 2,
                                            "servers": [s.to_row() for s in servers.infos]})
            servers.set_epoch(grown)
            pf.update_handle(grown)
            placement = Placement.of_handle(grown)
            keys = [k for k in (f"j{i}" for i in range(200))
                    if placement.server_for(k.encode()).node_id == joined.node_id][:10]
            got = _events_until(listener, lambda ev: any(
                e.op == "gap" and e.server == joined.address for e in ev))
            assert any(e.op == "gap" and e.dropped == DROPPED_UNKNOWN
                       and e.server == joined.address for e in got), got
            pf.put_many("n", [(key, b"v") for key in keys])
            got = _events_until(listener, lambda ev: len(
                {e.key for e in ev if e.op == "put" and e.server == joined.address}) == len(keys))
            assert {e.key for e in got if e.server == joined.address} == set(keys)


def test_kept_events_whose_reply_was_lost_come_again_until_confirmed(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    """The ``events`` call the listener makes (``keep``): a reply that never reached its caller
    (here: read and thrown away, as a call that timed out while its server was paused is answered
    to nobody) loses no event; the next call returns them again until ``acked`` confirms them.
    Without ``keep`` a call takes what it returns. Through a real server's JSON actions (the CI
    run on 52db806 lost 4 of 5 events in the SIGSTOP test below: polls drained the events into
    replies nobody read)."""
    servers, info = server_factory("keep-0", capacity_bytes=16 * 1024 * 1024)
    with connect(servers.handle(), **CLIENT_OPTIONS) as pf:
        pf.create_bucket("n")
        connection = pf._connection(info.address)
        ctx = pf._view.ctx
        sub = int(connection.action(ACTION_SUBSCRIBE, action_body(
            ctx, bucket="n", prefix="", ops=["put"], capacity=16))["subscription"])

        def keys(**fields: object) -> list[tuple[str, int]]:
            result = connection.action(ACTION_EVENTS, action_body(
                ctx, subscription=sub, timeout_ms=0, **fields))
            return [(e["key"], int(e["seq"])) for e in result["events"]]

        for i in range(3):
            pf.put("n", f"k{i}", b"v")
        assert [k for k, _ in keys(keep=True, max=2)] == ["k0", "k1"]  # its reply "lost"
        again = keys(keep=True)
        assert [k for k, _ in again] == ["k0", "k1", "k2"]
        assert [k for k, _ in keys(keep=True, acked=again[1][1])] == ["k2"]
        assert keys(keep=True, acked=again[2][1]) == []
        pf.put("n", "k3", b"v")
        assert [k for k, _ in keys()] == ["k3"]
        assert keys() == []


def test_a_server_that_stops_answering_for_a_while_does_not_end_its_events(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    """Issue 28, item 4: a transient failure of one server's event stream (SIGSTOPped past the
    client's timeouts) is retried; once it answers its events come again, and ``get`` raises
    nothing (before: the stream ended for good with DataUnavailable)."""
    servers, info = server_factory("pause-0", capacity_bytes=16 * 1024 * 1024)
    handle = servers.handle()
    options = {"op_timeout_s": "3s", "rpc_timeout_s": "3s", "connect_timeout_s": "3s"}
    with connect(handle, **options) as pf:
        pf.create_bucket("n")
        with pf.subscribe("n", "", ops=("put",)) as listener:
            pid = servers.process(info.node_id).pid
            os.kill(pid, signal.SIGSTOP)
            try:
                # Past one rpc timeout of a parked events call, without raising.
                assert _events_until(listener, lambda ev: False, timeout_s=5.0) == []
            finally:
                os.kill(pid, signal.SIGCONT)
            pf.put_many("n", [(f"p{i}", b"v") for i in range(5)])
            got = _events_until(listener, lambda ev: len(ev) == 5)
            assert sorted(e.key for e in got) == [f"p{i}" for i in range(5)]
