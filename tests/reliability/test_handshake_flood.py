"""Floods that go a little further into the protocol than silence (issue 27, defect 1): 400
connections that send the first 14 bytes of the HTTP/2 preface and then nothing, or that finish
a TLS handshake with ALPN ``h2`` and then say nothing. Before the fix each one was handed to
hyper, whose handshake has no deadline, and held an HTTP/2 place and a listener place: every new
Flight call to the server timed out for as long as they were held.

Now a connection's whole handshake (first bytes, TLS, the HTTP/2 preface and SETTINGS frame,
the direct magic and first message) is bounded by ``HANDSHAKE_TIMEOUT`` (10 s), connections in
their handshake take places of their own pool (``HANDSHAKES_MAX``, 256), never those of served
connections, and one peer address holds at most half of it (the rest are closed as they come).
The flood comes from 127.0.0.2, the real client from 127.0.0.1: the client opens new
connections (a fresh client) round after round while the flood is held, and every round must
succeed; the worst latency it saw is printed. The test opens its hostile connections itself,
bounded in count and time, and closes them at the end.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path

from fixtures_servers import CLIENT_OPTIONS, ServerSet

from pocketflow.client import connect
from pocketflow.handle import JobHandle
from pocketflow.tls import issue_server_cert, make_cluster_ca, read_ca

HOSTILE_CONNECTIONS = 400
HOSTILE_SOURCE = "127.0.0.2"
"""Another peer address than the real client's (127.0.0.1)."""
HANDSHAKE_TIMEOUT_S = 10.0  # servers/crates/flight/src/bounds.rs
HANDSHAKES_MAX = 256  # servers/crates/flight/src/bounds.rs
PEER_HOLDS_MAX = HANDSHAKES_MAX // 2 + 1
"""One peer holds at most half the handshake pool (one more may enter at exactly half)."""
HOLD_S = HANDSHAKE_TIMEOUT_S + 2.0
"""How long the flood is held: past the handshake bound, so its end is seen too."""
ROUND_BOUND_S = 8.0
"""A round of the real client (connect, put, get, close) must end within this (a bound so the
test ends on a loaded machine, not a speed target)."""
CLOSE_SLACK_S = 5.0
PARTIAL_PREFACE = b"PRI * HTTP/2.0"
"""The first 14 bytes of the HTTP/2 client preface."""


def open_hostile(address: str, count: int, after_connect: Callable[[socket.socket], socket.socket]
                 ) -> list[socket.socket]:
    """``count`` connections from HOSTILE_SOURCE to ``address``, each given to ``after_connect``
    (which sends its bytes, or its TLS handshake); those the server closed at once are kept too
    (closed sockets read as closed)."""
    host, port = address.rsplit(":", 1)
    opened = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(5.0)
        sock.bind((HOSTILE_SOURCE, 0))
        try:
            sock.connect((host, int(port)))
            opened.append(after_connect(sock))
        except OSError:
            sock.close()  # refused or closed during its TLS handshake: it holds nothing
    return opened


def still_open(sock: socket.socket) -> bool:
    """Whether the server has not closed ``sock`` yet (without waiting)."""
    try:
        sock.setblocking(False)
        data = sock.recv(1, socket.MSG_PEEK) if not isinstance(sock, ssl.SSLSocket) \
            else sock.recv(1)
        return bool(data)  # b"": closed by the server
    except (BlockingIOError, ssl.SSLWantReadError):
        return True
    except OSError:
        return False


def real_client_rounds(handle: JobHandle, hold_until: float) -> list[float]:
    """Rounds of a fresh client (new connections each time) until ``hold_until``; each round's
    latency. Every round must succeed."""
    latencies = []
    n = 0
    while time.monotonic() < hold_until:
        started = time.monotonic()
        with connect(handle, small_ops="flight", **CLIENT_OPTIONS) as pf:
            if n == 0:
                pf.create_bucket("flood")
            pf.put("flood", f"k{n}", b"still served")
            assert pf.get("flood", f"k{n}", delete=True) == b"still served"
        latency = time.monotonic() - started
        assert latency < ROUND_BOUND_S, f"round {n} took {latency:.2f} s"
        latencies.append(latency)
        n += 1
        time.sleep(0.2)
    return latencies


def hold_flood_and_check(handle: JobHandle, hostile: list[socket.socket], what: str) -> None:
    flooded = time.monotonic()
    try:
        time.sleep(0.5)
        held = sum(still_open(s) for s in hostile)
        # One peer holds at most half the handshake pool; the rest were closed as they came.
        assert held <= PEER_HOLDS_MAX, held
        latencies = real_client_rounds(handle, flooded + HOLD_S)
        assert len(latencies) >= 3
        # The server closed every hostile connection by the handshake bound.
        deadline = flooded + HANDSHAKE_TIMEOUT_S + CLOSE_SLACK_S
        while any(still_open(s) for s in hostile) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = sum(still_open(s) for s in hostile)
        assert left == 0, f"{left} hostile connections still open"
        print(f"{what}: {len(hostile)} hostile connections from {HOSTILE_SOURCE} "
              f"({held} held past the first 0.5 s); {len(latencies)} client rounds, "
              f"worst {max(latencies) * 1000:.0f} ms")
    finally:
        for sock in hostile:
            sock.close()


def test_a_partial_preface_flood_neither_locks_clients_out_nor_stays(
    server_factory,  # noqa: ANN001
) -> None:
    servers, info = server_factory("flood-h2", capacity_bytes=16 * 1024 * 1024)
    handle = servers.handle()

    def partial_preface(sock: socket.socket) -> socket.socket:
        sock.sendall(PARTIAL_PREFACE)
        return sock

    hostile = open_hostile(info.address, HOSTILE_CONNECTIONS, partial_preface)
    hold_flood_and_check(handle, hostile, "partial preface")


def test_a_tls_then_silence_flood_neither_locks_clients_out_nor_stays(
    cluster_secret_file: tuple[bytes, Path], tmp_path: Path
) -> None:
    secret, secret_file = cluster_secret_file
    make_cluster_ca(tmp_path)
    servers = ServerSet(secret, secret_file, tls_ca=read_ca(tmp_path))
    try:
        cert = issue_server_cert(tmp_path, "flood-tls", "127.0.0.1")
        info = servers.start("flood-tls", "dram", 16 * 1024 * 1024, tls=cert)
        handle = servers.handle()
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        context.set_alpn_protocols(["h2"])

        def tls_then_silence(sock: socket.socket) -> socket.socket:
            return context.wrap_socket(sock, server_hostname="127.0.0.1")

        hostile = open_hostile(info.address, HOSTILE_CONNECTIONS, tls_then_silence)
        hold_flood_and_check(handle, hostile, "TLS then silence")
    finally:
        servers.stop_all()
