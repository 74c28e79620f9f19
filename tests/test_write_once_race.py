"""Write-once with exactly one winner, on the session's real servers (no Ray): a PERSIST writer
and an ephemeral writer of one key store on different servers, and one server (the key's
arbiter) decides between them, whatever the timing (issue 28, item 2). Overwrites replace every
version of a key (item 3). A writer whose check cannot reach a server is not let win.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import pytest
from fixtures_servers import CLIENT_OPTIONS, ServerSet, records_of, split_keys

from pocketflow.client import Client, connect
from pocketflow.errors import DataUnavailable, ObjectExists, ObjectNotFound
from pocketflow.handle import JobHandle, ServerInfo

ROUNDS = 200
BARRIER_TIMEOUT_S = 30


def test_a_persist_and_an_ephemeral_writer_racing_have_exactly_one_winner(
    job_handle: JobHandle,
) -> None:
    keys = split_keys(job_handle, ROUNDS, "race")
    start = threading.Barrier(2)
    wins: dict[str, list[str]] = {key: [] for key in keys}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def writer(name: str, persist: bool) -> None:
        with connect(job_handle, **CLIENT_OPTIONS) as own:
            for key in keys:
                start.wait(BARRIER_TIMEOUT_S)
                try:
                    own.put("b", key, name.encode(), persist=persist)
                except ObjectExists:
                    continue
                except BaseException as exc:  # noqa: BLE001 - reported below
                    with lock:
                        errors.append(exc)
                    continue
                with lock:
                    wins[key].append(name)

    with connect(job_handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        threads = [threading.Thread(target=writer, args=(name, name == "persist"))
                   for name in ("persist", "ephemeral")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert not any(thread.is_alive() for thread in threads)
        assert errors == [], errors[:3]
        no_winner = [key for key in keys if not wins[key]]
        two_winners = [key for key in keys if len(wins[key]) > 1]
        assert not no_winner and not two_winners, (
            f"{len(no_winner)} rounds without a winner, {len(two_winners)} with two")
        for key in keys:
            assert pf.get("b", key) == wins[key][0].encode(), key
            assert len(records_of(pf, "b", key)) == 1, (key, records_of(pf, "b", key))
        # Listings show each key once, as the object it is.
        listed = {info.key: info.size for info in pf.list("b", "race-")}
        assert listed == {key: len(wins[key][0]) for key in keys}


def test_an_ephemeral_overwrite_of_a_persist_key_replaces_every_version(
    client: Client, job_handle: JobHandle,
) -> None:
    client.create_bucket("b")
    small, large = split_keys(job_handle, 2, "over")
    big = bytes(range(256)) * (3 * 4096 + 5)  # 3 MiB and a bit: four data blocks
    for key, value in ((small, b"persist"), (large, big)):
        client.put("b", key, value, persist=True)
        client.put("b", key, b"ephemeral", overwrite=True)
        assert client.get("b", key) == b"ephemeral"
        assert not client.lookup("b", key).persist
        assert len(records_of(client, "b", key)) == 1
        # Deleted, nothing of the old version comes back.
        assert client.get("b", key, delete=True) == b"ephemeral"
        with pytest.raises(ObjectNotFound):
            client.get("b", key)
    # And the other way round: a PERSIST overwrite replaces the ephemeral version.
    key = split_keys(job_handle, 3, "back")[2]
    client.put("b", key, b"ephemeral")
    client.put("b", key, b"persist", persist=True, overwrite=True)
    assert client.get("b", key) == b"persist" and client.lookup("b", key).persist
    assert len(records_of(client, "b", key)) == 1
    client.delete("b", key)
    with pytest.raises(ObjectNotFound):
        client.get("b", key)
    client.put("b", key, b"again")  # the key is free again: no fence or version is left
    assert client.get("b", key) == b"again"


def test_two_delete_readers_of_a_fenced_key_get_it_once(
    client: Client, job_handle: JobHandle,
) -> None:
    client.create_bucket("b")
    keys = split_keys(job_handle, 40, "claim")
    for key in keys:
        client.put("b", key, key.encode(), persist=True)
    got: dict[str, list[bytes]] = {key: [] for key in keys}
    start = threading.Barrier(2)
    lock = threading.Lock()

    def reader() -> None:
        with connect(job_handle, **CLIENT_OPTIONS) as own:
            start.wait(BARRIER_TIMEOUT_S)
            for key in keys:
                try:
                    value = own.get("b", key, delete=True)
                except ObjectNotFound:
                    continue
                with lock:
                    got[key].append(value)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert all(got[key] == [key.encode()] for key in keys), got
    for key in keys:
        client.put("b", key, b"new")  # nothing of the claimed key remains
    assert client.get_many("b", keys) == [b"new"] * len(keys)


HUNG_OPTIONS = {"op_timeout_s": "1s", "rpc_timeout_s": "1s", "stream_timeout_s": "10s"}
"""A writer whose calls to a hung server time out quickly."""


def test_a_writer_that_cannot_reach_a_server_never_wins_a_second_time(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    """A PERSIST object is stored; its PERSIST home then hangs. An ephemeral put of the same key
    finds the fence the PERSIST put left on the key's arbiter; whether the record it stands for
    was stored only the hung server can say, so the put stores through the fence there and fails
    as unavailable when its bound runs out (the outcome unknown to it). Once the server answers,
    its write-once refuses those stores: no second winner."""
    servers, _ = server_factory("once-0", capacity_bytes=16 * 1024 * 1024)
    servers, _ = server_factory("once-1", capacity_bytes=16 * 1024 * 1024, long_running=True)
    handle = servers.handle()
    persist_home = servers.infos[1]
    keys = split_keys(handle, 5, "hang")
    with connect(handle, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        for key in keys:
            pf.put("b", key, b"persist", persist=True)
        pid = servers.process(persist_home.node_id).pid
        os.kill(pid, signal.SIGSTOP)
        try:
            with connect(handle, **HUNG_OPTIONS) as hurried:
                for key in keys:
                    with pytest.raises(DataUnavailable):
                        hurried.put("b", key, b"second")
        finally:
            os.kill(pid, signal.SIGCONT)
        for key in keys:
            assert pf.get("b", key) == b"persist"
            assert records_of(pf, "b", key) == [persist_home.node_id]
