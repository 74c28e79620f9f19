"""TLS between clients and real storage server processes: a server with a certificate from a
cluster CA serves both of its protocols (direct and Flight) over TLS; every wrong pairing is
refused with a ``TlsError`` that names its cause (a plaintext client, a TLS client of a
plaintext server, another CA, an expired certificate, a certificate for another address); tokens
are still checked on top of TLS."""

from __future__ import annotations

import datetime
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures_servers import CLIENT_OPTIONS, ServerSet, _require_binary

from pocketflow import connect
from pocketflow.auth import make_token
from pocketflow.errors import PermissionDenied, TlsError
from pocketflow.server_process import ServerSpec, StorageServerProcess
from pocketflow.tls import issue_server_cert, make_cluster_ca, read_ca

CAPACITY_BYTES = 64 * 1024 * 1024
BIG_BYTES = 3 * 1024 * 1024 + 17
"""Over the test block size: the object travels as several data blocks."""

TRANSPORTS = ("direct", "flight")


@pytest.fixture(scope="module")
def tls_servers(
    cluster_secret_file: tuple[bytes, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerSet]:
    """One TLS server (tls-0) with a certificate for 127.0.0.1 from a fresh cluster CA."""
    _require_binary()
    secret, secret_file = cluster_secret_file
    tls_dir = tmp_path_factory.mktemp("tls")
    make_cluster_ca(tls_dir)
    servers = ServerSet(secret, secret_file, tls_ca=read_ca(tls_dir))
    cert = issue_server_cert(tls_dir, "tls-0", "127.0.0.1")
    try:
        servers.start("tls-0", "dram", CAPACITY_BYTES, long_running=True, tls=cert)
        yield servers
    finally:
        servers.stop_all()


@pytest.mark.parametrize("small_ops", TRANSPORTS)
def test_a_tls_server_serves_small_and_large_objects_on_both_paths(
    tls_servers: ServerSet, small_ops: str
) -> None:
    handle = tls_servers.handle()
    big = os.urandom(BIG_BYTES)
    try:
        with connect(handle, small_ops=small_ops, **CLIENT_OPTIONS) as pf:
            pf.create_bucket("b")
            pf.put("b", "small", b"over tls")
            pf.put("b", "big", big)
            assert pf.get("b", "small") == b"over tls"
            assert pf.get("b", "big") == big
            assert sorted(o.key for o in pf.list("b")) == ["big", "small"]
    finally:
        tls_servers.delete_job(handle)


def test_the_cluster_files_are_private(tmp_path: Path) -> None:
    make_cluster_ca(tmp_path)
    issue_server_cert(tmp_path, "s", "127.0.0.1")
    files = [tmp_path / "ca.pem", tmp_path / "ca.key", tmp_path / "servers" / "s.pem",
             tmp_path / "servers" / "s.key"]
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert "PRIVATE KEY" not in read_ca(tmp_path)


@pytest.mark.parametrize("small_ops", TRANSPORTS)
def test_a_plaintext_client_is_told_the_server_needs_tls(
    tls_servers: ServerSet, small_ops: str
) -> None:
    handle = tls_servers.handle().replace(tls_ca=None)
    with connect(handle, small_ops=small_ops, **CLIENT_OPTIONS) as pf:
        with pytest.raises(TlsError, match="TLS") as refused:
            pf.put("b", "k", b"v")
    assert "accepts TLS connections only" in str(refused.value)


@pytest.mark.parametrize("small_ops", TRANSPORTS)
def test_a_tls_client_of_a_plaintext_server_is_told_so(
    storage_servers: ServerSet, tls_servers: ServerSet, small_ops: str
) -> None:
    handle = storage_servers.handle().replace(tls_ca=tls_servers.tls_ca)
    try:
        with connect(handle, small_ops=small_ops, **CLIENT_OPTIONS) as pf:
            with pytest.raises(TlsError, match="plaintext server"):
                pf.put("b", "k", b"v")
    finally:
        storage_servers.delete_job(handle)


@pytest.mark.parametrize("small_ops", TRANSPORTS)
def test_a_client_that_trusts_another_ca_is_refused(
    tls_servers: ServerSet, tmp_path: Path, small_ops: str
) -> None:
    make_cluster_ca(tmp_path, name="another CA")
    handle = tls_servers.handle().replace(tls_ca=read_ca(tmp_path))
    with connect(handle, small_ops=small_ops, **CLIENT_OPTIONS) as pf:
        with pytest.raises(TlsError, match="not signed by the trusted CA"):
            pf.put("b", "k", b"v")


@pytest.mark.parametrize("small_ops", TRANSPORTS)
def test_another_clusters_ca_is_named_apart_and_refused_as_such(
    tls_servers: ServerSet, tmp_path: Path, small_ops: str
) -> None:
    """Issue 29 item 8: two clusters' CAs made the same way have names of their own, so a
    client holding the other cluster's CA gets the documented error, not a bad signature."""
    make_cluster_ca(tmp_path)
    handle = tls_servers.handle().replace(tls_ca=read_ca(tmp_path))
    assert _ca_subject(handle.tls_ca) != _ca_subject(tls_servers.tls_ca)
    with connect(handle, small_ops=small_ops, **CLIENT_OPTIONS) as pf:
        with pytest.raises(TlsError, match="not signed by the trusted CA"):
            pf.put("b", "k", b"v")


def _ca_subject(pem: str | None) -> str:
    from cryptography import x509

    assert pem is not None
    return x509.load_pem_x509_certificate(pem.encode()).subject.rfc4514_string()


def _refusal_of_a_server_with(
    servers: ServerSet, secret_file: Path, node_id: str, host: str,
    **cert_times: datetime.datetime,
) -> TlsError:
    """Start a server whose certificate the trusted CA signed for ``host`` (with
    ``cert_times``), and return the error a client trusting that CA gets from it."""
    # The session's CA: only the certificate's name or dates differ from a good one.
    ca_dir = Path(servers.processes[0].spec.tls.cert).parents[1]  # type: ignore[union-attr]
    cert = issue_server_cert(ca_dir, node_id, host, **cert_times)
    process = StorageServerProcess(ServerSpec(
        node_id=node_id, tier="dram", capacity_bytes=CAPACITY_BYTES, secret_file=secret_file,
        threads=1, tls=cert,
    ))
    process.start()
    try:
        handle = servers.handle(set_epoch=False).replace(
            servers=(servers.infos[0].replace(node_id=node_id, address=process.address),),
        )
        with connect(handle, **CLIENT_OPTIONS) as pf:
            with pytest.raises(TlsError) as refused:
                pf.put("b", "k", b"v")
    finally:
        process.stop()
    return refused.value


def test_an_expired_certificate_is_refused(
    tls_servers: ServerSet, cluster_secret_file: tuple[bytes, Path]
) -> None:
    now = datetime.datetime.now(datetime.UTC)
    refused = _refusal_of_a_server_with(
        tls_servers, cluster_secret_file[1], "expired-0", "127.0.0.1",
        not_before=now - datetime.timedelta(days=10), not_after=now - datetime.timedelta(days=1),
    )
    assert "expired" in str(refused)


def test_a_certificate_for_another_address_is_refused(
    tls_servers: ServerSet, cluster_secret_file: tuple[bytes, Path]
) -> None:
    # Signed by the trusted CA, but naming 127.0.0.9 while the server listens on 127.0.0.1.
    refused = _refusal_of_a_server_with(
        tls_servers, cluster_secret_file[1], "misnamed-0", "127.0.0.9"
    )
    assert "does not name this address" in str(refused)


def test_tokens_are_still_checked_over_tls(tls_servers: ServerSet) -> None:
    handle = tls_servers.handle()
    forged = handle.replace(
        token=make_token(b"another secret of sixteen bytes", handle.job_id, ttl_s=60)
    )
    try:
        with connect(forged, **CLIENT_OPTIONS) as pf:
            with pytest.raises(PermissionDenied) as refused:
                pf.put("b", "k", b"v")
        assert not isinstance(refused.value, TlsError)
    finally:
        tls_servers.delete_job(handle)


def test_a_server_on_a_node_address_refuses_to_start_without_tls(
    cluster_secret_file: tuple[bytes, Path],
) -> None:
    _require_binary()
    # 192.0.2.1 (TEST-NET-1) is never bound: the flag check comes before any bind.
    process = StorageServerProcess(ServerSpec(
        node_id="plain-node", tier="dram", capacity_bytes=CAPACITY_BYTES,
        secret_file=cluster_secret_file[1], listen_host="192.0.2.1",
    ))
    with pytest.raises(Exception, match="needs TLS"):
        process.start(timeout_s=20)
    assert not process.alive()
