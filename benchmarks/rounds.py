"""Timed rounds of the pytest-benchmark suite whose every result is checked outside the timing.

A case that only times a call could measure an error path or an empty answer and still print a
fine number. :func:`verified_rounds` runs pytest-benchmark's ``pedantic`` rounds and hands each
round's result to a check before the next round starts (untimed), and fails unless every round,
warm-up included, was checked. :func:`record_figures` adds p50/p99 and throughput to the
benchmark's ``extra_info``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from benchmarks.workloads import GB, summarize_ns

WARMUP_ROUNDS = 2
"""Untimed rounds before the timed ones (still checked)."""

_serial = itertools.count()


def fresh_key(test: str) -> str:
    """A key no other round of this process used.

    Fixed-width numbers: no key is a prefix of another, so deleting a key by prefix is exact.
    """
    return f"pytest-bench/{test}/{next(_serial):09d}"


def verified_rounds(
    benchmark: Any,
    target: Callable[..., Any],
    *,
    prepare: Callable[[], tuple[Any, ...]],
    check: Callable[[tuple[Any, ...], Any], None],
    rounds: int,
) -> None:
    """Time ``target(*prepare())`` for ``rounds`` rounds; ``check(args, result)`` each round.

    ``prepare`` and ``check`` run outside the timed region. The last round is checked after
    pytest-benchmark returns. With benchmarks disabled (``--benchmark-disable``) pytest-benchmark
    runs one round, which is checked the same way.
    """
    pending: list[tuple[tuple[Any, ...], Any]] = []
    checked = [0]

    def check_pending() -> None:
        while pending:
            args, result = pending.pop()
            check(args, result)
            checked[0] += 1

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        check_pending()
        return prepare(), {}

    def timed(*args: Any) -> Any:
        result = target(*args)
        pending.append((args, result))
        return result

    benchmark.pedantic(
        timed, setup=setup, rounds=rounds, iterations=1, warmup_rounds=WARMUP_ROUNDS
    )
    check_pending()
    expected = 1 if benchmark.disabled else rounds + WARMUP_ROUNDS
    assert checked[0] == expected, f"{checked[0]} rounds checked, {expected} run"


def record_figures(benchmark: Any, *, objects_per_round: int, bytes_per_round: int) -> None:
    """Put p50/p99, ops/s (objects per second) and GB/s from the raw round timings into
    ``extra_info``."""
    if benchmark.disabled or benchmark.stats is None:
        return
    seconds = benchmark.stats.stats.data
    summary = summarize_ns([s * 1e9 for s in seconds])
    mean_s = sum(seconds) / len(seconds)
    benchmark.extra_info.update(
        p50_us=summary["p50_us"],
        p99_us=summary["p99_us"],
        ops_per_s=objects_per_round / mean_s,
        gb_per_s=bytes_per_round / mean_s / GB,
    )
