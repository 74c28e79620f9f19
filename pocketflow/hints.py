"""Job hints: what a job tells the control plane about itself when it registers (Pocket's hints;
:mod:`pocketflow.control.hints` turns them into a demand)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pocketflow.config import parse_size

__all__ = ["Hints", "MAX_CONCURRENT_TASKS_MAX"]

MAX_CONCURRENT_TASKS_MAX = 1_000_000
"""Largest ``max_concurrent_tasks`` hint accepted."""


@dataclass(frozen=True)
class Hints:
    """What a job tells the control plane about itself when it registers (Pocket's hints).

    Sizes accept bytes or strings with units (``"1GiB"``, ``"200 MB"``); throughput is bytes per
    second and accepts the same forms. ``None`` means "unknown".

    - ``latency_sensitive``: True (default) puts data in DRAM first and adds NVMe only when the
      data does not fit; False keeps the job's data out of DRAM.
    - ``max_concurrent_tasks``: how many tasks read or write at once.
    - ``data_size_bytes``: the job's expected peak of live data.
    - ``peak_throughput_bytes_per_s``: the job's expected peak aggregate throughput.
    """

    latency_sensitive: bool = True
    max_concurrent_tasks: int | None = None
    data_size_bytes: int | None = None
    peak_throughput_bytes_per_s: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.latency_sensitive, bool):
            raise TypeError(f"latency_sensitive must be a bool, got {self.latency_sensitive!r}")
        tasks = self.max_concurrent_tasks
        if tasks is not None:
            if isinstance(tasks, bool) or not isinstance(tasks, int):
                raise TypeError(f"max_concurrent_tasks must be an int, got {tasks!r}")
            if not 1 <= tasks <= MAX_CONCURRENT_TASKS_MAX:
                raise ValueError(
                    f"max_concurrent_tasks must be in 1..{MAX_CONCURRENT_TASKS_MAX}, got {tasks}"
                )
        for name in ("data_size_bytes", "peak_throughput_bytes_per_s"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, parse_size(value, name=name))

    @classmethod
    def coerce(cls, hints: Hints | Mapping[str, Any] | None) -> Hints:
        """Accept ``Hints``, a mapping of its fields, or ``None`` (all defaults)."""
        if hints is None:
            return cls()
        if isinstance(hints, Hints):
            return hints
        if isinstance(hints, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(hints) - known)
            if unknown:
                raise ValueError(
                    f"unknown hint(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
                )
            return cls(**hints)
        raise TypeError(f"hints must be Hints, a dict or None, not {type(hints).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """The hints as a JSON-compatible dict (what the controller receives)."""
        return dataclasses.asdict(self)
