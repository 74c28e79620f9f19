"""The job table: registered jobs' records (handle, hints, demand), their ids and their tokens."""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pocketflow.auth import make_token
from pocketflow.control.hints import JobDemand
from pocketflow.control.packing import Allocation
from pocketflow.control.packing import Placement as PackedPlacement
from pocketflow.errors import ClusterError, InvalidRequest, JobNotRegistered
from pocketflow.handle import JobHandle, ServerInfo

JOB_NAME_MAX_BYTES = 100
"""Longest job name; the job id adds a dash and a random suffix (JOB_ID_MAX_BYTES is 128)."""

JOB_ID_SUFFIX_BYTES = 3
"""Random bytes of a job id's suffix (printed as 6 hex digits)."""

JOB_ID_ATTEMPTS_MAX = 16
"""How many random suffixes to try before giving up on a unique job id."""

TOKEN_TTL_S_DEFAULT = 24 * 3600.0
"""Lifetime of a job's capability token."""

FIRST_EPOCH = 1

REQUEST_ID_MAX_BYTES = 64
"""Longest registration request id."""

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class JobRecord:
    """What the controller remembers about a registered job."""

    handle: JobHandle
    hints: dict[str, Any]
    registered_at_unix_s: float
    demand: dict[str, Any] = field(default_factory=dict)
    request_id: str | None = None
    """The id of the registration request (a driver's retry with it finds this job)."""
    held_weights: dict[str, list[Any]] = field(default_factory=dict)
    """``node_id -> [weight, persist]`` of each suspect of the map: what it gets back when it
    answers again."""

    def job_demand(self) -> JobDemand:
        """The demand the job was packed with (:class:`JobDemand`)."""
        return JobDemand.from_dict(self.demand)

    def allocation(self) -> Allocation:
        """The job's current weight map as a packing :class:`Allocation`."""
        return Allocation(
            tuple(
                PackedPlacement(node_id=s.node_id, weight=s.weight, persist=s.persist)
                for s in self.handle.servers
            )
        )

    def holds(self, node_id: str) -> bool:
        """Whether the job's map names ``node_id``."""
        return any(s.node_id == node_id for s in self.handle.servers)

    @classmethod
    def from_metadata(
        cls,
        record: dict[str, Any],
        *,
        token: str,
        block_size_bytes: int,
        tls_ca: str | None = None,
    ) -> JobRecord:
        """A record read back from the ``Metadata`` actor (:meth:`to_metadata` output), with a
        new ``token`` (the log holds none)."""
        handle = JobHandle(
            job_id=str(record["job_id"]),
            name=str(record["name"]),
            epoch=FIRST_EPOCH,
            servers=(),
            token=token,
            block_size_bytes=block_size_bytes,
            tls_ca=tls_ca,
        ).with_weight_map(record["weight_map"])
        return cls(
            handle=handle,
            hints=dict(record.get("hints", {})),
            registered_at_unix_s=float(record["registered_at_unix_s"]),
            demand=dict(record.get("demand", {})),
            request_id=record.get("request_id"),
            held_weights={
                str(n): list(w) for n, w in dict(record.get("held_weights") or {}).items()
            },
        )

    def to_metadata(self) -> dict[str, Any]:
        """The record as stored by the ``Metadata`` actor (JSON-compatible)."""
        return {
            "job_id": self.handle.job_id,
            "name": self.handle.name,
            "epoch": self.handle.epoch,
            "weight_map": self.handle.weight_map(),
            "hints": self.hints,
            "demand": self.demand,
            "registered_at_unix_s": self.registered_at_unix_s,
            "request_id": self.request_id,
            "held_weights": self.held_weights,
        }


def validate_job_name(name: str) -> str:
    """Check a job name: 1-100 bytes of letters, digits, ``.``, ``_``, ``-``; alphanumeric first."""
    if not isinstance(name, str) or not _JOB_NAME.match(name):
        raise InvalidRequest(
            f"invalid job name {name!r}: use letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    if len(name.encode()) > JOB_NAME_MAX_BYTES:
        raise InvalidRequest(f"job name longer than {JOB_NAME_MAX_BYTES} bytes: {name!r}")
    return name


def validate_request_id(request_id: str | None) -> str | None:
    """Check a registration request id: ``None``, or 1-64 letters, digits, ``_`` and ``-``."""
    if request_id is None:
        return None
    if (not isinstance(request_id, str) or not _REQUEST_ID.match(request_id)
            or len(request_id) > REQUEST_ID_MAX_BYTES):
        raise InvalidRequest(
            f"a request id is 1-{REQUEST_ID_MAX_BYTES} letters, digits, '_' and '-', "
            f"got {request_id!r:.100}"
        )
    return request_id


class JobTable:
    """Registered jobs by id (oldest first), and the tokens and handles issued to them.

    Changed only under the controller's lock; single reads and copies need none.
    """

    def __init__(
        self,
        *,
        secret: bytes,
        token_ttl_s: float,
        block_size_bytes: int,
        tls_ca: str | None,
    ) -> None:
        self._secret = secret
        self._token_ttl_s = token_ttl_s
        self._block_size_bytes = block_size_bytes
        self._tls_ca = tls_ca
        self._records: dict[str, JobRecord] = {}
        # Registration request id -> job id, for the jobs registered with one.
        self._requests: dict[str, str] = {}

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._records))

    def get(self, job_id: str) -> JobRecord | None:
        return self._records.get(job_id)

    def record(self, job_id: str) -> JobRecord:
        """The record of a registered job, else ``JobNotRegistered``."""
        record = self._records.get(job_id)
        if record is None:
            raise JobNotRegistered(f"job {job_id!r} is not registered")
        return record

    def records(self) -> list[JobRecord]:
        """Every record, oldest first (a copy)."""
        return list(self._records.values())

    def items(self) -> list[tuple[str, JobRecord]]:
        return list(self._records.items())

    def put(self, record: JobRecord) -> None:
        self._records[record.handle.job_id] = record
        if record.request_id is not None:
            self._requests[record.request_id] = record.handle.job_id

    def remove(self, job_id: str) -> JobRecord | None:
        record = self._records.pop(job_id, None)
        if record is not None and record.request_id is not None:
            self._requests.pop(record.request_id, None)
        return record

    def by_request(self, request_id: str) -> JobRecord | None:
        """The job registered by the request ``request_id``, if it is registered."""
        job_id = self._requests.get(request_id)
        return None if job_id is None else self._records.get(job_id)

    def holding(self, node_id: str) -> list[str]:
        """Ids of the jobs whose map names ``node_id``."""
        return [job_id for job_id, record in self.items() if record.holds(node_id)]

    def new_job_id(self, name: str) -> str:
        """``name`` with a random suffix no registered job has."""
        for _ in range(JOB_ID_ATTEMPTS_MAX):
            job_id = f"{name}-{secrets.token_hex(JOB_ID_SUFFIX_BYTES)}"
            if job_id not in self._records:
                return job_id
        raise ClusterError(f"could not find a free job id for {name!r}")

    def token(self, job_id: str) -> str:
        """A new capability token of ``job_id``, valid for the cluster's token TTL."""
        return make_token(self._secret, job_id, ttl_s=self._token_ttl_s)

    def new_handle(
        self, job_id: str, name: str, servers: tuple[ServerInfo, ...]
    ) -> JobHandle:
        """The first handle of a new job, with a new token."""
        return JobHandle(
            job_id=job_id,
            name=name,
            epoch=FIRST_EPOCH,
            servers=servers,
            token=self.token(job_id),
            block_size_bytes=self._block_size_bytes,
            tls_ca=self._tls_ca,
        )

    def from_metadata(self, record: dict[str, Any]) -> JobRecord:
        """A job record read back from the ``Metadata`` log, with a new token."""
        return JobRecord.from_metadata(
            record,
            token=self.token(str(record["job_id"])),
            block_size_bytes=self._block_size_bytes,
            tls_ca=self._tls_ca,
        )

    def renew_token(self, job_id: str) -> JobHandle:
        """The job's handle with a new token (later handles carry it too); ``JobNotRegistered``.

        Takes no lock: an epoch move racing with it may keep the older token in the record;
        both tokens are valid, and the caller gets the new one.
        """
        record = self.record(job_id)
        handle = record.handle.replace(token=self.token(job_id))
        if self._records.get(job_id) is record:
            self._records[job_id] = dataclasses.replace(record, handle=handle)
        return handle
