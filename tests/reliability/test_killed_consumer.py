"""A consumer killed while its dequeues are parked takes nothing (issue 27, defect 2).

Each round starts a consumer process that parks one dequeue per queue on a real server
(``dequeue(timeout_s=20)``), each on its own session, waits until the server counts them all
parked, SIGKILLs the consumer by pid, and 50 ms later enqueues one item into every queue. Every
item must still be in its queue: a parked op dies with its session, and an item leaves its queue
only for a consumer that is there to receive it. Before the fix the parked dequeues of a direct
session outlived their client, took the items and sent them nowhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from fixtures_servers import CLIENT_OPTIONS

from pocketflow.client import connect

CONSUMERS_PER_ROUND = 50
"""Parked dequeues per consumer process, one session each (a client takes at most 64)."""
ROUNDS = {"direct": 20, "flight": 2}
"""1,000 killed dequeues on the direct path, where the defect was; a check of the gRPC path."""
PARK_TIMEOUT_S = 60.0
ENQUEUE_AFTER_KILL_S = 0.05

_CONSUMER = """
import sys, threading
from pocketflow.client import connect
from pocketflow.handle import JobHandle

handle = JobHandle.from_json(sys.stdin.readline())
count, prefix, small_ops = int(sys.argv[1]), sys.argv[2], sys.argv[3]
pf = connect(handle, small_ops=small_ops, sessions_per_server=count, op_timeout_s="30s")
def consume(n):
    pf.queue("b", f"{prefix}-{n}").dequeue(timeout_s=20)
    print("consumed", n, flush=True)
for n in range(count):
    threading.Thread(target=consume, args=(n,), daemon=True).start()
print("started", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("small_ops", sorted(ROUNDS))
def test_a_consumer_killed_mid_dequeue_takes_nothing(server_factory, small_ops: str) -> None:  # noqa: ANN001
    servers, info = server_factory("consumers-0", capacity_bytes=32 * 1024 * 1024)
    handle = servers.handle()
    started = time.monotonic()
    lost: list[str] = []
    with connect(handle, **CLIENT_OPTIONS) as producer, servers.admin(info.address) as admin:
        producer.create_bucket("b")
        for round_ in range(ROUNDS[small_ops]):
            prefix = f"r{round_}"
            consumer = subprocess.Popen(
                [sys.executable, "-c", _CONSUMER, str(CONSUMERS_PER_ROUND), prefix, small_ops],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            try:
                assert consumer.stdin is not None and consumer.stdout is not None
                consumer.stdin.write(handle.to_json() + "\n")
                consumer.stdin.flush()
                assert consumer.stdout.readline() == "started\n", consumer.poll()
                deadline = time.monotonic() + PARK_TIMEOUT_S
                while admin.stats()["parked_queue_ops"] < CONSUMERS_PER_ROUND:
                    assert time.monotonic() < deadline, admin.stats()["parked_queue_ops"]
                    assert consumer.poll() is None
                    time.sleep(0.02)
                os.kill(consumer.pid, signal.SIGKILL)
                consumer.wait(timeout=30)
            finally:
                if consumer.poll() is None:
                    consumer.kill()
                    consumer.wait(timeout=30)
            time.sleep(ENQUEUE_AFTER_KILL_S)
            for n in range(CONSUMERS_PER_ROUND):
                producer.queue("b", f"{prefix}-{n}").enqueue(f"{prefix}-{n}".encode())
            for n in range(CONSUMERS_PER_ROUND):
                item = producer.queue("b", f"{prefix}-{n}").dequeue()
                if item != f"{prefix}-{n}".encode():
                    lost.append(f"{prefix}-{n}: {item!r}")
    assert not lost, f"{len(lost)} items taken by killed consumers: {lost[:5]}"
    print(f"{small_ops}: {ROUNDS[small_ops] * CONSUMERS_PER_ROUND} killed dequeues, none took "
          f"an item, in {time.monotonic() - started:.1f} s")
