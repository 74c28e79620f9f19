"""Connections to storage servers: pipelined DoExchange sessions, DoPut/DoGet of blocks, actions.

One :class:`ServerConnection` per server and client holds a ``pyarrow.flight.FlightClient`` (one
gRPC channel, one HTTP/2 connection) and a small pool of DoExchange sessions. A session is used by
one thread at a time, so the thread that sends a frame also reads its replies: a single small
operation costs one write and one read, with no thread hop. Many operations share frames and keep
up to ``exchange_window`` in flight (:meth:`ExchangeSession.run`).

Every wait is bounded: actions and data streams carry a gRPC deadline, and a :class:`Watchdog`
thread cancels a session whose reply is overdue, so a dead or hung server surfaces as
:class:`~pocketflow.errors.DataUnavailable` and never as a hang.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pyarrow as pa
import pyarrow.flight as flight

from pocketflow.errors import (
    CapacityExhausted,
    DataUnavailable,
    InternalError,
    InvalidRequest,
    PocketflowError,
    error_from_flight,
)
from pocketflow.protocol import (
    ACTION_DELETE_JOB,
    ACTION_DRAIN,
    ACTION_SET_CORES,
    ACTION_SET_EPOCH,
    ACTION_STATS,
    ADMIN_JOB_ID,
    BATCH_MAX_BYTES,
    DATA_COLUMN_NAME,
    FRAME_HEADER_LEN_BYTES,
    FRAME_HEADER_STRUCT,
    FRAME_MAX_BYTES,
    FRAME_OPS_MAX,
    FRAME_VERSION,
    MESSAGE_MAX_BYTES,
    OP_FIXED_LEN_BYTES,
    OP_STRUCT,
    SESSION_INFLIGHT_MAX,
    ZERO_HEADER,
    Reply,
    action_body,
    context,
    decode_get_piece_meta,
    decode_reply_frame,
    encode_put_batch_meta,
)

__all__ = [
    "DATA_SCHEMA",
    "GRPC_OPTIONS",
    "ExchangeOp",
    "ExchangeSession",
    "ServerConnection",
    "Watchdog",
    "AdminClient",
]

T = TypeVar("T")

GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MESSAGE_MAX_BYTES),
    ("grpc.max_send_message_length", MESSAGE_MAX_BYTES),
]
DATA_SCHEMA = pa.schema([pa.field(DATA_COLUMN_NAME, pa.binary(), nullable=False)])
WATCHDOG_INTERVAL_MAX_S = 0.1
SESSION_CLOSE_TIMEOUT_S = 2.0
POOL_WAIT_SLICE_S = 0.05
SESSION_REFUSALS_MAX = 8
"""How often one call goes back to its pool after the server refused a new session."""
STREAM_BYTES_PER_S_MIN = 8 * 1024 * 1024
"""Slowest transfer rate a data stream's deadline allows for (see ``_stream_call_options``)."""
ADMIN_TIMEOUT_DEFAULT_S = 10.0
CONNECT_TIMEOUT_MIN_S = 1.0
"""Shortest TCP + HTTP/2 connection attempt allowed, whatever the first-reply bound."""

_OFFSETS = struct.Struct("<ii")

# gRPC's threads and channels do not survive fork(): a child forked while this process has a
# channel open hangs on its first call, even on a new channel. Such a child fails fast instead.
# A process that closes all its channels before it forks (Client.disconnect) leaves a child that
# opens its own.
_channels_lock = threading.Lock()
_channels_open = 0
_forked_after_grpc = False


GRPC_THREAD_NAMES = ("event_engine", "grpc_", "lifeguard", "default-executo", "resolver-execu")
"""Prefixes of the names of gRPC's own threads (Linux ``/proc/self/task/*/comm``)."""
GRPC_SHUTDOWN_WAIT_S = 2.0
"""How long :func:`wait_for_grpc_shutdown` waits for gRPC's threads to exit."""


GRPC_QUIET_SCANS = 2
"""Consecutive scans that must find no gRPC thread before :func:`wait_for_grpc_shutdown` trusts it.

One scan is not enough: it is not atomic, and gRPC's ``grpc_shutdown`` thread can start just
as the thread that starts it exits, so a scan can see neither. Trusting one empty scan, about 1
fork in 100 still saw gRPC running (its child failed on its first call: in Lithops a worker that
lost its call, whose job then never finished); with two, none in 1000.
"""


def _grpc_thread_scan() -> tuple[set[int], bool]:
    """This process's threads named like gRPC's, and whether no listed thread exited mid-scan
    (a thread that did may have just started another)."""
    found = set()
    complete = True
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:
            complete = False  # The thread exited meanwhile.
            continue
        if name.startswith(GRPC_THREAD_NAMES):
            found.add(int(comm.parent.name))
    return found, complete


def _grpc_thread_ids() -> set[int]:
    """This process's threads named like gRPC's (none where ``/proc`` is not available)."""
    return _grpc_thread_scan()[0]


# gRPC threads that were running before this process opened its first channel: another gRPC
# in the process (Ray's, grpcio's) owns them, and they do not go away when our channels close.
_foreign_grpc_threads: set[int] = set()
_grpc_opened = False
"""Whether this process ever opened a channel (only then is /proc looked at on fork)."""
_grpc_running_at_fork = False


def wait_for_grpc_shutdown(timeout_s: float = GRPC_SHUTDOWN_WAIT_S) -> bool:
    """Once no channel is open, wait until gRPC's threads are gone; whether they are.

    gRPC shuts itself down when its last channel closes, asynchronously, on a thread of its own.
    A process that forks in the middle of that leaves a child whose first call hangs, so a
    process that forks after closing its channels waits here first. Threads of another gRPC
    that were running before the first channel opened are not waited for.
    """
    if _channels_open:
        return False
    deadline = time.monotonic() + timeout_s
    quiet_scans = 0
    while True:
        found, complete = _grpc_thread_scan()
        quiet_scans = quiet_scans + 1 if complete and not found - _foreign_grpc_threads else 0
        if quiet_scans >= GRPC_QUIET_SCANS:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


def _note_fork_in_parent() -> None:
    # gRPC may outlive the last close (a call still in flight holds the channel): a child forked
    # while its threads run cannot use it either.
    global _grpc_running_at_fork
    _grpc_running_at_fork = _grpc_opened and bool(_grpc_thread_ids() - _foreign_grpc_threads)


def _note_fork_in_child() -> None:
    global _forked_after_grpc, _channels_lock, _channels_open, _foreign_grpc_threads, _grpc_opened
    if _channels_open or _grpc_running_at_fork:
        _forked_after_grpc = True
    # The parent's channels and threads are not this process's, and the lock may have been held
    # at fork.
    _channels_open = 0
    _foreign_grpc_threads = set()
    _grpc_opened = False
    _channels_lock = threading.Lock()


os.register_at_fork(before=_note_fork_in_parent, after_in_child=_note_fork_in_child)
_pack_frame_header = FRAME_HEADER_STRUCT.pack
_pack_op = OP_STRUCT.pack


def _only_value(column: pa.Array) -> pa.Buffer | None:
    """The value of a one-row binary column as a zero-copy slice of the received body.

    (``column[0].as_buffer()`` would go through an Arrow scalar, which copies the value.)
    Returns ``None`` if the column is not one non-null row.
    """
    if len(column) != 1 or column.null_count:
        return None
    _, offsets, values = column.buffers()
    if offsets is None:
        return None
    start, end = _OFFSETS.unpack_from(offsets, 4 * column.offset)
    if values is None:
        return pa.py_buffer(b"") if start == end else None
    if not 0 <= start <= end <= values.size:
        return None
    return values.slice(start, end - start)


class Watched(Protocol):
    """Something the watchdog can cancel: a ``deadline`` (monotonic seconds, 0 when idle)."""

    deadline: float

    def expire(self) -> None:
        """Cancel the overdue call."""


class Watchdog:
    """Cancels streams whose next message is overdue; one daemon thread per client.

    DoExchange sessions and DoGet streams are watched: a hung server (stopped, deadlocked)
    cannot block a caller longer than the operation timeout. (A DoPut stream is bounded by its
    gRPC deadline instead: pyarrow offers no way to cancel a blocked write.)
    """

    def __init__(self, interval_s: float = WATCHDOG_INTERVAL_MAX_S) -> None:
        self._interval_s = interval_s
        self._sessions: set[Watched] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, session: Watched) -> None:
        """Start watching a stream's ``deadline``."""
        with self._lock:
            self._sessions.add(session)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._loop, name="pocketflow-watchdog", daemon=True
                )
                self._thread.start()

    def unwatch(self, session: Watched) -> None:
        """Stop watching a stream."""
        with self._lock:
            self._sessions.discard(session)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            now = time.monotonic()
            with self._lock:
                overdue = [s for s in self._sessions if 0.0 < s.deadline < now]
            for session in overdue:
                session.expire()

    def close(self) -> None:
        """Stop the thread (sessions still open stay unwatched)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)


class ExchangeOp:
    """One small operation to run over a session, and, once run, its reply.

    ``tag`` is the caller's (for instance the index of the key in a ``get_many`` call).
    """

    __slots__ = ("op", "flags", "bucket", "key", "header", "value", "tag", "reply")

    def __init__(
        self,
        op: int,
        flags: int,
        bucket: bytes,
        key: bytes,
        header: bytes = ZERO_HEADER,
        value: bytes | bytearray | memoryview = b"",
        tag: Any = None,
    ) -> None:
        self.op = op
        self.flags = flags
        self.bucket = bucket
        self.key = key
        self.header = header
        self.value = value
        self.tag = tag
        self.reply: Reply | None = None

    def encoded_len(self) -> int:
        """Bytes this op takes in a request frame."""
        return OP_FIXED_LEN_BYTES + len(self.bucket) + len(self.key) + len(self.value)


class SessionFailure(Exception):
    """A session broke; ``error`` is the pocketflow error, ``sent`` whether any op may have run."""

    def __init__(self, error: PocketflowError, *, sent: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.sent = sent


class ExchangeSession:
    """One open DoExchange stream to one server, used by one thread at a time."""

    def __init__(self, connection: ServerConnection, command: bytes) -> None:
        self._connection = connection
        self.address = connection.address
        self.deadline = 0.0
        self.used = False
        self.broken = False
        self._expired = False
        self._next_id = 1
        try:
            self._writer, self._reader = connection.flight_client().do_exchange(
                flight.FlightDescriptor.for_command(command)
            )
        except Exception as exc:
            raise SessionFailure(error_from_flight(exc, server=self.address), sent=False) from exc

    # -- the single-operation fast path ------------------------------------------------------

    def call(
        self,
        epoch: int,
        op: int,
        flags: int,
        bucket: bytes,
        key: bytes,
        header: bytes,
        value: bytes | bytearray | memoryview,
        timeout_s: float,
    ) -> Reply:
        """Send one op in its own frame and wait for its reply."""
        request_id = self._next_id
        self._next_id = request_id + 1
        frame = b"".join((
            _pack_frame_header(FRAME_VERSION, epoch, 1),
            _pack_op(request_id, op, flags, len(bucket), len(key), len(value)),
            header, bucket, key, value,
        ))
        first = not self.used
        self.used = True
        self._write(frame, timeout_s, sent=False)
        while True:
            replies = self._read(self._connection.first_reply_timeout_s if first else timeout_s)
            for reply in replies:
                if reply.request_id == request_id:
                    self.deadline = 0.0
                    return reply
            self._protocol_error(f"reply for unknown request ids {[r.request_id for r in replies]}")

    # -- pipelined operations ----------------------------------------------------------------

    def run(self, epoch: int, ops: Sequence[ExchangeOp], window: int, timeout_s: float) -> None:
        """Run ``ops``, keeping up to ``window`` in flight; fills each op's ``reply``.

        Ops are packed into frames of at most ``FRAME_OPS_MAX`` ops and ``FRAME_MAX_BYTES``;
        replies may come back in any order. ``timeout_s`` bounds each wait for progress.
        """
        window = max(1, min(window, SESSION_INFLIGHT_MAX))
        pending: dict[int, ExchangeOp] = {}
        total = len(ops)
        sent = 0
        first = not self.used
        self.used = True
        while sent < total or pending:
            if sent < total and len(pending) < window:
                parts: list[Any] = []
                count = 0
                size = FRAME_HEADER_LEN_BYTES
                while sent < total and len(pending) < window and count < FRAME_OPS_MAX:
                    op = ops[sent]
                    op_len = op.encoded_len()
                    if count and size + op_len > FRAME_MAX_BYTES:
                        break
                    request_id = self._next_id
                    self._next_id = request_id + 1
                    parts.append(_pack_op(
                        request_id, op.op, op.flags, len(op.bucket), len(op.key), len(op.value)
                    ))
                    parts.append(op.header)
                    parts.append(op.bucket)
                    parts.append(op.key)
                    if op.value:
                        parts.append(op.value)
                    pending[request_id] = op
                    count += 1
                    size += op_len
                    sent += 1
                frame = _pack_frame_header(FRAME_VERSION, epoch, count) + b"".join(parts)
                self._write(frame, timeout_s, sent=bool(sent - count))
                continue
            replies = self._read(self._connection.first_reply_timeout_s if first else timeout_s)
            first = False
            for reply in replies:
                op = pending.pop(reply.request_id, None)
                if op is None:
                    self._protocol_error(f"reply for unknown request id {reply.request_id}")
                op.reply = reply
        self.deadline = 0.0

    # -- stream plumbing ---------------------------------------------------------------------

    def _write(self, frame: bytes, timeout_s: float, *, sent: bool) -> None:
        self.deadline = time.monotonic() + timeout_s
        try:
            self._writer.write_metadata(frame)
        except Exception as exc:
            self.broken = True
            # The write failing means the stream has ended; its status says why.
            error = self._status_after_failure(exc)
            raise SessionFailure(error, sent=sent) from exc

    def _read(self, timeout_s: float) -> list[Reply]:
        self.deadline = time.monotonic() + timeout_s
        try:
            chunk = self._reader.read_chunk()
        except StopIteration:
            self.broken = True
            error = DataUnavailable(
                "unavailable: the server ended the session", server=self.address
            )
            raise SessionFailure(error, sent=True) from None
        except Exception as exc:
            self.broken = True
            raise SessionFailure(self._map(exc), sent=True) from exc
        metadata = chunk.app_metadata
        if metadata is None:
            self._protocol_error("the server sent a message without app_metadata")
        try:
            return decode_reply_frame(metadata)
        except InvalidRequest as exc:
            self._protocol_error(str(exc))
            raise  # unreachable; keeps type checkers content

    def _status_after_failure(self, exc: BaseException) -> PocketflowError:
        first = self._map(exc)
        if self._expired:
            return first
        try:
            self._reader.read_chunk()
        except StopIteration:
            return first
        except Exception as status_exc:
            second = self._map(status_exc)
            if isinstance(first, (DataUnavailable, InternalError)):
                return second
        return first

    def _map(self, exc: BaseException) -> PocketflowError:
        if self._expired:
            return DataUnavailable(
                "unavailable: no reply before the deadline; session cancelled", server=self.address
            )
        return error_from_flight(exc, server=self.address)

    def _protocol_error(self, what: str) -> None:
        self.broken = True
        error = InternalError(f"internal: exchange protocol violation: {what}", server=self.address)
        raise SessionFailure(error, sent=True)

    def expire(self) -> None:
        """Cancel the stream because a reply is overdue (called by the watchdog)."""
        self._expired = True
        self.broken = True
        self.deadline = 0.0
        try:
            self._reader.cancel()
        except Exception:  # noqa: BLE001 - cancelling a finished call is harmless
            pass

    def close(self) -> None:
        """End the stream: half-close, then wait briefly for the server's status."""
        self.deadline = time.monotonic() + SESSION_CLOSE_TIMEOUT_S
        try:
            if self.broken:
                self._reader.cancel()
            else:
                self._writer.done_writing()
            self._writer.close()
        except Exception:  # noqa: BLE001 - the stream is going away; its status no longer matters
            pass
        finally:
            self.deadline = 0.0


class _ReadWatch:
    """A DoGet stream as the watchdog sees it."""

    __slots__ = ("reader", "deadline", "expired")

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.deadline = 0.0
        self.expired = False

    def expire(self) -> None:
        self.expired = True
        self.deadline = 0.0
        try:
            self.reader.cancel()
        except Exception:  # noqa: BLE001 - cancelling a finished call is harmless
            pass


class _SessionPool:
    """Idle sessions of one connection; opens new ones up to a bound, then makes callers wait."""

    def __init__(self, connection: ServerConnection, size_max: int) -> None:
        self._connection = connection
        self._size_max = size_max
        self._idle: list[ExchangeSession] = []
        self._open = 0
        self._waiters = 0
        self._cond = threading.Condition(threading.Lock())
        self._closed = False

    def acquire(self, timeout_s: float, *, fresh: bool = False) -> ExchangeSession:
        """An idle session, else a new one; ``fresh`` first retires every idle session."""
        if not fresh and not self._closed:
            try:
                # list.pop is atomic under the GIL: the common case takes no lock.
                return self._idle.pop()
            except IndexError:
                pass
        stale: list[ExchangeSession] = []
        with self._cond:
            if fresh:
                # A pooled session just broke: the others likely share its fate.
                stale, self._idle = self._idle, []
                self._open -= len(stale)
            deadline = time.monotonic() + timeout_s
            while True:
                if self._closed:
                    raise DataUnavailable(
                        "unavailable: client is closed", server=self._connection.address
                    )
                if self._idle:
                    return self._idle.pop()
                if self._open < self._size_max:
                    self._open += 1
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DataUnavailable(
                        f"unavailable: all {self._size_max} sessions busy for {timeout_s:.1f}s",
                        server=self._connection.address,
                    )
                self._waiters += 1
                try:
                    # Short waits: a lock-free release may miss a waiter that is just arriving.
                    self._cond.wait(min(remaining, POOL_WAIT_SLICE_S))
                finally:
                    self._waiters -= 1
        for session in stale:
            self._connection.retire(session)
        try:
            return self._connection.open_session()
        except BaseException:
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise

    def shrink(self) -> bool:
        """The server refused a new session (its bound on sessions, shared by all clients): from
        now on keep at most the sessions open now, and wait for one of them. False when none is
        open, so there is nothing to wait for."""
        with self._cond:
            if self._open <= 0:
                return False
            self._size_max = min(self._size_max, self._open)
            self._cond.notify_all()
            return True

    def release(self, session: ExchangeSession) -> None:
        """Return a session; a broken one is closed and frees its slot."""
        if not session.broken and not self._closed and not self._waiters:
            self._idle.append(session)
            return
        with self._cond:
            if session.broken or self._closed:
                self._open -= 1
                retire = True
            else:
                self._idle.append(session)
                retire = False
            self._cond.notify()
        if retire:
            self._connection.retire(session)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
            self._cond.notify_all()
        for session in idle:
            self._connection.retire(session)


class ServerConnection:
    """Everything one client uses to talk to one storage server.

    ``exchange_command`` supplies the DoExchange descriptor (the job's capability context) when a
    session opens; it is called again for every new session, so a refreshed handle is picked up.
    """

    def __init__(
        self,
        address: str,
        *,
        exchange_command: Callable[[], bytes] | None = None,
        watchdog: Watchdog | None = None,
        sessions_max: int = 8,
        op_timeout_s: float = 30.0,
        first_reply_timeout_s: float = 5.0,
        rpc_timeout_s: float = 30.0,
        stream_timeout_s: float = 300.0,
    ) -> None:
        self.address = address
        # op_timeout_s bounds every wait for progress (a reply, the next DoGet piece): a hung
        # server fails a call within it. Waits that are not the server's progress (a free
        # session of this client's pool; a stream's total deadline) get the longer of it and
        # rpc_timeout_s, so that a busy client or a slow but moving transfer is not cut off.
        self.op_timeout_s = op_timeout_s
        self.patience_s = max(op_timeout_s, rpc_timeout_s)
        # The first reply on a new session also waits for the connection and the token check;
        # it gets the shorter of the two bounds.
        self.first_reply_timeout_s = max(min(first_reply_timeout_s, op_timeout_s), 0.001)
        self._exchange_command = exchange_command
        self._watchdog = watchdog
        self._rpc_options = flight.FlightCallOptions(timeout=rpc_timeout_s)
        self.stream_timeout_s = stream_timeout_s
        self._client: flight.FlightClient | None = None
        self._client_lock = threading.Lock()
        self._pool = _SessionPool(self, sessions_max)

    def flight_client(self) -> flight.FlightClient:
        """The Flight client (one gRPC channel), created on first use."""
        client = self._client
        if client is not None:
            return client
        global _channels_open, _foreign_grpc_threads, _grpc_opened
        with self._client_lock:
            if self._client is None:
                if _forked_after_grpc:
                    raise InvalidRequest(
                        "this process was forked while its parent had pocketflow connections "
                        "open; gRPC cannot run here. Start workers with multiprocessing 'spawn' "
                        "or 'forkserver' (the job handle pickles), or call Client.disconnect() "
                        "before forking."
                    )
                # Opening a DoExchange session blocks until the channel connects, before the
                # watchdog can see it; gRPC's own connection deadline (20 s) is cut to ours.
                connect_ms = int(max(self.first_reply_timeout_s, CONNECT_TIMEOUT_MIN_S) * 1000)
                options = [*GRPC_OPTIONS, ("grpc.min_reconnect_backoff_ms", connect_ms)]
                with _channels_lock:
                    if not _channels_open:
                        _foreign_grpc_threads = _grpc_thread_ids()
                    _channels_open += 1  # Counted first, so a concurrent opener sees it.
                    _grpc_opened = True
                try:
                    self._client = flight.FlightClient(
                        f"grpc://{self.address}", generic_options=options
                    )
                except Exception as exc:
                    with _channels_lock:
                        _channels_open = max(_channels_open - 1, 0)
                    raise error_from_flight(exc, server=self.address) from exc
            return self._client

    # -- exchange ----------------------------------------------------------------------------

    def open_session(self) -> ExchangeSession:
        """Open a new DoExchange session (normally through the pool)."""
        if self._exchange_command is None:
            raise InvalidRequest("this connection has no job context for DoExchange sessions")
        try:
            session = ExchangeSession(self, self._exchange_command())
        except SessionFailure as failure:
            raise failure.error from failure
        if self._watchdog is not None:
            self._watchdog.watch(session)
        return session

    def retire(self, session: ExchangeSession) -> None:
        """Close a session that leaves the pool."""
        session.close()
        if self._watchdog is not None:
            self._watchdog.unwatch(session)

    def call(
        self,
        epoch: int,
        op: int,
        flags: int,
        bucket: bytes,
        key: bytes,
        header: bytes = ZERO_HEADER,
        value: bytes | bytearray | memoryview = b"",
    ) -> Reply:
        """Run one small operation (see :meth:`_on_session` for the retries)."""
        return self._on_session(lambda session: session.call(
            epoch, op, flags, bucket, key, header, value, self.op_timeout_s
        ))

    def _on_session(self, use: Callable[[ExchangeSession], T]) -> T:
        """``use`` a pooled session and give it back; returns what ``use`` returned.

        A pooled session that turns out stale (``DataUnavailable`` before anything was sent) is
        replaced by a fresh one once; a new session the server refuses for its bound on sessions
        makes the call wait for one of the sessions this pool already has.
        """
        replaced = False  # a stale pooled session was replaced (once at most)
        fresh = False  # the next acquire retires the idle sessions first
        refusals = 0
        while True:
            session = self._pool.acquire(self.patience_s, fresh=fresh)
            fresh = False
            reused = session.used
            try:
                result = use(session)
            except SessionFailure as failure:
                self._pool.release(session)
                if self._refused(failure, reused, refusals):
                    refusals += 1
                    continue
                if (replaced or failure.sent or not reused
                        or not isinstance(failure.error, DataUnavailable)):
                    raise failure.error from failure
                replaced = fresh = True
                continue
            except BaseException:
                self._release_interrupted(session)
                raise
            self._pool.release(session)
            return result

    def _refused(self, failure: SessionFailure, reused: bool, refusals: int) -> bool:
        """Whether a failed new session was refused by the server's bound on sessions and the
        pool shrank to the sessions it has (so the call waits for one of them).

        A session that ends with ``capacity_exhausted`` before its first reply can only have been
        refused when it opened (per-operation failures are replies): none of its operations ran.
        """
        return (
            not reused
            and isinstance(failure.error, CapacityExhausted)
            and refusals < SESSION_REFUSALS_MAX
            and self._pool.shrink()
        )

    def _release_interrupted(self, session: ExchangeSession) -> None:
        """Give back a session left mid-call by an unexpected exception (``KeyboardInterrupt``,
        a bug): its reply may still arrive, so it is closed rather than reused, and its pool slot
        is freed."""
        session.broken = True
        self._pool.release(session)

    def run(self, epoch: int, ops: Sequence[ExchangeOp], window: int) -> None:
        """Run many small operations pipelined over one session; fills each op's ``reply``."""
        if ops:
            self._on_session(lambda session: session.run(epoch, ops, window, self.op_timeout_s))

    # -- data streams ------------------------------------------------------------------------

    def put_blocks(
        self, command: bytes, blocks: Sequence[tuple[int, memoryview]]
    ) -> dict[str, Any]:
        """Write data blocks over one DoPut stream; returns the server's ``{"blocks", "bytes"}``.

        Each block goes as batches of at most ``BATCH_MAX_BYTES``, built without copying: the
        batch's value buffer is a slice of the caller's memory.
        """
        try:
            writer, result_reader = self.flight_client().do_put(
                flight.FlightDescriptor.for_command(command), DATA_SCHEMA,
                options=self._stream_call_options(sum(len(data) for _, data in blocks)),
            )
        except Exception as exc:
            raise error_from_flight(exc, server=self.address) from exc
        try:
            for index, data in blocks:
                block_len = len(data)
                metadata = encode_put_batch_meta(index, block_len)
                at = 0
                while at < block_len:
                    piece = data[at:at + BATCH_MAX_BYTES]
                    piece_len = len(piece)
                    offsets = pa.py_buffer(_OFFSETS.pack(0, piece_len))
                    values = pa.Array.from_buffers(
                        pa.binary(), 1, [None, offsets, pa.py_buffer(piece)]
                    )
                    batch = pa.RecordBatch.from_arrays([values], schema=DATA_SCHEMA)
                    writer.write_with_metadata(batch, metadata)
                    at += piece_len
            writer.done_writing()
            result = result_reader.read()
            writer.close()
        except Exception as exc:
            raise self._stream_error(exc, writer) from exc
        if result is None:
            return {}
        try:
            parsed = json.loads(result.to_pybytes())
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}

    def _stream_call_options(self, nbytes: int) -> flight.FlightCallOptions:
        """A deadline that fits the transfer: ``patience_s`` plus the time ``nbytes`` take at
        ``STREAM_BYTES_PER_S_MIN``, capped by ``stream_timeout_s``. A DoGet from a hung server
        fails sooner, after ``op_timeout_s`` without a piece (the watchdog); a DoPut, which
        pyarrow cannot cancel, only at this deadline."""
        deadline_s = self.patience_s + nbytes / STREAM_BYTES_PER_S_MIN
        return flight.FlightCallOptions(timeout=min(self.stream_timeout_s, deadline_s))

    def get_ranges(
        self, ticket: bytes, sink: Callable[[int, int, pa.Buffer], None], *, nbytes: int = 0
    ) -> int:
        """Read the ranges of a DoGet ticket; ``sink(block, offset, piece)`` gets each piece.

        Pieces arrive in ticket order; ``piece`` is a zero-copy view of the received bytes.
        ``nbytes`` (the ticket's total length) sizes the deadline. Returns the bytes received.
        """
        try:
            reader = self.flight_client().do_get(
                flight.Ticket(ticket), options=self._stream_call_options(nbytes)
            )
        except Exception as exc:
            raise error_from_flight(exc, server=self.address) from exc
        watch = _ReadWatch(reader)
        if self._watchdog is not None:
            self._watchdog.watch(watch)
        try:
            return self._read_pieces(reader, watch, sink)
        finally:
            watch.deadline = 0.0
            if self._watchdog is not None:
                self._watchdog.unwatch(watch)

    def _read_pieces(
        self, reader: Any, watch: _ReadWatch, sink: Callable[[int, int, pa.Buffer], None]
    ) -> int:
        received = 0
        while True:
            watch.deadline = time.monotonic() + self.op_timeout_s
            try:
                chunk = reader.read_chunk()
            except StopIteration:
                return received
            except Exception as exc:
                if watch.expired:
                    raise DataUnavailable(
                        f"unavailable: no data for {self.op_timeout_s:.1f}s; stream cancelled",
                        server=self.address,
                    ) from exc
                raise error_from_flight(exc, server=self.address) from exc
            if chunk.app_metadata is None or chunk.data is None:
                raise InternalError(
                    "internal: DoGet batch without app_metadata or data", server=self.address
                )
            index, offset, length = decode_get_piece_meta(chunk.app_metadata)
            piece = _only_value(chunk.data.column(0))
            if piece is None or piece.size != length:
                raise InternalError(
                    f"internal: DoGet piece of block {index} has "
                    f"{0 if piece is None else piece.size} bytes, metadata says {length}",
                    server=self.address,
                )
            sink(index, offset, piece)
            received += length

    def _stream_error(self, exc: BaseException, writer: Any) -> PocketflowError:
        # A failed write usually only says "the stream ended"; the status from close() says why.
        first = error_from_flight(exc, server=self.address)
        try:
            writer.close()
        except Exception as close_exc:  # noqa: BLE001 - only its status is wanted
            second = error_from_flight(close_exc, server=self.address)
            if isinstance(first, (DataUnavailable, InternalError)) and not isinstance(
                second, InternalError
            ):
                return second
        return first

    # -- actions -----------------------------------------------------------------------------

    def action(self, name: str, body: bytes) -> Any:
        """Run one DoAction and return its JSON result (``{}`` when the body is empty)."""
        try:
            results = self.flight_client().do_action(
                flight.Action(name, body), options=self._rpc_options
            )
            payload = b""
            for result in results:
                if not payload:
                    payload = result.body.to_pybytes()
        except Exception as exc:
            raise error_from_flight(exc, server=self.address) from exc
        if not payload:
            return {}
        try:
            return json.loads(payload)
        except ValueError as exc:
            raise InternalError(
                f"internal: action {name} returned invalid JSON", server=self.address
            ) from exc

    def close(self) -> None:
        """Close every session and the channel."""
        global _channels_open
        self._pool.close()
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken channel is harmless
                pass
            with _channels_lock:
                _channels_open = max(_channels_open - 1, 0)


class AdminClient:
    """Control-plane calls to one storage server, authorized by the admin token."""

    def __init__(
        self, address: str, admin_token: str, *, timeout_s: float = ADMIN_TIMEOUT_DEFAULT_S
    ) -> None:
        self.address = address
        self._ctx = context(ADMIN_JOB_ID, 0, admin_token)
        self._connection = ServerConnection(
            address, rpc_timeout_s=timeout_s, stream_timeout_s=timeout_s
        )

    def stats(self) -> dict[str, Any]:
        """The server's last complete statistics sample (see docs/PROTOCOL.md)."""
        return self._connection.action(ACTION_STATS, action_body(self._ctx))

    def drain(self, *, exit_when_empty: bool) -> dict[str, Any]:
        """Make the server refuse writes; with ``exit_when_empty`` it exits once empty."""
        return self._connection.action(
            ACTION_DRAIN, action_body(self._ctx, exit_when_empty=exit_when_empty)
        )

    def set_cores(self, cores: int) -> dict[str, Any]:
        """Run the server on ``cores`` CPU cores from now on, without restarting it.

        Returns ``{"cores", "cores_max"}``; ``cores`` outside ``1..cores_max`` (see ``stats``) is
        ``InvalidRequest``. See docs/PROTOCOL.md, Vertical scaling.
        """
        return self._connection.action(ACTION_SET_CORES, action_body(self._ctx, cores=cores))

    def set_epoch(self, job_id: str, epoch: int, weight_map: dict[str, Any]) -> dict[str, Any]:
        """Tell the server a job's current epoch and weight map."""
        return self._connection.action(
            ACTION_SET_EPOCH, action_body(self._ctx, job=job_id, epoch=epoch, map=weight_map)
        )

    def delete_job(self, job_id: str) -> dict[str, Any]:
        """Free every non-PERSIST record of a job; returns ``{"deleted", "freed_bytes"}``."""
        return self._connection.action(ACTION_DELETE_JOB, action_body(self._ctx, job=job_id))

    def close(self) -> None:
        """Close the connection."""
        self._connection.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


