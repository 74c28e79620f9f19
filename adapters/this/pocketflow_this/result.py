"""What a pipeline run returns (built by the driver, returned by ``Pipeline.run``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["PipelineResult"]


@dataclass
class PipelineResult:
    """What a run returns. ``outputs`` holds the last stage's values in input order; the
    outcomes are the successful tasks' timings (every attempt that finished)."""

    outputs: list[Any]
    outcomes: list[Any]
    elapsed_s: float
    started_unix_s: float
    executor: str
    exchange: str
    job_id: str | None
    hints: dict[str, Any] | None
    delete_intermediates: bool
    retried: list[tuple[int, int]] = field(default_factory=list)
    regenerated: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    handle_json: str | None = None
    """The job's handle at the end (pocketflow runs): reads the PERSIST results later."""
