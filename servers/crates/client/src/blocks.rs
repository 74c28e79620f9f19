//! Data blocks: DoPut streams that write them and DoGet streams that read ranges of them
//! straight into the caller's memory.

use arrow_flight::flight_descriptor::DescriptorType;
use arrow_flight::{FlightData, FlightDescriptor, Ticket};
use bytes::Bytes;
use pocketflow_protocol::batch::{GetPieceMeta, PutPieceMeta};
use pocketflow_protocol::ipc::{decode_piece, encode_piece, is_schema_message, schema_flight_data};
use pocketflow_protocol::limits::{BATCH_MAX_BYTES, BLOCK_SIZE_MAX_BYTES};
use std::sync::atomic::Ordering;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::config::PUT_PIECES_QUEUED_MAX;
use crate::connection::{Connection, ExchangeReply};
use crate::direct::DirectSession;
use crate::error::ClientError;
use crate::pool::Acquired;
use crate::reads::Destination;
use crate::session::SessionFailure;

/// One block to write: its index (>= 1) and its bytes, borrowed from the caller.
#[derive(Debug, Clone, Copy)]
pub struct BlockSlice<'a> {
    /// Block index.
    pub index: u32,
    /// The block's bytes.
    pub data: &'a [u8],
}

impl<'a> BlockSlice<'a> {
    /// An object's bytes cut into its data blocks `1..`, each `block_size` bytes but the last.
    pub fn cut(data: &'a [u8], block_size: usize) -> impl Iterator<Item = BlockSlice<'a>> {
        data.chunks(block_size)
            .enumerate()
            .map(|(i, data)| BlockSlice {
                index: i as u32 + 1,
                data,
            })
    }
}

/// Where the bytes of one ticket range go: `[block, offset in block, length]` of the ticket and
/// the position in the destination of its first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RangeTarget {
    /// Block index.
    pub block: u32,
    /// Offset in the block.
    pub offset: u64,
    /// Bytes of the range.
    pub len: u64,
    /// Destination position of the range's first byte.
    pub dest_at: usize,
}

/// What a DoGet moved: the bytes received per range (in ticket order), and the error that ended
/// it early, if any (the counts then tell which ranges are complete).
#[derive(Debug)]
pub struct ReadOutcome {
    /// Bytes received for each range.
    pub received: Vec<u64>,
    /// Why the stream ended before every range was complete.
    pub error: Option<ClientError>,
}

/// What a READ (`Connection::read_object_blocking`) brought: the record's reply (for a small
/// object whose destination refused it, with its value as the body), the object's bytes placed
/// in the destination, and the error that ended the read after the reply, if any.
#[derive(Debug)]
pub struct ObjectRead {
    /// The record's reply: status, header, error text.
    pub reply: ExchangeReply,
    /// The object's bytes placed in the destination.
    pub received: u64,
    /// Why the read ended before its END.
    pub error: Option<ClientError>,
}

impl Connection {
    /// Write `blocks` of one object version over one DoPut stream described by `command`;
    /// returns the server's JSON result (`{"blocks": n, "bytes": total}`).
    ///
    /// Each block goes as pieces of at most `BATCH_MAX_BYTES`, encoded on the calling thread
    /// (one copy, into the message body) at most `PUT_PIECES_QUEUED_MAX` ahead of the stream.
    pub async fn put_blocks(
        &self,
        command: Bytes,
        blocks: &[BlockSlice<'_>],
    ) -> Result<Bytes, ClientError> {
        let inner = self.inner()?;
        let nbytes: u64 = blocks.iter().map(|b| b.data.len() as u64).sum();
        let deadline = inner.config.stream_deadline(nbytes);
        let (tx, rx) = mpsc::channel::<FlightData>(PUT_PIECES_QUEUED_MAX);
        let mut opening = schema_flight_data();
        opening.flight_descriptor = Some(FlightDescriptor {
            r#type: DescriptorType::Cmd as i32,
            cmd: command,
            path: vec![],
        });
        let mut client = inner.client.clone();
        let call = async move {
            let response = client.do_put(ReceiverStream::new(rx)).await?;
            let mut results = response.into_inner();
            let mut first = Bytes::new();
            while let Some(result) = results.message().await? {
                if first.is_empty() {
                    first = result.app_metadata;
                }
            }
            Ok::<Bytes, tonic::Status>(first)
        };
        let feed = async move {
            if tx.send(opening).await.is_err() {
                return;
            }
            for block in blocks {
                let meta = Bytes::copy_from_slice(
                    &PutPieceMeta {
                        block_index: block.index,
                        block_len: block.data.len() as u64,
                    }
                    .encode(),
                );
                for piece in block.data.chunks(BATCH_MAX_BYTES as usize) {
                    if tx.send(encode_piece(piece, meta.clone())).await.is_err() {
                        // The call ended (its status says why).
                        return;
                    }
                }
            }
        };
        let both = async { tokio::join!(call, feed).0 };
        match tokio::time::timeout(deadline, both).await {
            Ok(result) => result.map_err(ClientError::from),
            Err(_) => Err(ClientError::Unavailable(format!(
                "DoPut of {nbytes} bytes did not finish within {:.1}s",
                deadline.as_secs_f64()
            ))),
        }
    }

    /// Read the ranges of a DoGet `ticket`, each into its own destination (`dests[i]`, of
    /// exactly `ranges[i].len` bytes: disjoint slices, so no two writers alias).
    ///
    /// Pieces arrive in ticket order; each is copied once, from the received message into
    /// `dest`. Every wait for a piece is bounded by the op timeout, the whole stream by the
    /// stream deadline. A failure after some ranges arrived is returned with their counts.
    pub async fn get_ranges(
        &self,
        ticket: Bytes,
        ranges: &[RangeTarget],
        dests: &mut [&mut [u8]],
    ) -> Result<ReadOutcome, ClientError> {
        let inner = self.inner()?;
        check_ranges(ranges, dests)?;
        let nbytes: u64 = ranges.iter().map(|r| r.len).sum();
        let deadline = tokio::time::Instant::now() + inner.config.stream_deadline(nbytes);
        let op_timeout = inner.config.op_timeout;
        let mut received = vec![0u64; ranges.len()];
        let mut client = inner.client.clone();
        let opened = tokio::time::timeout_at(deadline, client.do_get(Ticket { ticket })).await;
        let mut stream = match opened {
            Err(_) => {
                return Err(ClientError::Unavailable(
                    "DoGet got no answer before its deadline".into(),
                ))
            }
            Ok(result) => result.map_err(ClientError::from)?.into_inner(),
        };
        let mut current = 0usize;
        loop {
            let bound = (tokio::time::Instant::now() + op_timeout).min(deadline);
            let message = match tokio::time::timeout_at(bound, stream.message()).await {
                Err(_) => {
                    let error = ClientError::Unavailable(format!(
                        "no data for {:.1}s; stream cancelled",
                        op_timeout.as_secs_f64()
                    ));
                    return Ok(ReadOutcome {
                        received,
                        error: Some(error),
                    });
                }
                Ok(Err(status)) => {
                    return Ok(ReadOutcome {
                        received,
                        error: Some(ClientError::from(status)),
                    })
                }
                Ok(Ok(None)) => break,
                Ok(Ok(Some(message))) => message,
            };
            if is_schema_message(&message.data_header) {
                continue;
            }
            let meta = GetPieceMeta::decode(&message.app_metadata)
                .map_err(|e| ClientError::Protocol(format!("DoGet piece metadata: {e}")))?;
            let piece = decode_piece(&message.data_header, &message.data_body)
                .map_err(|e| ClientError::Protocol(format!("DoGet piece: {e}")))?;
            if piece.len() as u64 != meta.len {
                return Err(ClientError::Protocol(format!(
                    "DoGet piece of block {} has {} bytes, metadata says {}",
                    meta.block_index,
                    piece.len(),
                    meta.len
                )));
            }
            // Pieces come in ticket order: find the range this one belongs to.
            while current < ranges.len() && !contains(&ranges[current], &meta) {
                current += 1;
            }
            let Some(range) = ranges.get(current) else {
                return Err(ClientError::Protocol(format!(
                    "DoGet piece of block {} at {} is in no range of the ticket",
                    meta.block_index, meta.offset
                )));
            };
            let at = (meta.offset - range.offset) as usize;
            dests[current][at..at + piece.len()].copy_from_slice(&piece);
            received[current] += meta.len;
        }
        Ok(ReadOutcome {
            received,
            error: None,
        })
    }
}

/// Split `dest` into one slice per range (`ranges` in `dest_at` order, not overlapping): the
/// slice of each range starts at its `dest_at` and holds its `len` bytes. The slices are
/// disjoint, so each can be written by a thread of its own.
pub fn split_dest<'d>(
    dest: &'d mut [u8],
    ranges: &[&RangeTarget],
) -> Result<Vec<&'d mut [u8]>, ClientError> {
    let mut pieces = Vec::with_capacity(ranges.len());
    let (mut rest, mut at) = (dest, 0usize);
    for range in ranges {
        let len = usize::try_from(range.len).unwrap_or(usize::MAX);
        let fits = range.dest_at >= at
            && (range.dest_at - at)
                .checked_add(len)
                .is_some_and(|end| end <= rest.len());
        if !fits {
            return Err(ClientError::InvalidArgument(format!(
                "range of block {} ({} bytes at {}) does not fit the destination",
                range.block, range.len, range.dest_at
            )));
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(range.dest_at - at);
        let (piece, after) = tail.split_at_mut(len);
        pieces.push(piece);
        rest = after;
        at = range.dest_at + len;
    }
    Ok(pieces)
}

/// Refuse ranges whose destinations are missing or not of their length.
fn check_ranges(ranges: &[RangeTarget], dests: &[&mut [u8]]) -> Result<(), ClientError> {
    if dests.len() != ranges.len() {
        return Err(ClientError::InvalidArgument(format!(
            "{} destinations for {} ranges",
            dests.len(),
            ranges.len()
        )));
    }
    for (range, dest) in ranges.iter().zip(dests) {
        if dest.len() as u64 != range.len {
            return Err(ClientError::InvalidArgument(format!(
                "range of block {} ({} bytes) has a destination of {} bytes",
                range.block,
                range.len,
                dest.len()
            )));
        }
    }
    Ok(())
}

impl Connection {
    /// Read a ticket's ranges like [`Connection::get_ranges`], blocking the calling thread: over
    /// a direct connection when the config says so (raw bytes read straight into `dest`, no
    /// runtime thread), else over DoGet.
    pub fn get_ranges_blocking(
        &self,
        ticket: Bytes,
        ranges: &[RangeTarget],
        dests: &mut [&mut [u8]],
    ) -> Result<ReadOutcome, ClientError> {
        let inner = self.inner()?;
        if !inner.config.direct {
            return crate::block_on(self.get_ranges(ticket, ranges, dests));
        }
        check_ranges(ranges, dests)?;
        let nbytes: u64 = ranges.iter().map(|r| r.len).sum();
        let op_timeout = inner.config.op_timeout;
        self.on_block_connection(nbytes, |connection, deadline| {
            connection.get_ranges(&ticket, ranges, dests, op_timeout, deadline)
        })
    }
}

impl Connection {
    /// Read an object whole with a direct READ `ticket` (docs/PROTOCOL.md, "Direct exchange"):
    /// its record and, for a small object or an object of one data block kept with its
    /// manifest, its bytes into `dest`, in one round trip on a block connection. `Ok(None)`
    /// when this connection does not read so (Flight only, or a server without READ): the
    /// caller then asks for the record over a session.
    pub fn read_object_blocking(
        &self,
        ticket: &[u8],
        dest: &mut dyn Destination,
    ) -> Result<Option<ObjectRead>, ClientError> {
        let inner = self.inner()?;
        if !inner.config.direct || inner.reads_unsupported.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let op_timeout = inner.config.op_timeout;
        let read = self
            .on_block_connection(u64::from(BLOCK_SIZE_MAX_BYTES), |connection, deadline| {
                connection.read_object(ticket, &mut *dest, op_timeout, deadline)
            });
        match read {
            // A server older than READ refuses the message kind (and nothing ran there).
            Err(error) if is_unknown_kind(&error) => {
                inner.reads_unsupported.store(true, Ordering::Relaxed);
                Ok(None)
            }
            other => other.map(Some),
        }
    }
}

/// Whether `error` is a server's refusal of a direct message kind it does not know.
fn is_unknown_kind(error: &ClientError) -> bool {
    matches!(error, ClientError::Server { code, message }
        if *code == tonic::Code::InvalidArgument as i32 && message.contains("unknown message kind"))
}

impl Connection {
    /// Write data blocks like [`Connection::put_blocks`], blocking the calling thread: over a
    /// direct connection when the config says so (each block written from the caller's memory
    /// straight to the socket), else over DoPut.
    pub fn put_blocks_blocking(
        &self,
        command: Bytes,
        blocks: &[BlockSlice<'_>],
    ) -> Result<Bytes, ClientError> {
        let inner = self.inner()?;
        if !inner.config.direct {
            return crate::block_on(self.put_blocks(command, blocks));
        }
        let nbytes: u64 = blocks.iter().map(|b| b.data.len() as u64).sum();
        let op_timeout = inner.config.op_timeout;
        self.on_block_connection(nbytes, |connection, deadline| {
            connection.put_blocks(&command, blocks, op_timeout, deadline)
        })
    }

    /// Run one transfer of `nbytes` on a pooled block connection within the stream deadline;
    /// a pooled connection that had gone stale is replaced once, when nothing was sent.
    fn on_block_connection<T>(
        &self,
        nbytes: u64,
        mut transfer: impl FnMut(&mut DirectSession, std::time::Instant) -> Result<T, SessionFailure>,
    ) -> Result<T, ClientError> {
        let inner = self.inner()?;
        let deadline = std::time::Instant::now() + inner.config.stream_deadline(nbytes);
        let mut fresh = false;
        loop {
            let mut connection = self.block_connection(fresh)?;
            let reused = connection.used;
            let outcome = transfer(&mut connection, deadline);
            inner.direct_blocks.release(Some(connection));
            match outcome {
                Ok(done) => return Ok(done),
                Err(SessionFailure { error, sent }) => {
                    if fresh || sent || !reused {
                        return Err(error);
                    }
                    fresh = true;
                }
            }
        }
    }

    /// A pooled block connection, or a new one (`fresh`: retire the idle ones first).
    fn block_connection(&self, fresh: bool) -> Result<Box<DirectSession>, ClientError> {
        let inner = self.inner()?;
        match inner
            .direct_blocks
            .acquire(inner.config.patience(), fresh)?
        {
            Acquired::Idle(connection) => Ok(connection),
            Acquired::OpenNew => {
                match DirectSession::connect(
                    &inner.address,
                    inner.config.first_reply(),
                    inner.config.op_timeout,
                    inner.config.tls.as_ref(),
                ) {
                    Ok(connection) => Ok(Box::new(connection)),
                    Err(error) => {
                        inner.direct_blocks.release(None);
                        Err(error)
                    }
                }
            }
        }
    }
}

pub(crate) fn contains(range: &RangeTarget, piece: &GetPieceMeta) -> bool {
    piece.block_index == range.block
        && piece.offset >= range.offset
        && piece.offset + piece.len <= range.offset + range.len
}
