"""Discrete-time simulator driving the real hints, packing and sizing policies (Pocket Figure 10).

Run it with ``python3 -m pocketflow.control.simulator --out sim.png``: three jobs register and
deregister over time, and the plot shows the throughput the cluster has allocated following the
throughput the jobs demand.

API summary:

- :class:`SimJob` — a job of the trace: name, hints, when it asks to register, how long it runs.
- :class:`SimConfig` — tier specs, sizing bounds, per-tier start-up delay, long-running servers,
  duration; :data:`FIGURE10_TRACE` — the default three-job trace.
- ``simulate(trace, config) -> SimResult`` — per-step :class:`Sample` rows (demanded and
  allocated throughput, servers, actions) and per-job start and end times. Pure: no I/O.
- ``plot(result, path)`` — write the PNG (matplotlib, imported lazily: a test extra).

The model: each step is one second. A storage node offers its tier's throughput and capacity
once its start-up delay has passed. A job asking to register is packed onto the ready, active
nodes (:func:`pocketflow.control.packing.pack`); when it does not fit, the shortfall is launched
and the job waits until those nodes are up (registration blocks), then it is packed again. A
running job drives its peak throughput, spread by its weights; its reservation (weight x
capacity demand) is held from its registration on, and its data (``written_fraction`` of the
reservation, written evenly over ``write_s``) fills it, as the controller counts them (a tier
grows on data, and shrinks no lower than what jobs hold). Every
``sizing_interval_s`` steps the sizing policy (:func:`pocketflow.control.sizing.decide`) sees each
node's utilization (CPU modelled as network use over the throughput its threads can drive, each
of ``threads_max`` threads driving an equal part) and may add threads to a node, add a node, or
drain one: a draining node takes no new jobs and exits once no running job has data on it. Allocated
throughput counts every node that is up, draining or not (it still costs money).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pocketflow.control.hints import JobDemand, demand_from_hints
from pocketflow.control.packing import Allocation, ServerLoad, pack, with_allocations
from pocketflow.control.sizing import (
    AddServer,
    AddThreads,
    NoAction,
    RemoveServers,
    RemoveThreads,
    ServerUtilization,
    SizingBounds,
    decide,
)
from pocketflow.control.tiers import GB, I3_2XLARGE, ClusterSpec
from pocketflow.hints import Hints

STEPS_MAX = 100_000
"""Upper bound on simulated steps (seconds)."""

NODES_MAX = 1_000
"""Upper bound on nodes launched in one simulation."""


@dataclass(frozen=True)
class SimJob:
    """A job of the trace: it asks to register at ``arrive_s`` and runs for ``run_s``; it
    writes ``written_fraction`` of its capacity demand, evenly over the first ``write_s`` of
    its run (0: all at its registration)."""

    name: str
    hints: Mapping[str, Any]
    arrive_s: int
    run_s: int
    written_fraction: float = 1.0
    write_s: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.written_fraction <= 1.0 or self.write_s < 0:
            raise ValueError(
                f"need 0 <= written_fraction <= 1 and write_s >= 0, got "
                f"{self.written_fraction}, {self.write_s}"
            )

    def written_share(self, running_s: int) -> float:
        """The share of its capacity demand the job has written ``running_s`` into its run."""
        if self.write_s <= 0:
            return self.written_fraction
        return self.written_fraction * min(max(running_s, 0) / self.write_s, 1.0)


@dataclass(frozen=True)
class SimConfig:
    """What the simulated cluster looks like and how long to simulate."""

    spec: ClusterSpec = I3_2XLARGE
    bounds: SizingBounds = field(default_factory=lambda: SizingBounds(cooldown_s=5.0))
    startup_delay_s: Mapping[str, int] = field(
        default_factory=lambda: {"dram": 5, "nvme": 10}
    )
    long_running_tier: str = "dram"
    long_running_count: int = 2
    threads_start: int = 2
    threads_max: int = 4
    duration_s: int = 200
    sizing_interval_s: int = 1
    """How often (in steps) the sizing policy runs, as the controller's ``sizing_interval``."""

    def __post_init__(self) -> None:
        if self.sizing_interval_s < 1:
            raise ValueError(f"sizing_interval_s must be >= 1, got {self.sizing_interval_s}")


FIGURE10_TRACE: tuple[SimJob, ...] = (
    # A latency-sensitive job of 40 concurrent tasks: 3 GB/s on DRAM.
    SimJob("video", {"max_concurrent_tasks": 40}, arrive_s=5, run_s=70),
    # A latency-insensitive sort: 100 tasks (7.5 GB/s) and 2 TB on NVMe.
    SimJob(
        "sort",
        {"latency_sensitive": False, "max_concurrent_tasks": 100, "data_size_bytes": 2000 * GB},
        arrive_s=35,
        run_s=50,
    ),
    # A small latency-sensitive job: 2 GB/s and 40 GB.
    SimJob(
        "query",
        {"peak_throughput_bytes_per_s": 2 * GB, "data_size_bytes": 40 * GB},
        arrive_s=100,
        run_s=40,
    ),
)
"""Three jobs registering and deregistering, overlapping like Pocket's Figure 10."""


@dataclass(frozen=True)
class Sample:
    """The cluster at the end of one step."""

    t_s: int
    demand_bytes_per_s: int
    allocated_bytes_per_s: int
    nodes_up: int
    nodes_starting: int
    nodes_draining: int
    action: str
    demand_capacity_bytes: int = 0
    """Capacity the jobs demand (their hints), from when each asks to register."""
    allocated_capacity_bytes: int = 0
    """Capacity of the nodes that are up, draining or not."""


@dataclass(frozen=True)
class JobTimes:
    """When a job asked to register, was registered, and deregistered (``None``: not yet)."""

    name: str
    arrive_s: int
    start_s: int | None
    end_s: int | None
    demand: JobDemand


@dataclass(frozen=True)
class SimResult:
    """The samples of every step and the times of every job."""

    samples: tuple[Sample, ...]
    jobs: tuple[JobTimes, ...]
    config: SimConfig


@dataclass
class _Node:
    node_id: str
    tier: str
    long_running: bool
    ready_s: int
    threads: int
    draining: bool = False
    exited_s: int | None = None

    def up(self, t: int) -> bool:
        return self.ready_s <= t and self.exited_s is None


@dataclass
class _Job:
    spec: SimJob
    demand: JobDemand
    start_s: int | None = None
    end_s: int | None = None
    allocation: Allocation | None = None
    waiting_for: set[str] = field(default_factory=set)


class _Cluster:
    """The simulated nodes and jobs; one call of :meth:`step` is one second."""

    def __init__(self, trace: Sequence[SimJob], config: SimConfig) -> None:
        self.config = config
        self.nodes: list[_Node] = []
        self.jobs = [_Job(j, demand_from_hints(Hints.coerce(j.hints), config.spec)) for j in trace]
        self.last_action_s: float | None = None
        for _ in range(config.long_running_count):
            self._launch(config.long_running_tier, t=0, long_running=True, delay_s=0)

    def _launch(self, tier: str, *, t: int, long_running: bool = False, delay_s: int | None = None
                ) -> _Node:
        if len(self.nodes) >= NODES_MAX:
            raise RuntimeError(f"simulation launched more than {NODES_MAX} nodes")
        delay = self.config.startup_delay_s.get(tier, 0) if delay_s is None else delay_s
        node = _Node(
            f"{tier}-{len(self.nodes)}",
            tier,
            long_running,
            ready_s=t + delay,
            threads=self.config.threads_start,
        )
        self.nodes.append(node)
        return node

    def _running(self, t: int) -> list[_Job]:
        return [j for j in self.jobs if j.start_s is not None and j.end_s is None]

    def _loads(self, t: int) -> list[ServerLoad]:
        spec = self.config.spec
        loads = []
        for node in self.nodes:
            if not node.up(t):
                continue
            tier = spec.tier(node.tier)
            loads.append(
                ServerLoad(
                    node.node_id,
                    node.tier,
                    tier.capacity_bytes,
                    tier.throughput_bytes_per_s,
                    long_running=node.long_running,
                    draining=node.draining,
                )
            )
        placed = [(j.demand, j.allocation) for j in self._running(t) if j.allocation is not None]
        return with_allocations(loads, placed)

    def step(self, t: int) -> Sample:
        for job in self._running(t):
            if t >= job.start_s + job.spec.run_s:  # type: ignore[operator]
                job.end_s = t
        self._register(t)
        self._exit_drained(t)
        action = self._size(t)
        return self._sample(t, action)

    def _register(self, t: int) -> None:
        for job in self.jobs:
            if job.start_s is not None or job.spec.arrive_s > t:
                continue
            if any(not self._node(n).up(t) for n in job.waiting_for):
                continue
            result = pack(job.demand, self._loads(t), self.config.spec)
            if result.fits:
                job.allocation = result.allocation
                job.start_s = t
                job.waiting_for = set()
                continue
            launched = set()
            for tier, count in sorted(result.shortfall.items()):
                for _ in range(count):
                    launched.add(self._launch(tier, t=t).node_id)
            job.waiting_for = launched

    def _node(self, node_id: str) -> _Node:
        return next(n for n in self.nodes if n.node_id == node_id)

    def _exit_drained(self, t: int) -> None:
        in_use = {
            p.node_id
            for j in self._running(t)
            if j.allocation is not None
            for p in j.allocation.placements
            if p.weight > 0
        }
        for node in self.nodes:
            if node.draining and node.exited_s is None and node.node_id not in in_use:
                node.exited_s = t

    def _utilization(self, t: int) -> list[ServerUtilization]:
        spec = self.config.spec
        net: dict[str, float] = {}
        used: dict[str, float] = {}
        reserved: dict[str, float] = {}
        for job in self._running(t):
            assert job.allocation is not None and job.start_s is not None
            throughput, capacity = job.demand.throughput_bytes_per_s, job.demand.capacity_bytes
            written = job.spec.written_share(t - job.start_s)
            for p in job.allocation.placements:
                net[p.node_id] = net.get(p.node_id, 0.0) + p.weight * throughput
                # Its reservation is held from its registration on (a fresh job must not look
                # idle); its data fills it as it writes.
                reserved[p.node_id] = reserved.get(p.node_id, 0.0) + p.weight * capacity
                used[p.node_id] = used.get(p.node_id, 0.0) + p.weight * capacity * written
        samples = []
        for node in self.nodes:
            if not node.up(t):
                continue
            tier = spec.tier(node.tier)
            traffic = net.get(node.node_id, 0.0)
            # Each thread drives an equal part of the tier's throughput.
            thread_share = node.threads / self.config.threads_max
            samples.append(
                ServerUtilization(
                    node.node_id,
                    node.tier,
                    cpu_fraction=min(traffic / (tier.throughput_bytes_per_s * thread_share), 1.0),
                    net_bytes_per_s=traffic,
                    net_capacity_bytes_per_s=tier.throughput_bytes_per_s,
                    used_bytes=int(used.get(node.node_id, 0.0)),
                    reserved_bytes=int(reserved.get(node.node_id, 0.0)),
                    capacity_bytes=tier.capacity_bytes,
                    threads=node.threads,
                    threads_max=self.config.threads_max,
                    long_running=node.long_running,
                    draining=node.draining,
                )
            )
        return samples

    def _size(self, t: int) -> str:
        if t % self.config.sizing_interval_s:
            return ""
        pending: dict[str, int] = {}
        for node in self.nodes:
            if node.ready_s > t:
                pending[node.tier] = pending.get(node.tier, 0) + 1
        action = decide(
            self._utilization(t),
            self.config.bounds,
            now_s=float(t),
            last_action_s=self.last_action_s,
            pending=pending,
        )
        if isinstance(action, NoAction):
            return ""
        self.last_action_s = float(t)
        if isinstance(action, AddServer):
            node = self._launch(action.tier, t=t, long_running=action.long_running)
            return f"add {node.node_id}"
        if isinstance(action, RemoveServers):
            for node_id in action.node_ids:
                self._node(node_id).draining = True
            return f"drain {', '.join(action.node_ids)}"
        assert isinstance(action, (AddThreads, RemoveThreads))
        self._node(action.node_id).threads = action.threads
        return f"threads {action.node_id}={action.threads}"

    def _sample(self, t: int, action: str) -> Sample:
        spec = self.config.spec
        up = [n for n in self.nodes if n.up(t)]
        return Sample(
            t_s=t,
            demand_bytes_per_s=sum(j.demand.throughput_bytes_per_s for j in self._running(t)),
            allocated_bytes_per_s=sum(spec.tier(n.tier).throughput_bytes_per_s for n in up),
            nodes_up=len(up),
            nodes_starting=sum(1 for n in self.nodes if n.ready_s > t),
            nodes_draining=sum(1 for n in up if n.draining),
            action=action,
            # From the moment a job asks to register (a registration waiting for launched
            # nodes demands its capacity already).
            demand_capacity_bytes=sum(
                j.demand.capacity_bytes for j in self.jobs
                if j.spec.arrive_s <= t and j.end_s is None
            ),
            allocated_capacity_bytes=sum(spec.tier(n.tier).capacity_bytes for n in up),
        )


def simulate(trace: Sequence[SimJob] = FIGURE10_TRACE, config: SimConfig | None = None
             ) -> SimResult:
    """Run the trace on a simulated cluster for ``config.duration_s`` steps."""
    config = config or SimConfig()
    if not 0 < config.duration_s <= STEPS_MAX:
        raise ValueError(f"duration_s must be in 1..{STEPS_MAX}, got {config.duration_s}")
    cluster = _Cluster(trace, config)
    samples = tuple(cluster.step(t) for t in range(config.duration_s))
    jobs = tuple(
        JobTimes(j.spec.name, j.spec.arrive_s, j.start_s, j.end_s, j.demand) for j in cluster.jobs
    )
    return SimResult(samples=samples, jobs=jobs, config=config)


def plot(result: SimResult, path: str | Path) -> Path:
    """Write the demanded and allocated throughput over time as a PNG; returns the path."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "plotting needs matplotlib: pip install 'pocketflow[test]' or pip install matplotlib"
        ) from exc
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    gbit = 1e9 / 8
    times = [s.t_s for s in result.samples]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.step(times, [s.allocated_bytes_per_s / gbit for s in result.samples], where="post",
            label="allocated throughput", color="tab:blue")
    ax.step(times, [s.demand_bytes_per_s / gbit for s in result.samples], where="post",
            label="job demand (peak throughput)", color="tab:orange")
    top = max((s.allocated_bytes_per_s for s in result.samples), default=0) / gbit
    for job in result.jobs:
        if job.start_s is not None:
            ax.axvline(job.start_s, color="tab:green", linestyle=":", linewidth=1)
            ax.annotate(f"{job.name} +", (job.start_s, top * 1.02), fontsize=8, color="tab:green")
        if job.end_s is not None:
            ax.axvline(job.end_s, color="tab:red", linestyle=":", linewidth=1)
            ax.annotate(f"{job.name} -", (job.end_s, top * 0.95), fontsize=8, color="tab:red")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("throughput (Gb/s)")
    ax.set_title("pocketflow simulator: allocated throughput follows job demand")
    ax.set_ylim(bottom=0, top=max(top * 1.12, 1))
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: simulate the Figure 10 trace and write the plot."""
    parser = argparse.ArgumentParser(prog="python3 -m pocketflow.control.simulator")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--duration-s", type=int, default=SimConfig().duration_s)
    args = parser.parse_args(argv)
    result = simulate(FIGURE10_TRACE, SimConfig(duration_s=args.duration_s))
    try:
        out = plot(result, args.out)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for job in result.jobs:
        print(f"{job.name}: asked at {job.arrive_s}s, registered at {job.start_s}s, "
              f"deregistered at {job.end_s}s, {job.demand.throughput_bytes_per_s / 1e9:.2f} GB/s "
              f"on {'/'.join(job.demand.tiers)}")
    peak = max(s.allocated_bytes_per_s for s in result.samples)
    print(f"peak allocated {peak * 8 / 1e9:.0f} Gb/s; final {result.samples[-1].nodes_up} nodes")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
