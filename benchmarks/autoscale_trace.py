"""Pocket's Figure 10 for real: a trace of overlapping jobs replayed on pocketflow running on Ray's
real autoscaler, with the simulator's prediction of the same trace on the same axes.

::

    python -m benchmarks.autoscale_trace                # the trace; JSON + PNG in results/
    python -m benchmarks.autoscale_trace --out /tmp/r   # elsewhere

The cluster (:mod:`benchmarks.autoscaling_ray`): a Ray head with two DRAM storage slots (the two
long-running servers) and two worker node types the autoscaler launches on demand, raylets on
this machine: ``dram`` nodes (one DRAM slot) and ``nvme`` nodes (one NVMe slot).
pocketflow joins it (``LocalCluster(storage_resources=True, autoscale=True)``, sizing every
second), so the controller launches servers for registrations that do not fit, the launcher asks
the autoscaler for their slots, the sizing loop drains idle servers and the autoscaler removes
idle nodes.

The trace (:data:`TRACE`): three jobs with staggered arrivals, each with the hint mix of one of
the project's workloads: a gg-like build (latency-sensitive, many small objects), the demo sort
(latency-insensitive, so NVMe) and a THIS-like video pipeline (latency-sensitive). Each job's
driver (a thread here) registers, writes a part of its data size in 1 MiB objects paced over its
run, reads every object back and checks it, and deregisters.

What it measures, against issue 31's goals:

- demanded capacity (each job's capacity demand from when it asks to register until it
  deregisters), allocated capacity (every live server's, draining ones included) and worker
  nodes, sampled every ``SAMPLE_INTERVAL_S``; GB-seconds of both over the trace and their ratio;
- scale-up: for each server launched on a new node, the time from the demand that asked for it
  to its server up and to a request it served, split into the autoscaler's launch (the slot
  asked for to a node launcher taking the node up, from the monitor's log), the raylet's start
  (to the node alive in the GCS) and the server's start (to the server listed by the control
  plane; of which, for servers a registration launched together, the wait for the batch's
  last node: ``waited_for_batch_s``);
- scale-down: for each launched server, from the last of its jobs deregistering to the server
  retired (its capacity released) and to its node removed;
- nothing lost (every job's objects read back equal), every drained server empty when it was
  retired (by what the controller saw: its stats after the drain, or its exit), and nothing
  left (worker nodes and resource request 30 s after the control plane stops);
- the simulator (:mod:`pocketflow.control.simulator`) driven with the same trace, tier sizes,
  sizing bounds and the measured start-up delays: its allocated GB-seconds against the real run's.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.autoscaling_ray import AutoscalingRay, NodeType
from benchmarks.machine import git_commit, machine, now_iso, today

MIB = 1024 * 1024
RESULTS_DIR = Path(__file__).resolve().parent / "results"

SAMPLE_INTERVAL_S = 0.25
"""How often the sampler reads the cluster (status, Ray nodes, the autoscaler request)."""
OBJECT_BYTES = 1 * MIB
"""Size of each object a job writes."""
WRITE_FRACTION = 0.5
"""Share of its data-size hint a job writes (1 MiB objects, paced over its run)."""
LONG_RUNNING_DRAM_BYTES = 16 * MIB
"""Capacity of each DRAM server (the two long-running ones and every launched one)."""
NVME_BYTES = 64 * MIB
"""Capacity of each NVMe server."""
SIZING_COOLDOWN_S = 5
"""The sizing loop's cool-down (it runs every second)."""
NODE_TYPES_MAX_WORKERS = 4
"""Most worker nodes of each type."""
SETTLE_S = 60.0
"""After the last job, how long to wait for the cluster to return to its two servers."""
NOTHING_LEFT_WAIT_S = 30.0
"""Issue 31's goal: no storage node and no request this long after the control plane stops."""
JOB_TIMEOUT_S = 300.0
"""Bound on one job's driver (registration may wait for nodes)."""


@dataclass(frozen=True)
class TraceJob:
    """A job of the trace: it asks to register ``arrive_s`` after the start and runs ``run_s``."""

    name: str
    hints: dict[str, Any]
    arrive_s: float
    run_s: float
    workload: str


TRACE: tuple[TraceJob, ...] = (
    TraceJob("build", {"latency_sensitive": True, "data_size_bytes": 40 * MIB,
                       "peak_throughput_bytes_per_s": 20_000_000},
             arrive_s=0.0, run_s=45.0, workload="gg build: latency-sensitive, small objects"),
    TraceJob("sort", {"latency_sensitive": False, "data_size_bytes": 96 * MIB,
                      "peak_throughput_bytes_per_s": 20_000_000},
             arrive_s=15.0, run_s=50.0, workload="demo sort: latency-insensitive (NVMe)"),
    TraceJob("pipeline", {"latency_sensitive": True, "data_size_bytes": 24 * MIB,
                          "peak_throughput_bytes_per_s": 40_000_000},
             arrive_s=35.0, run_s=35.0, workload="THIS pipeline: latency-sensitive"),
)
"""Three overlapping jobs with the hint mix of the project's workloads (explicit peak
throughputs: what they drive is what they declare, for the real run and the simulator alike)."""

TINY_TRACE: tuple[TraceJob, ...] = (
    TraceJob("build", {"latency_sensitive": True, "data_size_bytes": 36 * MIB,
                       "peak_throughput_bytes_per_s": 20_000_000},
             arrive_s=0.0, run_s=10.0, workload="gg build: latency-sensitive, small objects"),
    TraceJob("sort", {"latency_sensitive": False, "data_size_bytes": 48 * MIB,
                      "peak_throughput_bytes_per_s": 20_000_000},
             arrive_s=4.0, run_s=10.0, workload="demo sort: latency-insensitive (NVMe)"),
    TraceJob("pipeline", {"latency_sensitive": True, "data_size_bytes": 2 * MIB,
                          "peak_throughput_bytes_per_s": 40_000_000},
             arrive_s=8.0, run_s=6.0, workload="THIS pipeline: latency-sensitive"),
)
"""The same three kinds of job, shorter and smaller: the build needs one DRAM node, the sort one
NVMe node, and together with the pipeline they keep DRAM below the sizing loop's 80% (so it
launches no third node: raylets start slowly on a loaded machine). The suite runs the benchmark
with it (``--tiny``) to check the script end to end, not its figures."""


@dataclass
class JobRun:
    """What one job's driver saw (times in seconds from the trace's start)."""

    name: str
    asked_s: float | None = None
    registered_s: float | None = None
    first_put_s: float | None = None
    deregistered_s: float | None = None
    servers: list[str] = field(default_factory=list)
    objects: int = 0
    verified: bool = False
    error: str | None = None


@dataclass
class Sample:
    """The cluster at one instant (seconds from the trace's start)."""

    t_s: float
    demand_bytes: int
    allocated_bytes: int
    servers: list[str]
    worker_nodes: int
    requested_slots: int


class Trace:
    """Runs the trace on a started cluster and samples it."""

    def __init__(self, cluster: Any, cluster_ray: AutoscalingRay, trace: Sequence[TraceJob]):
        self.cluster = cluster
        self.cluster_ray = cluster_ray
        self.trace = trace
        self.runs = {job.name: JobRun(job.name) for job in trace}
        self.samples: list[Sample] = []
        self.node_seen_s: dict[str, float] = {}
        self.node_gone_s: dict[str, float] = {}
        self.server_seen_s: dict[str, float] = {}
        self.server_gone_s: dict[str, float] = {}
        self.server_last: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._t0 = 0.0

    def now_s(self) -> float:
        return time.monotonic() - self._t0

    def run(self) -> None:
        self._t0 = time.monotonic()
        sampler = threading.Thread(target=self._sample_loop, name="sampler", daemon=True)
        sampler.start()
        drivers = [threading.Thread(target=self._drive, args=(job,), name=job.name, daemon=True)
                   for job in self.trace]
        for driver in drivers:
            driver.start()
        for driver in drivers:
            driver.join(JOB_TIMEOUT_S + max(j.arrive_s + j.run_s for j in self.trace))
        # Settle: the cluster back to its long-running servers.
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and (
            len(self.samples) == 0 or len(self.samples[-1].servers) > 2
            or self.samples[-1].worker_nodes > 0
        ):
            time.sleep(SAMPLE_INTERVAL_S)
        self._stop.set()
        sampler.join(10.0)

    def _drive(self, job: TraceJob) -> None:
        run = self.runs[job.name]
        delay = job.arrive_s - self.now_s()
        if delay > 0:
            time.sleep(delay)
        try:
            run.asked_s = self.now_s()
            handle_job = self.cluster.register_job(job.name, job.hints, lease_ms=None)
            run.registered_s = self.now_s()
            run.servers = sorted(s.node_id for s in handle_job.handle.servers if s.weight > 0)
            objects = max(1, int(job.hints["data_size_bytes"] * WRITE_FRACTION) // OBJECT_BYTES)
            end_s = run.registered_s + job.run_s
            with handle_job.connect(op_timeout_s="30s") as pf:
                pf.create_bucket("data")
                for i in range(objects):
                    pf.put("data", f"o{i:05d}", _payload(job.name, i))
                    if run.first_put_s is None:
                        run.first_put_s = self.now_s()
                    run.objects = i + 1
                    # Paced over the first 80% of the run.
                    pause = run.registered_s + job.run_s * 0.8 * (i + 1) / objects - self.now_s()
                    if pause > 0:
                        time.sleep(pause)
                run.verified = all(
                    bytes(pf.get("data", f"o{i:05d}")) == _payload(job.name, i)
                    for i in range(objects)
                )
            pause = end_s - self.now_s()
            if pause > 0:
                time.sleep(pause)
            handle_job.deregister()
            run.deregistered_s = self.now_s()
        except Exception as exc:  # noqa: BLE001 - reported in the results
            run.error = f"{type(exc).__name__}: {exc}"

    def _sample_loop(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            try:
                self._sample()
            except Exception as exc:  # noqa: BLE001 - a missed sample, not a failed run
                print(f"sample failed: {exc}", file=sys.stderr)

    def _sample(self) -> None:
        status = self.cluster.status()
        t = self.now_s()
        servers = status["servers"]
        names = sorted(s["node_id"] for s in servers)
        for s in servers:
            self.server_seen_s.setdefault(s["node_id"], t)
            self.server_last[s["node_id"]] = {
                "used_bytes": s["used_bytes"], "objects": s["objects"], "tier": s["tier"],
                "ray_node_id": s["ray_node_id"], "capacity_bytes": s["capacity_bytes"],
                "long_running": s["long_running"],
            }
        for gone in set(self.server_seen_s) - set(names) - set(self.server_gone_s):
            self.server_gone_s[gone] = t
        workers = self.cluster_ray.worker_nodes()
        for node in workers:
            self.node_seen_s.setdefault(node, t)
        for gone in set(self.node_seen_s) - set(workers) - set(self.node_gone_s):
            self.node_gone_s[gone] = t
        demand = sum(
            int(job.hints["data_size_bytes"]) for job in self.trace
            if (run := self.runs[job.name]).asked_s is not None and run.deregistered_s is None
        )
        self.samples.append(Sample(
            t_s=t,
            demand_bytes=demand,
            allocated_bytes=sum(int(s["capacity_bytes"]) for s in servers),
            servers=names,
            worker_nodes=len(workers),
            requested_slots=len(self.cluster_ray.resource_request()),
        ))


def _payload(name: str, index: int) -> bytes:
    seed = f"{name}/{index}".encode()
    return (seed * (OBJECT_BYTES // len(seed) + 1))[:OBJECT_BYTES]


# -- analysis -----------------------------------------------------------------------------------


def gb_seconds(samples: Sequence[Sample], attribute: str, *, start_s: float, end_s: float
               ) -> float:
    """The integral of a sampled quantity (bytes) over ``[start_s, end_s]`` in GB-seconds, each
    sample holding until the next."""
    total = 0.0
    for here, nxt in zip(samples, samples[1:], strict=False):
        lo, hi = max(here.t_s, start_s), min(nxt.t_s, end_s)
        if hi > lo:
            total += getattr(here, attribute) * (hi - lo)
    return total / 1e9


@dataclass(frozen=True)
class NodeLaunch:
    """One worker node the autoscaler launched, from its monitor's log (seconds from the trace's
    start): when a node launcher took it up ("Got N nodes to launch.") and when the provider
    had created it ("Launching N nodes, type T.", logged once the fake provider's ``ray start``
    of the node returned)."""

    node_type: str
    taken_s: float
    created_s: float


_LOG_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}).*?(\w*NodeLauncher\d*): "
    r"(?:Got (\d+) nodes to launch|Launching (\d+) nodes, type (\S+?)\.?[ \t]*$)",
    re.MULTILINE,
)


def monitor_launches(log_text: str, *, t0_unix_s: float) -> list[NodeLaunch]:
    """The node launches in the autoscaler's monitor log, one entry per node. Each node launcher
    thread takes one batch at a time, so a "Launching" line belongs to the last "Got" line of
    the same launcher. The log's timestamps are local time."""
    taken: dict[str, float] = {}
    found: list[NodeLaunch] = []
    for match in _LOG_LINE.finditer(log_text):
        stamp = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"))
        at = stamp + int(match.group(2)) / 1000 - t0_unix_s
        launcher = match.group(3)
        if match.group(4) is not None:
            taken[launcher] = at
            continue
        count, node_type = int(match.group(5)), match.group(6)
        found.extend([NodeLaunch(node_type, taken.pop(launcher, at), at)] * count)
    return found


def scale_ups(trace: Trace, requests: list[dict[str, Any]], launches: list[NodeLaunch],
              actions: list[dict[str, Any]], t0_unix_s: float) -> list[dict[str, Any]]:
    """One row per server launched onto a new worker node: the demand that asked for it (the
    latest registration waiting when its slot was asked for; the sizing loop's request for a
    server its ``AddServer`` action names),
    when the autoscaler was asked for its slot, when a node launcher took the node up, when the
    node was alive (first seen), when its server was up (first listed by ``status``) and when it
    first served a job's put. Each node is matched to the launch of its type created nearest to
    when it was first seen."""
    rows = []
    asks = sorted((r["at_unix_s"] - t0_unix_s, r.get("reason", "")) for r in requests
                  if r.get("reason", "").startswith("launching"))
    unmatched = list(launches)
    sized = {a.get("node_id") for a in actions if a.get("action") == "AddServer"}
    for server, seen_s in sorted(trace.server_seen_s.items(), key=lambda kv: kv[1]):
        last = trace.server_last.get(server, {})
        node, tier = last.get("ray_node_id"), last.get("tier")
        if last.get("long_running") or node not in trace.node_seen_s:
            continue
        node_up = trace.node_seen_s[node]
        asked = max((at for at, reason in asks if at <= seen_s and f" {tier} " in reason),
                    default=None)
        launch = min((x for x in unmatched if x.node_type == tier),
                     key=lambda x: abs(x.created_s - node_up), default=None)
        if launch is not None:
            unmatched.remove(launch)
        # Of the registrations waiting when the slot was asked for, the latest: registrations
        # launch side by side, each asking as it arrives.
        waiting = [r.asked_s for r in trace.runs.values()
                   if server not in sized and r.asked_s is not None and asked is not None
                   and r.asked_s <= asked
                   and (r.registered_s is None or r.registered_s >= asked)]
        demand = max(waiting) if waiting else asked
        served = min((r.first_put_s for r in trace.runs.values()
                      if server in r.servers and r.first_put_s is not None), default=None)
        taken = launch.taken_s if launch is not None else None
        rows.append({
            "server": server, "tier": tier, "node": node[-5:],
            "asked_by": "registration" if waiting else "sizing",
            "demand_s": demand, "requested_s": asked, "autoscaler_took_s": taken,
            "node_up_s": node_up, "server_up_s": seen_s, "first_served_s": served,
            "autoscaler_launch_s": _diff(taken, asked),
            "raylet_start_s": _diff(node_up, taken),
            "server_start_s": _diff(seen_s, node_up),
            "demand_to_served_s": _diff(served, demand),
            "demand_to_server_up_s": _diff(seen_s, demand),
        })
    # A registration that needs several servers launches them together and takes them in
    # together, once the last is up (launch_many): a server whose node came up first waits for
    # its siblings' nodes before it is listed. That wait is the batch's, not its server's start.
    for row in rows:
        batch = [r["node_up_s"] for r in rows
                 if r["tier"] == row["tier"] and r["requested_s"] == row["requested_s"]
                 and r["asked_by"] == row["asked_by"] == "registration"]
        last_up = max(batch, default=row["node_up_s"])
        row["waited_for_batch_s"] = _diff(last_up, row["node_up_s"])
        row["server_start_after_batch_s"] = _diff(row["server_up_s"], last_up)
    return rows


def scale_downs(trace: Trace) -> list[dict[str, Any]]:
    """One row per launched server: from the deregistration of the last job whose map named it
    (at registration) to the server retired (capacity released) and its node removed, as
    sampled. A server the sizing loop added for a full tier, which no job's first map names,
    has no such instant (``last_job_left_s`` None)."""
    rows = []
    for server in sorted(trace.server_seen_s, key=trace.server_seen_s.__getitem__):
        last = trace.server_last.get(server, {})
        if last.get("long_running"):
            continue
        users = [r for r in trace.runs.values() if server in r.servers]
        left = [r.deregistered_s for r in users]
        last_left = max(left) if left and None not in left else None  # type: ignore[type-var]
        node = last.get("ray_node_id")
        rows.append({
            "server": server, "tier": last.get("tier"),
            "jobs": sorted(r.name for r in users),
            "last_job_left_s": last_left,
            "retired_s": trace.server_gone_s.get(server),
            "node_removed_s": trace.node_gone_s.get(node) if node else None,
            "released_after_s": _diff(trace.server_gone_s.get(server), last_left),
            "node_removed_after_s": _diff(
                trace.node_gone_s.get(node) if node else None, last_left
            ),
        })
    return rows


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 2)


def simulate_trace(trace: Sequence[TraceJob], startup_delay_s: dict[str, int],
                   duration_s: int) -> Any:
    """The simulator's run of the same trace, cluster shape and sizing bounds."""
    from pocketflow.control.simulator import SimConfig, SimJob, simulate
    from pocketflow.control.sizing import SizingBounds
    from pocketflow.control.tiers import local_spec

    config = SimConfig(
        spec=local_spec(dram_capacity_bytes=LONG_RUNNING_DRAM_BYTES,
                        nvme_capacity_bytes=NVME_BYTES),
        bounds=SizingBounds(cooldown_s=SIZING_COOLDOWN_S,
                            vertical_cooldown_s=min(SIZING_COOLDOWN_S, 2.0)),
        startup_delay_s=startup_delay_s,
        long_running_tier="dram",
        long_running_count=2,
        duration_s=duration_s,
        sizing_interval_s=1,
    )
    # Each job writes WRITE_FRACTION of its data size, paced over the first 80% of its run.
    jobs = [SimJob(j.name, j.hints, arrive_s=int(round(j.arrive_s)), run_s=int(round(j.run_s)),
                   written_fraction=WRITE_FRACTION, write_s=int(round(j.run_s * 0.8)))
            for j in trace]
    return simulate(jobs, config)


def plot(path: Path, real: Sequence[Sample], sim: Any, runs: dict[str, JobRun]) -> Path:
    """Demanded and allocated capacity and worker nodes over time, real and simulated."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    mib = float(MIB)
    t = [s.t_s for s in real]
    ax.step(t, [s.demand_bytes / mib for s in real], where="post", color="tab:orange",
            label="demanded capacity (jobs' hints)")
    ax.step(t, [s.allocated_bytes / mib for s in real], where="post", color="tab:blue",
            label="allocated capacity, real run")
    st = [s.t_s for s in sim.samples]
    ax.step(st, [s.allocated_capacity_bytes / mib for s in sim.samples], where="post",
            color="tab:blue", linestyle="--", alpha=0.7, label="allocated capacity, simulator")
    ax.set_xlabel("time since the first job asked (s)")
    ax.set_ylabel("capacity (MiB)")
    nodes = ax.twinx()
    nodes.step(t, [s.worker_nodes for s in real], where="post", color="tab:green",
               label="worker nodes, real run")
    nodes.step(st, [s.nodes_up - 2 for s in sim.samples], where="post", color="tab:green",
               linestyle="--", alpha=0.7, label="launched nodes, simulator")
    nodes.set_ylabel("worker nodes")
    nodes.set_ylim(0, max([s.worker_nodes for s in real] + [1]) + 2)
    for run in runs.values():
        if run.asked_s is not None:
            ax.axvline(run.asked_s, color="gray", linestyle=":", linewidth=0.8)
            ax.annotate(f"{run.name} +", (run.asked_s, 0), fontsize=8, color="gray")
        if run.deregistered_s is not None:
            ax.axvline(run.deregistered_s, color="gray", linestyle=":", linewidth=0.8)
            ax.annotate(f"{run.name} -", (run.deregistered_s, 0), fontsize=8, color="gray")
    lines = ax.get_legend_handles_labels()
    more = nodes.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=8)
    ax.set_title("pocketflow on Ray's autoscaler: allocation follows demand (real vs simulator)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- the run -----------------------------------------------------------------------------------


def run_benchmark(out_dir: Path, trace_jobs: Sequence[TraceJob] = TRACE, *,
                  name: str = "autoscale-trace") -> dict[str, Any]:
    from pocketflow.cluster import LocalCluster
    from pocketflow.control.draining import EMPTY, EXITED
    from pocketflow.control.launcher import tier_resource

    dram, nvme = tier_resource("dram"), tier_resource("nvme")
    node_types = [
        NodeType("dram", {dram: 1}, max_workers=NODE_TYPES_MAX_WORKERS),
        NodeType("nvme", {nvme: 1}, max_workers=NODE_TYPES_MAX_WORKERS),
    ]
    result: dict[str, Any] = {"started": now_iso(), "commit": git_commit(), "machine": machine(),
                              "trace": [asdict(j) for j in trace_jobs]}
    with AutoscalingRay(head_resources={dram: 2}, node_types=node_types) as cluster_ray:
        cluster_ray.connect()
        cluster = LocalCluster(
            dram_servers=2, nvme_servers=0, dram_capacity=LONG_RUNNING_DRAM_BYTES,
            nvme_capacity=NVME_BYTES, autoscale=True, storage_resources=True,
            register_timeout="120s", sizing_interval="1s", sizing_cooldown=f"{SIZING_COOLDOWN_S}s",
            tmp_dir="/var/tmp",
        )
        with cluster:
            trace = Trace(cluster, cluster_ray, trace_jobs)
            t0_unix_s = time.time()
            trace.run()
            status = cluster.status()
            requests = status["resource_requests"]
            actions = status["sizing_actions"]
            session = cluster_ray.session_dir
            monitor_log = ""
            if session is not None:
                for log_path in sorted((session / "logs").glob("monitor*.log")):
                    monitor_log += log_path.read_text(errors="replace")
            stopped_s = trace.now_s()
        left_request = cluster_ray.resource_request()
        stop_t = time.monotonic()
        while cluster_ray.worker_nodes() and time.monotonic() - stop_t < NOTHING_LEFT_WAIT_S:
            time.sleep(SAMPLE_INTERVAL_S)
        nothing_left = {
            "worker_nodes_after_s": round(time.monotonic() - stop_t, 1),
            "worker_nodes": len(cluster_ray.worker_nodes()),
            "request_at_stop": left_request,
            "request_after": cluster_ray.resource_request(),
        }
        nothing_left["ok"] = nothing_left["worker_nodes"] == 0 and not nothing_left[
            "request_after"]
    launches = monitor_launches(monitor_log, t0_unix_s=t0_unix_s)
    ups = scale_ups(trace, requests, launches, actions, t0_unix_s)
    downs = scale_downs(trace)
    end_s = max((r.deregistered_s or 0.0) for r in trace.runs.values())
    start_s = min((r.asked_s or 0.0) for r in trace.runs.values())
    window = {"start_s": start_s, "end_s": stopped_s}
    demanded = gb_seconds(trace.samples, "demand_bytes", **window)
    allocated = gb_seconds(trace.samples, "allocated_bytes", **window)
    baseline = 2 * LONG_RUNNING_DRAM_BYTES
    elastic = allocated - baseline * (stopped_s - start_s) / 1e9
    # The simulator, with the start-up delays measured here: a node's own, from its slot asked
    # for to its server up, per tier (the simulator starts a node when its launch starts; a
    # registration queued behind another's launch is not modelled, so it is not counted).
    delays: dict[str, int] = {}
    for tier in ("dram", "nvme"):
        measured = [row["server_up_s"] - row["requested_s"] for row in ups
                    if row["tier"] == tier and row["requested_s"] is not None]
        delays[tier] = max(1, math.ceil(statistics.median(measured))) if measured else 5
    sim = simulate_trace(trace_jobs, delays, duration_s=int(math.ceil(stopped_s)) + 1)
    sim_allocated = sum(
        s.allocated_capacity_bytes for s in sim.samples if start_s <= s.t_s < stopped_s
    ) / 1e9
    sim_demanded = sum(
        s.demand_capacity_bytes for s in sim.samples if start_s <= s.t_s < stopped_s
    ) / 1e9
    # Each retired server as last sampled (its heartbeat, which may be seconds old: a sample of
    # a server retired right after its job's end may still show that job's objects), and what
    # showed the controller it was empty when it retired it (its stats after the drain, or its
    # exit: a drained server exits only once it holds nothing).
    drained = {s: trace.server_last[s] for s in trace.server_gone_s if s in trace.server_last}
    retired_how = {r["node_id"]: r["how"] for r in status.get("retired_servers", [])}
    result.update({
        "jobs": {name: asdict(run) for name, run in trace.runs.items()},
        "scale_up": ups,
        "scale_down": downs,
        "gb_seconds": {
            "window_s": [round(start_s, 1), round(stopped_s, 1)],
            "demanded": round(demanded, 4),
            "allocated": round(allocated, 4),
            "allocated_over_demanded": round(allocated / demanded, 3) if demanded else None,
            "allocated_elastic": round(elastic, 4),
            "long_running_baseline_bytes": baseline,
            "simulator_allocated": round(sim_allocated, 4),
            "simulator_demanded": round(sim_demanded, 4),
            "simulator_over_real_allocated": round(sim_allocated / allocated, 3)
            if allocated else None,
        },
        "simulator_startup_delay_s": delays,
        "nothing_lost": all(r.verified and r.error is None for r in trace.runs.values()),
        "drained_servers_last_seen": drained,
        "drained_servers_retired_how": {s: retired_how.get(s) for s in trace.server_gone_s},
        "drained_servers_empty": all(
            retired_how.get(s) in (EMPTY, EXITED) for s in trace.server_gone_s
        ),
        "nothing_left": nothing_left,
        "sizing_actions": actions,
        "resource_requests": requests,
        "samples": [asdict(s) for s in trace.samples],
        "simulator_samples": [
            {"t_s": s.t_s, "demand_bytes": s.demand_capacity_bytes,
             "allocated_bytes": s.allocated_capacity_bytes, "nodes_up": s.nodes_up,
             "action": s.action} for s in sim.samples
        ],
        "end_s": end_s,
    })
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{today()}-{name}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    result["png"] = str(plot(out_dir / f"{stem}.png", trace.samples, sim, trace.runs))
    return result


def summary(result: dict[str, Any]) -> str:
    """The figures the issue's goals are stated in, one per line."""
    lines = []
    for row in result["scale_up"]:
        lines.append(
            f"scale-up {row['server']} ({row['tier']}, asked by {row['asked_by']}): demand -> "
            f"server up {row['demand_to_server_up_s']} s, -> served "
            f"{row['demand_to_served_s']} s (autoscaler launch {row['autoscaler_launch_s']} s, "
            f"raylet start {row['raylet_start_s']} s, server start {row['server_start_s']} s, "
            f"of which waiting for its launch batch's other nodes {row['waited_for_batch_s']} s)"
        )
    for row in result["scale_down"]:
        lines.append(f"scale-down {row['server']} (jobs {', '.join(row['jobs']) or 'none'}): "
                     f"released {row['released_after_s']} s after its last job left, node "
                     f"removed {row['node_removed_after_s']} s")
    gbs = result["gb_seconds"]
    lines.append(f"GB-s allocated/demanded {gbs['allocated_over_demanded']} "
                 f"({gbs['allocated']} / {gbs['demanded']}); simulator/real allocated "
                 f"{gbs['simulator_over_real_allocated']}")
    lines.append(f"nothing lost: {result['nothing_lost']}; nothing left: {result['nothing_left']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.autoscale_trace")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tiny", action="store_true",
                        help="the short, small trace the suite runs (checks the script only)")
    args = parser.parse_args(argv)
    if args.tiny:
        result = run_benchmark(args.out, TINY_TRACE, name="autoscale-trace-tiny")
    else:
        result = run_benchmark(args.out)
    print(summary(result))
    print(f"wrote {result['png']}")
    return 0 if result["nothing_lost"] and result["nothing_left"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
