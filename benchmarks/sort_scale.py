"""Sorts at 1, 4 and 10 GB side by side: pocketflow's shuffle on Ray tasks and on Lithops
functions, Ray Data's own sort, Lithops with its localhost storage, and Lithops with Redis where
the data fits in memory, on the same records.

Run from the repository root (one size per process is fine; each run writes its own files)::

    python3 -m benchmarks.sort_scale --sizes 1GB,4GB,10GB [--variants ...] [--out DIR]
    python3 -m benchmarks.sort_scale --sizes 8MB --dram 64MiB   # what the test runs

Records are the demo's (:mod:`pocketflow.demo`): 100 bytes with 10-byte keys, generated
deterministically from a seed by each mapper; every variant's output is validated like gensort's
valsort (each partition sorted, partitions in key order, the same record count and
order-independent checksum as the input). The cluster's DRAM is capped (``--dram``, 2 GiB in
all by default) with a large NVMe server beside it, so that at 4 and 10 GB most bytes go to
NVMe; the tiers' split is reported.

Variants (``--variants``, all by default):

- ``pocketflow-ray``: :func:`pocketflow_lithops.shuffle.shuffle` on Ray tasks
  (:class:`~pocketflow_lithops.shuffle_executors.RayShuffleExecutor`), PERSIST outputs.
- ``pocketflow-lithops``: the same shuffle on Lithops' localhost executor with pocketflow's
  runtime.
- ``ray-data``: ``ray.data`` ``sort`` of the same records on the same Ray cluster (what a Ray
  user would pick); ``ray[data]`` comes with the ``bench`` extra; without it this peer is reported
  skipped.
- ``lithops-localhost``: mappers and reducers on Lithops' localhost executor shuffling through
  its localhost storage (files), as in :mod:`benchmarks.lithops_sort`.
- ``lithops-redis``: the same through Lithops' redis backend on a redis-server started here,
  only when twice the input fits in ``--redis-max`` (default 2 GiB).

Tasks at once: ``WORKERS`` (the cores) for every variant. With ``--storage-tasks-extra N``
(default 0), where the shuffle's job holds much of its data on NVMe (at 4 and 10 GB with DRAM
capped), pocketflow-ray's executor also runs reducers, which mostly wait on the device, in N
extra slots, and the Lithops variants get N more worker processes (the same most tasks at
once: Lithops' only knob); Ray Data schedules its own tasks on the cluster's ``WORKERS`` CPUs.
Each run reports its number.

Each variant first sorts ``WARMUP_BYTES`` once, unreported (workers and frameworks start
there), and each Lithops executor, made per run, runs one call before its timed jobs. What the
job time covers: generating, partitioning, shuffling and sorting the records, for every variant
with the same record functions of :mod:`pocketflow.demo`; for pocketflow also the job's
registration and deregistration; for the pocketflow and Lithops variants also the input's
checksum, which their mappers compute (some 15 ms of CPU per 32 MiB mapper) and Ray Data's
driver computes apart. Reading the output back to validate it is timed apart. Per run: job time,
GB/s of input sorted, per-phase times (map; shuffle writes = mappers' time writing partitions; reads
= reducers' time reading inputs and writing outputs, and of it the outputs' writes; reducers' time
sorting; reducers' time parked for inputs; validation), peak storage-server RSS (sum of ``VmRSS``
over the server processes), peak DRAM and NVMe bytes held, and every tier's bytes in and out per
second over time (the servers' ``stats``, sampled every ``SAMPLE_INTERVAL_S``), plotted per size
into a PNG.
For the pocketflow variants also, in the map phase and after it, the busy time of the block device
under the cluster's work directory (where the NVMe server's file is: the kernel's ``io_ticks``)
and the machine's busy CPU time, both machine-wide (every process's): on a quiet machine they
say how far the job's computing and its device I/O overlap (:func:`busy_shares`), split by kind
(user, system, interrupts, steal, I/O wait, the kernel's threads); and per group of the run's
own processes, load or not, their CPU per GB, page faults, and their main threads' time on a
core and waiting for one (:func:`process_cpu`). ``--object-size`` shapes each sort by the size
of its shuffle's objects instead of one mapper per 32 MiB (:func:`sort_config`).
Results go to ``benchmarks/results/sort-scale-<date>-<sizes>.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle
import ray.cloudpickle

from benchmarks.machine import (
    ProcessScan,
    git_commit,
    machine,
    machine_busy_cpu_s,
    machine_cpu_split_s,
    now_iso,
    package_versions,
    scan_processes,
    today,
)
from pocketflow.config import parse_size
from pocketflow.demo import (
    _MASK64,
    MapResult,
    PartitionCheck,
    SortConfig,
    check_output,
    describe_partition,
    format_bytes,
    generate_records,
    map_records,
    record_checksum,
    reduce_records,
)
from pocketflow.errors import ConfigError

# Neither Ray's nor Lithops' workers can import ``benchmarks`` from every working directory.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

RESULTS_DIR = Path(__file__).resolve().parent / "results"
VARIANTS = ("pocketflow-ray", "pocketflow-lithops", "ray-data", "lithops-localhost",
            "lithops-redis")
SAMPLE_INTERVAL_S = 0.5
"""Pause between two samples of the servers' stats and RSS."""
SAMPLES_MAX = 100_000
"""Most samples one run keeps."""
BYTES_PER_MAPPER = 32 * 1024 * 1024
"""Input bytes per mapper (reducers: half as many as mappers), as the issue's 1 GB demo."""
TASKS_MAX = 4096
"""Most mappers of one sort (the shuffle's bound per stage)."""
WORKERS = 2
"""Tasks at once (Ray tasks, Lithops worker processes): the machine's cores."""
SPEEDUP_GOAL = 1.5
"""pocketflow's job time against the fastest of Ray Data and Lithops' localhost storage."""
LINEARITY_GOAL = 1.3
"""Time per GB at the largest size over time per GB at the smallest, at most."""
WARMUP_BYTES = 2_000_000
"""Input of each variant's unreported first sort."""
STAGE_TIMEOUT_S = 6 * 3600.0
"""Bound on one stage of one run."""
SETTLE_TIMEOUT_S = 10.0
"""Most a pocketflow run waits, before its job registers, for the control plane to see the
servers' bytes as they are (several heartbeats)."""
SETTLE_SLACK_BYTES = 1024 * 1024
"""How far the control plane's view of a server's used bytes may be from the server's own."""


def sort_config(input_bytes: int, seed: int = 42, *,
                object_bytes: int | None = None) -> SortConfig:
    """The sort of ``input_bytes`` of records, half as many reducers as mappers: one mapper per
    ``BYTES_PER_MAPPER``; or, with ``object_bytes``, as many mappers as make the shuffle's
    (mapper, reducer) objects about that size (``mappers * reducers * object_bytes`` is the
    input: the mappers grow as the square root of the input, and the objects as the input)."""
    if object_bytes is None:
        mappers = input_bytes // BYTES_PER_MAPPER
    else:
        mappers = math.isqrt(2 * input_bytes // object_bytes)
    mappers = max(2, min(TASKS_MAX, mappers))
    return SortConfig(mappers=mappers, reducers=max(2, mappers // 2),
                      records=input_bytes // 100, seed=seed, processes=WORKERS)


# -- sampling the servers ----------------------------------------------------------------------


TIER_COUNTERS = ("received_bytes", "sent_bytes")
"""Cumulative per-tier counters each sample carries: bytes the tier's servers received and sent
(their ``stats``). On the NVMe tier every byte received is written to the device and every byte
sent was read from it (O_DIRECT: no page cache in between), so these are its device's traffic.
They count work, not time: the same on a loaded machine as on a quiet one."""


def _value_at(points: list[tuple[float, float]], t_s: float) -> float:
    """A cumulative counter's value at ``t_s``, interpolated linearly between the samples
    ``(t_s, value)`` around it (the first or last value outside them)."""
    if t_s <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in zip(points, points[1:], strict=False):
        if t_s <= t1:
            return v0 + (v1 - v0) * ((t_s - t0) / (t1 - t0) if t1 > t0 else 1.0)
    return points[-1][1]


def tier_bytes(samples: list[dict[str, Any]], split_s: float) -> dict[str, dict[str, Any]]:
    """Each tier's counters (:data:`TIER_COUNTERS`) over ``samples``: ``before`` the instant
    ``split_s`` after the first sample (the map phase's end), ``after`` it, and in ``all``;
    the cumulative counters are interpolated linearly at ``split_s`` between the two samples
    around it."""
    if len(samples) < 2:
        return {}

    def at(tier: str, counter: str, t_s: float) -> float:
        points = [(s["t_s"], s["tiers"].get(tier, {}).get(counter, 0.0)) for s in samples]
        return _value_at(points, t_s)

    start, end = samples[0]["t_s"], samples[-1]["t_s"]
    split = min(max(start + split_s, start), end)
    tiers = sorted({t for s in samples for t in s["tiers"]})
    return {
        tier: {
            phase: {c: int(at(tier, c, b) - at(tier, c, a)) for c in TIER_COUNTERS}
            for phase, (a, b) in (("before", (start, split)), ("after", (split, end)),
                                  ("all", (start, end)))
        }
        for tier in tiers
    }


CPU_SPLIT_COUNTERS = ("user_s", "system_s", "irq_s", "steal_s", "iowait_s")
"""The machine's CPU time by kind (:func:`benchmarks.machine.machine_cpu_split_s`)."""
BUSY_COUNTERS = ("device_busy_s", "cpu_busy_s", "kernel_threads_s", *CPU_SPLIT_COUNTERS)
"""Machine-wide busy times each sample holds (cumulative seconds; absent where unknown)."""


def busy_shares(samples: list[dict[str, Any]], split_s: float) -> dict[str, dict[str, float]]:
    """Per phase (``before``/``after`` the instant ``split_s`` after the first sample, as
    :func:`tier_bytes`, and ``all``): its wall seconds and, for each of
    :data:`BUSY_COUNTERS` that every sample holds, the busy seconds in it."""
    if len(samples) < 2:
        return {}
    start, end = samples[0]["t_s"], samples[-1]["t_s"]
    split = min(max(start + split_s, start), end)
    counters = [c for c in BUSY_COUNTERS if all(s.get(c) is not None for s in samples)]
    shares: dict[str, dict[str, float]] = {}
    for phase, (a, b) in (("before", (start, split)), ("after", (split, end)),
                          ("all", (start, end))):
        row = {"wall_s": b - a}
        for counter in counters:
            points = [(s["t_s"], float(s[counter])) for s in samples]
            row[counter] = _value_at(points, b) - _value_at(points, a)
        shares[phase] = row
    return shares


def device_stat_path(path: Path) -> Path | None:
    """The kernel's I/O statistics file of the block device holding ``path``, or ``None`` where
    there is none (a file system on no block device: tmpfs, overlay)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return stat if stat.is_file() else None


def _device_busy_s(stat: Path | None) -> float | None:
    """The device's ``io_ticks``: milliseconds it had I/O in flight, as seconds."""
    if stat is None:
        return None
    try:
        return int(stat.read_text().split()[9]) / 1000.0
    except (OSError, IndexError, ValueError):
        return None


def _cpu_busy_s() -> float | None:
    """:func:`benchmarks.machine.machine_busy_cpu_s`, or None where it cannot be read."""
    try:
        return machine_busy_cpu_s()
    except OSError:
        return None


PROCESS_COUNTERS = ("user_s", "system_s", "minor_faults", "main_cpu_s", "run_delay_s",
                    "threads_run_delay_s")
"""Per group of processes (:func:`process_group`), what :func:`process_cpu` reports
(:attr:`benchmarks.machine.ProcessScan.times`)."""


def process_group(pid: int, command: str, *, servers: dict[int, str], driver: int) -> str:
    """The group of this run's process ``pid`` (command line ``command``): ``<tier> servers``,
    ``task workers`` (Ray workers running the shuffle's or Ray Data's tasks), ``actors``
    (pocketflow's control-plane actors), ``raylet``, ``gcs``, ``driver`` (this process), or
    ``other`` (Ray's dashboard and monitors, Lithops' workers)."""
    if pid in servers:
        return f"{servers[pid]} servers"
    if pid == driver:
        return "driver"
    if "default_worker.py" in command:
        # A Ray worker before it names itself (``ray::IDLE``, ``ray::<actor>``): its group is
        # the one of its latest sample (see :func:`process_cpu`).
        return "task workers"
    if command.startswith("ray::"):
        name = (command[5:].split(None, 1)[0] if len(command) > 5 else "").split(".", 1)[0]
        if name in RAY_AGENT_NAMES:
            return "other"
        return "actors" if name in ACTOR_NAMES else "task workers"
    program = command.split(None, 1)[0] if command else ""
    if program.endswith("raylet"):
        return "raylet"
    if "gcs_server" in command:
        return "gcs"
    return "other"


ACTOR_NAMES = ("Controller", "Metadata", "StorageNode")
"""Ray actor classes of pocketflow's control plane (their workers' titles start with these)."""
RAY_AGENT_NAMES = ("RuntimeEnvAgent", "DashboardAgent")
"""Ray's own per-node agents, whose titles also start with ``ray::``."""


def process_cpu(samples: list[dict[str, Any]], split_s: float) -> dict[str, dict[str, Any]]:
    """Per phase (``before``/``after``/``all`` as :func:`tier_bytes`), per process group, the
    CPU seconds (user, system), minor page faults, and main threads' CPU and run delay of its
    processes, from samples holding ``{"t_s", "procs": {pid: [group, *PROCESS_COUNTERS]}}``. A
    process first seen in a later sample started after the one before it (counted from zero
    there); one gone keeps its last reading. A process counts in the group of its latest
    sample (a Ray worker names itself once it starts)."""
    if len(samples) < 2:
        return {}
    start, end = samples[0]["t_s"], samples[-1]["t_s"]
    split = min(max(start + split_s, start), end)
    points: dict[int, list[tuple[float, list[Any]]]] = {}
    groups: dict[int, str] = {}
    previous_t = start
    for sample in samples:
        for pid, (group, *values) in sample["procs"].items():
            groups[pid] = group
            if pid not in points:
                points[pid] = ([] if sample is samples[0] else
                               [(previous_t, [0.0] * len(PROCESS_COUNTERS))])
            points[pid].append((sample["t_s"], values))
        previous_t = sample["t_s"]
    out: dict[str, dict[str, Any]] = {}
    for phase, (a, b) in (("before", (start, split)), ("after", (split, end)),
                          ("all", (start, end))):
        rows: dict[str, Any] = {}
        for pid, series in points.items():
            row = rows.setdefault(groups[pid], {c: 0.0 for c in PROCESS_COUNTERS})
            for i, counter in enumerate(PROCESS_COUNTERS):
                line = [(t, float(v[i])) for t, v in series]
                row[counter] += _value_at(line, b) - _value_at(line, a)
        out[phase] = rows
    return out


SPLIT_COLUMNS = (*CPU_SPLIT_COUNTERS, "kernel_threads_s")
"""The busy table's columns after the busy shares."""


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TierSampler:
    """Samples every storage server's stats (tier, used bytes, bytes in/out per second) and the
    servers' RSS: once on entry, in a thread every ``SAMPLE_INTERVAL_S``, and once on exit, at
    most ``SAMPLES_MAX`` times in all."""

    def __init__(self, cluster: Any) -> None:
        from pocketflow.control.admin import AdminTokens

        self._tokens = AdminTokens(cluster.secret, tls_ca=cluster.tls_ca)
        self._servers = list(cluster.servers)
        self._device = device_stat_path(cluster.work_dir)
        self._server_tiers = {s.server_pid: s.tier for s in self._servers}
        self._driver = os.getpid()
        self.process_samples: list[dict[str, Any]] = []
        """Per sample, the CPU of every process below this one (:func:`process_cpu`)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tier-sampler", daemon=True)
        self.started = time.monotonic()
        self.samples: list[dict[str, Any]] = []
        self.errors = 0

    def __enter__(self) -> TierSampler:
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        # A run shorter than one interval still has its start and its end.
        self._take()

    def _take(self) -> None:
        try:
            scan = scan_processes(self._driver)
            self.samples.append(self._sample(scan))
            self.process_samples.append({"t_s": self.samples[-1]["t_s"],
                                         "procs": self._processes(scan)})
        except Exception:  # noqa: BLE001 - a failed sample must not end the run
            self.errors += 1

    def _processes(self, scan: ProcessScan) -> dict[int, list[Any]]:
        procs: dict[int, list[Any]] = {}
        for pid, times in scan.times.items():
            group = process_group(pid, scan.commands[pid], servers=self._server_tiers,
                                  driver=self._driver)
            procs[pid] = [group, *times]
        return procs

    def _run(self) -> None:
        while len(self.samples) < SAMPLES_MAX - 1 and not self._stop.wait(SAMPLE_INTERVAL_S):
            self._take()

    def _sample(self, scan: ProcessScan) -> dict[str, Any]:
        tiers: dict[str, dict[str, float]] = {}
        for server in self._servers:
            stats = self._tokens.client(server.address).stats()
            tier = tiers.setdefault(
                str(stats["tier"]),
                {"used_bytes": 0.0, "in_per_s": 0.0, "out_per_s": 0.0,
                 **{c: 0.0 for c in TIER_COUNTERS}})
            tier["used_bytes"] += float(stats["used_bytes"])
            tier["in_per_s"] += float(stats.get("bytes_in_per_s") or 0.0)
            tier["out_per_s"] += float(stats.get("bytes_out_per_s") or 0.0)
            tier["received_bytes"] += float(stats.get("received_bytes_total") or 0.0)
            tier["sent_bytes"] += float(stats.get("sent_bytes_total") or 0.0)
        rss = sum(scan.rss_bytes[s.server_pid] if s.server_pid in scan.rss_bytes
                  else _rss_bytes(s.server_pid) for s in self._servers)
        return {"t_s": time.monotonic() - self.started, "tiers": tiers, "rss_bytes": rss,
                "device_busy_s": _device_busy_s(self._device), "cpu_busy_s": _cpu_busy_s(),
                "kernel_threads_s": scan.kernel_threads_s, **machine_cpu_split_s()}

    def peak(self, tier: str) -> int:
        """Most bytes the tier held in any sample."""
        return int(max((s["tiers"].get(tier, {}).get("used_bytes", 0) for s in self.samples),
                       default=0))

    def peak_rss(self) -> int:
        return max((s["rss_bytes"] for s in self.samples), default=0)


# -- variants ------------------------------------------------------------------------------------


@dataclass
class Run:
    """One variant's run at one size."""

    variant: str
    input_bytes: int
    job_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=dict)
    peak_dram_bytes: int = 0
    peak_nvme_bytes: int = 0
    peak_server_rss_bytes: int = 0
    timeline: list[dict[str, Any]] = field(default_factory=list)
    tier_bytes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per tier, bytes its servers received and sent, in the map phase
    (``before``), after it and in ``all`` (:func:`tier_bytes`). The split is the shuffle's
    ``map_s`` after the sampler's first sample, which precedes the map phase by the job's
    registration (a fraction of a second), so the map phase's figures miss its last moment."""
    busy: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per phase as ``tier_bytes``, wall seconds and the machine's busy seconds
    (:func:`busy_shares`)."""
    process_cpu: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per phase as ``tier_bytes``, per group of this run's processes, their user and system
    CPU seconds and minor page faults (:func:`process_cpu`)."""
    ok: bool = False
    skipped: str = ""
    problems: list[str] = field(default_factory=list)
    tasks_max: int = 0
    """Most of its tasks the variant may run at once (see :func:`tasks_in_flight`)."""

    @property
    def gb_per_s(self) -> float:
        return self.input_bytes / 1e9 / self.job_s if self.job_s else 0.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _validate(config: SortConfig, maps: list[MapResult], checks: list[PartitionCheck]) -> list[str]:
    problems = check_output(config, input_checksum=sum(m.checksum for m in maps) & _MASK64,
                            checks=checks)
    if sum(m.records for m in maps) != config.records:
        problems.append("mappers generated the wrong number of records")
    return problems


def wait_for_settled_usage(cluster: Any, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Wait until the control plane's view of every server's used bytes (its latest heartbeat)
    is the server's own, at most ``timeout_s``; whether it is.

    A job is packed on the free bytes the control plane sees: registered right after the
    previous run deleted its outputs, it would see them still there and get a smaller DRAM
    share (a 2 GB sort after another got half of the DRAM share of one on a settled cluster).
    """
    from pocketflow.control.admin import AdminTokens

    tokens = AdminTokens(cluster.secret, tls_ca=cluster.tls_ca)
    deadline = time.monotonic() + timeout_s
    while True:
        own = {s.node_id: int(tokens.client(s.address).stats()["used_bytes"])
               for s in cluster.servers}
        seen = {row["node_id"]: int(row.get("used_bytes", -1))
                for row in cluster.status()["servers"]}
        if all(abs(seen.get(node, -1) - used) <= SETTLE_SLACK_BYTES
               for node, used in own.items()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def run_pocketflow(variant: str, executor: Any, config: SortConfig, cluster: Any) -> Run:
    """The sort through :func:`~pocketflow_lithops.shuffle.shuffle` on ``executor``, once the
    control plane sees the servers' bytes as they are (:func:`wait_for_settled_usage`)."""
    from pocketflow_lithops.shuffle import shuffle
    from pocketflow_lithops.sort import _validate as validate_outputs

    import pocketflow

    run = Run(variant, config.input_bytes)
    if not wait_for_settled_usage(cluster):
        print(f"  {variant}: the control plane's view of the servers' bytes did not settle "
              f"within {SETTLE_TIMEOUT_S} s", flush=True)
    with TierSampler(cluster) as sampler:
        started = time.perf_counter()
        result = shuffle(executor, functools.partial(map_records, config), reduce_records,
                         range(config.mappers), reducers=config.reducers, cluster=cluster,
                         name=f"sort-scale-{variant}", input_size_bytes=config.input_bytes,
                         persist_output=True, timeout_s=STAGE_TIMEOUT_S)
        run.job_s = time.perf_counter() - started
    validating = time.perf_counter()
    checks = validate_outputs(executor, result.handle_json, result.outputs, STAGE_TIMEOUT_S)
    run.phase_s = {
        "map": result.map_s,
        "shuffle_writes_per_mapper": _mean(result.map_io_s),
        "reads_per_reducer": _mean(result.io_s),
        "reducer_parked_per_reducer": _mean(result.input_wait_s),
        "reduce_per_reducer": _mean(result.reduce_s),
        "output_write_per_reducer": _mean(result.output_write_s),
        "shuffle_and_reduce": result.elapsed_s - result.map_s,
        "validate": time.perf_counter() - validating,
    }
    with pocketflow.connect(result.handle_json) as pf:
        for output in result.outputs:
            pf.delete(output.bucket, output.key)
    run.problems = _validate(config, result.map_values, checks)
    run.ok = not run.problems
    run.peak_dram_bytes, run.peak_nvme_bytes = sampler.peak("dram"), sampler.peak("nvme")
    run.peak_server_rss_bytes = sampler.peak_rss()
    run.timeline = sampler.samples
    run.tier_bytes = tier_bytes(sampler.samples, result.map_s)
    run.busy = busy_shares(sampler.samples, result.map_s)
    run.process_cpu = process_cpu(sampler.process_samples, result.map_s)
    return run


def _fixed_binary(values: Any, width: int) -> Any:
    """A ``(n, width)`` uint8 array as an Arrow fixed-size binary column, without a copy per
    value (a Python ``bytes`` per record would make Ray Data's side slow for our sake)."""
    import numpy as np
    import pyarrow as pa

    flat = np.ascontiguousarray(values)
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), flat.shape[0],
                                                [None, pa.py_buffer(flat)])


def _ray_data_generate(config: SortConfig, batch: dict[str, Any]) -> Any:
    """Ray Data: the records of the mappers in ``batch["id"]``, as key and record columns."""
    import numpy as np
    import pyarrow as pa

    records = np.concatenate([generate_records(config, int(m)) for m in batch["id"]])
    return pa.table({"key": _fixed_binary(records[:, :10], 10),
                     "record": _fixed_binary(records, 100)})


def _ray_data_describe(batch: Any) -> dict[str, Any]:
    """Ray Data: one block of the sorted output (an Arrow table) as a partition check."""
    column = batch.column("record").combine_chunks()
    buffer = column.buffers()[1]
    data = memoryview(buffer)[column.offset * 100:(column.offset + len(column)) * 100]
    check = describe_partition(0, data)
    return {"records": [check.records], "checksum": [str(check.checksum)],
            "is_sorted": [check.is_sorted], "first_key": [check.first_key or b""],
            "last_key": [check.last_key or b""]}


def run_ray_data(config: SortConfig) -> Run:
    """``ray.data`` ``sort`` of the same records on the same Ray cluster, validated per block."""
    run = Run("ray-data", config.input_bytes)
    try:
        import ray.data
    except ImportError as exc:
        run.skipped = f"ray.data cannot be imported ({exc}): pip install 'ray[data]'"
        return run
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    started = time.perf_counter()
    sorted_ds = (ray.data.range(config.mappers, override_num_blocks=config.mappers)
                 .map_batches(functools.partial(_ray_data_generate, config), batch_size=1,
                              batch_format="numpy")
                 .sort("key")
                 .materialize())
    run.job_s = time.perf_counter() - started
    validating = time.perf_counter()
    rows = sorted_ds.map_batches(_ray_data_describe, batch_size=None,
                                 batch_format="pyarrow").take_all()
    run.phase_s = {"validate": time.perf_counter() - validating}
    checks = [PartitionCheck(reducer=i, records=int(r["records"]), checksum=int(r["checksum"]),
                             is_sorted=bool(r["is_sorted"]),
                             first_key=bytes(r["first_key"]) or None,
                             last_key=bytes(r["last_key"]) or None, bytes_read=0)
              for i, r in enumerate(row for row in rows if int(row["records"]))]
    # Blocks, not reducers: validate as that many partitions of the same records.
    shaped = SortConfig(mappers=config.mappers, reducers=max(1, len(checks)),
                        records=config.records, seed=config.seed)
    expected = sum(record_checksum(generate_records(config, m))
                   for m in range(config.mappers)) & _MASK64
    run.problems = check_output(shaped, input_checksum=expected, checks=checks)
    run.ok = not run.problems
    return run


def run_lithops_storage(variant: str, fexec: Any, config: SortConfig,
                        sample: Callable[[str], int]) -> Run:
    """:mod:`benchmarks.lithops_sort`'s shuffle through Lithops' own storage."""
    from benchmarks.lithops_sort import run_storage_variant

    done = run_storage_variant(variant, fexec, config, sample)
    run = Run(variant, config.input_bytes, job_s=done.job_s, ok=done.ok, problems=done.problems)
    run.phase_s = {"shuffle_writes_per_mapper": _mean(done.map_io_s),
                   "reads_per_reducer": _mean(done.reduce_io_s)}
    return run


# -- the run -------------------------------------------------------------------------------------


def run(sizes: list[int], variants: tuple[str, ...], out_dir: Path, *, dram_bytes: int,
        nvme_bytes: int, redis_max_bytes: int, object_store_bytes: int,
        storage_tasks_extra: int = 0, object_bytes: int | None = None) -> dict[str, Any]:
    """Every variant at every size, one after the other; JSON, Markdown and a PNG."""
    import pocketflow

    started_iso, started = now_iso(), time.perf_counter()
    cluster_shape = {"dram_servers": 2, "dram_capacity": dram_bytes // 2, "nvme_servers": 1,
                     "nvme_capacity": nvme_bytes, "num_cpus": WORKERS,
                     "object_store_memory": object_store_bytes}
    with pocketflow.LocalCluster(**cluster_shape) as cluster:
        runs = run_sizes(cluster, sizes, variants, redis_max_bytes=redis_max_bytes,
                         warmup_bytes=WARMUP_BYTES, storage_tasks_extra=storage_tasks_extra,
                         object_bytes=object_bytes)
    results = report(runs, sizes, variants, cluster_shape=cluster_shape,
                     redis_max_bytes=redis_max_bytes, started_iso=started_iso,
                     storage_tasks_extra=storage_tasks_extra, object_bytes=object_bytes,
                     duration_s=time.perf_counter() - started)
    write(results, runs, out_dir)
    return results


def report(runs: list[Run], sizes: list[int], variants: tuple[str, ...], *,
           cluster_shape: dict[str, Any], redis_max_bytes: int, started_iso: str,
           duration_s: float, storage_tasks_extra: int = 0,
           object_bytes: int | None = None) -> dict[str, Any]:
    """The results document of ``runs``."""
    return {
        "benchmark": "sort-scale",
        "started": started_iso,
        "duration_s": round(duration_s, 1),
        "commit": git_commit(),
        "machine": machine(),
        "versions": package_versions(("pocketflow", "ray", "lithops", "redis", "numpy")),
        "config": {"sizes": sizes, "variants": list(variants), "cluster": cluster_shape,
                   "bytes_per_mapper": BYTES_PER_MAPPER, "workers": WORKERS,
                   "storage_tasks_extra": storage_tasks_extra, "object_bytes": object_bytes,
                   "shapes": {str(size): [c.mappers, c.reducers] for size in sizes
                              for c in [sort_config(size, object_bytes=object_bytes)]},
                   "redis_max_bytes": redis_max_bytes, "sample_interval_s": SAMPLE_INTERVAL_S},
        "summary": summarize(runs, sizes),
        "runs": [asdict(r) | {"gb_per_s": r.gb_per_s} for r in runs],
    }


def write(results: dict[str, Any], runs: list[Run], out_dir: Path) -> Path:
    """The results as JSON, Markdown and a PNG in ``out_dir``; returns the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = results["config"]["sizes"]
    stem = f"sort-scale-{today()}-" + "-".join(format_bytes(s).replace(" ", "") for s in sizes)
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(results))
    plot(runs, out_dir / f"{stem}.png")
    print(f"wrote {out_dir / stem}.json, .md and .png")
    return out_dir / f"{stem}.json"


def run_sizes(cluster: Any, sizes: list[int], variants: tuple[str, ...], *,
              redis_max_bytes: int, warmup_bytes: int = 0,
              storage_tasks_extra: int = 0, object_bytes: int | None = None) -> list[Run]:
    """Every variant at every size on ``cluster``, one after the other; with ``warmup_bytes``,
    each variant first sorts that much once, unreported (its workers, Ray Data's and Lithops'
    machinery start there, not in the first measured run)."""
    for variant in variants if warmup_bytes else ():
        _run_variant(variant, sort_config(warmup_bytes), cluster, redis_max_bytes,
                     storage_tasks_extra)
    runs: list[Run] = []
    for size in sizes:
        config = sort_config(size, object_bytes=object_bytes)
        for variant in variants:
            try:
                done = _run_variant(variant, config, cluster, redis_max_bytes,
                                    storage_tasks_extra)
            except Exception as exc:  # noqa: BLE001 - one variant's failure is its result
                done = Run(variant, config.input_bytes,
                           problems=[f"failed: {type(exc).__name__}: {exc}"])
            runs.append(done)
            print(f"  {format_bytes(size):>9s} {variant:20s} "
                  + (f"skipped: {done.skipped}" if done.skipped else
                     f"job {done.job_s:8.2f} s, {done.gb_per_s:6.3f} GB/s, "
                     f"{'OK' if done.ok else 'FAILED ' + '; '.join(done.problems)}"),
                  flush=True)
    return runs


def tasks_in_flight(cluster: Any, config: SortConfig, storage_tasks_extra: int) -> int:
    """Most tasks at once for a sort of ``config`` on ``cluster``: ``WORKERS``, and where the
    shuffle's job would hold much of its data on NVMe (its weight map, from a job registered
    here with the shuffle's hints, outside every timing), ``storage_tasks_extra`` more: the Ray
    executor's extra slots for reducers waiting on storage. pocketflow-ray's executor decides
    that itself; the Lithops variants get that many worker processes, so that no variant runs
    more tasks at once than another. Ray Data schedules its own tasks on the cluster's CPUs
    (``WORKERS``)."""
    if not storage_tasks_extra:
        return WORKERS
    from pocketflow_lithops.shuffle import shuffle_data_bytes, shuffle_hints
    from pocketflow_lithops.shuffle_tasks import data_on_nvme

    from pocketflow.job import register_job

    hints = shuffle_hints(config.mappers, config.reducers, shuffle_data_bytes(
        config.input_bytes, persist_output=True, delete_inputs=True))
    with register_job("sort-scale-probe", hints, cluster=cluster) as job:
        on_nvme = data_on_nvme(job.handle)
    return WORKERS + storage_tasks_extra if on_nvme else WORKERS


def _noop(value: int) -> int:
    return value


def _warm_up(fexec: Any) -> None:
    """One call on a new Lithops executor before its timed jobs, so that nothing an executor
    does once is timed, as the Ray variants run on a warm cluster (on this machine a fresh
    executor's first job was not measurably slower than its next: 0.7-0.8 s against 0.7-1.3 s
    for two empty calls, under load)."""
    fexec.get_result(fexec.map(_noop, [0]))


def _run_variant(variant: str, config: SortConfig, cluster: Any, redis_max_bytes: int,
                 storage_tasks_extra: int = 0) -> Run:
    workers = (WORKERS if variant == "ray-data" else
               tasks_in_flight(cluster, config, storage_tasks_extra))
    done = _run_variant_with(variant, config, cluster, redis_max_bytes, workers,
                             storage_tasks_extra)
    done.tasks_max = workers
    return done


def _run_variant_with(variant: str, config: SortConfig, cluster: Any, redis_max_bytes: int,
                      workers: int, storage_tasks_extra: int) -> Run:
    if variant == "pocketflow-ray":
        from pocketflow_lithops.shuffle_executors import RayShuffleExecutor

        # WORKERS computing tasks, and the extra slots for reducers of a job on NVMe.
        return run_pocketflow(variant, RayShuffleExecutor(
            tasks_max=WORKERS, storage_tasks_extra=storage_tasks_extra), config, cluster)
    if variant == "ray-data":
        return run_ray_data(config)
    if variant == "lithops-redis" and 2 * config.input_bytes > redis_max_bytes:
        return Run(variant, config.input_bytes,
                   skipped=f"twice the input does not fit in {format_bytes(redis_max_bytes)}")
    import lithops
    from lithops.constants import LITHOPS_TEMP_DIR

    from benchmarks.lithops_sort import dir_bytes
    from pocketflow.demo import lithops_config

    if variant == "pocketflow-lithops":
        from pocketflow_lithops.runtime import runtime_path

        with lithops.FunctionExecutor(config=lithops_config(
                storage="localhost", workers=workers, runtime=runtime_path())) as fexec:
            try:
                _warm_up(fexec)
                return run_pocketflow(variant, fexec, config, cluster)
            finally:
                fexec.clean()
    if variant == "lithops-localhost":
        root = Path(LITHOPS_TEMP_DIR) / "storage"
        with lithops.FunctionExecutor(config=lithops_config(storage="localhost",
                                                            workers=workers)) as fexec:
            try:
                _warm_up(fexec)
                return run_lithops_storage(variant, fexec, config,
                                           lambda prefix: dir_bytes(root / prefix))
            finally:
                fexec.clean()
    import redis

    from benchmarks.peers import RedisPeer

    peer = RedisPeer()
    peer.start()
    try:
        port = peer.spec().port
        client = redis.Redis(host="127.0.0.1", port=port)
        from pocketflow_lithops.executor_data import NO_CLEANER, delete_executor_data

        # Its data is deleted here, before the redis-server stops: a request left to Lithops'
        # cleaner would outlive that server.
        with lithops.FunctionExecutor(config=lithops_config(
                storage="redis", workers=workers,
                extra={"redis": {"host": "127.0.0.1", "port": port}, **NO_CLEANER})) as fexec:
            try:
                _warm_up(fexec)
                return run_lithops_storage(
                    variant, fexec, config,
                    lambda _prefix: int(client.info("memory")["used_memory"]))
            finally:
                delete_executor_data(fexec)
    finally:
        peer.stop()


def summarize(runs: list[Run], sizes: list[int]) -> dict[str, Any]:
    """Per size: each variant's job time and GB/s, pocketflow's speedup over the fastest peer;
    across sizes: time per GB at the largest size over the smallest."""
    summary: dict[str, Any] = {}
    for size in sizes:
        mine = {r.variant: r for r in runs if r.input_bytes == size and not r.skipped}
        row: dict[str, Any] = {v: {"job_s": r.job_s, "gb_per_s": r.gb_per_s, "ok": r.ok}
                               for v, r in mine.items()}
        ours = [mine[v].job_s for v in ("pocketflow-ray", "pocketflow-lithops")
                if v in mine and mine[v].ok]
        peers = [mine[v].job_s for v in ("ray-data", "lithops-localhost")
                 if v in mine and mine[v].ok]
        if ours and peers:
            row["speedup_vs_fastest_peer"] = min(peers) / min(ours)
            row["speedup_met"] = row["speedup_vs_fastest_peer"] >= SPEEDUP_GOAL
        summary[str(size)] = row
    for variant in ("pocketflow-ray", "pocketflow-lithops"):
        timed = sorted((r.input_bytes, r.job_s) for r in runs
                       if r.variant == variant and r.ok and r.job_s)
        if len(timed) >= 2:
            (small, small_s), (large, large_s) = timed[0], timed[-1]
            ratio = (large_s / large) / (small_s / small)
            summary[f"{variant}_time_per_gb_ratio"] = ratio
            summary[f"{variant}_linear_met"] = ratio <= LINEARITY_GOAL
    return summary


def markdown(results: dict[str, Any]) -> str:
    """The results as a Markdown report."""
    cfg, m = results["config"], results["machine"]
    lines = [
        "# Sorts at scale: pocketflow on Ray and Lithops against Ray Data, Lithops storage, "
        "Redis",
        "",
        f"- commit `{(results['commit']['commit'] or '?')[:12]}`, {results['started']}, "
        f"{results['duration_s']} s; {m['cpu_model']}, {m['cores']} cores, load average "
        f"{m['load_avg_1m_at_start']:.2f} at start",
        f"- cluster: {json.dumps(cfg['cluster'])}; {cfg['workers']} computing tasks at once, "
        f"{cfg.get('storage_tasks_extra', 0)} extra slots for reducers of a job on NVMe; "
        "tasks: most tasks of the variant at once (the Lithops variants: as many worker "
        "processes)",
        "- shape (mappers x reducers) per size: "
        + ", ".join(f"{format_bytes(int(size))}: {m} x {r}"
                    for size, (m, r) in cfg.get("shapes", {}).items())
        + (f" (objects of about {format_bytes(cfg['object_bytes'])})"
           if cfg.get("object_bytes") else " (one mapper per 32 MiB)"),
        "",
        "| size | variant | tasks | job s | GB/s | map s | writes/mapper s | reads/reducer s | "
        "of which output write s | sort/reducer s | parked/reducer s | peak DRAM | peak NVMe | "
        "peak server RSS | valid |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        if r["skipped"]:
            lines.append(f"| {format_bytes(r['input_bytes'])} | {r['variant']} | | skipped: "
                         f"{r['skipped']} |||||||||||| |")
            continue
        p = r["phase_s"]
        lines.append(
            f"| {format_bytes(r['input_bytes'])} | {r['variant']} | {r.get('tasks_max', '')} | "
            f"{r['job_s']:.2f} | "
            f"{r['gb_per_s']:.3f} | {p.get('map', 0):.2f} | "
            f"{p.get('shuffle_writes_per_mapper', 0):.3f} | {p.get('reads_per_reducer', 0):.3f} | "
            f"{p.get('output_write_per_reducer', 0):.3f} | {p.get('reduce_per_reducer', 0):.3f} | "
            f"{p.get('reducer_parked_per_reducer', 0):.3f} | "
            f"{format_bytes(r['peak_dram_bytes'])} | {format_bytes(r['peak_nvme_bytes'])} | "
            f"{format_bytes(r['peak_server_rss_bytes'])} | {'yes' if r['ok'] else 'NO'} |")
    tiered = [r for r in results["runs"] if r.get("tier_bytes")]
    if tiered:
        lines += ["", "Bytes per tier, in the map phase / after it (on NVMe: the device's writes "
                  "and reads):", "", "| size | variant | tier | received | sent |",
                  "|---|---|---|---|---|"]
    for r in tiered:
        for tier, phases in r["tier_bytes"].items():
            cells = [" / ".join(format_bytes(phases[phase][counter])
                                for phase in ("before", "after"))
                     for counter in TIER_COUNTERS]
            lines.append(f"| {format_bytes(r['input_bytes'])} | {r['variant']} | {tier} | "
                         + " | ".join(cells) + " |")
    busy = [r for r in results["runs"] if r.get("busy")]
    if busy:
        lines += ["", "Machine-wide busy time, in the map phase / after it (the block device "
                  "under the cluster's work directory, which holds the NVMe file; CPU over "
                  f"{m['cores']} cores; every process's, so only a quiet run's say how far "
                  "computing and device I/O overlap):", "",
                  "| size | variant | wall s | device busy s (share) | CPU busy s (share) | "
                  "user s | system s | irq s | steal s | iowait s | kernel threads s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in busy:
        phases = [r["busy"][phase] for phase in ("before", "after")]

        def cell(counter: str, cores: int, phases: list[dict[str, float]] = phases) -> str:
            return " / ".join(
                f"{p[counter]:.1f} ({p[counter] / p['wall_s'] / cores:.0%})"
                if counter in p and p["wall_s"] > 0 else "-" for p in phases)

        lines.append(f"| {format_bytes(r['input_bytes'])} | {r['variant']} | "
                     + " / ".join(f"{p['wall_s']:.1f}" for p in phases) + " | "
                     + cell("device_busy_s", 1) + " | " + cell("cpu_busy_s", m["cores"]) + " | "
                     + " | ".join(" / ".join(f"{p[c]:.1f}" if c in p else "-" for p in phases)
                                  for c in SPLIT_COLUMNS) + " |")
    per_process = [r for r in results["runs"] if r.get("process_cpu")]
    if per_process:
        lines += ["", "CPU seconds per GB of input by the run's processes, in the map phase / "
                  "after it (user, system; minor page faults in thousands per GB; of the "
                  "processes' main threads alone: seconds per GB on a core, and ready but "
                  "waiting for one, what other load costs them; a task worker's main thread "
                  "runs its task, and is blocked for the rest of the phase; and the run delay "
                  "of all their threads, a server's included): the processes below the "
                  "benchmark's, so other users' work is not in it:", "",
                  "| size | variant | processes | user s/GB | system s/GB | faults k/GB | "
                  "main thread on CPU s/GB | main thread run delay s/GB | "
                  "all threads' run delay s/GB |",
                  "|---|---|---|---|---|---|---|---|---|"]
    for r in per_process:
        gb = r["input_bytes"] / 1e9
        phases = [r["process_cpu"][phase] for phase in ("before", "after")]
        groups = sorted({g for p in phases for g in p},
                        key=lambda g: -sum(p.get(g, {}).get("user_s", 0)
                                           + p.get(g, {}).get("system_s", 0) for p in phases))
        for group in groups:
            cells = [" / ".join(f"{p.get(group, {}).get(c, 0) / gb / scale:.{digits}f}"
                                for p in phases)
                     for c, scale, digits in (("user_s", 1, 2), ("system_s", 1, 2),
                                              ("minor_faults", 1000, 0),
                                              ("main_cpu_s", 1, 2), ("run_delay_s", 1, 2),
                                              ("threads_run_delay_s", 1, 2))]
            lines.append(f"| {format_bytes(r['input_bytes'])} | {r['variant']} | {group} | "
                         + " | ".join(cells) + " |")
    lines += ["", "Goals:"]
    for size, row in results["summary"].items():
        if isinstance(row, dict) and "speedup_vs_fastest_peer" in row:
            speedup = row["speedup_vs_fastest_peer"]
            lines.append(f"- {format_bytes(int(size))}: pocketflow's best over the fastest of "
                         f"Ray Data and Lithops localhost: **{speedup:.2f}x**"
                         f" (goal >= {SPEEDUP_GOAL}x) - "
                         f"{'met' if row['speedup_met'] else 'NOT met'}")
    for variant in ("pocketflow-ray", "pocketflow-lithops"):
        ratio = results["summary"].get(f"{variant}_time_per_gb_ratio")
        if ratio is not None:
            lines.append(f"- {variant}: time per GB at the largest size / the smallest: "
                         f"**{ratio:.2f}** (goal <= {LINEARITY_GOAL}) - "
                         f"{'met' if ratio <= LINEARITY_GOAL else 'NOT met'}")
    lines.append("")
    return "\n".join(lines)


def plot(runs: list[Run], path: Path) -> None:
    """Bytes in and out per second of each tier over time, one panel per pocketflow run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in runs if r.timeline]
    fig, axes = plt.subplots(max(1, len(mine)), 1, figsize=(9, 2.6 * max(1, len(mine))),
                             squeeze=False)
    for ax, r in zip(axes[:, 0], mine, strict=False):
        tiers = sorted({t for s in r.timeline for t in s["tiers"]})
        for tier in tiers:
            ax.plot([s["t_s"] for s in r.timeline],
                    [(s["tiers"].get(tier, {}).get("in_per_s", 0)
                      + s["tiers"].get(tier, {}).get("out_per_s", 0)) / 1e6
                     for s in r.timeline], label=tier)
        ax.set_title(f"{r.variant}, {format_bytes(r.input_bytes)}")
        ax.set_ylabel("MB/s in+out")
        ax.legend(loc="upper right")
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python3 -m benchmarks.sort_scale``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1GB,4GB,10GB",
                        help="comma-separated input sizes (default 1GB,4GB,10GB)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dram", default="2GiB", help="DRAM of the cluster in all (2 servers)")
    parser.add_argument("--nvme", default="32GiB", help="capacity of the one NVMe server")
    parser.add_argument("--redis-max", default="2GiB",
                        help="run Redis only where twice the input fits in this")
    parser.add_argument("--object-store", default="2GiB", help="Ray's object store memory")
    parser.add_argument("--storage-tasks-extra", type=int, default=0,
                        help="slots beyond the cores for pocketflow-ray's reducers of a job on "
                             "NVMe, and as many more Lithops worker processes there (default 0)")
    parser.add_argument("--object-size", default=None,
                        help="shape each sort so that its shuffle's objects are about this size "
                             "(mappers grow as the square root of the input); default: one "
                             "mapper per 32 MiB")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    variants = tuple(v for v in args.variants.split(",") if v)
    if not variants or not set(variants) <= set(VARIANTS):
        parser.error(f"--variants takes some of {','.join(VARIANTS)}")
    try:
        sizes = [parse_size(s, name="--sizes") for s in args.sizes.split(",") if s]
        dram, nvme = parse_size(args.dram, name="--dram"), parse_size(args.nvme, name="--nvme")
        redis_max = parse_size(args.redis_max, name="--redis-max")
        store = parse_size(args.object_store, name="--object-store")
        object_bytes = (None if args.object_size is None else
                        parse_size(args.object_size, name="--object-size"))
    except ConfigError as exc:
        parser.error(str(exc))
    if any("lithops" in v for v in variants):
        from pocketflow.demo import forget_inherited_lithops_session

        forget_inherited_lithops_session()
    results = run(sizes, variants, args.out, dram_bytes=dram, nvme_bytes=nvme,
                  redis_max_bytes=redis_max, object_store_bytes=store,
                  storage_tasks_extra=args.storage_tasks_extra, object_bytes=object_bytes)
    ok = all(r["ok"] for r in results["runs"] if not r["skipped"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
