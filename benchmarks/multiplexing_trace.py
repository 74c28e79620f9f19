"""Jiffy's Figure 9(a) for real: a multi-job trace on the local cluster at 100%, 50% and 20% of
the peak DRAM it needs (and 10%, below the trace's peak of live data), job-level allocation
against prefix grants.

The trace: ``--jobs`` jobs arrive ``--every`` seconds apart; each is a chain of stages (``--widths``
tasks each). A task of stage ``k`` reads its inputs (the objects stage ``k-1`` wrote under its
prefix ``s<k>/t<i>``) with DELETE, computes (``--compute`` seconds: a sleep, the machine has two
cores), and writes ``--part`` bytes to each task of stage ``k+1``. Tasks are threads of this
process, one client per job, against a real cluster (2 DRAM servers, 1 NVMe server).

- ``job`` (Pocket, pocketflow without sized prefixes): a job registers with its whole
  intermediate data (``HINT_HEADROOM`` times it) as ``data_size_bytes``; the controller reserves
  DRAM for it (or NVMe when DRAM is short) until the job deregisters.
- ``prefix`` (Jiffy): a job registers without hints (it reserves nothing); a task about to
  write declares the prefixes of its output parts (``s<k>/t<i>/m<j>``, one per reader) with
  their sizes (``Job.declare_many``, one controller call per task), so DRAM is granted as data
  is written, as in Jiffy (and in the simulator); each gets DRAM, or waits in order for DRAM
  that ended or lapsing prefixes give back (``--wait`` at most), or spills to NVMe. The job's
  keeper renews them; a reader that consumed its parts ends them (``Job.end``): the servers free
  them and the controller takes their DRAM back at once. A reader that never ends its parts (a
  crash) loses them a lease (``--lease``) after the keeper stops.

First the trace runs with ample DRAM (both schemes); the peak DRAM the job-level scheme allocates
there is the 100% figure (the simulator's definition) and each job's time there (the faster of
the two schemes) is its unconstrained time. Then each fraction of the peak
runs on a cluster whose DRAM servers hold exactly that. Reported per scheme and fraction: mean and
p90 job slowdown (job time over its unconstrained time), and utilization of allocated DRAM (the
time integral of live bytes on DRAM over the integral of DRAM reserved or granted). Writes
``results/<date>-multiplexing-trace.{json,md,png}``.

    python3 -m benchmarks.multiplexing_trace [--fractions 1,0.5,0.2,0.1]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.machine import git_commit, machine, now_iso, today

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MIB = 1024 * 1024
BUCKET = "t"
SAMPLE_S = 0.1
"""How often the DRAM reserved and used are sampled."""
PUT_RETRIES_MAX = 200
"""A put that meets a full server retries this often (50 ms apart), then fails the run."""
AMPLE_DRAM_BYTES = 1024 * MIB
HINT_HEADROOM = 1.5
"""A job-level job hints this much more than its data: its keys are spread by weight, so the
share that lands on DRAM varies around the reservation, and a full DRAM server refuses puts."""


@dataclass
class Shape:
    jobs: int = 4
    every_s: float = 3.0
    widths: tuple[int, ...] = (4, 4, 4)
    part_bytes: int = 2 * MIB
    compute_s: float = 3.0
    """Mean compute per task; each task's is drawn from 0.25x..1.75x of it (seeded), so fast
    tasks' outputs wait for the stage's stragglers, as in a real shuffle. Stages of seconds keep
    Jiffy's 1 s lease small against them (a shorter lease on this loaded 2-core machine risks a
    late renewal freeing live data: see the note on the run)."""
    lease_ms: int = 1000
    """Prefix lease (Jiffy's 1 s)."""
    wait_s: float = 0.5

    def stage_bytes(self, stage: int) -> int:
        """Bytes stage ``stage`` writes (the last writes nothing)."""
        if stage + 1 >= len(self.widths):
            return 0
        return self.widths[stage] * self.widths[stage + 1] * self.part_bytes

    def job_bytes(self) -> int:
        return sum(self.stage_bytes(s) for s in range(len(self.widths)))


@dataclass
class Ledger:
    """Live intermediate bytes of the trace, in total and on DRAM, kept by the tasks."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    live: int = 0
    live_dram: int = 0
    peak: int = 0

    def add(self, nbytes: int, on_dram: bool) -> None:
        with self.lock:
            self.live += nbytes
            self.live_dram += nbytes if on_dram else 0
            self.peak = max(self.peak, self.live)


@functools.lru_cache(maxsize=16)
def _placement(handle):
    """The placement of ``handle`` (one per epoch, not one per key)."""
    from pocketflow.placement import Placement

    return Placement.of_handle(handle)


def _tier_of(job, key: str) -> str:
    return _placement(job.handle).server_for(key.encode()).tier


def _put(pf, key: str, data: bytes) -> None:
    from pocketflow.errors import CapacityExhausted

    for _ in range(PUT_RETRIES_MAX):
        try:
            pf.put(BUCKET, key, data)
            return
        except CapacityExhausted:
            time.sleep(0.05)
    raise RuntimeError(f"{key}: every server of its tier stayed full")


@dataclass
class JobRun:
    """What one job's driver and tasks share: its handle, client, keeper and figures."""

    job: Any
    pf: Any
    shape: Shape
    scheme: str
    index: int
    ledger: Ledger
    keeper: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    placed: dict[str, int] = field(default_factory=dict)
    waited_s: float = 0.0


def _run_job(cluster, index: int, shape: Shape, scheme: str, ledger: Ledger) -> dict[str, Any]:
    """One job of the trace, start to end; returns its timings and placements."""
    started = time.monotonic()
    # A prefix-scheme job reserves nothing for itself: its DRAM comes prefix by prefix.
    hints = {"data_size_bytes": int(HINT_HEADROOM * shape.job_bytes())} if scheme == "job" else {}
    job = cluster.register_job(f"trace-{scheme}-{index}", hints, prefix_lease_ms=shape.lease_ms)
    run = JobRun(job, job.connect(), shape, scheme, index, ledger)
    try:
        run.pf.create_bucket(BUCKET)
        if scheme == "prefix":
            run.keeper = job.keep([])
        for stage, width in enumerate(shape.widths):
            tasks = [threading.Thread(target=_task, args=(run, stage, t)) for t in range(width)]
            for task in tasks:
                task.start()
            for task in tasks:
                task.join()
    finally:
        if run.keeper is not None:
            run.keeper.close()
        run.pf.close()
        job.deregister()
    return {"job": index, "scheme": scheme, "time_s": time.monotonic() - started,
            "waited_s": round(run.waited_s, 3), "prefixes": run.placed}


def _part(stage: int, reader: int, writer: int) -> str:
    """The prefix of what task ``writer`` of stage ``stage - 1`` writes for task ``reader``."""
    return f"s{stage}/t{reader}/m{writer}"


def _task(run: JobRun, stage: int, task: int) -> None:
    """Read (with DELETE) what the previous stage wrote for this task, compute, write a part
    for each task of the next stage. Prefix scheme: a task declares its output parts, sized,
    when it is about to write them (DRAM is granted as data is written, as in Jiffy), and a
    reader ends the parts it consumed (their DRAM goes back at once)."""
    job, pf, shape, widths = run.job, run.pf, run.shape, run.shape.widths
    if stage > 0:
        parts = [_part(stage, task, m) for m in range(widths[stage - 1])]
        for part in parts:
            key = f"{part}/data"
            tier = _tier_of(job, key)
            data = pf.get(BUCKET, key, delete=True)
            run.ledger.add(-len(data), tier == "dram")
        if run.scheme == "prefix":
            job.end(parts)
    spread = random.Random(hash((run.index, stage, task)) & 0xFFFF).uniform(0.25, 1.75)
    time.sleep(shape.compute_s * spread)
    if stage + 1 >= len(widths):
        return
    parts = [_part(stage + 1, t, task) for t in range(widths[stage + 1])]
    if run.scheme == "prefix":
        begun = time.monotonic()
        decided = job.declare_many([(p, (), shape.part_bytes) for p in parts],
                                   wait_s=shape.wait_s)
        for part in parts:
            run.keeper.add(part)
        with run.lock:
            run.waited_s += time.monotonic() - begun
            for pool in decided.values():
                run.placed[str(pool)] = run.placed.get(str(pool), 0) + 1
    payload = bytes([task % 251]) * shape.part_bytes
    for part in parts:
        key = f"{part}/data"
        _put(pf, key, payload)
        run.ledger.add(len(payload), _tier_of(job, key) == "dram")


def run_trace(shape: Shape, scheme: str, dram_bytes_per_server: int) -> dict[str, Any]:
    """The whole trace on a fresh cluster with ``dram_bytes_per_server`` on each DRAM server."""
    import pocketflow

    ledger = Ledger()
    jobs: list[dict[str, Any]] = []
    samples: list[tuple[float, int, int]] = []
    with pocketflow.LocalCluster(dram_servers=2, nvme_servers=1,
                                 dram_capacity=dram_bytes_per_server,
                                 nvme_capacity=max(4 * shape.jobs * shape.job_bytes(), 256 * MIB),
                                 num_cpus=2, object_store_memory="80MiB") as cluster:
        stop = threading.Event()
        capacity = 2 * dram_bytes_per_server

        def sample() -> None:
            while not stop.wait(SAMPLE_S):
                grants = cluster.status()["prefix_grants"]
                free = grants["dram_free_bytes"]
                if grants.get("stale") or len(free) != 2:
                    continue  # the controller was busy (a registration): no fresh figures
                with ledger.lock:
                    used = ledger.live_dram
                samples.append((time.monotonic(), capacity - sum(free.values()), used))

        def one(i: int) -> None:
            time.sleep(i * shape.every_s)
            jobs.append(_run_job(cluster, i, shape, scheme, ledger))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        drivers = [threading.Thread(target=one, args=(i,)) for i in range(shape.jobs)]
        for driver in drivers:
            driver.start()
        for driver in drivers:
            driver.join()
        elapsed = time.monotonic() - started
        stop.set()
        sampler.join()
    allocated = sum(a for _, a, _ in samples)
    used = sum(u for _, _, u in samples)
    return {"scheme": scheme, "dram_bytes_per_server": dram_bytes_per_server,
            "elapsed_s": round(elapsed, 3), "peak_live_bytes": ledger.peak,
            "peak_allocated_bytes": max((a for _, a, _ in samples), default=0),
            "utilization": round(used / allocated, 3) if allocated else None,
            "jobs": sorted(jobs, key=lambda j: j["job"])}


def _slowdowns(run: dict[str, Any], base: dict[int, float]) -> list[float]:
    return [j["time_s"] / base[j["job"]] for j in run["jobs"]]


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="1,0.5,0.2,0.1")
    parser.add_argument("--jobs", type=int, default=Shape.jobs)
    parser.add_argument("--every", type=float, default=Shape.every_s)
    parser.add_argument("--widths", default="4,4,4")
    parser.add_argument("--part", default="2MiB")
    parser.add_argument("--compute", type=float, default=Shape.compute_s)
    parser.add_argument("--lease", type=int, default=Shape.lease_ms)
    parser.add_argument("--wait", type=float, default=Shape.wait_s)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from pocketflow.config import parse_size

    shape = Shape(jobs=args.jobs, every_s=args.every,
                  widths=tuple(int(w) for w in args.widths.split(",")),
                  part_bytes=parse_size(args.part), compute_s=args.compute,
                  lease_ms=args.lease, wait_s=args.wait)
    fractions = [float(f) for f in args.fractions.split(",")]
    runs = []
    base: dict[str, dict[int, float]] = {}
    peak = 0
    for scheme in ("job", "prefix"):
        run = run_trace(shape, scheme, AMPLE_DRAM_BYTES)
        run["fraction"] = None
        runs.append(run)
        base[scheme] = {j["job"]: j["time_s"] for j in run["jobs"]}
        if scheme == "job":
            peak = run["peak_allocated_bytes"]
        print(f"  unconstrained {scheme:6s}: {run['elapsed_s']:.2f} s, peak live "
              f"{run['peak_live_bytes'] / MIB:.0f} MiB, peak allocated "
              f"{run['peak_allocated_bytes'] / MIB:.0f} MiB", flush=True)
    unconstrained = {j: min(base["job"][j], base["prefix"][j]) for j in base["job"]}
    rows = []
    for fraction in fractions:
        per_server = max(int(fraction * peak / 2) // MIB * MIB, 4 * MIB)
        for scheme in ("job", "prefix"):
            run = run_trace(shape, scheme, per_server)
            run["fraction"] = fraction
            runs.append(run)
            slow = _slowdowns(run, unconstrained)
            row = {"fraction": fraction, "scheme": scheme,
                   "dram_mib": 2 * per_server // MIB,
                   "slowdown_mean": round(statistics.fmean(slow), 3),
                   "slowdown_p90": round(_p90(slow), 3),
                   "utilization": run["utilization"]}
            rows.append(row)
            print(f"  {fraction:>4.0%} {scheme:6s}: slowdown {row['slowdown_mean']:.2f}x "
                  f"(p90 {row['slowdown_p90']:.2f}x), utilization {row['utilization']}",
                  flush=True)
    report = {"benchmark": "multiplexing-trace", "when": now_iso(), "git": git_commit(),
              "machine": machine(), "shape": {**shape.__dict__, "widths": list(shape.widths)},
              "peak_live_bytes": peak, "rows": rows, "runs": runs}
    stem = args.out or RESULTS_DIR / f"{today()}-multiplexing-trace"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["| DRAM (of peak) | scheme | slowdown mean | p90 | utilization |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['fraction']:.0%} ({r['dram_mib']} MiB) | {r['scheme']} | "
              f"{r['slowdown_mean']:.2f}x | {r['slowdown_p90']:.2f}x | {r['utilization']} |"
              for r in rows]
    stem.with_suffix(".md").write_text(
        f"# Multi-job trace on the local cluster ({now_iso()}, {git_commit()})\n\n"
        f"Peak DRAM allocated (job-level, ample DRAM: the 100% figure) {peak / MIB:.0f} MiB; "
        f"shape {report['shape']}.\n\n"
        + "\n".join(lines) + "\n")
    _plot(rows, stem.with_suffix(".png"))
    print(f"wrote {stem}.json/.md/.png")
    return 0


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fractions = sorted({r["fraction"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for scheme, label in (("job", "job-level (Pocket)"), ("prefix", "prefix grants (Jiffy)")):
        mine = {r["fraction"]: r for r in rows if r["scheme"] == scheme}
        xs = [f"{f:.0%}" for f in fractions]
        axes[0].plot(xs, [mine[f]["slowdown_mean"] for f in fractions], marker="o", label=label)
        axes[1].plot(xs, [mine[f]["utilization"] or 0 for f in fractions], marker="o",
                     label=label)
    axes[0].set_ylabel("job slowdown (x)")
    worst = max(r["slowdown_mean"] for r in rows)
    axes[0].set_ylim(0.9, max(1.5, worst + 0.1))  # noise of a few percent stays small
    axes[1].set_ylabel("utilization of allocated DRAM")
    axes[1].set_ylim(0, 1.05)
    for axis in axes:
        axis.set_xlabel("DRAM capacity (of peak)")
        axis.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Multi-job trace on the local cluster (real servers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
