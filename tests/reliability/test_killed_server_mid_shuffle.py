"""A shuffle that loses a storage server between its map and reduce phases still delivers a
complete and correct output (issue 12: the reliability suite).

Only pocketflow's public API and spawned worker processes (a bounded multiprocessing pool), no
Lithops. Mappers generate and range-partition 100-byte records (:mod:`pocketflow.demo`) and write
one object per (mapper, reducer). A storage server added to the session cluster for this test,
which holds some of those objects, is SIGKILLed once the mappers are done. Reducers start with
the map they were given (the dead server still in it); one that meets
:class:`~pocketflow.DataUnavailable` reports which mappers' partitions it lost. The driver waits
until the control plane has moved the job off the dead server, reruns exactly those mappers for
exactly those partitions (lineage), and reruns those reducers, a bounded number of rounds. The
output is checked against what the mappers generated: record counts, an order-independent
checksum, sortedness and global order.

A reducer reads its inputs without DELETE and deletes them only once its output is stored: a
reducer that lost one input keeps the others for its rerun. The session's own servers are never
touched; the killed server is removed from the cluster by ``extra_server``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from fixtures_cluster import extra_server, used_bytes, wait_for

import pocketflow
from pocketflow.cluster import LocalCluster
from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.demo import (
    RECORD_BYTES,
    MapResult,
    SortConfig,
    check_output,
    describe_partition,
    map_records,
    reduce_records,
)
from pocketflow.errors import BucketExists, DataUnavailable
from pocketflow.placement import Placement

MAPPERS = 4
REDUCERS = 4
RECORDS = 160_000
"""16 MB of records: partitions of about 1 MB, large objects striped over 1 MiB blocks."""
SEED = 12
POOL_PROCESSES = 3
"""Worker processes of the pool (the machine has 2 cores)."""
TASK_TIMEOUT_S = 90.0
"""Bound on one phase of tasks in the pool."""
ROUNDS_MAX = 3
"""Most rounds of rerunning mappers and reducers after lost partitions."""
MAP_REFRESH_TIMEOUT_S = 30.0
"""How long the driver waits for the control plane to move the job off the dead server."""
DOOMED_CAPACITY_BYTES = 256 * 1024 * 1024
"""The killed server's capacity: a no-hints job (weights by free bytes) puts a good share on it."""
TASK_CLIENT_OPTIONS = {"op_timeout_s": "5s", "connect_timeout_s": "1s"}
SHUFFLE_BUCKET = "shuffle"
OUTPUT_BUCKET = "output"


def partition_key(*, mapper: int, reducer: int) -> str:
    """Key of the object mapper ``mapper`` writes for reducer ``reducer``."""
    return f"r{reducer:03d}/m{mapper:03d}"


def output_key(reducer: int) -> str:
    """Key of reducer ``reducer``'s sorted output."""
    return f"out-{reducer:03d}"


@dataclass(frozen=True)
class ReduceOutcome:
    """What one reducer did: stored its output, or lost inputs, or could not store its output."""

    reducer: int
    lost_mappers: tuple[int, ...] = ()
    output_unwritten: bool = False

    @property
    def complete(self) -> bool:
        return not self.lost_mappers and not self.output_unwritten


# -- the tasks (run in spawned worker processes) ------------------------------------------------


def _map_task(handle_json: str, config: SortConfig, mapper: int,
              only_reducers: tuple[int, ...] | None) -> MapResult:
    """Mapper ``mapper``: generate and partition its records, write its partitions (all of them,
    or on a rerun only ``only_reducers``'). A rerun overwrites: what is left of a lost partition
    (a manifest whose data block died with the server) is replaced."""
    parts: dict[int, np.ndarray] = {}

    def emit(reducer: int, data: Any) -> None:
        parts[reducer] = data

    result = map_records(config, mapper, emit)
    wanted = range(config.reducers) if only_reducers is None else only_reducers
    with pocketflow.connect(handle_json, **TASK_CLIENT_OPTIONS) as pf:
        for reducer in wanted:
            pf.put(SHUFFLE_BUCKET, partition_key(mapper=mapper, reducer=reducer), parts[reducer],
                   overwrite=only_reducers is not None)
    return result


def _reduce_task(handle_json: str, reducer: int, mappers: int) -> ReduceOutcome:
    """Reducer ``reducer``: read its inputs, sort them, store the output, delete the inputs."""
    with pocketflow.connect(handle_json, **TASK_CLIENT_OPTIONS) as pf:
        inputs: dict[int, bytes] = {}
        lost: list[int] = []
        for mapper in range(mappers):
            try:
                inputs[mapper] = pf.get(SHUFFLE_BUCKET,
                                        partition_key(mapper=mapper, reducer=reducer))
            except DataUnavailable:
                lost.append(mapper)
        if lost:
            return ReduceOutcome(reducer, lost_mappers=tuple(lost))
        output = reduce_records(reducer, [inputs[m] for m in range(mappers)])
        try:
            pf.put(OUTPUT_BUCKET, output_key(reducer), output, overwrite=True)
        except DataUnavailable:
            return ReduceOutcome(reducer, output_unwritten=True)
        for mapper in range(mappers):
            pf.delete(SHUFFLE_BUCKET, partition_key(mapper=mapper, reducer=reducer))
    return ReduceOutcome(reducer)


# -- the driver ---------------------------------------------------------------------------------


@pytest.fixture
def doomed_server(local_cluster: LocalCluster) -> Iterator[StorageNodeInfo]:
    """A DRAM server added to the session cluster for this test only, killed by the test."""
    with extra_server(local_cluster, prefix="doomed", capacity_bytes=DOOMED_CAPACITY_BYTES) as (
        info, _
    ):
        yield info


def _run_all(pool: Any, task: Callable[..., Any], calls: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Run ``task`` on every argument tuple in the pool at once; results in call order."""
    return pool.starmap_async(task, calls, chunksize=1).get(TASK_TIMEOUT_S)


def _wait_for_map_without(pf: pocketflow.Client, node_id: str) -> str:
    """Wait until the control plane has moved the job off ``node_id`` (a live server answers
    ``stale_epoch`` with the new map); returns the new handle's JSON."""
    deadline = time.monotonic() + MAP_REFRESH_TIMEOUT_S
    while node_id in {s.node_id for s in pf.handle.servers}:
        assert time.monotonic() < deadline, f"the job's map still names {node_id}"
        try:
            pf.create_bucket(SHUFFLE_BUCKET)
        except (BucketExists, DataUnavailable):
            pass
        time.sleep(0.2)
    return pf.handle.to_json()


def test_partitions_lost_with_a_killed_server_are_regenerated_by_their_mappers(
    local_cluster: LocalCluster, doomed_server: StorageNodeInfo, capsys: pytest.CaptureFixture[str]
) -> None:
    info = doomed_server
    config = SortConfig(mappers=MAPPERS, reducers=REDUCERS, records=RECORDS, seed=SEED)
    session_servers = {s.node_id for s in local_cluster.servers}
    baseline = {k: v for k, v in used_bytes(local_cluster).items() if k in session_servers}
    context = multiprocessing.get_context("spawn")
    started = time.monotonic()
    # Leaving the pool's block terminates its worker processes (by pid), also on a failure.
    with local_cluster.register_job("killed-shuffle") as job, context.Pool(POOL_PROCESSES) as pool:
        handle_json = job.handle.to_json()
        assert info.node_id in {s.node_id for s in job.handle.servers if s.weight > 0}
        placement = Placement(job.handle.servers)
        on_doomed = {
            (m, r) for m in range(MAPPERS) for r in range(REDUCERS)
            if placement.server_for(partition_key(mapper=m, reducer=r).encode(), 0).node_id
            == info.node_id
        }
        assert on_doomed, "no partition is placed on the server to kill"
        with job.connect(**TASK_CLIENT_OPTIONS) as pf:
            pf.create_bucket(SHUFFLE_BUCKET)
            pf.create_bucket(OUTPUT_BUCKET)
            maps = _run_all(pool, _map_task,
                            [(handle_json, config, m, None) for m in range(MAPPERS)])
            map_s = time.monotonic() - started

            os.kill(info.server_pid, signal.SIGKILL)
            killed_at = time.monotonic()

            regenerated: list[tuple[int, int]] = []
            done: dict[int, ReduceOutcome] = {}
            pending = list(range(REDUCERS))
            task_handle = handle_json
            new_map_s: float | None = None
            for round_ in range(ROUNDS_MAX + 1):
                outcomes = _run_all(pool, _reduce_task,
                                    [(task_handle, r, MAPPERS) for r in pending])
                done.update({o.reducer: o for o in outcomes if o.complete})
                failed = [o for o in outcomes if not o.complete]
                if not failed:
                    break
                assert round_ < ROUNDS_MAX, f"reducers still failing: {failed}"
                task_handle = _wait_for_map_without(pf, info.node_id)
                if new_map_s is None:
                    new_map_s = time.monotonic() - killed_at
                lost = sorted({(m, o.reducer) for o in failed for m in o.lost_mappers})
                regenerated += lost
                by_mapper: dict[int, tuple[int, ...]] = {}
                for m, r in lost:
                    by_mapper[m] = (*by_mapper.get(m, ()), r)
                reruns = _run_all(pool, _map_task, [(task_handle, config, m, rs)
                                                    for m, rs in sorted(by_mapper.items())])
                # A mapper regenerates the very records it generated the first time.
                assert all(again == maps[again.mapper] for again in reruns)
                pending = [o.reducer for o in failed]
            reduce_s = time.monotonic() - killed_at

            assert sorted(done) == list(range(REDUCERS))
            outputs = [pf.get(OUTPUT_BUCKET, output_key(r), delete=True) for r in range(REDUCERS)]
            checks = [describe_partition(r, data) for r, data in enumerate(outputs)]
            input_checksum = sum(m.checksum for m in maps) % (1 << 64)
            assert sum(m.records for m in maps) == RECORDS
            assert check_output(config, input_checksum=input_checksum, checks=checks) == []
            # Every partition whose object was on the killed server was lost and regenerated,
            # and every shuffle object was deleted by its reducer.
            assert on_doomed <= set(regenerated), (sorted(on_doomed), regenerated)
            assert info.node_id not in {s.node_id for s in pf.handle.servers}
            assert pf.list(SHUFFLE_BUCKET) == []
    # The job is gone and the session's servers hold what they held before.
    assert wait_for(lambda: {k: v for k, v in used_bytes(local_cluster).items()
                             if k in session_servers} == baseline), used_bytes(local_cluster)
    with capsys.disabled():
        print(
            f"\nkilled server mid-shuffle: {MAPPERS}x{REDUCERS} partitions, "
            f"{RECORDS * RECORD_BYTES / 1e6:.0f} MB; {len(on_doomed)} with their first block on "
            f"the killed server, {len(regenerated)} regenerated in {round_} round(s); pool start "
            f"and map {map_s:.1f} s, new map {new_map_s or 0:.1f} s after the kill, reduce with "
            f"regeneration {reduce_s:.1f} s, total {time.monotonic() - started:.1f} s; output "
            f"verified ({RECORDS} records, checksum {input_checksum:#018x})"
        )
