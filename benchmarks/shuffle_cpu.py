"""CPU per object of a shuffle: the many-objects shuffle's mappers and reducers run one after
the other in this process, against a local cluster, and the CPU time they and the storage
servers spend is divided by the number of objects. A measure that the machine's load hardly
moves (unlike job time), for comparing two builds on a busy machine.

Run from the repository root::

    python3 -m benchmarks.shuffle_cpu [--wide 256] [--narrow 16] [--total-mib 1024] [--rounds 3]

For each shape (``wide`` x ``wide`` and ``narrow`` x ``narrow`` over the same bytes, the objects
of :mod:`benchmarks.many_objects`), each round:

- **tasks**: CPU time of this process (every thread: the interpreter and the native client
  core) while the shuffle's task functions (:mod:`pocketflow_lithops.shuffle_tasks`) run every
  mapper, then every reducer (DELETE reads; no waiting, since every input is written first);
- **user**: of that, what the benchmark's own map and reduce functions cost, measured alone
  on the same objects without pocketflow; **pocketflow** is tasks less user;
- **servers**: CPU time of the storage server processes (``/proc/<pid>/stat``);
- **requests**: requests the storage servers served (their metrics'
  ``pocketflow_requests_total``, every op of every RPC), a count no load moves.

Printed per round, and as the median over rounds (after one discarded warm-up round) per
shape, with the wide shape's CPU per object over the narrow one's. No Ray tasks, no executor:
what Ray or Lithops cost per task is not in it.
"""

from __future__ import annotations

import argparse
import functools
import resource
import statistics
import sys
import time
from typing import Any

from benchmarks.machine import process_cpu_s
from benchmarks.many_objects import CLUSTER_SHAPE, MiB, map_fixed, reduce_check

INPUT_WAIT_S = 60.0
"""Bound on a reducer's wait for its inputs (every input is written before reducers run)."""
ROUNDS_DEFAULT = 3
"""Measured rounds per shape (after one discarded warm-up round)."""
METRICS_TIMEOUT_S = 10.0
"""Bound on one read of a server's metrics."""


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _requests_served(cluster: Any) -> int:
    """Requests every storage server of ``cluster`` served since it started (its metrics)."""
    import urllib.request

    total = 0
    for server in cluster.servers:
        with urllib.request.urlopen(server.metrics_url, timeout=METRICS_TIMEOUT_S) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("pocketflow_requests_total{"):
                    total += int(float(line.rsplit(" ", 1)[1]))
    return total


def _keep(kept: list[bytes], _reducer: int, data: bytes) -> None:
    kept.append(data)


def user_cpu_s(tasks: int, object_bytes: int) -> float:
    """CPU time of the benchmark's own map and reduce functions on one shape's objects, alone."""
    started = _process_cpu_s()
    first_inputs: list[bytes] = []
    for mapper in range(tasks):
        emitted: list[bytes] = []
        map_fixed(object_bytes, tasks, mapper, functools.partial(_keep, emitted))
        first_inputs.append(emitted[0])
    for _ in range(tasks):
        # The inputs of reducer 0 stand for every reducer's: the same sizes and comparisons.
        reduce_check(object_bytes, 0, first_inputs)
    return _process_cpu_s() - started


def run_round(cluster: Any, *, tasks: int, object_bytes: int, name: str) -> dict[str, Any]:
    """One ``tasks x tasks`` shuffle through the task functions in this process: its CPU."""
    from pocketflow_lithops import shuffle_tasks as st

    servers = [s.server_pid for s in cluster.servers]
    with cluster.register_job(name) as job, job.connect() as pf:
        pf.create_bucket(st.SHUFFLE_BUCKET)
        spec = st._Spec(handle_json=pf.handle.to_json(), mappers=tasks, reducers=tasks,
                        bucket=st.SHUFFLE_BUCKET, output_bucket=st.OUTPUT_BUCKET,
                        persist_output=False, input_wait_s=INPUT_WAIT_S, client_options=())
        map_function = functools.partial(map_fixed, object_bytes, tasks)
        reduce_function = functools.partial(reduce_check, object_bytes)
        requests_before = _requests_served(cluster)
        servers_before = sum(process_cpu_s(pid) for pid in servers)
        started, wall_started = _process_cpu_s(), time.perf_counter()
        for mapper in range(tasks):
            st._map_task(st._MapCall(spec, map_function, mapper, mapper, None))
        good = 0
        for reducer in range(tasks):
            outcome = st._reduce_task(st._ReduceCall(spec, reduce_function, reducer))
            good += outcome.value[0] if outcome.value is not None else 0
        tasks_cpu_s = _process_cpu_s() - started
        wall_s = time.perf_counter() - wall_started
        servers_cpu_s = sum(process_cpu_s(pid) for pid in servers) - servers_before
        requests = _requests_served(cluster) - requests_before
    return {"objects": tasks * tasks, "valid": good == tasks * tasks, "wall_s": wall_s,
            "tasks_cpu_s": tasks_cpu_s, "servers_cpu_s": servers_cpu_s, "requests": requests}


def measure(cluster: Any, *, wide: int, narrow: int, total_bytes: int,
            rounds: int) -> dict[str, Any]:
    """Both shapes, a warm-up round and ``rounds`` measured rounds each, interleaved."""
    shapes = {tasks: total_bytes // (tasks * tasks) for tasks in (wide, narrow)}
    user = {tasks: user_cpu_s(tasks, size) for tasks, size in shapes.items()}
    runs: dict[int, list[dict[str, Any]]] = {tasks: [] for tasks in shapes}
    for round_index in range(rounds + 1):
        for tasks, size in shapes.items():
            done = run_round(cluster, tasks=tasks, object_bytes=size,
                             name=f"shuffle-cpu-{tasks}-{round_index}")
            if round_index == 0:
                continue  # warm-up: connections, the first allocations
            done["pocketflow_cpu_s"] = done["tasks_cpu_s"] - user[tasks]
            runs[tasks].append(done)
    summary: dict[str, Any] = {}
    for tasks, mine in runs.items():
        objects = tasks * tasks
        median = {field: statistics.median(r[field] for r in mine)
                  for field in ("tasks_cpu_s", "pocketflow_cpu_s", "servers_cpu_s", "wall_s",
                                "requests")}
        summary[str(tasks)] = {
            "objects": objects, "object_bytes": shapes[tasks], "user_cpu_s": user[tasks],
            **median,
            # Contention on a loaded machine only adds CPU time: the least round is the
            # steadier figure for comparing builds there.
            "tasks_cpu_s_min": min(r["tasks_cpu_s"] for r in mine),
            "servers_cpu_s_min": min(r["servers_cpu_s"] for r in mine),
            "pocketflow_us_per_object": median["pocketflow_cpu_s"] / objects * 1e6,
            "servers_us_per_object": median["servers_cpu_s"] / objects * 1e6,
            "requests_per_object": median["requests"] / objects,
            "valid": all(r["valid"] for r in mine),
        }
    total = {tasks: summary[str(tasks)]["tasks_cpu_s"] + summary[str(tasks)]["servers_cpu_s"]
             for tasks in shapes}
    summary["cpu_ratio"] = total[wide] / total[narrow]
    return {"summary": summary, "runs": {str(t): r for t, r in runs.items()}}


def report(result: dict[str, Any], *, wide: int, narrow: int) -> str:
    """The summary as lines of text."""
    lines = []
    for tasks in (wide, narrow):
        s = result["summary"][str(tasks)]
        lines.append(
            f"{tasks:4d} x {tasks:<4d} {s['objects']:6d} objects of {s['object_bytes']:>8d} B: "
            f"tasks {s['tasks_cpu_s']:.2f} s CPU (user {s['user_cpu_s']:.2f}, pocketflow "
            f"{s['pocketflow_cpu_s']:.2f} = {s['pocketflow_us_per_object']:.1f} us/object), "
            f"servers {s['servers_cpu_s']:.2f} s ({s['servers_us_per_object']:.1f} us/object, "
            f"{s['requests_per_object']:.2f} requests/object), "
            f"wall {s['wall_s']:.2f} s, {'valid' if s['valid'] else 'INVALID'}; least round: "
            f"tasks {s['tasks_cpu_s_min']:.2f} s, servers {s['servers_cpu_s_min']:.2f} s")
    lines.append(f"CPU, wide over narrow: {result['summary']['cpu_ratio']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python3 -m benchmarks.shuffle_cpu``."""
    import pocketflow

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wide", type=int, default=256, help="mappers and reducers, wide")
    parser.add_argument("--narrow", type=int, default=16, help="mappers and reducers, narrow")
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes per shuffle, MiB")
    parser.add_argument("--rounds", type=int, default=ROUNDS_DEFAULT, help="measured rounds")
    args = parser.parse_args(argv)
    if args.rounds < 1 or min(args.wide, args.narrow) < 1:
        parser.error("--rounds, --wide and --narrow must be at least 1")
    with pocketflow.LocalCluster(**CLUSTER_SHAPE) as cluster:
        result = measure(cluster, wide=args.wide, narrow=args.narrow,
                         total_bytes=args.total_mib * MiB, rounds=args.rounds)
    print(report(result, wide=args.wide, narrow=args.narrow))
    summary = result["summary"]
    return 0 if summary[str(args.wide)]["valid"] and summary[str(args.narrow)]["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
