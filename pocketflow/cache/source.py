"""The S3-compatible store behind a cache: one boto3 client per process and source, the few
requests the cache makes (conditional GET, listing, PUT, DELETE), their count, and the one place
boto3's failures become typed errors (:func:`pocketflow.errors.error_from_s3`)."""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from itertools import chain
from typing import Any, NamedTuple

from pocketflow.errors import InvalidRequest, PocketflowError, error_from_s3

__all__ = [
    "S3Source",
    "S3Store",
    "Fetched",
    "NOT_MODIFIED",
    "Listed",
    "BODY_CHUNK_BYTES",
    "LIST_PAGE_KEYS",
    "LIST_WASTE_FACTOR",
    "LIST_SLACK_KEYS",
    "LIST_KEYS_MAX",
    "request_counts", "add_request_counts",
]

log = logging.getLogger(__name__)

BODY_CHUNK_BYTES = 8 * 1024 * 1024
"""A GET's body is read in pieces of this size, and ``on_progress`` runs between them (a fill
renews its claim there, so a long download is not taken for a dead one)."""

LIST_PAGE_KEYS = 1000
"""Keys per ListObjectsV2 page (S3's maximum)."""

LIST_WASTE_FACTOR = 4
"""A listing that revalidates ``n`` keys stops after ``n * LIST_WASTE_FACTOR + LIST_SLACK_KEYS``
listed keys: keys it has not reached by then (they are spread over a range holding many other
keys) are revalidated one conditional GET each."""
LIST_SLACK_KEYS = 16

LIST_KEYS_MAX = 1_000_000
"""Most keys one :meth:`S3Store.list_objects` returns."""

CLIENTS_MAX = 16
"""boto3 clients kept per process (one per source); the oldest is dropped past this."""


@dataclass(frozen=True)
class S3Source:
    """Where a cache's backing objects live: an S3-compatible endpoint.

    ``endpoint_url`` None means AWS S3 in ``region``. Credentials are never part of the source
    (which travels to every task in the cache's spec): boto3 finds them in each process as it
    always does (environment, config files, instance role); ``unsigned`` sends anonymous requests
    instead (public buckets, or a local store without identities such as the tests' SeaweedFS).
    ``attempts`` is botocore's total attempts per request (1 = no retry). ``raw_get`` sends
    the cache's GETs and listings on pooled connections without boto3
    (:mod:`pocketflow.cache.http_get`, about a seventh of boto3's CPU per GET) when the
    ``endpoint_url`` is plain ``http://``; False keeps them on boto3.
    """

    endpoint_url: str | None = None
    region: str = "us-east-1"
    unsigned: bool = False
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    attempts: int = 3
    pool_connections: int = 32
    raw_get: bool = True

    def __post_init__(self) -> None:
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise InvalidRequest("S3 timeouts must be > 0")
        if not 1 <= self.attempts <= 10:
            raise InvalidRequest("S3 attempts must be in 1..10")
        if not 1 <= self.pool_connections <= 1024:
            raise InvalidRequest("S3 pool_connections must be in 1..1024")

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the cache's spec."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> S3Source:
        """The inverse of :meth:`to_dict` (unknown fields are refused)."""
        try:
            return cls(**data)
        except TypeError as exc:
            raise InvalidRequest(f"not an S3 source: {exc}") from None


class Fetched(NamedTuple):
    """An object as a GET returned it."""

    etag: str
    size: int
    data: bytes


class _NotModified:
    def __repr__(self) -> str:
        return "NOT_MODIFIED"


NOT_MODIFIED = _NotModified()
"""What a conditional GET returns when the object still has the ETag it was given."""


class Listed(NamedTuple):
    """A listing's revalidation of some keys: ``found`` maps each key the listing reached and
    holds to its ``(etag, size)``; ``absent`` are keys it reached that do not exist; keys in
    neither were not reached (the listing stopped at its bound). ``listed``: how many keys
    the listing's pages held in all (those asked for and others)."""

    found: dict[str, tuple[str, int]]
    absent: set[str]
    listed: int = 0


def _just_before(key: str) -> str:
    """A string that sorts below ``key`` and above every key below it save those that begin
    with it (the key with its last character one lower), as a listing's exclusive
    ``StartAfter``: the listing then begins at ``key`` instead of at the keys that share all but
    its last character ("in/000064" starts after "in/000063", not after "in/00006", which
    lists "in/000060" to "in/000063" first). "" when there is none (list from the prefix)."""
    if not key:
        return ""
    code = ord(key[-1]) - 1
    if code < 0:
        return key[:-1]
    if 0xD800 <= code <= 0xDFFF:
        code = 0xD7FF  # surrogates are not characters (UTF-8 cannot carry them)
    return key[:-1] + chr(code)


def normal_etag(etag: str) -> str:
    """An ETag without the quotes S3 puts around it (listings and GETs agree then)."""
    return etag.strip().strip('"')


_clients_lock = threading.Lock()
_clients: dict[S3Source, tuple[int, Any]] = {}


def _client(source: S3Source) -> Any:
    """This process's boto3 client for ``source`` (made again in a forked child: a client's
    connection pool belongs to the process that opened it)."""
    pid = os.getpid()
    with _clients_lock:
        held = _clients.get(source)
        if held is not None and held[0] == pid:
            return held[1]
    import boto3
    import botocore.session
    from botocore import UNSIGNED
    from botocore.config import Config

    config = Config(
        signature_version=UNSIGNED if source.unsigned else None,
        retries={"max_attempts": source.attempts, "mode": "standard"},
        connect_timeout=source.connect_timeout_s,
        read_timeout=source.read_timeout_s,
        max_pool_connections=source.pool_connections,
        # Checksums only where S3 requires them: the cache's reads are checked by length, and
        # hashing every payload twice would cost more than the loopback transfer.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    session = botocore.session.get_session()
    # Timestamps stay text: nothing here reads them, and botocore's datetime parsing was most of
    # a listing's cost (a page of 1000 keys parsed in 0.69 s, 0.19 s without it, here).
    session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=str)
    client = boto3.session.Session(botocore_session=session).client(
        "s3", endpoint_url=source.endpoint_url, region_name=source.region, config=config
    )
    client.meta.events.register("before-send.s3", _count_request)
    with _clients_lock:
        _clients[source] = (pid, client)
        while len(_clients) > CLIENTS_MAX:
            del _clients[next(iter(_clients))]
    return client


_getters_lock = threading.Lock()
_getters: dict[S3Source, tuple[int, Any]] = {}


def _getter(source: S3Source) -> Any:
    """This process's raw getter for ``source`` (:class:`~pocketflow.cache.http_get.RawGetter`),
    or None where GETs stay on boto3: ``raw_get`` off, no ``endpoint_url``, an ``https``
    endpoint (boto3 verifies it with the CA bundle its configuration names, which the raw
    path does not read), or a signed source with no credentials found (boto3 then raises its
    own error)."""
    if not source.raw_get or not (source.endpoint_url or "").startswith("http://"):
        return None
    pid = os.getpid()
    with _getters_lock:
        held = _getters.get(source)
        if held is not None and held[0] == pid:
            return held[1]
    from pocketflow.cache.http_get import RawGetter

    getter: Any = RawGetter(source, _count_operation)
    if not source.unsigned and not getter.signs:
        getter = None
    with _getters_lock:
        _getters[source] = (pid, getter)
        while len(_getters) > CLIENTS_MAX:
            _, old = _getters.pop(next(iter(_getters)))
            if old is not None:
                old.close()
    return getter


_requests_lock = threading.Lock()
_requests: Counter[str] = Counter()


def _count_request(event_name: str = "", **_: Any) -> None:
    # event_name is "before-send.s3.<Operation>"; every attempt sent counts, retries included.
    _count_operation(event_name.rsplit(".", 1)[-1])


def _count_operation(operation: str) -> None:
    with _requests_lock:
        _requests[operation] += 1


def add_request_counts(counts: dict[str, int]) -> None:
    """Count requests another process sent for this one (a prewarm's workers), so that
    :func:`request_counts` stays the whole of what this process had sent."""
    with _requests_lock:
        _requests.update({name: int(n) for name, n in counts.items()})


def request_counts() -> dict[str, int]:
    """S3 requests this process has sent, by operation (``GetObject``, ``ListObjectsV2``, ...),
    every retry counted; the counts a benchmark reports."""
    with _requests_lock:
        return dict(_requests)


class S3Store:
    """The requests a cache makes to its source, each raising a typed :class:`S3Error`."""

    def __init__(self, source: S3Source) -> None:
        self.source = source

    def connect(self, *, boto3: bool = True) -> None:
        """Make this process's boto3 client and raw getter now (they are made on first use
        otherwise; importing boto3 and building a client costs 0.1-0.2 s of CPU). Without
        ``boto3`` only the raw getter, for a process that only reads through a cache whose
        GETs and listings are raw (a task then spends no CPU on a client it never uses)."""
        if boto3 or _getter(self.source) is None:
            _client(self.source)
        _getter(self.source)

    def get(
        self, bucket: str, key: str, *, if_none_match: str | None = None,
        on_progress: Callable[[], None] | None = None,
    ) -> Fetched | _NotModified:
        """GetObject, whole. With ``if_none_match`` (an ETag) a 304 answer returns
        :data:`NOT_MODIFIED` and carries no body. ``on_progress`` runs between body pieces."""
        getter = _getter(self.source)
        if getter is not None:
            answer = getter.get(
                bucket, key, on_progress=on_progress, read_body=_read_body,
                if_none_match=(None if if_none_match is None
                               else f'"{normal_etag(if_none_match)}"'))
        else:
            answer = self._boto3_get(bucket, key, if_none_match, on_progress)
        if answer is None:
            return NOT_MODIFIED
        size, etag, data = answer
        if len(data) != size:
            raise error_from_s3(
                OSError(f"body of {len(data)} bytes, Content-Length said {size}"),
                bucket=bucket, key=key,
            )
        return Fetched(etag, size, data)

    def get_range(self, bucket: str, key: str, first: int, last: int) -> bytes:
        """Bytes ``first..last`` (inclusive) of an object: one ranged GetObject. A server that
        answers it with the whole object (200, ignoring the range) gets an ``S3InvalidRequest``
        of code ``RangeIgnored`` (not retried), its body unread."""
        getter = _getter(self.source)
        if getter is not None:
            answer = getter.get(bucket, key, if_none_match=None, on_progress=None,
                                read_body=_read_body, byte_range=(first, last))
            assert answer is not None
            _, _, data = answer
        else:
            try:
                got = _client(self.source).get_object(Bucket=bucket, Key=key,
                                                      Range=f"bytes={first}-{last}")
                ranged = "ContentRange" in got
                if ranged:
                    data = _read_body(got["Body"], int(got["ContentLength"]), None)
                else:  # a 200: the whole object, refused unread
                    got["Body"].close()
            except Exception as exc:
                raise error_from_s3(exc, bucket=bucket, key=key) from exc
            if not ranged:
                from pocketflow.cache.http_get import RANGE_IGNORED
                from pocketflow.errors import s3_error

                raise s3_error(RANGE_IGNORED, 200, "the server answered a ranged GET with "
                               "the whole object", bucket=bucket, key=key)
        if len(data) != last - first + 1:
            raise error_from_s3(
                OSError(f"range of {len(data)} bytes, asked for {last - first + 1}"),
                bucket=bucket, key=key)
        return data

    def _boto3_get(self, bucket: str, key: str, if_none_match: str | None,
                   on_progress: Callable[[], None] | None) -> tuple[int, str, bytes] | None:
        """GetObject through boto3: ``(size, etag, body)``, None for a 304 answer."""
        args: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if if_none_match is not None:
            args["IfNoneMatch"] = f'"{normal_etag(if_none_match)}"'
        try:
            answer = _client(self.source).get_object(**args)
            etag = normal_etag(answer["ETag"])
            size = int(answer["ContentLength"])
            data = _read_body(answer["Body"], size, on_progress)
        except Exception as exc:
            if if_none_match is not None and _status(exc) == 304:
                return None
            raise error_from_s3(exc, bucket=bucket, key=key) from exc
        return size, etag, data

    def list_keys(self, bucket: str, keys: Sequence[str]) -> Listed:
        """Revalidate ``keys`` (sorted, distinct) with ListObjectsV2 pages over their common
        prefix, from just before the first: each page answers for up to 1000 keys at the cost of
        one request. The first page asks for as many keys as there are to revalidate (and
        ``LIST_SLACK_KEYS``), which covers a batch of keys that follow one another; further
        pages are asked only for keys not reached yet, up to ``LIST_WASTE_FACTOR`` times as many
        listed keys as asked for in all."""
        if not keys:
            return Listed({}, set())
        keys = sorted(set(keys))
        wanted = set(keys)
        first, last = keys[0], keys[-1]
        prefix = os.path.commonprefix([first, last])
        listed_max = len(keys) * LIST_WASTE_FACTOR + LIST_SLACK_KEYS
        args: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix,
                                "MaxKeys": min(LIST_PAGE_KEYS, len(keys) + LIST_SLACK_KEYS)}
        start_after = _just_before(first)
        if start_after:
            args["StartAfter"] = start_after
        found: dict[str, tuple[str, int]] = {}
        listed = 0
        reached = ""
        while True:
            page = self._list_page(args)
            contents = page.get("Contents", ()) or ()
            for item in contents:
                name = item["Key"]
                listed += 1
                reached = name
                if name in wanted:
                    found[name] = (normal_etag(item["ETag"]), int(item["Size"]))
            done = not page.get("IsTruncated") or (reached and reached >= last)
            if done or listed >= listed_max:
                if not page.get("IsTruncated"):
                    reached = max(reached, last)
                break
            token = page.get("NextContinuationToken")
            if not token:
                break
            args["ContinuationToken"] = token
            args["MaxKeys"] = min(LIST_PAGE_KEYS, listed_max - listed)
            args.pop("StartAfter", None)
        absent = {k for k in wanted if k not in found and k <= reached}
        return Listed(found, absent, listed)

    def list_after(self, bucket: str, after: str, count: int) -> list[tuple[str, str, int]]:
        """One ListObjectsV2 page: up to ``count`` (at most ``LIST_PAGE_KEYS``) ``(key, etag,
        size)`` that follow ``after`` under its prefix up to its last ``/``."""
        page = self._list_page({"Bucket": bucket, "Prefix": after[:after.rfind("/") + 1],
                                "StartAfter": after,
                                "MaxKeys": max(1, min(LIST_PAGE_KEYS, count))})
        return [(item["Key"], normal_etag(item["ETag"]), int(item["Size"]))
                for item in page.get("Contents", ()) or ()]

    def head(self, bucket: str, key: str) -> tuple[str, int]:
        """HeadObject: the object's ETag and size."""
        try:
            answer = _client(self.source).head_object(Bucket=bucket, Key=key)
        except Exception as exc:
            raise error_from_s3(exc, bucket=bucket, key=key) from exc
        return normal_etag(answer["ETag"]), int(answer["ContentLength"])

    def list_objects(self, bucket: str, prefix: str = "") -> list[tuple[str, int]]:
        """Every ``(key, size)`` under ``prefix``, sorted (at most ``LIST_KEYS_MAX + 1``)."""
        found: list[tuple[str, int]] = []
        args: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": LIST_PAGE_KEYS}
        while len(found) <= LIST_KEYS_MAX:
            page = self._list_page(args)
            found += [(item["Key"], int(item["Size"])) for item in page.get("Contents", ())]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                break
            args["ContinuationToken"] = token
        return found[:LIST_KEYS_MAX + 1]

    def _list_page(self, args: dict[str, Any]) -> dict[str, Any]:
        """One ListObjectsV2 page, as boto3 returns it (``Contents`` of ``Key``, ``ETag``,
        ``Size``; ``IsTruncated``; ``NextContinuationToken``): on the raw getter when there is
        one (boto3 parsed a page of 1000 keys in 0.19 s of CPU), else boto3's."""
        getter = _getter(self.source)
        bucket = args["Bucket"]
        if getter is None:
            try:
                return _client(self.source).list_objects_v2(**args)  # type: ignore[no-any-return]
            except Exception as exc:
                raise error_from_s3(exc, bucket=bucket, key=None) from exc
        params = {"encoding-type": "url"}
        for name, param in (("Prefix", "prefix"), ("MaxKeys", "max-keys"),
                            ("StartAfter", "start-after"),
                            ("ContinuationToken", "continuation-token")):
            if name in args:
                params[param] = str(args[name])
        body = getter.list_page(bucket, params)
        try:
            return _parse_listing(body)
        except ValueError as exc:
            raise error_from_s3(OSError(f"an unreadable listing: {exc}"), bucket=bucket,
                                key=None) from None

    def create_bucket(self, bucket: str) -> None:
        """CreateBucket; one that exists and is ours is not an error."""
        try:
            _client(self.source).create_bucket(Bucket=bucket)
        except Exception as exc:
            code = getattr(exc, "response", {}).get("Error", {}).get("Code")
            if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return
            raise error_from_s3(exc, bucket=bucket, key=None) from exc

    def head_bucket(self, bucket: str) -> None:
        """HeadBucket: raises :class:`~pocketflow.errors.S3BucketNotFound` if it is missing."""
        try:
            _client(self.source).head_bucket(Bucket=bucket)
        except Exception as exc:
            error = error_from_s3(exc, bucket=bucket, key=None)
            if getattr(error, "status", 0) == 404:
                from pocketflow.errors import s3_error

                raise s3_error("NoSuchBucket", 404, "the bucket does not exist",
                               bucket=bucket) from exc
            raise error from exc

    def put(self, bucket: str, key: str, data: Any) -> str:
        """PutObject; returns the new ETag."""
        try:
            answer = _client(self.source).put_object(Bucket=bucket, Key=key, Body=data)
        except Exception as exc:
            raise error_from_s3(exc, bucket=bucket, key=key) from exc
        return normal_etag(answer["ETag"])

    def put_parts(self, bucket: str, key: str, parts: Iterable[bytes]) -> None:
        """PutObject of ``parts`` one after another (each but the last at least 5 MiB, as S3
        wants): one PUT if there is one part, else one multipart upload that takes each part as
        it comes (the caller holds one part at a time), aborted if anything fails."""
        pieces = iter(parts)
        first = next(pieces, b"")
        second = next(pieces, None)
        if second is None:
            self.put(bucket, key, first)
            return
        client = _client(self.source)
        try:
            upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        except Exception as exc:
            raise error_from_s3(exc, bucket=bucket, key=key) from exc
        done: list[dict[str, Any]] = []
        try:
            for number, part in enumerate(chain([first, second], pieces), 1):
                answer = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id,
                                            PartNumber=number, Body=part)
                done.append({"ETag": answer["ETag"], "PartNumber": number})
            client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                             MultipartUpload={"Parts": done})
        except BaseException as exc:
            try:
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception as abort_exc:  # noqa: BLE001 - the upload's own error is raised
                log.info("aborting the upload of %s/%s failed: %s", bucket, key, abort_exc)
            if isinstance(exc, PocketflowError) or not isinstance(exc, Exception):
                raise
            raise error_from_s3(exc, bucket=bucket, key=key) from exc

    def delete(self, bucket: str, key: str) -> None:
        """DeleteObject (deleting a missing key is not an error in S3)."""
        try:
            _client(self.source).delete_object(Bucket=bucket, Key=key)
        except Exception as exc:
            raise error_from_s3(exc, bucket=bucket, key=key) from exc


_ROOT = re.compile(rb"<ListBucketResult[\s>]")
_ENTITY = re.compile(r"&(#[0-9]+|#x[0-9a-fA-F]+|quot|amp|lt|gt|apos);")
_NAMED_ENTITIES = {"quot": '"', "amp": "&", "lt": "<", "gt": ">", "apos": "'"}
_PERCENT = re.compile(rb"%[0-9A-Fa-f]{2}")
_PERCENT_BYTES = {f"%{i:02x}".encode(): bytes([i]) for i in range(256)}


def _xml_text(raw: bytes) -> str:
    """An XML element's text: its UTF-8 with the five named entities and character
    references replaced."""
    text = raw.decode()
    if "&" not in text:
        return text
    try:
        return _ENTITY.sub(lambda m: _NAMED_ENTITIES.get(m[1]) or chr(
            int(m[1][2:], 16) if m[1].startswith("#x") else int(m[1][1:])), text)
    except OverflowError as exc:
        raise ValueError(f"a character reference out of range: {exc}") from None


def _url_text(raw: bytes) -> str:
    """A url-encoded element's text (``encoding-type=url``: ``+`` for a space, ``%XX`` for a
    byte of the UTF-8), as ``urllib.parse.unquote_plus`` reads it, at a fifth of its CPU."""
    # "/" is the one escape most keys hold: replaced without a regular expression.
    raw = raw.replace(b"+", b" ").replace(b"%2F", b"/")
    if b"%" in raw:
        raw = _PERCENT.sub(lambda m: _PERCENT_BYTES[m[0].lower()], raw)
    if b"&" in raw:
        return _xml_text(raw)
    return raw.decode()


def _element(within: bytes, name: bytes) -> bytes | None:
    """The text of the first ``<name>`` element in ``within`` (elements of a listing hold text
    only), None if there is none."""
    start = within.find(b"<" + name + b">")
    if start < 0:
        return None
    start += len(name) + 2
    end = within.find(b"<", start)
    if end < 0:
        raise ValueError(f"an unterminated {name.decode()}")
    return within[start:end]


def _parse_listing(body: bytes) -> dict[str, Any]:
    """A ListObjectsV2 answer (asked with ``encoding-type=url``) as boto3 returns it. Read by
    string search over its flat, fixed shape (``ListBucketResult`` holding ``Contents`` of
    ``Key``, ``ETag``, ``Size``, elements of text only, no CDATA): a task that revalidates once
    per process spent more CPU importing ``xml.etree`` (5 ms) and unquoting keys with
    ``urllib`` (2 ms per 272 keys) than on the listing's request. A body of another shape is a
    ``ValueError``."""
    if _ROOT.search(body) is None:
        raise ValueError("not a ListBucketResult")
    # The result's own fields lie outside its Contents (NextContinuationToken may come last).
    head, *parts = body.split(b"<Contents>")
    items: list[bytes] = []
    outside = [head]
    for part in parts:
        item, closed, tail = part.partition(b"</Contents>")
        if not closed:
            raise ValueError("an unterminated Contents")
        items.append(item)
        outside.append(tail)
    result = b"".join(outside)
    encoding = _element(result, b"EncodingType")
    url_encoded = encoding is not None and encoding.lower() == b"url"
    contents = []
    for item in items:
        key = _element(item, b"Key")
        if key is None:
            raise ValueError("a Contents without a Key")
        etag = (_element(item, b"ETag") or b"").replace(b"&#34;", b'"').replace(b"&quot;", b'"')
        contents.append({
            "Key": _url_text(key) if url_encoded else _xml_text(key),
            "ETag": _xml_text(etag) if b"&" in etag else etag.decode(),
            "Size": int(_element(item, b"Size") or 0),
        })
    truncated = _element(result, b"IsTruncated")
    page: dict[str, Any] = {
        "Contents": contents,
        "IsTruncated": truncated is not None and truncated.strip().lower() == b"true",
    }
    token = _element(result, b"NextContinuationToken")
    if token:
        page["NextContinuationToken"] = _xml_text(token)
    return page


def _status(exc: BaseException) -> int:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return 0
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _read_body(body: Any, size: int, on_progress: Callable[[], None] | None) -> bytes:
    """The whole body; in ``BODY_CHUNK_BYTES`` pieces with ``on_progress`` between them when it
    is larger than one piece. The buffer grows as the pieces arrive (doubling), not to the size
    the answer announced: a Content-Length that lies (up to S3's 5 TiB) costs what was sent."""
    try:
        if size <= BODY_CHUNK_BYTES or on_progress is None:
            return body.read()
        buffer = bytearray(BODY_CHUNK_BYTES)
        at = 0
        while at < size:
            if at == len(buffer):
                buffer.extend(bytes(min(len(buffer), size - at)))
            with memoryview(buffer) as view:
                got = body.readinto(view[at:at + min(BODY_CHUNK_BYTES, size - at)])
            if not got:
                break
            at += got
            on_progress()
        del buffer[at:]
        return bytes(buffer)
    finally:
        body.close()
