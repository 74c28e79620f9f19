"""Tests of the Lithops drop-in shuffle on the real localhost executor and the session cluster.

Lost partitions: a storage server added for the test is killed by pid in the middle of a
shuffle; the control plane moves the job off it and the shuffle regenerates what it held. A
reducer that fails after its DELETE reads is retried, and its retry has what the failed attempt
consumed regenerated.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from fixtures_cluster import extra_server, used_bytes, wait_for
from pocketflow_lithops.shuffle import (
    CONSUMING_PREFIX,
    OutputInfo,
    _ReduceCall,
    _ReduceOutcome,
    _shuffle_task,
    _Spec,
    finished_key,
    refresh_map,
    shuffle,
    shuffle_key,
)

import pocketflow
from pocketflow.cluster import LocalCluster
from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.demo import (
    SortConfig,
    check_output,
    describe_partition,
    is_sorted,
    lithops_config,
    map_records,
    record_checksum,
    records_from,
    reduce_records,
)
from pocketflow.errors import BucketNotFound, DataUnavailable, ObjectNotFound, ShuffleFailed
from pocketflow.handle import JobHandle
from pocketflow.placement import Placement

# Lithops pickles the task functions; the ones defined here travel by value (workers cannot
# import this test module).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SHUFFLE_TIMEOUT_S = 120.0
"""Bound on one shuffle in these tests (Lithops starts a worker process per call)."""
GATE_TIMEOUT_S = 60.0
"""How long the gated mapper waits for the test to open its gate."""
BENCHMARK_TIMEOUT_S = 300.0
"""Bound on the benchmark script's tiny run."""
DOOMED_CAPACITY_BYTES = 512 * 1024 * 1024
"""The killed server's capacity: several times the session's DRAM servers' free bytes."""
REDUCERS_MAX = 32
"""Most reducers the regeneration test tries when looking for inputs on the killed server."""
RETRY_PROBE_MAX_S = 10.0
"""Bound on a retried reducer finding its consumed inputs (it looks without waiting for them)."""



def test_a_task_process_imports_only_the_tasks_module() -> None:
    """Lithops forks a process per task, which imports the task function's module as it
    unpickles the call: that module is ``shuffle_tasks``, which loads neither the driver's
    module, Lithops nor the client (a task connects when it first reads or writes), and the
    user's functions stay instance attributes of the calls, where Lithops looks for the
    modules to ship."""
    import subprocess

    from lithops.libs import inspect as lithops_inspect
    from pocketflow_lithops.shuffle_tasks import _MapCall, _ReduceCall

    pickled = cloudpickle.dumps(_shuffle_task)
    assert b"pocketflow_lithops.shuffle_tasks" in pickled and len(pickled) < 200
    script = (
        "import sys, pocketflow_lithops.shuffle_tasks\n"
        "heavy = ('pocketflow_lithops.shuffle', 'pocketflow.client', 'pocketflow.job', 'lithops',"
        " 'dataclasses')\n"
        "print(','.join(m for m in heavy if m in sys.modules) or '-')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["-"], out
    spec = _Spec("{}", 1, 1, "b", "o", False, 1.0, ())
    for call, function in ((_MapCall(spec, map_records, 0, 0, None), map_records),
                           (_ReduceCall(spec, reduce_records, 0), reduce_records)):
        members = dict(lithops_inspect.getmembers_static(call))
        assert function in members.values(), type(call).__name__
        again = cloudpickle.loads(cloudpickle.dumps(call))
        assert type(again) is type(call) and vars(again).keys() == vars(call).keys()
    retry = _ReduceCall(spec, reduce_records, 3).with_attempt("a1")
    assert (retry.reducer, retry.attempt, retry.reduce_function) == (3, "a1", reduce_records)


def test_every_input_key_is_its_reducer_s_prefix_and_its_mapper() -> None:
    """The keys a reducer reads are the ones mappers write, and each lies under its reducer's
    lease prefix (one f-string each side, kept apart for speed)."""
    from pocketflow_lithops.shuffle_tasks import reducer_input_keys, reducer_prefix

    assert shuffle_key(mapper=3, reducer=12) == "r00012/m00003"
    for reducer in (0, 7, 4095):
        keys = reducer_input_keys(reducer, 300)
        assert keys == {m: shuffle_key(mapper=m, reducer=reducer) for m in range(300)}
        assert all(k.startswith(reducer_prefix(reducer) + "/") for k in keys.values())
    assert reducer_input_keys(1, 0) == {}


def test_a_steered_key_is_its_reducer_s_and_avoids_the_servers_named() -> None:
    """A partition regenerated after a server lost data goes under its own key when that key's
    home is another server, else under the first ``~n`` variant whose home is; the reducer's
    keys name it; with every server avoided it keeps its own key."""
    from pocketflow_lithops.shuffle_tasks import (
        STEER_SALTS_MAX,
        _keys_of,
        reducer_prefix,
        steered_key,
    )

    from pocketflow.handle import ServerInfo

    servers = [ServerInfo(f"s-{i}", f"127.0.0.1:{7000 + i}", "dram", 1.0, False)
               for i in range(3)]
    placement = Placement(servers)
    lossy = servers[1].address
    steered = 0
    for m in range(40):
        key = steered_key(mapper=m, reducer=5, avoid=frozenset({lossy}), placement=placement)
        own = shuffle_key(mapper=m, reducer=5)
        assert placement.server_for(key.encode(), 0).address != lossy
        assert key.startswith(reducer_prefix(5) + "/")
        if placement.server_for(own.encode(), 0).address == lossy:
            steered += 1
            salt = int(key.rsplit("~", 1)[1])
            assert 1 <= salt <= STEER_SALTS_MAX and key == f"{own}~{salt}"
            assert all(placement.server_for(f"{own}~{n}".encode(), 0).address == lossy
                       for n in range(1, salt))
        else:
            assert key == own
    assert steered > 0, "no key of 40 had its home on one server of three"
    every = frozenset(s.address for s in servers)
    assert steered_key(mapper=1, reducer=5, avoid=every, placement=placement) == shuffle_key(
        mapper=1, reducer=5)
    spec = _Spec("{}", 3, 6, "b", "o", False, 1.0, (), steered=((1, 5, "r00005/m00001~2"),))
    assert _keys_of(spec, 5) == {0: "r00005/m00000", 1: "r00005/m00001~2", 2: "r00005/m00002"}
    assert _keys_of(spec, 4) == _own_keys(4, 3)


def _own_keys(reducer: int, mappers: int) -> dict[int, str]:
    return {m: shuffle_key(mapper=m, reducer=reducer) for m in range(mappers)}


@pytest.fixture
def fexec() -> Iterator[Any]:
    """A Lithops localhost executor with 4 worker processes (reducers park while mappers run)."""
    import lithops

    executor = lithops.FunctionExecutor(config=lithops_config(storage="localhost", workers=4))
    try:
        yield executor
    finally:
        executor.clean()


def _emit_bytes(item: int, emit: Callable[[int, Any], None]) -> int:
    for partition in range(3):
        emit(partition, bytes([item]) * (10 * (partition + 1)))
        emit(partition, b"|")
    return item * 100


def _join(partition: int, inputs: list[bytes]) -> bytes:
    return f"{partition}:".encode() + b"".join(inputs)


def _slow_then_emit(delay_s: float, item: int, emit: Callable[[int, Any], None]) -> float:
    time.sleep(delay_s)
    emit(0, b"late")
    return time.time()


def _reduce_started(partition: int, inputs: list[bytes]) -> tuple[float, list[bytes]]:
    return time.time(), inputs


def _reduce_crashing_once(flag_dir: str, crashing: int, how: str, partition: int,
                          inputs: list[bytes]) -> bytes:
    """The sort's reducer; reducer ``crashing`` fails on its first attempt, after its inputs
    were read with DELETE: it raises, or its process dies (a file in ``flag_dir`` tells the
    attempts apart)."""
    flag = Path(flag_dir) / f"reducer-{partition}"
    if partition == crashing and not flag.exists():
        flag.write_text(str(sum(len(i) for i in inputs)))
        if how == "exit":
            os._exit(3)
        raise RuntimeError(f"reducer {partition} crashes after its reads")
    return reduce_records(partition, inputs)


def _raise_on_reduce(partition: int, inputs: list[bytes]) -> bytes:
    raise RuntimeError("the reduce function breaks")


def _failing_map(item: int, emit: Callable[[int, Any], None]) -> None:
    if item == 1:
        raise RuntimeError("mapper 1 breaks")
    emit(0, b"x")


def test_shuffle_delivers_every_partition_in_mapper_order(
    local_cluster: LocalCluster, fexec: Any
) -> None:
    baseline = used_bytes(local_cluster)
    result = shuffle(fexec, _emit_bytes, _join, [1, 2, 3], reducers=3, cluster=local_cluster,
                     input_size_bytes=1000, timeout_s=SHUFFLE_TIMEOUT_S)
    assert result.map_values == [100, 200, 300]
    assert result.outputs == [
        f"{r}:".encode() + b"".join(bytes([m]) * (10 * (r + 1)) + b"|" for m in (1, 2, 3))
        for r in range(3)
    ]
    assert result.bytes_shuffled == result.bytes_read == sum(3 * (10 * (r + 1) + 1)
                                                            for r in range(3))
    assert result.regenerated == []
    assert len(result.input_wait_s) == len(result.io_s) == 3 and len(result.map_io_s) == 3
    # The shuffle's own job is deregistered and its objects were deleted on read.
    assert result.job_id not in {j["job_id"] for j in local_cluster.status()["jobs"]}
    assert wait_for(lambda: used_bytes(local_cluster) == baseline), used_bytes(local_cluster)
    # Lithops shipped this test module to the workers, but not pocketflow's own packages:
    # the workers ran the installed ones.
    from lithops.constants import LITHOPS_TEMP_DIR

    shipped = [p.name for d in Path(LITHOPS_TEMP_DIR, "modules").glob(f"{fexec.executor_id}-*")
               for p in d.iterdir()]
    assert shipped, "Lithops shipped no module at all: the check below would prove nothing"
    assert not [name for name in shipped if name.startswith("pocketflow")], shipped


def _client_loaded(item: int, emit: Callable[[int, Any], None]) -> bool:
    # Runs before the task writes anything, so before the task itself imports the client.
    emit(0, bytes([item]))
    return "pocketflow.client" in sys.modules


def test_pocketflows_runtime_hands_the_loaded_client_down_to_every_task(
    local_cluster: LocalCluster, fexec: Any
) -> None:
    """With :func:`pocketflow_lithops.runtime.runtime_path` as Lithops' runtime, the process of
    every task starts with the client loaded (Lithops' runner loaded it once, before forking);
    with this interpreter as the runtime, no task process has it until it imports it."""
    import lithops
    from pocketflow_lithops.runtime import runtime_path

    preloading = lithops.FunctionExecutor(
        config=lithops_config(storage="localhost", workers=2, runtime=runtime_path()))
    try:
        result = shuffle(preloading, _client_loaded, _join, [1, 2, 3, 4], reducers=1,
                         cluster=local_cluster, timeout_s=SHUFFLE_TIMEOUT_S)
    finally:
        preloading.clean()
    assert result.map_values == [True] * 4
    assert result.outputs == [b"0:" + bytes([1, 2, 3, 4])]
    plain = shuffle(fexec, _client_loaded, _join, [1, 2], reducers=1, cluster=local_cluster,
                    timeout_s=SHUFFLE_TIMEOUT_S)
    assert plain.map_values == [False, False]


def test_the_runtime_runs_a_script_as_the_interpreter_would(tmp_path: Path) -> None:
    from pocketflow_lithops.runtime import PRELOADED_MODULES, runtime_path

    script = tmp_path / "show.py"
    script.write_text(
        "import json, sys\n"
        f"loaded = [m for m in {PRELOADED_MODULES!r} if m in sys.modules]\n"
        "print(json.dumps([sys.argv, sys.path[0], __name__, loaded]))\n"
        "sys.exit(3)\n"
    )
    done = subprocess.run([runtime_path(), str(script), "run_job", "x y"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    argv, path0, name, loaded = json.loads(done.stdout)
    assert argv == [str(script), "run_job", "x y"] and path0 == str(tmp_path)
    assert name == "__main__" and loaded == list(PRELOADED_MODULES)
    # Any other command line is the interpreter's.
    done = subprocess.run([runtime_path(), "-c", "import sys; print(sys.argv[1:])", "a"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "['a']"

def test_sort_output_persists_and_reducers_wait_for_late_mappers(
    local_cluster: LocalCluster, fexec: Any
) -> None:
    config = SortConfig(mappers=2, reducers=2, records=20_000, seed=5)
    result = shuffle(fexec, functools.partial(map_records, config), reduce_records, range(2),
                     reducers=2, cluster=local_cluster, persist_output=True,
                     input_size_bytes=config.input_bytes, timeout_s=SHUFFLE_TIMEOUT_S)
    assert all(isinstance(o, OutputInfo) and o.bucket == "output" for o in result.outputs)
    checksum = sum(m.checksum for m in result.map_values) % (1 << 64)
    with pocketflow.connect(result.handle_json) as pf:
        parts = [records_from(pf.get(o.bucket, o.key, delete=True)) for o in result.outputs]
    assert sum(p.shape[0] for p in parts) == 20_000
    assert all(is_sorted(p) for p in parts)
    assert sum(record_checksum(p) for p in parts) % (1 << 64) == checksum

    # A reducer starts while its only mapper still runs and is parked until the input arrives.
    # The mapper sleeps 5 s: the reducer's worker may start up to 4 s after it on a loaded
    # machine and still be seen parked for at least 1 s.
    result = shuffle(fexec, functools.partial(_slow_then_emit, 5.0), _reduce_started, [0],
                     reducers=1, cluster=local_cluster, timeout_s=SHUFFLE_TIMEOUT_S)
    reducer_started_s, inputs = result.outputs[0]
    assert inputs == [b"late"]
    assert result.input_wait_s[0] >= 1.0, result.input_wait_s
    assert reducer_started_s >= result.map_values[0] - 0.01  # read only after the write


def test_the_append_layout_delivers_the_same_partitions_and_sorts(
    local_cluster: LocalCluster, fexec: Any
) -> None:
    baseline = used_bytes(local_cluster)
    expected = [
        f"{r}:".encode() + b"".join(bytes([m]) * (10 * (r + 1)) + b"|" for m in (1, 2, 3))
        for r in range(3)
    ]
    # Both layouts with their data scoped to prefix leases (1 s, renewed by the driver).
    for layout in ("objects", "append"):
        scoped = shuffle(fexec, _emit_bytes, _join, [1, 2, 3], reducers=3,
                         cluster=local_cluster, input_size_bytes=1000,
                         timeout_s=SHUFFLE_TIMEOUT_S, layout=layout, prefix_lease_ms=1000)
        assert scoped.outputs == expected, layout
    result = shuffle(fexec, _emit_bytes, _join, [1, 2, 3], reducers=3, cluster=local_cluster,
                     input_size_bytes=1000, timeout_s=SHUFFLE_TIMEOUT_S, layout="append")
    assert result.map_values == [100, 200, 300]
    assert result.outputs == expected
    assert result.bytes_shuffled == sum(3 * (10 * (r + 1) + 1) for r in range(3))
    # A sort whose partitions take many records each (100 KB per mapper and reducer).
    config = SortConfig(mappers=3, reducers=2, records=6_000, seed=9)
    result = shuffle(fexec, functools.partial(map_records, config), reduce_records, range(3),
                     reducers=2, cluster=local_cluster, persist_output=True,
                     input_size_bytes=config.input_bytes, timeout_s=SHUFFLE_TIMEOUT_S,
                     layout="append")
    checksum = sum(m.checksum for m in result.map_values) % (1 << 64)
    with pocketflow.connect(result.handle_json) as pf:
        parts = [records_from(pf.get(o.bucket, o.key, delete=True)) for o in result.outputs]
    assert sum(p.shape[0] for p in parts) == 6_000
    assert all(is_sorted(p) for p in parts)
    assert sum(record_checksum(p) for p in parts) % (1 << 64) == checksum
    assert wait_for(lambda: used_bytes(local_cluster) == baseline), used_bytes(local_cluster)
    with pytest.raises(ValueError):
        shuffle(fexec, _emit_bytes, _join, [1], reducers=1, cluster=local_cluster,
                layout="columns")


def test_a_failing_mapper_fails_the_shuffle_and_deregisters_its_job(
    local_cluster: LocalCluster, fexec: Any
) -> None:
    jobs_before = {j["job_id"] for j in local_cluster.status()["jobs"]}
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="mapper 1 breaks"):
        shuffle(fexec, _failing_map, _join, [0, 1], reducers=1, cluster=local_cluster,
                input_wait_s=60, timeout_s=SHUFFLE_TIMEOUT_S)
    assert time.monotonic() - started < SHUFFLE_TIMEOUT_S
    assert {j["job_id"] for j in local_cluster.status()["jobs"]} == jobs_before


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_reducer_retried_after_its_delete_reads_has_its_inputs_regenerated(
    local_cluster: LocalCluster, fexec: Any, tmp_path: Path, how: str
) -> None:
    baseline = used_bytes(local_cluster)
    config = SortConfig(mappers=3, reducers=3, records=6_000, seed=17)
    with local_cluster.register_job("reducer-retry") as job:
        result = shuffle(fexec, functools.partial(map_records, config),
                         functools.partial(_reduce_crashing_once, str(tmp_path), 1, how), range(3),
                         reducers=3, job=job, persist_output=True,
                         input_size_bytes=config.input_bytes, timeout_s=SHUFFLE_TIMEOUT_S)
        # Reducer 1's first attempt read all of its inputs with DELETE, then failed.
        assert int((tmp_path / "reducer-1").read_text()) > 0
        assert result.retried == [1]
        # Its retry found them consumed; exactly its partitions were regenerated, once.
        assert result.regenerated == [[(m, 1) for m in range(3)]]
        with job.connect() as pf:
            assert pf.list("shuffle") == []  # no input and no marker left behind
            checks = [describe_partition(r, pf.get(o.bucket, o.key, delete=True))
                      for r, o in enumerate(result.outputs)]
    input_checksum = sum(m.checksum for m in result.map_values) % (1 << 64)
    assert check_output(config, input_checksum=input_checksum, checks=checks) == []
    assert wait_for(lambda: used_bytes(local_cluster) == baseline), used_bytes(local_cluster)


def test_a_retried_reducer_tells_consumed_inputs_from_never_written_ones(
    local_cluster: LocalCluster,
) -> None:
    """The reducer task on its own, in this process: with the marker of an attempt that read
    its inputs it reports them lost at once; with inputs nobody marked it waits its bound and
    fails clearly."""
    with local_cluster.register_job("reducer-marker") as job, job.connect() as pf:
        pf.create_bucket("shuffle")
        spec = _Spec(handle_json=job.handle.to_json(), mappers=2, reducers=1, bucket="shuffle",
                     output_bucket="output", persist_output=False, input_wait_s=60.0,
                     client_options=())
        inputs = [(shuffle_key(mapper=m, reducer=0), f"input {m}".encode()) for m in range(2)]
        pf.put_many("shuffle", inputs)
        with pytest.raises(RuntimeError, match="reduce function breaks"):
            _shuffle_task(_ReduceCall(spec, _raise_on_reduce, 0))
        assert [i.key for i in pf.list("shuffle")] == [
            i.key for i in pf.list("shuffle", CONSUMING_PREFIX)
        ], "the inputs were read with DELETE, and the attempt's marker is left"

        started = time.monotonic()
        outcome = _shuffle_task(_ReduceCall(spec, _join, 0))
        assert isinstance(outcome, _ReduceOutcome)
        assert outcome.lost_mappers == (0, 1) and outcome.unreachable == ()
        assert time.monotonic() - started < RETRY_PROBE_MAX_S

        # The driver reruns the mappers; the next attempt reads what they wrote again.
        pf.put_many("shuffle", inputs)
        outcome = _shuffle_task(_ReduceCall(spec, _join, 0))
        assert outcome.value == b"0:input 0input 1" and outcome.lost_mappers == ()

        # Inputs that never arrive, with no marker naming them: a clear error, no loop.
        spec = spec._replace(input_wait_s=1.0)
        started = time.monotonic()
        with pytest.raises(ShuffleFailed, match=r"reducer 1: inputs of mappers \[0, 1\] did not"):
            _shuffle_task(_ReduceCall(spec, _join, 1))
        assert time.monotonic() - started < RETRY_PROBE_MAX_S

        # An attempt the driver named writes an empty finished marker as it returns; one that
        # raised writes none (the driver then learns of it from Lithops alone).
        pf.put_many("shuffle", inputs)
        outcome = _shuffle_task(_ReduceCall(spec, _join, 0, attempt="a1"))
        assert outcome.value == b"0:input 0input 1"
        assert pf.get("shuffle", finished_key(reducer=0, attempt="a1")) == b""
        pf.put_many("shuffle", inputs)
        with pytest.raises(RuntimeError, match="reduce function breaks"):
            _shuffle_task(_ReduceCall(spec, _raise_on_reduce, 0, attempt="a2"))
        assert not pf.exists("shuffle", finished_key(reducer=0, attempt="a2"))


def test_a_reducer_ahead_of_a_mapper_marks_only_the_inputs_it_consumed(
    local_cluster: LocalCluster,
) -> None:
    """A reducer reads the inputs that are there before looking for the others, and names every
    input in its marker before that read; once some were not there, the marker names only those
    it consumed. So a retry after an attempt that ran ahead of a slow mapper reports the
    consumed input lost, and not the one never written (which is waited for, not
    regenerated)."""
    with local_cluster.register_job("reducer-ahead") as job, job.connect() as pf:
        pf.create_bucket("shuffle")
        spec = _Spec(handle_json=job.handle.to_json(), mappers=2, reducers=1, bucket="shuffle",
                     output_bucket="output", persist_output=False, input_wait_s=1.0,
                     client_options=())
        pf.put("shuffle", shuffle_key(mapper=0, reducer=0), b"input 0")
        with pytest.raises(ShuffleFailed, match=r"inputs of mappers \[1\] did not arrive"):
            _shuffle_task(_ReduceCall(spec, _join, 0))
        markers = pf.list("shuffle", CONSUMING_PREFIX)
        assert len(markers) == 1
        assert pf.get("shuffle", markers[0].key) == bytes([0b01]), "names mapper 0 alone"

        started = time.monotonic()
        outcome = _shuffle_task(_ReduceCall(spec, _join, 0))
        assert isinstance(outcome, _ReduceOutcome)
        assert outcome.lost_mappers == (0,), outcome
        assert time.monotonic() - started < RETRY_PROBE_MAX_S

        # The driver reruns mapper 0; mapper 1 writes at last: the next attempt reads both.
        pf.put_many("shuffle", [(shuffle_key(mapper=m, reducer=0), f"input {m}".encode())
                                for m in range(2)])
        outcome = _shuffle_task(_ReduceCall(spec, _join, 0))
        assert outcome.value == b"0:input 0input 1" and outcome.lost_mappers == ()
        assert [i.key for i in pf.list("shuffle")] == [
            i.key for i in pf.list("shuffle", CONSUMING_PREFIX)
        ], "every input was read with DELETE"


def test_bad_arguments_are_refused(local_cluster: LocalCluster, fexec: Any) -> None:
    with pytest.raises(ValueError):
        shuffle(fexec, _emit_bytes, _join, [], reducers=1, cluster=local_cluster)
    with pytest.raises(ValueError):
        shuffle(fexec, _emit_bytes, _join, [1], reducers=0, cluster=local_cluster)
    with pytest.raises(ValueError):
        shuffle(fexec, _emit_bytes, _join, [1], reducers=1, cluster=local_cluster,
                reduce_retries=-1)
    assert issubclass(ShuffleFailed, pocketflow.errors.PocketflowError)


# -- lost partitions --------------------------------------------------------------------------


@pytest.fixture
def doomed_server(local_cluster: LocalCluster) -> Iterator[StorageNodeInfo]:
    """A DRAM server added to the session cluster for this test only, killed by the test.

    It is bigger than the session's DRAM servers, so that a no-hints job (weights by free bytes)
    places most keys on it and a few reducers are enough to have inputs on it.
    """
    with extra_server(local_cluster, prefix="doomed", capacity_bytes=DOOMED_CAPACITY_BYTES) as (
        info, _
    ):
        yield info


def _gated_map(config: SortConfig, handle_json: str, gate_keys: tuple[str, ...], mapper: int,
               emit: Callable[[int, Any], None]) -> Any:
    """The sort's mapper; mapper ``m`` below ``len(gate_keys)`` first waits until the test opens
    its gate (puts ``gate_keys[m]``)."""
    if mapper < len(gate_keys):
        with pocketflow.connect(handle_json) as pf:
            for _ in range(3):
                try:
                    missing = pf.wait_for("gate", [gate_keys[mapper]], timeout_s=GATE_TIMEOUT_S)
                    break
                except DataUnavailable as exc:  # the gate's server is the one killed
                    refresh_map(pf, {exc.server or ""}, bucket="gate")
            if missing:
                raise RuntimeError(f"the test never opened mapper {mapper}'s gate")
    return map_records(config, mapper, emit)


def _first_reads_found_nothing(pf: Any, reducers: int) -> bool:
    """Whether ``reducers`` reducer attempts made their first read and consumed nothing: each
    names every input in its marker before that read and no mapper once it found none."""
    try:
        markers = pf.list("shuffle", CONSUMING_PREFIX)
        return len(markers) >= reducers and not any(
            any(pf.get("shuffle", m.key)) for m in markers)
    except (BucketNotFound, ObjectNotFound):  # no bucket yet, or a marker being replaced
        return False


def test_partitions_lost_with_a_killed_server_are_regenerated(
    local_cluster: LocalCluster, fexec: Any, doomed_server: StorageNodeInfo
) -> None:
    info = doomed_server
    with local_cluster.register_job("regen") as job:
        assert info.node_id in {s.node_id for s in job.handle.servers if s.weight > 0}
        placement = Placement(job.handle.servers)
        # Enough reducers that mapper 1 (which writes before the kill) has inputs on the doomed
        # server (and, when the job has other servers with weight, elsewhere too).
        on_doomed = [placement.server_for(shuffle_key(mapper=1, reducer=i).encode(), 0).node_id
                     == info.node_id for i in range(REDUCERS_MAX)]
        reducers = next(
            (n for n in range(2, REDUCERS_MAX + 1)
             if any(on_doomed[:n]) and (all(on_doomed) or not all(on_doomed[:n]))),
            None,
        )
        assert reducers is not None, f"no reducer count up to {REDUCERS_MAX} fits: {on_doomed}"
        config = SortConfig(mappers=2, reducers=reducers, records=4_000, seed=11)
        outcome: dict[str, Any] = {}
        with job.connect() as pf:
            pf.create_bucket("gate")

        def run() -> None:
            try:
                outcome["result"] = shuffle(
                    fexec,
                    functools.partial(_gated_map, config, job.handle.to_json(),
                                      ("open", "mapper-1")),
                    reduce_records, range(2), reducers=reducers, job=job, persist_output=True,
                    client_options={"op_timeout_s": 5.0, "connect_timeout_s": 1.0},
                )
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
                outcome["error"] = exc

        driver = threading.Thread(target=run, daemon=True)
        driver.start()
        with job.connect() as pf:
            # A reducer reads every input already there before it waits for the others: mapper 1
            # writes only once the running reducers (two: the fixture's 4 workers hold both
            # mappers and two reducers) found nothing to read. They then wait for all of their
            # inputs, consuming none, so mapper 1's partitions stay where they were written;
            # mapper 0 waits at the gate, so reducers are parked mid-shuffle when the server
            # dies.
            assert wait_for(lambda: _first_reads_found_nothing(pf, 2), timeout_s=60)
            pf.put("gate", "mapper-1", b"1")
            late = [shuffle_key(mapper=1, reducer=r) for r in range(reducers)]
            assert wait_for(lambda: _exists_all(pf, late), timeout_s=60)
            os.kill(info.server_pid, signal.SIGKILL)
            # Both gates open under the map without the dead server (mapper 1's rerun passes
            # its gate again, whose key may have been on that server).
            for gate in ("open", "mapper-1"):
                for _ in range(3):
                    try:
                        pf.put("gate", gate, b"1", overwrite=True)
                        break
                    except DataUnavailable as exc:
                        refresh_map(pf, {exc.server or ""}, bucket="gate")
        driver.join(SHUFFLE_TIMEOUT_S)
        assert not driver.is_alive(), "shuffle did not finish after the server was killed"
        if "error" in outcome:
            raise outcome["error"]
        result = outcome["result"]

        assert result.regenerated, "nothing was regenerated"
        # Mapper 1's output on the killed server is among what was regenerated.
        assert 1 in {m for m, _ in result.regenerated[0]}, result.regenerated
        handle = JobHandle.from_json(result.handle_json)
        assert info.node_id not in {s.node_id for s in handle.servers if s.weight > 0}
        with pocketflow.connect(result.handle_json) as pf:
            checks = [describe_partition(r, pf.get(o.bucket, o.key, delete=True))
                      for r, o in enumerate(result.outputs)]
        input_checksum = sum(m.checksum for m in result.map_values) % (1 << 64)
        assert check_output(config, input_checksum=input_checksum, checks=checks) == []


def _exists_all(pf: Any, keys: list[str]) -> bool:
    try:
        return not pf.wait_for("shuffle", keys, timeout_s=1.0)
    except BucketNotFound:  # the shuffle has not created its bucket yet
        return False


def test_benchmark_script_runs_every_variant(tmp_path: Path) -> None:
    """``benchmarks/lithops_sort.py`` end to end on a tiny sort (its own cluster and redis, in a
    subprocess: Ray runs once per process). It checks the script works, not how fast anything
    is."""
    repo = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.lithops_sort", "--quick", "--records", "8000",
         "--out", str(tmp_path)],
        cwd=repo, capture_output=True, text=True, timeout=BENCHMARK_TIMEOUT_S,
        # Not this process's Ray, nor its Lithops session (whose executor ids it would reuse).
        env={k: v for k, v in os.environ.items()
             if k != "RAY_ADDRESS" and not k.startswith("__LITHOPS_")},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (result_file,) = tmp_path.glob("lithops-sort-*-quick.json")
    results = json.loads(result_file.read_text())
    summary = results["summary"]
    for variant in ("lithops-localhost", "lithops-redis", "pocketflow", "pocketflow-plain-runtime",
                    "pocketflow-no-delete"):
        assert summary[variant]["all_ok"], variant
        assert summary[variant]["peak_held_bytes"] > 0, variant
    assert summary["speedup_vs_localhost"] > 0 and len(summary["speedup_vs_localhost_paired"]) == 3
    # Without DELETE the shuffle data stays until the job ends: more bytes held at the peak.
    assert summary["delete_peak_ratio"] < 1.0
    assert (tmp_path / result_file.name.replace(".json", ".md")).exists()


def test_a_task_waits_for_a_map_with_a_server_to_write_to(
    server_factory: Callable[..., tuple[Any, Any]],
) -> None:
    """After its last data server died where no other had room, a job's new map has no weighted
    server until the control plane has launched one (issue 31): a task's map refresh waits for
    that map instead of writing into nothing at once, and gives up after its bound."""

    servers, info = server_factory("refresh-0", long_running=True)
    weightless = info.replace(weight=0.0)
    handle = servers.handle(servers=[weightless], epoch=2)
    with pocketflow.connect(handle.to_json(), op_timeout_s="5s") as pf:
        with pytest.raises(DataUnavailable, match="no server to write to"):
            refresh_map(pf, set(), bucket="b", timeout_s=1.0)

        def launched() -> None:
            time.sleep(1.0)
            servers.set_epoch(handle.replace(epoch=3, servers=(info,)))

        setter = threading.Thread(target=launched, daemon=True)
        setter.start()
        started = time.monotonic()
        refresh_map(pf, set(), bucket="b", timeout_s=30.0)
        setter.join()
        assert time.monotonic() - started >= 0.5, "it waited for the new map"
        assert pf.handle.epoch == 3 and pf.handle.servers[0].weight > 0
        pf.put("b", "k", b"v")
        assert pf.get("b", "k") == b"v"
