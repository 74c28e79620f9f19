//! DoPut of data blocks: each one-row batch is the next piece of a block, streamed into the
//! store's block writer as it arrives; on any error every block of the stream is freed.

use std::sync::Arc;

use arrow_flight::{FlightData, PutResult};
use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use pocketflow_protocol::batch::PutPieceMeta;
use pocketflow_protocol::descriptor::{PutDescriptor, PutStored};
use pocketflow_protocol::limits::BATCH_MAX_BYTES;
use pocketflow_protocol::ProtocolError;
use pocketflow_store::BlockWrite;
use tokio::sync::OwnedSemaphorePermit;
use tonic::Streaming;

use crate::bounds::PUT_STREAM_BLOCKS_MAX;
use crate::ipc::{check_schema, decode_piece, is_schema_message};
use crate::service::{descriptor_cmd, ServiceState};
use crate::status::ServiceError;

/// The block being written.
struct OpenBlock {
    index: u32,
    declared: u64,
    writer: BlockWrite,
}

/// One upload's progress. Dropping it before [`Upload::finish`] (an error, or the client going
/// away) frees every block it wrote.
struct Upload {
    state: Arc<ServiceState>,
    job: String,
    descriptor: PutDescriptor,
    schema_seen: bool,
    open: Option<OpenBlock>,
    committed: Vec<u32>,
    bytes: u64,
    finished: bool,
}

impl Drop for Upload {
    fn drop(&mut self) {
        // The open writer frees its reservation when dropped; committed blocks are removed here.
        if !self.finished && !self.committed.is_empty() {
            let d = &self.descriptor;
            let _ = self.state.store.delete_blocks(
                &self.job,
                &d.bucket,
                &d.key,
                d.version,
                &self.committed,
            );
        }
    }
}

impl Upload {
    async fn accept(&mut self, data: FlightData) -> Result<(), ServiceError> {
        if data.data_header.is_empty() {
            if data.data_body.is_empty() && data.app_metadata.is_empty() {
                return Ok(());
            }
            return Err(ServiceError::StreamShape(
                "DoPut message without an IPC header",
            ));
        }
        if is_schema_message(&data.data_header) {
            check_schema(&data.data_header)?;
            self.schema_seen = true;
            return Ok(());
        }
        if !self.schema_seen {
            return Err(ServiceError::StreamShape(
                "DoPut stream must open with its schema",
            ));
        }
        let piece = decode_piece(&data.data_header, &data.data_body)?;
        let meta = PutPieceMeta::decode(&data.app_metadata)?;
        self.write_piece(meta, piece).await
    }

    async fn write_piece(&mut self, meta: PutPieceMeta, piece: Bytes) -> Result<(), ServiceError> {
        let piece_len = piece.len() as u64;
        let open = self.open_for(meta, piece_len).await?;
        open.writer.append(piece).await?;
        self.appended(piece_len).await
    }

    /// Check the next piece's place (`piece_len` bytes of the block `meta` names) and return the
    /// block it goes to, opened (space reserved) if it is the first piece of its block.
    async fn open_for(
        &mut self,
        meta: PutPieceMeta,
        piece_len: u64,
    ) -> Result<&mut OpenBlock, ServiceError> {
        if piece_len > BATCH_MAX_BYTES {
            return Err(field("batch", "value is larger than BATCH_MAX_BYTES"));
        }
        if meta.block_len > u64::from(self.descriptor.block_size) {
            return Err(field("block length", "exceeds the descriptor's block_size"));
        }
        if let Some(open) = &self.open {
            if open.index != meta.block_index {
                return Err(ServiceError::BlockIncomplete {
                    index: open.index,
                    written: open.writer.appended_bytes(),
                    declared: open.declared,
                });
            }
            if open.declared != meta.block_len {
                return Err(field("block length", "changed within a block"));
            }
        } else {
            if let Some(manifest) = self.descriptor.manifest() {
                if manifest.data_block_len(meta.block_index) != Some(meta.block_len) {
                    return Err(field(
                        "block length",
                        "does not match the block of the object the commit names",
                    ));
                }
            }
            if self.committed.len() >= PUT_STREAM_BLOCKS_MAX {
                return Err(field(
                    "blocks",
                    "more than PUT_STREAM_BLOCKS_MAX in one stream",
                ));
            }
            self.state.auth.check_may_write(&self.job)?;
            let d = &self.descriptor;
            let writer = self
                .state
                .store
                .begin_block(
                    &self.job,
                    &d.bucket,
                    &d.key,
                    d.version,
                    meta.block_index,
                    meta.block_len,
                    d.persist,
                )
                .await?;
            self.open = Some(OpenBlock {
                index: meta.block_index,
                declared: meta.block_len,
                writer,
            });
        }
        let open = self.open.as_mut().expect("a block is open");
        if open.writer.appended_bytes() + piece_len > open.declared {
            return Err(field(
                "batch",
                "pieces add up to more than the block length",
            ));
        }
        Ok(open)
    }

    /// Count a piece of `piece_len` bytes written to the open block; the block's last piece
    /// makes it readable.
    async fn appended(&mut self, piece_len: u64) -> Result<(), ServiceError> {
        self.state.stats.counters.add_in(piece_len);
        self.bytes += piece_len;
        let open = self.open.as_ref().expect("a block is open");
        if open.writer.appended_bytes() == open.declared {
            let open = self.open.take().expect("a block is open");
            open.writer.commit().await?;
            self.committed.push(open.index);
        }
        Ok(())
    }

    /// End the upload: every block must be complete. With a commit, the upload must hold every
    /// block of the object, and the manifest is then stored as a DoExchange PUT would store it
    /// (epoch, write-once, PERSIST checks); if that fails, the blocks are freed.
    async fn finish(&mut self) -> Result<Bytes, ServiceError> {
        if let Some(open) = &self.open {
            return Err(ServiceError::BlockIncomplete {
                index: open.index,
                written: open.writer.appended_bytes(),
                declared: open.declared,
            });
        }
        // A job ended while its upload ran gets nothing stored: the unfinished upload's blocks
        // are freed when it is dropped.
        self.state.auth.check_may_write(&self.job)?;
        let mut result = PutStored {
            blocks: self.committed.len() as u64,
            bytes: self.bytes,
            ..Default::default()
        };
        if let Some(manifest) = self.descriptor.manifest() {
            // Each block's index and length were checked against the manifest as it opened, and
            // an index is stored at most once, so a full count is every block of the object.
            if self.committed.len() != manifest.block_count as usize {
                return Err(field(
                    "commit",
                    "the upload does not hold every block of the object",
                ));
            }
            let d = &self.descriptor;
            self.state.auth.check_epoch(&self.job, d.ctx.epoch)?;
            self.state.drain.check_write(&self.state.node_id)?;
            let overwrite = d.commit.is_some_and(|c| c.overwrite);
            result.replaced = self
                .state
                .store
                .put_record(
                    &self.job,
                    &d.bucket,
                    &d.key,
                    manifest,
                    Bytes::new(),
                    overwrite,
                )
                .await?;
            result.committed = true;
        }
        self.finished = true;
        let json = serde_json::to_vec(&result).expect("a result always serializes");
        Ok(Bytes::from(json))
    }
}

fn field(what: &'static str, why: &'static str) -> ServiceError {
    ServiceError::Protocol(ProtocolError::Field { what, why })
}

/// Check a descriptor and take a transfer slot for its upload.
async fn begin(
    state: &Arc<ServiceState>,
    descriptor: &[u8],
    schema_seen: bool,
) -> Result<(Upload, OwnedSemaphorePermit), ServiceError> {
    let descriptor = PutDescriptor::parse(descriptor)?;
    let job = state.auth.job(&descriptor.ctx)?;
    state.drain.check_write(&state.node_id)?;
    state.auth.check_may_write(&job)?;
    if descriptor.persist && !state.store.long_running() {
        return Err(ServiceError::PersistRefused {
            node_id: state.node_id.clone(),
        });
    }
    state.stats.counters.add_ops(1);
    let slot = state
        .transfers
        .clone()
        .acquire_owned()
        .await
        .expect("transfer semaphore is never closed");
    let upload = Upload {
        state: state.clone(),
        job,
        descriptor,
        schema_seen,
        open: None,
        committed: Vec::new(),
        bytes: 0,
        finished: false,
    };
    Ok((upload, slot))
}

/// Run one DoPut stream to its end and return its single PutResult.
pub(crate) async fn put(
    state: Arc<ServiceState>,
    mut input: Streaming<FlightData>,
) -> Result<PutResult, ServiceError> {
    let first = match input.next().await {
        Some(Ok(first)) => first,
        Some(Err(_)) | None => {
            return Err(ServiceError::StreamShape(
                "DoPut stream ended before its descriptor",
            ))
        }
    };
    let (mut upload, _slot) = begin(&state, &descriptor_cmd(&first)?, false).await?;
    upload
        .accept(FlightData {
            flight_descriptor: None,
            ..first
        })
        .await?;
    // A client that stops sending would hold the transfer slot: it gets `transfer_idle`.
    let idle = state.transfer_idle;
    loop {
        let message = tokio::time::timeout(idle, input.next())
            .await
            .map_err(|_| ServiceError::TransferIdle {
                transfer: "DoPut",
                idle_ms: idle.as_millis() as u64,
            })?;
        let Some(message) = message else { break };
        let data = message.map_err(|_| ServiceError::StreamShape("DoPut request stream failed"))?;
        upload.accept(data).await?;
    }
    let app_metadata = upload.finish().await?;
    Ok(PutResult { app_metadata })
}

/// Fill `buf` from an upload's connection within the transfer idle time. `Err(None)`: the
/// connection broke.
async fn read_within<R>(
    reader: &mut R,
    buf: &mut [u8],
    idle: std::time::Duration,
) -> Result<(), Option<ServiceError>>
where
    R: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt;

    match tokio::time::timeout(idle, reader.read_exact(buf)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(_)) => Err(None),
        Err(_) => Err(Some(ServiceError::TransferIdle {
            transfer: "direct PUT",
            idle_ms: idle.as_millis() as u64,
        })),
    }
}

/// Read exactly `len` bytes onto the end of `buf` (its spare capacity), within the idle bound.
async fn fill_within<R>(
    reader: &mut R,
    buf: &mut BytesMut,
    len: usize,
    idle: std::time::Duration,
) -> Result<(), Option<ServiceError>>
where
    R: tokio::io::AsyncRead + Unpin,
{
    use bytes::BufMut;
    use tokio::io::AsyncReadExt;

    let target = buf.len() + len;
    let fill = async {
        while buf.len() < target {
            let wanted = target - buf.len();
            let mut rest = (&mut *buf).limit(wanted);
            if reader.read_buf(&mut rest).await? == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
            }
        }
        Ok::<(), std::io::Error>(())
    };
    match tokio::time::timeout(idle, fill).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(None),
        Err(_) => Err(Some(ServiceError::TransferIdle {
            transfer: "direct PUT",
            idle_ms: idle.as_millis() as u64,
        })),
    }
}

/// Receive an upload over a direct connection (`pocketflow_protocol::direct`): PIECE messages
/// `[block index u32][block length u64][bytes]` until END; returns the result JSON. Same checks,
/// slot, idle bound and cleanup as DoPut. `Err(None)`: the connection broke.
pub(crate) async fn receive_direct<R>(
    state: Arc<ServiceState>,
    descriptor: &[u8],
    reader: &mut R,
) -> Result<Bytes, Option<ServiceError>>
where
    R: tokio::io::AsyncRead + Unpin,
{
    use pocketflow_protocol::direct::{decode_head, Kind, MESSAGE_HEAD_BYTES, PIECE_META_BYTES};

    let (mut upload, _slot) = begin(&state, descriptor, true).await.map_err(Some)?;
    let idle = state.transfer_idle;
    loop {
        let mut head = [0u8; MESSAGE_HEAD_BYTES];
        read_within(reader, &mut head, idle).await?;
        let (kind, len) = decode_head(&head).map_err(|e| Some(e.into()))?;
        match kind {
            Kind::End if len == 0 => return upload.finish().await.map_err(Some),
            Kind::Piece if len >= PIECE_META_BYTES => {}
            _ => {
                return Err(Some(
                    ProtocolError::DirectMessage(format!(
                        "a {kind:?} message of {len} bytes inside an upload"
                    ))
                    .into(),
                ))
            }
        }
        let mut raw_meta = [0u8; PIECE_META_BYTES];
        read_within(reader, &mut raw_meta, idle).await?;
        let meta = PutPieceMeta {
            block_index: u32::from_le_bytes(raw_meta[..4].try_into().expect("4 bytes")),
            block_len: u64::from_le_bytes(raw_meta[4..].try_into().expect("8 bytes")),
        };
        let piece_len = (len - PIECE_META_BYTES) as u64;
        let open = upload.open_for(meta, piece_len).await.map_err(Some)?;
        if let Some(spare) = open.writer.spare(piece_len) {
            // The engine's memory (the DRAM arena) takes the piece straight from the socket.
            read_within(reader, spare, idle).await?;
            open.writer.advance(piece_len);
        } else {
            // Read into uninitialised capacity: zeroing a block-sized buffer first would cost
            // a pass over every byte of the upload.
            let mut piece = BytesMut::with_capacity(piece_len as usize);
            fill_within(reader, &mut piece, piece_len as usize, idle).await?;
            let appended = open.writer.append(piece.freeze()).await;
            appended.map_err(|e| Some(e.into()))?;
        }
        upload.appended(piece_len).await.map_err(Some)?;
    }
}
