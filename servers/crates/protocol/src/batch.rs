//! The `app_metadata` of DoPut and DoGet record batches: which block, and which piece of it.

use crate::error::ProtocolError;

/// Bytes of a DoPut batch's `app_metadata`.
pub const PUT_PIECE_META_BYTES: usize = 12;
/// Bytes of a DoGet batch's `app_metadata`.
pub const GET_PIECE_META_BYTES: usize = 20;

/// DoPut batch metadata: the batch's value is the next piece of block `block_index`, whose total
/// length is `block_len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutPieceMeta {
    /// Block index, at least 1.
    pub block_index: u32,
    /// Length of the whole block.
    pub block_len: u64,
}

impl PutPieceMeta {
    /// Encode as 12 little-endian bytes.
    pub fn encode(&self) -> [u8; PUT_PIECE_META_BYTES] {
        let mut out = [0u8; PUT_PIECE_META_BYTES];
        out[0..4].copy_from_slice(&self.block_index.to_le_bytes());
        out[4..12].copy_from_slice(&self.block_len.to_le_bytes());
        out
    }

    /// Decode; the block index must be at least 1.
    pub fn decode(buf: &[u8]) -> Result<Self, ProtocolError> {
        if buf.len() != PUT_PIECE_META_BYTES {
            return Err(ProtocolError::Length {
                what: "DoPut app_metadata",
                len: buf.len() as u64,
                min: PUT_PIECE_META_BYTES as u64,
                max: PUT_PIECE_META_BYTES as u64,
            });
        }
        let block_index = u32::from_le_bytes(buf[0..4].try_into().expect("4 bytes"));
        let block_len = u64::from_le_bytes(buf[4..12].try_into().expect("8 bytes"));
        if block_index == 0 {
            return Err(ProtocolError::Field {
                what: "block index",
                why: "must be >= 1",
            });
        }
        Ok(Self {
            block_index,
            block_len,
        })
    }
}

/// DoGet batch metadata: the batch's value is bytes `[offset, offset + len)` of block `block_index`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GetPieceMeta {
    /// Block index, at least 1.
    pub block_index: u32,
    /// Offset of the piece in the block.
    pub offset: u64,
    /// Length of the piece.
    pub len: u64,
}

impl GetPieceMeta {
    /// Encode as 20 little-endian bytes.
    pub fn encode(&self) -> [u8; GET_PIECE_META_BYTES] {
        let mut out = [0u8; GET_PIECE_META_BYTES];
        out[0..4].copy_from_slice(&self.block_index.to_le_bytes());
        out[4..12].copy_from_slice(&self.offset.to_le_bytes());
        out[12..20].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Decode (for clients and tests).
    pub fn decode(buf: &[u8]) -> Result<Self, ProtocolError> {
        if buf.len() != GET_PIECE_META_BYTES {
            return Err(ProtocolError::Length {
                what: "DoGet app_metadata",
                len: buf.len() as u64,
                min: GET_PIECE_META_BYTES as u64,
                max: GET_PIECE_META_BYTES as u64,
            });
        }
        Ok(Self {
            block_index: u32::from_le_bytes(buf[0..4].try_into().expect("4 bytes")),
            offset: u64::from_le_bytes(buf[4..12].try_into().expect("8 bytes")),
            len: u64::from_le_bytes(buf[12..20].try_into().expect("8 bytes")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let put = PutPieceMeta {
            block_index: 3,
            block_len: 1 << 20,
        };
        assert_eq!(PutPieceMeta::decode(&put.encode()).unwrap(), put);
        let get = GetPieceMeta {
            block_index: 2,
            offset: 4096,
            len: 512,
        };
        assert_eq!(GetPieceMeta::decode(&get.encode()).unwrap(), get);
    }

    #[test]
    fn malformed() {
        assert!(PutPieceMeta::decode(&[0u8; 11]).is_err());
        assert!(PutPieceMeta::decode(&[0u8; 13]).is_err());
        assert!(matches!(
            PutPieceMeta::decode(&[0u8; 12]),
            Err(ProtocolError::Field { .. })
        ));
        assert!(GetPieceMeta::decode(&[0u8; 12]).is_err());
    }
}
