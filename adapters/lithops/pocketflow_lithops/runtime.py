"""A Lithops localhost runtime that loads pocketflow's client once per job instead of once per task.

Lithops' localhost executor starts one interpreter per job (its runner), which forks the worker
processes, which fork one process per task. Lithops' own storage backend is loaded in the
workers before they fork (they open it to report each call), so every task process inherits
it; pocketflow's client, used only by the task function, would be imported again by each task
process, some 10 ms per task on this machine. This runtime is the interpreter with the client
and the shuffle's task module loaded first, so the runner passes them down to every fork:

    fexec = lithops.FunctionExecutor(config={..., "localhost": {"runtime": runtime_path()}})

``runtime_path()`` is the ``pocketflow-lithops-runtime`` command that installing this package
puts beside the interpreter (``pip install adapters/lithops``). Lithops runs it as it would run
the interpreter, ``runtime <runner script> <command> [args]``; any other command line is handed
to the interpreter itself. Loading the modules starts no thread and opens no connection (the
client's native runtime is made on first use, in the process that uses it), so forking stays
safe.
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
import sysconfig
from pathlib import Path

__all__ = ["RUNTIME_COMMAND", "RUNTIME_PACKAGES", "PRELOADED_MODULES", "main", "runtime_path"]

RUNTIME_COMMAND = "pocketflow-lithops-runtime"
"""The console command of this runtime (``setup.cfg``)."""
RUNTIME_PACKAGES = ("pocketflow", "pocketflow_lithops")
"""Packages a Lithops runtime must have installed (the native client core cannot travel as a
pickled module), passed to every ``fexec.map`` of a shuffle as ``exclude_modules``: Lithops'
dependency analysis then neither walks nor ships them, which with an editable install cost
each job about 0.3 s before its first task started, and workers run the installed code."""
PRELOADED_MODULES = (
    "pocketflow.client",
    "pocketflow_lithops.shuffle_tasks",
    "pocketflow_lithops.worker_clients",
)
"""What the runtime loads before Lithops' runner starts: what every shuffle task imports."""


def runtime_path() -> str:
    """The path of the ``pocketflow-lithops-runtime`` command of this interpreter's environment.

    Raises ``FileNotFoundError`` when the package was installed without its scripts (then use
    ``sys.executable`` as the runtime: tasks import the client themselves).
    """
    candidates = [Path(sysconfig.get_path("scripts")) / RUNTIME_COMMAND,
                  Path(sys.executable).parent / RUNTIME_COMMAND]
    user_scheme = f"{os.name}_user"
    if user_scheme in sysconfig.get_scheme_names():
        candidates.append(Path(sysconfig.get_path("scripts", user_scheme)) / RUNTIME_COMMAND)
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(RUNTIME_COMMAND)
    if found is not None:
        return found
    raise FileNotFoundError(
        f"{RUNTIME_COMMAND} is not installed beside {sys.executable} (looked in "
        f"{', '.join(str(c.parent) for c in candidates)} and PATH); install pocketflow-lithops "
        f"with pip, or use sys.executable as Lithops' runtime"
    )


def main(argv: list[str] | None = None) -> None:
    """Load :data:`PRELOADED_MODULES`, then run ``argv[0]`` (a script) with the rest of the
    arguments as the interpreter would; any other command line goes to the interpreter."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-") or not os.path.isfile(args[0]):
        # Not a script to run (an option such as -c, or nothing): the interpreter handles it.
        os.execv(sys.executable, [sys.executable, *args])
    for module in PRELOADED_MODULES:
        __import__(module)
    script = os.path.abspath(args[0])
    sys.argv = [script, *args[1:]]
    sys.path[0] = os.path.dirname(script)  # as the interpreter sets it for a script
    runpy.run_path(script, run_name="__main__")
