"""Infer and force a small C project (three sources, a header, an archive, a link) on the
session's local cluster: both engines, incremental rebuilds, DELETE and PERSIST, the CLI."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pocketflow_gg import worker
from pocketflow_gg.cli import main as gg_main
from pocketflow_gg.engines import make_engine
from pocketflow_gg.errors import InferError, ThunkFailed
from pocketflow_gg.force import fetch_outputs, force, graph_width, hints_for
from pocketflow_gg.infer import infer
from pocketflow_gg.objects import content_name, file_name
from pocketflow_gg.store import BLOBS, PocketflowStore, RedisStore
from pocketflow_gg.worker import exe_cache_dir, trim_executables

import pocketflow

PROJECT = Path(__file__).with_name("cproject")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    dest = tmp_path / "cproject"
    shutil.copytree(PROJECT, dest)
    return dest


@pytest.fixture
def gg_store(local_cluster, request) -> Iterator[PocketflowStore]:
    """A pocketflow job of its own for one test, and its store."""
    hints = {"max_concurrent_tasks": 3, "data_size_bytes": "128MiB"}
    with pocketflow.register_job(f"gg-{request.node.name[:20]}", hints,
                                 cluster=local_cluster) as job:
        store = PocketflowStore(job.handle.to_json())
        store.create_buckets()
        try:
            yield store
        finally:
            store.close()


def run(path: Path, *args: str) -> str:
    return subprocess.run([str(path), *args], capture_output=True, text=True, timeout=30,
                          check=True).stdout


def test_infer_turns_make_steps_into_thunks(project: Path) -> None:
    graph, target = infer(project, "app")
    kinds = [(s.kind, s.output) for s in graph.steps]
    assert kinds == [("compile", "main.o"), ("compile", "square.o"), ("compile", "circle.o"),
                     ("archive", "libshapes.a"), ("link", "app")]
    main_step = graph.steps[0]
    assert main_step.headers == ("shapes.h",)  # found like `cc -MM` does
    compile_thunk = graph.thunks[main_step.thunk]
    # The compile carries its source and header at their paths and runs make's command ...
    assert sorted(f for _, f in compile_thunk.values) == ["main.c", "shapes.h"]
    assert dict((f, n) for n, f in compile_thunk.values)["main.c"] == file_name(
        project / "main.c")
    assert compile_thunk.args[:3] == ("gcc", "-B", "bin/")
    assert compile_thunk.args[-4:] == ("-c", "-o", "main.o", "main.c")
    assert "-DGREETING=\"hello\"" in compile_thunk.args
    # ... and the compiler's own programs are executables named by content.
    assert {f for _, f in compile_thunk.executables} == {"", "bin/cc1", "bin/as"}
    assert compile_thunk.function_hash == file_name(Path(shutil.which("gcc")).resolve())
    assert "GCC_EXEC_PREFIX=/usr/lib/gcc/" in compile_thunk.envars
    link = graph.thunks[target]
    assert {f for _, f in link.thunks} == {"main.o", "libshapes.a"}
    assert graph_width(graph, target) == 3
    assert hints_for(graph, target)["max_concurrent_tasks"] == 3


def test_infer_with_preprocess_follows_ggs_model(project: Path) -> None:
    graph, _ = infer(project, "app", preprocess=True)
    main_step = graph.steps[0]
    assert main_step.headers == ("shapes.h",)  # from the preprocessor's -MMD
    compile_thunk = graph.thunks[main_step.thunk]
    # The compile reads the preprocessed source (no headers on the worker).
    (i_name, i_file), = compile_thunk.values
    assert i_file == "main.i"
    assert b"square_area" in graph.value_bytes(i_name)  # the header is inlined
    assert {f for _, f in compile_thunk.executables} == {"", "bin/cc1", "bin/as"}


def test_a_source_whose_includes_cannot_be_read_gets_its_headers_from_the_compiler(
        project: Path) -> None:
    # A computed include the scan cannot follow: `cc -MM` lists the headers instead.
    main = project / "main.c"
    main.write_text(main.read_text().replace('#include "shapes.h"',
                                             "#define SHAPES \"shapes.h\"\n#include SHAPES"))
    graph, _ = infer(project, "app")
    main_step = graph.steps[0]
    assert main_step.headers == ("shapes.h",)
    assert sorted(f for _, f in graph.thunks[main_step.thunk].values) == ["main.c", "shapes.h"]


@pytest.mark.parametrize("preprocess", [False, True])
def test_both_compile_models_build_the_same_program(project: Path, gg_store: PocketflowStore,
                                                    preprocess: bool, tmp_path: Path) -> None:
    graph, target = infer(project, "app", preprocess=preprocess)
    engine = make_engine("ray", gg_store.spec, workers=2)
    try:
        result = force(graph, target, store=gg_store, engine=engine, jobs=2)
    finally:
        engine.close()
    (app,) = fetch_outputs(gg_store, graph.thunks[target], result.outputs, tmp_path / "out")
    subprocess.run(["make", "-s", "app"], cwd=project, check=True, timeout=60)
    assert file_name(app) == file_name(project / "app")


@pytest.mark.parametrize("engine_kind", ["ray", "lithops"])
def test_force_builds_the_project_on_workers(project: Path, gg_store: PocketflowStore,
                                             engine_kind: str, tmp_path: Path) -> None:
    graph, target = infer(project, "app")
    engine = make_engine(engine_kind, gg_store.spec, workers=2)
    try:
        result = force(graph, target, store=gg_store, engine=engine, jobs=2)
    finally:
        engine.close()
    assert len(result.ran) == 5 and not result.reused
    assert all(r["pid"] != os.getpid() for r in result.reports)  # workers, not the driver
    # Workers keep the content-named executables they fetched, for later thunks and jobs.
    assert graph.executables <= {p.name for p in exe_cache_dir().iterdir()}
    (app,) = fetch_outputs(gg_store, graph.thunks[target], result.outputs, tmp_path / "out")
    assert run(app, "4") == "hello 16 5024\n"
    subprocess.run(["make", "-s", "app"], cwd=project, check=True, timeout=60)
    assert run(project / "app", "4") == run(app, "4")


def test_rebuild_after_touching_one_source_reruns_only_its_dependents(
        project: Path, gg_store: PocketflowStore, tmp_path: Path) -> None:
    engine = make_engine("ray", gg_store.spec, workers=2)
    try:
        graph, target = infer(project, "app")
        first = force(graph, target, store=gg_store, engine=engine, jobs=2, delete=False)
        assert len(first.ran) == 5
        source = project / "circle.c"
        source.write_text(source.read_text().replace("314 *", "315 *"))
        graph2, target2 = infer(project, "app")
        second = force(graph2, target2, store=gg_store, engine=engine, jobs=2, delete=False)
        outputs = {s.thunk: s.output for s in graph2.steps}
        assert sorted(outputs[name] for name in second.ran) == ["app", "circle.o", "libshapes.a"]
        assert sorted(outputs[name] for name in second.reused) == ["main.o", "square.o"]
        # Only the changed source and the new thunks went up; executables were there.
        assert 0 < second.uploaded_bytes < 100_000 < first.uploaded_bytes
        (app,) = fetch_outputs(gg_store, graph2.thunks[target2], second.outputs, tmp_path)
        assert run(app, "2") == "hello 4 1260\n"
        third = force(graph2, target2, store=gg_store, engine=engine, jobs=2, delete=False)
        assert third.ran == [] and len(third.reused) == 1  # the target's reduction is enough
    finally:
        engine.close()


def test_delete_frees_intermediates_and_the_target_persists(
        project: Path, gg_store: PocketflowStore) -> None:
    graph, target = infer(project, "app")
    engine = make_engine("ray", gg_store.spec, workers=2)
    try:
        result = force(graph, target, store=gg_store, engine=engine, jobs=2, delete=True)
    finally:
        engine.close()
    compiles = [s for s in graph.steps if s.kind == "compile"]
    for step in compiles:
        values = dict((f, n) for n, f in graph.thunks[step.thunk].values)
        source = values.pop(step.inputs[0])
        assert not gg_store.exists(BLOBS, source), f"{step.output}'s source was read once"
        assert all(gg_store.exists(BLOBS, n) for n in values.values())  # the shared header
    object_names = [r["outputs"][0] for r in result.reports
                    if r["thunk"] in {s.thunk for s in compiles}]
    assert len(object_names) == 3
    assert not any(gg_store.exists(BLOBS, name) for name in object_names)
    assert all(gg_store.exists(BLOBS, name) for name in graph.executables)  # read many times
    assert result.deleted_bytes > 0
    (app_name,) = result.outputs
    assert gg_store.is_persistent(BLOBS, app_name)
    assert not gg_store.is_persistent(BLOBS, next(iter(graph.executables)))


def test_a_compile_error_fails_the_build_with_the_compiler_message(
        project: Path, gg_store: PocketflowStore) -> None:
    (project / "square.c").write_text("long square_area(long side) { return side * ; }\n")
    graph, target = infer(project, "app")
    engine = make_engine("ray", gg_store.spec, workers=2)
    try:
        with pytest.raises(ThunkFailed, match="expected expression"):
            force(graph, target, store=gg_store, engine=engine, jobs=2)
    finally:
        engine.close()


def test_unknown_build_commands_are_refused(project: Path) -> None:
    (project / "Makefile").write_text("gen.c:\n\tpython3 gen.py > gen.c\n")
    with pytest.raises(InferError, match="shell syntax"):
        infer(project, "gen.c")
    (project / "Makefile").write_text("out:\n\tperl gen.pl out\n")
    with pytest.raises(InferError, match="no model for build command 'perl'"):
        infer(project, "out")
    with pytest.raises(InferError, match="no build step produces"):
        infer(PROJECT, "main.c")


def test_cli_hash_prints_ggs_name(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    out = io.StringIO()
    assert gg_main(["hash", str(path)], out=out) == 0
    assert out.getvalue() == content_name(b"abc") + "\n"


@pytest.mark.parametrize("extra", [[], ["--preprocess"]])
def test_cli_build_writes_the_target(local_cluster, project: Path, tmp_path: Path,
                                     extra: list[str]) -> None:
    out = io.StringIO()
    status = gg_main(["build", str(project), "app", "--out", str(tmp_path / "out"),
                      "--engine", "ray", "--jobs", "2", "--address", local_cluster.ray_address,
                      "--no-progress", *extra], out=out)
    assert status == 0, out.getvalue()
    assert run(tmp_path / "out" / "app", "1") == "hello 1 314\n"
    text = out.getvalue()
    assert "thunks: 5 run, 0 reused, of 5" in text
    assert "bytes moved" in text and "peak capacity" in text


def test_the_same_thunks_run_with_redis_as_the_store(local_cluster, project: Path,
                                                     tmp_path: Path) -> None:
    """The benchmark's peer: the store is a real redis-server (GETDEL for DELETE)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make install installs it as root)")
    repo_root = str(Path(__file__).resolve().parents[3])
    if repo_root not in sys.path:  # benchmarks/ is not an installed package
        sys.path.insert(0, repo_root)
    from benchmarks.peers import RedisPeer

    peer = RedisPeer()
    peer.start()
    try:
        store = RedisStore(f"redis://127.0.0.1:{peer.spec().port}/0?prefix=t")
        graph, target = infer(project, "app")
        engine = make_engine("ray", store.spec, workers=2)
        try:
            result = force(graph, target, store=store, engine=engine, jobs=2)
        finally:
            engine.close()
        (app,) = fetch_outputs(store, graph.thunks[target], result.outputs, tmp_path)
        assert run(app, "3") == "hello 9 2826\n"
        assert result.deleted_bytes > 0
        source = dict((f, n) for n, f in graph.thunks[graph.steps[0].thunk].values)["main.c"]
        assert not store.exists(BLOBS, source)  # read once, with GETDEL
        store.close()
    finally:
        peer.stop()


def test_cli_reports_bad_input_with_a_clear_error(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nowhere"
    assert gg_main(["build", str(missing), "app", "--out", str(tmp_path / "out")]) == 2
    assert f"{missing} is not a directory" in capsys.readouterr().err
    assert gg_main(["build", str(PROJECT), "app", "--out", str(tmp_path), "--jobs", "0"]) == 2
    assert "--jobs must be at least 1" in capsys.readouterr().err
    assert gg_main(["hash", str(missing)]) == 2
    assert "No such file" in capsys.readouterr().err


def test_ray_queues_tasks_only_where_the_cluster_bounds_what_runs(local_cluster) -> None:
    engine = make_engine("ray", "unused", workers=2)
    # The session's cluster has 2 CPUs: with 2 jobs Ray itself runs at most 2 thunks, and
    # a queued one starts as soon as one finishes; with 1 job only 1 may be submitted.
    assert engine.window(2) == 4
    assert engine.window(1) == 1


def test_the_executable_cache_drops_the_least_recently_used_beyond_its_bound(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(worker, "EXE_CACHE_ROOT", tmp_path)
    cache = exe_cache_dir()  # made (private) on first use
    now = time.time()
    ages = {"old": 3000, "older": 4000, "recent": 10}
    for name, age in ages.items():
        (cache / name).write_bytes(b"x" * 1000)
        os.utime(cache / name, (now - age, now - age))
    # Over the bound by 2,000 bytes: the two least recently used go ...
    assert trim_executables(bytes_max=1000) == 2000
    assert sorted(p.name for p in cache.iterdir()) == ["recent"]
    # ... but nothing used in the last EXE_CACHE_KEEP_S, whatever the bound.
    assert trim_executables(bytes_max=0) == 0
