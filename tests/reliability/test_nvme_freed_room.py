"""A put into room that deleted blocks' writes still hold (NVMe write-behind), through a real
server process and the real client.

The NVMe tier acknowledges a put before the last writes behind it reach the device; a block
deleted then keeps its extent until they complete (the server's ``freeing_bytes``). The test fills
a private NVMe server (8 MiB blocks, one per object, then 1 MiB objects until less than 1 MiB is
free), and each of 200 rounds deletes the 8 MiB object put last and at once puts another: it
needs that object's whole extent, so it must wait for the writes (the server's
``FREEING_WAIT_MAX``, 2 s) instead of failing as full. With the wait set to 0 the same rounds
failed with ``capacity_exhausted`` 8 and 2 times in 100 on this machine. Then a put larger than
the freed room fails with ``CapacityExhausted`` within the wait's bound, leaves nothing behind,
and its message's figures agree with the server's stats.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from fixtures_servers import CLIENT_OPTIONS, ServerSet

from pocketflow.client import connect
from pocketflow.errors import CapacityExhausted
from pocketflow.handle import ServerInfo

MiB = 1024 * 1024
BLOCK_BYTES = 8 * MiB
"""One block per object, so a put needs one whole extent: the one the delete gives back."""
TOP_UP_BYTES = 1 * MiB
CAPACITY_BYTES = 40 * MiB
ROUNDS = 200
FREEING_WAIT_MAX_S = 2.0
"""The server's bound on a write's wait for the room of deleted blocks (``FREEING_WAIT_MAX``)."""
REFUSED_WITHIN_S = FREEING_WAIT_MAX_S + 5.0
"""A put that cannot fit ends within the server's wait, with a loaded machine's slack."""
SETTLE_TIMEOUT_S = 20.0
_REFUSED = re.compile(
    r"(?:tier is full: (\d+) bytes requested, (\d+) bytes free"
    r"|tier has no free extent of (\d+) bytes: (\d+) bytes free)"
)
_CAPACITY = re.compile(r"\(capacity (\d+) bytes")


def _server_stats(servers: ServerSet, info: ServerInfo) -> dict:
    with servers.admin(info.address) as admin:
        return admin.stats()


def _fill(pf, prefix: str, size: int) -> int:  # noqa: ANN001
    """Put objects of ``size`` until the server refuses one (which leaves nothing); how many."""
    count = 0
    while True:
        try:
            pf.put("b", f"{prefix}-{count:03d}", bytes(size))
        except CapacityExhausted:
            return count
        count += 1


def test_a_put_into_room_still_being_freed_waits_for_it(
    server_factory: Callable[..., tuple[ServerSet, ServerInfo]],
) -> None:
    servers, info = server_factory("freed-room-0", tier="nvme", capacity_bytes=CAPACITY_BYTES)
    handle = servers.handle(servers=[info], block_size_bytes=BLOCK_BYTES)
    with connect(handle, block_size_bytes=BLOCK_BYTES, **CLIENT_OPTIONS) as pf:
        pf.create_bucket("b")
        filled = _fill(pf, "fill", BLOCK_BYTES)
        assert filled >= 2, "the tier took fewer than two objects"
        _fill(pf, "top", TOP_UP_BYTES)
        full = _server_stats(servers, info)
        last = f"fill-{filled - 1:03d}"
        for round_ in range(ROUNDS):
            pf.delete("b", last)
            # At once: no read or stats call in between, which would give the writes time.
            pf.put("b", last, bytes([round_ % 256]) * BLOCK_BYTES)
        assert pf.get("b", last) == bytes([(ROUNDS - 1) % 256]) * BLOCK_BYTES
        assert _server_stats(servers, info)["used_bytes"] == full["used_bytes"]

        # A put larger than the room a delete gives back: refused, within the wait's bound.
        pf.delete("b", last)
        before = _server_stats(servers, info)
        started = time.monotonic()
        try:
            pf.put("b", "too-large", bytes(BLOCK_BYTES + TOP_UP_BYTES))
        except CapacityExhausted as exc:
            refused = str(exc)
        else:
            raise AssertionError("a put larger than the tier's room was stored")
        took_s = time.monotonic() - started
        assert took_s < REFUSED_WITHIN_S, f"the refusal took {took_s:.1f} s"
        figures = _REFUSED.search(refused)
        assert figures is not None, refused
        requested, free_bytes = (int(g) for g in figures.groups() if g is not None)
        capacity = _CAPACITY.search(refused)
        assert capacity is None or int(capacity.group(1)) == before["capacity_bytes"], refused
        # One of its blocks (with its header) found no room.
        assert TOP_UP_BYTES <= requested <= BLOCK_BYTES + 4096, refused
        assert free_bytes < requested, refused
        # Nothing of it stays, and the room it saw free is at most what is free once its other
        # block is given back: the room the delete gave back and what the fill left.
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        after = _server_stats(servers, info)
        while ((after["used_bytes"], after["objects"], after["freeing_bytes"])
               != (before["used_bytes"], before["objects"], 0)
               and time.monotonic() < deadline):
            time.sleep(0.05)
            after = _server_stats(servers, info)
        assert (after["used_bytes"], after["objects"], after["freeing_bytes"]) == (
            before["used_bytes"], before["objects"], 0), (before, after)
        assert free_bytes <= after["capacity_bytes"] - after["used_bytes"], (refused, after)
        # The room is whole again: an object of the size deleted fits.
        pf.put("b", last, bytes(BLOCK_BYTES))
        assert _server_stats(servers, info)["used_bytes"] == full["used_bytes"]
