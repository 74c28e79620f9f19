//! One port, two protocols: every accepted connection is HTTP/2 (Arrow Flight, whose clients
//! open with `PRI * HTTP/2.0`) or the direct exchange (which opens with `DIRECT_MAGIC`). Its
//! first bytes decide; a connection that sends nothing within the open bound is closed.
//!
//! With TLS, every connection must open with a TLS handshake, and the protocol agreed by ALPN
//! decides instead (`h2` or `pocketflow-direct`). A plaintext connection to a TLS listener is
//! told why it is refused, in its own protocol (`crate::refusal`): a direct client gets a
//! `permission_denied` status, an HTTP/2 client the same status as the answer to its first
//! request, then a GOAWAY with `INADEQUATE_SECURITY`.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use pocketflow_protocol::direct::{DIRECT_ALPN, DIRECT_MAGIC};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

use crate::bounds::HTTP2_CONNECTIONS_MAX;
use crate::direct::DIRECT_OPEN_TIMEOUT;
pub use crate::refusal::TLS_REQUIRED_MESSAGE;
use crate::refusal::{refuse_plaintext_direct, refuse_plaintext_http2, refuse_tls};
use crate::service::StorageService;

/// An accepted connection whose first bytes can be looked at without taking them.
pub trait Peekable: AsyncRead + AsyncWrite + Send + Sync + Unpin + 'static {
    /// Copy the bytes received so far (up to `buf.len()`) without consuming them.
    fn peek(&self, buf: &mut [u8]) -> impl Future<Output = io::Result<usize>> + Send;
}

impl Peekable for tokio::net::TcpStream {
    fn peek(&self, buf: &mut [u8]) -> impl Future<Output = io::Result<usize>> + Send {
        tokio::net::TcpStream::peek(self, buf)
    }
}

/// An accepted connection as tonic and the direct exchange see it: plain, or inside TLS.
pub enum Link<C> {
    /// Plaintext (a loopback listener without TLS).
    Plain(C),
    /// Inside a finished TLS handshake.
    Tls(Box<TlsStream<C>>),
}

impl<C: Connected> Connected for Link<C> {
    type ConnectInfo = C::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        match self {
            Link::Plain(c) => c.connect_info(),
            Link::Tls(s) => s.get_ref().0.connect_info(),
        }
    }
}

impl<C: Peekable> AsyncRead for Link<C> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Link::Plain(c) => Pin::new(c).poll_read(cx, buf),
            Link::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl<C: Peekable> AsyncWrite for Link<C> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Link::Plain(c) => Pin::new(c).poll_write(cx, buf),
            Link::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Link::Plain(c) => Pin::new(c).poll_write_vectored(cx, bufs),
            Link::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Link::Plain(c) => c.is_write_vectored(),
            Link::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Link::Plain(c) => Pin::new(c).poll_flush(cx),
            Link::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Link::Plain(c) => Pin::new(c).poll_shutdown(cx),
            Link::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Pause before looking again at a connection that sent only part of the magic so far.
const PARTIAL_MAGIC_RETRY: Duration = Duration::from_millis(1);

/// HTTP/2 connections handed to tonic that it has not taken yet.
const HTTP2_QUEUED_MAX: usize = 64;

/// An HTTP/2 connection for tonic, holding one of the `HTTP2_CONNECTIONS_MAX` slots while it
/// lives (a direct connection holds a session slot instead).
pub struct Http2Connection<C> {
    inner: Link<C>,
    _slot: OwnedSemaphorePermit,
}

impl<C: Connected> Connected for Http2Connection<C> {
    type ConnectInfo = C::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<C: Peekable> AsyncRead for Http2Connection<C> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<C: Peekable> AsyncWrite for Http2Connection<C> {
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

enum Protocol {
    Http2,
    Direct,
    /// A TLS handshake (its first byte is a handshake record, 0x16).
    Tls,
}

/// First byte of a TLS record carrying a handshake message (a ClientHello opens every TLS
/// connection); neither `PRI ` nor `DIRECT_MAGIC` starts with it.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// The HTTP/2 connections of `incoming`, for tonic, at most `HTTP2_CONNECTIONS_MAX` at once
/// (further ones wait for a slot); direct-exchange connections are served by `service` on tasks
/// of their own.
pub fn route<C: Peekable + Connected>(
    incoming: impl Stream<Item = io::Result<C>> + Send + 'static,
    service: StorageService,
    tls: Option<TlsAcceptor>,
) -> impl Stream<Item = io::Result<Http2Connection<C>>> {
    let (tx, rx) = mpsc::channel(HTTP2_QUEUED_MAX);
    let http2_slots = Arc::new(Semaphore::new(HTTP2_CONNECTIONS_MAX));
    tokio::spawn(async move {
        let mut incoming = std::pin::pin!(incoming);
        while let Some(accepted) = incoming.next().await {
            let connection = match accepted {
                Ok(connection) => connection,
                Err(e) => {
                    if tx.send(Err(e)).await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            let tx = tx.clone();
            let service = service.clone();
            let http2_slots = http2_slots.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                // The first bytes, then (with TLS) the handshake, within the open bound.
                let opened = tokio::time::timeout(DIRECT_OPEN_TIMEOUT, async {
                    let protocol = protocol_of(&connection).await?;
                    Some(match (tls, protocol) {
                        (None, Protocol::Http2) => (Protocol::Http2, Link::Plain(connection)),
                        (None, Protocol::Direct) => (Protocol::Direct, Link::Plain(connection)),
                        // A TLS client of a plaintext listener: end its handshake cleanly.
                        (None, Protocol::Tls) => {
                            refuse_tls(connection).await;
                            return None;
                        }
                        (Some(acceptor), Protocol::Tls) => {
                            let stream = acceptor.accept(connection).await.ok()?;
                            let direct = stream.get_ref().1.alpn_protocol() == Some(DIRECT_ALPN);
                            let protocol = if direct {
                                Protocol::Direct
                            } else {
                                Protocol::Http2
                            };
                            (protocol, Link::Tls(Box::new(stream)))
                        }
                        (Some(_), Protocol::Direct) => {
                            refuse_plaintext_direct(connection).await;
                            return None;
                        }
                        (Some(_), Protocol::Http2) => {
                            refuse_plaintext_http2(connection).await;
                            return None;
                        }
                    })
                })
                .await;
                match opened {
                    Ok(Some((Protocol::Direct, link))) => service.serve_direct(link).await,
                    Ok(Some((_, link))) => {
                        let Ok(slot) = http2_slots.acquire_owned().await else {
                            return;
                        };
                        let connection = Http2Connection {
                            inner: link,
                            _slot: slot,
                        };
                        let _ = tx.send(Ok(connection)).await;
                    }
                    // Closed, failed, refused, or silent for the whole bound: dropping closes it.
                    Ok(None) | Err(_) => {}
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// Which protocol the connection speaks, from its first bytes (`None`: it closed or failed).
async fn protocol_of<C: Peekable>(connection: &C) -> Option<Protocol> {
    let mut first = [0u8; DIRECT_MAGIC.len()];
    loop {
        let n = connection.peek(&mut first).await.ok()?;
        if n == 0 {
            return None;
        }
        if first[0] == TLS_HANDSHAKE_RECORD {
            return Some(Protocol::Tls);
        }
        if !DIRECT_MAGIC.starts_with(&first[..n]) {
            return Some(Protocol::Http2);
        }
        if n == DIRECT_MAGIC.len() {
            return Some(Protocol::Direct);
        }
        tokio::time::sleep(PARTIAL_MAGIC_RETRY).await;
    }
}
