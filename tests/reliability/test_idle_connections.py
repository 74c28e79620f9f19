"""An HTTP/2 connection that finished its handshake and then asks for nothing is closed after
the server's idle bound (issue 27, defect 1): it answers keepalive pings, so before, it held one
of the HTTP/2 places for as long as it liked. A connection with a stream in flight (a parked
dequeue, a pooled DoExchange session) is not idle, and a client whose idle connection was closed
simply opens a new one.

The server runs with ``--connection-idle 1s``; the raw HTTP/2 peer is written here (the client
preface, an empty SETTINGS frame, the ACK of the server's SETTINGS, answers to its pings).
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

from fixtures_servers import CLIENT_OPTIONS, ServerSet, start_keyed_server

from pocketflow.client import connect
from pocketflow.handle import JobHandle, ServerInfo

IDLE_S = 1.0
CLOSE_BOUND_S = IDLE_S + 9.0
"""The idle connection must be closed by then (slack for a loaded machine)."""
PARKED_S = 3.0
"""A dequeue parked for three idle bounds: its stream keeps its connection."""
CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_SETTINGS, FRAME_PING = 0x4, 0x6
FLAG_ACK = 0x1


def frame(kind: int, flags: int, payload: bytes = b"", stream: int = 0) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(
        ">I", stream) + payload


def hold_idle_http2(address: str, bound_s: float) -> float | None:
    """Open an HTTP/2 connection, finish its handshake, answer the server's frames and ask for
    nothing; the seconds until the server closed it, or ``None`` if it did not by ``bound_s``."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    try:
        opened = time.monotonic()
        sock.sendall(CLIENT_PREFACE + frame(FRAME_SETTINGS, 0))
        buffered = b""
        while time.monotonic() - opened < bound_s:
            sock.settimeout(max(0.05, bound_s - (time.monotonic() - opened)))
            try:
                data = sock.recv(65536)
            except TimeoutError:
                return None
            except ConnectionResetError:
                return time.monotonic() - opened
            if not data:
                return time.monotonic() - opened
            buffered += data
            while len(buffered) >= 9:
                length = int.from_bytes(buffered[:3], "big")
                if len(buffered) < 9 + length:
                    break
                kind, flags = buffered[3], buffered[4]
                payload = buffered[9:9 + length]
                buffered = buffered[9 + length:]
                if kind == FRAME_SETTINGS and not flags & FLAG_ACK:
                    sock.sendall(frame(FRAME_SETTINGS, FLAG_ACK))
                elif kind == FRAME_PING and not flags & FLAG_ACK:
                    sock.sendall(frame(FRAME_PING, FLAG_ACK, payload))
        return None
    finally:
        sock.close()


def test_an_idle_http2_connection_is_closed_and_a_busy_one_kept(
    cluster_secret_file: tuple[bytes, Path], tmp_path: Path
) -> None:
    secret, secret_file = cluster_secret_file
    server = start_keyed_server(secret, None, "--connection-idle", f"{int(IDLE_S * 1000)}ms",
                                node_id="idle-0")
    try:
        servers = ServerSet(secret, secret_file)
        servers.infos.append(ServerInfo("idle-0", server.address, "dram", 1.0, False))
        handle: JobHandle = servers.handle()

        closed_after = hold_idle_http2(server.address, CLOSE_BOUND_S)
        assert closed_after is not None, f"an idle connection was open after {CLOSE_BOUND_S} s"
        assert closed_after >= IDLE_S * 0.9, closed_after

        with connect(handle, small_ops="flight", **CLIENT_OPTIONS) as pf:
            pf.create_bucket("b")
            # A dequeue parked past the idle bound holds a stream: answered, not cut off.
            started = time.monotonic()
            assert pf.queue("b", "q").dequeue(timeout_s=PARKED_S) is None
            assert time.monotonic() - started >= PARKED_S * 0.9
            # Idle past the bound, then used again: the client opens a new connection.
            time.sleep(IDLE_S * 2)
            pf.put("b", "after-idle", b"served")
            assert pf.get("b", "after-idle") == b"served"
    finally:
        server.stop()
