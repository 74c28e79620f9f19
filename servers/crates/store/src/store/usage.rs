//! Capacity, usage and object counts of the server, in total and per job (statistics and the
//! drain check).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use super::Store;
use crate::capacity::JobAccount;
use crate::error::StoreError;
use crate::refusals::RefusalCounts;
use crate::throughput::Throughput;

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
    /// Channel entries in the index: queue and append-file segments, queue items and append
    /// records (their bytes are in `used_bytes`). A server holding any holds channel data.
    pub channel_entries: u64,
    /// Bytes of deleted blocks that their writes to the device still hold (NVMe write-behind;
    /// not in `used_bytes`): free once those writes complete.
    pub freeing_bytes: u64,
    /// Writes refused for want of room since the server started, by the limit they hit.
    pub refusals: RefusalCounts,
    /// The same per job, for every job with buckets or a reservation share on this server (at
    /// most [`crate::JOBS_MAX`] with buckets, plus those with only a share, one per job the
    /// service's epoch table holds).
    pub per_job: BTreeMap<String, JobUsage>,
}

/// Usage of one job.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct JobUsage {
    /// Bytes charged to the job.
    pub used_bytes: u64,
    /// Block-0 records of the job.
    pub objects: u64,
    /// Channel entries of the job (see [`Usage::channel_entries`]).
    pub channel_entries: u64,
    /// The job's share of its reservation on this server (0: none; see [`crate::capacity`]).
    pub reserved_bytes: u64,
    /// The job's writes refused for want of room, by the limit they hit, since its account was
    /// made here (its first bucket or share; forgotten with the job).
    pub refusals: RefusalCounts,
}

impl JobUsage {
    fn of(account: &JobAccount) -> Self {
        Self {
            used_bytes: account.used_bytes.load(Ordering::Acquire),
            objects: account.objects.load(Ordering::Acquire),
            channel_entries: account.channel_entries.load(Ordering::Acquire),
            reserved_bytes: account.reserved_bytes.load(Ordering::Acquire),
            refusals: account.refusals.counts(),
        }
    }
}

impl Store {
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

    /// Capacity, usage and object counts, in total and per job.
    pub fn usage(&self) -> Usage {
        // Jobs holding only a share here (no bucket) are listed too: their share keeps room
        // free for them, which the other jobs' refusals under `reserved` should be seen with.
        let mut per_job: BTreeMap<String, JobUsage> = self
            .shared
            .budget
            .reserved_accounts()
            .into_iter()
            .map(|(name, account)| (name, JobUsage::of(&account)))
            .collect();
        let jobs = self.shared.jobs.read().expect("job map lock poisoned");
        for (name, job) in jobs.iter() {
            per_job.insert(name.clone(), JobUsage::of(&job.account));
        }
        drop(jobs);
        Usage {
            capacity_bytes: self.capacity_bytes(),
            used_bytes: self.used_bytes(),
            objects: per_job.values().map(|j| j.objects).sum(),
            channel_entries: per_job.values().map(|j| j.channel_entries).sum(),
            freeing_bytes: self.shared.engine.freeing_bytes(),
            refusals: self.shared.budget.refusals().counts(),
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
