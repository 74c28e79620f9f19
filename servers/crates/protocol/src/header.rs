//! The fixed 32-byte object header stored with block 0 and carried in DoExchange ops and replies.

use crate::limits::{BLOCK_SIZE_MAX_BYTES, OVERFLOW_VALUE_MAX_BYTES, SMALL_OBJECT_MAX_BYTES};

/// Encoded size of [`ObjectHeader`].
pub const HEADER_LEN_BYTES: usize = 32;
/// Header flag: the object is PERSIST and lives on long-running servers only.
pub const HEADER_FLAG_PERSIST: u32 = 1;
/// Header flag: the record is a write-once fence, not an object: a record of no bytes that a
/// PERSIST put places on the key's ephemeral home, so that one server decides between writers of
/// both placements. Listings and notifications leave fences out; clients read through them.
pub const HEADER_FLAG_FENCE: u32 = 2;
/// Header flag of a manifest: its data blocks were placed without some of the job's servers,
/// which were full when it was written; the record's value (1..=`OVERFLOW_VALUE_MAX_BYTES`)
/// names them. Servers store the value and hand it back with the record; only clients read it.
pub const HEADER_FLAG_OVERFLOW: u32 = 4;
/// Every header flag this version knows.
pub const HEADER_FLAGS_KNOWN: u32 = HEADER_FLAG_PERSIST | HEADER_FLAG_FENCE | HEADER_FLAG_OVERFLOW;

/// Size, layout and flags of one object, as stored with its block-0 record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ObjectHeader {
    /// Writer-chosen id of the put that created the object; 0 means absent.
    pub version: u64,
    /// Object size in bytes.
    pub size: u64,
    /// 0 for a small object (bytes inline in block 0), else the number of data blocks.
    pub block_count: u32,
    /// Bytes per data block; 0 for a small object.
    pub block_size: u32,
    /// Bit set of `HEADER_FLAG_*`.
    pub flags: u32,
}

/// Why a header is not acceptable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HeaderError {
    /// Fewer than [`HEADER_LEN_BYTES`] bytes were given.
    #[error("object header needs {HEADER_LEN_BYTES} bytes, got {0}")]
    Truncated(usize),
    /// Version 0 is reserved for "absent".
    #[error("object version must be non-zero")]
    ZeroVersion,
    /// A small object larger than the small-object bound, or a manifest with bad geometry.
    #[error(
        "object geometry is inconsistent: size {size}, {block_count} blocks of {block_size} bytes"
    )]
    Geometry {
        /// Declared size.
        size: u64,
        /// Declared block count.
        block_count: u32,
        /// Declared block size.
        block_size: u32,
    },
    /// Flag bits that this version does not know.
    #[error("unknown object flags {0:#x}")]
    UnknownFlags(u32),
    /// The reserved last four bytes are not zero.
    #[error("the object header's reserved field is not zero")]
    ReservedNonZero,
}

impl ObjectHeader {
    /// Whether the object is PERSIST.
    pub fn persist(&self) -> bool {
        self.flags & HEADER_FLAG_PERSIST != 0
    }

    /// Whether the record is a write-once fence (see [`HEADER_FLAG_FENCE`]).
    pub fn fence(&self) -> bool {
        self.flags & HEADER_FLAG_FENCE != 0
    }

    /// Whether the object's bytes are inline in block 0.
    pub fn is_small(&self) -> bool {
        self.block_count == 0
    }

    /// Whether this is a manifest whose data blocks skipped full servers (its record's value
    /// names them).
    pub fn overflowed(&self) -> bool {
        self.flags & HEADER_FLAG_OVERFLOW != 0
    }

    /// Whether a block-0 record of this header may carry a value of `len` bytes: a small
    /// object's bytes (`size`), nothing for a manifest, 1..=`OVERFLOW_VALUE_MAX_BYTES` for an
    /// overflowed manifest.
    pub fn value_len_ok(&self, len: u64) -> bool {
        if self.is_small() {
            len == self.size
        } else if self.overflowed() {
            (1..=OVERFLOW_VALUE_MAX_BYTES).contains(&len)
        } else {
            len == 0
        }
    }

    /// Length of data block `index` (1-based) of a large object, or `None` if out of range.
    pub fn data_block_len(&self, index: u32) -> Option<u64> {
        if index == 0 || index > self.block_count {
            return None;
        }
        let start = u64::from(index - 1) * u64::from(self.block_size);
        Some((self.size - start).min(u64::from(self.block_size)))
    }

    /// Check the header's internal consistency.
    pub fn validate(&self) -> Result<(), HeaderError> {
        if self.version == 0 {
            return Err(HeaderError::ZeroVersion);
        }
        if self.flags & !HEADER_FLAGS_KNOWN != 0 {
            return Err(HeaderError::UnknownFlags(self.flags));
        }
        let geometry = HeaderError::Geometry {
            size: self.size,
            block_count: self.block_count,
            block_size: self.block_size,
        };
        if self.fence() && (self.size != 0 || self.block_count != 0 || self.persist()) {
            // A fence holds no bytes and lives with ephemeral records.
            return Err(geometry);
        }
        if self.block_count == 0 {
            // Only a manifest has data blocks that could skip a server.
            if self.size > SMALL_OBJECT_MAX_BYTES || self.block_size != 0 || self.overflowed() {
                return Err(geometry);
            }
            return Ok(());
        }
        if self.block_size == 0 || self.block_size > BLOCK_SIZE_MAX_BYTES {
            return Err(geometry);
        }
        let expected_blocks = self.size.div_ceil(u64::from(self.block_size));
        if expected_blocks != u64::from(self.block_count) {
            return Err(geometry);
        }
        Ok(())
    }

    /// Encode into the fixed little-endian layout of docs/PROTOCOL.md.
    pub fn encode(&self) -> [u8; HEADER_LEN_BYTES] {
        let mut out = [0u8; HEADER_LEN_BYTES];
        out[0..8].copy_from_slice(&self.version.to_le_bytes());
        out[8..16].copy_from_slice(&self.size.to_le_bytes());
        out[16..20].copy_from_slice(&self.block_count.to_le_bytes());
        out[20..24].copy_from_slice(&self.block_size.to_le_bytes());
        out[24..28].copy_from_slice(&self.flags.to_le_bytes());
        out
    }

    /// Decode from the fixed layout; does not validate (see [`ObjectHeader::validate`]).
    pub fn decode(buf: &[u8]) -> Result<Self, HeaderError> {
        if buf.len() < HEADER_LEN_BYTES {
            return Err(HeaderError::Truncated(buf.len()));
        }
        let u64_at = |at: usize| u64::from_le_bytes(buf[at..at + 8].try_into().expect("8 bytes"));
        let u32_at = |at: usize| u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"));
        if u32_at(28) != 0 {
            return Err(HeaderError::ReservedNonZero);
        }
        Ok(Self {
            version: u64_at(0),
            size: u64_at(8),
            block_count: u32_at(16),
            block_size: u32_at(20),
            flags: u32_at(24),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_bytes_must_be_zero() {
        let mut raw = ObjectHeader {
            version: 7,
            size: 3,
            ..Default::default()
        }
        .encode();
        raw[31] = 1;
        assert_eq!(
            ObjectHeader::decode(&raw),
            Err(HeaderError::ReservedNonZero)
        );
    }

    #[test]
    fn round_trip() {
        let header = ObjectHeader {
            version: 7,
            size: 3 << 20,
            block_count: 3,
            block_size: 1 << 20,
            flags: 1,
        };
        assert_eq!(ObjectHeader::decode(&header.encode()).unwrap(), header);
        assert!(header.validate().is_ok());
        assert_eq!(header.data_block_len(3), Some(1 << 20));
        assert_eq!(header.data_block_len(4), None);
    }

    #[test]
    fn rejects_bad_geometry() {
        let small_too_big = ObjectHeader {
            version: 1,
            size: SMALL_OBJECT_MAX_BYTES + 1,
            ..Default::default()
        };
        assert!(small_too_big.validate().is_err());
        let two_blocks = ObjectHeader {
            version: 1,
            size: 10,
            block_count: 2,
            block_size: 8,
            flags: 0,
        };
        assert!(two_blocks.validate().is_ok());
        let wrong_count = ObjectHeader {
            version: 1,
            size: 10,
            block_count: 3,
            block_size: 8,
            flags: 0,
        };
        assert!(wrong_count.validate().is_err());
        assert_eq!(
            ObjectHeader::decode(&[0u8; 5]),
            Err(HeaderError::Truncated(5))
        );
    }

    #[test]
    fn a_fence_holds_no_bytes_and_is_never_persist() {
        let fence = ObjectHeader {
            version: 9,
            flags: HEADER_FLAG_FENCE,
            ..Default::default()
        };
        assert!(fence.validate().is_ok() && fence.fence() && !fence.persist());
        for bad in [
            ObjectHeader { size: 1, ..fence },
            ObjectHeader {
                flags: HEADER_FLAG_FENCE | HEADER_FLAG_PERSIST,
                ..fence
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        let unknown = ObjectHeader { flags: 8, ..fence };
        assert_eq!(unknown.validate(), Err(HeaderError::UnknownFlags(8)));
    }

    #[test]
    fn only_a_manifest_overflows_and_carries_a_bounded_value() {
        let manifest = ObjectHeader {
            version: 1,
            size: 10,
            block_count: 2,
            block_size: 8,
            flags: HEADER_FLAG_OVERFLOW | HEADER_FLAG_PERSIST,
        };
        assert!(manifest.validate().is_ok() && manifest.overflowed() && manifest.persist());
        assert!(!manifest.value_len_ok(0));
        assert!(manifest.value_len_ok(1) && manifest.value_len_ok(OVERFLOW_VALUE_MAX_BYTES));
        assert!(!manifest.value_len_ok(OVERFLOW_VALUE_MAX_BYTES + 1));
        let plain = ObjectHeader {
            flags: 0,
            ..manifest
        };
        assert!(plain.value_len_ok(0) && !plain.value_len_ok(1));
        let small = ObjectHeader {
            version: 1,
            size: 3,
            flags: HEADER_FLAG_OVERFLOW,
            ..Default::default()
        };
        assert!(
            small.validate().is_err(),
            "a small object has no blocks to skip a server"
        );
        let unknown = ObjectHeader {
            flags: 8,
            ..manifest
        };
        assert_eq!(unknown.validate(), Err(HeaderError::UnknownFlags(8)));
    }
}
