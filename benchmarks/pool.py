"""Benchmark client processes (multiprocessing spawn) that run workload phases together.

The processes are started once per run and reused for every peer and cell, so a cell pays no
interpreter start-up. Each keeps one open client per peer (by :class:`ClientSpec`). The driver
sends each of the first ``clients`` processes one phase with a common start time on the
machine-wide monotonic clock, then collects their :class:`~benchmarks.workloads.PhaseResult`.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.workloads import PhaseResult, clock_ns, run_phase

PROCESSES_MAX = 64
"""Most client processes one pool starts."""

START_TIMEOUT_S = 60.0
"""How long a client process may take to start and answer its first ping."""

PHASE_TIMEOUT_S = 180.0
"""How long one phase may take in one client process before the run fails."""

START_DELAY_NS = 20_000_000
"""Common start time of a phase: this far after the driver sends it (20 ms)."""

IDLE_TIMEOUT_S = 1800.0
"""A client process with no command for this long exits by itself."""

STOP_TIMEOUT_S = 5.0


class PhaseError(RuntimeError):
    """A client process failed a phase (its traceback is the message)."""


def _worker_main(conn: Connection) -> None:
    """Client process loop: run commands until told to close, the pipe closes, or idle timeout."""
    clients: dict[Any, Any] = {}
    try:
        while conn.poll(IDLE_TIMEOUT_S):
            try:
                command, args = conn.recv()
            except EOFError:
                return
            if command == "close":
                return
            try:
                if command == "ping":
                    reply: Any = "pong"
                elif command == "forget":
                    client = clients.pop(args, None)
                    if client is not None:
                        client.close()
                    reply = None
                elif command == "phase":
                    spec, kwargs = args
                    client = clients.get(spec)
                    if client is None:
                        client = clients[spec] = spec.connect()
                    reply = run_phase(client, **kwargs)
                else:
                    raise ValueError(f"unknown command {command!r}")
                conn.send(("ok", reply))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        for client in clients.values():
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing is best effort at exit
                pass


class ClientPool:
    """``processes`` benchmark client processes; use as a context manager."""

    def __init__(self, processes: int) -> None:
        if not 1 <= processes <= PROCESSES_MAX:
            raise ValueError(f"processes must be 1..{PROCESSES_MAX}, got {processes}")
        self.size = processes
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self.broken = False
        """Set when a process missed its deadline or died: the pool must be replaced."""

    def start(self) -> ClientPool:
        """Spawn the processes and wait until each answers."""
        ctx = multiprocessing.get_context("spawn")
        try:
            for index in range(self.size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main, args=(child,), name=f"bench-client-{index}", daemon=True
                )
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            for conn in self._conns:
                conn.send(("ping", None))
            self._collect(self._conns, timeout_s=START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        return self

    def pids(self) -> list[int]:
        """Process ids of the client processes."""
        return [p.pid for p in self._procs]

    def run(
        self,
        spec: Any,
        phase: str,
        *,
        prefixes: Sequence[str],
        keys: Sequence[Sequence[str]],
        size_bytes: int,
        batch_ops: int = 1,
        seconds_max: float | None = None,
    ) -> list[PhaseResult]:
        """Run one phase in ``len(keys)`` processes at once (process ``i`` gets ``keys[i]``).

        ``seconds_max`` bounds each process's phase (see :func:`~benchmarks.workloads.run_phase`).
        """
        if self.broken:
            raise PhaseError("the client pool is broken; start a new one")
        clients = len(keys)
        if not 1 <= clients <= self.size or len(prefixes) != clients:
            raise ValueError(f"need 1..{self.size} key lists and as many prefixes")
        start_at = clock_ns() + START_DELAY_NS
        conns = self._conns[:clients]
        for conn, prefix, client_keys in zip(conns, prefixes, keys, strict=True):
            kwargs = {
                "phase": phase, "prefix": prefix, "keys": list(client_keys),
                "size_bytes": size_bytes, "batch_ops": batch_ops, "start_at_ns": start_at,
                "seconds_max": seconds_max,
            }
            self._send(conn, ("phase", (spec, kwargs)))
        return self._collect(conns, timeout_s=PHASE_TIMEOUT_S)

    def forget(self, spec: Any) -> None:
        """Close every process's client of ``spec`` (its peer is about to stop)."""
        for conn in self._conns:
            self._send(conn, ("forget", spec))
        self._collect(self._conns, timeout_s=PHASE_TIMEOUT_S)

    def _send(self, conn: Connection, message: Any) -> None:
        """Send a command; a process that is gone breaks the pool (it must be replaced)."""
        try:
            conn.send(message)
        except (OSError, ValueError) as exc:  # BrokenPipeError; ValueError: a closed pipe
            self.broken = True
            raise PhaseError(f"a client process is gone: {exc!r}") from exc

    def _collect(self, conns: Sequence[Connection], *, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        replies: list[Any] = []
        errors: list[str] = []
        for index, conn in enumerate(conns):
            if not conn.poll(max(deadline - time.monotonic(), 0.0)):
                self.broken = True
                raise PhaseError(f"client process {index} did not answer within {timeout_s:.0f} s")
            try:
                status, value = conn.recv()
            except EOFError as exc:
                self.broken = True
                raise PhaseError(f"client process {index} exited") from exc
            if status == "ok":
                replies.append(value)
            else:
                errors.append(f"client process {index}:\n{value}")
        if errors:
            raise PhaseError("\n".join(errors))
        return replies

    def close(self) -> None:
        """Ask every process to exit; terminate (by pid) those that do not in time."""
        for conn in self._conns:
            try:
                conn.send(("close", None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self._procs:
            proc.join(max(deadline - time.monotonic(), 0.0))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(STOP_TIMEOUT_S)
        for conn in self._conns:
            conn.close()
        self._procs.clear()
        self._conns.clear()

    def __enter__(self) -> ClientPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
