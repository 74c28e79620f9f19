"""Wire codecs and limits: pinned to the Rust protocol crate and to the byte layouts of the spec."""

import ast
import json
import operator
import re
import struct
from pathlib import Path

import pytest

from pocketflow import protocol
from pocketflow.errors import InvalidRequest
from pocketflow.protocol import (
    FRAME_VERSION,
    OP_FLAG_OVERWRITE,
    OP_FLAG_PERSIST,
    OP_GET,
    OP_PUT,
    ZERO_HEADER,
    ObjectHeader,
    Reply,
    decode_get_piece_meta,
    decode_put_batch_meta,
    decode_reply_frame,
    decode_request_frame,
    encode_frame,
    encode_get_piece_meta,
    encode_op_parts,
    encode_put_batch_meta,
    encode_reply_frame,
    large_header,
    small_header,
)

LIMITS_RS = Path(__file__).resolve().parents[1] / "servers/crates/protocol/src/limits.rs"
_OPS = {ast.Mult: operator.mul, ast.Add: operator.add, ast.Sub: operator.sub,
        ast.LShift: operator.lshift, ast.Pow: operator.pow}


def _eval_rust_const(expr: str) -> object:
    def walk(node: ast.AST) -> object:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"unsupported constant expression {expr!r}")

    return walk(ast.parse(expr, mode="eval").body)


def _rust_limits() -> dict[str, object]:
    text = LIMITS_RS.read_text()
    found = re.findall(r"pub const (\w+): [^=]+= (.+?);", text)
    return {name: _eval_rust_const(value) for name, value in found}


def test_every_rust_limit_is_mirrored_with_the_same_value() -> None:
    limits = _rust_limits()
    assert len(limits) >= 17
    for name, value in limits.items():
        assert hasattr(protocol, name), f"protocol.py lacks {name}"
        assert getattr(protocol, name) == value, name


def test_header_round_trip_and_layout() -> None:
    header = ObjectHeader(version=7, size=3 << 20, block_count=3, block_size=1 << 20, flags=1)
    raw = header.encode()
    assert len(raw) == 32
    assert raw == struct.pack("<QQIIII", 7, 3 << 20, 3, 1 << 20, 1, 0)
    assert ObjectHeader.decode(raw) == header
    assert header.persist and not header.is_small
    assert header.data_block_len(3) == 1 << 20
    with pytest.raises(IndexError):
        header.data_block_len(4)
    odd = large_header(5, 10, 4, persist=False)
    assert (odd.block_count, odd.data_block_len(3)) == (3, 2)
    assert small_header(1, 9, persist=True) == ObjectHeader(1, 9, 0, 0, 1)
    assert ObjectHeader.from_json(header.to_json()) == header


def test_request_frame_layout_matches_the_spec() -> None:
    parts: list[object] = []
    header = small_header(9, 3, persist=True).encode()
    length = encode_op_parts(parts, 42, OP_PUT, OP_FLAG_PERSIST | OP_FLAG_OVERWRITE, b"bk", b"key",
                             header, b"abc")
    frame = encode_frame(5, 1, parts)
    assert length == 52 + 2 + 3 + 3
    assert len(frame) == 16 + length
    assert frame[:16] == bytes([FRAME_VERSION, 0, 0, 0]) + struct.pack("<QI", 5, 1)
    op = frame[16:]
    assert struct.unpack_from("<QBBHHHI", op) == (42, 1, 6, 2, 3, 0, 3)
    assert op[20:52] == header
    assert op[52:] == b"bkkeyabc"


def test_request_frame_round_trip_of_many_ops() -> None:
    parts: list[object] = []
    for i in range(100):
        encode_op_parts(parts, i, OP_GET, 1, b"b", f"k{i}".encode())
    epoch, ops = decode_request_frame(encode_frame(3, 100, parts))
    assert epoch == 3
    assert [op.key for op in ops] == [f"k{i}" for i in range(100)]
    assert all(op.flags == 1 and op.header == ObjectHeader(0, 0) for op in ops)
    with pytest.raises(InvalidRequest):
        encode_frame(3, 0, [])
    with pytest.raises(InvalidRequest):
        encode_frame(3, protocol.FRAME_OPS_MAX + 1, parts)


def test_reply_frame_round_trip() -> None:
    header = ObjectHeader(1, 5)
    replies = [
        Reply(7, 0, header, memoryview(b"hello")),
        Reply(8, 5, None, memoryview(b"not_found: k")),
        Reply(9, 0, None, memoryview(b"")),
    ]
    raw = encode_reply_frame(replies)
    assert raw[:8] == bytes([FRAME_VERSION, 0, 0, 0]) + struct.pack("<I", 3)
    assert struct.unpack_from("<QBBHI", raw, 8) == (7, 0, 1, 0, 5)
    decoded = decode_reply_frame(raw)
    assert [(r.request_id, r.status, r.header, bytes(r.body)) for r in decoded] == [
        (7, 0, header, b"hello"), (8, 5, None, b"not_found: k"), (9, 0, None, b"")]


def test_truncated_reply_frames_are_refused() -> None:
    raw = encode_reply_frame([Reply(7, 0, ObjectHeader(1, 5), memoryview(b"hello"))])
    for cut in (3, 10, 30, len(raw) - 1):
        with pytest.raises(InvalidRequest):
            decode_reply_frame(raw[:cut])
    with pytest.raises(InvalidRequest):
        decode_reply_frame(bytes([2]) + raw[1:])


def test_stream_metadata_codecs() -> None:
    assert encode_put_batch_meta(3, 1 << 20) == struct.pack("<IQ", 3, 1 << 20)
    assert decode_put_batch_meta(encode_put_batch_meta(3, 99)) == (3, 99)
    assert len(encode_get_piece_meta(1, 2, 3)) == 20
    assert decode_get_piece_meta(encode_get_piece_meta(1, 4096, 512)) == (1, 4096, 512)
    with pytest.raises(InvalidRequest):
        decode_get_piece_meta(b"short")


def test_json_bodies() -> None:
    ctx = protocol.context("job", 2, "tok")
    assert json.loads(protocol.exchange_descriptor(ctx)) == {"ctx": ctx}
    put = json.loads(protocol.put_descriptor(ctx, bucket="b", key="k", version=9,
                                             block_size=1024, persist=True))
    assert put == {"ctx": ctx, "bucket": "b", "key": "k", "version": 9, "block_size": 1024,
                   "persist": True}
    ticket = json.loads(protocol.get_ticket(ctx, bucket="b", key="k", version=9,
                                            ranges=[(1, 0, 10), (2, 5, 5)], delete=True))
    assert ticket["ranges"] == [[1, 0, 10], [2, 5, 5]] and ticket["delete"] is True
    assert json.loads(protocol.action_body(ctx, bucket="b")) == {"ctx": ctx, "bucket": "b"}
    with pytest.raises(InvalidRequest):
        protocol.get_ticket(ctx, bucket="b", key="k", version=9, ranges=[], delete=False)


def test_name_checks() -> None:
    assert protocol.check_bucket("b") == b"b"
    assert protocol.check_key("ключ") == "ключ".encode()
    for bad in ("", "x" * 256):
        with pytest.raises(InvalidRequest):
            protocol.check_bucket(bad)
    for bad in ("", "k" * 1025):
        with pytest.raises(InvalidRequest):
            protocol.check_key(bad)
    with pytest.raises(InvalidRequest):
        protocol.check_key(b"bytes")  # type: ignore[arg-type]
    assert ZERO_HEADER == bytes(32)
