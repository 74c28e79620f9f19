//! The pocketflow wire protocol: limits, the object header, frame, ticket and descriptor codecs,
//! error kinds and capability tokens. No networking and no storage live here.

#![warn(missing_docs)]

pub mod action;
pub mod batch;
pub mod context;
pub mod descriptor;
pub mod direct;
pub mod error;
pub mod frame;
pub mod header;
pub mod ipc;
pub mod limits;
pub mod opening;
pub mod pin;
pub mod ticket;
pub mod tls;
pub mod token;
pub mod units;

pub use context::Context;
pub use error::{ErrorKind, ProtocolError, TokenError};
pub use header::{
    HeaderError, ObjectHeader, HEADER_FLAGS_KNOWN, HEADER_FLAG_FENCE, HEADER_FLAG_OVERFLOW,
    HEADER_FLAG_PERSIST, HEADER_LEN_BYTES,
};
