//! Every bound of the wire protocol, defined once; `pocketflow/protocol.py` mirrors these values.

/// Largest object stored as a single block-0 record and moved over the DoExchange session.
pub const SMALL_OBJECT_MAX_BYTES: u64 = 64 * 1024;
/// Default size of one data block of a large object.
pub const BLOCK_SIZE_DEFAULT_BYTES: u32 = 1024 * 1024;
/// Largest data block a client may declare.
pub const BLOCK_SIZE_MAX_BYTES: u32 = 16 * 1024 * 1024;
/// Largest piece of a block carried by one DoPut or DoGet record batch.
pub const BATCH_MAX_BYTES: u64 = 4 * 1024 * 1024;
/// gRPC message size limit, both directions, on both ends.
pub const MESSAGE_MAX_BYTES: usize = 16 * 1024 * 1024;
/// Largest DoExchange frame (request or reply) in bytes.
pub const FRAME_MAX_BYTES: usize = 8 * 1024 * 1024;
/// Most operations in one DoExchange request frame.
pub const FRAME_OPS_MAX: u32 = 1024;
/// Most operations of one DoExchange session the server runs at once.
pub const SESSION_INFLIGHT_MAX: usize = 256;
/// Largest value of an overflowed manifest (header flag `HEADER_FLAG_OVERFLOW`): the JSON list
/// of the servers its data blocks skipped because they were full.
pub const OVERFLOW_VALUE_MAX_BYTES: u64 = 4096;
/// Longest key in bytes.
pub const KEY_MAX_BYTES: usize = 1024;
/// Longest bucket name in bytes.
pub const BUCKET_NAME_MAX_BYTES: usize = 255;
/// Longest job id in bytes.
pub const JOB_ID_MAX_BYTES: usize = 128;
/// Most ranges in one DoGet ticket.
pub const TICKET_RANGES_MAX: usize = 4096;
/// Most keys returned by one enumerate call.
pub const ENUMERATE_LIMIT_MAX: u32 = 10_000;
/// Interval of the statistics sampler.
pub const STATS_INTERVAL_MS: u64 = 1000;
/// Version byte that opens every DoExchange frame.
pub const FRAME_VERSION: u8 = 1;
/// Reserved job id of control-plane (admin) tokens.
pub const ADMIN_JOB_ID: &str = "__admin__";
/// Line the server prints on stdout once it listens, followed by `host:port`.
pub const READY_LINE_PREFIX: &str = "POCKETFLOW_SERVER_READY";
/// Largest weight map (as compact JSON) accepted by `set_epoch` and returned in `stale_epoch`.
pub const EPOCH_MAP_MAX_BYTES: usize = 1024 * 1024;
/// Most keys one `wait` action names.
pub const WAIT_KEYS_MAX: usize = 1024;
/// Longest a `wait` action is parked before it returns the keys still missing.
pub const WAIT_TIMEOUT_MAX_MS: u64 = 30_000;
/// Longest a queue or append op parks on the server (dequeue of an empty queue, enqueue into a
/// full one); a client waits longer by repeating the op.
pub const CHANNEL_WAIT_MAX_MS: u64 = 10_000;
/// Most items one queue segment holds (its `max_items` is at most this).
pub const QUEUE_ITEMS_MAX: u32 = 1 << 20;
/// Largest append-file segment, in bytes (a client's segment size is at most this).
pub const APPEND_SEGMENT_MAX_BYTES: u64 = 64 * 1024 * 1024;
/// Most bytes one append-file read returns.
pub const APPEND_READ_MAX_BYTES: u32 = 1024 * 1024;
/// Most events one subscription keeps before it loses its oldest.
pub const SUBSCRIBER_EVENTS_MAX: usize = 65_536;
/// Most events one `events` call returns.
pub const EVENTS_BATCH_MAX: usize = 1024;
/// Shortest prefix lease.
pub const LEASE_MS_MIN: u64 = 100;
/// Longest prefix lease.
pub const LEASE_MS_MAX: u64 = 600_000;
/// Most prefixes one `renew_leases` call names.
pub const LEASE_PREFIXES_MAX: usize = 4096;
/// Most pins one process holds on one server (PIN beyond it is refused; the reader copies).
pub const PINS_PER_PROCESS_MAX: u32 = 4096;
/// A server pins at most its DRAM arena's capacity divided by this, over all jobs.
pub const PINNED_ARENA_DIVISOR: u64 = 2;
/// One job pins at most its server's pin budget (above) divided by this.
pub const PINNED_JOB_DIVISOR: u64 = 2;
/// Interval of the server's sweep of pins held by processes that are gone: a dead reader's pins
/// are released within two intervals.
pub const PIN_SWEEP_INTERVAL_MS: u64 = 50;
