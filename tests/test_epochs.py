"""Tests of epochs: a running job grows onto more servers and its clients follow transparently."""

from __future__ import annotations

from pocketflow.cluster import LocalCluster


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
