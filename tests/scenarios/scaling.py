"""Scenario run by tests/test_scaling.py in its own process (its own Ray): an elastic cluster
(with TLS) launches a server for a job that does not fit, drains launched servers once idle, and
adds a server when its DRAM tier fills up; a long-running server the controller launches gets
the cluster's PERSIST TTL, and every launched server a certificate the controller signs. Prints
one JSON line of observations."""

from __future__ import annotations

import json
import sys

from polling import wait

from pocketflow.auth import admin_token
from pocketflow.cluster import LocalCluster
from pocketflow.control import CONTROLLER_ACTOR_NAME, NAMESPACE
from pocketflow.errors import CapacityExhausted
from pocketflow.transport import AdminClient

WAIT_S = 40.0


def server_ids(cluster: LocalCluster) -> set[str]:
    return {s["node_id"] for s in cluster.status()["servers"]}


def launched_persist_ttl_ms(cluster: LocalCluster, out: dict[str, object]) -> dict[str, int]:
    """``persist_ttl_ms`` of a long-running and of an ephemeral server the controller launches;
    whether each serves TLS goes to ``out["launched_tls"]`` (its stats are read over TLS,
    checked against the cluster's CA)."""
    import ray

    controller = ray.get_actor(CONTROLLER_ACTOR_NAME, namespace=NAMESPACE)
    token = admin_token(cluster.secret, ttl_s=600)
    ttl: dict[str, int] = {}
    tls: list[bool] = []
    for long_running in (True, False):
        info = ray.get(controller.launch_server.remote("dram", long_running=long_running),
                       timeout=60)
        with AdminClient(info.address, token, tls_ca=cluster.tls_ca) as admin:
            stats = admin.stats()
        ttl["long_running" if stats["long_running"] else "ephemeral"] = stats["persist_ttl_ms"]
        tls.append(info.tls)
    out["launched_tls"] = tls
    return ttl


def main() -> None:
    out: dict[str, object] = {}
    with LocalCluster(
        dram_servers=2,
        nvme_servers=0,
        dram_capacity="8MiB",
        nvme_capacity="32MiB",
        autoscale=True,
        servers_max=4,
        persist_ttl="90m",
        sizing_interval="300ms",
        sizing_cooldown="1s",
        num_cpus=1,
        object_store_memory="80MiB",
        tmp_dir="/var/tmp",
        tls=True,
    ) as cluster:
        initial = server_ids(cluster)
        out["initial"] = sorted(initial)
        with cluster.register_job("big", {"data_size_bytes": "20MiB"}) as job:
            out["big_servers"] = sorted(s.node_id for s in job.handle.servers if s.weight > 0)
            out["after_register"] = sorted(server_ids(cluster))
            with job.connect() as pf:
                pf.create_bucket("b")
                pf.put("b", "k", b"x" * 1000)
                out["big_roundtrip"] = pf.get("b", "k") == b"x" * 1000
        out["scaled_down"] = wait(lambda: server_ids(cluster) == initial, WAIT_S)
        out["after_idle"] = sorted(server_ids(cluster))

        # 40 MiB needs three more 8 MiB servers; two more reach servers_max: nothing is
        # launched for a job that could not fit even then.
        removals_before = sum(
            a["action"] == "RemoveServers" for a in cluster.status()["sizing_actions"]
        )
        try:
            cluster.register_job("too-big", {"data_size_bytes": "40MiB"})
            out["too_big"] = "registered"
        except CapacityExhausted as exc:
            out["too_big"] = f"CapacityExhausted: {exc}"
        out["after_too_big"] = sorted(server_ids(cluster))
        out["removals_since_too_big"] = sum(
            a["action"] == "RemoveServers" for a in cluster.status()["sizing_actions"]
        ) - removals_before

        with cluster.register_job("fill") as job, job.connect() as pf:
            pf.create_bucket("b")
            stored = 0
            for i in range(150):
                try:
                    pf.put("b", f"k{i}", b"f" * 100_000)
                    stored += 100_000
                except CapacityExhausted:
                    pass
            out["filled_bytes"] = stored
            out["scaled_up"] = wait(lambda: len(server_ids(cluster)) > len(initial), WAIT_S)
            out["after_fill"] = sorted(server_ids(cluster))
            # The sizing loop records its action only after launch_server has added the
            # server, and status() reads the servers without the lock: wait (bounded) until
            # the action that launched a new server is recorded too.
            added = set(out["after_fill"]) - initial
            if added:
                wait(lambda: any(a["action"] == "AddServer" and a.get("node_id") in added
                                 for a in cluster.status()["sizing_actions"]), WAIT_S)
            out["actions"] = [
                (a["action"], a.get("node_id")) for a in cluster.status()["sizing_actions"]
            ]
        out["launched_persist_ttl_ms"] = launched_persist_ttl_ms(cluster, out)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
