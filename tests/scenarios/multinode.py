"""Scenario run by tests/test_multinode.py in its own process: a multi-node Ray cluster made with
``ray.cluster_utils.Cluster`` where storage servers are placed by custom resources. A job that
does not fit waits for a node with a free storage slot (the controller asks the autoscaler); the
test adds one, a server starts on it, and the node is drained before it is removed. Prints one
JSON line of observations."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from pocketflow.auth import write_secret_file
from pocketflow.client import connect
from pocketflow.control import CONTROLLER_ACTOR_NAME, METADATA_ACTOR_NAME, NAMESPACE
from pocketflow.control.controller import Controller
from pocketflow.control.launcher import LaunchSpec, tier_resource
from pocketflow.control.loopback import keep_ray_on_loopback
from pocketflow.control.metadata import Metadata
from pocketflow.control.tiers import local_spec

MIB = 1024 * 1024
OBJECT_STORE_BYTES = 80 * MIB
SLOT = tier_resource("dram")


def wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def main() -> None:
    keep_ray_on_loopback()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p
    )
    work = Path(tempfile.mkdtemp(prefix="pocketflow-multinode-", dir="/var/tmp"))
    secret = work / "cluster.secret"
    write_secret_file(secret)
    out: dict[str, object] = {}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": OBJECT_STORE_BYTES,
            "resources": {SLOT: 2},
        },
    )
    try:
        ray.init(
            address=cluster.address, namespace=NAMESPACE, log_to_driver=False,
            logging_level=logging.WARNING,
        )
        options = {"namespace": NAMESPACE, "num_cpus": 0}
        metadata = ray.remote(Metadata).options(name=METADATA_ACTOR_NAME, **options).remote()
        controller = (
            ray.remote(Controller)
            .options(name=CONTROLLER_ACTOR_NAME, max_concurrency=8, **options)
            .remote(
                secret_file=str(secret),
                metadata=metadata,
                block_size_bytes=MIB,
                cluster_spec=local_spec(dram_capacity_bytes=8 * MIB),
                launch=LaunchSpec(
                    secret_file=str(secret),
                    data_dir=str(work),
                    capacity_bytes_by_tier={"dram": 8 * MIB},
                    use_resources=True,
                    servers_max=8,
                ),
                register_timeout_s=90.0,
            )
        )
        for _ in range(2):
            ray.get(controller.launch_server.remote("dram", long_running=True), timeout=60)
        head_id = ray.get_runtime_context().get_node_id()
        status = ray.get(controller.status.remote(), timeout=30)
        out["initial_on_head"] = all(s["ray_node_id"] == head_id for s in status["servers"])

        # 20 MiB does not fit on two 8 MiB servers; no node has a free slot yet.
        pending = controller.register_job.remote("big", {"data_size_bytes": 20 * MIB})
        out["autoscaler_asked"] = wait(
            lambda: bool(ray.get(controller.status.remote(), timeout=30)["resource_requests"]),
            timeout_s=30,
        )
        node = cluster.add_node(
            num_cpus=1, object_store_memory=OBJECT_STORE_BYTES, resources={SLOT: 1}
        )
        handle = ray.get(pending, timeout=120)
        status = ray.get(controller.status.remote(), timeout=30)
        on_new = [s["node_id"] for s in status["servers"] if s["ray_node_id"] == node.node_id]
        out["servers_on_new_node"] = on_new
        out["job_uses_new_node"] = bool(
            set(on_new) & {s.node_id for s in handle.servers if s.weight > 0}
        )
        with connect(handle) as pf:
            pf.create_bucket("b")
            for i in range(32):
                pf.put("b", f"k{i}", b"v" * 10_000)
            # Drain while the job's data is live: the server must stay until the data is freed.
            early = ray.get(controller.drain_node.remote(node.node_id, 3.0), timeout=60)
            out["drain_waits_for_live_data"] = early["still_draining"] == on_new
            out["data_readable_while_draining"] = all(
                pf.get("b", f"k{i}") == b"v" * 10_000 for i in range(32)
            )
        ray.get(controller.deregister_job.remote(handle.job_id), timeout=60)
        drained = ray.get(controller.drain_node.remote(node.node_id, 30.0), timeout=90)
        out["drained"] = drained
        cluster.remove_node(node)
        status = ray.get(controller.status.remote(), timeout=30)
        out["after_remove"] = sorted(s["node_id"] for s in status["servers"])
        out["dead_after_remove"] = sorted(status["dead_servers"])
        ray.get(controller.close.remote(), timeout=60)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
