//! Counts of refused writes by the bound they hit ([`CapacityLimit`]), server-wide and per job,
//! so that statistics and metrics say why writes overflowed (a full tier, fragmented free space,
//! other jobs' reservations) without anyone patching the server to find out.
//!
//! A refusal is already the slow path; counting it is one relaxed increment per counter, and
//! nothing is counted on an admitted write.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{CapacityLimit, StoreError};

/// Counters of refusals, one per [`CapacityLimit`] kind, in the order of [`CapacityLimit::NAMES`].
#[derive(Debug, Default)]
pub(crate) struct Refusals([AtomicU64; CapacityLimit::NAMES.len()]);

impl Refusals {
    /// Count `error` if it is a capacity refusal; any other error is not counted.
    pub fn count(&self, error: &StoreError) {
        if let StoreError::CapacityExhausted { limit, .. } = error {
            self.0[limit.index()].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The counts so far.
    pub fn counts(&self) -> RefusalCounts {
        let n = |limit: usize| self.0[limit].load(Ordering::Relaxed);
        RefusalCounts {
            data: n(0),
            records: n(1),
            reserved: n(2),
            extent: n(3),
            freeing: n(4),
        }
    }
}

/// Writes refused for want of room, by the bound they hit (see [`CapacityLimit`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RefusalCounts {
    /// The tier's room for data was full ([`CapacityLimit::Data`]).
    pub data: u64,
    /// The whole tier was full, the records' reserve too ([`CapacityLimit::Records`]).
    pub records: u64,
    /// The free room was held for other jobs' reservations ([`CapacityLimit::Reserved`]).
    pub reserved: u64,
    /// The bytes were free, but not in one extent ([`CapacityLimit::Extent`]).
    pub extent: u64,
    /// The room was held by deleted blocks still being written ([`CapacityLimit::Freeing`]).
    pub freeing: u64,
}

impl RefusalCounts {
    /// Each count with its limit's name ([`CapacityLimit::NAMES`]).
    pub fn by_name(&self) -> [(&'static str, u64); CapacityLimit::NAMES.len()] {
        let names = CapacityLimit::NAMES;
        [
            (names[0], self.data),
            (names[1], self.records),
            (names[2], self.reserved),
            (names[3], self.extent),
            (names[4], self.freeing),
        ]
    }

    /// All refusals together.
    pub fn total(&self) -> u64 {
        self.by_name().iter().map(|(_, n)| n).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_counted_under_their_limit_and_other_errors_not_at_all() {
        let refusals = Refusals::default();
        let full = |limit| StoreError::CapacityExhausted {
            requested: 10,
            available: 1,
            limit,
        };
        refusals.count(&full(CapacityLimit::Extent {
            largest_free_bytes: 4096,
        }));
        refusals.count(&full(CapacityLimit::Extent {
            largest_free_bytes: 0,
        }));
        refusals.count(&full(CapacityLimit::Records { capacity_bytes: 8 }));
        refusals.count(&StoreError::PersistRefused);
        let counts = refusals.counts();
        assert_eq!(
            counts,
            RefusalCounts {
                records: 1,
                extent: 2,
                ..RefusalCounts::default()
            }
        );
        assert_eq!(counts.total(), 3);
        assert_eq!(
            counts.by_name(),
            [
                ("data", 0),
                ("records", 1),
                ("reserved", 0),
                ("extent", 2),
                ("freeing", 0)
            ]
        );
    }
}
