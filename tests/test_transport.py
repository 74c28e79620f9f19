"""Transport pieces against a real server: the admin client and session behaviour."""

from __future__ import annotations

import pytest
from fixtures_servers import ServerSet

from pocketflow.auth import make_token
from pocketflow.errors import DataUnavailable, PermissionDenied
from pocketflow.handle import JobHandle
from pocketflow.protocol import OP_GET, OP_PUT, SMALL_OBJECT_MAX_BYTES, small_header
from pocketflow.transport import AdminClient, ServerConnection


def test_admin_client(storage_servers: ServerSet, job_handle: JobHandle) -> None:
    server = storage_servers.infos[0]
    with storage_servers.admin(server.address) as admin:
        stats = admin.stats()
        assert stats["node_id"] == server.node_id
        assert stats["tier"] == "dram"
        assert {"capacity_bytes", "used_bytes", "objects", "jobs", "cpu_utilization"} <= set(stats)
        assert admin.set_epoch(job_handle.job_id, 1, job_handle.weight_map()) == {}
        result = admin.delete_job(job_handle.job_id)
        assert {"deleted", "freed_bytes"} <= set(result)


def test_admin_needs_the_admin_token(storage_servers: ServerSet, job_handle: JobHandle) -> None:
    server = storage_servers.infos[0]
    with AdminClient(server.address, job_handle.token) as not_admin:
        with pytest.raises(PermissionDenied):
            not_admin.stats()
        with pytest.raises(PermissionDenied):
            not_admin.set_epoch(job_handle.job_id, 9, job_handle.weight_map())
    forged = make_token(b"some other secret, long enough", "__admin__", ttl_s=60)
    with AdminClient(server.address, forged) as impostor:
        with pytest.raises(PermissionDenied):
            impostor.drain(exit_when_empty=False)


def test_admin_of_dead_address_is_unavailable() -> None:
    with AdminClient("127.0.0.1:1", "0.x", timeout_s=2) as admin:
        with pytest.raises(DataUnavailable):
            admin.stats()


SMALL_OPS = pytest.mark.parametrize("direct", [True, False], ids=["direct", "flight"])


@SMALL_OPS
def test_pipelined_batches_report_each_op_on_either_session_kind(
    storage_servers: ServerSet, job_handle: JobHandle, direct: bool
) -> None:
    """More ops than a frame or a window holds, pipelined per server: each op's own outcome comes
    back in order, a missing key fails alone, and an object of exactly the small-object bound
    travels as one op."""
    from pocketflow.client import connect
    from pocketflow.errors import ObjectNotFound

    small_ops = "direct" if direct else "flight"
    with connect(job_handle, small_ops=small_ops, exchange_window=64) as client:
        client.create_bucket("b")
        keys = [f"k{i}" for i in range(1500)]
        assert client.put_many("b", [(key, key.encode()) for key in keys]) == 1500
        got = client.get_each("b", [*keys, "absent"])
        assert got[:-1] == [key.encode() for key in keys]
        assert isinstance(got[-1], ObjectNotFound)
        edge = bytes(SMALL_OBJECT_MAX_BYTES)
        client.put("b", "edge", edge)
        assert client.get("b", "edge") == edge


@SMALL_OPS
def test_refused_calls_free_their_session(
    storage_servers: ServerSet, job_handle: JobHandle, direct: bool
) -> None:
    """A call refused on the way in (bad arguments) or failed on the way (an op of a stale
    pooled session) must not leak its session's pool slot."""
    from pocketflow.protocol import action_body, exchange_descriptor

    server = job_handle.servers[0]
    command = exchange_descriptor(job_handle.context())
    connection = ServerConnection(
        server.address, exchange_command=lambda: command, sessions_max=1, op_timeout_s=2.0,
        direct=direct,
    )
    try:
        connection.action("create_bucket", action_body(job_handle.context(), bucket="b"))
        header = small_header(7, 3, persist=False).encode()
        connection.call(job_handle.epoch, OP_PUT, 0, b"b", b"k", header, b"abc")
        with pytest.raises(ValueError):
            connection.call(job_handle.epoch, OP_GET, 0, b"b", b"k", b"short header")
        with pytest.raises(TypeError):
            connection.call(job_handle.epoch, OP_PUT, 0, b"b", b"k2", header, 12345)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            connection.call(job_handle.epoch, 99, 0, b"b", b"k")
        with pytest.raises(ValueError):
            connection.call(job_handle.epoch, OP_GET, 0, b"b", b"\xff")
        # With one session allowed, a leaked slot would make this wait and fail as unavailable.
        reply = connection.call(job_handle.epoch, OP_GET, 0, b"b", b"k")
        assert reply.status == 0 and bytes(reply.body) == b"abc"
    finally:
        connection.close()


@SMALL_OPS
def test_server_that_never_answers_the_connection_fails_promptly(direct: bool) -> None:
    """A listener that accepts TCP but never answers (a hung server) must fail a new session
    within the first-reply bound, not gRPC's 20 s connection deadline."""
    import socket
    import time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    connection = ServerConnection(
        address, exchange_command=lambda: b"{}", op_timeout_s=2.0,
        first_reply_timeout_s=1.0, direct=direct,
    )
    try:
        started = time.monotonic()
        with pytest.raises(DataUnavailable):
            connection.call(1, OP_GET, 0, b"b", b"k")
        assert time.monotonic() - started < 6.0
    finally:
        connection.close()
        listener.close()


def test_a_plain_arrow_flight_client_reads_a_block_by_ticket(
    storage_servers: ServerSet, job_handle: JobHandle
) -> None:
    """Flight stays the interface any Arrow Flight client can use: pyarrow's own client fetches
    a data block that the native client core wrote, by a DoGet ticket."""
    import pyarrow.flight as flight

    from pocketflow.client import connect
    from pocketflow.placement import Placement
    from pocketflow.protocol import OP_LOOKUP, exchange_descriptor, get_ticket

    with connect(job_handle) as client:
        client.create_bucket("arrow")
        data = bytes(range(256)) * (4096 + 3)  # a large object: two blocks of 1 MiB
        client.put("arrow", "obj", data)
        key_raw = b"obj"
        primary = Placement(job_handle.servers).server_for(key_raw, 0)
        command = job_handle.context()
        lookup = ServerConnection(primary.address,
                                  exchange_command=lambda: exchange_descriptor(command))
        try:
            header = lookup.call(job_handle.epoch, OP_LOOKUP, 0, b"arrow", key_raw).header
        finally:
            lookup.close()
        assert header is not None and header.block_count == 2
        block_server = Placement(job_handle.servers).server_for(key_raw, 2)
        tail = header.size - header.block_size
        ticket = get_ticket(job_handle.context(), bucket="arrow", key="obj",
                            version=header.version, ranges=[(2, 0, tail)], delete=False)
        arrow_client = flight.connect(f"grpc://{block_server.address}")
        try:
            table = arrow_client.do_get(flight.Ticket(ticket)).read_all()
        finally:
            arrow_client.close()
        assert table.column_names == ["data"]
        got = b"".join(value.as_py() for value in table.column(0))
        assert got == data[header.block_size:]


@SMALL_OPS
def test_a_wrong_token_is_refused_typed_on_either_session_kind(
    storage_servers: ServerSet, job_handle: JobHandle, direct: bool
) -> None:
    from pocketflow.protocol import exchange_descriptor

    forged = make_token(b"some other secret, long enough", job_handle.job_id, ttl_s=60)
    context = dict(job_handle.context(), token=forged)
    command = exchange_descriptor(context)
    connection = ServerConnection(job_handle.servers[0].address,
                                  exchange_command=lambda: command, direct=direct)
    try:
        with pytest.raises(PermissionDenied):
            connection.call(job_handle.epoch, OP_GET, 0, b"b", b"k")
    finally:
        connection.close()


def test_direct_and_flight_small_ops_see_the_same_objects(
    storage_servers: ServerSet, job_handle: JobHandle
) -> None:
    """Both session kinds reach one store on one port: what one writes, the other reads, and
    write-once holds across them."""
    from pocketflow.protocol import action_body, exchange_descriptor

    command = exchange_descriptor(job_handle.context())
    address = job_handle.servers[0].address
    direct = ServerConnection(address, exchange_command=lambda: command, direct=True)
    flight = ServerConnection(address, exchange_command=lambda: command, direct=False)
    try:
        direct.action("create_bucket", action_body(job_handle.context(), bucket="x"))
        header = small_header(9, 2, persist=False).encode()
        assert direct.call(job_handle.epoch, OP_PUT, 0, b"x", b"d", header, b"dd").status == 0
        assert flight.call(job_handle.epoch, OP_PUT, 0, b"x", b"f", header, b"ff").status == 0
        assert bytes(flight.call(job_handle.epoch, OP_GET, 0, b"x", b"d").body) == b"dd"
        assert bytes(direct.call(job_handle.epoch, OP_GET, 0, b"x", b"f").body) == b"ff"
        again = flight.call(job_handle.epoch, OP_PUT, 0, b"x", b"d", header, b"ee")
        assert again.status == 6
        assert bytes(direct.call(job_handle.epoch, OP_GET, 0, b"x", b"d").body) == b"dd"
    finally:
        direct.close()
        flight.close()
