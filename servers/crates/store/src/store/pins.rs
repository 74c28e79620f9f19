//! The bytes a PIN holds: an object's bytes read where they lie, in one extent of the engine.

use bytes::Bytes;
use pocketflow_protocol::ObjectHeader;

use super::{check_names, not_found, Store};
use crate::engine::SharedArena;
use crate::error::StoreError;
use crate::index::BlockKey;

/// What [`Store::pin_read`] found.
#[derive(Debug)]
pub enum PinRead {
    /// A small object: its value (block 0), which the reader gets in the reply as a GET's.
    Value(ObjectHeader, Bytes),
    /// A large object of one data block on this server: the block's bytes, which keep its
    /// extent (and its charge to the job) while any clone of them lives.
    Block(ObjectHeader, Bytes),
}

impl Store {
    /// The engine's shared arena, if it has one (see [`crate::engine::dram::DramEngine::open_shared`]).
    pub fn shared_arena(&self) -> Option<SharedArena> {
        self.shared.engine.shared_arena()
    }

    /// Read an object for a PIN: a small object's value, or the one data block of a large
    /// object whose block lives here. A large object of more than one block, or whose block is
    /// not on this server, is refused with `NotPinnable`.
    pub async fn pin_read(
        &self,
        job: &str,
        bucket: &str,
        key: &str,
    ) -> Result<PinRead, StoreError> {
        check_names(job, bucket, Some(key))?;
        let (header, stored) = self.with_bucket(job, bucket, |b, _| {
            let found = b.records.get(key).ok_or_else(|| not_found(bucket, key))?;
            let header = found.header;
            if header.block_count == 0 {
                return Ok((header, std::sync::Arc::clone(&found.stored)));
            }
            if header.block_count != 1 {
                return Err(StoreError::NotPinnable {
                    why: "the object has more than one data block",
                });
            }
            let address = BlockKey {
                key: key.to_string(),
                version: header.version,
                index: 1,
            };
            let stored = b.blocks.get(&address).ok_or(StoreError::NotPinnable {
                why: "the object's data block is on another server",
            })?;
            Ok((header, std::sync::Arc::clone(stored)))
        })?;
        let len = stored.block.as_ref().map_or(0, |block| block.len());
        let bytes = self.read_stored(stored, 0, len).await?;
        match header.block_count {
            0 => Ok(PinRead::Value(header, bytes)),
            _ if len != header.size => Err(StoreError::NotPinnable {
                why: "the object's data block is not its whole size",
            }),
            _ => Ok(PinRead::Block(header, bytes)),
        }
    }
}
