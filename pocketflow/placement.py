"""Weighted rendezvous hashing: which storage server holds block ``i`` of key ``k``.

Each ``(key, block index)`` is hashed once (BLAKE2b, 8 bytes); each server has a 64-bit seed
derived from its node id. The pair's score on a server is ``-weight / ln(u)`` where ``u`` in (0, 1)
comes from a SplitMix64 mix of the hash with the server's seed, and the highest score wins
(Schindelhauer and Schomaker's weighted rendezvous). So every server gets a share of keys
proportional to its weight, adding a server moves only the keys that now score highest on it, and
the result depends on nothing but the key and the weight map (never on Python's ``hash``), so
every process of a job places every block the same way.

Small objects and manifests are block 0; data block ``i`` of a large object is placed by
``(key, i)``, which stripes a large object over the job's servers, except that the one data block
of an object of one data block is placed by ``(key, 0)``, with its manifest (:func:`placed_block`),
so that such an object is written in one round trip to one server. PERSIST objects are placed over
the servers marked ``persist`` only. A key under a routed prefix (:class:`pocketflow.handle.Routes`:
the longest prefix ``P`` with the key starting ``P/``) is placed over the members of its route's
pool with equal weights instead; PERSIST placement and the fallback ranking ignore routes.

The placement itself is the Rust client core's (``servers/crates/client/src/placement.rs``, checked
against the shared cases of ``tests/vectors/placement.json``), the one the client's reads and
writes use; this class gives it a Python face for code that needs to know where a key lives.
"""

from __future__ import annotations

from collections.abc import Sequence

from pocketflow import _core
from pocketflow.errors import DataUnavailable, PersistNotSupported
from pocketflow.handle import NO_ROUTES, JobHandle, Routes, ServerInfo

__all__ = ["Placement", "placed_block"]

placed_block = _core.placed_block
"""The block index placement hashes for data block ``block`` (>= 1) of an object of
``block_count`` data blocks: 0, its manifest's, when the object has one data block (the block
lives with its manifest), else ``block`` itself (the blocks are striped)."""


class Placement:
    """Placement of blocks over one weight map (build once per epoch; immutable, thread-safe)."""

    def __init__(self, servers: Sequence[ServerInfo], routes: Routes = NO_ROUTES) -> None:
        self.servers: tuple[ServerInfo, ...] = tuple(servers)
        self._native = _core.Placement(
            [(s.node_id, s.weight, s.persist) for s in self.servers],
            routes.pool_map() if routes else None,
            routes.route_map() if routes else None,
        )

    @classmethod
    def of_handle(cls, handle: JobHandle) -> Placement:
        """The placement of ``handle``'s weight map, routes included."""
        return cls(handle.servers, handle.routes)

    def server_for(self, key: bytes, block: int = 0, *, persist: bool = False) -> ServerInfo:
        """The server that holds block ``block`` of ``key`` (UTF-8 bytes)."""
        index = self._native.server_for(key, block, persist)
        if index < 0:
            raise self._none_can_hold(persist)
        return self.servers[index]

    def data_block_server(
        self, key: bytes, block: int, *, block_count: int, persist: bool = False
    ) -> ServerInfo:
        """The server that holds data block ``block`` of an object of ``block_count`` data
        blocks (see :func:`placed_block`)."""
        return self.server_for(key, placed_block(block, block_count), persist=persist)

    def servers_for(
        self, keys: list[bytes], block: int = 0, *, persist: bool = False
    ) -> list[ServerInfo]:
        """The server of block ``block`` of each key, as :meth:`server_for` would pick it, placed
        in one call (for batches)."""
        picked = self._native.servers_for(keys, block, persist)
        if picked and min(picked) < 0:
            raise self._none_can_hold(persist)
        servers = self.servers
        return [servers[i] for i in picked]

    def ranked(self, key: bytes, block: int = 0) -> list[ServerInfo]:
        """Every server of the map, best-scoring first (the order fallback reads probe in);
        weight-0 servers rank after every active one."""
        servers = self.servers
        return [servers[i] for i in self._native.ranked(key, block)]

    def has_persist(self) -> bool:
        """Whether PERSIST objects can be placed at all."""
        return self._native.has_persist()

    @staticmethod
    def _none_can_hold(persist: bool) -> Exception:
        if persist:
            return PersistNotSupported(
                "persist_refused: the job's weight map has no long-running server"
            )
        return DataUnavailable("unavailable: the job's weight map has no server with weight > 0")
