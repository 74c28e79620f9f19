"""Where stage tasks run: Ray tasks or Lithops functions (localhost), chosen when a pipeline
runs. Both take a :class:`~pocketflow_this.task.TaskCall` and hand back what it returned or
raised; a task whose process died comes back as an exception like any other failure.
"""

from __future__ import annotations

import abc
import time
from typing import Any

from pocketflow_this.task import TaskCall, TaskOutcome, run_task

__all__ = ["Executor", "RayExecutor", "LithopsExecutor", "make_executor", "EXECUTORS"]

EXECUTORS = ("ray", "lithops")
LITHOPS_POLL_S = 0.1
"""Pause between Lithops status checks while no call has finished."""
RUNTIME_PACKAGES = ("pocketflow", "pocketflow_this")
"""Packages a Lithops runtime must have installed (pocketflow's native client core cannot
travel as a pickled module): every submission passes them as ``exclude_modules``, so Lithops'
dependency analysis neither walks nor ships them (about 0.3 s per submission with an editable
install) and workers run the installed code."""

Finished = list[tuple[Any, TaskOutcome | BaseException]]


class Executor(abc.ABC):
    """Runs tasks; ``wait`` returns those of ``tickets`` that finished within ``timeout_s``."""

    name: str

    @abc.abstractmethod
    def submit(self, call: TaskCall) -> Any: ...

    @abc.abstractmethod
    def wait(self, tickets: list[Any], timeout_s: float) -> Finished: ...

    def close(self) -> None:
        """Release what the executor holds (worker processes, temporary files)."""
        return None


class RayExecutor(Executor):
    """Ray tasks on the Ray cluster this process is connected to (started by
    :class:`pocketflow.LocalCluster`, or ``ray.init`` by the caller). Each task asks for
    ``num_cpus`` so that every stage's ``concurrency`` fits at once: a downstream task parked
    on its input never keeps an upstream task from starting. Ray does not retry tasks itself
    (``max_retries=0``); the pipeline's driver does, because a retry may need its input
    regenerated first."""

    name = "ray"

    def __init__(self, *, tasks_max: int) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address="auto", namespace="pocketflow-this", log_to_driver=False)
        cpus = float(ray.cluster_resources().get("CPU", 1.0))
        self.num_cpus = min(1.0, cpus / max(1, tasks_max))
        self._remote = ray.remote(run_task).options(num_cpus=self.num_cpus, max_retries=0)

    def submit(self, call: TaskCall) -> Any:
        return self._remote.remote(call)

    def wait(self, tickets: list[Any], timeout_s: float) -> Finished:
        import ray
        from ray.exceptions import RayTaskError

        if not tickets:
            return []
        ready, _ = ray.wait(tickets, num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = ray.wait(tickets, num_returns=len(tickets), timeout=0)
        finished: Finished = []
        for ref in ready:
            try:
                finished.append((ref, ray.get(ref)))
            except RayTaskError as exc:
                finished.append((ref, exc.cause if exc.cause is not None else exc))
            except Exception as exc:  # noqa: BLE001 - a dead worker, reported like a failure
                finished.append((ref, exc))
        return finished


class LithopsExecutor(Executor):
    """Lithops functions on its localhost backend (version 2: one shared queue of calls and
    ``workers`` worker slots, so calls of different submissions start in submission order as
    slots free up). Lithops' own storage is its localhost storage; the pipeline's values never
    go there."""

    name = "lithops"

    def __init__(self, *, workers: int, config: dict[str, Any] | None = None) -> None:
        import lithops

        from pocketflow.demo import lithops_config

        self._fexec = lithops.FunctionExecutor(config=config or lithops_config(
            storage="localhost", workers=workers, extra={"localhost": {"version": 2}}))

    def submit(self, call: TaskCall) -> Any:
        return self._fexec.call_async(run_task, (call,), exclude_modules=list(RUNTIME_PACKAGES))

    def wait(self, tickets: list[Any], timeout_s: float) -> Finished:
        from lithops.wait import ALWAYS

        deadline = time.monotonic() + timeout_s
        while True:
            done, _ = self._fexec.wait(tickets, throw_except=False, return_when=ALWAYS,
                                       download_results=True, show_progressbar=False)
            if done or time.monotonic() >= deadline:
                break
            time.sleep(LITHOPS_POLL_S)
        finished: Finished = []
        for future in done:
            try:
                finished.append((future, future.result(throw_except=True)))
            except BaseException as exc:  # noqa: BLE001 - the task's failure, reported
                finished.append((future, exc))
        return finished

    def close(self) -> None:
        try:
            self._fexec.clean()
        except Exception:  # noqa: BLE001 - best effort cleanup of Lithops' temporary files
            pass


def make_executor(name: str, *, tasks_max: int) -> Executor:
    """The executor named ``name`` (one of ``EXECUTORS``), sized for ``tasks_max`` tasks."""
    if name == "ray":
        return RayExecutor(tasks_max=tasks_max)
    if name == "lithops":
        return LithopsExecutor(workers=tasks_max)
    raise ValueError(f"unknown executor {name!r}; choose one of {', '.join(EXECUTORS)}")
