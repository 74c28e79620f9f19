"""Side by side: building Lua 5.4 (the lupa 2.8 sdist's developer makefile) with a local
``make -jN``, as gg thunks on Ray tasks with pocketflow as the storage (with and without
DELETE-on-read), and as the same thunks with a redis-server as the storage.

Run from the repository root::

    python3 -m benchmarks.gg_build [--quick] [--repeats N] [--jobs N] [--engine ray|lithops]

Every variant builds the same sources from a fresh copy, one after the other in this one run, in
a rotating order per repeat, after one warm-up build of ``make`` and of ``gg-pocketflow`` (the
first build on a fresh cluster waits for Ray's worker processes to start; reported apart), on
the same cores (the embedded local cluster pins Ray to ``--jobs`` CPUs; ``make`` runs
``-j --jobs``):

- ``make``: ``make -B -jN lua`` in the source directory, at niceness 19 like the thunks'
  compilers (a shared machine's other load then slows both alike).
- ``gg-pocketflow``: :func:`pocketflow_gg.infer` (``make -n``, each compile carrying its source
  and project headers), a job
  registered with the graph's hints, :func:`pocketflow_gg.force` on the engine's workers with
  DELETE for inputs read once and PERSIST for the target, and the target fetched to disk.
- ``gg-pocketflow-no-delete``: the same without DELETE, for the peak capacity DELETE saves.
- ``gg-pocketflow-scoped``: ``gg-pocketflow`` with the build's intermediate objects scoped to
  prefix leases (``force(..., scope=job)``, 1 s leases), for what scoping costs.
- ``gg-redis``: the same thunks and workers with a redis-server (started here on 127.0.0.1, no
  persistence) as the store: ``SET NX`` for puts, ``GETDEL`` for DELETE.

Reported per variant (median over repeats): job time (for gg, from inference to the target on
disk), storage I/O time per thunk (mean and p95 over every thunk of every repeat: the time a
worker spent in get/put/exists calls; "data" without fetching executables, "all" with them),
bytes
moved (uploaded by the driver plus read and written by workers), and peak capacity: the
driver's account of live bytes (values and thunks uploaded, plus outputs written, minus objects
freed by DELETE) and, sampled every ``SAMPLE_INTERVAL_S``, the store's own figure above its level
before the run (pocketflow: the servers' ``used_bytes``, refreshed by their 1 s statistics;
redis: ``used_memory``). Every gg build's ``lua`` must print 42 and be byte-identical to the
local make's. Results go to ``benchmarks/results/gg-build-<date>[-quick].json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.machine import git_commit, machine, now_iso, package_versions, today
from benchmarks.peers import RedisPeer

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SAMPLE_INTERVAL_S = 0.25
"""How often the store's used bytes are sampled. pocketflow's servers refresh the figure once a
second, so sampling faster finds no higher peak; each sample is a controller call, and at every
50 ms they took about 0.05 CPU-seconds per second from the build being measured."""
VARIANTS = ("make", "gg-pocketflow", "gg-pocketflow-scoped", "gg-pocketflow-no-delete",
            "gg-redis")
WARMUP_VARIANTS = ("make", "gg-pocketflow")
CLUSTER_SHAPE = dict(dram_servers=2, nvme_servers=1, dram_capacity="256MiB",
                     nvme_capacity="256MiB", object_store_memory="80MiB")


@dataclass
class Run:
    """One build of one variant."""

    variant: str
    repeat: int
    job_s: float
    force_s: float | None = None
    infer_s: float | None = None
    thunks_run: int | None = None
    io_s_per_thunk: list[float] = field(default_factory=list)
    data_io_s_per_thunk: list[float] = field(default_factory=list)
    executable_bytes: int | None = None
    run_s_per_thunk: list[float] = field(default_factory=list)
    bytes_moved: int | None = None
    uploaded_bytes: int | None = None
    deleted_bytes: int | None = None
    peak_live_bytes: int | None = None
    peak_sampled_bytes: int | None = None
    binary_name: str | None = None
    load_avg_1m: float | None = None
    driver_cpu_s: float | None = None
    """CPU time of the driver process (all its threads) during the force and the fetch."""
    prefix_calls: int | None = None


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]


def _as_thunks_run() -> None:
    # make's compilers get the CPU priority the thunks' compilers get (FUNCTION_NICENESS).
    from pocketflow_gg.worker import FUNCTION_NICENESS

    os.setpriority(os.PRIO_PROCESS, 0, FUNCTION_NICENESS)


def run_make(src: Path, jobs: int, repeat: int) -> tuple[Run, Path]:
    subprocess.run(["make", "-s", "clean"], cwd=src, check=True, capture_output=True)
    started = time.perf_counter()
    subprocess.run(["make", "-s", "-B", f"-j{jobs}", "lua"], cwd=src, check=True,
                   capture_output=True, timeout=900, preexec_fn=_as_thunks_run)
    elapsed = time.perf_counter() - started
    from pocketflow_gg.objects import file_name

    return Run("make", repeat, elapsed, binary_name=file_name(src / "lua")), src / "lua"


def run_gg(variant: str, src: Path, jobs: int, repeat: int, *, cluster: Any, engine_kind: str,
           redis_port: int | None, sampler_fn: Any, out_dir: Path) -> Run:
    from pocketflow_gg.engines import make_engine
    from pocketflow_gg.force import fetch_outputs, force, hints_for
    from pocketflow_gg.infer import infer
    from pocketflow_gg.objects import file_name, size_of
    from pocketflow_gg.store import PocketflowStore, RedisStore

    import pocketflow
    from pocketflow.demo import PeakSampler

    started = time.perf_counter()
    graph, target = infer(src, "lua")
    infer_s = time.perf_counter() - started
    delete = variant != "gg-pocketflow-no-delete"
    job = None
    if variant.startswith("gg-pocketflow"):
        job = pocketflow.register_job(f"gg-bench-{repeat}", hints_for(graph, target),
                                      cluster=cluster)
        store: Any = PocketflowStore(job.handle.to_json())
        store.create_buckets()
    else:
        store = RedisStore(f"redis://127.0.0.1:{redis_port}/0?prefix=gg-{uuid.uuid4().hex[:8]}")
    engine = make_engine(engine_kind, store.spec, workers=jobs)
    try:
        with PeakSampler(sampler_fn, interval_s=SAMPLE_INTERVAL_S) as sampler:
            cpu_started = time.process_time()
            result = force(graph, target, store=store, engine=engine, jobs=jobs, delete=delete,
                           scope=job if variant == "gg-pocketflow-scoped" else None)
            (built,) = fetch_outputs(store, graph.thunks[target], result.outputs, out_dir)
            driver_cpu_s = time.process_time() - cpu_started
        job_s = time.perf_counter() - started
    finally:
        engine.close()
        store.close()
        if job is not None:
            job.deregister()
    check = subprocess.run([str(built), "-e", "print(6*7)"], capture_output=True, text=True,
                           timeout=30, check=True).stdout
    if check != "42\n":
        raise RuntimeError(f"{variant}: lua printed {check!r}")
    return Run(
        variant, repeat, job_s, force_s=result.job_s, infer_s=infer_s,
        thunks_run=len(result.ran),
        io_s_per_thunk=[r["io_s"] for r in result.reports],
        data_io_s_per_thunk=[r["data_io_s"] for r in result.reports],
        executable_bytes=sum(size_of(n) for n in graph.executables),
        run_s_per_thunk=[r["run_s"] for r in result.reports],
        bytes_moved=result.bytes_moved, uploaded_bytes=result.uploaded_bytes,
        deleted_bytes=result.deleted_bytes, peak_live_bytes=result.peak_live_bytes,
        peak_sampled_bytes=sampler.held_bytes, binary_name=file_name(built),
        driver_cpu_s=driver_cpu_s, prefix_calls=result.prefix_calls,
    )


def summarize(runs: list[Run]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        mine = [r for r in runs if r.variant == variant]
        if not mine:
            continue
        row: dict[str, Any] = {"repeats": len(mine),
                               "job_s": statistics.median(r.job_s for r in mine)}
        if variant != "make":
            io = [x for r in mine for x in r.io_s_per_thunk]
            data_io = [x for r in mine for x in r.data_io_s_per_thunk]
            row.update({
                "data_io_ms_per_thunk_mean": 1000 * statistics.fmean(data_io),
                "data_io_ms_per_thunk_p95": 1000 * _p95(data_io),
                "peak_live_data_bytes": statistics.median(
                    r.peak_live_bytes - r.executable_bytes for r in mine),
                "force_s": statistics.median(r.force_s for r in mine),
                "infer_s": statistics.median(r.infer_s for r in mine),
                "thunks": mine[0].thunks_run,
                "io_ms_per_thunk_mean": 1000 * statistics.fmean(io),
                "io_ms_per_thunk_p95": 1000 * _p95(io),
                "run_ms_per_thunk_mean": 1000 * statistics.fmean(
                    x for r in mine for x in r.run_s_per_thunk),
                "bytes_moved": statistics.median(r.bytes_moved for r in mine),
                "deleted_bytes": statistics.median(r.deleted_bytes for r in mine),
                "peak_live_bytes": statistics.median(r.peak_live_bytes for r in mine),
                "peak_sampled_bytes": statistics.median(r.peak_sampled_bytes for r in mine),
                "driver_cpu_s": statistics.median(r.driver_cpu_s for r in mine),
                "prefix_calls": statistics.median(r.prefix_calls for r in mine),
            })
        row["binaries"] = sorted({r.binary_name for r in mine})
        row["load_avg_1m"] = statistics.median(r.load_avg_1m for r in mine)
        out[variant] = row
    return out


def markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    mib = 1024 * 1024
    lines = [
        f"# gg build of Lua 5.4: make -j{report['jobs']} vs thunks on pocketflow vs redis",
        "",
        f"{report['started']}, commit {report['commit'].get('commit', '?')[:10]}, "
        f"{report['machine'].get('cpu_model')}, {report['jobs']} jobs, engine "
        f"{report['engine']}, {report['repeats']} repeat(s). "
        f"Command: `{report['command']}`.",
        "",
        "| variant | job s | force s | data I/O per thunk mean ms | p95 ms | all I/O per thunk "
        "mean ms | p95 ms | bytes moved MiB | freed by DELETE MiB | peak live MiB (without "
        "executables) | peak sampled MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, row in s.items():
        if variant == "make":
            lines.append(f"| make | {row['job_s']:.1f} | | | | | | | | | |")
            continue
        lines.append(
            f"| {variant} | {row['job_s']:.1f} | {row['force_s']:.1f} | "
            f"{row['data_io_ms_per_thunk_mean']:.2f} | {row['data_io_ms_per_thunk_p95']:.2f} | "
            f"{row['io_ms_per_thunk_mean']:.1f} | {row['io_ms_per_thunk_p95']:.1f} | "
            f"{row['bytes_moved'] / mib:.1f} | {row['deleted_bytes'] / mib:.1f} | "
            f"{row['peak_live_bytes'] / mib:.1f} ({row['peak_live_data_bytes'] / mib:.2f}) | "
            f"{row['peak_sampled_bytes'] / mib:.1f} |")
    ratios = report["ratios"]
    lines += [
        "",
        f"- storage I/O per thunk on its data, pocketflow / redis: mean "
        f"{ratios['data_io_mean']:.2f}x, p95 {ratios['data_io_p95']:.2f}x (goal <= 0.7x); "
        f"with executable fetches: mean {ratios['io_mean']:.2f}x, p95 {ratios['io_p95']:.2f}x",
        f"- job time, gg-pocketflow / make: {ratios['job_vs_make']:.2f}x (goal <= 1.10x)",
        f"- scoped to prefix leases / not (both with DELETE): job time "
        f"{ratios['job_scoped']:.3f}x, driver CPU {ratios['driver_cpu_scoped']:.3f}x "
        f"({s['gg-pocketflow-scoped']['driver_cpu_s']:.2f} / "
        f"{s['gg-pocketflow']['driver_cpu_s']:.2f} s), "
        f"{s['gg-pocketflow-scoped']['prefix_calls']:.0f} prefix declarations, ends and "
        f"renewals (one action per server each, no controller call); peak sampled "
        f"{s['gg-pocketflow-scoped']['peak_sampled_bytes'] / mib:.1f} / "
        f"{s['gg-pocketflow']['peak_sampled_bytes'] / mib:.1f} MiB",
        f"- peak live bytes with DELETE / without: {ratios['peak_delete']:.2f}x "
        f"(without the executables, which every thunk reads: {ratios['peak_data_delete']:.2f}x)",
        "- first builds on the fresh cluster (warm-up, left out of the medians: Ray starts "
        "its worker processes during the first): "
        + ", ".join(f"{v} {t:.1f} s" for v, t in report.get("warmup", {}).items()),
        f"- every gg-built lua printed 42 and was byte-identical to make's: "
        f"{report['identical']}",
        f"- 1-minute load average after each run (median per variant, "
        f"{report['machine'].get('cores_usable', '?')} cores usable): "
        + ", ".join(f"{v} {row['load_avg_1m']:.1f}" for v, row in s.items()),
        "",
        "Job time for gg includes inference (`make -n`, the headers of each source from its "
        "`#include` lines, hashing), registration, uploading values and executables, forcing "
        "and fetching `lua`. "
        "Storage I/O per thunk with executable fetches counts fetching an executable (cc1 is "
        "33 MB) the first time a machine needs it; workers keep executables by content name "
        "in one directory per machine, so after the warm-up builds no thunk fetches one.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--engine", choices=("ray", "lithops"), default="ray")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)

    import redis
    from pocketflow_gg.lua_sources import lua_sources

    import pocketflow

    work = Path(tempfile.mkdtemp(prefix="gg-bench-"))
    started_iso = now_iso()
    runs: list[Run] = []
    warmups: list[Run] = []
    server_niceness = None
    peer = RedisPeer()
    peer.start()
    try:
        src = lua_sources(work)
        port = peer.spec().port
        redis_client = redis.Redis(host="127.0.0.1", port=port)

        def redis_used() -> int:
            return int(redis_client.info("memory")["used_memory"])

        with pocketflow.LocalCluster(num_cpus=args.jobs, **CLUSTER_SHAPE) as cluster:
            # Ray runs its workers, and so the storage servers their actors start, at a
            # niceness of its own; redis-server gets the same, so neither store outranks the
            # other for CPU on a shared machine (thunks' compilers run at 19, below both).
            server_niceness = os.getpriority(os.PRIO_PROCESS, cluster.servers[0].server_pid)
            os.setpriority(os.PRIO_PROCESS, peer.pid, server_niceness)
            def pf_used() -> int:
                return sum(int(s["used_bytes"]) for s in cluster.status()["servers"])

            def build(variant: str, repeat: int) -> Run:
                if variant == "make":
                    run, _ = run_make(src, args.jobs, repeat)
                else:
                    subprocess.run(["make", "-s", "clean"], cwd=src, check=True,
                                   capture_output=True)
                    run = run_gg(variant, src, args.jobs, repeat, cluster=cluster,
                                 engine_kind=args.engine,
                                 redis_port=port if variant == "gg-redis" else None,
                                 sampler_fn=redis_used if variant == "gg-redis" else pf_used,
                                 out_dir=work / f"out-{variant}-{repeat}")
                run.load_avg_1m = os.getloadavg()[0]
                return run

            # The first build on a fresh cluster also waits for Ray to start its worker
            # processes (about a second here), whichever variant comes first: one build of
            # each kind warms up, reported apart and left out of the medians.
            for variant in WARMUP_VARIANTS:
                warmups.append(build(variant, -1))
                print(f"warm-up {variant}: {warmups[-1].job_s:.1f} s", flush=True)
            for repeat in range(repeats):
                order = VARIANTS[repeat % len(VARIANTS):] + VARIANTS[:repeat % len(VARIANTS)]
                for variant in order:
                    runs.append(build(variant, repeat))
                    print(f"repeat {repeat} {variant}: {runs[-1].job_s:.1f} s", flush=True)
    finally:
        peer.stop()
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(runs)
    names = {r.binary_name for r in runs}
    report = {
        "benchmark": "gg-build",
        "started": started_iso,
        "command": "python3 -m benchmarks.gg_build" + (" --quick" if args.quick else "")
                   + (f" --repeats {args.repeats}" if args.repeats else "")
                   + f" --jobs {args.jobs} --engine {args.engine}",
        "commit": git_commit(),
        "machine": machine(),
        "packages": package_versions(("ray", "lithops", "redis", "protobuf")),
        "jobs": args.jobs,
        "engine": args.engine,
        "repeats": repeats,
        "identical": len(names | {r.binary_name for r in warmups}) == 1,
        "warmup": {r.variant: r.job_s for r in warmups},
        "store_niceness": server_niceness,
        "summary": summary,
        "ratios": {
            "data_io_mean": summary["gg-pocketflow"]["data_io_ms_per_thunk_mean"]
            / summary["gg-redis"]["data_io_ms_per_thunk_mean"],
            "data_io_p95": summary["gg-pocketflow"]["data_io_ms_per_thunk_p95"]
            / summary["gg-redis"]["data_io_ms_per_thunk_p95"],
            "peak_data_delete": summary["gg-pocketflow"]["peak_live_data_bytes"]
            / summary["gg-pocketflow-no-delete"]["peak_live_data_bytes"],
            "io_mean": summary["gg-pocketflow"]["io_ms_per_thunk_mean"]
            / summary["gg-redis"]["io_ms_per_thunk_mean"],
            "io_p95": summary["gg-pocketflow"]["io_ms_per_thunk_p95"]
            / summary["gg-redis"]["io_ms_per_thunk_p95"],
            "job_vs_make": summary["gg-pocketflow"]["job_s"] / summary["make"]["job_s"],
            "peak_delete": summary["gg-pocketflow"]["peak_live_bytes"]
            / summary["gg-pocketflow-no-delete"]["peak_live_bytes"],
            "job_scoped": summary["gg-pocketflow-scoped"]["job_s"]
            / summary["gg-pocketflow"]["job_s"],
            "driver_cpu_scoped": summary["gg-pocketflow-scoped"]["driver_cpu_s"]
            / summary["gg-pocketflow"]["driver_cpu_s"],
        },
        "runs": [asdict(r) for r in runs],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"gg-build-{today()}{'-quick' if args.quick else ''}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
