"""Jobs: register with hints, hand the job handle to tasks, deregister to free the job's data."""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pocketflow.auth import token_expiry_unix_ms
from pocketflow.config import parse_size
from pocketflow.control.leases import LEASE_MS_DEFAULT, check_lease_ms
from pocketflow.control.plane import (
    ControlPlane,
    HasControlPlane,
    connect_control_plane,
    last_started,
)
from pocketflow.errors import (
    ClusterError,
    ConfigError,
    InvalidRequest,
    JobNotRegistered,
    PocketflowError,
)
from pocketflow.hints import Hints
from pocketflow.prefixes import (
    PREFIX_LEASE_MS_DEFAULT,
    PREFIX_WAIT_S_DEFAULT,
    PrefixKeeper,
    PrefixLeases,
    check_prefix_lease_ms,
)
from pocketflow.protocol import LEASE_PREFIXES_MAX

if TYPE_CHECKING:
    from pocketflow.client import Client
    from pocketflow.handle import JobHandle

log = logging.getLogger(__name__)

RENEW_RETRY_FIRST_S = 0.25
"""Pause before retrying a failed lease renewal (doubled for each further failure)."""

RENEW_BACKOFF_MAX_S = 2.0
"""Longest pause between two renewal attempts while they fail, unless a third of the lease is
longer (the controller's ``RESTORED_LEASE_GRACE_S`` must exceed it)."""

RENEW_FAILURE_LOG_INTERVAL_S = 30.0
"""How often a driver whose lease renewals keep failing says so."""

REGISTER_RETRY_S = 60.0
"""How long a registration is retried while the controller does not answer (it restarts)."""

REGISTER_RETRY_PAUSE_MAX_S = 2.0
"""Longest pause between two attempts of a registration."""

class Job:
    """A registered job: its handle, a way to connect, and deregistration.

    Use it as a context manager; leaving the block deregisters the job (also when the block
    raises), which frees all of its non-PERSIST data::

        with pocketflow.register_job("sort", {"data_size_bytes": "1GiB"}) as job:
            run_tasks(job.handle.to_json())
    """

    def __init__(
        self, handle: JobHandle, control: ControlPlane, *, lease_ms: int | None = None,
        prefix_lease_ms: int = PREFIX_LEASE_MS_DEFAULT,
    ) -> None:
        self._prefix_lease_ms = check_prefix_lease_ms(prefix_lease_ms)
        self._prefix_leases: PrefixLeases | None = None
        self._granted: set[str] = set()
        self._grants_due: list[str] = []
        self._grants_wake = threading.Event()
        self._grants_renewer: threading.Thread | None = None
        self._handle = handle
        self._control = control
        self._lock = threading.Lock()
        self._deregistered = False
        self._clients: weakref.WeakSet[Client] = weakref.WeakSet()
        self._lease_stop = threading.Event()
        self._token_received_unix_ms = int(time.time() * 1000)
        if lease_ms is not None:
            check_lease_ms(lease_ms)
            threading.Thread(
                target=_renew_lease,
                args=(control, handle.job_id, lease_ms, self._lease_stop,
                      self._renew_token_if_half_gone),
                name=f"pocketflow-lease-{handle.job_id}",
                daemon=True,
            ).start()

    @property
    def handle(self) -> JobHandle:
        """The serializable job handle to pass to tasks (``handle.to_json()``)."""
        return self._handle

    @property
    def job_id(self) -> str:
        """The job id: its name and a random suffix."""
        return self._handle.job_id

    @property
    def name(self) -> str:
        """The name the job was registered with."""
        return self._handle.name

    @property
    def deregistered(self) -> bool:
        """Whether :meth:`deregister` has run."""
        return self._deregistered

    def connect(self, **options: Any) -> Client:
        """Open a client on this job's storage servers (closed again by :meth:`deregister`)."""
        from pocketflow.client import connect

        client = connect(self._handle, **options)
        with self._lock:
            self._clients.add(client)
            if client.handle.token != self._handle.token:
                client.update_handle(self._handle)  # renewed while it was connecting
        return client

    def renew_token(self) -> JobHandle:
        """Get the job a new token (valid for the cluster's token TTL from now) and give it to
        this job's handle and to every client opened by :meth:`connect`; returns the new handle.

        The lease thread calls it once half of the current token's life is gone, so a job that
        runs longer than a token lives keeps its access. Tasks elsewhere hold the handle they were
        given: pass them :attr:`handle` again, and a task's client takes it with
        :meth:`pocketflow.Client.update_handle`.
        """
        handle = self._control.renew_token(self._handle.job_id)
        with self._lock:
            self._token_received_unix_ms = int(time.time() * 1000)
        return self._adopt(handle)

    def _renew_token_if_half_gone(self) -> None:
        if token_half_gone(self._handle.token, received_unix_ms=self._token_received_unix_ms,
                           now_unix_ms=int(time.time() * 1000)):
            self.renew_token()

    # -- prefix leases (pocketflow.prefixes) -------------------------------------------------

    @property
    def prefix_leases(self) -> PrefixLeases:
        """The job's prefix leases (declared prefixes, lease length, batched renewal)."""
        if self._prefix_leases is None:
            leases = PrefixLeases(self.connect(), lease_ms=self._prefix_lease_ms,
                                  on_renew=self._renew_grants)
            with self._lock:
                if self._prefix_leases is None:
                    self._prefix_leases = leases
        return self._prefix_leases

    def declare(
        self,
        prefix: str,
        parents: Iterable[str] = (),
        *,
        size_bytes: int | str | None = None,
        wait_s: float = PREFIX_WAIT_S_DEFAULT,
    ) -> str | None:
        """Declare a prefix of the job's DAG (``"map/7"``) with the prefixes it depends on, and
        start its lease (``prefix_lease_ms``, default 1 s) on every storage server. Keys under
        ``<prefix>/`` (objects, queues, append files, every bucket) are freed by the servers
        when the lease lapses; see :mod:`pocketflow.prefixes`.

        With ``size_bytes`` (what the prefix will hold), the controller also places it: it
        grants the prefix DRAM when there is room, else the declaration waits for DRAM that
        lapsing prefixes give back (in order, at most ``wait_s``) and then spills the prefix to
        NVMe; see :mod:`pocketflow.control.prefix_grants`. Returns ``"dram"``, ``"nvme"``, or
        ``None`` (no size given, or no pool could take it: the job's own weights place it).
        Keep the prefix renewed (:meth:`keep`) or its grant lapses with its lease."""
        return self.declare_many([(prefix, parents, size_bytes)], wait_s=wait_s)[prefix]

    def declare_many(
        self,
        declarations: Iterable[tuple[str, Iterable[str], int | str | None]],
        *,
        wait_s: float = PREFIX_WAIT_S_DEFAULT,
    ) -> dict[str, str | None]:
        """:meth:`declare` for many ``(prefix, parents, size_bytes)`` at once (a stage's
        prefixes): one controller call places every sized prefix, in one new epoch of the job's
        map, and one ``renew_leases`` per server starts the leases. Returns each prefix's
        placement."""
        items = [(p, tuple(parents), _declared_size(p, size)) for p, parents, size in declarations]
        leases = self.prefix_leases
        placed: dict[str, str | None] = {p: None for p, _, _ in items}
        sized = [(p, size) for p, _, size in items if size is not None]
        if sized:
            leases.check_declarations([(p, parents) for p, parents, _ in items])
            result = self._control.declare_prefixes(
                self.job_id, sized, self._prefix_lease_ms, wait_s)
            for pool in ("dram", "nvme"):
                for prefix in result[pool]:
                    placed[prefix] = pool
            with self._lock:
                self._granted.update(result["dram"])
            self._adopt(result["handle"])
        leases.declare_many([(p, parents) for p, parents, _ in items])
        return placed

    def _adopt(self, handle: JobHandle) -> JobHandle:
        """Take a newer handle of this job (a renewed token, a new epoch) and give it to this
        job's clients; returns the handle now in use."""
        with self._lock:
            handle = self._handle = self._handle.updated_by(handle)
            clients = list(self._clients)
        for client in clients:
            client.update_handle(handle)
        return handle

    def _renew_grants(self, prefixes: list[str]) -> None:
        """Renew the controller's grants among ``prefixes`` (a renewal's closure). The call runs
        on a thread of its own, so the servers' renewals never wait for the controller; while
        one call runs, only the newest set waits for the next."""
        with self._lock:
            granted = [p for p in prefixes if p in self._granted]
            if not granted:
                return
            self._grants_due = granted
            if self._grants_renewer is None:
                self._grants_renewer = threading.Thread(
                    target=self._grants_renewal_loop, daemon=True,
                    name=f"pocketflow-grants-{self.job_id}")
                self._grants_renewer.start()
        self._grants_wake.set()

    def _grants_renewal_loop(self) -> None:
        while not self._lease_stop.is_set():
            self._grants_wake.wait(1.0)
            self._grants_wake.clear()
            with self._lock:
                due, self._grants_due = self._grants_due, []
            if not due:
                continue
            try:
                self._control.renew_prefixes(self.job_id, due)
            except JobNotRegistered:
                return
            except PocketflowError as exc:
                log.warning("renewing the DRAM grants of job %s failed: %s", self.job_id, exc)

    def renew(self, prefixes: Iterable[str]) -> int:
        """Renew declared ``prefixes`` with their ancestors and descendants, in one call per
        storage server; returns how many prefixes that covered."""
        return self.prefix_leases.renew(prefixes)

    def end(self, prefixes: Iterable[str]) -> int:
        """The job is done with ``prefixes`` (its readers consumed their data): every server
        frees them now, with the declared prefixes below them in the path, instead of a lease
        after their last renewal, and their DRAM grants go back to the controller at once
        (waiting declarations first). Keepers stop renewing them; declare them again to reuse
        them. Returns the bytes the servers freed."""
        ended, freed = self.prefix_leases.end(prefixes)
        with self._lock:
            granted = [p for p in ended if p in self._granted]
            self._granted.difference_update(granted)
        # After the servers freed the data, so the DRAM given back is really free.
        for i in range(0, len(granted), LEASE_PREFIXES_MAX):
            self._control.end_prefixes(self.job_id, granted[i:i + LEASE_PREFIXES_MAX])
        return freed

    def keep(self, prefixes: Iterable[str]) -> PrefixKeeper:
        """Renew ``prefixes`` every third of the lease on a thread until the keeper is closed
        (use it as a context manager; :meth:`PrefixKeeper.release` drops one prefix)."""
        return PrefixKeeper(self.prefix_leases, prefixes)

    def status(self) -> dict[str, Any]:
        """The cluster's status (servers, tiers, jobs) as the controller reports it."""
        return self._control.status()

    def deregister(self) -> dict[str, Any] | None:
        """Deregister the job and free its non-PERSIST data; a second call does nothing.

        Returns what was freed (``{"deleted", "freed_bytes", ...}``), or ``None`` if the job was
        already deregistered through this object. If the control plane call fails, the job
        counts as still registered, so that calling again retries it.
        """
        with self._lock:
            if self._deregistered:
                return None
            self._deregistered = True
        self._lease_stop.set()
        with self._lock:
            clients = list(self._clients)
        for client in clients:
            client.close()
        try:
            return self._control.deregister(self._handle.job_id)
        except BaseException:
            with self._lock:
                self._deregistered = False
            raise

    def __enter__(self) -> Job:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.deregister()
            return
        # Keep the block's own exception; a failing deregistration is only logged.
        try:
            self.deregister()
        except Exception as dereg_exc:
            log.warning("deregistering job %s failed: %s", self.job_id, dereg_exc)

    def __repr__(self) -> str:
        state = "deregistered" if self._deregistered else "registered"
        return f"<Job {self.job_id} epoch={self._handle.epoch} {state}>"


def register_job(
    name: str,
    hints: Hints | Mapping[str, Any] | None = None,
    *,
    cluster: ControlPlane | HasControlPlane | None = None,
    lease_ms: int | None = LEASE_MS_DEFAULT,
    prefix_lease_ms: int = PREFIX_LEASE_MS_DEFAULT,
) -> Job:
    """Register a job and return it; use the result as a context manager.

    The control plane is, in order: ``cluster`` (a :class:`~pocketflow.LocalCluster` or a
    :class:`~pocketflow.control.plane.ControlPlane`), the :class:`~pocketflow.LocalCluster` running
    in this process, or the pocketflow controller of the Ray cluster at ``$RAY_ADDRESS`` (default
    ``"auto"``, e.g. one started by ``pocketflow up --local``).

    The job's lease starts with its registration, and while the job is registered a background
    thread of this process renews it with the controller every ``lease_ms / 3`` (with backoff
    while the controller does not answer, for as long as the job lives); if this process dies,
    the lease runs out and the controller deregisters the job (freeing its non-PERSIST data)
    within about ``lease_ms`` plus one monitor pass. ``lease_ms=None`` takes no lease: the job
    then lives until it is deregistered. A registration that fails because the controller is
    restarting is retried (``REGISTER_RETRY_S``) under the same request id, so it registers one
    job, never two.
    ``prefix_lease_ms`` is the lease of the prefixes the job declares (:meth:`Job.declare`).
    """
    coerced = Hints.coerce(hints)
    if lease_ms is not None:
        check_lease_ms(lease_ms)  # before registering: a refused lease leaves no job behind
    check_prefix_lease_ms(prefix_lease_ms)
    control = _resolve_control_plane(cluster)
    handle = _register(control, name, coerced, lease_ms=lease_ms)
    return Job(handle, control, lease_ms=lease_ms, prefix_lease_ms=prefix_lease_ms)


def _register(
    control: ControlPlane, name: str, hints: Hints, *, lease_ms: int | None
) -> JobHandle:
    """Register with a request id of its own, retried while the controller does not answer
    (``ClusterError``: it crashed and Ray restarts it) for ``REGISTER_RETRY_S``: a restarted
    controller that took the job back from its log answers the retry with that job instead of
    registering another, and one whose log never got it registers it now. The job's lease is
    given with the registration, so a job whose driver never learnt of it ends with its lease.
    """
    request_id = uuid.uuid4().hex
    deadline_s = time.monotonic() + REGISTER_RETRY_S
    pause_s = RENEW_RETRY_FIRST_S
    while True:
        try:
            return control.register(name, hints, request_id=request_id, lease_ms=lease_ms)
        except ClusterError as exc:
            if time.monotonic() + pause_s > deadline_s:
                raise
            log.warning("registering job %s failed (%s); trying again", name, exc)
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, REGISTER_RETRY_PAUSE_MAX_S)


def _declared_size(prefix: str, size: int | str | None) -> int | None:
    """``size`` with a size like ``"64MiB"`` in bytes (``InvalidRequest`` if it is not one);
    any other value as given: the controller checks it (``Controller.declare_prefixes``)."""
    if not isinstance(size, str):
        return size
    try:
        return parse_size(size, name=f"size_bytes of {prefix!r}")
    except ConfigError as exc:
        raise InvalidRequest(str(exc)) from None


def token_half_gone(token: str, *, received_unix_ms: int, now_unix_ms: int) -> bool:
    """Whether half of the life ``token`` had when it was received is gone (time to renew it)."""
    expiry_ms = token_expiry_unix_ms(token)
    return now_unix_ms >= expiry_ms - (expiry_ms - received_unix_ms) / 2


def _renew_lease(
    control: ControlPlane, job_id: str, lease_ms: int, stop: threading.Event,
    renew_token: Callable[[], None],
) -> None:
    """Renew a job's lease every third of ``lease_ms`` until ``stop`` is set or the job is gone
    (``JobNotRegistered``), and after each renewal ``renew_token`` (which renews the job's token
    when half of its life is gone).

    Each renewal is one bounded controller call. A failed one (the controller restarts, or its
    restore waits for the ``Metadata`` actor) is retried after ``RENEW_RETRY_FIRST_S``, then
    twice as long each time, at most a third of the lease or ``RENEW_BACKOFF_MAX_S`` whichever is
    longer, for as long as the job lives: a restarted controller gives the job's lease back for
    at least ``RESTORED_LEASE_GRACE_S``, longer than any of these pauses, so the first renewal
    that reaches it keeps the job.
    """
    period_s = lease_ms / 3000.0
    pause_max_s = max(period_s, RENEW_BACKOFF_MAX_S)
    failing_since_s: float | None = None
    logged_s = 0.0
    pause_s = period_s
    while not stop.is_set():
        try:
            control.renew_lease(job_id, lease_ms)
            renew_token()
        except JobNotRegistered:
            return
        except Exception as exc:
            now_s = time.monotonic()
            if failing_since_s is None:
                failing_since_s = now_s
                pause_s = min(RENEW_RETRY_FIRST_S, period_s)
            else:
                pause_s = min(pause_s * 2, pause_max_s)
            if now_s - logged_s >= RENEW_FAILURE_LOG_INTERVAL_S:
                logged_s = now_s
                log.warning("renewing the lease of job %s failed for %.1f s (%s); trying again",
                            job_id, now_s - failing_since_s, exc)
        else:
            if failing_since_s is not None:
                log.warning("job %s: its lease is renewed again after %.1f s", job_id,
                            time.monotonic() - failing_since_s)
            failing_since_s = None
            pause_s = period_s
        stop.wait(pause_s)


def _resolve_control_plane(cluster: Any) -> ControlPlane:
    if isinstance(cluster, ControlPlane):
        return cluster
    if cluster is not None:
        return cluster.control
    current = last_started()
    if current is not None:
        return current.control
    return connect_control_plane()
