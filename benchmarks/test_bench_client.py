"""pytest-benchmark suite: one client's put/get latency and throughput on each peer.

Run with ``python -m pytest benchmarks/ --benchmark-only`` (add ``--bench-peers`` to choose
peers). Each test reports pytest-benchmark's own statistics plus ``p50_us``, ``p99_us``,
``ops_per_s`` and ``gb_per_s`` in ``extra_info``, computed from the raw round timings. Tests are
grouped by operation and size, so the peers of one group are compared side by side.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from benchmarks.peers import Peer
from benchmarks.workloads import GB, KiB, MiB, format_size, payload, summarize_ns

SMALL_BYTES = 1 * KiB
LARGE_SIZES = (1 * MiB, 64 * MiB)
BATCH_OPS = 100
ROUNDS = {1 * KiB: 2000, 1 * MiB: 100, 64 * MiB: 8}
"""Timed rounds per test, by object size (each test also runs warm-up rounds)."""
BATCH_ROUNDS = 100
WARMUP_ROUNDS = 2

_serial = itertools.count()


def _key(test: str) -> str:
    # Fixed-width numbers: no key is a prefix of another, so deleting a key by prefix is exact.
    return f"pytest-bench/{test}/{next(_serial):09d}"


def _record(benchmark: Any, *, objects_per_round: int, bytes_per_round: int) -> None:
    """Put p50/p99 and throughput from the raw round timings into ``extra_info``."""
    if benchmark.disabled or benchmark.stats is None:
        return
    seconds = benchmark.stats.stats.data
    summary = summarize_ns([s * 1e9 for s in seconds])
    mean_s = sum(seconds) / len(seconds)
    benchmark.extra_info.update(
        p50_us=summary["p50_us"],
        p99_us=summary["p99_us"],
        ops_per_s=objects_per_round / mean_s,
        gb_per_s=bytes_per_round / mean_s / GB,
    )


def _bench_put(benchmark: Any, peer: Peer, size_bytes: int, rounds: int) -> None:
    """Time ``put`` of fresh keys; each round's previous key is deleted outside the timing."""
    client = peer.client()
    data = payload(size_bytes)
    last: list[str] = []

    def setup() -> tuple[tuple[str, bytes], dict[str, Any]]:
        if last:
            client.delete_many(last[0], last)
            last.clear()
        key = _key(f"put-{size_bytes}")
        last.append(key)
        return (key, data), {}

    benchmark.group = f"put {format_size(size_bytes)}"
    try:
        benchmark.pedantic(
            client.put, setup=setup, rounds=rounds, iterations=1, warmup_rounds=WARMUP_ROUNDS
        )
    finally:
        if last:
            client.delete_many(last[0], last)
    _record(benchmark, objects_per_round=1, bytes_per_round=size_bytes)


def _bench_get(benchmark: Any, peer: Peer, size_bytes: int, rounds: int) -> None:
    """Time ``get`` of one stored object, checking its bytes once."""
    client = peer.client()
    data = payload(size_bytes)
    key = _key(f"get-{size_bytes}")
    client.put(key, data)
    benchmark.group = f"get {format_size(size_bytes)}"
    try:
        value = benchmark.pedantic(
            client.get, args=(key,), rounds=rounds, iterations=1, warmup_rounds=WARMUP_ROUNDS
        )
        assert len(value) == size_bytes
        if client.stores_data:
            assert bytes(value) == data
    finally:
        client.delete_many(key, [key])
    _record(benchmark, objects_per_round=1, bytes_per_round=size_bytes)


def test_put_1k(benchmark: Any, peer: Peer) -> None:
    """Latency of one 1 KiB put."""
    _bench_put(benchmark, peer, SMALL_BYTES, ROUNDS[SMALL_BYTES])


def test_get_1k(benchmark: Any, peer: Peer) -> None:
    """Latency of one 1 KiB get."""
    _bench_get(benchmark, peer, SMALL_BYTES, ROUNDS[SMALL_BYTES])


def test_put_many_1k(benchmark: Any, peer: Peer) -> None:
    """Pipelined puts: one ``put_many`` (a Redis pipeline) of 100 objects of 1 KiB per round."""
    client = peer.client()
    data = payload(SMALL_BYTES)
    last: list[list[str]] = []

    def setup() -> tuple[tuple[list[tuple[str, bytes]]], dict[str, Any]]:
        if last:
            prefix = last[0][0].rsplit("/", 1)[0] + "/"
            client.delete_many(prefix, last.pop())
        batch = _key("put-many")
        keys = [f"{batch}/{i:04d}" for i in range(BATCH_OPS)]
        last.append(keys)
        return ([(k, data) for k in keys],), {}

    benchmark.group = f"put_many {BATCH_OPS} x {format_size(SMALL_BYTES)}"
    try:
        benchmark.pedantic(
            client.put_many, setup=setup, rounds=BATCH_ROUNDS, iterations=1,
            warmup_rounds=WARMUP_ROUNDS,
        )
    finally:
        if last:
            prefix = last[0][0].rsplit("/", 1)[0] + "/"
            client.delete_many(prefix, last.pop())
    _record(benchmark, objects_per_round=BATCH_OPS, bytes_per_round=BATCH_OPS * SMALL_BYTES)


def test_get_many_1k(benchmark: Any, peer: Peer) -> None:
    """Pipelined gets: one ``get_many`` (a Redis pipeline) of 100 objects of 1 KiB per round."""
    client = peer.client()
    batch = _key("get-many")
    keys = [f"{batch}/{i:04d}" for i in range(BATCH_OPS)]
    client.put_many([(k, payload(SMALL_BYTES)) for k in keys])
    benchmark.group = f"get_many {BATCH_OPS} x {format_size(SMALL_BYTES)}"
    try:
        values = benchmark.pedantic(
            client.get_many, args=(keys,), rounds=BATCH_ROUNDS, iterations=1,
            warmup_rounds=WARMUP_ROUNDS,
        )
        assert [len(v) for v in values] == [SMALL_BYTES] * BATCH_OPS
    finally:
        client.delete_many(batch + "/", keys)
    _record(benchmark, objects_per_round=BATCH_OPS, bytes_per_round=BATCH_OPS * SMALL_BYTES)


@pytest.mark.parametrize("size_bytes", LARGE_SIZES, ids=format_size)
def test_put_large(benchmark: Any, peer: Peer, size_bytes: int) -> None:
    """Throughput of one large put (1 MiB, 64 MiB)."""
    _bench_put(benchmark, peer, size_bytes, ROUNDS[size_bytes])


@pytest.mark.parametrize("size_bytes", LARGE_SIZES, ids=format_size)
def test_get_large(benchmark: Any, peer: Peer, size_bytes: int) -> None:
    """Throughput of one large get (1 MiB, 64 MiB)."""
    _bench_get(benchmark, peer, size_bytes, ROUNDS[size_bytes])
