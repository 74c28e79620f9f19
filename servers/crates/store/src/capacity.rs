//! Capacity accounting: the server-wide byte budget and per-job usage, charged by RAII guards.
//!
//! Every record and data block holds a [`Charge`] of its engine allocation plus a fixed index
//! overhead; the charge is released when the entry's last holder (the index, or a reader still
//! holding the bytes) drops it. The budget equals the engine's capacity, so `used_bytes` never
//! exceeds it and the index's memory is bounded by the capacity too.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::StoreError;

/// Bytes charged per index entry (record or data block) on top of its key length and engine
/// allocation, so that an unbounded number of empty objects cannot exhaust server memory: a
/// 0-byte object with a 10-byte key costs 74 bytes of the budget.
pub const INDEX_ENTRY_OVERHEAD_BYTES: u64 = 64;

/// The server-wide budget of chargeable bytes.
#[derive(Debug)]
pub(crate) struct Budget {
    capacity_bytes: u64,
    used_bytes: AtomicU64,
}

/// Usage counters of one job; updated by charges and by the index.
#[derive(Debug, Default)]
pub(crate) struct JobAccount {
    /// Bytes charged to the job's entries, including entries only readers still hold.
    pub used_bytes: AtomicU64,
    /// Block-0 records in the index.
    pub objects: AtomicU64,
    /// Records and data blocks in the index.
    pub entries: AtomicU64,
    /// Of `entries`, the channels': queue and append-file segments, queue items and records.
    pub channel_entries: AtomicU64,
}

/// Bytes held against the budget and a job's usage; released on drop.
#[derive(Debug)]
pub(crate) struct Charge {
    bytes: u64,
    budget: Arc<Budget>,
    job: Arc<JobAccount>,
}

impl Budget {
    pub fn new(capacity_bytes: u64) -> Arc<Self> {
        Arc::new(Self {
            capacity_bytes,
            used_bytes: AtomicU64::new(0),
        })
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    pub fn used_bytes(&self) -> u64 {
        self.used_bytes.load(Ordering::Acquire)
    }

    /// Charge `bytes` to `job`, or fail with `CapacityExhausted` and charge nothing.
    pub fn charge(
        self: &Arc<Self>,
        job: &Arc<JobAccount>,
        bytes: u64,
    ) -> Result<Charge, StoreError> {
        let reserved = self
            .used_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes)
                    .filter(|&total| total <= self.capacity_bytes)
            });
        if let Err(used) = reserved {
            return Err(StoreError::CapacityExhausted {
                requested: bytes,
                available: self.capacity_bytes - used,
            });
        }
        job.used_bytes.fetch_add(bytes, Ordering::AcqRel);
        Ok(Charge {
            bytes,
            budget: Arc::clone(self),
            job: Arc::clone(job),
        })
    }
}

impl Charge {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let before = self
            .budget
            .used_bytes
            .fetch_sub(self.bytes, Ordering::AcqRel);
        assert!(
            before >= self.bytes,
            "budget released more than was charged"
        );
        self.job.used_bytes.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_are_bounded_and_released_on_drop() {
        let budget = Budget::new(100);
        let job = Arc::new(JobAccount::default());
        let a = budget.charge(&job, 60).unwrap();
        assert!(matches!(
            budget.charge(&job, 41),
            Err(StoreError::CapacityExhausted {
                requested: 41,
                available: 40
            })
        ));
        let b = budget.charge(&job, 40).unwrap();
        assert_eq!(
            (budget.used_bytes(), job.used_bytes.load(Ordering::Relaxed)),
            (100, 100)
        );
        drop(a);
        drop(b);
        assert_eq!(
            (budget.used_bytes(), job.used_bytes.load(Ordering::Relaxed)),
            (0, 0)
        );
    }
}
