"""The demo job: a MapReduce sort of generated 100-byte records, shuffled by pocketflow.

This module holds what the sort is, whatever runs its tasks: the records (mapper ``i``
generates its share deterministically from the seed, 10-byte keys), their range partitioning
into ``R`` partitions, the reducers' sort, and the validation (record counts, an
order-independent checksum, global order), with the report and a sampler of the servers' used
bytes. What runs the tasks is a *demo runner* that a framework adapter provides, found through
the entry-point group ``pocketflow.demo_runners`` (:func:`demo_runner`): the core imports no
adapter. ``pocketflow-lithops`` registers ``lithops``
(:mod:`pocketflow_lithops.sort`): mappers and reducers as Lithops calls on the localhost
executor, wired by its drop-in shuffle, reducers reading their ``M`` inputs with DELETE-on-read
and writing their outputs with PERSIST, and a validation stage that reads every output back.

:func:`lithops_config` and :func:`forget_inherited_lithops_session` stay here because they
import nothing of Lithops (plain configuration, the environment) and the THIS adapter and the
benchmarks use them too.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pocketflow.errors import ConfigError
from pocketflow.status_view import format_bytes

log = logging.getLogger(__name__)

RECORD_BYTES = 100
KEY_BYTES = 10
TASKS_PER_STAGE_MAX = 1024
"""Most mappers, and most reducers, of one sort."""
RECORDS_MAX = 100_000_000
"""Most records one sort generates (10 GB)."""
CAPACITY_POLL_INTERVAL_S = 0.25
"""How often the driver samples the servers' used bytes while the job runs."""
SAMPLES_MAX = 200_000
"""Most samples one sampler takes; it stops sampling after that."""
LITHOPS_ENV_PREFIX = "__LITHOPS_"
"""Prefix of the environment variables Lithops passes to child processes (its session)."""
SORT_TIMEOUT_DEFAULT_S = 3600.0
"""Default bound on each wait for a stage of the sort (Lithops raises ``TimeoutError``)."""
LITHOPS_POCKET_STORAGE = "pocket"
"""Name of pocketflow's Lithops storage backend (``pocketflow_lithops.storage``)."""
LITHOPS_MONITORING_INTERVAL_S = 0.1
"""How often Lithops' driver looks for finished calls (its default of 2 s dominates small jobs)."""
DEMO_RUNNERS_GROUP = "pocketflow.demo_runners"
"""Entry-point group naming the installed demo runners (see :class:`DemoRunner`)."""
DEFAULT_DEMO_RUNNER = "lithops"
"""The runner ``pocketflow demo`` picks when several are installed and none is named."""

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)
_SHIFT_30 = np.uint64(30)
_SHIFT_27 = np.uint64(27)
_SHIFT_31 = np.uint64(31)
_CHECKSUM_SEED = np.uint64(0x5045434B45544657)
_CHECKSUM_WORDS = RECORD_BYTES // 8
"""Whole 64-bit words of a record; the remaining 4 bytes are its tail word."""
_CHECKSUM_WEIGHTS = np.array([
    0x38DB8118CDBD12C1, 0xACE312B7091F6D5B, 0x7721FB986D531B39, 0xF6ECF38C729A5941,
    0x16898C3347C30C6F, 0x29BDAB1DC678CFE5, 0x47E266BA9CC67C95, 0xD9DCD1A6E01FBDC3,
    0xE93B5FFCA2E750D7, 0x3EC08A9944789B65, 0x9A01FEDCFD77760F, 0x4EF760B9FE8A5FF9,
], dtype=np.uint64)
"""Odd weights of a record's words in its hash (arbitrary odd constants, fixed)."""
_CHECKSUM_TAIL_WEIGHT = np.uint64(0xD6E8FEB86659FD93)
_RECORD_DTYPE = np.dtype(f"V{RECORD_BYTES}")


@dataclass(frozen=True)
class SortConfig:
    """Size and shape of one sort: ``records`` records of 100 bytes, ``mappers`` x ``reducers``.

    ``processes`` is the number of Lithops worker processes (default: the number of CPUs, at
    least 2);
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
    regenerated_partitions: int = 0
    executor: str = "Lithops localhost executor"
    """What ran the tasks, as the summary names it."""
    peak_used_by_tier: dict[str, int] = field(default_factory=dict)
    """Each tier's highest used bytes while the sort ran."""
    capacity_by_tier: dict[str, int] = field(default_factory=dict)

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
            f"(job {self.job_id}, {self.executor}, {cfg.pool_size()} worker processes)",
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
        if self.peak_used_by_tier:
            lines.append("  per tier, at its own peak: " + ", ".join(
                f"{tier} {format_bytes(used)} of "
                f"{format_bytes(self.capacity_by_tier.get(tier, 0))}"
                for tier, used in sorted(self.peak_used_by_tier.items())
            ))
        if self.regenerated_partitions:
            lines.append(f"  regenerated {self.regenerated_partitions} partitions lost with a "
                         "storage server")
        if self.ok:
            lines.append(
                f"  validation: OK (globally sorted, {self.output_records:,} records, "
                f"checksum {self.output_checksum:#018x})"
            )
        else:
            lines.append("  validation: FAILED")
            lines.extend(f"    - {problem}" for problem in self.problems)
        return lines


# -- records ----------------------------------------------------------------------------------


def generate_records(config: SortConfig, mapper: int) -> np.ndarray:
    """Mapper ``mapper``'s records, as a ``(n, 100)`` uint8 array; deterministic in the seed.

    The bytes are the raw 64-bit outputs of a PCG64 seeded with ``(seed, mapper)``: drawing
    words is about four times cheaper than ``Generator.bytes`` (17 against 67 ms of CPU for a
    32 MiB mapper), and every variant of the sort benchmarks generates its records here.
    """
    _, count = config.mapper_range(mapper)
    total_bytes = count * RECORD_BYTES
    words = np.random.default_rng([config.seed, mapper]).bit_generator.random_raw(
        -(-total_bytes // 8))
    return words.view(np.uint8)[:total_bytes].reshape(count, RECORD_BYTES)


def records_from(data: bytes | memoryview) -> np.ndarray:
    """View bytes as a ``(n, 100)`` record array (no copy)."""
    if len(data) % RECORD_BYTES:
        raise ValueError(f"{len(data)} bytes is not a whole number of {RECORD_BYTES}-byte records")
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, RECORD_BYTES)


def _rows(records: np.ndarray) -> np.ndarray:
    """Records as a 1-D array of ``RECORD_BYTES``-wide opaque items: ``np.take`` moves each with
    one copy of its bytes, where fancy indexing of uint8 rows costs three to four times more."""
    return np.ascontiguousarray(records).view(_RECORD_DTYPE).reshape(-1)


def _gather(records: np.ndarray, order: np.ndarray) -> np.ndarray:
    """``records[order]``, row by row, as a new ``(n, 100)`` uint8 array."""
    return np.take(_rows(records), order).view(np.uint8).reshape(-1, RECORD_BYTES)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, elementwise (wrapping uint64 arithmetic)."""
    z = z + _GOLDEN
    z = (z ^ (z >> _SHIFT_30)) * _MIX_1
    z = (z ^ (z >> _SHIFT_27)) * _MIX_2
    return z ^ (z >> _SHIFT_31)


def record_checksum(records: np.ndarray) -> int:
    """Order-independent checksum: the sum, mod 2^64, of a 64-bit hash of every record.

    A record's hash is SplitMix64's finalizer of a weighted sum of its twelve little-endian
    64-bit words and its last 32-bit word, each weight odd: a change to any one word changes
    the sum (an odd weight is invertible mod 2^64) and so the hash (the finalizer is a
    bijection), and the finalizer's mixing makes changes that cancel across records or words
    as unlikely as a 64-bit collision. A missing, duplicated or altered record changes the
    checksum; the order of records does not. One pass over the words and one finalizer per
    record (some 15 ms of CPU for a 32 MiB mapper, where a finalizer per 32-bit word cost 175).
    """
    count = records.shape[0]
    if count == 0:
        return 0
    flat = np.ascontiguousarray(records)
    words = np.ndarray((count, _CHECKSUM_WORDS), dtype="<u8", buffer=flat,
                       strides=(RECORD_BYTES, 8))
    tail = np.ndarray((count,), dtype="<u4", buffer=flat, offset=8 * _CHECKSUM_WORDS,
                      strides=(RECORD_BYTES,))
    h = words @ _CHECKSUM_WEIGHTS
    h += tail.astype(np.uint64) * _CHECKSUM_TAIL_WEIGHT
    h ^= _CHECKSUM_SEED
    return int(_mix64(h).sum(dtype=np.uint64))


def partition_of(records: np.ndarray, reducers: int) -> np.ndarray:
    """Range partition by the first two key bytes: partition ``r`` holds the ``r``-th key range.

    The partitions come back as uint16 (``reducers`` is at most 65,536, the key prefix's
    range), so that a stable argsort of them is numpy's radix sort.
    """
    if not 1 <= reducers <= 1 << 16:
        raise ValueError(f"reducers must be in 1..{1 << 16}, got {reducers}")
    prefix = np.ascontiguousarray(records[:, :2]).view(">u2").reshape(-1).astype(np.uint32)
    return ((prefix * reducers) >> 16).astype(np.uint16)


def group_by_partition(records: np.ndarray, reducers: int) -> tuple[np.ndarray, np.ndarray]:
    """Records grouped by :func:`partition_of`, in their order within each partition, and the
    ``reducers + 1`` bounds: partition ``r`` is ``grouped[bounds[r]:bounds[r + 1]]``. One
    stable radix argsort and one gather; the mappers of every sort variant group here."""
    partitions = partition_of(records, reducers)
    grouped = _gather(records, np.argsort(partitions, kind="stable"))
    counts = np.bincount(partitions, minlength=reducers)
    return grouped, np.concatenate(([0], np.cumsum(counts)))


def _high_keys(records: np.ndarray) -> np.ndarray:
    """The first 8 key bytes of contiguous records as native integers (one strided pass)."""
    if records.shape[0] == 0:
        return np.empty(0, dtype=np.uint64)
    high = np.ndarray((records.shape[0],), dtype=">u8", buffer=records, strides=(RECORD_BYTES,))
    return high.astype(np.uint64)


def _key_columns(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 10-byte keys as native integers: (their first 8 bytes, their last 2 bytes), each read
    in one strided pass over the records."""
    flat = np.ascontiguousarray(records)
    if flat.shape[0] == 0:
        return np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.uint16)
    low = np.ndarray((flat.shape[0],), dtype=">u2", buffer=flat, offset=8,
                     strides=(RECORD_BYTES,))
    return _high_keys(flat), low.astype(np.uint16)


def _key_order(high: np.ndarray, low_of: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """The permutation that orders records by their 10-byte key, given the keys' first 8 bytes
    (``high``, native integers) and a function that returns the last 2 bytes of the records
    at the given indices.

    Each ``high`` loses its lowest bits to the record's index and the packed words are sorted
    by value (numpy's vectorised sort of integers: some 10 ms of CPU for 700,000 records, where
    an argsort takes 30-60 and a lexsort of both key columns 190); the index bits then give
    the order. Records whose remaining high bits are equal (rare in random keys, but allowed)
    are put in key order among themselves by a lexsort of just those records.
    """
    count = high.shape[0]
    if count < 2:
        return np.arange(count, dtype=np.intp)
    index_bits = np.uint64((count - 1).bit_length())
    packed = (high >> index_bits) << index_bits
    packed |= np.arange(count, dtype=np.uint64)
    packed.sort()
    order = (packed & ((np.uint64(1) << index_bits) - np.uint64(1))).astype(np.intp)
    prefix = packed >> index_bits
    tied = prefix[1:] == prefix[:-1]
    if tied.any():
        in_run = np.zeros(count, dtype=bool)
        in_run[1:] |= tied
        in_run[:-1] |= tied
        positions = np.flatnonzero(in_run)
        run = np.cumsum(np.concatenate(([True], ~tied)))[positions]
        members = order[positions]
        order[positions] = members[np.lexsort((low_of(members), high[members], run))]
    return order


def sort_records(records: np.ndarray) -> np.ndarray:
    """Records ordered by their 10-byte key, bytewise (:func:`_key_order`, then one gather)."""
    flat = np.ascontiguousarray(records)
    order = _key_order(_high_keys(flat), lambda at: _key_columns(flat[at])[1])
    return _gather(flat, order)


def sort_runs(runs: list[Any]) -> np.ndarray:
    """The records of several runs of bytes (a reducer's inputs), ordered by their 10-byte key,
    as one new ``(n, 100)`` array: each record is copied once, from its run straight to its
    place, without joining the runs first (a join costs a copy of all the bytes)."""
    views = [records_from(run) for run in runs]
    high = np.concatenate([_high_keys(v) for v in views]) if views else np.empty(0, np.uint64)
    order = _key_order(high, lambda at: np.concatenate([_key_columns(v)[1] for v in views])[at])
    place = np.empty(order.shape[0], dtype=np.intp)
    place[order] = np.arange(order.shape[0], dtype=np.intp)
    out = np.empty(order.shape[0], dtype=_RECORD_DTYPE)
    at = 0
    for view in views:
        count = view.shape[0]
        out[place[at:at + count]] = _rows(view)
        at += count
    return out.view(np.uint8).reshape(-1, RECORD_BYTES)


def is_sorted(records: np.ndarray) -> bool:
    """Whether records are in non-decreasing key order."""
    if records.shape[0] < 2:
        return True
    high, low = _key_columns(records)
    later_high, earlier_high = high[1:], high[:-1]
    ordered = (later_high > earlier_high) | ((later_high == earlier_high) & (low[1:] >= low[:-1]))
    return bool(ordered.all())


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


# -- tasks (run in Lithops' worker processes) -------------------------------------------------


def map_records(config: SortConfig, mapper: int, emit: Callable[[int, Any], None]) -> MapResult:
    """Mapper ``mapper``: generate its records, range-partition them, emit one run per reducer
    (a view of the grouped records, no copy per run)."""
    records = generate_records(config, mapper)
    checksum = record_checksum(records)
    grouped, bounds = group_by_partition(records, config.reducers)
    for r in range(config.reducers):
        emit(r, grouped[bounds[r] : bounds[r + 1]].reshape(-1))
    return MapResult(
        mapper=mapper,
        records=records.shape[0],
        checksum=checksum,
        bytes_written=records.shape[0] * RECORD_BYTES,
    )


def reduce_records(reducer: int, inputs: list[bytes]) -> np.ndarray:
    """Reducer ``reducer``: its inputs' records in key order (as a flat byte array)."""
    del reducer
    return sort_runs(inputs).reshape(-1)


def describe_partition(reducer: int, data: bytes) -> PartitionCheck:
    """What validation needs to know of reducer ``reducer``'s output bytes."""
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


def check_partition(handle_json: str, bucket: str, key: str, reducer: int) -> PartitionCheck:
    """Read reducer ``reducer``'s output back from the storage servers and describe it."""
    import pocketflow

    with pocketflow.connect(handle_json) as pf:
        return describe_partition(reducer, pf.get(bucket, key))


# -- the driver -------------------------------------------------------------------------------


def forget_inherited_lithops_session() -> None:
    """Make this process start a Lithops session of its own; call it before any executor.

    Lithops exports its session id and executor count to child processes so they join the
    parent's session, continuing the count from the parent's snapshot; but the parent keeps
    counting too, so a parent and a child that both create executors later reuse the same
    executor ids, and with them the same storage keys for results and statuses (seen as one
    sort reading another process's results). A program that runs as its own command (the demo,
    the benchmark) therefore drops the inherited variables first.
    """
    for name in [n for n in os.environ if n.startswith(LITHOPS_ENV_PREFIX)]:
        del os.environ[name]


def lithops_config(*, storage: str = "localhost", workers: int | None = None,
                   extra: dict[str, Any] | None = None,
                   runtime: str | None = None) -> dict[str, Any]:
    """Lithops configuration of the localhost executor with ``runtime`` (by default this
    interpreter) as the runtime.

    ``storage`` is Lithops' own storage (function payloads, results, status); the shuffle's
    data never goes there. ``extra`` is merged in per section (e.g. a ``redis`` section).
    """
    config: dict[str, Any] = {
        "lithops": {
            "backend": "localhost",
            "storage": storage,
            # Lithops polls its storage for finished calls; 2 s by default is most of a small job.
            "monitoring_interval": LITHOPS_MONITORING_INTERVAL_S,
            "log_level": "WARNING",
        },
        "localhost": {
            "runtime": runtime or sys.executable,
            "version": 1,
            "worker_processes": workers or max(2, os.cpu_count() or 2),
        },
    }
    for section, values in (extra or {}).items():
        config.setdefault(section, {}).update(values)
    return config


class PeakSampler:
    """Samples a store's used bytes in a background thread; remembers the baseline and the peak.

    ``sample`` returns the bytes in use; a failing sample is counted in ``errors`` and skipped.
    At most ``samples_max`` samples are taken (the thread stops sampling after that).
    """

    def __init__(
        self,
        sample: Callable[[], int],
        *,
        interval_s: float = CAPACITY_POLL_INTERVAL_S,
        samples_max: int = SAMPLES_MAX,
    ) -> None:
        self._sample = sample
        self._interval_s = interval_s
        self._samples_max = samples_max
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)
        self.baseline_bytes = sample()
        self.peak_bytes = self.baseline_bytes
        self.samples = 1
        self.errors = 0

    def _run(self) -> None:
        while self.samples < self._samples_max and not self._stop.wait(self._interval_s):
            try:
                used = self._sample()
            except Exception:  # a failed sample must not end the job; the next one may work
                self.errors += 1
                continue
            self.samples += 1
            self.peak_bytes = max(self.peak_bytes, used)

    @property
    def held_bytes(self) -> int:
        """Peak above the baseline."""
        return max(0, self.peak_bytes - self.baseline_bytes)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.peak_bytes = max(self.peak_bytes, self._sample())
        except Exception:  # the job's outcome matters more than one last sample
            self.errors += 1


class CapacityPoller(PeakSampler):
    """A :class:`PeakSampler` of the cluster's used bytes from its status (servers' heartbeats),
    which also records the capacity and the number of servers."""

    def __init__(
        self,
        status: Callable[[], dict[str, Any]],
        *,
        interval_s: float = CAPACITY_POLL_INTERVAL_S,
    ) -> None:
        first = status()["servers"]
        self.capacity_bytes = sum(int(s["capacity_bytes"]) for s in first)
        self.servers = len(first)
        self.capacity_by_tier: dict[str, int] = {}
        for server in first:
            tier = str(server["tier"])
            self.capacity_by_tier[tier] = (self.capacity_by_tier.get(tier, 0)
                                           + int(server["capacity_bytes"]))
        self.peak_by_tier: dict[str, int] = {}
        """Each tier's highest used bytes seen (its own peak, not at the total's peak)."""

        def sample() -> int:
            by_tier: dict[str, int] = {}
            for server in status()["servers"]:
                tier = str(server["tier"])
                by_tier[tier] = by_tier.get(tier, 0) + int(server["used_bytes"])
            for tier, used in by_tier.items():
                self.peak_by_tier[tier] = max(self.peak_by_tier.get(tier, 0), used)
            return sum(by_tier.values())

        super().__init__(sample, interval_s=interval_s)

    @property
    def baseline_used_bytes(self) -> int:
        """Used bytes when sampling started."""
        return self.baseline_bytes

    @property
    def peak_used_bytes(self) -> int:
        """Highest used bytes seen."""
        return self.peak_bytes


# -- runners ----------------------------------------------------------------------------------


class DemoRunner(Protocol):
    """What runs the demo's tasks: an adapter's object named in the entry-point group
    :data:`DEMO_RUNNERS_GROUP`. ``pocketflow demo`` calls :meth:`prepare` before it starts a
    cluster and :meth:`run` once the cluster is up."""

    def prepare(self) -> None:
        """Get the process ready before the cluster starts (its child processes inherit it)."""

    def run(
        self, cluster: Any, config: SortConfig, *, progress: bool, options: Mapping[str, Any]
    ) -> SortReport:
        """Run the sort on ``cluster`` (what :func:`pocketflow.register_job` takes) and return
        its report; ``options`` are the runner's own settings from the command line (unknown
        ones are ignored). Raises what the job raised; leaves no process of its own behind."""
        ...


def demo_runner_names() -> list[str]:
    """The names of the installed demo runners, sorted."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=DEMO_RUNNERS_GROUP)})


def demo_runner(name: str | None = None) -> DemoRunner:
    """The installed demo runner called ``name``, or the only one installed (``lithops`` when
    there are several). Raises :class:`ConfigError` when there is none or no such one."""
    from importlib.metadata import entry_points

    found = {ep.name: ep for ep in entry_points(group=DEMO_RUNNERS_GROUP)}
    if not found:
        raise ConfigError(
            "no demo runner is installed: the demo's tasks run on a framework adapter, e.g. "
            "pip install -e adapters/lithops (make install does it)"
        )
    if name is None:
        name = next(iter(found)) if len(found) == 1 else DEFAULT_DEMO_RUNNER
    if name not in found:
        raise ConfigError(f"no demo runner {name!r} is installed (installed: "
                          f"{', '.join(sorted(found))})")
    runner: DemoRunner = found[name].load()
    return runner
