"""S3 GETs and listings on pooled HTTP connections without boto3's request pipeline.

A cache's fills and revalidations are GetObject requests, thousands per run for small objects,
and boto3 spends 1.6-3.4 ms of CPU on each (its event hooks, request building and response
parsing) against 0.2-0.3 ms for the same GET on a kept-alive ``http.client`` connection,
measured here on the benchmarks' SeaweedFS; a prewarm in one Python process was held by that
CPU to about 260 objects/s. A ListObjectsV2 page that revalidates up to 1000 keys cost boto3
0.19 s of CPU to parse. This module sends the same requests (path-style, signed with
botocore's own SigV4 signer unless the source is unsigned) and reads the answers itself;
everything else (HEADs, PUTs, DELETEs, buckets) stays on boto3
(:mod:`pocketflow.cache.source`).

Only sources with a plain ``http://`` ``endpoint_url`` take this path
(:func:`pocketflow.cache.source._getter`): for AWS itself (no endpoint) the addressing
(virtual-hosted buckets, regional endpoints, redirects) is boto3's, and an ``https`` endpoint
is verified with the CA bundle boto3's configuration names, which this module does not read.
"""

from __future__ import annotations

import http.client
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from pocketflow.errors import InvalidRequest, S3Error, s3_error

__all__ = ["RawGetter", "RETRY_STATUSES", "ERROR_BODY_BYTES_MAX", "BACKOFF_MAX_S",
           "RANGE_IGNORED"]

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
"""Answers that are retried (within the source's ``attempts``), as botocore's standard mode
retries throttling and server errors."""
ERROR_BODY_BYTES_MAX = 64 * 1024
"""Most bytes of an error answer read to find its S3 error code."""
RANGE_IGNORED = "RangeIgnored"
"""Code of the :class:`~pocketflow.errors.S3Error` (an ``S3InvalidRequest``, not retried) of a
ranged GET that the server answered 200, with the whole object: refused without its body."""
BACKOFF_BASE_S = 0.05
BACKOFF_MAX_S = 1.0
"""A retry waits a random time up to ``BACKOFF_BASE_S * 2**attempt``, at most this."""

_CODE = re.compile(rb"<Code>([^<]*)</Code>")
_LENGTH = re.compile(r"[0-9]{1,20}")
"""A Content-Length as HTTP writes it (around it, spaces and tabs are allowed and dropped), of at
most 20 digits: digits only, where ``int`` would also take ``-1``, ``+5``, ``1_0`` or other
scripts' digits."""
OBJECT_BYTES_MAX = 5 * 1024 ** 4
"""S3's largest object (5 TiB): an answer that says it is longer cannot be one, and is not read."""
GARBLED_SHOWN_CHARS = 64
"""Most characters of a garbled header value quoted in the error that names it."""
_MESSAGE = re.compile(rb"<Message>([^<]*)</Message>")


class _Stale(Exception):
    """A kept-alive connection the server had closed: send the request again on a new one (not
    counted as an attempt, as no answer came)."""


class RawGetter:
    """GETs of one S3 source over at most ``pool_connections`` kept-alive connections.

    Thread-safe: a request takes an idle connection (or opens one) and gives it back when its
    answer was read whole; a connection whose answer was not read whole is closed."""

    def __init__(self, source: Any, count: Callable[[str], None]) -> None:
        """``source``: an :class:`~pocketflow.cache.source.S3Source` with an ``endpoint_url``;
        ``count`` is told of every request sent (its operation name)."""
        if not source.endpoint_url:
            raise InvalidRequest("a raw S3 getter needs an endpoint_url")
        parts = urlsplit(source.endpoint_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequest(f"not an http(s) S3 endpoint: {source.endpoint_url!r}")
        self._source = source
        self._count = count
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._base = f"{parts.scheme}://{parts.netloc}"
        self._prefix = parts.path.rstrip("/")
        self._idle: list[http.client.HTTPConnection] = []
        self._idle_max = source.pool_connections
        self._lock = threading.Lock()
        self.opened = 0
        """Connections opened so far (each kept alive while it answers whole)."""
        self._credentials: Any = None
        if not source.unsigned:
            import botocore.session

            self._credentials = botocore.session.get_session().get_credentials()

    @property
    def signs(self) -> bool:
        """Whether requests are signed (a signed source with credentials found)."""
        return self._credentials is not None

    def get(self, bucket: str, key: str, *, if_none_match: str | None,
            on_progress: Callable[[], None] | None,
            read_body: Callable[[Any, int, Callable[[], None] | None], bytes],
            byte_range: tuple[int, int] | None = None,
            ) -> tuple[int, str, bytes] | None:
        """GetObject, whole (or ``byte_range``, ``(first, last)`` inclusive, answered 206):
        ``(Content-Length, ETag, body)``, or None for a 304 answer to ``if_none_match``.
        Raises the typed :class:`~pocketflow.errors.S3Error` of a failure.
        ``read_body(response, size, on_progress)`` reads a 200 (206) answer's body."""
        headers: dict[str, str] = {}
        if if_none_match is not None:
            headers["If-None-Match"] = if_none_match
        if byte_range is not None:
            headers["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
        return self._send("GetObject", bucket, key, f"/{bucket}/{quote(key, safe='/~')}",
                          headers, on_progress, read_body)

    def list_page(self, bucket: str, params: dict[str, str]) -> bytes:
        """One ListObjectsV2 request (``params``: its query parameters besides ``list-type``):
        the answer's XML body."""
        query = urlencode(sorted({**params, "list-type": "2"}.items()), quote_via=quote,
                          safe="~")
        answer = self._send("ListObjectsV2", bucket, None, f"/{bucket}?{query}", {}, None,
                            lambda response, _size, _progress: response.read())
        assert answer is not None
        return answer[2]

    def _send(self, operation: str, bucket: str, key: str | None, target: str,
              headers: dict[str, str], on_progress: Callable[[], None] | None,
              read_body: Callable[[Any, int, Callable[[], None] | None], bytes],
              ) -> tuple[int, str, bytes] | None:
        path = self._prefix + target
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._once(operation, bucket, key, path, headers, on_progress,
                                  read_body)
            except _Stale:
                attempt -= 1
                continue
            except S3Error as exc:
                if attempt >= self._source.attempts or not _retryable(exc):
                    raise
            time.sleep(random.uniform(0, min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** attempt)))

    def _once(self, operation: str, bucket: str, key: str | None, path: str,
              headers: dict[str, str],
              on_progress: Callable[[], None] | None,
              read_body: Callable[[Any, int, Callable[[], None] | None], bytes],
              ) -> tuple[int, str, bytes] | None:
        connection: http.client.HTTPConnection | None = None
        keep = False
        try:
            connection, reused = self._take()
            try:
                self._count(operation)
                connection.request("GET", path, headers=self._signed(path, headers))
                answer = connection.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                if reused:
                    raise _Stale() from None
                raise
            status = answer.status
            if status == 200 and "Range" in headers:
                # A server that ignores Range sends the whole object (a pack: up to 256 MiB
                # per ranged GET): refused unread, its connection closed.
                raise s3_error(RANGE_IGNORED, status,
                               "the server answered a ranged GET with the whole object",
                               bucket=bucket, key=key)
            if status == 200 or (status == 206 and "Range" in headers):
                etag = (answer.getheader("ETag") or "").strip().strip('"')
                length = answer.getheader("Content-Length")
                if length is not None:
                    length = length.strip(" \t")  # optional whitespace (RFC 9110, 5.5)
                if length is not None and not _LENGTH.fullmatch(length):
                    # http.client lets any value pass. An answer that cannot be framed is no
                    # answer: unavailable (retried), as one cut short is, its connection closed.
                    raise s3_error("", 0, "a garbled Content-Length: "
                                   f"{length[:GARBLED_SHOWN_CHARS]!r}", bucket=bucket, key=key)
                size = int(length) if length is not None else -1
                if size > OBJECT_BYTES_MAX:
                    raise s3_error("", 0, f"a Content-Length of {size} bytes, beyond S3's "
                                   f"largest object ({OBJECT_BYTES_MAX} bytes)", bucket=bucket,
                                   key=key)
                data = read_body(answer, size, on_progress)
                if size < 0:
                    size = len(data)
                keep = len(data) == size and not answer.will_close
                return size, etag, data
            if status == 304 and "If-None-Match" in headers:
                answer.read()
                keep = not answer.will_close
                return None
            body = answer.read(ERROR_BODY_BYTES_MAX)
            # An error answer read whole leaves its connection usable (a 404 is a common answer).
            keep = answer.isclosed() and not answer.will_close
            code_found = _CODE.search(body)
            message_found = _MESSAGE.search(body)
            code = code_found.group(1).decode(errors="replace") if code_found else ""
            message = (message_found.group(1).decode(errors="replace") if message_found
                       else answer.reason or "")
            if not code and status == 404 and key is not None:
                code = "NoSuchKey"
            raise s3_error(code, status, message, bucket=bucket, key=key)
        except (OSError, http.client.HTTPException) as exc:
            raise s3_error("", 0, f"{type(exc).__name__}: {exc}", bucket=bucket,
                           key=key) from exc
        finally:
            if connection is not None:
                if keep:
                    self._give_back(connection)
                else:
                    connection.close()

    def _signed(self, path: str, headers: dict[str, str]) -> dict[str, str]:
        if self._credentials is None:
            return headers
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method="GET", url=self._base + path, headers=dict(headers))
        S3SigV4Auth(self._credentials.get_frozen_credentials(), "s3",
                    self._source.region).add_auth(request)
        return dict(request.headers.items())

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        connection: http.client.HTTPConnection
        if self._https:
            connection = http.client.HTTPSConnection(self._host, self._port,
                                                     timeout=self._source.connect_timeout_s)
        else:
            connection = http.client.HTTPConnection(self._host, self._port,
                                                    timeout=self._source.connect_timeout_s)
        connection.connect()
        with self._lock:
            self.opened += 1
        assert connection.sock is not None
        connection.sock.settimeout(self._source.read_timeout_s)
        return connection, False

    def _give_back(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self._idle_max:
                self._idle.append(connection)
                return
        connection.close()

    def close(self) -> None:
        """Close the idle connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


def _retryable(exc: S3Error) -> bool:
    return exc.status == 0 or exc.status in RETRY_STATUSES
