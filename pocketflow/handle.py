"""The job handle: everything a task needs to reach its job's storage servers, as plain data.

A job registers with the control plane once and receives a :class:`JobHandle`; the framework hands
it to its tasks (JSON or pickle, under 4 KiB for 64 servers) and tasks talk straight to the
storage servers with it, never to Ray.

The *weight map* is the part of the handle that changes when the controller resizes a job::

    {"epoch": 2, "servers": [["dram-0", "127.0.0.1:40123", "dram", 1.0, 1], ...]}

with one ``[node_id, address, tier, weight, persist]`` row per server; ``"suspects": [node_id,
...]`` names servers of the map that hang (the controller gave them weight 0); and, once the job
has lost a server to a failure, ``"lost": [[node_id, address], ...]`` (the servers declared
dead while they were in the job's map, at most :data:`LOST_SERVERS_MAX`, oldest dropped first):
a key that no live server of the map holds may have been on one of them, so reads raise
``DataUnavailable`` instead of ``ObjectNotFound``. The controller passes the map to
``set_epoch``; a server that sees an older epoch returns it in its ``stale_epoch`` error and the
client applies it with :meth:`JobHandle.with_weight_map`. Weights are rounded to
:data:`WEIGHT_SIGNIFICANT_DIGITS` digits when a :class:`ServerInfo` is built, so a handle placed
from memory and the same handle read back from JSON place every key identically.

A map may also route prefixes of the job's keys (:class:`Routes`)::

    "pools": {"dram": ["dram-0", "dram-1"], "nvme": ["nvme-0"]},
    "routes": {"shuffle/r3": "dram", "shuffle/r4": "nvme"}

Every block of a key under ``<prefix>/`` (the longest routed prefix wins; PERSIST placement
ignores routes) is placed over the members of the route's pool with equal weights, whatever their
weight in the map; members the map does not list are ignored, and a route whose pool has none left
is ignored. The controller routes a prefix that was granted DRAM, or that spilled to NVMe
(:meth:`pocketflow.Job.declare` with ``size_bytes``).

A map after the first also says where the job's earlier maps placed keys (:class:`EarlierMap`)::

    "earlier": [{"servers": [["dram-0", 1.0, 1], ["dram-1", 1.0, 1]], "pools": ..., "routes": ...}]

one entry per distinct earlier placement (a suspect's weight 0, as placement saw it), so that a
write-once put looks for its key only on the servers an earlier map put it on instead of on every
server (docs/ARCHITECTURE.md, "Write-once"). A map without it (a job that changed its map more than
:data:`EARLIER_MAPS_MAX` ways, or a map from before the field) makes a put check every server.
"""

from __future__ import annotations

import json
import math
import re

from pocketflow.errors import InvalidRequest
from pocketflow.protocol import (
    BLOCK_SIZE_DEFAULT_BYTES,
    BLOCK_SIZE_MAX_BYTES,
    JOB_ID_MAX_BYTES,
    KEY_MAX_BYTES,
    context,
)
from pocketflow.records import TYPE_CHECKING, Record

if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "ServerInfo", "JobHandle", "LostServer", "Routes", "TIERS", "WEIGHT_SIGNIFICANT_DIGITS",
    "LOST_SERVERS_MAX", "POOLS_MAX", "ROUTES_MAX", "EarlierMap", "EARLIER_MAPS_MAX",
    "EARLIER_ROWS_MAX",
]

TIERS = ("dram", "nvme")
WEIGHT_SIGNIFICANT_DIGITS = 6
LOST_SERVERS_MAX = 16
"""Most lost servers a weight map remembers (keeps a handle small); the oldest are dropped."""
POOLS_MAX = 16
"""Most server pools a weight map names."""
ROUTES_MAX = 4096
"""Most routed prefixes a weight map holds (as ``ROUTES_MAX`` in the client core)."""
SERVERS_MAX = 4096
"""Most servers a weight map (or one pool) lists (as the client core's bound)."""
FIRST_EPOCH = 1
"""The epoch of a job's first map (no earlier map placed anything)."""
EARLIER_MAPS_MAX = 16
"""Most earlier placements a weight map remembers (as the client core's bound). A job whose map
changed more ways than this forgets them all for good, and its puts check every server again:
slower, never unsafe."""
EARLIER_ROWS_MAX = 1024
"""Most rows (servers, pool members, routes) the remembered placements hold together: bounds the
handle and the ``stale_epoch`` answers that carry it."""
_POOL_NAME = re.compile(r"^[a-z0-9_-]{1,32}$")
_dumps = json.JSONEncoder(separators=(",", ":")).encode


class ServerInfo(Record):
    """One storage server in a job's weight map (immutable; :meth:`replace` makes a changed copy).

    ``address`` is ``"host:port"``; ``weight`` is the server's share of the job's new data (0 means
    no new data, but its records stay readable); ``persist`` marks a long-running server that
    accepts PERSIST objects.
    """

    __slots__ = ("node_id", "address", "tier", "weight", "persist")
    node_id: str
    address: str
    tier: str
    weight: float
    persist: bool

    def __init__(
        self, node_id: str, address: str, tier: str, weight: float, persist: bool = False
    ) -> None:
        if not node_id:
            raise InvalidRequest("server node_id must not be empty")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidRequest(f"server address must be 'host:port', got {address!r}")
        if tier not in TIERS:
            raise InvalidRequest(f"server tier must be one of {TIERS}, got {tier!r}")
        rounded = float(weight)
        if not math.isfinite(rounded) or rounded < 0:
            raise InvalidRequest(f"server weight must be finite and >= 0, got {weight!r}")
        self._set(
            node_id=node_id,
            address=address,
            tier=tier,
            weight=float(f"{rounded:.{WEIGHT_SIGNIFICANT_DIGITS}g}"),
            persist=bool(persist),
        )

    def to_row(self) -> list[Any]:
        """The compact ``[node_id, address, tier, weight, persist]`` row of the weight map."""
        weight: float | int = int(self.weight) if self.weight.is_integer() else self.weight
        return [self.node_id, self.address, self.tier, weight, 1 if self.persist else 0]

    @classmethod
    def from_row(cls, row: Any) -> ServerInfo:
        """Parse a weight-map row (or a dict with the field names)."""
        if isinstance(row, dict):
            return cls(
                str(row["node_id"]), str(row["address"]), str(row["tier"]),
                float(row["weight"]), bool(row.get("persist", False)),
            )
        if not isinstance(row, (list, tuple)) or len(row) != 5:
            raise InvalidRequest(f"weight-map row must have 5 fields, got {row!r}")
        node_id, address, tier, weight, persist = row
        return cls(str(node_id), str(address), str(tier), float(weight), bool(persist))


class LostServer(Record):
    """A server declared dead while it was in the job's weight map (its data is gone)."""

    __slots__ = ("node_id", "address")
    node_id: str
    address: str

    def __init__(self, node_id: str, address: str) -> None:
        self._set(
            node_id=node_id,
            address=address,
        )

    def to_row(self) -> list[str]:
        """The compact ``[node_id, address]`` row of the map's ``lost`` list."""
        return [self.node_id, self.address]

    @classmethod
    def from_row(cls, row: Any) -> LostServer:
        """Parse a ``lost`` row."""
        if not isinstance(row, (list, tuple)) or len(row) != 2:
            raise InvalidRequest(f"lost-server row must be [node_id, address], got {row!r}")
        return cls(str(row[0]), str(row[1]))


def _route_prefix(prefix: Any) -> str:
    if (not isinstance(prefix, str) or not prefix or prefix.startswith("/")
            or prefix.endswith("/") or "//" in prefix or len(prefix.encode()) >= KEY_MAX_BYTES):
        raise InvalidRequest(f"malformed weight map: bad routed prefix {prefix!r:.200}")
    return prefix


class Routes(Record):
    """Prefixes of a job's keys placed over a named pool of servers (see the module doc).

    ``pools`` and ``routes`` are sorted ``(name, node ids)`` and ``(prefix, pool name)`` pairs;
    build one with :meth:`of` from dicts."""

    __slots__ = ("pools", "routes")
    pools: tuple[tuple[str, tuple[str, ...]], ...]
    routes: tuple[tuple[str, str], ...]

    def __init__(
        self,
        pools: tuple[tuple[str, tuple[str, ...]], ...] = (),
        routes: tuple[tuple[str, str], ...] = (),
    ) -> None:
        if len(pools) > POOLS_MAX:
            raise InvalidRequest(f"malformed weight map: more than {POOLS_MAX} pools")
        if len(routes) > ROUTES_MAX:
            raise InvalidRequest(f"malformed weight map: more than {ROUTES_MAX} routes")
        names = set()
        for name, members in pools:
            if not isinstance(name, str) or not _POOL_NAME.match(name):
                raise InvalidRequest(f"malformed weight map: bad pool name {name!r:.100}")
            if len(members) > SERVERS_MAX or len(set(members)) != len(members):
                raise InvalidRequest(
                    f"malformed weight map: pool {name!r} lists a server twice or too many")
            if not all(isinstance(m, str) and m for m in members):
                raise InvalidRequest(f"malformed weight map: pool {name!r} members are node ids")
            names.add(name)
        for prefix, pool in routes:
            _route_prefix(prefix)
            if pool not in names:
                raise InvalidRequest(
                    f"malformed weight map: route {prefix!r} names no pool ({pool!r:.100})")
        self._set(
            pools=pools,
            routes=routes,
        )

    @classmethod
    def of(cls, pools: Any = None, routes: Any = None) -> Routes:
        """Routes from the JSON shapes ``{name: [node ids]}`` and ``{prefix: pool name}``."""
        if pools is None and routes is None:
            return NO_ROUTES
        if not isinstance(pools or {}, dict) or not isinstance(routes or {}, dict):
            raise InvalidRequest("malformed weight map: pools and routes are JSON objects")
        try:
            return cls(
                tuple(sorted((str(n), tuple(str(m) for m in ms))
                             for n, ms in (pools or {}).items())),
                tuple(sorted((p, str(n)) for p, n in (routes or {}).items())),
            )
        except TypeError as exc:
            raise InvalidRequest(f"malformed weight map: {exc}") from exc

    def __bool__(self) -> bool:
        return bool(self.routes)

    def pool_map(self) -> dict[str, list[str]]:
        """``{name: [node ids]}``."""
        return {name: list(members) for name, members in self.pools}

    def route_map(self) -> dict[str, str]:
        """``{prefix: pool name}``."""
        return dict(self.routes)

    def with_routes(self, pools: dict[str, list[str]], routes: dict[str, str]) -> Routes:
        """These routes with ``pools`` defined (or redefined) and ``routes`` added or replaced."""
        return Routes.of({**self.pool_map(), **pools}, {**self.route_map(), **routes})

    def without(self, prefixes: set[str]) -> Routes:
        """These routes without ``prefixes`` (pools no route names are dropped too)."""
        routes = {p: n for p, n in self.routes if p not in prefixes}
        used = set(routes.values())
        return Routes.of({n: m for n, m in self.pool_map().items() if n in used}, routes)

    def without_member(self, node_id: str) -> Routes:
        """These routes with ``node_id`` out of every pool (a server leaving the job: routed
        keys must not go to it); a pool left empty goes with its routes."""
        pools = {n: [m for m in ms if m != node_id] for n, ms in self.pool_map().items()}
        pools = {n: ms for n, ms in pools.items() if ms}
        return Routes.of(pools, {p: n for p, n in self.routes if n in pools})

    def add_to(self, doc: dict[str, Any]) -> dict[str, Any]:
        """``doc`` with ``pools`` and ``routes`` set when there are routes."""
        if self.routes:
            doc["pools"] = self.pool_map()
            doc["routes"] = self.route_map()
        return doc


NO_ROUTES = Routes()


class EarlierMap(Record):
    """Where an earlier weight map of a job placed keys: each server's ``(node_id, weight,
    persist)`` as placement saw it (a suspect with weight 0 and no PERSIST), and its routes."""

    __slots__ = ("servers", "routes")
    servers: tuple[tuple[str, float, bool], ...]
    routes: Routes

    def __init__(
        self, servers: tuple[tuple[str, float, bool], ...], routes: Routes = NO_ROUTES
    ) -> None:
        self._set(
            servers=servers,
            routes=routes,
        )

    @classmethod
    def of_handle(cls, handle: JobHandle) -> EarlierMap:
        """The placement of ``handle``'s map."""
        suspects = set(handle.suspects)
        return cls(tuple(
            (s.node_id, 0.0 if s.node_id in suspects else s.weight,
             s.persist and s.node_id not in suspects)
            for s in handle.servers
        ), handle.routes)

    def rows(self) -> int:
        """Rows it holds (servers, pool members, routes), counted against
        :data:`EARLIER_ROWS_MAX`."""
        members = sum(len(m) for _, m in self.routes.pools)
        return len(self.servers) + members + len(self.routes.routes)

    def to_doc(self) -> dict[str, Any]:
        """``{"servers": [[node_id, weight, persist], ...], "pools"?, "routes"?}``."""
        rows = [[n, int(w) if w.is_integer() else w, int(p)] for n, w, p in self.servers]
        return self.routes.add_to({"servers": rows})

    @classmethod
    def from_doc(cls, doc: Any) -> EarlierMap:
        """Parse :meth:`to_doc` output."""
        rows = doc.get("servers") if isinstance(doc, dict) else None
        if not isinstance(rows, list) or len(rows) > SERVERS_MAX:
            raise InvalidRequest(f"malformed weight map: earlier map {doc!r:.200}")
        servers = []
        for row in rows:
            if (not isinstance(row, (list, tuple)) or len(row) != 3 or not isinstance(row[0], str)
                    or not isinstance(row[1], (int, float)) or not math.isfinite(row[1])
                    or row[1] < 0):
                raise InvalidRequest(f"malformed weight map: earlier server {row!r:.200}")
            weight = float(f"{float(row[1]):.{WEIGHT_SIGNIFICANT_DIGITS}g}")
            servers.append((row[0], weight, bool(row[2])))
        return cls(tuple(servers), Routes.of(doc.get("pools"), doc.get("routes")))


def _suspects_from_map(weight_map: Any) -> tuple[str, ...]:
    """The ``"suspects"`` of a weight map (node ids), checked."""
    suspects = weight_map.get("suspects", ()) if isinstance(weight_map, dict) else ()
    if not isinstance(suspects, (list, tuple)) or len(suspects) > SERVERS_MAX or not all(
            isinstance(n, str) for n in suspects):
        raise InvalidRequest(f"malformed weight map: suspects {suspects!r:.200}")
    return tuple(suspects)


def _held_weights_from_map(weight_map: Any) -> tuple[tuple[str, float, bool], ...]:
    """The ``"held_weights"`` of a weight map (``{node_id: [weight, persist]}``), checked."""
    held = weight_map.get("held_weights", {}) if isinstance(weight_map, dict) else {}
    if not isinstance(held, dict) or len(held) > SERVERS_MAX:
        raise InvalidRequest(f"malformed weight map: held_weights {held!r:.200}")
    rows = []
    for node_id, row in sorted(held.items()):
        if (not isinstance(row, (list, tuple)) or len(row) != 2
                or not isinstance(row[0], (int, float)) or not row[0] >= 0):
            raise InvalidRequest(f"malformed weight map: held weight {row!r:.200}")
        rows.append((str(node_id), float(row[0]), bool(row[1])))
    return tuple(rows)


def _earlier_from_map(weight_map: Any) -> tuple[EarlierMap, ...] | None:
    """The ``"earlier"`` placements of a weight map, checked; ``None`` when it has none."""
    docs = weight_map.get("earlier") if isinstance(weight_map, dict) else None
    if docs is None:
        return None
    if not isinstance(docs, list) or len(docs) > EARLIER_MAPS_MAX:
        raise InvalidRequest(f"malformed weight map: earlier {docs!r:.200}")
    earlier = tuple(EarlierMap.from_doc(doc) for doc in docs)
    if sum(m.rows() for m in earlier) > EARLIER_ROWS_MAX:
        raise InvalidRequest(f"malformed weight map: earlier maps hold more than "
                             f"{EARLIER_ROWS_MAX} rows")
    return earlier


def _servers_from_map(
    weight_map: Any,
) -> tuple[int, tuple[ServerInfo, ...], tuple[LostServer, ...], Routes]:
    if not isinstance(weight_map, dict) or "epoch" not in weight_map or "servers" not in weight_map:
        raise InvalidRequest(f"weight map must be {{'epoch', 'servers'}}, got {weight_map!r:.200}")
    try:
        epoch = int(weight_map["epoch"])
        servers = tuple(ServerInfo.from_row(row) for row in weight_map["servers"])
        lost = tuple(LostServer.from_row(row) for row in weight_map.get("lost", ()))
        routes = Routes.of(weight_map.get("pools"), weight_map.get("routes"))
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, InvalidRequest):
            raise
        raise InvalidRequest(f"malformed weight map: {exc}") from exc
    return epoch, servers, lost, routes


class JobHandle(Record):
    """A registered job: id, weight-map epoch, storage servers, capability token, block size,
    and the servers it lost to failures (``lost``, see the module doc).

    Immutable: :meth:`replace` makes a changed copy (checked as a new handle is)."""

    __slots__ = ("job_id", "name", "epoch", "servers", "token", "block_size_bytes", "lost",
                 "tls_ca", "routes", "suspects", "held_weights", "earlier")
    job_id: str
    name: str
    epoch: int
    servers: tuple[ServerInfo, ...]
    token: str
    block_size_bytes: int
    lost: tuple[LostServer, ...]
    tls_ca: str | None
    """The cluster CA (PEM) that the servers' certificates are checked against; ``None`` when
    the servers speak plaintext (an embedded cluster on loopback without ``tls=True``)."""
    routes: Routes
    """Prefixes placed over a pool of servers of their own (granted DRAM, or spilled)."""
    suspects: tuple[str, ...]
    """Servers of the map that are hung (running but not answering): the controller gave them
    weight 0, so new keys go elsewhere; they keep what they hold (see docs/ARCHITECTURE.md)."""
    held_weights: tuple[tuple[str, float, bool], ...]
    """``(node_id, weight, persist)`` of each suspect before it was suspected: where the keys
    written before are, so that only the keys it may hold need it (docs/ARCHITECTURE.md)."""
    earlier: tuple[EarlierMap, ...] | None
    """Where the job's earlier maps placed keys (distinct placements, oldest first); ``None``
    when not known (then a write-once put after a map change checks every server)."""

    def __init__(
        self,
        job_id: str,
        name: str,
        epoch: int,
        servers: tuple[ServerInfo, ...],
        token: str,
        block_size_bytes: int = BLOCK_SIZE_DEFAULT_BYTES,
        lost: tuple[LostServer, ...] = (),
        tls_ca: str | None = None,
        routes: Routes = NO_ROUTES,
        suspects: tuple[str, ...] = (),
        held_weights: tuple[tuple[str, float, bool], ...] = (),
        earlier: tuple[EarlierMap, ...] | None = None,
    ) -> None:
        if not job_id or len(job_id.encode()) > JOB_ID_MAX_BYTES:
            raise InvalidRequest(f"job id must be 1..{JOB_ID_MAX_BYTES} bytes")
        if not 0 < block_size_bytes <= BLOCK_SIZE_MAX_BYTES:
            raise InvalidRequest(
                f"block size must be 1..{BLOCK_SIZE_MAX_BYTES} bytes, got {block_size_bytes}"
            )
        if not isinstance(servers, tuple):
            servers = tuple(servers)
        if not isinstance(lost, tuple) or len(lost) > LOST_SERVERS_MAX:
            lost = tuple(lost)[-LOST_SERVERS_MAX:]
        node_ids = [s.node_id for s in servers]
        if len(set(node_ids)) != len(node_ids):
            raise InvalidRequest(f"duplicate node ids in the weight map: {node_ids}")
        self._set(
            job_id=job_id,
            name=name,
            epoch=epoch,
            servers=servers,
            token=token,
            block_size_bytes=block_size_bytes,
            lost=lost,
            tls_ca=tls_ca,
            routes=routes,
            suspects=suspects,
            held_weights=held_weights,
            earlier=earlier,
        )

    def weight_map(self) -> dict[str, Any]:
        """The JSON-able weight map: ``{"epoch": n, "servers": [[node_id, address, ...], ...]}``
        (plus ``"lost": [[node_id, address], ...]`` when the job lost servers)."""
        weight_map: dict[str, Any] = {
            "epoch": self.epoch, "servers": [s.to_row() for s in self.servers]
        }
        if self.lost:
            weight_map["lost"] = [s.to_row() for s in self.lost]
        if self.suspects:
            weight_map["suspects"] = list(self.suspects)
        if self.held_weights:
            weight_map["held_weights"] = self._held_weights_doc()
        if self.earlier:
            weight_map["earlier"] = [m.to_doc() for m in self.earlier]
        return self.routes.add_to(weight_map)

    def _held_weights_doc(self) -> dict[str, list[Any]]:
        return {node_id: [weight, int(persist)] for node_id, weight, persist in self.held_weights}

    def earlier_after(self) -> tuple[EarlierMap, ...] | None:
        """The ``earlier`` of the map that follows this one: this map's placement added to those
        before it (once), or ``None`` when they are not known or no longer fit their bounds."""
        known = () if self.epoch <= FIRST_EPOCH else self.earlier
        if known is None:
            return None
        this = EarlierMap.of_handle(self)
        earlier = known if this in known else (*known, this)
        if (len(earlier) > EARLIER_MAPS_MAX
                or sum(m.rows() for m in earlier) > EARLIER_ROWS_MAX):
            return None
        return earlier

    def with_weight_map(self, weight_map: dict[str, Any]) -> JobHandle:
        """This handle with another epoch, servers and routes (from ``set_epoch`` or
        ``stale_epoch``)."""
        epoch, servers, lost, routes = _servers_from_map(weight_map)
        return self.replace(epoch=epoch, servers=servers, lost=lost, routes=routes,
                            suspects=_suspects_from_map(weight_map),
                            held_weights=_held_weights_from_map(weight_map),
                            earlier=_earlier_from_map(weight_map))

    def updated_by(self, newer: JobHandle) -> JobHandle:
        """This handle after ``newer``, a later handle of the same job (a renewed token, a newer
        weight map): ``newer`` itself, or, when ``newer`` holds an older weight map than this
        one, this map with ``newer``'s token."""
        if newer.epoch < self.epoch:
            return self.replace(token=newer.token)
        return newer

    def with_lost(self, lost: LostServer) -> JobHandle:
        """This handle also remembering ``lost`` (a server declared dead) as lost."""
        kept = tuple(s for s in self.lost if s.node_id != lost.node_id)
        return self.replace(lost=(*kept, lost))

    def context(self) -> dict[str, Any]:
        """The capability context (``{"job", "epoch", "token"}``) that every request carries."""
        return context(self.job_id, self.epoch, self.token)

    def to_json(self) -> str:
        """Compact JSON, the form a framework passes to its tasks."""
        doc: dict[str, Any] = {
            "job": self.job_id,
            "name": self.name,
            "epoch": self.epoch,
            "token": self.token,
            "block_size": self.block_size_bytes,
            "servers": [s.to_row() for s in self.servers],
        }
        if self.lost:
            doc["lost"] = [s.to_row() for s in self.lost]
        if self.suspects:
            doc["suspects"] = list(self.suspects)
        if self.held_weights:
            doc["held_weights"] = self._held_weights_doc()
        if self.earlier:
            doc["earlier"] = [m.to_doc() for m in self.earlier]
        if self.tls_ca is not None:
            doc["tls_ca"] = self.tls_ca
        return _dumps(self.routes.add_to(doc))

    @classmethod
    def from_json(cls, text: str | bytes) -> JobHandle:
        """Parse :meth:`to_json` output."""
        try:
            doc = json.loads(text)
            epoch, servers, lost, routes = _servers_from_map(doc)
            return cls(
                job_id=str(doc["job"]),
                name=str(doc.get("name", "")),
                epoch=epoch,
                servers=servers,
                token=str(doc["token"]),
                block_size_bytes=int(doc.get("block_size", BLOCK_SIZE_DEFAULT_BYTES)),
                lost=lost,
                tls_ca=str(doc["tls_ca"]) if doc.get("tls_ca") is not None else None,
                routes=routes,
                suspects=_suspects_from_map(doc),
                held_weights=_held_weights_from_map(doc),
                earlier=_earlier_from_map(doc),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidRequest):
                raise
            raise InvalidRequest(f"malformed job handle: {exc}") from exc

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Pickle as the compact JSON: a 64-server handle stays well under 4 KiB.
        return (JobHandle.from_json, (self.to_json(),))

    def __repr__(self) -> str:
        return (
            f"JobHandle(job_id={self.job_id!r}, name={self.name!r}, epoch={self.epoch}, "
            f"servers=<{len(self.servers)}>, block_size_bytes={self.block_size_bytes}"
            + (", tls" if self.tls_ca is not None else "")
            + (f", routes=<{len(self.routes.routes)}>" if self.routes else "")
            + (f", lost=<{len(self.lost)}>)" if self.lost else ")")
        )
