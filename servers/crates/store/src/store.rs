//! The per-server store: an engine plus the object index, capacity accounting and the semantics
//! of docs/PROTOCOL.md (write-once, DELETE-on-read, PERSIST, buckets, prefixes, jobs).
//!
//! This file holds the [`Store`] itself and what every role shares (the index lookups, charging
//! and reading an entry's bytes, forgetting removed entries); each role's operations live in a
//! file of their own: [`records`] (block-0 records), [`blocks`] (data blocks), [`jobs`] (buckets,
//! a job's end, PERSIST expiry), [`prefix_leases`] and [`usage`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pocketflow_protocol::limits::{BUCKET_NAME_MAX_BYTES, JOB_ID_MAX_BYTES, KEY_MAX_BYTES};

use crate::capacity::{Budget, ChargeKind, JobAccount, INDEX_ENTRY_OVERHEAD_BYTES};
use crate::engine::dram::DramEngine;
use crate::engine::nvme::{NvmeConfig, NvmeEngine};
use crate::engine::{BlockWriter, Engine, Tier};
use crate::error::StoreError;
use crate::events::Events;
use crate::expiry::Expiry;
use crate::index::{lock, BucketIndex, BucketRef, JobIndex, JobMap, Record, Stored};
use crate::leases::Leases;
use crate::waiters::{Waiter, Waiters};

mod blocks;
mod jobs;
mod pins;
mod prefix_leases;
mod records;
#[cfg(test)]
mod tests;
mod usage;

pub use blocks::BlockWrite;
pub use pins::PinRead;
pub use records::Claim;
pub use usage::{JobUsage, Usage};

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
    /// Whether the DRAM arena is a sealed memfd that readers on this host may map read-only
    /// (zero-copy reads of pinned objects); ignored for NVMe.
    pub shared_dram: bool,
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
            // A host without sealable memfds (kernels before 5.1) or that refuses them still
            // gets a DRAM server, with a private arena.
            Tier::Dram if config.shared_dram => {
                match DramEngine::open_shared(config.capacity_bytes, true) {
                    Ok(engine) => Arc::new(engine),
                    Err(e) => {
                        eprintln!(
                            "pocketflow-server: warning: cannot share the DRAM arena ({e}); \
                             it is private (readers copy)"
                        );
                        Arc::new(DramEngine::open(config.capacity_bytes, true)?)
                    }
                }
            }
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

    /// The subscriptions of this server (notifications).
    pub fn events(&self) -> &Events {
        &self.shared.events
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

    /// Charge and write the bytes of a new entry.
    pub(crate) async fn store_bytes(
        &self,
        account: &Arc<JobAccount>,
        key: &str,
        value: Bytes,
        persist: bool,
        kind: ChargeKind,
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
            kind,
        )?;
        let block = if len == 0 {
            None
        } else {
            let mut writer = self.begin_write(account, len).await?;
            writer.append(value).await?;
            Some(writer.finish().await?)
        };
        Ok(Arc::new(Stored {
            block,
            persist,
            charge,
        }))
    }

    /// Begin writing `len` bytes of `account`'s job in the engine (waiting a bounded time for
    /// bytes still being freed); a refusal for want of an extent is counted to the job.
    pub(crate) async fn begin_write(
        &self,
        account: &JobAccount,
        len: u64,
    ) -> Result<Box<dyn BlockWriter>, StoreError> {
        let begun = self.shared.engine.begin_write_waiting(len).await;
        if let Err(error) = &begun {
            self.shared.budget.count_refusal(account, error);
        }
        begun
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
}
