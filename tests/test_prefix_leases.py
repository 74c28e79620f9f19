"""Prefix leases on a real local cluster: a lapsed prefix is freed on every server within two
lease periods, a renewed one never, and renewing a prefix renews its ancestors and descendants;
the closure rule alone, and bad declarations."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from pocketflow.client import Client
from pocketflow.cluster import LocalCluster
from pocketflow.errors import ConfigError, InvalidRequest
from pocketflow.job import Job
from pocketflow.prefixes import PrefixDag

LEASE_MS = 1000  # Jiffy's
BUCKETS = ("a", "b")


def test_the_closure_covers_ancestors_and_descendants_only() -> None:
    dag = PrefixDag()
    for prefix, parents in [("map", ()), ("map/0", ()), ("map/1", ()), ("in", ()),
                            ("reduce", ()), ("reduce/0", ("map/0", "map/1")),
                            ("reduce/1", ("map/1",)), ("out/0", ("reduce/0",)), ("other", ()),
                            # Names that sort next to "map/": none of them is below "map".
                            ("map-1", ()), ("map.x", ()), ("map0", ()), ("mapx/1", ())]:
        dag.declare(prefix, parents)
    # reduce/0: parents map/0 and map/1, their path ancestor map, its own path ancestor
    # reduce, its child out/0; not its sibling reduce/1, nor in, nor other.
    assert dag.closure(["reduce/0"]) == {"reduce/0", "map/0", "map/1", "map", "reduce", "out/0"}
    # map: everything below it, transitively through declared children.
    assert dag.closure(["map"]) == {"map", "map/0", "map/1", "reduce/0", "reduce/1", "out/0"}
    assert dag.copy().closure(["map"]) == dag.closure(["map"])
    with pytest.raises(InvalidRequest):
        dag.declare("x", ["not-declared"])
    with pytest.raises(InvalidRequest):
        dag.declare("map", ["out/0"])  # a cycle
    for bad in ("", "/a", "a/", "a//b"):
        with pytest.raises(InvalidRequest):
            dag.declare(bad)
    with pytest.raises(InvalidRequest):
        dag.closure(["never"])


def _present(pf, key: str) -> bool:
    return all(pf.exists(bucket, key) for bucket in BUCKETS)


def _gone(pf, key: str) -> bool:
    return not any(pf.exists(bucket, key) for bucket in BUCKETS)


def _put_everywhere(pf, key: str, data: bytes) -> None:
    for bucket in BUCKETS:
        pf.put(bucket, key, data)


def _wait_until(condition: Callable[[], bool], within_s: float, failure: str) -> None:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within_s, failure
        time.sleep(0.05)


@contextmanager
def _job_with_buckets(cluster: LocalCluster, name: str, *,
                      lease_ms: int) -> Iterator[tuple[Job, Client]]:
    """A job with prefix leases of ``lease_ms``, connected, with every bucket of BUCKETS."""
    with cluster.register_job(name, {"data_size_bytes": "16MiB"},
                              prefix_lease_ms=lease_ms) as job, job.connect() as pf:
        for bucket in BUCKETS:
            pf.create_bucket(bucket)
        yield job, pf


def test_ending_a_prefix_forgets_it_and_what_is_below_it_in_the_path() -> None:
    dag = PrefixDag()
    for prefix, parents in [("map", ()), ("map/0", ()), ("map/0/part", ()), ("map0", ()),
                            ("reduce/0", ("map/0",)), ("reduce/1", ("map/0", "map0"))]:
        dag.declare(prefix, parents)
    assert dag.remove(["map/0", "never"]) == ["map/0", "map/0/part"]
    assert "map/0" not in dag and "map/0/part" not in dag and "map0" in dag
    # Its children keep their other parents, and a renewal no longer reaches it.
    assert dag.closure(["reduce/1"]) == {"reduce/1", "map0"}
    assert dag.closure(["reduce/0"]) == {"reduce/0"}
    assert dag.closure(["map"]) == {"map"}
    dag.declare("map/0", ["map0"])  # declared again, it is a new prefix
    assert dag.closure(["map/0"]) == {"map/0", "map", "map0"}  # reduce/1 forgot it


def test_a_lapsed_prefix_is_freed_within_two_periods_and_a_renewed_one_never(
    local_cluster: LocalCluster,
) -> None:
    with _job_with_buckets(local_cluster, "prefix-leases", lease_ms=LEASE_MS) as (job, pf):
        job.declare("map")
        job.declare("map/0")
        job.declare("reduce/0", parents=["map/0"])
        job.declare("out/0", parents=["reduce/0"])
        job.declare("other")
        keys = {p: f"{p}/data" for p in ("map", "map/0", "reduce/0", "out/0", "other")}
        for key in keys.values():
            _put_everywhere(pf, key, b"x" * 1000)
        pf.queue("a", "other/q").enqueue(b"item")
        with pf.subscribe("a", "", ops=("lease_expired",)) as listener:
            with job.keep(["reduce/0"]) as keeper:
                started = time.monotonic()
                # `other` is not covered: it lapses and is freed on every server.
                _wait_until(lambda: _gone(pf, keys["other"]), 2 * LEASE_MS / 1000,
                            "not freed in 2 leases")
                assert pf.queue("a", "other/q").dequeue() is None
                # The renewed prefix, its ancestors and its descendants outlive 3 leases.
                deadline = started + 3 * LEASE_MS / 1000
                while time.monotonic() < deadline:
                    for prefix in ("map", "map/0", "reduce/0", "out/0"):
                        assert _present(pf, keys[prefix]), f"{prefix} freed while renewed"
                    time.sleep(0.1)
                assert keeper.renewals >= 6
            _wait_until(lambda: all(_gone(pf, keys[p]) for p in ("map", "map/0", "reduce/0",
                                                                 "out/0")),
                        2 * LEASE_MS / 1000, "not freed in 2 leases")
            expired = set()
            while len(expired) < 5:
                event = listener.get(timeout_s=2)
                assert event is not None, f"only {expired} reported"
                expired.add(event.key)
            assert expired == set(keys)


def test_renewing_a_parent_keeps_its_descendants(local_cluster: LocalCluster) -> None:
    with _job_with_buckets(local_cluster, "prefix-parent", lease_ms=500) as (job, pf):
        job.declare("map")
        job.declare("map/3")
        job.declare("reduce/1", parents=["map/3"])
        for key in ("map/3/part", "reduce/1/part"):
            _put_everywhere(pf, key, b"y")
        started = time.monotonic()
        while time.monotonic() - started < 2.0:  # four leases, renewing only the root
            assert job.renew(["map"]) == 3
            assert _present(pf, "map/3/part") and _present(pf, "reduce/1/part")
            time.sleep(0.15)
        with pytest.raises(InvalidRequest):
            job.renew(["never-declared"])
        with pytest.raises(ConfigError):
            local_cluster.register_job("bad-lease", prefix_lease_ms=10)


def test_a_straggler_writing_under_an_ended_or_lapsed_prefix_is_freed_a_lease_later(
    local_cluster: LocalCluster,
) -> None:
    lease_s = LEASE_MS / 1000
    with _job_with_buckets(local_cluster, "prefix-straggler", lease_ms=LEASE_MS) as (job, pf):
        job.declare("ended")
        job.declare("lapsed")
        with job.keep(["ended"]):
            job.end(["ended"])
            # A task still running writes its output after its readers were done.
            _put_everywhere(pf, "ended/late", b"s" * 100)
            _wait_until(lambda: _gone(pf, "ended/late"), 2 * lease_s,
                        "the straggler's write stayed")
            # `lapsed` was never renewed: it lapsed by now; a straggler writes under it.
            _put_everywhere(pf, "lapsed/late", b"s")
            _wait_until(lambda: _gone(pf, "lapsed/late"), 2 * lease_s,
                        "the straggler's write stayed")
        # After the lingering lease, the prefix is the job's again: a write there stays.
        time.sleep(1.5 * lease_s)
        _put_everywhere(pf, "ended/much-later", b"k")
        time.sleep(1.5 * lease_s)
        assert _present(pf, "ended/much-later")


def test_a_keeper_left_running_stops_when_its_job_ends(
    local_cluster: LocalCluster, caplog: pytest.LogCaptureFixture,
) -> None:
    # A driver that forgot to close its keeper (or failed before it could) ends its job: the
    # keeper's client is closed with it, and the keeper stops instead of failing forever.
    with local_cluster.register_job("prefix-keeper-left", {"data_size_bytes": "1MiB"},
                                    prefix_lease_ms=LEASE_MS) as job:
        job.declare("p")
        keeper = job.keep(["p"])
        time.sleep(LEASE_MS / 1000)
        assert keeper.running and keeper.renewals >= 2
    _wait_until(lambda: not keeper.running, 2 * LEASE_MS / 1000, "the keeper still runs")
    assert not [r for r in caplog.records if "renewing prefixes failed" in r.getMessage()]
