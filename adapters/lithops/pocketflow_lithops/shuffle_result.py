"""What a shuffle gives back to its driver (:class:`ShuffleResult`), whichever layout ran it:
its own module so that the layouts (:mod:`pocketflow_lithops.shuffle`,
:mod:`pocketflow_lithops.append_shuffle`) share it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ShuffleResult"]


@dataclass
class ShuffleResult:
    """Outcome of one shuffle.

    ``outputs[r]`` is reducer ``r``'s :class:`OutputInfo` (with ``persist_output``) or its return
    value; ``map_values[m]`` is mapper ``m``'s return value (of its first successful run).
    ``handle_json`` is the job's handle, with which PERSIST outputs are read after the job is
    gone. ``regenerated`` lists, per round, the ``(mapper, reducer)`` partitions rerun after a
    storage server was lost or a failed reducer attempt had consumed them; ``retried`` names the
    reducer of each resubmission after a failed task. ``input_wait_s`` and ``io_s`` are per
    reducer: time parked waiting for inputs and time reading inputs and writing the output;
    ``reduce_s`` and ``output_write_s``, where the layout measures them (empty otherwise), are
    per reducer too: time in the reduce function and time writing the output (inside ``io_s``);
    ``map_io_s`` is per mapper, time writing its partitions.
    """

    job_id: str
    handle_json: str
    outputs: list[Any]
    map_values: list[Any]
    elapsed_s: float
    map_s: float
    bytes_shuffled: int
    bytes_read: int
    input_wait_s: list[float] = field(default_factory=list)
    io_s: list[float] = field(default_factory=list)
    map_io_s: list[float] = field(default_factory=list)
    reduce_s: list[float] = field(default_factory=list)
    output_write_s: list[float] = field(default_factory=list)
    regenerated: list[list[tuple[int, int]]] = field(default_factory=list)
    retried: list[int] = field(default_factory=list)
