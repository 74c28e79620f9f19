"""A drop-in shuffle for Lithops and Ray: map and reduce tasks pass their partitions through
pocketflow.

::

    def mapper(item, emit):              # runs in a Lithops worker or a Ray task
        for record in read(item):
            emit(partition_of(record), record)
        return len(item)                 # any picklable value, returned to the driver

    def reducer(partition, inputs):      # inputs: one bytes object per mapper, mapper order
        return b"".join(sorted(inputs))

    fexec = lithops.FunctionExecutor(config=...)
    result = shuffle(fexec, mapper, reducer, items, reducers=8, cluster=cluster,
                     input_size_bytes=total, persist_output=True)
    result = shuffle("ray", mapper, reducer, items, reducers=8, cluster=cluster)  # Ray tasks

What it does, in Pocket's terms:

- **Executors.** The first argument says where the tasks run, per call: Lithops functions or
  Ray tasks (:mod:`pocketflow_lithops.shuffle_executors`). The driver below is the same on both:
  hints, flags, waiting, regeneration and retries do not depend on it. Only how the driver hears
  of a finished task differs (Ray tells it; Lithops is polled, see the last point).

- **Hints.** The shuffle registers its own pocketflow job with what it knows: mappers plus
  reducers as the most concurrent tasks (reducers start while mappers still run) and, as the
  data size, the most bytes it holds at once (:func:`shuffle_data_bytes`): the larger of the
  input and the PERSIST outputs (``output_size_bytes``, by default the input's size), or their
  sum when the inputs are kept (no DELETE reads). The
  job's weight map splits its data over the tiers in proportion to that reservation, so
  reserving the outputs as well as the inputs they replace would leave half of the DRAM share
  unused and send twice the bytes to NVMe. It deregisters the job at the end, also when a task
  fails, which frees every shuffle object left behind. Pass ``job=`` to run inside a job you
  manage instead.
- **One object per (mapper, reducer).** Mapper ``m`` writes ``r{r:05d}/m{m:05d}`` for every
  reducer ``r``, an empty object when it emitted nothing for ``r``, so a reducer always knows
  exactly which ``M`` objects to read. Each is read once, with DELETE-on-read. Where
  ``input_size_bytes`` says partitions are larger than the job's block size, the tasks' clients
  write with a block size that holds one (:func:`shuffle_block_bytes`, at most
  ``SHUFFLE_BLOCK_MAX_BYTES``), unless the caller sets one (``client_options``, the
  environment or the config file): a reducer reads an object of one data block with one READ
  that also claims it. Where the shuffle picked the block size, a reducer's PERSIST output
  keeps the job's: it takes the DRAM its consumed partitions left, holes of a partition's size
  between partitions not yet read, and a larger block fits none of them (the server refuses it
  for want of a free extent and the writer overflows to NVMe). Where the caller set one,
  partitions and outputs are both written with the caller's.
- **Final outputs.** With ``persist_output`` the reducer's bytes are written with PERSIST to
  ``output_bucket`` and outlive the job; the driver gets :class:`OutputInfo` (key and size) and
  reads them with :func:`pocketflow.connect` and :attr:`ShuffleResult.handle_json`. Without it
  the reducer's return value comes back through the executor.
- **Reducers wait without spinning.** Mappers and then reducers are submitted as one stage (one
  Lithops job), so reducers start as soon as workers free up, before all mappers finish. A reducer
  waits for its inputs with :meth:`pocketflow.Client.wait_for`: the storage server parks the
  call (the ``wait`` action) until the last awaited key is put, so no reducer polls with
  ``not_found`` and none sleeps longer than needed; each call is bounded
  (``WAIT_TIMEOUT_MAX_MS``) and the whole wait by ``input_wait_s``. A server-side wait was
  chosen over a client-side exponential backoff because backoff either burns a round trip per
  key per retry or adds up to one backoff interval of latency per partition, and a parked call
  costs the server only an HTTP/2 stream.
- **Lost partitions are regenerated.** When a storage server dies mid-shuffle, pocketflow's
  control plane moves the job to a new weight-map epoch without it (clients learn the new map
  from any live server, ``stale_epoch``), and reads of what it held raise
  :class:`~pocketflow.errors.DataUnavailable`. A reducer that meets it puts back the inputs it
  already consumed (under the new map) and reports which mappers' outputs were lost; the driver
  reruns exactly those mappers, writing only the lost partitions, and reruns the reducer, at most
  ``regenerate_rounds_max`` times. A mapper whose write fails the same way waits for the new map
  and writes again (keys it already wrote are kept: ``ObjectExists`` is expected there).
  An input whose server answers :class:`~pocketflow.errors.DataLost` (it accepted the bytes,
  then a write behind the put failed in its NVMe device) is lost the same way: the reducer
  deletes its record, so that the rerun's write-once put writes it again, and reports it with
  the server the error names; the driver avoids that server for the rest of the job, writing
  each partition it regenerates under a key whose home is another server
  (:func:`~pocketflow_lithops.shuffle_tasks.steered_key`).
- **A retried reducer recovers what its earlier attempt consumed.** Before each round of DELETE
  reads a reducer writes a small marker, ``consuming/r{r:05d}/<attempt>``, naming the mappers
  whose inputs it is about to consume. A reducer first reads every input that is there (its
  marker names them all before that read, and only those it consumed after, when some were not
  there), then looks for the others without waiting; if some are missing, it reads its
  reducer's markers: inputs that a marker names and no live server holds were consumed by an
  attempt that never committed, so it reads nothing more, puts back what it read and reports
  them as lost, as after a dead server, and the driver reruns exactly those mappers for that
  partition. The driver submits a reducer again when its task fails, at most
  ``reduce_retries`` times; a retry by anyone else (Lithops, a FaaS platform) recovers the same
  way. Inputs missing with no marker naming them are awaited, and after ``input_wait_s`` fail
  the shuffle with :class:`ShuffleFailed`. The driver deletes the markers once every reducer is
  done. Why lineage, and not holding inputs until the reducer commits: the package's README.
- **A mapper whose process died runs again.** Its writes are write-once, so the rerun keeps
  what the dead process wrote and writes the rest, at most ``map_retries`` times (the Ray
  executor tells a dead process from a raise; a mapper that raised fails the shuffle). What it
  writes again after a reducer consumed the first copy is deleted once every reducer has
  committed.
- **With Lithops, the driver hears of returning reducers from the servers.** Lithops reports
  a finished call by a status its driver polls for (every 0.1 s with its localhost storage),
  which at the end of a shuffle is time nobody works. Each reducer attempt therefore writes a
  small marker, ``finished/r{r:05d}/<attempt>``, as it returns; once every mapper's result is
  in, the driver parks on the servers for the markers of the reducers still pending
  (``wait_for``, in slices of ``FINISHED_WAIT_SLICE_S``, between which it looks at Lithops'
  statuses for failed calls) and, when all are there, looks at the statuses every
  ``FINISHED_POLL_INTERVAL_S`` until Lithops has them, at most ``FINISHED_POLLS_MAX`` times per
  stage before it goes back to Lithops' own wait (the constants are in
  :mod:`pocketflow_lithops.shuffle_executors`). Every result still comes from Lithops; the
  markers only say when to look.

Task code (:mod:`pocketflow_lithops.shuffle_tasks`, kept apart so that the process Lithops
forks for each task imports only it) runs in Lithops' worker processes or Ray's, which import it
from the installed ``pocketflow-lithops`` package (``adapters/lithops``). Tasks talk straight to
the storage servers with the job handle, never to the control plane. Neither this module nor
the tasks import Lithops unless the Lithops executor runs them.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pocketflow.config import ClientConfig
from pocketflow.errors import (
    BucketExists,
    CapacityExhausted,
    ObjectNotFound,
    PocketflowError,
    ShuffleFailed,
)
from pocketflow.placement import Placement
from pocketflow_lithops.append_shuffle import run_append_layout
from pocketflow_lithops.shuffle_executors import (
    ShuffleExecutor,
    TaskProcessDied,
    shuffle_executor,
)
from pocketflow_lithops.shuffle_result import ShuffleResult
from pocketflow_lithops.shuffle_tasks import (
    CLUSTER_GONE,
    CLUSTER_GONE_SETTLE_S,
    CONSUMING_PREFIX,
    FINISHED_PREFIX,
    INPUT_KEY_PREFIX,
    OUTPUT_BUCKET,
    SHUFFLE_BUCKET,
    OutputInfo,
    _MapCall,
    _MapOutcome,
    _ReduceCall,
    _ReduceOutcome,
    _shuffle_task,
    _Spec,
    cluster_gone,
    consuming_key,
    data_on_nvme,
    finished_key,
    output_key,
    raise_if_cluster_gone,
    reducer_prefix,
    refresh_map,
    shuffle_key,
    steered_key,
)

if TYPE_CHECKING:
    from pocketflow.client import Client
    from pocketflow.job import Hints, Job

__all__ = [
    "OutputInfo",
    "ShuffleResult",
    "shuffle",
    "shuffle_data_bytes",
    "shuffle_hints",
    "shuffle_key",
    "output_key",
    "consuming_key",
    "finished_key",
    "SHUFFLE_BUCKET",
    "OUTPUT_BUCKET",
]

log = logging.getLogger(__name__)

TASKS_PER_STAGE_MAX = 4096
"""Most mappers, and most reducers, of one shuffle."""
INPUT_WAIT_DEFAULT_S = 300.0
"""Default bound on how long a reducer waits for all of its inputs."""
REGENERATE_ROUNDS_MAX = 3
"""Default bound on rounds of rerunning mappers and reducers after lost partitions."""
MARKERS_PREFIX = "done"
"""Lease prefix of the append layout's mapper markers (``done/m00003``)."""
LAYOUTS = ("objects", "append")
"""Shuffle layouts: one object per (mapper, reducer), or one append file per reducer."""
SHUFFLE_BLOCK_MAX_BYTES = 8 * 1024 * 1024
"""Largest block size :func:`shuffle_block_bytes` gives a shuffle's clients."""
SHUFFLE_BLOCK_SLACK = 1.25
"""How much larger than the mean a partition may be and still be one block."""
REDUCE_RETRIES_DEFAULT = 2
"""Default bound on how many times the driver submits one reducer again after its task failed."""
MAP_RETRIES_DEFAULT = 2
"""Default bound on how many times the driver submits one mapper again after its process died
(:class:`TaskProcessDied`; a mapper that raised is never retried)."""


def shuffle(
    executor: Any,
    map_function: Callable[[Any, Callable[[int, Any], None]], Any],
    reduce_function: Callable[[int, list[bytes]], Any],
    map_inputs: Sequence[Any],
    *,
    reducers: int,
    cluster: Any = None,
    job: Job | None = None,
    name: str = "lithops-shuffle",
    input_size_bytes: int | None = None,
    output_size_bytes: int | None = None,
    persist_output: bool = False,
    output_bucket: str = OUTPUT_BUCKET,
    input_wait_s: float = INPUT_WAIT_DEFAULT_S,
    regenerate_rounds_max: int = REGENERATE_ROUNDS_MAX,
    reduce_retries: int = REDUCE_RETRIES_DEFAULT,
    client_options: dict[str, Any] | None = None,
    delete_inputs: bool = True,
    timeout_s: float | None = None,
    layout: str = "objects",
    prefix_lease_ms: int | None = None,
    map_retries: int = MAP_RETRIES_DEFAULT,
) -> ShuffleResult:
    """Run a map/shuffle/reduce on Lithops functions or Ray tasks, shuffling through pocketflow.

    ``executor`` says where the tasks run (:mod:`pocketflow_lithops.shuffle_executors`): a
    ``lithops.FunctionExecutor``, ``"ray"`` (Ray tasks on the Ray cluster this process is
    connected to, or ``address="auto"``), or a :class:`~pocketflow_lithops.shuffle_executors.
    RayShuffleExecutor` sized by the caller. Everything else is the same on both.

    ``map_function(item, emit)`` runs once per item of ``map_inputs`` and calls
    ``emit(partition, data)`` with ``0 <= partition < reducers`` and bytes-like ``data`` (several
    emits to one partition are concatenated in order); its return value comes back in
    :attr:`ShuffleResult.map_values`. ``reduce_function(partition, inputs)`` gets one ``bytes``
    per mapper, in mapper order. ``input_size_bytes`` (what the mappers emit in all) and
    ``output_size_bytes`` (the PERSIST outputs in all; by default as large as the input) size
    the job's reservation (:func:`shuffle_data_bytes`). See the module docstring for hints,
    flags, waiting and
    regeneration. ``cluster`` is what :func:`pocketflow.register_job` takes; ``job`` runs the
    shuffle in an already registered job (not deregistered here). ``client_options`` are
    :class:`~pocketflow.config.ClientConfig` settings for the tasks' clients.
    ``reduce_retries`` bounds how many times one reducer is submitted again after its task
    failed; ``map_retries`` how many times one mapper whose process died is submitted again
    (:class:`~pocketflow_lithops.shuffle_executors.TaskProcessDied`, told apart from a raise by
    the Ray executor; a mapper that raised is never retried: it fails the shuffle at once).
    ``delete_inputs=False`` reads the shuffle objects without DELETE (they then live until the
    job is deregistered); it exists to measure what DELETE saves. ``timeout_s`` bounds each wait
    for a stage's results (``TimeoutError``; Lithops arms ``SIGALRM`` for it, so with Lithops
    pass it only from the main thread). ``layout="append"`` shuffles through one shared append file
    per reducer instead of one object per (mapper, reducer)
    (:mod:`pocketflow_lithops.append_shuffle`: no regeneration, no reducer retries).
    ``prefix_lease_ms`` scopes the shuffle's data to prefix leases (:mod:`pocketflow.prefixes`):
    one prefix per reducer (``r00003``) and one for the mappers' markers (``done``), renewed by
    the driver every third of the lease while the shuffle runs; if the driver dies, the servers
    free the shuffle's data one lease later instead of when the job's lease runs out. With
    ``job=``, that job's ``prefix_lease_ms`` applies.

    Raises :class:`ShuffleFailed` when lost partitions could not be regenerated within
    ``regenerate_rounds_max`` rounds or a reducer's inputs did not arrive, and whatever a mapper
    raised, or a reducer on its last attempt (Lithops re-raises it here).
    """
    from pocketflow.job import register_job

    mappers = len(map_inputs)
    for what, count in (("mappers", mappers), ("reducers", reducers)):
        if not 1 <= count <= TASKS_PER_STAGE_MAX:
            raise ValueError(f"{what} must be in 1..{TASKS_PER_STAGE_MAX}, got {count}")
    if not 0 < input_wait_s < float("inf"):
        raise ValueError(f"input_wait_s must be positive and finite, got {input_wait_s}")
    if regenerate_rounds_max < 0:
        raise ValueError("regenerate_rounds_max must be >= 0")
    if reduce_retries < 0:
        raise ValueError("reduce_retries must be >= 0")
    if map_retries < 0:
        raise ValueError("map_retries must be >= 0")
    for what, size in (("input_size_bytes", input_size_bytes),
                       ("output_size_bytes", output_size_bytes)):
        if size is not None and size < 0:
            raise ValueError(f"{what} must be >= 0, got {size}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    tasks = shuffle_executor(executor)
    if job is not None:
        return _run(tasks, job, map_function, reduce_function, map_inputs, reducers,
                    persist_output, output_bucket, input_wait_s, regenerate_rounds_max,
                    reduce_retries, client_options, delete_inputs, timeout_s, layout,
                    prefix_lease_ms is not None, map_retries, input_size_bytes)
    hints = shuffle_hints(mappers, reducers, shuffle_data_bytes(
        input_size_bytes, output_size_bytes=output_size_bytes, persist_output=persist_output,
        delete_inputs=delete_inputs))
    # The context manager deregisters the job also when a task (or this driver) fails.
    leases = {} if prefix_lease_ms is None else {"prefix_lease_ms": prefix_lease_ms}
    with register_job(name, hints, cluster=cluster, **leases) as own_job:
        return _run(tasks, own_job, map_function, reduce_function, map_inputs, reducers,
                    persist_output, output_bucket, input_wait_s, regenerate_rounds_max,
                    reduce_retries, client_options, delete_inputs, timeout_s, layout,
                    prefix_lease_ms is not None, map_retries, input_size_bytes)


def shuffle_hints(mappers: int, reducers: int, data_size_bytes: int | None) -> Hints:
    """The hints a shuffle registers its own job with (see the module doc); ``data_size_bytes``
    from :func:`shuffle_data_bytes`."""
    from pocketflow.job import Hints

    return Hints(max_concurrent_tasks=min(mappers + reducers, 1_000_000),
                 data_size_bytes=data_size_bytes)


def shuffle_block_bytes(partition_bytes: int, job_block_bytes: int) -> int:
    """The block size of a shuffle's clients whose partitions hold ``partition_bytes`` on
    average: the job's, unless a partition (with ``SHUFFLE_BLOCK_SLACK`` for uneven ones) is
    larger, then the MiB multiple that holds it, at most ``SHUFFLE_BLOCK_MAX_BYTES``. A reducer
    reads an object of one data block with one READ that also claims it (DELETE-on-read); one of
    several blocks costs it a record read, a block read per block and two claim actions."""
    mib = 1024 * 1024
    wanted = -(-int(partition_bytes * SHUFFLE_BLOCK_SLACK) // mib) * mib
    return max(job_block_bytes, min(wanted, SHUFFLE_BLOCK_MAX_BYTES))


def shuffle_data_bytes(input_size_bytes: int | None, *, persist_output: bool,
                       delete_inputs: bool, output_size_bytes: int | None = None) -> int | None:
    """The most bytes a shuffle holds at once, from ``input_size_bytes`` (what its mappers
    emit) and ``output_size_bytes`` (its PERSIST outputs; ``None``: as large as the input);
    ``None`` when the input size is not known.

    With DELETE reads a reducer frees its inputs as it reads them and only then writes its
    output, and no reducer has all its inputs before every mapper has written its partition,
    so the outputs take the place of the inputs they replace: the larger of the two (outputs
    in proportion to their inputs). Without DELETE reads the inputs stay until the job ends,
    beside the outputs: their sum. Outputs that come back through the executor hold nothing on
    the servers.
    """
    if input_size_bytes is None:
        return None
    if not persist_output:
        return input_size_bytes
    outputs = input_size_bytes if output_size_bytes is None else output_size_bytes
    if delete_inputs:
        return max(input_size_bytes, outputs)
    return input_size_bytes + outputs


def _run(
    executor: ShuffleExecutor, job: Job, map_function: Callable[..., Any],
    reduce_function: Callable[[int, list[bytes]], Any], map_inputs: Sequence[Any],
    reducers: int, persist_output: bool, output_bucket: str, input_wait_s: float,
    regenerate_rounds_max: int, reduce_retries: int, client_options: dict[str, Any] | None,
    delete_inputs: bool, timeout_s: float | None, layout: str = "objects",
    scoped: bool = False, map_retries: int = MAP_RETRIES_DEFAULT,
    input_size_bytes: int | None = None,
) -> ShuffleResult:
    if not scoped:
        return _run_stages(executor, job, map_function, reduce_function, map_inputs, reducers,
                           persist_output, output_bucket, input_wait_s, regenerate_rounds_max,
                           reduce_retries, client_options, delete_inputs, timeout_s, layout,
                           map_retries, input_size_bytes)
    prefixes = [reducer_prefix(r) for r in range(reducers)] + [MARKERS_PREFIX]
    job.declare_many([(prefix, (), None) for prefix in prefixes])  # one renewal per server
    with job.keep(prefixes):
        return _run_stages(executor, job, map_function, reduce_function, map_inputs, reducers,
                           persist_output, output_bucket, input_wait_s, regenerate_rounds_max,
                           reduce_retries, client_options, delete_inputs, timeout_s, layout,
                           map_retries, input_size_bytes)


def _run_stages(
    executor: ShuffleExecutor, job: Job, map_function: Callable[..., Any],
    reduce_function: Callable[[int, list[bytes]], Any], map_inputs: Sequence[Any],
    reducers: int, persist_output: bool, output_bucket: str, input_wait_s: float,
    regenerate_rounds_max: int, reduce_retries: int, client_options: dict[str, Any] | None,
    delete_inputs: bool, timeout_s: float | None, layout: str, map_retries: int,
    input_size_bytes: int | None,
) -> ShuffleResult:
    started = time.perf_counter()
    started_unix_s = time.time()
    options = dict(client_options or {})
    # Each (mapper, reducer) object of one data block where the input size says how large
    # they are, unless the caller chose the block size. The outputs then keep the job's; with
    # the caller's choice, both use it (module doc, "One object per (mapper, reducer)").
    output_block_bytes = None
    if (layout == "objects" and input_size_bytes is not None
            and "block_size_bytes" not in ClientConfig.resolve(**options).explicit):
        block_bytes = shuffle_block_bytes(input_size_bytes // (len(map_inputs) * reducers),
                                          job.handle.block_size_bytes)
        if block_bytes != job.handle.block_size_bytes:
            options["block_size_bytes"] = block_bytes
            output_block_bytes = job.handle.block_size_bytes
    with job.connect(**options) as pf:
        for bucket in (SHUFFLE_BUCKET, output_bucket) if persist_output else (SHUFFLE_BUCKET,):
            try:
                pf.create_bucket(bucket)
            except BucketExists:
                pass
        spec = _Spec(
            handle_json=pf.handle.to_json(),
            mappers=len(map_inputs),
            reducers=reducers,
            bucket=SHUFFLE_BUCKET,
            output_bucket=output_bucket,
            persist_output=persist_output,
            input_wait_s=input_wait_s,
            client_options=tuple(sorted(options.items())),
            delete_inputs=delete_inputs,
            # What one task writes or reads, where the input size is known: an executor may
            # run small calls several to a task.
            call_bytes=None if input_size_bytes is None else
            input_size_bytes // min(len(map_inputs), reducers),
            on_nvme=data_on_nvme(pf.handle),
            output_block_bytes=output_block_bytes if persist_output else None,
        )
        if layout == "append":
            return run_append_layout(executor, pf, job.job_id, map_function, reduce_function,
                                     map_inputs, spec, timeout_s)
        map_calls = [_MapCall(spec, map_function, item, m, None)
                     for m, item in enumerate(map_inputs)]
        reduce_calls = [_ReduceCall(spec, reduce_function, r) for r in range(reducers)]
        retries_left = dict.fromkeys(range(reducers), reduce_retries)
        map_retries_left = dict.fromkeys(range(len(map_inputs)), map_retries)
        retried: list[int] = []
        try:
            # One stage (one Lithops job) holds every mapper and then every reducer: executors
            # start calls in order as workers free up (Lithops' localhost v1 runs whole jobs
            # one after another; the Ray executor keeps its own queue), so reducers start while
            # the last mappers run and park on the servers until their inputs are written,
            # instead of waiting for a barrier. All mappers come first, so a worker held by a
            # parked reducer never keeps a mapper from running.
            outcomes = _gather(executor, map_calls + reduce_calls, retries_left=retries_left,
                               map_retries_left=map_retries_left, retried=retried,
                               timeout_s=timeout_s, pf=pf)
            map_outcomes: list[_MapOutcome] = outcomes[:len(map_calls)]
            reduce_outcomes: list[_ReduceOutcome] = outcomes[len(map_calls):]
            map_s = max(o.finished_unix_s for o in map_outcomes) - started_unix_s

            done = {o.reducer: o for o in reduce_outcomes if not o.lost_mappers}
            failed = [o for o in reduce_outcomes if o.lost_mappers]
            regenerated: list[list[tuple[int, int]]] = []
            # Servers that lost data behind their puts (DataLost), for the rest of the job (at
            # most the job's servers), and the keys of the partitions steered off them.
            lossy: set[str] = set()
            steered: dict[tuple[int, int], str] = {}
            rewritten_bytes = 0
            while failed:
                if len(regenerated) == regenerate_rounds_max:
                    lost = sorted({(m, o.reducer) for o in failed for m in o.lost_mappers})
                    raise ShuffleFailed(
                        f"partitions {lost[:8]}{'...' if len(lost) > 8 else ''} still lost "
                        f"after {regenerate_rounds_max} rounds of regeneration"
                    )
                # Reruns and retries get the map without the lost servers, so none of them
                # starts by reaching for a dead server.
                unreachable = {a for o in failed for a in o.unreachable}
                if unreachable:
                    refresh_map(pf, unreachable, bucket=SHUFFLE_BUCKET)
                spec = spec._replace(handle_json=pf.handle.to_json())
                lost_by_mapper: dict[int, set[int]] = {}
                for outcome in failed:
                    for mapper in outcome.lost_mappers:
                        lost_by_mapper.setdefault(mapper, set()).add(outcome.reducer)
                lossy |= {a for o in failed for a in o.lossy}
                if lossy:
                    spec = _steer(spec, pf, lossy, lost_by_mapper, steered)
                regenerated.append(
                    sorted((m, r) for m, rs in lost_by_mapper.items() for r in rs)
                )
                log.warning("shuffle %s: regenerating %d lost partitions of %d mappers",
                            job.job_id, len(regenerated[-1]), len(lost_by_mapper))
                reruns = [_MapCall(spec, map_function, map_inputs[m], m, frozenset(rs))
                          for m, rs in sorted(lost_by_mapper.items())]
                rewritten_bytes += sum(
                    o.bytes_written
                    for o in _gather(executor, reruns, retries_left=retries_left,
                                     map_retries_left=map_retries_left, retried=retried,
                                     timeout_s=timeout_s, pf=pf)
                )
                outcomes = _gather(
                    executor, [_ReduceCall(spec, reduce_function, o.reducer) for o in failed],
                    retries_left=retries_left, map_retries_left=map_retries_left,
                    retried=retried, timeout_s=timeout_s, pf=pf,
                )
                done.update({o.reducer: o for o in outcomes if not o.lost_mappers})
                failed = [o for o in outcomes if o.lost_mappers]
        except BaseException as failure:
            # Deleting the bucket wakes reducers still parked on it; they fail at once instead
            # of holding their workers until their wait bound.
            try:
                pf.delete_bucket(SHUFFLE_BUCKET)
            except PocketflowError as exc:
                log.warning("shuffle %s: could not delete its bucket: %s", job.job_id, exc)
            # Whatever failed first (a task's lost connection, a mapper's error, a wait), a
            # shuffle whose cluster is gone says so.
            if (isinstance(failure, Exception) and CLUSTER_GONE not in str(failure)
                    and not isinstance(failure, CapacityExhausted)):
                gone = cluster_gone(pf, settle_s=CLUSTER_GONE_SETTLE_S)
                if gone is not None:
                    raise gone from failure
            raise
        # Every reducer has committed: the markers of its attempts are no longer needed.
        pf.delete_prefix(SHUFFLE_BUCKET, CONSUMING_PREFIX)
        pf.delete_prefix(SHUFFLE_BUCKET, FINISHED_PREFIX)
        if delete_inputs:
            _delete_inputs_written_again(pf, mappers=len(map_inputs), reducers=reducers,
                                         steered=spec.steered)
        handle_json = pf.handle.to_json()

    ordered = [done[r] for r in range(reducers)]
    return ShuffleResult(
        job_id=job.job_id,
        handle_json=handle_json,
        outputs=[o.value for o in ordered],
        map_values=[o.value for o in sorted(map_outcomes, key=lambda o: o.mapper)],
        elapsed_s=time.perf_counter() - started,
        map_s=map_s,
        bytes_shuffled=sum(o.bytes_written for o in map_outcomes) + rewritten_bytes,
        bytes_read=sum(o.bytes_read for o in ordered),
        input_wait_s=[o.wait_s for o in ordered],
        io_s=[o.io_s for o in ordered],
        map_io_s=[o.io_s for o in sorted(map_outcomes, key=lambda o: o.mapper)],
        reduce_s=[o.reduce_s for o in ordered],
        output_write_s=[o.write_s for o in ordered],
        regenerated=regenerated,
        retried=retried,
    )


def _steer(spec: _Spec, pf: Client, lossy: set[str], lost_by_mapper: dict[int, set[int]],
           steered: dict[tuple[int, int], str]) -> _Spec:
    """``spec`` naming, for each partition about to be regenerated, a key whose home under
    ``pf``'s map is none of the ``lossy`` servers (:func:`steered_key`), so that the rerun does
    not write it again where its bytes were lost; ``steered`` keeps every partition's choice for
    the rest of the job (the latest one wins)."""
    placement = Placement.of_handle(pf.handle)
    avoid = frozenset(lossy)
    for mapper, reducers_lost in lost_by_mapper.items():
        for reducer in reducers_lost:
            key = steered_key(mapper=mapper, reducer=reducer, avoid=avoid, placement=placement)
            if key == shuffle_key(mapper=mapper, reducer=reducer):
                steered.pop((mapper, reducer), None)
            else:
                steered[(mapper, reducer)] = key
    log.warning("shuffle: avoiding %s (lost data) for %d regenerated partitions",
                sorted(lossy), len(steered))
    return spec._replace(steered=tuple(sorted((m, r, k) for (m, r), k in steered.items())))


def _delete_inputs_written_again(pf: Client, *, mappers: int, reducers: int,
                                 steered: tuple[tuple[int, int, str], ...] = ()) -> None:
    """Delete this shuffle's inputs still in the shuffle bucket once every reducer committed.

    A mapper whose process died after writing its partitions runs again, and its rerun writes
    again every partition whose first copy a reducer has meanwhile consumed (write-once refuses
    only the ones still there): with every reducer committed, those copies are garbage that
    would hold the job's capacity until it ends. Without a rerun none is left, and this costs
    one listing per server.
    """
    left = pf.list(SHUFFLE_BUCKET, INPUT_KEY_PREFIX)
    if not left:
        return  # the common case: no key set to build (mappers x reducers names)
    mine = {shuffle_key(mapper=m, reducer=r) for m in range(mappers) for r in range(reducers)}
    mine |= {key for _, _, key in steered}
    for info in left:
        if info.key in mine:
            try:
                pf.delete(SHUFFLE_BUCKET, info.key)
            except ObjectNotFound:
                pass


def _gather(
    executor: ShuffleExecutor, calls: Sequence[_MapCall | _ReduceCall], *,
    retries_left: dict[int, int], map_retries_left: dict[int, int], retried: list[int],
    timeout_s: float | None, pf: Client | None = None,
) -> list[Any]:
    """Run ``calls`` as one stage of the executor and return their outcomes, in the order of
    ``calls``.

    A reducer whose task failed (it raised, or its process died) is submitted again while
    ``retries_left[reducer]`` allows, and the reducer is appended to ``retried``; it recovers
    the inputs its failed attempt consumed through its markers (see the module doc). A mapper
    whose process died (:class:`TaskProcessDied`: the Ray executor tells it apart from a raise)
    is submitted again while ``map_retries_left[mapper]`` allows: its writes are write-once, so a
    rerun keeps what the dead one wrote and writes the rest. Raised at once, without a retry: a
    mapper's exception, a reducer's :class:`ShuffleFailed` (its inputs never arrived: a retry
    would only wait again), a task's :class:`CapacityExhausted` (every tier of the job is full:
    a retry, or the regeneration of the inputs a failed reducer consumed, would write into the
    same full tiers, so a reducer that could not write its output is not a lost partition), a
    failure once no storage server of the job answers (:func:`raise_if_cluster_gone`), and a
    task's failure with no retries left. ``timeout_s`` bounds the whole wait
    (``TimeoutError``). With ``pf`` (the driver's client), an executor that learns of results by
    polling (Lithops) learns that reducers returned from their finished markers.

    Whatever it raises, the calls of this stage still queued or running are stopped first
    (:meth:`ShuffleExecutor.stop`), so that no task of a failed shuffle goes on.
    """
    submitted = [_new_attempt(executor, call) for call in calls]
    tickets = executor.submit(_shuffle_task, submitted)
    every = list(tickets)  # Kept alive, so that ids of tickets stay unique.
    try:
        return _collect(executor, submitted, tickets, every, retries_left=retries_left,
                        map_retries_left=map_retries_left, retried=retried,
                        timeout_s=timeout_s, pf=pf)
    except BaseException as exc:
        executor.stop(every, exc)
        raise


def _collect(
    executor: ShuffleExecutor, submitted: list[_MapCall | _ReduceCall], tickets: list[Any],
    every: list[Any], *, retries_left: dict[int, int], map_retries_left: dict[int, int],
    retried: list[int], timeout_s: float | None, pf: Client | None,
) -> list[Any]:
    """The waiting of :func:`_gather`: outcomes of the ``tickets`` of the ``submitted`` calls,
    resubmitting failed tasks (each new ticket is appended to ``every``)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    slot = {id(t): i for i, t in enumerate(tickets)}
    outcomes: list[Any] = [None] * len(submitted)
    pending = list(tickets)
    executor.begin_stage()
    while pending:
        left_s = None if deadline is None else deadline - time.monotonic()
        finished, pending = executor.wait(pending, [submitted[slot[id(t)]] for t in pending],
                                          left_s=left_s, pf=pf)
        for ticket in finished:
            i = slot[id(ticket)]
            call = submitted[i]
            try:
                outcomes[i] = executor.result(ticket)
                continue
            except ShuffleFailed:
                raise
            except CapacityExhausted as exc:
                raise CapacityExhausted(f"{_task_name(call)}: {exc.message or exc}",
                                        server=exc.server) from exc
            except Exception as exc:
                if pf is not None:
                    # Any failure may be the cluster's end (a task's process may die with it):
                    # no retry then.
                    raise_if_cluster_gone(pf, settle_s=CLUSTER_GONE_SETTLE_S)
                if isinstance(call, _ReduceCall):
                    left, index = retries_left, call.reducer
                elif isinstance(exc, TaskProcessDied):
                    left, index = map_retries_left, call.mapper
                else:
                    raise
                if left[index] <= 0:
                    raise
                left[index] -= 1
                if isinstance(call, _ReduceCall):
                    retried.append(call.reducer)
                log.warning("%s failed (%s: %s); submitting it again (%d retries left)",
                            _task_name(call), type(exc).__name__, exc, left[index])
                submitted[i] = _new_attempt(executor, call)
                # A mapper run again goes ahead of queued reducers: they would wait for it.
                (again,) = executor.submit(_shuffle_task, [submitted[i]],
                                           first=isinstance(call, _MapCall))
                slot[id(again)] = i
                every.append(again)
                pending.append(again)
    executor.settle(every)
    return outcomes


def _task_name(call: _MapCall | _ReduceCall) -> str:
    if isinstance(call, _MapCall):
        return f"mapper {call.mapper}"
    return f"reducer {call.reducer}"


def _new_attempt(executor: ShuffleExecutor,
                 call: _MapCall | _ReduceCall) -> _MapCall | _ReduceCall:
    """``call`` as one new submission: a reducer gets a finished marker of its own where the
    executor learns of results by polling."""
    if isinstance(call, _MapCall) or not executor.names_attempts:
        return call
    return call.with_attempt(uuid.uuid4().hex[:16])
