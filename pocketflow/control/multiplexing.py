"""Capacity multiplexing (Jiffy Figure 9(a)): job-level allocation against prefix leases when
the fast tier holds only part of what the jobs' peaks add up to.

Run it with ``python3 -m pocketflow.control.multiplexing --out multiplexing.png``: a trace of
staggered shuffles runs at 100%, 50% and 20% of the peak DRAM capacity under both schemes, and
the plot shows each scheme's job slowdown (against unlimited DRAM) and the utilization of the
DRAM it allocated.

API summary:

- :class:`DagJob` — one job of the trace: arrival, a chain of stages (bytes each stage writes,
  tasks per stage), compute per task; :func:`staggered_trace` builds the default trace.
- :class:`MuxConfig` — per-task bandwidth of DRAM and of the spill tier, lease length, how long a
  prefix may wait for freed DRAM, time step.
- ``simulate(trace, capacity_bytes, scheme, config) -> MuxResult`` — per-job completion times and
  the DRAM allocated and used over time, for ``scheme`` ``"job"`` or ``"prefix"``. Pure: no I/O.
- ``run_figure(trace, fractions, config) -> dict`` — both schemes at each fraction of the peak.
- ``plot(figure, path)`` — write the PNG (matplotlib, imported lazily).

The model. Every job is a chain of shuffles: a stage's tasks each read an equal share of the
stage before it (one part from each of its writers), compute, then write their share of the
stage's output. With ``readers="barrier"`` (Pocket's and Jiffy's jobs) a stage starts when the
stage before it is done; with ``readers="park"`` (pocketflow's Lithops shuffle, whose reducers
wait on the servers for their inputs) every stage starts with the job and a reader reads each
part as soon as its writer finished writing it. A task moves bytes at ``dram_bytes_per_s`` to
or from DRAM and at ``spill_bytes_per_s`` to or from the spill tier (NVMe, or in Jiffy's
evaluation S3), so a task whose data did not fit in DRAM is slower. Intermediate data is deleted
as it is read (DELETE-on-read): a reader reads the parts it can have in DRAM first (fetched side
by side with the spilled ones, they arrive first) and each part is deleted when it has been
read, so a reader gives its DRAM back at DRAM's rate during its read, not all at once when its
last spilled byte arrived. A part is readable once its writer's whole write is done.

- ``"job"`` (Pocket, and pocketflow without prefixes): a job reserves DRAM for its peak
  (its whole intermediate data) when it arrives, or what is left, and holds the reservation
  until it ends; the share of its data beyond the reservation is written to the spill tier.
- ``"prefix"`` (Jiffy, :mod:`pocketflow.prefixes`): capacity is allocated to a reducer's prefix
  (``r00003``) as mappers write into it and freed when that reducer is done and the prefix's
  lease lapses one lease later. A mapper whose write does not fit waits in a FIFO for freed
  DRAM, at most ``wait_max_s``; capacity freed by lapsed leases goes to waiting prefixes first,
  in order, then to new writes; at the deadline the rest of the write spills.

Slowdown is a job's completion time (arrival to last reducer) over its time with unlimited DRAM.
Utilization of allocated capacity is the time integral of DRAM holding live data over the time
integral of DRAM allocated (reserved for a job, or held by a prefix whose lease has not lapsed).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

GB = 1000**3
MB = 1000**2

STEPS_MAX = 2_000_000
"""Upper bound on simulated steps."""
JOBS_MAX = 10_000
"""Upper bound on jobs of one trace."""
SCHEMES = ("job", "prefix")
READERS = ("barrier", "park")


@dataclass(frozen=True)
class DagJob:
    """One job of the trace: a chain of stages. Stage ``k`` has ``widths[k]`` tasks; each
    reads its share of stage ``k-1``'s output (deleting it), computes ``compute_s``, and writes
    its share of ``stage_bytes[k]`` (the last stage's output leaves the cluster: 0)."""

    name: str
    arrive_s: float
    stage_bytes: tuple[int, ...]
    widths: tuple[int, ...]
    compute_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.stage_bytes or len(self.stage_bytes) != len(self.widths):
            raise ValueError("a job has one width per stage and at least one stage")
        if min(self.widths) < 1 or min(self.stage_bytes) < 0:
            raise ValueError("widths are >= 1 and stage bytes >= 0")


@dataclass(frozen=True)
class MuxConfig:
    """Bandwidths, lease and time step of the model."""

    dram_bytes_per_s: float = 75 * MB
    """What one task moves to or from DRAM: the 600 Mb/s per-task network bound of
    :mod:`pocketflow.control.tiers` (Pocket's per-lambda limit)."""
    spill_bytes_per_s: float = 15 * MB
    """What one task moves to or from the spill tier: an assumption (a fifth of DRAM's), the
    order of one S3 or remote-NVMe stream per task; the slowdowns scale with it."""
    lease_s: float = 1.0
    """Prefix lease (Jiffy's 1 s): what a stage's readers did not delete is freed this long
    after the reading stage ends."""
    wait_max_s: float = 1.0
    """Longest a write waits for freed DRAM (one lease) before the rest spills."""
    readers: str = "barrier"
    """When a stage's tasks start: ``"barrier"``, when the stage before it is done (Jiffy's
    and Pocket's jobs); ``"park"``, with the job, each task parked on the servers until a
    writer's part for it exists, reading it then (pocketflow's Lithops shuffle)."""
    step_s: float = 0.05


def staggered_trace(jobs: int = 24, *, every_s: float = 5.0) -> list[DagJob]:
    """Jobs of two to five stages, 1 to 12 GB per stage, arriving every ``every_s`` seconds;
    deterministic."""
    shapes = (
        ((4, 8, 0), (32, 64, 16)),
        ((12, 2, 0), (96, 32, 8)),
        ((2, 6, 3, 0), (16, 48, 32, 8)),
        ((6, 0), (64, 32)),
        ((3, 10, 4, 1, 0), (32, 96, 48, 16, 8)),
        ((8, 8, 0), (64, 64, 16)),
    )
    trace = []
    for i in range(jobs):
        sizes, widths = shapes[i % len(shapes)]
        trace.append(DagJob(f"job-{i}", i * every_s, tuple(g * GB for g in sizes), widths,
                            compute_s=2.0 + (i % 3)))
    return trace


@dataclass
class _Task:
    job: int
    stage: int
    phase: str = "read"  # read, compute, wait, write
    left_s: float = 0.0  # of the compute or the write
    wait_until_s: float = 0.0
    dram_bytes: float = 0.0  # what the write moves to DRAM
    spill_bytes: float = 0.0  # what the write moves to the spill tier
    read_dram: float = 0.0  # input bytes read (and deleted) so far from DRAM
    read_spill: float = 0.0  # and from the spill tier


@dataclass
class _JobState:
    spec: DagJob
    arrived: bool = False
    reserved: float = 0.0
    end_s: float | None = None
    # Per stage: tasks created, and tasks not done yet (a task is done when its write is).
    started: list[bool] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    # Per stage: output bytes written so far (readable) in DRAM and spilled; readers take
    # equal shares.
    out_dram: list[float] = field(default_factory=list)
    out_spill: list[float] = field(default_factory=list)
    # Per stage: DRAM allocated to the stage's output and not yet freed.
    held: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class MuxResult:
    """Completion times and DRAM use of one run."""

    scheme: str
    capacity_bytes: float
    completion_s: tuple[float, ...]
    allocated_byte_s: float
    used_byte_s: float
    spilled_bytes: float
    peak_allocated_bytes: float
    peak_live_bytes: tuple[float, ...]
    """Per job, the most DRAM its data took at once."""

    @property
    def utilization(self) -> float:
        """DRAM holding live data over DRAM allocated, integrated over time."""
        return self.used_byte_s / self.allocated_byte_s if self.allocated_byte_s else 1.0


class _Sim:
    def __init__(self, trace: Sequence[DagJob], capacity: float, scheme: str,
                 config: MuxConfig, reservations: Sequence[float] | None) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
        if config.readers not in READERS:
            raise ValueError(f"readers must be one of {READERS}, got {config.readers!r}")
        if not 0 < len(trace) <= JOBS_MAX:
            raise ValueError(f"a trace has 1..{JOBS_MAX} jobs")
        self.c = config
        self.scheme = scheme
        self.free = capacity
        self.jobs = [_JobState(spec) for spec in trace]
        self.reservations = reservations
        self.tasks: list[_Task] = []
        self.waiting: collections.deque[_Task] = collections.deque()
        self.lapses: list[tuple[float, int, int]] = []  # (when, job, stage)
        self.live = 0.0
        self.live_per_job = [0.0] * len(trace)
        self.peak_live_per_job = [0.0] * len(trace)
        self.allocated = 0.0
        self.allocated_byte_s = 0.0
        self.used_byte_s = 0.0
        self.spilled = 0.0
        self.peak_allocated = 0.0

    # -- capacity --------------------------------------------------------------------------

    def _grant(self, want: float) -> float:
        got = max(0.0, min(want, self.free))
        self.free -= got
        self.allocated += got
        return got

    def _release(self, amount: float) -> None:
        self.free += amount
        self.allocated -= amount

    def _io_s(self, dram: float, spill: float) -> float:
        return dram / self.c.dram_bytes_per_s + spill / self.c.spill_bytes_per_s

    def _live(self, j: int, delta: float) -> None:
        self.live += delta
        self.live_per_job[j] += delta
        self.peak_live_per_job[j] = max(self.peak_live_per_job[j], self.live_per_job[j])

    # -- stages ----------------------------------------------------------------------------

    def _start_stage(self, j: int, k: int) -> None:
        job = self.jobs[j]
        job.started[k] = True
        for _ in range(job.spec.widths[k]):
            task = _Task(j, k)
            if k == 0:  # the first stage reads the job's input from outside
                task.phase, task.left_s = "compute", job.spec.compute_s
            self.tasks.append(task)

    def _arrive(self, t: float) -> None:
        for j, job in enumerate(self.jobs):
            if job.arrived or job.spec.arrive_s > t:
                continue
            job.arrived = True
            stages = len(job.spec.stage_bytes)
            job.out_dram, job.out_spill, job.held = [0.0] * stages, [0.0] * stages, [0.0] * stages
            job.started, job.left = [False] * stages, list(job.spec.widths)
            if self.scheme == "job":
                want = (self.reservations[j] if self.reservations is not None
                        else float(sum(job.spec.stage_bytes)))
                job.reserved = self._grant(want)
            # Parked readers start with the job: each stage's tasks wait on the servers for
            # their inputs. Otherwise a stage starts when the one before it is done.
            for k in range(stages if self.c.readers == "park" else 1):
                self._start_stage(j, k)

    def _write_share(self, task: _Task) -> float:
        spec = self.jobs[task.job].spec
        return spec.stage_bytes[task.stage] / spec.widths[task.stage]

    def _begin_write(self, task: _Task, dram: float) -> None:
        want = self._write_share(task)
        task.dram_bytes, task.spill_bytes = dram, want - dram
        self.jobs[task.job].held[task.stage] += dram
        self.spilled += want - dram
        self._live(task.job, dram)
        task.phase, task.left_s = "write", self._io_s(dram, want - dram)

    def _request_write(self, task: _Task, t: float) -> None:
        job = self.jobs[task.job]
        want = self._write_share(task)
        if want == 0:
            task.phase, task.left_s = "write", 0.0
            return
        if self.scheme == "job":
            # Writes go to the job's reservation while it has room, the rest spills.
            self._begin_write(task, max(0.0, min(want, job.reserved - sum(job.held))))
            return
        if not self.waiting and self.free >= want:
            self._grant(want)
            self._begin_write(task, want)
            return
        task.phase, task.wait_until_s = "wait", t + self.c.wait_max_s
        self.waiting.append(task)

    def _serve_waiting(self, t: float) -> None:
        while self.waiting:
            task = self.waiting[0]
            want = self._write_share(task)
            if self.free < want and t < task.wait_until_s:
                break
            self.waiting.popleft()
            self._begin_write(task, self._grant(want))

    def _read(self, task: _Task, dt: float) -> bool:
        """Read for ``dt`` what the task's share of the previous stage's written output offers,
        parts in DRAM first, deleting each part read (DELETE-on-read); returns whether the
        whole input is read (every writer done and nothing left)."""
        job = self.jobs[task.job]
        k = task.stage - 1
        share = 1.0 / job.spec.widths[task.stage]
        dram = max(0.0, min(job.out_dram[k] * share - task.read_dram,
                            self.c.dram_bytes_per_s * dt))
        spill_s = dt - dram / self.c.dram_bytes_per_s
        spill = max(0.0, min(job.out_spill[k] * share - task.read_spill,
                             self.c.spill_bytes_per_s * spill_s))
        task.read_dram += dram
        task.read_spill += spill
        if dram > 0:
            self._live(task.job, -dram)
            job.held[k] -= dram
            if self.scheme == "prefix":
                self._release(dram)
        return (job.left[k] == 0
                and task.read_dram >= job.out_dram[k] * share - 1e-3
                and task.read_spill >= job.out_spill[k] * share - 1e-3)

    def _write_done(self, task: _Task, t: float) -> None:
        job = self.jobs[task.job]
        k = task.stage
        job.out_dram[k] += task.dram_bytes
        job.out_spill[k] += task.spill_bytes
        job.left[k] -= 1
        if job.left[k]:
            return
        if k > 0 and self.scheme == "prefix" and job.held[k - 1] > 1e-6:
            self.lapses.append((t + self.c.lease_s, task.job, k - 1))
        if k + 1 < len(job.spec.stage_bytes):
            if not job.started[k + 1]:
                self._start_stage(task.job, k + 1)
            return
        job.end_s = t
        if self.scheme == "job":
            self._release(job.reserved)

    def step(self, t: float) -> None:
        dt = self.c.step_s
        if self.lapses:
            due = [lapse for lapse in self.lapses if lapse[0] <= t]
            self.lapses = [lapse for lapse in self.lapses if lapse[0] > t]
            for _, j, k in due:  # what readers left is freed when the lease lapses
                self._release(self.jobs[j].held[k])
                self._live(j, -self.jobs[j].held[k])
                self.jobs[j].held[k] = 0.0
        self._serve_waiting(t)
        self._arrive(t)
        running: list[_Task] = []
        for task in self.tasks:
            if task.phase == "read":
                if self._read(task, dt):
                    task.phase, task.left_s = "compute", self.jobs[task.job].spec.compute_s
                running.append(task)
                continue
            if task.phase == "wait":  # parked in self.waiting until DRAM or its deadline
                running.append(task)
                continue
            task.left_s -= dt
            if task.left_s > 1e-9:
                running.append(task)
            elif task.phase == "compute":
                self._request_write(task, t + dt)
                running.append(task)
            else:
                self._write_done(task, t + dt)
        self.tasks = running
        self.allocated_byte_s += self.allocated * dt
        self.used_byte_s += self.live * dt
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def done(self) -> bool:
        return all(job.end_s is not None for job in self.jobs) and not self.lapses


def simulate(trace: Sequence[DagJob], capacity_bytes: float, scheme: str,
             config: MuxConfig | None = None, *,
             reservations: Sequence[float] | None = None) -> MuxResult:
    """Run ``trace`` on ``capacity_bytes`` of DRAM under ``scheme`` until every job ended.
    ``reservations`` (job-level scheme) is what each job reserves; default: its peak of live
    data when it runs alone with unlimited DRAM (what a job would give as its hint)."""
    config = config or MuxConfig()
    if scheme == "job" and reservations is None:
        reservations = [
            simulate([replace(spec, arrive_s=0.0)], float("inf"), "prefix", config)
            .peak_live_bytes[0]
            for spec in trace
        ]
    sim = _Sim(trace, capacity_bytes, scheme, config, reservations)
    for step in range(STEPS_MAX):
        if sim.done():
            break
        sim.step(step * config.step_s)
    else:
        raise RuntimeError(f"the trace did not finish within {STEPS_MAX} steps")
    completion = tuple(job.end_s - job.spec.arrive_s for job in sim.jobs)  # type: ignore[operator]
    return MuxResult(scheme, capacity_bytes, completion, sim.allocated_byte_s, sim.used_byte_s,
                     sim.spilled, sim.peak_allocated, tuple(sim.peak_live_per_job))


def peak_capacity(trace: Sequence[DagJob], config: MuxConfig | None = None) -> float:
    """The peak DRAM the trace allocates with job-level allocation and unlimited DRAM: what
    "100% of the peak capacity" means."""
    return simulate(trace, float("inf"), "job", config).peak_allocated_bytes


def run_figure(trace: Sequence[DagJob], fractions: Sequence[float] = (1.0, 0.5, 0.2),
               config: MuxConfig | None = None) -> dict:
    """Both schemes at each fraction of the peak: mean and p90 slowdown, utilization."""
    config = config or MuxConfig()
    baseline = simulate(trace, float("inf"), "prefix", config).completion_s
    peak = peak_capacity(trace, config)
    rows = []
    for fraction in fractions:
        for scheme in SCHEMES:
            result = simulate(trace, peak * fraction, scheme, config)
            slowdowns = [c / b for c, b in zip(result.completion_s, baseline, strict=True)]
            rows.append({
                "capacity_fraction": fraction,
                "scheme": scheme,
                "slowdown_mean": statistics.fmean(slowdowns),
                "slowdown_p90": sorted(slowdowns)[int(0.9 * (len(slowdowns) - 1))],
                "slowdown_max": max(slowdowns),
                "utilization": result.utilization,
                "spilled_bytes": result.spilled_bytes,
            })
    return {"peak_capacity_bytes": peak, "jobs": len(trace), "rows": rows,
            "config": config.__dict__}


def plot(figure: dict, path: str | Path, *, title: str = "") -> Path:
    """Write slowdown and utilization per capacity fraction and scheme as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    labels = {"job": "job-level allocation (Pocket)", "prefix": "prefix leases (Jiffy)"}
    fractions = sorted({r["capacity_fraction"] for r in figure["rows"]}, reverse=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    for i, scheme in enumerate(SCHEMES):
        rows = {r["capacity_fraction"]: r for r in figure["rows"] if r["scheme"] == scheme}
        xs = [k + (i - 0.5) * width for k in range(len(fractions))]
        left.bar(xs, [rows[f]["slowdown_mean"] for f in fractions], width, label=labels[scheme])
        left.errorbar(xs, [rows[f]["slowdown_mean"] for f in fractions],
                      yerr=[[0] * len(fractions),
                            [max(0.0, rows[f]["slowdown_p90"] - rows[f]["slowdown_mean"])
                             for f in fractions]],
                      fmt="none", ecolor="black", capsize=3)
        right.bar(xs, [100 * rows[f]["utilization"] for f in fractions], width,
                  label=labels[scheme])
    for ax in (left, right):
        ax.set_xticks(range(len(fractions)), [f"{int(100 * f)}%" for f in fractions])
        ax.set_xlabel("DRAM capacity, % of the job-level peak")
        ax.grid(axis="y", alpha=0.3)
    left.set_ylabel("job slowdown (mean; bar to p90)")
    left.axhline(1.0, color="gray", linewidth=0.8)
    right.set_ylabel("utilization of allocated DRAM (%)")
    right.set_ylim(0, 105)
    left.legend(loc="upper left", fontsize=8)
    readers = {"barrier": "stage by stage", "park": "readers parked"}[
        figure["config"].get("readers", "barrier")]
    fig.suptitle(title or f"capacity multiplexing (simulated): {figure['jobs']} staggered "
                 f"jobs of 2-5 stages, {readers}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: the default trace at 100/50/20% of peak, printed and plotted."""
    parser = argparse.ArgumentParser(prog="python3 -m pocketflow.control.multiplexing")
    parser.add_argument("--out", required=True, help="PNG file to write")
    parser.add_argument("--jobs", type=int, default=24)
    parser.add_argument("--spill-ratio", type=float, default=None,
                        help="spill tier's per-task bandwidth over DRAM's (default 0.2: S3-like, "
                             "as in Jiffy's evaluation)")
    parser.add_argument("--readers", choices=READERS, default="barrier",
                        help="when a stage's readers start (default barrier: when the stage "
                             "before it is done; park: with the job, reading parts as written)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="also print the 20%% rows with other time steps and waits: how "
                             "much of a figure is the model's timing")
    args = parser.parse_args(argv)
    config = MuxConfig(readers=args.readers)
    if args.spill_ratio is not None:
        if not 0 < args.spill_ratio <= 1:
            parser.error("--spill-ratio must be in (0, 1]")
        config = replace(config, spill_bytes_per_s=args.spill_ratio * config.dram_bytes_per_s)
    figure = run_figure(staggered_trace(args.jobs), config=config)
    print(f"peak capacity (job-level, unlimited DRAM): "
          f"{figure['peak_capacity_bytes'] / GB:.1f} GB, {figure['jobs']} jobs, readers "
          f"{config.readers}, spill at {config.spill_bytes_per_s / config.dram_bytes_per_s:.2f} "
          "of DRAM's per-task bandwidth")
    for row in figure["rows"]:
        print(f"{int(100 * row['capacity_fraction']):4d}% {row['scheme']:7s} slowdown mean "
              f"{row['slowdown_mean']:.2f} p90 {row['slowdown_p90']:.2f} max "
              f"{row['slowdown_max']:.2f}, utilization {100 * row['utilization']:.0f}%, "
              f"spilled {row['spilled_bytes'] / GB:.1f} GB")
    print(f"wrote {plot(figure, args.out)}")
    if args.sensitivity:
        for step_s in (0.025, 0.05, 0.1):
            for wait_max_s in (0.5, 1.0, 2.0):
                varied = replace(config, step_s=step_s, wait_max_s=wait_max_s)
                rows = run_figure(staggered_trace(args.jobs), (0.2,), varied)["rows"]
                print(f"  20% step {step_s} s, wait {wait_max_s} s: " + ", ".join(
                    f"{r['scheme']} {r['slowdown_mean']:.2f}" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
