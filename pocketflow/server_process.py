"""Start, watch and stop one `pocketflow-server` storage server process."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pocketflow.errors import ServerStartError
from pocketflow.tls import ServerCert

log = logging.getLogger(__name__)

READY_PREFIX = "POCKETFLOW_SERVER_READY "
SERVER_BINARY_NAME = "pocketflow-server"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
STDERR_TAIL_LINES_MAX = 50
PIPE_DRAIN_TIMEOUT_S = 2.0
"""How long ``stop`` waits for the output-draining threads to reach the end of the pipes."""


def find_server_binary() -> Path:
    """Locate the storage server binary.

    Order: the ``POCKETFLOW_SERVER_BIN`` environment variable, then the newer of the copy that
    ``make install`` puts in ``pocketflow/_bin`` and the Cargo release build of a source checkout,
    then ``PATH``.
    """
    override = os.environ.get("POCKETFLOW_SERVER_BIN")
    if override:
        path = Path(override)
        if not path.is_file():
            raise ServerStartError(f"POCKETFLOW_SERVER_BIN={override} is not a file")
        return path
    package_dir = Path(__file__).resolve().parent
    candidates = [
        package_dir / "_bin" / SERVER_BINARY_NAME,
        package_dir.parent / "servers" / "target" / "release" / SERVER_BINARY_NAME,
    ]
    found = [c for c in candidates if c.is_file()]
    if found:
        # In a source checkout the Cargo build may be newer than the copy `make install` made.
        return max(found, key=lambda c: c.stat().st_mtime)
    on_path = shutil.which(SERVER_BINARY_NAME)
    if on_path:
        return Path(on_path)
    raise ServerStartError(
        f"{SERVER_BINARY_NAME} not found; run `make install` (looked in "
        f"{', '.join(str(c) for c in candidates)} and PATH)"
    )


@dataclass(frozen=True)
class ServerKeys:
    """A server's key material, handed to it over stdin (``--keys-from-stdin``): the cluster
    secret and, with TLS, its certificate chain and key (PEM). Never on its command line or in a
    file, so a task on the machine finds it neither by listing processes nor by looking in the
    cluster's directories."""

    secret: bytes = field(repr=False)
    tls_cert_pem: str | None = None
    tls_key_pem: str | None = field(default=None, repr=False)

    def document(self) -> bytes:
        """The JSON document the server reads from stdin (docs/PROTOCOL.md)."""
        doc: dict[str, str] = {"secret_hex": self.secret.hex()}
        if self.tls_cert_pem is not None and self.tls_key_pem is not None:
            doc["tls_cert_pem"] = self.tls_cert_pem
            doc["tls_key_pem"] = self.tls_key_pem
        return json.dumps(doc).encode()


@dataclass(frozen=True)
class ServerSpec:
    """How to start one storage server. Its keys come from ``keys`` (over stdin), else from
    ``secret_file`` and ``tls`` (files, for manual use and tests)."""

    node_id: str
    tier: str
    capacity_bytes: int
    secret_file: Path | None = None
    long_running: bool = False
    nvme_path: Path | None = None
    threads: int | None = None
    parent_pid: int | None = None
    persist_ttl_ms: int | None = None
    """How long PERSIST objects live after they are written (``None``: until the server exits)."""
    listen_host: str = "127.0.0.1"
    """The address to listen on (the node's address); not loopback only with ``tls``."""
    tls: ServerCert | None = None
    """Certificate and key files: every connection must then use TLS."""
    keys: ServerKeys | None = None
    """The secret (and TLS identity) over stdin instead of ``secret_file`` and ``tls``."""
    metrics: bool = True
    """Serve Prometheus metrics at ``<listen_host>:<port>/metrics``: over HTTPS with the server's
    certificate when it uses TLS, else over plain HTTP (which a non-loopback address allows only
    with ``metrics_plaintext``)."""
    metrics_plaintext: bool = False
    """Serve the metrics over plain HTTP even with TLS or on a node address (an explicit opt-in,
    ``--metrics-plaintext``)."""
    shared_dram: bool = False
    """Keep the DRAM arena in a sealed memfd that processes of this host and uid may map
    read-only (``--shared-dram``): zero-copy reads of pinned objects (docs/ARCHITECTURE.md)."""

    @property
    def uses_tls(self) -> bool:
        """Whether every connection to the server must use TLS."""
        return self.tls is not None or (
            self.keys is not None and self.keys.tls_cert_pem is not None
        )


def _bracketed(host: str) -> str:
    """``host`` as the host part of ``host:port`` (IPv6 addresses in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class StorageServerProcess:
    """One running storage server, started by this process and stopped by its process id."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self._proc: subprocess.Popen[str] | None = None
        self._address: str | None = None
        self._metrics_address: str | None = None
        self._metrics_tls = False
        self._stderr_tail: list[str] = []
        self._stderr_lock = threading.Lock()
        self._pipe_threads: list[threading.Thread] = []

    @property
    def address(self) -> str:
        """``host:port`` the server listens on."""
        if self._address is None:
            raise ServerStartError(f"server {self.spec.node_id} is not started")
        return self._address

    @property
    def metrics_url(self) -> str | None:
        """``https://host:port/metrics`` (a server with TLS serves its metrics over HTTPS, with
        its own certificate), ``http://...`` otherwise, or ``None`` when the server serves no
        metrics."""
        if self._metrics_address is None:
            return None
        scheme = "https" if self._metrics_tls else "http"
        return f"{scheme}://{self._metrics_address}/metrics"

    @property
    def pid(self) -> int:
        """Process id of the running server."""
        if self._proc is None:
            raise ServerStartError(f"server {self.spec.node_id} is not started")
        return self._proc.pid

    def command(self) -> list[str]:
        """The argument vector used to start the server."""
        spec = self.spec
        args = [
            str(find_server_binary()),
            "--listen", f"{_bracketed(spec.listen_host)}:0",
            "--node-id", spec.node_id,
            "--tier", spec.tier,
            "--capacity", str(spec.capacity_bytes),
        ]
        if spec.keys is not None:
            args.append("--keys-from-stdin")
        else:
            if spec.secret_file is None:
                raise ServerStartError(f"server {spec.node_id}: no keys and no secret file")
            args += ["--secret-file", str(spec.secret_file)]
            if spec.tls is not None:
                args += ["--tls-cert", str(spec.tls.cert), "--tls-key", str(spec.tls.key)]
        if spec.long_running:
            args.append("--long-running")
        if spec.shared_dram:
            args.append("--shared-dram")
        if spec.metrics:
            args += ["--metrics-listen", f"{_bracketed(spec.listen_host)}:0"]
            if spec.metrics_plaintext:
                args.append("--metrics-plaintext")
        if spec.nvme_path is not None:
            args += ["--nvme-path", str(spec.nvme_path)]
        if spec.threads is not None:
            args += ["--threads", str(spec.threads)]
        if spec.persist_ttl_ms is not None:
            args += ["--persist-ttl", f"{spec.persist_ttl_ms}ms"]
        args += ["--parent-pid", str(spec.parent_pid if spec.parent_pid else os.getpid())]
        return args

    def start(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """Start the server and wait until it reports its address; returns ``host:port``."""
        if self._proc is not None:
            raise ServerStartError(f"server {self.spec.node_id} already started")
        command = self.command()
        keys = self.spec.keys
        try:
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL if keys is None else subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        except OSError as exc:
            raise ServerStartError(
                f"server {self.spec.node_id}: cannot run {command[0]}: {exc}"
            ) from exc
        if keys is not None:
            # One document, then end of input: the server reads its keys at start only.
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(keys.document().decode())
                self._proc.stdin.close()
            except OSError as exc:  # it died at once; the ready wait below reports why
                log.warning("server %s: its keys could not be sent: %s", self.spec.node_id, exc)
        ready: list[str] = []
        ready_event = threading.Event()
        self._pipe_threads = [
            threading.Thread(target=self._drain_stderr, daemon=True),
            threading.Thread(target=self._read_ready_line, args=(ready, ready_event), daemon=True),
        ]
        for thread in self._pipe_threads:
            thread.start()
        # The reader keeps draining stdout after the ready line, so wait for the event, not
        # for the thread to end.
        ready_event.wait(timeout_s)
        if not ready:
            self.stop()
            raise ServerStartError(
                f"server {self.spec.node_id} did not become ready within {timeout_s:.0f}s: "
                + self.stderr_tail()
            )
        # `host:port [metrics=host:port [metrics_tls]] [tls]`
        fields = ready[0].split()
        self._address = fields[0]
        for word in fields[1:]:
            if word.startswith("metrics="):
                self._metrics_address = word[len("metrics="):]
            elif word == "metrics_tls":
                self._metrics_tls = True
        return self._address

    def _read_ready_line(self, out: list[str], ready_event: threading.Event) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            for line in self._proc.stdout:
                if line.startswith(READY_PREFIX):
                    out.append(line[len(READY_PREFIX):].strip())
                    break
        finally:
            # Also set when stdout ends without the line (the server died), so start() fails fast.
            ready_event.set()
        # Keep draining stdout so the server never blocks on a full pipe.
        for _ in self._proc.stdout:
            pass

    def _drain_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for line in self._proc.stderr:
            with self._stderr_lock:
                self._stderr_tail.append(line.rstrip("\n"))
                del self._stderr_tail[:-STDERR_TAIL_LINES_MAX]

    def stderr_tail(self) -> str:
        """The last lines the server wrote to stderr."""
        with self._stderr_lock:
            return "\n".join(self._stderr_tail)

    def alive(self) -> bool:
        """Whether the server process is still running."""
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """Kill the server abruptly (SIGKILL), for failure tests."""
        if self.alive():
            assert self._proc is not None
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait(STOP_TIMEOUT_S)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Stop the server by its process id: SIGTERM, then SIGKILL after ``timeout_s``."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout_s)
        self._close_pipes()
        return proc.returncode

    def _close_pipes(self) -> None:
        """Close stdout and stderr once their draining threads have read them to the end."""
        proc = self._proc
        if proc is None or proc.poll() is None:
            return
        deadline = time.monotonic() + PIPE_DRAIN_TIMEOUT_S
        for thread in self._pipe_threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        if any(thread.is_alive() for thread in self._pipe_threads):
            return  # a descendant still holds a pipe open; closing under a reader is unsafe
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
