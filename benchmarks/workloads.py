"""The workload every peer runs, and the statistics both benchmark front ends compute from it.

A *phase* is one client putting, getting or deleting a list of keys (one op at a time, or in
pipelined batches); :func:`run_phase` times each operation (or batch) and records when the phase
started and ended on the machine-wide monotonic clock, so phases of concurrent client processes
can be combined into one wall-clock window (:func:`combine`).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KiB = 1024
MiB = 1024 * KiB
GB = 1e9
"""Throughput is reported in decimal GB/s (10^9 bytes per second)."""

PUT = "put"
GET = "get"
PUT_MANY = "put_many"
GET_MANY = "get_many"
DELETE = "delete"
PHASES = (PUT, GET, PUT_MANY, GET_MANY, DELETE)

PAYLOADS_CACHED_MAX = 4
"""Distinct payload sizes kept in memory by one process."""

CDF_POINTS_MAX = 200
"""Points kept per latency CDF in the results."""


def clock_ns() -> int:
    """CLOCK_MONOTONIC in ns: one clock for every process of the machine."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@functools.lru_cache(maxsize=PAYLOADS_CACHED_MAX)
def payload(size_bytes: int) -> bytes:
    """Random (incompressible) bytes of the given size, made once per process and size."""
    return os.urandom(size_bytes)


def format_size(size_bytes: int) -> str:
    """``1 KiB``, ``64 MiB``, ``100 B``."""
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale} {unit}"
    return f"{size_bytes} B"


def round_keys(cell: str, round_index: int, client: int, count: int) -> tuple[str, list[str]]:
    """The key prefix and keys one client uses in one round of a cell."""
    prefix = f"{cell}/r{round_index}/c{client}/"
    return prefix, [f"{prefix}{i}" for i in range(count)]


@dataclass
class PhaseResult:
    """What one client measured in one phase."""

    phase: str
    ops: int
    bytes: int
    start_ns: int
    end_ns: int
    latencies_ns: list[int] = field(default_factory=list)
    """One entry per operation (PUT/GET) or per batch (PUT_MANY/GET_MANY)."""


def run_phase(
    client: Any,
    phase: str,
    *,
    prefix: str,
    keys: Sequence[str],
    size_bytes: int,
    batch_ops: int = 1,
    start_at_ns: int | None = None,
    seconds_max: float | None = None,
) -> PhaseResult:
    """Run one phase of ``keys`` on ``client`` (a :class:`benchmarks.peers.PeerClient`).

    A client with a ``timed_phase`` method (the native TCP client) runs PUT and GET phases
    itself and returns their :class:`PhaseResult`. Otherwise: waits until ``start_at_ns``
    first (so concurrent clients start together). Every GET checks
    the length of what it received, and the first GET of the phase its bytes too (unless the
    peer stores nothing, like the TCP peer). Batched phases send ``batch_ops`` keys per call.
    With ``seconds_max`` no new operation (or batch) starts after that long, so ``ops`` of the
    result may be fewer than ``len(keys)``: the keys done are ``keys[:ops]``.
    """
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")
    if batch_ops < 1:
        raise ValueError("batch_ops must be at least 1")
    timed_phase = getattr(client, "timed_phase", None)
    if timed_phase is not None and phase != DELETE:
        # A native client times the phase in its own loop, on the same clock.
        result: PhaseResult = timed_phase(
            phase, keys=keys, size_bytes=size_bytes, batch_ops=batch_ops,
            start_at_ns=start_at_ns, seconds_max=seconds_max,
        )
        return result
    data = payload(size_bytes)
    if start_at_ns is not None:
        delay_ns = start_at_ns - clock_ns()
        if delay_ns > 0:
            time.sleep(delay_ns / 1e9)
    latencies: list[int] = []
    done = 0
    start = clock_ns()
    stop_after = None if seconds_max is None else start + int(seconds_max * 1e9)
    if phase == PUT:
        for key in keys:
            t0 = clock_ns()
            if stop_after is not None and done and t0 > stop_after:
                break
            client.put(key, data)
            latencies.append(clock_ns() - t0)
            done += 1
    elif phase == GET:
        first: Any = None
        for key in keys:
            t0 = clock_ns()
            if stop_after is not None and done and t0 > stop_after:
                break
            value = client.get(key)
            latencies.append(clock_ns() - t0)
            done += 1
            _check_length(key, value, size_bytes)
            first = value if first is None else first
        if first is not None and client.stores_data:
            _check_first(keys[0], first, data)
    elif phase in (PUT_MANY, GET_MANY):
        for offset in range(0, len(keys), batch_ops):
            batch = keys[offset : offset + batch_ops]
            t0 = clock_ns()
            if stop_after is not None and done and t0 > stop_after:
                break
            if phase == PUT_MANY:
                client.put_many([(key, data) for key in batch])
            else:
                values = client.get_many(batch)
            latencies.append(clock_ns() - t0)
            done += len(batch)
            if phase == GET_MANY:
                if len(values) != len(batch):
                    raise AssertionError(f"get_many returned {len(values)} of {len(batch)} values")
                for key, value in zip(batch, values, strict=True):
                    _check_length(key, value, size_bytes)
    else:
        client.delete_many(prefix, list(keys))
        done = len(keys)
    end = clock_ns()
    moved = 0 if phase == DELETE else size_bytes * done
    return PhaseResult(
        phase=phase, ops=done, bytes=moved, start_ns=start, end_ns=end, latencies_ns=latencies,
    )


def _check_length(key: str, value: Any, size_bytes: int) -> None:
    if len(value) != size_bytes:
        raise AssertionError(f"{key}: got {len(value)} bytes, expected {size_bytes}")


def _check_first(key: str, value: Any, data: bytes) -> None:
    if bytes(value) != data:
        raise AssertionError(f"{key}: the bytes read differ from the bytes written")


# -- statistics ---------------------------------------------------------------------------------


def summarize_ns(latencies_ns: Sequence[float]) -> dict[str, float]:
    """p50, p99, mean, min and max in microseconds, and the sample count."""
    if len(latencies_ns) == 0:
        raise ValueError("no latency samples")
    us = np.asarray(latencies_ns, dtype=np.float64) / 1e3
    p50, p99 = np.percentile(us, [50, 99])
    return {
        "p50_us": float(p50),
        "p99_us": float(p99),
        "mean_us": float(us.mean()),
        "min_us": float(us.min()),
        "max_us": float(us.max()),
        "samples": int(us.size),
    }


def cdf_points(latencies_ns: Sequence[float], points: int = CDF_POINTS_MAX) -> list[list[float]]:
    """``[[latency_us, fraction], ...]`` at up to ``points`` evenly spaced quantiles."""
    us = np.sort(np.asarray(latencies_ns, dtype=np.float64)) / 1e3
    if us.size == 0:
        return []
    fractions = np.linspace(0.0, 1.0, num=min(points, us.size))
    values = np.quantile(us, fractions)
    # Rounded: 0.01 us and 1e-4 of the distribution are finer than anything measured here.
    pairs = zip(values, fractions, strict=True)
    return [[round(float(v), 2), round(float(f), 4)] for v, f in pairs]


@dataclass
class Figures:
    """Combined figures of one phase kind over all clients and rounds of a cell."""

    ops: int
    bytes: int
    wall_s: float
    latency: dict[str, float]
    latencies_ns: list[int]

    @property
    def ops_per_s(self) -> float:
        """Operations (objects, not batches) per second over the phases' wall-clock time."""
        return self.ops / self.wall_s

    @property
    def gb_per_s(self) -> float:
        """Decimal GB per second over the phases' wall-clock time."""
        return self.bytes / self.wall_s / GB

    def as_dict(self) -> dict[str, Any]:
        """JSON form (without the raw samples)."""
        return {
            "ops": self.ops,
            "bytes": self.bytes,
            "wall_s": self.wall_s,
            "ops_per_s": self.ops_per_s,
            "gb_per_s": self.gb_per_s,
            **self.latency,
        }


def combine(rounds: Sequence[Sequence[PhaseResult]]) -> Figures:
    """Figures of a phase run by several clients over several rounds.

    A round's wall-clock time is from the first client's start to the last client's end (all
    clients started together); throughput is total bytes over the rounds' summed wall time.
    """
    ops = 0
    moved = 0
    wall_ns = 0
    latencies: list[int] = []
    for results in rounds:
        if not results:
            continue
        wall_ns += max(r.end_ns for r in results) - min(r.start_ns for r in results)
        for r in results:
            ops += r.ops
            moved += r.bytes
            latencies.extend(r.latencies_ns)
    if wall_ns <= 0 or not latencies:
        raise ValueError("no completed phase to combine")
    return Figures(
        ops=ops, bytes=moved, wall_s=wall_ns / 1e9, latency=summarize_ns(latencies),
        latencies_ns=latencies,
    )


ROUND_FIGURES = ("ops_per_s", "gb_per_s", "p50_us", "p99_us")
"""The figures of one round of a phase (see :func:`round_figures`); a cell reports each as the
median over its rounds with the spread (:mod:`benchmarks.spread`)."""


def round_figures(results: Sequence[PhaseResult]) -> dict[str, float]:
    """The figures of one round of a phase run by ``len(results)`` clients started together:
    objects and decimal GB per second over the round's wall-clock window (first client's start
    to last client's end), and p50/p99 of its operations' (or batches') latencies."""
    figures = combine([results])
    return {
        "ops_per_s": figures.ops_per_s,
        "gb_per_s": figures.gb_per_s,
        "p50_us": figures.latency["p50_us"],
        "p99_us": figures.latency["p99_us"],
    }


def all_finite_positive(values: Sequence[float]) -> bool:
    """Whether every value is a finite number above zero (the harness's sanity check)."""
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)
