"""Raw loopback TCP: a sink/source server and its client, the machine's transport ceiling.

The server stores nothing. A PUT sends a header and the bytes, which the server reads into a
scratch buffer and acknowledges with one byte; a GET sends a header and the server answers with
that many bytes from a buffer of random bytes filled at start. So a round trip costs exactly
what the kernel's loopback path and one Python process on each side cost, which is what every
storage peer pays at least.

Run as ``python -m benchmarks.tcp --object-max-bytes N --parent-pid PID``; the server prints
``TCP_PEER_READY host:port`` when it listens, and exits on SIGTERM, when its parent is gone, or
after ``--lifetime-s``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence

READY_PREFIX = "TCP_PEER_READY "
HEADER = struct.Struct("<B7xQ")
"""Request header: op (1 PUT, 2 GET), 7 zero bytes, payload length."""

OP_PUT = 1
OP_GET = 2
ACK = b"\x00"

CONNECTIONS_MAX = 64
"""Most client connections the server serves at once; more wait in the listen backlog."""

SCRATCH_BYTES = 4 * 1024 * 1024
"""Size of each connection's receive buffer for PUT bytes."""

BATCH_OPS_MAX = 4096
"""Most operations one pipelined client call sends before reading replies."""

SOCKET_TIMEOUT_S = 60.0
"""Deadline of every blocking socket call of the client."""

IDLE_TIMEOUT_S = 30 * 60.0
"""Deadline of every blocking socket call of the server, the wait for a client's next request
included: longer than a connection idles in the side-by-side runner, whose clients keep their
connections while the other peers take their rounds of a cell (over a minute for the 64 KiB cells
of a full run, which a 60 s deadline cut). The parent check and the lifetime still end the
server."""

LIFETIME_S_DEFAULT = 3600.0
"""The server exits by itself after this long."""

PARENT_POLL_S = 0.5


def _recv_exact(sock: socket.socket, buffer: memoryview) -> None:
    """Fill ``buffer`` from ``sock``; raises ``ConnectionError`` on EOF."""
    filled = 0
    while filled < len(buffer):
        n = sock.recv_into(buffer[filled:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        filled += n


# -- server -------------------------------------------------------------------------------------


def _serve_connection(sock: socket.socket, source: memoryview, slots: threading.Semaphore) -> None:
    """Answer one connection's requests, pipelined: every complete request in what one receive
    brought is answered, then the replies go out together."""
    scratch = bytearray(SCRATCH_BYTES)
    view = memoryview(scratch)
    end = 0  # bytes of scratch holding not yet parsed input
    body_left = 0  # bytes of the current PUT's payload still to drop
    try:
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(IDLE_TIMEOUT_S)
            while True:
                try:
                    received = sock.recv_into(view[end:])
                except OSError:
                    return
                if received == 0:
                    return
                end += received
                pos = 0
                replies: list[bytes | memoryview] = []
                while True:
                    if body_left:
                        take = min(body_left, end - pos)
                        pos += take
                        body_left -= take
                        if body_left:
                            break
                        replies.append(ACK)
                        continue
                    if end - pos < HEADER.size:
                        break
                    op, length = HEADER.unpack_from(scratch, pos)
                    pos += HEADER.size
                    if op == OP_PUT:
                        body_left = length
                        if not length:
                            replies.append(ACK)
                    elif op == OP_GET and length <= len(source):
                        replies.append(source[:length])
                    else:
                        return  # a malformed request ends the connection
                view[: end - pos] = view[pos:end]  # keep a partial header for the next receive
                end -= pos
                _send_replies(sock, replies)
    finally:
        slots.release()


def _send_replies(sock: socket.socket, replies: list[bytes | memoryview]) -> None:
    if not replies:
        return
    if sum(len(r) for r in replies) <= SCRATCH_BYTES // 4:
        sock.sendall(b"".join(replies))
        return
    for reply in replies:
        sock.sendall(reply)


def serve(*, object_max_bytes: int, parent_pid: int | None, lifetime_s: float) -> None:
    """Listen on 127.0.0.1, print the ready line, serve until stopped (see module doc)."""
    source = memoryview(os.urandom(object_max_bytes))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(CONNECTIONS_MAX)
    listener.settimeout(PARENT_POLL_S)
    host, port = listener.getsockname()
    print(f"{READY_PREFIX}{host}:{port}", flush=True)
    slots = threading.Semaphore(CONNECTIONS_MAX)
    deadline = time.monotonic() + lifetime_s
    while time.monotonic() < deadline:
        if parent_pid is not None and os.getppid() != parent_pid:
            return
        if not slots.acquire(timeout=PARENT_POLL_S):
            continue
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            slots.release()
            continue
        threading.Thread(
            target=_serve_connection, args=(conn, source, slots), daemon=True
        ).start()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.tcp``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--object-max-bytes", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--lifetime-s", type=float, default=LIFETIME_S_DEFAULT)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve(
        object_max_bytes=args.object_max_bytes,
        parent_pid=args.parent_pid,
        lifetime_s=args.lifetime_s,
    )
    return 0


# -- client -------------------------------------------------------------------------------------


class TcpClient:
    """One connection to the TCP sink/source server."""

    def __init__(self, host: str, port: int) -> None:
        self._sock = socket.create_connection((host, port), timeout=SOCKET_TIMEOUT_S)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ack = memoryview(bytearray(BATCH_OPS_MAX))

    def put(self, data: bytes | memoryview) -> None:
        """Send ``data`` and wait for the server's acknowledgement."""
        header = HEADER.pack(OP_PUT, len(data))
        if len(data) <= SCRATCH_BYTES // 64:
            self._sock.sendall(header + bytes(data))
        else:
            self._sock.sendall(header)
            self._sock.sendall(data)
        _recv_exact(self._sock, self._ack[:1])

    def get(self, length: int) -> bytearray:
        """Receive ``length`` bytes from the server."""
        self._sock.sendall(HEADER.pack(OP_GET, length))
        buffer = bytearray(length)
        _recv_exact(self._sock, memoryview(buffer))
        return buffer

    def put_many(self, payloads: Sequence[bytes | memoryview]) -> None:
        """Send every payload, then read all acknowledgements (one pipelined batch)."""
        if len(payloads) > BATCH_OPS_MAX:
            raise ValueError(f"at most {BATCH_OPS_MAX} operations per batch")
        frames = b"".join(HEADER.pack(OP_PUT, len(p)) + bytes(p) for p in payloads)
        self._sock.sendall(frames)
        _recv_exact(self._sock, self._ack[: len(payloads)])

    def get_many(self, lengths: Sequence[int]) -> list[memoryview]:
        """Send every request, then read all replies into one buffer (one pipelined batch)."""
        if len(lengths) > BATCH_OPS_MAX:
            raise ValueError(f"at most {BATCH_OPS_MAX} operations per batch")
        self._sock.sendall(b"".join(HEADER.pack(OP_GET, n) for n in lengths))
        buffer = memoryview(bytearray(sum(lengths)))
        _recv_exact(self._sock, buffer)
        out = []
        offset = 0
        for length in lengths:
            out.append(buffer[offset : offset + length])
            offset += length
        return out

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()


if __name__ == "__main__":
    sys.exit(main())
