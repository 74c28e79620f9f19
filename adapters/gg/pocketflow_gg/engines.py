"""Where thunks run: Ray tasks or Lithops functions (localhost executor). An engine is given a
store spec and a thunk name per call, nothing else, and hands back the worker's report."""

from __future__ import annotations

import sys
from typing import Any, Protocol

from pocketflow_gg.errors import GGError
from pocketflow_gg.worker import run_thunk

ENGINES = ("ray", "lithops")
WAIT_POLL_S = 0.05
"""How often the Lithops engine looks for finished calls."""
LITHOPS_WINDOW_PER_WORKER = 32
"""Calls the Lithops engine keeps submitted per worker process."""
RAY_QUEUED_PER_JOB = 1
"""Ray tasks the driver keeps submitted per running one when the cluster's CPUs already bound
what runs at once to ``jobs``: Ray hands a queued task to the worker that finishes one at once,
instead of the worker idling while the driver hears of the finish, records it and submits the
next. On a cluster with more CPUs than ``jobs``, ``jobs`` are submitted at a time."""
RUNTIME_PACKAGES = ("pocketflow", "pocketflow_gg")
"""Packages a Lithops runtime must have installed (pocketflow's native client core cannot
travel as a pickled module): every submission passes them as ``exclude_modules``, so Lithops'
dependency analysis neither walks nor ships them (about 0.3 s per submission with an editable
install) and workers run the installed code."""


class Engine(Protocol):
    """Runs :func:`pocketflow_gg.worker.run_thunk` calls on workers that are not the driver."""

    def window(self, jobs: int) -> int:
        """How many calls the driver may keep submitted at once for ``jobs`` running."""
        ...

    def submit_many(self, store_spec: str, thunk_names: list[str],
                    scopes: list[str] | None = None) -> list[Any]:
        """Start one call per thunk (``run_thunk(store_spec, name, scope)``, the scope the
        prefix the thunk is stored under, ``""`` without); returns their handles in order."""
        ...

    def wait_any(self, pending: list[Any], timeout_s: float) -> list[tuple[Any, Any]]:
        """``(call, report or exception)`` of the calls among ``pending`` that finished."""
        ...

    def close(self) -> None: ...


class RayEngine:
    """One Ray task per thunk (``num_cpus=1``): Ray runs as many at once as the cluster has
    CPUs for (``jobs`` on the embedded local cluster)."""

    def __init__(self) -> None:
        import ray

        if not ray.is_initialized():
            raise GGError("the ray engine needs a connected Ray (start a LocalCluster or pass "
                          "--address)")
        self._ray = ray
        self._task = ray.remote(num_cpus=1, max_retries=0)(run_thunk)

    def window(self, jobs: int) -> int:
        cpus = self._ray.cluster_resources().get("CPU", 0)
        return jobs * (1 + RAY_QUEUED_PER_JOB) if cpus <= jobs else jobs

    def submit_many(self, store_spec: str, thunk_names: list[str],
                    scopes: list[str] | None = None) -> list[Any]:
        return [self._task.remote(store_spec, name, scope)
                for name, scope in zip(thunk_names, _scopes(thunk_names, scopes), strict=True)]

    def wait_any(self, pending: list[Any], timeout_s: float) -> list[tuple[Any, Any]]:
        done, _ = self._ray.wait(pending, num_returns=1, timeout=timeout_s)
        if done:  # collect whatever else finished meanwhile
            more, _ = self._ray.wait([p for p in pending if p not in done],
                                     num_returns=len(pending) - len(done), timeout=0)
            done += more
        out: list[tuple[Any, Any]] = []
        for ref in done:
            try:
                out.append((ref, self._ray.get(ref)))
            except Exception as exc:  # the task's own exception, re-raised by Ray
                cause = getattr(exc, "cause", None)
                out.append((ref, cause if isinstance(cause, Exception) else exc))
        return out

    def close(self) -> None:
        pass


class LithopsEngine:
    """One Lithops call per thunk on the localhost executor, ``workers`` processes."""

    def __init__(self, store_spec: str, *, workers: int) -> None:
        import lithops

        if store_spec.startswith("redis://"):
            config = _lithops_local_config()
        else:
            try:
                from pocketflow_lithops.storage import lithops_config
            except ImportError:  # pocketflow-lithops not installed: Lithops keeps its own data
                config = _lithops_local_config()
            else:
                config = lithops_config(store_spec)
        config.setdefault("localhost", {})["worker_processes"] = workers
        config["lithops"]["log_level"] = "WARNING"
        self._lithops = lithops
        self._executor = lithops.FunctionExecutor(config=config)

    def window(self, jobs: int) -> int:
        # Every Lithops job costs a runner process on the localhost executor, so the ready
        # thunks go out together as one map; its worker processes bound what runs at once.
        return jobs * LITHOPS_WINDOW_PER_WORKER

    def submit_many(self, store_spec: str, thunk_names: list[str],
                    scopes: list[str] | None = None) -> list[Any]:
        calls = [(store_spec, name, scope)
                 for name, scope in zip(thunk_names, _scopes(thunk_names, scopes), strict=True)]
        return list(self._executor.map(run_thunk, calls,
                                       exclude_modules=list(RUNTIME_PACKAGES)))

    def wait_any(self, pending: list[Any], timeout_s: float) -> list[tuple[Any, Any]]:
        from lithops.wait import ANY_COMPLETED

        done, _ = self._executor.wait(pending, throw_except=False,
                                      return_when=ANY_COMPLETED,
                                      download_results=False, timeout=timeout_s,
                                      wait_dur_sec=WAIT_POLL_S, show_progressbar=False)
        out: list[tuple[Any, Any]] = []
        for future in done:
            try:
                out.append((future, future.result()))
            except Exception as exc:  # the call's exception, re-raised by Lithops
                out.append((future, exc))
        return out

    def close(self) -> None:
        try:
            self._executor.clean(clean_cloudobjects=True)
        except Exception:  # cleaning Lithops' temporary data must not hide the build's result
            pass


def _scopes(thunk_names: list[str], scopes: list[str] | None) -> list[str]:
    if scopes is None:
        return [""] * len(thunk_names)
    if len(scopes) != len(thunk_names):
        raise GGError(f"{len(scopes)} scopes for {len(thunk_names)} thunks")
    return scopes


def _lithops_local_config() -> dict[str, Any]:
    return {
        "lithops": {"backend": "localhost", "storage": "localhost", "monitoring_interval": 0.1},
        "localhost": {"runtime": sys.executable, "version": 1},
    }


def make_engine(kind: str, store_spec: str, *, workers: int) -> Engine:
    """The engine called ``kind`` (``ray`` or ``lithops``)."""
    if kind == "ray":
        return RayEngine()
    if kind == "lithops":
        return LithopsEngine(store_spec, workers=workers)
    raise GGError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")
