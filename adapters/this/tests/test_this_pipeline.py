"""Tests of the adapter: declarations without a cluster, then THIS on the session cluster's real
storage servers, on Ray tasks and on Lithops' localhost functions, with a task that dies and a
storage server killed mid-pipeline."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
import ray.cloudpickle as ray_cloudpickle
from fixtures_cluster import extra_server, used_bytes, wait_for
from pocketflow_this import (
    Pipeline,
    PipelineDefinitionError,
    StageFailed,
    codec,
    pipeline,
    stage,
)
from pocketflow_this.task import value_key
from pocketflow_this_examples.this import (
    decode_segment,
    detect_faces,
    make_pipeline,
    run_this,
)
from pocketflow_this_examples.video import Segment, VideoSpec, write_segments

import pocketflow
from pocketflow.cluster import LocalCluster
from pocketflow.handle import JobHandle

# Ray and Lithops pickle the stage functions; the wrappers defined here travel by value (Ray
# has its own copy of cloudpickle).
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])

SPEC = VideoSpec(width=320, height=180, fps=10, seconds=6, segment_frames=5,
                 scale_min=0.3, scale_max=0.35)
"""60 frames in 12 segments of 864 KB decoded each: short, and still more items than fit in
the pipeline's window at once."""
RUN_TIMEOUT_S = 90.0
GATE_TIMEOUT_S = 60.0
DOOMED_CAPACITY_BYTES = 512 * 1024 * 1024
CLI_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def segments(tmp_path_factory: pytest.TempPathFactory) -> list[Segment]:
    return write_segments(SPEC, tmp_path_factory.mktemp("video"))


@pytest.fixture(scope="module")
def expected(segments: list[Segment]) -> list[list[list[tuple[int, ...]]]]:
    """Every segment's boxes, computed here in one process: what any run must produce."""
    return [detect_faces(decode_segment(s))["boxes"] for s in segments]


def _boxes(outputs: list[dict[str, Any]]) -> list[list[list[tuple[int, ...]]]]:
    return [[[tuple(b) for b in frame] for frame in out["boxes"]] for out in outputs]


# -- declarations (no cluster) -----------------------------------------------------------------


def test_decorators_validate_and_derive_hints() -> None:
    @stage(concurrency=3, output_bytes=lambda n: n * 100)
    def make(n: int) -> bytes:
        return b"x" * n

    @stage(concurrency=2, latency_sensitive=False, output_bytes=10)
    def size(data: bytes) -> int:
        return len(data)

    @pipeline(name="p", items_in_flight_max=2)
    def p(item: int) -> Any:
        return size(make(item))

    assert isinstance(p, Pipeline) and [s.name for s in p.stages] == ["make", "size"]
    assert size(make(4)) == 4  # on real values a stage is the plain function
    hints = p.hints([1, 2, 3, 4])
    # Two items in flight at most: the two largest intermediates, plus every final value.
    assert hints == {"latency_sensitive": True, "max_concurrent_tasks": 5,
                     "data_size_bytes": 400 + 300 + 4 * 10}
    assert p.hints([1, 2, 3, 4], delete_intermediates=False)["data_size_bytes"] == 1040
    assert Pipeline([size]).hints([1])["latency_sensitive"] is False
    assert Pipeline([stage(len)]).hints([1])["data_size_bytes"] is None

    with pytest.raises(PipelineDefinitionError, match="concurrency"):
        stage(len, concurrency=0)
    with pytest.raises(PipelineDefinitionError, match="callable"):
        stage(42)
    with pytest.raises(PipelineDefinitionError, match="output_bytes"):
        stage(len, output_bytes=-1)
    with pytest.raises(PipelineDefinitionError, match="not a stage"):
        Pipeline([len])
    with pytest.raises(PipelineDefinitionError, match="at least one"):
        Pipeline([])
    with pytest.raises(PipelineDefinitionError, match="consumed by both"):
        @pipeline
        def fan_out(item: int) -> Any:
            data = make(item)
            size(data)
            return size(data)
    with pytest.raises(PipelineDefinitionError, match="exactly one argument"):
        @pipeline
        def two(a: int, b: int) -> Any:
            return size(make(a))
    with pytest.raises(ValueError, match="unknown executor"):
        p.run([1], executor="spark", exchange=object())


def test_codec_round_trips_frames_without_copying() -> None:
    frames = np.arange(2 * 4 * 6 * 3, dtype=np.uint8).reshape(2, 4, 6, 3)
    data = codec.encode({"frames": frames, "segment": 7})
    back = codec.decode(data)
    assert back["segment"] == 7 and np.array_equal(back["frames"], frames)
    assert not back["frames"].flags.owndata  # a view of the received bytes
    with pytest.raises(codec.CodecError):
        codec.decode(b"PFT0" + data[4:])
    with pytest.raises(codec.CodecError):
        codec.decode(data[:-1])


# -- on the session cluster --------------------------------------------------------------------


def _peak_sampler(cluster: LocalCluster, stop: threading.Event, peaks: list[int]) -> None:
    base = sum(used_bytes(cluster).values())
    peak = 0
    while not stop.is_set():
        peak = max(peak, sum(used_bytes(cluster).values()) - base)
        time.sleep(0.1)
    peaks.append(peak)


def _run_sampled(cluster: LocalCluster, tmp_path: Path, **options: Any) -> tuple[Any, Any, int]:
    """THIS on Ray with at most 3 items in flight: its summary, its result, and the most bytes
    the servers held at once above what they held before."""
    stop = threading.Event()
    peaks: list[int] = []
    sampler = threading.Thread(target=_peak_sampler, args=(cluster, stop, peaks))
    sampler.start()
    try:
        summary, result = run_this(tmp_path, executor="ray", spec=SPEC, cluster=cluster,
                                   pipe=make_pipeline(items_in_flight_max=3),
                                   timeout_s=RUN_TIMEOUT_S, **options)
    finally:
        stop.set()
        sampler.join()
    return summary, result, peaks[0]


def test_this_on_ray_streams_deletes_and_persists(
    local_cluster: LocalCluster, segments: list[Segment], expected: Any, tmp_path: Path
) -> None:
    summary, result, peak = _run_sampled(local_cluster, tmp_path)

    assert _boxes(result.outputs) == expected
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["frames"] == SPEC.frames and written["frames_complete"]
    assert written["seconds_of_video"] == SPEC.seconds
    assert written["detections"] == sum(len(f) for seg in expected for f in seg)
    assert written["score"]["recall"] >= 0.7 and written["score"]["precision"] >= 0.7
    for png in ("detections.png", "contact_sheet.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Hints from the decorators and the input: 4 tasks, 3 items' frames plus the results.
    assert result.hints["max_concurrent_tasks"] == 4
    assert result.hints["data_size_bytes"] < sum(s.decoded_bytes for s in segments) / 2
    decodes = [o for o in result.outcomes if o.stage == 0]
    detects = [o for o in result.outcomes if o.stage == 1]
    assert len(decodes) == len(detects) == len(segments)
    # Streaming: detection started reading frames long before the last decode finished.
    assert min(o.input_ready_unix_s for o in detects) < max(o.finished_unix_s for o in decodes)
    # DELETE: with at most 3 items in flight, the frames held at once stay well under the total.
    frame_bytes = sum(o.bytes_written for o in decodes)
    assert peak < frame_bytes / 2, (peak, frame_bytes)

    # The job is gone; the results were written with PERSIST and outlive it.
    assert result.job_id not in {j["job_id"] for j in local_cluster.status()["jobs"]}
    with pocketflow.connect(result.handle_json) as pf:
        for i in range(len(segments)):
            out = codec.decode(pf.get("this", value_key(stage=1, item=i), delete=True))
            assert out["segment"] == i


def test_this_reads_its_video_through_the_cache(
    local_cluster: LocalCluster, s3_server: Any, segments: list[Segment], expected: Any,
    tmp_path: Path,
) -> None:
    """The video in S3: decode tasks read it through a pocketflow cache, the run's working set
    is recorded, and the next run prewarms from it."""
    for run in ("first", "second"):
        summary, result = run_this(tmp_path / run, executor="ray", spec=SPEC,
                                   cluster=local_cluster, s3=s3_server, timeout_s=RUN_TIMEOUT_S)
        assert _boxes(result.outputs) == expected
        cache = summary["input_cache"]
        assert cache["working_set_keys"] == len(segments), "every segment read through it"
        # Each run encodes and uploads its own copy of the video, and x264's output differs by
        # up to a few hundred bytes from one process to the next (the frames are the same), so
        # what the cache must hold is that run's video, not this module's copy.
        assert cache["held_bytes"] >= summary["video"]["h264_bytes"]
    assert cache["prewarm_from"] == "cache"
    assert cache["prewarm_planned"] == cache["prewarm_fetched"] == len(segments)


def test_scoped_values_are_freed_as_their_consumers_finish(
    local_cluster: LocalCluster, segments: list[Segment], expected: Any, tmp_path: Path
) -> None:
    """Without DELETE-on-read, prefix leases alone free each item's frames once its detection
    is done, so what the run holds at once stays a few items' worth, not the whole video."""
    _, result, peak = _run_sampled(local_cluster, tmp_path, delete_intermediates=False,
                                   prefix_lease_ms=1000)
    assert _boxes(result.outputs) == expected
    frame_bytes = sum(o.bytes_written for o in result.outcomes if o.stage == 0)
    assert peak < frame_bytes / 2, (peak, frame_bytes)
    with pytest.raises(ValueError):
        make_pipeline().run(segments, exchange=object(), prefix_lease_ms=1000)


def _gated_detect(gate: str, chunk: dict[str, Any]) -> dict[str, Any]:
    """THIS's detect that first waits for the test's gate file."""
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise RuntimeError("the test never opened the gate")
        time.sleep(0.05)
    return detect_faces(chunk)


def test_items_on_a_killed_server_are_regenerated(
    local_cluster: LocalCluster, segments: list[Segment], expected: Any, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    pipe = make_pipeline(detect_concurrency=1, items_in_flight_max=len(segments),
                         detect_function=functools.partial(_gated_detect, str(gate)))
    decoded = threading.Semaphore(0)
    outcome: dict[str, Any] = {}
    with extra_server(local_cluster, prefix="doomed", capacity_bytes=DOOMED_CAPACITY_BYTES) as (
        info, _
    ):
        def run() -> None:
            try:
                # No size hints: the job spreads over every DRAM server by free bytes, so most
                # frames land on the big doomed server.
                outcome["result"] = pipe.run(
                    segments, executor="ray", cluster=local_cluster, keep_outputs=False,
                    hints={"latency_sensitive": True}, timeout_s=RUN_TIMEOUT_S,
                    client_options={"op_timeout_s": 5.0, "connect_timeout_s": 1.0},
                    on_outcome=lambda o: o.stage == 0 and decoded.release(),
                )
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
                outcome["error"] = exc

        driver = threading.Thread(target=run, daemon=True)
        driver.start()
        # Every segment is decoded and its frames written; detect holds the first at the gate.
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for _ in segments:
            while not decoded.acquire(timeout=0.5):
                assert driver.is_alive() and time.monotonic() < deadline, (
                    f"decoding stalled: {outcome.get('error')!r}")
        os.kill(info.server_pid, signal.SIGKILL)
        gate.write_text("open")
        driver.join(RUN_TIMEOUT_S)
        assert not driver.is_alive(), "the pipeline did not finish after the server was killed"
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    assert result.regenerated, "nothing was regenerated"
    handle = JobHandle.from_json(result.handle_json)
    assert info.node_id in {s.node_id for s in handle.lost}
    assert _boxes(result.outputs) == expected


def _dying_detect(flag_dir: str, chunk: dict[str, Any]) -> dict[str, Any]:
    """THIS's detect whose process dies the first time it sees segment 1 (after its input was
    read with DELETE)."""
    flag = Path(flag_dir) / f"died-{chunk['segment']}"
    if chunk["segment"] == 1 and not flag.exists():
        flag.write_text("1")
        os._exit(3)
    return detect_faces(chunk)


def _failing_decode(flag_dir: str, segment: Segment) -> dict[str, Any]:
    """THIS's decode that raises the first time it gets segment 2."""
    flag = Path(flag_dir) / f"raised-{segment.index}"
    if segment.index == 2 and not flag.exists():
        flag.write_text("1")
        raise RuntimeError("decoder failed once")
    return decode_segment(segment)


def test_lithops_retries_failed_tasks_and_regenerates_consumed_input(
    local_cluster: LocalCluster, segments: list[Segment], expected: Any, tmp_path: Path
) -> None:
    pipe = make_pipeline(detect_function=functools.partial(_dying_detect, str(tmp_path)),
                         decode_function=functools.partial(_failing_decode, str(tmp_path)))
    result = pipe.run(segments[:6], executor="lithops", cluster=local_cluster,
                      keep_outputs=False, timeout_s=RUN_TIMEOUT_S)
    assert (0, 2) in result.retried and (1, 1) in result.retried, result.failures
    # Detect's dead attempt had consumed segment 1's frames: they were decoded again.
    assert result.regenerated == [1], result.failures
    assert _boxes(result.outputs) == expected[:6]
    # Lithops functions stream too: a detect task read frames before the last decode ended.
    decodes = [o for o in result.outcomes if o.stage == 0]
    detects = [o for o in result.outcomes if o.stage == 1]
    assert min(o.input_ready_unix_s for o in detects) < max(o.finished_unix_s for o in decodes)


def _always_failing(value: Any) -> Any:
    raise ValueError(f"bad value {value!r}")


def test_a_task_failing_beyond_its_retries_fails_the_run_and_frees_the_job(
    local_cluster: LocalCluster
) -> None:
    pipe = Pipeline([stage(_always_failing, retries=1)], name="failing")
    jobs_before = {j["job_id"] for j in local_cluster.status()["jobs"]}
    with pytest.raises(StageFailed, match="after 1 retries"):
        pipe.run([1, 2], executor="ray", cluster=local_cluster, timeout_s=RUN_TIMEOUT_S)
    assert wait_for(lambda: {j["job_id"] for j in local_cluster.status()["jobs"]} <= jobs_before)


def test_cli_demo_writes_the_summary_and_pngs(tmp_path: Path) -> None:
    """``pocketflow-this demo`` end to end in a subprocess (its own local cluster: Ray runs once
    per process), on a short small video; and a bad argument exits 2 with a message."""
    env = {k: v for k, v in os.environ.items()
           if k != "RAY_ADDRESS" and not k.startswith("__LITHOPS_")}
    done = subprocess.run(
        [sys.executable, "-m", "pocketflow_this.cli", "demo", "--out", str(tmp_path),
         "--seconds", "2", "--width", "320", "--height", "180", "--segment-frames", "10"],
        capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["frames"] == 50 and summary["seconds_of_video"] == 2
    assert summary["detections"] >= 0 and 0 <= summary["score"]["recall"] <= 1
    assert {"detections.png", "contact_sheet.png"} <= {p.name for p in tmp_path.iterdir()}

    bad = subprocess.run(
        [sys.executable, "-m", "pocketflow_this.cli", "demo", "--out", str(tmp_path),
         "--seconds", "0"], capture_output=True, text=True, timeout=60, env=env,
    )
    assert bad.returncode == 2 and "--seconds" in bad.stderr
