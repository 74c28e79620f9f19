"""An HTTP/2 connection that finished its handshake and then asks for nothing is closed after
the server's idle bound (issue 27, defect 1): it answers keepalive pings, so before, it held one
of the HTTP/2 places for as long as it liked. A connection with a stream in flight (a parked
dequeue, a pooled DoExchange session) is not idle, and a client whose idle connection was closed
simply opens a new one.

The server runs with ``--connection-idle 1s``; the raw HTTP/2 peer is written here (the client
preface, an empty SETTINGS frame, the ACK of the server's SETTINGS, answers to its pings).

The same bound holds between the transfers of a direct block connection, and a direct
connection's first message is refused from its head when it claims more than a descriptor may
hold (before, the server kept room for up to a whole frame, 8 MiB, of each connection in its
handshake).
"""

from __future__ import annotations

import json
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
FRAME_HEADERS, FRAME_SETTINGS, FRAME_PING = 0x1, 0x4, 0x6
FLAG_ACK, FLAG_END_HEADERS = 0x1, 0x4
REQUEST_START_S = 10.0
"""How long a request stream may send nothing after it opens (``REQUEST_START_TIMEOUT``)."""
SILENT_CLOSE_BOUND_S = REQUEST_START_S + IDLE_S + 14.0
"""A connection whose only stream never sent its body must be closed by then."""
DIRECT_MAGIC = b"PFXCHG01"
DIRECT_OPEN, DIRECT_STATUS, DIRECT_GET, DIRECT_END, DIRECT_READ = 1, 4, 5, 7, 11
REQUEST_MAX_BYTES = 1024 * 1024
"""The longest OPEN, GET, PUT or READ payload a server reads (docs/PROTOCOL.md)."""
BUSY_IDLE_S = 3.0
"""The idle bound of the busy block connection's server: its gaps (``BUSY_GAP_S``) leave
2.5 s of slack each on a loaded machine."""
BUSY_GAP_S = 0.5
BUSY_READS = 9
"""Reads ``BUSY_GAP_S`` apart: the connection is busy for more than the idle bound."""
REFUSAL_BOUND_S = 5.0
"""An over-long first message must be refused by then (the handshake deadline is 10 s)."""


def frame(kind: int, flags: int, payload: bytes = b"", stream: int = 0) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(
        ">I", stream) + payload


def silent_request(address: str, path: str) -> bytes:
    """The HEADERS frame of a gRPC request on stream 1 whose body never comes (no END_STREAM).
    HPACK by hand: indexed :method POST and :scheme http, the rest literal without indexing."""

    def literal(name_index: int, value: str, name: str = "") -> bytes:
        head = bytes([name_index]) if name_index < 15 else bytes([15, name_index - 15])
        if not name_index:
            head += bytes([len(name)]) + name.encode()
        return head + bytes([len(value)]) + value.encode()

    block = (b"\x83\x86" + literal(4, path) + literal(1, address)
             + literal(31, "application/grpc") + literal(0, "trailers", "te"))
    return frame(FRAME_HEADERS, FLAG_END_HEADERS, block, stream=1)


def hold_idle_http2(address: str, bound_s: float, opening: bytes = b"") -> float | None:
    """Open an HTTP/2 connection, finish its handshake (then send ``opening``), answer the
    server's frames and ask for nothing more; the seconds until the server closed it, or ``None``
    if it did not by ``bound_s``."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    try:
        opened = time.monotonic()
        sock.sendall(CLIENT_PREFACE + frame(FRAME_SETTINGS, 0) + opening)
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


def test_a_stream_that_never_sends_its_body_is_ended_and_its_connection_then_idles(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """Before, the stream counted as in flight for as long as the peer kept it open, so its
    connection never reached the idle bound and kept one of the HTTP/2 places."""
    secret, _ = cluster_secret_file
    server = start_keyed_server(secret, None, "--connection-idle", f"{int(IDLE_S * 1000)}ms",
                                node_id="idle-3")
    try:
        request = silent_request(server.address, "/arrow.flight.protocol.FlightService/DoAction")
        closed_after = hold_idle_http2(server.address, SILENT_CLOSE_BOUND_S, request)
        assert closed_after is not None, (
            f"a connection whose stream never sent its body was open after "
            f"{SILENT_CLOSE_BOUND_S} s")
        assert closed_after >= REQUEST_START_S * 0.9, closed_after
    finally:
        server.stop()


def direct_message(sock: socket.socket) -> tuple[int, bytes] | None:
    """One direct message (kind, payload); ``None`` if the server closed the connection."""
    data = b""
    while len(data) < 5:
        chunk = sock.recv(5 - len(data))
        if not chunk:
            return None
        data += chunk
    kind, length = struct.unpack("<BI", data)
    payload = b""
    while len(payload) < length:
        chunk = sock.recv(length - len(payload))
        assert chunk, "closed inside a message"
        payload += chunk
    return kind, payload


def closed_within(sock: socket.socket, bound_s: float) -> float | None:
    """Seconds until the server closed ``sock`` (sending nothing), ``None`` if not by then."""
    opened = time.monotonic()
    sock.settimeout(bound_s)
    try:
        data = sock.recv(1)
    except TimeoutError:
        return None
    except ConnectionResetError:
        return time.monotonic() - opened
    assert data == b"", f"the server sent {data!r} on an idle connection"
    return time.monotonic() - opened


def direct_read(sock: socket.socket, ticket: bytes) -> list[int]:
    """Send one READ on a direct block connection; the kinds of its answer, up to its END."""
    sock.sendall(struct.pack("<BI", DIRECT_READ, len(ticket)) + ticket)
    kinds: list[int] = []
    while not kinds or kinds[-1] != DIRECT_END:
        message = direct_message(sock)
        assert message is not None, f"closed after {kinds}"
        assert message[0] != DIRECT_STATUS, message
        kinds.append(message[0])
    return kinds


def read_ticket(handle: JobHandle, bucket: str, key: str) -> bytes:
    return json.dumps({"ctx": handle.context(), "bucket": bucket, "key": key,
                       "inline_bytes_max": 1024}).encode()


def test_an_idle_direct_block_connection_is_closed_between_transfers(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    secret, secret_file = cluster_secret_file
    server = start_keyed_server(secret, None, "--connection-idle", f"{int(IDLE_S * 1000)}ms",
                                node_id="idle-1")
    try:
        servers = ServerSet(secret, secret_file)
        servers.infos.append(ServerInfo("idle-1", server.address, "dram", 1.0, False))
        handle = servers.handle()
        with connect(handle, **CLIENT_OPTIONS) as pf:
            pf.create_bucket("b")
            pf.put("b", "k", b"read over a block connection")
            host, port = server.address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(DIRECT_MAGIC)
                direct_read(sock, read_ticket(handle, "b", "k"))
                # The transfer is done; the connection asks for nothing more.
                closed_after = closed_within(sock, CLOSE_BOUND_S)
            assert closed_after is not None, (
                f"an idle block connection was open {CLOSE_BOUND_S} s after its transfer")
            assert closed_after >= IDLE_S * 0.9, closed_after
            # The client's own pooled connections were closed the same way: it replaces them.
            time.sleep(IDLE_S * 2)
            assert pf.get("b", "k") == b"read over a block connection"
    finally:
        server.stop()


def test_a_busy_direct_block_connection_outlives_the_idle_bound_then_closes_when_idle(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """The idle bound counts from a connection's last transfer, not from its first: the server
    keeps one idle timer per block connection and moves it on at every request."""
    secret, secret_file = cluster_secret_file
    server = start_keyed_server(secret, None, "--connection-idle",
                                f"{int(BUSY_IDLE_S * 1000)}ms", node_id="idle-3")
    try:
        servers = ServerSet(secret, secret_file)
        servers.infos.append(ServerInfo("idle-3", server.address, "dram", 1.0, False))
        handle = servers.handle()
        with connect(handle, **CLIENT_OPTIONS) as pf:
            pf.create_bucket("b")
            pf.put("b", "k", b"read again and again")
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(DIRECT_MAGIC)
            opened = time.monotonic()
            for _ in range(BUSY_READS):
                assert direct_read(sock, read_ticket(handle, "b", "k"))[-1] == DIRECT_END
                time.sleep(BUSY_GAP_S)
            busy_s = time.monotonic() - opened
            assert busy_s > BUSY_IDLE_S, busy_s
            closed_after = closed_within(sock, BUSY_IDLE_S + CLOSE_BOUND_S)
        assert closed_after is not None, "a busy block connection was never closed once idle"
        # Its last gap counts towards the bound.
        assert closed_after >= BUSY_IDLE_S * 0.9 - BUSY_GAP_S, closed_after
    finally:
        server.stop()


def test_a_first_direct_message_longer_than_a_descriptor_is_refused_from_its_head(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    secret, _ = cluster_secret_file
    server = start_keyed_server(secret, None, node_id="idle-2")
    try:
        host, port = server.address.rsplit(":", 1)
        for kind in (DIRECT_OPEN, DIRECT_GET, DIRECT_READ):
            with socket.create_connection((host, int(port)), timeout=REFUSAL_BOUND_S) as sock:
                # The head claims two descriptors' worth; no payload byte follows.
                sock.sendall(DIRECT_MAGIC + struct.pack("<BI", kind, 2 * REQUEST_MAX_BYTES))
                started = time.monotonic()
                try:
                    message = direct_message(sock)
                except TimeoutError:
                    message = None
                assert message is not None, (
                    f"kind {kind}: no refusal within {REFUSAL_BOUND_S} s "
                    f"({time.monotonic() - started:.1f} s)")
                status, text = message
                assert status == DIRECT_STATUS, message
                assert text[0] == 3 and b"over the bound" in text, text  # INVALID_ARGUMENT
    finally:
        server.stop()
