"""The driver of one run: registers the job, keeps the tasks flowing, recovers from failures,
reads the results, deregisters.

Scheduling. Items are admitted in order, at most ``items_in_flight_max`` at once; each stage
has at most ``concurrency`` tasks out. A task of stage ``k`` for an item is submitted as soon
as the item's stage ``k-1`` task has been submitted: it waits for its input on the storage
server (pocketflow's ``wait``), so it starts reading the moment its input exists, not when
the upstream stage ends. Downstream tasks are submitted before new items are admitted.

Failures. A task that raised or whose process died is submitted again (``Stage.retries``). A
task whose input is gone (:class:`InputLost`: its earlier attempt consumed it with DELETE, or
the server holding it died) has the item regenerated: its stages up to the failed one run
again from the item's input (lineage, as in the Lithops shuffle), at most
``regenerations_max`` times per item. When the job loses a server, the driver adopts the new
map, then regenerates every item whose unconsumed value may have been on it. Values a
regeneration writes twice are kept once (write-once keys); a value that lost its consumer is
deleted.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pocketflow.errors import PocketflowError
from pocketflow_this.codec import decode
from pocketflow_this.errors import InputLost, InputTimeout, StageFailed
from pocketflow_this.exchange import Exchange, ExchangeClient, PocketflowExchange
from pocketflow_this.executors import make_executor
from pocketflow_this.result import PipelineResult
from pocketflow_this.task import TaskCall, TaskOutcome, value_key, value_prefix

log = logging.getLogger(__name__)

TODO, RUNNING, DONE = "todo", "running", "done"
POLL_S = 0.2
"""Longest the driver blocks waiting for a task before it looks at the job's map again."""
MAP_PROBE_INTERVAL_S = 1.0
"""How often the driver asks a storage server whether the job's map changed."""
BUCKET = "this"


class Scope:
    """Prefix leases over a run's intermediate values (Jiffy's task-scoped storage): the value of
    stage ``k`` (not the last) for an item lives under its own prefix, declared when the item is
    admitted (or regenerated) and renewed by the job's keeper, and ended when stage ``k + 1`` of
    the item succeeded: every server frees it then (with or without DELETE-on-read), and if the
    driver dies, the servers free what is left one lease after its last renewal. The final
    values are not scoped: they are PERSIST and outlive the job."""

    def __init__(self, job: Any, stages: int) -> None:
        self.job = job
        self.intermediate = stages - 1
        self.keeper = job.keep([])
        self.consumed: set[str] = set()

    def declare(self, item: int) -> None:
        """Start (or renew) the item's intermediate prefixes; one renewal per server."""
        prefixes = [value_prefix(stage=k, item=item) for k in range(self.intermediate)]
        if not prefixes:
            return
        self.consumed.difference_update(prefixes)  # written again: not consumed any more
        self.job.declare_many([(p, (), None) for p in prefixes])
        for prefix in prefixes:
            self.keeper.add(prefix)

    def consume(self, stage: int, item: int) -> None:
        """Stage ``stage + 1`` of ``item`` succeeded: its input ends at the next :meth:`flush`."""
        self.consumed.add(value_prefix(stage=stage, item=item))

    def flush(self) -> None:
        """End the consumed prefixes (one ``end_leases`` per server)."""
        if self.consumed:
            ended, self.consumed = sorted(self.consumed), set()
            try:
                self.job.end(ended)
            except PocketflowError as exc:  # the leases still free them, a lease later
                log.warning("ending %d consumed prefixes failed: %s", len(ended), exc)

    def close(self) -> None:
        self.keeper.close()


@dataclass
class _Item:
    index: int
    value: Any
    status: list[str]
    attempts: list[int]
    tickets: list[Any]
    regenerations: int = 0
    output: Any = None
    finished: bool = False
    outcomes: list[TaskOutcome] = field(default_factory=list)


class _Run:
    def __init__(self, pipeline: Any, items: list[Any], executor: Any, exchange: Exchange,
                 client: ExchangeClient, *, delete_intermediates: bool, keep_outputs: bool,
                 input_wait_s: float, regenerations_max: int, timeout_s: float | None,
                 on_outcome: Any = None, scope: Scope | None = None) -> None:
        self.p = pipeline
        self.scope = scope
        self.on_outcome = on_outcome
        self.stages = pipeline.stages
        self.last = len(self.stages) - 1
        self.executor = executor
        self.exchange = exchange
        self.client = client
        self.delete = delete_intermediates
        self.keep_outputs = keep_outputs
        self.input_wait_s = input_wait_s
        self.regenerations_max = regenerations_max
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        n = len(self.stages)
        self.items = [_Item(i, v, [TODO] * n, [0] * n, [None] * n) for i, v in enumerate(items)]
        self.admitted = 0
        self.running = [0] * n
        self.by_ticket: dict[Any, tuple[int, int]] = {}
        self.retried: list[tuple[int, int]] = []
        self.regenerated: list[int] = []
        self.failures: list[str] = []
        self.outcomes: list[TaskOutcome] = []
        self.unreachable = client.unreachable()
        self.probed = time.monotonic()

    # -- scheduling ---------------------------------------------------------------------------

    def _submit(self, item: _Item, k: int) -> None:
        s = self.stages[k]
        call = TaskCall(
            exchange=self.exchange, function=s.function, stage=k, item=item.index,
            attempt=item.attempts[k], value=item.value if k == 0 else None,
            read_delete=self.delete, write_persist=k == self.last,
            upstream_done=k > 0 and item.status[k - 1] == DONE,
            overwrite=item.regenerations > 0 or item.attempts[k] > 0,
            input_wait_s=self.input_wait_s,
        )
        log.debug("submit stage %d item %d attempt %d upstream_done %s", k, item.index,
                  call.attempt, call.upstream_done)
        ticket = self.executor.submit(call)
        item.status[k] = RUNNING
        item.tickets[k] = ticket
        self.running[k] += 1
        self.by_ticket[ticket] = (item.index, k)

    def _active(self) -> list[_Item]:
        return [it for it in self.items[:self.admitted] if not it.finished]

    def _schedule(self) -> None:
        active = self._active()
        for k in range(self.last, -1, -1):
            for it in active:
                if self.running[k] >= self.stages[k].concurrency:
                    break
                if it.status[k] == TODO and (k == 0 or it.status[k - 1] != TODO):
                    self._submit(it, k)
        while (self.admitted < len(self.items) and len(active) < self.p.items_in_flight_max
               and self.running[0] < self.stages[0].concurrency):
            it = self.items[self.admitted]
            self.admitted += 1
            active.append(it)
            if self.scope is not None:
                self.scope.declare(it.index)
            self._submit(it, 0)

    # -- outcomes -----------------------------------------------------------------------------

    def _succeeded(self, it: _Item, k: int, outcome: TaskOutcome) -> None:
        it.status[k] = DONE
        self.outcomes.append(outcome)
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        if self.scope is not None and k > 0:
            self.scope.consume(k - 1, it.index)
        if k < self.last and it.status[k + 1] == DONE:
            # A regeneration wrote a value its consumer no longer needs.
            self.client.delete(value_key(stage=k, item=it.index))
            if self.scope is not None:
                self.scope.consume(k, it.index)
        if k == self.last and not it.finished:
            self._collect(it)

    def _collect(self, it: _Item) -> None:
        try:
            data = self.client.get(value_key(stage=self.last, item=it.index),
                                   delete=not self.keep_outputs)
        except InputLost as exc:
            self._adopt_map({exc.server} if exc.server else set())
            self._regenerate(it, self.last, f"final value lost: {exc}")
            return
        it.output = decode(data)
        it.finished = True

    def _failed(self, it: _Item, k: int, exc: BaseException) -> None:
        what = f"stage {self.stages[k].name} item {it.index}: {type(exc).__name__}: {exc}"
        self.failures.append(what)
        it.status[k] = TODO  # the task has ended
        if isinstance(exc, InputTimeout):
            raise StageFailed(what) from exc
        if isinstance(exc, InputLost):
            self._adopt_map({exc.server} if exc.server else set())
            if k == 0 or it.status[k - 1] != DONE:
                # Its input is (being) written again, or it could not write: run it again.
                it.status[k] = TODO
                if k == 0:
                    self._count_attempt(it, k, what, exc)
            else:
                self._regenerate(it, k, what)
            return
        self._count_attempt(it, k, what, exc)
        it.status[k] = TODO
        self.retried.append((k, it.index))
        log.warning("retrying %s", what)

    def _count_attempt(self, it: _Item, k: int, what: str, exc: BaseException) -> None:
        it.attempts[k] += 1
        if it.attempts[k] > self.stages[k].retries:
            raise StageFailed(f"{what} (after {self.stages[k].retries} retries)") from exc

    def _regenerate(self, it: _Item, upto: int, why: str) -> None:
        it.regenerations += 1
        if it.regenerations > self.regenerations_max:
            raise StageFailed(f"item {it.index} lost its values {it.regenerations - 1} times; "
                              f"last: {why}")
        log.warning("regenerating item %d up to stage %d: %s", it.index, upto, why)
        self.regenerated.append(it.index)
        if self.scope is not None:
            self.scope.declare(it.index)
        for s in range(upto + 1):
            if it.status[s] != RUNNING:
                it.status[s] = TODO
                # What is left of the value (block 0 of an object whose data blocks died with
                # a server) must not pass for the regenerated value.
                self.client.delete(value_key(stage=s, item=it.index))
        it.finished = False

    # -- lost servers -------------------------------------------------------------------------

    def _adopt_map(self, unreachable: set[str]) -> None:
        if unreachable:
            self.client.refresh(unreachable)
        newer = self.client.spec()
        if newer is not None:
            self.exchange = newer
        lost = self.client.unreachable() - self.unreachable
        if lost:
            self.unreachable |= lost
            self._sweep_lost()

    def _sweep_lost(self) -> None:
        """Regenerate each item whose value that no task has consumed yet may have been on a
        lost server (a value that was consumed already reads as lost too: regenerating it
        costs work, never correctness)."""
        for it in self._active():
            for k in range(self.last):
                if (it.status[k] == DONE and it.status[k + 1] == TODO
                        and self.client.lost(value_key(stage=k, item=it.index))):
                    self._regenerate(it, k, "its value may have been on a lost server")
                    break

    def _state(self) -> str:
        """The unfinished items' stage states, for error messages."""
        rows = [f"{it.index}:{'/'.join(it.status)}" for it in self._active()]
        return f"running per stage {self.running}; unfinished items {' '.join(rows[:32])}"

    def _probe(self) -> None:
        if time.monotonic() - self.probed < MAP_PROBE_INTERVAL_S:
            return
        self.probed = time.monotonic()
        probe = getattr(self.client, "probe", None)
        if probe is not None:
            probe()
            self._adopt_map(set())

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        while not all(it.finished for it in self.items):
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise TimeoutError(f"pipeline {self.p.name} did not finish in time; "
                                   f"{self._state()}")
            self._schedule()
            for ticket, result in self.executor.wait(list(self.by_ticket), POLL_S):
                index, k = self.by_ticket.pop(ticket)
                self.running[k] -= 1
                it = self.items[index]
                log.debug("stage %d item %d: %s", k, index,
                          type(result).__name__ if isinstance(result, BaseException) else "ok")
                if isinstance(result, BaseException):
                    self._failed(it, k, result)
                else:
                    self._succeeded(it, k, result)
            if self.scope is not None:
                self.scope.flush()
            self._probe()


def run_pipeline(pipeline: Any, items: list[Any], *, executor: str, cluster: Any,
                 exchange: Exchange | None, delete_intermediates: bool, keep_outputs: bool,
                 input_wait_s: float, regenerations_max: int, timeout_s: float | None,
                 client_options: dict[str, Any], hints: dict[str, Any] | None,
                 on_outcome: Any, prefix_lease_ms: int | None = None) -> Any:
    """Run ``pipeline`` over ``items`` (see :meth:`Pipeline.run`)."""
    import pocketflow

    if hints is None:
        hints = pipeline.hints(items, delete_intermediates=delete_intermediates)
    started = time.perf_counter()
    started_unix = time.time()
    ex = make_executor(executor, tasks_max=pipeline.tasks_max)
    try:
        if exchange is not None:
            run = _run_with(pipeline, items, ex, exchange, delete_intermediates, keep_outputs,
                            input_wait_s, regenerations_max, timeout_s, on_outcome)
            job_id = None
        else:
            name = f"{pipeline.name}-{uuid.uuid4().hex[:6]}"
            leases = {} if prefix_lease_ms is None else {"prefix_lease_ms": prefix_lease_ms}
            with pocketflow.register_job(name, hints, cluster=cluster, **leases) as job:
                job_id = job.job_id
                spec = PocketflowExchange(job.handle.to_json(), BUCKET,
                                          tuple(sorted(client_options.items())))
                scope = None if prefix_lease_ms is None else Scope(job, len(pipeline.stages))
                try:
                    run = _run_with(pipeline, items, ex, spec, delete_intermediates,
                                    keep_outputs, input_wait_s, regenerations_max, timeout_s,
                                    on_outcome, scope)
                finally:
                    if scope is not None:
                        scope.close()
    finally:
        ex.close()
    return PipelineResult(
        outputs=[it.output for it in run.items],
        outcomes=run.outcomes,
        elapsed_s=time.perf_counter() - started,
        started_unix_s=started_unix,
        executor=executor,
        exchange=(exchange.name if exchange is not None else "pocketflow"),
        job_id=job_id,
        hints=hints if exchange is None else None,
        delete_intermediates=delete_intermediates,
        retried=run.retried,
        regenerated=run.regenerated,
        failures=run.failures,
        handle_json=(run.exchange.handle_json if isinstance(run.exchange, PocketflowExchange)
                     else None),
    )


def _run_with(pipeline: Any, items: list[Any], ex: Any, exchange: Exchange,
              delete_intermediates: bool, keep_outputs: bool, input_wait_s: float,
              regenerations_max: int, timeout_s: float | None, on_outcome: Any,
              scope: Scope | None = None) -> _Run:
    client = exchange.connect()
    try:
        create = getattr(client, "create_bucket", None)
        if create is not None:
            create()
        run = _Run(pipeline, items, ex, exchange, client,
                   delete_intermediates=delete_intermediates, keep_outputs=keep_outputs,
                   input_wait_s=input_wait_s, regenerations_max=regenerations_max,
                   timeout_s=timeout_s, on_outcome=on_outcome, scope=scope)
        try:
            run.run()
        except BaseException:
            # Tasks still parked on their inputs wake up and fail at once instead of holding
            # their workers until their wait bound.
            client.abandon()
            raise
        return run
    finally:
        client.close()
