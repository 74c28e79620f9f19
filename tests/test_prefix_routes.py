"""Prefix routes, with the ``PrefixRoutes`` role built without Ray over real servers: a granted
prefix is routed to the DRAM server holding its grant, one that does not fit spills to NVMe,
each change in a new epoch the servers and the log learn."""

from __future__ import annotations

import threading
from pathlib import Path

from control_roles import register, roles

MIB = 1024 * 1024
LEASE_MS = 10_000


def test_granted_prefixes_route_to_dram_and_the_rest_spill_to_nvme(
    cluster_secret_file: tuple[bytes, Path], tmp_path: Path
) -> None:
    _, secret_file = cluster_secret_file
    with roles(secret_file) as built:
        built.start("pr-0", capacity_bytes=8 * MIB)
        built.start("pr-nvme", tier="nvme", capacity_bytes=64 * MIB, data_dir=tmp_path)
        handle = register(built, "routed", {"data_size_bytes": MIB})
        changed = threading.Condition(built.lock)
        with changed:
            small = built.routes.declare(handle.job_id, [("s/a", MIB)], LEASE_MS, 0.0,
                                         wait=changed.wait)
            big = built.routes.declare(handle.job_id, [("s/b", 64 * MIB)], LEASE_MS, 0.0,
                                       wait=changed.wait)
        assert small["dram"] == ["s/a"] and big["nvme"] == ["s/b"]
        now = built.jobs.record(handle.job_id).handle
        assert now.epoch == handle.epoch + 2
        pools = now.routes.pool_map()
        routes = dict(now.routes.routes)
        assert pools[routes["s/a"]] == ["pr-0"] and pools[routes["s/b"]] == ["pr-nvme"]
        logged = built.metadata.get_job(handle.job_id)
        assert logged["epoch"] == now.epoch and "s/a" in logged["grants"]
        assert built.routes.renew(handle.job_id, ["s/a", "s/b"]) == 1
        with built.lock:
            assert built.routes.end(handle.job_id, ["s/a"]) == 1
        assert built.routes.summary()["grants"] == 0
