"""The Lithops storage backend ``pocket``: import hook, storage calls, real localhost executor."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import lithops
import pytest
from lithops.storage.utils import StorageNoSuchKeyError
from pocketflow_lithops.storage import (
    MONITORING_INTERVAL_DEFAULT_S,
    PocketStorageBackend,
    lithops_config,
    load_config,
)

from pocketflow.cluster import LocalCluster
from pocketflow.errors import InvalidRequest
from pocketflow.job import Job

BUCKET = "lithops"
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def job(local_cluster: LocalCluster) -> Iterator[Job]:
    with local_cluster.register_job("lithops-backend-test") as registered:
        yield registered


@pytest.fixture(scope="module")
def config(job: Job) -> dict:
    config = lithops_config(job.handle)
    # Deregistering the job frees its data; a Lithops cleaner running after the cluster has
    # stopped could not reach it and would leave a failing request behind on this machine.
    config["lithops"]["data_cleaner"] = False
    return config


@pytest.fixture(scope="module")
def storage(config: dict) -> lithops.Storage:
    # Lithops' own Storage class, so its loading path (config module, backend class) is used.
    return lithops.Storage(config=config)


def test_a_fresh_interpreter_finds_the_backend_from_any_directory(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "assert 'pocketflow' not in sys.modules, 'the hook must not import pocketflow'\n"
        "import lithops.storage.backends.pocket as backend\n"
        "import lithops.storage.backends.pocket.config as config\n"
        "print(backend.StorageBackend.__module__, config.load_config.__module__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    target = "pocketflow_lithops.storage"
    assert result.stdout.split() == [target, target]


def test_the_installed_pth_hook_is_silent_when_its_module_is_gone(tmp_path: Path) -> None:
    """The installed ``.pth`` loads the hook when it is importable and says nothing otherwise.

    An editable install whose source tree was moved must not print a traceback at the start of
    every Python process on the machine.
    """
    import site

    pth = next(
        (Path(d) / "pocketflow_lithops.pth" for d in site.getsitepackages()
         if (Path(d) / "pocketflow_lithops.pth").is_file()),
        None,
    )
    assert pth is not None, "pocketflow_lithops.pth is not installed in site-packages"
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / pth.name).write_text(pth.read_text(encoding="utf-8"), encoding="utf-8")
    adapter_root = Path(__file__).resolve().parent.parent  # holds _pocketflow_lithops.py
    code = (
        "import site, sys\n"
        f"if len(sys.argv) > 1: sys.path.insert(0, {str(adapter_root)!r})\n"
        f"site.addsitedir({str(site_dir)!r})\n"
        "print('_pocketflow_lithops' in sys.modules)\n"
    )
    # -I -S: no user site, no site-packages, no cwd; only what the code above adds.
    for extra, loaded in (([], "False"), (["with-repo"], "True")):
        result = subprocess.run(
            [sys.executable, "-I", "-S", "-c", code, *extra], cwd=tmp_path, capture_output=True,
            text=True, timeout=60, check=False,
        )
        assert result.returncode == 0, result.stderr
        assert result.stderr == ""
        assert result.stdout.split() == [loaded]


def test_unrelated_names_under_the_backends_package_stay_missing() -> None:
    with pytest.raises(ModuleNotFoundError):
        __import__("lithops.storage.backends.pocket_not_ours")


def test_load_config_requires_a_handle_and_sets_a_short_monitoring_interval(job: Job) -> None:
    with pytest.raises(InvalidRequest):
        load_config({"lithops": {"storage": "pocket"}})
    with pytest.raises(InvalidRequest):
        load_config({"lithops": {"storage": "pocket"}, "pocket": {"storage_bucket": "x"}})
    config = {"lithops": {"storage": "pocket"}, "pocket": {"handle": job.handle.to_json()}}
    load_config(config)
    assert config["pocket"]["storage_bucket"] == BUCKET
    assert config["lithops"]["monitoring_interval"] == MONITORING_INTERVAL_DEFAULT_S
    mine = {"lithops": {"monitoring_interval": 3}, "pocket": {"handle": job.handle.to_json()}}
    load_config(mine)
    assert mine["lithops"]["monitoring_interval"] == 3


def test_handle_file(job: Job, tmp_path: Path) -> None:
    path = tmp_path / "handle.json"
    path.write_text(job.handle.to_json())
    config = {"lithops": {}, "pocket": {"handle_file": str(path)}}
    load_config(config)
    backend = PocketStorageBackend(config["pocket"])
    backend.put_object(BUCKET, "handle-file/k", b"v")
    assert backend.get_object(BUCKET, "handle-file/k") == b"v"


def test_missing_keys_raise_lithops_exceptions(storage: lithops.Storage) -> None:
    with pytest.raises(StorageNoSuchKeyError):
        storage.get_object(BUCKET, "missing/key")
    with pytest.raises(StorageNoSuchKeyError):
        storage.get_object(BUCKET, "missing/key", stream=True)
    with pytest.raises(StorageNoSuchKeyError):
        storage.get_object(BUCKET, "missing/key", extra_get_args={"Range": "bytes=0-3"})
    with pytest.raises(StorageNoSuchKeyError):
        storage.head_object(BUCKET, "missing/key")
    with pytest.raises(StorageNoSuchKeyError):
        storage.get_object("no-such-bucket", "k")
    with pytest.raises(StorageNoSuchKeyError):
        storage.head_bucket("no-such-bucket")
    # As in S3, deleting what is not there is not an error.
    storage.delete_object(BUCKET, "missing/key")
    storage.delete_objects(BUCKET, ["missing/a", "missing/b"])
    assert storage.list_keys("no-such-bucket") == []


def test_put_accepts_bytes_str_and_streams_and_overwrites(storage: lithops.Storage) -> None:
    storage.put_object(BUCKET, "put/bytes", b"one")
    storage.put_object(BUCKET, "put/bytes", b"two")  # Lithops rewrites keys
    storage.put_object(BUCKET, "put/str", "text \u00e9")
    storage.put_object(BUCKET, "put/binary-stream", io.BytesIO(b"stream"))
    storage.put_object(BUCKET, "put/text-stream", io.StringIO("text stream"))
    assert storage.get_object(BUCKET, "put/bytes") == b"two"
    assert storage.get_object(BUCKET, "put/str") == "text \u00e9".encode()
    assert storage.get_object(BUCKET, "put/binary-stream") == b"stream"
    assert storage.get_object(BUCKET, "put/text-stream") == b"text stream"
    assert storage.head_object(BUCKET, "put/bytes")["content-length"] == "3"
    assert storage.head_bucket(BUCKET)["ResponseMetadata"]["HTTPStatusCode"] == 200


def test_a_new_bucket_is_created_by_its_first_put(storage: lithops.Storage) -> None:
    stream = io.BytesIO(b"xx-first")
    stream.seek(3)
    storage.put_object("created-on-put", "k", stream)
    assert storage.get_object("created-on-put", "k") == b"first"


def test_byte_ranges_small_and_across_blocks(storage: lithops.Storage) -> None:
    small = b"0123456789"
    storage.put_object(BUCKET, "range/small", small)
    large = bytes(range(256)) * (10 * MIB // 256 // 4)  # 2.5 MiB: three 1 MiB blocks
    storage.put_object(BUCKET, "range/large", large)

    def get(key: str, spec: str, stream: bool = False) -> bytes:
        data = storage.get_object(BUCKET, key, stream=stream, extra_get_args={"Range": spec})
        return data.read() if stream else data

    assert get("range/small", "bytes=1-4") == small[1:5]
    assert get("range/small", "bytes=7-") == small[7:]
    assert get("range/small", "bytes=-3") == small[-3:]
    assert get("range/small", "bytes=5-100") == small[5:]
    assert get("range/small", "bytes=-100") == small
    assert get("range/small", "bytes=10-") == b""
    assert get("range/small", "bytes=-0") == b""
    assert get("range/small", "bytes=2-2", stream=True) == small[2:3]
    edge = MIB - 5
    assert get("range/large", f"bytes={edge}-{edge + 9}") == large[edge:edge + 10]
    assert get("range/large", f"bytes={2 * MIB - 1}-") == large[2 * MIB - 1:]
    assert get("range/large", "bytes=-7", stream=True) == large[-7:]
    with pytest.raises(InvalidRequest):
        get("range/small", "items=0-1")


def test_streams_read_large_objects_whole(storage: lithops.Storage) -> None:
    large = os.urandom(3 * MIB + 17)
    storage.put_object(BUCKET, "stream/large", io.BytesIO(large))
    body = storage.get_object(BUCKET, "stream/large", stream=True)
    assert hasattr(body, "read")
    assert body.read(10) == large[:10]
    assert body.read() == large[10:]


def test_listing_is_a_plain_prefix_match_with_no_delimiter(storage: lithops.Storage) -> None:
    keys = ["ls/a/b", "ls/a/b/c", "ls/a/bc", "ls/a_b", "ls/b"]
    for key in keys:
        storage.put_object(BUCKET, key, key.encode())
    assert storage.list_keys(BUCKET, "ls/a/b") == ["ls/a/b", "ls/a/b/c", "ls/a/bc"]
    assert storage.list_keys(BUCKET, "ls/a/b/") == ["ls/a/b/c"]
    assert storage.list_keys(BUCKET, "ls/a") == ["ls/a/b", "ls/a/b/c", "ls/a/bc", "ls/a_b"]
    assert storage.list_keys(BUCKET, "ls/zzz") == []
    assert set(keys) <= set(storage.list_keys(BUCKET))
    objects = storage.list_objects(BUCKET, "ls/")
    assert [(o["Key"], o["Size"]) for o in objects] == [(k, len(k)) for k in keys]
    globbed = storage.list_objects(BUCKET, "ls/", match_pattern="ls/a/*c")
    assert [o["Key"] for o in globbed] == ["ls/a/b/c", "ls/a/bc"]
    storage.delete_objects(BUCKET, ["ls/a/b", "ls/b"])
    assert storage.list_keys(BUCKET, "ls/") == ["ls/a/b/c", "ls/a/bc", "ls/a_b"]


def test_upload_and_download_files(storage: lithops.Storage, tmp_path: Path) -> None:
    source = tmp_path / "in.bin"
    data = os.urandom(2 * MIB + 3)
    source.write_bytes(data)
    assert storage.upload_file(str(source), BUCKET, "files/in.bin") is True
    target = tmp_path / "deep" / "dir" / "out.bin"
    assert storage.download_file(BUCKET, "files/in.bin", str(target)) is True
    assert target.read_bytes() == data
    assert storage.download_file(BUCKET, "files/missing", str(tmp_path / "x")) is False


def test_the_localhost_executor_runs_on_pocket_storage(config: dict) -> None:
    def word_count(key: str, storage: lithops.Storage) -> int:
        # Runs in a Lithops worker: a fork of a process that used the backend already.
        storage.put_object(BUCKET, f"exec/{key}", f"{key} and some words".encode())
        text = storage.get_object(BUCKET, f"exec/{key}")
        return len(text.split())

    fexec = lithops.FunctionExecutor(config=config)
    fexec.map(word_count, ["a", "b", "c", "d"])
    assert fexec.get_result() == [4, 4, 4, 4]
    single = lithops.FunctionExecutor(config=config)
    single.call_async(lambda x: x * 2, 21)
    assert single.get_result() == 42
    keys = lithops.Storage(config=config).list_keys(BUCKET, "exec/")
    assert keys == ["exec/a", "exec/b", "exec/c", "exec/d"]
