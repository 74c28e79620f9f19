//! Prefix leases: a job's prefixes (`stage/task`) that live while the job renews them.
//!
//! A lease covers every key that starts with `<prefix>/`, in every bucket of the job, with its
//! queues and append files. The job's driver renews many prefixes in one call (it expands each
//! renewal to the prefix's ancestors and descendants, so the server keeps a flat table); a lease
//! that is not renewed in time lapses, and the sweeper frees its prefix on this server at once.
//! A lease that lapsed or that the job ended stays in the table, ended, for one more lease, and
//! its prefix is freed again when that lapses: what a straggler wrote under it meanwhile is not
//! left for the job's whole life.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pocketflow_protocol::limits::{LEASE_MS_MAX, LEASE_MS_MIN, LEASE_PREFIXES_MAX};

use crate::error::StoreError;

/// Most leases one server holds (over all jobs).
pub const LEASES_MAX: usize = 65_536;

/// One lease: when it lapses, how long its last renewal was for, and whether the job ended it.
#[derive(Clone, Copy, Debug)]
struct Lease {
    expiry: Instant,
    lease_ms: u64,
    /// Ended by the job: its prefix was freed then, and the entry lingers one more lease so
    /// that what a straggler writes under it meanwhile is freed when it lapses.
    ended: bool,
}

/// The lease table of one server: (job, prefix) to its lease.
#[derive(Default)]
pub struct Leases {
    table: Mutex<BTreeMap<(String, String), Lease>>,
}

/// A lease taken off the table by [`Leases::take_lapsed`].
#[derive(Debug, PartialEq, Eq)]
pub struct Lapsed {
    /// The job that held it.
    pub job: String,
    /// Its prefix.
    pub prefix: String,
    /// The job had ended it: its prefix was freed then, and this frees only what was written
    /// under it since.
    pub ended: bool,
}

impl Leases {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<(String, String), Lease>> {
        self.table.lock().expect("lease table lock poisoned")
    }

    /// Renew (or start) the leases of `prefixes` of `job` for `lease_ms` from now; returns how
    /// many leases the job holds here afterwards.
    pub fn renew(
        &self,
        job: &str,
        prefixes: &[String],
        lease_ms: u64,
    ) -> Result<usize, StoreError> {
        if !(LEASE_MS_MIN..=LEASE_MS_MAX).contains(&lease_ms) {
            return Err(StoreError::InvalidChannelArgument {
                what: "lease_ms",
                value: lease_ms,
                min: LEASE_MS_MIN,
                max: LEASE_MS_MAX,
            });
        }
        if prefixes.is_empty() || prefixes.len() > LEASE_PREFIXES_MAX {
            return Err(StoreError::InvalidChannelArgument {
                what: "prefix count",
                value: prefixes.len() as u64,
                min: 1,
                max: LEASE_PREFIXES_MAX as u64,
            });
        }
        let expiry = Instant::now() + Duration::from_millis(lease_ms);
        let mut table = self.lock();
        let new = prefixes
            .iter()
            .filter(|p| !table.contains_key(&(job.to_string(), (*p).clone())))
            .count();
        if table.len() + new > LEASES_MAX {
            return Err(StoreError::CapacityExhausted {
                requested: new as u64,
                available: (LEASES_MAX - table.len()) as u64,
            });
        }
        for prefix in prefixes {
            // A renewal also revives a lease the job ended (declared again, or a renewal that
            // was on its way when the job ended it).
            let entry = table
                .entry((job.to_string(), prefix.clone()))
                .or_insert(Lease {
                    expiry,
                    lease_ms,
                    ended: false,
                });
            if entry.ended {
                *entry = Lease {
                    expiry,
                    lease_ms,
                    ended: false,
                };
            } else {
                entry.expiry = entry.expiry.max(expiry);
                entry.lease_ms = lease_ms;
            }
        }
        Ok(table
            .iter()
            .filter(|((j, _), lease)| j == job && !lease.ended)
            .count())
    }

    /// Return the leases that lapsed by `now` (the caller frees their prefixes). A live one
    /// stays in the table, ended, for one more lease from `now`, as [`Leases::end`] leaves
    /// one; an ended one leaves the table.
    pub fn take_lapsed(&self, now: Instant) -> Vec<Lapsed> {
        let mut table = self.lock();
        let mut lapsed = Vec::new();
        table.retain(|(job, prefix), lease| {
            if lease.expiry > now {
                return true;
            }
            lapsed.push(Lapsed {
                job: job.clone(),
                prefix: prefix.clone(),
                ended: lease.ended,
            });
            if lease.ended {
                return false;
            }
            lease.ended = true;
            lease.expiry = now + Duration::from_millis(lease.lease_ms);
            true
        });
        lapsed
    }

    /// End the leases of `prefixes` of `job` now and return those the job held (the caller
    /// frees them); prefixes without a live lease here are skipped. Each ended lease stays in
    /// the table, ended, for one more lease from now: what a straggler writes under it in that
    /// time is freed when it lapses, instead of living as long as the job.
    pub fn end(&self, job: &str, prefixes: &[String]) -> Vec<String> {
        let now = Instant::now();
        let mut table = self.lock();
        prefixes
            .iter()
            .filter(|p| match table.get_mut(&(job.to_string(), (*p).clone())) {
                Some(lease) if !lease.ended => {
                    lease.ended = true;
                    lease.expiry = now + Duration::from_millis(lease.lease_ms);
                    true
                }
                _ => false,
            })
            .cloned()
            .collect()
    }

    /// Forget every lease of `job` (its data is gone with it).
    pub fn forget_job(&self, job: &str) {
        self.lock().retain(|(j, _), _| j != job);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_lapse_unless_renewed_and_are_bounded() {
        let leases = Leases::default();
        let p = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(leases.renew("j", &p(&["map", "map/1"]), 100).unwrap(), 2);
        assert!(leases.renew("j", &p(&["x"]), 10).is_err());
        assert!(leases.renew("j", &[], 100).is_err());
        let later = Instant::now() + Duration::from_millis(150);
        leases.renew("j", &p(&["map"]), 1000).unwrap();
        let lapsed = |job: &str, prefix: &str, ended: bool| Lapsed {
            job: job.into(),
            prefix: prefix.into(),
            ended,
        };
        assert_eq!(leases.take_lapsed(later), vec![lapsed("j", "map/1", false)]);
        assert!(leases.take_lapsed(later).is_empty());
        // A lapsed lease lingers, ended, one more lease (100 ms), then leaves.
        assert_eq!(
            leases.take_lapsed(later + Duration::from_millis(100)),
            vec![lapsed("j", "map/1", true)]
        );
        // Ended: no longer counted, ended once, and it lapses one lease (1 s) after the end.
        assert_eq!(leases.end("j", &p(&["map", "nope"])), p(&["map"]));
        assert!(leases.end("j", &p(&["map"])).is_empty());
        assert_eq!(leases.renew("j", &p(&["other"]), 100).unwrap(), 1);
        assert_eq!(
            leases.take_lapsed(Instant::now() + Duration::from_millis(500)),
            vec![lapsed("j", "other", false)]
        );
        let much_later = Instant::now() + Duration::from_millis(1100);
        assert_eq!(
            leases.take_lapsed(much_later),
            vec![lapsed("j", "map", true), lapsed("j", "other", true)]
        );
        // A renewal revives an ended lease.
        leases.renew("j", &p(&["map"]), 100).unwrap();
        assert_eq!(leases.end("j", &p(&["map"])), p(&["map"]));
        assert_eq!(leases.renew("j", &p(&["map"]), 100).unwrap(), 1);
        leases.forget_job("j");
        assert!(leases
            .take_lapsed(later + Duration::from_secs(5))
            .is_empty());
    }
}
