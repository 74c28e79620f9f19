"""Notifications on real storage servers: every event of a burst in each server's order, an
explicit gap count for a slow subscriber, queue events, and typed errors."""

from __future__ import annotations

import pytest

from pocketflow.client import Client
from pocketflow.errors import InvalidRequest
from pocketflow.notifications import Event

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
