"""A cache filling beside another job's reservation on a local cluster of its own (run by
tests/test_cache_growth.py in a process of its own: the test session's cluster has an NVMe
server, which would take the fills a DRAM server refuses, and one process runs one cluster).

``python tests/cache_refusals_run.py '<json>'`` prints one JSON line of what happened; the
arguments are those of :func:`run`."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

MiB = 1024 * 1024
SHAPE = {"dram_servers": 2, "nvme_servers": 0, "dram_capacity": "64MiB", "num_cpus": 1,
         "object_store_memory": "80MiB"}
"""Two DRAM servers and no NVMe (nothing to overflow to), as the benchmark's cluster."""
NEIGHBOUR_OBJECT_BYTES = MiB
NEIGHBOUR_OBJECTS = 40
"""The other job writes this many objects before the cache fills and as many after."""
REFUSALS_REPORTED_S = 10.0
"""How long the servers' heartbeats may take to report the refusals counted."""


def _body(key: str, size: int) -> bytes:
    return key.encode().ljust(size, b".")


def _refusals(cluster: Any, job_id: str) -> dict[str, int]:
    """The refusals of ``job_id``'s writes by limit, summed over the servers' own counts (as of
    their latest heartbeats)."""
    out: dict[str, int] = {}
    for server in cluster.control.status()["servers"]:
        job = server["jobs"].get(job_id) or {}
        for limit, count in (job.get("capacity_refusals") or {}).items():
            out[limit] = out.get(limit, 0) + int(count)
    return out


def _neighbour_writes(client: Any, start: int) -> dict[str, bytes]:
    values = {f"n/{i:03d}": bytes([i % 251]) * NEIGHBOUR_OBJECT_BYTES
              for i in range(start, start + NEIGHBOUR_OBJECTS)}
    for key, value in values.items():
        client.put("data", key, value)
    return values


def run(*, endpoint_url: str, bucket: str, keys: list[str], object_bytes: int,
        capacity_bytes: int, capacity_max_bytes: int | None, neighbour_reserved_bytes: int,
        short_reservation: bool, autoscale: bool, batch_keys: int) -> dict[str, Any]:
    """Start the cluster, register the other job (``neighbour_reserved_bytes``; it writes
    ``NEIGHBOUR_OBJECTS`` of 1 MiB), open a cache starting at ``capacity_bytes`` (its
    reservation leaving out the entries' records if ``short_reservation``), read ``keys``
    through it ``batch_keys`` at a time with a maintainer pass after each, then read them all
    again; the other job writes as much again and reads everything back."""
    import pocketflow
    import pocketflow.cache.cache as cache_module
    import pocketflow.cache.working_set as working_set_module
    from pocketflow.cache import open_cache
    from pocketflow.cache.source import S3Source
    from pocketflow.cluster import LocalCluster

    cache_module.CAPACITY_DEFAULT_BYTES = capacity_bytes
    if short_reservation:
        working_set_module.ENTRY_RECORDS_BYTES = 0
        working_set_module.BOOKKEEPING_BYTES = 0
    source = S3Source(endpoint_url=endpoint_url, unsigned=True, read_timeout_s=30.0)
    out: dict[str, Any] = {}
    with LocalCluster(**SHAPE, autoscale=autoscale, servers_max=3) as cluster:
        neighbour = pocketflow.register_job(
            "neighbour", {"data_size_bytes": neighbour_reserved_bytes}, cluster=cluster)
        with neighbour.connect() as client:
            client.create_bucket("data")
            written = _neighbour_writes(client, 0)
        with open_cache("refusals", source, idle="1s", lease_ms=600_000,
                        capacity_max=capacity_max_bytes, cluster=cluster) as cache:
            out["capacity_at_open"] = cache.capacity_bytes
            out["reserved_at_open"] = cache.status()["reserved_bytes"]
            correct = True
            for start in range(0, len(keys), batch_keys):
                chunk = keys[start:start + batch_keys]
                data = cache.client.get_many(bucket, chunk)
                correct &= data == [_body(k, object_bytes) for k in chunk]
                cache.client.flush()
                cache.maintain_now()
            out["first_pass_correct"] = correct
            out["status"] = {k: v for k, v in cache.status().items()
                             if isinstance(v, (int, float, str)) or v is None}
            out["stats"] = cache.client.stats.to_dict()
            hits = cache.client.stats.hits
            data = cache.client.get_many(bucket, keys)
            out["second_pass_correct"] = data == [_body(k, object_bytes) for k in keys]
            out["second_pass_hits"] = cache.client.stats.hits - hits
            out["capacity_after"] = cache.capacity_bytes
            refused = out["stats"]["refused"]
            deadline = time.monotonic() + REFUSALS_REPORTED_S
            while (sum(_refusals(cluster, cache.job_id).values()) < refused
                   and time.monotonic() < deadline):
                time.sleep(0.25)
            out["server_refusals"] = _refusals(cluster, cache.job_id)
            out["servers"] = len(cluster.control.status()["servers"])
        with neighbour.connect() as client:
            written.update(_neighbour_writes(client, NEIGHBOUR_OBJECTS))
            out["neighbour_intact"] = all(client.get("data", key) == value
                                          for key, value in written.items())
        neighbour.deregister()
    return out


if __name__ == "__main__":
    print(json.dumps(run(**json.loads(sys.argv[1]))))
