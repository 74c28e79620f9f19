"""What a result was measured on: commit, date, machine, and the versions of everything compared."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
COMMAND_TIMEOUT_S = 10.0


def _run(argv: list[str], cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(
            argv, cwd=cwd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds process ``pid`` has used so far (Linux ``/proc``); raises
    ``OSError`` when it is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_split_s() -> dict[str, float]:
    """CPU seconds every core of the machine spent so far, split as ``/proc/stat`` does:
    ``user_s`` (with nice), ``system_s``, ``irq_s`` (hard and soft interrupts), ``steal_s``
    (the hypervisor ran something else on this VM's cores), ``iowait_s``; raises ``OSError``
    when it cannot be read."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, iowait, irq, softirq, steal = ticks
    return {"user_s": (user + nice) / tick, "system_s": system / tick,
            "irq_s": (irq + softirq) / tick, "steal_s": steal / tick, "iowait_s": iowait / tick}


def _read_proc(path: str) -> bytes:
    """The bytes of a small ``/proc`` file (one read, no ``pathlib``: a sampler reads hundreds
    per sample); raises ``OSError`` when it is gone."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def _stat_fields(pid: int | str) -> list[bytes]:
    """``/proc/<pid>/stat``'s fields after the command name (``state`` first, ``ppid`` second);
    raises ``OSError`` when the process is gone."""
    return _read_proc(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()


@dataclass
class ProcessScan:
    """One pass over ``/proc`` (:func:`scan_processes`)."""

    commands: dict[int, str]
    """Every live process below the scan's root (and the root), by pid: its command line
    (arguments joined by spaces; its name where it has none)."""
    times: dict[int, tuple[float, float, int, float, float, float]]
    """Of the same processes (those still there for the whole scan): user and system CPU
    seconds so far (all its threads), minor page faults; of its main thread alone, seconds on
    a core and seconds ready to run but waiting for one (the scheduler's run delay: what a
    loaded machine costs it); and the run delay of all its live threads together. A main
    thread's wall time beyond its time on a core and its run delay is time it was blocked (on
    I/O, on other threads, asleep)."""
    kernel_threads_s: float
    """CPU seconds the kernel's own threads (children of ``kthreadd``, pid 2: block-device
    workers, ``ksoftirqd``, reclaim) have spent so far, whoever they worked for."""
    rss_bytes: dict[int, int]
    """Of the same processes as ``times``, resident bytes (``/proc/<pid>/stat``'s ``rss``, the
    counter ``VmRSS`` also shows)."""


def scan_processes(root: int) -> ProcessScan:
    """The processes below ``root``, their CPU times and resident bytes, and the kernel
    threads' CPU (:class:`ProcessScan`), from one pass over Linux ``/proc`` that reads each
    process's ``stat`` once, without ``pathlib`` (a sampler calls it every fraction of a second,
    in the process whose run it measures)."""
    tick = os.sysconf("SC_CLK_TCK")
    page = os.sysconf("SC_PAGE_SIZE")
    stats: dict[int, list[bytes]] = {}
    children: dict[int, list[int]] = {}
    kernel_ticks = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = _stat_fields(name)
            ppid = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
        pid = int(name)
        stats[pid] = fields
        children.setdefault(ppid, []).append(pid)
        if ppid == 2:
            kernel_ticks += int(fields[11]) + int(fields[12])
    commands: dict[int, str] = {}
    times: dict[int, tuple[float, float, int, float, float, float]] = {}
    rss: dict[int, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        fields = stats.get(pid)
        if fields is None:
            continue
        try:
            raw = _read_proc(f"/proc/{pid}/cmdline")
            commands[pid] = (raw.replace(b"\0", b" ").decode(errors="replace").strip()
                             or _read_proc(f"/proc/{pid}/comm").decode(errors="replace").strip())
        except OSError:
            continue
        todo.extend(children.get(pid, ()))
        try:
            on_cpu_ns, run_delay_ns = _read_proc(f"/proc/{pid}/schedstat").split()[:2]
            threads = os.listdir(f"/proc/{pid}/task")
        except (OSError, ValueError):
            continue
        threads_delay_ns = 0
        for task in threads:
            try:
                threads_delay_ns += int(
                    _read_proc(f"/proc/{pid}/task/{task}/schedstat").split()[1])
            except (OSError, IndexError, ValueError):
                continue  # A thread that ended while listed.
        times[pid] = (int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7]),
                      int(on_cpu_ns) / 1e9, int(run_delay_ns) / 1e9, threads_delay_ns / 1e9)
        rss[pid] = int(fields[21]) * page
    return ProcessScan(commands, times, kernel_ticks / tick, rss)


def machine_busy_cpu_s() -> float:
    """CPU seconds every core of the machine spent on anything but idling and I/O wait so far,
    whoever's work it was (``/proc/stat``: user nice system idle iowait irq softirq steal; guest
    times are inside user and nice); raises ``OSError`` when it cannot be read."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def git_commit() -> dict[str, Any]:
    """``git rev-parse HEAD``, whether tracked files changed since, and how many are untracked."""
    commit = _run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT)
    status = _run(["git", "status", "--porcelain"], cwd=REPO_ROOT)
    lines = [] if status is None else status.splitlines()
    return {
        "commit": commit,
        "dirty": None if status is None else any(not x.startswith("??") for x in lines),
        "untracked_files": sum(1 for x in lines if x.startswith("??")),
    }


def today() -> str:
    """Today's date, ``YYYY-MM-DD`` (UTC), the stem of result file names."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")


def now_iso() -> str:
    """The current UTC time, ISO 8601, to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def machine() -> dict[str, Any]:
    """CPU model, cores (online and usable), memory, kernel, OS and Python."""
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_bytes = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_bytes = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError):
        pass
    return {
        "cpu_model": cpu_model or platform.processor() or None,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_bytes": memory_bytes,
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "load_avg_1m_at_start": os.getloadavg()[0],
    }


def package_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """Installed versions of Python distributions (``None`` when absent)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
