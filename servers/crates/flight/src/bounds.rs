//! Server-side resource bounds (not part of the client contract), from which the memory bound in
//! docs/PROTOCOL.md is computed.

use pocketflow_protocol::limits::{
    BATCH_MAX_BYTES, EPOCH_MAP_MAX_BYTES, FRAME_MAX_BYTES, MESSAGE_MAX_BYTES, SESSION_INFLIGHT_MAX,
    SMALL_OBJECT_MAX_BYTES,
};

/// Most client connections open at once, of both protocols; the listener stops accepting
/// while at the bound. Room for every connection in its handshake, every HTTP/2 connection and
/// a direct connection per session.
pub const CONNECTIONS_MAX: usize = HANDSHAKES_MAX + HTTP2_CONNECTIONS_MAX + EXCHANGE_SESSIONS_MAX;
/// Most connections in their handshake at once (first bytes, TLS, the HTTP/2 preface and
/// SETTINGS, or the direct magic and first message); one more is closed at once. Connections in
/// their handshake hold none of the places of served connections.
pub const HANDSHAKES_MAX: usize = 256;
/// A peer address's share of the handshake pool: once the pool is half full, a connection from
/// a peer with this many in their handshake is closed at once (below half, a burst from one
/// peer, such as the many workers of one node starting together, may take more). So one peer
/// holds at most half the pool, and other peers always find room.
pub const PEER_HANDSHAKES_MAX: usize = 32;
/// How long a connection's whole handshake may take, from its accept until it is served (its
/// wait for an HTTP/2 place included); a connection not done by then is closed.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a request stream (an RPC) may send nothing after it opens: one that sends no
/// message by then is failed, so a stream that never sends its body does not keep its
/// connection busy (`crate::request_start`).
pub const REQUEST_START_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Most HTTP/2 (Flight) connections served at once; further ones wait for a place within their
/// handshake's deadline.
pub const HTTP2_CONNECTIONS_MAX: usize = 128;
/// How long an HTTP/2 connection may carry no stream before it is closed, unless the server is
/// told otherwise (`--connection-idle`). Keepalive pings answered do not count as streams.
pub const CONNECTION_IDLE_DEFAULT: std::time::Duration = std::time::Duration::from_secs(120);
/// Most HTTP/2 connections of one peer address served at once: an HTTP/2 connection needs no
/// token, so one peer holds at most half of them.
pub const PEER_HTTP2_CONNECTIONS_MAX: usize = HTTP2_CONNECTIONS_MAX / 2;
/// Most concurrent HTTP/2 streams (RPCs) on one connection.
pub const HTTP2_STREAMS_PER_CONNECTION_MAX: u32 = 128;
/// HTTP/2 flow-control window of one stream: bytes a client may send ahead of the server.
pub const HTTP2_STREAM_WINDOW_BYTES: u32 = 8 * 1024 * 1024;
/// HTTP/2 flow-control window of one connection, shared by its streams.
pub const HTTP2_CONNECTION_WINDOW_BYTES: u32 = 16 * 1024 * 1024;
/// Most DoPut and DoGet streams moving data at once; further ones wait for a slot before they
/// read their first message.
pub const TRANSFERS_MAX: usize = 32;
/// Most DoExchange sessions open at once; one more is refused with `capacity_exhausted`.
pub const EXCHANGE_SESSIONS_MAX: usize = 256;
/// Most `wait` actions parked at once; one more is refused with `capacity_exhausted`. A parked
/// wait holds one HTTP/2 stream and its missing-key list (at most `WAIT_KEYS_MAX` keys).
pub const WAITS_PARKED_MAX: usize = 4096;
/// Most blocks one DoPut stream may carry.
pub const PUT_STREAM_BLOCKS_MAX: usize = 1 << 20;
/// Most jobs registered on the server (told their epoch with `set_epoch`, not ended here); a
/// `set_epoch` for one more is `capacity_exhausted`.
pub const EPOCH_TABLE_JOBS_MAX: usize = 65_536;
/// Most ended (deregistered) jobs the server remembers in order to say, when it refuses one's
/// write, that it ended (rather than that it is not registered), and to refuse a `set_epoch` of
/// it that arrives late; past it the oldest is forgotten. Forgetting an ended job lets none of its
/// tokens write again: only registered jobs write.
pub const ENDED_JOBS_MAX: usize = 4_096;
/// Least time an ended job is remembered; it is remembered longer while a token of it that the
/// server verified is still valid.
pub const ENDED_JOB_KEPT_MIN_MS: u64 = 10 * 60 * 1000;
/// A session stops coalescing replies into a frame past this size (one reply may exceed it).
pub const REPLY_FRAME_TARGET_BYTES: usize = 1024 * 1024;
/// Reply frames of one session queued for the transport.
pub const REPLY_FRAMES_QUEUED_MAX: usize = 1;
/// DoGet pieces of one stream queued for the transport.
pub const GET_PIECES_QUEUED_MAX: usize = 1;
/// Piece size of a direct GET from the NVMe tier: its ranges are read and sent in pieces of at
/// most this, so a block's first pieces go out while the kernel still reads the rest.
pub const NVME_DIRECT_PIECE_BYTES: u64 = 512 * 1024;
/// Reads of one direct GET from the NVMe tier in the kernel at once (its read-ahead, and the
/// staging memory it holds: `NVME_DIRECT_READS_AHEAD_MAX * NVME_DIRECT_PIECE_BYTES`, 1 MiB).
pub const NVME_DIRECT_READS_AHEAD_MAX: usize = 2;
/// How long in-flight RPCs get to finish after a shutdown signal before the process exits.
pub const SHUTDOWN_GRACE_MS: u64 = 2_000;
/// Poll interval of the drain-exit and parent-process watches.
pub const WATCH_INTERVAL_MS: u64 = 500;

/// Bytes one transfer can hold in the server process beyond the store: the request message being
/// decoded (DoPut) or the queued, encoding and sending pieces (DoGet).
pub const TRANSFER_BUFFER_BYTES: usize = MESSAGE_MAX_BYTES + 2 * BATCH_MAX_BYTES as usize;
/// Largest reply frame: the coalescing target plus one reply, at most a `stale_epoch` map.
pub const REPLY_FRAME_MAX_BYTES: usize = REPLY_FRAME_TARGET_BYTES + EPOCH_MAP_MAX_BYTES + 64 * 1024;
/// Bytes one busy exchange session can hold beyond the store: the request frame in hand, the
/// reply frames being built, queued and sent, and GET values read from the store.
pub const SESSION_BUFFER_BYTES: usize = FRAME_MAX_BYTES
    + 3 * REPLY_FRAME_MAX_BYTES
    + SESSION_INFLIGHT_MAX * SMALL_OBJECT_MAX_BYTES as usize;
/// Resident bytes of an idle server beyond its capacity: code, runtime and worker stacks,
/// allocator arenas, the index of an empty store.
pub const BASE_OVERHEAD_BYTES: usize = 48 * 1024 * 1024;
