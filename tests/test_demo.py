"""Tests of the demo sort's core: its record helpers and validation (pure), and how the
``pocketflow demo`` command finds a runner. The runs themselves are the runner's tests
(``adapters/lithops/tests/test_sort.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scenario_runner import run_scenario

from pocketflow.demo import (
    KEY_BYTES,
    PartitionCheck,
    SortConfig,
    check_output,
    demo_runner,
    demo_runner_names,
    forget_inherited_lithops_session,
    generate_records,
    group_by_partition,
    is_sorted,
    lithops_config,
    partition_of,
    record_checksum,
    sort_records,
    sort_runs,
)
from pocketflow.errors import ConfigError


def test_generation_is_deterministic_and_covers_every_record() -> None:
    config = SortConfig(mappers=3, reducers=2, records=1000, seed=7)
    parts = [generate_records(config, m) for m in range(3)]
    assert sum(p.shape[0] for p in parts) == 1000
    assert all(p.shape[1] == 100 for p in parts)
    assert np.array_equal(parts[1], generate_records(config, 1))
    other_seed = SortConfig(mappers=3, reducers=2, records=1000, seed=8)
    assert not np.array_equal(parts[0], generate_records(other_seed, 0))


def test_checksum_ignores_order_but_sees_changes() -> None:
    records = generate_records(SortConfig(mappers=1, records=500), 0)
    shuffled = records[np.random.default_rng(1).permutation(500)]
    assert record_checksum(records) == record_checksum(shuffled)
    altered = records.copy()
    altered[17, 50] ^= 1
    assert record_checksum(altered) != record_checksum(records)
    assert record_checksum(records[:-1]) != record_checksum(records)
    duplicated = np.concatenate([records[:-1], records[:1]])
    assert record_checksum(duplicated) != record_checksum(records)


def test_sort_orders_keys_bytewise() -> None:
    records = generate_records(SortConfig(mappers=1, records=2000), 0)
    ordered = sort_records(records)
    keys = [bytes(row[:KEY_BYTES]) for row in ordered]
    assert keys == sorted(bytes(row[:KEY_BYTES]) for row in records)
    assert is_sorted(ordered) and not is_sorted(records)


def _reference_sort(records: np.ndarray) -> np.ndarray:
    """Records ordered by their key bytes, byte by byte (a lexsort of ten columns)."""
    return records[np.lexsort(tuple(records[:, i] for i in range(KEY_BYTES - 1, -1, -1)))]


@pytest.mark.parametrize("shared_key_bytes", [0, 2, 6, 8, 9, 10])
def test_sort_orders_keys_that_share_their_first_bytes(shared_key_bytes: int) -> None:
    # Keys whose first 8 bytes (or more of them) repeat are put in order by the rest of the
    # key, not by where they came from: the sort's fast path orders by those 8 bytes only.
    rng = np.random.default_rng(shared_key_bytes)
    records = rng.integers(0, 256, (3000, 100), dtype=np.uint8)
    if shared_key_bytes:
        source = rng.integers(0, 40, records.shape[0])
        records[:, :shared_key_bytes] = records[source, :shared_key_bytes]
    ordered = sort_records(records)
    assert np.array_equal(ordered[:, :KEY_BYTES], _reference_sort(records)[:, :KEY_BYTES])
    assert is_sorted(ordered)
    assert record_checksum(ordered) == record_checksum(records)


@pytest.mark.parametrize("shared_key_bytes", [0, 8, 10])
def test_runs_are_sorted_together_as_one(shared_key_bytes: int) -> None:
    rng = np.random.default_rng(100 + shared_key_bytes)
    records = rng.integers(0, 256, (2500, 100), dtype=np.uint8)
    if shared_key_bytes:
        source = rng.integers(0, 40, records.shape[0])
        records[:, :shared_key_bytes] = records[source, :shared_key_bytes]
    cuts = [0, 0, 300, 301, 1700, 2500, 2500]
    runs = [records[a:b].tobytes() for a, b in zip(cuts, cuts[1:], strict=False)]
    ordered = sort_runs(runs)
    assert np.array_equal(ordered[:, :KEY_BYTES], _reference_sort(records)[:, :KEY_BYTES])
    assert record_checksum(ordered) == record_checksum(records)
    assert sort_runs([]).shape == (0, 100)


def test_sort_of_no_record_or_one() -> None:
    for count in (0, 1):
        records = generate_records(SortConfig(mappers=1, records=count), 0)
        assert np.array_equal(sort_records(records), records)


def test_checksum_sees_a_change_in_any_byte() -> None:
    records = generate_records(SortConfig(mappers=1, records=50), 0)
    checksum = record_checksum(records)
    for at in range(100):
        altered = records.copy()
        altered[7, at] ^= 0x80
        assert record_checksum(altered) != checksum, at
    # Two records trading a word at the same place still change it.
    traded = records.copy()
    traded[[3, 4], 8:16] = traded[[4, 3], 8:16]
    assert record_checksum(traded) != checksum


def test_grouping_by_partition_keeps_each_partition_s_records_in_order() -> None:
    records = generate_records(SortConfig(mappers=1, records=5000), 0)
    grouped, bounds = group_by_partition(records, 7)
    parts = partition_of(records, 7)
    assert bounds[0] == 0 and bounds[-1] == records.shape[0] and len(bounds) == 8
    for r in range(7):
        assert np.array_equal(grouped[bounds[r]:bounds[r + 1]], records[parts == r])


def test_partitions_beyond_the_key_prefix_are_refused() -> None:
    records = generate_records(SortConfig(mappers=1, records=10), 0)
    assert partition_of(records, 1 << 16).max() < 1 << 16
    with pytest.raises(ValueError, match="reducers"):
        partition_of(records, (1 << 16) + 1)


def test_range_partitions_are_ordered() -> None:
    records = generate_records(SortConfig(mappers=1, records=5000), 0)
    parts = partition_of(records, 4)
    assert set(parts.tolist()) == {0, 1, 2, 3}
    highest = [max(bytes(r[:KEY_BYTES]) for r in records[parts == p]) for p in range(3)]
    lowest = [min(bytes(r[:KEY_BYTES]) for r in records[parts == p]) for p in range(1, 4)]
    assert all(h < lo for h, lo in zip(highest, lowest, strict=True))


def _check(reducer: int, records: np.ndarray) -> PartitionCheck:
    return PartitionCheck(
        reducer=reducer,
        records=records.shape[0],
        checksum=record_checksum(records),
        is_sorted=is_sorted(records),
        first_key=bytes(records[0, :KEY_BYTES]) if len(records) else None,
        last_key=bytes(records[-1, :KEY_BYTES]) if len(records) else None,
        bytes_read=records.size,
    )


def test_validation_accepts_a_correct_sort_and_names_each_fault() -> None:
    config = SortConfig(mappers=1, reducers=2, records=3000)
    records = generate_records(config, 0)
    checksum = record_checksum(records)
    parts = partition_of(records, 2)
    good = [_check(r, sort_records(records[parts == r])) for r in range(2)]
    assert check_output(config, input_checksum=checksum, checks=good) == []

    unsorted = [_check(0, records[parts == 0]), good[1]]
    assert any("not sorted" in p for p in check_output(config, input_checksum=checksum,
                                                      checks=unsorted))
    swapped = [PartitionCheck(**{**good[1].__dict__, "reducer": 0}),
               PartitionCheck(**{**good[0].__dict__, "reducer": 1})]
    assert any("before partition" in p for p in check_output(config, input_checksum=checksum,
                                                            checks=swapped))
    short = [good[0], _check(1, sort_records(records[parts == 1])[:-1])]
    problems = check_output(config, input_checksum=checksum, checks=short)
    assert any("records" in p for p in problems) and any("checksum" in p for p in problems)
    assert any("partitions" in p for p in check_output(config, input_checksum=checksum,
                                                       checks=good[:1]))


def test_bad_sort_configs_are_refused() -> None:
    with pytest.raises(ValueError):
        SortConfig(mappers=0)
    with pytest.raises(ValueError):
        SortConfig(records=-1)


def test_lithops_config_is_the_localhost_executor() -> None:
    config = lithops_config(storage="redis", workers=3, extra={"redis": {"port": 1}})
    assert config["lithops"]["backend"] == "localhost"
    assert config["lithops"]["storage"] == "redis"
    assert config["localhost"] == {"runtime": sys.executable, "version": 1,
                                   "worker_processes": 3}
    assert config["redis"] == {"port": 1}


def test_a_command_forgets_the_lithops_session_it_inherited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("__LITHOPS_SESSION_ID", "abc123")
    monkeypatch.setenv("__LITHOPS_TOTAL_EXECUTORS", "4")
    monkeypatch.setenv("LITHOPS_CONFIG_FILE", "/nonexistent")
    forget_inherited_lithops_session()
    assert "__LITHOPS_SESSION_ID" not in os.environ
    assert "__LITHOPS_TOTAL_EXECUTORS" not in os.environ
    assert os.environ["LITHOPS_CONFIG_FILE"] == "/nonexistent"


def test_the_command_finds_the_runner_an_adapter_installed() -> None:
    # pocketflow-lithops names its runner in the entry-point group; the core imports no adapter.
    assert "lithops" in demo_runner_names()
    runner = demo_runner("lithops")
    assert type(runner).__module__ == "pocketflow_lithops.sort"
    assert callable(runner.prepare) and callable(runner.run)
    assert demo_runner() is runner or len(demo_runner_names()) > 1
    with pytest.raises(ConfigError, match="no demo runner 'nosuch' is installed"):
        demo_runner("nosuch")


CLUSTER_GONE_TIMEOUT_S = 420.0
"""Bound on the scenario below: its own cluster's start, the kill, the exit and the checks."""
CLUSTER_GONE_EXIT_S = 30.0
"""How soon the demo must exit once its cluster is gone (slack for a loaded machine; it took
minutes before, or never)."""


def test_a_demo_whose_whole_cluster_is_killed_exits_within_seconds() -> None:
    # Issue 29 item 9: the demo's own local cluster (GCS, raylet, workers, controller, storage
    # servers) is SIGKILLed while the shuffle runs. The demo must fail within seconds with an
    # error that says the cluster is gone, exit non-zero, and leave none of its processes.
    seen = run_scenario("cluster_gone", timeout_s=CLUSTER_GONE_TIMEOUT_S)
    shown = json.dumps(seen)  # whole, where pytest would cut a dict's repr
    assert seen["shuffle_started"] and seen["killed"] > 0, shown
    assert seen["shuffle_running_at_kill"], shown
    assert seen["exited"], shown
    assert seen["exit_after_kill_s"] < CLUSTER_GONE_EXIT_S, shown
    assert seen["returncode"] != 0, shown
    assert any("gone" in line for line in seen["said"]), shown
    assert seen["left"] == [], shown


RAY_START_FAILURE_TIMEOUT_S = 120.0
"""Bound on the demo command below (Ray refuses its socket path at once)."""


def test_a_demo_whose_ray_cannot_start_says_so_without_a_traceback(tmp_path: Path) -> None:
    """Ray's own start failures (its raylet missing Ray's 30 s start bound on a loaded machine
    raises a plain ``Exception``; an unusable temp dir an ``OSError``) came out of ``pocketflow
    demo`` as raw tracebacks. They are a ``ClusterError`` now: one line saying Ray could not
    start, a failed exit, and no Ray process left behind. Here Ray's temp dir is too long for
    its Unix sockets."""
    too_long = tmp_path / ("d" * 110)
    too_long.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["RAY_TMPDIR"] = str(too_long)
    proc = subprocess.run(
        [sys.executable, "-m", "pocketflow", "demo", "--records", "1000", "--no-progress"],
        capture_output=True, text=True, env=env, timeout=RAY_START_FAILURE_TIMEOUT_S,
        start_new_session=True,
    )
    assert proc.returncode != 0, proc.stdout
    assert "pocketflow demo: could not start Ray" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
