"""How a shuffle fails: at once, with the error that says why, and with nothing left running.

A reducer that cannot write its output because every tier of its job is full is not a lost
partition: neither retried nor regenerated (both would write into the same full tiers). A job
whose every storage server is gone fails within seconds, in its tasks and in its driver. A
driver whose job fails exits non-zero and leaves no process of its own behind (checked by pid,
with the process's start time against reuse), nor its executor's data in Lithops' storage.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from fixtures_servers import ServerSet
from pocketflow_lithops.shuffle import shuffle

from pocketflow.cluster import LocalCluster
from pocketflow.demo import lithops_config
from pocketflow.errors import BucketNotFound, CapacityExhausted, DataUnavailable
from pocketflow.handle import ServerInfo
from pocketflow.job import Job

# Lithops pickles the task functions; the ones defined here travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

MiB = 1024 * 1024
SHUFFLE_TIMEOUT_S = 120.0
"""Bound on one shuffle here (Lithops starts a worker process per call)."""
FAIL_FAST_S = 30.0
"""How soon a failure must end the shuffle (or its driver), with slack for a loaded machine;
what failed before the fixes took minutes (retries, regeneration rounds, 30 s map refreshes,
calls left running)."""
DRIVER_TIMEOUT_S = 120.0
"""Bound on the driver process of the exit test, whatever happens."""
LEFTOVER_WAIT_S = 15.0
"""How long the driver's processes may take to be gone once it exited."""
SLOW_MAPPER_S = 60.0
"""How long the mappers that do not fail sleep first: calls that keep running after their
driver failed would outlive it by this much."""


@pytest.fixture
def fexec() -> Iterator[Any]:
    """A Lithops localhost executor with 4 worker processes, shut down after the test."""
    import lithops

    with lithops.FunctionExecutor(
        config=lithops_config(storage="localhost", workers=4)
    ) as executor:
        try:
            yield executor
        finally:
            executor.clean()


def _count_call(directory: str, name: str) -> None:
    """Leave one file per call, so the test counts the calls of each task."""
    (Path(directory) / f"{name}-{time.monotonic_ns()}").touch()


def _calls(directory: Path, name: str) -> int:
    return sum(1 for p in directory.iterdir() if p.name.startswith(f"{name}-"))


def _counted_map(directory: str, item: int, emit: Callable[[int, Any], None]) -> int:
    _count_call(directory, f"mapper{item}")
    for partition in range(2):
        emit(partition, bytes([item]) * 1000)
    return item


def _reduce_too_big_for_its_tier(directory: str, partition: int, inputs: list[bytes]) -> bytes:
    """Reducer 0's output (6 MiB) does not fit the job's only long-running server (4 MiB)."""
    _count_call(directory, f"reducer{partition}")
    if partition == 0:
        return b"o" * (6 * MiB)
    return b"".join(inputs)


def test_a_reducer_whose_output_finds_every_tier_full_fails_the_shuffle_at_once(
    local_cluster: LocalCluster, server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
    fexec: Any, tmp_path: Path,
) -> None:
    # PERSIST outputs go to long-running servers only, and the job has one, of 4 MiB; the
    # shuffle's objects go to the other server.
    servers, _ = server_factory("outputs-0", capacity_bytes=4 * MiB, long_running=True,
                                weight=0.0)
    _, _ = server_factory("shuffle-0", capacity_bytes=32 * MiB)
    handle = servers.handle()
    job = Job(handle, local_cluster.control)
    started = time.monotonic()
    with pytest.raises(CapacityExhausted) as failure:
        shuffle(fexec, functools.partial(_counted_map, str(tmp_path)),
                functools.partial(_reduce_too_big_for_its_tier, str(tmp_path)), [0, 1, 2],
                reducers=2, job=job, persist_output=True, input_wait_s=60,
                timeout_s=SHUFFLE_TIMEOUT_S)
    assert time.monotonic() - started < FAIL_FAST_S
    assert "reducer 0" in str(failure.value)
    # Not a lost partition: reducer 0 ran once, no mapper ran again to regenerate its inputs.
    assert _calls(tmp_path, "reducer0") == 1
    assert [_calls(tmp_path, f"mapper{m}") for m in range(3)] == [1, 1, 1]
    servers.delete_job(handle)


def _write_then_wait(directory: str, item: int, emit: Callable[[int, Any], None]) -> int:
    """Mapper 0 writes at once; the others wait until the test killed every server."""
    if item != 0:
        deadline = time.monotonic() + SHUFFLE_TIMEOUT_S
        while not (Path(directory) / "servers-killed").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the test never killed the servers")
            time.sleep(0.05)
    emit(0, b"x" * 1000)
    return item


def test_a_shuffle_whose_servers_are_all_gone_fails_within_seconds(
    local_cluster: LocalCluster, server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
    fexec: Any, tmp_path: Path,
) -> None:
    # The job's only servers die while its tasks run: the mappers still to write and the
    # reducers parked on the servers fail at once instead of waiting for a new map that no live
    # server can give them (tried from outside: tasks idled ~11 s each and the driver waited
    # for minutes).
    servers, _ = server_factory("gone-0", capacity_bytes=16 * MiB, long_running=True)
    server_factory("gone-1", capacity_bytes=16 * MiB)
    handle = servers.handle()
    job = Job(handle, local_cluster.control)
    killed: list[float] = []

    def kill_once_mapper_0_wrote() -> None:
        # Lithops arms its timeout with SIGALRM, so the shuffle runs on the main thread and
        # the servers die from this one.
        with job.connect() as pf:
            deadline = time.monotonic() + SHUFFLE_TIMEOUT_S
            while not _written(pf, "shuffle", "r00000/m00000"):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
        for process in servers.processes:
            os.kill(process.pid, signal.SIGKILL)
        killed.append(time.monotonic())
        (tmp_path / "servers-killed").touch()

    killer = threading.Thread(target=kill_once_mapper_0_wrote, daemon=True)
    killer.start()
    with pytest.raises(DataUnavailable, match="no storage server of job") as failure:
        # Reads without DELETE: a reducer reads every input already there before it waits for
        # the others, and with DELETE it could consume mapper 0's object before the killer saw
        # it (the killer then waited out its bound and the shuffle its timeout).
        shuffle(fexec, functools.partial(_write_then_wait, str(tmp_path)), _join_inputs,
                [0, 1, 2], reducers=2, job=job, input_wait_s=SHUFFLE_TIMEOUT_S,
                timeout_s=SHUFFLE_TIMEOUT_S, delete_inputs=False)
    failed = time.monotonic()
    killer.join(SHUFFLE_TIMEOUT_S)
    assert killed, f"mapper 0 never wrote: {failure.value}"
    assert failed - killed[0] < FAIL_FAST_S


def _written(pf: Any, bucket: str, key: str) -> bool:
    try:
        return bool(pf.exists(bucket, key))
    except BucketNotFound:  # the driver has not made the shuffle's bucket yet
        return False


def _join_inputs(partition: int, inputs: list[bytes]) -> bytes:
    return b"".join(inputs)


DRIVER_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path

    import pocketflow_lithops.sort as sort
    from pocketflow.control.plane import connect_control_plane
    from pocketflow.demo import SortConfig, forget_inherited_lithops_session, map_records

    directory = Path(sys.argv[2])
    # Read here, not in the task: a Lithops worker's sys.argv is its own (the other mappers
    # then failed with IndexError, sometimes before mapper 0 did).
    slow_s = float(sys.argv[3])

    def failing_map(config, mapper, emit):
        if mapper == 0:
            (directory / "mapper-0-failed").write_text(repr(time.time()))
            raise RuntimeError("mapper 0 fails on purpose")
        time.sleep(slow_s)
        return map_records(config, mapper, emit)

    # The sort's mappers run this instead of generating records (pickled by value, from here).
    sort.map_records = failing_map
    forget_inherited_lithops_session()
    config = SortConfig(mappers=6, reducers=2, records=6_000, processes=3)
    sort.run_sort(connect_control_plane(sys.argv[1]), config, progress=False)
""")


def _lithops_job_files() -> set[Path]:
    """Every file under ``lithops.jobs`` in Lithops' localhost storage (the demo driver's).

    ``os.walk`` skips a directory that goes away while it lists it: other tests' Lithops
    cleaners delete their own jobs' directories meanwhile."""
    from lithops.constants import LITHOPS_TEMP_DIR

    root = Path(LITHOPS_TEMP_DIR) / "storage" / "lithops.jobs"
    return {Path(directory) / name for directory, _, names in os.walk(root) for name in names}


def _descendants(pid: int) -> set[tuple[int, str]]:
    """``(pid, start time)`` of every process below ``pid`` now, whichever thread started it
    (the start time tells a pid reused later apart)."""
    found: set[tuple[int, str]] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        # Every thread's children: Lithops starts its runner from a thread of its own.
        children: list[int] = []
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children += map(int, (task / "children").read_text().split())
            except OSError:
                continue
        for child in children:
            start = _start_time(child)
            if start is not None:
                found.add((child, start))
                todo.append(child)
    return found


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def test_a_driver_whose_job_fails_exits_at_once_and_leaves_no_process(
    local_cluster: LocalCluster, tmp_path: Path,
) -> None:
    # The demo's driver (pocketflow_lithops.sort.run_sort, what `pocketflow demo` runs) with a
    # mapper that fails while the others still have a long time to run: the driver must exit
    # non-zero soon after the failure, and every process it started (Lithops' runner, its
    # workers, the tasks) must be gone. Before, Lithops' job manager and monitor threads kept
    # the driver alive and its runner went on starting the queued calls.
    env = {k: v for k, v in os.environ.items()
           if k != "RAY_ADDRESS" and not k.startswith("__LITHOPS_")}
    lithops_files_before = _lithops_job_files()
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER_SCRIPT, local_cluster.ray_address, str(tmp_path),
         str(SLOW_MAPPER_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )
    seen: set[tuple[int, str]] = set()
    deadline = time.monotonic() + DRIVER_TIMEOUT_S
    try:
        while driver.poll() is None and time.monotonic() < deadline:
            seen |= _descendants(driver.pid)
            time.sleep(0.1)
        exited = time.time()
        assert driver.poll() is not None, "the driver did not exit"
        _, err = driver.communicate()
        assert driver.returncode != 0
        assert "mapper 0 fails on purpose" in err
        failed_at = float((tmp_path / "mapper-0-failed").read_text())
        assert exited - failed_at < FAIL_FAST_S, json.dumps(
            {"exit_after_failure_s": exited - failed_at})
        assert seen, "the driver started no process (Lithops' runner at least)"
        # Its data in Lithops' storage was deleted before it exited, not handed to Lithops'
        # cleaner: that detached process works through every pending request on the machine,
        # 5 s per prefix, and outlived the driver by minutes when others' requests piled up.
        assert not _lithops_job_files() - lithops_files_before
        left = _alive(seen)
        give_up = time.monotonic() + LEFTOVER_WAIT_S
        while left and time.monotonic() < give_up:
            time.sleep(0.2)
            left = _alive(left)
        assert not left, [_cmdline(pid) for pid, _ in left]
    finally:
        # Whatever failed above, nothing of this test stays behind (Lithops' runner has a
        # session of its own, so the driver's group does not hold it).
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.communicate()
        for pid, _ in _alive(seen):
            os.kill(pid, signal.SIGKILL)


def _alive(processes: set[tuple[int, str]]) -> set[tuple[int, str]]:
    return {(pid, start) for pid, start in processes if _start_time(pid) == start}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()[:200].replace(b"\0", b" ").decode()
    except OSError:
        return "?"
