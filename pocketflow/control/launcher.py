"""Starting storage servers on demand: one ``StorageNode`` Ray actor per server, bounded waits,
and the storage slots asked of Ray's autoscaler, which follow the servers kept and starting."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pocketflow.control import NAMESPACE, STORAGE_NODE_ACTOR_PREFIX
from pocketflow.control.storage_node import StorageNode, StorageNodeInfo
from pocketflow.errors import CapacityExhausted, ClusterError, PocketflowError
from pocketflow.tls import ClusterCA

log = logging.getLogger(__name__)

RESOURCE_PREFIX = "pocketflow_storage_"
"""Custom Ray resource a node advertises per storage-server slot of a tier (``..._dram``)."""

RESOURCE_REQUESTS_KEPT_MAX = 64
"""Most autoscaler requests remembered for ``status``."""

LAUNCHES_AT_ONCE_MAX = 64
"""Most servers one call starts at once (a cluster's ``servers_max`` at most)."""

LAUNCH_ATTEMPTS_MAX = 3
"""Most times one launch starts over because the Ray node under the starting actor died."""

RESOURCE_REQUEST_SLOTS_MAX = 4096
"""Most storage slots one autoscaler request asks for (more servers than any cluster runs)."""

RequestResources = Callable[[list[dict[str, float]]], None]
"""Sends the autoscaler the resource bundles the cluster must be able to fit
(``ray.autoscaler.sdk.request_resources(bundles=...)``; an empty list withdraws the request)."""


def tier_resource(tier: str) -> str:
    """The custom Ray resource a server of ``tier`` needs one unit of."""
    return RESOURCE_PREFIX + tier


@dataclass(frozen=True)
class LaunchSpec:
    """How the controller starts a storage server of each tier.

    ``capacity_bytes_by_tier`` says which tiers can be launched and how big each server is.
    NVMe servers keep their data in a file of ``data_dir``. With ``use_resources``, each
    ``StorageNode`` actor requests one unit of :func:`tier_resource` so that Ray places it on a
    node that advertises storage slots of that tier; without it the actor runs anywhere (a local
    cluster). ``persist_ttl_ms`` is given to long-running servers (their PERSIST lifetime). The
    cluster secret and CA are not part of it: the launcher gets them from the controller, in
    memory.
    """

    data_dir: str
    capacity_bytes_by_tier: dict[str, int]
    threads: int | None = None
    persist_ttl_ms: int | None = None
    use_resources: bool = False
    servers_max: int = 64
    extra_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchRequest:
    """One server to launch: its node id, tier, and whether it is long-running."""

    node_id: str
    tier: str
    long_running: bool = False


class Launcher:
    """Starts ``StorageNode`` actors and their servers, each start bounded by a deadline, and keeps
    Ray's autoscaler asked for the storage slots the cluster needs.

    Each node gets the cluster ``secret`` and, with ``ca`` (the cluster CA, held in memory by
    the controller), a certificate the CA signs for the node's request (the node makes its
    server's key, which never leaves it): a launched server uses TLS whenever the cluster does.

    Launched nodes are detached actors (``lifetime="detached"``), so they outlive a crash of the
    controller that launched them and a restarted controller takes them back
    (:mod:`pocketflow.control.restore`); the controller stops them when it closes, and a launched
    node that no live controller knows stops itself (:class:`StorageNode`).

    With ``use_resources``, each server holds one storage slot (:func:`tier_resource`) of a Ray
    node, and :meth:`follow` keeps one standing autoscaler request
    (``ray.autoscaler.sdk.request_resources``) for exactly the slots of the servers the cluster
    keeps plus those starting. Ray fits such a request on every node's total resources as if they
    were idle and keeps the nodes it needs for it, so the request must follow the servers down
    as well as up: a slot still requested after its server left keeps an idle node up for good.
    :meth:`withdraw` clears the request when the controller closes. The request is one per Ray
    cluster: another client's ``request_resources`` replaces it, and this one replaces theirs.
    """

    def __init__(
        self,
        spec: LaunchSpec,
        *,
        secret: bytes,
        ca: ClusterCA | None = None,
        live_slots: Callable[[], Mapping[str, int]] = dict,
        request_resources: RequestResources | None = None,
    ) -> None:
        self.spec = spec
        self._secret = secret
        self._ca = ca
        self.resource_requests: list[dict[str, Any]] = []
        self._live_slots = live_slots
        self._request = request_resources or _ray_request_resources
        # Guards the launches in progress and the last request sent: launches run under the
        # controller's lock, the monitor loop follows without it.
        self._lock = threading.Lock()
        self._starting: dict[str, int] = {}
        self._requested: dict[str, int] | None = None

    def can_launch(self, tier: str) -> bool:
        """Whether servers of ``tier`` can be launched at all."""
        return tier in self.spec.capacity_bytes_by_tier

    def requested_slots(self) -> dict[str, int]:
        """The slots of the standing autoscaler request, per resource (empty: none)."""
        with self._lock:
            return dict(self._requested or {})

    def starting_counts(self) -> dict[str, int]:
        """Servers being launched now, per tier."""
        with self._lock:
            return dict(self._starting)

    @contextmanager
    def starting(self, tier: str) -> Iterator[None]:
        """Count a launch of ``tier`` as starting while the block runs (the caller launches the
        server and takes it in), asking the autoscaler for its slot at once."""
        with self._lock:
            self._starting[tier] = self._starting.get(tier, 0) + 1
        self.follow(reason=f"launching a {tier} server")
        try:
            yield
        finally:
            with self._lock:
                self._starting[tier] -= 1
                if self._starting[tier] <= 0:
                    del self._starting[tier]
            self.follow(reason=f"{tier} launch done")

    def follow(self, *, reason: str = "servers changed") -> bool:
        """Ask the autoscaler for one slot per server kept (``live_slots()``, per tier) and per
        server starting, if that differs from the standing request; returns whether a request
        was sent. Does nothing without ``use_resources``."""
        if not self.spec.use_resources:
            return False
        live = self._live_slots()
        with self._lock:
            wanted: dict[str, int] = {}
            for tier in set(live) | set(self._starting):
                count = int(live.get(tier, 0)) + self._starting.get(tier, 0)
                if count > 0:
                    wanted[tier_resource(tier)] = count
            if wanted == self._requested:
                return False
            self._send(wanted, reason=reason)
            return True

    def withdraw(self, *, reason: str = "the controller is closing") -> None:
        """Clear the standing autoscaler request (also one a crashed controller left behind).
        Does nothing without ``use_resources``."""
        if not self.spec.use_resources:
            return
        with self._lock:
            self._send({}, reason=reason)

    def _send(self, slots: dict[str, int], *, reason: str) -> None:
        """Send ``slots`` as the standing request and remember it. Called under ``_lock``."""
        total = sum(slots.values())
        if total > RESOURCE_REQUEST_SLOTS_MAX:
            raise ClusterError(
                f"asked for {total} storage slots, more than {RESOURCE_REQUEST_SLOTS_MAX}"
            )
        bundles = [{resource: 1.0} for resource in sorted(slots) for _ in range(slots[resource])]
        try:
            self._request(bundles)
        except Exception as exc:  # noqa: BLE001 - no autoscaler API, or no cluster to ask
            outcome = f"request failed: {exc}"
            log.warning("autoscaler request %s (%s) failed: %s", slots, reason, exc)
        else:
            outcome = "requested" if slots else "withdrawn"
            self._requested = dict(slots)
            log.info("autoscaler asked for %s (%s)", slots or "nothing", reason)
        self.resource_requests.append(
            {"slots": dict(slots), "reason": reason, "at_unix_s": time.time(),
             "outcome": outcome}
        )
        del self.resource_requests[:-RESOURCE_REQUESTS_KEPT_MAX]

    def launch(
        self, *, node_id: str, tier: str, long_running: bool, deadline_s: float
    ) -> tuple[StorageNodeInfo, Any]:
        """Start one server; returns its info and ``StorageNode`` actor handle, or raises what
        :meth:`launch_many` reports for it."""
        (outcome,) = self.launch_many(
            [LaunchRequest(node_id, tier, long_running)], deadline_s=deadline_s
        )
        if isinstance(outcome, PocketflowError):
            raise outcome
        return outcome

    def launch_many(
        self, requests: Sequence[LaunchRequest], *, deadline_s: float
    ) -> list[tuple[StorageNodeInfo, Any] | PocketflowError]:
        """Start several servers at once (each waits for its own node, so a registration that
        needs several waits for the slowest, not for their sum); one outcome per request, in
        order: its info and ``StorageNode`` actor handle, or the error that stopped it.

        ``deadline_s`` is a ``time.monotonic()`` instant. A server not up by then is
        ``CapacityExhausted`` (its half-started actor is killed); a tier that cannot be launched,
        or a server that failed to start, ``ClusterError``. A node that dies under a starting
        actor (Ray placed it on a node it had not yet found dead) is not the server's fault:
        that launch starts over with a new actor, at most ``LAUNCH_ATTEMPTS_MAX`` times. Call it
        inside :meth:`starting` (once per request), so the autoscaler is asked for the servers'
        slots while they wait.
        """
        import ray
        from ray.exceptions import RayActorError

        if len(requests) > LAUNCHES_AT_ONCE_MAX:
            raise ClusterError(
                f"{len(requests)} servers to launch at once, more than {LAUNCHES_AT_ONCE_MAX}"
            )
        outcomes: list[tuple[StorageNodeInfo, Any] | PocketflowError | None] = (
            [None] * len(requests)
        )
        # Starting actors: their pending call -> (request index, actor, attempt, whether the
        # call is the start; with TLS the node's certificate request comes first).
        starting: dict[Any, tuple[int, Any, int, bool]] = {}
        for index, request in enumerate(requests):
            if not self.can_launch(request.tier):
                outcomes[index] = ClusterError(
                    f"this cluster cannot launch {request.tier} servers"
                )
                continue
            node = self._create(request)
            starting[self._first_call(node)] = (index, node, 1, self._ca is None)
        while starting:
            remaining = deadline_s - time.monotonic()
            if remaining <= 0:
                waited_for_slot = self.spec.use_resources and bool(self.requested_slots())
                for index, node, _, _ in starting.values():
                    _kill_quietly(node)
                    request = requests[index]
                    outcomes[index] = CapacityExhausted(
                        f"storage server {request.node_id} ({request.tier}) was not up in time"
                        + (" (the autoscaler was asked for a node with a free slot)"
                           if waited_for_slot else "")
                    )
                break
            ready, _ = ray.wait(list(starting), num_returns=1, timeout=min(remaining, 1.0))
            for ref in ready:
                index, node, attempt, is_start = starting.pop(ref)
                request = requests[index]
                try:
                    answer = ray.get(ref)
                    if not is_start:
                        # The node's certificate request: the CA (here, never on the node)
                        # signs it, and the node starts its server with it.
                        assert self._ca is not None
                        cert = self._ca.sign(answer, request.node_id)
                        starting[node.start.remote(cert)] = (index, node, attempt, True)
                        continue
                    info: StorageNodeInfo = answer
                except RayActorError as exc:
                    _kill_quietly(node)
                    # A system-level death before the server was up: its node (or the actor's
                    # process) died under it, not a fault of the server's.
                    if not exc.actor_init_failed and attempt < LAUNCH_ATTEMPTS_MAX:
                        log.warning("storage server %s: the Ray node under it died while it "
                                    "started; launching it again (%s)", request.node_id,
                                    str(exc).splitlines()[-1])
                        again = self._create(request)
                        starting[self._first_call(again)] = (
                            index, again, attempt + 1, self._ca is None
                        )
                        continue
                    outcomes[index] = ClusterError(
                        f"storage server {request.node_id} ({request.tier}) did not start: "
                        f"{str(exc).splitlines()[-1]}"
                    )
                except PocketflowError as exc:
                    _kill_quietly(node)
                    outcomes[index] = exc
                except Exception as exc:  # noqa: BLE001 - Ray's own errors, typed here
                    _kill_quietly(node)
                    outcomes[index] = ClusterError(
                        f"storage server {request.node_id} ({request.tier}) did not start: "
                        f"{exc}"
                    )
                else:
                    log.info("launched storage server %s (%s) at %s", request.node_id,
                             request.tier, info.address)
                    outcomes[index] = (info, node)
        return [o if o is not None else ClusterError("not launched") for o in outcomes]

    def _first_call(self, node: Any) -> Any:
        """The first call to a new node: its certificate request with TLS, else its start."""
        if self._ca is not None:
            return node.certificate_request.remote()
        return node.start.remote()

    def _create(self, request: LaunchRequest) -> Any:
        """Create one detached ``StorageNode`` actor (its server is not started yet)."""
        import ray

        options: dict[str, Any] = {
            "name": STORAGE_NODE_ACTOR_PREFIX + request.node_id,
            "namespace": NAMESPACE,
            "num_cpus": 0,
            "max_restarts": 0,
            # Survives a crash of the controller, which takes it back when Ray restarts it.
            "lifetime": "detached",
            **self.spec.extra_options,
        }
        if self.spec.use_resources:
            options["resources"] = {tier_resource(request.tier): 1}
        nvme_path = (
            str(Path(self.spec.data_dir) / f"{request.node_id}.data")
            if request.tier != "dram" else None
        )
        return ray.remote(StorageNode).options(**options).remote(
            node_id=request.node_id,
            tier=request.tier,
            capacity_bytes=self.spec.capacity_bytes_by_tier[request.tier],
            secret=self._secret,
            long_running=request.long_running,
            nvme_path=nvme_path,
            threads=self.spec.threads,
            persist_ttl_ms=self.spec.persist_ttl_ms if request.long_running else None,
            tls_ca=self._ca.cert_pem if self._ca is not None else None,
            launched=True,
        )


def _kill_quietly(node: Any) -> None:
    import ray

    try:
        ray.kill(node, no_restart=True)
    except Exception as exc:  # noqa: BLE001 - already gone
        log.info("killing a storage node that failed to start: %s", exc)


def _ray_request_resources(bundles: list[dict[str, float]]) -> None:
    """``ray.autoscaler.sdk.request_resources(bundles=bundles)``."""
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)
