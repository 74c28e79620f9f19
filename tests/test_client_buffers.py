"""Reads into the caller's memory write only into writable destinations (issue 28, item 6): a
``bytes`` is immutable and may be shared (CPython keeps one object per one-byte value), so a
read into one is refused and leaves it as it was, at the public API (``ValueError``:
``InvalidRequest``) and at the native binding under it (``TypeError``)."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from pocketflow.client import Client
from pocketflow.protocol import OP_LOOKUP, ObjectHeader

LARGE_BYTES = 3 * 1024 * 1024 + 5  # several data blocks


def _header(client: Client, bucket: str, key: str) -> ObjectHeader:
    """The manifest of ``key``, from the server that holds it."""
    view = client._view
    for server in view.handle.servers:
        reply = client._call(view, server, OP_LOOKUP, 0, bucket.encode(), key.encode())
        if reply.status == 0 and reply.header is not None:
            return reply.header
    raise AssertionError(f"{key} is on no server")


def test_a_read_into_bytes_is_refused_and_changes_nothing(client: Client) -> None:
    client.create_bucket("b")
    small = b"\x07" * 5
    large = bytes(range(256)) * (LARGE_BYTES // 256) + b"\x07" * (LARGE_BYTES % 256)
    client.put("b", "small", small)
    client.put("b", "large", large)
    header = _header(client, "b", "large")
    for key, value in (("small", small), ("large", large)):
        dest = bytes(len(value))
        for readonly in (dest, memoryview(dest)):
            with pytest.raises(ValueError):
                client.get_into("b", key, readonly)
            with pytest.raises(TypeError):
                client._core.get_into("b", key, readonly)
        with pytest.raises(TypeError):
            client._core.read_blocks("b", "large", header.encode(), 0, len(value),
                                     delete=False, dest=dest)
        assert dest == bytes(len(value))
        # Writable destinations work, and the object is untouched by the refusals.
        into = bytearray(len(value))
        assert client.get_into("b", key, into) == len(value)
        assert bytes(into) == value


HUGE_READ_BYTES = 48 * 1024 * 1024
"""Above glibc's largest mmap threshold (32 MiB): every such ``bytes`` is a fresh mapping."""
PAGE_BYTES = 4096
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_pages_off() -> bool:
    try:
        return "[never]" in THP_SETTING.read_text()
    except OSError:
        return True


@pytest.mark.skipif(_huge_pages_off(), reason="transparent huge pages are off on this kernel")
def test_a_large_get_faults_its_fresh_bytes_in_by_huge_pages(client: Client) -> None:
    """A ``get()`` above 32 MiB returns a ``bytes`` that glibc maps afresh for it; filled 4 KiB
    page by page it costs one page fault (and one page clear) per 4 KiB, most of the call's CPU
    time. Its memory asks for huge pages, so the faults are a small fraction of that (a count,
    not a speed: the 4 KiB pages at the unaligned ends of the mapping still fault one by one)."""
    client.create_bucket("b")
    value = bytes(range(256)) * (HUGE_READ_BYTES // 256)
    client.put("b", "huge", value)
    assert client.get("b", "huge") == value
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    read = client.get("b", "huge")
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert read == value
    pages = HUGE_READ_BYTES // PAGE_BYTES
    assert faults < pages // 4, f"{faults} page faults for {pages} pages of 4 KiB"
