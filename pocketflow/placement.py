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

The same placement exists in the Rust client core (``servers/crates/client/src/placement.rs``);
:meth:`Placement.servers_for` places a whole batch of keys there in one call. Both are checked
against the shared cases of ``tests/vectors/placement.json``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

from pocketflow import _core
from pocketflow.errors import DataUnavailable, PersistNotSupported
from pocketflow.handle import NO_ROUTES, JobHandle, Routes, ServerInfo

__all__ = ["Placement", "hash_block", "placed_block", "server_seed"]

_MASK64 = (1 << 64) - 1
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB
_GOLDEN = 0x9E3779B97F4A7C15
_TWO_POW_MINUS_53 = 2.0**-53


def hash_block(key: bytes, block: int) -> int:
    """64-bit hash of ``(key, block index)``; the block index is appended as 4 bytes."""
    digest = hashlib.blake2b(key + block.to_bytes(4, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def placed_block(block: int, block_count: int) -> int:
    """The block index placement hashes for data block ``block`` (>= 1) of an object of
    ``block_count`` data blocks: 0, its manifest's, when the object has one data block (the block
    lives with its manifest), else ``block`` itself (the blocks are striped). The native core's
    ``placement::placed_block``, which is what the client's reads and writes use."""
    return 0 if block_count == 1 else block


def server_seed(node_id: str) -> int:
    """64-bit seed of a server, from its node id."""
    digest = hashlib.blake2b(node_id.encode(), digest_size=8, person=b"pf-seed").digest()
    return int.from_bytes(digest, "little")


def _unit(h: int, seed: int) -> float:
    """SplitMix64 finalizer of ``h ^ seed`` mapped to the open interval (0, 1)."""
    z = ((h ^ seed) + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX_1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX_2) & _MASK64
    z ^= z >> 31
    return ((z >> 11) + 0.5) * _TWO_POW_MINUS_53


class _Pool:
    """Servers eligible for one kind of placement, with their seeds and weights precomputed."""

    __slots__ = ("servers", "seeds", "weights", "seeded_weights", "uniform")

    def __init__(self, servers: Sequence[ServerInfo], weights: Sequence[float]) -> None:
        self.servers = tuple(servers)
        self.seeds = tuple(server_seed(s.node_id) for s in servers)
        self.weights = tuple(weights)
        self.seeded_weights = tuple(zip(self.seeds, self.weights, strict=True))
        self.uniform = len(set(self.weights)) <= 1

    def pick(self, h: int) -> ServerInfo:
        # The mix of _unit, inlined: this loop runs for every block placed.
        best = 0
        best_score = -1.0
        if self.uniform:
            # Equal weights: the largest mixed value wins, no logarithm needed.
            for i, seed in enumerate(self.seeds):
                z = ((h ^ seed) + _GOLDEN) & _MASK64
                z = ((z ^ (z >> 30)) * _MIX_1) & _MASK64
                z = ((z ^ (z >> 27)) * _MIX_2) & _MASK64
                z ^= z >> 31
                if z > best_score:
                    best_score, best = z, i
        else:
            log = math.log
            for i, (seed, weight) in enumerate(self.seeded_weights):
                z = ((h ^ seed) + _GOLDEN) & _MASK64
                z = ((z ^ (z >> 30)) * _MIX_1) & _MASK64
                z = ((z ^ (z >> 27)) * _MIX_2) & _MASK64
                z ^= z >> 31
                score = -weight / log(((z >> 11) + 0.5) * _TWO_POW_MINUS_53)
                if score > best_score:
                    best_score, best = score, i
        return self.servers[best]

    def ranked(self, h: int) -> list[ServerInfo]:
        scored = sorted(
            ((-w / math.log(_unit(h, seed)), i) for i, (seed, w) in
             enumerate(zip(self.seeds, self.weights, strict=True))),
            reverse=True,
        )
        return [self.servers[i] for _, i in scored]


class Placement:
    """Placement of blocks over one weight map (build once per epoch; immutable, thread-safe)."""

    def __init__(self, servers: Sequence[ServerInfo], routes: Routes = NO_ROUTES) -> None:
        self.servers: tuple[ServerInfo, ...] = tuple(servers)
        # Routed prefix -> its pool's members in this map (None: none left, default placement).
        self._routes: dict[bytes, _Pool | None] = {}
        if routes:
            by_id = {s.node_id: s for s in servers}
            pools: dict[str, _Pool | None] = {}
            for name, members in routes.pools:
                present = [by_id[m] for m in members if m in by_id]
                pools[name] = _Pool(present, [1.0] * len(present)) if present else None
            self._routes = {prefix.encode(): pools[name] for prefix, name in routes.routes}
        active = [s for s in servers if s.weight > 0]
        self._ephemeral = _Pool(active, [s.weight for s in active]) if active else None
        persist_active = [s for s in active if s.persist]
        if persist_active:
            self._persist: _Pool | None = _Pool(persist_active, [s.weight for s in persist_active])
        else:
            # Long-running servers that get no new ephemeral data still take PERSIST objects.
            persist_any = [s for s in servers if s.persist]
            self._persist = _Pool(persist_any, [1.0] * len(persist_any)) if persist_any else None
        # For fallback reads: every server of the map, weight-0 servers with a tiny weight so that
        # they rank after every active server.
        weights_all = [s.weight if s.weight > 0 else 1e-9 for s in servers]
        self._all = _Pool(servers, weights_all) if servers else None
        self._native = _core.Placement(
            [(s.node_id, s.weight, s.persist) for s in servers],
            routes.pool_map() if routes else None,
            routes.route_map() if routes else None,
        )

    @classmethod
    def of_handle(cls, handle: JobHandle) -> Placement:
        """The placement of ``handle``'s weight map, routes included."""
        return cls(handle.servers, handle.routes)

    def server_for(self, key: bytes, block: int = 0, *, persist: bool = False) -> ServerInfo:
        """The server that holds block ``block`` of ``key`` (UTF-8 bytes)."""
        if self._routes and not persist:
            pool = self._route_of(key)
            if pool is not None:
                return pool.pick(hash_block(key, block))
        return self.server_for_hash(hash_block(key, block), persist=persist)

    def data_block_server(
        self, key: bytes, block: int, *, block_count: int, persist: bool = False
    ) -> ServerInfo:
        """The server that holds data block ``block`` of an object of ``block_count`` data
        blocks (see :func:`placed_block`)."""
        return self.server_for(key, placed_block(block, block_count), persist=persist)

    def _route_of(self, key: bytes) -> _Pool | None:
        """The pool of the longest routed prefix ``P`` that ``key`` starts ``P/`` with; ``None``
        when no route matches or that route's pool has no member in the map."""
        end = key.rfind(b"/")
        while end > 0:
            prefix = key[:end]
            if prefix in self._routes:
                return self._routes[prefix]
            end = key.rfind(b"/", 0, end)
        return None

    def servers_for(
        self, keys: list[bytes], block: int = 0, *, persist: bool = False
    ) -> list[ServerInfo]:
        """The server of block ``block`` of each key, as :meth:`server_for` would pick it, placed
        in one call to the native core (for batches)."""
        picked = self._native.servers_for(keys, block, persist)
        if picked and min(picked) < 0:
            self.server_for(keys[picked.index(-1)], block, persist=persist)  # raises the error
        servers = self.servers
        return [servers[i] for i in picked]

    def server_for_hash(self, h: int, *, persist: bool = False) -> ServerInfo:
        """The server for a precomputed :func:`hash_block` value (routes not applied)."""
        pool = self._persist if persist else self._ephemeral
        if pool is None:
            if persist:
                raise PersistNotSupported(
                    "persist_refused: the job's weight map has no long-running server"
                )
            raise DataUnavailable("unavailable: the job's weight map has no server with weight > 0")
        return pool.pick(h)

    def ranked(self, key: bytes, block: int = 0) -> list[ServerInfo]:
        """Every server of the map, best-scoring first (the order fallback reads probe in)."""
        if self._all is None:
            return []
        return self._all.ranked(hash_block(key, block))

    def has_persist(self) -> bool:
        """Whether PERSIST objects can be placed at all."""
        return self._persist is not None
