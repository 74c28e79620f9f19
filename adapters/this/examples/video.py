"""The demo's test video, made offline: ``skimage.data.astronaut()`` panned and scaled over a
smooth background, encoded with PyAV to H.264 in independent segments (each starts with a
keyframe, as HLS segments do), so a decode task needs only its own segment. The astronaut's
face box is known in the source image, so every frame's true face position is known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["VideoSpec", "Segment", "write_segments", "in_s3", "true_face", "render",
           "FACE_BOX"]

FACE_BOX = (175, 63, 100, 100)
"""The face in ``astronaut()`` (x, y, w, h in its 512x512 pixels), as OpenCV's frontal-face
cascade finds it at full size (one measurement, kept as a constant)."""
SOURCE_SIZE = 512
FRAMES_MAX = 100_000
"""Most frames of one test video."""


@dataclass(frozen=True)
class VideoSpec:
    """Shape and motion of a test video."""

    width: int = 640
    height: int = 360
    fps: int = 25
    seconds: int = 18
    segment_frames: int = 25
    scale_min: float = 0.5
    scale_max: float = 0.68

    def __post_init__(self) -> None:
        if self.width < 64 or self.height < 64 or self.width % 2 or self.height % 2:
            raise ValueError(f"frame size must be even and >= 64, got {self.width}x{self.height}")
        if not 1 <= self.fps <= 120 or self.seconds < 1 or self.segment_frames < 1:
            raise ValueError("fps must be 1..120, seconds and segment_frames >= 1")
        if self.frames > FRAMES_MAX:
            raise ValueError(f"{self.frames} frames, more than {FRAMES_MAX}")
        side = SOURCE_SIZE * self.scale_max
        if not 0 < self.scale_min <= self.scale_max or side > min(self.width, self.height):
            raise ValueError(f"scales {self.scale_min}..{self.scale_max} do not fit the frame")

    @property
    def frames(self) -> int:
        return self.fps * self.seconds

    @property
    def frame_bytes(self) -> int:
        return self.width * self.height * 3


@dataclass(frozen=True)
class Segment:
    """One encoded segment of the video: the decode stage's input item. It is read from
    ``path``, or, when ``cache_spec`` is set, from S3 (``s3_bucket``/``s3_key``) through the
    pocketflow cache of that spec (:func:`in_s3`)."""

    path: str
    index: int
    first_frame: int
    frames: int
    width: int
    height: int
    s3_bucket: str | None = None
    s3_key: str | None = None
    cache_spec: str | None = None

    @property
    def decoded_bytes(self) -> int:
        return self.frames * self.width * self.height * 3

    def open_encoded(self) -> Any:
        """The encoded segment for PyAV: its path, or its bytes read through the cache."""
        if self.cache_spec is None:
            return self.path
        import io

        from pocketflow.cache import shared_client

        cache = shared_client(self.cache_spec)
        try:
            return io.BytesIO(cache.get(str(self.s3_bucket), str(self.s3_key)))
        finally:
            cache.flush()


def in_s3(segments: list[Segment], cache: Any, bucket: str) -> list[Segment]:
    """Upload the segments' files to S3 ``bucket`` (the cache's source, created if need be),
    writing through ``cache`` (a :class:`pocketflow.cache.Cache`) so that it holds what S3
    holds, and return segments that decode reads from there through the cache."""
    from dataclasses import replace

    cache.client.source_store.create_bucket(bucket)
    moved = []
    for segment in segments:
        key = f"segments/{Path(segment.path).name}"
        cache.client.put(bucket, key, Path(segment.path).read_bytes())
        moved.append(replace(segment, s3_bucket=bucket, s3_key=key,
                             cache_spec=cache.spec.to_json()))
    return moved


def placement(spec: VideoSpec, frame: int) -> tuple[int, int, int]:
    """Where the astronaut is in ``frame``: its top-left corner and side, in pixels."""
    t = frame / spec.fps
    zoom = 0.5 - 0.5 * math.cos(2 * math.pi * t / 7.0)
    side = int(round(SOURCE_SIZE * (spec.scale_min + (spec.scale_max - spec.scale_min) * zoom)))
    pan = 0.5 - 0.5 * math.cos(2 * math.pi * t / 5.0)
    x = int(round((spec.width - side) * pan))
    y = int(round((spec.height - side) * (0.5 + 0.4 * math.sin(2 * math.pi * t / 9.0))))
    return x, y, side


def true_face(spec: VideoSpec, frame: int) -> tuple[int, int, int, int]:
    """The face's box (x, y, w, h) in ``frame``."""
    x, y, side = placement(spec, frame)
    f = side / SOURCE_SIZE
    fx, fy, fw, fh = FACE_BOX
    return (int(round(x + fx * f)), int(round(y + fy * f)), int(round(fw * f)),
            int(round(fh * f)))


def _background(spec: VideoSpec) -> np.ndarray:
    yy, xx = np.mgrid[0:spec.height, 0:spec.width].astype(np.float32)
    r = 90 + 60 * np.sin(xx / 97.0) * np.cos(yy / 61.0)
    g = 110 + 50 * np.cos(xx / 53.0 + yy / 149.0)
    b = 140 + 40 * np.sin((xx + yy) / 211.0)
    return np.clip(np.stack([r, g, b], axis=-1), 0, 255).astype(np.uint8)


def render(spec: VideoSpec, frame: int, *, background: np.ndarray | None = None,
           source: np.ndarray | None = None) -> np.ndarray:
    """Frame ``frame`` as RGB (height, width, 3)."""
    import cv2

    if source is None:
        from skimage.data import astronaut

        source = astronaut()
    out = (_background(spec) if background is None else background).copy()
    x, y, side = placement(spec, frame)
    out[y:y + side, x:x + side] = cv2.resize(source, (side, side), interpolation=cv2.INTER_AREA)
    return out


def write_segments(spec: VideoSpec, out_dir: Path) -> list[Segment]:
    """Encode the video to H.264 (MP4 segments of ``segment_frames`` frames) in ``out_dir``."""
    import av
    from skimage.data import astronaut

    out_dir.mkdir(parents=True, exist_ok=True)
    source = astronaut()
    background = _background(spec)
    segments = []
    for index, first in enumerate(range(0, spec.frames, spec.segment_frames)):
        count = min(spec.segment_frames, spec.frames - first)
        path = out_dir / f"segment-{index:05d}.mp4"
        with av.open(str(path), "w") as container:
            stream = container.add_stream("libx264", rate=spec.fps)
            stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
            stream.options = {"preset": "veryfast", "crf": "20"}
            for f in range(first, first + count):
                image = render(spec, f, background=background, source=source)
                frame = av.VideoFrame.from_ndarray(image, format="rgb24")
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        segments.append(Segment(str(path), index, first, count, spec.width, spec.height))
    return segments
