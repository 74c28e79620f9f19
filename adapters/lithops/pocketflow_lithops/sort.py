"""The demo sort on Lithops or Ray (``pocketflow demo``'s runner ``lithops``, its option
``executor``).

Mappers and reducers are Lithops calls on the localhost executor (worker subprocesses of this
interpreter, no Ray in the tasks) or Ray tasks on the cluster's Ray, wired together by the
drop-in shuffle of :mod:`pocketflow_lithops.shuffle`: the shuffle registers a job with hints,
tasks receive only the job handle's JSON. Mapper ``i`` generates its share of records
(:mod:`pocketflow.demo`) and range-partitions them into ``R`` partitions, one object per
(mapper, reducer); reducer ``r`` waits for and reads its ``M`` inputs with DELETE-on-read,
sorts them and writes its output with PERSIST. A validation stage (more calls of the same
executor) reads every output back from the storage servers and checks it; the driver then
compares record counts and an order-independent checksum with what the mappers generated, and
checks that the partitions are globally ordered.

The core's ``pocketflow demo`` finds :data:`RUNNER` through the entry-point group
``pocketflow.demo_runners`` (this package's ``setup.cfg``), so the core imports no adapter.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pocketflow
from pocketflow.demo import (
    LITHOPS_POCKET_STORAGE,
    SORT_TIMEOUT_DEFAULT_S,
    CapacityPoller,
    MapResult,
    PartitionCheck,
    SortConfig,
    SortReport,
    check_output,
    check_partition,
    forget_inherited_lithops_session,
    lithops_config,
    map_records,
    reduce_records,
)
from pocketflow.errors import PocketflowError
from pocketflow_lithops.executor_data import NO_CLEANER, delete_executor_data
from pocketflow_lithops.runtime import runtime_path
from pocketflow_lithops.shuffle import shuffle
from pocketflow_lithops.shuffle_executors import EXECUTORS, RayShuffleExecutor
from pocketflow_lithops.shuffle_tasks import (
    CLUSTER_GONE,
    CLUSTER_GONE_SETTLE_S,
    OutputInfo,
    cluster_gone,
)

__all__ = ["RUNNER", "LithopsSortRunner", "run_sort"]

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def _say(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


def _shuffle_runtime() -> str | None:
    """The Lithops runtime that loads pocketflow's client once per job
    (:mod:`pocketflow_lithops.runtime`), or ``None`` (this interpreter) if it is not installed."""
    try:
        return runtime_path()
    except FileNotFoundError as exc:
        log.warning("%s; every task imports the client itself", exc)
        return None


def _check_partition_call(args: tuple[str, str, str, int]) -> PartitionCheck:
    """:func:`check_partition` as a task of one argument (a Ray task of the validation)."""
    return check_partition(*args)


@contextlib.contextmanager
def _saying_if_cluster_gone(handle_json: str) -> Iterator[None]:
    """Re-raise a pocketflow failure of the block as the error that says the job's cluster is
    gone when no storage server of the job answers any more (as the shuffle's failures do):
    the driver's steps after the shuffle (the validation, the deletion of the outputs) may be
    where it learns that its cluster died."""
    try:
        yield
    except PocketflowError as failure:
        if CLUSTER_GONE in str(failure):
            raise
        with pocketflow.connect(handle_json) as pf:
            gone = cluster_gone(pf, settle_s=CLUSTER_GONE_SETTLE_S)
        if gone is not None:
            raise gone from failure
        raise


def _validate(fexec: Any, handle_json: str, outputs: list[OutputInfo],
              timeout_s: float | None) -> list[PartitionCheck]:
    """The validation stage: one call per output (a Lithops call, or a Ray task when ``fexec``
    is a :class:`RayShuffleExecutor`) reads it back and describes it. A failure of a call whose
    cluster is gone meanwhile says so, as the shuffle's do."""
    calls = [(handle_json, o.bucket, o.key, r) for r, o in enumerate(outputs)]
    with _saying_if_cluster_gone(handle_json):
        if isinstance(fexec, RayShuffleExecutor):
            return list(fexec.run_all(_check_partition_call, calls, timeout_s))
        return list(fexec.get_result(fexec.map(check_partition, calls), timeout=timeout_s))


def run_sort(
    cluster: Any = None,
    config: SortConfig | None = None,
    *,
    progress: bool = True,
    fexec: Any = None,
    lithops_storage: str = "localhost",
    client_options: dict[str, Any] | None = None,
    timeout_s: float | None = SORT_TIMEOUT_DEFAULT_S,
    executor: str = "lithops",
) -> SortReport:
    """Run the sort on Lithops' localhost executor or on Ray tasks (``executor``: ``"lithops"``
    or ``"ray"``), shuffling through pocketflow; the report.

    ``cluster`` is what :func:`pocketflow.register_job` takes (a LocalCluster, a control plane,
    or ``None`` for the running one). The shuffle registers its own job with hints (tasks, input
    size) and deregisters it at the end. ``fexec`` reuses a ``lithops.FunctionExecutor``;
    otherwise one is made with :func:`~pocketflow.demo.lithops_config` with ``lithops_storage``
    for Lithops' own data: ``"localhost"`` (files), or ``"pocket"`` (pocketflow's Lithops
    storage backend, in a job of its own, registered and deregistered here), and the runtime
    that loads the client once per job (:mod:`pocketflow_lithops.runtime`). An executor made
    here is shut down on the way out, also when the sort fails: calls not started are dropped
    and the processes of its jobs killed, so no task outlives the sort; then its data in Lithops'
    storage is deleted from this process (no Lithops cleaner process is left running).
    ``timeout_s`` bounds each wait for a stage's Lithops results (``TimeoutError``; only
    enforced on the main thread, where Lithops can arm its alarm). Raises whatever a task
    raised.

    With ``executor="ray"`` the tasks are Ray tasks on the Ray cluster this process is connected
    to (the local cluster's), at most ``config.pool_size()`` at once; ``fexec`` and
    ``lithops_storage`` are not used and Lithops is not imported.
    """
    from pocketflow.job import _resolve_control_plane

    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    cfg = config or SortConfig()
    control = _resolve_control_plane(cluster)
    if threading.current_thread() is not threading.main_thread():
        timeout_s = None
    options = dict(client_options or {})
    if cfg.block_size_bytes is not None:
        options.setdefault("block_size_bytes", cfg.block_size_bytes)
    phase_s: dict[str, float] = {}
    with contextlib.ExitStack() as own:
        if executor == "ray":
            fexec = RayShuffleExecutor(tasks_max=cfg.pool_size())
        elif fexec is None:
            import lithops

            # No cleaner process that outlives the sort: its data is deleted here, on the way out.
            extra: dict[str, Any] = dict(NO_CLEANER)
            if lithops_storage == LITHOPS_POCKET_STORAGE:
                # Lithops' own data (payloads, results, status) in a pocketflow job of its own,
                # through the `pocket` storage backend.
                from pocketflow.job import register_job

                lithops_job = register_job("lithops-data", cluster=control)
                own.callback(lithops_job.deregister)
                extra[LITHOPS_POCKET_STORAGE] = {"handle": lithops_job.handle.to_json()}
            fexec = lithops.FunctionExecutor(config=lithops_config(
                storage=lithops_storage, workers=cfg.pool_size(), extra=extra,
                runtime=_shuffle_runtime()))
            own.callback(delete_executor_data, fexec)
            # Leaving the executor's context stops its monitor and invoker and kills the
            # process groups of its jobs: without it a failed sort left Lithops' runner
            # starting the calls still queued, and the monitor threads kept this process alive.
            own.enter_context(fexec)
        started = time.perf_counter()
        with CapacityPoller(control.status) as poller:
            where = "Ray tasks" if executor == "ray" else "Lithops"
            _say(progress, f"shuffle: {cfg.mappers} mappers x {cfg.reducers} reducers on {where}")
            result = shuffle(
                fexec, functools.partial(map_records, cfg), reduce_records, range(cfg.mappers),
                reducers=cfg.reducers, cluster=control, name="sort",
                input_size_bytes=cfg.input_bytes, persist_output=True,
                client_options=options, timeout_s=timeout_s,
            )
            phase_s["map"] = result.map_s
            phase_s["shuffle+reduce"] = result.elapsed_s - result.map_s
            _say(progress, "validate: reading the sorted output back")
            phase_started = time.perf_counter()
            checks = _validate(fexec, result.handle_json, result.outputs, timeout_s)
            phase_s["validate"] = time.perf_counter() - phase_started
        elapsed_s = time.perf_counter() - started
        maps: list[MapResult] = result.map_values
        input_checksum = sum(m.checksum for m in maps) & _MASK64
        problems = check_output(cfg, input_checksum=input_checksum, checks=checks)
        if sum(m.records for m in maps) != cfg.records:
            problems.append(f"mappers generated {sum(m.records for m in maps):,} records")
        if not cfg.keep_output:
            with (_saying_if_cluster_gone(result.handle_json),
                  pocketflow.connect(result.handle_json) as pf):
                for output in result.outputs:
                    pf.delete(output.bucket, output.key)
    from pocketflow.handle import JobHandle

    handle = JobHandle.from_json(result.handle_json)
    output_bytes = sum(o.size for o in result.outputs)
    return SortReport(
        config=cfg,
        job_id=result.job_id,
        input_checksum=input_checksum,
        output_checksum=sum(c.checksum for c in checks) & _MASK64,
        output_records=sum(c.records for c in checks),
        elapsed_s=elapsed_s,
        phase_s=phase_s,
        bytes_written=result.bytes_shuffled + output_bytes,
        bytes_read=result.bytes_read + sum(c.bytes_read for c in checks),
        peak_used_bytes=poller.peak_used_bytes,
        baseline_used_bytes=poller.baseline_used_bytes,
        capacity_bytes=poller.capacity_bytes,
        servers=poller.servers,
        weights={s.node_id: s.weight for s in handle.servers if s.weight > 0},
        problems=problems,
        regenerated_partitions=sum(len(r) for r in result.regenerated),
        executor="Ray tasks" if executor == "ray" else "Lithops localhost executor",
        peak_used_by_tier=dict(poller.peak_by_tier),
        capacity_by_tier=dict(poller.capacity_by_tier),
    )


class LithopsSortRunner:
    """The demo runner ``lithops`` (see :class:`pocketflow.demo.DemoRunner`): the sort on
    Lithops' localhost executor, or on Ray tasks with the option ``executor="ray"``. Its option
    ``lithops_storage`` is where Lithops keeps its own data (``"localhost"`` or ``"pocket"``)."""

    def prepare(self) -> None:
        """Start a Lithops session of this process's own before anything forks."""
        forget_inherited_lithops_session()

    def run(
        self, cluster: Any, config: SortConfig, *, progress: bool, options: Mapping[str, Any]
    ) -> SortReport:
        """:func:`run_sort` with the command line's options."""
        return run_sort(cluster, config, progress=progress,
                        lithops_storage=options.get("lithops_storage") or "localhost",
                        executor=options.get("executor") or "lithops")


RUNNER = LithopsSortRunner()
"""The object the entry point ``pocketflow.demo_runners: lithops`` names."""
