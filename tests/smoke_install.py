"""The install smoke test: what a new user's first minutes need, run by the interpreter of one
install (the editable install of `make install`, or a wheel in a fresh virtualenv).

Run as ``python tests/smoke_install.py client`` or ``... demo``; the last line of its output is
one JSON object of what it measured. It exits non-zero, naming the failure, when:

- ``client``: a storage server started from ``find_server_binary()`` (with ``--binary-under``,
  that binary must lie under that directory, e.g. the virtualenv) does not take a job, or a
  fresh process that imports ``pocketflow`` and connects with the job's handle cannot put and get
  back an object, or loads Ray, Lithops, pyarrow or numpy on the way. It reports that process's
  time for ``import pocketflow`` + ``connect(handle)`` (wall clock, and the CPU time it used,
  which a loaded machine inflates less) and its resident memory after them: medians of
  ``TASK_RUNS`` fresh processes.
- ``demo``: ``pocketflow demo`` (the console script beside this interpreter) cannot sort a small
  input on a fresh local cluster, with Lithops' own data in pocketflow (the ``pocket`` storage
  backend, found through the ``pocketflow-lithops`` package's import hook).

Not collected by pytest (the name has no ``test_`` prefix): ``tests/test_install_smoke.py`` runs
it in the editable install, ``make test-wheels`` (``.ci/wheel_smoke.py``) from the wheels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY_MODULES = ("ray", "lithops", "pyarrow", "numpy")
"""Top-level packages a task that only connects must not load."""

SERVER_CAPACITY_BYTES = 16 * 1024 * 1024
TOKEN_TTL_S = 600.0
CHILD_TIMEOUT_S = 60.0
"""Bound on the connecting process (it starts in well under a second)."""
TASK_RUNS = 5
"""Fresh connecting processes per smoke run (``--runs``); the figures reported are their medians
(the first one also pays for reading the native core from disk)."""
TASK_RUNS_MAX = 500
"""Bound on ``--runs`` (each run is a fresh process of well under a second)."""
DEMO_TIMEOUT_S = 600.0
"""Bound on the demo sort, cluster start included (about 30 s on a loaded 2-core machine)."""
DEMO_ARGS = ("--records", "20000", "--mappers", "2", "--reducers", "2", "--processes", "2",
             "--lithops-storage", "pocket", "--no-progress")

# The connecting task: stdin carries the handle's JSON; prints one JSON line.
TASK_SCRIPT = """
import json, sys, time
startup_cpu_ms = time.process_time() * 1000
handle_json = sys.stdin.read()
modules_before = len(sys.modules)
started, started_cpu = time.perf_counter(), time.process_time()
import pocketflow
pf = pocketflow.connect(handle_json)
connected_ms = (time.perf_counter() - started) * 1000
connected_cpu_ms = (time.process_time() - started_cpu) * 1000
modules_loaded = len(sys.modules) - modules_before
with open("/proc/self/status") as status:
    rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
heavy = sorted({name.split(".")[0] for name in sys.modules} & set(sys.argv[1].split(",")))
bucket = sys.argv[2]
pf.create_bucket(bucket)
pf.put(bucket, "hello", b"hello from " + sys.executable.encode())
value = pf.get(bucket, "hello", delete=True)
pf.close()
print(json.dumps({"import_connect_ms": round(connected_ms, 2),
                  "import_connect_cpu_ms": round(connected_cpu_ms, 2),
                  "startup_cpu_ms": round(startup_cpu_ms, 2), "modules_loaded": modules_loaded,
                  "rss_mib": round(rss_kib / 1024, 1), "heavy_modules": heavy,
                  "value": value.decode(), "pocketflow_file": pocketflow.__file__}))
"""


def client_round_trip(binary_under: Path | None, runs: int) -> dict[str, object]:
    """Start one DRAM server, make a job on it, and run the connecting task against it."""
    from pocketflow.auth import make_token, write_secret_file
    from pocketflow.handle import JobHandle, ServerInfo
    from pocketflow.server_process import ServerSpec, StorageServerProcess, find_server_binary
    from pocketflow.transport import AdminClient

    binary = find_server_binary().resolve()
    if binary_under is not None and not binary.is_relative_to(binary_under.resolve()):
        raise SystemExit(f"the server binary {binary} is not the install's (under {binary_under})")
    with tempfile.TemporaryDirectory(prefix="pocketflow-smoke-") as work_dir:
        secret_file = Path(work_dir) / "cluster.secret"
        secret = write_secret_file(secret_file)
        server = StorageServerProcess(ServerSpec(
            node_id="smoke-0", tier="dram", capacity_bytes=SERVER_CAPACITY_BYTES,
            secret_file=secret_file, threads=1,
        ))
        address = server.start()
        try:
            handle = JobHandle(
                job_id="smoke", name="smoke", epoch=1,
                servers=(ServerInfo("smoke-0", address, "dram", 1.0, False),),
                token=make_token(secret, "smoke", ttl_s=TOKEN_TTL_S),
            )
            with AdminClient(address, make_token(secret, "__admin__", ttl_s=TOKEN_TTL_S)) as admin:
                admin.set_epoch(handle.job_id, handle.epoch, handle.weight_map())
            reports = [run_task(handle.to_json(), f"smoke-{run}") for run in range(runs)]
        finally:
            server.stop()
    report = dict(reports[-1])
    for figure in ("import_connect_ms", "import_connect_cpu_ms", "startup_cpu_ms", "rss_mib"):
        report[figure] = statistics.median(run[figure] for run in reports)
        report[f"{figure}_runs"] = [run[figure] for run in reports]
    report["server_binary"] = str(binary)
    return report


def run_task(handle_json: str, bucket: str) -> dict[str, object]:
    """One fresh connecting process; fails unless it read its value back with no heavy module."""
    child = subprocess.run(
        [sys.executable, "-c", TASK_SCRIPT, ",".join(HEAVY_MODULES), bucket],
        input=handle_json, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False,
    )
    if child.returncode != 0:
        raise SystemExit(f"the connecting task failed:\n{child.stderr}")
    report = json.loads(child.stdout.strip().splitlines()[-1])
    if report["value"] != f"hello from {sys.executable}":
        raise SystemExit(f"the task read back {report['value']!r}")
    if report["heavy_modules"]:
        raise SystemExit(f"importing and connecting loaded {report['heavy_modules']}")
    return report


def demo_sort() -> dict[str, object]:
    """``pocketflow demo`` on a small input; its summary lines are reported."""
    command = Path(sys.executable).with_name("pocketflow")
    started = time.perf_counter()
    result = subprocess.run(
        [str(command), "demo", *DEMO_ARGS], capture_output=True, text=True,
        timeout=DEMO_TIMEOUT_S, check=False,
    )
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"pocketflow demo failed ({result.returncode}):\n{result.stdout}\n"
                         f"{result.stderr[-4000:]}")
    return {"demo_s": round(seconds, 1), "demo_output": result.stdout.strip().splitlines()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("client", "demo"))
    parser.add_argument("--binary-under", type=Path, default=None,
                        help="fail unless the server binary found lies under this directory")
    parser.add_argument("--runs", type=int, default=TASK_RUNS,
                        help="fresh connecting processes of `client` (medians reported)")
    args = parser.parse_args()
    if not 1 <= args.runs <= TASK_RUNS_MAX:
        parser.error(f"--runs must be 1..{TASK_RUNS_MAX}")
    report = (client_round_trip(args.binary_under, args.runs) if args.what == "client"
              else demo_sort())
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
