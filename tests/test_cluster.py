"""Tests of the embedded local cluster: actors, servers, status, and that nothing outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from fixtures_cluster import wait_for

from pocketflow.cluster import LocalCluster, _unwrap
from pocketflow.control import CONTROLLER_ACTOR_NAME, NAMESPACE, STORAGE_NODE_ACTOR_PREFIX
from pocketflow.control.plane import connect_control_plane
from pocketflow.control.storage_node import StorageNode
from pocketflow.errors import ClusterError, ConfigError, ServerStartError
from pocketflow.processes import ProcessRef, descendants

SCANNED_FILE_MAX_BYTES = 16 * 1024 * 1024
"""Largest file of the cluster's directory searched for the secret (the NVMe data files are
larger, and hold only data)."""
UP_READY_TIMEOUT_S = 120.0
UP_EXIT_TIMEOUT_S = 90.0
PROCESS_GONE_TIMEOUT_S = 30.0


def test_status_reports_servers_tiers_and_capacity(local_cluster: LocalCluster) -> None:
    status = local_cluster.status()
    servers = {s["node_id"]: s for s in status["servers"]}
    assert set(servers) == {"dram-0", "dram-1", "nvme-0"}
    assert all(s["reachable"] and not s["draining"] for s in servers.values())
    # Every local server is long-running: PERSIST data goes on to NVMe when DRAM is full.
    assert servers["dram-0"]["long_running"] and servers["nvme-0"]["long_running"]
    assert status["tiers"]["dram"] == {
        "servers": 2,
        "capacity_bytes": 2 * 128 * 1024 * 1024,
        "used_bytes": servers["dram-0"]["used_bytes"] + servers["dram-1"]["used_bytes"],
    }
    assert status["tiers"]["nvme"]["capacity_bytes"] == 256 * 1024 * 1024


def test_servers_listen_on_loopback_and_run(local_cluster: LocalCluster) -> None:
    for info in local_cluster.servers:
        assert info.address.startswith("127.0.0.1:")
        assert info.server_process().alive()
    assert set(local_cluster.process_ids()["servers"]) == {
        s.server_pid for s in local_cluster.servers
    }


def test_everything_listens_on_loopback_only(local_cluster: LocalCluster) -> None:
    psutil = pytest.importorskip("psutil")
    assert local_cluster.ray_address.startswith("127.0.0.1:")
    pids = local_cluster.process_ids()
    assert pids["servers"] and (pids["ray"] or not local_cluster.owns_ray)
    listening = []
    for pid in pids["servers"] + pids["ray"]:
        try:
            connections = psutil.Process(pid).net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        listening += [c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN]
    assert listening
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for ip in listening), listening


_HOSTILE_TASK = textwrap.dedent("""
    # A task of another job (as a Lithops function or any process of the cluster's user runs)
    # that looks for key material where a task finds it by looking: the cluster's storage
    # servers' command lines (/proc/<pid>/cmdline; given by pid, since other clusters may run on
    # this machine) and the cluster's files. With a secret it would mint an admin token and
    # delete the victim job's data.
    import json, os, sys
    from pathlib import Path
    from pocketflow.auth import admin_token
    from pocketflow.transport import AdminClient

    victim, address, work_dir, pids = sys.argv[1:5]
    found = []
    for pid in pids.split(","):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"pocketflow-server"):
            for flag in (b"--secret-file", b"--tls-key"):
                if flag in argv:
                    found.append(argv[argv.index(flag) + 1].decode())
    for path in Path(work_dir).rglob("*"):
        if path.is_file() and ("secret" in path.name or path.suffix == ".key"):
            found.append(str(path))
    deleted = None
    for path in found:
        try:
            with AdminClient(address, admin_token(Path(path).read_bytes(), ttl_s=60)) as admin:
                deleted = admin.delete_job(victim)
        except Exception:
            pass
    print(json.dumps({"found": found, "deleted": deleted}))
""")


def test_a_task_finds_no_key_material_by_looking(local_cluster: LocalCluster) -> None:
    """Issue 29 item 5: the cluster secret is in no file of the cluster and on no server's
    command line (servers get it over stdin), so a task that tries the old path (the secret
    file named by a server's --secret-file, an admin token minted from it, delete_job of
    another job) finds nothing and deletes nothing."""
    with local_cluster.register_job("victim") as victim:
        with victim.connect() as pf:
            pf.create_bucket("b")
            pf.put("b", "k", b"precious")
        address = victim.handle.servers[0].address
        server_pids = local_cluster.process_ids()["servers"]
        assert server_pids
        result = subprocess.run(
            [sys.executable, "-c", _HOSTILE_TASK, victim.job_id, address,
             str(local_cluster.work_dir), ",".join(str(pid) for pid in server_pids)],
            capture_output=True, text=True, timeout=60, check=True,
        )
        outcome = json.loads(result.stdout)
        assert outcome == {"found": [], "deleted": None}, outcome
        with victim.connect() as pf:
            assert pf.get("b", "k") == b"precious"
    secret = local_cluster.secret
    for pid in local_cluster.process_ids()["servers"]:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            text = cmdline.read()
        assert b"--keys-from-stdin" in text and secret not in text
    for path in local_cluster.work_dir.rglob("*"):
        if path.is_file() and path.stat().st_size <= SCANNED_FILE_MAX_BYTES:
            assert secret not in path.read_bytes(), path


def test_controller_is_found_by_name(local_cluster: LocalCluster) -> None:
    import ray

    assert ray.get_actor(CONTROLLER_ACTOR_NAME, namespace=NAMESPACE) is not None
    status = connect_control_plane().status()
    assert {s["node_id"] for s in status["servers"]} == {"dram-0", "dram-1", "nvme-0"}


def test_storage_node_actor_reports_its_server(local_cluster: LocalCluster) -> None:
    import ray

    node = ray.get_actor(STORAGE_NODE_ACTOR_PREFIX + "nvme-0", namespace=NAMESPACE)
    assert ray.get(node.alive.remote())
    stats = ray.get(node.stats.remote())
    assert stats["node_id"] == "nvme-0" and stats["tier"] == "nvme"
    assert stats["capacity_bytes"] == 256 * 1024 * 1024


def test_server_exits_when_its_storage_node_actor_dies(local_cluster: LocalCluster) -> None:
    import ray

    actor = ray.remote(StorageNode).options(namespace=NAMESPACE, num_cpus=0).remote(
        node_id="orphan-0",
        tier="dram",
        capacity_bytes=16 * 1024 * 1024,
        secret=local_cluster.secret,
    )
    info = ray.get(actor.start.remote(), timeout=60)
    server = info.server_process()
    assert server.alive()
    ray.kill(actor, no_restart=True)
    assert wait_for(lambda: not server.alive(), timeout_s=PROCESS_GONE_TIMEOUT_S)


def test_bad_cluster_shapes_are_refused() -> None:
    with pytest.raises(ConfigError):
        LocalCluster(dram_servers=0, nvme_servers=0)
    with pytest.raises(ConfigError):
        LocalCluster(dram_capacity="lots")
    with pytest.raises(ConfigError):
        LocalCluster(block_size="64MiB")


def test_no_process_outlives_an_interrupted_up(local_cluster: LocalCluster) -> None:
    """``pocketflow up --local`` in another process, then SIGINT: all its processes are gone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    up = subprocess.Popen(
        [sys.executable, "-m", "pocketflow", "up", "--local",
         "--dram-capacity", "32MiB", "--nvme-capacity", "32MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        lines = []
        deadline = time.monotonic() + UP_READY_TIMEOUT_S
        assert up.stdout is not None
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Press Ctrl-C to stop" in line:
                break
        assert lines and "Press Ctrl-C to stop" in lines[-1], "".join(lines) + up.stderr.read()
        server_pids = {
            int(line.split()[-1]) for line in lines if line.startswith(("dram-", "nvme-"))
        }
        assert len(server_pids) == 3
        started = [ref for ref in (ProcessRef.of(pid) for pid in descendants(up.pid)) if ref]
        assert server_pids <= {ref.pid for ref in started}
        assert any(
            "raylet" in open(f"/proc/{ref.pid}/cmdline").read()
            for ref in started if ref.alive()
        )

        up.send_signal(signal.SIGINT)
        out, err = up.communicate(timeout=UP_EXIT_TIMEOUT_S)
        assert up.returncode == 0, err
        assert "stopped" in out
        assert wait_for(
            lambda: not any(ref.alive() for ref in started), timeout_s=PROCESS_GONE_TIMEOUT_S
        ), [ref.pid for ref in started if ref.alive()]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_unwrapped_ray_errors_keep_their_cause() -> None:
    """A start-up failure raised as ClusterError still carries the original error and traceback."""
    try:
        raise RuntimeError("actor died")
    except RuntimeError as exc:
        error = _unwrap(exc, "starting storage node dram-0")
    assert isinstance(error, ClusterError)
    assert "starting storage node dram-0" in str(error)
    assert error.__cause__ is not None and error.__cause__.__traceback__ is not None
    own = ServerStartError("binary missing")
    assert _unwrap(own, "starting") is own


def test_calls_that_may_launch_servers_are_bounded_by_the_registration_timeout(
    local_cluster: LocalCluster,
) -> None:
    """A registration may wait for servers up to the cluster's ``register_timeout`` (120 s in
    the trace, waiting for the autoscaler); the driver's call to it was cut at 60 s whatever that
    timeout. Its bound is the registration timeout plus a margin now, known to the cluster's
    own plane and asked of the controller by a plane that joins the cluster."""
    from pocketflow.control.plane import CALL_TIMEOUT_S, LAUNCH_CALL_MARGIN_S

    joined = connect_control_plane()
    expected = max(CALL_TIMEOUT_S, 60.0 + LAUNCH_CALL_MARGIN_S)  # the fixture's default 60 s
    assert joined.launch_call_timeout_s() == expected
    assert local_cluster.control.launch_call_timeout_s() == expected
    handle = joined.register("bounded", {"data_size_bytes": "1MiB"})
    joined.deregister(handle.job_id)


def test_stopping_a_cluster_frees_the_cache_read_pool(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopping ``LocalCluster`` removes the free slots of the host's cache read pool (its
    tasks' processes are gone) and leaves one a live reader holds."""
    from pocketflow.cache import client as cache_client

    pool = tmp_path / "pool"
    monkeypatch.setenv(cache_client.ARENA_POOL_ENV, str(pool))
    held = cache_client._arena(4 << 20)
    free = cache_client._arena(4 << 20)
    assert isinstance(held, cache_client._Slot) and isinstance(free, cache_client._Slot)
    del free
    LocalCluster().stop()  # never started: stopping it still frees the pool
    assert [p.name for p in pool.iterdir()] == ["slot-0"]  # the held one
    del held
