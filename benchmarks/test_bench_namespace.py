"""pytest-benchmark suite of the namespace: listing 10,000 keys, and a job's register/deregister.

Run with ``python -m pytest benchmarks/test_bench_namespace.py --benchmark-only``. Listing runs
on every chosen peer that can list a prefix (pocketflow's enumerate, Redis SCAN MATCH, S3
ListObjectsV2); registration only on the pocketflow peers (it is the control plane's job API,
Ray actor calls, never on the path of a put or get). Every round's answer is checked untimed.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.peers import Peer
from benchmarks.rounds import fresh_key, record_figures, verified_rounds
from benchmarks.workloads import payload

LIST_KEYS = 10_000
LIST_OBJECT_BYTES = 100
LIST_PUT_BATCH_KEYS = 1000
"""Objects per ``put_many`` while filling the listed prefix (untimed)."""
LIST_ROUNDS = 20
LIST_PEERS = ("pocketflow-dram", "pocketflow-nvme", "redis", "s3")
REGISTER_ROUNDS = 50
POCKETFLOW_PEERS = ("pocketflow-dram", "pocketflow-nvme")


@pytest.mark.peers(*LIST_PEERS)
def test_list_10k_keys(benchmark: Any, peer: Peer) -> None:
    """Every key under a prefix of 10,000 objects of 100 B, sorted, in pages of 1000."""
    client = peer.client()
    data = payload(LIST_OBJECT_BYTES)
    prefix = fresh_key("list") + "/"
    keys = [f"{prefix}{i:05d}" for i in range(LIST_KEYS)]
    list_keys = client.list_keys  # type: ignore[attr-defined]

    def check(args: tuple[Any, ...], listed: list[str]) -> None:
        assert len(listed) == LIST_KEYS, f"listed {len(listed)} keys, stored {LIST_KEYS}"
        assert listed == keys, "the listing differs from the keys stored"

    try:
        for start in range(0, LIST_KEYS, LIST_PUT_BATCH_KEYS):
            client.put_many([(k, data) for k in keys[start : start + LIST_PUT_BATCH_KEYS]])
        benchmark.group = f"list {LIST_KEYS:,} keys"
        verified_rounds(
            benchmark, list_keys, prepare=lambda: (prefix,), check=check, rounds=LIST_ROUNDS
        )
    finally:
        client.delete_many(prefix, keys)
    record_figures(benchmark, objects_per_round=LIST_KEYS, bytes_per_round=0)


@pytest.mark.peers(*POCKETFLOW_PEERS)
def test_register_deregister_job(benchmark: Any, peer: Peer) -> None:
    """One job's round trip through the control plane: ``register_job`` (hints of the peer's
    tier), then ``deregister``. Checks that each job got servers and was removed again."""
    from pocketflow.job import Hints, register_job

    cluster = peer.cluster  # type: ignore[attr-defined]
    hints = Hints(latency_sensitive=peer.tier == "dram")  # type: ignore[attr-defined]
    job_ids: list[str] = []

    def round_trip() -> tuple[str, int, Any]:
        job = register_job("bench-register", hints, cluster=cluster)
        carrying = sum(1 for server in job.handle.servers if server.weight > 0)
        return job.job_id, carrying, job.deregister()

    def check(args: tuple[Any, ...], result: tuple[str, int, Any]) -> None:
        job_id, carrying, freed = result
        assert carrying > 0, f"job {job_id} got no server with a weight"
        assert isinstance(freed, dict), f"deregistering {job_id} returned {freed!r}"
        assert job_id not in job_ids, f"job id {job_id} handed out twice"
        job_ids.append(job_id)

    benchmark.group = "register + deregister job"
    verified_rounds(benchmark, round_trip, prepare=tuple, check=check, rounds=REGISTER_ROUNDS)
    still_there = {job["job_id"] for job in cluster.control.status()["jobs"]} & set(job_ids)
    assert not still_there, f"deregistered jobs still listed: {sorted(still_there)}"
    record_figures(benchmark, objects_per_round=1, bytes_per_round=0)
