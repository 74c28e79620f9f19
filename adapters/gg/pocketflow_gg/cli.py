"""The ``pocketflow-gg`` command: ``hash FILE...`` and ``build SOURCE_DIR TARGET --out DIR``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any, TextIO

from pocketflow_gg.engines import ENGINES, make_engine
from pocketflow_gg.errors import GGError
from pocketflow_gg.force import fetch_outputs, force, hints_for
from pocketflow_gg.infer import infer
from pocketflow_gg.objects import file_name
from pocketflow_gg.worker import trim_executables


def _format_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{n} B"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pocketflow-gg",
        description="gg thunks whose objects live in pocketflow: name files, build C projects.")
    sub = parser.add_subparsers(dest="command", required=True)
    hash_ = sub.add_parser("hash", help="print gg's content name of each FILE (as `gg hash`)")
    hash_.add_argument("files", nargs="+", metavar="FILE")
    build = sub.add_parser(
        "build", help="infer a make build as thunks, force it on workers, write the target",
        description="Infers SOURCE_DIR's `make TARGET` as gg thunks, writes them to a pocketflow "
                    "job, forces them on Lithops functions or Ray tasks and writes TARGET into "
                    "--out. Starts an embedded local cluster unless --address is given.")
    build.add_argument("source_dir", metavar="SOURCE_DIR")
    build.add_argument("target", metavar="TARGET", help="the file make builds (e.g. lua)")
    build.add_argument("--out", required=True, metavar="DIR", help="where TARGET is written")
    build.add_argument("--engine", choices=ENGINES, default="ray",
                       help="where thunks run: Ray tasks (default) or Lithops functions on "
                            "its localhost executor")
    build.add_argument("--jobs", type=int, default=os.cpu_count() or 2,
                       help="thunks running at once (default: the number of cores)")
    build.add_argument("--address", default=None,
                       help="Ray address of a running pocketflow cluster (`pocketflow up`)")
    build.add_argument("--no-delete", action="store_true",
                       help="keep intermediate objects (no DELETE-on-read)")
    build.add_argument("--prefix-lease-ms", type=int, default=None, metavar="MS",
                       help="scope the build's intermediate objects to prefix leases of MS "
                            "milliseconds, each freed as soon as its readers are done (and all "
                            "of them one lease after the driver's last renewal if it dies)")
    build.add_argument("--preprocess", action="store_true",
                       help="preprocess sources here, as gg's model does, so that workers need "
                            "no headers (by default a compile carries its project headers and "
                            "workers use their own system headers)")
    build.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _hash(args: argparse.Namespace, out: TextIO) -> int:
    for path in args.files:
        print(file_name(path), file=out)
    return 0


def _build(args: argparse.Namespace, out: TextIO) -> int:
    import pocketflow
    from pocketflow_gg.store import PocketflowStore

    started = time.perf_counter()
    graph, target = infer(args.source_dir, args.target, preprocess=args.preprocess)
    hints = hints_for(graph, target)
    print(f"inferred {len(graph.thunks)} thunks ({len(graph.values)} values, "
          f"{_format_bytes(graph.total_bytes())}) in {time.perf_counter() - started:.1f} s",
          file=out, flush=True)
    with ExitStack() as stack:
        if args.address:
            from pocketflow.control.plane import connect_control_plane

            cluster: Any = connect_control_plane(args.address)
        else:
            cluster = stack.enter_context(pocketflow.LocalCluster())
        leases = ({} if args.prefix_lease_ms is None
                  else {"prefix_lease_ms": args.prefix_lease_ms})
        job = stack.enter_context(
            pocketflow.register_job(f"gg-{args.target}", hints, cluster=cluster, **leases))
        store = PocketflowStore(job.handle.to_json())
        stack.callback(store.close)
        stack.callback(trim_executables)
        store.create_buckets()
        engine = make_engine(args.engine, store.spec, workers=args.jobs)
        stack.callback(engine.close)
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = stack.enter_context(tqdm(total=len(graph.thunks), unit="thunk", file=out))

        def progress(event: str, name: str) -> None:
            if bar is None:
                return
            if event == "total":
                bar.reset(total=int(name))
            elif event in ("done", "reused"):
                bar.update(1)

        result = force(graph, target, store=store, engine=engine, jobs=args.jobs,
                       delete=not args.no_delete, progress=progress,
                       scope=job if args.prefix_lease_ms is not None else None)
        if bar is not None:
            bar.close()
        written = fetch_outputs(store, graph.thunks[target.split("#", 1)[0]], result.outputs,
                                args.out)
    io = sorted(r["io_s"] for r in result.reports)
    mean_io = sum(io) / len(io) if io else 0.0
    print(f"built {', '.join(str(p) for p in written)} in {time.perf_counter() - started:.1f} s "
          f"(force {result.job_s:.1f} s, engine {args.engine}, {args.jobs} jobs)", file=out)
    print(f"  thunks: {len(result.ran)} run, {len(result.reused)} reused, "
          f"of {result.thunks_total}", file=out)
    print(f"  bytes moved: {_format_bytes(result.bytes_moved)} "
          f"(uploaded {_format_bytes(result.uploaded_bytes)}, "
          f"freed on read {_format_bytes(result.deleted_bytes)})", file=out)
    if result.build_prefix is not None:
        print(f"  scoped to {result.build_prefix}: {result.prefixes_ended} thunk prefixes "
              f"ended as read, {_format_bytes(result.ended_bytes)} freed by ending prefixes",
              file=out)
    print(f"  peak capacity: {_format_bytes(result.peak_live_bytes)}; "
          f"storage I/O per thunk: mean {mean_io * 1000:.1f} ms", file=out)
    return 0


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the command; returns the exit status."""
    args = _parser().parse_args(argv)
    out = out or sys.stdout
    try:
        if args.command == "hash":
            return _hash(args, out)
        if args.jobs < 1:
            raise GGError(f"--jobs must be at least 1, got {args.jobs}")
        if args.prefix_lease_ms is not None:
            from pocketflow.protocol import LEASE_MS_MAX, LEASE_MS_MIN

            if not LEASE_MS_MIN <= args.prefix_lease_ms <= LEASE_MS_MAX:
                raise GGError(f"--prefix-lease-ms must be in {LEASE_MS_MIN}..{LEASE_MS_MAX}, "
                              f"got {args.prefix_lease_ms}")
        return _build(args, out)
    except (GGError, OSError) as exc:
        print(f"pocketflow-gg: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
