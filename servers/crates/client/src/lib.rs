//! The pocketflow client core: everything a client process does on the wire to its storage
//! servers, in Rust, with no Python in it. One [`Connection`] per server holds one HTTP/2
//! connection (a tonic channel), a bounded pool of pipelined DoExchange sessions for small
//! operations, and runs DoPut and DoGet streams of data blocks and DoActions. Every wait is bounded
//! by a timeout from [`ConnectionConfig`], so a dead or hung server surfaces as
//! [`ClientError::Unavailable`], never as a hang.
//!
//! All I/O runs on one tokio runtime per process ([`runtime`]), made lazily and made again in a
//! forked child, which never touches its parent's runtime threads or connections.

#![warn(missing_docs)]

mod block_reads;
mod blocks;
pub mod channels;
mod config;
mod connection;
mod direct;
mod error;
pub mod failure;
mod homes;
pub mod listing;
pub mod objects;
mod overflow;
mod parallel;
pub mod placement;
mod pool;
pub mod reads;
pub mod records;
mod runtime;
mod session;
pub mod shared;
pub mod tls;
pub mod upload;
pub mod view;
pub mod waits;
pub mod write_once;
pub mod writes;

pub use blocks::{split_dest, BlockSlice, ObjectRead, RangeTarget, ReadOutcome};
pub use config::ConnectionConfig;
pub use connection::{Connection, ExchangeReply, ExchangeRequest};
pub use error::ClientError;
pub use failure::Failure;
pub use homes::{Layout, Skipped};
pub use listing::Listing;
pub use objects::{Objects, Tuning};
pub use reads::Destination;
pub use records::Record;
pub use runtime::{block_on, runtime_handle};
pub use tls::ClientTls;
pub use upload::StreamUpload;
pub use writes::{NewRecord, PutItem};
