"""Named caches end to end on the session's local cluster (a real controller) and a real S3
server: tasks in other processes reading through a cache's spec, the run's working set
recorded with PERSIST, prewarming (also from a generation that ended idle), a task waiting
for a key being prewarmed, eviction by recency, capacity grown and shrunk by the working set."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fixtures_cluster import used_bytes, wait_for
from fixtures_s3 import FaultyS3Proxy, boto3_client

from pocketflow.cache import open_cache
from pocketflow.cache import pack as pack_module
from pocketflow.cache.cache import Cache, working_set_key
from pocketflow.cache.client import WAIT_HEAD_KEYS
from pocketflow.cache.http_get import RANGE_IGNORED
from pocketflow.cache.pack import PACK_OBJECT_BYTES_MAX
from pocketflow.cache.prewarm import PREWARM_BATCH_KEYS
from pocketflow.cache.records import RECORD_BUCKET
from pocketflow.cache.source import S3Source, S3Store, request_counts
from pocketflow.cache.working_set import (
    KeyUse,
    PackEntry,
    PackRef,
    RunRecord,
    plan_prewarm,
    reservation_bytes,
)
from pocketflow.cluster import LocalCluster
from pocketflow.errors import JobNotRegistered, S3InvalidRequest, S3ObjectNotFound

MiB = 1024 * 1024
PROCESS_TIMEOUT_S = 120.0
IDLE_END_TIMEOUT_S = 30.0


@pytest.fixture
def s3(s3_server: S3Source) -> Iterator[Any]:
    client = boto3_client(s3_server)
    yield client
    client.close()


TASK = """
import json, sys
from pocketflow.cache import connect, request_counts
spec_json, bucket, keys = sys.stdin.read().split("\\n")
with connect(spec_json) as cache:
    data = cache.get_many(bucket, json.loads(keys))
    stats = cache.stats.to_dict()
print(json.dumps({"sizes": [len(d) for d in data], "stats": stats,
                  "gets": request_counts().get("GetObject", 0)}))
"""


def _task(cache: Cache, bucket: str, keys: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", TASK], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write(f"{cache.spec.to_json()}\n{bucket}\n{json.dumps(keys)}")
    proc.stdin.close()
    proc.stdin = None
    return proc


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=PROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


UPLOAD_THREADS = 16
"""S3 puts at once while a test uploads its objects."""


def _upload(s3: Any, bucket: str, sizes: dict[str, int]) -> None:
    def put(key: str) -> None:
        s3.put_object(Bucket=bucket, Key=key, Body=key.encode().ljust(sizes[key], b"."))

    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        list(pool.map(put, sizes))


def _record_working_set(cluster: LocalCluster, s3_server: S3Source, bucket: str, name: str,
                        app: str, keys: list[str]) -> None:
    """A first run of ``app`` on the cache ``name`` that reads ``keys`` (its working set,
    recorded for the next run's prewarm), left to idle out; returns once its job ended."""
    with open_cache(name, s3_server, app=app, idle="1s", cluster=cluster) as cache:
        cache.client.get_many(bucket, keys)
        job_id = cache.job_id
    _wait_ended(cluster, job_id)


def _wait_ended(cluster: LocalCluster, job_id: str) -> None:
    deadline = time.monotonic() + IDLE_END_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            cluster.control.job_handle(job_id)
        except JobNotRegistered:
            return
        time.sleep(0.2)
    pytest.fail(f"the idle cache {job_id} was not freed within {IDLE_END_TIMEOUT_S}s")


def _run_reading(local_cluster: LocalCluster, source: S3Source, *, name: str, app: str,
                 url: str, bucket: str, keys: list[str]) -> None:
    """A run of cache ``name`` of ``app`` (idle after 1 s, its working set recorded at ``url``)
    whose client reads ``keys`` of ``bucket``; returns once the idle cache's job is freed."""
    with open_cache(name, source, app=app, idle="1s", working_set_url=url,
                    cluster=local_cluster) as cache:
        cache.client.get_many(bucket, keys)
        job_id = cache.job_id
    _wait_ended(local_cluster, job_id)


def _prewarm_each_key_alone(local_cluster: LocalCluster, source: S3Source, *, name: str,
                            app: str, url: str, bucket: str, keys: list[str]) -> None:
    """A prewarming run of cache ``name`` of ``app`` from the record at ``url``, whose pack
    cannot be read: every one of ``keys`` (4 KiB each) is prewarmed, none from the pack, and
    the run's task reads them all without S3. Returns once the idle cache's job is freed."""
    with open_cache(name, source, app=app, prewarm=True, idle="1s", working_set_url=url,
                    cluster=local_cluster) as cache:
        assert cache.wait_prewarmed(120.0)
        status = cache.status()
        assert status["prewarm_fetched"] == len(keys)
        assert status["prewarm_stats"]["packed"] == 0, status["prewarm_stats"]
        result = _result(_task(cache, bucket, keys))
        assert result["gets"] == 0 and result["sizes"] == [4096] * len(keys)
        job_id = cache.job_id
    _wait_ended(local_cluster, job_id)


def test_tasks_read_through_the_spec_and_the_run_is_recorded(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    sizes = {f"in/{i:03d}": 20_000 + i for i in range(24)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    with open_cache("t-record", s3_server, app="rec", idle="60s", cluster=local_cluster) as cache:
        first = _task(cache, s3_bucket, keys[:16])
        second = _task(cache, s3_bucket, keys[8:])
        results = [_result(first), _result(second)]
        assert results[0]["sizes"] == [sizes[k] for k in keys[:16]]
        assert results[1]["sizes"] == [sizes[k] for k in keys[8:]]
        # Every key came from S3 once across both tasks (the overlap waited or hit).
        assert sum(r["gets"] for r in results) == len(keys)
        assert sum(r["stats"]["filled"] for r in results) == len(keys)
        cache.maintain_now()
        status = cache.status()
        assert status["entries"] == len(keys)
        assert status["held_bytes"] == sum(sizes.values())
        assert status["working_set_keys"] == len(keys)
        assert status["reads"] == 32 and status["fills"] == len(keys)
        job_id = cache.job_id
    record_info = local_cluster.control.job_handle(job_id)  # the cache outlives the run
    from pocketflow.client import connect

    with connect(record_info) as pf:
        info = pf.lookup(RECORD_BUCKET, working_set_key("rec"))
        assert info.persist
        record = RunRecord.decode(pf.get(RECORD_BUCKET, working_set_key("rec")))
    reads = {use.key: use.reads for use in record.keys}
    assert reads == {k: 2 if k in keys[8:16] else 1 for k in keys}
    assert record.distinct_bytes == sum(sizes.values())


def test_a_run_revalidates_the_last_runs_working_set_as_it_opens(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """A run opening a cache that lives on revalidates the last run's working set with
    listings while its tasks start: they find the unchanged keys fresh (no S3 request of
    theirs); a key changed or deleted behind the cache is not renewed, so its reader still
    gets S3's current answer."""
    lease_ms = 2000
    sizes = {f"ws/{i:04d}": 2_000 + i for i in range(1200)}  # two listing pages
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    with open_cache("t-renew-open", s3_server, app="renew-open", idle="60s", lease_ms=lease_ms,
                    cluster=local_cluster) as cache:
        cache.client.get_many(s3_bucket, keys)
    time.sleep(lease_ms / 1000 + 0.2)  # every entry past its lease
    changed, deleted = keys[5], keys[1100]
    s3.put_object(Bucket=s3_bucket, Key=changed, Body=b"changed behind the cache")
    s3.delete_object(Bucket=s3_bucket, Key=deleted)
    with open_cache("t-renew-open", s3_server, app="renew-open", idle="60s", lease_ms=lease_ms,
                    cluster=local_cluster) as cache:
        assert not cache.created
        assert wait_for(lambda: cache.status()["renewed_at_open"] == len(keys) - 2), \
            cache.status()["renewed_at_open"]
        unchanged = [k for k in keys if k not in (changed, deleted)]
        with cache.connect() as reader:
            before = request_counts()
            data = reader.get_many(s3_bucket, unchanged)
            assert request_counts() == before  # no GET, no listing: all fresh
            assert reader.stats.fresh == len(unchanged)
            assert reader.stats.listings == 0 and reader.stats.revalidated == 0
            assert [len(d) for d in data] == [sizes[k] for k in unchanged]
            assert reader.get(s3_bucket, changed) == b"changed behind the cache"
            with pytest.raises(S3ObjectNotFound):
                reader.get(s3_bucket, deleted)


def test_prewarm_from_the_generation_that_ended_idle(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """Run 1 records its working set; the cache idles out (its entries are freed, the PERSIST
    record stays); run 2 on a new generation prewarms from it, and its tasks ask S3 nothing."""
    sizes = {f"p/{i:03d}": 50_000 for i in range(20)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    with open_cache("t-prewarm", s3_server, app="pw", idle="1s",
                    cluster=local_cluster) as cache:
        assert cache.status()["prewarm_from"] is None
        _result(_task(cache, s3_bucket, keys))
        first_job = cache.job_id
    _wait_ended(local_cluster, first_job)
    opening = time.time()
    with open_cache("t-prewarm", s3_server, app="pw", prewarm=True, idle="60s",
                    cluster=local_cluster) as cache:
        assert cache.job_id != first_job and cache.created
        assert cache.wait_prewarmed(60.0)
        status = cache.status()
        assert opening < status["prewarm_ended_unix"] <= time.time()
        assert status["prewarm_from"] == "predecessor"
        assert status["prewarm_planned"] == len(keys) == status["prewarm_fetched"]
        result = _result(_task(cache, s3_bucket, keys))
        assert result["gets"] == 0, "prewarmed keys are read without S3"
        assert result["stats"]["hits"] == len(keys)


def test_a_task_waits_for_the_key_being_prewarmed(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    big = {"w/big": 40 * MiB}
    _upload(s3, s3_bucket, big)
    with open_cache("t-wait", s3_server, app="wt", idle="60s", cluster=local_cluster) as cache:
        cache.client.get(s3_bucket, "w/big")
        cache.client.invalidate(s3_bucket, "w/big")
    gets = request_counts().get("GetObject", 0)
    with open_cache("t-wait", s3_server, app="wt", prewarm=True, idle="60s",
                    cluster=local_cluster) as cache:
        result = _result(_task(cache, s3_bucket, ["w/big"]))
        assert cache.wait_prewarmed(60.0)
        assert result["gets"] == 0, "the task started no second fetch"
        assert result["stats"]["waited"] + result["stats"]["fresh"] == 1
        assert request_counts().get("GetObject", 0) - gets == 1


def test_tasks_wait_for_keys_the_prewarm_claimed_ahead(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """A prewarm of many small objects claims its next keys ahead of its fetches (the first
    window before ``open_cache`` returns): a task started at once that reads the plan's last
    keys, far beyond the batches in flight, waits for the prewarm's fills and sends S3
    nothing; every key is fetched from S3 once (before, only the batches in flight were
    claimed, and the task fetched the rest itself)."""
    sizes = {f"c/{i:04d}": 4096 for i in range(900)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    _record_working_set(local_cluster, s3_server, s3_bucket, "t-ahead", "ahead", keys)
    gets = request_counts().get("GetObject", 0)
    with open_cache("t-ahead", s3_server, app="ahead", prewarm=True, idle="1s",
                    cluster=local_cluster) as cache:
        assert cache.status()["prewarm_planned"] == len(keys)
        result = _result(_task(cache, s3_bucket, keys[-200:]))
        assert cache.wait_prewarmed(120.0)
        assert result["sizes"] == [4096] * 200
        assert result["gets"] == 0, result["stats"]
        assert result["stats"]["hits"] == 200
        status = cache.status()
        assert status["prewarm_fetched"] == len(keys)
        assert status["prewarm_objects_per_s"] > 0
        assert status["prewarm_cpu_s"] > 0, "the workers' CPU time, reported at their end"
        # ... of which their start (interpreter, imports, first claims) and the kernel's part.
        assert 0 < status["prewarm_start_cpu_s"] < status["prewarm_cpu_s"], status
        assert 0 < status["prewarm_cpu_system_s"] <= status["prewarm_cpu_s"], status
        assert request_counts().get("GetObject", 0) - gets == len(keys), "each key once"
        job_id = cache.job_id
    _wait_ended(local_cluster, job_id)  # its capacity goes back for the tests after it


def test_a_prewarm_worker_killed_leaves_its_keys_to_the_tasks(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """The prewarm fetches in worker processes of its own. One SIGKILLed right after
    ``open_cache`` returned (its first window claimed, its fetches begun) leaves claims nobody
    fills: a task reading every key waits for them only until they lapse (``claim_ms``), takes
    them over and reads every key whole; the prewarm counts as done once its workers ended,
    and closing the cache does not wait for the dead worker."""
    sizes = {f"k/{i:04d}": 4096 for i in range(1200)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    _record_working_set(local_cluster, s3_server, s3_bucket, "t-kill", "kill", keys)
    with open_cache("t-kill", s3_server, app="kill", prewarm=True, idle="1s", claim_ms=3000,
                    cluster=local_cluster) as cache:
        pids = cache.prewarm_pids
        assert len(pids) == 2, "two worker processes share the plan"
        os.kill(pids[0], signal.SIGKILL)
        result = _result(_task(cache, s3_bucket, keys))
        assert result["sizes"] == [4096] * len(keys)
        assert cache.wait_prewarmed(60.0)
        status = cache.status()
        assert status["prewarm_fetched"] < len(keys), "the killed worker's batches are not done"
        assert result["stats"]["steals"] + result["stats"]["filled"] >= 1, result["stats"]
        job_id = cache.job_id
    _wait_ended(local_cluster, job_id)


def test_a_reader_waiting_on_many_claimed_keys_outlives_the_prewarm_workers_killed(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """The worst moment of a prewarm's claims: both workers stopped (SIGSTOP) right after
    claiming their first windows, a task reading every key (more than ``WAIT_HEAD_KEYS``, so
    it waits in several heads) parks on their claims, then both workers are SIGKILLed while it
    waits. Nobody renews or fills those claims: the task takes them over once they lapse
    (``claim_ms``), fetches the keys itself and returns every key whole within a bound."""
    sizes = {f"s/{i:04d}": 4096 for i in range(3 * WAIT_HEAD_KEYS + 100)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    _record_working_set(local_cluster, s3_server, s3_bucket, "t-stop", "stop", keys)
    with open_cache("t-stop", s3_server, app="stop", prewarm=True, idle="1s", claim_ms=3000,
                    cluster=local_cluster) as cache:
        pids = cache.prewarm_pids
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        task = _task(cache, s3_bucket, keys)
        time.sleep(2.0)
        assert task.poll() is None, "the task waits for the stopped workers' claims"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        result = _result(task)
        took_s = time.monotonic() - started
        assert result["sizes"] == [4096] * len(keys)
        assert result["stats"]["steals"] >= 1, result["stats"]
        assert result["stats"]["hits"] + result["stats"]["filled"] == len(keys)
        assert took_s < 60.0, f"the task took {took_s:.1f} s"
        assert cache.wait_prewarmed(30.0), "killed workers end the prewarm"
        job_id = cache.job_id
    _wait_ended(local_cluster, job_id)


def _pack_of(s3: Any, bucket: str, key: str) -> PackRef:
    record = RunRecord.decode(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert record.pack is not None
    return record.pack


def test_prewarm_takes_small_objects_from_the_last_runs_pack(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """Run 1 (with ``working_set_url``) packs its small entries next to its working set's
    copy in S3. Before run 2, one packed key changes in S3, one is deleted and one's packed
    bytes go bad: run 2's prewarm fills every other small key from the pack (a listing and
    ranged GETs per batch, not a GET each), and GETs those three and the object too large to
    pack on their own; its tasks read every key without S3, the changed key at its new
    version. Run 2 writes a new pack and deletes the old one; run 3, whose entries are run 2's,
    keeps run 2's pack and PUTs no new one."""
    small = {f"p/{i:04d}": 4096 for i in range(2 * PREWARM_BATCH_KEYS + 100)}
    sizes = {**small, "p/large": PACK_OBJECT_BYTES_MAX + 1}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    url = f"s3://{s3_bucket}/ws/packed"
    _run_reading(local_cluster, s3_server, name="t-pack", app="packed", url=url,
                 bucket=s3_bucket, keys=keys)
    first = _pack_of(s3, s3_bucket, "ws/packed")
    assert first.bucket == s3_bucket and first.key.startswith("ws/packed.pack-")
    assert sorted(e.key for e in first.entries) == sorted(small)
    changed, gone, bad = "p/0005", "p/0006", "p/0007"
    s3.put_object(Bucket=s3_bucket, Key=changed, Body=b"new".ljust(4096, b"!"))
    s3.delete_object(Bucket=s3_bucket, Key=gone)
    body = bytearray(s3.get_object(Bucket=s3_bucket, Key=first.key)["Body"].read())
    body[next(e.offset for e in first.entries if e.key == bad)] ^= 0xFF
    s3.put_object(Bucket=s3_bucket, Key=first.key, Body=bytes(body))
    before = request_counts()
    readable = [k for k in keys if k != gone]
    with open_cache("t-pack", s3_server, app="packed", prewarm=True, idle="2s",
                    working_set_url=url, cluster=local_cluster) as cache:
        assert cache.wait_prewarmed(120.0)
        status = cache.status()
        assert status["prewarm_fetched"] == len(keys)
        assert status["prewarm_stats"]["packed"] == len(small) - 3, status["prewarm_stats"]
        gets = request_counts().get("GetObject", 0) - before.get("GetObject", 0)
        batches = -(-len(keys) // PREWARM_BATCH_KEYS)
        # One ranged GET per batch (its packed keys lie together), one GET for each of the
        # four keys not taken from the pack.
        assert 4 < gets <= 4 + batches, gets
        result = _result(_task(cache, s3_bucket, readable))
        assert result["gets"] == 0, result["stats"]
        assert result["sizes"] == [sizes[k] for k in readable]
        assert cache.client.get(s3_bucket, changed) == b"new".ljust(4096, b"!")
        assert cache.client.get(s3_bucket, bad) == bad.encode().ljust(4096, b".")
        with pytest.raises(S3ObjectNotFound):
            cache.client.get(s3_bucket, gone)
    second = _pack_of(s3, s3_bucket, "ws/packed")
    assert second.key != first.key
    assert {e.key: e.etag for e in second.entries}[changed] != {
        e.key: e.etag for e in first.entries}[changed]
    with pytest.raises(Exception, match="404|Not Found"):
        s3.head_object(Bucket=s3_bucket, Key=first.key)
    puts = request_counts().get("PutObject", 0)
    with open_cache("t-pack", s3_server, app="packed", idle="1s", working_set_url=url,
                    cluster=local_cluster) as cache:
        assert cache.client.get_many(s3_bucket, readable) == [
            b"new".ljust(4096, b"!") if k == changed else k.encode().ljust(sizes[k], b".")
            for k in readable]
        job_id = cache.job_id
    assert _pack_of(s3, s3_bucket, "ws/packed") == second
    assert request_counts().get("PutObject", 0) - puts == 1, "the record's copy only"
    _wait_ended(local_cluster, job_id)


def test_a_kept_pack_is_one_that_is_still_there(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """Run 2's entries are run 1's, but its pack is gone from S3 (another run from the same
    record replaced and deleted it): run 2 writes a new pack instead of keeping a record that
    names a deleted one (before, it kept the gone pack, and every later prewarm fetched each
    key alone)."""
    sizes = {f"g/{i:03d}": 4096 for i in range(50)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    url = f"s3://{s3_bucket}/ws/gone"
    first: PackRef | None = None
    for _ in range(2):
        if first is not None:
            s3.delete_object(Bucket=s3_bucket, Key=first.key)
        _run_reading(local_cluster, s3_server, name="t-gone", app="gone", url=url,
                     bucket=s3_bucket, keys=keys)
        if first is None:
            first = _pack_of(s3, s3_bucket, "ws/gone")
    assert first is not None
    second = _pack_of(s3, s3_bucket, "ws/gone")
    assert second.key != first.key
    assert s3.head_object(Bucket=s3_bucket, Key=second.key)["ContentLength"] == second.size


def test_a_run_that_packs_nothing_deletes_the_last_pack(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """Run 2 reads only an object too large to pack: its record names no pack, and run 1's
    pack, which no record names any more, is deleted (before, it stayed in S3 for good)."""
    sizes = {**{f"n/{i:03d}": 4096 for i in range(20)}, "n/large": PACK_OBJECT_BYTES_MAX + 1}
    _upload(s3, s3_bucket, sizes)
    url = f"s3://{s3_bucket}/ws/none"
    first: PackRef | None = None
    for keys in (sorted(sizes), ["n/large"]):
        _run_reading(local_cluster, s3_server, name="t-none", app="none", url=url,
                     bucket=s3_bucket, keys=keys)
        if first is None:
            first = _pack_of(s3, s3_bucket, "ws/none")
    assert first is not None
    record = RunRecord.decode(s3.get_object(Bucket=s3_bucket, Key="ws/none")["Body"].read())
    assert record.pack is None and [u.key for u in record.keys] == ["n/large"]
    with pytest.raises(Exception, match="404|Not Found"):
        s3.head_object(Bucket=s3_bucket, Key=first.key)


def test_the_last_pack_stays_while_a_record_still_names_it(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """Run 2 packs other entries than run 1, but its record's copy in S3 cannot be written (a
    proxy refuses that PUT): the S3 copy still names run 1's pack, which therefore stays
    (before, it was deleted anyway, and the next run from the S3 copy found no pack)."""
    sizes = {f"c/{i:03d}": 4096 for i in range(50)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    url = f"s3://{s3_bucket}/ws/copy"
    with FaultyS3Proxy(s3_server) as proxy:
        _run_reading(local_cluster, proxy.source, name="t-copy", app="copy", url=url,
                     bucket=s3_bucket, keys=keys[:40])
        first = _pack_of(s3, s3_bucket, "ws/copy")
        proxy.refused_puts.add(f"/{s3_bucket}/ws/copy")
        _run_reading(local_cluster, proxy.source, name="t-copy", app="copy", url=url,
                     bucket=s3_bucket, keys=keys)
        assert proxy.puts_refused == 1
    assert _pack_of(s3, s3_bucket, "ws/copy") == first
    assert s3.head_object(Bucket=s3_bucket, Key=first.key)["ContentLength"] == first.size


def test_a_server_that_ignores_ranges_is_not_read_a_whole_pack_per_batch(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """Behind a proxy that drops the Range header (a server that ignores ranges answers 200
    with the whole object), a ranged GET of the pack is refused unread (``RangeIgnored``, not
    retried; before, the whole pack was read and only then found too long), and the prewarm
    fetches each key on its own: every key is prewarmed and none from the pack."""
    sizes = {f"r/{i:03d}": 4096 for i in range(100)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    url = f"s3://{s3_bucket}/ws/ranged"
    with FaultyS3Proxy(s3_server) as proxy:
        _run_reading(local_cluster, proxy.source, name="t-ranged", app="ranged", url=url,
                     bucket=s3_bucket, keys=keys)
        pack = _pack_of(s3, s3_bucket, "ws/ranged")
        proxy.drop_ranges = True
        with pytest.raises(S3InvalidRequest) as refused:
            S3Store(proxy.source).get_range(s3_bucket, pack.key, 0, 4095)
        assert (refused.value.code, refused.value.status) == (RANGE_IGNORED, 200)
        _prewarm_each_key_alone(local_cluster, proxy.source, name="t-ranged", app="ranged",
                                url=url, bucket=s3_bucket, keys=keys)
        assert proxy.ranges_dropped >= 2


def test_pack_reads_answered_with_a_garbled_length_leave_every_batch_fetched_key_by_key(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """Behind a proxy whose ranged GETs answer with a Content-Length that is not a number, each
    of three batches' pack reads fails with an ``S3Unavailable`` from the raw getter; the
    prewarm fetches each batch's keys on their own, so every key is prewarmed (none from the
    pack) and the run's task reads them all without S3.

    Not a test of e0c18d7's catch-all in ``_from_pack`` any more: when this was written the
    garbled length was an untyped ``ValueError``, and since fe2566b it is an ``S3Error``, which
    ``_from_pack`` caught before e0c18d7 too (the next test raises one outside the S3
    errors)."""
    sizes = {f"v/{i:04d}": 4096 for i in range(3 * PREWARM_BATCH_KEYS)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    url = f"s3://{s3_bucket}/ws/garbled"
    with FaultyS3Proxy(s3_server) as proxy:
        _run_reading(local_cluster, proxy.source, name="t-garbled", app="garbled", url=url,
                     bucket=s3_bucket, keys=keys)
        proxy.garble_range_lengths = True
        _prewarm_each_key_alone(local_cluster, proxy.source, name="t-garbled", app="garbled",
                                url=url, bucket=s3_bucket, keys=keys)
        assert proxy.lengths_garbled >= 3


def test_a_pack_read_failing_outside_the_s3_errors_leaves_every_batch_fetched_key_by_key(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """On boto3's path (``raw_get`` off), behind a proxy that leaves the ETag out of listings,
    the listing that validates each of three batches' packed keys fails with a ``KeyError``,
    outside the S3 errors: ``_from_pack`` logs it and the prewarm fetches the keys on their
    own, so every key is prewarmed (none from the pack) and the run's task reads them all
    without S3 once listings are whole again (before e0c18d7 the error ended each stream
    thread: nothing was prewarmed, and the claimed-ahead keys stayed claimed)."""
    sizes = {f"e/{i:04d}": 4096 for i in range(3 * PREWARM_BATCH_KEYS)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    url = f"s3://{s3_bucket}/ws/etagless"
    with FaultyS3Proxy(s3_server) as proxy:
        source = dataclasses.replace(proxy.source, raw_get=False)
        _run_reading(local_cluster, source, name="t-etagless", app="etagless", url=url,
                     bucket=s3_bucket, keys=keys)
        proxy.strip_listing_etags = True
        with pytest.raises(KeyError):
            S3Store(source).list_keys(s3_bucket, keys[:4])
        with open_cache("t-etagless", source, app="etagless", prewarm=True, idle="1s",
                        working_set_url=url, cluster=local_cluster) as cache:
            assert cache.wait_prewarmed(120.0)
            status = cache.status()
            assert status["prewarm_fetched"] == len(keys)
            assert status["prewarm_stats"]["packed"] == 0, status["prewarm_stats"]
            assert proxy.listings_stripped >= 1 + 3
            proxy.strip_listing_etags = False
            result = _result(_task(cache, s3_bucket, keys))
            assert result["gets"] == 0 and result["sizes"] == [4096] * len(keys)
            job_id = cache.job_id
        _wait_ended(local_cluster, job_id)


def test_a_batch_of_packed_keys_in_two_ranges_is_validated_by_a_listing_each(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """Run 1 reads two ranges of keys far apart in S3's order (1,000 keys it does not read lie
    between them), so one prewarm batch holds both. The first listing stops within its bound
    before the second range; a second listing from that range's first key validates it, and
    every key is taken from the pack (before, the second range was fetched a GET per key)."""
    sizes = {**{f"a/{i:03d}": 4096 for i in range(100)},
             **{f"z/{i:03d}": 4096 for i in range(100)}}
    _upload(s3, s3_bucket, {**sizes, **{f"m/{i:04d}": 1 for i in range(1000)}})
    keys = sorted(sizes)
    url = f"s3://{s3_bucket}/ws/ranges"
    _run_reading(local_cluster, s3_server, name="t-ranges", app="ranges", url=url,
                 bucket=s3_bucket, keys=keys)
    before = request_counts()
    with open_cache("t-ranges", s3_server, app="ranges", prewarm=True, idle="1s",
                    working_set_url=url, cluster=local_cluster) as cache:
        assert cache.wait_prewarmed(120.0)
        assert cache.status()["prewarm_stats"]["packed"] == len(keys)
        sent = {op: n - before.get(op, 0) for op, n in request_counts().items()}
        assert sent.get("GetObject", 0) == 1, sent  # the pack's range: both lie together
        # The first listing's two pages (up to its bound of 4 x 200 + 16 keys), then one.
        assert sent.get("ListObjectsV2", 0) == 3, sent
        job_id = cache.job_id
    _wait_ended(local_cluster, job_id)


def test_a_pack_larger_than_a_part_is_uploaded_in_parts(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pack is built a part at a time (``PACK_PART_BYTES``, lowered here to S3's 5 MiB
    minimum so that 6.25 MiB of entries make two parts) and uploaded as one multipart object:
    each packed entry's bytes are where the record says, and the next run's prewarm takes
    every key from it."""
    monkeypatch.setattr(pack_module, "PACK_PART_BYTES", 5 * MiB)
    sizes = {f"m/{i:03d}": PACK_OBJECT_BYTES_MAX for i in range(100)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    url = f"s3://{s3_bucket}/ws/parts"
    before = request_counts()
    with open_cache("t-parts", s3_server, app="parts", idle="1s", working_set_url=url,
                    cluster=local_cluster) as cache:
        cache.client.get_many(s3_bucket, keys)
        job_id = cache.job_id
    assert request_counts().get("UploadPart", 0) - before.get("UploadPart", 0) == 2
    _wait_ended(local_cluster, job_id)
    pack = _pack_of(s3, s3_bucket, "ws/parts")
    body = s3.get_object(Bucket=s3_bucket, Key=pack.key)["Body"].read()
    assert len(body) == sum(sizes.values()) and len(pack.entries) == len(keys)
    for entry in pack.entries:
        assert body[entry.offset:entry.offset + entry.size] == entry.key.encode().ljust(
            entry.size, b".")
    with open_cache("t-parts", s3_server, app="parts", prewarm=True, idle="1s",
                    working_set_url=url, cluster=local_cluster) as cache:
        assert cache.wait_prewarmed(120.0)
        assert cache.status()["prewarm_stats"]["packed"] == len(keys)
        result = _result(_task(cache, s3_bucket, keys))
        assert result["gets"] == 0 and result["sizes"] == [sizes[k] for k in keys]
        job_id = cache.job_id
    _wait_ended(local_cluster, job_id)


def test_a_run_record_carries_its_pack() -> None:
    """A record's pack lists each packed key by its index in the record and its ETag; the
    offsets come back as the sums of the sizes packed before, in the pack's order."""
    keys = (KeyUse("b", "x", 10, 1), KeyUse("b", "y", 20, 2), KeyUse("c", "z", 5, 1))
    pack = PackRef("b", "ws.pack-1", (PackEntry("c", "z", "e" * 32, 0, 5),
                                      PackEntry("b", "x", "f" * 32, 5, 10)))
    record = RunRecord("app", "run", 1, 2.0, keys, pack)
    assert RunRecord.decode(record.encode()) == record
    plain = RunRecord("app", "run", 1, 2.0, keys)
    assert RunRecord.decode(plain.encode()).pack is None


def test_eviction_by_recency(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    sizes = {f"e/{i}": MiB for i in range(10)}
    _upload(s3, s3_bucket, sizes)
    with open_cache("t-evict", s3_server, capacity="6MiB", idle="60s",
                    cluster=local_cluster) as cache:
        reader = cache.client
        for i in range(10):
            reader.get(s3_bucket, f"e/{i}")
            reader.flush()
            cache.maintain_now()
        reader.get(s3_bucket, "e/0")  # read again: the most recent now
        reader.flush()
        cache.maintain_now()
        status = cache.status()
        assert status["held_bytes"] <= 6 * MiB and status["evictions"] >= 4
        fresh, filled = reader.stats.fresh, reader.stats.filled
        reader.get(s3_bucket, "e/9")
        reader.get(s3_bucket, "e/0")
        assert reader.stats.fresh - fresh == 2, "the most recent stay"
        reader.get(s3_bucket, "e/1")
        assert reader.stats.filled - filled == 1, "the least recent went"


def test_capacity_follows_the_working_set(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    sizes = {f"s/{i:02d}": MiB for i in range(40)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    with open_cache("t-size", s3_server, app="sz", idle="60s", cluster=local_cluster) as cache:
        assert cache.capacity_bytes == 64 * MiB
        cache.client.get_many(s3_bucket, keys[:20])
    # Fitted to the run's 20 MiB at its end (x1.25), and the controller reserves that, with
    # its entries' records (entries of 1 MiB).
    with open_cache("t-size", s3_server, app="sz", idle="60s", cluster=local_cluster) as cache:
        assert cache.capacity_bytes == 25 * MiB
        opened = local_cluster.control.open_cache("t-size", {}, 60_000)
        assert opened["capacity_bytes"] == reservation_bytes(25 * MiB, entry_bytes_mean=MiB)
        assert opened["capacity_bytes"] == cache.status()["reserved_bytes"]
        cache.client.get_many(s3_bucket, keys)
        cache.client.flush()
        deadline = time.monotonic() + 30.0
        while cache.capacity_bytes < 50 * MiB and time.monotonic() < deadline:
            time.sleep(0.25)
        assert cache.capacity_bytes == 50 * MiB, "grown while the run read more"
        assert local_cluster.control.open_cache("t-size", {}, 60_000)["capacity_bytes"] == (
            reservation_bytes(50 * MiB, entry_bytes_mean=MiB))


def test_a_working_set_that_fits_is_held_while_the_cache_grows(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run whose working set outgrows the starting capacity quickly (faster than the
    sizing interval) grows the cache before anything is evicted: every entry is still held
    and the next read of the whole set is all hits (the benchmark's 1 GiB cold run evicted
    192 of 1024 entries while its cache grew from 64 MiB, and its cached run refetched them)."""
    import pocketflow.cache.cache as cache_module

    monkeypatch.setattr(cache_module, "CAPACITY_DEFAULT_BYTES", 16 * MiB)
    sizes = {f"g/{i:02d}": MiB for i in range(40)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    with open_cache("t-grow", s3_server, idle="1s", lease_ms=600_000,
                    cluster=local_cluster) as cache:
        assert cache.capacity_bytes == 16 * MiB
        for start in range(0, len(keys), 10):
            cache.client.get_many(s3_bucket, keys[start:start + 10])
            cache.client.flush()
            cache.maintain_now()
        status = cache.status()
        assert status["evictions"] == 0, status
        assert status["held_bytes"] == 40 * MiB <= cache.capacity_bytes
        before = cache.client.stats.fresh
        cache.client.get_many(s3_bucket, keys)
        assert cache.client.stats.fresh - before == len(keys), "the whole set is held"
        job_id = cache.job_id
    _wait_ended(local_cluster, job_id)


def test_a_miss_costs_two_calls_before_its_bytes(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """What the storage servers serve per miss, counted by their own metrics: the claim is
    not read back when every claim of the batch was written (before, each miss read its claim
    back), and the reader waited for one call (the claims' put) between the ``meta`` read and
    its S3 request; the entry, meta and outcome are written after it has its bytes."""
    from test_metrics import scrape_all, summed

    sizes = {f"rt/{i:02d}": 10_000 for i in range(16)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    with open_cache("t-trips", s3_server, idle="1s", lease_ms=600_000,
                    cluster=local_cluster) as cache:
        before = scrape_all(local_cluster)
        data = cache.client.get_many(s3_bucket, keys)
        trips = cache.client.stats.to_dict().get("fill_round_trips")
        cache.client.flush()
        after = scrape_all(local_cluster)
        assert [len(d) for d in data] == [sizes[k] for k in keys]
        assert cache.client.stats.filled == len(keys)

        def moved(name: str, **labels: str) -> float:
            return summed(after, name, **labels) - summed(before, name, **labels)

        # Reads that found something: each claim's removal, once its fill is written (the
        # misses' meta reads found nothing; before, each claim was also read back).
        found = moved("pocketflow_requests_total", op="get", result="ok")
        assert found == len(keys), f"{found} reads found an object for {len(keys)} misses"
        # Writes: each miss's claim, entry, meta and outcome.
        assert moved("pocketflow_requests_total", op="put") == 4 * len(keys)
        assert trips == 1, "the claims' put, and no read back"
        before = cache.client.stats.fresh
        assert cache.client.get_many(s3_bucket, keys) == data
        assert cache.client.stats.fresh - before == len(keys)
        job_id = cache.job_id
    _wait_ended(local_cluster, job_id)


def test_prewarm_plan_takes_benefit_per_byte_within_capacity() -> None:
    uses = [KeyUse("b", "big-once", 10 * MiB, 1), KeyUse("b", "small-often", 1000, 50),
            KeyUse("b", "mid", MiB, 3), KeyUse("b", "never", 10, 0)]
    plan = plan_prewarm(uses, 2 * MiB)
    assert [u.key for u in plan] == ["small-often", "mid"]
    assert [u.key for u in plan_prewarm(uses, 64 * MiB)] == ["small-often", "big-once", "mid"]


def test_prewarm_plan_keeps_the_first_read_order_among_equal_benefits() -> None:
    """Keys of equal benefit (a run's same-size inputs, each read once) are fetched in the
    order the last run first read them, so a prewarm reaches the keys its run's first tasks
    ask for first."""
    uses = [KeyUse("b", f"in/{i:05d}", 4096, 1) for i in range(2000)]
    shuffled = uses[1000:] + uses[:1000]
    assert plan_prewarm(shuffled, 64 * MiB) == shuffled


def test_a_cache_larger_than_dram_keeps_entries_on_nvme(
    local_cluster: LocalCluster, s3_server: S3Source, s3: Any, s3_bucket: str,
) -> None:
    """A cache whose capacity is more than the cluster's DRAM (2 x 128 MiB here) is reserved on
    DRAM first and the rest on NVMe, as any latency-sensitive job: its entries land on both and
    are read back as hits from either."""
    sizes = {f"n/{i:02d}": MiB for i in range(32)}
    _upload(s3, s3_bucket, sizes)
    keys = sorted(sizes)
    with open_cache("t-spill", s3_server, capacity="320MiB", idle="1s", lease_ms=600_000,
                    cluster=local_cluster) as cache:
        servers = {s.node_id: s for s in cache.spec.handle.servers if s.weight > 0}
        tiers = {s.tier for s in servers.values()}
        assert tiers == {"dram", "nvme"}, servers
        assert cache.client.get_many(s3_bucket, keys) == [
            k.encode().ljust(MiB, b".") for k in keys]
        cache.client.flush()
        before = cache.client.stats.fresh
        assert cache.client.get_many(s3_bucket, keys) == [
            k.encode().ljust(MiB, b".") for k in keys]
        assert cache.client.stats.fresh - before == len(keys), "every entry a hit"
        nvme = [node for node, s in servers.items() if s.tier == "nvme"]
        assert wait_for(lambda: sum(used_bytes(local_cluster).get(n, 0) for n in nvme)
                        >= 4 * MiB), "some entries are held on NVMe"
        job_id = cache.job_id
    _wait_ended(local_cluster, job_id)
