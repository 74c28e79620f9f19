"""One stage task, as it runs in a worker (a Ray task or a Lithops function): wait for the
input, read it (with DELETE when it has one consumer), run the stage, write the output (with
PERSIST when it is the pipeline's result). Only a small :class:`TaskOutcome` goes back to the
driver; the values themselves never do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pocketflow_this.codec import decode, encode
from pocketflow_this.errors import InputLost, InputTimeout
from pocketflow_this.exchange import Exchange, client_for

__all__ = ["TaskCall", "TaskOutcome", "run_task", "value_key", "value_prefix"]

WAIT_SLICE_S = 2.0
"""Longest single wait for an input; between slices the task gives up early if the run ended."""


def value_prefix(*, stage: int, item: int) -> str:
    """The prefix the value of stage ``stage`` for item ``item`` lives under (a prefix lease
    scopes it when the run asks for one: :class:`pocketflow_this.driver.Scope`)."""
    return f"s{stage:02d}/i{item:06d}"


def value_key(*, stage: int, item: int) -> str:
    """Key of the value stage ``stage`` writes for item ``item``."""
    return f"{value_prefix(stage=stage, item=item)}/v"


@dataclass(frozen=True)
class TaskCall:
    """What a worker needs to run stage ``stage`` on item ``item``."""

    exchange: Exchange
    function: Callable[[Any], Any]
    stage: int
    item: int
    attempt: int
    value: Any  # the item's input, for the first stage only
    read_delete: bool
    write_persist: bool
    upstream_done: bool
    input_wait_s: float
    overwrite: bool = False  # a rerun replaces what an earlier attempt may have left


@dataclass(frozen=True)
class TaskOutcome:
    """What a finished task reports: where its time went and how many bytes it moved."""

    stage: int
    item: int
    attempt: int
    started_unix_s: float
    input_ready_unix_s: float
    read_done_unix_s: float
    write_start_unix_s: float
    finished_unix_s: float
    wait_s: float
    read_s: float
    compute_s: float
    write_s: float
    bytes_read: int
    bytes_written: int
    written: bool  # False when a rerun found its output already there

    @property
    def io_s(self) -> float:
        """Storage I/O time of the task: reading its input and writing its output."""
        return self.read_s + self.write_s


def run_task(call: TaskCall) -> TaskOutcome:
    """Run one stage task (see the module doc). Raises :class:`InputLost` when the input is
    gone, :class:`InputTimeout` when it never came, and whatever the stage raises."""
    started = time.time()
    client = client_for(call.exchange)
    bytes_read = 0
    wait_s = read_s = 0.0
    input_ready = read_done = started
    if call.stage == 0:
        value = call.value
    else:
        key = value_key(stage=call.stage - 1, item=call.item)
        t0 = time.perf_counter()
        if call.upstream_done:
            # The input was written before this task was submitted: no waiting. Missing means
            # an earlier attempt consumed it, or it died with a server.
            ready = client.wait(key, 0.0)
        else:
            deadline = time.monotonic() + call.input_wait_s
            ready = False
            while not ready and time.monotonic() < deadline:
                ready = client.wait(key, max(0.0, min(WAIT_SLICE_S,
                                                      deadline - time.monotonic())))
            if not ready:
                raise InputTimeout(f"{key} did not appear within {call.input_wait_s:.0f} s")
        if not ready:
            raise InputLost(f"{key} is gone (read by an earlier attempt, or lost)")
        wait_s = time.perf_counter() - t0
        input_ready = time.time()
        t0 = time.perf_counter()
        data = client.get(key, delete=call.read_delete)
        read_s = time.perf_counter() - t0
        read_done = time.time()
        bytes_read = len(data)
        value = decode(data)
    t0 = time.perf_counter()
    result = call.function(value)
    compute_s = time.perf_counter() - t0
    payload = encode(result)
    del value, result
    write_start = time.time()
    t0 = time.perf_counter()
    written = client.put(value_key(stage=call.stage, item=call.item), payload,
                         persist=call.write_persist, overwrite=call.overwrite)
    write_s = time.perf_counter() - t0
    return TaskOutcome(
        stage=call.stage, item=call.item, attempt=call.attempt, started_unix_s=started,
        input_ready_unix_s=input_ready, read_done_unix_s=read_done,
        write_start_unix_s=write_start, finished_unix_s=time.time(), wait_s=wait_s,
        read_s=read_s, compute_s=compute_s, write_s=write_s, bytes_read=bytes_read,
        bytes_written=len(payload), written=written,
    )
