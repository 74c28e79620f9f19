"""Prefix leases (Jiffy): a job scopes its data to the prefixes of its DAG, each with a lease.

A job declares prefixes such as ``map``, ``map/7`` and ``reduce/3`` with the prefixes they
depend on (``job.declare("reduce/3", parents=["map/7"])``). A prefix covers every key that
starts with ``<prefix>/`` in every bucket of the job, with its queues and append files. Renewing
a prefix renews its *ancestors* (its declared parents and the declared prefixes above it in the
path, transitively) and its *descendants* (the prefixes that name it as a parent and the
declared prefixes below it in the path, transitively): a running task keeps its inputs and its
consumers' data alive. A prefix whose lease lapses is freed by every storage server on its own
(each server holds the job's lease table and sweeps it every 50 ms), so its capacity is
reusable at once, without a control-plane round trip.

Renewals are batched: :meth:`PrefixLeases.renew` expands the prefixes it is given to their
closure and sends the whole set to each server of the job in one ``renew_leases`` action per
server (in parallel), so a driver renews any number of prefixes with one call per server per
period; tasks never renew through Ray. :class:`PrefixKeeper` does it every third of the lease on
a thread of its own. Each server is renewed on its own deadline, well inside the lease, and one
whose renewal failed is tried again at once with a short jittered backoff: a server that hangs
cannot keep the others from being renewed, so they never free a live job's prefixes.

:class:`PrefixDag` is the pure part (no I/O), so the closure rule is tested alone.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from pocketflow.errors import (
    ConfigError,
    InvalidRequest,
    JobNotRegistered,
    LeaseTableFull,
    PocketflowError,
    StaleEpoch,
)
from pocketflow.layout import STALE_EPOCH_RETRIES_MAX
from pocketflow.protocol import (
    ACTION_END_LEASES,
    ACTION_RENEW_LEASES,
    KEY_MAX_BYTES,
    LEASE_MS_MAX,
    LEASE_MS_MIN,
    LEASE_PREFIXES_MAX,
    action_body,
)
from pocketflow.retry import backoff_s

if TYPE_CHECKING:
    from pocketflow.client import Client

__all__ = ["PrefixDag", "PrefixLeases", "PrefixKeeper", "PREFIX_LEASE_MS_DEFAULT",
           "PREFIX_WAIT_S_DEFAULT", "PREFIXES_MAX"]

log = logging.getLogger(__name__)

PREFIX_LEASE_MS_DEFAULT = 1000
"""Lease of a prefix unless the job says otherwise (Jiffy used 1 s)."""
PREFIX_WAIT_S_DEFAULT = 5.0
"""How long a sized declaration waits for DRAM before it spills (``Job.declare``)."""
PREFIXES_MAX = 65_536
"""Most prefixes one job declares."""
PARENTS_MAX = 1024
"""Most parents one prefix declares."""
KEEPER_THREADS_MAX = 16
"""Most renewals one keeper has in flight at once (one per server)."""
RENEW_DEADLINE_DIVISOR = 3
"""A keeper's renewal to one server must answer within this fraction of the lease: a server
that does not is tried again while the lease it renewed last still holds."""
RENEW_RETRY_BASE_S = 0.02
"""First backoff after a failed renewal (it doubles up to a third of the lease, jittered)."""


def check_prefix(prefix: str) -> str:
    """``prefix`` if it is a usable lease prefix, else :class:`InvalidRequest`."""
    if not isinstance(prefix, str) or not prefix:
        raise InvalidRequest(f"a prefix is a non-empty str, got {prefix!r}")
    if prefix.startswith("/") or prefix.endswith("/") or "//" in prefix:
        raise InvalidRequest(f"a prefix is a path like 'map/7', without empty parts: {prefix!r}")
    if len(prefix.encode()) >= KEY_MAX_BYTES:
        raise InvalidRequest(f"a prefix is shorter than {KEY_MAX_BYTES} bytes")
    return prefix


def check_prefix_lease_ms(lease_ms: int) -> int:
    """``lease_ms`` if the servers accept it, else :class:`ConfigError`."""
    if isinstance(lease_ms, bool) or not isinstance(lease_ms, int) or not (
        LEASE_MS_MIN <= lease_ms <= LEASE_MS_MAX
    ):
        raise ConfigError(f"prefix lease_ms must be an int in {LEASE_MS_MIN}..{LEASE_MS_MAX}")
    return lease_ms


class PrefixDag:
    """A job's declared prefixes and their parents; computes what a renewal covers."""

    def __init__(self) -> None:
        self._parents: dict[str, tuple[str, ...]] = {}
        self._children: dict[str, set[str]] = {}
        # The declared prefixes in order: those below ``p`` in the path are one range of it
        # (``p + "/"`` up to ``p + "0"``, "0" being the byte after "/"), found by bisection, so
        # a renewal of a prefix with many below it costs no scan of every prefix per prefix.
        self._sorted: list[str] = []

    def __contains__(self, prefix: object) -> bool:
        return prefix in self._parents

    def __len__(self) -> int:
        return len(self._parents)

    def copy(self) -> PrefixDag:
        """An independent copy (to try declarations on)."""
        dag = PrefixDag()
        dag._parents = dict(self._parents)
        dag._children = {p: set(c) for p, c in self._children.items()}
        dag._sorted = list(self._sorted)
        return dag

    def declare(self, prefix: str, parents: Iterable[str] = ()) -> None:
        """Add ``prefix`` with ``parents`` (declared before it). Declaring a prefix again adds
        parents to it."""
        check_prefix(prefix)
        parents = tuple(parents)
        if len(parents) > PARENTS_MAX:
            raise InvalidRequest(f"at most {PARENTS_MAX} parents per prefix")
        for parent in parents:
            check_prefix(parent)
            if parent not in self._parents:
                raise InvalidRequest(f"parent {parent!r} of {prefix!r} was not declared")
            if parent == prefix or prefix in self.ancestors([parent]):
                raise InvalidRequest(f"{parent!r} as a parent of {prefix!r} makes a cycle")
        if prefix not in self._parents and len(self._parents) >= PREFIXES_MAX:
            raise InvalidRequest(f"a job declares at most {PREFIXES_MAX} prefixes")
        known = self._parents.get(prefix)
        if known is None:
            bisect.insort(self._sorted, prefix)
            known = ()
        self._parents[prefix] = known + tuple(p for p in parents if p not in known)
        for parent in parents:
            self._children.setdefault(parent, set()).add(prefix)

    def remove(self, prefixes: Iterable[str]) -> list[str]:
        """Forget the declared ``prefixes`` and the declared prefixes below them in the path
        (ended: their data is freed); returns what was forgotten, sorted. Children that named
        one as a parent keep their other parents. They can be declared again."""
        named = [p for p in prefixes if p in self._parents]
        gone = set(named) | {p for n in named for p in self._below(n)}
        if gone:
            self._sorted = [p for p in self._sorted if p not in gone]
        for prefix in gone:
            for parent in self._parents.pop(prefix):
                children = self._children.get(parent)
                if children is not None:
                    children.discard(prefix)
            for child in self._children.pop(prefix, set()):
                if child in self._parents:
                    self._parents[child] = tuple(p for p in self._parents[child] if p != prefix)
        return sorted(gone)

    def _up(self, prefix: str) -> list[str]:
        """Direct ancestors: declared parents and the nearest declared path prefix."""
        up = list(self._parents.get(prefix, ()))
        parts = prefix.split("/")
        for cut in range(len(parts) - 1, 0, -1):
            above = "/".join(parts[:cut])
            if above in self._parents:
                up.append(above)
                break
        return up

    def _below(self, prefix: str) -> list[str]:
        """The declared prefixes below ``prefix`` in the path, in order."""
        start = bisect.bisect_left(self._sorted, prefix + "/")
        return self._sorted[start:bisect.bisect_left(self._sorted, prefix + "0", lo=start)]

    def _down(self, prefix: str) -> list[str]:
        """Direct descendants: declared children and declared prefixes below it in the path."""
        return sorted(self._children.get(prefix, set())) + self._below(prefix)

    def _walk(self, start: Iterable[str], step) -> set[str]:
        seen: set[str] = set()
        todo = [p for p in start if p in self._parents]
        while todo:
            prefix = todo.pop()
            if prefix in seen:
                continue
            seen.add(prefix)
            todo.extend(p for p in step(prefix) if p in self._parents)
        return seen

    def ancestors(self, prefixes: Iterable[str]) -> set[str]:
        """``prefixes`` (the declared ones) and everything above them."""
        return self._walk(prefixes, self._up)

    def descendants(self, prefixes: Iterable[str]) -> set[str]:
        """``prefixes`` (the declared ones) and everything below them."""
        return self._walk(prefixes, self._down)

    def closure(self, prefixes: Iterable[str]) -> set[str]:
        """What renewing ``prefixes`` renews: each one, its ancestors and its descendants."""
        prefixes = list(prefixes)
        unknown = [p for p in prefixes if p not in self._parents]
        if unknown:
            raise InvalidRequest(f"prefix {unknown[0]!r} was not declared")
        return self.ancestors(prefixes) | self.descendants(prefixes)


class PrefixLeases:
    """A job's prefix leases on its storage servers, renewed through one client."""

    def __init__(
        self,
        client: Client,
        *,
        lease_ms: int = PREFIX_LEASE_MS_DEFAULT,
        on_renew: Callable[[list[str]], None] | None = None,
    ) -> None:
        self._client = client
        self.lease_ms = check_prefix_lease_ms(lease_ms)
        self.dag = PrefixDag()
        self._lock = threading.Lock()
        self._on_renew = on_renew

    @property
    def closed(self) -> bool:
        """Whether the client the leases are renewed through was closed."""
        return self._client.closed

    def declare(self, prefix: str, parents: Iterable[str] = ()) -> None:
        """Declare ``prefix`` and start its lease (and renew its closure) on every server."""
        self.declare_many([(prefix, parents)])

    def check_declarations(self, declarations: Iterable[tuple[str, Iterable[str]]]) -> None:
        """Raise what :meth:`declare_many` would for ``declarations``, declaring nothing."""
        with self._lock:
            trial = self.dag.copy()
        for prefix, parents in declarations:
            trial.declare(prefix, parents)

    def declare_many(self, declarations: Iterable[tuple[str, Iterable[str]]]) -> None:
        """Declare every ``(prefix, parents)`` in order and start their leases with one
        renewal (one ``renew_leases`` per server)."""
        declarations = [(p, tuple(parents)) for p, parents in declarations]
        if len(declarations) > 1:  # all or none (one declaration checks before it changes)
            self.check_declarations(declarations)
        with self._lock:
            for prefix, parents in declarations:
                self.dag.declare(prefix, parents)
        self.renew([p for p, _ in declarations])

    def renew(self, prefixes: Iterable[str]) -> int:
        """Renew ``prefixes`` with their ancestors and descendants on every server of the job:
        one ``renew_leases`` action per server (per ``LEASE_PREFIXES_MAX`` prefixes), all
        servers at once, each within one lease (a renewal later than that is too late to keep
        anything). Returns how many prefixes were renewed; raises if no server could be."""
        with self._lock:
            covered = sorted(self.dag.closure(prefixes))
        if not covered:
            return 0
        try:
            outcomes = self._renew_everywhere(covered, deadline_s=self.lease_ms / 1000)
        finally:
            if self._on_renew is not None:
                self._on_renew(covered)
        failed = [e for e in outcomes.values() if e is not None]
        if failed and len(failed) == len(outcomes):
            raise failed[0]
        for error in failed:
            log.warning("renewing prefix leases on %s failed: %s", error.server, error)
        return len(covered)

    def renew_on(self, address: str, covered: list[str], *, deadline_s: float) -> None:
        """Renew the prefixes ``covered`` (a closure) on the server at ``address``, each action
        within ``deadline_s``. A newer map a server answers with is adopted, and the renewal
        sent again if the server is still in it. Raises what the server answered."""
        client = self._client
        for attempt in range(STALE_EPOCH_RETRIES_MAX + 1):
            view = client._view
            if address not in {s.address for s in view.handle.servers}:
                return
            try:
                # A full lease table refuses only the new prefixes of a chunk (its leases were
                # renewed): the later chunks are renewed all the same, then the refusal raised.
                refused: LeaseTableFull | None = None
                for i in range(0, len(covered), LEASE_PREFIXES_MAX):
                    try:
                        client._connection(address).action(
                            ACTION_RENEW_LEASES,
                            action_body(view.ctx, prefixes=covered[i:i + LEASE_PREFIXES_MAX],
                                        lease_ms=self.lease_ms),
                            timeout_s=deadline_s)
                    except LeaseTableFull as full:
                        refused = refused or full
                if refused is not None:
                    raise refused
                return
            except StaleEpoch as stale:
                if attempt == STALE_EPOCH_RETRIES_MAX:
                    raise
                client._adopt(stale)
        raise AssertionError("unreachable")

    def _renew_everywhere(
        self, covered: list[str], *, deadline_s: float
    ) -> dict[str, PocketflowError | None]:
        """Renew ``covered`` on every server of the map at once, each on its own deadline, and
        on the servers of a newer map adopted meanwhile; per address, ``None`` or its error."""
        outcomes: dict[str, PocketflowError | None] = {}
        for _ in range(STALE_EPOCH_RETRIES_MAX + 1):
            addresses = sorted({s.address for s in self._client._view.handle.servers}
                               - outcomes.keys())
            if not addresses:
                break

            def renew_one(address: str) -> PocketflowError | None:
                try:
                    self.renew_on(address, covered, deadline_s=deadline_s)
                except PocketflowError as exc:
                    return exc
                return None

            results = self._client._parallel([lambda a=a: renew_one(a) for a in addresses])
            outcomes.update(zip(addresses, results, strict=True))
        return outcomes

    def end(self, prefixes: Iterable[str]) -> tuple[list[str], int]:
        """End declared ``prefixes`` now, with the declared prefixes below them in the path: the
        job is done with their data. Every server frees them at once (one ``end_leases`` per
        server), not a lease later, and they are no longer renewed (declare them again to reuse
        them). Returns the prefixes ended and the bytes the servers freed."""
        prefixes = list(prefixes)
        for prefix in prefixes:
            check_prefix(prefix)
        with self._lock:
            ended = self.dag.remove(prefixes)
        freed = 0
        errors: list[PocketflowError] = []
        for i in range(0, len(ended), LEASE_PREFIXES_MAX):
            results = self._client._on_every_server(
                ACTION_END_LEASES, prefixes=ended[i:i + LEASE_PREFIXES_MAX])
            failed = [r for r in results if isinstance(r, PocketflowError)]
            if failed and len(failed) == len(results):
                raise failed[0]
            errors += failed
            freed += sum(int(r.get("freed_bytes", 0)) for r in results if isinstance(r, dict))
        for error in errors:  # a dead server's data is gone with it
            log.warning("ending prefix leases on %s failed: %s", error.server, error)
        return ended, freed


class _ServerRenewal:
    """One server's part of a keeper: whether a renewal to it is in flight, when the next is
    due, and how many in a row failed."""

    __slots__ = ("in_flight", "due", "failures", "last_error")

    def __init__(self) -> None:
        self.in_flight = False
        self.due = 0.0
        self.failures = 0
        self.last_error: PocketflowError | None = None


class PrefixKeeper:
    """Renews a set of prefixes every third of the lease on a thread, until closed; drop a
    prefix with :meth:`release` and it lapses one lease later.

    Each server is renewed on its own (every server of the job's current map, on a pool of at
    most ``KEEPER_THREADS_MAX`` threads), each call within ``lease / RENEW_DEADLINE_DIVISOR``:
    a server that hangs holds up only its own renewal, never another server's, so the servers
    that answer keep the job's prefixes. A server whose renewal failed is tried again at once,
    with a jittered backoff well inside the lease (a renewal also declares again what a lapse
    freed), not a period later. The keeper stops when its job's client is closed (the job ended),
    or once every server of the map answers that the job is not registered.
    """

    def __init__(self, leases: PrefixLeases, prefixes: Iterable[str]) -> None:
        self._leases = leases
        self._prefixes = set(prefixes)
        leases.dag.closure(self._prefixes)  # every prefix declared
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._servers: dict[str, _ServerRenewal] = {}
        self._covered: list[str] = []
        self.renewals = 0
        self._pool = ThreadPoolExecutor(max_workers=KEEPER_THREADS_MAX,
                                        thread_name_prefix="pocketflow-prefix-renewal")
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="pocketflow-prefix-keeper")
        self._thread.start()

    @property
    def _period_s(self) -> float:
        return self._leases.lease_ms / 3000.0

    @property
    def _deadline_s(self) -> float:
        return self._leases.lease_ms / 1000.0 / RENEW_DEADLINE_DIVISOR

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        next_round = time.monotonic()
        while not self._stop.is_set():
            if self._leases.closed:
                # The job's client was closed (the job ended): nothing can be renewed any more.
                log.info("prefix keeper stops: the job's client is closed")
                return
            now = time.monotonic()
            with self._lock:
                if self._job_ended():
                    log.info("prefix keeper stops: the job is no longer registered")
                    return
                ended = {p for p in self._prefixes if p not in self._leases.dag}
                self._prefixes -= ended  # ended (PrefixLeases.end): nothing left to keep
                prefixes = set(self._prefixes)
            if now >= next_round:
                next_round = now + self._period_s
                if prefixes:
                    self._start_round(prefixes, now)
            self._send_due(now)
            with self._lock:
                retries = [s.due for s in self._servers.values()
                           if not s.in_flight and s.failures]
            wake_at = min([next_round, *retries])
            self._wake.wait(max(0.0, wake_at - time.monotonic()))
            self._wake.clear()

    def _job_ended(self) -> bool:
        """Whether every server of the map said the job is not registered here (under lock)."""
        states = [self._servers.get(a) for a in self._addresses()]
        return bool(states) and all(
            s is not None and isinstance(s.last_error, JobNotRegistered) for s in states)

    def _addresses(self) -> list[str]:
        return sorted({s.address for s in self._leases._client._view.handle.servers})

    def _start_round(self, prefixes: set[str], now: float) -> None:
        """A period began: every server of the current map is due (those with a renewal still
        in flight get theirs when it ends), with the closure as it is now."""
        try:
            covered = sorted(self._leases.dag.closure(prefixes))
        except InvalidRequest:
            return  # a prefix ended meanwhile; the next pass drops it
        addresses = self._addresses()
        with self._lock:
            self._covered = covered
            for address in addresses:
                self._servers.setdefault(address, _ServerRenewal()).due = now
            for address in [a for a, s in self._servers.items()
                            if a not in addresses and not s.in_flight]:
                del self._servers[address]  # left the map
        self.renewals += 1
        on_renew = self._leases._on_renew
        if on_renew is not None:
            try:
                on_renew(covered)
            except PocketflowError as exc:
                log.warning("renewing prefixes' grants failed: %s", exc)

    def _send_due(self, now: float) -> None:
        with self._lock:
            covered = self._covered
            due = [a for a, s in self._servers.items() if not s.in_flight and s.due <= now]
            for address in due:
                state = self._servers[address]
                state.in_flight = True
                state.due = float("inf")
        for address in due:
            try:
                self._pool.submit(self._renew_one, address, covered)
            except RuntimeError:  # the pool is shut down: the keeper is stopping
                return

    def _renew_one(self, address: str, covered: list[str]) -> None:
        error: PocketflowError | None = None
        try:
            self._leases.renew_on(address, covered, deadline_s=self._deadline_s)
        except PocketflowError as exc:
            error = exc
        with self._lock:
            state = self._servers.get(address)
            if state is None:
                return
            state.in_flight = False
            state.last_error = error
            recovered = error is None and state.failures > 0
            if error is None:
                state.failures = 0
                state.due = float("inf")  # until the next round
            else:
                state.due = time.monotonic() + backoff_s(
                    state.failures, base_s=RENEW_RETRY_BASE_S, cap_s=self._period_s)
                state.failures += 1
            failures = state.failures
        if self._leases.closed or self._stop.is_set():
            pass
        elif failures == 1:
            log.warning("renewing prefixes on %s failed (retrying): %s", address, error)
        elif recovered:
            log.info("renewing prefixes on %s works again", address)
        self._wake.set()

    @property
    def running(self) -> bool:
        """Whether the keeper still renews (not closed, and its job's client is open)."""
        return self._thread.is_alive()

    def add(self, prefix: str) -> None:
        """Keep ``prefix`` (declared) alive too."""
        self._leases.dag.closure([prefix])
        with self._lock:
            self._prefixes.add(prefix)

    def release(self, prefix: str) -> None:
        """Stop renewing ``prefix`` (it lapses unless another kept prefix covers it)."""
        with self._lock:
            self._prefixes.discard(prefix)

    def close(self) -> None:
        """Stop renewing; every kept prefix lapses one lease later."""
        self._stop.set()
        self._wake.set()
        self._thread.join(10.0)

    def __enter__(self) -> PrefixKeeper:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
