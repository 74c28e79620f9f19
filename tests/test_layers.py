"""The client's layers import one way only: placement and sessions under the object layout, the
object layout under the file objects, all of them under the API (``pocketflow.client``).

Every import of a ``pocketflow`` module counts, wherever it stands in a file (top level, inside a
function, under ``TYPE_CHECKING``), since each of those is a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pocketflow

PACKAGE_DIR = Path(pocketflow.__file__).parent

LAYERS = [
    ["records", "errors", "config", "handle", "protocol", "placement"],
    ["transport"],
    ["layout"],
    ["objectfile"],
    ["client"],
]
"""The data path's modules, bottom first; a module may import only modules of lower layers (and
of its own layer, for the leaf modules of the first one)."""


def _imports_of(module: str) -> set[str]:
    """The ``pocketflow`` modules that ``pocketflow/<module>.py`` imports anywhere."""
    tree = ast.parse((PACKAGE_DIR / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "pocketflow":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("pocketflow."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("pocketflow."):
                    found.add(alias.name.split(".")[1])
    return found


def test_each_layer_imports_only_the_layers_below_it() -> None:
    rank = {module: level for level, modules in enumerate(LAYERS) for module in modules}
    upward = []
    for module, level in rank.items():
        for imported in _imports_of(module):
            if imported in rank and rank[imported] > level:
                upward.append(f"{module} imports {imported}")
            if imported in rank and rank[imported] == level and level > 0:
                upward.append(f"{module} imports {imported} of its own layer")
    assert upward == []


def test_the_data_path_modules_have_no_import_cycle() -> None:
    modules = [module for layer in LAYERS for module in layer]
    graph = {module: _imports_of(module) & set(modules) for module in modules}
    state: dict[str, str] = {}
    cycles: list[str] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                cycles.append(" -> ".join([*path, module, imported]))
            elif imported not in state:
                visit(imported, [*path, module])
        state[module] = "done"

    for module in modules:
        if module not in state:
            visit(module, [])
    assert cycles == []


def test_the_layer_list_names_real_modules_that_import_something() -> None:
    # Guards the two tests above against a renamed module or a parser that finds nothing.
    for layer in LAYERS:
        for module in layer:
            assert (PACKAGE_DIR / f"{module}.py").is_file(), module
    assert "layout" in _imports_of("objectfile")
    assert {"layout", "objectfile", "transport"} <= _imports_of("client")


def _fresh_interpreter_output(script: str) -> list[str]:
    """What ``script`` prints, split, run in a new interpreter (so nothing is imported yet)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=True).stdout.split()


def test_a_task_that_only_connects_does_not_import_the_control_plane() -> None:
    """``import pocketflow`` leaves the cluster and job modules (and Ray) to first use: a
    Lithops function runs in a fresh process each time and pays every import again."""
    script = (
        "import sys, pocketflow\n"
        "heavy = sorted(m for m in ('pocketflow.cluster', 'pocketflow.job', 'pocketflow.control',"
        " 'ray', 'psutil') if m in sys.modules)\n"
        "print(','.join(heavy) or '-')\n"
        "from pocketflow import Hints, LocalCluster, register_job\n"
        "assert Hints.__module__ == 'pocketflow.hints' and callable(register_job)\n"
        "assert LocalCluster.__module__ == 'pocketflow.cluster'\n"
        "assert {'LocalCluster', 'Hints'} <= set(dir(pocketflow))\n"
        "try:\n"
        "    pocketflow.NoSuchName\n"
        "except AttributeError:\n"
        "    print('ok')\n"
    )
    out = _fresh_interpreter_output(script)
    assert out == ["-", "ok"], out


def test_a_module_of_the_package_used_for_something_else_does_not_import_the_client() -> None:
    """``pocketflow.demo``'s record functions (which a plain Lithops sort uses as its workload)
    cost no client, native core or handle; the client's names load on first use."""
    script = (
        "import sys, pocketflow.demo\n"
        "loaded = sorted(m for m in ('pocketflow.client', 'pocketflow._core', 'pocketflow.handle',"
        " 'pocketflow.channels', 'pocketflow.notifications', 'pocketflow.protocol')"
        " if m in sys.modules)\n"
        "print(','.join(loaded) or '-')\n"
        "import pocketflow\n"
        "assert pocketflow.connect.__module__ == 'pocketflow.client'\n"
        "assert pocketflow.Queue.__module__ == 'pocketflow.channels'\n"
        "from pocketflow import Client, JobHandle, Listener\n"
        "assert {'connect', 'Client', 'JobHandle'} <= set(dir(pocketflow))\n"
        "print('ok')\n"
    )
    out = _fresh_interpreter_output(script)
    assert out == ["-", "ok"], out


def test_a_client_that_puts_and_gets_leaves_channels_notifications_and_files_to_first_use() -> None:
    """``import pocketflow.client`` loads no queue, append-file, listener or file-object module
    (each Lithops task is a new process that pays every import again); the methods that need
    them load them, and their defaults are the modules' own."""
    script = (
        "import sys, inspect, pocketflow.client as c\n"
        "lazy = ('pocketflow.channels', 'pocketflow.notifications', 'pocketflow.objectfile')\n"
        "print(','.join(m for m in lazy if m in sys.modules) or '-')\n"
        "from pocketflow.channels import APPEND_SEGMENT_DEFAULT_BYTES\n"
        "from pocketflow.notifications import SUBSCRIBER_EVENTS_DEFAULT\n"
        "params = inspect.signature(c.Client.append_file).parameters\n"
        "assert params['segment_bytes'].default == APPEND_SEGMENT_DEFAULT_BYTES\n"
        "params = inspect.signature(c.Client.subscribe).parameters\n"
        "assert params['capacity'].default == SUBSCRIBER_EVENTS_DEFAULT\n"
        "print('ok')\n"
    )
    out = _fresh_interpreter_output(script)
    assert out == ["-", "ok"], out


ADAPTER_PACKAGES = ("pocketflow_lithops", "pocketflow_gg", "pocketflow_this")
"""The framework adapters' packages (``adapters/``), which build on the core, never under it."""


def test_the_core_imports_no_adapter() -> None:
    """No module of ``pocketflow`` imports an adapter, wherever the import stands: an adapter
    plugs into the core through its hooks (the demo's runners are found by entry point)."""
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [])
            found.extend(f"{path.relative_to(PACKAGE_DIR)} imports {name}" for name in names
                         if name.split(".")[0] in ADAPTER_PACKAGES)
    assert found == []


HEAVY_PACKAGES = ("ray", "lithops", "pyarrow", "numpy", "grpc", "cryptography", "psutil")
"""What a client-only install does not have (setup.cfg: they come with the extras)."""


def test_a_task_that_connects_with_a_handle_and_does_io_loads_no_extra(job_handle) -> None:
    """``pip install pocketflow`` brings no Ray, Lithops or pyarrow: a task that imports the
    package, connects with its job's handle and puts and gets must not need them."""
    from fixtures_servers import run_with_handle

    script = (
        "import sys, pocketflow\n"
        "with pocketflow.connect(sys.stdin.read()) as pf:\n"
        "    pf.create_bucket('b')\n"
        "    pf.put('b', 'k', b'v')\n"
        "    assert pf.get('b', 'k', delete=True) == b'v'\n"
        "    list(pf.enumerate('b'))\n"
        f"loaded = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY_PACKAGES!r}))\n"
        "print(','.join(loaded) or '-')\n"
    )
    assert run_with_handle(script, job_handle, timeout_s=60) == ["-"]


DEFERRED_STDLIB = ("logging", "concurrent.futures", "pathlib", "dataclasses", "typing", "inspect",
                   "ast")
"""Standard-library modules a task that connects, puts and gets does not need: each costs a
fresh process milliseconds it would pay for nothing (benchmarks/import_connect.py). The client's
value classes are ``pocketflow.records`` classes, not dataclasses or ``typing.NamedTuple``s, and
its type-only names are imported under ``TYPE_CHECKING``, for ``dataclasses`` and ``typing`` (and
``inspect`` and ``ast``, which ``dataclasses`` imports) were a third of that time."""


def test_a_task_that_connects_puts_and_gets_leaves_modules_it_does_not_need_to_first_use(
    job_handle,
) -> None:
    """Run without ``site`` (``-S``), as a fresh virtualenv with only the core wheel would: an
    editable install's import finders, run from ``.pth`` files at startup, load ``pathlib``,
    ``typing`` and ``re`` before any of our code, which hid these imports from a measurement in
    a development environment."""
    import subprocess
    import sys

    with pocketflow.connect(job_handle) as pf:
        pf.create_bucket("b")
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(PACKAGE_DIR.parent)!r})\n"
        f"deferred = {DEFERRED_STDLIB!r}\n"
        "preloaded = [m for m in deferred if m in sys.modules]\n"
        "import pocketflow\n"
        "pf = pocketflow.connect(sys.stdin.read())\n"
        "pf.put('b', 'k', b'v')\n"
        "assert pf.get('b', 'k', delete=True) == b'v'\n"
        "pf.close()\n"
        "loaded = [m for m in deferred if m in sys.modules]\n"
        "print(','.join(preloaded) or '-', ','.join(loaded) or '-')\n"
    )
    result = subprocess.run([sys.executable, "-S", "-c", script], input=job_handle.to_json(),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["-", "-"], result.stdout
