"""A job's end raced by its own lease renewals and lapses (issue 27 defects 3 and 4, at their
worst moment), on one real server: job A renews its prefix as fast as it can, with a lease short
enough to lapse around the moment its end (``delete_job``) comes, while job B holds a prefix of
the same name with data in it. Every round: B's data stays and its lease renews; A's data is
freed once (the server's used bytes come back to B's alone, never below), and once ended A's
renewals are refused, never accepted again.
"""

from __future__ import annotations

import random
import threading
import time

from fixtures_servers import CLIENT_OPTIONS

from pocketflow.client import connect
from pocketflow.errors import JobNotRegistered
from pocketflow.handle import JobHandle
from pocketflow.protocol import ACTION_RENEW_LEASES, action_body
from pocketflow.transport import ServerConnection

ROUNDS = 24
A_LEASE_MS = 100
"""Job A's lease: the shortest a server takes, so its lapse races its end."""
B_LEASE_MS = 1000
RENEWALS_MAX = 10_000
"""Most renewals A's renewer sends in one round (it stops at its job's end)."""
JOIN_TIMEOUT_S = 30.0
SWEEPS_S = 0.5
"""Long enough for the server's lease sweep (every 50 ms) to have run after the end."""


def renew(connection: ServerConnection, handle: JobHandle, prefixes: list[str],
          lease_ms: int) -> dict:
    return connection.action(
        ACTION_RENEW_LEASES,
        action_body(handle.context(), prefixes=prefixes, lease_ms=lease_ms),
    )


def server_used(servers, info) -> tuple[int, dict]:  # noqa: ANN001
    with servers.admin(info.address) as admin:
        stats = admin.stats()
    return int(stats["used_bytes"]), stats.get("jobs", {})


def end_while_renewing(servers, info, kept: dict[str, bytes]) -> None:  # noqa: ANN001
    """One round: a fresh job A with the same keys as B renews its prefix as fast as it can
    (pausing about a lease now and then, so the prefix lapses) while its end comes; no renewal
    is accepted after the end."""
    job_a = servers.handle()
    connection = ServerConnection(info.address, exchange_command=None, direct=False,
                                  op_timeout_s=30.0)
    try:
        with connect(job_a, **CLIENT_OPTIONS) as pf_a:
            pf_a.create_bucket("b")
            for key, value in kept.items():
                pf_a.put("b", key, value)
        renew(connection, job_a, ["kept"], A_LEASE_MS)
        accepted_after_end: list[int] = []
        ended = threading.Event()
        start = threading.Barrier(2)

        def renewer() -> None:
            start.wait(JOIN_TIMEOUT_S)
            for n in range(RENEWALS_MAX):
                was_ended = ended.is_set()
                try:
                    renew(connection, job_a, ["kept", f"new/{n}"], A_LEASE_MS)
                except JobNotRegistered:
                    return
                if was_ended:
                    accepted_after_end.append(n)
                if random.random() < 0.05:
                    time.sleep(A_LEASE_MS / 1000 * random.uniform(0.8, 1.3))

        thread = threading.Thread(target=renewer)
        thread.start()
        start.wait(JOIN_TIMEOUT_S)
        time.sleep(random.uniform(0, 2 * A_LEASE_MS / 1000))
        with servers.admin(info.address) as admin:
            admin.delete_job(job_a.job_id)
        ended.set()
        thread.join(JOIN_TIMEOUT_S)
        assert not thread.is_alive(), "A's renewals were never refused"
        assert accepted_after_end == [], accepted_after_end
        _, jobs = server_used(servers, info)
        assert job_a.job_id not in jobs, jobs
    finally:
        connection.close()


def test_a_jobs_end_raced_by_its_renewals_and_lapses_frees_its_data_once_and_no_other(
    server_factory,  # noqa: ANN001
) -> None:
    servers, info = server_factory("lease-end-0", capacity_bytes=64 * 1024 * 1024)
    job_b = servers.handle()
    kept = {"kept/small": b"b" * 1000, "kept/large": random.Random(1).randbytes(3 * 1024 * 1024)}
    conn_b = ServerConnection(info.address, exchange_command=None, direct=False,
                              op_timeout_s=30.0)
    stop = threading.Event()
    b_failures: list[BaseException] = []

    def keeper() -> None:
        # B's keeper renews every quarter lease, as a driver's does.
        while not stop.wait(B_LEASE_MS / 4000):
            try:
                renew(conn_b, job_b, ["kept"], B_LEASE_MS)
            except BaseException as exc:  # noqa: BLE001 - asserted below
                b_failures.append(exc)
                return

    b_keeper = threading.Thread(target=keeper)
    try:
        with connect(job_b, **CLIENT_OPTIONS) as pf_b:
            pf_b.create_bucket("b")
            for key, value in kept.items():
                pf_b.put("b", key, value)
            renew(conn_b, job_b, ["kept"], B_LEASE_MS)
            b_keeper.start()
            b_used, _ = server_used(servers, info)
            for round_ in range(ROUNDS):
                end_while_renewing(servers, info, kept)
                if round_ % 6 == 0:
                    time.sleep(SWEEPS_S)
                # B's data is all there, and A's was freed once: the server holds B's alone.
                assert pf_b.get_many("b", list(kept)) == list(kept.values()), round_
                used, jobs = server_used(servers, info)
                assert used == b_used, (round_, used, b_used, jobs)
    finally:
        stop.set()
        if b_keeper.is_alive():
            b_keeper.join(JOIN_TIMEOUT_S)
        conn_b.close()
    assert b_failures == [], b_failures
