"""One client's gets from an NVMe server, server binary against server binary, each paired with
fio reading the same file.

Each round, for each ``--binary`` (the order flips every round): an NVMe storage server of that
binary starts on loopback with its data in one file of ``--dir`` (the same file for every
binary and round), the client core puts ``--objects`` objects of ``--size-kib`` KiB (default
1 MiB, in blocks of ``--block-kib``, default 1 MiB as a job's), gets them one after another,
cycling, for ``--seconds``, and fio reads the part of the file the objects occupy with the
pattern of ``engines.py``'s ``seqread-qd1`` (``--rw=read --bs=<block> --iodepth=1 --direct=1
--ioengine=io_uring``, the block capped at the object size) before the server stops, so each get
sample has a fio sample on the same file, the same blocks and the same file system next to it in
time (which of the two runs first flips every other round). ``--dram name=path`` adds a DRAM
server of that binary as a reference: the same gets with the disk taken out.

Prints one JSON line per (binary, round) and one summary line per binary: median GB/s and p50
latency over the rounds, fio's median, and the median of each round's get/fio ratio.

    python3 -m benchmarks.nvme_get --binary before=/tmp/a --binary after=/tmp/b \
        --dram dram=/tmp/b --dir /tmp/pocketflow-nvme-get --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.peers import standalone_job
from pocketflow.auth import write_secret_file
from pocketflow.client import connect
from pocketflow.handle import ServerInfo
from pocketflow.server_process import ServerSpec, StorageServerProcess

TOKEN_TTL_S = 3600.0
CAPACITY_SLACK_BYTES = 64 * 1024 * 1024
FIO_TIMEOUT_S = 120
BUCKET = "bench"


def _fio(data_file: Path, read_bytes: int, span_bytes: int, seconds: float) -> float:
    """GB/s of fio reading the first `span_bytes` of `data_file`, `read_bytes` at a time."""
    command = [
        "fio", "--name=get", f"--filename={data_file}", "--direct=1", "--ioengine=io_uring",
        "--rw=read", f"--bs={read_bytes}", "--iodepth=1", f"--size={span_bytes}",
        f"--runtime={seconds}", "--time_based", "--output-format=json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True,
                          timeout=FIO_TIMEOUT_S)
    return json.loads(done.stdout)["jobs"][0]["read"]["bw_bytes"] / 1e9


def _gets(pf, keys: list[str], size_bytes: int, seconds: float) -> dict:
    """Get `keys` one after another, cycling, for `seconds`; GB/s and latency percentiles."""
    latencies = []
    started = time.perf_counter()
    deadline = started + seconds
    at = 0
    while True:
        before = time.perf_counter()
        data = pf.get(BUCKET, keys[at % len(keys)])
        after = time.perf_counter()
        assert len(data) == size_bytes
        latencies.append(after - before)
        at += 1
        if after >= deadline:
            break
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "gbps": size_bytes * len(latencies) / elapsed / 1e9,
        "p10_us": latencies[len(latencies) // 10] * 1e6,
        "p50_us": latencies[len(latencies) // 2] * 1e6,
        "p99_us": latencies[min(len(latencies) - 1, len(latencies) * 99 // 100)] * 1e6,
        "gets": len(latencies),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", action="append", required=True, help="name=path (NVMe)")
    parser.add_argument("--dram", action="append", default=[], help="name=path (DRAM reference)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pocketflow-nvme-get"))
    parser.add_argument("--size-kib", type=int, default=1024)
    parser.add_argument("--block-kib", type=int, default=1024)
    parser.add_argument("--objects", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--no-fio", action="store_true", help="skip the paired fio runs")
    args = parser.parse_args()
    if shutil.which("fio") is None and not args.no_fio:
        print("fio is not installed", file=sys.stderr)
        return 2

    size_bytes = args.size_kib * 1024
    block_bytes = args.block_kib * 1024
    read_bytes = min(size_bytes, block_bytes)
    # The objects fill the start of the data file, one after another (the allocator is first
    # fit and every server starts empty), so fio reads exactly the blocks the gets read.
    span_bytes = args.objects * size_bytes
    args.dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="nvme-get-", dir=args.dir))
    secret = write_secret_file(workdir / "cluster.secret")
    # Every NVMe server uses the same data file, one server at a time: files of their own
    # differed in speed by up to 1.5x on a virtio disk (where the host caches them), which
    # showed as a difference between binaries.
    data_file = workdir / "data.dat"
    named = [(*n.split("=", 1), "nvme") for n in args.binary]
    named += [(*n.split("=", 1), "dram") for n in args.dram]

    def serve(name: str, path: str, tier: str) -> tuple[StorageServerProcess, Any, list[str]]:
        """Start a server of `path`, put the objects on it and warm the client up."""
        os.environ["POCKETFLOW_SERVER_BIN"] = path
        process = StorageServerProcess(ServerSpec(
            node_id=name, tier=tier, capacity_bytes=span_bytes + CAPACITY_SLACK_BYTES,
            secret_file=workdir / "cluster.secret", threads=2, metrics=False,
            nvme_path=data_file if tier == "nvme" else None))
        info = ServerInfo(name, process.start(), tier, 1.0, False)
        handle = standalone_job(info, secret, block_size_bytes=block_bytes, ttl_s=TOKEN_TTL_S)
        pf = connect(handle)
        pf.create_bucket(BUCKET)
        keys = [f"obj-{i}" for i in range(args.objects)]
        for key in keys:
            pf.put(BUCKET, key, payload)
        _gets(pf, keys, size_bytes, 0.2)  # connect and warm up
        return process, pf, keys

    payload = os.urandom(size_bytes)
    samples: dict[str, list[dict]] = {name: [] for name, _, _ in named}
    try:
        for round_at in range(args.rounds):
            order = named if round_at % 2 == 0 else named[::-1]
            for name, path, tier in order:
                process, pf, keys = serve(name, path, tier)
                try:
                    fio_first = (round_at // 2) % 2 == 1
                    fio_gbps = None
                    run_fio = tier == "nvme" and not args.no_fio
                    if run_fio and fio_first:
                        fio_gbps = _fio(data_file, read_bytes, span_bytes, args.seconds)
                    sample = _gets(pf, keys, size_bytes, args.seconds)
                    if run_fio and not fio_first:
                        fio_gbps = _fio(data_file, read_bytes, span_bytes, args.seconds)
                finally:
                    pf.close()
                    process.stop()
                sample.update(binary=name, tier=tier, round=round_at, fio_gbps=fio_gbps,
                              ratio=None if fio_gbps is None else sample["gbps"] / fio_gbps,
                              load=os.getloadavg()[0])
                samples[name].append(sample)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                  for k, v in sample.items()}), flush=True)

        first = samples[named[0][0]]
        for name, rows in samples.items():
            summary = {
                "binary": name, "rounds": len(rows),
                "median_gbps": round(statistics.median(r["gbps"] for r in rows), 4),
                "median_p10_us": round(statistics.median(r["p10_us"] for r in rows), 1),
                "median_p50_us": round(statistics.median(r["p50_us"] for r in rows), 1),
                "median_p99_us": round(statistics.median(r["p99_us"] for r in rows), 1),
                # Each round's GB/s over the first binary's in the same round, then the median.
                "median_ratio_to_first": round(statistics.median(
                    r["gbps"] / f["gbps"] for r, f in zip(rows, first, strict=True)), 3),
            }
            fio = [r["fio_gbps"] for r in rows if r["fio_gbps"] is not None]
            if fio:
                summary["median_fio_gbps"] = round(statistics.median(fio), 4)
                summary["median_ratio"] = round(statistics.median(
                    r["ratio"] for r in rows if r["ratio"] is not None), 3)
            print(json.dumps({"summary": summary}), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
