"""Pytest plugin: real `pocketflow-server` processes (no Ray) and a connected client per test.

Session scope: a cluster secret (0600 file) and three servers: ``dram-0`` (long-running),
``dram-1`` and ``nvme-0`` (long-running, on a temporary file). Test scope: a fresh job on them
(``job_handle``), told its epoch by the admin client, and a connected ``client``; at teardown the
job's data is freed with ``delete_job``. ``server_factory`` starts private servers that a test may
fill or kill. Every process started here is stopped by its process id. Also helpers that tests
of several files share: which servers hold a key (``records_of``), keys whose PERSIST and
ephemeral homes differ (``split_keys``), waiting for a server process to exit
(``wait_exited``) and restarting one at its old address (``ServerAt``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pocketflow.auth import make_token, write_secret_file
from pocketflow.client import Client, connect
from pocketflow.errors import PocketflowError, ServerStartError
from pocketflow.handle import JobHandle, ServerInfo
from pocketflow.placement import Placement
from pocketflow.protocol import OP_LOOKUP, READY_LINE_PREFIX
from pocketflow.server_process import ServerSpec, StorageServerProcess, find_server_binary
from pocketflow.tls import ServerCert
from pocketflow.transport import AdminClient

TOKEN_TTL_S = 3600.0
SERVER_THREADS = 2
DRAM_CAPACITY_BYTES = 96 * 1024 * 1024
NVME_CAPACITY_BYTES = 128 * 1024 * 1024
TEST_BLOCK_SIZE_BYTES = 1024 * 1024
CLIENT_OPTIONS = {"op_timeout_s": "10s", "rpc_timeout_s": "10s", "stream_timeout_s": "60s"}


def run_with_handle(script: str, handle: JobHandle, *, timeout_s: float) -> list[str]:
    """Run ``script`` in a fresh interpreter with ``handle``'s JSON on stdin; it must exit 0.
    Returns its stdout's words. A fresh interpreter, because this one may hold gRPC calls of
    earlier tests (hung servers) that a fork would inherit."""
    result = subprocess.run(
        [sys.executable, "-c", script], input=handle.to_json(), capture_output=True, text=True,
        timeout=timeout_s, check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


class ServerAt(StorageServerProcess):
    """A server process listening on a given ``host:port`` (a restart at its old address)."""

    def __init__(self, spec: ServerSpec, address: str) -> None:
        super().__init__(spec)
        self._listen = address

    def command(self) -> list[str]:
        args = super().command()
        args[args.index("--listen") + 1] = self._listen
        return args


def records_of(pf: Client, bucket: str, key: str) -> list[str]:
    """The servers of ``pf``'s job that hold an object (a block-0 record, not a fence) of
    ``key``."""
    view = pf._view
    held = []
    for server in view.handle.servers:
        reply = pf._call(view, server, OP_LOOKUP, 0, bucket.encode(), key.encode())
        if reply.status == 0 and not (reply.header is not None and reply.header.fence):
            held.append(server.node_id)
    return held


def split_keys(handle: JobHandle, count: int, prefix: str) -> list[str]:
    """``count`` keys ``{prefix}-{i}`` whose PERSIST home is another server than their
    ephemeral home."""
    placement = Placement.of_handle(handle)
    keys = []
    for i in range(100_000):
        key = f"{prefix}-{i}"
        if (placement.server_for(key.encode()).node_id
                != placement.server_for(key.encode(), persist=True).node_id):
            keys.append(key)
            if len(keys) == count:
                return keys
    raise AssertionError(f"PERSIST and ephemeral keys are placed alike: {handle}")


def wait_exited(pid: int, *, timeout_s: float) -> None:
    """Wait until process ``pid`` is gone or a zombie (a child of this process is reaped by its
    Popen; until then it is a zombie); fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().split(") ", 1)[1].startswith("Z"):
                return
        assert time.monotonic() < deadline, f"server {pid} did not exit"
        time.sleep(0.05)


def _require_binary() -> None:
    try:
        find_server_binary()
    except ServerStartError as exc:
        pytest.fail(
            f"the storage server binary is missing ({exc}); build it with "
            "`cd servers && cargo build --release -p pocketflow-server`",
            pytrace=False,
        )


@dataclass
class ServerSet:
    """Running servers that share one cluster secret, and how to make jobs on them."""

    secret: bytes
    secret_file: Path
    processes: list[StorageServerProcess] = field(default_factory=list)
    infos: list[ServerInfo] = field(default_factory=list)
    tls_ca: str | None = None
    """The CA the servers' certificates chain to (admin clients and handles trust it)."""

    def admin_token(self) -> str:
        """A fresh admin token."""
        return make_token(self.secret, "__admin__", ttl_s=TOKEN_TTL_S)

    def admin(self, address: str) -> AdminClient:
        """An admin client for one server (the caller closes it)."""
        return AdminClient(address, self.admin_token(), tls_ca=self.tls_ca)

    def handle(
        self,
        *,
        job_id: str | None = None,
        servers: Sequence[ServerInfo] | None = None,
        epoch: int = 1,
        block_size_bytes: int = TEST_BLOCK_SIZE_BYTES,
        set_epoch: bool = True,
    ) -> JobHandle:
        """A new job's handle over ``servers`` (default: all), told to the servers."""
        job = job_id or f"test-{uuid.uuid4().hex[:12]}"
        chosen = tuple(self.infos if servers is None else servers)
        handle = JobHandle(
            job_id=job,
            name="test",
            epoch=epoch,
            servers=chosen,
            token=make_token(self.secret, job, ttl_s=TOKEN_TTL_S),
            block_size_bytes=block_size_bytes,
            tls_ca=self.tls_ca,
        )
        if set_epoch:
            self.set_epoch(handle)
        return handle

    def set_epoch(self, handle: JobHandle, servers: Sequence[ServerInfo] | None = None) -> None:
        """Tell servers (default: the handle's) the handle's epoch and weight map."""
        for server in handle.servers if servers is None else servers:
            with self.admin(server.address) as admin:
                admin.set_epoch(handle.job_id, handle.epoch, handle.weight_map())

    def delete_job(self, handle: JobHandle) -> None:
        """Free a job's non-PERSIST data on every server it used (best effort)."""
        for server in handle.servers:
            try:
                with self.admin(server.address) as admin:
                    admin.delete_job(handle.job_id)
            except PocketflowError:
                pass

    def start(
        self,
        node_id: str,
        tier: str,
        capacity_bytes: int,
        *,
        long_running: bool = False,
        nvme_path: Path | None = None,
        weight: float = 1.0,
        persist_ttl_ms: int | None = None,
        listen_host: str = "127.0.0.1",
        tls: ServerCert | None = None,
        shared_dram: bool = False,
    ) -> ServerInfo:
        """Start one more server with this set's secret; returns its weight-map entry."""
        process = StorageServerProcess(ServerSpec(
            listen_host=listen_host,
            tls=tls,
            node_id=node_id,
            tier=tier,
            capacity_bytes=capacity_bytes,
            secret_file=self.secret_file,
            long_running=long_running,
            nvme_path=nvme_path,
            threads=SERVER_THREADS,
            persist_ttl_ms=persist_ttl_ms,
            shared_dram=shared_dram,
        ))
        self.processes.append(process)
        address = process.start()
        info = ServerInfo(node_id, address, tier, weight, long_running)
        self.infos.append(info)
        return info

    def process(self, node_id: str) -> StorageServerProcess:
        """The process of a server by node id."""
        return next(p for p in self.processes if p.spec.node_id == node_id)

    def stop_all(self) -> None:
        """Stop every server this set started, by process id."""
        for process in self.processes:
            try:
                process.stop()
            except (OSError, ServerStartError):
                pass


@dataclass
class KeyedServer:
    """A server process started here with its keys on stdin (``--keys-from-stdin``)."""

    process: subprocess.Popen[str]
    address: str
    ready_fields: list[str]
    """The ready line's words after the prefix."""

    def stop(self) -> None:
        """SIGTERM by pid, then wait."""
        self.process.terminate()
        self.process.wait(timeout=10)


def start_keyed_server(
    secret: bytes, cert: ServerCert | None, *args: str, node_id: str = "keyed-0"
) -> KeyedServer:
    """Start a DRAM server on 127.0.0.1 whose secret (and TLS identity, with ``cert``) come over
    stdin only; ``args`` are more flags. The caller stops it."""
    _require_binary()
    document = {"secret_hex": secret.hex()}
    if cert is not None:
        document |= {"tls_cert_pem": cert.cert.read_text(), "tls_key_pem": cert.key.read_text()}
    process = subprocess.Popen(
        [str(find_server_binary()), "--tier", "dram", "--capacity", "32MiB",
         "--listen", "127.0.0.1:0", "--node-id", node_id, "--threads", str(SERVER_THREADS),
         "--keys-from-stdin", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(json.dumps(document))
    process.stdin.flush()
    ready = process.stdout.readline().split()
    if ready[:1] != [READY_LINE_PREFIX]:
        process.terminate()
        process.wait(timeout=10)
        raise AssertionError(f"no ready line: {ready}")
    return KeyedServer(process, ready[1], ready[1:])


@pytest.fixture(scope="session")
def cluster_secret_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Path]:
    """The session's cluster secret and its 0600 file."""
    path = tmp_path_factory.mktemp("secret") / "cluster.secret"
    return write_secret_file(path), path


@pytest.fixture(scope="session")
def storage_servers(
    cluster_secret_file: tuple[bytes, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerSet]:
    """Three real servers for the session: dram-0 (long-running), dram-1, nvme-0 (long-running)."""
    _require_binary()
    secret, secret_file = cluster_secret_file
    servers = ServerSet(secret, secret_file)
    nvme_file = tmp_path_factory.mktemp("nvme") / "nvme-0.img"
    try:
        servers.start("dram-0", "dram", DRAM_CAPACITY_BYTES, long_running=True)
        servers.start("dram-1", "dram", DRAM_CAPACITY_BYTES)
        servers.start("nvme-0", "nvme", NVME_CAPACITY_BYTES, long_running=True,
                      nvme_path=nvme_file)
        yield servers
    finally:
        servers.stop_all()


@pytest.fixture
def job_handle(storage_servers: ServerSet) -> Iterator[JobHandle]:
    """A fresh job on the session's servers; its data is freed at teardown."""
    handle = storage_servers.handle()
    try:
        yield handle
    finally:
        storage_servers.delete_job(handle)


@pytest.fixture
def client(job_handle: JobHandle) -> Iterator[Client]:
    """A client of the fresh job, with bounded timeouts."""
    with connect(job_handle, **CLIENT_OPTIONS) as connected:
        yield connected


@pytest.fixture
def server_factory(
    cluster_secret_file: tuple[bytes, Path], tmp_path: Path
) -> Iterator[Callable[..., tuple[ServerSet, ServerInfo]]]:
    """Start private servers (to fill or kill) with the session secret; stopped at teardown."""
    _require_binary()
    secret, secret_file = cluster_secret_file
    servers = ServerSet(secret, secret_file)

    def start(
        node_id: str = "private-0",
        tier: str = "dram",
        capacity_bytes: int = 8 * 1024 * 1024,
        *,
        long_running: bool = False,
        weight: float = 1.0,
        persist_ttl_ms: int | None = None,
        shared_dram: bool = False,
    ) -> tuple[ServerSet, ServerInfo]:
        nvme_path = tmp_path / f"{node_id}.img" if tier == "nvme" else None
        info = servers.start(node_id, tier, capacity_bytes, long_running=long_running,
                             nvme_path=nvme_path, weight=weight, persist_ttl_ms=persist_ttl_ms,
                             shared_dram=shared_dram)
        return servers, info

    try:
        yield start
    finally:
        servers.stop_all()
