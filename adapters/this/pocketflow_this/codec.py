"""How a stage's return value travels as one object: pickle protocol 5 with its buffers out of
band, so numpy frames are laid out raw and come back as views of the received bytes.

Layout: ``MAGIC``, the pickle's length and the buffer count (little-endian u64, u32), the
buffers' lengths (u64 each), the pickle, then the buffers, each raw.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

__all__ = ["encode", "decode", "CodecError"]

MAGIC = b"PFT1"
BUFFERS_MAX = 4096
"""Most out-of-band buffers in one value (a value with more is pickled in band)."""
_HEAD = struct.Struct("<4sQI")


class CodecError(ValueError):
    """The bytes are not a value written by :func:`encode`."""


def encode(value: Any) -> bytes:
    """One bytes object holding ``value`` (its buffers copied once, into the result)."""
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    if len(buffers) > BUFFERS_MAX:
        buffers = []
        body = pickle.dumps(value, protocol=5)
    raws = [b.raw() for b in buffers]
    lengths = struct.pack(f"<{len(raws)}Q", *(len(r) for r in raws))
    return b"".join([_HEAD.pack(MAGIC, len(body), len(raws)), lengths, body, *raws])


def decode(data: bytes | bytearray | memoryview) -> Any:
    """The value :func:`encode` wrote; its buffers are views of ``data`` (no copy)."""
    view = memoryview(data).cast("B")
    if len(view) < _HEAD.size:
        raise CodecError(f"{len(view)} bytes are too short for a value")
    magic, body_len, count = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise CodecError(f"not a pocketflow-this value (magic {bytes(magic)!r})")
    if count > BUFFERS_MAX:
        raise CodecError(f"{count} buffers, more than {BUFFERS_MAX}")
    at = _HEAD.size
    lengths = struct.unpack_from(f"<{count}Q", view, at)
    at += 8 * count
    if at + body_len + sum(lengths) != len(view):
        raise CodecError(f"value of {len(view)} bytes does not match its header")
    body = view[at:at + body_len]
    at += body_len
    buffers = []
    for length in lengths:
        buffers.append(view[at:at + length])
        at += length
    return pickle.loads(body, buffers=buffers)
