"""Write-once and exactly-once DELETE per key, not per server record: across a grow (block 0 of a
key moves to another server) and across PERSIST and ephemeral placement (different servers for
the same key), exactly one of the puts of a key wins and two DELETE readers never both get it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from fixtures_servers import CLIENT_OPTIONS, ServerSet, records_of, split_keys
from test_metrics import scrape_all, summed

from pocketflow.client import connect
from pocketflow.cluster import LocalCluster
from pocketflow.errors import DataUnavailable, ObjectExists, ObjectNotFound
from pocketflow.handle import EarlierMap, JobHandle, ServerInfo
from pocketflow.placement import Placement

KEYS = 60


def test_a_key_stays_written_once_across_a_grow(local_cluster: LocalCluster) -> None:
    with local_cluster.register_job("write-once-grow", {"data_size_bytes": "8MiB"}) as job:
        with job.connect() as pf:
            pf.create_bucket("b")
            for i in range(KEYS):
                pf.put("b", f"k{i}", f"first-{i}".encode())
            before = pf._view.placement
            local_cluster.control.grow_job(job.job_id, {"data_size_bytes": "300MiB"})
            pf.get("b", "k0")  # adopts the new map
            after = pf._view.placement
            moved = [i for i in range(KEYS)
                     if before.server_for(f"k{i}".encode()).node_id
                     != after.server_for(f"k{i}".encode()).node_id]
            assert moved, "the grow moved no key's block 0; the test needs some that moved"
            for i in range(KEYS):
                try:
                    pf.put("b", f"k{i}", b"second")
                except ObjectExists:
                    pass
                else:
                    raise AssertionError(f"k{i} (moved: {i in moved}) was written twice")
                assert pf.get("b", f"k{i}") == f"first-{i}".encode()
                assert len(records_of(pf, "b", f"k{i}")) == 1

            # Two DELETE readers of each moved key: exactly one gets it.
            for i in moved:
                got = []
                for _ in range(2):
                    try:
                        got.append(pf.get("b", f"k{i}", delete=True))
                    except (ObjectNotFound, DataUnavailable):
                        pass
                assert got == [f"first-{i}".encode()]


# A job larger than the DRAM servers, for the grow below.
SPLIT_HINTS = {"data_size_bytes": "300MiB"}
SPLIT_SERVER_BYTES = 32 * 1024 * 1024


def _split_job(server_factory: Callable[..., tuple[ServerSet, ServerInfo]]) -> JobHandle:
    """A job on two servers of which one is long-running, so that PERSIST objects (long-running
    servers only) and ephemeral ones are placed differently. Its own servers: every server of
    the local cluster is long-running (PERSIST data goes on to NVMe)."""
    servers, _ = server_factory("split-long", "dram", SPLIT_SERVER_BYTES, long_running=True,
                                weight=0.5)
    server_factory("split-short", "dram", SPLIT_SERVER_BYTES, weight=0.5)
    return servers.handle()


def test_persist_and_ephemeral_puts_of_one_key_are_one_key(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    handle = _split_job(server_factory)
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        keys = split_keys(pf._view.handle, 20, "split")
        for n, key in enumerate(keys):
            first_persist = n % 2 == 0
            pf.put("b", key, b"first", persist=first_persist)
            try:
                pf.put("b", key, b"second", persist=not first_persist)
            except ObjectExists:
                pass
            else:
                raise AssertionError(f"{key} written twice (persist first: {first_persist})")
            assert pf.get("b", key) == b"first"
            assert len(records_of(pf, "b", key)) == 1
        # Large objects too: the loser leaves none of its blocks behind.
        big = bytes(3 * 1024 * 1024)
        pf.put("b", keys[0] + "-big", big, persist=True)
        try:
            pf.put("b", keys[0] + "-big", big)
        except ObjectExists:
            pass
        else:
            raise AssertionError("a large object was written twice")
        assert pf.get("b", keys[0] + "-big") == big


def test_concurrent_writers_with_mixed_flags_have_exactly_one_winner(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    handle = _split_job(server_factory)
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        keys = split_keys(pf._view.handle, 25, "split")
        wins: dict[str, list[int]] = {key: [] for key in keys}
        lock = threading.Lock()

        def writer(n: int) -> None:
            with connect(handle, **CLIENT_OPTIONS) as own:
                for key in keys:
                    try:
                        own.put("b", key, f"w{n}".encode(), persist=n % 2 == 1)
                    except ObjectExists:
                        continue
                    with lock:
                        wins[key].append(n)

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads)
        for key in keys:
            assert len(wins[key]) == 1, (key, wins[key])
            assert len(records_of(pf, "b", key)) == 1, key
            assert pf.get("b", key) == f"w{wins[key][0]}".encode()


def test_concurrent_delete_readers_of_mixed_flag_keys_after_a_grow_have_one_winner(
    local_cluster: LocalCluster,
) -> None:
    """Keys written with either flag on a small job, then the job grown (block 0 placed by the
    old map, looked for through the new one, where PERSIST and ephemeral placements differ), read
    at once by 4 DELETE readers each: exactly one gets the bytes."""
    with local_cluster.register_job("delete-race", {"data_size_bytes": "8MiB"}) as job:
        with job.connect() as pf:
            pf.create_bucket("b")
            keys = [f"k{i}" for i in range(KEYS)]
            for n, key in enumerate(keys):
                pf.put("b", key, f"value-{n}".encode(), persist=n % 2 == 0)
            grown = local_cluster.control.grow_job(job.job_id, SPLIT_HINTS)
            before, after = Placement(job.handle.servers), Placement(grown.servers)
            assert grown.epoch > job.handle.epoch
            assert any(
                before.server_for(key.encode(), persist=n % 2 == 0).node_id
                != after.server_for(key.encode(), persist=n % 2 == 0).node_id
                for n, key in enumerate(keys)
            ), "the grow moved no key's block 0; the test needs some that moved"
            got: dict[str, list[bytes]] = {key: [] for key in keys}
            errors: list[BaseException] = []
            lock = threading.Lock()
            start = threading.Barrier(4)

            def reader() -> None:
                with job.connect() as own:
                    start.wait(30)
                    for key in keys:
                        try:
                            value = own.get("b", key, delete=True)
                        except ObjectNotFound:
                            continue
                        except BaseException as exc:  # noqa: BLE001 - reported below
                            with lock:
                                errors.append(exc)
                            continue
                        with lock:
                            got[key].append(value)

            threads = [threading.Thread(target=reader) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            assert not any(thread.is_alive() for thread in threads)
            assert errors == [], errors[:3]
            assert not pf.exists("b", keys[0])  # also adopts the grown map for records_of
            for n, key in enumerate(keys):
                assert got[key] == [f"value-{n}".encode()], (key, got[key])
                assert len(records_of(pf, "b", key)) == 0


def test_after_a_grow_a_put_looks_for_its_key_only_where_an_earlier_map_placed_it(
    local_cluster: LocalCluster,
) -> None:
    """The grown map says where the job's first map placed keys (``earlier``), so a put of a new
    key looks it up only on the servers that map placed it on (and that are not its home or
    arbiter now): most keys pay no lookup. Counted on the servers' own request counters; before
    the narrowing every put looked on every other server of the map."""
    with local_cluster.register_job("write-once-narrow", {"data_size_bytes": "8MiB"}) as job:
        with job.connect() as pf:
            pf.create_bucket("b")
            first = job.handle
            local_cluster.control.grow_job(job.job_id, SPLIT_HINTS)
            pf.put("b", "adopt", b"x")  # adopts the grown map
            grown = pf._view.handle
            # A bucket every server of the grown map has: no put repairs one (and claims again).
            pf.create_bucket("c")
            assert grown.epoch > first.epoch
            assert grown.earlier == (EarlierMap.of_handle(first),)
            before, after = Placement(first.servers), Placement(grown.servers)
            keys = [f"n{i}" for i in range(KEYS)]
            expected = 0
            for key in keys:
                raw = key.encode()
                earlier = {before.server_for(raw).node_id}
                if any(s.persist for s in first.servers):
                    earlier.add(before.server_for(raw, persist=True).node_id)
                expected += len(earlier - {after.server_for(raw).node_id})
            everywhere = KEYS * (len(grown.servers) - 1)
            assert expected < everywhere, "the grow left every server a rival of every key"
            start = scrape_all(local_cluster)
            for key in keys:
                pf.put("c", key, key.encode())
            end = scrape_all(local_cluster)
            lookups = (summed(end, "pocketflow_requests_total", op="lookup")
                       - summed(start, "pocketflow_requests_total", op="lookup"))
            assert lookups == expected, (lookups, expected, everywhere)
            for key in keys:
                assert pf.get("c", key) == key.encode()
                with pytest.raises(ObjectExists):
                    pf.put("c", key, b"again")
