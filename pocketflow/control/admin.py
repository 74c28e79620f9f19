"""Admin connections of the control plane to storage servers, with admin tokens renewed in time."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from pocketflow.auth import admin_token
from pocketflow.errors import PocketflowError
from pocketflow.transport import ADMIN_TIMEOUT_DEFAULT_S, AdminClient

log = logging.getLogger(__name__)

T = TypeVar("T")


class Addressed(Protocol):
    """A server as the admin calls name it (``StorageNodeInfo`` is one)."""

    node_id: str
    address: str


S = TypeVar("S", bound=Addressed)

ADMIN_TOKEN_TTL_S = 3600.0
"""Lifetime of an admin token; connections are reopened with a fresh one at half of it."""


class AdminTokens:
    """One ``AdminClient`` per server address, all using an admin token that is renewed in time.

    ``secret`` is the cluster secret (held in memory by the control plane's processes only),
    ``tls_ca`` the cluster CA certificate (PEM) that servers' certificates are checked against
    (``None``: plaintext). ``timeout_s`` bounds every admin call, so a hung server costs at most
    that long.
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
        sampled = time.time()
        stats = self.client(address).stats()
        stats["sampled_at_unix_s"] = sampled
        return stats

    def forget(self, address: str) -> None:
        """Close and drop the connection to ``address`` (after the server failed or left)."""
        found = self._clients.pop(address, None)
        if found is not None:
            found.close()

    def close(self) -> None:
        """Close every connection."""
        clients, self._clients = self._clients, {}
        for found in clients.values():
            found.close()

    def on_every_server(
        self, servers: Iterable[S], what: str, call: Callable[[AdminClient], T]
    ) -> tuple[list[tuple[S, T]], list[str]]:
        """Run ``call`` with the admin client of each server, one after another. Returns the
        servers that answered with their results, and the node ids of those that failed
        (logged, their connection forgotten)."""
        results: list[tuple[S, T]] = []
        unreachable: list[str] = []
        for info in servers:
            try:
                results.append((info, call(self.client(info.address))))
            except PocketflowError as exc:
                log.warning("%s on %s failed: %s", what, info.node_id, exc)
                self.forget(info.address)
                unreachable.append(info.node_id)
        return results, unreachable
