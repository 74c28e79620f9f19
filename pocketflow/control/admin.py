"""Admin connections of the control plane to storage servers, with admin tokens renewed in time."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Protocol, TypeVar

from pocketflow.auth import admin_token
from pocketflow.errors import DataUnavailable, PocketflowError
from pocketflow.transport import ADMIN_TIMEOUT_DEFAULT_S, AdminClient

log = logging.getLogger(__name__)

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)
Item = TypeVar("Item")


class Addressed(Protocol):
    """A server as the admin calls name it (``StorageNodeInfo`` is one)."""

    node_id: str
    address: str


S = TypeVar("S", bound=Addressed)

ADMIN_TOKEN_TTL_S = 3600.0
"""Lifetime of an admin token; connections are reopened with a fresh one at half of it."""

ADMIN_CALLS_IN_FLIGHT_MAX = 8
"""Most admin calls one ``AdminTokens`` runs at once in a fan-out (:meth:`AdminTokens.fan_out`):
its pool's threads. More servers than that queue for a thread, within the fan-out's deadline."""


class AdminTokens:
    """One ``AdminClient`` per server address, all using an admin token that is renewed in time.

    ``secret`` is the cluster secret (held in memory by the control plane's processes only),
    ``tls_ca`` the cluster CA certificate (PEM) that servers' certificates are checked against
    (``None``: plaintext). ``timeout_s`` bounds every admin call, so a hung server costs at most
    that long; :meth:`fan_out` calls several servers at once within one such deadline, so a
    registration or a monitor pass waits at most that long however many servers hang.

    The table of connections is not shared between threads: each thread that calls servers has
    its own ``AdminTokens`` (or calls it under a lock). A pool thread of :meth:`fan_out` only
    runs a call on a connection the calling thread took from the table (an ``AdminClient`` may
    be used from several threads: its native connection is shared and thread-safe).
    """

    def __init__(
        self,
        secret: bytes,
        *,
        ttl_s: float = ADMIN_TOKEN_TTL_S,
        timeout_s: float = ADMIN_TIMEOUT_DEFAULT_S,
        tls_ca: str | None = None,
    ) -> None:
        self._secret = secret
        self._tls_ca = tls_ca
        self._timeout_s = timeout_s
        self._ttl_s = ttl_s
        self._token: str | None = None
        self._renew_at = 0.0
        self._clients: dict[str, AdminClient] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def client(self, address: str) -> AdminClient:
        """The admin connection to ``address``, opened on first use."""
        now = time.monotonic()
        if self._token is None or now >= self._renew_at:
            self._token = admin_token(self._secret, ttl_s=self._ttl_s)
            self._renew_at = now + self._ttl_s / 2
            self.close()
        found = self._clients.get(address)
        if found is None:
            found = AdminClient(
                address, self._token, timeout_s=self._timeout_s, tls_ca=self._tls_ca
            )
            self._clients[address] = found
        return found

    def sampled_stats(self, address: str) -> dict[str, Any]:
        """The server's ``stats``, stamped ``sampled_at_unix_s`` with the time the call started
        (the controller keeps the latest sample of each server by it)."""
        return sampled_stats(self.client(address))

    def forget(self, address: str) -> None:
        """Close and drop the connection to ``address`` (after the server failed or left)."""
        found = self._clients.pop(address, None)
        if found is not None:
            found.close()

    def close(self) -> None:
        """Close every connection (the pool's threads stay for the next calls)."""
        clients, self._clients = self._clients, {}
        for found in clients.values():
            found.close()

    def fan_out(
        self, calls: Iterable[tuple[K, str, Callable[[AdminClient], T]]]
    ) -> dict[K, T | PocketflowError]:
        """Run each ``(key, address, call)`` with the admin client of ``address``, at most
        ``ADMIN_CALLS_IN_FLIGHT_MAX`` at once, and wait for all of them within one deadline of
        ``timeout_s`` from now. Returns ``key -> result``, or the ``PocketflowError`` it raised,
        or ``DataUnavailable`` for a call that did not end by the deadline (it is left to end on
        its own call deadline; its result is dropped). Give each server one key: calls to one
        server that must not overlap belong in one ``call``.

        Connections are taken from the table here, in the calling thread; what to do with a
        failure (forget the connection, retry later) is the caller's, in its own thread.
        """
        deadline_s = time.monotonic() + self._timeout_s
        futures: dict[K, Future[T]] = {}
        outcomes: dict[K, T | PocketflowError] = {}
        addresses: dict[K, str] = {}
        for key, address, call in calls:
            addresses[key] = address
            try:
                admin = self.client(address)
            except PocketflowError as exc:
                outcomes[key] = exc
                continue
            futures[key] = self._executor().submit(call, admin)
        wait_futures(futures.values(), timeout=max(0.0, deadline_s - time.monotonic()))
        for key, future in futures.items():
            if not future.done():
                future.cancel()  # not started yet: it never will be
                outcomes[key] = DataUnavailable(
                    f"no answer within the admin deadline of {self._timeout_s:g}s",
                    server=addresses[key],
                )
                continue
            exc = future.exception()
            if exc is None:
                outcomes[key] = future.result()
            elif isinstance(exc, PocketflowError):
                outcomes[key] = exc
            else:
                raise exc
        return outcomes

    def fan_out_in_order(
        self,
        groups: Iterable[tuple[K, str, Sequence[Item]]],
        call: Callable[[AdminClient, Item], Any],
    ) -> dict[K, tuple[list[Item], PocketflowError | None]]:
        """For each ``(key, address, items)``, ``call`` each item on that server one after
        another, stopping at the first ``PocketflowError``; the servers at once, within one
        deadline (:meth:`fan_out`). Returns ``key -> (the items done, the error that stopped
        the rest or None)``; a server that did not answer by the deadline has none done."""
        outcomes = self.fan_out(
            (key, address, functools.partial(_each_in_order, items, call))
            for key, address, items in groups
        )
        return {key: ([], outcome) if isinstance(outcome, PocketflowError) else outcome
                for key, outcome in outcomes.items()}

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=ADMIN_CALLS_IN_FLIGHT_MAX, thread_name_prefix="pocketflow-admin"
                )
            return self._pool

    def on_every_server(
        self, servers: Iterable[S], what: str, call: Callable[[AdminClient], T]
    ) -> tuple[list[tuple[S, T]], list[str]]:
        """Run ``call`` with the admin client of each server, the servers at once
        (:meth:`fan_out`: one deadline for all). Returns the servers that answered with their
        results, and the node ids of those that failed (logged, their connection forgotten)."""
        targets = list(servers)
        outcomes = self.fan_out((index, info.address, call) for index, info in enumerate(targets))
        results: list[tuple[S, T]] = []
        unreachable: list[str] = []
        for index, info in enumerate(targets):
            outcome = outcomes[index]
            if isinstance(outcome, PocketflowError):
                log.warning("%s on %s failed: %s", what, info.node_id, outcome)
                self.forget(info.address)
                unreachable.append(info.node_id)
            else:
                results.append((info, outcome))
        return results, unreachable


def sampled_stats(admin: AdminClient) -> dict[str, Any]:
    """``admin``'s server's ``stats``, stamped ``sampled_at_unix_s`` with the time the call
    started (:meth:`AdminTokens.sampled_stats`; also a fan-out's call)."""
    sampled = time.time()
    stats = admin.stats()
    stats["sampled_at_unix_s"] = sampled
    return stats


def _each_in_order(
    items: Sequence[Item], call: Callable[[AdminClient, Item], Any], admin: AdminClient
) -> tuple[list[Item], PocketflowError | None]:
    """One server's calls of :meth:`AdminTokens.fan_out_in_order` (a pool thread's): the items
    done, and the error that stopped the rest."""
    done: list[Item] = []
    for item in items:
        try:
            call(admin, item)
        except PocketflowError as exc:
            return done, exc
        done.append(item)
    return done, None
