"""A server's bound on DoExchange sessions (256, shared by every client) against client pools.

Other processes hold all but a few of a private server's sessions; a client whose pool would open
more shares the sessions it got instead of failing, and a client that gets none has a typed error.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fixtures_servers import CLIENT_OPTIONS

from pocketflow.client import connect
from pocketflow.errors import CapacityExhausted

EXCHANGE_SESSIONS_MAX = 256  # servers/crates/flight/src/bounds.rs
SESSIONS_PER_HOLDER_MAX = 127  # under the 128 streams the server allows one connection
HOLDER_START_TIMEOUT_S = 60

# Opens N sessions to the handle's only server, makes each answer once (so the server holds
# it), prints "held" and keeps them until stdin closes.
_HOLDER = """
import sys
from pocketflow.handle import JobHandle
from pocketflow.protocol import OP_GET, exchange_descriptor
from pocketflow.transport import ServerConnection

handle, count = JobHandle.from_json(sys.stdin.readline()), int(sys.argv[1])
command = exchange_descriptor(handle.context())
connection = ServerConnection(handle.servers[0].address, exchange_command=lambda: command,
                              sessions_max=count)
assert connection.warm(count) == count
reply = connection.call(handle.epoch, OP_GET, 0, b"b", b"missing")
assert reply.status == 5, reply
print("held", flush=True)
sys.stdin.read()
"""


@contextmanager
def sessions_held(handle_json: str, count: int) -> Iterator[None]:
    """Other processes hold ``count`` sessions of the server until the block ends."""
    holders: list[subprocess.Popen[str]] = []
    try:
        left = count
        while left:
            n = min(left, SESSIONS_PER_HOLDER_MAX)
            holder = subprocess.Popen(
                [sys.executable, "-c", _HOLDER, str(n)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True,
            )
            holders.append(holder)
            assert holder.stdin is not None and holder.stdout is not None
            holder.stdin.write(handle_json + "\n")
            holder.stdin.flush()
            left -= n
        for holder in holders:
            assert holder.stdout is not None
            line = _readline(holder, HOLDER_START_TIMEOUT_S)
            assert line == "held\n", (line, holder.poll())
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
    handle = servers.handle()
    with connect(handle, **CLIENT_OPTIONS) as setup:
        setup.create_bucket("b")
    with sessions_held(handle.to_json(), EXCHANGE_SESSIONS_MAX - 1):
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
        with sessions_held(handle.to_json(), 1), connect(handle, **CLIENT_OPTIONS) as starved:
            with pytest.raises(CapacityExhausted):
                starved.lookup("b", "t0-0-0")
            assert starved.get("b", "t0-0-0") == b"x" * 1024
