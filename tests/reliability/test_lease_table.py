"""Two jobs competing for one server's lease table (issue 27, defect 3): one job's leases never
cost another job its data.

Job A fills the table in renewals of ``LEASE_PREFIXES_MAX`` new prefixes, as fast as it can.
Job B, meanwhile, keeps a prefix holding data alive the way a driver does after a new
declaration: every renewal names its kept prefixes and one new prefix. Before the fix A took the
whole server-wide table (65,535 leases), B's next renewal was refused whole, B's kept prefix
lapsed and its data was freed, and the refusal read like a full tier. Now A is refused alone at
its share, with ``LeaseTableFull``; B's renewals all succeed and its data stays; A's own kept
prefixes are renewed by its refused renewals, so A keeps its data too.
"""

from __future__ import annotations

import time

import pytest
from fixtures_servers import CLIENT_OPTIONS

from pocketflow.client import connect
from pocketflow.errors import JobNotRegistered, LeaseTableFull
from pocketflow.handle import JobHandle
from pocketflow.protocol import ACTION_RENEW_LEASES, LEASE_PREFIXES_MAX, action_body
from pocketflow.transport import ServerConnection

LEASES_PER_JOB_MAX = 8192  # servers/crates/store/src/leases.rs
LEASE_MS = 1000
RENEW_EVERY_S = 0.25
KEPT_FOR_S = 4 * LEASE_MS / 1000
"""Long enough for a lapse (a lease, plus the 50 ms sweep) to have freed what was not renewed."""
FILL_ROUNDS_MAX = 32


def renew(connection: ServerConnection, handle: JobHandle, prefixes: list[str]) -> dict:
    return connection.action(
        ACTION_RENEW_LEASES,
        action_body(handle.context(), prefixes=prefixes, lease_ms=LEASE_MS),
    )


def test_a_job_that_fills_the_lease_table_costs_no_other_job_its_data(server_factory) -> None:  # noqa: ANN001
    servers, info = server_factory("leases-0", capacity_bytes=32 * 1024 * 1024)
    job_a, job_b = servers.handle(), servers.handle()
    conn_a = ServerConnection(info.address, exchange_command=None, direct=False,
                              op_timeout_s=30.0)
    conn_b = ServerConnection(info.address, exchange_command=None, direct=False,
                              op_timeout_s=30.0)
    try:
        with connect(job_a, **CLIENT_OPTIONS) as pf_a, connect(job_b, **CLIENT_OPTIONS) as pf_b:
            for pf in (pf_a, pf_b):
                pf.create_bucket("b")
                pf.put("b", "kept/x", b"must stay")
            renew(conn_a, job_a, ["kept"])
            renew(conn_b, job_b, ["kept"])

            # A fills its share of the table, one renewal of new prefixes after another.
            refusal: LeaseTableFull | None = None
            for round_ in range(FILL_ROUNDS_MAX):
                batch = [f"fill{round_}/{i}" for i in range(LEASE_PREFIXES_MAX - 1)]
                try:
                    renew(conn_a, job_a, ["kept", *batch])
                except LeaseTableFull as full:
                    refusal = full
                    break
            assert refusal is not None, "job A was never refused"
            message = str(refusal)
            assert "most leases one job may hold" in message, message
            assert "were renewed" in message and "tier is full" not in message, message

            # B renews its kept prefix with a new one each time, A its kept prefix with a new
            # one; both keep their data over several leases.
            deadline = time.monotonic() + KEPT_FOR_S
            n = 0
            while time.monotonic() < deadline:
                # Accepted whole (the new prefixes it named before lapse: they are renewed
                # once only).
                held = renew(conn_b, job_b, ["kept", f"new/{n}"])["leases"]
                assert 2 <= held <= n + 2, held
                # A's new prefix is refused, or takes the place of one of A's own lapsed
                # leases; A never holds more than its share.
                try:
                    held_a = renew(conn_a, job_a, ["kept", f"more/{n}"])["leases"]
                    assert held_a <= LEASES_PER_JOB_MAX, held_a
                except LeaseTableFull:
                    pass
                n += 1
                time.sleep(RENEW_EVERY_S)
            assert pf_b.get("b", "kept/x") == b"must stay"
            assert pf_a.get("b", "kept/x") == b"must stay"
    finally:
        conn_a.close()
        conn_b.close()
    print(f"job A refused at its share ({LEASES_PER_JOB_MAX}): {message}")


def test_an_ended_job_cannot_renew(server_factory) -> None:  # noqa: ANN001
    servers, info = server_factory("leases-1")
    handle = servers.handle()
    connection = ServerConnection(info.address, exchange_command=None, direct=False,
                                  op_timeout_s=30.0)
    try:
        assert renew(connection, handle, ["kept"])["leases"] == 1
        with servers.admin(info.address) as admin:
            admin.delete_job(handle.job_id)
        with pytest.raises(JobNotRegistered, match="deregistered"):
            renew(connection, handle, ["kept"])
    finally:
        connection.close()
