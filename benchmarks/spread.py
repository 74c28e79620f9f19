"""Median and spread over rounds: how every repeated figure of the benchmarks is reported.

A figure measured in several rounds (a throughput, a p50) is reported as the median of the
rounds, with its spread: the lowest and highest round, and the quartiles. Two peers measured in
the same interleaved rounds (:mod:`benchmarks.schedule`) are compared round by round: the ratio
of each round pair, then the median and spread of those ratios, so a drift of the machine during
the run moves both sides of a pair alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

SPREAD_FIELDS = ("min", "q1", "median", "q3", "max")
"""What :func:`spread` returns, lowest first (q1 and q3: the 25th and 75th percentiles)."""


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles (linear interpolation), lowest and highest of ``values``."""
    if len(values) == 0:
        raise ValueError("no rounds to summarize")
    array = np.asarray(values, dtype=np.float64)
    q1, median, q3 = np.percentile(array, [25, 50, 75])
    return {
        "min": float(array.min()), "q1": float(q1), "median": float(median), "q3": float(q3),
        "max": float(array.max()),
    }


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """``numerators[i] / denominators[i]`` for each round both have (the shorter list rules)."""
    return [a / b for a, b in zip(numerators, denominators, strict=False)]


def spread_problems(summary: object, *, median: float | None = None) -> list[str]:
    """Why ``summary`` is not a valid :func:`spread` (empty when it is): every field present,
    finite and above zero, in order, and its median equal to ``median`` if given."""
    if not isinstance(summary, dict):
        return [f"no spread ({summary!r})"]
    values = [summary.get(name) for name in SPREAD_FIELDS]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values):
        return [f"spread fields not all finite and above zero: {summary!r}"]
    problems = []
    if any(a > b * (1 + 1e-9) for a, b in zip(values, values[1:], strict=False)):
        problems.append(f"spread out of order: {summary!r}")
    if median is not None and not math.isclose(summary["median"], median, rel_tol=1e-9):
        problems.append(f"median {summary['median']!r} is not the figure {median!r}")
    return problems


def format_spread(summary: dict[str, float], digits: int = 3) -> str:
    """``median [min–max]`` with ``digits`` significant digits (thousands without decimals)."""
    def fmt(value: float) -> str:
        return f"{value:,.0f}" if value >= 1000 else f"{value:.{digits}g}"

    return f"{fmt(summary['median'])} [{fmt(summary['min'])}–{fmt(summary['max'])}]"
