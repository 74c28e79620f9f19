//! Block-0 records (small objects and manifests): put, get with DELETE-on-read, lookup,
//! deletion, parked readers of absent keys, enumeration and prefix deletion.

use std::collections::btree_map::Entry;
use std::ops::Bound;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use pocketflow_protocol::limits::{ENUMERATE_LIMIT_MAX, KEY_MAX_BYTES};
use pocketflow_protocol::ObjectHeader;

use super::{bucket_not_found, check_names, not_found, Store};
use crate::capacity::{ChargeKind, JobAccount};
use crate::channels::{forget_channels, SegmentKey};
use crate::error::StoreError;
use crate::events::EventOp;
use crate::expiry::Slot;
use crate::index::{lock, split_prefix, BlockKey, BucketIndex, Record};
use crate::waiters::Waiter;

impl Store {
    /// Insert a block-0 record: a small object (`value.len() == header.size`, no data blocks) or
    /// a manifest (`header.block_count > 0`; `value` empty, or for an overflowed manifest the
    /// servers its blocks skipped, see `ObjectHeader::value_len_ok`). A manifest may use the
    /// records' reserve of the tier (`capacity.rs`), a small object may not. Write-once: fails
    /// with `AlreadyExists` unless `overwrite`, in which case the replaced header is returned. A
    /// failed put leaves nothing behind.
    pub async fn put_record(
        &self,
        job: &str,
        bucket: &str,
        key: &str,
        header: ObjectHeader,
        value: Bytes,
        overwrite: bool,
    ) -> Result<Option<ObjectHeader>, StoreError> {
        check_names(job, bucket, Some(key))?;
        header.validate()?;
        if !header.value_len_ok(value.len() as u64) {
            return Err(StoreError::ValueLengthMismatch {
                expected: if header.is_small() { header.size } else { 0 },
                actual: value.len() as u64,
            });
        }
        if header.persist() && !self.shared.long_running {
            return Err(StoreError::PersistRefused);
        }
        let (job_index, bucket_ref) = self.bucket(job, bucket)?;
        // Fail fast before writing; the check is repeated at the insert, which decides.
        self.with_bucket(job, bucket, |b, _| {
            match !overwrite && b.records.contains_key(key) {
                true => Err(StoreError::AlreadyExists {
                    bucket: bucket.to_string(),
                    key: key.to_string(),
                }),
                false => Ok(()),
            }
        })?;
        // A fence holds no bytes, like a manifest: a home full of data still takes it, so a
        // PERSIST put whose ephemeral home is full can still claim its key there.
        let kind = match header.is_small() && !header.fence() {
            true => ChargeKind::Data,
            false => ChargeKind::Record,
        };
        let stored = self
            .store_bytes(&job_index.account, key, value, header.persist(), kind)
            .await?;
        let replaced = {
            let mut guard = lock(&bucket_ref);
            if guard.removed {
                return Err(bucket_not_found(bucket));
            }
            let record = Record {
                header,
                stored: Arc::clone(&stored),
            };
            // One search of the index (an entry), not a lookup and then an insert.
            let replaced = match guard.records.entry(key.to_string()) {
                Entry::Occupied(_) if !overwrite => {
                    return Err(StoreError::AlreadyExists {
                        bucket: bucket.to_string(),
                        key: key.to_string(),
                    });
                }
                Entry::Occupied(mut existing) => Some(existing.insert(record)),
                Entry::Vacant(vacant) => {
                    vacant.insert(record);
                    job_index.account.objects.fetch_add(1, Ordering::AcqRel);
                    job_index.account.entries.fetch_add(1, Ordering::AcqRel);
                    None
                }
            };
            // Under the bucket lock, so a key's events keep the order of its operations. A
            // fence is no object: nobody is told of it.
            if !header.fence() {
                self.shared.events.emit(job, bucket, key, EventOp::Put);
            }
            replaced
        };
        self.shared.waiters.inserted(job, bucket, key);
        if let (true, Some(expiry)) = (header.persist(), &self.shared.expiry) {
            expiry.push(job, bucket, Slot::Record(key.to_string()), &stored);
        }
        Ok(replaced.map(|old| old.header))
    }

    /// Read a block-0 record. With `delete`, the record leaves the index atomically with the
    /// read (exactly one of concurrent deleting readers gets it, the others get `NotFound`) and
    /// its space is freed when the returned bytes are dropped.
    pub async fn get_record(
        &self,
        job: &str,
        bucket: &str,
        key: &str,
        delete: bool,
    ) -> Result<(ObjectHeader, Bytes), StoreError> {
        let claim = if delete { Claim::Always } else { Claim::Never };
        let (header, bytes, _) = self.get_record_claiming(job, bucket, key, claim).await?;
        Ok((header, bytes))
    }

    /// [`Store::get_record`] that takes the record out of the index as `claim` says; returns
    /// whether it did. A claimed record leaves the index atomically with the read, as with
    /// `delete`.
    pub async fn get_record_claiming(
        &self,
        job: &str,
        bucket: &str,
        key: &str,
        claim: Claim,
    ) -> Result<(ObjectHeader, Bytes, bool), StoreError> {
        check_names(job, bucket, Some(key))?;
        let (header, stored, claimed) = self.with_bucket(job, bucket, |b, account| {
            if claim == Claim::Always {
                // A DELETE read takes the record in one search of the index.
                let record = self.take_record(b, account, job, bucket, key)?;
                return Ok((record.header, record.stored, true));
            }
            let found = b.records.get(key).ok_or_else(|| not_found(bucket, key))?;
            let takes = match claim {
                Claim::Never => false,
                Claim::Always => true,
                Claim::Whole { inline_bytes_max } => {
                    let header = found.header;
                    let block = BlockKey {
                        key: key.to_string(),
                        version: header.version,
                        index: 1,
                    };
                    header.block_count == 0
                        || (header.block_count == 1
                            && header.size <= inline_bytes_max
                            && b.blocks.get(&block).is_some_and(|stored| {
                                stored.block.as_ref().map_or(0, |block| block.len()) == header.size
                            }))
                }
            };
            if !takes {
                return Ok((found.header, Arc::clone(&found.stored), false));
            }
            let record = self.take_record(b, account, job, bucket, key)?;
            Ok((record.header, record.stored, true))
        })?;
        let len = stored.block.as_ref().map_or(0, |block| block.len());
        assert!(
            header.value_len_ok(len),
            "record bytes ({len}) disagree with the header"
        );
        let bytes = self.read_stored(stored, 0, len).await?;
        Ok((header, bytes, claimed))
    }

    /// The keys of `keys` that have no block-0 record in the bucket now, in their order.
    pub fn missing(
        &self,
        job: &str,
        bucket: &str,
        keys: &[String],
    ) -> Result<Vec<String>, StoreError> {
        check_names(job, bucket, None)?;
        self.with_bucket(job, bucket, |b, _| {
            Ok(keys
                .iter()
                .filter(|key| !b.records.contains_key(key.as_str()))
                .cloned()
                .collect())
        })
    }

    /// A reader parked on keys of `bucket` of `job`, woken by the block-0 inserts of the keys it
    /// watches.
    ///
    /// To wait for keys without missing their insert, [`Waiter::watch`] them first, then check
    /// them ([`Store::missing`]), then await [`Waiter::notified`].
    pub fn waiter(&self, job: &str, bucket: &str) -> Waiter {
        Waiter::new(self.shared.waiters.clone(), job, bucket)
    }

    /// Wake every parked [`Waiter`] without an insert (a bucket or job went away, so parked
    /// readers re-check and fail instead of waiting for their deadline).
    pub fn wake_waiters(&self) {
        self.shared.waiters.wake_all();
        self.shared.queue_items.wake_all();
        self.shared.queue_space.wake_all();
    }

    /// Queue ops parked now: dequeues waiting for an item and enqueues waiting for room (each
    /// watches its one segment).
    pub fn parked_queue_ops(&self) -> usize {
        let (items, space) = self.queue_waiters();
        items.watched_keys() + space.watched_keys()
    }

    /// Keys watched by parked readers, each reader counting once per key.
    pub fn watched_keys(&self) -> usize {
        self.shared.waiters.watched_keys()
    }

    /// The header of a block-0 record.
    pub fn lookup(&self, job: &str, bucket: &str, key: &str) -> Result<ObjectHeader, StoreError> {
        check_names(job, bucket, Some(key))?;
        self.with_bucket(job, bucket, |b, _| {
            b.records
                .get(key)
                .map(|r| r.header)
                .ok_or_else(|| not_found(bucket, key))
        })
    }

    /// Remove a block-0 record and return its header. Data blocks are not touched: the client
    /// deletes them with [`Store::delete_blocks`] on the servers that hold them.
    pub fn delete_record(
        &self,
        job: &str,
        bucket: &str,
        key: &str,
    ) -> Result<ObjectHeader, StoreError> {
        self.delete_record_version(job, bucket, key, None)
    }

    /// [`Store::delete_record`], only if the record is `version` when one is given (else
    /// `NotFound`, and the record stays).
    pub fn delete_record_version(
        &self,
        job: &str,
        bucket: &str,
        key: &str,
        version: Option<u64>,
    ) -> Result<ObjectHeader, StoreError> {
        check_names(job, bucket, Some(key))?;
        let record = self.with_bucket(job, bucket, |b, account| {
            if let Some(version) = version {
                if b.records
                    .get(key)
                    .is_some_and(|r| r.header.version != version)
                {
                    return Err(not_found(bucket, key));
                }
            }
            self.take_record(b, account, job, bucket, key)
        })?;
        let header = record.header;
        drop(record);
        Ok(header)
    }

    /// Take `key`'s block-0 record out of the locked bucket `b`: uncount it from the job's
    /// `account` and emit its delete event (not for a fence). Called under the bucket lock, so
    /// a key's events keep the order of its operations.
    fn take_record(
        &self,
        b: &mut BucketIndex,
        account: &JobAccount,
        job: &str,
        bucket: &str,
        key: &str,
    ) -> Result<Record, StoreError> {
        let record = b
            .records
            .remove(key)
            .ok_or_else(|| not_found(bucket, key))?;
        account.objects.fetch_sub(1, Ordering::AcqRel);
        account.entries.fetch_sub(1, Ordering::AcqRel);
        if !record.header.fence() {
            self.shared.events.emit(job, bucket, key, EventOp::Delete);
        }
        Ok(record)
    }

    /// Up to `limit` (1..=`ENUMERATE_LIMIT_MAX`) block-0 records whose key starts with `prefix`
    /// and sorts after `start_after`, as (key, object size), in key order; `true` if more follow.
    pub fn enumerate(
        &self,
        job: &str,
        bucket: &str,
        prefix: &str,
        start_after: Option<&str>,
        limit: u32,
    ) -> Result<(Vec<(String, u64)>, bool), StoreError> {
        check_names(job, bucket, None)?;
        if limit == 0 || limit > ENUMERATE_LIMIT_MAX {
            return Err(StoreError::InvalidLimit {
                limit,
                max: ENUMERATE_LIMIT_MAX,
            });
        }
        if prefix.len() > KEY_MAX_BYTES {
            return Err(StoreError::InvalidName {
                what: "prefix",
                len: prefix.len(),
                max: KEY_MAX_BYTES,
            });
        }
        self.with_bucket(job, bucket, |b, _| {
            let range = match start_after {
                Some(after) if after >= prefix => b
                    .records
                    .range::<str, _>((Bound::Excluded(after), Bound::Unbounded)),
                _ => b
                    .records
                    .range::<str, _>((Bound::Included(prefix), Bound::Unbounded)),
            };
            let mut keys: Vec<(String, u64)> = range
                .take_while(|(key, _)| key.starts_with(prefix))
                .filter(|(_, record)| !record.header.fence())
                .take(limit as usize + 1)
                .map(|(key, record)| (key.clone(), record.header.size))
                .collect();
            let truncated = keys.len() > limit as usize;
            keys.truncate(limit as usize);
            Ok((keys, truncated))
        })
    }

    /// Delete every record and data block whose key starts with `prefix` (PERSIST ones too);
    /// returns (records deleted, bytes charged to everything deleted).
    pub fn delete_prefix(
        &self,
        job: &str,
        bucket: &str,
        prefix: &str,
    ) -> Result<(u64, u64), StoreError> {
        check_names(job, bucket, None)?;
        let first_block = BlockKey {
            key: prefix.to_string(),
            version: 0,
            index: 0,
        };
        let first_segment = SegmentKey {
            name: prefix.to_string(),
            segment: 0,
        };
        let (records, blocks, channels, counts) = self.with_bucket(job, bucket, |b, account| {
            let records = split_prefix(&mut b.records, &prefix.to_string(), |k| k.as_str(), prefix);
            let blocks = split_prefix(&mut b.blocks, &first_block, |k| k.key.as_str(), prefix);
            let queues = split_prefix(&mut b.queues, &first_segment, |k| k.name.as_str(), prefix);
            let appends = split_prefix(&mut b.appends, &first_segment, |k| k.name.as_str(), prefix);
            let counts = self.forget(account, [], blocks.values().cloned());
            let record_counts = self.forget_records(account, &records);
            let channel_bytes = forget_channels(account, &queues, &appends);
            Ok((
                records,
                blocks,
                (queues, appends),
                (record_counts.0, record_counts.1 + counts.1 + channel_bytes),
            ))
        })?;
        drop((records, blocks, channels));
        Ok(counts)
    }
}

/// Whether a GET takes the record it reads out of the index (DELETE on read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// A plain read.
    Never,
    /// DELETE on read: the record is taken whatever it is.
    Always,
    /// DELETE on read of a record whose bytes go with it: a small object's, or (when its size
    /// is at most `inline_bytes_max`) one of one data block held here whole. A striped object's
    /// manifest stays: its reader reads the blocks first and then takes the record with a
    /// delete conditional on its version, so a reader that dies mid-read loses nothing.
    Whole {
        /// The most bytes of one data block sent along with the record (0: none).
        inline_bytes_max: u64,
    },
}
