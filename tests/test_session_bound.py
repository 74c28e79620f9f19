"""A server's bound on DoExchange sessions (256, shared by every client) against client pools.

Other processes hold all but a few of a private server's sessions; a client whose pool would open
more shares the sessions it got instead of failing, and a client that gets none has a typed error.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fixtures_servers import CLIENT_OPTIONS

from pocketflow.client import connect
from pocketflow.errors import CapacityExhausted, PocketflowError

EXCHANGE_SESSIONS_MAX = 256  # servers/crates/flight/src/bounds.rs
SESSIONS_PER_HOLDER_MAX = 64  # the most sessions_per_server a client takes
HOLDER_START_TIMEOUT_S = 60

HELD_WAIT_S = 2.0
"""How long each of a holder's dequeues parks on its empty queue before the next one."""

# Holds N sessions of the handle's only server through the public API: N threads each park a
# dequeue on an empty queue, again and again, so the client's pool opens a session per thread and
# keeps them all open. Prints "started", and stops once stdin closes.
_HOLDER = """
import sys, threading
from pocketflow.client import connect
from pocketflow.handle import JobHandle

handle, count = JobHandle.from_json(sys.stdin.readline()), int(sys.argv[1])
stop = threading.Event()
with connect(handle, sessions_per_server=count, op_timeout_s="30s") as pf:
    def hold(n):
        queue = pf.queue("b", f"held-{n}")
        while not stop.is_set():
            queue.dequeue(timeout_s=float(sys.argv[2]))
    threads = [threading.Thread(target=hold, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    print("started", flush=True)
    sys.stdin.read()
    stop.set()
    for thread in threads:
        thread.join()
"""


def open_sessions(metrics_url: str) -> int:
    """The server's gauge of open exchange sessions (DoExchange and direct)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        # `pocketflow_sessions{node_id="...",tier="..."} 12`
        if line.startswith(("pocketflow_sessions ", "pocketflow_sessions{")):
            return int(float(line.rsplit(None, 1)[1]))
    raise AssertionError("the server's metrics have no pocketflow_sessions gauge")


@contextmanager
def sessions_held(handle_json: str, count: int, *, metrics_url: str, total: int) -> Iterator[None]:
    """Other processes hold ``count`` sessions of the server until the block ends; the block
    starts once the server counts ``total`` open sessions."""
    holders: list[subprocess.Popen[str]] = []
    try:
        left = count
        while left:
            n = min(left, SESSIONS_PER_HOLDER_MAX)
            holder = subprocess.Popen(
                [sys.executable, "-c", _HOLDER, str(n), str(HELD_WAIT_S)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            holders.append(holder)
            assert holder.stdin is not None and holder.stdout is not None
            holder.stdin.write(handle_json + "\n")
            holder.stdin.flush()
            left -= n
        for holder in holders:
            assert holder.stdout is not None
            line = _readline(holder, HOLDER_START_TIMEOUT_S)
            assert line == "started\n", (line, holder.poll())
        deadline = time.monotonic() + HOLDER_START_TIMEOUT_S
        while (held := open_sessions(metrics_url)) < total:
            assert time.monotonic() < deadline, f"only {held} of {total} sessions open"
            assert all(holder.poll() is None for holder in holders)
            time.sleep(0.2)
        yield
    finally:
        for holder in holders:
            if holder.stdin is not None:
                holder.stdin.close()
        for holder in holders:
            try:
                holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait(timeout=30)


def _readline(process: subprocess.Popen[str], timeout_s: float) -> str:
    """One line of ``process``'s stdout, or "" after ``timeout_s``."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return line[0] if line else ""


def test_a_pool_refused_by_the_server_shares_the_sessions_it_has(server_factory) -> None:  # noqa: ANN001
    servers, _ = server_factory("sessions-0", capacity_bytes=64 * 1024 * 1024)
    metrics_url = servers.process("sessions-0").metrics_url
    assert metrics_url is not None
    handle = servers.handle()
    with connect(handle, **CLIENT_OPTIONS) as setup:
        setup.create_bucket("b")
    held = EXCHANGE_SESSIONS_MAX - 1
    with sessions_held(handle.to_json(), held, metrics_url=metrics_url, total=held):
        # One session is left; four threads each want their own and run long pipelines.
        with connect(handle, sessions_per_server=8, **CLIENT_OPTIONS) as pf:
            start = threading.Barrier(4)
            errors: list[BaseException] = []

            def writer(t: int) -> None:
                start.wait(timeout=30)
                try:
                    for round_ in range(3):
                        pf.put_many("b", [(f"t{t}-{round_}-{i}", b"x" * 1024)
                                          for i in range(2000)])
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            assert not any(thread.is_alive() for thread in threads)
            assert errors == []
            keys = pf.list("b")
            assert len(keys) == 4 * 3 * 2000

        # With every session held by others, a new client gets a typed error, not a hang. A get
        # needs no session (a direct READ on a block connection); a lookup does.
        with sessions_held(handle.to_json(), 1, metrics_url=metrics_url,
                           total=EXCHANGE_SESSIONS_MAX), \
                connect(handle, **CLIENT_OPTIONS) as starved:
            with pytest.raises(CapacityExhausted):
                starved.lookup("b", "t0-0-0")
            assert starved.get("b", "t0-0-0") == b"x" * 1024


def test_a_client_whose_own_calls_hold_every_session_is_busy_not_the_server(
    server_factory,  # noqa: ANN001
) -> None:
    """One session per server, held by a dequeue parked on an empty queue on one thread: a
    lookup on another thread waits for the session, then fails as ClientBusy (the client is
    overloaded), never as DataUnavailable, which would say the server is gone (issue 28, item 7).
    A parked dequeue holds its session for as long as it parks whatever the machine's speed (a
    long batch of small ops did not: on a quiet machine it let the lookup in between its ops)."""
    from pocketflow.errors import ClientBusy, DataUnavailable

    servers, _ = server_factory("busy-0", capacity_bytes=64 * 1024 * 1024)
    handle = servers.handle()
    options = dict(CLIENT_OPTIONS, op_timeout_s="0.3s", rpc_timeout_s="0.3s",
                   connect_timeout_s="0.3s")
    with connect(handle, sessions_per_server=1, exchange_window=1, **options) as pf:
        pf.create_bucket("b")
        pf.put("b", "hold-0", b"x")
        holding = threading.Event()
        done = threading.Event()
        held: list[str] = []

        def hold() -> None:
            # The only session parks on the server for HELD_WAIT_S at a time, far longer than
            # the 0.3 s another call waits for it.
            queue = pf.queue("b", "held")
            holding.set()
            while not done.is_set():
                try:
                    queue.dequeue(timeout_s=HELD_WAIT_S)
                except PocketflowError as exc:  # a holder waiting for the other may be busy
                    held.append(f"{type(exc).__name__}: {exc}")

        # Two holders, so that while one is between two dequeues the other is parked or waiting.
        holders = [threading.Thread(target=hold) for _ in range(2)]
        for holder in holders:
            holder.start()
        try:
            holding.wait(10)
            raised: list[BaseException] = []
            others: list[str] = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                time.sleep(0.05)
                try:
                    pf.lookup("b", "hold-0")
                except ClientBusy as exc:
                    raised.append(exc)
                    break
                except DataUnavailable as exc:
                    pytest.fail(f"a busy client reported its server unavailable: {exc}")
                except PocketflowError as exc:
                    others.append(f"{type(exc).__name__}: {exc}")
                else:
                    others.append("answered")
            assert raised, ("the holders never kept the session past a whole wait",
                            others[-5:], held[-3:])
        finally:
            done.set()
            for holder in holders:
                holder.join(timeout=120)
