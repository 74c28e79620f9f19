//! DoExchange sessions: one open stream of small operations, and the bounded pool of them that a
//! connection keeps per server.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use arrow_flight::flight_descriptor::DescriptorType;
use arrow_flight::{FlightData, FlightDescriptor};
use bytes::Bytes;
use futures::FutureExt;
use pocketflow_protocol::frame::{decode_reply_frame, Reply};
use tokio::sync::{mpsc, Notify};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::error::ClientError;
use crate::pool::{no_free_session, Acquired, PoolState, Pooled};

/// Request frames queued ahead of the HTTP/2 stream of one session.
const SESSION_SEND_QUEUE_MAX: usize = 4;

/// How a session failed: the error, and whether any operation may have run.
#[derive(Debug)]
pub(crate) struct SessionFailure {
    pub(crate) error: ClientError,
    pub(crate) sent: bool,
}

impl SessionFailure {
    pub(crate) fn new(error: ClientError, sent: bool) -> Self {
        SessionFailure { error, sent }
    }
}

/// One open DoExchange stream, used by one caller at a time.
pub(crate) struct Session {
    tx: mpsc::Sender<FlightData>,
    rx: Streaming<FlightData>,
    next_id: u64,
    /// Whether an operation already ran on it (a reused session may have gone stale).
    pub(crate) used: bool,
    /// Whether it must not be reused.
    pub(crate) broken: bool,
}

impl Session {
    /// Open a session with the job's descriptor command; waits for the server's answer.
    pub(crate) async fn open(
        client: &mut arrow_flight::flight_service_client::FlightServiceClient<
            tonic::transport::Channel,
        >,
        command: Bytes,
        timeout: Duration,
    ) -> Result<Session, ClientError> {
        let (tx, rx) = mpsc::channel(SESSION_SEND_QUEUE_MAX);
        let opening = FlightData {
            flight_descriptor: Some(FlightDescriptor {
                r#type: DescriptorType::Cmd as i32,
                cmd: command,
                path: vec![],
            }),
            ..Default::default()
        };
        tx.send(opening)
            .await
            .map_err(|_| ClientError::Unavailable("session queue closed".into()))?;
        let call = client.do_exchange(ReceiverStream::new(rx));
        let response = match tokio::time::timeout(timeout, call).await {
            Ok(result) => result?,
            Err(_) => {
                return Err(ClientError::Unavailable(format!(
                    "no answer to a new session within {:.1}s",
                    timeout.as_secs_f64()
                )))
            }
        };
        Ok(Session {
            tx,
            rx: response.into_inner(),
            next_id: 1,
            used: false,
            broken: false,
        })
    }

    /// Whether the stream already ended or failed while idle (a pooled session gone stale).
    fn ended_while_idle(&mut self) -> bool {
        self.rx.message().now_or_never().is_some()
    }

    async fn send(&mut self, frame: Bytes, sent_before: bool) -> Result<(), SessionFailure> {
        let message = FlightData {
            app_metadata: frame,
            ..Default::default()
        };
        if self.tx.send(message).await.is_err() {
            self.broken = true;
            let error = self.status_after_failure().await;
            return Err(SessionFailure::new(error, sent_before));
        }
        Ok(())
    }

    /// The status that ended the stream, read after a failed send.
    async fn status_after_failure(&mut self) -> ClientError {
        let bound = Duration::from_millis(500);
        match tokio::time::timeout(bound, self.rx.message()).await {
            Ok(Err(status)) => ClientError::from(status),
            _ => ClientError::Unavailable("the server ended the session".into()),
        }
    }

    async fn receive(&mut self, timeout: Duration) -> Result<Vec<Reply>, SessionFailure> {
        let message = match tokio::time::timeout(timeout, self.rx.message()).await {
            Err(_) => {
                self.broken = true;
                return Err(SessionFailure::new(
                    ClientError::Unavailable(format!(
                        "no reply within {:.1}s; session cancelled",
                        timeout.as_secs_f64()
                    )),
                    true,
                ));
            }
            Ok(Err(status)) => {
                self.broken = true;
                return Err(SessionFailure::new(ClientError::from(status), true));
            }
            Ok(Ok(None)) => {
                self.broken = true;
                return Err(SessionFailure::new(
                    ClientError::Unavailable("the server ended the session".into()),
                    true,
                ));
            }
            Ok(Ok(Some(message))) => message,
        };
        if message.app_metadata.is_empty() {
            return Err(self.violation("the server sent a message without app_metadata"));
        }
        decode_reply_frame(&message.app_metadata).map_err(|e| self.violation(&e.to_string()))
    }

    fn violation(&mut self, what: &str) -> SessionFailure {
        self.broken = true;
        SessionFailure::new(ClientError::Protocol(what.to_string()), true)
    }

    /// Run `frames` of ops (already encoded with request ids from [`Session::take_ids`]),
    /// keeping at most `window` ops in flight; returns the replies by request id.
    pub(crate) async fn run(
        &mut self,
        frames: Vec<(Bytes, Vec<u64>)>,
        window: usize,
        op_timeout: Duration,
        first_reply_timeout: Duration,
    ) -> Result<HashMap<u64, Reply>, SessionFailure> {
        let stale = self.used && self.ended_while_idle();
        if stale {
            self.broken = true;
            return Err(SessionFailure::new(
                ClientError::Unavailable("the pooled session had ended".into()),
                false,
            ));
        }
        let mut first = !self.used;
        self.used = true;
        let total: usize = frames.iter().map(|(_, ids)| ids.len()).sum();
        let mut replies: HashMap<u64, Reply> = HashMap::with_capacity(total);
        let mut pending: HashMap<u64, ()> = HashMap::with_capacity(window.min(total));
        let mut frames = frames.into_iter().peekable();
        let mut sent_any = false;
        while frames.peek().is_some() || !pending.is_empty() {
            if let Some((_, ids)) = frames.peek() {
                if pending.is_empty() || pending.len() + ids.len() <= window {
                    let (frame, ids) = frames.next().expect("peeked");
                    self.send(frame, sent_any).await?;
                    sent_any = true;
                    for id in ids {
                        pending.insert(id, ());
                    }
                    continue;
                }
            }
            let bound = if first {
                first_reply_timeout
            } else {
                op_timeout
            };
            let batch = self.receive(bound).await?;
            first = false;
            for reply in batch {
                if pending.remove(&reply.request_id).is_none() {
                    return Err(self.violation(&format!(
                        "reply for unknown request id {}",
                        reply.request_id
                    )));
                }
                replies.insert(reply.request_id, reply);
            }
        }
        Ok(replies)
    }

    /// Reserve `count` consecutive request ids; returns the first.
    pub(crate) fn take_ids(&mut self, count: usize) -> u64 {
        let first = self.next_id;
        self.next_id += count as u64;
        first
    }
}

impl Pooled for Session {
    fn broken(&self) -> bool {
        self.broken
    }
}

/// The idle sessions of one connection; opens new ones up to a bound, then makes callers wait.
pub(crate) struct SessionPool {
    state: Mutex<PoolState<Session>>,
    freed: Notify,
}

impl SessionPool {
    pub(crate) fn new(limit: usize) -> Self {
        SessionPool {
            state: Mutex::new(PoolState::new(limit)),
            freed: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState<Session>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An idle session, or a slot to open one; waits up to `patience` when all are in use.
    /// `fresh` first retires every idle session (they may all be stale).
    pub(crate) async fn acquire(
        &self,
        patience: Duration,
        fresh: bool,
    ) -> Result<Acquired<Session>, ClientError> {
        if fresh {
            self.lock().retire_idle();
        }
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(acquired) = self.lock().try_acquire()? {
                return Ok(acquired);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(no_free_session(patience));
            }
        }
    }

    /// Give back a session (or the slot of one that failed to open, with `None`).
    pub(crate) fn release(&self, session: Option<Box<Session>>) {
        self.lock().release(session);
        self.freed.notify_one();
    }

    /// After the server refused a new session: keep to the sessions already open, if any.
    /// Returns whether the caller should wait for one of them.
    pub(crate) fn shrink(&self) -> bool {
        self.lock().shrink()
    }

    /// Drop every idle session and refuse new acquisitions.
    pub(crate) fn close(&self) {
        let idle = self.lock().close();
        drop(idle);
        self.freed.notify_waiters();
    }
}
