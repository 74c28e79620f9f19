//! The DoExchange small-operation session: request frames in, ops run concurrently up to
//! `SESSION_INFLIGHT_MAX`, ready replies coalesced into reply frames out.

use std::collections::VecDeque;
use std::sync::Arc;

use arrow_flight::FlightData;
use bytes::Bytes;
use futures::stream::{BoxStream, FuturesUnordered};
use futures::{FutureExt, StreamExt};
use pocketflow_protocol::descriptor::ExchangeDescriptor;
use pocketflow_protocol::frame::{
    decode_request_frame, OpCode, Reply, ReplyFrameBuilder, RequestOp, STATUS_OK,
};
use pocketflow_protocol::limits::SESSION_INFLIGHT_MAX;
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use crate::auth::Authority;
use crate::bounds::{EXCHANGE_SESSIONS_MAX, REPLY_FRAMES_QUEUED_MAX, REPLY_FRAME_TARGET_BYTES};
use crate::service::{descriptor_cmd, ServiceState};
use crate::status::ServiceError;

/// Open a session: authorize its descriptor, then run it on its own task.
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
    let descriptor = ExchangeDescriptor::parse(&descriptor_cmd(&first)?)?;
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
    let session = Session {
        state,
        job,
        token_expiry_unix_ms,
        input,
        tx,
        _permit: permit,
    };
    tokio::spawn(session.run(first));
    Ok(ReceiverStream::new(rx).boxed())
}

/// One open session; owns the request stream and the reply channel.
struct Session {
    state: Arc<ServiceState>,
    job: Arc<str>,
    /// When the token the session was opened with expires: later frames are refused.
    token_expiry_unix_ms: u64,
    input: Streaming<FlightData>,
    tx: mpsc::Sender<Result<FlightData, Status>>,
    _permit: OwnedSemaphorePermit,
}

/// An op waiting for an in-flight slot, with the error it already has (stale epoch).
struct PendingOp {
    op: RequestOp,
    stale_map: Option<Arc<str>>,
}

impl Session {
    async fn run(mut self, first: FlightData) {
        let mut pending: VecDeque<PendingOp> = VecDeque::new();
        let mut inflight = FuturesUnordered::new();
        let mut input_open = true;
        let mut fatal: Option<Status> = None;
        if let Err(e) = self.accept_message(first, &mut pending) {
            fatal = Some(e.to_status());
            input_open = false;
        }
        loop {
            while inflight.len() < SESSION_INFLIGHT_MAX {
                let Some(next) = pending.pop_front() else {
                    break;
                };
                inflight.push(run_op(self.state.clone(), self.job.clone(), next));
            }
            if !input_open && pending.is_empty() && inflight.is_empty() {
                break;
            }
            // Read the next frame only once every op of the previous one has an in-flight slot and
            // the set is below the bound; otherwise the stream is left unread and HTTP/2 flow
            // control pushes back on the client.
            let can_read =
                input_open && pending.is_empty() && inflight.len() < SESSION_INFLIGHT_MAX;
            tokio::select! {
                biased;
                Some(reply) = inflight.next(), if !inflight.is_empty() => {
                    let frame = coalesce(reply, &mut inflight);
                    let message = FlightData { app_metadata: frame, ..Default::default() };
                    if self.tx.send(Ok(message)).await.is_err() {
                        return; // The client went away; dropping the ops cancels them.
                    }
                }
                message = self.input.next(), if can_read => match message {
                    Some(Ok(data)) => {
                        if let Err(e) = self.accept_message(data, &mut pending) {
                            fatal = Some(e.to_status());
                            input_open = false;
                        }
                    }
                    Some(Err(_)) => return, // The request stream broke (reset, cancel).
                    None => input_open = false,
                },
            }
        }
        if let Some(status) = fatal {
            let _ = self.tx.send(Err(status)).await;
        }
    }

    /// Decode one message's frame into pending ops; an error ends the session.
    fn accept_message(
        &self,
        data: FlightData,
        pending: &mut VecDeque<PendingOp>,
    ) -> Result<(), ServiceError> {
        if !data.data_header.is_empty() || !data.data_body.is_empty() {
            return Err(ServiceError::StreamShape(
                "DoExchange messages carry only app_metadata",
            ));
        }
        if data.app_metadata.is_empty() {
            return Ok(());
        }
        Authority::check_not_expired(self.token_expiry_unix_ms)?;
        let frame = decode_request_frame(&data.app_metadata)?;
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
/// `REPLY_FRAME_TARGET_BYTES`.
fn coalesce<S>(first: Reply, inflight: &mut S) -> Bytes
where
    S: futures::Stream<Item = Reply> + Unpin,
{
    let mut builder = ReplyFrameBuilder::new();
    builder.push(&first);
    while builder.len_bytes() < REPLY_FRAME_TARGET_BYTES {
        let Some(Some(reply)) = inflight.next().now_or_never() else {
            break;
        };
        // At most SESSION_INFLIGHT_MAX replies are ready, each under EPOCH_MAP_MAX_BYTES plus a
        // small prefix, so a frame below the target always has room for one more.
        assert!(builder.fits(&reply), "reply frame bound exceeded");
        builder.push(&reply);
    }
    builder.finish()
}

async fn run_op(state: Arc<ServiceState>, job: Arc<str>, pending: PendingOp) -> Reply {
    let request_id = pending.op.request_id;
    state.stats.counters.add_ops(1);
    let result = match pending.stale_map {
        Some(map_json) => Err(ServiceError::StaleEpoch { map_json }),
        None => execute(&state, &job, pending.op).await,
    };
    match result {
        Ok((header, body)) => Reply {
            request_id,
            status: STATUS_OK,
            header,
            body,
        },
        Err(e) => Reply {
            request_id,
            status: e.status_byte(),
            header: None,
            body: e.reply_body(),
        },
    }
}

type OpOutcome = (Option<pocketflow_protocol::ObjectHeader>, Bytes);

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
            Ok((replaced, Bytes::new()))
        }
        OpCode::Get => {
            let (header, value) = store
                .get_record(job, &op.bucket, &op.key, op.delete_on_read())
                .await?;
            state.stats.counters.add_out(value.len() as u64);
            Ok((Some(header), value))
        }
        OpCode::Delete => Ok((
            Some(store.delete_record(job, &op.bucket, &op.key)?),
            Bytes::new(),
        )),
        OpCode::Lookup => Ok((Some(store.lookup(job, &op.bucket, &op.key)?), Bytes::new())),
    }
}
