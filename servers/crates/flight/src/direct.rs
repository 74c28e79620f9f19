//! The direct exchange (`pocketflow_protocol::direct`): a DoExchange session's frames over a
//! plain TCP connection, for clients that want small operations without HTTP/2, or DoGet
//! tickets answered with raw block bytes. The session itself, its bounds and its replies are the
//! DoExchange session's (`exchange.rs`); a ticket's checks, slot and pieces are DoGet's.

use std::io::IoSlice;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use pocketflow_protocol::direct::{
    decode_head, encode_head, encode_status, Kind, DIRECT_MAGIC, MESSAGE_HEAD_BYTES,
    PAYLOAD_MAX_BYTES, REQUEST_MAX_BYTES,
};
use pocketflow_protocol::ProtocolError;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tonic::Status;

use crate::exchange::{self, Incoming};
use crate::handshake::Opening;
use crate::service::StorageService;
use crate::status::ServiceError;
use crate::{doget, doput, read};

/// Reply bytes gathered before a write: a small reply frame goes out in one write with its head.
const WRITE_BUFFER_BYTES: usize = 64 * 1024;
/// Request bytes read ahead per system call.
const READ_BUFFER_BYTES: usize = 8 * 1024;
/// After refusing a transfer, how long and how much of the client's remaining input is read and
/// dropped before the connection closes.
const REFUSED_DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
const REFUSED_DRAIN_MAX_BYTES: usize = 64 << 20;
const DRAIN_BUFFER_BYTES: usize = 64 * 1024;

impl StorageService {
    /// Serve one direct-exchange connection whose first bytes are [`DIRECT_MAGIC`] (not yet
    /// read): open the session, then relay request and reply frames until either side ends. The
    /// magic and the first message must arrive by the deadline of `opening`, whose places in
    /// the handshake pool are given back once they have.
    pub async fn serve_direct<S>(&self, stream: S, opening: Opening)
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (reader, writer) = tokio::io::split(stream);
        // A small request frame, or a transfer's message heads, descriptor and piece metadata,
        // come out of one read; larger payloads are read past the buffer, straight into place.
        let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, reader);
        let mut writer = BufWriter::with_capacity(WRITE_BUFFER_BYTES, writer);
        let opened = tokio::time::timeout_at(opening.deadline(), read_first(&mut reader)).await;
        drop(opening);
        let descriptor = match opened {
            Ok(Ok((Kind::Open, descriptor))) => descriptor,
            Ok(Ok((kind @ (Kind::Get | Kind::Put | Kind::Read), first))) => {
                return self.serve_blocks(kind, first, reader, writer).await
            }
            Ok(Ok((kind, _))) => {
                let e: ServiceError = unexpected(kind, "OPEN, GET, PUT or READ").into();
                return write_status(&mut writer, e.to_status()).await;
            }
            Ok(Err(Some(e))) => return write_status(&mut writer, e.to_status()).await,
            // The client went away, or sent nothing in time: nobody is there to tell.
            Ok(Err(None)) | Err(_) => return,
        };
        let frames = futures::stream::unfold(Some(reader), |reader| async move {
            let mut reader = reader?;
            match read_message(&mut reader).await {
                Ok(Some((Kind::Frame, payload))) => Some((Incoming::Frame(payload), Some(reader))),
                Ok(Some((kind, _))) => {
                    Some((Incoming::Invalid(unexpected(kind, "FRAME").into()), None))
                }
                Ok(None) => None,
                Err(Some(e)) => Some((Incoming::Invalid(e), None)),
                Err(None) => Some((Incoming::Broken, None)),
            }
        })
        .boxed();
        let mut replies = match exchange::start(self.state.clone(), &descriptor, frames) {
            Ok(replies) => replies,
            Err(e) => return write_status(&mut writer, e.to_status()).await,
        };
        if write_message(&mut writer, Kind::Ready, &[]).await.is_err() {
            return;
        }
        while let Some(reply) = replies.recv().await {
            let frame = match reply {
                Ok(frame) => frame,
                Err(status) => return write_status(&mut writer, status).await,
            };
            // A frame dropped unsent puts the queue items it carries back.
            let Some(pieces) = frame.to_send() else {
                continue;
            };
            if write_frame(&mut writer, pieces).await.is_err() {
                return; // The client went away; dropping `replies` ends the session.
            }
            frame.delivered();
        }
        let _ = writer.shutdown().await;
    }
}

impl StorageService {
    /// Count a direct block transfer's outcome (a vanished client counts as `unavailable`).
    fn count_block<T>(
        &self,
        result: &Result<T, Option<ServiceError>>,
        rpc: &str,
        op: &str,
        started: std::time::Instant,
    ) {
        let kind = match result {
            Ok(_) => "ok",
            Err(Some(e)) => e.kind().as_str(),
            Err(None) => "unavailable",
        };
        self.state.metrics.request(rpc, op, kind, started.elapsed());
    }

    /// A connection of block transfers: answer each GET with its data and END, each READ with
    /// its record, its bytes and END, and each PUT (followed by its pieces and END) with STORED,
    /// until the client closes. An error ends the connection with a STATUS. A connection whose
    /// next request does not arrive within the connection idle bound is closed (a pooled client
    /// connection that was closed is seen and replaced before it is used again).
    async fn serve_blocks<R, W>(
        &self,
        mut kind: Kind,
        mut request: Bytes,
        mut reader: R,
        mut writer: BufWriter<W>,
    ) where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        // The token of this connection's last READ, verified: its next READs (a client's
        // gets, one after another) skip the MAC.
        let mut kept = None;
        // One idle timer per connection, moved on before each wait for a request: moving a
        // registered timer later is a compare-and-swap, where a new timer per request took the
        // runtime's timer lock to register it and again to drop it.
        let idle_timer = tokio::time::sleep(self.connection_idle());
        tokio::pin!(idle_timer);
        loop {
            let started = std::time::Instant::now();
            // A GET's and a READ's END go out with their last DATA.
            let done = if kind == Kind::Get {
                let sent = doget::send_direct(self.state.clone(), &request, &mut writer).await;
                self.count_block(&sent, "direct_get", "get", started);
                sent
            } else if kind == Kind::Read {
                // Counted by the READ itself, with the record's outcome.
                read::send_read(self.state.clone(), &request, &mut writer, &mut kept).await
            } else {
                let stored = doput::receive_direct(self.state.clone(), &request, &mut reader).await;
                self.count_block(&stored, "direct_put", "put", started);
                match stored {
                    Ok(result) => write_message(&mut writer, Kind::Stored, &result)
                        .await
                        .map_err(|_| None),
                    Err(e) => Err(e),
                }
            };
            match done {
                Ok(()) => {}
                Err(Some(e)) => return refuse(e, reader, writer).await,
                Err(None) => return,
            }
            let idle_until = tokio::time::Instant::now() + self.connection_idle();
            idle_timer.as_mut().reset(idle_until);
            let next = tokio::select! {
                biased;
                next = read_message(&mut reader) => next,
                () = &mut idle_timer => return,
            };
            (kind, request) = match next {
                Ok(Some((next @ (Kind::Get | Kind::Put | Kind::Read), request))) => (next, request),
                Ok(Some((other, _))) => {
                    return refuse(unexpected(other, "GET, PUT or READ").into(), reader, writer)
                        .await
                }
                Err(Some(e)) => return refuse(e, reader, writer).await,
                Ok(None) | Err(None) => return,
            };
        }
    }
}

fn unexpected(kind: Kind, wanted: &str) -> ProtocolError {
    ProtocolError::DirectMessage(format!("a {kind:?} message where {wanted} was expected"))
}

/// Read the magic and the first message. `Err(None)`: the connection ended or failed (there
/// is nobody to answer).
async fn read_first<R>(reader: &mut R) -> Result<(Kind, Bytes), Option<ServiceError>>
where
    R: AsyncRead + Unpin,
{
    let mut magic = [0u8; DIRECT_MAGIC.len()];
    reader.read_exact(&mut magic).await.map_err(|_| None)?;
    if &magic != DIRECT_MAGIC {
        return Err(Some(
            ProtocolError::DirectMessage("the connection does not start with the magic".into())
                .into(),
        ));
    }
    read_message(reader).await?.ok_or(None)
}

/// Most payload bytes the server reads of a client's message of `kind`: a request frame may fill
/// a frame, a descriptor or ticket only [`REQUEST_MAX_BYTES`].
fn payload_max_bytes(kind: Kind) -> usize {
    match kind {
        Kind::Frame => PAYLOAD_MAX_BYTES,
        _ => REQUEST_MAX_BYTES,
    }
}

/// Read one message. `Ok(None)`: the client closed the connection between messages;
/// `Err(None)`: it broke (reset, or closed inside a message); `Err(Some)`: malformed, or longer
/// than a message of its kind may be (refused from its head, before its payload is read).
async fn read_message<R>(reader: &mut R) -> Result<Option<(Kind, Bytes)>, Option<ServiceError>>
where
    R: AsyncRead + Unpin,
{
    let mut head = [0u8; MESSAGE_HEAD_BYTES];
    match reader.read(&mut head[..1]).await {
        Ok(0) => return Ok(None),
        Ok(_) => {}
        Err(_) => return Err(None),
    }
    reader.read_exact(&mut head[1..]).await.map_err(|_| None)?;
    let (kind, len) = decode_head(&head).map_err(|e| Some(e.into()))?;
    let max = payload_max_bytes(kind);
    if len > max {
        return Err(Some(
            ProtocolError::DirectMessage(format!(
                "a {kind:?} message of {len} bytes over the bound of {max}"
            ))
            .into(),
        ));
    }
    // Read into the buffer's spare capacity: it is not zeroed first, since every byte of it is
    // overwritten (a frame of small puts is as long as their values: zeroing it cost a pass
    // over every byte put).
    let mut payload = BytesMut::with_capacity(len);
    while payload.len() < len {
        let left = (len - payload.len()) as u64;
        let read = (&mut *reader)
            .take(left)
            .read_buf(&mut payload)
            .await
            .map_err(|_| None)?;
        if read == 0 {
            return Err(None); // Closed inside the message.
        }
    }
    Ok(Some((kind, payload.freeze())))
}

async fn write_message<W>(
    writer: &mut BufWriter<W>,
    kind: Kind,
    payload: &[u8],
) -> std::io::Result<()>
where
    W: AsyncWrite + Unpin,
{
    writer.write_all(&encode_head(kind, payload.len())).await?;
    writer.write_all(payload).await?;
    writer.flush().await
}

/// Most pieces one vectored write hands the kernel (Linux's `IOV_MAX`).
const WRITE_PIECES_MAX: usize = 1024;

/// Send a FRAME message of a reply frame's `pieces` with vectored writes: its head and large
/// bodies go from where they are to the socket, without a copy into one buffer first.
async fn write_frame<W>(writer: &mut BufWriter<W>, pieces: &[Bytes]) -> std::io::Result<()>
where
    W: AsyncWrite + Unpin,
{
    let len_bytes = pieces.iter().map(Bytes::len).sum();
    let head = encode_head(Kind::Frame, len_bytes);
    let mut parts: Vec<&[u8]> = Vec::with_capacity(pieces.len() + 1);
    parts.push(&head);
    parts.extend(pieces.iter().map(|piece| &piece[..]));
    write_all_vectored(writer, &parts).await?;
    writer.flush().await
}

/// Write every byte of `parts`, in order, with as few vectored writes as the writer takes.
async fn write_all_vectored<W>(writer: &mut W, parts: &[&[u8]]) -> std::io::Result<()>
where
    W: AsyncWrite + Unpin,
{
    // The first part not wholly written, and how much of it was.
    let (mut at, mut offset) = (0usize, 0usize);
    loop {
        while at < parts.len() && offset == parts[at].len() {
            (at, offset) = (at + 1, 0);
        }
        if at == parts.len() {
            return Ok(());
        }
        let slices: Vec<IoSlice<'_>> = std::iter::once(&parts[at][offset..])
            .chain(parts[at + 1..].iter().copied())
            .take(WRITE_PIECES_MAX)
            .map(IoSlice::new)
            .collect();
        let mut written = writer.write_vectored(&slices).await?;
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        // Each round moves past at least one byte, so the loop ends after at most as many
        // rounds as the parts hold bytes.
        while written > 0 {
            let left = parts[at].len() - offset;
            if written < left {
                offset += written;
                break;
            }
            written -= left;
            (at, offset) = (at + 1, 0);
        }
    }
}

/// End a block connection with `error`: send its STATUS, then read and drop what the client
/// still sends (the rest of an upload) for a bounded time, so that closing does not reset the
/// connection before the client read the status.
async fn refuse<R, W>(error: ServiceError, mut reader: R, mut writer: BufWriter<W>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    write_status(&mut writer, error.to_status()).await;
    let mut sink = vec![0u8; DRAIN_BUFFER_BYTES];
    let _ = tokio::time::timeout(REFUSED_DRAIN_TIMEOUT, async {
        let mut drained = 0usize;
        while drained < REFUSED_DRAIN_MAX_BYTES {
            match reader.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => drained += n,
            }
        }
    })
    .await;
}

/// Send the status that ends the session, then close the connection.
async fn write_status<W>(writer: &mut BufWriter<W>, status: Status)
where
    W: AsyncWrite + Unpin,
{
    let code = u8::try_from(status.code() as i32).unwrap_or(u8::MAX);
    let payload = encode_status(code, status.message());
    if write_message(writer, Kind::Status, &payload).await.is_ok() {
        let _ = writer.shutdown().await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use pocketflow_protocol::direct::encode_message;
    use tokio::io::AsyncWriteExt;

    use super::*;

    /// Bytes of a payload that arrives in many small writes.
    const PIECED_PAYLOAD_BYTES: usize = 200 * 1024;
    /// Bytes per write of that payload.
    const PIECE_BYTES: usize = 4093;

    #[tokio::test]
    async fn a_payload_read_in_pieces_comes_whole_and_the_next_message_after_it() {
        let payload: Vec<u8> = (0..PIECED_PAYLOAD_BYTES).map(|i| (i % 251) as u8).collect();
        let (client, server) = tokio::io::duplex(PIECE_BYTES);
        let sent = payload.clone();
        let writer = tokio::spawn(async move {
            let mut client = client;
            let mut wire = encode_message(Kind::Frame, &sent).to_vec();
            wire.extend_from_slice(&encode_message(Kind::Frame, b"next"));
            for piece in wire.chunks(PIECE_BYTES) {
                client.write_all(piece).await.unwrap();
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            client
        });
        let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, server);
        let (kind, got) = read_message(&mut reader).await.ok().flatten().unwrap();
        assert_eq!(kind, Kind::Frame);
        assert_eq!(got.len(), payload.len());
        assert!(got == payload, "the payload's bytes changed on the way");
        let (_, next) = read_message(&mut reader).await.ok().flatten().unwrap();
        assert_eq!(&next[..], b"next");
        drop(writer.await.unwrap());
        assert!(matches!(read_message(&mut reader).await, Ok(None)));
    }

    /// Bytes a duplex pipe takes per write in the vectored-write test: far fewer than a
    /// frame's pieces, so every write is short and most split a piece.
    const PIPE_BYTES: usize = 1000;

    #[tokio::test]
    async fn a_frame_written_in_pieces_arrives_whole_through_short_writes() {
        let pieces: Vec<Bytes> = [0usize, 5, 4096, 0, 1, 20_000, 3, 8192]
            .iter()
            .enumerate()
            .map(|(i, &len)| Bytes::from((0..len).map(|b| (b + i) as u8).collect::<Vec<u8>>()))
            .collect();
        let joined: Vec<u8> = pieces.iter().flat_map(|p| p.iter().copied()).collect();
        let (server, client) = tokio::io::duplex(PIPE_BYTES);
        let writer = tokio::spawn(async move {
            let mut writer = BufWriter::new(server);
            write_frame(&mut writer, &pieces).await.unwrap();
            write_frame(&mut writer, &[Bytes::from_static(b"next")])
                .await
                .unwrap();
            writer
        });
        let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, client);
        let (kind, got) = read_message(&mut reader).await.ok().flatten().unwrap();
        assert_eq!(kind, Kind::Frame);
        assert!(got == joined, "the frame's bytes changed on the way");
        let (_, next) = read_message(&mut reader).await.ok().flatten().unwrap();
        assert_eq!(&next[..], b"next");
        drop(writer.await.unwrap());
        assert!(matches!(read_message(&mut reader).await, Ok(None)));
    }

    #[tokio::test]
    async fn a_connection_closed_inside_a_payload_is_broken_not_a_short_message() {
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let wire = encode_message(Kind::Frame, &[7u8; 1000]);
        client
            .write_all(&wire[..MESSAGE_HEAD_BYTES + 600])
            .await
            .unwrap();
        drop(client);
        let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, server);
        assert!(matches!(read_message(&mut reader).await, Err(None)));
    }
}
