//! DoGet of block ranges: the schema message, then each range as one-row batches of at most
//! `BATCH_MAX_BYTES`, optionally removing each block once its last range is sent. The pieces are
//! the store's own bytes; `doget_wire` puts them on the wire without copying them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arrow_flight::FlightData;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use pocketflow_protocol::batch::GetPieceMeta;
use pocketflow_protocol::limits::BATCH_MAX_BYTES;
use pocketflow_protocol::ticket::GetTicket;
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::bounds::{GET_PIECES_QUEUED_MAX, NVME_DIRECT_PIECE_BYTES, NVME_DIRECT_READS_AHEAD_MAX};
use crate::ipc::{encode_piece, schema_flight_data};
use crate::service::ServiceState;
use crate::status::ServiceError;

/// One message of a DoGet answer, before it is put on the wire.
#[derive(Clone, Debug)]
pub(crate) enum Answer {
    /// The schema message that opens the stream.
    Schema,
    /// One piece of a range: where it lies, and its bytes as the store holds them (no copy;
    /// they hold their space in the store until dropped).
    Piece {
        /// Block, offset and length, sent as the message's app metadata.
        meta: GetPieceMeta,
        /// The bytes.
        value: Bytes,
    },
}

impl Answer {
    /// As a `FlightData`, the piece copied into the message body (for tonic's own codec).
    pub(crate) fn into_flight_data(self) -> FlightData {
        match self {
            Answer::Schema => schema_flight_data(),
            Answer::Piece { meta, value } => {
                encode_piece(&value, Bytes::copy_from_slice(&meta.encode()))
            }
        }
    }
}

/// One piece to send: a slice of a range.
#[derive(Clone, Copy, Debug)]
struct Piece {
    range_at: usize,
    index: u32,
    offset: u64,
    len: u64,
}

/// The ticket's ranges cut into pieces of at most `piece_bytes_max`, in order.
fn pieces(
    ticket: &GetTicket,
    piece_bytes_max: u64,
) -> impl Iterator<Item = Piece> + Send + 'static {
    assert!(piece_bytes_max > 0, "pieces hold at least one byte");
    let ranges = ticket.ranges.clone();
    ranges
        .into_iter()
        .enumerate()
        .flat_map(move |(range_at, range)| {
            let count = range.len().div_ceil(piece_bytes_max).max(1);
            (0..count).map(move |i| {
                let start = i * piece_bytes_max;
                Piece {
                    range_at,
                    index: range.index(),
                    offset: range.offset() + start,
                    len: (range.len() - start).min(piece_bytes_max),
                }
            })
        })
}

/// A DoGet in progress; holds its transfer slot until the last piece is queued.
///
/// With `delete`, dropping it removes every block the ticket names, so a stream that ends early
/// (a failed range, the client going away) leaves nothing behind: the manifest is already gone,
/// so nobody else can reach those blocks.
struct Transfer {
    state: Arc<ServiceState>,
    job: String,
    ticket: GetTicket,
    /// Position of the last range naming each block (for `delete`).
    last_range_of: HashMap<u32, usize>,
    _slot: OwnedSemaphorePermit,
}

impl Transfer {
    async fn read(&self, piece: Piece) -> Result<Answer, ServiceError> {
        let mut value = self.read_raw(piece).await?;
        if self.state.store.tier() == pocketflow_store::Tier::Nvme {
            // An NVMe piece is a share of the staging memory that every NVMe read and write of
            // the server draws on; queued for a slow client it would hold that share until the
            // client reads it. One copy releases it at once (the direct path sends each piece
            // before it reads the next, so it needs none).
            value = Bytes::copy_from_slice(&value);
        }
        let meta = GetPieceMeta {
            block_index: piece.index,
            offset: piece.offset,
            len: value.len() as u64,
        };
        Ok(Answer::Piece { meta, value })
    }

    /// The bytes of one piece, as the store holds them.
    async fn read_raw(&self, piece: Piece) -> Result<Bytes, ServiceError> {
        let t = &self.ticket;
        let value = self
            .state
            .store
            .read_block(
                &self.job,
                &t.bucket,
                &t.key,
                t.version,
                piece.index,
                piece.offset,
                piece.len,
            )
            .await?;
        self.state.stats.counters.add_out(value.len() as u64);
        Ok(value)
    }

    /// Queue `message` for the client. False when the client is gone, or when it took nothing
    /// for the transfer idle time: then `idle` is set, the transfer ends (its slot is given
    /// back) and the client's stream ends with `TransferIdle` after what was queued.
    async fn send(&self, tx: &Sender, message: Result<Answer, Status>, idle: &AtomicBool) -> bool {
        match tokio::time::timeout(self.state.transfer_idle, tx.send(message)).await {
            Ok(sent) => sent.is_ok(),
            Err(_) => {
                idle.store(true, Ordering::Release);
                false
            }
        }
    }

    /// After range `range_at` was sent completely, remove the blocks it named last.
    fn after_range(&self, range_at: usize) {
        if !self.ticket.delete {
            return;
        }
        let index = self.ticket.ranges[range_at].index();
        if self.last_range_of.get(&index) == Some(&range_at) {
            let t = &self.ticket;
            // A block already gone was removed by a concurrent delete; nothing is left to free.
            let _ =
                self.state
                    .store
                    .delete_blocks(&self.job, &t.bucket, &t.key, t.version, &[index]);
        }
    }

    async fn run(
        self,
        first: Answer,
        mut rest: impl Iterator<Item = Piece>,
        first_piece: Piece,
        tx: Sender,
        idle: Arc<AtomicBool>,
    ) {
        if !self.send(&tx, Ok(Answer::Schema), &idle).await
            || !self.send(&tx, Ok(first), &idle).await
        {
            return;
        }
        let mut previous = first_piece;
        loop {
            let next = rest.next();
            if next.is_none_or(|n| n.range_at != previous.range_at) {
                self.after_range(previous.range_at);
            }
            let Some(piece) = next else { return };
            let message = self.read(piece).await.map_err(|e| e.to_status());
            let failed = message.is_err();
            if !self.send(&tx, message, &idle).await || failed {
                return;
            }
            previous = piece;
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if !self.ticket.delete {
            return;
        }
        // Blocks already removed after their last range (or by a concurrent delete) are skipped;
        // bytes still queued for the client hold their space until sent.
        let t = &self.ticket;
        let indices: Vec<u32> = self.last_range_of.keys().copied().collect();
        let _ = self
            .state
            .store
            .delete_blocks(&self.job, &t.bucket, &t.key, t.version, &indices);
    }
}

type Sender = mpsc::Sender<Result<Answer, Status>>;

/// Check a ticket and take a transfer slot for it; returns the transfer and its pieces (of at
/// most `piece_bytes_max`).
async fn begin(
    state: Arc<ServiceState>,
    ticket_bytes: &[u8],
    piece_bytes_max: u64,
) -> Result<(Transfer, impl Iterator<Item = Piece> + Send + 'static), ServiceError> {
    let ticket = GetTicket::parse(ticket_bytes)?;
    let job = state.auth.job(&ticket.ctx)?;
    state.stats.counters.add_ops(1);
    Ok(begin_authorized(state, job, ticket, piece_bytes_max).await)
}

/// Take a transfer slot for a ticket of `job` already checked; returns the transfer and its
/// pieces (of at most `piece_bytes_max`).
async fn begin_authorized(
    state: Arc<ServiceState>,
    job: String,
    ticket: GetTicket,
    piece_bytes_max: u64,
) -> (Transfer, impl Iterator<Item = Piece> + Send + 'static) {
    let slot = state
        .transfers
        .clone()
        .acquire_owned()
        .await
        .expect("transfer semaphore is never closed");
    let last_range_of = ticket
        .ranges
        .iter()
        .enumerate()
        .map(|(at, r)| (r.index(), at))
        .collect();
    let pieces = pieces(&ticket, piece_bytes_max);
    let transfer = Transfer {
        state,
        job,
        ticket,
        last_range_of,
        _slot: slot,
    };
    (transfer, pieces)
}

/// Send a ticket's pieces over a direct connection (`pocketflow_protocol::direct`): each as a
/// DATA message `[block index u32][offset u64][bytes]` straight from the store, then END; an
/// error is a STATUS, after which the connection ends (`Err`). A client that takes nothing
/// for the transfer idle time ends it too.
///
/// From the NVMe tier the pieces are smaller (`NVME_DIRECT_PIECE_BYTES`) and up to
/// `NVME_DIRECT_READS_AHEAD_MAX` of them are read at once, each sent as soon as it and the ones
/// before it are read: a 1 MiB block's first half goes out while the kernel reads the second,
/// instead of the whole read and then the whole send. Measured on a virtio disk: reading the
/// pieces one after another is slower than one read of the block (the time per read dominates),
/// and four concurrent 256 KiB reads all complete near the end of the block's read time, so
/// two halves overlap the most. A DRAM piece is the store's own memory at once, so it is sent
/// whole, with nothing to overlap.
pub(crate) async fn send_direct<W>(
    state: Arc<ServiceState>,
    ticket_bytes: &[u8],
    writer: &mut W,
) -> Result<(), Option<ServiceError>>
where
    W: tokio::io::AsyncWrite + Unpin,
{
    let (piece_bytes_max, _) = direct_pieces(&state);
    let (transfer, pieces) = begin(state, ticket_bytes, piece_bytes_max)
        .await
        .map_err(Some)?;
    send_pieces(&transfer, pieces, writer, &[]).await
}

/// A direct transfer's piece size and read-ahead on this server's tier.
fn direct_pieces(state: &ServiceState) -> (u64, usize) {
    match state.store.tier() {
        pocketflow_store::Tier::Nvme => (NVME_DIRECT_PIECE_BYTES, NVME_DIRECT_READS_AHEAD_MAX),
        pocketflow_store::Tier::Dram => (BATCH_MAX_BYTES, 1),
    }
}

/// [`send_direct`] of a ticket of `job` already checked (a direct READ's data block), with
/// `prefix` (an encoded message) sent in the same write as the first piece.
pub(crate) async fn send_direct_authorized<W>(
    state: Arc<ServiceState>,
    job: String,
    ticket: GetTicket,
    writer: &mut W,
    prefix: &[u8],
) -> Result<(), Option<ServiceError>>
where
    W: tokio::io::AsyncWrite + Unpin,
{
    let (piece_bytes_max, _) = direct_pieces(&state);
    let (transfer, pieces) = begin_authorized(state, job, ticket, piece_bytes_max).await;
    send_pieces(&transfer, pieces, writer, prefix).await
}

/// Send `pieces` of `transfer` as DATA messages, read ahead as the tier allows (see
/// [`send_direct`]), then END. `prefix` (a message already encoded) goes out in the same write
/// as the first piece, and END in the same write as the last: a transfer of one piece is one
/// system call, and one wake-up of the client.
async fn send_pieces<W>(
    transfer: &Transfer,
    pieces: impl Iterator<Item = Piece>,
    writer: &mut W,
    prefix: &[u8],
) -> Result<(), Option<ServiceError>>
where
    W: tokio::io::AsyncWrite + Unpin,
{
    use bytes::Buf;
    use futures::stream::FuturesOrdered;
    use pocketflow_protocol::direct::{encode_head, Kind, DATA_META_BYTES};
    use tokio::io::AsyncWriteExt;

    let idle = transfer.state.transfer_idle;
    let (_, reads_ahead_max) = direct_pieces(&transfer.state);
    let end = encode_head(Kind::End, 0);
    let mut pieces = pieces.peekable();
    let mut reads = FuturesOrdered::new();
    let mut previous: Option<Piece> = None;
    loop {
        // Keep the read-ahead full; the new reads enter the kernel when `reads` is next polled.
        while reads.len() < reads_ahead_max {
            let Some(piece) = pieces.next() else { break };
            reads.push_back(async move { (piece, transfer.read_raw(piece).await) });
        }
        let Some((piece, value)) = reads.next().await else {
            break;
        };
        // A failed read ends the transfer; dropping `reads` leaves the others' buffers with
        // the engine until the kernel is done with them.
        let value = value.map_err(Some)?;
        if let Some(done) = previous.filter(|p| p.range_at != piece.range_at) {
            transfer.after_range(done.range_at);
        }
        let mut head = [0u8; 5 + DATA_META_BYTES];
        head[..5].copy_from_slice(&encode_head(Kind::Data, DATA_META_BYTES + value.len()));
        head[5..9].copy_from_slice(&piece.index.to_le_bytes());
        head[9..].copy_from_slice(&piece.offset.to_le_bytes());
        let before: &[u8] = if previous.is_none() { prefix } else { &[] };
        let last = reads.is_empty() && pieces.peek().is_none();
        let after: &[u8] = if last { &end } else { &[] };
        // Heads and bytes in one vectored write: a piece larger than the writer's buffer would
        // otherwise go out as a 17-byte segment of its own, and wake the client twice.
        let mut message = before.chain(&head[..]).chain(&value[..]).chain(after);
        let sent = async {
            writer.write_all_buf(&mut message).await?;
            writer.flush().await
        };
        match tokio::time::timeout(idle, sent).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(None),
            Err(_) => {
                return Err(Some(ServiceError::TransferIdle {
                    transfer: "direct GET",
                    idle_ms: idle.as_millis() as u64,
                }))
            }
        }
        previous = Some(piece);
    }
    if let Some(done) = previous {
        transfer.after_range(done.range_at);
    }
    Ok(())
}

/// Answer a DoGet: the first piece is read before the response starts, so a missing block or a
/// bad range is the RPC's status; the rest streams from a task.
pub(crate) async fn get(
    state: Arc<ServiceState>,
    ticket_bytes: Bytes,
) -> Result<BoxStream<'static, Result<Answer, Status>>, ServiceError> {
    let (transfer, mut pieces) = begin(state, &ticket_bytes, BATCH_MAX_BYTES).await?;
    let first_piece = pieces.next().expect("a ticket has at least one range");
    let first = transfer.read(first_piece).await?;
    let mut rest = pieces.peekable();
    if rest.peek().is_none() {
        // One piece (a block of at most `BATCH_MAX_BYTES`, the common case): both messages are
        // ready, so they are answered without a task and a channel, and the transfer ends here.
        // With `delete`, dropping it removes the block; the piece's bytes keep their space in
        // the store until they are sent (as on the direct path).
        drop(transfer);
        return Ok(futures::stream::iter([Ok(Answer::Schema), Ok(first)]).boxed());
    }
    let (tx, rx) = mpsc::channel(GET_PIECES_QUEUED_MAX);
    let idle = Arc::new(AtomicBool::new(false));
    let idle_ms = transfer.state.transfer_idle.as_millis() as u64;
    tokio::spawn(transfer.run(first, rest, first_piece, tx, idle.clone()));
    // Once the task's sender is gone, a transfer it ended for idleness says so (the status is
    // built only then).
    let ended_idle = futures::stream::once(async move {
        idle.load(Ordering::Acquire).then(|| {
            Err(ServiceError::TransferIdle {
                transfer: "DoGet",
                idle_ms,
            }
            .to_status())
        })
    })
    .filter_map(futures::future::ready);
    Ok(ReceiverStream::new(rx).chain(ended_idle).boxed())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use pocketflow_protocol::ticket::BlockRange;
    use pocketflow_protocol::token::{now_unix_ms, TokenKey};
    use pocketflow_protocol::Context;
    use pocketflow_store::engine::dram::DramEngine;
    use pocketflow_store::Store;
    use tokio::sync::Semaphore;

    use crate::auth::Authority;
    use crate::drain::Drain;
    use crate::stats::Stats;

    pub(crate) const JOB: &str = "j";

    /// A service state over a small DRAM store holding blocks 1 and 2 (10 bytes each) of
    /// `b/k` version 7.
    async fn state_with_blocks() -> (Arc<ServiceState>, TokenKey) {
        let engine = Arc::new(DramEngine::open(1 << 20, false).unwrap());
        let store = Store::with_engine(engine, false);
        store.create_bucket(JOB, "b").unwrap();
        for index in [1, 2] {
            put_block(&store, index, Bytes::from(vec![index as u8; 10])).await;
        }
        state_over(store)
    }

    pub(crate) async fn put_block(store: &Store, index: u32, value: Bytes) {
        let mut write = store
            .begin_block(JOB, "b", "k", 7, index, value.len() as u64, false)
            .await
            .unwrap();
        write.append(value).await.unwrap();
        write.commit().await.unwrap();
    }

    /// A service state over `store`, and the key of its tokens.
    pub(crate) fn state_over(store: Store) -> (Arc<ServiceState>, TokenKey) {
        let key = TokenKey::new(b"0123456789abcdef").unwrap();
        let state = ServiceState {
            store,
            auth: Authority::new(key.clone(), "test".into()),
            stats: Stats::default(),
            metrics: crate::metrics::Metrics::new("test", "dram"),
            drain: Drain::default(),
            node_id: "test".into(),
            transfers: Arc::new(Semaphore::new(1)),
            sessions: Arc::new(Semaphore::new(1)),
            waits: Arc::new(Semaphore::new(1)),
            transfer_idle: std::time::Duration::from_secs(30),
            connection_idle_ms: std::sync::atomic::AtomicU64::new(120_000),
            pins: None,
            arena_served: std::sync::atomic::AtomicBool::new(false),
        };
        (Arc::new(state), key)
    }

    /// The DATA messages of a direct GET's answer, as (block index, offset, bytes); the answer
    /// ends with END.
    pub(crate) fn data_messages(mut answer: &[u8]) -> Vec<(u32, u64, Vec<u8>)> {
        use pocketflow_protocol::direct::{
            decode_head, encode_head, Kind, DATA_META_BYTES, MESSAGE_HEAD_BYTES,
        };
        let end = encode_head(Kind::End, 0);
        assert!(answer.ends_with(&end), "the answer ends with END");
        answer = &answer[..answer.len() - end.len()];
        let mut messages = Vec::new();
        while !answer.is_empty() {
            let head: [u8; MESSAGE_HEAD_BYTES] = answer[..MESSAGE_HEAD_BYTES].try_into().unwrap();
            let (kind, len) = decode_head(&head).unwrap();
            assert_eq!(kind, Kind::Data);
            let payload = &answer[MESSAGE_HEAD_BYTES..MESSAGE_HEAD_BYTES + len];
            let index = u32::from_le_bytes(payload[..4].try_into().unwrap());
            let offset = u64::from_le_bytes(payload[4..DATA_META_BYTES].try_into().unwrap());
            messages.push((index, offset, payload[DATA_META_BYTES..].to_vec()));
            answer = &answer[MESSAGE_HEAD_BYTES + len..];
        }
        messages
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_direct_get_from_nvme_sends_pieces_read_ahead_in_ticket_order() {
        use pocketflow_store::engine::nvme::{NvmeConfig, NvmeEngine};
        const PIECE: u64 = NVME_DIRECT_PIECE_BYTES;

        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let config = NvmeConfig::new(dir.path().join("blocks"), 16 << 20);
        let store = Store::with_engine(Arc::new(NvmeEngine::open(config).unwrap()), false);
        store.create_bucket(JOB, "b").unwrap();
        let pattern = |len: u64, seed: u64| -> Bytes {
            (0..len).map(|i| (i * 31 + seed + i / 4096) as u8).collect()
        };
        let one = pattern(4 * PIECE + 5, 1);
        let two = pattern(3000, 2);
        put_block(&store, 1, one.clone()).await;
        put_block(&store, 2, two.clone()).await;
        let (state, key) = state_over(store);

        // Block 1 whole (more pieces than the read-ahead, the last 5 bytes), a range of block 2,
        // then an unaligned range of block 1 again; with delete, both blocks go at the end.
        let ranges = format!(
            "[[1,0,{}],[2,100,2000],[1,4097,{}]]",
            one.len(),
            2 * PIECE + 77
        );
        let mut answer = Vec::new();
        send_direct(state.clone(), &delete_ticket(&key, &ranges), &mut answer)
            .await
            .unwrap();
        let messages = data_messages(&answer);
        let mut expected = Vec::new();
        for (index, block, start, len) in [
            (1u32, &one, 0u64, one.len() as u64),
            (2, &two, 100, 2000),
            (1, &one, 4097, 2 * PIECE + 77),
        ] {
            for at in (0..len).step_by(PIECE as usize) {
                let end = (at + PIECE).min(len);
                let bytes = block[(start + at) as usize..(start + end) as usize].to_vec();
                expected.push((index, start + at, bytes));
            }
        }
        assert_eq!(messages.len(), expected.len());
        for (got, want) in messages.iter().zip(&expected) {
            assert_eq!((got.0, got.1, got.2.len()), (want.0, want.1, want.2.len()));
            assert!(got.2 == want.2, "piece of block {} at {}", got.0, got.1);
        }
        wait_until_freed(&state).await;
        assert_eq!(state.transfers.available_permits(), 1);
    }

    fn delete_ticket(key: &TokenKey, ranges: &str) -> Bytes {
        let token = key.make(JOB, now_unix_ms() + 60_000);
        Bytes::from(format!(
            r#"{{"ctx":{{"job":"{JOB}","epoch":1,"token":"{token}"}},"bucket":"b","key":"k","version":7,"ranges":{ranges},"delete":true}}"#
        ))
    }

    pub(crate) async fn wait_until_freed(state: &ServiceState) {
        for _ in 0..200 {
            if state.store.used_bytes() == 0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        panic!("{} bytes still charged", state.store.used_bytes());
    }

    #[tokio::test]
    async fn delete_frees_every_block_when_the_client_goes_away() {
        let (state, key) = state_with_blocks().await;
        let stream = get(state.clone(), delete_ticket(&key, "[[1,0,10],[2,0,10]]"))
            .await
            .unwrap();
        drop(stream);
        wait_until_freed(&state).await;
        assert_eq!(state.transfers.available_permits(), 1);
    }

    #[tokio::test]
    async fn delete_frees_every_block_when_a_later_range_fails() {
        let (state, key) = state_with_blocks().await;
        let stream = get(state.clone(), delete_ticket(&key, "[[1,0,10],[2,0,20]]"))
            .await
            .unwrap();
        let messages: Vec<_> = stream.collect().await;
        assert!(
            messages.last().unwrap().is_err(),
            "the range past the end fails"
        );
        // The piece of block 1 is the store's bytes: its space is freed once it is gone.
        drop(messages);
        wait_until_freed(&state).await;
    }

    #[tokio::test]
    async fn delete_frees_every_block_when_the_first_range_fails() {
        let (state, key) = state_with_blocks().await;
        let err = get(state.clone(), delete_ticket(&key, "[[2,0,20],[1,0,10]]"))
            .await
            .err()
            .unwrap();
        assert_eq!(err.kind(), pocketflow_protocol::ErrorKind::InvalidArgument);
        wait_until_freed(&state).await;
    }

    #[tokio::test]
    async fn a_one_piece_delete_read_sends_the_piece_and_frees_the_block() {
        let (state, key) = state_with_blocks().await;
        let before = state.store.used_bytes();
        let stream = get(state.clone(), delete_ticket(&key, "[[2,0,10]]"))
            .await
            .unwrap();
        assert_eq!(state.transfers.available_permits(), 1);
        let mut messages: Vec<_> = stream.collect().await;
        assert_eq!(messages.len(), 2, "the schema, then the piece");
        assert_eq!(
            state.store.used_bytes(),
            before,
            "the unsent piece holds its space"
        );
        let piece = messages.pop().unwrap().unwrap().into_flight_data();
        assert_eq!(&piece.data_body[8..18], &[2u8; 10]);
        assert!(
            state.store.used_bytes() < before,
            "block 2 is freed once its piece is sent"
        );
        let again = get(state.clone(), delete_ticket(&key, "[[2,0,10]]")).await;
        assert_eq!(
            again.err().unwrap().kind(),
            pocketflow_protocol::ErrorKind::NotFound
        );
        assert!(get(state.clone(), delete_ticket(&key, "[[1,0,10]]"))
            .await
            .is_ok());
    }

    #[tokio::test]
    async fn reads_without_delete_keep_the_blocks() {
        let (state, key) = state_with_blocks().await;
        let ticket = String::from_utf8(delete_ticket(&key, "[[1,0,10]]").to_vec())
            .unwrap()
            .replace(r#""delete":true"#, r#""delete":false"#);
        let used = state.store.used_bytes();
        let err = get(
            state.clone(),
            Bytes::from(ticket.replace("[[1,0,10]]", "[[1,0,11]]")),
        )
        .await
        .err()
        .unwrap();
        assert_eq!(err.kind(), pocketflow_protocol::ErrorKind::InvalidArgument);
        let stream = get(state.clone(), Bytes::from(ticket)).await.unwrap();
        assert_eq!(stream.collect::<Vec<_>>().await.len(), 2);
        assert_eq!(state.store.used_bytes(), used);
    }

    #[test]
    fn ranges_are_cut_into_batches() {
        let ticket = GetTicket {
            ctx: Context {
                job: "j".into(),
                epoch: 0,
                token: String::new(),
            },
            bucket: "b".into(),
            key: "k".into(),
            version: 1,
            ranges: vec![
                BlockRange(1, 0, 9 << 20),
                BlockRange(2, 5, 0),
                BlockRange(3, 100, 10),
            ],
            delete: false,
        };
        let all: Vec<_> = pieces(&ticket, BATCH_MAX_BYTES)
            .map(|p| (p.range_at, p.index, p.offset, p.len))
            .collect();
        assert_eq!(
            all,
            vec![
                (0, 1, 0, 4 << 20),
                (0, 1, 4 << 20, 4 << 20),
                (0, 1, 8 << 20, 1 << 20),
                (1, 2, 5, 0),
                (2, 3, 100, 10),
            ]
        );
    }
}
