//! One client's connection to one storage server: small operations over pooled DoExchange
//! sessions, data blocks over DoPut and DoGet streams, and actions.

use std::mem::ManuallyDrop;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::Action;
use bytes::Bytes;
use std::collections::HashMap;

use pocketflow_protocol::frame::{
    encode_request_frame, OpCode, Reply, RequestOp, REQUEST_FRAME_HEAD_BYTES,
};
use pocketflow_protocol::header::ObjectHeader;
use pocketflow_protocol::limits::{
    FRAME_MAX_BYTES, FRAME_OPS_MAX, MESSAGE_MAX_BYTES, SESSION_INFLIGHT_MAX,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::config::{
    ConnectionConfig, CONNECTION_WINDOW_BYTES, CONNECT_TIMEOUT_MIN, FRAME_MAX_BYTES_RECEIVED,
    SESSION_REFUSALS_MAX, STREAM_WINDOW_BYTES,
};
use crate::direct::{DirectPool, DirectSession};
use crate::error::ClientError;
use crate::pool::Acquired;
use crate::runtime::runtime_handle;
use crate::session::{Session, SessionFailure, SessionPool};

/// One small operation to send over a session.
#[derive(Debug, Clone)]
pub struct ExchangeRequest {
    /// What to do.
    pub op: OpCode,
    /// Op flag bits.
    pub flags: u8,
    /// Bucket name (UTF-8, checked by the caller).
    pub bucket: String,
    /// Object key (UTF-8, checked by the caller).
    pub key: String,
    /// Object header (PUT only).
    pub header: ObjectHeader,
    /// Value (PUT of a small object only).
    pub value: Bytes,
}

/// The server's answer to one [`ExchangeRequest`].
#[derive(Debug, Clone)]
pub struct ExchangeReply {
    /// 0 OK, else the gRPC code of the error kind.
    pub status: u8,
    /// The object header, when the reply carries one.
    pub header: Option<ObjectHeader>,
    /// The value (GET OK) or `"<kind>: <message>"`.
    pub body: Bytes,
}

pub(crate) struct Inner {
    pub(crate) address: String,
    pub(crate) config: ConnectionConfig,
    pub(crate) client: FlightServiceClient<Channel>,
    pool: SessionPool,
    direct: DirectPool,
    pub(crate) direct_blocks: DirectPool,
    /// Set once the server refused a direct READ (a server older than it): reads then ask for
    /// the record over a session, as before.
    pub(crate) reads_unsupported: AtomicBool,
}

/// Everything one client uses to talk to one storage server.
///
/// A connection belongs to the process that made it: in a forked child it refuses every call
/// (the child makes its own) and is never torn down, since its tasks ran on the parent's threads.
pub struct Connection {
    inner: ManuallyDrop<Inner>,
    pid: u32,
}

impl Connection {
    /// A connection to `address` (`host:port`); the TCP and HTTP/2 connection is made on the
    /// first call, within the first-reply bound.
    pub fn new(address: &str, config: ConnectionConfig) -> Result<Self, ClientError> {
        let scheme = if config.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
            .map_err(|e| ClientError::InvalidArgument(format!("bad address {address:?}: {e}")))?
            .connect_timeout(config.first_reply().max(CONNECT_TIMEOUT_MIN))
            .tcp_nodelay(true)
            .initial_stream_window_size(STREAM_WINDOW_BYTES)
            .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
            .max_frame_size(FRAME_MAX_BYTES_RECEIVED);
        if let Some(tls) = &config.tls {
            let tls_config = ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(tls.ca_pem()))
                .domain_name(crate::tls::host_of(address));
            endpoint = endpoint
                .tls_config(tls_config)
                .map_err(|e| crate::tls::tls_error(address, &e.to_string()))?;
        }
        let handle = runtime_handle();
        let channel = {
            let _entered = handle.enter();
            endpoint.connect_lazy()
        };
        let client = FlightServiceClient::new(channel)
            .max_decoding_message_size(MESSAGE_MAX_BYTES)
            .max_encoding_message_size(MESSAGE_MAX_BYTES);
        Ok(Connection {
            inner: ManuallyDrop::new(Inner {
                address: address.to_string(),
                pool: SessionPool::new(config.sessions_max),
                direct: DirectPool::new(config.sessions_max),
                direct_blocks: DirectPool::new(config.sessions_max),
                reads_unsupported: AtomicBool::new(false),
                config,
                client,
            }),
            pid: crate::runtime::process_id(),
        })
    }

    /// The server's address.
    pub fn address(&self) -> &str {
        &self.inner.address
    }

    pub(crate) fn inner(&self) -> Result<&Inner, ClientError> {
        if crate::runtime::process_id() != self.pid {
            return Err(ClientError::InvalidArgument(
                "this connection was made by the parent of this forked process; \
                 make a new one here"
                    .into(),
            ));
        }
        Ok(&self.inner)
    }

    /// Run `requests` over one pooled session, at most `window` in flight, and return their
    /// replies in request order. `command` is the job's DoExchange descriptor, used if a new
    /// session has to be opened.
    pub async fn exchange(
        &self,
        command: &Bytes,
        epoch: u64,
        requests: &[ExchangeRequest],
        window: usize,
    ) -> Result<Vec<ExchangeReply>, ClientError> {
        let inner = self.inner()?;
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let window = window.clamp(1, SESSION_INFLIGHT_MAX);
        let mut replaced = false;
        let mut fresh = false;
        let mut refusals = 0;
        loop {
            let acquired = inner.pool.acquire(inner.config.patience(), fresh).await?;
            fresh = false;
            let mut session = match acquired {
                Acquired::Idle(session) => session,
                Acquired::OpenNew => {
                    let mut client = inner.client.clone();
                    match Session::open(&mut client, command.clone(), inner.config.first_reply())
                        .await
                    {
                        Ok(session) => Box::new(session),
                        Err(error) => {
                            inner.pool.release(None);
                            if error.is_capacity_exhausted()
                                && refusals < SESSION_REFUSALS_MAX
                                && inner.pool.shrink()
                            {
                                refusals += 1;
                                continue;
                            }
                            return Err(error);
                        }
                    }
                }
            };
            let reused = session.used;
            let first_id = session.take_ids(requests.len());
            let frames = build_frames(first_id, epoch, requests, window);
            let outcome = session
                .run(
                    frames.0,
                    window,
                    inner.config.op_timeout,
                    inner.config.first_reply(),
                )
                .await;
            inner.pool.release(Some(session));
            match outcome {
                Ok(replies) => return Ok(in_request_order(replies, &frames.1)),
                Err(SessionFailure { error, sent }) => {
                    // A pooled session that had gone stale is replaced once, when nothing ran.
                    if replaced || sent || !reused || !error.is_unavailable() {
                        return Err(error);
                    }
                    replaced = true;
                    fresh = true;
                }
            }
        }
    }

    /// Run `requests` like [`Connection::exchange`], blocking the calling thread: over a
    /// direct-exchange session when the config says so (no runtime thread involved), else over
    /// a DoExchange session.
    pub fn exchange_blocking(
        &self,
        command: &Bytes,
        epoch: u64,
        requests: &[ExchangeRequest],
        window: usize,
    ) -> Result<Vec<ExchangeReply>, ClientError> {
        let inner = self.inner()?;
        if !inner.config.direct {
            return crate::block_on(self.exchange(command, epoch, requests, window));
        }
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let window = window.clamp(1, SESSION_INFLIGHT_MAX);
        let mut replaced = false;
        let mut fresh = false;
        let mut refusals = 0;
        loop {
            let acquired = inner.direct.acquire(inner.config.patience(), fresh)?;
            fresh = false;
            let mut session = match acquired {
                Acquired::Idle(session) => session,
                Acquired::OpenNew => {
                    match DirectSession::open(
                        &inner.address,
                        command,
                        inner.config.first_reply(),
                        inner.config.tls.as_ref(),
                    ) {
                        Ok(session) => Box::new(session),
                        Err(error) => {
                            inner.direct.release(None);
                            if error.is_capacity_exhausted()
                                && refusals < SESSION_REFUSALS_MAX
                                && inner.direct.shrink()
                            {
                                refusals += 1;
                                continue;
                            }
                            return Err(error);
                        }
                    }
                }
            };
            let reused = session.used;
            let first_id = session.take_ids(requests.len());
            let frames = build_frames(first_id, epoch, requests, window);
            let outcome = session.run(
                frames.0,
                window,
                inner.config.op_timeout,
                inner.config.first_reply(),
            );
            inner.direct.release(Some(session));
            match outcome {
                Ok(replies) => return Ok(in_request_order(replies, &frames.1)),
                Err(SessionFailure { error, sent }) => {
                    // A pooled session that had gone stale is replaced once, when nothing ran.
                    if replaced || sent || !reused || !error.is_unavailable() {
                        return Err(error);
                    }
                    replaced = true;
                    fresh = true;
                }
            }
        }
    }

    /// Open small-operation sessions (of the kind [`Connection::exchange_blocking`] uses) until
    /// the pool holds `count` (at most its bound), kept idle for the next concurrent callers.
    /// Returns the sessions pooled.
    pub fn warm_blocking(&self, command: &Bytes, count: usize) -> Result<usize, ClientError> {
        let inner = self.inner()?;
        if !inner.config.direct {
            return crate::block_on(self.warm(command, count));
        }
        let count = count.min(inner.config.sessions_max);
        let mut held = Vec::with_capacity(count);
        let mut failure = None;
        for _ in 0..count {
            match inner.direct.acquire(inner.config.patience(), false) {
                Ok(Acquired::Idle(session)) => held.push(session),
                Ok(Acquired::OpenNew) => {
                    match DirectSession::open(
                        &inner.address,
                        command,
                        inner.config.first_reply(),
                        inner.config.tls.as_ref(),
                    ) {
                        Ok(session) => held.push(Box::new(session)),
                        Err(error) => {
                            inner.direct.release(None);
                            failure = Some(error);
                            break;
                        }
                    }
                }
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            }
        }
        let pooled = held.len();
        for session in held {
            inner.direct.release(Some(session));
        }
        match failure {
            Some(error) => Err(error),
            None => Ok(pooled),
        }
    }

    /// Open sessions until the pool holds `count` (at most its bound) and keep them idle, so
    /// that the next `count` concurrent callers find one ready. Returns the sessions pooled.
    pub async fn warm(&self, command: &Bytes, count: usize) -> Result<usize, ClientError> {
        let inner = self.inner()?;
        let count = count.min(inner.config.sessions_max);
        let mut held = Vec::with_capacity(count);
        let mut failure = None;
        for _ in 0..count {
            match inner.pool.acquire(inner.config.patience(), false).await {
                Ok(Acquired::Idle(session)) => held.push(session),
                Ok(Acquired::OpenNew) => {
                    let mut client = inner.client.clone();
                    match Session::open(&mut client, command.clone(), inner.config.first_reply())
                        .await
                    {
                        Ok(session) => held.push(Box::new(session)),
                        Err(error) => {
                            inner.pool.release(None);
                            failure = Some(error);
                            break;
                        }
                    }
                }
                Err(error) => {
                    failure = Some(error);
                    break;
                }
            }
        }
        let pooled = held.len();
        for session in held {
            inner.pool.release(Some(session));
        }
        match failure {
            Some(error) => Err(error),
            None => Ok(pooled),
        }
    }

    /// Run one DoAction and return its first result body (empty when there is none), within
    /// the connection's `rpc_timeout`.
    pub async fn action(&self, name: &str, body: Bytes) -> Result<Bytes, ClientError> {
        let bound = self.inner()?.config.rpc_timeout;
        self.action_within(name, body, bound).await
    }

    /// [`Connection::action`] within `bound` instead of the connection's `rpc_timeout`: a call
    /// that must not outlive what it protects (a lease renewal) fails as unavailable sooner.
    pub async fn action_within(
        &self,
        name: &str,
        body: Bytes,
        bound: Duration,
    ) -> Result<Bytes, ClientError> {
        let inner = self.inner()?;
        let mut client = inner.client.clone();
        let call = async move {
            let mut results = client
                .do_action(Action {
                    r#type: name.to_string(),
                    body,
                })
                .await?
                .into_inner();
            let mut first = Bytes::new();
            while let Some(result) = results.message().await? {
                if first.is_empty() {
                    first = result.body;
                }
            }
            Ok::<Bytes, tonic::Status>(first)
        };
        match tokio::time::timeout(bound, call).await {
            Ok(result) => result.map_err(ClientError::from),
            Err(_) => Err(ClientError::Unavailable(format!(
                "action {name} got no answer within {:.1}s",
                bound.as_secs_f64()
            ))),
        }
    }

    /// Close every idle session; calls in flight on other threads finish or fail.
    pub fn close(&self) {
        if let Ok(inner) = self.inner() {
            inner.pool.close();
            inner.direct.close();
            inner.direct_blocks.close();
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if crate::runtime::process_id() == self.pid {
            // SAFETY: dropped exactly once, here; in a forked child it is leaked instead.
            unsafe { ManuallyDrop::drop(&mut self.inner) }
        }
    }
}

/// The replies of `ids` (in request order), taken from the replies by request id.
fn in_request_order(mut replies: HashMap<u64, Reply>, ids: &[u64]) -> Vec<ExchangeReply> {
    ids.iter()
        .map(|id| {
            let reply = replies.remove(id).expect("every op was answered");
            ExchangeReply {
                status: reply.status,
                header: reply.header,
                body: reply.body,
            }
        })
        .collect()
}

/// Encode `requests` into frames with ids from `first_id` on: at most `FRAME_OPS_MAX` ops,
/// `FRAME_MAX_BYTES` and `window` ops per frame. Returns the frames and the ids in request order.
fn build_frames(
    first_id: u64,
    epoch: u64,
    requests: &[ExchangeRequest],
    window: usize,
) -> (Vec<(Bytes, Vec<u64>)>, Vec<u64>) {
    let ops_max = window.min(FRAME_OPS_MAX as usize);
    let mut frames = Vec::new();
    let mut ids_in_order = Vec::with_capacity(requests.len());
    let mut ops: Vec<RequestOp> = Vec::new();
    let mut ids: Vec<u64> = Vec::new();
    let mut size = REQUEST_FRAME_HEAD_BYTES;
    for (i, request) in requests.iter().enumerate() {
        let op = RequestOp {
            request_id: first_id + i as u64,
            op: request.op,
            flags: request.flags,
            bucket: request.bucket.clone(),
            key: request.key.clone(),
            header: request.header,
            value: request.value.clone(),
        };
        let len = op.encoded_len();
        if !ops.is_empty() && (ops.len() == ops_max || size + len > FRAME_MAX_BYTES) {
            frames.push((encode_request_frame(epoch, &ops), std::mem::take(&mut ids)));
            ops.clear();
            size = REQUEST_FRAME_HEAD_BYTES;
        }
        size += len;
        ids.push(op.request_id);
        ids_in_order.push(op.request_id);
        ops.push(op);
    }
    frames.push((encode_request_frame(epoch, &ops), ids));
    (frames, ids_in_order)
}
