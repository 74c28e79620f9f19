"""``@stage``: a plain function becomes a pipeline stage with what the adapter needs to know
about it (how many tasks of it may run at once, whether it is latency-sensitive, how big its
output is). Called on a real value it is still the plain function; called inside a
``@pipeline`` body it records where its input comes from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pocketflow_this.errors import PipelineDefinitionError

__all__ = ["Stage", "stage", "Traced", "CONCURRENCY_MAX"]

CONCURRENCY_MAX = 1024
"""Most tasks of one stage that may run at once."""

OutputBytes = int | Callable[[Any], int] | None


@dataclass(frozen=True)
class Stage:
    """A pipeline stage: ``function`` and how it runs.

    - ``concurrency``: most tasks of this stage running at once (a Pocket hint).
    - ``latency_sensitive``: its data belongs in DRAM (a Pocket hint; the job is
      latency-sensitive if any stage is).
    - ``output_bytes``: size of one task's output, as bytes or a function of the pipeline's input
      item; it sizes the job's ``data_size_bytes`` hint.
    - ``retries``: how many times a failed task of this stage is submitted again.
    """

    function: Callable[[Any], Any]
    name: str
    concurrency: int = 1
    latency_sensitive: bool = True
    output_bytes: OutputBytes = None
    retries: int = 2

    def __post_init__(self) -> None:
        if not callable(self.function):
            raise PipelineDefinitionError(f"stage function must be callable, got "
                                          f"{type(self.function).__name__}")
        c = self.concurrency
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= CONCURRENCY_MAX:
            raise PipelineDefinitionError(
                f"stage {self.name}: concurrency must be an int in 1..{CONCURRENCY_MAX}, got {c!r}")
        if not isinstance(self.latency_sensitive, bool):
            raise PipelineDefinitionError(
                f"stage {self.name}: latency_sensitive must be a bool, got "
                f"{self.latency_sensitive!r}")
        r = self.retries
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= 16:
            raise PipelineDefinitionError(
                f"stage {self.name}: retries must be an int in 0..16, got {r!r}")
        ob = self.output_bytes
        if ob is not None and not callable(ob) and (
                isinstance(ob, bool) or not isinstance(ob, int) or ob < 0):
            raise PipelineDefinitionError(
                f"stage {self.name}: output_bytes must be bytes >= 0 or a function of the "
                f"item, got {ob!r}")

    def output_bytes_for(self, item: Any) -> int | None:
        """This stage's output size for input item ``item``, if the stage declares it."""
        ob = self.output_bytes
        if ob is None:
            return None
        size = ob(item) if callable(ob) else ob
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise PipelineDefinitionError(
                f"stage {self.name}: output_bytes({item!r}) returned {size!r}, not bytes >= 0")
        return size

    def __call__(self, value: Any) -> Any:
        if isinstance(value, Traced):
            return value.then(self)
        return self.function(value)


def stage(
    function: Callable[[Any], Any] | None = None,
    *,
    concurrency: int = 1,
    latency_sensitive: bool = True,
    output_bytes: OutputBytes = None,
    retries: int = 2,
    name: str | None = None,
) -> Any:
    """Declare a stage: ``@stage`` or ``@stage(concurrency=4, latency_sensitive=True)``."""

    def wrap(fn: Callable[[Any], Any]) -> Stage:
        return Stage(fn, name or getattr(fn, "__name__", "stage"), concurrency,
                     latency_sensitive, output_bytes, retries)

    if function is not None:
        return wrap(function)
    return wrap


class Traced:
    """The symbolic value a ``@pipeline`` body passes to its stages: it records the chain."""

    def __init__(self, chain: tuple[Stage, ...] = ()) -> None:
        self.chain = chain
        self._consumer: Stage | None = None

    def then(self, next_stage: Stage) -> Traced:
        if self._consumer is not None:
            what = self.chain[-1].name if self.chain else "the pipeline's input"
            raise PipelineDefinitionError(
                f"{what} is consumed by both {self._consumer.name} and {next_stage.name}: "
                "pipelines are chains (one consumer per value)")
        self._consumer = next_stage
        return Traced(self.chain + (next_stage,))
