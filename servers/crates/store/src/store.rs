//! The per-server store: an engine plus the object index, capacity accounting and the semantics
//! of docs/PROTOCOL.md (write-once, DELETE-on-read, PERSIST, buckets, prefixes, jobs).

use std::collections::BTreeMap;
use std::ops::Bound;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pocketflow_protocol::limits::{
    BLOCK_SIZE_MAX_BYTES, BUCKET_NAME_MAX_BYTES, ENUMERATE_LIMIT_MAX, JOB_ID_MAX_BYTES,
    KEY_MAX_BYTES,
};
use pocketflow_protocol::ObjectHeader;

use crate::capacity::{Budget, Charge, JobAccount, INDEX_ENTRY_OVERHEAD_BYTES};
use crate::channels::{forget_channels, SegmentKey};
use crate::engine::dram::DramEngine;
use crate::engine::nvme::{NvmeConfig, NvmeEngine};
use crate::engine::{BlockWriter, Engine, Tier};
use crate::error::StoreError;
use crate::events::{EventOp, Events};
use crate::expiry::{Expiry, Slot};
use crate::index::{
    lock, split_prefix, BlockKey, BucketIndex, BucketRef, JobIndex, JobMap, Record, Stored,
    BUCKETS_PER_JOB_MAX, JOBS_MAX,
};
use crate::leases::Leases;
use crate::throughput::Throughput;
use crate::waiters::{Waiter, Waiters};

/// How to open a [`Store`].
#[derive(Clone, Debug, Default)]
pub struct StoreConfig {
    /// The tier this server serves.
    pub tier: Tier,
    /// Bytes of the tier (the DRAM arena is mapped and prefaulted at this size; an NVMe file is
    /// extended to it).
    pub capacity_bytes: u64,
    /// File or block device of the NVMe tier; required for [`Tier::Nvme`], ignored for DRAM.
    pub nvme_path: Option<PathBuf>,
    /// Whether the server accepts PERSIST objects.
    pub long_running: bool,
    /// How long PERSIST records and data blocks live after they are written (`None`: until the
    /// server exits); see [`Store::expire_persist`].
    pub persist_ttl: Option<Duration>,
}

/// Capacity and usage of the server, for statistics.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    /// Bytes of the tier.
    pub capacity_bytes: u64,
    /// Bytes charged (engine allocations plus index overhead), including writes in progress and
    /// deleted entries a reader still holds.
    pub used_bytes: u64,
    /// Block-0 records (objects) in the index.
    pub objects: u64,
    /// The same per job, for every job with buckets on this server.
    pub per_job: BTreeMap<String, JobUsage>,
}

/// Usage of one job.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct JobUsage {
    /// Bytes charged to the job.
    pub used_bytes: u64,
    /// Block-0 records of the job.
    pub objects: u64,
}

/// One server's objects: shared by all request handlers (it is `Send + Sync`; clones share).
///
/// Jobs are isolated: every operation names its job first, and no operation of one job reaches
/// another's index. Every method locks at most one bucket at a time, briefly, and never across
/// an await.
#[derive(Clone)]
pub struct Store {
    shared: Arc<Shared>,
}

struct Shared {
    engine: Arc<dyn Engine>,
    budget: Arc<Budget>,
    jobs: JobMap,
    long_running: bool,
    expiry: Option<Arc<Expiry>>,
    /// Readers parked on absent keys; a block-0 insert wakes those watching its key.
    waiters: Arc<Waiters>,
    /// Dequeues parked on empty queue segments; an enqueue or a seal wakes them.
    pub(crate) queue_items: Arc<Waiters>,
    /// Enqueues parked on full queue segments; a dequeue or a seal wakes them.
    pub(crate) queue_space: Arc<Waiters>,
    /// Subscriptions to the job's operations (notifications).
    events: Events,
    /// Prefix leases.
    leases: Leases,
}

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

fn check_name(what: &'static str, name: &str, max: usize) -> Result<(), StoreError> {
    if name.is_empty() || name.len() > max {
        return Err(StoreError::InvalidName {
            what,
            len: name.len(),
            max,
        });
    }
    Ok(())
}

pub(crate) fn check_names(job: &str, bucket: &str, key: Option<&str>) -> Result<(), StoreError> {
    check_name("job", job, JOB_ID_MAX_BYTES)?;
    check_name("bucket", bucket, BUCKET_NAME_MAX_BYTES)?;
    if let Some(key) = key {
        check_name("key", key, KEY_MAX_BYTES)?;
    }
    Ok(())
}

fn not_found(bucket: &str, key: &str) -> StoreError {
    StoreError::NotFound {
        bucket: bucket.to_string(),
        key: key.to_string(),
    }
}

fn bucket_not_found(bucket: &str) -> StoreError {
    StoreError::BucketNotFound {
        bucket: bucket.to_string(),
    }
}

/// Bytes that a read hands out, holding the entry (and so its space) until dropped.
struct HeldBytes {
    bytes: Bytes,
    _stored: Arc<Stored>,
}

impl AsRef<[u8]> for HeldBytes {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Store {
    /// Open the engine of `config.tier` and an empty index.
    pub fn open(config: StoreConfig) -> Result<Self, StoreError> {
        let engine: Arc<dyn Engine> = match config.tier {
            Tier::Dram => Arc::new(DramEngine::open(config.capacity_bytes, true)?),
            Tier::Nvme => {
                let path = config.nvme_path.ok_or(StoreError::NvmePathRequired)?;
                Arc::new(NvmeEngine::open(NvmeConfig::new(
                    path,
                    config.capacity_bytes,
                ))?)
            }
        };
        Ok(Self::build(engine, config.long_running, config.persist_ttl))
    }

    /// A store over an already opened engine (tests, benchmarks, other engines).
    pub fn with_engine(engine: Arc<dyn Engine>, long_running: bool) -> Self {
        Self::build(engine, long_running, None)
    }

    fn build(engine: Arc<dyn Engine>, long_running: bool, persist_ttl: Option<Duration>) -> Self {
        let budget = Budget::new(engine.capacity_bytes());
        Self {
            shared: Arc::new(Shared {
                engine,
                budget,
                jobs: JobMap::default(),
                long_running,
                expiry: persist_ttl.map(|ttl| Arc::new(Expiry::new(ttl))),
                waiters: Arc::new(Waiters::default()),
                queue_items: Arc::new(Waiters::default()),
                queue_space: Arc::new(Waiters::default()),
                events: Events::default(),
                leases: Leases::default(),
            }),
        }
    }

    /// The tier of the engine.
    pub fn tier(&self) -> Tier {
        self.shared.engine.tier()
    }

    /// Whether PERSIST objects are accepted.
    pub fn long_running(&self) -> bool {
        self.shared.long_running
    }

    /// Bytes of the tier.
    pub fn capacity_bytes(&self) -> u64 {
        self.shared.budget.capacity_bytes()
    }

    /// Bytes charged now (see [`Usage::used_bytes`]).
    pub fn used_bytes(&self) -> u64 {
        self.shared.budget.used_bytes()
    }

    /// Bytes the engine has allocated now, index overhead not included.
    pub fn engine_used_bytes(&self) -> u64 {
        self.shared.engine.used_bytes()
    }

    /// Measure what the engine can move: one test block of `min(64 MiB, capacity / 8)` written
    /// and read back in 1 MiB pieces below the index, then freed (see [`crate::throughput`]).
    /// `None` when the tier is too small for a test block. Run it before serving.
    pub async fn measure_throughput(&self) -> Result<Option<Throughput>, StoreError> {
        crate::throughput::measure(self.shared.engine.as_ref()).await
    }

    /// The subscriptions of this server (notifications).
    pub fn events(&self) -> &Events {
        &self.shared.events
    }

    /// Renew (or start) leases of `prefixes` of `job` for `lease_ms`; see [`Leases::renew`].
    pub fn renew_leases(
        &self,
        job: &str,
        prefixes: &[String],
        lease_ms: u64,
    ) -> Result<usize, StoreError> {
        for prefix in prefixes {
            check_name("prefix", prefix, KEY_MAX_BYTES - 1)?;
        }
        self.shared.leases.renew(job, prefixes, lease_ms)
    }

    /// Free every prefix whose lease lapsed by `now`: in every bucket of its job, the records,
    /// data blocks, queues and append files under `<prefix>/`; each one's subscribers get a
    /// `lease_expired` event. A lease that had lapsed or been ended was freed then: its second
    /// lapse, one lease later, frees what a straggler wrote under it since, with an event only
    /// if that deleted records. Returns (job, prefix, bytes freed) per lapsed lease.
    pub fn expire_leases(&self, now: Instant) -> Vec<(String, String, u64)> {
        self.shared
            .leases
            .take_lapsed(now)
            .into_iter()
            .map(|lapsed| {
                let bytes = self.free_prefix(&lapsed.job, &lapsed.prefix, !lapsed.ended);
                (lapsed.job, lapsed.prefix, bytes)
            })
            .collect()
    }

    /// End the leases of `prefixes` of `job` now (the job consumed their data) and free each
    /// one as a lapse would; prefixes that hold no lease here are skipped. Returns how many
    /// ended and the bytes freed.
    pub fn end_leases(&self, job: &str, prefixes: &[String]) -> Result<(usize, u64), StoreError> {
        for prefix in prefixes {
            check_name("prefix", prefix, KEY_MAX_BYTES - 1)?;
        }
        let ended = self.shared.leases.end(job, prefixes);
        let bytes = ended.iter().map(|p| self.free_prefix(job, p, true)).sum();
        Ok((ended.len(), bytes))
    }

    /// Free what `job` holds under `<prefix>/` in every bucket and emit `lease_expired`
    /// (without `always`, only when it deleted records).
    fn free_prefix(&self, job: &str, prefix: &str, always: bool) -> u64 {
        let scope = format!("{prefix}/");
        let buckets: Vec<String> = self.job(job).map_or_else(Vec::new, |j| {
            j.buckets
                .read()
                .expect("bucket map lock poisoned")
                .keys()
                .cloned()
                .collect()
        });
        let (deleted, bytes) = buckets
            .iter()
            .filter_map(|bucket| self.delete_prefix(job, bucket, &scope).ok())
            .fold((0, 0), |(n, b), (count, bytes)| (n + count, b + bytes));
        if always || deleted > 0 {
            self.shared
                .events
                .emit(job, "", prefix, EventOp::LeaseExpired);
        }
        bytes
    }

    /// The server-wide byte budget (channels charge their segments to it).
    pub(crate) fn budget(&self) -> &Arc<Budget> {
        &self.shared.budget
    }

    /// A parked op on `waiters`, for keys of `bucket` of `job`.
    pub(crate) fn waiter_on(&self, waiters: &Arc<Waiters>, job: &str, bucket: &str) -> Waiter {
        Waiter::new(Arc::clone(waiters), job, bucket)
    }

    /// The parked dequeues and enqueues of queue segments.
    pub(crate) fn queue_waiters(&self) -> (&Arc<Waiters>, &Arc<Waiters>) {
        (&self.shared.queue_items, &self.shared.queue_space)
    }

    fn job(&self, job: &str) -> Option<Arc<JobIndex>> {
        self.shared
            .jobs
            .read()
            .expect("job map lock poisoned")
            .get(job)
            .cloned()
    }

    pub(crate) fn bucket(
        &self,
        job: &str,
        bucket: &str,
    ) -> Result<(Arc<JobIndex>, BucketRef), StoreError> {
        let job_index = self.job(job).ok_or_else(|| bucket_not_found(bucket))?;
        let bucket_ref = job_index
            .buckets
            .read()
            .expect("bucket map lock poisoned")
            .get(bucket)
            .cloned();
        let bucket_ref = bucket_ref.ok_or_else(|| bucket_not_found(bucket))?;
        Ok((job_index, bucket_ref))
    }

    /// Run `f` on the locked bucket; what `f` returns is dropped by the caller, after the lock.
    pub(crate) fn with_bucket<R>(
        &self,
        job: &str,
        bucket: &str,
        f: impl FnOnce(&mut BucketIndex, &Arc<JobAccount>) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        let (job_index, bucket_ref) = self.bucket(job, bucket)?;
        let mut guard = lock(&bucket_ref);
        if guard.removed {
            return Err(bucket_not_found(bucket));
        }
        f(&mut guard, &job_index.account)
    }

    /// Create a bucket of `job` on this server.
    pub fn create_bucket(&self, job: &str, bucket: &str) -> Result<(), StoreError> {
        check_names(job, bucket, None)?;
        let mut jobs = self.shared.jobs.write().expect("job map lock poisoned");
        if !jobs.contains_key(job) && jobs.len() >= JOBS_MAX {
            return Err(StoreError::TooManyJobs { max: JOBS_MAX });
        }
        let job_index = jobs.entry(job.to_string()).or_default();
        job_index.released.store(false, Ordering::Release);
        let mut buckets = job_index.buckets.write().expect("bucket map lock poisoned");
        if buckets.contains_key(bucket) {
            return Err(StoreError::BucketExists {
                bucket: bucket.to_string(),
            });
        }
        if buckets.len() >= BUCKETS_PER_JOB_MAX {
            return Err(StoreError::TooManyBuckets {
                max: BUCKETS_PER_JOB_MAX,
            });
        }
        buckets.insert(bucket.to_string(), BucketRef::default());
        Ok(())
    }

    /// Delete a bucket with every record and data block in it (PERSIST ones too); returns the
    /// bytes charged to them. A job left without buckets is forgotten.
    pub fn delete_bucket(&self, job: &str, bucket: &str) -> Result<u64, StoreError> {
        check_names(job, bucket, None)?;
        let job_index = self.job(job).ok_or_else(|| bucket_not_found(bucket))?;
        let removed = job_index
            .buckets
            .write()
            .expect("bucket map lock poisoned")
            .remove(bucket);
        let bucket_ref = removed.ok_or_else(|| bucket_not_found(bucket))?;
        let (records, blocks, queues, appends) = {
            let mut guard = lock(&bucket_ref);
            guard.removed = true;
            (
                std::mem::take(&mut guard.records),
                std::mem::take(&mut guard.blocks),
                std::mem::take(&mut guard.queues),
                std::mem::take(&mut guard.appends),
            )
        };
        let freed =
            self.forget(
                &job_index.account,
                records.into_values(),
                blocks.into_values(),
            )
            .1 + forget_channels(&job_index.account, &queues, &appends);
        drop((queues, appends));
        self.prune_job(job);
        Ok(freed)
    }

    /// Uncount removed entries from `account`; returns (records, bytes charged to all of them).
    /// Dropping the entries (here, outside every lock) frees their space unless a reader holds it.
    fn forget(
        &self,
        account: &JobAccount,
        records: impl IntoIterator<Item = Record>,
        blocks: impl IntoIterator<Item = Arc<Stored>>,
    ) -> (u64, u64) {
        let mut record_count = 0;
        let mut entry_count = 0;
        let mut freed = 0;
        for record in records {
            record_count += 1;
            entry_count += 1;
            freed += record.stored.charge.bytes();
        }
        for block in blocks {
            entry_count += 1;
            freed += block.charge.bytes();
        }
        account.objects.fetch_sub(record_count, Ordering::AcqRel);
        account.entries.fetch_sub(entry_count, Ordering::AcqRel);
        (record_count, freed)
    }

    /// Remove `job` from the job map if it has no buckets left.
    fn prune_job(&self, job: &str) {
        let mut jobs = self.shared.jobs.write().expect("job map lock poisoned");
        let empty = jobs.get(job).is_some_and(|j| {
            j.buckets
                .read()
                .expect("bucket map lock poisoned")
                .is_empty()
        });
        if empty {
            jobs.remove(job);
        }
    }

    /// Charge and write the bytes of a new entry.
    pub(crate) async fn store_bytes(
        &self,
        account: &Arc<JobAccount>,
        key: &str,
        value: Bytes,
        persist: bool,
    ) -> Result<Arc<Stored>, StoreError> {
        let len = value.len() as u64;
        let engine = &self.shared.engine;
        let allocation = if len == 0 {
            0
        } else {
            engine.allocation_bytes(len)
        };
        let charge = self.shared.budget.charge(
            account,
            allocation + INDEX_ENTRY_OVERHEAD_BYTES + key.len() as u64,
        )?;
        let block = if len == 0 {
            None
        } else {
            let mut writer = engine.begin_write(len)?;
            writer.append(value).await?;
            Some(writer.finish().await?)
        };
        Ok(Arc::new(Stored {
            block,
            persist,
            charge,
        }))
    }

    /// Read `len` bytes at `offset` of an entry; the bytes hold the entry until dropped.
    pub(crate) async fn read_stored(
        &self,
        stored: Arc<Stored>,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, StoreError> {
        let Some(block) = stored.block.as_ref() else {
            return Ok(Bytes::new());
        };
        if len == 0 {
            return Ok(Bytes::new());
        }
        let bytes = self.shared.engine.read(block, offset, len).await?;
        assert_eq!(bytes.len() as u64, len, "engine returned a short read");
        Ok(Bytes::from_owner(HeldBytes {
            bytes,
            _stored: stored,
        }))
    }

    /// Insert a block-0 record: a small object (`value.len() == header.size`, no data blocks) or
    /// a manifest (`value` empty, `header.block_count > 0`). Write-once: fails with
    /// `AlreadyExists` unless `overwrite`, in which case the replaced header is returned. A failed
    /// put leaves nothing behind.
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
        let expected = if header.is_small() { header.size } else { 0 };
        if value.len() as u64 != expected {
            return Err(StoreError::ValueLengthMismatch {
                expected,
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
        let stored = self
            .store_bytes(&job_index.account, key, value, header.persist())
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
            let replaced = match guard.records.get_mut(key) {
                Some(_) if !overwrite => {
                    return Err(StoreError::AlreadyExists {
                        bucket: bucket.to_string(),
                        key: key.to_string(),
                    });
                }
                Some(existing) => Some(std::mem::replace(existing, record)),
                None => {
                    guard.records.insert(key.to_string(), record);
                    job_index.account.objects.fetch_add(1, Ordering::AcqRel);
                    job_index.account.entries.fetch_add(1, Ordering::AcqRel);
                    None
                }
            };
            // Under the bucket lock, so a key's events keep the order of its operations.
            self.shared.events.emit(job, bucket, key, EventOp::Put);
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
        check_names(job, bucket, Some(key))?;
        let (header, stored) = self.with_bucket(job, bucket, |b, account| {
            if delete {
                let record = b
                    .records
                    .remove(key)
                    .ok_or_else(|| not_found(bucket, key))?;
                account.objects.fetch_sub(1, Ordering::AcqRel);
                account.entries.fetch_sub(1, Ordering::AcqRel);
                // Under the bucket lock, so a key's events keep the order of its operations.
                self.shared.events.emit(job, bucket, key, EventOp::Delete);
                Ok((record.header, record.stored))
            } else {
                let record = b.records.get(key).ok_or_else(|| not_found(bucket, key))?;
                Ok((record.header, Arc::clone(&record.stored)))
            }
        })?;
        let len = stored.block.as_ref().map_or(0, |block| block.len());
        assert_eq!(
            len,
            if header.is_small() { header.size } else { 0 },
            "record bytes disagree with the header"
        );
        let bytes = self.read_stored(stored, 0, len).await?;
        Ok((header, bytes))
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
            let record = b
                .records
                .remove(key)
                .ok_or_else(|| not_found(bucket, key))?;
            account.objects.fetch_sub(1, Ordering::AcqRel);
            account.entries.fetch_sub(1, Ordering::AcqRel);
            self.shared.events.emit(job, bucket, key, EventOp::Delete);
            Ok(record)
        })?;
        let header = record.header;
        drop(record);
        Ok(header)
    }

    /// Reserve `len` bytes for data block `index` (>= 1) of `(key, version)` and return its
    /// writer. Fails with `CapacityExhausted` (nothing reserved), `BucketNotFound`,
    /// `PersistRefused`, `BlockTooLarge` or `BlockExists`.
    #[allow(clippy::too_many_arguments)]
    pub fn begin_block(
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
        let charge = self.shared.budget.charge(&job_index.account, cost)?;
        let writer = engine.begin_write(len)?;
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

    /// [`Store::forget`] for records still in a map (they are dropped by the caller).
    fn forget_records(
        &self,
        account: &JobAccount,
        records: &BTreeMap<String, Record>,
    ) -> (u64, u64) {
        let freed = records.values().map(|r| r.stored.charge.bytes()).sum();
        let count = records.len() as u64;
        account.objects.fetch_sub(count, Ordering::AcqRel);
        account.entries.fetch_sub(count, Ordering::AcqRel);
        (count, freed)
    }

    /// Delete every non-PERSIST record and data block of `job`; returns (records deleted, bytes
    /// charged to everything deleted). Buckets left with no data are removed, and the job is
    /// forgotten if no bucket remains, so a deregistered job leaves nothing behind; a job that
    /// keeps working afterwards creates its buckets again.
    pub fn delete_job(&self, job: &str) -> (u64, u64) {
        self.delete_job_data(job, true)
    }

    /// [`Store::delete_job`] that also deletes the job's PERSIST records and blocks: what an
    /// operator runs on the data an ended job left behind (`pocketflow persist rm`).
    pub fn delete_job_with_persist(&self, job: &str) -> (u64, u64) {
        self.delete_job_data(job, false)
    }

    fn delete_job_data(&self, job: &str, keep_persist: bool) -> (u64, u64) {
        self.shared.leases.forget_job(job);
        let Some(job_index) = self.job(job) else {
            return (0, 0);
        };
        let buckets: Vec<BucketRef> = job_index
            .buckets
            .read()
            .expect("bucket map lock poisoned")
            .values()
            .cloned()
            .collect();
        let mut deleted = 0;
        let mut freed = 0;
        for bucket_ref in buckets {
            let (records, blocks, channels) = {
                let mut guard = lock(&bucket_ref);
                // Queues and append files are never PERSIST: they go with the job.
                let channels = (
                    std::mem::take(&mut guard.queues),
                    std::mem::take(&mut guard.appends),
                );
                let (keep_records, records) = std::mem::take(&mut guard.records)
                    .into_iter()
                    .partition(|(_, r)| keep_persist && r.header.persist());
                let (keep_blocks, blocks) = std::mem::take(&mut guard.blocks)
                    .into_iter()
                    .partition(|(_, s)| keep_persist && s.persist);
                guard.records = keep_records;
                guard.blocks = keep_blocks;
                let records: BTreeMap<String, Record> = records;
                let blocks: BTreeMap<BlockKey, Arc<Stored>> = blocks;
                (records, blocks, channels)
            };
            let (count, bytes) = self.forget(
                &job_index.account,
                records.into_values(),
                blocks.into_values(),
            );
            deleted += count;
            freed += bytes + forget_channels(&job_index.account, &channels.0, &channels.1);
            drop(channels);
        }
        job_index.released.store(true, Ordering::Release);
        let mut jobs = self.shared.jobs.write().expect("job map lock poisoned");
        let mut buckets = job_index.buckets.write().expect("bucket map lock poisoned");
        buckets.retain(|_, bucket_ref| {
            let mut guard = lock(bucket_ref);
            guard.removed = guard.is_empty();
            !guard.removed
        });
        if buckets.is_empty() {
            jobs.remove(job);
        }
        (deleted, freed)
    }

    /// The time-to-live of PERSIST entries, if they expire.
    pub fn persist_ttl(&self) -> Option<Duration> {
        self.shared.expiry.as_ref().map(|e| e.ttl())
    }

    /// PERSIST records and data blocks whose time-to-live has passed by `now`: up to `max` of
    /// them are deleted; returns (entries deleted, bytes charged to them). A job that was
    /// deregistered (`delete_job`) loses the buckets this leaves empty, and is forgotten when it
    /// has none left. Call it again while it returns `max` entries.
    pub fn expire_persist(&self, now: Instant, max: usize) -> (u64, u64) {
        let Some(expiry) = &self.shared.expiry else {
            return (0, 0);
        };
        let mut deleted = 0;
        let mut freed = 0;
        for due in expiry.take_due(now, max) {
            let Some(target) = due.stored.upgrade() else {
                continue;
            };
            let Ok((job_index, bucket_ref)) = self.bucket(&due.job, &due.bucket) else {
                continue;
            };
            let (records, blocks, now_empty) = {
                let mut guard = lock(&bucket_ref);
                let mut records = Vec::new();
                let mut blocks = Vec::new();
                match &due.slot {
                    Slot::Record(key) => {
                        if guard
                            .records
                            .get(key)
                            .is_some_and(|r| Arc::ptr_eq(&r.stored, &target))
                        {
                            records.extend(guard.records.remove(key));
                        }
                    }
                    Slot::Block(address) => {
                        if guard
                            .blocks
                            .get(address)
                            .is_some_and(|b| Arc::ptr_eq(b, &target))
                        {
                            blocks.extend(guard.blocks.remove(address));
                        }
                    }
                }
                (records, blocks, guard.is_empty())
            };
            drop(target);
            let entries = (records.len() + blocks.len()) as u64;
            let (_, bytes) = self.forget(&job_index.account, records, blocks);
            deleted += entries;
            freed += bytes;
            if now_empty && job_index.released.load(Ordering::Acquire) {
                self.remove_empty_buckets(&due.job, &job_index);
            }
        }
        (deleted, freed)
    }

    /// Remove the empty buckets of a released job, and the job if none remain.
    fn remove_empty_buckets(&self, job: &str, job_index: &Arc<JobIndex>) {
        let mut jobs = self.shared.jobs.write().expect("job map lock poisoned");
        // Re-checked under the job map lock: a new create_bucket clears `released` under it.
        if !job_index.released.load(Ordering::Acquire) {
            return;
        }
        let mut buckets = job_index.buckets.write().expect("bucket map lock poisoned");
        buckets.retain(|_, bucket_ref| {
            let mut guard = lock(bucket_ref);
            guard.removed = guard.is_empty();
            !guard.removed
        });
        if buckets.is_empty() && jobs.get(job).is_some_and(|j| Arc::ptr_eq(j, job_index)) {
            jobs.remove(job);
        }
    }

    /// Capacity, usage and object counts, in total and per job.
    pub fn usage(&self) -> Usage {
        let jobs = self.shared.jobs.read().expect("job map lock poisoned");
        let per_job: BTreeMap<String, JobUsage> = jobs
            .iter()
            .map(|(name, job)| {
                let usage = JobUsage {
                    used_bytes: job.account.used_bytes.load(Ordering::Acquire),
                    objects: job.account.objects.load(Ordering::Acquire),
                };
                (name.clone(), usage)
            })
            .collect();
        Usage {
            capacity_bytes: self.capacity_bytes(),
            used_bytes: self.used_bytes(),
            objects: per_job.values().map(|j| j.objects).sum(),
            per_job,
        }
    }

    /// Whether the index holds no record and no data block of any job (a draining server may
    /// exit).
    pub fn is_empty(&self) -> bool {
        let jobs = self.shared.jobs.read().expect("job map lock poisoned");
        jobs.values()
            .all(|job| job.account.entries.load(Ordering::Acquire) == 0)
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

#[cfg(test)]
mod tests {
    use pocketflow_protocol::HEADER_FLAG_PERSIST;

    use super::*;

    const JOB: &str = "job-a";

    /// A store of `tier`; the temporary directory of an NVMe file lives as long as the store.
    fn open(
        tier: Tier,
        capacity_bytes: u64,
        long_running: bool,
    ) -> (Store, Option<tempfile::TempDir>) {
        let dir = (tier == Tier::Nvme)
            .then(|| tempfile::tempdir_in("/tmp").expect("temp dir on an O_DIRECT file system"));
        let nvme_path = dir.as_ref().map(|d| d.path().join("blocks"));
        let store = Store::open(StoreConfig {
            tier,
            capacity_bytes,
            nvme_path,
            long_running,
            persist_ttl: None,
        })
        .unwrap();
        (store, dir)
    }

    /// A long-running store whose PERSIST entries live `ttl`.
    fn open_with_ttl(tier: Tier, ttl: Duration) -> (Store, Option<tempfile::TempDir>) {
        let (store, dir) = open(tier, 1 << 20, true);
        let engine = Arc::clone(&store.shared.engine);
        drop(store);
        (Store::build(engine, true, Some(ttl)), dir)
    }

    fn small(version: u64, value: &[u8]) -> ObjectHeader {
        ObjectHeader {
            version,
            size: value.len() as u64,
            ..Default::default()
        }
    }

    fn manifest(version: u64, size: u64, block_size: u32) -> ObjectHeader {
        let block_count = size.div_ceil(u64::from(block_size)) as u32;
        ObjectHeader {
            version,
            size,
            block_count,
            block_size,
            flags: 0,
        }
    }

    fn pattern(len: usize, seed: u8) -> Bytes {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
            .collect::<Vec<_>>()
            .into()
    }

    async fn put(
        store: &Store,
        bucket: &str,
        key: &str,
        value: &[u8],
    ) -> Result<Option<ObjectHeader>, StoreError> {
        store
            .put_record(
                JOB,
                bucket,
                key,
                small(1, value),
                Bytes::copy_from_slice(value),
                false,
            )
            .await
    }

    /// A small PERSIST record of version 1 in bucket "b" (replacing one when `overwrite`).
    async fn put_persist(
        store: &Store,
        key: &str,
        value: &'static [u8],
        overwrite: bool,
    ) -> Result<Option<ObjectHeader>, StoreError> {
        let header = ObjectHeader {
            flags: HEADER_FLAG_PERSIST,
            ..small(1, value)
        };
        store
            .put_record(JOB, "b", key, header, Bytes::from_static(value), overwrite)
            .await
    }

    /// The PERSIST data block 1 of "big" (version 9) in bucket "b": `abc`.
    async fn put_persist_block(store: &Store) {
        let mut write = store.begin_block(JOB, "b", "big", 9, 1, 3, true).unwrap();
        write.append(Bytes::from_static(b"abc")).await.unwrap();
        write.commit().await.unwrap();
    }

    async fn put_block(
        store: &Store,
        key: &str,
        version: u64,
        index: u32,
        data: &Bytes,
    ) -> Result<(), StoreError> {
        let mut write =
            store.begin_block(JOB, "b", key, version, index, data.len() as u64, false)?;
        for piece in data.chunks(7000) {
            write.append(data.slice_ref(piece)).await?;
        }
        write.commit().await
    }

    async fn small_objects_round_trip(tier: Tier) {
        let (store, _dir) = open(tier, 1 << 20, false);
        store.create_bucket(JOB, "b").unwrap();
        assert!(matches!(
            store.create_bucket(JOB, "b"),
            Err(StoreError::BucketExists { .. })
        ));
        assert_eq!(put(&store, "b", "k1", b"hello").await.unwrap(), None);
        put(&store, "b", "empty", b"").await.unwrap();
        let (header, value) = store.get_record(JOB, "b", "k1", false).await.unwrap();
        assert_eq!((header.size, &value[..]), (5, &b"hello"[..]));
        assert_eq!(
            store
                .get_record(JOB, "b", "empty", false)
                .await
                .unwrap()
                .1
                .len(),
            0
        );
        assert_eq!(store.lookup(JOB, "b", "k1").unwrap(), header);
        drop(value);
        assert_eq!(store.usage().objects, 2);
        let allocation = if tier == Tier::Dram { 64 } else { 4096 };
        let expected_used = allocation + 2 * INDEX_ENTRY_OVERHEAD_BYTES + 2 + 5;
        assert_eq!(store.used_bytes(), expected_used);
        assert_eq!(
            store.usage().per_job[JOB],
            JobUsage {
                used_bytes: expected_used,
                objects: 2
            }
        );
        // A delete of another version leaves the record; of its own version removes it.
        assert!(matches!(
            store.delete_record_version(JOB, "b", "k1", Some(header.version + 1)),
            Err(StoreError::NotFound { .. })
        ));
        assert_eq!(
            store
                .delete_record_version(JOB, "b", "k1", Some(header.version))
                .unwrap(),
            header
        );
        put(&store, "b", "k1", b"hello").await.unwrap();
        assert_eq!(store.delete_record(JOB, "b", "k1").unwrap(), header);
        assert!(matches!(
            store.get_record(JOB, "b", "k1", false).await,
            Err(StoreError::NotFound { .. })
        ));
        assert!(matches!(
            store.delete_record(JOB, "b", "k1"),
            Err(StoreError::NotFound { .. })
        ));
        assert!(matches!(
            put(&store, "nope", "k", b"x").await,
            Err(StoreError::BucketNotFound { .. })
        ));
        assert_eq!(
            store.delete_bucket(JOB, "b").unwrap(),
            INDEX_ENTRY_OVERHEAD_BYTES + 5
        );
        assert!(matches!(
            store.delete_bucket(JOB, "b"),
            Err(StoreError::BucketNotFound { .. })
        ));
        assert_eq!(store.used_bytes(), 0);
        assert!(store.is_empty());
        assert!(store.usage().per_job.is_empty());
    }

    async fn write_once_and_overwrite(tier: Tier) {
        let (store, _dir) = open(tier, 1 << 20, false);
        store.create_bucket(JOB, "b").unwrap();
        put(&store, "b", "k", b"first").await.unwrap();
        let used = store.used_bytes();
        let second = store
            .put_record(
                JOB,
                "b",
                "k",
                small(2, b"second"),
                Bytes::from_static(b"second"),
                false,
            )
            .await;
        assert!(matches!(second, Err(StoreError::AlreadyExists { .. })));
        assert_eq!(
            store.used_bytes(),
            used,
            "a refused put leaves nothing behind"
        );
        let replaced = store
            .put_record(
                JOB,
                "b",
                "k",
                small(2, b"second"),
                Bytes::from_static(b"second"),
                true,
            )
            .await
            .unwrap();
        assert_eq!(replaced.map(|h| h.version), Some(1));
        let (header, value) = store.get_record(JOB, "b", "k", false).await.unwrap();
        assert_eq!((header.version, &value[..]), (2, &b"second"[..]));
        assert_eq!(store.usage().objects, 1);
    }

    async fn invalid_puts_are_refused(tier: Tier) {
        let (store, _dir) = open(tier, 1 << 20, false);
        store.create_bucket(JOB, "b").unwrap();
        let refused = put_persist(&store, "k", b"x", false).await;
        assert!(matches!(refused, Err(StoreError::PersistRefused)));
        assert!(matches!(
            store.begin_block(JOB, "b", "k", 1, 1, 10, true),
            Err(StoreError::PersistRefused)
        ));
        let mismatch = store
            .put_record(
                JOB,
                "b",
                "k",
                small(1, b"xy"),
                Bytes::from_static(b"x"),
                false,
            )
            .await;
        assert!(matches!(
            mismatch,
            Err(StoreError::ValueLengthMismatch {
                expected: 2,
                actual: 1
            })
        ));
        let manifest_with_value = store
            .put_record(
                JOB,
                "b",
                "k",
                manifest(1, 100, 64),
                Bytes::from_static(b"x"),
                false,
            )
            .await;
        assert!(matches!(
            manifest_with_value,
            Err(StoreError::ValueLengthMismatch {
                expected: 0,
                actual: 1
            })
        ));
        let zero_version = store
            .put_record(
                JOB,
                "b",
                "k",
                small(0, b"x"),
                Bytes::from_static(b"x"),
                false,
            )
            .await;
        assert_eq!(zero_version.unwrap_err().kind(), "invalid_argument");
        let long_key = "k".repeat(KEY_MAX_BYTES + 1);
        assert!(matches!(
            put(&store, "b", &long_key, b"x").await,
            Err(StoreError::InvalidName { what: "key", .. })
        ));
        assert!(matches!(
            store.begin_block(JOB, "b", "k", 1, 0, 10, false),
            Err(StoreError::InvalidBlockAddress { .. })
        ));
        assert!(matches!(
            store.begin_block(JOB, "b", "k", 1, 1, 0, false),
            Err(StoreError::EmptyBlock)
        ));
        let too_large = store.begin_block(
            JOB,
            "b",
            "k",
            1,
            1,
            u64::from(BLOCK_SIZE_MAX_BYTES) + 1,
            false,
        );
        assert!(matches!(too_large, Err(StoreError::BlockTooLarge { .. })));
        assert_eq!(store.used_bytes(), 0);
        assert!(store.is_empty());
    }

    async fn persist_on_long_running(tier: Tier) {
        let (store, _dir) = open(tier, 1 << 20, true);
        store.create_bucket(JOB, "b").unwrap();
        put_persist(&store, "kept", b"keep", false).await.unwrap();
        put(&store, "b", "dropped", b"drop").await.unwrap();
        put_persist_block(&store).await;
        store.create_bucket(JOB, "scratch").unwrap();
        let (deleted, freed) = store.delete_job(JOB);
        assert_eq!(
            (deleted, freed),
            (
                1,
                INDEX_ENTRY_OVERHEAD_BYTES + 7 + if tier == Tier::Dram { 64 } else { 4096 }
            )
        );
        assert_eq!(
            store.get_record(JOB, "b", "kept", false).await.unwrap().1,
            Bytes::from_static(b"keep")
        );
        assert_eq!(
            store.read_block(JOB, "b", "big", 9, 1, 0, 3).await.unwrap(),
            Bytes::from_static(b"abc")
        );
        assert!(matches!(
            store.enumerate(JOB, "scratch", "", None, 10),
            Err(StoreError::BucketNotFound { .. })
        ));
        assert_eq!(store.usage().objects, 1);
        let used = store.used_bytes();
        assert_eq!(store.delete_bucket(JOB, "b").unwrap(), used);
        assert_eq!(store.used_bytes(), 0);
        assert!(store.is_empty());

        // The operator's delete of an ended job's data takes the PERSIST data too.
        store.create_bucket(JOB, "b").unwrap();
        put_persist(&store, "kept", b"keep", false).await.unwrap();
        put_persist_block(&store).await;
        store.delete_job(JOB);
        let used = store.used_bytes();
        assert!(used > 0);
        // One record ("kept"); the bytes of its data block count too.
        assert_eq!(store.delete_job_with_persist(JOB), (1, used));
        assert_eq!(store.used_bytes(), 0);
        assert!(store.is_empty());
        assert!(store.usage().per_job.is_empty());
        assert_eq!(store.delete_job_with_persist(JOB), (0, 0));
    }

    async fn data_blocks(tier: Tier) {
        let (store, _dir) = open(tier, 4 << 20, false);
        store.create_bucket(JOB, "b").unwrap();
        let data = pattern(100_000, 4);
        put_block(&store, "obj", 5, 1, &data).await.unwrap();
        put_block(&store, "obj", 5, 2, &data.slice(..10))
            .await
            .unwrap();
        store
            .put_record(
                JOB,
                "b",
                "obj",
                manifest(5, 100_010, 100_000),
                Bytes::new(),
                false,
            )
            .await
            .unwrap();
        assert_eq!(
            store
                .get_record(JOB, "b", "obj", false)
                .await
                .unwrap()
                .1
                .len(),
            0
        );
        assert_eq!(
            store
                .read_block(JOB, "b", "obj", 5, 1, 0, 100_000)
                .await
                .unwrap(),
            data
        );
        assert_eq!(
            store
                .read_block(JOB, "b", "obj", 5, 1, 4095, 3)
                .await
                .unwrap(),
            data.slice(4095..4098)
        );
        assert_eq!(
            store
                .read_block(JOB, "b", "obj", 5, 2, 10, 0)
                .await
                .unwrap()
                .len(),
            0
        );
        assert_eq!(
            store.block_len(JOB, "b", "obj", 5, 1).unwrap(),
            Some(100_000)
        );
        assert_eq!(store.block_len(JOB, "b", "obj", 5, 2).unwrap(), Some(10));
        assert_eq!(store.block_len(JOB, "b", "obj", 5, 3).unwrap(), None);
        assert_eq!(store.block_len(JOB, "b", "obj", 6, 1).unwrap(), None);
        assert!(matches!(
            store.block_len(JOB, "nope", "obj", 5, 1),
            Err(StoreError::BucketNotFound { .. })
        ));
        let past_end = store.read_block(JOB, "b", "obj", 5, 2, 5, 6).await;
        assert!(matches!(
            past_end,
            Err(StoreError::InvalidRange {
                offset: 5,
                len: 6,
                block_len: 10
            })
        ));
        assert!(matches!(
            store.read_block(JOB, "b", "obj", 6, 1, 0, 1).await,
            Err(StoreError::BlockNotFound { .. })
        ));
        assert!(matches!(
            put_block(&store, "obj", 5, 1, &data).await,
            Err(StoreError::BlockExists { .. })
        ));
        // Short and long writes are refused, and uncommitted writes free their reservation.
        let before = store.used_bytes();
        let mut short = store
            .begin_block(JOB, "b", "obj", 7, 1, 100, false)
            .unwrap();
        short.append(pattern(50, 0)).await.unwrap();
        assert!(matches!(
            short.append(pattern(51, 0)).await,
            Err(StoreError::LengthMismatch {
                expected: 100,
                actual: 101
            })
        ));
        assert!(matches!(
            short.commit().await,
            Err(StoreError::LengthMismatch {
                expected: 100,
                actual: 50
            })
        ));
        assert_eq!(store.used_bytes(), before);
        // Blocks read before deletion stay valid and hold their space until dropped.
        let held = store
            .read_block(JOB, "b", "obj", 5, 1, 0, 100_000)
            .await
            .unwrap();
        let freed = store.delete_blocks(JOB, "b", "obj", 5, &[1, 2, 3]).unwrap();
        let block_cost =
            |len| store.shared.engine.allocation_bytes(len) + INDEX_ENTRY_OVERHEAD_BYTES + 3;
        assert_eq!(freed, block_cost(100_000) + block_cost(10));
        assert_eq!(
            store.used_bytes(),
            before - block_cost(10),
            "the held block is still charged"
        );
        assert_eq!(held, data);
        drop(held);
        assert_eq!(store.used_bytes(), before - freed);
        assert_eq!(store.delete_record(JOB, "b", "obj").unwrap().version, 5);
        assert_eq!(store.used_bytes(), 0);
        assert!(store.is_empty());
    }

    async fn exhaustion_leaves_nothing(tier: Tier) {
        let capacity = 256 * 1024;
        let (store, _dir) = open(tier, capacity, false);
        store.create_bucket(JOB, "b").unwrap();
        let data = pattern(60_000, 1);
        let mut stored = 0;
        loop {
            let key = format!("k{stored}");
            match store
                .put_record(JOB, "b", &key, small(1, &data), data.clone(), false)
                .await
            {
                Ok(_) => stored += 1,
                Err(StoreError::CapacityExhausted {
                    requested,
                    available,
                }) => {
                    assert!(requested > available);
                    break;
                }
                Err(other) => panic!("unexpected {other}"),
            }
        }
        assert_eq!(stored, 4);
        assert_eq!(store.usage().objects, 4);
        let used = store.used_bytes();
        assert!(matches!(
            store.begin_block(JOB, "b", "big", 1, 1, 100_000, false),
            Err(StoreError::CapacityExhausted { .. })
        ));
        assert_eq!(store.used_bytes(), used);
        // Freed space is reused.
        let (_, value) = store.get_record(JOB, "b", "k0", true).await.unwrap();
        assert_eq!(
            store.used_bytes(),
            used,
            "a delete-on-read frees when the bytes are dropped"
        );
        drop(value);
        assert!(store.used_bytes() < used);
        put(&store, "b", "again", &data).await.unwrap();
        assert_eq!(store.delete_prefix(JOB, "b", "").unwrap().0, 4);
        assert_eq!(store.used_bytes(), 0);
    }

    async fn concurrent_delete_on_read_has_one_winner(tier: Tier) {
        let (store, _dir) = open(tier, 4 << 20, false);
        store.create_bucket(JOB, "b").unwrap();
        for round in 0..20 {
            let key = format!("k{round}");
            let value = pattern(1000 + round, round as u8);
            put(&store, "b", &key, &value).await.unwrap();
            let readers: Vec<_> = (0..8)
                .map(|_| {
                    let store = store.clone();
                    let key = key.clone();
                    tokio::spawn(async move { store.get_record(JOB, "b", &key, true).await })
                })
                .collect();
            let mut winners = 0;
            for reader in readers {
                match reader.await.unwrap() {
                    Ok((_, bytes)) => {
                        assert_eq!(bytes, value);
                        winners += 1;
                    }
                    Err(StoreError::NotFound { .. }) => {}
                    Err(other) => panic!("unexpected {other}"),
                }
            }
            assert_eq!(winners, 1, "round {round}");
        }
        assert_eq!(store.used_bytes(), 0);
        assert!(store.is_empty());
    }

    async fn jobs_are_isolated(tier: Tier) {
        let (store, _dir) = open(tier, 1 << 20, false);
        store.create_bucket(JOB, "b").unwrap();
        store.create_bucket("job-b", "b").unwrap();
        put(&store, "b", "k", b"mine").await.unwrap();
        assert!(matches!(
            store.get_record("job-b", "b", "k", false).await,
            Err(StoreError::NotFound { .. })
        ));
        assert!(matches!(
            store.lookup("job-c", "b", "k"),
            Err(StoreError::BucketNotFound { .. })
        ));
        assert_eq!(
            store.enumerate("job-b", "b", "", None, 10).unwrap(),
            (vec![], false)
        );
        assert_eq!(store.delete_prefix("job-b", "b", "").unwrap(), (0, 0));
        assert_eq!(store.delete_job("job-b"), (0, 0));
        assert_eq!(
            store.get_record(JOB, "b", "k", false).await.unwrap().1,
            Bytes::from_static(b"mine")
        );
        let usage = store.usage();
        assert_eq!(usage.per_job.keys().collect::<Vec<_>>(), [JOB]);
        assert_eq!(usage.per_job[JOB].used_bytes, usage.used_bytes);
    }

    async fn enumerate_pages_and_prefixes(tier: Tier) {
        let (store, _dir) = open(tier, 4 << 20, false);
        store.create_bucket(JOB, "b").unwrap();
        for i in 0..25 {
            put(&store, "b", &format!("map/{i:02}"), &vec![1; i])
                .await
                .unwrap();
        }
        put(&store, "b", "mapper", b"x").await.unwrap();
        put(&store, "b", "reduce/0", b"y").await.unwrap();
        put_block(&store, "map/99", 3, 1, &pattern(5000, 0))
            .await
            .unwrap();
        let mut seen = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let (page, truncated) = store
                .enumerate(JOB, "b", "map/", after.as_deref(), 10)
                .unwrap();
            assert!(page.len() <= 10);
            seen.extend(page.iter().cloned());
            after = page.last().map(|(k, _)| k.clone());
            if !truncated {
                break;
            }
        }
        let expected: Vec<(String, u64)> =
            (0..25).map(|i| (format!("map/{i:02}"), i as u64)).collect();
        assert_eq!(seen, expected);
        let (page, truncated) = store.enumerate(JOB, "b", "map/", Some("a"), 2).unwrap();
        assert_eq!((page[0].0.as_str(), truncated), ("map/00", true));
        assert_eq!(
            store.enumerate(JOB, "b", "map/", Some("zzz"), 2).unwrap(),
            (vec![], false)
        );
        assert!(matches!(
            store.enumerate(JOB, "b", "", None, 0),
            Err(StoreError::InvalidLimit { .. })
        ));
        assert!(matches!(
            store.enumerate(JOB, "b", "", None, ENUMERATE_LIMIT_MAX + 1),
            Err(StoreError::InvalidLimit { .. })
        ));
        let used = store.used_bytes();
        let (deleted, freed) = store.delete_prefix(JOB, "b", "map/").unwrap();
        assert_eq!(deleted, 25);
        assert_eq!(store.used_bytes(), used - freed);
        assert_eq!(
            store
                .read_block(JOB, "b", "map/99", 3, 1, 0, 1)
                .await
                .unwrap_err()
                .kind(),
            "not_found"
        );
        let rest: Vec<String> = store
            .enumerate(JOB, "b", "", None, 100)
            .unwrap()
            .0
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(rest, ["mapper", "reduce/0"]);
        assert_eq!(store.delete_job(JOB).0, 2);
        assert_eq!(store.used_bytes(), 0);
        assert!(store.is_empty());
        assert!(store.usage().per_job.is_empty());
    }

    async fn deleting_a_bucket_under_a_write_leaks_nothing(tier: Tier) {
        let (store, _dir) = open(tier, 1 << 20, false);
        store.create_bucket(JOB, "b").unwrap();
        let mut write = store
            .begin_block(JOB, "b", "k", 1, 1, 10_000, false)
            .unwrap();
        write.append(pattern(10_000, 1)).await.unwrap();
        assert!(store.used_bytes() > 10_000);
        assert_eq!(store.delete_bucket(JOB, "b").unwrap(), 0);
        store.create_bucket(JOB, "b").unwrap();
        assert!(matches!(
            write.commit().await,
            Err(StoreError::BucketNotFound { .. })
        ));
        assert_eq!(store.used_bytes(), 0);
        assert!(store.is_empty());
        assert!(matches!(
            store.read_block(JOB, "b", "k", 1, 1, 0, 1).await,
            Err(StoreError::BlockNotFound { .. })
        ));
    }

    async fn futures_are_send(tier: Tier) {
        let (store, _dir) = open(tier, 1 << 20, false);
        store.create_bucket(JOB, "b").unwrap();
        let task_store = store.clone();
        let task = tokio::spawn(async move {
            put(&task_store, "b", "k", b"v").await.unwrap();
            let mut write = task_store
                .begin_block(JOB, "b", "k", 1, 1, 1, false)
                .unwrap();
            write.append(Bytes::from_static(b"z")).await.unwrap();
            write.commit().await.unwrap();
            task_store
                .read_block(JOB, "b", "k", 1, 1, 0, 1)
                .await
                .unwrap()
        });
        assert_eq!(task.await.unwrap(), Bytes::from_static(b"z"));
    }

    async fn persist_expires_after_its_ttl(tier: Tier) {
        let ttl = Duration::from_secs(60);
        let (store, _dir) = open_with_ttl(tier, ttl);
        assert_eq!(store.persist_ttl(), Some(ttl));
        store.create_bucket(JOB, "b").unwrap();
        let written = Instant::now();
        put_persist(&store, "kept", b"keep", false).await.unwrap();
        put_persist_block(&store).await;
        // Overwritten before it expires: the replaced version's queue entry is stale.
        put_persist(&store, "twice", b"keep", false).await.unwrap();
        put_persist(&store, "twice", b"kep2", true).await.unwrap();
        put(&store, "b", "plain", b"drop").await.unwrap();
        assert_eq!(store.expire_persist(written + ttl / 2, 100), (0, 0));
        store.delete_job(JOB);
        assert_eq!(store.usage().objects, 2);

        // One entry per pass at most, oldest first.
        let later = Instant::now() + ttl;
        assert_eq!(store.expire_persist(later, 1).0, 1);
        assert!(matches!(
            store.get_record(JOB, "b", "kept", false).await,
            Err(StoreError::NotFound { .. })
        ));
        assert_eq!(
            store.read_block(JOB, "b", "big", 9, 1, 0, 3).await.unwrap(),
            Bytes::from_static(b"abc")
        );
        assert_eq!(store.expire_persist(later, 100).0, 2);
        assert_eq!(store.used_bytes(), 0);
        assert!(store.is_empty());
        // The released job's emptied bucket and the job itself are gone.
        assert!(store.usage().per_job.is_empty());
        assert_eq!(store.expire_persist(later, 100), (0, 0));
    }

    async fn expiry_keeps_the_buckets_of_a_live_job(tier: Tier) {
        let ttl = Duration::from_millis(1);
        let (store, _dir) = open_with_ttl(tier, ttl);
        store.create_bucket(JOB, "b").unwrap();
        put_persist(&store, "k", b"x", false).await.unwrap();
        let (deleted, freed) = store.expire_persist(Instant::now() + ttl, 100);
        assert_eq!(deleted, 1);
        assert!(freed > 0);
        assert_eq!(store.used_bytes(), 0);
        // The job was never deregistered: its bucket stays usable.
        put(&store, "b", "next", b"y").await.unwrap();
        assert_eq!(store.usage().objects, 1);
    }

    async fn without_a_ttl_persist_never_expires(tier: Tier) {
        let (store, _dir) = open(tier, 1 << 20, true);
        store.create_bucket(JOB, "b").unwrap();
        put_persist(&store, "k", b"x", false).await.unwrap();
        let far = Instant::now() + Duration::from_secs(365 * 24 * 3600);
        assert_eq!(store.expire_persist(far, 100), (0, 0));
        assert_eq!(store.persist_ttl(), None);
        assert_eq!(store.usage().objects, 1);
    }

    async fn inserts_wake_the_waiters_of_their_keys(tier: Tier) {
        let (store, _dir) = open(tier, 1 << 20, false);
        store.create_bucket(JOB, "b").unwrap();
        let wanted = vec!["k".to_string()];
        let mut waiter = store.waiter(JOB, "b");
        waiter.watch(&wanted);
        assert_eq!(store.missing(JOB, "b", &wanted).unwrap(), wanted);
        put(&store, "b", "other", b"x").await.unwrap();
        assert!(!waiter.try_notified(), "woken by a key it does not watch");
        put(&store, "b", "k", b"x").await.unwrap();
        assert!(waiter.try_notified());
        assert!(store.missing(JOB, "b", &wanted).unwrap().is_empty());
        assert_eq!(store.watched_keys(), 0);
        waiter.watch(&["later".to_string()]);
        assert_eq!(store.watched_keys(), 1);
        store.delete_bucket(JOB, "b").unwrap();
        store.wake_waiters();
        assert!(waiter.try_notified(), "a deleted bucket wakes its readers");
        drop(waiter);
        assert_eq!(store.watched_keys(), 0);
    }

    async fn ended_leases_free_their_prefixes_now(tier: Tier) {
        let (store, _dir) = open(tier, 1 << 20, true);
        store.create_bucket(JOB, "b").unwrap();
        let p = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        store
            .renew_leases(JOB, &p(&["s1/t0", "s1/t1"]), 60_000)
            .unwrap();
        put(&store, "b", "s1/t0/m0", b"gone").await.unwrap();
        put(&store, "b", "s1/t1/m0", b"kept").await.unwrap();
        put(&store, "b", "s1/t0x", b"not under it").await.unwrap();
        let (ended, freed) = store
            .end_leases(JOB, &p(&["s1/t0", "never-leased"]))
            .unwrap();
        assert_eq!(ended, 1);
        assert!(freed > 0);
        assert!(matches!(
            store.get_record(JOB, "b", "s1/t0/m0", false).await,
            Err(StoreError::NotFound { .. })
        ));
        assert!(store.get_record(JOB, "b", "s1/t1/m0", false).await.is_ok());
        assert!(store.get_record(JOB, "b", "s1/t0x", false).await.is_ok());
        // Ended once: a second end finds no lease.
        assert_eq!(store.end_leases(JOB, &p(&["s1/t0"])).unwrap(), (0, 0));
        assert!(store.end_leases(JOB, &p(&[""])).is_err());
        // A straggler writes under the ended prefix: the ended lease lingers one lease and its
        // lapse frees what was written since.
        put(&store, "b", "s1/t0/late", b"straggler").await.unwrap();
        let far = Instant::now() + Duration::from_secs(3600);
        let lapsed: Vec<(String, bool)> = store
            .expire_leases(far)
            .into_iter()
            .map(|(_, prefix, bytes)| (prefix, bytes > 0))
            .collect();
        assert_eq!(lapsed, vec![("s1/t0".into(), true), ("s1/t1".into(), true)]);
        assert!(matches!(
            store.get_record(JOB, "b", "s1/t0/late", false).await,
            Err(StoreError::NotFound { .. })
        ));
        assert!(store.get_record(JOB, "b", "s1/t0x", false).await.is_ok());
    }

    macro_rules! per_tier {
        ($($name:ident),* $(,)?) => {
            mod dram {
                $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name(super::Tier::Dram).await })*
            }
            mod nvme {
                $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() { super::$name(super::Tier::Nvme).await })*
            }
        };
    }

    per_tier!(
        small_objects_round_trip,
        write_once_and_overwrite,
        invalid_puts_are_refused,
        persist_on_long_running,
        data_blocks,
        exhaustion_leaves_nothing,
        concurrent_delete_on_read_has_one_winner,
        jobs_are_isolated,
        enumerate_pages_and_prefixes,
        deleting_a_bucket_under_a_write_leaks_nothing,
        futures_are_send,
        persist_expires_after_its_ttl,
        expiry_keeps_the_buckets_of_a_live_job,
        without_a_ttl_persist_never_expires,
        inserts_wake_the_waiters_of_their_keys,
        ended_leases_free_their_prefixes_now,
    );
}
