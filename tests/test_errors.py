"""The error hierarchy and the one mapping from server kinds and Flight exceptions to it."""

import pyarrow as pa
import pyarrow.flight as flight
import pytest

from pocketflow import errors
from pocketflow.errors import (
    AlreadyExists,
    BucketExists,
    BucketNotFound,
    CapacityExhausted,
    DataUnavailable,
    FailedPrecondition,
    InternalError,
    InvalidRequest,
    JobNotRegistered,
    NotFound,
    ObjectExists,
    ObjectNotFound,
    PermissionDenied,
    PersistNotSupported,
    PocketflowError,
    QueueFull,
    SegmentSealed,
    ServerDraining,
    StaleEpoch,
    Unavailable,
    error_from_flight,
    error_from_status,
)

# The table of docs/PROTOCOL.md: kind, gRPC code (status byte), exception.
PROTOCOL_TABLE = [
    ("not_found", 5, ObjectNotFound),
    ("bucket_not_found", 5, BucketNotFound),
    ("job_not_registered", 5, JobNotRegistered),
    ("already_exists", 6, ObjectExists),
    ("bucket_exists", 6, BucketExists),
    ("capacity_exhausted", 8, CapacityExhausted),
    ("invalid_argument", 3, InvalidRequest),
    ("draining", 14, ServerDraining),
    ("permission_denied", 7, PermissionDenied),
    ("stale_epoch", 9, StaleEpoch),
    ("persist_refused", 9, PersistNotSupported),
    ("internal", 13, InternalError),
    ("queue_full", 8, QueueFull),
    ("sealed", 9, SegmentSealed),
    ("lease_table_full", 8, errors.LeaseTableFull),
    ("data_lost", 15, errors.DataLost),
]


@pytest.mark.parametrize(("kind", "code", "cls"), PROTOCOL_TABLE)
def test_exchange_status_maps_one_to_one(kind: str, code: int, cls: type) -> None:
    error = error_from_status(code, f"{kind}: something about it".encode(), server="127.0.0.1:1")
    assert type(error) is cls
    assert cls.kind == kind
    assert cls.grpc_code == code
    assert error.server == "127.0.0.1:1"
    assert "127.0.0.1:1" in str(error)


def test_families() -> None:
    assert issubclass(ObjectNotFound, NotFound) and issubclass(BucketNotFound, NotFound)
    assert issubclass(errors.JobNotRegistered, NotFound)
    assert issubclass(ObjectExists, AlreadyExists) and issubclass(BucketExists, AlreadyExists)
    assert issubclass(ServerDraining, Unavailable) and issubclass(DataUnavailable, Unavailable)
    assert issubclass(StaleEpoch, FailedPrecondition)
    assert issubclass(PersistNotSupported, FailedPrecondition)
    for name in errors.__all__:
        value = getattr(errors, name)
        if isinstance(value, type):
            assert issubclass(value, PocketflowError)
    assert issubclass(InvalidRequest, ValueError)
    assert issubclass(errors.ConfigError, ValueError)


def test_bucket_not_found_is_not_read_as_not_found() -> None:
    error = error_from_status(5, b"bucket_not_found: no bucket 'b' for job j")
    assert type(error) is BucketNotFound


def test_stale_epoch_carries_the_map() -> None:
    body = b'stale_epoch: {"epoch":3,"servers":[["dram-0","127.0.0.1:9","dram",1,0]]}'
    error = error_from_status(9, body)
    assert isinstance(error, StaleEpoch)
    assert error.weight_map == {"epoch": 3, "servers": [["dram-0", "127.0.0.1:9", "dram", 1, 0]]}


def test_unknown_kind_falls_back_on_code() -> None:
    assert type(error_from_status(5, b"no kind here")) is ObjectNotFound
    assert type(error_from_status(8, b"")) is CapacityExhausted
    assert type(error_from_status(42, b"strange")) is InternalError


def _grpc_message(kind_text: str) -> str:
    # What pyarrow makes of a status from a non-C++ server.
    return (
        f"Flight returned error, with message: {kind_text}. gRPC client debug context: "
        f'UNKNOWN:Error received from peer {{grpc_message:"{kind_text}", grpc_status:9}}'
    )


def test_flight_exceptions_map_by_kind() -> None:
    cases = [
        (pa.ArrowKeyError(_grpc_message("not_found: k")), ObjectNotFound),
        (pa.ArrowInvalid(_grpc_message("capacity_exhausted: full")), CapacityExhausted),
        (flight.FlightUnauthorizedError(_grpc_message("permission_denied: bad")),
         PermissionDenied),
        (flight.FlightInternalError(_grpc_message("internal: bug")), InternalError),
        (flight.FlightUnavailableError(_grpc_message("draining: bye")), ServerDraining),
        (pa.ArrowInvalid(_grpc_message("persist_refused: not long-running")),
         PersistNotSupported),
        (flight.FlightServerError(_grpc_message("bucket_exists: b")), BucketExists),
    ]
    for exc, cls in cases:
        mapped = error_from_flight(exc, server="s:1")
        assert type(mapped) is cls, (exc, mapped)


def test_transport_failures_are_data_unavailable() -> None:
    refused = flight.FlightUnavailableError(
        "Flight returned unavailable error, with message: failed to connect to all addresses; "
        "last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: not_found: x"
    )
    assert type(error_from_flight(refused)) is DataUnavailable
    assert type(error_from_flight(flight.FlightTimedOutError("deadline"))) is DataUnavailable
    assert type(error_from_flight(flight.FlightCancelledError("cancelled"))) is DataUnavailable
    assert type(error_from_flight(ConnectionResetError("reset"))) is DataUnavailable


def test_stale_epoch_from_flight_message_with_trailing_text() -> None:
    exc = pa.ArrowInvalid(_grpc_message('stale_epoch: {"epoch": 7, "servers": []}'))
    mapped = error_from_flight(exc)
    assert isinstance(mapped, StaleEpoch)
    assert mapped.weight_map == {"epoch": 7, "servers": []}


def test_pocketflow_errors_pass_through() -> None:
    original = CapacityExhausted("capacity_exhausted: x")
    assert error_from_flight(original) is original
