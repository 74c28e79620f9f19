"""The worker side: run one thunk given only a store spec and the thunk's name.

The worker fetches the thunk, its plan, values and executables from the store, lays them out in
a private directory, runs the function there, puts each output under its content name and
records the reduction (thunk name -> output name). Layout of the private directory: an entry
``name=filename`` is placed at ``filename``; an entry without a filename, and any object a
``@{GGHASH:name}`` placeholder refers to, at ``blobs/<name>``. The function itself runs from a
hash-named path (as in gg), so compilers find their own files through the thunk's envars
(``GCC_EXEC_PREFIX``) and ``-B`` arguments, not through where they were installed. In a build
scoped to prefix leases the worker is also given the prefix its thunk and plan are stored under,
and the plan says where each input is and where the outputs go (:mod:`pocketflow_gg.scope`).

Executables are content-named, so workers keep those they fetched in one directory per machine
(like gg's blob directory on a warm Lambda) and reuse them across thunks and jobs: a name is its
bytes, checked when they are fetched. The directory is kept under ``EXE_CACHE_BYTES_MAX``, least
recently used first, never removing a file used in the last ``EXE_CACHE_KEEP_S``.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from pocketflow_gg.errors import MissingObject, ThunkFailed
from pocketflow_gg.objects import content_name, placeholders_in, replace_placeholders, size_of
from pocketflow_gg.scope import located
from pocketflow_gg.store import BLOBS, REDUCTIONS, Plan, Store, need, open_store, plan_key
from pocketflow_gg.thunk import Thunk

FUNCTION_NICENESS = 19
"""CPU niceness a thunk's function runs at: the lowest priority, so that storage servers and
the workers' own I/O sharing the machine are not starved by compilers (on Lambda they run on
other machines)."""
TIMEOUT_DEFAULT_S = 600.0
"""How long a thunk without a timeout of its own may run."""
STDERR_TAIL_BYTES = 4000
"""How much of a failed function's stderr goes into the error."""
SPAWNER_THREADS = 4
"""Threads a worker process starts functions from (Ray runs one thunk per worker process at
a time; more serve a worker that runs several at once)."""
STORES_CACHED_MAX = 4
"""Open stores a worker process keeps (one per build it serves)."""
EXE_CACHE_ROOT = Path(tempfile.gettempdir()) / f"pocketflow-gg-{os.getuid()}"
EXE_CACHE_BYTES_MAX = 2 << 30
"""Most bytes of executables a machine keeps (a gcc toolchain is about 40 MB)."""
EXE_CACHE_KEEP_S = 600.0
"""An executable used this recently is never removed (a thunk may be about to link it)."""
EXE_CACHE_TOUCH_S = 60.0
"""A cached executable's time of use is refreshed when older than this (not at every use)."""

VALUE_CACHE_BYTES_MAX = 64 << 20
"""Most bytes of values read without DELETE (headers, read by many thunks) a worker process
keeps by content name."""
VALUE_CACHE_ITEM_BYTES_MAX = 1 << 20
"""Larger values are not kept."""

_stores: OrderedDict[str, Store] = OrderedDict()
_stores_lock = threading.Lock()


def _store(spec: str) -> Store:
    with _stores_lock:
        store = _stores.get(spec)
        if store is None:
            store = open_store(spec)
            _stores[spec] = store
        _stores.move_to_end(spec)
        while len(_stores) > STORES_CACHED_MAX:
            _stores.popitem(last=False)[1].close()
        return store


class _ValueCache:
    """Values by content name (a name is its bytes, so a kept value never goes stale), least
    recently used dropped first, at most ``VALUE_CACHE_BYTES_MAX``."""

    def __init__(self, bytes_max: int) -> None:
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._bytes_max = bytes_max
        self._lock = threading.Lock()

    def take(self, names: list[str]) -> dict[str, bytes]:
        with self._lock:
            found = {n: self._values[n] for n in names if n in self._values}
            for name in found:
                self._values.move_to_end(name)
            return found

    def keep(self, name: str, data: bytes) -> None:
        if len(data) > VALUE_CACHE_ITEM_BYTES_MAX:
            return
        with self._lock:
            if name in self._values:
                return
            self._values[name] = data
            self._bytes += len(data)
            while self._bytes > self._bytes_max:
                self._bytes -= len(self._values.popitem(last=False)[1])


_shared_values = _ValueCache(VALUE_CACHE_BYTES_MAX)


def exe_cache_dir() -> Path:
    """Where workers on this machine keep the executables they fetched, by content name: under
    a directory of this user's alone (mode 0700). A cached file is trusted by its name and size,
    so a root that another user could write to (created before us under the same name in the
    shared temporary directory) is refused rather than used."""
    EXE_CACHE_ROOT.mkdir(mode=0o700, exist_ok=True)
    root = os.lstat(EXE_CACHE_ROOT)
    if (not stat.S_ISDIR(root.st_mode) or root.st_uid != os.getuid()
            or root.st_mode & 0o022):
        raise ThunkFailed("?", f"the executable cache {EXE_CACHE_ROOT} is not a directory "
                               "only this user can write to; remove it")
    if root.st_mode & 0o077:
        EXE_CACHE_ROOT.chmod(0o700)  # ours and written only by us: made private
    cache = EXE_CACHE_ROOT / "executables"
    cache.mkdir(exist_ok=True)
    return cache


def trim_executables(bytes_max: int = EXE_CACHE_BYTES_MAX) -> int:
    """Remove this machine's least recently used executables until they take at most
    ``bytes_max`` (none used in the last ``EXE_CACHE_KEEP_S``); returns the bytes removed."""
    try:
        found = list(os.scandir(exe_cache_dir()))
    except FileNotFoundError:
        return 0
    entries = []
    for entry in found:
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        entries.append((info.st_mtime, info.st_size, entry.path))
    total = sum(size for _, size, _ in entries)
    removed = 0
    keep_after = time.time() - EXE_CACHE_KEEP_S
    for used, size, path in sorted(entries):
        if total - removed <= bytes_max or used >= keep_after:
            break
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed += size
    return removed


def _safe_relative(filename: str) -> PurePosixPath:
    path = PurePosixPath(filename)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ThunkFailed("?", f"entry filename {filename!r} must be a relative path inside "
                               "the thunk's directory")
    return path


def _write(path: Path, data: bytes, *, executable: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
    tmp.write_bytes(data)
    if executable:
        tmp.chmod(0o755)
    os.replace(tmp, path)


def _checked(name: str, data: bytes) -> bytes:
    if content_name(data) != name.split("#", 1)[0]:
        raise MissingObject(f"object {name} in the store does not match its name")
    return data


def _executable(store: Store, name: str, key: str) -> Path:
    path = exe_cache_dir() / name
    try:
        info = path.stat()
    except FileNotFoundError:
        pass
    else:
        if info.st_size == size_of(name):
            if time.time() - info.st_mtime > EXE_CACHE_TOUCH_S:
                os.utime(path)
            return path
    _write(path, _checked(name, need(store, BLOBS, key)), executable=True)
    trim_executables()
    return path


def _lower_priority() -> None:
    os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), FUNCTION_NICENESS))


def _lower_this_threads_priority() -> None:
    # On Linux a nice value belongs to a thread (PRIO_PROCESS with a thread id), and a child
    # inherits its parent thread's.
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid),
                                             FUNCTION_NICENESS))


_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _run_function(argv: list[str], **options: Any) -> subprocess.CompletedProcess:
    """Run a thunk's function at ``FUNCTION_NICENESS``. On Linux it is started from a thread
    of this process that runs at that niceness, so that the child inherits it and Python can
    start it with ``vfork`` (a ``preexec_fn`` would force a ``fork`` of the whole worker
    process, page tables and all, for every thunk); elsewhere through a ``preexec_fn``."""
    global _spawner
    if not sys.platform.startswith("linux"):
        return subprocess.run(argv, preexec_fn=_lower_priority, **options)
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=SPAWNER_THREADS,
                                          thread_name_prefix="gg-function",
                                          initializer=_lower_this_threads_priority)
    return _spawner.submit(subprocess.run, argv, **options).result()


def run_thunk(store_spec: str, thunk_name: str, scope: str = "") -> dict[str, Any]:
    """Force one thunk whose inputs are all values; returns its report (outputs, timings).
    The thunk and its plan are stored under the prefix ``scope`` (``""``: the bucket root);
    the plan says where each input is and where the outputs go."""
    started = time.perf_counter()
    first_in_process = store_spec not in _stores
    store = _store(store_spec)
    before = store.stats.to_dict()
    thunk_key = located(scope, thunk_name)
    try:
        thunk_data, plan_data = store.get_many(
            BLOBS, [thunk_key, located(scope, plan_key(thunk_name))])
    except MissingObject:  # no plan: nothing to delete, nothing persists
        thunk_data, plan_data = need(store, BLOBS, thunk_key), None
    thunk = Thunk.parse(_checked(thunk_name, thunk_data))
    if thunk.thunks:
        raise ThunkFailed(thunk_name, f"has unreduced dependencies {thunk.dependencies()}")
    plan = Plan.from_bytes(plan_data) if plan_data is not None else Plan()
    deleting = set(plan.delete_inputs)
    prefix_of = dict(plan.located)

    def key(name: str) -> str:
        return located(prefix_of.get(name, ""), name)

    workdir = Path(tempfile.mkdtemp(prefix="gg-thunk-"))
    try:
        path_of: dict[str, str] = {}
        referenced = {n for text in (*thunk.args, *thunk.envars) for n in placeholders_in(text)}
        # One batch for the inputs read with DELETE, one for the others.
        # Values read by several thunks (headers) are kept by name in this process.
        names = list(dict.fromkeys(name for name, _ in thunk.values))
        fetched_values = _shared_values.take([n for n in names if n not in deleting])
        for delete in (True, False):
            group = [n for n in names if (n in deleting) == delete and n not in fetched_values]
            datas = store.get_many(BLOBS, [key(n) for n in group], delete=delete)
            for name, data in zip(group, datas, strict=True):
                fetched_values[name] = _checked(name, data)
                if not delete:
                    _shared_values.keep(name, data)
        made = {workdir}
        for name, filename in thunk.values:
            # The directory is the thunk's own: no other process sees a half-written file.
            target = workdir / (_safe_relative(filename) if filename else Path("blobs", name))
            if target.parent not in made:
                target.parent.mkdir(parents=True, exist_ok=True)
                made.add(target.parent)
            target.write_bytes(fetched_values[name])
            path_of.setdefault(name, str(target))
        exe_started = store.stats.seconds
        for name, filename in thunk.executables:
            cached = _executable(store, name, key(name))
            path_of.setdefault(name, str(cached))
            if filename:
                target = workdir / _safe_relative(filename)
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(cached, target)
                except OSError:
                    shutil.copy2(cached, target)
        exe_io_s = store.stats.seconds - exe_started
        missing = referenced - set(path_of)
        if missing:
            raise ThunkFailed(thunk_name, f"placeholders name objects not in the thunk: "
                                          f"{sorted(missing)}")
        function = path_of.get(thunk.function_hash)
        if function is None or thunk.function_hash not in {n for n, _ in thunk.executables}:
            raise ThunkFailed(thunk_name, "its function is not one of its executables")
        (workdir / "tmp").mkdir(exist_ok=True)
        env = dict(e.split("=", 1) for e in
                   (replace_placeholders(v, path_of) for v in thunk.envars) if "=" in e)
        env.update({"TMPDIR": str(workdir / "tmp"), "__GG_ENABLED__": "1",
                    "__GG_DIR__": str(workdir / "blobs")})
        argv = [replace_placeholders(a, path_of) for a in thunk.args]
        fetched = time.perf_counter()
        timeout_s = thunk.timeout_ms / 1000 if thunk.timeout_ms else TIMEOUT_DEFAULT_S
        try:
            result = _run_function(argv, executable=function, cwd=workdir, env=env,
                                   capture_output=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise ThunkFailed(thunk_name, f"timed out after {timeout_s:.0f} s") from exc
        ran = time.perf_counter()
        if result.returncode != 0:
            tail = result.stderr[-STDERR_TAIL_BYTES:].decode(errors="replace")
            raise ThunkFailed(thunk_name, f"{argv[0]} exited with {result.returncode}: {tail}")
        produced: list[tuple[str, bytes]] = []
        for tag in thunk.outputs:
            out_path = workdir / _safe_relative(tag)
            if not out_path.is_file():
                raise ThunkFailed(thunk_name, f"declared output {tag!r} was not produced")
            data = out_path.read_bytes()
            produced.append((content_name(data), data))
        outputs = [name for name, _ in produced]
        store.put_many(BLOBS, [(located(plan.outputs_at, name), data)
                               for name, data in dict(produced).items()],
                       persist=plan.persist_outputs)
        store.put_many(REDUCTIONS, [(located(plan.outputs_at, ref), output.encode())
                                    for ref, output in
                                    zip(thunk.output_names(), outputs, strict=True)],
                       overwrite=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    after = store.stats.to_dict()
    report = {key: after[key] - before[key] for key in after}
    report.update({
        "thunk": thunk_name,
        "outputs": outputs,
        "output_bytes": [size_of(n) for n in outputs],
        "run_s": ran - fetched,
        # Storage time without fetching executables: the thunk's own data (Pocket's figure).
        "exe_io_s": exe_io_s,
        "data_io_s": report["io_s"] - exe_io_s,
        "total_s": time.perf_counter() - started,
        "pid": os.getpid(),
        "first_in_process": first_in_process,
    })
    return report
