"""Build hook of the ``pocketflow`` package: the native client core ``pocketflow._core`` (Rust,
built by setuptools-rust from ``servers/crates/pyclient``); the rest is setup.cfg. The adapters
are packages of their own under ``adapters/``."""

from setuptools import setup
from setuptools_rust import Binding, RustExtension

NATIVE_CORE = RustExtension(
    "pocketflow._core",
    path="servers/crates/pyclient/Cargo.toml",
    binding=Binding.PyO3,
    debug=False,
)

setup(rust_extensions=[NATIVE_CORE], zip_safe=False)
