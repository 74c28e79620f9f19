"""The worker's process handling: a thunk's function runs at the lowest CPU priority, the
worker process itself does not."""

from __future__ import annotations

import os

from pocketflow_gg.worker import FUNCTION_NICENESS, _run_function


def test_a_function_runs_at_the_thunk_niceness_and_the_worker_keeps_its_own() -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    result = _run_function(["sh", "-c", "cut -d' ' -f19 /proc/self/stat"], capture_output=True,
                           text=True, check=True, timeout=30)
    assert int(result.stdout) == max(before, FUNCTION_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
