"""A build scoped to prefix leases (``force(..., scope=job)``) on the session's local cluster:
the same program, nothing of the build left but its target, each thunk's outputs freed once
their readers succeeded (also without DELETE), and everything freed one lease after a driver
that dies."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from pocketflow_gg.cli import main as gg_main
from pocketflow_gg.engines import make_engine
from pocketflow_gg.errors import GGError
from pocketflow_gg.force import fetch_outputs, force
from pocketflow_gg.infer import infer
from pocketflow_gg.store import BLOBS, REDUCTIONS, PocketflowStore

import pocketflow
from pocketflow.handle import JobHandle

PROJECT = Path(__file__).with_name("cproject")
HINTS = {"max_concurrent_tasks": 3, "data_size_bytes": "128MiB"}
DRIVER_START_TIMEOUT_S = 90.0
"""How long the killed driver's subprocess may take to join Ray and finish a thunk."""
INFLIGHT_SETTLE_S = 1.5
"""How long the test lets the killed driver's running compiles finish before it kills it (a
worker that writes after its prefix lapsed leaves an object no lease covers)."""
LAPSE_SLACK_S = 3.0
"""Allowed lateness of the servers' lease sweep (every 50 ms) on a loaded 2-core machine."""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    dest = tmp_path / "cproject"
    shutil.copytree(PROJECT, dest)
    return dest


@contextmanager
def job_and_store(cluster, name: str, **leases: int) -> Iterator[tuple[object, PocketflowStore]]:
    with pocketflow.register_job(name, HINTS, cluster=cluster, **leases) as job:
        store = PocketflowStore(job.handle.to_json())
        store.create_buckets()
        try:
            yield job, store
        finally:
            store.close()


def keys(job, bucket: str) -> list[str]:
    with job.connect() as client:
        return [info.key for info in client.list(bucket)]


def run(path: Path, *args: str) -> str:
    return subprocess.run([str(path), *args], capture_output=True, text=True, timeout=30,
                          check=True).stdout


@pytest.mark.parametrize("engine_kind", ["ray", "lithops"])
def test_a_scoped_build_leaves_only_its_target_and_reuses_it(
        local_cluster, project: Path, tmp_path: Path, engine_kind: str) -> None:
    graph, target = infer(project, "app")
    with job_and_store(local_cluster, "gg-scoped", prefix_lease_ms=1000) as (job, store):
        engine = make_engine(engine_kind, store.spec, workers=2)
        try:
            result = force(graph, target, store=store, engine=engine, jobs=2, scope=job)
            (app,) = fetch_outputs(store, graph.thunks[target], result.outputs, tmp_path)
            assert run(app, "4") == "hello 16 5024\n"
            # Of the build, only the target's output (PERSIST) and reductions are left.
            (app_name,) = result.outputs
            assert keys(job, BLOBS) == [app_name]
            assert store.is_persistent(BLOBS, app_name)
            assert set(keys(job, REDUCTIONS)) <= {r["thunk"] for r in result.reports} | {target}
            # Every thunk but the target ended its prefix when its readers were done.
            assert result.build_prefix is not None and result.build_prefix.startswith("gg-")
            assert (result.prefixes_declared, result.prefixes_ended) == (5, 4)
            assert result.ended_bytes > 0
            assert not job.prefix_leases.dag  # nothing declared is left
            # A second force on the job reuses the target's recorded reduction.
            again = force(graph, target, store=store, engine=engine, jobs=2, scope=job)
            assert again.ran == [] and again.reused == [target]
            assert again.outputs == result.outputs
        finally:
            engine.close()


def _held_when_the_link_starts(cluster, project: Path, *, scoped: bool) -> tuple[set, dict]:
    """Build without DELETE; return the blob keys held when the link (the target) started and
    each compile's output name."""
    graph, target = infer(project, "app")
    held: set[str] = set()
    with job_and_store(cluster, f"gg-held-{int(scoped)}", prefix_lease_ms=1000) as (job, store):

        def progress(event: str, name: str) -> None:
            if event == "started" and name == target:
                held.update(keys(job, BLOBS))

        engine = make_engine("ray", store.spec, workers=2)
        try:
            result = force(graph, target, store=store, engine=engine, jobs=2, delete=False,
                           progress=progress, scope=job if scoped else None)
        finally:
            engine.close()
    output_of = {ran: report["outputs"][0]
                 for ran, report in zip(result.ran, result.reports, strict=True)}
    objects = {step.output: output_of[step.thunk] for step in graph.steps}
    return held, objects


def test_scoping_frees_a_thunks_outputs_once_its_readers_succeeded(
        local_cluster, project: Path) -> None:
    # Without DELETE, an unscoped build still holds the archived objects when the link starts.
    held, objects = _held_when_the_link_starts(local_cluster, project, scoped=False)
    assert {objects["square.o"], objects["circle.o"]} <= held
    # Scoped, their prefix ended when the archive (their one reader) succeeded; the link's own
    # inputs are still there, under the prefixes of the thunks that made them.
    held, objects = _held_when_the_link_starts(local_cluster, project, scoped=True)
    names = {key.rsplit("/", 1)[-1] for key in held}
    assert objects["square.o"] not in names and objects["circle.o"] not in names
    assert {objects["main.o"], objects["libshapes.a"]} <= names
    assert all("/" in key for key in held)  # nothing of this build at the bucket root


def test_a_scoped_build_needs_the_stores_own_job(local_cluster, project: Path) -> None:
    graph, target = infer(project, "app")
    with job_and_store(local_cluster, "gg-store") as (_, store), \
            pocketflow.register_job("gg-other", HINTS, cluster=local_cluster) as other:
        engine = make_engine("ray", store.spec, workers=2)
        try:
            with pytest.raises(GGError, match="the job that holds its store"):
                force(graph, target, store=store, engine=engine, jobs=2, scope=other)
        finally:
            engine.close()


def test_cli_build_with_prefix_leases(local_cluster, project: Path, tmp_path: Path) -> None:
    out = io.StringIO()
    status = gg_main(["build", str(project), "app", "--out", str(tmp_path / "out"),
                      "--engine", "ray", "--jobs", "2", "--address", local_cluster.ray_address,
                      "--no-progress", "--prefix-lease-ms", "1000"], out=out)
    assert status == 0, out.getvalue()
    assert run(tmp_path / "out" / "app", "1") == "hello 1 314\n"
    assert "4 thunk prefixes ended as read" in out.getvalue()
    assert gg_main(["build", str(project), "app", "--out", str(tmp_path),
                    "--prefix-lease-ms", "5"]) == 2


DRIVER = """
import json, sys
import pocketflow
from pocketflow.control.plane import connect_control_plane
from pocketflow_gg.engines import make_engine
from pocketflow_gg.force import force
from pocketflow_gg.infer import infer
from pocketflow_gg.store import PocketflowStore

project, address = sys.argv[1:]
graph, target = infer(project, "app")
control = connect_control_plane(address)
# No job lease: the job outlives this driver, so what frees its data is the prefix leases.
job = pocketflow.register_job("gg-dies", {"max_concurrent_tasks": 3}, cluster=control,
                              lease_ms=None, prefix_lease_ms=300)
store = PocketflowStore(job.handle.to_json())
store.create_buckets()
print(json.dumps({"handle": job.handle.to_json()}), flush=True)

def progress(event, name):
    if event == "done":
        print(json.dumps({"done": name}), flush=True)
        if name != target:
            import time
            time.sleep(3600)  # the test kills this driver here

force(graph, target, store=store, engine=make_engine("ray", store.spec, workers=2), jobs=2,
      delete=False, progress=progress, scope=job)
"""


def test_a_dead_drivers_build_is_freed_one_lease_later(local_cluster, project: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(project),
                               local_cluster.ray_address],
                              stdout=subprocess.PIPE, text=True, env=env)
    handle_json = None
    try:
        deadline = time.monotonic() + DRIVER_START_TIMEOUT_S
        assert driver.stdout is not None
        for line in driver.stdout:  # ends when the driver exits; bounded by the deadline
            message = json.loads(line)
            handle_json = message.get("handle", handle_json)
            if "done" in message or time.monotonic() > deadline:
                break
        assert handle_json is not None, "the driver printed no handle"
        store = PocketflowStore(handle_json)
        try:
            with pocketflow.connect(handle_json) as client:
                # The thunks still running finish (their outputs go under prefixes that are
                # renewed while the driver lives); the driver is stuck in its callback.
                time.sleep(INFLIGHT_SETTLE_S)
                assert client.list(BLOBS), "the build holds nothing while it runs"
                driver.send_signal(signal.SIGKILL)
                driver.wait(30)
                killed = time.monotonic()
                # Nothing renews the build any more: one lease (0.3 s) later every server
                # freed all of it, the uploaded executables and sources too.
                while client.list(BLOBS) or client.list(REDUCTIONS):
                    assert time.monotonic() - killed < 0.3 + LAPSE_SLACK_S, \
                        [i.key for i in client.list(BLOBS)]
                    time.sleep(0.05)
        finally:
            store.close()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
        if handle_json is not None:
            local_cluster.control.deregister(JobHandle.from_json(handle_json).job_id)
