//! The bounds a [`crate::Connection`] keeps to.

use std::time::Duration;

/// Sessions, timeouts and window sizes of one connection.
#[derive(Debug, Clone)]
pub struct ConnectionConfig {
    /// Most DoExchange sessions open to the server at once (one per concurrently calling thread).
    pub sessions_max: usize,
    /// Bound on every wait for the server's progress: a reply, the next DoGet piece.
    pub op_timeout: Duration,
    /// Bound on the first reply of a new session (connection, token check), and on connecting.
    pub first_reply_timeout: Duration,
    /// Bound on an action, and on waiting for a free session of the pool.
    pub rpc_timeout: Duration,
    /// Bound on a whole DoPut or DoGet stream.
    pub stream_timeout: Duration,
    /// Whether small operations use direct-exchange sessions (plain TCP, the calling thread's
    /// blocking I/O) instead of DoExchange sessions over HTTP/2.
    pub direct: bool,
    /// Trust for TLS connections (the cluster CA); `None` connects in plaintext.
    pub tls: Option<crate::tls::ClientTls>,
}

/// Slowest transfer rate a data stream's deadline allows for.
pub const STREAM_BYTES_PER_S_MIN: u64 = 8 * 1024 * 1024;
/// HTTP/2 receive window of one stream: a DoGet of a few blocks flows without a window update.
pub const STREAM_WINDOW_BYTES: u32 = 8 * 1024 * 1024;
/// HTTP/2 receive window of the connection.
pub const CONNECTION_WINDOW_BYTES: u32 = 32 * 1024 * 1024;
/// Largest HTTP/2 frame the client accepts: a 1 MiB block arrives in a few frames, not 64 of
/// the 16 KiB default, while a small reply behind a frame in flight waits at most ~0.1 ms.
pub const FRAME_MAX_BYTES_RECEIVED: u32 = 1024 * 1024;
/// Shortest connection attempt allowed, whatever the first-reply bound.
pub const CONNECT_TIMEOUT_MIN: Duration = Duration::from_secs(1);
/// How often one call goes back to its pool after the server refused a new session.
pub const SESSION_REFUSALS_MAX: u32 = 8;
/// DoPut pieces encoded ahead of the HTTP/2 stream (each at most `BATCH_MAX_BYTES`).
pub const PUT_PIECES_QUEUED_MAX: usize = 2;

impl Default for ConnectionConfig {
    fn default() -> Self {
        ConnectionConfig {
            sessions_max: 8,
            op_timeout: Duration::from_secs(30),
            first_reply_timeout: Duration::from_secs(5),
            rpc_timeout: Duration::from_secs(30),
            stream_timeout: Duration::from_secs(300),
            direct: true,
            tls: None,
        }
    }
}

impl ConnectionConfig {
    /// The longer of the op and RPC bounds: waits that are not the server's progress (a free
    /// session of this client's pool) get it, so a busy client is not cut off.
    pub fn patience(&self) -> Duration {
        self.op_timeout.max(self.rpc_timeout)
    }

    /// The first reply of a new session waits at most this long.
    pub fn first_reply(&self) -> Duration {
        self.first_reply_timeout
            .min(self.op_timeout)
            .max(Duration::from_millis(1))
    }

    /// Deadline of a stream moving `nbytes`: patience plus the time at the slowest rate, capped.
    pub fn stream_deadline(&self, nbytes: u64) -> Duration {
        let transfer = Duration::from_secs_f64(nbytes as f64 / STREAM_BYTES_PER_S_MIN as f64);
        (self.patience() + transfer).min(self.stream_timeout)
    }
}
