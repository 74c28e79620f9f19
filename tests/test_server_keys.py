"""Key material handed to a real storage server over stdin (``--keys-from-stdin``): the cluster
secret and a TLS certificate and key from the cluster CA reach the server without a key path on
its command line, and it serves TLS clients of that CA with tokens of that secret."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures_servers import CLIENT_OPTIONS, ServerSet, _require_binary

from pocketflow import connect
from pocketflow.auth import new_secret
from pocketflow.errors import PermissionDenied
from pocketflow.handle import ServerInfo
from pocketflow.protocol import READY_LINE_PREFIX
from pocketflow.server_process import find_server_binary
from pocketflow.tls import issue_server_cert, make_cluster_ca, read_ca

CAPACITY = "32MiB"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


@pytest.fixture
def stdin_keyed_server(tmp_path: Path) -> Iterator[tuple[ServerSet, subprocess.Popen[str]]]:
    """A TLS server on 127.0.0.1 whose secret, certificate and key came over stdin only."""
    _require_binary()
    secret = new_secret()
    make_cluster_ca(tmp_path)
    cert = issue_server_cert(tmp_path, "keyed-0", "127.0.0.1")
    document = {
        "secret_hex": secret.hex(),
        "tls_cert_pem": cert.cert.read_text(),
        "tls_key_pem": cert.key.read_text(),
    }
    process = subprocess.Popen(
        [str(find_server_binary()), "--tier", "dram", "--capacity", CAPACITY,
         "--listen", "127.0.0.1:0", "--node-id", "keyed-0", "--threads", "2",
         "--keys-from-stdin"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(document))
        process.stdin.flush()
        ready = process.stdout.readline().split()
        assert ready[:1] == [READY_LINE_PREFIX] and ready[-1] == "tls", ready
        servers = ServerSet(secret, tmp_path / "no-secret-file", tls_ca=read_ca(tmp_path))
        servers.infos.append(ServerInfo("keyed-0", ready[1], "dram", 1.0, False))
        yield servers, process
    finally:
        process.terminate()
        process.wait(timeout=STOP_TIMEOUT_S)


def test_a_server_keyed_over_stdin_serves_tls_clients_of_its_secret(
    stdin_keyed_server: tuple[ServerSet, subprocess.Popen[str]],
) -> None:
    servers, process = stdin_keyed_server
    command_line = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode()
    assert "secret" not in command_line and ".key" not in command_line, command_line
    handle = servers.handle()
    for small_ops in ("direct", "flight"):
        with connect(handle, small_ops=small_ops, **CLIENT_OPTIONS) as pf:
            bucket = f"b-{small_ops}"
            pf.create_bucket(bucket)
            pf.put(bucket, "k", b"keyed over stdin")
            assert pf.get(bucket, "k") == b"keyed over stdin"
    # A token of another secret is refused.
    stranger = ServerSet(new_secret(), servers.secret_file, tls_ca=servers.tls_ca)
    stranger.infos.extend(servers.infos)
    forged = stranger.handle(set_epoch=False)
    with connect(forged, **CLIENT_OPTIONS) as pf, pytest.raises(PermissionDenied):
        pf.create_bucket("forged")
