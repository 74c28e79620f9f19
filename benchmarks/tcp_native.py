"""The native raw-TCP peer: the loopback limit that pocketflow is reported as a fraction of.

``pocketflow-loopback`` (the Cargo workspace's ``servers/crates/loopback``, built by ``make
install``) is a sink/source server and a client in Rust with blocking sockets, speaking the
framing of :mod:`benchmarks.tcp`. Its client runs each timed phase itself: a benchmark client
process (:mod:`benchmarks.pool`) keeps one ``pocketflow-loopback client`` process per peer and
hands it the phase (shape, object size, count, batch, common start time, time bound) on a pipe;
the client answers with the same figures :func:`benchmarks.workloads.run_phase` records. So no
Python runs between two requests, and a GET lands in a buffer that is reused (touched once):
what is left is the kernel's loopback path and one copy on each side, the least any storage
system pays for the same request and response shapes on this machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers import REPO_ROOT, _ServerPeer
from benchmarks.process import ManagedProcess, ServerStartError, _die_with_parent
from benchmarks.workloads import DELETE, PHASES, PhaseResult

BINARY_ENV = "POCKETFLOW_LOOPBACK_BINARY"
"""Overrides where the binary is looked for."""
BINARY_BUILT = REPO_ROOT / "servers" / "target" / "release" / "pocketflow-loopback"
"""Where ``make install`` (``cargo build --release`` of the workspace) puts it."""

SERVER_READY_PREFIX = "LOOPBACK_READY "
CLIENT_READY_LINE = "LOOPBACK_CLIENT_READY"
START_TIMEOUT_S = 15.0
CLIENT_STOP_TIMEOUT_S = 5.0
"""How long a client process may take to exit once its input is closed."""


class NativeClientError(RuntimeError):
    """The native client failed a phase or could not start (its message says why)."""


def loopback_binary() -> Path | None:
    """The ``pocketflow-loopback`` binary: ``$POCKETFLOW_LOOPBACK_BINARY``, else the build's."""
    override = os.environ.get(BINARY_ENV)
    path = Path(override) if override else BINARY_BUILT
    return path if path.is_file() and os.access(path, os.X_OK) else None


@dataclass(frozen=True)
class NativeTcpSpec:
    """A sink/source server on 127.0.0.1 and the binary whose client reaches it."""

    port: int
    binary: str
    object_max_bytes: int
    host: str = "127.0.0.1"

    def connect(self) -> NativeTcpClient:
        """Start a native client process connected to the server."""
        return NativeTcpClient(self)


class NativeTcpClient:
    """A ``pocketflow-loopback client`` process that runs whole timed phases (nothing stored).

    It offers :meth:`timed_phase` instead of per-object calls: :func:`~benchmarks.workloads.
    run_phase` hands it every PUT and GET phase. Each of its socket calls has a 60 s deadline,
    so a reply always comes (or the process exits and the pipe closes).
    """

    stores_data = False

    def __init__(self, spec: NativeTcpSpec) -> None:
        argv = [
            spec.binary, "client", "--connect", f"{spec.host}:{spec.port}",
            "--object-max-bytes", str(spec.object_max_bytes),
        ]
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, bufsize=1, preexec_fn=_die_with_parent(signal.SIGKILL),
        )
        ready = self._read_line()
        if ready.strip() != CLIENT_READY_LINE:
            self.close()
            raise NativeClientError(
                f"pocketflow-loopback client did not connect to {spec.host}:{spec.port} "
                f"(exit code {self._proc.returncode})"
            )

    def _read_line(self) -> str:
        assert self._proc.stdout is not None
        return self._proc.stdout.readline()

    def timed_phase(
        self,
        phase: str,
        *,
        keys: Sequence[str],
        size_bytes: int,
        batch_ops: int,
        start_at_ns: int | None,
        seconds_max: float | None,
    ) -> PhaseResult:
        """Run a PUT or GET phase (single or batched) of ``len(keys)`` objects in the client."""
        if phase not in PHASES or phase == DELETE:
            raise ValueError(f"the native client runs put and get phases, not {phase!r}")
        phase_ns_max = 0 if seconds_max is None else max(1, int(seconds_max * 1e9))
        command = (f"phase {phase} {size_bytes} {len(keys)} {batch_ops} {start_at_ns or 0} "
                   f"{phase_ns_max}\n")
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(command)
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise NativeClientError(f"the native client is gone: {exc!r}") from exc
        line = self._read_line()
        if not line:
            raise NativeClientError(
                f"the native client exited (code {self._proc.poll()}) during {command.strip()!r}"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise NativeClientError(f"{command.strip()!r}: {reply['error']}")
        return PhaseResult(
            phase=phase, ops=reply["ops"], bytes=reply["bytes"], start_ns=reply["start_ns"],
            end_ns=reply["end_ns"], latencies_ns=reply["latencies_ns"],
        )

    def delete_many(self, prefix: str, keys: Sequence[str]) -> None:
        """Nothing to delete: the server stores nothing."""

    def close(self) -> None:
        """Close the client's input (it exits), and kill it by pid if it does not in time."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._proc.wait(timeout=CLIENT_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=CLIENT_STOP_TIMEOUT_S)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


class NativeTcpPeer(_ServerPeer):
    """``tcp-native``: the Rust sink/source server and client of ``pocketflow-loopback``."""

    name = "tcp-native"

    def __init__(self, *, object_max_bytes: int = 64 * 1024 * 1024) -> None:
        super().__init__()
        self.object_max_bytes = object_max_bytes
        self._spec: NativeTcpSpec | None = None
        self.notes.append(
            "Rust client and server (pocketflow-loopback), blocking sockets, stores nothing; "
            "the client times whole phases and reads GETs into a reused buffer: the loopback "
            "limit"
        )

    def start(self) -> None:
        """Start ``pocketflow-loopback serve`` and read its address from the ready line."""
        binary = loopback_binary()
        if binary is None:
            raise ServerStartError(
                f"pocketflow-loopback not built ({BINARY_BUILT}): run `make install` (or set "
                f"{BINARY_ENV})"
            )
        work = self._work_dir()
        argv = [
            str(binary), "serve", "--object-max-bytes", str(self.object_max_bytes),
            "--parent-pid", str(os.getpid()),
        ]
        self._process = ManagedProcess("tcp-native", argv, log_path=work / "loopback.log")
        address = self._process.start(timeout_s=START_TIMEOUT_S, ready_prefix=SERVER_READY_PREFIX)
        assert address is not None
        host, _, port = address.rpartition(":")
        self._spec = NativeTcpSpec(
            port=int(port), host=host, binary=str(binary), object_max_bytes=self.object_max_bytes
        )

    def spec(self) -> NativeTcpSpec:
        """The server's port and the client binary."""
        if self._spec is None:
            raise RuntimeError("tcp-native peer is not started")
        return self._spec
