"""Force: run a thunk graph on an engine's workers, thunks as soon as their inputs exist,
reusing reductions already recorded, with DELETE and PERSIST chosen from the graph, and
optionally with the build's intermediate objects scoped to prefix leases."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pocketflow_gg.engines import Engine
from pocketflow_gg.errors import GGError, MissingObject, ThunkFailed
from pocketflow_gg.infer import BuildGraph
from pocketflow_gg.objects import is_thunk, size_of
from pocketflow_gg.scope import BuildScope, located
from pocketflow_gg.store import BLOBS, REDUCTIONS, Plan, Store, need, plan_key
from pocketflow_gg.thunk import Thunk

if TYPE_CHECKING:
    from pocketflow.job import Job

log = logging.getLogger(__name__)

THUNK_TIMEOUT_DEFAULT_S = 900.0
"""How long the driver waits for any one call to finish before giving up on the build."""
JOBS_MAX = 1024
UPLOAD_BATCH_MAX = 256
"""Most small objects the driver writes in one batch."""
UPLOAD_BATCH_BYTES_MAX = 8 << 20
"""Most bytes the driver writes in one batch; a larger object (an executable) is put alone."""


@dataclass
class ForceResult:
    """What a force did, for the summary and the benchmark."""

    target: str
    outputs: list[str]
    thunks_total: int = 0
    ran: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    reports: list[dict[str, Any]] = field(default_factory=list)
    uploaded_bytes: int = 0
    job_s: float = 0.0
    peak_live_bytes: int = 0
    deleted_bytes: int = 0
    build_prefix: str | None = None
    """The prefix the build was scoped to (``None``: not scoped)."""
    prefixes_declared: int = 0
    prefixes_ended: int = 0
    """Thunk prefixes ended as their readers finished (the build prefix not counted)."""
    ended_bytes: int = 0
    """Bytes the servers freed when the build's prefixes ended (at the end too)."""
    prefix_calls: int = 0
    """Declarations, ends and keeper renewals: one action per storage server each."""

    @property
    def bytes_moved(self) -> int:
        """Bytes the driver uploaded plus every byte workers read and wrote."""
        return self.uploaded_bytes + sum(r["bytes_read"] + r["bytes_written"]
                                         for r in self.reports)


def graph_width(graph: BuildGraph, target: str) -> int:
    """The most thunks of the target's graph at one depth (a bound on useful parallelism)."""
    depth: dict[str, int] = {}

    def depth_of(name: str) -> int:
        base = name.split("#", 1)[0]
        if base not in depth:
            deps = graph.thunks[base].dependencies()
            depth[base] = 1 + max((depth_of(d) for d in deps), default=-1)
        return depth[base]

    depth_of(target)
    return max(Counter(depth.values()).values())


def hints_for(graph: BuildGraph, target: str) -> dict[str, Any]:
    """pocketflow registration hints from the graph: its width as the concurrency, its values
    and thunks (plus as much again for outputs) as the data size."""
    return {"max_concurrent_tasks": graph_width(graph, target),
            "data_size_bytes": max(1 << 20, 2 * graph.total_bytes())}


def upload(graph: BuildGraph, store: Store, thunks: Iterable[str] | None = None, *,
           prefix: str = "") -> int:
    """Write the values and executables of ``thunks`` (default: every thunk of the graph) and
    the thunks themselves to the store, skipping what is there (found in one batch); returns
    the bytes written. Small objects go in batches, large ones (executables) one by one.
    With ``prefix`` (a scoped build), what is missing at the bucket root goes under the
    prefix, and the thunks are not written (the driver writes each thunk it submits under the
    thunk's own prefix)."""
    names = list(graph.thunks) if thunks is None else list(thunks)
    return _upload(graph, store, names, prefix)[0]


def _upload(graph: BuildGraph, store: Store, names: list[str],
            prefix: str) -> tuple[int, list[str]]:
    """:func:`upload`; also returns the names written."""
    needed = list(dict.fromkeys(n for t in names for n, _ in (*graph.thunks[t].values,
                                                               *graph.thunks[t].executables)))
    before = store.stats.bytes_written
    batch: list[tuple[str, bytes]] = []
    batch_bytes = 0
    missing = store.missing(BLOBS, needed if prefix else needed + names)
    for name in missing:
        key = located(prefix, name)
        if size_of(name) >= UPLOAD_BATCH_BYTES_MAX:
            store.put(BLOBS, key, graph.value_bytes(name))
            continue
        data = graph.thunks[name].data if name in graph.thunks else graph.value_bytes(name)
        batch.append((key, data))
        batch_bytes += len(data)
        if len(batch) >= UPLOAD_BATCH_MAX or batch_bytes >= UPLOAD_BATCH_BYTES_MAX:
            store.put_many(BLOBS, batch)
            batch, batch_bytes = [], 0
    store.put_many(BLOBS, batch)
    return store.stats.bytes_written - before, missing


class _Forcer:
    def __init__(self, graph: BuildGraph, target: str, store: Store, engine: Engine, *,
                 jobs: int, delete: bool, reuse: bool,
                 progress: Callable[[str, str], None] | None, timeout_s: float,
                 scope: BuildScope | None = None) -> None:
        self.graph = graph
        self.scope = scope
        self.target = target.split("#", 1)[0]
        self.store = store
        self.engine = engine
        self.jobs = jobs
        self.delete = delete
        self.reuse = reuse
        self.progress = progress or (lambda event, name: None)
        self.timeout_s = timeout_s
        self.reductions: dict[str, str] = {}  # thunk reference -> value name
        # Reductions recorded before this force, of every thunk of the graph: one batch.
        self.recorded: dict[str, bytes] = (store.get_found(REDUCTIONS, [
            ref for thunk in graph.thunks.values() for ref in thunk.output_names()])
            if reuse else {})
        self.order = self._reachable()
        self.dependents: dict[str, set[str]] = {n: set() for n in self.order}
        self.waiting_on: dict[str, set[str]] = {}
        for name in self.order:
            deps = {d.split("#", 1)[0] for d in graph.thunks[name].dependencies()}
            if name in self.pre_reduced:
                deps = set()
            self.waiting_on[name] = deps
            for dep in deps:
                self.dependents[dep].add(name)
        self.readers = self._readers()
        self.not_deletable: set[str] = set(graph.executables)
        # Scoping: where the driver uploaded each object ("" for the bucket root), the prefix
        # of each submitted thunk other than the target (its outputs are there), and how many
        # of each thunk's readers have not succeeded yet.
        self.deps_of = {name: set(deps) for name, deps in self.waiting_on.items()}
        self.index = {name: i for i, name in enumerate(self.order)}
        self.uploaded_at: dict[str, str] = {}
        self.outputs_at: dict[str, str] = {}
        self.readers_left = {name: len(self.dependents[name]) for name in self.order}

    def _reachable(self) -> list[str]:
        """The thunks the target needs, top down; with ``reuse``, the graph below a thunk whose
        reduction is recorded (and whose outputs still exist) is not visited (gg's force)."""
        self.pre_reduced: set[str] = set()
        seen: list[str] = []
        stack = [self.target]
        marked: set[str] = set()
        while stack:
            name = stack.pop()
            if name in marked:
                continue
            if name not in self.graph.thunks:
                raise MissingObject(f"thunk {name} is not in the graph")
            marked.add(name)
            seen.append(name)
            thunk = self.graph.thunks[name]
            if self._reused(thunk, thunk) is not None:
                self.pre_reduced.add(name)
                continue
            stack.extend(d.split("#", 1)[0] for d in self.graph.thunks[name].dependencies())
        return seen

    def _readers(self) -> Counter[str]:
        """How many thunks of the graph read each value and each thunk reference."""
        readers: Counter[str] = Counter()
        for name in self.order:
            thunk = self.graph.thunks[name]
            readers.update({n for n, _ in (*thunk.values, *thunk.thunks)})
        return readers

    def _deletable(self, value: str, via: str | None) -> bool:
        if not self.delete or value in self.not_deletable:
            return False
        return self.readers[via or value] == 1 and (via is None or self.readers[value] == 0)

    def _plan(self, original: Thunk, rewritten: Thunk) -> Plan:
        via_of = {}
        for ref, _ in original.thunks:
            if ref in self.reductions:
                via_of[self.reductions[ref]] = ref
        delete = sorted({n for n, _ in rewritten.values if self._deletable(n, via_of.get(n))})
        where: dict[str, str] = {}
        if self.scope is not None:
            for name, _ in (*rewritten.values, *rewritten.executables):
                where[name] = self.uploaded_at.get(name, "")
            for ref, _ in original.thunks:  # read where the thunk that made it put it
                where[self.reductions[ref]] = self.outputs_at.get(ref.split("#", 1)[0], "")
        return Plan(delete_inputs=tuple(delete), persist_outputs=original.name == self.target,
                    located=tuple(sorted((n, p) for n, p in where.items() if p)),
                    outputs_at=self.outputs_at.get(original.name, ""))

    def _scope_of(self, name: str) -> str:
        """The prefix a submitted thunk is stored under; its outputs too, unless it is the
        target (those persist at the root)."""
        if self.scope is None:
            return ""
        prefix = self.scope.thunk_prefix(self.index[name])
        if name != self.target:
            self.outputs_at[name] = prefix
        return prefix

    def _reused(self, original: Thunk, rewritten: Thunk) -> list[str] | None:
        if not self.reuse:
            return None
        for candidate in dict.fromkeys((original, rewritten)):
            refs = candidate.output_names()
            recorded = (self.recorded if candidate is original
                        else self.store.get_found(REDUCTIONS, refs))
            if not all(ref in recorded for ref in refs):
                continue
            outputs = [recorded[ref].decode() for ref in refs]
            if (not any(is_thunk(o) for o in outputs)
                    and not self.store.missing(BLOBS, list(dict.fromkeys(outputs)))):
                return outputs
        return None

    def _record(self, original: Thunk, outputs: list[str]) -> None:
        for ref, output in zip(original.output_names(), outputs, strict=True):
            if output in self.reductions.values() or self.readers[output]:
                # Equal bytes from two thunks, or equal to a value: more than one reader.
                self.not_deletable.add(output)
            self.reductions[ref] = output

    def run(self) -> ForceResult:
        started = time.perf_counter()
        result = ForceResult(target=self.target, outputs=[], thunks_total=len(self.order))
        self.progress("total", str(len(self.order)))
        to_run = [n for n in self.order if n not in self.pre_reduced]
        build = self.scope.build if self.scope is not None else ""
        result.uploaded_bytes, uploaded = _upload(self.graph, self.store, to_run, build)
        if build:
            self.uploaded_at = dict.fromkeys(uploaded, build)
        live = sum(size_of(n) for n in dict.fromkeys(
            n for t in to_run for n, _ in (*self.graph.thunks[t].values,
                                           *self.graph.thunks[t].executables)))
        live += sum(len(self.graph.thunks[t].data) for t in to_run)
        result.peak_live_bytes = live
        ready = [n for n in reversed(self.order) if not self.waiting_on[n]]
        in_flight: dict[Any, tuple[Thunk, Thunk]] = {}
        window = max(1, self.engine.window(self.jobs))
        while ready or in_flight:
            batch: list[tuple[Thunk, Thunk]] = []
            while ready and len(in_flight) + len(batch) < window:
                name = ready.pop(0)
                original = self.graph.thunks[name]
                rewritten = original.reduced(self.reductions)
                outputs = self._reused(original, rewritten)
                if outputs is not None:
                    result.reused.append(name)
                    self.progress("reused", name)
                    self._finish(original, outputs, ready)
                    continue
                batch.append((original, rewritten))
                self.progress("started", name)
            if batch:
                scopes = [self._scope_of(original.name) for original, _ in batch]
                if self.scope is not None:  # the round's prefixes: one renewal per server
                    self.scope.declare(scopes)
                # A rewritten thunk (any thunk, when scoped) and each plan, in one batch
                # before the calls start.
                self.store.put_many(BLOBS, [
                    item for (original, rewritten), scope in zip(batch, scopes, strict=True)
                    for item in (
                        *(((located(scope, rewritten.name), rewritten.data),)
                          if rewritten.name != original.name or scope else ()),
                        (located(scope, plan_key(rewritten.name)),
                         self._plan(original, rewritten).to_bytes()))], overwrite=True)
                calls = self.engine.submit_many(self.store.spec, [r.name for _, r in batch],
                                                scopes if self.scope is not None else None)
                in_flight.update(zip(calls, batch, strict=True))
            if not in_flight:
                break
            finished = self.engine.wait_any(list(in_flight), self.timeout_s)
            if not finished:
                raise GGError(f"no thunk finished in {self.timeout_s:.0f} s")
            for call, outcome in finished:
                original, rewritten = in_flight.pop(call)
                if isinstance(outcome, BaseException):
                    if isinstance(outcome, GGError):
                        raise outcome
                    raise ThunkFailed(rewritten.name, f"worker failed: {outcome!r}") from outcome
                result.reports.append(outcome)
                result.ran.append(original.name)
                live += outcome["bytes_written"] - outcome["deleted_bytes"]
                result.deleted_bytes += outcome["deleted_bytes"]
                result.peak_live_bytes = max(result.peak_live_bytes, live)
                self.progress("done", original.name)
                # The worker recorded the reduction of the thunk it ran.
                self._finish(original, outcome["outputs"], ready,
                             recorded=rewritten.name == original.name)
            if self.scope is not None:  # the round's consumed prefixes: one end per server
                live -= self.scope.flush()
        if self.target not in {r.split("#", 1)[0] for r in self.reductions}:
            raise GGError(f"the graph of {self.target} did not reduce (a cycle?)")
        target = self.graph.thunks[self.target]
        result.outputs = [self.reductions[ref] for ref in target.output_names()]
        result.job_s = time.perf_counter() - started
        return result

    def _finish(self, original: Thunk, outputs: list[str], ready: list[str], *,
                recorded: bool = False) -> None:
        self._record(original, outputs)
        if not recorded:
            at = self.outputs_at.get(original.name, "")
            self.store.put_many(REDUCTIONS, [
                (located(at, ref), output.encode())
                for ref, output in zip(original.output_names(), outputs, strict=True)],
                overwrite=True)
        if self.scope is not None:
            for dep in self.deps_of[original.name]:
                self.readers_left[dep] -= 1
                if self.readers_left[dep] == 0 and dep in self.outputs_at:
                    self.scope.consumed(self.outputs_at[dep])
        for dependent in sorted(self.dependents[original.name]):
            waiting = self.waiting_on[dependent]
            waiting.discard(original.name)
            if not waiting:
                ready.append(dependent)


def force(graph: BuildGraph, target: str, *, store: Store, engine: Engine, jobs: int,
          delete: bool = True, reuse: bool = True,
          progress: Callable[[str, str], None] | None = None,
          timeout_s: float = THUNK_TIMEOUT_DEFAULT_S, scope: Job | None = None) -> ForceResult:
    """Reduce ``target`` (a thunk of ``graph``) to its outputs.

    First the values, executables and thunks of the thunks that will run are uploaded if they
    are missing from the store (a rebuild puts back only what changed or was deleted).
    At most ``jobs`` calls run at once (the engine's window: Ray tasks are submitted ``jobs``
    at a time; the Lithops engine submits every ready thunk as one map, whose ``jobs`` worker
    processes run them). With ``reuse``, a thunk whose reduction is recorded and
    whose outputs still exist is not run again. With ``delete``, an input read by exactly one
    thunk of the graph is read with DELETE (executables never are); the target's outputs are
    written with PERSIST. ``progress(event, thunk)`` is called with ``started``, ``done`` and
    ``reused``, and once first with ``("total", "<thunks to visit>")`` (the graph below a
    thunk whose reduction is recorded is not visited).

    With ``scope`` (the job that holds ``store``'s objects), the build's intermediate objects
    live under prefix leases of that job (its ``prefix_lease_ms``; layout in
    :mod:`pocketflow_gg.scope`): a thunk's thunk, plan, outputs and reductions under a prefix
    of its own, declared when it is submitted (one declaration per submission round) and
    ended when every thunk reading its outputs succeeded (one end per scheduling round); the
    values and executables uploaded for the build under a build prefix that a keeper renews
    with everything below it (one renewal per server per third of a lease) and that ends when
    ``force`` returns or raises. If the driver dies, the servers free all of it one lease after
    the last renewal. The target's outputs and reductions are at the bucket root, as without
    scoping, so a later ``force`` on the job reuses the target; an intermediate thunk is reused
    only from what an unscoped force left at the root.
    """
    if not 1 <= jobs <= JOBS_MAX:
        raise GGError(f"jobs must be in 1..{JOBS_MAX}, got {jobs}")
    build_scope = BuildScope(scope, store) if scope is not None else None
    try:
        result = _Forcer(graph, target, store, engine, jobs=jobs, delete=delete, reuse=reuse,
                         progress=progress, timeout_s=timeout_s, scope=build_scope).run()
    except BaseException:
        if build_scope is not None:
            _close_quietly(build_scope)
        raise
    if build_scope is None:
        return result
    build_scope.close()
    result.build_prefix = build_scope.build
    result.prefixes_declared = build_scope.declared
    result.prefixes_ended = build_scope.ended
    result.ended_bytes = build_scope.ended_bytes
    result.prefix_calls = build_scope.calls
    return result


def _close_quietly(build_scope: BuildScope) -> None:
    """End a failed build's prefixes, keeping the build's own error: if ending fails, the
    leases free them a lease later."""
    from pocketflow.errors import PocketflowError

    try:
        build_scope.close()
    except PocketflowError as exc:
        log.warning("ending the prefixes of build %s failed (they lapse in %d ms): %s",
                    build_scope.build, build_scope.lease_ms, exc)


def fetch_outputs(store: Store, thunk: Thunk, outputs: list[str],
                  out_dir: str | Path) -> list[Path]:
    """Write a thunk's outputs into ``out_dir`` under their tags' base names; ELF executables
    get mode 755."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for tag, name in zip(thunk.outputs, outputs, strict=True):
        data = need(store, BLOBS, name)
        path = out / os.path.basename(tag)
        path.write_bytes(data)
        if data[:4] == b"\x7fELF" and data[16:17] in (b"\x02", b"\x03"):
            path.chmod(0o755)
        written.append(path)
    return written
