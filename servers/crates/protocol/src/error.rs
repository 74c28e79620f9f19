//! Error kinds of the wire protocol with their gRPC codes, and the typed errors of this crate.

use crate::header::HeaderError;

/// A failure class as it appears on the wire: the prefix of every status message and, over
/// DoExchange, the per-op status byte (the kind's gRPC code).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// No such object, block or job record.
    NotFound,
    /// The bucket is not known to this server.
    BucketNotFound,
    /// The job is not registered on this server: the control plane has not told it the job's
    /// epoch, or ended the job here. Its writes are refused; its reads still work.
    JobNotRegistered,
    /// The object exists and OVERWRITE was not set.
    AlreadyExists,
    /// The bucket exists already.
    BucketExists,
    /// The tier has no room for the write.
    CapacityExhausted,
    /// The request is malformed or violates a limit.
    InvalidArgument,
    /// The server is draining and refuses writes.
    Draining,
    /// Missing, malformed, expired or wrong capability token, or a request outside the token's job.
    PermissionDenied,
    /// The request's weight-map epoch is older than the server's; the message is the new map.
    StaleEpoch,
    /// A PERSIST write reached a server that is not long-running.
    PersistRefused,
    /// A bug or an unexpected I/O failure in the server.
    Internal,
    /// A queue segment holds its `max_items` and stayed full for the op's whole wait.
    QueueFull,
    /// A queue or append-file segment is sealed (full, or its server ran out of room): the
    /// writer goes on in the next segment.
    Sealed,
    /// A renewal named new prefixes past the job's share of the server's lease table, or past
    /// the table's bound: those were refused, every lease the job held was renewed.
    LeaseTableFull,
    /// The server accepted the object's bytes (the put succeeded) and then lost them: a write
    /// behind the put failed in the device. The object cannot be read; its writer (or its
    /// lineage) must write it again.
    DataLost,
}

/// gRPC status code numbers used by [`ErrorKind::grpc_code`].
pub mod grpc_code {
    /// INVALID_ARGUMENT.
    pub const INVALID_ARGUMENT: u8 = 3;
    /// NOT_FOUND.
    pub const NOT_FOUND: u8 = 5;
    /// ALREADY_EXISTS.
    pub const ALREADY_EXISTS: u8 = 6;
    /// PERMISSION_DENIED.
    pub const PERMISSION_DENIED: u8 = 7;
    /// RESOURCE_EXHAUSTED.
    pub const RESOURCE_EXHAUSTED: u8 = 8;
    /// FAILED_PRECONDITION.
    pub const FAILED_PRECONDITION: u8 = 9;
    /// INTERNAL.
    pub const INTERNAL: u8 = 13;
    /// UNAVAILABLE.
    pub const UNAVAILABLE: u8 = 14;
    /// DATA_LOSS.
    pub const DATA_LOSS: u8 = 15;
}

impl ErrorKind {
    /// Every kind, in the order of the table in docs/PROTOCOL.md.
    pub const ALL: [ErrorKind; 16] = [
        ErrorKind::NotFound,
        ErrorKind::BucketNotFound,
        ErrorKind::JobNotRegistered,
        ErrorKind::AlreadyExists,
        ErrorKind::BucketExists,
        ErrorKind::CapacityExhausted,
        ErrorKind::InvalidArgument,
        ErrorKind::Draining,
        ErrorKind::PermissionDenied,
        ErrorKind::StaleEpoch,
        ErrorKind::PersistRefused,
        ErrorKind::Internal,
        ErrorKind::QueueFull,
        ErrorKind::Sealed,
        ErrorKind::LeaseTableFull,
        ErrorKind::DataLost,
    ];

    /// The kind's wire name, e.g. `"not_found"`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not_found",
            ErrorKind::BucketNotFound => "bucket_not_found",
            ErrorKind::JobNotRegistered => "job_not_registered",
            ErrorKind::AlreadyExists => "already_exists",
            ErrorKind::BucketExists => "bucket_exists",
            ErrorKind::CapacityExhausted => "capacity_exhausted",
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::Draining => "draining",
            ErrorKind::PermissionDenied => "permission_denied",
            ErrorKind::StaleEpoch => "stale_epoch",
            ErrorKind::PersistRefused => "persist_refused",
            ErrorKind::Internal => "internal",
            ErrorKind::QueueFull => "queue_full",
            ErrorKind::Sealed => "sealed",
            ErrorKind::LeaseTableFull => "lease_table_full",
            ErrorKind::DataLost => "data_lost",
        }
    }

    /// The kind named `name`, if any.
    pub fn from_name(name: &str) -> Option<ErrorKind> {
        ErrorKind::ALL
            .into_iter()
            .find(|kind| kind.as_str() == name)
    }

    /// The gRPC status code of the kind, which is also its DoExchange status byte.
    pub fn grpc_code(self) -> u8 {
        match self {
            ErrorKind::NotFound | ErrorKind::BucketNotFound | ErrorKind::JobNotRegistered => {
                grpc_code::NOT_FOUND
            }
            ErrorKind::AlreadyExists | ErrorKind::BucketExists => grpc_code::ALREADY_EXISTS,
            ErrorKind::CapacityExhausted | ErrorKind::QueueFull | ErrorKind::LeaseTableFull => {
                grpc_code::RESOURCE_EXHAUSTED
            }
            ErrorKind::InvalidArgument => grpc_code::INVALID_ARGUMENT,
            ErrorKind::Draining => grpc_code::UNAVAILABLE,
            ErrorKind::PermissionDenied => grpc_code::PERMISSION_DENIED,
            ErrorKind::StaleEpoch | ErrorKind::PersistRefused | ErrorKind::Sealed => {
                grpc_code::FAILED_PRECONDITION
            }
            ErrorKind::Internal => grpc_code::INTERNAL,
            ErrorKind::DataLost => grpc_code::DATA_LOSS,
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a frame, descriptor, ticket, action body or token was refused while decoding it.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The buffer ends before the structure it should hold.
    #[error("{what} truncated: needs {needed} bytes, got {got}")]
    Truncated {
        /// What was being decoded.
        what: &'static str,
        /// Bytes needed.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// Bytes remain after the last op of a frame.
    #[error("frame has {0} trailing bytes after its last op")]
    TrailingBytes(usize),
    /// The frame is larger than `FRAME_MAX_BYTES`.
    #[error("frame of {0} bytes exceeds FRAME_MAX_BYTES")]
    FrameTooLarge(usize),
    /// The frame version byte is not `FRAME_VERSION`.
    #[error("unsupported frame version {0}")]
    FrameVersion(u8),
    /// A field that must be zero is not.
    #[error("reserved field of {0} is not zero")]
    ReservedNonZero(&'static str),
    /// The op count is 0 or above `FRAME_OPS_MAX`.
    #[error("frame op count {0} is outside 1..=FRAME_OPS_MAX")]
    OpCount(u32),
    /// The op code is unknown.
    #[error("unknown op code {0}")]
    OpCode(u8),
    /// The flags byte has bits that the op does not accept.
    #[error("flags {flags:#04x} are not valid for op {op}")]
    OpFlags {
        /// Op name.
        op: &'static str,
        /// Flags byte as sent.
        flags: u8,
    },
    /// A name or value is longer or shorter than its bound allows.
    #[error("{what} length {len} is outside {min}..={max}")]
    Length {
        /// Which field.
        what: &'static str,
        /// Length as sent.
        len: u64,
        /// Smallest length accepted.
        min: u64,
        /// Largest length accepted.
        max: u64,
    },
    /// A name is not UTF-8 or holds control characters.
    #[error("{0} is not valid UTF-8 text")]
    NotText(&'static str),
    /// The object header is inconsistent.
    #[error("bad object header: {0}")]
    Header(#[from] HeaderError),
    /// A PUT's value length does not match its header.
    #[error(
        "value length {value_len} does not match object header (size {size}, {block_count} blocks)"
    )]
    ValueLength {
        /// Value bytes sent.
        value_len: u64,
        /// Header size.
        size: u64,
        /// Header block count.
        block_count: u32,
    },
    /// The PERSIST op flag and the header's PERSIST flag disagree.
    #[error("PERSIST op flag and object header PERSIST flag disagree")]
    PersistMismatch,
    /// A JSON body could not be parsed into the expected structure.
    #[error("bad {what} JSON: {}", json_complaint(.source))]
    Json {
        /// What was being parsed.
        what: &'static str,
        /// The parser's complaint.
        source: serde_json::Error,
    },
    /// A field of a JSON request is out of range.
    #[error("{what}: {why}")]
    Field {
        /// Which field.
        what: &'static str,
        /// Which rule it breaks.
        why: &'static str,
    },
    /// The action type is not one this server knows.
    #[error("unknown action {0:?}")]
    UnknownAction(String),
    /// The FlightDescriptor is missing or not of type CMD.
    #[error("a CMD FlightDescriptor is required")]
    DescriptorMissing,
    /// The capability token is missing, malformed, wrong or expired.
    #[error("{0}")]
    Token(#[from] TokenError),
    /// A direct-exchange message is malformed or out of order.
    #[error("direct exchange: {0}")]
    DirectMessage(String),
}

/// Most bytes of a JSON parser's complaint kept in an error message. serde quotes an offending
/// value in full (`invalid type: string "..."`), and the message becomes a status that must not
/// echo megabytes of a request back.
const JSON_COMPLAINT_MAX_BYTES: usize = 256;

/// The parser's complaint, cut to `JSON_COMPLAINT_MAX_BYTES` at a character boundary; a cut one
/// still ends with where in the body the parser stopped.
fn json_complaint(source: &serde_json::Error) -> String {
    let text = source.to_string();
    if text.len() <= JSON_COMPLAINT_MAX_BYTES {
        return text;
    }
    let mut end = JSON_COMPLAINT_MAX_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}... at line {} column {}",
        &text[..end],
        source.line(),
        source.column()
    )
}

/// Why a capability token was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    /// The token is empty.
    #[error("capability token missing")]
    Missing,
    /// The token is not `<expiry_unix_ms>.<64 hex digits>`.
    #[error("capability token malformed")]
    Malformed,
    /// The MAC does not match the job and expiry.
    #[error("capability token does not match job {0:?}")]
    Mismatch(String),
    /// The token's expiry has passed.
    #[error("capability token expired at {expiry_unix_ms} (now {now_unix_ms})")]
    Expired {
        /// Expiry named in the token.
        expiry_unix_ms: u64,
        /// Server clock at verification.
        now_unix_ms: u64,
    },
    /// The cluster secret is shorter than `SECRET_MIN_BYTES`.
    #[error("cluster secret has {0} bytes, at least 16 are required")]
    SecretTooShort(usize),
}

impl ProtocolError {
    /// The wire kind of the error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ProtocolError::Token(_) => ErrorKind::PermissionDenied,
            _ => ErrorKind::InvalidArgument,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_and_codes() {
        for kind in ErrorKind::ALL {
            assert_eq!(ErrorKind::from_name(kind.as_str()), Some(kind));
        }
        assert_eq!(ErrorKind::from_name("nope"), None);
        assert_eq!(ErrorKind::NotFound.grpc_code(), 5);
        assert_eq!(ErrorKind::BucketExists.grpc_code(), 6);
        assert_eq!(ErrorKind::CapacityExhausted.grpc_code(), 8);
        assert_eq!(ErrorKind::Draining.grpc_code(), 14);
        assert_eq!(ErrorKind::PermissionDenied.grpc_code(), 7);
        assert_eq!(ErrorKind::PersistRefused.grpc_code(), 9);
        assert_eq!(ErrorKind::Internal.grpc_code(), 13);
        assert_eq!(ErrorKind::InvalidArgument.grpc_code(), 3);
        assert_eq!(ErrorKind::DataLost.grpc_code(), 15);
        assert_eq!(ErrorKind::DataLost.as_str(), "data_lost");
    }

    #[test]
    fn json_complaints_are_bounded() {
        let body = format!(r#"{{"n":"{}"}}"#, "é".repeat(10_000));
        let source = serde_json::from_str::<std::collections::HashMap<String, u64>>(&body)
            .expect_err("a string is no u64");
        let error = ProtocolError::Json {
            what: "body",
            source,
        };
        let text = error.to_string();
        assert!(text.len() < 2 * JSON_COMPLAINT_MAX_BYTES, "{text}");
        assert!(text.starts_with("bad body JSON: invalid type: string"));
        assert!(text.ends_with("at line 1 column 20007"), "{text}");
    }

    #[test]
    fn protocol_error_kinds() {
        assert_eq!(ProtocolError::OpCode(9).kind(), ErrorKind::InvalidArgument);
        assert_eq!(
            ProtocolError::Token(TokenError::Missing).kind(),
            ErrorKind::PermissionDenied
        );
    }
}
