"""Named caches (:mod:`pocketflow.cache`): each cache is a job of the control plane, found by its
name, kept alive by its lease while drivers use it (it ends ``idle_ms`` after its last run,
freeing its entries) and whose reservation follows its measured working set, grown and shrunk.

A cache lives while a run uses it and ``idle_ms`` after the last one: each run (a driver of
:func:`pocketflow.cache.open_cache`) holds a *run lease* of its own, renewed while it lasts, and
the cache's job lease is kept at the run lease plus ``idle_ms`` while some run holds one; when
the last run ends (:meth:`Caches.end_run`), the job lease restarts at ``idle_ms``. So a run's
liveness does not hang on renewing within ``idle`` (a short idle on a loaded machine used to end
a cache under a live run), and one run ending does not shorten the cache under another. The
runs are the role's memory: after a controller restart it learns them again at their next
renewal.

A cache outlives the runs that use it but not its idleness; what it records with PERSIST (the
working sets of the applications that used it) outlives it. So that the next generation of a
cache of the same name can read those records, the role remembers each ended generation's
handle (:meth:`Caches.open` returns it, with a new token, as ``predecessor``). That memory is
the controller's own: a restarted controller finds the caches again by their jobs' names, but
not the generations that had ended before it started.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from pocketflow.control.hints import demand_from_hints
from pocketflow.control.job_leases import JobLeases
from pocketflow.control.job_table import JobTable
from pocketflow.control.leases import LEASE_MS_MAX, check_lease_ms
from pocketflow.control.tiers import ClusterSpec
from pocketflow.errors import InvalidRequest, JobNotRegistered
from pocketflow.handle import JobHandle

__all__ = ["Caches", "CACHE_JOB_PREFIX", "CACHE_NAME_MAX_BYTES", "CACHES_REMEMBERED_MAX",
           "RUNS_PER_CACHE_MAX", "cache_job_name", "check_cache_name"]

log = logging.getLogger(__name__)

CACHE_JOB_PREFIX = "cache."
"""A cache's job is named ``cache.<cache name>``."""

CACHE_NAME_MAX_BYTES = 90
"""Longest cache name (its job name, with the prefix, stays within a job name's 100 bytes)."""

CACHES_REMEMBERED_MAX = 1024
"""Most cache names whose current and ended generations the role remembers (oldest forgotten)."""

RUNS_PER_CACHE_MAX = 1024
"""Most live runs the role tracks per cache (beyond it, the run whose lease ends first is
forgotten: the cache's job lease still covers it until then)."""

_CACHE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_cache_name(name: str) -> str:
    """``name`` if it names a cache (letters, digits, ``.``, ``_``, ``-``; at most
    ``CACHE_NAME_MAX_BYTES``), else :class:`InvalidRequest`."""
    if not isinstance(name, str) or not _CACHE_NAME.match(name) or (
        len(name.encode()) > CACHE_NAME_MAX_BYTES
    ):
        raise InvalidRequest(
            f"a cache name is 1..{CACHE_NAME_MAX_BYTES} letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit; got {name!r}"
        )
    return name


def cache_job_name(name: str) -> str:
    """The job name of cache ``name``."""
    return CACHE_JOB_PREFIX + check_cache_name(name)


@dataclasses.dataclass
class _Known:
    job_id: str
    handle: JobHandle
    predecessor: JobHandle | None = None


class Caches:
    """The named caches. Every method is called under the controller's lock.

    ``register(job name, hints)`` and ``grow(job id, hints)`` are the controller's own
    registration and growth; ``call_metadata`` writes a shrunk reservation to the job's record.
    """

    def __init__(
        self,
        jobs: JobTable,
        leases: JobLeases,
        *,
        register: Callable[[str, dict[str, Any]], JobHandle],
        grow: Callable[[str, dict[str, Any]], JobHandle],
        call_metadata: Callable[..., Any],
        spec: Callable[[], ClusterSpec],
    ) -> None:
        self._jobs = jobs
        self._leases = leases
        self._register = register
        self._grow = grow
        self._call_metadata = call_metadata
        self._spec = spec
        self._known: OrderedDict[str, _Known] = OrderedDict()
        # job id -> run id -> when that run's lease ends (monotonic s). Its own lock: renewals
        # do not wait behind a registration, as the controller's renew_lease.
        self._runs: dict[str, dict[str, float]] = {}
        self._runs_lock = threading.Lock()

    def open(self, name: str, hints: dict[str, Any], *, idle_ms: int, run_id: str | None = None,
             run_lease_ms: int | None = None) -> dict[str, Any]:
        """Find cache ``name``'s live job, or register one with ``hints``; either way (re)start
        its lease at ``idle_ms``, or, given a run, start that run's lease (:meth:`renew_run`).
        Returns ``{"handle", "created", "predecessor",
        "capacity_bytes"}``: the predecessor is the handle (with a new token) of the generation
        that ended last, whose PERSIST records the new one may read, or ``None``;
        ``capacity_bytes`` what the live generation reserves."""
        job_name = cache_job_name(name)
        check_lease_ms(idle_ms)
        known = self._find(name, job_name)
        created = known is None
        if known is None:
            ended = self._known.pop(name, None)
            handle = self._register(job_name, hints)
            predecessor = ended.handle if ended is not None else None
            known = _Known(handle.job_id, handle, predecessor)
            log.info("cache %s: new generation %s%s", name, handle.job_id,
                     f" after {predecessor.job_id}" if predecessor else "")
        if run_id is None:
            self._leases.renew(known.job_id, lease_ms=idle_ms, now_s=time.monotonic())
        else:
            self.renew_run(known.job_id, run_id, run_lease_ms=run_lease_ms or idle_ms,
                           idle_ms=idle_ms)
        self._known[name] = known
        self._known.move_to_end(name)
        while len(self._known) > CACHES_REMEMBERED_MAX:
            self._known.popitem(last=False)
        predecessor = None
        if known.predecessor is not None:
            predecessor = known.predecessor.replace(
                token=self._jobs.token(known.predecessor.job_id))
        capacity_bytes = self._jobs.record(known.job_id).job_demand().capacity_bytes
        return {"handle": known.handle, "created": created, "predecessor": predecessor,
                "capacity_bytes": capacity_bytes}

    def renew_run(self, job_id: str, run_id: str, *, run_lease_ms: int, idle_ms: int) -> None:
        """Start or renew run ``run_id``'s lease on cache job ``job_id`` for ``run_lease_ms``;
        the job's lease becomes ``run_lease_ms + idle_ms``. Raises :class:`JobNotRegistered`
        when the cache ended, :class:`InvalidRequest` for a job that is not a cache."""
        self._check_cache(job_id)
        check_lease_ms(run_lease_ms)
        check_lease_ms(idle_ms)
        if not isinstance(run_id, str) or not 0 < len(run_id.encode()) <= CACHE_NAME_MAX_BYTES:
            raise InvalidRequest(f"a run id is 1..{CACHE_NAME_MAX_BYTES} bytes, got {run_id!r}")
        now_s = time.monotonic()
        with self._runs_lock:
            if job_id not in self._runs:
                # The runs of caches that ended (their drivers died) go with the next new one,
                # so the table holds live caches only.
                for ended in [job for job in self._runs if job not in self._jobs]:
                    del self._runs[ended]
            runs = self._runs.setdefault(job_id, {})
            runs[run_id] = now_s + run_lease_ms / 1000
            while len(runs) > RUNS_PER_CACHE_MAX:
                del runs[min(runs, key=runs.__getitem__)]
        self._leases.renew(job_id, lease_ms=min(run_lease_ms + idle_ms, LEASE_MS_MAX),
                           now_s=now_s)

    def end_run(self, job_id: str, run_id: str, *, idle_ms: int) -> bool:
        """Run ``run_id`` of cache job ``job_id`` ended: when no other run holds a lease, the
        cache's idle time starts (its job lease restarts at ``idle_ms``). Returns whether other
        runs keep it. Raises :class:`JobNotRegistered` when the cache ended."""
        self._check_cache(job_id)
        check_lease_ms(idle_ms)
        now_s = time.monotonic()
        with self._runs_lock:
            runs = self._runs.get(job_id, {})
            runs.pop(run_id, None)
            for lapsed in [run for run, ends_s in runs.items() if ends_s <= now_s]:
                del runs[lapsed]
            others = bool(runs)
            if not others:
                self._runs.pop(job_id, None)
        if not others:
            self._leases.renew(job_id, lease_ms=idle_ms, now_s=now_s)
        return others

    def _check_cache(self, job_id: str) -> None:
        record = self._jobs.get(job_id)
        if record is None:
            raise JobNotRegistered(f"job {job_id!r} is not registered")
        if not record.handle.name.startswith(CACHE_JOB_PREFIX):
            raise InvalidRequest(f"job {job_id!r} is not a cache")

    def resize(self, job_id: str, hints: dict[str, Any]) -> JobHandle:
        """Move a cache's reservation to ``hints``: a growth takes the controller's path (new
        servers in a new epoch if need be); a shrink keeps the map and reserves less, so that
        other jobs may be packed into what the cache gave back. Returns the cache's handle."""
        record = self._jobs.record(job_id)
        if not record.handle.name.startswith(CACHE_JOB_PREFIX):
            raise InvalidRequest(f"job {job_id!r} is not a cache")
        old = record.job_demand()
        new = demand_from_hints(hints, self._spec())
        if (new.capacity_bytes > old.capacity_bytes
                or new.throughput_bytes_per_s > old.throughput_bytes_per_s):
            handle = self._grow(job_id, hints)
            record = self._jobs.record(job_id)
            if record.demand != new.to_dict():
                # A growth in one dimension that left the map as it was: record the demand.
                self._record_demand(job_id, hints, new.to_dict())
        else:
            self._record_demand(job_id, hints, new.to_dict())
            handle = self._jobs.record(job_id).handle
        for known in self._known.values():
            if known.job_id == job_id:
                known.handle = handle
        return handle

    def _record_demand(self, job_id: str, hints: dict[str, Any], demand: dict[str, Any]) -> None:
        record = self._jobs.record(job_id)
        self._call_metadata("update_job", job_id, {"hints": dict(hints), "demand": demand})
        self._jobs.put(dataclasses.replace(record, hints=dict(hints), demand=demand))

    def _find(self, name: str, job_name: str) -> _Known | None:
        """The live generation of cache ``name``: the one this role registered, else (after a
        controller restart) a registered job of its name; refreshed to the job's current
        handle. ``None`` when it ended (then it is kept as the next one's predecessor)."""
        known = self._known.get(name)
        if known is not None:
            record = self._jobs.get(known.job_id)
            if record is not None:
                known.handle = record.handle
                return known
            return None
        for job_id, record in self._jobs.items():
            if record.handle.name == job_name:
                found = _Known(job_id, record.handle)
                self._known[name] = found
                return found
        return None

    def handle(self, name: str) -> JobHandle:
        """The live handle of cache ``name``; :class:`JobNotRegistered` if it has none."""
        known = self._find(name, cache_job_name(name))
        if known is None:
            raise JobNotRegistered(f"cache {name!r} has no live job")
        return known.handle
