"""Scenario run by tests/test_autoscaling.py in its own process: pocketflow on Ray's real
autoscaler (the fake multi-node provider, benchmarks/autoscaling_ray.py), whose worker nodes are
raylets on this machine. The head holds two DRAM slots (the long-running servers); each worker
node the autoscaler launches holds one NVMe slot, so every latency-insensitive job's data lives
on worker nodes.

Steps, each recorded in the JSON line printed at the end (an error ends only its step):

- scale_up: a job that no server can take registers; the autoscaler adds a node, a server
  starts on it and serves the job.
- scale_down: the job deregisters; the server retires, the autoscaler request drops its slot and
  the autoscaler removes the node.
- node_loss: a Lithops shuffle whose partitions live on one worker node; the node (its raylet and
  everything on it) is SIGKILLed once all but the last mapper wrote; its data is DataUnavailable
  at once, the autoscaler brings a replacement node, the shuffle regenerates the lost partitions
  by lineage and its output is checked.
- controller_restart: the controller is SIGKILLed while a server it launched runs; Ray restarts
  it, and it takes the server back, keeps its slot requested and keeps its sizing history.
- nothing_left: the pocketflow cluster stops; the request is withdrawn and the autoscaler removes
  every worker node.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not installed

import ray  # noqa: E402
from polling import wait  # noqa: E402

from benchmarks.autoscaling_ray import AutoscalingRay, NodeType  # noqa: E402
from pocketflow.cluster import LocalCluster  # noqa: E402
from pocketflow.control import CONTROLLER_ACTOR_NAME, NAMESPACE  # noqa: E402
from pocketflow.control.launcher import tier_resource  # noqa: E402
from pocketflow.errors import DataUnavailable  # noqa: E402
from pocketflow.placement import Placement  # noqa: E402

MIB = 1024 * 1024
DEFAULT_DASHBOARD_PORT = 8265
"""Ray's default dashboard port (``ray_constants.DEFAULT_DASHBOARD_PORT``)."""
DRAM_SLOT = tier_resource("dram")
NVME_SLOT = tier_resource("nvme")
WORKER_NODES_MAX = 3
"""Worker nodes the autoscaler may run (a killed node counts until the autoscaler ends it)."""
NODE_WAIT_S = 120.0
"""Bound on waiting for the autoscaler to add or remove a node (raylets start slowly on a
loaded 2-core machine)."""
JOB_HINTS = {"latency_sensitive": False, "data_size_bytes": 24 * MIB}
"""A job for one NVMe server of 32 MiB (75%: the sizing loop adds nothing for it)."""
MAPPERS = 6
HELD_MAPPERS = 3
"""The last mappers, held until the test killed the node holding the others' partitions."""
LITHOPS_WORKERS = HELD_MAPPERS
"""As many Lithops workers as held mappers: once the free mappers wrote, every worker holds a
held one, so no reducer runs before the kill (a reducer reads, with DELETE, every input already
there before it waits for the others, so a reducer running then would consume the partitions
the kill is meant to lose)."""
REDUCERS = 2
PARTITION_BYTES = 64 * 1024
SHUFFLE_TIMEOUT_S = 240.0
RESTART_WAIT_S = 60.0


@contextlib.contextmanager
def hold_port(port: int) -> Iterator[bool]:
    """Listen on 127.0.0.1:``port`` for the block; yields whether this process holds it (it may
    be held already)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            yield False
            return
        sock.listen()
        yield True


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def step(out: dict[str, Any], name: str, body: Callable[[dict[str, Any]], None]) -> None:
    """Run one step; what it observed and any error go under ``out[name]``."""
    seen: dict[str, Any] = {}
    started = time.monotonic()
    try:
        body(seen)
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        seen["error"] = traceback.format_exc()[-4000:]
    seen["step_s"] = round(time.monotonic() - started, 1)
    out[name] = seen


def server_ids(cluster: LocalCluster) -> set[str]:
    return {s["node_id"] for s in cluster.status()["servers"]}


def servers_on(cluster: LocalCluster, ray_nodes: list[str]) -> dict[str, str]:
    """``server -> ray node`` of the servers on the given Ray nodes."""
    return {s["node_id"]: s["ray_node_id"] for s in cluster.status()["servers"]
            if s["ray_node_id"] in ray_nodes}


def nvme_bundles(cluster_ray: AutoscalingRay) -> int:
    return sum(1 for b in cluster_ray.resource_request() if NVME_SLOT in b)


# -- the shuffle's tasks (run in Lithops worker processes) ----------------------------------------


def record_bytes(mapper: int, reducer: int) -> bytes:
    return bytes([mapper * REDUCERS + reducer + 1]) * PARTITION_BYTES


def hold_last_mapper(directory: str, item: int, emit: Callable[[int, Any], None]) -> int:
    """Every mapper emits one partition per reducer; the last ``HELD_MAPPERS`` only once the
    test released them (after it killed the node holding the others' partitions)."""
    if item >= MAPPERS - HELD_MAPPERS:
        deadline = time.monotonic() + SHUFFLE_TIMEOUT_S
        while not (Path(directory) / "release").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the test never released the last mapper")
            time.sleep(0.05)
    for reducer in range(REDUCERS):
        emit(reducer, record_bytes(item, reducer))
    return item


def join_inputs(partition: int, inputs: list[bytes]) -> bytes:
    return b"".join(inputs)


# -- steps -----------------------------------------------------------------------------------------


def scale_up(cluster: LocalCluster, cluster_ray: AutoscalingRay, seen: dict[str, Any],
             jobs: dict[str, Any]) -> None:
    before = set(cluster_ray.worker_nodes())
    seen["workers_before"] = sorted(before)
    started = time.monotonic()
    job = cluster.register_job("scale-up", JOB_HINTS, lease_ms=None)
    jobs["scale_up"] = job
    seen["registered_s"] = round(time.monotonic() - started, 1)
    added = sorted(set(cluster_ray.worker_nodes()) - before)
    seen["added_nodes"] = added
    weighted = {s.node_id for s in job.handle.servers if s.weight > 0}
    on_new = servers_on(cluster, added)
    seen["job_servers_on_new_nodes"] = sorted(weighted & set(on_new))
    seen["nvme_bundles"] = nvme_bundles(cluster_ray)
    with job.connect(op_timeout_s="10s") as pf:
        pf.create_bucket("b")
        placement = Placement(job.handle.servers)
        key = next(f"k{i}" for i in range(1000)
                   if placement.server_for(f"k{i}".encode()).node_id in on_new)
        pf.put("b", key, b"x" * 4096)
        seen["roundtrip_on_new_node"] = pf.get("b", key) == b"x" * 4096


def scale_down(cluster: LocalCluster, cluster_ray: AutoscalingRay, seen: dict[str, Any],
               jobs: dict[str, Any]) -> None:
    job = jobs.pop("scale_up")
    initial = {"dram-0", "dram-1"}
    started = time.monotonic()
    job.deregister()
    seen["retired"] = wait(lambda: server_ids(cluster) == initial, NODE_WAIT_S)
    seen["retired_s"] = round(time.monotonic() - started, 1)
    seen["request_dropped"] = wait(lambda: nvme_bundles(cluster_ray) == 0, NODE_WAIT_S)
    seen["request_dropped_s"] = round(time.monotonic() - started, 1)
    seen["node_removed"] = wait(lambda: not cluster_ray.worker_nodes(), NODE_WAIT_S)
    seen["node_removed_s"] = round(time.monotonic() - started, 1)
    seen["request"] = cluster_ray.resource_request()
    seen["actions"] = [[a["action"], a.get("node_ids") or a.get("node_id")]
                       for a in cluster.status()["sizing_actions"]]


def node_loss(cluster: LocalCluster, cluster_ray: AutoscalingRay, seen: dict[str, Any],
              jobs: dict[str, Any], work_dir: Path) -> None:
    try:
        import lithops
        from pocketflow_lithops.shuffle import shuffle
        from pocketflow_lithops.shuffle_tasks import SHUFFLE_BUCKET
    except ImportError as exc:
        seen["skipped"] = f"the Lithops adapter is not installed: {exc}"
        return
    from pocketflow.client import connect
    from pocketflow.demo import lithops_config

    job = cluster.register_job("node-loss", JOB_HINTS, lease_ms=None)
    jobs["node_loss"] = job
    weighted = [s for s in job.handle.servers if s.weight > 0]
    victim_server = weighted[0].node_id
    victim = next(s["ray_node_id"] for s in cluster.status()["servers"]
                  if s["node_id"] == victim_server)
    seen["victim_server"] = victim_server
    assert victim in cluster_ray.worker_nodes(), "the job's server is not on a worker node"
    release = work_dir / "release"
    killer_seen: dict[str, Any] = {}

    def kill_when_written() -> None:
        try:
            with connect(job.handle, op_timeout_s="5s") as pf:
                written = wait(lambda: len(_partitions(pf, SHUFFLE_BUCKET))
                               >= (MAPPERS - HELD_MAPPERS) * REDUCERS, SHUFFLE_TIMEOUT_S / 2)
                killer_seen["partitions_before_kill"] = len(_partitions(pf, SHUFFLE_BUCKET))
                assert written, "the mappers never wrote"
                some_key = _partitions(pf, SHUFFLE_BUCKET)[0]
                killer_seen["killed_pids"] = len(cluster_ray.kill_node(victim))
                killed_at = time.monotonic()
                try:
                    pf.get(SHUFFLE_BUCKET, some_key)
                except DataUnavailable:
                    killer_seen["data_unavailable_s"] = round(time.monotonic() - killed_at, 2)
                # Released once the control plane moved the job onto a replacement.
                moved = wait(lambda: _weighted_elsewhere(cluster, job.job_id, victim_server),
                             NODE_WAIT_S)
                killer_seen["replaced"] = moved
                killer_seen["replaced_s"] = round(time.monotonic() - killed_at, 1)
        except Exception:  # noqa: BLE001 - reported
            killer_seen["error"] = traceback.format_exc()[-3000:]
        finally:
            release.touch()

    killer = threading.Thread(target=kill_when_written, daemon=True)
    config = lithops_config(storage="localhost", workers=LITHOPS_WORKERS)
    with lithops.FunctionExecutor(config=config) as fexec:
        killer.start()
        try:
            result = shuffle(
                fexec, functools.partial(hold_last_mapper, str(work_dir)), join_inputs,
                list(range(MAPPERS)), reducers=REDUCERS, job=job, input_wait_s=SHUFFLE_TIMEOUT_S,
                timeout_s=SHUFFLE_TIMEOUT_S,
            )
        finally:
            killer.join(SHUFFLE_TIMEOUT_S)
            seen.update(killer_seen)
            fexec.clean()
    expected = [b"".join(record_bytes(m, r) for m in range(MAPPERS)) for r in range(REDUCERS)]
    seen["output_correct"] = list(result.outputs) == expected
    seen["regenerated"] = [list(map(list, rnd)) for rnd in result.regenerated]
    seen["new_nodes"] = sorted(set(cluster_ray.worker_nodes()) - {victim})
    seen["victim_alive"] = victim in cluster_ray.worker_nodes()
    now = cluster.control.job_handle(job.job_id)
    seen["job_servers_after"] = sorted(s.node_id for s in now.servers if s.weight > 0)
    seen["lost"] = [s.node_id for s in now.lost]


def _partitions(pf: Any, bucket: str) -> list[str]:
    """Keys of the mappers' partitions written so far (``r<reducer>/m<mapper>``)."""
    try:
        keys = [info.key for info in pf.list(bucket)]
    except Exception:  # noqa: BLE001 - the bucket is not made yet
        return []
    return [k for k in keys if k.startswith("r") and "/m" in k]


def _weighted_elsewhere(cluster: LocalCluster, job_id: str, dead_server: str) -> bool:
    handle = cluster.control.job_handle(job_id)
    weighted = {s.node_id for s in handle.servers if s.weight > 0}
    return bool(weighted) and dead_server not in {s.node_id for s in handle.servers}


def controller_restart(cluster: LocalCluster, cluster_ray: AutoscalingRay,
                       seen: dict[str, Any], jobs: dict[str, Any]) -> None:
    controller = ray.get_actor(CONTROLLER_ACTOR_NAME, namespace=NAMESPACE)
    if not server_ids(cluster) - {"dram-0", "dram-1"}:
        # The node-loss step left no launched server: a job that needs one.
        jobs["restart"] = cluster.register_job("restart", JOB_HINTS, lease_ms=None)
    launched = sorted(server_ids(cluster) - {"dram-0", "dram-1"})
    seen["launched_before"] = launched
    assert launched, "no launched server to take back"
    actions_before = len(cluster.status()["sizing_actions"])
    seen["actions_before"] = actions_before
    old_pid = ray.get(controller.pid.remote(), timeout=30)
    os.kill(old_pid, signal.SIGKILL)
    started = time.monotonic()

    def restarted() -> bool:
        try:
            return ray.get(controller.pid.remote(), timeout=5) != old_pid
        except Exception:  # noqa: BLE001 - restarting
            return False

    seen["restarted"] = wait(restarted, RESTART_WAIT_S)
    seen["restart_s"] = round(time.monotonic() - started, 1)
    restored = ray.get(controller.restored.remote(), timeout=30) or {}
    seen["restored_servers"] = sorted(restored.get("servers", []))
    # The launched servers stay (detached nodes), and their slots stay requested.
    time.sleep(2.0)
    seen["servers_after"] = sorted(server_ids(cluster))
    seen["nvme_bundles_after"] = nvme_bundles(cluster_ray)
    seen["actions_after"] = len(cluster.status()["sizing_actions"])


def main() -> None:
    out: dict[str, Any] = {}
    node_types = [NodeType("storage", {NVME_SLOT: 1}, max_workers=WORKER_NODES_MAX)]
    # Ray's default dashboard port taken, as another Ray on the machine takes it: the head
    # starts on a port of its own (its start failed on "Failed to bind to 127.0.0.1:8265").
    with hold_port(DEFAULT_DASHBOARD_PORT) as held, AutoscalingRay(
        head_resources={DRAM_SLOT: 2}, node_types=node_types
    ) as cluster_ray:
        out["default_dashboard_port_taken"] = held or port_in_use(DEFAULT_DASHBOARD_PORT)
        cluster_ray.connect()
        assert cluster_ray.work_dir is not None
        cluster = LocalCluster(
            dram_servers=2, nvme_servers=0, dram_capacity="16MiB", nvme_capacity="32MiB",
            autoscale=True, storage_resources=True, register_timeout=f"{NODE_WAIT_S:.0f}s",
            sizing_interval="1s", sizing_cooldown="2s", dead_after="3s", tmp_dir="/var/tmp",
        )
        jobs: dict[str, Any] = {}
        with cluster:
            step(out, "scale_up", lambda seen: scale_up(cluster, cluster_ray, seen, jobs))
            step(out, "scale_down", lambda seen: scale_down(cluster, cluster_ray, seen, jobs))
            step(out, "node_loss", lambda seen: node_loss(
                cluster, cluster_ray, seen, jobs, cluster_ray.work_dir))  # type: ignore[arg-type]
            step(out, "controller_restart",
                 lambda seen: controller_restart(cluster, cluster_ray, seen, jobs))
            out["workers_at_stop"] = len(cluster_ray.worker_nodes())
            stopped_at = time.monotonic()
        seen_left: dict[str, Any] = {}
        seen_left["request_after_stop"] = cluster_ray.resource_request()
        seen_left["nodes_gone"] = wait(lambda: not cluster_ray.worker_nodes(), NODE_WAIT_S)
        seen_left["nodes_gone_s"] = round(time.monotonic() - stopped_at, 1)
        seen_left["request_later"] = cluster_ray.resource_request()
        out["nothing_left"] = seen_left
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
