//! Capacity accounting: the server-wide byte budget and per-job usage, charged by RAII guards.
//!
//! Every record and data block holds a [`Charge`] of its engine allocation plus a fixed index
//! overhead; the charge is released when the entry's last holder (the index, or a reader still
//! holding the bytes) drops it. The budget equals the engine's capacity, so `used_bytes` never
//! exceeds it and the index's memory is bounded by the capacity too.
//!
//! A slice of the budget, the *records' reserve* (1/64 of the capacity, at most 64 MiB), is
//! kept for records that carry no object data ([`ChargeKind::Record`]: a large object's
//! manifest, which may name the servers its blocks went to instead of this one). Data (small
//! objects' bytes, data blocks, queue items, append records) stops short of it. So a server whose
//! tier is full of data still takes the manifest of an object whose bytes a client wrote on
//! another tier, and readers, waiters and DELETE-on-read claims keep finding every key at its
//! home (docs/ARCHITECTURE.md, "Bigger than DRAM").

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{CapacityLimit, StoreError};

/// Bytes charged per index entry (record or data block) on top of its key length and engine
/// allocation, so that an unbounded number of empty objects cannot exhaust server memory: a
/// 0-byte object with a 10-byte key costs 74 bytes of the budget.
pub const INDEX_ENTRY_OVERHEAD_BYTES: u64 = 64;

/// The records' reserve is the capacity divided by this ...
pub const RECORD_RESERVE_DIVISOR: u64 = 64;
/// ... and at most this many bytes.
pub const RECORD_RESERVE_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// What a charge pays for, which decides how much of the budget it may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChargeKind {
    /// Object data: up to the capacity less the records' reserve.
    Data,
    /// A record without object data (a manifest): up to the whole capacity.
    Record,
}

/// The server-wide budget of chargeable bytes.
#[derive(Debug)]
pub(crate) struct Budget {
    capacity_bytes: u64,
    /// The records' reserve (see the module doc).
    reserve_bytes: u64,
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
            reserve_bytes: (capacity_bytes / RECORD_RESERVE_DIVISOR).min(RECORD_RESERVE_MAX_BYTES),
            used_bytes: AtomicU64::new(0),
        })
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    pub fn used_bytes(&self) -> u64 {
        self.used_bytes.load(Ordering::Acquire)
    }

    /// The most bytes charges of `kind` may hold together with everything else charged.
    fn limit_bytes(&self, kind: ChargeKind) -> u64 {
        match kind {
            ChargeKind::Data => self.capacity_bytes - self.reserve_bytes,
            ChargeKind::Record => self.capacity_bytes,
        }
    }

    /// Charge `bytes` of `kind` to `job`, or fail with `CapacityExhausted`, naming the limit it
    /// hit, and charge nothing.
    pub fn charge(
        self: &Arc<Self>,
        job: &Arc<JobAccount>,
        bytes: u64,
        kind: ChargeKind,
    ) -> Result<Charge, StoreError> {
        let limit = self.limit_bytes(kind);
        let reserved = self
            .used_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= limit)
            });
        if let Err(used) = reserved {
            return Err(StoreError::CapacityExhausted {
                requested: bytes,
                available: limit.saturating_sub(used),
                limit: match kind {
                    ChargeKind::Data => CapacityLimit::Data {
                        capacity_bytes: self.capacity_bytes,
                        reserve_bytes: self.reserve_bytes,
                    },
                    ChargeKind::Record => CapacityLimit::Records {
                        capacity_bytes: self.capacity_bytes,
                    },
                },
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
        // Capacity 6,400: 100 bytes of it are the records' reserve.
        let budget = Budget::new(6_400);
        let job = Arc::new(JobAccount::default());
        let a = budget.charge(&job, 6_000, ChargeKind::Data).unwrap();
        assert!(matches!(
            budget.charge(&job, 301, ChargeKind::Data),
            Err(StoreError::CapacityExhausted {
                requested: 301,
                available: 300,
                limit: CapacityLimit::Data {
                    capacity_bytes: 6_400,
                    reserve_bytes: 100
                }
            })
        ));
        let b = budget.charge(&job, 300, ChargeKind::Data).unwrap();
        // Data stops at the reserve; records go on into it, up to the capacity.
        assert!(budget.charge(&job, 1, ChargeKind::Data).is_err());
        let c = budget.charge(&job, 100, ChargeKind::Record).unwrap();
        assert!(matches!(
            budget.charge(&job, 1, ChargeKind::Record),
            Err(StoreError::CapacityExhausted {
                requested: 1,
                available: 0,
                limit: CapacityLimit::Records {
                    capacity_bytes: 6_400
                }
            })
        ));
        assert_eq!(
            (budget.used_bytes(), job.used_bytes.load(Ordering::Relaxed)),
            (6_400, 6_400)
        );
        drop(a);
        drop(b);
        drop(c);
        assert_eq!(
            (budget.used_bytes(), job.used_bytes.load(Ordering::Relaxed)),
            (0, 0)
        );
    }

    #[test]
    fn the_reserve_is_a_64th_of_the_capacity_at_most_64_mib() {
        assert_eq!(Budget::new(1 << 30).reserve_bytes, 16 << 20);
        assert_eq!(Budget::new(1 << 40).reserve_bytes, RECORD_RESERVE_MAX_BYTES);
        assert_eq!(Budget::new(100).reserve_bytes, 1);
    }
}
