"""A prewarm's fetching: the planned keys in batches, claimed a window ahead, fetched by
``PREWARM_PROCESSES`` worker processes, each ``PREWARM_STREAMS`` batches at a time.

Why processes: a prewarm of many small objects is bound by one process's Python (the S3
answers' parsing and the four records of each fill), while the run's first tasks sit parked
waiting for it; the quiet benchmark's prewarm fetched 766 objects/s in the driver, where two
task processes filling the same keys reached 1,115/s. Worker ``w`` of ``n`` fetches batches
``w, w + n, ...`` of the plan, so that the workers together still go through it in order.

A worker is ``python -m pocketflow.cache.prewarm``: it reads one JSON document on stdin (the
cache's spec and its batches), claims its first window, says ``started`` on stdout, then one
line per batch fetched, and ``end`` with its stats and S3 request counts once its fills are
written to the cache; it then stays while its last fills' claims and outcomes linger
(``DONE_LINGER_S``, see ``linger_claims`` of :class:`CacheClient`) and removes them. SIGTERM
stops it after the batches in flight; a worker that dies leaves its claims to lapse within
``claim_ms``, and the tasks waiting on them take them over.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from pocketflow.cache.working_set import KeyUse, PackEntry, PackRef
from pocketflow.errors import PocketflowError

__all__ = ["PREWARM_PROCESSES", "PREWARM_STREAMS", "PREWARM_S3_PARALLEL",
           "PREWARM_BATCH_KEYS", "PREWARM_BATCH_BYTES", "PREWARM_CLAIM_AHEAD_KEYS",
           "PREWARM_CLAIM_AHEAD_BYTES", "WORKER_START_TIMEOUT_S", "WORKER_STOP_TIMEOUT_S",
           "batches_of", "fetch_batches", "Workers"]

log = logging.getLogger(__name__)

PREWARM_PROCESSES = 2
"""Worker processes of one prewarm (the machine's cores in the benchmark)."""
PREWARM_BATCH_KEYS = 256
"""Most keys a prewarm fetches at once (a task waiting on one waits for its batch)."""
PREWARM_BATCH_BYTES = 16 * 1024 * 1024
"""Most bytes of one prewarm batch (a batch holds at least one key)."""
PREWARM_STREAMS = 2
"""Batches one worker has in flight at once (their S3 requests share its
``PREWARM_S3_PARALLEL`` connections; a batch's entries are written by its client's publisher
thread while the next batches download)."""
PREWARM_S3_PARALLEL = 32
"""S3 requests one worker has in flight (the S3 source's default connection pool)."""
PREWARM_CLAIM_AHEAD_KEYS = 4096
"""Keys a worker claims ahead of its fetches (:meth:`CacheClient.claim_ahead`): a task asking
for one waits for the prewarm's fill instead of fetching it too. Claimed when the window
reaches them, so they are fetched well within a claim's time (``claim_ms``) at the prewarm's
rate; one that lapses first is taken over by a waiter."""
PREWARM_CLAIM_AHEAD_BYTES = 256 * 1024 * 1024
"""... and at most this many bytes of them."""
WORKER_START_TIMEOUT_S = 30.0
"""How long the driver waits for a worker to claim its first window (then goes on without
waiting: the worker's claims come when they come)."""
WORKER_STOP_TIMEOUT_S = 10.0
"""How long a stopped worker has to write its fills and end before it is killed."""
LINGER_CHECK_S = 0.5
"""How often a worker that has fetched everything removes the outcomes whose linger is over."""
WORKER_LINE_MAX_BYTES = 1024 * 1024
"""Longest line a worker writes (its end line carries its stats)."""


def batches_of(plan: list[KeyUse]) -> list[list[KeyUse]]:
    """``plan`` cut in order into batches of at most ``PREWARM_BATCH_KEYS`` keys and
    ``PREWARM_BATCH_BYTES``."""
    batches: list[list[KeyUse]] = []
    current: list[KeyUse] = []
    used = 0
    for use in plan:
        if current and (len(current) >= PREWARM_BATCH_KEYS
                        or used + use.size > PREWARM_BATCH_BYTES):
            batches.append(current)
            current, used = [], 0
        current.append(use)
        used += use.size
    if current:
        batches.append(current)
    return batches


def _by_bucket(uses: list[KeyUse]) -> dict[str, list[str]]:
    """The keys of ``uses`` by S3 bucket, in order."""
    out: dict[str, list[str]] = {}
    for use in uses:
        out.setdefault(use.bucket, []).append(use.key)
    return out


def _from_pack(client: Any, pack: PackRef, bucket: str, keys: list[str],
               ) -> tuple[dict[str, Any], int]:
    """The bytes of those of ``keys`` that ``pack`` holds and S3 still holds at the packed
    version, with the time their validation (a listing or a few) was first sent
    (:mod:`.pack`): ``({key: Fetched}, sent_ms)``; none if a listing or the pack's GETs
    failed, with any error (a pack is an optimisation: whatever goes wrong reading it, the
    keys are fetched on their own)."""
    from pocketflow.cache.pack import listed_versions, read_packed
    from pocketflow.cache.source import Fetched

    held = {(e.bucket, e.key): e for e in pack.entries}
    packed = [held[(bucket, k)] for k in keys if (bucket, k) in held]
    if not packed:
        return {}, 0
    store = client.source_store
    sent_ms = int(time.time() * 1000)
    try:
        listed = listed_versions(store, bucket, [e.key for e in packed])
        datas = read_packed(store, pack.bucket, pack.key, packed)
    except Exception as exc:
        log.warning("prewarming %d keys from the pack failed, fetching them one by one: "
                    "%s: %s", len(packed), type(exc).__name__, exc)
        return {}, 0
    known = {e.key: Fetched(e.etag, e.size, datas[e.key]) for e in packed
             if e.key in datas and listed.get(e.key) == (e.etag, e.size)}
    return known, sent_ms


def fetch_batches(client: Any, batches: list[list[KeyUse]], *, stop: threading.Event,
                  on_batch: Callable[[int], None], on_claimed: Callable[[], None],
                  pack: PackRef | None = None) -> None:
    """Fetch ``batches`` in order through ``client`` (a :class:`CacheClient`),
    ``PREWARM_STREAMS`` at a time, with the next ``PREWARM_CLAIM_AHEAD_KEYS`` claimed ahead;
    ``on_claimed`` runs once the first window is claimed, ``on_batch(keys)`` after each batch.
    A batch's keys that ``pack`` holds are taken from it (validated by a listing) instead of
    one GET each. Returns when every batch is fetched and written to the cache, or ``stop`` is
    set and the batches in flight are."""
    lock = threading.Lock()
    next_batch = iter(enumerate(batches))
    claimed_upto = [0]  # batches [0, claimed_upto) are claimed (or being fetched)

    def claim_window(unstarted: int) -> None:
        """Claim batches from ``claimed_upto`` while the claimed, unstarted ones (from
        ``unstarted`` on) are within the window."""
        with lock:
            ahead = batches[unstarted:claimed_upto[0]]
            keys = sum(len(b) for b in ahead)
            held = sum(u.size for b in ahead for u in b)
            new: list[KeyUse] = []
            while (claimed_upto[0] < len(batches) and keys < PREWARM_CLAIM_AHEAD_KEYS
                   and held < PREWARM_CLAIM_AHEAD_BYTES):
                batch = batches[claimed_upto[0]]
                claimed_upto[0] += 1
                new += batch
                keys += len(batch)
                held += sum(u.size for u in batch)
        for bucket, bucket_keys in _by_bucket(new).items():
            client.claim_ahead(bucket, bucket_keys)

    claim_window(0)
    on_claimed()

    def stream() -> None:
        while not stop.is_set():
            with lock:
                item = next(next_batch, None)
            if item is None:
                return
            index, batch = item
            claim_window(index + 1)
            for bucket, keys in _by_bucket(batch).items():
                # Any error ends this batch's keys, not the stream: a stream that ended would
                # leave the batches it had claimed ahead claimed (renewed while the worker
                # lives), and its readers waiting on them. A prefetch that fails releases its
                # keys' claims held ahead.
                try:
                    known, known_ms = (_from_pack(client, pack, bucket, keys)
                                       if pack is not None else ({}, 0))
                    client.prefetch(bucket, keys, known=known, known_ms=known_ms)
                except PocketflowError as exc:
                    log.warning("prewarming %d keys failed: %s", len(keys), exc)
                except Exception:
                    log.exception("prewarming %d keys failed", len(keys))
            on_batch(len(batch))

    threads = [threading.Thread(target=stream, name=f"pocketflow-prewarm-{i}", daemon=True)
               for i in range(PREWARM_STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    client.flush()  # prewarmed means written to the cache, not only fetched


class Workers:
    """The driver's side of a prewarm's worker processes (it started them: it ends them, by
    their pids). ``fetched`` counts the keys they fetched; ``done`` is set once every worker
    ended; ``stats`` and ``requests`` sum what the workers reported at their end, ``cpu_ms``
    their CPU time (user and system, from their start to their end line), ``cpu_system_ms``
    the part of it spent in the kernel (a fetch's receive from S3 and send into the cache) and
    ``start_cpu_ms`` the part spent before they fetched (the interpreter, imports, connecting,
    the first window's claims), so that a benchmark tells a prewarm's CPU per object from its
    start."""

    def __init__(self, spec_json: str, batches: list[list[KeyUse]], *,
                 processes: int = PREWARM_PROCESSES,
                 on_requests: Callable[[dict[str, int]], None] | None = None,
                 pack: PackRef | None = None) -> None:
        self._lock = threading.Lock()
        self.fetched = 0
        self.stats: dict[str, int] = {}
        self.requests: dict[str, int] = {}
        self.cpu_ms = 0
        self.cpu_system_ms = 0
        self.start_cpu_ms = 0
        self.done = threading.Event()
        self._on_requests = on_requests
        shares = [batches[w::processes] for w in range(processes)]
        shares = [share for share in shares if share]
        self._procs: list[subprocess.Popen[str]] = []
        self._started: list[threading.Event] = []
        self._readers: list[threading.Thread] = []
        self._left = len(shares)
        if not shares:
            self.done.set()
            return
        for share in shares:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pocketflow.cache.prewarm"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True, env=_worker_env())
            started = threading.Event()
            self._procs.append(proc)
            self._started.append(started)
            reader = threading.Thread(target=self._read, args=(proc, started), daemon=True,
                                      name=f"pocketflow-prewarm-reader-{proc.pid}")
            self._readers.append(reader)
            reader.start()
            assert proc.stdin is not None
            order: dict[str, Any] = {"spec": spec_json, "batches": share}
            if pack is not None:
                mine = {(u.bucket, u.key) for batch in share for u in batch}
                order["pack"] = {"bucket": pack.bucket, "key": pack.key,
                                 "entries": [list(e) for e in pack.entries
                                             if (e.bucket, e.key) in mine]}
            try:
                proc.stdin.write(json.dumps(order))
                proc.stdin.close()
            except OSError as exc:  # the worker died at once; its reader sees it end
                log.warning("prewarm worker %d did not take its batches: %s", proc.pid, exc)

    def wait_started(self, timeout_s: float) -> bool:
        """Wait until every worker claimed its first window (or ended); whether they did
        within ``timeout_s``."""
        return all(started.wait(timeout_s) for started in self._started)

    def _read(self, proc: subprocess.Popen[str], started: threading.Event) -> None:
        assert proc.stdout is not None
        ended = False
        try:
            for line in iter(lambda: proc.stdout.readline(WORKER_LINE_MAX_BYTES), ""):
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                if message.get("started"):
                    started.set()
                elif "fetched" in message:
                    with self._lock:
                        self.fetched += int(message["fetched"])
                elif message.get("end") and not ended:
                    ended = True
                    self._add(message.get("stats") or {}, message.get("requests") or {},
                              cpu_ms=int(message.get("cpu_ms") or 0),
                              cpu_system_ms=int(message.get("cpu_system_ms") or 0),
                              start_cpu_ms=int(message.get("start_cpu_ms") or 0))
                    self._one_ended()
        finally:
            started.set()
            proc.wait()
            if not ended:
                log.warning("prewarm worker %d ended (exit %s) without its end report",
                            proc.pid, proc.returncode)
                self._one_ended()

    def _one_ended(self) -> None:
        """A worker has fetched all it will (it may still linger to remove its outcomes)."""
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.done.set()

    def _add(self, stats: dict[str, int], requests: dict[str, int], *, cpu_ms: int,
             cpu_system_ms: int, start_cpu_ms: int) -> None:
        with self._lock:
            self.cpu_ms += cpu_ms
            self.cpu_system_ms += cpu_system_ms
            self.start_cpu_ms += start_cpu_ms
            for name, value in stats.items():
                self.stats[name] = self.stats.get(name, 0) + int(value)
            for name, value in requests.items():
                self.requests[name] = self.requests.get(name, 0) + int(value)
        if self._on_requests is not None:
            self._on_requests(requests)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def stop(self) -> None:
        """Ask every worker still running to stop after its batches in flight (SIGTERM), kill
        those that have not ended within ``WORKER_STOP_TIMEOUT_S``, and wait for them."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self._procs:
            try:
                proc.wait(WORKER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("prewarm worker %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()
        for reader in self._readers:
            reader.join(WORKER_STOP_TIMEOUT_S)


def _worker_env() -> dict[str, str]:
    """This process's environment, with the directory this ``pocketflow`` was imported from
    first on ``PYTHONPATH``, so that a worker runs the same code."""
    import pocketflow

    root = os.path.dirname(os.path.dirname(os.path.abspath(pocketflow.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _cpu_ms(times: os.times_result) -> int:
    """This process's CPU time so far, user and system, in ms."""
    return round(1000 * (times.user + times.system))


def main() -> int:
    """A worker: fetch the batches given on stdin through the cache of the given spec."""
    from pocketflow.cache.client import CacheClient
    from pocketflow.cache.source import request_counts
    from pocketflow.cache.spec import CacheSpec

    order = json.loads(sys.stdin.read())
    spec = CacheSpec.from_json(order["spec"])
    batches = [[KeyUse(str(b), str(k), int(n), int(r)) for b, k, n, r in batch]
               for batch in order["batches"]]
    pack = None
    if order.get("pack"):
        pack = PackRef(str(order["pack"]["bucket"]), str(order["pack"]["key"]),
                       tuple(PackEntry(str(b), str(k), str(e), int(o), int(n))
                             for b, k, e, o, n in order["pack"]["entries"]))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # Its fills are logged (the driver's maintainer counts the bytes), its reads are not the
    # run's working set.
    client = CacheClient(spec, record_reads=False, s3_parallel=PREWARM_S3_PARALLEL,
                         linger_claims=True)
    start_cpu_ms = [0]

    def started() -> None:
        start_cpu_ms[0] = _cpu_ms(os.times())
        _say({"started": True})

    try:
        fetch_batches(client, batches, stop=stop, on_batch=lambda n: _say({"fetched": n}),
                      on_claimed=started, pack=pack)
        times = os.times()
        _say({"end": True, "stats": client.stats.to_dict(), "requests": request_counts(),
              "cpu_ms": _cpu_ms(times), "cpu_system_ms": round(1000 * times.system),
              "start_cpu_ms": start_cpu_ms[0]})
        # The last fills' claims and outcomes stay their linger (readers that just missed a
        # fill find them), unless the driver stops the worker first.
        while client.outcomes_pending and not stop.wait(LINGER_CHECK_S):
            client.flush()
    finally:
        client.close()  # writes its fills, removes its claims and outcomes
    return 0


if __name__ == "__main__":
    sys.exit(main())
