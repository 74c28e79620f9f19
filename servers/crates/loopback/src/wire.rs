//! The framing shared with `benchmarks/tcp.py` (Python's `struct` format `<B7xQ`): a 16-byte
//! request header (operation, seven zero bytes, payload length in little-endian), then a PUT's
//! payload. A PUT is answered with one acknowledgement byte, a GET with exactly that many bytes.
//! So either client works with either server.

use crate::error::Error;

/// Bytes of a request header.
pub const HEADER_BYTES: usize = 16;
/// The byte that acknowledges a PUT.
pub const ACK: u8 = 0;
const OP_PUT: u8 = 1;
const OP_GET: u8 = 2;

/// The two request shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// The client sends the bytes, the server drops them and acknowledges.
    Put,
    /// The server answers with the number of bytes asked for.
    Get,
}

/// The header of a request for `length_bytes` bytes.
pub fn encode(op: Op, length_bytes: u64) -> [u8; HEADER_BYTES] {
    let mut header = [0u8; HEADER_BYTES];
    header[0] = match op {
        Op::Put => OP_PUT,
        Op::Get => OP_GET,
    };
    header[8..].copy_from_slice(&length_bytes.to_le_bytes());
    header
}

/// The operation and length of a request header.
pub fn decode(header: &[u8; HEADER_BYTES]) -> Result<(Op, u64), Error> {
    let op = match header[0] {
        OP_PUT => Op::Put,
        OP_GET => Op::Get,
        other => return Err(Error::UnknownOp(other)),
    };
    let mut length = [0u8; 8];
    length.copy_from_slice(&header[8..]);
    Ok((op, u64::from_le_bytes(length)))
}

/// `length_bytes` bytes that no compressor shrinks (xorshift64*), the same on every call.
pub fn filler(length_bytes: usize) -> Vec<u8> {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut bytes = Vec::with_capacity(length_bytes);
    while bytes.len() < length_bytes {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let word = state.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
        let take = word.len().min(length_bytes - bytes.len());
        bytes.extend_from_slice(&word[..take]);
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_matches_the_python_struct_layout() {
        // struct.pack("<B7xQ", 2, 1 << 20) in benchmarks/tcp.py.
        let expected = [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0];
        assert_eq!(encode(Op::Get, 1 << 20), expected);
        assert_eq!(decode(&expected).unwrap(), (Op::Get, 1 << 20));
        assert_eq!(
            decode(&encode(Op::Put, u64::MAX)).unwrap(),
            (Op::Put, u64::MAX)
        );
    }

    #[test]
    fn an_unknown_operation_is_refused() {
        let mut header = encode(Op::Put, 1);
        header[0] = 9;
        assert!(matches!(decode(&header), Err(Error::UnknownOp(9))));
    }

    #[test]
    fn filler_is_deterministic_and_not_constant() {
        let bytes = filler(1000);
        assert_eq!(bytes.len(), 1000);
        assert_eq!(bytes, filler(1000));
        assert!(bytes.iter().any(|&b| b != bytes[0]));
    }
}
