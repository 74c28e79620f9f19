"""Side by side: the Lithops sort shuffling through Lithops' localhost storage, its redis storage
backend on a real redis-server, and pocketflow (with and without DELETE-on-read).

Run from the repository root::

    python3 -m benchmarks.lithops_sort [--quick] [--repeats N] [--out DIR]

Every variant sorts the same generated records (same seed, 100-byte records, 10-byte keys) with
the same mappers, reducers and Lithops localhost executor (version 1, the same worker processes),
one after the other in this one run, in a rotating order per repeat:

- ``lithops-localhost``: mappers ``put_object`` one object per (mapper, reducer) into Lithops'
  localhost storage (files under Lithops' temporary directory); after the map job, a reduce job
  reads its objects with ``get_object`` and deletes them (as DELETE-on-read would), sorts, and
  writes its output there too. Lithops' own data (payloads, results) uses the same storage.
- ``lithops-redis``: the same tasks on Lithops' ``redis`` storage backend, on a redis-server this
  script starts on 127.0.0.1 and a free port and stops by pid.
- ``pocketflow``: :func:`pocketflow_lithops.shuffle.shuffle` on an embedded local
  cluster (job registration with hints, reducers parked by the ``wait`` action, DELETE-on-read,
  PERSIST outputs, deregistration); Lithops' own data in its localhost storage. Lithops' runtime
  is pocketflow's (:mod:`pocketflow_lithops.runtime`): this interpreter with the client loaded
  before Lithops' runner forks its workers and they fork each task, as Lithops' own storage
  backend (the Lithops variants' shuffle storage) is loaded in its workers before they fork.
  The Lithops variants run on this interpreter, which imports nothing of pocketflow's client.
- ``pocketflow-plain-runtime``: the same shuffle on this interpreter as Lithops' runtime: each
  task process imports the client itself (some 10 ms per task here).
- ``pocketflow-no-delete``: the same with ``delete_inputs=False``, to measure what DELETE saves.
- ``pocketflow-append``: the same shuffle with ``layout="append"``: one shared append file per
  reducer that every mapper appends to (R files instead of M x R objects).

Reported per variant (median over repeats): job time (from submitting the map tasks until every
reducer has written its output; for pocketflow also job registration and deregistration), time
per task in ephemeral I/O (a mapper's writes of its partitions, a reducer's reads of its inputs
and write of its output; pocketflow reducers' time parked in ``wait`` is reported apart), and
peak bytes held by the store above its level before the job, sampled every
``SAMPLE_INTERVAL_S`` by a bounded sampler thread (pocketflow: the servers' ``stats`` action;
redis: ``INFO memory`` ``used_memory``; localhost storage: the size of the files under the job's
prefix). Every run's output is validated (sorted, complete, checksum equal to the input's).
Results go to ``benchmarks/results/lithops-sort-<date>[-quick].json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

from benchmarks.machine import git_commit, machine, now_iso, package_versions, today
from benchmarks.peers import RedisPeer
from pocketflow.demo import (
    _MASK64,
    MapResult,
    PartitionCheck,
    PeakSampler,
    SortConfig,
    check_output,
    check_partition,
    describe_partition,
    forget_inherited_lithops_session,
    format_bytes,
    generate_records,
    group_by_partition,
    lithops_config,
    map_records,
    record_checksum,
    reduce_records,
    sort_runs,
)

# Lithops pickles the storage-backend tasks below; workers cannot import this module by name
# from every working directory, so they travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SAMPLE_INTERVAL_S = 0.05
"""Pause between two samples of the store's used bytes."""
DIR_ENTRIES_MAX = 100_000
"""Most files the localhost-storage sampler walks per sample."""
VARIANTS = ("lithops-localhost", "lithops-redis", "pocketflow", "pocketflow-plain-runtime",
            "pocketflow-no-delete", "pocketflow-append")
SHAPES = {
    "quick": {"records": 200_000, "mappers": 4, "reducers": 4, "repeats": 1},
    "full": {"records": 1_000_000, "mappers": 8, "reducers": 8, "repeats": 3},
}
BASELINE_UNSHIPPED = ["pocketflow"]
"""What the Lithops-storage variants tell Lithops not to analyse and ship: they use
``pocketflow.demo`` only as a library of record functions (installed here), and a plain Lithops
sort would not carry pocketflow's dependency walk, which costs a job about 0.3 s before its
first task starts. pocketflow's own shuffle does the same for its packages
(``pocketflow_lithops.shuffle.RUNTIME_PACKAGES``), so neither side pays it."""
SPEEDUP_GOAL = 1.3
"""pocketflow's job time against Lithops' localhost storage's, at least (median job times)."""
WORKERS = 2
"""Lithops worker processes (the machine's cores; the same for every variant)."""
CLUSTER_SHAPE = {"dram_servers": 2, "nvme_servers": 0, "dram_capacity": "1GiB",
                 "num_cpus": 2, "object_store_memory": "80MiB"}


# -- tasks of the Lithops-storage variants (run in Lithops workers) -----------------------------


def storage_map(config: SortConfig, mapper: int, prefix: str, storage: Any) -> dict[str, Any]:
    """Generate, partition and write one object per reducer with ``storage.put_object``."""
    records = generate_records(config, mapper)
    # Grouped as pocketflow's mappers group (map_records), so both do the same work.
    grouped, bounds = group_by_partition(records, config.reducers)
    started = time.perf_counter()
    for r in range(config.reducers):
        storage.put_object(storage.bucket, f"{prefix}/r{r:05d}/m{mapper:05d}",
                           grouped[bounds[r]:bounds[r + 1]].tobytes())
    io_s = time.perf_counter() - started
    result = MapResult(mapper=mapper, records=records.shape[0],
                       checksum=record_checksum(records), bytes_written=records.size)
    return {"map": result, "io_s": io_s}


def storage_reduce(config: SortConfig, reducer: int, prefix: str, storage: Any) -> dict[str, Any]:
    """Read (then delete) every input of ``reducer``, sort, write the output."""
    started = time.perf_counter()
    inputs = []
    for m in range(config.mappers):
        key = f"{prefix}/r{reducer:05d}/m{m:05d}"
        inputs.append(storage.get_object(storage.bucket, key))
        storage.delete_object(storage.bucket, key)
    io_s = time.perf_counter() - started
    # Sorted as pocketflow's reducers sort (reduce_records), so both do the same work.
    output = sort_runs(inputs).tobytes()
    started = time.perf_counter()
    storage.put_object(storage.bucket, f"{prefix}/out/part-{reducer:05d}", output)
    io_s += time.perf_counter() - started
    return {"reducer": reducer, "bytes_read": sum(len(i) for i in inputs), "io_s": io_s}


def storage_check(reducer: int, prefix: str, storage: Any) -> PartitionCheck:
    """Read reducer ``reducer``'s output back, describe it, delete it."""
    key = f"{prefix}/out/part-{reducer:05d}"
    data = storage.get_object(storage.bucket, key)
    storage.delete_object(storage.bucket, key)
    return describe_partition(reducer, data)


# -- measuring --------------------------------------------------------------------------------


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (at most ``DIR_ENTRIES_MAX`` entries)."""
    total = 0
    seen = 0
    stack = [path]
    while stack and seen < DIR_ENTRIES_MAX:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            seen += 1
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
    return total


@dataclass
class Run:
    """One variant's one run."""

    variant: str
    job_s: float
    map_io_s: list[float]
    reduce_io_s: list[float]
    reduce_wait_s: list[float]
    peak_held_bytes: int
    samples: int
    ok: bool
    problems: list[str] = field(default_factory=list)

    @property
    def io_s_per_task(self) -> float:
        """Mean ephemeral-I/O time of one task (mappers and reducers together)."""
        times = self.map_io_s + self.reduce_io_s
        return sum(times) / len(times) if times else 0.0


def _validate(config: SortConfig, maps: list[MapResult], checks: list[PartitionCheck]) -> list[str]:
    input_checksum = sum(m.checksum for m in maps) & _MASK64
    problems = check_output(config, input_checksum=input_checksum, checks=checks)
    if sum(m.records for m in maps) != config.records:
        problems.append("mappers generated the wrong number of records")
    return problems


def run_storage_variant(name: str, fexec: Any, config: SortConfig,
                        sample: Callable[[str], int]) -> Run:
    """The sort with the shuffle through the executor's own Lithops storage (map, then reduce).

    An empty object ``<prefix>/.keep`` holds the job's prefix for the whole run. Lithops'
    localhost storage removes a deleted object's parent directories once they are empty: a
    reducer deleting its last input could remove the prefix's directory while another
    reducer's ``put_object`` had created it and was about to make ``out/`` in it, which then
    failed with ``FileNotFoundError`` (seen once in the test suite's tiny sort)."""
    prefix = f"lithops-sort-{uuid.uuid4().hex[:8]}"
    storage = fexec.storage
    storage.put_object(storage.bucket, f"{prefix}/.keep", b"")
    try:
        return _run_storage_sort(name, fexec, config, sample, prefix)
    finally:
        storage.delete_object(storage.bucket, f"{prefix}/.keep")


def _run_storage_sort(name: str, fexec: Any, config: SortConfig, sample: Callable[[str], int],
                      prefix: str) -> Run:
    with PeakSampler(functools.partial(sample, prefix), interval_s=SAMPLE_INTERVAL_S) as sampler:
        started = time.perf_counter()
        maps = fexec.get_result(fexec.map(
            storage_map, [(config, m, prefix) for m in range(config.mappers)],
            exclude_modules=BASELINE_UNSHIPPED))
        reduces = fexec.get_result(fexec.map(
            storage_reduce, [(config, r, prefix) for r in range(config.reducers)],
            exclude_modules=BASELINE_UNSHIPPED))
        job_s = time.perf_counter() - started
    checks = fexec.get_result(fexec.map(
        storage_check, [(r, prefix) for r in range(config.reducers)]))
    problems = _validate(config, [m["map"] for m in maps], checks)
    return Run(name, job_s, [m["io_s"] for m in maps], [r["io_s"] for r in reduces],
               [], sampler.held_bytes, sampler.samples, not problems, problems)


def run_pocketflow_variant(name: str, fexec: Any, config: SortConfig, cluster: Any,
                           sample: Callable[[], int], *, delete_inputs: bool,
                           layout: str = "objects") -> Run:
    """The sort with :func:`~pocketflow_lithops.shuffle.shuffle`."""
    from pocketflow_lithops.shuffle import shuffle

    import pocketflow

    with PeakSampler(sample, interval_s=SAMPLE_INTERVAL_S) as sampler:
        started = time.perf_counter()
        result = shuffle(
            fexec, functools.partial(map_records, config), reduce_records,
            range(config.mappers), reducers=config.reducers, cluster=cluster,
            name="lithops-sort-bench", input_size_bytes=config.input_bytes,
            persist_output=True, delete_inputs=delete_inputs, layout=layout,
        )
        job_s = time.perf_counter() - started
    checks = fexec.get_result(fexec.map(
        check_partition,
        [(result.handle_json, o.bucket, o.key, r) for r, o in enumerate(result.outputs)],
    ))
    with pocketflow.connect(result.handle_json) as pf:
        for output in result.outputs:
            pf.delete(output.bucket, output.key)
    problems = _validate(config, result.map_values, checks)
    return Run(name, job_s, result.map_io_s, result.io_s, result.input_wait_s,
               sampler.held_bytes, sampler.samples, not problems, problems)


@contextmanager
def _executor(storage: str, extra: dict[str, Any] | None = None,
              runtime: str | None = None) -> Iterator[Any]:
    import lithops
    from pocketflow_lithops.executor_data import NO_CLEANER, delete_executor_data

    # The executor's data is deleted here, before the redis-server it may live on stops: a
    # request left to Lithops' cleaner would outlive that server.
    fexec = lithops.FunctionExecutor(config=lithops_config(
        storage=storage, workers=WORKERS, extra={**(extra or {}), **NO_CLEANER},
        runtime=runtime))
    try:
        # Warm up: the first job of an executor pays for starting its machinery.
        fexec.get_result(fexec.map(_noop, [0]))
        yield fexec
    finally:
        delete_executor_data(fexec)


def _noop(x: int) -> int:
    return x


def _pocketflow_used(cluster: Any) -> Callable[[], int]:
    from pocketflow.control.admin import AdminTokens

    tokens = AdminTokens(cluster.secret, tls_ca=cluster.tls_ca)
    addresses = [s.address for s in cluster.servers]

    def sample() -> int:
        return sum(int(tokens.client(a).stats()["used_bytes"]) for a in addresses)

    return sample


def run(shape: str, repeats: int, out_dir: Path, *, records: int | None = None,
        variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """Run every variant ``repeats`` times; write JSON and Markdown; return the results."""
    import redis
    from lithops.constants import LITHOPS_TEMP_DIR
    from pocketflow_lithops.runtime import runtime_path

    import pocketflow

    params = SHAPES[shape]
    config = SortConfig(mappers=params["mappers"], reducers=params["reducers"],
                        records=records or params["records"], seed=42, processes=WORKERS)
    started_iso, started = now_iso(), time.perf_counter()
    runs: list[Run] = []
    redis_peer = RedisPeer()
    redis_peer.start()
    try:
        port = redis_peer.spec().port
        redis_client = redis.Redis(host="127.0.0.1", port=port)
        redis_used = lambda _prefix: int(redis_client.info("memory")["used_memory"])  # noqa: E731
        local_root = Path(LITHOPS_TEMP_DIR) / "storage"
        local_used = lambda prefix: dir_bytes(local_root / prefix)  # noqa: E731
        with pocketflow.LocalCluster(**CLUSTER_SHAPE) as cluster, \
                _executor("localhost") as local_fexec, \
                _executor("localhost", runtime=runtime_path()) as pocketflow_fexec, \
                _executor("redis", {"redis": {"host": "127.0.0.1", "port": port}}) as redis_fexec:
            pf_used = _pocketflow_used(cluster)
            for repeat in range(repeats):
                order = variants[repeat % len(variants):] + variants[:repeat % len(variants)]
                for variant in order:
                    if variant == "lithops-localhost":
                        done = run_storage_variant(variant, local_fexec, config, local_used)
                    elif variant == "lithops-redis":
                        done = run_storage_variant(variant, redis_fexec, config, redis_used)
                    else:
                        done = run_pocketflow_variant(
                            variant, local_fexec if variant == "pocketflow-plain-runtime"
                            else pocketflow_fexec, config, cluster, pf_used,
                            delete_inputs=variant != "pocketflow-no-delete",
                            layout="append" if variant == "pocketflow-append" else "objects")
                    print(f"  {variant:22s} job {done.job_s:6.2f} s, I/O per task "
                          f"{1000 * done.io_s_per_task:7.1f} ms, peak held "
                          f"{format_bytes(done.peak_held_bytes)}, "
                          f"{'OK' if done.ok else 'FAILED ' + '; '.join(done.problems)}",
                          flush=True)
                    runs.append(done)
    finally:
        redis_peer.stop()
    results = {
        "benchmark": "lithops-sort",
        "shape": shape,
        "started": started_iso,
        "duration_s": round(time.perf_counter() - started, 1),
        "commit": git_commit(),
        "machine": machine(),
        "versions": {**package_versions(("pocketflow", "lithops", "redis", "pyarrow", "numpy")),
                     "redis-server": redis_peer.version(), "lithops_localhost": "v1"},
        "config": {"records": config.records, "record_bytes": 100, "key_bytes": 10,
                   "mappers": config.mappers, "reducers": config.reducers,
                   "lithops_workers": WORKERS, "repeats": repeats, "seed": config.seed,
                   "cluster": CLUSTER_SHAPE, "sample_interval_s": SAMPLE_INTERVAL_S},
        "summary": summarize(runs),
        "runs": [asdict(r) | {"io_s_per_task": r.io_s_per_task} for r in runs],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"lithops-sort-{today()}" + ("-quick" if shape == "quick" else "") + (
        "" if variants == VARIANTS else "-" + "-".join(variants))
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(results))
    print(f"wrote {out_dir / stem}.json and .md")
    return results


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Median job time, I/O time per task and peak bytes per variant, and the two goals."""
    summary: dict[str, Any] = {}
    for variant in VARIANTS:
        mine = [r for r in runs if r.variant == variant]
        if not mine:
            continue
        summary[variant] = {
            "runs": len(mine),
            "all_ok": all(r.ok for r in mine),
            "job_s": statistics.median(r.job_s for r in mine),
            "job_s_min": min(r.job_s for r in mine),
            "job_s_max": max(r.job_s for r in mine),
            "io_s_per_task": statistics.median(r.io_s_per_task for r in mine),
            "map_io_s_per_task": statistics.median(
                sum(r.map_io_s) / len(r.map_io_s) for r in mine),
            "reduce_io_s_per_task": statistics.median(
                sum(r.reduce_io_s) / len(r.reduce_io_s) for r in mine),
            "reduce_wait_s_per_task": statistics.median(
                sum(r.reduce_wait_s) / len(r.reduce_wait_s) if r.reduce_wait_s else 0.0
                for r in mine),
            "peak_held_bytes": statistics.median(r.peak_held_bytes for r in mine),
        }
    if {"pocketflow", "lithops-localhost", "lithops-redis"} <= summary.keys():
        fastest = min(("pocketflow", "lithops-localhost", "lithops-redis"),
                      key=lambda v: summary[v]["job_s"])
        summary["fastest"] = fastest
    if {"pocketflow", "lithops-localhost"} <= summary.keys():
        # Repeat k ran the k-th job of every variant, next to each other in time: the ratio of
        # each repeat's two jobs is less exposed to the machine's drift over the whole run.
        local = [r.job_s for r in runs if r.variant == "lithops-localhost"]
        ours = [r.job_s for r in runs if r.variant == "pocketflow"]
        paired = [a / b for a, b in zip(local, ours, strict=False)]
        summary["speedup_vs_localhost"] = (
            summary["lithops-localhost"]["job_s"] / summary["pocketflow"]["job_s"])
        summary["speedup_vs_localhost_paired"] = [
            statistics.median(paired), min(paired), max(paired)]
    if {"pocketflow", "pocketflow-no-delete"} <= summary.keys():
        without = summary["pocketflow-no-delete"]["peak_held_bytes"]
        summary["delete_peak_ratio"] = (
            summary["pocketflow"]["peak_held_bytes"] / without if without else None
        )
    return summary


def markdown(results: dict[str, Any]) -> str:
    """The results as a Markdown report with one table."""
    cfg, summary, m = results["config"], results["summary"], results["machine"]
    commit = results["commit"]
    lines = [
        f"# Lithops sort: shuffle through Lithops storage vs pocketflow ({results['shape']})",
        "",
        f"- commit `{(commit['commit'] or '?')[:12]}`"
        f"{' with uncommitted changes' if commit['dirty'] else ''}, {results['started']}, "
        f"{results['duration_s']} s",
        f"- {m['cpu_model']}, {m['cores']} cores, load average {m['load_avg_1m_at_start']:.2f} "
        "at start (other work on the machine counts)",
        f"- {cfg['records']:,} records of 100 bytes ({format_bytes(cfg['records'] * 100)}), "
        f"{cfg['mappers']} mappers x {cfg['reducers']} reducers, Lithops localhost executor v1 "
        f"with {cfg['lithops_workers']} worker processes, median of {cfg['repeats']} run(s)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()),
        "",
        "| variant | job s | job s min-max | I/O per task ms | map write ms | reduce read+write ms "
        "| reducer parked ms | peak held | output valid |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        s = summary.get(variant)
        if s is None:
            continue
        lines.append(
            f"| {variant} | {s['job_s']:.2f} | {s['job_s_min']:.2f}-{s['job_s_max']:.2f} | "
            f"{1000 * s['io_s_per_task']:.1f} | "
            f"{1000 * s['map_io_s_per_task']:.1f} | {1000 * s['reduce_io_s_per_task']:.1f} | "
            f"{1000 * s['reduce_wait_s_per_task']:.1f} | "
            f"{format_bytes(int(s['peak_held_bytes']))} | {'yes' if s['all_ok'] else 'NO'} |"
        )
    lines += ["", "Goals:"]
    if "fastest" in summary:
        met = "met" if summary["fastest"] == "pocketflow" else "NOT met"
        others = [v for v in ("lithops-localhost", "lithops-redis") if v != summary["fastest"]]
        overlap = any(summary[v]["job_s_min"] <= summary[summary["fastest"]]["job_s_max"]
                      for v in others + ["pocketflow"] if v != summary["fastest"])
        lines.append(f"- fastest job of the three (median): **{summary['fastest']}** "
                     f"(goal: pocketflow) - {met}"
                     + ("; the min-max ranges overlap, so on this machine the difference is "
                        "within run-to-run noise" if overlap else ""))
    speedup = summary.get("speedup_vs_localhost")
    if speedup is not None:
        median, low, high = summary["speedup_vs_localhost_paired"]
        lines.append(
            f"- pocketflow's speedup over lithops-localhost: **{speedup:.2f}x** (median job times; "
            f"per repeat {median:.2f}x median, {low:.2f}-{high:.2f}x)"
            f" (goal: >= {SPEEDUP_GOAL:.1f}x) - {'met' if speedup >= SPEEDUP_GOAL else 'NOT met'}")
    ratio = summary.get("delete_peak_ratio")
    if ratio is not None:
        lines.append(f"- peak bytes held with DELETE / without: **{ratio:.2f}** (goal: <= 0.6) - "
                     f"{'met' if ratio <= 0.6 else 'NOT met'}")
    lines += [
        "",
        "Job time counts from submitting the map tasks until every reducer wrote its output "
        "(Lithops variants: a map job, then a reduce job; pocketflow: one job whose reducers "
        "park on the servers until their inputs are written, plus job registration and "
        "deregistration). I/O per task is the mean over mappers and reducers of the time spent "
        "writing partitions, reading inputs and writing outputs; a pocketflow reducer's time "
        "parked waiting for mappers is in its own column and not in I/O. Peak held is the "
        "store's used bytes above its level before the job (pocketflow: servers' stats, "
        "including allocation overhead; redis: used_memory, including Lithops' own job data; "
        "localhost: file sizes under the job's prefix).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python3 -m benchmarks.lithops_sort``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="20 MB, 4x4, one repeat (default: 100 MB, 8x8, 3 repeats)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per variant")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    parser.add_argument("--records", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated variants to run (default: all)")
    args = parser.parse_args(argv)
    variants = tuple(v for v in args.variants.split(",") if v)
    if not variants or not set(variants) <= set(VARIANTS):
        parser.error(f"--variants takes some of {','.join(VARIANTS)}")
    shape = "quick" if args.quick else "full"
    repeats = args.repeats or SHAPES[shape]["repeats"]
    if repeats < 1:
        parser.error("--repeats must be at least 1")
    records = args.records or SHAPES[shape]["records"]
    if not 1 <= records <= SHAPES["full"]["records"] * 10:
        parser.error("--records out of range")
    forget_inherited_lithops_session()
    results = run(shape, repeats, args.out, records=records, variants=variants)
    ok = all(s["all_ok"] for v, s in results["summary"].items() if v in VARIANTS)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
