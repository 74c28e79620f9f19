"""Prefix leases over a build's intermediate objects (Jiffy's task-scoped storage for gg).

Key layout, in both buckets (``gg-blobs``, ``gg-reductions``) of the job; names stay gg's
content names, the prefix is only where an object is stored:

- ``<build>/<name>``: the values and executables the driver uploaded for this build (those the
  job does not already hold at the bucket root). Ended when the build ends.
- ``<build>/t<i>/...``: thunk ``i`` of the build (its place in the driver's visiting order):
  the thunk as submitted, its plan, its outputs and its reductions. Declared when the thunk is
  submitted, ended as soon as every thunk that reads its outputs succeeded.
- the bucket root: the target's outputs (PERSIST) and reductions, as without scoping, so they
  survive the build; objects and reductions that an earlier force left at the root are used
  where they are.

``<build>`` is ``gg-<12 hex digits>``, declared with the build; every ``t<i>`` is below it in
the path, so the keeper renews the whole build by keeping ``<build>`` alone (one
``renew_leases`` per server per third of a lease, whatever the number of thunks), and ending
``<build>`` frees whatever is left. A driver that dies stops renewing: every server frees the
build's objects one lease after the last renewal.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from pocketflow_gg.errors import GGError

if TYPE_CHECKING:
    from pocketflow.job import Job
    from pocketflow.prefixes import PrefixKeeper
    from pocketflow_gg.store import Store

BUILD_PREFIX_START = "gg-"
ENDS_PER_CALL_MAX = 4096
"""Most prefixes one ``Job.end`` is given (the client splits it further per server action)."""


def located(prefix: str, name: str) -> str:
    """The key of ``name`` stored under ``prefix`` (``""``: the bucket root)."""
    return f"{prefix}/{name}" if prefix else name


class BuildScope:
    """A build's prefixes in a pocketflow job: declares the build prefix and starts a keeper
    for it at once; thunk prefixes are declared per submission round (:meth:`declare`) and
    ended per scheduling round (:meth:`consumed`, :meth:`flush`); :meth:`close` ends the
    build prefix and everything still under it."""

    def __init__(self, job: Job, store: Store) -> None:
        if getattr(store, "store_id", None) != job.job_id:
            raise GGError(f"prefix leases scope a build to the job that holds its store: the "
                          f"store is {getattr(store, 'store_id', store)!r}, the job "
                          f"{job.job_id!r} (a PocketflowStore of that job is needed)")
        self.job = job
        self.build = f"{BUILD_PREFIX_START}{uuid.uuid4().hex[:12]}"
        self.lease_ms = job.prefix_leases.lease_ms
        self.ended_bytes = 0
        """Bytes the servers freed when the build's prefixes ended (the build's own too)."""
        self.declared = 0
        self.ended = 0
        self.calls = 1
        """``declare_many``, ``end`` and keeper renewals so far: each is one action per storage
        server of the job, and none is a controller call (no prefix is sized)."""
        self._consumed: list[str] = []
        job.declare_many([(self.build, (), None)])
        self._keeper: PrefixKeeper | None = job.keep([self.build])

    def thunk_prefix(self, index: int) -> str:
        """Where thunk ``index`` of the build keeps its thunk, plan, outputs and reductions."""
        return f"{self.build}/t{index}"

    def declare(self, prefixes: list[str]) -> None:
        """Start the leases of a submission round's thunk prefixes: one renewal per server."""
        if prefixes:
            self.job.declare_many([(p, (), None) for p in prefixes])
            self.declared += len(prefixes)
            self.calls += 1

    def consumed(self, prefix: str) -> None:
        """Every reader of ``prefix`` succeeded: it ends at the next :meth:`flush`."""
        self._consumed.append(prefix)

    def flush(self) -> int:
        """End the consumed prefixes (one ``end_leases`` per server per
        ``ENDS_PER_CALL_MAX``); returns the bytes the servers freed."""
        freed = 0
        while self._consumed:
            batch = self._consumed[:ENDS_PER_CALL_MAX]
            del self._consumed[:ENDS_PER_CALL_MAX]
            freed += self.job.end(batch)
            self.ended += len(batch)
            self.calls += 1
        self.ended_bytes += freed
        return freed

    def close(self) -> int:
        """Stop renewing and end the build prefix with everything still under it; returns the
        bytes the servers freed. A second call does nothing."""
        if self._keeper is None:
            return 0
        keeper, self._keeper = self._keeper, None
        keeper.close()
        self.calls += keeper.renewals + 1
        self._consumed.clear()  # under the build prefix: ended with it
        freed = self.job.end([self.build])
        self.ended_bytes += freed
        return freed
