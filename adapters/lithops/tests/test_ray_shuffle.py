"""Tests of the shuffle on Ray tasks (:class:`pocketflow_lithops.shuffle_executors.
RayShuffleExecutor`) on the session cluster's Ray: the same driver as on Lithops, with the same
hints, DELETE-on-read, PERSIST outputs, lineage regeneration and retries.

A mapper killed mid-run is a Ray worker process of the session cluster, SIGKILLed by pid by the
test; a reducer that dies after its DELETE reads ends its own worker process (``os._exit``).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import ray.cloudpickle
from fixtures_cluster import used_bytes, wait_for
from pocketflow_lithops.shuffle import SHUFFLE_BLOCK_MAX_BYTES, shuffle, shuffle_block_bytes
from pocketflow_lithops.shuffle_executors import RayShuffleExecutor, shuffle_executor
from pocketflow_lithops.shuffle_result import ShuffleResult
from pocketflow_lithops.shuffle_tasks import data_on_nvme, shuffle_key

import pocketflow
from pocketflow.cluster import LocalCluster
from pocketflow.control.admin import AdminTokens
from pocketflow.demo import (
    PartitionCheck,
    SortConfig,
    check_output,
    describe_partition,
    map_records,
    reduce_records,
)
from pocketflow.handle import JobHandle, ServerInfo
from pocketflow.job import Job

# Ray pickles the task functions with its own cloudpickle; the ones defined here travel by
# value (Ray's workers cannot import this test module).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SHUFFLE_TIMEOUT_S = 120.0
"""Bound on one shuffle in these tests."""
KILL_WAIT_S = 60.0
"""How long the doomed mapper waits to be killed (the test kills it as soon as it says where)."""
TASKS_MAX = 4
"""Ray tasks of one shuffle at once here (on the session cluster's 2 CPUs)."""
MEETING_REDUCERS = 4
"""Reducers (and mappers) of the extra-slot tests: ``tasks_max=2`` plus the 2 extra slots."""
MEETING_WAIT_S = 30.0
"""How long a reducer of those tests waits for the others to be running beside it."""
MAPPER_HOLD_S = 0.5
"""How long each mapper of those tests holds its slot."""
NVME_JOB_BYTES = 500 * 1024 * 1024
"""Hinted input of a job that does not fit the session cluster's DRAM (2 x 128 MiB), so that
nearly half of its weight goes to its NVMe server (256 MiB)."""
REDUCER_INPUT_WAIT_S = 45.0
"""Bound on a reducer's wait for its inputs where a reducer could wait for a mapper that never
gets a slot: the shuffle then fails within it instead of the default 300 s."""


def _ray() -> RayShuffleExecutor:
    return RayShuffleExecutor(tasks_max=TASKS_MAX)


def _emit_bytes(item: int, emit: Callable[[int, Any], None]) -> int:
    for partition in range(3):
        emit(partition, bytes([item]) * (10 * (partition + 1)))
        emit(partition, b"|")
    return item * 100


def _join(partition: int, inputs: list[bytes]) -> bytes:
    return f"{partition}:".encode() + b"".join(inputs)


def _reduce_crashing_once(flag_dir: str, crashing: int, how: str, partition: int,
                          inputs: list[bytes]) -> bytes:
    """The sort's reducer; reducer ``crashing`` fails on its first attempt, after its inputs
    were read with DELETE: it raises, or its process dies."""
    flag = Path(flag_dir) / f"reducer-{partition}"
    if partition == crashing and not flag.exists():
        flag.write_text(str(sum(len(i) for i in inputs)))
        if how == "exit":
            os._exit(3)
        raise RuntimeError(f"reducer {partition} crashes after its reads")
    return reduce_records(partition, inputs)


def _map_killed_once(flag_dir: str, config: SortConfig, mapper: int,
                     emit: Callable[[int, Any], None]) -> Any:
    """The sort's mapper; mapper 1's first run says its pid and waits to be killed."""
    directory = Path(flag_dir)
    (directory / f"mapper-{mapper}-{time.monotonic_ns()}").touch()
    flag = directory / "doomed-pid"
    if mapper == 1 and not flag.exists():
        flag.write_text(str(os.getpid()))
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise TimeoutError("the test never killed mapper 1")
    return map_records(config, mapper, emit)


def _failing_map(item: int, emit: Callable[[int, Any], None]) -> None:
    if item == 1:
        raise RuntimeError("mapper 1 breaks")
    emit(0, b"x")


def _doomed_pid(flag_dir: Path) -> int | None:
    """The pid a doomed mapper wrote to ``flag_dir/doomed-pid`` (its process, to be killed), once
    it did; ``None`` if it did not within ``SHUFFLE_TIMEOUT_S``."""
    pid_file = flag_dir / "doomed-pid"
    deadline = time.monotonic() + SHUFFLE_TIMEOUT_S
    while not pid_file.exists() or not pid_file.read_text():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return int(pid_file.read_text())


def _kill_the_doomed_mapper(flag_dir: Path) -> tuple[threading.Thread, list[int]]:
    """A started thread that SIGKILLs the doomed mapper's process once it said its pid in
    ``flag_dir`` (:func:`_doomed_pid`), and the list of the pids it killed."""
    killed: list[int] = []

    def kill() -> None:
        pid = _doomed_pid(flag_dir)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer, killed


def _outputs_leaving_nothing(job: Job, result: ShuffleResult) -> list[PartitionCheck]:
    """Once ``job``'s shuffle left no object in its bucket: the checks of its outputs, each
    read with DELETE."""
    with job.connect() as pf:
        assert pf.list("shuffle") == []
        return [describe_partition(r, pf.get(o.bucket, o.key, delete=True))
                for r, o in enumerate(result.outputs)]


def test_a_shuffle_on_ray_tasks_delivers_every_partition_and_leaves_nothing(
    local_cluster: LocalCluster,
) -> None:
    baseline = used_bytes(local_cluster)
    jobs_before = {j["job_id"] for j in local_cluster.status()["jobs"]}
    result = shuffle(_ray(), _emit_bytes, _join, [1, 2, 3], reducers=3, cluster=local_cluster,
                     input_size_bytes=200, timeout_s=SHUFFLE_TIMEOUT_S)
    assert result.map_values == [100, 200, 300]
    assert result.outputs == [
        f"{r}:".encode() + b"".join(bytes([m]) * (10 * (r + 1)) + b"|" for m in (1, 2, 3))
        for r in range(3)
    ]
    assert result.bytes_shuffled == result.bytes_read == sum(3 * (10 * (r + 1) + 1)
                                                             for r in range(3))
    assert result.retried == [] and result.regenerated == []
    # Its own job, registered with hints and deregistered at the end.
    assert result.job_id not in jobs_before
    assert {j["job_id"] for j in local_cluster.status()["jobs"]} == jobs_before
    assert wait_for(lambda: used_bytes(local_cluster) == baseline), used_bytes(local_cluster)


def test_a_sort_on_ray_tasks_validates_with_delete_on_read_and_persist_outputs(
    local_cluster: LocalCluster,
) -> None:
    config = SortConfig(mappers=4, reducers=3, records=12_000, seed=29)
    with local_cluster.register_job("ray-sort") as job:
        result = shuffle("ray", functools.partial(map_records, config), reduce_records,
                         range(config.mappers), reducers=config.reducers, job=job,
                         persist_output=True, timeout_s=SHUFFLE_TIMEOUT_S)
        with job.connect() as pf:
            # DELETE-on-read consumed every input; no reducer marker is left either.
            assert pf.list("shuffle") == []
            checks = [describe_partition(r, pf.get(o.bucket, o.key, delete=True))
                      for r, o in enumerate(result.outputs)]
            assert all(o.bucket == "output" and o.size > 0 for o in result.outputs)
    assert result.bytes_shuffled == result.bytes_read == config.input_bytes
    input_checksum = sum(m.checksum for m in result.map_values) % (1 << 64)
    assert check_output(config, input_checksum=input_checksum, checks=checks) == []
    # Per reducer, its time sorting and its time writing the PERSIST output, the latter inside
    # its I/O time.
    assert len(result.reduce_s) == len(result.output_write_s) == config.reducers
    assert all(s > 0 for s in result.reduce_s + result.output_write_s)
    assert all(w <= io for w, io in zip(result.output_write_s, result.io_s, strict=True))


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_reducer_on_ray_retried_after_its_delete_reads_has_its_inputs_regenerated(
    local_cluster: LocalCluster, tmp_path: Path, how: str,
) -> None:
    baseline = used_bytes(local_cluster)
    config = SortConfig(mappers=3, reducers=3, records=6_000, seed=17)
    with local_cluster.register_job("ray-reducer-retry") as job:
        result = shuffle(_ray(), functools.partial(map_records, config),
                         functools.partial(_reduce_crashing_once, str(tmp_path), 1, how),
                         range(3), reducers=3, job=job, persist_output=True,
                         timeout_s=SHUFFLE_TIMEOUT_S)
        assert int((tmp_path / "reducer-1").read_text()) > 0
        assert result.retried == [1]
        # Its retry found them consumed; exactly its partitions were regenerated, once.
        assert result.regenerated == [[(m, 1) for m in range(3)]]
        checks = _outputs_leaving_nothing(job, result)
    input_checksum = sum(m.checksum for m in result.map_values) % (1 << 64)
    assert check_output(config, input_checksum=input_checksum, checks=checks) == []
    assert wait_for(lambda: used_bytes(local_cluster) == baseline), used_bytes(local_cluster)


def test_a_mapper_whose_ray_worker_is_killed_runs_again(
    local_cluster: LocalCluster, tmp_path: Path,
) -> None:
    config = SortConfig(mappers=3, reducers=2, records=6_000, seed=5)
    killer, killed = _kill_the_doomed_mapper(tmp_path)
    with local_cluster.register_job("ray-mapper-killed") as job:
        result = shuffle(_ray(), functools.partial(_map_killed_once, str(tmp_path), config),
                         reduce_records, range(config.mappers), reducers=config.reducers,
                         job=job, persist_output=True, timeout_s=SHUFFLE_TIMEOUT_S)
        killer.join(SHUFFLE_TIMEOUT_S)
        checks = _outputs_leaving_nothing(job, result)
    assert killed, "mapper 1 never said its pid"
    runs = sorted(p.name.rsplit("-", 1)[0] for p in tmp_path.glob("mapper-*"))
    assert runs == ["mapper-0", "mapper-1", "mapper-1", "mapper-2"]
    input_checksum = sum(m.checksum for m in result.map_values) % (1 << 64)
    assert check_output(config, input_checksum=input_checksum, checks=checks) == []


def _emit_with_task_id(item: int, emit: Callable[[int, Any], None], *,
                       reducers: int) -> str:
    for partition in range(reducers):
        emit(partition, f"{item}>{partition};".encode())
    return ray.get_runtime_context().get_task_id()


def _join_checked(mappers: int, partition: int, inputs: list[bytes]) -> bytes:
    assert inputs == [f"{m}>{partition};".encode() for m in range(mappers)], inputs
    return b"".join(inputs)


def test_a_stage_of_many_small_calls_runs_in_bundles_and_validates(
    local_cluster: LocalCluster,
) -> None:
    # 24 mappers and 24 reducers on 2 slots: each Ray task runs several consecutive calls, so
    # the stage costs Ray far fewer tasks than calls; every partition still arrives once.
    baseline = used_bytes(local_cluster)
    executor = RayShuffleExecutor(tasks_max=2)
    calls = 24
    # A job of its own without hints: 48 concurrent tasks' worth of reservation does not fit.
    # The input size says the calls are small.
    with local_cluster.register_job("ray-bundles") as job:
        result = shuffle(executor, functools.partial(_emit_with_task_id, reducers=calls),
                         functools.partial(_join_checked, calls), range(calls), reducers=calls,
                         job=job, timeout_s=SHUFFLE_TIMEOUT_S, input_size_bytes=calls * calls * 6)
    bundle = executor.bundle_calls(2 * calls, 6 * calls)
    assert bundle > 1
    assert len(set(result.map_values)) <= calls // bundle + 1, result.map_values
    assert result.outputs == [b"".join(f"{m}>{r};".encode() for m in range(calls))
                              for r in range(calls)]
    assert result.retried == [] and result.regenerated == []
    assert wait_for(lambda: used_bytes(local_cluster) == baseline), used_bytes(local_cluster)


def test_mappers_of_a_killed_ray_process_run_again_ahead_of_queued_reducers(
    local_cluster: LocalCluster, tmp_path: Path,
) -> None:
    # More reducers than slots: when mapper 1's process is killed, the reducers queued behind
    # the mappers would take every slot and park waiting for mapper 1's partitions; its rerun
    # (and its bundle's other mappers') must start before them.
    config = SortConfig(mappers=16, reducers=16, records=8_000, seed=11)
    killer, killed = _kill_the_doomed_mapper(tmp_path)
    with local_cluster.register_job("ray-bundle-killed") as job:
        result = shuffle(RayShuffleExecutor(tasks_max=2),
                         functools.partial(_map_killed_once, str(tmp_path), config),
                         reduce_records, range(config.mappers), reducers=config.reducers,
                         job=job, persist_output=True, timeout_s=SHUFFLE_TIMEOUT_S,
                         input_wait_s=REDUCER_INPUT_WAIT_S,
                         input_size_bytes=config.input_bytes)
        killer.join(SHUFFLE_TIMEOUT_S)
        checks = _outputs_leaving_nothing(job, result)
    assert killed, "mapper 1 never said its pid"
    runs = [p.name.rsplit("-", 1)[0] for p in tmp_path.glob("mapper-*")]
    assert runs.count("mapper-1") == 2
    assert {f"mapper-{m}" for m in range(config.mappers)} == set(runs)
    input_checksum = sum(m.checksum for m in result.map_values) % (1 << 64)
    assert check_output(config, input_checksum=input_checksum, checks=checks) == []


CONSUMED_WAIT_S = 20.0
"""How long the test waits for a reducer to consume a copy of the doomed bundle's first mapper
before it kills the bundle anyway (and fails)."""


def _map_after_the_doomed_said_its_pid(flag_dir: str, config: SortConfig,
                                       waiting: frozenset[int], mapper: int,
                                       emit: Callable[[int, Any], None]) -> Any:
    """:func:`_map_killed_once`; mappers in ``waiting`` first wait (bounded) until mapper 1 said
    its pid, which it does once mapper 0, run before it in the same Ray task, has written."""
    pid_file = Path(flag_dir) / "doomed-pid"
    deadline = time.monotonic() + KILL_WAIT_S
    while mapper in waiting and not (pid_file.exists() and pid_file.read_text()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"mapper {mapper}: mapper 1 never said its pid")
        time.sleep(0.02)
    return _map_killed_once(flag_dir, config, mapper, emit)


def test_a_mapper_rerun_after_its_first_copies_were_consumed_leaves_no_input_behind(
    local_cluster: LocalCluster, tmp_path: Path,
) -> None:
    """A reducer reads every input already there before it waits for the others, so it may
    consume what a mapper wrote in a process that then dies. The mapper's rerun writes that
    partition again (write-once refuses only copies still there); the reducer keeps the copy it
    read, and the shuffle deletes the rewrite once every reducer committed.

    Mappers 0-3 share one Ray task (16 x 16 on 2 slots: bundles of 4), so mapper 0 has written
    its partitions when mapper 1 says its pid. The other slot runs the other mappers and then
    reducers 0-3, whose reducer 0 consumes mapper 0's copy for it and waits for mappers 1-3.
    Only then is the bundle's process SIGKILLed: mappers 0-3 run again. Mappers 12-15, the last
    bundle before the reducers, wait for mapper 1's pid: a reducer that started before mapper 0
    wrote would wait for all of its inputs, consuming none (Ray may start the other slot's
    worker first)."""
    config = SortConfig(mappers=16, reducers=16, records=8_000, seed=13)
    killed: list[int] = []
    consumed_before_kill: list[bool] = []
    first_copy = shuffle_key(mapper=0, reducer=0)

    def kill_after_reducer_0_consumed_mapper_0(job_connect: Callable[[], Any]) -> None:
        pid = _doomed_pid(tmp_path)
        if pid is None:
            return
        with job_connect() as pf:
            consumed_by = time.monotonic() + CONSUMED_WAIT_S
            while pf.exists("shuffle", first_copy) and time.monotonic() < consumed_by:
                time.sleep(0.05)
            consumed_before_kill.append(not pf.exists("shuffle", first_copy))
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    with local_cluster.register_job("ray-rerun-after-consumed") as job:
        killer = threading.Thread(target=kill_after_reducer_0_consumed_mapper_0,
                                  args=(job.connect,), daemon=True)
        killer.start()
        result = shuffle(RayShuffleExecutor(tasks_max=2),
                         functools.partial(_map_after_the_doomed_said_its_pid, str(tmp_path),
                                           config, frozenset(range(12, 16))),
                         reduce_records, range(config.mappers), reducers=config.reducers,
                         job=job, persist_output=True, timeout_s=SHUFFLE_TIMEOUT_S,
                         input_wait_s=REDUCER_INPUT_WAIT_S,
                         input_size_bytes=config.input_bytes)
        killer.join(SHUFFLE_TIMEOUT_S)
        with job.connect() as pf:
            left = [info.key for info in pf.list("shuffle")]
            checks = [describe_partition(r, pf.get(o.bucket, o.key, delete=True))
                      for r, o in enumerate(result.outputs)]
    assert killed, "mapper 1 never said its pid"
    assert consumed_before_kill == [True], "reducer 0 did not consume mapper 0's first copy"
    assert left == [], "the rerun's copies of consumed inputs were left behind"
    runs = [p.name.rsplit("-", 1)[0] for p in tmp_path.glob("mapper-*")]
    assert runs.count("mapper-0") == 2 and runs.count("mapper-1") == 2, sorted(runs)
    assert result.regenerated == [] and result.retried == []
    input_checksum = sum(m.checksum for m in result.map_values) % (1 << 64)
    assert check_output(config, input_checksum=input_checksum, checks=checks) == []


def _record_interval(directory: str, kind: str, index: int, started_ns: int) -> None:
    (Path(directory) / f"{kind}-{index}-{started_ns}-{time.monotonic_ns()}").touch()


def _map_recorded(directory: str, hold_s: float, item: int,
                  emit: Callable[[int, Any], None]) -> int:
    started_ns = time.monotonic_ns()
    time.sleep(hold_s)  # long enough that mappers sharing slots would overlap
    for partition in range(MEETING_REDUCERS):
        emit(partition, bytes([item]) * 8)
    _record_interval(directory, "mapper", item, started_ns)
    return item


def _reduce_meeting(directory: str, meeting: int, hold_s: float, partition: int,
                    inputs: list[bytes]) -> bytes:
    """Say it started; then wait (bounded) until ``meeting`` reducers did, or hold ``hold_s``."""
    started_ns = time.monotonic_ns()
    (Path(directory) / f"started-{partition}").touch()
    deadline = time.monotonic() + MEETING_WAIT_S
    while len(list(Path(directory).glob("started-*"))) < meeting:
        if time.monotonic() > deadline:
            raise TimeoutError(f"reducer {partition}: fewer than {meeting} reducers ran at once")
        time.sleep(0.02)
    time.sleep(hold_s)
    _record_interval(directory, "reducer", partition, started_ns)
    return b"".join(inputs)


def _most_at_once(directory: Path, kind: str) -> int:
    """Most ``kind`` calls whose recorded intervals overlapped at one moment."""
    edges = []
    for path in directory.glob(f"{kind}-*"):
        _, _, started_ns, ended_ns = path.name.split("-")
        edges += [(int(started_ns), 1), (int(ended_ns), -1)]
    running = most = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):
        running += step
        most = max(most, running)
    return most


def test_reducers_of_a_job_on_nvme_take_extra_slots_and_mappers_do_not(
    local_cluster: LocalCluster, tmp_path: Path,
) -> None:
    # A job whose hints do not fit the session cluster's DRAM gets much of its weight on the
    # NVMe server: its reducers then run beside the computing calls in the executor's extra
    # slots, asked for here (all 4 reducers at once on tasks_max=2 must meet, or they time
    # out), while its mappers keep to tasks_max.
    executor = RayShuffleExecutor(tasks_max=2, storage_tasks_extra=2)
    result = shuffle(executor, functools.partial(_map_recorded, str(tmp_path), MAPPER_HOLD_S),
                     functools.partial(_reduce_meeting, str(tmp_path), MEETING_REDUCERS, 0.0),
                     range(MEETING_REDUCERS), reducers=MEETING_REDUCERS,
                     cluster=local_cluster, input_size_bytes=NVME_JOB_BYTES,
                     timeout_s=SHUFFLE_TIMEOUT_S)
    weights = {s.node_id: (s.tier, s.weight)
               for s in JobHandle.from_json(result.handle_json).servers}
    assert data_on_nvme(JobHandle.from_json(result.handle_json)), weights
    assert result.outputs == [b"".join(bytes([m]) * 8 for m in range(MEETING_REDUCERS))
                              for _ in range(MEETING_REDUCERS)]
    assert _most_at_once(tmp_path, "reducer") == MEETING_REDUCERS
    assert _most_at_once(tmp_path, "mapper") <= 2


def _servers_own_stats(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    """``node_id -> stats`` of each server, its own (admin), not the control plane's copy."""
    from pocketflow.control.admin import AdminTokens

    tokens = AdminTokens(cluster.secret, tls_ca=cluster.tls_ca)
    try:
        return {s.node_id: tokens.client(s.address).stats() for s in cluster.servers}
    finally:
        tokens.close()


def _own_stats(cluster: LocalCluster, field: str) -> dict[str, int]:
    """``node_id -> field`` of each server's own stats."""
    return {node: int(stats[field]) for node, stats in _servers_own_stats(cluster).items()}


def _bytes_of_jobs(cluster: LocalCluster, job_ids: list[str]) -> int:
    """The bytes the servers hold for ``job_ids``, from each server's own stats (a job they
    no longer know holds none)."""
    return sum(int(stats["jobs"].get(job, {}).get("used_bytes", 0))
               for stats in _servers_own_stats(cluster).values() for job in job_ids)


def _emit_one(item: int, emit: Callable[[int, Any], None]) -> int:
    emit(0, b"x" * 10)
    return item


def _received_bytes_by_node(cluster: LocalCluster) -> dict[str, int]:
    """``node_id -> bytes received so far`` from each server's own counter."""
    return _own_stats(cluster, "received_bytes_total")


def _dram_free_settled(cluster: LocalCluster) -> int:
    """The DRAM bytes the control plane sees free, once its view of every server's used bytes
    is the server's own (an earlier test's deletes reach it with the next heartbeat)."""
    def settled() -> bool:
        seen = used_bytes(cluster)
        return all(seen.get(node) == own
                   for node, own in _own_stats(cluster, "used_bytes").items())

    assert wait_for(settled)
    seen = used_bytes(cluster)
    return sum(s.capacity_bytes - seen[s.node_id] for s in cluster.servers if s.tier == "dram")


def test_a_sort_whose_inputs_fit_dram_once_writes_nothing_to_nvme(
    local_cluster: LocalCluster,
) -> None:
    # A sort with PERSIST outputs and DELETE reads holds its input's size at most: each
    # reducer's output replaces the inputs it consumed. Hinted at about 200 MiB, it fits the
    # session cluster's DRAM (2 x 128 MiB) once but not twice: reserving the outputs beside the
    # inputs (as the shuffle did) put 36% of its weight, and of its bytes, on the NVMe server.
    hinted_bytes = min(200 * 1024 * 1024, _dram_free_settled(local_cluster) - 16 * 1024 * 1024)
    # Three tasks' bandwidth (3 x 75 MB/s) fits the DRAM tier's nominal throughput
    # (2 x 125 MB/s), so the job is packed by capacity alone.
    config = SortConfig(mappers=2, reducers=1, records=200_000, seed=11, processes=2)
    before = _received_bytes_by_node(local_cluster)
    result = shuffle(RayShuffleExecutor(tasks_max=2), functools.partial(map_records, config),
                     reduce_records, range(config.mappers), reducers=config.reducers,
                     cluster=local_cluster, input_size_bytes=hinted_bytes, persist_output=True,
                     timeout_s=SHUFFLE_TIMEOUT_S)
    received = {node: total - before[node]
                for node, total in _received_bytes_by_node(local_cluster).items()}
    weights = {s.node_id: (s.tier, s.weight)
               for s in JobHandle.from_json(result.handle_json).servers}
    assert all(weight == 0 for tier, weight in weights.values() if tier == "nvme"), weights
    with pocketflow.connect(result.handle_json) as pf:
        checks = [describe_partition(r, pf.get(o.bucket, o.key, delete=True))
                  for r, o in enumerate(result.outputs)]
    input_checksum = sum(m.checksum for m in result.map_values) % (1 << 64)
    assert check_output(config, input_checksum=input_checksum, checks=checks) == []
    # The shuffle objects and the outputs (2 x 20 MB) went to DRAM; the NVMe server got only
    # the job's bookkeeping (bucket creation, registration), far below 1% of that.
    nvme = sum(n for node, n in received.items() if weights.get(node, ("", 0))[0] == "nvme")
    dram = sum(n for node, n in received.items() if weights.get(node, ("", 0))[0] == "dram")
    assert dram >= 2 * config.input_bytes and nvme < config.input_bytes // 100, received


def test_outputs_larger_than_the_input_are_reserved_and_a_negative_size_is_refused(
    local_cluster: LocalCluster,
) -> None:
    # A shuffle whose PERSIST outputs (say, a join's) are larger than its input holds the
    # outputs' size at its end: stated, it is reserved, so a job whose outputs outgrow the
    # session cluster's DRAM (2 x 128 MiB) gets weight on its NVMe server (256 MiB). One
    # mapper and one reducer: their bandwidth fits the DRAM tier's, so only capacity decides.
    dram_free = _dram_free_settled(local_cluster)
    result = shuffle(RayShuffleExecutor(tasks_max=2), _emit_one, _join, range(1), reducers=1,
                     cluster=local_cluster, input_size_bytes=1024,
                     output_size_bytes=dram_free + 128 * 1024 * 1024, persist_output=True,
                     timeout_s=SHUFFLE_TIMEOUT_S)
    weights = {s.node_id: (s.tier, s.weight)
               for s in JobHandle.from_json(result.handle_json).servers}
    assert sum(w for tier, w in weights.values() if tier == "nvme") > 0.2, weights
    with pocketflow.connect(result.handle_json) as pf:
        outputs = [pf.get(o.bucket, o.key, delete=True) for o in result.outputs]
    assert outputs == [b"0:" + b"x" * 10]
    with pytest.raises(ValueError, match="output_size_bytes must be >= 0"):
        shuffle(RayShuffleExecutor(tasks_max=2), _emit_bytes, _join, range(2), reducers=3,
                cluster=local_cluster, output_size_bytes=-1, persist_output=True)


def test_reducers_of_a_job_in_dram_keep_to_tasks_max(
    local_cluster: LocalCluster, tmp_path: Path,
) -> None:
    assert RayShuffleExecutor(tasks_max=2).storage_tasks_extra == 0  # opt-in
    executor = RayShuffleExecutor(tasks_max=2, storage_tasks_extra=2)
    result = shuffle(executor, functools.partial(_map_recorded, str(tmp_path), MAPPER_HOLD_S),
                     functools.partial(_reduce_meeting, str(tmp_path), 0, MAPPER_HOLD_S),
                     range(MEETING_REDUCERS), reducers=MEETING_REDUCERS,
                     cluster=local_cluster, input_size_bytes=1 << 20,
                     timeout_s=SHUFFLE_TIMEOUT_S)
    assert not data_on_nvme(JobHandle.from_json(result.handle_json))
    assert _most_at_once(tmp_path, "reducer") <= 2
    assert _most_at_once(tmp_path, "mapper") <= 2


def test_calls_handed_to_ray_ahead_of_free_slots_still_keep_to_tasks_max(
    local_cluster: LocalCluster, tmp_path: Path,
) -> None:
    # One slot per CPU of the session cluster (2) and no extra slots: Ray cannot run a third
    # task at once, so the executor hands it calls before a slot frees and Ray starts them as
    # slots free. Mappers and reducers (4 each, each holding its slot) must still run at most
    # 2 at once, and the reducers, queued in Ray only once no
    # mapper is outstanding, must never wait there ahead of a mapper they need.
    executor = RayShuffleExecutor(tasks_max=2)
    assert executor.queued_ahead_max == 2
    result = shuffle(executor, functools.partial(_map_recorded, str(tmp_path), MAPPER_HOLD_S),
                     functools.partial(_reduce_meeting, str(tmp_path), 0, MAPPER_HOLD_S),
                     range(MEETING_REDUCERS), reducers=MEETING_REDUCERS,
                     cluster=local_cluster, input_size_bytes=1 << 20,
                     timeout_s=SHUFFLE_TIMEOUT_S, input_wait_s=REDUCER_INPUT_WAIT_S)
    assert result.outputs == [b"".join(bytes([m]) * 8 for m in range(MEETING_REDUCERS))
                              for _ in range(MEETING_REDUCERS)]
    assert _most_at_once(tmp_path, "mapper") == 2
    assert _most_at_once(tmp_path, "reducer") == 2
    # Where Ray could run a handed call at once (a slot per CPU would leave one free, or the
    # extra slots' CPUs), nothing is handed ahead.
    assert RayShuffleExecutor(tasks_max=1).queued_ahead_max == 0
    assert RayShuffleExecutor(tasks_max=2, storage_tasks_extra=2).queued_ahead_max == 0


def test_a_mapper_that_raises_on_ray_fails_the_shuffle_without_a_retry(
    local_cluster: LocalCluster,
) -> None:
    jobs_before = {j["job_id"] for j in local_cluster.status()["jobs"]}
    with pytest.raises(RuntimeError, match="mapper 1 breaks"):
        shuffle(_ray(), _failing_map, _join, [0, 1], reducers=1, cluster=local_cluster,
                input_wait_s=60, timeout_s=SHUFFLE_TIMEOUT_S)
    assert {j["job_id"] for j in local_cluster.status()["jobs"]} == jobs_before


class _TwoArgumentError(Exception):
    """Pickles, but cannot be unpickled: its ``__init__`` wants two arguments, its args hold one."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what} failed: {why}")


def _map_raising_two_argument_error(item: int, emit: Callable[[int, Any], None]) -> None:
    if item == 5:
        raise _TwoArgumentError("mapper 5", "on purpose")
    emit(0, b"x")


def test_a_mapper_s_error_that_cannot_be_unpickled_still_fails_the_shuffle_by_name(
    local_cluster: LocalCluster,
) -> None:
    # In a bundle (small calls, many per slot): the error comes back as a RuntimeError that
    # names it, instead of costing the bundle's outcomes an unpickling failure in the driver.
    executor = RayShuffleExecutor(tasks_max=1)
    assert executor.bundle_calls(16, 16) > 1
    with local_cluster.register_job("ray-unpicklable") as job, pytest.raises(
            RuntimeError, match=r"_TwoArgumentError: mapper 5 failed: on purpose"):
        shuffle(executor, _map_raising_two_argument_error, _join, range(8), reducers=8,
                job=job, input_size_bytes=64, input_wait_s=60, timeout_s=SHUFFLE_TIMEOUT_S)


def test_the_executor_is_chosen_per_call_and_bad_ones_are_refused(
    local_cluster: LocalCluster,
) -> None:
    own = _ray()
    assert shuffle_executor(own) is own
    assert isinstance(shuffle_executor("ray"), RayShuffleExecutor)
    with pytest.raises(ValueError, match="unknown executor"):
        shuffle_executor("dask")
    with pytest.raises(TypeError, match="not an executor"):
        shuffle_executor(42)
    with pytest.raises(ValueError, match="tasks_max"):
        RayShuffleExecutor(tasks_max=0)


def test_the_ray_shuffle_imports_no_lithops() -> None:
    # A Ray user runs the shuffle without Lithops: neither the driver's modules nor the tasks'
    # import it (the Lithops executor imports it when it is used).
    script = (
        "import sys\n"
        "import pocketflow_lithops.shuffle, pocketflow_lithops.shuffle_executors\n"
        "import pocketflow_lithops.shuffle_tasks\n"
        "print(sorted(m for m in sys.modules if m == 'lithops' or m.startswith('lithops.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "[]", out


def test_partitions_larger_than_a_block_are_shuffled_as_one_block_each(
    local_cluster: LocalCluster,
) -> None:
    # 4 x 4 partitions of about 1.5 MB: two data blocks each at the job's 1 MiB, one at the
    # block size the shuffle picks from its input size (2 MiB). A reducer reads an object of
    # one block with one direct READ that claims it; one of two blocks costs it a record read,
    # block reads and two claim actions (``delete``, ``delete_blocks``), as the servers count.
    config = SortConfig(mappers=4, reducers=4, records=240_000, seed=13, processes=2)
    served: dict[str, dict[tuple[str, str], float]] = {}
    jobs: list[str] = []
    for side, options in (("picked", None), ("job's", {"block_size_bytes": 1024 * 1024})):
        before = _requests_by_op(local_cluster)
        result = shuffle(RayShuffleExecutor(tasks_max=2), functools.partial(map_records, config),
                         reduce_records, range(config.mappers), reducers=config.reducers,
                         cluster=local_cluster, input_size_bytes=config.input_bytes,
                         persist_output=True, client_options=options,
                         timeout_s=SHUFFLE_TIMEOUT_S)
        after = _requests_by_op(local_cluster)
        served[side] = {op: n - before.get(op, 0.0) for op, n in after.items()}
        handle = JobHandle.from_json(result.handle_json)
        jobs.append(handle.job_id)
        block_bytes = handle.block_size_bytes
        assert block_bytes == (2 if side == "picked" else 1) * 1024 * 1024, (side, block_bytes)
        with pocketflow.connect(result.handle_json) as pf:
            checks = [describe_partition(r, pf.get(o.bucket, o.key, delete=True))
                      for r, o in enumerate(result.outputs)]
        input_checksum = sum(m.checksum for m in result.map_values) % (1 << 64)
        assert check_output(config, input_checksum=input_checksum, checks=checks) == [], side
    shuffle_objects = config.mappers * config.reducers
    claims = ("do_action", "delete_blocks")
    assert served["job's"].get(claims, 0) >= shuffle_objects, served["job's"]
    assert served["picked"].get(claims, 0) == 0, served["picked"]
    assert served["picked"].get(("direct_read", "get"), 0) >= shuffle_objects, served["picked"]
    # Inputs consumed, outputs read with DELETE, both jobs deregistered: nothing of them is
    # left on any server (counted by job: an earlier test's bytes may still be going).
    assert wait_for(lambda: _bytes_of_jobs(local_cluster, jobs) == 0), \
        _bytes_of_jobs(local_cluster, jobs)


def test_outputs_fill_the_dram_holes_of_partitions_shuffled_as_one_block(
    local_cluster: LocalCluster, server_factory: Callable[..., tuple[Any, ServerInfo]],
) -> None:
    # 8 x 2 partitions of 1.1 MB (1.05 MiB) on one DRAM server with about 3 MiB free beyond
    # them: the shuffle writes each as one block of its pick (2 MiB), and a reducer's output
    # (8.8 MB) then has the holes its consumed partitions left (1.05 MiB each, between the
    # other reducer's partitions) and that free tail. Written in blocks of the job's size
    # (1 MiB) it fits them; in blocks of 2 MiB none of the holes takes one, the DRAM server
    # refuses them (no free extent) and the writers overflowed all 17.6 MB of outputs to NVMe
    # (the 1 GB sort sent 40-100 MiB of its outputs to NVMe this way).
    mib = 1024 * 1024
    config = SortConfig(mappers=8, reducers=2, records=176_000, seed=21)
    partition_bytes = config.input_bytes // (config.mappers * config.reducers)
    assert mib < partition_bytes and shuffle_block_bytes(partition_bytes, mib) == 2 * mib
    servers, dram = server_factory("holes-dram-0", "dram", 20 * mib, long_running=True)
    _, nvme = server_factory("holes-nvme-0", "nvme", 64 * mib, long_running=True, weight=0.0)
    job = Job(servers.handle(servers=[dram, nvme], block_size_bytes=mib), local_cluster.control)
    # One task at a time: every mapper's partitions are written before the first reducer's
    # output, and one reducer's output before the other consumes its partitions.
    result = shuffle(RayShuffleExecutor(tasks_max=1), functools.partial(map_records, config),
                     reduce_records, range(config.mappers), reducers=config.reducers,
                     job=job, input_size_bytes=config.input_bytes, persist_output=True,
                     timeout_s=SHUFFLE_TIMEOUT_S)
    admin = AdminTokens(servers.secret)
    try:
        on_nvme = int(admin.client(nvme.address).stats()["used_bytes"])
    finally:
        admin.close()
    assert on_nvme < mib, f"{on_nvme} bytes of outputs overflowed to NVMe"
    with pocketflow.connect(result.handle_json) as pf:
        checks = [describe_partition(r, pf.get(o.bucket, o.key, delete=True))
                  for r, o in enumerate(result.outputs)]
    input_checksum = sum(m.checksum for m in result.map_values) % (1 << 64)
    assert check_output(config, input_checksum=input_checksum, checks=checks) == []


def _requests_by_op(cluster: LocalCluster) -> dict[tuple[str, str], float]:
    """``(rpc, op) -> requests served so far`` by every server, from its Prometheus metrics."""
    import urllib.request

    counts: dict[tuple[str, str], float] = {}
    for server in cluster.servers:
        assert server.metrics_url is not None, server
        with urllib.request.urlopen(server.metrics_url, timeout=10) as page:
            for line in page.read().decode().splitlines():
                if not line.startswith("pocketflow_requests_total{"):
                    continue
                labels, value = line.rsplit(" ", 1)
                found = dict(part.split("=", 1) for part in
                             labels[labels.index("{") + 1:labels.rindex("}")].split(","))
                key = (found["rpc"].strip('"'), found["op"].strip('"'))
                counts[key] = counts.get(key, 0.0) + float(value)
    return counts


def test_the_shuffle_block_size_holds_a_partition_within_its_bounds() -> None:
    mib = 1024 * 1024
    assert shuffle_block_bytes(200 * 1024, mib) == mib  # one block already: the job's
    assert shuffle_block_bytes(2_400_000, mib) == 3 * mib  # 1.25 x 2.4 MB, MiB multiple
    assert shuffle_block_bytes(100 * mib, mib) == SHUFFLE_BLOCK_MAX_BYTES  # bounded
    assert shuffle_block_bytes(200 * 1024, 4 * mib) == 4 * mib  # never below the job's
