"""What each object Lithops stores is (told by its bucket and key), and the put flags that follow.

The ``pocket`` backend sees only ``put_object(bucket, key, data)`` and ``get_object(bucket, key)``;
Lithops names its own objects after fixed patterns (``lithops.storage.utils``), so the key says
what an object is. The decisions, with the Lithops code behind each, are in the table of
adapters/lithops/README.md ("Flags per object kind"); in short:

- **DELETE on read: never.** No kind is provably read exactly once: the function pickle is read
  by every job that reuses it, call arguments with byte ranges (one per call chunk on FaaS
  backends), statuses by both the job monitor and the futures (and the monitor relies on seeing
  them listed again), results again after a failed unpickle, by a concurrent ``result()`` or by a
  copy of the future. Lithops' cleaner deletes a job's objects when it is done with them.
- **Write-once** (``overwrite=False``) where Lithops writes a key once in every code path: a
  job's call arguments (one key per job id) and a call's start marker (one key per activation).
  Everything else is overwritten, as in S3: Lithops rewrites function pickles (re-uploaded after
  ``clean(clean_fn=True)``), results and statuses (a re-run activation of the same call writes
  them again), runtime metadata (redeploys), and users rewrite their own keys.
- **PERSIST** only for user objects in the buckets the configuration names
  (``persist_buckets``): Lithops' own objects are dead once the pocketflow job ends (no later job
  can read them), and only the user knows which of their objects are final outputs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from lithops.constants import JOBS_PREFIX, RUNTIMES_PREFIX, TEMP_PREFIX
from lithops.storage.utils import (
    agg_data_key_suffix,
    func_key_suffix,
    init_key_suffix,
    output_key_suffix,
    status_key_suffix,
)

__all__ = ["ObjectKind", "WriteFlags", "object_kind", "write_flags"]


class ObjectKind(enum.Enum):
    """What an object of Lithops' storage bucket (or a user bucket) is."""

    FUNCTION = "function"
    """``lithops.jobs/<executor>/<hash>.func.pickle``: a serialized function and its modules."""
    CALL_ARGUMENTS = "call arguments"
    """``lithops.jobs/<executor>-<job>/aggdata.pickle``: every call's arguments, back to back."""
    START_MARKER = "start marker"
    """``lithops.jobs/<executor>-<job>/<call>/<activation>.init``: empty; a call has started."""
    STATUS = "status"
    """``lithops.jobs/<executor>-<job>/<call>/status.json``: a call's final status and stats."""
    RESULT = "result"
    """``lithops.jobs/<executor>-<job>/<call>/output.pickle``: a result too big (8 KiB or more)
    to travel inside the status."""
    CLOUDOBJECT = "cloudobject"
    """``lithops.jobs/tmp/...``: ``Storage.put_cloudobject`` without a key."""
    RUNTIME_META = "runtime metadata"
    """``lithops.runtimes/...``: what a runtime has installed, cached by Lithops."""
    OTHER_JOB_DATA = "other job data"
    """Anything else under ``lithops.jobs/`` (e.g. serverless backends' ``<runtime>.meta``)."""
    USER = "user object"
    """Anything else: what the user stores through ``Storage`` in any bucket."""


@dataclass(frozen=True)
class WriteFlags:
    """The pocketflow put flags of one object."""

    persist: bool
    overwrite: bool


def object_kind(bucket: str, key: str, *, storage_bucket: str) -> ObjectKind:
    """The kind of ``bucket/key``; Lithops keeps its own objects in ``storage_bucket`` only."""
    if bucket != storage_bucket:
        return ObjectKind.USER
    if key.startswith(RUNTIMES_PREFIX + "/"):
        return ObjectKind.RUNTIME_META
    if key.startswith(TEMP_PREFIX + "/"):
        return ObjectKind.CLOUDOBJECT
    if not key.startswith(JOBS_PREFIX + "/"):
        return ObjectKind.USER
    parts = key[len(JOBS_PREFIX) + 1:].split("/")
    if len(parts) == 2 and parts[1].endswith("." + func_key_suffix):
        return ObjectKind.FUNCTION
    if parts[1:] == [agg_data_key_suffix]:
        return ObjectKind.CALL_ARGUMENTS
    if len(parts) == 3:
        if parts[2] == status_key_suffix:
            return ObjectKind.STATUS
        if parts[2] == output_key_suffix:
            return ObjectKind.RESULT
        if parts[2].endswith(init_key_suffix) and len(parts[2]) > len(init_key_suffix):
            return ObjectKind.START_MARKER
    return ObjectKind.OTHER_JOB_DATA


_WRITE_ONCE = frozenset({ObjectKind.CALL_ARGUMENTS, ObjectKind.START_MARKER})
"""The kinds Lithops writes once in every code path; a second write is a bug made loud."""


def write_flags(kind: ObjectKind, *, persist_bucket: bool) -> WriteFlags:
    """The put flags of an object of ``kind``; ``persist_bucket``: its bucket is one of the
    configuration's ``persist_buckets`` (which never holds Lithops' own objects)."""
    return WriteFlags(
        persist=persist_bucket and kind is ObjectKind.USER,
        overwrite=kind not in _WRITE_ONCE,
    )
