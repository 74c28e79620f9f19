"""``@pipeline`` / ``Pipeline(...)``: a chain of stages and how to run it through pocketflow.

::

    @stage(concurrency=2, output_bytes=lambda segment: segment.frame_bytes)
    def decode(segment): ...

    @stage(concurrency=2)
    def detect(frames): ...

    @pipeline(name="this")
    def this(segment):
        return detect(decode(segment))

    result = this.run(segments, executor="ray")    # or "lithops"

Running it registers a pocketflow job with hints derived from the stages and the input,
submits the tasks (see :mod:`pocketflow_this.driver`) and deregisters the job at the end, also
when the run fails. Every intermediate value is read once, with DELETE; the last stage's values
are written with PERSIST and read back by the driver into :attr:`PipelineResult.outputs`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from pocketflow_this.driver import run_pipeline
from pocketflow_this.errors import PipelineDefinitionError
from pocketflow_this.result import PipelineResult
from pocketflow_this.stage import Stage, Traced

__all__ = ["Pipeline", "pipeline", "PipelineResult", "Traced", "STAGES_MAX", "ITEMS_MAX"]

STAGES_MAX = 32
"""Most stages in one pipeline."""
ITEMS_MAX = 100_000
"""Most input items of one run."""
INPUT_WAIT_DEFAULT_S = 300.0
"""Default bound on how long a task waits for its input to be written."""
REGENERATIONS_MAX = 3
"""Default bound on how many times one item is regenerated from its input."""


class Pipeline:
    """A chain of :class:`Stage` objects; ``run`` executes it over input items."""

    def __init__(self, stages: Sequence[Stage], *, name: str = "pipeline",
                 items_in_flight_max: int | None = None) -> None:
        stages = tuple(stages)
        if not stages:
            raise PipelineDefinitionError("a pipeline needs at least one stage")
        if len(stages) > STAGES_MAX:
            raise PipelineDefinitionError(f"{len(stages)} stages, more than {STAGES_MAX}")
        for s in stages:
            if not isinstance(s, Stage):
                raise PipelineDefinitionError(
                    f"{s!r} is not a stage; decorate it with @stage")
        if items_in_flight_max is not None and (
                isinstance(items_in_flight_max, bool) or not isinstance(items_in_flight_max, int)
                or items_in_flight_max < 1):
            raise PipelineDefinitionError(
                f"items_in_flight_max must be an int >= 1, got {items_in_flight_max!r}")
        self.stages = stages
        self.name = name
        self.items_in_flight_max = items_in_flight_max or 2 * self.tasks_max

    @property
    def tasks_max(self) -> int:
        """Most tasks of the pipeline running at once: the sum of its stages' concurrency."""
        return sum(s.concurrency for s in self.stages)

    def hints(self, items: Sequence[Any], *, delete_intermediates: bool = True
              ) -> dict[str, Any]:
        """The pocketflow job hints of a run over ``items``.

        ``data_size_bytes`` is the peak of live data: with DELETE, at most
        ``items_in_flight_max`` items hold an intermediate value at once (the driver admits no
        more), plus every final value; without DELETE, every value of every item. Unknown
        when a stage does not declare ``output_bytes``.
        """
        sizes: list[list[int]] = []
        for item in items:
            per_stage = [s.output_bytes_for(item) for s in self.stages]
            if any(size is None for size in per_stage):
                sizes = []
                break
            sizes.append(per_stage)  # type: ignore[arg-type]
        data_size: int | None = None
        if sizes:
            finals = sum(row[-1] for row in sizes)
            intermediates = sorted((sum(row[:-1]) for row in sizes), reverse=True)
            if delete_intermediates:
                intermediates = intermediates[:self.items_in_flight_max]
            data_size = max(1, finals + sum(intermediates))
        return {
            "latency_sensitive": any(s.latency_sensitive for s in self.stages),
            "max_concurrent_tasks": self.tasks_max,
            "data_size_bytes": data_size,
        }

    def run(
        self,
        items: Sequence[Any],
        *,
        executor: str = "ray",
        cluster: Any = None,
        exchange: Any = None,
        delete_intermediates: bool = True,
        keep_outputs: bool = True,
        input_wait_s: float = INPUT_WAIT_DEFAULT_S,
        regenerations_max: int = REGENERATIONS_MAX,
        timeout_s: float | None = None,
        client_options: dict[str, Any] | None = None,
        hints: dict[str, Any] | None = None,
        on_outcome: Callable[[Any], None] | None = None,
        prefix_lease_ms: int | None = None,
    ) -> PipelineResult:
        """Run the pipeline over ``items`` on ``executor`` (``"ray"`` or ``"lithops"``).

        Values go through a pocketflow job this call registers (on ``cluster``, or the one
        :func:`pocketflow.register_job` finds) and deregisters at the end, also on failure;
        pass ``exchange`` (an :class:`~pocketflow_this.exchange.Exchange`) to use another store
        instead (no job is registered). ``keep_outputs=False`` reads the final values with
        DELETE. ``hints`` replaces the derived hints (:meth:`hints`); ``on_outcome`` is called
        in the driver with each finished task's :class:`~pocketflow_this.task.TaskOutcome`.
        ``prefix_lease_ms`` scopes each intermediate value to a prefix lease of that length
        (:class:`~pocketflow_this.driver.Scope`): freed on every server as soon as its consumer
        succeeded, and one lease after the driver's last renewal if the driver dies.
        Raises :class:`~pocketflow_this.errors.StageFailed` when a task fails beyond
        its retries or an item beyond ``regenerations_max`` regenerations,
        :class:`TimeoutError` past ``timeout_s``.
        """
        items = list(items)
        if len(items) > ITEMS_MAX:
            raise ValueError(f"{len(items)} items, more than {ITEMS_MAX}")
        if not 0 < input_wait_s < float("inf"):
            raise ValueError(f"input_wait_s must be finite and > 0, got {input_wait_s}")
        if prefix_lease_ms is not None and exchange is not None:
            raise ValueError("prefix_lease_ms scopes values in the job this call registers; "
                             "it does not apply to another exchange")
        return run_pipeline(
            self, items, executor=executor, cluster=cluster, exchange=exchange,
            delete_intermediates=delete_intermediates, keep_outputs=keep_outputs,
            input_wait_s=input_wait_s, regenerations_max=regenerations_max,
            timeout_s=timeout_s, client_options=client_options or {}, hints=hints,
            on_outcome=on_outcome, prefix_lease_ms=prefix_lease_ms,
        )

    def __repr__(self) -> str:
        return f"<Pipeline {self.name}: {' -> '.join(s.name for s in self.stages)}>"


def pipeline(function: Callable[..., Any] | None = None, *, name: str | None = None,
             items_in_flight_max: int | None = None) -> Any:
    """Declare a pipeline by calling stages in a function of one input:
    ``@pipeline def p(x): return b(a(x))``. The body runs once, on a symbolic value."""

    def build(fn: Callable[..., Any]) -> Pipeline:
        if len(inspect.signature(fn).parameters) != 1:
            raise PipelineDefinitionError(
                f"@pipeline function {fn.__name__} must take exactly one argument (the item)")
        out = fn(Traced())
        if not isinstance(out, Traced) or not out.chain:
            raise PipelineDefinitionError(
                f"@pipeline function {fn.__name__} must return the last stage's value")
        return Pipeline(out.chain, name=name or fn.__name__,
                        items_in_flight_max=items_in_flight_max)

    if function is not None:
        return build(function)
    return build
