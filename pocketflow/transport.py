"""Connections to storage servers, over the Rust client core (``pocketflow._core``).

One :class:`ServerConnection` per server and client wraps a native connection: one HTTP/2
connection, a bounded pool of small-operation sessions and DoActions. Everything else of the data
path (pipelined batches, data blocks over DoPut and DoGet) runs inside the native object layer
(``_core.Objects``) and has no Python face. The GIL is released during all I/O; every wait is
bounded by the connection's timeouts, so a dead or hung server surfaces as
:class:`~pocketflow.errors.DataUnavailable`, never as a hang. Errors arrive already mapped to
:mod:`pocketflow.errors` (by ``error_from_grpc``).

The native runtime belongs to the process that made it: a forked child makes its own runtime and
connections on first use (the parent's are never touched there), so a client keeps working across
``fork()`` without any preparation.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from pocketflow import _core
from pocketflow.errors import InternalError
from pocketflow.protocol import (
    ACTION_DELETE_JOB,
    ACTION_DRAIN,
    ACTION_SET_CORES,
    ACTION_SET_EPOCH,
    ACTION_STATS,
    ADMIN_JOB_ID,
    ZERO_HEADER,
    ObjectHeader,
    Reply,
    action_body,
    context,
)
from pocketflow.records import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = ["ServerConnection", "AdminClient", "ADMIN_TIMEOUT_DEFAULT_S"]

ADMIN_TIMEOUT_DEFAULT_S = 10.0

RawReply = tuple[int, tuple[int, int, int, int, int] | None, bytes]
"""A reply as the native core gives it: status, the header's fields or ``None``, body."""


def _reply(raw: RawReply) -> Reply:
    status, header, body = raw
    return Reply(0, status, None if header is None else ObjectHeader(*header), body)


class ServerConnection:
    """Everything one client uses to talk to one storage server.

    ``exchange_command`` supplies the DoExchange descriptor (the job's capability context); it
    is read on every call, so a refreshed handle is used by the next session that opens. With
    ``direct`` (the default), small operations travel over direct-exchange sessions (plain TCP,
    blocking I/O on the calling thread); without it, over DoExchange sessions.
    """

    def __init__(
        self,
        address: str,
        *,
        exchange_command: Callable[[], bytes] | None = None,
        sessions_max: int = 8,
        op_timeout_s: float = 30.0,
        first_reply_timeout_s: float = 5.0,
        rpc_timeout_s: float = 30.0,
        stream_timeout_s: float = 300.0,
        direct: bool = True,
        tls_ca: str | None = None,
    ) -> None:
        self.address = address
        self.op_timeout_s = op_timeout_s
        self._exchange_command = exchange_command
        self._native = _core.Connection(
            address,
            sessions_max=sessions_max,
            op_timeout_s=op_timeout_s,
            first_reply_timeout_s=first_reply_timeout_s,
            rpc_timeout_s=rpc_timeout_s,
            stream_timeout_s=stream_timeout_s,
            direct=direct,
            tls_ca=tls_ca.encode("ascii") if tls_ca is not None else None,
        )

    @classmethod
    def wrap(
        cls, native: Any, *, exchange_command: Callable[[], bytes] | None, op_timeout_s: float
    ) -> ServerConnection:
        """A connection over ``native``, a ``_core.Connection`` made elsewhere (the client's
        native core makes one per server and shares it)."""
        connection = cls.__new__(cls)
        connection.address = native.address
        connection.op_timeout_s = op_timeout_s
        connection._exchange_command = exchange_command
        connection._native = native
        return connection

    def _command(self) -> bytes:
        if self._exchange_command is None:
            return b""
        return self._exchange_command()

    # -- exchange ----------------------------------------------------------------------------

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
        """Run one small operation over a pooled session and return its reply."""
        return _reply(self._native.call(
            self._command(), epoch, op, flags, bucket, key, header, value
        ))

    # -- actions -----------------------------------------------------------------------------

    def action(self, name: str, body: bytes, *, timeout_s: float | None = None) -> Any:
        """Run one DoAction and return its JSON result (``{}`` when the body is empty).

        It fails with :class:`~pocketflow.errors.DataUnavailable` after ``timeout_s`` (default:
        the connection's ``rpc_timeout_s``)."""
        payload = self._native.action(name, body, timeout_s=timeout_s)
        if not payload:
            return {}
        try:
            return json.loads(payload)
        except ValueError as exc:
            raise InternalError(
                f"internal: action {name} returned invalid JSON", server=self.address
            ) from exc

    def close(self) -> None:
        """Close the idle sessions; the connection cannot be used afterwards."""
        self._native.close()


class AdminClient:
    """Control-plane calls to one storage server, authorized by the admin token."""

    def __init__(
        self,
        address: str,
        admin_token: str,
        *,
        timeout_s: float = ADMIN_TIMEOUT_DEFAULT_S,
        tls_ca: str | None = None,
    ) -> None:
        self.address = address
        self._ctx = context(ADMIN_JOB_ID, 0, admin_token)
        self._connection = ServerConnection(
            address, rpc_timeout_s=timeout_s, stream_timeout_s=timeout_s,
            op_timeout_s=timeout_s, first_reply_timeout_s=timeout_s, tls_ca=tls_ca,
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

    def delete_job(self, job_id: str, *, persist: bool = False) -> dict[str, Any]:
        """End a job on the server and free every non-PERSIST record of it (with ``persist``,
        its PERSIST records too); returns ``{"deleted", "freed_bytes"}``."""
        fields: dict[str, Any] = {"job": job_id}
        if persist:
            fields["persist"] = True
        return self._connection.action(ACTION_DELETE_JOB, action_body(self._ctx, **fields))

    def close(self) -> None:
        """Close the connection."""
        self._connection.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
