"""The job handle: plain data, compact, and a weight map that round-trips exactly."""

import json
import pickle

import pytest

from pocketflow.errors import InvalidRequest
from pocketflow.handle import (
    EARLIER_MAPS_MAX,
    LOST_SERVERS_MAX,
    EarlierMap,
    JobHandle,
    LostServer,
    ServerInfo,
)
from pocketflow.placement import Placement

TOKEN = "1767225600000." + "ab" * 32


def _handle(servers: int = 3, *, weight: float = 1.0) -> JobHandle:
    infos = tuple(
        ServerInfo(
            node_id=f"{'dram' if i % 2 else 'nvme'}-{i}",
            address=f"127.0.0.1:{40000 + i}",
            tier="dram" if i % 2 else "nvme",
            weight=weight / (i + 1),
            persist=i % 4 == 0,
        )
        for i in range(servers)
    )
    return JobHandle("sort-3f2a9c", "sort", 1, infos, TOKEN)


def test_json_and_pickle_round_trip() -> None:
    handle = _handle()
    assert JobHandle.from_json(handle.to_json()) == handle
    assert pickle.loads(pickle.dumps(handle)) == handle
    assert handle.block_size_bytes == 1024 * 1024


def test_sixty_four_servers_fit_in_four_kib() -> None:
    handle = _handle(64)
    assert len(handle.to_json().encode()) < 4096
    assert len(pickle.dumps(handle)) < 4096
    assert len(handle.servers) == 64


def test_weights_are_rounded_so_json_places_identically() -> None:
    handle = _handle(7)
    assert handle.servers[2].weight == 0.333333
    copy = JobHandle.from_json(handle.to_json())
    a, b = Placement(handle.servers), Placement(copy.servers)
    for i in range(2000):
        key = f"k{i}".encode()
        assert a.server_for(key, i % 5) == b.server_for(key, i % 5)


def test_weight_map_round_trip_and_apply() -> None:
    handle = _handle(3)
    weight_map = handle.weight_map()
    assert weight_map["epoch"] == 1
    assert weight_map["servers"][0] == ["nvme-0", "127.0.0.1:40000", "nvme", 1, 1]
    grown = dict(weight_map, epoch=2,
                 servers=[*weight_map["servers"], ["dram-9", "127.0.0.1:49", "dram", 2.5, 0]])
    newer = handle.with_weight_map(grown)
    assert newer.epoch == 2 and len(newer.servers) == 4
    assert newer.servers[-1] == ServerInfo("dram-9", "127.0.0.1:49", "dram", 2.5, False)
    assert newer.token == handle.token and newer.job_id == handle.job_id
    assert handle.epoch == 1  # frozen: the original is untouched
    assert newer.context() == {"job": "sort-3f2a9c", "epoch": 2, "token": TOKEN}


def test_lost_servers_travel_in_the_map_json_and_pickle() -> None:
    handle = _handle(3)
    assert "lost" not in handle.weight_map() and '"lost"' not in handle.to_json()
    dead = LostServer("dram-7", "127.0.0.1:40007")
    lost = handle.with_lost(dead).with_lost(dead)  # remembered once
    assert lost.lost == (dead,)
    assert lost.weight_map()["lost"] == [["dram-7", "127.0.0.1:40007"]]
    assert JobHandle.from_json(lost.to_json()) == lost
    assert pickle.loads(pickle.dumps(lost)) == lost
    # A stale_epoch map carries them to a client still on the old handle.
    adopted = handle.with_weight_map(dict(lost.weight_map(), epoch=2))
    assert adopted.lost == (dead,) and adopted.epoch == 2
    # Bounded: the oldest are dropped.
    many = handle
    for i in range(LOST_SERVERS_MAX + 3):
        many = many.with_lost(LostServer(f"dram-{100 + i}", f"127.0.0.1:{41000 + i}"))
    assert len(many.lost) == LOST_SERVERS_MAX
    assert many.lost[-1].node_id == f"dram-{100 + LOST_SERVERS_MAX + 2}"
    with pytest.raises(InvalidRequest):
        handle.with_weight_map(dict(handle.weight_map(), lost=[["only-id"]]))


def test_repr_hides_the_token() -> None:
    assert TOKEN not in repr(_handle())


@pytest.mark.parametrize(
    "row",
    [
        ["a", "nohost", "dram", 1, 0],
        ["a", "127.0.0.1:1", "tape", 1, 0],
        ["a", "127.0.0.1:1", "dram", -1, 0],
        ["", "127.0.0.1:1", "dram", 1, 0],
        ["a", "127.0.0.1:1", "dram"],
    ],
)
def test_malformed_rows_are_refused(row: list[object]) -> None:
    with pytest.raises(InvalidRequest):
        _handle().with_weight_map({"epoch": 2, "servers": [row]})


def test_malformed_handles_are_refused() -> None:
    with pytest.raises(InvalidRequest):
        JobHandle.from_json("{}")
    with pytest.raises(InvalidRequest):
        JobHandle.from_json("not json")
    with pytest.raises(InvalidRequest):
        _handle().with_weight_map({"servers": []})
    duplicate = ServerInfo("a", "127.0.0.1:1", "dram", 1)
    with pytest.raises(InvalidRequest):
        JobHandle("j", "n", 1, (duplicate, duplicate), TOKEN)
    with pytest.raises(InvalidRequest):
        JobHandle("j", "n", 1, (duplicate,), TOKEN, block_size_bytes=0)


def test_a_later_handle_updates_the_token_but_never_moves_the_map_back() -> None:

    current = _handle(3).replace(epoch=4)
    renewed_older_map = _handle(2).replace(epoch=3, token="renewed")
    kept = current.updated_by(renewed_older_map)
    assert (kept.epoch, kept.servers, kept.token) == (4, current.servers, "renewed")
    newer = _handle(2).replace(epoch=5, token="newer")
    assert current.updated_by(newer) is newer


def test_each_new_map_remembers_the_earlier_placements_once_within_bounds() -> None:
    first = _handle(3)
    assert first.earlier is None and "earlier" not in first.weight_map()
    second = first.replace(epoch=2, servers=_handle(4).servers,
                           earlier=first.earlier_after(), suspects=("dram-1",))
    assert second.earlier == (EarlierMap.of_handle(first),)
    for copy in (JobHandle.from_json(second.to_json()), pickle.loads(pickle.dumps(second)),
                 first.with_weight_map(second.weight_map())):
        assert copy.earlier == second.earlier
    # A suspect was placed nothing: its weight 0 and no PERSIST.
    third = second.earlier_after()
    assert third is not None and len(third) == 2
    assert ("dram-1", 0.0, False) in third[1].servers
    # The same placement again is remembered once.
    again = second.replace(epoch=3, earlier=third)
    assert again.earlier_after() == third
    # Past the bound the job forgets them for good (its puts check every server again).
    handle = first
    for epoch in range(2, EARLIER_MAPS_MAX + 4):
        handle = handle.replace(epoch=epoch, earlier=handle.earlier_after(),
                                servers=_handle(3, weight=float(epoch)).servers[:2]
                                + _handle(3).servers[2:])
    assert handle.earlier is None and handle.earlier_after() is None
    doc = json.loads(second.to_json())
    doc["earlier"][0]["servers"][0][1] = -1
    with pytest.raises(InvalidRequest):
        JobHandle.from_json(json.dumps(doc))
