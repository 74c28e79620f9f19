//! The DoExchange small-operation session: request frames in, ops run concurrently up to
//! `SESSION_INFLIGHT_MAX`, ready replies coalesced into reply frames out.
//!
//! A session ends with its client: when the request stream breaks the session stops at once,
//! dropping the ops it runs; when the client closes its side, the ops parked on a queue (a
//! dequeue waiting for an item, an enqueue waiting for room) end unanswered, and the others
//! finish. A dequeued item travels in its reply frame with its store guard and stays taken only
//! once the frame is out ([`ReplyFrame::delivered`]); a frame dropped unsent, or one carrying items
//! after the client closed its side, puts them back at the head of their queues.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arrow_flight::FlightData;
use bytes::{BufMut, Bytes, BytesMut};
use futures::stream::{BoxStream, FuturesUnordered};
use futures::{FutureExt, StreamExt};
use pocketflow_protocol::descriptor::ExchangeDescriptor;
use pocketflow_protocol::frame::{
    decode_request_frame, ChannelArgs, OpCode, Reply, ReplyFramePieces, RequestOp, OP_FLAG_SEAL,
    REPLY_FRAME_HEAD_BYTES, STATUS_OK,
};
use pocketflow_protocol::limits::SESSION_INFLIGHT_MAX;
use pocketflow_store::channels::{AppendState, QueueState};
use pocketflow_store::delivery::Undelivered;
use pocketflow_store::Claim;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use crate::auth::Authority;
use crate::bounds::{EXCHANGE_SESSIONS_MAX, REPLY_FRAMES_QUEUED_MAX, REPLY_FRAME_TARGET_BYTES};
use crate::service::{descriptor_cmd, ServiceState};
use crate::status::ServiceError;

/// What a session reads from its client: a request frame, or the end of the requests.
pub(crate) enum Incoming {
    /// A request frame (empty ones are ignored).
    Frame(Bytes),
    /// The request stream broke (reset, cancelled): the session ends without a status.
    Broken,
    /// The client sent something a session cannot take: the session ends with this error.
    Invalid(ServiceError),
}

/// Request frames of a session, from DoExchange messages or from a direct connection.
pub(crate) type IncomingFrames = BoxStream<'static, Incoming>;

/// Reply frames of a session, then the status that ended it, if one did.
pub(crate) type ReplyFrames = mpsc::Receiver<Result<ReplyFrame, Status>>;

/// One reply frame, with the queue items its replies carry until the frame is out.
pub(crate) struct ReplyFrame {
    /// The frame's bytes, in pieces to write one after the other: large bodies are the store's
    /// own bytes, not copied into a frame buffer ([`ReplyFramePieces`]).
    pieces: Vec<Bytes>,
    len_bytes: usize,
    deliveries: Vec<Undelivered>,
    /// Set once the session's client closed its side of the session.
    client_closed: Arc<AtomicBool>,
}

impl ReplyFrame {
    /// The frame's pieces to send (a vectored write sends them without a copy), or `None` when
    /// the frame carries queue items and its client closed its side (a consumer that went
    /// away): dropping the frame then puts them back.
    pub(crate) fn to_send(&self) -> Option<&[Bytes]> {
        let undeliverable =
            !self.deliveries.is_empty() && self.client_closed.load(Ordering::Acquire);
        (!undeliverable).then_some(self.pieces.as_slice())
    }

    /// [`ReplyFrame::to_send`] as one buffer (DoExchange's `app_metadata`): the pieces joined.
    pub(crate) fn to_send_joined(&self) -> Option<Bytes> {
        let pieces = self.to_send()?;
        if let [only] = pieces {
            return Some(only.clone());
        }
        let mut joined = BytesMut::with_capacity(self.len_bytes);
        pieces.iter().for_each(|piece| joined.put_slice(piece));
        Some(joined.freeze())
    }

    /// The frame went out: the items it carries stay taken.
    pub(crate) fn delivered(self) {
        self.deliveries.into_iter().for_each(Undelivered::delivered);
    }
}

/// Open a DoExchange session: authorize its descriptor, then run it on its own task.
pub(crate) async fn open(
    state: Arc<ServiceState>,
    mut input: Streaming<FlightData>,
) -> Result<BoxStream<'static, Result<FlightData, Status>>, ServiceError> {
    let first = match input.next().await {
        Some(Ok(first)) => first,
        Some(Err(_)) => {
            return Err(ServiceError::StreamShape(
                "request stream failed before its first message",
            ))
        }
        None => {
            return Err(ServiceError::StreamShape(
                "DoExchange stream ended before its descriptor",
            ))
        }
    };
    let first_frame = message_frame(&first);
    let descriptor = descriptor_cmd(&first)?;
    let frames = futures::stream::once(async move { first_frame })
        .chain(input.map(|message| match message {
            Ok(data) => message_frame(&data),
            // A message over the size bound is refused by the decoder, not by the peer: the
            // client is still there and gets the refusal as the session's status.
            Err(status) if status.code() == tonic::Code::OutOfRange => {
                Incoming::Invalid(ServiceError::MessageRefused(status.message().to_string()))
            }
            Err(_) => Incoming::Broken,
        }))
        .boxed();
    let replies = start(state, &descriptor, frames)?;
    // A frame counts as out once tonic takes it for the response body.
    Ok(ReceiverStream::new(replies)
        .filter_map(|reply| async move {
            match reply {
                Ok(frame) => {
                    let bytes = frame.to_send_joined()?;
                    frame.delivered();
                    Some(Ok(FlightData {
                        app_metadata: bytes,
                        ..Default::default()
                    }))
                }
                Err(status) => Some(Err(status)),
            }
        })
        .boxed())
}

/// The request frame of one DoExchange message, which carries only app_metadata.
fn message_frame(data: &FlightData) -> Incoming {
    if !data.data_header.is_empty() || !data.data_body.is_empty() {
        return Incoming::Invalid(ServiceError::StreamShape(
            "DoExchange messages carry only app_metadata",
        ));
    }
    Incoming::Frame(data.app_metadata.clone())
}

/// Start a session whose client sent `descriptor` (the exchange descriptor command): authorize
/// it, take one of the server's session slots and run it on its own task over `frames`.
pub(crate) fn start(
    state: Arc<ServiceState>,
    descriptor: &[u8],
    frames: IncomingFrames,
) -> Result<ReplyFrames, ServiceError> {
    let descriptor = ExchangeDescriptor::parse(descriptor)?;
    let (job, token_expiry_unix_ms) = state.auth.job_until(&descriptor.ctx)?;
    let job: Arc<str> = job.into();
    let permit =
        state
            .sessions
            .clone()
            .try_acquire_owned()
            .map_err(|_| ServiceError::ResourceBound {
                what: "exchange sessions",
                max: EXCHANGE_SESSIONS_MAX,
            })?;
    let (tx, rx) = mpsc::channel(REPLY_FRAMES_QUEUED_MAX);
    let (client_closed_tx, _) = watch::channel(false);
    let session = Session {
        state,
        job,
        token_expiry_unix_ms,
        input: frames,
        tx,
        client_closed: Arc::new(AtomicBool::new(false)),
        client_closed_tx,
        _permit: permit,
    };
    tokio::spawn(session.run());
    Ok(rx)
}

/// When a token that expires at `expiry_unix_ms` (wall clock) expires, on tokio's clock.
fn token_expiry_instant(expiry_unix_ms: u64) -> tokio::time::Instant {
    let left_ms = expiry_unix_ms.saturating_sub(pocketflow_protocol::token::now_unix_ms());
    // Far-future tokens are capped so the deadline stays representable.
    tokio::time::Instant::now() + std::time::Duration::from_millis(left_ms.min(u64::from(u32::MAX)))
}

/// One open session; owns the request stream and the reply channel.
struct Session {
    state: Arc<ServiceState>,
    job: Arc<str>,
    /// When the token the session was opened with expires: later frames are refused.
    token_expiry_unix_ms: u64,
    input: IncomingFrames,
    tx: mpsc::Sender<Result<ReplyFrame, Status>>,
    /// Set (and told to the parked ops) once the client closed its side of the session.
    client_closed: Arc<AtomicBool>,
    client_closed_tx: watch::Sender<bool>,
    _permit: OwnedSemaphorePermit,
}

/// An op waiting for an in-flight slot, with the error it already has (stale epoch).
struct PendingOp {
    op: RequestOp,
    stale_map: Option<Arc<str>>,
}

impl Session {
    async fn run(mut self) {
        let mut pending: VecDeque<PendingOp> = VecDeque::new();
        let mut inflight = FuturesUnordered::new();
        let mut input_open = true;
        let mut fatal: Option<Status> = None;
        // The session ends by itself when its token expires, idle or not: a client that holds a
        // renewed token then finds the pooled session ended while idle and opens a new one
        // instead of losing its next call to `permission_denied`.
        let expiry = token_expiry_instant(self.token_expiry_unix_ms);
        let expired = tokio::time::sleep_until(expiry);
        tokio::pin!(expired);
        loop {
            while inflight.len() < SESSION_INFLIGHT_MAX {
                let Some(next) = pending.pop_front() else {
                    break;
                };
                let closed = self.client_closed_tx.subscribe();
                inflight.push(run_op(self.state.clone(), self.job.clone(), next, closed));
            }
            if !input_open && pending.is_empty() && inflight.is_empty() {
                break;
            }
            // Read the next frame only once every op of the previous one has an in-flight slot and
            // the set is below the bound; otherwise the stream is left unread and flow control
            // (HTTP/2's, or TCP's on a direct connection) pushes back on the client.
            let can_read =
                input_open && pending.is_empty() && inflight.len() < SESSION_INFLIGHT_MAX;
            tokio::select! {
                biased;
                Some(answer) = inflight.next(), if !inflight.is_empty() => {
                    // A parked op that ended with its client's side has no reply.
                    let Some(answer) = answer else { continue };
                    let frame = coalesce(answer, &mut inflight, &self.client_closed);
                    if self.tx.send(Ok(frame)).await.is_err() {
                        return; // The client went away; dropping the ops cancels them.
                    }
                }
                incoming = self.input.next(), if can_read => match incoming {
                    Some(Incoming::Frame(frame)) => {
                        if let Err(e) = self.accept_frame(frame, &mut pending) {
                            fatal = Some(e.to_status());
                            input_open = false;
                        }
                    }
                    Some(Incoming::Invalid(e)) => {
                        fatal = Some(e.to_status());
                        input_open = false;
                    }
                    Some(Incoming::Broken) => return,
                    None => {
                        // The client closed its side: its parked queue ops end now.
                        input_open = false;
                        self.client_closed.store(true, Ordering::Release);
                        self.client_closed_tx.send_replace(true);
                    }
                },
                () = &mut expired, if input_open => {
                    if let Err(e) = Authority::check_not_expired(self.token_expiry_unix_ms) {
                        fatal = Some(e.to_status());
                        input_open = false;
                    } else {
                        // Woken a little early (clock steps): wait for the rest.
                        let expiry = token_expiry_instant(self.token_expiry_unix_ms);
                        expired.as_mut().reset(expiry + std::time::Duration::from_millis(1));
                    }
                }
            }
        }
        if let Some(status) = fatal {
            let _ = self.tx.send(Err(status)).await;
        }
    }

    /// Decode one request frame into pending ops; an error ends the session.
    fn accept_frame(
        &self,
        frame: Bytes,
        pending: &mut VecDeque<PendingOp>,
    ) -> Result<(), ServiceError> {
        if frame.is_empty() {
            return Ok(());
        }
        Authority::check_not_expired(self.token_expiry_unix_ms)?;
        let frame = decode_request_frame(&frame)?;
        let stale_map = match self.state.auth.check_epoch(&self.job, frame.epoch) {
            Err(ServiceError::StaleEpoch { map_json }) => Some(map_json),
            _ => None,
        };
        pending.extend(frame.ops.into_iter().map(|op| PendingOp {
            op,
            stale_map: stale_map.clone(),
        }));
        Ok(())
    }
}

/// Pack `first` and every other reply that is ready now into one frame of about
/// `REPLY_FRAME_TARGET_BYTES`, with the queue items the replies carry.
///
/// The ready replies are gathered first and the frame's heads are then written once at their
/// final size (grown reply by reply, a frame of many small objects' bodies was copied again at
/// every doubling of its buffer); large bodies stay where the store holds them, as pieces of
/// their own that a direct connection writes with one vectored write.
fn coalesce<S>(first: Answer, inflight: &mut S, client_closed: &Arc<AtomicBool>) -> ReplyFrame
where
    S: futures::Stream<Item = Option<Answer>> + Unpin,
{
    let mut frame_bytes = REPLY_FRAME_HEAD_BYTES + first.0.encoded_len();
    let mut heads_bytes = ReplyFramePieces::unshared_len(&first.0);
    let mut answers = vec![first];
    // At most SESSION_INFLIGHT_MAX replies are ready, each under EPOCH_MAP_MAX_BYTES plus a
    // small prefix, so a frame below the target always has room for one more.
    while frame_bytes < REPLY_FRAME_TARGET_BYTES && answers.len() < SESSION_INFLIGHT_MAX {
        let answer = match inflight.next().now_or_never() {
            Some(Some(Some(answer))) => answer,
            Some(Some(None)) => continue,
            _ => break,
        };
        frame_bytes += answer.0.encoded_len();
        heads_bytes += ReplyFramePieces::unshared_len(&answer.0);
        answers.push(answer);
    }
    let mut builder = ReplyFramePieces::with_capacity(heads_bytes);
    let mut deliveries = Vec::new();
    for (reply, taken) in answers {
        assert!(builder.fits(&reply), "reply frame bound exceeded");
        builder.push(&reply);
        deliveries.extend(taken);
    }
    let (pieces, len_bytes) = builder.finish();
    debug_assert_eq!(len_bytes, frame_bytes);
    ReplyFrame {
        pieces,
        len_bytes,
        deliveries,
        client_closed: client_closed.clone(),
    }
}

/// A reply, with the queue item it carries if it is a dequeue's.
type Answer = (Reply, Option<Undelivered>);

/// Run one op; `None` when it was parked on a queue and its client closed its side meanwhile.
async fn run_op(
    state: Arc<ServiceState>,
    job: Arc<str>,
    pending: PendingOp,
    mut client_closed: watch::Receiver<bool>,
) -> Option<Answer> {
    let request_id = pending.op.request_id;
    state.stats.counters.add_ops(1);
    let started = std::time::Instant::now();
    let op_name = pending.op.op.name();
    let parks = matches!(pending.op.op, OpCode::Dequeue | OpCode::Enqueue);
    // An UNPIN releases what this process holds whatever the map: it places nothing.
    let stale_map = pending.stale_map.filter(|_| pending.op.op != OpCode::Unpin);
    let result = match stale_map {
        Some(map_json) => Err(ServiceError::StaleEpoch { map_json }),
        None if parks => {
            tokio::select! {
                done = execute(&state, &job, pending.op) => done,
                _ = client_closed.wait_for(|closed| *closed) => return None,
            }
        }
        None => execute(&state, &job, pending.op).await,
    };
    state.metrics.outcome("exchange", op_name, &result, started);
    Some(match result {
        Ok((header, body, taken)) => (
            Reply {
                request_id,
                status: STATUS_OK,
                header,
                body,
            },
            taken,
        ),
        Err(e) => (
            Reply {
                request_id,
                status: e.status_byte(),
                header: None,
                body: e.reply_body(),
            },
            None,
        ),
    })
}

type OpOutcome = (
    Option<pocketflow_protocol::ObjectHeader>,
    Bytes,
    Option<Undelivered>,
);

async fn execute(
    state: &ServiceState,
    job: &str,
    op: RequestOp,
) -> Result<OpOutcome, ServiceError> {
    op.check()?;
    let store = &state.store;
    match op.op {
        OpCode::Put => {
            state.drain.check_write(&state.node_id)?;
            state.auth.check_may_write(job)?;
            if op.persist() && !store.long_running() {
                return Err(ServiceError::PersistRefused {
                    node_id: state.node_id.clone(),
                });
            }
            state.stats.counters.add_in(op.value.len() as u64);
            let overwrite = op.overwrite();
            let replaced = store
                .put_record(job, &op.bucket, &op.key, op.header, op.value, overwrite)
                .await?;
            Ok((replaced, Bytes::new(), None))
        }
        OpCode::Get => {
            let claim = match (op.delete_on_read(), op.claim_whole()) {
                (false, _) => Claim::Never,
                (true, false) => Claim::Always,
                (true, true) => Claim::Whole {
                    inline_bytes_max: 0,
                },
            };
            let (header, value, _) = store
                .get_record_claiming(job, &op.bucket, &op.key, claim)
                .await?;
            state.stats.counters.add_out(value.len() as u64);
            Ok((Some(header), value, None))
        }
        OpCode::Delete => Ok((
            Some(store.delete_record(job, &op.bucket, &op.key)?),
            Bytes::new(),
            None,
        )),
        OpCode::Lookup => Ok((
            Some(store.lookup(job, &op.bucket, &op.key)?),
            Bytes::new(),
            None,
        )),
        OpCode::Pin => {
            let (header, body) = crate::pin::pin(state, job, &op).await?;
            Ok((header, body, None))
        }
        OpCode::Unpin => {
            let (header, body) = crate::pin::unpin(state, job, &op)?;
            Ok((header, body, None))
        }
        _ => execute_channel(state, job, op).await,
    }
}

/// A queue or append-file op; its arguments and results travel as [`ChannelArgs`] in the op's
/// and the reply's header (docs/PROTOCOL.md, "Queues and append files").
async fn execute_channel(
    state: &ServiceState,
    job: &str,
    op: RequestOp,
) -> Result<OpOutcome, ServiceError> {
    let store = &state.store;
    let args = ChannelArgs::of_header(&op.header);
    let (bucket, name, segment) = (op.bucket.as_str(), op.key.as_str(), args.c);
    let queue_reply = |s: QueueState, a: u64| ChannelArgs {
        a,
        b: s.items,
        c: segment,
        d: s.max_items,
        e: u32::from(s.sealed),
    };
    let append_reply = |s: AppendState, a: u64| ChannelArgs {
        a,
        b: s.len_bytes,
        c: segment,
        d: u32::try_from(s.records).unwrap_or(u32::MAX),
        e: u32::from(s.sealed),
    };
    let seal = op.flags & OP_FLAG_SEAL != 0;
    let (reply, body, taken) = match op.op {
        OpCode::Enqueue => {
            state.drain.check_write(&state.node_id)?;
            state.auth.check_may_write(job)?;
            state.stats.counters.add_in(op.value.len() as u64);
            let s = store
                .enqueue(job, bucket, name, segment, args.d, op.value, args.a)
                .await?;
            (queue_reply(s, 0), Bytes::new(), None)
        }
        OpCode::Dequeue => {
            let (item, s) = store.dequeue(job, bucket, name, segment, args.a).await?;
            let present = u64::from(item.is_some());
            let (item, taken) = match item {
                Some((item, taken)) => (item, Some(taken)),
                None => (Bytes::new(), None),
            };
            state.stats.counters.add_out(item.len() as u64);
            (queue_reply(s, present), item, taken)
        }
        OpCode::QueueInfo => {
            let s = store.queue_info(job, bucket, name, segment, seal, args.d)?;
            (queue_reply(s, u64::from(s.exists)), Bytes::new(), None)
        }
        OpCode::Append => {
            state.drain.check_write(&state.node_id)?;
            state.auth.check_may_write(job)?;
            state.stats.counters.add_in(op.value.len() as u64);
            let (offset, index) = store
                .append(job, bucket, name, segment, args.b, op.value)
                .await?;
            let reply = ChannelArgs {
                a: index,
                b: offset,
                c: segment,
                ..Default::default()
            };
            (reply, Bytes::new(), None)
        }
        OpCode::ReadAppend if seal => {
            let s = store.seal_append(job, bucket, name, segment)?;
            (append_reply(s, u64::from(s.exists)), Bytes::new(), None)
        }
        OpCode::ReadAppend => {
            let (bytes, s) = store
                .read_append(job, bucket, name, segment, args.a, args.d)
                .await?;
            state.stats.counters.add_out(bytes.len() as u64);
            (append_reply(s, u64::from(s.exists)), bytes, None)
        }
        OpCode::ReadRecords => {
            let (bytes, count, s) = store
                .read_records(job, bucket, name, segment, args.a, args.d)
                .await?;
            state.stats.counters.add_out(bytes.len() as u64);
            (append_reply(s, count), bytes, None)
        }
        OpCode::Put
        | OpCode::Get
        | OpCode::Delete
        | OpCode::Lookup
        | OpCode::Pin
        | OpCode::Unpin => {
            unreachable!("object ops are run by execute")
        }
    };
    Ok((Some(reply.to_header()), body, taken))
}
