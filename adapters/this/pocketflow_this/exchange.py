"""Where stages hand values to each other: a pocketflow job's bucket (the adapter's exchange),
or any other store behind the same small interface (the benchmark's Redis and S3 peers).

An :class:`Exchange` is plain picklable data that travels to every task; ``connect()`` in the
task opens its client. Keys are written once; a rerun that finds its key already written keeps
the first copy (the stages are deterministic functions of their input).
"""

from __future__ import annotations

import abc
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pocketflow.errors import (
    BucketExists,
    BucketNotFound,
    DataUnavailable,
    ObjectExists,
    ObjectNotFound,
    PocketflowError,
)
from pocketflow_this.errors import InputLost

__all__ = ["Exchange", "ExchangeClient", "PocketflowExchange", "client_for"]

CLIENTS_PER_PROCESS_MAX = 4
"""Most exchange clients one worker process keeps open between tasks."""
MAP_REFRESH_TIMEOUT_S = 30.0
"""How long the driver waits for the control plane to move the job off a dead server."""
MAP_REFRESH_PAUSE_S = (0.05, 1.0)
"""First and largest pause between checks for a new weight map (failure path only)."""


class ExchangeClient(abc.ABC):
    """A connection to an exchange, used by tasks and by the driver."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes, *, persist: bool, overwrite: bool = False) -> bool:
        """Write ``key`` (replacing it with ``overwrite``); ``False`` if it was already there
        and not replaced."""

    @abc.abstractmethod
    def get(self, key: str, *, delete: bool) -> bytes:
        """The value of ``key`` (freed as it is read with ``delete``); raises
        :class:`InputLost` when it is gone or on a server that cannot be reached."""

    @abc.abstractmethod
    def wait(self, key: str, timeout_s: float) -> bool:
        """Block until ``key`` exists or ``timeout_s`` passes; whether it exists."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if it is there."""

    def lost(self, key: str) -> bool:
        """Whether ``key`` may have been lost with a dead server (only stores that lose
        servers answer ``True``)."""
        return False

    def unreachable(self) -> set[str]:
        """Servers the client's current map knows to be dead."""
        return set()

    def refresh(self, unreachable: set[str]) -> None:
        """Wait until the client's map no longer names ``unreachable`` (driver, failure path)."""
        return None

    def spec(self) -> Exchange | None:
        """The exchange as this client now sees it (a newer map), or ``None`` if unchanged."""
        return None

    def abandon(self) -> None:
        """The run failed: wake tasks still waiting for their inputs (best effort)."""
        return None

    def close(self) -> None:
        """Close connections."""
        return None


class Exchange(abc.ABC):
    """Picklable description of where a run's values go; ``connect()`` opens a client."""

    name: str

    @abc.abstractmethod
    def connect(self) -> ExchangeClient: ...

    def cache_key(self) -> Any:
        """What identifies this exchange in a worker's client cache."""
        return self


@dataclass(frozen=True)
class PocketflowExchange(Exchange):
    """A bucket of a registered pocketflow job, reached with its handle."""

    handle_json: str
    bucket: str
    client_options: tuple[tuple[str, Any], ...] = ()
    name: str = "pocketflow"

    def connect(self) -> PocketflowClient:
        return PocketflowClient(self)


class PocketflowClient(ExchangeClient):
    """:class:`ExchangeClient` over :class:`pocketflow.Client`."""

    def __init__(self, exchange: PocketflowExchange) -> None:
        import pocketflow

        self._exchange = exchange
        self._bucket = exchange.bucket
        self.pf = pocketflow.connect(exchange.handle_json, **dict(exchange.client_options))

    def create_bucket(self) -> None:
        try:
            self.pf.create_bucket(self._bucket)
        except BucketExists:
            pass

    def put(self, key: str, data: bytes, *, persist: bool, overwrite: bool = False) -> bool:
        try:
            self.pf.put(self._bucket, key, data, persist=persist, overwrite=overwrite)
        except ObjectExists:
            return False
        except DataUnavailable as exc:
            raise InputLost(f"cannot write {key}: {exc}", exc.server) from exc
        return True

    def get(self, key: str, *, delete: bool) -> bytes:
        try:
            return self.pf.get(self._bucket, key, delete=delete)
        except ObjectNotFound as exc:
            raise InputLost(f"{key} is gone (consumed by an earlier attempt?)") from exc
        except DataUnavailable as exc:
            raise InputLost(f"{key} is unavailable: {exc}", exc.server) from exc

    def wait(self, key: str, timeout_s: float) -> bool:
        try:
            return not self.pf.wait_for(self._bucket, [key], timeout_s=timeout_s)
        except DataUnavailable as exc:
            raise InputLost(f"waiting for {key}: {exc}", exc.server) from exc
        except BucketNotFound as exc:  # the run ended (its bucket was deleted)
            raise InputLost(f"waiting for {key}: {exc}") from exc

    def delete(self, key: str) -> None:
        try:
            self.pf.delete(self._bucket, key)
        except (ObjectNotFound, DataUnavailable):
            pass

    def lost(self, key: str) -> bool:
        try:
            self.pf.lookup(self._bucket, key)
        except DataUnavailable:
            return True
        except ObjectNotFound:
            return False
        return False

    def unreachable(self) -> set[str]:
        return {s.address for s in self.pf.handle.lost}

    def _names(self, unreachable: set[str]) -> bool:
        return any(s.address in unreachable for s in self.pf.handle.servers)

    def refresh(self, unreachable: set[str]) -> None:
        """Ask live servers until one answers with a map without ``unreachable`` (the control
        plane moves the job off a silent server after a few seconds)."""
        deadline = time.monotonic() + MAP_REFRESH_TIMEOUT_S
        pause_s, pause_max_s = MAP_REFRESH_PAUSE_S
        while self._names(unreachable) and time.monotonic() < deadline:
            try:
                self.pf.create_bucket(self._bucket)  # any live server answers stale_epoch
            except (BucketExists, DataUnavailable):
                pass
            if not self._names(unreachable):
                return
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, pause_max_s)

    def probe(self) -> None:
        """One request that brings a newer map if the job has one (``stale_epoch``)."""
        try:
            self.pf.create_bucket(self._bucket)
        except (BucketExists, DataUnavailable):
            pass

    def spec(self) -> PocketflowExchange | None:
        handle_json = self.pf.handle.to_json()
        if handle_json == self._exchange.handle_json:
            return None
        return PocketflowExchange(handle_json, self._bucket, self._exchange.client_options)

    def abandon(self) -> None:
        try:
            self.pf.delete_bucket(self._bucket)
        except PocketflowError:
            pass

    def close(self) -> None:
        self.pf.close()


_clients: OrderedDict[Any, ExchangeClient] = OrderedDict()
_clients_lock = threading.Lock()


def client_for(exchange: Exchange) -> ExchangeClient:
    """This process's client for ``exchange``, kept for the next task (least recently used out
    beyond ``CLIENTS_PER_PROCESS_MAX``)."""
    key = exchange.cache_key()
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = exchange.connect()
            _clients[key] = client
        _clients.move_to_end(key)
        evicted = []
        while len(_clients) > CLIENTS_PER_PROCESS_MAX:
            evicted.append(_clients.popitem(last=False)[1])
    for old in evicted:
        old.close()
    return client
