//! The direct exchange: the DoExchange session's frames over a plain TCP connection to the same
//! port as Flight, for small operations without HTTP/2 (docs/PROTOCOL.md, "Direct exchange").
//!
//! A connection opens with [`DIRECT_MAGIC`] (which no HTTP/2 client sends: its preface starts
//! `PRI `), then carries messages `[kind u8][length u32 LE][payload]` both ways. The client's
//! first message is [`Kind::Open`] with the exchange descriptor; the server answers
//! [`Kind::Ready`] or [`Kind::Status`]. After that the client sends [`Kind::Frame`]s holding
//! request frames and the server answers with [`Kind::Frame`]s holding reply frames, exactly as
//! over DoExchange. A [`Kind::Status`] (`[gRPC code u8][message]`) is the server's last message:
//! the session failed as a DoExchange stream would end with that status.

use bytes::{BufMut, Bytes, BytesMut};

use crate::limits::FRAME_MAX_BYTES;
use crate::ProtocolError;

/// The first bytes of a direct-exchange connection.
pub const DIRECT_MAGIC: &[u8; 8] = b"PFXCHG01";

/// The ALPN protocol a direct-exchange client offers over TLS; an HTTP/2 (Flight) client offers
/// `h2`. A TLS listener tells the two apart by the protocol the handshake agreed on.
pub const DIRECT_ALPN: &[u8] = b"pocketflow-direct";

/// The ALPN protocol of HTTP/2 (Arrow Flight) over TLS.
pub const H2_ALPN: &[u8] = b"h2";

/// Bytes before each message's payload: kind and length.
pub const MESSAGE_HEAD_BYTES: usize = 5;

/// Largest payload of any direct message: a request or reply frame, or a status.
pub const PAYLOAD_MAX_BYTES: usize = FRAME_MAX_BYTES;

/// Largest payload of a request that opens a session or a transfer ([`Kind::Open`],
/// [`Kind::Get`], [`Kind::Put`], [`Kind::Read`]): a descriptor or ticket (a GET ticket of
/// `TICKET_RANGES_MAX` ranges takes about 230 KiB). A server refuses a longer one from its head,
/// before reading (or holding room for) its payload.
pub const REQUEST_MAX_BYTES: usize = 1024 * 1024;

/// What a direct message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Client to server, first: the exchange descriptor (as DoExchange's descriptor command).
    Open,
    /// Server to client: the session is open.
    Ready,
    /// A request frame (client to server) or a reply frame (server to client).
    Frame,
    /// Server to client, last: `[gRPC code u8][UTF-8 message]`.
    Status,
    /// Client to server, first or after an END: a DoGet ticket to send the data of.
    Get,
    /// Server to client: `[block index u32 LE][offset u64 LE]` and a piece of a ticket's range.
    Data,
    /// Server to client: every piece of the ticket was sent. Client to server: every piece of
    /// the upload was sent.
    End,
    /// Client to server, first or after a finished transfer: a DoPut descriptor.
    Put,
    /// Client to server: `[block index u32 LE][block length u64 LE]` then a piece of the block.
    Piece,
    /// Server to client: the upload's result JSON (DoPut's `{"blocks", "bytes"}`).
    Stored,
    /// Client to server, first or after a finished transfer: a [`crate::ticket::ReadTicket`]
    /// naming an object to read whole. The server answers with a [`Kind::Frame`] holding one
    /// reply (a GET op's, its body empty when OK), then the object's bytes as [`Kind::Data`]
    /// messages (block index 0 for a small object's value, 1 for the data block of an object
    /// of one data block kept with its manifest), then [`Kind::End`].
    Read,
}

/// Bytes of a PIECE message's payload before the piece: block index and block length.
pub const PIECE_META_BYTES: usize = 12;

/// Bytes of a DATA message's payload before the piece: block index and offset in the block.
pub const DATA_META_BYTES: usize = 12;

impl Kind {
    /// Every kind, in code order.
    pub const ALL: [Kind; 11] = [
        Kind::Open,
        Kind::Ready,
        Kind::Frame,
        Kind::Status,
        Kind::Get,
        Kind::Data,
        Kind::End,
        Kind::Put,
        Kind::Piece,
        Kind::Stored,
        Kind::Read,
    ];

    /// The wire byte.
    pub fn code(self) -> u8 {
        match self {
            Kind::Open => 1,
            Kind::Ready => 2,
            Kind::Frame => 3,
            Kind::Status => 4,
            Kind::Get => 5,
            Kind::Data => 6,
            Kind::End => 7,
            Kind::Put => 8,
            Kind::Piece => 9,
            Kind::Stored => 10,
            Kind::Read => 11,
        }
    }

    /// The kind of a wire byte.
    pub fn from_code(code: u8) -> Result<Self, ProtocolError> {
        match code {
            1 => Ok(Kind::Open),
            2 => Ok(Kind::Ready),
            3 => Ok(Kind::Frame),
            4 => Ok(Kind::Status),
            5 => Ok(Kind::Get),
            6 => Ok(Kind::Data),
            7 => Ok(Kind::End),
            8 => Ok(Kind::Put),
            9 => Ok(Kind::Piece),
            10 => Ok(Kind::Stored),
            11 => Ok(Kind::Read),
            other => Err(ProtocolError::DirectMessage(format!(
                "unknown message kind {other}"
            ))),
        }
    }
}

/// Decode a message head: its kind and payload length (checked against the bound).
pub fn decode_head(head: &[u8; MESSAGE_HEAD_BYTES]) -> Result<(Kind, usize), ProtocolError> {
    let kind = Kind::from_code(head[0])?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > PAYLOAD_MAX_BYTES {
        return Err(ProtocolError::DirectMessage(format!(
            "message of {len} bytes over the bound of {PAYLOAD_MAX_BYTES}"
        )));
    }
    Ok((kind, len))
}

/// The head of a message of `kind` with `len` payload bytes.
pub fn encode_head(kind: Kind, len: usize) -> [u8; MESSAGE_HEAD_BYTES] {
    debug_assert!(len <= PAYLOAD_MAX_BYTES);
    let n = (len as u32).to_le_bytes();
    [kind.code(), n[0], n[1], n[2], n[3]]
}

/// A whole message (head and payload) in one buffer.
pub fn encode_message(kind: Kind, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(MESSAGE_HEAD_BYTES + payload.len());
    out.put_slice(&encode_head(kind, payload.len()));
    out.put_slice(payload);
    out.freeze()
}

/// The payload of a [`Kind::Status`] message.
pub fn encode_status(code: u8, message: &str) -> Bytes {
    let mut out = BytesMut::with_capacity(1 + message.len());
    out.put_u8(code);
    // A status message is short; cut a long one at a character boundary under the bound.
    let mut end = message.len().min(PAYLOAD_MAX_BYTES - 1);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    out.put_slice(&message.as_bytes()[..end]);
    out.freeze()
}

/// The gRPC code and message of a [`Kind::Status`] payload.
pub fn decode_status(payload: &[u8]) -> Result<(u8, String), ProtocolError> {
    let (&code, message) = payload
        .split_first()
        .ok_or_else(|| ProtocolError::DirectMessage("empty status message".into()))?;
    Ok((code, String::from_utf8_lossy(message).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_round_trip_and_bound_the_length() {
        for kind in Kind::ALL {
            let head = encode_head(kind, 1234);
            assert_eq!(decode_head(&head).unwrap(), (kind, 1234));
        }
        let mut over = encode_head(Kind::Frame, 0);
        over[1..].copy_from_slice(&((PAYLOAD_MAX_BYTES + 1) as u32).to_le_bytes());
        assert!(decode_head(&over).is_err());
        assert!(decode_head(&[0, 0, 0, 0, 0]).is_err());
        assert!(decode_head(&[42, 0, 0, 0, 0]).is_err());
    }

    #[test]
    fn statuses_round_trip() {
        let payload = encode_status(7, "permission_denied: bad token");
        assert_eq!(
            decode_status(&payload).unwrap(),
            (7, "permission_denied: bad token".to_string())
        );
        assert!(decode_status(&[]).is_err());
        let message = encode_message(Kind::Status, &payload);
        assert_eq!(message.len(), MESSAGE_HEAD_BYTES + payload.len());
    }
}
