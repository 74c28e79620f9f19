//! Data blocks of large objects: the block writer, reads of block ranges, and deletion.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use pocketflow_protocol::limits::BLOCK_SIZE_MAX_BYTES;

use super::{bucket_not_found, check_names, Store};
use crate::capacity::{Charge, ChargeKind, INDEX_ENTRY_OVERHEAD_BYTES};
use crate::engine::BlockWriter;
use crate::error::StoreError;
use crate::expiry::{Expiry, Slot};
use crate::index::{lock, BlockKey, BucketRef, JobIndex, Stored};

/// Writer of one data block, returned by [`Store::begin_block`].
///
/// The block's space is reserved; it becomes readable at [`BlockWrite::commit`]. Dropping the
/// writer without committing frees everything.
pub struct BlockWrite {
    job: Arc<JobIndex>,
    bucket: BucketRef,
    bucket_name: String,
    address: BlockKey,
    len: u64,
    appended: u64,
    persist: bool,
    writer: Box<dyn BlockWriter>,
    charge: Charge,
    /// The expiry queue and the job's name, for a PERSIST block on a server with a TTL.
    expiry: Option<(Arc<Expiry>, String)>,
}

impl Store {
    /// Reserve `len` bytes for data block `index` (>= 1) of `(key, version)` and return its
    /// writer. Fails with `CapacityExhausted` (nothing reserved), `BucketNotFound`,
    /// `PersistRefused`, `BlockTooLarge` or `BlockExists`.
    #[allow(clippy::too_many_arguments)]
    pub async fn begin_block(
        &self,
        job: &str,
        bucket: &str,
        key: &str,
        version: u64,
        index: u32,
        len: u64,
        persist: bool,
    ) -> Result<BlockWrite, StoreError> {
        check_names(job, bucket, Some(key))?;
        if version == 0 || index == 0 {
            return Err(StoreError::InvalidBlockAddress { version, index });
        }
        if len == 0 {
            return Err(StoreError::EmptyBlock);
        }
        if len > u64::from(BLOCK_SIZE_MAX_BYTES) {
            return Err(StoreError::BlockTooLarge {
                len,
                max: u64::from(BLOCK_SIZE_MAX_BYTES),
            });
        }
        if persist && !self.shared.long_running {
            return Err(StoreError::PersistRefused);
        }
        let (job_index, bucket_ref) = self.bucket(job, bucket)?;
        let address = BlockKey {
            key: key.to_string(),
            version,
            index,
        };
        self.with_bucket(job, bucket, |b, _| match b.blocks.contains_key(&address) {
            true => Err(StoreError::BlockExists {
                key: key.to_string(),
                version,
                index,
            }),
            false => Ok(()),
        })?;
        let engine = &self.shared.engine;
        let cost = engine.allocation_bytes(len) + INDEX_ENTRY_OVERHEAD_BYTES + key.len() as u64;
        let charge = self
            .shared
            .budget
            .charge(&job_index.account, cost, ChargeKind::Data)?;
        let writer = self.begin_write(&job_index.account, len).await?;
        Ok(BlockWrite {
            job: job_index,
            bucket: bucket_ref,
            bucket_name: bucket.to_string(),
            address,
            len,
            appended: 0,
            persist,
            writer,
            charge,
            expiry: match (persist, &self.shared.expiry) {
                (true, Some(expiry)) => Some((Arc::clone(expiry), job.to_string())),
                _ => None,
            },
        })
    }

    /// Read `len` bytes at `offset` of a data block. Fails with `BlockNotFound` or
    /// `InvalidRange`.
    #[allow(clippy::too_many_arguments)]
    pub async fn read_block(
        &self,
        job: &str,
        bucket: &str,
        key: &str,
        version: u64,
        index: u32,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, StoreError> {
        check_names(job, bucket, Some(key))?;
        let address = BlockKey {
            key: key.to_string(),
            version,
            index,
        };
        let stored = self.with_bucket(job, bucket, |b, _| {
            b.blocks
                .get(&address)
                .cloned()
                .ok_or(StoreError::BlockNotFound {
                    key: key.to_string(),
                    version,
                    index,
                })
        })?;
        let block_len = stored.block.as_ref().map_or(0, |block| block.len());
        if offset.checked_add(len).is_none_or(|end| end > block_len) {
            return Err(StoreError::InvalidRange {
                offset,
                len,
                block_len,
            });
        }
        self.read_stored(stored, offset, len).await
    }

    /// The length of data block `index` of `(key, version)`, if this server holds it (an index
    /// lookup: no byte is read).
    pub fn block_len(
        &self,
        job: &str,
        bucket: &str,
        key: &str,
        version: u64,
        index: u32,
    ) -> Result<Option<u64>, StoreError> {
        check_names(job, bucket, Some(key))?;
        let address = BlockKey {
            key: key.to_string(),
            version,
            index,
        };
        self.with_bucket(job, bucket, |b, _| {
            Ok(b.blocks
                .get(&address)
                .map(|stored| stored.block.as_ref().map_or(0, |block| block.len())))
        })
    }

    /// Remove data blocks `indices` of `(key, version)`; missing ones are ignored. Returns the
    /// bytes charged to the removed blocks (freed once no reader holds them).
    pub fn delete_blocks(
        &self,
        job: &str,
        bucket: &str,
        key: &str,
        version: u64,
        indices: &[u32],
    ) -> Result<u64, StoreError> {
        check_names(job, bucket, Some(key))?;
        let mut address = BlockKey {
            key: key.to_string(),
            version,
            index: 0,
        };
        let (removed, freed) = self.with_bucket(job, bucket, |b, account| {
            let mut removed = Vec::with_capacity(indices.len());
            for &index in indices {
                address.index = index;
                removed.extend(b.blocks.remove(&address));
            }
            let freed = self.forget(account, [], removed.iter().cloned()).1;
            Ok((removed, freed))
        })?;
        drop(removed);
        Ok(freed)
    }
}

impl BlockWrite {
    /// Declared length of the block.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the declared length is zero (never: empty blocks are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes appended so far.
    pub fn appended_bytes(&self) -> u64 {
        self.appended
    }

    /// Append the next piece; fails with `LengthMismatch` if the block would exceed its length.
    pub async fn append(&mut self, piece: Bytes) -> Result<(), StoreError> {
        let actual = self.appended + piece.len() as u64;
        if actual > self.len {
            return Err(StoreError::LengthMismatch {
                expected: self.len,
                actual,
            });
        }
        if piece.is_empty() {
            return Ok(());
        }
        self.writer.append(piece).await?;
        self.appended = actual;
        Ok(())
    }

    /// The engine's memory for the next `len` bytes of the block, to be filled in place and then
    /// counted with [`BlockWrite::advance`]; `None` when the engine takes pieces only through
    /// [`BlockWrite::append`] or the piece would pass the block's end.
    pub fn spare(&mut self, len: u64) -> Option<&mut [u8]> {
        if len == 0 || self.appended + len > self.len {
            return None;
        }
        self.writer.spare(len)
    }

    /// Count `len` bytes written into [`BlockWrite::spare`] as appended.
    pub fn advance(&mut self, len: u64) {
        assert!(
            self.appended + len <= self.len,
            "advance past the block's declared length"
        );
        self.writer.advance(len);
        self.appended += len;
    }

    /// Finish the write and make the block readable. Fails with `LengthMismatch` if fewer bytes
    /// than declared were appended, `BlockExists` if the address was taken meanwhile, and
    /// `BucketNotFound` if the bucket was deleted meanwhile; on failure everything is freed.
    pub async fn commit(self) -> Result<(), StoreError> {
        if self.appended != self.len {
            return Err(StoreError::LengthMismatch {
                expected: self.len,
                actual: self.appended,
            });
        }
        let BlockWrite {
            job,
            bucket,
            bucket_name,
            address,
            writer,
            persist,
            charge,
            expiry,
            ..
        } = self;
        let block = writer.finish().await?;
        let stored = Arc::new(Stored {
            block: Some(block),
            persist,
            charge,
        });
        let mut guard = lock(&bucket);
        if guard.removed {
            return Err(bucket_not_found(&bucket_name));
        }
        if guard.blocks.contains_key(&address) {
            let BlockKey {
                key,
                version,
                index,
            } = address;
            return Err(StoreError::BlockExists {
                key,
                version,
                index,
            });
        }
        if let Some((expiry, job_name)) = expiry {
            expiry.push(
                &job_name,
                &bucket_name,
                Slot::Block(address.clone()),
                &stored,
            );
        }
        guard.blocks.insert(address, stored);
        job.account.entries.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
}
