//! One port, two protocols: every accepted connection is HTTP/2 (Arrow Flight, whose clients
//! open with `PRI * HTTP/2.0`) or the direct exchange (which opens with `DIRECT_MAGIC`). Its
//! first bytes decide. Its whole handshake is bounded (`crate::handshake`): a connection that
//! has not opened its protocol within `HANDSHAKE_TIMEOUT` is closed, and connections in their
//! handshake take places of their own pool (bounded per peer address too), never those of
//! connections being served.
//!
//! With TLS, every connection must open with a TLS handshake, and the protocol agreed by ALPN
//! decides instead (`h2` or `pocketflow-direct`). A plaintext connection to a TLS listener is
//! told why it is refused, in its own protocol (`crate::refusal`): a direct client gets a
//! `permission_denied` status, an HTTP/2 client the same status as the answer to its first
//! request, then a GOAWAY with `INADEQUATE_SECURITY`.

use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use pocketflow_protocol::direct::{DIRECT_ALPN, DIRECT_MAGIC};
use pocketflow_protocol::opening::{first_bytes, FirstBytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

use crate::activity::{Activity, Http2Info, IdleWatch};
use crate::bounds::{
    HANDSHAKES_MAX, HTTP2_CONNECTIONS_MAX, PEER_HANDSHAKES_MAX, PEER_HTTP2_CONNECTIONS_MAX,
};
use crate::handshake::{read_http2_opening, Opening, Replayed};
use crate::peers::{PeerCounts, PeerPlace};
pub use crate::refusal::TLS_REQUIRED_MESSAGE;
use crate::refusal::{refuse_plaintext_direct, refuse_plaintext_http2, refuse_tls};
use crate::service::StorageService;

/// An accepted connection whose first bytes can be looked at without taking them.
pub trait Peekable: AsyncRead + AsyncWrite + Send + Sync + Unpin + 'static {
    /// Copy the bytes received so far (up to `buf.len()`) without consuming them.
    fn peek(&self, buf: &mut [u8]) -> impl Future<Output = io::Result<usize>> + Send;

    /// The peer's address, for the per-peer bounds (`None`: unknown, not bounded per peer).
    fn peer_ip(&self) -> Option<IpAddr>;
}

impl Peekable for tokio::net::TcpStream {
    fn peek(&self, buf: &mut [u8]) -> impl Future<Output = io::Result<usize>> + Send {
        tokio::net::TcpStream::peek(self, buf)
    }

    fn peer_ip(&self) -> Option<IpAddr> {
        self.peer_addr().ok().map(|a| a.ip())
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

/// An HTTP/2 connection for tonic, holding one of the `HTTP2_CONNECTIONS_MAX` places (and one
/// of its peer's `PEER_HTTP2_CONNECTIONS_MAX`) while it lives (a direct connection holds a
/// session slot instead). Its preface and first SETTINGS frame, read during the handshake, are
/// read again by hyper.
///
/// A connection with no stream in flight for the service's connection idle bound is closed
/// (its reader fails, which ends hyper's connection): its streams are counted by the HTTP
/// service through the connection's [`Http2Info`].
pub struct Http2Connection<C> {
    inner: Replayed<Link<C>>,
    info: Http2Info,
    idle: IdleWatch,
    _slot: OwnedSemaphorePermit,
    _peer_place: Option<PeerPlace>,
}

impl<C: Connected> Connected for Http2Connection<C> {
    type ConnectInfo = Http2Info;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

impl<C: Peekable> AsyncRead for Http2Connection<C> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Pending if self.idle.poll_expired(cx) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no stream on the connection for its idle bound",
            ))),
            polled => polled,
        }
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

/// The HTTP/2 connections of `incoming`, for tonic, at most `HTTP2_CONNECTIONS_MAX` at once
/// (further ones wait for a place until their handshake's deadline); direct-exchange
/// connections are served by `service` on tasks of their own. A connection past the handshake
/// pool's bounds (`HANDSHAKES_MAX`; once it is half full, a peer's `PEER_HANDSHAKES_MAX`) is
/// closed as it comes.
pub fn route<C: Peekable + Connected>(
    incoming: impl Stream<Item = io::Result<C>> + Send + 'static,
    service: StorageService,
    tls: Option<TlsAcceptor>,
) -> impl Stream<Item = io::Result<Http2Connection<C>>> {
    let (tx, rx) = mpsc::channel(HTTP2_QUEUED_MAX);
    let pools = Pools {
        handshakes: Arc::new(Semaphore::new(HANDSHAKES_MAX)),
        peer_handshakes: Arc::new(PeerCounts::default()),
        http2: Arc::new(Semaphore::new(HTTP2_CONNECTIONS_MAX)),
        peer_http2: Arc::new(PeerCounts::default()),
    };
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
            // Past the handshake pool's bounds: dropped, that is closed, before any work.
            let Some(opening) = pools.opening(connection.peer_ip()) else {
                continue;
            };
            let tx = tx.clone();
            let service = service.clone();
            let pools = pools.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let deadline = opening.deadline();
                let peer = connection.peer_ip();
                // The first bytes, then (with TLS) the handshake, by the deadline.
                let opened = tokio::time::timeout_at(deadline, async {
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
                    Ok(Some((Protocol::Direct, link))) => service.serve_direct(link, opening).await,
                    Ok(Some((_, link))) => {
                        // The preface and SETTINGS, then a place, by the same deadline.
                        let served = tokio::time::timeout_at(deadline, async {
                            let mut link = link;
                            let first = read_http2_opening(&mut link).await?;
                            let peer_place = match peer {
                                Some(ip) => Some(pools.http2_place(ip).await),
                                None => None,
                            };
                            let slot = pools.http2.clone().acquire_owned().await.ok()?;
                            let activity = Activity::new();
                            Some(Http2Connection {
                                inner: Replayed::new(first, link),
                                info: Http2Info {
                                    activity: activity.clone(),
                                },
                                idle: IdleWatch::new(activity, service.connection_idle()),
                                _slot: slot,
                                _peer_place: peer_place,
                            })
                        })
                        .await;
                        drop(opening);
                        if let Ok(Some(connection)) = served {
                            let _ = tx.send(Ok(connection)).await;
                        }
                    }
                    // Closed, failed, refused, or not opened in time: dropping closes it.
                    Ok(None) | Err(_) => {}
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

/// The pools a connection takes places in: the handshake pool while it opens, then (HTTP/2) a
/// served connection's place.
#[derive(Clone)]
struct Pools {
    handshakes: Arc<Semaphore>,
    peer_handshakes: Arc<PeerCounts>,
    http2: Arc<Semaphore>,
    peer_http2: Arc<PeerCounts>,
}

/// How often an HTTP/2 connection whose peer holds all its places looks again for one.
const PEER_PLACE_RETRY: Duration = Duration::from_millis(50);

impl Pools {
    /// Places in the handshake pool for a new connection from `peer`, or `None` past a bound:
    /// the pool's, or (once the pool is half full) the peer's share.
    fn opening(&self, peer: Option<IpAddr>) -> Option<Opening> {
        let place = self.handshakes.clone().try_acquire_owned().ok()?;
        let peer_place = match peer {
            Some(ip) => {
                // While the pool is at most half full any peer may take more than its share;
                // past that each keeps to its share, so a flood from one address leaves half.
                let bound = if self.handshakes.available_permits() >= HANDSHAKES_MAX / 2 {
                    HANDSHAKES_MAX
                } else {
                    PEER_HANDSHAKES_MAX
                };
                Some(PeerCounts::enter(&self.peer_handshakes, ip, bound)?)
            }
            None => None,
        };
        Some(Opening::new(place, peer_place))
    }

    /// One of `peer`'s HTTP/2 places, once it has one free (the caller bounds the wait).
    async fn http2_place(&self, peer: IpAddr) -> PeerPlace {
        loop {
            if let Some(place) =
                PeerCounts::enter(&self.peer_http2, peer, PEER_HTTP2_CONNECTIONS_MAX)
            {
                return place;
            }
            tokio::time::sleep(PEER_PLACE_RETRY).await;
        }
    }
}

/// Which protocol the connection speaks, from its first bytes (`None`: it closed or failed).
async fn protocol_of<C: Peekable>(connection: &C) -> Option<Protocol> {
    let mut first = [0u8; DIRECT_MAGIC.len()];
    loop {
        let n = connection.peek(&mut first).await.ok()?;
        if n == 0 {
            return None;
        }
        match first_bytes(&first[..n]) {
            FirstBytes::Tls => return Some(Protocol::Tls),
            FirstBytes::Http2 => return Some(Protocol::Http2),
            FirstBytes::Direct => return Some(Protocol::Direct),
            FirstBytes::NeedMore => tokio::time::sleep(PARTIAL_MAGIC_RETRY).await,
        }
    }
}
