"""Restore after a crash, built without Ray: the loader's data (storage nodes, the Metadata
log's records) handed to fresh roles over real servers."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from control_roles import register, roles

from pocketflow.control.metadata import Metadata
from pocketflow.control.restore import InitData, RestoredNode, restore
from pocketflow.processes import wait_gone

LEASE_MS = 5000


def test_fresh_roles_take_back_jobs_leases_and_servers_and_move_jobs_off_the_gone(
    cluster_secret_file: tuple[bytes, Path], tmp_path: Path
) -> None:
    _, secret_file = cluster_secret_file
    metadata = Metadata(tmp_path / "metadata.log")
    with roles(secret_file, metadata=metadata) as before:
        kept = before.start("rs-0")
        gone = before.start("rs-1")
        handle = register(before, "restored")
        metadata.update_job(handle.job_id, {"lease_ms": LEASE_MS})
        nodes = dict(zip(("rs-0", "rs-1"), before.started, strict=True))
        os.kill(gone.server_pid, signal.SIGKILL)
        assert not wait_gone([gone.server_process()], timeout_s=10)
        init = InitData(
            nodes=[RestoredNode(kept, nodes["rs-0"], True, nodes["rs-0"].stats()),
                   RestoredNode(gone, nodes["rs-1"], False)],
            jobs=metadata.jobs(),
        )
        with roles(secret_file, metadata=metadata) as after:
            with after.lock:
                restored = restore(
                    init, membership=after.membership, jobs=after.jobs, leases=after.leases,
                    routes=after.routes, epochs=after.epochs, ends=after.ends,
                    add_server=after.membership.add,
                )
            assert restored == {"servers": ["rs-0"], "jobs": [handle.job_id],
                                "leases": {handle.job_id: LEASE_MS}, "grants": 0}
            assert "rs-1" in after.membership.dead_servers()
            assert after.leases.get(handle.job_id).lease_ms == LEASE_MS
            record = after.jobs.record(handle.job_id).handle
            assert record.epoch == handle.epoch + 1
            assert [s.node_id for s in record.lost] == ["rs-1"]
            assert [s.node_id for s in record.servers] == ["rs-0"]
            assert record.token != handle.token
            assert metadata.get_job(handle.job_id)["epoch"] == record.epoch
