"""The cache's pure parts: key naming, record codecs, S3 error mapping, access batches."""

from __future__ import annotations

import pytest

from pocketflow.cache.access_log import (
    ACCESS_ITEM_MAX_BYTES,
    Access,
    decode_batch,
    encode_batches,
)
from pocketflow.cache.records import (
    CACHE_KEY_MAX_BYTES,
    Claim,
    Meta,
    Outcome,
    cache_key,
    done_key,
    entry_key,
)
from pocketflow.cache.source import S3Source
from pocketflow.cache.spec import CacheSpec
from pocketflow.cache.working_set import (
    BOOKKEEPING_BYTES,
    ENTRIES_RESERVED_MAX,
    ENTRY_RECORDS_BYTES,
    capacity_of_reservation,
    reservation_bytes,
)
from pocketflow.errors import (
    BucketNotFound,
    DataUnavailable,
    InvalidRequest,
    ObjectNotFound,
    PermissionDenied,
    S3AccessDenied,
    S3BucketNotFound,
    S3InvalidRequest,
    S3ObjectNotFound,
    S3Unavailable,
    error_from_s3,
    s3_error,
)
from pocketflow.handle import JobHandle, ServerInfo
from pocketflow.protocol import KEY_MAX_BYTES


def test_cache_keys() -> None:
    assert cache_key("inputs", "a/b") == "inputs/a/b"
    long_key = "k" * 2000
    hashed = cache_key("inputs", long_key)
    assert hashed.startswith("inputs#") and len(hashed.encode()) <= CACHE_KEY_MAX_BYTES
    assert cache_key("inputs", long_key) == hashed != cache_key("inputs", long_key + "x")
    top = cache_key("b" * 63, "é" * ((CACHE_KEY_MAX_BYTES - 64) // 2))
    for name in (entry_key(top, '"etag-1"'), done_key(top, "0123456789abcdef")):
        assert len(name.encode()) <= KEY_MAX_BYTES
    assert entry_key("b/k", "e1") != entry_key("b/k", "e2")
    for bad in (("", "k"), ("a/b", "k"), ("a#b", "k"), ("b", "")):
        with pytest.raises(InvalidRequest):
            cache_key(*bad)


def test_record_codecs() -> None:
    meta = Meta("value", "abc", 12, 1000)
    assert Meta.decode(meta.encode()) == meta
    assert meta.fresh(1500, 1000) and not meta.fresh(2000, 1000) and not meta.fresh(1000, 0)
    claim = Claim("f" * 16, 123, "host:1")
    assert Claim.decode(claim.encode()) == claim
    outcome = Outcome("error", code="AccessDenied", status=403, message="no")
    assert Outcome.decode(outcome.encode()) == outcome
    for bad in (b"", b"{}", b'{"v":9}', b'{"v":1,"s":"bogus","e":"","n":0,"t":0}'):
        with pytest.raises(InvalidRequest):
            Meta.decode(bad)


@pytest.mark.parametrize(("code", "status", "cls", "family"), [
    ("NoSuchKey", 404, S3ObjectNotFound, ObjectNotFound),
    ("404", 404, S3ObjectNotFound, ObjectNotFound),
    ("NoSuchBucket", 404, S3BucketNotFound, BucketNotFound),
    ("AccessDenied", 403, S3AccessDenied, PermissionDenied),
    ("SignatureDoesNotMatch", 403, S3AccessDenied, PermissionDenied),
    ("SlowDown", 503, S3Unavailable, DataUnavailable),
    ("InternalError", 500, S3Unavailable, DataUnavailable),
    ("", 0, S3Unavailable, DataUnavailable),
    ("InvalidBucketName", 400, S3InvalidRequest, ValueError),
    ("KeyTooLongError", 400, S3InvalidRequest, InvalidRequest),
])
def test_s3_errors_map_by_code_and_status(code: str, status: int, cls: type,
                                          family: type) -> None:
    error = s3_error(code, status, "message", bucket="b", key="k")
    assert type(error) is cls and isinstance(error, family)
    assert (error.code, error.status, error.bucket, error.key, error.detail) == (
        code, status, "b", "k", "message")


def test_boto_exceptions_map() -> None:
    from botocore.exceptions import ClientError, EndpointConnectionError

    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "no"},
                          "ResponseMetadata": {"HTTPStatusCode": 403}}, "GetObject")
    assert isinstance(error_from_s3(denied, bucket="b", key="k"), S3AccessDenied)
    down = EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    assert isinstance(error_from_s3(down, bucket="b"), S3Unavailable)


def test_access_batches_round_trip_and_stay_bounded() -> None:
    accesses = [Access("b", f"key/{i:06d}", i, f"etag{i}", 1 + i % 3, i % 2, i % 5 == 0)
                for i in range(3000)]
    items = encode_batches(accesses)
    assert len(items) > 1 and all(len(item) <= ACCESS_ITEM_MAX_BYTES for item in items)
    assert [a for item in items for a in decode_batch(item)] == accesses
    with pytest.raises(InvalidRequest):
        decode_batch(b"nonsense")
    # A batch of a client that counts no refused fills decodes with none; eight fields do not.
    assert decode_batch(b'{"v":1,"a":[["b","k",3,"e",1,1]]}') == [Access("b", "k", 3, "e", 1, 1)]
    with pytest.raises(InvalidRequest):
        decode_batch(b'{"v":1,"a":[["b","k",3,"e",1,1,0,0]]}')


def test_a_reservation_covers_the_entries_records_and_reads_back() -> None:
    """What a cache reserves for a capacity covers its entries' records at their mean size
    (more per byte for small entries), and the capacity a reservation holds reads back."""
    MiB = 1024 * 1024
    small = reservation_bytes(64 * MiB, entry_bytes_mean=4096)
    assert small == 64 * MiB + 16384 * ENTRY_RECORDS_BYTES + BOOKKEEPING_BYTES
    large = reservation_bytes(64 * MiB, entry_bytes_mean=MiB)
    assert 64 * MiB + BOOKKEEPING_BYTES < large < small
    tiny = reservation_bytes(64 * MiB, entry_bytes_mean=1)
    assert tiny == 64 * MiB + ENTRIES_RESERVED_MAX * ENTRY_RECORDS_BYTES + BOOKKEEPING_BYTES
    for capacity, mean in ((64 * MiB, 4096), (25 * MiB, MiB), (1000, 300), (16 * MiB, 1)):
        reserved = reservation_bytes(capacity, entry_bytes_mean=mean)
        back = capacity_of_reservation(reserved, entry_bytes_mean=mean)
        assert capacity - ENTRY_RECORDS_BYTES <= back <= capacity
        assert reservation_bytes(back, entry_bytes_mean=mean) <= reserved
    assert capacity_of_reservation(BOOKKEEPING_BYTES // 2, entry_bytes_mean=4096) == 0


def test_spec_round_trip_and_checks() -> None:
    handle = JobHandle(job_id="cache-x-1", name="cache-x", epoch=1,
                       servers=(ServerInfo("dram-0", "127.0.0.1:1", "dram", 1.0, True),),
                       token="t", block_size_bytes=1 << 20)
    spec = CacheSpec(name="x", handle=handle, source=S3Source(endpoint_url="http://h:1"),
                     lease_ms=0, run_id="r1", claim_ms=500)
    assert CacheSpec.from_json(spec.to_json()) == spec
    for bad in ({"lease_ms": -1}, {"lease_ms": True}, {"claim_ms": 5}, {"fill_wait_s": 0}):
        with pytest.raises(InvalidRequest):
            CacheSpec(name="x", handle=handle, source=S3Source(), **bad)
    with pytest.raises(InvalidRequest):
        CacheSpec.from_json('{"name": "x"}')
