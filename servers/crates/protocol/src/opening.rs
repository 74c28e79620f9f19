//! How a connection to a storage server opens, judged from the bytes received so far: which
//! protocol its first bytes start (a TLS handshake, the direct exchange, HTTP/2), and whether an
//! HTTP/2 opening (the client preface, then the SETTINGS frame that must follow it) is whole.
//! Pure functions over bytes, so the server's handshake reads them under its deadline and the
//! fuzz target checks them without a network.

use crate::direct::DIRECT_MAGIC;

/// The HTTP/2 client connection preface.
pub const CLIENT_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Bytes of an HTTP/2 frame header: length (24 bits), type, flags, stream id.
pub const FRAME_HEAD_BYTES: usize = 9;
/// Largest frame payload a client may send before it has seen other settings of the server's
/// (`SETTINGS_MAX_FRAME_SIZE`'s initial value).
pub const FRAME_PAYLOAD_MAX_BYTES: usize = 16 * 1024;
/// The HTTP/2 SETTINGS frame type.
pub const FRAME_SETTINGS: u8 = 0x4;
/// Bytes of one setting in a SETTINGS frame (identifier and value).
const SETTING_BYTES: usize = 6;
/// First byte of a TLS record carrying a handshake message (a ClientHello opens every TLS
/// connection); neither `PRI ` nor `DIRECT_MAGIC` starts with it.
pub const TLS_HANDSHAKE_RECORD: u8 = 0x16;
/// Longest HTTP/2 opening: the preface, a frame head and the largest first SETTINGS payload.
pub const HTTP2_OPENING_MAX_BYTES: usize =
    CLIENT_PREFACE.len() + FRAME_HEAD_BYTES + FRAME_PAYLOAD_MAX_BYTES;

/// The protocol a connection's first bytes start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FirstBytes {
    /// Not enough bytes yet to tell (a prefix of the direct magic).
    NeedMore,
    /// A TLS handshake record.
    Tls,
    /// The direct exchange's magic, whole.
    Direct,
    /// Anything else: HTTP/2 is the only protocol left (its opening is checked next).
    Http2,
}

/// Which protocol the bytes received so far start (`first` must not be empty).
pub fn first_bytes(first: &[u8]) -> FirstBytes {
    match first.first() {
        None => FirstBytes::NeedMore,
        Some(&TLS_HANDSHAKE_RECORD) => FirstBytes::Tls,
        Some(_) if !DIRECT_MAGIC.starts_with(&first[..first.len().min(DIRECT_MAGIC.len())]) => {
            FirstBytes::Http2
        }
        Some(_) if first.len() >= DIRECT_MAGIC.len() => FirstBytes::Direct,
        Some(_) => FirstBytes::NeedMore,
    }
}

/// How far an HTTP/2 opening has come.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Http2Opening {
    /// Whole once this many bytes in all have arrived (more than given so far).
    NeedBytes(usize),
    /// Whole: its first this many bytes are the preface and the SETTINGS frame.
    Whole(usize),
    /// Not an HTTP/2 opening: not the preface, or not a SETTINGS frame after it, or one over
    /// its bounds.
    NotHttp2,
}

/// Judge the bytes received so far as an HTTP/2 opening.
pub fn http2_opening(received: &[u8]) -> Http2Opening {
    let preface = received.len().min(CLIENT_PREFACE.len());
    if received[..preface] != CLIENT_PREFACE[..preface] {
        return Http2Opening::NotHttp2;
    }
    let head_end = CLIENT_PREFACE.len() + FRAME_HEAD_BYTES;
    if received.len() < head_end {
        return Http2Opening::NeedBytes(head_end);
    }
    let head = &received[CLIENT_PREFACE.len()..head_end];
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let stream_id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    let settings = head[3] == FRAME_SETTINGS && head[4] == 0 && stream_id == 0;
    if !settings || len > FRAME_PAYLOAD_MAX_BYTES || len % SETTING_BYTES != 0 {
        return Http2Opening::NotHttp2;
    }
    let end = head_end + len;
    if received.len() < end {
        Http2Opening::NeedBytes(end)
    } else {
        Http2Opening::Whole(end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opening(payload_len: usize) -> Vec<u8> {
        let mut bytes = CLIENT_PREFACE.to_vec();
        let len = (payload_len as u32).to_be_bytes();
        bytes.extend_from_slice(&[len[1], len[2], len[3], FRAME_SETTINGS, 0, 0, 0, 0, 0]);
        bytes.extend(std::iter::repeat_n(7u8, payload_len));
        bytes
    }

    #[test]
    fn first_bytes_tell_the_protocol() {
        assert_eq!(first_bytes(b"PRI * HTTP/2.0"), FirstBytes::Http2);
        // "P" also starts the direct magic: one more byte tells.
        assert_eq!(first_bytes(b"P"), FirstBytes::NeedMore);
        assert_eq!(first_bytes(b"PR"), FirstBytes::Http2);
        assert_eq!(first_bytes(&DIRECT_MAGIC[..3]), FirstBytes::NeedMore);
        assert_eq!(first_bytes(DIRECT_MAGIC), FirstBytes::Direct);
        assert_eq!(first_bytes(&[TLS_HANDSHAKE_RECORD, 3, 1]), FirstBytes::Tls);
        assert_eq!(first_bytes(b"GET / HTTP/1.1"), FirstBytes::Http2);
    }

    #[test]
    fn an_opening_is_whole_only_with_its_settings_frame() {
        let whole = opening(12);
        for cut in 0..whole.len() {
            assert!(
                matches!(http2_opening(&whole[..cut]), Http2Opening::NeedBytes(n) if n > cut),
                "{cut}"
            );
        }
        assert_eq!(http2_opening(&whole), Http2Opening::Whole(whole.len()));
        let mut more = whole.clone();
        more.extend_from_slice(b"a request");
        assert_eq!(http2_opening(&more), Http2Opening::Whole(whole.len()));
        assert_eq!(http2_opening(&opening(7)), Http2Opening::NotHttp2);
        assert_eq!(
            http2_opening(&opening(FRAME_PAYLOAD_MAX_BYTES + 6)[..40]),
            Http2Opening::NotHttp2
        );
        let mut headers_first = opening(0);
        headers_first[CLIENT_PREFACE.len() + 3] = 0x1;
        assert_eq!(http2_opening(&headers_first), Http2Opening::NotHttp2);
        assert_eq!(http2_opening(b"GET / HTTP/1.1\r\n"), Http2Opening::NotHttp2);
    }
}
