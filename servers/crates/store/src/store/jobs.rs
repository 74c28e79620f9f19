//! Buckets and jobs: creating and deleting buckets, a job's end (its non-PERSIST data freed),
//! and the expiry of PERSIST entries after the server's time-to-live.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{bucket_not_found, check_names, Store};
use crate::channels::forget_channels;
use crate::error::StoreError;
use crate::expiry::Slot;
use crate::index::{
    lock, BlockKey, BucketRef, JobIndex, Record, Stored, BUCKETS_PER_JOB_MAX, JOBS_MAX,
};

impl Store {
    /// Create a bucket of `job` on this server.
    pub fn create_bucket(&self, job: &str, bucket: &str) -> Result<(), StoreError> {
        check_names(job, bucket, None)?;
        let mut jobs = self.shared.jobs.write().expect("job map lock poisoned");
        if !jobs.contains_key(job) && jobs.len() >= JOBS_MAX {
            return Err(StoreError::TooManyJobs { max: JOBS_MAX });
        }
        let job_index = jobs.entry(job.to_string()).or_insert_with(|| {
            // A job that holds a reservation here charges the account that holds it.
            Arc::new(JobIndex {
                account: self.shared.budget.reserved_account(job).unwrap_or_default(),
                ..JobIndex::default()
            })
        });
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

    /// Set `job`'s reservation on this server to `reserved_bytes` (what the control plane packed
    /// here in the map of `epoch`; 0: none), unless a map of a later epoch set it already: from
    /// now on the other jobs' charges keep the part of it the job has not used free (see
    /// [`crate::capacity`]).
    pub fn set_reservation(&self, job: &str, epoch: u64, reserved_bytes: u64) {
        // Under the job map's lock, so that a bucket created meanwhile charges the same account.
        let jobs = self.shared.jobs.write().expect("job map lock poisoned");
        let account = jobs.get(job).map(|j| &j.account);
        self.shared
            .budget
            .set_reservation(job, epoch, reserved_bytes, account);
    }

    /// End `job`'s reservation on this server (the job's end): no share, whatever epoch set it.
    pub fn end_reservation(&self, job: &str) {
        let jobs = self.shared.jobs.write().expect("job map lock poisoned");
        let account = jobs.get(job).map(|j| &j.account);
        self.shared.budget.end_reservation(job, account);
    }

    /// `job`'s reservation on this server and what it holds here, in bytes.
    pub fn reservation(&self, job: &str) -> (u64, u64) {
        let jobs = self.shared.jobs.read().expect("job map lock poisoned");
        let account = jobs
            .get(job)
            .map(|j| Arc::clone(&j.account))
            .or_else(|| self.shared.budget.reserved_account(job));
        account.map_or((0, 0), |a| {
            (
                a.reserved_bytes.load(Ordering::Acquire),
                a.used_bytes.load(Ordering::Acquire),
            )
        })
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
}
