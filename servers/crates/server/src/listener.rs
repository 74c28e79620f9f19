//! The listener: accepts at most `CONNECTIONS_MAX` connections at once, each with TCP_NODELAY,
//! and holds a slot for as long as a connection lives (the pools a connection takes places in
//! after that are `pocketflow_flight::route`'s).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use pocketflow_flight::bounds::CONNECTIONS_MAX;
use pocketflow_flight::route::Peekable;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Pause after a failed accept (e.g. out of file descriptors) before trying again.
const ACCEPT_RETRY_MS: u64 = 50;

/// A client connection that holds one of the `CONNECTIONS_MAX` slots.
pub struct Connection {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
}

impl Peekable for Connection {
    fn peek(&self, buf: &mut [u8]) -> impl std::future::Future<Output = io::Result<usize>> + Send {
        self.stream.peek(buf)
    }

    fn peer_ip(&self) -> Option<std::net::IpAddr> {
        self.stream.peer_addr().ok().map(|a| a.ip())
    }
}

impl Connected for Connection {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The stream of accepted connections; waits for a free slot before accepting the next one.
pub fn incoming(listener: TcpListener) -> impl Stream<Item = io::Result<Connection>> {
    let slots = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    futures::stream::unfold((listener, slots), |(listener, slots)| async move {
        let slot = slots
            .clone()
            .acquire_owned()
            .await
            .expect("connection semaphore is never closed");
        let accepted = match listener.accept().await {
            Ok((stream, _peer)) => stream.set_nodelay(true).map(|()| Connection {
                stream,
                _slot: slot,
            }),
            Err(e) => {
                tokio::time::sleep(Duration::from_millis(ACCEPT_RETRY_MS)).await;
                Err(e)
            }
        };
        Some((accepted, (listener, slots)))
    })
}
