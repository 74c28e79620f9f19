"""The demo job: a MapReduce sort of generated 100-byte records, shuffled through pocketflow.

Mappers and reducers run in separate OS processes (a ``spawn`` pool, no Ray in the tasks). Each
task receives only the job handle's JSON and connects with it. Mapper ``i`` generates its share of
records deterministically from the seed, range-partitions them by key into ``R`` partitions and
writes one object per (mapper, reducer); reducer ``r`` reads its ``M`` inputs with DELETE-on-read,
sorts them and writes its output with PERSIST. A validation stage reads every output back from the
storage servers and checks it; the driver then compares record counts and an order-independent
checksum with what the mappers generated, and checks that the partitions are globally ordered.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    from pocketflow.job import Job

RECORD_BYTES = 100
KEY_BYTES = 10
SHUFFLE_BUCKET = "shuffle"
OUTPUT_BUCKET = "output"
TASKS_PER_STAGE_MAX = 1024
"""Most mappers, and most reducers, of one sort."""
RECORDS_MAX = 100_000_000
"""Most records one sort generates (10 GB)."""
CAPACITY_POLL_INTERVAL_S = 0.25
"""How often the driver samples the servers' used bytes while the job runs."""

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)
_SHIFT_30 = np.uint64(30)
_SHIFT_27 = np.uint64(27)
_SHIFT_31 = np.uint64(31)
_CHECKSUM_SEED = np.uint64(0x5045434B45544657)

T = TypeVar("T")


@dataclass(frozen=True)
class SortConfig:
    """Size and shape of one sort: ``records`` records of 100 bytes, ``mappers`` x ``reducers``.

    ``processes`` is the size of the task pool (default: the number of CPUs, at least 2);
    ``block_size_bytes`` overrides the job's block size for large objects; ``keep_output`` keeps
    the sorted output (PERSIST, so it outlives the job) instead of deleting it after validation.
    """

    mappers: int = 8
    reducers: int = 4
    records: int = 1_000_000
    seed: int = 0
    processes: int | None = None
    block_size_bytes: int | None = None
    keep_output: bool = False

    def __post_init__(self) -> None:
        for name in ("mappers", "reducers"):
            value = getattr(self, name)
            if not 1 <= value <= TASKS_PER_STAGE_MAX:
                raise ValueError(f"{name} must be in 1..{TASKS_PER_STAGE_MAX}, got {value}")
        if not 0 <= self.records <= RECORDS_MAX:
            raise ValueError(f"records must be in 0..{RECORDS_MAX}, got {self.records}")
        if self.processes is not None and self.processes < 1:
            raise ValueError(f"processes must be at least 1, got {self.processes}")

    @property
    def input_bytes(self) -> int:
        """Bytes of generated input (and of sorted output)."""
        return self.records * RECORD_BYTES

    def pool_size(self) -> int:
        """Processes in the task pool."""
        wanted = self.processes or max(2, os.cpu_count() or 2)
        return max(1, min(wanted, max(self.mappers, self.reducers)))

    def mapper_range(self, mapper: int) -> tuple[int, int]:
        """Global index of the first record of ``mapper`` and its record count."""
        first = self.records * mapper // self.mappers
        last = self.records * (mapper + 1) // self.mappers
        return first, last - first


@dataclass(frozen=True)
class MapResult:
    """What one mapper generated and wrote."""

    mapper: int
    records: int
    checksum: int
    bytes_written: int


@dataclass(frozen=True)
class ReduceResult:
    """What one reducer read and wrote."""

    reducer: int
    records: int
    bytes_read: int
    bytes_written: int


@dataclass(frozen=True)
class PartitionCheck:
    """One output partition as read back from the storage servers."""

    reducer: int
    records: int
    checksum: int
    is_sorted: bool
    first_key: bytes | None
    last_key: bytes | None
    bytes_read: int


@dataclass
class SortReport:
    """Outcome of one sort: validation, timings, bytes moved, peak capacity used."""

    config: SortConfig
    job_id: str
    input_checksum: int
    output_checksum: int
    output_records: int
    elapsed_s: float
    phase_s: dict[str, float]
    bytes_written: int
    bytes_read: int
    peak_used_bytes: int
    baseline_used_bytes: int
    capacity_bytes: int
    servers: int
    weights: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether the output is complete and globally sorted."""
        return not self.problems

    def summary_lines(self) -> list[str]:
        """The human-readable report the CLI prints."""
        cfg = self.config
        moved = self.bytes_written + self.bytes_read
        rate = moved / self.elapsed_s if self.elapsed_s > 0 else 0.0
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phase_s.items())
        lines = [
            f"sorted {cfg.records:,} records ({format_bytes(cfg.input_bytes)}) with "
            f"{cfg.mappers} mappers and {cfg.reducers} reducers in {self.elapsed_s:.1f} s "
            f"(job {self.job_id}, {cfg.pool_size()} task processes)",
            f"  phases: {phases}",
            "  job's servers (share of data): "
            + ", ".join(
                f"{node} {100 * w / (sum(self.weights.values()) or 1):.0f}%"
                for node, w in self.weights.items()
            ),
            f"  bytes moved: written {format_bytes(self.bytes_written)}, read "
            f"{format_bytes(self.bytes_read)} (total {format_bytes(moved)}, "
            f"{format_bytes(int(rate))}/s)",
            f"  peak capacity used: {format_bytes(self.peak_used_bytes)} of "
            f"{format_bytes(self.capacity_bytes)} on {self.servers} servers "
            f"(baseline {format_bytes(self.baseline_used_bytes)})",
        ]
        if self.ok:
            lines.append(
                f"  validation: OK (globally sorted, {self.output_records:,} records, "
                f"checksum {self.output_checksum:#018x})"
            )
        else:
            lines.append("  validation: FAILED")
            lines.extend(f"    - {problem}" for problem in self.problems)
        return lines


def format_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# -- records ----------------------------------------------------------------------------------


def generate_records(config: SortConfig, mapper: int) -> np.ndarray:
    """Mapper ``mapper``'s records, as a ``(n, 100)`` uint8 array; deterministic in the seed."""
    _, count = config.mapper_range(mapper)
    rng = np.random.default_rng([config.seed, mapper])
    return np.frombuffer(rng.bytes(count * RECORD_BYTES), dtype=np.uint8).reshape(
        count, RECORD_BYTES
    )


def records_from(data: bytes | memoryview) -> np.ndarray:
    """View bytes as a ``(n, 100)`` record array (no copy)."""
    if len(data) % RECORD_BYTES:
        raise ValueError(f"{len(data)} bytes is not a whole number of {RECORD_BYTES}-byte records")
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, RECORD_BYTES)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, elementwise (wrapping uint64 arithmetic)."""
    z = z + _GOLDEN
    z = (z ^ (z >> _SHIFT_30)) * _MIX_1
    z = (z ^ (z >> _SHIFT_27)) * _MIX_2
    return z ^ (z >> _SHIFT_31)


def record_checksum(records: np.ndarray) -> int:
    """Order-independent checksum: the sum, mod 2^64, of a 64-bit hash of every record.

    A missing, duplicated or altered record changes it (with overwhelming probability); the order
    of records does not.
    """
    if records.shape[0] == 0:
        return 0
    words = np.ascontiguousarray(records).view("<u4")
    h = np.full(records.shape[0], _CHECKSUM_SEED, dtype=np.uint64)
    for column in range(words.shape[1]):
        h = _mix64(h ^ words[:, column].astype(np.uint64))
    return int(h.sum(dtype=np.uint64))


def partition_of(records: np.ndarray, reducers: int) -> np.ndarray:
    """Range partition by the first two key bytes: partition ``r`` holds the ``r``-th key range."""
    prefix = (records[:, 0].astype(np.uint32) << 8) | records[:, 1]
    return ((prefix * reducers) >> 16).astype(np.int64)


def _key_columns(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 10-byte keys as (big-endian first 8 bytes, big-endian last 2 bytes)."""
    high = np.ascontiguousarray(records[:, :8]).view(">u8").ravel()
    low = (records[:, 8].astype(np.uint16) << 8) | records[:, 9]
    return high, low


def sort_records(records: np.ndarray) -> np.ndarray:
    """Records ordered by their 10-byte key, bytewise."""
    high, low = _key_columns(records)
    return records[np.lexsort((low, high))]


def is_sorted(records: np.ndarray) -> bool:
    """Whether records are in non-decreasing key order."""
    if records.shape[0] < 2:
        return True
    high, low = _key_columns(records)
    later_high, earlier_high = high[1:], high[:-1]
    ordered = (later_high > earlier_high) | ((later_high == earlier_high) & (low[1:] >= low[:-1]))
    return bool(ordered.all())


def shuffle_key(*, reducer: int, mapper: int) -> str:
    """Key of the object mapper ``mapper`` writes for reducer ``reducer``."""
    return f"r{reducer:05d}/m{mapper:05d}"


def output_key(reducer: int) -> str:
    """Key of reducer ``reducer``'s sorted output."""
    return f"part-{reducer:05d}"


def check_output(
    config: SortConfig, *, input_checksum: int, checks: list[PartitionCheck]
) -> list[str]:
    """Problems with the sorted output, compared with the input (empty when it is correct)."""
    problems = []
    by_reducer = sorted(checks, key=lambda c: c.reducer)
    if [c.reducer for c in by_reducer] != list(range(config.reducers)):
        problems.append(
            f"expected partitions 0..{config.reducers - 1}, "
            f"got {[c.reducer for c in by_reducer]}"
        )
    total = sum(c.records for c in by_reducer)
    if total != config.records:
        problems.append(f"output has {total:,} records, input had {config.records:,}")
    output_checksum = sum(c.checksum for c in by_reducer) & _MASK64
    if output_checksum != input_checksum:
        problems.append(
            f"output checksum {output_checksum:#018x} != input checksum {input_checksum:#018x}"
        )
    previous_last: bytes | None = None
    previous_reducer = -1
    for check in by_reducer:
        if not check.is_sorted:
            problems.append(f"partition {check.reducer} is not sorted")
        if check.records == 0 or check.first_key is None or check.last_key is None:
            continue
        if previous_last is not None and check.first_key < previous_last:
            problems.append(
                f"partition {check.reducer} starts with key {check.first_key.hex()} before "
                f"partition {previous_reducer} ends ({previous_last.hex()})"
            )
        previous_last, previous_reducer = check.last_key, check.reducer
    return problems


# -- tasks (run in the pool's processes) ------------------------------------------------------


def _connect(handle_json: str, config: SortConfig) -> Any:
    import pocketflow
    from pocketflow.handle import JobHandle

    options = {}
    if config.block_size_bytes is not None:
        options["block_size_bytes"] = config.block_size_bytes
    return pocketflow.connect(JobHandle.from_json(handle_json), **options)


def map_task(args: tuple[str, SortConfig, int]) -> MapResult:
    """Generate mapper ``i``'s records, partition them, write one object per reducer."""
    handle_json, config, mapper = args
    records = generate_records(config, mapper)
    checksum = record_checksum(records)
    partitions = partition_of(records, config.reducers)
    grouped = records[np.argsort(partitions, kind="stable")]
    bounds = np.concatenate(([0], np.cumsum(np.bincount(partitions, minlength=config.reducers))))
    items = [
        (
            shuffle_key(reducer=r, mapper=mapper),
            grouped[bounds[r] : bounds[r + 1]].reshape(-1).data,
        )
        for r in range(config.reducers)
    ]
    with _connect(handle_json, config) as pf:
        pf.put_many(SHUFFLE_BUCKET, items)
    return MapResult(
        mapper=mapper,
        records=records.shape[0],
        checksum=checksum,
        bytes_written=records.shape[0] * RECORD_BYTES,
    )


def reduce_task(args: tuple[str, SortConfig, int]) -> ReduceResult:
    """Read reducer ``r``'s inputs (DELETE on read), sort them, write the output (PERSIST)."""
    handle_json, config, reducer = args
    keys = [shuffle_key(reducer=reducer, mapper=m) for m in range(config.mappers)]
    with _connect(handle_json, config) as pf:
        values = pf.get_many(SHUFFLE_BUCKET, keys, delete=True)
        data = b"".join(values)
        records = sort_records(records_from(data))
        pf.put(OUTPUT_BUCKET, output_key(reducer), records.reshape(-1).data, persist=True)
    return ReduceResult(
        reducer=reducer,
        records=records.shape[0],
        bytes_read=len(data),
        bytes_written=records.shape[0] * RECORD_BYTES,
    )


def check_task(args: tuple[str, SortConfig, int]) -> PartitionCheck:
    """Read reducer ``r``'s output back from the servers and describe it."""
    handle_json, config, reducer = args
    with _connect(handle_json, config) as pf:
        data = pf.get(OUTPUT_BUCKET, output_key(reducer))
    records = records_from(data)
    count = records.shape[0]
    return PartitionCheck(
        reducer=reducer,
        records=count,
        checksum=record_checksum(records),
        is_sorted=is_sorted(records),
        first_key=bytes(records[0, :KEY_BYTES]) if count else None,
        last_key=bytes(records[-1, :KEY_BYTES]) if count else None,
        bytes_read=len(data),
    )


# -- the driver -------------------------------------------------------------------------------


class CapacityPoller:
    """Samples the cluster's used bytes in a background thread; remembers the peak."""

    def __init__(
        self,
        status: Callable[[], dict[str, Any]],
        *,
        interval_s: float = CAPACITY_POLL_INTERVAL_S,
    ) -> None:
        self._status = status
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="capacity-poller", daemon=True)
        first = self._sample()
        self.baseline_used_bytes = first[0]
        self.peak_used_bytes = first[0]
        self.capacity_bytes = first[1]
        self.servers = first[2]

    def _sample(self) -> tuple[int, int, int]:
        servers = self._status()["servers"]
        return (
            sum(int(s["used_bytes"]) for s in servers),
            sum(int(s["capacity_bytes"]) for s in servers),
            len(servers),
        )

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                used = self._sample()[0]
            except Exception:  # a failed sample must not end the job; the next one may work
                continue
            self.peak_used_bytes = max(self.peak_used_bytes, used)

    def __enter__(self) -> CapacityPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_used_bytes = max(self.peak_used_bytes, self._sample()[0])


def _run_stage(
    pool: Any,
    task: Callable[[tuple[str, SortConfig, int]], T],
    args: Iterable[tuple[str, SortConfig, int]],
    bar: Any,
) -> Iterator[T]:
    for result in pool.imap_unordered(task, args):
        bar.update(1)
        yield result


def run_sort(job: Job, config: SortConfig | None = None, *, progress: bool = True) -> SortReport:
    """Run the sort as job ``job`` (which the caller registers and deregisters); returns the report.

    Raises whatever a task raised (re-raised in this process by the pool).
    """
    from tqdm import tqdm

    cfg = config or SortConfig()
    handle_json = job.handle.to_json()
    with job.connect() as pf:
        pf.create_bucket(SHUFFLE_BUCKET)
        pf.create_bucket(OUTPUT_BUCKET)

    phase_s: dict[str, float] = {}
    context = multiprocessing.get_context("spawn")
    started = time.perf_counter()
    with (
        CapacityPoller(job.status) as poller,
        context.Pool(processes=cfg.pool_size()) as pool,
        tqdm(
            total=cfg.mappers + 2 * cfg.reducers,
            unit="task",
            file=sys.stderr,
            disable=not progress,
            desc="map",
        ) as bar,
    ):
        phase_started = time.perf_counter()
        maps = list(
            _run_stage(pool, map_task, ((handle_json, cfg, m) for m in range(cfg.mappers)), bar)
        )
        phase_s["map"] = time.perf_counter() - phase_started

        bar.set_description("reduce")
        phase_started = time.perf_counter()
        reduces = list(
            _run_stage(
                pool, reduce_task, ((handle_json, cfg, r) for r in range(cfg.reducers)), bar
            )
        )
        phase_s["reduce"] = time.perf_counter() - phase_started

        bar.set_description("validate")
        phase_started = time.perf_counter()
        checks = list(
            _run_stage(pool, check_task, ((handle_json, cfg, r) for r in range(cfg.reducers)), bar)
        )
        phase_s["validate"] = time.perf_counter() - phase_started
    elapsed_s = time.perf_counter() - started

    input_checksum = sum(m.checksum for m in maps) & _MASK64
    problems = check_output(cfg, input_checksum=input_checksum, checks=checks)
    if sum(m.records for m in maps) != cfg.records:
        problems.append(f"mappers generated {sum(m.records for m in maps):,} records")
    if not cfg.keep_output:
        with job.connect() as pf:
            for reducer in range(cfg.reducers):
                pf.delete(OUTPUT_BUCKET, output_key(reducer))

    return SortReport(
        config=cfg,
        job_id=job.job_id,
        input_checksum=input_checksum,
        output_checksum=sum(c.checksum for c in checks) & _MASK64,
        output_records=sum(c.records for c in checks),
        elapsed_s=elapsed_s,
        phase_s=phase_s,
        bytes_written=sum(m.bytes_written for m in maps) + sum(r.bytes_written for r in reduces),
        bytes_read=sum(r.bytes_read for r in reduces) + sum(c.bytes_read for c in checks),
        peak_used_bytes=poller.peak_used_bytes,
        baseline_used_bytes=poller.baseline_used_bytes,
        capacity_bytes=poller.capacity_bytes,
        servers=poller.servers,
        weights={s.node_id: s.weight for s in job.handle.servers if s.weight > 0},
        problems=problems,
    )
