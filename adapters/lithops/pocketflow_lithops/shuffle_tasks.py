"""The tasks of a shuffle (:mod:`pocketflow_lithops.shuffle`): what runs in Lithops' workers.

Lithops runs every task in a process forked for it, which imports the task's module while it
unpickles the call: whatever this module and its imports cost, every task pays again. So it
holds only the worker's side (the task function, its calls and outcomes, the keys the tasks
write) and defines no dataclass (each costs some 0.7 ms to define, its methods being generated
with ``exec``): calls are plain classes, the spec and outcomes NamedTuples. The driver's side,
with its Lithops waits, lives in :mod:`pocketflow_lithops.shuffle`; the client is imported
when a task first connects.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from pocketflow.errors import (
    BucketExists,
    DataLost,
    DataUnavailable,
    ObjectExists,
    ObjectNotFound,
    PocketflowError,
    ShuffleFailed,
)

if TYPE_CHECKING:
    from pocketflow.client import Client
    from pocketflow.handle import JobHandle
    from pocketflow.placement import Placement
    from pocketflow_lithops.worker_clients import ClientCache

__all__ = [
    "OUTPUT_BUCKET",
    "SHUFFLE_BUCKET",
    "OutputInfo",
    "CLUSTER_GONE",
    "CLUSTER_GONE_SETTLE_S",
    "cluster_gone",
    "consuming_key",
    "data_on_nvme",
    "finished_key",
    "output_key",
    "raise_if_cluster_gone",
    "reducer_input_keys",
    "reducer_prefix",
    "refresh_map",
    "run_map_function",
    "shuffle_key",
    "steered_key",
]

SHUFFLE_BUCKET = "shuffle"
"""Bucket of the (mapper, reducer) objects."""
OUTPUT_BUCKET = "output"
"""Default bucket of the reducers' outputs."""
CONSUMING_PREFIX = "consuming/"
"""Prefix of the reducers' markers in the shuffle bucket (see :func:`consuming_key`)."""
FINISHED_PREFIX = "finished/"
"""Prefix of the markers reducer attempts write as they return (see :func:`finished_key`)."""
ATTEMPT_MARKERS_MAX = 64
"""Most markers of earlier attempts a reducer reads; beyond, it treats every input as marked."""
MAP_REFRESH_TIMEOUT_S = 30.0
"""How long a task waits for the control plane to move the job off an unreachable server."""
MAP_REFRESH_BACKOFF_S = (0.05, 1.0)
"""First and largest pause between checks for a new weight map (failure path only)."""
CLUSTER_GONE = "its cluster is gone"
"""How the error of :func:`cluster_gone` ends."""
CLUSTER_GONE_SETTLE_S = 1.0
"""How long the driver's :func:`cluster_gone` keeps asking, after a task failed, while only some
of the job's servers answer: a cluster killed as a whole (another user's ``ray stop``) loses its
servers one after another, and the failure may come from the first of them to go."""
CLUSTER_GONE_PROBE_PAUSE_S = 0.2
"""Pause between those questions."""
WRITE_ATTEMPTS_MAX = 3
"""Most times a mapper (or a reducer putting inputs back) writes again after an unreachable
server."""
NVME_SHARE_MIN = 0.4
"""Share of a job's new data on NVMe from which its reducers count as waiting on storage: a
reducer reads and writes its share on NVMe at the device's pace (a virtual disk here: some
260 MB/s of O_DIRECT writes) and the rest at memory speed. The sort benchmark's 4 and 10 GB jobs
reserve twice their input, 8 and 20 GB, of which its DRAM (capped at 2 GiB) holds at most a
quarter and a tenth; its 1 GB job's 2 GB fit in DRAM."""
WORKER_CLIENTS_MAX = 8
"""Most pocketflow clients one worker process keeps open between tasks: two per shuffle where
the shuffle picks its partitions' block size (one with it, one with the job's for the reducers'
PERSIST outputs, ``_Spec.output_block_bytes``), so four shuffles' clients stay warm, as four
did when each had one."""
STEER_SALTS_MAX = 64
"""Most other names :func:`steered_key` tries for a regenerated partition whose own key's home
is a server that lost data; with one of two servers avoided, all of them land there once in
2**64."""

log = logging.getLogger(__name__)


INPUT_KEY_PREFIX = "r"
"""What the key of every (mapper, reducer) object starts with (:func:`shuffle_key`)."""


def reducer_prefix(reducer: int) -> str:
    """The lease prefix of everything addressed to one reducer (its inputs, its file)."""
    return f"{INPUT_KEY_PREFIX}{reducer:05d}"


def shuffle_key(*, mapper: int, reducer: int) -> str:
    """Key of the object mapper ``mapper`` writes for reducer ``reducer``: its reducer's prefix
    (:func:`reducer_prefix`), ``/m`` and the mapper. One format, not a call of
    ``reducer_prefix``: a wide shuffle's mappers name one key per object."""
    return f"{INPUT_KEY_PREFIX}{reducer:05d}/m{mapper:05d}"


def reducer_input_keys(reducer: int, mappers: int) -> dict[int, str]:
    """:func:`shuffle_key` of every mapper below ``mappers`` for ``reducer``, by mapper, the
    reducer's part of the key formatted once (a wide shuffle's reducer names hundreds)."""
    head = f"{reducer_prefix(reducer)}/m"
    return {m: f"{head}{m:05d}" for m in range(mappers)}


def steered_key(*, mapper: int, reducer: int, avoid: frozenset[str],
                placement: Placement) -> str:
    """The key a regenerated partition is written under so that ``placement`` puts its block 0
    (a small or one-block object's every byte) on none of the servers (addresses) in
    ``avoid``, which lost data behind their puts (:class:`~pocketflow.errors.DataLost`): its
    :func:`shuffle_key` when that key's home is not one of them, else that key with ``~n``
    for the first ``n`` up to ``STEER_SALTS_MAX`` whose home is not. The driver names the
    chosen key in the spec, so a rerun mapper and the reducer agree on it. The data blocks of a
    partition of several blocks are placed by their own hashes and may still land there."""
    key = shuffle_key(mapper=mapper, reducer=reducer)
    for salt in range(STEER_SALTS_MAX + 1):
        candidate = key if salt == 0 else f"{key}~{salt}"
        if placement.server_for(candidate.encode(), 0).address not in avoid:
            return candidate
    return key


def output_key(reducer: int) -> str:
    """Key of reducer ``reducer``'s output (with ``persist_output``)."""
    return f"part-{reducer:05d}"


def consuming_key(*, reducer: int, attempt: str) -> str:
    """Key of the marker in which one attempt of reducer ``reducer`` names the mappers whose
    inputs it has consumed or is about to consume (a bitmap, one bit per mapper)."""
    return f"{_consuming_prefix(reducer)}{attempt}"


def finished_key(*, reducer: int, attempt: str) -> str:
    """Key of the marker one attempt of reducer ``reducer`` writes as it returns (empty)."""
    return f"{FINISHED_PREFIX}r{reducer:05d}/{attempt}"


def _consuming_prefix(reducer: int) -> str:
    return f"{CONSUMING_PREFIX}r{reducer:05d}/"


def _encode_mappers(mappers: set[int], count: int) -> bytes:
    bitmap = bytearray((count + 7) // 8)
    for m in mappers:
        bitmap[m // 8] |= 1 << (m % 8)
    return bytes(bitmap)


def _decode_mappers(data: bytes, count: int) -> set[int]:
    return {m for m in range(min(count, 8 * len(data))) if data[m // 8] >> (m % 8) & 1}


class OutputInfo(NamedTuple):
    """Where a reducer's PERSIST output is: bucket, key and size."""

    bucket: str
    key: str
    size: int


class _Spec(NamedTuple):
    """What every task of one shuffle needs; pickled into each Lithops call."""

    handle_json: str
    mappers: int
    reducers: int
    bucket: str
    output_bucket: str
    persist_output: bool
    input_wait_s: float
    client_options: tuple[tuple[str, Any], ...]
    delete_inputs: bool = True
    call_bytes: int | None = None
    """About the bytes one mapper writes or one reducer reads, the larger; ``None``: not known."""
    on_nvme: bool = False
    """Whether the job's map places most of its new data on NVMe servers (see
    :func:`data_on_nvme`): its reducers then mostly wait on the device."""
    output_block_bytes: int | None = None
    """The block size of the reducers' PERSIST outputs where ``client_options`` hold the
    shuffle's own pick for its partitions (the job's: a reducer's output fills the holes its
    consumed partitions left on DRAM, which a larger block does not fit); ``None``: the
    tasks' clients' own."""
    steered: tuple[tuple[int, int, str], ...] = ()
    """``(mapper, reducer, key)`` of each partition regenerated under another key than its
    :func:`shuffle_key` (:func:`steered_key`): its rerun writes it there and its reducer reads
    it there. Empty until a server lost data."""


def _keys_of(spec: _Spec, reducer: int) -> dict[int, str]:
    """The key of each of ``reducer``'s inputs, by mapper: :func:`reducer_input_keys`, but for
    the partitions the driver steered away from servers that lost data."""
    keys = reducer_input_keys(reducer, spec.mappers)
    for mapper, steered_reducer, key in spec.steered:
        if steered_reducer == reducer:
            keys[mapper] = key
    return keys


# The calls are plain classes, not NamedTuples: Lithops finds the user's map and reduce
# functions, to ship their modules, among an argument's instance attributes, which a
# NamedTuple's fields are not.


class _MapCall:
    """One mapper's Lithops call."""

    parks = False
    """A mapper never waits for another call's writes: an executor may queue it ahead of a free
    slot (see :class:`~pocketflow_lithops.shuffle_executors.RayShuffleExecutor`)."""

    def __init__(self, spec: _Spec, map_function: Callable[..., Any], item: Any, mapper: int,
                 only_reducers: frozenset[int] | None) -> None:
        self.spec = spec
        self.map_function = map_function
        self.item = item
        self.mapper = mapper
        self.only_reducers = only_reducers
        """Write only these partitions (a rerun after lost partitions); ``None`` writes all."""

    def __repr__(self) -> str:
        return f"_MapCall(mapper={self.mapper}, only_reducers={self.only_reducers})"


class _MapOutcome(NamedTuple):
    mapper: int
    value: Any
    bytes_written: int
    write_attempts: int
    io_s: float = 0.0
    finished_unix_s: float = 0.0


class _ReduceCall:
    """One reducer's Lithops call."""

    parks = True
    """A reducer may wait for mappers' writes: an executor queues it ahead of a free slot only
    once no mapper is outstanding."""

    def __init__(self, spec: _Spec, reduce_function: Callable[[int, list[bytes]], Any],
                 reducer: int, attempt: str = "") -> None:
        self.spec = spec
        self.reduce_function = reduce_function
        self.reducer = reducer
        self.attempt = attempt
        """Names this submission's finished marker (set by the driver); empty: none is
        written."""

    @property
    def waits_on_storage(self) -> bool:
        """Whether this reducer mostly waits on storage (its job's data is on NVMe): an executor
        may then run it beside its computing calls (see
        :class:`~pocketflow_lithops.shuffle_executors.RayShuffleExecutor`)."""
        return self.spec.on_nvme

    def with_attempt(self, attempt: str) -> _ReduceCall:
        """This call as a submission named ``attempt``."""
        return _ReduceCall(self.spec, self.reduce_function, self.reducer, attempt)

    def __repr__(self) -> str:
        return f"_ReduceCall(reducer={self.reducer}, attempt={self.attempt!r})"


class _ReduceOutcome(NamedTuple):
    reducer: int
    lost_mappers: tuple[int, ...] = ()
    unreachable: tuple[str, ...] = ()
    lossy: tuple[str, ...] = ()
    """Addresses of the servers whose reads said :class:`~pocketflow.errors.DataLost`."""
    value: Any = None
    bytes_read: int = 0
    wait_s: float = 0.0
    io_s: float = 0.0
    reduce_s: float = 0.0
    write_s: float = 0.0


_CLIENTS: ClientCache | None = None
_CLIENTS_LOCK = threading.Lock()


def _client(spec: _Spec, **overrides: Any) -> Client:
    """This worker process's client for the shuffle's handle, kept open for the next task.

    A warm worker (Lithops runs many calls per worker process) reuses its connections and
    sessions instead of opening new ones per task; at most ``WORKER_CLIENTS_MAX`` are kept, and
    they are disconnected before the process forks.
    """
    global _CLIENTS
    from pocketflow_lithops.worker_clients import ClientCache

    with _CLIENTS_LOCK:  # Made on first use, like this module's other imports of the client.
        if _CLIENTS is None:
            _CLIENTS = ClientCache(WORKER_CLIENTS_MAX)
    return _CLIENTS.get(spec.handle_json, **(dict(spec.client_options) | overrides))


def data_on_nvme(handle: JobHandle) -> bool:
    """Whether ``handle``'s weight map places at least ``NVME_SHARE_MIN`` of new data on NVMe
    servers."""
    total = sum(s.weight for s in handle.servers)
    nvme = sum(s.weight for s in handle.servers if s.tier == "nvme")
    return total > 0 and nvme >= NVME_SHARE_MIN * total


def _unusable_map(pf: Client, unreachable: set[str]) -> bool:
    """Whether the client's map still names an ``unreachable`` server, or has no server to
    write new keys to (the control plane moved the job off a dead server where no other had
    room, and is launching one)."""
    servers = pf.handle.servers
    return any(s.address in unreachable for s in servers) or not any(
        s.weight > 0 for s in servers
    )


def refresh_map(pf: Client, unreachable: set[str], *, bucket: str,
                timeout_s: float = MAP_REFRESH_TIMEOUT_S) -> None:
    """Wait until the client's weight map no longer names the ``unreachable`` servers and has a
    server to write to.

    The control plane declares a silent server dead after a few seconds and moves the job to a
    new epoch (without a weighted server when no live one had room for the job's data, until a
    server launched for it is up); a client learns it from the ``stale_epoch`` answer of any
    live server. This asks the live servers (``create_bucket``, which also gives the bucket to
    servers new to the map) with a bounded exponential backoff: it runs only after a failure,
    never on the normal path. Raises :class:`DataUnavailable` when the map has not changed
    within ``timeout_s``, and at once when no server of the job answers
    (:func:`raise_if_cluster_gone`).
    """
    deadline = time.monotonic() + timeout_s
    pause_s, pause_max_s = MAP_REFRESH_BACKOFF_S
    while _unusable_map(pf, unreachable):
        try:
            pf.create_bucket(bucket)
        except (BucketExists, DataUnavailable):
            pass
        if not _unusable_map(pf, unreachable):
            return
        raise_if_cluster_gone(pf)
        if time.monotonic() + pause_s > deadline:
            named = sorted(unreachable & {s.address for s in pf.handle.servers})
            raise DataUnavailable(
                f"unavailable: the job's map still names {named} after {timeout_s:.0f} s"
                if named else
                f"unavailable: the job's map has no server to write to after {timeout_s:.0f} s",
                server=next(iter(unreachable), None),
            )
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, pause_max_s)


def raise_if_cluster_gone(pf: Client, *, settle_s: float = 0.0) -> None:
    """Raise :class:`DataUnavailable` when no server of the job's map answers: the job's
    cluster is gone (or cut off from this process), so no newer map can arrive and nothing it
    held can be read; whoever waits for one would wait out its whole bound for nothing
    (``settle_s``: see :func:`cluster_gone`)."""
    gone = cluster_gone(pf, settle_s=settle_s)
    if gone is not None:
        raise gone


def cluster_gone(pf: Client, *, settle_s: float = 0.0) -> DataUnavailable | None:
    """The error that says the job's cluster is gone when no server of its map answers, else
    ``None``. Asked after a failure only: while some servers answer and others do not, it asks
    again for up to ``settle_s`` (the driver: ``CLUSTER_GONE_SETTLE_S``), so that a cluster
    dying as a whole is called gone even when the failure came from its first server to go."""
    servers = {s.address for s in pf.handle.servers}
    settle_until = time.monotonic() + settle_s
    while True:
        unreachable = pf.unreachable_servers()
        if not unreachable:
            return None
        if {s.address for s in unreachable} >= servers:
            names = ", ".join(f"{s.node_id} at {s.address}" for s in unreachable)
            return DataUnavailable(
                f"unavailable: no storage server of job {pf.handle.job_id} answers ({names}): "
                f"{CLUSTER_GONE}", server=unreachable[0].address,
            )
        if time.monotonic() + CLUSTER_GONE_PROBE_PAUSE_S > settle_until:
            return None
        time.sleep(CLUSTER_GONE_PROBE_PAUSE_S)


def _write_all(pf: Client, spec: _Spec, items: list[tuple[str, bytes | memoryview]]) -> int:
    """Write ``items`` to the shuffle bucket (write-once); after an unreachable server, wait for
    the new map and write what is missing again. Returns how many write rounds it took."""
    bucket = spec.bucket
    pending = items
    for attempt in range(1, WRITE_ATTEMPTS_MAX + 1):
        try:
            pf.put_many(bucket, pending)
            return attempt
        except DataUnavailable as exc:
            if attempt == WRITE_ATTEMPTS_MAX:
                raise
            refresh_map(pf, {exc.server} if exc.server else set(), bucket=bucket)
        except ObjectExists:
            # A rerun, or a retry after a partly failed round: some keys are already there.
            pass
        still = []
        for key, data in pending:
            try:
                pf.put(bucket, key, data)
            except ObjectExists:
                continue
            except DataUnavailable as exc:
                if attempt == WRITE_ATTEMPTS_MAX:
                    raise
                refresh_map(pf, {exc.server} if exc.server else set(), bucket=bucket)
                still.append((key, data))
        if not still:
            return attempt + 1
        pending = still
    raise AssertionError("unreachable")


def _shuffle_task(call: _MapCall | _ReduceCall) -> _MapOutcome | _ReduceOutcome:
    """The one task function of a shuffle's Lithops job: a mapper or a reducer."""
    if isinstance(call, _MapCall):
        return _map_task(call)
    outcome = _reduce_task(call)
    if call.attempt:
        _say_finished(call)
    return outcome


def _say_finished(call: _ReduceCall) -> None:
    """Write this attempt's finished marker, so the driver looks for its result now. Best
    effort: without it the driver learns of the result from Lithops' next poll."""
    spec = call.spec
    try:
        _client(spec).put(spec.bucket, finished_key(reducer=call.reducer, attempt=call.attempt),
                          b"", overwrite=True)
    except PocketflowError as exc:
        log.warning("reducer %d: could not write its finished marker: %s", call.reducer, exc)


def run_map_function(
    map_function: Callable[..., Any], item: Any, reducers: int
) -> tuple[Any, list[list[Any]]]:
    """Run a mapper's function on ``item`` with an ``emit(partition, data)`` that checks the
    partition; returns its value and what it emitted, per reducer."""
    parts: list[list[Any]] = [[] for _ in range(reducers)]

    def emit(partition: int, data: Any) -> None:
        if not 0 <= partition < reducers:
            raise ValueError(f"partition {partition} outside 0..{reducers - 1}")
        parts[partition].append(data)

    return map_function(item, emit), parts


def _map_task(call: _MapCall) -> _MapOutcome:
    """One mapper: run the user's function, then write one object per (wanted) reducer."""
    spec = call.spec
    value, parts = run_map_function(call.map_function, call.item, spec.reducers)
    wanted = range(spec.reducers) if call.only_reducers is None else sorted(call.only_reducers)
    items: list[tuple[str, bytes | memoryview]] = []
    mapper = call.mapper
    steered = {r: key for m, r, key in spec.steered if m == mapper}
    for r in wanted:
        chunks = parts[r]
        data = chunks[0] if len(chunks) == 1 else b"".join(memoryview(c) for c in chunks)
        # A bytes object is already flat bytes (and its len its size): no view made for it.
        items.append((steered.get(r) or shuffle_key(mapper=mapper, reducer=r),
                      data if type(data) is bytes else memoryview(data).cast("B")))
    started = time.perf_counter()
    attempts = _write_all(_client(spec), spec, items)
    return _MapOutcome(
        mapper=call.mapper,
        value=value,
        bytes_written=sum(len(data) for _, data in items),
        write_attempts=attempts,
        io_s=time.perf_counter() - started,
        finished_unix_s=time.time(),
    )


def _home_nodes(handle: JobHandle, keys: dict[int, str]) -> dict[int, str]:
    """Node id of the server holding each key's block 0 under ``handle``'s map."""
    from pocketflow.placement import Placement

    placement = Placement.of_handle(handle)
    return {m: placement.server_for(key.encode(), 0).node_id for m, key in keys.items()}


def _servers_of(handle: JobHandle, keys: dict[int, str]) -> dict[int, str]:
    """Address of the server holding each key's block 0 under ``handle``'s map."""
    from pocketflow.placement import Placement

    placement = Placement.of_handle(handle)
    return {m: placement.server_for(key.encode(), 0).address for m, key in keys.items()}


def _reduce_task(call: _ReduceCall) -> _ReduceOutcome:
    """One reducer: wait for its inputs, mark and read them with DELETE, run the user's function,
    write the output; or, when inputs were lost (with a server, or consumed by an earlier
    attempt of this reducer that never committed), put back what it read and say which."""
    from pocketflow.handle import JobHandle

    spec = call.spec
    keys = _keys_of(spec, call.reducer)
    inputs: dict[int, bytes] = {}
    lost: set[int] = set()
    # Servers that read DataLost: the driver steers the regenerated partitions off them.
    lossy: set[str] = set()
    # Lost inputs whose server still holds their record (their bytes lost behind the put):
    # deleted before the regeneration, whose write-once puts would otherwise find them there.
    dropped: set[int] = set()
    unreachable: set[str] = set()
    wait_s = io_s = 0.0
    deadline = time.monotonic() + spec.input_wait_s
    pf = _client(spec)
    marker = consuming_key(reducer=call.reducer, attempt=uuid.uuid4().hex[:16])
    consuming: set[int] = set()
    # Where the stage's mappers first placed each input: one whose server the job has since
    # lost, and which no live server holds, is gone with it. Worked out only once the job has
    # lost a server (a placement per input: for many small inputs a cost of its own).
    homes: dict[int, str] | None = None
    markers_checked = not spec.delete_inputs
    waited_epoch: int | None = None
    pending = dict(keys)
    # First read every input that is there, instead of looking for each (a LOOKUP per input
    # was a third of a wide shuffle's reducer-side server ops) and then reading. The marker
    # names every input first, since any of them may be consumed; it is narrowed to those
    # consumed when some were not there. Inputs not there go to the loop below, which looks,
    # checks the markers and waits as it does for any missing input.
    started = time.perf_counter()
    if spec.delete_inputs:
        consuming |= pending.keys()
        _write_marker(pf, spec, marker, _encode_mappers(consuming, spec.mappers))
    results = pf.get_each(spec.bucket, list(pending.values()), delete=spec.delete_inputs)
    for m, result in zip(list(pending), results, strict=True):
        if isinstance(result, bytes):
            inputs[m] = result
            del pending[m]
        elif isinstance(result, DataUnavailable):
            lost.add(m)
            unreachable.add(result.server or "")
            del pending[m]
        elif isinstance(result, DataLost):
            # Its server accepted it and then lost its bytes: gone as with a dead server.
            lost.add(m)
            dropped.add(m)
            lossy.add(result.server or "")
            del pending[m]
        # Any other error (not there yet, consumed by another attempt, a bucket a server
        # lacks, ...) is the loop's to sort out, as after its first look.
    if pending and spec.delete_inputs:
        consuming -= pending.keys()
        _write_marker(pf, spec, marker, _encode_mappers(consuming, spec.mappers))
    io_s += time.perf_counter() - started
    while pending:
        started = time.perf_counter()
        placed_by = pf.handle
        # Look without waiting first, and again whenever the client's map changed since
        # the last look (a read or a listing learnt a new one): inputs are only waited for
        # once none of them is known to be lost or consumed.
        probing = placed_by.epoch != waited_epoch
        waited_epoch = placed_by.epoch
        try:
            missing = set(pf.wait_for(
                spec.bucket, list(pending.values()),
                timeout_s=0.0 if probing else max(0.0, deadline - time.monotonic()),
            ))
        except DataUnavailable as exc:
            # Inputs placed on the unreachable server are gone (or will be written under
            # the next map): they are regenerated; the others are still awaited.
            unreachable.add(exc.server or "")
            gone = {m for m, address in _servers_of(placed_by, pending).items()
                    if address in unreachable}
            if not gone:
                raise
            lost |= gone
            for m in gone:
                del pending[m]
            wait_s += time.perf_counter() - started
            if probing:
                waited_epoch = None  # look again before waiting
            continue
        wait_s += time.perf_counter() - started
        # The client may have learnt the map without a lost server before it asked that
        # server for anything (another task of this worker, a read): then nothing raised,
        # and the inputs it held would be awaited on live servers until the bound.
        lost_nodes = {s.node_id for s in pf.handle.lost}
        if lost_nodes and homes is None:
            homes = _home_nodes(JobHandle.from_json(spec.handle_json), keys)
        gone = {m for m, k in pending.items()
                if k in missing and homes is not None and homes[m] in lost_nodes}
        lost |= gone
        for m in gone:
            del pending[m]
        if not markers_checked and any(k in missing for k in pending.values()):
            # Inputs are missing: not written yet, or consumed by an earlier attempt of
            # this reducer that never committed, in which case it marked them first.
            markers_checked = True
            earlier = _marked_by_earlier_attempts(pf, spec, call.reducer)
            consumed = {m for m, k in pending.items() if m in earlier and k in missing}
            if consumed:
                # Report them for regeneration and read nothing more (what the first read
                # consumed is put back below).
                lost |= consumed
                break
            continue
        ready = {m: k for m, k in pending.items() if k not in missing}
        if not ready:
            if probing or not pending:
                continue
            raise ShuffleFailed(
                f"reducer {call.reducer}: inputs of mappers "
                f"{sorted(pending)[:8]} did not arrive within {spec.input_wait_s:.0f} s "
                f"(never written, and no earlier attempt of this reducer marked them)"
            )
        started = time.perf_counter()
        if spec.delete_inputs:
            # The marker is written before the reads that consume, so that a retry of this
            # reducer knows what may be gone.
            consuming |= ready.keys()
            _write_marker(pf, spec, marker, _encode_mappers(consuming, spec.mappers))
        results = _read_all(pf, spec.bucket, list(ready.values()),
                            delete=spec.delete_inputs)
        io_s += time.perf_counter() - started
        for (m, _), result in zip(ready.items(), results, strict=True):
            del pending[m]
            if isinstance(result, bytes):
                inputs[m] = result
            else:
                lost.add(m)
                if isinstance(result, DataUnavailable):
                    unreachable.add(result.server or "")
                elif isinstance(result, DataLost):
                    dropped.add(m)
                    lossy.add(result.server or "")
                # ObjectNotFound on a live server: another reader (a concurrent attempt of
                # this reducer) consumed it; regenerated by lineage like a lost one.
    if lost:
        started = time.perf_counter()
        if lossy - {""}:
            # A consumed input whose home lost data would be put back where it may be lost
            # again: it is reported lost instead, and the driver regenerates it elsewhere.
            homes = _servers_of(pf.handle, {m: keys[m] for m in inputs})
            for m, address in homes.items():
                if address in lossy:
                    lost.add(m)
                    del inputs[m]
        try:
            _drop_lost(pf, spec.bucket, [keys[m] for m in sorted(dropped)])
        finally:
            # What this attempt consumed goes back whatever the drops did.
            _put_back(pf, spec, keys, inputs, unreachable)
        io_s += time.perf_counter() - started
        return _ReduceOutcome(call.reducer, lost_mappers=tuple(sorted(lost)),
                              unreachable=tuple(sorted(unreachable - {""})),
                              lossy=tuple(sorted(lossy - {""})),
                              wait_s=wait_s, io_s=io_s)
    bytes_read = sum(len(v) for v in inputs.values())
    started = time.perf_counter()
    value = call.reduce_function(call.reducer, [inputs[m] for m in range(spec.mappers)])
    inputs.clear()
    reduce_s = time.perf_counter() - started
    write_s = 0.0
    if spec.persist_output:
        started = time.perf_counter()
        key = output_key(call.reducer)
        data = memoryview(value).cast("B")
        writer = (pf if spec.output_block_bytes is None else
                  _client(spec, block_size_bytes=spec.output_block_bytes))
        writer.put(spec.output_bucket, key, data, persist=True, overwrite=True)
        write_s = time.perf_counter() - started
        io_s += write_s
        value = OutputInfo(spec.output_bucket, key, len(data))
    return _ReduceOutcome(call.reducer, value=value, bytes_read=bytes_read, wait_s=wait_s,
                          io_s=io_s, reduce_s=reduce_s, write_s=write_s)


def _marked_by_earlier_attempts(pf: Client, spec: _Spec, reducer: int) -> set[int]:
    """Mappers whose inputs earlier attempts of ``reducer`` marked (empty on a first attempt).

    A marker that cannot be read (its server gone, or its bytes lost behind the put), or more
    than ``ATTEMPT_MARKERS_MAX`` of them, count as naming every mapper: an input then counts as
    consumed only if it is missing when the retry starts.
    """
    prefix = _consuming_prefix(reducer)
    for attempt in range(1, WRITE_ATTEMPTS_MAX + 1):
        try:
            markers = sorted({info.key for info in pf.list(spec.bucket, prefix)})
            break
        except DataUnavailable as exc:
            # A server of the map cannot be listed: wait for the map without it.
            if attempt == WRITE_ATTEMPTS_MAX:
                raise
            refresh_map(pf, {exc.server} if exc.server else set(), bucket=spec.bucket)
    if len(markers) > ATTEMPT_MARKERS_MAX:
        return set(range(spec.mappers))
    marked: set[int] = set()
    for key in markers:
        try:
            marked |= _decode_mappers(pf.get(spec.bucket, key), spec.mappers)
        except (DataUnavailable, DataLost, ObjectNotFound):
            return set(range(spec.mappers))
    return marked


def _write_marker(pf: Client, spec: _Spec, key: str, data: bytes) -> None:
    """Write (overwrite) this attempt's marker; after an unreachable server, under the new map."""
    for attempt in range(1, WRITE_ATTEMPTS_MAX + 1):
        try:
            pf.put(spec.bucket, key, data, overwrite=True)
            return
        except DataUnavailable as exc:
            if attempt == WRITE_ATTEMPTS_MAX:
                raise
            refresh_map(pf, {exc.server} if exc.server else set(), bucket=spec.bucket)


def _read_all(
    pf: Client, bucket: str, keys: list[str], *, delete: bool
) -> list[bytes | PocketflowError]:
    """Read (and delete) inputs in one call of the native core (block 0 pipelined per server,
    the data blocks of several objects at once); a lost one (server unreachable, its bytes lost
    behind the put, or consumed by another reader) comes back as the error instead of being
    raised, and so does not cost the inputs already consumed."""
    results = pf.get_each(bucket, keys, delete=delete)
    for result in results:
        if isinstance(result, PocketflowError) and not isinstance(
            result, (DataUnavailable, DataLost, ObjectNotFound)
        ):
            raise result
    return results


def _drop_lost(pf: Client, bucket: str, keys: list[str]) -> None:
    """Delete inputs whose bytes their server lost (:class:`DataLost`): their records stay
    until deleted, and the regeneration's write-once puts of the same keys would find them and
    skip writing. Only a version whose read still says lost is deleted
    (:meth:`~pocketflow.client.Client.delete_if_lost`): a concurrent attempt of this reducer
    may have dropped it already and the mapper's rerun written a good one, which stays.
    Already gone (a DELETE read took the record) is fine; a delete that fails otherwise (its
    server unreachable, draining, a map that keeps moving) is logged and left to the next
    attempt, which reads the same lost bytes and drops them again."""
    for key in keys:
        try:
            pf.delete_if_lost(bucket, key)
        except ObjectNotFound:
            continue
        except PocketflowError as exc:
            log.warning("could not drop lost input %s/%s: %s", bucket, key, exc)


def _put_back(pf: Client, spec: _Spec, keys: dict[int, str], inputs: dict[int, bytes],
              unreachable: set[str]) -> None:
    """Write the inputs a failed reducer already consumed back under the job's new map (each
    under its key in ``keys``), so that its retry finds them and only the lost ones are
    regenerated."""
    unreachable.discard("")
    if unreachable:
        refresh_map(pf, unreachable, bucket=spec.bucket)
    items = [(keys[m], memoryview(data)) for m, data in sorted(inputs.items())]
    if items:
        _write_all(pf, spec, items)
