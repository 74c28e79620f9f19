"""The adapter's exceptions: one hierarchy, so a caller catches exactly what it can handle."""

from __future__ import annotations

__all__ = [
    "PipelineError",
    "PipelineDefinitionError",
    "InputLost",
    "InputTimeout",
    "StageFailed",
]


class PipelineError(Exception):
    """Base class of every error this adapter raises."""


class PipelineDefinitionError(PipelineError, TypeError):
    """A stage or pipeline was declared wrongly (bad decorator arguments, not a chain)."""


class InputLost(PipelineError):
    """A task's input is gone: consumed by an earlier attempt (DELETE-on-read) or held by a
    storage server that died. The driver regenerates it from the item's first input.

    ``args`` is ``(message, server)``; ``server`` is the unreachable server's address or
    ``None``. Plain ``args`` keep it picklable across Ray and Lithops workers.
    """

    def __init__(self, message: str, server: str | None = None) -> None:
        super().__init__(message, server)

    @property
    def server(self) -> str | None:
        return self.args[1]

    def __str__(self) -> str:
        return str(self.args[0])


class InputTimeout(PipelineError):
    """A task's input did not appear within the run's ``input_wait_s``."""


class StageFailed(PipelineError):
    """A stage task kept failing after its retries (or an item after its regenerations)."""
