"""Weighted rendezvous placement: proportional, minimal movement, deterministic everywhere."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from pocketflow.errors import DataUnavailable, PersistNotSupported
from pocketflow.handle import Routes, ServerInfo
from pocketflow.placement import Placement, placed_block

KEYS = 100_000


def _servers(weights: list[float], *, persist: set[int] | None = None) -> list[ServerInfo]:
    return [
        ServerInfo(f"node-{i}", f"127.0.0.1:{30000 + i}", "dram", w, i in (persist or set()))
        for i, w in enumerate(weights)
    ]


@pytest.mark.parametrize(
    "weights",
    [[1, 1, 1], [1, 2, 3], [0.5, 4, 1, 2.5], [3, 1, 1, 1, 1, 1, 1, 1, 2, 5]],
)
def test_shares_follow_weights(weights: list[float]) -> None:
    servers = _servers(weights)
    placement = Placement(servers)
    counts = Counter(placement.server_for(f"key-{i}".encode()).node_id for i in range(KEYS))
    total = sum(weights)
    for server, weight in zip(servers, weights, strict=True):
        share = counts[server.node_id] / KEYS
        assert abs(share - weight / total) < 0.02, (server.node_id, share, weight / total)


def test_blocks_of_one_key_spread_too() -> None:
    placement = Placement(_servers([1, 1, 1, 1]))
    counts = Counter(placement.server_for(b"one-big-object", i).node_id for i in range(20_000))
    assert all(abs(c / 20_000 - 0.25) < 0.02 for c in counts.values())


def test_one_data_block_lives_with_its_manifest_and_more_are_striped() -> None:
    placement = Placement(_servers([1, 1, 1], persist={0, 2}))
    assert placed_block(1, 1) == 0
    assert [placed_block(b, 3) for b in (1, 2, 3)] == [1, 2, 3]
    for i in range(200):
        key = f"key-{i}".encode()
        for persist in (False, True):
            home = placement.server_for(key, 0, persist=persist)
            assert placement.data_block_server(key, 1, block_count=1, persist=persist) == home
            for block in (1, 2):
                assert placement.data_block_server(
                    key, block, block_count=2, persist=persist
                ) == placement.server_for(key, block, persist=persist)


def test_adding_a_server_moves_only_keys_to_it() -> None:
    before = Placement(_servers([1, 2, 1]))
    grown = _servers([1, 2, 1]) + [ServerInfo("node-new", "127.0.0.1:39999", "nvme", 2)]
    after = Placement(grown)
    moved = 0
    for i in range(20_000):
        key = f"key-{i}".encode()
        old, new = before.server_for(key), after.server_for(key)
        if old != new:
            assert new.node_id == "node-new"
            moved += 1
    assert abs(moved / 20_000 - 2 / 6) < 0.03


def test_zero_weight_servers_get_nothing_but_rank_last() -> None:
    servers = _servers([1, 0, 1])
    placement = Placement(servers)
    assert all(placement.server_for(f"k{i}".encode()).node_id != "node-1" for i in range(5000))
    ranked = placement.ranked(b"some-key")
    assert [s.node_id for s in ranked][-1] == "node-1"
    assert ranked[0] == placement.server_for(b"some-key")


def test_persist_objects_go_to_persist_servers_only() -> None:
    placement = Placement(_servers([1, 1, 1, 1], persist={1, 3}))
    counts = Counter(
        placement.server_for(f"k{i}".encode(), persist=True).node_id for i in range(10_000)
    )
    assert set(counts) == {"node-1", "node-3"}
    assert abs(counts["node-1"] / 10_000 - 0.5) < 0.03
    with pytest.raises(PersistNotSupported):
        Placement(_servers([1, 1])).server_for(b"k", persist=True)


def test_long_running_server_with_zero_weight_still_takes_persist() -> None:
    placement = Placement(_servers([1, 0], persist={1}))
    assert placement.server_for(b"k", persist=True).node_id == "node-1"


_CHILD = """
from pocketflow.handle import ServerInfo
from pocketflow.placement import Placement
servers = [ServerInfo(f"node-{i}", f"127.0.0.1:{30000 + i}", "dram", 1 + i % 3) for i in range(5)]
p = Placement(servers)
print(",".join(p.server_for(f"key-{i}".encode(), i % 4).node_id for i in range(500)))
"""


def test_deterministic_across_processes() -> None:
    outputs = set()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=root)
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                             text=True, check=True, timeout=60)
        outputs.add(out.stdout.strip())
    assert len(outputs) == 1
    servers = [ServerInfo(f"node-{i}", f"127.0.0.1:{30000 + i}", "dram", 1 + i % 3)
               for i in range(5)]
    here = Placement(servers)
    expected = ",".join(here.server_for(f"key-{i}".encode(), i % 4).node_id for i in range(500))
    assert outputs == {expected}


VECTORS = os.path.join(os.path.dirname(__file__), "vectors", "placement.json")


def test_placement_matches_the_shared_vectors() -> None:
    """The cases the Rust core checks (`cargo test -p pocketflow-client`), through the Python face
    of its placement: one key, a batch and a ranking name the servers the vectors name."""
    with open(VECTORS, encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    checked = 0
    for case in cases:
        servers = [
            ServerInfo(node_id, f"127.0.0.1:{31000 + i}", "dram", weight, persist)
            for i, (node_id, weight, persist) in enumerate(case["servers"])
        ]
        placement = Placement(servers, Routes.of(case.get("pools"), case.get("routes")))
        for key, block, persist, expected in case["server_for"]:
            try:
                got = placement.server_for(key.encode(), block, persist=persist).node_id
            except (PersistNotSupported, DataUnavailable):
                got = None
            assert got == expected, (case["name"], key, block, persist)
            # The batch form picks the same.
            try:
                batch = placement.servers_for([key.encode()], block, persist=persist)
                got = batch[0].node_id
            except (PersistNotSupported, DataUnavailable):
                got = None
            assert got == expected, ("batch", case["name"], key, block, persist)
            checked += 1
        for key, block, expected in case["ranked"]:
            got = [s.node_id for s in placement.ranked(key.encode(), block)]
            assert got == expected, (case["name"], key, block)
            checked += 1
    assert checked >= 500  # 501 picks and rankings, 210 of them under routes
