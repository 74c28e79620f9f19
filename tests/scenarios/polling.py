"""Polling with a deadline, shared by the scenario scripts (each imports it from its own folder)."""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_INTERVAL_S = 0.2
"""Pause between two checks of a condition."""


def wait(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Check ``predicate`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(POLL_INTERVAL_S)
    return False
