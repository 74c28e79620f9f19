"""The ``pocketflow-this`` command: ``pocketflow-this demo --out DIR [--executor ray|lithops]``
makes a test video, runs THIS over it through pocketflow and writes ``DIR/summary.json`` and
the PNGs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pocketflow_this.executors import EXECUTORS

__all__ = ["main"]

DEMO_DRAM_CAPACITY = "512MiB"
DEMO_NVME_CAPACITY = "1GiB"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pocketflow-this", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the THIS video pipeline on a made-up video")
    demo.add_argument("--out", type=Path, required=True, help="directory for summary and PNGs")
    demo.add_argument("--executor", choices=EXECUTORS, default="ray",
                      help="where stage tasks run (default ray)")
    demo.add_argument("--seconds", type=_positive, default=18,
                      help="seconds of video (default 18: 450 frames, 311 MB decoded)")
    demo.add_argument("--width", type=_positive, default=640, help="frame width (default 640)")
    demo.add_argument("--height", type=_positive, default=360, help="frame height (default 360)")
    demo.add_argument("--segment-frames", type=_positive, default=25,
                      help="frames per decode task (default 25)")
    demo.add_argument("--s3-endpoint", default=None,
                      help="upload the video to this S3 endpoint and read it through a "
                           "pocketflow cache (credentials as boto3 finds them)")
    demo.add_argument("--s3-unsigned", action="store_true",
                      help="send the S3 requests unsigned (a local store without identities)")
    demo.add_argument("--address", default=None,
                      help="use the pocketflow cluster at this Ray address (`pocketflow up "
                           "--local` prints it); by default a local cluster is started")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from pocketflow_this_examples.this import run_demo
    from pocketflow_this_examples.video import VideoSpec

    try:
        spec = VideoSpec(width=args.width, height=args.height, seconds=args.seconds,
                         segment_frames=args.segment_frames,
                         scale_min=0.5 * min(1.0, args.height / 360),
                         scale_max=0.68 * min(1.0, args.height / 360))
    except ValueError as exc:
        print(f"pocketflow-this: {exc}", file=sys.stderr)
        return 2
    s3 = None
    if args.s3_endpoint is not None:
        from pocketflow.cache import S3Source

        s3 = S3Source(endpoint_url=args.s3_endpoint, unsigned=args.s3_unsigned)
    if args.address is not None:
        import os

        import ray

        os.environ["RAY_ADDRESS"] = args.address
        if not ray.is_initialized():
            ray.init(address=args.address, log_to_driver=False)
        summary = run_demo(args.out, executor=args.executor, spec=spec, s3=s3)
    else:
        import pocketflow

        with pocketflow.LocalCluster(dram_capacity=DEMO_DRAM_CAPACITY,
                                     nvme_capacity=DEMO_NVME_CAPACITY) as cluster:
            summary = run_demo(args.out, executor=args.executor, spec=spec, cluster=cluster,
                               s3=s3)
    brief = {k: summary[k] for k in ("frames", "detections", "seconds_of_video", "score",
                                    "elapsed_s", "decoded_bytes")}
    print(json.dumps(brief, indent=2))
    print(f"wrote {args.out / 'summary.json'} and {', '.join(summary['pngs'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
