"""Prefix routes: declared prefixes granted DRAM (or spilled to NVMe) become routes of the job's
weight map, each change in a new epoch (bookkeeping of the grants in control/prefix_grants.py)."""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from pocketflow.control.allocator import Allocator
from pocketflow.control.epochs import Epochs
from pocketflow.control.job_table import JobTable
from pocketflow.control.membership import Membership
from pocketflow.control.prefix_grants import WAITING_MAX, PrefixGrants, Waiting, grants_from_record
from pocketflow.errors import InvalidRequest, JobNotRegistered
from pocketflow.handle import POOLS_MAX, ROUTES_MAX, JobHandle, ServerInfo
from pocketflow.prefixes import check_prefix, check_prefix_lease_ms
from pocketflow.protocol import EPOCH_MAP_MAX_BYTES, LEASE_PREFIXES_MAX

log = logging.getLogger(__name__)

PREFIX_WAIT_S_MAX = 30.0
"""Longest a prefix declaration may wait for DRAM (well inside the driver's call deadline)."""

RESTORED_GRANT_GRACE_S = 10.0
"""Shortest life a restarted controller gives a prefix grant it took back from the log, so that
the drivers' renewals (which failed while it came up) reach it before the grant lapses."""

POOL_DRAM = "dram"
"""Pool name of the DRAM servers a job's granted prefixes are routed to."""
POOL_NVME = "nvme"
"""Pool name of the NVMe servers a job's spilled prefixes are routed to."""
SERVER_POOL_PREFIX = "dram-"
"""Pools of one DRAM server each (``dram-0``, ...): where prefixes granted on one server go."""


class PrefixRoutes:
    """Grants declared prefixes DRAM and routes them. Called under the controller's lock, except
    :meth:`renew` (the grants have a lock of their own, so a renewal never waits behind a
    registration).

    ``wake()`` wakes the declarations waiting for DRAM (the controller's condition).
    """

    def __init__(
        self,
        grants: PrefixGrants,
        jobs: JobTable,
        membership: Membership,
        allocator: Allocator,
        epochs: Epochs,
        *,
        wake: Callable[[], None],
    ) -> None:
        self.grants = grants
        self._jobs = jobs
        self._membership = membership
        self._allocator = allocator
        self._epochs = epochs
        self._wake = wake
        self._seen: dict[str, Any] = {**grants.summary(), "dram_free_bytes": {}}
        # Routed prefixes whose grant lapsed, per job: dropped from its map at its next epoch.
        self._lapsed: dict[str, set[str]] = {}

    def declare(
        self,
        job_id: str,
        requests: list[tuple[str, int]],
        lease_ms: int,
        wait_s: float,
        *,
        wait: Callable[[float], Any],
    ) -> dict[str, Any]:
        """See ``Controller.declare_prefixes``; ``wait(left_s)`` waits on the controller's
        condition (releasing its lock) at most ``left_s``."""
        requests = declarations(requests)
        check_prefix_lease_ms(lease_ms)
        if not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= PREFIX_WAIT_S_MAX:
            raise InvalidRequest(f"wait_s must be a number in 0..{PREFIX_WAIT_S_MAX}")
        started = time.monotonic()
        record = self._jobs.record(job_id)
        self.expire(started)
        live = self.grants.granted(job_id)
        self.grants.renew(job_id, [p for p, _ in requests if p in live], started)
        lapsed = self._lapsed.get(job_id, set())
        routed = {p for p, _pool in record.handle.routes.routes if p not in lapsed}
        todo = [(p, n) for p, n in requests if p not in live and p not in routed]
        if len(routed | {p for p, _ in todo}) > ROUTES_MAX:
            raise InvalidRequest(f"a job routes at most {ROUTES_MAX} prefixes")
        # Each new route adds `"prefix":"pool",` to the map servers must accept.
        grown = len(json.dumps(record.handle.weight_map(), separators=(",", ":"))) + sum(
            len(json.dumps(p)) + 8 for p, _ in todo)
        if grown > EPOCH_MAP_MAX_BYTES:
            raise InvalidRequest(
                f"the routes would make the job's weight map larger than "
                f"{EPOCH_MAP_MAX_BYTES} bytes: declare fewer or shorter sized prefixes")
        waiting = Waiting(job_id, collections.deque(todo), lease_ms / 1000.0)
        if todo and self.grants.waiting() < WAITING_MAX:
            self.grants.enqueue(waiting)
            self.serve()
            deadline = started + wait_s
            while waiting.pending and waiting.cancelled is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wait(left)
            self.grants.leave(waiting)
            self.serve()  # what waited behind this one may fit now
        if waiting.cancelled is not None:
            raise JobNotRegistered(f"job {job_id!r}: {waiting.cancelled}")
        spilled = [p for p, _ in waiting.pending]
        handle, placed = self._route(job_id, waiting.granted, spilled)
        waited_s = time.monotonic() - started
        if waiting.granted or spilled:
            log.info("job %s: %d prefixes granted DRAM, %d spilled after %.2f s", job_id,
                     len(waiting.granted), len(spilled), waited_s)
        return {
            "handle": handle,
            "dram": list(waiting.granted),
            "nvme": [p for p in spilled if placed],
            "default": [] if placed else spilled,
            "waited_s": waited_s,
        }

    def renew(self, job_id: str, prefixes: list[str]) -> int:
        """Extend the grants of a job's ``prefixes``; how many hold a grant."""
        self._jobs.record(job_id)
        return self.grants.renew(job_id, list(prefixes), time.monotonic())

    def end(self, job_id: str, prefixes: list[str]) -> int:
        """Take back the grants of a job's ended ``prefixes`` (their routes go with the next
        route change); how many held a grant."""
        if not isinstance(prefixes, list) or len(prefixes) > LEASE_PREFIXES_MAX or not all(
                isinstance(p, str) for p in prefixes):
            raise InvalidRequest(f"prefixes must be a list of at most {LEASE_PREFIXES_MAX} str")
        self._jobs.record(job_id)
        ended = self.grants.end(job_id, prefixes)
        if ended:
            self._lapsed.setdefault(job_id, set()).update(g.prefix for g in ended)
            self.serve()
        return len(ended)

    def expire(self, now_s: float) -> int:
        """Take back the grants whose lease lapsed; how many lapsed."""
        lapsed = self.grants.expire(now_s)
        for grant in lapsed:
            if grant.job_id in self._jobs:
                self._lapsed.setdefault(grant.job_id, set()).add(grant.prefix)
        if lapsed:
            self.serve()
        return len(lapsed)

    def release_job(self, job_id: str) -> None:
        """A job ended: its grants go back, its waiting declarations end, DRAM is served on."""
        self.grants.release_job(job_id, "the job was deregistered while it waited")
        self._lapsed.pop(job_id, None)
        self.serve()
        self._wake()  # its waiting declarations end now

    def serve(self) -> None:
        """Give free DRAM to the waiting declarations (in order) and wake them."""
        if not self.grants.waiting():
            return
        # Grants not counted: ``serve`` takes them off itself.
        free = self._allocator.dram_free(grants=False)
        if self.grants.serve(free, self._dram_pool, time.monotonic()):
            self._wake()

    def summary(self) -> dict[str, Any]:
        """Live grants, granted bytes, waiting declarations and prefixes, and each DRAM
        server's room left for new grants (``dram_free_bytes``); kept for :meth:`last_summary`."""
        free = {n: max(free, 0) for n, free in self._allocator.dram_free(grants=True).items()}
        self._seen = {**self.grants.summary(), "dram_free_bytes": free}
        return self._seen

    def last_summary(self) -> dict[str, Any]:
        """The figures of the last :meth:`summary`, marked ``stale`` (when the lock is busy)."""
        return {**self._seen, "stale": True}

    def restore(self, logged: dict[str, object], now_s: float) -> int:
        """Take back the prefix grants the jobs' records hold (written with each route change)
        before anything moves a job to a new epoch: each gets a whole lease from now, at least
        ``RESTORED_GRANT_GRACE_S`` (the drivers' renewals failed while the controller came up,
        and reach it only once their next period comes), so the keepers that go on renewing
        keep it, and a grant nobody renews (its prefix ended just before the crash) lapses
        then. Shares on servers that are not back are dropped; a prefix no longer routed is
        skipped. Returns how many were taken back."""
        restored = 0
        for job_id, record in logged.items():
            job = self._jobs.get(job_id)
            if job is None:
                continue
            routed = {prefix for prefix, _pool in job.handle.routes.routes}
            for grant in grants_from_record(job_id, record, now_s):
                shares = {n: b for n, b in grant.shares.items() if n in self._membership}
                if grant.prefix not in routed or not shares:
                    continue
                grant.shares = shares
                grant.expires_at_s = max(grant.expires_at_s, now_s + RESTORED_GRANT_GRACE_S)
                restored += self.grants.restore(grant)
        self.summary()  # status shows them from the start
        return restored

    def _pool(self, job_id: str, name: str) -> list[str]:
        """The members of a job's pool ``name``: those its map names already (routed keys must
        not move), else every live, active server of that tier."""
        record = self._jobs.get(job_id)
        if record is not None:
            named = record.handle.routes.pool_map().get(name)
            if named:
                return [m for m in named if m in self._membership]
        return sorted(
            info.node_id for info in self._membership.servers()
            if info.tier == name and not self._membership.unavailable(info.node_id)
        )

    def _dram_pool(self, job_id: str) -> list[str]:
        return self._pool(job_id, POOL_DRAM)

    def _route(
        self, job_id: str, granted: list[str], spilled: list[str]
    ) -> tuple[JobHandle, bool]:
        """Route ``granted`` prefixes to the job's DRAM pool and ``spilled`` ones to its NVMe
        pool, dropping routes whose grant lapsed, in a new epoch when anything changed. Returns
        the job's handle and whether spilled prefixes had an NVMe pool to go to."""
        record = self._jobs.record(job_id)
        handle = record.handle
        lapsed = self._lapsed.pop(job_id, set()) - set(granted) - set(spilled)
        routes = handle.routes.without(lapsed) if lapsed else handle.routes
        defined = routes.pool_map()
        pools: dict[str, list[str]] = {}
        new: dict[str, str] = {}
        grants = self.grants.granted(job_id)
        spread: list[str] = []
        for prefix in granted:  # a grant on one server routes the prefix to that server alone
            grant = grants.get(prefix)
            name = None
            if grant is not None and len(grant.shares) == 1:
                name = server_pool(next(iter(grant.shares)), {**defined, **pools})
            if name is None:
                spread.append(prefix)
            else:
                pools.setdefault(name, list(grant.shares))
                new[prefix] = name
        for name, prefixes in ((POOL_DRAM, spread), (POOL_NVME, spilled)):
            members = self._pool(job_id, name)
            if prefixes and members:
                pools.setdefault(name, members)
                new.update(dict.fromkeys(prefixes, name))
        placed = not spilled or POOL_NVME in pools
        if not new and not lapsed:
            return handle, placed
        routes = routes.with_routes({n: m for n, m in pools.items() if n not in defined}, new)
        servers = list(handle.servers)
        listed = {s.node_id for s in servers}
        for _name, members in routes.pools:
            for node_id in members:
                info = self._membership.get(node_id)
                if node_id not in listed and info is not None:
                    servers.append(ServerInfo(node_id, info.address, info.tier, 0.0))
                    listed.add(node_id)
        return self._epochs.move(job_id, tuple(servers), routes=routes), placed


def server_pool(node_id: str, pools: dict[str, list[str]]) -> str | None:
    """The name of the pool of ``node_id`` alone among ``pools`` (``dram-<k>``), or a new one;
    ``None`` when a map has no room for another pool (two stay for ``dram`` and ``nvme``)."""
    for name, members in pools.items():
        if name.startswith(SERVER_POOL_PREFIX) and members == [node_id]:
            return name
    if len(set(pools) | {POOL_DRAM, POOL_NVME}) >= POOLS_MAX:
        return None
    return next(f"{SERVER_POOL_PREFIX}{k}" for k in range(POOLS_MAX)
                if f"{SERVER_POOL_PREFIX}{k}" not in pools)


def declarations(requests: Any) -> list[tuple[str, int]]:
    """``[(prefix, size_bytes), ...]`` checked: declared prefixes, sizes >= 0, no repeats."""
    if not isinstance(requests, (list, tuple)) or len(requests) > ROUTES_MAX:
        raise InvalidRequest(f"declare at most {ROUTES_MAX} prefixes as [(prefix, size), ...]")
    checked: list[tuple[str, int]] = []
    seen: set[str] = set()
    for item in requests:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise InvalidRequest(f"a declaration is (prefix, size_bytes), got {item!r:.100}")
        prefix, size = check_prefix(item[0]), item[1]
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidRequest(f"size_bytes of {prefix!r} must be an int >= 0, got {size!r}")
        if prefix in seen:
            raise InvalidRequest(f"prefix {prefix!r} declared twice in one call")
        seen.add(prefix)
        checked.append((prefix, size))
    return checked
