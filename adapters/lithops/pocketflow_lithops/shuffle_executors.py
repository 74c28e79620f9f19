"""Where a shuffle's tasks run: Lithops functions or Ray tasks, chosen per call of
:func:`pocketflow_lithops.shuffle.shuffle`.

The shuffle's driver (:mod:`pocketflow_lithops.shuffle`) is the same on both: it submits the
calls of a stage, waits for some of them to finish, resubmits a failed reducer, and stops what
is still running when the shuffle fails. An executor does only those four things, for the task
function :func:`~pocketflow_lithops.shuffle_tasks._shuffle_task` (or the append layout's task).

- :class:`LithopsShuffleExecutor` wraps a ``lithops.FunctionExecutor``. Lithops learns that a
  call finished by polling its storage, so reducer attempts write a finished marker on the
  storage servers and the driver parks on them (``names_attempts``; see the shuffle's doc).
- :class:`RayShuffleExecutor` runs the calls as Ray tasks on the Ray cluster this process is
  connected to. It keeps at most ``tasks_max`` of them running and starts the others in
  submission order as slots free up, as Lithops' worker pool does: a stage submits every mapper
  before any reducer, so a reducer parked on its inputs only ever holds a slot once every
  mapper has one, and the shuffle cannot deadlock on its own slots. Ray reports a finished task
  as it happens, so no marker is written. Ray does not retry a task itself (``max_retries=0``):
  the shuffle's driver does, because a retry may need lost inputs regenerated first. A stage
  with many more calls than slots runs its calls in bundles, several consecutive calls per Ray
  task one after another (at most ``RAY_BUNDLE_CALLS_MAX``, and at least
  ``RAY_BUNDLES_PER_SLOT`` bundles per slot so that slots stay evenly busy): each Ray task costs
  the driver, the raylet and its worker some milliseconds of CPU, which a 256 x 256 shuffle of
  small objects would otherwise pay 512 times. Only calls known to be small are bundled (the
  shuffle's input size over its tasks, at most ``RAY_BUNDLE_CALL_BYTES_MAX``). A bundle keeps
  submission order (so the rule above still holds), gives each call its own outcome or error,
  and when its process dies every call of it is reported as :class:`TaskProcessDied` and runs
  again under the shuffle's retry rules. Calls that say they mostly wait on storage
  (``waits_on_storage``: a shuffle's reducers when much of its job's data lives on NVMe) may run
  in ``storage_tasks_extra`` slots beyond ``tasks_max`` (none by default, see
  ``RAY_STORAGE_TASKS_EXTRA_PER_SLOT``): such a reducer spends most of its time
  waiting for the NVMe device (its reads, its output's write), during which another task can
  use the CPU; calls that compute (mappers) keep to ``tasks_max``, so the extra slots only
  overlap storage waits with work and never add processes competing for the cores.
  Where the cluster's CPUs cannot run one more task at once (the default: one slot per CPU, no
  extra slots), up to ``RAY_QUEUED_AHEAD_PER_SLOT`` calls per slot are handed to Ray before a
  slot frees, and Ray starts them as soon as one does: calls that never wait for other calls
  (``parks`` false: mappers) at any time, and calls that may (``parks`` true: reducers, which
  wait for mappers' writes) only once no call that does not say it parks is outstanding, so a
  reducer never waits in Ray's queue ahead of a mapper it needs, nor takes a mapper's slot.

Lithops is imported only by the Lithops executor and Ray only by the Ray executor: a Ray user
runs the shuffle without importing Lithops.
"""

from __future__ import annotations

import abc
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pocketflow.errors import PocketflowError
from pocketflow_lithops.runtime import RUNTIME_PACKAGES

if TYPE_CHECKING:
    from pocketflow.client import Client

__all__ = [
    "EXECUTORS",
    "LithopsShuffleExecutor",
    "RayShuffleExecutor",
    "ShuffleExecutor",
    "TaskProcessDied",
    "shuffle_executor",
]

log = logging.getLogger(__name__)

EXECUTORS = ("lithops", "ray")
"""Names :func:`shuffle_executor` takes."""
FINISHED_WAIT_SLICE_S = 0.25
"""Longest the Lithops driver parks on the servers for reducers' finished markers before it
looks at Lithops' statuses again (a call that failed writes none)."""
FINISHED_POLL_INTERVAL_S = 0.005
"""Pause between two looks at Lithops' statuses once the pending reducers said they returned."""
FINISHED_POLLS_MAX = 40
"""Most such looks per stage; after them the driver waits with Lithops' own polling."""
RAY_TASKS_MAX = 4096
"""Most Ray tasks one shuffle keeps running at once (each holds a Ray worker process)."""
RAY_WAIT_SLICE_S = 1.0
"""Longest one ``ray.wait`` of the driver, so that a timeout and a stop are seen in time."""
RAY_BUNDLE_CALLS_MAX = 16
"""Most calls of a stage one Ray task runs, one after another."""
RAY_BUNDLES_PER_SLOT = 4
"""A stage is cut into at least this many bundles per slot (``tasks_max``) before calls are
bundled at all, so that bundles spread evenly over the running tasks."""
RAY_STORAGE_TASKS_EXTRA_PER_SLOT = 0
"""Slots beyond ``tasks_max`` for calls that mostly wait on storage, per slot of ``tasks_max``
(the default of :class:`RayShuffleExecutor`'s ``storage_tasks_extra``). None by default, as
measured: the sort's reducers of a job on NVMe do spend nearly all their time in I/O (a 512 MB
sort, its data on NVMe: 0.4-2.2 s per reducer in its reads and output write against 0.07 s of
CPU to sort its 64 MB; at 4 GB the reducers' reads took 16.8 s for 3.6 s of CPU), but each
extra slot costs a Ray worker process started for it (Ray keeps idle workers only up to the
cluster's CPUs: some 1.4 s of CPU each, 2.8-3.2 s per 512 MB sort with 2 extra slots), and
that sort ran slower with them in all of three interleaved rounds (under load, a hint only).
The device (a virtual disk here: some 260 MB/s of O_DIRECT writes with 1 or 4 writers) goes
no faster with more requests in flight. Whether they pay at 4-10 GB is for a quiet run to say
(``benchmarks.sort_scale --storage-tasks-extra``)."""
RAY_QUEUED_AHEAD_PER_SLOT = 1
"""Calls handed to Ray beyond the free slots, per slot of ``tasks_max``, where Ray itself holds
them until a slot frees (see :class:`RayShuffleExecutor`): Ray then starts the next call on the
worker a finished one leaves, instead of waiting for the driver to hear of the end and submit
it. Measured on a loaded 2-core machine: 100 calls of 20 ms on 2 slots took 1.22 and 1.19 s
instead of 1.39 and 1.30 (two runs, medians of 4 interleaved rounds each; 1.00 is the floor),
and the idle time between a worker's
tasks in a 1 GB sort (43 tasks) fell from 0.30 to 0.24 s per worker (medians of 6 jobs each,
interleaved), some 2% of the job."""
RAY_BUNDLE_CALL_BYTES_MAX = 16 * 1024 * 1024
"""Calls are bundled only when each moves at most this many bytes (the shuffle's ``call_bytes``,
known from its input size): a larger call's I/O dwarfs a Ray task's cost, and a bundle of
large calls would only leave a slot busy longer at the end of the stage."""


class TaskProcessDied(PocketflowError):
    """A task's process died under it (killed, out of memory) instead of the task raising: the
    task may be run again, since its writes are write-once and a rerun keeps what it wrote."""


class ShuffleExecutor(abc.ABC):
    """Runs the calls of a shuffle; tickets are the executor's handles of submitted calls."""

    name: str
    names_attempts: bool
    """Whether reducer attempts write finished markers that :meth:`wait` parks on."""

    @abc.abstractmethod
    def submit(self, task: Callable[[Any], Any], calls: Sequence[Any], *,
               first: bool = False) -> list[Any]:
        """Start ``task(call)`` for every call, in order; one ticket per call. ``first``: ahead
        of the calls still queued (a mapper run again, which queued reducers wait for), where
        the executor keeps its own queue."""

    @abc.abstractmethod
    def wait(self, pending: list[Any], calls: list[Any], *, left_s: float | None,
             pf: Client | None) -> tuple[list[Any], list[Any]]:
        """Wait until some of the ``pending`` tickets (of ``calls``) finished; returns the
        finished and the other tickets. Raises ``TimeoutError`` once ``left_s`` is used up."""

    @abc.abstractmethod
    def result(self, ticket: Any) -> Any:
        """The finished call's outcome; raises what the task raised, or
        :class:`TaskProcessDied`."""

    @abc.abstractmethod
    def stop(self, tickets: list[Any], exc: BaseException) -> None:
        """Drop the calls of ``tickets`` not started yet and kill those running."""

    def begin_stage(self) -> None:
        """A new stage starts (its own bound on quick polls)."""
        return None

    def settle(self, tickets: list[Any]) -> None:
        """Every call of ``tickets`` is done: release what the executor keeps for them."""
        return None

    def run_all(self, task: Callable[[Any], Any], calls: Sequence[Any],
                timeout_s: float | None) -> list[Any]:
        """Run every call and return the outcomes in call order; the first failure is raised
        once every call still running was stopped."""
        tickets = self.submit(task, calls)
        slot = {id(t): i for i, t in enumerate(tickets)}
        outcomes: list[Any] = [None] * len(calls)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(tickets)
        self.begin_stage()
        try:
            while pending:
                left_s = None if deadline is None else deadline - time.monotonic()
                finished, pending = self.wait(pending, [calls[slot[id(t)]] for t in pending],
                                              left_s=left_s, pf=None)
                for ticket in finished:
                    outcomes[slot[id(ticket)]] = self.result(ticket)
        except BaseException as exc:
            self.stop(tickets, exc)
            raise
        self.settle(tickets)
        return outcomes


class LithopsShuffleExecutor(ShuffleExecutor):
    """The calls as Lithops functions of the ``fexec`` given (its jobs, its workers)."""

    name = "lithops"
    names_attempts = True

    def __init__(self, fexec: Any) -> None:
        self.fexec = fexec
        self._polls_left = FINISHED_POLLS_MAX

    def submit(self, task: Callable[[Any], Any], calls: Sequence[Any], *,
               first: bool = False) -> list[Any]:
        # Lithops' invoker keeps the queue: ``first`` cannot move a call ahead in it.
        return list(self.fexec.map(task, [(call,) for call in calls],
                                   exclude_modules=list(RUNTIME_PACKAGES)))

    def begin_stage(self) -> None:
        self._polls_left = FINISHED_POLLS_MAX

    def wait(self, pending: list[Any], calls: list[Any], *, left_s: float | None,
             pf: Client | None) -> tuple[list[Any], list[Any]]:
        from lithops.wait import ANY_COMPLETED

        from pocketflow_lithops.shuffle_tasks import _ReduceCall

        if pf is not None and self._polls_left > 0 and all(
                isinstance(c, _ReduceCall) and c.attempt for c in calls):
            try:
                finished, not_done, polls = self._wait_finished(
                    pf, pending, calls, left_s=left_s, polls_max=self._polls_left)
                self._polls_left -= polls
                return finished, not_done
            except PocketflowError as exc:
                # The markers only say when to look: without them, Lithops' own wait does.
                log.warning("shuffle: waiting for finished markers failed (%s); waiting for "
                            "Lithops' statuses instead", exc)
                self._polls_left = 0
        # Any completed call, not all: a failure is seen (and a mapper's raised) as it happens.
        finished, not_done = self.fexec.wait(pending, throw_except=False,
                                             return_when=ANY_COMPLETED, download_results=True,
                                             timeout=left_s, show_progressbar=False)
        return list(finished), list(not_done)

    def result(self, ticket: Any) -> Any:
        return ticket.result()

    def stop(self, tickets: list[Any], exc: BaseException) -> None:
        """Stop the Lithops jobs of ``tickets``: drop their calls not started yet and kill the
        processes running the others, as Lithops' own ``wait`` does when it raises.

        Lithops has no public call for this (its executor's context manager stops every job of
        the executor, which a caller's executor may not want), so this goes through the
        executor's own parts; an executor without them is left as it is, with a warning. The
        jobs' data goes to Lithops' cleaner only when the executor's ``data_cleaner`` is on: a
        driver that turned it off deletes its data itself
        (:mod:`pocketflow_lithops.executor_data`) and is not left with a cleaner process.
        """
        fexec = self.fexec
        try:
            fexec.invoker.discard_pending({f.job_key for f in tickets},
                                          {f.job_id for f in tickets})
            fexec.job_monitor.remove(tickets)
            fexec.compute_handler.clear({f.job_key for f in tickets}, exception=exc)
            if fexec.data_cleaner:
                fexec.clean(fs=tickets, clean_cloudobjects=False, force=True)
        except Exception as error:  # noqa: BLE001 - the shuffle's own error is the one to raise
            log.warning("shuffle: could not stop its Lithops calls (%s: %s); they run to their "
                        "end", type(error).__name__, error)

    def settle(self, tickets: list[Any]) -> None:
        # Every call is done: this wait returns at once and lets Lithops clean the jobs' data.
        self.fexec.wait(tickets, throw_except=False, show_progressbar=False)

    def run_all(self, task: Callable[[Any], Any], calls: Sequence[Any],
                timeout_s: float | None) -> list[Any]:
        futures = self.submit(task, calls)
        return list(self.fexec.get_result(futures, timeout=timeout_s, show_progressbar=False))

    def _wait_finished(
        self, pf: Client, pending: list[Any], calls: list[Any], *, left_s: float | None,
        polls_max: int,
    ) -> tuple[list[Any], list[Any], int]:
        """Wait for some of the ``pending`` reducer calls to be reported by Lithops: park on the
        servers until every one of them wrote its finished marker (at most
        ``FINISHED_WAIT_SLICE_S``), then look at Lithops' statuses once (which also shows calls
        that failed without a marker) or, when every marker is there, every
        ``FINISHED_POLL_INTERVAL_S`` until one is reported, at most ``polls_max`` times.

        Returns Lithops' done and not-done futures and how many of the quick looks it took.
        Raises ``TimeoutError`` once ``left_s`` is used up, as Lithops' own wait does.
        """
        from lithops.wait import ALWAYS

        from pocketflow_lithops.shuffle_tasks import finished_key

        if left_s is not None and left_s <= 0:
            raise TimeoutError("the shuffle's reducers did not finish within its timeout")
        slice_s = FINISHED_WAIT_SLICE_S if left_s is None else min(FINISHED_WAIT_SLICE_S,
                                                                    left_s)
        bucket = calls[0].spec.bucket
        keys = [finished_key(reducer=c.reducer, attempt=c.attempt) for c in calls]
        missing = pf.wait_for(bucket, keys, timeout_s=slice_s)
        polls = 0
        while True:
            finished, not_done = self.fexec.wait(pending, throw_except=False,
                                                 return_when=ALWAYS, download_results=True,
                                                 show_progressbar=False)
            if finished or missing:
                return list(finished), list(not_done), polls
            polls += 1
            if polls >= polls_max:
                return list(finished), list(not_done), polls
            time.sleep(FINISHED_POLL_INTERVAL_S)


def run_calls(task: Callable[[Any], Any], calls: Sequence[Any]) -> list[tuple[bool, Any]]:
    """Run ``task(call)`` for each call in order, in one Ray task: per call, ``(True,
    outcome)`` or ``(False, the exception it raised)``, so that one call's error does not cost
    the others their outcomes. The exception carries its traceback as a note (pickling drops
    the traceback itself)."""
    import traceback

    outcomes: list[tuple[bool, Any]] = []
    for call in calls:
        try:
            outcomes.append((True, task(call)))
        except Exception as exc:  # noqa: BLE001 - handed to the driver, which raises it
            exc.add_note("".join(traceback.format_exception(exc)))
            outcomes.append((False, _returnable(exc)))
    return outcomes


def _returnable(exc: Exception) -> Exception:
    """``exc``, or where it would not survive the trip to the driver (an exception class whose
    ``__init__`` wants other arguments than its ``args`` pickles but cannot be unpickled, which
    would lose every outcome of the bundle) a ``RuntimeError`` that names it and carries its
    message and traceback."""
    import pickle

    from ray import cloudpickle

    try:
        pickle.loads(cloudpickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to round-trip is the case handled here
        notes = "".join(f"\n{note}" for note in getattr(exc, "__notes__", ()))
        return RuntimeError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}{notes}")


class _RayBundle:
    """Consecutive calls of one stage run by one Ray task (``ref`` once started)."""

    __slots__ = ("task", "tickets", "ref", "outcomes", "parks")

    def __init__(self, task: Callable[[Any], Any], tickets: list[_RayTicket]) -> None:
        self.task = task
        self.tickets = tickets
        self.ref: Any = None
        self.outcomes: list[tuple[bool, Any]] | None = None
        parks = {getattr(t.call, "parks", None) for t in tickets}
        self.parks: bool | None = parks.pop() if len(parks) == 1 else None
        """Whether every call may park waiting for other calls' writes (``True``), none does
        (``False``), or it is not known of every call (``None``)."""


class _RayTicket:
    """One submitted call, run by its bundle's Ray task."""

    __slots__ = ("call", "bundle", "index")

    def __init__(self, call: Any) -> None:
        self.call = call
        self.bundle: _RayBundle | None = None
        self.index = 0
        """Where the call is in its bundle."""

    @property
    def ref(self) -> Any:
        """The Ray task running this call (``None`` while it is queued)."""
        return None if self.bundle is None else self.bundle.ref


def _waits_on_storage(bundle: _RayBundle) -> bool:
    """Whether every call of ``bundle`` says it mostly waits on storage."""
    return all(getattr(t.call, "waits_on_storage", False) for t in bundle.tickets)


class RayShuffleExecutor(ShuffleExecutor):
    """The calls as Ray tasks, at most ``tasks_max`` running at once (default: the Ray
    cluster's CPUs, at least 2), plus at most ``storage_tasks_extra`` more for calls that say
    they mostly wait on storage (default: ``RAY_STORAGE_TASKS_EXTRA_PER_SLOT`` per slot, none;
    see the module doc), each asking for an equal share of ``cpus`` (default: the cluster's CPUs;
    at most one CPU per task) so that all of them fit at once. Connects to the running Ray
    cluster (``address="auto"``) unless this process already is."""

    name = "ray"
    names_attempts = False

    def __init__(self, *, tasks_max: int | None = None, cpus: float | None = None,
                 storage_tasks_extra: int | None = None) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address="auto", log_to_driver=False)
        total_cpus = float(ray.cluster_resources().get("CPU", 1.0))
        cpus = total_cpus if cpus is None else cpus
        if tasks_max is None:
            tasks_max = max(2, int(total_cpus))
        if storage_tasks_extra is None:
            storage_tasks_extra = tasks_max * RAY_STORAGE_TASKS_EXTRA_PER_SLOT
        if not 1 <= tasks_max <= RAY_TASKS_MAX:
            raise ValueError(f"tasks_max must be in 1..{RAY_TASKS_MAX}, got {tasks_max}")
        if not 0 <= storage_tasks_extra <= RAY_TASKS_MAX - tasks_max:
            raise ValueError(f"storage_tasks_extra must be in 0..{RAY_TASKS_MAX - tasks_max}, "
                             f"got {storage_tasks_extra}")
        if not 0 < cpus <= total_cpus:
            raise ValueError(f"cpus must be in (0, {total_cpus}], got {cpus}")
        self.tasks_max = tasks_max
        self.storage_tasks_extra = storage_tasks_extra
        # Ray takes fractions of a CPU below one, to four decimals, and whole CPUs above. Every
        # task asks for the same share, so that the extra slots fit beside the others.
        self.num_cpus = min(1.0, math.floor(
            cpus / (tasks_max + storage_tasks_extra) * 10_000) / 10_000)
        self._remote: Any = None
        self._queued: deque[_RayBundle] = deque()
        self._first: deque[_RayBundle] = deque()
        """Bundles submitted with ``first``, started before any of ``_queued``."""
        self._running: dict[Any, _RayBundle] = {}
        self.queued_ahead_max = (
            tasks_max * RAY_QUEUED_AHEAD_PER_SLOT
            if storage_tasks_extra == 0 and self.num_cpus * (tasks_max + 1) > total_cpus
            else 0
        )
        """Calls handed to Ray beyond the free slots (see the module doc): only where Ray cannot
        run them at once, so that they wait in Ray's queue and never run beyond ``tasks_max``."""
        self._awaited = 0
        """Bundles submitted and not yet finished or stopped that do not say they park (a
        reducer may wait for their writes)."""
        self._leaving: list[_RayBundle] = []
        """Bundles the last :meth:`wait` found finished: they still count in ``_awaited`` until
        the next one, by when the driver has submitted again what failed in them (a mapper
        whose process died), so that no reducer goes ahead of that rerun."""

    def bundle_calls(self, calls: int, call_bytes: int | None) -> int:
        """How many consecutive calls of a stage of ``calls``, each moving about ``call_bytes``
        (``None``: not known), one Ray task runs."""
        if call_bytes is None or call_bytes > RAY_BUNDLE_CALL_BYTES_MAX:
            return 1
        return max(1, min(RAY_BUNDLE_CALLS_MAX,
                          calls // (self.tasks_max * RAY_BUNDLES_PER_SLOT)))

    def submit(self, task: Callable[[Any], Any], calls: Sequence[Any], *,
               first: bool = False) -> list[Any]:
        tickets = [_RayTicket(call) for call in calls]
        spec = getattr(calls[0], "spec", None) if calls else None
        size = self.bundle_calls(len(tickets), getattr(spec, "call_bytes", None))
        for start in range(0, len(tickets), size):
            bundle = _RayBundle(task, tickets[start:start + size])
            for index, ticket in enumerate(bundle.tickets):
                ticket.bundle, ticket.index = bundle, index
            if bundle.parks is not True:
                self._awaited += 1
            (self._first if first else self._queued).append(bundle)
        self._start_queued()
        return tickets

    def _start_queued(self) -> None:
        import ray

        if self._remote is None:
            self._remote = ray.remote(run_calls).options(num_cpus=self.num_cpus,
                                                         max_retries=0)
        while self._first or self._queued:
            queue = self._first or self._queued
            # A computing call keeps to tasks_max; one that waits on storage, and a call run
            # again (a mapper that queued reducers, perhaps in the extra slots, wait for), may
            # take the extra slots too.
            slots = self.tasks_max
            if queue is self._first or _waits_on_storage(queue[0]):
                slots += self.storage_tasks_extra
            if len(self._running) >= slots and not (
                    len(self._running) < slots + self.queued_ahead_max
                    and self._may_queue_ahead(queue[0])):
                break
            bundle = queue.popleft()
            bundle.ref = self._remote.remote(bundle.task, [t.call for t in bundle.tickets])
            self._running[bundle.ref] = bundle

    def _may_queue_ahead(self, bundle: _RayBundle) -> bool:
        """Whether ``bundle`` may wait in Ray's queue for a slot: its calls never park, or they
        may park and every bundle outstanding (its own included) parks too, so none of them
        writes what a parked call waits for."""
        if bundle.parks is False:
            return True
        return bundle.parks is True and self._awaited == 0

    def _finished(self, bundle: _RayBundle) -> None:
        """``bundle`` left the executor (finished, or stopped)."""
        if bundle.parks is not True:
            self._awaited -= 1

    def wait(self, pending: list[Any], calls: list[Any], *, left_s: float | None,
             pf: Client | None) -> tuple[list[Any], list[Any]]:
        import ray

        deadline = None if left_s is None else time.monotonic() + left_s
        # Slots freed by the last wait are filled only now, once the driver has resubmitted
        # what failed in them: a mapper run again takes a freed slot before a queued reducer,
        # which would park there waiting for that very mapper.
        for bundle in self._leaving:
            self._finished(bundle)
        self._leaving.clear()
        self._start_queued()
        while True:
            running = list({id(t.ref): t.ref for t in pending if t.ref is not None}.values())
            if not running:
                raise RuntimeError("no call of the stage is running (tickets of a stopped "
                                   "shuffle?)")
            slice_s = RAY_WAIT_SLICE_S
            if deadline is not None:
                slice_s = min(slice_s, deadline - time.monotonic())
                if slice_s <= 0:
                    raise TimeoutError("the shuffle's tasks did not finish within its timeout")
            ready, _ = ray.wait(running, num_returns=1, timeout=slice_s)
            if ready:
                ready, _ = ray.wait(running, num_returns=len(running), timeout=0)
                done = set(ready)
                for ref in ready:
                    bundle = self._running.pop(ref, None)
                    if bundle is not None:
                        self._leaving.append(bundle)
                finished = [t for t in pending if t.ref is not None and t.ref in done]
                finished_ids = set(map(id, finished))
                return finished, [t for t in pending if id(t) not in finished_ids]

    def result(self, ticket: Any) -> Any:
        import ray
        from ray.exceptions import RayTaskError, WorkerCrashedError

        bundle = ticket.bundle
        if bundle.outcomes is None:
            try:
                bundle.outcomes = ray.get(bundle.ref)
            except RayTaskError as exc:
                cause = exc.cause if exc.cause is not None else exc
                raise cause from None
            except WorkerCrashedError as exc:
                raise TaskProcessDied(f"the process of {ticket.call!r} died: {exc}") from exc
        ok, outcome = bundle.outcomes[ticket.index]
        if not ok:
            raise outcome
        return outcome

    def stop(self, tickets: list[Any], exc: BaseException) -> None:
        import ray

        stopping = {id(t.bundle) for t in tickets}
        for queue in (self._queued, self._first):
            for bundle in queue:
                if id(bundle) in stopping:
                    self._finished(bundle)
        self._queued = deque(b for b in self._queued if id(b) not in stopping)
        self._first = deque(b for b in self._first if id(b) not in stopping)
        for ticket in tickets:
            bundle = self._running.pop(ticket.ref, None) if ticket.ref is not None else None
            if bundle is not None:
                self._finished(bundle)
                try:
                    # force: the worker process is killed, so no task of a failed shuffle
                    # goes on writing into (or parking on) its job.
                    ray.cancel(ticket.ref, force=True)
                except Exception as error:  # noqa: BLE001 - already finished, or Ray is gone
                    log.debug("shuffle: could not cancel a Ray task: %s", error)


def shuffle_executor(executor: Any) -> ShuffleExecutor:
    """``executor`` as a :class:`ShuffleExecutor`: one already, ``"ray"`` (a
    :class:`RayShuffleExecutor` with its defaults), or a ``lithops.FunctionExecutor``."""
    if isinstance(executor, ShuffleExecutor):
        return executor
    if isinstance(executor, str):
        if executor == "ray":
            return RayShuffleExecutor()
        raise ValueError(f"unknown executor {executor!r}: pass 'ray', a RayShuffleExecutor, or "
                         f"a lithops.FunctionExecutor")
    if hasattr(executor, "map") and hasattr(executor, "wait"):
        return LithopsShuffleExecutor(executor)
    raise TypeError(f"not an executor: {type(executor).__name__}")
