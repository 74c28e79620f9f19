"""THIS (decode H.264, detect faces) with its frames exchanged through pocketflow's DRAM tier,
its NVMe tier, a redis-server and the SeaweedFS S3 server, side by side in one run.

Run from the repository root::

    python3 -m benchmarks.this_pipeline [--quick] [--seconds N] [--out DIR]

Every variant runs the same decorated pipeline (``pocketflow_this_examples.this``) over the
same H.264 segments (made once, 640x360, 25 frames a segment) on Ray tasks of an embedded local
cluster (2 CPUs), one variant after the other, after an unmeasured warm-up run:

- ``pocketflow-dram``: a latency-sensitive job (hints derived from the stages), frames read
  with DELETE, results written with PERSIST.
- ``pocketflow-dram-no-delete``: the same, frames read without DELETE (they stay until the job
  is deregistered): what DELETE saves in capacity.
- ``pocketflow-nvme``: a latency-insensitive job (no DRAM: the NVMe server's file engine).
- ``redis``: a redis-server on 127.0.0.1 (``benchmarks.peers.RedisPeer``): SET NX to write,
  GETDEL to read once, a task waits for its input with BLPOP on a per-key list the writer
  pushes to (no polling).
- ``s3``: SeaweedFS's S3 gateway (``benchmarks.peers.S3Peer``), boto3 unsigned without
  checksums: PutObject, GetObject then DeleteObject; a task waits for its input by polling
  HeadObject (S3 has no notification a task can block on).

Reported per variant: job time (the driver's run, registration to deregistration for
pocketflow), storage I/O time per task for each stage (a decode task's write of its frames; a
detect task's read of them and write of its result; waiting for the input to exist is not
I/O and is reported apart, in all and from the moment the input was written, which is the
store's part of it), mean, median and p95; the peak of intermediate bytes held, from the tasks'
own timestamps (+frames when written, -frames when read with DELETE) for every store, and for
pocketflow also the servers' used bytes sampled every ``SAMPLE_INTERVAL_S`` (their statistics
refresh every second). ``this-pipeline-<date>.png`` plots capacity over time with and without
DELETE (the Pocket paper's Figure 9). Every run's detections are checked against the first
variant's (same boxes for every frame).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
from pocketflow_this.errors import InputLost
from pocketflow_this.exchange import Exchange, ExchangeClient

from benchmarks.machine import machine, now_iso, package_versions, today
from benchmarks.peers import RedisPeer, S3Peer, _boto3_client

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SAMPLE_INTERVAL_S = 0.25
SAMPLES_MAX = 20_000
S3_POLL_S = (0.005, 0.1)
"""First and largest pause between HeadObject polls of a task waiting for its input."""
RUN_TIMEOUT_S = 900.0
VARIANTS = ("pocketflow-dram", "pocketflow-dram-no-delete", "pocketflow-nvme", "redis", "s3")


# -- the peers as exchanges ---------------------------------------------------------------------


class RedisExchange(Exchange):
    """Values in a redis-server; ``ready:<key>`` lists wake waiting readers."""

    name = "redis"

    def __init__(self, port: int, prefix: str) -> None:
        self.port = port
        self.prefix = prefix

    def cache_key(self) -> Any:
        return ("redis", self.port, self.prefix)

    def connect(self) -> RedisExchangeClient:
        return RedisExchangeClient(self)


class RedisExchangeClient(ExchangeClient):
    def __init__(self, exchange: RedisExchange) -> None:
        import redis

        self._r = redis.Redis(host="127.0.0.1", port=exchange.port, socket_timeout=120)
        self._p = exchange.prefix

    def put(self, key: str, data: bytes, *, persist: bool, overwrite: bool = False) -> bool:
        k = self._p + key
        pipe = self._r.pipeline(transaction=False)
        pipe.set(k, data, nx=not overwrite)
        pipe.rpush("ready:" + k, b"1")
        written, _ = pipe.execute()
        return bool(written)

    def get(self, key: str, *, delete: bool) -> bytes:
        k = self._p + key
        value = self._r.getdel(k) if delete else self._r.get(k)
        if value is None:
            raise InputLost(f"{key} is gone")
        return value

    def wait(self, key: str, timeout_s: float) -> bool:
        k = self._p + key
        if self._r.exists(k):
            return True
        if timeout_s <= 0:
            return False
        self._r.blpop(["ready:" + k], timeout=max(0.01, timeout_s))
        return bool(self._r.exists(k))

    def delete(self, key: str) -> None:
        self._r.delete(self._p + key, "ready:" + self._p + key)

    def close(self) -> None:
        self._r.close()


class S3Exchange(Exchange):
    """Values as S3 objects under a prefix of one bucket."""

    name = "s3"

    def __init__(self, endpoint_url: str, bucket: str, prefix: str) -> None:
        self.endpoint_url = endpoint_url
        self.bucket = bucket
        self.prefix = prefix

    def cache_key(self) -> Any:
        return ("s3", self.endpoint_url, self.bucket, self.prefix)

    def connect(self) -> S3ExchangeClient:
        return S3ExchangeClient(self)


class S3ExchangeClient(ExchangeClient):
    def __init__(self, exchange: S3Exchange) -> None:
        self._s3 = _boto3_client(exchange.endpoint_url)
        self._bucket = exchange.bucket
        self._p = exchange.prefix

    def put(self, key: str, data: bytes, *, persist: bool, overwrite: bool = False) -> bool:
        self._s3.put_object(Bucket=self._bucket, Key=self._p + key, Body=data)
        return True

    def get(self, key: str, *, delete: bool) -> bytes:
        from botocore.exceptions import ClientError

        try:
            body = self._s3.get_object(Bucket=self._bucket, Key=self._p + key)["Body"].read()
        except ClientError as exc:
            raise InputLost(f"{key} is gone: {exc}") from exc
        if delete:
            self._s3.delete_object(Bucket=self._bucket, Key=self._p + key)
        return body

    def _exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._s3.head_object(Bucket=self._bucket, Key=self._p + key)
        except ClientError:
            return False
        return True

    def wait(self, key: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        pause, pause_max = S3_POLL_S
        while not self._exists(key):
            if time.monotonic() + pause > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, pause_max)
        return True

    def delete(self, key: str) -> None:
        self._s3.delete_object(Bucket=self._bucket, Key=self._p + key)

    def close(self) -> None:
        self._s3.close()


# -- measuring ----------------------------------------------------------------------------------


class CapacitySampler:
    """Samples the pocketflow servers' used bytes (above the level at start) on a thread."""

    def __init__(self, cluster: Any) -> None:
        self._cluster = cluster
        self._stop = threading.Event()
        self.samples: list[tuple[float, int]] = []
        self._base = self._used()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _used(self) -> int:
        return sum(int(s["used_bytes"]) for s in self._cluster.status()["servers"])

    def _loop(self) -> None:
        while not self._stop.is_set() and len(self.samples) < SAMPLES_MAX:
            self.samples.append((time.time(), self._used() - self._base))
            self._stop.wait(SAMPLE_INTERVAL_S)

    def __enter__(self) -> CapacitySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def held_timeline(result: Any) -> list[tuple[float, int]]:
    """Intermediate bytes held over time, from the tasks' timestamps."""
    events = []
    for o in result.outcomes:
        if o.stage == 0:
            events.append((o.finished_unix_s, o.bytes_written))
        elif result.delete_intermediates:
            events.append((o.read_done_unix_s, -o.bytes_read))
    held, line = 0, [(result.started_unix_s, 0)]
    for t, delta in sorted(events):
        held += delta
        line.append((t, held))
    return line


def waits_after_written(result: Any, stage: int) -> list[float]:
    """For each task of ``stage`` (> 0): how long after its input was written (the upstream
    task's write returned) the task saw it exist, 0 when it started waiting later. The rest of
    a task's wait is the upstream task still running, which no store can shorten."""
    upstream = {o.item: o for o in result.outcomes if o.stage == stage - 1}
    late = []
    for o in result.outcomes:
        if o.stage != stage or o.item not in upstream:
            continue
        wait_start = o.input_ready_unix_s - o.wait_s
        late.append(max(0.0, o.input_ready_unix_s
                        - max(upstream[o.item].finished_unix_s, wait_start)))
    return late


def stage_io(result: Any, stages: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for k, name in enumerate(stages):
        rows = [o for o in result.outcomes if o.stage == k]
        io = np.array([o.io_s for o in rows])
        late = waits_after_written(result, k) if k else [0.0]
        out[name] = {
            "tasks": len(rows),
            "io_s_mean": float(io.mean()),
            "io_s_p50": float(np.percentile(io, 50)),
            "io_s_p95": float(np.percentile(io, 95)),
            "read_s_mean": float(np.mean([o.read_s for o in rows])),
            "write_s_mean": float(np.mean([o.write_s for o in rows])),
            "wait_s_mean": float(np.mean([o.wait_s for o in rows])),
            "wait_after_written_s_mean": float(np.mean(late)),
            "wait_after_written_s_p95": float(np.percentile(late, 95)),
            "compute_s_mean": float(np.mean([o.compute_s for o in rows])),
            "bytes_read_per_task": float(np.mean([o.bytes_read for o in rows])),
            "bytes_written_per_task": float(np.mean([o.bytes_written for o in rows])),
        }
    return out


# -- the run ------------------------------------------------------------------------------------


def run(seconds: int, out_dir: Path, *, quick: bool, repo: Path, note: str) -> dict[str, Any]:
    import ray.cloudpickle as ray_cloudpickle
    from pocketflow_this_examples.this import this
    from pocketflow_this_examples.video import VideoSpec, write_segments

    import pocketflow
    from pocketflow.handle import JobHandle

    # Ray pickles the exchanges defined here by value (workers need not import benchmarks/).
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spec = VideoSpec(seconds=seconds)
    work = out_dir / "this-video"
    segments = write_segments(spec, work)
    stages = tuple(s.name for s in this.stages)
    runs: dict[str, Any] = {}
    timelines: dict[str, Any] = {}
    reference = None
    with pocketflow.LocalCluster(dram_capacity="768MiB", nvme_capacity="1GiB") as cluster:
        redis_peer, s3_peer = RedisPeer(), S3Peer()
        redis_peer.start()
        s3_peer.start()
        try:
            # Warm-up: Ray starts its worker processes and they import PyAV and OpenCV once,
            # outside of every measured run.
            this.run(segments[:4], executor="ray", cluster=cluster, keep_outputs=False,
                     timeout_s=RUN_TIMEOUT_S)
            for variant in VARIANTS:
                options: dict[str, Any] = {"cluster": cluster, "timeout_s": RUN_TIMEOUT_S,
                                           "keep_outputs": False}
                if variant == "pocketflow-dram-no-delete":
                    options["delete_intermediates"] = False
                if variant == "pocketflow-nvme":
                    hints = this.hints(segments)
                    hints["latency_sensitive"] = False
                    options["hints"] = hints
                if variant == "redis":
                    options["exchange"] = RedisExchange(redis_peer.spec().port, "this/")
                if variant == "s3":
                    s3 = s3_peer.spec()
                    options["exchange"] = S3Exchange(s3.endpoint_url, s3.bucket, "this/")
                print(f"{variant} ...", flush=True)
                sampler = CapacitySampler(cluster)
                with sampler:
                    result = this.run(segments, executor="ray", **options)
                boxes = [out["boxes"] for out in result.outputs]
                if reference is None:
                    reference = boxes
                tiers = None
                if result.handle_json is not None:
                    handle = JobHandle.from_json(result.handle_json)
                    tiers = sorted({s.tier for s in handle.servers if s.weight > 0})
                held = held_timeline(result)
                runs[variant] = {
                    "job_s": result.elapsed_s,
                    "stages": stage_io(result, stages),
                    "peak_held_bytes": max(b for _, b in held),
                    "peak_server_used_bytes": (max((b for _, b in sampler.samples), default=0)
                                               if result.exchange == "pocketflow" else None),
                    "tiers": tiers,
                    "hints": result.hints,
                    "outputs_match_first_variant": boxes == reference,
                    "frames": sum(len(b) for b in boxes),
                    "retried": result.retried,
                    "regenerated": result.regenerated,
                }
                t0 = result.started_unix_s
                timelines[variant] = {
                    "held": [(t - t0, b) for t, b in held],
                    "server_used": [(t - t0, b) for t, b in sampler.samples],
                }
                print(f"  {variant}: {result.elapsed_s:.1f} s, detect I/O "
                      f"{runs[variant]['stages']['detect']['io_s_mean'] * 1000:.1f} ms", flush=True)
        finally:
            redis_peer.stop()
            s3_peer.stop()
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {
        "benchmark": "this_pipeline",
        "when": now_iso(),
        "commit": commit,
        "machine": machine(),
        "packages": package_versions(("ray", "lithops", "av", "opencv-python-headless",
                                      "redis", "boto3")),
        "quick": quick,
        "note": note,
        "video": {"seconds": seconds, "width": spec.width, "height": spec.height,
                  "fps": spec.fps, "frames": spec.frames, "segments": len(segments),
                  "decoded_bytes": sum(s.decoded_bytes for s in segments)},
        "executor": "ray (embedded local cluster, 2 CPUs)",
        "variants": runs,
        "ratios": ratios(runs),
        "timelines": timelines,
    }


def ratios(runs: dict[str, Any]) -> dict[str, Any]:
    """pocketflow DRAM's per-task I/O over Redis's and S3's, and DELETE's peak over no DELETE."""
    out: dict[str, Any] = {}
    pf = runs["pocketflow-dram"]["stages"]
    for peer in ("redis", "s3"):
        for stage_name, row in pf.items():
            other = runs[peer]["stages"][stage_name]
            out[f"{stage_name}_io_mean_vs_{peer}"] = row["io_s_mean"] / other["io_s_mean"]
    with_delete = runs["pocketflow-dram"]["peak_server_used_bytes"]
    without = runs["pocketflow-dram-no-delete"]["peak_server_used_bytes"]
    out["peak_server_used_delete_vs_no_delete"] = with_delete / without if without else None
    out["peak_held_delete_vs_no_delete"] = (runs["pocketflow-dram"]["peak_held_bytes"]
                                            / runs["pocketflow-dram-no-delete"]["peak_held_bytes"])
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for variant, color in (("pocketflow-dram", "tab:blue"),
                           ("pocketflow-dram-no-delete", "tab:red")):
        line = results["timelines"][variant]
        xs, ys = zip(*line["server_used"], strict=True) if line["server_used"] else ((), ())
        ax.plot(xs, [y / 2**20 for y in ys], color=color, lw=2,
                label=f"{variant}: servers' used bytes (sampled)")
        hx, hy = zip(*line["held"], strict=True)
        ax.step(hx, [y / 2**20 for y in hy], where="post", color=color, lw=1, ls="--",
                label=f"{variant}: frames held (task timestamps)")
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("MiB")
    ax.set_title(f"THIS, {results['video']['decoded_bytes'] / 1e6:.0f} MB of decoded frames: "
                 "capacity with and without DELETE")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(results: dict[str, Any]) -> str:
    v = results["video"]
    lines = [
        f"# THIS pipeline: frames through pocketflow, Redis and S3 ({results['when']})",
        "",
        f"Commit `{results['commit']}`; {results['machine'].get('cpu_model')}, "
        f"{results['machine'].get('cores_usable')} usable cores, load "
        f"{results['machine'].get('load_avg_1m_at_start', 0):.1f} at start; {results['executor']}. "
        f"Video {v['width']}x{v['height']}, {v['frames']} frames in {v['segments']} segments, "
        f"{v['decoded_bytes'] / 1e6:.0f} MB decoded. Command: `python3 -m "
        f"benchmarks.this_pipeline{' --quick' if results['quick'] else ''}`. "
        f"{results['note']}",
        "",
        "| variant | job s | decode I/O ms mean / p50 / p95 | detect I/O ms mean / p50 / p95 | "
        "detect wait ms mean | detect wait after input written ms mean / p95 | "
        "peak held MB | peak server used MB | same detections |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def io(stage: dict[str, Any]) -> str:
        return " / ".join(f"{stage[k] * 1e3:.1f}" for k in ("io_s_mean", "io_s_p50", "io_s_p95"))

    for name, r in results["variants"].items():
        d, t = r["stages"]["decode"], r["stages"]["detect"]
        used = r["peak_server_used_bytes"]
        lines.append(
            f"| {name} | {r['job_s']:.1f} | {io(d)} | {io(t)} | "
            f"{t['wait_s_mean'] * 1e3:.0f} | {t['wait_after_written_s_mean'] * 1e3:.1f} / "
            f"{t['wait_after_written_s_p95'] * 1e3:.1f} | {r['peak_held_bytes'] / 1e6:.0f} | "
            f"{'-' if used is None else f'{used / 1e6:.0f}'} | "
            f"{r['outputs_match_first_variant']} |")
    lines += ["", "Ratios (goal: I/O <= 0.7x Redis and <= 0.2x S3 in both stages; peak with "
              "DELETE <= 0.5x without):", ""]
    for key, value in results["ratios"].items():
        lines.append(f"- {key}: {'-' if value is None else f'{value:.2f}'}")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 s of video (a smoke run)")
    parser.add_argument("--seconds", type=int, default=None,
                        help="seconds of video (default 18: 311 MB of frames)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="git checkout whose commit the results name")
    parser.add_argument("--note", default="", help="a sentence added to the report")
    args = parser.parse_args(argv)
    seconds = args.seconds or (4 if args.quick else 18)
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(seconds, args.out, quick=args.quick, repo=args.repo, note=args.note)
    stem = f"this-pipeline-{today()}{'-quick' if args.quick else ''}"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(results))
    plot(results, args.out / f"{stem}.png")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
