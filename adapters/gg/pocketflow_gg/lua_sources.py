"""The real project the adapter builds: Lua 5.4 from the sources inside the PyPI sdist of lupa
(``third-party/lua54/``, Lua's own developer makefile), downloaded once with pip and cached."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from pocketflow_gg.errors import GGError

LUPA_VERSION = "2.8"
CACHE_DIR = Path(os.environ.get("POCKETFLOW_GG_CACHE", Path.home() / ".cache" / "pocketflow-gg"))
DOWNLOAD_TIMEOUT_S = 900.0
LUA_DIR_IN_SDIST = f"lupa-{LUPA_VERSION}/third-party/lua54"


class SourcesUnavailable(GGError):
    """The lupa sdist could not be downloaded (no network, no index)."""


def lupa_sdist(cache_dir: Path = CACHE_DIR) -> Path:
    """The cached ``lupa-2.8.tar.gz``, downloaded with ``pip download`` when missing."""
    sdist = cache_dir / f"lupa-{LUPA_VERSION}.tar.gz"
    if sdist.is_file():
        return sdist
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", "lupa", "--no-deps",
           "--disable-pip-version-check", f"lupa=={LUPA_VERSION}", "-d", str(cache_dir)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True,
                                timeout=DOWNLOAD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise SourcesUnavailable(f"pip download lupa=={LUPA_VERSION} timed out") from exc
    if result.returncode != 0 or not sdist.is_file():
        raise SourcesUnavailable(f"pip download lupa=={LUPA_VERSION} failed: "
                                 f"{result.stderr[-1500:]}")
    return sdist


def lua_sources(dest: Path, cache_dir: Path = CACHE_DIR) -> Path:
    """A fresh copy of Lua's source directory (with its makefile) under ``dest``."""
    sdist = lupa_sdist(cache_dir)
    extracted = cache_dir / LUA_DIR_IN_SDIST
    if not (extracted / "makefile").is_file():
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(LUA_DIR_IN_SDIST + "/") and (m.isfile() or m.isdir())]
            tar.extractall(cache_dir, members=members, filter="data")
    target = Path(dest) / "lua54"
    shutil.copytree(extracted, target, ignore=shutil.ignore_patterns(".git", "testes", "manual"))
    return target
