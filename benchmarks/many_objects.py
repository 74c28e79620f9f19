"""Many small objects: one shuffle of 256 mappers x 256 reducers (65,536 objects of 16 KiB)
against 16 x 16 over the same bytes (256 objects of 4 MiB), on Ray tasks or Lithops functions.

Run from the repository root::

    python3 -m benchmarks.many_objects [--quick] [--executor ray|lithops] [--repeats N] [--out DIR]

Both shapes run on one embedded local cluster, one after the other, in a rotating order per
repeat, through :func:`pocketflow_lithops.shuffle.shuffle` (DELETE-on-read, reducers parked on
the servers until their inputs are written). Mapper ``m`` writes, for every reducer ``r``, an
object of the shape's size whose bytes are a function of ``(m, r)``; reducer ``r`` checks every
input against it, so a run validates only if each of the ``M x R`` objects arrived whole, once.

Reported (JSON and Markdown in
``benchmarks/results/many-objects-<date>-<executor>[-quick].*``, to be committed):

- **Job time** per shape (median over repeats, with min and max), and the wide shape's over the
  narrow one's (goal: at most ``JOB_TIME_RATIO_GOAL``).
- **Server memory per object**, measured from the servers before any shuffle ran (freed heap
  would be reused and hide growth): in a job of its own, ``65,536`` objects are put, first empty,
  then of the wide shape's size; the growth of the storage server processes' resident memory
  (``VmRSS``) divided by the number of objects the servers report storing (their ``stats``).
  The DRAM arena is preallocated and resident from the start, so objects' bytes do not grow
  it: the growth is the index, the records and the allocator's overhead. Empty objects give
  the metadata per object (goal: at most ``METADATA_BYTES_GOAL``).
- **Controller calls**: the ``Controller``'s own count of the calls it served
  (``calls_served``, per method) before and after each shuffle. Storage nodes' heartbeats and
  this script's own questions are periodic or its own and left out. Of what is left, the
  driver's renewals (``TIME_BASED_CALLS``) come per span of time, so they are reported per
  second of the shuffle; the other calls, per job, are divided by the number of objects (goal:
  zero per object, i.e. the wide shuffle asks the control plane no more per job than the
  narrow one).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray.cloudpickle

from benchmarks.machine import git_commit, machine, now_iso, package_versions, today

# Ray's workers (and Lithops') cannot import ``benchmarks`` from every working directory: the
# task functions below travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

RESULTS_DIR = Path(__file__).resolve().parent / "results"
KiB = 1024
MiB = 1024 * KiB
SHAPES = {
    "full": {"wide": 256, "narrow": 16, "total_bytes": 1024 * MiB, "repeats": 3,
             "metadata_objects": 65_536},
    "quick": {"wide": 64, "narrow": 8, "total_bytes": 16 * MiB, "repeats": 1,
              "metadata_objects": 4096},
}
CLUSTER_SHAPE = {"dram_servers": 2, "nvme_servers": 0, "dram_capacity": "2GiB",
                 "num_cpus": 2, "object_store_memory": "80MiB"}
JOB_TIME_RATIO_GOAL = 2.0
"""The wide shuffle's job time over the narrow one's, at most."""
METADATA_BYTES_GOAL = 256
"""Server memory per stored (empty) object, at most."""
PERIODIC_CALLS = frozenset({"heartbeat", "calls_served", "status"})
"""Controller methods that storage nodes call on a timer, or this script calls to measure."""
TIME_BASED_CALLS = frozenset({"renew_lease", "renew_token", "renew_prefixes"})
"""Calls a job's driver makes per span of time while it runs (a third of its lease, half its
token's life), whatever its objects: a longer shuffle makes more of them, so they are counted
per second, apart from the calls per job that the goal is about."""
PUT_BATCH_OBJECTS = 1024
"""Objects per ``put_many`` while filling the servers for the memory measurement."""
TASKS_MAX = 4
"""Tasks of one shuffle at once (Ray tasks, or Lithops worker processes)."""
CALL_TIMEOUT_S = 60.0
"""Bound on one question to the controller."""
SHUFFLE_TIMEOUT_S = 1800.0
"""Bound on one shuffle's stages."""


# -- the shuffle's tasks (run in Ray's or Lithops' workers) -------------------------------------


def payload(mapper: int, reducer: int, size_bytes: int) -> bytes:
    """The bytes mapper ``mapper`` writes for reducer ``reducer``: a function of both."""
    head = f"{mapper}:{reducer}:".encode()
    fill = bytes([(mapper * 31 + reducer * 7) % 251])
    return (head + fill * size_bytes)[:size_bytes]


def map_fixed(size_bytes: int, reducers: int, mapper: int,
              emit: Callable[[int, Any], None]) -> int:
    """Emit one object of ``size_bytes`` for every reducer."""
    for reducer in range(reducers):
        emit(reducer, payload(mapper, reducer, size_bytes))
    return mapper


def reduce_check(size_bytes: int, reducer: int, inputs: list[bytes]) -> tuple[int, int]:
    """How many inputs are what their mapper wrote for this reducer, and their bytes."""
    good = sum(1 for m, data in enumerate(inputs) if data == payload(m, reducer, size_bytes))
    return good, sum(len(data) for data in inputs)


# -- measuring ----------------------------------------------------------------------------------


def controller_calls() -> dict[str, int]:
    """The running cluster's controller's count of the calls it served, per method."""
    import ray

    from pocketflow.control import CONTROLLER_ACTOR_NAME, NAMESPACE

    controller = ray.get_actor(CONTROLLER_ACTOR_NAME, namespace=NAMESPACE)
    return dict(ray.get(controller.calls_served.remote(), timeout=CALL_TIMEOUT_S))


def shuffle_calls(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Calls served between two counts, per method, less the periodic and measuring ones."""
    return {m: n - before.get(m, 0) for m, n in after.items()
            if m not in PERIODIC_CALLS and n - before.get(m, 0) > 0}


def run_shape(cluster: Any, executor: Any, *, tasks: int, object_bytes: int,
              timeout_s: float | None = SHUFFLE_TIMEOUT_S) -> dict[str, Any]:
    """One ``tasks x tasks`` shuffle of ``object_bytes`` objects; its figures and validation."""
    from pocketflow_lithops.shuffle import shuffle

    calls_before = controller_calls()
    started = time.perf_counter()
    result = shuffle(executor, functools.partial(map_fixed, object_bytes, tasks),
                     functools.partial(reduce_check, object_bytes), range(tasks),
                     reducers=tasks, cluster=cluster, name=f"many-objects-{tasks}",
                     input_size_bytes=tasks * tasks * object_bytes, timeout_s=timeout_s)
    job_s = time.perf_counter() - started
    calls = shuffle_calls(calls_before, controller_calls())
    per_job = {m: n for m, n in calls.items() if m not in TIME_BASED_CALLS}
    renewals = sum(n for m, n in calls.items() if m in TIME_BASED_CALLS)
    objects = tasks * tasks
    good = sum(g for g, _ in result.outputs)
    problems = []
    if good != objects:
        problems.append(f"{objects - good} of {objects} objects arrived wrong or not at all")
    if result.bytes_read != objects * object_bytes:
        problems.append(f"reducers read {result.bytes_read} bytes, not {objects * object_bytes}")
    return {
        "mappers": tasks, "reducers": tasks, "objects": objects, "object_bytes": object_bytes,
        "job_s": job_s, "map_s": result.map_s, "bytes": objects * object_bytes,
        # Where the time goes: each task's own I/O against the job's whole time.
        "map_writes_s_mean": sum(result.map_io_s) / tasks,
        "reduce_reads_s_mean": sum(result.io_s) / tasks,
        "reduce_parked_s_mean": sum(result.input_wait_s) / tasks,
        "regenerated": len(result.regenerated), "retried": len(result.retried),
        "controller_calls": calls, "controller_calls_total": sum(calls.values()),
        "controller_calls_per_job": sum(per_job.values()),
        "controller_calls_per_object": sum(per_job.values()) / objects,
        "controller_renewals": renewals,
        "controller_renewals_per_s": renewals / job_s,
        "ok": not problems, "problems": problems,
    }


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def server_memory_per_object(cluster: Any, *, objects: int, object_bytes: int) -> dict[str, Any]:
    """Put ``objects`` objects of ``object_bytes`` in a job of their own; the storage servers'
    resident memory and object count before and after, and the growth per object stored (the
    DRAM arena is resident from the start: objects' bytes do not count). The job is
    deregistered at the end (its objects freed; the heap keeps what it grew, so measure on
    fresh servers first)."""
    from pocketflow.control.admin import AdminTokens

    tokens = AdminTokens(cluster.secret, tls_ca=cluster.tls_ca)
    servers = list(cluster.servers)

    def stored() -> int:
        return sum(int(tokens.client(s.address).stats()["objects"]) for s in servers)

    def rss() -> int:
        return sum(_rss_bytes(s.server_pid) for s in servers)

    data = b"\xa5" * object_bytes
    with cluster.register_job(f"metadata-{object_bytes}") as job, job.connect() as pf:
        pf.create_bucket("m")
        objects_before, rss_before = stored(), rss()
        for first in range(0, objects, PUT_BATCH_OBJECTS):
            batch = range(first, min(objects, first + PUT_BATCH_OBJECTS))
            pf.put_many("m", [(f"o{i:08d}", data) for i in batch])
        added = stored() - objects_before
        grown = rss() - rss_before
    return {"objects": objects, "objects_stored": added, "object_bytes": object_bytes,
            "rss_growth_bytes": grown,
            "rss_growth_per_object": grown / added if added else float("nan")}


# -- the run ------------------------------------------------------------------------------------


def _executor(name: str) -> tuple[Any, Callable[[], None]]:
    """The shuffle's executor named ``name`` and how to release it."""
    if name == "ray":
        from pocketflow_lithops.shuffle_executors import RayShuffleExecutor

        return RayShuffleExecutor(tasks_max=TASKS_MAX), lambda: None
    import lithops

    from pocketflow.demo import lithops_config

    fexec = lithops.FunctionExecutor(config=lithops_config(storage="localhost",
                                                           workers=TASKS_MAX))
    return fexec, fexec.clean


def run(shape: str, *, executor_name: str, repeats: int, out_dir: Path) -> dict[str, Any]:
    """Both shuffles ``repeats`` times and the memory measurement; JSON and Markdown."""
    import pocketflow

    params = SHAPES[shape]
    wide, narrow, total = params["wide"], params["narrow"], params["total_bytes"]
    sizes = {wide: total // (wide * wide), narrow: total // (narrow * narrow)}
    started_iso, started = now_iso(), time.perf_counter()
    runs: list[dict[str, Any]] = []
    with pocketflow.LocalCluster(**CLUSTER_SHAPE) as cluster:
        memory = [server_memory_per_object(cluster, objects=params["metadata_objects"],
                                           object_bytes=size)
                  for size in (0, sizes[wide])]
        executor, release = _executor(executor_name)
        try:
            # Warm up: the first shuffle pays for starting workers.
            run_shape(cluster, executor, tasks=2, object_bytes=1)
            for repeat in range(repeats):
                order = (wide, narrow) if repeat % 2 == 0 else (narrow, wide)
                for tasks in order:
                    done = run_shape(cluster, executor, tasks=tasks, object_bytes=sizes[tasks])
                    done["repeat"] = repeat
                    runs.append(done)
                    print(f"  {tasks:4d} x {tasks:<4d} {done['objects']:6d} objects of "
                          f"{done['object_bytes']:>8d} B: job {done['job_s']:7.2f} s, "
                          f"controller calls per job {done['controller_calls_per_job']} "
                          f"(+{done['controller_renewals']} renewals), "
                          f"{'OK' if done['ok'] else 'FAILED ' + '; '.join(done['problems'])}",
                          flush=True)
        finally:
            release()
    results = {
        "benchmark": "many-objects",
        "shape": shape,
        "executor": executor_name,
        "started": started_iso,
        "duration_s": round(time.perf_counter() - started, 1),
        "commit": git_commit(),
        "machine": machine(),
        "versions": package_versions(("pocketflow", "ray", "lithops")),
        "config": {"wide": wide, "narrow": narrow, "total_bytes": total, "repeats": repeats,
                   "tasks_max": TASKS_MAX, "cluster": CLUSTER_SHAPE},
        "summary": summarize(runs, memory, wide=wide, narrow=narrow),
        "memory": memory,
        "runs": runs,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"many-objects-{today()}-{executor_name}" + ("-quick" if shape == "quick" else "")
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(results))
    print(f"wrote {out_dir / stem}.json and .md")
    return results


def summarize(runs: list[dict[str, Any]], memory: list[dict[str, Any]], *, wide: int,
              narrow: int) -> dict[str, Any]:
    """Median job times per shape, their ratio (paired per repeat too), and the goals."""
    summary: dict[str, Any] = {}
    for tasks in (wide, narrow):
        mine = [r for r in runs if r["mappers"] == tasks]
        summary[str(tasks)] = {
            "objects": mine[0]["objects"], "object_bytes": mine[0]["object_bytes"],
            "job_s": statistics.median(r["job_s"] for r in mine),
            "job_s_min": min(r["job_s"] for r in mine),
            "job_s_max": max(r["job_s"] for r in mine),
            "map_writes_s_mean": statistics.median(r["map_writes_s_mean"] for r in mine),
            "reduce_reads_s_mean": statistics.median(r["reduce_reads_s_mean"] for r in mine),
            "reduce_parked_s_mean": statistics.median(r["reduce_parked_s_mean"] for r in mine),
            "controller_calls_per_object": max(r["controller_calls_per_object"] for r in mine),
            "controller_calls_per_job_max": max(r["controller_calls_per_job"] for r in mine),
            "controller_renewals_per_s_max": max(r["controller_renewals_per_s"] for r in mine),
            "all_ok": all(r["ok"] for r in mine),
        }
    ratio = summary[str(wide)]["job_s"] / summary[str(narrow)]["job_s"]
    by_repeat = {(r["repeat"], r["mappers"]): r["job_s"] for r in runs}
    paired = [by_repeat[(k, wide)] / by_repeat[(k, narrow)]
              for k in sorted({r["repeat"] for r in runs})]
    empty = next(m for m in memory if m["object_bytes"] == 0)
    summary["job_time_ratio"] = ratio
    summary["job_time_ratio_paired"] = [statistics.median(paired), min(paired), max(paired)]
    summary["job_time_ratio_met"] = ratio <= JOB_TIME_RATIO_GOAL
    summary["metadata_bytes_per_object"] = empty["rss_growth_per_object"]
    summary["metadata_met"] = empty["rss_growth_per_object"] <= METADATA_BYTES_GOAL
    # A fixed number of calls per job, whatever the objects: the wide shuffle asks no more of
    # the control plane than the narrow one (renewals, per second, are not per object).
    summary["controller_calls_grow_with_objects"] = (
        summary[str(wide)]["controller_calls_per_job_max"]
        > summary[str(narrow)]["controller_calls_per_job_max"])
    return summary


def markdown(results: dict[str, Any]) -> str:
    """The results as a Markdown report."""
    cfg, summary, m = results["config"], results["summary"], results["machine"]
    wide, narrow = cfg["wide"], cfg["narrow"]
    lines = [
        f"# Many small objects: {wide} x {wide} against {narrow} x {narrow} "
        f"({results['executor']}, {results['shape']})",
        "",
        f"- commit `{(results['commit']['commit'] or '?')[:12]}`, {results['started']}, "
        f"{results['duration_s']} s; {m['cpu_model']}, {m['cores']} cores, load average "
        f"{m['load_avg_1m_at_start']:.2f} at start",
        f"- {cfg['total_bytes'] / MiB:.0f} MiB per shuffle, {cfg['tasks_max']} tasks at once, "
        f"median of {cfg['repeats']} run(s)",
        "",
        "| shape | objects | object bytes | job s | min-max | writes/mapper s | reads/reducer s "
        "| parked/reducer s | controller calls per job (max) | per object | renewals per s "
        "| valid |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tasks in (wide, narrow):
        s = summary[str(tasks)]
        lines.append(
            f"| {tasks} x {tasks} | {s['objects']:,} | {s['object_bytes']:,} | {s['job_s']:.2f} "
            f"| {s['job_s_min']:.2f}-{s['job_s_max']:.2f} | {s['map_writes_s_mean']:.4f} | "
            f"{s['reduce_reads_s_mean']:.4f} | {s['reduce_parked_s_mean']:.4f} | "
            f"{s['controller_calls_per_job_max']} | "
            f"{s['controller_calls_per_object']:.5f} | {s['controller_renewals_per_s_max']:.2f} "
            f"| {'yes' if s['all_ok'] else 'NO'} |")
    median, low, high = summary["job_time_ratio_paired"]
    lines += [
        "",
        "| objects put | object bytes | objects stored | server RSS growth | per object |",
        "|---|---|---|---|---|",
    ]
    for mem in results["memory"]:
        lines.append(f"| {mem['objects']:,} | {mem['object_bytes']:,} | "
                     f"{mem['objects_stored']:,} | {mem['rss_growth_bytes']:,} | "
                     f"{mem['rss_growth_per_object']:.0f} |")
    lines += [
        "",
        "Goals:",
        f"- job time {wide}x{wide} / {narrow}x{narrow}: **{summary['job_time_ratio']:.2f}x** "
        f"(per repeat {median:.2f}x, {low:.2f}-{high:.2f}x; goal <= {JOB_TIME_RATIO_GOAL}x) - "
        f"{'met' if summary['job_time_ratio_met'] else 'NOT met'}",
        f"- server memory per empty object: **{summary['metadata_bytes_per_object']:.0f} B** "
        f"(goal <= {METADATA_BYTES_GOAL} B) - "
        f"{'met' if summary['metadata_met'] else 'NOT met'}",
        f"- controller calls per job grow with objects ({wide}x{wide}: "
        f"{summary[str(wide)]['controller_calls_per_job_max']}, {narrow}x{narrow}: "
        f"{summary[str(narrow)]['controller_calls_per_job_max']}, renewals per second left "
        f"out): **{'yes' if summary['controller_calls_grow_with_objects'] else 'no'}** "
        "(goal: no)",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python3 -m benchmarks.many_objects``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="16 MiB, 64x64 against 8x8, one repeat (default: 1 GiB, 256x256 "
                        "against 16x16, 3 repeats)")
    parser.add_argument("--executor", choices=("ray", "lithops"), default="ray")
    parser.add_argument("--repeats", type=int, default=None, help="runs per shape")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    shape = "quick" if args.quick else "full"
    repeats = args.repeats or SHAPES[shape]["repeats"]
    if repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.executor == "lithops":
        from pocketflow.demo import forget_inherited_lithops_session

        forget_inherited_lithops_session()
    results = run(shape, executor_name=args.executor, repeats=repeats, out_dir=args.out)
    s = results["summary"]
    return 0 if s[str(SHAPES[shape]["wide"])]["all_ok"] and s[
        str(SHAPES[shape]["narrow"])]["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
