"""Type stub of ``pocketflow._core``, the native client core (``servers/crates/pyclient``).

Every blocking method releases the GIL; every failure is raised as a :mod:`pocketflow.errors`
class (mapped once, by ``error_from_grpc``).
"""

from typing_extensions import Buffer

RawHeader = tuple[int, int, int, int, int]
"""An object header as ``(version, size, block_count, block_size, flags)``."""
RawReply = tuple[int, RawHeader | None, bytes]
"""A small operation's reply: status (0 or a gRPC code), header, body."""

PLACED_OPS_MAX: int
"""Most ops one :meth:`Objects.run_placed` runs (one request frame's worth, 1024)."""

def parse_size(text: str) -> int:
    """Bytes of a size string in the one grammar (``pocketflow_protocol::units``); ``ValueError``
    saying why it is not one."""

def parse_duration_ns(text: str) -> int:
    """Nanoseconds of a duration string in the one grammar; ``ValueError`` saying why it is not
    one."""

def placed_block(block: int, block_count: int) -> int:
    """The block index placement hashes for data block ``block`` of an object of
    ``block_count`` data blocks: 0 (its manifest's) for an object of one data block."""

class Placement:
    """Weighted rendezvous placement over one weight map (what ``pocketflow/placement.py``
    wraps)."""

    def __init__(
        self,
        servers: list[tuple[str, float, bool]],
        pools: dict[str, list[str]] | None = None,
        routes: dict[str, str] | None = None,
    ) -> None:
        """``servers`` as ``(node_id, weight, persist)`` in the map's order; ``pools`` (name ->
        node ids) and ``routes`` (key prefix -> pool name) as a weight map's optional fields.
        Raises ``InvalidRequest`` for malformed pools or routes."""
    def servers_for(self, keys: list[bytes], block: int = 0, persist: bool = False) -> list[int]:
        """Index of each key's server in the map's order, -1 where none can hold it."""
    def server_for(self, key: bytes, block: int = 0, persist: bool = False) -> int:
        """Index of the key's server in the map's order, -1 where none can hold it."""
    def ranked(self, key: bytes, block: int = 0) -> list[int]:
        """Every server's index, best-scoring first (routes play no part)."""
    def has_persist(self) -> bool:
        """Whether PERSIST objects can be placed at all."""

class Connection:
    """One client's connection to one storage server."""

    def __init__(
        self,
        address: str,
        *,
        sessions_max: int,
        op_timeout_s: float,
        first_reply_timeout_s: float,
        rpc_timeout_s: float,
        stream_timeout_s: float,
        direct: bool = True,
        tls_ca: bytes | None = None,
    ) -> None: ...
    @property
    def address(self) -> str: ...
    def call(
        self, command: bytes, epoch: int, op: int, flags: int, bucket: bytes, key: bytes,
        header: bytes, value: Buffer | None,
    ) -> RawReply: ...
    def action(self, name: str, body: bytes, *, timeout_s: float | None = None) -> bytes: ...
    def close(self) -> None: ...

class Listing:
    """A listing in progress: pages of ``(key, size)`` in key order."""

    def __iter__(self) -> Listing: ...
    def __next__(self) -> list[tuple[str, int]]: ...

class Upload:
    """A streamed upload: data blocks sent in the background as they come, then the manifest."""

    @property
    def version(self) -> int: ...
    def add(self, index: int, block: Buffer) -> None:
        """Queue block ``index`` (held until sent); may wait for a send; raises earlier ones'."""
    def commit(self, size: int, overwrite: bool) -> None: ...
    def abort(self) -> None: ...

class SharedView:
    """One object pinned in a server's shared arena: ``memoryview(view)`` reads it in place;
    the pin is released when the view and its exports are gone."""
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...

class Objects:
    """The object layer of one job's client: the weight map in use (adopting newer ones), one
    connection per server, and the read and write paths of objects."""

    def __init__(
        self,
        handle_json: str,
        *,
        sessions_max: int,
        op_timeout_s: float,
        first_reply_timeout_s: float,
        rpc_timeout_s: float,
        stream_timeout_s: float,
        io_threads: int,
        exchange_window: int,
        direct: bool = True,
        tls_ca: bytes | None = None,
    ) -> None: ...
    def generation(self) -> int:
        """Changes whenever the weight map in use does."""
    def handle_json(self) -> str:
        """The handle in use (``JobHandle.to_json``)."""
    def set_handle(self, handle_json: str) -> None: ...
    def adopt_weight_map(self, weight_map_json: str) -> bool:
        """Adopt a newer map; returns whether it was newer."""
    def connection(self, address: str) -> Connection:
        """The connection the core itself uses for ``address``."""
    def close(self, *, reopen: bool) -> None: ...
    def enumerate(self, bucket: str, prefix: str, page_size: int) -> Listing:
        """A listing of the bucket under ``prefix``, merged from every server."""
    def upload(self, bucket: str, key: str, *, persist: bool) -> Upload: ...
    def get(self, bucket: str, key: str, *, delete: bool = False) -> bytes: ...
    def get_into(self, bucket: str, key: str, buffer: Buffer, *, delete: bool = False) -> int: ...
    def get_range(self, bucket: str, key: str, offset: int, length: int) -> bytes: ...
    def wait_for(self, bucket: str, keys: list[str], timeout_s: float) -> list[str]:
        """Block until every key exists or the timeout passes; the keys still missing."""
    def get_many(
        self, bucket: str, keys: list[str], *, delete: bool = False, each: bool = False
    ) -> list[bytes | BaseException]:
        """With ``each``, a failed key's exception stands in its place instead of being raised."""
    def get_many_into(
        self, bucket: str, keys: list[str], buffer: Buffer, offsets: list[int],
        sizes: list[int],
    ) -> list[BaseException | None]:
        """Object ``i`` into ``buffer[offsets[i]:offsets[i] + sizes[i]]``; None or its error."""
    def pin_views(self, bucket: str, keys: list[str]) -> list[SharedView | bytes | None]:
        """Per key its bytes pinned in place, a small object's bytes, or None (read it)."""
    def shared_counts(self) -> tuple[int, int, int]:
        """``(pinned, values, copied)`` of this client's zero-copy reads."""
    def lookup(
        self, bucket: str, key: str, *, lost_unavailable: bool = True
    ) -> tuple[int, bool]:
        """``(size, persist)``."""
    def call_placed(
        self, op: int, flags: int, bucket: bytes, key: bytes, block: int, header: bytes,
        value: Buffer,
    ) -> tuple[str, int, RawHeader | None, bytes]:
        """One small op on the server of block ``block`` of ``key``: ``(server address,
        status, header, body)``; a stale map is adopted and the op run again."""
    def run_placed(
        self, bucket: bytes, key: bytes, block: int, ops: list[tuple[int, int, bytes, Buffer]],
    ) -> list[RawReply]:
        """``(op, flags, header, value)`` ops on ``key``, pipelined on the server of block
        ``block`` of ``key``, like :meth:`call_placed` (a stale map adopted, the bucket created
        on a server added after it was made, the refused ops run again): each op's reply, in
        order. At most :data:`PLACED_OPS_MAX` ops, else ``InvalidRequest``."""
    def fetch_record(
        self, bucket: str, key: str, op: int, flags: int, *, lost_unavailable: bool = True
    ) -> tuple[str, RawHeader | None, bytes]:
        """Block 0 where it lives: ``(server address, header, body)``."""
    def read_blocks(
        self, bucket: str, key: str, header: bytes, start: int, end: int, *, delete: bool,
        dest: Buffer | None = None, value: bytes = b"",
    ) -> bytes | int: ...
    def restore_record(
        self, server: str, bucket: str, key: str, header: bytes, body: bytes
    ) -> None: ...
    def claim_record(
        self, server: str, bucket: str, key: str, header: bytes, body: bytes
    ) -> bool: ...
    def put(
        self, bucket: str, key: str, data: Buffer, *, persist: bool = False,
        overwrite: bool = False,
    ) -> None: ...
    def put_many(
        self, bucket: str, items: list[tuple[str, Buffer]], *, persist: bool = False,
        overwrite: bool = False,
    ) -> int: ...
    def delete_blocks(self, bucket: str, key: str, header: bytes) -> None: ...
