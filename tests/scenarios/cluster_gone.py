"""Scenario run by tests/test_demo.py in its own process: ``pocketflow demo`` on a local cluster
of its own, whose whole cluster (Ray's GCS, raylet and workers, the controller, the storage
servers) is SIGKILLed while the shuffle runs, as another user's ``ray stop`` would. Prints one
JSON line: the demo's exit status, how long after the kill it exited, what it said, and which
of the processes it had started were still alive afterwards (by pid and start time)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEMO_ARGS = ["--records", "12000000", "--mappers", "24", "--reducers", "4", "--processes", "2",
             "--dram-capacity", "64MiB", "--nvme-capacity", "3GiB", "--num-cpus", "1"]
"""A sort whose shuffle runs for several seconds (2,000,000 records took under 3 s on a quiet
machine, so a kill meant for the shuffle landed in the validation or after the sort; since the
records' functions got five times cheaper, 6,000,000 left too thin a margin). The cluster dies
long before the sort would fill its tiers."""
START_TIMEOUT_S = 240.0
"""Bound on the demo's cluster start and the shuffle's first tasks."""
RUNNING_BEFORE_KILL_S = 2.0
"""How long the shuffle runs before the cluster dies (argv[1] overrides it, to try the kill at
other moments by hand)."""
EXIT_TIMEOUT_S = 120.0
"""Bound on the demo's exit after the kill (it is killed beyond, and the scenario says so)."""
SWEEP_S = 3.0
"""How long after the kill the scenario keeps ending the killed cluster's processes, as ``ray
stop`` would: a worker the raylet forked between the scenario's last look and the raylet's
death is an orphan no descendant walk finds, and one still starting can wait a minute for a GCS
that is gone."""
LEFTOVER_WAIT_S = 15.0
"""How long the demo's processes may take to be gone once it exited."""
CLUSTER_PROCESSES = ("gcs_server", "raylet", "ray::", "default_worker.py", "dashboard",
                     "log_monitor.py", "monitor.py", "runtime_env", "pocketflow-server")
"""What in a command line marks a process of the cluster (not the demo, not Lithops)."""


def start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def descendants(pid: int) -> set[tuple[int, str]]:
    found: set[tuple[int, str]] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            started = start_time(child)
            if started is not None:
                found.add((child, started))
                todo.append(child)
    return found


SESSION = re.compile(r"session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_\d+")
"""A Ray session's name, in the command line of every process of that cluster."""


def of_sessions(sessions: set[str]) -> set[tuple[int, str]]:
    """The live processes of the Ray clusters named ``sessions`` (their cluster marks and their
    session's name in the command line), wherever they were reparented."""
    found: set[tuple[int, str]] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        line = cmdline(int(entry.name))
        if (any(name in line for name in sessions)
                and any(mark in line for mark in CLUSTER_PROCESSES)):
            started = start_time(int(entry.name))
            if started is not None:
                found.add((int(entry.name), started))
    return found


def alive(processes: set[tuple[int, str]]) -> set[tuple[int, str]]:
    return {(pid, started) for pid, started in processes if start_time(pid) == started}


def main() -> None:
    running_s = float(sys.argv[1]) if len(sys.argv) > 1 else RUNNING_BEFORE_KILL_S
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_ADDRESS") and not k.startswith("__LITHOPS_")}
    with tempfile.TemporaryDirectory() as scratch:
        said = Path(scratch) / "stderr"
        with said.open("w") as err:
            demo = subprocess.Popen([sys.executable, "-m", "pocketflow", "demo", *DEMO_ARGS],
                                    stdout=subprocess.DEVNULL, stderr=err, env=env,
                                    start_new_session=True)
        out = watch(demo, said, running_s)
    print(json.dumps(out))


def watch(demo: subprocess.Popen[bytes], said: Path, running_s: float) -> dict[str, object]:
    """Wait for the shuffle, kill the cluster, then watch the demo end (see the module doc)."""
    seen: set[tuple[int, str]] = set()
    out: dict[str, object] = {}
    try:
        # The demo says "shuffle: ..." on stderr once its cluster is up and the shuffle starts.
        deadline = time.monotonic() + START_TIMEOUT_S
        while ("shuffle:" not in said.read_text() and demo.poll() is None
               and time.monotonic() < deadline):
            seen |= descendants(demo.pid)
            time.sleep(0.1)
        out["shuffle_started"] = "shuffle:" in said.read_text()
        until = time.monotonic() + running_s
        while time.monotonic() < until and demo.poll() is None:
            seen |= descendants(demo.pid)
            time.sleep(0.1)
        seen |= descendants(demo.pid)
        cluster = [(pid, started) for pid, started in alive(seen)
                   if any(mark in cmdline(pid) for mark in CLUSTER_PROCESSES)]
        out["killed"] = len(cluster)
        # The kill is meant for the shuffle: whether the demo had moved on to its validation (or
        # ended) before it, so that a sort grown too fast shows as such.
        out["shuffle_running_at_kill"] = ("validate:" not in said.read_text()
                                          and demo.poll() is None)
        sessions = {found.group() for pid, _ in cluster
                    if (found := SESSION.search(cmdline(pid))) is not None}
        for pid, _ in cluster:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while demo.poll() is None and time.monotonic() - killed < EXIT_TIMEOUT_S:
            seen |= descendants(demo.pid)
            if time.monotonic() - killed < SWEEP_S:
                stragglers = of_sessions(sessions)
                for pid, _ in stragglers:
                    os.kill(pid, signal.SIGKILL)
                seen |= stragglers
            time.sleep(0.1)
        out["exited"] = demo.poll() is not None
        out["exit_after_kill_s"] = round(time.monotonic() - killed, 1)
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
        demo.wait()
        out["returncode"] = demo.returncode
        out["said"] = [line for line in said.read_text().splitlines()
                       if line.startswith("pocketflow demo:")]
        left = alive(seen)
        give_up = time.monotonic() + LEFTOVER_WAIT_S
        while left and time.monotonic() < give_up:
            time.sleep(0.2)
            left = alive(left)
        out["left"] = sorted(cmdline(pid)[:160] for pid, _ in left)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
        for pid, _ in alive(seen):
            os.kill(pid, signal.SIGKILL)
    return out


if __name__ == "__main__":
    main()
