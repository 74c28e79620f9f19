//! The pocketflow wire protocol: limits, the object header, frame, ticket and descriptor codecs,
//! error kinds and capability tokens. No networking and no storage live here.

pub mod header;
pub mod limits;

pub use header::{ObjectHeader, HEADER_FLAG_PERSIST, HEADER_LEN_BYTES};
