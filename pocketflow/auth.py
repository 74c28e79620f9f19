"""Capability tokens: HMAC-SHA256 over a job id and an expiry, keyed by the cluster secret.

A token is ``"<expiry_unix_ms>.<hex(HMAC-SHA256(secret, job + "\\n" + expiry_unix_ms))>"``
(docs/PROTOCOL.md). The storage servers read the same secret from a 0600 file at start and check
every request's token; the admin token is the same construction for :data:`ADMIN_JOB_ID`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

from pocketflow.errors import ConfigError, PermissionDenied
from pocketflow.protocol import ADMIN_JOB_ID, JOB_ID_MAX_BYTES

__all__ = [
    "ADMIN_JOB_ID",
    "SECRET_MIN_BYTES",
    "make_token",
    "admin_token",
    "verify_token",
    "token_expiry_unix_ms",
    "new_secret",
    "write_secret_file",
    "read_secret_file",
]

SECRET_MIN_BYTES = 16
"""Shortest cluster secret the servers accept."""
SECRET_DEFAULT_HEX_CHARS = 64


def _mac(secret: bytes, job_id: str, expiry_ms: int) -> str:
    message = f"{job_id}\n{expiry_ms}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def make_token(secret: bytes, job_id: str, *, ttl_s: float) -> str:
    """A token that lets its holder reach ``job_id``'s records for ``ttl_s`` seconds."""
    if len(secret) < SECRET_MIN_BYTES:
        raise ConfigError(f"cluster secret must be at least {SECRET_MIN_BYTES} bytes")
    if not job_id or len(job_id.encode()) > JOB_ID_MAX_BYTES:
        raise ConfigError(f"job id must be 1..{JOB_ID_MAX_BYTES} bytes, got {job_id!r}")
    if ttl_s <= 0:
        raise ConfigError(f"token ttl must be positive, got {ttl_s}")
    expiry_ms = int(time.time() * 1000 + ttl_s * 1000)
    return f"{expiry_ms}.{_mac(secret, job_id, expiry_ms)}"


def admin_token(secret: bytes, *, ttl_s: float) -> str:
    """A control-plane token (``set_epoch``, ``stats``, ``drain``, ``delete_job`` of any job)."""
    return make_token(secret, ADMIN_JOB_ID, ttl_s=ttl_s)


def verify_token(secret: bytes, job_id: str, token: str, *, now_ms: int | None = None) -> None:
    """Check a token as a server does; raise :class:`PermissionDenied` if it does not hold."""
    expiry_text, dot, mac = token.partition(".")
    if not dot or not expiry_text.isdigit() or len(mac) != 64:
        raise PermissionDenied("permission_denied: malformed token")
    expiry_ms = int(expiry_text)
    current_ms = int(time.time() * 1000) if now_ms is None else now_ms
    if expiry_ms <= current_ms:
        raise PermissionDenied("permission_denied: token expired")
    if not hmac.compare_digest(mac, _mac(secret, job_id, expiry_ms)):
        raise PermissionDenied("permission_denied: token does not match the job")


def token_expiry_unix_ms(token: str) -> int:
    """When ``token`` expires (Unix ms), read from the token itself (no secret needed); raises
    :class:`PermissionDenied` for a malformed token."""
    expiry_text, dot, _ = token.partition(".")
    if not dot or not expiry_text.isdigit():
        raise PermissionDenied("permission_denied: malformed token")
    return int(expiry_text)


def new_secret() -> bytes:
    """A fresh cluster secret: 64 hex characters (32 random bytes), usable as file contents."""
    return secrets.token_hex(SECRET_DEFAULT_HEX_CHARS // 2).encode("ascii")


def write_secret_file(path: str | os.PathLike[str], secret: bytes | None = None) -> bytes:
    """Create ``path`` with mode 0600 holding ``secret`` (a new one if omitted); returns it.

    The file's bytes, exactly, are the HMAC key; it is created exclusively, so an existing file is
    never overwritten.
    """
    value = new_secret() if secret is None else secret
    if len(value) < SECRET_MIN_BYTES:
        raise ConfigError(f"cluster secret must be at least {SECRET_MIN_BYTES} bytes")
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(value)
    return value


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """Read a cluster secret file; its bytes, exactly, are the HMAC key."""
    try:
        value = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read cluster secret {path}: {exc}") from exc
    if len(value) < SECRET_MIN_BYTES:
        raise ConfigError(f"cluster secret {path} is shorter than {SECRET_MIN_BYTES} bytes")
    return value
