"""Scenario run by tests/test_tls_nodes.py in its own process: a two-node Ray cluster on one
machine whose nodes have distinct addresses (head 127.0.0.1, node B 127.0.0.2), one TLS storage
server per node placed by custom resources, its metrics over HTTPS. A task pinned to node B
writes; a task pinned to the head reads every byte back over TLS; node B's server is killed and
a read of its data from the head fails with ``DataUnavailable``, timed. Prints one JSON line of
observations."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import ssl
import sys
import time
import urllib.request

import ray
import ray_nodes

from pocketflow.cluster import LocalCluster
from pocketflow.control.launcher import tier_resource
from pocketflow.handle import JobHandle
from pocketflow.job import Hints
from pocketflow.placement import Placement

MIB = 1024 * 1024
SLOT = tier_resource("dram")
NODE_B_ADDRESS = "127.0.0.2"
KEYS = 24
CLIENT_OPTIONS = {"op_timeout_s": "5s", "rpc_timeout_s": "5s", "connect_timeout_s": "2s"}


def value_of(i: int) -> bytes:
    """Key ``k<i>``'s value: small ones, and some over the block size."""
    size = 2 * MIB + i if i % 4 == 0 else 1000 + i
    return hashlib.sha256(str(i).encode()).digest() * (size // 32) + b"x" * (size % 32)


@ray.remote(num_cpus=0, resources={"node_b": 0.01})
def write_on_b(handle_json: str) -> str:
    from pocketflow.client import connect

    handle = JobHandle.from_json(handle_json)
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("x")
        for i in range(KEYS):
            pf.put("x", f"k{i}", value_of(i))
    return str(ray.util.get_node_ip_address())


@ray.remote(num_cpus=0, resources={"node_a": 0.01})
def read_on_a(handle_json: str, keys: list[int]) -> dict[str, object]:
    from pocketflow.client import connect
    from pocketflow.errors import PocketflowError

    handle = JobHandle.from_json(handle_json)
    out: dict[str, object] = {"node": str(ray.util.get_node_ip_address()), "ok": 0}
    started = time.monotonic()
    with connect(handle, **CLIENT_OPTIONS) as pf:
        for i in keys:
            try:
                if pf.get("x", f"k{i}") == value_of(i):
                    out["ok"] = int(out["ok"]) + 1  # type: ignore[call-overload]
            except PocketflowError as exc:
                out["error"] = type(exc).__name__
                out["message"] = str(exc)[:300]
                break
    out["seconds"] = time.monotonic() - started
    return out


def main() -> None:
    out: dict[str, object] = {}
    ray_cluster = ray_nodes.start_head({SLOT: 1, "node_a": 1})
    try:
        ray_nodes.add_node(ray_cluster, {SLOT: 1, "node_b": 1}, node_ip_address=NODE_B_ADDRESS)
        ray_nodes.connect(ray_cluster)
        with LocalCluster(
            dram_servers=2, nvme_servers=0, dram_capacity="48MiB", storage_resources=True,
            tls=True, tmp_dir="/var/tmp", dead_after="3s",
        ) as cluster:
            servers = cluster.status()["servers"]
            out["server_hosts"] = sorted(s["address"].rsplit(":", 1)[0] for s in servers)
            out["metrics_hosts"] = sorted(
                s["metrics_url"].split("//")[1].rsplit(":", 1)[0] for s in servers
            )
            out["all_tls"] = all(s["tls"] for s in servers)
            # Metrics on a node address follow the TLS rule: HTTPS with the server's
            # certificate, which a scraper trusting the cluster CA reads.
            out["metrics_schemes"] = sorted({s["metrics_url"].split("://")[0] for s in servers})
            with urllib.request.urlopen(
                servers[-1]["metrics_url"], timeout=10,
                context=ssl.create_default_context(cadata=cluster.tls_ca),
            ) as reply:
                out["metrics_scraped"] = b"pocketflow_capacity_bytes" in reply.read()
            on_b = next(s for s in servers if s["address"].startswith(NODE_B_ADDRESS + ":"))
            with cluster.register_job("xnode", Hints(data_size_bytes="64MiB")) as job:
                handle = job.handle
                out["handle_has_ca"] = handle.tls_ca is not None and "PRIVATE" not in handle.tls_ca
                out["writer_node"] = ray.get(write_on_b.remote(handle.to_json()), timeout=120)
                read = ray.get(read_on_a.remote(handle.to_json(), list(range(KEYS))), timeout=120)
                out["reader_node"] = read["node"]
                out["read_ok"] = read["ok"]
                placement = Placement(handle.servers)
                keys_on_b = [
                    i for i in range(KEYS)
                    if placement.server_for(f"k{i}".encode(), 0).node_id == on_b["node_id"]
                ]
                out["keys_on_b"] = len(keys_on_b)
                os.kill(int(on_b["server_pid"]), signal.SIGKILL)
                failed = ray.get(read_on_a.remote(handle.to_json(), keys_on_b), timeout=120)
                out["after_kill"] = failed
    finally:
        ray.shutdown()
        ray_cluster.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
