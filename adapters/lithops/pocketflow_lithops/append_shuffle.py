"""The shuffle's second layout: one shared append file per reducer instead of one object per
(mapper, reducer).

``shuffle(..., layout="append")`` runs this. Every mapper appends its partition for reducer
``r`` to the append file ``r{r:05d}/in`` (:meth:`pocketflow.Client.append_file`) in records of
at most ``SMALL_OBJECT_MAX_BYTES``, each opened by ``u32 mapper, u32 sequence, u32 length``
(pipelined: :meth:`~pocketflow.channels.AppendFile.append_many`), and ends with one record
``(mapper, END)`` carrying how many chunks it appended; then it puts one empty object
``done/m{m:05d}``. A reducer waits for the ``M`` done objects with the server-side ``wait``
(no polling), reads its whole file by byte ranges (pipelined per segment), cuts it into records
by their lengths, reassembles each mapper's bytes in sequence order
(a chunk seen twice, from a mapper that ran twice, counts once) and checks that every mapper's
END record is there with its chunk count. So the shuffle leaves ``R`` files and ``M`` markers
on the servers instead of ``M x R`` objects, and a reducer reads one file in large batches
instead of ``M`` objects.

What this layout does not do (use the default ``"objects"`` layout for it): regenerate
partitions lost with a storage server (a reducer that meets a lost server fails the shuffle with
:class:`~pocketflow.errors.ShuffleFailed`), and DELETE-on-read (a reducer deletes its file
after writing its output; a retried reducer reads it again). Reducers are not retried.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pocketflow.errors import BucketExists, ShuffleFailed
from pocketflow.protocol import SMALL_OBJECT_MAX_BYTES
from pocketflow_lithops.shuffle_executors import ShuffleExecutor
from pocketflow_lithops.shuffle_result import ShuffleResult
from pocketflow_lithops.shuffle_tasks import (
    OutputInfo,
    _client,
    _Spec,
    output_key,
    reducer_prefix,
    run_map_function,
)

__all__ = ["run_append_layout", "append_file_key", "done_key"]

_CHUNK_HEAD = struct.Struct("<III")
CHUNK_BYTES_MAX = SMALL_OBJECT_MAX_BYTES - _CHUNK_HEAD.size
"""Partition bytes per appended record (the rest of the record is its head)."""
END_SEQUENCE = 0xFFFF_FFFF
"""Sequence number of a mapper's last record for a reducer; its body is the chunk count."""
SEGMENT_BYTES = 16 * 1024 * 1024
"""Segment size of the reducers' append files."""


def append_file_key(reducer: int) -> str:
    """The append file of one reducer's inputs."""
    return f"{reducer_prefix(reducer)}/in"


def done_key(mapper: int) -> str:
    """The empty object a mapper puts once it appended all its partitions."""
    return f"done/m{mapper:05d}"


@dataclass(frozen=True)
class _AppendMap:
    spec: _Spec
    map_function: Callable[..., Any]
    item: Any
    mapper: int


@dataclass(frozen=True)
class _AppendReduce:
    spec: _Spec
    reduce_function: Callable[[int, list[bytes]], Any]
    reducer: int


def _append_task(call: _AppendMap | _AppendReduce) -> dict[str, Any]:
    """The one task function of an append-layout shuffle: a mapper or a reducer."""
    if isinstance(call, _AppendMap):
        return _map(call)
    return _reduce(call)


def _map(call: _AppendMap) -> dict[str, Any]:
    spec = call.spec
    value, parts = run_map_function(call.map_function, call.item, spec.reducers)
    pf = _client(spec)
    started = time.perf_counter()
    written = 0
    for r in range(spec.reducers):
        data = memoryview(b"".join(memoryview(c).cast("B") for c in parts[r]))
        log = pf.append_file(spec.bucket, append_file_key(r), segment_bytes=SEGMENT_BYTES)
        records = []
        for seq, at in enumerate(range(0, len(data), CHUNK_BYTES_MAX)):
            piece = data[at:at + CHUNK_BYTES_MAX]
            records.append(_CHUNK_HEAD.pack(call.mapper, seq, len(piece)) + piece)
        records.append(_CHUNK_HEAD.pack(call.mapper, END_SEQUENCE, 4)
                       + struct.pack("<I", len(records)))
        log.append_many(records)
        written += len(data)
    pf.put(spec.bucket, done_key(call.mapper), b"", overwrite=True)
    return {"mapper": call.mapper, "value": value, "bytes_written": written,
            "io_s": time.perf_counter() - started, "finished_unix_s": time.time()}


def _reduce(call: _AppendReduce) -> dict[str, Any]:
    spec = call.spec
    pf = _client(spec)
    waited = time.perf_counter()
    missing = pf.wait_for(spec.bucket, [done_key(m) for m in range(spec.mappers)],
                          timeout_s=spec.input_wait_s)
    if missing:
        raise ShuffleFailed(f"reducer {call.reducer}: {len(missing)} mappers never finished "
                            f"within {spec.input_wait_s} s (first {missing[0]})")
    started = time.perf_counter()
    chunks: list[dict[int, bytes]] = [{} for _ in range(spec.mappers)]
    ends: dict[int, int] = {}
    log = pf.append_file(spec.bucket, append_file_key(call.reducer), segment_bytes=SEGMENT_BYTES)
    whole = memoryview(log.read(0, log.size()))
    at = 0
    while at < len(whole):
        mapper, sequence, length = _CHUNK_HEAD.unpack_from(whole, at)
        body = whole[at + _CHUNK_HEAD.size:at + _CHUNK_HEAD.size + length]
        at += _CHUNK_HEAD.size + length
        if not 0 <= mapper < spec.mappers or len(body) != length:
            raise ShuffleFailed(f"reducer {call.reducer}: a record of its file is malformed")
        if sequence == END_SEQUENCE:
            ends[mapper] = struct.unpack_from("<I", body)[0]
        else:
            chunks[mapper].setdefault(sequence, body)
    read = len(whole)
    inputs: list[bytes] = []
    for m in range(spec.mappers):
        if ends.get(m) != len(chunks[m]) or sorted(chunks[m]) != list(range(len(chunks[m]))):
            raise ShuffleFailed(f"reducer {call.reducer}: the input of mapper {m} is incomplete")
        inputs.append(b"".join(chunks[m][s] for s in range(len(chunks[m]))))
    del whole
    value = call.reduce_function(call.reducer, inputs)
    if spec.persist_output:
        data = memoryview(value).cast("B")
        key = output_key(call.reducer)
        pf.put(spec.output_bucket, key, data, persist=True, overwrite=True)
        value = OutputInfo(spec.output_bucket, key, len(data))
    pf.delete_prefix(spec.bucket, append_file_key(call.reducer))
    return {"reducer": call.reducer, "value": value, "bytes_read": read,
            "wait_s": started - waited, "io_s": time.perf_counter() - started}


def run_append_layout(
    executor: ShuffleExecutor, pf: Any, job_id: str, map_function: Callable[..., Any],
    reduce_function: Callable[[int, list[bytes]], Any], map_inputs: Sequence[Any],
    spec: _Spec, timeout_s: float | None,
) -> ShuffleResult:
    """Run the mappers and then the reducers as one stage of ``executor`` (one Lithops job);
    ``pf`` is the driver's client of the shuffle's job, whose buckets exist."""
    started = time.perf_counter()
    started_unix_s = time.time()
    maps = [_AppendMap(spec, map_function, item, m) for m, item in enumerate(map_inputs)]
    reduces = [_AppendReduce(spec, reduce_function, r) for r in range(spec.reducers)]
    try:
        outcomes = executor.run_all(_append_task, maps + reduces, timeout_s)
    except BaseException:
        try:  # wakes reducers still parked on the bucket
            pf.delete_bucket(spec.bucket)
        except Exception:  # noqa: BLE001 - the task's error is the one to raise
            pass
        raise
    map_outcomes, reduce_outcomes = outcomes[:len(maps)], outcomes[len(maps):]
    pf.delete_prefix(spec.bucket, "done/")
    return ShuffleResult(
        job_id=job_id,
        handle_json=pf.handle.to_json(),
        outputs=[o["value"] for o in reduce_outcomes],
        map_values=[o["value"] for o in map_outcomes],
        elapsed_s=time.perf_counter() - started,
        map_s=max(o["finished_unix_s"] for o in map_outcomes) - started_unix_s,
        bytes_shuffled=sum(o["bytes_written"] for o in map_outcomes),
        bytes_read=sum(o["bytes_read"] for o in reduce_outcomes),
        input_wait_s=[o["wait_s"] for o in reduce_outcomes],
        io_s=[o["io_s"] for o in reduce_outcomes],
        map_io_s=[o["io_s"] for o in map_outcomes],
    )


def ensure_buckets(pf: Any, buckets: Sequence[str]) -> None:
    """Create ``buckets`` on every server of the job (existing ones are fine)."""
    for bucket in buckets:
        try:
            pf.create_bucket(bucket)
        except BucketExists:
            pass
