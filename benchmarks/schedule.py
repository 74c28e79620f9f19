"""Interleaved rounds: how the benchmarks give every peer the same machine.

Each peer (any subject of a comparison: a storage system, a sort engine) runs one round at a
time, peers taking turns within every round, so a slow minute of a shared machine falls on all
of them instead of on whichever peer's series ran then; the order rotates from round to round,
so no peer always runs right after another. The first rounds are warm-ups, run by every peer and
discarded (a server's first touch of fresh memory, connections, caches). Then measured rounds
until at least ``rounds_min`` and, within the time budget, at most ``rounds_max``. A peer whose
round raises is recorded as failed and leaves the remaining rounds; the others go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RoundBounds:
    """How many rounds, and how long."""

    warmup_rounds: int
    """Rounds each peer runs first, discarded."""
    rounds_min: int
    """Measured rounds each peer runs whatever the time (unless it fails)."""
    rounds_max: int
    """Measured rounds at most."""
    seconds_per_peer: float
    """No measured round past ``rounds_min`` starts once this, times the number of peers, has
    passed since the first round started."""

    def __post_init__(self) -> None:
        if self.warmup_rounds < 0 or not 1 <= self.rounds_min <= self.rounds_max:
            raise ValueError(f"bad round bounds {self!r}")


@dataclass
class Interleaved(Generic[T]):
    """What :func:`interleave` returns: each peer's measured rounds in order, and failures."""

    rounds: dict[str, list[T]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    """The peers whose round raised, with the message :func:`interleave`'s ``describe`` made."""
    orders: list[list[str]] = field(default_factory=list)
    """The order the peers ran in, per round (warm-ups first)."""


def rotated(peers: Sequence[str], round_index: int) -> list[str]:
    """``peers`` starting at ``round_index`` modulo their number."""
    if not peers:
        return []
    shift = round_index % len(peers)
    return [*peers[shift:], *peers[:shift]]


def interleave(
    peers: Sequence[str],
    run_round: Callable[[str, int, bool], T],
    bounds: RoundBounds,
    *,
    describe: Callable[[str, Exception], str] = lambda peer, exc: f"{type(exc).__name__}: {exc}",
    clock: Callable[[], float] = time.monotonic,
) -> Interleaved[T]:
    """Run ``run_round(peer, round_index, warmup)`` for every peer, round by round.

    ``round_index`` counts from 0 over warm-ups and measured rounds alike, so a round's keys or
    files can be named by it. ``describe`` turns a round's exception into the peer's error (and
    is where a caller repairs what the failure broke).
    """
    if len(set(peers)) != len(peers):
        raise ValueError(f"peers named twice: {list(peers)}")
    out: Interleaved[T] = Interleaved(rounds={peer: [] for peer in peers})
    live = list(peers)
    started = clock()
    budget_s = bounds.seconds_per_peer * len(peers)
    index = 0
    measured = 0
    while live and measured < bounds.rounds_max:
        warmup = index < bounds.warmup_rounds
        if not warmup and measured >= bounds.rounds_min and clock() - started >= budget_s:
            break
        order = rotated(live, index)
        out.orders.append(order)
        for peer in order:
            try:
                result = run_round(peer, index, warmup)
            except Exception as exc:  # noqa: BLE001 - one failing peer must not end the others
                out.errors[peer] = describe(peer, exc)
                live.remove(peer)
                continue
            if not warmup:
                out.rounds[peer].append(result)
        index += 1
        measured += 0 if warmup else 1
    for peer in out.errors:
        out.rounds.pop(peer, None)
    return out
