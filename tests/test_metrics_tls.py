"""The metrics listener of a real storage server follows the TLS rule of its other listeners: a
server with a TLS identity serves ``/metrics`` over HTTPS with that certificate (a plain HTTP
scrape gets nothing), plain HTTP only with ``--metrics-plaintext``; a server without TLS serves
plain HTTP on loopback, and refuses to start with metrics on another address unless opted in."""

from __future__ import annotations

import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from fixtures_servers import start_keyed_server

from pocketflow.auth import new_secret
from pocketflow.server_process import find_server_binary
from pocketflow.tls import issue_server_cert, make_cluster_ca

SCRAPE_TIMEOUT_S = 10.0


def metrics_address(fields: list[str]) -> str:
    return next(f.removeprefix("metrics=") for f in fields if f.startswith("metrics="))


def assert_serves_plaintext_metrics(fields: list[str]) -> None:
    """The server whose ready line has ``fields`` serves its metrics over plain HTTP."""
    assert "metrics_tls" not in fields, fields
    with urllib.request.urlopen(f"http://{metrics_address(fields)}/metrics",
                                timeout=SCRAPE_TIMEOUT_S) as reply:
        assert b"pocketflow_capacity_bytes" in reply.read()


def test_a_tls_server_serves_metrics_over_https_only(tmp_path: Path) -> None:
    ca = make_cluster_ca(tmp_path)
    cert = issue_server_cert(tmp_path, "keyed-0", "127.0.0.1")
    server = start_keyed_server(new_secret(), cert, "--metrics-listen", "127.0.0.1:0")
    try:
        assert "metrics_tls" in server.ready_fields, server.ready_fields
        address = metrics_address(server.ready_fields)
        context = ssl.create_default_context(cafile=str(ca))
        with urllib.request.urlopen(f"https://{address}/metrics", context=context,
                                    timeout=SCRAPE_TIMEOUT_S) as reply:
            assert reply.status == 200
            assert b"pocketflow_capacity_bytes" in reply.read()
        # A client that does not trust the cluster CA is refused by its own TLS check.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(f"https://{address}/metrics", timeout=SCRAPE_TIMEOUT_S)
        # Plain HTTP gets no metrics: the server waits for a ClientHello and closes.
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=SCRAPE_TIMEOUT_S) as plain:
            plain.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = plain.recv(65536)
            assert b"pocketflow_" not in answer and not answer.startswith(b"HTTP/1.1 200")
    finally:
        server.stop()


def test_metrics_plaintext_is_an_explicit_opt_in(tmp_path: Path) -> None:
    make_cluster_ca(tmp_path)
    cert = issue_server_cert(tmp_path, "keyed-0", "127.0.0.1")
    server = start_keyed_server(new_secret(), cert, "--metrics-listen", "127.0.0.1:0",
                                "--metrics-plaintext")
    try:
        assert_serves_plaintext_metrics(server.ready_fields)
    finally:
        server.stop()


def test_a_server_without_tls_serves_metrics_on_loopback_only(tmp_path: Path) -> None:
    server = start_keyed_server(new_secret(), None, "--metrics-listen", "127.0.0.1:0")
    try:
        assert_serves_plaintext_metrics(server.ready_fields)
    finally:
        server.stop()
    # 192.0.2.1 (TEST-NET-1) is never bound: the refusal comes before any bind.
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(new_secret())
    refused = subprocess.run(
        [str(find_server_binary()), "--tier", "dram", "--capacity", "1MiB",
         "--secret-file", str(secret_file), "--metrics-listen", "192.0.2.1:0"],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert refused.returncode == 2, refused.stderr
    assert "--metrics-plaintext" in refused.stderr
