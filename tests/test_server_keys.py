"""Key material handed to a real storage server over stdin (``--keys-from-stdin``): the cluster
secret and a TLS certificate and key from the cluster CA reach the server without a key path on
its command line, and it serves TLS clients of that CA with tokens of that secret."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures_servers import CLIENT_OPTIONS, KeyedServer, ServerSet, start_keyed_server

from pocketflow import connect
from pocketflow.auth import new_secret
from pocketflow.errors import PermissionDenied
from pocketflow.handle import ServerInfo
from pocketflow.tls import issue_server_cert, make_cluster_ca, read_ca


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[ServerSet, KeyedServer]]:
    """A TLS server on 127.0.0.1 whose secret, certificate and key came over stdin only."""
    secret = new_secret()
    make_cluster_ca(tmp_path)
    server = start_keyed_server(secret, issue_server_cert(tmp_path, "keyed-0", "127.0.0.1"))
    try:
        assert server.ready_fields[-1] == "tls", server.ready_fields
        servers = ServerSet(secret, tmp_path / "no-secret-file", tls_ca=read_ca(tmp_path))
        servers.infos.append(ServerInfo("keyed-0", server.address, "dram", 1.0, False))
        yield servers, server
    finally:
        server.stop()


def test_a_server_keyed_over_stdin_serves_tls_clients_of_its_secret(
    keyed: tuple[ServerSet, KeyedServer],
) -> None:
    servers, server = keyed
    command_line = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().decode()
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
