"""Tests of epochs: a running job grows onto more servers and its clients follow transparently."""

from __future__ import annotations

from pathlib import Path

from control_roles import register, roles

from pocketflow.client import connect
from pocketflow.cluster import LocalCluster
from pocketflow.handle import LostServer


def test_a_growing_job_moves_to_a_new_epoch_and_old_data_stays_readable(
    local_cluster: LocalCluster,
) -> None:
    with local_cluster.register_job("growing", {"data_size_bytes": "8MiB"}) as job:
        first = job.handle
        weighted = {s.node_id for s in first.servers if s.weight > 0}
        with job.connect() as pf:
            pf.create_bucket("b")
            for i in range(40):
                pf.put("b", f"old-{i}", f"v{i}".encode())

            grown = local_cluster.control.grow_job(job.job_id, {"data_size_bytes": "300MiB"})
            assert grown.epoch == first.epoch + 1
            assert {s.node_id for s in first.servers} <= {s.node_id for s in grown.servers}
            assert {s.node_id for s in grown.servers if s.weight > 0} > weighted

            # The client still holds the first handle: it gets stale_epoch, adopts, and retries.
            for i in range(40):
                assert pf.get("b", f"old-{i}") == f"v{i}".encode()
            for i in range(40):
                pf.put("b", f"new-{i}", b"n")
            assert pf.get("b", "new-39") == b"n"
            assert local_cluster.control.job_handle(job.job_id).epoch == grown.epoch

        import ray

        from pocketflow.control import METADATA_ACTOR_NAME, NAMESPACE

        metadata = ray.get_actor(METADATA_ACTOR_NAME, namespace=NAMESPACE)
        record = ray.get(metadata.get_job.remote(job.job_id), timeout=30)
        assert record["epoch"] == grown.epoch
        assert record["weight_map"] == grown.weight_map()
        assert record["hints"]["data_size_bytes"] == 300 * 1024 * 1024


# -- the Epochs role, built without Ray -----------------------------------------------------------


def test_a_job_moved_off_a_lost_server_follows_without_ray(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    """``Epochs`` over real servers: the new map reaches the job's live servers and its log
    record, the lost server is remembered, and a client holding the old map adopts the new one
    from the first server it calls."""
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        built.start("ep-0")
        built.start("ep-1")
        lost = built.start("ep-2")
        handle = register(built, "moving")
        assert {s.node_id for s in handle.servers} == {"ep-0", "ep-1", "ep-2"}
        with connect(handle, op_timeout_s="5s") as pf:
            pf.create_bucket("b")
            with built.lock:
                moved = built.epochs.move_off_lost(LostServer(lost.node_id, lost.address))
            assert moved == [handle.job_id]
            now = built.jobs.record(handle.job_id).handle
            assert now.epoch == handle.epoch + 1
            assert [s.node_id for s in now.lost] == ["ep-2"]
            assert all(s.node_id != "ep-2" or s.weight == 0 for s in now.servers)
            assert built.metadata.get_job(handle.job_id)["epoch"] == now.epoch
            for index in range(20):
                pf.put("b", f"k{index}", b"v")
            assert pf.handle.epoch == now.epoch
            assert pf.handle.weight_map() == now.weight_map()
