"""What a task process pays to start using pocketflow: ``import pocketflow`` + ``connect(handle)``
in a fresh process, from a fresh virtualenv that holds the core wheel and nothing else (issue
33's goal: <= 25 ms and <= 30 MB resident).

::

    python -m benchmarks.import_connect --runs 41 --out /tmp/import-connect.json
    python -m benchmarks.import_connect --wheel dist/pocketflow-0.1.0-*.whl --runs 41

Without ``--wheel`` it builds the core wheel first (``pip wheel --no-deps .``, which reuses
``servers/target`` after ``make install``: seconds, not a compile). It then installs the wheel
into a fresh virtualenv and runs ``tests/smoke_install.py client --runs N`` with that
virtualenv's interpreter in isolated mode: one storage server from the wheel's binary, and N
fresh processes that each import ``pocketflow``, connect with the job's handle (timed: wall
clock, and CPU time, which a loaded machine inflates less), then put and get back an object.
It reports the medians and quartiles of N and, for scale, the CPU time the interpreter spent
starting before the timed part (not counted in the goal).

Why a fresh virtualenv: a development environment's editable installs run import finders from
``.pth`` files at interpreter start, which load ``typing``, ``re``, ``pathlib`` and some hundred
other modules before the timer starts, so a measurement there leaves out most of the cost.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
SMOKE_SCRIPT = CHECKOUT / "tests" / "smoke_install.py"
RUNS_DEFAULT = 41
STEP_TIMEOUT_S = 900.0
"""Bound on each step (building the wheel, the virtualenv, the install, the runs)."""
FIGURES = ("import_connect_ms", "import_connect_cpu_ms", "startup_cpu_ms", "rss_mib")


def clean_env() -> dict[str, str]:
    """This environment without a Python path or virtualenv: the virtualenv's interpreter and
    its children must import only what the virtualenv holds."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")}


def build_wheel(out_dir: Path, env: dict[str, str]) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--disable-pip-version-check", "--wheel-dir", str(out_dir), str(CHECKOUT)],
                   env=env, check=True, timeout=STEP_TIMEOUT_S)
    (wheel,) = out_dir.glob("pocketflow-*.whl")
    return wheel


def quartiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"p25": values[0], "median": values[0], "p75": values[0]}
    p25, median, p75 = statistics.quantiles(values, n=4, method="inclusive")
    return {"p25": round(p25, 2), "median": round(median, 2), "p75": round(p75, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, default=None,
                        help="the core wheel (default: build one from this checkout)")
    parser.add_argument("--runs", type=int, default=RUNS_DEFAULT,
                        help="fresh connecting processes (tests/smoke_install.py bounds it)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    env = clean_env()
    root = Path(tempfile.mkdtemp(prefix="pocketflow-import-connect-"))
    try:
        wheel = args.wheel.resolve() if args.wheel else build_wheel(root / "dist", env)
        venv = root / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], env=env, check=True,
                       timeout=STEP_TIMEOUT_S)
        python = venv / "bin" / "python"
        subprocess.run([str(python), "-I", "-m", "pip", "install", "--quiet", "--no-deps",
                        "--disable-pip-version-check", str(wheel)],
                       env=env, check=True, timeout=STEP_TIMEOUT_S)
        result = subprocess.run(
            [str(python), "-I", str(SMOKE_SCRIPT), "client", "--binary-under", str(venv),
             "--runs", str(args.runs)],
            env=env, cwd=venv, capture_output=True, text=True, timeout=STEP_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0:
            raise SystemExit(f"the smoke run failed:\n{result.stdout}\n{result.stderr}")
        smoke = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)

    report: dict[str, object] = {
        "wheel": wheel.name, "runs": args.runs,
        **{figure: quartiles(smoke[f"{figure}_runs"]) for figure in FIGURES},
        "modules_loaded": smoke["modules_loaded"], "heavy_modules": smoke["heavy_modules"],
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "load_average": [round(x, 2) for x in os.getloadavg()]},
    }
    for figure in FIGURES:
        print(f"{figure:>22}: {report[figure]}")
    print(f"{'modules_loaded':>22}: {smoke['modules_loaded']}")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
