"""The ``StorageNode`` actor: starts one storage server process, reports on it, stops it by pid."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pocketflow.control.admin import AdminTokens
from pocketflow.errors import ServerStartError
from pocketflow.processes import ProcessRef
from pocketflow.server_process import ServerSpec, StorageServerProcess


@dataclass(frozen=True)
class StorageNodeInfo:
    """Where a started storage server listens and which processes run it."""

    node_id: str
    tier: str
    address: str
    capacity_bytes: int
    long_running: bool
    server_pid: int
    server_start_time: float
    actor_pid: int

    def server_process(self) -> ProcessRef:
        """The server process, for stopping it by pid when its actor cannot."""
        return ProcessRef(pid=self.server_pid, start_time=self.server_start_time)


class StorageNode:
    """Supervises one ``pocketflow-server`` process.

    The server is started with ``--parent-pid`` set to this actor's process, so it exits by itself
    if the actor dies. The actor is thin glue: it starts, describes, queries and stops its server.
    """

    def __init__(
        self,
        *,
        node_id: str,
        tier: str,
        capacity_bytes: int,
        secret_file: str,
        long_running: bool = False,
        nvme_path: str | None = None,
        threads: int | None = None,
    ) -> None:
        self._spec = ServerSpec(
            node_id=node_id,
            tier=tier,
            capacity_bytes=capacity_bytes,
            secret_file=Path(secret_file),
            long_running=long_running,
            nvme_path=Path(nvme_path) if nvme_path else None,
            threads=threads,
            parent_pid=os.getpid(),
        )
        self._process = StorageServerProcess(self._spec)
        self._admin = AdminTokens(Path(secret_file))
        self._info: StorageNodeInfo | None = None

    def start(self) -> StorageNodeInfo:
        """Start the server and wait until it listens; returns where it runs."""
        address = self._process.start()
        ref = ProcessRef.of(self._process.pid)
        if ref is None:
            raise ServerStartError(
                f"server {self._spec.node_id} exited right after start: "
                + self._process.stderr_tail()
            )
        self._info = StorageNodeInfo(
            node_id=self._spec.node_id,
            tier=self._spec.tier,
            address=address,
            capacity_bytes=self._spec.capacity_bytes,
            long_running=self._spec.long_running,
            server_pid=ref.pid,
            server_start_time=ref.start_time,
            actor_pid=os.getpid(),
        )
        return self._info

    def info(self) -> StorageNodeInfo:
        """Where the server runs. Raises ``ServerStartError`` before ``start``."""
        if self._info is None:
            raise ServerStartError(f"server {self._spec.node_id} is not started")
        return self._info

    def alive(self) -> bool:
        """Whether the server process is running."""
        return self._process.alive()

    def stats(self) -> dict[str, Any]:
        """The server's last statistics sample (see docs/PROTOCOL.md, Statistics)."""
        return self._admin.client(self.info().address).stats()

    def stderr_tail(self) -> str:
        """The last lines the server wrote to stderr, for diagnosing failures."""
        return self._process.stderr_tail()

    def stop(self) -> int | None:
        """Stop the server by its pid (SIGTERM, then SIGKILL); returns its exit status."""
        self._admin.close()
        return self._process.stop()
