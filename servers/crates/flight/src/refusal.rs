//! Refusals at the door of a listener: a plaintext client of a TLS listener is told why in its
//! own protocol, and a TLS client of a plaintext listener has its handshake ended cleanly.
//!
//! An HTTP/2 client is answered on the stream of its first request: a GOAWAY alone (last stream
//! 0) races the client's request, and a client (hyper) that sees it before the request is out
//! fails the request as cancelled, without the GOAWAY's reason. So the refusal waits for the
//! client's first HEADERS frame and answers that stream with a trailers-only gRPC response
//! (`permission_denied` and the reason), then sends the GOAWAY.

use std::io;
use std::time::Duration;

use pocketflow_protocol::direct::{encode_head, encode_status, Kind};
use pocketflow_protocol::opening::{
    CLIENT_PREFACE, FRAME_HEAD_BYTES, FRAME_PAYLOAD_MAX_BYTES, FRAME_SETTINGS,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

use crate::route::Peekable;

/// Why a plaintext connection to a TLS listener is refused.
pub const TLS_REQUIRED_MESSAGE: &str = "this storage server accepts TLS connections only; \
     connect with TLS, trusting the cluster CA (the job handle's tls_ca)";

/// The refusal as a status message, its kind first (as every status of the server's).
fn refusal_message() -> String {
    format!("permission_denied: {TLS_REQUIRED_MESSAGE}")
}

/// Largest ClientHello read from a TLS client of a plaintext listener before closing.
const CLIENT_HELLO_MAX_BYTES: usize = 16 * 1024;

/// How long a refused plaintext connection stays open for its client to read why.
const REFUSAL_LINGER: Duration = Duration::from_secs(2);
/// Most bytes read (and dropped) from a refused plaintext connection while it lingers.
const REFUSAL_DRAIN_MAX_BYTES: usize = 64 * 1024;

/// How long a refused HTTP/2 client may take to send its first request; one that sends none
/// gets the GOAWAY alone. Together with `REFUSAL_LINGER` well within the open bound
/// (`HANDSHAKE_TIMEOUT`) that the caller holds the whole refusal to.
const FIRST_REQUEST_WAIT: Duration = Duration::from_secs(5);
/// Most bytes read from a refused HTTP/2 client while looking for its first HEADERS frame.
const FIRST_REQUEST_MAX_BYTES: usize = 64 * 1024;

const FRAME_HEADERS: u8 = 0x1;
const FRAME_GOAWAY: u8 = 0x7;
const FLAG_ACK: u8 = 0x1;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
/// The HTTP/2 error code of a connection whose security is not enough.
const INADEQUATE_SECURITY: u32 = 0xc;
/// The gRPC status code `PERMISSION_DENIED`.
const GRPC_PERMISSION_DENIED: u8 = 7;

/// End a TLS client's handshake on a plaintext listener with a clean close (its ClientHello
/// read first, so the close is a FIN and not a reset): the client sees the connection end
/// during its handshake, which it reports as a server that does not speak TLS.
pub(crate) async fn refuse_tls<C: Peekable>(mut connection: C) {
    let mut hello = vec![0u8; CLIENT_HELLO_MAX_BYTES];
    let _ = connection.read(&mut hello).await;
    let _ = connection.shutdown().await;
}

/// Tell a plaintext direct-exchange client of a TLS listener why it is refused (a
/// `permission_denied` STATUS), and close.
pub(crate) async fn refuse_plaintext_direct<C: Peekable>(mut connection: C) {
    let status = encode_status(GRPC_PERMISSION_DENIED, &refusal_message());
    let mut out = encode_head(Kind::Status, status.len()).to_vec();
    out.extend_from_slice(&status);
    if connection.write_all(&out).await.is_ok() {
        linger_and_close(connection).await;
    }
}

/// Tell a plaintext HTTP/2 client of a TLS listener why it is refused, and close: the server
/// preface, then (once its first request arrives) a trailers-only `permission_denied` answer on
/// that stream, then a GOAWAY with `INADEQUATE_SECURITY` and the reason as debug data.
pub(crate) async fn refuse_plaintext_http2<C: Peekable>(mut connection: C) {
    // The server preface (an empty SETTINGS frame) first: the client needs it before any other
    // frame of ours, and sends its request without waiting for it.
    if connection
        .write_all(&frame_head(0, FRAME_SETTINGS, 0, 0))
        .await
        .is_err()
    {
        return;
    }
    let first = tokio::time::timeout(FIRST_REQUEST_WAIT, first_request(&mut connection)).await;
    let mut out = Vec::new();
    let last_stream = match first {
        Ok(Ok(Some(stream))) => {
            // Its SETTINGS acknowledged, as HTTP/2 asks, then the answer.
            out.extend_from_slice(&frame_head(0, FRAME_SETTINGS, FLAG_ACK, 0));
            let block = refusal_header_block();
            out.extend_from_slice(&frame_head(
                block.len(),
                FRAME_HEADERS,
                FLAG_END_STREAM | FLAG_END_HEADERS,
                stream,
            ));
            out.extend_from_slice(&block);
            stream
        }
        // Not HTTP/2 after all, closed, or no request in time: the GOAWAY alone.
        Ok(Ok(None)) | Ok(Err(_)) | Err(_) => 0,
    };
    let debug = TLS_REQUIRED_MESSAGE.as_bytes();
    out.extend_from_slice(&frame_head(8 + debug.len(), FRAME_GOAWAY, 0, 0));
    out.extend_from_slice(&last_stream.to_be_bytes());
    out.extend_from_slice(&INADEQUATE_SECURITY.to_be_bytes());
    out.extend_from_slice(debug);
    if connection.write_all(&out).await.is_ok() {
        linger_and_close(connection).await;
    }
}

/// Let the client read the refusal before the connection ends (a client that sees the close
/// first reports that instead): read and drop what it sends until it closes, at most
/// `REFUSAL_LINGER` and `REFUSAL_DRAIN_MAX_BYTES`, then close.
async fn linger_and_close<C: Peekable>(mut connection: C) {
    let _ = tokio::time::timeout(REFUSAL_LINGER, async {
        let mut sink = [0u8; 4096];
        let mut drained = 0;
        while drained < REFUSAL_DRAIN_MAX_BYTES {
            match connection.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => drained += n,
            }
        }
    })
    .await;
    let _ = connection.shutdown().await;
}

/// The stream id of the client's first HEADERS frame, after its preface and any other frames
/// (`None`: it is not HTTP/2, or sent more than `FIRST_REQUEST_MAX_BYTES` or a frame larger
/// than `FRAME_PAYLOAD_MAX_BYTES` first). The HEADERS frame's own payload is left unread.
async fn first_request<R: AsyncRead + Unpin>(connection: &mut R) -> io::Result<Option<u32>> {
    let mut preface = [0u8; CLIENT_PREFACE.len()];
    connection.read_exact(&mut preface).await?;
    if &preface != CLIENT_PREFACE {
        return Ok(None);
    }
    let mut read = preface.len();
    let mut payload = vec![0u8; FRAME_PAYLOAD_MAX_BYTES];
    loop {
        let mut head = [0u8; FRAME_HEAD_BYTES];
        connection.read_exact(&mut head).await?;
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        if head[3] == FRAME_HEADERS && stream != 0 {
            return Ok(Some(stream));
        }
        read += FRAME_HEAD_BYTES + len;
        if len > FRAME_PAYLOAD_MAX_BYTES || read > FIRST_REQUEST_MAX_BYTES {
            return Ok(None);
        }
        connection.read_exact(&mut payload[..len]).await?;
    }
}

/// An HTTP/2 frame header.
fn frame_head(len: usize, kind: u8, flags: u8, stream: u32) -> [u8; FRAME_HEAD_BYTES] {
    let len = u32::try_from(len).expect("a refusal frame is small");
    let [_, l0, l1, l2] = len.to_be_bytes();
    let [s0, s1, s2, s3] = stream.to_be_bytes();
    [l0, l1, l2, kind, flags, s0, s1, s2, s3]
}

/// The HPACK block of a trailers-only gRPC response: `:status 200`, `content-type`,
/// `grpc-status` `permission_denied` and the reason as `grpc-message`. Every field is a literal
/// without indexing (no Huffman coding), so the client's decoder table is left untouched.
fn refusal_header_block() -> Vec<u8> {
    /// `:status: 200`, entry 8 of the HPACK static table.
    const STATUS_200: u8 = 0x88;
    let mut block = vec![STATUS_200];
    let message = refusal_message();
    let status = GRPC_PERMISSION_DENIED.to_string();
    for (name, value) in [
        ("content-type", "application/grpc"),
        ("grpc-status", status.as_str()),
        ("grpc-message", message.as_str()),
    ] {
        block.push(0x00); // Literal without indexing, new name.
        hpack_string(name.as_bytes(), &mut block);
        hpack_string(value.as_bytes(), &mut block);
    }
    block
}

/// An HPACK string literal without Huffman coding: its length (7-bit prefix integer), then it.
fn hpack_string(bytes: &[u8], out: &mut Vec<u8>) {
    const PREFIX_MAX: usize = 0x7f;
    let mut len = bytes.len();
    if len < PREFIX_MAX {
        out.push(len as u8);
    } else {
        out.push(PREFIX_MAX as u8);
        len -= PREFIX_MAX;
        while len >= 0x80 {
            out.push((len & 0x7f) as u8 | 0x80);
            len >>= 7;
        }
        out.push(len as u8);
    }
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reason_needs_no_percent_encoding_in_grpc_message() {
        // grpc-message carries printable ASCII other than '%' as is.
        assert!(refusal_message()
            .bytes()
            .all(|b| (0x20..=0x7e).contains(&b) && b != b'%'));
    }

    #[test]
    fn hpack_lengths_use_the_seven_bit_prefix() {
        let mut out = Vec::new();
        hpack_string(&[b'a'; 126], &mut out);
        assert_eq!(out[0], 126);
        out.clear();
        hpack_string(&[b'a'; 127], &mut out);
        assert_eq!(&out[..2], &[0x7f, 0x00]);
        out.clear();
        hpack_string(&[b'a'; 300], &mut out);
        // 300 - 127 = 173 = 0b1_0101101: low seven bits with the continuation bit, then 1.
        assert_eq!(&out[..3], &[0x7f, 0xad, 0x01]);
        assert_eq!(out.len(), 3 + 300);
    }

    /// A tonic client (hyper's HTTP/2) gets the reason as the status of its call, every time:
    /// the answer is on its request's stream, so it cannot lose a race with the GOAWAY.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tonic_client_gets_the_reason_as_its_status() {
        use arrow_flight::flight_service_client::FlightServiceClient;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((connection, _)) = listener.accept().await {
                tokio::spawn(refuse_plaintext_http2(connection));
            }
        });
        for _ in 0..20 {
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut client = FlightServiceClient::new(channel);
            let ticket = arrow_flight::Ticket {
                ticket: bytes::Bytes::from_static(b"t"),
            };
            let status = client.do_get(ticket).await.err().unwrap();
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
            assert_eq!(status.message(), refusal_message());
        }
    }

    #[tokio::test]
    async fn the_first_headers_frame_names_the_stream() {
        let mut client = CLIENT_PREFACE.to_vec();
        client.extend_from_slice(&frame_head(6, FRAME_SETTINGS, 0, 0));
        client.extend_from_slice(&[0, 3, 0, 0, 0, 100]);
        client.extend_from_slice(&frame_head(4, 0x8, 0, 0)); // WINDOW_UPDATE
        client.extend_from_slice(&[0, 1, 0, 0]);
        client.extend_from_slice(&frame_head(10, FRAME_HEADERS, 0x4, 3));
        assert_eq!(
            first_request(&mut client.as_slice()).await.unwrap(),
            Some(3)
        );

        let mut not_http2 = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".as_slice();
        assert_eq!(first_request(&mut not_http2).await.unwrap(), None);

        let mut huge = CLIENT_PREFACE.to_vec();
        huge.extend_from_slice(&frame_head(
            FRAME_PAYLOAD_MAX_BYTES + 1,
            FRAME_SETTINGS,
            0,
            0,
        ));
        assert_eq!(first_request(&mut huge.as_slice()).await.unwrap(), None);
    }
}
