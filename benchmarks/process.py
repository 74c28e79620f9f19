"""Child server processes of a benchmark run: started with a readiness timeout, stopped by pid."""

from __future__ import annotations

import atexit
import ctypes
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

STOP_TIMEOUT_S = 5.0
"""Default time a server may take to exit after SIGTERM before it gets SIGKILL."""

POLL_INTERVAL_S = 0.05
"""Pause between two readiness probes."""

LOG_TAIL_BYTES_MAX = 2000
"""How much of a failed server's log goes into the error message."""

READY_WAIT_BYTES_MAX = 64 * 1024
"""Most output a server may print before its ready line (the rest is in its log)."""

PORTS_MAX = 16
"""Most free ports one call to :func:`free_ports` hands out."""


_PR_SET_PDEATHSIG = 1


def _die_with_parent(signum: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to send the child ``signum`` when this process dies.

    This covers a driver that is killed before its ``finally`` or ``atexit`` can run. The libc
    function is looked up here, before the fork, so the child only makes one system call.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signum)

    return preexec


class ServerStartError(RuntimeError):
    """A benchmark peer's server did not come up within its start timeout."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago.

    The sockets are held open until all ports are chosen, so the ports are distinct; another
    process may still take one before the server binds it, which callers handle by retrying.
    """
    if not 1 <= count <= PORTS_MAX:
        raise ValueError(f"count must be 1..{PORTS_MAX}, got {count}")
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


class ManagedProcess:
    """One server process that this benchmark started; it is always stopped by its pid.

    ``stop`` runs on an explicit call, and at interpreter exit as a safety net. Output goes to
    ``log_path`` unless the process announces readiness with a line on stdout
    (:meth:`start` with ``ready_prefix``).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        death_signal: int = signal.SIGTERM,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.cwd = cwd
        self.env = env
        self.stop_timeout_s = stop_timeout_s
        """How long the process may take to exit after SIGTERM before it gets SIGKILL."""
        self.death_signal = death_signal
        """The signal Linux sends the process if this one dies without stopping it."""
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """Process id while started, else ``None``."""
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        """Whether the process is running."""
        return self._proc is not None and self._proc.poll() is None

    def start(
        self,
        *,
        timeout_s: float,
        ready: Callable[[], bool] | None = None,
        ready_prefix: str | None = None,
    ) -> str | None:
        """Start the process and wait until it is ready; return the rest of the ready line.

        Readiness is either a line on stdout starting with ``ready_prefix`` or ``ready()``
        returning true. Raises :class:`ServerStartError` (after stopping the process) when the
        process exits or ``timeout_s`` passes first.
        """
        if self._proc is not None:
            raise RuntimeError(f"{self.name} is already started")
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if ready_prefix else log,
                stderr=log,
                cwd=self.cwd,
                env=self.env,
                # One prctl call in the child, which takes no lock.
                preexec_fn=_die_with_parent(self.death_signal),
            )
        finally:
            log.close()
        atexit.register(self.stop)
        try:
            if ready_prefix is not None:
                return self._wait_line(ready_prefix, timeout_s)
            self._wait_probe(ready, timeout_s)
            return None
        except BaseException:
            self.stop()
            raise

    def _wait_line(self, prefix: str, timeout_s: float) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        partial = b""  # the last, unfinished line
        seen_bytes = 0
        with selectors.DefaultSelector() as selector:
            selector.register(self._proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline and seen_bytes <= READY_WAIT_BYTES_MAX:
                if not selector.select(timeout=max(deadline - time.monotonic(), 0.0)):
                    continue
                chunk = os.read(self._proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                seen_bytes += len(chunk)
                # Only whole lines: a ready line read in two pieces must not yield half a port.
                *lines, partial = (partial + chunk).split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace")
                    if line.startswith(prefix):
                        return line[len(prefix):].strip()
        raise ServerStartError(
            f"{self.name} printed no {prefix!r} line within {timeout_s:.0f} s "
            f"and {READY_WAIT_BYTES_MAX} bytes "
            f"(exit code {self._proc.poll()}): {self.log_tail()}"
        )

    def _wait_probe(self, ready: Callable[[], bool] | None, timeout_s: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self._proc.returncode}: {self.log_tail()}"
                )
            if ready is None or ready():
                return
            time.sleep(POLL_INTERVAL_S)
        raise ServerStartError(
            f"{self.name} was not ready within {timeout_s:.0f} s: {self.log_tail()}"
        )

    def log_tail(self) -> str:
        """The end of the process's log file, for error messages."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no log)"
        return data[-LOG_TAIL_BYTES_MAX:].decode(errors="replace").strip() or "(empty log)"

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; returns the exit code.

        Safe to call more than once; only ever signals this process's own pid, and only while
        it has not been reaped (so the pid cannot have been reused).
        """
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
        if proc.stdout is not None:
            proc.stdout.close()
        atexit.unregister(self.stop)
        return proc.returncode
