//! DoGet on the wire, below tonic's codec: the HTTP service tonic serves answers DoGet itself
//! (every other RPC goes to the generated Flight server) and frames each piece by hand, so the
//! piece's bytes reach hyper as the store's own `Bytes` instead of being copied into a body.
//!
//! tonic encodes every message into its own buffer (`EncodeBuf` over a `BytesMut`), so even a
//! `FlightData` whose `data_body` is the store's `Bytes` would be copied once there. Here a
//! piece's gRPC message is three chunks of the HTTP/2 body: a small head freshly encoded (gRPC
//! prefix, `data_header`, `app_metadata`, the `data_body` key and length, the IPC offsets), the
//! value itself, and the IPC padding. The bytes on the wire are exactly those tonic would send
//! for the same `FlightData`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};

use arrow_flight::flight_service_server::FlightServiceServer;
use arrow_flight::{FlightData, Ticket};
use bytes::{BufMut, Bytes, BytesMut};
use futures::stream::BoxStream;
use futures::StreamExt;
use http_body::Frame;
use pocketflow_protocol::ipc::{schema_flight_data, PieceFrame};
use pocketflow_protocol::limits::MESSAGE_MAX_BYTES;
use prost::Message;
use tonic::body::Body;
use tonic::codec::{Codec, Streaming};
use tonic::codegen::http::{self, HeaderMap, HeaderValue};
use tonic::codegen::{BoxFuture, Service};
use tonic::server::NamedService;
use tonic::Status;

use crate::activity::{CountedBody, Http2Info};
use crate::doget::{self, Answer};
use crate::request_start::StartBy;
use crate::service::{ServiceState, StorageService};

/// The path of the DoGet RPC.
const DO_GET_PATH: &str = "/arrow.flight.protocol.FlightService/DoGet";

/// Bytes of the prefix of every gRPC message: a compression flag and a big-endian length.
const GRPC_PREFIX_BYTES: usize = 5;

/// The key of `FlightData.data_body` (field 1000, length-delimited) as a protobuf varint.
const DATA_BODY_KEY: [u8; 2] = [0xc2, 0x3e];

/// Values at most this long are copied into their message's head: one small chunk costs less
/// than three HTTP/2 DATA frames.
const INLINE_VALUE_MAX_BYTES: usize = 16 * 1024;

/// Zeros that pad a piece's body to 8 bytes.
static PADDING: [u8; 8] = [0; 8];

/// The HTTP service of the storage server: the generated Flight server, with DoGet answered by
/// [`answer_do_get`].
#[derive(Clone)]
pub struct FlightServer {
    generated: FlightServiceServer<StorageService>,
    state: Arc<ServiceState>,
}

impl FlightServer {
    pub(crate) fn new(
        generated: FlightServiceServer<StorageService>,
        state: Arc<ServiceState>,
    ) -> Self {
        Self { generated, state }
    }
}

impl NamedService for FlightServer {
    const NAME: &'static str = <FlightServiceServer<StorageService> as NamedService>::NAME;
}

impl Service<http::Request<Body>> for FlightServer {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Service::<http::Request<Body>>::poll_ready(&mut self.generated, cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        // The stream counts on its connection until its response body is done or dropped.
        let stream = request
            .extensions()
            .get::<Http2Info>()
            .map(|info| info.activity.begin());
        // A stream that opens and sends nothing is failed at a bound, so it ends.
        let request = request.map(|body| Body::new(StartBy::new(body)));
        if request.uri().path() != DO_GET_PATH {
            let answer = self.generated.call(request);
            return Box::pin(async move {
                let response = answer.await?;
                Ok(response.map(|body| Body::new(CountedBody::new(body, stream))))
            });
        }
        let state = self.state.clone();
        Box::pin(async move {
            let response = answer_do_get(state, request.into_body()).await;
            Ok(response.map(|body| Body::new(CountedBody::new(body, stream))))
        })
    }
}

/// Answer one DoGet: read its ticket, then stream the answer as [`DoGetBody`]. A failure before
/// the first message is a trailers-only response, as tonic would send it.
async fn answer_do_get(state: Arc<ServiceState>, request: Body) -> http::Response<Body> {
    let started = std::time::Instant::now();
    let ticket = match read_ticket(request).await {
        Ok(ticket) => ticket,
        Err(status) => return status.into_http(),
    };
    let answers = doget::get(state.clone(), ticket).await;
    state.metrics.outcome("do_get", "get", &answers, started);
    match answers {
        Ok(answers) => {
            let mut response = http::Response::new(Body::new(DoGetBody::new(answers)));
            response.headers_mut().insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            );
            response
        }
        Err(e) => e.to_status().into_http(),
    }
}

/// The ticket of a DoGet request, decoded by tonic's own request decoder (gRPC framing, the
/// `MESSAGE_MAX_BYTES` bound). A request without a message is an empty ticket, which fails to
/// parse as a typed invalid argument.
async fn read_ticket(body: Body) -> Result<Bytes, Status> {
    let decoder = tonic_prost::ProstCodec::<Ticket, Ticket>::default().decoder();
    let mut request = Streaming::new_request(decoder, body, None, Some(MESSAGE_MAX_BYTES));
    Ok(request
        .message()
        .await?
        .map(|ticket| ticket.ticket)
        .unwrap_or_default())
}

/// The gRPC prefix of a message of `len` bytes (uncompressed).
fn grpc_prefix(len: usize) -> [u8; GRPC_PREFIX_BYTES] {
    let len = u32::try_from(len).expect("a DoGet message is at most MESSAGE_MAX_BYTES");
    let mut prefix = [0u8; GRPC_PREFIX_BYTES];
    prefix[1..].copy_from_slice(&len.to_be_bytes());
    prefix
}

/// The schema message, gRPC-framed (made once).
fn schema_message() -> Bytes {
    static SCHEMA: OnceLock<Bytes> = OnceLock::new();
    SCHEMA
        .get_or_init(|| {
            let data = schema_flight_data();
            let mut out = BytesMut::with_capacity(GRPC_PREFIX_BYTES + data.encoded_len());
            out.put_slice(&grpc_prefix(data.encoded_len()));
            data.encode(&mut out).expect("the buffer has room");
            out.freeze()
        })
        .clone()
}

/// One answer as the chunks of its gRPC message, in order (one to three).
fn message_chunks(answer: Answer, out: &mut VecDeque<Bytes>) {
    let (meta, value) = match answer {
        Answer::Schema => {
            out.push_back(schema_message());
            return;
        }
        Answer::Piece { meta, value } => (meta, value),
    };
    let frame = PieceFrame::new(value.len());
    let body_len = frame.body_len(value.len());
    // Fields 2 and 3 as prost encodes them (it skips the empty `data_body`), then field 1000
    // by hand, its value starting with the IPC offsets.
    let fields = FlightData {
        flight_descriptor: None,
        data_header: frame.data_header,
        app_metadata: Bytes::copy_from_slice(&meta.encode()),
        data_body: Bytes::new(),
    };
    let body_len_bytes = prost::length_delimiter_len(body_len);
    let message_len = fields.encoded_len() + DATA_BODY_KEY.len() + body_len_bytes + body_len;
    let inline = value.len() <= INLINE_VALUE_MAX_BYTES;
    let head_len = GRPC_PREFIX_BYTES + message_len - body_len + frame.body_prefix.len();
    let mut head = BytesMut::with_capacity(head_len + if inline { value.len() + 8 } else { 0 });
    head.put_slice(&grpc_prefix(message_len));
    fields.encode(&mut head).expect("the buffer has room");
    head.put_slice(&DATA_BODY_KEY);
    prost::encode_length_delimiter(body_len, &mut head).expect("the buffer has room");
    head.put_slice(&frame.body_prefix);
    debug_assert_eq!(head.len(), head_len);
    let padding = &PADDING[..frame.padding_bytes];
    if inline {
        head.put_slice(&value);
        head.put_slice(padding);
        out.push_back(head.freeze());
        return;
    }
    out.push_back(head.freeze());
    out.push_back(value);
    if !padding.is_empty() {
        out.push_back(Bytes::from_static(padding));
    }
}

/// The HTTP/2 body of a DoGet answer: each answer's chunks, then trailers with its status
/// (`grpc-status: 0` after the last answer, or the failure that ended the stream).
struct DoGetBody {
    answers: Option<BoxStream<'static, Result<Answer, Status>>>,
    /// Chunks of the current message not yet handed to hyper.
    queued: VecDeque<Bytes>,
}

impl DoGetBody {
    fn new(answers: BoxStream<'static, Result<Answer, Status>>) -> Self {
        Self {
            answers: Some(answers),
            queued: VecDeque::with_capacity(3),
        }
    }
}

/// Trailers that end a DoGet with `status` (`None`: success).
fn trailers(status: Option<Status>) -> HeaderMap {
    let mut trailers = HeaderMap::new();
    match status {
        None => {
            trailers.insert("grpc-status", HeaderValue::from_static("0"));
        }
        Some(status) => {
            if status.add_header(&mut trailers).is_err() {
                trailers.clear();
                let _ = Status::internal("DoGet status does not fit in trailers")
                    .add_header(&mut trailers);
            }
        }
    }
    trailers
}

impl http_body::Body for DoGetBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if let Some(chunk) = this.queued.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        let Some(answers) = this.answers.as_mut() else {
            return Poll::Ready(None);
        };
        let ended = match ready!(answers.poll_next_unpin(cx)) {
            Some(Ok(answer)) => {
                message_chunks(answer, &mut this.queued);
                let chunk = this.queued.pop_front().expect("a message has a chunk");
                return Poll::Ready(Some(Ok(Frame::data(chunk))));
            }
            Some(Err(status)) => Some(status),
            None => None,
        };
        // The stream is over (a DoGet ends at its first failure): release the transfer now.
        this.answers = None;
        Poll::Ready(Some(Ok(Frame::trailers(trailers(ended)))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body as _;
    use pocketflow_protocol::batch::GetPieceMeta;
    use pocketflow_protocol::ipc::decode_piece;

    fn piece(len: usize) -> Answer {
        Answer::Piece {
            meta: GetPieceMeta {
                block_index: 3,
                offset: 4 << 20,
                len: len as u64,
            },
            value: Bytes::from((0..len).map(|i| (i * 7) as u8).collect::<Vec<u8>>()),
        }
    }

    /// What tonic would send for `answer`: its `FlightData`, gRPC-framed.
    fn as_tonic_sends(answer: Answer) -> Vec<u8> {
        let data = answer.into_flight_data();
        let mut out = grpc_prefix(data.encoded_len()).to_vec();
        data.encode(&mut out).unwrap();
        out
    }

    #[test]
    fn messages_are_the_bytes_tonic_would_send() {
        for len in [
            0,
            1,
            7,
            8,
            13,
            INLINE_VALUE_MAX_BYTES,
            INLINE_VALUE_MAX_BYTES + 3,
            1 << 20,
        ] {
            let mut chunks = VecDeque::new();
            message_chunks(piece(len), &mut chunks);
            let wire: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
            assert_eq!(wire, as_tonic_sends(piece(len)), "a value of {len} bytes");
            let expected_chunks = if len <= INLINE_VALUE_MAX_BYTES {
                1
            } else if len % 8 == 0 {
                2
            } else {
                3
            };
            assert_eq!(chunks.len(), expected_chunks, "a value of {len} bytes");
        }
        let mut chunks = VecDeque::new();
        message_chunks(Answer::Schema, &mut chunks);
        assert_eq!(chunks[0].to_vec(), as_tonic_sends(Answer::Schema));
    }

    #[test]
    fn a_large_value_is_sent_as_the_stores_own_bytes() {
        let answer = piece(1 << 20);
        let Answer::Piece { value, .. } = answer.clone() else {
            unreachable!()
        };
        let mut chunks = VecDeque::new();
        message_chunks(answer, &mut chunks);
        assert_eq!(chunks[1].as_ptr(), value.as_ptr(), "no copy of the value");
        // The whole message still decodes as one FlightData whose piece is the value.
        let wire: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
        let data = FlightData::decode(&wire[GRPC_PREFIX_BYTES..]).unwrap();
        assert_eq!(
            decode_piece(&data.data_header, &data.data_body).unwrap(),
            value
        );
    }

    #[tokio::test]
    async fn the_body_ends_with_the_status_of_the_stream() {
        let answers = futures::stream::iter([
            Ok(Answer::Schema),
            Ok(piece(20_000)),
            Err(Status::not_found("not_found: gone")),
        ])
        .boxed();
        let mut body = DoGetBody::new(answers);
        let mut data = 0;
        let trailers = loop {
            let frame = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx))
                .await
                .unwrap()
                .unwrap();
            match frame.into_data() {
                Ok(chunk) => data += chunk.len(),
                Err(frame) => break frame.into_trailers().unwrap(),
            }
        };
        assert_eq!(
            data,
            as_tonic_sends(Answer::Schema).len() + as_tonic_sends(piece(20_000)).len()
        );
        assert_eq!(trailers["grpc-status"], "5");
        assert_eq!(trailers["grpc-message"], "not_found:%20gone");
        assert!(
            std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx))
                .await
                .is_none()
        );
    }
}
