//! PIN and UNPIN, the zero-copy reads of a server on the same host: their arguments (carried in
//! the op's header), the grant a PIN's reply carries, which says where the object's bytes lie
//! in the server's shared DRAM arena, and the name of the Unix socket that hands out the arena.

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::ProtocolError;
use crate::header::ObjectHeader;

/// Bytes of an encoded [`PinGrant`].
pub const PIN_GRANT_BYTES: usize = 56;
/// Bytes of the random nonce at the start of a shared arena.
pub const ARENA_NONCE_BYTES: usize = 16;

/// The arguments of a PIN or UNPIN op, carried in the op's header fields: `version` holds the
/// calling process's pid, `size` the pin id (UNPIN only; 0 for PIN).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinArgs {
    /// The process that holds (PIN) or held (UNPIN) the pin, as the server's pid namespace sees it.
    pub pid: u32,
    /// The pin to release (UNPIN).
    pub pin_id: u64,
}

impl PinArgs {
    /// The arguments as the header fields that carry them.
    pub fn to_header(self) -> ObjectHeader {
        ObjectHeader {
            version: u64::from(self.pid),
            size: self.pin_id,
            ..ObjectHeader::default()
        }
    }

    /// The arguments carried by `header`; a pid that does not fit 32 bits is refused.
    pub fn of_header(header: &ObjectHeader) -> Result<Self, ProtocolError> {
        let pid = u32::try_from(header.version).map_err(|_| ProtocolError::Length {
            what: "pin pid",
            len: header.version,
            min: 1,
            max: u64::from(u32::MAX),
        })?;
        Ok(PinArgs {
            pid,
            pin_id: header.size,
        })
    }
}

/// The abstract Unix socket name (without its leading NUL) on which the server of pid
/// `server_pid` whose arena starts with `nonce` hands its arena's descriptor to processes of its
/// own uid (`SCM_RIGHTS`; the server checks the peer's uid with `SO_PEERCRED`).
pub fn arena_socket_name(server_pid: u32, nonce: &[u8; ARENA_NONCE_BYTES]) -> String {
    let hex: String = nonce[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("pocketflow-arena-{server_pid}-{hex}")
}

/// Where a pinned object's bytes lie: `len` bytes at `offset` of the arena of `arena_len` bytes
/// of server `server_pid`, whose first bytes are `nonce` (its descriptor is had from the socket
/// [`arena_socket_name`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinGrant {
    /// Offset of the object's first byte from the start of the arena.
    pub offset: u64,
    /// The object's length.
    pub len: u64,
    /// The pin's id, for UNPIN.
    pub pin_id: u64,
    /// Length of the arena's mapping.
    pub arena_len: u64,
    /// The server's pid.
    pub server_pid: u32,
    /// The arena's first bytes: a mapping that does not start with them is another arena.
    pub nonce: [u8; ARENA_NONCE_BYTES],
}

impl PinGrant {
    /// The grant as a reply body.
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(PIN_GRANT_BYTES);
        out.put_u64_le(self.offset);
        out.put_u64_le(self.len);
        out.put_u64_le(self.pin_id);
        out.put_u64_le(self.arena_len);
        out.put_u32_le(self.server_pid);
        out.put_u32_le(0);
        out.put_slice(&self.nonce);
        out.freeze()
    }

    /// Decode a reply body; a body of another length, or a range outside the arena, is refused.
    pub fn decode(body: &[u8]) -> Result<Self, ProtocolError> {
        if body.len() != PIN_GRANT_BYTES {
            return Err(ProtocolError::Length {
                what: "pin grant",
                len: body.len() as u64,
                min: PIN_GRANT_BYTES as u64,
                max: PIN_GRANT_BYTES as u64,
            });
        }
        let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8 bytes"));
        let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().expect("4 bytes"));
        let grant = PinGrant {
            offset: u64_at(0),
            len: u64_at(8),
            pin_id: u64_at(16),
            arena_len: u64_at(24),
            server_pid: u32_at(32),
            nonce: body[40..56].try_into().expect("16 bytes"),
        };
        let end = grant.offset.checked_add(grant.len);
        if grant.offset < ARENA_NONCE_BYTES as u64 || end.is_none_or(|end| end > grant.arena_len) {
            return Err(ProtocolError::Length {
                what: "pinned range end",
                len: end.unwrap_or(u64::MAX),
                min: ARENA_NONCE_BYTES as u64,
                max: grant.arena_len,
            });
        }
        Ok(grant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_round_trips_and_a_range_outside_its_arena_is_refused() {
        let grant = PinGrant {
            offset: 4096,
            len: 1 << 20,
            pin_id: 7,
            arena_len: 8 << 20,
            server_pid: 1234,
            nonce: [5; ARENA_NONCE_BYTES],
        };
        let body = grant.encode();
        assert_eq!(body.len(), PIN_GRANT_BYTES);
        assert_eq!(PinGrant::decode(&body).unwrap(), grant);
        let outside = PinGrant {
            offset: (8 << 20) - 10,
            ..grant
        };
        assert!(PinGrant::decode(&outside.encode()).is_err());
        let over_nonce = PinGrant { offset: 0, ..grant };
        assert!(PinGrant::decode(&over_nonce.encode()).is_err());
        assert!(PinGrant::decode(&body[..40]).is_err());
    }

    #[test]
    fn pin_args_travel_in_the_header() {
        let args = PinArgs {
            pid: 4242,
            pin_id: 99,
        };
        assert_eq!(PinArgs::of_header(&args.to_header()).unwrap(), args);
        let too_big = ObjectHeader {
            version: u64::from(u32::MAX) + 1,
            ..ObjectHeader::default()
        };
        assert!(PinArgs::of_header(&too_big).is_err());
    }
}
