//! The JSON DoGet ticket that names ranges of an object's data blocks, and the direct READ's
//! ticket that names a whole object.

use serde::{Deserialize, Serialize};

use crate::context::{check_bucket, check_key, parse_json, Context};
use crate::error::ProtocolError;
use crate::limits::{BLOCK_SIZE_MAX_BYTES, TICKET_RANGES_MAX};

/// One range `[block index >= 1, offset in block, length]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRange(pub u32, pub u64, pub u64);

impl BlockRange {
    /// Block index (1-based).
    pub fn index(&self) -> u32 {
        self.0
    }

    /// First byte of the range within the block.
    pub fn offset(&self) -> u64 {
        self.1
    }

    /// Bytes in the range.
    pub fn len(&self) -> u64 {
        self.2
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.2 == 0
    }
}

/// A DoGet ticket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetTicket {
    /// Whose data this is.
    pub ctx: Context,
    /// Bucket of the object.
    pub bucket: String,
    /// Key of the object.
    pub key: String,
    /// Version of the put whose blocks are read.
    pub version: u64,
    /// Ranges to send, in order.
    pub ranges: Vec<BlockRange>,
    /// Remove each named block once its ranges have been sent.
    #[serde(default)]
    pub delete: bool,
}

impl GetTicket {
    /// Parse and validate a ticket.
    pub fn parse(ticket: &[u8]) -> Result<Self, ProtocolError> {
        let ticket: Self = parse_json("ticket", ticket)?;
        ticket.ctx.validate()?;
        check_bucket(&ticket.bucket)?;
        check_key(&ticket.key)?;
        if ticket.version == 0 {
            return Err(ProtocolError::Field {
                what: "version",
                why: "must be non-zero",
            });
        }
        if ticket.ranges.is_empty() || ticket.ranges.len() > TICKET_RANGES_MAX {
            return Err(ProtocolError::Length {
                what: "ranges",
                len: ticket.ranges.len() as u64,
                min: 1,
                max: TICKET_RANGES_MAX as u64,
            });
        }
        for range in &ticket.ranges {
            if range.index() == 0 {
                return Err(ProtocolError::Field {
                    what: "ranges",
                    why: "block index must be >= 1",
                });
            }
            let end = range.offset().checked_add(range.len());
            if end.is_none_or(|end| end > u64::from(BLOCK_SIZE_MAX_BYTES)) {
                return Err(ProtocolError::Field {
                    what: "ranges",
                    why: "range ends past BLOCK_SIZE_MAX_BYTES",
                });
            }
        }
        Ok(ticket)
    }
}

/// A direct READ's ticket (`Kind::Read`): read the object `bucket/key` whole, in one exchange
/// with its block-0 home.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadTicket {
    /// Whose data this is.
    pub ctx: Context,
    /// Bucket of the object.
    pub bucket: String,
    /// Key of the object.
    pub key: String,
    /// DELETE on read: claim the record (and free the data block sent with it).
    #[serde(default)]
    pub delete: bool,
    /// With `delete`: claim only a record whose bytes come with this reply (a small object's,
    /// or one of one data block sent along); a striped object's manifest stays for its reader
    /// to remove after reading the blocks (a `delete` conditional on the version).
    #[serde(default)]
    pub claim_whole: bool,
    /// The most bytes the reader takes with the record: the data block of an object of one
    /// data block is sent along only when the object's size is at most this (0: never).
    #[serde(default)]
    pub inline_bytes_max: u64,
}

impl ReadTicket {
    /// Parse and validate a READ ticket.
    pub fn parse(ticket: &[u8]) -> Result<Self, ProtocolError> {
        let ticket: Self = parse_json("read ticket", ticket)?;
        ticket.ctx.validate()?;
        check_bucket(&ticket.bucket)?;
        check_key(&ticket.key)?;
        Ok(ticket)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticket(ranges: &str) -> String {
        format!(
            r#"{{"ctx":{{"job":"j","epoch":1,"token":"t"}},"bucket":"b","key":"k","version":3,"ranges":{ranges}}}"#
        )
    }

    #[test]
    fn read_tickets() {
        let t = ReadTicket::parse(
            br#"{"ctx":{"job":"j","epoch":1,"token":"t"},"bucket":"b","key":"k"}"#,
        )
        .unwrap();
        assert!(!t.delete);
        assert_eq!(t.inline_bytes_max, 0);
        let t = ReadTicket::parse(
            br#"{"ctx":{"job":"j","epoch":1,"token":"t"},"bucket":"b","key":"k","delete":true,"inline_bytes_max":1048576}"#,
        )
        .unwrap();
        assert!(t.delete);
        assert_eq!(t.inline_bytes_max, 1 << 20);
        for bad in [
            r#"{"ctx":{"job":"j","epoch":1,"token":"t"},"bucket":"","key":"k"}"#,
            r#"{"ctx":{"job":"j","epoch":1,"token":"t"},"bucket":"b","key":""}"#,
            r#"{"ctx":{"job":"j","epoch":1,"token":"t"},"bucket":"b"}"#,
            r#"{"bucket":"b","key":"k"}"#,
        ] {
            assert!(ReadTicket::parse(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn valid_ticket() {
        let t = GetTicket::parse(ticket("[[1,0,1048576],[2,4096,512]]").as_bytes()).unwrap();
        assert_eq!(
            t.ranges,
            vec![BlockRange(1, 0, 1 << 20), BlockRange(2, 4096, 512)]
        );
        assert!(!t.delete);
    }

    #[test]
    fn invalid_tickets() {
        for ranges in [
            "[]",
            "[[0,0,1]]",
            "[[1,16777216,1]]",
            "[[1,0]]",
            "[[1,0,1,4]]",
            "[[-1,0,1]]",
            "[[4294967296,0,1]]",
        ] {
            assert!(
                GetTicket::parse(ticket(ranges).as_bytes()).is_err(),
                "{ranges}"
            );
        }
        let many = format!("[{}]", vec!["[1,0,1]"; TICKET_RANGES_MAX + 1].join(","));
        assert!(matches!(
            GetTicket::parse(ticket(&many).as_bytes()),
            Err(ProtocolError::Length { .. })
        ));
        let zero_version = ticket("[[1,0,1]]").replace(r#""version":3"#, r#""version":0"#);
        assert!(GetTicket::parse(zero_version.as_bytes()).is_err());
        assert!(GetTicket::parse(b"garbage").is_err());
    }
}
