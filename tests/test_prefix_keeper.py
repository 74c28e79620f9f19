"""A prefix keeper against a hung server (issue 28, item 1): three real servers, a kept prefix
with keys on each, one server SIGSTOPped for longer than the lease. The keeper renews every server
on its own deadline, so the two that answer keep the prefix and its keys the whole time, and once
the stopped server runs again it is renewed again too.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from fixtures_servers import CLIENT_OPTIONS, ServerSet

from pocketflow.client import Client, connect
from pocketflow.handle import ServerInfo
from pocketflow.placement import Placement
from pocketflow.prefixes import PrefixKeeper, PrefixLeases

LEASE_MS = 1000
KEYS_PER_SERVER = 6
STOP_S = 3.0
CHECK_INTERVAL_S = 0.2


def _keys_on(placement: Placement, node_id: str, prefix: str, count: int) -> list[str]:
    keys = [f"{prefix}/k{i}" for i in range(2000)]
    on = [k for k in keys if placement.server_for(k.encode()).node_id == node_id]
    assert len(on) >= count, f"too few keys placed on {node_id}"
    return on[:count]


def _present(pf: Client, keys: list[str]) -> int:
    return sum(pf.exists("b", key) for key in keys)


def test_a_hung_server_does_not_stall_the_renewal_of_the_others(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    for n in range(3):
        servers, _ = server_factory(f"keep-{n}", capacity_bytes=16 * 1024 * 1024)
    handle = servers.handle()
    hung, live = servers.infos[2], servers.infos[:2]
    placement = Placement.of_handle(handle)
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        leases = PrefixLeases(pf, lease_ms=LEASE_MS)
        leases.declare("p")
        kept = {s.node_id: _keys_on(placement, s.node_id, "p", KEYS_PER_SERVER)
                for s in servers.infos}
        live_keys = [k for s in live for k in kept[s.node_id]]
        for keys in kept.values():
            pf.put_many("b", [(key, b"x" * 100) for key in keys])
        with PrefixKeeper(leases, ["p"]) as keeper:
            time.sleep(LEASE_MS / 1000)  # a few renewals on every server
            pid = servers.process(hung.node_id).pid
            os.kill(pid, signal.SIGSTOP)
            try:
                renewals_at_stop = keeper.renewals
                deadline = time.monotonic() + STOP_S
                while time.monotonic() < deadline:
                    held = _present(pf, live_keys)
                    assert held == len(live_keys), (
                        f"{held} of {len(live_keys)} kept keys on the live servers left "
                        f"{STOP_S - (deadline - time.monotonic()):.1f}s into the stop")
                    time.sleep(CHECK_INTERVAL_S)
                # One round every third of a lease went on while one server hung.
                assert keeper.renewals - renewals_at_stop >= 2 * STOP_S * 1000 / LEASE_MS
            finally:
                os.kill(pid, signal.SIGCONT)
            # The resumed server is renewed again: a key written under the prefix there now
            # outlives two leases, and the live servers' keys are all still there.
            again = _keys_on(placement, hung.node_id, "p/again", 2)
            pf.put_many("b", [(key, b"y") for key in again])
            time.sleep(2.5 * LEASE_MS / 1000)
            assert _present(pf, again) == len(again)
            assert _present(pf, live_keys) == len(live_keys)
        # Closed, the keeper renews nothing: the prefix lapses everywhere.
        deadline = time.monotonic() + 3 * LEASE_MS / 1000
        while _present(pf, live_keys + again) and time.monotonic() < deadline:
            time.sleep(CHECK_INTERVAL_S)
        assert _present(pf, live_keys + again) == 0
