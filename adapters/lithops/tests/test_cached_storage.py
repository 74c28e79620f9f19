"""The Lithops storage backend ``pocket_cache``: a real localhost executor maps over inputs in a
real S3 server (SeaweedFS) named ``pocket_cache://bucket/key``, its workers read them through
a pocketflow cache (whole and in chunks); the second run asks S3 nothing. Also the backend's
storage calls and the import hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lithops
import pytest
from fixtures_s3 import boto3_client
from lithops.storage.utils import StorageNoSuchKeyError
from pocketflow_lithops.cached_storage import (
    URL_SCHEME,
    PocketCacheStorageBackend,
    cached_storage_config,
    inputs,
    load_config,
)

from pocketflow.cache import open_cache
from pocketflow.cache.cache import Cache
from pocketflow.cache.source import S3Source
from pocketflow.cluster import LocalCluster
from pocketflow.demo import lithops_config
from pocketflow.errors import InvalidRequest, S3Error

MiB = 1024 * 1024


@pytest.fixture
def cache(local_cluster: LocalCluster, s3_server: S3Source) -> Iterator[Cache]:
    # A lease longer than the test: the second run's reads need no validation either.
    with open_cache("lithops-inputs", s3_server, app="lithops-test", idle="60s",
                    lease_ms=600_000, cluster=local_cluster) as opened:
        yield opened


@pytest.fixture
def s3(s3_server: S3Source) -> Iterator[Any]:
    client = boto3_client(s3_server)
    yield client
    client.close()


def test_a_map_reads_its_inputs_through_the_cache(cache: Cache, s3: Any,
                                                   s3_bucket: str) -> None:
    def count_bytes(obj: Any) -> dict[str, Any]:
        # A map function over one input: its bytes, and the S3 GETs of this call's process
        # (Lithops opened the input before the call, in the process it forked for the call).
        # Nested, so it is shipped by value and the worker does not import this module.
        import os

        from pocketflow.cache.source import request_counts

        data = obj.data_stream.read()
        return {"key": obj.key, "bytes": len(data), "head": data[:8].decode(),
                "pid": os.getpid(), "gets": request_counts().get("GetObject", 0)}

    sizes = {f"in/part-{i}": 100_000 + i for i in range(6)}
    for key, size in sizes.items():
        s3.put_object(Bucket=s3_bucket, Key=key, Body=key.encode().ljust(size, b"."))
    config = cached_storage_config(cache, lithops_config(storage="localhost", workers=2))
    urls = [f"{URL_SCHEME}{s3_bucket}/{key}" for key in sorted(sizes)]
    fexec = lithops.FunctionExecutor(config=config)
    try:
        first = fexec.get_result(fexec.map(count_bytes, urls))
        second = fexec.get_result(fexec.map(count_bytes, urls))
        # A prefix lists the inputs through the backend (S3's listing).
        by_prefix = fexec.get_result(fexec.map(count_bytes, f"{URL_SCHEME}{s3_bucket}/in/"))
    finally:
        fexec.clean(clean_cloudobjects=False)
    for results in (first, second, by_prefix):
        assert sorted((r["key"], r["bytes"]) for r in results) == sorted(sizes.items())
        assert all(r["head"] == "in/part-" for r in results)
    assert len({r["pid"] for r in first}) == len(sizes), "a process per call"
    assert sum(r["gets"] for r in first) == len(sizes)
    assert sum(r["gets"] for r in second) == 0, "the second run's inputs came from the cache"
    assert sum(r["gets"] for r in by_prefix) == 0


def test_chunks_are_read_as_ranges_of_the_cached_object(cache: Cache, s3: Any,
                                                        s3_bucket: str) -> None:
    def count_lines(obj: Any) -> int:
        return obj.data_stream.read().count(b"\n")

    body = b"".join(b"line %06d\n" % i for i in range(60_000))
    s3.put_object(Bucket=s3_bucket, Key="lines.txt", Body=body)
    config = cached_storage_config(cache, lithops_config(storage="localhost", workers=2))
    fexec = lithops.FunctionExecutor(config=config)
    try:
        counts = fexec.get_result(fexec.map(
            count_lines, [f"{URL_SCHEME}{s3_bucket}/lines.txt"], obj_chunk_size=128 * 1024,
            obj_newline="\n"))
    finally:
        fexec.clean(clean_cloudobjects=False)
    assert len(counts) > 1 and sum(counts) == 60_000


def test_storage_calls(cache: Cache, s3: Any, s3_bucket: str) -> None:
    backend = PocketCacheStorageBackend({"spec": cache.spec.to_json()})
    backend.put_object(s3_bucket, "a/1", "text")
    backend.put_object(s3_bucket, "a/2", b"bytes")
    assert s3.get_object(Bucket=s3_bucket, Key="a/1")["Body"].read() == b"text"
    assert backend.get_object(s3_bucket, "a/2") == b"bytes"
    assert backend.get_object(s3_bucket, "a/2", stream=True).read() == b"bytes"
    assert backend.get_object(s3_bucket, "a/2", extra_get_args={"Range": "bytes=1-2"}) == b"yt"
    assert backend.get_object(s3_bucket, "a/2", extra_get_args={"Range": "bytes=-2"}) == b"es"
    assert backend.head_object(s3_bucket, "a/1")["content-length"] == "4"
    assert backend.list_keys(s3_bucket, "a/") == ["a/1", "a/2"]
    assert backend.list_objects(s3_bucket, "a/", match_pattern="*2") == [{"Key": "a/2",
                                                                         "Size": 5}]
    assert backend.head_bucket(s3_bucket)["ResponseMetadata"]["HTTPStatusCode"] == 200
    with pytest.raises(StorageNoSuchKeyError):
        backend.head_bucket("no-such-bucket-here")
    assert backend.list_objects("no-such-bucket-here") == []
    backend.delete_objects(s3_bucket, ["a/1", "a/1", "missing"])
    with pytest.raises(StorageNoSuchKeyError):
        backend.get_object(s3_bucket, "a/1")
    with pytest.raises(StorageNoSuchKeyError):
        backend.head_object(s3_bucket, "a/1")
    with pytest.raises(S3Error):
        backend.put_object("in", "k", b"a bucket name S3 refuses")
    assert inputs(cache.spec.to_json()) is backend.get_client()


def test_config_is_checked() -> None:
    with pytest.raises(InvalidRequest):
        load_config({})
    with pytest.raises(InvalidRequest):
        load_config({"pocket_cache": {}})
    with pytest.raises(InvalidRequest):
        load_config({"pocket_cache": {"spec": "{}"}})


def test_a_fresh_interpreter_finds_the_backend(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "assert 'pocketflow' not in sys.modules, 'the hook must not import pocketflow'\n"
        "import lithops.storage.backends.pocket_cache as backend\n"
        "import lithops.storage.backends.pocket_cache.config as config\n"
        "print(backend.StorageBackend.__module__, config.load_config.__module__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    target = "pocketflow_lithops.cached_storage"
    assert result.stdout.split() == [target, target]


def test_the_modules_shipped_to_workers_import_without_benchmarks(tmp_path: Path) -> None:
    """Lithops ships the module of a function it maps, and the modules beside it that it
    imports, to its workers; in CI a worker cannot import ``benchmarks`` (a directory of the
    checkout, not an installed package), so neither this module nor the S3 fixtures may import
    it at the top (CI failed both Lithops maps above with ModuleNotFoundError)."""
    here = Path(__file__).resolve().parent
    code = (
        "import sys\n"
        "class NoBenchmarks:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'benchmarks':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, NoBenchmarks())\n"
        "import fixtures_s3, test_cached_storage\n"
        "print('imported')\n"
    )
    path = os.pathsep.join([str(here), str(here.parents[2] / "tests"),
                            os.environ.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": path},
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and result.stdout.split() == ["imported"], result.stderr


BENCHMARK_TIMEOUT_S = 600.0
"""Bound on the quick benchmark (two local clusters, a SeaweedFS and ten Lithops maps: about
4 minutes on a loaded 2-core machine)."""


@pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 30)
def test_the_benchmark_runs_every_way(tmp_path: Path) -> None:
    """``benchmarks/cache_inputs.py --quick`` end to end (its own S3 server and clusters, in a
    subprocess: Ray runs once per process). It checks the script works and its runs are what
    they say (inputs verified, S3 requests as each way implies), not how fast anything is."""
    repo = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.cache_inputs", "--quick", "--out", str(tmp_path)],
        cwd=repo, capture_output=True, text=True, timeout=BENCHMARK_TIMEOUT_S,
        env={k: v for k, v in os.environ.items()
             if k != "RAY_ADDRESS" and not k.startswith("__LITHOPS_")},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result_file,) = tmp_path.glob("cache-inputs-*-quick.json")
    results = json.loads(result_file.read_text())
    runs = {(r["mix"], r["way"]): r for r in results["runs"]}
    assert set(runs) == {(m, w) for m in ("1MiB", "4KiB")
                         for w in ("s3", "s3-raw", "cold", "cached", "prewarmed")}
    for (mix, way), r in runs.items():
        count = 12 if mix == "1MiB" else 300
        assert r["ok"] and r["reads"] == count, (mix, way)
        gets = r["s3_requests"].get("GetObject", 0)
        # The cold and prewarmed runs' drivers also look for the working set's copy in S3.
        if way in ("s3", "s3-raw"):
            assert gets == count, (mix, way, r["s3_requests"])
        if way == "cold":
            assert gets == count + 1, (mix, way, r["s3_requests"])
        if way == "cached":
            assert gets == 0 and r["hit_ratio"] == 1.0, (mix, r)
            assert r["s3_requests"].get("ListObjectsV2", 0) >= 1, "validated by listing"
        if way == "prewarmed":
            assert r["cache"]["prewarm_from"] == "s3"
            # Each key fetched once, by a GET of its own (the prewarm's or a task's) or from
            # the last run's pack of small entries (4 KiB: one ranged GET per batch of 256).
            packed = r["cache"]["prewarm_stats"]["packed"]
            assert packed == (0 if mix == "1MiB" else count), (mix, r["cache"])
            ranged = gets - 1 - (count - packed)
            assert 0 <= ranged <= -(-packed // 256), (mix, r["s3_requests"])
            # The workers' CPU per object without their start, and their start's CPU.
            assert r["prewarm_start_cpu_s"] > 0, (mix, r)
            assert 0 < r["prewarm_fetch_cpu_us_per_object"] < r["prewarm_cpu_us_per_object"], r
    assert set(results["goals"]) == {"1MiB", "4KiB"}
    assert (tmp_path / result_file.name.replace(".json", ".md")).exists()
