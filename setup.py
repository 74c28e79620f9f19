"""Build hook of the ``pocketflow`` package: its two Rust artifacts, built by setuptools-rust from
the Cargo workspace in ``servers/`` (the rest is setup.cfg). The adapters are packages of their
own under ``adapters/``.

- ``pocketflow._core``, the native client core (``servers/crates/pyclient``);
- ``pocketflow/_bin/pocketflow-server``, the storage server binary (``servers/crates/server``),
  inside the package, where ``server_process.find_server_binary`` looks first after its
  environment override. So a wheel carries both, and installing it needs no Rust toolchain:
  the CLI, ``LocalCluster`` and the client work from the wheel alone.

Both are built with ``--locked`` into the workspace's target directory (``servers/target``), so
a wheel built after ``make install`` reuses that build instead of compiling the workspace again.
Both are stripped of symbols: a client-only install is mostly these two files.
"""

from setuptools import setup
from setuptools_rust import Binding, RustExtension, Strip

CARGO_ARGS = ["--locked"]

NATIVE_CORE = RustExtension(
    "pocketflow._core",
    path="servers/crates/pyclient/Cargo.toml",
    binding=Binding.PyO3,
    debug=False,
    args=CARGO_ARGS,
    strip=Strip.All,
)

# An executable, not a module: the Exec binding copies the built binary to the dotted target's
# path inside the package (pocketflow/_bin/pocketflow-server) and marks it executable.
# Built with the whole workspace, as `make server` and `cargo test --workspace` build it: cargo
# unifies dependency features over the packages it builds, so the server alone would get
# dependencies of other features, compiled a second time (minutes on CI) for the same binary.
SERVER_BINARY = RustExtension(
    {"pocketflow-server": "pocketflow._bin.pocketflow-server"},
    path="servers/crates/server/Cargo.toml",
    binding=Binding.Exec,
    debug=False,
    args=[*CARGO_ARGS, "--workspace"],
    strip=Strip.All,
)

setup(rust_extensions=[NATIVE_CORE, SERVER_BINARY], zip_safe=False)
