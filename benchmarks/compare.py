"""Side-by-side runner: pocketflow (DRAM and NVMe tiers), Redis, S3 and raw TCP in one run.

``python -m benchmarks.compare [--quick|--full] [--peers ...] [--out DIR]``, or the same options
after ``pocketflow bench`` (which calls :func:`main_from_args`).

Every peer is started on 127.0.0.1 before the first cell and stopped (by pid) after the last,
so that the peers can take turns: every cell (one object size and one number of client
processes, multiprocessing spawn, started once for the whole run) runs interleaved rounds
(:mod:`benchmarks.schedule`): in each round every peer in turn runs a PUT phase, a GET phase of
what it put and an untimed cleanup, the order rotating from round to round. The first rounds of
every cell are warm-ups, discarded; each figure is the median of the measured rounds, reported
with its spread (:mod:`benchmarks.spread`), and pocketflow/peer ratios are taken round by round.
Pipelined cells send batches (``put_many``/``get_many``, a Redis pipeline, concurrent S3
requests, one TCP send). ``tcp-native`` (:mod:`benchmarks.tcp_native`) is the loopback limit:
every peer is also reported as a fraction of it. Results go to ``<out>/<date>-<mode>.json``,
``.md`` and ``-*.png``; a full run also copies its summary to ``<out>/LATEST.md``.

The exit status is 0 when every planned figure was measured, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import machine, report
from benchmarks.options import PEER_NAMES, TLS_PEER_NAMES, add_arguments
from benchmarks.peers import (
    Peer,
    PocketflowPeer,
    RedisPeer,
    S3Peer,
    StandalonePocketflowPeer,
    TcpPeer,
    pocketflow_version,
    weed_binary,
)
from benchmarks.pool import ClientPool, PhaseError
from benchmarks.schedule import RoundBounds, interleave
from benchmarks.spread import spread
from benchmarks.tcp_native import NativeTcpPeer
from benchmarks.workloads import (
    DELETE,
    GET,
    GET_MANY,
    PUT,
    PUT_MANY,
    ROUND_FIGURES,
    KiB,
    MiB,
    PhaseResult,
    cdf_points,
    combine,
    round_figures,
    round_keys,
)

CDF_SIZE_BYTES = 1 * KiB
"""Object size whose one-client latency distribution is kept (the CDF plot)."""


@dataclass(frozen=True)
class Plan:
    """What one run measures, and the bounds on each cell."""

    mode: str
    sizes_bytes: tuple[int, ...]
    clients: tuple[int, ...]
    batch_size_bytes: int
    batch_ops: int
    """Objects per put_many/get_many call (per pipeline)."""
    batch_clients: tuple[int, ...]
    ops_per_phase_max: int
    """Most objects one client puts (then gets) in one round."""
    round_bytes_max: int
    """Bytes all clients of a round put together, at most (but one object per client at
    least). Rounds are kept small so that most of them reuse memory the previous round freed:
    the figures are a steady state, not a store's first touch of fresh memory."""
    warmup_rounds: int
    """Rounds every peer runs at the start of every cell, discarded (a store's first touch of
    fresh memory at this size, connections, caches)."""
    rounds_min: int
    """Measured rounds every peer runs in every cell, whatever the time."""
    rounds_max: int
    """Measured rounds at most."""
    cell_seconds: float
    """Time budget of a cell per peer: past ``rounds_min``, a cell of N peers starts no new
    round after N times this."""
    phase_seconds_max: float
    """A client starts no new operation of a phase after this long (it always does one)."""

    def ops_per_client(self, size_bytes: int, clients: int) -> int:
        """Objects per client per round: bounded by count and by the round's bytes."""
        return max(1, min(self.ops_per_phase_max, self.round_bytes_max // (size_bytes * clients)))

    def live_bytes_max(self) -> int:
        """Most bytes alive at once in any cell (what a peer must be able to hold)."""
        return max(
            self.ops_per_client(size, clients) * size * clients
            for size in self.sizes_bytes
            for clients in self.clients
        )

    def cells_per_peer(self) -> int:
        """Figure cells (one per op) each peer contributes."""
        return 2 * (len(self.sizes_bytes) * len(self.clients) + len(self.batch_clients))

    def round_bounds(self) -> RoundBounds:
        """The interleaved rounds of one cell."""
        return RoundBounds(
            warmup_rounds=self.warmup_rounds, rounds_min=self.rounds_min,
            rounds_max=self.rounds_max, seconds_per_peer=self.cell_seconds,
        )


QUICK = Plan(
    mode="quick",
    sizes_bytes=(1 * KiB, 1 * MiB),
    clients=(1, 4),
    batch_size_bytes=1 * KiB,
    batch_ops=100,
    batch_clients=(1,),
    ops_per_phase_max=200,
    round_bytes_max=16 * MiB,
    warmup_rounds=1,
    rounds_min=3,
    rounds_max=3,
    cell_seconds=0.3,
    phase_seconds_max=0.5,
)

FULL = Plan(
    mode="full",
    sizes_bytes=(1 * KiB, 64 * KiB, 1 * MiB, 64 * MiB),
    clients=(1, 2, 4, 8, 16),
    batch_size_bytes=1 * KiB,
    batch_ops=100,
    batch_clients=(1, 4),
    ops_per_phase_max=1000,
    round_bytes_max=64 * MiB,
    warmup_rounds=2,
    rounds_min=5,
    rounds_max=20,
    cell_seconds=2.0,
    phase_seconds_max=5.0,
)


# -- cells --------------------------------------------------------------------------------------


def run_cell(
    pool_holder: list[ClientPool],
    peers: Sequence[Peer],
    plan: Plan,
    *,
    size_bytes: int,
    clients: int,
    batched: bool,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Measure every peer at one object size and client count, in interleaved rounds.

    Returns one record per peer and op (put, get), each figure the median over the measured
    rounds with its spread and per-round values, and the cell's schedule (the order the peers
    ran in, round by round, warm-ups first). A peer whose round fails gets error records and
    leaves the cell; ``pool_holder[0]`` is replaced if the failure broke the client pool.
    """
    mode = "batch" if batched else "single"
    if batched:
        per_client = plan.batch_ops * max(1, plan.ops_per_phase_max // plan.batch_ops)
        phases = ((PUT_MANY, "put"), (GET_MANY, "get"))
    else:
        per_client = plan.ops_per_client(size_bytes, clients)
        phases = ((PUT, "put"), (GET, "get"))
    cell_id = f"{mode}-{size_bytes}-{clients}"
    by_name = {peer.name: peer for peer in peers}

    def one_round(name: str, index: int, warmup: bool) -> dict[str, list[PhaseResult]]:
        pool = pool_holder[0]
        spec = by_name[name].spec()
        prefixes, keys = zip(
            *(round_keys(cell_id, index, c, per_client) for c in range(clients)), strict=True
        )
        todo: Sequence[Sequence[str]] = keys
        phase_results: dict[str, list[PhaseResult]] = {}
        try:
            for phase, _ in phases:
                results = pool.run(
                    spec, phase, prefixes=prefixes, keys=todo, size_bytes=size_bytes,
                    batch_ops=plan.batch_ops, seconds_max=plan.phase_seconds_max,
                )
                phase_results[phase] = results
                # The GET phase reads what the PUT phase stored before its time ran out.
                todo = [done[: r.ops] for done, r in zip(todo, results, strict=True)]
        finally:
            # Also after a failed phase, so that the next round finds the peer empty.
            if not pool.broken:
                pool.run(spec, DELETE, prefixes=prefixes, keys=keys, size_bytes=size_bytes)
        return phase_results

    def describe(name: str, exc: Exception) -> str:
        message = exc.args[0] if isinstance(exc, PhaseError) else traceback.format_exc()
        if pool_holder[0].broken:
            size = pool_holder[0].size
            pool_holder[0].close()
            pool_holder[0] = ClientPool(size).start()
        return str(message)

    outcome = interleave(list(by_name), one_round, plan.round_bounds(), describe=describe)
    records: list[dict[str, Any]] = []
    for name in by_name:
        base = {"peer": name, "mode": mode, "size_bytes": size_bytes, "clients": clients}
        if name in outcome.errors:
            records += [{**base, "op": op, "error": outcome.errors[name]} for _, op in phases]
            continue
        for phase, op in phases:
            rounds = [r[phase] for r in outcome.rounds[name]]
            record = {
                **base, "op": op, "batch_ops": plan.batch_ops if batched else 1,
                "warmup_rounds": plan.warmup_rounds, **cell_figures(rounds),
            }
            if not batched and clients == 1 and size_bytes == CDF_SIZE_BYTES:
                record["cdf_us"] = cdf_points(combine(rounds).latencies_ns)
            records.append(record)
    schedule = {"cell": cell_id, "warmup_rounds": plan.warmup_rounds, "orders": outcome.orders}
    return records, schedule


def cell_figures(rounds: Sequence[Sequence[PhaseResult]]) -> dict[str, Any]:
    """The figures of one peer's phase over the measured rounds of a cell.

    Each of :data:`~benchmarks.workloads.ROUND_FIGURES` is the median over the rounds, with
    ``spread`` (min, quartiles, max) and ``per_round`` (in round order, for paired ratios);
    ``ops``, ``bytes`` and ``wall_s`` are totals, ``latency_pooled_us`` the percentiles of every
    measured operation together.
    """
    per_round = [round_figures(r) for r in rounds]
    values = {name: [f[name] for f in per_round] for name in ROUND_FIGURES}
    spreads = {name: spread(values[name]) for name in ROUND_FIGURES}
    pooled = combine(rounds)
    return {
        "rounds": len(per_round),
        "ops": pooled.ops,
        "bytes": pooled.bytes,
        "wall_s": pooled.wall_s,
        **{name: spreads[name]["median"] for name in ROUND_FIGURES},
        "spread": spreads,
        "per_round": values,
        "latency_pooled_us": pooled.latency,
    }


def cell_grid(plan: Plan) -> list[tuple[int, int, bool]]:
    """``(size_bytes, clients, batched)`` of every cell, in the order they run."""
    grid = [(size, clients, False) for size in plan.sizes_bytes for clients in plan.clients]
    grid += [(plan.batch_size_bytes, clients, True) for clients in plan.batch_clients]
    return grid


def _describe(cell: dict[str, Any]) -> str:
    where = f"{cell['peer']} {cell['op']}"
    if "error" in cell:
        return f"{where}: FAILED ({str(cell['error']).strip().splitlines()[-1]})"
    if cell["size_bytes"] <= 64 * KiB:
        return f"{where} p50 {cell['p50_us']:.0f} us"
    return f"{where} {cell['gb_per_s']:.2f} GB/s"


# -- the run ------------------------------------------------------------------------------------


def _make_peers(
    names: Sequence[str], stack: ExitStack, plan: Plan, cluster: Any = None
) -> list[tuple[str, Callable[[], Peer]]]:
    """Factories of the peers to run, in order.

    The pocketflow peers use ``cluster`` if given, else a local cluster (sized for the plan's
    live bytes) started here, before any peer, and stopped with ``stack``.
    """
    cluster_box: list[Any] = [] if cluster is None else [cluster]

    def pocketflow_cluster() -> Any:
        if not cluster_box:
            from pocketflow.cluster import LocalCluster

            capacity = max(256 * MiB, plan.live_bytes_max() + 128 * MiB)
            started = LocalCluster(
                dram_servers=2, nvme_servers=1, dram_capacity=capacity,
                nvme_capacity=2 * capacity, num_cpus=2,
            )
            stack.callback(started.stop)
            started.start()
            cluster_box.append(started)
        return cluster_box[0]

    object_max_bytes = max(plan.sizes_bytes)
    factories: dict[str, Callable[[], Peer]] = {
        "tcp": lambda: TcpPeer(object_max_bytes=object_max_bytes),
        "tcp-native": lambda: NativeTcpPeer(object_max_bytes=object_max_bytes),
        "redis": RedisPeer,
        "s3": S3Peer,
        "pocketflow-dram": lambda: PocketflowPeer(pocketflow_cluster(), tier="dram"),
        "pocketflow-nvme": lambda: PocketflowPeer(pocketflow_cluster(), tier="nvme"),
        "pocketflow-dram-plain": lambda: StandalonePocketflowPeer(
            tls=False, capacity_bytes=plan.live_bytes_max() + 128 * MiB
        ),
        "pocketflow-dram-tls": lambda: StandalonePocketflowPeer(
            tls=True, capacity_bytes=plan.live_bytes_max() + 128 * MiB
        ),
    }
    if {"pocketflow-dram", "pocketflow-nvme"} & set(names):
        pocketflow_cluster()
    return [(name, factories[name]) for name in names]


def run(
    plan: Plan,
    peer_names: Sequence[str],
    log: Callable[[str], None],
    *,
    cluster: Any = None,
) -> dict[str, Any]:
    """Run the plan against the peers and return the result (not yet written).

    ``cluster`` is a running :class:`pocketflow.LocalCluster` to use for the pocketflow peers
    (the test suite's); without it the run starts and stops its own.
    """
    began = time.monotonic()
    result: dict[str, Any] = {
        "schema": 2,
        "mode": plan.mode,
        "date": machine.now_iso(),
        "commit": machine.git_commit(),
        "machine": machine.machine(),
        "versions": {},
        "plan": {
            **dataclasses.asdict(plan),
            "peers": list(peer_names),
            "cells_planned": plan.cells_per_peer() * len(peer_names),
            "live_bytes_max": plan.live_bytes_max(),
        },
        "peers": {},
        "cells": [],
        "schedule": [],
    }
    with ExitStack() as stack:
        pool_size = max(plan.clients + plan.batch_clients)
        pool_holder = [ClientPool(pool_size).start()]
        stack.callback(lambda: pool_holder[0].close())
        log(f"{pool_size} client processes: pids {pool_holder[0].pids()}")
        started: list[Peer] = []
        infos: dict[str, dict[str, Any]] = {}
        for name, factory in _make_peers(peer_names, stack, plan, cluster):
            t0 = time.monotonic()
            peer: Peer | None = None
            try:
                peer = factory()
                stack.callback(peer.stop)
                peer.start()
            except Exception as exc:  # noqa: BLE001 - a peer that cannot start is recorded
                result["peers"][name] = {"error": f"did not start: {exc}"}
                log(f"{name}: did not start: {exc}")
                if peer is not None:
                    peer.stop()
                continue
            infos[name] = {"startup_s": time.monotonic() - t0}
            log(f"{name}: started in {infos[name]['startup_s']:.1f} s")
            started.append(peer)
        for size_bytes, clients, batched in cell_grid(plan) if started else ():
            t0 = time.monotonic()
            cell, schedule = run_cell(
                pool_holder, started, plan, size_bytes=size_bytes, clients=clients,
                batched=batched,
            )
            result["cells"] += cell
            result["schedule"].append(schedule)
            log(f"{'batch' if batched else 'single'} {size_bytes} B x{clients}: "
                + "; ".join(_describe(c) for c in cell) + f"  ({time.monotonic() - t0:.1f} s)")
        for peer in started:
            result["peers"][peer.name] = {**peer.info(), **infos[peer.name]}
            if not pool_holder[0].broken:
                pool_holder[0].forget(peer.spec())
    result["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    result["versions"] = _versions(result["peers"])
    result["ratios"] = report.ratios(result)
    result["loopback_limit"] = report.loopback_fractions(result)
    result["elapsed_s"] = time.monotonic() - began
    return result


def narrowed(plan: Plan, *, sizes: str | None, clients: str | None) -> Plan:
    """``plan`` with only the single cells of ``sizes`` and ``clients`` (comma-separated; each
    ``None`` keeps the plan's) and no batch cells; ``plan`` itself when both are ``None``. A
    narrowed run is named ``<mode>-cells``, so it never replaces a full run's LATEST.md."""
    if sizes is None and clients is None:
        return plan
    from pocketflow.config import parse_size
    from pocketflow.errors import ConfigError

    try:
        sizes_bytes = (plan.sizes_bytes if sizes is None else
                       tuple(parse_size(s.strip(), name="--sizes") for s in sizes.split(",")))
        counts = (plan.clients if clients is None else
                  tuple(int(c) for c in clients.split(",")))
    except (ConfigError, ValueError) as exc:
        raise ValueError(f"bad --sizes or --clients: {exc}") from exc
    if not sizes_bytes or min(sizes_bytes) <= 0 or not counts or min(counts) <= 0:
        raise ValueError("--sizes and --clients take positive values")
    return dataclasses.replace(
        plan, mode=f"{plan.mode}-cells", sizes_bytes=sizes_bytes, clients=counts,
        batch_clients=(), round_bytes_max=max(plan.round_bytes_max, max(sizes_bytes)),
    )


def _versions(peers: dict[str, Any]) -> dict[str, str | None]:
    versions: dict[str, str | None] = {"pocketflow": pocketflow_version()}
    for name in ("redis", "s3"):
        if name in peers and peers[name].get("version"):
            versions["redis-server" if name == "redis" else "seaweedfs"] = peers[name]["version"]
    if "s3" not in peers and weed_binary() is None:
        versions["seaweedfs"] = None
    versions.update(machine.package_versions(
        ("pyarrow", "redis", "hiredis", "boto3", "ray", "numpy", "matplotlib")
    ))
    versions["redis-py"] = versions.pop("redis")
    return versions


def write(result: dict[str, Any], out_dir: Path, *, plots: bool = True) -> list[Path]:
    """Write JSON, plots and the Markdown summary; a full run also refreshes LATEST.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{machine.today()}-{result['mode']}"
    result["plots"] = [str(p.name) for p in report.plot(result, stem)] if plots else []
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md")]
    report.write_json(result, paths[0])
    paths[1].write_text(report.summary_markdown(result))
    if result["mode"] == "full":
        latest = out_dir / "LATEST.md"
        shutil.copyfile(paths[1], latest)
        paths.append(latest)
    return paths + [out_dir / p for p in result["plots"]]


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``python -m benchmarks.compare``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare",
        description="Compare pocketflow with Redis, S3 (SeaweedFS) and raw TCP on this machine.",
    )
    add_arguments(parser)
    return parser


def main_from_args(args: argparse.Namespace) -> int:
    """Run with parsed :func:`add_arguments` options; returns the exit status."""
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    known = (*PEER_NAMES, *TLS_PEER_NAMES)
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        print(f"unknown peers {unknown}; choose from {', '.join(known)}", file=sys.stderr)
        return 2
    plan = QUICK if args.mode == "quick" else FULL
    try:
        plan = narrowed(plan, sizes=getattr(args, "sizes", None),
                        clients=getattr(args, "clients", None))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if getattr(args, "tls", False):
        names += [n for n in TLS_PEER_NAMES if n not in names]
        # What TLS costs is asked at 1 KiB, 1 MiB and 64 MiB.
        plan = dataclasses.replace(
            plan, sizes_bytes=tuple(sorted({*plan.sizes_bytes, 64 * MiB})),
            round_bytes_max=max(plan.round_bytes_max, 64 * MiB),
        )

    def log(line: str) -> None:
        print(line, flush=True)

    log(f"{plan.mode} run: peers {', '.join(names)}")
    result = run(plan, names, log)
    for path in write(result, args.out, plots=not args.no_plots):
        log(f"wrote {path}")
    problems = report.figure_problems(result)
    for problem in problems:
        log(f"MISSING: {problem}")
    log(f"done in {result['elapsed_s']:.0f} s")
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.compare``; returns the exit status."""
    return main_from_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
