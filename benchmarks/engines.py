"""Storage engine benchmark: pocketflow's DRAM and NVMe engines side by side with fio.

Builds and runs the Rust program ``servers/crates/store/examples/engine_bench.rs`` and, on the
same file, ``fio --direct=1 --ioengine=io_uring`` with the same patterns:

============  =====  ===========  =====================================
pattern       block  queue depth  what
============  =====  ===========  =====================================
seqwrite      1 MiB  8            sequential write of the whole file
seqread       1 MiB  8            sequential read of the whole file
randread      64 KiB 32           random aligned reads over the file
seqwrite-qd1  1 MiB  1            one write at a time (a single client's put)
seqread-qd1   1 MiB  1            one read at a time (a single client's get)
randread-qd1  64 KiB 1            one random read at a time (per-I/O overhead shows most)
============  =====  ===========  =====================================

The disk of a virtual machine is noisy from one second to the next, so fio and the engine
alternate, pattern by pattern, for ``--reps`` rounds (the order flips each round) and the table
compares the best run of each. Prints the table and writes JSON (with commit and machine) and,
if matplotlib is installed, a PNG plot to ``benchmarks/results/engines-<date>.{json,png}``.

Usage: ``python benchmarks/engines.py [--dir /tmp/pocketflow-bench] [--file-mib 1024]
[--seconds 2] [--reps 3] [--keep-file] [--patterns dram,seqread-qd1,...]
[--bench-binary PATH]``. ``--bench-binary`` runs an engine bench built elsewhere (e.g. from
another commit, to compare two versions of the engine against the same fio) instead of building
this checkout's. The directory must be on a file system that supports
O_DIRECT (ext4, xfs; tmpfs only on kernels >= 6.6). Pointing ``--dir`` at tmpfs (/dev/shm) takes
the disk out of the comparison and measures the software overhead of each side alone. Takes
about a minute once the bench is built.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVERS_DIR = REPO_ROOT / "servers"
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
BENCH_BINARY = SERVERS_DIR / "target" / "release" / "examples" / "engine_bench"

# pattern -> (fio --rw, block size, queue depth); the engine bench uses the same values.
NVME_PATTERNS = {
    "seqwrite": ("write", "1m", 8),
    "seqread": ("read", "1m", 8),
    "randread": ("randread", "64k", 32),
    "seqwrite-qd1": ("write", "1m", 1),
    "seqread-qd1": ("read", "1m", 1),
    "randread-qd1": ("randread", "64k", 1),
}
RATIO_TARGET = 0.8
DRAM_TARGET_GBPS = 5.0
FIO_TIMEOUT_S = 120
BENCH_TIMEOUT_S = 300


def build_bench() -> None:
    """Build the engine bench in release mode (a no-op when it is up to date)."""
    subprocess.run(
        [
            "cargo",
            "build",
            "--release",
            "-q",
            "-p",
            "pocketflow-store",
            "--example",
            "engine_bench",
        ],
        cwd=SERVERS_DIR,
        check=True,
    )


def run_dram(bench_binary: Path, seconds: float) -> list[dict]:
    """Run the DRAM part of the engine bench and return its rows."""
    command = [str(bench_binary), "--patterns", "dram", "--seconds", str(seconds)]
    done = subprocess.run(
        command, capture_output=True, text=True, check=True, timeout=BENCH_TIMEOUT_S
    )
    return json.loads(done.stdout)["dram"]


class EngineServer:
    """The engine bench in `--serve` mode: one NVMe engine on the file, one pattern per request.

    Keeping the engine open lets the read patterns reuse the blocks of the last write pass, so
    no untimed refill runs between fio and the engine.
    """

    def __init__(
        self, bench_binary: Path, data_file: Path, file_bytes: int, seconds: float
    ) -> None:
        command = [
            str(bench_binary),
            "--serve",
            "--nvme-file",
            str(data_file),
            "--nvme-bytes",
            str(file_bytes),
            "--seconds",
            str(seconds),
        ]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def run(self, pattern: str) -> dict:
        """Run one pattern and return its measurement (within :data:`BENCH_TIMEOUT_S`)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(pattern + "\n")
        self.process.stdin.flush()
        # The bench answers with one line per pattern; a hung bench must not hang the run.
        ready, _, _ = select.select([self.process.stdout], [], [], BENCH_TIMEOUT_S)
        if not ready:
            raise RuntimeError(f"engine bench gave no answer for {pattern} in {BENCH_TIMEOUT_S} s")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"engine bench exited with {self.process.wait()}")
        return json.loads(line)[pattern]

    def close(self) -> None:
        """Close stdin, which ends the bench, and wait for it; kill it (by pid) if it hangs."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=BENCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=BENCH_TIMEOUT_S)


def run_fio(pattern: str, data_file: Path, file_bytes: int, seconds: float) -> dict:
    """Run fio for one pattern on `data_file`; returns GB/s, IOPS and mean completion latency."""
    rw, block, depth = NVME_PATTERNS[pattern]
    command = [
        "fio",
        f"--name={pattern}",
        f"--filename={data_file}",
        "--direct=1",
        "--ioengine=io_uring",
        f"--rw={rw}",
        f"--bs={block}",
        f"--iodepth={depth}",
        f"--size={file_bytes}",
        f"--runtime={seconds}",
        "--time_based",
        "--output-format=json",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, check=True, timeout=FIO_TIMEOUT_S
    )
    job = json.loads(done.stdout)["jobs"][0]
    side = job["write"] if rw == "write" else job["read"]
    return {
        "gbps": side["bw_bytes"] / 1e9,
        "iops": side["iops"],
        "clat_mean_us": side["clat_ns"]["mean"] / 1e3,
    }


def git_commit() -> str:
    """The checked-out commit, or "uncommitted" when there is none."""
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    return done.stdout.strip() if done.returncode == 0 else "uncommitted"


def machine(data_dir: Path) -> dict:
    """What the numbers were measured on."""
    file_system = subprocess.run(
        ["stat", "-f", "-c", "%T", str(data_dir)], capture_output=True, text=True
    ).stdout.strip()
    return {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "data_dir": str(data_dir),
        "file_system": file_system,
        "fio": subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip(),
    }


def plot(report: dict, path: Path) -> bool:
    """Bar chart of fio vs engine per NVMe pattern, plus DRAM; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    patterns = list(report["nvme"])
    if not patterns or not report["dram"]:
        return False
    fio = [report["nvme"][p]["fio_best_gbps"] for p in patterns]
    engine = [report["nvme"][p]["engine_best_gbps"] for p in patterns]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    positions = range(len(patterns))
    left.bar([x - 0.2 for x in positions], fio, width=0.4, label="fio io_uring")
    left.bar([x + 0.2 for x in positions], engine, width=0.4, label="pocketflow nvme engine")
    left.set_xticks(list(positions), patterns)
    left.set_ylabel("GB/s (best run)")
    left.set_title("NVMe engine vs fio, same file")
    left.legend(loc="lower center")
    dram = report["dram"]
    labels = [f"{d['block_bytes'] // 1024} KiB" for d in dram]
    dram_positions = range(len(dram))
    right.bar(
        [x - 0.2 for x in dram_positions], [d["write_gbps"] for d in dram], width=0.4, label="write"
    )
    right.bar(
        [x + 0.2 for x in dram_positions],
        [d["read_gbps"] for d in dram],
        width=0.4,
        label="read + consume",
    )
    right.set_xticks(list(dram_positions), labels)
    right.set_title(f"DRAM engine, {dram[0]['threads']} threads")
    right.set_ylabel("GB/s")
    right.legend(loc="lower center")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pocketflow-bench"))
    parser.add_argument("--file-mib", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--keep-file", action="store_true")
    parser.add_argument(
        "--patterns",
        default=",".join(["dram", *NVME_PATTERNS]),
        help="comma-separated: dram and any of " + ", ".join(NVME_PATTERNS),
    )
    parser.add_argument("--bench-binary", type=Path, help="run this engine bench, build none")
    args = parser.parse_args()
    if shutil.which("fio") is None:
        print("fio is not installed", file=sys.stderr)
        return 2
    chosen = args.patterns.split(",")
    unknown = [p for p in chosen if p != "dram" and p not in NVME_PATTERNS]
    if unknown:
        print(f"unknown patterns {unknown}", file=sys.stderr)
        return 2
    # Writes go first: until a write pass, the file's extents are unwritten and fio reads them
    # as zeroes without touching the disk.
    patterns = sorted(
        (p for p in NVME_PATTERNS if p in chosen), key=lambda p: NVME_PATTERNS[p][0] != "write"
    )

    bench_binary = args.bench_binary
    if bench_binary is None:
        build_bench()
        bench_binary = BENCH_BINARY
    args.dir.mkdir(parents=True, exist_ok=True)
    data_file = args.dir / "engines.dat"
    file_bytes = args.file_mib * 1024 * 1024
    started = datetime.datetime.now(datetime.UTC)

    dram = run_dram(bench_binary, args.seconds) if "dram" in chosen else []
    samples: dict[str, dict[str, list[dict]]] = {p: {"fio": [], "engine": []} for p in patterns}
    engine = EngineServer(bench_binary, data_file, file_bytes, args.seconds)
    try:
        for rep in range(args.reps):
            for pattern in patterns:
                order = ["fio", "engine"] if rep % 2 == 0 else ["engine", "fio"]
                for tool in order:
                    if tool == "fio":
                        samples[pattern]["fio"].append(
                            run_fio(pattern, data_file, file_bytes, args.seconds)
                        )
                    else:
                        samples[pattern]["engine"].append(engine.run(pattern))
    finally:
        engine.close()
    if not args.keep_file:
        data_file.unlink(missing_ok=True)

    nvme = {}
    for pattern, runs in samples.items():
        fio_gbps = [r["gbps"] for r in runs["fio"]]
        engine_gbps = [r["gbps"] for r in runs["engine"]]
        nvme[pattern] = {
            "block": NVME_PATTERNS[pattern][1],
            "queue_depth": NVME_PATTERNS[pattern][2],
            "fio_best_gbps": max(fio_gbps),
            "engine_best_gbps": max(engine_gbps),
            "fio_median_gbps": statistics.median(fio_gbps),
            "engine_median_gbps": statistics.median(engine_gbps),
            "ratio_best": max(engine_gbps) / max(fio_gbps),
            "ratio_median": statistics.median(engine_gbps) / statistics.median(fio_gbps),
            # Each engine run against the fio run next to it in time.
            "ratio_paired": [e / f for e, f in zip(engine_gbps, fio_gbps, strict=True)],
            "fio_runs": runs["fio"],
            "engine_runs": runs["engine"],
        }

    print(
        f"{'pattern':<10} {'block':>6} {'qd':>3} {'fio GB/s':>9} {'engine GB/s':>12} "
        f"{'ratio':>6} {'median ratio':>13}  target >= {RATIO_TARGET}x"
    )
    for pattern, row in nvme.items():
        verdict = "ok" if row["ratio_best"] >= RATIO_TARGET else "BELOW"
        cells = [
            f"{pattern:<10}",
            f"{row['block']:>6}",
            f"{row['queue_depth']:>3}",
            f"{row['fio_best_gbps']:>9.2f}",
            f"{row['engine_best_gbps']:>12.2f}",
            f"{row['ratio_best']:>6.2f}",
            f"{row['ratio_median']:>13.2f}",
        ]
        print(" ".join(cells) + f"  {verdict}")
    for row in dram:
        verdict = "ok" if row["write_read_gbps"] >= DRAM_TARGET_GBPS else "BELOW"
        print(
            f"dram {row['block_bytes'] // 1024:>5} KiB, {row['threads']} threads: "
            f"write {row['write_gbps']:.2f} GB/s, read+consume {row['read_gbps']:.2f} GB/s, "
            f"write+read {row['write_read_gbps']:.2f} GB/s "
            f"(target >= {DRAM_TARGET_GBPS}) {verdict}"
        )

    report = {
        "benchmark": "engines",
        "started_utc": started.isoformat(),
        "commit": git_commit(),
        "machine": machine(args.dir),
        "settings": {
            "file_bytes": file_bytes,
            "seconds": args.seconds,
            "reps": args.reps,
            "bench_binary": str(bench_binary),
        },
        "dram": dram,
        "nvme": nvme,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = RESULTS_DIR / f"engines-{started.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plotted = plot(report, stem.with_suffix(".png"))
    print(
        f"wrote {stem.with_suffix('.json')}"
        + (f" and {stem.with_suffix('.png')}" if plotted else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
