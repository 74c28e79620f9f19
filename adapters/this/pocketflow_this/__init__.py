"""pocketflow for video analytics: pipelines declared with decorators whose stages hand their
values to each other through pocketflow, on Ray tasks or Lithops functions.

::

    from pocketflow_this import pipeline, stage

    @stage(concurrency=2)
    def decode(segment): ...

    @stage(concurrency=2)
    def detect(frames): ...

    @pipeline
    def this(segment):
        return detect(decode(segment))

    result = this.run(segments, executor="ray")
"""

from pocketflow_this.errors import (
    InputLost,
    InputTimeout,
    PipelineDefinitionError,
    PipelineError,
    StageFailed,
)
from pocketflow_this.pipeline import Pipeline, PipelineResult, pipeline
from pocketflow_this.stage import Stage, stage

__all__ = [
    "stage",
    "Stage",
    "pipeline",
    "Pipeline",
    "PipelineResult",
    "PipelineError",
    "PipelineDefinitionError",
    "InputLost",
    "InputTimeout",
    "StageFailed",
]
