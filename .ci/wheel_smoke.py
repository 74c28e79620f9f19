"""Install the wheels of `make wheels` into fresh virtualenvs, with no Rust toolchain on PATH, and
run the install smoke test (tests/smoke_install.py) from there.

1. The wheels are what they should be: the core wheel holds the native client core and an
   executable ``pocketflow/_bin/pocketflow-server``; each adapter's is pure Python
   (``py3-none-any``); the Lithops adapter's carries its import hook ``pocketflow_lithops.pth``.
2. A client-only virtualenv (``pip install <core wheel>``, no extras): a server started from the
   wheel's binary takes a job, and a fresh process imports ``pocketflow``, connects with the
   job's handle, puts and gets back an object without loading Ray, Lithops, pyarrow or numpy.
3. A virtualenv with the cluster and Lithops extras and the ``pocketflow-lithops`` wheel: the
   same client round trip, then ``pocketflow demo`` sorts a small input on a local cluster with
   Lithops' own data in pocketflow.

It prints what it measured (install time and size on disk, import + connect time and resident
memory of the connecting process, time to the first job) and, with ``--out``, writes them as
JSON. It fails on any broken step; the figures themselves are goals for a quiet machine, not
checks (speed targets live in benchmarks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
SMOKE_SCRIPT = CHECKOUT / "tests" / "smoke_install.py"
RUST_TOOLS = ("cargo", "rustc", "rustup")
PIP_TIMEOUT_S = 900.0
"""Bound on one pip install (the cluster extra downloads Ray when pip's cache lacks it)."""
SMOKE_TIMEOUT_S = 900.0
"""Bound on one run of the smoke script (its own steps are bounded well inside this)."""
SERVER_MEMBER = "pocketflow/_bin/pocketflow-server"
PTH_MEMBER = "pocketflow_lithops.pth"


def toolchain_free_env() -> dict[str, str]:
    """This environment with every PATH entry that holds a Rust tool removed, and no Python path
    or virtualenv inherited (the checkout must not be what the virtualenv imports)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "CARGO", "RUSTC")}
    kept = [entry for entry in env.get("PATH", "").split(os.pathsep)
            if entry and not any((Path(entry) / tool).exists() for tool in RUST_TOOLS)]
    env["PATH"] = os.pathsep.join(kept)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    if shutil.which("cargo", path=env["PATH"]) is not None:
        raise SystemExit("cargo is still on PATH after removing the Rust tool directories")
    return env


def find_wheels(dist: Path) -> dict[str, Path]:
    """The four wheels in ``dist`` by distribution name."""
    wheels: dict[str, Path] = {}
    for wheel in sorted(dist.glob("*.whl")):
        wheels[wheel.name.split("-")[0]] = wheel
    missing = {"pocketflow", "pocketflow_lithops", "pocketflow_gg", "pocketflow_this"} - set(wheels)
    if missing:
        raise SystemExit(f"no wheel for {sorted(missing)} in {dist}; run `make wheels`")
    return wheels


def check_wheel_contents(wheels: dict[str, Path]) -> dict[str, float]:
    """Fail unless each wheel holds what an install without a toolchain needs; their sizes."""
    with zipfile.ZipFile(wheels["pocketflow"]) as core:
        names = set(core.namelist())
        if SERVER_MEMBER not in names:
            raise SystemExit(f"{wheels['pocketflow'].name} has no {SERVER_MEMBER}")
        mode = core.getinfo(SERVER_MEMBER).external_attr >> 16
        if not mode & 0o111:
            raise SystemExit(f"{SERVER_MEMBER} is not executable in the wheel (mode {mode:o})")
        if not any(n.startswith("pocketflow/_core.") and n.endswith(".so") for n in names):
            raise SystemExit(f"{wheels['pocketflow'].name} has no native core pocketflow/_core")
    for name in ("pocketflow_lithops", "pocketflow_gg", "pocketflow_this"):
        if not wheels[name].name.endswith("-py3-none-any.whl"):
            raise SystemExit(f"{wheels[name].name} is not a pure-Python wheel")
    with zipfile.ZipFile(wheels["pocketflow_lithops"]) as lithops_wheel:
        if PTH_MEMBER not in lithops_wheel.namelist():
            raise SystemExit(f"{wheels['pocketflow_lithops'].name} has no {PTH_MEMBER}")
    return {name: round(path.stat().st_size / 2**20, 2) for name, path in wheels.items()}


def disk_bytes(root: Path) -> int:
    """Bytes ``root`` takes on disk (allocated blocks), like ``du``."""
    total = 0
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            total += path.lstat().st_blocks * 512
    return total


def make_venv(path: Path, env: dict[str, str]) -> tuple[Path, Path]:
    """A fresh virtualenv; its interpreter and site-packages."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], env=env, check=True,
                   timeout=PIP_TIMEOUT_S)
    python = path / "bin" / "python"
    site = Path(subprocess.run(
        [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        env=env, check=True, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
    ).stdout.strip())
    return python, site


def pip_install(python: Path, requirements: list[str], env: dict[str, str]) -> float:
    """``pip install`` into the virtualenv; the seconds it took."""
    started = time.perf_counter()
    subprocess.run([str(python), "-I", "-m", "pip", "install", "--quiet", *requirements],
                   env=env, check=True, timeout=PIP_TIMEOUT_S)
    return time.perf_counter() - started


def run_smoke(python: Path, venv: Path, what: str, env: dict[str, str]) -> dict[str, object]:
    """tests/smoke_install.py ``what`` with the virtualenv's interpreter, from outside the
    checkout, in isolated mode: it can import only what the virtualenv holds."""
    venv_env = dict(env, PATH=os.pathsep.join([str(venv / "bin"), env["PATH"]]),
                    VIRTUAL_ENV=str(venv))
    result = subprocess.run(
        [str(python), "-I", str(SMOKE_SCRIPT), what, "--binary-under", str(venv)],
        env=venv_env, cwd=venv, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"smoke {what} failed in {venv}:\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dist", type=Path, default=CHECKOUT / "dist")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the virtualenvs (printed)")
    args = parser.parse_args()

    wheels = find_wheels(args.dist)
    report: dict[str, object] = {"wheel_mib": check_wheel_contents(wheels)}
    env = toolchain_free_env()
    root = Path(tempfile.mkdtemp(prefix="pocketflow-wheels-"))
    try:
        client_venv = root / "client"
        python, site = make_venv(client_venv, env)
        before = disk_bytes(site)
        install_s = pip_install(python, [str(wheels["pocketflow"])], env)
        client = run_smoke(python, client_venv, "client", env)
        report["client_only"] = {
            "pip_install_s": round(install_s, 1),
            "site_packages_mib": round((disk_bytes(site) - before) / 2**20, 1),
            **client,
        }
        print(f"client-only install: {report['client_only']}", flush=True)

        cluster_venv = root / "cluster"
        python, site = make_venv(cluster_venv, env)
        before = disk_bytes(site)
        install_s = pip_install(python, [f"{wheels['pocketflow']}[cluster,lithops]",
                                         str(wheels["pocketflow_lithops"])], env)
        client = run_smoke(python, cluster_venv, "client", env)
        demo = run_smoke(python, cluster_venv, "demo", env)
        report["cluster"] = {
            "pip_install_s": round(install_s, 1),
            "site_packages_mib": round((disk_bytes(site) - before) / 2**20, 1),
            "first_job_s": round(install_s + float(demo["demo_s"]), 1),
            **client, **demo,
        }
        print(f"cluster install: {report['cluster']}", flush=True)
    finally:
        if args.keep:
            print(f"virtualenvs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    report["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                         "load_average": os.getloadavg()}
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("wheel smoke ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
