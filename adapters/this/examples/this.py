"""THIS (the Pocket paper's Thousand Island Scanner) as a decorated pipeline: ``decode`` turns
H.264 segments into RGB frames, ``detect`` finds faces in them with OpenCV's frontal-face Haar
cascade; frames travel through pocketflow, read once with DELETE. The driver aggregates the
detections per second of video, scores them against the known face positions and draws the
PNGs.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
from pocketflow_this import Pipeline, PipelineResult, pipeline, stage
from pocketflow_this_examples.video import (
    Segment,
    VideoSpec,
    in_s3,
    true_face,
    write_segments,
)

__all__ = ["decode", "detect", "this", "make_pipeline", "summarize", "run_demo", "THUMB_WIDTH"]

THUMB_WIDTH = 160
"""Width of the contact sheet's thumbnails (one per segment)."""
THUMB_BYTES = THUMB_WIDTH * 90 * 3 + 64 * 1024
"""Size of one detect output: boxes and one thumbnail, with room."""
DETECT_WIDTH = 320
"""Frames are searched for faces at about this width."""
IOU_MATCH = 0.3
"""A detection matches the true face when their intersection over union is at least this."""

_cascade: Any = None


def _face_cascade() -> Any:
    global _cascade
    if _cascade is None:
        import cv2

        _cascade = cv2.CascadeClassifier(
            cv2.data.haarcascades + "haarcascade_frontalface_default.xml")
        if _cascade.empty():
            raise RuntimeError("OpenCV's frontal-face cascade did not load (opencv-python-"
                               "headless<5 ships it in cv2.data)")
    return _cascade


def decode_segment(segment: Segment) -> dict[str, Any]:
    """All frames of ``segment`` as one (frames, height, width, 3) RGB array."""
    import av

    frames = np.empty((segment.frames, segment.height, segment.width, 3), dtype=np.uint8)
    count = 0
    with av.open(segment.open_encoded()) as container:
        for frame in container.decode(video=0):
            if count == segment.frames:
                raise ValueError(f"{segment.path} has more than {segment.frames} frames")
            frames[count] = frame.to_ndarray(format="rgb24")
            count += 1
    if count != segment.frames:
        raise ValueError(f"{segment.path} has {count} frames, expected {segment.frames}")
    return {"segment": segment.index, "first_frame": segment.first_frame, "frames": frames}


def detect_faces(chunk: dict[str, Any]) -> dict[str, Any]:
    """Face boxes (x, y, w, h) of every frame of ``chunk`` and a thumbnail of its first."""
    import cv2

    cascade = _face_cascade()
    frames = chunk["frames"]
    boxes = []
    h, w = frames.shape[1:3]
    # Frames wider than DETECT_WIDTH are searched at a reduced size (4x fewer pixels at 640).
    factor = max(1, w // DETECT_WIDTH)
    for image in frames:
        gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
        if factor > 1:
            gray = cv2.resize(gray, (w // factor, h // factor), interpolation=cv2.INTER_AREA)
        found = cascade.detectMultiScale(gray, scaleFactor=1.1, minNeighbors=4,
                                         minSize=(20, 20))
        boxes.append([tuple(int(v) * factor for v in box) for box in found])
    thumb = cv2.resize(frames[0], (THUMB_WIDTH, max(1, round(h * THUMB_WIDTH / w))),
                       interpolation=cv2.INTER_AREA)
    return {"segment": chunk["segment"], "first_frame": chunk["first_frame"], "boxes": boxes,
            "thumb": thumb, "frame_size": (w, h)}


decode = stage(decode_segment, name="decode", concurrency=2, latency_sensitive=True,
               output_bytes=lambda segment: segment.decoded_bytes + 4096)
detect = stage(detect_faces, name="detect", concurrency=2, latency_sensitive=True,
               output_bytes=THUMB_BYTES)


@pipeline(name="this")
def this(segment: Segment) -> Any:
    return detect(decode(segment))


def make_pipeline(*, decode_concurrency: int = 2, detect_concurrency: int = 2,
                  detect_function: Any = None, decode_function: Any = None,
                  items_in_flight_max: int | None = None) -> Pipeline:
    """THIS with other concurrencies or stage functions (tests wrap the stages)."""
    dec = stage(decode_function or decode_segment, name="decode",
                concurrency=decode_concurrency, output_bytes=decode.output_bytes)
    det = stage(detect_function or detect_faces, name="detect",
                concurrency=detect_concurrency, output_bytes=THUMB_BYTES)
    return Pipeline([dec, det], name="this", items_in_flight_max=items_in_flight_max)


def iou(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    ax, ay, aw, ah = a
    bx, by, bw, bh = b
    ix = max(0, min(ax + aw, bx + bw) - max(ax, bx))
    iy = max(0, min(ay + ah, by + bh) - max(ay, by))
    inter = ix * iy
    union = aw * ah + bw * bh - inter
    return inter / union if union else 0.0


def summarize(spec: VideoSpec, outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-second aggregates and the score against the true face positions."""
    frames = detections = matched_frames = true_positives = 0
    ious = []
    per_second: dict[int, dict[str, int]] = {}
    seen = set()
    for out in outputs:
        for offset, boxes in enumerate(out["boxes"]):
            f = out["first_frame"] + offset
            seen.add(f)
            frames += 1
            detections += len(boxes)
            truth = true_face(spec, f)
            scores = [iou(tuple(b), truth) for b in boxes]
            hits = [s for s in scores if s >= IOU_MATCH]
            true_positives += len(hits)
            if hits:
                matched_frames += 1
                ious.append(max(hits))
            sec = per_second.setdefault(f // spec.fps, {"frames": 0, "detections": 0,
                                                          "frames_with_face_found": 0})
            sec["frames"] += 1
            sec["detections"] += len(boxes)
            sec["frames_with_face_found"] += bool(hits)
    return {
        "frames": frames,
        "frames_expected": spec.frames,
        "frames_complete": seen == set(range(spec.frames)),
        "detections": detections,
        "seconds_of_video": frames / spec.fps,
        "score": {
            "recall": matched_frames / frames if frames else 0.0,
            "precision": true_positives / detections if detections else 0.0,
            "mean_iou": float(np.mean(ious)) if ious else 0.0,
            "iou_match": IOU_MATCH,
        },
        "per_second": [{"second": s, **v} for s, v in sorted(per_second.items())],
    }


def task_stats(result: PipelineResult, stages: tuple[str, ...]) -> dict[str, Any]:
    """Per stage: tasks, mean and p95 of storage I/O seconds per task, bytes moved."""
    out = {}
    for k, name in enumerate(stages):
        rows = [o for o in result.outcomes if o.stage == k]
        io = np.array([o.io_s for o in rows]) if rows else np.zeros(1)
        out[name] = {
            "tasks": len(rows),
            "io_s_mean": float(io.mean()),
            "io_s_p95": float(np.percentile(io, 95)),
            "read_s_mean": float(np.mean([o.read_s for o in rows])) if rows else 0.0,
            "write_s_mean": float(np.mean([o.write_s for o in rows])) if rows else 0.0,
            "compute_s_mean": float(np.mean([o.compute_s for o in rows])) if rows else 0.0,
            "bytes_read": sum(o.bytes_read for o in rows),
            "bytes_written": sum(o.bytes_written for o in rows),
        }
    return out


def draw(spec: VideoSpec, outputs: list[dict[str, Any]], summary: dict[str, Any],
         out_dir: Path) -> list[str]:
    """``detections.png`` (detections and found faces per second) and ``contact_sheet.png``
    (each segment's first frame, detections in green, the true face in red)."""
    import matplotlib

    matplotlib.use("Agg")
    import cv2
    import matplotlib.pyplot as plt

    seconds = [row["second"] for row in summary["per_second"]]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(seconds, [row["detections"] for row in summary["per_second"]], color="tab:green",
           label="detections")
    ax.plot(seconds, [row["frames_with_face_found"] for row in summary["per_second"]], "k.-",
            label="frames whose true face was found")
    ax.axhline(spec.fps, color="tab:red", lw=1, ls="--", label="frames per second")
    ax.set_xlabel("second of video")
    ax.set_ylabel("count")
    ax.set_title(f"THIS: {summary['detections']} detections in {summary['frames']} frames, "
                 f"recall {summary['score']['recall']:.2f}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "detections.png", dpi=110)
    plt.close(fig)

    thumbs = []
    for out in sorted(outputs, key=lambda o: o["segment"]):
        thumb = np.array(out["thumb"], copy=True)
        w, _ = out["frame_size"]
        f = THUMB_WIDTH / w
        for x, y, bw, bh in out["boxes"][0]:
            cv2.rectangle(thumb, (int(x * f), int(y * f)), (int((x + bw) * f), int((y + bh) * f)),
                          (0, 255, 0), 1)
        x, y, bw, bh = true_face(spec, out["first_frame"])
        cv2.rectangle(thumb, (int(x * f), int(y * f)), (int((x + bw) * f), int((y + bh) * f)),
                      (255, 0, 0), 1)
        thumbs.append(thumb)
    columns = min(8, len(thumbs))
    rows = math.ceil(len(thumbs) / columns)
    th, tw = thumbs[0].shape[:2]
    sheet = np.full((rows * th, columns * tw, 3), 255, dtype=np.uint8)
    for i, thumb in enumerate(thumbs):
        r, c = divmod(i, columns)
        sheet[r * th:(r + 1) * th, c * tw:(c + 1) * tw] = thumb
    fig = plt.figure(figsize=(columns * 1.6, rows * 1.0 + 0.4))
    plt.imshow(sheet)
    plt.axis("off")
    plt.title("first frame of each segment: detections green, true face red", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "contact_sheet.png", dpi=110)
    plt.close(fig)
    return ["detections.png", "contact_sheet.png"]


INPUT_CACHE = "this-inputs"
"""The cache the video is read through when it lives in S3."""
INPUT_BUCKET = "this-video"
"""The S3 bucket the video's segments are uploaded to."""


def run_demo(out_dir: Path, *, executor: str = "ray", spec: VideoSpec | None = None,
             cluster: Any = None, pipe: Pipeline | None = None, s3: Any = None,
             **run_options: Any) -> dict[str, Any]:
    """Make the video, run THIS over it, write ``summary.json`` and the PNGs into ``out_dir``;
    returns the summary. With ``s3`` (a :class:`pocketflow.cache.S3Source`) the video is
    uploaded to S3 and decode reads it through a pocketflow cache."""
    return run_this(out_dir, executor=executor, spec=spec, cluster=cluster, pipe=pipe, s3=s3,
                    **run_options)[0]


def run_this(out_dir: Path, *, executor: str = "ray", spec: VideoSpec | None = None,
             cluster: Any = None, pipe: Pipeline | None = None, s3: Any = None,
             **run_options: Any) -> tuple[dict[str, Any], PipelineResult]:
    """:func:`run_demo`, also returning the pipeline's result."""
    spec = spec or VideoSpec()
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    segments = write_segments(spec, out_dir / "video")
    encode_s = time.perf_counter() - t0
    pipe = pipe or this
    input_cache: dict[str, Any] | None = None
    if s3 is None:
        result = pipe.run(segments, executor=executor, cluster=cluster, **run_options)
    else:
        from pocketflow.cache import open_cache

        # The run reads the video through the cache; the next run prewarms from this one.
        with open_cache(INPUT_CACHE, s3, app="this", prewarm=True, cluster=cluster) as cache:
            result = pipe.run(in_s3(segments, cache, INPUT_BUCKET), executor=executor,
                              cluster=cluster, **run_options)
            input_cache = cache.close()
    summary = summarize(spec, result.outputs)
    if input_cache is not None:
        summary["input_cache"] = input_cache
    summary.update({
        "executor": executor,
        "elapsed_s": result.elapsed_s,
        "encode_s": encode_s,
        "video": {"width": spec.width, "height": spec.height, "fps": spec.fps,
                  "segments": len(segments), "segment_frames": spec.segment_frames,
                  "h264_bytes": sum(Path(s.path).stat().st_size for s in segments)},
        "decoded_bytes": sum(s.decoded_bytes for s in segments),
        "job_id": result.job_id,
        "hints": result.hints,
        "stages": task_stats(result, tuple(s.name for s in pipe.stages)),
        "retried": result.retried,
        "regenerated": result.regenerated,
    })
    summary["pngs"] = draw(spec, result.outputs, summary, out_dir)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary, result
