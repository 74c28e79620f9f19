"""The ``pocket`` backend's put flags per Lithops object kind: on Lithops' own key names, and on a
real localhost job checked from pocketflow's side (keys, PERSIST flags, the job's used bytes)."""

from __future__ import annotations

import pickle
import time
from collections import Counter
from collections.abc import Iterator

import lithops
import pytest
from fixtures_cluster import wait_for
from lithops.constants import JOBS_PREFIX, RUNTIMES_PREFIX, TEMP_PREFIX
from lithops.storage.utils import (
    clean_bucket,
    create_data_key,
    create_func_key,
    create_init_key,
    create_output_key,
    create_status_key,
)
from pocketflow_lithops.object_kinds import ObjectKind, WriteFlags, object_kind, write_flags
from pocketflow_lithops.storage import lithops_config, load_config

import pocketflow
from pocketflow.client import Client
from pocketflow.cluster import LocalCluster
from pocketflow.errors import InvalidRequest, ObjectExists
from pocketflow.job import Job
from pocketflow.status_view import job_bytes

BUCKET = "lithops"
OUTPUT_BUCKET = "flags-outputs"
"""The test's ``persist_buckets``."""
SCRATCH_BUCKET = "flags-scratch"
CALLS = 4
RESULT_BYTES = 64 * 1024
"""Over Lithops' 8 KiB inline limit, so each result is stored as its own ``output.pickle``."""
STATS_INTERVAL_S = 1.2
"""A little over the servers' 1 s statistics interval."""


@pytest.fixture(scope="module")
def job(local_cluster: LocalCluster) -> Iterator[Job]:
    with local_cluster.register_job("lithops-flags-test") as registered:
        yield registered


@pytest.fixture(scope="module")
def config(job: Job) -> dict:
    config = lithops_config(job.handle, persist_buckets=[OUTPUT_BUCKET])
    # As in test_lithops_backend.py: no cleaner process that could outlive the cluster. The test
    # runs Lithops' own clean-up function (clean_bucket) itself instead.
    config["lithops"]["data_cleaner"] = False
    return config


@pytest.fixture(scope="module")
def pf(job: Job) -> Iterator[Client]:
    with pocketflow.connect(job.handle) as client:
        yield client


def _job_bytes_settled(cluster: LocalCluster, job_id: str) -> int:
    """The job's used bytes once two readings a statistics interval apart agree."""
    last = job_bytes(cluster.status()).get(job_id, 0)
    for _ in range(10):
        time.sleep(STATS_INTERVAL_S)
        now = job_bytes(cluster.status()).get(job_id, 0)
        if now == last:
            return now
        last = now
    return last


# -- kinds and flags, on Lithops' own key names -------------------------------------------------


def test_lithops_key_names_map_to_their_kinds() -> None:
    executor, job_id, call = "a1b2c3-0", "M000", "00003"
    kinds = {
        create_func_key(executor, "0123456789abcdef"): ObjectKind.FUNCTION,
        create_data_key(executor, job_id): ObjectKind.CALL_ARGUMENTS,
        create_init_key(executor, job_id, call, "f00ba4f00ba4"): ObjectKind.START_MARKER,
        create_status_key(executor, job_id, call): ObjectKind.STATUS,
        create_output_key(executor, job_id, call): ObjectKind.RESULT,
        f"{TEMP_PREFIX}/cloudobject_0": ObjectKind.CLOUDOBJECT,
        f"{TEMP_PREFIX}/{executor}-{job_id}-{call}/cloudobject_1": ObjectKind.CLOUDOBJECT,
        f"{RUNTIMES_PREFIX}/3.8.0/localhost/python3.meta.json": ObjectKind.RUNTIME_META,
        f"{JOBS_PREFIX}/python3.meta": ObjectKind.OTHER_JOB_DATA,
        f"{JOBS_PREFIX}/{executor}-{job_id}/{call}/.init": ObjectKind.OTHER_JOB_DATA,
        "lithops.jobsx/aggdata.pickle": ObjectKind.USER,
        "data/part-0": ObjectKind.USER,
    }
    for key, kind in kinds.items():
        assert object_kind(BUCKET, key, storage_bucket=BUCKET) is kind, key
        # Lithops keeps its own objects in the storage bucket only.
        assert object_kind("other", key, storage_bucket=BUCKET) is ObjectKind.USER, key


def test_write_flags_per_kind() -> None:
    write_once = {ObjectKind.CALL_ARGUMENTS, ObjectKind.START_MARKER}
    for kind in ObjectKind:
        for persist_bucket in (False, True):
            assert write_flags(kind, persist_bucket=persist_bucket) == WriteFlags(
                persist=persist_bucket and kind is ObjectKind.USER,
                overwrite=kind not in write_once,
            ), (kind, persist_bucket)


def test_persist_buckets_are_checked(job: Job) -> None:
    handle = job.handle.to_json()
    with pytest.raises(InvalidRequest):
        lithops_config(handle, persist_buckets=[BUCKET])  # Lithops' own bucket never persists
    with pytest.raises(InvalidRequest):
        load_config({"pocket": {"handle": handle, "persist_buckets": "outputs"}})
    config = {"pocket": {"handle": handle, "persist_buckets": ["out", "out"]}}
    load_config(config)
    assert config["pocket"]["persist_buckets"] == ["out"]
    config = {"pocket": {"handle": handle}}
    load_config(config)
    assert config["pocket"]["persist_buckets"] == []


# -- a real localhost job, seen from pocketflow -------------------------------------------------


def test_a_map_keeps_every_kind_until_lithops_cleans_it(
    config: dict, pf: Client, job: Job, local_cluster: LocalCluster
) -> None:
    def make_result(i: int) -> bytes:
        return bytes([i]) * RESULT_BYTES  # Runs in a Lithops worker.

    storage = lithops.Storage(config=config)
    # A first executor stores the runtime metadata (if this process has not yet), so that the
    # baseline below holds everything except what the map's executor stores.
    warm_up = lithops.FunctionExecutor(config=config)
    warm_up.call_async(lambda x: x * 2, 21)
    assert warm_up.get_result() == 42
    baseline = _job_bytes_settled(local_cluster, job.job_id)

    fexec = lithops.FunctionExecutor(config=config)
    futures = fexec.map(make_result, list(range(CALLS)))
    fexec.wait(futures, download_results=False)  # statuses only, no result read yet
    unread_copy = pickle.loads(pickle.dumps(futures[1]))
    expected = [bytes([i]) * RESULT_BYTES for i in range(CALLS)]
    assert fexec.get_result(futures) == expected

    executor = fexec.executor_id
    job_keys = pf.list(BUCKET, f"{JOBS_PREFIX}/{executor}-")
    function_keys = pf.list(BUCKET, f"{JOBS_PREFIX}/{executor}/")
    kinds = Counter(
        object_kind(BUCKET, info.key, storage_bucket=BUCKET) for info in job_keys + function_keys
    )
    # Localhost is a batch backend: the arguments always go through storage, one object per job.
    assert kinds == {
        ObjectKind.FUNCTION: 1,
        ObjectKind.CALL_ARGUMENTS: 1,
        ObjectKind.START_MARKER: CALLS,
        ObjectKind.STATUS: CALLS,
        ObjectKind.RESULT: CALLS,
    }
    for info in job_keys + function_keys:
        assert pf.lookup(BUCKET, info.key).persist is False, info.key
    assert wait_for(
        lambda: job_bytes(local_cluster.status()).get(job.job_id, 0)
        >= baseline + CALLS * RESULT_BYTES
    )

    # Nothing was read with DELETE: the results are still there, and reading them again works,
    # by the same futures and by a copy of a future made before its result was read.
    for future in futures:
        assert pf.exists(BUCKET, create_output_key(executor, future.job_id, future.call_id))
    assert fexec.get_result(futures) == expected
    assert unread_copy.result() == expected[1]

    # Write-once kinds refuse a second write and keep the first; overwrite kinds take it.
    job_id = futures[0].job_id
    data_key = create_data_key(executor, job_id)
    arguments = pf.get(BUCKET, data_key)
    with pytest.raises(ObjectExists):
        storage.put_object(BUCKET, data_key, b"a second job with the same id")
    assert pf.get(BUCKET, data_key) == arguments
    marker = next(i.key for i in job_keys if i.key.endswith(".init"))
    with pytest.raises(ObjectExists):
        storage.put_object(BUCKET, marker, b"")
    output_key = create_output_key(executor, job_id, futures[0].call_id)
    storage.put_object(BUCKET, output_key, pf.get(BUCKET, output_key))

    # Lithops' own clean-up (what its cleaner process runs for the job and the executor's
    # functions) frees everything the job stored.
    for prefix in (f"{JOBS_PREFIX}/{executor}-{job_id}/", f"{JOBS_PREFIX}/{executor}/"):
        clean_bucket(storage, BUCKET, prefix, sleep=0)
    assert pf.list(BUCKET, f"{JOBS_PREFIX}/{executor}") == []
    assert wait_for(
        lambda: job_bytes(local_cluster.status()).get(job.job_id, 0) == baseline
    ), (job_bytes(local_cluster.status()).get(job.job_id, 0), baseline)


def test_user_objects_persist_only_in_the_persist_buckets(config: dict, pf: Client) -> None:
    def write_objects(key: str, storage: lithops.Storage) -> list[str]:
        # Runs in a Lithops worker, with the configuration the job carries.
        storage.put_object(OUTPUT_BUCKET, key, b"final output")
        storage.put_object(SCRATCH_BUCKET, key, b"scratch data")
        storage.put_cloudobject(b"final cloudobject", OUTPUT_BUCKET, key + ".co")
        temporary = storage.put_cloudobject(b"temporary cloudobject")
        return [temporary.bucket, temporary.key]

    key = "flags/out-0"
    fexec = lithops.FunctionExecutor(config=config)
    fexec.call_async(write_objects, key)
    temporary_bucket, temporary_key = fexec.get_result()
    try:
        assert pf.lookup(OUTPUT_BUCKET, key).persist is True
        assert pf.lookup(OUTPUT_BUCKET, key + ".co").persist is True
        assert pf.lookup(SCRATCH_BUCKET, key).persist is False
        assert (temporary_bucket, temporary_key.startswith(TEMP_PREFIX + "/")) == (BUCKET, True)
        assert pf.lookup(BUCKET, temporary_key).persist is False
        for info in pf.list(BUCKET, f"{JOBS_PREFIX}/{fexec.executor_id}"):
            assert pf.lookup(BUCKET, info.key).persist is False, info.key
        # User objects are overwritten, as in S3, and stay PERSIST.
        storage = lithops.Storage(config=config)
        storage.put_object(OUTPUT_BUCKET, key, b"final output, second version")
        assert pf.get(OUTPUT_BUCKET, key) == b"final output, second version"
        assert pf.lookup(OUTPUT_BUCKET, key).persist is True
    finally:
        # PERSIST objects outlive the job: take them back rather than leave them to their TTL.
        for bucket, name in ((OUTPUT_BUCKET, key), (OUTPUT_BUCKET, key + ".co")):
            if pf.exists(bucket, name):
                pf.delete(bucket, name)
