//! A request stream must carry its first frame within [`REQUEST_START_TIMEOUT`]: a stream that
//! opens (its HEADERS arrive) and then sends nothing is failed at the bound. Until then it counts
//! as in flight on its connection (`crate::activity`), which keeps the connection from its idle
//! bound; without the deadline, one silent stream held its connection, and its place among
//! `HTTP2_CONNECTIONS_MAX`, for as long as the peer liked. Once a request has sent a frame, its
//! RPC's own bounds apply (a DoPut's transfer idle time, a session's token expiry).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame;
use tokio::time::Sleep;
use tonic::Status;

use crate::bounds::REQUEST_START_TIMEOUT;
use crate::status::ServiceError;

/// A request body that fails if its first frame (data or trailers) or its end does not arrive
/// within [`REQUEST_START_TIMEOUT`] of the request.
pub struct StartBy<B> {
    inner: B,
    /// Until the first frame: when the request fails.
    timer: Option<Pin<Box<Sleep>>>,
}

impl<B> StartBy<B> {
    /// `inner`, whose first frame must come within the bound from now.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            timer: Some(Box::pin(tokio::time::sleep(REQUEST_START_TIMEOUT))),
        }
    }
}

impl<B> http_body::Body for StartBy<B>
where
    B: http_body::Body<Data = Bytes, Error = Status> + Unpin,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.timer = None;
                Poll::Ready(frame)
            }
            Poll::Pending => {
                let expired = this
                    .timer
                    .as_mut()
                    .is_some_and(|timer| timer.as_mut().poll(cx).is_ready());
                if !expired {
                    return Poll::Pending;
                }
                this.timer = None;
                let silent = ServiceError::RequestSilent {
                    timeout_ms: REQUEST_START_TIMEOUT.as_millis() as u64,
                };
                Poll::Ready(Some(Err(silent.to_status())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
