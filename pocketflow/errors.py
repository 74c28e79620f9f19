"""One exception hierarchy for pocketflow, mapped once from the storage server's error kinds.

Every failure the storage server reports has a *kind* (``not_found``, ``capacity_exhausted``, ...)
that fixes its gRPC status code and opens its message (``"<kind>: <message>"``); over the
DoExchange session the same code travels as a per-operation status byte. Each kind maps to exactly
one exception class here (table in docs/PROTOCOL.md), so a caller can catch precisely the failure
it can handle::

    try:
        data = pf.get("shuffle", "part-7", delete=True)
    except pocketflow.ObjectNotFound:
        ...

The families (``NotFound``, ``AlreadyExists``, ``Unavailable``, ``FailedPrecondition``) group the
kinds that share a gRPC code. :func:`error_from_flight` and :func:`error_from_status` are the only
places where transport errors become pocketflow errors.
"""

from __future__ import annotations

import json
import re

from pocketflow.records import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "PocketflowError",
    "NotFound",
    "ObjectNotFound",
    "BucketNotFound",
    "JobNotRegistered",
    "AlreadyExists",
    "ObjectExists",
    "BucketExists",
    "CapacityExhausted",
    "QueueFull",
    "LeaseTableFull",
    "InvalidRequest",
    "Unavailable",
    "ServerDraining",
    "ServerSuspect",
    "ClientBusy",
    "DataUnavailable",
    "PermissionDenied",
    "TlsError",
    "FailedPrecondition",
    "StaleEpoch",
    "PersistNotSupported",
    "SegmentSealed",
    "InternalError",
    "DataLost",
    "ServerStartError",
    "ClusterError",
    "ConfigError",
    "ShuffleFailed",
    "S3Error",
    "S3ObjectNotFound",
    "S3BucketNotFound",
    "S3AccessDenied",
    "S3Unavailable",
    "S3InvalidRequest",
    "s3_error",
    "error_from_s3",
    "GRPC_CODE_OK",
    "error_from_kind",
    "error_from_status",
    "error_from_flight",
    "error_from_grpc",
]

GRPC_CODE_OK = 0
GRPC_CODE_CANCELLED = 1
GRPC_CODE_UNKNOWN = 2
GRPC_CODE_INVALID_ARGUMENT = 3
GRPC_CODE_DEADLINE_EXCEEDED = 4
GRPC_CODE_NOT_FOUND = 5
GRPC_CODE_ALREADY_EXISTS = 6
GRPC_CODE_PERMISSION_DENIED = 7
GRPC_CODE_RESOURCE_EXHAUSTED = 8
GRPC_CODE_FAILED_PRECONDITION = 9
GRPC_CODE_INTERNAL = 13
GRPC_CODE_UNAVAILABLE = 14
GRPC_CODE_DATA_LOSS = 15
GRPC_CODE_UNAUTHENTICATED = 16


class PocketflowError(Exception):
    """Base of every error pocketflow raises.

    ``kind`` is the server's error kind (``None`` for client-side errors), ``grpc_code`` the gRPC
    status code that carries it, ``server`` the ``host:port`` that reported it when known.
    """

    kind: str | None = None
    grpc_code: int = GRPC_CODE_UNKNOWN

    def __init__(self, message: str = "", *, server: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.server = server

    def __str__(self) -> str:
        if self.server:
            return f"{self.message} (server {self.server})"
        return self.message


class NotFound(PocketflowError):
    """Something named by the request does not exist."""

    grpc_code = GRPC_CODE_NOT_FOUND


class ObjectNotFound(NotFound):
    """No object with this key in this bucket (or it was already consumed by a DELETE read)."""

    kind = "not_found"


class BucketNotFound(NotFound):
    """The bucket does not exist."""

    kind = "bucket_not_found"


class JobNotRegistered(NotFound):
    """The job is not registered: the control plane does not know it (never registered, or
    deregistered), or the storage server that refused a write was not told of it (yet)."""

    kind = "job_not_registered"


class AlreadyExists(PocketflowError):
    """A write-once name is already taken."""

    grpc_code = GRPC_CODE_ALREADY_EXISTS


class ObjectExists(AlreadyExists):
    """The key already holds an object and the put did not ask to overwrite it."""

    kind = "already_exists"


class BucketExists(AlreadyExists):
    """The bucket already exists."""

    kind = "bucket_exists"


class CapacityExhausted(PocketflowError):
    """A storage tier is full; nothing of the failed write remains stored."""

    kind = "capacity_exhausted"
    grpc_code = GRPC_CODE_RESOURCE_EXHAUSTED


class QueueFull(CapacityExhausted):
    """A bounded queue stayed full (``max_items``) for the whole wait of an enqueue."""

    kind = "queue_full"


class LeaseTableFull(CapacityExhausted):
    """A prefix renewal named new prefixes past the job's share of a server's lease table (or
    past the table's bound): those were refused, and every lease the job held was renewed."""

    kind = "lease_table_full"
    grpc_code = GRPC_CODE_RESOURCE_EXHAUSTED


class InvalidRequest(PocketflowError, ValueError):
    """The request is malformed or breaks a protocol limit (also a ``ValueError``)."""

    kind = "invalid_argument"
    grpc_code = GRPC_CODE_INVALID_ARGUMENT


class Unavailable(PocketflowError):
    """A storage server cannot serve the request right now."""

    grpc_code = GRPC_CODE_UNAVAILABLE


class ServerDraining(Unavailable):
    """The server is draining: it refuses writes but still serves reads and deletes."""

    kind = "draining"


class ServerSuspect(Unavailable):
    """The operation needs a server that the control plane suspects (running, not answering):
    a write-once check of a key it may hold, or a read of a key found nowhere else. Refused at
    once instead of waiting on it; the server keeps its data and may answer again."""

    kind = "suspect_server"


class ClientBusy(Unavailable):
    """Every session this client may open to a server stayed busy with its own other calls for
    the whole wait: the client is overloaded, the server is not at fault (nothing was sent).
    Raise ``sessions_per_server`` or run fewer calls at once."""

    kind = "client_busy"


class DataUnavailable(Unavailable):
    """The server could not be reached: refused, reset, timed out or dead."""

    kind = "unavailable"


class PermissionDenied(PocketflowError):
    """The capability token is missing, malformed, expired, wrong, or not for this job."""

    kind = "permission_denied"
    grpc_code = GRPC_CODE_PERMISSION_DENIED


class TlsError(PermissionDenied):
    """A TLS connection to a server failed for a reason that retrying will not fix: its
    certificate is not signed by the trusted CA, has expired, or does not name its address; or
    one side spoke TLS and the other plaintext. The message names the cause."""


TLS_MESSAGE_PREFIX = "TLS: "
"""How the client core opens the message of a TLS failure (after ``permission_denied: ``)."""


class FailedPrecondition(PocketflowError):
    """The server is not in a state that allows the request."""

    grpc_code = GRPC_CODE_FAILED_PRECONDITION


class StaleEpoch(FailedPrecondition):
    """The request used an old weight-map epoch; ``weight_map`` is the job's current map."""

    kind = "stale_epoch"

    def __init__(
        self,
        message: str = "",
        *,
        weight_map: dict[str, Any] | None = None,
        server: str | None = None,
    ) -> None:
        super().__init__(message, server=server)
        self.weight_map: dict[str, Any] | None = weight_map


class PersistNotSupported(FailedPrecondition):
    """A PERSIST put reached a server that is not long-running (or no such server exists)."""

    kind = "persist_refused"


class SegmentSealed(FailedPrecondition):
    """A queue or append-file segment is sealed; the client goes on in the next segment (the
    public API handles it and never raises it)."""

    kind = "sealed"


class InternalError(PocketflowError):
    """The server failed in a way it did not expect; a bug worth reporting."""

    kind = "internal"
    grpc_code = GRPC_CODE_INTERNAL


class DataLost(PocketflowError):
    """The server accepted the object (its put succeeded) and then lost its bytes: a write the
    NVMe engine made behind the put failed in the device. Every read of the object fails so until
    it is written again; whoever can make it again (its writer, a shuffle's lineage) should, as
    after a dead server. Not a transport failure: the server answered."""

    kind = "data_lost"
    grpc_code = GRPC_CODE_DATA_LOSS


class ServerStartError(PocketflowError):
    """A storage server process could not be found, started, or did not become ready."""


class ClusterError(PocketflowError):
    """The cluster (Ray, the controller, storage nodes) failed or is not running."""


class ConfigError(PocketflowError, ValueError):
    """A configuration value is unknown or cannot be parsed (also a ``ValueError``)."""


class ShuffleFailed(PocketflowError):
    """A framework shuffle could not finish: inputs never arrived within their bound, or
    partitions lost with a storage server could not be regenerated within the allowed rounds."""


class S3Error(PocketflowError):
    """A request to the S3-compatible store behind a read-through cache (:mod:`pocketflow.cache`)
    failed. ``code`` is S3's error code (``NoSuchKey``, ``AccessDenied``, ``SlowDown``, ...) or
    the HTTP status as text, ``status`` the HTTP status (0 when no answer came), ``bucket`` and
    ``key`` what was asked for, ``detail`` S3's own message. Each subclass is also the
    pocketflow family of its failure, so ``except pocketflow.ObjectNotFound`` catches a key
    missing in S3 as well."""

    def __init__(
        self, message: str = "", *, code: str = "", status: int = 0, bucket: str = "",
        key: str | None = None, detail: str = "", server: str | None = None,
    ) -> None:
        super().__init__(message, server=server)
        self.detail = detail
        self.code = code
        self.status = status
        self.bucket = bucket
        self.key = key


class S3ObjectNotFound(S3Error, ObjectNotFound):
    """The key does not exist in the S3 bucket (``NoSuchKey``, or 404 on HEAD)."""


class S3BucketNotFound(S3Error, BucketNotFound):
    """The S3 bucket does not exist (``NoSuchBucket``)."""


class S3AccessDenied(S3Error, PermissionDenied):
    """S3 refused the credentials or the request (``AccessDenied``, 403, a bad signature or key
    id, an expired token)."""


class S3Unavailable(S3Error, DataUnavailable):
    """S3 could not be reached or could not serve now: no connection, a timeout, a 5xx answer,
    throttling (``SlowDown``). Worth retrying later."""


class S3InvalidRequest(S3Error, InvalidRequest):
    """S3 refused the request as malformed or not allowed (any other 4xx answer, e.g.
    ``InvalidBucketName``); also a ``ValueError``."""


_S3_DENIED_CODES = frozenset({
    "AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "ExpiredToken", "InvalidToken", "TokenRefreshRequired", "AccountProblem",
})
_S3_UNAVAILABLE_CODES = frozenset({
    "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
    "ThrottlingException", "RequestTimeTooSkewed", "OperationAborted",
})


def s3_error(
    code: str, status: int, message: str, *, bucket: str, key: str | None = None
) -> S3Error:
    """The typed error of an S3 failure, from its error code and HTTP status: the one rule,
    used for boto3's exceptions (:func:`error_from_s3`) and for failures a cache recorded."""
    cls: type[S3Error]
    if code == "NoSuchBucket":
        cls = S3BucketNotFound
    elif code in ("NoSuchKey", "NotFound") or (status == 404 and code in ("404", "")):
        cls = S3ObjectNotFound
    elif code in _S3_DENIED_CODES or status in (401, 403):
        cls = S3AccessDenied
    elif code in _S3_UNAVAILABLE_CODES or status == 0 or status >= 500 or status == 429:
        cls = S3Unavailable
    else:
        cls = S3InvalidRequest
    where = f"s3://{bucket}/{key}" if key is not None else f"s3://{bucket}"
    text = f"{code or status}: {message}" if message else str(code or status)
    return cls(f"S3 {where}: {text}", code=code, status=status, bucket=bucket, key=key,
               detail=message)


def error_from_s3(exc: BaseException, *, bucket: str, key: str | None = None) -> PocketflowError:
    """Map an exception raised by boto3/botocore on a request for ``bucket``/``key`` to a
    pocketflow error (the caller raises it ``from exc``). A ``ClientError`` (S3 answered) maps by
    its code and status (:func:`s3_error`); a failure to get an answer at all (no connection,
    timeouts, a connection closed mid-answer) is :class:`S3Unavailable`."""
    if isinstance(exc, PocketflowError):
        return exc
    # Imported here: pocketflow's errors stay importable without botocore (an extra).
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {}) or {}
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return s3_error(str(error.get("Code", "") or ""), status,
                        str(error.get("Message", "") or ""), bucket=bucket, key=key)
    if isinstance(exc, (BotoCoreError, OSError)):
        return s3_error("", 0, f"{type(exc).__name__}: {exc}", bucket=bucket, key=key)
    return s3_error("", 0, f"unexpected {type(exc).__name__}: {exc}", bucket=bucket, key=key)


_KIND_TO_CLASS: dict[str, type[PocketflowError]] = {
    cls.kind: cls
    for cls in (
        ObjectNotFound,
        BucketNotFound,
        JobNotRegistered,
        ObjectExists,
        BucketExists,
        CapacityExhausted,
        InvalidRequest,
        ServerDraining,
        ServerSuspect,
        ClientBusy,
        PermissionDenied,
        StaleEpoch,
        PersistNotSupported,
        InternalError,
        QueueFull,
        SegmentSealed,
        LeaseTableFull,
        DataLost,
    )
    if cls.kind is not None
}

# The exception class for a gRPC code when the message names no kind we know.
_CODE_TO_CLASS: dict[int, type[PocketflowError]] = {
    GRPC_CODE_CANCELLED: DataUnavailable,
    GRPC_CODE_INVALID_ARGUMENT: InvalidRequest,
    GRPC_CODE_DEADLINE_EXCEEDED: DataUnavailable,
    GRPC_CODE_NOT_FOUND: ObjectNotFound,
    GRPC_CODE_ALREADY_EXISTS: ObjectExists,
    GRPC_CODE_PERMISSION_DENIED: PermissionDenied,
    GRPC_CODE_RESOURCE_EXHAUSTED: CapacityExhausted,
    GRPC_CODE_FAILED_PRECONDITION: InternalError,
    GRPC_CODE_INTERNAL: InternalError,
    GRPC_CODE_UNAVAILABLE: DataUnavailable,
    GRPC_CODE_DATA_LOSS: DataLost,
    GRPC_CODE_UNAUTHENTICATED: PermissionDenied,
}

# The kinds that travel with UNAVAILABLE but are not a transport failure.
_UNAVAILABLE_KINDS = frozenset({ServerDraining.kind, ServerSuspect.kind, ClientBusy.kind})

# Longest kinds first so that "bucket_not_found" is not read as "not_found".
_KIND_PATTERN = re.compile(
    r"(?<![A-Za-z0-9_])("
    + "|".join(sorted((re.escape(k) for k in _KIND_TO_CLASS), key=len, reverse=True))
    + r"): "
)
_JSON_DECODER = json.JSONDecoder()


def error_from_kind(
    kind: str, message: str, *, server: str | None = None
) -> PocketflowError:
    """Build the exception for a server error kind and the text after ``"<kind>: "``."""
    cls = _KIND_TO_CLASS.get(kind)
    if cls is None:
        return InternalError(f"{kind}: {message}", server=server)
    if cls is StaleEpoch:
        weight_map: dict[str, Any] | None = None
        try:
            parsed, _ = _JSON_DECODER.raw_decode(message.lstrip())
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            weight_map = parsed
        return StaleEpoch("stale_epoch: the job's weight map changed",
                          weight_map=weight_map, server=server)
    return cls(f"{kind}: {message}", server=server)


def _from_text(text: str, code: int, server: str | None) -> PocketflowError:
    match = _KIND_PATTERN.search(text)
    if match is not None:
        rest = text[match.end():]
        if match.group(1) == PermissionDenied.kind and (
            rest.startswith(TLS_MESSAGE_PREFIX) or "accepts TLS connections only" in rest
        ):
            return TlsError(f"{PermissionDenied.kind}: {rest}", server=server)
        return error_from_kind(match.group(1), rest, server=server)
    cls = _CODE_TO_CLASS.get(code, InternalError)
    return cls(text, server=server)


def error_from_status(
    status: int, body: bytes | memoryview, *, server: str | None = None
) -> PocketflowError:
    """Map one DoExchange reply (status byte, UTF-8 body ``"<kind>: <message>"``) to an error."""
    text = bytes(body).decode("utf-8", errors="replace")
    return _from_text(text, status, server)


def error_from_flight(exc: BaseException, *, server: str | None = None) -> PocketflowError:
    """Map an exception raised by ``pyarrow.flight`` (or the socket below it) to a pocketflow error,
    for programs that talk to the servers with a plain Arrow Flight client (``pip install
    pocketflow[flight]``); the pocketflow client itself does not use pyarrow.

    The kind is read from the message, which the server opens with ``"<kind>: "``; the exception
    class only decides when no known kind appears (a transport failure, a proxy, a crash). The
    caller raises the result ``from exc`` so the cause stays chained.
    """
    if isinstance(exc, PocketflowError):
        return exc
    # Imported here so that errors.py stays importable without pyarrow (the control plane's
    # pure modules and the CLI import it).
    import pyarrow as pa
    import pyarrow.flight as flight

    text = str(exc)
    if isinstance(exc, flight.FlightUnavailableError):
        code = GRPC_CODE_UNAVAILABLE
    elif isinstance(exc, flight.FlightTimedOutError):
        code = GRPC_CODE_DEADLINE_EXCEEDED
    elif isinstance(exc, flight.FlightCancelledError):
        code = GRPC_CODE_CANCELLED
    elif isinstance(exc, flight.FlightUnauthorizedError):
        code = GRPC_CODE_PERMISSION_DENIED
    elif isinstance(exc, flight.FlightUnauthenticatedError):
        code = GRPC_CODE_UNAUTHENTICATED
    elif isinstance(exc, flight.FlightInternalError):
        code = GRPC_CODE_INTERNAL
    elif isinstance(exc, pa.ArrowKeyError):
        code = GRPC_CODE_NOT_FOUND
    elif isinstance(exc, pa.ArrowInvalid):
        # Arrow folds INVALID_ARGUMENT, RESOURCE_EXHAUSTED and FAILED_PRECONDITION into Invalid;
        # the kind in the message tells them apart.
        if "resource exhausted" in text:
            code = GRPC_CODE_RESOURCE_EXHAUSTED
        elif "precondition" in text:
            code = GRPC_CODE_FAILED_PRECONDITION
        else:
            code = GRPC_CODE_INVALID_ARGUMENT
    elif isinstance(exc, (ConnectionError, TimeoutError, OSError)):
        code = GRPC_CODE_UNAVAILABLE
    else:
        code = GRPC_CODE_INTERNAL
    return error_from_grpc(code, text, server=server)


def error_from_grpc(code: int, message: str, *, server: str | None = None) -> PocketflowError:
    """Map a gRPC status (code and message) to a pocketflow error; the Rust client core
    (``pocketflow._core``) raises every failure through this function.

    The kind is read from the message, which the server opens with ``"<kind>: "``; the code only
    decides when no known kind appears. Transport codes (unavailable, deadline, cancelled,
    unknown) are :class:`DataUnavailable` unless the message opens with a kind of their own:
    the server is draining, a check refused for a suspect server, or the client is busy.
    """
    if code in (GRPC_CODE_UNAVAILABLE, GRPC_CODE_DEADLINE_EXCEEDED, GRPC_CODE_CANCELLED,
                GRPC_CODE_UNKNOWN):
        # Anything else with these codes is the transport failing.
        match = _KIND_PATTERN.search(message)
        if match is not None and match.group(1) in _UNAVAILABLE_KINDS:
            return error_from_kind(match.group(1), message[match.end():], server=server)
        if message.startswith("unavailable: "):
            return DataUnavailable(message, server=server)
        return DataUnavailable(f"unavailable: {message}", server=server)
    return _from_text(message, code, server)
