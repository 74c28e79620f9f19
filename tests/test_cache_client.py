"""The read-through cache's data path (``pocketflow.cache.client``) against a real S3 server
(SeaweedFS) and real storage servers: hits, misses, the validation lease and its staleness
bound, listings, writes and deletes through the cache, single flight across processes (and a
fill whose process is killed), S3 errors as typed errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest
from fixtures_s3 import boto3_client

from pocketflow.cache import client as cache_client
from pocketflow.cache.client import WAIT_HEAD_KEYS, CacheClient, create_buckets
from pocketflow.cache.records import (
    CLAIM_BUCKET,
    ENTRY_BUCKET,
    META_BUCKET,
    Meta,
    cache_key,
    entry_key,
)
from pocketflow.cache.source import S3Source, request_counts
from pocketflow.cache.spec import CacheSpec
from pocketflow.client import connect
from pocketflow.errors import (
    ObjectNotFound,
    S3BucketNotFound,
    S3InvalidRequest,
    S3ObjectNotFound,
    S3Unavailable,
)
from pocketflow.handle import JobHandle

CLIENT_OPTIONS = {"op_timeout_s": "10s", "rpc_timeout_s": "10s", "stream_timeout_s": "60s"}
PROCESS_TIMEOUT_S = 120.0


@pytest.fixture
def cache_spec(job_handle: JobHandle, s3_server: S3Source) -> CacheSpec:
    with connect(job_handle, **CLIENT_OPTIONS) as pf:
        create_buckets(pf)
    return CacheSpec(name="t", handle=job_handle, source=s3_server, lease_ms=60_000)


@pytest.fixture
def s3(s3_server: S3Source) -> Iterator[Any]:
    client = boto3_client(s3_server)
    yield client
    client.close()


def _cache(spec: CacheSpec, **changes: Any) -> CacheClient:
    from dataclasses import replace

    return CacheClient(replace(spec, **changes) if changes else spec)


def _gets() -> int:
    return request_counts().get("GetObject", 0)


def _lists() -> int:
    return request_counts().get("ListObjectsV2", 0)


def test_miss_fills_and_a_hit_asks_s3_nothing(cache_spec: CacheSpec, s3: Any,
                                              s3_bucket: str) -> None:
    s3.put_object(Bucket=s3_bucket, Key="in/a", Body=b"alpha" * 1000)
    with _cache(cache_spec) as cache:
        before = _gets()
        assert cache.get(s3_bucket, "in/a") == b"alpha" * 1000
        assert _gets() - before == 1
        cache.flush()  # the fill is written by the client's publisher thread
        assert cache.stats.filled == 1
        before = _gets()
        for _ in range(3):
            assert cache.get(s3_bucket, "in/a") == b"alpha" * 1000
        assert _gets() == before, "a fresh hit must not ask S3"
        assert cache.stats.fresh == 3
        # The entry is in pocketflow, named by its version.
        meta = cache.client.get(META_BUCKET, cache_key(s3_bucket, "in/a"))
        assert b'"s":"value"' in meta


def test_large_object_and_range(cache_spec: CacheSpec, s3: Any, s3_bucket: str) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    s3.put_object(Bucket=s3_bucket, Key="big", Body=data)
    with _cache(cache_spec) as cache:
        assert cache.get(s3_bucket, "big") == data
        # The fill is written behind the read; a read racing that write may fetch the key again
        # (a noted race), which is not what this test is about.
        cache.flush()
        before = _gets()
        assert cache.get_range(s3_bucket, "big", 1024 * 1024 - 5, 10) == data[
            1024 * 1024 - 5:1024 * 1024 + 5]
        assert cache.stat(s3_bucket, "big")[1] == len(data)
        assert [k for k, _ in cache.list(s3_bucket)] == ["big"]
        assert _gets() == before


def test_a_second_client_in_another_process_hits(cache_spec: CacheSpec, s3: Any,
                                                 s3_bucket: str) -> None:
    s3.put_object(Bucket=s3_bucket, Key="shared", Body=b"x" * 70_000)
    with _cache(cache_spec) as cache:
        cache.get(s3_bucket, "shared")
    script = (
        "import sys, json\n"
        "from pocketflow.cache import connect\n"
        "from pocketflow.cache.source import request_counts\n"
        f"c = connect(sys.stdin.read())\n"
        f"assert c.get({s3_bucket!r}, 'shared') == b'x' * 70_000\n"
        "print(json.dumps([c.stats.fresh, request_counts().get('GetObject', 0)]))\n"
        "c.close()\n"
    )
    out = _run(script, cache_spec.to_json())
    assert out.strip().endswith("[1, 0]"), out


VIEWS_TASK = """
import json, resource, sys
from pocketflow.cache import connect
spec, bucket, keys, how = sys.stdin.read().split("\\n")
c = connect(spec)
keys = json.loads(keys)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
data = c.get_views(bucket, keys) if how == "views" else c.get_many(bucket, keys)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
ok = all(bytes(d) == k.encode() * (len(d) // len(k)) for k, d in zip(keys, data))
print(json.dumps({"faults": faults, "ok": ok, "types": sorted({type(d).__name__ for d in data}),
                  "fresh": c.stats.fresh}))
c.close()
"""


def _huge_pages_on_request() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as mode:
            return "[never]" not in mode.read()
    except OSError:
        return False


@pytest.fixture
def shm_pool(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A shared-memory read pool of the test's own in ``/dev/shm`` (a slot's pages stay
    allocated there, as in the default pool; a file elsewhere is on disk), removed after."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    pool = f"/dev/shm/pocketflow-test-arenas-{os.getpid()}-{tmp_path.name}"
    monkeypatch.setenv(cache_client.ARENA_POOL_ENV, pool)
    yield pool
    import gc

    gc.collect()  # views a caught error's traceback holds, in a cycle with its frames
    cache_client.free_arena_pool()
    assert not os.path.exists(pool), "a slot of the test's pool is still held"


def test_views_of_hits_share_one_buffer_with_huge_pages(
        cache_spec: CacheSpec, s3: Any, s3_bucket: str, shm_pool: str) -> None:
    """``get_views`` reads a round's cached entries into one buffer: the same bytes as
    ``get_many`` (fresh hits, stale ones revalidated, misses), each a read-only view; in a
    fresh process the buffer is the pool slot an earlier round left, its pages allocated
    already (``get_many``'s 16 x 1 MiB ``bytes`` fault ~4,000 times), so the task's reads cost
    a fraction of the page faults. The pool is the test's own: a slot made fresh (after the
    pool was freed) faults its pages in once, as ``bytes`` do, so the task reuses the slot
    the test's first round made."""
    keys = [f"v/{i:02d}" for i in range(16)]
    for key in keys:
        s3.put_object(Bucket=s3_bucket, Key=key, Body=key.encode() * ((1 << 20) // len(key)))
    with _cache(cache_spec, lease_ms=60_000) as cache:
        cache.get_many(s3_bucket, keys)
        cache.flush()
        views = cache.get_views(s3_bucket, keys)
        assert all(isinstance(v, memoryview) and v.readonly for v in views)
        assert [bytes(v) for v in views] == cache.get_many(s3_bucket, keys)
        with pytest.raises(S3ObjectNotFound):
            cache.get_views(s3_bucket, keys[:2] + ["v/none"])
        del views  # its slot free again, for the task process below
    spec_json = cache_spec.to_json()
    runs = {how: json.loads(_run(VIEWS_TASK, f"{spec_json}\n{s3_bucket}\n{json.dumps(keys)}"
                                               f"\n{how}").strip().splitlines()[-1])
            for how in ("views", "bytes")}
    assert runs["views"]["ok"] and runs["bytes"]["ok"], runs
    assert runs["views"]["types"] == ["memoryview"] and runs["views"]["fresh"] == len(keys)
    if _huge_pages_on_request():
        assert runs["views"]["faults"] * 4 < runs["bytes"]["faults"], runs
    # Stale entries (lease over) are revalidated and read into views too; a changed key is
    # filled anew and served as a view of its new bytes.
    with _cache(cache_spec, lease_ms=300) as cache:
        time.sleep(0.4)
        s3.put_object(Bucket=s3_bucket, Key=keys[3], Body=b"changed")
        views = cache.get_views(s3_bucket, keys)
        assert bytes(views[3]) == b"changed"
        assert [bytes(v) for i, v in enumerate(views) if i != 3] == [
            k.encode() * ((1 << 20) // len(k)) for i, k in enumerate(keys) if i != 3]
        assert cache.stats.revalidated == len(keys) - 1


def _slot_locked(path: str) -> bool:
    """Whether some process holds the pool slot ``path`` (a non-blocking flock fails)."""
    import fcntl

    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases a lock this check took
    return False


def _slot_of(view: memoryview) -> str | None:
    region = view.obj
    fd = getattr(region, "_lock_fd", -1)
    return os.readlink(f"/proc/self/fd/{fd}") if fd >= 0 else None


def test_views_go_into_pooled_slots_held_while_their_views_live(
        cache_spec: CacheSpec, s3: Any, s3_bucket: str, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``get_views`` rounds go into slots of the host's shared-memory pool: a slot stays locked
    while any view of it lives (a second reader meanwhile gets another), is free again once
    they are dropped, and with every slot held a round falls back to a private mapping, the
    same bytes each way."""
    pool = tmp_path / "pool"
    monkeypatch.setenv(cache_client.ARENA_POOL_ENV, str(pool))
    keys = [f"p/{i}" for i in range(4)]
    expected = [key.encode() * ((1 << 20) // len(key)) for key in keys]
    for key, body in zip(keys, expected, strict=True):
        s3.put_object(Bucket=s3_bucket, Key=key, Body=body)
    with _cache(cache_spec, lease_ms=60_000) as cache:
        cache.get_many(s3_bucket, keys)
        cache.flush()  # cached: the views below are hits, read into one buffer
        first = cache.get_views(s3_bucket, keys)
        slot = _slot_of(first[0])
        assert slot is not None and slot.startswith(str(pool))
        assert [bytes(v) for v in first] == expected
        assert _slot_locked(slot)
        second = cache.get_views(s3_bucket, keys)
        assert _slot_of(second[0]) not in (None, slot)
        assert [bytes(v) for v in second] == expected
        del first
        assert not _slot_locked(slot)
        held = [cache_client._arena(4 << 20) for _ in range(cache_client.ARENA_POOL_SLOTS - 1)]
        assert all(isinstance(h, cache_client._Slot) for h in held)
        private = cache.get_views(s3_bucket, keys)  # every slot held: a private mapping
        assert _slot_of(private[0]) is None
        assert [bytes(v) for v in private] == expected
        del held, second, private
    assert len(list(pool.iterdir())) == cache_client.ARENA_POOL_SLOTS
    monkeypatch.setenv(cache_client.ARENA_POOL_ENV, "0")
    assert cache_client._arena(4 << 20).__class__ is not cache_client._Slot


SLOT_TASK = """
import os, sys, time
from pocketflow.cache import connect
spec, bucket, key = sys.stdin.read().split("\\n")
c = connect(spec)
views = c.get_views(bucket, [key])
print(os.readlink(f"/proc/self/fd/{views[0].obj._lock_fd}"), flush=True)
time.sleep(600)
"""


def test_a_reader_killed_holding_a_slot_frees_it(
        cache_spec: CacheSpec, s3: Any, s3_bucket: str, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader SIGKILLed while its views hold a pool slot leaves the slot free (its lock goes
    with its process), so the pool does not shrink by the readers that died."""
    pool = tmp_path / "pool"
    monkeypatch.setenv(cache_client.ARENA_POOL_ENV, str(pool))
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"x" * (3 << 20))
    with _cache(cache_spec, lease_ms=60_000) as cache:
        cache.get(s3_bucket, "k")
        cache.flush()
    proc = _spawn(SLOT_TASK, f"{cache_spec.to_json()}\n{s3_bucket}\nk")
    try:
        assert proc.stdout is not None
        slot = proc.stdout.readline().strip()
        assert slot.startswith(str(pool)), proc.stderr.read() if proc.stderr else slot
        assert _slot_locked(slot)
    finally:
        proc.kill()
        proc.communicate(timeout=PROCESS_TIMEOUT_S)
    assert proc.returncode == -signal.SIGKILL
    assert not _slot_locked(slot)


def test_revalidation_after_the_lease(cache_spec: CacheSpec, s3: Any, s3_bucket: str) -> None:
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v1")
    with _cache(cache_spec, lease_ms=400) as cache:
        assert cache.get(s3_bucket, "k") == b"v1"
        cache.flush()  # the fill is written by the publisher thread
        time.sleep(0.5)
        before = _gets()
        assert cache.get(s3_bucket, "k") == b"v1"
        assert _gets() - before == 1, "one conditional request revalidates"
        assert cache.stats.revalidated == 1 and cache.stats.validations == 1
        # Renewed: the next read within the lease asks nothing.
        before = _gets()
        assert cache.get(s3_bucket, "k") == b"v1"
        assert _gets() == before


def test_a_refill_while_a_revalidation_waits_on_s3_is_not_reverted_by_its_renewal(
        cache_spec: CacheSpec, s3: Any, s3_bucket: str) -> None:
    """A read revalidates a stale key (S3: not modified) and, before it renews the key's meta,
    the object changes and another task refills it with the new ETag: the renewal re-reads
    the meta, finds it changed and leaves it, so the newer version is kept (it used to be
    overwritten with the old ETag dated at the revalidation's send time, going back in
    version within the lease). The order is fixed: the other task's read runs once the
    first read's S3 answer is in, before that read returns to renew."""
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v1")
    with _cache(cache_spec, lease_ms=400) as first, _cache(cache_spec, lease_ms=400) as other:
        assert first.get(s3_bucket, "k") == b"v1"
        first.flush()
        time.sleep(0.5)  # stale for both
        ask_s3 = first._s3_each

        def answer_then_refill(bucket: str, asks: list[Any], **options: Any) -> list[Any]:
            answers = ask_s3(bucket, asks, **options)
            s3.put_object(Bucket=s3_bucket, Key="k", Body=b"version 2")
            assert other.get(s3_bucket, "k") == b"version 2"  # refilled with the new ETag
            other.flush()
            return answers

        first._s3_each = answer_then_refill  # type: ignore[method-assign]
        assert first.get(s3_bucket, "k") == b"v1"  # what S3 answered when asked
        first.flush()
        assert first.stats.revalidated == 1 and other.stats.filled == 1
    with connect(cache_spec.handle, **CLIENT_OPTIONS) as pf:
        meta = Meta.decode(pf.get(META_BUCKET, cache_key(s3_bucket, "k")))
    assert meta.size == len(b"version 2"), "the renewal reverted the refill"
    with _cache(cache_spec, lease_ms=400) as third:
        gets = _gets()
        assert third.get(s3_bucket, "k") == b"version 2"
        assert _gets() == gets, "the refill's meta is fresh: S3 is asked nothing"


def test_staleness_bound(cache_spec: CacheSpec, s3: Any, s3_bucket: str) -> None:
    """A write behind the cache's back is served stale while the lease holds, never after."""
    lease_ms = 1500
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"old")
    with _cache(cache_spec, lease_ms=lease_ms) as cache:
        validated_s = time.time()
        assert cache.get(s3_bucket, "k") == b"old"
        s3.put_object(Bucket=s3_bucket, Key="k", Body=b"new")
        seen_old_at = []
        while True:
            value = cache.get(s3_bucket, "k")
            now = time.time()
            if value == b"new":
                break
            assert value == b"old"
            seen_old_at.append(now)
            assert now - validated_s < lease_ms / 1000 + 1.0, "stale beyond the lease"
            time.sleep(0.05)
        assert seen_old_at, "the lease served the cached version"
        # Every stale read began within the lease of the validation (taken before it was sent).
        assert max(seen_old_at) - validated_s <= lease_ms / 1000 + 0.2
        assert cache.get(s3_bucket, "k") == b"new"
        # The replaced version's entry is gone.
        assert cache.stats.filled == 2


def test_lease_zero_checks_every_read(cache_spec: CacheSpec, s3: Any, s3_bucket: str) -> None:
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v1")
    with _cache(cache_spec, lease_ms=0) as cache:
        cache.get(s3_bucket, "k")
        # Written by the publisher thread; a read before that waits for it (no S3 request).
        cache.flush()
        before = _gets()
        for _ in range(3):
            assert cache.get(s3_bucket, "k") == b"v1"
        assert _gets() - before == 3
        s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v2")
        assert cache.get(s3_bucket, "k") == b"v2"
        assert cache.stats.revalidated == 3


def test_listing_revalidates_a_batch(cache_spec: CacheSpec, s3: Any, s3_bucket: str) -> None:
    keys = [f"part/{i:04d}" for i in range(40)]
    for k in keys:
        s3.put_object(Bucket=s3_bucket, Key=k, Body=k.encode())
    s3.put_object(Bucket=s3_bucket, Key="other", Body=b"not asked for")
    with _cache(cache_spec, lease_ms=300) as cache:
        assert cache.get_many(s3_bucket, keys) == [k.encode() for k in keys]
        cache.flush()
        time.sleep(0.4)
        s3.put_object(Bucket=s3_bucket, Key=keys[7], Body=b"changed")
        s3.delete_object(Bucket=s3_bucket, Key=keys[9])
        gets, lists = _gets(), _lists()
        results = cache.get_each(s3_bucket, keys)
        assert _lists() - lists == 1
        assert _gets() - gets == 1, "only the changed key is fetched"
        assert results[7] == b"changed"
        assert isinstance(results[9], S3ObjectNotFound)
        assert [r for i, r in enumerate(results) if i not in (7, 9)] == [
            k.encode() for i, k in enumerate(keys) if i not in (7, 9)]
        assert cache.stats.revalidated == 38


def test_a_revalidating_listing_renews_the_cached_keys_that_follow(
        cache_spec: CacheSpec, s3: Any, s3_bucket: str) -> None:
    """A read whose listing revalidated its batch renews, after it, the cached keys that follow
    the batch with one more listing page: another task reading them within the lease of that
    page asks S3 nothing for them. A key changed behind the cache before that page, or deleted,
    is not renewed: its reader gets the new bytes (never the old) or S3ObjectNotFound."""
    keys = [f"part/{i:04d}" for i in range(40)]
    for k in keys:
        s3.put_object(Bucket=s3_bucket, Key=k, Body=k.encode())
    s3.put_object(Bucket=s3_bucket, Key="partx", Body=b"outside the directory")
    with _cache(cache_spec, lease_ms=1500) as filler:
        assert filler.get_many(s3_bucket, keys) == [k.encode() for k in keys]
        filler.flush()
    time.sleep(1.6)
    s3.put_object(Bucket=s3_bucket, Key=keys[30], Body=b"changed")
    s3.delete_object(Bucket=s3_bucket, Key=keys[35])
    with _cache(cache_spec, lease_ms=1500) as first:
        lists = _lists()
        assert first.get_many(s3_bucket, keys[:10]) == [k.encode() for k in keys[:10]]
        first.flush()  # the listing ahead runs on the publisher thread
        assert _lists() - lists == 2
        assert first.stats.revalidated == 10
        assert first.stats.renewed_ahead == 28, "every key after the batch but the two changed"
    with _cache(cache_spec, lease_ms=1500) as second:
        gets = _gets()
        results = second.get_each(s3_bucket, keys[10:])
        assert results[30 - 10] == b"changed"
        assert isinstance(results[35 - 10], S3ObjectNotFound)
        assert [r for i, r in enumerate(results, 10) if i not in (30, 35)] == [
            k.encode() for i, k in enumerate(keys) if i >= 10 and i not in (30, 35)]
        assert second.stats.fresh == 28
        assert _gets() - gets == 1, "only the changed key is fetched"
    # A prefetch (a prewarm's, which goes on to the following keys itself) does not renew
    # ahead; nor does a read with a lease of 0 (the renewal would be stale at once).
    time.sleep(1.6)
    with _cache(cache_spec, lease_ms=1500) as prewarm:
        lists = _lists()
        assert prewarm.prefetch(s3_bucket, keys[:10]) == 10
        prewarm.flush()
        assert _lists() - lists == 1 and prewarm.stats.renewed_ahead == 0
    with _cache(cache_spec, lease_ms=0) as zero:
        lists = _lists()
        zero.get_many(s3_bucket, keys[:10])
        zero.flush()
        assert _lists() - lists == 1 and zero.stats.renewed_ahead == 0


def test_write_through(cache_spec: CacheSpec, s3: Any, s3_bucket: str) -> None:
    with _cache(cache_spec) as cache:
        s3.put_object(Bucket=s3_bucket, Key="w", Body=b"first")
        assert cache.get(s3_bucket, "w") == b"first"
        cache.flush()
        old_meta = cache.client.get(META_BUCKET, cache_key(s3_bucket, "w"))
        etag = cache.put(s3_bucket, "w", b"second")
        assert s3.get_object(Bucket=s3_bucket, Key="w")["Body"].read() == b"second"
        assert etag and etag in s3.head_object(Bucket=s3_bucket, Key="w")["ETag"]
        before = _gets()
        assert cache.get(s3_bucket, "w") == b"second"
        assert _gets() == before, "a write through the cache is read without asking S3"
        # The replaced version's entry was removed.
        import json

        old_etag = json.loads(old_meta)["e"]
        with pytest.raises(ObjectNotFound):
            cache.client.get(ENTRY_BUCKET, entry_key(cache_key(s3_bucket, "w"), old_etag))
        cache.delete(s3_bucket, "w")
        with pytest.raises(S3ObjectNotFound):
            cache.get(s3_bucket, "w")
        assert _gets() == before, "the delete left a negative entry"
        assert cache.invalidate(s3_bucket, "w")
        with pytest.raises(S3ObjectNotFound):
            cache.get(s3_bucket, "w")


def test_missing_key_is_cached_negative(cache_spec: CacheSpec, s3: Any, s3_bucket: str) -> None:
    with _cache(cache_spec, lease_ms=60_000) as cache:
        with pytest.raises(S3ObjectNotFound) as raised:
            cache.get(s3_bucket, "nope")
        assert raised.value.code == "NoSuchKey" and isinstance(raised.value, ObjectNotFound)
        before = _gets()
        with pytest.raises(S3ObjectNotFound):
            cache.get(s3_bucket, "nope")
        assert _gets() == before
        # A key created later is seen once the negative entry's lease is over (here: dropped).
        s3.put_object(Bucket=s3_bucket, Key="nope", Body=b"now")
        cache.invalidate(s3_bucket, "nope")
        assert cache.get(s3_bucket, "nope") == b"now"


def test_s3_errors_are_typed(cache_spec: CacheSpec, s3_bucket: str) -> None:
    with _cache(cache_spec) as cache:
        with pytest.raises(S3BucketNotFound) as raised:
            cache.get("no-such-bucket-here", "k")
        assert raised.value.bucket == "no-such-bucket-here"
        with pytest.raises(S3InvalidRequest) as invalid:
            cache.put("in", "k", b"a bucket name S3 refuses")
        assert invalid.value.code == "InvalidBucketName" and isinstance(invalid.value, ValueError)
        results = cache.get_each(s3_bucket, ["missing-1", "missing-2"])
        assert all(isinstance(r, S3ObjectNotFound) for r in results)
    # An S3 endpoint nobody listens on: every read fails fast with S3Unavailable.
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dead = S3Source(endpoint_url=f"http://127.0.0.1:{port}", unsigned=True, attempts=1,
                    connect_timeout_s=2.0, read_timeout_s=2.0)
    with _cache(cache_spec, source=dead) as cache:
        with pytest.raises(S3Unavailable) as raised:
            cache.get(s3_bucket, "k")
        assert raised.value.status == 0
        cache.flush()
        # The claim was released: nothing is left waiting for a fill that failed.
        with pytest.raises(ObjectNotFound):
            cache.client.get(CLAIM_BUCKET, cache_key(s3_bucket, "k"))


def test_a_prefetch_fetches_only_what_is_not_cached_and_answers_stay_in_order(
    cache_spec: CacheSpec, s3: Any, s3_bucket: str,
) -> None:
    """A prefetch looks its keys up by name first and reads only the ``meta`` records that
    exist: cached keys are not fetched again, missing ones once, keys S3 lacks are not counted;
    a batch's S3 answers come back on a few lanes, in key order, errors in place."""
    keys = [f"pf/{i:03d}" for i in range(60)]
    absent = set(keys[5::7])
    for key in keys:
        if key not in absent:
            s3.put_object(Bucket=s3_bucket, Key=key, Body=key.encode() * (1 + len(key) % 5))
    spec = replace(cache_spec, lease_ms=60_000)
    with CacheClient(spec, s3_parallel=4) as cache:
        cached = keys[:20]
        cache.get_each(s3_bucket, cached)
        cache.flush()
        before = _gets()
        held = cache.prefetch(s3_bucket, keys)
        assert held == len(keys) - len(absent)
        # Only the keys not cached yet are asked for (S3 answers the absent ones 404); those
        # of the first 20 are cached, the absent ones among them as missing.
        assert _gets() - before == len(keys) - len(cached)
        cache.flush()
        before = _gets()
        results = cache.get_each(s3_bucket, keys)
        assert _gets() == before, "every key, present or absent, is fresh in the cache now"
        for key, result in zip(keys, results, strict=True):
            if key in absent:
                assert isinstance(result, S3ObjectNotFound), key
            else:
                assert result == key.encode() * (1 + len(key) % 5), key
    with CacheClient(spec, s3_parallel=3) as cache:
        for key in keys:
            cache.invalidate(s3_bucket, key)
        before = _gets()
        results = cache.get_each(s3_bucket, keys)  # 60 misses on 3 lanes
        assert _gets() - before == len(keys)
        assert [isinstance(r, S3ObjectNotFound) for r in results] == [k in absent for k in keys]
        assert [r for r in results if not isinstance(r, S3ObjectNotFound)] == [
            k.encode() * (1 + len(k) % 5) for k in keys if k not in absent]


def test_concurrent_misses_in_threads_fetch_once(cache_spec: CacheSpec, s3: Any,
                                                 s3_bucket: str) -> None:
    data = os.urandom(4 * 1024 * 1024)
    s3.put_object(Bucket=s3_bucket, Key="hot", Body=data)
    with _cache(cache_spec) as cache:
        barrier = threading.Barrier(6)
        got: list[bytes] = []

        def read() -> None:
            barrier.wait(timeout=30)
            got.append(cache.get(s3_bucket, "hot"))

        before = _gets()
        threads = [threading.Thread(target=read) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert got == [data] * 6
        assert _gets() - before == 1
        assert cache.stats.filled == 1 and cache.stats.waited + cache.stats.fresh == 5


CONCURRENT_READER = """
import json, sys, time
from pocketflow.cache import connect
from pocketflow.cache.source import request_counts
spec_json, bucket, start_at = sys.stdin.read().split("\\n")
cache = connect(spec_json)
while time.time() < float(start_at):
    time.sleep(0.001)
data = cache.get(bucket, "hot")
cache.flush()
print(json.dumps({"len": len(data), "gets": request_counts().get("GetObject", 0),
                  "stats": cache.stats.to_dict()}))
cache.close()
"""


def test_concurrent_misses_in_processes_fetch_once(cache_spec: CacheSpec, s3: Any,
                                                   s3_bucket: str) -> None:
    import json

    data = os.urandom(8 * 1024 * 1024)
    s3.put_object(Bucket=s3_bucket, Key="hot", Body=data)
    readers = 5
    start_at = time.time() + 4.0  # every process is up and connected by then
    procs = [_spawn(CONCURRENT_READER, f"{cache_spec.to_json()}\n{s3_bucket}\n{start_at}")
             for _ in range(readers)]
    outs = [json.loads(_finish(p).strip().splitlines()[-1]) for p in procs]
    assert all(o["len"] == len(data) for o in outs)
    assert sum(o["gets"] for o in outs) == 1, outs
    assert sum(o["stats"]["filled"] for o in outs) == 1
    assert sum(o["stats"]["hits"] for o in outs) == readers - 1


KILLED_FILLER = """
import sys
from pocketflow.cache import connect
spec_json, bucket = sys.stdin.read().split("\\n")
cache = connect(spec_json)
cache.get(bucket, "slow")
"""


def test_a_killed_fill_is_taken_over(cache_spec: CacheSpec, s3: Any, s3_bucket: str) -> None:
    """A process killed while it holds a fill's claim: the next reader waits out the claim's
    deadline, takes the fill over, and reads the object; nothing is left claimed."""
    from dataclasses import replace

    spec = replace(cache_spec, claim_ms=1500)
    data = os.urandom(48 * 1024 * 1024)
    s3.put_object(Bucket=s3_bucket, Key="slow", Body=data)
    ckey = cache_key(s3_bucket, "slow")
    with _cache(spec) as cache:
        _kill_while_claimed(spec, cache, s3_bucket, "slow")
        started = time.monotonic()
        assert cache.get(s3_bucket, "slow") == data
        assert cache.stats.steals == 1 and cache.stats.wait_slices >= 1
        assert time.monotonic() - started < 60.0
        cache.flush()
        assert not cache.client.exists(CLAIM_BUCKET, ckey)
        assert cache.get(s3_bucket, "slow") == data and cache.stats.fresh == 1
        # A claim that lapsed long before anyone asked again is taken over without a wait.
        cache.invalidate(s3_bucket, "slow")
        _kill_while_claimed(spec, cache, s3_bucket, "slow")
        time.sleep(spec.claim_ms / 1000 + 0.5)
        slices = cache.stats.wait_slices
        assert cache.get(s3_bucket, "slow") == data
        assert cache.stats.steals == 2 and cache.stats.wait_slices == slices


def _kill_while_claimed(spec: CacheSpec, cache: CacheClient, bucket: str, key: str) -> None:
    """Start a process that reads ``key`` through the cache and SIGKILL it while it holds the
    key's claim (a few attempts: a fast fill may end before it is killed)."""
    ckey = cache_key(bucket, key)
    for _attempt in range(5):
        proc = _spawn(KILLED_FILLER, f"{spec.to_json()}\n{bucket}")
        claimed = _wait_until(lambda: cache.client.exists(CLAIM_BUCKET, ckey), 60.0)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if claimed and cache.client.exists(CLAIM_BUCKET, ckey):
            return
        cache.invalidate(bucket, key)  # it finished first: try again
    pytest.fail("the filler never held its claim when killed")


HELD_FILLER = """
import sys, threading
from pocketflow.cache import connect
spec_json, bucket, held_at = sys.stdin.read().split("\\n")
cache = connect(spec_json)
# A barrier, not a stand-in: the fill's writes stop at the moment under test and the process
# is killed there.
setattr(cache, held_at, lambda *args, **kwargs: threading.Event().wait())
data = cache.get(bucket, "k")
print(len(data), flush=True)
threading.Event().wait()
"""


@pytest.mark.parametrize("held_at", ["_publish", "_finish_fills"])
def test_a_filler_killed_after_its_s3_answer_is_taken_over(
        cache_spec: CacheSpec, s3: Any, s3_bucket: str, held_at: str) -> None:
    """The worst moment of a miss: its reader has the bytes from S3 and its process is killed
    before the publisher wrote the fill (``_publish``: nothing written) or after it wrote the
    entry and meta but not the outcome (``_finish_fills``). No entry is served torn, and the key
    is not left claimed: the next reader has its bytes within ``claim_ms`` and a wait slice."""
    from dataclasses import replace

    from pocketflow.cache.client import WAIT_SLICE_S

    spec = replace(cache_spec, claim_ms=1500)
    data = os.urandom(64 * 1024)
    s3.put_object(Bucket=s3_bucket, Key="k", Body=data)
    ckey = cache_key(s3_bucket, "k")
    with _cache(spec) as cache:
        proc = _spawn(HELD_FILLER, f"{spec.to_json()}\n{s3_bucket}\n{held_at}")
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == str(len(data))
            if held_at == "_finish_fills":  # killed once its publisher wrote entry and meta
                assert _wait_until(lambda: cache.client.exists(META_BUCKET, ckey), 60.0)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        assert cache.client.exists(CLAIM_BUCKET, ckey)
        assert cache.client.exists(META_BUCKET, ckey) == (held_at == "_finish_fills")
        started = time.monotonic()
        assert cache.get(s3_bucket, "k") == data
        waited_s = time.monotonic() - started
        assert waited_s < spec.claim_ms / 1000 + WAIT_SLICE_S + 20.0  # slack for a loaded machine
        if held_at == "_finish_fills":
            # Entry and meta were written: a hit, the dead fill's claim never waited on...
            assert cache.stats.fresh == 1 and cache.stats.steals == 0
            # ...until the key misses again: then it is taken over once it lapsed.
            cache.invalidate(s3_bucket, "k")
            started = time.monotonic()
            assert cache.get(s3_bucket, "k") == data
            assert time.monotonic() - started < spec.claim_ms / 1000 + WAIT_SLICE_S + 20.0
        assert cache.stats.steals == 1
        cache.flush()
        assert not cache.client.exists(CLAIM_BUCKET, ckey)
        gets = _gets()
        assert cache.get(s3_bucket, "k") == data and _gets() == gets


UNFLUSHED_FILLER = """
import sys
from pocketflow.cache import connect
spec_json, bucket = sys.stdin.read().split("\\n")
cache = connect(spec_json)
assert len(cache.get(bucket, "k")) > 0
# Ends without flush() or close(): the fill is still the publisher thread's.
"""


def test_a_process_that_ends_without_flush_leaves_its_fill_written(
        cache_spec: CacheSpec, s3: Any, s3_bucket: str) -> None:
    data = os.urandom(4 * 1024 * 1024)
    s3.put_object(Bucket=s3_bucket, Key="k", Body=data)
    _run(UNFLUSHED_FILLER, f"{cache_spec.to_json()}\n{s3_bucket}")
    ckey = cache_key(s3_bucket, "k")
    with _cache(cache_spec) as cache:
        assert not cache.client.exists(CLAIM_BUCKET, ckey)
        gets = _gets()
        assert cache.get(s3_bucket, "k") == data
        assert _gets() == gets and cache.stats.fresh == 1


LINGERING_FILLER = """
import os, sys
from pocketflow.cache.client import CacheClient
from pocketflow.cache.spec import CacheSpec
spec_json, bucket = sys.stdin.read().split("\\n")
cache = CacheClient(CacheSpec.from_json(spec_json), linger_claims=True)
assert len(cache.get(bucket, "k")) > 0
cache.flush()  # written; its claim and outcome linger
os._exit(0)  # dies before removing them (as a SIGKILLed prewarm worker)
"""


def test_a_dead_prewarms_lingering_claim_does_not_hold_an_evicted_key(
        cache_spec: CacheSpec, s3: Any, s3_bucket: str) -> None:
    """A prewarm's claims linger with their outcomes; one whose process died leaves both. Once
    the key's entry is evicted, a reader finds the old claim and its outcome but no entry: it
    removes the lapsed claim and fills the key again (it went round to the same outcome and
    read S3 uncached every time before)."""
    from dataclasses import replace as changed

    spec = changed(cache_spec, claim_ms=500)
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"v" * 5000)
    _run(LINGERING_FILLER, f"{spec.to_json()}\n{s3_bucket}")
    ckey = cache_key(s3_bucket, "k")
    with _cache(spec) as cache:
        assert cache.client.exists(CLAIM_BUCKET, ckey), "the dead filler's claim lingers"
        meta = cache.client.get(META_BUCKET, ckey)
        assert cache.evict(entry_key(ckey, json.loads(meta)["e"]))
        time.sleep(0.6)  # the claim's deadline passes
        gets = _gets()
        assert cache.get(s3_bucket, "k") == b"v" * 5000
        cache.flush()
        assert cache.stats.filled == 1 and cache.stats.bypassed == 0, cache.stats
        assert _gets() - gets == 1
        gets = _gets()
        assert cache.get(s3_bucket, "k") == b"v" * 5000
        assert _gets() == gets, "cached again"


def test_claims_held_ahead_are_moved_on_until_their_fill(
        cache_spec: CacheSpec, s3: Any, s3_bucket: str) -> None:
    """A prewarm that claimed a key ahead and reaches it only after three claim times: the
    reader waiting on it waits for the prewarm's fill instead of taking the claim over and
    fetching the key a second time."""
    from dataclasses import replace

    spec = replace(cache_spec, claim_ms=1500)
    data = os.urandom(64 * 1024)
    s3.put_object(Bucket=s3_bucket, Key="k", Body=data)
    gets = _gets()
    with _cache(spec) as prewarm, _cache(spec) as reader:
        assert prewarm.claim_ahead(s3_bucket, ["k"]) == 1
        got: list[Any] = []
        thread = threading.Thread(target=lambda: got.append(reader.get(s3_bucket, "k")))
        thread.start()
        time.sleep(3 * spec.claim_ms / 1000)
        assert thread.is_alive()  # still waiting for the prewarm
        assert prewarm.prefetch(s3_bucket, ["k"]) == 1
        thread.join(60.0)
        assert got == [data]
        assert reader.stats.steals == 0 and reader.stats.waited == 1
    assert _gets() - gets == 1


def test_a_reader_waiting_on_a_prewarm_reads_its_fills_as_they_land(
        cache_spec: CacheSpec, s3: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader of many keys a prewarm claimed reads the ones filled so far as soon as they
    land (``WAIT_HEAD_KEYS`` at a time, in the order read), not only once all landed or its
    wait slice ran out, so that when the last fill lands only the last head is left to read;
    it still gets every key's bytes, each fetched once."""
    # A slice longer than the test: whatever the reader reads before the rest is filled, it
    # read because its head landed.
    monkeypatch.setattr(cache_client, "WAIT_SLICE_S", 120.0)
    count = 2 * WAIT_HEAD_KEYS + 64
    keys = [f"w/{i:04d}" for i in range(count)]
    datas = {k: os.urandom(512) for k in keys}
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket=s3_bucket, Key=k, Body=datas[k]), keys))
    gets = _gets()
    with _cache(cache_spec) as prewarm, _cache(cache_spec) as reader:
        assert prewarm.claim_ahead(s3_bucket, keys) == count
        got: list[Any] = []
        thread = threading.Thread(target=lambda: got.append(reader.get_many(s3_bucket, keys)))
        thread.start()
        try:
            # Every key claimed by the prewarm: the reader parks on all of them.
            assert _wait_until(lambda: reader.stats.wait_slices >= 1, 30.0)
            # The first head and part of the second: the reader reads the first head now.
            assert prewarm.prefetch(s3_bucket, keys[:WAIT_HEAD_KEYS + 64]) == WAIT_HEAD_KEYS + 64
            prewarm.flush()
            assert _wait_until(lambda: reader.stats.waited >= WAIT_HEAD_KEYS, 30.0), (
                f"read {reader.stats.waited} waited-for keys while the rest were not filled")
            assert thread.is_alive()
            assert reader.stats.waited < count
        finally:
            assert prewarm.prefetch(s3_bucket, keys[WAIT_HEAD_KEYS + 64:]) == count - (
                WAIT_HEAD_KEYS + 64)
            thread.join(60.0)
        assert got == [[datas[k] for k in keys]]
        assert reader.stats.waited == count and reader.stats.steals == 0
    assert _gets() - gets == count


# -- helpers --------------------------------------------------------------------------------


def _spawn(script: str, stdin: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write(stdin)
    proc.stdin.close()
    proc.stdin = None  # communicate() must not flush it again
    return proc


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, err = proc.communicate(timeout=PROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err
    return out


def _run(script: str, stdin: str) -> str:
    return _finish(_spawn(script, stdin))


def _wait_until(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return False


# -- the cache's own storage failing: reads go to S3 --------------------------------------------


def _private_cache(server_factory: Any, s3_server: S3Source, capacity_bytes: int,
                   ) -> tuple[Any, CacheSpec]:
    servers, _ = server_factory("cache-0", "dram", capacity_bytes, long_running=True)
    handle = servers.handle()
    with connect(handle, **CLIENT_OPTIONS) as pf:
        create_buckets(pf)
    return servers, CacheSpec(name="t", handle=handle, source=s3_server, lease_ms=60_000)


def test_a_full_cache_serves_from_s3(server_factory: Any, s3_server: S3Source, s3: Any,
                                     s3_bucket: str) -> None:
    """An object larger than the cache's tier: each read returns it from S3 (counted as
    bypassed), and neither a meta nor a claim of it stays behind; what fits is cached."""
    _, spec = _private_cache(server_factory, s3_server, 4 * 1024 * 1024)
    data = os.urandom(6 * 1024 * 1024)
    s3.put_object(Bucket=s3_bucket, Key="huge", Body=data)
    s3.put_object(Bucket=s3_bucket, Key="small", Body=b"fits")
    with CacheClient(spec, client=connect(spec.handle, **CLIENT_OPTIONS)) as cache:
        assert cache.get_many(s3_bucket, ["huge", "small"]) == [data, b"fits"]
        cache.flush()
        assert cache.stats.bypassed == 1 and cache.stats.filled == 1
        assert cache.get(s3_bucket, "small") == b"fits" and cache.stats.fresh == 1
        with pytest.raises(ObjectNotFound):
            cache.client.get(META_BUCKET, cache_key(s3_bucket, "huge"))
        assert not cache.client.exists(CLAIM_BUCKET, cache_key(s3_bucket, "huge"))
        assert cache.get(s3_bucket, "huge") == data
        cache.flush()
        assert cache.stats.bypassed == 2
        cache.client.close()


def test_a_dead_cache_server_serves_from_s3(server_factory: Any, s3_server: S3Source,
                                            s3: Any, s3_bucket: str) -> None:
    """The cache's only storage server is SIGKILLed: reads, hits and misses alike, come from
    S3 and are correct; nothing raises but S3's own errors."""
    servers, spec = _private_cache(server_factory, s3_server, 16 * 1024 * 1024)
    s3.put_object(Bucket=s3_bucket, Key="a", Body=b"alpha")
    s3.put_object(Bucket=s3_bucket, Key="b", Body=b"beta")
    with CacheClient(spec, client=connect(spec.handle, **CLIENT_OPTIONS)) as cache:
        assert cache.get(s3_bucket, "a") == b"alpha"
        cache.flush()  # "a" is cached before the kill
        os.kill(servers.process("cache-0").pid, signal.SIGKILL)
        started = time.monotonic()
        assert cache.get_many(s3_bucket, ["a", "b"]) == [b"alpha", b"beta"]
        assert cache.stats.bypassed == 2
        with pytest.raises(S3ObjectNotFound):
            cache.get(s3_bucket, "missing")
        assert time.monotonic() - started < 60.0
        cache.client.close()


HOLD_SLOT = """
import sys
from pocketflow.cache import client
slot = client._arena(4 << 20)
print(int(isinstance(slot, client._Slot)), flush=True)
sys.stdin.read()
"""


def test_freeing_the_pool_removes_free_slots_and_leaves_held_ones(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``free_arena_pool`` removes the slots no process holds and leaves the one another live
    process reads into (its lock taken); once that process has ended, the next free removes
    that slot too, and the pool's directory with it."""
    pool = tmp_path / "pool"
    monkeypatch.setenv(cache_client.ARENA_POOL_ENV, str(pool))
    holder = subprocess.Popen([sys.executable, "-c", HOLD_SLOT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "1"
        mine = [cache_client._arena(4 << 20) for _ in range(2)]
        assert all(isinstance(m, cache_client._Slot) for m in mine)
        del mine  # free again, their files left in the pool
        assert len(list(pool.iterdir())) == 3
        assert cache_client.free_arena_pool() == 2
        left = [str(p) for p in pool.iterdir()]
        assert len(left) == 1 and _slot_locked(left[0])
    finally:
        holder.communicate("", timeout=30)
    assert cache_client.free_arena_pool() == 1
    assert not pool.exists()
    assert cache_client.free_arena_pool() == 0  # nothing left: nothing to do
