"""Capability tokens: the format of docs/PROTOCOL.md, verification, secret files."""

import hashlib
import hmac
import os
import stat
import time

import pytest

from pocketflow.auth import (
    ADMIN_JOB_ID,
    admin_token,
    make_token,
    new_secret,
    read_secret_file,
    verify_token,
    write_secret_file,
)
from pocketflow.errors import ConfigError, PermissionDenied

SECRET = b"0123456789abcdef0123456789abcdef"


def test_token_format_matches_the_protocol() -> None:
    before_ms = int(time.time() * 1000)
    token = make_token(SECRET, "sort-3f2a9c", ttl_s=60)
    after_ms = int(time.time() * 1000)  # a stalled test process must not move the bounds
    expiry_text, mac = token.split(".")
    expiry_ms = int(expiry_text)
    assert before_ms + 59_000 <= expiry_ms <= after_ms + 61_000
    expected = hmac.new(SECRET, f"sort-3f2a9c\n{expiry_ms}".encode(), hashlib.sha256).hexdigest()
    assert mac == expected
    verify_token(SECRET, "sort-3f2a9c", token)


def test_admin_token_is_for_the_reserved_job() -> None:
    assert ADMIN_JOB_ID == "__admin__"
    token = admin_token(SECRET, ttl_s=10)
    verify_token(SECRET, ADMIN_JOB_ID, token)
    with pytest.raises(PermissionDenied):
        verify_token(SECRET, "some-job", token)


def test_wrong_secret_expired_and_malformed_tokens_are_refused() -> None:
    token = make_token(SECRET, "job", ttl_s=10)
    with pytest.raises(PermissionDenied):
        verify_token(b"another secret of enough length", "job", token)
    with pytest.raises(PermissionDenied):
        verify_token(SECRET, "job", token, now_ms=int(token.split(".")[0]) + 1)
    for bad in ("", "abc", "123.", "x.deadbeef", token + "0"):
        with pytest.raises(PermissionDenied):
            verify_token(SECRET, "job", bad)


def test_bad_inputs_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        make_token(b"short", "job", ttl_s=10)
    with pytest.raises(ConfigError):
        make_token(SECRET, "", ttl_s=10)
    with pytest.raises(ConfigError):
        make_token(SECRET, "j" * 129, ttl_s=10)
    with pytest.raises(ConfigError):
        make_token(SECRET, "job", ttl_s=0)


def test_secret_file_is_private_and_exact(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "secret")
    secret = write_secret_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_secret_file(path) == secret
    assert len(secret) == 64 and secret.isalnum()
    with pytest.raises(FileExistsError):
        write_secret_file(path)
    assert new_secret() != new_secret()
    short = os.path.join(tmp_path, "short")
    with open(short, "wb") as f:
        f.write(b"tiny")
    with pytest.raises(ConfigError):
        read_secret_file(short)
