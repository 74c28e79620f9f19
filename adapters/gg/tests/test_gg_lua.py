"""The real build: Lua 5.4 from the lupa 2.8 sdist (its developer makefile: 33 compiles, an
archive, ranlib, a link against readline), forced as thunks on Ray tasks over pocketflow."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from pocketflow_gg.engines import make_engine
from pocketflow_gg.force import fetch_outputs, force, hints_for
from pocketflow_gg.infer import infer
from pocketflow_gg.lua_sources import SourcesUnavailable, lua_sources
from pocketflow_gg.objects import file_name
from pocketflow_gg.store import PocketflowStore

import pocketflow

SCRIPT = """
local t = {}
for i = 1, 10 do t[i] = (i * 7919) % 97 end
table.sort(t)
print(table.concat(t, ","), string.format("%5.2f", math.pi), ("gg"):rep(3), utf8.char(955))
"""


@pytest.fixture(scope="module")
def lua_dir(tmp_path_factory) -> Path:
    try:
        return lua_sources(tmp_path_factory.mktemp("lua"))
    except SourcesUnavailable as exc:
        pytest.skip(f"the lupa 2.8 sdist could not be downloaded: {exc}")


def lua(binary: Path, *args: str) -> str:
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=30,
                          check=True).stdout


def test_lua_builds_as_thunks_and_matches_a_local_make(local_cluster, lua_dir: Path,
                                                       tmp_path: Path) -> None:
    graph, target = infer(lua_dir, "lua")
    kinds = [s.kind for s in graph.steps]
    assert kinds.count("compile") >= 30 and kinds[-3:] == ["archive", "ranlib", "link"]
    hints = hints_for(graph, target)
    with pocketflow.register_job("gg-lua", hints, cluster=local_cluster) as job:
        store = PocketflowStore(job.handle.to_json())
        store.create_buckets()
        engine = make_engine("ray", store.spec, workers=2)
        try:
            result = force(graph, target, store=store, engine=engine, jobs=2)
        finally:
            engine.close()
        (built,) = fetch_outputs(store, graph.thunks[target], result.outputs, tmp_path / "out")
        store.close()
    assert len(result.ran) == len(graph.thunks)
    assert lua(built, "-e", "print(6*7)") == "42\n"
    subprocess.run(["make", "-s", "-j2", "lua"], cwd=lua_dir, check=True, timeout=300,
                   capture_output=True)
    local = lua_dir / "lua"
    (tmp_path / "t.lua").write_text(SCRIPT)
    assert lua(built, str(tmp_path / "t.lua")) == lua(local, str(tmp_path / "t.lua"))
    # Same compiler, same flags, preprocessed or not: the same bytes as the local build.
    assert file_name(built) == file_name(local)
