"""Starting a storage server process: failures surface as ServerStartError."""

from __future__ import annotations

import ssl
import urllib.request
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


@pytest.mark.parametrize("tls", [False, True])
def test_keys_reach_the_server_over_stdin_and_nowhere_else(tls: bool) -> None:
    """Issue 29 item 5 (contract C): a server started with ``ServerKeys`` reads its secret (and
    TLS identity) from stdin: its command line names no key and holds no secret, and a job's
    token made with that secret is accepted."""
    from pocketflow.auth import make_token, new_secret
    from pocketflow.client import connect
    from pocketflow.handle import JobHandle, ServerInfo
    from pocketflow.server_process import ServerKeys
    from pocketflow.tls import new_cluster_ca, server_key_and_request
    from pocketflow.transport import AdminClient

    secret = new_secret()
    ca = new_cluster_ca() if tls else None
    cert = key = None
    if ca is not None:
        key, request = server_key_and_request("keys-0", "127.0.0.1")
        cert = ca.sign(request, "keys-0")
    process = StorageServerProcess(ServerSpec(
        node_id="keys-0", tier="dram", capacity_bytes=1 << 20, threads=1,
        keys=ServerKeys(secret=secret, tls_cert_pem=cert, tls_key_pem=key),
    ))
    address = process.start()
    try:
        with open(f"/proc/{process.pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read().split(b"\0")
        assert b"--keys-from-stdin" in argv and secret not in b" ".join(argv)
        assert not {b"--secret-file", b"--tls-cert", b"--tls-key"} & set(argv)
        tls_ca = ca.cert_pem if ca is not None else None
        handle = JobHandle(job_id="keys-job", name="keys", epoch=1,
                           servers=(ServerInfo("keys-0", address, "dram", 1.0),),
                           token=make_token(secret, "keys-job", ttl_s=60), tls_ca=tls_ca)
        with AdminClient(address, make_token(secret, "__admin__", ttl_s=60),
                         tls_ca=tls_ca) as admin:
            admin.set_epoch(handle.job_id, handle.epoch, handle.weight_map())
        with connect(handle, op_timeout_s="5s") as pf:
            pf.create_bucket("b")
            pf.put("b", "k", b"v")
            assert pf.get("b", "k") == b"v"
        # Issue 29 item 6 (contract B): a TLS server's metrics are served over HTTPS with its
        # certificate, and its metrics URL says so; a scraper trusting the cluster CA reads them.
        url = process.metrics_url
        assert url is not None and url.startswith("https://" if tls else "http://"), url
        context = None
        if ca is not None:
            context = ssl.create_default_context(cadata=ca.cert_pem)
        with urllib.request.urlopen(url, timeout=10, context=context) as reply:
            assert b"pocketflow_requests_total" in reply.read()
    finally:
        assert process.stop() == 0
