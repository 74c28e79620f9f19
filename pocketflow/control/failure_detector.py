"""Failure detection: which silent storage servers are gone (to be declared dead) and which are
only suspect (hung, stopped or overloaded: never stopped, their data kept)."""

from __future__ import annotations

import logging
import time
from typing import Any

from pocketflow.control.admin import AdminTokens, sampled_stats
from pocketflow.control.membership import Membership
from pocketflow.control.storage_node import StorageNodeInfo
from pocketflow.errors import PocketflowError

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_MS_MIN = 50
"""Shortest accepted heartbeat interval."""

DEAD_AFTER_MS_DEFAULT = 3000
"""A storage server whose heartbeats are missing for this long is declared dead."""

PROBE_TIMEOUT_S_MIN = 1.0
"""Shortest deadline of the direct ``stats`` probe of a server whose heartbeats are late.

The probe's deadline is ``dead_after`` (at least this): a server busy on a loaded machine is
not stopped for one slow answer, while a killed one refuses the connection at once and a hung
one is declared dead ``dead_after`` later (about twice ``dead_after`` after it hung)."""

SUSPECT_RECHECK_S = 5.0
"""How often a suspect server (silent, not answering, but its process is running: hung, stopped
or overloaded) is probed again; between probes the failure detector skips it."""


class FailureDetector:
    """Looks at the servers whose heartbeats are missing for ``dead_after_s``.

    A silent server that answers a direct ``stats`` probe is alive (its answer counts as a
    heartbeat); one whose process still runs, by its ``StorageNode`` (``nodes.process_runs``),
    becomes a suspect, probed again every ``SUSPECT_RECHECK_S``; the others are gone. Deciding
    what a gone server means for the jobs is the controller's (:meth:`gone`, then its lock).

    ``probe`` is used only by the caller's thread (``AdminTokens`` is not shared between
    threads).
    """

    def __init__(
        self, membership: Membership, *, probe: AdminTokens, nodes: Any, dead_after_s: float
    ) -> None:
        self._membership = membership
        self._probe = probe
        self._nodes = nodes
        self.dead_after_s = dead_after_s

    def silent(self) -> dict[str, float]:
        """``node_id -> seconds since its last heartbeat`` for servers silent too long."""
        return self._membership.silent(dead_after_s=self.dead_after_s)

    def gone(self) -> list[str]:
        """The silent servers that neither answer a probe nor have a running process; suspects
        are marked on the way (a suspect probed less than ``SUSPECT_RECHECK_S`` ago is
        skipped). The servers due are probed at once (:meth:`AdminTokens.fan_out`), so hung
        servers cost one probe deadline together, not one each."""
        found = []
        probed: list[StorageNodeInfo] = []
        for node_id in self.silent():
            info = self._membership.get(node_id)
            if info is None:
                found.append(node_id)
                continue
            probed_at = self._membership.suspect_probed_at(node_id)
            if probed_at is not None and time.monotonic() - probed_at < SUSPECT_RECHECK_S:
                continue
            probed.append(info)
        answers = self._probe.fan_out(
            (info.node_id, info.address, sampled_stats) for info in probed
        )
        for info in probed:
            if self._answered(info, answers[info.node_id]):
                continue
            if self._nodes.process_runs(self._membership.node(info.node_id), info.node_id):
                # Hung, stopped or overloaded, not gone: its data stays, it gets no new
                # jobs, and its clients' calls fail within their op timeout meanwhile.
                self._membership.mark_suspect(info.node_id)
                continue
            found.append(info.node_id)
        return found

    def _answered(self, info: StorageNodeInfo, answer: dict[str, Any] | PocketflowError) -> bool:
        """Whether a silent server answered ``stats`` within the probe's deadline.

        Heartbeats travel through Ray and can be late on a loaded machine; a server that
        answers is alive and its answer counts as a heartbeat. A killed server refuses the
        connection at once, a hung one costs one probe deadline (``dead_after``).
        """
        if isinstance(answer, PocketflowError):
            self._probe.forget(info.address)
            return False
        log.warning("heartbeats of %s are late but it answers; still alive", info.node_id)
        self._membership.heartbeat(info.node_id, answer)
        return True

    def close(self) -> None:
        self._probe.close()
