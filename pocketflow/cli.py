"""The ``pocketflow`` command: run a local cluster, show its status, run the demo sort, list and
delete the PERSIST data of ended jobs."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from pocketflow.config import parse_duration, parse_size
from pocketflow.errors import ConfigError, PocketflowError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _duration_s(text: str) -> float:
    try:
        return parse_duration(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_cluster_shape(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("local cluster")
    group.add_argument("--dram-servers", type=int, default=2, help="DRAM servers (default 2)")
    group.add_argument("--nvme-servers", type=int, default=1, help="NVMe servers (default 1)")
    group.add_argument("--dram-capacity", type=_size, default="256MiB",
                       help="capacity of each DRAM server (default 256MiB)")
    group.add_argument("--nvme-capacity", type=_size, default="1GiB",
                       help="capacity of each NVMe server (default 1GiB)")
    group.add_argument("--block-size", type=_size, default="1MiB",
                       help="block size of large objects (default 1MiB)")
    group.add_argument("--num-cpus", type=_positive, default=2,
                       help="CPUs Ray may schedule on (default 2)")
    group.add_argument("--persist-ttl", type=_duration_s, default="24h",
                       help="how long PERSIST objects live on long-running servers (default 24h)")
    group.add_argument("--autoscale", action="store_true",
                       help="launch servers for jobs that do not fit, and run the sizing loop")
    group.add_argument("--sizing-interval", default="5s",
                       help="how often the sizing loop acts with --autoscale (default 5s)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``pocketflow`` command."""
    parser = argparse.ArgumentParser(
        prog="pocketflow",
        description="Elastic, ephemeral storage and shuffle for serverless analytics.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    up = commands.add_parser(
        "up", help="run a cluster in the foreground until Ctrl-C",
        description="Run a pocketflow cluster in the foreground until Ctrl-C.",
    )
    where = up.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true",
                       help="run an embedded local cluster on this machine")
    where.add_argument("--address", default=None,
                       help="join the running Ray cluster at this address: storage servers go "
                       "to nodes that advertise pocketflow_storage_<tier> resources, each on "
                       "its node's address, with TLS (see examples/cluster.yaml)")
    up.add_argument("--tls", action="store_true",
                    help="make a cluster CA and serve TLS only (always on with --address)")
    up.add_argument("--work-dir", default=None,
                    help="where the metadata log, the CA certificate and NVMe files go (default "
                    "a new directory under /tmp); with --address, a path every node sees")
    _add_cluster_shape(up)
    up.set_defaults(func=cmd_up)

    status = commands.add_parser(
        "status", help="show the servers, tiers and jobs of a running cluster",
        description="Show the servers, tiers and jobs of a running pocketflow cluster.",
    )
    status.add_argument("--address", default=None,
                        help="Ray address of the cluster (default $RAY_ADDRESS or 'auto')")
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    status.set_defaults(func=cmd_status)

    persist = commands.add_parser(
        "persist", help="list or delete the PERSIST data that ended jobs left",
        description="PERSIST objects outlive their job until their TTL. Once the job has ended, "
        "its token can no longer write, and these commands let the operator see and delete what "
        "is left.",
    )
    persist_commands = persist.add_subparsers(dest="persist_command", metavar="ACTION",
                                              required=True)
    persist_ls = persist_commands.add_parser(
        "ls", help="list jobs that are no longer registered and still hold data",
        description="List the jobs that are no longer registered and still hold data (their "
        "PERSIST objects), with objects and bytes per server.",
    )
    persist_ls.add_argument("--json", action="store_true", help="print the listing as JSON")
    persist_rm = persist_commands.add_parser(
        "rm", help="delete everything ended jobs left, PERSIST objects included",
        description="Delete everything the named ended jobs left on every server, PERSIST "
        "objects included. A registered job is refused: deregister it first.",
    )
    persist_rm.add_argument("jobs", nargs="*", metavar="JOB", help="job ids (see `persist ls`)")
    persist_rm.add_argument("--all", action="store_true",
                            help="every job that `persist ls` lists")
    for sub in (persist_ls, persist_rm):
        sub.add_argument("--address", default=None,
                         help="Ray address of the cluster (default $RAY_ADDRESS or 'auto')")
    persist.set_defaults(func=cmd_persist)

    demo = commands.add_parser(
        "demo", help="run a MapReduce sort through pocketflow and validate it",
        description="Sort generated 100-byte records with mappers and reducers on Lithops' "
        "localhost executor (or Ray tasks: --executor ray) that shuffle through pocketflow; "
        "validate the output; report time, bytes moved and peak capacity. Starts its own local "
        "cluster unless --address is given.",
    )
    demo.add_argument("--mappers", type=_positive, default=8, help="map tasks (default 8)")
    demo.add_argument("--reducers", type=_positive, default=4, help="reduce tasks (default 4)")
    demo.add_argument("--records", type=int, default=1_000_000,
                      help="100-byte records to sort (default 1,000,000 = 100 MB)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the generated records")
    demo.add_argument("--processes", type=_positive, default=None,
                      help="Lithops worker processes (default: number of CPUs, at least 2)")
    demo.add_argument("--keep-output", action="store_true",
                      help="keep the sorted output (PERSIST) instead of deleting it")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--lithops-storage", choices=("localhost", "pocket"), default="localhost",
                      help="where Lithops keeps its own data (payloads, results): its localhost "
                      "storage (default) or pocketflow's Lithops backend; the shuffle itself "
                      "always goes through pocketflow")
    demo.add_argument("--executor", choices=("lithops", "ray"), default="lithops",
                      help="what runs the mappers and reducers: Lithops' localhost executor "
                      "(default) or Ray tasks on the cluster's Ray")
    demo.add_argument("--runner", default=None,
                      help="what runs the tasks: an installed demo runner (entry-point group "
                      "pocketflow.demo_runners; default: the only one, or lithops)")
    demo.add_argument("--address", default=None,
                      help="Ray address of a running cluster (`pocketflow up --local`); "
                      "default: start a local cluster for the demo")
    _add_cluster_shape(demo)
    demo.set_defaults(func=cmd_demo)
    _add_bench(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pocketflow`` console script and ``python -m pocketflow``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args, parser))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (PocketflowError, ValueError) as exc:
        print(f"pocketflow {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILED


# -- up ---------------------------------------------------------------------------------------


def _local_cluster(args: argparse.Namespace) -> Any:
    from pocketflow.cluster import LocalCluster

    return LocalCluster(
        dram_servers=args.dram_servers,
        nvme_servers=args.nvme_servers,
        dram_capacity=args.dram_capacity,
        nvme_capacity=args.nvme_capacity,
        block_size=args.block_size,
        num_cpus=args.num_cpus,
        persist_ttl=args.persist_ttl,
        autoscale=args.autoscale,
        sizing_interval=args.sizing_interval if args.autoscale else None,
        **_placement_args(args),
    )


def _placement_args(args: argparse.Namespace) -> dict[str, Any]:
    """TLS, resources and work directory of ``up`` (other commands run a plain local cluster)."""
    joined = getattr(args, "address", None) is not None and getattr(args, "command", "") == "up"
    extra: dict[str, Any] = {}
    if getattr(args, "tls", False) or joined:
        extra["tls"] = True
    if joined:
        extra["storage_resources"] = True
    if getattr(args, "work_dir", None):
        extra["tmp_dir"] = args.work_dir
    return extra


def _join_ray(address: str) -> None:
    """Connect this process to the Ray cluster at ``address`` (the cluster then uses it)."""
    import logging

    import ray

    from pocketflow.control import NAMESPACE
    from pocketflow.errors import ClusterError

    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False,
                 logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterError(f"cannot join the Ray cluster at {address}: {exc}") from exc


class _StopSignals:
    """While active, SIGINT and SIGTERM raise ``KeyboardInterrupt`` once, then are ignored."""

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._fired = threading.Event()

    def _handler(self, signum: int, frame: Any) -> None:
        if self._fired.is_set():
            return  # already stopping; let the cleanup finish
        self._fired.set()
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def install(self) -> None:
        """Install the handlers (again: ``ray.init`` replaces the SIGTERM handler)."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.signal(signum, self._handler)
            self._previous.setdefault(signum, previous)

    def __enter__(self) -> _StopSignals:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def cmd_up(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``pocketflow up --local``: run a local cluster until Ctrl-C or SIGTERM."""
    if not args.local and args.address is None:
        parser.error("say where: `pocketflow up --local` (this machine) or "
                     "`pocketflow up --address <ray address>` (an existing Ray cluster)")
    out = sys.stdout
    with _StopSignals() as signals:
        if args.address is not None:
            _join_ray(args.address)
        cluster = _local_cluster(args)
        try:
            started = time.perf_counter()
            cluster.start()
            signals.install()
            _print_up(cluster, time.perf_counter() - started, out)
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("stopping the local cluster ...", file=out, flush=True)
        finally:
            cluster.stop()
    print("stopped", file=out, flush=True)
    return EXIT_OK


def _print_up(cluster: Any, elapsed_s: float, out: TextIO) -> None:
    from pocketflow.status_view import format_bytes, table

    address = cluster.ray_address
    rows = [
        [s.node_id, s.tier, s.address, format_bytes(s.capacity_bytes),
         "yes" if s.long_running else "no", str(s.server_pid)]
        for s in cluster.servers
    ]
    tls_dir = cluster.tls_dir
    tls = f" with TLS (cluster CA: {tls_dir / 'ca.pem'})" if tls_dir else ""
    print(f"pocketflow cluster is up ({elapsed_s:.1f} s; Ray at {address}, "
          f"namespace pocketflow){tls}", file=out)
    header = ["NODE", "TIER", "ADDRESS", "CAPACITY", "PERSIST", "PID"]
    print("\n".join(table(header, rows, right=set())), file=out)
    print(
        "\nConnect from another process on this machine:\n"
        f"  pocketflow status --address {address}\n"
        f"  pocketflow demo --address {address}\n"
        f"  with RAY_ADDRESS={address} set, in Python:\n"
        "    with pocketflow.register_job(\"myjob\") as job: ...\n"
        "\nPress Ctrl-C to stop.",
        file=out,
        flush=True,
    )


# -- status -----------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``pocketflow status``: servers, tiers and jobs of a running cluster."""
    from pocketflow.control.plane import connect_control_plane

    status = connect_control_plane(args.address).status()
    if args.json:
        json.dump(status, sys.stdout, indent=2, sort_keys=True, default=str)
        print()
        return EXIT_OK
    print_status(status, sys.stdout)
    return EXIT_OK


def print_status(status: dict[str, Any], out: TextIO) -> None:
    """Print ``Controller.status()`` as tables (see :mod:`pocketflow.status_view`)."""
    from pocketflow.status_view import format_status

    out.write(format_status(status))


# -- persist ----------------------------------------------------------------------------------


def cmd_persist(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``pocketflow persist ls|rm``: the data that ended jobs left (their PERSIST objects)."""
    from pocketflow.control.plane import connect_control_plane
    from pocketflow.status_view import format_bytes

    if args.persist_command == "rm" and bool(args.jobs) == bool(args.all):
        parser.error("persist rm: name the jobs or give --all, not both")
    plane = connect_control_plane(args.address)
    if args.persist_command == "ls":
        listing = plane.persist_list()
        if args.json:
            json.dump(listing, sys.stdout, indent=2, sort_keys=True)
            print()
            return EXIT_OK
        if not listing["jobs"]:
            print("no ended job holds data")
        for row in listing["jobs"]:
            servers = ", ".join(sorted(row["servers"]))
            print(f"{row['job_id']}  {row['objects']} objects  "
                  f"{format_bytes(row['used_bytes'])}  on {servers}")
        for node_id in listing["unreachable"]:
            print(f"warning: {node_id} did not answer", file=sys.stderr)
        return EXIT_OK if not listing["unreachable"] else EXIT_FAILED
    jobs = args.jobs or [row["job_id"] for row in plane.persist_list()["jobs"]]
    if not jobs:
        print("no ended job holds data")
        return EXIT_OK
    result = plane.persist_delete(jobs)
    print(f"deleted {result['deleted']} objects, freed {format_bytes(result['freed_bytes'])} "
          f"of {len(jobs)} job(s)")
    for node_id in result["unreachable"]:
        print(f"warning: {node_id} did not answer; its data of these jobs is left",
              file=sys.stderr)
    return EXIT_OK if not result["unreachable"] else EXIT_FAILED


# -- demo -------------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``pocketflow demo``: the MapReduce sort, on a fresh local cluster or a running one, its
    tasks run by an installed demo runner (:func:`pocketflow.demo.demo_runner`)."""
    from pocketflow.demo import SortConfig, demo_runner

    try:
        runner = demo_runner(args.runner)
    except ConfigError as exc:
        print(f"pocketflow demo: {exc}", file=sys.stderr)
        return EXIT_FAILED
    runner.prepare()

    config = SortConfig(
        mappers=args.mappers,
        reducers=args.reducers,
        records=args.records,
        seed=args.seed,
        processes=args.processes,
        block_size_bytes=args.block_size if args.address else None,
        keep_output=args.keep_output,
    )
    out = sys.stdout
    if args.address:
        from pocketflow.control.plane import connect_control_plane

        return _run_demo(runner, connect_control_plane(args.address), config, args, out)
    started = time.perf_counter()
    with _StopSignals() as signals, _local_cluster(args) as cluster:
        signals.install()
        print(f"started a local cluster in {time.perf_counter() - started:.1f} s "
              f"({len(cluster.servers)} storage servers)", file=out, flush=True)
        return _run_demo(runner, cluster, config, args, out)


def _run_demo(runner: Any, cluster: Any, config: Any, args: argparse.Namespace,
              out: TextIO) -> int:
    # The runner's shuffle registers the job itself, with the hints it knows (tasks, input size).
    try:
        report = runner.run(cluster, config, progress=not args.no_progress,
                            options={"lithops_storage": args.lithops_storage,
                                     "executor": args.executor})
    except PocketflowError as exc:
        # Said now, before the local cluster stops: what failed is what the user needs, and
        # stopping a cluster that is gone is best effort.
        print(f"pocketflow demo: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    for line in report.summary_lines():
        print(line, file=out)
    out.flush()
    return EXIT_OK if report.ok else EXIT_FAILED


# -- bench ------------------------------------------------------------------------------------

BENCH_DESCRIPTION = (
    "Compare pocketflow (DRAM and NVMe tiers) with Redis, SeaweedFS S3 and raw loopback TCP on "
    "127.0.0.1, the same as `python -m benchmarks.compare`; writes JSON, Markdown and PNG plots "
    "(default benchmarks/results/). Needs a pocketflow source checkout: benchmarks/ is not "
    "installed with the package."
)
BENCH_NOT_FOUND = (
    "benchmarks/ is not installed with the pocketflow package; run `pocketflow bench` from the "
    "root of a pocketflow source checkout (the directory that holds benchmarks/compare.py)"
)


def _benchmarks_root() -> Path | None:
    """The source checkout whose ``benchmarks/`` ``pocketflow bench`` runs, or ``None``.

    The current directory first, then the checkout this package was installed from (an
    editable install, or running from the checkout).
    """
    import pocketflow

    candidates = [Path(pocketflow.__file__).resolve().parent.parent]
    try:
        candidates.insert(0, Path.cwd().resolve())
    except OSError:  # the current directory was removed; every other command must still run
        pass
    for root in candidates:
        if all((root / "benchmarks" / name).is_file() for name in ("options.py", "compare.py")):
            return root
    return None


def _add_bench(commands: Any) -> None:
    """The ``bench`` subcommand, with the options ``benchmarks/options.py`` defines."""
    import importlib.util

    root = _benchmarks_root()
    if root is None:
        # Take any arguments, so that the command says what is missing instead of rejecting
        # options it cannot know.
        bench = commands.add_parser(
            "bench", help="compare with Redis, S3 and raw TCP (source checkout only)",
            description=BENCH_DESCRIPTION, prefix_chars="+", add_help=False,
        )
        bench.add_argument("bench_args", nargs="*", help=argparse.SUPPRESS)
    else:
        bench = commands.add_parser(
            "bench", help="compare with Redis, S3 and raw TCP (source checkout only)",
            description=BENCH_DESCRIPTION,
        )
        # Loaded by path, not imported: building the parser must not put the checkout on
        # sys.path for every other command. The module is free of dependencies.
        spec = importlib.util.spec_from_file_location(
            "_pocketflow_bench_options", root / "benchmarks" / "options.py"
        )
        assert spec is not None and spec.loader is not None
        options = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(options)
        options.add_arguments(bench)
    bench.set_defaults(func=cmd_bench, benchmarks_root=root)


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``pocketflow bench``: ``python -m benchmarks.compare`` of the source checkout."""
    root = args.benchmarks_root
    if root is None:
        print(f"pocketflow bench: {BENCH_NOT_FOUND}", file=sys.stderr)
        return EXIT_FAILED
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        from benchmarks import compare
    except ImportError as exc:
        print(f"pocketflow bench: cannot import the benchmarks of {root}: {exc} (they need the "
              "test extras: pip install -e '.[test]')", file=sys.stderr)
        return EXIT_FAILED
    if Path(compare.__file__).resolve().parent != root / "benchmarks":
        print(f"pocketflow bench: another `benchmarks` package shadows {root / 'benchmarks'}: "
              f"{compare.__file__}", file=sys.stderr)
        return EXIT_FAILED
    return int(compare.main_from_args(args))
