"""The job table and the drivers' job leases, built and tested without Ray (the leases with a
real ``Metadata`` log)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pocketflow.auth import verify_token
from pocketflow.control.job_leases import LEASE_EXPIRIES_PER_PASS_MAX, JobLeases
from pocketflow.control.job_table import FIRST_EPOCH, JobRecord, JobTable
from pocketflow.control.metadata import Metadata
from pocketflow.control.metadata_calls import MetadataCalls
from pocketflow.errors import JobNotRegistered, PermissionDenied
from pocketflow.handle import ServerInfo

SECRET = b"s" * 32
SERVERS = (ServerInfo("dram-0", "127.0.0.1:1", "dram", 1.0), ServerInfo("dram-1", "127.0.0.1:2",
                                                                          "dram", 0.0))


def _table() -> JobTable:
    return JobTable(secret=SECRET, token_ttl_s=60.0, block_size_bytes=1 << 20, tls_ca=None)


def _record(table: JobTable, name: str = "sort") -> JobRecord:
    job_id = table.new_job_id(name)
    return JobRecord(handle=table.new_handle(job_id, name, SERVERS), hints={"x": 1},
                     registered_at_unix_s=time.time(), demand={})


def test_jobs_get_ids_of_their_name_and_tokens_for_their_id_only() -> None:
    table = _table()
    record = _record(table)
    table.put(record)
    job_id = record.handle.job_id
    assert job_id.startswith("sort-") and table.new_job_id("sort") != job_id
    assert record.handle.epoch == FIRST_EPOCH
    verify_token(SECRET, job_id, record.handle.token)
    with pytest.raises(PermissionDenied):
        verify_token(SECRET, "other-000000", record.handle.token)
    time.sleep(0.01)  # tokens name their expiry in ms
    renewed = table.renew_token(job_id)
    assert renewed.token != record.handle.token
    assert table.record(job_id).handle.token == renewed.token
    assert table.holding("dram-1") == [job_id] and table.holding("dram-9") == []
    with pytest.raises(JobNotRegistered):
        table.record("nobody-000000")
    with pytest.raises(JobNotRegistered):
        table.renew_token("nobody-000000")


def test_a_record_read_back_from_the_log_keeps_its_map_with_a_new_token() -> None:
    table = _table()
    record = _record(table)
    back = table.from_metadata(record.to_metadata())
    assert back.handle.weight_map() == record.handle.weight_map()
    assert back.handle.job_id == record.handle.job_id and back.hints == record.hints
    verify_token(SECRET, back.handle.job_id, back.handle.token)


def test_lease_lengths_are_logged_once_and_a_run_out_lease_is_due(tmp_path: Path) -> None:
    metadata = Metadata(tmp_path / "metadata.log")
    metadata.put_job({"job_id": "a-000001", "name": "a", "epoch": 1})
    leases = JobLeases(MetadataCalls(metadata))
    try:
        now = time.monotonic()
        leases.renew("a-000001", lease_ms=200, now_s=now)
        deadline = time.monotonic() + 10
        while metadata.get_job("a-000001").get("lease_ms") != 200:
            assert time.monotonic() < deadline, "the lease length was never logged"
            time.sleep(0.01)
        logged = len(metadata.ops())
        leases.renew("a-000001", lease_ms=200, now_s=now)
        time.sleep(0.1)
        assert len(metadata.ops()) == logged, "an unchanged lease length was logged again"
        assert leases.due(now_s=now + 0.1) == []
        assert leases.due(now_s=now + 0.3) == ["a-000001"]
        leases.release("a-000001")
        assert leases.due(now_s=now + 0.3) == [] and leases.get("a-000001") is None
        # A lease started with its registration (or taken back after a restart) runs from then,
        # and counts as logged; one taken back lasts its grace at least.
        leases.start("a-000001", lease_ms=200, now_s=now + 1)
        assert leases.due(now_s=now + 1.1) == [] and leases.due(now_s=now + 1.3) == ["a-000001"]
        leases.start("a-000001", lease_ms=200, now_s=now + 1, at_least_s=5.0)
        assert leases.due(now_s=now + 5.9) == [] and leases.due(now_s=now + 6.1) == ["a-000001"]
        time.sleep(0.1)
        assert len(metadata.ops()) == logged, "a started lease was logged again"
        leases.release("a-000001")
        for index in range(LEASE_EXPIRIES_PER_PASS_MAX + 2):
            leases.start(f"b-{index:06d}", lease_ms=100, now_s=now)
        assert len(leases.due(now_s=now + 5)) == LEASE_EXPIRIES_PER_PASS_MAX
    finally:
        leases.close()
        metadata.close()
