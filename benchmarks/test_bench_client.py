"""pytest-benchmark suite: one client's put/get latency and throughput on each peer.

Run with ``python -m pytest benchmarks/test_bench_client.py --benchmark-only`` (add
``--bench-peers`` to choose peers). Each test reports pytest-benchmark's own statistics plus
``p50_us``, ``p99_us``, ``ops_per_s`` and ``gb_per_s`` in ``extra_info``, computed from the raw
round timings. Tests are grouped by operation and size, so the peers of one group are compared
side by side. Every round's result is checked outside the timing (:mod:`benchmarks.rounds`):
what a get returns has the bytes that were put, what a put stored can be read back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from benchmarks.peers import Peer, PeerClient
from benchmarks.rounds import fresh_key, record_figures, verified_rounds
from benchmarks.workloads import KiB, MiB, format_size, payload
from pocketflow.errors import ObjectNotFound

SMALL_BYTES = 1 * KiB
SIZES_BYTES = (64 * KiB, 1 * MiB, 64 * MiB)
"""Sizes of the single-object put/get cases besides 1 KiB (64 KiB is the largest object that
pocketflow still sends whole over the pipelined session; larger ones are striped in blocks)."""
ROUNDS = {1 * KiB: 2000, 64 * KiB: 500, 1 * MiB: 100, 64 * MiB: 8}
"""Timed rounds per test, by object size (each test also runs warm-up rounds)."""
BATCH_OPS = 100
BATCH_ROUNDS = 100
GET_DELETE_SIZES = (1 * KiB, 1 * MiB)
GET_DELETE_PEERS = ("pocketflow-dram", "pocketflow-nvme", "redis")
"""Peers that read and free an object in one request (pocketflow's DELETE flag, Redis GETDEL)."""


def check_value(client: PeerClient, value: Any, data: bytes) -> None:
    """``value`` is ``data`` (only its length, for a peer that stores nothing)."""
    assert len(value) == len(data), f"got {len(value)} bytes, put {len(data)}"
    if client.stores_data:
        assert bytes(value) == data, "the bytes read differ from the bytes put"


def check_values(client: PeerClient, values: Sequence[Any], data: bytes, count: int) -> None:
    """``values`` are ``count`` copies of ``data``."""
    assert len(values) == count, f"got {len(values)} values, expected {count}"
    for value in values:
        check_value(client, value, data)


def _bench_put(benchmark: Any, peer: Peer, size_bytes: int, rounds: int) -> None:
    """Time ``put`` of a fresh key; each round's object is read back and deleted untimed."""
    client = peer.client()
    data = payload(size_bytes)

    def check(args: tuple[Any, ...], result: Any) -> None:
        key = args[0]
        try:
            check_value(client, client.get(key), data)
        finally:
            client.delete_many(key, [key])

    benchmark.group = f"put {format_size(size_bytes)}"
    verified_rounds(
        benchmark, client.put, prepare=lambda: (fresh_key(f"put-{size_bytes}"), data),
        check=check, rounds=rounds,
    )
    record_figures(benchmark, objects_per_round=1, bytes_per_round=size_bytes)


def _bench_get(benchmark: Any, peer: Peer, size_bytes: int, rounds: int) -> None:
    """Time ``get`` of one stored object; every round's bytes are checked untimed."""
    client = peer.client()
    data = payload(size_bytes)
    key = fresh_key(f"get-{size_bytes}")
    client.put(key, data)
    benchmark.group = f"get {format_size(size_bytes)}"
    try:
        verified_rounds(
            benchmark, client.get, prepare=lambda: (key,),
            check=lambda args, value: check_value(client, value, data), rounds=rounds,
        )
    finally:
        client.delete_many(key, [key])
    record_figures(benchmark, objects_per_round=1, bytes_per_round=size_bytes)


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

    def prepare() -> tuple[list[tuple[str, bytes]]]:
        batch = fresh_key("put-many")
        return ([(f"{batch}/{i:04d}", data) for i in range(BATCH_OPS)],)

    def check(args: tuple[Any, ...], result: Any) -> None:
        keys = [key for key, _ in args[0]]
        try:
            check_values(client, client.get_many(keys), data, BATCH_OPS)
        finally:
            client.delete_many(keys[0].rsplit("/", 1)[0] + "/", keys)

    benchmark.group = f"put_many {BATCH_OPS} x {format_size(SMALL_BYTES)}"
    verified_rounds(benchmark, client.put_many, prepare=prepare, check=check, rounds=BATCH_ROUNDS)
    record_figures(benchmark, objects_per_round=BATCH_OPS, bytes_per_round=BATCH_OPS * SMALL_BYTES)


def test_get_many_1k(benchmark: Any, peer: Peer) -> None:
    """Pipelined gets: one ``get_many`` (a Redis pipeline) of 100 objects of 1 KiB per round."""
    client = peer.client()
    data = payload(SMALL_BYTES)
    batch = fresh_key("get-many")
    keys = [f"{batch}/{i:04d}" for i in range(BATCH_OPS)]
    client.put_many([(k, data) for k in keys])
    benchmark.group = f"get_many {BATCH_OPS} x {format_size(SMALL_BYTES)}"
    try:
        verified_rounds(
            benchmark, client.get_many, prepare=lambda: (keys,),
            check=lambda args, values: check_values(client, values, data, BATCH_OPS),
            rounds=BATCH_ROUNDS,
        )
    finally:
        client.delete_many(batch + "/", keys)
    record_figures(benchmark, objects_per_round=BATCH_OPS, bytes_per_round=BATCH_OPS * SMALL_BYTES)


@pytest.mark.parametrize("size_bytes", SIZES_BYTES, ids=format_size)
def test_put_sized(benchmark: Any, peer: Peer, size_bytes: int) -> None:
    """Latency and throughput of one put of 64 KiB, 1 MiB, 64 MiB."""
    _bench_put(benchmark, peer, size_bytes, ROUNDS[size_bytes])


@pytest.mark.parametrize("size_bytes", SIZES_BYTES, ids=format_size)
def test_get_sized(benchmark: Any, peer: Peer, size_bytes: int) -> None:
    """Latency and throughput of one get of 64 KiB, 1 MiB, 64 MiB."""
    _bench_get(benchmark, peer, size_bytes, ROUNDS[size_bytes])


@pytest.mark.peers(*GET_DELETE_PEERS)
@pytest.mark.parametrize("size_bytes", GET_DELETE_SIZES, ids=format_size)
def test_get_delete(benchmark: Any, peer: Peer, size_bytes: int) -> None:
    """DELETE-on-read: each round puts a fresh object (untimed), then one timed get that frees
    it. The check reads the bytes and that the object is gone."""
    client = peer.client()
    data = payload(size_bytes)
    get_delete = client.get_delete  # type: ignore[attr-defined]

    def prepare() -> tuple[str]:
        key = fresh_key(f"get-delete-{size_bytes}")
        client.put(key, data)
        return (key,)

    def check(args: tuple[Any, ...], value: Any) -> None:
        key = args[0]
        check_value(client, value, data)
        try:
            client.get(key)
        except (KeyError, ObjectNotFound):  # the Redis client's and pocketflow's "no object"
            return
        raise AssertionError(f"{key} is still there after a delete-on-read")

    benchmark.group = f"get_delete {format_size(size_bytes)}"
    verified_rounds(benchmark, get_delete, prepare=prepare, check=check,
                    rounds=ROUNDS[size_bytes] // 2)
    record_figures(benchmark, objects_per_round=1, bytes_per_round=size_bytes)

