"""Prefix grants: DRAM given to the prefixes of a job's DAG, waited for in order, and taken back
when a prefix's lease lapses or the job ends it (Jiffy's capacity multiplexing, done by the
controller).

A job declares a prefix with the bytes it will hold (``job.declare("shuffle/r3",
size_bytes=...)``). The controller grants the prefix DRAM on the server of the job's DRAM pool
with the most room when it fits there (the prefix is then routed to that server alone, so the
grant is what the server will hold), else over the whole pool when every member has room for an
even share (the route spreads its keys over them by hash); otherwise the declaration waits in a
FIFO, at most ``wait_s``, and what is still waiting at its deadline spills to NVMe. A grant
lasts one prefix lease from its last renewal: the driver renews its granted prefixes with the
controller in one call per renewal period, next to the servers' renewal; ``Job.end`` gives a
consumed prefix's grant back at once. DRAM given back goes to the waiting declarations first,
oldest first, and only then to new declarations and registrations (the controller serves the
FIFO under the same lock that frees the grant, so nothing slips in between).

This module is the bookkeeping only (no I/O): :class:`PrefixGrants` is driven by the controller
(:class:`pocketflow.control.prefix_routes.PrefixRoutes`), which decides under the controller's
lock; the bookkeeping has a lock of its own, so a renewal never waits behind a registration that
holds the controller's lock (while a launch comes up, say) and its prefixes never lapse for it.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from pocketflow.errors import CapacityExhausted

__all__ = ["Grant", "Waiting", "PrefixGrants", "GRANTS_MAX", "WAITING_MAX", "EXPIRY_SLACK_S",
           "grants_record", "grants_from_record"]

GRANTS_MAX = 65_536
"""Most live grants over all jobs."""
WAITING_MAX = 4
"""Most declarations waiting for DRAM at once (each holds one of the controller's threads)."""
WAITING_PREFIXES_MAX = 4096
"""Most prefixes one waiting declaration asks for."""
EXPIRY_SLACK_S = 0.1
"""A grant lapses this long after its lease: the servers free the prefix's data first."""


@dataclass
class Grant:
    """DRAM reserved for one prefix of one job: ``shares`` bytes on each server of its pool."""

    job_id: str
    prefix: str
    shares: dict[str, int]
    lease_s: float
    expires_at_s: float


@dataclass
class Waiting:
    """One declaration waiting for DRAM: ``pending`` prefixes (with their sizes) in order."""

    job_id: str
    pending: collections.deque[tuple[str, int]]
    lease_s: float
    granted: list[str] = field(default_factory=list)
    cancelled: str | None = None
    """Why the declaration ended early (its job was deregistered), else ``None``."""


def _fit(size: int, members: list[str], free: Mapping[str, int]) -> dict[str, int] | None:
    """Where a prefix of ``size`` bytes fits, as bytes per server: all of it on the member with
    the most room when it fits there (its route then names that server alone, so the grant
    is exact), else an even share on every member when each has room for it (its keys spread
    over the pool by hash: the shares are what an even spread takes); ``None`` when neither."""
    if not members:
        return None
    roomiest = max(members, key=lambda m: (free.get(m, 0), m))
    if free.get(roomiest, 0) >= size:
        return {roomiest: size}
    share = math.ceil(size / len(members))
    if all(free.get(m, 0) >= share for m in members):
        return dict.fromkeys(members, share)
    return None


def grants_record(grants: Mapping[str, Grant]) -> dict[str, dict]:
    """A job's live grants as its Metadata record keeps them (JSON-compatible): prefix ->
    ``{"shares": {node_id: bytes}, "lease_s": seconds}``."""
    return {prefix: {"shares": dict(g.shares), "lease_s": g.lease_s}
            for prefix, g in grants.items()}


def grants_from_record(job_id: str, record: object, now_s: float) -> list[Grant]:
    """The grants :func:`grants_record` wrote, each with a whole lease from ``now_s``; entries
    that do not parse are skipped (the log is ours, but a grant is never worth a failed
    restart)."""
    if not isinstance(record, dict):
        return []
    grants = []
    for prefix, entry in record.items():
        try:
            shares = {str(node): int(share) for node, share in entry["shares"].items()}
            lease_s = float(entry["lease_s"])
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if shares and lease_s > 0 and all(share >= 0 for share in shares.values()):
            grants.append(Grant(job_id, str(prefix), shares, lease_s,
                                now_s + lease_s + EXPIRY_SLACK_S))
    return grants


def _locked(method):
    """Run ``method`` under the instance's lock."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return run


class PrefixGrants:
    """Live grants and the FIFO of waiting declarations; every method is thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._grants: dict[str, dict[str, Grant]] = {}
        self._count = 0
        self._waiting: collections.deque[Waiting] = collections.deque()

    # -- reading ----------------------------------------------------------------------------

    @_locked
    def reserved_by_server(self) -> dict[str, int]:
        """Bytes granted on each server, over every live grant."""
        return self._reserved()

    def _reserved(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for grants in self._grants.values():
            for grant in grants.values():
                for node_id, share in grant.shares.items():
                    total[node_id] = total.get(node_id, 0) + share
        return total

    @_locked
    def granted(self, job_id: str) -> dict[str, Grant]:
        """The live grants of ``job_id`` by prefix (a copy)."""
        return dict(self._grants.get(job_id, {}))

    @_locked
    def waiting(self) -> int:
        """How many declarations wait."""
        return len(self._waiting)

    @_locked
    def summary(self) -> dict[str, int]:
        """Counts for ``status``: live grants, granted bytes, waiting declarations and prefixes."""
        return {
            "grants": self._count,
            "granted_bytes": sum(self._reserved().values()),
            "waiting_declarations": len(self._waiting),
            "waiting_prefixes": sum(len(w.pending) for w in self._waiting),
        }

    # -- changing ---------------------------------------------------------------------------

    @_locked
    def enqueue(self, waiting: Waiting) -> None:
        """Queue a declaration behind the ones already waiting."""
        if len(waiting.pending) > WAITING_PREFIXES_MAX:
            raise CapacityExhausted(
                f"a declaration waits for at most {WAITING_PREFIXES_MAX} prefixes")
        if len(self._waiting) >= WAITING_MAX:
            raise CapacityExhausted(f"{WAITING_MAX} declarations already wait for DRAM")
        self._waiting.append(waiting)

    @_locked
    def leave(self, waiting: Waiting) -> None:
        """Take a declaration out of the FIFO (decided, timed out or cancelled)."""
        try:
            self._waiting.remove(waiting)
        except ValueError:
            pass

    @_locked
    def serve(
        self,
        free: Mapping[str, int],
        pool_of: Callable[[str], list[str]],
        now_s: float,
    ) -> bool:
        """Grant waiting prefixes, oldest declaration first, while they fit in ``free`` (bytes
        free per DRAM server, grants not counted yet); the first that does not fit stops
        everything behind it. ``pool_of(job_id)`` names the servers a job's grant spreads over.
        Returns whether anything was granted."""
        free = dict(free)
        for node_id, share in self._reserved().items():
            if node_id in free:
                free[node_id] -= share
        any_granted = False
        for waiting in self._waiting:
            while waiting.pending:
                prefix, size = waiting.pending[0]
                shares = _fit(size, pool_of(waiting.job_id), free)
                if shares is None or self._count >= GRANTS_MAX:
                    return any_granted
                for member, share in shares.items():
                    free[member] -= share
                waiting.pending.popleft()
                self._add(Grant(waiting.job_id, prefix, shares,
                                waiting.lease_s, now_s + waiting.lease_s + EXPIRY_SLACK_S))
                waiting.granted.append(prefix)
                any_granted = True
        return any_granted

    def _add(self, grant: Grant) -> None:
        grants = self._grants.setdefault(grant.job_id, {})
        if grant.prefix not in grants:
            self._count += 1
        grants[grant.prefix] = grant

    @_locked
    def restore(self, grant: Grant) -> bool:
        """Take back a grant a crashed controller had made (read from the job's Metadata
        record); returns whether it was added (not past ``GRANTS_MAX``)."""
        if self._count >= GRANTS_MAX and grant.prefix not in self._grants.get(grant.job_id, {}):
            return False
        self._add(grant)
        return True

    @_locked
    def renew(self, job_id: str, prefixes: Iterable[str], now_s: float) -> int:
        """Extend the grants of ``prefixes`` by their lease from ``now_s``; returns how many of
        them are granted (the others are ignored: not granted, or lapsed already)."""
        grants = self._grants.get(job_id)
        if not grants:
            return 0
        renewed = 0
        for prefix in prefixes:
            grant = grants.get(prefix)
            if grant is not None:
                grant.expires_at_s = now_s + grant.lease_s + EXPIRY_SLACK_S
                renewed += 1
        return renewed

    @_locked
    def end(self, job_id: str, prefixes: Iterable[str]) -> list[Grant]:
        """Take back the grants of ``prefixes`` of ``job_id`` now; returns them (prefixes
        without a grant are skipped)."""
        grants = self._grants.get(job_id, {})
        ended = [grants.pop(p) for p in dict.fromkeys(prefixes) if p in grants]
        self._count -= len(ended)
        if not grants:
            self._grants.pop(job_id, None)
        return ended

    @_locked
    def expire(self, now_s: float) -> list[Grant]:
        """Take back every grant whose lease lapsed; returns them."""
        lapsed = []
        for job_id in list(self._grants):
            grants = self._grants[job_id]
            for prefix in [p for p, g in grants.items() if g.expires_at_s <= now_s]:
                lapsed.append(grants.pop(prefix))
                self._count -= 1
            if not grants:
                del self._grants[job_id]
        return lapsed

    @_locked
    def release_job(self, job_id: str, why: str) -> None:
        """Forget a job's grants and end its waiting declarations with ``why``."""
        self._count -= len(self._grants.pop(job_id, {}))
        for waiting in [w for w in self._waiting if w.job_id == job_id]:
            waiting.cancelled = why
            self._waiting.remove(waiting)
