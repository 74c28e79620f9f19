"""Tests of the nodes the controller launches (detached ``StorageNode`` actors): one that no live
controller knows stops its server and ends itself, so it never holds a Ray node for good."""

from __future__ import annotations

import uuid

import pytest
from fixtures_cluster import wait_for

from pocketflow.cluster import LocalCluster
from pocketflow.control import NAMESPACE, STORAGE_NODE_ACTOR_PREFIX
from pocketflow.control.storage_node import (
    ORPHAN_CALL_TIMEOUT_S,
    ORPHAN_CHECK_INTERVAL_S,
    ORPHAN_CHECKS_MAX,
    StorageNode,
)

MIB = 1024 * 1024
ORPHAN_GONE_TIMEOUT_S = (ORPHAN_CHECKS_MAX + 2) * (ORPHAN_CHECK_INTERVAL_S
                                                   + ORPHAN_CALL_TIMEOUT_S) + 15.0
"""Bound on a launched node noticing that no controller knows it, with slack for a loaded
machine."""


def test_a_launched_node_no_controller_knows_stops_its_server_and_itself(
    local_cluster: LocalCluster,
) -> None:
    """As a launch that the crashed controller started and its restarted instance never saw
    finish: the controller runs, but does not know the server."""
    import ray
    from ray.exceptions import RayActorError

    node_id = f"orphan-{uuid.uuid4().hex[:6]}"
    node = ray.remote(StorageNode).options(
        name=STORAGE_NODE_ACTOR_PREFIX + node_id, namespace=NAMESPACE, num_cpus=0,
        lifetime="detached",
    ).remote(
        node_id=node_id, tier="dram", capacity_bytes=8 * MIB,
        secret=local_cluster.secret, launched=True,
    )
    try:
        info = ray.get(node.start.remote(), timeout=60)
        assert info.launched
        server = info.server_process()
        assert server.alive()
        assert node_id not in {s["node_id"] for s in local_cluster.status()["servers"]}
        assert wait_for(lambda: not server.alive(), timeout_s=ORPHAN_GONE_TIMEOUT_S), (
            "the orphaned server still runs"
        )

        def actor_gone() -> bool:
            try:
                ray.get(node.alive.remote(), timeout=5)
            except RayActorError:
                return True
            except Exception:  # noqa: BLE001 - slow to answer: not gone yet
                return False
            return False

        assert wait_for(actor_gone, timeout_s=30.0), "the orphaned node still runs"
        with pytest.raises(ValueError):
            ray.get_actor(STORAGE_NODE_ACTOR_PREFIX + node_id, namespace=NAMESPACE)
    finally:
        try:
            ray.kill(node, no_restart=True)
        except Exception:  # noqa: BLE001 - already ended
            pass


def test_several_servers_are_launched_at_once_and_one_that_cannot_be_fails_alone(
    local_cluster: LocalCluster,
) -> None:
    """A registration short of several servers starts them together (each waits for its own
    node); a request the cluster cannot serve is that request's error, not the others'."""
    import time

    from pocketflow.control.launcher import Launcher, LaunchRequest, LaunchSpec
    from pocketflow.errors import ClusterError

    suffix = uuid.uuid4().hex[:6]
    launcher = Launcher(LaunchSpec(
        data_dir=str(local_cluster.work_dir), capacity_bytes_by_tier={"dram": 8 * MIB},
    ), secret=local_cluster.secret)
    requests = [LaunchRequest(f"many-{i}-{suffix}", "dram") for i in range(2)]
    requests.append(LaunchRequest(f"many-nvme-{suffix}", "nvme"))
    outcomes = launcher.launch_many(requests, deadline_s=time.monotonic() + 60.0)
    try:
        assert isinstance(outcomes[2], ClusterError)
        infos = [o[0] for o in outcomes[:2] if isinstance(o, tuple)]
        assert [i.node_id for i in infos] == [r.node_id for r in requests[:2]], outcomes
        assert all(i.launched and i.server_process().alive() for i in infos)
    finally:
        import ray

        for outcome in outcomes:
            if isinstance(outcome, tuple):
                ray.get(outcome[1].stop.remote(), timeout=30)
                ray.kill(outcome[1], no_restart=True)


def test_a_launched_server_gets_a_certificate_the_controllers_ca_signed(
    local_cluster: LocalCluster,
) -> None:
    """Issue 29 item 5: with a CA (held in memory by the controller) the launcher signs the
    node's certificate request and the node hands key and certificate to its server over stdin:
    the server speaks TLS, a client trusting that CA is served, and its command line names no
    key."""
    import time

    import ray

    from pocketflow.auth import admin_token
    from pocketflow.control.launcher import Launcher, LaunchSpec
    from pocketflow.tls import new_cluster_ca
    from pocketflow.transport import AdminClient

    ca = new_cluster_ca()
    launcher = Launcher(LaunchSpec(
        data_dir=str(local_cluster.work_dir), capacity_bytes_by_tier={"dram": 8 * MIB},
    ), secret=local_cluster.secret, ca=ca)
    node_id = f"signed-{uuid.uuid4().hex[:6]}"
    info, node = launcher.launch(node_id=node_id, tier="dram", long_running=False,
                                 deadline_s=time.monotonic() + 60.0)
    try:
        assert info.tls
        with open(f"/proc/{info.server_pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
        assert b"--keys-from-stdin" in argv
        assert not {b"--secret-file", b"--tls-cert", b"--tls-key"} & set(argv)
        with AdminClient(info.address, admin_token(local_cluster.secret, ttl_s=60),
                         tls_ca=ca.cert_pem) as admin:
            assert admin.stats()["node_id"] == node_id
        assert info.metrics_url.startswith("https://")
    finally:
        ray.get(node.stop.remote(), timeout=30)
        ray.kill(node, no_restart=True)
