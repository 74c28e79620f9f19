"""Draining a server that holds a job's queue items and append records (issue 29, item 2): the
server is not retired while it holds them, a fresh client dequeues every item and reads every
record, and once the job ends the server is retired.

The test adds its own server to the session cluster and drains only that one.
"""

from __future__ import annotations

from typing import Any

from fixtures_cluster import keys_on, wait_for

from pocketflow.client import connect
from pocketflow.cluster import LocalCluster
from pocketflow.control.storage_node import StorageNodeInfo

ITEMS = 20
RETIRE_BOUND_S = 30.0
"""How long the server may take to be told to drain, exit and be retired after the job ends."""


def test_a_drained_server_keeps_its_channels_until_they_are_gone(
    local_cluster: LocalCluster, added_server: tuple[StorageNodeInfo, Any]
) -> None:
    info, _ = added_server
    job = local_cluster.register_job("drained-channels")
    try:
        on, _ = keys_on(job.handle, info.node_id, on_min=2)
        queue_name, file_name = on[0], on[1]
        with job.connect() as pf:
            pf.create_bucket("b")
            queue = pf.queue("b", queue_name, max_items=ITEMS)
            log = pf.append_file("b", file_name)
            for index in range(ITEMS):
                queue.enqueue(f"item-{index}".encode())
                log.append(f"record-{index}".encode())
        stats = {s["node_id"]: s for s in local_cluster.status()["servers"]}
        assert stats[info.node_id]["objects"] == 0  # channels only: no object

        result = local_cluster.control.drain_server(info.node_id)
        assert result["retired"] is False, result
        assert result["holding_channels"] == [job.job_id]
        assert info.server_process().alive()

        # A fresh client, with the job's current handle from the controller.
        handle = local_cluster.control.job_handle(job.job_id)
        with connect(handle, op_timeout_s="5s") as fresh:
            queue = fresh.queue("b", queue_name, max_items=ITEMS)
            items = [queue.dequeue(timeout_s=1) for _ in range(ITEMS)]
            assert items == [f"item-{index}".encode() for index in range(ITEMS)]
            assert queue.dequeue() is None
            records = list(fresh.append_file("b", file_name))
            assert records == [f"record-{index}".encode() for index in range(ITEMS)]
        assert info.node_id in {s["node_id"] for s in local_cluster.status()["servers"]}
    finally:
        job.deregister()
    # The job ended: nothing holds the server any more, it is told to drain, exits and is
    # retired.
    assert wait_for(
        lambda: info.node_id not in {s["node_id"] for s in local_cluster.status()["servers"]},
        timeout_s=RETIRE_BOUND_S,
    ), "the drained server was never retired"
    assert wait_for(lambda: not info.server_process().alive(), timeout_s=RETIRE_BOUND_S)
