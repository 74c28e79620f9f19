//! Streams in flight on one HTTP/2 connection, and since when it has had none. A connection
//! that carries no stream for the idle bound is closed ([`IdleWatch`]): hyper's keepalive pings
//! keep a vanished peer from holding a place, not a live one that answers them and asks nothing.
//! A pooled DoExchange session is a stream, so a client's idle sessions keep their connection.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::{Instant, Sleep};

/// The streams of one connection: how many are in flight, and when the last one ended.
pub struct Activity {
    born: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds from `born` to when the connection last had no stream in flight.
    idle_since_ms: AtomicU64,
}

/// What tonic gives each request of an HTTP/2 connection (its `ConnectInfo`): the connection's
/// [`Activity`], which the HTTP service counts the request's stream in.
#[derive(Clone)]
pub struct Http2Info {
    /// The connection's streams.
    pub activity: Arc<Activity>,
}

/// One stream in flight; counted until dropped (with the response body that carries it).
pub struct StreamGuard(Arc<Activity>);

impl Activity {
    /// A connection that has had no stream yet.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            born: Instant::now(),
            in_flight: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
        })
    }

    /// Count one more stream in flight until the guard is dropped.
    pub fn begin(self: &Arc<Self>) -> StreamGuard {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        StreamGuard(self.clone())
    }

    /// When the connection will have been idle for `idle`; `None` while a stream is in flight.
    fn idle_deadline(&self, idle: Duration) -> Option<Instant> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let since = Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire));
        Some(self.born + since + idle)
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let activity = &self.0;
        let now_ms = activity.born.elapsed().as_millis() as u64;
        if activity.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            activity.idle_since_ms.fetch_max(now_ms, Ordering::AcqRel);
        }
    }
}

/// The idle bound of one connection, checked whenever its reader waits.
pub struct IdleWatch {
    activity: Arc<Activity>,
    idle: Duration,
    timer: Pin<Box<Sleep>>,
}

impl IdleWatch {
    /// Watch `activity` for `idle` without a stream.
    pub fn new(activity: Arc<Activity>, idle: Duration) -> Self {
        Self {
            timer: Box::pin(tokio::time::sleep(idle)),
            activity,
            idle,
        }
    }

    /// Whether the connection has been idle for the bound; if not, `cx` is woken when it may be.
    pub fn poll_expired(&mut self, cx: &mut Context<'_>) -> bool {
        loop {
            let deadline = match self.activity.idle_deadline(self.idle) {
                Some(deadline) if deadline <= Instant::now() => return true,
                Some(deadline) => deadline,
                // Busy: look again a bound from now.
                None => Instant::now() + self.idle,
            };
            if self.timer.deadline() != deadline {
                self.timer.as_mut().reset(deadline);
            }
            if self.timer.as_mut().poll(cx).is_pending() {
                return false;
            }
        }
    }
}

/// A response body that keeps its stream counted in flight until it is done or dropped.
pub struct CountedBody<B> {
    inner: B,
    _stream: Option<StreamGuard>,
}

impl<B> CountedBody<B> {
    /// `inner`, counted by `stream` (none: a connection that is not counted).
    pub fn new(inner: B, stream: Option<StreamGuard>) -> Self {
        Self {
            inner,
            _stream: stream,
        }
    }
}

impl<B> http_body::Body for CountedBody<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_connection_expires_only_after_the_bound_without_a_stream() {
        let activity = Activity::new();
        let mut watch = IdleWatch::new(activity.clone(), Duration::from_secs(10));
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(!watch.poll_expired(&mut cx));
        tokio::time::advance(Duration::from_secs(6)).await;
        let stream = activity.begin();
        tokio::time::advance(Duration::from_secs(20)).await;
        assert!(!watch.poll_expired(&mut cx), "a stream in flight keeps it");
        drop(stream);
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(!watch.poll_expired(&mut cx), "idle 9 s of 10");
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(watch.poll_expired(&mut cx));
    }
}
