"""A flood of TCP connections that never send a byte (no token needed to open one) must neither
lock real clients out nor stay open forever (issue 12, item 1, server side).

The server looks at each new connection's first bytes before it counts as HTTP/2 or as a direct
session (`servers/crates/flight/src/route.rs`); one that has not finished its handshake within
`HANDSHAKE_TIMEOUT` (10 s) is closed, and one peer address holds at most half of the
`HANDSHAKES_MAX` (256) connections in their handshake (the rest are closed as they come). The
silent connections come from 127.0.0.2, the real client from 127.0.0.1. The test opens its idle
connections itself, bounded in count and time, and closes them at the end.
"""

from __future__ import annotations

import socket
import time

from fixtures_servers import ServerSet

from pocketflow.handle import JobHandle
from pocketflow.protocol import OP_GET, OP_PUT, action_body, exchange_descriptor, small_header
from pocketflow.transport import ServerConnection

IDLE_CONNECTIONS = 200
"""Well over the 128 that locked a server out before."""
OPEN_TIMEOUT_S = 10.0
"""`HANDSHAKE_TIMEOUT` of the server."""
SILENT_SOURCE = "127.0.0.2"
"""Another peer address than the real client's."""


def test_silent_connections_neither_lock_clients_out_nor_stay_open(
    storage_servers: ServerSet, job_handle: JobHandle
) -> None:
    address = job_handle.servers[0].address
    host, port = address.rsplit(":", 1)
    idle: list[socket.socket] = []
    try:
        for _ in range(IDLE_CONNECTIONS):
            idle.append(socket.create_connection((host, int(port)), timeout=5,
                                                 source_address=(SILENT_SOURCE, 0)))
        opened = time.monotonic()

        # A real client still gets in, over both protocols, while the flood holds its sockets.
        command = exchange_descriptor(job_handle.context())
        header = small_header(4, 2, persist=False).encode()
        for direct in (True, False):
            connection = ServerConnection(address, exchange_command=lambda: command,
                                          direct=direct, op_timeout_s=5.0,
                                          first_reply_timeout_s=5.0)
            try:
                started = time.monotonic()
                if direct:
                    connection.action("create_bucket",
                                      action_body(job_handle.context(), bucket="flood"))
                key = b"direct" if direct else b"flight"
                put = connection.call(job_handle.epoch, OP_PUT, 0, b"flood", key, header, b"ok")
                assert put.status == 0
                got = connection.call(job_handle.epoch, OP_GET, 0, b"flood", key)
                assert bytes(got.body) == b"ok"
                assert time.monotonic() - started < 5.0
            finally:
                connection.close()

        # The server closes every silent connection after the open bound.
        deadline = opened + OPEN_TIMEOUT_S + 10.0
        for sock in idle:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                assert sock.recv(1) == b"", "a silent connection got bytes"
            except ConnectionResetError:
                pass
        assert time.monotonic() < deadline + 1.0
    finally:
        for sock in idle:
            sock.close()
