"""A bounded per-process cache of pocketflow clients.

Serverless workers (Lithops' among them) run many calls per process and fork a process per call
right after using the storage. Keeping one client per handle saves a connection per call. A
client survives a fork as it is (a forked child makes its own native runtime and connections on
first use), so nothing happens before a fork; the child only gets fresh locks.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from pocketflow.client import Client, connect


class ClientCache:
    """At most ``clients_max`` clients, one per ``(handle, options)``, least recently used out."""

    def __init__(self, clients_max: int) -> None:
        if clients_max < 1:
            raise ValueError(f"clients_max must be at least 1, got {clients_max}")
        self.clients_max = clients_max
        self._clients: OrderedDict[Hashable, Client] = OrderedDict()
        self._lock = threading.Lock()
        _caches.add(self)

    def get(self, handle_json: str, **options: Any) -> Client:
        """The process's client for ``handle_json`` connected with ``options``."""
        key = (handle_json, tuple(sorted(options.items())))
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = connect(handle_json, **options)
                self._clients[key] = client
            self._clients.move_to_end(key)
            evicted = []
            while len(self._clients) > self.clients_max:
                evicted.append(self._clients.popitem(last=False)[1])
        for old in evicted:
            old.close()
        return client

    def _reset_lock(self) -> None:
        self._lock = threading.Lock()


_caches: weakref.WeakSet[ClientCache] = weakref.WeakSet()


def _reset_locks_in_child() -> None:
    # A lock held by another thread at fork would stay held in the child forever.
    for cache in list(_caches):
        cache._reset_lock()


os.register_at_fork(after_in_child=_reset_locks_in_child)
