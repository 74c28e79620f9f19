"""Run Lithops' own test suite against the ``pocket`` storage backend on an embedded cluster.

::

    python3 adapters/lithops/run_lithops_tests.py [extra pytest arguments]

Starts a small embedded local cluster (Ray pinned to 2 CPUs, two DRAM storage servers), registers
a job, writes a Lithops config file whose storage is that job (``storage: pocket``) and whose
compute backend is the localhost executor (``sys.executable``, version 1), and runs pytest
directly on the test files shipped in the installed ``lithops`` package, with ``--storage pocket
--backend localhost``. Unlike ``lithops test``, pytest's exit status is this script's, so a
failing Lithops test fails CI. The job is deregistered and every process the cluster started is
stopped by its process id afterwards, also when the tests fail or are interrupted. Lithops'
temporary files go to a scratch ``TMPDIR`` that is removed at the end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LITHOPS_TEST_FILES = (
    "test_storage.py",
    "test_call_async.py",
    "test_map.py",
    "test_future.py",
    "test_concurrent_futures.py",
)
"""Lithops' storage test suite, plus its map, call_async and futures tests."""

TEST_TIMEOUT_S = 120
"""pytest-timeout per test: a hung Lithops job fails its test instead of stalling CI."""

RUN_TIMEOUT_S = 900
"""One pytest run is killed after this long."""



def lithops_tests_dir() -> Path:
    """The ``tests`` directory of the installed ``lithops`` package."""
    import lithops

    tests = Path(lithops.__file__).resolve().parent / "tests"
    if not (tests / "conftest.py").is_file():
        raise FileNotFoundError(f"no Lithops test suite at {tests} (is lithops installed?)")
    return tests


def write_config(handle_json: str, directory: Path) -> Path:
    """Write the Lithops config file (YAML) for the job into ``directory``; returns its path."""
    import yaml
    from pocketflow_lithops.storage import lithops_config

    path = directory / "lithops_config.yaml"
    path.write_text(yaml.safe_dump(lithops_config(handle_json)), encoding="utf-8")
    return path


def run(pytest_args: list[str]) -> int:
    """Start the cluster, run Lithops' tests against it, stop it; pytest's exit status."""
    from pocketflow.cluster import LocalCluster

    tests = lithops_tests_dir()
    files = [str(tests / name) for name in LITHOPS_TEST_FILES]
    cluster = LocalCluster(
        dram_servers=2,
        nvme_servers=0,
        dram_capacity="128MiB",
        block_size="1MiB",
        num_cpus=2,
        object_store_memory="80MiB",
    )
    with tempfile.TemporaryDirectory(
        prefix="pocketflow-lithops-tests-", ignore_cleanup_errors=True
    ) as tmp, cluster:
        job = cluster.register_job("lithops-tests")
        try:
            config = write_config(job.handle.to_json(), Path(tmp))
            command = [
                sys.executable, "-m", "pytest", *files,
                "--config", str(config), "--storage", "pocket", "--backend", "localhost",
                "-o", f"cache_dir={Path(tmp) / '.pytest_cache'}",
                f"--timeout={TEST_TIMEOUT_S}", "-q", *pytest_args,
            ]
            # A scratch working directory: Lithops and pytest write nothing into the repository.
            # Lithops keeps its runner, its copy of itself, job files and clean-up requests under
            # $TMPDIR/lithops-$USER; a scratch TMPDIR keeps this run apart from any other Lithops
            # session on the machine, and a clean-up request that cannot run once the cluster
            # is gone from every later Lithops cleaner (deregistering frees the data anyway).
            env = {**os.environ, "TMPDIR": tmp}
            # One run, no rerun: a failing Lithops test fails CI.
            return _pytest(command, cwd=tmp, env=env)
        finally:
            job.deregister()


def _pytest(command: list[str], *, cwd: str, env: dict[str, str]) -> int:
    print("+", " ".join(command), flush=True)
    completed = subprocess.run(command, cwd=cwd, env=env, timeout=RUN_TIMEOUT_S, check=False)
    return completed.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _, pytest_args = parser.parse_known_args(argv)
    return run(pytest_args)


if __name__ == "__main__":
    sys.exit(main())
