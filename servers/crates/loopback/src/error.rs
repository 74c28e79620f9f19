//! The one error type of the loopback tool.

use std::io;

/// What can go wrong in the loopback server or client.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The command line names no subcommand, or one that does not exist.
    #[error("usage: pocketflow-loopback serve --object-max-bytes N [--parent-pid PID] [--lifetime-s S] | client --connect HOST:PORT --object-max-bytes N")]
    Usage,
    /// A flag the subcommand needs is missing.
    #[error("missing flag {0}")]
    MissingFlag(&'static str),
    /// A flag this subcommand does not take.
    #[error("unknown flag {0:?}")]
    UnknownFlag(String),
    /// A flag's value does not parse or is out of range.
    #[error("bad value {value:?} for {flag}")]
    BadValue {
        /// The flag or command field.
        flag: &'static str,
        /// What was given.
        value: String,
    },
    /// A request header names an operation that does not exist.
    #[error("unknown operation {0} in a request header")]
    UnknownOp(u8),
    /// A GET asks for more bytes than the server's source buffer holds, or a phase would
    /// move more than the client's bound.
    #[error("{requested_bytes} bytes requested, at most {max_bytes} allowed")]
    TooLarge {
        /// Bytes asked for.
        requested_bytes: u64,
        /// The bound.
        max_bytes: u64,
    },
    /// A line on the client's standard input is not a command.
    #[error("bad command {0:?}")]
    BadCommand(String),
    /// The server acknowledged a PUT with something other than the acknowledgement byte.
    #[error("bad acknowledgement byte {0}")]
    BadAck(u8),
    /// The other side closed the connection in the middle of a message.
    #[error("connection closed in the middle of a message")]
    Closed,
    /// A socket, pipe or clock call failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}
