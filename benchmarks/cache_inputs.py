"""A Lithops job mapping over inputs in S3, run four ways (issue 32's benchmark of the
read-through cache, :mod:`pocketflow.cache`), for two input mixes.

Run from the repository root::

    python3 -m benchmarks.cache_inputs [--quick | --scale F] [--out DIR] [--mixes 1MiB,4KiB]

One SeaweedFS S3 server (``weed server -s3`` on 127.0.0.1, :class:`benchmarks.peers.S3Peer`)
holds the inputs of each mix: ``1MiB``, 1 GiB of 1 MiB objects (1024), and ``4KiB``, 20,000
objects of 4 KiB (``--quick``: 12 and 300; ``--scale 0.1``: a tenth of each, 102 and 2,000,
with the full run's tasks: the reduced size that shows a change's direction on a loaded
machine). A Lithops localhost executor (version 1, ``WORKERS``
worker processes, Lithops' own data in its localhost storage) maps ``TASKS`` calls over the
keys, each call reading a contiguous share of them, four ways, one after the other:

- ``s3``: straight from S3, boto3 GETs (as Lithops' own storage backend reads), ``S3_PARALLEL_MAX``
  at once per task; the goals are against this way.
- ``s3-raw``: the same GETs on the cache's pooled raw HTTP connections
  (:mod:`pocketflow.cache.http_get`, which the cache's fills and revalidations use): how much of
  a gain is the cheaper GET alone (not a goal's baseline).
- ``cold``: through a new cache on a local cluster (``CacheClient.get_views``: views of the
  storage servers' shared DRAM arenas, pinned and read in place, else of one buffer per round,
  with huge pages; the run's ``app`` recorded at its end, with a copy of its
  working set in S3).
- ``cached``: the same cache again (its entries held; their validation lease has run out: the
  driver revalidates the last run's working set as it opens the cache, one ListObjectsV2 page
  per 1000 keys, while the first calls start; a task that still finds its keys stale
  revalidates them itself, one page per 1000 keys, and after its read renews the cached keys
  that follow its share with one more page: the calls that read those within the 5 s lease
  find them fresh).
- ``prewarmed``: a fresh local cluster (nothing cached), the cache opened with ``prewarm=True``
  from the working set's copy in S3 (its objects of 64 KiB or less from the pack the cold run
  wrote next to it, :mod:`pocketflow.cache.pack`: a listing and ranged GETs per batch instead of
  a GET per object); the map is submitted at once, while the prewarm runs.

Reported per run: input I/O per task (the time a call spends getting its inputs: mean and p95
over calls, and in the JSON each call's, with its process's CPU over the same span and its
cache counters; a miss's bytes are the call's when S3 answered, and its entry is written after, by
the cache client's publisher, which the call's ``flush`` waits for within the job time), job
time (submission to the last result; for ``prewarmed`` from opening the
cache, so the prewarm counts), the hit ratio (reads served from the cache: fresh, revalidated,
or filled by another process while the task waited; over every read of every call), the S3
requests of the run by operation (every call's and the driver's, which prewarms), and bytes
checked (each call verifies its inputs' contents). For ``prewarmed`` also what bounds the
prewarm's rate, from CPU times, which load changes far less than wall times: its workers' CPU
per object (their start included; without it; and the kernel's part, the receives from S3 and
the sends into the cache), the S3 server's CPU per object, the objects taken from
the pack, and the machine's busy cores
over the run, whoever's work (every core busy means the prewarm is bound by CPU: a faster one
needs less CPU per object rather than more GETs in flight). Results go to
``benchmarks/results/cache-inputs-<date>[-quick|-scale<F>].json`` and ``.md`` (the full run's,
on a quiet machine, are the ones committed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import cloudpickle

from benchmarks.machine import (
    git_commit,
    machine,
    machine_busy_cpu_s,
    now_iso,
    package_versions,
    process_cpu_s,
    today,
)
from benchmarks.peers import S3Peer
from pocketflow.demo import forget_inherited_lithops_session, lithops_config

# Lithops pickles the tasks below; workers cannot import this module by name from every working
# directory, so they travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

RESULTS_DIR = Path(__file__).resolve().parent / "results"
WAYS = ("s3", "s3-raw", "cold", "cached", "prewarmed")
MIXES = {
    "full": {"1MiB": (1024, 1024 * 1024), "4KiB": (20_000, 4096)},
    "quick": {"1MiB": (12, 1024 * 1024), "4KiB": (300, 4096)},
}
TASKS = {"full": 16, "quick": 4}
WORKERS = 2
"""Lithops worker processes (the machine's cores)."""
S3_PARALLEL_MAX = 16
"""GETs one straight-S3 task has in flight (the cache client's own bound for its misses)."""
UPLOAD_THREADS = 16
CLUSTER_SHAPE = {"dram_servers": 2, "nvme_servers": 0, "dram_capacity": "1GiB",
                 "num_cpus": 2, "object_store_memory": "80MiB"}
"""Room for the 1 GiB mix and the 4 KiB one, with the caches' bookkeeping."""
CACHED_AFTER_S = 6.0
"""The cached run starts at least this long after the cold one ended, so that the validation
lease (5 s by default) has run out: the cached run pays its validations."""
GOAL_IO_RATIO = 0.2
GOAL_COLD_SLOWDOWN = 1.10
GOAL_HIT_RATIO = 0.95
WS_BUCKET = "cache-bench-working-sets"


def _content(key: str, size: int) -> bytes:
    """The bytes of input ``key``: its name repeated (each call checks what it read)."""
    seed = key.encode()
    return (seed * (size // len(seed) + 1))[:size]


# -- the map's tasks (run in Lithops workers) ---------------------------------------------------


def read_straight(source: dict[str, Any], bucket: str, keys: list[str],
                  size: int) -> dict[str, Any]:
    """Read ``keys`` with GETs, ``S3_PARALLEL_MAX`` at once (boto3's unless the source's
    ``raw_get`` is on); time it, check it."""
    from pocketflow.cache.source import S3Source, S3Store, request_counts

    store = S3Store(S3Source.from_dict(source))
    store.connect()  # boto3's import and client, outside the timed reads
    before = Counter(request_counts())
    started = time.perf_counter()
    with ThreadPoolExecutor(S3_PARALLEL_MAX) as pool:
        datas = list(pool.map(lambda k: store.get(bucket, k).data, keys))  # type: ignore[union-attr]
    io_s = time.perf_counter() - started
    ok = all(d == _content(k, size) for k, d in zip(keys, datas, strict=True))
    after = Counter(request_counts())
    return {"io_s": io_s, "reads": len(keys), "hits": 0, "ok": ok,
            "bytes": sum(len(d) for d in datas), "requests": dict(after - before),
            "stats": {}}


def read_cached(spec_json: str, bucket: str, keys: list[str], size: int) -> dict[str, Any]:
    """Read ``keys`` through the cache (one ``get_views``); time it, check it."""
    from pocketflow.cache import shared_client
    from pocketflow.cache.source import request_counts

    cache = shared_client(spec_json)
    # The cache's GETs and listings are raw (no boto3): its tasks make no boto3 client, whose
    # 0.1-0.2 s of CPU per task otherwise competes with a prewarm running at the same time.
    cache.source_store.connect(boto3=False)
    before = Counter(request_counts())
    stats_before = cache.stats.to_dict()
    started_unix = time.time()
    started, cpu_started = time.perf_counter(), time.process_time()
    # Views of one buffer per round with huge pages: each call is a fresh process (Lithops
    # forks one per call), whose get_many would fault 64 MiB in 4 KiB at a time.
    datas = cache.get_views(bucket, keys)
    io_s = time.perf_counter() - started
    io_cpu_s = time.process_time() - cpu_started
    cache.flush()
    ok = all(d == _content(k, size) for k, d in zip(keys, datas, strict=True))
    after = Counter(request_counts())
    stats = {k: v - stats_before.get(k, 0) for k, v in cache.stats.to_dict().items()}
    return {"io_s": io_s, "io_cpu_s": io_cpu_s, "reads": len(keys), "hits": stats["hits"],
            "ok": ok, "started_unix": started_unix,
            "bytes": sum(len(d) for d in datas), "requests": dict(after - before),
            "stats": stats}


def _noop(x: int) -> int:
    return x


# -- the driver ---------------------------------------------------------------------------------


def _upload(source: Any, bucket: str, count: int, size: int) -> list[str]:
    from pocketflow.cache.source import S3Store

    store = S3Store(source)
    store.create_bucket(bucket)
    keys = [f"in/{i:06d}" for i in range(count)]
    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        list(pool.map(lambda k: store.put(bucket, k, _content(k, size)), keys))
    return keys


def _shares(keys: list[str], tasks: int) -> list[list[str]]:
    per = -(-len(keys) // tasks)
    return [keys[i:i + per] for i in range(0, len(keys), per)]


@contextmanager
def _executor() -> Iterator[Any]:
    import lithops

    fexec = lithops.FunctionExecutor(config=lithops_config(storage="localhost", workers=WORKERS))
    try:
        fexec.get_result(fexec.map(_noop, [0]))  # the first job pays for the machinery
        yield fexec
    finally:
        fexec.clean()


def _map(fexec: Any, function: Any, args: list[tuple[Any, ...]]) -> tuple[list[Any], float]:
    started = time.perf_counter()
    results = fexec.get_result(fexec.map(function, args))
    return results, time.perf_counter() - started


def _summary(way: str, results: list[dict[str, Any]], job_s: float,
             driver_requests: Counter[str], extra: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    io = [r["io_s"] for r in results]
    requests: Counter[str] = Counter(driver_requests)
    for r in results:
        requests.update(r["requests"])
    reads = sum(r["reads"] for r in results)
    stats: Counter[str] = Counter()
    for r in results:
        stats.update(r["stats"])
    row = {
        "way": way, "job_s": job_s, "tasks": len(results),
        "io_s_mean": statistics.fmean(io), "io_s_p95": _p95(io),
        "reads": reads, "hit_ratio": sum(r["hits"] for r in results) / reads if reads else 0.0,
        "s3_requests": dict(requests), "s3_requests_total": sum(requests.values()),
        "bytes": sum(r["bytes"] for r in results), "ok": all(r["ok"] for r in results),
        "cache_stats": dict(stats),
        # Per call, in the map's order: which calls pay the tail (a mean and a p95 hide it).
        "io_s_per_task": io,
        # The call's process CPU (its threads, user and kernel) over the same span: what load
        # changes far less than the wall time.
        "io_cpu_s_per_task": [r.get("io_cpu_s") for r in results],
        "stats_per_task": [r["stats"] for r in results],
        # When each call's reads began (unix s): which calls ran while a prewarm did.
        "started_unix_per_task": [r.get("started_unix") for r in results],
    }
    row.update(extra or {})
    return row


def _or_unknown(value: float | None, scale: float = 1.0) -> str:
    """``value * scale`` rounded for a report line, ``?`` if it is not known (a result file
    written before it was measured)."""
    return "?" if value is None else format(value * scale, ".0f")


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


class Mix:
    """One input mix in S3: its bucket, keys, object size and the calls' shares of the keys."""

    def __init__(self, name: str, count: int, size: int, tasks: int, source: Any) -> None:
        self.name, self.count, self.size = name, count, size
        self.bucket = f"cache-bench-{name.lower()}-{uuid.uuid4().hex[:6]}"
        print(f"{name}: uploading {count} objects of {size} bytes to s3://{self.bucket}",
              flush=True)
        self.keys = _upload(source, self.bucket, count, size)
        self.shares = _shares(self.keys, tasks)
        self.cache = f"bench-{name.lower()}-{uuid.uuid4().hex[:6]}"
        self.ws_url = f"s3://{WS_BUCKET}/{self.cache}"


def _report(mix: Mix, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(f"  {mix.name:5s} {row['way']:10s} job {row['job_s']:7.2f} s, I/O per task mean "
          f"{1000 * row['io_s_mean']:8.1f} ms p95 {1000 * row['io_s_p95']:8.1f} ms, hits "
          f"{100 * row['hit_ratio']:5.1f}%, S3 requests {row['s3_requests']}, "
          f"{'OK' if row['ok'] else 'WRONG BYTES'}", flush=True)
    rows.append({"mix": mix.name, "objects": mix.count, "object_bytes": mix.size, **row})


def _process_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user and system) process ``pid`` used so far; None if it is unknown."""
    if pid is None:
        return None
    try:
        return process_cpu_s(pid)
    except OSError:
        return None


def _prewarm_cpu(status: dict[str, Any], gets: int, s3_cpu_s: float | None,
                 busy_s: float, wall_s: float) -> dict[str, Any]:
    """What bounds a prewarm's rate, from CPU times (which load changes far less than wall
    times): its workers' CPU per object fetched, the S3 server's CPU per object fetched (the
    run's GETs, listings and the tasks' requests included), the objects taken from the last
    run's pack (:mod:`pocketflow.cache.pack`) and the run's GETs, and how many of the
    machine's cores were busy on average (all of them: CPU-bound)."""
    fetched = status.get("prewarm_fetched") or 0
    cpu_s = status.get("prewarm_cpu_s")
    start_s = status.get("prewarm_start_cpu_s") or 0.0
    system_s = status.get("prewarm_cpu_system_s") or 0.0
    return {
        "prewarm_cpu_us_per_object": (1e6 * cpu_s / fetched if cpu_s and fetched else None),
        # Without the workers' start (interpreter, imports, first claims), user and kernel.
        "prewarm_fetch_cpu_us_per_object": (1e6 * (cpu_s - start_s) / fetched
                                            if cpu_s and fetched else None),
        "prewarm_system_cpu_us_per_object": (1e6 * system_s / fetched
                                             if cpu_s and fetched else None),
        "prewarm_start_cpu_s": start_s,
        "s3_server_cpu_us_per_object": (1e6 * s3_cpu_s / fetched
                                        if s3_cpu_s is not None and fetched else None),
        "prewarm_packed": (status.get("prewarm_stats") or {}).get("packed", 0),
        "gets": gets,
        "machine_busy_cores": busy_s / wall_s if wall_s > 0 else None,
    }


def run_ways(mixes: list[Mix], source: Any, fexec: Any,
             s3_pid: int | None = None) -> list[dict[str, Any]]:
    """The four ways over every mix: straight; cold then cached on one local cluster; prewarmed
    on a fresh one (with the CPU times of its prewarm and of the S3 server, ``s3_pid``)."""
    import pocketflow
    from pocketflow.cache import open_cache
    from pocketflow.cache.source import request_counts

    rows: list[dict[str, Any]] = []
    for mix in mixes:
        for way, raw_get in (("s3", False), ("s3-raw", True)):
            straight = {**source.to_dict(), "raw_get": raw_get}
            results, job_s = _map(fexec, read_straight,
                                  [(straight, mix.bucket, share, mix.size)
                                   for share in mix.shares])
            _report(mix, _summary(way, results, job_s, Counter()), rows)
    with pocketflow.LocalCluster(**CLUSTER_SHAPE) as cluster:
        for way in ("cold", "cached"):
            for mix in mixes:
                before = Counter(request_counts())
                with open_cache(mix.cache, source, app=mix.cache, cluster=cluster,
                                working_set_url=mix.ws_url, idle="10min") as cache:
                    spec = cache.spec.to_json()
                    results, job_s = _map(fexec, read_cached,
                                          [(spec, mix.bucket, share, mix.size)
                                           for share in mix.shares])
                    status = cache.close()
                _report(mix, _summary(way, results, job_s, Counter(request_counts()) - before,
                                      {"cache": status}), rows)
            if way == "cold":
                time.sleep(CACHED_AFTER_S)
    with pocketflow.LocalCluster(**CLUSTER_SHAPE) as cluster:
        for mix in mixes:
            before = Counter(request_counts())
            s3_cpu_before, busy_before = _process_cpu_s(s3_pid), machine_busy_cpu_s()
            started, opening_unix = time.perf_counter(), time.time()
            with open_cache(mix.cache, source, app=mix.cache, cluster=cluster, prewarm=True,
                            working_set_url=mix.ws_url, idle="10min") as cache:
                opened_unix = time.time()
                spec = cache.spec.to_json()
                results, _ = _map(fexec, read_cached,
                                  [(spec, mix.bucket, share, mix.size) for share in mix.shares])
                job_s = time.perf_counter() - started
                cache.wait_prewarmed(600.0)
                prewarmed_unix = time.time()
                wall_s = time.perf_counter() - started
                s3_cpu_after, busy_after = _process_cpu_s(s3_pid), machine_busy_cpu_s()
                status = cache.close()
            requests = Counter(request_counts()) - before
            s3_cpu_s = (s3_cpu_after - s3_cpu_before
                        if s3_cpu_before is not None and s3_cpu_after is not None else None)
            cpu = _prewarm_cpu(status, requests.get("GetObject", 0), s3_cpu_s,
                               busy_after - busy_before, wall_s)
            # The prewarm's span on the calls' clock: from opening the cache to the driver
            # seeing it done (an upper bound of its end).
            times = {"opening_unix": opening_unix, "opened_unix": opened_unix,
                     "prewarmed_unix": prewarmed_unix}
            _report(mix, _summary("prewarmed", results, job_s, requests,
                                  {"cache": status, **cpu, **times}), rows)
    return rows


def prewarm_overlap(row: dict[str, Any]) -> dict[str, Any] | None:
    """Of a prewarmed run's calls, those that began reading before its prewarm ended (on the
    calls' clock: the time the cache saw its last worker end, ``prewarm_ended_unix``) and the
    others: how many, and their mean I/O. A call that overlaps the prewarm shares the
    machine's cores with its fetches (the workers', the S3 server's and the storage servers'
    CPU); None for a result file written before these times were kept."""
    starts = row.get("started_unix_per_task") or []
    cache = row.get("cache") or {}
    ended = cache.get("prewarm_ended_unix")
    if not starts or None in starts or ended is None or "opening_unix" not in row:
        return None
    during = [io for io, t in zip(row["io_s_per_task"], starts, strict=True) if t < ended]
    after = [io for io, t in zip(row["io_s_per_task"], starts, strict=True) if t >= ended]
    return {"first_call_s": min(starts) - row["opening_unix"],
            "prewarm_s": ended - row["opening_unix"],
            "during": len(during), "during_io_s_mean": statistics.fmean(during) if during else None,
            "after": len(after), "after_io_s_mean": statistics.fmean(after) if after else None}


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals, per mix."""
    out: dict[str, Any] = {}
    for mix in sorted({r["mix"] for r in rows}):
        by_way = {r["way"]: r for r in rows if r["mix"] == mix}
        s3 = by_way["s3"]
        out[mix] = {
            "cached_io_ratio": by_way["cached"]["io_s_mean"] / s3["io_s_mean"],
            "prewarmed_io_ratio": by_way["prewarmed"]["io_s_mean"] / s3["io_s_mean"],
            "cold_job_ratio": by_way["cold"]["job_s"] / s3["job_s"],
            "cold_io_ratio": by_way["cold"]["io_s_mean"] / s3["io_s_mean"],
            "raw_get_io_ratio": by_way["s3-raw"]["io_s_mean"] / s3["io_s_mean"],
            "prewarmed_hit_ratio": by_way["prewarmed"]["hit_ratio"],
            "cached_gets": by_way["cached"]["s3_requests"].get("GetObject", 0),
            "cached_lists": by_way["cached"]["s3_requests"].get("ListObjectsV2", 0),
            "cached_job_saving": 1 - by_way["cached"]["job_s"] / s3["job_s"],
            "prewarmed_job_saving": 1 - by_way["prewarmed"]["job_s"] / s3["job_s"],
            "cached_validations_per_read": (
                sum(by_way["cached"]["s3_requests"].values()) / by_way["cached"]["reads"]),
            **{f"cached_{name}": by_way["cached"]["cache_stats"].get(name, 0)
               for name in ("fresh", "revalidated", "listings", "listed_keys", "renewed_ahead")},
        }
    return out


def markdown(results: dict[str, Any]) -> str:
    m, commit = results["machine"], results["commit"]
    lines = [
        f"# Lithops map over S3 inputs: straight, and through pocketflow's cache "
        f"({results['shape']}"
        f"{'' if results.get('scale', 1.0) == 1.0 else ' x ' + format(results['scale'], 'g')})",
        "",
        f"- commit `{(commit['commit'] or '?')[:12]}`"
        f"{' with uncommitted changes' if commit['dirty'] else ''}, {results['started']}, "
        f"{results['duration_s']} s",
        f"- {m['cpu_model']}, {m['cores']} cores, load average {m['load_avg_1m_at_start']:.2f} "
        "at start (other work on the machine counts)",
        f"- Lithops localhost executor v1, {WORKERS} workers; S3: SeaweedFS on 127.0.0.1",
        "",
        "| mix | way | job s | I/O per task mean ms | p95 ms | hit ratio | S3 requests | "
        "bytes ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        requests = ", ".join(f"{k} {v}" for k, v in sorted(r["s3_requests"].items())) or "0"
        lines.append(
            f"| {r['mix']} | {r['way']} | {r['job_s']:.2f} | {1000 * r['io_s_mean']:.1f} | "
            f"{1000 * r['io_s_p95']:.1f} | {100 * r['hit_ratio']:.1f}% | {requests} | "
            f"{'yes' if r['ok'] else 'NO'} |")
    lines += ["", "Goals:"]
    for mix, g in results["goals"].items():
        lines += [
            f"- {mix}: cached I/O per task {g['cached_io_ratio']:.2f}x straight S3, prewarmed "
            f"{g['prewarmed_io_ratio']:.2f}x (goal <= {GOAL_IO_RATIO}x); cold job "
            f"{g['cold_job_ratio']:.2f}x straight S3 (goal <= {GOAL_COLD_SLOWDOWN}x); prewarmed "
            f"hit ratio {100 * g['prewarmed_hit_ratio']:.1f}% (goal >= "
            f"{100 * GOAL_HIT_RATIO:.0f}%); cached run's S3 requests: {g['cached_lists']} "
            f"listings, {g['cached_gets']} GETs (goal: validations only); straight S3 on "
            f"the cache's raw GETs: {g['raw_get_io_ratio']:.2f}x boto3's I/O per task",
            f"- {mix}, cached run: {g['cached_fresh']} fresh hits, {g['cached_revalidated']} "
            f"revalidated; {g['cached_listings']} listings held {g['cached_listed_keys']} keys "
            f"and renewed {g['cached_renewed_ahead']} keys ahead of the calls that read them",
        ]
    for mix in results["goals"]:
        cached_runs = [r for r in results["runs"] if r["mix"] == mix and r.get("cache")]
        if cached_runs:
            # Fills the storage servers refused for want of room (read from S3 instead), and
            # the capacity each run ended with (refusals grow it).
            lines.append(f"- {mix}, fills refused for want of room: " + ", ".join(
                f"{r['way']} {(r.get('cache_stats') or {}).get('refused', 'not counted')} "
                f"(capacity {(r['cache'].get('capacity_bytes') or 0) / 2**20:.0f} MiB at its "
                f"end)" for r in cached_runs))
    for r in results["runs"]:
        if r["way"] == "prewarmed" and r.get("prewarm_cpu_us_per_object") is not None:
            s3_cpu = r.get("s3_server_cpu_us_per_object")
            lines.append(
                f"- {r['mix']}, prewarmed run: the prewarm fetched "
                f"{r['cache'].get('prewarm_objects_per_s') or 0:.0f} objects/s "
                f"({r.get('prewarm_packed', 0)} of {r['cache'].get('prewarm_fetched') or 0} from "
                f"the last run's pack; {r.get('gets', 0)} GETs in the run) at "
                f"{r['prewarm_cpu_us_per_object']:.0f} us of its workers' CPU per object (their "
                f"start included; "
                f"{_or_unknown(r.get('prewarm_fetch_cpu_us_per_object'))} us without it, their "
                f"starts took {_or_unknown(r.get('prewarm_start_cpu_s'), 1000)} ms together; "
                f"{_or_unknown(r.get('prewarm_system_cpu_us_per_object'))} us per object in "
                f"the kernel); the "
                f"S3 server spent "
                f"{'?' if s3_cpu is None else format(s3_cpu, '.0f')} us of CPU per object; the "
                f"machine's cores were {r['machine_busy_cores']:.2f} busy on average of "
                f"{m['cores']} (from opening the cache to the prewarm's end)")
            overlap = prewarm_overlap(r)
            if overlap is not None:
                lines.append(
                    f"- {r['mix']}, prewarmed run: the first call began reading "
                    f"{overlap['first_call_s']:.2f} s after the cache was opened, the prewarm "
                    f"ended at {overlap['prewarm_s']:.2f} s; {overlap['during']} calls began "
                    "while it ran (mean I/O "
                    f"{_or_unknown(overlap['during_io_s_mean'], 1000)} ms), {overlap['after']} "
                    f"after (mean {_or_unknown(overlap['after_io_s_mean'], 1000)} ms)")
    lines += ["", "Side by side with Faa$T (SoCC'21: runs up to 92% and on average 57% faster "
              "with its cache; every read first checks the object's version in blob storage):"]
    for mix, g in results["goals"].items():
        lines.append(
            f"- {mix}: the cached run's job is {100 * g['cached_job_saving']:.0f}% shorter than "
            f"straight S3's, the prewarmed run's {100 * g['prewarmed_job_saving']:.0f}%; its S3 "
            f"requests per read: {g['cached_validations_per_read']:.3f} (Faa$T: 1, a version "
            "check per read)")
    lines += [
        "",
        "Where the gain comes from: a hit costs no S3 request while its validation lease holds, "
        "and once it has run out one listing page revalidates up to 1000 keys (and, after the "
        "read, one more renews the cached keys that follow, which the next calls read), so "
        "small "
        "objects, whose reads are mostly the round trip, gain as much as large ones (Faa$T's "
        "per-read check erased the gain at 64 KB and below); a miss is fetched once however "
        "many tasks ask; a prewarm of small objects takes them from the last run's pack (a "
        "listing page and a ranged GET per 256 objects, each checked against the listing's "
        "ETag, instead of a GET each), so it is not held by per-request CPU, ours or the S3 "
        "server's; and the cached bytes come from pocketflow's storage servers over "
        "pipelined sessions. On this one machine the S3 server is local, so S3 is far faster "
        "than a remote store and every ratio here understates the gain against real S3.",
    ]
    lines += [
        "",
        "The cache's tasks read with `get_views`: on the local cluster each entry is pinned in "
        "its storage server's shared DRAM arena and read in place (no copy; the call makes the "
        "pages present before it returns), and entries that are not pinned land in one buffer "
        "mapped with huge pages, so a call's fresh process (Lithops forks one per call) faults "
        "them in 2 MiB pieces rather than 4 KiB ones; the prewarm fetches in two worker "
        "processes, whose S3 requests are counted with the driver's.",
        "",
        "Straight S3 (`s3`) reads with boto3, as Lithops' storage backend does; the cache's own "
        "GETs (fills, prewarm, revalidations) go on pooled raw HTTP connections at about a "
        "seventh of boto3's CPU per GET, and `s3-raw` shows what that GET alone gives a job "
        "without the cache.",
        "",
        "S3 requests count every call's and the driver's: the driver's are the working set's copy "
        "in S3 (one PutObject when a run ends, one GetObject when one starts: none is "
        "there yet for the cold run), the pack of the small entries (objects of 64 KiB or "
        "less) that the cold run writes next to it (one more PutObject; the cached run holds "
        "the same entries and keeps that pack) and, in the prewarmed run, the prewarm's "
        "requests: for the packed keys one listing page and ranged GETs of the pack per batch "
        "of 256 keys, for the others a GET each. A read "
        "counts as a hit when the cache served it: fresh (within the 5 s validation lease, "
        "from its own listing or another call's listing ahead), revalidated (a listing page per "
        "1000 keys once the lease has run out), or filled by another process "
        "(the prewarm) while the task waited for it.",
        "",
    ]
    return "\n".join(lines)


def mix_sizes(shape: str, scale: float = 1.0) -> dict[str, tuple[int, int]]:
    """Each mix's ``(objects, object bytes)`` for ``shape`` ("full" or "quick"), the full
    counts times ``scale`` (at least one object)."""
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    return {name: (max(1, round(count * scale)), size)
            for name, (count, size) in MIXES[shape].items()}


def run(shape: str, mixes: tuple[str, ...], out_dir: Path,
        scale: float = 1.0) -> dict[str, Any]:
    started_iso, started = now_iso(), time.perf_counter()
    sizes = mix_sizes(shape, scale)
    peer = S3Peer(volume_size_limit_mb=1024)
    peer.start()
    rows: list[dict[str, Any]] = []
    try:
        from pocketflow.cache.source import S3Source, S3Store

        source = S3Source(endpoint_url=peer.spec().endpoint_url, unsigned=True, attempts=1)
        S3Store(source).create_bucket(WS_BUCKET)
        uploaded = [Mix(name, *sizes[name], TASKS[shape], source) for name in mixes]
        with _executor() as fexec:
            rows = run_ways(uploaded, source, fexec, s3_pid=peer.pid)
    finally:
        peer.stop()
    results = {
        "benchmark": "cache-inputs", "shape": shape, "scale": scale, "started": started_iso,
        "duration_s": round(time.perf_counter() - started, 1), "commit": git_commit(),
        "machine": machine(),
        "versions": {**package_versions(("pocketflow", "lithops", "boto3", "ray")),
                     "seaweedfs": peer.version()},
        "config": {"tasks": TASKS[shape], "lithops_workers": WORKERS,
                   "s3_parallel_per_task": S3_PARALLEL_MAX, "cluster": CLUSTER_SHAPE,
                   "mixes": {m: sizes[m] for m in mixes}},
        "runs": rows,
        "goals": goals(rows),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"cache-inputs-{today()}" + ("-quick" if shape == "quick" else "")
    if scale != 1.0:
        stem += f"-scale{scale:g}"
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(results))
    print(f"wrote {out_dir / stem}.json and .md")
    return results


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python3 -m benchmarks.cache_inputs``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="12 x 1 MiB and 300 x 4 KiB, 4 tasks (default: 1 GiB and 20,000)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="the full run's objects times this, in (0, 1] (e.g. 0.1: 102 x 1 "
                             "MiB and 2,000 x 4 KiB, 16 tasks), to see a change's direction "
                             "under load")
    parser.add_argument("--mixes", default="1MiB,4KiB", help="comma-separated input mixes")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    mixes = tuple(m for m in args.mixes.split(",") if m)
    if not mixes or not set(mixes) <= set(MIXES["full"]):
        parser.error(f"--mixes takes some of {','.join(MIXES['full'])}")
    if not 0 < args.scale <= 1 or (args.quick and args.scale != 1.0):
        parser.error("--scale takes a fraction in (0, 1], without --quick")
    forget_inherited_lithops_session()
    results = run("quick" if args.quick else "full", mixes, args.out, args.scale)
    return 0 if all(r["ok"] for r in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
