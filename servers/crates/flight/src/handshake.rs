//! A connection's handshake, under one deadline from its accept: its first bytes, the TLS
//! handshake, and the opening of its protocol (the HTTP/2 client preface and SETTINGS frame, or
//! the direct exchange's magic and first message). Until it is done the connection holds a place
//! of the handshake pool ([`crate::bounds::HANDSHAKES_MAX`], a share of it per peer address) and
//! none of the pools of served connections, so connections that never finish their handshake cannot
//! take the places of clients that did.
//!
//! hyper's HTTP/2 server waits for the client preface without a deadline of its own, so the
//! preface and the first SETTINGS frame are read here, within the deadline, and given to hyper
//! again through [`Replayed`].

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use pocketflow_protocol::opening::{http2_opening, Http2Opening};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use crate::bounds::HANDSHAKE_TIMEOUT;
use crate::peers::PeerPlace;

/// A connection's handshake in progress: its deadline and its places in the handshake pool,
/// given back when it is dropped (the handshake done, or the connection gone).
pub struct Opening {
    deadline: Instant,
    _place: OwnedSemaphorePermit,
    _peer_place: Option<PeerPlace>,
}

impl Opening {
    /// A handshake that began now, holding `place` and `peer_place` until it ends.
    pub fn new(place: OwnedSemaphorePermit, peer_place: Option<PeerPlace>) -> Self {
        Self {
            deadline: Instant::now() + HANDSHAKE_TIMEOUT,
            _place: place,
            _peer_place: peer_place,
        }
    }

    /// When the handshake must be done.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

/// Read the HTTP/2 client preface and the SETTINGS frame that must follow it; returns the bytes
/// read, for hyper to read again, or `None` if the connection closed or sent something else
/// (it is then closed without an answer: hyper would only send a GOAWAY to a client that does
/// not speak HTTP/2).
pub(crate) async fn read_http2_opening<S: AsyncRead + Unpin>(stream: &mut S) -> Option<Vec<u8>> {
    let mut received = Vec::new();
    loop {
        match http2_opening(&received) {
            Http2Opening::Whole(_) => return Some(received),
            Http2Opening::NotHttp2 => return None,
            Http2Opening::NeedBytes(total) => {
                let have = received.len();
                received.resize(total, 0);
                stream.read_exact(&mut received[have..]).await.ok()?;
            }
        }
    }
}

/// A stream whose first bytes were already read: they are read again first, then the stream.
pub struct Replayed<S> {
    first: Vec<u8>,
    at: usize,
    inner: S,
}

impl<S> Replayed<S> {
    /// `inner`, with `first` (read from it before) read again first.
    pub fn new(first: Vec<u8>, inner: S) -> Self {
        Self {
            first,
            at: 0,
            inner,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Replayed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.at < self.first.len() {
            let n = buf.remaining().min(self.first.len() - self.at);
            let at = self.at;
            buf.put_slice(&self.first[at..at + n]);
            self.at += n;
            if self.at == self.first.len() {
                self.first = Vec::new();
                self.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Replayed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pocketflow_protocol::opening::{CLIENT_PREFACE, FRAME_SETTINGS};
    use tokio::io::AsyncWriteExt;

    fn settings(payload_len: usize) -> Vec<u8> {
        let mut bytes = CLIENT_PREFACE.to_vec();
        let len = (payload_len as u32).to_be_bytes();
        bytes.extend_from_slice(&[len[1], len[2], len[3], FRAME_SETTINGS, 0, 0, 0, 0, 0]);
        bytes.extend(std::iter::repeat_n(7u8, payload_len));
        bytes
    }

    #[tokio::test]
    async fn the_opening_is_read_whole_and_replayed_before_the_rest() {
        let (mut client, mut server) = tokio::io::duplex(64 * 1024);
        let mut sent = settings(12);
        sent.extend_from_slice(b"then a request");
        client.write_all(&sent).await.unwrap();
        drop(client);
        let opening = read_http2_opening(&mut server).await.unwrap();
        assert_eq!(opening, settings(12));
        let mut replayed = Replayed::new(opening, server);
        let mut all = Vec::new();
        replayed.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, sent);
    }

    #[tokio::test]
    async fn a_partial_or_wrong_opening_is_refused() {
        for sent in [
            CLIENT_PREFACE[..14].to_vec(),
            settings(12)[..30].to_vec(),
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            settings(7),
            {
                let mut wrong_type = settings(0);
                wrong_type[CLIENT_PREFACE.len() + 3] = 0x1;
                wrong_type
            },
        ] {
            let (mut client, mut server) = tokio::io::duplex(64 * 1024);
            client.write_all(&sent).await.unwrap();
            drop(client);
            assert!(read_http2_opening(&mut server).await.is_none(), "{sent:?}");
        }
    }
}
