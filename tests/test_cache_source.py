"""The cache's S3 GETs on pooled connections (``pocketflow.cache.http_get``, used by
``S3Store.get``): the same answers as boto3's against a real S3 server (SeaweedFS), signed with
real credentials against one that checks them, and every way an HTTP exchange fails (a server
of the test's own on loopback that hangs, drops a kept-alive connection, cuts a body short,
garbles its Content-Length or answers 503) as a typed error or a retry, within the source's
timeouts and attempts."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from fixtures_s3 import REPO_ROOT, boto3_client

from pocketflow.cache.source import BODY_CHUNK_BYTES, NOT_MODIFIED, Fetched, S3Source, S3Store
from pocketflow.errors import (
    S3AccessDenied,
    S3BucketNotFound,
    S3ObjectNotFound,
    S3Unavailable,
)

ODD_KEYS = ["plain", "with space/and+plus", "ünïcode/é", "tilde~and%percent", "a/b/c?d=e&f"]
FAULT_TIMEOUT_S = 1.0
"""Read timeout of the sources aimed at the test's own misbehaving servers."""
SERVE_SLACK_S = 10.0


def test_raw_gets_answer_as_boto3_does(s3_server: S3Source, s3_bucket: str) -> None:
    s3 = boto3_client(s3_server)
    for i, key in enumerate(ODD_KEYS):
        s3.put_object(Bucket=s3_bucket, Key=key, Body=key.encode() * (i + 1))
    raw = S3Store(s3_server)
    boto = S3Store(replace(s3_server, raw_get=False))
    for key in ODD_KEYS:
        got, expected = raw.get(s3_bucket, key), boto.get(s3_bucket, key)
        assert isinstance(got, Fetched) and got == expected
        assert raw.get(s3_bucket, key, if_none_match=got.etag) is NOT_MODIFIED
        assert raw.get(s3_bucket, key, if_none_match="0" * 32) == expected
    with pytest.raises(S3ObjectNotFound):
        raw.get(s3_bucket, "absent")
    with pytest.raises(S3BucketNotFound):
        raw.get(s3_bucket + "-absent", "absent")
    # Listings: the same keys (url-encoded on the wire), ETags and sizes as boto3 lists.
    assert raw.list_objects(s3_bucket) == boto.list_objects(s3_bucket)
    assert sorted(k for k, _ in raw.list_objects(s3_bucket)) == sorted(ODD_KEYS)
    asked = sorted(ODD_KEYS)[1:] + ["absent"]
    assert raw.list_keys(s3_bucket, asked) == boto.list_keys(s3_bucket, asked)
    with pytest.raises(S3BucketNotFound):
        raw.list_objects(s3_bucket + "-absent")
    # A body larger than one piece is read in pieces, with on_progress between them.
    big = bytes(range(256)) * ((BODY_CHUNK_BYTES + 12345) // 256)
    s3.put_object(Bucket=s3_bucket, Key="big", Body=big)
    ticks: list[int] = []
    fetched = raw.get(s3_bucket, "big", on_progress=lambda: ticks.append(1))
    assert isinstance(fetched, Fetched) and fetched.data == big and len(ticks) == 2
    s3.close()


def test_raw_listings_go_on_across_pages(s3_server: S3Source, s3_bucket: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from pocketflow.cache.source import LIST_PAGE_KEYS

    s3 = boto3_client(s3_server)
    keys = [f"k/{i:05d}" for i in range(LIST_PAGE_KEYS + 30)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket=s3_bucket, Key=k, Body=b"x"), keys))
    raw = S3Store(s3_server)
    assert raw.list_objects(s3_bucket, "k/") == [(k, 1) for k in keys]
    revalidated = raw.list_keys(s3_bucket, keys[10:])
    assert sorted(revalidated.found) == keys[10:] and not revalidated.absent
    assert revalidated == S3Store(replace(s3_server, raw_get=False)).list_keys(s3_bucket,
                                                                               keys[10:])
    s3.close()


def test_raw_gets_keep_their_connections(s3_server: S3Source, s3_bucket: str) -> None:
    """Sequential GETs, answered or not found, share one kept-alive connection."""
    source = replace(s3_server, read_timeout_s=29.0)  # a getter of this test's own
    boto3_client(source).put_object(Bucket=s3_bucket, Key="k", Body=b"v")
    store = S3Store(source)
    for _ in range(20):
        assert store.get(s3_bucket, "k").data == b"v"  # type: ignore[union-attr]
        with pytest.raises(S3ObjectNotFound):
            store.get(s3_bucket, "absent")
    from pocketflow.cache.source import _getter

    assert _getter(source).opened == 1


# -- a misbehaving server of the test's own ------------------------------------------------------


class _Server:
    """One loopback listener; each accepted connection runs ``serve(connection, index)``."""

    def __init__(self, serve: Callable[[socket.socket, int], None]) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._serve = serve
        self._stop = threading.Event()
        self.accepted = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            index = self.accepted
            threading.Thread(target=self._handle, args=(connection, index), daemon=True).start()

    def _handle(self, connection: socket.socket, index: int) -> None:
        connection.settimeout(SERVE_SLACK_S)
        try:
            self._serve(connection, index)
        except OSError:
            pass
        finally:
            connection.close()

    def source(self, attempts: int = 1) -> S3Source:
        return S3Source(endpoint_url=f"http://127.0.0.1:{self.port}", unsigned=True,
                        attempts=attempts, read_timeout_s=FAULT_TIMEOUT_S,
                        connect_timeout_s=FAULT_TIMEOUT_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(SERVE_SLACK_S)
        self._listener.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[socket.socket, int], None]], _Server]]:
    servers: list[_Server] = []

    def start(handler: Callable[[socket.socket, int], None]) -> _Server:
        servers.append(_Server(handler))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _read_request(connection: socket.socket) -> bool:
    data = b""
    while b"\r\n\r\n" not in data:
        piece = connection.recv(65536)
        if not piece:
            return False
        data += piece
    return True


def _answer(status: str, body: bytes, *, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return (f"HTTP/1.1 {status}\r\nETag: \"e1\"\r\nContent-Length: {size}\r\n\r\n").encode() + body


def test_a_server_that_never_answers_is_unavailable_within_the_read_timeout(serve: Any) -> None:
    hold = threading.Event()
    server = serve(lambda connection, _: (_read_request(connection), hold.wait(SERVE_SLACK_S)))
    started = time.monotonic()
    with pytest.raises(S3Unavailable):
        S3Store(server.source()).get("b", "k")
    hold.set()
    assert time.monotonic() - started < FAULT_TIMEOUT_S + SERVE_SLACK_S / 2


def test_a_dropped_kept_alive_connection_is_sent_again(serve: Any) -> None:
    """The server closes each connection after one answer without saying so (as an idle
    timeout does): the next GET finds its pooled connection dead and sends again on a new one,
    even with one attempt."""

    def one_answer(connection: socket.socket, _: int) -> None:
        if _read_request(connection):
            connection.sendall(_answer("200 OK", b"abc"))

    server = serve(one_answer)
    store = S3Store(server.source(attempts=1))
    for _ in range(3):
        assert store.get("b", "k") == Fetched("e1", 3, b"abc")
    assert server.accepted == 3


def test_a_body_cut_short_is_unavailable(serve: Any) -> None:
    def short(connection: socket.socket, _: int) -> None:
        if _read_request(connection):
            connection.sendall(_answer("200 OK", b"abc", length=10))

    with pytest.raises(S3Unavailable):
        S3Store(serve(short).source()).get("b", "k")


@pytest.mark.parametrize("lengths", [["garbled"], ["3", "4"], ["-3"], ["+3"]])
def test_a_garbled_content_length_is_unavailable_and_its_connection_closed(
    serve: Any, lengths: list[str],
) -> None:
    """A 200 whose Content-Length is not digits (a word, two headers that disagree, a sign),
    which http.client passes on as it came, is an ``S3Unavailable`` naming the header, not a
    ``ValueError`` (nor, for a sign, an answer read on a guess). It is retried within the
    attempts, each on a new connection: the server keeps its connections open, and the getter
    closed the one whose answer it could not frame."""
    headers = "".join(f"Content-Length: {length}\r\n" for length in lengths)

    def garbled(connection: socket.socket, _: int) -> None:
        while _read_request(connection):
            connection.sendall(f"HTTP/1.1 200 OK\r\nETag: \"e1\"\r\n{headers}\r\nabc".encode())

    server = serve(garbled)
    with pytest.raises(S3Unavailable, match="a garbled Content-Length") as caught:
        S3Store(server.source(attempts=2)).get("b", "k")
    assert (caught.value.status, caught.value.bucket, caught.value.key) == (0, "b", "k")
    assert ", ".join(lengths) in str(caught.value)
    assert server.accepted == 2


@pytest.mark.parametrize("length", ["3 ", "3\t", " 3"])
def test_a_content_length_with_whitespace_around_it_is_read(serve: Any, length: str) -> None:
    """Spaces and tabs around the value are allowed (RFC 9110's optional whitespace; http.client
    keeps the trailing ones): the answer is read as any other."""

    def spaced(connection: socket.socket, _: int) -> None:
        while _read_request(connection):
            connection.sendall(
                f"HTTP/1.1 200 OK\r\nETag: \"e1\"\r\nContent-Length: {length}\r\n\r\nabc"
                .encode())

    server = serve(spaced)
    store = S3Store(server.source(attempts=1))
    assert store.get("b", "k") == Fetched("e1", 3, b"abc")
    assert store.get("b", "k") == Fetched("e1", 3, b"abc")
    assert server.accepted == 1  # the connection was kept: the answer was framed


def test_a_content_length_beyond_s3s_largest_object_is_unavailable(serve: Any) -> None:
    """A Content-Length of 20 digits (past any u64, let alone S3's 5 TiB) is an
    ``S3Unavailable`` naming the size, retried within the attempts, not an ``OverflowError``
    from the buffer it would size."""

    def huge(connection: socket.socket, _: int) -> None:
        while _read_request(connection):
            connection.sendall(b"HTTP/1.1 200 OK\r\nETag: \"e1\"\r\n"
                               b"Content-Length: 99999999999999999999\r\n\r\nabc")

    server = serve(huge)
    with pytest.raises(S3Unavailable, match="beyond S3's largest object") as caught:
        S3Store(server.source(attempts=2)).get("b", "k", on_progress=lambda: None)
    assert (caught.value.status, caught.value.bucket, caught.value.key) == (0, "b", "k")
    assert server.accepted == 2


def test_a_lying_content_length_costs_only_what_was_sent(serve: Any) -> None:
    """A claimed fill (``on_progress``: read in pieces) whose answer says 4 TiB but sends three
    bytes and closes is a body cut short (``S3Unavailable``): its buffer grew with what arrived,
    it was not sized (and zeroed) to what the header announced, which would have failed with a
    ``MemoryError`` or, for a size that fits in memory, taken it all."""
    progress: list[int] = []

    def lying(connection: socket.socket, _: int) -> None:
        if _read_request(connection):
            connection.sendall(_answer("200 OK", b"abc", length=4 * 1024 ** 4))

    with pytest.raises(S3Unavailable):
        S3Store(serve(lying).source(attempts=1)).get("b", "k",
                                                     on_progress=lambda: progress.append(1))
    assert progress == [1]  # the three bytes arrived as one piece, then the body ended


def test_server_errors_are_retried_within_the_attempts(serve: Any) -> None:
    def busy_then_ok(connection: socket.socket, index: int) -> None:
        while _read_request(connection):
            if index == 1:
                error = b"<Error><Code>SlowDown</Code><Message>busy</Message></Error>"
                connection.sendall(_answer("503 Slow Down", error)
                                   .replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))
                return
            connection.sendall(_answer("200 OK", b"ok"))

    server = serve(busy_then_ok)
    assert S3Store(server.source(attempts=2)).get("b", "k") == Fetched("e1", 2, b"ok")
    server2 = serve(busy_then_ok)
    with pytest.raises(S3Unavailable) as caught:
        S3Store(server2.source(attempts=1)).get("b", "k")
    assert caught.value.code == "SlowDown"


def test_a_refused_connection_is_unavailable() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
    source = S3Source(endpoint_url=f"http://127.0.0.1:{port}", unsigned=True, attempts=1,
                      connect_timeout_s=FAULT_TIMEOUT_S)
    with pytest.raises(S3Unavailable):
        S3Store(source).get("b", "k")


# -- signed requests ------------------------------------------------------------------------------

ACCESS_KEY = "AKIDPOCKETFLOWTEST"
SECRET_KEY = "pocketflow-test-secret"


@pytest.fixture(scope="module")
def signed_server() -> Iterator[str]:
    """A SeaweedFS gateway with one identity: unsigned or wrongly signed requests are refused."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.peers import S3Peer

    peer = S3Peer(credentials=(ACCESS_KEY, SECRET_KEY))
    peer.start()
    try:
        yield peer.spec().endpoint_url
    finally:
        peer.stop()


def test_signed_raw_gets(signed_server: str, monkeypatch: pytest.MonkeyPatch,
                         tmp_path: Any) -> None:
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    source = S3Source(endpoint_url=signed_server, attempts=1)
    writer = S3Store(replace(source, raw_get=False))
    writer.create_bucket("signed")
    etags = {key: writer.put("signed", key, key.encode()) for key in ODD_KEYS}
    store = S3Store(source)
    from pocketflow.cache.source import _getter

    assert _getter(source).signs
    for key in ODD_KEYS:
        assert store.get("signed", key) == Fetched(etags[key], len(key.encode()), key.encode())
        assert store.get("signed", key, if_none_match=etags[key]) is NOT_MODIFIED
    with pytest.raises(S3ObjectNotFound):
        store.get("signed", "absent")
    assert store.list_objects("signed") == [(k, len(k.encode())) for k in sorted(ODD_KEYS)]
    assert sorted(store.list_keys("signed", sorted(ODD_KEYS)[1:]).found) == sorted(ODD_KEYS)[1:]
    with pytest.raises(S3AccessDenied):
        S3Store(replace(source, unsigned=True)).get("signed", ODD_KEYS[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(S3AccessDenied):
        S3Store(replace(source, read_timeout_s=31.0)).get("signed", ODD_KEYS[0])


def test_https_aws_and_opted_out_sources_keep_boto3() -> None:
    from pocketflow.cache.source import _getter

    assert _getter(S3Source(endpoint_url="https://127.0.0.1:1", unsigned=True)) is None
    assert _getter(S3Source(unsigned=True)) is None
    assert _getter(S3Source(endpoint_url="http://127.0.0.1:1", unsigned=True,
                            raw_get=False)) is None
    assert _getter(S3Source(endpoint_url="http://127.0.0.1:1", unsigned=True)) is not None


def test_a_listing_lists_about_as_many_keys_as_it_revalidates(s3_server: S3Source,
                                                             s3_bucket: str) -> None:
    """A batch of keys that follow one another is revalidated by one page that begins at its
    first key and holds little more than the batch; a sparse batch gets further pages for what
    the first did not reach, within the waste bound. A changed key's new ETag and a deleted
    key's absence are seen at both ends of the batch."""
    from concurrent.futures import ThreadPoolExecutor

    from pocketflow.cache.source import LIST_SLACK_KEYS, LIST_WASTE_FACTOR, request_counts

    s3 = boto3_client(s3_server)
    keys = [f"in/{i:06d}" for i in range(300)]
    with ThreadPoolExecutor(16) as pool:
        etags = dict(zip(keys, pool.map(
            lambda k: s3.put_object(Bucket=s3_bucket, Key=k, Body=k.encode())["ETag"].strip('"'),
            keys), strict=True))
    raw, boto = S3Store(s3_server), S3Store(replace(s3_server, raw_get=False))
    batch = keys[100:164]
    lists = request_counts().get("ListObjectsV2", 0)
    listed = raw.list_keys(s3_bucket, batch)
    assert request_counts().get("ListObjectsV2", 0) - lists == 1
    assert listed.found == {k: (etags[k], len(k)) for k in batch} and not listed.absent
    # Not the batch's 4x bound (272 keys), nor "in/000060".."in/000063" before its first key.
    assert len(batch) <= listed.listed <= len(batch) + LIST_SLACK_KEYS
    assert boto.list_keys(s3_bucket, batch) == listed

    sparse = keys[::3]
    lists = request_counts().get("ListObjectsV2", 0)
    listed = raw.list_keys(s3_bucket, sparse)
    assert request_counts().get("ListObjectsV2", 0) - lists == 2
    assert sorted(listed.found) == sparse and not listed.absent
    assert listed.listed <= len(sparse) * LIST_WASTE_FACTOR + LIST_SLACK_KEYS

    s3.delete_object(Bucket=s3_bucket, Key=batch[0])
    changed = s3.put_object(Bucket=s3_bucket, Key=batch[-1], Body=b"changed")["ETag"].strip('"')
    listed = raw.list_keys(s3_bucket, batch)
    assert listed.absent == {batch[0]} and batch[0] not in listed.found
    assert listed.found[batch[-1]] == (changed, len(b"changed"))
    assert boto.list_keys(s3_bucket, batch) == listed
    s3.close()


LISTING_HEAD = (b'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult '
                b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name>')


def _listing_server(serve: Any, bodies: list[bytes]) -> Any:
    def answer(connection: socket.socket, index: int) -> None:
        while _read_request(connection):
            body = bodies.pop(0)
            connection.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n"
                               .encode() + body)

    return serve(answer)


def test_listing_bodies_are_read_whatever_their_escapes(serve: Any) -> None:
    """The listing reader takes keys url-encoded or XML-escaped, ETags quoted by any entity,
    the result's fields before or after its Contents; a body that is not a listing is a typed
    error, not a wrong answer."""
    from pocketflow.errors import S3Error

    page1 = LISTING_HEAD + (
        b"<IsTruncated>true</IsTruncated><EncodingType>url</EncodingType>"
        b"<Contents><Key>in%2Fb</Key><LastModified>x</LastModified><ETag>&quot;e2&quot;</ETag>"
        b"<Size>4</Size><Owner><ID>0</ID></Owner></Contents>"
        b"<Contents><Key>in%2Fwith+space%2Band%25plus%C3%A9</Key><ETag>&#34;e1&#34;</ETag>"
        b"<Size>3</Size></Contents>"
        b"<NextContinuationToken>t&amp;1</NextContinuationToken></ListBucketResult>")
    page2 = LISTING_HEAD + (
        b"<IsTruncated>false</IsTruncated>"
        b"<Contents><Key>in/c&amp;d&lt;e</Key><ETag>\"e3\"</ETag><Size>5</Size></Contents>"
        b"</ListBucketResult>")
    server = _listing_server(serve, [page1, page2])
    assert S3Store(server.source()).list_objects("b", "in/") == [
        ("in/b", 4), ("in/with space+and%plusé", 3), ("in/c&d<e", 5)]
    server = _listing_server(serve, [page1])
    listed = S3Store(server.source()).list_keys("b", ["in/b", "in/with space+and%plusé"])
    assert listed.found == {"in/with space+and%plusé": ("e1", 3), "in/b": ("e2", 4)}
    for garbage in (b"<Error>not a listing</Error>", LISTING_HEAD + b"<Contents><Key>k</Key>",
                    LISTING_HEAD + b"<Contents><Key>k</Key><Size>x</Size></Contents>"):
        server = _listing_server(serve, [garbage])
        with pytest.raises(S3Error):
            S3Store(server.source()).list_objects("b", "in/")
