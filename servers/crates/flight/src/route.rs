//! One port, two protocols: every accepted connection is HTTP/2 (Arrow Flight, whose clients
//! open with `PRI * HTTP/2.0`) or the direct exchange (which opens with `DIRECT_MAGIC`). Its
//! first bytes decide; a connection that sends nothing within the open bound is closed.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use pocketflow_protocol::direct::DIRECT_MAGIC;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

use crate::bounds::HTTP2_CONNECTIONS_MAX;
use crate::direct::DIRECT_OPEN_TIMEOUT;
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

/// Pause before looking again at a connection that sent only part of the magic so far.
const PARTIAL_MAGIC_RETRY: Duration = Duration::from_millis(1);

/// HTTP/2 connections handed to tonic that it has not taken yet.
const HTTP2_QUEUED_MAX: usize = 64;

/// An HTTP/2 connection for tonic, holding one of the `HTTP2_CONNECTIONS_MAX` slots while it
/// lives (a direct connection holds a session slot instead).
pub struct Http2Connection<C> {
    inner: C,
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
}

/// The HTTP/2 connections of `incoming`, for tonic, at most `HTTP2_CONNECTIONS_MAX` at once
/// (further ones wait for a slot); direct-exchange connections are served by `service` on tasks
/// of their own.
pub fn route<C: Peekable + Connected>(
    incoming: impl Stream<Item = io::Result<C>> + Send + 'static,
    service: StorageService,
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
            tokio::spawn(async move {
                match tokio::time::timeout(DIRECT_OPEN_TIMEOUT, protocol_of(&connection)).await {
                    Ok(Some(Protocol::Http2)) => {
                        let Ok(slot) = http2_slots.acquire_owned().await else {
                            return;
                        };
                        let connection = Http2Connection {
                            inner: connection,
                            _slot: slot,
                        };
                        let _ = tx.send(Ok(connection)).await;
                    }
                    Ok(Some(Protocol::Direct)) => service.serve_direct(connection).await,
                    // Closed, failed, or silent for the whole bound: dropping it closes it.
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
        if !DIRECT_MAGIC.starts_with(&first[..n]) {
            return Some(Protocol::Http2);
        }
        if n == DIRECT_MAGIC.len() {
            return Some(Protocol::Direct);
        }
        tokio::time::sleep(PARTIAL_MAGIC_RETRY).await;
    }
}
