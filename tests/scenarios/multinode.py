"""Scenario run by tests/test_multinode.py in its own process: a multi-node Ray cluster made with
``ray.cluster_utils.Cluster`` where storage servers are placed by custom resources. A job that
does not fit waits for a node with a free storage slot (the controller asks the autoscaler); the
test adds one, a server starts on it, and the node is drained before it is removed. Prints one
JSON line of observations."""

from __future__ import annotations

import json
import sys
import uuid

import ray
import ray_nodes
from polling import wait

from pocketflow.cluster import LocalCluster
from pocketflow.control import CONTROLLER_ACTOR_NAME, NAMESPACE
from pocketflow.control.launcher import tier_resource

MIB = 1024 * 1024
SLOT = tier_resource("dram")
FITS_WAIT_S = 20.0
"""Bound on a registration that fits while another waits for a node (it takes well under a
second; before, it waited for the other's node)."""


def main() -> None:
    out: dict[str, object] = {}
    ray_cluster = ray_nodes.start_head({SLOT: 2})
    try:
        ray_nodes.connect(ray_cluster)
        with LocalCluster(
            dram_servers=2,
            nvme_servers=0,
            dram_capacity="8MiB",
            autoscale=True,
            storage_resources=True,
            register_timeout="90s",
            tmp_dir="/var/tmp",
        ) as cluster:
            head_id = ray.get_runtime_context().get_node_id()
            status = cluster.status()
            out["initial_on_head"] = all(s["ray_node_id"] == head_id for s in status["servers"])

            # 20 MiB does not fit on two 8 MiB servers, and no node has a free slot yet.
            controller = ray.get_actor(CONTROLLER_ACTOR_NAME, namespace=NAMESPACE)
            request_id = uuid.uuid4().hex
            pending = controller.register_job.remote(
                "big", {"data_size_bytes": 20 * MIB}, request_id
            )
            # Asked, and the request went through (an "request failed: ..." outcome is no ask).
            out["autoscaler_asked"] = wait(
                lambda: any(
                    r["outcome"] == "requested" for r in cluster.status()["resource_requests"]
                ),
                timeout_s=30,
            )
            out["resource_requests"] = cluster.status()["resource_requests"]
            # While "big" waits for a node, a job that fits registers: the launch waits with
            # the controller's lock released (else it waits until "big" has its node).
            small = controller.register_job.remote("small", {"data_size_bytes": 1 * MIB})
            ready, _ = ray.wait([small], timeout=FITS_WAIT_S)
            big_ready, _ = ray.wait([pending], timeout=0)
            out["fits_registered_while_launch_waits"] = bool(ready) and not big_ready
            # The driver's retry of "big" (its call timed out) while it still waits: answered
            # with the same job once it is registered, not registered a second time.
            retry = controller.register_job.remote(
                "big", {"data_size_bytes": 20 * MIB}, request_id
            )
            node = ray_nodes.add_node(ray_cluster, {SLOT: 1})
            handle = ray.get(pending, timeout=120)
            out["retry_answered_with_the_same_job"] = (
                ray.get(retry, timeout=120).job_id == handle.job_id
            )
            cluster.control.deregister(ray.get(small, timeout=120).job_id)
            status = cluster.status()
            on_new = [s["node_id"] for s in status["servers"] if s["ray_node_id"] == node.node_id]
            out["servers_on_new_node"] = on_new
            out["job_uses_new_node"] = bool(
                set(on_new) & {s.node_id for s in handle.servers if s.weight > 0}
            )
            from pocketflow.client import connect

            with connect(handle) as pf:
                pf.create_bucket("b")
                for i in range(32):
                    pf.put("b", f"k{i}", b"v" * 10_000)
                # Drained while the job's data is live: the server stays until the data is freed.
                early = cluster.control.drain_node(node.node_id, 3.0)
                out["drain_waits_for_live_data"] = early["still_draining"] == on_new
                out["data_readable_while_draining"] = all(
                    pf.get("b", f"k{i}") == b"v" * 10_000 for i in range(32)
                )
            cluster.control.deregister(handle.job_id)
            out["drained"] = cluster.control.drain_node(node.node_id, 25.0)
            ray_cluster.remove_node(node)
            status = cluster.status()
            out["after_remove"] = sorted(s["node_id"] for s in status["servers"])
            out["dead_after_remove"] = sorted(status["dead_servers"])

            # A running job's growth that needs a node waits for it with the controller's lock
            # released too: a job that fits registers meanwhile.
            grown = cluster.control.register("grown", {"data_size_bytes": 1 * MIB})
            asked_before = len(cluster.status()["resource_requests"])
            growing = controller.grow_job.remote(grown.job_id, {"data_size_bytes": 20 * MIB})
            # Its launch under way: a slot more than the two servers' is asked for.
            wait(lambda: any(r["outcome"] == "requested" and r["slots"].get(SLOT, 0) > 2
                             for r in cluster.status()["resource_requests"][asked_before:]),
                 timeout_s=30)
            other = controller.register_job.remote("other", {"data_size_bytes": 1 * MIB})
            ready, _ = ray.wait([other], timeout=FITS_WAIT_S)
            grow_ready, _ = ray.wait([growing], timeout=0)
            out["fits_registered_while_growth_waits"] = bool(ready) and not grow_ready
            grow_node = ray_nodes.add_node(ray_cluster, {SLOT: 2})
            grown_handle = ray.get(growing, timeout=120)
            on_grow_node = {s["node_id"] for s in cluster.status()["servers"]
                            if s["ray_node_id"] == grow_node.node_id}
            out["growth_uses_new_node"] = bool(
                on_grow_node & {s.node_id for s in grown_handle.servers if s.weight > 0}
            )
            cluster.control.deregister(grown.job_id)
            cluster.control.deregister(ray.get(other, timeout=120).job_id)
            cluster.control.drain_node(grow_node.node_id, 25.0)
            ray_cluster.remove_node(grow_node)
    finally:
        ray.shutdown()
        ray_cluster.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
