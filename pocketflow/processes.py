"""Identify processes this library started and stop them by process id, safe against pid reuse."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

try:  # psutil is optional; /proc is enough on Linux.
    import psutil
except ImportError:  # pragma: no cover - exercised only where psutil is absent
    psutil = None

POLL_INTERVAL_S = 0.05
TERMINATE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ProcessRef:
    """A process id together with its start time, so a recycled pid is never mistaken for it."""

    pid: int
    start_time: float

    @classmethod
    def of(cls, pid: int) -> ProcessRef | None:
        """Reference the running process ``pid``; ``None`` if it does not exist."""
        start = _start_time(pid)
        return None if start is None else cls(pid=pid, start_time=start)

    def alive(self) -> bool:
        """Whether this very process is still running (a zombie counts as gone)."""
        if _is_zombie(self.pid):
            return False
        start = _start_time(self.pid)
        return start is not None and start == self.start_time

    def signal(self, signum: int) -> bool:
        """Send ``signum`` if the pid still names this process; returns whether it was sent."""
        if not self.alive():
            return False
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            return False
        return True


def children(pid: int | None = None) -> set[int]:
    """Process ids of the direct children of ``pid`` (default: this process)."""
    root = os.getpid() if pid is None else pid
    if psutil is not None:
        try:
            return {p.pid for p in psutil.Process(root).children(recursive=False)}
        except psutil.NoSuchProcess:
            return set()
    return {
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and _parent_pid(int(entry.name)) == root
    }


def descendants(pid: int | None = None) -> set[int]:
    """Process ids of all descendants of ``pid`` (default: this process)."""
    root = os.getpid() if pid is None else pid
    if psutil is not None:
        try:
            return {p.pid for p in psutil.Process(root).children(recursive=True)}
        except psutil.NoSuchProcess:
            return set()
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        parent = _parent_pid(int(entry.name))
        if parent is not None:
            children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def wait_gone(refs: list[ProcessRef], *, timeout_s: float) -> list[ProcessRef]:
    """Wait up to ``timeout_s`` for every process to exit; returns those still alive."""
    deadline = time.monotonic() + timeout_s
    remaining = [r for r in refs if r.alive()]
    while remaining and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL_S)
        remaining = [r for r in remaining if r.alive()]
    return remaining


def terminate(
    refs: list[ProcessRef], *, timeout_s: float = TERMINATE_TIMEOUT_S
) -> list[ProcessRef]:
    """SIGTERM each live process, SIGKILL those still alive after ``timeout_s``.

    Returns the processes that survived even SIGKILL (normally none).
    """
    for ref in refs:
        ref.signal(signal.SIGTERM)
    survivors = wait_gone(refs, timeout_s=timeout_s)
    for ref in survivors:
        ref.signal(signal.SIGKILL)
    return wait_gone(survivors, timeout_s=timeout_s)


def _start_time(pid: int) -> float | None:
    if psutil is not None:
        try:
            return psutil.Process(pid).create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
    fields = _stat_fields(pid)
    return None if fields is None else float(fields[19])


def _is_zombie(pid: int) -> bool:
    if psutil is not None:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False
    fields = _stat_fields(pid)
    return fields is not None and fields[0] == "Z"


def _parent_pid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state is field 0)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()
