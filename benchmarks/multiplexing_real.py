"""Capacity reuse on a real local cluster: how soon another job can use the DRAM that a job whose
driver died was holding, with job-level lifetime against prefix leases.

Job A fills the cluster's DRAM servers with 1 MiB objects under a prefix ``stage0/``; then its
driver "dies" (this script stops every renewal: the job's lease with the controller, and, in the
prefix scheme, its prefix lease). Job B then writes half as many bytes, retrying every 50 ms
while the servers answer ``capacity_exhausted``. Reported per scheme: how long B waited for the
capacity (from A's last renewal to B's last write).

- ``job``: A's data is scoped to the job only; it is freed when the controller's job lease
  (``JOB_LEASE_MS``) runs out and the controller deregisters the job (Pocket).
- ``prefix``: A's data is also scoped to a prefix lease of ``PREFIX_LEASE_MS`` (Jiffy's 1 s),
  freed by every server on its own when it lapses.

This measures the mechanism that capacity multiplexing rests on, for real; the controller still
allocates per job, so the job-slowdown comparison of Jiffy's Figure 9(a) is the simulator's
(``python3 -m pocketflow.control.multiplexing``). Writes ``results/<date>-multiplexing-real.json``.

    python -m benchmarks.multiplexing_real [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.machine import git_commit, machine, now_iso, today

RESULTS_DIR = Path(__file__).resolve().parent / "results"
JOB_LEASE_MS = 3000
PREFIX_LEASE_MS = 1000
DRAM_CAPACITY = "48MiB"
OBJECT_BYTES = 1024 * 1024
FILL_OBJECTS_MAX = 200
RETRY_S = 0.05
WAIT_BOUND_S = 60.0


def _fill(pf, prefix: str) -> int:
    """Put 1 MiB objects under ``prefix`` until a server is full; returns how many went in."""
    from pocketflow.errors import CapacityExhausted

    payload = bytes(OBJECT_BYTES)
    for i in range(FILL_OBJECTS_MAX):
        try:
            pf.put("d", f"{prefix}/k{i}", payload)
        except CapacityExhausted:
            return i
    return FILL_OBJECTS_MAX


def _one(cluster, scheme: str) -> dict:
    from pocketflow.errors import CapacityExhausted, JobNotRegistered

    hints = {"data_size_bytes": "4MiB"}
    a = cluster.register_job(f"a-{scheme}", hints, lease_ms=JOB_LEASE_MS,
                             prefix_lease_ms=PREFIX_LEASE_MS)
    pa = a.connect()
    pa.create_bucket("d")
    keeper = None
    if scheme == "prefix":
        a.declare("stage0")
        keeper = a.keep(["stage0"])
    filled = _fill(pa, "stage0")
    # The driver dies: no renewal of anything from now on.
    a._lease_stop.set()
    if keeper is not None:
        keeper.close()
    died = time.monotonic()
    b = cluster.register_job(f"b-{scheme}", hints)
    waited_s = None
    try:
        with b.connect() as pb:
            pb.create_bucket("d")
            payload = bytes(OBJECT_BYTES)
            want = max(1, filled // 2)
            for i in range(want):
                while True:
                    try:
                        pb.put("d", f"b/k{i}", payload)
                        break
                    except CapacityExhausted:
                        if time.monotonic() - died > WAIT_BOUND_S:
                            raise
                        time.sleep(RETRY_S)
            waited_s = time.monotonic() - died
    finally:
        b.deregister()
        pa.close()
        try:
            a.deregister()
        except JobNotRegistered:
            pass
    return {"scheme": scheme, "filled_mib": filled, "capacity_back_s": round(waited_s, 3)}


def main(argv: list[str] | None = None) -> int:
    import pocketflow

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    runs = []
    with pocketflow.LocalCluster(dram_servers=2, nvme_servers=0, dram_capacity=DRAM_CAPACITY,
                                 num_cpus=2, object_store_memory="80MiB") as cluster:
        for _ in range(args.repeats):
            for scheme in ("job", "prefix"):
                run = _one(cluster, scheme)
                print(f"  {scheme:6s} filled {run['filled_mib']} MiB, capacity back after "
                      f"{run['capacity_back_s']:.2f} s", flush=True)
                runs.append(run)
    summary = {
        scheme: statistics.median(r["capacity_back_s"] for r in runs if r["scheme"] == scheme)
        for scheme in ("job", "prefix")
    }
    report = {"benchmark": "multiplexing-real", "when": now_iso(), "git": git_commit(),
              "machine": machine(), "job_lease_ms": JOB_LEASE_MS,
              "prefix_lease_ms": PREFIX_LEASE_MS, "dram": f"2 x {DRAM_CAPACITY}",
              "median_capacity_back_s": summary, "runs": runs}
    out = args.out or RESULTS_DIR / f"{today()}-multiplexing-real.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"median seconds until the dead job's DRAM was reused: {summary}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
