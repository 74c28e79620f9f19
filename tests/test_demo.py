"""Tests of the demo sort: its record helpers and validation (pure), and a small end-to-end run."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
from fixtures_cluster import used_bytes, wait_for

from pocketflow.cluster import LocalCluster
from pocketflow.demo import (
    KEY_BYTES,
    PartitionCheck,
    SortConfig,
    check_output,
    forget_inherited_lithops_session,
    generate_records,
    is_sorted,
    lithops_config,
    partition_of,
    record_checksum,
    run_sort,
    sort_records,
)

SORT_TIMEOUT_S = 240
"""Bound on each stage of a test sort: a stuck Lithops job fails the test instead of hanging."""


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


def test_small_sort_end_to_end(local_cluster: LocalCluster) -> None:
    baseline = used_bytes(local_cluster)
    config = SortConfig(mappers=3, reducers=2, records=30_000, seed=3, processes=2,
                        block_size_bytes=64 * 1024)
    report = run_sort(local_cluster, config, progress=False, timeout_s=SORT_TIMEOUT_S)
    assert report.ok, report.problems
    assert report.output_records == 30_000
    assert report.output_checksum == report.input_checksum
    # Mappers and reducers each wrote the data once; reducers and the check each read it once.
    assert report.bytes_written == 2 * config.input_bytes
    assert report.bytes_read == 2 * config.input_bytes
    assert report.peak_used_bytes > report.baseline_used_bytes
    assert report.regenerated_partitions == 0
    assert "validation: OK" in "\n".join(report.summary_lines())
    # The shuffle registered its own job and deregistered it at the end.
    assert report.job_id not in {j["job_id"] for j in local_cluster.status()["jobs"]}
    # Shuffle objects were consumed on read, output deleted, the job deregistered: nothing left.
    assert wait_for(lambda: used_bytes(local_cluster) == baseline), used_bytes(local_cluster)


def test_lithops_config_is_the_localhost_executor() -> None:
    config = lithops_config(storage="redis", workers=3, extra={"redis": {"port": 1}})
    assert config["lithops"]["backend"] == "localhost"
    assert config["lithops"]["storage"] == "redis"
    assert config["localhost"] == {"runtime": sys.executable, "version": 1,
                                   "worker_processes": 3}
    assert config["redis"] == {"port": 1}


@pytest.mark.skipif(importlib.util.find_spec("pocketflow_lithops.storage") is None,
                    reason="pocketflow's Lithops storage backend is not in this checkout")
def test_small_sort_with_lithops_own_data_in_pocketflow(local_cluster: LocalCluster) -> None:
    config = SortConfig(mappers=2, reducers=2, records=10_000, seed=4, processes=2)
    jobs_before = {j["job_id"] for j in local_cluster.status()["jobs"]}
    report = run_sort(local_cluster, config, progress=False, lithops_storage="pocket",
                      timeout_s=SORT_TIMEOUT_S)
    assert report.ok, report.problems
    # Both the shuffle's job and the job holding Lithops' data are deregistered.
    assert {j["job_id"] for j in local_cluster.status()["jobs"]} == jobs_before


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
