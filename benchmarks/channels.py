"""Queue and append-file ops against a put and a get of the same size, on one DRAM server.

One real ``pocketflow-server`` (no Ray), one client, one calling thread: the latency of a 1 KiB
put, get, enqueue, dequeue and append, and of the pipelined channel calls (an ``append_many`` of
``BATCH_RECORDS`` records and a ``read`` of that many records' bytes), taking turns in chunks of
``CHUNK_OPS`` (so drift on a shared machine hits every op alike), reported as p50 and p99 and as
the ratio of each op's p50 to the put's. The goal of issue 14: queue ops within 1.2x of a put.
Writes JSON (commit, machine) to ``--out``.

    python -m benchmarks.channels [--ops 2000] [--rounds 5] [--size 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.machine import git_commit, machine, now_iso, today
from pocketflow.auth import admin_token, make_token, write_secret_file
from pocketflow.client import connect
from pocketflow.handle import JobHandle, ServerInfo
from pocketflow.server_process import ServerSpec, StorageServerProcess
from pocketflow.transport import AdminClient

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CHUNK_OPS = 50
"""Ops of one kind timed in a row before the next kind takes its turn."""
BATCH_RECORDS = 16
"""Records of one timed ``append_many``, and records' worth of bytes of one timed ``read``."""


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(ops: int, rounds: int, size: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="pf-bench-channels-") as tmp:
        secret_file = Path(tmp) / "secret"
        secret = write_secret_file(secret_file)
        server = StorageServerProcess(ServerSpec("dram-0", "dram", 512 * 1024 * 1024, secret_file,
                                                 threads=2))
        address = server.start()
        try:
            handle = JobHandle(job_id="bench-channels", name="bench", epoch=1,
                               servers=(ServerInfo("dram-0", address, "dram", 1.0, False),),
                               token=make_token(secret, "bench-channels", ttl_s=3600))
            with AdminClient(address, admin_token(secret, ttl_s=3600)) as admin:
                admin.set_epoch(handle.job_id, 1, handle.weight_map())
            return _measure(handle, ops, rounds, size)
        finally:
            server.stop()


def _measure(handle: JobHandle, ops: int, rounds: int, size: int) -> dict:
    payload = bytes(size)
    batch = [payload] * BATCH_RECORDS
    samples: dict[str, list[float]] = {n: [] for n in
                                       ("put", "get", "enqueue", "dequeue", "append",
                                        "append_many", "read")}
    with connect(handle) as pf:
        pf.create_bucket("b")
        queue = pf.queue("b", "q", max_items=ops + 1)
        log = pf.append_file("b", "log", segment_bytes=64 * 1024 * 1024)
        for r in range(rounds):
            keys = [f"r{r}-k{i}" for i in range(ops)]
            # One file per round, freed with the round's prefix, so the rounds' batches never
            # fill the server.
            many = pf.append_file("b", f"r{r}-many", segment_bytes=64 * 1024 * 1024)
            steps: list[tuple[str, Callable[[int], object]]] = [
                ("put", lambda i, keys=keys: pf.put("b", keys[i], payload)),
                ("get", lambda i, keys=keys: pf.get("b", keys[i])),
                ("enqueue", lambda i: queue.enqueue(payload)),
                ("dequeue", lambda i: queue.dequeue()),
                ("append", lambda i: log.append(payload)),
                ("append_many", lambda i, many=many: many.append_many(batch)),
                ("read", lambda i, many=many: many.read(0, BATCH_RECORDS * size)),
            ]
            for _name, step in steps:
                step(0)  # warm the session
            # Ops take turns in chunks, so a burst of other work on the machine hits every op
            # alike instead of one op's whole round.
            for chunk in range(1, ops, CHUNK_OPS):
                for name, step in steps:
                    taken = samples[name]
                    for i in range(chunk, min(chunk + CHUNK_OPS, ops)):
                        started = time.perf_counter()
                        step(i)
                        taken.append(time.perf_counter() - started)
            pf.delete_prefix("b", f"r{r}-")
    put_p50 = statistics.median(samples["put"])
    return {
        name: {
            "p50_us": round(statistics.median(s) * 1e6, 1),
            "p99_us": round(_percentile(s, 0.99) * 1e6, 1),
            "ops": len(s),
            "p50_vs_put": round(statistics.median(s) / put_p50, 3),
        }
        for name, s in samples.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results = run(args.ops, args.rounds, args.size)
    report = {"benchmark": "channels", "size_bytes": args.size, "when": now_iso(),
              "git": git_commit(), "machine": machine(), "results": results}
    out = args.out or RESULTS_DIR / f"{today()}-channels.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'op':<10}{'p50 us':>10}{'p99 us':>10}{'p50/put':>10}")
    for name, r in results.items():
        print(f"{name:<10}{r['p50_us']:>10}{r['p99_us']:>10}{r['p50_vs_put']:>10}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
