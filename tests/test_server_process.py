"""Starting a storage server process: failures surface as ServerStartError."""

from __future__ import annotations

from pathlib import Path

import pytest

from pocketflow.errors import ServerStartError
from pocketflow.server_process import ServerSpec, StorageServerProcess


def test_unrunnable_binary_is_a_server_start_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = tmp_path / "pocketflow-server"
    binary.write_text("not a program\n")
    binary.chmod(0o644)  # exists, but cannot be executed
    monkeypatch.setenv("POCKETFLOW_SERVER_BIN", str(binary))
    spec = ServerSpec(node_id="x-0", tier="dram", capacity_bytes=1 << 20,
                      secret_file=tmp_path / "secret")
    process = StorageServerProcess(spec)
    with pytest.raises(ServerStartError, match="cannot run"):
        process.start(timeout_s=5)
    assert process.stop() is None


def test_stop_closes_the_output_pipes(tmp_path: Path) -> None:
    from pocketflow.auth import write_secret_file

    secret_file = tmp_path / "secret"
    write_secret_file(secret_file)
    spec = ServerSpec(node_id="pipes-0", tier="dram", capacity_bytes=1 << 20,
                      secret_file=secret_file, threads=1)
    process = StorageServerProcess(spec)
    process.start()
    proc = process._proc
    assert proc is not None and proc.stdout is not None and proc.stderr is not None
    try:
        assert not proc.stdout.closed
    finally:
        assert process.stop() == 0
    assert proc.stdout.closed and proc.stderr.closed
