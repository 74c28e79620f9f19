"""gg's content names and placeholders.

A content name is ``V`` (a value) or ``T`` (a thunk), then the SHA-256 of the bytes in URL-safe
base64 without padding with ``-`` written as ``.``, then the size in 8 lowercase hex digits. An
output other than a thunk's first is named ``<thunk name>#<tag>``. ``@{GGHASH:<name>}`` in a
thunk's arguments or environment stands for the path of that object where the thunk runs.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

from pocketflow_gg.errors import InvalidName

MAGIC = b"##GGTHUNK##"
"""The first bytes of every thunk file."""
DIGEST_CHARS = 43
"""Characters of the base64 SHA-256 in a name."""
NAME_CHARS = 1 + DIGEST_CHARS + 8
SIZE_MAX_BYTES = 0xFFFFFFFF
"""gg writes sizes in 8 hex digits (and reads them as 32-bit), so larger objects have no name."""
PLACEHOLDER_START = "@{GGHASH:"
PLACEHOLDER_END = "}"
_NAME = re.compile(r"^[VT][A-Za-z0-9_.]{43}[0-9a-f]{8}$")
_PLACEHOLDER = re.compile(r"@\{GGHASH:([VT][A-Za-z0-9_.]{43}[0-9a-f]{8}(?:#[^}]*)?)\}")
_READ_CHUNK_BYTES = 1 << 20


def _name(kind: str, digest: bytes, size: int) -> str:
    if size > SIZE_MAX_BYTES:
        raise InvalidName(f"{size} bytes is more than a gg name can describe")
    text = base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii").replace("-", ".")
    return f"{kind}{text}{size:08x}"


def content_name(data: bytes | bytearray | memoryview) -> str:
    """gg's name of ``data``: a ``T`` name if it starts with the thunk magic, else ``V``."""
    kind = "T" if bytes(data[: len(MAGIC)]) == MAGIC else "V"
    return _name(kind, hashlib.sha256(data).digest(), len(data))


def file_name(path: str | Path) -> str:
    """gg's name of a file's contents (what ``gg hash FILE`` prints), read in chunks."""
    digest = hashlib.sha256()
    size = 0
    head = b""
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK_BYTES):
            if size < len(MAGIC):
                head = (head + chunk)[: len(MAGIC)]
            digest.update(chunk)
            size += len(chunk)
    return _name("T" if head == MAGIC else "V", digest.digest(), size)


def check_name(name: str) -> str:
    """``name`` if it is a content name (optionally ``#tag``), else :class:`InvalidName`."""
    if not isinstance(name, str) or not _NAME.match(name.split("#", 1)[0]):
        raise InvalidName(f"not a gg content name: {name!r}")
    return name


def is_thunk(name: str) -> bool:
    """Whether ``name`` names a thunk (``T``)."""
    return check_name(name)[0] == "T"


def size_of(name: str) -> int:
    """The object's size in bytes, read from its name."""
    base = check_name(name).split("#", 1)[0]
    return int(base[-8:], 16)


def output_name(thunk_name: str, tag: str) -> str:
    """The name of the output ``tag`` of a thunk other than its first (``T...#tag``)."""
    return f"{check_name(thunk_name)}#{tag}"


def placeholder(name: str) -> str:
    """``@{GGHASH:name}``, which a worker replaces with the object's path."""
    return f"{PLACEHOLDER_START}{check_name(name)}{PLACEHOLDER_END}"


def placeholders_in(text: str) -> list[str]:
    """The names of the placeholders in ``text``, in order."""
    return _PLACEHOLDER.findall(text)


def replace_placeholders(text: str, path_of: dict[str, str]) -> str:
    """``text`` with every placeholder replaced by ``path_of[name]`` (a missing name raises
    ``KeyError``)."""
    return _PLACEHOLDER.sub(lambda m: path_of[m.group(1)], text)
