"""The ``Metadata`` actor: job records in memory and in an append-only log replayed on start."""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from pathlib import Path
from typing import Any

from pocketflow.errors import ClusterError, JobNotRegistered

log = logging.getLogger(__name__)

JOBS_MAX = 4096
"""Most jobs registered at once; registering one more is refused."""

ENDINGS_MAX = 4096
"""Most ended jobs whose end some server has not confirmed; past it the oldest is forgotten."""

OP_LOG_ENTRIES_MAX = 100_000
"""Most op-log entries kept in memory; the oldest are dropped past it (see ``ops``)."""

COMPACT_RECORDS_MAX_DEFAULT = 10_000
"""Log records appended since the last compaction that trigger the next one."""

COMPACT_BYTES_MAX_DEFAULT = 64 * 1024 * 1024
"""Log bytes that trigger a compaction, whatever the record count."""

LOG_RECORD_MAX_BYTES = 16 * 1024 * 1024
"""Longest log record; a longer line is treated as corrupt on replay."""

SIZING_ACTIONS_KEPT_MAX = 64
"""Most sizing actions kept (the controller's sizing history, which a restarted controller
takes back); the oldest are dropped past it."""

_SNAPSHOT = "snapshot"


def encode_record(entry: dict[str, Any]) -> bytes:
    """One log line: ``<length> <crc32> <json>\\n`` (length and CRC-32 of the JSON bytes, hex)."""
    body = json.dumps(entry, separators=(",", ":"), sort_keys=True).encode()
    return b"%08x %08x " % (len(body), zlib.crc32(body)) + body + b"\n"


def decode_records(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """The whole records at the start of ``data`` and the byte offset where they end.

    Decoding stops at the first record that is cut short (a torn last write), whose length or
    checksum does not match, or that is not JSON; everything from there on is ignored.
    """
    records: list[dict[str, Any]] = []
    offset = 0
    while offset < len(data):
        head = data[offset : offset + 18]
        if len(head) < 18 or head[8:9] != b" " or head[17:18] != b" ":
            break
        try:
            length = int(head[0:8], 16)
            crc = int(head[9:17], 16)
        except ValueError:
            break
        end = offset + 18 + length
        if length > LOG_RECORD_MAX_BYTES or end >= len(data) or data[end : end + 1] != b"\n":
            break
        body = data[offset + 18 : end]
        if zlib.crc32(body) != crc:
            break
        try:
            entry = json.loads(body)
        except ValueError:
            break
        if not isinstance(entry, dict):
            break
        records.append(entry)
        offset = end + 1
    return records, offset


class Metadata:
    """Job records plus an append-only op log, in memory and (with ``log_path``) in a file.

    Every change is appended to the log first, then applied. With ``log_path`` each record is
    written to the file (and, with ``fsync`` (default), flushed to stable storage with
    ``os.fsync``) before the method returns, so an acknowledged change survives the actor's
    process dying; on start the file is replayed. A torn last record (the process died while
    writing it, so the change was never acknowledged) is detected by its length and CRC-32 and
    cut off. Once ``compact_records_max`` records or ``compact_bytes_max`` bytes were appended,
    the log is rewritten as one snapshot record of the live state (to a temporary file that
    replaces the log atomically), which bounds its size and the replay time.

    The log may live on shared storage so that a metadata actor restarted on another node finds
    it; only one actor may write it at a time.
    """

    def __init__(
        self,
        log_path: str | os.PathLike[str] | None = None,
        *,
        fsync: bool = True,
        compact_records_max: int = COMPACT_RECORDS_MAX_DEFAULT,
        compact_bytes_max: int = COMPACT_BYTES_MAX_DEFAULT,
    ) -> None:
        if compact_records_max < 1 or compact_bytes_max < 1:
            raise ValueError("compaction bounds must be positive")
        self._jobs: dict[str, dict[str, Any]] = {}
        self._sizing: list[dict[str, Any]] = []
        self._endings: dict[str, list[str]] = {}
        self._ops: list[dict[str, Any]] = []
        self._next_seq = 1
        self._path = None if log_path is None else Path(log_path)
        self._fsync = fsync
        self._compact_records_max = compact_records_max
        self._compact_bytes_max = compact_bytes_max
        self._file: Any = None
        self._records_since_compaction = 0
        self._replayed = 0
        if self._path is not None:
            self._open_log(self._path)

    # -- mutations ----------------------------------------------------------------------------

    def put_job(self, record: dict[str, Any]) -> int:
        """Record a registered job (``record["job_id"]`` names it; a second put replaces it).

        Returns the op's sequence number.
        """
        job_id = record["job_id"]
        if job_id not in self._jobs and len(self._jobs) >= JOBS_MAX:
            raise ClusterError(f"too many registered jobs (at most {JOBS_MAX})")
        return self._commit({"op": "register_job", "job_id": job_id, "record": record})

    def update_job(self, job_id: str, fields: dict[str, Any]) -> int:
        """Change fields of a job's record (e.g. its ``epoch`` and ``weight_map``).

        Returns the op's sequence number. Raises ``JobNotRegistered`` if the job is unknown.
        """
        if job_id not in self._jobs:
            raise JobNotRegistered(f"job {job_id!r} is not registered")
        return self._commit({"op": "update_job", "job_id": job_id, "fields": dict(fields)})

    def remove_job(
        self, job_id: str, missing_ok: bool = False, ending: list[str] | None = None
    ) -> dict[str, Any] | None:
        """Forget a job; returns its record. With ``ending``, the servers (node ids) that must
        still confirm the job's end are logged in the same record (see :meth:`update_ending`).

        Raises ``JobNotRegistered`` if it is unknown, or returns ``None`` with ``missing_ok``
        (a retried call whose first attempt went through).
        """
        if job_id not in self._jobs:
            if missing_ok:
                return None
            raise JobNotRegistered(f"job {job_id!r} is not registered")
        record = self._jobs[job_id]
        change: dict[str, Any] = {"op": "deregister_job", "job_id": job_id}
        if ending:
            change["ending"] = sorted(ending)
        self._commit(change)
        return record

    def record_sizing(self, action: dict[str, Any]) -> int:
        """Log one action of the controller's sizing loop (JSON-compatible, with its
        ``at_unix_s``); the latest ``SIZING_ACTIONS_KEPT_MAX`` are kept. Returns the op's
        sequence number."""
        return self._commit({"op": "sizing_action", "action": dict(action)})

    def update_ending(self, job_id: str, remaining: list[str]) -> int:
        """Log which servers must still confirm an ended job's end (none: the end is complete
        and forgotten). Returns the op's sequence number."""
        return self._commit({"op": "job_ending", "job_id": job_id, "ending": sorted(remaining)})

    # -- queries ------------------------------------------------------------------------------

    def sizing_actions(self) -> list[dict[str, Any]]:
        """The latest sizing actions logged, oldest first."""
        return [dict(a) for a in self._sizing]

    def get_job(self, job_id: str) -> dict[str, Any]:
        """The record of one job. Raises ``JobNotRegistered`` if it is unknown."""
        try:
            return self._jobs[job_id]
        except KeyError:
            raise JobNotRegistered(f"job {job_id!r} is not registered") from None

    def jobs(self) -> list[dict[str, Any]]:
        """Records of every registered job, oldest first."""
        return list(self._jobs.values())

    def endings(self) -> dict[str, list[str]]:
        """``job_id -> node ids`` of ended jobs whose end some server has not confirmed."""
        return {job_id: list(nodes) for job_id, nodes in self._endings.items()}

    def ops(self, since_seq: int = 0) -> list[dict[str, Any]]:
        """Op-log entries with a sequence number greater than ``since_seq``, oldest first.

        After a restart these are the entries replayed since the last compaction.
        """
        return [op for op in self._ops if op["seq"] > since_seq]

    def log_info(self) -> dict[str, Any]:
        """Where the log is and how much of it there is: ``{"path", "records", "bytes",
        "replayed", "pid"}`` (``path`` is ``None`` when the log is in memory only)."""
        size = self._file.tell() if self._file is not None else 0
        return {
            "path": None if self._path is None else str(self._path),
            "records": self._records_since_compaction,
            "bytes": size,
            "replayed": self._replayed,
            "pid": os.getpid(),
        }

    def close(self) -> None:
        """Close the log file (the actor is about to be killed)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- internals ----------------------------------------------------------------------------

    def _commit(self, change: dict[str, Any]) -> int:
        """Log ``change`` durably, then apply it; returns its sequence number."""
        entry = {"seq": self._next_seq, "at_unix_s": time.time(), **change}
        if self._file is not None:
            self._write(encode_record(entry))
            self._records_since_compaction += 1
        self._apply(entry)
        if self._file is not None and (
            self._records_since_compaction >= self._compact_records_max
            or self._file.tell() >= self._compact_bytes_max
        ):
            self._compact()
        return entry["seq"]

    def _apply(self, entry: dict[str, Any]) -> None:
        kind = entry["op"]
        if kind == _SNAPSHOT:
            self._jobs = {r["job_id"]: r for r in entry["jobs"]}
            self._sizing = list(entry.get("sizing", []))[-SIZING_ACTIONS_KEPT_MAX:]
            self._endings = {str(j): list(n) for j, n in entry.get("endings", {}).items()}
            self._next_seq = max(self._next_seq, int(entry["next_seq"]))
            return
        job_id = entry.get("job_id", "")
        if kind == "sizing_action":
            self._sizing.append(entry["action"])
            del self._sizing[:-SIZING_ACTIONS_KEPT_MAX]
        elif kind == "register_job":
            self._jobs[job_id] = entry["record"]
        elif kind == "update_job":
            if job_id in self._jobs:
                self._jobs[job_id] = {**self._jobs[job_id], **entry["fields"]}
        elif kind in ("deregister_job", "job_ending"):
            if kind == "deregister_job":
                self._jobs.pop(job_id, None)
            self._endings.pop(job_id, None)
            if entry.get("ending"):
                self._endings[job_id] = list(entry["ending"])
                while len(self._endings) > ENDINGS_MAX:
                    del self._endings[next(iter(self._endings))]
        else:
            raise ClusterError(f"unknown metadata log record {kind!r}")
        self._next_seq = max(self._next_seq, int(entry["seq"]) + 1)
        self._ops.append(entry)
        if len(self._ops) > OP_LOG_ENTRIES_MAX:
            del self._ops[: len(self._ops) - OP_LOG_ENTRIES_MAX]

    def _open_log(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = path.read_bytes() if path.exists() else b""
        records, good_bytes = decode_records(data)
        for entry in records:
            self._apply(entry)
        self._replayed = len(records)
        self._records_since_compaction = len(records)
        self._file = open(path, "ab")  # noqa: SIM115 - kept open for the actor's lifetime
        if good_bytes < len(data):
            log.warning(
                "metadata log %s: ignored %d bytes after the last whole record",
                path, len(data) - good_bytes,
            )
            self._file.truncate(good_bytes)
            self._file.seek(good_bytes)
        if records:
            log.info("metadata log %s: replayed %d records", path, len(records))

    def _write(self, line: bytes) -> None:
        try:
            self._file.write(line)
            self._file.flush()
            if self._fsync:
                os.fsync(self._file.fileno())
        except OSError as exc:
            raise ClusterError(f"cannot append to the metadata log {self._path}: {exc}") from exc

    def _compact(self) -> None:
        """Rewrite the log as one snapshot of the live state, atomically."""
        assert self._path is not None and self._file is not None
        snapshot = {
            "seq": self._next_seq - 1,
            "at_unix_s": time.time(),
            "op": _SNAPSHOT,
            "next_seq": self._next_seq,
            "jobs": list(self._jobs.values()),
            "sizing": list(self._sizing),
            "endings": dict(self._endings),
        }
        tmp = self._path.with_name(self._path.name + ".compact")
        try:
            with open(tmp, "wb") as out:
                out.write(encode_record(snapshot))
                out.flush()
                if self._fsync:
                    os.fsync(out.fileno())
            os.replace(tmp, self._path)
            if self._fsync:
                dir_fd = os.open(self._path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError as exc:
            # The old log is still whole and still open; compaction is retried after more records.
            log.warning("compacting the metadata log %s failed: %s", self._path, exc)
            self._records_since_compaction = 0
            return
        self._file.close()
        self._file = open(self._path, "ab")  # noqa: SIM115 - kept open for the actor's lifetime
        self._records_since_compaction = 1
