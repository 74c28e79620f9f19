"""Bad input against real servers gets a typed refusal and changes nothing (issue 12, items 2
and 4): a delete_prefix without its prefix, a set_epoch to epoch 0, a token that is missing or
not a string, an object header with a non-zero reserved field, hints as strings."""

from __future__ import annotations

import json
import socket
import struct

import pytest
from fixtures_servers import ServerSet

from pocketflow.cluster import LocalCluster
from pocketflow.errors import InvalidRequest, PermissionDenied
from pocketflow.handle import JobHandle
from pocketflow.protocol import (
    OP_PUT,
    action_body,
    encode_frame,
    encode_op_parts,
    exchange_descriptor,
    small_header,
)
from pocketflow.transport import ServerConnection


def _connection(handle: JobHandle) -> ServerConnection:
    command = exchange_descriptor(handle.context())
    return ServerConnection(handle.servers[0].address, exchange_command=lambda: command)


def test_delete_prefix_needs_its_prefix(storage_servers: ServerSet, job_handle: JobHandle) -> None:
    connection = _connection(job_handle)
    ctx = job_handle.context()
    try:
        connection.action("create_bucket", action_body(ctx, bucket="b"))
        header = small_header(3, 1, persist=False).encode()
        for key in (b"a", b"b", b"c"):
            assert connection.call(job_handle.epoch, OP_PUT, 0, b"b", key, header, b"x").status == 0
        with pytest.raises(InvalidRequest, match="prefix"):
            connection.action("delete_prefix", action_body(ctx, bucket="b"))
        listed = connection.action("enumerate", action_body(ctx, bucket="b", prefix="", limit=10))
        assert len(listed["keys"]) == 3, listed
        # An explicit empty prefix is the caller's intent: everything goes.
        assert connection.action("delete_prefix", action_body(ctx, bucket="b", prefix=""))[
            "deleted"] == 3
    finally:
        connection.close()


def test_set_epoch_zero_is_refused(storage_servers: ServerSet, job_handle: JobHandle) -> None:
    server = storage_servers.infos[0]
    with storage_servers.admin(server.address) as admin:
        with pytest.raises(InvalidRequest, match="epoch"):
            admin.set_epoch("a-job-nobody-registered", 0, job_handle.weight_map())
        assert admin.set_epoch("a-job-nobody-registered", 1, job_handle.weight_map()) == {}


@pytest.mark.parametrize(
    "token", [None, 12, {"a": 1}, ["t"]], ids=["missing", "int", "map", "list"]
)
def test_a_token_that_is_missing_or_not_text_is_permission_denied(
    storage_servers: ServerSet, job_handle: JobHandle, token: object
) -> None:
    ctx: dict[str, object] = {"job": job_handle.job_id, "epoch": job_handle.epoch}
    if token is not None:
        ctx["token"] = token
    body = json.dumps({"ctx": ctx, "bucket": "b", "key": "k"}).encode()
    connection = ServerConnection(job_handle.servers[0].address,
                                  exchange_command=lambda: json.dumps({"ctx": ctx}).encode())
    try:
        with pytest.raises(PermissionDenied):
            connection.action("lookup", body)
        with pytest.raises(PermissionDenied):
            connection.call(job_handle.epoch, OP_PUT, 0, b"b", b"k",
                            small_header(3, 1, persist=False).encode(), b"x")
    finally:
        connection.close()


def _direct_message(sock: socket.socket) -> tuple[int, bytes]:
    head = b""
    while len(head) < 5:
        chunk = sock.recv(5 - len(head))
        assert chunk, "the server closed before answering"
        head += chunk
    kind, length = struct.unpack("<BI", head)
    payload = b""
    while len(payload) < length:
        chunk = sock.recv(length - len(payload))
        assert chunk
        payload += chunk
    return kind, payload


def test_a_header_with_reserved_bytes_set_is_refused_and_not_stored(
    storage_servers: ServerSet, job_handle: JobHandle
) -> None:
    """Raw direct-exchange bytes: a PUT whose header's reserved field is not zero."""
    connection = _connection(job_handle)
    try:
        connection.action("create_bucket", action_body(job_handle.context(), bucket="r"))
        header = bytearray(small_header(5, 1, persist=False).encode())
        header[28:32] = b"\x01\x00\x00\x00"
        parts: list[bytes] = []
        encode_op_parts(parts, 1, OP_PUT, 0, b"r", b"reserved", bytes(header), b"x")
        frame = encode_frame(job_handle.epoch, 1, parts)
        host, port = job_handle.servers[0].address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            command = exchange_descriptor(job_handle.context())
            sock.sendall(b"PFXCHG01" + struct.pack("<BI", 1, len(command)) + command)
            assert _direct_message(sock) == (2, b"")  # READY
            sock.sendall(struct.pack("<BI", 3, len(frame)) + frame)
            kind, payload = _direct_message(sock)
        assert kind == 4, (kind, payload)  # STATUS
        assert payload[0] == 3 and b"reserved" in payload, payload
        listed = connection.action(
            "enumerate", action_body(job_handle.context(), bucket="r", prefix="", limit=10)
        )
        assert listed["keys"] == []
    finally:
        connection.close()


def test_register_takes_hints_as_strings_like_register_job(local_cluster: LocalCluster) -> None:
    handle = local_cluster.control.register("string-hints", {"data_size_bytes": "8MiB"})
    try:
        assert handle.servers
    finally:
        local_cluster.control.deregister(handle.job_id)
    with pytest.raises(ValueError, match="eight"):  # ConfigError, before any Ray call
        local_cluster.control.register("bad-hints", {"data_size_bytes": "eight"})
