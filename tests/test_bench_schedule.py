"""The benchmarks' rules for repeated figures: interleaved rounds with discarded warm-ups
(``benchmarks/schedule.py``), medians with their spread and round-by-round ratios
(``benchmarks/spread.py``, ``benchmarks/report.py``). Pure code: no server, no timing."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import report  # noqa: E402
from benchmarks.compare import cell_figures  # noqa: E402
from benchmarks.schedule import RoundBounds, interleave, rotated  # noqa: E402
from benchmarks.spread import format_spread, paired_ratios, spread, spread_problems  # noqa: E402
from benchmarks.workloads import PhaseResult  # noqa: E402


class _Clock:
    """A clock the test moves: each round of a peer takes ``step_s``."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _bounds(**changes: Any) -> RoundBounds:
    base = {"warmup_rounds": 2, "rounds_min": 3, "rounds_max": 5, "seconds_per_peer": 10.0}
    return RoundBounds(**{**base, **changes})


def test_every_peer_runs_every_round_in_rotating_order_and_warmups_are_discarded() -> None:
    calls: list[tuple[str, int, bool]] = []

    def run_round(peer: str, index: int, warmup: bool) -> int:
        calls.append((peer, index, warmup))
        return index

    out = interleave(["a", "b", "c"], run_round, _bounds(rounds_max=3))
    assert out.orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"],
                          ["b", "c", "a"]]
    # Round by round: no peer's second round before every peer's first.
    assert [index for _, index, _ in calls] == sorted(index for _, index, _ in calls)
    assert [warmup for _, index, warmup in calls if index < 2] == [True] * 6
    assert out.rounds == {"a": [2, 3, 4], "b": [2, 3, 4], "c": [2, 3, 4]}
    assert out.errors == {}


def test_rounds_past_the_minimum_stop_at_the_time_budget() -> None:
    clock = _Clock()

    def run_round(peer: str, index: int, warmup: bool) -> int:
        clock.now_s += 3.0  # two peers, 10 s each: 20 s of budget, 6 s per round
        return index

    out = interleave(["a", "b"], run_round, _bounds(warmup_rounds=1, rounds_min=2,
                                                    rounds_max=50), clock=clock)
    # Rounds start at 0, 6, 12 and 18 s; the one at 24 s does not.
    assert out.rounds == {"a": [1, 2, 3], "b": [1, 2, 3]}

    slow = _Clock()

    def slow_round(peer: str, index: int, warmup: bool) -> int:
        slow.now_s += 100.0
        return index

    out = interleave(["a", "b"], slow_round, _bounds(rounds_min=3), clock=slow)
    assert out.rounds["a"] == [2, 3, 4]  # the minimum is run whatever the time


def test_a_failing_peer_leaves_the_rounds_and_the_others_go_on() -> None:
    def run_round(peer: str, index: int, warmup: bool) -> int:
        if peer == "bad" and index == 3:
            raise ConnectionError("refused")
        return index

    out = interleave(["good", "bad"], run_round, _bounds(rounds_max=4))
    assert out.errors == {"bad": "ConnectionError: refused"}
    assert "bad" not in out.rounds
    assert out.rounds["good"] == [2, 3, 4, 5]
    assert all(order == ["good"] for order in out.orders[4:])


def test_bad_bounds_and_duplicate_peers_are_refused() -> None:
    for bad in ({"rounds_min": 0}, {"rounds_min": 6}, {"warmup_rounds": -1}):
        with pytest.raises(ValueError):
            _bounds(**bad)
    with pytest.raises(ValueError, match="twice"):
        interleave(["a", "a"], lambda *_: 0, _bounds())
    assert rotated([], 3) == []


def test_spread_is_the_median_and_quartiles_of_the_rounds() -> None:
    summary = spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert summary == {"min": 1.0, "q1": 2.0, "median": 3.0, "q3": 4.0, "max": 5.0}
    assert spread([7.0]) == dict.fromkeys(("min", "q1", "median", "q3", "max"), 7.0)
    with pytest.raises(ValueError):
        spread([])
    assert format_spread(summary) == "3 [1–5]"
    assert format_spread(spread([1500.0, 2500.0])) == "2,000 [1,500–2,500]"
    assert paired_ratios([2.0, 9.0, 4.0], [1.0, 3.0]) == [2.0, 3.0]


@pytest.mark.parametrize("bad, reason", [
    (None, "no spread"),
    ({"min": 1.0, "q1": 2.0, "median": 3.0, "q3": 4.0}, "not all finite"),
    ({"min": 1.0, "q1": 2.0, "median": math.nan, "q3": 4.0, "max": 5.0}, "not all finite"),
    ({"min": 3.0, "q1": 2.0, "median": 3.0, "q3": 4.0, "max": 5.0}, "out of order"),
    ({"min": 1.0, "q1": 2.0, "median": 2.5, "q3": 4.0, "max": 5.0}, "is not the figure"),
])
def test_spread_problems_name_what_is_wrong(bad: Any, reason: str) -> None:
    (problem,) = spread_problems(bad, median=3.0)
    assert reason in problem


def _round(ops: int, latency_ns: int, size_bytes: int = 1000) -> list[PhaseResult]:
    """One client's phase: ``ops`` operations of ``latency_ns`` each, back to back."""
    return [PhaseResult(phase="get", ops=ops, bytes=ops * size_bytes, start_ns=0,
                        end_ns=ops * latency_ns, latencies_ns=[latency_ns] * ops)]


def _cell(peer: str, rounds: list[list[PhaseResult]]) -> dict[str, Any]:
    return {"peer": peer, "op": "get", "mode": "single", "size_bytes": 1000, "clients": 1,
            "warmup_rounds": 1, **cell_figures(rounds)}


def test_cell_figures_are_medians_over_rounds_with_their_spread() -> None:
    # Three rounds of 10 ops at 1, 2 and 4 us per op: 1.0, 0.5 and 0.25 GB/s.
    cell = _cell("redis", [_round(10, 1000), _round(10, 4000), _round(10, 2000)])
    assert cell["rounds"] == 3
    assert cell["gb_per_s"] == pytest.approx(0.5)
    assert cell["spread"]["gb_per_s"]["min"] == pytest.approx(0.25)
    assert cell["spread"]["gb_per_s"]["max"] == pytest.approx(1.0)
    assert cell["per_round"]["p50_us"] == pytest.approx([1.0, 4.0, 2.0])
    assert cell["p50_us"] == pytest.approx(2.0)
    assert cell["ops"] == 30 and cell["latency_pooled_us"]["samples"] == 30


def test_ratios_pair_the_rounds_that_ran_back_to_back() -> None:
    # The machine slows down 4x in round 2: a ratio of medians would say 1.0 and 2.0 at random
    # orders; paired, pocketflow is twice as fast in every round.
    pocketflow = _cell("pocketflow-dram", [_round(10, 1000), _round(10, 4000), _round(10, 1000)])
    redis = _cell("redis", [_round(10, 2000), _round(10, 8000), _round(10, 2000)])
    native = _cell("tcp-native", [_round(10, 500), _round(10, 2000), _round(10, 500)])
    result = {"cells": [pocketflow, redis, native], "plan": {"rounds_min": 3, "warmup_rounds": 1}}
    by_peer = {r["peer"]: r for r in report.ratios(result)}
    assert by_peer["redis"]["gb_per_s"] == pytest.approx(2.0)
    assert by_peer["redis"]["spread"]["gb_per_s"]["min"] == pytest.approx(2.0)
    assert by_peer["redis"]["p50_us"] == pytest.approx(0.5)
    assert by_peer["redis"]["pairs"] == 3
    fractions = {f["peer"]: f for f in report.loopback_fractions(result)}
    assert set(fractions) == {"pocketflow-dram", "redis"}
    assert fractions["pocketflow-dram"]["fraction"] == pytest.approx(0.5)
    assert fractions["redis"]["fraction"] == pytest.approx(0.25)
