"""Backoff between the retries of one failing call: exponential, capped, and jittered, so that
many clients that failed at the same moment (a server that hung, then answered again) do not
retry in step."""

from __future__ import annotations

import random

__all__ = ["backoff_s"]

_jitter = random.Random()
"""A generator of its own: a program that seeds the global one does not align our retries."""


def backoff_s(attempt: int, *, base_s: float, cap_s: float) -> float:
    """How long to wait before retry ``attempt`` (0 for the first retry): ``base_s * 2**attempt``
    capped at ``cap_s``, then drawn uniformly from its upper half."""
    if attempt < 0 or base_s < 0 or cap_s < 0:
        raise ValueError("attempt, base_s and cap_s must be >= 0")
    ceiling = min(cap_s, base_s * 2.0 ** min(attempt, 62))
    return _jitter.uniform(ceiling / 2, ceiling)
